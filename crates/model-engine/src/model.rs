// SPDX-License-Identifier: MIT OR Apache-2.0
//! The generic decoder's forward pass over a batch of tokens from any number of sequences.
//!
//! One step takes a flat list of tokens, each with its sequence and position; prefill (many
//! tokens of one sequence), decode (one token of each of many sequences) and mixtures of both are
//! the same call. Keys and values go to the paged cache through each sequence's block table, and
//! attention reads them back from there, so a step never needs the previous steps' activations.
//!
//! Per layer (pre-norm; the residual stream `h` is f32, every other activation bf16, and each
//! kernel computes in f32 and rounds its output once; docs/precision.md says why):
//! `x = norm(h)`; `q | k | v = x Wqkv (+bqkv)` (one product); `q, k = rope(qk_norm(q, k))`
//! (qk-norm on Qwen3) with `k, v` written to the cache, in one kernel; `a = attention(q, cache)`
//! (tensor-core tiles for prefill runs, split-K for decode); `h += a Wo`; `x = norm(h)`;
//! `h += down(silu(x Wgate) * x Wup)`. Logits are `norm(h) Wlm` for the requested rows, accumulated
//! and returned in f32.

use std::sync::Arc;

use metrale_cache::BlockTable;
use metrale_config::ModelConfig;
use metrale_core::{DevicePtr, LaunchConfig};
use metrale_gpu_runtime::trace::{
    TRACE_CAPACITY, TraceRecord, parse_trace, trace_header, trace_words,
};
use metrale_gpu_runtime::{
    Event, GemmOp, GpuBackend, GpuError, Graph, KernelHandle, Stream, launch_kernel,
};
use metrale_kernels::ops::{
    ATTENTION_SPLIT_KEYS, ATTENTION_UNSPLIT_KEYS, AddRmsNorm, ArgmaxF32, Embedding,
    GEMV_FMA_MAX_ROWS, GEMV_MAX_ROWS, GEMV_RESIDENT_BLOCKS, GEMV_STREAM_STAGES, Gemm, GemmF32Out,
    Gemv, GemvF32Out, GemvGridMode, GemvNorm, GemvStaged, GemvStream, GemvStreamF32Out,
    GemvStreamNorm, GemvSwiglu, GemvSwigluNorm, GemvSwigluStaged, GemvSwigluStream,
    GemvSwigluStreamNorm, PagedAttention, PagedAttentionQkv, PrefillAttention, PrefillAttentionV2,
    PrefillAttentionV3, QkvRopeKvWrite, SiluMul, argmax_scratch_bytes, attention_splits_of,
    gemv_launch_grid, gemv_norm_fits, gemv_stages, gemv_stream_fits, prefill_attention_tiles_of,
};
use metrale_kernels::{Kernel, KernelAbi};

use crate::profile::Profiler;
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
    /// An environment variable the engine reads holds a value it does not know.
    #[error("{name}={value}: expected {expected}")]
    BadVariable {
        /// The variable.
        name: &'static str,
        /// Its value.
        value: String,
        /// What it may hold.
        expected: &'static str,
    },
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
}

impl ModelOptions {
    /// KV cache bytes per block, all layers, K and V.
    pub fn kv_bytes_per_block(config: &ModelConfig, block_size: usize) -> u64 {
        (2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * 2) as u64
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
}

struct Kernels {
    embedding: KernelHandle,
    add_rmsnorm: KernelHandle,
    qkv_post: KernelHandle,
    gemm: KernelHandle,
    gemv: KernelHandle,
    gemm_f32out: KernelHandle,
    gemv_f32out: KernelHandle,
    silu_mul: KernelHandle,
    attention: KernelHandle,
    attention_qkv: KernelHandle,
    attention_qkv_wide: KernelHandle,
    embedding_vec: KernelHandle,
    gemv_stream: KernelHandle,
    gemv_swiglu_stream: KernelHandle,
    gemv_stream_f32out: KernelHandle,
    gemv_stream_norm: KernelHandle,
    gemv_swiglu_stream_norm: KernelHandle,
    gemv_swiglu: KernelHandle,
    gemv_staged: KernelHandle,
    gemv_swiglu_staged: KernelHandle,
    gemv_norm: KernelHandle,
    gemv_swiglu_norm: KernelHandle,
    prefill_attention: KernelHandle,
    prefill_attention_v2: KernelHandle,
    prefill_attention_v3: KernelHandle,
    argmax_f32: KernelHandle,
}

/// Device buffers sized once for `max_tokens_per_step` tokens.
struct Scratch {
    /// f32 `[tokens, hidden]`: the residual stream.
    hidden: DevicePtr,
    /// f32 `[GEMV_FMA_MAX_ROWS, hidden]`: the residual stream's other half for the normalising
    /// GEMVs, which read it from one buffer and write the sum to the other (their blocks run
    /// concurrently, so not in place).
    hidden_alt: DevicePtr,
    x: DevicePtr,
    /// `[tokens, (heads + 2 * kv_heads) * head_dim]`: the fused q | k | v product.
    qkv: DevicePtr,
    /// `[tokens, heads * head_dim]`: q after qk-norm and RoPE.
    q: DevicePtr,
    attn: DevicePtr,
    o: DevicePtr,
    gate_up: DevicePtr,
    act: DevicePtr,
    mlp: DevicePtr,
    gathered: DevicePtr,
    logits: DevicePtr,
    /// i32 `[max_logit_rows]`: the device-side argmax of each logits row.
    argmax: DevicePtr,
    /// u64 `[2 * max_logit_rows]`, zero between launches: the argmax blocks' merge keys and
    /// counts ([`ArgmaxF32`]'s `scratch`).
    argmax_scratch: DevicePtr,
    /// Split-K attention partials, [`ATTENTION_PARTIALS`] of `head_dim + 2` f32 each.
    partials: DevicePtr,
    /// i32 `[max_tokens_per_step, kv_heads]`, zero between launches: the split attention's
    /// count of finished blocks per (token, kv head).
    counters: DevicePtr,
    /// The per-step integer inputs, packed so a step uploads them in one copy: for a step of n
    /// tokens, ids, positions, token_seq and slots (n entries each), the prefill attention's
    /// query tiles (room for n tiles of 4), then the block tables.
    step_inputs: DevicePtr,
}

/// Where a step's uploaded integer inputs landed on the device.
#[derive(Clone, Copy)]
struct StepBuffers {
    ids: DevicePtr,
    positions: DevicePtr,
    token_seq: DevicePtr,
    slots: DevicePtr,
    /// The prefill attention's query tiles, `num_tiles` of (seq, first token, first position,
    /// count).
    tiles: DevicePtr,
    num_tiles: u32,
    /// Leading tokens that are runs of one token (the decode rows, which the scheduler puts
    /// first): in a mixed step they go through the split decode attention, as they would in a
    /// decode-only step, and the prefill attention takes the tiles after them.
    decode_rows: u32,
    tables: DevicePtr,
}

/// The most decode steps [`Model::decode_ahead`] keeps queued ahead of the id it reads back.
pub const MAX_DECODE_AHEAD: u32 = 8;
/// Steps greedy decode keeps queued by default. Measured on the H200 (docs/results/
/// 2026-12-01-speed-h200/ab-routes-ahead): with 2, `met generate` went 1158.6 -> 1227.6 tok/s on
/// Qwen3-0.6B and 227.5 -> 230.6 on Qwen3-8B, the same greedy ids.
pub const DECODE_AHEAD: u32 = 2;

/// Room for split-K attention partials ((token, head, split) triples): 64 decode rows of 32
/// heads can split 16 ways, 1 row 512 ways.
const ATTENTION_PARTIALS: u32 = 32768;
/// Blocks a split attention launch aims for by default: about two per SM of an H200
/// (`METRALE_ATTENTION_TARGET_BLOCKS` overrides it, for measuring fewer and longer splits).
const ATTENTION_TARGET_BLOCKS: u32 = 264;
/// The most blocks (tokens x kv heads) a fused decode attention launch of one split may have for
/// it to take the wide form (8 warps a block, [`PagedAttentionQkv::WIDE_NAME`]); more blocks take
/// the 4-warp form, two an SM. `METRALE_ATTENTION_WIDE_BLOCKS` overrides it (0: never wide). The
/// fused form runs only at batch 1 (one sequence, one token), so its blocks are the model's kv
/// heads: 16 takes every model of at most 16 kv heads (Qwen3's 8) up to 256 keys. On the H200 at
/// batch 1, 160 keys (docs/results/2026-12-02-speed-h200/attention-wide): Qwen3-0.6B's attention
/// 5.79 -> 4.03 us a layer, `met generate` (32 + 256 tokens) 1371.8 -> 1519.6 tok/s; Qwen3-8B's
/// 5.65 -> 5.26 us, 232.9 -> 234.4 tok/s (two passes each).
const ATTENTION_WIDE_BLOCKS: u32 = 16;

/// The tensor-core prefill attention kernels (all take the same arguments and tiles).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum PrefillVersion {
    /// `prefill_attention_bf16`: 64-token query tiles, mma.sync.
    V1,
    /// `prefill_attention_v2_bf16`: 128-token query tiles, mma.sync, double-buffered keys.
    V2,
    /// `prefill_attention_v3_bf16`: 128-token query tiles on wgmma (head_dim 128 only).
    V3,
}

impl PrefillVersion {
    /// The version `METRALE_PREFILL_ATTENTION` names (`v1`, `v2`, `v3`; `v3` falls back to version
    /// 2 at head dims it does not cover), by default version 3 where it covers the head dim (128)
    /// and version 2 elsewhere; another value is an error. On the H200 version 3 took
    /// Qwen3-8B's 8192-token TTFT from 256.9 to 239.1 ms and 1024's from 25.6 to 24.1 ms
    /// (same run; docs/results/2026-12-01-speed-h200/prefill-v3).
    pub(crate) fn choose(env: Option<&str>, head_dim: u32) -> Result<PrefillVersion, ModelError> {
        let v3 = PrefillAttentionV3::supports_head_dim(head_dim);
        Ok(match env {
            Some("v1") => PrefillVersion::V1,
            Some("v2") => PrefillVersion::V2,
            None | Some("v3") if v3 => PrefillVersion::V3,
            None | Some("v3") => PrefillVersion::V2,
            Some(other) => {
                return Err(ModelError::BadVariable {
                    name: "METRALE_PREFILL_ATTENTION",
                    value: other.to_string(),
                    expected: "v1, v2 or v3",
                });
            }
        })
    }
}

/// Which GEMV products of 1 to 4 rows (the FMA form) take a special form: the staged entries
/// (`METRALE_GEMV_STAGE`: `gemv_bf16_staged`, `gemv_bf16_swiglu_staged`, or the stage of the
/// normalising entries: the first weights copied before the programmatic-launch wait) or the
/// normalising entries (`METRALE_GEMV_NORM`: `gemv_bf16_norm`, `gemv_bf16_swiglu_norm`, the
/// residual add + RMSNorm before the product in its launch). Each computes the plain entries' bits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum GemvPolicy {
    /// None.
    Off,
    /// Those [`gemv_stages`] picks: at most 8M weights (Qwen3-0.6B's products).
    Small,
    /// Every product of the FMA form (1 to 4 rows).
    All,
}

impl GemvPolicy {
    /// The policy the variable `name` names (`0` or `off`, `small`, `all`), `default` when it is
    /// unset; another value is an error.
    ///
    /// Stage (default `small`), measured on the H200 with one kernel entry for both forms:
    /// Qwen3-0.6B's batch-1 decode 6-8% faster staging; Qwen3-8B's 1-3% slower with the staged
    /// path in its kernel whether it staged or not, less so staging every product
    /// (docs/results/2026-12-01-speed-h200/gemv-prewait); with separate entries, staging all of
    /// 8B's products made its step at 160 keys 4.436 -> 4.559 ms
    /// (docs/results/2026-12-01-speed-h200/grid-cap).
    /// Norm (default `small`), measured on the H200 (docs/results/2026-12-01-speed-h200/
    /// decode-defaults): Qwen3-0.6B's 32 + 256-token generation 1041 -> 1129 tok/s with it, its
    /// step at 1k keys 0.98 -> 0.94 ms; Qwen3-8B's 219.2 -> 206.8 tok/s, its step at 160 keys
    /// 4.54 -> 4.83 ms (at 1k keys 4.86 -> 4.82), although its two fused launches measured alone
    /// take 4.9 us less than the launches they replace. The loss is the driver's L1 / shared split
    /// for the normalising kernels: with an explicit carveout of 25-75% for them (wip/norm-prefetch,
    /// `METRALE_SMEM_CARVEOUT_KERNELS`) 8B's folded step equals the separate launches' (4.347-4.374
    /// against 4.368 ms), no gain (docs/results/2026-12-02-speed-h200/norm-carveout).
    pub(crate) fn choose(
        name: &'static str,
        env: Option<&str>,
        default: GemvPolicy,
    ) -> Result<GemvPolicy, ModelError> {
        Ok(match env {
            None => default,
            Some("0" | "off") => GemvPolicy::Off,
            Some("small") => GemvPolicy::Small,
            Some("all") => GemvPolicy::All,
            Some(other) => {
                return Err(ModelError::BadVariable {
                    name,
                    value: other.to_string(),
                    expected: "0, off, small or all",
                });
            }
        })
    }

    /// Whether an `m x n x k` GEMV product takes the form.
    fn takes(self, m: u32, n: u32, k: u32) -> bool {
        match self {
            GemvPolicy::Off => false,
            GemvPolicy::Small => gemv_stages(m, n, k),
            GemvPolicy::All => (1..=GEMV_FMA_MAX_ROWS).contains(&m),
        }
    }
}

/// The count the variable `name` holds (`default` when it is unset); a value that is not a
/// non-negative integer is an error, not the default.
fn parse_count(name: &'static str, env: Option<&str>, default: u32) -> Result<u32, ModelError> {
    env.map_or(Ok(default), |v| {
        v.trim().parse().map_err(|_| ModelError::BadVariable {
            name,
            value: v.to_string(),
            expected: "a non-negative integer",
        })
    })
}

/// The labels the model's launches carry (its profile's rows; [`Model::set_skip`]).
const LAUNCH_LABELS: [&str; 11] = [
    "embedding",
    "add_rmsnorm",
    "qkv",
    "qkv_post",
    "attention",
    "prefill_attention",
    "o",
    "gate_up",
    "silu_mul",
    "down",
    "lm_head",
];

/// `label=value` pairs split by `,` or `+` (the latter for speed.sh's variant lists) from the
/// variable `name`, each label one of `labels` and each value one `value` takes; `expected` says
/// what the variable holds. Unset or empty: no pair.
fn parse_label_values<T>(
    name: &'static str,
    env: Option<&str>,
    labels: &[&'static str],
    expected: &'static str,
    value: impl Fn(&str) -> Option<T>,
) -> Result<Vec<(&'static str, T)>, ModelError> {
    let bad = |v: &str| ModelError::BadVariable {
        name,
        value: v.to_string(),
        expected,
    };
    let Some(env) = env else {
        return Ok(Vec::new());
    };
    env.split([',', '+'])
        .map(str::trim)
        .filter(|pair| !pair.is_empty())
        .map(|pair| {
            let (label, v) = pair.split_once('=').ok_or_else(|| bad(env))?;
            let label = labels
                .iter()
                .copied()
                .find(|k| *k == label.trim())
                .ok_or_else(|| bad(env))?;
            Ok((label, value(v.trim()).ok_or_else(|| bad(env))?))
        })
        .collect()
}

/// `METRALE_CARVEOUT_LABELS`: launches of these labels ask the driver for this shared-memory
/// carveout (percent of the most an SM has), e.g. `qkv=100,o=100`; unset or empty: none does.
fn parse_carveout_labels(env: Option<&str>) -> Result<Vec<(&'static str, u8)>, ModelError> {
    parse_label_values(
        "METRALE_CARVEOUT_LABELS",
        env,
        &LAUNCH_LABELS,
        "label=percent pairs separated by `,` or `+` (percent 0 to 100; labels: embedding, \
         add_rmsnorm, qkv, qkv_post, attention, prefill_attention, o, gate_up, silu_mul, down, \
         lm_head)",
        |v| v.parse::<u8>().ok().filter(|&p| p <= 100),
    )
}

/// The labels of GEMV launches (plain, staged and normalising entries), whose grid may shrink:
/// their blocks loop over the column groups.
const GEMV_LABELS: [&str; 5] = ["qkv", "o", "gate_up", "down", "lm_head"];

/// `METRALE_GRID_CAP_LABELS`: GEMV launches of these labels take at most this many blocks, e.g.
/// `qkv=132` (one block an SM, leaving registers beside it for the launch after it to become
/// resident early); unset or empty: the usual grids.
fn parse_grid_cap_labels(env: Option<&str>) -> Result<Vec<(&'static str, u32)>, ModelError> {
    parse_label_values(
        "METRALE_GRID_CAP_LABELS",
        env,
        &GEMV_LABELS,
        "label=blocks pairs separated by `,` or `+` (blocks at least 1; labels: qkv, o, gate_up, \
         down, lm_head)",
        |v| v.parse::<u32>().ok().filter(|&b| b >= 1),
    )
}

/// The one-row GEMV launches that take the bulk-copy stream by default (products of at least
/// [`GEMV_STREAM_MIN_WEIGHTS`] weights). On the H200, Qwen3-8B's batch-1 `met generate` (32 + 256
/// tokens) went 236.1 -> 240.8 tok/s with all four streamed and their weights evict-first in L2
/// (docs/results/2026-12-02-speed-h200/gemv-stream): the activations and cache rows between the
/// products then stay in L2, so the short launches between them (the attention, add + RMSNorm)
/// no longer wait on HBM behind the next product's first copies.
const DEFAULT_STREAM_LABELS: [&str; 4] = ["qkv", "o", "gate_up", "down"];

/// Products of fewer weights keep the register GEMV under the default stream set: Qwen3-0.6B's
/// (at most 6.3M weights) were measured with it; Qwen3-8B's (16.8M to 100M) are the stream's.
const GEMV_STREAM_MIN_WEIGHTS: u64 = 8 << 20;

/// The streams' evict-first hint by default: without it the same four streams measured 234.2
/// tok/s (prefetching the next product's weights slowed the launch before by as much as it gained),
/// with it 240.8 (docs/results/2026-12-02-speed-h200/gemv-stream).
const GEMV_STREAM_EVICT: bool = true;

/// Streamed products after a residual add + RMSNorm take the norm into their launch by default:
/// Qwen3-8B's batch-1 decode 237.8 -> 246.8 tok/s on the H200, the same greedy ids (its two add +
/// RMSNorm launches a layer gone; docs/results/2026-12-02-speed-h200/stream-norm).
const GEMV_STREAM_NORM: bool = true;

/// [`Model::streams`]' rule for a stream set `labels` and its weight threshold.
fn stream_takes(
    labels: &[&str],
    min_weights: u64,
    label: &str,
    (m, n, k): (u32, u32, u32),
) -> bool {
    let columns = if label == "gate_up" { n / 2 } else { n };
    labels.contains(&label)
        && u64::from(n) * u64::from(k) >= min_weights
        && gemv_stream_fits(m, columns, k)
}

/// The labels of the one-row GEMV launches that may take the bulk-copy stream (gate_up: when it
/// runs with SiLU x up in its epilogue and the add + RMSNorm in a launch of its own; lm_head, not
/// in the default set, with f32 output: `gemv_bf16_stream_f32out`).
const STREAM_LABELS: [&str; 5] = ["qkv", "o", "gate_up", "down", "lm_head"];

/// `METRALE_GEMV_STREAM_LABELS`: the one-row GEMV launches of these labels (`+` or `,` between
/// them) take [`GemvStream`] where it fits; unset or empty: none does.
fn parse_stream_labels(env: Option<&str>) -> Result<Vec<&'static str>, ModelError> {
    let Some(env) = env else {
        return Ok(Vec::new());
    };
    env.split([',', '+'])
        .map(str::trim)
        .filter(|label| !label.is_empty())
        .map(|label| {
            STREAM_LABELS
                .iter()
                .copied()
                .find(|l| *l == label)
                .ok_or_else(|| ModelError::BadVariable {
                    name: "METRALE_GEMV_STREAM_LABELS",
                    value: env.to_string(),
                    expected: "labels separated by `,` or `+` (qkv, o, gate_up, down, lm_head)",
                })
        })
        .collect()
}

/// [`Model::carveout`]'s rule: the carveout (percent) a launch of `label` asks for, given whether
/// the gate|up launch after it folds the residual add + RMSNorm (`gate_up_folds_norm`, which only
/// the o projection looks at).
fn carveout_rule(label: &str, gate_up_folds_norm: bool) -> Option<u8> {
    const MOST_SHARED: u8 = 100;
    match label {
        "qkv" => Some(MOST_SHARED),
        "o" if gate_up_folds_norm => Some(MOST_SHARED),
        _ => None,
    }
}

/// A loaded model: weights, KV pool, scratch and kernel handles on one backend.
pub struct Model {
    config: ModelConfig,
    options: ModelOptions,
    gpu: Arc<dyn GpuBackend>,
    weights: DeviceWeights,
    k_cache: Vec<DevicePtr>,
    v_cache: Vec<DevicePtr>,
    rope_cos: DevicePtr,
    rope_sin: DevicePtr,
    scratch: Scratch,
    kernels: Kernels,
    owned: Vec<DevicePtr>,
    /// Replay decode steps from captured graphs (on unless `METRALE_CUDA_GRAPHS=0`; measured on
    /// the H200 at batch 1: Qwen3-8B 127.9 -> 140.7 tok/s, Qwen3-0.6B 401.6 -> 493.7 tok/s;
    /// docs/results/2026-11-30-speed-h200/launch-ab).
    use_graphs: bool,
    /// Captured decode steps, by (sequences, keys per attention split, splits).
    graphs: std::collections::HashMap<(u32, u32, u32), Graph>,
    /// Host time spent capturing and instantiating those graphs (`graph_captures`).
    capture_time: std::time::Duration,
    /// Per-launch timing (`set_profile`).
    profiler: Option<std::sync::Mutex<Profiler>>,
    /// Launch labels left out, for timing experiments (`set_skip`).
    skip: Vec<&'static str>,
    /// Launches that ask for their own shared-memory carveout, in place of
    /// [`Model::carveout`]'s rule (`METRALE_CARVEOUT_LABELS`, for measuring; set but empty: none).
    carveout_labels: Option<Vec<(&'static str, u8)>>,
    /// One-row GEMV launches of these labels that take the bulk-copy stream ([`GemvStream`])
    /// or [`GemvSwigluStream`] where it fits (`METRALE_GEMV_STREAM_LABELS`, e.g. `down+o+qkv`;
    /// default none).
    gemv_stream_labels: Vec<&'static str>,
    /// Products of fewer weights than this keep the register GEMV even where their label streams
    /// (by default [`GEMV_STREAM_MIN_WEIGHTS`]; 0 when `METRALE_GEMV_STREAM_LABELS` is set).
    gemv_stream_min_weights: u64,
    /// 4-KiB units of each warp's ring a stream copies before its programmatic-launch wait
    /// (`METRALE_GEMV_STREAM_PREWAIT`, 0 to [`GEMV_STREAM_STAGES`], default all).
    gemv_stream_prewait: u32,
    /// The streams' weights go through L2 as evict-first lines (`METRALE_GEMV_STREAM_EVICT=0|1`,
    /// default [`GEMV_STREAM_EVICT`]).
    gemv_stream_evict: bool,
    /// A streamed qkv or gate|up product after a residual add + RMSNorm does the norm itself
    /// ([`GemvStreamNorm`], [`GemvSwigluStreamNorm`]; `METRALE_GEMV_STREAM_NORM=0|1`, default
    /// [`GEMV_STREAM_NORM`]).
    gemv_stream_norm: bool,
    /// GEMV launches that take at most this many blocks (`METRALE_GRID_CAP_LABELS`, for
    /// measuring; empty by default).
    grid_cap_labels: Vec<(&'static str, u32)>,
    /// Products of at most this many rows stream the weight with the GEMV kernel; larger ones
    /// go to `GpuBackend::gemm` (`METRALE_GEMV_MAX_ROWS`, 0..=8, default 8).
    gemv_max_rows: u32,
    /// Which tensor-core prefill attention runs (`METRALE_PREFILL_ATTENTION=v1|v2|v3`):
    /// [`PrefillVersion::choose`].
    prefill_version: PrefillVersion,
    /// Blocks a split decode attention launch aims for ([`ATTENTION_TARGET_BLOCKS`] unless
    /// `METRALE_ATTENTION_TARGET_BLOCKS` says otherwise).
    attention_target_blocks: u32,
    /// The fewest keys a split takes ([`ATTENTION_SPLIT_KEYS`] unless
    /// `METRALE_ATTENTION_SPLIT_KEYS` says otherwise; rounded up to a power of two).
    attention_split_keys: u32,
    /// The longest context left in one split ([`ATTENTION_UNSPLIT_KEYS`] unless
    /// `METRALE_ATTENTION_UNSPLIT_KEYS` says otherwise, 0 for none; rounded up to a power of two).
    attention_unsplit_keys: u32,
    /// The most blocks a one-split fused decode attention launch takes the wide form at
    /// ([`ATTENTION_WIDE_BLOCKS`] unless `METRALE_ATTENTION_WIDE_BLOCKS` says otherwise).
    attention_wide_blocks: u32,
    /// The token embedding through `embedding_f32_vec` (16-byte loads) when
    /// `METRALE_EMBEDDING_VEC=1`; off by default until measured on the H200 (where
    /// `embedding_f32` takes 6.5 us of Qwen3-8B's batch-1 step, docs/results/
    /// 2026-12-02-speed-h200/attention-wide's timelines). The same values either way.
    embedding_vec: bool,
    /// At most this many blocks for a plain or staged GEMV launch (`METRALE_GEMV_GRID_CAP`, default
    /// [`GEMV_RESIDENT_BLOCKS`]; 0 for the rule's grid): see [`Model::launch_gemv`].
    gemv_grid_cap: u32,
    /// How the cap applies (`METRALE_GEMV_GRID_MODE=same|balanced|resplit`, default same):
    /// [`GemvGridMode`].
    gemv_grid_mode: GemvGridMode,
    /// Decode steps of one sequence run the QKV post-processing inside the decode attention
    /// (`paged_attention_qkv_bf16`, one launch fewer per layer) unless
    /// `METRALE_FUSED_QKV_ATTENTION=0`; the outputs are the same bits either way.
    fused_qkv_attention: bool,
    /// Products the GEMV streams run the gate|up projection with SiLU x up in its epilogue
    /// (`gemv_bf16_swiglu`, one launch fewer per layer) unless `METRALE_FUSED_SWIGLU=0`.
    fused_swiglu: bool,
    /// Which GEMV products stage their first weights ([`GemvPolicy::choose`]).
    gemv_stage: GemvPolicy,
    /// Which GEMV products after a residual add + RMSNorm do the norm in their own launch.
    gemv_norm: GemvPolicy,
    /// Whether each step's device work is timed ([`Model::set_step_timing`]).
    step_timing: bool,
    /// The two events step timing records, created on first use and kept (the backend has no
    /// call to destroy an event).
    step_events: Option<(Event, Event)>,
    /// The device time of the last step run with step timing on, ms.
    last_step_gpu_ms: Option<f32>,
    /// Greedy decode of one sequence keeps this many steps queued while it reads an id back
    /// ([`Model::decode_ahead`]; `METRALE_DECODE_AHEAD`, default [`DECODE_AHEAD`]; 0: a host
    /// round trip per step, through [`Model::forward_argmax`]).
    decode_ahead: u32,
    /// The stream ids are read back on while decode steps stay queued (created on first use).
    readback: Option<Stream>,
    /// Events [`Model::decode_ahead`] records after each step's argmax, kept for reuse (the
    /// backend has no call to destroy an event).
    ahead_events: Vec<Event>,
}

/// Most rows for which a product over [`GEMV_WIDE_K`] or more inputs still uses the GEMV
/// (`Model::streams_weight`).
const GEMV_WIDE_K_MAX_ROWS: u32 = 4;
/// Inputs from which products of more than [`GEMV_WIDE_K_MAX_ROWS`] rows use the library GEMM.
const GEMV_WIDE_K: u32 = 4096;

impl Model {
    /// Checks shapes, uploads the weights, and allocates the KV pool and scratch buffers.
    pub fn load(
        config: ModelConfig,
        source: &dyn metrale_model_weights::WeightSource,
        gpu: Arc<dyn GpuBackend>,
        options: ModelOptions,
        progress: LoadProgress,
    ) -> Result<Self, ModelError> {
        // The environment switches first, so that a value they do not take stops the load before
        // any weight moves.
        let prefill_version = PrefillVersion::choose(
            std::env::var("METRALE_PREFILL_ATTENTION").ok().as_deref(),
            config.head_dim as u32,
        )?;
        let policy = |name: &'static str, default| {
            GemvPolicy::choose(name, std::env::var(name).ok().as_deref(), default)
        };
        let count = |name: &'static str, default| {
            parse_count(name, std::env::var(name).ok().as_deref(), default)
        };
        let on_unless_zero = |name: &str| std::env::var(name).map_or(true, |v| v != "0");
        let gemv_stage = policy("METRALE_GEMV_STAGE", GemvPolicy::Small)?;
        let gemv_norm = policy("METRALE_GEMV_NORM", GemvPolicy::Small)?;
        let gemv_grid_mode = match std::env::var("METRALE_GEMV_GRID_MODE") {
            Err(_) => GemvGridMode::default(),
            Ok(v) => GemvGridMode::parse(&v).ok_or(ModelError::BadVariable {
                name: "METRALE_GEMV_GRID_MODE",
                value: v,
                expected: "same, balanced or resplit",
            })?,
        };
        let gemv_max_rows = count("METRALE_GEMV_MAX_ROWS", GEMV_MAX_ROWS)?.min(GEMV_MAX_ROWS);
        let attention_target_blocks =
            count("METRALE_ATTENTION_TARGET_BLOCKS", ATTENTION_TARGET_BLOCKS)?.max(1);
        let gemv_grid_cap = count("METRALE_GEMV_GRID_CAP", GEMV_RESIDENT_BLOCKS)?;
        let attention_split_keys = count("METRALE_ATTENTION_SPLIT_KEYS", ATTENTION_SPLIT_KEYS)?;
        let attention_unsplit_keys =
            count("METRALE_ATTENTION_UNSPLIT_KEYS", ATTENTION_UNSPLIT_KEYS)?;
        let attention_wide_blocks = count("METRALE_ATTENTION_WIDE_BLOCKS", ATTENTION_WIDE_BLOCKS)?;
        let switch = |name: &'static str, default: bool| match std::env::var(name) {
            Err(_) => Ok(default),
            Ok(v) => match v.trim() {
                "0" => Ok(false),
                "1" => Ok(true),
                _ => Err(ModelError::BadVariable {
                    name,
                    value: v,
                    expected: "0 or 1",
                }),
            },
        };
        let embedding_vec = switch("METRALE_EMBEDDING_VEC", false)?;
        let gemv_stream_evict = switch("METRALE_GEMV_STREAM_EVICT", GEMV_STREAM_EVICT)?;
        let gemv_stream_norm = switch("METRALE_GEMV_STREAM_NORM", GEMV_STREAM_NORM)?;
        let gemv_stream_prewait =
            count("METRALE_GEMV_STREAM_PREWAIT", GEMV_STREAM_STAGES)?.min(GEMV_STREAM_STAGES);
        let use_graphs = on_unless_zero("METRALE_CUDA_GRAPHS");
        let fused_qkv_attention = on_unless_zero("METRALE_FUSED_QKV_ATTENTION");
        let fused_swiglu = on_unless_zero("METRALE_FUSED_SWIGLU");
        let decode_ahead = count("METRALE_DECODE_AHEAD", DECODE_AHEAD)?.min(MAX_DECODE_AHEAD);
        let grid_cap_labels =
            parse_grid_cap_labels(std::env::var("METRALE_GRID_CAP_LABELS").ok().as_deref())?;
        // The default set streams only Qwen3-8B-sized products; a set given streams all it names.
        let (gemv_stream_labels, gemv_stream_min_weights) =
            match std::env::var("METRALE_GEMV_STREAM_LABELS") {
                Err(_) => (DEFAULT_STREAM_LABELS.to_vec(), GEMV_STREAM_MIN_WEIGHTS),
                Ok(v) => (parse_stream_labels(Some(&v))?, 0),
            };
        let carveout_labels = match std::env::var("METRALE_CARVEOUT_LABELS") {
            Ok(v) => Some(parse_carveout_labels(Some(&v))?),
            Err(_) => None,
        };
        let g = gpu.as_ref();
        let kernels = Kernels {
            embedding: g.kernel(Embedding::NAME)?,
            add_rmsnorm: g.kernel(AddRmsNorm::NAME)?,
            qkv_post: g.kernel(QkvRopeKvWrite::NAME)?,
            gemm: g.kernel(Gemm::NAME)?,
            gemv: g.kernel(Gemv::NAME)?,
            gemm_f32out: g.kernel(GemmF32Out::NAME)?,
            gemv_f32out: g.kernel(GemvF32Out::NAME)?,
            gemv_swiglu: g.kernel(GemvSwiglu::NAME)?,
            gemv_staged: g.kernel(GemvStaged::NAME)?,
            gemv_swiglu_staged: g.kernel(GemvSwigluStaged::NAME)?,
            gemv_norm: g.kernel(GemvNorm::NAME)?,
            gemv_swiglu_norm: g.kernel(GemvSwigluNorm::NAME)?,
            silu_mul: g.kernel(SiluMul::NAME)?,
            attention: g.kernel(PagedAttention::NAME)?,
            attention_qkv: g.kernel(PagedAttentionQkv::NAME)?,
            attention_qkv_wide: g.kernel(PagedAttentionQkv::WIDE_NAME)?,
            embedding_vec: g.kernel(Embedding::VEC_NAME)?,
            gemv_stream: g.kernel(GemvStream::NAME)?,
            gemv_swiglu_stream: g.kernel(GemvSwigluStream::NAME)?,
            gemv_stream_f32out: g.kernel(GemvStreamF32Out::NAME)?,
            gemv_stream_norm: g.kernel(GemvStreamNorm::NAME)?,
            gemv_swiglu_stream_norm: g.kernel(GemvSwigluStreamNorm::NAME)?,
            prefill_attention: g.kernel(PrefillAttention::NAME)?,
            prefill_attention_v2: g.kernel(PrefillAttentionV2::NAME)?,
            prefill_attention_v3: g.kernel(PrefillAttentionV3::NAME)?,
            argmax_f32: g.kernel(ArgmaxF32::NAME)?,
        };
        let weights = weights::load(&config, source, g, progress)?;
        let mut owned = Vec::new();
        let mut alloc = |bytes: usize| -> Result<DevicePtr, ModelError> {
            let p = g.alloc(bytes.max(1))?;
            owned.push(p);
            Ok(p)
        };
        let c = &config;
        let t = options.max_tokens_per_step;
        let (h, i, hd) = (c.hidden_size, c.intermediate_size, c.head_dim);
        let (qd, kvd) = (c.num_heads * hd, c.num_kv_heads * hd);
        let rows = options.max_seqs.max(1);
        let step_inputs = alloc((8 * t + rows * options.max_blocks_per_seq()) * 4)?;
        let scratch = Scratch {
            hidden: alloc(t * h * 4)?,
            hidden_alt: alloc(t.min(GEMV_FMA_MAX_ROWS as usize) * h * 4)?,
            x: alloc(t * h * 2)?,
            qkv: alloc(t * (qd + 2 * kvd) * 2)?,
            q: alloc(t * qd * 2)?,
            attn: alloc(t * qd * 2)?,
            o: alloc(t * h * 2)?,
            gate_up: alloc(t * 2 * i * 2)?,
            act: alloc(t * i * 2)?,
            mlp: alloc(t * h * 2)?,
            logits: alloc(options.max_logit_rows.max(1) * c.vocab_size * 4)?,
            gathered: alloc(options.max_logit_rows.max(1) * h * 2)?,
            partials: alloc(ATTENTION_PARTIALS as usize * (hd + 2) * 4)?,
            counters: alloc(t * c.num_kv_heads * 4)?,
            argmax: alloc(options.max_logit_rows.max(1) * 4)?,
            argmax_scratch: alloc(argmax_scratch_bytes(options.max_logit_rows.max(1)))?,
            step_inputs,
        };
        let cache_bytes = options.num_blocks * options.block_size * kvd * 2;
        let mut k_cache = Vec::new();
        let mut v_cache = Vec::new();
        for _ in 0..c.num_layers {
            k_cache.push(alloc(cache_bytes)?);
            v_cache.push(alloc(cache_bytes)?);
        }
        let (cos, sin) = crate::rope::tables(c, options.max_seq_len);
        let rope_cos = alloc(cos.len() * 4)?;
        let rope_sin = alloc(sin.len() * 4)?;
        // The split attention's counters and the argmax scratch start at zero; every launch
        // leaves them there.
        let stream = g.default_stream();
        g.memset(scratch.counters, 0, t * c.num_kv_heads * 4, stream)?;
        g.memset(
            scratch.argmax_scratch,
            0,
            argmax_scratch_bytes(options.max_logit_rows.max(1)),
            stream,
        )?;
        g.synchronize(stream)?;
        g.copy_h2d(bytemuck::cast_slice(&cos), rope_cos)?;
        g.copy_h2d(bytemuck::cast_slice(&sin), rope_sin)?;
        Ok(Model {
            config,
            options,
            gpu,
            weights,
            k_cache,
            v_cache,
            rope_cos,
            rope_sin,
            scratch,
            kernels,
            owned,
            use_graphs,
            graphs: std::collections::HashMap::new(),
            capture_time: std::time::Duration::ZERO,
            profiler: None,
            skip: Vec::new(),
            carveout_labels,
            grid_cap_labels,
            gemv_stream_labels,
            gemv_stream_min_weights,
            gemv_stream_prewait,
            gemv_stream_evict,
            gemv_stream_norm,
            gemv_max_rows,
            prefill_version,
            attention_target_blocks,
            gemv_grid_cap,
            gemv_grid_mode,
            attention_split_keys,
            attention_unsplit_keys,
            attention_wide_blocks,
            embedding_vec,
            fused_qkv_attention,
            fused_swiglu,
            gemv_stage,
            gemv_norm,
            step_timing: false,
            step_events: None,
            last_step_gpu_ms: None,
            decode_ahead,
            readback: None,
            ahead_events: Vec::new(),
        })
    }

    /// Whether an `m`-row product over `k` inputs streams its weight through the GEMV kernel
    /// (otherwise `GpuBackend::gemm`): up to `gemv_max_rows` rows, except that past
    /// [`GEMV_WIDE_K_MAX_ROWS`] rows, products with `k >= GEMV_WIDE_K` go to the library GEMM.
    /// On the H200 at 8 rows cuBLASLt beat the GEMV on Qwen3-8B's products (k 4096 and 12288:
    /// qkv 14.8 vs 17.2 us, down 30.7 vs 32.1 us; the batch-8 step 6.16 vs 6.40 ms) and lost on
    /// Qwen3-0.6B's (k at most 3072: the batch-8 step 1.98 vs 1.82 ms)
    /// (docs/results/2026-11-30-speed-h200, kernel-table and bench-model-gemm8 files).
    fn streams_weight(&self, m: u32, k: u32) -> bool {
        m <= self.gemv_max_rows && (m <= GEMV_WIDE_K_MAX_ROWS || k < GEMV_WIDE_K)
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
        self.use_graphs = on;
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

    /// The sizes it was built with.
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

    fn validate(&self, step: &StepInput) -> Result<(), ModelError> {
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
        })?;
        self.forward_argmax(&StepInput {
            tokens: &tokens[..1],
            positions: &positions[n - 1..],
            token_seq: &seq[..1],
            block_tables: &[&table],
            logit_rows: &[0],
        })?;
        Ok(())
    }

    /// How many steps [`Model::decode_ahead`] keeps queued ahead of the id it reads back
    /// (`METRALE_DECODE_AHEAD`; 0: the caller steps with [`Model::forward_argmax`]).
    pub fn decode_ahead_steps(&self) -> u32 {
        self.decode_ahead
    }

    /// Greedy decode of one sequence without a host round trip per step: step `i` feeds
    /// `first` (for `i` = 0) or step `i - 1`'s argmax, taken on the device, at position
    /// `first_position + i`, for up to `steps` steps. Every step's integer inputs go up in one
    /// copy before the first (the block table is fixed: `table` must already reach the last
    /// position; the table row goes with the first step only, 32 bytes with each later one);
    /// then each step is queued as two device copies (its inputs, the previous id),
    /// its graph and its argmax, and each id comes back on a side stream once
    /// [`decode_ahead_steps`](Self::decode_ahead_steps) more steps are queued behind it (at least
    /// none), so the device has that many steps in hand while the host reads. `on_id` sees every id in
    /// order and returns whether to go on; the steps queued past the last one it accepts run
    /// and are discarded (their cache rows lie past the sequence's end). Returns once nothing
    /// is queued.
    pub fn decode_ahead(
        &mut self,
        table: &BlockTable,
        first: u32,
        first_position: usize,
        steps: usize,
        on_id: &mut dyn FnMut(u32) -> bool,
    ) -> Result<(), ModelError> {
        if steps == 0 {
            return Ok(());
        }
        // Step i's id is read once step i + ahead is queued.
        let lag = (self.decode_ahead as usize + 1).min(steps);
        // Every step's inputs as `upload` packs them (the id a placeholder past step 0): the
        // first step's whole, then only each later step's first 8 values (id, position,
        // sequence, slot, its one tile), since the block table row after them does not change.
        const HEAD: usize = 8;
        let mut plan = Vec::new();
        let mut buffers = None;
        for i in 0..steps {
            let position = [(first_position + i) as u32];
            let step = StepInput {
                tokens: &[if i == 0 { first } else { 0 }],
                positions: &position,
                token_seq: &[0],
                block_tables: &[table],
                logit_rows: &[0],
            };
            self.validate(&step)?;
            let (packed, places) = self.pack(&step, i == 0);
            if i == 0 {
                buffers = Some(places);
            } else {
                debug_assert_eq!(packed.len(), HEAD);
            }
            plan.extend(packed);
        }
        let first_len = plan.len() - (steps - 1) * HEAD;
        debug_assert_eq!(first_len, HEAD + self.options.max_blocks_per_seq());
        let g = self.gpu.clone();
        let g = g.as_ref();
        let s = g.default_stream();
        let readback = match self.readback {
            Some(r) => r,
            None => *self.readback.insert(g.create_stream()?),
        };
        let plan_dev = g.alloc(plan.len() * 4)?;
        let ids = g.alloc(steps * 4)?;
        while self.ahead_events.len() <= lag {
            self.ahead_events.push(g.create_event()?);
        }
        let events: Vec<Event> = self.ahead_events[..=lag].to_vec();
        let result = (|| -> Result<(), ModelError> {
            g.copy_h2d(bytemuck::cast_slice(&plan), plan_dev)?;
            let read = |j: usize| -> Result<u32, ModelError> {
                g.stream_wait_event(readback, events[j % events.len()])?;
                let mut id = [0u8; 4];
                g.copy_d2h_on(ids.offset(j * 4), &mut id, readback)?;
                Ok(i32::from_ne_bytes(id) as u32)
            };
            let mut next_read = 0;
            for i in 0..steps {
                let (at, len) = match i {
                    0 => (0, first_len),
                    _ => (first_len + (i - 1) * HEAD, HEAD),
                };
                g.copy_d2d(
                    plan_dev.offset(at * 4),
                    self.scratch.step_inputs,
                    len * 4,
                    s,
                )?;
                if i > 0 {
                    g.copy_d2d(ids.offset((i - 1) * 4), self.scratch.step_inputs, 4, s)?;
                }
                let position = [(first_position + i) as u32];
                let step = StepInput {
                    tokens: &[0],
                    positions: &position,
                    token_seq: &[0],
                    block_tables: &[table],
                    logit_rows: &[0],
                };
                self.run_with(&step, buffers)?;
                let argmax = ArgmaxF32 {
                    out: ids.offset(i * 4),
                    logits: self.scratch.logits,
                    rows: 1,
                    cols: self.config.vocab_size as u32,
                    scratch: self.scratch.argmax_scratch,
                };
                launch_kernel(g, self.kernels.argmax_f32, &argmax, s)?;
                g.record_event(events[i % events.len()], s)?;
                if i + 1 >= lag {
                    let go_on = on_id(read(next_read)?);
                    next_read += 1;
                    if !go_on {
                        return Ok(());
                    }
                }
            }
            while next_read < steps {
                let go_on = on_id(read(next_read)?);
                next_read += 1;
                if !go_on {
                    break;
                }
            }
            Ok(())
        })();
        // Nothing queued may outlive the buffers it reads; the first error is the one to report.
        let drained = g.synchronize(s);
        let freed = g.free(plan_dev).and(g.free(ids));
        result?;
        drained?;
        Ok(freed?)
    }

    /// A trace build's timeline of one step of `step` through [`Model::forward_argmax`] (replayed
    /// from its graph when graphs are on): the record of every launch of our kernels in launch
    /// order (block 0 at its programmatic-launch wait: [`metrale_gpu_runtime::trace`]; cuBLASLt's
    /// launches have none), at most [`TRACE_CAPACITY`] of them, or `None` when the loaded
    /// kernels have no trace (a release build, the host or mock backend). The step's outputs are
    /// the untraced step's (the trace only adds stores of its own).
    pub fn trace_step(&mut self, step: &StepInput) -> Result<Option<Vec<TraceRecord>>, ModelError> {
        // The kernels write up to their own bound; the buffer has room for all of it.
        let capacity = TRACE_CAPACITY;
        let g = self.gpu.clone();
        let bytes = trace_words(capacity) * 8;
        let buffer = g.alloc(bytes)?;
        if let Err(e) = g.copy_h2d(&trace_header(capacity), buffer) {
            g.free(buffer)?;
            return Err(e.into());
        }
        let on = g.set_kernel_trace(buffer);
        let ran = match on {
            Ok(true) => Some(self.forward_argmax(step)),
            _ => None,
        };
        // Off on every path, and the buffer freed only once no module points at it any more
        // (otherwise it is left allocated: later kernels would write records into it).
        let off = g.set_kernel_trace(DevicePtr::NULL);
        if let Err(off_error) = off {
            let first = match on {
                Err(e) => e,
                Ok(_) => off_error,
            };
            return Err(first.into());
        }
        let read = match (&on, &ran) {
            (Ok(true), Some(Ok(_))) => {
                let mut raw = vec![0u8; bytes];
                g.copy_d2h(buffer, &mut raw).map(|()| {
                    let words: Vec<u64> = bytemuck::pod_collect_to_vec(&raw);
                    Some(parse_trace(&words))
                })
            }
            _ => Ok(None),
        };
        let freed = g.free(buffer);
        on?;
        if let Some(ran) = ran {
            ran?;
        }
        let records = read?;
        freed?;
        Ok(records)
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
            launch_kernel(g, self.kernels.argmax_f32, &argmax, s)?;
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

    /// Queues one step up to the logits of `step.logit_rows` in `scratch.logits`; returns the
    /// number of rows. Nothing is synchronised.
    fn run(&mut self, step: &StepInput) -> Result<usize, ModelError> {
        self.run_with(step, None)
    }

    /// [`Model::run`]; with `queued` the step was validated by the caller and its inputs are
    /// queued into `scratch.step_inputs` (as [`Model::pack`] lays them out, at these places)
    /// ahead of it on the stream, so nothing is uploaded (and step timing does not apply).
    fn run_with(
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
            self.attention_target_blocks,
            self.attention_split_keys,
            self.attention_unsplit_keys,
        );
        if !pure_decode {
            return self.enqueue(step, inputs, split);
        }
        if !self.use_graphs || self.profiler.is_some() {
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
    fn pack(&self, step: &StepInput, tables: bool) -> (Vec<i32>, StepBuffers) {
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
        let tiles = prefill_attention_tiles_of(&token_seq, &positions, self.prefill_tile());
        let num_tiles = tiles.len() as u32;
        let decode_rows = tiles.iter().take_while(|t| t[3] == 1).count() as u32;
        let tiles = tiles.concat();
        let mut packed = [ids, positions, token_seq, slots, tiles].concat();
        packed.resize(8 * n, 0);
        if tables {
            let width = o.max_blocks_per_seq();
            packed.extend(
                step.block_tables
                    .iter()
                    .flat_map(|t| t.padded_row(width, 0)),
            );
        }
        let region = |i: usize| sc.step_inputs.offset(i * n * 4);
        let buffers = StepBuffers {
            ids: region(0),
            positions: region(1),
            token_seq: region(2),
            slots: region(3),
            tiles: region(4),
            num_tiles,
            decode_rows,
            tables: region(8),
        };
        (packed, buffers)
    }

    /// Queues the step's kernels (the inputs already uploaded) up to the logits of
    /// `step.logit_rows` in `scratch.logits`; returns the number of rows. Reads from `step` only
    /// its sizes and logit rows, so that a captured graph replays it for any step of the same
    /// shape.
    fn enqueue(
        &self,
        step: &StepInput,
        inputs: StepBuffers,
        (keys_per_split, splits): (u32, u32),
    ) -> Result<usize, ModelError> {
        let StepBuffers {
            ids,
            positions,
            token_seq,
            slots,
            tiles,
            num_tiles,
            decode_rows,
            tables,
        } = inputs;
        let g = self.gpu.as_ref();
        let s = g.default_stream();
        if let Some(p) = &self.profiler {
            p.lock().expect("profiler lock").begin(g)?;
        }
        let c = &self.config;
        let o = &self.options;
        let sc = &self.scratch;
        let k = &self.kernels;
        let n = step.tokens.len() as u32;
        let (h, inter, hd) = (
            c.hidden_size as u32,
            c.intermediate_size as u32,
            c.head_dim as u32,
        );
        let (qh, kvh) = (c.num_heads as u32, c.num_kv_heads as u32);
        let (qd, kvd) = (qh * hd, kvh * hd);
        let eps = c.rms_norm_eps;
        let width = o.max_blocks_per_seq();

        // Decode-sized products stream the weight with the GEMV kernel; the rest use the GEMM.
        let gemm = |label: &'static str,
                    out: DevicePtr,
                    a: DevicePtr,
                    w: DevicePtr,
                    bias: DevicePtr,
                    m: u32,
                    n_: u32,
                    k_: u32|
         -> Result<(), ModelError> {
            if self.streams_weight(m, k_) {
                let gemv = Gemv {
                    c: out,
                    a,
                    w,
                    bias,
                    m,
                    n: n_,
                    k: k_,
                };
                if self.streams(label, m, n_, k_) {
                    let stream = GemvStream {
                        prewait: self.gemv_stream_prewait,
                        evict_first: self.gemv_stream_evict.into(),
                        ..GemvStream::from(gemv)
                    };
                    self.launch_stream(k.gemv_stream, label, &stream, m)
                } else if self.gemv_stage.takes(m, n_, k_) {
                    self.launch_gemv(k.gemv_staged, label, &GemvStaged::from(gemv), (m, n_))
                } else {
                    self.launch_gemv(k.gemv, label, &gemv, (m, n_))
                }
            } else {
                let op = GemmOp {
                    c: out,
                    a,
                    w,
                    bias,
                    m,
                    n: n_,
                    k: k_,
                    f32_out: false,
                };
                if self.skip.contains(&label) {
                    return Ok(());
                }
                g.gemm(&op, k.gemm, s)?;
                self.mark(label)
            }
        };
        let scale = 1.0 / (hd as f32).sqrt();
        // Steps where some sequence brings more than one token (prefill chunks) run attention on
        // tensor cores over query tiles; decode steps split each token's context across blocks
        // when there are too few (token, head) pairs to fill the GPU (the split is the same for
        // every layer). The tile kernel covers head dims 64 and 128.
        let tensor_core_prefill = self.tensor_core_prefill(step);
        // A decode step of one sequence (one token) folds the QKV post-processing into the
        // decode attention: the token needs no other token's key of the same step. On the H200
        // the fusion made the batch-1 step 0.8% (Qwen3-8B) and 2% (Qwen3-0.6B) faster, and
        // batches 8 to 64 0.2-2% slower (each split of a token redoes its query group's norm and
        // rotation in front of its attention; docs/results/2026-12-01-speed-h200/
        // ab-fused-qkv-attention), so it stops at one sequence.
        let fused_post = self.fused_qkv_attention
            && !tensor_core_prefill
            && matches!(hd, 64 | 128 | 256)
            && step.block_tables.len() == 1
            && step.tokens.len() == 1;
        self.launch(
            if self.embedding_vec {
                k.embedding_vec
            } else {
                k.embedding
            },
            "embedding",
            &Embedding {
                out: sc.hidden,
                table: self.weights.embedding,
                ids,
                tokens: n,
                hidden: h,
                vocab: c.vocab_size as u32,
            },
        )?;
        // The residual stream: sc.hidden, updated in place by add_rmsnorm; a GEMV that normalises
        // its own input reads it and writes the sum to the other buffer, which becomes it.
        let mut residual = sc.hidden;
        let other = |r: DevicePtr| {
            if r == sc.hidden {
                sc.hidden_alt
            } else {
                sc.hidden
            }
        };
        // Whether the product after a residual add + RMSNorm takes the norm into its launch
        // (GemvNorm, GemvSwigluNorm): a GEMV product of the FMA form whose A fits in shared
        // memory, as METRALE_GEMV_NORM picks.
        let folds_norm = |m: u32, n_: u32| self.folds_norm(m, n_, h);
        // Whether the streamed product of `label` does the add + RMSNorm itself (GemvStreamNorm,
        // GemvSwigluStreamNorm; gate_up only in its SwiGLU form): before folds_norm's rule.
        let stream_folds_norm = |label: &'static str, m: u32, n_: u32| {
            self.gemv_stream_norm
                && self.streams_weight(m, h)
                && (label != "gate_up" || self.fused_swiglu)
                && self.streams(label, m, n_, h)
        };
        // A skipped launch (set_skip) writes no sum, so the stream stays where it was.
        let moves = |label: &'static str| !self.skip.contains(&label);
        let stage = |m: u32, n_: u32| u32::from(self.gemv_stage.takes(m, n_, h));
        for (l, w) in self.weights.layers.iter().enumerate() {
            // Layer 0 normalises the embeddings as they are; later layers first add the previous
            // layer's MLP output into the residual.
            let mlp_out = if l == 0 { DevicePtr::NULL } else { sc.mlp };
            // The add + RMSNorm and the qkv product in one launch, streamed or not.
            let fold = GemvNorm {
                c: sc.qkv,
                residual,
                residual_out: other(residual),
                input: mlp_out,
                norm_weight: w.input_norm,
                w: w.qkv,
                bias: w.qkv_bias,
                m: n,
                n: qd + 2 * kvd,
                k: h,
                eps,
                stage: stage(n, qd + 2 * kvd),
            };
            let folded = if stream_folds_norm("qkv", n, qd + 2 * kvd) {
                let stream = GemvStreamNorm {
                    prewait: self.gemv_stream_prewait,
                    evict_first: self.gemv_stream_evict.into(),
                    ..GemvStreamNorm::from(fold)
                };
                self.launch_stream(k.gemv_stream_norm, "qkv", &stream, n)?;
                true
            } else if folds_norm(n, qd + 2 * kvd) {
                self.launch(k.gemv_norm, "qkv", &fold)?;
                true
            } else {
                self.launch(
                    k.add_rmsnorm,
                    "add_rmsnorm",
                    &AddRmsNorm {
                        out: sc.x,
                        residual,
                        input: mlp_out,
                        weight: w.input_norm,
                        rows: n,
                        cols: h,
                        eps,
                    },
                )?;
                gemm("qkv", sc.qkv, sc.x, w.qkv, w.qkv_bias, n, qd + 2 * kvd, h)?;
                false
            };
            if folded && moves("qkv") {
                residual = fold.residual_out;
            }
            let post = QkvRopeKvWrite {
                qkv: sc.qkv,
                q_out: sc.q,
                k_cache: self.k_cache[l],
                v_cache: self.v_cache[l],
                slots,
                q_norm: w.q_norm,
                k_norm: w.k_norm,
                positions,
                cos: self.rope_cos,
                sin: self.rope_sin,
                tokens: n,
                q_heads: qh,
                kv_heads: kvh,
                head_dim: hd,
                max_position: o.max_seq_len as u32,
                eps,
            };
            // Decode rows (all of a decode step, the leading ones of a mixed step) through the
            // split decode attention; the prefill tiles after them on tensor cores. A decode row
            // thus gets the same arithmetic whether or not a prefill shares its step.
            let paged_tokens = if tensor_core_prefill { decode_rows } else { n };
            let attention = PagedAttention {
                out: sc.attn,
                partials: sc.partials,
                counters: sc.counters,
                q: sc.q,
                k_cache: self.k_cache[l],
                v_cache: self.v_cache[l],
                block_tables: tables,
                token_seq,
                positions,
                tokens: paged_tokens,
                q_heads: qh,
                kv_heads: kvh,
                head_dim: hd,
                block_size: o.block_size as u32,
                max_blocks_per_seq: width as u32,
                keys_per_split,
                splits,
                scale,
            };
            if fused_post {
                // The fused attention copies its first cache tiles before the programmatic-launch
                // wait: the launch just before it (the qkv product) must write no cache row.
                let fused = PagedAttentionQkv::fuse(&post, &attention);
                if fused.splits == 1
                    && fused.wide_fits()
                    && fused.tokens * fused.kv_heads <= self.attention_wide_blocks
                {
                    let carveout = self.carveout("attention", None);
                    let config = fused.wide_launch_config();
                    self.launch_with(k.attention_qkv_wide, "attention", &fused, &config, carveout)?;
                } else {
                    self.launch(k.attention_qkv, "attention", &fused)?;
                }
            } else {
                self.launch(k.qkv_post, "qkv_post", &post)?;
                if paged_tokens > 0 {
                    self.launch(k.attention, "attention", &attention)?;
                }
            }
            if tensor_core_prefill && decode_rows < num_tiles {
                let v1 = PrefillAttention {
                    out: sc.attn,
                    q: sc.q,
                    k_cache: self.k_cache[l],
                    v_cache: self.v_cache[l],
                    block_tables: tables,
                    // Each decode row is one tile of its own, first.
                    tiles: tiles.offset(decode_rows as usize * 16),
                    num_tiles: num_tiles - decode_rows,
                    q_heads: qh,
                    kv_heads: kvh,
                    head_dim: hd,
                    block_size: o.block_size as u32,
                    max_blocks_per_seq: width as u32,
                    scale,
                };
                // The same arguments for every version; each its own launch geometry.
                match self.prefill_version {
                    PrefillVersion::V1 => {
                        self.launch(k.prefill_attention, "prefill_attention", &v1)?
                    }
                    PrefillVersion::V2 => self.launch(
                        k.prefill_attention_v2,
                        "prefill_attention",
                        &PrefillAttentionV2::from(v1),
                    )?,
                    PrefillVersion::V3 => self.launch(
                        k.prefill_attention_v3,
                        "prefill_attention",
                        &PrefillAttentionV3::from(v1),
                    )?,
                }
            }
            gemm("o", sc.o, sc.attn, w.o, DevicePtr::NULL, n, h, qd)?;
            let swiglu = self.fused_swiglu && self.streams_weight(n, h);
            let silu_mul = SiluMul {
                out: sc.act,
                gate_up: sc.gate_up,
                tokens: n,
                inter,
            };
            // The add + RMSNorm and the gate|up product (SwiGLU form) in one launch.
            let residual_out = other(residual);
            let swiglu_fold = GemvSwigluNorm {
                out: sc.act,
                residual,
                residual_out,
                input: sc.o,
                norm_weight: w.post_norm,
                w: w.gate_up,
                m: n,
                inter,
                k: h,
                eps,
                stage: stage(n, 2 * inter),
            };
            if stream_folds_norm("gate_up", n, 2 * inter) {
                let stream = GemvSwigluStreamNorm {
                    prewait: self.gemv_stream_prewait,
                    evict_first: self.gemv_stream_evict.into(),
                    ..GemvSwigluStreamNorm::from(swiglu_fold)
                };
                self.launch_stream(k.gemv_swiglu_stream_norm, "gate_up", &stream, n)?;
                if moves("gate_up") {
                    residual = residual_out;
                }
            } else if folds_norm(n, 2 * inter) {
                if swiglu {
                    self.launch(k.gemv_swiglu_norm, "gate_up", &swiglu_fold)?;
                } else {
                    let fused = GemvNorm {
                        c: sc.gate_up,
                        residual,
                        residual_out,
                        input: sc.o,
                        norm_weight: w.post_norm,
                        w: w.gate_up,
                        bias: DevicePtr::NULL,
                        m: n,
                        n: 2 * inter,
                        k: h,
                        eps,
                        stage: stage(n, 2 * inter),
                    };
                    self.launch(k.gemv_norm, "gate_up", &fused)?;
                    self.launch(k.silu_mul, "silu_mul", &silu_mul)?;
                }
                if moves("gate_up") {
                    residual = residual_out;
                }
            } else {
                self.launch(
                    k.add_rmsnorm,
                    "add_rmsnorm",
                    &AddRmsNorm {
                        out: sc.x,
                        residual,
                        input: sc.o,
                        weight: w.post_norm,
                        rows: n,
                        cols: h,
                        eps,
                    },
                )?;
                if swiglu {
                    let swiglu = GemvSwiglu {
                        out: sc.act,
                        a: sc.x,
                        w: w.gate_up,
                        m: n,
                        inter,
                        k: h,
                    };
                    if self.streams("gate_up", n, 2 * inter, h) {
                        let stream = GemvSwigluStream {
                            prewait: self.gemv_stream_prewait,
                            evict_first: self.gemv_stream_evict.into(),
                            ..GemvSwigluStream::from(swiglu)
                        };
                        self.launch_stream(k.gemv_swiglu_stream, "gate_up", &stream, n)?;
                    } else if self.gemv_stage.takes(n, 2 * inter, h) {
                        let staged = GemvSwigluStaged::from(swiglu);
                        self.launch_gemv(k.gemv_swiglu_staged, "gate_up", &staged, (n, 2 * inter))?;
                    } else {
                        self.launch_gemv(k.gemv_swiglu, "gate_up", &swiglu, (n, 2 * inter))?;
                    }
                } else {
                    let (gate_up, x) = (sc.gate_up, sc.x);
                    gemm(
                        "gate_up",
                        gate_up,
                        x,
                        w.gate_up,
                        DevicePtr::NULL,
                        n,
                        2 * inter,
                        h,
                    )?;
                    self.launch(k.silu_mul, "silu_mul", &silu_mul)?;
                }
            }
            gemm("down", sc.mlp, sc.act, w.down, DevicePtr::NULL, n, h, inter)?;
        }
        self.launch(
            k.add_rmsnorm,
            "add_rmsnorm",
            &AddRmsNorm {
                out: sc.x,
                residual,
                input: sc.mlp,
                weight: self.weights.final_norm,
                rows: n,
                cols: h,
                eps,
            },
        )?;

        let rows = step.logit_rows.len();
        if rows == 0 {
            return Ok(0);
        }
        // Logits only for the rows asked for: a contiguous run is used in place, otherwise the
        // rows are gathered first.
        let row_bytes = c.hidden_size * 2;
        let first = step.logit_rows[0];
        // In place only at a 256-byte aligned start: cuBLASLt's algorithms assume that alignment
        // of their operands (hidden 576, SmolLM2, gives rows 128-byte aligned).
        let contiguous = (first * row_bytes).is_multiple_of(256)
            && step
                .logit_rows
                .iter()
                .enumerate()
                .all(|(i, &r)| r == first + i);
        let input = if contiguous {
            sc.x.offset(first * row_bytes)
        } else {
            for (i, &r) in step.logit_rows.iter().enumerate() {
                g.copy_d2d(
                    sc.x.offset(r * row_bytes),
                    sc.gathered.offset(i * row_bytes),
                    row_bytes,
                    s,
                )?;
            }
            sc.gathered
        };
        let vocab = c.vocab_size as u32;
        // The LM head accumulates in f32 and writes f32 logits: no bf16 rounding of the logits,
        // so greedy choices are not decided by ties that only bf16 creates.
        let (out, a, w) = (sc.logits, input, self.weights.lm_head);
        if self.streams_weight(rows as u32, h) {
            let head = GemvF32Out {
                c: out,
                a,
                w,
                bias: DevicePtr::NULL,
                m: rows as u32,
                n: vocab,
                k: h,
            };
            if self.streams("lm_head", rows as u32, vocab, h) {
                let stream = GemvStreamF32Out {
                    prewait: self.gemv_stream_prewait,
                    evict_first: self.gemv_stream_evict.into(),
                    ..GemvStreamF32Out::from(head)
                };
                self.launch_stream(k.gemv_stream_f32out, "lm_head", &stream, rows as u32)?;
            } else {
                self.launch_gemv(k.gemv_f32out, "lm_head", &head, (rows as u32, vocab))?;
            }
        } else {
            let head = GemmOp {
                c: out,
                a,
                w,
                bias: DevicePtr::NULL,
                m: rows as u32,
                n: vocab,
                k: h,
                f32_out: true,
            };
            if !self.skip.contains(&"lm_head") {
                g.gemm(&head, k.gemm_f32out, s)?;
                self.mark("lm_head")?;
            }
        }
        Ok(rows)
    }

    /// Whether the step's attention runs on the tensor-core prefill kernel (for its tiles after
    /// the leading decode rows): some sequence brings more than one token, and the head dim is
    /// one the kernel covers.
    fn tensor_core_prefill(&self, step: &StepInput) -> bool {
        step.tokens.len() > step.block_tables.len()
            && PrefillAttention::supports_head_dim(self.config.head_dim as u32)
    }

    /// Whether the `m x n x k` product of `label` takes the bulk-copy stream: a label of the set,
    /// enough weights, and a shape the stream takes (`n` counts the gate and up rows of gate_up).
    fn streams(&self, label: &'static str, m: u32, n: u32, k: u32) -> bool {
        stream_takes(
            &self.gemv_stream_labels,
            self.gemv_stream_min_weights,
            label,
            (m, n, k),
        )
    }

    /// Query tokens per tile of the prefill attention in use.
    fn prefill_tile(&self) -> u32 {
        match self.prefill_version {
            PrefillVersion::V1 => PrefillAttention::TILE_TOKENS,
            PrefillVersion::V2 => PrefillAttentionV2::TILE_TOKENS,
            PrefillVersion::V3 => PrefillAttentionV3::TILE_TOKENS,
        }
    }

    /// [`Model::launch`] of a plain or staged GEMV of `m` rows over `n` output columns, its grid
    /// capped at `METRALE_GEMV_GRID_CAP` blocks when that leaves the kernel's recovered columns
    /// per block (next_pow2(ceil(n / grid)) clamped to 1..8, or 8..64 in the MMA form past
    /// GEMV_FMA_MAX_ROWS rows) as they were: the blocks then loop over the column groups, with the
    /// same sums. By default at the blocks resident at once ([`GEMV_RESIDENT_BLOCKS`]);
    /// `METRALE_GEMV_GRID_MODE` spreads the groups evenly or caps also where the columns per block
    /// change ([`GemvGridMode`]).
    fn launch_gemv<K: Kernel>(
        &self,
        handle: KernelHandle,
        label: &'static str,
        args: &K,
        (m, n): (u32, u32),
    ) -> Result<(), ModelError> {
        let mut config = args.launch_config();
        config.grid[0] = gemv_launch_grid(
            m,
            n,
            config.grid[0],
            self.gemv_grid_cap,
            self.gemv_grid_mode,
        );
        self.launch_with(handle, label, args, &config, self.carveout(label, Some(m)))
    }

    /// [`Model::launch_with`] of a bulk-copy GEMV stream of `m` rows: its own geometry (one block
    /// an SM whatever the product: no grid cap of [`Model::launch_gemv`]) and the label's carveout.
    fn launch_stream<K: Kernel>(
        &self,
        handle: KernelHandle,
        label: &'static str,
        args: &K,
        m: u32,
    ) -> Result<(), ModelError> {
        let carveout = self.carveout(label, Some(m));
        self.launch_with(handle, label, args, &args.launch_config(), carveout)
    }

    /// Launches one kernel on the default stream (and, when profiling, marks its end).
    fn launch<K: Kernel>(
        &self,
        handle: KernelHandle,
        label: &'static str,
        args: &K,
    ) -> Result<(), ModelError> {
        let carveout = self.carveout(label, None);
        self.launch_with(handle, label, args, &args.launch_config(), carveout)
    }

    /// [`Model::launch`] with the given launch geometry and shared-memory carveout.
    fn launch_with<K: Kernel>(
        &self,
        handle: KernelHandle,
        label: &'static str,
        args: &K,
        config: &LaunchConfig,
        carveout: Option<u8>,
    ) -> Result<(), ModelError> {
        if self.skip.contains(&label) {
            return Ok(());
        }
        let g = self.gpu.as_ref();
        let mut config = *config;
        if let Some(&(_, cap)) = self.grid_cap_labels.iter().find(|(l, _)| *l == label) {
            config.grid[0] = config.grid[0].min(cap);
        }
        match carveout {
            Some(percent) => {
                g.launch_with_carveout(handle, &config, &args.args(), g.default_stream(), percent)?
            }
            None => g.launch(handle, &config, &args.args(), g.default_stream())?,
        }
        self.mark(label)
    }

    /// The shared-memory carveout (percent) a launch of `label` asks for (`rows`: the rows of a
    /// GEMV product, where known); `None` leaves the split to the driver. A kernel whose blocks
    /// need another L1 / shared split than the SMs hold becomes resident only once the kernel
    /// before has left them (the decode attention's block 0 waited 0.06 us for its release behind
    /// a QKV product at the driver's split, 1.09 us behind one at 100%); and a launch at 100%
    /// leaves its SMs with the smallest L1 for the launches after it. The rule, measured on the
    /// H200 at batch 1 with 160 keys (docs/results/2026-12-02-speed-h200/carveout):
    /// - the QKV product asks for the most shared memory, the split the decode attention after
    ///   it needs: Qwen3-8B's qkv launch 16.5 -> 14.4 us a layer, its step 4.32 -> 4.26 ms;
    ///   neutral at Qwen3-0.6B;
    /// - the o projection does too when the gate|up launch after it folds the residual add +
    ///   RMSNorm (Qwen3-0.6B's sizes: step 0.823 -> 0.803 ms); at Qwen3-8B's, where gate|up
    ///   streams 201 MB without the norm, it made gate|up 47.6 -> 54.4 us, so it does not.
    ///
    /// `METRALE_CARVEOUT_LABELS` replaces the rule.
    fn carveout(&self, label: &'static str, rows: Option<u32>) -> Option<u8> {
        if let Some(labels) = &self.carveout_labels {
            return labels.iter().find(|(l, _)| *l == label).map(|&(_, p)| p);
        }
        let c = &self.config;
        let (h, inter) = (c.hidden_size as u32, c.intermediate_size as u32);
        // Only the o projection's case looks at the gate|up launch after it.
        let folds = label == "o" && rows.is_some_and(|m| self.folds_norm(m, 2 * inter, h));
        carveout_rule(label, folds)
    }

    /// Whether the product of `rows` x `n` x `k` after a residual add + RMSNorm takes the norm into
    /// its launch (GemvNorm, GemvSwigluNorm): a GEMV product of the FMA form whose A fits in
    /// shared memory, as METRALE_GEMV_NORM picks.
    fn folds_norm(&self, rows: u32, n: u32, k: u32) -> bool {
        self.streams_weight(rows, k)
            && gemv_norm_fits(rows, n, k)
            && self.gemv_norm.takes(rows, n, k)
    }

    /// For timing experiments only: leave out every launch with one of these labels (the
    /// labels of [`Model::profile`]), so that a step's time without them can be measured where
    /// it matters, inside the replayed graph. The step's outputs are then wrong. Captured graphs
    /// are set aside (not freed: this is a measuring tool) so that the next decode steps are
    /// captured without those launches. Where a fused launch stands for two (the one-sequence
    /// decode attention with qkv_post's work, labelled "attention"; the gate|up GEMV with
    /// SiLU x up, labelled "gate_up"; the qkv and gate|up GEMVs that do the residual add +
    /// RMSNorm before them, labelled "qkv" and "gate_up"), "qkv_post", "silu_mul" and
    /// "add_rmsnorm" leave out nothing of them and the fused label leaves out every part: turn
    /// the fusions off (`METRALE_FUSED_QKV_ATTENTION=0`, `METRALE_FUSED_SWIGLU=0`,
    /// `METRALE_GEMV_NORM=0`) to time the parts apart.
    pub fn set_skip(&mut self, labels: &[&str]) -> Result<(), ModelError> {
        self.skip = labels
            .iter()
            .map(|l| {
                LAUNCH_LABELS
                    .iter()
                    .copied()
                    .find(|k| k == l)
                    .ok_or_else(|| {
                        ModelError::InvalidStep(format!(
                            "unknown launch label `{l}`; the labels are {}",
                            LAUNCH_LABELS.join(", ")
                        ))
                    })
            })
            .collect::<Result<_, _>>()?;
        self.graphs.clear();
        Ok(())
    }

    /// When profiling, records the end of the work queued so far under `label`.
    fn mark(&self, label: &'static str) -> Result<(), ModelError> {
        if let Some(p) = &self.profiler {
            p.lock()
                .expect("profiler lock")
                .mark(self.gpu.as_ref(), label)?;
        }
        Ok(())
    }

    /// Times every launch of the following steps (graph replay is off meanwhile); read the last
    /// step's times with [`Model::profile`].
    pub fn set_profile(&mut self, on: bool) {
        self.profiler = on.then(|| std::sync::Mutex::new(Profiler::default()));
    }

    /// The last step's launches in order, with their milliseconds (empty unless profiling).
    pub fn profile(&self) -> Result<Vec<(&'static str, f64)>, ModelError> {
        match &self.profiler {
            Some(p) => Ok(p.lock().expect("profiler lock").times(self.gpu.as_ref())?),
            None => Ok(Vec::new()),
        }
    }
}

impl Drop for Model {
    fn drop(&mut self) {
        for &p in self.owned.iter().chain(&self.weights.allocations) {
            let _ = self.gpu.free(p);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{
        GemvPolicy, LAUNCH_LABELS, PrefillVersion, carveout_rule, parse_carveout_labels,
        parse_count, parse_grid_cap_labels, parse_stream_labels,
    };

    #[test]
    fn the_default_stream_set_takes_qwen3_8b_products_not_qwen3_0_6b() {
        use super::{DEFAULT_STREAM_LABELS, GEMV_STREAM_MIN_WEIGHTS, stream_takes};
        let default =
            |label, mnk| stream_takes(&DEFAULT_STREAM_LABELS, GEMV_STREAM_MIN_WEIGHTS, label, mnk);
        // Qwen3-8B at batch 1: qkv, o, gate|up (both halves' rows), down.
        for (label, mnk) in [
            ("qkv", (1, 6144, 4096)),
            ("o", (1, 4096, 4096)),
            ("gate_up", (1, 24576, 4096)),
            ("down", (1, 4096, 12288)),
        ] {
            assert!(default(label, mnk), "{label} {mnk:?}");
        }
        // Qwen3-0.6B's (under 8M weights), two rows, and the LM head, which is not in the set.
        for (label, mnk) in [
            ("qkv", (1, 4096, 1024)),
            ("o", (1, 1024, 2048)),
            ("gate_up", (1, 6144, 1024)),
            ("down", (1, 1024, 3072)),
            ("down", (2, 4096, 12288)),
            ("lm_head", (1, 151936, 4096)),
        ] {
            assert!(!default(label, mnk), "{label} {mnk:?}");
        }
        // A set given streams whatever fits, however small: Qwen3-0.6B's o and qkv (rows of 2 KiB,
        // in half-size chunks), not SmolLM2's qkv (rows of 576 elements).
        assert!(stream_takes(&["o"], 0, "o", (1, 1024, 2048)));
        assert!(stream_takes(&["qkv"], 0, "qkv", (1, 4096, 1024)));
        assert!(!stream_takes(&["qkv"], 0, "qkv", (1, 960, 576)));
        // gate_up's columns are half its rows: 7 outputs over 14 rows fit.
        assert!(stream_takes(&["gate_up"], 0, "gate_up", (1, 14, 2048)));
    }

    #[test]
    fn stream_labels_take_the_plain_gemv_labels() {
        assert!(parse_stream_labels(None).unwrap().is_empty());
        assert!(parse_stream_labels(Some("")).unwrap().is_empty());
        assert_eq!(
            parse_stream_labels(Some("down+ o ,qkv")).unwrap(),
            ["down", "o", "qkv"]
        );
        for bad in ["attention", "down=1", "attention+o", "Down"] {
            let err = parse_stream_labels(Some(bad)).unwrap_err();
            assert!(
                err.to_string()
                    .starts_with(&format!("METRALE_GEMV_STREAM_LABELS={bad}: expected")),
                "{err}"
            );
        }
    }

    #[test]
    fn grid_caps_take_gemv_labels_and_positive_counts() {
        assert!(parse_grid_cap_labels(None).unwrap().is_empty());
        assert_eq!(
            parse_grid_cap_labels(Some("qkv=372+ gate_up = 264")).unwrap(),
            vec![("qkv", 372), ("gate_up", 264)]
        );
        for bad in ["qkv=0", "attention=8", "o", "down=-3", "lm_head=many"] {
            let err = parse_grid_cap_labels(Some(bad)).unwrap_err();
            assert!(
                err.to_string()
                    .starts_with(&format!("METRALE_GRID_CAP_LABELS={bad}: expected")),
                "{bad}: {err}"
            );
        }
    }

    #[test]
    fn the_carveout_rule_names_qkv_and_o_before_a_folded_norm() {
        for folds in [false, true] {
            assert_eq!(carveout_rule("qkv", folds), Some(100));
            assert_eq!(carveout_rule("o", folds), folds.then_some(100));
            for label in LAUNCH_LABELS.iter().filter(|l| !["qkv", "o"].contains(l)) {
                assert_eq!(carveout_rule(label, folds), None, "{label}");
            }
        }
    }

    #[test]
    fn carveout_labels_take_known_labels_and_percentages() {
        assert!(parse_carveout_labels(None).unwrap().is_empty());
        assert!(parse_carveout_labels(Some("")).unwrap().is_empty());
        assert_eq!(
            parse_carveout_labels(Some("qkv=100, o = 50+attention=0")).unwrap(),
            vec![("qkv", 100), ("o", 50), ("attention", 0)]
        );
        for bad in ["qkv", "qkv=101", "qkv=-1", "mlp=50", "o=half", "=50"] {
            let err = parse_carveout_labels(Some(bad)).unwrap_err();
            assert!(
                err.to_string()
                    .starts_with(&format!("METRALE_CARVEOUT_LABELS={bad}: expected")),
                "{bad}: {err}"
            );
        }
    }

    #[test]
    fn counts_from_the_environment_refuse_what_is_not_one() {
        assert_eq!(parse_count("METRALE_GEMV_GRID_CAP", None, 7).unwrap(), 7);
        assert_eq!(
            parse_count("METRALE_GEMV_GRID_CAP", Some("396"), 0).unwrap(),
            396
        );
        assert_eq!(
            parse_count("METRALE_GEMV_GRID_CAP", Some(" 8 "), 0).unwrap(),
            8
        );
        for bad in ["", "-1", "many", "1.5"] {
            let err = parse_count("METRALE_ATTENTION_SPLIT_KEYS", Some(bad), 64).unwrap_err();
            assert_eq!(
                err.to_string(),
                format!("METRALE_ATTENTION_SPLIT_KEYS={bad}: expected a non-negative integer")
            );
        }
    }

    #[test]
    fn gemv_policy_follows_the_variable_and_refuses_unknown_values() {
        let choose = |env| GemvPolicy::choose("METRALE_GEMV_STAGE", env, GemvPolicy::Small);
        let choose = |env| choose(env).unwrap();
        assert_eq!(choose(None), GemvPolicy::Small);
        assert_eq!(choose(Some("0")), GemvPolicy::Off);
        assert_eq!(choose(Some("off")), GemvPolicy::Off);
        assert_eq!(choose(Some("small")), GemvPolicy::Small);
        assert_eq!(choose(Some("all")), GemvPolicy::All);
        let unset = GemvPolicy::choose("METRALE_GEMV_NORM", None, GemvPolicy::All);
        assert_eq!(unset.unwrap(), GemvPolicy::All);
        // Qwen3-8B's qkv product at batch 1 is taken only under `all`; no policy takes 5 rows.
        assert!(!choose(None).takes(1, 6144, 4096));
        assert!(choose(Some("all")).takes(1, 6144, 4096));
        assert!(choose(None).takes(1, 4096, 1024));
        assert!(!choose(Some("all")).takes(5, 4096, 1024));
        assert!(!choose(Some("off")).takes(1, 4096, 1024));
        let err = GemvPolicy::choose("METRALE_GEMV_NORM", Some("yes"), GemvPolicy::All);
        let err = err.unwrap_err().to_string();
        assert_eq!(err, "METRALE_GEMV_NORM=yes: expected 0, off, small or all");
    }

    #[test]
    fn prefill_version_follows_the_variable_and_refuses_unknown_values() {
        let choose = |env, head_dim| PrefillVersion::choose(env, head_dim).unwrap();
        assert_eq!(choose(None, 128), PrefillVersion::V3);
        assert_eq!(choose(None, 64), PrefillVersion::V2);
        assert_eq!(choose(Some("v1"), 128), PrefillVersion::V1);
        assert_eq!(choose(Some("v2"), 128), PrefillVersion::V2);
        assert_eq!(choose(Some("v3"), 128), PrefillVersion::V3);
        // Version 3 covers head_dim 128 only.
        assert_eq!(choose(Some("v3"), 64), PrefillVersion::V2);
        let err = PrefillVersion::choose(Some("v9"), 128)
            .unwrap_err()
            .to_string();
        assert_eq!(err, "METRALE_PREFILL_ATTENTION=v9: expected v1, v2 or v3");
    }
}
