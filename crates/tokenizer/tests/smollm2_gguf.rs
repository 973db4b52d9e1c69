// SPDX-License-Identifier: MIT OR Apache-2.0
//! The tokenizer of a real model GGUF (SmolLM2-135M-Instruct): ids, control tokens, template.

mod common;

use metrale_model_weights::GgufFile;
use metrale_tokenizer::{DecodeStream, RenderOptions, Tokenizer};
use serde_json::json;

fn smollm2() -> Tokenizer {
    let gguf = GgufFile::open(&common::data_file(
        "smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    ))
    .unwrap();
    Tokenizer::from_gguf(&gguf).unwrap()
}

#[test]
fn special_ids_come_from_the_metadata() {
    let t = smollm2();
    assert_eq!(t.vocab_size(), 49_152);
    assert_eq!(t.bos_token_id(), Some(1));
    assert_eq!(t.eos_token_ids(), [2]);
    assert_eq!(t.pad_token_id(), Some(2));
    assert_eq!(t.token_to_id("<|im_start|>"), Some(1));
    assert_eq!(t.id_to_token(2).as_deref(), Some("<|im_end|>"));
    // add_bos_token is false in this file: nothing is added.
    assert_eq!(
        t.encode("Hi", true).unwrap(),
        t.encode("Hi", false).unwrap()
    );
}

#[test]
fn rendered_prompt_tokenizes_control_tokens_whole() {
    let t = smollm2();
    let messages = [json!({"role": "user", "content": "What is the capital of France?"})];
    let options = RenderOptions {
        add_generation_prompt: true,
        ..RenderOptions::default()
    };
    let prompt = t
        .chat_template()
        .unwrap()
        .render(&messages, &options)
        .unwrap();
    assert!(
        prompt.ends_with("<|im_end|>\n<|im_start|>assistant\n"),
        "{prompt:?}"
    );
    let ids = t.encode(&prompt, false).unwrap();
    assert_eq!(
        ids.iter().filter(|&&id| id == 1).count(),
        3,
        "three <|im_start|>"
    );
    assert_eq!(
        ids.iter().filter(|&&id| id == 2).count(),
        2,
        "two <|im_end|>"
    );
    assert_eq!(t.decode(&ids, false).unwrap(), prompt);
    let visible = t.decode(&ids, true).unwrap();
    assert!(
        !visible.contains("<|im_") && visible.contains("What is the capital of France?"),
        "{visible:?}"
    );

    // A streamed answer that ends with EOS: the special token adds no text when skipped.
    let answer = t
        .encode("The capital of France is Paris. 🇫🇷", false)
        .unwrap();
    let mut stream = DecodeStream::new(true);
    let mut text = String::new();
    for &id in answer.iter().chain(&[2]) {
        text.push_str(&stream.step(&t, id).unwrap().unwrap_or_default());
    }
    assert_eq!(stream.finish(&t).unwrap(), None);
    assert_eq!(text, "The capital of France is Paris. 🇫🇷");
}

#[test]
fn out_of_vocabulary_ids_are_an_error() {
    let t = smollm2();
    let err = t.decode(&[5, 49_152], false).unwrap_err().to_string();
    assert!(
        err.contains("49152") && err.contains("outside the vocabulary"),
        "{err}"
    );
}
