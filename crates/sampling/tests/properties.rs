// SPDX-License-Identifier: MIT OR Apache-2.0
//! Properties over thousands of random cases (random logits with ties, NaN and `-inf`; random
//! temperature, top-k, top-p and min-p): the drawn token always has a finite logit, lies in the
//! top-k set, in the top-p nucleus and above the min-p cut, each recomputed here independently in
//! f64, and the same seed draws it again.

use std::cmp::Ordering;

use metrale_sampling::rng::Xoshiro256StarStar;
use metrale_sampling::{Sampler, SamplingParams};

/// Slack for comparing the sampler's f32-weight, f64-sum arithmetic with this file's f64 one.
const SLACK: f64 = 1e-5;

/// A random case: logits and parameters.
fn random_case(rng: &mut Xoshiro256StarStar, vocab: usize) -> (Vec<f32>, SamplingParams) {
    let scale = [0.5, 3.0, 10.0, 40.0][rng.next_below(4) as usize];
    let integer = rng.next_below(4) == 0; // integer logits give many exact ties
    let logits = (0..vocab)
        .map(|_| match rng.next_below(20) {
            0 => f32::NAN,
            1 => f32::NEG_INFINITY,
            _ => {
                let l = (rng.next_f64() * 2.0 - 1.0) as f32 * scale;
                if integer { l.round() } else { l }
            }
        })
        .collect();
    let params = SamplingParams {
        temperature: [0.05, 0.3, 0.7, 1.0, 1.5, 3.0][rng.next_below(6) as usize],
        top_k: match rng.next_below(3) {
            0 => None,
            1 => Some(0),
            _ => Some(1 + rng.next_below(vocab as u64 + 5) as u32),
        },
        top_p: if rng.next_below(3) == 0 {
            1.0
        } else {
            1.0 - rng.next_f64() as f32
        },
        min_p: if rng.next_below(3) == 0 {
            0.0
        } else {
            rng.next_f64() as f32 * 0.5
        },
        seed: Some(rng.next_u64()),
        ..SamplingParams::default()
    };
    (logits, params)
}

/// Asserts what a draw of `token` from `logits` under `params` must satisfy.
fn assert_token_is_allowed(logits: &[f32], params: &SamplingParams, token: u32) {
    let t = token as usize;
    assert!(
        logits[t].is_finite(),
        "token {token} has logit {} under {params:?}",
        logits[t]
    );

    // Drawable tokens, tempered exactly as the sampler does, ranked best first (lowest id on ties).
    let mut ranked: Vec<(usize, f32)> = logits
        .iter()
        .map(|&l| l / params.temperature)
        .enumerate()
        .filter(|&(_, l)| !l.is_nan() && l != f32::NEG_INFINITY)
        .collect();
    ranked.sort_by(|a, b| {
        b.1.partial_cmp(&a.1)
            .unwrap_or(Ordering::Equal)
            .then(a.0.cmp(&b.0))
    });

    let k = params
        .top_k
        .filter(|&k| k > 0)
        .map_or(ranked.len(), |k| (k as usize).min(ranked.len()));
    let rank = ranked
        .iter()
        .position(|&(i, _)| i == t)
        .expect("the token is drawable");
    assert!(
        rank < k,
        "token {token} has rank {rank}, outside top-{k} under {params:?}"
    );
    ranked.truncate(k);

    let max = f64::from(ranked[0].1);
    let probs: Vec<f64> = ranked
        .iter()
        .map(|&(_, l)| (f64::from(l) - max).exp())
        .collect();
    let total: f64 = probs.iter().sum();
    let p = probs[rank];
    // min-p: relative to the most likely, whose weight is 1.
    assert!(
        p >= f64::from(params.min_p) * (1.0 - SLACK),
        "p {p} under the min-p cut of {params:?}"
    );
    // top-p: the nucleus, made a little larger to absorb rounding, must contain the token.
    if params.top_p < 1.0 {
        let threshold = (f64::from(params.top_p) + SLACK) * total;
        let mut mass = 0.0;
        let nucleus = probs.iter().position(|&q| {
            mass += q;
            mass >= threshold
        });
        let nucleus = nucleus.map_or(probs.len(), |last| last + 1);
        // Tokens tied with the nucleus's last one are as good as it.
        let edge = probs[nucleus - 1];
        assert!(
            rank < nucleus || p >= edge * (1.0 - SLACK),
            "token {token} (rank {rank}, p {p}) outside the {nucleus}-token nucleus of {params:?}"
        );
    }
}

fn check_cases(seed: u64, cases: usize, vocab: impl Fn(&mut Xoshiro256StarStar) -> usize) {
    let mut rng = Xoshiro256StarStar::seed_from_u64(seed);
    let mut checked = 0;
    for _ in 0..cases {
        let n = vocab(&mut rng);
        let (logits, params) = random_case(&mut rng, n);
        if !logits.iter().any(|l| l.is_finite()) {
            continue; // nothing drawable: the fallback has its own test
        }
        let token = Sampler::new(params.clone(), &[]).sample(&mut logits.clone());
        assert_token_is_allowed(&logits, &params, token);
        let again = Sampler::new(params.clone(), &[]).sample(&mut logits.clone());
        assert_eq!(
            token, again,
            "the same seed drew differently under {params:?}"
        );
        checked += 1;
    }
    assert!(
        checked > cases * 9 / 10,
        "only {checked} of {cases} cases had a drawable token"
    );
}

#[test]
fn small_vocabularies() {
    check_cases(100, 5000, |rng| 1 + rng.next_below(64) as usize);
}

#[test]
fn medium_vocabularies() {
    check_cases(200, 1000, |rng| 200 + rng.next_below(2000) as usize);
}

#[test]
fn many_draws_from_one_sequence_stay_inside_the_filters() {
    let mut rng = Xoshiro256StarStar::seed_from_u64(300);
    for _ in 0..20 {
        let (logits, params) = random_case(&mut rng, 500);
        let mut sampler = Sampler::new(params.clone(), &[]);
        for _ in 0..200 {
            let token = sampler.sample(&mut logits.clone());
            assert_token_is_allowed(&logits, &params, token);
        }
    }
}

#[test]
fn a_full_size_vocabulary_with_a_wide_nucleus() {
    // 152k tokens with nearly flat logits: the nucleus holds tens of thousands of tokens, so the
    // nucleus search must grow its guess several times.
    const VOCAB: usize = 152_064;
    let mut rng = Xoshiro256StarStar::seed_from_u64(400);
    let logits: Vec<f32> = (0..VOCAB).map(|_| rng.next_f64() as f32 * 0.5).collect();
    for (top_p, top_k) in [(0.5, None), (0.95, Some(1000)), (0.3, Some(100_000))] {
        let params = SamplingParams {
            top_p,
            top_k,
            seed: Some(1),
            ..SamplingParams::default()
        };
        let mut sampler = Sampler::new(params.clone(), &[]);
        for _ in 0..5 {
            let token = sampler.sample(&mut logits.clone());
            assert_token_is_allowed(&logits, &params, token);
        }
    }
}
