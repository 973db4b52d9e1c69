// SPDX-License-Identifier: MIT OR Apache-2.0
//! Tool calls in each wire format: random walks through the masks always end in output that
//! `metrale-toolcall` parses to one or more calls of offered tools, with no other content, and
//! arguments that their tool's schema accepts.

mod common;

use common::{Rng, Vocab, compile, llama3, qwen3, sample};
use metrale_grammar::{GrammarError, GrammarSpec, ToolChoiceMode, ToolSpec, ToolWire};
use metrale_toolcall::{Format, parse_whole};
use serde_json::{Value, json};

const RUNS: u64 = 50;

/// Tools covering raw-text, enum, integer, array, nested-object and nullable parameters, one
/// with no parameters, and one whose parameters use `$defs`.
fn tools() -> Vec<ToolSpec> {
    vec![
        ToolSpec {
            name: "get_weather".into(),
            parameters: json!({
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "free text"},
                    "unit": {"enum": ["celsius", "fahrenheit"]},
                    "days": {"type": "integer", "minimum": 1, "maximum": 14}
                },
                "required": ["city"]
            }),
        },
        ToolSpec {
            name: "search".into(),
            parameters: json!({
                "type": "object",
                "properties": {
                    "query": {"type": "string", "minLength": 1, "maxLength": 30},
                    "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
                    "filters": {
                        "type": "object",
                        "properties": {
                            "lang": {"enum": ["en", "fr", "12"]},
                            "safe": {"type": "boolean"}
                        },
                        "required": ["safe"],
                        "additionalProperties": false
                    },
                    "note": {"type": ["string", "null"]}
                },
                "required": ["query", "filters"],
                "additionalProperties": false
            }),
        },
        ToolSpec {
            name: "get_time".into(),
            parameters: Value::Null,
        },
        ToolSpec {
            name: "book".into(),
            parameters: json!({
                "$defs": {"date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}},
                "type": "object",
                "properties": {"when": {"$ref": "#/$defs/date"}, "seats": {"type": "integer", "minimum": 1}},
                "required": ["when"]
            }),
        },
    ]
}

/// The parser that reads `wire` (qwen3_xml is read by both Qwen3 parsers).
fn formats(wire: ToolWire) -> Vec<Format> {
    match wire {
        ToolWire::Hermes => vec![Format::Hermes],
        ToolWire::Qwen3Xml => vec![Format::Qwen3Xml, Format::Qwen3Coder],
        ToolWire::Mistral => vec![Format::Mistral],
        ToolWire::Llama3Json => vec![Format::Llama3Json],
        ToolWire::BareJson => vec![Format::BareJson],
    }
}

/// Arguments as the tool's schema sees them: no parameters means `{}` only.
fn argument_schema(tool: &ToolSpec) -> Value {
    match &tool.parameters {
        Value::Null => json!({"type": "object", "additionalProperties": false}),
        p => p.clone(),
    }
}

fn check_wire(vocab: &Vocab, wire: ToolWire, choice: ToolChoiceMode, seed0: u64) {
    let tools = tools();
    let spec = GrammarSpec::tool_calls(wire, &tools, choice.clone()).unwrap();
    let grammar = compile(vocab, &spec);
    let mut names_seen = std::collections::BTreeSet::new();
    for seed in seed0..seed0 + RUNS {
        let s = sample(vocab, &grammar, &mut Rng::new(seed));
        for format in formats(wire) {
            let parsed = parse_whole(format, &s.text);
            let why = format!("{wire:?} {choice:?} seed {seed} as {format}: {:?}", s.text);
            assert!(parsed.content.trim().is_empty(), "content left over: {why}");
            assert!(!parsed.tool_calls.is_empty(), "no call: {why}");
            if let ToolChoiceMode::Named(name) = &choice {
                assert_eq!(parsed.tool_calls.len(), 1, "{why}");
                assert_eq!(&parsed.tool_calls[0].name, name, "{why}");
            }
            if choice == ToolChoiceMode::RequiredOne {
                assert_eq!(parsed.tool_calls.len(), 1, "{why}");
            }
            for call in &parsed.tool_calls {
                let tool = tools
                    .iter()
                    .find(|t| t.name == call.name)
                    .unwrap_or_else(|| panic!("unknown tool `{}`: {why}", call.name));
                names_seen.insert(call.name.clone());
                let args: Value = serde_json::from_str(&call.arguments)
                    .unwrap_or_else(|e| panic!("arguments not JSON ({e}): {why}"));
                let validator = jsonschema::validator_for(&argument_schema(tool)).unwrap();
                if let Err(e) = validator.validate(&args) {
                    panic!("`{}` arguments {args} invalid: {e}: {why}", call.name);
                }
            }
        }
    }
    if matches!(
        choice,
        ToolChoiceMode::Required | ToolChoiceMode::RequiredOne
    ) {
        assert!(
            names_seen.len() > 1,
            "{wire:?}: only {names_seen:?} was ever called"
        );
    }
}

fn check_both_choices(wire: ToolWire) {
    let v = qwen3();
    check_wire(v, wire, ToolChoiceMode::Required, 0);
    check_wire(v, wire, ToolChoiceMode::Named("search".into()), 100);
    check_wire(v, wire, ToolChoiceMode::RequiredOne, 300);
}

#[test]
fn hermes_calls_parse_and_validate() {
    check_both_choices(ToolWire::Hermes);
}

#[test]
fn qwen3_xml_calls_parse_and_validate() {
    check_both_choices(ToolWire::Qwen3Xml);
}

#[test]
fn mistral_calls_parse_and_validate() {
    check_both_choices(ToolWire::Mistral);
}

#[test]
fn llama3_json_calls_parse_and_validate() {
    check_both_choices(ToolWire::Llama3Json);
}

#[test]
fn bare_json_calls_parse_and_validate() {
    check_both_choices(ToolWire::BareJson);
}

#[test]
fn llama3_vocabulary_calls_parse_and_validate() {
    let v = llama3();
    check_wire(v, ToolWire::Llama3Json, ToolChoiceMode::Required, 200);
    check_wire(
        v,
        ToolWire::Qwen3Xml,
        ToolChoiceMode::Named("get_weather".into()),
        300,
    );
}

#[test]
fn qwen3_xml_writes_raw_text_and_json_values() {
    // Walk one hand-written call through the grammar token by token: raw text for a string
    // parameter, a bare word for an enum, JSON for an integer.
    let v = qwen3();
    let spec = GrammarSpec::tool_calls(
        ToolWire::Qwen3Xml,
        &tools(),
        ToolChoiceMode::Named("get_weather".into()),
    )
    .unwrap();
    let g = compile(v, &spec);
    let text = "<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco, CA\n</parameter>\n\
                <parameter=unit>\ncelsius\n</parameter>\n<parameter=days>\n3\n</parameter>\n\
                </function>\n</tool_call>";
    let mut m = v.engine.matcher(&g).unwrap();
    for id in v.tokenizer.encode(text, false).unwrap() {
        m.advance(id)
            .unwrap_or_else(|e| panic!("{:?} refused: {e}", v.tokenizer.id_to_token(id)));
    }
    m.advance(v.engine.eos_token_ids()[0]).unwrap();
    let parsed = parse_whole(Format::Qwen3Coder, text);
    assert_eq!(
        parsed.tool_calls[0].arguments,
        r#"{"city":"San Francisco, CA","unit":"celsius","days":3}"#
    );
}

#[test]
fn qwen3_xml_refuses_raw_text_that_reads_as_json() {
    // A string parameter written `42` would be read back as the number 42.
    let v = qwen3();
    let spec = GrammarSpec::tool_calls(
        ToolWire::Qwen3Xml,
        &tools(),
        ToolChoiceMode::Named("get_weather".into()),
    )
    .unwrap();
    let g = compile(v, &spec);
    let mut m = v.engine.matcher(&g).unwrap();
    let prefix = "<tool_call>\n<function=get_weather>\n<parameter=city>\n42";
    for id in v.tokenizer.encode(prefix, false).unwrap() {
        m.advance(id).unwrap();
    }
    let close = v.tokenizer.encode("\n</parameter>", false).unwrap();
    let mut refused = false;
    for id in close {
        if m.advance(id).is_err() {
            refused = true;
            break;
        }
    }
    assert!(refused, "`42` was accepted as a string value");
}

#[test]
fn tool_lists_that_cannot_be_constrained_are_refused() {
    let weather = tools().remove(0);
    let err = |wire, tools: &[ToolSpec], choice| {
        GrammarSpec::tool_calls(wire, tools, choice)
            .unwrap_err()
            .to_string()
    };
    assert!(err(ToolWire::Hermes, &[], ToolChoiceMode::Required).contains("no tools"));
    assert!(
        err(
            ToolWire::Hermes,
            std::slice::from_ref(&weather),
            ToolChoiceMode::Named("nope".into())
        )
        .contains("`nope`")
    );
    assert!(
        err(
            ToolWire::Hermes,
            &[weather.clone(), weather.clone()],
            ToolChoiceMode::Required
        )
        .contains("two tools")
    );
    let spaced = ToolSpec {
        name: "get weather".into(),
        parameters: Value::Null,
    };
    assert!(
        err(
            ToolWire::Qwen3Xml,
            std::slice::from_ref(&spaced),
            ToolChoiceMode::Required
        )
        .contains("qwen3_xml")
    );
    // Other wires write the name as a JSON string, so any name works there.
    assert!(GrammarSpec::tool_calls(ToolWire::Hermes, &[spaced], ToolChoiceMode::Required).is_ok());
}

#[test]
fn a_bad_parameters_schema_names_its_tool() {
    let v = qwen3();
    for wire in ToolWire::ALL {
        let bad = ToolSpec {
            name: "broken".into(),
            parameters: json!({"type": "object", "properties": {"a": {"type": "strin"}}}),
        };
        let spec =
            GrammarSpec::tool_calls(wire, &[tools().remove(0), bad], ToolChoiceMode::Required)
                .unwrap();
        let e = v.engine.compile(&spec).unwrap_err();
        assert!(matches!(e, GrammarError::Invalid { .. }), "{wire:?}: {e}");
        let msg = e.to_string();
        assert!(
            msg.contains("`broken`") && msg.contains("strin"),
            "{wire:?}: {msg}"
        );
    }
}

#[test]
fn wire_names_round_trip() {
    for wire in ToolWire::ALL {
        assert_eq!(wire.name().parse::<ToolWire>().unwrap(), wire);
    }
    assert_eq!(
        "qwen3_coder".parse::<ToolWire>().unwrap(),
        ToolWire::Qwen3Xml
    );
    assert!("xml".parse::<ToolWire>().is_err());
}
