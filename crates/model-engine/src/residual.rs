// SPDX-License-Identifier: MIT OR Apache-2.0
//! The residual stream: f32 `[tokens, hidden]` in one of two buffers, the output of the block
//! before waiting to be added into it, and the normalised rows the next product reads.
//!
//! Every block of the layer plan starts with the same fold: `h += previous block's output;
//! x = norm(h)`. Either a launch of its own does it in place ([`Residual::add_norm`]), or the
//! product after it does it in its launch (the normalising GEMVs): their blocks run concurrently,
//! so they read the stream from one buffer and block 0 writes the sum to the other, which becomes
//! the stream ([`Residual::advance`]). The stream therefore alternates between its two buffers;
//! nothing else moves it. The launch of its own writes the normalised rows as bf16, or, for a
//! product that reads e4m3 rows ([`crate::linear::Linear::takes_fp8_rows`]), as those rows and
//! their scales ([`Residual::add_norm_into`]).

use metrale_core::DevicePtr;
use metrale_gpu_runtime::KernelHandle;
use metrale_kernels::ops::{AddRmsNorm, AddRmsNormFp8Rows};

use crate::ModelError;
use crate::launch::Launcher;
use crate::linear::Rows;
use crate::plan::NormKind;

/// An RMSNorm's weight, epsilon and weight offset.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RmsNorm {
    /// bf16 `[hidden]`, as the checkpoint stores it.
    pub(crate) weight: DevicePtr,
    pub(crate) eps: f32,
    /// Added to each weight in f32 before it scales ([`NormKind::weight_offset`]): 1 for
    /// Qwen3-Next's norms (`1 + weight`), else 0.
    pub(crate) weight_offset: f32,
}

impl RmsNorm {
    /// The norm of `kind` over `weight`.
    pub(crate) fn of(weight: DevicePtr, kind: NormKind) -> Result<RmsNorm, ModelError> {
        Ok(RmsNorm {
            weight,
            eps: kind.rms_eps()?,
            weight_offset: kind.weight_offset(),
        })
    }

    /// Whether a normalising GEMV may take the norm into its launch: those kernels scale by the
    /// plain weight, so a norm with an offset runs in [`Residual::add_norm`]'s launch.
    pub(crate) fn folds(&self) -> bool {
        self.weight_offset == 0.0
    }
}

/// The residual stream of one step.
#[derive(Debug)]
pub(crate) struct Residual {
    /// f32: `[tokens, hidden]` for the first, `[GEMV_FMA_MAX_ROWS, hidden]` for the second (only
    /// the normalising GEMVs, of at most that many rows, write it).
    buffers: [DevicePtr; 2],
    /// Which buffer holds the stream.
    current: usize,
    /// bf16 `[tokens, hidden]` still to be added (the previous block's output), or null.
    pending: DevicePtr,
    /// bf16 `[tokens, hidden]`: where [`Residual::add_norm`] writes the normalised rows.
    normed: DevicePtr,
    cols: u32,
    kernels: NormKernels,
}

/// The launches of [`Residual::add_norm_into`]: its bf16 and e4m3-rows forms.
#[derive(Clone, Copy, Debug)]
pub(crate) struct NormKernels {
    /// [`AddRmsNorm`].
    pub(crate) bf16: KernelHandle,
    /// [`AddRmsNormFp8Rows`].
    pub(crate) fp8_rows: KernelHandle,
}

impl Residual {
    /// The stream in `buffers[0]` (the embeddings' rows), nothing pending.
    pub(crate) fn new(
        buffers: [DevicePtr; 2],
        normed: DevicePtr,
        cols: u32,
        kernels: NormKernels,
    ) -> Residual {
        Residual {
            buffers,
            current: 0,
            pending: DevicePtr::NULL,
            normed,
            cols,
            kernels,
        }
    }

    /// The bf16 `[tokens, hidden]` buffer [`Residual::add_norm`] writes the normalised rows to.
    pub(crate) fn normed(&self) -> DevicePtr {
        self.normed
    }

    /// The buffer holding the stream.
    pub(crate) fn current(&self) -> DevicePtr {
        self.buffers[self.current]
    }

    /// The buffer a normalising GEMV writes the sum to.
    pub(crate) fn other(&self) -> DevicePtr {
        self.buffers[1 - self.current]
    }

    /// The output still to be added (null: none).
    pub(crate) fn pending(&self) -> DevicePtr {
        self.pending
    }

    /// A block's output, to be added by the next fold.
    pub(crate) fn set_pending(&mut self, output: DevicePtr) {
        self.pending = output;
    }

    /// A launch labelled `label` added the pending output and wrote the sum to
    /// [`Residual::other`], which becomes the stream (unless the launch was left out).
    pub(crate) fn advance(&mut self, launcher: &Launcher, label: &str) {
        if launcher.runs(label) {
            self.current = 1 - self.current;
        }
        self.pending = DevicePtr::NULL;
    }

    /// `h += pending` in place, then the normalised rows in their buffer, in one launch
    /// (`add_rmsnorm`); returns that buffer.
    pub(crate) fn add_norm(
        &mut self,
        launcher: &Launcher,
        norm: RmsNorm,
        rows: u32,
    ) -> Result<DevicePtr, ModelError> {
        self.add_norm_into(launcher, norm, rows, Rows::Bf16(self.normed))?;
        Ok(self.normed)
    }

    /// `h += pending` in place, then the normalised rows in the form `into` names, in one launch
    /// labelled `add_rmsnorm`: bf16 rows ([`AddRmsNorm`]), or e4m3 rows and their scales for an
    /// FP8 product ([`AddRmsNormFp8Rows`]: the bits [`AddRmsNorm`] then the quantize launch
    /// would write).
    pub(crate) fn add_norm_into(
        &mut self,
        launcher: &Launcher,
        norm: RmsNorm,
        rows: u32,
        into: Rows,
    ) -> Result<(), ModelError> {
        let (residual, input, cols) = (self.current(), self.pending, self.cols);
        let (weight, eps, weight_offset) = (norm.weight, norm.eps, norm.weight_offset);
        match into {
            Rows::Bf16(out) => {
                let args = AddRmsNorm {
                    out,
                    residual,
                    input,
                    weight,
                    rows,
                    cols,
                    eps,
                    weight_offset,
                };
                launcher.launch(self.kernels.bf16, "add_rmsnorm", &args)?;
            }
            Rows::Fp8(fp8) => {
                let args = AddRmsNormFp8Rows {
                    q: fp8.values,
                    scales: fp8.scales,
                    residual,
                    input,
                    weight,
                    rows,
                    cols,
                    eps,
                    weight_offset,
                };
                launcher.launch(self.kernels.fp8_rows, "add_rmsnorm", &args)?;
            }
        }
        self.pending = DevicePtr::NULL;
        Ok(())
    }
}
