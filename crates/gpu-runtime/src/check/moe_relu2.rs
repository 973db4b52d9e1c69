// SPDX-License-Identifier: MIT OR Apache-2.0
//! Parity cases of the squared-ReLU experts (Nemotron-H's `E` layers: `moe_gemv_relu2`,
//! `moe_grouped_gemv_relu2`, `moe_grouped_mma_relu2`, `moe_gemm_relu2`) at
//! NVIDIA-Nemotron-3-Nano-30B-A3B's widths (hidden 2688, expert width 1856, top 6 of 128; the
//! expert products over fewer experts, as the bytes of 128 would only slow the host), its router
//! (sigmoid with a correction bias, renormalised, scaled by 2.5) and its down products, and the
//! edges the SwiGLU cases cover: the scalar path (width 37, hidden 130), empty slots, experts with
//! more rows than one tile, a ragged last column tile (1856 is not a multiple of 64 or 128).

use metrale_core::DevicePtr;
use metrale_kernels::KernelAbi;
use metrale_kernels::ops::{
    MoeGemmDown, MoeGemmRelu2, MoeGemvDown, MoeGemvRelu2, MoeGroupedGemvRelu2, MoeGroupedMmaRelu2,
    MoeRoute, MoeScoring, group_by_expert,
};

use super::moe::{input, output, routed_ids, routed_weights};
use super::{
    Allowance, Buffer, Case, OutputKind, Rng, bf16_normal, f32_bytes, host_allowance, i32_bytes,
    launch_of,
};

/// Nano's widths.
const HIDDEN: u32 = 2688;
const INTER: u32 = 1856;

/// Every squared-ReLU expert case, in a fixed order.
pub(super) fn relu2_expert_cases(rng: &mut Rng) -> Vec<Case> {
    let mut out = route_cases(rng);
    out.extend(decode_cases(rng));
    out.extend(grouped_cases(rng));
    out
}

/// Nano's router at one row and at a batch: 128 experts, top 6, sigmoid scores plus the
/// correction bias for the choice, the unbiased scores renormalised and scaled by 2.5. Logits on
/// a grid of 1/8 and biases of 1/64, as the SwiGLU routing cases, so that host and device choose
/// from the same exact keys.
fn route_cases(rng: &mut Rng) -> Vec<Case> {
    let mut out = Vec::new();
    for rows in [1u32, 7] {
        let (experts, k) = (128u32, 6u32);
        let logits: Vec<f32> = (0..rows * experts)
            .map(|_| (rng.normal() * 16.0).round() / 8.0)
            .collect();
        let bias: Vec<f32> = (0..experts)
            .map(|_| (rng.normal() * 6.4).round() / 64.0)
            .collect();
        let n = (rows * k) as usize;
        out.push(Case {
            kernel: MoeRoute::NAME,
            gemm: None,
            allowance: None,
            shape: format!(
                "rows={rows} experts={experts} k={k} Sigmoid renormalize=1 scale=2.5 bias=true \
                 (Nemotron-3-Nano)"
            ),
            buffers: vec![
                output(vec![0xFF; n * 4], OutputKind::I32),
                output(vec![0xFF; n * 4], OutputKind::F32),
                input(f32_bytes(&logits)),
                input(f32_bytes(&bias)),
            ],
            build: Box::new(move |p| {
                launch_of(MoeRoute {
                    topk_ids: p[0],
                    topk_weights: p[1],
                    logits: p[2],
                    correction_bias: p[3],
                    rows,
                    experts,
                    k,
                    scoring: MoeScoring::Sigmoid,
                    renormalize: 1,
                    scale: 2.5,
                })
            }),
        });
    }
    out
}

/// The decode experts: Nano's widths at batch 1 (6 of 8 experts) and 4 rows (6 of 12), the
/// scalar path, empty slots; the down launch at Nano's widths.
fn decode_cases(rng: &mut Rng) -> Vec<Case> {
    let mut out = Vec::new();
    for &(rows, experts, k, inter, hidden, empty) in &[
        (1u32, 8u32, 6u32, INTER, HIDDEN, 0usize),
        (4, 12, 6, INTER, HIDDEN, 0),
        (2, 7, 3, 37, 130, 0),
        (3, 6, 2, 64, 64, 2),
    ] {
        let (n, i, h) = ((rows * k) as usize, inter as usize, hidden as usize);
        let ids = routed_ids(rng, rows, experts, k, empty);
        out.push(Case {
            kernel: MoeGemvRelu2::NAME,
            gemm: None,
            allowance: None,
            shape: format!(
                "rows={rows} experts={experts} k={k} inter={inter} hidden={hidden} empty={empty}"
            ),
            buffers: vec![
                output(vec![0; n * i * 2], OutputKind::Bf16),
                input(bf16_normal(rng, rows as usize * h, 1.0)),
                input(bf16_normal(
                    rng,
                    experts as usize * i * h,
                    2.0 / (hidden as f32).sqrt(),
                )),
                input(i32_bytes(&ids)),
            ],
            build: Box::new(move |p| {
                launch_of(MoeGemvRelu2 {
                    shared_act: DevicePtr::NULL,
                    shared_w: DevicePtr::NULL,
                    shared_inter: 0,
                    act: p[0],
                    x: p[1],
                    w: p[2],
                    ids: p[3],
                    rows,
                    k,
                    experts,
                    inter,
                    hidden,
                })
            }),
        });
    }
    // The down launch on Nano's widths, its shared expert (ungated: a null gate) added.
    let (rows, experts, k) = (2u32, 8u32, 6u32);
    let (n, i, h) = ((rows * k) as usize, INTER as usize, HIDDEN as usize);
    let ids = routed_ids(rng, rows, experts, k, 0);
    let weights = routed_weights(rng, n);
    out.push(Case {
        kernel: MoeGemvDown::NAME,
        gemm: None,
        allowance: None,
        shape: format!(
            "rows={rows} experts={experts} k={k} hidden={HIDDEN} inter={INTER} shared ungated \
             (Nemotron-3-Nano)"
        ),
        buffers: vec![
            output(vec![0; rows as usize * h * 2], OutputKind::Bf16),
            input(bf16_normal(rng, n * i, 1.0)),
            input(bf16_normal(
                rng,
                experts as usize * h * i,
                1.0 / (INTER as f32).sqrt(),
            )),
            input(i32_bytes(&ids)),
            input(f32_bytes(&weights)),
            input(bf16_normal(rng, rows as usize * h, 1.0)),
        ],
        build: Box::new(move |p| {
            launch_of(MoeGemvDown {
                shared_act: DevicePtr::NULL,
                shared_w: DevicePtr::NULL,
                shared_inter: 0,
                out: p[0],
                act: p[1],
                w: p[2],
                ids: p[3],
                weights: p[4],
                shared: p[5],
                shared_gate: DevicePtr::NULL,
                rows,
                k,
                experts,
                hidden: HIDDEN,
                inter: INTER,
            })
        }),
    });
    out
}

/// The grouped up product's three forms on one grouping each (the same inputs), and the grouped
/// down product at Nano's widths: 16 rows of top 6 over 8 experts (12 rows an expert on average),
/// 200 rows of top 2 on 3 experts (about 133 rows each: three 64-row tiles and five 32-row
/// passes, the last partial) with ragged column tiles, the scalar path, empty slots.
fn grouped_cases(rng: &mut Rng) -> Vec<Case> {
    let mut out = Vec::new();
    for &(rows, experts, k, inter, hidden, empty) in &[
        (16u32, 8u32, 6u32, INTER, HIDDEN, 0usize),
        (200, 3, 2, 100, 96, 0),
        (9, 7, 3, 37, 130, 0),
        (12, 6, 2, 64, 64, 3),
    ] {
        let (n, i, h) = ((rows * k) as usize, inter as usize, hidden as usize);
        let ids = routed_ids(rng, rows, experts, k, empty);
        let (offsets, sorted) = group_by_expert(&ids, experts as usize);
        let shape = format!(
            "rows={rows} experts={experts} k={k} inter={inter} hidden={hidden} empty={empty}"
        );
        let buffers: Vec<Buffer> = vec![
            output(vec![0; n * i * 2], OutputKind::Bf16),
            input(bf16_normal(rng, rows as usize * h, 1.0)),
            input(bf16_normal(
                rng,
                experts as usize * i * h,
                2.0 / (hidden as f32).sqrt(),
            )),
            input(i32_bytes(&offsets)),
            input(i32_bytes(&sorted)),
        ];
        let gemm = MoeGemmRelu2 {
            act: DevicePtr::NULL,
            x: DevicePtr::NULL,
            w: DevicePtr::NULL,
            offsets: DevicePtr::NULL,
            sorted: DevicePtr::NULL,
            k,
            experts,
            inter,
            hidden,
        };
        let with = move |p: &[DevicePtr]| MoeGemmRelu2 {
            act: p[0],
            x: p[1],
            w: p[2],
            offsets: p[3],
            sorted: p[4],
            ..gemm
        };
        // An up product at a bf16 rounding boundary may round either way in another f32 sum
        // order, and the square spreads that over several bf16 steps: the reference's allowance.
        let flips = || -> Option<Allowance> {
            let inputs = buffers.clone();
            Some(Allowance::new(0, move || {
                // Positions past the assigned rows are not written: no allowance there.
                let mut extra = host_allowance(&inputs, with, |k, mem| k.flip_allowance(mem));
                extra.resize(n * i, 0.0);
                extra
            }))
        };
        out.push(Case {
            kernel: MoeGroupedMmaRelu2::NAME,
            gemm: None,
            allowance: flips(),
            shape: shape.clone(),
            buffers: buffers.clone(),
            build: Box::new(move |p| launch_of(MoeGroupedMmaRelu2::from(with(p)))),
        });
        out.push(Case {
            kernel: MoeGroupedGemvRelu2::NAME,
            gemm: None,
            allowance: flips(),
            shape: shape.clone(),
            buffers: buffers.clone(),
            build: Box::new(move |p| launch_of(MoeGroupedGemvRelu2::from(with(p)))),
        });
        out.push(Case {
            kernel: MoeGemmRelu2::NAME,
            gemm: None,
            allowance: flips(),
            shape,
            buffers,
            build: Box::new(move |p| launch_of(with(p))),
        });
    }
    // The grouped down product on Nano's widths (16 rows of top 6 over 8 experts).
    let (rows, experts, k) = (16u32, 8u32, 6u32);
    let (n, i, h) = ((rows * k) as usize, INTER as usize, HIDDEN as usize);
    let ids = routed_ids(rng, rows, experts, k, 0);
    let (offsets, sorted) = group_by_expert(&ids, experts as usize);
    out.push(Case {
        kernel: MoeGemmDown::NAME,
        gemm: None,
        allowance: None,
        shape: format!(
            "rows={rows} experts={experts} k={k} hidden={HIDDEN} inter={INTER} (Nemotron-3-Nano)"
        ),
        buffers: vec![
            output(vec![0; n * h * 2], OutputKind::Bf16),
            input(bf16_normal(rng, n * i, 1.0)),
            input(bf16_normal(
                rng,
                experts as usize * h * i,
                1.0 / (INTER as f32).sqrt(),
            )),
            input(i32_bytes(&offsets)),
            input(i32_bytes(&sorted)),
        ],
        build: Box::new(move |p| {
            launch_of(MoeGemmDown {
                y: p[0],
                act: p[1],
                w: p[2],
                offsets: p[3],
                sorted: p[4],
                experts,
                hidden: HIDDEN,
                inter: INTER,
            })
        }),
    });
    out
}
