// SPDX-License-Identifier: MIT OR Apache-2.0
//! Chat templates against strings `transformers` rendered (tests/fixtures/chat_templates.json,
//! made by scripts/make_template_fixtures.py): every case must match byte for byte, and every case
//! `transformers` refused must be refused too (`raise_exception` ones with the same message).

mod common;

use metrale_model_weights::GgufFile;
use metrale_tokenizer::{ChatTemplate, RenderOptions, Tokenizer, TokenizerError};
use serde_json::{Map, Value};

fn fixture() -> Value {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/chat_templates.json"
    );
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// The template source a fixture entry names: a whole `.jinja` file, a key of a JSON file, or a
/// GGUF metadata key.
fn template_source(entry: &Value) -> String {
    let path = common::data_file(entry["file"].as_str().unwrap());
    let Some(key) = entry.get("key").and_then(Value::as_str) else {
        return std::fs::read_to_string(path).unwrap();
    };
    if path.extension().is_some_and(|e| e == "gguf") {
        let gguf = GgufFile::open(&path).unwrap();
        return gguf.metadata[key].as_str().unwrap().to_string();
    }
    let json: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    json[key].as_str().unwrap().to_string()
}

fn compile(entry: &Value) -> ChatTemplate {
    let special = entry["special_tokens"].as_object().unwrap();
    let text = |key: &str| special.get(key).and_then(Value::as_str).map(str::to_string);
    let mut template = ChatTemplate::new(
        &template_source(entry),
        text("bos_token"),
        text("eos_token"),
    )
    .unwrap();
    for (key, value) in special
        .iter()
        .filter(|(k, _)| !["bos_token", "eos_token"].contains(&k.as_str()))
    {
        template = template.with_variable(key, value.clone());
    }
    template
}

fn options(case: &Value, tools: &Value) -> RenderOptions {
    RenderOptions {
        add_generation_prompt: case["add_generation_prompt"].as_bool().unwrap(),
        tools: case["tools"]
            .as_bool()
            .unwrap()
            .then(|| tools.as_array().unwrap().clone()),
        enable_thinking: case["enable_thinking"].as_bool(),
        extra: case["extra"].as_object().cloned().unwrap_or_else(Map::new),
    }
}

fn messages<'a>(fixture: &'a Value, case: &Value) -> &'a [Value] {
    fixture["conversations"][case["conversation"].as_str().unwrap()]
        .as_array()
        .unwrap()
}

/// Python's error for `{% for x in none %}`.
const NONE_NOT_ITERABLE: &str = "'NoneType' object is not iterable";

/// How one case compared with `transformers`.
#[derive(Debug, PartialEq)]
enum Outcome {
    /// Same text.
    Same,
    /// Both refused (a `raise_exception` one with the same message).
    BothRefused,
    /// `transformers` failed iterating `None` (a template looping over `tools` unchecked), we
    /// rendered: MiniJinja iterates `None` as empty. Known, and only more lenient.
    RenderedWhereNoneIsNotIterable,
    /// A difference, described.
    Differs(String),
}

fn check(template: &ChatTemplate, fixture: &Value, case: &Value) -> Outcome {
    let got = template.render(messages(fixture, case), &options(case, &fixture["tools"]));
    let label = format!(
        "{} / {} (add_generation_prompt={}, enable_thinking={})",
        case["template"],
        case["conversation"],
        case["add_generation_prompt"],
        case["enable_thinking"]
    );
    let differs = |what: String| Outcome::Differs(format!("{label}: {what}"));
    match (got, case.get("expected"), case.get("expected_error")) {
        (Ok(text), Some(Value::String(want)), _) if text == *want => Outcome::Same,
        (Ok(text), Some(Value::String(want)), _) => {
            let at = text
                .chars()
                .zip(want.chars())
                .take_while(|(a, b)| a == b)
                .count();
            let tail = |s: &str| {
                s.chars()
                    .skip(at.saturating_sub(20))
                    .take(60)
                    .collect::<String>()
            };
            differs(format!(
                "differs at char {at}:\n    want …{:?}\n    got  …{:?}",
                tail(want),
                tail(&text)
            ))
        }
        (Err(e), Some(_), _) => differs(format!("transformers rendered it, we failed: {e}")),
        (Ok(_), None, Some(err)) if err["message"] == NONE_NOT_ITERABLE => {
            Outcome::RenderedWhereNoneIsNotIterable
        }
        (Ok(_), None, Some(err)) => differs(format!("transformers failed ({err}), we rendered")),
        (Err(TokenizerError::TemplateRaised { message }), None, Some(err))
            if err["type"] == "TemplateError" =>
        {
            if message == err["message"].as_str().unwrap() {
                Outcome::BothRefused
            } else {
                differs(format!("raised {message:?}, want {err}"))
            }
        }
        (Err(e), None, Some(err)) if err["type"] == "TemplateError" => {
            differs(format!("want raise_exception({}), got {e}", err["message"]))
        }
        (Err(_), None, Some(_)) => Outcome::BothRefused,
        (got, _, _) => differs(format!("malformed case, got {got:?}")),
    }
}

#[test]
fn templates_render_what_transformers_renders() {
    let fixture = fixture();
    let mut failures = Vec::new();
    for (id, entry) in fixture["templates"].as_object().unwrap() {
        let template = compile(entry);
        let cases: Vec<&Value> = fixture["cases"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|c| c["template"] == id.as_str())
            .collect();
        let outcomes: Vec<Outcome> = cases
            .iter()
            .map(|case| check(&template, &fixture, case))
            .collect();
        let count = |o: &Outcome| outcomes.iter().filter(|x| *x == o).count();
        eprintln!(
            "{id}: {} cases: {} same text, {} refused by both, {} rendered where Python cannot iterate None",
            cases.len(),
            count(&Outcome::Same),
            count(&Outcome::BothRefused),
            count(&Outcome::RenderedWhereNoneIsNotIterable)
        );
        failures.extend(outcomes.into_iter().filter_map(|o| match o {
            Outcome::Differs(d) => Some(d),
            _ => None,
        }));
    }
    assert!(
        failures.is_empty(),
        "{} cases differ from transformers:\n  {}",
        failures.len(),
        failures.join("\n  ")
    );
}

/// The loaders hand out the same template and special tokens the fixture was rendered with.
#[test]
fn loaders_provide_the_model_template() {
    let fixture = fixture();
    let qwen3 = Tokenizer::from_hf_dir(&common::data_file("qwen3-tokenizer")).unwrap();
    let smollm2 = Tokenizer::from_gguf(
        &GgufFile::open(&common::data_file(
            "smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        ))
        .unwrap(),
    )
    .unwrap();
    for (tokenizer, id) in [
        (&qwen3, "qwen3-tokenizer_config"),
        (&smollm2, "smollm2-gguf"),
    ] {
        let template = tokenizer
            .chat_template()
            .unwrap_or_else(|| panic!("{id}: no chat template"));
        let cases = fixture["cases"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|c| c["template"] == id);
        for case in cases {
            let outcome = check(template, &fixture, case);
            assert!(
                matches!(outcome, Outcome::Same | Outcome::BothRefused),
                "{outcome:?}"
            );
        }
    }
    assert_eq!(qwen3.eos_token_ids(), [151_645]);
    assert_eq!(qwen3.pad_token_id(), Some(151_643));
    assert_eq!(qwen3.bos_token_id(), None);
}
