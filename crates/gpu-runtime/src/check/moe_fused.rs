// SPDX-License-Identifier: MIT OR Apache-2.0
//! Parity cases of the fused decode MoE launches: the router in one launch (`moe_router`) at
//! every router kind the engine serves and every decode batch of 1 to 8 rows; the shared expert
//! as extra slots of the decode expert launches (`moe_gemv_swiglu`, `moe_gemv_relu2`,
//! `moe_gemv_down` with `shared_w`) at widths other than the routed experts' (Qwen1.5-MoE-A2.7B:
//! four slots of 1408; Nemotron-3-Nano: two of 1856; Qwen3.5-35B-A3B: one of 512; a partial last
//! slot; the scalar path), behind the sigmoid gate and ungated, with empty routed slots.
//!
//! The router's inputs lie on coarse grids (activations multiples of 1/4, weights of 1/128), so
//! that every partial sum of a logit is exact in f32: host and device compute the same logits
//! whatever order they add in, and choose the same experts, ties included (equal logits are
//! exact ties on both sides). The weights are compared as f32 (their `exp` differ in the last
//! bit), the choices exactly, and the counter must come back zero.

use metrale_core::DevicePtr;
use metrale_kernels::KernelAbi;
use metrale_kernels::ops::{
    ExpertActivation, MoeGemvDown, MoeGemvRelu2, MoeGemvSwiglu, MoeRouter, MoeScoring,
};

use super::moe::{input, output, routed_ids, routed_weights};
use super::{Case, Init, OutputKind, Rng, bf16_normal, f32_bytes, i32_bytes, launch_of};

/// Every fused MoE case, in a fixed order.
pub(super) fn moe_fused_cases(rng: &mut Rng) -> Vec<Case> {
    let mut out = router_cases(rng);
    out.extend(shared_slot_cases(rng));
    out
}

/// `n` bf16 values `round(N(0, spread²)) * step`, clamped to `±limit * step`, drawn from `rng`
/// on first read (as `bf16_normal`: the generator moves past them now). With a power-of-two
/// `step` and a small `limit` every value is exact in bf16.
fn bf16_grid(rng: &mut Rng, n: usize, spread: f32, limit: f32, step: f32) -> Init {
    let mut from = rng.clone();
    rng.skip(2 * n as u64);
    Init::new(move || {
        let v: Vec<half::bf16> = (0..n)
            .map(|_| {
                let q = (from.normal() * spread).round().clamp(-limit, limit);
                half::bf16::from_f32(q * step)
            })
            .collect();
        bytemuck::cast_slice(&v).to_vec()
    })
}

/// A router kind at a model's shape.
#[derive(Clone, Copy)]
struct RouterShape {
    name: &'static str,
    experts: u32,
    k: u32,
    hidden: u32,
    scoring: MoeScoring,
    renormalize: u32,
    scale: f32,
    biased: bool,
    gated: bool,
}

const QWEN3_MOE: RouterShape = RouterShape {
    name: "Qwen3-30B-A3B",
    experts: 128,
    k: 8,
    hidden: 2048,
    scoring: MoeScoring::Softmax,
    renormalize: 1,
    scale: 1.0,
    biased: false,
    gated: false,
};

/// The router in one launch: Qwen3-30B-A3B at every batch of 1 to 8 rows; Qwen1.5-MoE-A2.7B
/// (qwen2_moe: softmax without renormalisation, the shared expert's gate column), Qwen3.5-35B-A3B
/// and Qwen3-Next-80B-A3B (256 and 512 experts, gated shared experts), MiniMax-M2 (sigmoid with
/// the correction bias), a DeepSeek-style routed scaling, Nemotron-3-Nano (sigmoid, bias,
/// renormalised, scaled by 2.5, hidden 2688); and the edges: the scalar path (hidden 130) over 7
/// experts with one slot, every expert chosen (k = E = 16) without a bias, and a row of zeros
/// (every logit 0: the tie order).
fn router_cases(rng: &mut Rng) -> Vec<Case> {
    let mut shapes: Vec<(u32, RouterShape, bool)> =
        (1..=8).map(|rows| (rows, QWEN3_MOE, false)).collect();
    let qwen2_moe = RouterShape {
        name: "Qwen1.5-MoE-A2.7B",
        experts: 60,
        k: 4,
        renormalize: 0,
        gated: true,
        ..QWEN3_MOE
    };
    let qwen3_5 = RouterShape {
        name: "Qwen3.5-35B-A3B",
        experts: 256,
        gated: true,
        ..QWEN3_MOE
    };
    let qwen3_next = RouterShape {
        name: "Qwen3-Next-80B-A3B",
        experts: 512,
        k: 10,
        gated: true,
        ..QWEN3_MOE
    };
    let minimax = RouterShape {
        name: "MiniMax-M2",
        experts: 256,
        hidden: 3072,
        scoring: MoeScoring::Sigmoid,
        biased: true,
        ..QWEN3_MOE
    };
    let deepseek = RouterShape {
        name: "DeepSeek-style scaling",
        scale: 2.5,
        ..minimax
    };
    let nano = RouterShape {
        name: "Nemotron-3-Nano",
        experts: 128,
        k: 6,
        hidden: 2688,
        scale: 2.5,
        ..minimax
    };
    let scalar = RouterShape {
        name: "scalar path",
        experts: 7,
        k: 1,
        hidden: 130,
        gated: true,
        ..QWEN3_MOE
    };
    let every = RouterShape {
        name: "every expert",
        experts: 16,
        k: 16,
        hidden: 64,
        scoring: MoeScoring::Sigmoid,
        renormalize: 0,
        ..QWEN3_MOE
    };
    shapes.extend([
        (1, qwen2_moe, false),
        (5, qwen2_moe, false),
        (1, qwen3_5, false),
        (3, qwen3_5, false),
        (8, qwen3_5, false),
        (2, qwen3_next, false),
        (1, minimax, false),
        (4, minimax, false),
        (2, deepseek, false),
        (1, nano, false),
        (7, nano, false),
        (3, scalar, false),
        (2, every, false),
        (3, QWEN3_MOE, true),
        (2, nano, true),
    ]);
    shapes
        .into_iter()
        .map(|(rows, s, zero_row)| router_case(rng, rows, s, zero_row))
        .collect()
}

fn router_case(rng: &mut Rng, rows: u32, s: RouterShape, zero_row: bool) -> Case {
    let (r, e, k, h) = (
        rows as usize,
        s.experts as usize,
        s.k as usize,
        s.hidden as usize,
    );
    let x = bf16_grid(rng, r * h, 2.0, 8.0, 0.25);
    let x = match zero_row {
        // The first row all zeros: every logit 0.
        true => Init::new(move || {
            let mut bytes = x.bytes().to_vec();
            bytes[..h * 2].fill(0);
            bytes
        }),
        false => x,
    };
    let w = bf16_grid(rng, e * h, 2.0, 8.0, 1.0 / 128.0);
    let gate = bf16_grid(rng, h, 2.0, 8.0, 1.0 / 128.0);
    let bias: Vec<f32> = (0..e)
        .map(|_| (rng.normal() * 6.4).round() / 64.0)
        .collect();
    let RouterShape {
        experts,
        k: kk,
        hidden,
        scoring,
        renormalize,
        scale,
        biased,
        gated,
        ..
    } = s;
    Case {
        kernel: MoeRouter::NAME,
        gemm: None,
        allowance: None,
        shape: format!(
            "rows={rows} experts={experts} k={kk} hidden={hidden} {scoring:?} \
             renormalize={renormalize} scale={scale} bias={biased} gate={gated} \
             zero_row={zero_row} ({})",
            s.name
        ),
        buffers: vec![
            output(vec![0xFF; r * k * 4], OutputKind::I32),
            output(vec![0xFF; r * k * 4], OutputKind::F32),
            output(vec![0xFF; r * e * 4], OutputKind::F32),
            output(vec![0; r * 4], OutputKind::F32),
            output(vec![0; 4], OutputKind::I32),
            input(x),
            input(w),
            input(gate),
            input(f32_bytes(&bias)),
        ],
        build: Box::new(move |p| {
            launch_of(MoeRouter {
                topk_ids: p[0],
                topk_weights: p[1],
                logits: p[2],
                shared_logit: p[3],
                counter: p[4],
                x: p[5],
                w: p[6],
                shared_gate_w: if gated { p[7] } else { DevicePtr::NULL },
                correction_bias: if biased { p[8] } else { DevicePtr::NULL },
                rows,
                experts,
                k: kk,
                scoring,
                renormalize,
                scale,
                hidden,
            })
        }),
    }
}

/// A decode expert shape with a shared expert.
#[derive(Clone, Copy)]
struct SlotShape {
    name: &'static str,
    rows: u32,
    experts: u32,
    k: u32,
    inter: u32,
    hidden: u32,
    shared_inter: u32,
    activation: ExpertActivation,
    gated: bool,
    /// Routed slots left empty (ids outside the experts), as `routed_ids` places them.
    empty: usize,
}

/// The shared expert as slots of the decode expert launches: both launches at each shape (the
/// routed experts over fewer experts than the model's, as the other decode cases).
fn shared_slot_cases(rng: &mut Rng) -> Vec<Case> {
    let qwen1_5 = SlotShape {
        name: "Qwen1.5-MoE-A2.7B",
        rows: 1,
        experts: 6,
        k: 4,
        inter: 1408,
        hidden: 2048,
        shared_inter: 5632,
        activation: ExpertActivation::SwiGlu,
        gated: true,
        empty: 0,
    };
    let qwen3_5 = SlotShape {
        name: "Qwen3.5-35B-A3B",
        experts: 10,
        k: 8,
        inter: 512,
        shared_inter: 512,
        ..qwen1_5
    };
    let nano = SlotShape {
        name: "Nemotron-3-Nano",
        experts: 8,
        k: 6,
        inter: 1856,
        hidden: 2688,
        shared_inter: 3712,
        activation: ExpertActivation::Relu2,
        gated: false,
        ..qwen1_5
    };
    let partial = SlotShape {
        name: "partial last slot, scalar path",
        rows: 2,
        experts: 7,
        k: 3,
        inter: 37,
        hidden: 130,
        shared_inter: 90,
        empty: 1,
        ..qwen1_5
    };
    let narrow = SlotShape {
        name: "shared narrower than routed",
        rows: 3,
        experts: 6,
        k: 2,
        inter: 64,
        hidden: 64,
        shared_inter: 24,
        activation: ExpertActivation::Relu2,
        gated: true,
        empty: 2,
    };
    let mut out = Vec::new();
    for s in [
        qwen1_5,
        SlotShape { rows: 3, ..qwen1_5 },
        qwen3_5,
        SlotShape { rows: 8, ..qwen3_5 },
        nano,
        SlotShape { rows: 4, ..nano },
        partial,
        narrow,
    ] {
        out.push(first_slot_case(rng, s));
        out.push(down_slot_case(rng, s));
    }
    out
}

fn slot_shape_label(s: &SlotShape) -> String {
    format!(
        "rows={} experts={} k={} inter={} hidden={} shared_inter={} {:?} gated={} empty={} ({})",
        s.rows,
        s.experts,
        s.k,
        s.inter,
        s.hidden,
        s.shared_inter,
        s.activation,
        s.gated,
        s.empty,
        s.name
    )
}

/// The first launch with the shared expert's slots: both activations written.
fn first_slot_case(rng: &mut Rng, s: SlotShape) -> Case {
    let (r, n, i, h, si) = (
        s.rows as usize,
        (s.rows * s.k) as usize,
        s.inter as usize,
        s.hidden as usize,
        s.shared_inter as usize,
    );
    let per = s.activation.rows_per_column();
    let ids = routed_ids(rng, s.rows, s.experts, s.k, s.empty);
    let scale = 2.0 / (h as f32).sqrt();
    let SlotShape {
        rows,
        experts,
        k,
        inter,
        hidden,
        shared_inter,
        activation,
        ..
    } = s;
    Case {
        kernel: match activation {
            ExpertActivation::SwiGlu => MoeGemvSwiglu::NAME,
            ExpertActivation::Relu2 => MoeGemvRelu2::NAME,
        },
        gemm: None,
        allowance: None,
        shape: slot_shape_label(&s),
        buffers: vec![
            output(vec![0; n * i * 2], OutputKind::Bf16),
            input(bf16_normal(rng, r * h, 1.0)),
            input(bf16_normal(rng, experts as usize * per * i * h, scale)),
            input(i32_bytes(&ids)),
            output(vec![0; r * si * 2], OutputKind::Bf16),
            input(bf16_normal(rng, per * si * h, scale)),
        ],
        build: Box::new(move |p| {
            let a = MoeGemvSwiglu {
                act: p[0],
                x: p[1],
                w: p[2],
                ids: p[3],
                shared_act: p[4],
                shared_w: p[5],
                rows,
                k,
                experts,
                inter,
                hidden,
                shared_inter,
            };
            match activation {
                ExpertActivation::SwiGlu => launch_of(a),
                ExpertActivation::Relu2 => launch_of(MoeGemvRelu2::from(a)),
            }
        }),
    }
}

/// The down launch with the shared expert's slot after the routed ones, behind its gate (gate
/// logits spread over sigmoid's range) or ungated.
fn down_slot_case(rng: &mut Rng, s: SlotShape) -> Case {
    let (r, n, i, h, si) = (
        s.rows as usize,
        (s.rows * s.k) as usize,
        s.inter as usize,
        s.hidden as usize,
        s.shared_inter as usize,
    );
    let ids = routed_ids(rng, s.rows, s.experts, s.k, s.empty);
    let weights = routed_weights(rng, n);
    let gates: Vec<f32> = (0..r).map(|_| rng.normal() * 4.0).collect();
    let SlotShape {
        rows,
        experts,
        k,
        inter,
        hidden,
        shared_inter,
        gated,
        ..
    } = s;
    Case {
        kernel: MoeGemvDown::NAME,
        gemm: None,
        allowance: None,
        shape: slot_shape_label(&s),
        buffers: vec![
            output(vec![0; r * h * 2], OutputKind::Bf16),
            input(bf16_normal(rng, n * i, 1.0)),
            input(bf16_normal(
                rng,
                experts as usize * h * i,
                1.0 / (i as f32).sqrt(),
            )),
            input(i32_bytes(&ids)),
            input(f32_bytes(&weights)),
            input(f32_bytes(&gates)),
            input(bf16_normal(rng, r * si, 1.0)),
            input(bf16_normal(rng, h * si, 1.0 / (si as f32).sqrt())),
        ],
        build: Box::new(move |p| {
            launch_of(MoeGemvDown {
                out: p[0],
                act: p[1],
                w: p[2],
                ids: p[3],
                weights: p[4],
                shared: DevicePtr::NULL,
                shared_gate: if gated { p[5] } else { DevicePtr::NULL },
                shared_act: p[6],
                shared_w: p[7],
                rows,
                k,
                experts,
                hidden,
                inter,
                shared_inter,
            })
        }),
    }
}
