// SPDX-License-Identifier: MIT OR Apache-2.0
//! Hybrid models: layers whose token mixer is a recurrence (Gated DeltaNet, Mamba-2) beside a few
//! full-attention layers, read from `config.json`.
//!
//! Two layouts exist. Qwen3-Next and Qwen3.5 keep the transformer's two blocks per layer and swap
//! the token mixer (`layer_types`, or one full-attention layer every `full_attention_interval`);
//! Nemotron-H gives each layer exactly one block, named by one character of
//! `hybrid_override_pattern` (`M` Mamba-2, `*` attention, `-` dense MLP, `E` mixture of experts).
//! [`HybridLayer`] holds either: an optional mixer and an optional feed-forward block.

use serde_json::{Map, Value};

use crate::ConfigError;
use crate::hf::{bool_of, get, opt_usize, unsupported, usize_of};

/// The token mixer of one layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Mixer {
    /// Softmax attention over the KV cache.
    Attention,
    /// Gated DeltaNet (the gated delta rule with a short causal conv in front).
    GatedDeltaNet,
    /// Mamba-2 (the SSD recurrence with a short causal conv in front).
    Mamba2,
}

/// The feed-forward block of one layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Ffn {
    /// The dense MLP of `intermediate_size`.
    Dense,
    /// The mixture of experts of [`crate::ModelConfig::moe`].
    Sparse,
}

/// What one layer of a hybrid model holds, in the order it runs them. At least one is present.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct HybridLayer {
    /// The token mixer, if the layer has one.
    pub mixer: Option<Mixer>,
    /// The feed-forward block, if the layer has one.
    pub ffn: Option<Ffn>,
}

/// How a Gated DeltaNet layer's input projections are laid out in the checkpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GdnProjection {
    /// Qwen3-Next: `in_proj_qkvz` and `in_proj_ba`, their rows grouped by key head (each group:
    /// q, k, then the v and z of the value heads sharing that key head; b then a likewise).
    GroupedQkvzBa,
    /// Qwen3.5: `in_proj_qkv` (all q, all k, all v), `in_proj_z`, `in_proj_b`, `in_proj_a`.
    SplitQkvZBA,
}

/// A Gated DeltaNet layer's shape (the `linear_*` keys).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GatedDeltaNetConfig {
    /// Query/key heads (`linear_num_key_heads`).
    pub key_heads: usize,
    /// Value heads (`linear_num_value_heads`), a multiple of the key heads; each value head owns
    /// one recurrent state and reads the q and k of key head `v / (value_heads / key_heads)`.
    pub value_heads: usize,
    /// Width of a query/key head (`linear_key_head_dim`).
    pub key_head_dim: usize,
    /// Width of a value head (`linear_value_head_dim`).
    pub value_head_dim: usize,
    /// Taps of the causal depthwise conv over q, k and v (`linear_conv_kernel_dim`).
    pub conv_kernel: usize,
    /// The checkpoint's projection layout.
    pub projection: GdnProjection,
}

impl GatedDeltaNetConfig {
    /// Channels through the short conv: q, k and v.
    pub fn conv_channels(&self) -> usize {
        2 * self.key_heads * self.key_head_dim + self.value_heads * self.value_head_dim
    }

    /// Bytes of one sequence's recurrent state in one layer: the f32 matrix state of every value
    /// head (`key_head_dim x value_head_dim`) and the conv's last `conv_kernel - 1` inputs of
    /// every channel, in `conv_bytes` each.
    pub fn state_bytes(&self, conv_bytes: usize) -> usize {
        self.value_heads * self.key_head_dim * self.value_head_dim * 4
            + self.conv_channels() * (self.conv_kernel - 1) * conv_bytes
    }
}

/// A Mamba-2 layer's shape.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Mamba2Config {
    /// SSM heads (`mamba_num_heads`); each has one scalar decay per token.
    pub heads: usize,
    /// Channels per head (`mamba_head_dim`); `heads * head_dim` is the inner width.
    pub head_dim: usize,
    /// State size per channel (`ssm_state_size`, N).
    pub state_size: usize,
    /// Groups sharing one B and one C (`n_groups`); also the gated RMSNorm's groups.
    pub groups: usize,
    /// Taps of the causal depthwise conv over x, B and C (`conv_kernel`).
    pub conv_kernel: usize,
    /// The conv has a bias (`use_conv_bias`).
    pub conv_bias: bool,
    /// The training chunk of the SSD scan (`chunk_size`): a prefill schedule, not the math.
    pub chunk_size: usize,
    /// `dt` after softplus is clamped to this range (`time_step_limit`).
    pub time_step_limit: (f32, f32),
}

impl Mamba2Config {
    /// Inner width: `heads * head_dim`.
    pub fn inner(&self) -> usize {
        self.heads * self.head_dim
    }

    /// Channels through the short conv: x, B and C.
    pub fn conv_channels(&self) -> usize {
        self.inner() + 2 * self.groups * self.state_size
    }

    /// Bytes of one sequence's recurrent state in one layer: the f32 SSM state
    /// (`heads x head_dim x state_size`) and the conv's last `conv_kernel - 1` inputs.
    pub fn state_bytes(&self, conv_bytes: usize) -> usize {
        self.inner() * self.state_size * 4
            + self.conv_channels() * (self.conv_kernel - 1) * conv_bytes
    }
}

/// The activation of every MLP (dense, routed experts, shared expert) of a hybrid model.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MlpActivation {
    /// `down(silu(x Wgate) * x Wup)` (Qwen3-Next, Qwen3.5).
    SwiGlu,
    /// `down(relu(x Wup)^2)`, no gate product; a MoE's shared expert is added ungated
    /// (Nemotron-H).
    Relu2,
}

/// What a hybrid model adds to [`crate::ModelConfig`].
#[derive(Clone, Debug, PartialEq)]
pub struct HybridConfig {
    /// One entry per layer.
    pub layers: Vec<HybridLayer>,
    /// The Gated DeltaNet layers' shape, if any layer has one.
    pub gated_delta_net: Option<GatedDeltaNetConfig>,
    /// The Mamba-2 layers' shape, if any layer has one.
    pub mamba2: Option<Mamba2Config>,
    /// The attention layers' q projection is twice as wide and its second half, through a
    /// sigmoid, gates the attention output per element before `o_proj` (Qwen3-Next, Qwen3.5).
    pub attention_output_gate: bool,
    /// The attention layers rotate q and k (Qwen3-Next: partial RoPE); Nemotron-H's attention
    /// has no position encoding at all (the Mamba-2 layers carry position).
    pub attention_rope: bool,
    /// Every RMSNorm of the residual stream, and the QK-norm, scales by `1 + weight` instead of
    /// `weight` (Qwen3-Next, Qwen3.5; not the gated norms inside the mixers).
    pub norm_unit_offset: bool,
    /// The MLPs' activation.
    pub mlp_activation: MlpActivation,
}

impl HybridConfig {
    /// Layers whose mixer carries recurrent state (Gated DeltaNet or Mamba-2).
    pub fn recurrent_layers(&self) -> usize {
        self.layers
            .iter()
            .filter(|l| matches!(l.mixer, Some(Mixer::GatedDeltaNet | Mixer::Mamba2)))
            .count()
    }

    /// Bytes of one sequence's recurrent state over every layer (the state slot's size), with
    /// the conv state in `conv_bytes` per element.
    pub fn state_bytes_per_sequence(&self, conv_bytes: usize) -> usize {
        self.layers
            .iter()
            .map(|l| match l.mixer {
                Some(Mixer::GatedDeltaNet) => self
                    .gated_delta_net
                    .map_or(0, |g| g.state_bytes(conv_bytes)),
                Some(Mixer::Mamba2) => self.mamba2.map_or(0, |m| m.state_bytes(conv_bytes)),
                _ => 0,
            })
            .sum()
    }
}

/// Granite 4.0's layer kinds: `layer_types` (or `layers_block_type`), each `mamba` /
/// `linear_attention` (a Mamba-2 mixer) or `attention` / `full_attention`; without it every layer
/// is Mamba-2, as transformers defaults it.
pub(crate) fn granite_layers(
    obj: &Map<String, Value>,
    num_layers: usize,
) -> Result<Vec<Mixer>, ConfigError> {
    let Some((key, types)) = ["layer_types", "layers_block_type"]
        .into_iter()
        .find_map(|k| obj.get(k).filter(|v| !v.is_null()).map(|v| (k, v)))
    else {
        return Ok(vec![Mixer::Mamba2; num_layers]);
    };
    layer_kinds(key, types, num_layers, |t| match t {
        "mamba" | "linear_attention" => Some(Mixer::Mamba2),
        "attention" | "full_attention" => Some(Mixer::Attention),
        _ => None,
    })
    .map_err(|bad| {
        unsupported(
            key,
            &bad,
            "Granite layers are mamba (linear_attention) or attention (full_attention)",
        )
    })?
}

/// A `layer_types`-style list under `key`: one kind a layer, each read by `kind`. The outer
/// error is a malformed list; the inner one the first entry `kind` does not know.
fn layer_kinds(
    key: &'static str,
    types: &Value,
    num_layers: usize,
    kind: impl Fn(&str) -> Option<Mixer>,
) -> Result<Result<Vec<Mixer>, ConfigError>, Value> {
    let list = match types.as_array() {
        Some(list) => list,
        None => {
            return Ok(Err(ConfigError::Invalid {
                key,
                message: format!("expected a list of layer kinds, got {types}"),
            }));
        }
    };
    if list.len() != num_layers {
        return Ok(Err(ConfigError::Invalid {
            key,
            message: format!("{} entries for num_hidden_layers {num_layers}", list.len()),
        }));
    }
    list.iter()
        .map(|t| t.as_str().and_then(&kind).ok_or_else(|| t.clone()))
        .collect::<Result<Vec<_>, _>>()
        .map(Ok)
}

/// Granite 4.0's Mamba-2 mixer, from its `mamba_*` keys (`mamba_d_head` "auto": the inner width
/// `mamba_expand * hidden_size` over the heads). Its gated RMSNorm spans the whole inner width,
/// which the kernels' group-wise norm equals only with one group: more are refused.
pub(crate) fn granite_mamba2(obj: &Map<String, Value>) -> Result<Mamba2Config, ConfigError> {
    let heads = usize_of(obj, "mamba_n_heads")?;
    let head_dim = match obj.get("mamba_d_head") {
        None | Some(Value::Null) => None,
        Some(v) if v.as_str() == Some("auto") => None,
        Some(_) => Some(usize_of(obj, "mamba_d_head")?),
    };
    let head_dim = match head_dim {
        Some(d) => d,
        None => {
            let inner =
                opt_usize(obj, "mamba_expand")?.unwrap_or(2) * usize_of(obj, "hidden_size")?;
            if heads == 0 || !inner.is_multiple_of(heads) {
                return Err(ConfigError::Invalid {
                    key: "mamba_n_heads",
                    message: format!("{heads} does not divide the inner width {inner}"),
                });
            }
            inner / heads
        }
    };
    let groups = opt_usize(obj, "mamba_n_groups")?.unwrap_or(1);
    if groups != 1 {
        return Err(unsupported(
            "mamba_n_groups",
            &obj["mamba_n_groups"],
            "Granite's gated norm spans every group; implemented with one group",
        ));
    }
    // The same mixer under Nemotron-H's key names.
    let mut keys = obj.clone();
    for (to, value) in [
        ("mamba_num_heads", Value::from(heads)),
        ("mamba_head_dim", Value::from(head_dim)),
        (
            "ssm_state_size",
            obj.get("mamba_d_state")
                .cloned()
                .unwrap_or(Value::from(256)),
        ),
        ("n_groups", Value::from(groups)),
        (
            "conv_kernel",
            obj.get("mamba_d_conv").cloned().unwrap_or(Value::from(4)),
        ),
        (
            "use_conv_bias",
            obj.get("mamba_conv_bias")
                .cloned()
                .unwrap_or(Value::from(true)),
        ),
        (
            "chunk_size",
            obj.get("mamba_chunk_size")
                .cloned()
                .unwrap_or(Value::from(256)),
        ),
    ] {
        keys.insert(to.into(), value);
    }
    mamba2(&keys)
}

/// Qwen3-Next's and Qwen3.5's layer kinds: `layer_types` (`linear_attention` /
/// `full_attention`), or, without it, a full-attention layer every `full_attention_interval`
/// (4 when absent, as transformers defaults it), the rest Gated DeltaNet.
pub(crate) fn qwen_mixers(
    obj: &Map<String, Value>,
    num_layers: usize,
) -> Result<Vec<Mixer>, ConfigError> {
    if let Some(types) = obj.get("layer_types").filter(|v| !v.is_null()) {
        return layer_kinds("layer_types", types, num_layers, |t| match t {
            "linear_attention" => Some(Mixer::GatedDeltaNet),
            "full_attention" => Some(Mixer::Attention),
            _ => None,
        })
        .map_err(|bad| {
            unsupported(
                "layer_types",
                &bad,
                "Qwen3-Next layers are linear_attention or full_attention",
            )
        })?;
    }
    let interval = opt_usize(obj, "full_attention_interval")?.unwrap_or(4);
    if interval == 0 {
        return Err(ConfigError::Invalid {
            key: "full_attention_interval",
            message: "must be positive".into(),
        });
    }
    Ok((0..num_layers)
        .map(|l| {
            if (l + 1).is_multiple_of(interval) {
                Mixer::Attention
            } else {
                Mixer::GatedDeltaNet
            }
        })
        .collect())
}

/// Qwen3-Next's Gated DeltaNet shape. The conv's activation is the model's `hidden_act`, which
/// the caller has already required to be silu.
pub(crate) fn gated_delta_net(
    obj: &Map<String, Value>,
    projection: GdnProjection,
) -> Result<GatedDeltaNetConfig, ConfigError> {
    let g = GatedDeltaNetConfig {
        key_heads: usize_of(obj, "linear_num_key_heads")?,
        value_heads: usize_of(obj, "linear_num_value_heads")?,
        key_head_dim: usize_of(obj, "linear_key_head_dim")?,
        value_head_dim: usize_of(obj, "linear_value_head_dim")?,
        conv_kernel: opt_usize(obj, "linear_conv_kernel_dim")?.unwrap_or(4),
        projection,
    };
    for (key, v) in [
        ("linear_num_key_heads", g.key_heads),
        ("linear_num_value_heads", g.value_heads),
        ("linear_key_head_dim", g.key_head_dim),
        ("linear_value_head_dim", g.value_head_dim),
    ] {
        if v == 0 {
            return Err(ConfigError::Invalid {
                key,
                message: "must be positive".into(),
            });
        }
    }
    if !g.value_heads.is_multiple_of(g.key_heads) {
        return Err(ConfigError::Invalid {
            key: "linear_num_value_heads",
            message: format!(
                "{} is not a multiple of linear_num_key_heads {}",
                g.value_heads, g.key_heads
            ),
        });
    }
    if !(2..=8).contains(&g.conv_kernel) {
        return Err(ConfigError::Invalid {
            key: "linear_conv_kernel_dim",
            message: format!("{} is not between 2 and 8", g.conv_kernel),
        });
    }
    Ok(g)
}

/// Nemotron-H's layers from `hybrid_override_pattern` (or transformers 5's `layers_block_type`
/// list: `mamba`/`linear_attention`, `attention`/`full_attention`, `mlp`, `moe`).
pub(crate) fn nemotron_layers(obj: &Map<String, Value>) -> Result<Vec<HybridLayer>, ConfigError> {
    let one = |mixer, ffn| HybridLayer { mixer, ffn };
    let from_name = |name: &str| match name {
        "M" | "mamba" | "linear_attention" => Some(one(Some(Mixer::Mamba2), None)),
        "*" | "attention" | "full_attention" => Some(one(Some(Mixer::Attention), None)),
        "-" | "mlp" => Some(one(None, Some(Ffn::Dense))),
        "E" | "moe" => Some(one(None, Some(Ffn::Sparse))),
        _ => None,
    };
    if let Some(list) = obj.get("layers_block_type").and_then(Value::as_array) {
        return list
            .iter()
            .map(|t| {
                t.as_str().and_then(from_name).ok_or_else(|| {
                    unsupported(
                        "layers_block_type",
                        t,
                        "Nemotron-H layers are mamba, attention, mlp or moe",
                    )
                })
            })
            .collect();
    }
    let pattern = get(obj, "hybrid_override_pattern")?
        .as_str()
        .ok_or_else(|| ConfigError::Invalid {
            key: "hybrid_override_pattern",
            message: "expected a string such as \"M-M*-\"".into(),
        })?;
    pattern
        .chars()
        .map(|c| {
            from_name(c.encode_utf8(&mut [0; 4])).ok_or_else(|| {
                unsupported(
                    "hybrid_override_pattern",
                    &Value::String(c.to_string()),
                    "Nemotron-H layers are M (Mamba-2), * (attention), - (MLP) or E (experts)",
                )
            })
        })
        .collect()
}

/// Nemotron-H's Mamba-2 shape; the legacy `mamba_*` spellings are read too.
pub(crate) fn mamba2(obj: &Map<String, Value>) -> Result<Mamba2Config, ConfigError> {
    let act = obj
        .get("mamba_hidden_act")
        .and_then(Value::as_str)
        .unwrap_or("silu");
    if act != "silu" {
        return Err(unsupported(
            "mamba_hidden_act",
            &obj["mamba_hidden_act"],
            "Mamba-2 layers are implemented with silu only",
        ));
    }
    let either = |new: &'static str, old: &'static str, default: usize| {
        Ok::<_, ConfigError>(
            opt_usize(obj, new)?
                .or(opt_usize(obj, old)?)
                .unwrap_or(default),
        )
    };
    let limit = match obj.get("time_step_limit").or(obj.get("mamba_dt_limit")) {
        None | Some(Value::Null) => (0.0, f32::INFINITY),
        Some(Value::Array(a)) if a.len() == 2 => {
            // JSON has no infinity: configs write a huge number (or a string) for "no bound".
            let bound = |v: &Value, default: f32| v.as_f64().map_or(default, |x| x as f32);
            (bound(&a[0], 0.0), bound(&a[1], f32::INFINITY))
        }
        Some(other) => {
            return Err(ConfigError::Invalid {
                key: "time_step_limit",
                message: format!("expected [min, max], got {other}"),
            });
        }
    };
    let m = Mamba2Config {
        heads: usize_of(obj, "mamba_num_heads")?,
        head_dim: usize_of(obj, "mamba_head_dim")?,
        state_size: usize_of(obj, "ssm_state_size")?,
        groups: either("n_groups", "mamba_n_groups", 8)?,
        conv_kernel: either("conv_kernel", "mamba_d_conv", 4)?,
        conv_bias: bool_of(obj, "use_conv_bias", true)?,
        chunk_size: either("chunk_size", "mamba_chunk_size", 128)?,
        time_step_limit: limit,
    };
    for (key, v) in [
        ("mamba_num_heads", m.heads),
        ("mamba_head_dim", m.head_dim),
        ("ssm_state_size", m.state_size),
        ("n_groups", m.groups),
        ("chunk_size", m.chunk_size),
    ] {
        if v == 0 {
            return Err(ConfigError::Invalid {
                key,
                message: "must be positive".into(),
            });
        }
    }
    if !m.heads.is_multiple_of(m.groups) {
        return Err(ConfigError::Invalid {
            key: "n_groups",
            message: format!("{} does not divide mamba_num_heads {}", m.groups, m.heads),
        });
    }
    if !(2..=8).contains(&m.conv_kernel) {
        return Err(ConfigError::Invalid {
            key: "conv_kernel",
            message: format!("{} is not between 2 and 8", m.conv_kernel),
        });
    }
    for key in ["use_bias", "mamba_proj_bias"] {
        if bool_of(obj, key, false)? {
            return Err(unsupported(
                key,
                &obj[key],
                "Mamba-2 projections with bias are not implemented",
            ));
        }
    }
    Ok(m)
}

/// Parameters of a hybrid model, counting a tied LM head once.
pub(crate) fn parameter_count(c: &crate::ModelConfig, hybrid: &HybridConfig) -> u64 {
    let h = c.hidden_size as u64;
    let (q, kv) = (
        (c.num_heads * c.head_dim) as u64,
        (c.num_kv_heads * c.head_dim) as u64,
    );
    let gate = if hybrid.attention_output_gate { q } else { 0 };
    let qk_norm = match c.qk_norm {
        crate::QkNorm::None => 0,
        crate::QkNorm::PerHead => 2 * c.head_dim as u64,
        crate::QkNorm::Whole => q + kv,
    };
    let attention = h * (q + gate) + 2 * h * kv + q * h + qk_norm;
    let gdn = hybrid.gated_delta_net.map_or(0, |g| {
        let (kd, vd) = (
            (g.key_heads * g.key_head_dim) as u64,
            (g.value_heads * g.value_head_dim) as u64,
        );
        let nv = g.value_heads as u64;
        let conv = g.conv_channels() as u64 * g.conv_kernel as u64;
        h * (2 * kd + 2 * vd) + h * 2 * nv + conv + 2 * nv + g.value_head_dim as u64 + vd * h
    });
    let mamba = hybrid.mamba2.map_or(0, |m| {
        let (inner, heads, ch) = (m.inner() as u64, m.heads as u64, m.conv_channels() as u64);
        let conv = ch * m.conv_kernel as u64 + if m.conv_bias { ch } else { 0 };
        h * (inner + ch + heads) + conv + 3 * heads + inner + inner * h
    });
    let products = match hybrid.mlp_activation {
        MlpActivation::SwiGlu => 3,
        MlpActivation::Relu2 => 2,
    };
    let dense = products * h * c.intermediate_size as u64;
    let sparse = c.moe.as_ref().map_or(0, |m| {
        let routed = m.num_experts as u64 * products * h * m.expert_intermediate as u64;
        let shared = m.shared_expert_intermediate.map_or(0, |s| {
            let gate = match hybrid.mlp_activation {
                MlpActivation::SwiGlu => h,
                MlpActivation::Relu2 => 0,
            };
            products * h * s as u64 + gate
        });
        let bias = match m.router {
            crate::RouterKind::SigmoidBias => m.num_experts as u64,
            crate::RouterKind::Softmax => 0,
        };
        routed + shared + m.num_experts as u64 * h + bias
    });
    let layers: u64 = hybrid
        .layers
        .iter()
        .map(|l| {
            let norms = h * (l.mixer.is_some() as u64 + l.ffn.is_some() as u64);
            let mixer = match l.mixer {
                Some(Mixer::Attention) => attention,
                Some(Mixer::GatedDeltaNet) => gdn,
                Some(Mixer::Mamba2) => mamba,
                None => 0,
            };
            let ffn = match l.ffn {
                Some(Ffn::Dense) => dense,
                Some(Ffn::Sparse) => sparse,
                None => 0,
            };
            norms + mixer + ffn
        })
        .sum();
    let v = c.vocab_size as u64;
    v * h * if c.tie_word_embeddings { 1 } else { 2 } + layers + h
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ModelFamily, QkNorm, RouterKind, from_config_json};

    /// Qwen3-Next-80B-A3B-Instruct's config.json as the hub ships it.
    const QWEN3_NEXT_80B: &str = r#"{"architectures":["Qwen3NextForCausalLM"],"attention_bias":false,
      "attention_dropout":0.0,"bos_token_id":151643,"decoder_sparse_step":1,"eos_token_id":151645,
      "full_attention_interval":4,"head_dim":256,"hidden_act":"silu","hidden_size":2048,
      "initializer_range":0.02,"intermediate_size":5120,"linear_conv_kernel_dim":4,
      "linear_key_head_dim":128,"linear_num_key_heads":16,"linear_num_value_heads":32,
      "linear_value_head_dim":128,"max_position_embeddings":262144,"mlp_only_layers":[],
      "model_type":"qwen3_next","moe_intermediate_size":512,"norm_topk_prob":true,
      "num_attention_heads":16,"num_experts":512,"num_experts_per_tok":10,"num_hidden_layers":48,
      "num_key_value_heads":2,"output_router_logits":false,"partial_rotary_factor":0.25,
      "rms_norm_eps":1e-06,"rope_scaling":null,"rope_theta":5000000,"router_aux_loss_coef":0.001,
      "shared_expert_intermediate_size":512,"tie_word_embeddings":false,"torch_dtype":"bfloat16",
      "use_cache":true,"use_sliding_window":false,"vocab_size":151936}"#;

    /// NVIDIA-Nemotron-3-Nano-30B-A3B's config.json (its `auto_map` left out).
    const NEMOTRON_3_NANO: &str = r#"{"architectures":["NemotronHForCausalLM"],"attention_bias":false,
      "attention_dropout":0.0,"bos_token_id":1,"chunk_size":128,"conv_kernel":4,"eos_token_id":2,
      "expand":2,"head_dim":128,"hidden_dropout":0.0,"hidden_size":2688,
      "hybrid_override_pattern":"MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
      "initializer_range":0.02,"intermediate_size":1856,"layer_norm_epsilon":1e-05,
      "mamba_head_dim":64,"mamba_hidden_act":"silu","mamba_num_heads":64,"mamba_proj_bias":false,
      "mamba_ssm_cache_dtype":"float32","max_position_embeddings":262144,"mlp_bias":false,
      "mlp_hidden_act":"relu2","model_type":"nemotron_h","moe_intermediate_size":1856,
      "moe_shared_expert_intermediate_size":3712,"n_group":1,"n_groups":8,"n_routed_experts":128,
      "n_shared_experts":1,"norm_eps":1e-05,"norm_topk_prob":true,"num_attention_heads":32,
      "num_experts_per_tok":6,"num_hidden_layers":52,"num_key_value_heads":2,
      "num_logits_to_keep":1,"pad_token_id":0,"partial_rotary_factor":1.0,
      "rescale_prenorm_residual":true,"residual_in_fp32":false,"rope_theta":10000,
      "routed_scaling_factor":2.5,"sliding_window":null,"ssm_state_size":128,
      "tie_word_embeddings":false,"time_step_floor":0.0001,"time_step_max":0.1,
      "time_step_min":0.001,"topk_group":1,"torch_dtype":"bfloat16","use_bias":false,
      "use_cache":true,"use_conv_bias":true,"use_mamba_kernels":true,"vocab_size":131072}"#;

    #[test]
    fn qwen3_next_80b_is_three_gated_deltanet_layers_to_one_gated_attention() {
        let c = from_config_json(QWEN3_NEXT_80B).unwrap();
        assert_eq!(c.family, ModelFamily::Qwen3Next);
        assert_eq!((c.num_heads, c.num_kv_heads, c.head_dim), (16, 2, 256));
        assert_eq!(c.rotary_dim, 64, "partial_rotary_factor 0.25 of 256");
        assert_eq!(c.qk_norm, QkNorm::PerHead);
        let h = c.hybrid.as_ref().unwrap();
        assert!(h.attention_output_gate && h.attention_rope && h.norm_unit_offset);
        assert_eq!(h.layers.len(), 48);
        let attention: Vec<usize> = (0..48)
            .filter(|&l| h.layers[l].mixer == Some(Mixer::Attention))
            .collect();
        assert_eq!(attention, (0..12).map(|i| 4 * i + 3).collect::<Vec<_>>());
        assert!(h.layers.iter().all(|l| l.ffn == Some(Ffn::Sparse)));
        assert_eq!(h.recurrent_layers(), 36);
        let g = h.gated_delta_net.unwrap();
        assert_eq!(
            (g.key_heads, g.value_heads, g.key_head_dim, g.value_head_dim),
            (16, 32, 128, 128)
        );
        assert_eq!(
            (g.conv_kernel, g.projection),
            (4, GdnProjection::GroupedQkvzBa)
        );
        assert_eq!(g.conv_channels(), 8192);
        // Per layer: 32 states of 128 x 128 f32 (2 MiB) and 3 conv taps of 8192 bf16 channels.
        assert_eq!(g.state_bytes(2), 32 * 128 * 128 * 4 + 3 * 8192 * 2);
        let m = c.moe.as_ref().unwrap();
        assert_eq!(
            (m.num_experts, m.top_k, m.expert_intermediate),
            (512, 10, 512)
        );
        assert_eq!((m.router, m.norm_topk_prob), (RouterKind::Softmax, true));
        assert_eq!(m.shared_expert_intermediate, Some(512));
        assert!(h.mamba2.is_none());
        // 79.7B parameters: the model card's 80B (the hub's 81.3B adds the MTP layer, not read here).
        let p = c.parameter_count() as f64 / 1e9;
        assert!((79.0..82.0).contains(&p), "{p}");
    }

    #[test]
    fn qwen3_next_layer_types_spell_the_same_pattern_and_override_the_interval() {
        let types: Vec<String> = (0..48)
            .map(|l| {
                let t = if l % 4 == 3 { "full" } else { "linear" };
                format!("\"{t}_attention\"")
            })
            .collect();
        let listed = QWEN3_NEXT_80B.replace(
            "\"full_attention_interval\":4,",
            &format!("\"layer_types\":[{}],", types.join(",")),
        );
        assert_eq!(
            from_config_json(&listed).unwrap(),
            from_config_json(QWEN3_NEXT_80B).unwrap()
        );
        let every_second = QWEN3_NEXT_80B.replace(
            "\"full_attention_interval\":4",
            "\"full_attention_interval\":2",
        );
        let c = from_config_json(&every_second).unwrap();
        let mixers: Vec<_> = c.hybrid.unwrap().layers[..4]
            .iter()
            .map(|l| l.mixer.unwrap())
            .collect();
        assert_eq!(
            mixers,
            [
                Mixer::GatedDeltaNet,
                Mixer::Attention,
                Mixer::GatedDeltaNet,
                Mixer::Attention
            ]
        );
        let sparse_step = QWEN3_NEXT_80B
            .replace("\"decoder_sparse_step\":1", "\"decoder_sparse_step\":2")
            .replace("\"mlp_only_layers\":[]", "\"mlp_only_layers\":[5]");
        let c = from_config_json(&sparse_step).unwrap();
        let ffns: Vec<_> = c.hybrid.unwrap().layers[..6]
            .iter()
            .map(|l| l.ffn.unwrap())
            .collect();
        use Ffn::{Dense, Sparse};
        assert_eq!(ffns, [Dense, Sparse, Dense, Sparse, Dense, Dense]);
    }

    #[test]
    fn qwen3_next_variants_it_does_not_implement_are_refused_by_name() {
        for (from, to, key) in [
            (
                "\"full_attention_interval\":4,",
                "\"layer_types\":[\"linear_attention\",\"sliding_attention\"],",
                "layer_types",
            ),
            (
                "\"linear_num_value_heads\":32",
                "\"linear_num_value_heads\":24",
                "linear_num_value_heads",
            ),
            (
                "\"full_attention_interval\":4",
                "\"full_attention_interval\":0",
                "full_attention_interval",
            ),
            (
                "\"use_sliding_window\":false",
                "\"use_sliding_window\":false,\"attn_output_gate\":false",
                "attn_output_gate",
            ),
            ("\"linear_key_head_dim\":128,", "", "linear_key_head_dim"),
        ] {
            let text = QWEN3_NEXT_80B.replace(from, to);
            assert_ne!(text, QWEN3_NEXT_80B, "{from}");
            let err = from_config_json(&text).unwrap_err().to_string();
            assert!(err.contains(key), "{key}: {err}");
        }
    }

    /// Qwen3.5-35B-A3B's config.json: the text model under `text_config` (its vision tower's
    /// config cut to two keys; the engine reads only the text model).
    const QWEN35_35B_A3B: &str = r#"{"architectures":["Qwen3_5MoeForConditionalGeneration"],
      "image_token_id":248056,"model_type":"qwen3_5_moe","tie_word_embeddings":false,
      "text_config":{"attention_bias":false,"attention_dropout":0.0,"attn_output_gate":true,
        "full_attention_interval":4,"head_dim":256,
        "hidden_act":"silu","hidden_size":2048,"initializer_range":0.02,
        "linear_conv_kernel_dim":4,"linear_key_head_dim":128,"linear_num_key_heads":16,
        "linear_num_value_heads":32,"linear_value_head_dim":128,"max_position_embeddings":262144,
        "model_type":"qwen3_5_moe_text","moe_intermediate_size":512,"num_attention_heads":16,
        "num_experts":256,"num_experts_per_tok":8,"num_hidden_layers":40,"num_key_value_heads":2,
        "rms_norm_eps":1e-06,"rope_parameters":{"mrope_interleaved":true,
        "mrope_section":[11,11,10],"partial_rotary_factor":0.25,"rope_theta":10000000,
        "rope_type":"default"},"shared_expert_intermediate_size":512,"vocab_size":248320},
      "vision_config":{"depth":27,"model_type":"qwen3_5_moe"}}"#;

    #[test]
    fn qwen35_moe_reads_its_text_config_with_split_projections_and_every_layer_sparse() {
        let c = from_config_json(QWEN35_35B_A3B).unwrap();
        assert_eq!(c.family, ModelFamily::Qwen35Moe);
        assert_eq!(
            (c.hidden_size, c.num_layers, c.vocab_size),
            (2048, 40, 248320)
        );
        assert_eq!((c.head_dim, c.rotary_dim, c.rope_theta), (256, 64, 1e7));
        assert!(!c.tie_word_embeddings);
        let h = c.hybrid.as_ref().unwrap();
        assert_eq!(h.recurrent_layers(), 30);
        assert!(h.layers.iter().all(|l| l.ffn == Some(Ffn::Sparse)));
        let g = h.gated_delta_net.unwrap();
        assert_eq!(g.projection, GdnProjection::SplitQkvZBA);
        let m = c.moe.as_ref().unwrap();
        assert_eq!((m.num_experts, m.top_k), (256, 8));
        assert!(m.norm_topk_prob && m.shared_expert_intermediate == Some(512));
        // 35B parameters (the text model: the vision tower's ~0.4B are not read).
        let p = c.parameter_count() as f64 / 1e9;
        assert!((33.5..35.5).contains(&p), "{p}");
    }

    #[test]
    fn nemotron_3_nano_is_one_block_per_layer_from_its_pattern() {
        let c = from_config_json(NEMOTRON_3_NANO).unwrap();
        assert_eq!(c.family, ModelFamily::NemotronH);
        assert_eq!(
            (c.num_layers, c.hidden_size, c.rms_norm_eps),
            (52, 2688, 1e-5)
        );
        assert_eq!((c.num_heads, c.num_kv_heads, c.head_dim), (32, 2, 128));
        assert_eq!(c.qk_norm, QkNorm::None);
        let h = c.hybrid.as_ref().unwrap();
        assert!(!h.attention_output_gate && !h.attention_rope && !h.norm_unit_offset);
        assert_eq!(h.mlp_activation, MlpActivation::Relu2);
        let count = |want: HybridLayer| h.layers.iter().filter(|&&l| l == want).count();
        let mamba = HybridLayer {
            mixer: Some(Mixer::Mamba2),
            ffn: None,
        };
        let attention = HybridLayer {
            mixer: Some(Mixer::Attention),
            ffn: None,
        };
        let experts = HybridLayer {
            mixer: None,
            ffn: Some(Ffn::Sparse),
        };
        assert_eq!(
            (count(mamba), count(attention), count(experts)),
            (23, 6, 23)
        );
        assert_eq!(&h.layers[..3], &[mamba, experts, mamba]);
        assert_eq!(h.layers[5], attention);
        let m = h.mamba2.unwrap();
        assert_eq!(
            (m.heads, m.head_dim, m.state_size, m.groups),
            (64, 64, 128, 8)
        );
        assert_eq!((m.conv_kernel, m.chunk_size, m.conv_bias), (4, 128, true));
        assert_eq!(m.time_step_limit, (0.0, f32::INFINITY));
        assert_eq!(m.conv_channels(), 4096 + 2 * 8 * 128);
        let e = c.moe.as_ref().unwrap();
        assert_eq!(
            (e.num_experts, e.top_k, e.expert_intermediate),
            (128, 6, 1856)
        );
        assert_eq!((e.router, e.routed_scaling), (RouterKind::SigmoidBias, 2.5));
        assert_eq!(e.shared_expert_intermediate, Some(3712));
        // 31.6B parameters, as the model card says.
        let p = c.parameter_count() as f64 / 1e9;
        assert!((31.0..32.2).contains(&p), "{p}");
    }

    #[test]
    fn nemotron_h_8b_has_dense_mlps_and_no_experts() {
        // Nemotron-H-8B-Base-8K's shape: its pattern, no experts, the older attention_head_dim.
        let text = NEMOTRON_3_NANO
            .replace(
                "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
                "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
            )
            .replace("\"head_dim\":128", "\"attention_head_dim\":128");
        let c = from_config_json(&text).unwrap();
        assert!(c.moe.is_none());
        let h = c.hybrid.unwrap();
        let dense = h
            .layers
            .iter()
            .filter(|l| l.ffn == Some(Ffn::Dense))
            .count();
        assert_eq!((h.layers.len(), dense, h.recurrent_layers()), (52, 24, 24));
        assert_eq!(c.head_dim, 128);
    }

    #[test]
    fn nemotron_h_variants_it_does_not_implement_are_refused_by_name() {
        for (from, to, key) in [
            ("MEMEM*", "MEMEX*", "hybrid_override_pattern"),
            ("\"relu2\"", "\"silu\"", "mlp_hidden_act"),
            (
                "\"mamba_hidden_act\":\"silu\"",
                "\"mamba_hidden_act\":\"gelu\"",
                "mamba_hidden_act",
            ),
            ("\"n_group\":1", "\"n_group\":4", "n_group"),
            ("\"use_bias\":false", "\"use_bias\":true", "use_bias"),
            (
                "\"num_hidden_layers\":52",
                "\"num_hidden_layers\":50",
                "num_hidden_layers",
            ),
            ("\"n_groups\":8", "\"n_groups\":7", "n_groups"),
            ("\"mamba_num_heads\":64,", "", "mamba_num_heads"),
        ] {
            let text = NEMOTRON_3_NANO.replace(from, to);
            assert_ne!(text, NEMOTRON_3_NANO, "{from}");
            let err = from_config_json(&text).unwrap_err().to_string();
            assert!(err.contains(key), "{key}: {err}");
        }
    }
}
