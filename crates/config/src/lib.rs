// SPDX-License-Identifier: MIT OR Apache-2.0
//! The typed model config: the single source of truth for a checkpoint's shape.
//!
//! The central decision: **parse once, refuse what is not understood.** A `config.json` or a GGUF
//! header becomes one [`ModelConfig`]; every later stage (weight shapes, KV sizing, kernel target
//! choice) reads that struct and nothing re-parses the file. An unknown `model_type`, or a key that
//! changes the architecture in a way the engine does not implement (a non-SiLU activation, sliding
//! windows, an unknown RoPE scaling), is an error naming the key, never silently ignored.
//!
//! No I/O: callers hand in the JSON text or the GGUF metadata map.
#![forbid(unsafe_code)]

mod gguf;
mod hf;
mod hybrid;
mod presets;

pub use gguf::{MetaValue, from_gguf_metadata};
pub use hf::from_config_json;
pub use hybrid::{
    Ffn, GatedDeltaNetConfig, GdnProjection, HybridConfig, HybridLayer, Mamba2Config, Mixer,
    MlpActivation,
};
pub use presets::{ModelBehavior, ModelPresets, SamplingPresets, presets};

/// The model families the engine runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ModelFamily {
    /// Llama 2/3.x and Llama-architecture models (SmolLM2, ...).
    Llama,
    /// Seed-OSS (seed_oss: Seed-OSS-36B): Llama's decoder with q, k and v biases.
    SeedOss,
    /// Phi-3 / Phi-4 (phi3): Llama's decoder with q|k|v stored as one `qkv_proj` and gate|up as
    /// one `gate_up_proj`, RoPE on a fraction of each head where the config says.
    Phi3,
    /// SmolLM3: Llama's decoder with no position encoding in the attention of the layers
    /// `no_rope_layers` marks 0 (every fourth by default).
    SmolLm3,
    /// Granite (Granite-3.x dense): Llama's decoder with constant multipliers on the embedding,
    /// the blocks' outputs, the attention scores and the logits ([`Multipliers`]).
    Granite,
    /// Mistral (Mistral-7B-v0.3, Mistral-Nemo, Mistral-Small): Llama's decoder, with a sliding
    /// window when its config sets one (refused: not implemented).
    Mistral,
    /// Qwen2 / Qwen2.5: QKV bias.
    Qwen2,
    /// Qwen3 dense: QK-norm, no QKV bias.
    Qwen3,
    /// Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention, sparse MLPs with a softmax
    /// router and a shared expert behind a sigmoid gate.
    Qwen2Moe,
    /// Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention, sparse MLPs with a softmax
    /// router.
    Qwen3Moe,
    /// Mixtral (Mixtral-8x7B, Mixtral-8x22B): Llama's attention, sparse MLPs in every layer with a
    /// softmax router whose top k is renormalised.
    Mixtral,
    /// OLMoE (OLMoE-1B-7B): Llama's attention with q and k RMS-normalised over their whole
    /// projections, sparse MLPs in every layer with a softmax router.
    Olmoe,
    /// GLM-4.5 (GLM-4.5, GLM-4.5-Air): q, k and v with biases, RoPE on half of each head, per-head
    /// QK-norm where `use_qk_norm` says, dense MLPs in the first `first_k_dense_replace` layers and
    /// sparse ones after, with DeepSeek-V3's sigmoid router (a correction bias, renormalised,
    /// scaled) and an ungated shared expert.
    Glm4Moe,
    /// MiniMax-M2: q and k RMS-normalised over their whole projections, partial RoPE, sparse MLPs
    /// in every layer with a sigmoid router and a per-expert correction bias.
    MiniMaxM2,
    /// Qwen3-Next (Qwen3-Next-80B-A3B): three Gated DeltaNet layers to one gated full-attention
    /// layer (partial RoPE, QK-norm, an output gate), sparse MLPs with a softmax router and a
    /// shared expert behind a sigmoid gate, norms scaling by `1 + weight`.
    Qwen3Next,
    /// Qwen3.5 MoE's text model (Qwen3.5-35B-A3B): Qwen3-Next's layers with the Gated DeltaNet
    /// projections stored split instead of grouped, every MLP sparse, and the config nested
    /// under `text_config` beside the vision tower's.
    Qwen35Moe,
    /// Granite-3.x MoE (granitemoe: Granite-3.1-1B-A400M, 3B-A800M; granitemoeshared, the same
    /// with a shared MLP): Llama's attention, experts in every layer (the top k of the router's
    /// logits weighted by their softmax), Granite's multipliers.
    GraniteMoe,
    /// Granite 4.0 (Granite-4.0-H-Small / -Tiny / -Micro, and the attention-only Granite-4.0-Micro):
    /// Mamba-2 or attention (RoPE or none) then an MLP in every layer: experts with an ungated
    /// shared expert, or the shared MLP alone; Granite's multipliers.
    GraniteMoeHybrid,
    /// Nemotron-H: one block per layer from `hybrid_override_pattern`: Mamba-2, attention
    /// without position encoding, squared-ReLU MLPs or experts.
    NemotronH,
}

impl ModelFamily {
    /// The HF `model_type` string.
    pub fn model_type(self) -> &'static str {
        match self {
            ModelFamily::Llama => "llama",
            ModelFamily::Mistral => "mistral",
            ModelFamily::Granite => "granite",
            ModelFamily::SmolLm3 => "smollm3",
            ModelFamily::Phi3 => "phi3",
            ModelFamily::SeedOss => "seed_oss",
            ModelFamily::Qwen2 => "qwen2",
            ModelFamily::Qwen3 => "qwen3",
            ModelFamily::Qwen2Moe => "qwen2_moe",
            ModelFamily::Qwen3Moe => "qwen3_moe",
            ModelFamily::Mixtral => "mixtral",
            ModelFamily::Olmoe => "olmoe",
            ModelFamily::Glm4Moe => "glm4_moe",
            ModelFamily::MiniMaxM2 => "minimax_m2",
            ModelFamily::Qwen3Next => "qwen3_next",
            ModelFamily::Qwen35Moe => "qwen3_5_moe",
            ModelFamily::GraniteMoe => "granitemoe",
            ModelFamily::GraniteMoeHybrid => "granitemoehybrid",
            ModelFamily::NemotronH => "nemotron_h",
        }
    }

    /// Every supported family, for messages.
    pub const ALL: [ModelFamily; 19] = [
        ModelFamily::Llama,
        ModelFamily::Mistral,
        ModelFamily::Granite,
        ModelFamily::SmolLm3,
        ModelFamily::Phi3,
        ModelFamily::SeedOss,
        ModelFamily::Qwen2,
        ModelFamily::Qwen3,
        ModelFamily::Qwen2Moe,
        ModelFamily::Qwen3Moe,
        ModelFamily::Mixtral,
        ModelFamily::Olmoe,
        ModelFamily::Glm4Moe,
        ModelFamily::MiniMaxM2,
        ModelFamily::Qwen3Next,
        ModelFamily::Qwen35Moe,
        ModelFamily::GraniteMoe,
        ModelFamily::GraniteMoeHybrid,
        ModelFamily::NemotronH,
    ];

    /// Whether some layers mix tokens by a recurrence ([`ModelConfig::hybrid`] is set).
    pub fn hybrid(self) -> bool {
        matches!(
            self,
            ModelFamily::Qwen3Next
                | ModelFamily::Qwen35Moe
                | ModelFamily::GraniteMoeHybrid
                | ModelFamily::NemotronH
        )
    }

    /// q|k|v and gate|up are stored fused (`qkv_proj`, `gate_up_proj`: Phi-3), in the order the
    /// engine stacks them.
    pub fn fused_projections(self) -> bool {
        self == ModelFamily::Phi3
    }

    /// The q, k and v products carry biases whatever the config says (the Qwen2 attention; other
    /// families by their `attention_bias`).
    pub fn qkv_bias(self) -> bool {
        matches!(self, ModelFamily::Qwen2 | ModelFamily::Qwen2Moe)
    }

    /// How q and k are RMS-normalised before RoPE: per head (the Qwen3 attention), over the
    /// whole projection (MiniMax-M2), or not at all.
    pub fn qk_norm(self) -> QkNorm {
        match self {
            ModelFamily::Qwen3
            | ModelFamily::Qwen3Moe
            | ModelFamily::Qwen3Next
            | ModelFamily::Qwen35Moe => QkNorm::PerHead,
            ModelFamily::MiniMaxM2 | ModelFamily::Olmoe => QkNorm::Whole,
            ModelFamily::Llama
            | ModelFamily::Mistral
            | ModelFamily::Granite
            | ModelFamily::SmolLm3
            | ModelFamily::Phi3
            | ModelFamily::SeedOss
            | ModelFamily::Qwen2
            | ModelFamily::Qwen2Moe
            | ModelFamily::Mixtral
            | ModelFamily::GraniteMoe
            | ModelFamily::GraniteMoeHybrid
            | ModelFamily::NemotronH => QkNorm::None,
            // Per head where the config's `use_qk_norm` says (GLM-4.5), else none.
            ModelFamily::Glm4Moe => QkNorm::None,
        }
    }

    /// The dense family whose attention and weight names this one shares.
    pub fn dense(self) -> ModelFamily {
        match self {
            ModelFamily::Qwen2Moe => ModelFamily::Qwen2,
            ModelFamily::Qwen3Moe => ModelFamily::Qwen3,
            ModelFamily::Mixtral | ModelFamily::Mistral => ModelFamily::Llama,
            other => other,
        }
    }

    fn parse(model_type: &str) -> Result<Self, ConfigError> {
        // granitemoeshared is granitemoe with its shared MLP (`shared_intermediate_size`).
        if model_type == "granitemoeshared" {
            return Ok(ModelFamily::GraniteMoe);
        }
        ModelFamily::ALL
            .into_iter()
            .find(|f| f.model_type() == model_type)
            .ok_or_else(|| ConfigError::UnknownModelType {
                model_type: model_type.to_string(),
            })
    }
}

/// The RMSNorm of q and k between their projection and RoPE.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum QkNorm {
    /// None (Llama, Qwen2).
    None,
    /// Each head on its own, one weight of `head_dim` shared by every head (Qwen3).
    PerHead,
    /// The whole q projection (`heads * head_dim`) and the whole k projection
    /// (`kv_heads * head_dim`), each with its own weight of that width (MiniMax-M2, OLMoE).
    Whole,
}

impl QkNorm {
    /// Whether q and k are normalised at all.
    pub fn any(self) -> bool {
        self != QkNorm::None
    }
}

/// RoPE frequency scaling.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum RopeScaling {
    /// Plain RoPE.
    None,
    /// Llama 3.1's piecewise frequency scaling.
    Llama3 {
        /// Scale applied to low frequencies.
        factor: f32,
        /// Wavelength threshold (as a fraction of the original context) below which frequencies are scaled.
        low_freq_factor: f32,
        /// Wavelength threshold above which frequencies are kept.
        high_freq_factor: f32,
        /// Context length the model was pre-trained with.
        original_max_position_embeddings: u32,
    },
    /// Positions divided by `factor`.
    Linear {
        /// The divisor.
        factor: f32,
    },
    /// YaRN: frequencies that turn fewer than `beta_slow` times over the original context are
    /// divided by `factor`, those that turn more than `beta_fast` times are kept, a linear ramp
    /// between; cos and sin are scaled by `attention_factor` (Qwen2.5 / Qwen3 past their native
    /// context, DeepSeek).
    Yarn {
        /// The context extension.
        factor: f32,
        /// The context the model was pre-trained with.
        original_max_position_embeddings: u32,
        /// Rotations over the original context above which a frequency is kept.
        beta_fast: f32,
        /// Rotations below which it is divided by `factor`.
        beta_slow: f32,
        /// cos and sin are multiplied by this (0.1 ln(factor) + 1 unless the config says).
        attention_factor: f32,
        /// The ramp's ends rounded outward to whole dimensions.
        truncate: bool,
    },
}

/// How a sparse MLP's router turns its logits into expert weights.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum RouterKind {
    /// `softmax(logits)` over every expert, then the top k (Qwen2-MoE, Qwen3-MoE, Mixtral, OLMoE).
    Softmax,
    /// `sigmoid(logits)`; the top k of `scores + correction_bias` chosen, weighted by the unbiased
    /// scores (MiniMax-M2, DeepSeek-V3).
    SigmoidBias,
}

/// A Mixture-of-Experts MLP's shape and routing.
#[derive(Clone, Debug, PartialEq)]
pub struct MoeConfig {
    /// Routed experts.
    pub num_experts: usize,
    /// Experts each token takes.
    pub top_k: usize,
    /// Each expert's gate and up width.
    pub expert_intermediate: usize,
    /// The top k weights are renormalised to sum to 1.
    pub norm_topk_prob: bool,
    /// How scores are made.
    pub router: RouterKind,
    /// Routed weights are multiplied by this.
    pub routed_scaling: f32,
    /// Width of the shared expert every token takes beside the routed ones (Qwen2-MoE, Qwen3-Next:
    /// behind a sigmoid gate; Nemotron-H: ungated, [`MlpActivation::Relu2`]), if any.
    pub shared_expert_intermediate: Option<usize>,
    /// The shared expert's output is scaled by `sigmoid(x · g)` (Qwen2-MoE, Qwen3-Next); else
    /// it is added as it is (Nemotron-H, GLM-4.5).
    pub shared_expert_gated: bool,
    /// Every `sparse_step`-th layer is sparse (`decoder_sparse_step`)...
    pub sparse_step: usize,
    /// ...except these, which stay dense (`mlp_only_layers`).
    pub mlp_only_layers: Vec<usize>,
}

impl MoeConfig {
    /// Whether layer `l`'s MLP is the sparse one (else dense, of `intermediate_size`).
    pub fn is_sparse(&self, l: usize) -> bool {
        !self.mlp_only_layers.contains(&l) && (l + 1).is_multiple_of(self.sparse_step.max(1))
    }
}

/// A checkpoint's shape and numerics, whatever file it came from.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    /// The family (and so the parameter point of the generic decoder).
    pub family: ModelFamily,
    /// Residual stream width.
    pub hidden_size: usize,
    /// MLP inner width.
    pub intermediate_size: usize,
    /// Decoder layers.
    pub num_layers: usize,
    /// Query heads.
    pub num_heads: usize,
    /// Key/value heads (grouped-query attention when fewer than `num_heads`).
    pub num_kv_heads: usize,
    /// Elements per head; may differ from `hidden_size / num_heads` (Qwen3).
    pub head_dim: usize,
    /// Vocabulary size (rows of the embedding).
    pub vocab_size: usize,
    /// Longest context the model supports.
    pub max_position_embeddings: usize,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f32,
    /// RoPE base.
    pub rope_theta: f32,
    /// RoPE scaling.
    pub rope_scaling: RopeScaling,
    /// Whether the LM head reuses the embedding matrix.
    pub tie_word_embeddings: bool,
    /// Whether q/k/v projections have a bias (Qwen2).
    pub attention_bias: bool,
    /// How q and k are RMS-normalised before RoPE.
    pub qk_norm: QkNorm,
    /// The leading elements of each head that RoPE rotates (even, at most `head_dim`; the rest
    /// pass unrotated): `head_dim` but for partial rotary (MiniMax-M2: 64 of 128).
    pub rotary_dim: usize,
    /// Beginning-of-sequence token, if the config names one.
    pub bos_token_id: Option<u32>,
    /// End-of-sequence tokens.
    pub eos_token_ids: Vec<u32>,
    /// The sparse MLPs, for a Mixture-of-Experts model.
    pub moe: Option<MoeConfig>,
    /// The layer pattern and the recurrent mixers' shapes, for a hybrid model (`None`: every
    /// layer is attention then an MLP).
    pub hybrid: Option<HybridConfig>,
    /// Granite's scalings of the embedding, the blocks' outputs, the attention scores and the
    /// logits (all 1, and the scores by `1 / sqrt(head_dim)`, for every other family).
    pub multipliers: Multipliers,
    /// Layers whose attention applies no RoPE (SmolLM3's `no_rope_layers` zeros); empty for
    /// every other family.
    pub nope_layers: Vec<usize>,
}

/// Constant scalings a family applies around its blocks (Granite's `embedding_multiplier`,
/// `residual_multiplier`, `attention_multiplier`, `logits_scaling`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Multipliers {
    /// The embedding rows are multiplied by this.
    pub embedding: f32,
    /// Each block's output is multiplied by this before it is added to the residual stream.
    pub residual: f32,
    /// The attention scores' scale, in place of `1 / sqrt(head_dim)`.
    pub attention: Option<f32>,
    /// The logits are divided by this.
    pub logits: f32,
}

impl Default for Multipliers {
    fn default() -> Self {
        Multipliers {
            embedding: 1.0,
            residual: 1.0,
            attention: None,
            logits: 1.0,
        }
    }
}

impl Multipliers {
    /// Whether the weights upload as the checkpoint stores them (only the attention scale, a
    /// kernel argument, may differ).
    pub fn weights_unscaled(&self) -> bool {
        self.embedding == 1.0 && self.residual == 1.0 && self.logits == 1.0
    }
}

impl ModelConfig {
    /// Checks the invariants every later stage relies on.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |key: &'static str, message: String| Err(ConfigError::Invalid { key, message });
        for (key, v) in [
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_layers),
            ("num_attention_heads", self.num_heads),
            ("num_key_value_heads", self.num_kv_heads),
            ("head_dim", self.head_dim),
            ("vocab_size", self.vocab_size),
            ("max_position_embeddings", self.max_position_embeddings),
        ] {
            if v == 0 {
                return bad(key, "must be positive".into());
            }
        }
        if !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return bad(
                "num_key_value_heads",
                format!(
                    "{} does not divide num_attention_heads {}",
                    self.num_kv_heads, self.num_heads
                ),
            );
        }
        if !self.head_dim.is_multiple_of(2) || self.head_dim > 256 {
            return bad(
                "head_dim",
                format!("{} is not an even number up to 256", self.head_dim),
            );
        }
        if self.rotary_dim == 0
            || !self.rotary_dim.is_multiple_of(2)
            || self.rotary_dim > self.head_dim
        {
            return bad(
                "rotary_dim",
                format!(
                    "{} is not a positive even number up to head_dim {}",
                    self.rotary_dim, self.head_dim
                ),
            );
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps > 0.0) {
            return bad(
                "rms_norm_eps",
                format!("{} is not a positive number", self.rms_norm_eps),
            );
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 0.0) {
            return bad(
                "rope_theta",
                format!("{} is not a positive number", self.rope_theta),
            );
        }
        if let Some(m) = &self.moe {
            if m.num_experts == 0 || m.expert_intermediate == 0 {
                return bad(
                    "num_experts",
                    "experts and their width must be positive".into(),
                );
            }
            if m.top_k == 0 || m.top_k > m.num_experts {
                return bad(
                    "num_experts_per_tok",
                    format!(
                        "{} is not between 1 and num_experts {}",
                        m.top_k, m.num_experts
                    ),
                );
            }
            if m.sparse_step == 0 {
                return bad("decoder_sparse_step", "must be positive".into());
            }
            if !(m.routed_scaling.is_finite() && m.routed_scaling > 0.0) {
                return bad(
                    "routed_scaling_factor",
                    format!("{} is not a positive number", m.routed_scaling),
                );
            }
        }
        Ok(())
    }

    /// Parameters, counting a tied LM head once.
    pub fn parameter_count(&self) -> u64 {
        if let Some(hybrid) = &self.hybrid {
            return hybrid::parameter_count(self, hybrid);
        }
        let (h, i, v) = (
            self.hidden_size as u64,
            self.intermediate_size as u64,
            self.vocab_size as u64,
        );
        let (q, kv) = (
            (self.num_heads * self.head_dim) as u64,
            (self.num_kv_heads * self.head_dim) as u64,
        );
        let attn = h * q + 2 * h * kv + q * h + if self.attention_bias { q + 2 * kv } else { 0 };
        let norms = 2 * h
            + match self.qk_norm {
                QkNorm::None => 0,
                QkNorm::PerHead => 2 * self.head_dim as u64,
                QkNorm::Whole => q + kv,
            };
        let dense = 3 * h * i;
        let mlps: u64 = (0..self.num_layers)
            .map(|l| match &self.moe {
                Some(m) if m.is_sparse(l) => {
                    let routed = m.num_experts as u64 * 3 * h * m.expert_intermediate as u64;
                    let shared = m.shared_expert_intermediate.map_or(0, |s| {
                        3 * h * s as u64 + if m.shared_expert_gated { h } else { 0 }
                    });
                    let bias = match m.router {
                        RouterKind::SigmoidBias => m.num_experts as u64,
                        RouterKind::Softmax => 0,
                    };
                    routed + shared + m.num_experts as u64 * h + bias
                }
                _ => dense,
            })
            .sum();
        let layers = self.num_layers as u64 * (attn + norms) + mlps;
        v * h * if self.tie_word_embeddings { 1 } else { 2 } + layers + h
    }
}

/// Why a config was refused.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file is not JSON or a field has the wrong type.
    #[error("invalid config: {0}")]
    Syntax(String),
    /// A required key is absent.
    #[error("config is missing `{0}`")]
    Missing(&'static str),
    /// The model type is not one the engine runs.
    #[error(
        "unsupported model_type `{model_type}`; supported: llama, qwen2, qwen3, qwen2_moe, qwen3_moe, minimax_m2, qwen3_next, qwen3_5_moe, nemotron_h"
    )]
    UnknownModelType {
        /// What the config says.
        model_type: String,
    },
    /// A key changes the architecture in a way the engine does not implement.
    #[error("unsupported config `{key}` = {value}: {why}")]
    Unsupported {
        /// The key.
        key: String,
        /// Its value.
        value: String,
        /// What the engine would need.
        why: &'static str,
    },
    /// A value out of range.
    #[error("invalid config `{key}`: {message}")]
    Invalid {
        /// The key.
        key: &'static str,
        /// What is wrong.
        message: String,
    },
}
