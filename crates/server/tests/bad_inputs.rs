// SPDX-License-Identifier: MIT OR Apache-2.0
//! Bad inputs to `met generate`: each one clear error, exit code 1, no panic.

mod common;

use common::{assert_clean_failure, met, smollm2};

fn generate(path: &str, extra: &[&str]) -> std::process::Output {
    let mut args = vec![
        "generate",
        "--backend",
        "host",
        "--model-from-path",
        path,
        "--prompt",
        "hello",
        "--max-tokens",
        "2",
    ];
    args.extend_from_slice(extra);
    met(&args)
}

#[test]
fn missing_path() {
    let out = generate("/nonexistent/model-dir", &[]);
    assert_clean_failure(&out, &["/nonexistent/model-dir", "does not exist"]);
}

#[test]
fn unknown_model_type() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("config.json"),
        r#"{"model_type": "gemma3", "hidden_size": 64}"#,
    )
    .unwrap();
    let out = generate(dir.path().to_str().unwrap(), &[]);
    assert_clean_failure(&out, &["gemma3", "llama, qwen2, qwen3", "config.json"]);
}

/// A tiny valid Llama config for the safetensors cases.
const TINY_CONFIG: &str = r#"{"model_type": "llama", "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
  "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 4, "max_position_embeddings": 64, "rms_norm_eps": 1e-5}"#;

#[test]
fn truncated_safetensors() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("config.json"), TINY_CONFIG).unwrap();
    // A header promising 64 bytes of data, followed by only 10.
    let header =
        br#"{"model.embed_tokens.weight":{"dtype":"BF16","shape":[4,8],"data_offsets":[0,64]}}"#;
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header);
    bytes.extend_from_slice(&[0u8; 10]);
    std::fs::write(dir.path().join("model.safetensors"), bytes).unwrap();
    let out = generate(dir.path().to_str().unwrap(), &[]);
    assert_clean_failure(&out, &["model.safetensors", "truncated"]);
}

/// A GGUF v3 file with a valid Llama header and one Q2_K tensor (a type the engine does not read).
fn gguf_with_q2k() -> Vec<u8> {
    let mut meta = Vec::new();
    let mut count = 0u64;
    let mut kv = |k: &str, ty: u32, v: &[u8]| {
        meta.extend((k.len() as u64).to_le_bytes());
        meta.extend(k.as_bytes());
        meta.extend(ty.to_le_bytes());
        meta.extend(v);
        count += 1;
    };
    let s = |v: &str| {
        [
            (v.len() as u64).to_le_bytes().to_vec(),
            v.as_bytes().to_vec(),
        ]
        .concat()
    };
    kv("general.architecture", 8, &s("llama"));
    for (k, v) in [
        ("llama.embedding_length", 256u32),
        ("llama.feed_forward_length", 512),
        ("llama.block_count", 1),
        ("llama.attention.head_count", 2),
        ("llama.vocab_size", 4),
    ] {
        kv(k, 4, &v.to_le_bytes());
    }
    let mut table = Vec::new();
    let name = "token_embd.weight";
    table.extend((name.len() as u64).to_le_bytes());
    table.extend(name.as_bytes());
    table.extend(2u32.to_le_bytes());
    table.extend(256u64.to_le_bytes());
    table.extend(4u64.to_le_bytes());
    table.extend(10u32.to_le_bytes()); // Q2_K
    table.extend(0u64.to_le_bytes());
    let mut out = b"GGUF".to_vec();
    out.extend(3u32.to_le_bytes());
    out.extend(1u64.to_le_bytes());
    out.extend(count.to_le_bytes());
    out.extend(meta);
    out.extend(table);
    out.resize(out.len().next_multiple_of(32), 0);
    out.extend(vec![0u8; 4 * 84]);
    out
}

#[test]
fn gguf_with_unsupported_tensor_type() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("q2k.gguf");
    std::fs::write(&path, gguf_with_q2k()).unwrap();
    let out = generate(path.to_str().unwrap(), &[]);
    assert_clean_failure(&out, &["token_embd.weight", "Q2_K", "not supported"]);
}

#[test]
fn prompt_longer_than_the_context() {
    let model = smollm2();
    let long = "word ".repeat(50);
    let out = met(&[
        "generate",
        "--backend",
        "host",
        "--model-from-path",
        model.to_str().unwrap(),
        "--prompt",
        &long,
        "--max-seq-len",
        "16",
    ]);
    assert_clean_failure(&out, &["prompt has", "tokens but the context is 16 tokens"]);
}

#[test]
fn bad_sampling_values() {
    let model = smollm2();
    let out = met(&[
        "generate",
        "--backend",
        "host",
        "--model-from-path",
        model.to_str().unwrap(),
        "--prompt",
        "hi",
        "--temperature=-1",
    ]);
    assert_clean_failure(&out, &["temperature"]);
}
