// SPDX-License-Identifier: MIT OR Apache-2.0
//! The Gated DeltaNet token mixer ([`crate::plan::GatedDeltaNetSpec`]: Qwen3-Next, Qwen3.5).
//!
//! One product computes every input of the mixer (`in_proj`: q | k | v | z | b, a grouped per
//! key head, rearranged so at load: [`crate::weights::GdnWeights`]); the causal depthwise conv
//! with SiLU runs over the q | k | v columns from and back into each sequence's conv state;
//! `gdn_gating` turns b and a into each value head's write strength and log-decay; the gated
//! delta rule runs over each sequence's tokens from and back into its f32 state (token by token,
//! `gdn_recurrent`; or, in steps whose longest run has at least the tuning's `gdn_chunk_min_run`
//! tokens, in chunks of [`GDN_CHUNK_MAX`]: `gdn_chunk_prep` then `gdn_chunk_scan`, or their
//! tensor-core forms under the tuning's `gdn_chunk_tensor_cores`); each head's output is
//! RMS-normalised and multiplied by `silu(z)`; `out_proj` maps back to the hidden width.
//!
//! State: every block owns its layer's part of every state slot (conv inputs bf16
//! `[slots, kernel - 1, channels]`, the rule's f32 `[slots, hv, dk, dv]`); the step names each
//! sequence's slot. A sequence whose run starts at position 0 starts from a zero state (the
//! kernels read the position), so a slot needs no clearing between the sequences that hold it,
//! and a preempted sequence's recompute starts afresh.

use metrale_core::DevicePtr;
use metrale_gpu_runtime::{GpuBackend, KernelHandle, Stream};
use metrale_kernels::KernelAbi;
use metrale_kernels::ops::{
    GDN_CHUNK_MAX, GatedRmsNorm, GdnChunkPrep, GdnChunkPrepTc, GdnChunkScan, GdnChunkScanTc,
    GdnConv1d, GdnGating, GdnRecurrent,
};

use super::{Arena, Block, Step, copy_slot};
use crate::ModelError;
use crate::launch::Launcher;
use crate::linear::{Linear, LinearKernels};
use crate::plan::GatedDeltaNetSpec;
use crate::residual::{Residual, RmsNorm};
use crate::tuning::Tuning;
use crate::weights::GdnWeights;

#[derive(Clone, Copy, Debug)]
struct Kernels {
    conv: KernelHandle,
    gating: KernelHandle,
    recurrent: KernelHandle,
    chunk_prep: KernelHandle,
    chunk_scan: KernelHandle,
    chunk_prep_tc: KernelHandle,
    chunk_scan_tc: KernelHandle,
    norm: KernelHandle,
}

/// The chunked rule's `max_chunks` (chunks of [`GDN_CHUNK_MAX`] tokens in the longest run) for a
/// step whose longest run is `max_run` tokens, or `None` for the token-by-token walk: runs
/// shorter than `min_run` (0: never chunked). Every run of a chunked step takes the chunked form,
/// decode rows (runs of one) too.
fn chunking(max_run: u32, min_run: u32) -> Option<u32> {
    (min_run != 0 && max_run >= min_run).then(|| max_run.div_ceil(GDN_CHUNK_MAX).max(1))
}

/// Buffers every Gated DeltaNet block of a step shares, and the kernels.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Shared {
    kernels: Kernels,
    /// bf16 `[tokens, in_proj width]`.
    proj: DevicePtr,
    /// bf16 `[tokens, conv channels]`: q | k | v after the conv and SiLU.
    qkv: DevicePtr,
    /// f32 `[tokens, value_heads]` each.
    g: DevicePtr,
    beta: DevicePtr,
    /// bf16 `[tokens, value_heads * value_head_dim]`: the rule's output, then the gated norm's.
    o: DevicePtr,
    normed: DevicePtr,
    /// f32 `[tokens, value_heads, GDN_CHUNK_MAX]` each: the chunked rule's `T` and decay-masked
    /// scores, a row a token (allocated whatever the tuning, which may change after the load).
    t_mat: DevicePtr,
    attn: DevicePtr,
    /// bf16 `[tokens, hidden]`: the block's output.
    out: DevicePtr,
}

impl Shared {
    pub(crate) fn new(
        arena: &mut Arena,
        spec: &GatedDeltaNetSpec,
        max_tokens: usize,
        hidden: usize,
    ) -> Result<Shared, ModelError> {
        let gpu = arena.gpu;
        let s = spec.shape;
        let vd = s.value_heads * s.value_head_dim;
        let t = max_tokens;
        Ok(Shared {
            kernels: Kernels {
                conv: gpu.kernel(GdnConv1d::NAME)?,
                gating: gpu.kernel(GdnGating::NAME)?,
                recurrent: gpu.kernel(GdnRecurrent::NAME)?,
                chunk_prep: gpu.kernel(GdnChunkPrep::NAME)?,
                chunk_scan: gpu.kernel(GdnChunkScan::NAME)?,
                chunk_prep_tc: gpu.kernel(GdnChunkPrepTc::NAME)?,
                chunk_scan_tc: gpu.kernel(GdnChunkScanTc::NAME)?,
                norm: gpu.kernel(GatedRmsNorm::NAME)?,
            },
            proj: arena.alloc(t * in_proj_width(spec) * 2)?,
            qkv: arena.alloc(t * s.conv_channels() * 2)?,
            g: arena.alloc(t * s.value_heads * 4)?,
            beta: arena.alloc(t * s.value_heads * 4)?,
            o: arena.alloc(t * vd * 2)?,
            normed: arena.alloc(t * vd * 2)?,
            t_mat: arena.alloc(t * s.value_heads * GDN_CHUNK_MAX as usize * 4)?,
            attn: arena.alloc(t * s.value_heads * GDN_CHUNK_MAX as usize * 4)?,
            out: arena.alloc(t * hidden * 2)?,
        })
    }

    /// Whether blocks of `spec` fit this scratch (every Gated DeltaNet layer of a model has one
    /// shape).
    pub(crate) fn fits(spec: &GatedDeltaNetSpec, first: &GatedDeltaNetSpec) -> bool {
        spec.shape == first.shape
    }
}

/// The width of the one input product: q | k | v (the conv's channels), z, then b and a.
fn in_proj_width(spec: &GatedDeltaNetSpec) -> usize {
    let s = spec.shape;
    s.conv_channels() + s.value_heads * s.value_head_dim + 2 * s.value_heads
}

/// One layer's Gated DeltaNet mixer with its part of every state slot.
pub(crate) struct GatedDeltaNet {
    spec: GatedDeltaNetSpec,
    norm: RmsNorm,
    in_proj: Linear,
    out: Linear,
    conv_weight: DevicePtr,
    dt_bias: DevicePtr,
    a_log: DevicePtr,
    gate_norm: DevicePtr,
    /// bf16 `[slots, kernel - 1, channels]`.
    conv_state: DevicePtr,
    /// f32 `[slots, value_heads, key_head_dim, value_head_dim]`.
    state: DevicePtr,
    shared: Shared,
}

impl GatedDeltaNet {
    /// The layer's block over its weights, with its state for `slots` sequences.
    pub(crate) fn new(
        arena: &mut Arena,
        spec: GatedDeltaNetSpec,
        norm: RmsNorm,
        w: &GdnWeights,
        (hidden, slots): (usize, usize),
        linear: LinearKernels,
        shared: Shared,
    ) -> Result<GatedDeltaNet, ModelError> {
        let s = spec.shape;
        let vd = (s.value_heads * s.value_head_dim) as u32;
        let conv_bytes = slots * (s.conv_kernel - 1) * s.conv_channels() * 2;
        let state_bytes = slots * s.value_heads * s.key_head_dim * s.value_head_dim * 4;
        let width = in_proj_width(&spec) as u32;
        Ok(GatedDeltaNet {
            spec,
            norm,
            in_proj: Linear::of(
                "gdn_in",
                w.in_proj,
                DevicePtr::NULL,
                (width, hidden as u32),
                linear,
            ),
            out: Linear::of(
                "gdn_out",
                w.out,
                DevicePtr::NULL,
                (hidden as u32, vd),
                linear,
            ),
            conv_weight: w.conv,
            dt_bias: w.dt_bias,
            a_log: w.a_log,
            gate_norm: w.norm,
            conv_state: arena.alloc(conv_bytes)?,
            state: arena.alloc(state_bytes)?,
            shared,
        })
    }
}

impl Block for GatedDeltaNet {
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
        let (hv, hk) = (s.value_heads as u32, s.key_heads as u32);
        let (dk, dv) = (s.key_head_dim as u32, s.value_head_dim as u32);
        let channels = s.conv_channels() as u32;
        let width = in_proj_width(&self.spec) as u32;
        let kd = (s.key_heads * s.key_head_dim) as u32;
        let vd = hv * dv;
        self.in_proj
            .run_normed(l, residual, self.norm, sc.proj, n)?;
        let conv = GdnConv1d {
            out: sc.qkv,
            x: sc.proj,
            conv_state: self.conv_state,
            weight: self.conv_weight,
            bias: DevicePtr::NULL,
            seq_starts: inputs.seq_starts,
            slots: inputs.state_slots,
            positions: inputs.positions,
            seqs: step.seqs,
            max_len: step.max_run,
            channels,
            x_stride: width,
            kernel: s.conv_kernel as u32,
        };
        l.launch(k.conv, "gdn_conv", &conv)?;
        let gating = GdnGating {
            g: sc.g,
            beta: sc.beta,
            ba: sc.proj.offset((channels + vd) as usize * 2),
            a_log: self.a_log,
            dt_bias: self.dt_bias,
            tokens: n,
            hv,
            hk,
            ba_stride: width,
        };
        l.launch(k.gating, "gdn_gating", &gating)?;
        let (q, kk, v) = (
            sc.qkv,
            sc.qkv.offset(kd as usize * 2),
            sc.qkv.offset(2 * kd as usize * 2),
        );
        match chunking(step.max_run, l.tuning.gdn_chunk_min_run) {
            None => {
                let rule = GdnRecurrent {
                    o: sc.o,
                    state: self.state,
                    q,
                    k: kk,
                    v,
                    g: sc.g,
                    beta: sc.beta,
                    seq_starts: inputs.seq_starts,
                    slots: inputs.state_slots,
                    positions: inputs.positions,
                    seqs: step.seqs,
                    hv,
                    hk,
                    dk,
                    dv,
                    qkv_stride: channels,
                };
                l.launch(k.recurrent, "gdn_rule", &rule)?;
            }
            Some(max_chunks) => {
                let prep = GdnChunkPrep {
                    t_mat: sc.t_mat,
                    attn: sc.attn,
                    q,
                    k: kk,
                    g: sc.g,
                    beta: sc.beta,
                    seq_starts: inputs.seq_starts,
                    seqs: step.seqs,
                    hv,
                    hk,
                    dk,
                    qkv_stride: channels,
                    chunk_len: GDN_CHUNK_MAX,
                    max_chunks,
                };
                let scan = GdnChunkScan {
                    o: sc.o,
                    state: self.state,
                    q,
                    k: kk,
                    v,
                    g: sc.g,
                    beta: sc.beta,
                    t_mat: sc.t_mat,
                    attn: sc.attn,
                    seq_starts: inputs.seq_starts,
                    slots: inputs.state_slots,
                    positions: inputs.positions,
                    seqs: step.seqs,
                    hv,
                    hk,
                    dk,
                    dv,
                    qkv_stride: channels,
                    chunk_len: GDN_CHUNK_MAX,
                    max_chunks,
                };
                // The same arguments and scratch for either pair; each scan reads its own
                // prep's T and P.
                if l.tuning.gdn_chunk_tensor_cores {
                    l.launch(k.chunk_prep_tc, "gdn_rule", &GdnChunkPrepTc(prep))?;
                    l.launch(k.chunk_scan_tc, "gdn_rule", &GdnChunkScanTc(scan))?;
                } else {
                    l.launch(k.chunk_prep, "gdn_rule", &prep)?;
                    l.launch(k.chunk_scan, "gdn_rule", &scan)?;
                }
            }
        }
        let norm = GatedRmsNorm {
            out: sc.normed,
            x: sc.o,
            z: sc.proj.offset(channels as usize * 2),
            weight: self.gate_norm,
            rows: n,
            groups: hv,
            width: dv,
            z_stride: width,
            weight_group_stride: 0,
            eps: self.spec.norm_eps,
            gate_first: 0,
            x_f32: 0,
        };
        l.launch(k.norm, "gdn_norm", &norm)?;
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
            s.value_heads * s.key_head_dim * s.value_head_dim * 4,
            (from, to),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_runs_take_the_chunked_rule() {
        // Off, and runs shorter than the threshold: token by token.
        assert_eq!(chunking(8192, 0), None);
        assert_eq!(chunking(100, 128), None);
        // Chunks of 64 over the longest run, a partial last one counted.
        assert_eq!(chunking(8192, 128), Some(128));
        assert_eq!(chunking(130, 128), Some(3));
        assert_eq!(chunking(1, 1), Some(1));
        assert_eq!(chunking(64, 1), Some(1));
        assert_eq!(chunking(65, 1), Some(2));
    }
}
