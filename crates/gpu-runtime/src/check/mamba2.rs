// SPDX-License-Identifier: MIT OR Apache-2.0
//! Parity cases of the Mamba-2 recurrence (`mamba2.cu`): at Nemotron-H-8B's widths (128 heads of
//! 64 channels, a state of 128, 8 groups) one decode row continuing and one fresh, a decode batch
//! of 4 on shuffled slots, a 40-token prefill run fresh and one continuing under a step limit
//! that clamps both ways, and a mixed step of runs of 23, 1, 1 and 17 tokens; x|B|C read as the
//! conv writes it (packed) and out of wider rows, dt read packed and out of in_proj's
//! 18560-element row. Then ragged small widths: one group for all heads, a head wider than the
//! block's 16 channels and not a multiple of them, a state not a multiple of the 32 values 8
//! lanes hold in one round, an empty run, one head a group, and steps on softplus's linear branch
//! (above 20).
//!
//! Each case says which of its runs start a sequence ([`Start`]): a fresh run (position 0) must
//! ignore its slot's old state, which is random and nonzero in every case, and a continuing one
//! must read it. Every state buffer holds more slots than the case touches, so a write to the
//! wrong slot shows as a difference; the state and `y` (f32: the gated norm reads it unrounded)
//! are compared with the f32 metric.

use metrale_kernels::KernelAbi;
use metrale_kernels::ops::Mamba2Recurrent;

use super::gated_delta::{Start, f32_normal, input, output, run_positions, run_starts};
use super::{Case, OutputKind, Rng, bf16_normal, f32_bytes, i32_bytes, launch_of};

/// The widths of one case.
#[derive(Clone, Copy, Debug)]
struct Shape {
    heads: u32,
    head_dim: u32,
    state_size: u32,
    groups: u32,
}

impl Shape {
    fn inner(&self) -> u32 {
        self.heads * self.head_dim
    }
    fn conv_channels(&self) -> u32 {
        self.inner() + 2 * self.groups * self.state_size
    }
}

/// Nemotron-H-8B's Mamba-2 layers.
const NEMOTRON_H_8B: Shape = Shape {
    heads: 128,
    head_dim: 64,
    state_size: 128,
    groups: 8,
};

/// How a case lays its inputs out and where its steps land.
#[derive(Clone, Copy, Debug)]
struct Layout {
    /// Elements from one token's x|B|C row to the next, beyond the packed width.
    xbc_pad: u32,
    /// Elements from one token's raw dt to the next (at least `heads`); the dt columns are the
    /// row's last `heads`, as in in_proj's output.
    dt_stride: u32,
    /// The step's clamp.
    dt_limit: (f32, f32),
    /// Put every step on softplus's linear branch (bias 22) instead of the model's range.
    big_steps: bool,
}

const PACKED: Layout = Layout {
    xbc_pad: 0,
    dt_stride: 0,
    dt_limit: (0.0, f32::INFINITY),
    big_steps: false,
};

impl Layout {
    fn dt_stride(&self, shape: Shape) -> u32 {
        self.dt_stride.max(shape.heads)
    }
}

/// Sequences of `lens` tokens in shuffled slots of `slots`.
fn recurrent_case(
    rng: &mut Rng,
    lens: &[u32],
    shape: Shape,
    layout: Layout,
    slots: u32,
    start: Start,
) -> Case {
    let Shape {
        heads,
        head_dim,
        state_size,
        groups,
    } = shape;
    let seqs = lens.len() as u32;
    let tokens: u32 = lens.iter().sum();
    let xbc_stride = shape.conv_channels() + layout.xbc_pad;
    let dt_stride = layout.dt_stride(shape);
    let dt_offset = dt_stride - heads;
    let starts = run_starts(lens);
    let seq_slots: Vec<i32> = super::shuffled(rng, slots as usize)[..lens.len()].to_vec();
    let positions = run_positions(lens, start);
    let h = heads as usize;
    // Rates 1 to 16 (A = -exp(a_log)), as Mamba-2 initialises them.
    let a_log: Vec<f32> = (0..h).map(|i| (1.0 + i as f32 % 16.0).ln()).collect();
    // Steps as the model's biases put them: softplus(dt_bias) log-uniform in [1e-3, 1e-1] (the
    // raw projection's N(0, 1) spreads them further), or all on the linear branch.
    let dt_bias: Vec<f32> = (0..h)
        .map(|_| {
            if layout.big_steps {
                22.0 + rng.uniform()
            } else {
                let dt = (1e-3f32.ln() + rng.uniform() * (1e-1f32.ln() - 1e-3f32.ln())).exp();
                dt.exp_m1().ln()
            }
        })
        .collect();
    let state = (slots * heads * head_dim * state_size) as usize;
    let (dt_min, dt_max) = layout.dt_limit;
    Case {
        kernel: Mamba2Recurrent::NAME,
        shape: format!(
            "lens={lens:?} heads={heads} head_dim={head_dim} state_size={state_size} \
             groups={groups} xbc_stride={xbc_stride} dt_stride={dt_stride} \
             dt_limit=[{dt_min}, {dt_max}] big_steps={} slots {seq_slots:?} of {slots} \
             start={start:?}",
            layout.big_steps
        ),
        buffers: vec![
            output(
                vec![0u8; (tokens * shape.inner()) as usize * 4].into(),
                OutputKind::F32,
            ),
            output(f32_normal(rng, state, 0.5), OutputKind::F32),
            input(bf16_normal(rng, (tokens * xbc_stride) as usize, 1.0)),
            input(bf16_normal(rng, (tokens * dt_stride) as usize, 1.0)),
            input(f32_bytes(&a_log).into()),
            input(f32_bytes(&dt_bias).into()),
            input(f32_normal(rng, h, 1.0)),
            input(i32_bytes(&starts).into()),
            input(i32_bytes(&seq_slots).into()),
            input(i32_bytes(&positions).into()),
        ],
        build: Box::new(move |p| {
            launch_of(Mamba2Recurrent {
                y: p[0],
                state: p[1],
                xbc: p[2],
                dt_raw: p[3].offset(dt_offset as usize * 2),
                a_log: p[4],
                dt_bias: p[5],
                d: p[6],
                seq_starts: p[7],
                slots: p[8],
                positions: p[9],
                seqs,
                heads,
                head_dim,
                state_size,
                groups,
                xbc_stride,
                dt_stride,
                dt_min,
                dt_max,
            })
        }),
        gemm: None,
        allowance: None,
    }
}

/// Every Mamba-2 case, in a fixed order.
pub(super) fn mamba2_cases(rng: &mut Rng) -> Vec<Case> {
    use Start::{Continuing, Fresh, Mixed};
    let s8 = NEMOTRON_H_8B;
    // in_proj's output row of Nemotron-H-8B: z (8192) | x|B|C (10240) | dt (128).
    let in_proj_row = Layout {
        dt_stride: s8.inner() + s8.conv_channels() + s8.heads,
        ..PACKED
    };
    let wide = Layout {
        xbc_pad: 24,
        ..in_proj_row
    };
    // Legacy Mamba-2 configs' time_step_limit-like bounds, inside the steps' spread.
    let clamped = Layout {
        dt_limit: (0.01, 0.05),
        ..in_proj_row
    };
    let shape = |heads, head_dim, state_size, groups| Shape {
        heads,
        head_dim,
        state_size,
        groups,
    };
    let ragged = Layout {
        xbc_pad: 5,
        dt_stride: 9,
        ..PACKED
    };
    let mut out = Vec::new();
    for (lens, shape, layout, slots, start) in [
        (&[1u32][..], s8, PACKED, 2u32, Continuing),
        (&[1][..], s8, in_proj_row, 2, Fresh),
        (&[1; 4][..], s8, wide, 6, Mixed),
        (&[40][..], s8, in_proj_row, 2, Fresh),
        (&[40][..], s8, clamped, 2, Continuing),
        (&[23, 1, 1, 17][..], s8, wide, 5, Mixed),
        // One group for all heads; head_dim 20 (a block of 16 channels and a partial one); a
        // state of 20 (lanes 5..8 of each channel idle, the float4 pieces ragged); an empty run.
        (&[3, 0, 5][..], shape(6, 20, 20, 1), ragged, 4, Mixed),
        // A head of 130 channels (9 blocks, the last with 2), one head a group, state 16.
        (&[7][..], shape(4, 130, 16, 4), ragged, 2, Continuing),
        // One group, a larger head and a state of 64, runs of 5 and 2.
        (&[5, 2][..], shape(16, 64, 64, 1), PACKED, 3, Mixed),
    ] {
        out.push(recurrent_case(rng, lens, shape, layout, slots, start));
    }
    // A decode batch of 8 with every step on softplus's linear branch (decay ~ 0: the state is
    // replaced by the token's write), 8 groups of one head.
    let big = Layout {
        big_steps: true,
        dt_stride: 11,
        ..PACKED
    };
    out.push(recurrent_case(
        rng,
        &[1; 8],
        shape(8, 8, 128, 8),
        big,
        10,
        Mixed,
    ));
    out
}

/// The chunked prefill's three launches, each on its own random inputs: at Nemotron-H-8B's widths,
/// one run of 300 tokens in chunks of 64 (the last of 44) and runs of 130, 1 and 70 in chunks of
/// 32 (a one-token run is one chunk), both with max_chunks 5 (scratch past a run's chunks must stay
/// untouched); carries from a continuing and a fresh sequence; and the ragged shape (head_dim 20,
/// state 20, one group). Built after every other case.
pub(super) fn mamba2_chunk_cases(rng: &mut Rng) -> Vec<Case> {
    use metrale_kernels::ops::{Mamba2ChunkCarry, Mamba2ChunkScan, Mamba2ChunkState};
    let s8 = NEMOTRON_H_8B;
    let ragged = Shape {
        heads: 6,
        head_dim: 20,
        state_size: 20,
        groups: 1,
    };
    let mut out = Vec::new();
    for (lens, shape, chunk_len, start) in [
        (&[300u32][..], s8, 64u32, Start::Continuing),
        (&[130, 1, 70][..], s8, 32, Start::Mixed),
        (&[9, 4][..], ragged, 4, Start::Fresh),
    ] {
        let max_chunks = 5u32;
        let seqs = lens.len() as u32;
        let tokens: u32 = lens.iter().sum();
        let Shape {
            heads,
            head_dim,
            state_size,
            groups,
        } = shape;
        let xbc_stride = shape.conv_channels() + 3;
        let dt_stride = heads + 7;
        let starts = run_starts(lens);
        let per_seq = (heads * head_dim * state_size) as usize;
        let scratch = seqs as usize * max_chunks as usize;
        let h = heads as usize;
        let a_log: Vec<f32> = (0..h).map(|i| (1.0 + i as f32 % 16.0).ln()).collect();
        let dt_bias: Vec<f32> = (0..h)
            .map(|_| {
                let dt = (1e-3f32.ln() + rng.uniform() * (1e-1f32.ln() - 1e-3f32.ln())).exp();
                dt.exp_m1().ln()
            })
            .collect();
        let label = format!(
            "lens={lens:?} heads={heads} head_dim={head_dim} state_size={state_size} \
             groups={groups} chunk_len={chunk_len} max_chunks={max_chunks}"
        );
        // Pass 1.
        let (a1, b1) = (a_log.clone(), dt_bias.clone());
        out.push(Case {
            kernel: Mamba2ChunkState::NAME,
            shape: label.clone(),
            buffers: vec![
                output(f32_normal(rng, scratch * per_seq, 0.5), OutputKind::F32),
                output(f32_normal(rng, scratch * h, 1.0), OutputKind::F32),
                input(bf16_normal(rng, (tokens * xbc_stride) as usize, 1.0)),
                input(bf16_normal(rng, (tokens * dt_stride) as usize, 1.0)),
                input(f32_bytes(&a1).into()),
                input(f32_bytes(&b1).into()),
                input(f32_normal(rng, h, 1.0)),
                input(i32_bytes(&starts).into()),
            ],
            build: Box::new(move |p| {
                launch_of(Mamba2ChunkState {
                    chunk_states: p[0],
                    chunk_decay: p[1],
                    xbc: p[2],
                    dt_raw: p[3].offset(7 * 2),
                    a_log: p[4],
                    dt_bias: p[5],
                    d: p[6],
                    seq_starts: p[7],
                    seqs,
                    heads,
                    head_dim,
                    state_size,
                    groups,
                    xbc_stride,
                    dt_stride,
                    dt_min: 0.0,
                    dt_max: f32::INFINITY,
                    chunk_len,
                    max_chunks,
                })
            }),
            gemm: None,
            allowance: None,
        });
        // Pass 2: decays in (0, 1], as products of exp(-dt A) are.
        let decay: Vec<f32> = (0..scratch * h)
            .map(|_| 0.05 + 0.95 * rng.uniform())
            .collect();
        let slots = 2 * seqs;
        let seq_slots: Vec<i32> = super::shuffled(rng, slots as usize)[..lens.len()].to_vec();
        let positions = run_positions(lens, start);
        out.push(Case {
            kernel: Mamba2ChunkCarry::NAME,
            shape: format!("{label} slots {seq_slots:?} of {slots} start={start:?}"),
            buffers: vec![
                output(f32_normal(rng, scratch * per_seq, 0.5), OutputKind::F32),
                input(f32_bytes(&decay).into()),
                output(
                    f32_normal(rng, slots as usize * per_seq, 0.5),
                    OutputKind::F32,
                ),
                input(i32_bytes(&starts).into()),
                input(i32_bytes(&seq_slots).into()),
                input(i32_bytes(&positions).into()),
            ],
            build: Box::new(move |p| {
                launch_of(Mamba2ChunkCarry {
                    chunk_states: p[0],
                    chunk_decay: p[1],
                    state: p[2],
                    seq_starts: p[3],
                    slots: p[4],
                    positions: p[5],
                    seqs,
                    heads,
                    head_dim,
                    state_size,
                    chunk_len,
                    max_chunks,
                })
            }),
            gemm: None,
            allowance: None,
        });
        // Pass 3.
        out.push(Case {
            kernel: Mamba2ChunkScan::NAME,
            shape: label,
            buffers: vec![
                output(
                    vec![0u8; (tokens * shape.inner()) as usize * 4].into(),
                    OutputKind::F32,
                ),
                input(f32_normal(rng, scratch * per_seq, 0.5)),
                input(bf16_normal(rng, (tokens * xbc_stride) as usize, 1.0)),
                input(bf16_normal(rng, (tokens * dt_stride) as usize, 1.0)),
                input(f32_bytes(&a_log).into()),
                input(f32_bytes(&dt_bias).into()),
                input(f32_normal(rng, h, 1.0)),
                input(i32_bytes(&starts).into()),
            ],
            build: Box::new(move |p| {
                launch_of(Mamba2ChunkScan {
                    y: p[0],
                    chunk_states: p[1],
                    xbc: p[2],
                    dt_raw: p[3].offset(7 * 2),
                    a_log: p[4],
                    dt_bias: p[5],
                    d: p[6],
                    seq_starts: p[7],
                    seqs,
                    heads,
                    head_dim,
                    state_size,
                    groups,
                    xbc_stride,
                    dt_stride,
                    dt_min: 0.0,
                    dt_max: f32::INFINITY,
                    chunk_len,
                    max_chunks,
                })
            }),
            gemm: None,
            allowance: None,
        });
    }
    out
}
