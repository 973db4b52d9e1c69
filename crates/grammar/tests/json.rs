// SPDX-License-Identifier: MIT OR Apache-2.0
//! JSON schemas and "any JSON object": random walks through the masks always end in JSON that an
//! independent validator (the `jsonschema` crate) accepts.

mod common;

use common::{Rng, compile, qwen3, sample, smollm2};
use metrale_grammar::GrammarSpec;
use serde_json::{Value, json};

const RUNS: u64 = 50;

/// Required string, integer, enum, array and nested-object fields, and optional ones.
fn person_schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 40},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "role": {"enum": ["admin", "user", "guest"]},
            "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 4},
            "address": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"}
                },
                "required": ["city", "zip"],
                "additionalProperties": false
            },
            "score": {"type": "number"},
            "active": {"type": "boolean"},
            "nickname": {"type": ["string", "null"]}
        },
        "required": ["name", "age", "role", "tags", "address"],
        "additionalProperties": false
    })
}

#[test]
fn schema_samples_validate() {
    let v = qwen3();
    let schema = person_schema();
    let validator = jsonschema::validator_for(&schema).unwrap();
    let g = compile(
        v,
        &GrammarSpec::JsonSchema {
            schema: schema.clone(),
            strict: true,
        },
    );
    for seed in 0..RUNS {
        let s = sample(v, &g, &mut Rng::new(seed));
        let value: Value = serde_json::from_str(&s.text)
            .unwrap_or_else(|e| panic!("seed {seed}: not JSON ({e}): {:?}", s.text));
        if let Err(e) = validator.validate(&value) {
            panic!("seed {seed}: {e}: {}", s.text);
        }
    }
}

#[test]
fn schema_samples_validate_with_a_gguf_vocabulary() {
    let v = smollm2();
    let schema = person_schema();
    let validator = jsonschema::validator_for(&schema).unwrap();
    let g = compile(
        v,
        &GrammarSpec::JsonSchema {
            schema: schema.clone(),
            strict: true,
        },
    );
    for seed in 0..RUNS / 5 {
        let s = sample(v, &g, &mut Rng::new(seed));
        let value: Value = serde_json::from_str(&s.text)
            .unwrap_or_else(|e| panic!("seed {seed}: not JSON ({e}): {:?}", s.text));
        assert!(validator.is_valid(&value), "seed {seed}: {}", s.text);
    }
}

#[test]
fn json_object_samples_are_objects() {
    let v = qwen3();
    let g = compile(v, &GrammarSpec::JsonObject);
    for seed in 0..RUNS {
        let s = sample(v, &g, &mut Rng::new(1000 + seed));
        let value: Value = serde_json::from_str(&s.text)
            .unwrap_or_else(|e| panic!("seed {seed}: not JSON ({e}): {:?}", s.text));
        assert!(value.is_object(), "seed {seed}: {}", s.text);
    }
}

#[test]
fn refs_and_combinators_validate() {
    let v = qwen3();
    let schema = json!({
        "$defs": {
            "point": {
                "type": "object",
                "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                "required": ["x", "y"],
                "additionalProperties": false
            }
        },
        "type": "object",
        "properties": {
            "shape": {
                "anyOf": [
                    {"type": "object", "properties": {"circle": {"$ref": "#/$defs/point"}},
                     "required": ["circle"], "additionalProperties": false},
                    {"type": "array", "items": {"$ref": "#/$defs/point"}, "maxItems": 3}
                ]
            },
            "label": {"const": "fixed"}
        },
        "required": ["shape", "label"],
        "additionalProperties": false
    });
    let validator = jsonschema::validator_for(&schema).unwrap();
    let g = compile(
        v,
        &GrammarSpec::JsonSchema {
            schema: schema.clone(),
            strict: true,
        },
    );
    for seed in 0..RUNS {
        let s = sample(v, &g, &mut Rng::new(2000 + seed));
        let value: Value = serde_json::from_str(&s.text)
            .unwrap_or_else(|e| panic!("seed {seed}: not JSON ({e}): {:?}", s.text));
        assert!(validator.is_valid(&value), "seed {seed}: {}", s.text);
    }
}

#[test]
fn whitespace_is_bounded() {
    // One run of blanks or one line break and its indentation between tokens: a walk that
    // always picks whitespace cannot go on forever.
    let v = qwen3();
    let g = compile(v, &GrammarSpec::JsonObject);
    let mut m = v.engine.matcher(&g).unwrap();
    let brace = v.tokenizer.encode("{", false).unwrap()[0];
    m.advance(brace).unwrap();
    let space = v.tokenizer.encode(" ", false).unwrap()[0];
    let mut spaces = 0;
    while m.advance(space).is_ok() {
        spaces += 1;
        assert!(spaces <= 48, "more blanks than the whitespace rule allows");
    }
    assert_eq!(spaces, 48);
}
