// SPDX-License-Identifier: MIT OR Apache-2.0
//! Allowed-token bitsets, as a grammar hands them to the sampler.
//!
//! Layout (the one `metrale-grammar` fills): token `i` is bit `i % 32` of word `i / 32`; a set
//! bit allows the token. Tokens past the last word are not allowed.

/// Whether `token` is allowed by `allowed`.
pub(crate) fn is_allowed(allowed: &[u32], token: u32) -> bool {
    allowed
        .get(token as usize / 32)
        .is_some_and(|word| word & (1 << (token % 32)) != 0)
}

/// Sets every logit the bitset does not allow to `-inf`, 32 at a time.
pub(crate) fn apply(allowed: &[u32], logits: &mut [f32]) {
    let words = allowed.iter().copied().chain(std::iter::repeat(0));
    for (chunk, word) in logits.chunks_mut(32).zip(words) {
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
}

/// The lowest allowed token below `vocab_size`, if any.
pub(crate) fn first_allowed(allowed: &[u32], vocab_size: usize) -> Option<u32> {
    allowed
        .iter()
        .enumerate()
        .find(|(_, word)| **word != 0)
        .map(|(i, word)| (i * 32) as u32 + word.trailing_zeros())
        .filter(|&token| (token as usize) < vocab_size)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bits_map_to_tokens_and_the_rest_is_banned() {
        // Tokens 1, 33 and 63 allowed; 70 logits, so tokens 64..70 fall past the bitset.
        let allowed = [1 << 1, (1 << 1) | (1 << 31)];
        let mut logits = vec![0.5_f32; 70];
        apply(&allowed, &mut logits);
        let kept: Vec<usize> = (0..70).filter(|&i| logits[i].is_finite()).collect();
        assert_eq!(kept, vec![1, 33, 63]);
        assert!(is_allowed(&allowed, 33) && !is_allowed(&allowed, 32));
        assert!(!is_allowed(&allowed, 64), "past the bitset");
        assert_eq!(first_allowed(&allowed, 70), Some(1));
        assert_eq!(first_allowed(&[0, 1 << 4], 70), Some(36));
        assert_eq!(first_allowed(&[0, 1 << 4], 36), None);
        assert_eq!(first_allowed(&[], 70), None);
    }

    #[test]
    fn full_words_are_left_alone() {
        let mut logits = vec![1.0_f32; 40];
        apply(&[u32::MAX, u32::MAX], &mut logits);
        assert!(logits.iter().all(|&l| l == 1.0));
    }
}
