// SPDX-License-Identifier: MIT OR Apache-2.0
//! `met bench-model` runs on the host backend and prints one row per prefill length and batch.

mod common;

use common::{assert_clean_failure, met, smollm2};

#[test]
fn prints_a_row_per_configuration() {
    let gguf = smollm2();
    let out = met(&[
        "bench-model",
        "--model-from-path",
        gguf.to_str().unwrap(),
        "--backend",
        "host",
        "--prefill",
        "8",
        "--batches",
        "1,2",
        "--context",
        "20",
        "--repeats",
        "1",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows: Vec<&str> = stdout
        .lines()
        .filter(|l| l.starts_with("| ") && !l.starts_with("| row"))
        .collect();
    assert_eq!(rows.len(), 3, "{stdout}");
    assert!(
        rows[0].starts_with("| prefill (time to first logits) | 1 | 8 |"),
        "{stdout}"
    );
    assert!(rows[2].starts_with("| decode step | 2 | 20 |"), "{stdout}");
}

#[test]
fn refuses_a_context_beyond_the_model() {
    let gguf = smollm2();
    let out = met(&[
        "bench-model",
        "--model-from-path",
        gguf.to_str().unwrap(),
        "--backend",
        "host",
        "--context",
        "100000000",
    ]);
    assert_clean_failure(&out, &["--context/--prefill need", "positions"]);
}
