// SPDX-License-Identifier: MIT OR Apache-2.0
//! Tokenization against llama.cpp's golden vectors (made with `transformers`), for vocabularies
//! built from GGUF metadata and for Hugging Face `tokenizer.json` files.

mod common;

use metrale_model_weights::GgufFile;
use metrale_tokenizer::{DecodeStream, Tokenizer};

fn gguf_vocab(name: &str) -> Tokenizer {
    let gguf = GgufFile::open(&common::data_file(&format!(
        "llama.cpp/models/ggml-vocab-{name}.gguf"
    )))
    .unwrap();
    Tokenizer::from_gguf(&gguf).unwrap_or_else(|e| panic!("ggml-vocab-{name}: {e}"))
}

/// Encodes every vector and returns the failures, described.
fn mismatches(tokenizer: &Tokenizer, vectors: &[(String, Vec<u32>)]) -> Vec<String> {
    vectors
        .iter()
        .filter_map(|(text, want)| {
            let got = tokenizer.encode(text, false).unwrap();
            (got != *want).then(|| format!("{text:?}\n    want {want:?}\n    got  {got:?}"))
        })
        .collect()
}

fn assert_all_match(what: &str, tokenizer: &Tokenizer, vectors: &[(String, Vec<u32>)]) {
    let bad = mismatches(tokenizer, vectors);
    eprintln!(
        "{what}: {}/{} vectors match",
        vectors.len() - bad.len(),
        vectors.len()
    );
    assert!(
        bad.is_empty(),
        "{what}: {} of {} vectors differ:\n  {}",
        bad.len(),
        vectors.len(),
        bad.join("\n  ")
    );
}

/// The GGUF vocabularies with vectors whose pre-tokenizer this crate rebuilds, and the
/// SentencePiece ones (Llama 2 / Mistral / Mixtral's `llama-spm`, Phi-3's).
const SUPPORTED: [&str; 13] = [
    "llama-spm",
    "phi-3",
    "llama-bpe",
    "qwen2",
    "qwen35",
    "gpt-2",
    "mpt",
    "starcoder",
    "refact",
    "command-r",
    "falcon",
    "deepseek-llm",
    "deepseek-coder",
];

#[test]
fn gguf_vocabularies_match_llama_cpp_vectors() {
    for name in SUPPORTED {
        assert_all_match(
            &format!("ggml-vocab-{name}.gguf"),
            &gguf_vocab(name),
            &common::vocab_vectors(name),
        );
    }
}

#[test]
fn unsupported_vocabularies_are_refused_with_the_supported_list() {
    for name in ["bert-bge", "nomic-bert-moe"] {
        let gguf = GgufFile::open(&common::data_file(&format!(
            "llama.cpp/models/ggml-vocab-{name}.gguf"
        )))
        .unwrap();
        let err = Tokenizer::from_gguf(&gguf).unwrap_err().to_string();
        assert!(
            err.contains("not supported") && err.contains("checkpoint directory"),
            "ggml-vocab-{name}: {err}"
        );
    }
}

#[test]
fn qwen3_tokenizer_json_matches_qwen2_vectors() {
    let tokenizer = Tokenizer::from_hf_dir(&common::data_file("qwen3-tokenizer")).unwrap();
    assert_all_match(
        "qwen3 tokenizer.json vs ggml-vocab-qwen2",
        &tokenizer,
        &common::vocab_vectors("qwen2"),
    );
    // The vocabularies agree: every id of the Qwen2 GGUF below Qwen3's size spells the same token.
    let qwen2 = gguf_vocab("qwen2");
    let shared = (0..151_643)
        .filter(|&id| tokenizer.id_to_token(id) == qwen2.id_to_token(id))
        .count();
    assert_eq!(shared, 151_643, "Qwen2 and Qwen3 base vocabularies differ");
}

/// The Llama-3 `tokenizer.json` shipped in the test data predates `"ignore_merges": true` (which
/// Meta's current file and llama.cpp have), so BPE merges "Cửa Việt"'s second word instead of
/// taking the whole-word token. With that one flag set it matches every vector.
#[test]
fn llama3_tokenizer_json_matches_llama_bpe_vectors() {
    let vectors = common::vocab_vectors("llama-bpe");
    let dir = common::data_file("llama3-tokenizer");
    let tokenizer = Tokenizer::from_hf_dir(&dir).unwrap();
    let bad = mismatches(&tokenizer, &vectors);
    eprintln!(
        "llama3 tokenizer.json as shipped: {}/{} vectors match",
        vectors.len() - bad.len(),
        vectors.len()
    );
    assert!(
        bad.len() == 1 && bad[0].starts_with("\"Cửa Việt\""),
        "unexpected differences:\n  {}",
        bad.join("\n  ")
    );

    let mut json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("tokenizer.json")).unwrap()).unwrap();
    assert_eq!(json["model"]["ignore_merges"], false);
    json["model"]["ignore_merges"] = true.into();
    let fixed = tempfile::tempdir().unwrap();
    std::fs::write(
        fixed.path().join("tokenizer.json"),
        serde_json::to_vec(&json).unwrap(),
    )
    .unwrap();
    std::fs::copy(
        dir.join("tokenizer_config.json"),
        fixed.path().join("tokenizer_config.json"),
    )
    .unwrap();
    let tokenizer = Tokenizer::from_hf_dir(fixed.path()).unwrap();
    assert_all_match(
        "llama3 tokenizer.json with ignore_merges",
        &tokenizer,
        &vectors,
    );
    assert_eq!(tokenizer.bos_token_id(), Some(128_000));
    assert_eq!(tokenizer.encode("Hi", true).unwrap(), [128_000, 13347]);
}

#[test]
fn decode_inverts_encode() {
    let mut tokenizers: Vec<(String, Tokenizer)> = SUPPORTED
        .iter()
        .map(|n| (n.to_string(), gguf_vocab(n)))
        .collect();
    tokenizers.push((
        "qwen3 tokenizer.json".into(),
        Tokenizer::from_hf_dir(&common::data_file("qwen3-tokenizer")).unwrap(),
    ));
    tokenizers.push((
        "llama3 tokenizer.json".into(),
        Tokenizer::from_hf_dir(&common::data_file("llama3-tokenizer")).unwrap(),
    ));
    for (name, tokenizer) in &tokenizers {
        let vocab = if name.starts_with("qwen3") {
            "qwen2"
        } else if name.starts_with("llama3") {
            "llama-bpe"
        } else {
            name
        };
        for (text, _) in common::vocab_vectors(vocab) {
            let ids = tokenizer.encode(&text, false).unwrap();
            assert_eq!(
                tokenizer.decode(&ids, false).unwrap(),
                text,
                "{name}: round trip of {text:?}"
            );
        }
    }
}

#[test]
fn decode_stream_emits_whole_characters() {
    let texts = [
        "Hello, y'all! How are you 😁 ?我想在apple工作1314151天～",
        "🚀 (normal) 😶‍🌫️ (multiple emojis concatenated) ✅ (only emoji that has its own token)",
        "нещо на Български",
        "កាន់តែពិសេសអាចខលចេញ",
        "日本語のテキストと한국어 텍스트, 𝓤𝓷𝓲𝓬𝓸𝓭𝓮 and 🏳️‍🌈🇫🇷",
    ];
    for (name, tokenizer) in [
        ("qwen2", gguf_vocab("qwen2")),
        ("llama-bpe", gguf_vocab("llama-bpe")),
        ("gpt-2", gguf_vocab("gpt-2")),
    ] {
        for text in texts {
            let ids = tokenizer.encode(text, false).unwrap();
            let mut stream = DecodeStream::new(false);
            let mut streamed = String::new();
            for &id in &ids {
                if let Some(piece) = stream.step(&tokenizer, id).unwrap() {
                    assert!(
                        !piece.contains('\u{FFFD}'),
                        "{name}: piece {piece:?} of {text:?} has a replacement character"
                    );
                    streamed.push_str(&piece);
                }
            }
            assert_eq!(
                stream.finish(&tokenizer).unwrap(),
                None,
                "{name}: {text:?} left text behind"
            );
            assert_eq!(
                streamed,
                tokenizer.decode(&ids, false).unwrap(),
                "{name}: {text:?}"
            );
            assert_eq!(streamed, text);
        }
    }
}
