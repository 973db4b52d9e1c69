// SPDX-License-Identifier: MIT OR Apache-2.0
//! SmolLM2-135M-Instruct end to end on the host backend, against golden greedy transcripts from
//! `transformers` on the same GGUF (tests/fixtures/smollm2_golden.json; the command that produced
//! it is in the file).

mod common;

use common::{assert_clean_failure, met, met_with_env, smollm2};

/// `met generate` arguments: the host backend, greedy, `prompt` as one chat message, then `extra`.
fn greedy_chat(prompt: &str, max_tokens: &str, extra: &[&str]) -> Vec<String> {
    let model = smollm2();
    [
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
    ]
    .into_iter()
    .chain(extra.iter().copied())
    .map(str::to_owned)
    .collect()
}

fn run(args: &[String]) -> std::process::Output {
    met(&args.iter().map(String::as_str).collect::<Vec<_>>())
}

fn ids_after(stderr: &str, label: &str) -> Vec<u32> {
    let line = stderr
        .lines()
        .find_map(|l| l.strip_prefix(label))
        .unwrap_or_else(|| panic!("no `{label}` in: {stderr}"));
    serde_json::from_str(line.trim()).unwrap()
}

/// The greedy ids a successful `--print-ids` run printed.
fn output_ids(out: std::process::Output) -> Vec<u32> {
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{stderr}");
    ids_after(&stderr, "output ids:")
}

#[test]
fn capital_of_france() {
    let out = run(&greedy_chat("What is the capital of France?", "16", &[]));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "The capital of France is Paris.",
        "{stderr}"
    );
    assert!(
        stderr.contains("host backend"),
        "says which backend: {stderr}"
    );
    assert!(
        stderr.contains("TTFT") && stderr.contains("tok/s"),
        "{stderr}"
    );
}

/// The warm-up step writes garbage into the first KV blocks; a request after it reuses them and
/// must still give the same answer.
#[test]
fn warm_up_leaves_the_answer_unchanged() {
    let out = run(&greedy_chat(
        "What is the capital of France?",
        "16",
        &["--warm-up"],
    ));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("warm-up step in"), "{stderr}");
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "The capital of France is Paris.",
        "{stderr}"
    );
}

/// Decode steps replayed from captured graphs (the default; the host backend records
/// and replays them too) give the same tokens as steps launched one kernel at a time, across
/// enough steps for the attention split bucket to change.
#[test]
fn graph_replay_gives_the_same_tokens() {
    let args = greedy_chat(
        "Write a haiku about the sea.",
        "40",
        &["--ignore-eos", "--print-ids"],
    );
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let direct = output_ids(met_with_env(&args, "METRALE_CUDA_GRAPHS", "0"));
    let replayed = output_ids(met_with_env(&args, "METRALE_CUDA_GRAPHS", "1"));
    assert_eq!(direct.len(), 40);
    assert_eq!(replayed, direct);
}

/// `met generate` with `--tune` overrides (and an operator switch of the environment).
fn met_tuned(args: &[&str], tune: &[&str]) -> std::process::Output {
    let mut all: Vec<&str> = args.to_vec();
    for t in tune {
        all.extend(["--tune", t]);
    }
    met(&all)
}

/// Decode steps with the QKV post-processing folded into the decode attention, SiLU x up into
/// the gate|up GEMV and the residual add + RMSNorm into the GEMVs after it (the kernel tree's
/// defaults) give the same tokens as with any of these fusions turned off.
#[test]
fn fused_launches_give_the_same_tokens() {
    let args = greedy_chat("Name three rivers.", "24", &["--ignore-eos", "--print-ids"]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let fused = output_ids(met_tuned(&args, &[]));
    assert_eq!(fused.len(), 24);
    for off in [
        "fused_qkv_attention=false",
        "fused_swiglu=false",
        "gemv_norm=off",
    ] {
        assert_eq!(output_ids(met_tuned(&args, &[off])), fused, "{off}");
    }
}

/// Greedy decode with steps queued ahead of the host (ids read back a few steps late, the
/// argmax fed to the next step on the device) gives the same tokens as a round trip per step:
/// to a length limit, and to an end-of-sequence token (the steps queued past it discarded).
#[test]
fn decode_ahead_gives_the_same_tokens() {
    for extra in [&["--ignore-eos", "--print-ids"][..], &["--print-ids"][..]] {
        let args = greedy_chat("Name two colours.", "24", extra);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let want = output_ids(met_tuned(&args, &["decode_ahead=0"]));
        assert!(!want.is_empty());
        for ahead in ["decode_ahead=1", "decode_ahead=3", "decode_ahead=8"] {
            let got = output_ids(met_tuned(&args, &[ahead]));
            assert_eq!(got, want, "{ahead} {extra:?}");
        }
    }
}

/// A schedule override or an operator switch with a value the engine does not take stops the
/// run with a message that names it and what it takes (exit 1, no panic), instead of quietly
/// running the default, and before any weight is loaded.
#[test]
fn bad_engine_switches_fail_cleanly() {
    let args = greedy_chat("Hi.", "2", &[]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let no_weights = |out: &std::process::Output, what: &str| {
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!stderr.contains("loading weights"), "{what}: {stderr}");
    };
    for (tune, expected) in [
        ("gemv_grid_mode=fast", "same, balanced or resplit"),
        ("gemv_norm=yes", "off, small or all"),
        ("attention_unsplit_keys=-1", "a non-negative integer"),
        ("decode_ahead=two", "a non-negative integer"),
        ("embedding_vec=yes", "true or false"),
        ("gemv_stream=attention", "product labels"),
        ("carveout=qkv=150", "label=percent pairs"),
        ("grid_caps=attention=8", "label=blocks pairs"),
        (
            "gemv_strem=qkv",
            "unknown tuning key `gemv_strem`; the keys are graphs",
        ),
        ("fused_swiglu", "key=value"),
    ] {
        let out = met_tuned(&args, &[tune]);
        assert_clean_failure(&out, &[&format!("--tune {tune}"), expected]);
        no_weights(&out, tune);
    }
    let (key, value) = ("METRALE_CUDA_GRAPHS", "yes");
    let out = met_with_env(&args, key, value);
    assert_clean_failure(
        &out,
        &[&format!("{key}={value}"), "expected 0 (off) or 1 (on)"],
    );
    no_weights(&out, key);
}

/// The engine's greedy ids must equal the reference's, except that at a step where the reference
/// itself is tied at bf16 precision (its top-2 margin within one bf16 step of the top logit) either
/// token is correct, and the transcripts may part there. At least three prompts must match whole.
#[test]
fn greedy_ids_match_transformers() {
    let fixture: serde_json::Value =
        serde_json::from_str(include_str!("fixtures/smollm2_golden.json")).expect("fixture parses");
    let max_new = fixture["max_new_tokens"].as_u64().unwrap().to_string();
    let cases = fixture["cases"].as_array().unwrap();
    let mut whole = 0;
    for case in cases {
        let prompt = case["prompt"].as_str().unwrap();
        let out = run(&greedy_chat(prompt, &max_new, &["--print-ids"]));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{stderr}");
        let want_prompt: Vec<u32> = serde_json::from_value(case["prompt_ids"].clone()).unwrap();
        let want: Vec<u32> = serde_json::from_value(case["output_ids"].clone()).unwrap();
        let margins: Vec<f64> = serde_json::from_value(case["top2_margins"].clone()).unwrap();
        let ulps: Vec<f64> = serde_json::from_value(case["bf16_ulp_of_top"].clone()).unwrap();
        assert_eq!(
            ids_after(&stderr, "prompt ids:"),
            want_prompt,
            "prompt ids for {prompt:?}"
        );
        let got = ids_after(&stderr, "output ids:");
        match got.iter().zip(&want).position(|(a, b)| a != b) {
            None => {
                assert_eq!(
                    got.len(),
                    want.len(),
                    "output length for {prompt:?}: {got:?} vs {want:?}"
                );
                whole += 1;
            }
            Some(step) => assert!(
                margins[step] <= ulps[step],
                "{prompt:?}: step {step} gives {} where the reference gives {} with a clear margin {} (bf16 step {})",
                got[step],
                want[step],
                margins[step],
                ulps[step]
            ),
        }
    }
    assert!(whole >= 3, "only {whole} prompts matched whole");
}
