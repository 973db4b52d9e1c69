// SPDX-License-Identifier: MIT OR Apache-2.0
//! The block modules: one per kind of the layer plan ([`crate::plan::BlockKind`]), each owning
//! its weights, its scratch and its launches.
//!
//! A block's contract ([`Block::enqueue`]): fold the residual stream's pending output and
//! normalise (in its first product's launch or in one of its own, [`crate::linear`]), compute,
//! and leave its output pending for the next block. Blocks of one kind share their scratch (the
//! step runs them one after the other); state that outlives a step (the attention's KV cache)
//! belongs to the block of its layer.

pub(crate) mod attention;
pub(crate) mod gated_delta;
pub(crate) mod mamba2;
pub(crate) mod mlp;
pub(crate) mod moe;

use metrale_core::DevicePtr;
use metrale_gpu_runtime::{GpuBackend, Stream};

use crate::ModelError;
use crate::launch::Launcher;
use crate::model::StepBuffers;
use crate::residual::Residual;
use crate::tuning::Tuning;

/// What every block of one step sees: its size and the step's uploaded inputs.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Step {
    /// Tokens in the step.
    pub(crate) tokens: u32,
    /// Sequences in the step.
    pub(crate) seqs: u32,
    /// The most tokens one sequence brings (1 in a decode step).
    pub(crate) max_run: u32,
    /// Where the step's integer inputs are on the device.
    pub(crate) inputs: StepBuffers,
    /// The split decode attention's (keys per split, splits), the same for every layer.
    pub(crate) split: (u32, u32),
    /// The step's prefill tiles (after its leading decode rows) run on the tensor-core prefill
    /// attention.
    pub(crate) tensor_core_prefill: bool,
}

/// One block of the layer plan, loaded.
pub(crate) trait Block: Send + Sync {
    /// Queues the block's launches: `h += pending; out = block(norm(h))`, leaving `out` pending.
    /// `before_fold`: the next block folds the residual add + RMSNorm into a register GEMV (its
    /// last product's carveout looks at it).
    fn enqueue(
        &self,
        l: &Launcher,
        step: &Step,
        residual: &mut Residual,
        before_fold: bool,
    ) -> Result<(), ModelError>;

    /// Whether the block's first product folds the residual add + RMSNorm into a register GEMV
    /// at `rows` rows.
    fn folds_norm(&self, t: &Tuning, rows: u32) -> bool;

    /// Queues on `stream` the copy of the block's part of recurrent-state slot `from` into slot
    /// `to` (a recurrent block's conv inputs and matrix state); nothing for a block without
    /// state.
    fn copy_state(
        &self,
        _gpu: &dyn GpuBackend,
        _stream: Stream,
        _from: usize,
        _to: usize,
    ) -> Result<(), ModelError> {
        Ok(())
    }
}

/// Queues the copy of slot `from` of a per-slot state buffer (`bytes` a slot) into slot `to`.
pub(crate) fn copy_slot(
    gpu: &dyn GpuBackend,
    stream: Stream,
    buffer: DevicePtr,
    bytes: usize,
    (from, to): (usize, usize),
) -> Result<(), ModelError> {
    gpu.copy_d2d(
        buffer.offset(from * bytes),
        buffer.offset(to * bytes),
        bytes,
        stream,
    )?;
    Ok(())
}

/// Device allocations made at load, freed with the model.
pub(crate) struct Arena<'a> {
    pub(crate) gpu: &'a dyn GpuBackend,
    pub(crate) owned: Vec<DevicePtr>,
}

impl Arena<'_> {
    /// `bytes` (at least 1) of device memory.
    pub(crate) fn alloc(&mut self, bytes: usize) -> Result<DevicePtr, ModelError> {
        let p = self.gpu.alloc(bytes.max(1))?;
        self.owned.push(p);
        Ok(p)
    }
}
