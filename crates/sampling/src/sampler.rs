// SPDX-License-Identifier: MIT OR Apache-2.0
//! One sequence's sampler: its parameters, its generator, the tokens it has seen, and scratch.

use std::collections::hash_map::RandomState;
use std::fmt;
use std::hash::{BuildHasher, Hasher};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::filters::{self, Candidate};
use crate::mask;
use crate::penalties::{TokenHistory, apply_logit_bias};
use crate::rng::Xoshiro256StarStar;
use crate::{SamplingParams, softmax};

/// Picks the next token of one sequence from its logits.
///
/// Holds everything that persists between steps: the parameters, the generator (so a seeded
/// sequence is reproducible draw by draw), the prompt and output tokens (for the penalties), and
/// scratch reused by every draw, so that sampling allocates only while the scratch first grows to
/// the vocabulary's size (up to 20 bytes a token: 3 MB for 152k tokens, per sequence).
pub struct Sampler {
    params: SamplingParams,
    /// The seed the generator started from, given or taken from the clock.
    seed: u64,
    rng: Xoshiro256StarStar,
    history: TokenHistory,
    /// Scratch: the tokens still in the running during one draw.
    candidates: Vec<Candidate>,
    /// Scratch: the filters' rank keys.
    keys: Vec<u64>,
}

impl Sampler {
    /// A sampler for a sequence that starts with `prompt`.
    ///
    /// `params` should have passed [`SamplingParams::validate`]; the sampler does not check them
    /// again, and invalid values give well-defined but meaningless tokens, never a panic. A `None`
    /// seed is replaced by one drawn from the clock and the process's hash keys, so two samplers
    /// created in the same instant still differ; [`Sampler::seed`] reports it.
    pub fn new(params: SamplingParams, prompt: &[u32]) -> Self {
        let seed = params.seed.unwrap_or_else(seed_from_clock);
        Self {
            seed,
            rng: Xoshiro256StarStar::seed_from_u64(seed),
            history: TokenHistory::from_prompt(prompt),
            candidates: Vec::new(),
            keys: Vec::new(),
            params,
        }
    }

    /// The parameters this sampler applies.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// The seed this sampler's generator started from: [`SamplingParams::seed`] if it was set,
    /// otherwise the one taken from the clock. Another sampler built with it reproduces this one.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// Picks the next token from `logits` (one per vocabulary entry) and records it as output.
    ///
    /// The algorithm, in order:
    /// 1. add `logit_bias`;
    /// 2. the repetition penalty over the prompt and output tokens, then the presence and
    ///    frequency penalties over the output tokens;
    /// 3. if [greedy](SamplingParams::is_greedy), the argmax (lowest index on ties, NaN never
    ///    wins) and stop;
    /// 4. divide by the temperature and drop the tokens that cannot be drawn (NaN or `-inf`);
    /// 5. top-k, softmax, top-p, min-p (applied before top-p, which gives the same set faster;
    ///    see `filters::top_p`);
    /// 6. one uniform number from the generator picks a token from the renormalised remainder.
    ///
    /// On return `logits` holds the logits after steps 1 and 2 (biased and penalised, not
    /// divided by the temperature). If no token survives step 4 (every logit NaN or `-inf`,
    /// or driven there by the temperature), the argmax of those logits is returned instead.
    ///
    /// # Panics
    /// If `logits` is empty.
    pub fn sample(&mut self, logits: &mut [f32]) -> u32 {
        self.sample_where(logits, None)
    }

    /// [`Sampler::sample`] restricted to the tokens of an allowed-token bitset (a grammar's
    /// mask): token `i` is bit `i % 32` of `allowed[i / 32]`, and tokens past the bitset are not
    /// allowed.
    ///
    /// The mask applies between steps 2 and 3, after the bias and the penalties and before the
    /// temperature and the filters, so that top-k, top-p and min-p choose among allowed tokens
    /// only and renormalise over them. On return `logits` holds the biased and penalised logits
    /// with every token the bitset does not allow at `-inf`. The returned token is always
    /// allowed when any token of `logits` is: if every allowed logit is NaN or `-inf`, it is the
    /// lowest allowed id. (A bitset that allows nothing gives what [`Sampler::sample`] gives for
    /// all-`-inf` logits; a grammar's mask is never empty.)
    ///
    /// # Panics
    /// If `logits` is empty.
    pub fn sample_allowed(&mut self, logits: &mut [f32], allowed: &[u32]) -> u32 {
        self.sample_where(logits, Some(allowed))
    }

    fn sample_where(&mut self, logits: &mut [f32], allowed: Option<&[u32]>) -> u32 {
        assert!(!logits.is_empty(), "cannot sample from an empty vocabulary");
        apply_logit_bias(&self.params.logit_bias, logits);
        self.history.apply_penalties(&self.params, logits);
        if let Some(allowed) = allowed {
            mask::apply(allowed, logits);
        }
        let mut token = if self.params.is_greedy() {
            filters::argmax(logits)
        } else {
            self.draw(logits)
        };
        if let Some(allowed) = allowed
            && !mask::is_allowed(allowed, token)
        {
            // Only when every allowed logit is NaN or -inf: the argmax fell on a banned token.
            token = mask::first_allowed(allowed, logits.len()).unwrap_or(token);
        }
        self.record(token);
        token
    }

    /// Records `token` as the sequence's next output token without sampling, for when the
    /// caller picked it another way (a device-side argmax, a forced token). The generator does
    /// not advance.
    pub fn record(&mut self, token: u32) {
        self.history.record(token);
    }

    /// Steps 4 to 6 of [`Sampler::sample`] over the biased and penalised `logits`.
    fn draw(&mut self, logits: &[f32]) -> u32 {
        let params = &self.params;
        let candidates = &mut self.candidates;
        filters::collect_tempered(logits, params.temperature, candidates);
        if candidates.is_empty() {
            return filters::argmax(logits);
        }
        if let Some(k) = params.top_k {
            filters::top_k(candidates, k as usize, &mut self.keys);
        }
        let total = softmax::weigh(candidates);
        filters::min_p(candidates, params.min_p);
        filters::top_p(candidates, params.top_p, total, &mut self.keys);
        softmax::draw(candidates, self.rng.next_f64())
    }
}

impl fmt::Debug for Sampler {
    /// The parameters and seed; the token history is summarised, as it can hold a whole prompt.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Sampler")
            .field("params", &self.params)
            .field("seed", &self.seed)
            .finish_non_exhaustive()
    }
}

/// A seed that differs between calls: the wall clock in nanoseconds, hashed with a fresh
/// [`RandomState`] (random keys per process, advanced on every call).
fn seed_from_clock() -> u64 {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let mut hasher = RandomState::new().build_hasher();
    hasher.write_u128(nanos);
    hasher.finish()
}
