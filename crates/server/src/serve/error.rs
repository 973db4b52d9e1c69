// SPDX-License-Identifier: MIT OR Apache-2.0
//! Errors a client can cause, in OpenAI's or Anthropic's body shape.

use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::json;

/// Which API's error shape to answer with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dialect {
    /// `{"error": {"message", "type", "param", "code"}}`
    OpenAi,
    /// `{"type": "error", "error": {"type", "message"}}`
    Anthropic,
}

/// An error answer: status, message, the offending field if any.
#[derive(Debug)]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// What was wrong and, where it helps, what to do.
    pub message: String,
    /// The request field at fault.
    pub param: Option<String>,
    /// Response shape.
    pub dialect: Dialect,
}

impl ApiError {
    /// 400 naming `param`.
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            param: Some(param.into()),
            dialect: Dialect::OpenAi,
        }
    }
    /// An error with a status and no field.
    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        ApiError {
            status,
            message: message.into(),
            param: None,
            dialect: Dialect::OpenAi,
        }
    }
    /// The same error in another dialect.
    pub fn with_dialect(mut self, dialect: Dialect) -> Self {
        self.dialect = dialect;
        self
    }

    fn openai_type(&self) -> &'static str {
        match self.status {
            StatusCode::UNAUTHORIZED => "authentication_error",
            StatusCode::NOT_FOUND => "not_found_error",
            StatusCode::TOO_MANY_REQUESTS => "rate_limit_error",
            StatusCode::PAYLOAD_TOO_LARGE => "request_too_large",
            StatusCode::NOT_IMPLEMENTED => "not_supported_error",
            StatusCode::SERVICE_UNAVAILABLE => "overloaded_error",
            s if s.is_server_error() => "server_error",
            _ => "invalid_request_error",
        }
    }

    fn anthropic_type(&self) -> &'static str {
        match self.status {
            StatusCode::UNAUTHORIZED => "authentication_error",
            StatusCode::NOT_FOUND => "not_found_error",
            StatusCode::TOO_MANY_REQUESTS => "rate_limit_error",
            StatusCode::PAYLOAD_TOO_LARGE => "request_too_large",
            StatusCode::SERVICE_UNAVAILABLE => "overloaded_error",
            s if s.is_server_error() => "api_error",
            _ => "invalid_request_error",
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = match self.dialect {
            Dialect::OpenAi => json!({"error": {
                "message": self.message,
                "type": self.openai_type(),
                "param": self.param,
                "code": self.status.as_u16().to_string(),
            }}),
            Dialect::Anthropic => {
                json!({"type": "error", "error": {"type": self.anthropic_type(), "message": self.message}})
            }
        };
        (self.status, Json(body)).into_response()
    }
}
