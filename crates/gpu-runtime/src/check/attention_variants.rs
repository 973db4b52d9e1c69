// SPDX-License-Identifier: MIT OR Apache-2.0
//! Parity cases of the attention variants beside Llama's and Qwen3's: MiniMax-M2's QK-norm over
//! the whole q and k projections (`qk_norm_whole_bf16`, in place on the QKV product) and its
//! partial RoPE (`qkv_rope_kv_write_bf16` with `rotary_dim` below `head_dim`, the scalar path).
//! MiniMax-M2's widths (48 q heads, 8 kv heads of 128, 64 rotated) at decode and prefill, and the
//! edges: widths that are not multiples of the block, a rotation of 2 elements, per-head norms
//! beside a partial rotation.

use metrale_core::DevicePtr;
use metrale_kernels::KernelAbi;
use metrale_kernels::ops::{QkNormWhole, QkvRopeKvWrite};

use super::{
    Buffer, Case, OutputKind, Rng, bf16_normal, f32_bytes, i32_bytes, launch_of, norm_weight,
    rope_tables, shuffled,
};

/// Every case, in a fixed order.
pub(super) fn attention_variant_cases(rng: &mut Rng) -> Vec<Case> {
    let mut out = qk_norm_whole_cases(rng);
    out.extend(partial_rope_cases(rng));
    out
}

/// The whole-projection norm: MiniMax-M2 (q 6144, k 1024) at 1 and 300 tokens; 4 q heads and
/// 1 kv head of 96 (widths that do not fill the block's threads evenly), 7 tokens.
fn qk_norm_whole_cases(rng: &mut Rng) -> Vec<Case> {
    let mut out = Vec::new();
    for &(tokens, q_width, k_width) in &[(1u32, 6144u32, 1024u32), (300, 6144, 1024), (7, 384, 96)]
    {
        let row = q_width + 2 * k_width;
        out.push(Case {
            kernel: QkNormWhole::NAME,
            gemm: None,
            allowance: None,
            shape: format!("tokens={tokens} q={q_width} k={k_width}"),
            buffers: vec![
                Buffer {
                    init: bf16_normal(rng, (tokens * row) as usize, 2.0),
                    output: Some(OutputKind::Bf16),
                },
                Buffer {
                    init: norm_weight(rng, q_width as usize).into(),
                    output: None,
                },
                Buffer {
                    init: norm_weight(rng, k_width as usize).into(),
                    output: None,
                },
            ],
            build: Box::new(move |p| {
                launch_of(QkNormWhole {
                    qkv: p[0],
                    q_norm: p[1],
                    k_norm: p[2],
                    tokens,
                    q_width,
                    k_width,
                    row,
                    eps: 1e-6,
                })
            }),
        });
    }
    out
}

/// Partial RoPE with the cache write: MiniMax-M2's heads (48/8 of 128, 64 rotated, no per-head
/// norm: its norm ran before) at 1 and 300 tokens; 4/2 heads of 128 with 32 rotated and per-head
/// norms; 3/1 heads of 64 with 2 rotated. Tables of rotary_dim / 2 columns; as in the full-RoPE
/// cases, token 2 is past the table and token 1 has a negative slot.
fn partial_rope_cases(rng: &mut Rng) -> Vec<Case> {
    let mut out = Vec::new();
    for &(tokens, q_heads, kv_heads, head_dim, rotary_dim, norms) in &[
        (1u32, 48u32, 8u32, 128u32, 64u32, false),
        (300, 48, 8, 128, 64, false),
        (5, 4, 2, 128, 32, true),
        (4, 3, 1, 64, 2, false),
    ] {
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
        let (cos, sin) = rope_tables(max_position, rotary_dim as usize);
        let bf16_out = |n: usize| Buffer {
            init: vec![0; n * 2].into(),
            output: Some(OutputKind::Bf16),
        };
        let input = |init| Buffer { init, output: None };
        let mut buffers = vec![bf16_out(t * q_heads as usize * d)];
        for _ in 0..2 {
            buffers.push(Buffer {
                init: bf16_normal(rng, num_slots * kv_row, 1.0),
                output: Some(OutputKind::Bf16),
            });
        }
        buffers.push(input(bf16_normal(rng, t * heads * d, 2.0)));
        buffers.push(input(norm_weight(rng, d).into()));
        buffers.push(input(norm_weight(rng, d).into()));
        buffers.push(input(i32_bytes(&positions).into()));
        buffers.push(input(i32_bytes(&slots).into()));
        buffers.push(input(f32_bytes(&cos).into()));
        buffers.push(input(f32_bytes(&sin).into()));
        out.push(Case {
            kernel: QkvRopeKvWrite::NAME,
            gemm: None,
            allowance: None,
            shape: format!(
                "tokens={tokens} heads={q_heads}/{kv_heads} d={head_dim} rotary={rotary_dim} \
                 qk_norm={norms}"
            ),
            buffers,
            build: Box::new(move |p| {
                let norm = |ptr: DevicePtr| if norms { ptr } else { DevicePtr::NULL };
                launch_of(QkvRopeKvWrite {
                    q_out: p[0],
                    k_cache: p[1],
                    v_cache: p[2],
                    qkv: p[3],
                    q_norm: norm(p[4]),
                    k_norm: norm(p[5]),
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
                    weight_offset: 0.0,
                })
            }),
        });
    }
    out
}
