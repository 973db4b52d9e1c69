// SPDX-License-Identifier: MIT OR Apache-2.0
//! Where the tests find the real tokenizer files and llama.cpp's vectors.

#![allow(dead_code)]

use std::path::{Path, PathBuf};

/// The test-data directory: `$METRALE_TEST_DATA`, else `.cache/test-data` at the workspace root.
/// Panics, saying how to fetch it, when it is missing: these tests must not pass vacuously.
pub fn data_dir() -> PathBuf {
    let dir = std::env::var_os("METRALE_TEST_DATA")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.cache/test-data"));
    assert!(
        dir.join("llama.cpp/models").is_dir(),
        "test data not found at {}: run scripts/fetch-test-data.sh (or set METRALE_TEST_DATA to where it put the data)",
        dir.display()
    );
    dir
}

/// A file under the test-data directory, which must exist.
pub fn data_file(relative: &str) -> PathBuf {
    let path = data_dir().join(relative);
    assert!(
        path.exists(),
        "{} is missing: run scripts/fetch-test-data.sh",
        path.display()
    );
    path
}

/// llama.cpp's golden vectors for `ggml-vocab-<name>.gguf`: each test string (the `.inp` file
/// separates them with a `__ggml_vocab_test__` line) and its ids (one line of the `.out` file per
/// string, ids separated by spaces), produced by `transformers` without special tokens.
pub fn vocab_vectors(name: &str) -> Vec<(String, Vec<u32>)> {
    let inp = std::fs::read_to_string(data_file(&format!(
        "llama.cpp/models/ggml-vocab-{name}.gguf.inp"
    )))
    .unwrap();
    let out = std::fs::read_to_string(data_file(&format!(
        "llama.cpp/models/ggml-vocab-{name}.gguf.out"
    )))
    .unwrap();
    let mut texts: Vec<&str> = inp.split("\n__ggml_vocab_test__\n").collect();
    // Every string is followed by the marker, so the last piece is the empty rest of the file.
    assert_eq!(
        texts.pop(),
        Some(""),
        "ggml-vocab-{name}.gguf.inp does not end with the marker line"
    );
    let ids: Vec<Vec<u32>> = out
        .lines()
        .map(|line| {
            line.split_whitespace()
                .map(|id| id.parse().unwrap())
                .collect()
        })
        .collect();
    assert_eq!(
        texts.len(),
        ids.len(),
        "ggml-vocab-{name}: .inp and .out disagree on the number of strings"
    );
    texts.into_iter().map(str::to_string).zip(ids).collect()
}
