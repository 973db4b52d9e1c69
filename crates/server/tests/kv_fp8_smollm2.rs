// SPDX-License-Identifier: MIT OR Apache-2.0
//! `--kv-cache-dtype fp8` on SmolLM2-135M-Instruct's real weights (the Q4_1 GGUF, BF16 at load),
//! on the host backend: the golden prompts' greedy answers (tests/fixtures/smollm2_golden.json,
//! from `transformers`) and the perplexity over the committed text set against the bf16 cache
//! (docs/precision.md, "FP8 KV cache", has the whole set's figure and its command). Bad values
//! of the flag are refused before anything loads.

mod common;

use common::{met, smollm2};

const TEXT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/perplexity");

fn greedy(prompt: &str, max_tokens: &str, kv: &str) -> std::process::Output {
    let model = smollm2();
    met(&[
        "generate",
        "--backend",
        "host",
        "--model-from-path",
        model.to_str().unwrap(),
        "--chat",
        "--prompt",
        prompt,
        "--max-tokens",
        max_tokens,
        "--temperature",
        "0",
        "--kv-cache-dtype",
        kv,
        "--print-ids",
    ])
}

fn ids_after(stderr: &str, label: &str) -> Vec<u32> {
    let line = stderr
        .lines()
        .find_map(|l| l.strip_prefix(label))
        .unwrap_or_else(|| panic!("no `{label}` in: {stderr}"));
    serde_json::from_str(line.trim()).unwrap()
}

/// How far apart, in bf16 steps of the reference's top logit, its top two logits may be where
/// the FP8 cache may pick the other one: the e4m3 rounding of every cached key and value moves
/// the logits by a few percent of their spread (3% relative L2 on the tiny model of
/// crates/model-engine/tests/kv_fp8.rs), far more than bf16's own rounding, which the bf16
/// golden test allows one step for. Measured: the haiku prompt parts at a margin of 2 steps (its
/// step 1) and the colours prompt at 1 (its step 9).
const FP8_KV_TIE_STEPS: f64 = 4.0;

/// With the FP8 cache the capital-of-France answer is the reference's, and every golden prompt's
/// greedy ids are the reference's up to a step where the reference's top two logits lie within
/// [`FP8_KV_TIE_STEPS`] bf16 steps (a near tie the cache may break the other way); at least two
/// prompts match whole. The log says the cache is FP8 with scales 1.0.
#[test]
fn golden_prompts_with_an_fp8_kv_cache() {
    let out = greedy("What is the capital of France?", "16", "fp8");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "The capital of France is Paris.",
        "{stderr}"
    );
    assert!(
        stderr.contains("KV cache fp8_e4m3 with scales 1.0"),
        "{stderr}"
    );
    let fixture: serde_json::Value =
        serde_json::from_str(include_str!("fixtures/smollm2_golden.json")).expect("fixture parses");
    let max_new = fixture["max_new_tokens"].as_u64().unwrap().to_string();
    let mut whole = 0;
    for case in fixture["cases"].as_array().unwrap() {
        let prompt = case["prompt"].as_str().unwrap();
        let out = greedy(prompt, &max_new, "fp8");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{stderr}");
        let want: Vec<u32> = serde_json::from_value(case["output_ids"].clone()).unwrap();
        let margins: Vec<f64> = serde_json::from_value(case["top2_margins"].clone()).unwrap();
        let ulps: Vec<f64> = serde_json::from_value(case["bf16_ulp_of_top"].clone()).unwrap();
        let got = ids_after(&stderr, "output ids:");
        match got.iter().zip(&want).position(|(a, b)| a != b) {
            None => {
                assert_eq!(got.len(), want.len(), "{prompt:?}: {got:?} vs {want:?}");
                whole += 1;
            }
            Some(step) => assert!(
                margins[step] <= FP8_KV_TIE_STEPS * ulps[step],
                "{prompt:?}: step {step} gives {} where the reference gives {} with a margin {} \
                 ({} bf16 steps)",
                got[step],
                want[step],
                margins[step],
                margins[step] / ulps[step]
            ),
        }
    }
    assert!(whole >= 2, "only {whole} prompts matched whole");
}

/// `met perplexity` over `files` of the text set with the KV cache `kv`: the total it prints.
fn perplexity(files: &[&str], kv: &str) -> f64 {
    let model = smollm2();
    let mut args = vec![
        "perplexity".to_string(),
        "--backend".into(),
        "host".into(),
        "--model-from-path".into(),
        model.display().to_string(),
        "--kv-cache-dtype".into(),
        kv.into(),
    ];
    for f in files {
        args.extend(["--text".into(), format!("{TEXT}/{f}")]);
    }
    let out = met(&args.iter().map(String::as_str).collect::<Vec<_>>());
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let total = stdout
        .lines()
        .find(|l| l.starts_with("total:"))
        .unwrap_or_else(|| panic!("no total in {stdout}"));
    total
        .rsplit("perplexity ")
        .next()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no perplexity in {total}"))
}

/// Issue 32's bar for the FP8 cache, on one text of the set (the whole set's figure, measured in
/// release, is in docs/precision.md): the perplexity rises by at most 1% over the bf16 cache's,
/// and not by nothing (the e4m3 cache is in use).
#[test]
fn fp8_kv_perplexity_within_one_percent() {
    let files = ["01-science.txt"];
    let bf16 = perplexity(&files, "bf16");
    let fp8 = perplexity(&files, "fp8");
    let rise = fp8 / bf16 - 1.0;
    eprintln!(
        "perplexity: bf16 KV {bf16:.4}, fp8 KV {fp8:.4}, rise {:.2}%",
        rise * 100.0
    );
    assert!(rise.abs() > 1e-5, "the FP8 cache changed nothing: {rise}");
    assert!(
        rise <= 0.01,
        "the FP8 cache raises perplexity by {:.2}%",
        rise * 100.0
    );
}

/// Element types without kernels, and junk, are refused by the argument parser with the values
/// it takes; nothing loads.
#[test]
fn bad_kv_cache_dtypes_are_refused() {
    let model = smollm2();
    for bad in ["fp16", "fp8_e5m2", "int8", "junk"] {
        let out = met(&[
            "generate",
            "--backend",
            "host",
            "--model-from-path",
            model.to_str().unwrap(),
            "--prompt",
            "hi",
            "--kv-cache-dtype",
            bad,
        ]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{bad}: {stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
        assert!(
            stderr.contains("use auto (bf16 today), bf16 or fp8"),
            "{bad}: {stderr}"
        );
        assert!(!stderr.contains("loading weights"), "{bad}: {stderr}");
    }
}
