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
