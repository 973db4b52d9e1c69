// SPDX-License-Identifier: MIT OR Apache-2.0
//! The qwen3_coder/qwen3_xml wire: `<function=NAME>` blocks of `<parameter=KEY>` values.
//!
//! Each parameter is written `<parameter=KEY>\nVALUE\n</parameter>`. A string parameter's value
//! is raw text, and the parser reads a value as JSON when it parses as JSON, so raw text is kept
//! from looking like JSON (a number, `true`, a quoted string, a bracketed value) and from
//! containing the tags that end it. Other values are JSON under the parameter's schema. A tool
//! whose parameters are not a plain object schema (combinators, pattern properties, keys the
//! tags cannot carry) is written as a JSON body inside `<tool_call>`, which the parser also
//! accepts.
//!
//! Known gap: a string inside a JSON value (an array or object parameter) may contain
//! `</parameter>`, which the parser would take as the value's end; llguidance cannot intersect
//! an embedded JSON grammar with a "does not contain" regex.

use serde_json::{Map, Value, json};

use super::{ToolSpec, call_schema, json_rule, lit, parameters, rule, terminal};
use crate::spec::with_json_options;

/// Text that ends a qwen3 XML value or region, so a raw value must not contain it.
const XML_STOPS: [&str; 4] = ["</parameter>", "<parameter=", "</function>", "</tool_call>"];

/// Schema keywords that describe but do not constrain.
const ANNOTATIONS: [&str; 5] = ["description", "title", "default", "examples", "$comment"];

/// `call`: one `<function=NAME>` block per tool, parameters in schema order.
pub(super) fn calls(g: &mut String, tools: &[&ToolSpec]) {
    let alternatives: Vec<String> = (0..tools.len()).map(|i| format!("fn_{i}")).collect();
    rule(g, "call", &alternatives.join(" | "));
    let mut text_terminal = false;
    for (i, tool) in tools.iter().enumerate() {
        let Some(params) = xml_params(&parameters(tool)) else {
            rule(
                g,
                &format!("fn_{i}"),
                &json_rule(&call_schema(tool, "arguments")),
            );
            continue;
        };
        let mut body = vec![lit(&format!("<function={}>\n", tool.name))];
        for (j, p) in params.iter().enumerate() {
            let name = format!("xp_{i}_{j}");
            let open = lit(&format!("<parameter={}>\n", p.key));
            let close = lit("\n</parameter>\n");
            let value = match &p.value {
                XmlValue::Text { min, max } => {
                    text_terminal = true;
                    let len = match max {
                        Some(max) => format!("{{{min},{max}}}"),
                        None => format!("{{{min},}}"),
                    };
                    terminal(
                        g,
                        &format!("XT_{i}_{j}"),
                        &format!("/(?s:.{len})/ & XML_TEXT"),
                    );
                    terminal(g, &format!("XV_{i}_{j}"), &format!("XT_{i}_{j} {close}"));
                    format!("XV_{i}_{j}")
                }
                XmlValue::Choice(values) => {
                    let values: Vec<String> = values.iter().map(|v| lit(v)).collect();
                    format!("({}) {close}", values.join(" | "))
                }
                XmlValue::Json(schema) => {
                    rule(g, &format!("xj_{i}_{j}"), &json_rule(schema));
                    format!("xj_{i}_{j} {close}")
                }
            };
            rule(g, &name, &format!("{open} {value}"));
            body.push(if p.required { name } else { format!("{name}?") });
        }
        body.push(lit("</function>"));
        rule(g, &format!("fn_{i}"), &body.join(" "));
    }
    if text_terminal {
        // Raw text that neither ends the value early nor reads back as JSON.
        let stops: Vec<String> = XML_STOPS.iter().map(|s| s.replace('/', r"\/")).collect();
        terminal(
            g,
            "XML_TEXT",
            &format!(
                r#"~/(?s:.*)({})(?s:.*)/ & ~/\s*([\[{{](?s:.*)[\]}}]|"([^"\\\x00-\x1f]|\\(["\\\/bfnrt]|u[0-9a-fA-F]{{4}}))*"|-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?|true|false|null)\s*/"#,
                stops.join("|")
            ),
        );
    }
}

/// One parameter of the XML wire.
struct XmlParam {
    key: String,
    required: bool,
    value: XmlValue,
}

enum XmlValue {
    /// Raw text of `min..=max` characters (a plain string schema).
    Text { min: u64, max: Option<u64> },
    /// One of these raw texts (a string `enum` or `const` none of whose values reads as JSON).
    Choice(Vec<String>),
    /// JSON under this schema (options and the tool's definitions included).
    Json(Value),
}

/// The parameters of a plain object schema, in schema order; `None` when the XML wire cannot
/// express the schema faithfully.
fn xml_params(schema: &Value) -> Option<Vec<XmlParam>> {
    const OBJECT_KEYWORDS: [&str; 8] = [
        "type",
        "properties",
        "required",
        "additionalProperties",
        "$defs",
        "definitions",
        "$schema",
        "$id",
    ];
    let Value::Object(object) = schema else {
        return None;
    };
    let plain = object
        .keys()
        .all(|k| OBJECT_KEYWORDS.contains(&k.as_str()) || ANNOTATIONS.contains(&k.as_str()));
    if !plain || object.get("type").is_some_and(|t| t != "object") {
        return None;
    }
    let defs: Map<String, Value> = ["$defs", "definitions"]
        .into_iter()
        .filter_map(|k| Some((k.to_owned(), object.get(k)?.clone())))
        .collect();
    let no_properties = Map::new();
    let properties = match object.get("properties") {
        None => &no_properties,
        Some(Value::Object(p)) => p,
        Some(_) => return None,
    };
    let required: Vec<&str> = match object.get("required") {
        None => Vec::new(),
        Some(Value::Array(names)) => names.iter().map(Value::as_str).collect::<Option<_>>()?,
        Some(_) => return None,
    };
    let mut params = Vec::new();
    for (key, schema) in properties {
        params.push(XmlParam {
            key: key.clone(),
            required: required.contains(&key.as_str()),
            value: xml_value(schema, &defs)?,
        });
    }
    for key in required.iter().filter(|k| !properties.contains_key(**k)) {
        let schema = match object.get("additionalProperties") {
            None | Some(Value::Bool(true)) => json!({}),
            Some(Value::Bool(false)) => return None,
            Some(s) => s.clone(),
        };
        params.push(XmlParam {
            key: (*key).to_owned(),
            required: true,
            value: xml_value(&schema, &defs)?,
        });
    }
    params.iter().all(|p| is_xml_name(&p.key)).then_some(params)
}

fn xml_value(schema: &Value, defs: &Map<String, Value>) -> Option<XmlValue> {
    let object = match schema {
        Value::Object(o) => o,
        Value::Bool(true) => return Some(XmlValue::Json(with_json_options(schema, true))),
        _ => return None,
    };
    let only = |allowed: &[&str]| {
        object
            .keys()
            .all(|k| allowed.contains(&k.as_str()) || ANNOTATIONS.contains(&k.as_str()))
    };
    // An absent bound is `Ok(None)`; one that is not a count is `Err` (left to the JSON path).
    let bound = |key: &str| match object.get(key) {
        None => Ok(None),
        Some(v) => v.as_u64().map(Some).ok_or(()),
    };
    if object.get("type") == Some(&json!("string"))
        && only(&["type", "minLength", "maxLength"])
        && let (Ok(min), Ok(max)) = (bound("minLength"), bound("maxLength"))
    {
        return Some(XmlValue::Text {
            min: min.unwrap_or(0),
            max,
        });
    }
    let string_type = object.get("type").is_none_or(|t| t == "string");
    let values: Option<Vec<&str>> = match (object.get("enum"), object.get("const")) {
        (Some(Value::Array(vs)), None) => vs.iter().map(Value::as_str).collect(),
        (None, Some(Value::String(c))) => Some(vec![c.as_str()]),
        _ => None,
    };
    if string_type
        && only(&["type", "enum", "const"])
        && let Some(values) =
            values.filter(|vs| !vs.is_empty() && vs.iter().all(|v| is_raw_text(v)))
    {
        return Some(XmlValue::Choice(
            values.into_iter().map(str::to_owned).collect(),
        ));
    }
    let mut schema = object.clone();
    for (k, v) in defs {
        schema.entry(k.clone()).or_insert_with(|| v.clone());
    }
    Some(XmlValue::Json(with_json_options(
        &Value::Object(schema),
        true,
    )))
}

/// Whether `value` written raw reads back as itself: not empty, not JSON, no closing tags.
fn is_raw_text(value: &str) -> bool {
    !value.is_empty()
        && serde_json::from_str::<Value>(value.trim()).is_err()
        && !XML_STOPS.iter().any(|s| value.contains(s))
}

/// A function or parameter name the XML tags can carry (the parser trims it and cuts at `>`).
pub(super) fn is_xml_name(name: &str) -> bool {
    !name.is_empty() && !name.contains(|c: char| c.is_whitespace() || c == '<' || c == '>')
}

#[cfg(test)]
mod tests {
    use super::*;

    fn weather() -> Value {
        json!({
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer"}
            },
            "required": ["city"]
        })
    }

    #[test]
    fn xml_parameters_are_raw_text_enums_and_json() {
        let params = xml_params(&weather()).unwrap();
        assert_eq!(params.len(), 3);
        assert!(matches!(
            params[0].value,
            XmlValue::Text {
                min: 0,
                max: Some(20)
            }
        ));
        assert!(params[0].required && !params[1].required);
        assert!(matches!(&params[1].value, XmlValue::Choice(v) if v.len() == 2));
        assert!(matches!(params[2].value, XmlValue::Json(_)));
    }

    #[test]
    fn combinators_fall_back_to_a_json_body() {
        assert!(xml_params(&json!({"anyOf": [{"type": "object"}]})).is_none());
        assert!(xml_params(&json!({"type": "object", "properties": {"a b": {}}})).is_none());
    }

    #[test]
    fn raw_text_is_not_json() {
        assert!(is_raw_text("celsius"));
        assert!(!is_raw_text("12"));
        assert!(!is_raw_text(" true "));
        assert!(!is_raw_text("a</parameter>"));
    }
}
