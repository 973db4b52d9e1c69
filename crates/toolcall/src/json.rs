// SPDX-License-Identifier: MIT OR Apache-2.0
//! Lenient JSON: scanning for the end of a value, repairing what the book calls recoverable, and
//! reading call objects.

use serde_json::{Map, Value};

/// A function name and its JSON arguments, before an index and id are given.
pub(crate) type RawCall = (String, Value);

/// Byte offset just past the JSON value (object or array) starting at `s[0]`, or `None` while it
/// is still open. Brackets inside strings do not count.
pub(crate) fn value_end(s: &str) -> Option<usize> {
    let mut depth = 0usize;
    let mut in_string = false;
    let mut escaped = false;
    for (i, c) in s.char_indices() {
        if in_string {
            match c {
                _ if escaped => escaped = false,
                '\\' => escaped = true,
                '"' => in_string = false,
                _ => {}
            }
            continue;
        }
        match c {
            '"' => in_string = true,
            '{' | '[' => depth += 1,
            '}' | ']' => {
                depth = depth.saturating_sub(1);
                if depth == 0 {
                    return Some(i + 1);
                }
            }
            _ if depth == 0 => return Some(i),
            _ => {}
        }
    }
    None
}

/// The first occurrence of `needle` in `s` outside a JSON string (counting quotes from `s[0]`).
pub(crate) fn find_outside_strings(s: &str, needle: &str) -> Option<usize> {
    let mut in_string = false;
    let mut escaped = false;
    for (i, c) in s.char_indices() {
        if in_string {
            match c {
                _ if escaped => escaped = false,
                '\\' => escaped = true,
                '"' => in_string = false,
                _ => {}
            }
        } else if c == '"' {
            in_string = true;
        } else if s[i..].starts_with(needle) {
            return Some(i);
        }
    }
    None
}

/// `s` without a surrounding markdown fence (```` ```json ```` ... ```` ``` ````), trimmed.
pub(crate) fn strip_fence(s: &str) -> &str {
    let s = s.trim();
    let Some(rest) = s.strip_prefix("```") else {
        return s;
    };
    let body = match rest.find('\n') {
        Some(nl) => &rest[nl + 1..],
        None => rest.trim_start_matches("json"),
    };
    body.trim_end().strip_suffix("```").unwrap_or(body).trim()
}

/// Parses `s` as JSON, repairing trailing commas and brackets left open at the end of the text.
pub(crate) fn parse_lenient(s: &str) -> Option<Value> {
    let s = strip_fence(s);
    if let Ok(v) = serde_json::from_str(s) {
        return Some(v);
    }
    let repaired = repair(s)?;
    serde_json::from_str(&repaired).ok()
}

/// Drops commas before a closing bracket and appends the closers of brackets still open, unless
/// the text ends inside a string or closes a bracket it never opened.
fn repair(s: &str) -> Option<String> {
    let mut out = String::with_capacity(s.len() + 4);
    let mut open = Vec::new();
    let mut in_string = false;
    let mut escaped = false;
    for (i, c) in s.char_indices() {
        if in_string {
            match c {
                _ if escaped => escaped = false,
                '\\' => escaped = true,
                '"' => in_string = false,
                _ => {}
            }
            out.push(c);
            continue;
        }
        match c {
            '"' => in_string = true,
            '{' => open.push('}'),
            '[' => open.push(']'),
            '}' | ']' if open.pop() != Some(c) => return None,
            ',' => {
                let next = s[i + 1..].trim_start().chars().next();
                if matches!(next, Some('}' | ']') | None) {
                    continue;
                }
            }
            _ => {}
        }
        out.push(c);
    }
    if in_string {
        return None;
    }
    out.extend(open.into_iter().rev());
    Some(out)
}

/// The calls in a parsed value: one call object, a list of them, or `{"function": {...}}`
/// wrappers. `None` if any element is not a call; an empty object or list is no call at all.
pub(crate) fn calls_from_value(v: Value) -> Option<Vec<RawCall>> {
    match v {
        Value::Array(items) => items.into_iter().map(call_from_value).collect(),
        Value::Object(ref m) if m.is_empty() => Some(Vec::new()),
        v => Some(vec![call_from_value(v)?]),
    }
}

fn call_from_value(v: Value) -> Option<RawCall> {
    let Value::Object(mut m) = v else {
        return None;
    };
    if let Some(Value::Object(inner)) = m.remove("function") {
        m = inner;
    }
    let name = match m.remove("name")? {
        Value::String(n) if !n.trim().is_empty() => n.trim().to_owned(),
        _ => return None,
    };
    let args = m.remove("arguments").or_else(|| m.remove("parameters"));
    Some((name, arguments_from(args)?))
}

/// Arguments as a JSON value: absent or null become `{}`, a string holding JSON is that JSON.
pub(crate) fn arguments_from(args: Option<Value>) -> Option<Value> {
    match args {
        None | Some(Value::Null) => Some(Value::Object(Map::new())),
        Some(Value::String(s)) if s.trim().is_empty() => Some(Value::Object(Map::new())),
        Some(Value::String(s)) => parse_lenient(&s),
        Some(v) => Some(v),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn value_end_skips_brackets_in_strings() {
        assert_eq!(value_end(r#"{"a":"}"} x"#), Some(9));
        assert_eq!(value_end(r#"{"a":[1,2]"#), None);
        assert_eq!(value_end("[1]"), Some(3));
    }

    #[test]
    fn repairs_trailing_commas_and_open_brackets() {
        assert_eq!(
            parse_lenient(r#"{"a": [1, 2,],}"#),
            Some(serde_json::json!({"a": [1, 2]}))
        );
        assert_eq!(
            parse_lenient(r#"{"a": {"b": 1"#),
            Some(serde_json::json!({"a": {"b": 1}}))
        );
        assert_eq!(parse_lenient(r#"{"a": "unterminated"#), None);
        assert_eq!(parse_lenient("not json"), None);
    }
}
