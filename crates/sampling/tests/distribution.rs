// SPDX-License-Identifier: MIT OR Apache-2.0
//! Sampling draws from the distribution it claims: observed frequencies over 20k draws against the
//! exact renormalised probabilities, by a chi-square test. The seeds are fixed, so a pass is a
//! pass forever; the threshold (the 0.999 quantile) says how unlikely a correct sampler is to
//! fail on a fresh seed.

use metrale_sampling::{Sampler, SamplingParams};

const DRAWS: usize = 20_000;

/// Probabilities of the test distribution, most likely first.
const PROBS: [f64; 5] = [0.5, 0.25, 0.15, 0.07, 0.03];

/// The 0.999 quantile of the chi-square distribution with 1 to 4 degrees of freedom.
const CHI_SQUARE_999: [f64; 4] = [10.83, 13.82, 16.27, 18.47];

/// Logits whose softmax is [`PROBS`], shifted to show that only differences matter.
fn logits() -> Vec<f32> {
    PROBS.iter().map(|p| p.ln() as f32 + 1.7).collect()
}

/// `weights` scaled to sum to 1.
fn normalised(weights: &[f64]) -> Vec<f64> {
    let total: f64 = weights.iter().sum();
    weights.iter().map(|w| w / total).collect()
}

/// Draws [`DRAWS`] tokens with `params` and checks their frequencies against `expected`:
/// tokens of probability 0 are never drawn, and the rest pass the chi-square test and lie within
/// 0.015 of their probability.
fn assert_draws_match(params: SamplingParams, expected: &[f64]) {
    let mut sampler = Sampler::new(
        SamplingParams {
            seed: Some(2718),
            ..params.clone()
        },
        &[],
    );
    let mut counts = vec![0u32; PROBS.len()];
    for _ in 0..DRAWS {
        counts[sampler.sample(&mut logits()) as usize] += 1;
    }
    let mut chi_square = 0.0;
    let mut cells = 0;
    for (token, (&count, &p)) in counts.iter().zip(expected).enumerate() {
        if p == 0.0 {
            assert_eq!(count, 0, "token {token} has probability 0 under {params:?}");
            continue;
        }
        let frequency = f64::from(count) / DRAWS as f64;
        assert!(
            (frequency - p).abs() < 0.015,
            "token {token}: {frequency} vs {p} under {params:?}"
        );
        let expected_count = p * DRAWS as f64;
        chi_square += (f64::from(count) - expected_count).powi(2) / expected_count;
        cells += 1;
    }
    let critical = CHI_SQUARE_999[cells - 2];
    assert!(
        chi_square < critical,
        "chi-square {chi_square} >= {critical} under {params:?}: {counts:?}"
    );
}

#[test]
fn temperature_one_draws_the_softmax() {
    assert_draws_match(SamplingParams::default(), &PROBS);
}

#[test]
fn temperature_reshapes_the_softmax() {
    // Dividing the logits by T raises the probabilities to the power 1/T.
    for temperature in [0.5_f32, 2.0] {
        let expected = normalised(&PROBS.map(|p| p.powf(1.0 / f64::from(temperature))));
        assert_draws_match(
            SamplingParams {
                temperature,
                ..SamplingParams::default()
            },
            &expected,
        );
    }
}

#[test]
fn top_k_renormalises_what_it_keeps() {
    let expected = normalised(&[0.5, 0.25, 0.15, 0.0, 0.0]);
    assert_draws_match(
        SamplingParams {
            top_k: Some(3),
            ..SamplingParams::default()
        },
        &expected,
    );
}

#[test]
fn top_p_keeps_the_smallest_set_reaching_its_mass() {
    // 0.5 + 0.25 = 0.75 < 0.8 <= 0.9 = 0.5 + 0.25 + 0.15.
    let expected = normalised(&[0.5, 0.25, 0.15, 0.0, 0.0]);
    assert_draws_match(
        SamplingParams {
            top_p: 0.8,
            ..SamplingParams::default()
        },
        &expected,
    );
}

#[test]
fn min_p_cuts_relative_to_the_most_likely() {
    // min_p 0.1 keeps p >= 0.05: four tokens.
    let expected = normalised(&[0.5, 0.25, 0.15, 0.07, 0.0]);
    assert_draws_match(
        SamplingParams {
            min_p: 0.1,
            ..SamplingParams::default()
        },
        &expected,
    );
}

#[test]
fn filters_compose() {
    // Top-k keeps four, renormalised: 0.5/0.97, 0.25/0.97, 0.15/0.97, 0.07/0.97; top-p 0.7 then
    // needs the first two (0.515 < 0.7 <= 0.773).
    let expected = normalised(&[0.5, 0.25, 0.0, 0.0, 0.0]);
    let params = SamplingParams {
        top_k: Some(4),
        top_p: 0.7,
        ..SamplingParams::default()
    };
    assert_draws_match(params, &expected);
}
