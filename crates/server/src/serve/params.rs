// SPDX-License-Identifier: MIT OR Apache-2.0
//! Reading request fields from parsed JSON with errors that name the field.
//!
//! Bodies are parsed to `serde_json::Value` first and each field is read with a typed getter, so
//! a wrong type is a 400 that says which field and what was expected, in both dialects.

use serde_json::{Map, Value};

use super::error::ApiError;

/// A JSON object body.
pub struct Body<'a> {
    obj: &'a Map<String, Value>,
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

impl<'a> Body<'a> {
    /// The body as an object, or a 400.
    pub fn new(v: &'a Value) -> Result<Self, ApiError> {
        v.as_object().map(|obj| Body { obj }).ok_or_else(|| {
            ApiError::invalid(
                "body",
                format!("the request body must be a JSON object, got {}", kind(v)),
            )
        })
    }

    /// The raw value of a field, treating `null` as absent.
    pub fn get(&self, key: &str) -> Option<&'a Value> {
        self.obj.get(key).filter(|v| !v.is_null())
    }

    fn wrong(key: &str, want: &str, v: &Value) -> ApiError {
        ApiError::invalid(key, format!("`{key}` must be {want}, got {}", kind(v)))
    }

    /// An optional string.
    pub fn str(&self, key: &str) -> Result<Option<&'a str>, ApiError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => Err(Self::wrong(key, "a string", v)),
        }
    }

    /// An optional boolean.
    pub fn bool(&self, key: &str) -> Result<Option<bool>, ApiError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(Self::wrong(key, "true or false", v)),
        }
    }

    /// An optional integer within `[min, max]`.
    pub fn int(&self, key: &str, min: i64, max: i64) -> Result<Option<i64>, ApiError> {
        match self.get(key) {
            None => Ok(None),
            Some(v @ Value::Number(n)) => {
                let i = n.as_i64().or_else(|| {
                    n.as_f64()
                        .filter(|f| f.fract() == 0.0 && f.abs() < 9e15)
                        .map(|f| f as i64)
                });
                match i {
                    Some(i) if (min..=max).contains(&i) => Ok(Some(i)),
                    Some(i) => Err(ApiError::invalid(
                        key,
                        format!(
                            "`{key}` = {i} is out of range: it must be between {min} and {max}"
                        ),
                    )),
                    None => Err(Self::wrong(key, "an integer", v)),
                }
            }
            Some(v) => Err(Self::wrong(key, "an integer", v)),
        }
    }

    /// An optional finite number within `[min, max]`.
    pub fn num(&self, key: &str, min: f64, max: f64) -> Result<Option<f64>, ApiError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Number(n)) => {
                let f = n.as_f64().unwrap_or(f64::NAN);
                if f.is_finite() && (min..=max).contains(&f) {
                    Ok(Some(f))
                } else {
                    Err(ApiError::invalid(
                        key,
                        format!(
                            "`{key}` = {f} is out of range: it must be between {min} and {max}"
                        ),
                    ))
                }
            }
            Some(v) => Err(Self::wrong(key, "a number", v)),
        }
    }

    /// An optional array.
    pub fn array(&self, key: &str) -> Result<Option<&'a Vec<Value>>, ApiError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Array(a)) => Ok(Some(a)),
            Some(v) => Err(Self::wrong(key, "an array", v)),
        }
    }

    /// An optional object.
    pub fn object(&self, key: &str) -> Result<Option<&'a Map<String, Value>>, ApiError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Object(o)) => Ok(Some(o)),
            Some(v) => Err(Self::wrong(key, "an object", v)),
        }
    }

    /// `stop`: a string or an array of at most `max` strings (`strict`: an array only, as
    /// Anthropic's `stop_sequences`).
    pub fn stop_list(&self, key: &str, max: usize, strict: bool) -> Result<Vec<String>, ApiError> {
        let list = match self.get(key) {
            None => return Ok(Vec::new()),
            Some(Value::String(s)) if !strict => vec![s.clone()],
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| {
                    v.as_str().map(str::to_string).ok_or_else(|| {
                        ApiError::invalid(
                            key,
                            format!("every entry of `{key}` must be a string, got {}", kind(v)),
                        )
                    })
                })
                .collect::<Result<_, _>>()?,
            Some(v) => {
                return Err(Self::wrong(
                    key,
                    if strict {
                        "an array of strings"
                    } else {
                        "a string or an array of strings"
                    },
                    v,
                ));
            }
        };
        if list.len() > max {
            return Err(ApiError::invalid(
                key,
                format!(
                    "`{key}` has {} entries; at most {max} are allowed",
                    list.len()
                ),
            ));
        }
        Ok(list)
    }
}

/// The text of a message `content`: a string, or an array of `{"type": "text", "text": ...}` parts.
pub fn content_text(content: &Value, field: &str) -> Result<String, ApiError> {
    match content {
        Value::String(s) => Ok(s.clone()),
        Value::Array(parts) => {
            let mut text = String::new();
            for (i, p) in parts.iter().enumerate() {
                let ty = p.get("type").and_then(Value::as_str);
                match (ty, p.get("text").and_then(Value::as_str)) {
                    (Some("text"), Some(t)) => text.push_str(t),
                    (Some(other), _) if other != "text" => {
                        return Err(ApiError::invalid(
                            format!("{field}[{i}].type"),
                            format!("content part type `{other}` is not supported (only text)"),
                        ));
                    }
                    _ => {
                        return Err(ApiError::invalid(
                            format!("{field}[{i}]"),
                            "a content part must be {\"type\": \"text\", \"text\": string}",
                        ));
                    }
                }
            }
            Ok(text)
        }
        v => Err(ApiError::invalid(
            field,
            format!(
                "`{field}` must be a string or an array of text parts, got {}",
                kind(v)
            ),
        )),
    }
}
