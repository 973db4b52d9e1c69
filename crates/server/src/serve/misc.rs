// SPDX-License-Identifier: MIT OR Apache-2.0
//! Models, tokenisation, health, metrics, the OpenAPI document, and the not-supported answers.

use std::sync::Arc;

use axum::body::Body as HttpBody;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use metrale_tokenizer::RenderOptions;
use serde_json::{Value, json};

use super::error::{ApiError, Dialect};
use super::openai::read_json;
use super::params::{Body, content_text};
use super::state::AppState;

fn model_card(state: &AppState) -> Value {
    json!({"id": state.model_name, "object": "model", "created": state.created, "owned_by": "metrale", "max_model_len": state.max_seq_len})
}

/// `GET /v1/models`.
pub async fn models(State(state): State<Arc<AppState>>) -> Response {
    axum::Json(json!({"object": "list", "data": [model_card(&state)]})).into_response()
}

/// `GET /v1/models/{id}`.
pub async fn model(
    State(state): State<Arc<AppState>>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    if id == state.model_name {
        Ok(axum::Json(model_card(&state)).into_response())
    } else {
        Err(ApiError::new(
            StatusCode::NOT_FOUND,
            format!(
                "model `{id}` is not served here; this server serves `{}`",
                state.model_name
            ),
        ))
    }
}

/// `POST /tokenize`: `{"prompt": str}` or `{"messages": [...]}` (through the chat template).
pub async fn tokenize(
    State(state): State<Arc<AppState>>,
    body: HttpBody,
) -> Result<Response, ApiError> {
    let value = read_json(body, Dialect::OpenAi).await?;
    let b = Body::new(&value)?;
    let tokens = if let Some(prompt) = b.str("prompt")? {
        let special = b.bool("add_special_tokens")?.unwrap_or(true);
        state
            .tokenizer
            .encode(prompt, special)
            .map_err(|e| ApiError::invalid("prompt", e.to_string()))?
    } else if let Some(messages) = b.array("messages")? {
        let mut chat = Vec::new();
        for (i, m) in messages.iter().enumerate() {
            let role = m.get("role").and_then(Value::as_str).ok_or_else(|| {
                ApiError::invalid(format!("messages[{i}].role"), "`role` must be a string")
            })?;
            let content = content_text(
                m.get("content").unwrap_or(&Value::Null),
                &format!("messages[{i}].content"),
            )?;
            chat.push(json!({"role": role, "content": content}));
        }
        let template = state
            .tokenizer
            .chat_template()
            .ok_or_else(|| ApiError::invalid("messages", "this model has no chat template"))?;
        let add = b.bool("add_generation_prompt")?.unwrap_or(true);
        let text = template
            .render(
                &chat,
                &RenderOptions {
                    add_generation_prompt: add,
                    ..Default::default()
                },
            )
            .map_err(|e| ApiError::invalid("messages", e.to_string()))?;
        state
            .tokenizer
            .encode(&text, false)
            .map_err(|e| ApiError::invalid("messages", e.to_string()))?
    } else {
        return Err(ApiError::invalid(
            "prompt",
            "send `prompt` (a string) or `messages`",
        ));
    };
    Ok(axum::Json(
        json!({"tokens": tokens, "count": tokens.len(), "max_model_len": state.max_seq_len}),
    )
    .into_response())
}

/// `POST /detokenize`: `{"tokens": [ids]}`.
pub async fn detokenize(
    State(state): State<Arc<AppState>>,
    body: HttpBody,
) -> Result<Response, ApiError> {
    let value = read_json(body, Dialect::OpenAi).await?;
    let b = Body::new(&value)?;
    let tokens = b
        .array("tokens")?
        .ok_or_else(|| ApiError::invalid("tokens", "`tokens` is required"))?;
    let ids: Vec<u32> = tokens
        .iter()
        .map(|t| {
            t.as_u64()
                .filter(|&v| (v as usize) < state.vocab_size)
                .map(|v| v as u32)
        })
        .collect::<Option<_>>()
        .ok_or_else(|| {
            ApiError::invalid(
                "tokens",
                format!("`tokens` must be token ids below {}", state.vocab_size),
            )
        })?;
    let prompt = state
        .tokenizer
        .decode(&ids, false)
        .map_err(|e| ApiError::invalid("tokens", e.to_string()))?;
    Ok(axum::Json(json!({"prompt": prompt})).into_response())
}

/// `GET /health`: ready (the server only listens once the model is loaded).
pub async fn health() -> Response {
    axum::Json(json!({"status": "ok"})).into_response()
}

/// `GET /metrics`.
pub async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4",
        )],
        state.metrics.render(&state.model_name),
    )
        .into_response()
}

/// OpenAI endpoints this engine does not serve: a clear 501, not a 404.
pub async fn not_supported(uri: axum::http::Uri) -> ApiError {
    ApiError::new(
        StatusCode::NOT_IMPLEMENTED,
        format!(
            "`{}` is not supported by this server (it serves chat completions, completions and Anthropic messages)",
            uri.path()
        ),
    )
}

/// Anything else.
pub async fn not_found(uri: axum::http::Uri) -> ApiError {
    ApiError::new(StatusCode::NOT_FOUND, format!("no route `{}`", uri.path()))
}

/// `GET /openapi.json`: the routes, their request bodies and responses, in OpenAPI 3.1.
pub async fn openapi() -> Response {
    let post = |summary: &str, required: &[&str]| {
        json!({"post": {"summary": summary,
            "requestBody": {"required": true, "content": {"application/json": {"schema": {"type": "object", "required": required}}}},
            "responses": {"200": {"description": "OK (JSON, or text/event-stream when `stream` is true)"},
                          "400": {"description": "invalid request"}, "401": {"description": "missing or wrong bearer token"},
                          "413": {"description": "body over 1 MiB"}, "429": {"description": "queue full"}}}})
    };
    let get = |summary: &str| json!({"get": {"summary": summary, "responses": {"200": {"description": "OK"}}}});
    axum::Json(json!({
        "openapi": "3.1.0",
        "info": {"title": "metrale", "version": env!("CARGO_PKG_VERSION")},
        "paths": {
            "/v1/chat/completions": post("OpenAI chat completions", &["messages"]),
            "/v1/completions": post("OpenAI text completions", &["prompt"]),
            "/v1/messages": post("Anthropic Messages", &["messages", "max_tokens"]),
            "/v1/messages/count_tokens": post("Anthropic token count", &["messages"]),
            "/tokenize": post("Token ids of a prompt or of chat messages", &[]),
            "/detokenize": post("Text of token ids", &["tokens"]),
            "/v1/models": get("The served model"),
            "/v1/models/{id}": get("One model"),
            "/health": get("Readiness"),
            "/health/live": get("Liveness"),
            "/metrics": get("Prometheus metrics"),
        }
    }))
    .into_response()
}
