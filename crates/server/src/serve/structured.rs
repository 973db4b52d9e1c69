// SPDX-License-Identifier: MIT OR Apache-2.0
//! Structured output on the request side: the fields that ask for a grammar, read into a
//! [`GrammarSpec`] with errors that name the field.
//!
//! OpenAI's `response_format` (`text`, `json_object`, `json_schema`), and vLLM's extension fields
//! so that clients written for vLLM work unchanged: `guided_json` (a schema), `guided_regex`,
//! `guided_grammar` (Lark, llguidance's dialect), `guided_choice` (a list of strings), and the
//! newer `structured_outputs: {"json" | "regex" | "grammar" | "choice" | "json_object": ...}`.
//! A request may ask for one grammar; two are refused rather than one picked silently. Whether
//! the grammar compiles is decided later, at admission ([`super::constraint`]), which names the
//! same field.

use serde_json::{Map, Value};

use super::error::ApiError;
use super::params::Body;
use metrale_grammar::GrammarSpec;

/// A grammar the request's own fields ask the output to follow.
#[derive(Clone, Debug, PartialEq)]
pub struct Requested {
    /// What the output must match.
    pub spec: GrammarSpec,
    /// The request field it came from (`response_format.json_schema.schema`, `guided_regex`,
    /// ...), named by the 400 when the grammar does not compile.
    pub field: String,
}

/// The grammar asked for by `response_format`, the `guided_*` fields or `structured_outputs`;
/// `None` when the request asks for none (or for `response_format: {"type": "text"}`).
pub fn requested(b: &Body) -> Result<Option<Requested>, ApiError> {
    let mut found: Vec<Requested> = Vec::new();
    if let Some(r) = response_format(b)? {
        found.push(r);
    }
    if let Some(v) = b.get("guided_json") {
        found.push(json_schema(v, "guided_json")?);
    }
    if let Some(rx) = b.str("guided_regex")? {
        found.push(regex(rx, "guided_regex"));
    }
    if let Some(lark) = b.str("guided_grammar")? {
        found.push(lark_grammar(lark, "guided_grammar"));
    }
    if let Some(v) = b.get("guided_choice") {
        found.push(choice(v, "guided_choice")?);
    }
    if let Some(o) = b.object("structured_outputs")? {
        found.extend(structured_outputs(o)?);
    }
    only_one(found)
}

/// The one grammar found, or a 400 naming the second field that asks for one.
fn only_one(mut found: Vec<Requested>) -> Result<Option<Requested>, ApiError> {
    match found.len() {
        0 | 1 => Ok(found.pop()),
        _ => Err(ApiError::invalid(
            &found[1].field,
            format!(
                "`{}` and `{}` both constrain the output; give one of them",
                found[0].field, found[1].field
            ),
        )),
    }
}

fn invalid(field: &str, what: &str) -> ApiError {
    ApiError::invalid(field, format!("`{field}` {what}"))
}

/// OpenAI's `response_format`.
fn response_format(b: &Body) -> Result<Option<Requested>, ApiError> {
    let Some(rf) = b.object("response_format")? else {
        return Ok(None);
    };
    let kinds = "must be `text`, `json_object` or `json_schema`";
    match rf.get("type") {
        Some(Value::String(t)) if t == "text" => Ok(None),
        Some(Value::String(t)) if t == "json_object" => Ok(Some(Requested {
            spec: GrammarSpec::JsonObject,
            field: "response_format".into(),
        })),
        Some(Value::String(t)) if t == "json_schema" => json_schema_format(rf).map(Some),
        Some(Value::String(other)) => Err(invalid(
            "response_format.type",
            &format!("`{other}` is not supported: it {kinds}"),
        )),
        None | Some(Value::Null) => Err(invalid(
            "response_format.type",
            &format!("is required: it {kinds}"),
        )),
        Some(_) => Err(invalid("response_format.type", kinds)),
    }
}

/// `response_format: {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`;
/// `strict` defaults to false (unsupported schema keywords are then ignored, not refused).
fn json_schema_format(rf: &Map<String, Value>) -> Result<Requested, ApiError> {
    let field = "response_format.json_schema";
    let js = match rf.get("json_schema") {
        Some(Value::Object(o)) => o,
        None | Some(Value::Null) => {
            return Err(invalid(
                field,
                "is required when `response_format.type` is `json_schema`",
            ));
        }
        Some(_) => {
            return Err(invalid(
                field,
                "must be an object {\"name\", \"schema\", \"strict\"}",
            ));
        }
    };
    for key in ["name", "description"] {
        if js.get(key).is_some_and(|v| !v.is_string() && !v.is_null()) {
            return Err(invalid(&format!("{field}.{key}"), "must be a string"));
        }
    }
    let strict = match js.get("strict") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(s)) => *s,
        Some(_) => {
            return Err(invalid(&format!("{field}.strict"), "must be true or false"));
        }
    };
    let schema_field = format!("{field}.schema");
    let schema = match js.get("schema") {
        Some(s @ (Value::Object(_) | Value::Bool(_))) => s.clone(),
        None | Some(Value::Null) => {
            return Err(invalid(
                &schema_field,
                "is required: the JSON schema the answer must follow",
            ));
        }
        Some(_) => return Err(invalid(&schema_field, "must be a JSON schema (an object)")),
    };
    Ok(Requested {
        spec: GrammarSpec::JsonSchema { schema, strict },
        field: schema_field,
    })
}

/// A JSON schema given as an object, `true`/`false`, or a string holding one (vLLM accepts
/// either); compiled leniently (unsupported keywords ignored), as vLLM does.
fn json_schema(v: &Value, field: &str) -> Result<Requested, ApiError> {
    let schema = match v {
        Value::Object(_) | Value::Bool(_) => v.clone(),
        Value::String(s) => match serde_json::from_str::<Value>(s) {
            Ok(parsed @ (Value::Object(_) | Value::Bool(_))) => parsed,
            Ok(_) => return Err(invalid(field, "must hold a JSON schema (an object)")),
            Err(e) => {
                return Err(invalid(
                    field,
                    &format!("is a string that is not JSON: {e}"),
                ));
            }
        },
        _ => return Err(invalid(field, "must be a JSON schema (an object)")),
    };
    Ok(Requested {
        spec: GrammarSpec::JsonSchema {
            schema,
            strict: false,
        },
        field: field.into(),
    })
}

fn regex(rx: &str, field: &str) -> Requested {
    Requested {
        spec: GrammarSpec::Regex(rx.into()),
        field: field.into(),
    }
}

fn lark_grammar(lark: &str, field: &str) -> Requested {
    Requested {
        spec: GrammarSpec::Lark(lark.into()),
        field: field.into(),
    }
}

/// One of a list of strings, as a Lark grammar of literal alternatives.
fn choice(v: &Value, field: &str) -> Result<Requested, ApiError> {
    let list = v
        .as_array()
        .filter(|a| !a.is_empty())
        .ok_or_else(|| invalid(field, "must be a non-empty array of strings"))?;
    let mut alternatives = Vec::with_capacity(list.len());
    for (i, c) in list.iter().enumerate() {
        let text = c
            .as_str()
            .filter(|s| !s.is_empty())
            .ok_or_else(|| invalid(&format!("{field}[{i}]"), "must be a non-empty string"))?;
        alternatives.push(lark_literal(text));
    }
    Ok(Requested {
        spec: GrammarSpec::Lark(format!("start: {}\n", alternatives.join(" | "))),
        field: field.into(),
    })
}

/// A Lark string literal: JSON string syntax, with DEL escaped too (Lark refuses it raw).
fn lark_literal(text: &str) -> String {
    Value::String(text.into())
        .to_string()
        .replace('\x7f', "\\u007f")
}

/// vLLM's `structured_outputs` object: exactly one of its grammar keys.
fn structured_outputs(o: &Map<String, Value>) -> Result<Option<Requested>, ApiError> {
    let mut found = Vec::new();
    for (key, v) in o {
        if v.is_null() {
            continue;
        }
        let field = format!("structured_outputs.{key}");
        let r = match key.as_str() {
            "json" => json_schema(v, &field)?,
            "regex" | "grammar" => {
                let text = v
                    .as_str()
                    .ok_or_else(|| invalid(&field, "must be a string"))?;
                if key == "regex" {
                    regex(text, &field)
                } else {
                    lark_grammar(text, &field)
                }
            }
            "choice" => choice(v, &field)?,
            "json_object" => match v {
                Value::Bool(true) => Requested {
                    spec: GrammarSpec::JsonObject,
                    field,
                },
                Value::Bool(false) => continue,
                _ => return Err(invalid(&field, "must be true or false")),
            },
            _ => {
                return Err(invalid(
                    &field,
                    "is not supported (supported: json, regex, grammar, choice, json_object)",
                ));
            }
        };
        found.push(r);
    }
    only_one(found)
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn req(v: Value) -> Result<Option<Requested>, ApiError> {
        requested(&Body::new(&v).unwrap())
    }

    fn spec(v: Value) -> (GrammarSpec, String) {
        let r = req(v.clone())
            .unwrap()
            .unwrap_or_else(|| panic!("{v}: no grammar"));
        (r.spec, r.field)
    }

    #[test]
    fn openai_response_formats() {
        assert_eq!(req(json!({})).unwrap(), None);
        assert_eq!(
            req(json!({"response_format": {"type": "text"}})).unwrap(),
            None
        );
        assert_eq!(req(json!({"response_format": null})).unwrap(), None);
        assert_eq!(
            spec(json!({"response_format": {"type": "json_object"}})),
            (GrammarSpec::JsonObject, "response_format".into())
        );
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        assert_eq!(
            spec(json!({"response_format": {"type": "json_schema",
                "json_schema": {"name": "x", "schema": schema, "strict": true}}})),
            (
                GrammarSpec::JsonSchema {
                    schema: schema.clone(),
                    strict: true
                },
                "response_format.json_schema.schema".into()
            )
        );
        assert_eq!(
            spec(json!({"response_format": {"type": "json_schema", "json_schema": {"schema": schema}}})).0,
            GrammarSpec::JsonSchema {
                schema,
                strict: false
            },
            "strict defaults to false and name is optional"
        );
    }

    #[test]
    fn vllm_fields() {
        let schema = json!({"type": "string"});
        let lenient = GrammarSpec::JsonSchema {
            schema: schema.clone(),
            strict: false,
        };
        assert_eq!(
            spec(json!({"guided_json": schema})),
            (lenient.clone(), "guided_json".into())
        );
        assert_eq!(
            spec(json!({"guided_json": "{\"type\": \"string\"}"})).0,
            lenient,
            "a schema in a string"
        );
        assert_eq!(
            spec(json!({"guided_regex": "[a-z]+"})),
            (GrammarSpec::Regex("[a-z]+".into()), "guided_regex".into())
        );
        assert_eq!(
            spec(json!({"guided_grammar": "start: \"a\""})),
            (
                GrammarSpec::Lark("start: \"a\"".into()),
                "guided_grammar".into()
            )
        );
        assert_eq!(
            spec(json!({"guided_choice": ["yes", "no \"way\"", "a\u{7f}"]})).0,
            GrammarSpec::Lark("start: \"yes\" | \"no \\\"way\\\"\" | \"a\\u007f\"\n".into())
        );
        assert_eq!(
            spec(json!({"structured_outputs": {"regex": "\\d+"}})),
            (
                GrammarSpec::Regex("\\d+".into()),
                "structured_outputs.regex".into()
            )
        );
        assert_eq!(
            spec(json!({"structured_outputs": {"json": schema}})).1,
            "structured_outputs.json"
        );
        assert_eq!(
            spec(json!({"structured_outputs": {"json_object": true}})).0,
            GrammarSpec::JsonObject
        );
        assert_eq!(
            spec(json!({"structured_outputs": {"choice": ["a"], "regex": null}})).0,
            GrammarSpec::Lark("start: \"a\"\n".into())
        );
        assert_eq!(
            req(json!({"structured_outputs": {"json_object": false}})).unwrap(),
            None
        );
    }

    #[test]
    fn bad_requests_name_the_field() {
        let cases = [
            (json!({"response_format": "json"}), "response_format"),
            (json!({"response_format": {}}), "response_format.type"),
            (
                json!({"response_format": {"type": "yaml"}}),
                "response_format.type",
            ),
            (
                json!({"response_format": {"type": 3}}),
                "response_format.type",
            ),
            (
                json!({"response_format": {"type": "json_schema"}}),
                "response_format.json_schema",
            ),
            (
                json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}),
                "response_format.json_schema.schema",
            ),
            (
                json!({"response_format": {"type": "json_schema", "json_schema": {"schema": "{}"}}}),
                "response_format.json_schema.schema",
            ),
            (
                json!({"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}}),
                "response_format.json_schema.strict",
            ),
            (
                json!({"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "name": 5}}}),
                "response_format.json_schema.name",
            ),
            (json!({"guided_json": 5}), "guided_json"),
            (json!({"guided_json": "{not json"}), "guided_json"),
            (json!({"guided_regex": ["a"]}), "guided_regex"),
            (json!({"guided_grammar": 1}), "guided_grammar"),
            (json!({"guided_choice": []}), "guided_choice"),
            (json!({"guided_choice": ["a", 2]}), "guided_choice[1]"),
            (json!({"structured_outputs": "json"}), "structured_outputs"),
            (
                json!({"structured_outputs": {"structural_tag": {}}}),
                "structured_outputs.structural_tag",
            ),
            (
                json!({"structured_outputs": {"regex": 1}}),
                "structured_outputs.regex",
            ),
            (
                json!({"structured_outputs": {"regex": "a", "grammar": "start: \"a\""}}),
                "structured_outputs.grammar",
            ),
            (
                json!({"response_format": {"type": "json_object"}, "guided_regex": "a"}),
                "guided_regex",
            ),
        ];
        for (v, field) in cases {
            let e = req(v.clone()).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(field), "{v}: {}", e.message);
            assert!(
                e.message.contains(field.split('[').next().unwrap()),
                "{v}: {}",
                e.message
            );
        }
    }
}
