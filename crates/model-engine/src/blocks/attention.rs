// SPDX-License-Identifier: MIT OR Apache-2.0
//! Grouped-query self-attention over the paged KV cache ([`crate::plan::AttentionSpec`]).
//!
//! `qkv = norm(h) · Wqkvᵀ (+ bias)` (one product over q, k and v rows); `q, k = rope(qk_norm(q,
//! k))` with k and v written to the cache through each sequence's block table; the attention
//! reads the cache back; `out = attn · Woᵀ`. Decode rows (every row of a decode step, the leading
//! rows of a mixed one, which the scheduler puts first) take the split decode attention; the
//! prefill tiles after them take the tensor-core prefill attention, so a decode token computes
//! the same bits whether or not a prefill shares its step. A decode step of one sequence runs
//! QK-norm, RoPE and the cache write inside the decode attention (`fused_qkv_attention`).
//!
//! The variants are the spec's parameters, not branches of their own: a QK-norm over the whole q
//! and k projections (MiniMax-M2) is one more launch on the QKV product before the post-processing,
//! which then runs with its per-head norms off; partial RoPE is the post-processing's
//! `rotary_dim` over tables of `rotary_dim / 2` columns; a per-head QK-norm scaling by `1 + weight`
//! (Qwen3-Next) is its `weight_offset`. None takes the fused decode attention, which norms per head
//! by the plain weights and rotates whole heads.

use metrale_config::QkNorm;
use metrale_core::{DevicePtr, KernelName, KvCacheDtype};
use metrale_gpu_runtime::{GpuBackend, KernelHandle};
use metrale_kernels::KernelAbi;
use metrale_kernels::ops::{
    PagedAttention, PagedAttentionFp8, PagedAttentionQkv, PagedAttentionQkvFp8, PrefillAttention,
    PrefillAttentionV2, PrefillAttentionV2Fp8, PrefillAttentionV3, QkNormWhole, QkvRopeKvWrite,
    QkvRopeKvWriteFp8, SigmoidGateMul,
};

use super::{Arena, Block, Step};
use crate::ModelError;
use crate::launch::Launcher;
use crate::linear::{Linear, LinearKernels};
use crate::plan::AttentionSpec;
use crate::residual::{Residual, RmsNorm};
use crate::tuning::{PrefillVersion, Tuning};
use crate::weights::LayerWeights;

/// Room for split-K attention partials ((token, head, split) triples): 64 decode rows of 32
/// heads can split 16 ways, 1 row 512 ways.
pub(crate) const ATTENTION_PARTIALS: u32 = 32768;

/// The prefill attention the tuning picks at `head_dim` over a cache of `kv_cache` elements
/// (version 3 covers 128 only, version 2 elsewhere; over an FP8 cache version 2, the one with an
/// FP8 form).
pub(crate) fn prefill_version(t: &Tuning, head_dim: u32, kv_cache: KvCacheDtype) -> PrefillVersion {
    match t.prefill_attention {
        _ if kv_cache == KvCacheDtype::Fp8 => PrefillVersion::V2,
        PrefillVersion::V3 if !PrefillAttentionV3::supports_head_dim(head_dim) => {
            PrefillVersion::V2
        }
        v => v,
    }
}

/// Query tokens per tile of a prefill attention version.
pub(crate) fn prefill_tile(v: PrefillVersion) -> u32 {
    match v {
        PrefillVersion::V1 => PrefillAttention::TILE_TOKENS,
        PrefillVersion::V2 => PrefillAttentionV2::TILE_TOKENS,
        PrefillVersion::V3 => PrefillAttentionV3::TILE_TOKENS,
    }
}

/// Whether a step where some sequence brings more than one token runs its prefill tiles on the
/// tensor-core kernels (they cover head dims 64 and 128, over either cache).
pub(crate) fn tensor_core_prefill(head_dim: u32) -> bool {
    PrefillAttention::supports_head_dim(head_dim)
}

/// The kernels an FP8 cache needs: the cache write, the decode attentions, version 2's prefill
/// attention.
pub(crate) fn fp8_cache_kernels() -> [KernelName; 5] {
    [
        QkvRopeKvWriteFp8::NAME,
        PagedAttentionFp8::NAME,
        PagedAttentionQkvFp8::NAME,
        PagedAttentionQkvFp8::WIDE_NAME,
        PrefillAttentionV2Fp8::NAME,
    ]
}

/// The cache write and decode attention kernels of the cache's element type (bf16 or FP8).
#[derive(Clone, Copy, Debug)]
struct Kernels {
    qk_norm_whole: KernelHandle,
    qkv_post: KernelHandle,
    decode: KernelHandle,
    decode_qkv: KernelHandle,
    decode_qkv_wide: KernelHandle,
    prefill_v1: KernelHandle,
    prefill_v2: KernelHandle,
    prefill_v3: KernelHandle,
    output_gate: KernelHandle,
}

/// Buffers every attention block of a step shares.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Scratch {
    /// bf16 `[tokens, (heads + 2 * kv_heads) * head_dim]`: the fused q | k | v product.
    qkv: DevicePtr,
    /// bf16 `[tokens, heads * head_dim]`: q after qk-norm and RoPE.
    q: DevicePtr,
    /// bf16 `[tokens, heads * head_dim]`.
    attn: DevicePtr,
    /// bf16 `[tokens, hidden]`: the block's output.
    out: DevicePtr,
    /// bf16 `[tokens, heads * head_dim]`: the output gate's product, or NULL without one.
    gate: DevicePtr,
    /// Split-K partials, [`ATTENTION_PARTIALS`] of `head_dim + 2` f32 each.
    partials: DevicePtr,
    /// i32 `[tokens, kv_heads]`, zero between launches: the split attention's count of finished
    /// blocks per (token, kv head).
    counters: DevicePtr,
}

/// What the attention blocks of a model share: kernels, scratch, the RoPE tables and the cache
/// geometry.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Shared {
    kernels: Kernels,
    scratch: Scratch,
    /// f32 `[max_position, rotary_dim / 2]` each.
    rope: (DevicePtr, DevicePtr),
    max_position: u32,
    block_size: u32,
    /// Block-table width.
    max_blocks_per_seq: u32,
    kv_cache: KvCacheDtype,
}

/// Cache and step sizes the attention blocks are built for.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Sizes {
    pub(crate) hidden: usize,
    pub(crate) max_tokens: usize,
    pub(crate) max_seq_len: usize,
    pub(crate) num_blocks: usize,
    pub(crate) block_size: usize,
    pub(crate) max_blocks_per_seq: usize,
    pub(crate) kv_cache: KvCacheDtype,
}

impl Shared {
    /// Resolves the kernels and allocates the scratch (counters zeroed on `gpu`'s default
    /// stream, not synchronised).
    pub(crate) fn new(
        gpu: &dyn GpuBackend,
        arena: &mut Arena,
        spec: &AttentionSpec,
        sizes: Sizes,
        rope: (DevicePtr, DevicePtr),
    ) -> Result<Shared, ModelError> {
        let [qkv_post, decode, decode_qkv, decode_qkv_wide, prefill_v2] = match sizes.kv_cache {
            KvCacheDtype::Bf16 => [
                QkvRopeKvWrite::NAME,
                PagedAttention::NAME,
                PagedAttentionQkv::NAME,
                PagedAttentionQkv::WIDE_NAME,
                PrefillAttentionV2::NAME,
            ],
            KvCacheDtype::Fp8 => fp8_cache_kernels(),
        };
        let kernels = Kernels {
            qk_norm_whole: gpu.kernel(QkNormWhole::NAME)?,
            qkv_post: gpu.kernel(qkv_post)?,
            decode: gpu.kernel(decode)?,
            decode_qkv: gpu.kernel(decode_qkv)?,
            decode_qkv_wide: gpu.kernel(decode_qkv_wide)?,
            prefill_v1: gpu.kernel(PrefillAttention::NAME)?,
            prefill_v2: gpu.kernel(prefill_v2)?,
            prefill_v3: gpu.kernel(PrefillAttentionV3::NAME)?,
            output_gate: gpu.kernel(SigmoidGateMul::NAME)?,
        };
        let t = sizes.max_tokens;
        let qd = spec.heads * spec.head_dim;
        let kvd = spec.kv_heads * spec.head_dim;
        // One counter a (token, decode attention block): a block a kv head, or one per 8 query
        // heads of a wider group.
        let counters_bytes = t
            * metrale_kernels::ops::paged_attention_groups(spec.heads as u32, spec.kv_heads as u32)
                as usize
            * 4;
        let scratch = Scratch {
            qkv: arena.alloc(t * (qd + 2 * kvd) * 2)?,
            q: arena.alloc(t * qd * 2)?,
            attn: arena.alloc(t * qd * 2)?,
            gate: if spec.output_gate {
                arena.alloc(t * qd * 2)?
            } else {
                DevicePtr::NULL
            },
            out: arena.alloc(t * sizes.hidden * 2)?,
            partials: arena.alloc(ATTENTION_PARTIALS as usize * (spec.head_dim + 2) * 4)?,
            counters: arena.alloc(counters_bytes)?,
        };
        gpu.memset(scratch.counters, 0, counters_bytes, gpu.default_stream())?;
        Ok(Shared {
            kernels,
            scratch,
            rope,
            max_position: sizes.max_seq_len as u32,
            block_size: sizes.block_size as u32,
            max_blocks_per_seq: sizes.max_blocks_per_seq as u32,
            kv_cache: sizes.kv_cache,
        })
    }
}

/// One layer's attention: its weights, its KV cache, the shared kernels and scratch.
pub(crate) struct Attention {
    spec: AttentionSpec,
    norm: RmsNorm,
    qkv: Linear,
    /// The output gate's product (`sigmoid` of it multiplies the attention output), if any.
    gate: Option<Linear>,
    o: Linear,
    /// bf16, or null without QK-norm: `[head_dim]` each per head, `[heads * head_dim]` and
    /// `[kv_heads * head_dim]` over the whole projections.
    q_norm: DevicePtr,
    k_norm: DevicePtr,
    /// `[num_blocks, block_size, kv_heads, head_dim]` each, of the cache's element type.
    k_cache: DevicePtr,
    v_cache: DevicePtr,
    cache: CacheElements,
    shared: Shared,
}

/// The layer's cache elements: bf16, or FP8 E4M3 holding `k / k_scale` and `v / v_scale`. The
/// one place the element type reaches the launches: each cache write and decode attention is
/// built as the bf16 form's arguments and passed through [`CacheElements::launch`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum CacheElements {
    Bf16,
    Fp8 { k_scale: f32, v_scale: f32 },
}

/// A launch whose arguments depend on the cache's element type.
enum CacheLaunch<'a> {
    Post(&'a QkvRopeKvWrite),
    Decode(&'a PagedAttention),
    Fused(
        &'a PagedAttentionQkv,
        Option<&'a metrale_core::LaunchConfig>,
    ),
}

impl CacheElements {
    /// Launches `what` with `kernel` (the cache's element type's entry, [`Shared`]'s handles):
    /// the bf16 arguments as they are, or their FP8 form with the layer's scales.
    fn launch(
        self,
        l: &Launcher,
        kernel: KernelHandle,
        label: &'static str,
        what: CacheLaunch,
    ) -> Result<(), ModelError> {
        let carveout = || l.carveout(label, false);
        match (self, what) {
            (CacheElements::Bf16, CacheLaunch::Post(a)) => l.launch(kernel, label, a),
            (CacheElements::Bf16, CacheLaunch::Decode(a)) => l.launch(kernel, label, a),
            (CacheElements::Bf16, CacheLaunch::Fused(a, None)) => l.launch(kernel, label, a),
            (CacheElements::Bf16, CacheLaunch::Fused(a, Some(config))) => {
                l.launch_with(kernel, label, a, config, carveout())
            }
            (CacheElements::Fp8 { k_scale, v_scale }, what) => match what {
                CacheLaunch::Post(a) => {
                    l.launch(kernel, label, &QkvRopeKvWriteFp8::of(a, k_scale, v_scale))
                }
                CacheLaunch::Decode(a) => {
                    l.launch(kernel, label, &PagedAttentionFp8::of(a, k_scale, v_scale))
                }
                CacheLaunch::Fused(a, wide) => {
                    let fp8 = PagedAttentionQkvFp8::of(a, k_scale, v_scale);
                    match wide {
                        None => l.launch(kernel, label, &fp8),
                        Some(_) => {
                            let config = fp8.wide_launch_config();
                            l.launch_with(kernel, label, &fp8, &config, carveout())
                        }
                    }
                }
            },
        }
    }
}

impl Attention {
    /// The layer's block over its weights, with a KV cache of `sizes.num_blocks` blocks.
    pub(crate) fn new(
        arena: &mut Arena,
        spec: AttentionSpec,
        norm: RmsNorm,
        w: &LayerWeights,
        linear: LinearKernels,
        shared: Shared,
        sizes: Sizes,
    ) -> Result<Attention, ModelError> {
        let (h, hd) = (sizes.hidden as u32, spec.head_dim as u32);
        let (qd, kvd) = (spec.heads as u32 * hd, spec.kv_heads as u32 * hd);
        let cache_bytes =
            sizes.num_blocks * sizes.block_size * kvd as usize * sizes.kv_cache.element_bytes();
        let cache = match sizes.kv_cache {
            KvCacheDtype::Bf16 => CacheElements::Bf16,
            KvCacheDtype::Fp8 => CacheElements::Fp8 {
                k_scale: w.kv_scales.0,
                v_scale: w.kv_scales.1,
            },
        };
        if spec.qk_norm_unit_offset && spec.qk_norm == QkNorm::Whole {
            // qk_norm_whole_bf16 takes no weight offset.
            return Err(ModelError::Unsupported(
                "a QK-norm over the whole projections scaling by 1 + weight".into(),
            ));
        }
        Ok(Attention {
            spec,
            norm,
            qkv: Linear::of("qkv", w.qkv, w.qkv_bias, (qd + 2 * kvd, h), linear),
            gate: spec
                .output_gate
                .then(|| Linear::of("attn_gate", w.attn_gate, DevicePtr::NULL, (qd, h), linear)),
            o: Linear::of("o", w.o, DevicePtr::NULL, (h, qd), linear),
            q_norm: w.q_norm,
            k_norm: w.k_norm,
            k_cache: arena.alloc(cache_bytes)?,
            v_cache: arena.alloc(cache_bytes)?,
            cache,
            shared,
        })
    }

    /// The decode attention over the step's decode rows (its leading `tokens`).
    fn decode(&self, step: &Step, tokens: u32) -> PagedAttention {
        let (s, sc) = (&self.shared, &self.shared.scratch);
        let hd = self.spec.head_dim as u32;
        let inputs = &step.inputs;
        PagedAttention {
            out: sc.attn,
            partials: sc.partials,
            counters: sc.counters,
            q: sc.q,
            k_cache: self.k_cache,
            v_cache: self.v_cache,
            block_tables: inputs.tables,
            token_seq: inputs.token_seq,
            positions: inputs.positions,
            tokens,
            q_heads: self.spec.heads as u32,
            kv_heads: self.spec.kv_heads as u32,
            head_dim: hd,
            block_size: s.block_size,
            max_blocks_per_seq: s.max_blocks_per_seq,
            keys_per_split: step.split.0,
            splits: step.split.1,
            scale: self.spec.scale,
        }
    }

    /// The QK-norm over the whole q and k projections of every token of the step, in place on
    /// the QKV product (before [`Attention::post`]).
    fn norm_whole(&self, step: &Step) -> QkNormWhole {
        let (hd, sc) = (self.spec.head_dim as u32, &self.shared.scratch);
        let (q_width, k_width) = (self.spec.heads as u32 * hd, self.spec.kv_heads as u32 * hd);
        QkNormWhole {
            qkv: sc.qkv,
            q_norm: self.q_norm,
            k_norm: self.k_norm,
            tokens: step.tokens,
            q_width,
            k_width,
            row: q_width + 2 * k_width,
            eps: self.norm.eps,
        }
    }

    /// Per-head QK-norm, RoPE and the cache write of every token of the step.
    fn post(&self, step: &Step) -> QkvRopeKvWrite {
        let (s, sc) = (&self.shared, &self.shared.scratch);
        let per_head = |w: DevicePtr| match self.spec.qk_norm {
            QkNorm::PerHead => w,
            QkNorm::None | QkNorm::Whole => DevicePtr::NULL,
        };
        QkvRopeKvWrite {
            qkv: sc.qkv,
            q_out: sc.q,
            k_cache: self.k_cache,
            v_cache: self.v_cache,
            slots: step.inputs.slots,
            q_norm: per_head(self.q_norm),
            k_norm: per_head(self.k_norm),
            positions: step.inputs.positions,
            cos: s.rope.0,
            sin: s.rope.1,
            tokens: step.tokens,
            q_heads: self.spec.heads as u32,
            kv_heads: self.spec.kv_heads as u32,
            head_dim: self.spec.head_dim as u32,
            rotary_dim: self.spec.rotary_dim as u32,
            max_position: s.max_position,
            eps: self.norm.eps,
            weight_offset: if self.spec.qk_norm_unit_offset {
                1.0
            } else {
                0.0
            },
        }
    }

    /// Whether this step's decode runs QK-norm, RoPE and the cache write inside the decode
    /// attention: one sequence, one token (the token needs no other token's key of the step; at
    /// batches of 8 to 64 the fusion measured slower: each split redoes its query group's norm).
    /// The fused kernel norms per head by the plain weights and rotates whole heads: the
    /// whole-projection norm, a unit-offset QK-norm and partial RoPE take the separate launches.
    fn fused_post(&self, t: &Tuning, step: &Step) -> bool {
        t.fused_qkv_attention
            && self.spec.qk_norm != QkNorm::Whole
            && !self.spec.qk_norm_unit_offset
            && !self.spec.partial_rotary()
            && !step.tensor_core_prefill
            && matches!(self.spec.head_dim, 64 | 128 | 256)
            && step.seqs == 1
            && step.tokens == 1
    }

    /// The attention proper: decode rows through the split decode attention (with the QKV
    /// post-processing fused where it applies), then the prefill tiles on tensor cores.
    fn attend(&self, l: &Launcher, step: &Step) -> Result<(), ModelError> {
        let k = &self.shared.kernels;
        let inputs = &step.inputs;
        let decode_rows = if step.tensor_core_prefill {
            inputs.decode_rows
        } else {
            step.tokens
        };
        if self.spec.qk_norm == QkNorm::Whole {
            l.launch(k.qk_norm_whole, "qk_norm", &self.norm_whole(step))?;
        }
        let post = self.post(step);
        let decode = self.decode(step, decode_rows);
        let cache = self.cache;
        if self.fused_post(l.tuning, step) {
            // The fused attention copies its first cache tiles before the programmatic-launch
            // wait: the launch just before it (the qkv product) must write no cache row.
            let fused = PagedAttentionQkv::fuse(&post, &decode);
            if fused.splits == 1
                && fused.wide_fits()
                && fused.tokens * fused.kv_heads <= l.tuning.attention_wide_blocks
            {
                let config = fused.wide_launch_config();
                let launch = CacheLaunch::Fused(&fused, Some(&config));
                cache.launch(l, k.decode_qkv_wide, "attention", launch)?;
            } else {
                cache.launch(
                    l,
                    k.decode_qkv,
                    "attention",
                    CacheLaunch::Fused(&fused, None),
                )?;
            }
        } else {
            cache.launch(l, k.qkv_post, "qkv_post", CacheLaunch::Post(&post))?;
            if decode_rows > 0 {
                cache.launch(l, k.decode, "attention", CacheLaunch::Decode(&decode))?;
            }
        }
        if step.tensor_core_prefill && decode_rows < inputs.num_tiles {
            self.prefill(l, step, decode_rows)?;
        }
        Ok(())
    }

    /// The tensor-core attention over the step's prefill tiles (after its `decode_rows` tiles of
    /// one token).
    fn prefill(&self, l: &Launcher, step: &Step, decode_rows: u32) -> Result<(), ModelError> {
        let (s, sc) = (&self.shared, &self.shared.scratch);
        let hd = self.spec.head_dim as u32;
        let v1 = PrefillAttention {
            out: sc.attn,
            q: sc.q,
            k_cache: self.k_cache,
            v_cache: self.v_cache,
            block_tables: step.inputs.tables,
            tiles: step.inputs.tiles.offset(decode_rows as usize * 16),
            num_tiles: step.inputs.num_tiles - decode_rows,
            q_heads: self.spec.heads as u32,
            kv_heads: self.spec.kv_heads as u32,
            head_dim: hd,
            block_size: s.block_size,
            max_blocks_per_seq: s.max_blocks_per_seq,
            scale: self.spec.scale,
        };
        let (k, label) = (&s.kernels, "prefill_attention");
        // The same arguments for every version; each its own launch geometry. Over an FP8 cache
        // version 2's FP8 form (prefill_version picks version 2).
        match (self.cache, prefill_version(l.tuning, hd, s.kv_cache)) {
            (CacheElements::Fp8 { k_scale, v_scale }, _) => l.launch(
                k.prefill_v2,
                label,
                &PrefillAttentionV2Fp8::of(&v1, k_scale, v_scale),
            ),
            (CacheElements::Bf16, PrefillVersion::V1) => l.launch(k.prefill_v1, label, &v1),
            (CacheElements::Bf16, PrefillVersion::V2) => {
                l.launch(k.prefill_v2, label, &PrefillAttentionV2::from(v1))
            }
            (CacheElements::Bf16, PrefillVersion::V3) => {
                l.launch(k.prefill_v3, label, &PrefillAttentionV3::from(v1))
            }
        }
    }
}

impl Block for Attention {
    fn enqueue(
        &self,
        l: &Launcher,
        step: &Step,
        residual: &mut Residual,
        before_fold: bool,
    ) -> Result<(), ModelError> {
        let sc = &self.shared.scratch;
        let n = step.tokens;
        match &self.gate {
            None => self.qkv.run_normed(l, residual, self.norm, sc.qkv, n)?,
            Some(gate) => {
                // Two products read the normalised rows: the norm takes a launch of its own.
                let x = residual.add_norm(l, self.norm, n)?;
                self.qkv.run(l, sc.qkv, x, n, false)?;
                gate.run(l, sc.gate, x, n, false)?;
            }
        }
        self.attend(l, step)?;
        if self.gate.is_some() {
            let qd = (self.spec.heads * self.spec.head_dim) as u32;
            let args = SigmoidGateMul {
                x: sc.attn,
                gate: sc.gate,
                rows: n,
                n: qd,
                gate_stride: qd,
            };
            l.launch(self.shared.kernels.output_gate, "attn_gate_mul", &args)?;
        }
        self.o.run(l, sc.out, sc.attn, n, before_fold)?;
        residual.set_pending(sc.out);
        Ok(())
    }

    fn folds_norm(&self, t: &Tuning, rows: u32) -> bool {
        self.gate.is_none() && self.norm.folds() && self.qkv.folds_norm(t, rows)
    }
}
