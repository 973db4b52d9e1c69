// SPDX-License-Identifier: MIT OR Apache-2.0
//! Parity cases of the norms with a weight offset (Qwen3-Next's: weights stored centred on zero,
//! scaled by `1 + weight` summed in f32): the residual add + RMSNorm (`add_rmsnorm_f32res`) at
//! Qwen3-Next's hidden width (2048) for a decode row and a run, at 5120 (the rows in several
//! passes) and at 33 columns (the scalar path); the per-head QK-norm with RoPE and the cache
//! write (`qkv_rope_kv_write_bf16`) at Qwen3-Next's attention (16 q heads, 2 kv heads of 256, 64
//! rotated: the scalar path) for a decode token and a run, and at whole rotations of heads of
//! 128 and 256 (the vector path). Every weight is drawn around 0 and the offset is 1; the cases
//! at offset 0 are the other lists'.

use metrale_kernels::KernelAbi;
use metrale_kernels::ops::{AddRmsNorm, QkvRopeKvWrite};

use super::{
    Buffer, Case, OutputKind, Rng, bf16_normal, f32_bytes, i32_bytes, launch_of, rope_tables,
    shuffled,
};

/// The offset of every case here.
const OFFSET: f32 = 1.0;

/// A weight centred on zero, as Qwen3-Next's checkpoints store their norms.
fn centred_weight(rng: &mut Rng, n: usize) -> super::Init {
    bf16_normal(rng, n, 0.1)
}

/// Every case, in a fixed order.
pub(super) fn norm_offset_cases(rng: &mut Rng) -> Vec<Case> {
    let mut out = Vec::new();
    for &(rows, cols, with_input) in &[
        (1u32, 2048u32, true),
        (40, 2048, true),
        (5, 2048, false),
        (3, 5120, true),
        (2, 33, true),
    ] {
        out.push(add_rmsnorm_case(rng, rows, cols, with_input));
    }
    for &(tokens, q_heads, kv_heads, head_dim, rotary_dim) in &[
        (1u32, 16u32, 2u32, 256u32, 64u32),
        (40, 16, 2, 256, 64),
        (5, 8, 2, 128, 128),
        (3, 16, 2, 256, 256),
        // No rotation at all (Nemotron-H's attention): the norm alone.
        (4, 4, 2, 64, 0),
    ] {
        out.push(qkv_post_case(
            rng,
            (tokens, q_heads, kv_heads),
            head_dim,
            rotary_dim,
        ));
    }
    out
}

fn add_rmsnorm_case(rng: &mut Rng, rows: u32, cols: u32, with_input: bool) -> Case {
    let n = (rows * cols) as usize;
    let residual: Vec<f32> = (0..n).map(|_| 2.0 * rng.normal()).collect();
    Case {
        kernel: AddRmsNorm::NAME,
        gemm: None,
        allowance: None,
        shape: format!("rows={rows} cols={cols} input={with_input} weight_offset={OFFSET}"),
        buffers: vec![
            Buffer {
                init: vec![0; n * 2].into(),
                output: Some(OutputKind::Bf16),
            },
            Buffer {
                init: f32_bytes(&residual).into(),
                output: Some(OutputKind::F32),
            },
            Buffer {
                init: bf16_normal(rng, n, 2.0),
                output: None,
            },
            Buffer {
                init: centred_weight(rng, cols as usize),
                output: None,
            },
        ],
        build: Box::new(move |p| {
            launch_of(AddRmsNorm {
                out: p[0],
                residual: p[1],
                input: if with_input {
                    p[2]
                } else {
                    metrale_core::DevicePtr::NULL
                },
                weight: p[3],
                rows,
                cols,
                eps: 1e-6,
                weight_offset: OFFSET,
            })
        }),
    }
}

/// As the full- and partial-RoPE cases: positions random in a 4096-row table, token 2 past it
/// and token 1 with a negative slot (where there are more than 2 tokens), shuffled slots.
fn qkv_post_case(
    rng: &mut Rng,
    (tokens, q_heads, kv_heads): (u32, u32, u32),
    head_dim: u32,
    rotary_dim: u32,
) -> Case {
    let max_position = 4096u32;
    let (t, d) = (tokens as usize, head_dim as usize);
    let heads = (q_heads + 2 * kv_heads) as usize;
    let kv_row = kv_heads as usize * d;
    let num_slots = 2 * t + 3;
    let mut positions: Vec<i32> = (0..t)
        .map(|_| 1 + rng.below(u64::from(max_position) - 1) as i32)
        .collect();
    let mut slots = shuffled(rng, num_slots);
    slots.truncate(t);
    if t > 2 {
        positions[2] = max_position as i32 + 3;
        slots[1] = -1;
    }
    // rotary_dim 0 reads no table; one column keeps the buffers non-empty.
    let (cos, sin) = rope_tables(max_position, rotary_dim.max(2) as usize);
    let input = |init| Buffer { init, output: None };
    let mut buffers = vec![Buffer {
        init: vec![0; t * q_heads as usize * d * 2].into(),
        output: Some(OutputKind::Bf16),
    }];
    for _ in 0..2 {
        buffers.push(Buffer {
            init: bf16_normal(rng, num_slots * kv_row, 1.0),
            output: Some(OutputKind::Bf16),
        });
    }
    buffers.push(input(bf16_normal(rng, t * heads * d, 2.0)));
    buffers.push(input(centred_weight(rng, d)));
    buffers.push(input(centred_weight(rng, d)));
    buffers.push(input(i32_bytes(&positions).into()));
    buffers.push(input(i32_bytes(&slots).into()));
    buffers.push(input(f32_bytes(&cos).into()));
    buffers.push(input(f32_bytes(&sin).into()));
    Case {
        kernel: QkvRopeKvWrite::NAME,
        gemm: None,
        allowance: None,
        shape: format!(
            "tokens={tokens} heads={q_heads}/{kv_heads} d={head_dim} rotary={rotary_dim} \
             qk_norm=true weight_offset={OFFSET}"
        ),
        buffers,
        build: Box::new(move |p| {
            launch_of(QkvRopeKvWrite {
                q_out: p[0],
                k_cache: p[1],
                v_cache: p[2],
                qkv: p[3],
                q_norm: p[4],
                k_norm: p[5],
                positions: p[6],
                slots: p[7],
                cos: p[8],
                sin: p[9],
                tokens,
                q_heads,
                kv_heads,
                head_dim,
                rotary_dim,
                max_position,
                eps: 1e-6,
                weight_offset: OFFSET,
            })
        }),
    }
}
