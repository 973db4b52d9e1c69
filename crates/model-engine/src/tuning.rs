// SPDX-License-Identifier: MIT OR Apache-2.0
//! The engine's schedule choices as one typed value.
//!
//! A [`Tuning`] starts from [`Tuning::plain`]: every product through the library GEMM, every
//! fusion off, the separate launches (the simplest correct path, which the host path test compares
//! the others with). The kernel tree then applies its measured defaults: `HARDWARE.toml`'s
//! `[tuning]` under the target leaf's `KERNEL.toml` `[tuning]` ([`Tuning::for_target`]), as
//! `key = value` pairs through [`Tuning::set`], the same parser `met bench-model --tune key=value`
//! uses for experiments. Hardware facts (SMs, resident blocks) come from the class's
//! [`HardwareSchedule`]. The run-time environment holds only operator switches
//! ([`Tuning::apply_operator_env`]).

use metrale_gpu_runtime::{GpuError, operator_switch};
use metrale_kernels::ops::{ATTENTION_SPLIT_KEYS, GEMV_STREAM_STAGES, GemvGridMode};
use metrale_kernels::{HardwareSchedule, TargetKernels};

/// A tuning key or value the engine does not take.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TuningError {
    /// No such key.
    #[error("unknown tuning key `{key}`; the keys are {}", KEYS.join(", "))]
    UnknownKey {
        /// The key given.
        key: String,
    },
    /// The key exists; the value is not one it takes.
    #[error("{key}={value}: expected {expected}")]
    BadValue {
        /// The key.
        key: String,
        /// The value given.
        value: String,
        /// What it takes.
        expected: &'static str,
    },
}

/// Which GEMV products of 1 to 4 rows (the FMA form) take a special form (the staged entries, or
/// the residual add + RMSNorm folded into the product's launch). Each computes the plain
/// entries' bits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GemvPolicy {
    /// None.
    Off,
    /// Those `gemv_stages` picks: at most 8M weights (Qwen3-0.6B's products).
    Small,
    /// Every product of the FMA form (1 to 4 rows).
    All,
}

/// The tensor-core prefill attention kernels (all take the same arguments and tiles).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PrefillVersion {
    /// `prefill_attention_bf16`: 64-token query tiles, mma.sync.
    V1,
    /// `prefill_attention_v2_bf16`: 128-token query tiles, mma.sync, double-buffered keys.
    V2,
    /// `prefill_attention_v3_bf16`: 128-token query tiles on wgmma (head_dim 128 only; version 2
    /// elsewhere).
    V3,
}

/// How launches pick their shared-memory carveout.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Carveout {
    /// The driver picks for every launch.
    Driver,
    /// The measured rule (`launch::carveout_rule`): the QKV product at 100%, the o projection
    /// too before a gate|up launch that folds the norm.
    Rule,
    /// Launches of these labels ask for this percent; the others leave it to the driver.
    Labels(Vec<(&'static str, u8)>),
}

/// The labels the model's launches carry (its profile's rows, `Model::set_skip`).
pub const LAUNCH_LABELS: [&str; 17] = [
    "embedding",
    "add_rmsnorm",
    "qkv",
    "qk_norm",
    "qkv_post",
    "attention",
    "prefill_attention",
    "o",
    "gate_up",
    "silu_mul",
    "down",
    "lm_head",
    "router",
    "experts",
    "shared_gate_up",
    "shared_down",
    "shared_gate",
];

/// The labels of the products ([`crate::linear::Linear`]): those that may stream, take a grid
/// cap or a special GEMV form.
pub const LINEAR_LABELS: [&str; 15] = [
    "qkv",
    "o",
    "gate_up",
    "down",
    "lm_head",
    "router",
    "shared_gate_up",
    "shared_down",
    "shared_gate",
    // Gated attention's output gate (Qwen3-Next, Qwen3.5).
    "attn_gate",
    // A squared-ReLU MLP's up product (Nemotron-H).
    "up",
    // The Gated DeltaNet's input and output products.
    "gdn_in",
    "gdn_out",
    // The Mamba-2 mixer's input and output products.
    "mamba_in",
    "mamba_out",
];

/// Every key [`Tuning::set`] takes.
pub const KEYS: [&str; 37] = [
    "graphs",
    "decode_ahead",
    "gemv_max_rows",
    "gemm_wide_k",
    "gemm_wide_k_max_gemv_rows",
    "gemv_stage",
    "gemv_norm",
    "gemv_grid_cap",
    "gemv_grid_mode",
    "gemv_stream",
    "gemv_stream_min_weights",
    "gemv_stream_prewait",
    "gemv_stream_evict",
    "gemv_stream_norm",
    "gemv_fp8_stream",
    "gemv_fp8_mma_min_rows",
    "fp8_gemm",
    "fp8_fused_quantize",
    "fused_swiglu",
    "fused_qkv_attention",
    "prefill_attention",
    "attention_target_blocks",
    "attention_split_keys",
    "attention_unsplit_keys",
    "attention_wide_blocks",
    "embedding_vec",
    "moe_grouped_min_rows",
    "moe_fp8_experts",
    "moe_tensor_core_min_rows",
    "moe_grouped_mma",
    "moe_fused_router",
    "moe_fused_shared_expert",
    "ssd_chunk_min_run",
    "gdn_chunk_min_run",
    "gdn_chunk_tensor_cores",
    "carveout",
    "grid_caps",
];

/// The most decode steps `Model::decode_ahead` keeps queued ahead of the id it reads back.
pub const MAX_DECODE_AHEAD: u32 = 8;

/// Every schedule choice of the engine. Public fields: a test or a benchmark may set any of them
/// in-process; [`Tuning::set`] is the same by name.
#[derive(Clone, Debug, PartialEq)]
pub struct Tuning {
    /// The class's launch-geometry facts.
    pub hardware: HardwareSchedule,
    /// Replay pure decode steps from captured graphs.
    pub graphs: bool,
    /// Greedy decode of one sequence keeps this many steps queued while it reads an id back
    /// (`Model::decode_ahead`; 0: a host round trip per step), at most [`MAX_DECODE_AHEAD`].
    pub decode_ahead: u32,
    /// Products of at most this many rows (0 to 8) stream the weight with a GEMV; larger ones
    /// go to the library GEMM.
    pub gemv_max_rows: u32,
    /// Products over at least this many inputs go to the library GEMM past
    /// [`Tuning::gemm_wide_k_max_gemv_rows`] rows.
    pub gemm_wide_k: u32,
    /// See [`Tuning::gemm_wide_k`].
    pub gemm_wide_k_max_gemv_rows: u32,
    /// Which GEMV products stage their first weights before the programmatic-launch wait.
    pub gemv_stage: GemvPolicy,
    /// Which GEMV products after a residual add + RMSNorm do the norm in their own launch.
    pub gemv_norm: GemvPolicy,
    /// At most this many blocks for a plain or staged GEMV launch (0: the rule's grid).
    pub gemv_grid_cap: u32,
    /// How the cap applies.
    pub gemv_grid_mode: GemvGridMode,
    /// The one-row products of these labels take the bulk-copy stream where it fits.
    pub gemv_stream: Vec<&'static str>,
    /// ... if they have at least this many weights.
    pub gemv_stream_min_weights: u64,
    /// 4-KiB units of each warp's ring a stream copies before its programmatic-launch wait.
    pub gemv_stream_prewait: u32,
    /// The streams' weights go through L2 as evict-first lines.
    pub gemv_stream_evict: bool,
    /// A streamed qkv or gate|up product after a residual add + RMSNorm does the norm itself.
    pub gemv_stream_norm: bool,
    /// One-row FP8 products of the stream's labels and size take the FP8 bulk-copy stream
    /// (`gemv_fp8_stream` and its SwiGLU and normalising forms) where it fits; off: the FP8 GEMV.
    pub gemv_fp8_stream: bool,
    /// FP8 products of this many rows and more (up to 8) that do not stream take the
    /// tensor-core FP8 GEMV (`gemv_fp8_mma`, `gemv_fp8_mma_swiglu`: A as f16, mma.sync) where it
    /// fits; fewer rows take the register FP8 GEMV (`off`: u32::MAX, always the register one).
    pub gemv_fp8_mma_min_rows: u32,
    /// FP8 products above the GEMV's rows quantize their activations to e4m3 (a scale per row
    /// and 128 columns, `fp8_quantize_rows`) and take the library's block-scaled FP8 GEMM
    /// (cuBLASLt on CUDA) where the weight fits it (`gemm_fp8_fits`, 128 x 128 scale blocks);
    /// off: the weight dequantised to BF16 and the BF16 library GEMM.
    pub fp8_gemm: bool,
    /// Where an FP8 product takes the FP8 GEMM ([`Tuning::fp8_gemm`]) after one of the engine's
    /// own elementwise launches (the residual add + RMSNorm before qkv and gate|up, SiLU x up
    /// before down), that launch writes the product's e4m3 rows and scales itself
    /// (`add_rmsnorm_f32res_fp8_rows`, `silu_mul_fp8_rows`) instead of bf16 rows for
    /// `fp8_quantize_rows` (off: the separate quantize launch). The same bits either way, one
    /// launch fewer a product; on in the plain path too, where it changes nothing until
    /// `fp8_gemm` is on.
    pub fp8_fused_quantize: bool,
    /// Gate|up products streamed through the GEMV run SiLU x up in their epilogue.
    pub fused_swiglu: bool,
    /// A decode step of one sequence runs QK-norm, RoPE and the cache write inside the decode
    /// attention.
    pub fused_qkv_attention: bool,
    /// The tensor-core prefill attention.
    pub prefill_attention: PrefillVersion,
    /// Blocks a split decode attention launch aims for.
    pub attention_target_blocks: u32,
    /// The fewest keys a split takes (rounded up to a power of two).
    pub attention_split_keys: u32,
    /// The longest context left in one split (0: none; rounded up to a power of two).
    pub attention_unsplit_keys: u32,
    /// The most blocks a one-split fused decode attention launch takes the 8-warp form at.
    pub attention_wide_blocks: u32,
    /// The token embedding with 16-byte loads (`embedding_f32_vec`; the same values).
    pub embedding_vec: bool,
    /// MoE steps of at least this many tokens group the assignments by expert and run each
    /// expert's rows as one tensor-core product (fewer: every assignment reads its expert).
    pub moe_grouped_min_rows: u32,
    /// With FP8 linears, the routed experts load as FP8 too (e4m3 stacks and their scales, the
    /// FP8 forms of every expert launch); off: they load as BF16 (an FP8 checkpoint's expert
    /// tensors dequantised), as before FP8 experts existed. Read at load.
    pub moe_fp8_experts: bool,
    /// Grouped MoE steps of at least this many tokens run the experts' products on tensor cores
    /// (fewer: as weight streams over the touched experts, a few rows an expert).
    pub moe_tensor_core_min_rows: u32,
    /// Grouped MoE steps below [`Tuning::moe_tensor_core_min_rows`] tokens run the experts'
    /// products on tensor cores, each touched expert's weights read once per 32 of its rows
    /// (off: the CUDA-core weight streams). BF16 experts only: FP8 experts have only the
    /// tensor-core form.
    pub moe_grouped_mma: bool,
    /// MoE steps of at most `MOE_ROUTER_MAX_ROWS` (8) tokens run the router's product, the
    /// shared expert's gate logit and the routing in one launch (`moe_router`; off: the f32
    /// GEMV, the gate's own product and `moe_route`). The same logits and choices.
    pub moe_fused_router: bool,
    /// MoE steps on the per-assignment expert launches (fewer than
    /// [`Tuning::moe_grouped_min_rows`] tokens) run the shared expert as extra slots of those
    /// two launches (off: its own gate|up and down products, three launches for squared ReLU),
    /// its output then unrounded before the combine.
    pub moe_fused_shared_expert: bool,
    /// Steps whose longest run has at least this many tokens walk the Mamba-2 recurrence in
    /// parallel chunks (`mamba2_chunk_*`, three launches; 0: never, token by token).
    pub ssd_chunk_min_run: u32,
    /// Steps whose longest run has at least this many tokens run the gated delta rule in chunks
    /// of 64 (`gdn_chunk_prep`, then `gdn_chunk_scan`; 0: never, token by token).
    pub gdn_chunk_min_run: u32,
    /// The chunked gated delta rule runs its products on tensor cores (`gdn_chunk_prep_tc`,
    /// `gdn_chunk_scan_tc`: bf16 operands, f32 accumulators, the solve and the carried state in
    /// f32; off: the CUDA-core f32 pair). Outputs within bf16 rounding of the f32 pair's.
    pub gdn_chunk_tensor_cores: bool,
    /// Shared-memory carveouts.
    pub carveout: Carveout,
    /// GEMV launches of these labels take at most this many blocks.
    pub grid_caps: Vec<(&'static str, u32)>,
}

impl Tuning {
    /// The plain path on `hardware`: the library GEMM for every product, no fusion, no stream,
    /// no fold, separate launches, the driver's carveouts, graphs on. (`fp8_fused_quantize` is
    /// on: it takes effect only with `fp8_gemm`, which is off, and changes no bits.)
    pub fn plain(hardware: HardwareSchedule) -> Tuning {
        Tuning {
            hardware,
            graphs: true,
            decode_ahead: 0,
            gemv_max_rows: 0,
            gemm_wide_k: u32::MAX,
            gemm_wide_k_max_gemv_rows: 0,
            gemv_stage: GemvPolicy::Off,
            gemv_norm: GemvPolicy::Off,
            gemv_grid_cap: 0,
            gemv_grid_mode: GemvGridMode::default(),
            gemv_stream: Vec::new(),
            gemv_stream_min_weights: 0,
            gemv_stream_prewait: GEMV_STREAM_STAGES,
            gemv_stream_evict: true,
            gemv_stream_norm: false,
            gemv_fp8_stream: false,
            gemv_fp8_mma_min_rows: u32::MAX,
            fp8_gemm: false,
            fp8_fused_quantize: true,
            fused_swiglu: false,
            fused_qkv_attention: false,
            prefill_attention: PrefillVersion::V1,
            attention_target_blocks: hardware.sm_count * hardware.attention_blocks_per_sm,
            attention_split_keys: ATTENTION_SPLIT_KEYS,
            attention_unsplit_keys: 0,
            attention_wide_blocks: 0,
            embedding_vec: false,
            moe_grouped_min_rows: u32::MAX,
            moe_fp8_experts: false,
            moe_tensor_core_min_rows: 0,
            moe_grouped_mma: false,
            moe_fused_router: false,
            moe_fused_shared_expert: false,
            ssd_chunk_min_run: 0,
            gdn_chunk_min_run: 0,
            gdn_chunk_tensor_cores: false,
            carveout: Carveout::Driver,
            grid_caps: Vec::new(),
        }
    }

    /// The target's schedule: [`Tuning::plain`] on its class, then its kernel tree's `[tuning]`
    /// values. A value the engine does not take is an error naming the key (the build checks
    /// only that the tables parse).
    pub fn for_target(target: &TargetKernels) -> Result<Tuning, TuningError> {
        let mut t = Tuning::plain(target.schedule);
        for &(key, value) in target.tuning {
            t.set(key, value)?;
        }
        Ok(t)
    }

    /// The Hopper class's schedule (its `HARDWARE.toml` `[tuning]`, no leaf's): what a backend
    /// without a resolved target runs, since every kernel of this tree is Hopper's.
    pub fn hopper() -> Result<Tuning, TuningError> {
        let mut t = Tuning::plain(HardwareSchedule::HOPPER);
        for &(key, value) in metrale_kernels::hardware::hopper::TUNING {
            t.set(key, value)?;
        }
        Ok(t)
    }

    /// [`Tuning::for_target`] where a target resolved, else [`Tuning::hopper`].
    pub fn for_placement(target: Option<&TargetKernels>) -> Result<Tuning, TuningError> {
        target.map_or_else(Tuning::hopper, Tuning::for_target)
    }

    /// The GEMV blocks resident at once on the class.
    pub fn resident_gemv_blocks(&self) -> u32 {
        self.hardware.sm_count * self.hardware.gemv_blocks_per_sm
    }

    /// The operator switches of the environment: `METRALE_CUDA_GRAPHS=0` launches every kernel of
    /// a decode step instead of replaying a graph (`1`: replay). Unset leaves the value as it is;
    /// anything but `0` or `1` is an error.
    pub fn apply_operator_env(&mut self) -> Result<(), GpuError> {
        if let Some(on) = operator_switch("METRALE_CUDA_GRAPHS")? {
            self.graphs = on;
        }
        Ok(())
    }

    /// Sets one choice by name, as `key=value` text (`met bench-model --tune`, the kernel tree's
    /// `[tuning]` tables).
    pub fn set(&mut self, key: &str, value: &str) -> Result<(), TuningError> {
        let v = value.trim();
        let bad = |expected| TuningError::BadValue {
            key: key.to_string(),
            value: value.to_string(),
            expected,
        };
        let count = |v: &str| v.parse::<u32>().map_err(|_| bad("a non-negative integer"));
        let switch = |v: &str| match v {
            "0" | "false" | "off" => Ok(false),
            "1" | "true" | "on" => Ok(true),
            _ => Err(bad("true or false (1 or 0)")),
        };
        let policy = |v: &str| match v {
            "0" | "off" => Ok(GemvPolicy::Off),
            "small" => Ok(GemvPolicy::Small),
            "all" => Ok(GemvPolicy::All),
            _ => Err(bad("off, small or all")),
        };
        match key {
            "graphs" => self.graphs = switch(v)?,
            "decode_ahead" => self.decode_ahead = count(v)?.min(MAX_DECODE_AHEAD),
            "gemv_max_rows" => {
                self.gemv_max_rows = count(v)?.min(metrale_kernels::ops::GEMV_MAX_ROWS)
            }
            "gemm_wide_k" => self.gemm_wide_k = count(v)?,
            "gemm_wide_k_max_gemv_rows" => self.gemm_wide_k_max_gemv_rows = count(v)?,
            "gemv_stage" => self.gemv_stage = policy(v)?,
            "gemv_norm" => self.gemv_norm = policy(v)?,
            "gemv_grid_cap" => {
                self.gemv_grid_cap = match v {
                    "resident" => self.resident_gemv_blocks(),
                    _ => count(v).map_err(|_| bad("a block count, 0 (none) or `resident`"))?,
                }
            }
            "gemv_grid_mode" => {
                self.gemv_grid_mode =
                    GemvGridMode::parse(v).ok_or_else(|| bad("same, balanced or resplit"))?
            }
            "gemv_stream" => {
                self.gemv_stream = labels(v, &LINEAR_LABELS)
                    .ok_or_else(|| bad("product labels split by `+` or `,` (qkv, o, gate_up, down, lm_head, router, shared_gate_up, shared_down, shared_gate, attn_gate, up, gdn_in, gdn_out, mamba_in, mamba_out), or empty"))?
            }
            "gemv_stream_min_weights" => {
                self.gemv_stream_min_weights =
                    v.parse().map_err(|_| bad("a non-negative integer"))?
            }
            "gemv_stream_prewait" => self.gemv_stream_prewait = count(v)?.min(GEMV_STREAM_STAGES),
            "gemv_stream_evict" => self.gemv_stream_evict = switch(v)?,
            "gemv_stream_norm" => self.gemv_stream_norm = switch(v)?,
            "gemv_fp8_stream" => self.gemv_fp8_stream = switch(v)?,
            "gemv_fp8_mma_min_rows" => {
                self.gemv_fp8_mma_min_rows = match v {
                    "off" => u32::MAX,
                    v => count(v)?,
                }
            }
            "fp8_gemm" => self.fp8_gemm = switch(v)?,
            "fp8_fused_quantize" => self.fp8_fused_quantize = switch(v)?,
            "fused_swiglu" => self.fused_swiglu = switch(v)?,
            "fused_qkv_attention" => self.fused_qkv_attention = switch(v)?,
            "prefill_attention" => {
                self.prefill_attention = match v {
                    "v1" => PrefillVersion::V1,
                    "v2" => PrefillVersion::V2,
                    "v3" => PrefillVersion::V3,
                    _ => return Err(bad("v1, v2 or v3")),
                }
            }
            "attention_target_blocks" => self.attention_target_blocks = count(v)?.max(1),
            "attention_split_keys" => self.attention_split_keys = count(v)?,
            "attention_unsplit_keys" => self.attention_unsplit_keys = count(v)?,
            "attention_wide_blocks" => self.attention_wide_blocks = count(v)?,
            "embedding_vec" => self.embedding_vec = switch(v)?,
            "moe_grouped_min_rows" => self.moe_grouped_min_rows = count(v)?,
            "moe_fp8_experts" => self.moe_fp8_experts = switch(v)?,
            "moe_tensor_core_min_rows" => self.moe_tensor_core_min_rows = count(v)?,
            "moe_grouped_mma" => self.moe_grouped_mma = switch(v)?,
            "moe_fused_router" => self.moe_fused_router = switch(v)?,
            "moe_fused_shared_expert" => self.moe_fused_shared_expert = switch(v)?,
            "ssd_chunk_min_run" => self.ssd_chunk_min_run = count(v)?,
            "gdn_chunk_min_run" => self.gdn_chunk_min_run = count(v)?,
            "gdn_chunk_tensor_cores" => self.gdn_chunk_tensor_cores = switch(v)?,
            "carveout" => {
                self.carveout = match v {
                    "rule" => Carveout::Rule,
                    "driver" | "" => Carveout::Driver,
                    _ => Carveout::Labels(
                        label_values(v, &LAUNCH_LABELS, |p| p.parse::<u8>().ok().filter(|&p| p <= 100))
                            .ok_or_else(|| bad("`rule`, `driver`, or label=percent pairs split by `+` or `,` (percent 0 to 100)"))?,
                    ),
                }
            }
            "grid_caps" => {
                self.grid_caps =
                    label_values(v, &LINEAR_LABELS, |b| b.parse::<u32>().ok().filter(|&b| b >= 1))
                        .ok_or_else(|| bad("label=blocks pairs split by `+` or `,` (blocks at least 1; labels as gemv_stream's)"))?
            }
            _ => {
                return Err(TuningError::UnknownKey {
                    key: key.to_string(),
                });
            }
        }
        Ok(())
    }

    /// [`Tuning::set`] of a `key=value` pair.
    pub fn set_pair(&mut self, pair: &str) -> Result<(), TuningError> {
        let (key, value) = pair.split_once('=').ok_or_else(|| TuningError::BadValue {
            key: pair.to_string(),
            value: String::new(),
            expected: "key=value",
        })?;
        self.set(key.trim(), value)
    }
}

/// Labels of `known` split by `+` or `,`; empty text: none.
fn labels(v: &str, known: &[&'static str]) -> Option<Vec<&'static str>> {
    v.split([',', '+'])
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .map(|l| known.iter().copied().find(|k| *k == l))
        .collect()
}

/// `label=value` pairs split by `+` or `,`, each label one of `known` and each value one `value`
/// takes; empty text: none.
fn label_values<T>(
    v: &str,
    known: &[&'static str],
    value: impl Fn(&str) -> Option<T>,
) -> Option<Vec<(&'static str, T)>> {
    v.split([',', '+'])
        .map(str::trim)
        .filter(|pair| !pair.is_empty())
        .map(|pair| {
            let (label, x) = pair.split_once('=')?;
            let label = known.iter().copied().find(|k| *k == label.trim())?;
            Some((label, value(x.trim())?))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plain() -> Tuning {
        Tuning::plain(HardwareSchedule {
            sm_count: 10,
            gemv_blocks_per_sm: 3,
            attention_blocks_per_sm: 2,
        })
    }

    #[test]
    fn every_key_is_taken_and_unknown_ones_are_named() {
        let values = [
            ("graphs", "0"),
            ("decode_ahead", "2"),
            ("gemv_max_rows", "8"),
            ("gemm_wide_k", "4096"),
            ("gemm_wide_k_max_gemv_rows", "4"),
            ("gemv_stage", "small"),
            ("gemv_norm", "all"),
            ("gemv_grid_cap", "resident"),
            ("gemv_grid_mode", "balanced"),
            ("gemv_stream", "qkv+o"),
            ("gemv_stream_min_weights", "8388608"),
            ("gemv_stream_prewait", "2"),
            ("gemv_stream_evict", "false"),
            ("gemv_stream_norm", "true"),
            ("gemv_fp8_stream", "on"),
            ("gemv_fp8_mma_min_rows", "2"),
            ("fp8_gemm", "on"),
            ("fp8_fused_quantize", "off"),
            ("fused_swiglu", "1"),
            ("fused_qkv_attention", "on"),
            ("prefill_attention", "v2"),
            ("attention_target_blocks", "99"),
            ("attention_split_keys", "128"),
            ("attention_unsplit_keys", "512"),
            ("attention_wide_blocks", "16"),
            ("embedding_vec", "1"),
            ("moe_grouped_min_rows", "16"),
            ("moe_fp8_experts", "on"),
            ("moe_tensor_core_min_rows", "256"),
            ("moe_grouped_mma", "on"),
            ("moe_fused_router", "on"),
            ("moe_fused_shared_expert", "on"),
            ("ssd_chunk_min_run", "128"),
            ("gdn_chunk_min_run", "256"),
            ("gdn_chunk_tensor_cores", "on"),
            ("carveout", "qkv=100+o=50"),
            ("grid_caps", "qkv=132"),
        ];
        assert_eq!(values.map(|(k, _)| k), KEYS);
        let mut t = plain();
        for (k, v) in values {
            let before = t.clone();
            t.set(k, v).unwrap_or_else(|e| panic!("{k}={v}: {e}"));
            assert_ne!(t, before, "{k}={v} changed nothing");
        }
        assert_eq!(t.gemv_grid_cap, 30);
        assert_eq!(t.gemv_stream, ["qkv", "o"]);
        assert_eq!(t.carveout, Carveout::Labels(vec![("qkv", 100), ("o", 50)]));
        let err = t.set("gemv_strem", "qkv").unwrap_err().to_string();
        assert!(
            err.starts_with("unknown tuning key `gemv_strem`; the keys are graphs, "),
            "{err}"
        );
    }

    #[test]
    fn bad_values_say_what_the_key_takes() {
        let mut t = plain();
        for (k, v, expected) in [
            ("gemv_stage", "yes", "off, small or all"),
            ("prefill_attention", "v9", "v1, v2 or v3"),
            ("decode_ahead", "-1", "a non-negative integer"),
            ("graphs", "maybe", "true or false (1 or 0)"),
        ] {
            let err = t.set(k, v).unwrap_err();
            assert_eq!(err.to_string(), format!("{k}={v}: expected {expected}"));
        }
        for bad in ["attention", "down=1", "Down"] {
            assert!(t.set("gemv_stream", bad).is_err(), "{bad}");
        }
        for bad in ["qkv", "qkv=101", "mlp=50", "=50"] {
            assert!(t.set("carveout", bad).is_err(), "{bad}");
        }
        for bad in ["qkv=0", "attention=8", "o"] {
            assert!(t.set("grid_caps", bad).is_err(), "{bad}");
        }
        assert!(t.set_pair("gemv_stage").is_err());
        // A refused value changes nothing.
        assert_eq!(t, plain());
    }

    #[test]
    fn counts_are_clamped_where_the_kernels_bound_them() {
        let mut t = plain();
        t.set("decode_ahead", "100").unwrap();
        assert_eq!(t.decode_ahead, MAX_DECODE_AHEAD);
        t.set("gemv_max_rows", "100").unwrap();
        assert_eq!(t.gemv_max_rows, metrale_kernels::ops::GEMV_MAX_ROWS);
        t.set_pair("gemv_stream_prewait = 9").unwrap();
        assert_eq!(t.gemv_stream_prewait, GEMV_STREAM_STAGES);
    }

    #[test]
    fn the_hopper_class_tuning_is_taken_whole() {
        let t = Tuning::hopper().unwrap();
        assert_eq!(t.hardware, HardwareSchedule::HOPPER);
        // Not the plain path: the tree names the measured forms.
        assert!(t.fused_swiglu && t.gemv_max_rows > 0);
        assert_eq!(t.carveout, Carveout::Rule);
    }

    #[test]
    fn the_kernel_trees_tuning_applies_to_every_embedded_target() {
        // Every embedded target's [tuning] values are ones the engine takes (METRALE_SKIP_BUILD
        // builds embed none).
        for target in metrale_kernels::TARGETS {
            let t = Tuning::for_target(target).unwrap_or_else(|e| panic!("{}: {e}", target.target));
            assert_eq!(t.hardware, target.schedule);
        }
    }
}
