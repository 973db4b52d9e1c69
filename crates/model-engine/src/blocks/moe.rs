// SPDX-License-Identifier: MIT OR Apache-2.0
//! The Mixture-of-Experts MLP ([`crate::plan::MlpKind::Moe`]).
//!
//! `x = norm(h)`; router logits `x · Wrouterᵀ` (f32); the top k experts per token and their
//! weights (`moe_route`: softmax or sigmoid scores, renormalised, scaled); every selected
//! expert's gate|up product with SiLU x up (`moe_gemv_swiglu`); the down products weighted and
//! summed in f32, rounded once (`moe_gemv_down`). Each (token, slot) pair reads its expert's
//! weights: the decode shape. Steps of at least the tuning's `moe_grouped_min_rows` tokens group
//! the assignments by expert instead (`moe_group`), run each expert's rows as one product
//! (`moe_gemm_swiglu`, `moe_gemm_down` on tensor cores from `moe_tensor_core_min_rows` tokens;
//! below that weight streams over the touched experts: `moe_grouped_mma_swiglu`,
//! `moe_grouped_mma_down` on tensor cores with the tuning's `moe_grouped_mma`, else
//! `moe_grouped_gemv_swiglu`, `moe_grouped_gemv_down` on CUDA cores; either way each expert
//! output rounded to bf16 as transformers rounds it) and combine them with the routing weights
//! (`moe_combine`).
//!
//! A shared expert (Qwen2-MoE) is a dense SwiGLU MLP every token takes, run by the ordinary
//! products between the routing and the experts' down launch: its gate|up with SiLU x up, its
//! down (bf16, rounded as transformers rounds the shared expert's output), and its gate logit
//! `x · g` (an f32 product of one column). The down launch of either path (`moe_gemv_down`,
//! `moe_combine`) adds `sigmoid(logit) * shared` to the routed sum in f32 before its one rounding.

use metrale_config::RouterKind;
use metrale_core::DevicePtr;
use metrale_gpu_runtime::{GpuBackend, KernelHandle};
use metrale_kernels::KernelAbi;
use metrale_kernels::ops::{
    MoeCombine, MoeGemmDown, MoeGemmSwiglu, MoeGemvDown, MoeGemvSwiglu, MoeGroup,
    MoeGroupedGemvDown, MoeGroupedGemvSwiglu, MoeGroupedMmaDown, MoeGroupedMmaSwiglu, MoeRoute,
    MoeScoring,
};

use super::{Arena, Block, Step};
use crate::ModelError;
use crate::launch::Launcher;
use crate::linear::{Linear, LinearKernels, SwigluLinear};
use crate::plan::MoeSpec;
use crate::residual::{Residual, RmsNorm};
use crate::tuning::Tuning;
use crate::weights::MoeWeights;

#[derive(Clone, Copy, Debug)]
struct Kernels {
    route: KernelHandle,
    gate_up: KernelHandle,
    down: KernelHandle,
    group: KernelHandle,
    gemm_gate_up: KernelHandle,
    gemm_down: KernelHandle,
    stream_gate_up: KernelHandle,
    stream_down: KernelHandle,
    mma_gate_up: KernelHandle,
    mma_down: KernelHandle,
    combine: KernelHandle,
}

/// Buffers every MoE block of a step shares (the model's sparse layers have one shape).
#[derive(Clone, Copy, Debug)]
struct Scratch {
    /// f32 `[tokens, experts]`.
    logits: DevicePtr,
    /// i32 `[tokens, top_k]`.
    ids: DevicePtr,
    /// f32 `[tokens, top_k]`.
    weights: DevicePtr,
    /// bf16 `[tokens * top_k, intermediate]`.
    act: DevicePtr,
    /// bf16 `[tokens, hidden]`: the block's output.
    out: DevicePtr,
    /// The grouped path's: i32 `[experts + 1]` offsets, i32 `[tokens * top_k]` assignments in
    /// expert order, bf16 `[tokens * top_k, hidden]` expert outputs in assignment order.
    offsets: DevicePtr,
    sorted: DevicePtr,
    y: DevicePtr,
    /// The shared expert's, null without one: bf16 `[tokens, 2 * shared_intermediate]` gate|up
    /// where SiLU x up runs in a launch of its own, bf16 `[tokens, shared_intermediate]`
    /// activations, bf16 `[tokens, hidden]` output, f32 `[tokens]` gate logits.
    shared_gate_up: DevicePtr,
    shared_act: DevicePtr,
    shared_out: DevicePtr,
    shared_logit: DevicePtr,
}

/// What the MoE blocks of a model share.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Shared {
    spec: MoeSpec,
    kernels: Kernels,
    scratch: Scratch,
}

impl Shared {
    pub(crate) fn new(
        gpu: &dyn GpuBackend,
        arena: &mut Arena,
        spec: MoeSpec,
        max_tokens: usize,
        hidden: usize,
    ) -> Result<Shared, ModelError> {
        let kernels = Kernels {
            route: gpu.kernel(MoeRoute::NAME)?,
            gate_up: gpu.kernel(MoeGemvSwiglu::NAME)?,
            down: gpu.kernel(MoeGemvDown::NAME)?,
            group: gpu.kernel(MoeGroup::NAME)?,
            gemm_gate_up: gpu.kernel(MoeGemmSwiglu::NAME)?,
            gemm_down: gpu.kernel(MoeGemmDown::NAME)?,
            stream_gate_up: gpu.kernel(MoeGroupedGemvSwiglu::NAME)?,
            stream_down: gpu.kernel(MoeGroupedGemvDown::NAME)?,
            mma_gate_up: gpu.kernel(MoeGroupedMmaSwiglu::NAME)?,
            mma_down: gpu.kernel(MoeGroupedMmaDown::NAME)?,
            combine: gpu.kernel(MoeCombine::NAME)?,
        };
        let (t, k) = (max_tokens, spec.top_k);
        let si = spec.shared_intermediate.unwrap_or(0);
        let mut shared = |bytes: usize| match si {
            0 => Ok(DevicePtr::NULL),
            _ => arena.alloc(bytes),
        };
        let (shared_gate_up, shared_act, shared_out, shared_logit) = (
            shared(t * 2 * si * 2)?,
            shared(t * si * 2)?,
            shared(t * hidden * 2)?,
            shared(t * 4)?,
        );
        let scratch = Scratch {
            logits: arena.alloc(t * spec.experts * 4)?,
            ids: arena.alloc(t * k * 4)?,
            weights: arena.alloc(t * k * 4)?,
            act: arena.alloc(t * k * spec.intermediate * 2)?,
            out: arena.alloc(t * hidden * 2)?,
            offsets: arena.alloc((spec.experts + 1) * 4)?,
            sorted: arena.alloc(t * k * 4)?,
            y: arena.alloc(t * k * hidden * 2)?,
            shared_gate_up,
            shared_act,
            shared_out,
            shared_logit,
        };
        Ok(Shared {
            spec,
            kernels,
            scratch,
        })
    }

    /// Whether a layer of `spec` can use these buffers.
    pub(crate) fn fits(&self, spec: &MoeSpec) -> bool {
        self.spec == *spec
    }
}

/// One sparse layer's MLP.
pub(crate) struct Moe {
    norm: RmsNorm,
    router: Linear,
    /// bf16 `[experts, 2 * intermediate, hidden]`.
    experts_gate_up: DevicePtr,
    /// bf16 `[experts, hidden, intermediate]`.
    experts_down: DevicePtr,
    /// f32 `[experts]`: the sigmoid router's correction bias (MiniMax-M2), or null.
    correction_bias: DevicePtr,
    shared_expert: Option<SharedExpert>,
    shared: Shared,
    hidden: u32,
}

/// The shared expert's products (Qwen2-MoE).
struct SharedExpert {
    /// `act = silu(x · Wgateᵀ) * (x · Wupᵀ)`, bf16 `[rows, shared_intermediate]`.
    gate_up: SwigluLinear,
    /// `out = act · Wdownᵀ`, bf16 `[rows, hidden]`.
    down: Linear,
    /// The gate's logit `x · g`, f32 `[rows]` (one output column).
    gate: Linear,
}

impl Moe {
    pub(crate) fn new(
        norm: RmsNorm,
        w: &MoeWeights,
        hidden: u32,
        linear: LinearKernels,
        shared: Shared,
    ) -> Moe {
        let experts = shared.spec.experts as u32;
        let shared_expert = shared.spec.shared_intermediate.map(|si| {
            let si = si as u32;
            SharedExpert {
                gate_up: SwigluLinear {
                    gate_up: Linear::new(
                        "shared_gate_up",
                        w.shared_gate_up,
                        DevicePtr::NULL,
                        (2 * si, hidden),
                        linear,
                    ),
                    inter: si,
                    scratch: shared.scratch.shared_gate_up,
                },
                down: Linear::new(
                    "shared_down",
                    w.shared_down,
                    DevicePtr::NULL,
                    (hidden, si),
                    linear,
                ),
                gate: Linear::new(
                    "shared_gate",
                    w.shared_gate,
                    DevicePtr::NULL,
                    (1, hidden),
                    linear,
                ),
            }
        });
        Moe {
            norm,
            router: Linear::new(
                "router",
                w.router,
                DevicePtr::NULL,
                (experts, hidden),
                linear,
            ),
            experts_gate_up: w.experts_gate_up,
            experts_down: w.experts_down,
            correction_bias: w.correction_bias,
            shared_expert,
            shared,
            hidden,
        }
    }

    fn route(&self, rows: u32) -> MoeRoute {
        let (spec, sc) = (&self.shared.spec, &self.shared.scratch);
        MoeRoute {
            topk_ids: sc.ids,
            topk_weights: sc.weights,
            logits: sc.logits,
            correction_bias: self.correction_bias,
            rows,
            experts: spec.experts as u32,
            k: spec.top_k as u32,
            scoring: match spec.router {
                RouterKind::Softmax => MoeScoring::Softmax,
                RouterKind::SigmoidBias => MoeScoring::Sigmoid,
            },
            renormalize: spec.norm_topk_prob.into(),
            scale: spec.routed_scaling,
        }
    }
}

impl Moe {
    /// The shared expert's output and gate logits for the down launch's epilogue (computed by
    /// [`Moe::run_shared_expert`]), or nulls without one.
    fn shared_term(&self) -> (DevicePtr, DevicePtr) {
        let sc = &self.shared.scratch;
        match self.shared_expert {
            Some(_) => (sc.shared_out, sc.shared_logit),
            None => (DevicePtr::NULL, DevicePtr::NULL),
        }
    }

    /// The shared expert's products on the normalised rows `x`, if the layer has one.
    fn run_shared_expert(&self, l: &Launcher, x: DevicePtr, rows: u32) -> Result<(), ModelError> {
        let (Some(se), sc) = (&self.shared_expert, &self.shared.scratch) else {
            return Ok(());
        };
        se.gate_up.run(l, sc.shared_act, x, rows)?;
        se.down.run(l, sc.shared_out, sc.shared_act, rows, false)?;
        se.gate.run_f32(l, sc.shared_logit, x, rows)
    }

    /// The decode form: every (row, slot) pair reads its expert's weights.
    fn per_assignment(&self, l: &Launcher, x: DevicePtr, rows: u32) -> Result<(), ModelError> {
        let (spec, sc, kernels) = (
            &self.shared.spec,
            &self.shared.scratch,
            &self.shared.kernels,
        );
        let (k, inter, experts) = (
            spec.top_k as u32,
            spec.intermediate as u32,
            spec.experts as u32,
        );
        let gate_up = MoeGemvSwiglu {
            act: sc.act,
            x,
            w: self.experts_gate_up,
            ids: sc.ids,
            rows,
            k,
            experts,
            inter,
            hidden: self.hidden,
        };
        l.launch(kernels.gate_up, "experts", &gate_up)?;
        let (shared, shared_gate) = self.shared_term();
        let down = MoeGemvDown {
            out: sc.out,
            act: sc.act,
            w: self.experts_down,
            ids: sc.ids,
            weights: sc.weights,
            shared,
            shared_gate,
            rows,
            k,
            experts,
            hidden: self.hidden,
            inter,
        };
        l.launch(kernels.down, "experts", &down)
    }

    /// The prefill form: assignments grouped by expert, one tensor-core product per expert's
    /// rows, the outputs combined with the routing weights.
    fn grouped(&self, l: &Launcher, x: DevicePtr, rows: u32) -> Result<(), ModelError> {
        let (spec, sc, kernels) = (
            &self.shared.spec,
            &self.shared.scratch,
            &self.shared.kernels,
        );
        let (k, inter, experts) = (
            spec.top_k as u32,
            spec.intermediate as u32,
            spec.experts as u32,
        );
        let (offsets, sorted) = (sc.offsets, sc.sorted);
        let group = MoeGroup {
            offsets,
            sorted,
            ids: sc.ids,
            n: rows * k,
            experts,
        };
        l.launch(kernels.group, "experts", &group)?;
        let gate_up = MoeGemmSwiglu {
            act: sc.act,
            x,
            w: self.experts_gate_up,
            offsets,
            sorted,
            k,
            experts,
            inter,
            hidden: self.hidden,
        };
        let down = MoeGemmDown {
            y: sc.y,
            act: sc.act,
            w: self.experts_down,
            offsets,
            sorted,
            experts,
            hidden: self.hidden,
            inter,
        };
        if rows >= l.tuning.moe_tensor_core_min_rows {
            l.launch(kernels.gemm_gate_up, "experts", &gate_up)?;
            l.launch(kernels.gemm_down, "experts", &down)?;
        } else if l.tuning.moe_grouped_mma {
            l.launch(
                kernels.mma_gate_up,
                "experts",
                &MoeGroupedMmaSwiglu::from(gate_up),
            )?;
            l.launch(kernels.mma_down, "experts", &MoeGroupedMmaDown::from(down))?;
        } else {
            l.launch(
                kernels.stream_gate_up,
                "experts",
                &MoeGroupedGemvSwiglu::from(gate_up),
            )?;
            l.launch(
                kernels.stream_down,
                "experts",
                &MoeGroupedGemvDown::from(down),
            )?;
        }
        let (shared, shared_gate) = self.shared_term();
        let combine = MoeCombine {
            out: sc.out,
            y: sc.y,
            ids: sc.ids,
            weights: sc.weights,
            shared,
            shared_gate,
            rows,
            k,
            experts,
            hidden: self.hidden,
        };
        l.launch(kernels.combine, "experts", &combine)
    }
}

impl Block for Moe {
    fn enqueue(
        &self,
        l: &Launcher,
        step: &Step,
        residual: &mut Residual,
        _before_fold: bool,
    ) -> Result<(), ModelError> {
        let (sc, kernels) = (&self.shared.scratch, &self.shared.kernels);
        let rows = step.tokens;
        let x = residual.add_norm(l, self.norm, rows)?;
        self.router.run_f32(l, sc.logits, x, rows)?;
        l.launch(kernels.route, "router", &self.route(rows))?;
        if let Some(capture) = l.routing {
            capture.record(l.gpu, sc.ids, rows as usize * self.shared.spec.top_k * 4)?;
        }
        self.run_shared_expert(l, x, rows)?;
        if rows >= l.tuning.moe_grouped_min_rows {
            self.grouped(l, x, rows)?;
        } else {
            self.per_assignment(l, x, rows)?;
        }
        residual.set_pending(sc.out);
        Ok(())
    }

    fn folds_norm(&self, _t: &Tuning, _rows: u32) -> bool {
        false
    }
}
