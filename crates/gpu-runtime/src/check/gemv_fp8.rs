// SPDX-License-Identifier: MIT OR Apache-2.0
//! Parity cases of the FP8-weight products (`gemv_fp8.cu`): Qwen3-8B's batch-1 qkv, o, gate|up
//! and down products in 128 x 128 blocks, the row counts of both load depths (1-2 rows: 8 loads in
//! flight, 3-8: 4), a scale per row (per-channel checkpoints, misaligned stacks), a bias, K not a
//! multiple of 128 (a partial last block) and not of 16 (the scalar loop), N not a multiple of the
//! 8 columns a block; the dequantisation to BF16 at a prefill shape and on the scalar path.
//!
//! Weights are random E4M3 codes (NaN codes left out), so every binade and the subnormals occur;
//! scales are drawn around `1 / (64 sqrt(k))`, which keeps the products near unit scale.

use metrale_core::fp8::E4M3_NAN;
use metrale_kernels::KernelAbi;
use metrale_kernels::ops::{FP8_SCALE_COLS, Fp8DequantBf16, GemvFp8, GemvFp8Swiglu};

use super::{Buffer, Case, Init, OutputKind, Rng, bf16_normal, launch_of};

/// `n` random E4M3 codes, never NaN (0x7F, 0xFF), drawn on first read.
fn e4m3_codes(rng: &mut Rng, n: usize) -> Init {
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
fn scales(rng: &mut Rng, n: u32, k: u32, row_shift: u32) -> Init {
    let count = n.div_ceil(1 << row_shift) as usize * k.div_ceil(FP8_SCALE_COLS) as usize;
    let base = 1.0 / (64.0 * (k as f32).sqrt());
    let v: Vec<f32> = (0..count).map(|_| base * (0.5 + rng.uniform())).collect();
    bytemuck::cast_slice(&v).to_vec().into()
}

fn output(elements: usize) -> Buffer {
    Buffer {
        init: vec![0u8; elements * 2].into(),
        output: Some(OutputKind::Bf16),
    }
}

fn input(init: Init) -> Buffer {
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
                bias: if bias {
                    p[4]
                } else {
                    metrale_core::DevicePtr::NULL
                },
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
