// SPDX-License-Identifier: MIT OR Apache-2.0
//! Mixture of Experts (`moe.cu`): routing, the selected experts' MLPs, and the weighted combine
//! of their outputs.
//!
//! The vocabulary, shared by every entry:
//! - an **assignment** is one (row, slot) pair of the router's top k, numbered `a = r * k + s`;
//!   `topk_ids[a]` is its expert (an id outside `[0, experts)` means "no expert": its output is
//!   zero and it adds nothing to its row) and `topk_weights[a]` its f32 weight;
//! - the experts' first product is SwiGLU's (the `*Swiglu` entries: gate|up weights stacked
//!   `[experts, 2 * inter, hidden]`, each expert's gate rows then its up rows, the dense model's
//!   fused gate|up once per expert) or squared ReLU's (the `*Relu2` entries, Nemotron-H: up
//!   weights `[experts, inter, hidden]`, no gate); [`ExpertActivation`] names the two, and each
//!   pair of entries is one CUDA template over it. The down weights are `[experts, hidden, inter]`
//!   for both;
//! - every sum over the slots of a row runs in slot order (no atomics): the same bits on every
//!   run.
//!
//! Two paths, one semantics:
//! - **decode** ([`MoeRoute`] after the router's product, or [`MoeRouter`], both in one launch up
//!   to [`MOE_ROUTER_MAX_ROWS`] rows; [`MoeGemvSwiglu`], [`MoeGemvDown`]): weight streams in the
//!   manner of the GEMV, one launch for every selected expert of every row; the down launch
//!   weights and adds the slots inside each output's dot, in f32, and rounds once; a shared
//!   expert may ride in both as extra slots (the first launch's `shared_w`, the down launch's),
//!   its output then unrounded like the routed ones;
//! - **grouped** ([`MoeRoute`], [`MoeGroup`], [`MoeGemmSwiglu`], [`MoeGemmDown`], [`MoeCombine`]):
//!   the assignments grouped by expert, grouped tensor-core products over each expert's rows, each
//!   expert's output rounded to bf16 (as `transformers` in bf16 does) before the f32 combine. For
//!   decode batches, where an expert has a handful of rows, [`MoeGroupedGemvSwiglu`] and
//!   [`MoeGroupedGemvDown`] compute the two products' same values as weight streams over the
//!   touched experts, and [`MoeGroupedMmaSwiglu`] and [`MoeGroupedMmaDown`] on tensor cores,
//!   each touched expert's weights read once per 32 of its rows.
//!
//! FP8 (E4M3) expert stacks take the decode path's FP8 forms ([`MoeGemvFp8Swiglu`],
//! [`MoeGemvFp8Relu2`], [`MoeGemvFp8Down`]: the same launches and values over the dequantised
//! weights, `moe_fp8.cu`) and the grouped tensor-core forms' ([`MoeGroupedMmaFp8Swiglu`],
//! [`MoeGroupedMmaFp8Relu2`], [`MoeGroupedMmaFp8Down`], [`MoeWgmmaFp8Swiglu`],
//! [`MoeWgmmaFp8Relu2`], [`MoeWgmmaFp8Down`]: the BF16 forms' values over the stacks dequantised
//! as [`Fp8DequantBf16`](crate::ops::Fp8DequantBf16) writes them, each weight converted on its
//! way to the tensor cores, `moe.cu`).
//!
//! The MoE block's output is bf16 `[m, hidden]`, as the dense MLP's down product gives it: the
//! residual add + norm that follows takes it unchanged.

/// The three forms of each grouped product take the same arguments: one conversion each way
/// between the tensor-core tile form `$gemm` and `$twin`.
macro_rules! same_args {
    ($gemm:ident <-> $twin:ident { $($field:ident),* }) => {
        impl From<$twin> for $gemm {
            fn from(a: $twin) -> Self {
                let $twin { $($field),* } = a;
                $gemm { $($field),* }
            }
        }
        impl From<$gemm> for $twin {
            fn from(a: $gemm) -> Self {
                let $gemm { $($field),* } = a;
                $twin { $($field),* }
            }
        }
    };
}

mod decode;
mod fp8;
mod grouped;
mod grouped_fp8;
mod grouped_mma;
mod grouped_wgmma;
mod route;
mod router;

pub use decode::{MoeGemvDown, MoeGemvRelu2, MoeGemvSwiglu};
pub use fp8::{MoeGemvFp8Down, MoeGemvFp8Relu2, MoeGemvFp8Swiglu};
pub use grouped::{
    MoeCombine, MoeGemmDown, MoeGemmRelu2, MoeGemmSwiglu, MoeGroup, MoeGroupedGemvDown,
    MoeGroupedGemvRelu2, MoeGroupedGemvSwiglu, group_by_expert,
};
pub use grouped_fp8::{
    MoeGroupedMmaFp8Down, MoeGroupedMmaFp8Relu2, MoeGroupedMmaFp8Swiglu, MoeWgmmaFp8Down,
    MoeWgmmaFp8Relu2, MoeWgmmaFp8Swiglu,
};
pub use grouped_mma::{MoeGroupedMmaDown, MoeGroupedMmaRelu2, MoeGroupedMmaSwiglu};
pub use grouped_wgmma::{MoeWgmmaDown, MoeWgmmaRelu2, MoeWgmmaSwiglu};
pub use route::{MoeRoute, MoeScoring, route_row};
pub use router::{MOE_ROUTER_MAX_ROWS, MoeRouter};

use half::bf16;
use metrale_core::{DevicePtr, KernelName};

use crate::host::{self, HostError, HostMemory, widen};

/// Most experts a MoE entry takes (`MAX_EXPERTS` in moe.cu: the routing warp holds 16 a lane,
/// and [`MoeGroup`]'s per-warp histograms fill 32 KiB of shared memory).
pub const MOE_MAX_EXPERTS: u32 = 512;
/// Most experts a row takes (`MAX_TOP_K` in moe.cu).
pub const MOE_MAX_TOP_K: u32 = 16;

fn bad_args(kernel: KernelName, message: String) -> HostError {
    HostError::BadArgs { kernel, message }
}

/// Refuses `experts` or `k` outside what the kernels take.
fn check_experts(kernel: KernelName, experts: u32, k: u32) -> Result<(), HostError> {
    if !(1..=MOE_MAX_EXPERTS).contains(&experts) {
        return Err(bad_args(
            kernel,
            format!("experts = {experts} is not in 1..={MOE_MAX_EXPERTS}"),
        ));
    }
    if !(1..=MOE_MAX_TOP_K).contains(&k) {
        return Err(bad_args(
            kernel,
            format!("k = {k} is not in 1..={MOE_MAX_TOP_K}"),
        ));
    }
    Ok(())
}

/// The expert of an id, if it names one.
fn expert_of(id: i32, experts: usize) -> Option<usize> {
    usize::try_from(id).ok().filter(|&e| e < experts)
}

/// The experts' activation: which first product an expert computes (`ExpertAct` in moe.cu).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ExpertActivation {
    /// `silu(x . gate[j]) * (x . up[j])`: two weight rows a column, the gate rows first.
    SwiGlu,
    /// `relu(x . up[j])^2`, no gate product (Nemotron-H): one weight row a column.
    Relu2,
}

impl ExpertActivation {
    /// Weight rows an expert holds per activation column.
    pub const fn rows_per_column(self) -> usize {
        match self {
            ExpertActivation::SwiGlu => 2,
            ExpertActivation::Relu2 => 1,
        }
    }
}

/// One assignment's activation row of `inter` columns for expert `expert` of the stacked `w`
/// (`[experts, rows_per_column * inter, hidden]`): each weight row's dot with `x` rounded to bf16
/// first (what a bf16 product stores), then SwiGLU's `silu(g) * u` (as `silu_mul_bf16`) or
/// `relu(u)^2` (as `relu2_bf16`) in f32, unrounded.
fn expert_act(
    x: &[f32],
    w: &[bf16],
    expert: usize,
    inter: usize,
    hidden: usize,
    activation: ExpertActivation,
) -> Vec<f32> {
    let per = activation.rows_per_column() * inter * hidden;
    let rows = &w[expert * per..(expert + 1) * per];
    let mut row = vec![0f32; hidden];
    let mut product = |r: usize| {
        for (dst, src) in row.iter_mut().zip(&rows[r * hidden..(r + 1) * hidden]) {
            *dst = widen(*src);
        }
        crate::host::round_bf16(super::gemm::dot(x, &row))
    };
    (0..inter)
        .map(|j| match activation {
            ExpertActivation::SwiGlu => {
                let g = product(j);
                let u = product(inter + j);
                super::activation::silu(g) * u
            }
            ExpertActivation::Relu2 => {
                let u = product(j).max(0.0);
                u * u
            }
        })
        .collect()
}

/// The shared expert's term from its own products' bf16 output (Qwen2-MoE), added last to every
/// row's routed sum in f32:
/// `out[r, h] += g_r * shared[r, h]` with `g_r = sigmoid(shared_gate[r])` (1 where `shared_gate`
/// is null); nothing where `shared` is null. `out` is `[rows, hidden]`.
fn add_shared(
    mem: &mut dyn HostMemory,
    out: &mut [f32],
    shared: DevicePtr,
    shared_gate: DevicePtr,
    hidden: usize,
) -> Result<(), HostError> {
    if shared.is_null() || hidden == 0 {
        return Ok(());
    }
    let rows = out.len() / hidden;
    let y = host::load_bf16(mem, shared, rows * hidden)?;
    let gates = shared_gates(mem, shared_gate, rows)?;
    for ((row, y), g) in out
        .chunks_exact_mut(hidden)
        .zip(y.chunks_exact(hidden))
        .zip(gates)
    {
        for (o, &v) in row.iter_mut().zip(y) {
            *o = g.mul_add(v, *o);
        }
    }
    Ok(())
}

/// The shared expert's gate of each of `rows` rows: `sigmoid(shared_gate[r])`, or 1 where
/// `shared_gate` is null (an ungated shared expert).
fn shared_gates(
    mem: &dyn HostMemory,
    shared_gate: DevicePtr,
    rows: usize,
) -> Result<Vec<f32>, HostError> {
    Ok(match shared_gate.is_null() {
        true => vec![1.0; rows],
        false => host::load::<f32>(mem, shared_gate, rows)?
            .into_iter()
            .map(|g| 1.0 / (1.0 + (-g).exp()))
            .collect(),
    })
}

/// One assignment's down product in f32: `act . w[expert, h]` for every `h` of the stacked `w`
/// (`[experts, hidden, inter]`).
fn expert_down(act: &[f32], w: &[bf16], expert: usize, hidden: usize, inter: usize) -> Vec<f32> {
    let rows = &w[expert * hidden * inter..(expert + 1) * hidden * inter];
    let mut row = vec![0f32; inter];
    (0..hidden)
        .map(|h| {
            for (dst, src) in row.iter_mut().zip(&rows[h * inter..(h + 1) * inter]) {
                *dst = widen(*src);
            }
            super::gemm::dot(act, &row)
        })
        .collect()
}
