// SPDX-License-Identifier: MIT OR Apache-2.0
//! Parity cases of the FP8-weight products (`gemv_fp8.cu`): Qwen3-8B's batch-1 qkv, o, gate|up
//! and down products in 128 x 128 blocks, the row counts of both load depths (1-2 rows: 8 loads in
//! flight, 3-8: 4), a scale per row (per-channel checkpoints, misaligned stacks), a bias, K not a
//! multiple of 128 (a partial last block) and not of 16 (the scalar loop), N not a multiple of the
//! 8 columns a block; the dequantisation to BF16 at a prefill shape and on the scalar path.
//!
//! The batch-1 stream entries (`gemv_stream.cu`'s `gemv_fp8_*`): [`gemv_fp8_stream_cases`]; the
//! tensor-core GEMV (`gemv_fp8_mma.cu`): [`gemv_fp8_mma_cases`].
//!
//! Weights are random E4M3 codes (NaN codes left out), so every binade and the subnormals occur;
//! scales are drawn around `1 / (64 sqrt(k))`, which keeps the products near unit scale.

use metrale_core::DevicePtr;
use metrale_core::fp8::E4M3_NAN;
use metrale_kernels::KernelAbi;
use metrale_kernels::ops::{
    FP8_SCALE_COLS, Fp8DequantBf16, GEMV_STREAM_BLOCKS, GemvFp8, GemvFp8Mma, GemvFp8MmaSwiglu,
    GemvFp8Stream, GemvFp8StreamNorm, GemvFp8Swiglu, GemvFp8SwigluStream, GemvFp8SwigluStreamNorm,
};

use super::{
    Buffer, Case, Init, OutputKind, Rng, bf16_normal, f32_bytes, launch_of, norm_weight, on_grid,
};

/// `n` random E4M3 codes, never NaN (0x7F, 0xFF), drawn on first read.
pub(super) fn e4m3_codes(rng: &mut Rng, n: usize) -> Init {
    let mut from = rng.clone();
    rng.skip(n as u64);
    Init::new(move || {
        (0..n)
            .map(|_| {
                let code = from.below(254) as u8;
                if code >= E4M3_NAN { code + 1 } else { code }
            })
            .collect()
    })
}

/// The scales of an `[n, k]` weight with `2^row_shift` rows a scale: `1 / (64 sqrt(k))` times a
/// factor in [0.5, 1.5).
pub(super) fn scales(rng: &mut Rng, n: u32, k: u32, row_shift: u32) -> Init {
    let count = n.div_ceil(1 << row_shift) as usize * k.div_ceil(FP8_SCALE_COLS) as usize;
    let base = 1.0 / (64.0 * (k as f32).sqrt());
    let v: Vec<f32> = (0..count).map(|_| base * (0.5 + rng.uniform())).collect();
    bytemuck::cast_slice(&v).to_vec().into()
}

pub(super) fn output(elements: usize) -> Buffer {
    Buffer {
        init: vec![0u8; elements * 2].into(),
        output: Some(OutputKind::Bf16),
    }
}

pub(super) fn input(init: Init) -> Buffer {
    Buffer { init, output: None }
}

fn gemv_case(rng: &mut Rng, m: u32, n: u32, k: u32, row_shift: u32, bias: bool) -> Case {
    Case {
        kernel: GemvFp8::NAME,
        shape: format!("m={m} n={n} k={k} row_shift={row_shift} bias={bias}"),
        buffers: vec![
            output((m * n) as usize),
            input(bf16_normal(rng, (m * k) as usize, 1.0)),
            input(e4m3_codes(rng, (n * k) as usize)),
            input(scales(rng, n, k, row_shift)),
            input(bf16_normal(rng, n as usize, 1.0)),
        ],
        build: Box::new(move |p| {
            launch_of(GemvFp8 {
                c: p[0],
                a: p[1],
                w: p[2],
                scales: p[3],
                bias: if bias { p[4] } else { DevicePtr::NULL },
                m,
                n,
                k,
                row_shift,
            })
        }),
        gemm: None,
        allowance: None,
    }
}

fn swiglu_case(rng: &mut Rng, m: u32, inter: u32, k: u32, row_shift: u32) -> Case {
    Case {
        kernel: GemvFp8Swiglu::NAME,
        shape: format!("m={m} inter={inter} k={k} row_shift={row_shift}"),
        buffers: vec![
            output((m * inter) as usize),
            input(bf16_normal(rng, (m * k) as usize, 1.0)),
            input(e4m3_codes(rng, (2 * inter * k) as usize)),
            input(scales(rng, 2 * inter, k, row_shift)),
        ],
        build: Box::new(move |p| {
            launch_of(GemvFp8Swiglu {
                out: p[0],
                a: p[1],
                w: p[2],
                scales: p[3],
                m,
                inter,
                k,
                row_shift,
            })
        }),
        gemm: None,
        allowance: None,
    }
}

fn dequant_case(rng: &mut Rng, n: u32, k: u32, row_shift: u32) -> Case {
    Case {
        kernel: Fp8DequantBf16::NAME,
        shape: format!("n={n} k={k} row_shift={row_shift}"),
        buffers: vec![
            output((n * k) as usize),
            input(e4m3_codes(rng, (n * k) as usize)),
            input(scales(rng, n, k, row_shift)),
        ],
        build: Box::new(move |p| {
            launch_of(Fp8DequantBf16 {
                out: p[0],
                w: p[1],
                scales: p[2],
                n,
                k,
                row_shift,
            })
        }),
        gemm: None,
        allowance: None,
    }
}

/// Every FP8 case, in a fixed order.
pub(super) fn gemv_fp8_cases(rng: &mut Rng) -> Vec<Case> {
    let mut out = Vec::new();
    for (m, n, k, row_shift, bias) in [
        (1u32, 6144u32, 4096u32, 7u32, false),
        (1, 4096, 4096, 7, false),
        (1, 4096, 12288, 7, false),
        (2, 1024, 1024, 7, true),
        (3, 1000, 1024, 0, false),
        (4, 777, 2048, 7, true),
        (5, 300, 512, 7, false),
        (8, 257, 1024, 0, true),
        (1, 100, 144, 7, false),
        (2, 33, 200, 0, true),
    ] {
        out.push(gemv_case(rng, m, n, k, row_shift, bias));
    }
    for (m, inter, k, row_shift) in [
        (1u32, 12288u32, 4096u32, 7u32),
        (1, 3072, 1024, 7),
        (3, 1001, 256, 0),
        (8, 64, 144, 7),
        (2, 9, 72, 0),
    ] {
        out.push(swiglu_case(rng, m, inter, k, row_shift));
    }
    for (n, k, row_shift) in [(4096u32, 4096u32, 7u32), (300, 136, 0), (130, 272, 7)] {
        out.push(dequant_case(rng, n, k, row_shift));
    }
    out
}

/// The FP8 streams (`gemv_fp8_stream`, `gemv_fp8_swiglu_stream` and their `_norm` forms) on
/// Qwen3-8B's batch-1 qkv, o, gate|up and down products in 128 x 128 blocks, with the first fill
/// all, partly or not at all before the wait and with and without the evict-first hint; each of
/// the three chunk sizes (rows of whole 4, 2 and 1 KiB: k 4096 and 12288, 2048 and 6144, 1024 and
/// 3072); a scale per row; a bias; one column more than the grid's warps, fewer columns than
/// warps, rows not filling their last 128-row block (and the up rows of a SwiGLU weight starting
/// inside a block); the normalising forms at layer 0 (no input) and over a norm row longer than
/// one pass; a grid cap. After every other FP8 case, so that those keep their random inputs.
pub(super) fn gemv_fp8_stream_cases(rng: &mut Rng) -> Vec<Case> {
    let warps = GEMV_STREAM_BLOCKS * 8;
    let mut out = Vec::new();
    // (n, k, row_shift, bias, prewait, evict_first)
    for (n, k, row_shift, bias, prewait, evict_first) in [
        (6144u32, 4096u32, 7u32, false, 4u32, 1u32),
        (4096, 4096, 7, false, 4, 1),
        (4096, 12288, 7, false, 1, 1),
        (4096, 4096, 0, true, 0, 0),
        (warps + 1, 2048, 7, false, 2, 0),
        (300, 6144, 7, true, 4, 1),
        (1000, 3072, 0, true, 4, 1),
        (5, 1024, 7, true, 0, 0),
    ] {
        out.push(stream_case(
            rng,
            n,
            k,
            row_shift,
            bias,
            (prewait, evict_first),
        ));
    }
    // (inter, k, row_shift, prewait, evict_first)
    for (inter, k, row_shift, prewait, evict_first) in [
        (12288u32, 4096u32, 7u32, 4u32, 1u32),
        (3072, 1024, 7, 4, 1),
        (1001, 2048, 0, 0, 0),
        (100, 3072, 7, 2, 1),
    ] {
        out.push(swiglu_stream_case(
            rng,
            inter,
            k,
            row_shift,
            (prewait, evict_first),
        ));
    }
    // (n, k, swiglu, bias, input, row_shift, prewait, evict_first); for the SwiGLU form n counts
    // gate and up rows.
    for (n, k, swiglu, bias, input, row_shift, prewait, evict_first) in [
        (6144u32, 4096u32, false, false, true, 7u32, 4u32, 1u32),
        (24576, 4096, true, false, true, 7, 4, 1),
        (6144, 4096, false, false, false, 7, 2, 0),
        (1000, 3072, false, true, true, 0, 1, 0),
        (4096, 1024, false, false, true, 0, 4, 1),
        (600, 8192, true, false, true, 7, 4, 0),
    ] {
        let shape = NormShape {
            n,
            k,
            swiglu,
            bias,
            input,
        };
        out.push(norm_stream_case(
            rng,
            shape,
            row_shift,
            (prewait, evict_first),
        ));
    }
    // Fewer blocks than the host gives (a grid cap): longer runs of columns, the same sums.
    for (n, k, grid) in [(1056u32, 4096u32, 33u32), (1056, 1024, 66)] {
        out.push(on_grid(stream_case(rng, n, k, 7, false, (4, 1)), grid));
    }
    out
}

fn stream_case(
    rng: &mut Rng,
    n: u32,
    k: u32,
    row_shift: u32,
    bias: bool,
    (prewait, evict_first): (u32, u32),
) -> Case {
    let mut case = gemv_case(rng, 1, n, k, row_shift, bias);
    case.kernel = GemvFp8Stream::NAME;
    case.shape = format!("{} prewait={prewait} evict_first={evict_first}", case.shape);
    case.build = Box::new(move |p| {
        launch_of(GemvFp8Stream {
            c: p[0],
            a: p[1],
            w: p[2],
            scales: p[3],
            bias: if bias { p[4] } else { DevicePtr::NULL },
            m: 1,
            n,
            k,
            row_shift,
            prewait,
            evict_first,
        })
    });
    case
}

fn swiglu_stream_case(
    rng: &mut Rng,
    inter: u32,
    k: u32,
    row_shift: u32,
    (prewait, evict_first): (u32, u32),
) -> Case {
    let mut case = swiglu_case(rng, 1, inter, k, row_shift);
    case.kernel = GemvFp8SwigluStream::NAME;
    case.shape = format!("{} prewait={prewait} evict_first={evict_first}", case.shape);
    case.build = Box::new(move |p| {
        launch_of(GemvFp8SwigluStream {
            out: p[0],
            a: p[1],
            w: p[2],
            scales: p[3],
            m: 1,
            inter,
            k,
            row_shift,
            prewait,
            evict_first,
        })
    });
    case
}

/// A normalising stream's product: `n` weight rows (gate and up rows for `swiglu`) over `k`.
#[derive(Clone, Copy)]
struct NormShape {
    n: u32,
    k: u32,
    swiglu: bool,
    bias: bool,
    input: bool,
}

/// A normalising FP8 stream: the residual (an output too: it must come back unchanged), the
/// residual out, the input, the norm's weight, the e4m3 weight, its scales and a bias.
fn norm_stream_case(
    rng: &mut Rng,
    shape: NormShape,
    row_shift: u32,
    (prewait, evict_first): (u32, u32),
) -> Case {
    let NormShape {
        n,
        k,
        swiglu,
        bias,
        input: has_input,
    } = shape;
    let residual: Vec<f32> = (0..k).map(|_| 2.0 * rng.normal()).collect();
    let columns = if swiglu { n / 2 } else { n };
    Case {
        kernel: if swiglu {
            GemvFp8SwigluStreamNorm::NAME
        } else {
            GemvFp8StreamNorm::NAME
        },
        shape: format!(
            "m=1 n={n} k={k} row_shift={row_shift} bias={bias} input={has_input} \
             prewait={prewait} evict_first={evict_first}"
        ),
        buffers: vec![
            output(columns as usize),
            Buffer {
                init: f32_bytes(&residual).into(),
                output: Some(OutputKind::F32),
            },
            Buffer {
                init: vec![0xAB; k as usize * 4].into(),
                output: Some(OutputKind::F32),
            },
            input(bf16_normal(rng, k as usize, 2.0)),
            input(norm_weight(rng, k as usize).into()),
            input(e4m3_codes(rng, (n * k) as usize)),
            input(scales(rng, n, k, row_shift)),
            input(bf16_normal(rng, n as usize, 1.0)),
        ],
        build: Box::new(move |p| {
            let input = if has_input { p[3] } else { DevicePtr::NULL };
            if swiglu {
                launch_of(GemvFp8SwigluStreamNorm {
                    out: p[0],
                    residual: p[1],
                    residual_out: p[2],
                    input,
                    norm_weight: p[4],
                    w: p[5],
                    scales: p[6],
                    m: 1,
                    inter: n / 2,
                    k,
                    eps: 1e-6,
                    row_shift,
                    prewait,
                    evict_first,
                })
            } else {
                launch_of(GemvFp8StreamNorm {
                    c: p[0],
                    residual: p[1],
                    residual_out: p[2],
                    input,
                    norm_weight: p[4],
                    w: p[5],
                    scales: p[6],
                    bias: if bias { p[7] } else { DevicePtr::NULL },
                    m: 1,
                    n,
                    k,
                    eps: 1e-6,
                    row_shift,
                    prewait,
                    evict_first,
                })
            }
        }),
        gemm: None,
        allowance: None,
    }
}

/// The tensor-core FP8 GEMV (`gemv_fp8_mma`, `gemv_fp8_mma_swiglu`) on Qwen3-8B's qkv, o,
/// gate|up and down products in 128 x 128 blocks at 1 and 8 rows; a scale per row; a bias; N not
/// a multiple of the 16 columns a block (and fewer than 16); fewer 128-column pieces than the 8
/// warps of a block, and an odd count (the last piece alone); rows 2 to 7; up rows starting inside
/// a 128-row block; a grid smaller than the tiles (the block-stride loop). After every other case,
/// so that those keep their random inputs.
pub(super) fn gemv_fp8_mma_cases(rng: &mut Rng) -> Vec<Case> {
    let mut out = Vec::new();
    for (m, n, k, row_shift, bias) in [
        (1u32, 6144u32, 4096u32, 7u32, false),
        (1, 4096, 4096, 7, false),
        (1, 4096, 12288, 7, false),
        (8, 6144, 4096, 7, false),
        (8, 4096, 4096, 7, true),
        (8, 4096, 12288, 7, false),
        (3, 1000, 1024, 0, true),
        (5, 777, 384, 7, true),
        (1, 9, 2176, 0, false),
    ] {
        out.push(mma_case(rng, m, n, k, row_shift, bias));
    }
    for (m, inter, k, row_shift) in [
        (1u32, 12288u32, 4096u32, 7u32),
        (8, 12288, 4096, 7),
        (2, 1001, 1152, 0),
        (7, 100, 256, 7),
    ] {
        out.push(swiglu_mma_case(rng, m, inter, k, row_shift));
    }
    out.push(on_grid(mma_case(rng, 1, 1056, 1024, 7, true), 20));
    out.push(on_grid(swiglu_mma_case(rng, 4, 1056, 1024, 7), 20));
    out
}

fn mma_case(rng: &mut Rng, m: u32, n: u32, k: u32, row_shift: u32, bias: bool) -> Case {
    let mut case = gemv_case(rng, m, n, k, row_shift, bias);
    case.kernel = GemvFp8Mma::NAME;
    case.build = Box::new(move |p| {
        launch_of(GemvFp8Mma {
            c: p[0],
            a: p[1],
            w: p[2],
            scales: p[3],
            bias: if bias { p[4] } else { DevicePtr::NULL },
            m,
            n,
            k,
            row_shift,
        })
    });
    case
}

fn swiglu_mma_case(rng: &mut Rng, m: u32, inter: u32, k: u32, row_shift: u32) -> Case {
    let mut case = swiglu_case(rng, m, inter, k, row_shift);
    case.kernel = GemvFp8MmaSwiglu::NAME;
    case.build = Box::new(move |p| {
        launch_of(GemvFp8MmaSwiglu {
            out: p[0],
            a: p[1],
            w: p[2],
            scales: p[3],
            m,
            inter,
            k,
            row_shift,
        })
    });
    case
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_are_never_nan() {
        let mut rng = Rng::new(5);
        let codes = e4m3_codes(&mut rng, 100_000);
        assert!(codes.bytes().iter().all(|&b| b & 0x7F != 0x7F));
        assert!(codes.bytes().contains(&0x7E) && codes.bytes().contains(&0xFE));
    }
}
