// SPDX-License-Identifier: MIT OR Apache-2.0
//! The wire formats: where a call starts and ends, and how its body reads.

use serde_json::{Map, Value};

use crate::driver::{RegionEnd, StartDecision, Wire};
use crate::json::{
    RawCall, arguments_from, calls_from_value, find_outside_strings, parse_lenient, value_end,
};

const TOOL_CALL_OPEN: &str = "<tool_call>";
const TOOL_CALL_CLOSE: &str = "</tool_call>";

/// A body with nothing in it (or `{}`) is an empty call: dropped, not text.
fn is_empty_body(body: &str) -> bool {
    let b = body.trim();
    b.is_empty() || b.chars().filter(|c| !c.is_whitespace()).eq("{}".chars())
}

/// The first `</tool_call>` at all: the weaker end used once the output has ended.
fn first_close_tag(region: &str) -> Option<RegionEnd> {
    region.find(TOOL_CALL_CLOSE).map(|at| RegionEnd {
        body: at,
        consumed: at + TOOL_CALL_CLOSE.len(),
    })
}

/// The calls of a region that has no tags around it: an empty one is not a call but text.
fn untagged_json_calls(body: &str) -> Option<Vec<RawCall>> {
    json_calls(body).filter(|calls| !calls.is_empty())
}

fn json_calls(body: &str) -> Option<Vec<RawCall>> {
    if is_empty_body(body) {
        return Some(Vec::new());
    }
    calls_from_value(parse_lenient(body)?)
}

/// `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.
pub(crate) struct Hermes;

impl Wire for Hermes {
    const OPENERS: &'static [&'static str] = &[TOOL_CALL_OPEN];

    /// The first `</tool_call>` outside a JSON string, so a string value may contain the tag.
    fn find_end(&self, region: &str) -> Option<RegionEnd> {
        find_outside_strings(region, TOOL_CALL_CLOSE).map(|at| RegionEnd {
            body: at,
            consumed: at + TOOL_CALL_CLOSE.len(),
        })
    }

    fn fallback_end(&self, region: &str) -> Option<RegionEnd> {
        first_close_tag(region)
    }

    fn parse_body(&self, body: &str) -> Option<Vec<RawCall>> {
        json_calls(body)
    }
}

/// `<tool_call><function=NAME><parameter=KEY>value</parameter></function></tool_call>`.
pub(crate) struct Qwen3Xml;

impl Wire for Qwen3Xml {
    const OPENERS: &'static [&'static str] = &[TOOL_CALL_OPEN];

    /// The first `</tool_call>` right after `</function>`, `</parameter>` or a JSON `}`: a
    /// `</tool_call>` elsewhere is taken as part of a parameter value.
    fn find_end(&self, region: &str) -> Option<RegionEnd> {
        let mut from = 0;
        while let Some(at) = region[from..].find(TOOL_CALL_CLOSE).map(|i| i + from) {
            let before = region[..at].trim_end();
            if before.ends_with("</function>")
                || before.ends_with("</parameter>")
                || before.ends_with('}')
            {
                return Some(RegionEnd {
                    body: at,
                    consumed: at + TOOL_CALL_CLOSE.len(),
                });
            }
            from = at + TOOL_CALL_CLOSE.len();
        }
        None
    }

    fn fallback_end(&self, region: &str) -> Option<RegionEnd> {
        first_close_tag(region)
    }

    fn parse_body(&self, body: &str) -> Option<Vec<RawCall>> {
        if is_empty_body(body) {
            return Some(Vec::new());
        }
        if body.trim_start().starts_with('{') {
            // Qwen3 models fall back to the hermes JSON body now and then.
            return json_calls(body);
        }
        parse_xml_functions(body)
    }
}

/// One or more `<function=NAME>...</function>` blocks, nothing else but whitespace around them.
fn parse_xml_functions(body: &str) -> Option<Vec<RawCall>> {
    let mut calls = Vec::new();
    let mut rest = body.trim();
    while !rest.is_empty() {
        let after = rest.strip_prefix("<function=")?;
        let gt = after.find('>')?;
        let name = after[..gt].trim();
        if name.is_empty() || name.contains('<') {
            return None;
        }
        let inner_and_rest = &after[gt + 1..];
        let (inner, next) = match inner_and_rest.find("</function>") {
            Some(at) => (
                &inner_and_rest[..at],
                &inner_and_rest[at + "</function>".len()..],
            ),
            None => (inner_and_rest, ""),
        };
        calls.push((name.to_owned(), Value::Object(parse_xml_parameters(inner)?)));
        rest = next.trim();
    }
    (!calls.is_empty()).then_some(calls)
}

/// `<parameter=KEY>value</parameter>`...; a missing `</parameter>` ends at the next parameter.
fn parse_xml_parameters(inner: &str) -> Option<Map<String, Value>> {
    const OPEN: &str = "<parameter=";
    const CLOSE: &str = "</parameter>";
    let mut args = Map::new();
    let mut rest = inner.trim();
    while !rest.is_empty() {
        let after = rest.strip_prefix(OPEN)?;
        let gt = after.find('>')?;
        let key = after[..gt].trim();
        if key.is_empty() {
            return None;
        }
        let value_and_rest = &after[gt + 1..];
        let close = value_and_rest.find(CLOSE);
        let next_open = value_and_rest.find(OPEN);
        let (raw, next) = match (close, next_open) {
            (Some(c), Some(o)) if o < c => (&value_and_rest[..o], &value_and_rest[o..]),
            (Some(c), _) => (&value_and_rest[..c], &value_and_rest[c + CLOSE.len()..]),
            (None, Some(o)) => (&value_and_rest[..o], &value_and_rest[o..]),
            (None, None) => (value_and_rest, ""),
        };
        args.insert(key.to_owned(), xml_value(raw));
        rest = next.trim();
    }
    Some(args)
}

/// A parameter value: the template's newline on each side removed; JSON if it parses, else text.
fn xml_value(raw: &str) -> Value {
    let v = raw.strip_prefix('\n').unwrap_or(raw);
    let v = v.strip_suffix('\n').unwrap_or(v);
    serde_json::from_str(v.trim()).unwrap_or_else(|_| Value::String(v.to_owned()))
}

/// The end of a JSON region: an optional opening fence line, one JSON value, and the closing
/// fence if the region opened one.
fn json_region_end(region: &str) -> Option<RegionEnd> {
    let ws = |s: &str| s.len() - s.trim_start().len();
    let mut i = ws(region);
    if "```".starts_with(&region[i..]) {
        return None;
    }
    let fenced = region[i..].starts_with("```");
    if fenced {
        i += region[i..].find('\n')? + 1;
        i += ws(&region[i..]);
    }
    if i == region.len() {
        return None;
    }
    let end = i + value_end(&region[i..])?;
    if !fenced {
        return Some(RegionEnd {
            body: end,
            consumed: end,
        });
    }
    let j = end + ws(&region[end..]);
    let tail = &region[j..];
    if tail.starts_with("```") {
        Some(RegionEnd {
            body: j + 3,
            consumed: j + 3,
        })
    } else if "```".starts_with(tail) {
        None
    } else {
        Some(RegionEnd {
            body: end,
            consumed: end,
        })
    }
}

/// A call object at the start of the text, after separators (`;` if `semicolons`) and maybe a
/// markdown fence.
fn json_start(text: &str, semicolons: bool) -> StartDecision {
    let rest = text.trim_start_matches(|c: char| c.is_whitespace() || (semicolons && c == ';'));
    let skip = text.len() - rest.len();
    let Some(first) = rest.chars().next() else {
        return StartDecision::Undecided;
    };
    if first == '{' || first == '[' {
        return StartDecision::Call { skip };
    }
    if "```".starts_with(rest) {
        return StartDecision::Undecided;
    }
    let Some(info) = rest.strip_prefix("```") else {
        return StartDecision::Text;
    };
    let Some(nl) = info.find('\n') else {
        let tag = info.trim_end();
        let could_be = "json".starts_with(tag) && tag.len() == info.len() || tag == "json";
        return if could_be {
            StartDecision::Undecided
        } else {
            StartDecision::Text
        };
    };
    if !matches!(info[..nl].trim(), "" | "json") {
        return StartDecision::Text;
    }
    match info[nl + 1..].trim_start().chars().next() {
        None => StartDecision::Undecided,
        Some('{' | '[') => StartDecision::Call { skip },
        Some(_) => StartDecision::Text,
    }
}

/// `{"name": ..., "parameters": {...}}` opening the output or after `<|python_tag|>`.
pub(crate) struct Llama3Json;

impl Wire for Llama3Json {
    const OPENERS: &'static [&'static str] = &["<|python_tag|>"];

    fn start(&self, text: &str) -> StartDecision {
        json_start(text, true)
    }

    fn find_end(&self, region: &str) -> Option<RegionEnd> {
        json_region_end(region)
    }

    fn parse_body(&self, body: &str) -> Option<Vec<RawCall>> {
        untagged_json_calls(body)
    }
}

/// An unwrapped JSON call object or list as the output.
pub(crate) struct BareJson;

impl Wire for BareJson {
    const OPENERS: &'static [&'static str] = &[];

    fn start(&self, text: &str) -> StartDecision {
        json_start(text, false)
    }

    fn find_end(&self, region: &str) -> Option<RegionEnd> {
        json_region_end(region)
    }

    fn parse_body(&self, body: &str) -> Option<Vec<RawCall>> {
        untagged_json_calls(body)
    }
}

/// `[TOOL_CALLS][{"name": ..., "arguments": {...}}]`, or the v11 `[TOOL_CALLS]NAME[ARGS]{...}`.
pub(crate) struct Mistral;

const ARGS: &str = "[ARGS]";

impl Wire for Mistral {
    const OPENERS: &'static [&'static str] = &["[TOOL_CALLS]"];

    fn find_end(&self, region: &str) -> Option<RegionEnd> {
        let start = region.len() - region.trim_start().len();
        match region[start..].chars().next()? {
            '{' | '[' => json_region_end(region),
            _ => {
                let args = region.find(ARGS)? + ARGS.len();
                let end = json_region_end(&region[args..])?;
                Some(RegionEnd {
                    body: args + end.body,
                    consumed: args + end.consumed,
                })
            }
        }
    }

    fn parse_body(&self, body: &str) -> Option<Vec<RawCall>> {
        let trimmed = body.trim_start();
        if trimmed.starts_with('{') || trimmed.starts_with('[') {
            return untagged_json_calls(body);
        }
        let (name, args) = body.split_once(ARGS)?;
        let name = name.trim();
        if name.is_empty() || name.contains(char::is_whitespace) {
            return None;
        }
        let args = arguments_from(Some(Value::String(args.to_owned())))?;
        Some(vec![(name.to_owned(), args)])
    }
}
