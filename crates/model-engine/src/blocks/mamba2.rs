// SPDX-License-Identifier: MIT OR Apache-2.0
//! The Mamba-2 token mixer ([`crate::plan::Mamba2Spec`]: Nemotron-H).
//!
//! `in_proj` computes z | x | B | C | dt per token (the checkpoint's order); the causal depthwise
//! conv with its bias and SiLU runs over x | B | C from and back into each sequence's conv state
//! (the Gated DeltaNet's conv kernel, `gdn_conv1d`, reading the columns in place); the SSD
//! recurrence (`mamba2_recurrent`) runs each head over the sequence's tokens from and back into
//! its f32 state (runs of at least the tuning's `ssd_chunk_min_run` tokens in parallel chunks:
//! `mamba2_chunk_state`, `_carry`, `_scan`), with the step `dt = softplus(dt + dt_bias)` clamped to the config's limits, the
//! decay `exp(-exp(A_log) dt)` and the skip `D`; `y * silu(z)` is RMS-normalised per group of
//! heads (`gated_rmsnorm`, gate first); `out_proj` maps back to the hidden width.
//!
//! State as the Gated DeltaNet block's: every block owns its layer's part of every slot (conv
//! inputs bf16 `[slots, kernel - 1, conv channels]`, the SSM state f32 `[slots, heads, head_dim,
//! state_size]`); a run starting at position 0 starts from zero.

use metrale_core::DevicePtr;
use metrale_gpu_runtime::{GpuBackend, KernelHandle, Stream};
use metrale_kernels::KernelAbi;
use metrale_kernels::ops::{
    GatedRmsNorm, GdnConv1d, Mamba2ChunkCarry, Mamba2ChunkScan, Mamba2ChunkState, Mamba2Recurrent,
};

use super::{Arena, Block, Step, copy_slot};
use crate::ModelError;
use crate::launch::Launcher;
use crate::linear::{Linear, LinearKernels};
use crate::plan::Mamba2Spec;
use crate::residual::{Residual, RmsNorm};
use crate::tuning::Tuning;
use crate::weights::MambaWeights;

#[derive(Clone, Copy, Debug)]
struct Kernels {
    conv: KernelHandle,
    recurrent: KernelHandle,
    chunk_state: KernelHandle,
    chunk_carry: KernelHandle,
    chunk_scan: KernelHandle,
    norm: KernelHandle,
}

/// Chunk states the chunked prefill's scratch holds, every sequence's chunks together: a step's
/// sequences times its chunks a sequence stay within it.
const SCRATCH_CHUNKS: u32 = 32;
/// The shortest chunk the chunked prefill cuts.
const MIN_CHUNK: u32 = 16;

/// The chunked walk's `(chunk_len, max_chunks)` for a step of `seqs` sequences whose longest run
/// is `max_run` tokens, or `None` for the token-by-token walk: runs shorter than `min_run` (0:
/// never chunked), or too many sequences to give each two chunks of the scratch.
fn chunking(seqs: u32, max_run: u32, min_run: u32) -> Option<(u32, u32)> {
    if min_run == 0 || max_run < min_run || seqs == 0 || SCRATCH_CHUNKS / seqs < 2 {
        return None;
    }
    let chunk_len = max_run.div_ceil(SCRATCH_CHUNKS / seqs).max(MIN_CHUNK);
    let max_chunks = max_run.div_ceil(chunk_len);
    (max_chunks >= 2).then_some((chunk_len, max_chunks))
}

/// Buffers every Mamba-2 block of a step shares, and the kernels.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Shared {
    kernels: Kernels,
    /// bf16 `[tokens, in_proj width]`.
    proj: DevicePtr,
    /// bf16 `[tokens, conv channels]`: x | B | C after the conv and SiLU.
    xbc: DevicePtr,
    /// f32 `[tokens, inner]`: the recurrence's output, read unrounded by the gated norm (as
    /// transformers hands its scan's f32 output to the norm).
    y: DevicePtr,
    /// bf16 `[tokens, inner]`: the gated norm's output.
    normed: DevicePtr,
    /// f32 `[SCRATCH_CHUNKS, heads, head_dim, state_size]`: the chunked prefill's chunk states.
    chunk_states: DevicePtr,
    /// f32 `[SCRATCH_CHUNKS, heads]`: the chunked prefill's chunk decays.
    chunk_decay: DevicePtr,
    /// bf16 `[tokens, hidden]`: the block's output.
    out: DevicePtr,
}

impl Shared {
    pub(crate) fn new(
        arena: &mut Arena,
        spec: &Mamba2Spec,
        max_tokens: usize,
        hidden: usize,
    ) -> Result<Shared, ModelError> {
        let gpu = arena.gpu;
        let s = spec.shape;
        let t = max_tokens;
        Ok(Shared {
            kernels: Kernels {
                conv: gpu.kernel(GdnConv1d::NAME)?,
                recurrent: gpu.kernel(Mamba2Recurrent::NAME)?,
                chunk_state: gpu.kernel(Mamba2ChunkState::NAME)?,
                chunk_carry: gpu.kernel(Mamba2ChunkCarry::NAME)?,
                chunk_scan: gpu.kernel(Mamba2ChunkScan::NAME)?,
                norm: gpu.kernel(GatedRmsNorm::NAME)?,
            },
            proj: arena.alloc(t * in_proj_width(spec) * 2)?,
            xbc: arena.alloc(t * s.conv_channels() * 2)?,
            y: arena.alloc(t * s.inner() * 4)?,
            normed: arena.alloc(t * s.inner() * 2)?,
            chunk_states: arena.alloc(SCRATCH_CHUNKS as usize * s.inner() * s.state_size * 4)?,
            chunk_decay: arena.alloc(SCRATCH_CHUNKS as usize * s.heads * 4)?,
            out: arena.alloc(t * hidden * 2)?,
        })
    }

    /// Whether blocks of `spec` fit this scratch (every Mamba-2 layer of a model has one shape).
    pub(crate) fn fits(spec: &Mamba2Spec, first: &Mamba2Spec) -> bool {
        spec.shape == first.shape
    }
}

/// The width of the input product: z, x | B | C, dt.
fn in_proj_width(spec: &Mamba2Spec) -> usize {
    let s = spec.shape;
    s.inner() + s.conv_channels() + s.heads
}

/// One layer's Mamba-2 mixer with its part of every state slot.
pub(crate) struct Mamba2 {
    spec: Mamba2Spec,
    norm: RmsNorm,
    in_proj: Linear,
    out: Linear,
    w: MambaWeights,
    /// bf16 `[slots, kernel - 1, conv channels]`.
    conv_state: DevicePtr,
    /// f32 `[slots, heads, head_dim, state_size]`.
    state: DevicePtr,
    shared: Shared,
}

impl Mamba2 {
    /// The layer's block over its weights, with its state for `slots` sequences.
    pub(crate) fn new(
        arena: &mut Arena,
        spec: Mamba2Spec,
        norm: RmsNorm,
        w: &MambaWeights,
        (hidden, slots): (usize, usize),
        linear: LinearKernels,
        shared: Shared,
    ) -> Result<Mamba2, ModelError> {
        let s = spec.shape;
        let conv_bytes = slots * (s.conv_kernel - 1) * s.conv_channels() * 2;
        let state_bytes = slots * s.inner() * s.state_size * 4;
        let width = in_proj_width(&spec) as u32;
        let (h, inner) = (hidden as u32, s.inner() as u32);
        Ok(Mamba2 {
            spec,
            norm,
            in_proj: Linear::of("mamba_in", w.in_proj, DevicePtr::NULL, (width, h), linear),
            out: Linear::of("mamba_out", w.out, DevicePtr::NULL, (h, inner), linear),
            w: w.clone(),
            conv_state: arena.alloc(conv_bytes)?,
            state: arena.alloc(state_bytes)?,
            shared,
        })
    }
}

impl Block for Mamba2 {
    fn enqueue(
        &self,
        l: &Launcher,
        step: &Step,
        residual: &mut Residual,
        before_fold: bool,
    ) -> Result<(), ModelError> {
        let (sc, k, n) = (&self.shared, &self.shared.kernels, step.tokens);
        let s = self.spec.shape;
        let inputs = &step.inputs;
        let inner = s.inner() as u32;
        let channels = s.conv_channels() as u32;
        let width = in_proj_width(&self.spec) as u32;
        self.in_proj
            .run_normed(l, residual, self.norm, sc.proj, n)?;
        let conv = GdnConv1d {
            out: sc.xbc,
            x: sc.proj.offset(inner as usize * 2),
            conv_state: self.conv_state,
            weight: self.w.conv,
            bias: self.w.conv_bias,
            seq_starts: inputs.seq_starts,
            slots: inputs.state_slots,
            positions: inputs.positions,
            seqs: step.seqs,
            max_len: step.max_run,
            channels,
            x_stride: width,
            kernel: s.conv_kernel as u32,
        };
        l.launch(k.conv, "mamba_conv", &conv)?;
        let (dt_min, dt_max) = s.time_step_limit;
        let dt_raw = sc.proj.offset((inner + channels) as usize * 2);
        let (heads, head_dim, state_size, groups) = (
            s.heads as u32,
            s.head_dim as u32,
            s.state_size as u32,
            s.groups as u32,
        );
        match chunking(step.seqs, step.max_run, l.tuning.ssd_chunk_min_run) {
            None => {
                let ssd = Mamba2Recurrent {
                    y: sc.y,
                    state: self.state,
                    xbc: sc.xbc,
                    dt_raw,
                    a_log: self.w.a_log,
                    dt_bias: self.w.dt_bias,
                    d: self.w.d,
                    seq_starts: inputs.seq_starts,
                    slots: inputs.state_slots,
                    positions: inputs.positions,
                    seqs: step.seqs,
                    heads,
                    head_dim,
                    state_size,
                    groups,
                    xbc_stride: channels,
                    dt_stride: width,
                    dt_min,
                    dt_max,
                };
                l.launch(k.recurrent, "mamba_ssd", &ssd)?;
            }
            Some((chunk_len, max_chunks)) => {
                let pass1 = Mamba2ChunkState {
                    chunk_states: sc.chunk_states,
                    chunk_decay: sc.chunk_decay,
                    xbc: sc.xbc,
                    dt_raw,
                    a_log: self.w.a_log,
                    dt_bias: self.w.dt_bias,
                    d: self.w.d,
                    seq_starts: inputs.seq_starts,
                    seqs: step.seqs,
                    heads,
                    head_dim,
                    state_size,
                    groups,
                    xbc_stride: channels,
                    dt_stride: width,
                    dt_min,
                    dt_max,
                    chunk_len,
                    max_chunks,
                };
                l.launch(k.chunk_state, "mamba_ssd", &pass1)?;
                let pass2 = pass1.carry(self.state, inputs.state_slots, inputs.positions);
                l.launch(k.chunk_carry, "mamba_ssd", &pass2)?;
                l.launch(k.chunk_scan, "mamba_ssd", &pass1.scan(sc.y))?;
            }
        }
        let group = inner / s.groups as u32;
        let norm = GatedRmsNorm {
            out: sc.normed,
            x: sc.y,
            z: sc.proj,
            weight: self.w.norm,
            rows: n,
            groups: s.groups as u32,
            width: group,
            z_stride: width,
            weight_group_stride: group,
            eps: self.spec.norm_eps,
            gate_first: 1,
            x_f32: 1,
        };
        l.launch(k.norm, "mamba_norm", &norm)?;
        self.out.run(l, sc.out, sc.normed, n, before_fold)?;
        residual.set_pending(sc.out);
        Ok(())
    }

    fn folds_norm(&self, t: &Tuning, rows: u32) -> bool {
        self.norm.folds() && self.in_proj.folds_norm(t, rows)
    }

    fn copy_state(
        &self,
        gpu: &dyn GpuBackend,
        stream: Stream,
        from: usize,
        to: usize,
    ) -> Result<(), ModelError> {
        let s = self.spec.shape;
        let conv = (s.conv_kernel - 1) * s.conv_channels() * 2;
        copy_slot(gpu, stream, self.conv_state, conv, (from, to))?;
        copy_slot(
            gpu,
            stream,
            self.state,
            s.inner() * s.state_size * 4,
            (from, to),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_runs_are_chunked_within_the_scratch() {
        // Off, short runs, and too many sequences for two chunks each: token by token.
        assert_eq!(chunking(1, 8192, 0), None);
        assert_eq!(chunking(1, 100, 128), None);
        assert_eq!(chunking(17, 1024, 128), None);
        // One 8192-token run: 32 chunks of 256; 1024 tokens: 32 of 32.
        assert_eq!(chunking(1, 8192, 128), Some((256, 32)));
        assert_eq!(chunking(1, 1024, 128), Some((32, 32)));
        // Four sequences share the scratch: 8 chunks each at most.
        assert_eq!(chunking(4, 1000, 128), Some((125, 8)));
        // Chunks never shorter than MIN_CHUNK: 130 tokens make 9 chunks of 16.
        assert_eq!(chunking(1, 130, 128), Some((16, 9)));
        for (seqs, run) in [(1u32, 129u32), (3, 5000), (16, 700), (2, 128)] {
            let (len, chunks) = chunking(seqs, run, 128).expect("chunked");
            assert!(seqs * chunks <= SCRATCH_CHUNKS && len * chunks >= run && chunks >= 2);
        }
    }
}
