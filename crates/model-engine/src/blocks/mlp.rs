// SPDX-License-Identifier: MIT OR Apache-2.0
//! The dense SwiGLU MLP ([`crate::plan::MlpKind::DenseSwiglu`]):
//! `out = (silu(norm(h) · Wgateᵀ) * (norm(h) · Wupᵀ)) · Wdownᵀ`, the gate and up rows stacked in
//! one weight so one product feeds SiLU x up; and the squared-ReLU MLP of Nemotron-H
//! ([`crate::plan::MlpKind::DenseRelu2`]): `out = relu(norm(h) · Wupᵀ)² · Wdownᵀ`.

use metrale_core::DevicePtr;
use metrale_gpu_runtime::KernelHandle;
use metrale_kernels::KernelAbi;
use metrale_kernels::ops::Relu2;

use super::{Arena, Block, Step};
use crate::ModelError;
use crate::launch::Launcher;
use crate::linear::{Linear, LinearKernels, SwigluLinear};
use crate::residual::{Residual, RmsNorm};
use crate::tuning::Tuning;
use crate::weights::LayerWeights;

/// Buffers every dense MLP block of a step shares.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Scratch {
    /// bf16 `[tokens, 2 * inter]`: gate|up where SiLU x up runs in a launch of its own.
    gate_up: DevicePtr,
    /// bf16 `[tokens, inter]`.
    act: DevicePtr,
    /// bf16 `[tokens, hidden]`: the block's output.
    out: DevicePtr,
}

impl Scratch {
    pub(crate) fn new(
        arena: &mut Arena,
        max_tokens: usize,
        hidden: usize,
        inter: usize,
    ) -> Result<Scratch, ModelError> {
        Ok(Scratch {
            gate_up: arena.alloc(max_tokens * 2 * inter * 2)?,
            act: arena.alloc(max_tokens * inter * 2)?,
            out: arena.alloc(max_tokens * hidden * 2)?,
        })
    }
}

/// One layer's dense MLP.
pub(crate) struct DenseMlp {
    norm: RmsNorm,
    gate_up: SwigluLinear,
    down: Linear,
    scratch: Scratch,
}

impl DenseMlp {
    pub(crate) fn new(
        norm: RmsNorm,
        w: &LayerWeights,
        (hidden, inter): (u32, u32),
        linear: LinearKernels,
        scratch: Scratch,
    ) -> DenseMlp {
        DenseMlp {
            norm,
            gate_up: SwigluLinear {
                gate_up: Linear::of(
                    "gate_up",
                    w.gate_up,
                    DevicePtr::NULL,
                    (2 * inter, hidden),
                    linear,
                ),
                inter,
                scratch: scratch.gate_up,
            },
            down: Linear::of("down", w.down, DevicePtr::NULL, (hidden, inter), linear),
            scratch,
        }
    }
}

impl Block for DenseMlp {
    fn enqueue(
        &self,
        l: &Launcher,
        step: &Step,
        residual: &mut Residual,
        before_fold: bool,
    ) -> Result<(), ModelError> {
        let (sc, n) = (&self.scratch, step.tokens);
        // SiLU x up writes the rows the down product reads: bf16 in `act`, or its e4m3 rows.
        let act = self.down.input_rows(l.tuning, n, sc.act);
        self.gate_up.run_normed(l, residual, self.norm, act, n)?;
        self.down.run_rows(l, sc.out, act, n, before_fold)?;
        residual.set_pending(sc.out);
        Ok(())
    }

    fn folds_norm(&self, t: &Tuning, rows: u32) -> bool {
        self.norm.folds() && self.gate_up.gate_up.folds_norm(t, rows)
    }
}

/// One layer's squared-ReLU MLP (no gate product).
pub(crate) struct DenseRelu2Mlp {
    norm: RmsNorm,
    up: Linear,
    down: Linear,
    inter: u32,
    relu2: KernelHandle,
    scratch: Scratch,
}

impl DenseRelu2Mlp {
    /// Its up product is `w.gate_up` (`[inter, hidden]`), its down `w.down`.
    pub(crate) fn new(
        gpu: &dyn metrale_gpu_runtime::GpuBackend,
        norm: RmsNorm,
        w: &LayerWeights,
        (hidden, inter): (u32, u32),
        linear: LinearKernels,
        scratch: Scratch,
    ) -> Result<DenseRelu2Mlp, ModelError> {
        Ok(DenseRelu2Mlp {
            norm,
            up: Linear::of("up", w.gate_up, DevicePtr::NULL, (inter, hidden), linear),
            down: Linear::of("down", w.down, DevicePtr::NULL, (hidden, inter), linear),
            inter,
            relu2: gpu.kernel(Relu2::NAME)?,
            scratch,
        })
    }
}

impl Block for DenseRelu2Mlp {
    fn enqueue(
        &self,
        l: &Launcher,
        step: &Step,
        residual: &mut Residual,
        before_fold: bool,
    ) -> Result<(), ModelError> {
        let (sc, n) = (&self.scratch, step.tokens);
        self.up.run_normed(l, residual, self.norm, sc.act, n)?;
        let act = Relu2 {
            out: sc.act,
            x: sc.act,
            n: n * self.inter,
        };
        l.launch(self.relu2, "relu2", &act)?;
        self.down.run(l, sc.out, sc.act, n, before_fold)?;
        residual.set_pending(sc.out);
        Ok(())
    }

    fn folds_norm(&self, t: &Tuning, rows: u32) -> bool {
        self.norm.folds() && self.up.folds_norm(t, rows)
    }
}
