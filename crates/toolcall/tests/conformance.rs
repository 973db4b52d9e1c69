// SPDX-License-Identifier: MIT OR Apache-2.0
//! Tool-call conformance: for every format, well-formed, malformed-but-recoverable and
//! unrecoverable outputs, parsed whole and streamed in many chunkings; all must agree with each
//! other and with the expected content and calls.

mod common;

use metrale_toolcall::{Format, ParseEvent, Parsed, parse_whole, parser_for};
use serde_json::Value;

/// What a fixture is meant to exercise.
#[derive(Debug, Clone, Copy)]
enum Kind {
    WellFormed,
    Recoverable,
    Unrecoverable,
}

struct Case {
    format: Format,
    kind: Kind,
    name: &'static str,
    input: &'static str,
    content: &'static str,
    /// (function name, arguments as JSON text).
    calls: &'static [(&'static str, &'static str)],
}

const fn case(
    format: Format,
    kind: Kind,
    name: &'static str,
    input: &'static str,
    content: &'static str,
    calls: &'static [(&'static str, &'static str)],
) -> Case {
    Case {
        format,
        kind,
        name,
        input,
        content,
        calls,
    }
}

use Format::*;
use Kind::*;

const CASES: &[Case] = &[
    // ---- hermes ----
    case(
        Hermes,
        WellFormed,
        "single call",
        "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"location\": \"Paris\"}}\n</tool_call>",
        "",
        &[("get_weather", r#"{"location":"Paris"}"#)],
    ),
    case(
        Hermes,
        WellFormed,
        "text then two calls",
        "Let me check. 🌦\n\n<tool_call>\n{\"name\":\"a\",\"arguments\":{\"x\":1}}\n</tool_call>\n<tool_call>\n{\"name\":\"b\",\"arguments\":{}}\n</tool_call>\n",
        "Let me check. 🌦",
        &[("a", r#"{"x":1}"#), ("b", "{}")],
    ),
    case(
        Hermes,
        WellFormed,
        "list of calls in one tag",
        r#"<tool_call>[{"name":"a","arguments":{}},{"name":"b","parameters":{"k":"v"}}]</tool_call>"#,
        "",
        &[("a", "{}"), ("b", r#"{"k":"v"}"#)],
    ),
    case(
        Hermes,
        WellFormed,
        "plain text with a lone angle bracket",
        "a < b and <tool> are not tags; 日本語 <tool_cal",
        "a < b and <tool> are not tags; 日本語 <tool_cal",
        &[],
    ),
    case(
        Hermes,
        Recoverable,
        "missing closing tag at end",
        r#"<tool_call>{"name":"f","arguments":{"q":"héllo"}}"#,
        "",
        &[("f", r#"{"q":"héllo"}"#)],
    ),
    case(
        Hermes,
        Recoverable,
        "arguments as a JSON string",
        r#"<tool_call>{"name":"f","arguments":"{\"a\": 1}"}</tool_call>"#,
        "",
        &[("f", r#"{"a":1}"#)],
    ),
    case(
        Hermes,
        Recoverable,
        "trailing commas and whitespace",
        "<tool_call>  {\"name\":\"f\",\"arguments\":{\"a\":[1,2,],},}  \n</tool_call>  ",
        "",
        &[("f", r#"{"a":[1,2]}"#)],
    ),
    case(
        Hermes,
        Recoverable,
        "literal close tag inside a JSON string",
        r#"<tool_call>{"name":"echo","arguments":{"s":"</tool_call> ok"}}</tool_call> done"#,
        "done",
        &[("echo", r#"{"s":"</tool_call> ok"}"#)],
    ),
    case(
        Hermes,
        Recoverable,
        "markdown fence inside the tag",
        "<tool_call>\n```json\n{\"name\":\"f\",\"arguments\":{\"a\":true}}\n```\n</tool_call>",
        "",
        &[("f", r#"{"a":true}"#)],
    ),
    case(
        Hermes,
        Recoverable,
        "missing closing brace and tag",
        r#"Ok.<tool_call>{"name":"f","arguments":{"a":1}"#,
        "Ok.",
        &[("f", r#"{"a":1}"#)],
    ),
    case(
        Hermes,
        Recoverable,
        "empty body is dropped",
        "<tool_call>{}</tool_call>Hi",
        "Hi",
        &[],
    ),
    case(
        Hermes,
        Unrecoverable,
        "not JSON inside the tags",
        "Sure <tool_call>not json at all</tool_call> after",
        "Sure <tool_call>not json at all</tool_call> after",
        &[],
    ),
    case(
        Hermes,
        Unrecoverable,
        "call without a name",
        r#"<tool_call>{"arguments":{}}</tool_call>"#,
        r#"<tool_call>{"arguments":{}}</tool_call>"#,
        &[],
    ),
    case(
        Hermes,
        Unrecoverable,
        "unterminated string",
        r#"<tool_call>{"name": "f", "arguments": {"a": "x}</tool_call> tail"#,
        r#"<tool_call>{"name": "f", "arguments": {"a": "x}</tool_call> tail"#,
        &[],
    ),
    case(
        Hermes,
        Unrecoverable,
        "bad call then good call",
        "<tool_call>[1]</tool_call>\n<tool_call>{\"name\":\"g\",\"arguments\":{}}</tool_call>",
        "<tool_call>[1]</tool_call>",
        &[("g", "{}")],
    ),
    // ---- qwen3_coder / qwen3_xml ----
    case(
        Qwen3Coder,
        WellFormed,
        "single call, typed values",
        "<tool_call>\n<function=get_weather>\n<parameter=location>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
        "",
        &[("get_weather", r#"{"location":"Paris","days":3}"#)],
    ),
    case(
        Qwen3Coder,
        WellFormed,
        "text then multi-line code value",
        "I'll write it.\n<tool_call>\n<function=write_file>\n<parameter=path>\n/tmp/a.py\n</parameter>\n<parameter=content>\nprint(\"héllo 世界\")\nx = {\"a\": 1}\n</parameter>\n</function>\n</tool_call>",
        "I'll write it.",
        &[(
            "write_file",
            r#"{"path":"/tmp/a.py","content":"print(\"héllo 世界\")\nx = {\"a\": 1}"}"#,
        )],
    ),
    case(
        Qwen3Coder,
        WellFormed,
        "two calls",
        "<tool_call>\n<function=a>\n</function>\n</tool_call>\n<tool_call>\n<function=b>\n<parameter=xs>\n[1, 2]\n</parameter>\n</function>\n</tool_call>",
        "",
        &[("a", "{}"), ("b", r#"{"xs":[1,2]}"#)],
    ),
    case(
        Qwen3Xml,
        WellFormed,
        "qwen3_xml alias",
        "<tool_call>\n<function=f>\n<parameter=q>\nwhat is \"x\"?\n</parameter>\n</function>\n</tool_call>",
        "",
        &[("f", r#"{"q":"what is \"x\"?"}"#)],
    ),
    case(
        Qwen3Coder,
        Recoverable,
        "missing </parameter>",
        "<tool_call>\n<function=f>\n<parameter=a>\n1\n<parameter=b>\nhi\n</function>\n</tool_call>",
        "",
        &[("f", r#"{"a":1,"b":"hi"}"#)],
    ),
    case(
        Qwen3Coder,
        Recoverable,
        "literal </tool_call> inside a value",
        "<tool_call>\n<function=echo>\n<parameter=s>\nsay </tool_call> now\n</parameter>\n</function>\n</tool_call>",
        "",
        &[("echo", r#"{"s":"say </tool_call> now"}"#)],
    ),
    case(
        Qwen3Coder,
        Recoverable,
        "missing closing tags at end",
        "Calling.\n<tool_call>\n<function=f>\n<parameter=a>\n[1, 2]",
        "Calling.",
        &[("f", r#"{"a":[1,2]}"#)],
    ),
    case(
        Qwen3Coder,
        Recoverable,
        "empty tool call",
        "<tool_call></tool_call>ok",
        "ok",
        &[],
    ),
    case(
        Qwen3Coder,
        Recoverable,
        "hermes JSON body",
        r#"<tool_call>{"name":"f","arguments":{"a":1}}</tool_call>"#,
        "",
        &[("f", r#"{"a":1}"#)],
    ),
    case(
        Qwen3Coder,
        Unrecoverable,
        "prose inside the tags",
        "<tool_call>\nhello there\n</tool_call> bye",
        "<tool_call>\nhello there\n</tool_call> bye",
        &[],
    ),
    case(
        Qwen3Xml,
        Unrecoverable,
        "function without a name",
        "x <tool_call><function=>\n</function></tool_call>",
        "x <tool_call><function=>\n</function></tool_call>",
        &[],
    ),
    // ---- mistral ----
    case(
        Mistral,
        WellFormed,
        "one call in a list",
        r#"[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}]"#,
        "",
        &[("f", r#"{"a":1}"#)],
    ),
    case(
        Mistral,
        WellFormed,
        "content then two calls",
        r#"Sure.[TOOL_CALLS][{"name":"a","arguments":{}}, {"name":"b","arguments":{"x":"ü"}}]"#,
        "Sure.",
        &[("a", "{}"), ("b", r#"{"x":"ü"}"#)],
    ),
    case(
        Mistral,
        WellFormed,
        "v11 name[ARGS]",
        r#"[TOOL_CALLS]get_weather[ARGS]{"location": "Paris"}"#,
        "",
        &[("get_weather", r#"{"location":"Paris"}"#)],
    ),
    case(
        Mistral,
        Recoverable,
        "single object instead of a list",
        r#"[TOOL_CALLS]{"name":"f","arguments":{"a":1}}"#,
        "",
        &[("f", r#"{"a":1}"#)],
    ),
    case(
        Mistral,
        Recoverable,
        "arguments as a JSON string",
        r#"[TOOL_CALLS][{"name":"f","arguments":"{\"a\":1}"}]"#,
        "",
        &[("f", r#"{"a":1}"#)],
    ),
    case(
        Mistral,
        Recoverable,
        "truncated list",
        r#"[TOOL_CALLS][{"name":"f","arguments":{"a":1}"#,
        "",
        &[("f", r#"{"a":1}"#)],
    ),
    case(
        Mistral,
        Recoverable,
        "trailing text after the list",
        r#"[TOOL_CALLS] [{"name":"f","arguments":{},},] trailing"#,
        "trailing",
        &[("f", "{}")],
    ),
    case(
        Mistral,
        Unrecoverable,
        "prose after the marker",
        "[TOOL_CALLS] I cannot do that.",
        "[TOOL_CALLS] I cannot do that.",
        &[],
    ),
    case(
        Mistral,
        Unrecoverable,
        "list of non-calls",
        "[TOOL_CALLS][1, 2] ok",
        "[TOOL_CALLS][1, 2] ok",
        &[],
    ),
    // ---- llama3_json ----
    case(
        Llama3Json,
        WellFormed,
        "bare call",
        r#"{"name": "f", "parameters": {"a": 1}}"#,
        "",
        &[("f", r#"{"a":1}"#)],
    ),
    case(
        Llama3Json,
        WellFormed,
        "after python_tag",
        r#"<|python_tag|>{"name": "f", "parameters": {"a": "é"}}"#,
        "",
        &[("f", r#"{"a":"é"}"#)],
    ),
    case(
        Llama3Json,
        WellFormed,
        "two calls separated by ;",
        r#"{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 2}}"#,
        "",
        &[("a", "{}"), ("b", r#"{"x":2}"#)],
    ),
    case(
        Llama3Json,
        WellFormed,
        "text then python_tag",
        r#"Calling. <|python_tag|>{"name":"f","parameters":{}}"#,
        "Calling.",
        &[("f", "{}")],
    ),
    case(
        Llama3Json,
        WellFormed,
        "plain text",
        "The answer is {not json}. 🦀",
        "The answer is {not json}. 🦀",
        &[],
    ),
    case(
        Llama3Json,
        Recoverable,
        "trailing commas and whitespace",
        "  {\"name\": \"f\", \"parameters\": {\"a\": 1,},}  \n",
        "",
        &[("f", r#"{"a":1}"#)],
    ),
    case(
        Llama3Json,
        Recoverable,
        "missing closing brace",
        r#"{"name": "f", "parameters": {"a": 1}"#,
        "",
        &[("f", r#"{"a":1}"#)],
    ),
    case(
        Llama3Json,
        Recoverable,
        "arguments key and string arguments",
        r#"{"name": "f", "arguments": "{\"a\": [1]}"}"#,
        "",
        &[("f", r#"{"a":[1]}"#)],
    ),
    case(
        Llama3Json,
        Unrecoverable,
        "braces but not JSON",
        "{this is not json} ok",
        "{this is not json} ok",
        &[],
    ),
    case(
        Llama3Json,
        Unrecoverable,
        "JSON without a name",
        r#"{"result": 42}"#,
        r#"{"result": 42}"#,
        &[],
    ),
    // ---- bare_json ----
    case(
        BareJson,
        WellFormed,
        "one object",
        r#"{"name": "f", "arguments": {"a": 1}}"#,
        "",
        &[("f", r#"{"a":1}"#)],
    ),
    case(
        BareJson,
        WellFormed,
        "list",
        r#"[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"k": [1, 2]}}]"#,
        "",
        &[("a", "{}"), ("b", r#"{"k":[1,2]}"#)],
    ),
    case(
        BareJson,
        WellFormed,
        "plain text",
        "Hello, world! 👋 {x}",
        "Hello, world! 👋 {x}",
        &[],
    ),
    case(
        BareJson,
        Recoverable,
        "markdown fenced",
        "```json\n{\"name\": \"f\", \"arguments\": {\"a\": \"ß\"}}\n```",
        "",
        &[("f", r#"{"a":"ß"}"#)],
    ),
    case(
        BareJson,
        Recoverable,
        "arguments as a JSON string",
        r#"{"name":"f","arguments":"{\"a\":1}"}"#,
        "",
        &[("f", r#"{"a":1}"#)],
    ),
    case(
        BareJson,
        Recoverable,
        "truncated",
        r#"{"name": "f", "arguments": {"a": 1"#,
        "",
        &[("f", r#"{"a":1}"#)],
    ),
    case(
        BareJson,
        Unrecoverable,
        "code fence that is not JSON",
        "```python\nprint(1)\n```",
        "```python\nprint(1)\n```",
        &[],
    ),
    case(
        BareJson,
        Unrecoverable,
        "JSON that is not a call",
        r#"{"foo": 1}"#,
        r#"{"foo": 1}"#,
        &[],
    ),
    case(
        BareJson,
        Unrecoverable,
        "unterminated string",
        r#"{"name": "f", "arguments": {"a": "oops"#,
        r#"{"name": "f", "arguments": {"a": "oops"#,
        &[],
    ),
];

/// Folds a streamed parse, checking the event protocol on the way.
fn stream(format: Format, chunks: &[&str]) -> Parsed {
    let mut parser = parser_for(format);
    let mut parsed = Parsed::default();
    let mut open: Option<usize> = None;
    let events = chunks
        .iter()
        .flat_map(|c| parser.push(c))
        .collect::<Vec<_>>();
    for event in events.into_iter().chain(parser.finish()) {
        match &event {
            ParseEvent::Text(t) => {
                assert!(!t.is_empty(), "empty text event");
                assert_eq!(open, None, "text inside a call");
            }
            ParseEvent::ToolCallStart { index, .. } => {
                assert_eq!(open, None);
                assert_eq!(*index, parsed.tool_calls.len());
                open = Some(*index);
            }
            ParseEvent::ToolCallArguments { index, .. } => assert_eq!(open, Some(*index)),
            ParseEvent::ToolCallEnd { index } => {
                assert_eq!(open, Some(*index));
                open = None;
            }
        }
        parsed.apply(event);
    }
    assert_eq!(open, None, "call left open");
    parsed
}

fn json(s: &str) -> Value {
    serde_json::from_str(s).unwrap_or_else(|e| panic!("bad JSON {s:?}: {e}"))
}

fn check_expected(case: &Case, got: &Parsed, how: &str) {
    let ctx = format!("{} / {} ({:?}, {how})", case.format, case.name, case.kind);
    assert_eq!(got.content, case.content, "content: {ctx}");
    assert_eq!(
        got.tool_calls.len(),
        case.calls.len(),
        "call count: {ctx}: {got:?}"
    );
    for (i, (call, (name, args))) in got.tool_calls.iter().zip(case.calls).enumerate() {
        assert_eq!(call.id, format!("call_{i:08}"), "id: {ctx}");
        assert_eq!(call.name, *name, "name: {ctx}");
        assert_eq!(json(&call.arguments), json(args), "arguments: {ctx}");
    }
}

#[test]
fn every_format_has_fixtures_of_every_kind() {
    for format in [Hermes, Qwen3Coder, Mistral, Llama3Json, BareJson] {
        let of = |k: fn(&Kind) -> bool| {
            CASES
                .iter()
                .filter(|c| c.format == format && k(&c.kind))
                .count()
        };
        assert!(of(|k| matches!(k, WellFormed)) >= 2, "{format}");
        assert!(of(|k| matches!(k, Recoverable)) >= 2, "{format}");
        assert!(of(|k| matches!(k, Unrecoverable)) >= 1, "{format}");
        assert!(of(|_| true) >= 5, "{format}");
    }
}

#[test]
fn whole_parse_matches_expected() {
    for case in CASES {
        check_expected(case, &parse_whole(case.format, case.input), "whole");
    }
}

#[test]
fn streamed_parse_matches_whole_for_every_chunking() {
    for case in CASES {
        let whole = parse_whole(case.format, case.input);
        for chunks in common::chunkings(case.input) {
            let streamed = stream(case.format, &chunks);
            assert_eq!(
                streamed, whole,
                "{} / {}: chunks {chunks:?}",
                case.format, case.name
            );
            check_expected(case, &streamed, "streamed");
        }
    }
}

#[test]
fn markers_never_leak_partially_into_content() {
    // A stream cut right inside an opening tag emits nothing of the tag before it is decided.
    let mut p = parser_for(Hermes);
    assert_eq!(p.push("Hi <tool_"), vec![ParseEvent::Text("Hi".into())]);
    assert_eq!(p.push("ca"), vec![]);
    let events = p.push("ll>{\"name\":\"f\",\"arguments\":{}}</tool_call>");
    assert!(
        matches!(events[0], ParseEvent::ToolCallStart { .. }),
        "{events:?}"
    );
    assert_eq!(p.finish(), vec![]);
}

#[test]
fn format_names_round_trip() {
    for f in Format::ALL {
        assert_eq!(f.name().parse::<Format>(), Ok(f));
    }
    assert!("gemma4".parse::<Format>().is_err());
}

/// Random soups of marker pieces, JSON punctuation and multi-byte text: no panic, no lost text
/// decision that depends on the chunking (whole == streamed), for every format.
#[test]
fn random_soups_stream_like_whole() {
    const PIECES: &[&str] = &[
        "<tool_call>",
        "</tool_call>",
        "<tool_",
        "<function=f>",
        "</function>",
        "<parameter=a>",
        "</parameter>",
        "[TOOL_CALLS]",
        "[ARGS]",
        "<|python_tag|>",
        "```json\n",
        "```",
        "{",
        "}",
        "[",
        "]",
        "\"",
        "\\",
        ",",
        ";",
        ":",
        "\"name\"",
        "\"arguments\"",
        "\"f\"",
        "1",
        " ",
        "\n",
        "é",
        "世界",
        "🦀",
        "x",
    ];
    for seed in 0..400u64 {
        let mut rng = common::Rng::new(seed);
        let len = 1 + rng.below(24);
        let text: String = (0..len).map(|_| PIECES[rng.below(PIECES.len())]).collect();
        for format in Format::ALL {
            let whole = parse_whole(format, &text);
            for chunks in common::chunkings(&text).into_iter().step_by(7) {
                assert_eq!(
                    stream(format, &chunks),
                    whole,
                    "{format}: {text:?} as {chunks:?}"
                );
            }
        }
    }
}
