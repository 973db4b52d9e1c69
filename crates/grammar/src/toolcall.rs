// SPDX-License-Identifier: MIT OR Apache-2.0
//! Tool calls as a grammar, written in the wire format the model was trained on.
//!
//! Each wire is lowered to a Lark grammar whose sentences `metrale-toolcall` parses back to the
//! calls they spell: the tool's name is a fixed string, its arguments an embedded `%json` schema
//! (one per tool, so each tool's `$defs` stay its own). Markers (`<tool_call>`, `[TOOL_CALLS]`)
//! are the vocabulary's special token when it has one by that name, and plain text otherwise
//! (Qwen's `<tool_call>` is an ordinary added token: text the grammar forces, allowed as the
//! tokenizer spells it, which is that one token).
//!
//! The qwen3_coder/qwen3_xml wire, whose values are raw text, has its own module (`xml`).

use std::fmt::Write as _;
use std::str::FromStr;

use serde_json::{Map, Value, json};

use crate::GrammarError;
use crate::spec::with_json_options;

mod xml;

/// A tool-call wire format, as `metrale-toolcall` parses it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ToolWire {
    /// `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, calls separated by `\n`.
    Hermes,
    /// `<tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n</function>\n</tool_call>`
    /// (the qwen3_coder and qwen3_xml parsers).
    Qwen3Xml,
    /// `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`.
    Mistral,
    /// `{"name": ..., "parameters": {...}}`, calls separated by `; `.
    Llama3Json,
    /// A bare call object, or a JSON list of them.
    BareJson,
}

impl ToolWire {
    /// Every wire.
    pub const ALL: [ToolWire; 5] = [
        ToolWire::Hermes,
        ToolWire::Qwen3Xml,
        ToolWire::Mistral,
        ToolWire::Llama3Json,
        ToolWire::BareJson,
    ];

    /// The tool-call parser name for the wire (`qwen3_coder` parses the same wire as `qwen3_xml`).
    pub fn name(self) -> &'static str {
        match self {
            ToolWire::Hermes => "hermes",
            ToolWire::Qwen3Xml => "qwen3_xml",
            ToolWire::Mistral => "mistral",
            ToolWire::Llama3Json => "llama3_json",
            ToolWire::BareJson => "bare_json",
        }
    }
}

impl FromStr for ToolWire {
    type Err = GrammarError;

    /// A tool-call parser name (`hermes`, `qwen3_coder`, `qwen3_xml`, `mistral`, `llama3_json`,
    /// `bare_json`) to its wire.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "qwen3_coder" => Ok(ToolWire::Qwen3Xml),
            _ => ToolWire::ALL
                .into_iter()
                .find(|w| w.name() == s)
                .ok_or_else(|| {
                    GrammarError::Tools(format!(
                        "unknown tool-call format `{s}`; known: hermes, qwen3_coder, qwen3_xml, \
                         mistral, llama3_json, bare_json"
                    ))
                }),
        }
    }
}

/// One tool the model may call.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolSpec {
    /// The function's name, written verbatim in the call.
    pub name: String,
    /// The JSON schema of its arguments; `null` means it takes none (`{}` is then the only
    /// argument object).
    pub parameters: Value,
}

/// Which calls the output must make.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolChoiceMode {
    /// One or more calls, each of any offered tool (`tool_choice: "required"`).
    Required,
    /// Exactly one call, of any offered tool (`tool_choice: "required"` with
    /// `parallel_tool_calls: false`).
    RequiredOne,
    /// Exactly one call, of the tool with this name (`tool_choice: {"function": {"name": ...}}`).
    Named(String),
}

/// A validated tool-call request, lowered to Lark when the engine compiles it.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCallGrammar {
    wire: ToolWire,
    tools: Vec<ToolSpec>,
    choice: ToolChoiceMode,
}

impl ToolCallGrammar {
    pub(crate) fn new(
        wire: ToolWire,
        tools: &[ToolSpec],
        choice: ToolChoiceMode,
    ) -> Result<Self, GrammarError> {
        if tools.is_empty() {
            return Err(GrammarError::Tools("no tools were offered".into()));
        }
        for (i, tool) in tools.iter().enumerate() {
            if tool.name.is_empty() || tool.name.trim() != tool.name {
                return Err(GrammarError::Tools(format!(
                    "tool {i} has the name {:?}: a name must be non-empty, without surrounding \
                     whitespace",
                    tool.name
                )));
            }
            if wire == ToolWire::Qwen3Xml && !xml::is_xml_name(&tool.name) {
                return Err(GrammarError::Tools(format!(
                    "tool name {:?} cannot be written in the {} format (no whitespace, `<` or `>`)",
                    tool.name,
                    wire.name()
                )));
            }
            if tools[..i].iter().any(|t| t.name == tool.name) {
                return Err(GrammarError::Tools(format!(
                    "two tools are named `{}`",
                    tool.name
                )));
            }
        }
        if let ToolChoiceMode::Named(name) = &choice
            && !tools.iter().any(|t| &t.name == name)
        {
            return Err(GrammarError::Tools(format!(
                "tool_choice names `{name}`, which is not among the offered tools ({})",
                tools
                    .iter()
                    .map(|t| t.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        }
        Ok(ToolCallGrammar {
            wire,
            tools: tools.to_vec(),
            choice,
        })
    }

    pub(crate) fn cache_key(&self) -> String {
        let choice = match &self.choice {
            ToolChoiceMode::Required => "required".to_owned(),
            ToolChoiceMode::RequiredOne => "required_one".to_owned(),
            ToolChoiceMode::Named(n) => format!("named={n}"),
        };
        let tools: Vec<Value> = self
            .tools
            .iter()
            .map(|t| json!([t.name, t.parameters]))
            .collect();
        format!("{}:{}:{}", self.wire.name(), choice, Value::Array(tools))
    }

    /// The tools a call may name.
    fn callable(&self) -> Vec<&ToolSpec> {
        match &self.choice {
            ToolChoiceMode::Required | ToolChoiceMode::RequiredOne => self.tools.iter().collect(),
            ToolChoiceMode::Named(n) => self.tools.iter().filter(|t| &t.name == n).collect(),
        }
    }

    /// Each tool's schema compiled on its own, for an error that names the tool at fault.
    pub(crate) fn argument_schemas(&self) -> impl Iterator<Item = (&str, Value)> {
        self.callable()
            .into_iter()
            .map(|t| (t.name.as_str(), with_json_options(&parameters(t), true)))
    }

    /// The grammar as Lark. `special` gives the id of a special token spelled like a marker.
    pub(crate) fn to_lark(&self, special: impl Fn(&str) -> Option<u32>) -> String {
        let marker = |text: &str| match special(text) {
            Some(id) => format!("<[{id}]>"),
            None => lit(text),
        };
        let one = matches!(
            self.choice,
            ToolChoiceMode::Named(_) | ToolChoiceMode::RequiredOne
        );
        let mut g = String::new();
        match self.wire {
            ToolWire::Hermes | ToolWire::Qwen3Xml => {
                let (open, close) = (marker("<tool_call>"), marker("</tool_call>"));
                rule(&mut g, "start", if one { "tc" } else { r#"tc ("\n" tc)*"# });
                rule(&mut g, "tc", &format!(r#"{open} "\n" call "\n" {close}"#));
                if self.wire == ToolWire::Hermes {
                    self.json_calls(&mut g, "arguments");
                } else {
                    xml::calls(&mut g, &self.callable());
                }
            }
            ToolWire::Mistral => {
                let open = marker("[TOOL_CALLS]");
                let list = if one {
                    r#""[" call "]""#
                } else {
                    r#""[" call (", " call)* "]""#
                };
                rule(&mut g, "start", &format!("{open} {list}"));
                self.json_calls(&mut g, "arguments");
            }
            ToolWire::Llama3Json => {
                rule(
                    &mut g,
                    "start",
                    if one { "call" } else { r#"call ("; " call)*"# },
                );
                self.json_calls(&mut g, "parameters");
            }
            ToolWire::BareJson => {
                let start = if one {
                    "call"
                } else {
                    r#"call | "[" call (", " call)* "]""#
                };
                rule(&mut g, "start", start);
                self.json_calls(&mut g, "arguments");
            }
        }
        g
    }

    /// `call`: one `{"name": ..., ARGS_KEY: {...}}` object per callable tool.
    fn json_calls(&self, g: &mut String, args_key: &str) {
        let tools = self.callable();
        let alternatives: Vec<String> = (0..tools.len()).map(|i| format!("call_{i}")).collect();
        rule(g, "call", &alternatives.join(" | "));
        for (i, tool) in tools.iter().enumerate() {
            rule(
                g,
                &format!("call_{i}"),
                &json_rule(&call_schema(tool, args_key)),
            );
        }
    }
}

/// A tool's parameters schema; `null` (no parameters) allows only `{}`.
fn parameters(tool: &ToolSpec) -> Value {
    match &tool.parameters {
        Value::Null => json!({"type": "object", "properties": {}, "additionalProperties": false}),
        p => p.clone(),
    }
}

/// `{"name": NAME, ARGS_KEY: PARAMETERS}` with nothing else; the parameters' `$defs` and
/// `definitions` move to the root, where their `#/$defs/...` references point.
fn call_schema(tool: &ToolSpec, args_key: &str) -> Value {
    let mut params = parameters(tool);
    let mut root = Map::new();
    root.insert("type".into(), json!("object"));
    let mut defs = Map::new();
    if let Value::Object(p) = &mut params {
        for key in ["$defs", "definitions"] {
            if let Some(d) = p.remove(key) {
                defs.insert(key.to_owned(), d);
            }
        }
    }
    root.insert(
        "properties".into(),
        json!({ "name": { "const": tool.name }, args_key: params }),
    );
    root.insert("required".into(), json!(["name", args_key]));
    root.insert("additionalProperties".into(), json!(false));
    root.extend(defs);
    with_json_options(&Value::Object(root), true)
}

fn rule(g: &mut String, name: &str, body: &str) {
    let _ = writeln!(g, "{name}: {body}");
}

fn terminal(g: &mut String, name: &str, body: &str) {
    let _ = writeln!(g, "{name}: {body}");
}

fn json_rule(schema: &Value) -> String {
    format!("%json {schema}")
}

/// A Lark string literal (JSON string syntax; DEL escaped, which Lark requires).
fn lit(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 || c == '\x7f' => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn weather() -> ToolSpec {
        ToolSpec {
            name: "get_weather".into(),
            parameters: json!({
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 20},
                    "unit": {"enum": ["celsius", "fahrenheit"]},
                    "days": {"type": "integer"}
                },
                "required": ["city"]
            }),
        }
    }

    #[test]
    fn named_choice_must_be_offered() {
        let err = ToolCallGrammar::new(
            ToolWire::Hermes,
            &[weather()],
            ToolChoiceMode::Named("nope".into()),
        )
        .unwrap_err();
        assert!(err.to_string().contains("`nope`"), "{err}");
    }

    #[test]
    fn literals_escape_like_json() {
        assert_eq!(lit("a\"b\\c\n\x7f"), r#""a\"b\\c\n\u007f""#);
    }
}
