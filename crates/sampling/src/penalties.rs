// SPDX-License-Identifier: MIT OR Apache-2.0
//! The logit adjustments that depend on the request and the sequence so far: logit bias, the
//! Hugging Face repetition penalty, and the OpenAI presence and frequency penalties.

use std::collections::HashMap;

use crate::SamplingParams;

/// Adds each `(token, bias)` to `logits[token]`, skipping tokens outside `logits`.
pub(crate) fn apply_logit_bias(bias: &[(u32, f32)], logits: &mut [f32]) {
    for &(token, b) in bias {
        if let Some(logit) = logits.get_mut(token as usize) {
            *logit += b;
        }
    }
}

/// The tokens one sequence has seen, for the penalties.
///
/// Sparse on purpose: a sequence sees a few thousand distinct tokens of a vocabulary of ~150k, and
/// a batch holds hundreds of sequences, so a dense per-token array would cost more memory and more
/// time (the penalties visit only tokens seen) than this map.
#[derive(Clone, Debug, Default)]
pub(crate) struct TokenHistory {
    /// Every distinct token of the prompt and the output so far, mapped to how many times it
    /// occurs in the output (0 for a token seen only in the prompt).
    output_counts: HashMap<u32, u32>,
}

impl TokenHistory {
    /// A history holding `prompt` and no output.
    pub(crate) fn from_prompt(prompt: &[u32]) -> Self {
        let mut output_counts = HashMap::with_capacity(prompt.len().min(1 << 16));
        for &token in prompt {
            output_counts.entry(token).or_insert(0);
        }
        Self { output_counts }
    }

    /// Appends `token` to the output.
    pub(crate) fn record(&mut self, token: u32) {
        *self.output_counts.entry(token).or_insert(0) += 1;
    }

    /// Times `token` occurs in the output so far.
    #[cfg(test)]
    pub(crate) fn output_count(&self, token: u32) -> u32 {
        self.output_counts.get(&token).copied().unwrap_or(0)
    }

    /// Applies the repetition penalty to every token seen (prompt and output), then subtracts the
    /// presence and frequency penalties for every token of the output. Each distinct token is
    /// penalised once per call whatever its count, as in Hugging Face; tokens outside `logits` are
    /// skipped. The visiting order does not matter: each token's update reads only its own logit.
    pub(crate) fn apply_penalties(&self, params: &SamplingParams, logits: &mut [f32]) {
        if !params.has_penalties() {
            return;
        }
        let repetition = params.repetition_penalty;
        for (&token, &count) in &self.output_counts {
            let Some(logit) = logits.get_mut(token as usize) else {
                continue;
            };
            if repetition != 1.0 {
                *logit = if *logit > 0.0 {
                    *logit / repetition
                } else {
                    *logit * repetition
                };
            }
            if count > 0 {
                *logit -= params.presence_penalty + count as f32 * params.frequency_penalty;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bias_adds_and_ignores_tokens_past_the_vocabulary() {
        let mut logits = [1.0, 2.0, 3.0];
        apply_logit_bias(&[(0, 0.5), (2, -1.0), (0, 0.25), (9, 100.0)], &mut logits);
        assert_eq!(logits, [1.75, 2.0, 2.0]);
    }

    #[test]
    fn prompt_tokens_are_seen_but_not_counted_as_output() {
        let mut history = TokenHistory::from_prompt(&[4, 4, 5]);
        history.record(5);
        history.record(6);
        history.record(6);
        assert_eq!(history.output_count(4), 0);
        assert_eq!(history.output_count(5), 1);
        assert_eq!(history.output_count(6), 2);
        assert_eq!(history.output_count(7), 0);
    }
}
