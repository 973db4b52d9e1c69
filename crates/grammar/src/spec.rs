// SPDX-License-Identifier: MIT OR Apache-2.0
//! What a request asks the output to be.

use serde_json::{Value, json};

use crate::GrammarError;
use crate::toolcall::{ToolCallGrammar, ToolChoiceMode, ToolSpec, ToolWire};

/// JSON whitespace the JSON grammars allow between tokens: one run of blanks, or one line break
/// and its indentation. That admits compact and pretty-printed JSON alike but not the endless
/// whitespace a model can fall into when any amount is allowed (llguidance's default).
pub(crate) const JSON_WHITESPACE: &str = r"[\x20\x09]{1,48}|\r?\n[\x20\x09]{0,48}";

/// A grammar the output must match, as a request states it.
///
/// Two equal specs compile to one grammar (the engine's cache is keyed by the spec), so a JSON
/// schema's key order is part of its identity: llguidance writes object properties in schema
/// order.
#[derive(Debug, Clone, PartialEq)]
pub enum GrammarSpec {
    /// Any JSON object (OpenAI's `response_format: {"type": "json_object"}`).
    JsonObject,
    /// A JSON value valid under `schema` (draft 2020-12, as llguidance implements it: object
    /// properties come in schema order; string `format`s are enforced).
    JsonSchema {
        /// The schema.
        schema: Value,
        /// `true`: a standard keyword llguidance does not implement (`uniqueItems`, ...), an
        /// unknown `format`, or an unsupported `minProperties` is an error. `false`: those are
        /// ignored, and the output is only as constrained as the rest of the schema. Keywords
        /// outside the standard are ignored either way.
        strict: bool,
    },
    /// Text fully matching a regex (Rust `regex` syntax, no look-around or back-references).
    Regex(String),
    /// A grammar in llguidance's Lark dialect: Lark rules and terminals, `%json { schema }`
    /// embedded schemas, special tokens as `<|name|>` or `<[id]>`, `&` and `~` in terminals.
    Lark(String),
    /// Tool calls in a model's wire format; build it with [`GrammarSpec::tool_calls`].
    ToolCalls(ToolCallGrammar),
}

impl GrammarSpec {
    /// Tool calls written in `wire`, calling the `tools` that `choice` permits, each call's
    /// arguments valid under that tool's `parameters` schema (unsupported schema keywords are
    /// ignored rather than refused: a client's tool list should not fail a request).
    ///
    /// The output is the calls and nothing else: `ToolChoiceMode::Required` allows one or more
    /// calls of any offered tool, `ToolChoiceMode::RequiredOne` exactly one call of any offered
    /// tool, `ToolChoiceMode::Named` exactly one call of that tool. Errors
    /// when there are no tools, a name is empty or repeated, or the named tool is not offered.
    pub fn tool_calls(
        wire: ToolWire,
        tools: &[ToolSpec],
        choice: ToolChoiceMode,
    ) -> Result<Self, GrammarError> {
        ToolCallGrammar::new(wire, tools, choice).map(GrammarSpec::ToolCalls)
    }

    /// What the spec is, for error messages.
    pub(crate) fn kind(&self) -> &'static str {
        match self {
            GrammarSpec::JsonObject => "JSON object grammar",
            GrammarSpec::JsonSchema { .. } => "JSON schema",
            GrammarSpec::Regex(_) => "regex",
            GrammarSpec::Lark(_) => "Lark grammar",
            GrammarSpec::ToolCalls(_) => "tool-call grammar",
        }
    }

    /// The cache key: equal for equal specs, different for different ones.
    pub(crate) fn cache_key(&self) -> String {
        match self {
            GrammarSpec::JsonObject => "json_object".to_owned(),
            GrammarSpec::JsonSchema { schema, strict } => format!("json_schema:{strict}:{schema}"),
            GrammarSpec::Regex(rx) => format!("regex:{rx}"),
            GrammarSpec::Lark(lark) => format!("lark:{lark}"),
            GrammarSpec::ToolCalls(tools) => format!("tool_calls:{}", tools.cache_key()),
        }
    }
}

/// `schema` with the JSON options this crate compiles every schema with, in the
/// top-level `x-guidance` key llguidance reads them from (a schema's own is replaced).
pub(crate) fn with_json_options(schema: &Value, lenient: bool) -> Value {
    let mut object = match schema {
        Value::Object(m) => m.clone(),
        Value::Bool(true) => serde_json::Map::new(),
        other => {
            let mut m = serde_json::Map::new();
            m.insert("allOf".into(), json!([other]));
            m
        }
    };
    object.insert(
        "x-guidance".into(),
        json!({ "whitespace_pattern": JSON_WHITESPACE, "lenient": lenient }),
    );
    Value::Object(object)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_tell_specs_apart() {
        let a = GrammarSpec::JsonSchema {
            schema: json!({"type": "string"}),
            strict: true,
        };
        let b = GrammarSpec::JsonSchema {
            schema: json!({"type": "string"}),
            strict: false,
        };
        assert_ne!(a.cache_key(), b.cache_key());
        assert_eq!(a.cache_key(), a.clone().cache_key());
        assert_ne!(
            GrammarSpec::Regex("a".into()).cache_key(),
            GrammarSpec::Lark("a".into()).cache_key()
        );
    }
}
