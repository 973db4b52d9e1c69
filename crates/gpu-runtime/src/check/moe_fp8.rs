// SPDX-License-Identifier: MIT OR Apache-2.0
//! Parity cases of the FP8 decode experts (`moe_fp8.cu`: `moe_gemv_fp8_swiglu`,
//! `moe_gemv_fp8_relu2`, `moe_gemv_fp8_down`): Qwen3-30B-A3B's widths in 128 x 128 blocks (hidden
//! 2048, expert width 768, top 8; over fewer experts, as the bytes of 128 would only slow the
//! host) at one row and a batch; a scale per row (an expert width that fills no whole 128-row
//! block, 96); NVIDIA-Nemotron-3-Nano's squared-ReLU widths (hidden 2688, width 1856: a partial
//! last scale block of the down rows); the scalar paths (hidden 130, width 37: not multiples of
//! 16); empty slots; the down launch's shared-expert term with and without its gate.
//!
//! Then the grouped FP8 forms (`moe.cu`: `moe_grouped_mma_fp8_*`, `moe_wgmma_fp8_*`), drawn
//! after those so that they keep their inputs: Qwen3-30B-A3B's widths in 128 x 128 blocks over 32
//! rows of 8 experts (the weight streams: 32 rows an expert, one pass) and over 16 rows of top 2
//! (the prefill tiles: partial row tiles), one expert in every row (three 128-row tiles) with an
//! expert no row takes, widths off the 64-element pieces and the 128-column scale blocks with a
//! scale per row (hidden 144, width 80), the weight streams' element-by-element path (hidden 136,
//! width 40: not multiples of 16), empty slots, and the squared-ReLU forms at Nano's widths and
//! a ragged one (with the flip allowance of the BF16 forms' cases).
//!
//! Weights are random E4M3 codes (NaN codes left out) with scales around `1 / (64 sqrt(k))`, as
//! the FP8 GEMV's cases draw them.

use metrale_core::DevicePtr;
use metrale_kernels::KernelAbi;
use metrale_kernels::ops::{
    MoeGemvFp8Down, MoeGemvFp8Relu2, MoeGemvFp8Swiglu, MoeGroupedMmaFp8Down, MoeGroupedMmaFp8Relu2,
    MoeGroupedMmaFp8Swiglu, MoeWgmmaFp8Down, MoeWgmmaFp8Relu2, MoeWgmmaFp8Swiglu, group_by_expert,
};

use super::gemv_fp8::{e4m3_codes, scales};
use super::moe::{input, output, routed_ids, routed_weights};
use super::{
    Allowance, Case, OutputKind, Rng, bf16_normal, f32_bytes, host_allowance, i32_bytes, launch_of,
};

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
    // Last, so that the cases before keep their random inputs.
    out.extend(grouped_cases(rng));
    out
}

/// Which grouped FP8 form a case runs.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Form {
    /// The tensor-core weight streams (`moe_grouped_mma_fp8_*`).
    Streams,
    /// The warpgroup-MMA prefill tiles (`moe_wgmma_fp8_*`).
    Tiles,
}

/// The grouped FP8 forms' cases (module docs).
fn grouped_cases(rng: &mut Rng) -> Vec<Case> {
    let mut out = Vec::new();
    // (form, rows, experts, k, inter, hidden, empty slots, row_shift, one expert in every row,
    // squared ReLU)
    for &(form, rows, experts, k, inter, hidden, empty, row_shift, popular, relu2) in &[
        (
            Form::Streams,
            32u32,
            8u32,
            8u32,
            768u32,
            2048u32,
            0usize,
            7u32,
            false,
            false,
        ),
        (Form::Streams, 40, 12, 3, 40, 136, 2, 0, false, false),
        (Form::Streams, 70, 4, 2, 96, 256, 0, 0, false, false),
        (Form::Tiles, 16, 8, 2, 768, 2048, 0, 7, false, false),
        (Form::Tiles, 260, 12, 3, 128, 192, 0, 7, true, false),
        (Form::Tiles, 77, 5, 2, 80, 144, 3, 0, false, false),
        (Form::Streams, 16, 8, 6, 1856, 2688, 0, 0, false, true),
        (Form::Tiles, 200, 4, 2, 208, 128, 0, 0, false, true),
    ] {
        let (n, i, h) = ((rows * k) as usize, inter as usize, hidden as usize);
        let mut ids = routed_ids(rng, rows, experts - popular as u32, k, empty);
        if popular {
            // Slot 0 of every row takes expert 2; the last expert is never taken.
            for r in 0..rows as usize {
                let row = &mut ids[r * k as usize..(r + 1) * k as usize];
                match row.iter().position(|&e| e == 2) {
                    Some(at) => row.swap(0, at),
                    None => row[0] = 2,
                }
            }
        }
        let (offsets, sorted) = group_by_expert(&ids, experts as usize);
        let first_rows = experts * if relu2 { 1 } else { 2 } * inter;
        let shape = format!(
            "rows={rows} experts={experts} k={k} inter={inter} hidden={hidden} empty={empty} \
             row_shift={row_shift}{}",
            if popular {
                " one expert in every row"
            } else {
                ""
            }
        );
        let buffers = vec![
            output(vec![0; n * i * 2], OutputKind::Bf16),
            input(bf16_normal(rng, rows as usize * h, 1.0)),
            input(e4m3_codes(rng, first_rows as usize * h)),
            input(scales(rng, first_rows, hidden, row_shift)),
            input(i32_bytes(&offsets)),
            input(i32_bytes(&sorted)),
        ];
        let first = move |p: &[DevicePtr]| MoeGroupedMmaFp8Swiglu {
            act: p[0],
            x: p[1],
            w: p[2],
            scales: p[3],
            offsets: p[4],
            sorted: p[5],
            k,
            experts,
            inter,
            hidden,
            row_shift,
        };
        // An up product at a bf16 rounding boundary may round either way in another f32 sum
        // order, and the square spreads that over several bf16 steps: the reference's allowance.
        let allowance = relu2.then(|| {
            let inputs = buffers.clone();
            Allowance::new(0, move || {
                let mut extra = host_allowance(
                    &inputs,
                    |p| MoeGroupedMmaFp8Relu2::from(first(p)),
                    |k, mem| k.flip_allowance(mem),
                );
                extra.resize(n * i, 0.0);
                extra
            })
        });
        out.push(Case {
            kernel: match (form, relu2) {
                (Form::Streams, false) => MoeGroupedMmaFp8Swiglu::NAME,
                (Form::Streams, true) => MoeGroupedMmaFp8Relu2::NAME,
                (Form::Tiles, false) => MoeWgmmaFp8Swiglu::NAME,
                (Form::Tiles, true) => MoeWgmmaFp8Relu2::NAME,
            },
            gemm: None,
            allowance,
            shape: shape.clone(),
            buffers,
            build: Box::new(move |p| {
                let a = first(p);
                match (form, relu2) {
                    (Form::Streams, false) => launch_of(a),
                    (Form::Streams, true) => launch_of(MoeGroupedMmaFp8Relu2::from(a)),
                    (Form::Tiles, false) => launch_of(MoeWgmmaFp8Swiglu::from(a)),
                    (Form::Tiles, true) => launch_of(MoeWgmmaFp8Relu2::from(a)),
                }
            }),
        });
        if relu2 && form == Form::Tiles {
            continue;
        }
        // The down product of the same grouping.
        let down_rows = experts * hidden;
        out.push(Case {
            kernel: match form {
                Form::Streams => MoeGroupedMmaFp8Down::NAME,
                Form::Tiles => MoeWgmmaFp8Down::NAME,
            },
            gemm: None,
            allowance: None,
            shape,
            buffers: vec![
                output(vec![0; n * h * 2], OutputKind::Bf16),
                input(bf16_normal(rng, n * i, 1.0)),
                input(e4m3_codes(rng, down_rows as usize * i)),
                input(scales(rng, down_rows, inter, row_shift)),
                input(i32_bytes(&offsets)),
                input(i32_bytes(&sorted)),
            ],
            build: Box::new(move |p| {
                let a = MoeGroupedMmaFp8Down {
                    y: p[0],
                    act: p[1],
                    w: p[2],
                    scales: p[3],
                    offsets: p[4],
                    sorted: p[5],
                    experts,
                    hidden,
                    inter,
                    row_shift,
                };
                match form {
                    Form::Streams => launch_of(a),
                    Form::Tiles => launch_of(MoeWgmmaFp8Down::from(a)),
                }
            }),
        });
    }
    out
}
