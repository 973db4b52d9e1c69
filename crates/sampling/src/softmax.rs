// SPDX-License-Identifier: MIT OR Apache-2.0
//! From logits to a distribution, and one draw from it.
//!
//! The weights are unnormalised (`exp(logit - max)`, so the most likely token weighs exactly 1)
//! and summed in f64; the draw scales its uniform number by the sum instead of dividing every
//! weight by it. The exponential is computed here with basic IEEE arithmetic only, because
//! `f32::exp` calls the platform's libm, whose last bit differs between platforms, and one bit can
//! move a draw across a boundary: with this one, a seed names the same token everywhere.

use crate::filters::Candidate;

/// Sets every candidate's weight to `exp(logit - max_logit)` and returns their sum.
///
/// When some logit is `+inf` (a finite logit over a tiny temperature can overflow), those tokens
/// share all the mass equally and the rest get zero, which is the limit of the softmax.
pub(crate) fn weigh(candidates: &mut [Candidate]) -> f64 {
    let max = candidates
        .iter()
        .map(|c| c.logit)
        .fold(f32::NEG_INFINITY, f32::max);
    if max == f32::INFINITY {
        for c in candidates.iter_mut() {
            c.weight = if c.logit == f32::INFINITY { 1.0 } else { 0.0 };
        }
    } else {
        for c in candidates.iter_mut() {
            c.weight = exp_nonpositive(c.logit - max);
        }
    }
    candidates.iter().map(|c| f64::from(c.weight)).sum()
}

/// The token a uniform `u` in `[0, 1)` names: the first candidate whose cumulative weight exceeds
/// `u` times the total, walking in the list's (token) order. Zero weights are never picked.
///
/// # Panics
/// If `candidates` is empty.
pub(crate) fn draw(candidates: &[Candidate], u: f64) -> u32 {
    let total: f64 = candidates.iter().map(|c| f64::from(c.weight)).sum();
    let target = u * total;
    let mut mass = 0.0;
    for c in candidates {
        mass += f64::from(c.weight);
        if mass > target {
            return c.token;
        }
    }
    // `u < 1` makes this unreachable unless rounding left `target` at the very top; fall back to
    // the last token with any weight (the most likely one weighs 1), then to the last token.
    candidates
        .iter()
        .rev()
        .find(|c| c.weight > 0.0)
        .or(candidates.last())
        .expect("draw needs at least one candidate")
        .token
}

/// `1/k!` for `k = 0..=9`, the Taylor coefficients of `e^r`.
const INVERSE_FACTORIALS: [f64; 10] = {
    let mut coefficients = [1.0; 10];
    let mut k = 1;
    while k < coefficients.len() {
        coefficients[k] = coefficients[k - 1] / k as f64;
        k += 1;
    }
    coefficients
};

/// `e^x` for `x <= 0` (NaN gives 0), within one f32 ulp, bit-identical on every IEEE-754
/// platform.
///
/// `e^x = 2^n * e^r` with `n` the integer nearest `x / ln 2` and `|r| <= ln 2 / 2`; `e^r` by its
/// Taylor series to degree 9 (relative error below `1e-11`, far under an f32 ulp), all in f64,
/// then one rounding to f32. Only `+`, `*`, exact conversions and bit moves, with no branch and no
/// libm call (not even `round`, which is one on baseline x86-64), so the loop over a vocabulary
/// runs at a few nanoseconds a token.
fn exp_nonpositive(x: f32) -> f32 {
    // 1.5 * 2^52: adding it rounds to an integer (to nearest, the IEEE default) and leaves that
    // integer, two's complement, in the low bits of the sum.
    const ROUND_SHIFT: f64 = 6_755_399_441_055_744.0;
    // e^-104 is under half the smallest f32 subnormal, so clamping there still gives 0.
    let x = f64::from(x.max(-104.0));
    let shifted = x * std::f64::consts::LOG2_E + ROUND_SHIFT;
    let n = shifted - ROUND_SHIFT;
    let r = x - n * std::f64::consts::LN_2;
    let poly = INVERSE_FACTORIALS
        .iter()
        .rev()
        .fold(0.0, |acc, c| acc * r + c);
    // n lies in [-150, 0]; the low 12 bits of `shifted` are n, and moved into the exponent field
    // with the bias added they make exactly 2^n.
    let two_to_n = f64::from_bits((shifted.to_bits() << 52).wrapping_add(1023 << 52));
    (poly * two_to_n) as f32
}

#[cfg(test)]
mod tests {
    use super::*;

    fn candidates(logits: &[f32]) -> Vec<Candidate> {
        logits
            .iter()
            .enumerate()
            .map(|(i, &logit)| Candidate {
                token: i as u32,
                logit,
                weight: 0.0,
            })
            .collect()
    }

    #[test]
    fn exp_matches_the_platform_exp_to_an_ulp() {
        assert_eq!(exp_nonpositive(0.0), 1.0);
        assert_eq!(exp_nonpositive(-0.0), 1.0);
        assert_eq!(exp_nonpositive(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_nonpositive(-200.0), 0.0);
        assert_eq!(exp_nonpositive(-104.0), 0.0);
        assert_eq!(exp_nonpositive(f32::NAN), 0.0);
        let mut x = -104.0f32;
        while x <= 0.0 {
            let ours = exp_nonpositive(x);
            let exact = f64::from(x).exp();
            let ulp = f64::from(f32::from_bits(ours.to_bits() + 1) - ours);
            assert!(
                (f64::from(ours) - exact).abs() <= ulp,
                "exp({x}) = {ours}, want {exact}"
            );
            x += 0.0007;
        }
    }

    #[test]
    fn weights_are_relative_to_the_most_likely() {
        let mut c = candidates(&[0.0, 2.0_f32.ln(), -(2.0_f32.ln())]);
        let total = weigh(&mut c);
        let w: Vec<f32> = c.iter().map(|c| c.weight).collect();
        assert_eq!(w[1], 1.0);
        assert!(
            (w[0] - 0.5).abs() < 1e-7 && (w[2] - 0.25).abs() < 1e-7,
            "{w:?}"
        );
        assert!((total - 1.75).abs() < 1e-6);
    }

    #[test]
    fn infinite_logits_share_all_the_mass() {
        let mut c = candidates(&[f32::INFINITY, 3.0, f32::INFINITY]);
        assert_eq!(weigh(&mut c), 2.0);
        assert_eq!(
            c.iter().map(|c| c.weight).collect::<Vec<_>>(),
            [1.0, 0.0, 1.0]
        );
        assert_eq!(draw(&c, 0.0), 0);
        assert_eq!(draw(&c, 0.49), 0);
        assert_eq!(draw(&c, 0.51), 2);
    }

    #[test]
    fn draw_walks_the_cumulative_weights() {
        let mut c = candidates(&[0.0; 4]);
        for (c, w) in c.iter_mut().zip([0.0, 1.0, 0.0, 3.0]) {
            c.weight = w;
        }
        assert_eq!(
            draw(&c, 0.0),
            1,
            "a zero weight is never picked, even at u = 0"
        );
        assert_eq!(draw(&c, 0.2499), 1);
        assert_eq!(draw(&c, 0.25), 3);
        assert_eq!(draw(&c, 0.999_999), 3);
    }
}
