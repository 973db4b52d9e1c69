// SPDX-License-Identifier: MIT OR Apache-2.0
//! A model family's behaviour presets: the sampling a request gets for the parameters it leaves
//! unset, the tool-call wire format, whether the model reasons in `<think>` blocks. Facts of the
//! model, not of the hardware: they live here, keyed by family, whatever kernel target serves it.

use crate::ModelFamily;

/// Sampling used when a request leaves a parameter unset (from the family's published
/// `generation_config.json`).
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub struct SamplingPresets {
    /// Temperature.
    pub temperature: Option<f32>,
    /// Nucleus mass.
    pub top_p: Option<f32>,
    /// Top-k.
    pub top_k: Option<u32>,
    /// Min-p.
    pub min_p: Option<f32>,
    /// Repetition penalty.
    pub repetition_penalty: Option<f32>,
}

impl SamplingPresets {
    /// The sampling defaults a checkpoint's `generation_config.json` sets (`temperature`,
    /// `top_p`, `top_k`, `min_p`, `repetition_penalty`; a `top_k` of 0 or less is none), as
    /// vLLM reads them (`do_sample` is not read). A value out of its range is an error naming
    /// the key.
    pub fn from_generation_config(
        json: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<SamplingPresets, String> {
        let number = |key: &str, ok: &dyn Fn(f64) -> bool, range: &str| match json.get(key) {
            None | Some(serde_json::Value::Null) => Ok(None),
            Some(v) => match v.as_f64() {
                Some(x) if x.is_finite() && ok(x) => Ok(Some(x)),
                _ => Err(format!("`{key}` is {v}; expected {range}")),
            },
        };
        let f = |x: Option<f64>| x.map(|x| x as f32);
        Ok(SamplingPresets {
            temperature: f(number(
                "temperature",
                &|x| x >= 0.0,
                "a number of at least 0",
            )?),
            top_p: f(number(
                "top_p",
                &|x| x > 0.0 && x <= 1.0,
                "a number in (0, 1]",
            )?),
            top_k: number("top_k", &|x| x.fract() == 0.0, "an integer")?
                .filter(|&k| k > 0.0)
                .map(|k| k.min(u32::MAX as f64) as u32),
            min_p: f(number(
                "min_p",
                &|x| (0.0..=1.0).contains(&x),
                "a number in [0, 1]",
            )?),
            repetition_penalty: f(number(
                "repetition_penalty",
                &|x| x > 0.0,
                "a positive number",
            )?),
        })
    }

    /// These presets, each unset one taken from `fallback`.
    pub fn or(self, fallback: SamplingPresets) -> SamplingPresets {
        SamplingPresets {
            temperature: self.temperature.or(fallback.temperature),
            top_p: self.top_p.or(fallback.top_p),
            top_k: self.top_k.or(fallback.top_k),
            min_p: self.min_p.or(fallback.min_p),
            repetition_penalty: self.repetition_penalty.or(fallback.repetition_penalty),
        }
    }

    /// What these presets set, for a log line (`none` when nothing is).
    pub fn describe(&self) -> String {
        let mut parts = Vec::new();
        if let Some(t) = self.temperature {
            parts.push(format!("temperature {t}"));
        }
        if let Some(p) = self.top_p {
            parts.push(format!("top_p {p}"));
        }
        if let Some(k) = self.top_k {
            parts.push(format!("top_k {k}"));
        }
        if let Some(m) = self.min_p {
            parts.push(format!("min_p {m}"));
        }
        if let Some(r) = self.repetition_penalty {
            parts.push(format!("repetition_penalty {r}"));
        }
        if parts.is_empty() {
            "none".into()
        } else {
            parts.join(", ")
        }
    }
}

/// Parser and reasoning defaults.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub struct ModelBehavior {
    /// Default tool-call wire format (`hermes`, `llama3_json`, ...).
    pub tool_call_parser: Option<&'static str>,
    /// Whether the model emits `<think>` blocks.
    pub reasoning: bool,
    /// Default thinking budget, tokens.
    pub thinking_budget: Option<u32>,
}

/// A family's presets.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub struct ModelPresets {
    /// Sampling defaults.
    pub sampling: SamplingPresets,
    /// Behaviour defaults.
    pub behavior: ModelBehavior,
}

/// The presets of `family` (a MoE family takes its dense family's). The match names every family,
/// so a new one gets its presets by decision, not by falling into another's.
pub fn presets(family: ModelFamily) -> ModelPresets {
    match family {
        // Qwen3's generation_config.json (thinking mode).
        ModelFamily::Qwen3 | ModelFamily::Qwen3Moe => ModelPresets {
            sampling: SamplingPresets {
                temperature: Some(0.6),
                top_p: Some(0.95),
                top_k: Some(20),
                ..SamplingPresets::default()
            },
            behavior: ModelBehavior {
                tool_call_parser: Some("hermes"),
                reasoning: true,
                thinking_budget: None,
            },
        },
        // Qwen2.5-Instruct's generation_config.json.
        ModelFamily::Qwen2 | ModelFamily::Qwen2Moe => ModelPresets {
            sampling: SamplingPresets {
                temperature: Some(0.7),
                top_p: Some(0.8),
                top_k: Some(20),
                repetition_penalty: Some(1.05),
                ..SamplingPresets::default()
            },
            behavior: ModelBehavior {
                tool_call_parser: Some("hermes"),
                ..ModelBehavior::default()
            },
        },
        // MiniMax-M2's recommended sampling (its model card: temperature 1.0, top-p 0.95, top-k
        // 40). Its tool calls are `<minimax:tool_call>` XML, which no parser here reads, and its
        // `<think>` blocks are left to the operator's `--reasoning-parser` until a test with its
        // chat template shows the splitter reads them: both stay the defaults.
        ModelFamily::MiniMaxM2 => ModelPresets {
            sampling: SamplingPresets {
                temperature: Some(1.0),
                top_p: Some(0.95),
                top_k: Some(40),
                ..SamplingPresets::default()
            },
            behavior: ModelBehavior::default(),
        },
        // The hybrid families serve with the defaults: their published generation_config.json
        // and chat templates have not been read into presets yet.
        ModelFamily::Qwen3Next | ModelFamily::Qwen35Moe | ModelFamily::NemotronH => {
            ModelPresets::default()
        }
        // Mistral-7B-Instruct-v0.3, Mistral-Nemo, Mistral-Small and Mixtral-8x22B-Instruct call
        // tools in Mistral's `[TOOL_CALLS]` wire (Mixtral-8x7B-Instruct has no tool format; a
        // parser that never sees its marker changes nothing). None publishes sampling defaults.
        ModelFamily::Mistral | ModelFamily::Mixtral => ModelPresets {
            sampling: SamplingPresets::default(),
            behavior: ModelBehavior {
                tool_call_parser: Some("mistral"),
                ..ModelBehavior::default()
            },
        },
        // GLM-4.5 thinks in `<think>` blocks (vLLM's recipe serves it with a `<think>` reasoning
        // parser); its tool calls are its own XML, which no parser here reads; no sampling
        // presets are read from its generation_config.json yet.
        ModelFamily::Glm4Moe => ModelPresets {
            sampling: SamplingPresets::default(),
            behavior: ModelBehavior {
                reasoning: true,
                ..ModelBehavior::default()
            },
        },
        // Granite-3.x-Instruct (dense and MoE) calls tools as `<|tool_call|>` and a JSON list, which no parser
        // here reads; no sampling defaults are published.
        ModelFamily::Granite | ModelFamily::GraniteMoe => ModelPresets::default(),
        // Granite 4.0 calls tools in `<tool_call>` JSON blocks (IBM's vLLM instructions pass the
        // hermes parser); no sampling defaults are published.
        ModelFamily::GraniteMoeHybrid => ModelPresets {
            sampling: SamplingPresets::default(),
            behavior: ModelBehavior {
                tool_call_parser: Some("hermes"),
                ..ModelBehavior::default()
            },
        },
        // SmolLM3 reasons in `<think>` blocks by default (its chat template's enable_thinking);
        // its sampling comes from its generation_config.json.
        ModelFamily::SmolLm3 => ModelPresets {
            sampling: SamplingPresets::default(),
            behavior: ModelBehavior {
                reasoning: true,
                ..ModelBehavior::default()
            },
        },
        // Phi-3 and Phi-4 publish no sampling defaults beyond their generation_config.json and
        // no tool format a parser here reads.
        ModelFamily::Phi3 => ModelPresets::default(),
        // Seed-OSS thinks in `<seed:think>` blocks, which the reasoning splitter here does not
        // read, and calls tools in its own XML: both stay the operator's to set.
        ModelFamily::SeedOss => ModelPresets::default(),
        // OLMoE-1B-7B(-Instruct) publishes no sampling defaults and no tool format.
        ModelFamily::Olmoe => ModelPresets::default(),
        // Llama 3.x and Llama-architecture models (SmolLM2, ...): no sampling presets.
        ModelFamily::Llama => ModelPresets {
            sampling: SamplingPresets::default(),
            behavior: ModelBehavior {
                tool_call_parser: Some("llama3_json"),
                ..ModelBehavior::default()
            },
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_generation_config_sets_the_defaults_it_names() {
        // Qwen3-Next-80B-A3B-Instruct's kind of file: sampling keys beside token ids.
        let json: serde_json::Value = serde_json::from_str(
            r#"{"bos_token_id": 151643, "do_sample": true, "eos_token_id": [151645, 151643],
                "temperature": 0.7, "top_k": 20, "top_p": 0.8, "transformers_version": "4.57.0"}"#,
        )
        .unwrap();
        let file = SamplingPresets::from_generation_config(json.as_object().unwrap()).unwrap();
        assert_eq!(
            file,
            SamplingPresets {
                temperature: Some(0.7),
                top_p: Some(0.8),
                top_k: Some(20),
                ..SamplingPresets::default()
            }
        );
        // The file wins where it speaks; the family's presets fill the rest.
        let merged = file.or(presets(ModelFamily::Qwen2).sampling);
        assert_eq!(merged.temperature, Some(0.7));
        assert_eq!(merged.repetition_penalty, Some(1.05));
        assert_eq!(
            merged.describe(),
            "temperature 0.7, top_p 0.8, top_k 20, repetition_penalty 1.05"
        );
        // top_k 0 is none; a value out of range names its key.
        let zero = serde_json::json!({"top_k": 0});
        let none = SamplingPresets::from_generation_config(zero.as_object().unwrap()).unwrap();
        assert_eq!(none.top_k, None);
        let bad = serde_json::json!({"top_p": 1.5});
        let err = SamplingPresets::from_generation_config(bad.as_object().unwrap()).unwrap_err();
        assert!(err.contains("top_p"), "{err}");
        assert_eq!(SamplingPresets::default().describe(), "none");
    }

    #[test]
    fn each_family_has_its_presets_and_moe_takes_the_dense_ones() {
        let qwen3 = presets(ModelFamily::Qwen3);
        assert_eq!(qwen3.sampling.temperature, Some(0.6));
        assert_eq!(qwen3.sampling.top_k, Some(20));
        assert!(qwen3.behavior.reasoning);
        assert_eq!(qwen3.behavior.tool_call_parser, Some("hermes"));
        assert_eq!(presets(ModelFamily::Qwen3Moe), qwen3);
        let qwen2 = presets(ModelFamily::Qwen2);
        assert_eq!(qwen2.sampling.repetition_penalty, Some(1.05));
        assert!(!qwen2.behavior.reasoning);
        assert_eq!(presets(ModelFamily::Qwen2Moe), qwen2);
        let llama = presets(ModelFamily::Llama);
        assert_eq!(llama.sampling, SamplingPresets::default());
        assert_eq!(llama.behavior.tool_call_parser, Some("llama3_json"));
        let minimax = presets(ModelFamily::MiniMaxM2);
        assert_eq!(minimax.sampling.top_k, Some(40));
        assert_eq!(minimax.behavior, ModelBehavior::default());
    }
}
