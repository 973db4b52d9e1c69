// SPDX-License-Identifier: MIT OR Apache-2.0
//! The Mixture-of-Experts MLP ([`crate::plan::MlpKind::Moe`]).
//!
//! `x = norm(h)`; router logits `x · Wrouterᵀ` (f32); the top k experts per token and their
//! weights (`moe_route`: softmax or sigmoid scores, renormalised, scaled; steps of at most 8
//! tokens with the tuning's `moe_fused_router` compute the logits, the shared expert's gate logit
//! and the routing in one launch, `moe_router`); every selected
//! expert's first product with its activation (`moe_gemv_swiglu`: gate|up with SiLU x up, or
//! `moe_gemv_relu2`: up with squared ReLU, Nemotron-H's ungated experts); the down products
//! weighted and summed in f32, rounded once (`moe_gemv_down`). Each (token, slot) pair reads its expert's
//! weights: the decode shape. Steps of at least the tuning's `moe_grouped_min_rows` tokens group
//! the assignments by expert instead (`moe_group`), run each expert's rows as one product
//! (on tensor cores from `moe_tensor_core_min_rows` tokens: `moe_wgmma_swiglu`, `moe_wgmma_down`,
//! warpgroup-MMA tiles of every expert over one persistent block an SM, where the widths are
//! multiples of 8, else `moe_gemm_swiglu`, `moe_gemm_down`'s WMMA tiles, the same bits;
//! below that weight streams over the touched experts: `moe_grouped_mma_swiglu`,
//! `moe_grouped_mma_down` on tensor cores with the tuning's `moe_grouped_mma`, else
//! `moe_grouped_gemv_swiglu`, `moe_grouped_gemv_down` on CUDA cores; either way each expert
//! output rounded to bf16 as transformers rounds it) and combine them with the routing weights
//! (`moe_combine`).
//!
//! FP8 experts (the stacks e4m3 with f32 scales: [`LinearWeight`]'s form) take the same
//! thresholds and each launch's FP8 form: the decode launches' (`moe_gemv_fp8_swiglu`,
//! `moe_gemv_fp8_relu2`, `moe_gemv_fp8_down`), and on the grouped path the warpgroup-MMA tiles'
//! (`moe_wgmma_fp8_*`, from `moe_tensor_core_min_rows` where the widths are multiples of 16) or
//! else the tensor-core weight streams' (`moe_grouped_mma_fp8_*`, any shape; there are no
//! CUDA-core or WMMA FP8 forms, so `moe_grouped_mma` does not apply). The grouped FP8 forms turn
//! each e4m3 weight into `bf16(e4m3 × scale)` on its way to the tensor cores: the BF16 forms'
//! values over the dequantised stacks, with no dequantised copy. Their shared expert never rides
//! in the expert launches: it runs as its own (dense, FP8 with the linears) products.
//!
//! The activation ([`MlpActivation`], the spec's) is a property of the block: it picks the four
//! forms of the first product (`_swiglu` or `_relu2` entries, one CUDA template each) and the
//! shared expert's form; routing, grouping, down products and combine are the same launches.
//!
//! A shared expert is a dense MLP every token takes: Qwen2-MoE's SwiGLU one (gate|up with SiLU x
//! up, its down, and its gate logit `x · g`, an f32 product of one column, made by `moe_router`
//! where that runs), GLM-4.5's SwiGLU one without the gate, or Nemotron-H's ungated
//! squared-ReLU one (up, `relu2_bf16`, down). On the
//! per-assignment path with the tuning's `moe_fused_shared_expert` it is extra slots of the two
//! expert launches (`ceil(shared_intermediate / intermediate)` slots a row in the first, its
//! down row after the routed ones in `moe_gemv_down`), its output unrounded like a routed
//! expert's. Otherwise the ordinary products run it between the routing and the experts' down
//! launch, its down output bf16 (rounded as transformers rounds the shared expert's output). The
//! down launch of either path (`moe_gemv_down`, `moe_combine`) adds `sigmoid(logit) * shared`
//! (or `shared`, ungated) to the routed sum in f32 before its one rounding.

use metrale_config::{MlpActivation, RouterKind};
use metrale_core::DevicePtr;
use metrale_gpu_runtime::{GpuBackend, KernelHandle};
use metrale_kernels::KernelAbi;
use metrale_kernels::ops::{
    MOE_ROUTER_MAX_ROWS, MoeCombine, MoeGemmDown, MoeGemmRelu2, MoeGemmSwiglu, MoeGemvDown,
    MoeGemvFp8Down, MoeGemvFp8Relu2, MoeGemvFp8Swiglu, MoeGemvRelu2, MoeGemvSwiglu, MoeGroup,
    MoeGroupedGemvDown, MoeGroupedGemvRelu2, MoeGroupedGemvSwiglu, MoeGroupedMmaDown,
    MoeGroupedMmaFp8Down, MoeGroupedMmaFp8Relu2, MoeGroupedMmaFp8Swiglu, MoeGroupedMmaRelu2,
    MoeGroupedMmaSwiglu, MoeRoute, MoeRouter, MoeScoring, MoeWgmmaDown, MoeWgmmaFp8Down,
    MoeWgmmaFp8Relu2, MoeWgmmaFp8Swiglu, MoeWgmmaRelu2, MoeWgmmaSwiglu, Relu2,
};

use super::{Arena, Block, Step};
use crate::ModelError;
use crate::launch::Launcher;
use crate::linear::{Linear, LinearKernels, LinearWeight, Rows, SwigluLinear};
use crate::plan::MoeSpec;
use crate::residual::{Residual, RmsNorm};
use crate::tuning::Tuning;
use crate::weights::MoeWeights;

#[derive(Clone, Copy, Debug)]
struct Kernels {
    route: KernelHandle,
    router: KernelHandle,
    first: FirstProduct,
    down: KernelHandle,
    group: KernelHandle,
    gemm_down: KernelHandle,
    wgmma_down: KernelHandle,
    stream_down: KernelHandle,
    mma_down: KernelHandle,
    combine: KernelHandle,
    /// `relu2_bf16`, for a squared-ReLU shared expert.
    relu2: KernelHandle,
    /// FP8 experts' down launches: decode, tensor-core weight streams, warpgroup-MMA tiles.
    fp8_down: KernelHandle,
    fp8_mma_down: KernelHandle,
    fp8_wgmma_down: KernelHandle,
}

/// The experts' first product in the activation's forms: the decode launch, and the grouped
/// tensor-core tiles (WMMA and warpgroup MMA), weight streams and tensor-core weight streams; over
/// FP8 stacks the decode launch, the tensor-core weight streams and the warpgroup-MMA tiles. Each
/// takes the SwiGLU entries' arguments (the `_relu2` entries' are the same fields) and launches
/// the activation's entry with its own launch geometry.
#[derive(Clone, Copy, Debug)]
struct FirstProduct {
    activation: MlpActivation,
    decode: KernelHandle,
    /// The decode launch over FP8 experts.
    decode_fp8: KernelHandle,
    gemm: KernelHandle,
    wgmma: KernelHandle,
    stream: KernelHandle,
    mma: KernelHandle,
    /// The grouped forms over FP8 experts.
    mma_fp8: KernelHandle,
    wgmma_fp8: KernelHandle,
}

impl FirstProduct {
    fn new(gpu: &dyn GpuBackend, activation: MlpActivation) -> Result<Self, ModelError> {
        let names = match activation {
            MlpActivation::SwiGlu => [
                MoeGemvSwiglu::NAME,
                MoeGemmSwiglu::NAME,
                MoeGroupedGemvSwiglu::NAME,
                MoeGroupedMmaSwiglu::NAME,
                MoeWgmmaSwiglu::NAME,
                MoeGemvFp8Swiglu::NAME,
                MoeGroupedMmaFp8Swiglu::NAME,
                MoeWgmmaFp8Swiglu::NAME,
            ],
            MlpActivation::Relu2 => [
                MoeGemvRelu2::NAME,
                MoeGemmRelu2::NAME,
                MoeGroupedGemvRelu2::NAME,
                MoeGroupedMmaRelu2::NAME,
                MoeWgmmaRelu2::NAME,
                MoeGemvFp8Relu2::NAME,
                MoeGroupedMmaFp8Relu2::NAME,
                MoeWgmmaFp8Relu2::NAME,
            ],
        };
        Ok(FirstProduct {
            activation,
            decode: gpu.kernel(names[0])?,
            decode_fp8: gpu.kernel(names[5])?,
            gemm: gpu.kernel(names[1])?,
            stream: gpu.kernel(names[2])?,
            mma: gpu.kernel(names[3])?,
            wgmma: gpu.kernel(names[4])?,
            mma_fp8: gpu.kernel(names[6])?,
            wgmma_fp8: gpu.kernel(names[7])?,
        })
    }

    fn decode(&self, l: &Launcher, a: MoeGemvSwiglu) -> Result<(), ModelError> {
        match self.activation {
            MlpActivation::SwiGlu => l.launch(self.decode, "experts", &a),
            MlpActivation::Relu2 => l.launch(self.decode, "experts", &MoeGemvRelu2::from(a)),
        }
    }

    fn decode_fp8(&self, l: &Launcher, a: MoeGemvFp8Swiglu) -> Result<(), ModelError> {
        match self.activation {
            MlpActivation::SwiGlu => l.launch(self.decode_fp8, "experts", &a),
            MlpActivation::Relu2 => l.launch(self.decode_fp8, "experts", &MoeGemvFp8Relu2::from(a)),
        }
    }

    fn mma_fp8(&self, l: &Launcher, a: MoeGroupedMmaFp8Swiglu) -> Result<(), ModelError> {
        match self.activation {
            MlpActivation::SwiGlu => l.launch(self.mma_fp8, "experts", &a),
            MlpActivation::Relu2 => {
                l.launch(self.mma_fp8, "experts", &MoeGroupedMmaFp8Relu2::from(a))
            }
        }
    }

    fn wgmma_fp8(&self, l: &Launcher, a: MoeGroupedMmaFp8Swiglu) -> Result<(), ModelError> {
        match self.activation {
            MlpActivation::SwiGlu => {
                l.launch(self.wgmma_fp8, "experts", &MoeWgmmaFp8Swiglu::from(a))
            }
            MlpActivation::Relu2 => l.launch(self.wgmma_fp8, "experts", &MoeWgmmaFp8Relu2::from(a)),
        }
    }

    fn gemm(&self, l: &Launcher, a: MoeGemmSwiglu) -> Result<(), ModelError> {
        match self.activation {
            MlpActivation::SwiGlu => l.launch(self.gemm, "experts", &a),
            MlpActivation::Relu2 => l.launch(self.gemm, "experts", &MoeGemmRelu2::from(a)),
        }
    }

    fn wgmma(&self, l: &Launcher, a: MoeGemmSwiglu) -> Result<(), ModelError> {
        match self.activation {
            MlpActivation::SwiGlu => l.launch(self.wgmma, "experts", &MoeWgmmaSwiglu::from(a)),
            MlpActivation::Relu2 => l.launch(
                self.wgmma,
                "experts",
                &MoeWgmmaRelu2::from(MoeGemmRelu2::from(a)),
            ),
        }
    }

    fn stream(&self, l: &Launcher, a: MoeGemmSwiglu) -> Result<(), ModelError> {
        match self.activation {
            MlpActivation::SwiGlu => {
                l.launch(self.stream, "experts", &MoeGroupedGemvSwiglu::from(a))
            }
            MlpActivation::Relu2 => l.launch(
                self.stream,
                "experts",
                &MoeGroupedGemvRelu2::from(MoeGemmRelu2::from(a)),
            ),
        }
    }

    fn mma(&self, l: &Launcher, a: MoeGemmSwiglu) -> Result<(), ModelError> {
        match self.activation {
            MlpActivation::SwiGlu => l.launch(self.mma, "experts", &MoeGroupedMmaSwiglu::from(a)),
            MlpActivation::Relu2 => l.launch(
                self.mma,
                "experts",
                &MoeGroupedMmaRelu2::from(MoeGemmRelu2::from(a)),
            ),
        }
    }
}

/// Buffers every MoE block of a step shares (the model's sparse layers have one shape).
#[derive(Clone, Copy, Debug)]
struct Scratch {
    /// f32 `[tokens, experts]`.
    logits: DevicePtr,
    /// u32 `[1]`: `moe_router`'s arrival count, zeroed at allocation; each launch leaves it zero.
    router_counter: DevicePtr,
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
    /// where SiLU x up runs in a launch of its own (a squared-ReLU expert's up product), bf16
    /// `[tokens, shared_intermediate]` activations, bf16 `[tokens, hidden]` output, f32
    /// `[tokens]` gate logits.
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
            router: gpu.kernel(MoeRouter::NAME)?,
            first: FirstProduct::new(gpu, spec.activation)?,
            down: gpu.kernel(MoeGemvDown::NAME)?,
            group: gpu.kernel(MoeGroup::NAME)?,
            gemm_down: gpu.kernel(MoeGemmDown::NAME)?,
            wgmma_down: gpu.kernel(MoeWgmmaDown::NAME)?,
            stream_down: gpu.kernel(MoeGroupedGemvDown::NAME)?,
            mma_down: gpu.kernel(MoeGroupedMmaDown::NAME)?,
            combine: gpu.kernel(MoeCombine::NAME)?,
            relu2: gpu.kernel(Relu2::NAME)?,
            fp8_down: gpu.kernel(MoeGemvFp8Down::NAME)?,
            fp8_mma_down: gpu.kernel(MoeGroupedMmaFp8Down::NAME)?,
            fp8_wgmma_down: gpu.kernel(MoeWgmmaFp8Down::NAME)?,
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
            router_counter: arena.alloc(4)?,
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
        gpu.memset(scratch.router_counter, 0, 4, gpu.default_stream())?;
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
    /// bf16 `[experts, hidden]`: the router's weight, for `moe_router`.
    router_w: DevicePtr,
    /// bf16 `[hidden]`: the shared expert's sigmoid gate (one output column), or null.
    shared_gate_w: DevicePtr,
    /// `[experts, 2 * intermediate, hidden]` (SwiGLU), or `[experts, intermediate, hidden]`
    /// (squared ReLU: the up rows only): bf16, or e4m3 with its scales (the FP8 launches).
    experts_gate_up: LinearWeight,
    /// `[experts, hidden, intermediate]`, in `experts_gate_up`'s dtype (one scale layout each:
    /// the FP8 launches take a stack's `row_shift`).
    experts_down: LinearWeight,
    /// f32 `[experts]`: the sigmoid router's correction bias (MiniMax-M2), or null.
    correction_bias: DevicePtr,
    shared_expert: Option<SharedExpert>,
    /// The shared expert's weights as the decode expert launches take them.
    shared_slots: Option<SharedSlots>,
    shared: Shared,
    hidden: u32,
}

/// The shared expert as extra slots of the decode expert launches (`moe_gemv_*`'s `shared_w`).
#[derive(Clone, Copy, Debug)]
struct SharedSlots {
    /// bf16 `[2 * inter, hidden]` gate|up (SwiGLU) or `[inter, hidden]` up (squared ReLU).
    first: DevicePtr,
    /// bf16 `[hidden, inter]`.
    down: DevicePtr,
    /// The shared expert's width.
    inter: u32,
}

/// Which of the shared expert's launches the MLP still runs on its own.
#[derive(Clone, Copy, Debug)]
struct SharedLaunches {
    /// The gate's logit (not made by `moe_router`).
    gate_logit: bool,
    /// Its products (not slots of the expert launches).
    products: bool,
}

/// The shared expert's products, in the block's activation.
// One a layer, built at load and matched by reference: the variants differ by two products'
// copies of the kernel handles (`LinearKernels`), which boxing would only move to the heap.
#[allow(clippy::large_enum_variant)]
enum SharedExpert {
    /// Qwen2-MoE's, behind a sigmoid gate, or GLM-4.5's, ungated.
    SwiGlu {
        /// `act = silu(x · Wgateᵀ) * (x · Wupᵀ)`, bf16 `[rows, shared_intermediate]`.
        gate_up: SwigluLinear,
        /// `out = act · Wdownᵀ`, bf16 `[rows, hidden]`.
        down: Linear,
        /// The gate's logit `x · g`, f32 `[rows]` (one output column); `None` ungated.
        gate: Option<Linear>,
    },
    /// Nemotron-H's, ungated.
    Relu2 {
        /// `x · Wupᵀ`, bf16 `[rows, shared_intermediate]`; `relu2_bf16` makes the activations.
        up: Linear,
        /// `out = act · Wdownᵀ`, bf16 `[rows, hidden]`.
        down: Linear,
        inter: u32,
    },
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
            let down = Linear::of(
                "shared_down",
                w.shared_down,
                DevicePtr::NULL,
                (hidden, si),
                linear,
            );
            match shared.spec.activation {
                MlpActivation::SwiGlu => SharedExpert::SwiGlu {
                    gate_up: SwigluLinear {
                        gate_up: Linear::of(
                            "shared_gate_up",
                            w.shared_gate_up,
                            DevicePtr::NULL,
                            (2 * si, hidden),
                            linear,
                        ),
                        inter: si,
                        scratch: shared.scratch.shared_gate_up,
                    },
                    down,
                    gate: shared.spec.shared_gated.then(|| {
                        Linear::new(
                            "shared_gate",
                            w.shared_gate,
                            DevicePtr::NULL,
                            (1, hidden),
                            linear,
                        )
                    }),
                },
                MlpActivation::Relu2 => SharedExpert::Relu2 {
                    up: Linear::of(
                        "shared_up",
                        w.shared_gate_up,
                        DevicePtr::NULL,
                        (si, hidden),
                        linear,
                    ),
                    down,
                    inter: si,
                },
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
            router_w: w.router,
            shared_gate_w: w.shared_gate,
            // The slots are BF16 launches: only where the experts and the shared expert are BF16
            // (FP8 experts' launches take none; an FP8 shared expert runs its own products).
            shared_slots: shared
                .spec
                .shared_intermediate
                .filter(|_| {
                    [
                        w.experts_gate_up,
                        w.experts_down,
                        w.shared_gate_up,
                        w.shared_down,
                    ]
                    .iter()
                    .all(|w| w.scales.is_null())
                })
                .map(|si| SharedSlots {
                    first: w.shared_gate_up.w,
                    down: w.shared_down.w,
                    inter: si as u32,
                }),
            experts_gate_up: w.experts_gate_up,
            experts_down: w.experts_down,
            correction_bias: w.correction_bias,
            shared_expert,
            shared,
            hidden,
        }
    }

    /// The router, the shared expert's gate logit and the routing in one launch.
    fn router(&self, x: DevicePtr, rows: u32) -> MoeRouter {
        let (route, sc) = (self.route(rows), &self.shared.scratch);
        let gated = self.shared_gated();
        MoeRouter {
            topk_ids: route.topk_ids,
            topk_weights: route.topk_weights,
            logits: route.logits,
            shared_logit: sc.shared_logit,
            counter: sc.router_counter,
            x,
            w: self.router_w,
            shared_gate_w: if gated {
                self.shared_gate_w
            } else {
                DevicePtr::NULL
            },
            correction_bias: route.correction_bias,
            rows,
            experts: route.experts,
            k: route.k,
            scoring: route.scoring,
            renormalize: route.renormalize,
            scale: route.scale,
            hidden: self.hidden,
        }
    }

    /// Whether the shared expert's output is scaled by its sigmoid gate.
    fn shared_gated(&self) -> bool {
        matches!(
            self.shared_expert,
            Some(SharedExpert::SwiGlu { gate: Some(_), .. })
        )
    }

    /// Whether the routed experts are FP8 (every expert launch's FP8 form).
    fn fp8_experts(&self) -> bool {
        !self.experts_gate_up.scales.is_null()
    }

    /// Whether the decode expert launches take the shared expert as slots of their own.
    fn shared_in_experts(&self, t: &Tuning) -> bool {
        t.moe_fused_shared_expert && self.shared_slots.is_some()
    }

    /// Whether a step of `rows` tokens routes in one launch ([`MoeRouter`]).
    fn fused_router(t: &Tuning, rows: u32) -> bool {
        t.moe_fused_router && (1..=MOE_ROUTER_MAX_ROWS).contains(&rows)
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
    /// [`Moe::run_shared_expert`]; a null gate for an ungated one), or nulls without one.
    fn shared_term(&self) -> (DevicePtr, DevicePtr) {
        let sc = &self.shared.scratch;
        match self.shared_expert {
            Some(_) if self.shared_gated() => (sc.shared_out, sc.shared_logit),
            Some(_) => (sc.shared_out, DevicePtr::NULL),
            None => (DevicePtr::NULL, DevicePtr::NULL),
        }
    }

    /// The shared expert's launches of its own on the normalised rows `x`, if the layer has
    /// one: those `run` names.
    fn run_shared_expert(
        &self,
        l: &Launcher,
        x: DevicePtr,
        rows: u32,
        run: SharedLaunches,
    ) -> Result<(), ModelError> {
        let sc = &self.shared.scratch;
        match &self.shared_expert {
            None => Ok(()),
            Some(SharedExpert::SwiGlu {
                gate_up,
                down,
                gate,
            }) => {
                if run.products {
                    let act = down.input_rows(l.tuning, rows, sc.shared_act);
                    gate_up.run(l, act, Rows::Bf16(x), rows)?;
                    down.run_rows(l, sc.shared_out, act, rows, false)?;
                }
                match (run.gate_logit, gate) {
                    (true, Some(gate)) => gate.run_f32(l, sc.shared_logit, x, rows),
                    _ => Ok(()),
                }
            }
            Some(SharedExpert::Relu2 { .. }) if !run.products => Ok(()),
            Some(SharedExpert::Relu2 { up, down, inter }) => {
                up.run(l, sc.shared_gate_up, x, rows, false)?;
                let act = Relu2 {
                    out: sc.shared_act,
                    x: sc.shared_gate_up,
                    n: rows * inter,
                };
                l.launch(self.shared.kernels.relu2, "relu2", &act)?;
                down.run(l, sc.shared_out, sc.shared_act, rows, false)
            }
        }
    }

    /// The decode form: every (row, slot) pair reads its expert's weights; with the tuning's
    /// `moe_fused_shared_expert` the shared expert is slots of the same two launches.
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
        let slots = match self.shared_in_experts(l.tuning) {
            true => self.shared_slots,
            false => None,
        };
        let (shared_first, shared_down, shared_inter) = slots
            .map_or((DevicePtr::NULL, DevicePtr::NULL, 0), |s| {
                (s.first, s.down, s.inter)
            });
        if self.fp8_experts() {
            // No shared slots (shared_in_experts is false): the shared term is the dense
            // products' output.
            let (gu, dw) = (self.experts_gate_up, self.experts_down);
            let gate_up = MoeGemvFp8Swiglu {
                act: sc.act,
                x,
                w: gu.w,
                scales: gu.scales,
                ids: sc.ids,
                rows,
                k,
                experts,
                inter,
                hidden: self.hidden,
                row_shift: gu.row_shift,
            };
            kernels.first.decode_fp8(l, gate_up)?;
            let (shared, shared_gate) = self.shared_term();
            let down = MoeGemvFp8Down {
                out: sc.out,
                act: sc.act,
                w: dw.w,
                scales: dw.scales,
                ids: sc.ids,
                weights: sc.weights,
                shared,
                shared_gate,
                rows,
                k,
                experts,
                hidden: self.hidden,
                inter,
                row_shift: dw.row_shift,
            };
            return l.launch(kernels.fp8_down, "experts", &down);
        }
        let gate_up = MoeGemvSwiglu {
            shared_act: sc.shared_act,
            shared_w: shared_first,
            shared_inter,
            act: sc.act,
            x,
            w: self.experts_gate_up.w,
            ids: sc.ids,
            rows,
            k,
            experts,
            inter,
            hidden: self.hidden,
        };
        kernels.first.decode(l, gate_up)?;
        let (shared, shared_gate) = match slots {
            Some(_) => (DevicePtr::NULL, self.shared_term().1),
            None => self.shared_term(),
        };
        let down = MoeGemvDown {
            shared_act: sc.shared_act,
            shared_w: shared_down,
            shared_inter,
            out: sc.out,
            act: sc.act,
            w: self.experts_down.w,
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
        let (k, experts) = (spec.top_k as u32, spec.experts as u32);
        let (offsets, sorted) = (sc.offsets, sc.sorted);
        let group = MoeGroup {
            offsets,
            sorted,
            ids: sc.ids,
            n: rows * k,
            experts,
        };
        l.launch(kernels.group, "experts", &group)?;
        match self.fp8_experts() {
            true => self.grouped_fp8_products(l, x, rows)?,
            false => self.grouped_products(l, x, rows)?,
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

impl Moe {
    /// The grouped path's two products over BF16 experts, from `act` (in expert order) to `y` (in
    /// assignment order), in the form the step's rows and the tuning pick.
    fn grouped_products(&self, l: &Launcher, x: DevicePtr, rows: u32) -> Result<(), ModelError> {
        let (spec, sc, kernels) = (
            &self.shared.spec,
            &self.shared.scratch,
            &self.shared.kernels,
        );
        let (inter, experts) = (spec.intermediate as u32, spec.experts as u32);
        let (first_w, down_w) = (self.experts_gate_up.w, self.experts_down.w);
        let gate_up = MoeGemmSwiglu {
            act: sc.act,
            x,
            w: first_w,
            offsets: sc.offsets,
            sorted: sc.sorted,
            k: spec.top_k as u32,
            experts,
            inter,
            hidden: self.hidden,
        };
        let down = MoeGemmDown {
            y: sc.y,
            act: sc.act,
            w: down_w,
            offsets: sc.offsets,
            sorted: sc.sorted,
            experts,
            hidden: self.hidden,
            inter,
        };
        // The warpgroup-MMA tiles where the widths and pointers fit (the same bits as the WMMA
        // tiles, 4-6x faster at prefill sizes: docs/decisions.md), else the WMMA tiles.
        let wgmma =
            MoeWgmmaSwiglu::fits(experts, inter, self.hidden, &[x, sc.act, first_w, down_w]);
        if rows >= l.tuning.moe_tensor_core_min_rows && wgmma {
            kernels.first.wgmma(l, gate_up)?;
            l.launch(kernels.wgmma_down, "experts", &MoeWgmmaDown::from(down))
        } else if rows >= l.tuning.moe_tensor_core_min_rows {
            kernels.first.gemm(l, gate_up)?;
            l.launch(kernels.gemm_down, "experts", &down)
        } else if l.tuning.moe_grouped_mma {
            kernels.first.mma(l, gate_up)?;
            l.launch(kernels.mma_down, "experts", &MoeGroupedMmaDown::from(down))
        } else {
            kernels.first.stream(l, gate_up)?;
            l.launch(
                kernels.stream_down,
                "experts",
                &MoeGroupedGemvDown::from(down),
            )
        }
    }

    /// [`Moe::grouped_products`] over FP8 experts: the warpgroup-MMA tiles' FP8 forms from
    /// `moe_tensor_core_min_rows` rows where the widths (multiples of 16) and pointers fit, else
    /// the tensor-core weight streams' FP8 forms, which take any shape (element by element off
    /// 16-byte rows) and are the only FP8 form below that (no CUDA-core or WMMA FP8 forms:
    /// `moe_grouped_mma` does not apply). Both read the e4m3 stacks and turn each weight into
    /// `bf16(e4m3 × scale)` on the way to the tensor cores: the values of the BF16 forms over the
    /// dequantised stacks, without a dequantised copy.
    fn grouped_fp8_products(
        &self,
        l: &Launcher,
        x: DevicePtr,
        rows: u32,
    ) -> Result<(), ModelError> {
        let (spec, sc, kernels) = (
            &self.shared.spec,
            &self.shared.scratch,
            &self.shared.kernels,
        );
        let (inter, experts) = (spec.intermediate as u32, spec.experts as u32);
        let (gu, dw) = (self.experts_gate_up, self.experts_down);
        let gate_up = MoeGroupedMmaFp8Swiglu {
            act: sc.act,
            x,
            w: gu.w,
            scales: gu.scales,
            offsets: sc.offsets,
            sorted: sc.sorted,
            k: spec.top_k as u32,
            experts,
            inter,
            hidden: self.hidden,
            row_shift: gu.row_shift,
        };
        let down = MoeGroupedMmaFp8Down {
            y: sc.y,
            act: sc.act,
            w: dw.w,
            scales: dw.scales,
            offsets: sc.offsets,
            sorted: sc.sorted,
            experts,
            hidden: self.hidden,
            inter,
            row_shift: dw.row_shift,
        };
        let wgmma = MoeWgmmaFp8Swiglu::fits(experts, inter, self.hidden, &[x, sc.act, gu.w, dw.w]);
        if rows >= l.tuning.moe_tensor_core_min_rows && wgmma {
            kernels.first.wgmma_fp8(l, gate_up)?;
            l.launch(
                kernels.fp8_wgmma_down,
                "experts",
                &MoeWgmmaFp8Down::from(down),
            )
        } else {
            kernels.first.mma_fp8(l, gate_up)?;
            l.launch(kernels.fp8_mma_down, "experts", &down)
        }
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
        let fused_router = Moe::fused_router(l.tuning, rows);
        if fused_router {
            l.launch(kernels.router, "router", &self.router(x, rows))?;
        } else {
            self.router.run_f32(l, sc.logits, x, rows)?;
            l.launch(kernels.route, "router", &self.route(rows))?;
        }
        if let Some(capture) = l.routing {
            capture.record(l.gpu, sc.ids, rows as usize * self.shared.spec.top_k * 4)?;
        }
        let grouped = rows >= l.tuning.moe_grouped_min_rows;
        let run = SharedLaunches {
            gate_logit: !fused_router,
            products: grouped || !self.shared_in_experts(l.tuning),
        };
        self.run_shared_expert(l, x, rows, run)?;
        if grouped {
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
