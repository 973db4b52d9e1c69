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
    assert_eq!(rows.len(), 5, "{stdout}");
    assert!(
        rows[0].starts_with("| prefill (time to first logits) | 1 | 8 |"),
        "{stdout}"
    );
    assert!(rows[1].starts_with("| decode step | 1 | 20 |"), "{stdout}");
    assert!(rows[3].starts_with("| decode step | 2 | 20 |"), "{stdout}");
    // Each decode row is followed by the same step's device time, a positive number of ms.
    for (row, batch) in [(rows[2], 1), (rows[4], 2)] {
        let prefix = format!("| decode step, device time only | {batch} | 20 |");
        assert!(row.starts_with(&prefix), "{stdout}");
        let ms: f64 = row.split('|').nth(4).unwrap().trim().parse().unwrap();
        assert!(ms.is_finite() && ms > 0.0, "{row}");
    }
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
