// SPDX-License-Identifier: MIT OR Apache-2.0
//! Parity cases of the FP8 decode experts (`moe_fp8.cu`: `moe_gemv_fp8_swiglu`,
//! `moe_gemv_fp8_relu2`, `moe_gemv_fp8_down`): Qwen3-30B-A3B's widths in 128 x 128 blocks (hidden
//! 2048, expert width 768, top 8; over fewer experts, as the bytes of 128 would only slow the
//! host) at one row and a batch; a scale per row (an expert width that fills no whole 128-row
//! block, 96); NVIDIA-Nemotron-3-Nano's squared-ReLU widths (hidden 2688, width 1856: a partial
//! last scale block of the down rows); the scalar paths (hidden 130, width 37: not multiples of
//! 16); empty slots; the down launch's shared-expert term with and without its gate.
//!
//! Weights are random E4M3 codes (NaN codes left out) with scales around `1 / (64 sqrt(k))`, as
//! the FP8 GEMV's cases draw them.

use metrale_core::DevicePtr;
use metrale_kernels::KernelAbi;
use metrale_kernels::ops::{MoeGemvFp8Down, MoeGemvFp8Relu2, MoeGemvFp8Swiglu};

use super::gemv_fp8::{e4m3_codes, scales};
use super::moe::{input, output, routed_ids, routed_weights};
use super::{Case, OutputKind, Rng, bf16_normal, f32_bytes, i32_bytes, launch_of};

/// Every FP8 expert case, in a fixed order.
pub(super) fn moe_fp8_cases(rng: &mut Rng) -> Vec<Case> {
    let mut out = Vec::new();
    // (rows, experts, k, inter, hidden, empty slots, row_shift, squared ReLU, shared term)
    for &(rows, experts, k, inter, hidden, empty, row_shift, relu2, shared) in &[
        (1u32, 8u32, 8u32, 768u32, 2048u32, 0usize, 7u32, false, 0u32),
        (4, 12, 8, 768, 2048, 0, 7, false, 1),
        (3, 6, 2, 96, 256, 2, 0, false, 2),
        (2, 7, 3, 37, 130, 1, 0, false, 0),
        (1, 8, 6, 1856, 2688, 0, 0, true, 0),
        (3, 8, 6, 1856, 2688, 1, 0, true, 2),
        (2, 5, 2, 40, 136, 0, 7, true, 0),
    ] {
        let (n, i, h) = ((rows * k) as usize, inter as usize, hidden as usize);
        let per = if relu2 { 1 } else { 2 };
        let first_rows = experts * per * inter;
        let ids = routed_ids(rng, rows, experts, k, empty);
        let kernel = if relu2 {
            MoeGemvFp8Relu2::NAME
        } else {
            MoeGemvFp8Swiglu::NAME
        };
        out.push(Case {
            kernel,
            gemm: None,
            allowance: None,
            shape: format!(
                "rows={rows} experts={experts} k={k} inter={inter} hidden={hidden} \
                 empty={empty} row_shift={row_shift}"
            ),
            buffers: vec![
                output(vec![0; n * i * 2], OutputKind::Bf16),
                input(bf16_normal(rng, rows as usize * h, 1.0)),
                input(e4m3_codes(rng, first_rows as usize * h)),
                input(scales(rng, first_rows, hidden, row_shift)),
                input(i32_bytes(&ids)),
            ],
            build: Box::new(move |p| {
                let a = MoeGemvFp8Swiglu {
                    act: p[0],
                    x: p[1],
                    w: p[2],
                    scales: p[3],
                    ids: p[4],
                    rows,
                    k,
                    experts,
                    inter,
                    hidden,
                    row_shift,
                };
                match relu2 {
                    true => launch_of(MoeGemvFp8Relu2::from(a)),
                    false => launch_of(a),
                }
            }),
        });
        let ids = routed_ids(rng, rows, experts, k, empty);
        let weights = routed_weights(rng, n);
        let down_rows = experts * hidden;
        // shared: 0 none, 1 gated, 2 ungated.
        let gate: Vec<f32> = (0..rows).map(|_| rng.normal() * 2.0).collect();
        out.push(Case {
            kernel: MoeGemvFp8Down::NAME,
            gemm: None,
            allowance: None,
            shape: format!(
                "rows={rows} experts={experts} k={k} hidden={hidden} inter={inter} \
                 empty={empty} row_shift={row_shift} shared={}",
                ["none", "gated", "ungated"][shared as usize]
            ),
            buffers: vec![
                output(vec![0; rows as usize * h * 2], OutputKind::Bf16),
                input(bf16_normal(rng, n * i, 1.0)),
                input(e4m3_codes(rng, down_rows as usize * i)),
                input(scales(rng, down_rows, inter, row_shift)),
                input(i32_bytes(&ids)),
                input(f32_bytes(&weights)),
                input(bf16_normal(rng, rows as usize * h, 0.5)),
                input(f32_bytes(&gate)),
            ],
            build: Box::new(move |p| {
                launch_of(MoeGemvFp8Down {
                    out: p[0],
                    act: p[1],
                    w: p[2],
                    scales: p[3],
                    ids: p[4],
                    weights: p[5],
                    shared: if shared > 0 { p[6] } else { DevicePtr::NULL },
                    shared_gate: if shared == 1 { p[7] } else { DevicePtr::NULL },
                    rows,
                    k,
                    experts,
                    hidden,
                    inter,
                    row_shift,
                })
            }),
        });
    }
    out
}
