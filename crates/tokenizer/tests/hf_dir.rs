// SPDX-License-Identifier: MIT OR Apache-2.0
//! How `Tokenizer::from_hf_dir` reads the files around `tokenizer.json`.

mod common;

use std::path::Path;

use metrale_tokenizer::{RenderOptions, Tokenizer, TokenizerError};
use serde_json::json;

/// A model directory with Qwen3's `tokenizer.json` and the given extra files.
fn model_dir(files: &[(&str, String)]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(
        common::data_file("qwen3-tokenizer/tokenizer.json"),
        dir.path().join("tokenizer.json"),
    )
    .unwrap();
    for (name, text) in files {
        let path = dir.path().join(name);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, text).unwrap();
    }
    dir
}

fn render(tokenizer: &Tokenizer, name: &str) -> String {
    let template = tokenizer.chat_template_named(name).unwrap();
    template
        .render(
            &[json!({"role": "user", "content": "hi"})],
            &RenderOptions::default(),
        )
        .unwrap()
}

#[test]
fn special_tokens_as_added_token_objects_and_generation_eos_lists() {
    let config = json!({
        "bos_token": {"__type": "AddedToken", "content": "<|endoftext|>", "special": true},
        "eos_token": "<|im_end|>",
        "pad_token": null,
        "chat_template": [
            {"name": "default", "template": "{{ bos_token }}|{{ eos_token }}|{{ messages[0].content }}"},
            {"name": "tool_use", "template": "tools:{{ tools is none }}"}
        ]
    });
    let generation = json!({"eos_token_id": [151645, 151643], "pad_token_id": 151643});
    let dir = model_dir(&[
        ("tokenizer_config.json", config.to_string()),
        ("generation_config.json", generation.to_string()),
    ]);
    let t = Tokenizer::from_hf_dir(dir.path()).unwrap();
    assert_eq!(t.bos_token_id(), Some(151_643));
    assert_eq!(t.eos_token_ids(), [151_645, 151_643]);
    assert_eq!(t.pad_token_id(), Some(151_643));
    assert_eq!(
        t.chat_template_names().collect::<Vec<_>>(),
        ["default", "tool_use"]
    );
    assert_eq!(render(&t, "default"), "<|endoftext|>|<|im_end|>|hi");
    assert_eq!(render(&t, "tool_use"), "tools:True");
    assert_eq!(
        t.chat_template().unwrap().source(),
        config["chat_template"][0]["template"]
    );
}

#[test]
fn chat_template_jinja_takes_precedence() {
    let dir = model_dir(&[
        (
            "tokenizer_config.json",
            json!({"chat_template": "from config"}).to_string(),
        ),
        (
            "chat_template.jinja",
            "from jinja {{ messages | length }}".into(),
        ),
        ("additional_chat_templates/rag.jinja", "rag".into()),
    ]);
    let t = Tokenizer::from_hf_dir(dir.path()).unwrap();
    assert_eq!(render(&t, "default"), "from jinja 1");
    assert_eq!(render(&t, "rag"), "rag");
    assert_eq!(t.bos_token_id(), None);
    assert!(t.eos_token_ids().is_empty());
}

#[test]
fn errors_name_the_file_and_the_problem() {
    let err = Tokenizer::from_hf_dir(Path::new("/nonexistent-model-dir")).unwrap_err();
    assert!(
        matches!(err, TokenizerError::Io { .. })
            && err.to_string().contains("needs tokenizer.json"),
        "{err}"
    );

    let dir = model_dir(&[(
        "tokenizer_config.json",
        json!({"eos_token": "<|not-a-token|>"}).to_string(),
    )]);
    let err = Tokenizer::from_hf_dir(dir.path()).unwrap_err().to_string();
    assert!(
        err.contains("tokenizer_config.json") && err.contains("<|not-a-token|>"),
        "{err}"
    );

    let dir = model_dir(&[(
        "generation_config.json",
        json!({"eos_token_id": [1, 999999999]}).to_string(),
    )]);
    let err = Tokenizer::from_hf_dir(dir.path()).unwrap_err().to_string();
    assert!(
        err.contains("generation_config.json") && err.contains("999999999"),
        "{err}"
    );

    let dir = model_dir(&[("chat_template.jinja", "{% for %}".into())]);
    let err = Tokenizer::from_hf_dir(dir.path()).unwrap_err().to_string();
    assert!(
        err.contains("chat_template.jinja") && err.contains("does not compile"),
        "{err}"
    );
}
