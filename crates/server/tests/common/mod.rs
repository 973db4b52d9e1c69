// SPDX-License-Identifier: MIT OR Apache-2.0
//! Helpers shared by the `met` process tests.

#![allow(dead_code)]

use std::path::PathBuf;
use std::process::{Command, Output};

/// Runs `met` with `args` and returns its output.
pub fn met(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_met"))
        .args(args)
        .output()
        .expect("met runs")
}

/// Runs `met` with `args` and one extra environment variable.
pub fn met_with_env(args: &[&str], key: &str, value: &str) -> Output {
    Command::new(env!("CARGO_BIN_EXE_met"))
        .args(args)
        .env(key, value)
        .output()
        .expect("met runs")
}

/// The test-data directory of scripts/fetch-test-data.sh.
pub fn test_data() -> PathBuf {
    let dir = std::env::var_os("METRALE_TEST_DATA")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../.cache/test-data")
        });
    assert!(
        dir.join("smollm2").is_dir(),
        "test data missing at {}: run scripts/fetch-test-data.sh",
        dir.display()
    );
    dir
}

/// The SmolLM2-135M-Instruct GGUF.
pub fn smollm2() -> PathBuf {
    test_data().join("smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
}

/// Asserts a failed run: non-zero exit, no panic, and stderr containing every needle.
pub fn assert_clean_failure(out: &Output, needles: &[&str]) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "expected failure, got success; stderr: {stderr}"
    );
    assert!(!stderr.contains("panicked"), "panicked: {stderr}");
    assert_eq!(out.status.code(), Some(1), "exit code; stderr: {stderr}");
    for n in needles {
        assert!(stderr.contains(n), "stderr lacks {n:?}: {stderr}");
    }
}
