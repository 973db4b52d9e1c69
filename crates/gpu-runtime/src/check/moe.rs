// SPDX-License-Identifier: MIT OR Apache-2.0
//! Parity cases of the MoE kernels (`moe.cu`): Qwen3-30B-A3B's shapes (128 experts, top 8, hidden
//! 2048, expert width 768; the expert products over fewer experts, as the bytes of 128 would only
//! slow the host), Qwen2-57B-A14B's and MiniMax-M2's routing, and the edges: one slot a row, every
//! expert a row, expert counts that are not powers of two, rows off the 16-byte path, empty slots
//! (ids outside the experts), experts with more rows than one 64-row tile; the shared expert's
//! term in both down epilogues (Qwen1.5-MoE-A2.7B's widths), with and without its gate.

use metrale_core::DevicePtr;
use metrale_kernels::KernelAbi;
use metrale_kernels::ops::{
    MoeCombine, MoeGemmDown, MoeGemmSwiglu, MoeGemvDown, MoeGemvSwiglu, MoeGroup,
    MoeGroupedGemvDown, MoeGroupedGemvSwiglu, MoeRoute, MoeScoring, group_by_expert,
};
use metrale_kernels::ops::{
    MoeGemmRelu2, MoeGroupedMmaDown, MoeGroupedMmaSwiglu, MoeWgmmaDown, MoeWgmmaRelu2,
    MoeWgmmaSwiglu,
};

use super::{
    Buffer, Case, Init, OutputKind, Rng, bf16_normal, f32_bytes, i32_bytes, launch_of, shuffled,
};

/// Every MoE case, in a fixed order.
pub(super) fn moe_cases(rng: &mut Rng) -> Vec<Case> {
    let mut out = route_cases(rng);
    out.extend(decode_cases(rng));
    out.extend(group_cases(rng));
    out.extend(grouped_product_cases(rng));
    out.extend(combine_cases(rng));
    // Last, so that the cases before keep their random inputs.
    out.extend(shared_expert_cases(rng));
    out.extend(wgmma_cases(rng));
    out
}

/// The grouped products on warpgroup MMA (prefill), each beside `moe_gemm_*` on the same inputs:
/// Qwen3-30B-A3B's widths, one expert taking every row (three 128-row tiles, the last of 4 rows)
/// with an expert no row takes, widths off the 64-element pieces and the 64- and 128-column
/// tiles (inter 72, hidden 136), empty slots, and the squared-ReLU form.
fn wgmma_cases(rng: &mut Rng) -> Vec<Case> {
    let mut out = Vec::new();
    for &(rows, experts, k, inter, hidden, empty, popular, relu2) in &[
        (16u32, 8u32, 2u32, 768u32, 2048u32, 0usize, false, false),
        (260, 12, 3, 128, 192, 0, true, false),
        (77, 5, 2, 72, 136, 0, false, false),
        (12, 6, 2, 64, 64, 3, false, false),
        (200, 4, 2, 200, 128, 0, false, true),
    ] {
        let (n, i, h) = ((rows * k) as usize, inter as usize, hidden as usize);
        let mut ids = routed_ids(rng, rows, experts - popular as u32, k, empty);
        if popular {
            // Slot 0 of every row takes expert 2; the last expert is never taken.
            for r in 0..rows as usize {
                let row = &mut ids[r * k as usize..(r + 1) * k as usize];
                if let Some(at) = row.iter().position(|&e| e == 2) {
                    row.swap(0, at);
                } else {
                    row[0] = 2;
                }
            }
        }
        let (offsets, sorted) = group_by_expert(&ids, experts as usize);
        let rows_w = if relu2 { 1 } else { 2 };
        let shape = format!(
            "rows={rows} experts={experts} k={k} inter={inter} hidden={hidden} empty={empty}{}{}",
            if popular {
                " one expert in every row"
            } else {
                ""
            },
            if relu2 { " relu2" } else { "" },
        );
        let buffers = vec![
            output(vec![0; n * i * 2], OutputKind::Bf16),
            input(bf16_normal(rng, rows as usize * h, 1.0)),
            input(bf16_normal(
                rng,
                experts as usize * rows_w * i * h,
                2.0 / (hidden as f32).sqrt(),
            )),
            input(i32_bytes(&offsets)),
            input(i32_bytes(&sorted)),
        ];
        let first = move |p: &[DevicePtr]| MoeGemmSwiglu {
            act: p[0],
            x: p[1],
            w: p[2],
            offsets: p[3],
            sorted: p[4],
            k,
            experts,
            inter,
            hidden,
        };
        for wgmma in [true, false] {
            let kernel = match (wgmma, relu2) {
                (true, false) => MoeWgmmaSwiglu::NAME,
                (true, true) => MoeWgmmaRelu2::NAME,
                (false, false) => MoeGemmSwiglu::NAME,
                (false, true) => MoeGemmRelu2::NAME,
            };
            out.push(Case {
                kernel,
                gemm: None,
                allowance: None,
                shape: shape.clone(),
                buffers: buffers.clone(),
                build: Box::new(move |p| {
                    let a = first(p);
                    match (wgmma, relu2) {
                        (true, false) => launch_of(MoeWgmmaSwiglu::from(a)),
                        (true, true) => launch_of(MoeWgmmaRelu2::from(MoeGemmRelu2::from(a))),
                        (false, false) => launch_of(a),
                        (false, true) => launch_of(MoeGemmRelu2::from(a)),
                    }
                }),
            });
        }
        if relu2 {
            continue;
        }
        // The down product of the same grouping, its width and height swapped.
        let (dh, di) = (inter, hidden);
        let shape = format!(
            "rows={rows} experts={experts} k={k} hidden={dh} inter={di} empty={empty}{}",
            if popular {
                " one expert in every row"
            } else {
                ""
            },
        );
        let buffers = vec![
            output(vec![0; n * dh as usize * 2], OutputKind::Bf16),
            input(bf16_normal(rng, n * di as usize, 1.0)),
            input(bf16_normal(
                rng,
                experts as usize * (dh * di) as usize,
                1.0 / (di as f32).sqrt(),
            )),
            input(i32_bytes(&offsets)),
            input(i32_bytes(&sorted)),
        ];
        let down = move |p: &[DevicePtr]| MoeGemmDown {
            y: p[0],
            act: p[1],
            w: p[2],
            offsets: p[3],
            sorted: p[4],
            experts,
            hidden: dh,
            inter: di,
        };
        for wgmma in [true, false] {
            out.push(Case {
                kernel: if wgmma {
                    MoeWgmmaDown::NAME
                } else {
                    MoeGemmDown::NAME
                },
                gemm: None,
                allowance: None,
                shape: shape.clone(),
                buffers: buffers.clone(),
                build: Box::new(move |p| {
                    if wgmma {
                        launch_of(MoeWgmmaDown::from(down(p)))
                    } else {
                        launch_of(down(p))
                    }
                }),
            });
        }
    }
    out
}

/// `rows` rows of `k` distinct experts of `experts`; `empty` slots (a -1 and an id past the
/// experts, alternately) replace the last slots of the first rows.
pub(super) fn routed_ids(rng: &mut Rng, rows: u32, experts: u32, k: u32, empty: usize) -> Vec<i32> {
    let mut ids: Vec<i32> = (0..rows)
        .flat_map(|_| shuffled(rng, experts as usize).into_iter().take(k as usize))
        .collect();
    for i in 0..empty.min(rows as usize) {
        ids[i * k as usize + k as usize - 1] = if i % 2 == 0 { -1 } else { experts as i32 };
    }
    ids
}

/// Routing weights in (0, 1].
pub(super) fn routed_weights(rng: &mut Rng, n: usize) -> Vec<f32> {
    (0..n).map(|_| 1.0 - rng.uniform()).collect()
}

pub(super) fn input(init: impl Into<Init>) -> Buffer {
    Buffer {
        init: init.into(),
        output: None,
    }
}

pub(super) fn output(init: Vec<u8>, kind: OutputKind) -> Buffer {
    Buffer {
        init: init.into(),
        output: Some(kind),
    }
}

/// The router. Logits on a grid of 1/8 (biases of 1/64), so that equal keys are exact ties on
/// both sides and different ones lie far apart: host and device choose the same experts although
/// their `exp` differ in the last bit. A row of equal logits and rows of repeated values pin the
/// tie order.
fn route_cases(rng: &mut Rng) -> Vec<Case> {
    let on_grid = |rng: &mut Rng, n: usize, step: f32| -> Vec<f32> {
        (0..n)
            .map(|_| (rng.normal() * 2.0 / step).round() * step)
            .collect()
    };
    let mut out = Vec::new();
    for &(rows, experts, k, scoring, renormalize, scale, biased, ties) in &[
        // Qwen3-30B-A3B / Qwen3-235B-A22B, one row and a batch.
        (
            1u32,
            128u32,
            8u32,
            MoeScoring::Softmax,
            1u32,
            1.0f32,
            false,
            false,
        ),
        (5, 128, 8, MoeScoring::Softmax, 1, 1.0, false, false),
        // Qwen2-57B-A14B (norm_topk_prob false).
        (3, 64, 8, MoeScoring::Softmax, 0, 1.0, false, false),
        // MiniMax-M2, and DeepSeek-V3's routed scaling.
        (4, 256, 8, MoeScoring::Sigmoid, 1, 1.0, true, false),
        (2, 256, 8, MoeScoring::Sigmoid, 1, 2.5, true, false),
        // One slot of 7 experts over three blocks of rows; every expert of 16; the largest E, k.
        (9, 7, 1, MoeScoring::Softmax, 1, 1.0, false, false),
        (2, 16, 16, MoeScoring::Sigmoid, 0, 1.0, false, false),
        (3, 512, 16, MoeScoring::Softmax, 0, 1.0, false, false),
        // Ties: rows of equal logits, and of few distinct values.
        (3, 60, 4, MoeScoring::Softmax, 1, 1.0, false, true),
        (3, 60, 4, MoeScoring::Sigmoid, 1, 1.0, true, true),
    ] {
        let (r, e, kk) = (rows as usize, experts as usize, k as usize);
        let mut logits = on_grid(rng, r * e, 0.125);
        if ties {
            logits[..e].fill(0.5);
            for v in &mut logits[e..] {
                *v = (*v * 2.0).round().clamp(-1.0, 1.0);
            }
        }
        let bias = on_grid(rng, e, 1.0 / 64.0)
            .into_iter()
            .map(|b| {
                if ties {
                    (b * 2.0).round() / 4.0
                } else {
                    b * 0.1
                }
            })
            .map(|b| (b * 64.0).round() / 64.0)
            .collect::<Vec<f32>>();
        out.push(Case {
            kernel: MoeRoute::NAME,
            gemm: None,
            allowance: None,
            shape: format!(
                "rows={rows} experts={experts} k={k} {scoring:?} renormalize={renormalize} \
                 scale={scale} bias={biased} ties={ties}"
            ),
            buffers: vec![
                output(vec![0xFF; r * kk * 4], OutputKind::I32),
                output(vec![0xFF; r * kk * 4], OutputKind::F32),
                input(f32_bytes(&logits)),
                input(f32_bytes(&bias)),
            ],
            build: Box::new(move |p| {
                launch_of(MoeRoute {
                    topk_ids: p[0],
                    topk_weights: p[1],
                    logits: p[2],
                    correction_bias: if biased { p[3] } else { DevicePtr::NULL },
                    rows,
                    experts,
                    k,
                    scoring,
                    renormalize,
                    scale,
                })
            }),
        });
    }
    out
}

/// The decode experts: Qwen3-30B-A3B's widths with k = E = 8 and with 8 of 12 over 4 rows, one
/// slot of 5 experts, the scalar path (hidden 130, width 37), and empty slots.
fn decode_cases(rng: &mut Rng) -> Vec<Case> {
    let mut out = Vec::new();
    for &(rows, experts, k, inter, hidden, empty) in &[
        (1u32, 8u32, 8u32, 768u32, 2048u32, 0usize),
        (4, 12, 8, 768, 2048, 0),
        (3, 5, 1, 96, 256, 0),
        (2, 7, 3, 37, 130, 0),
        (3, 6, 2, 64, 64, 2),
    ] {
        let (n, i, h) = ((rows * k) as usize, inter as usize, hidden as usize);
        let ids = routed_ids(rng, rows, experts, k, empty);
        out.push(Case {
            kernel: MoeGemvSwiglu::NAME,
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
                    experts as usize * 2 * i * h,
                    2.0 / (hidden as f32).sqrt(),
                )),
                input(i32_bytes(&ids)),
            ],
            build: Box::new(move |p| {
                launch_of(MoeGemvSwiglu {
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
        let ids = routed_ids(rng, rows, experts, k, empty);
        let weights = routed_weights(rng, n);
        out.push(Case {
            kernel: MoeGemvDown::NAME,
            gemm: None,
            allowance: None,
            shape: format!(
                "rows={rows} experts={experts} k={k} hidden={hidden} inter={inter} empty={empty}"
            ),
            buffers: vec![
                output(vec![0; rows as usize * h * 2], OutputKind::Bf16),
                input(bf16_normal(rng, n * i, 1.0)),
                input(bf16_normal(
                    rng,
                    experts as usize * h * i,
                    1.0 / (inter as f32).sqrt(),
                )),
                input(i32_bytes(&ids)),
                input(f32_bytes(&weights)),
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
                    shared: DevicePtr::NULL,
                    shared_gate: DevicePtr::NULL,
                    rows,
                    k,
                    experts,
                    hidden,
                    inter,
                })
            }),
        });
    }
    out
}

/// The grouping: one decode row of Qwen3-30B-A3B, a prefill chunk of 64 rows, 60 experts, the
/// largest E and k over 1000 rows (16000 assignments: every warp's run is long), k = E, and empty
/// slots (the tail of `sorted` is -1).
fn group_cases(rng: &mut Rng) -> Vec<Case> {
    let mut out = Vec::new();
    for &(rows, experts, k, empty) in &[
        (1u32, 128u32, 8u32, 0usize),
        (64, 128, 8, 0),
        (300, 60, 4, 0),
        (1000, 512, 16, 0),
        (5, 3, 3, 0),
        (20, 10, 2, 7),
    ] {
        let n = rows * k;
        let ids = routed_ids(rng, rows, experts, k, empty);
        out.push(Case {
            kernel: MoeGroup::NAME,
            gemm: None,
            allowance: None,
            shape: format!("rows={rows} experts={experts} k={k} empty={empty}"),
            buffers: vec![
                output(vec![0xFF; (experts as usize + 1) * 4], OutputKind::I32),
                output(vec![0xFF; n as usize * 4], OutputKind::I32),
                input(i32_bytes(&ids)),
            ],
            build: Box::new(move |p| {
                launch_of(MoeGroup {
                    offsets: p[0],
                    sorted: p[1],
                    ids: p[2],
                    n,
                    experts,
                })
            }),
        });
    }
    out
}

/// The grouped products over a grouping made on the host: Qwen3-30B-A3B's widths over 16 rows of
/// 8 experts, 200 rows on 3 experts (about 133 rows each: three 64-row tiles, the last partial)
/// with ragged column tiles, the scalar path, and empty slots (their rows are not written).
fn grouped_product_cases(rng: &mut Rng) -> Vec<Case> {
    let mut out = Vec::new();
    for &(rows, experts, k, inter, hidden, empty) in &[
        (16u32, 8u32, 2u32, 768u32, 2048u32, 0usize),
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
        let buffers = vec![
            output(vec![0; n * i * 2], OutputKind::Bf16),
            input(bf16_normal(rng, rows as usize * h, 1.0)),
            input(bf16_normal(
                rng,
                experts as usize * 2 * i * h,
                2.0 / (hidden as f32).sqrt(),
            )),
            input(i32_bytes(&offsets)),
            input(i32_bytes(&sorted)),
        ];
        // The weight-stream forms of the same product, on the same inputs (drawn once).
        out.push(mma_swiglu_case(
            shape.clone(),
            buffers.clone(),
            (k, experts, inter, hidden),
        ));
        out.push(Case {
            kernel: MoeGroupedGemvSwiglu::NAME,
            gemm: None,
            allowance: None,
            shape: shape.clone(),
            buffers: buffers.clone(),
            build: Box::new(move |p| {
                launch_of(MoeGroupedGemvSwiglu {
                    act: p[0],
                    x: p[1],
                    w: p[2],
                    offsets: p[3],
                    sorted: p[4],
                    k,
                    experts,
                    inter,
                    hidden,
                })
            }),
        });
        out.push(Case {
            kernel: MoeGemmSwiglu::NAME,
            gemm: None,
            allowance: None,
            shape,
            buffers,
            build: Box::new(move |p| {
                launch_of(MoeGemmSwiglu {
                    act: p[0],
                    x: p[1],
                    w: p[2],
                    offsets: p[3],
                    sorted: p[4],
                    k,
                    experts,
                    inter,
                    hidden,
                })
            }),
        });
        // The down product of the same grouping, its width and height swapped.
        let (dh, di) = (inter, hidden);
        let shape =
            format!("rows={rows} experts={experts} k={k} hidden={dh} inter={di} empty={empty}");
        let buffers = vec![
            output(vec![0; n * dh as usize * 2], OutputKind::Bf16),
            input(bf16_normal(rng, n * di as usize, 1.0)),
            input(bf16_normal(
                rng,
                experts as usize * (dh * di) as usize,
                1.0 / (di as f32).sqrt(),
            )),
            input(i32_bytes(&offsets)),
            input(i32_bytes(&sorted)),
        ];
        out.push(mma_down_case(
            shape.clone(),
            buffers.clone(),
            (experts, dh, di),
        ));
        out.push(Case {
            kernel: MoeGroupedGemvDown::NAME,
            gemm: None,
            allowance: None,
            shape: shape.clone(),
            buffers: buffers.clone(),
            build: Box::new(move |p| {
                launch_of(MoeGroupedGemvDown {
                    y: p[0],
                    act: p[1],
                    w: p[2],
                    offsets: p[3],
                    sorted: p[4],
                    experts,
                    hidden: dh,
                    inter: di,
                })
            }),
        });
        out.push(Case {
            kernel: MoeGemmDown::NAME,
            gemm: None,
            allowance: None,
            shape,
            buffers,
            build: Box::new(move |p| {
                launch_of(MoeGemmDown {
                    y: p[0],
                    act: p[1],
                    w: p[2],
                    offsets: p[3],
                    sorted: p[4],
                    experts,
                    hidden: dh,
                    inter: di,
                })
            }),
        });
    }
    out
}

/// The weighted combine: Qwen3-30B-A3B at one row and at 33, a ragged width with empty slots, one
/// slot a row.
fn combine_cases(rng: &mut Rng) -> Vec<Case> {
    let mut out = Vec::new();
    for &(rows, k, experts, hidden, empty) in &[
        (1u32, 8u32, 128u32, 2048u32, 0usize),
        (33, 8, 128, 2048, 0),
        (5, 3, 7, 130, 3),
        (300, 1, 4, 64, 0),
    ] {
        let n = (rows * k) as usize;
        let ids = routed_ids(rng, rows, experts, k, empty);
        let weights = routed_weights(rng, n);
        out.push(Case {
            kernel: MoeCombine::NAME,
            gemm: None,
            allowance: None,
            shape: format!("rows={rows} k={k} experts={experts} hidden={hidden} empty={empty}"),
            buffers: vec![
                output(
                    vec![0; rows as usize * hidden as usize * 2],
                    OutputKind::Bf16,
                ),
                input(bf16_normal(rng, n * hidden as usize, 1.0)),
                input(i32_bytes(&ids)),
                input(f32_bytes(&weights)),
            ],
            build: Box::new(move |p| {
                launch_of(MoeCombine {
                    out: p[0],
                    y: p[1],
                    ids: p[2],
                    weights: p[3],
                    shared: DevicePtr::NULL,
                    shared_gate: DevicePtr::NULL,
                    rows,
                    k,
                    experts,
                    hidden,
                })
            }),
        });
    }
    out
}

/// The shared expert's output added in the down epilogues: the decode down launch and the
/// combine at Qwen1.5-MoE-A2.7B's widths (hidden 2048, expert width 1408, 60 experts, top 4;
/// the decode launch over fewer experts), a ragged width with empty slots, with the sigmoid gate
/// and without (weight 1).
fn shared_expert_cases(rng: &mut Rng) -> Vec<Case> {
    let mut out = Vec::new();
    // Gate logits spread over sigmoid's range, saturated ends included.
    let gate_logits =
        |rng: &mut Rng, rows: u32| -> Vec<f32> { (0..rows).map(|_| rng.normal() * 4.0).collect() };
    for &(rows, experts, k, inter, hidden, empty, gated) in &[
        (1u32, 6u32, 4u32, 1408u32, 2048u32, 0usize, true),
        (4, 8, 4, 1408, 2048, 0, false),
        (3, 6, 2, 37, 130, 2, true),
    ] {
        let (n, i, h) = ((rows * k) as usize, inter as usize, hidden as usize);
        let ids = routed_ids(rng, rows, experts, k, empty);
        let weights = routed_weights(rng, n);
        let gates = gate_logits(rng, rows);
        out.push(Case {
            kernel: MoeGemvDown::NAME,
            gemm: None,
            allowance: None,
            shape: format!(
                "rows={rows} experts={experts} k={k} hidden={hidden} inter={inter} empty={empty} \
                 shared gated={gated}"
            ),
            buffers: vec![
                output(vec![0; rows as usize * h * 2], OutputKind::Bf16),
                input(bf16_normal(rng, n * i, 1.0)),
                input(bf16_normal(
                    rng,
                    experts as usize * h * i,
                    1.0 / (inter as f32).sqrt(),
                )),
                input(i32_bytes(&ids)),
                input(f32_bytes(&weights)),
                input(bf16_normal(rng, rows as usize * h, 1.0)),
                input(f32_bytes(&gates)),
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
                    shared_gate: if gated { p[6] } else { DevicePtr::NULL },
                    rows,
                    k,
                    experts,
                    hidden,
                    inter,
                })
            }),
        });
    }
    for &(rows, k, experts, hidden, empty, gated) in &[
        (1u32, 4u32, 60u32, 2048u32, 0usize, true),
        (33, 4, 60, 2048, 0, false),
        (5, 3, 7, 130, 3, true),
    ] {
        let n = (rows * k) as usize;
        let ids = routed_ids(rng, rows, experts, k, empty);
        let weights = routed_weights(rng, n);
        let gates = gate_logits(rng, rows);
        out.push(Case {
            kernel: MoeCombine::NAME,
            gemm: None,
            allowance: None,
            shape: format!(
                "rows={rows} k={k} experts={experts} hidden={hidden} empty={empty} \
                 shared gated={gated}"
            ),
            buffers: vec![
                output(
                    vec![0; rows as usize * hidden as usize * 2],
                    OutputKind::Bf16,
                ),
                input(bf16_normal(rng, n * hidden as usize, 1.0)),
                input(i32_bytes(&ids)),
                input(f32_bytes(&weights)),
                input(bf16_normal(rng, rows as usize * hidden as usize, 1.0)),
                input(f32_bytes(&gates)),
            ],
            build: Box::new(move |p| {
                launch_of(MoeCombine {
                    out: p[0],
                    y: p[1],
                    ids: p[2],
                    weights: p[3],
                    shared: p[4],
                    shared_gate: if gated { p[5] } else { DevicePtr::NULL },
                    rows,
                    k,
                    experts,
                    hidden,
                })
            }),
        });
    }
    out
}

/// [`MoeGroupedMmaSwiglu`] on a grouped product's buffers (act, x, w, offsets, sorted), the
/// arguments `(k, experts, inter, hidden)`.
fn mma_swiglu_case(shape: String, buffers: Vec<Buffer>, args: (u32, u32, u32, u32)) -> Case {
    let (k, experts, inter, hidden) = args;
    Case {
        kernel: MoeGroupedMmaSwiglu::NAME,
        gemm: None,
        allowance: None,
        shape,
        buffers,
        build: Box::new(move |p| {
            launch_of(MoeGroupedMmaSwiglu {
                act: p[0],
                x: p[1],
                w: p[2],
                offsets: p[3],
                sorted: p[4],
                k,
                experts,
                inter,
                hidden,
            })
        }),
    }
}

/// [`MoeGroupedMmaDown`] on a grouped down product's buffers (y, act, w, offsets, sorted), the
/// arguments `(experts, hidden, inter)`.
fn mma_down_case(shape: String, buffers: Vec<Buffer>, args: (u32, u32, u32)) -> Case {
    let (experts, hidden, inter) = args;
    Case {
        kernel: MoeGroupedMmaDown::NAME,
        gemm: None,
        allowance: None,
        shape,
        buffers,
        build: Box::new(move |p| {
            launch_of(MoeGroupedMmaDown {
                y: p[0],
                act: p[1],
                w: p[2],
                offsets: p[3],
                sorted: p[4],
                experts,
                hidden,
                inter,
            })
        }),
    }
}

/// The tensor-core weight streams on shapes of their own (drawn after every other case, so that
/// those keep their inputs): Qwen3-30B-A3B's widths over 32 rows of 32 experts with k = 8 (8 rows
/// an expert on average, 1 to about 16: one and two row tiles), and over 150 rows on 4 experts
/// with k = 2 (about 75 rows an expert: three passes of 32 rows, the last partial); a ragged
/// width on 16-byte rows (a partial 16-column tile, K not a whole 128-element round).
pub(super) fn grouped_mma_cases(rng: &mut Rng) -> Vec<Case> {
    let mut out = Vec::new();
    for &(rows, experts, k, inter, hidden) in &[
        (32u32, 32u32, 8u32, 768u32, 2048u32),
        (150, 4, 2, 768, 2048),
        (40, 12, 3, 72, 200),
    ] {
        let (n, i, h) = ((rows * k) as usize, inter as usize, hidden as usize);
        let ids = routed_ids(rng, rows, experts, k, 0);
        let (offsets, sorted) = group_by_expert(&ids, experts as usize);
        out.push(mma_swiglu_case(
            format!("rows={rows} experts={experts} k={k} inter={inter} hidden={hidden}"),
            vec![
                output(vec![0; n * i * 2], OutputKind::Bf16),
                input(bf16_normal(rng, rows as usize * h, 1.0)),
                input(bf16_normal(
                    rng,
                    experts as usize * 2 * i * h,
                    2.0 / (hidden as f32).sqrt(),
                )),
                input(i32_bytes(&offsets)),
                input(i32_bytes(&sorted)),
            ],
            (k, experts, inter, hidden),
        ));
        // The down product of the same grouping: [hidden, inter] weights an expert.
        out.push(mma_down_case(
            format!("rows={rows} experts={experts} k={k} hidden={hidden} inter={inter}"),
            vec![
                output(vec![0; n * h * 2], OutputKind::Bf16),
                input(bf16_normal(rng, n * i, 1.0)),
                input(bf16_normal(
                    rng,
                    experts as usize * h * i,
                    1.0 / (inter as f32).sqrt(),
                )),
                input(i32_bytes(&offsets)),
                input(i32_bytes(&sorted)),
            ],
            (experts, hidden, inter),
        ));
    }
    out
}
