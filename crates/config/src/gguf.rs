// SPDX-License-Identifier: MIT OR Apache-2.0
//! GGUF metadata (the key-value header of a `.gguf` file) as a model config.

use std::collections::BTreeMap;

use crate::{
    ConfigError, ModelConfig, ModelFamily, MoeConfig, Multipliers, RopeScaling, RouterKind,
};

/// A GGUF metadata value, widened: every integer type to `U64`/`I64`, every float to `F64`.
#[derive(Clone, Debug, PartialEq)]
pub enum MetaValue {
    /// Unsigned integers (u8..u64).
    U64(u64),
    /// Signed integers (i8..i64).
    I64(i64),
    /// f32 and f64.
    F64(f64),
    /// bool.
    Bool(bool),
    /// UTF-8 string.
    Str(String),
    /// An array of values.
    Array(Vec<MetaValue>),
}

impl MetaValue {
    /// The value as an unsigned integer, if it is a non-negative integer.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            MetaValue::U64(v) => Some(v),
            MetaValue::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }
    /// The value as a float, if it is a number.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            MetaValue::F64(v) => Some(v),
            MetaValue::U64(v) => Some(v as f64),
            MetaValue::I64(v) => Some(v as f64),
            _ => None,
        }
    }
    /// The value as a bool.
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            MetaValue::Bool(v) => Some(v),
            _ => None,
        }
    }
    /// The value as a string.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            MetaValue::Str(s) => Some(s),
            _ => None,
        }
    }
    /// The value as an array.
    pub fn as_array(&self) -> Option<&[MetaValue]> {
        match self {
            MetaValue::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// Builds the config from GGUF metadata. `has_output_tensor` says whether the file has a separate
/// `output.weight` (an untied LM head); GGUF has no key for it.
pub fn from_gguf_metadata(
    meta: &BTreeMap<String, MetaValue>,
    has_output_tensor: bool,
) -> Result<ModelConfig, ConfigError> {
    let arch = meta
        .get("general.architecture")
        .and_then(MetaValue::as_str)
        .ok_or(ConfigError::Missing("general.architecture"))?;
    let key = |k: &str| format!("{arch}.{k}");
    // llama.cpp names the MoE architectures without the underscore, and writes Mixtral as
    // `llama` with experts.
    let family = match arch {
        "qwen3moe" => ModelFamily::Qwen3Moe,
        "qwen2moe" => ModelFamily::Qwen2Moe,
        "llama"
            if meta
                .get(&key("expert_count"))
                .and_then(MetaValue::as_u64)
                .is_some_and(|n| n > 0) =>
        {
            ModelFamily::Mixtral
        }
        other => ModelFamily::parse(other)?,
    };
    if !matches!(
        family,
        ModelFamily::Llama
            | ModelFamily::Qwen2
            | ModelFamily::Qwen3
            | ModelFamily::Qwen2Moe
            | ModelFamily::Qwen3Moe
            | ModelFamily::Mixtral
            | ModelFamily::Phi3
            | ModelFamily::Granite
    ) {
        return Err(ConfigError::Unsupported {
            key: "general.architecture".into(),
            value: arch.to_string(),
            why: "GGUF files are read for llama (with or without experts), qwen2, qwen3, \
                  qwen2moe, qwen3moe, phi3 and granite; load this family from its HF checkpoint",
        });
    }
    let uint = |k: &'static str| -> Result<usize, ConfigError> {
        meta.get(&key(k))
            .and_then(MetaValue::as_u64)
            .map(|v| v as usize)
            .ok_or(ConfigError::Missing(k))
    };
    let opt_uint = |k: &str| {
        meta.get(&key(k))
            .and_then(MetaValue::as_u64)
            .map(|v| v as usize)
    };
    let float = |k: &str, default: f64| {
        meta.get(&key(k))
            .and_then(MetaValue::as_f64)
            .unwrap_or(default) as f32
    };

    let rope_scaling = match meta
        .get(&key("rope.scaling.type"))
        .and_then(MetaValue::as_str)
    {
        None | Some("none") => RopeScaling::None,
        Some("linear") => RopeScaling::Linear {
            factor: float("rope.scaling.factor", 1.0),
        },
        Some(other) => {
            return Err(ConfigError::Unsupported {
                key: key("rope.scaling.type"),
                value: other.to_string(),
                why: "supported GGUF RoPE scalings: none, linear",
            });
        }
    };
    if let Some(window) = opt_uint("attention.sliding_window") {
        return Err(ConfigError::Unsupported {
            key: key("attention.sliding_window"),
            value: window.to_string(),
            why: "sliding-window attention is not implemented",
        });
    }
    let hidden_size = uint("embedding_length")?;
    let num_heads = uint("attention.head_count")?;
    let vocab_size = opt_uint("vocab_size")
        .or_else(|| {
            meta.get("tokenizer.ggml.tokens")
                .and_then(MetaValue::as_array)
                .map(<[_]>::len)
        })
        .ok_or(ConfigError::Missing("vocab_size"))?;
    let token = |k: &str| meta.get(k).and_then(MetaValue::as_u64).map(|v| v as u32);
    let head_dim = opt_uint("attention.key_length").unwrap_or(hidden_size / num_heads.max(1));
    let moe = match family {
        ModelFamily::Qwen3Moe | ModelFamily::Qwen2Moe | ModelFamily::Mixtral => Some(MoeConfig {
            num_experts: uint("expert_count")?,
            top_k: uint("expert_used_count")?,
            // Mixtral's files give the experts' width as the feed-forward length.
            expert_intermediate: match (family, opt_uint("expert_feed_forward_length")) {
                (_, Some(n)) => n,
                (ModelFamily::Mixtral, None) => uint("feed_forward_length")?,
                (_, None) => uint("expert_feed_forward_length")?,
            },
            // llama.cpp's graphs renormalise Qwen3-MoE's and Mixtral's top k and not
            // Qwen2-MoE's, as transformers does; a file that says otherwise is followed.
            norm_topk_prob: meta
                .get(&key("expert_weights_norm"))
                .and_then(MetaValue::as_bool)
                .unwrap_or(family != ModelFamily::Qwen2Moe),
            router: RouterKind::Softmax,
            routed_scaling: float("expert_weights_scale", 1.0),
            shared_expert_intermediate: opt_uint("expert_shared_feed_forward_length"),
            // Qwen2-MoE's shared expert has its sigmoid gate (`ffn_gate_inp_shexp`).
            shared_expert_gated: opt_uint("expert_shared_feed_forward_length").is_some(),
            // Every layer sparse: a converted file's layers hold `ffn_gate_inp` each (a layer
            // without it fails at load, naming the tensor).
            sparse_step: 1,
            mlp_only_layers: Vec::new(),
        }),
        _ => None,
    };
    let config = ModelConfig {
        family,
        hidden_size,
        // A MoE file may carry only the experts' width.
        intermediate_size: match (&moe, opt_uint("feed_forward_length")) {
            (_, Some(n)) => n,
            (Some(m), None) => m.expert_intermediate,
            (None, None) => uint("feed_forward_length")?,
        },
        num_layers: uint("block_count")?,
        num_heads,
        num_kv_heads: opt_uint("attention.head_count_kv").unwrap_or(num_heads),
        head_dim,
        vocab_size,
        max_position_embeddings: opt_uint("context_length").unwrap_or(4096),
        rms_norm_eps: float("attention.layer_norm_rms_epsilon", 1e-6),
        rope_theta: float("rope.freq_base", 10000.0),
        rope_scaling,
        tie_word_embeddings: !has_output_tensor,
        attention_bias: family.qkv_bias(),
        qk_norm: family.qk_norm(),
        rotary_dim: opt_uint("rope.dimension_count").unwrap_or(head_dim),
        bos_token_id: token("tokenizer.ggml.bos_token_id"),
        eos_token_ids: token("tokenizer.ggml.eos_token_id").into_iter().collect(),
        moe,
        hybrid: None,
        // Granite's multipliers, as llama.cpp names them (1 where absent).
        multipliers: match family {
            ModelFamily::Granite => Multipliers {
                embedding: float("embedding_scale", 1.0),
                residual: float("residual_scale", 1.0),
                attention: meta
                    .get(&key("attention.scale"))
                    .and_then(MetaValue::as_f64)
                    .map(|s| s as f32),
                logits: float("logit_scale", 1.0),
            },
            _ => Default::default(),
        },
        nope_layers: Vec::new(),
    };
    config.validate()?;
    Ok(config)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn smollm2() -> BTreeMap<String, MetaValue> {
        let mut m = BTreeMap::new();
        let mut put = |k: &str, v: MetaValue| {
            m.insert(k.to_string(), v);
        };
        put("general.architecture", MetaValue::Str("llama".into()));
        put("llama.embedding_length", MetaValue::U64(576));
        put("llama.feed_forward_length", MetaValue::U64(1536));
        put("llama.block_count", MetaValue::U64(30));
        put("llama.attention.head_count", MetaValue::U64(9));
        put("llama.attention.head_count_kv", MetaValue::U64(3));
        put("llama.context_length", MetaValue::U64(8192));
        put(
            "llama.attention.layer_norm_rms_epsilon",
            MetaValue::F64(1e-5),
        );
        put("llama.rope.freq_base", MetaValue::F64(100000.0));
        put("llama.vocab_size", MetaValue::U64(49152));
        put("tokenizer.ggml.eos_token_id", MetaValue::U64(2));
        m
    }

    #[test]
    fn llama_from_metadata() {
        let c = from_gguf_metadata(&smollm2(), false).unwrap();
        assert_eq!(
            (
                c.hidden_size,
                c.num_layers,
                c.num_heads,
                c.num_kv_heads,
                c.head_dim
            ),
            (576, 30, 9, 3, 64)
        );
        assert!(c.tie_word_embeddings);
        assert_eq!(c.eos_token_ids, vec![2]);
        assert_eq!(c.rope_theta, 100000.0);
    }

    /// Qwen3-30B-A3B's metadata as llama.cpp's converter writes it (`qwen3moe`).
    fn qwen3_30b_a3b() -> BTreeMap<String, MetaValue> {
        let mut m = BTreeMap::new();
        for (k, v) in [
            ("embedding_length", 2048),
            ("feed_forward_length", 6144),
            ("block_count", 48),
            ("attention.head_count", 32),
            ("attention.head_count_kv", 4),
            ("attention.key_length", 128),
            ("context_length", 40960),
            ("expert_count", 128),
            ("expert_used_count", 8),
            ("expert_feed_forward_length", 768),
            ("vocab_size", 151936),
        ] {
            m.insert(format!("qwen3moe.{k}"), MetaValue::U64(v));
        }
        m.insert(
            "general.architecture".into(),
            MetaValue::Str("qwen3moe".into()),
        );
        m.insert("qwen3moe.rope.freq_base".into(), MetaValue::F64(1e6));
        m
    }

    #[test]
    fn qwen3moe_and_qwen2moe_from_metadata() {
        let c = from_gguf_metadata(&qwen3_30b_a3b(), true).unwrap();
        assert_eq!(c.family, ModelFamily::Qwen3Moe);
        assert_eq!(c.qk_norm, crate::QkNorm::PerHead);
        let m = c.moe.as_ref().unwrap();
        assert_eq!(
            (m.num_experts, m.top_k, m.expert_intermediate),
            (128, 8, 768)
        );
        assert!(m.norm_topk_prob, "Qwen3-MoE renormalises its top k");
        assert_eq!(
            (m.shared_expert_intermediate, m.routed_scaling),
            (None, 1.0)
        );
        assert!((0..48).all(|l| m.is_sparse(l)));
        // Qwen1.5-MoE-A2.7B as qwen2moe: a shared expert, no renormalisation, qkv biases.
        let mut q2: BTreeMap<String, MetaValue> = qwen3_30b_a3b()
            .into_iter()
            .map(|(k, v)| (k.replace("qwen3moe.", "qwen2moe."), v))
            .collect();
        q2.insert(
            "general.architecture".into(),
            MetaValue::Str("qwen2moe".into()),
        );
        q2.insert(
            "qwen2moe.expert_shared_feed_forward_length".into(),
            MetaValue::U64(5632),
        );
        q2.remove("qwen2moe.feed_forward_length");
        let c = from_gguf_metadata(&q2, true).unwrap();
        let m = c.moe.as_ref().unwrap();
        assert_eq!(c.family, ModelFamily::Qwen2Moe);
        assert!(c.attention_bias && !m.norm_topk_prob);
        assert_eq!(m.shared_expert_intermediate, Some(5632));
        assert_eq!(c.intermediate_size, 768, "no dense width: the experts'");
        // A file that says how it weights the experts is followed.
        q2.insert("qwen2moe.expert_weights_norm".into(), MetaValue::Bool(true));
        assert!(
            from_gguf_metadata(&q2, true)
                .unwrap()
                .moe
                .unwrap()
                .norm_topk_prob
        );
        // The experts' keys are required.
        let mut m = qwen3_30b_a3b();
        m.remove("qwen3moe.expert_used_count");
        let err = from_gguf_metadata(&m, true).unwrap_err().to_string();
        assert!(err.contains("expert_used_count"), "{err}");
    }

    #[test]
    fn llama_with_experts_is_mixtral() {
        // Mixtral-8x7B as llama.cpp's converter writes it: `llama` with expert counts, the
        // experts' width as the feed-forward length.
        let mut m = BTreeMap::new();
        for (k, v) in [
            ("embedding_length", 4096),
            ("feed_forward_length", 14336),
            ("block_count", 32),
            ("attention.head_count", 32),
            ("attention.head_count_kv", 8),
            ("context_length", 32768),
            ("expert_count", 8),
            ("expert_used_count", 2),
            ("vocab_size", 32000),
        ] {
            m.insert(format!("llama.{k}"), MetaValue::U64(v));
        }
        m.insert(
            "general.architecture".into(),
            MetaValue::Str("llama".into()),
        );
        let c = from_gguf_metadata(&m, true).unwrap();
        assert_eq!(c.family, ModelFamily::Mixtral);
        let moe = c.moe.as_ref().unwrap();
        assert_eq!(
            (moe.num_experts, moe.top_k, moe.expert_intermediate),
            (8, 2, 14336)
        );
        assert!(moe.norm_topk_prob && moe.shared_expert_intermediate.is_none());
        // A dense llama file stays Llama.
        assert_eq!(
            from_gguf_metadata(&smollm2(), true).unwrap().family,
            ModelFamily::Llama
        );
        // Families read only from HF checkpoints are refused by name.
        let mut olmoe: BTreeMap<String, MetaValue> = m
            .into_iter()
            .map(|(k, v)| (k.replace("llama.", "olmoe."), v))
            .collect();
        olmoe.insert(
            "general.architecture".into(),
            MetaValue::Str("olmoe".into()),
        );
        let err = from_gguf_metadata(&olmoe, true).unwrap_err().to_string();
        assert!(
            err.contains("olmoe") && err.contains("HF checkpoint"),
            "{err}"
        );
    }

    #[test]
    fn phi3_from_metadata() {
        // Phi-4-mini's shape as llama.cpp writes it: RoPE on 96 of each head's 128 elements.
        let mut m = BTreeMap::new();
        for (k, v) in [
            ("embedding_length", 3072),
            ("feed_forward_length", 8192),
            ("block_count", 32),
            ("attention.head_count", 24),
            ("attention.head_count_kv", 8),
            ("context_length", 131072),
            ("rope.dimension_count", 96),
            ("vocab_size", 200064),
        ] {
            m.insert(format!("phi3.{k}"), MetaValue::U64(v));
        }
        m.insert("general.architecture".into(), MetaValue::Str("phi3".into()));
        let c = from_gguf_metadata(&m, false).unwrap();
        assert_eq!(c.family, ModelFamily::Phi3);
        assert_eq!((c.head_dim, c.rotary_dim), (128, 96));
        assert!(c.tie_word_embeddings && c.moe.is_none());
    }

    #[test]
    fn granite_from_metadata_carries_its_multipliers() {
        let mut m: BTreeMap<String, MetaValue> = smollm2()
            .into_iter()
            .map(|(k, v)| (k.replace("llama.", "granite."), v))
            .collect();
        m.insert(
            "general.architecture".into(),
            MetaValue::Str("granite".into()),
        );
        for (k, v) in [
            ("embedding_scale", 12.0),
            ("residual_scale", 0.22),
            ("attention.scale", 0.0078125),
            ("logit_scale", 16.0),
        ] {
            m.insert(format!("granite.{k}"), MetaValue::F64(v));
        }
        let c = from_gguf_metadata(&m, false).unwrap();
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
    }

    #[test]
    fn refuses_unknown_architecture_and_missing_keys() {
        let mut m = smollm2();
        m.insert(
            "general.architecture".into(),
            MetaValue::Str("mamba".into()),
        );
        assert!(
            from_gguf_metadata(&m, true)
                .unwrap_err()
                .to_string()
                .contains("mamba")
        );
        let mut m = smollm2();
        m.remove("llama.block_count");
        assert!(
            from_gguf_metadata(&m, true)
                .unwrap_err()
                .to_string()
                .contains("block_count")
        );
        let mut m = smollm2();
        m.insert(
            "llama.rope.scaling.type".into(),
            MetaValue::Str("yarn".into()),
        );
        assert!(
            from_gguf_metadata(&m, true)
                .unwrap_err()
                .to_string()
                .contains("yarn")
        );
    }
}
