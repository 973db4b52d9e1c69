// SPDX-License-Identifier: MIT OR Apache-2.0
//! The FP8 prefill product's cases (`fp8_gemm.cu`): the activation quantization
//! (`fp8_quantize_rows`: e4m3 codes compared code by code, the scales as f32) on Qwen3-8B's
//! widths, a partial last 128-column block, K not a multiple of 4 (the scalar path) and an
//! all-zero block (scale 1); the block-scaled FP8 GEMM through [`GpuBackend::gemm`] (cuBLASLt's
//! VEC128 x BLK128x128 matmul on CUDA) on Qwen3-8B's widths, with and without a bias, and as its
//! fallback kernel (`gemm_fp8_block_scaled`), at row counts that are multiples of 16, below 16
//! and neither (cuBLASLt takes multiples of 16: the rest goes through a padded second product).
//! The library cases are the first check of the scale layouts blaslt.rs assumes: a wrong one
//! fails them.
//!
//! [`GpuBackend::gemm`]: crate::GpuBackend::gemm

use half::bf16;
use metrale_core::DevicePtr;
use metrale_kernels::KernelAbi;
use metrale_kernels::ops::{
    FP8_GEMM_PAD_ROWS, FP8_GEMM_ROW_GROUP, FP8_SCALE_COLS, Fp8QuantizeRows, GemmFp8,
};

use super::gemv_fp8::{e4m3_codes, input, output, scales};
use super::{Buffer, Case, GemmBuild, Init, OutputKind, Rng, bf16_normal, f32_bytes, launch_of};
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
