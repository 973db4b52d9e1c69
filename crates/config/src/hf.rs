// SPDX-License-Identifier: MIT OR Apache-2.0
//! `config.json` of a Hugging Face checkpoint.

use serde_json::{Map, Value};

use crate::hybrid::{self, Ffn, GdnProjection, HybridConfig, HybridLayer, Mixer, MlpActivation};
use crate::{
    ConfigError, ModelConfig, ModelFamily, MoeConfig, Multipliers, QkNorm, RopeScaling, RouterKind,
};

pub(crate) fn get<'a>(
    obj: &'a Map<String, Value>,
    key: &'static str,
) -> Result<&'a Value, ConfigError> {
    obj.get(key)
        .filter(|v| !v.is_null())
        .ok_or(ConfigError::Missing(key))
}

pub(crate) fn usize_of(obj: &Map<String, Value>, key: &'static str) -> Result<usize, ConfigError> {
    get(obj, key)?
        .as_u64()
        .map(|v| v as usize)
        .ok_or_else(|| ConfigError::Invalid {
            key,
            message: format!("expected a non-negative integer, got {}", obj[key]),
        })
}

pub(crate) fn opt_usize(
    obj: &Map<String, Value>,
    key: &'static str,
) -> Result<Option<usize>, ConfigError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(_) => usize_of(obj, key).map(Some),
    }
}

pub(crate) fn f32_of(
    obj: &Map<String, Value>,
    key: &'static str,
    default: f32,
) -> Result<f32, ConfigError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(v) => v
            .as_f64()
            .map(|v| v as f32)
            .ok_or_else(|| ConfigError::Invalid {
                key,
                message: format!("expected a number, got {v}"),
            }),
    }
}

pub(crate) fn bool_of(
    obj: &Map<String, Value>,
    key: &'static str,
    default: bool,
) -> Result<bool, ConfigError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(v) => v.as_bool().ok_or_else(|| ConfigError::Invalid {
            key,
            message: format!("expected true or false, got {v}"),
        }),
    }
}

fn token_ids(v: Option<&Value>) -> Vec<u32> {
    match v {
        Some(Value::Number(n)) => n.as_u64().map(|n| vec![n as u32]).unwrap_or_default(),
        Some(Value::Array(a)) => a
            .iter()
            .filter_map(|x| x.as_u64())
            .map(|n| n as u32)
            .collect(),
        _ => Vec::new(),
    }
}

pub(crate) fn unsupported(key: &str, value: &Value, why: &'static str) -> ConfigError {
    ConfigError::Unsupported {
        key: key.to_string(),
        value: value.to_string(),
        why,
    }
}

/// RoPE's base: `rope_theta`, or transformers 5's `rope_parameters.rope_theta`.
fn rope_theta(obj: &Map<String, Value>) -> Result<f32, ConfigError> {
    match obj.get("rope_parameters").and_then(Value::as_object) {
        Some(p) if !obj.contains_key("rope_theta") => f32_of(p, "rope_theta", 10000.0),
        _ => f32_of(obj, "rope_theta", 10000.0),
    }
}

fn rope_scaling(obj: &Map<String, Value>) -> Result<RopeScaling, ConfigError> {
    // transformers 5 writes `rope_parameters` (the scaling's keys beside rope_theta) in place of
    // `rope_scaling`.
    let Some(v) = obj
        .get("rope_scaling")
        .filter(|v| !v.is_null())
        .or_else(|| obj.get("rope_parameters").filter(|v| !v.is_null()))
    else {
        return Ok(RopeScaling::None);
    };
    let Some(s) = v.as_object() else {
        return Err(unsupported("rope_scaling", v, "expected an object"));
    };
    let kind = s
        .get("rope_type")
        .or_else(|| s.get("type"))
        .and_then(Value::as_str)
        .unwrap_or("default");
    match kind {
        "default" => Ok(RopeScaling::None),
        "linear" => Ok(RopeScaling::Linear {
            factor: f32_of(s, "factor", 1.0)?,
        }),
        "llama3" => Ok(RopeScaling::Llama3 {
            factor: f32_of(s, "factor", 8.0)?,
            low_freq_factor: f32_of(s, "low_freq_factor", 1.0)?,
            high_freq_factor: f32_of(s, "high_freq_factor", 4.0)?,
            original_max_position_embeddings: usize_of(s, "original_max_position_embeddings")?
                as u32,
        }),
        "yarn" => yarn(obj, s),
        _ => Err(unsupported(
            "rope_scaling.rope_type",
            &Value::String(kind.into()),
            "supported RoPE scalings: default, linear, llama3, yarn",
        )),
    }
}

/// YaRN's parameters as transformers reads them: the original context from the config's top
/// level, else the scaling's, else `max_position_embeddings`; the factor, else the ratio of the
/// context to the original one; the attention factor given, else from DeepSeek's `mscale` /
/// `mscale_all_dim`, else 0.1 ln(factor) + 1.
fn yarn(obj: &Map<String, Value>, s: &Map<String, Value>) -> Result<RopeScaling, ConfigError> {
    let original = match opt_usize(obj, "original_max_position_embeddings")? {
        Some(o) => o,
        None => match opt_usize(s, "original_max_position_embeddings")? {
            Some(o) => o,
            None => usize_of(obj, "max_position_embeddings")?,
        },
    };
    if original == 0 {
        return Err(ConfigError::Invalid {
            key: "original_max_position_embeddings",
            message: "must be positive".into(),
        });
    }
    let factor = match s.get("factor") {
        Some(v) if !v.is_null() => f32_of(s, "factor", 1.0)?,
        _ => usize_of(obj, "max_position_embeddings")? as f32 / original as f32,
    };
    if factor.is_nan() || factor < 1.0 {
        return Err(ConfigError::Invalid {
            key: "factor",
            message: format!("YaRN's factor {factor} is not at least 1"),
        });
    }
    let mscale = |scale: f32, m: f32| {
        if scale <= 1.0 {
            1.0
        } else {
            0.1 * m * scale.ln() + 1.0
        }
    };
    let attention_factor = match s.get("attention_factor") {
        Some(v) if !v.is_null() => f32_of(s, "attention_factor", 1.0)?,
        _ => {
            let (m, all) = (f32_of(s, "mscale", 0.0)?, f32_of(s, "mscale_all_dim", 0.0)?);
            if m != 0.0 && all != 0.0 {
                mscale(factor, m) / mscale(factor, all)
            } else {
                mscale(factor, 1.0)
            }
        }
    };
    // transformers reads a zero beta as its default (`or`).
    let beta = |key, default| -> Result<f32, ConfigError> {
        Ok(match f32_of(s, key, default)? {
            0.0 => default,
            b => b,
        })
    };
    Ok(RopeScaling::Yarn {
        factor,
        original_max_position_embeddings: original as u32,
        beta_fast: beta("beta_fast", 32.0)?,
        beta_slow: beta("beta_slow", 1.0)?,
        attention_factor,
        truncate: bool_of(s, "truncate", true)?,
    })
}

/// The sparse MLPs of a MoE family's config (`None` for a dense family). Keys that would change
/// the routing in ways the engine does not implement are refused.
fn moe(obj: &Map<String, Value>, family: ModelFamily) -> Result<Option<MoeConfig>, ConfigError> {
    let shared = match family {
        ModelFamily::Qwen2Moe | ModelFamily::Qwen3Next | ModelFamily::Qwen35Moe => {
            Some(usize_of(obj, "shared_expert_intermediate_size")?)
        }
        ModelFamily::Qwen3Moe => None,
        ModelFamily::Mixtral | ModelFamily::Olmoe => {
            return every_layer_softmax_moe(obj, family).map(Some);
        }
        ModelFamily::MiniMaxM2 => return minimax_m2_moe(obj).map(Some),
        ModelFamily::Glm4Moe => return glm4_moe(obj).map(Some),
        ModelFamily::NemotronH => return nemotron_h_moe(obj),
        ModelFamily::GraniteMoeHybrid | ModelFamily::GraniteMoe => return granite_moe(obj),
        ModelFamily::Llama
        | ModelFamily::Mistral
        | ModelFamily::Granite
        | ModelFamily::SmolLm3
        | ModelFamily::Phi3
        | ModelFamily::SeedOss
        | ModelFamily::Qwen2
        | ModelFamily::Qwen3 => {
            return Ok(None);
        }
    };
    let mlp_only_layers = match obj.get("mlp_only_layers") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(a)) => a
            .iter()
            .map(|v| v.as_u64().map(|l| l as usize))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| ConfigError::Invalid {
                key: "mlp_only_layers",
                message: format!("expected layer indices, got {}", obj["mlp_only_layers"]),
            })?,
        Some(other) => {
            return Err(ConfigError::Invalid {
                key: "mlp_only_layers",
                message: format!("expected a list of layer indices, got {other}"),
            });
        }
    };
    Ok(Some(MoeConfig {
        num_experts: num_experts(obj)?,
        top_k: usize_of(obj, "num_experts_per_tok")?,
        expert_intermediate: usize_of(obj, "moe_intermediate_size")?,
        // transformers' defaults: Qwen3-MoE and Qwen3-Next renormalise, Qwen2-MoE does not;
        // Qwen3.5's router always does (its config has no such key).
        norm_topk_prob: family == ModelFamily::Qwen35Moe
            || bool_of(
                obj,
                "norm_topk_prob",
                matches!(family, ModelFamily::Qwen3Moe | ModelFamily::Qwen3Next),
            )?,
        router: RouterKind::Softmax,
        routed_scaling: 1.0,
        shared_expert_gated: shared.is_some(),
        shared_expert_intermediate: shared,
        sparse_step: opt_usize(obj, "decoder_sparse_step")?.unwrap_or(1),
        mlp_only_layers,
    }))
}

/// The number of routed experts: `num_experts`, or transformers 5's `num_local_experts`.
fn num_experts(obj: &Map<String, Value>) -> Result<usize, ConfigError> {
    match opt_usize(obj, "num_local_experts")? {
        Some(n) if !obj.contains_key("num_experts") => Ok(n),
        _ => usize_of(obj, "num_experts"),
    }
}

/// Mixtral's and OLMoE's sparse MLP, in every layer: experts of `intermediate_size` (no dense MLP,
/// no shared expert) under a softmax router. Mixtral always renormalises the top k; OLMoE does
/// where `norm_topk_prob` says (transformers' default: no).
fn every_layer_softmax_moe(
    obj: &Map<String, Value>,
    family: ModelFamily,
) -> Result<MoeConfig, ConfigError> {
    let norm_topk_prob = match family {
        ModelFamily::Mixtral => true,
        _ => bool_of(obj, "norm_topk_prob", false)?,
    };
    Ok(MoeConfig {
        num_experts: num_experts(obj)?,
        top_k: usize_of(obj, "num_experts_per_tok")?,
        expert_intermediate: usize_of(obj, "intermediate_size")?,
        norm_topk_prob,
        router: RouterKind::Softmax,
        routed_scaling: 1.0,
        shared_expert_intermediate: None,
        shared_expert_gated: false,
        sparse_step: 1,
        mlp_only_layers: Vec::new(),
    })
}

/// `obj[key]` must be absent or equal to `want` (a variant the engine does not implement
/// otherwise).
fn require(
    obj: &Map<String, Value>,
    key: &'static str,
    want: Value,
    why: &'static str,
) -> Result<(), ConfigError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(()),
        Some(v) if *v == want => Ok(()),
        Some(v) => Err(unsupported(key, v, why)),
    }
}

/// MiniMax-M2's sparse MLP, in every layer: Mixtral-style experts of `intermediate_size`, a
/// sigmoid router whose top k is chosen on the scores plus a per-expert correction bias, the
/// unbiased scores of the chosen experts renormalised. The original checkpoint's config spells
/// the variants out (`scoring_func`, `use_routing_bias`, `shared_intermediate_size`,
/// `attn_type_list`); transformers' config leaves them implied. Any other value is refused.
fn minimax_m2_moe(obj: &Map<String, Value>) -> Result<MoeConfig, ConfigError> {
    require(
        obj,
        "scoring_func",
        Value::from("sigmoid"),
        "MiniMax-M2 routing is implemented with sigmoid scores only",
    )?;
    require(
        obj,
        "use_routing_bias",
        Value::from(true),
        "MiniMax-M2 routing is implemented with its correction bias only",
    )?;
    if obj
        .get("shared_intermediate_size")
        .is_some_and(|v| !v.is_null() && v.as_u64() != Some(0))
    {
        return Err(unsupported(
            "shared_intermediate_size",
            &obj["shared_intermediate_size"],
            "a MiniMax-M2 shared expert is not implemented",
        ));
    }
    if let Some(types) = obj.get("attn_type_list").and_then(Value::as_array)
        && let Some(other) = types.iter().find(|t| t.as_u64() != Some(1))
    {
        return Err(unsupported(
            "attn_type_list",
            other,
            "only full-attention layers (type 1) are implemented",
        ));
    }
    let scaling = f32_of(obj, "routed_scaling_factor", 1.0)?;
    if scaling != 1.0 {
        return Err(unsupported(
            "routed_scaling_factor",
            &obj["routed_scaling_factor"],
            "MiniMax-M2 routing does not scale its weights",
        ));
    }
    Ok(MoeConfig {
        num_experts: num_experts(obj)?,
        top_k: usize_of(obj, "num_experts_per_tok")?,
        expert_intermediate: usize_of(obj, "intermediate_size")?,
        norm_topk_prob: true,
        router: RouterKind::SigmoidBias,
        routed_scaling: 1.0,
        shared_expert_intermediate: None,
        shared_expert_gated: false,
        sparse_step: 1,
        mlp_only_layers: Vec::new(),
    })
}

/// Nemotron-H's experts, present when its pattern has an `E` layer: squared-ReLU experts of
/// `moe_intermediate_size`, DeepSeek-V3's sigmoid router with a correction bias (one group), the
/// chosen weights renormalised and scaled by `routed_scaling_factor`, and an ungated shared
/// expert of `moe_shared_expert_intermediate_size`.
fn nemotron_h_moe(obj: &Map<String, Value>) -> Result<Option<MoeConfig>, ConfigError> {
    let layers = hybrid::nemotron_layers(obj)?;
    if !layers.iter().any(|l| l.ffn == Some(Ffn::Sparse)) {
        return Ok(None);
    }
    ungrouped_routing(obj)?;
    if let Some(v) = obj.get("moe_latent_size").filter(|v| !v.is_null()) {
        return Err(unsupported(
            "moe_latent_size",
            v,
            "latent expert projections are not implemented",
        ));
    }
    let shared = match opt_usize(obj, "n_shared_experts")?.unwrap_or(1) {
        0 => None,
        1 => Some(usize_of(obj, "moe_shared_expert_intermediate_size")?),
        _ => {
            return Err(unsupported(
                "n_shared_experts",
                &obj["n_shared_experts"],
                "one shared expert at most",
            ));
        }
    };
    Ok(Some(MoeConfig {
        num_experts: match opt_usize(obj, "n_routed_experts")? {
            Some(n) => n,
            None => num_experts(obj)?,
        },
        top_k: usize_of(obj, "num_experts_per_tok")?,
        expert_intermediate: usize_of(obj, "moe_intermediate_size")?,
        norm_topk_prob: bool_of(obj, "norm_topk_prob", true)?,
        router: RouterKind::SigmoidBias,
        routed_scaling: f32_of(obj, "routed_scaling_factor", 1.0)?,
        shared_expert_intermediate: shared,
        shared_expert_gated: false,
        sparse_step: 1,
        mlp_only_layers: Vec::new(),
    }))
}

/// Granite's experts (Granite-3.x MoE, and Granite 4.0 where `num_local_experts` is not 0): the
/// top k of the router's logits weighted by their softmax (the softmax over every expert,
/// renormalised over the top k: the same weights), experts of `intermediate_size`, and the
/// ungated `shared_mlp` of `shared_intermediate_size` beside them where that is not 0. Granite
/// 4.0 without experts has the shared MLP as each layer's dense MLP (`None` here).
fn granite_moe(obj: &Map<String, Value>) -> Result<Option<MoeConfig>, ConfigError> {
    let experts = opt_usize(obj, "num_local_experts")?.unwrap_or(0);
    if experts == 0 {
        return Ok(None);
    }
    let shared = opt_usize(obj, "shared_intermediate_size")?.filter(|&s| s > 0);
    Ok(Some(MoeConfig {
        num_experts: experts,
        top_k: usize_of(obj, "num_experts_per_tok")?,
        expert_intermediate: usize_of(obj, "intermediate_size")?,
        norm_topk_prob: true,
        router: RouterKind::Softmax,
        routed_scaling: 1.0,
        shared_expert_intermediate: shared,
        shared_expert_gated: false,
        sparse_step: 1,
        mlp_only_layers: Vec::new(),
    }))
}

/// DeepSeek-V3's router restricts each token's experts to its best `topk_group` of `n_group`
/// expert groups; with one group (GLM-4.5, Nemotron-H) that is no restriction. More are refused.
fn ungrouped_routing(obj: &Map<String, Value>) -> Result<(), ConfigError> {
    for key in ["n_group", "topk_group"] {
        if opt_usize(obj, key)?.is_some_and(|n| n != 1) {
            return Err(unsupported(
                key,
                &obj[key],
                "grouped expert routing is not implemented",
            ));
        }
    }
    Ok(())
}

/// GLM-4.5's sparse MLP: after the first `first_k_dense_replace` layers (dense, of
/// `intermediate_size`), experts of `moe_intermediate_size` under DeepSeek-V3's sigmoid router
/// (the top k chosen on the scores plus a correction bias, weighted by the unbiased scores,
/// renormalised where `norm_topk_prob` says, scaled by `routed_scaling_factor`), and
/// `n_shared_experts` ungated shared experts, one MLP of that many times the experts' width.
fn glm4_moe(obj: &Map<String, Value>) -> Result<MoeConfig, ConfigError> {
    ungrouped_routing(obj)?;
    let expert_intermediate = usize_of(obj, "moe_intermediate_size")?;
    let shared = match opt_usize(obj, "n_shared_experts")?.unwrap_or(1) {
        0 => None,
        n => Some(n * expert_intermediate),
    };
    let dense_layers = opt_usize(obj, "first_k_dense_replace")?.unwrap_or(1);
    Ok(MoeConfig {
        num_experts: match opt_usize(obj, "n_routed_experts")? {
            Some(n) => n,
            None => num_experts(obj)?,
        },
        top_k: usize_of(obj, "num_experts_per_tok")?,
        expert_intermediate,
        norm_topk_prob: bool_of(obj, "norm_topk_prob", true)?,
        router: RouterKind::SigmoidBias,
        routed_scaling: f32_of(obj, "routed_scaling_factor", 1.0)?,
        shared_expert_intermediate: shared,
        shared_expert_gated: false,
        sparse_step: 1,
        mlp_only_layers: (0..dense_layers).collect(),
    })
}

/// The layer pattern and mixer shapes of a hybrid family (`None` for the others), with the
/// keys that would change them in ways the engine does not implement refused.
fn hybrid_config(
    obj: &Map<String, Value>,
    family: ModelFamily,
    num_layers: usize,
    moe: Option<&MoeConfig>,
) -> Result<Option<HybridConfig>, ConfigError> {
    match family {
        ModelFamily::Qwen3Next | ModelFamily::Qwen35Moe => {
            require(
                obj,
                "attn_output_gate",
                Value::from(true),
                "Qwen3-Next attention is implemented with its output gate only",
            )?;
            let projection = match family {
                ModelFamily::Qwen3Next => GdnProjection::GroupedQkvzBa,
                _ => GdnProjection::SplitQkvZBA,
            };
            let layers = hybrid::qwen_mixers(obj, num_layers)?
                .into_iter()
                .enumerate()
                .map(|(l, mixer)| HybridLayer {
                    mixer: Some(mixer),
                    ffn: Some(match moe {
                        Some(m) if m.is_sparse(l) => Ffn::Sparse,
                        _ => Ffn::Dense,
                    }),
                })
                .collect::<Vec<_>>();
            let gdn = layers
                .iter()
                .any(|l| l.mixer == Some(Mixer::GatedDeltaNet))
                .then(|| hybrid::gated_delta_net(obj, projection))
                .transpose()?;
            Ok(Some(HybridConfig {
                layers,
                gated_delta_net: gdn,
                mamba2: None,
                attention_output_gate: true,
                attention_rope: true,
                norm_unit_offset: true,
                mlp_activation: MlpActivation::SwiGlu,
            }))
        }
        ModelFamily::GraniteMoeHybrid => {
            let rope = match obj.get("position_embedding_type") {
                None | Some(Value::Null) => false,
                Some(v) if v.as_str() == Some("nope") => false,
                Some(v) if v.as_str() == Some("rope") => true,
                Some(other) => {
                    return Err(unsupported(
                        "position_embedding_type",
                        other,
                        "Granite attention is implemented with rope or no position encoding",
                    ));
                }
            };
            let layers = hybrid::granite_layers(obj, num_layers)?
                .into_iter()
                .map(|mixer| HybridLayer {
                    mixer: Some(mixer),
                    ffn: Some(if moe.is_some() {
                        Ffn::Sparse
                    } else {
                        Ffn::Dense
                    }),
                })
                .collect::<Vec<_>>();
            let mamba = layers
                .iter()
                .any(|l| l.mixer == Some(Mixer::Mamba2))
                .then(|| hybrid::granite_mamba2(obj))
                .transpose()?;
            Ok(Some(HybridConfig {
                layers,
                gated_delta_net: None,
                mamba2: mamba,
                attention_output_gate: false,
                attention_rope: rope,
                norm_unit_offset: false,
                mlp_activation: MlpActivation::SwiGlu,
            }))
        }
        ModelFamily::NemotronH => {
            let act = obj
                .get("mlp_hidden_act")
                .and_then(Value::as_str)
                .unwrap_or("relu2");
            if act != "relu2" {
                return Err(unsupported(
                    "mlp_hidden_act",
                    &obj["mlp_hidden_act"],
                    "Nemotron-H MLPs are implemented with relu2 only",
                ));
            }
            let layers = hybrid::nemotron_layers(obj)?;
            let mamba = layers
                .iter()
                .any(|l| l.mixer == Some(Mixer::Mamba2))
                .then(|| hybrid::mamba2(obj))
                .transpose()?;
            Ok(Some(HybridConfig {
                layers,
                gated_delta_net: None,
                mamba2: mamba,
                attention_output_gate: false,
                attention_rope: false,
                norm_unit_offset: false,
                mlp_activation: MlpActivation::Relu2,
            }))
        }
        _ => Ok(None),
    }
}

/// Qwen3.5's config nests the text model under `text_config`; its keys win, the top level's
/// fill in the rest (token ids, `tie_word_embeddings`).
fn text_config(obj: &Map<String, Value>) -> Map<String, Value> {
    let Some(text) = obj.get("text_config").and_then(Value::as_object) else {
        return obj.clone();
    };
    let mut merged = text.clone();
    for (k, v) in obj {
        if !matches!(k.as_str(), "text_config" | "vision_config" | "model_type") {
            merged.entry(k.clone()).or_insert_with(|| v.clone());
        }
    }
    merged
}

/// The QK-norm of `family`; MiniMax-M2's original config spells it out (`use_qk_norm`,
/// `qk_norm_type: "per_layer"`, the norm over the whole projection), and any other value is
/// refused.
fn qk_norm(obj: &Map<String, Value>, family: ModelFamily) -> Result<QkNorm, ConfigError> {
    if family == ModelFamily::MiniMaxM2 {
        require(
            obj,
            "use_qk_norm",
            Value::from(true),
            "MiniMax-M2 attention is implemented with its QK-norm only",
        )?;
        require(
            obj,
            "qk_norm_type",
            Value::from("per_layer"),
            "MiniMax-M2's QK-norm is implemented over the whole projection (per_layer) only",
        )?;
    }
    if family == ModelFamily::Glm4Moe && bool_of(obj, "use_qk_norm", false)? {
        return Ok(QkNorm::PerHead);
    }
    Ok(family.qk_norm())
}

/// The leading elements of each head that RoPE rotates: `rotary_dim` (MiniMax-M2's original
/// config), or `head_dim * partial_rotary_factor` (at the top level or, transformers 5, inside
/// `rope_parameters`); `head_dim` when neither is given. Given both ways, they must agree.
fn rotary_dim(
    obj: &Map<String, Value>,
    head_dim: usize,
    family: ModelFamily,
) -> Result<usize, ConfigError> {
    let factor = match obj.get("rope_parameters").and_then(Value::as_object) {
        Some(p) if p.get("partial_rotary_factor").is_some_and(|v| !v.is_null()) => {
            Some(f32_of(p, "partial_rotary_factor", 1.0)?)
        }
        _ if obj
            .get("partial_rotary_factor")
            .is_some_and(|v| !v.is_null()) =>
        {
            Some(f32_of(obj, "partial_rotary_factor", 1.0)?)
        }
        _ => None,
    };
    let from_factor = match factor {
        None => None,
        Some(f) if f > 0.0 && f <= 1.0 => Some((head_dim as f32 * f) as usize),
        Some(f) => {
            return Err(ConfigError::Invalid {
                key: "partial_rotary_factor",
                message: format!("{f} is not in (0, 1]"),
            });
        }
    };
    match (opt_usize(obj, "rotary_dim")?, from_factor) {
        (Some(d), Some(f)) if d != f => Err(ConfigError::Invalid {
            key: "rotary_dim",
            message: format!(
                "{d} disagrees with partial_rotary_factor, which gives {f} of head_dim {head_dim}"
            ),
        }),
        (Some(d), _) => Ok(d),
        (None, Some(f)) => Ok(f),
        // GLM-4.5's config class rotates half of each head unless told otherwise.
        (None, None) if family == ModelFamily::Glm4Moe => Ok(head_dim / 2),
        (None, None) => Ok(head_dim),
    }
}

/// Granite's multipliers (every other family: none). Each must be a positive number.
fn multipliers(obj: &Map<String, Value>, family: ModelFamily) -> Result<Multipliers, ConfigError> {
    if !matches!(
        family,
        ModelFamily::Granite | ModelFamily::GraniteMoe | ModelFamily::GraniteMoeHybrid
    ) {
        return Ok(Multipliers::default());
    }
    let positive = |key: &'static str| -> Result<f32, ConfigError> {
        let v = f32_of(obj, key, 1.0)?;
        if v > 0.0 && v.is_finite() {
            Ok(v)
        } else {
            Err(ConfigError::Invalid {
                key,
                message: format!("{v} is not a positive number"),
            })
        }
    };
    Ok(Multipliers {
        embedding: positive("embedding_multiplier")?,
        residual: positive("residual_multiplier")?,
        attention: Some(positive("attention_multiplier")?),
        logits: positive("logits_scaling")?,
    })
}

/// SmolLM3's layers without RoPE: the zeros of `no_rope_layers` (one 0/1 a layer), or without
/// it every `no_rope_layer_interval`-th layer (4), as transformers fills it in. Other families:
/// none.
fn nope_layers(
    obj: &Map<String, Value>,
    family: ModelFamily,
    num_layers: usize,
) -> Result<Vec<usize>, ConfigError> {
    if family != ModelFamily::SmolLm3 {
        return Ok(Vec::new());
    }
    match obj.get("no_rope_layers").filter(|v| !v.is_null()) {
        Some(v) => {
            let list = v
                .as_array()
                .filter(|a| a.len() == num_layers)
                .ok_or_else(|| ConfigError::Invalid {
                    key: "no_rope_layers",
                    message: format!(
                        "expected one 0 or 1 for each of {num_layers} layers, got {v}"
                    ),
                })?;
            list.iter()
                .enumerate()
                .filter_map(|(l, x)| match x.as_u64() {
                    Some(0) => Some(Ok(l)),
                    Some(1) => None,
                    _ => Some(Err(ConfigError::Invalid {
                        key: "no_rope_layers",
                        message: format!("entry {l} is {x}, not 0 or 1"),
                    })),
                })
                .collect()
        }
        None => {
            let interval = opt_usize(obj, "no_rope_layer_interval")?.unwrap_or(4);
            if interval == 0 {
                return Err(ConfigError::Invalid {
                    key: "no_rope_layer_interval",
                    message: "must be positive".into(),
                });
            }
            Ok((0..num_layers)
                .filter(|l| (l + 1).is_multiple_of(interval))
                .collect())
        }
    }
}

/// Parses a `config.json` text.
pub fn from_config_json(text: &str) -> Result<ModelConfig, ConfigError> {
    let value: Value =
        serde_json::from_str(text).map_err(|e| ConfigError::Syntax(e.to_string()))?;
    let obj = value
        .as_object()
        .ok_or_else(|| ConfigError::Syntax("config.json is not a JSON object".into()))?;
    let model_type = get(obj, "model_type")?
        .as_str()
        .ok_or_else(|| ConfigError::Invalid {
            key: "model_type",
            message: "expected a string".into(),
        })?;
    let family = ModelFamily::parse(model_type)?;
    let merged;
    let obj = if family == ModelFamily::Qwen35Moe {
        merged = text_config(obj);
        &merged
    } else {
        obj
    };

    // Keys that would change the forward pass in ways the engine does not implement.
    let act = obj
        .get("hidden_act")
        .and_then(Value::as_str)
        .unwrap_or("silu");
    if act != "silu" {
        return Err(unsupported(
            "hidden_act",
            &obj["hidden_act"],
            "only silu (SwiGLU) MLPs are implemented",
        ));
    }
    if bool_of(obj, "mlp_bias", false)? {
        return Err(unsupported(
            "mlp_bias",
            &obj["mlp_bias"],
            "MLP projections with bias are not implemented",
        ));
    }
    if bool_of(obj, "use_sliding_window", false)? {
        return Err(unsupported(
            "use_sliding_window",
            &obj["use_sliding_window"],
            "sliding-window attention is not implemented",
        ));
    }
    // Mistral's, Mixtral's, OLMoE's and Phi-3's attention applies `sliding_window` whenever it is set (no
    // `use_sliding_window` switch); a window at least as long as the context changes nothing.
    let context = opt_usize(obj, "max_position_embeddings")?.unwrap_or(4096) as u64;
    if matches!(
        family,
        ModelFamily::Mistral | ModelFamily::Mixtral | ModelFamily::Olmoe | ModelFamily::Phi3
    ) && let Some(window) = obj.get("sliding_window").filter(|v| !v.is_null())
        && window.as_u64().is_none_or(|w| w < context)
    {
        return Err(unsupported(
            "sliding_window",
            window,
            "sliding-window attention is not implemented",
        ));
    }
    if bool_of(obj, "attention_out_bias", false)? {
        return Err(unsupported(
            "attention_out_bias",
            &obj["attention_out_bias"],
            "an output projection with bias is not implemented",
        ));
    }
    if let Some(clip) = obj.get("clip_qkv").filter(|v| !v.is_null()) {
        return Err(unsupported(
            "clip_qkv",
            clip,
            "clamping q, k and v is not implemented",
        ));
    }
    if let Some(types) = obj.get("layer_types").and_then(Value::as_array)
        && !family.hybrid()
        && let Some(other) = types.iter().find(|t| t.as_str() != Some("full_attention"))
    {
        return Err(unsupported(
            "layer_types",
            other,
            "only full-attention layers are implemented",
        ));
    }
    if obj
        .get("pretraining_tp")
        .and_then(Value::as_u64)
        .is_some_and(|p| p > 1)
    {
        return Err(unsupported(
            "pretraining_tp",
            &obj["pretraining_tp"],
            "tensor-parallel pretraining slices are not implemented",
        ));
    }

    let hidden_size = usize_of(obj, "hidden_size")?;
    let num_heads = usize_of(obj, "num_attention_heads")?;
    let head_dim = match opt_usize(obj, "head_dim")? {
        Some(d) => d,
        // Nemotron-H's older configs.
        None => opt_usize(obj, "attention_head_dim")?.unwrap_or(hidden_size / num_heads.max(1)),
    };
    let num_layers = if family == ModelFamily::NemotronH {
        // The pattern has one entry per layer; a num_hidden_layers beside it must agree.
        let n = hybrid::nemotron_layers(obj)?.len();
        match opt_usize(obj, "num_hidden_layers")? {
            Some(given) if given != n => {
                return Err(ConfigError::Invalid {
                    key: "num_hidden_layers",
                    message: format!("{given}, but hybrid_override_pattern has {n} layers"),
                });
            }
            _ => n,
        }
    } else {
        usize_of(obj, "num_hidden_layers")?
    };
    let moe = moe(obj, family)?;
    let intermediate_size = match (opt_usize(obj, "intermediate_size")?, &moe) {
        // Granite 4.0's dense MLP is its shared MLP (the experts take `intermediate_size`).
        _ if family == ModelFamily::GraniteMoeHybrid => usize_of(obj, "shared_intermediate_size")?,
        (Some(i), _) => i,
        // Qwen3.5 MoE has no dense MLP (every layer sparse) and no intermediate_size; the
        // experts' width stands in so that the field stays meaningful.
        (None, Some(m)) if family == ModelFamily::Qwen35Moe => m.expert_intermediate,
        (None, _) => return Err(ConfigError::Missing("intermediate_size")),
    };
    let rms_norm_eps = match family {
        ModelFamily::NemotronH => match obj.get("layer_norm_epsilon") {
            Some(v) if !v.is_null() => f32_of(obj, "layer_norm_epsilon", 1e-5)?,
            _ => f32_of(obj, "norm_eps", 1e-5)?,
        },
        _ => f32_of(obj, "rms_norm_eps", 1e-6)?,
    };
    let hybrid = hybrid_config(obj, family, num_layers, moe.as_ref())?;
    let config = ModelConfig {
        family,
        hidden_size,
        intermediate_size,
        num_layers,
        num_heads,
        num_kv_heads: opt_usize(obj, "num_key_value_heads")?.unwrap_or(num_heads),
        head_dim,
        vocab_size: usize_of(obj, "vocab_size")?,
        max_position_embeddings: opt_usize(obj, "max_position_embeddings")?.unwrap_or(4096),
        rms_norm_eps,
        rope_theta: rope_theta(obj)?,
        rope_scaling: rope_scaling(obj)?,
        tie_word_embeddings: bool_of(obj, "tie_word_embeddings", false)?,
        attention_bias: family.qkv_bias() || bool_of(obj, "attention_bias", false)?,
        qk_norm: qk_norm(obj, family)?,
        rotary_dim: rotary_dim(obj, head_dim, family)?,
        bos_token_id: token_ids(obj.get("bos_token_id")).first().copied(),
        eos_token_ids: token_ids(obj.get("eos_token_id")),
        moe,
        hybrid,
        multipliers: multipliers(obj, family)?,
        nope_layers: nope_layers(obj, family, num_layers)?,
    };
    config.validate()?;
    Ok(config)
}

#[cfg(test)]
mod tests {
    use super::*;

    const QWEN3_8B: &str = r#"{"architectures":["Qwen3ForCausalLM"],"attention_bias":false,"bos_token_id":151643,"eos_token_id":151645,
      "head_dim":128,"hidden_act":"silu","hidden_size":4096,"intermediate_size":12288,"max_position_embeddings":40960,
      "model_type":"qwen3","num_attention_heads":32,"num_hidden_layers":36,"num_key_value_heads":8,"rms_norm_eps":1e-06,
      "rope_scaling":null,"rope_theta":1000000,"sliding_window":null,"tie_word_embeddings":false,"torch_dtype":"bfloat16",
      "use_sliding_window":false,"vocab_size":151936}"#;

    const LLAMA31_8B: &str = r#"{"model_type":"llama","hidden_size":4096,"intermediate_size":14336,"num_hidden_layers":32,
      "num_attention_heads":32,"num_key_value_heads":8,"vocab_size":128256,"max_position_embeddings":131072,"rms_norm_eps":1e-05,
      "rope_theta":500000.0,"rope_scaling":{"factor":8.0,"low_freq_factor":1.0,"high_freq_factor":4.0,
      "original_max_position_embeddings":8192,"rope_type":"llama3"},"tie_word_embeddings":false,"bos_token_id":128000,
      "eos_token_id":[128001,128008,128009],"hidden_act":"silu","mlp_bias":false,"attention_bias":false}"#;

    #[test]
    fn qwen3_8b() {
        let c = from_config_json(QWEN3_8B).unwrap();
        assert_eq!(c.family, ModelFamily::Qwen3);
        assert!(c.qk_norm == QkNorm::PerHead && !c.attention_bias && !c.tie_word_embeddings);
        assert_eq!(c.rotary_dim, 128);
        assert_eq!((c.num_heads, c.num_kv_heads, c.head_dim), (32, 8, 128));
        assert_eq!(c.eos_token_ids, vec![151645]);
        // Qwen3-8B has 8.19B parameters.
        let p = c.parameter_count() as f64 / 1e9;
        assert!((8.1..8.3).contains(&p), "{p}");
    }

    #[test]
    fn yarn_as_qwen_documents_it_and_as_transformers_5_writes_it() {
        // Qwen3-8B past 32k tokens, as its model card says to set it.
        let hub = QWEN3_8B.replace(
            "\"rope_scaling\":null",
            r#""rope_scaling":{"rope_type":"yarn","factor":4.0,"original_max_position_embeddings":32768}"#,
        );
        let c = from_config_json(&hub).unwrap();
        let RopeScaling::Yarn {
            factor,
            original_max_position_embeddings,
            beta_fast,
            beta_slow,
            attention_factor,
            truncate,
        } = c.rope_scaling
        else {
            panic!("{:?}", c.rope_scaling)
        };
        assert_eq!((factor, original_max_position_embeddings), (4.0, 32768));
        assert_eq!((beta_fast, beta_slow, truncate), (32.0, 1.0, true));
        assert!((attention_factor - 1.138_629_4).abs() < 1e-6);
        // transformers 5: the same inside rope_parameters, beside the base.
        let t5 = QWEN3_8B.replace("\"rope_scaling\":null,\"rope_theta\":1000000,", "").replace(
            "\"vocab_size\"",
            r#""rope_parameters":{"rope_type":"yarn","factor":4.0,"original_max_position_embeddings":32768,"rope_theta":1000000.0},"vocab_size""#,
        );
        assert_eq!(from_config_json(&t5).unwrap(), c);
        // DeepSeek's mscale pair sets the attention factor: mscale(40, 1) / mscale(40, 1) = 1.
        let deepseek = hub.replace(
            "\"factor\":4.0,",
            "\"factor\":40.0,\"mscale\":1.0,\"mscale_all_dim\":1.0,\"beta_fast\":32,\"beta_slow\":1,",
        );
        match from_config_json(&deepseek).unwrap().rope_scaling {
            RopeScaling::Yarn {
                attention_factor, ..
            } => assert_eq!(attention_factor, 1.0),
            other => panic!("{other:?}"),
        }
        // Scalings not implemented are refused by name.
        let dynamic = QWEN3_8B.replace(
            "\"rope_scaling\":null",
            r#""rope_scaling":{"rope_type":"dynamic","factor":2.0}"#,
        );
        let err = from_config_json(&dynamic).unwrap_err().to_string();
        assert!(err.contains("dynamic") && err.contains("yarn"), "{err}");
    }

    #[test]
    fn llama31_rope_scaling_and_eos_list() {
        let c = from_config_json(LLAMA31_8B).unwrap();
        assert!(
            matches!(c.rope_scaling, RopeScaling::Llama3 { factor, original_max_position_embeddings: 8192, .. } if factor == 8.0)
        );
        assert_eq!(c.eos_token_ids, vec![128001, 128008, 128009]);
        assert_eq!(c.head_dim, 128);
    }

    #[test]
    fn refuses_what_it_does_not_understand() {
        let err = from_config_json(&QWEN3_8B.replace("\"qwen3\"", "\"gemma3\""))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("gemma3") && err.contains("llama, qwen2, qwen3"),
            "{err}"
        );
        let err = from_config_json(&QWEN3_8B.replace("\"silu\"", "\"gelu\""))
            .unwrap_err()
            .to_string();
        assert!(err.contains("hidden_act"), "{err}");
        let err = from_config_json(&QWEN3_8B.replace(
            "\"use_sliding_window\":false",
            "\"use_sliding_window\":true",
        ))
        .unwrap_err()
        .to_string();
        assert!(err.contains("use_sliding_window"), "{err}");
        let err = from_config_json(&QWEN3_8B.replace(
            "\"rope_scaling\":null",
            r#""rope_scaling":{"rope_type":"longrope","factor":4}"#,
        ))
        .unwrap_err()
        .to_string();
        assert!(err.contains("longrope"), "{err}");
        let err = from_config_json(
            &QWEN3_8B.replace("\"num_key_value_heads\":8", "\"num_key_value_heads\":5"),
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("num_key_value_heads"), "{err}");
        let err = from_config_json(&QWEN3_8B.replace("\"hidden_size\":4096,", ""))
            .unwrap_err()
            .to_string();
        assert!(err.contains("hidden_size"), "{err}");
        let err =
            from_config_json(&QWEN3_8B.replace("\"hidden_size\":4096", "\"hidden_size\":\"big\""))
                .unwrap_err()
                .to_string();
        assert!(err.contains("hidden_size"), "{err}");
        assert!(matches!(
            from_config_json("{not json"),
            Err(ConfigError::Syntax(_))
        ));
    }

    /// Qwen3-30B-A3B's config.json as the hub ships it.
    const QWEN3_30B_A3B: &str = r#"{"architectures":["Qwen3MoeForCausalLM"],"attention_bias":false,"attention_dropout":0.0,
      "bos_token_id":151643,"decoder_sparse_step":1,"eos_token_id":151645,"head_dim":128,"hidden_act":"silu",
      "hidden_size":2048,"initializer_range":0.02,"intermediate_size":6144,"max_position_embeddings":40960,
      "max_window_layers":48,"mlp_only_layers":[],"model_type":"qwen3_moe","moe_intermediate_size":768,
      "norm_topk_prob":true,"num_attention_heads":32,"num_experts":128,"num_experts_per_tok":8,
      "num_hidden_layers":48,"num_key_value_heads":4,"output_router_logits":false,"rms_norm_eps":1e-06,
      "rope_scaling":null,"rope_theta":1000000.0,"router_aux_loss_coef":0.001,"sliding_window":null,
      "tie_word_embeddings":false,"torch_dtype":"bfloat16","use_cache":true,"use_sliding_window":false,
      "vocab_size":151936}"#;

    #[test]
    fn qwen3_30b_a3b_is_sparse_in_every_layer() {
        let c = from_config_json(QWEN3_30B_A3B).unwrap();
        assert_eq!(c.family, ModelFamily::Qwen3Moe);
        assert!(c.qk_norm == QkNorm::PerHead && !c.attention_bias);
        let m = c.moe.as_ref().unwrap();
        assert_eq!(
            (m.num_experts, m.top_k, m.expert_intermediate),
            (128, 8, 768)
        );
        assert!(m.norm_topk_prob && m.shared_expert_intermediate.is_none());
        assert!((0..48).all(|l| m.is_sparse(l)));
        // 30.5B parameters, as the model card says.
        let p = c.parameter_count() as f64 / 1e9;
        assert!((30.3..30.7).contains(&p), "{p}");
    }

    #[test]
    fn qwen2_moe_has_a_shared_expert_and_sparse_steps() {
        let text = QWEN3_30B_A3B
            .replace("\"qwen3_moe\"", "\"qwen2_moe\"")
            .replace("\"decoder_sparse_step\":1", "\"decoder_sparse_step\":2")
            .replace("\"mlp_only_layers\":[]", "\"mlp_only_layers\":[3]")
            .replace(
                "\"norm_topk_prob\":true,",
                "\"shared_expert_intermediate_size\":5632,",
            );
        let c = from_config_json(&text).unwrap();
        assert!(c.attention_bias && c.qk_norm == QkNorm::None);
        let m = c.moe.unwrap();
        assert_eq!(m.shared_expert_intermediate, Some(5632));
        assert!(!m.norm_topk_prob);
        let sparse: Vec<usize> = (0..8).filter(|&l| m.is_sparse(l)).collect();
        assert_eq!(sparse, [1, 5, 7]);
        // Without its shared expert's width, a Qwen2-MoE config is refused by name.
        let err = from_config_json(&text.replace("\"shared_expert_intermediate_size\":5632,", ""))
            .unwrap_err()
            .to_string();
        assert!(err.contains("shared_expert_intermediate_size"), "{err}");
        let err = from_config_json(
            &QWEN3_30B_A3B.replace("\"num_experts_per_tok\":8", "\"num_experts_per_tok\":129"),
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("num_experts_per_tok"), "{err}");
    }

    #[test]
    fn transformers_5_names_read_as_the_hubs() {
        let text = QWEN3_30B_A3B
            .replace("\"num_experts\":128", "\"num_local_experts\":128")
            .replace(
                "\"rope_theta\":1000000.0,",
                "\"rope_parameters\":{\"rope_theta\":1000000.0,\"rope_type\":\"default\"},",
            );
        let c = from_config_json(&text).unwrap();
        assert_eq!(c, from_config_json(QWEN3_30B_A3B).unwrap());
        let llama3 = LLAMA31_8B.replace(
            "\"rope_theta\":500000.0,\"rope_scaling\":{",
            "\"rope_parameters\":{\"rope_theta\":500000.0,",
        );
        assert_eq!(
            from_config_json(&llama3).unwrap(),
            from_config_json(LLAMA31_8B).unwrap()
        );
    }

    /// MiniMax-M2's config.json as the hub ships it (its quantization block left out: the engine
    /// reads BF16 checkpoints).
    const MINIMAX_M2: &str = r#"{"architectures":["MiniMaxM2ForCausalLM"],"attn_type_list":[1,1,1,1],
      "bos_token_id":null,"eos_token_id":null,"head_dim":128,"hidden_act":"silu","hidden_size":3072,
      "intermediate_size":1536,"max_position_embeddings":196608,"model_type":"minimax_m2",
      "mtp_transformer_layers":1,"num_attention_heads":48,"num_experts_per_tok":8,"num_hidden_layers":62,
      "num_key_value_heads":8,"num_local_experts":256,"num_mtp_modules":3,"qk_norm_type":"per_layer",
      "rms_norm_eps":1e-06,"rope_theta":5000000,"rotary_dim":64,"scoring_func":"sigmoid",
      "shared_intermediate_size":0,"tie_word_embeddings":false,"use_cache":true,"use_mtp":true,
      "use_qk_norm":true,"use_routing_bias":true,"vocab_size":200064}"#;

    #[test]
    fn minimax_m2_has_whole_projection_qk_norm_partial_rope_and_biased_sigmoid_routing() {
        let c = from_config_json(MINIMAX_M2).unwrap();
        assert_eq!(c.family, ModelFamily::MiniMaxM2);
        assert_eq!(c.qk_norm, QkNorm::Whole);
        assert_eq!((c.head_dim, c.rotary_dim), (128, 64));
        assert_eq!((c.num_heads, c.num_kv_heads, c.hidden_size), (48, 8, 3072));
        assert_eq!(c.rope_theta, 5e6);
        let m = c.moe.as_ref().unwrap();
        assert_eq!(
            (m.num_experts, m.top_k, m.expert_intermediate),
            (256, 8, 1536)
        );
        assert_eq!(m.router, RouterKind::SigmoidBias);
        assert!(m.norm_topk_prob && m.shared_expert_intermediate.is_none());
        assert!((0..62).all(|l| m.is_sparse(l)));
        // 230B parameters, as the model card says.
        let p = c.parameter_count() as f64 / 1e9;
        assert!((228.0..231.0).contains(&p), "{p}");
    }

    /// Mistral-7B-Instruct-v0.3's and Mistral-Nemo-Instruct-2407's config.json as the hub ships
    /// them.
    const MISTRAL_7B_V03: &str = r#"{"architectures":["MistralForCausalLM"],"attention_dropout":0.0,"bos_token_id":1,
      "eos_token_id":2,"hidden_act":"silu","hidden_size":4096,"initializer_range":0.02,"intermediate_size":14336,
      "max_position_embeddings":32768,"model_type":"mistral","num_attention_heads":32,"num_hidden_layers":32,
      "num_key_value_heads":8,"rms_norm_eps":1e-05,"rope_theta":1000000.0,"sliding_window":null,
      "tie_word_embeddings":false,"torch_dtype":"bfloat16","use_cache":true,"vocab_size":32768}"#;
    const MISTRAL_NEMO: &str = r#"{"architectures":["MistralForCausalLM"],"attention_dropout":0.0,"bos_token_id":1,
      "eos_token_id":2,"head_dim":128,"hidden_act":"silu","hidden_size":5120,"initializer_range":0.02,
      "intermediate_size":14336,"max_position_embeddings":1024000,"model_type":"mistral","num_attention_heads":32,
      "num_hidden_layers":40,"num_key_value_heads":8,"rms_norm_eps":1e-05,"rope_theta":1000000.0,
      "sliding_window":null,"tie_word_embeddings":false,"torch_dtype":"bfloat16","use_cache":true,
      "vocab_size":131072}"#;

    #[test]
    fn mistral_is_llamas_decoder() {
        let m = from_config_json(MISTRAL_7B_V03).unwrap();
        assert_eq!(m.family, ModelFamily::Mistral);
        // The same model as a Llama config of those keys, but for the family.
        let as_llama = MISTRAL_7B_V03.replace("\"mistral\"", "\"llama\"");
        let l = from_config_json(&as_llama).unwrap();
        assert_eq!(
            ModelConfig {
                family: ModelFamily::Llama,
                ..m.clone()
            },
            l
        );
        let p = m.parameter_count() as f64 / 1e9;
        assert!((7.2..7.3).contains(&p), "{p}");
        // Mistral-Nemo: head_dim 128 beside a hidden size of 5120 (32 heads).
        let n = from_config_json(MISTRAL_NEMO).unwrap();
        assert_eq!((n.hidden_size, n.num_heads, n.head_dim), (5120, 32, 128));
        let p = n.parameter_count() as f64 / 1e9;
        assert!((12.1..12.4).contains(&p), "{p}");
        // Mistral-7B-v0.1's 4096-token window over a 32768-token context is refused.
        let v01 = MISTRAL_7B_V03.replace("\"sliding_window\":null", "\"sliding_window\":4096");
        let err = from_config_json(&v01).unwrap_err().to_string();
        assert!(err.contains("sliding_window"), "{err}");
    }

    /// Granite-3.3-8B-Instruct's config.json as the hub ships it.
    const GRANITE_33_8B: &str = r#"{"architectures":["GraniteForCausalLM"],"attention_bias":false,"attention_dropout":0.0,
      "attention_multiplier":0.0078125,"bos_token_id":0,"embedding_multiplier":12.0,"eos_token_id":0,"hidden_act":"silu",
      "hidden_size":4096,"initializer_range":0.02,"intermediate_size":12800,"logits_scaling":16.0,
      "max_position_embeddings":131072,"mlp_bias":false,"model_type":"granite","num_attention_heads":32,
      "num_hidden_layers":40,"num_key_value_heads":8,"pad_token_id":0,"residual_multiplier":0.22,"rms_norm_eps":1e-05,
      "rope_scaling":null,"rope_theta":10000000.0,"tie_word_embeddings":true,"torch_dtype":"bfloat16",
      "use_cache":true,"vocab_size":49159}"#;

    #[test]
    fn granite_is_llama_with_four_multipliers() {
        let c = from_config_json(GRANITE_33_8B).unwrap();
        assert_eq!(c.family, ModelFamily::Granite);
        assert_eq!(
            c.multipliers,
            Multipliers {
                embedding: 12.0,
                residual: 0.22,
                attention: Some(0.0078125),
                logits: 16.0
            }
        );
        assert!(c.tie_word_embeddings && c.moe.is_none());
        let p = c.parameter_count() as f64 / 1e9;
        assert!((8.1..8.2).contains(&p), "{p}");
        // Other families have none.
        assert_eq!(
            from_config_json(MISTRAL_7B_V03).unwrap().multipliers,
            Multipliers::default()
        );
        // A multiplier must be a positive number.
        let zero = GRANITE_33_8B.replace("\"logits_scaling\":16.0", "\"logits_scaling\":0");
        let err = from_config_json(&zero).unwrap_err().to_string();
        assert!(err.contains("logits_scaling"), "{err}");
    }

    /// Granite 4.0-H's keys as its hub configs spell them (`layer_types` of `mamba` /
    /// `attention`, `mamba_d_head` "auto", `position_embedding_type` "nope"), at a made-up small
    /// shape.
    const GRANITE_4_H: &str = r#"{"architectures":["GraniteMoeHybridForCausalLM"],"model_type":"granitemoehybrid",
      "hidden_size":1536,"num_hidden_layers":4,"layer_types":["mamba","mamba","attention","mamba"],
      "num_attention_heads":12,"num_key_value_heads":4,"intermediate_size":512,"shared_intermediate_size":1024,
      "num_local_experts":64,"num_experts_per_tok":6,"position_embedding_type":"nope","rms_norm_eps":1e-05,
      "mamba_n_heads":48,"mamba_d_head":"auto","mamba_d_state":128,"mamba_n_groups":1,"mamba_d_conv":4,
      "mamba_expand":2,"mamba_chunk_size":256,"mamba_conv_bias":true,"mamba_proj_bias":false,
      "embedding_multiplier":12,"residual_multiplier":0.22,"attention_multiplier":0.0078125,
      "logits_scaling":6,"max_position_embeddings":131072,"vocab_size":100352,"tie_word_embeddings":true,
      "rope_theta":10000}"#;

    #[test]
    fn granite_4_h_is_mamba_and_attention_with_experts_and_a_shared_mlp() {
        use crate::hybrid::{Ffn, Mixer};
        let c = from_config_json(GRANITE_4_H).unwrap();
        assert_eq!(c.family, ModelFamily::GraniteMoeHybrid);
        let h = c.hybrid.as_ref().unwrap();
        let mixers: Vec<_> = h.layers.iter().map(|l| l.mixer.unwrap()).collect();
        assert_eq!(
            mixers,
            [
                Mixer::Mamba2,
                Mixer::Mamba2,
                Mixer::Attention,
                Mixer::Mamba2
            ]
        );
        assert!(h.layers.iter().all(|l| l.ffn == Some(Ffn::Sparse)));
        assert!(!h.attention_rope);
        let m = h.mamba2.unwrap();
        assert_eq!(
            (m.heads, m.head_dim, m.state_size, m.groups),
            (48, 64, 128, 1)
        );
        let moe = c.moe.as_ref().unwrap();
        assert_eq!(
            (moe.num_experts, moe.top_k, moe.expert_intermediate),
            (64, 6, 512)
        );
        assert_eq!(
            (moe.shared_expert_intermediate, moe.shared_expert_gated),
            (Some(1024), false)
        );
        assert!(moe.norm_topk_prob && moe.router == RouterKind::Softmax);
        assert_eq!(c.multipliers.residual, 0.22);
        // Without experts the shared MLP is every layer's dense MLP; RoPE where it says so.
        let dense = GRANITE_4_H
            .replace("\"num_local_experts\":64", "\"num_local_experts\":0")
            .replace("\"nope\"", "\"rope\"");
        let c = from_config_json(&dense).unwrap();
        let h = c.hybrid.as_ref().unwrap();
        assert!(c.moe.is_none() && h.attention_rope);
        assert!(h.layers.iter().all(|l| l.ffn == Some(Ffn::Dense)));
        assert_eq!(c.intermediate_size, 1024);
        // Mamba-2 groups beyond one are refused (Granite's gated norm spans them all).
        let groups = GRANITE_4_H.replace("\"mamba_n_groups\":1", "\"mamba_n_groups\":2");
        let err = from_config_json(&groups).unwrap_err().to_string();
        assert!(err.contains("mamba_n_groups"), "{err}");
    }

    #[test]
    fn granite_moe_with_and_without_its_shared_mlp() {
        let moe = GRANITE_33_8B
            .replace("\"granite\"", "\"granitemoe\"")
            .replace(
                "\"intermediate_size\":12800",
                "\"intermediate_size\":512,\"num_local_experts\":40,\"num_experts_per_tok\":8",
            );
        let c = from_config_json(&moe).unwrap();
        assert_eq!(c.family, ModelFamily::GraniteMoe);
        let m = c.moe.as_ref().unwrap();
        assert_eq!(
            (m.num_experts, m.top_k, m.expert_intermediate),
            (40, 8, 512)
        );
        assert!(m.norm_topk_prob && m.router == RouterKind::Softmax);
        assert!(m.shared_expert_intermediate.is_none() && (0..40).all(|l| m.is_sparse(l)));
        assert_eq!(c.multipliers.embedding, 12.0);
        let shared = moe
            .replace("\"granitemoe\"", "\"granitemoeshared\"")
            .replace(
                "\"num_local_experts\":40",
                "\"num_local_experts\":40,\"shared_intermediate_size\":1024",
            );
        let c = from_config_json(&shared).unwrap();
        assert_eq!(c.family, ModelFamily::GraniteMoe);
        let m = c.moe.as_ref().unwrap();
        assert_eq!(
            (m.shared_expert_intermediate, m.shared_expert_gated),
            (Some(1024), false)
        );
    }

    #[test]
    fn smollm3_leaves_every_fourth_layer_without_rope() {
        // SmolLM3-3B's shape (transformers' SmolLM3Config defaults), the list left to its default.
        let c = from_config_json(
            r#"{"model_type":"smollm3","hidden_size":2048,"intermediate_size":11008,
                "num_hidden_layers":36,"num_attention_heads":16,"num_key_value_heads":4,
                "vocab_size":128256,"max_position_embeddings":65536,"rope_theta":5000000.0,
                "tie_word_embeddings":true,"use_sliding_window":false}"#,
        )
        .unwrap();
        assert_eq!(c.family, ModelFamily::SmolLm3);
        assert_eq!(c.nope_layers, (3..36).step_by(4).collect::<Vec<_>>());
        let p = c.parameter_count() as f64 / 1e9;
        assert!((3.0..3.2).contains(&p), "{p}");
        // Given explicitly, its zeros; other families have none.
        let list = (0..36)
            .map(|l| if l == 5 { "0" } else { "1" })
            .collect::<Vec<_>>()
            .join(",");
        let explicit = format!(
            r#"{{"model_type":"smollm3","hidden_size":2048,"intermediate_size":11008,
                "num_hidden_layers":36,"num_attention_heads":16,"num_key_value_heads":4,
                "vocab_size":128256,"no_rope_layers":[{list}]}}"#
        );
        assert_eq!(from_config_json(&explicit).unwrap().nope_layers, vec![5]);
        assert!(from_config_json(QWEN3_8B).unwrap().nope_layers.is_empty());
        let short = explicit.replace("[1,", "[");
        let err = from_config_json(&short).unwrap_err().to_string();
        assert!(err.contains("no_rope_layers"), "{err}");
    }

    /// Phi-4's config.json as the hub ships it.
    const PHI_4: &str = r#"{"architectures":["Phi3ForCausalLM"],"attention_bias":false,"attention_dropout":0.0,
      "bos_token_id":100257,"embd_pdrop":0.0,"eos_token_id":100265,"hidden_act":"silu","hidden_size":5120,
      "initializer_range":0.02,"intermediate_size":17920,"max_position_embeddings":16384,"model_type":"phi3",
      "num_attention_heads":40,"num_hidden_layers":40,"num_key_value_heads":10,
      "original_max_position_embeddings":16384,"pad_token_id":100349,"resid_pdrop":0.0,"rms_norm_eps":1e-05,
      "rope_scaling":null,"rope_theta":250000,"sliding_window":null,"tie_word_embeddings":false,
      "torch_dtype":"bfloat16","use_cache":true,"vocab_size":100352}"#;

    #[test]
    fn phi4_is_llamas_decoder_with_fused_projections() {
        let c = from_config_json(PHI_4).unwrap();
        assert_eq!(c.family, ModelFamily::Phi3);
        assert!(c.family.fused_projections());
        assert_eq!((c.num_heads, c.num_kv_heads, c.head_dim), (40, 10, 128));
        let p = c.parameter_count() as f64 / 1e9;
        assert!((14.6..14.7).contains(&p), "{p}");
        // Phi-3-mini-4k's 2047-token window and Phi-3.5's longrope are refused by name.
        let windowed = PHI_4.replace("\"sliding_window\":null", "\"sliding_window\":2047");
        assert!(
            from_config_json(&windowed)
                .unwrap_err()
                .to_string()
                .contains("sliding_window")
        );
        let long = PHI_4.replace(
            "\"rope_scaling\":null",
            r#""rope_scaling":{"type":"longrope","long_factor":[1.0],"short_factor":[1.0]}"#,
        );
        let err = from_config_json(&long).unwrap_err().to_string();
        assert!(err.contains("longrope"), "{err}");
    }

    #[test]
    fn seed_oss_has_qkv_biases_and_groups_of_ten() {
        // Seed-OSS-36B's widths.
        let c = from_config_json(
            r#"{"model_type":"seed_oss","hidden_size":5120,"intermediate_size":27648,
                "num_hidden_layers":64,"num_attention_heads":80,"num_key_value_heads":8,
                "head_dim":128,"vocab_size":155136,"max_position_embeddings":524288,
                "rope_theta":10000000.0,"attention_bias":true,"attention_out_bias":false,
                "mlp_bias":false,"tie_word_embeddings":false}"#,
        )
        .unwrap();
        assert_eq!(c.family, ModelFamily::SeedOss);
        assert!(c.attention_bias && c.qk_norm == QkNorm::None);
        let p = c.parameter_count() as f64 / 1e9;
        assert!((36.0..36.3).contains(&p), "{p}");
        let out_bias = r#"{"model_type":"seed_oss","hidden_size":64,"intermediate_size":128,
            "num_hidden_layers":1,"num_attention_heads":1,"vocab_size":32,
            "attention_out_bias":true}"#;
        let err = from_config_json(out_bias).unwrap_err().to_string();
        assert!(err.contains("attention_out_bias"), "{err}");
    }

    /// Mixtral-8x7B-v0.1's config.json as the hub ships it.
    const MIXTRAL_8X7B: &str = r#"{"architectures":["MixtralForCausalLM"],"attention_dropout":0.0,"bos_token_id":1,
      "eos_token_id":2,"hidden_act":"silu","hidden_size":4096,"initializer_range":0.02,"intermediate_size":14336,
      "max_position_embeddings":32768,"model_type":"mixtral","num_attention_heads":32,"num_experts_per_tok":2,
      "num_hidden_layers":32,"num_key_value_heads":8,"num_local_experts":8,"output_router_logits":false,
      "rms_norm_eps":1e-05,"rope_theta":1000000.0,"router_aux_loss_coef":0.02,"sliding_window":null,
      "tie_word_embeddings":false,"torch_dtype":"bfloat16","use_cache":true,"vocab_size":32000}"#;

    /// OLMoE-1B-7B-0924's config.json as the hub ships it.
    const OLMOE_1B_7B: &str = r#"{"architectures":["OlmoeForCausalLM"],"attention_bias":false,"attention_dropout":0.0,
      "clip_qkv":null,"eos_token_id":50279,"hidden_act":"silu","hidden_size":2048,"initializer_range":0.02,
      "intermediate_size":1024,"max_position_embeddings":4096,"model_type":"olmoe","norm_topk_prob":false,
      "num_attention_heads":16,"num_experts":64,"num_experts_per_tok":8,"num_hidden_layers":16,
      "num_key_value_heads":16,"output_router_logits":false,"pad_token_id":1,"rms_norm_eps":1e-05,
      "rope_scaling":null,"rope_theta":10000.0,"router_aux_loss_coef":0.01,"tie_word_embeddings":false,
      "torch_dtype":"bfloat16","use_cache":true,"vocab_size":50304}"#;

    #[test]
    fn mixtral_and_olmoe_have_sparse_mlps_in_every_layer() {
        let c = from_config_json(MIXTRAL_8X7B).unwrap();
        assert_eq!(c.family, ModelFamily::Mixtral);
        assert_eq!((c.qk_norm, c.attention_bias), (QkNorm::None, false));
        assert_eq!((c.head_dim, c.rotary_dim, c.num_kv_heads), (128, 128, 8));
        let m = c.moe.as_ref().unwrap();
        assert_eq!(
            (m.num_experts, m.top_k, m.expert_intermediate),
            (8, 2, 14336)
        );
        assert_eq!(m.router, RouterKind::Softmax);
        assert!(m.norm_topk_prob, "Mixtral renormalises its top 2");
        assert!(m.shared_expert_intermediate.is_none());
        assert!((0..32).all(|l| m.is_sparse(l)));
        // 46.7B parameters, as the model card says.
        let p = c.parameter_count() as f64 / 1e9;
        assert!((46.6..46.8).contains(&p), "{p}");

        let c = from_config_json(OLMOE_1B_7B).unwrap();
        assert_eq!(c.family, ModelFamily::Olmoe);
        assert_eq!(c.qk_norm, QkNorm::Whole);
        let m = c.moe.as_ref().unwrap();
        assert_eq!(
            (m.num_experts, m.top_k, m.expert_intermediate),
            (64, 8, 1024)
        );
        assert!(
            !m.norm_topk_prob,
            "OLMoE keeps the softmax weights of its top 8"
        );
        assert!((0..16).all(|l| m.is_sparse(l)));
        // 6.9B parameters in all.
        let p = c.parameter_count() as f64 / 1e9;
        assert!((6.85..6.95).contains(&p), "{p}");
        let renormalised =
            OLMOE_1B_7B.replace("\"norm_topk_prob\":false", "\"norm_topk_prob\":true");
        assert!(
            from_config_json(&renormalised)
                .unwrap()
                .moe
                .unwrap()
                .norm_topk_prob
        );
    }

    /// GLM-4.5-Air's config.json as the hub ships it (the defaults of transformers' Glm4MoeConfig).
    const GLM45_AIR: &str = r#"{"architectures":["Glm4MoeForCausalLM"],"attention_bias":true,"attention_dropout":0.0,
      "pad_token_id":151329,"eos_token_id":[151329,151336,151338],"head_dim":128,"hidden_act":"silu",
      "hidden_size":4096,"partial_rotary_factor":0.5,"initializer_range":0.02,"intermediate_size":10944,
      "max_position_embeddings":131072,"model_type":"glm4_moe","moe_intermediate_size":1408,"norm_topk_prob":true,
      "num_attention_heads":96,"n_group":1,"topk_group":1,"n_routed_experts":128,"n_shared_experts":1,
      "routed_scaling_factor":1.0,"num_experts_per_tok":8,"first_k_dense_replace":1,"num_hidden_layers":46,
      "num_key_value_heads":8,"rms_norm_eps":1e-05,"rope_scaling":null,"rope_theta":1000000,
      "num_nextn_predict_layers":1,"tie_word_embeddings":false,"torch_dtype":"bfloat16","use_cache":true,
      "use_qk_norm":false,"vocab_size":151552}"#;

    #[test]
    fn glm45_has_a_dense_first_layer_biased_sigmoid_routing_and_an_ungated_shared_expert() {
        let c = from_config_json(GLM45_AIR).unwrap();
        assert_eq!(c.family, ModelFamily::Glm4Moe);
        assert!(c.attention_bias);
        assert_eq!(c.qk_norm, QkNorm::None);
        assert_eq!((c.num_heads, c.head_dim, c.rotary_dim), (96, 128, 64));
        assert_eq!(c.eos_token_ids, vec![151329, 151336, 151338]);
        let m = c.moe.as_ref().unwrap();
        assert_eq!(
            (m.num_experts, m.top_k, m.expert_intermediate),
            (128, 8, 1408)
        );
        assert_eq!(m.router, RouterKind::SigmoidBias);
        assert_eq!(
            (m.shared_expert_intermediate, m.shared_expert_gated),
            (Some(1408), false)
        );
        assert!(!m.is_sparse(0) && (1..46).all(|l| m.is_sparse(l)));
        // 106B parameters without the multi-token-prediction layer, as the model card counts.
        let p = c.parameter_count() as f64 / 1e9;
        assert!((105.5..107.5).contains(&p), "{p}");
        // GLM-4.5's variants: per-head QK-norm, scaled weights, two shared experts, the default
        // rotary half when the config leaves it out.
        let variant = GLM45_AIR
            .replace("\"use_qk_norm\":false", "\"use_qk_norm\":true")
            .replace(
                "\"routed_scaling_factor\":1.0",
                "\"routed_scaling_factor\":2.5",
            )
            .replace("\"n_shared_experts\":1", "\"n_shared_experts\":2")
            .replace("\"first_k_dense_replace\":1", "\"first_k_dense_replace\":3")
            .replace("\"partial_rotary_factor\":0.5,", "");
        let c = from_config_json(&variant).unwrap();
        let m = c.moe.as_ref().unwrap();
        assert_eq!((c.qk_norm, c.rotary_dim), (QkNorm::PerHead, 64));
        assert_eq!(
            (m.routed_scaling, m.shared_expert_intermediate),
            (2.5, Some(2816))
        );
        assert!((0..3).all(|l| !m.is_sparse(l)) && m.is_sparse(3));
        // DeepSeek-V3's grouped routing is refused.
        let grouped = GLM45_AIR.replace("\"n_group\":1", "\"n_group\":8");
        let err = from_config_json(&grouped).unwrap_err().to_string();
        assert!(err.contains("n_group") && err.contains("grouped"), "{err}");
    }

    #[test]
    fn a_window_shorter_than_the_context_and_clipped_qkv_are_refused() {
        // Mistral-7B-v0.1-style window: applied by transformers whenever it is set.
        let windowed = MIXTRAL_8X7B.replace("\"sliding_window\":null", "\"sliding_window\":4096");
        let err = from_config_json(&windowed).unwrap_err().to_string();
        assert!(
            err.contains("sliding_window") && err.contains("4096"),
            "{err}"
        );
        // A window as long as the context changes nothing.
        let inert = MIXTRAL_8X7B.replace("\"sliding_window\":null", "\"sliding_window\":32768");
        assert_eq!(
            from_config_json(&inert).unwrap(),
            from_config_json(MIXTRAL_8X7B).unwrap()
        );
        let clipped = OLMOE_1B_7B.replace("\"clip_qkv\":null", "\"clip_qkv\":8.0");
        let err = from_config_json(&clipped).unwrap_err().to_string();
        assert!(err.contains("clip_qkv"), "{err}");
    }

    #[test]
    fn minimax_m2_as_transformers_5_writes_it_reads_as_the_hubs() {
        // transformers' own config: no rotary_dim or routing keys, the rotary fraction inside
        // rope_parameters.
        let t5 = r#"{"model_type":"minimax_m2","head_dim":128,"hidden_act":"silu","hidden_size":3072,
          "intermediate_size":1536,"max_position_embeddings":196608,"num_attention_heads":48,
          "num_experts_per_tok":8,"num_hidden_layers":62,"num_key_value_heads":8,"num_local_experts":256,
          "rms_norm_eps":1e-06,"rope_parameters":{"rope_type":"default",
          "rope_theta":5000000.0,"partial_rotary_factor":0.5},"tie_word_embeddings":false,"vocab_size":200064}"#;
        assert_eq!(
            from_config_json(t5).unwrap(),
            from_config_json(MINIMAX_M2).unwrap()
        );
        let top_level = t5.replace(
            "\"vocab_size\":200064",
            "\"vocab_size\":200064,\"partial_rotary_factor\":0.25",
        );
        // rope_parameters' factor wins over a stray top-level one; alone, the top-level one counts.
        assert_eq!(from_config_json(&top_level).unwrap().rotary_dim, 64);
        let alone = top_level.replace(",\"partial_rotary_factor\":0.5", "");
        assert_ne!(alone, top_level);
        assert_eq!(from_config_json(&alone).unwrap().rotary_dim, 32);
    }

    #[test]
    fn minimax_m2_variants_it_does_not_implement_are_refused_by_name() {
        for (from, to, key) in [
            ("\"sigmoid\"", "\"softmax\"", "scoring_func"),
            (
                "\"use_routing_bias\":true",
                "\"use_routing_bias\":false",
                "use_routing_bias",
            ),
            ("\"per_layer\"", "\"per_head\"", "qk_norm_type"),
            (
                "\"use_qk_norm\":true",
                "\"use_qk_norm\":false",
                "use_qk_norm",
            ),
            (
                "\"shared_intermediate_size\":0",
                "\"shared_intermediate_size\":512",
                "shared_intermediate_size",
            ),
            ("[1,1,1,1]", "[1,0,1,1]", "attn_type_list"),
            ("\"rotary_dim\":64", "\"rotary_dim\":65", "rotary_dim"),
            ("\"rotary_dim\":64", "\"rotary_dim\":256", "rotary_dim"),
            (
                "\"rotary_dim\":64",
                "\"rotary_dim\":64,\"partial_rotary_factor\":1.0",
                "rotary_dim",
            ),
        ] {
            let text = MINIMAX_M2.replace(from, to);
            assert_ne!(text, MINIMAX_M2, "{from}");
            let err = from_config_json(&text).unwrap_err().to_string();
            assert!(err.contains(key), "{key}: {err}");
        }
    }

    #[test]
    fn qwen2_always_has_qkv_bias() {
        let text = QWEN3_8B.replace("\"qwen3\"", "\"qwen2\"");
        let c = from_config_json(&text).unwrap();
        assert!(c.attention_bias && c.qk_norm == QkNorm::None);
    }
}
