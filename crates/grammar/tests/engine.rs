// SPDX-License-Identifier: MIT OR Apache-2.0
//! The engine's contract: one compile per spec, errors that say what is wrong (never a panic),
//! buffers checked, grammars tied to the engine that compiled them.

mod common;

use std::sync::Arc;

use common::{qwen3, smollm2};
use metrale_grammar::{GrammarError, GrammarSpec};
use serde_json::json;

fn invalid(spec: GrammarSpec) -> String {
    match qwen3().engine.compile(&spec) {
        Err(e @ GrammarError::Invalid { .. }) => e.to_string(),
        other => panic!("{spec:?}: expected an invalid-grammar error, got {other:?}"),
    }
}

#[test]
fn the_same_spec_compiles_once() {
    let engine = &qwen3().engine;
    let spec = |strict| GrammarSpec::JsonSchema {
        schema: json!({"type": "object", "properties": {"a": {"type": "integer"}}}),
        strict,
    };
    let a = engine.compile(&spec(true)).unwrap();
    let b = engine.compile(&spec(true)).unwrap();
    assert!(Arc::ptr_eq(&a, &b));
    let c = engine.compile(&spec(false)).unwrap();
    assert!(!Arc::ptr_eq(&a, &c));
}

#[test]
fn the_cache_is_bounded() {
    let engine = &smollm2().engine;
    let first = engine.compile(&GrammarSpec::Regex("x0".into())).unwrap();
    for i in 1..=256 {
        engine
            .compile(&GrammarSpec::Regex(format!("x{i}")))
            .unwrap();
    }
    // 257 distinct specs through a 256-entry cache: the least recently used went first.
    let again = engine.compile(&GrammarSpec::Regex("x0".into())).unwrap();
    assert!(!Arc::ptr_eq(&first, &again));
}

#[test]
fn compiles_share_across_threads() {
    let engine = &qwen3().engine;
    let spec = GrammarSpec::Regex("[a-z]{3}-[0-9]{3}".into());
    let grammars: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..4)
            .map(|_| s.spawn(|| engine.compile(&spec).unwrap()))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(grammars.windows(2).all(|w| Arc::ptr_eq(&w[0], &w[1])));
}

#[test]
fn invalid_schemas_say_why() {
    let msg = invalid(GrammarSpec::JsonSchema {
        schema: json!({"type": "strin"}),
        strict: true,
    });
    assert!(
        msg.contains("JSON schema") && msg.contains("strin"),
        "{msg}"
    );
    let msg = invalid(GrammarSpec::JsonSchema {
        schema: json!({"$ref": "#/$defs/missing"}),
        strict: false,
    });
    assert!(msg.contains("/$defs/missing"), "{msg}");
    let msg = invalid(GrammarSpec::JsonSchema {
        schema: json!({"type": "integer", "minimum": 5, "maximum": 1}),
        strict: true,
    });
    assert!(msg.contains("minimum"), "{msg}");
    let msg = invalid(GrammarSpec::JsonSchema {
        schema: json!(5),
        strict: true,
    });
    assert!(msg.contains("object or boolean"), "{msg}");
}

#[test]
fn strict_refuses_what_lenient_ignores() {
    let schema = json!({"type": "string", "format": "no-such-format"});
    let msg = invalid(GrammarSpec::JsonSchema {
        schema: schema.clone(),
        strict: true,
    });
    assert!(msg.contains("no-such-format"), "{msg}");
    qwen3()
        .engine
        .compile(&GrammarSpec::JsonSchema {
            schema,
            strict: false,
        })
        .unwrap();
}

#[test]
fn invalid_regexes_and_lark_say_why() {
    let msg = invalid(GrammarSpec::Regex("(unclosed".into()));
    assert!(msg.contains("regex") && msg.contains("unclosed"), "{msg}");
    let msg = invalid(GrammarSpec::Regex("(?=lookahead)".into()));
    assert!(msg.contains("regex"), "{msg}");
    let msg = invalid(GrammarSpec::Lark("start: undefined_rule".into()));
    assert!(
        msg.contains("Lark") && msg.contains("undefined_rule"),
        "{msg}"
    );
    let msg = invalid(GrammarSpec::Lark("start: \"unterminated".into()));
    assert!(msg.contains("Lark"), "{msg}");
    let msg = invalid(GrammarSpec::Lark(String::new()));
    assert!(msg.contains("start"), "{msg}");
    let msg = invalid(GrammarSpec::Lark("start: <|no_such_token|>".into()));
    assert!(msg.contains("<|no_such_token|>"), "{msg}");
}

#[test]
fn errors_are_cached_too() {
    let spec = GrammarSpec::Regex("[".into());
    let engine = &qwen3().engine;
    assert_eq!(
        engine.compile(&spec).unwrap_err(),
        engine.compile(&spec).unwrap_err()
    );
}

#[test]
fn buffers_must_fit_the_vocabulary() {
    let engine = &qwen3().engine;
    let g = engine.compile(&GrammarSpec::JsonObject).unwrap();
    let mut m = engine.matcher(&g).unwrap();
    let mut short = vec![0u32; engine.mask_words() - 1];
    assert!(matches!(
        m.fill_mask(&mut short),
        Err(GrammarError::BufferLength { what: "mask", .. })
    ));
    let mut logits = vec![0f32; engine.vocab_size() + 1];
    assert!(matches!(
        m.apply(&mut logits),
        Err(GrammarError::BufferLength { what: "logits", .. })
    ));
}

#[test]
fn grammars_belong_to_their_engine() {
    let g = qwen3().engine.compile(&GrammarSpec::JsonObject).unwrap();
    assert_eq!(
        smollm2().engine.matcher(&g).unwrap_err(),
        GrammarError::ForeignGrammar
    );
}

#[test]
fn a_refused_token_is_an_error_not_a_panic() {
    let v = qwen3();
    let g = v.engine.compile(&GrammarSpec::JsonObject).unwrap();
    let mut m = v.engine.matcher(&g).unwrap();
    let x = v.tokenizer.token_to_id("x").unwrap();
    assert_eq!(
        m.advance(x),
        Err(GrammarError::TokenNotAllowed { token: x })
    );
    assert!(m.advance(u32::MAX).is_err());
}
