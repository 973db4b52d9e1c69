// SPDX-License-Identifier: MIT OR Apache-2.0
//! `SamplingParams::validate`: every bad field is refused with a message naming it and its value.

use metrale_sampling::{SamplingError, SamplingParams};

const VOCAB: usize = 1000;

/// The error for `params`, which must be refused.
fn refused(params: SamplingParams) -> SamplingError {
    params
        .validate(VOCAB)
        .expect_err("these parameters must be refused")
}

/// Asserts that setting one field to each of `bad` is refused, naming `field` and the value.
fn refuses_each(field: &str, bad: &[f32], set: impl Fn(&mut SamplingParams, f32)) {
    for &value in bad {
        let mut params = SamplingParams::default();
        set(&mut params, value);
        let message = refused(params).to_string();
        assert!(message.contains(&format!("`{field}`")), "{message}");
        assert!(message.contains(&value.to_string()), "{message}");
    }
}

#[test]
fn defaults_and_edges_of_every_range_are_accepted() {
    let edges = SamplingParams {
        temperature: 0.0,
        top_k: Some(0),
        top_p: 1.0,
        min_p: 1.0,
        repetition_penalty: 0.01,
        presence_penalty: -2.0,
        frequency_penalty: 2.0,
        logit_bias: vec![(0, -100.0), (VOCAB as u32 - 1, 100.0)],
        seed: Some(0),
    };
    assert_eq!(SamplingParams::default().validate(VOCAB), Ok(()));
    assert_eq!(edges.validate(VOCAB), Ok(()));
}

#[test]
fn default_is_plain_sampling() {
    let params = SamplingParams::default();
    assert_eq!(params.temperature, 1.0);
    assert_eq!(params.top_k, None);
    assert_eq!(params.top_p, 1.0);
    assert_eq!(params.min_p, 0.0);
    assert_eq!(params.repetition_penalty, 1.0);
    assert_eq!(
        (params.presence_penalty, params.frequency_penalty),
        (0.0, 0.0)
    );
    assert!(params.logit_bias.is_empty() && params.seed.is_none());
    assert!(!params.is_greedy());
    assert!(
        SamplingParams {
            temperature: 0.0,
            ..params
        }
        .is_greedy()
    );
}

#[test]
fn plain_greedy_means_no_bias_and_no_penalty() {
    let greedy = SamplingParams {
        temperature: 0.0,
        ..SamplingParams::default()
    };
    assert!(greedy.is_plain_greedy());
    assert!(!SamplingParams::default().is_plain_greedy());
    for p in [
        SamplingParams {
            repetition_penalty: 1.1,
            ..greedy.clone()
        },
        SamplingParams {
            presence_penalty: 0.5,
            ..greedy.clone()
        },
        SamplingParams {
            frequency_penalty: -0.5,
            ..greedy.clone()
        },
        SamplingParams {
            logit_bias: vec![(3, 1.0)],
            ..greedy.clone()
        },
    ] {
        assert!(p.is_greedy() && !p.is_plain_greedy(), "{p:?}");
    }
}

#[test]
fn temperature_must_be_finite_and_non_negative() {
    refuses_each("temperature", &[-0.5, f32::NAN, f32::INFINITY], |p, v| {
        p.temperature = v
    });
}

#[test]
fn top_p_must_lie_in_the_half_open_unit_interval() {
    refuses_each("top_p", &[0.0, -0.1, 1.01, f32::NAN], |p, v| p.top_p = v);
}

#[test]
fn min_p_must_lie_in_the_unit_interval() {
    refuses_each("min_p", &[-0.01, 1.5, f32::NAN], |p, v| p.min_p = v);
}

#[test]
fn repetition_penalty_must_be_positive_and_finite() {
    refuses_each(
        "repetition_penalty",
        &[0.0, -1.0, f32::NAN, f32::INFINITY],
        |p, v| p.repetition_penalty = v,
    );
}

#[test]
fn presence_and_frequency_penalties_must_lie_in_plus_minus_two() {
    refuses_each("presence_penalty", &[-2.5, 2.01, f32::NAN], |p, v| {
        p.presence_penalty = v
    });
    refuses_each("frequency_penalty", &[-3.0, 2.5, f32::NAN], |p, v| {
        p.frequency_penalty = v
    });
}

#[test]
fn logit_bias_must_name_a_vocabulary_token() {
    let error = refused(SamplingParams {
        logit_bias: vec![(5, 1.0), (VOCAB as u32, 1.0)],
        ..SamplingParams::default()
    });
    assert_eq!(
        error,
        SamplingError::BiasTokenOutOfVocab {
            token: VOCAB as u32,
            vocab_size: VOCAB
        }
    );
    let message = error.to_string();
    assert!(
        message.contains("`logit_bias`") && message.contains("1000"),
        "{message}"
    );
}

#[test]
fn logit_bias_must_be_finite() {
    for bias in [f32::NEG_INFINITY, f32::INFINITY, f32::NAN] {
        let error = refused(SamplingParams {
            logit_bias: vec![(7, bias)],
            ..SamplingParams::default()
        });
        let message = error.to_string();
        assert!(message.contains("`logit_bias`"), "{message}");
        assert!(
            message.contains("token 7") && message.contains(&bias.to_string()),
            "{message}"
        );
    }
}

#[test]
fn the_first_bad_field_is_reported_with_its_range() {
    let error = refused(SamplingParams {
        temperature: -1.0,
        top_p: 0.0,
        ..SamplingParams::default()
    });
    assert_eq!(
        error.to_string(),
        "sampling parameter `temperature` = -1 is out of range: expected a finite number >= 0 \
         (0 means greedy)"
    );
}
