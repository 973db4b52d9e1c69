// SPDX-License-Identifier: MIT OR Apache-2.0
//! What a request asks of the sampler, and the checks that keep a bad request out.

use thiserror::Error;

/// How one sequence picks its next token.
///
/// The fields follow the OpenAI and Hugging Face meanings named on each; every knob has a neutral
/// value that switches it off, and [`SamplingParams::default`] is all-neutral at temperature 1.
/// Call [`SamplingParams::validate`] on anything that came from a user before building a
/// [`Sampler`](crate::Sampler): the sampler itself never fails, so it cannot report a bad value.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// Divides the logits before the softmax; `0` means greedy (argmax, lowest index on ties,
    /// NaN never wins). Must be finite and `>= 0`.
    pub temperature: f32,
    /// Keep only the `k` most likely tokens; `None` or `Some(0)` is off.
    pub top_k: Option<u32>,
    /// Keep the smallest set of most likely tokens whose mass is `>= top_p` (never fewer than
    /// one); `1.0` is off. Must lie in `(0, 1]`.
    pub top_p: f32,
    /// Keep tokens whose probability is `>= min_p * p_max`; `0.0` is off. Must lie in `[0, 1]`.
    pub min_p: f32,
    /// Hugging Face repetition penalty over every token of the prompt and the output so far:
    /// a positive logit is divided by it, a negative one multiplied, once per distinct token.
    /// `1.0` is off. Must be finite and `> 0`.
    pub repetition_penalty: f32,
    /// OpenAI presence penalty: subtracted once from the logit of every token that appeared in
    /// the output so far (the prompt does not count). `0.0` is off. Must lie in `[-2, 2]`.
    pub presence_penalty: f32,
    /// OpenAI frequency penalty: `count * frequency_penalty` is subtracted from each token's
    /// logit, `count` being its occurrences in the output so far. `0.0` is off. Must lie in
    /// `[-2, 2]`.
    pub frequency_penalty: f32,
    /// `(token, bias)` pairs added to the logits before anything else; entries for the same
    /// token add up. Validation requires finite biases and in-vocabulary tokens; the sampler
    /// itself also honours `-inf` (the token is never drawn) and skips out-of-range tokens.
    pub logit_bias: Vec<(u32, f32)>,
    /// Seed of the sampler's generator; `None` seeds from the clock. The same seed, parameters,
    /// prompt and logits give the same tokens on every platform.
    pub seed: Option<u64>,
}

impl Default for SamplingParams {
    /// Plain sampling from the softmax: temperature 1, every filter and penalty off, no seed.
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_k: None,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            logit_bias: Vec::new(),
            seed: None,
        }
    }
}

/// A [`SamplingParams`] field a request set to a value the sampler cannot honour.
#[derive(Clone, Debug, Error, PartialEq)]
pub enum SamplingError {
    /// A numeric field lies outside its range (NaN lies outside every range).
    #[error("sampling parameter `{field}` = {value} is out of range: expected {expected}")]
    OutOfRange {
        /// The field's name in [`SamplingParams`].
        field: &'static str,
        /// The rejected value.
        value: f32,
        /// The accepted range, in words.
        expected: &'static str,
    },
    /// A `logit_bias` entry names a token the vocabulary does not have.
    #[error(
        "sampling parameter `logit_bias` names token {token}, but the vocabulary has \
         {vocab_size} tokens: use ids below {vocab_size}"
    )]
    BiasTokenOutOfVocab {
        /// The token id.
        token: u32,
        /// The model's vocabulary size.
        vocab_size: usize,
    },
    /// A `logit_bias` entry carries an infinite or NaN bias.
    #[error(
        "sampling parameter `logit_bias` gives token {token} the bias {bias}: expected a finite \
         number (a large negative one, such as -100, bans the token)"
    )]
    NonFiniteBias {
        /// The token id.
        token: u32,
        /// The rejected bias.
        bias: f32,
    },
}

impl SamplingParams {
    /// Checks every field against its documented range and every `logit_bias` token against
    /// `vocab_size`, returning the first problem found.
    pub fn validate(&self, vocab_size: usize) -> Result<(), SamplingError> {
        check(
            "temperature",
            self.temperature,
            "a finite number >= 0 (0 means greedy)",
            |t| t.is_finite() && t >= 0.0,
        )?;
        check(
            "top_p",
            self.top_p,
            "a number in (0, 1] (1 turns it off)",
            |p| p > 0.0 && p <= 1.0,
        )?;
        check(
            "min_p",
            self.min_p,
            "a number in [0, 1] (0 turns it off)",
            |p| (0.0..=1.0).contains(&p),
        )?;
        check(
            "repetition_penalty",
            self.repetition_penalty,
            "a finite number > 0 (1 turns it off)",
            |r| r.is_finite() && r > 0.0,
        )?;
        check(
            "presence_penalty",
            self.presence_penalty,
            "a number in [-2, 2] (0 turns it off)",
            |p| (-2.0..=2.0).contains(&p),
        )?;
        check(
            "frequency_penalty",
            self.frequency_penalty,
            "a number in [-2, 2] (0 turns it off)",
            |p| (-2.0..=2.0).contains(&p),
        )?;
        for &(token, bias) in &self.logit_bias {
            if token as usize >= vocab_size {
                return Err(SamplingError::BiasTokenOutOfVocab { token, vocab_size });
            }
            if !bias.is_finite() {
                return Err(SamplingError::NonFiniteBias { token, bias });
            }
        }
        Ok(())
    }

    /// Whether the next token is the argmax of the biased and penalised logits (temperature 0).
    /// A greedy [`Sampler::sample`] draws no random number, so an engine may take the argmax on
    /// the device instead and report it with [`Sampler::record`], provided no bias or penalty is
    /// set (those are applied only by [`Sampler::sample`]).
    ///
    /// [`Sampler::record`]: crate::Sampler::record
    /// [`Sampler::sample`]: crate::Sampler::sample
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }

    /// Whether the next token is exactly the argmax of the raw logits: greedy with no logit bias
    /// and no penalty. An engine may then take the argmax on the device (first index on ties,
    /// NaN never wins, as [`Sampler::sample`] does) and report it with [`Sampler::record`].
    ///
    /// [`Sampler::record`]: crate::Sampler::record
    /// [`Sampler::sample`]: crate::Sampler::sample
    pub fn is_plain_greedy(&self) -> bool {
        self.is_greedy() && self.logit_bias.is_empty() && !self.has_penalties()
    }

    /// Whether any of the three penalties is on.
    pub(crate) fn has_penalties(&self) -> bool {
        self.repetition_penalty != 1.0
            || self.presence_penalty != 0.0
            || self.frequency_penalty != 0.0
    }
}

/// `Ok` when `accepts(value)`; NaN fails every range written with comparisons.
fn check(
    field: &'static str,
    value: f32,
    expected: &'static str,
    accepts: impl Fn(f32) -> bool,
) -> Result<(), SamplingError> {
    if accepts(value) {
        Ok(())
    } else {
        Err(SamplingError::OutOfRange {
            field,
            value,
            expected,
        })
    }
}
