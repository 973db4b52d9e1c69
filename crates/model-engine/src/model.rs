// SPDX-License-Identifier: MIT OR Apache-2.0
//! The model: the layer plan's blocks over a paged KV cache, and one step of any shape.
//!
//! One step takes a flat list of tokens, each with its sequence and position; prefill (many
//! tokens of one sequence), decode (one token of each of many sequences) and mixtures of both are
//! the same call. Keys and values go to the paged cache through each sequence's block table, and
//! attention reads them back from there, so a step never needs the previous steps' activations.
//!
//! A step is `upload` (its integer inputs in one host-to-device copy into fixed buffers) then
//! [`Model::enqueue`]: the embedding, every block of the [`LayerPlan`] in order (each folds the
//! previous block's output into the f32 residual stream, normalises and computes:
//! [`crate::blocks`]), the final norm and the LM head on the rows that need logits. `enqueue`
//! reads only the step's sizes, so a pure decode step is captured once per (sequences, attention
//! split) and replayed. Precision: the residual stream is f32, every other activation bf16
//! rounded once by the kernel that writes it, logits f32 (docs/precision.md).

use std::sync::Arc;

use metrale_cache::BlockTable;
use metrale_config::ModelConfig;
use metrale_core::{DevicePtr, KvCacheDtype};
use metrale_gpu_runtime::{
    Event, GpuBackend, GpuError, Graph, KernelHandle, Stream, launch_kernel,
};
use metrale_kernels::KernelAbi;
use metrale_kernels::ops::{
    ArgmaxF32, Embedding, GEMV_FMA_MAX_ROWS, argmax_scratch_bytes, attention_splits_of,
    prefill_attention_tiles_of,
};

use crate::blocks::attention::{
    self, ATTENTION_PARTIALS, Attention, prefill_tile, prefill_version,
};
use crate::blocks::gated_delta::{self, GatedDeltaNet};
use crate::blocks::mamba2::{self, Mamba2};
use crate::blocks::mlp::{self, DenseMlp, DenseRelu2Mlp};
use crate::blocks::moe::{self, Moe};
use crate::blocks::{Arena, Block, Step};
use crate::launch::Launcher;
use crate::linear::{Linear, LinearKernels};
use crate::plan::{BlockKind, LayerPlan, MlpKind};
use crate::profile::Profiler;
use crate::residual::{Residual, RmsNorm};
use crate::tuning::Tuning;
use crate::weights::LinearFormat;
use crate::weights::{self, DeviceWeights, LoadProgress};

/// What can go wrong loading or running the model.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// A tensor the config needs is not in the checkpoint.
    #[error("{checkpoint}: missing tensor `{name}`")]
    MissingTensor {
        /// HF name.
        name: String,
        /// The checkpoint.
        checkpoint: String,
    },
    /// A tensor's shape disagrees with the config.
    #[error("{checkpoint}: tensor `{name}` has shape {found:?}, the config implies {expected:?}")]
    ShapeMismatch {
        /// HF name.
        name: String,
        /// From the config.
        expected: Vec<usize>,
        /// In the file.
        found: Vec<usize>,
        /// The checkpoint.
        checkpoint: String,
    },
    /// Reading the weights failed.
    #[error(transparent)]
    Weights(#[from] metrale_model_weights::WeightError),
    /// A backend operation failed.
    #[error(transparent)]
    Gpu(#[from] GpuError),
    /// The step's input breaks a limit or an invariant.
    #[error("invalid step: {0}")]
    InvalidStep(String),
    /// The checkpoint needs a kind of layer the engine does not implement.
    #[error("unsupported model: {0}")]
    Unsupported(String),
    /// The KV cache's element type cannot serve this model on this backend.
    #[error("KV cache: {0}")]
    KvCache(String),
    /// A schedule choice the engine does not take (the kernel tree's `[tuning]`, `--tune`, an
    /// operator switch).
    #[error(transparent)]
    Tuning(#[from] crate::tuning::TuningError),
}

/// Where an FP8 KV cache's per-layer scales came from, for the start-up log.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvCacheScales {
    /// The cache's element type.
    pub dtype: KvCacheDtype,
    /// Attention layers whose `k_scale` / `v_scale` the checkpoint gave
    /// ([`crate::weights::checkpoint_kv_scales`]); every other layer's are 1.0.
    pub from_checkpoint: usize,
}

impl std::fmt::Display for KvCacheScales {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (self.dtype, self.from_checkpoint) {
            (KvCacheDtype::Bf16, _) => write!(f, "KV cache bf16"),
            (KvCacheDtype::Fp8, 0) => write!(
                f,
                "KV cache fp8_e4m3 with scales 1.0 (the checkpoint has no k_scale / v_scale; \
                 uncalibrated, as vLLM without them)"
            ),
            (KvCacheDtype::Fp8, n) => write!(
                f,
                "KV cache fp8_e4m3 with the checkpoint's k_scale / v_scale in {n} attention layers"
            ),
        }
    }
}

/// Sizes fixed at load: scratch buffers and the KV pool are allocated once from these.
#[derive(Clone, Copy, Debug)]
pub struct ModelOptions {
    /// Most tokens one step may carry (the prefill chunk).
    pub max_tokens_per_step: usize,
    /// Most sequences one step may touch.
    pub max_seqs: usize,
    /// Most rows of logits one step may ask for.
    pub max_logit_rows: usize,
    /// Longest sequence (prompt + generated tokens).
    pub max_seq_len: usize,
    /// KV blocks in the pool.
    pub num_blocks: usize,
    /// Tokens per KV block.
    pub block_size: usize,
    /// The KV cache's element type (`--kv-cache-dtype`): bf16, or FP8 E4M3 with per-layer
    /// scales (half the bytes a token). The attention blocks' cache writes and reads follow it.
    pub kv_cache: KvCacheDtype,
    /// Recurrent-state slots (a hybrid model's Gated DeltaNet or Mamba-2 layers keep one state
    /// per running sequence in a slot; the server adds the prefix cache's snapshot slots after
    /// the running ones, filled and read by [`Model::copy_state_slot`]). 0 for a model without
    /// recurrent layers.
    pub state_slots: usize,
}

impl ModelOptions {
    /// KV cache bytes per block of elements of `dtype`, every attention layer (a hybrid model's
    /// recurrent layers keep no KV), K and V.
    pub fn kv_bytes_per_block(config: &ModelConfig, block_size: usize, dtype: KvCacheDtype) -> u64 {
        let layers = config.num_layers - config.hybrid.as_ref().map_or(0, |h| h.recurrent_layers());
        (2 * layers * block_size * config.num_kv_heads * config.head_dim * dtype.element_bytes())
            as u64
    }

    /// Whether a cache of `dtype` can serve `config` on `gpu`: an FP8 cache needs its decode
    /// attention kernels (head dims 64, 128 and 256) in the backend's kernel set. Called by
    /// [`Model::load`] and by callers that want the refusal before a long load.
    pub fn check_kv_cache(
        config: &ModelConfig,
        gpu: &dyn GpuBackend,
        dtype: KvCacheDtype,
    ) -> Result<(), ModelError> {
        if dtype == KvCacheDtype::Bf16 {
            return Ok(());
        }
        if !metrale_kernels::ops::fp8_attention_takes_head_dim(config.head_dim as u32) {
            return Err(ModelError::KvCache(format!(
                "--kv-cache-dtype fp8 at head_dim {}: the FP8 cache's attention kernels take head \
                 dims 64, 128 and 256; use --kv-cache-dtype bf16",
                config.head_dim
            )));
        }
        for name in crate::blocks::attention::fp8_cache_kernels() {
            if gpu.kernel(name).is_err() {
                return Err(ModelError::KvCache(format!(
                    "--kv-cache-dtype fp8: the {} backend has no kernel {name}; use \
                     --kv-cache-dtype bf16",
                    gpu.kind()
                )));
            }
        }
        Ok(())
    }

    /// Recurrent-state bytes of one state slot (every recurrent layer's conv inputs in bf16 and
    /// its f32 matrix state); 0 for a model without recurrent layers.
    pub fn state_bytes_per_slot(config: &ModelConfig) -> u64 {
        config
            .hybrid
            .as_ref()
            .map_or(0, |h| h.state_bytes_per_sequence(2) as u64)
    }

    /// Block-table width: blocks of the longest sequence.
    pub fn max_blocks_per_seq(&self) -> usize {
        self.max_seq_len.div_ceil(self.block_size)
    }
}

/// One step's tokens.
#[derive(Clone, Copy, Debug)]
pub struct StepInput<'a> {
    /// Token ids.
    pub tokens: &'a [u32],
    /// Position of each token within its sequence.
    pub positions: &'a [u32],
    /// Index into `block_tables` of each token's sequence.
    pub token_seq: &'a [u32],
    /// Block table of every sequence the step touches; each must already hold the positions.
    pub block_tables: &'a [&'a BlockTable],
    /// Token indices whose next-token logits are wanted (e.g. the last token of each sequence).
    pub logit_rows: &'a [usize],
    /// The recurrent-state slot of every sequence, in `block_tables`' order (models with
    /// recurrent layers; empty otherwise). A sequence whose first token in the step is at
    /// position 0 starts from a zero state; any other continues the state its slot holds, which
    /// must be the state after its previous tokens. A model with recurrent layers also needs
    /// each sequence's tokens contiguous, in position order, and the sequences in
    /// `token_seq` order.
    pub state_slots: &'a [u32],
}

/// Where a step's uploaded integer inputs landed on the device.
#[derive(Clone, Copy, Debug)]
pub(crate) struct StepBuffers {
    pub(crate) ids: DevicePtr,
    pub(crate) positions: DevicePtr,
    pub(crate) token_seq: DevicePtr,
    pub(crate) slots: DevicePtr,
    /// The prefill attention's query tiles, `num_tiles` of (seq, first token, first position,
    /// count).
    pub(crate) tiles: DevicePtr,
    pub(crate) num_tiles: u32,
    /// Leading tokens that are runs of one token (the decode rows, which the scheduler puts
    /// first): in a mixed step they go through the split decode attention, as they would in a
    /// decode-only step, and the prefill attention takes the tiles after them.
    pub(crate) decode_rows: u32,
    pub(crate) tables: DevicePtr,
    /// i32 `[seqs + 1]`: each sequence's first token, then the step's tokens (after the tables).
    pub(crate) seq_starts: DevicePtr,
    /// i32 `[seqs]`: each sequence's recurrent-state slot.
    pub(crate) state_slots: DevicePtr,
}

/// Device buffers of the step itself (the blocks own theirs), sized once for
/// `max_tokens_per_step` tokens.
pub(crate) struct Buffers {
    /// f32 `[tokens, hidden]`, then f32 `[GEMV_FMA_MAX_ROWS, hidden]`: the residual stream's two
    /// buffers ([`Residual`]).
    hidden: [DevicePtr; 2],
    /// bf16 `[tokens, hidden]`: normalised rows.
    x: DevicePtr,
    /// bf16 `[max_logit_rows, hidden]`: the logit rows gathered when they are not contiguous.
    gathered: DevicePtr,
    /// f32 `[max_logit_rows, vocab]`.
    pub(crate) logits: DevicePtr,
    /// i32 `[max_logit_rows]`: the device-side argmax of each logits row.
    argmax: DevicePtr,
    /// u64 `[2 * max_logit_rows]`, zero between launches: the argmax blocks' merge keys and
    /// counts ([`ArgmaxF32`]'s `scratch`).
    pub(crate) argmax_scratch: DevicePtr,
    /// The per-step integer inputs, packed so a step uploads them in one copy: for a step of n
    /// tokens, ids, positions, token_seq and slots (n entries each), the prefill attention's
    /// query tiles (room for n tiles of 4), then the block tables, then each sequence's first
    /// token (and the total) and its recurrent-state slot.
    pub(crate) step_inputs: DevicePtr,
}

pub(crate) struct Kernels {
    embedding: KernelHandle,
    embedding_vec: KernelHandle,
    add_rmsnorm: crate::residual::NormKernels,
    pub(crate) argmax: KernelHandle,
}

/// A loaded model: the plan's blocks, the KV pool, buffers and kernel handles on one backend.
pub struct Model {
    pub(crate) config: ModelConfig,
    pub(crate) options: ModelOptions,
    pub(crate) gpu: Arc<dyn GpuBackend>,
    plan: LayerPlan,
    pub(crate) tuning: Tuning,
    weights: DeviceWeights,
    /// Every block of every layer, in step order.
    blocks: Vec<Box<dyn Block>>,
    final_norm: RmsNorm,
    lm_head: Linear,
    pub(crate) scratch: Buffers,
    pub(crate) kernels: Kernels,
    owned: Vec<DevicePtr>,
    /// Captured decode steps, by (sequences, keys per attention split, splits).
    pub(crate) graphs: std::collections::HashMap<(u32, u32, u32), Graph>,
    /// Host time spent capturing and instantiating those graphs (`graph_captures`).
    capture_time: std::time::Duration,
    /// Per-launch timing (`set_profile`).
    pub(crate) profiler: Option<std::sync::Mutex<Profiler>>,
    /// Launch labels left out, for timing experiments (`set_skip`).
    pub(crate) skip: Vec<&'static str>,
    /// The MoE layers' expert choices, copied out while on (`set_routing_capture`).
    pub(crate) routing: Option<crate::instrument::RoutingCapture>,
    /// Whether each step's device work is timed ([`Model::set_step_timing`]).
    step_timing: bool,
    /// The two events step timing records, created on first use and kept (the backend has no
    /// call to destroy an event).
    step_events: Option<(Event, Event)>,
    /// The device time of the last step run with step timing on, ms.
    last_step_gpu_ms: Option<f32>,
    /// The stream ids are read back on while decode steps stay queued (created on first use).
    pub(crate) readback: Option<Stream>,
    /// Events [`Model::decode_ahead`] records after each step's argmax, kept for reuse (the
    /// backend has no call to destroy an event).
    pub(crate) ahead_events: Vec<Event>,
}

impl Model {
    /// Checks shapes, uploads the weights, and allocates the KV pool and buffers. `tuning`: the
    /// schedule ([`Tuning::for_target`] of the kernel target, usually).
    pub fn load(
        config: ModelConfig,
        source: &dyn metrale_model_weights::WeightSource,
        gpu: Arc<dyn GpuBackend>,
        options: ModelOptions,
        tuning: Tuning,
        progress: LoadProgress,
    ) -> Result<Self, ModelError> {
        Self::load_with(
            config,
            source,
            gpu,
            options,
            tuning,
            &LinearFormat::Bf16,
            progress,
        )
    }

    /// [`Model::load`] with the dense linears in `format` (BF16, quantized to FP8 at load, or the
    /// checkpoint's FP8): a property of each product's weight, the same blocks and plan.
    pub fn load_with(
        config: ModelConfig,
        source: &dyn metrale_model_weights::WeightSource,
        gpu: Arc<dyn GpuBackend>,
        options: ModelOptions,
        tuning: Tuning,
        format: &LinearFormat,
        progress: LoadProgress,
    ) -> Result<Self, ModelError> {
        let plan = LayerPlan::from_config(&config)?;
        plan.check_runnable()?;
        let g = gpu.as_ref();
        ModelOptions::check_kv_cache(&config, g, options.kv_cache)?;
        let kernels = Kernels {
            embedding: g.kernel(Embedding::NAME)?,
            embedding_vec: g.kernel(Embedding::VEC_NAME)?,
            add_rmsnorm: crate::residual::NormKernels {
                bf16: g.kernel(metrale_kernels::ops::AddRmsNorm::NAME)?,
                fp8_rows: g.kernel(metrale_kernels::ops::AddRmsNormFp8Rows::NAME)?,
            },
            argmax: g.kernel(ArgmaxF32::NAME)?,
        };
        let mut linear = LinearKernels::resolve(g)?;
        let weights =
            weights::load_with(&config, source, g, format, tuning.moe_fp8_experts, progress)?;
        let mut arena = Arena {
            gpu: g,
            owned: Vec::new(),
        };
        let built = Self::buffers(&config, &options, &mut arena).and_then(|(scratch, rope)| {
            // The BF16 scratch FP8 weights dequantise into on the library path: with the FP8
            // GEMM only those it cannot take do (Qwen3-8B: none, where it was 201 MB).
            let dequantised = if tuning.fp8_gemm {
                weights.fp8_max_dequant_weights
            } else {
                weights.fp8_max_weights
            };
            if dequantised > 0 {
                linear.fp8_scratch = arena.alloc(dequantised * 2)?;
            }
            if weights.fp8_max_k > 0 && tuning.fp8_gemm {
                let rows = options.max_tokens_per_step.max(1);
                let (bytes, scales_at) =
                    metrale_kernels::ops::fp8_rows_bytes(rows, weights.fp8_max_k);
                let values = arena.alloc(bytes)?;
                let group = metrale_kernels::ops::FP8_GEMM_PAD_ROWS as usize;
                linear.fp8_rows = crate::linear::Fp8Rows {
                    values,
                    scales: values.offset(scales_at),
                    tail: arena.alloc(group * weights.fp8_max_n * 2)?,
                };
            }
            let blocks =
                Self::blocks(&config, &options, &plan, &weights, linear, rope, &mut arena)?;
            Ok((scratch, blocks))
        });
        let (scratch, blocks) = match built {
            Ok(b) => b,
            Err(e) => {
                for p in arena.owned.iter().chain(&weights.allocations) {
                    let _ = g.free(*p);
                }
                return Err(e);
            }
        };
        g.synchronize(g.default_stream())?;
        let final_norm = RmsNorm::of(weights.final_norm, plan.final_norm)?;
        let (h, vocab) = (config.hidden_size as u32, config.vocab_size as u32);
        Ok(Model {
            final_norm,
            lm_head: Linear::new(
                "lm_head",
                weights.lm_head,
                DevicePtr::NULL,
                (vocab, h),
                linear,
            ),
            owned: arena.owned,
            config,
            options,
            gpu,
            plan,
            tuning,
            weights,
            blocks,
            scratch,
            kernels,
            graphs: std::collections::HashMap::new(),
            capture_time: std::time::Duration::ZERO,
            profiler: None,
            skip: Vec::new(),
            routing: None,
            step_timing: false,
            step_events: None,
            last_step_gpu_ms: None,
            readback: None,
            ahead_events: Vec::new(),
        })
    }

    /// The step's own buffers and the RoPE tables (the argmax scratch zeroed, not synchronised).
    fn buffers(
        c: &ModelConfig,
        options: &ModelOptions,
        arena: &mut Arena,
    ) -> Result<(Buffers, (DevicePtr, DevicePtr)), ModelError> {
        let t = options.max_tokens_per_step;
        let h = c.hidden_size;
        let rows = options.max_seqs.max(1);
        let logit_rows = options.max_logit_rows.max(1);
        let scratch = Buffers {
            step_inputs: arena
                .alloc((8 * t + rows * (options.max_blocks_per_seq() + 2) + 1) * 4)?,
            hidden: [
                arena.alloc(t * h * 4)?,
                arena.alloc(t.min(GEMV_FMA_MAX_ROWS as usize) * h * 4)?,
            ],
            x: arena.alloc(t * h * 2)?,
            logits: arena.alloc(logit_rows * c.vocab_size * 4)?,
            gathered: arena.alloc(logit_rows * h * 2)?,
            argmax: arena.alloc(logit_rows * 4)?,
            argmax_scratch: arena.alloc(argmax_scratch_bytes(logit_rows))?,
        };
        let g = arena.gpu;
        let bytes = argmax_scratch_bytes(logit_rows);
        g.memset(scratch.argmax_scratch, 0, bytes, g.default_stream())?;
        let (cos, sin) = crate::rope::tables(c, options.max_seq_len);
        let rope = (arena.alloc(cos.len() * 4)?, arena.alloc(sin.len() * 4)?);
        g.copy_h2d(bytemuck::cast_slice(&cos), rope.0)?;
        g.copy_h2d(bytemuck::cast_slice(&sin), rope.1)?;
        Ok((scratch, rope))
    }

    /// One block module per entry of the plan, over the layers' weights; blocks of a kind share
    /// their scratch.
    fn blocks(
        c: &ModelConfig,
        options: &ModelOptions,
        plan: &LayerPlan,
        weights: &DeviceWeights,
        linear: LinearKernels,
        rope: (DevicePtr, DevicePtr),
        arena: &mut Arena,
    ) -> Result<Vec<Box<dyn Block>>, ModelError> {
        let sizes = attention::Sizes {
            hidden: c.hidden_size,
            max_tokens: options.max_tokens_per_step,
            max_seq_len: options.max_seq_len,
            num_blocks: options.num_blocks,
            block_size: options.block_size,
            max_blocks_per_seq: options.max_blocks_per_seq(),
            kv_cache: options.kv_cache,
        };
        let mut attention_shared = None;
        let mut mlp_scratch = None;
        let mut moe_shared: Option<moe::Shared> = None;
        let mut gdn_shared: Option<(gated_delta::Shared, crate::plan::GatedDeltaNetSpec)> = None;
        let mut mamba_shared: Option<(mamba2::Shared, crate::plan::Mamba2Spec)> = None;
        let mut relu2_scratch = None;
        let mut blocks: Vec<Box<dyn Block>> = Vec::new();
        for (l, spec) in plan.blocks() {
            let w = &weights.layers[l];
            match spec.kind {
                BlockKind::Attention(a) => {
                    let norm = RmsNorm::of(w.input_norm, spec.norm)?;
                    let shared = match attention_shared {
                        Some(s) => s,
                        None => *attention_shared
                            .insert(attention::Shared::new(arena.gpu, arena, &a, sizes, rope)?),
                    };
                    let block = Attention::new(arena, a, norm, w, linear, shared, sizes)?;
                    blocks.push(Box::new(block));
                }
                BlockKind::Mlp(MlpKind::DenseSwiglu { intermediate }) => {
                    let norm = RmsNorm::of(w.post_norm, spec.norm)?;
                    let t = options.max_tokens_per_step;
                    let scratch = match mlp_scratch {
                        Some(s) => s,
                        None => *mlp_scratch.insert(mlp::Scratch::new(
                            arena,
                            t,
                            c.hidden_size,
                            intermediate,
                        )?),
                    };
                    let dims = (c.hidden_size as u32, intermediate as u32);
                    blocks.push(Box::new(DenseMlp::new(norm, w, dims, linear, scratch)));
                }
                BlockKind::Mlp(MlpKind::Moe(m)) => {
                    let norm = RmsNorm::of(w.post_norm, spec.norm)?;
                    let shared = match moe_shared {
                        Some(s) if s.fits(&m) => s,
                        Some(_) => {
                            return Err(ModelError::InvalidStep(format!(
                                "layer {l}'s experts differ from the first sparse layer's"
                            )));
                        }
                        None => *moe_shared.insert(moe::Shared::new(
                            arena.gpu,
                            arena,
                            m,
                            options.max_tokens_per_step,
                            c.hidden_size,
                        )?),
                    };
                    let weights = w.moe.as_ref().expect("a sparse layer's weights");
                    let hidden = c.hidden_size as u32;
                    blocks.push(Box::new(Moe::new(norm, weights, hidden, linear, shared)));
                }
                BlockKind::GatedDeltaNet(g) => {
                    let norm = RmsNorm::of(w.input_norm, spec.norm)?;
                    let shared = match gdn_shared {
                        Some((s, first)) if gated_delta::Shared::fits(&g, &first) => s,
                        Some(_) => {
                            return Err(ModelError::Unsupported(format!(
                                "layer {l}'s Gated DeltaNet differs in shape from the first one's"
                            )));
                        }
                        None => {
                            let s = gated_delta::Shared::new(
                                arena,
                                &g,
                                options.max_tokens_per_step,
                                c.hidden_size,
                            )?;
                            gdn_shared.insert((s, g)).0
                        }
                    };
                    let weights = w.gdn.as_ref().expect("a Gated DeltaNet layer's weights");
                    let sizes = (c.hidden_size, options.state_slots.max(1));
                    let block = GatedDeltaNet::new(arena, g, norm, weights, sizes, linear, shared)?;
                    blocks.push(Box::new(block));
                }
                BlockKind::Mamba2(m) => {
                    let norm = RmsNorm::of(w.input_norm, spec.norm)?;
                    let shared = match mamba_shared {
                        Some((s, first)) if mamba2::Shared::fits(&m, &first) => s,
                        Some(_) => {
                            return Err(ModelError::Unsupported(format!(
                                "layer {l}'s Mamba-2 differs in shape from the first one's"
                            )));
                        }
                        None => {
                            let s = mamba2::Shared::new(
                                arena,
                                &m,
                                options.max_tokens_per_step,
                                c.hidden_size,
                            )?;
                            mamba_shared.insert((s, m)).0
                        }
                    };
                    let weights = w.mamba.as_ref().expect("a Mamba-2 layer's weights");
                    let sizes = (c.hidden_size, options.state_slots.max(1));
                    let block = Mamba2::new(arena, m, norm, weights, sizes, linear, shared)?;
                    blocks.push(Box::new(block));
                }
                BlockKind::Mlp(MlpKind::DenseRelu2 { intermediate }) => {
                    let norm = RmsNorm::of(w.post_norm, spec.norm)?;
                    let t = options.max_tokens_per_step;
                    let scratch = match relu2_scratch {
                        Some(s) => s,
                        None => *relu2_scratch.insert(mlp::Scratch::new(
                            arena,
                            t,
                            c.hidden_size,
                            intermediate,
                        )?),
                    };
                    let dims = (c.hidden_size as u32, intermediate as u32);
                    let block = DenseRelu2Mlp::new(arena.gpu, norm, w, dims, linear, scratch)?;
                    blocks.push(Box::new(block));
                }
            }
        }
        Ok(blocks)
    }

    /// The schedule the model runs with.
    pub fn tuning(&self) -> &Tuning {
        &self.tuning
    }

    /// Replaces the schedule (for experiments: `met bench-model --tune`). Captured graphs are set
    /// aside (not freed: this is a measuring tool) so that the next decode steps are captured
    /// under the new one. Scratch sized at load for the load's tuning stays as it was (the FP8
    /// products' quantize and dequantise scratches): a step that needs one its load did not
    /// allocate fails with [`ModelError::InvalidStep`].
    pub fn set_tuning(&mut self, tuning: Tuning) {
        self.tuning = tuning;
        self.graphs.clear();
    }

    /// The state slots of a step of one sequence (`met generate`, `met parity`, warm-up): slot 0
    /// for a model with recurrent layers, none otherwise.
    pub fn solo_state_slot(&self) -> &'static [u32] {
        if self.plan.recurrent_layers() > 0 {
            &[0]
        } else {
            &[]
        }
    }

    /// Copies recurrent-state slot `from` into slot `to`, every recurrent layer's conv inputs
    /// and matrix state, device to device on the default stream (so after the steps queued
    /// before it and before those queued after). The server keeps a prefix's state this way (a
    /// snapshot slot) and restores it into a sequence's slot on a prefix-cache hit. Nothing to
    /// do for a model without recurrent layers.
    pub fn copy_state_slot(&mut self, from: u32, to: u32) -> Result<(), ModelError> {
        let slots = self.options.state_slots;
        if self.plan.recurrent_layers() == 0 {
            return Ok(());
        }
        if from as usize >= slots || to as usize >= slots || from == to {
            return Err(ModelError::InvalidStep(format!(
                "copy of state slot {from} into {to}: two distinct slots of the {slots} the model \
                 holds"
            )));
        }
        let stream = self.gpu.default_stream();
        for block in &self.blocks {
            block.copy_state(self.gpu.as_ref(), stream, from as usize, to as usize)?;
        }
        Ok(())
    }

    /// The layer plan the model was built from.
    pub fn plan(&self) -> &LayerPlan {
        &self.plan
    }

    /// Times each step's device work with two events: from after its inputs are uploaded to
    /// after its last launch (the argmax in [`Model::forward_argmax`]), so that a step's wall
    /// time minus this is what the host's round trip between steps costs (the device waits for
    /// it: the upload and the read-back are synchronous). The stream is idle when the first
    /// event is recorded, so the time also holds the host's submission of the step's launches
    /// (one graph launch and the argmax when replayed, every launch otherwise): the round trip it
    /// leaves out is the upload, the read-back and the host's work between steps. Read it with
    /// [`Model::last_step_gpu_ms`].
    pub fn set_step_timing(&mut self, on: bool) -> Result<(), ModelError> {
        if on && self.step_events.is_none() {
            let g = self.gpu.as_ref();
            self.step_events = Some((g.create_event()?, g.create_event()?));
        }
        self.step_timing = on;
        self.last_step_gpu_ms = None;
        Ok(())
    }

    /// The device time of the last step run with step timing on, ms.
    pub fn last_step_gpu_ms(&self) -> Option<f32> {
        self.last_step_gpu_ms
    }

    /// Records the step timing's end event and reads the step's device time (synchronises).
    fn finish_step_timing(&mut self) -> Result<(), ModelError> {
        if let (true, Some((start, end))) = (self.step_timing, self.step_events) {
            let g = self.gpu.as_ref();
            let s = g.default_stream();
            g.record_event(end, s)?;
            g.synchronize(s)?;
            self.last_step_gpu_ms = Some(g.elapsed_ms(start, end)?);
        }
        Ok(())
    }

    /// Whether decode steps are replayed from captured graphs.
    pub fn set_graphs(&mut self, on: bool) {
        self.tuning.graphs = on;
    }

    /// How many decode-step graphs have been captured (one per batch size and attention split
    /// bucket met so far) and the host time their capture and instantiation took: the cost a
    /// generation pays when its context crosses into a new split bucket.
    pub fn graph_captures(&self) -> (usize, std::time::Duration) {
        (self.graphs.len(), self.capture_time)
    }

    /// The config the model was built from.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// The KV cache's element type and where its FP8 scales came from.
    pub fn kv_cache_scales(&self) -> KvCacheScales {
        KvCacheScales {
            dtype: self.options.kv_cache,
            from_checkpoint: self.weights.kv_scaled_layers,
        }
    }

    /// The sizes the model was loaded with.
    pub fn options(&self) -> &ModelOptions {
        &self.options
    }

    /// Bytes of weights on the device.
    pub fn weight_bytes(&self) -> u64 {
        self.weights.bytes
    }

    /// The backend it runs on.
    pub fn gpu(&self) -> &dyn GpuBackend {
        self.gpu.as_ref()
    }

    pub(crate) fn validate(&self, step: &StepInput) -> Result<(), ModelError> {
        let n = step.tokens.len();
        let bad = |m: String| Err(ModelError::InvalidStep(m));
        if n == 0 || n > self.options.max_tokens_per_step {
            return bad(format!(
                "{n} tokens; a step carries 1..={}",
                self.options.max_tokens_per_step
            ));
        }
        if step.positions.len() != n || step.token_seq.len() != n {
            return bad("tokens, positions and token_seq differ in length".into());
        }
        if step.block_tables.is_empty() || step.block_tables.len() > self.options.max_seqs {
            return bad(format!(
                "{} sequences; a step touches 1..={}",
                step.block_tables.len(),
                self.options.max_seqs
            ));
        }
        if step.logit_rows.len() > self.options.max_logit_rows
            || step.logit_rows.iter().any(|&r| r >= n)
        {
            return bad(format!(
                "logit rows {:?} out of range for {n} tokens",
                step.logit_rows
            ));
        }
        for (t, ((&id, &pos), &seq)) in step
            .tokens
            .iter()
            .zip(step.positions)
            .zip(step.token_seq)
            .enumerate()
        {
            if id as usize >= self.config.vocab_size {
                return bad(format!(
                    "token {t} has id {id}, outside the vocabulary of {}",
                    self.config.vocab_size
                ));
            }
            if pos as usize >= self.options.max_seq_len {
                return bad(format!(
                    "token {t} is at position {pos}, past max_seq_len {}",
                    self.options.max_seq_len
                ));
            }
            let Some(table) = step.block_tables.get(seq as usize) else {
                return bad(format!(
                    "token {t} names sequence {seq} of {}",
                    step.block_tables.len()
                ));
            };
            if table.slot(pos as usize, self.options.block_size).is_none() {
                return bad(format!(
                    "token {t}: sequence {seq}'s block table does not reach position {pos}"
                ));
            }
            if table
                .blocks
                .iter()
                .any(|&b| b as usize >= self.options.num_blocks)
            {
                return bad(format!(
                    "sequence {seq}'s block table names a block outside the pool of {}",
                    self.options.num_blocks
                ));
            }
        }
        if self.plan.recurrent_layers() > 0 {
            self.validate_recurrent(step)?;
        }
        Ok(())
    }

    /// What a model with recurrent state needs of a step: one distinct slot per sequence, and
    /// each sequence's tokens one contiguous run in position order, the runs in sequence order.
    fn validate_recurrent(&self, step: &StepInput) -> Result<(), ModelError> {
        let bad = |m: String| Err(ModelError::InvalidStep(m));
        let seqs = step.block_tables.len();
        if step.state_slots.len() != seqs {
            return bad(format!(
                "{} state slots for {seqs} sequences: a model with recurrent layers needs one \
                 per sequence",
                step.state_slots.len()
            ));
        }
        let mut seen = vec![false; self.options.state_slots];
        for &slot in step.state_slots {
            match seen.get_mut(slot as usize) {
                None => {
                    return bad(format!(
                        "state slot {slot} is outside the {} the model holds",
                        self.options.state_slots
                    ));
                }
                Some(true) => return bad(format!("state slot {slot} is named twice")),
                Some(s) => *s = true,
            }
        }
        for t in 1..step.tokens.len() {
            let (a, b) = (step.token_seq[t - 1], step.token_seq[t]);
            let next = step.positions[t - 1] + 1;
            if b < a || (b == a && step.positions[t] != next) || b > a + 1 {
                return bad(format!(
                    "token {t} (sequence {b}, position {}) does not continue the runs: a model \
                     with recurrent layers takes each sequence's tokens contiguous and in \
                     position order, sequences in order",
                    step.positions[t]
                ));
            }
        }
        if step.token_seq.first() != Some(&0)
            || step.token_seq.last().map(|&s| s as usize + 1) != Some(seqs)
        {
            return bad(format!(
                "the step's tokens do not cover its {seqs} sequences in order"
            ));
        }
        Ok(())
    }

    /// Runs one step and returns the logits of `step.logit_rows`, row-major `[rows, vocab]`.
    pub fn forward(&mut self, step: &StepInput) -> Result<Vec<f32>, ModelError> {
        let rows = self.run(step)?;
        self.finish_step_timing()?;
        let (g, s) = (self.gpu.as_ref(), self.gpu.default_stream());
        g.synchronize(s)?;
        let mut logits = vec![0f32; rows * self.config.vocab_size];
        if rows > 0 {
            g.copy_d2h(self.scratch.logits, bytemuck::cast_slice_mut(&mut logits))?;
        }
        Ok(logits)
    }

    /// Runs a prefill-shaped step (up to 16 tokens, above the GEMV's row limit) and a
    /// decode-shaped step through the first KV blocks, so that one-time set-up on the first use
    /// of each path (a GEMM library's handle, workspace and plans) is paid before the first
    /// request. Call it before the pool is in use: it writes garbage keys and values into those
    /// blocks, which a later sequence overwrites before it reads them.
    pub fn warm_up(&mut self) -> Result<(), ModelError> {
        let o = self.options;
        let n = o.max_tokens_per_step.min(16).min(o.max_seq_len);
        let blocks = n.div_ceil(o.block_size);
        if n == 0 || blocks > o.num_blocks {
            return Ok(());
        }
        let table = BlockTable {
            blocks: (0..blocks as u32).collect(),
        };
        let tokens = vec![0u32; n];
        let positions: Vec<u32> = (0..n as u32).collect();
        let seq = vec![0u32; n];
        self.forward_argmax(&StepInput {
            tokens: &tokens,
            positions: &positions,
            token_seq: &seq,
            block_tables: &[&table],
            logit_rows: &[n - 1],
            state_slots: self.solo_state_slot(),
        })?;
        self.forward_argmax(&StepInput {
            tokens: &tokens[..1],
            positions: &positions[n - 1..],
            token_seq: &seq[..1],
            block_tables: &[&table],
            logit_rows: &[0],
            state_slots: self.solo_state_slot(),
        })?;
        Ok(())
    }

    /// Queues one step up to the logits of `step.logit_rows` in `scratch.logits`; returns the
    /// number of rows. Nothing is synchronised.
    fn run(&mut self, step: &StepInput) -> Result<usize, ModelError> {
        self.run_with(step, None)
    }

    /// [`Model::run`]; with `queued` the step was validated by the caller and its inputs are
    /// queued into `scratch.step_inputs` (as [`Model::pack`] lays them out, at these places)
    /// ahead of it on the stream, so nothing is uploaded (and step timing does not apply).
    pub(crate) fn run_with(
        &mut self,
        step: &StepInput,
        queued: Option<StepBuffers>,
    ) -> Result<usize, ModelError> {
        let inputs = match queued {
            Some(inputs) => inputs,
            None => {
                self.validate(step)?;
                let inputs = self.upload(step)?;
                if let (true, Some((start, _))) = (self.step_timing, self.step_events) {
                    let g = self.gpu.as_ref();
                    g.record_event(start, g.default_stream())?;
                }
                inputs
            }
        };
        let n = step.tokens.len() as u32;
        let qh = self.config.num_heads as u32;
        // The split decode attention covers the leading decode rows of a mixed step, or the
        // whole step when the tensor-core prefill kernel does not apply.
        let paged_rows = if self.tensor_core_prefill(step) {
            inputs.decode_rows
        } else {
            n
        };
        let max_context = step.positions[..paged_rows as usize]
            .iter()
            .max()
            .map_or(1, |&p| p + 1);
        // A pure decode step (one token per sequence, each with a logit row, in order) can be
        // replayed from a graph: everything it launches depends only on the number of
        // sequences and the attention split, whose shape attention_splits buckets so that a
        // handful of graphs cover every context length (it changes where the context doubles).
        // Decode rows take that split with or without graphs, so that replaying a graph
        // computes bit for bit what launching the step directly would, and in mixed steps too.
        let pure_decode = step.block_tables.len() == step.tokens.len()
            && step.logit_rows.iter().copied().eq(0..step.tokens.len())
            && step.token_seq.iter().copied().eq(0..n);
        let split = attention_splits_of(
            paged_rows.max(1),
            qh,
            self.config.num_kv_heads as u32,
            max_context,
            ATTENTION_PARTIALS,
            self.tuning.attention_target_blocks,
            self.tuning.attention_split_keys,
            self.tuning.attention_unsplit_keys,
        );
        if !pure_decode {
            return self.enqueue(step, inputs, split);
        }
        if !self.tuning.graphs || self.profiler.is_some() || self.routing.is_some() {
            return self.enqueue(step, inputs, split);
        }
        let key = (n, split.0, split.1);
        let (g, s) = (self.gpu.as_ref(), self.gpu.default_stream());
        if let Some(&graph) = self.graphs.get(&key) {
            g.launch_graph(graph, s)?;
            return Ok(step.logit_rows.len());
        }
        let started = std::time::Instant::now();
        g.begin_capture(s)?;
        let rows = self.enqueue(step, inputs, split);
        let graph = g.end_capture(s);
        let (rows, graph) = (rows?, graph?);
        self.capture_time += started.elapsed();
        self.graphs.insert(key, graph);
        g.launch_graph(graph, s)?;
        Ok(rows)
    }

    /// Uploads the step's integer inputs in one copy; returns where each part landed.
    fn upload(&self, step: &StepInput) -> Result<StepBuffers, ModelError> {
        let (packed, buffers) = self.pack(step, true);
        self.gpu
            .copy_h2d(bytemuck::cast_slice(&packed), self.scratch.step_inputs)?;
        Ok(buffers)
    }

    /// The step's integer inputs as [`Model::upload`] copies them to `scratch.step_inputs`, and
    /// where each part lands there; without `tables`, only the per-token part before the block
    /// table rows (`8 * tokens` values).
    pub(crate) fn pack(&self, step: &StepInput, tables: bool) -> (Vec<i32>, StepBuffers) {
        let o = &self.options;
        let sc = &self.scratch;
        let n = step.tokens.len();
        let ids: Vec<i32> = step.tokens.iter().map(|&t| t as i32).collect();
        let positions: Vec<i32> = step.positions.iter().map(|&p| p as i32).collect();
        let token_seq: Vec<i32> = step.token_seq.iter().map(|&q| q as i32).collect();
        let slots: Vec<i32> = step
            .positions
            .iter()
            .zip(step.token_seq)
            .map(|(&p, &q)| {
                step.block_tables[q as usize]
                    .slot(p as usize, o.block_size)
                    .expect("validated") as i32
            })
            .collect();
        let tiles = prefill_attention_tiles_of(
            &token_seq,
            &positions,
            prefill_tile(prefill_version(
                &self.tuning,
                self.config.head_dim as u32,
                self.options.kv_cache,
            )),
        );
        let num_tiles = tiles.len() as u32;
        let decode_rows = tiles.iter().take_while(|t| t[3] == 1).count() as u32;
        let tiles = tiles.concat();
        let mut packed = [ids, positions, token_seq, slots, tiles].concat();
        packed.resize(8 * n, 0);
        let width = o.max_blocks_per_seq();
        let seqs = step.block_tables.len();
        if tables {
            packed.extend(
                step.block_tables
                    .iter()
                    .flat_map(|t| t.padded_row(width, 0)),
            );
            // Each sequence's first token (runs in sequence order: validated for a model that
            // reads them), then the total; then the state slots.
            let mut starts = vec![n as i32; seqs + 1];
            for (t, &q) in step.token_seq.iter().enumerate().rev() {
                starts[q as usize] = t as i32;
            }
            packed.extend(starts);
            packed.extend(step.state_slots.iter().map(|&s| s as i32));
            packed.resize(8 * n + seqs * (width + 2) + 1, 0);
        }
        let region = |i: usize| sc.step_inputs.offset(i * n * 4);
        let after_tables = sc.step_inputs.offset((8 * n + seqs * width) * 4);
        let buffers = StepBuffers {
            ids: region(0),
            positions: region(1),
            token_seq: region(2),
            slots: region(3),
            tiles: region(4),
            num_tiles,
            decode_rows,
            tables: region(8),
            seq_starts: after_tables,
            state_slots: after_tables.offset((seqs + 1) * 4),
        };
        (packed, buffers)
    }

    /// Runs one step and returns the argmax of each row of `step.logit_rows` (the lowest id on
    /// ties, NaN never chosen: what a greedy sampler without bias or penalties picks), taken on
    /// the device so that only one id per row comes back instead of the row's logits.
    pub fn forward_argmax(&mut self, step: &StepInput) -> Result<Vec<u32>, ModelError> {
        let rows = self.run(step)?;
        let (g, s) = (self.gpu.as_ref(), self.gpu.default_stream());
        let mut ids = vec![0i32; rows];
        if rows > 0 {
            let argmax = ArgmaxF32 {
                out: self.scratch.argmax,
                logits: self.scratch.logits,
                rows: rows as u32,
                cols: self.config.vocab_size as u32,
                scratch: self.scratch.argmax_scratch,
            };
            launch_kernel(g, self.kernels.argmax, &argmax, s)?;
            self.mark("argmax")?;
        }
        self.finish_step_timing()?;
        let (g, s) = (self.gpu.as_ref(), self.gpu.default_stream());
        g.synchronize(s)?;
        if rows > 0 {
            g.copy_d2h(self.scratch.argmax, bytemuck::cast_slice_mut(&mut ids))?;
        }
        Ok(ids.into_iter().map(|i| i as u32).collect())
    }

    /// Whether the step's attention runs on the tensor-core prefill kernel (for its tiles after
    /// the leading decode rows): some sequence brings more than one token, and the head dim is
    /// one the kernel covers.
    fn tensor_core_prefill(&self, step: &StepInput) -> bool {
        step.tokens.len() > step.block_tables.len()
            && attention::tensor_core_prefill(self.config.head_dim as u32)
    }

    /// How launches go out this step.
    fn launcher(&self) -> Launcher<'_> {
        Launcher {
            gpu: self.gpu.as_ref(),
            tuning: &self.tuning,
            skip: &self.skip,
            profiler: self.profiler.as_ref(),
            routing: self.routing.as_ref(),
        }
    }

    /// Queues the step's kernels (the inputs already uploaded) up to the logits of
    /// `step.logit_rows` in `scratch.logits`; returns the number of rows. Reads from `step` only
    /// its sizes and logit rows, so that a captured graph replays it for any step of the same
    /// shape.
    fn enqueue(
        &self,
        step: &StepInput,
        inputs: StepBuffers,
        split: (u32, u32),
    ) -> Result<usize, ModelError> {
        let l = self.launcher();
        if let Some(p) = l.profiler {
            p.lock().expect("profiler lock").begin(l.gpu)?;
        }
        if let Some(r) = l.routing {
            r.begin();
        }
        // The longest run of one sequence's tokens (1 in a decode step).
        let mut max_run = 0u32;
        let mut run = 0u32;
        for (t, &q) in step.token_seq.iter().enumerate() {
            run = if t > 0 && step.token_seq[t - 1] == q {
                run + 1
            } else {
                1
            };
            max_run = max_run.max(run);
        }
        let shape = Step {
            max_run,
            tokens: step.tokens.len() as u32,
            seqs: step.block_tables.len() as u32,
            inputs,
            split,
            tensor_core_prefill: self.tensor_core_prefill(step),
        };
        let mut residual = self.embed(&l, &shape)?;
        for (i, block) in self.blocks.iter().enumerate() {
            let next = self.blocks.get(i + 1);
            let before_fold = next.is_some_and(|b| b.folds_norm(&self.tuning, shape.tokens));
            block.enqueue(&l, &shape, &mut residual, before_fold)?;
        }
        let x = residual.add_norm(&l, self.final_norm, shape.tokens)?;
        self.logits(&l, step.logit_rows, x)
    }

    /// The token embedding into the residual stream's first buffer.
    fn embed(&self, l: &Launcher, step: &Step) -> Result<Residual, ModelError> {
        let c = &self.config;
        let sc = &self.scratch;
        let kernel = match self.tuning.embedding_vec {
            true => self.kernels.embedding_vec,
            false => self.kernels.embedding,
        };
        let args = Embedding {
            out: sc.hidden[0],
            table: self.weights.embedding,
            ids: step.inputs.ids,
            tokens: step.tokens,
            hidden: c.hidden_size as u32,
            vocab: c.vocab_size as u32,
        };
        l.launch(kernel, "embedding", &args)?;
        let cols = c.hidden_size as u32;
        Ok(Residual::new(
            sc.hidden,
            sc.x,
            cols,
            self.kernels.add_rmsnorm,
        ))
    }

    /// The LM head over the normalised rows `x` of `rows`, f32 logits into `scratch.logits`;
    /// returns the number of rows.
    fn logits(&self, l: &Launcher, rows: &[usize], x: DevicePtr) -> Result<usize, ModelError> {
        let Some(&first) = rows.first() else {
            return Ok(0);
        };
        let (g, s) = (l.gpu, l.gpu.default_stream());
        // A contiguous run is used in place, otherwise the rows are gathered first; in place only
        // at a 256-byte aligned start: cuBLASLt's algorithms assume that alignment of their
        // operands (hidden 576, SmolLM2, gives rows 128-byte aligned).
        let row_bytes = self.config.hidden_size * 2;
        let contiguous = (first * row_bytes).is_multiple_of(256)
            && rows.iter().enumerate().all(|(i, &r)| r == first + i);
        let input = if contiguous {
            x.offset(first * row_bytes)
        } else {
            let gathered = self.scratch.gathered;
            for (i, &r) in rows.iter().enumerate() {
                let (from, to) = (x.offset(r * row_bytes), gathered.offset(i * row_bytes));
                g.copy_d2d(from, to, row_bytes, s)?;
            }
            gathered
        };
        self.lm_head
            .run_f32(l, self.scratch.logits, input, rows.len() as u32)?;
        Ok(rows.len())
    }
}

impl Drop for Model {
    fn drop(&mut self) {
        for &p in self.owned.iter().chain(&self.weights.allocations) {
            let _ = self.gpu.free(p);
        }
    }
}
