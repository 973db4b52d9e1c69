// SPDX-License-Identifier: MIT OR Apache-2.0
//! Parity cases of the fused decode MoE launches: the router in one launch (`moe_router`) at
//! every router kind the engine serves and every decode batch of 1 to 8 rows.
//!
//! The router's inputs lie on coarse grids (activations multiples of 1/4, weights of 1/128), so
//! that every partial sum of a logit is exact in f32: host and device compute the same logits
//! whatever order they add in, and choose the same experts, ties included (equal logits are
//! exact ties on both sides). The weights are compared as f32 (their `exp` differ in the last
//! bit), the choices exactly, and the counter must come back zero.

use metrale_core::DevicePtr;
use metrale_kernels::KernelAbi;
use metrale_kernels::ops::{MoeRouter, MoeScoring};

use super::moe::{input, output};
use super::{Case, Init, OutputKind, Rng, f32_bytes, launch_of};

/// Every fused MoE case, in a fixed order.
pub(super) fn moe_fused_cases(rng: &mut Rng) -> Vec<Case> {
    router_cases(rng)
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
