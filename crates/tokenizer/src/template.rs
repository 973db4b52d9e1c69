// SPDX-License-Identifier: MIT OR Apache-2.0
//! Chat templates, rendered as `transformers` renders them.
//!
//! `transformers` runs Jinja2 with `trim_blocks` and `lstrip_blocks`, its own `tojson`
//! (`json.dumps(x, ensure_ascii=False)`, no HTML escaping, `indent` and friends), the globals
//! `raise_exception` and `strftime_now`, and Python objects underneath (dict order, `str.strip()`,
//! `True` printed as `True`). Before rendering, `apply_chat_template` drops `None`-valued message
//! keys, copies a message's reasoning under both `thinking` and `reasoning_content`, and passes the
//! special tokens (`bos_token`, `eos_token`), `tools` and `documents` (both `None` when absent),
//! `add_generation_prompt` and any extra keyword arguments. [`ChatTemplate`] does each of these.

use std::borrow::Cow;
use std::fmt::Write as _;

use minijinja::syntax::SyntaxConfig;
use minijinja::value::{Kwargs, Serde, ValueKind};
use minijinja::{Environment, Error, ErrorKind, Value};
use serde_json::{Map, Value as Json};

use crate::TokenizerError;
use crate::python::{self, DumpOptions};
use crate::strftime::DateTime;

/// The name the template is stored under inside its environment (appears in error locations).
const TEMPLATE_NAME: &str = "chat_template";

/// What a render call passes besides the messages (`apply_chat_template`'s keyword arguments).
#[derive(Clone, Debug, Default)]
pub struct RenderOptions {
    /// End with the header that starts an assistant turn (`<|im_start|>assistant\n`).
    pub add_generation_prompt: bool,
    /// Tool definitions (OpenAI style `{"type": "function", "function": {...}}` JSON schemas);
    /// the template sees `tools = None` when this is `None`.
    pub tools: Option<Vec<Json>>,
    /// Qwen3's switch for the thinking block; passed as `enable_thinking` when set.
    pub enable_thinking: Option<bool>,
    /// Any other template variables (`date_string`, `reasoning_effort`, ...). They override the
    /// special tokens, as keyword arguments do in `transformers`.
    pub extra: Map<String, Json>,
}

/// A compiled chat template plus the special-token variables it is rendered with.
#[derive(Clone)]
pub struct ChatTemplate {
    source: String,
    env: Environment<'static>,
    /// Variables every render starts from (the special tokens), in `transformers`' order.
    variables: Map<String, Json>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("source_len", &self.source.len())
            .field("variables", &self.variables)
            .finish()
    }
}

/// The error `raise_exception` carries, found again when mapping the render error.
#[derive(Debug)]
struct Raised(String);

impl std::fmt::Display for Raised {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Raised {}

impl ChatTemplate {
    /// Compiles a Jinja chat template. `bos_token` / `eos_token` become the template variables of
    /// those names (left undefined when `None`, as `transformers` leaves them).
    pub fn new(
        source: &str,
        bos_token: Option<String>,
        eos_token: Option<String>,
    ) -> Result<Self, TokenizerError> {
        let mut variables = Map::new();
        if let Some(bos) = bos_token {
            variables.insert("bos_token".into(), Json::String(bos));
        }
        if let Some(eos) = eos_token {
            variables.insert("eos_token".into(), Json::String(eos));
        }
        let env = environment(source)?;
        Ok(ChatTemplate {
            source: source.to_string(),
            env,
            variables,
        })
    }

    /// Adds (or replaces) a variable every render sees, such as another special token
    /// (`pad_token`, `unk_token`) that `transformers` passes.
    pub fn with_variable(mut self, name: &str, value: Json) -> Self {
        self.variables.insert(name.to_string(), value);
        self
    }

    /// The template's Jinja source, as given.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Renders `messages` (JSON objects with at least `role`) to the prompt text.
    pub fn render(
        &self,
        messages: &[Json],
        options: &RenderOptions,
    ) -> Result<String, TokenizerError> {
        let mut ctx = self.variables.clone();
        for (key, value) in &options.extra {
            ctx.insert(key.clone(), value.clone());
        }
        if let Some(enable) = options.enable_thinking {
            ctx.insert("enable_thinking".into(), Json::Bool(enable));
        }
        ctx.insert("messages".into(), Json::Array(prepare_messages(messages)?));
        ctx.insert(
            "tools".into(),
            options.tools.clone().map_or(Json::Null, Json::Array),
        );
        ctx.entry("documents").or_insert(Json::Null);
        ctx.insert(
            "add_generation_prompt".into(),
            Json::Bool(options.add_generation_prompt),
        );

        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| TokenizerError::TemplateRender(e.to_string()))?;
        template
            .render(Value::from(Serde(&ctx)))
            .map_err(render_error)
    }
}

/// Applies `apply_chat_template`'s message preparation: drop keys whose value is `null`, then
/// copy reasoning (`reasoning_content`, `thinking` or `reasoning`, first present wins) to both
/// `thinking` (first) and `reasoning_content` (last), keeping existing keys in place.
fn prepare_messages(messages: &[Json]) -> Result<Vec<Json>, TokenizerError> {
    const REASONING_FIELDS: [&str; 3] = ["reasoning_content", "thinking", "reasoning"];
    messages
        .iter()
        .enumerate()
        .map(|(i, message)| {
            let Json::Object(fields) = message else {
                return Err(TokenizerError::TemplateRender(format!(
                    "message {i} is not a JSON object (chat messages are objects with `role` and `content`)"
                )));
            };
            let fields: Map<String, Json> = fields.iter().filter(|(_, v)| !v.is_null()).map(|(k, v)| (k.clone(), v.clone())).collect();
            let Some(reasoning) = REASONING_FIELDS.iter().find_map(|k| fields.get(*k)).cloned() else {
                return Ok(Json::Object(fields));
            };
            let mut aliased = Map::new();
            aliased.insert("thinking".into(), reasoning.clone());
            aliased.extend(fields);
            aliased.insert("reasoning_content".into(), reasoning);
            Ok(Json::Object(aliased))
        })
        .collect()
}

/// Maps a MiniJinja error: a `raise_exception` call becomes [`TokenizerError::TemplateRaised`].
fn render_error(err: Error) -> TokenizerError {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(&err);
    while let Some(e) = source {
        if let Some(Raised(message)) = e.downcast_ref::<Raised>() {
            return TokenizerError::TemplateRaised {
                message: message.clone(),
            };
        }
        source = e.source();
    }
    TokenizerError::TemplateRender(chain(&err))
}

/// An error and its causes on one line.
fn chain(err: &Error) -> String {
    let mut text = err.to_string();
    let mut source = std::error::Error::source(err);
    while let Some(e) = source {
        let _ = write!(text, ": {e}");
        source = e.source();
    }
    text
}

/// The MiniJinja environment that behaves like `transformers`' Jinja2 environment, holding the
/// compiled template.
fn environment(source: &str) -> Result<Environment<'static>, TokenizerError> {
    let mut env = Environment::new();
    let syntax = SyntaxConfig::builder()
        .trim_blocks(true)
        .lstrip_blocks(true)
        .build()
        .map_err(|e| TokenizerError::TemplateSyntax(e.to_string()))?;
    env.set_syntax(syntax);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    // `{{ x }}` prints Python's str(x): `True`, `None`, `{'a': 1}`.
    env.set_formatter(|out, _state, value| {
        match value.as_str() {
            Some(s) if value.kind() == ValueKind::String => out.write_str(s),
            _ => out.write_str(&python::py_str(value)),
        }
        .map_err(|e| Error::new(ErrorKind::WriteFailure, e.to_string()))
    });
    env.add_filter("tojson", tojson);
    env.add_filter("string", |value: Value| python::py_str(&value));
    // Jinja2's `sequence` test accepts anything with a length and indexing (strings and dicts
    // too), and `iterable` anything Python can iterate: not None, which MiniJinja iterates as empty.
    env.add_test("sequence", |value: Value| {
        matches!(
            value.kind(),
            ValueKind::Seq | ValueKind::String | ValueKind::Map | ValueKind::Undefined
        )
    });
    env.add_test("iterable", |value: Value| {
        matches!(
            value.kind(),
            ValueKind::Seq
                | ValueKind::Iterable
                | ValueKind::String
                | ValueKind::Bytes
                | ValueKind::Map
                | ValueKind::Undefined
        )
    });
    env.add_function(
        "raise_exception",
        |message: Value| -> Result<Value, Error> {
            let message = python::py_str(&message);
            Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("raise_exception: {message}"),
            )
            .with_source(Raised(message)))
        },
    );
    env.add_function("strftime_now", |format: String| {
        DateTime::now_utc().format(&format)
    });
    env.add_template_owned(TEMPLATE_NAME, rewrite_generation_tags(source).into_owned())
        .map_err(|e| TokenizerError::TemplateSyntax(chain(&e)))?;
    Ok(env)
}

/// transformers' `tojson`: `json.dumps(x, ensure_ascii=False, indent=None, separators=None,
/// sort_keys=False)`, with those keyword arguments.
fn tojson(value: &Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent = match kwargs.get::<Option<Value>>("indent")? {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) if v.kind() == ValueKind::String => {
            Some(v.as_str().unwrap_or_default().to_string())
        }
        Some(v) => {
            let n = i64::try_from(v).map_err(|_| {
                Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson: indent must be an integer, a string or None",
                )
            })?;
            Some(" ".repeat(n.max(0) as usize))
        }
    };
    let mut options = DumpOptions::new(indent);
    options.ensure_ascii = kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false);
    options.sort_keys = kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false);
    if let Some(separators) = kwargs.get::<Option<Value>>("separators")?
        && !separators.is_none()
    {
        let parts: Vec<Value> = separators.try_iter()?.collect();
        match parts.as_slice() {
            [item, key] if item.as_str().is_some() && key.as_str().is_some() => {
                options.item_separator = item.as_str().unwrap_or_default().to_string();
                options.key_separator = key.as_str().unwrap_or_default().to_string();
            }
            _ => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson: separators must be (item_separator, key_separator)",
                ));
            }
        }
    }
    kwargs.assert_all_used()?;
    python::dumps(value, &options).map(Value::from)
}

/// Replaces transformers' `{% generation %}` / `{% endgeneration %}` tags (which only mark the
/// assistant's text for training masks and render their body unchanged) with an always-true
/// `if`, keeping the tags' whitespace-control markers so the surrounding whitespace is the same.
fn rewrite_generation_tags(source: &str) -> Cow<'_, str> {
    if !source.contains("generation") {
        return Cow::Borrowed(source);
    }
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(start) = rest.find("{%") {
        out.push_str(&rest[..start]);
        let tag = &rest[start..];
        let Some(end) = tag.find("%}") else { break };
        let inner = &tag[2..end];
        let (open_marker, body) = split_marker_start(inner);
        let (body, close_marker) = split_marker_end(body);
        let replacement = match body.trim() {
            "generation" => Some("if true"),
            "endgeneration" => Some("endif"),
            _ => None,
        };
        match replacement {
            Some(keyword) => {
                let _ = write!(out, "{{%{open_marker} {keyword} {close_marker}%}}");
            }
            None => out.push_str(&tag[..end + 2]),
        }
        rest = &tag[end + 2..];
    }
    out.push_str(rest);
    Cow::Owned(out)
}

fn split_marker_start(s: &str) -> (&str, &str) {
    match s.as_bytes().first() {
        Some(b'-' | b'+') => s.split_at(1),
        _ => ("", s),
    }
}

fn split_marker_end(s: &str) -> (&str, &str) {
    match s.as_bytes().last() {
        Some(b'-' | b'+') => s.split_at(s.len() - 1),
        _ => (s, ""),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn render(
        source: &str,
        messages: Json,
        options: &RenderOptions,
    ) -> Result<String, TokenizerError> {
        let t = ChatTemplate::new(source, Some("<s>".into()), Some("</s>".into()))?;
        t.render(messages.as_array().unwrap(), options)
    }

    #[test]
    fn python_semantics() {
        let out = render(
            "{{ bos_token }}{{ messages[0].x }} {{ messages[0].y | tojson }} {{ tools }} {{ messages[0].content.strip().startswith('hi') }}",
            json!([{"role": "user", "content": "  hi  ", "x": true, "y": {"b": "<&>", "a": [1.0, null]}, "z": null}]),
            &RenderOptions::default(),
        )
        .unwrap();
        assert_eq!(out, r#"<s>True {"b": "<&>", "a": [1.0, null]} None True"#);
    }

    #[test]
    fn type_tests_follow_jinja2() {
        let out = render(
            "{{ tools is iterable }} {{ 'ab' is sequence }} {{ messages[0] is sequence }} {{ 3 is iterable }}",
            json!([{"role": "user"}]),
            &RenderOptions::default(),
        )
        .unwrap();
        assert_eq!(out, "False True True False");
    }

    #[test]
    fn tojson_options() {
        let out = render(
            "{{ messages[0].y | tojson(indent=2) }}|{{ messages[0].y | tojson(separators=(',', ':'), sort_keys=true) }}",
            json!([{"role": "user", "y": {"b": 1, "a": [1]}}]),
            &RenderOptions::default(),
        )
        .unwrap();
        assert_eq!(
            out,
            "{\n  \"b\": 1,\n  \"a\": [\n    1\n  ]\n}|{\"a\":[1],\"b\":1}"
        );
    }

    #[test]
    fn raise_exception_is_a_typed_error() {
        let err = render(
            "{{ raise_exception('only user and assistant roles') }}",
            json!([]),
            &RenderOptions::default(),
        )
        .unwrap_err();
        assert!(
            matches!(err, TokenizerError::TemplateRaised { ref message } if message == "only user and assistant roles"),
            "{err}"
        );
    }

    #[test]
    fn reasoning_is_aliased_and_nulls_dropped() {
        let out = render(
            "{% for k, v in messages[0].items() %}{{ k }}={{ v }};{% endfor %}",
            json!([{"role": "assistant", "content": "a", "tool_calls": null, "reasoning": "r"}]),
            &RenderOptions::default(),
        )
        .unwrap();
        assert_eq!(
            out,
            "thinking=r;role=assistant;content=a;reasoning=r;reasoning_content=r;"
        );
    }

    #[test]
    fn generation_tags_render_their_body() {
        let src = "{% for m in messages %}\n{%- generation -%}\n {{ m.content }}\n{%- endgeneration %}\n{% endfor %}";
        assert_eq!(
            rewrite_generation_tags(src),
            "{% for m in messages %}\n{%- if true -%}\n {{ m.content }}\n{%- endif %}\n{% endfor %}"
        );
        assert_eq!(
            render(
                src,
                json!([{"role": "user", "content": "x"}]),
                &RenderOptions::default()
            )
            .unwrap(),
            "x"
        );
    }

    #[test]
    fn syntax_errors_are_reported() {
        assert!(matches!(
            ChatTemplate::new("{% if %}", None, None),
            Err(TokenizerError::TemplateSyntax(_))
        ));
    }
}
