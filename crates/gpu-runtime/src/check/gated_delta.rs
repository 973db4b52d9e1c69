// SPDX-License-Identifier: MIT OR Apache-2.0
//! Parity cases of the Gated DeltaNet kernels (`gated_delta.cu`): the short conv at
//! Qwen3-Next-80B-A3B's 8192 q|k|v channels and width 4 (a decode row, a decode batch on shuffled
//! slots, a 40-token prefill run, a mixed step of runs of 23, 1, 1 and 17 tokens), its input read
//! out of the 12352-element row of the merged qkvz|ba projection as well as packed, ragged
//! channel counts and strides, widths 2 and 8, runs shorter than the conv's taps (the new state
//! reaching back into the old, or into zeros), empty and of several chunks with a partial last;
//! the gated delta rule at Qwen3-Next's widths (32 value heads over 16 key heads, dk = dv = 128:
//! one decode row, a decode batch of 8, a 40-token prefill run, two sequences of different lengths
//! in different slots) and at ragged small widths (dk not a multiple of the lanes, dv not a
//! multiple of a block's 16 columns, an empty run, one key head for all); the gating with its rows
//! packed and spread.
//!
//! Each conv and recurrent case says which of its runs start a sequence ([`Start`]): a fresh run
//! (position 0) must ignore its slot's old state, which is random and nonzero in every case, and
//! a continuing one must read it. Every state buffer holds more slots than the case touches, so a
//! write to the wrong slot shows as a difference; the recurrent state is compared with the f32
//! metric, outputs with bf16's. The chunked prefill's two launches have cases of their own
//! ([`gdn_chunk_cases`]), and so have their tensor-core forms ([`gdn_chunk_tc_cases`]).

use metrale_kernels::KernelAbi;
use metrale_kernels::ops::{
    GdnChunkPrep, GdnChunkPrepTc, GdnChunkScan, GdnChunkScanTc, GdnConv1d, GdnConv1dStep,
    GdnGating, GdnRecurrent,
};

use super::{Buffer, Case, Init, OutputKind, Rng, bf16_normal, f32_bytes, i32_bytes, launch_of};

pub(super) fn output(init: Init, kind: OutputKind) -> Buffer {
    Buffer {
        init,
        output: Some(kind),
    }
}

pub(super) fn input(init: Init) -> Buffer {
    Buffer { init, output: None }
}

/// `n` f32 values of N(0, scale²), drawn on first read (as [`bf16_normal`]).
pub(super) fn f32_normal(rng: &mut Rng, n: usize, scale: f32) -> Init {
    let mut from = rng.clone();
    rng.skip(2 * n as u64);
    Init::new(move || {
        let v: Vec<f32> = (0..n).map(|_| from.normal() * scale).collect();
        f32_bytes(&v)
    })
}

fn bias_or_null(bias: bool, p: metrale_core::DevicePtr) -> metrale_core::DevicePtr {
    if bias {
        p
    } else {
        metrale_core::DevicePtr::NULL
    }
}

/// Which runs of a case start their sequence: a fresh run's first token is at position 0 (its
/// states read as zeros, its slot's old contents ignored), a continuing run's at a later one.
#[derive(Clone, Copy, Debug)]
pub(super) enum Start {
    /// Every run continues its sequence.
    Continuing,
    /// Every run starts its sequence.
    Fresh,
    /// Even-numbered runs start their sequence, odd-numbered ones continue theirs.
    Mixed,
}

impl Start {
    fn is_fresh(self, run: usize) -> bool {
        match self {
            Start::Continuing => false,
            Start::Fresh => true,
            Start::Mixed => run.is_multiple_of(2),
        }
    }
}

/// Each token's position for runs of `lens`: a fresh run counts from 0, continuing run `s` from
/// `7 + 13 s`.
pub(super) fn run_positions(lens: &[u32], start: Start) -> Vec<i32> {
    let mut out = Vec::new();
    for (s, &len) in lens.iter().enumerate() {
        let first = if start.is_fresh(s) {
            0
        } else {
            7 + 13 * s as i32
        };
        out.extend((0..len as i32).map(|t| first + t));
    }
    out
}

/// The widths of one conv case: `x_stride` elements from one token's input row to the next.
#[derive(Clone, Copy)]
struct Conv {
    channels: u32,
    x_stride: u32,
    kernel: u32,
}

/// Qwen3-Next-80B-A3B's conv (8192 q|k|v channels, width 4) reading the q|k|v columns out of the
/// merged qkvz|ba projection's row (12288 + 64 elements).
const QWEN3_NEXT_CONV_MERGED: Conv = Conv {
    channels: 8192,
    x_stride: 12352,
    kernel: 4,
};
/// The same conv on a packed input.
const QWEN3_NEXT_CONV: Conv = Conv {
    channels: 8192,
    x_stride: 8192,
    kernel: 4,
};

const fn conv(channels: u32, x_stride: u32, kernel: u32) -> Conv {
    Conv {
        channels,
        x_stride,
        kernel,
    }
}

fn conv_step_case(
    rng: &mut Rng,
    rows: u32,
    shape: Conv,
    slots: u32,
    bias: bool,
    start: Start,
) -> Case {
    let Conv {
        channels,
        x_stride,
        kernel,
    } = shape;
    let taps = (kernel - 1) as usize;
    let n = (rows * channels) as usize;
    let row_slots: Vec<i32> = super::shuffled(rng, slots as usize)[..rows as usize].to_vec();
    let positions = run_positions(&vec![1; rows as usize], start);
    Case {
        kernel: GdnConv1dStep::NAME,
        shape: format!(
            "rows={rows} channels={channels} x_stride={x_stride} kernel={kernel} slots={slots} \
             bias={bias} at {row_slots:?} start={start:?}"
        ),
        buffers: vec![
            output(vec![0u8; n * 2].into(), OutputKind::Bf16),
            input(bf16_normal(rng, (rows * x_stride) as usize, 1.0)),
            output(
                bf16_normal(rng, slots as usize * taps * channels as usize, 1.0),
                OutputKind::Bf16,
            ),
            input(bf16_normal(rng, (channels * kernel) as usize, 0.5)),
            input(bf16_normal(rng, channels as usize, 0.5)),
            input(i32_bytes(&row_slots).into()),
            input(i32_bytes(&positions).into()),
        ],
        build: Box::new(move |p| {
            launch_of(GdnConv1dStep {
                out: p[0],
                x: p[1],
                conv_state: p[2],
                weight: p[3],
                bias: bias_or_null(bias, p[4]),
                slots: p[5],
                positions: p[6],
                rows,
                channels,
                x_stride,
                kernel,
            })
        }),
        gemm: None,
        allowance: None,
    }
}

/// Runs of `lens` tokens in shuffled slots of `slots`.
fn conv_run_case(
    rng: &mut Rng,
    lens: &[u32],
    shape: Conv,
    slots: u32,
    bias: bool,
    start: Start,
) -> Case {
    let Conv {
        channels,
        x_stride,
        kernel,
    } = shape;
    let taps = (kernel - 1) as usize;
    let seqs = lens.len() as u32;
    let max_len = lens.iter().copied().max().unwrap_or(0);
    let starts = run_starts(lens);
    let tokens = *starts.last().unwrap() as usize;
    let n = tokens * channels as usize;
    let run_slots: Vec<i32> = super::shuffled(rng, slots as usize)[..lens.len()].to_vec();
    let positions = run_positions(lens, start);
    Case {
        kernel: GdnConv1d::NAME,
        shape: format!(
            "lens={lens:?} channels={channels} x_stride={x_stride} kernel={kernel} \
             slots {run_slots:?} of {slots} bias={bias} start={start:?}"
        ),
        buffers: vec![
            output(vec![0u8; n * 2].into(), OutputKind::Bf16),
            input(bf16_normal(rng, tokens * x_stride as usize, 1.0)),
            output(
                bf16_normal(rng, slots as usize * taps * channels as usize, 1.0),
                OutputKind::Bf16,
            ),
            input(bf16_normal(rng, (channels * kernel) as usize, 0.5)),
            input(bf16_normal(rng, channels as usize, 0.5)),
            input(i32_bytes(&starts).into()),
            input(i32_bytes(&run_slots).into()),
            input(i32_bytes(&positions).into()),
        ],
        build: Box::new(move |p| {
            launch_of(GdnConv1d {
                out: p[0],
                x: p[1],
                conv_state: p[2],
                weight: p[3],
                bias: bias_or_null(bias, p[4]),
                seq_starts: p[5],
                slots: p[6],
                positions: p[7],
                seqs,
                max_len,
                channels,
                x_stride,
                kernel,
            })
        }),
        gemm: None,
        allowance: None,
    }
}

/// Each run's first token, then the total.
pub(super) fn run_starts(lens: &[u32]) -> Vec<i32> {
    let mut starts = vec![0i32];
    for len in lens {
        starts.push(starts.last().unwrap() + *len as i32);
    }
    starts
}

/// The widths of one recurrent case.
#[derive(Clone, Copy)]
struct Heads {
    hv: u32,
    hk: u32,
    dk: u32,
    dv: u32,
}

/// Sequences of `lens` tokens in shuffled slots of `slots`; q | k | v in one row a token, as
/// the conv writes them.
fn recurrent_case(rng: &mut Rng, lens: &[u32], heads: Heads, slots: u32, start: Start) -> Case {
    let Heads { hv, hk, dk, dv } = heads;
    let seqs = lens.len() as u32;
    let tokens: u32 = lens.iter().sum();
    let stride = 2 * hk * dk + hv * dv;
    let starts = run_starts(lens);
    let seq_slots: Vec<i32> = super::shuffled(rng, slots as usize)[..lens.len()].to_vec();
    let positions = run_positions(lens, start);
    // Decays from exp(-2) to exp(-0.01), write strengths in (0, 1), as the model's gates land.
    let gates = (tokens * hv) as usize;
    let g: Vec<f32> = (0..gates).map(|_| -0.01 - 2.0 * rng.uniform()).collect();
    let beta: Vec<f32> = (0..gates).map(|_| rng.uniform()).collect();
    let state = (slots * hv * dk * dv) as usize;
    Case {
        kernel: GdnRecurrent::NAME,
        shape: format!(
            "lens={lens:?} hv={hv} hk={hk} dk={dk} dv={dv} slots {seq_slots:?} of {slots} \
             start={start:?}"
        ),
        buffers: vec![
            output(
                vec![0u8; (tokens * hv * dv) as usize * 2].into(),
                OutputKind::Bf16,
            ),
            output(f32_normal(rng, state, 0.5), OutputKind::F32),
            input(bf16_normal(rng, (tokens * stride) as usize, 1.0)),
            input(f32_bytes(&g).into()),
            input(f32_bytes(&beta).into()),
            input(i32_bytes(&starts).into()),
            input(i32_bytes(&seq_slots).into()),
            input(i32_bytes(&positions).into()),
        ],
        build: Box::new(move |p| {
            let bf16_at = |elements: u32| p[2].offset(elements as usize * 2);
            launch_of(GdnRecurrent {
                o: p[0],
                state: p[1],
                q: p[2],
                k: bf16_at(hk * dk),
                v: bf16_at(2 * hk * dk),
                g: p[3],
                beta: p[4],
                seq_starts: p[5],
                slots: p[6],
                positions: p[7],
                seqs,
                hv,
                hk,
                dk,
                dv,
                qkv_stride: stride,
            })
        }),
        gemm: None,
        allowance: None,
    }
}

/// Every Gated DeltaNet case, in a fixed order.
pub(super) fn gated_delta_cases(rng: &mut Rng) -> Vec<Case> {
    // Qwen3-Next-80B-A3B: 16 key heads and 32 value heads of 128, so 8192 q|k|v channels.
    const QWEN3_NEXT: Heads = Heads {
        hv: 32,
        hk: 16,
        dk: 128,
        dv: 128,
    };
    use Start::{Continuing, Fresh, Mixed};
    let mut out = Vec::new();
    for (rows, shape, slots, bias, start) in [
        (1u32, QWEN3_NEXT_CONV_MERGED, 4u32, false, Continuing),
        (1, QWEN3_NEXT_CONV, 4, false, Fresh),
        (8, QWEN3_NEXT_CONV_MERGED, 16, false, Mixed),
        (3, conv(100, 131, 4), 5, true, Mixed),
        (2, conv(37, 37, 2), 3, true, Fresh),
        (1, conv(300, 300, 8), 2, false, Continuing),
    ] {
        out.push(conv_step_case(rng, rows, shape, slots, bias, start));
    }
    for (lens, shape, slots, bias, start) in [
        (&[40u32][..], QWEN3_NEXT_CONV_MERGED, 4u32, false, Fresh),
        (&[40][..], QWEN3_NEXT_CONV, 4, false, Continuing),
        (&[1][..], QWEN3_NEXT_CONV_MERGED, 2, false, Continuing),
        (&[23, 1, 1, 17][..], QWEN3_NEXT_CONV_MERGED, 6, false, Mixed),
        (&[2][..], conv(100, 100, 4), 3, true, Fresh),
        (&[2][..], conv(100, 131, 4), 3, true, Continuing),
        (&[17, 0, 2][..], conv(70, 70, 4), 4, true, Mixed),
        (&[33][..], conv(300, 301, 8), 1, false, Fresh),
        (&[5, 1][..], conv(37, 40, 2), 2, true, Mixed),
    ] {
        out.push(conv_run_case(rng, lens, shape, slots, bias, start));
    }
    for (lens, heads, slots, start) in [
        (&[1u32][..], QWEN3_NEXT, 2u32, Continuing),
        (&[1][..], QWEN3_NEXT, 2, Fresh),
        (&[1; 8][..], QWEN3_NEXT, 10, Mixed),
        (&[40][..], QWEN3_NEXT, 2, Fresh),
        (&[23, 17][..], QWEN3_NEXT, 3, Mixed),
        (
            &[3, 0, 5][..],
            Heads {
                hv: 6,
                hk: 2,
                dk: 40,
                dv: 24,
            },
            4,
            Mixed,
        ),
        (
            &[7][..],
            Heads {
                hv: 2,
                hk: 2,
                dk: 100,
                dv: 50,
            },
            1,
            Continuing,
        ),
        (
            &[5, 2][..],
            Heads {
                hv: 4,
                hk: 1,
                dk: 16,
                dv: 8,
            },
            3,
            Mixed,
        ),
    ] {
        out.push(recurrent_case(rng, lens, heads, slots, start));
    }
    out
}

/// The gating at Qwen3-Next's heads (32 value over 16 key) for one decode row and a 40-token run,
/// its `ba` rows packed (`2 hv` apart) and as the merged qkvz|ba projection spreads them (12352
/// apart), and ragged head groupings and strides; `a` spread so that softplus meets its linear
/// branch (above 20).
pub(super) fn gating_cases(rng: &mut Rng) -> Vec<Case> {
    let mut out = Vec::new();
    for (tokens, hv, hk, ba_stride) in [
        (1u32, 32u32, 16u32, 64u32),
        (1, 32, 16, 12352),
        (40, 32, 16, 12352),
        (7, 6, 2, 12),
        (3, 4, 4, 13),
        (5, 3, 1, 6),
    ] {
        let (t, h) = (tokens as usize, hv as usize);
        let a_log: Vec<f32> = (0..h).map(|i| (1.0 + i as f32 % 16.0).ln()).collect();
        out.push(Case {
            kernel: GdnGating::NAME,
            gemm: None,
            allowance: None,
            shape: format!("tokens={tokens} hv={hv} hk={hk} ba_stride={ba_stride}"),
            buffers: vec![
                output(vec![0u8; t * h * 4].into(), OutputKind::F32),
                output(vec![0u8; t * h * 4].into(), OutputKind::F32),
                input(bf16_normal(rng, t * ba_stride as usize, 8.0)),
                input(f32_bytes(&a_log).into()),
                input(f32_normal(rng, h, 1.0)),
            ],
            build: Box::new(move |p| {
                launch_of(GdnGating {
                    g: p[0],
                    beta: p[1],
                    ba: p[2],
                    a_log: p[3],
                    dt_bias: p[4],
                    tokens,
                    hv,
                    hk,
                    ba_stride,
                })
            }),
        });
    }
    out
}

/// The chunked prefill's launches at one shape: `lens` tokens a run, chunks of `chunk_len`, and
/// a grid of `max_chunks` chunks.
struct ChunkCase {
    lens: &'static [u32],
    heads: Heads,
    chunk_len: u32,
    max_chunks: u32,
    slots: u32,
    start: Start,
}

/// The chunked prefill's two launches (`gdn_chunk_prep`, `gdn_chunk_scan`), each on its own
/// random inputs: at Qwen3-Next's widths (32 value heads over 16 key heads, dk = dv = 128) one
/// continuing run of 300 tokens in chunks of 64 (the last of 44) and runs of 130, 1 and 70 (a
/// one-token run is one chunk; fresh and continuing) with a grid wider than their chunks; then
/// ragged small widths (dk and dv not multiples of four or of a scan block's 16 columns, an empty
/// run, short chunks, one key head for all). The scan's `T` and `P` are the prep's host
/// reference over the scan case's own inputs, as the engine chains them (random ones would not
/// be the inverse the walk relies on to stay bounded). Built after every other case.
pub(super) fn gdn_chunk_cases(rng: &mut Rng) -> Vec<Case> {
    const QWEN3_NEXT: Heads = Heads {
        hv: 32,
        hk: 16,
        dk: 128,
        dv: 128,
    };
    use Start::{Continuing, Fresh, Mixed};
    let shapes = [
        ChunkCase {
            lens: &[300],
            heads: QWEN3_NEXT,
            chunk_len: 64,
            max_chunks: 5,
            slots: 2,
            start: Continuing,
        },
        ChunkCase {
            lens: &[130, 1, 70],
            heads: QWEN3_NEXT,
            chunk_len: 64,
            max_chunks: 4,
            slots: 4,
            start: Mixed,
        },
        ChunkCase {
            lens: &[9, 0, 4],
            heads: Heads {
                hv: 6,
                hk: 2,
                dk: 40,
                dv: 24,
            },
            chunk_len: 4,
            max_chunks: 3,
            slots: 4,
            start: Mixed,
        },
        ChunkCase {
            lens: &[70],
            heads: Heads {
                hv: 2,
                hk: 2,
                dk: 100,
                dv: 50,
            },
            chunk_len: 64,
            max_chunks: 2,
            slots: 1,
            start: Continuing,
        },
        ChunkCase {
            lens: &[23, 17],
            heads: Heads {
                hv: 4,
                hk: 1,
                dk: 18,
                dv: 9,
            },
            chunk_len: 7,
            max_chunks: 4,
            slots: 3,
            start: Fresh,
        },
    ];
    let mut out = Vec::new();
    for shape in shapes {
        out.push(chunk_prep_case(rng, &shape, Pair::CudaCores));
        out.push(chunk_scan_case(rng, &shape, Pair::CudaCores));
    }
    out
}

/// Which pair of chunked launches a case runs: the f32 CUDA-core one or its tensor-core form
/// (the same arguments; the tensor-core scan reads the tensor-core prep's `T` and `P`).
#[derive(Clone, Copy, PartialEq)]
enum Pair {
    CudaCores,
    TensorCores,
}

/// The tensor-core forms of the chunked prefill (`gdn_chunk_prep_tc`, `gdn_chunk_scan_tc`), each
/// against its host reference, which rounds the same operands to bf16: at Qwen3.5-35B-A3B's and
/// Qwen3-Next-80B-A3B's widths (32 value heads over 16 key heads, dk = dv = 128) one continuing
/// run of 300 tokens (a ragged last chunk of 44), runs of 130, 1 and 70 (fresh and continuing,
/// a grid wider than their chunks) and one continuing run of 520 (nine chunks, the last of 8:
/// the state carried through many); three value heads a key head (48 over 16) on runs of 200 and
/// 64; then the CUDA-core cases' ragged small widths (dk and dv not multiples of 16, an m-tile's
/// or a scan block's width; an empty run; short chunks; one key head for all). Built after every
/// other case.
pub(super) fn gdn_chunk_tc_cases(rng: &mut Rng) -> Vec<Case> {
    const QWEN35: Heads = Heads {
        hv: 32,
        hk: 16,
        dk: 128,
        dv: 128,
    };
    use Start::{Continuing, Fresh, Mixed};
    let shapes = [
        ChunkCase {
            lens: &[300],
            heads: QWEN35,
            chunk_len: 64,
            max_chunks: 5,
            slots: 2,
            start: Continuing,
        },
        ChunkCase {
            lens: &[130, 1, 70],
            heads: QWEN35,
            chunk_len: 64,
            max_chunks: 4,
            slots: 4,
            start: Mixed,
        },
        ChunkCase {
            lens: &[520],
            heads: QWEN35,
            chunk_len: 64,
            max_chunks: 9,
            slots: 3,
            start: Continuing,
        },
        ChunkCase {
            lens: &[200, 64],
            heads: Heads {
                hv: 48,
                hk: 16,
                dk: 128,
                dv: 128,
            },
            chunk_len: 64,
            max_chunks: 4,
            slots: 2,
            start: Continuing,
        },
        ChunkCase {
            lens: &[9, 0, 4],
            heads: Heads {
                hv: 6,
                hk: 2,
                dk: 40,
                dv: 24,
            },
            chunk_len: 4,
            max_chunks: 3,
            slots: 4,
            start: Mixed,
        },
        ChunkCase {
            lens: &[70],
            heads: Heads {
                hv: 2,
                hk: 2,
                dk: 100,
                dv: 50,
            },
            chunk_len: 64,
            max_chunks: 2,
            slots: 1,
            start: Continuing,
        },
        ChunkCase {
            lens: &[23, 17],
            heads: Heads {
                hv: 4,
                hk: 1,
                dk: 18,
                dv: 9,
            },
            chunk_len: 7,
            max_chunks: 4,
            slots: 3,
            start: Fresh,
        },
    ];
    let mut out = Vec::new();
    for shape in shapes {
        out.push(chunk_prep_case(rng, &shape, Pair::TensorCores));
        out.push(chunk_scan_case(rng, &shape, Pair::TensorCores));
    }
    out
}

/// What both launches of a chunk case read: q | k | v rows (with three elements of padding),
/// `g` and `beta`, and the runs' starts.
struct ChunkInputs {
    qkv: Buffer,
    g: Buffer,
    beta: Buffer,
    starts: Buffer,
    stride: u32,
    tokens: usize,
}

fn chunk_inputs(rng: &mut Rng, shape: &ChunkCase) -> ChunkInputs {
    let Heads { hv, hk, dk, dv } = shape.heads;
    let tokens: u32 = shape.lens.iter().sum();
    let stride = 2 * hk * dk + hv * dv + 3;
    // Decays from exp(-2) to exp(-0.01), write strengths in (0, 1), as the model's gates land.
    let gates = (tokens * hv) as usize;
    let g: Vec<f32> = (0..gates).map(|_| -0.01 - 2.0 * rng.uniform()).collect();
    let beta: Vec<f32> = (0..gates).map(|_| rng.uniform()).collect();
    ChunkInputs {
        qkv: input(bf16_normal(rng, (tokens * stride) as usize, 1.0)),
        g: input(f32_bytes(&g).into()),
        beta: input(f32_bytes(&beta).into()),
        starts: input(i32_bytes(&run_starts(shape.lens)).into()),
        stride,
        tokens: tokens as usize,
    }
}

/// What the prep's arguments take from a case besides its buffers.
#[derive(Clone, Copy)]
struct PrepGrid {
    seqs: u32,
    heads: Heads,
    chunk_len: u32,
    max_chunks: u32,
    stride: u32,
}

impl PrepGrid {
    fn of(shape: &ChunkCase, stride: u32) -> PrepGrid {
        PrepGrid {
            seqs: shape.lens.len() as u32,
            heads: shape.heads,
            chunk_len: shape.chunk_len,
            max_chunks: shape.max_chunks,
            stride,
        }
    }

    /// The prep's arguments over `p`: `T`, `P`, the q | k | v rows, `g`, `beta`, the starts.
    fn args(self, p: &[metrale_core::DevicePtr]) -> GdnChunkPrep {
        let Heads { hv, hk, dk, .. } = self.heads;
        GdnChunkPrep {
            t_mat: p[0],
            attn: p[1],
            q: p[2],
            k: p[2].offset((hk * dk) as usize * 2),
            g: p[3],
            beta: p[4],
            seq_starts: p[5],
            seqs: self.seqs,
            hv,
            hk,
            dk,
            qkv_stride: self.stride,
            chunk_len: self.chunk_len,
            max_chunks: self.max_chunks,
        }
    }
}

fn chunk_label(shape: &ChunkCase) -> String {
    let Heads { hv, hk, dk, dv } = shape.heads;
    format!(
        "lens={:?} hv={hv} hk={hk} dk={dk} dv={dv} chunk_len={} max_chunks={}",
        shape.lens, shape.chunk_len, shape.max_chunks
    )
}

fn chunk_prep_case(rng: &mut Rng, shape: &ChunkCase, pair: Pair) -> Case {
    let x = chunk_inputs(rng, shape);
    let scratch = x.tokens * (shape.heads.hv * shape.chunk_len) as usize;
    let grid = PrepGrid::of(shape, x.stride);
    Case {
        kernel: match pair {
            Pair::CudaCores => GdnChunkPrep::NAME,
            Pair::TensorCores => GdnChunkPrepTc::NAME,
        },
        shape: chunk_label(shape),
        buffers: vec![
            // Junk where every row is written.
            output(f32_normal(rng, scratch, 1.0), OutputKind::F32),
            output(f32_normal(rng, scratch, 1.0), OutputKind::F32),
            x.qkv,
            x.g,
            x.beta,
            x.starts,
        ],
        build: Box::new(move |p| match pair {
            Pair::CudaCores => launch_of(grid.args(p)),
            Pair::TensorCores => launch_of(GdnChunkPrepTc(grid.args(p))),
        }),
        gemm: None,
        allowance: None,
    }
}

fn chunk_scan_case(rng: &mut Rng, shape: &ChunkCase, pair: Pair) -> Case {
    use std::cell::LazyCell;
    use std::rc::Rc;
    let x = chunk_inputs(rng, shape);
    let Heads { hv, hk, dk, dv } = shape.heads;
    let scratch = x.tokens * (hv * shape.chunk_len) as usize;
    let seq_slots: Vec<i32> =
        super::shuffled(rng, shape.slots as usize)[..shape.lens.len()].to_vec();
    let positions = run_positions(shape.lens, shape.start);
    let state = (shape.slots * hv * dk * dv) as usize;
    // T and P: the prep's host reference over this case's inputs, worked out on first read.
    let grid = PrepGrid::of(shape, x.stride);
    let (chunk_len, max_chunks, stride) = (shape.chunk_len, shape.max_chunks, x.stride);
    let prep_buffers = vec![
        output(vec![0u8; scratch * 4].into(), OutputKind::F32),
        output(vec![0u8; scratch * 4].into(), OutputKind::F32),
        x.qkv.clone(),
        x.g.clone(),
        x.beta.clone(),
        x.starts.clone(),
    ];
    type Factors = LazyCell<(Vec<u8>, Vec<u8>), Box<dyn FnOnce() -> (Vec<u8>, Vec<u8>)>>;
    let factors: Rc<Factors> = Rc::new(LazyCell::new(Box::new(move || {
        super::host_allowance(
            &prep_buffers,
            |p| grid.args(p),
            |k, mem| {
                use metrale_kernels::{HostMemory, Kernel};
                match pair {
                    Pair::CudaCores => k.reference(mem)?,
                    Pair::TensorCores => GdnChunkPrepTc(*k).reference(mem)?,
                }
                Ok((
                    mem.bytes(k.t_mat, scratch * 4)?.to_vec(),
                    mem.bytes(k.attn, scratch * 4)?.to_vec(),
                ))
            },
        )
    })));
    let (t_of, p_of) = (factors.clone(), factors);
    let seqs = shape.lens.len() as u32;
    Case {
        kernel: match pair {
            Pair::CudaCores => GdnChunkScan::NAME,
            Pair::TensorCores => GdnChunkScanTc::NAME,
        },
        shape: format!(
            "{} slots {seq_slots:?} of {} start={:?}",
            chunk_label(shape),
            shape.slots,
            shape.start
        ),
        buffers: vec![
            output(
                vec![0u8; x.tokens * (hv * dv) as usize * 2].into(),
                OutputKind::Bf16,
            ),
            output(f32_normal(rng, state, 0.5), OutputKind::F32),
            x.qkv,
            x.g,
            x.beta,
            input(Init::new(move || LazyCell::force(&t_of).0.clone())),
            input(Init::new(move || LazyCell::force(&p_of).1.clone())),
            x.starts,
            input(i32_bytes(&seq_slots).into()),
            input(i32_bytes(&positions).into()),
        ],
        build: Box::new(move |p| {
            let bf16_at = |elements: u32| p[2].offset(elements as usize * 2);
            let scan = GdnChunkScan {
                o: p[0],
                state: p[1],
                q: p[2],
                k: bf16_at(hk * dk),
                v: bf16_at(2 * hk * dk),
                g: p[3],
                beta: p[4],
                t_mat: p[5],
                attn: p[6],
                seq_starts: p[7],
                slots: p[8],
                positions: p[9],
                seqs,
                hv,
                hk,
                dk,
                dv,
                qkv_stride: stride,
                chunk_len,
                max_chunks,
            };
            match pair {
                Pair::CudaCores => launch_of(scan),
                Pair::TensorCores => launch_of(GdnChunkScanTc(scan)),
            }
        }),
        gemm: None,
        allowance: None,
    }
}
