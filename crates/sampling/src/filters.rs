// SPDX-License-Identifier: MIT OR Apache-2.0
//! Narrowing the vocabulary to the tokens a draw may pick: argmax, top-k, top-p and min-p over a
//! list of [`Candidate`]s.
//!
//! Invariant: every function here takes and leaves the list in ascending token order. The draw
//! walks the list in that order, so which token a random number names depends only on the kept
//! set and its weights, never on how a selection happened to arrange things (which the standard
//! library is free to change between releases).
//!
//! Top-k and top-p both keep a prefix of a ranking (by logit or by weight, the lower token id first
//! among equals). Each finds the prefix's last member with a selection over [`rank_key`]s, plain
//! `u64`s that compare several times faster than a float comparator with a tie-break, then keeps
//! every candidate ranked at or above it with one order-preserving pass. Only the candidates the
//! nucleus search must inspect are sorted; the whole list only when the nucleus is most of it.

/// Where the nucleus search starts: most nuclei of a trained model hold far fewer tokens, so one
/// linear selection and a sort of this many usually settle it.
const FIRST_NUCLEUS_GUESS: usize = 256;

/// A token still in the running.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Candidate {
    /// Token id, an index into the logits.
    pub token: u32,
    /// Its logit after temperature; never NaN or `-inf`.
    pub logit: f32,
    /// `exp(logit - max_logit)` once [`crate::softmax::weigh`] ran: in `[0, 1]`, `1` for the most
    /// likely token; proportional to the probability.
    pub weight: f32,
}

/// Index of the largest logit; ties go to the lowest index, NaN never wins, all-NaN (or empty)
/// gives 0. The same rule as the device argmax kernel and its host reference.
pub(crate) fn argmax(logits: &[f32]) -> u32 {
    let mut best: Option<(usize, f32)> = None;
    for (i, &v) in logits.iter().enumerate() {
        if !v.is_nan() && best.is_none_or(|(_, b)| v > b) {
            best = Some((i, v));
        }
    }
    best.map_or(0, |(i, _)| i as u32)
}

/// Fills `out` with every token whose `logit / temperature` can be drawn (not NaN, not `-inf`),
/// in token order. `temperature` must be positive.
pub(crate) fn collect_tempered(logits: &[f32], temperature: f32, out: &mut Vec<Candidate>) {
    out.clear();
    out.extend(logits.iter().enumerate().filter_map(|(i, &l)| {
        let logit = l / temperature;
        (!logit.is_nan() && logit != f32::NEG_INFINITY).then_some(Candidate {
            token: i as u32,
            logit,
            weight: 0.0,
        })
    }));
}

/// Keeps the `k` candidates with the largest logits (the lowest token ids win ties); `k == 0` is
/// off. Linear on average: one selection over `keys` (scratch), one filtering pass.
pub(crate) fn top_k(candidates: &mut Vec<Candidate>, k: usize, keys: &mut Vec<u64>) {
    if k == 0 || k >= candidates.len() {
        return;
    }
    keys.clear();
    keys.extend(candidates.iter().map(|c| rank_key(c.logit, c.token)));
    let (_, &mut last, _) = keys.select_nth_unstable_by(k - 1, |a, b| b.cmp(a));
    candidates.retain(|c| rank_key(c.logit, c.token) >= last);
}

/// Keeps the candidates whose weight is `>= min_p` times the largest weight (which is 1), and
/// then no zero weight; `0` is off (zero weights stay, but the draw never picks one). `min_p` is
/// capped at 1 (NaN counts as 1), so the most likely token always stays.
pub(crate) fn min_p(candidates: &mut Vec<Candidate>, min_p: f32) {
    if min_p == 0.0 {
        return;
    }
    let cut = min_p.min(1.0);
    candidates.retain(|c| c.weight > 0.0 && c.weight >= cut);
}

/// Keeps the nucleus: the shortest run of most likely candidates (the lowest token ids first
/// among equals) whose weights sum to `>= top_p * total`; all of them when rounding keeps the
/// sum short. Always keeps at least one. `top_p >= 1` is off.
///
/// `total` is the weight of the whole distribution, which may exceed the list's own (after
/// min-p removed its tail: min-p and top-p both keep a prefix of the same order, so applying
/// min-p first and measuring top-p against the earlier total gives the same set, faster).
///
/// Cost: it selects the `n` most likely with a linear selection over `keys` (scratch) and sorts
/// only those, growing `n` until the nucleus fits, so a peaked distribution over a large
/// vocabulary is never fully sorted.
pub(crate) fn top_p(candidates: &mut Vec<Candidate>, top_p: f32, total: f64, keys: &mut Vec<u64>) {
    if top_p >= 1.0 || candidates.len() <= 1 {
        return;
    }
    let threshold = f64::from(top_p) * total;
    keys.clear();
    keys.extend(candidates.iter().map(|c| rank_key(c.weight, c.token)));
    let mut prefix = FIRST_NUCLEUS_GUESS.min(keys.len());
    let last = loop {
        if prefix < keys.len() {
            keys.select_nth_unstable_by(prefix - 1, |a, b| b.cmp(a));
        }
        keys[..prefix].sort_unstable_by(|a, b| b.cmp(a));
        let mut mass = 0.0;
        let reached = keys[..prefix].iter().find(|&&key| {
            mass += f64::from(weight_of(key));
            mass >= threshold
        });
        match reached {
            Some(&key) => break key,
            None if prefix == keys.len() => return,
            None => prefix = prefix.saturating_mul(4).min(keys.len()),
        }
    };
    candidates.retain(|c| rank_key(c.weight, c.token) >= last);
}

/// A key that orders candidates as the filters rank them: a larger `value` first, then a lower
/// `token`. The high half is `value`'s bits mapped so that unsigned order is numeric order
/// (`-0.0` counted as `+0.0`, so the two zeros tie as they do in the argmax); the low half is the
/// token's complement. `value` must not be NaN.
fn rank_key(value: f32, token: u32) -> u64 {
    // IEEE addition turns -0.0 into +0.0 and leaves every other value alone.
    let bits = (value + 0.0).to_bits();
    let ordered = if bits >> 31 == 1 {
        !bits
    } else {
        bits | 1 << 31
    };
    u64::from(ordered) << 32 | u64::from(!token)
}

/// The weight a [`rank_key`] of a non-negative weight was made from.
fn weight_of(key: u64) -> f32 {
    f32::from_bits((key >> 32) as u32 & !(1 << 31))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn weighted(weights: &[f32]) -> Vec<Candidate> {
        weights
            .iter()
            .enumerate()
            .map(|(i, &weight)| Candidate {
                token: i as u32,
                logit: weight.ln(),
                weight,
            })
            .collect()
    }

    fn tokens(candidates: &[Candidate]) -> Vec<u32> {
        candidates.iter().map(|c| c.token).collect()
    }

    #[test]
    fn rank_keys_order_by_value_then_lower_token() {
        let ranked = [
            rank_key(f32::INFINITY, 0),
            rank_key(2.5, 0),
            rank_key(2.5, 1),
            rank_key(1e-30, 0),
            rank_key(0.0, 3),
            rank_key(-1e-30, 0),
            rank_key(-2.5, 0),
            rank_key(f32::NEG_INFINITY, 0),
        ];
        assert!(ranked.windows(2).all(|w| w[0] > w[1]), "{ranked:x?}");
        assert_eq!(rank_key(-0.0, 4), rank_key(0.0, 4), "the two zeros tie");
        for w in [0.0, 1e-40, 0.3, 1.0] {
            assert_eq!(weight_of(rank_key(w, 9)), w);
        }
    }

    #[test]
    fn argmax_prefers_the_lowest_index_and_skips_nan() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, 2.0]), 1);
        assert_eq!(argmax(&[f32::NAN, 0.5, f32::NAN, 0.7]), 3);
        assert_eq!(argmax(&[f32::NEG_INFINITY, f32::NEG_INFINITY]), 0);
        assert_eq!(argmax(&[f32::NAN, f32::NAN]), 0);
        assert_eq!(argmax(&[]), 0);
    }

    #[test]
    fn collect_drops_what_cannot_be_drawn() {
        let mut out = Vec::new();
        collect_tempered(&[2.0, f32::NAN, f32::NEG_INFINITY, -4.0], 2.0, &mut out);
        assert_eq!(tokens(&out), [0, 3]);
        assert_eq!(out[0].logit, 1.0);
        assert_eq!(out[1].logit, -2.0);
    }

    #[test]
    fn top_k_keeps_the_largest_in_token_order_and_breaks_ties_low() {
        let mut c = weighted(&[0.1, 0.5, 0.3, 0.5, 0.05]);
        top_k(&mut c, 2, &mut Vec::new());
        assert_eq!(tokens(&c), [1, 3]);
        let mut c = weighted(&[0.1, 0.5, 0.3, 0.5, 0.05]);
        top_k(&mut c, 1, &mut Vec::new());
        assert_eq!(tokens(&c), [1]);
        let mut c = weighted(&[0.1, 0.5, 0.3]);
        top_k(&mut c, 0, &mut Vec::new());
        assert_eq!(c.len(), 3);
    }

    #[test]
    fn top_p_keeps_the_smallest_set_reaching_the_mass() {
        // Probabilities 0.4, 0.3, 0.2, 0.1 in a shuffled token order.
        let mut c = weighted(&[0.2, 0.4, 0.1, 0.3]);
        top_p(&mut c, 0.7, 1.0, &mut Vec::new());
        assert_eq!(tokens(&c), [1, 3]);
        let mut c = weighted(&[0.2, 0.4, 0.1, 0.3]);
        top_p(&mut c, 0.71, 1.0, &mut Vec::new());
        assert_eq!(tokens(&c), [0, 1, 3]);
        let mut c = weighted(&[0.2, 0.4, 0.1, 0.3]);
        top_p(&mut c, 1e-6, 1.0, &mut Vec::new());
        assert_eq!(tokens(&c), [1]);
    }

    #[test]
    fn top_p_grows_its_guess_over_a_flat_distribution() {
        let n = 5 * FIRST_NUCLEUS_GUESS;
        let mut c = weighted(&vec![1.0; n]);
        top_p(&mut c, 0.5, n as f64, &mut Vec::new());
        // Equal weights: the lowest ids come first, and half the mass is half the tokens.
        assert_eq!(tokens(&c), (0..n as u32 / 2).collect::<Vec<_>>());
    }

    #[test]
    fn top_p_keeps_everything_when_rounding_falls_short() {
        let mut c = weighted(&[0.5, 0.5]);
        top_p(&mut c, 0.999_999_9, 1.0 + 1e-6, &mut Vec::new());
        assert_eq!(tokens(&c), [0, 1]);
    }

    #[test]
    fn min_p_is_relative_to_the_most_likely() {
        let mut c = weighted(&[0.5, 1.0, 0.2, 0.0]);
        min_p(&mut c, 0.5);
        assert_eq!(tokens(&c), [0, 1]);
        let mut c = weighted(&[0.5, 1.0, 0.2, 0.0]);
        min_p(&mut c, 0.0);
        assert_eq!(tokens(&c), [0, 1, 2, 3], "off");
        let mut c = weighted(&[0.5, 1.0, 0.2, 0.0]);
        min_p(&mut c, 1e-9);
        assert_eq!(tokens(&c), [0, 1, 2], "zero weights go when min-p is on");
        let mut c = weighted(&[0.5, 1.0, 0.2]);
        min_p(&mut c, 1.0);
        assert_eq!(tokens(&c), [1]);
        let mut c = weighted(&[0.5, 1.0, 0.2]);
        min_p(&mut c, f32::NAN);
        assert_eq!(
            tokens(&c),
            [1],
            "an unvalidated min-p still keeps the most likely"
        );
    }
}
