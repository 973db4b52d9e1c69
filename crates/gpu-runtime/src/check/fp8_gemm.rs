// SPDX-License-Identifier: MIT OR Apache-2.0
//! The FP8 prefill product's cases (`fp8_gemm.cu`): the activation quantization
//! (`fp8_quantize_rows`: e4m3 codes compared code by code, the scales as f32) on Qwen3-8B's
//! widths, a partial last 128-column block, K not a multiple of 4 (the scalar path) and an
//! all-zero block (scale 1); the block-scaled FP8 GEMM through [`GpuBackend::gemm`] (cuBLASLt's
//! VEC128 x BLK128x128 matmul on CUDA) on Qwen3-8B's widths, with and without a bias, and as its
//! fallback kernel (`gemm_fp8_block_scaled`), at row counts that are multiples of 16, below 16
//! and neither (cuBLASLt takes multiples of 16: the rest goes through a padded second product).
//! The library cases are the first check of the scale layouts blaslt.rs assumes: a wrong one
//! fails them. The launches that write the quantized rows in place of their bf16 output
//! (`add_rmsnorm_f32res_fp8_rows`, `silu_mul_fp8_rows`: [`fp8_row_producer_cases`]) on Qwen3-8B's
//! and Qwen3-0.6B's widths at row counts that are and are not multiples of 16 and above the
//! padded group's 256 (two groups), and on the awkward paths.
//!
//! [`GpuBackend::gemm`]: crate::GpuBackend::gemm

use half::bf16;
use metrale_core::DevicePtr;
use metrale_kernels::KernelAbi;
use metrale_kernels::ops::{
    AddRmsNormFp8Rows, FP8_GEMM_PAD_ROWS, FP8_GEMM_ROW_GROUP, FP8_SCALE_COLS, Fp8QuantizeRows,
    GemmFp8, SiluMulFp8Rows,
};

use super::gemv_fp8::{e4m3_codes, input, output, scales};
use super::{
    Buffer, Case, GemmBuild, Init, OutputKind, Rng, bf16_normal, f32_bytes, launch_of, norm_weight,
};
use crate::{GemmFp8Scales, GemmOp};

/// Every case, in a fixed order.
pub(super) fn fp8_gemm_cases(rng: &mut Rng) -> Vec<Case> {
    let mut out = Vec::new();
    for (m, k, zero_block) in [
        (37u32, 4096u32, false),
        (270, 1024, false),
        (8, 12288, false),
        (5, 300, true),
        (3, 130, false),
    ] {
        out.push(quantize_case(rng, m, k, zero_block));
    }
    for (m, n, k, bias, library) in [
        (17u32, 2048u32, 4096u32, false, true),
        (64, 512, 12288, false, true),
        (256, 256, 512, true, true),
        (9, 6144, 512, true, true),
        (5, 1024, 4096, false, true),
        (32, 1024, 4096, true, true),
        (47, 768, 1024, true, true),
        (300, 512, 1024, true, true),
        (20, 256, 1024, true, false),
    ] {
        out.push(gemm_case(rng, m, n, k, bias, library));
    }
    out
}

fn quantize_case(rng: &mut Rng, m: u32, k: u32, zero_block: bool) -> Case {
    let kb = k.div_ceil(FP8_SCALE_COLS) as usize;
    let (rows, cols) = (m as usize, k as usize);
    let padded = m.next_multiple_of(FP8_GEMM_ROW_GROUP) as usize;
    let a = bf16_normal(rng, rows * cols, 2.0);
    let a = if zero_block {
        // Row 1's second 128 columns all zero: that block's scale is 1 and its codes 0.
        Init::new(move || {
            let mut v = a.bytes().to_vec();
            let at = (cols + 128) * 2;
            v[at..at + 256].fill(0);
            v
        })
    } else {
        a
    };
    Case {
        kernel: Fp8QuantizeRows::NAME,
        shape: format!("m={m} k={k} zero_block={zero_block}"),
        buffers: vec![
            Buffer {
                init: vec![0u8; padded * cols].into(),
                output: Some(OutputKind::E4m3),
            },
            Buffer {
                init: vec![0u8; kb * padded * 4].into(),
                output: Some(OutputKind::F32),
            },
            input(a),
        ],
        build: Box::new(move |p| {
            launch_of(Fp8QuantizeRows {
                q: p[0],
                scales: p[1],
                a: p[2],
                m,
                k,
            })
        }),
        gemm: None,
        allowance: None,
    }
}

/// A scale per row and 128 columns for `m` rows padded to 16 ([`fp8_row_scale`]'s layout): 1/64
/// times a factor in [0.5, 1.5) (random e4m3 codes reach 448, so A reaches about 10).
///
/// [`fp8_row_scale`]: metrale_kernels::ops::fp8_row_scale
fn activation_scales(rng: &mut Rng, m: u32, k: u32) -> Init {
    let count =
        m.next_multiple_of(FP8_GEMM_ROW_GROUP) as usize * k.div_ceil(FP8_SCALE_COLS) as usize;
    let v: Vec<f32> = (0..count).map(|_| (0.5 + rng.uniform()) / 64.0).collect();
    f32_bytes(&v).into()
}

fn gemm_case(rng: &mut Rng, m: u32, n: u32, k: u32, bias: bool, library: bool) -> Case {
    let via = if library { " via GpuBackend::gemm" } else { "" };
    let bind = move |p: &[DevicePtr]| GemmOp {
        c: p[0],
        a: p[1],
        w: p[3],
        bias: if bias { p[5] } else { DevicePtr::NULL },
        m,
        n,
        k,
        f32_out: false,
        fp8: Some(GemmFp8Scales {
            a: p[2],
            w: p[4],
            tail: p[6],
        }),
    };
    let bias_values: Vec<bf16> = (0..n).map(|_| bf16::from_f32(rng.normal())).collect();
    Case {
        kernel: GemmFp8::NAME,
        shape: format!("m={m} n={n} k={k} bias={bias}{via}"),
        buffers: vec![
            output((m * n) as usize),
            // The rows padded to 16, as the quantization leaves them (the pad rows' products are
            // computed and dropped).
            input(e4m3_codes(
                rng,
                (m.next_multiple_of(FP8_GEMM_ROW_GROUP) * k) as usize,
            )),
            input(activation_scales(rng, m, k)),
            input(e4m3_codes(rng, (n * k) as usize)),
            input(scales(rng, n, k, 7)),
            input(bytemuck::cast_slice(&bias_values).to_vec().into()),
            // The library's product of the padded rows lands here first.
            input(vec![0u8; (FP8_GEMM_PAD_ROWS * n) as usize * 2].into()),
        ],
        build: Box::new(move |p| {
            let op = bind(p);
            launch_of(GemmFp8 {
                c: op.c,
                a: op.a,
                a_scales: p[2],
                w: op.w,
                w_scales: p[4],
                bias: op.bias,
                m,
                n,
                k,
            })
        }),
        gemm: library.then(|| Box::new(bind) as GemmBuild),
        allowance: None,
    }
}

/// The producers that write the FP8 product's quantized rows themselves, each against its host
/// reference (its bf16 form's, then the quantization's): the residual add + RMSNorm
/// (`add_rmsnorm_f32res_fp8_rows`; the residual compared too) and SiLU x up
/// (`silu_mul_fp8_rows`) at 5, 32, 47 and 300 rows over 4096 and 1024 columns; the norm over
/// 8192 columns without an input (a row longer than one pass), 1000 columns (a partial last
/// 128-column block) and 130 columns with a weight offset (the scalar path); SiLU x up over
/// Qwen3-8B's 12288, 1000 and 130. The codes and scales start as garbage, so rows and blocks left
/// unwritten fail (the rows past the count must be zero with scale 1).
pub(super) fn fp8_row_producer_cases(rng: &mut Rng) -> Vec<Case> {
    let mut out = Vec::new();
    let main = [5u32, 32, 47, 300]
        .into_iter()
        .flat_map(|m| [4096u32, 1024].map(|k| (m, k)));
    for (rows, cols) in main.clone() {
        out.push(add_rmsnorm_case(rng, rows, cols, true, 0.0));
    }
    for (rows, cols, with_input, offset) in [
        (3u32, 8192u32, false, 0.0f32),
        (7, 1000, true, 0.0),
        (2, 130, true, 1.0),
    ] {
        out.push(add_rmsnorm_case(rng, rows, cols, with_input, offset));
    }
    for (tokens, inter) in main.chain([(17, 12288), (3, 1000), (2, 130)]) {
        out.push(silu_mul_case(rng, tokens, inter));
    }
    out
}

/// The quantized rows' two outputs for `m x k`, filled with garbage: e4m3 codes (0x55) for `m`
/// rounded up to 16 rows, and as many rows' scales (-1).
fn quantized_outputs(m: u32, k: u32) -> [Buffer; 2] {
    let rows = m.next_multiple_of(FP8_GEMM_ROW_GROUP) as usize;
    let kb = k.div_ceil(FP8_SCALE_COLS) as usize;
    [
        Buffer {
            init: vec![0x55u8; rows * k as usize].into(),
            output: Some(OutputKind::E4m3),
        },
        Buffer {
            init: f32_bytes(&vec![-1f32; rows * kb]).into(),
            output: Some(OutputKind::F32),
        },
    ]
}

/// `n` f32 values of N(0, scale²), drawn on first read as [`bf16_normal`] draws.
fn f32_normal(rng: &mut Rng, n: usize, scale: f32) -> Init {
    let mut from = rng.clone();
    rng.skip(2 * n as u64);
    Init::new(move || {
        let v: Vec<f32> = (0..n).map(|_| from.normal() * scale).collect();
        f32_bytes(&v)
    })
}

fn add_rmsnorm_case(rng: &mut Rng, rows: u32, cols: u32, with_input: bool, offset: f32) -> Case {
    let n = (rows * cols) as usize;
    let [q, scales] = quantized_outputs(rows, cols);
    Case {
        kernel: AddRmsNormFp8Rows::NAME,
        shape: format!("rows={rows} cols={cols} input={with_input} offset={offset}"),
        buffers: vec![
            q,
            scales,
            Buffer {
                init: f32_normal(rng, n, 2.0),
                output: Some(OutputKind::F32),
            },
            input(bf16_normal(rng, n, 2.0)),
            input(norm_weight(rng, cols as usize).into()),
        ],
        build: Box::new(move |p| {
            launch_of(AddRmsNormFp8Rows {
                q: p[0],
                scales: p[1],
                residual: p[2],
                input: if with_input { p[3] } else { DevicePtr::NULL },
                weight: p[4],
                rows,
                cols,
                eps: 1e-6,
                weight_offset: offset,
            })
        }),
        gemm: None,
        allowance: None,
    }
}

fn silu_mul_case(rng: &mut Rng, tokens: u32, inter: u32) -> Case {
    let [q, scales] = quantized_outputs(tokens, inter);
    Case {
        kernel: SiluMulFp8Rows::NAME,
        shape: format!("tokens={tokens} inter={inter}"),
        buffers: vec![
            q,
            scales,
            input(bf16_normal(rng, (tokens * inter * 2) as usize, 2.0)),
        ],
        build: Box::new(move |p| {
            launch_of(SiluMulFp8Rows {
                q: p[0],
                scales: p[1],
                gate_up: p[2],
                tokens,
                inter,
            })
        }),
        gemm: None,
        allowance: None,
    }
}
