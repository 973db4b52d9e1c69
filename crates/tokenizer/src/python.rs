// SPDX-License-Identifier: MIT OR Apache-2.0
//! How Python spells template values: `json.dumps` (transformers' `tojson` filter), and `str()` /
//! `repr()` (what Jinja2 prints for `{{ value }}`). Chat templates are Python programs in
//! disguise; matching these byte for byte is what makes a rendered prompt identical.

use minijinja::value::ValueKind;
use minijinja::{Error, ErrorKind, Value};

/// The arguments of Python's `json.dumps` that transformers' `tojson` exposes.
#[derive(Clone, Debug)]
pub(crate) struct DumpOptions {
    /// Escape every non-ASCII character as `\uXXXX`.
    pub ensure_ascii: bool,
    /// `None`: one line. `Some(s)`: one item per line, nested levels prefixed by `s` repeated.
    pub indent: Option<String>,
    /// Between items (`", "` on one line, `","` with an indent, unless given).
    pub item_separator: String,
    /// Between a key and its value.
    pub key_separator: String,
    /// Sort object keys.
    pub sort_keys: bool,
}

impl DumpOptions {
    /// `json.dumps`' defaults for a given indent, before explicit `separators`.
    pub fn new(indent: Option<String>) -> Self {
        let item_separator = if indent.is_some() { "," } else { ", " }.to_string();
        DumpOptions {
            ensure_ascii: false,
            indent,
            item_separator,
            key_separator: ": ".into(),
            sort_keys: false,
        }
    }
}

/// `json.dumps(value, ...)`. Fails, as Python does, on values JSON has no spelling for
/// (undefined, functions, namespaces).
pub(crate) fn dumps(value: &Value, options: &DumpOptions) -> Result<String, Error> {
    let mut out = String::new();
    write_json(&mut out, value, options, 0)?;
    Ok(out)
}

fn write_json(out: &mut String, value: &Value, o: &DumpOptions, depth: usize) -> Result<(), Error> {
    match value.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => out.push_str(&number(value, true)),
        ValueKind::String => {
            write_json_str(out, value.as_str().unwrap_or_default(), o.ensure_ascii)
        }
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            write_container(out, o, depth, ('[', ']'), &items, |out, item, depth| {
                write_json(out, item, o, depth)
            })?;
        }
        ValueKind::Map => {
            let mut items = Vec::new();
            for key in value.try_iter()? {
                let item = value.get_item(&key)?;
                items.push((json_key(&key)?, item));
            }
            if o.sort_keys {
                items.sort_by(|a, b| a.0.cmp(&b.0));
            }
            write_container(
                out,
                o,
                depth,
                ('{', '}'),
                &items,
                |out, (key, item), depth| {
                    write_json_str(out, key, o.ensure_ascii);
                    out.push_str(&o.key_separator);
                    write_json(out, item, o, depth)
                },
            )?;
        }
        kind => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson: a value of kind {kind} is not JSON serializable"),
            ));
        }
    }
    Ok(())
}

/// Writes `[...]` or `{...}` the way `json.dumps` lays items out.
fn write_container<T>(
    out: &mut String,
    o: &DumpOptions,
    depth: usize,
    (open, close): (char, char),
    items: &[T],
    mut write_item: impl FnMut(&mut String, &T, usize) -> Result<(), Error>,
) -> Result<(), Error> {
    out.push(open);
    if items.is_empty() {
        out.push(close);
        return Ok(());
    }
    let newline = |out: &mut String, level: usize| {
        if let Some(indent) = &o.indent {
            out.push('\n');
            for _ in 0..level {
                out.push_str(indent);
            }
        }
    };
    for (i, item) in items.iter().enumerate() {
        if i > 0 {
            out.push_str(&o.item_separator);
        }
        newline(out, depth + 1);
        write_item(out, item, depth + 1)?;
    }
    newline(out, depth);
    out.push(close);
    Ok(())
}

/// How `json.dumps` turns a dict key into a string.
fn json_key(key: &Value) -> Result<String, Error> {
    Ok(match key.kind() {
        ValueKind::String => key.as_str().unwrap_or_default().to_string(),
        ValueKind::Number => number(key, true),
        ValueKind::Bool => if key.is_true() { "true" } else { "false" }.to_string(),
        ValueKind::None => "null".to_string(),
        kind => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson: keys must be str, int, float, bool or None, not {kind}"),
            ));
        }
    })
}

/// A JSON string literal as `json.dumps` writes it.
fn write_json_str(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (ensure_ascii && !(' '..='~').contains(&c)) => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{unit:04x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// A number as Python prints it: integers in decimal, floats as `repr(float)`. In JSON, NaN and
/// the infinities are spelled as `json.dumps` spells them.
fn number(value: &Value, json: bool) -> String {
    if value.is_integer() {
        return value.to_string();
    }
    let f = f64::try_from(value.clone()).unwrap_or(f64::NAN);
    match (f.is_nan(), f.is_infinite(), json) {
        (true, _, true) => "NaN".into(),
        (true, _, false) => "nan".into(),
        (_, true, true) => if f > 0.0 { "Infinity" } else { "-Infinity" }.into(),
        (_, true, false) => if f > 0.0 { "inf" } else { "-inf" }.into(),
        _ => float_repr(f),
    }
}

/// Python's `repr(float)` of a finite float: the shortest digits that round-trip, positional
/// when the decimal exponent is in `-4..16`, else scientific with a signed two-digit exponent.
pub(crate) fn float_repr(f: f64) -> String {
    // Rust's `{:e}` gives the same shortest round-trip digits: `d.ddde±x`.
    let sci = format!("{:e}", f.abs());
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let digits: String = mantissa.chars().filter(char::is_ascii_digit).collect();
    let sign = if f.is_sign_negative() { "-" } else { "" };
    if (-4..16).contains(&exp) {
        let point = exp + 1; // digits before the decimal point
        let body = if point <= 0 {
            format!("0.{}{digits}", "0".repeat((-point) as usize))
        } else if point as usize >= digits.len() {
            format!("{digits}{}.0", "0".repeat(point as usize - digits.len()))
        } else {
            format!(
                "{}.{}",
                &digits[..point as usize],
                &digits[point as usize..]
            )
        };
        format!("{sign}{body}")
    } else {
        let (first, rest) = digits.split_at(1);
        let frac = if rest.is_empty() {
            String::new()
        } else {
            format!(".{rest}")
        };
        format!(
            "{sign}{first}{frac}e{}{:02}",
            if exp < 0 { '-' } else { '+' },
            exp.abs()
        )
    }
}

/// Python's `str(value)`: what Jinja2 prints for `{{ value }}`.
pub(crate) fn py_str(value: &Value) -> String {
    match value.kind() {
        ValueKind::Undefined => String::new(),
        ValueKind::String => value.as_str().unwrap_or_default().to_string(),
        _ => py_repr(value),
    }
}

/// Python's `repr(value)` for the JSON-like values templates see.
pub(crate) fn py_repr(value: &Value) -> String {
    match value.kind() {
        ValueKind::Undefined => String::new(),
        ValueKind::None => "None".into(),
        ValueKind::Bool => if value.is_true() { "True" } else { "False" }.into(),
        ValueKind::Number => number(value, false),
        ValueKind::String => str_repr(value.as_str().unwrap_or_default()),
        ValueKind::Seq => {
            let open_close = if value.is_tuple() {
                ("(", ")")
            } else {
                ("[", "]")
            };
            let items: Vec<String> = value
                .try_iter()
                .map(|it| it.map(|v| py_repr(&v)).collect())
                .unwrap_or_default();
            let trailing = if value.is_tuple() && items.len() == 1 {
                ","
            } else {
                ""
            };
            format!(
                "{}{}{trailing}{}",
                open_close.0,
                items.join(", "),
                open_close.1
            )
        }
        ValueKind::Map => {
            let items: Vec<String> = value
                .try_iter()
                .map(|keys| {
                    keys.map(|k| {
                        format!(
                            "{}: {}",
                            py_repr(&k),
                            py_repr(&value.get_item(&k).unwrap_or_default())
                        )
                    })
                    .collect()
                })
                .unwrap_or_default();
            format!("{{{}}}", items.join(", "))
        }
        _ => value.to_string(),
    }
}

/// Python's `repr(str)`: single quotes unless the text has a `'` and no `"`.
fn str_repr(s: &str) -> String {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    let mut out = String::with_capacity(s.len() + 2);
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || (0x7f..0xa0).contains(&(c as u32)) => {
                out.push_str(&format!("\\x{:02x}", c as u32))
            }
            c => out.push(c),
        }
    }
    out.push(quote);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floats_print_like_python() {
        for (f, want) in [
            (1.0, "1.0"),
            (0.1, "0.1"),
            (-2.5, "-2.5"),
            (1e16, "1e+16"),
            (1.5e16, "1.5e+16"),
            (1234567890123456.0, "1234567890123456.0"),
            (1e-5, "1e-05"),
            (0.0001, "0.0001"),
            (123456789012345678.0, "1.2345678901234568e+17"),
            (0.0, "0.0"),
            (100.0, "100.0"),
        ] {
            assert_eq!(float_repr(f), want, "{f}");
        }
    }

    #[test]
    fn dumps_matches_json_dumps() {
        let v: Value = Value::from(minijinja::value::Serde(
            serde_json::json!({"b": [1, 2.0, "é<>&\n\u{1}"], "a": {}, "c": null, "d": true}),
        ));
        assert_eq!(
            dumps(&v, &DumpOptions::new(None)).unwrap(),
            r#"{"b": [1, 2.0, "é<>&\n\u0001"], "a": {}, "c": null, "d": true}"#
        );
        let pretty = dumps(&v, &DumpOptions::new(Some("  ".into()))).unwrap();
        assert_eq!(
            pretty,
            "{\n  \"b\": [\n    1,\n    2.0,\n    \"é<>&\\n\\u0001\"\n  ],\n  \"a\": {},\n  \"c\": null,\n  \"d\": true\n}"
        );
        let ascii = DumpOptions {
            ensure_ascii: true,
            ..DumpOptions::new(None)
        };
        assert_eq!(
            dumps(&Value::from("é😀"), &ascii).unwrap(),
            r#""\u00e9\ud83d\ude00""#
        );
    }

    #[test]
    fn repr_matches_python() {
        let v = Value::from(minijinja::value::Serde(
            serde_json::json!({"a": [true, null, 1.5, "it's"], "b": "x"}),
        ));
        assert_eq!(py_str(&v), r#"{'a': [True, None, 1.5, "it's"], 'b': 'x'}"#);
    }
}
