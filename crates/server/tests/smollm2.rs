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

/// Decode steps with the QKV post-processing folded into the decode attention, SiLU x up into
/// the gate|up GEMV and the residual add + RMSNorm into the GEMVs after it (the defaults) give
/// the same tokens as with any of these fusions turned off.
#[test]
fn fused_launches_give_the_same_tokens() {
    let args = greedy_chat("Name three rivers.", "24", &["--ignore-eos", "--print-ids"]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let separate = output_ids(met_with_env(&args, "METRALE_FUSED_QKV_ATTENTION", "0"));
    let fused = output_ids(met_with_env(&args, "METRALE_FUSED_QKV_ATTENTION", "1"));
    let separate_swiglu = output_ids(met_with_env(&args, "METRALE_FUSED_SWIGLU", "0"));
    let separate_norm = output_ids(met_with_env(&args, "METRALE_GEMV_NORM", "0"));
    assert_eq!(separate.len(), 24);
    assert_eq!(fused, separate);
    assert_eq!(separate_swiglu, separate);
    assert_eq!(separate_norm, separate);
}

/// Greedy decode with steps queued ahead of the host (ids read back a few steps late, the
/// argmax fed to the next step on the device) gives the same tokens as a round trip per step:
/// to a length limit, and to an end-of-sequence token (the steps queued past it discarded).
#[test]
fn decode_ahead_gives_the_same_tokens() {
    for extra in [&["--ignore-eos", "--print-ids"][..], &["--print-ids"][..]] {
        let args = greedy_chat("Name two colours.", "24", extra);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let stepped = met_with_env(&args, "METRALE_DECODE_AHEAD", "0");
        let want = output_ids(stepped);
        assert!(!want.is_empty());
        for ahead in ["1", "3", "8"] {
            let got = output_ids(met_with_env(&args, "METRALE_DECODE_AHEAD", ahead));
            assert_eq!(got, want, "METRALE_DECODE_AHEAD={ahead} {extra:?}");
        }
    }
}

/// An engine switch with a value it does not take stops the run with a message that names the
/// variable and what it takes (exit 1, no panic), instead of quietly running the default, and
/// before any weight is loaded.
#[test]
fn bad_engine_switches_fail_cleanly() {
    let args = greedy_chat("Hi.", "2", &[]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    for (key, value, expected) in [
        (
            "METRALE_GEMV_GRID_MODE",
            "fast",
            "same, balanced or resplit",
        ),
        ("METRALE_GEMV_NORM", "yes", "0, off, small or all"),
        (
            "METRALE_ATTENTION_UNSPLIT_KEYS",
            "-1",
            "a non-negative integer",
        ),
        ("METRALE_GEMV_GRID_CAP", "lots", "a non-negative integer"),
        ("METRALE_DECODE_AHEAD", "two", "a non-negative integer"),
        (
            "METRALE_ATTENTION_WIDE_BLOCKS",
            "all",
            "a non-negative integer",
        ),
        ("METRALE_EMBEDDING_VEC", "yes", "0 or 1"),
        ("METRALE_GEMV_STREAM_EVICT", "2", "0 or 1"),
        ("METRALE_GEMV_STREAM_NORM", "yes", "0 or 1"),
        (
            "METRALE_GEMV_STREAM_PREWAIT",
            "-1",
            "a non-negative integer",
        ),
        (
            "METRALE_GEMV_STREAM_LABELS",
            "attention",
            "labels separated by `,` or `+` (qkv, o, gate_up, down, lm_head)",
        ),
        (
            "METRALE_CARVEOUT_LABELS",
            "qkv=150",
            "label=percent pairs separated by `,` or `+`",
        ),
        ("METRALE_CARVEOUT_LABELS", "mlp=50", "labels: embedding"),
        (
            "METRALE_GRID_CAP_LABELS",
            "attention=8",
            "labels: qkv, o, gate_up",
        ),
    ] {
        let out = met_with_env(&args, key, value);
        assert_clean_failure(&out, &[&format!("{key}={value}"), expected]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!stderr.contains("loading weights"), "{key}: {stderr}");
    }
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
