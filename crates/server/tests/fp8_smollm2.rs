// SPDX-License-Identifier: MIT OR Apache-2.0
//! `--quantization fp8` on SmolLM2-135M-Instruct's real weights (the Q4_1 GGUF, BF16 at load,
//! then E4M3 with a scale per 128x128 block), on the host backend, against the same model in
//! BF16: the perplexity over the committed text set (tests/fixtures/perplexity, chosen as
//! docs/precision.md says) and the golden prompt's greedy answer.
//!
//! Issue 32 asks for a perplexity rise of at most 1% and unchanged golden answers. Measured
//! (docs/precision.md, "FP8 weights"), 128x128 blocks give +1.60% over the whole set and the
//! capital-of-France answer changes (its first step is a tie in BF16 already: margin 0.125,
//! one bf16 step); so the issue's bound is an ignored test that fails for that reason, and the
//! test that runs guards what FP8 does today (a rise under 3%: a lost or misplaced scale gives
//! far more, see crates/model-engine/tests/fp8.rs).

mod common;

use common::{met, smollm2};

const TEXT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/perplexity");

/// `met perplexity` over `files` of the text set: the total perplexity it prints.
fn perplexity(files: &[&str], fp8: bool) -> f64 {
    let model = smollm2();
    let mut args = vec![
        "perplexity".to_string(),
        "--backend".into(),
        "host".into(),
        "--model-from-path".into(),
        model.display().to_string(),
    ];
    for f in files {
        args.extend(["--text".into(), format!("{TEXT}/{f}")]);
    }
    if fp8 {
        args.extend(["--quantization".into(), "fp8".into()]);
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

/// The greedy chat answer to `prompt`, 24 tokens at most.
fn answer(prompt: &str, fp8: bool) -> String {
    let model = smollm2();
    let mut args = vec![
        "generate",
        "--backend",
        "host",
        "--model-from-path",
        model.to_str().unwrap(),
        "--chat",
        "--prompt",
        prompt,
        "--max-tokens",
        "24",
        "--temperature",
        "0",
    ];
    if fp8 {
        args.extend(["--quantization", "fp8"]);
    }
    let out = met(&args);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// The rise of FP8's perplexity over BF16's on `files`, as a fraction.
fn rise(files: &[&str]) -> f64 {
    let bf16 = perplexity(files, false);
    let fp8 = perplexity(files, true);
    let rise = fp8 / bf16 - 1.0;
    eprintln!(
        "perplexity on {files:?}: BF16 {bf16:.4}, FP8 {fp8:.4}, rise {:.2}%",
        rise * 100.0
    );
    rise
}

/// What FP8 does today, on one text of the set (414 tokens; 01-science measured +1.17%, the
/// whole set +1.60%): within 3%, and not equal to BF16 (the FP8 weights are in use).
#[test]
fn fp8_perplexity_stays_near_bf16() {
    let rise = rise(&["01-science.txt"]);
    assert!(rise.abs() > 1e-4, "FP8 changed nothing: {rise}");
    assert!(rise < 0.03, "FP8 raises perplexity by {:.2}%", rise * 100.0);
}

/// Issue 32's accuracy bar on the host: over the whole text set the perplexity rises by at most
/// 1%, and the golden prompt's answer is BF16's. Fails today (+1.60%, and a different answer):
/// E4M3's 3-bit mantissa moves each weight by 2.6% RMS whatever the scale layout, and
/// SmolLM2's attention products take most of it (docs/precision.md). Several minutes on the host.
#[test]
#[ignore = "FP8 misses issue 32's bound on SmolLM2 (+1.60% perplexity, the France answer changes): docs/precision.md"]
fn fp8_meets_issue_32s_accuracy_bar() {
    let prompt = "What is the capital of France?";
    assert_eq!(answer(prompt, true), answer(prompt, false), "{prompt}");
    let files = [
        "01-science.txt",
        "02-history.txt",
        "03-story.txt",
        "04-howto.txt",
        "05-dialogue.txt",
        "06-technical.txt",
    ];
    let rise = rise(&files);
    assert!(
        rise <= 0.01,
        "FP8 raises perplexity by {:.2}%",
        rise * 100.0
    );
}
