// SPDX-License-Identifier: MIT OR Apache-2.0
//! One request's walk through a compiled grammar.

use std::sync::Arc;

use llguidance::api::StopReason;
use toktrie::SimpleVob;

use crate::GrammarError;
use crate::vocab::Vocab;

/// Where one output stands in its grammar: which tokens may come next, and whether it is done.
///
/// Per step: [`Matcher::fill_mask`] or [`Matcher::apply`] (or both: the mask for a state is
/// computed once), sample, then [`Matcher::advance`] with the sampled token. The model's EOS
/// tokens are allowed exactly when the output so far is complete.
pub struct Matcher {
    inner: llguidance::Matcher,
    vocab: Arc<Vocab>,
    /// The allowed tokens in the current state, once computed; cleared by `advance`.
    mask: Option<SimpleVob>,
}

impl std::fmt::Debug for Matcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Matcher")
            .field("stop_reason", &self.inner.stop_reason())
            .field("mask_ready", &self.mask.is_some())
            .finish_non_exhaustive()
    }
}

impl Matcher {
    pub(crate) fn new(inner: llguidance::Matcher, mask: SimpleVob, vocab: Arc<Vocab>) -> Self {
        Matcher {
            inner,
            vocab,
            mask: Some(mask),
        }
    }

    /// Writes the allowed tokens as a bitset: id `i` is bit `i % 32` of `allowed[i / 32]`.
    /// `allowed` must have [`crate::GrammarEngine::mask_words`] words.
    pub fn fill_mask(&mut self, allowed: &mut [u32]) -> Result<(), GrammarError> {
        let words = self.vocab.mask_words();
        if allowed.len() != words {
            return Err(GrammarError::BufferLength {
                what: "mask",
                expected: words,
                got: allowed.len(),
            });
        }
        let mask = self.current_mask()?;
        allowed.copy_from_slice(&mask.as_slice()[..words]);
        Ok(())
    }

    /// Sets the logit of every token the grammar does not allow to `f32::NEG_INFINITY`;
    /// `logits` has one entry per id of the model's vocabulary.
    pub fn apply(&mut self, logits: &mut [f32]) -> Result<(), GrammarError> {
        let expected = self.vocab.size;
        if logits.len() != expected {
            return Err(GrammarError::BufferLength {
                what: "logits",
                expected,
                got: logits.len(),
            });
        }
        let mask = self.current_mask()?;
        for (chunk, &word) in logits.chunks_mut(32).zip(mask.as_slice()) {
            match word {
                u32::MAX => {}
                0 => chunk.fill(f32::NEG_INFINITY),
                _ => {
                    for (bit, logit) in chunk.iter_mut().enumerate() {
                        if word & (1 << bit) == 0 {
                            *logit = f32::NEG_INFINITY;
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// Moves past `token`, which must be allowed by the current mask (the model's EOS ends the
    /// output where the grammar accepts it). A token the grammar does not allow is an error:
    /// when the mask for this step was computed the token is checked against it and the matcher
    /// stays as it was; otherwise llguidance refuses it and the matcher stays failed.
    pub fn advance(&mut self, token: u32) -> Result<(), GrammarError> {
        let known = (token as usize) < self.vocab.size;
        let allowed = match &self.mask {
            Some(mask) => known && mask.is_allowed(token),
            None => known && self.vocab.valid.is_allowed(token),
        };
        if !allowed {
            return Err(GrammarError::TokenNotAllowed { token });
        }
        if self.is_finished() && self.vocab.eos.contains(&token) {
            // The output is complete and only EOS was allowed: nothing left to walk.
            self.mask = None;
            return Ok(());
        }
        self.mask = None;
        self.inner.consume_token(token).map_err(failed)
    }

    /// Whether the output is complete and nothing but EOS may follow (set by `advance`: the
    /// last token closed the grammar, or was EOS where the grammar accepts).
    pub fn is_finished(&self) -> bool {
        matches!(
            self.inner.stop_reason(),
            StopReason::EndOfSentence | StopReason::NoExtension
        )
    }

    fn current_mask(&mut self) -> Result<&SimpleVob, GrammarError> {
        let mask = match self.mask.take() {
            Some(mask) => mask,
            None => compute_mask(&mut self.inner, &self.vocab)?,
        };
        Ok(self.mask.insert(mask))
    }
}

/// llguidance's mask with the engine's rules applied: ids without bytes never, EOS exactly
/// when the grammar accepts.
pub(crate) fn compute_mask(
    inner: &mut llguidance::Matcher,
    vocab: &Vocab,
) -> Result<SimpleVob, GrammarError> {
    let mut mask = inner.compute_mask_or_eos().map_err(failed)?;
    let accepting = inner.is_accepting().map_err(failed)?;
    mask.and(&vocab.valid);
    for &eos in &vocab.eos {
        mask.set(eos as usize, accepting);
    }
    if mask.is_zero() {
        return Err(GrammarError::Matcher(
            "no token of the vocabulary can continue the output here".into(),
        ));
    }
    Ok(mask)
}

fn failed(e: impl std::fmt::Display) -> GrammarError {
    GrammarError::Matcher(e.to_string())
}
