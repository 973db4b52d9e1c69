// SPDX-License-Identifier: MIT OR Apache-2.0
//! The residual stream: f32 `[tokens, hidden]` in one of two buffers, the output of the block
//! before waiting to be added into it, and the normalised rows the next product reads.
//!
//! Every block of the layer plan starts with the same fold: `h += previous block's output;
//! x = norm(h)`. Either a launch of its own does it in place ([`Residual::add_norm`]), or the
//! product after it does it in its launch (the normalising GEMVs): their blocks run concurrently,
//! so they read the stream from one buffer and block 0 writes the sum to the other, which becomes
//! the stream ([`Residual::advance`]). The stream therefore alternates between its two buffers;
//! nothing else moves it.

use metrale_core::DevicePtr;
use metrale_gpu_runtime::KernelHandle;
use metrale_kernels::ops::AddRmsNorm;

use crate::ModelError;
use crate::launch::Launcher;
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
    add_rmsnorm: KernelHandle,
}

impl Residual {
    /// The stream in `buffers[0]` (the embeddings' rows), nothing pending.
    pub(crate) fn new(
        buffers: [DevicePtr; 2],
        normed: DevicePtr,
        cols: u32,
        add_rmsnorm: KernelHandle,
    ) -> Residual {
        Residual {
            buffers,
            current: 0,
            pending: DevicePtr::NULL,
            normed,
            cols,
            add_rmsnorm,
        }
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
        let args = AddRmsNorm {
            out: self.normed,
            residual: self.current(),
            input: self.pending,
            weight: norm.weight,
            rows,
            cols: self.cols,
            eps: norm.eps,
            weight_offset: norm.weight_offset,
        };
        launcher.launch(self.add_rmsnorm, "add_rmsnorm", &args)?;
        self.pending = DevicePtr::NULL;
        Ok(self.normed)
    }
}
