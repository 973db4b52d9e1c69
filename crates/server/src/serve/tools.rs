// SPDX-License-Identifier: MIT OR Apache-2.0
//! Tools on the request side: definitions and `tool_choice` in both APIs' shapes, checked with
//! errors that name the entry and the field, and the tool parts of a conversation in the shape
//! chat templates expect.
//!
//! Templates are written against `transformers`' conventions: tool definitions in OpenAI's
//! `{"type": "function", "function": {name, description, parameters}}` shape, and a past call's
//! `arguments` as a JSON object (transformers' documentation; Qwen3's template also accepts a
//! string, Llama 3.1's and others' `tojson` it and would double-encode one). So Anthropic tools
//! are rewritten into OpenAI's shape, and OpenAI's string `arguments` are parsed into objects.

use serde_json::{Map, Value, json};

use super::error::ApiError;
use super::params::Body;
use super::state::AppState;
use metrale_toolcall::Format;

/// What the request allows the model to do with its tools.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ToolChoice {
    /// The model decides (OpenAI `auto`, Anthropic `auto`; the default).
    Auto,
    /// No calls: the answer is not parsed for them (OpenAI `none`, Anthropic `none`).
    None,
    /// Some call (OpenAI `required`, Anthropic `any`).
    Required,
    /// This function (OpenAI `{"type": "function", ...}`, Anthropic `{"type": "tool", ...}`).
    Named(String),
}

/// The tools a request offers, in OpenAI's shape, and its choice.
#[derive(Clone, Debug)]
pub struct Tools {
    /// Definitions as templates take them (`{"type": "function", "function": {...}}`).
    pub defs: Vec<Value>,
    /// What the model may do with them.
    pub choice: ToolChoice,
    /// At most one call per answer (OpenAI `parallel_tool_calls: false`, Anthropic
    /// `tool_choice.disable_parallel_tool_use: true`): enforced when a call is demanded and
    /// constrained.
    pub single_call: bool,
}

impl Tools {
    /// Whether the request offers any tool (what `--tool-max-tokens` keys on).
    pub fn offered(&self) -> bool {
        !self.defs.is_empty()
    }

    /// The definitions for the chat template (`None`: the template sees `tools = None`).
    pub fn for_template(&self) -> Option<Vec<Value>> {
        self.offered().then(|| self.defs.clone())
    }

    /// The wire format to parse the answer with: none when no tool is offered or calls are
    /// turned off, else the server's parser. A request that demands a call from a server with
    /// no parser is refused, since the call could never be recognised. (Whether the demanded
    /// call is also enforced by a grammar is [`super::constraint`]'s decision.)
    pub fn parser(&self, state: &AppState, field: &str) -> Result<Option<Format>, ApiError> {
        if !self.offered() || self.choice == ToolChoice::None {
            return Ok(None);
        }
        match (state.tool_parser, &self.choice) {
            (None, ToolChoice::Required | ToolChoice::Named(_)) => Err(ApiError::invalid(
                field,
                format!(
                    "`{field}` demands a tool call, but this server has no tool-call parser for its model; start it with --tool-call-parser"
                ),
            )),
            (parser, _) => Ok(parser),
        }
    }

    fn names(&self) -> Vec<&str> {
        self.defs
            .iter()
            .filter_map(|d| d["function"]["name"].as_str())
            .collect()
    }

    /// Checks that a named choice names an offered tool, and that a choice demanding a call
    /// comes with tools.
    fn check_choice(&self, field: &str) -> Result<(), ApiError> {
        let names = self.names();
        match &self.choice {
            ToolChoice::Required | ToolChoice::Named(_) if names.is_empty() => {
                Err(ApiError::invalid(
                    field,
                    format!("`{field}` demands a tool call, but the request offers no `tools`"),
                ))
            }
            ToolChoice::Named(name) if !names.contains(&name.as_str()) => Err(ApiError::invalid(
                field,
                format!(
                    "`{field}` names the function `{name}`, which is not in `tools` (offered: {})",
                    names.join(", ")
                ),
            )),
            _ => Ok(()),
        }
    }
}

fn invalid(field: &str, what: &str) -> ApiError {
    ApiError::invalid(field, format!("`{field}` {what}"))
}

/// An optional string field of `obj`; `field` is its path in the request.
fn opt_str<'a>(
    obj: &'a Map<String, Value>,
    key: &str,
    field: &str,
) -> Result<Option<&'a str>, ApiError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(_) => Err(invalid(&format!("{field}.{key}"), "must be a string")),
    }
}

/// A function name: a non-empty string without whitespace.
fn function_name(obj: &Map<String, Value>, key: &str, field: &str) -> Result<String, ApiError> {
    let field = format!("{field}.{key}");
    match obj.get(key) {
        Some(Value::String(s)) if !s.is_empty() && !s.chars().any(char::is_whitespace) => {
            Ok(s.clone())
        }
        Some(Value::String(_)) => Err(invalid(&field, "must be a non-empty name without spaces")),
        None | Some(Value::Null) => Err(invalid(&field, "is required")),
        Some(_) => Err(invalid(&field, "must be a string")),
    }
}

/// An optional JSON-schema field: an object.
fn opt_schema(obj: &Map<String, Value>, key: &str, field: &str) -> Result<Option<Value>, ApiError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v @ Value::Object(_)) => Ok(Some(v.clone())),
        Some(_) => Err(invalid(
            &format!("{field}.{key}"),
            "must be a JSON schema object",
        )),
    }
}

/// Refuses two tools of one name.
fn check_unique(defs: &[Value], field: &str, name_path: &str) -> Result<(), ApiError> {
    for (i, d) in defs.iter().enumerate() {
        let name = d["function"]["name"].as_str().unwrap_or_default();
        if let Some(j) = defs[..i]
            .iter()
            .position(|e| e["function"]["name"].as_str() == Some(name))
        {
            return Err(invalid(
                &format!("{field}[{i}].{name_path}"),
                &format!("repeats the name `{name}` of `{field}[{j}]`"),
            ));
        }
    }
    Ok(())
}

/// OpenAI's `tools` and `tool_choice`.
pub fn openai_tools(b: &Body) -> Result<Tools, ApiError> {
    let mut defs = Vec::new();
    for (i, tool) in b.array("tools")?.into_iter().flatten().enumerate() {
        let field = format!("tools[{i}]");
        let obj = tool.as_object().ok_or_else(|| {
            invalid(
                &field,
                "must be an object {\"type\": \"function\", \"function\": {...}}",
            )
        })?;
        match opt_str(obj, "type", &field)? {
            None | Some("function") => {}
            Some(other) => {
                return Err(invalid(
                    &format!("{field}.type"),
                    &format!("is `{other}`; only `function` tools are supported"),
                ));
            }
        }
        let ffield = format!("{field}.function");
        let f = match obj.get("function") {
            Some(Value::Object(f)) => f,
            None | Some(Value::Null) => return Err(invalid(&ffield, "is required")),
            Some(_) => return Err(invalid(&ffield, "must be an object")),
        };
        let name = function_name(f, "name", &ffield)?;
        let description = opt_str(f, "description", &ffield)?;
        let parameters = opt_schema(f, "parameters", &ffield)?;
        if f.get("strict")
            .is_some_and(|s| !s.is_boolean() && !s.is_null())
        {
            return Err(invalid(
                &format!("{ffield}.strict"),
                "must be true or false",
            ));
        }
        let mut function = json!({"name": name});
        if let Some(d) = description {
            function["description"] = d.into();
        }
        if let Some(p) = parameters {
            function["parameters"] = p;
        }
        defs.push(json!({"type": "function", "function": function}));
    }
    check_unique(&defs, "tools", "function.name")?;
    let choice = match b.get("tool_choice") {
        None => ToolChoice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "auto" => ToolChoice::Auto,
            "none" => ToolChoice::None,
            "required" => ToolChoice::Required,
            other => {
                return Err(invalid(
                    "tool_choice",
                    &format!(
                        "`{other}` is not one of auto, none, required, or {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}"
                    ),
                ));
            }
        },
        Some(Value::Object(o)) => {
            match opt_str(o, "type", "tool_choice")? {
                Some("function") => {}
                _ => {
                    return Err(invalid(
                        "tool_choice.type",
                        "must be `function` (other tool_choice objects are not supported)",
                    ));
                }
            }
            let f = o
                .get("function")
                .and_then(Value::as_object)
                .ok_or_else(|| invalid("tool_choice.function", "must be an object with `name`"))?;
            ToolChoice::Named(function_name(f, "name", "tool_choice.function")?)
        }
        Some(_) => {
            return Err(invalid(
                "tool_choice",
                "must be auto, none, required, or {\"type\": \"function\", \"function\": {\"name\": ...}}",
            ));
        }
    };
    let single_call = b.bool("parallel_tool_calls")? == Some(false);
    let tools = Tools {
        defs,
        choice,
        single_call,
    };
    tools.check_choice("tool_choice")?;
    Ok(tools)
}

/// Anthropic's `tools` (custom tools: name, description, input_schema) and `tool_choice`
/// (`{"type": "auto" | "any" | "tool" | "none"}`), rewritten into OpenAI's shape.
pub fn anthropic_tools(b: &Body) -> Result<Tools, ApiError> {
    let mut defs = Vec::new();
    for (i, tool) in b.array("tools")?.into_iter().flatten().enumerate() {
        let field = format!("tools[{i}]");
        let obj = tool.as_object().ok_or_else(|| {
            invalid(
                &field,
                "must be an object {\"name\", \"description\", \"input_schema\"}",
            )
        })?;
        match opt_str(obj, "type", &field)? {
            None | Some("custom") => {}
            Some(other) => {
                return Err(invalid(
                    &format!("{field}.type"),
                    &format!(
                        "is `{other}`; only custom tools (name, description, input_schema) are supported"
                    ),
                ));
            }
        }
        let name = function_name(obj, "name", &field)?;
        let description = opt_str(obj, "description", &field)?;
        let schema = opt_schema(obj, "input_schema", &field)?
            .ok_or_else(|| invalid(&format!("{field}.input_schema"), "is required"))?;
        let mut function = json!({"name": name});
        if let Some(d) = description {
            function["description"] = d.into();
        }
        function["parameters"] = schema;
        defs.push(json!({"type": "function", "function": function}));
    }
    check_unique(&defs, "tools", "name")?;
    let tool_choice = b.object("tool_choice")?;
    let single_call = tool_choice
        .and_then(|o| o.get("disable_parallel_tool_use"))
        .and_then(Value::as_bool)
        == Some(true);
    let choice = match tool_choice {
        None => ToolChoice::Auto,
        Some(o) => {
            if o.get("disable_parallel_tool_use")
                .is_some_and(|v| !v.is_boolean() && !v.is_null())
            {
                return Err(invalid(
                    "tool_choice.disable_parallel_tool_use",
                    "must be true or false",
                ));
            }
            match opt_str(o, "type", "tool_choice")? {
                Some("auto") => ToolChoice::Auto,
                Some("none") => ToolChoice::None,
                Some("any") => ToolChoice::Required,
                Some("tool") => ToolChoice::Named(function_name(o, "name", "tool_choice")?),
                _ => {
                    return Err(invalid(
                        "tool_choice.type",
                        "must be one of auto, any, tool, none",
                    ));
                }
            }
        }
    };
    let tools = Tools {
        defs,
        choice,
        single_call,
    };
    tools.check_choice("tool_choice")?;
    Ok(tools)
}

/// A past call's arguments for the template: a JSON string becomes the value it encodes; text
/// that is not JSON stays a string (Qwen3-style templates print it as given).
fn template_arguments(arguments: &Value) -> Value {
    match arguments {
        Value::String(s) => serde_json::from_str(s).unwrap_or_else(|_| arguments.clone()),
        other => other.clone(),
    }
}

/// An OpenAI assistant message's `tool_calls`, checked, with each call's `arguments` as an
/// object for the template.
pub fn openai_tool_calls(calls: &Value, field: &str) -> Result<Value, ApiError> {
    let list = calls
        .as_array()
        .ok_or_else(|| invalid(field, "must be an array of tool calls"))?;
    let mut out = Vec::with_capacity(list.len());
    for (k, call) in list.iter().enumerate() {
        let cfield = format!("{field}[{k}]");
        let obj = call.as_object().ok_or_else(|| {
            invalid(
                &cfield,
                "must be an object {\"id\", \"type\", \"function\"}",
            )
        })?;
        opt_str(obj, "id", &cfield)?;
        match opt_str(obj, "type", &cfield)? {
            None | Some("function") => {}
            Some(other) => {
                return Err(invalid(
                    &format!("{cfield}.type"),
                    &format!("is `{other}`; only `function` calls are supported"),
                ));
            }
        }
        let ffield = format!("{cfield}.function");
        let f = obj
            .get("function")
            .and_then(Value::as_object)
            .ok_or_else(|| invalid(&ffield, "must be an object {\"name\", \"arguments\"}"))?;
        function_name(f, "name", &ffield)?;
        let arguments = match f.get("arguments") {
            None | Some(Value::Null) => json!({}),
            Some(a @ (Value::String(_) | Value::Object(_))) => template_arguments(a),
            Some(_) => {
                return Err(invalid(
                    &format!("{ffield}.arguments"),
                    "must be a JSON string (or an object)",
                ));
            }
        };
        let mut call = obj.clone();
        let mut function = f.clone();
        function.insert("arguments".into(), arguments);
        call.insert("function".into(), Value::Object(function));
        call.entry("type").or_insert_with(|| "function".into());
        out.push(Value::Object(call));
    }
    Ok(Value::Array(out))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(v: &Value) -> Body<'_> {
        Body::new(v).unwrap()
    }

    fn weather() -> Value {
        json!({"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}})
    }

    #[test]
    fn openai_tools_and_choice() {
        let v = json!({"tools": [weather()], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}});
        let t = openai_tools(&body(&v)).unwrap();
        assert_eq!(t.choice, ToolChoice::Named("get_weather".into()));
        assert_eq!(t.defs, vec![weather()]);
        let v = json!({"tool_choice": "none"});
        let t = openai_tools(&body(&v)).unwrap();
        assert!(!t.offered());
        assert_eq!(t.choice, ToolChoice::None);
    }

    #[test]
    fn bad_tools_name_the_entry_and_field() {
        let cases = [
            (json!({"tools": [weather(), 3]}), "tools[1]"),
            (
                json!({"tools": [weather(), {"type": "function"}]}),
                "tools[1].function",
            ),
            (
                json!({"tools": [{"type": "function", "function": {}}]}),
                "tools[0].function.name",
            ),
            (
                json!({"tools": [{"type": "function", "function": {"name": 7}}]}),
                "tools[0].function.name",
            ),
            (
                json!({"tools": [{"type": "retrieval", "function": {"name": "x"}}]}),
                "tools[0].type",
            ),
            (
                json!({"tools": [{"function": {"name": "x", "parameters": "{}"}}]}),
                "tools[0].function.parameters",
            ),
            (
                json!({"tools": [weather(), weather()]}),
                "tools[1].function.name",
            ),
            (
                json!({"tools": [weather()], "tool_choice": {"type": "function", "function": {"name": "nope"}}}),
                "tool_choice",
            ),
            (json!({"tool_choice": "required"}), "tool_choice"),
            (
                json!({"tools": [weather()], "tool_choice": "sometimes"}),
                "tool_choice",
            ),
        ];
        for (v, field) in cases {
            let e = openai_tools(&body(&v)).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(field), "{v}: {}", e.message);
            assert!(e.message.contains(field), "{v}: {}", e.message);
        }
        let v = json!({"tools": [weather()], "tool_choice": {"type": "function", "function": {"name": "nope"}}});
        let e = openai_tools(&body(&v)).unwrap_err();
        assert!(
            e.message.contains("`nope`") && e.message.contains("get_weather"),
            "{}",
            e.message
        );
    }

    #[test]
    fn anthropic_tools_become_openai_functions() {
        let v = json!({"tools": [{"name": "get_weather", "description": "Weather", "input_schema": {"type": "object"}}],
                       "tool_choice": {"type": "any"}});
        let t = anthropic_tools(&body(&v)).unwrap();
        assert_eq!(t.choice, ToolChoice::Required);
        assert_eq!(
            t.defs,
            vec![
                json!({"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": {"type": "object"}}})
            ]
        );
        let cases = [
            (json!({"tools": [{"name": "x"}]}), "tools[0].input_schema"),
            (
                json!({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}),
                "tools[0].type",
            ),
            (json!({"tools": [{"input_schema": {}}]}), "tools[0].name"),
            (
                json!({"tools": [{"name": "x", "input_schema": {}}], "tool_choice": {"type": "tool", "name": "y"}}),
                "tool_choice",
            ),
            (
                json!({"tools": [{"name": "x", "input_schema": {}}], "tool_choice": {"type": "maybe"}}),
                "tool_choice.type",
            ),
        ];
        for (v, field) in cases {
            let e = anthropic_tools(&body(&v)).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(field), "{v}: {}", e.message);
        }
    }

    #[test]
    fn past_call_arguments_become_objects() {
        let calls = json!([{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}},
                           {"id": "call_2", "function": {"name": "g", "arguments": "not json"}}]);
        let out = openai_tool_calls(&calls, "messages[1].tool_calls").unwrap();
        assert_eq!(out[0]["function"]["arguments"], json!({"a": 1}));
        assert_eq!(out[1]["function"]["arguments"], "not json");
        assert_eq!(out[1]["type"], "function");
        let e = openai_tool_calls(
            &json!([{"function": {"arguments": "{}"}}]),
            "messages[1].tool_calls",
        )
        .unwrap_err();
        assert_eq!(
            e.param.as_deref(),
            Some("messages[1].tool_calls[0].function.name")
        );
    }
}
