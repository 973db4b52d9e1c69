// SPDX-License-Identifier: MIT OR Apache-2.0
//! `POST /v1/messages` (Anthropic Messages) and `/v1/messages/count_tokens`.

use std::convert::Infallible;
use std::sync::Arc;

use axum::body::Body as HttpBody;
use axum::extract::State;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use metrale_tokenizer::RenderOptions;
use serde_json::{Value, json};

use super::engine::{Finish, GenerationRequest, StreamEvent};
use super::error::{ApiError, Dialect};
use super::openai::read_json;
use super::params::{Body, content_text};
use super::state::{AppState, collect, sampling_params, submit_n, token_budget, unix_now};

fn anthropic(e: ApiError) -> ApiError {
    e.with_dialect(Dialect::Anthropic)
}

/// The prompt ids of a Messages request (system + messages through the chat template).
fn prompt_of(b: &Body, state: &AppState) -> Result<Vec<u32>, ApiError> {
    let messages = b
        .array("messages")?
        .ok_or_else(|| ApiError::invalid("messages", "`messages` is required"))?;
    if messages.is_empty() {
        return Err(ApiError::invalid(
            "messages",
            "`messages` must contain at least one message",
        ));
    }
    let mut chat = Vec::new();
    if let Some(system) = b.get("system") {
        chat.push(json!({"role": "system", "content": content_text(system, "system")?}));
    }
    for (i, m) in messages.iter().enumerate() {
        let field = format!("messages[{i}]");
        let role = m.get("role").and_then(Value::as_str).ok_or_else(|| {
            ApiError::invalid(
                format!("{field}.role"),
                format!("`{field}.role` must be a string"),
            )
        })?;
        if role != "user" && role != "assistant" {
            return Err(ApiError::invalid(
                format!("{field}.role"),
                format!("`{field}.role` `{role}` must be `user` or `assistant`"),
            ));
        }
        let content = m.get("content").ok_or_else(|| {
            ApiError::invalid(
                format!("{field}.content"),
                format!("`{field}.content` is required"),
            )
        })?;
        chat.push(
            json!({"role": role, "content": content_text(content, &format!("{field}.content"))?}),
        );
    }
    let template = state
        .tokenizer
        .chat_template()
        .ok_or_else(|| ApiError::invalid("messages", "this model has no chat template"))?;
    let text = template
        .render(
            &chat,
            &RenderOptions {
                add_generation_prompt: true,
                ..Default::default()
            },
        )
        .map_err(|e| {
            ApiError::invalid(
                "messages",
                format!("the chat template refused these messages: {e}"),
            )
        })?;
    state
        .tokenizer
        .encode(&text, false)
        .map_err(|e| ApiError::invalid("messages", e.to_string()))
}

fn stop_reason(f: Option<Finish>) -> &'static str {
    match f {
        Some(Finish::StopString(_)) => "stop_sequence",
        Some(Finish::Length) => "max_tokens",
        _ => "end_turn",
    }
}

/// `POST /v1/messages`.
pub async fn messages(
    State(state): State<Arc<AppState>>,
    body: HttpBody,
) -> Result<Response, ApiError> {
    let value = read_json(body, Dialect::Anthropic).await?;
    let b = Body::new(&value).map_err(anthropic)?;
    let prompt = prompt_of(&b, &state).map_err(anthropic)?;
    let max_tokens = b
        .int("max_tokens", 1, i64::MAX)
        .map_err(anthropic)?
        .ok_or_else(|| anthropic(ApiError::invalid("max_tokens", "`max_tokens` is required")))?;
    let max_tokens =
        token_budget(&state, prompt.len(), Some(max_tokens), "max_tokens").map_err(anthropic)?;
    let params = sampling_params(&b, &state, 1.0).map_err(anthropic)?;
    let stop = b.stop_list("stop_sequences", 16, true).map_err(anthropic)?;
    let stream = b.bool("stream").map_err(anthropic)?.unwrap_or(false);
    let model = b
        .str("model")
        .map_err(anthropic)?
        .unwrap_or(&state.model_name)
        .to_string();
    let input_tokens = prompt.len();
    let req = GenerationRequest {
        prompt,
        params,
        max_tokens,
        stop: stop.clone(),
        stop_tokens: state.eos.clone(),
        logprobs: None,
        deadline: None,
    };
    let mut rxs = submit_n(&state, req, 1, Dialect::Anthropic).await?;
    let rx = rxs.pop().expect("one receiver");
    let id = format!("msg_{:x}{:08x}", unix_now(), rand_suffix());
    if !stream {
        let out = collect(rx).await.map_err(anthropic)?;
        let stop_sequence = match out.finish {
            Some(Finish::StopString(i)) => {
                stop.get(i).cloned().map(Value::from).unwrap_or(Value::Null)
            }
            _ => Value::Null,
        };
        return Ok(axum::Json(json!({
            "id": id,
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": [{"type": "text", "text": out.text}],
            "stop_reason": stop_reason(out.finish),
            "stop_sequence": stop_sequence,
            "usage": {"input_tokens": out.prompt_tokens, "output_tokens": out.completion_tokens},
        }))
        .into_response());
    }
    Ok(stream_anthropic(rx, id, model, stop, input_tokens).into_response())
}

fn rand_suffix() -> u32 {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

fn event(name: &str, data: Value) -> Event {
    Event::default().event(name).data(data.to_string())
}

fn stream_anthropic(
    rx: tokio::sync::mpsc::UnboundedReceiver<StreamEvent>,
    id: String,
    model: String,
    stop: Vec<String>,
    input_tokens: usize,
) -> Sse<impl futures_util::Stream<Item = Result<Event, Infallible>>> {
    struct S {
        rx: tokio::sync::mpsc::UnboundedReceiver<StreamEvent>,
        pending: std::collections::VecDeque<Event>,
        started: bool,
        finished: bool,
        id: String,
        model: String,
        stop: Vec<String>,
        input_tokens: usize,
    }
    let s = S {
        rx,
        pending: Default::default(),
        started: false,
        finished: false,
        id,
        model,
        stop,
        input_tokens,
    };
    let stream = futures_util::stream::unfold(s, |mut s| async move {
        loop {
            if let Some(ev) = s.pending.pop_front() {
                return Some((Ok(ev), s));
            }
            if s.finished {
                return None;
            }
            let ev = s.rx.recv().await;
            if !s.started {
                s.started = true;
                s.pending.push_back(event("message_start", json!({"type": "message_start", "message": {
                    "id": s.id, "type": "message", "role": "assistant", "model": s.model, "content": [],
                    "stop_reason": null, "stop_sequence": null, "usage": {"input_tokens": s.input_tokens, "output_tokens": 0}}})));
                s.pending.push_back(event("content_block_start", json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}})));
            }
            match ev {
                Some(StreamEvent::Delta { text, .. }) => {
                    if !text.is_empty() {
                        s.pending.push_back(event("content_block_delta", json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": text}})));
                    }
                }
                Some(StreamEvent::Done {
                    finish,
                    prompt_tokens,
                    completion_tokens,
                }) => {
                    let stop_sequence = match finish {
                        Finish::StopString(i) => s
                            .stop
                            .get(i)
                            .cloned()
                            .map(Value::from)
                            .unwrap_or(Value::Null),
                        _ => Value::Null,
                    };
                    s.pending.push_back(event(
                        "content_block_stop",
                        json!({"type": "content_block_stop", "index": 0}),
                    ));
                    s.pending.push_back(event("message_delta", json!({"type": "message_delta",
                        "delta": {"stop_reason": stop_reason(Some(finish)), "stop_sequence": stop_sequence},
                        "usage": {"input_tokens": prompt_tokens, "output_tokens": completion_tokens}})));
                    s.pending
                        .push_back(event("message_stop", json!({"type": "message_stop"})));
                    s.finished = true;
                }
                Some(StreamEvent::Error(message)) => {
                    s.pending.push_back(event("error", json!({"type": "error", "error": {"type": "api_error", "message": message}})));
                    s.finished = true;
                }
                None => {
                    s.pending.push_back(event("error", json!({"type": "error", "error": {"type": "api_error", "message": "the engine stopped"}})));
                    s.finished = true;
                }
            }
        }
    });
    Sse::new(stream).keep_alive(KeepAlive::default())
}

/// `POST /v1/messages/count_tokens`.
pub async fn count_tokens(
    State(state): State<Arc<AppState>>,
    body: HttpBody,
) -> Result<Response, ApiError> {
    let value = read_json(body, Dialect::Anthropic).await?;
    let b = Body::new(&value).map_err(anthropic)?;
    let prompt = prompt_of(&b, &state).map_err(anthropic)?;
    Ok(axum::Json(json!({"input_tokens": prompt.len()})).into_response())
}
