// SPDX-License-Identifier: MIT OR Apache-2.0
//! `POST /v1/chat/completions` and `POST /v1/completions`.

use std::convert::Infallible;
use std::sync::Arc;

use axum::body::Body as HttpBody;
use axum::extract::State;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::StreamExt;
use metrale_tokenizer::RenderOptions;
use serde_json::{Value, json};
use tokio_stream::StreamMap;
use tokio_stream::wrappers::UnboundedReceiverStream;

use super::constraint::{GrammarRequest, constraint};
use super::engine::{Finish, GenerationRequest, StreamEvent, TokenLogprob};
use super::error::{ApiError, Dialect};
use super::params::{Body, content_text};
use super::reply::{ChatChoiceStream, Reply, ReplyShape, call_id_prefix, ends_in_calls};
use super::state::{
    AppState, chat_prompt, collect, openai_finish, sampling_params, submit_n, token_budget,
    unix_now,
};
use super::structured;
use super::thinking::request_budget;
use super::tools;

/// Refuses a body declared as something other than JSON (a missing Content-Type is accepted).
pub fn check_content_type(
    headers: &axum::http::HeaderMap,
    dialect: Dialect,
) -> Result<(), ApiError> {
    let Some(ct) = headers.get(axum::http::header::CONTENT_TYPE) else {
        return Ok(());
    };
    let mime = ct
        .to_str()
        .unwrap_or("")
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    if mime == "application/json" || mime.ends_with("+json") {
        Ok(())
    } else {
        Err(ApiError::new(
            axum::http::StatusCode::UNSUPPORTED_MEDIA_TYPE,
            format!("Content-Type `{mime}` is not supported: send the body as application/json"),
        )
        .with_dialect(dialect))
    }
}

/// Reads the body (at most [`super::state::BODY_LIMIT`] bytes) as JSON.
pub async fn read_json(body: HttpBody, dialect: Dialect) -> Result<Value, ApiError> {
    let bytes = axum::body::to_bytes(body, super::state::BODY_LIMIT)
        .await
        .map_err(|_| {
            ApiError::new(
                axum::http::StatusCode::PAYLOAD_TOO_LARGE,
                format!(
                    "the request body is larger than {} bytes",
                    super::state::BODY_LIMIT
                ),
            )
            .with_dialect(dialect)
        })?;
    serde_json::from_slice(&bytes).map_err(|e| {
        ApiError::invalid("body", format!("the request body is not valid JSON: {e}"))
            .with_dialect(dialect)
    })
}

fn request_id(prefix: &str) -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(1);
    format!(
        "{prefix}-{:x}{:06x}",
        unix_now(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

const ROLES: [&str; 5] = ["system", "developer", "user", "assistant", "tool"];

/// The messages of a chat request, normalised for the chat template.
pub(super) fn chat_messages(b: &Body) -> Result<Vec<Value>, ApiError> {
    let messages = b
        .array("messages")?
        .ok_or_else(|| ApiError::invalid("messages", "`messages` is required"))?;
    if messages.is_empty() {
        return Err(ApiError::invalid(
            "messages",
            "`messages` must contain at least one message",
        ));
    }
    let mut out = Vec::with_capacity(messages.len());
    for (i, m) in messages.iter().enumerate() {
        let field = format!("messages[{i}]");
        let obj = m
            .as_object()
            .ok_or_else(|| ApiError::invalid(&field, format!("`{field}` must be an object")))?;
        let role = obj.get("role").and_then(Value::as_str).ok_or_else(|| {
            ApiError::invalid(
                format!("{field}.role"),
                format!("`{field}.role` must be a string"),
            )
        })?;
        if !ROLES.contains(&role) {
            return Err(ApiError::invalid(
                format!("{field}.role"),
                format!("`{field}.role` `{role}` is not one of {}", ROLES.join(", ")),
            ));
        }
        let mut msg = obj.clone();
        // Templates expect `system` where OpenAI's newer clients send `developer`.
        if role == "developer" {
            msg.insert("role".into(), "system".into());
        }
        let has_tool_calls = obj.get("tool_calls").is_some_and(|t| !t.is_null());
        if has_tool_calls {
            let tfield = format!("{field}.tool_calls");
            if role != "assistant" {
                return Err(ApiError::invalid(
                    &tfield,
                    format!("`{tfield}` is only allowed on assistant messages"),
                ));
            }
            msg.insert(
                "tool_calls".into(),
                tools::openai_tool_calls(&obj["tool_calls"], &tfield)?,
            );
        }
        if obj
            .get("tool_call_id")
            .is_some_and(|id| !id.is_string() && !id.is_null())
        {
            return Err(ApiError::invalid(
                format!("{field}.tool_call_id"),
                format!("`{field}.tool_call_id` must be a string (the id of the call answered)"),
            ));
        }
        match obj.get("content") {
            None | Some(Value::Null) if role == "assistant" && has_tool_calls => {
                // Templates fail on null content next to tool calls; transformers' callers send "".
                msg.insert("content".into(), "".into());
            }
            None | Some(Value::Null) => {
                return Err(ApiError::invalid(
                    format!("{field}.content"),
                    format!("`{field}.content` is required"),
                ));
            }
            Some(c) => {
                msg.insert(
                    "content".into(),
                    content_text(c, &format!("{field}.content"))?.into(),
                );
            }
        }
        out.push(Value::Object(msg));
    }
    Ok(out)
}

/// Everything both OpenAI routes validate the same way.
struct Common {
    n: usize,
    stream: bool,
    include_usage: bool,
    logprobs: Option<usize>,
}

fn common(b: &Body, chat: bool) -> Result<Common, ApiError> {
    let n = b.int("n", 1, 16)?.unwrap_or(1) as usize;
    let stream = b.bool("stream")?.unwrap_or(false);
    let include_usage = match b.object("stream_options")? {
        Some(o) => match o.get("include_usage") {
            None | Some(Value::Null) => false,
            Some(Value::Bool(v)) => *v,
            Some(_) => {
                return Err(ApiError::invalid(
                    "stream_options.include_usage",
                    "`stream_options.include_usage` must be true or false",
                ));
            }
        },
        None => false,
    };
    let logprobs = if chat {
        let on = b.bool("logprobs")?.unwrap_or(false);
        let top = b.int("top_logprobs", 0, 20)?;
        if top.is_some() && !on {
            return Err(ApiError::invalid(
                "top_logprobs",
                "`top_logprobs` needs `logprobs: true`",
            ));
        }
        on.then(|| top.unwrap_or(0) as usize)
    } else {
        b.int("logprobs", 0, 20)?.map(|v| v as usize)
    };
    b.str("model")?;
    b.str("user")?;
    Ok(Common {
        n,
        stream,
        include_usage,
        logprobs,
    })
}

fn chat_logprobs(state: &AppState, lps: &[TokenLogprob]) -> Value {
    let entry = |id: u32, lp: f32| {
        let token = state.tokenizer.decode(&[id], false).unwrap_or_default();
        json!({"token": token, "logprob": lp, "bytes": token.as_bytes()})
    };
    json!({"content": lps.iter().map(|l| {
        let mut e = entry(l.token, l.logprob);
        e["top_logprobs"] = l.top.iter().map(|&(id, lp)| entry(id, lp)).collect::<Vec<_>>().into();
        e
    }).collect::<Vec<_>>()})
}

fn completion_logprobs(state: &AppState, lps: &[TokenLogprob]) -> Value {
    let tok = |id: u32| state.tokenizer.decode(&[id], false).unwrap_or_default();
    json!({
        "tokens": lps.iter().map(|l| tok(l.token)).collect::<Vec<_>>(),
        "token_logprobs": lps.iter().map(|l| l.logprob).collect::<Vec<_>>(),
        "top_logprobs": lps.iter().map(|l| l.top.iter().map(|&(id, lp)| (tok(id), json!(lp))).collect::<serde_json::Map<_, _>>()).collect::<Vec<_>>(),
    })
}

/// `POST /v1/chat/completions`.
pub async fn chat_completions(
    State(state): State<Arc<AppState>>,
    body: HttpBody,
) -> Result<Response, ApiError> {
    let value = read_json(body, Dialect::OpenAi).await?;
    let b = Body::new(&value)?;
    let messages = chat_messages(&b)?;
    let c = common(&b, true)?;
    let params = sampling_params(&b, &state, 2.0)?;
    let stop = b.stop_list("stop", 16, false)?;
    let tools = tools::openai_tools(&b)?;
    let tool_parser = tools.parser(&state, "tool_choice")?;
    let format = structured::requested(&b)?;
    let extra = b
        .object("chat_template_kwargs")?
        .cloned()
        .unwrap_or_default();
    let enable_thinking = match extra.get("enable_thinking") {
        None | Some(Value::Null) => state.disable_thinking.then_some(false),
        Some(Value::Bool(v)) => Some(*v),
        Some(_) => {
            return Err(ApiError::invalid(
                "chat_template_kwargs.enable_thinking",
                "`chat_template_kwargs.enable_thinking` must be true or false",
            ));
        }
    };
    let thinking_budget = b.int("thinking_budget", 0, i64::MAX)?.map(|v| v as usize);
    let prompt = chat_prompt(
        &state,
        &messages,
        &RenderOptions {
            add_generation_prompt: true,
            tools: tools.for_template(),
            enable_thinking,
            extra,
        },
    )?;
    let requested = match b.int("max_completion_tokens", 1, i64::MAX)? {
        Some(v) => Some(v),
        None => b.int("max_tokens", 1, i64::MAX)?,
    };
    let field = if b.get("max_completion_tokens").is_some() {
        "max_completion_tokens"
    } else {
        "max_tokens"
    };
    let mut max_tokens = token_budget(&state, prompt.ids.len(), requested, field)?;
    if tools.offered() {
        max_tokens = max_tokens.min(state.tool_max_tokens);
    }
    let grammar = constraint(
        &state,
        GrammarRequest {
            tools: Some(&tools),
            requested: format,
            think: prompt.think,
        },
    )
    .await?;
    let req = GenerationRequest {
        thinking: request_budget(&state, prompt.think, thinking_budget),
        turn_boundary: prompt.turn_boundary,
        prompt: prompt.ids,
        params,
        max_tokens,
        stop,
        stop_tokens: state.eos.clone(),
        logprobs: c.logprobs,
        deadline: None,
        grammar,
    };
    let rxs = submit_n(&state, req, c.n, Dialect::OpenAi).await?;
    let id = request_id("chatcmpl");
    let model = b.str("model")?.unwrap_or(&state.model_name).to_string();
    let n = rxs.len();
    let shapes: Vec<ReplyShape> = (0..n)
        .map(|i| ReplyShape {
            tool_parser,
            think: prompt.think,
            call_id_prefix: call_id_prefix("call", &id, i, n),
        })
        .collect();
    if c.stream {
        return Ok(
            stream_openai(state, rxs, id, model, Some(shapes), c.include_usage).into_response(),
        );
    }
    let wants_logprobs = c.logprobs.is_some();
    whole_response(rxs, id, model, "chat.completion", |i, out| {
        let logprobs = if wants_logprobs {
            chat_logprobs(&state, &out.logprobs)
        } else {
            Value::Null
        };
        let reply = Reply::whole(&shapes[i], &out.text);
        let cut = matches!(out.finish, Some(Finish::Length));
        let finish = if ends_in_calls(!reply.tool_calls.is_empty(), cut) {
            "tool_calls".into()
        } else {
            openai_finish(out.finish)
        };
        json!({"index": i, "message": reply.openai_message(), "logprobs": logprobs, "finish_reason": finish})
    })
    .await
}

/// The prompt of a completions request: a string, a one-element list of strings, or token ids.
fn completion_prompt(b: &Body, state: &AppState) -> Result<Vec<u32>, ApiError> {
    let bad = || {
        ApiError::invalid(
            "prompt",
            "`prompt` must be a string, a list of one string, or a list of token ids",
        )
    };
    let prompt = b
        .get("prompt")
        .ok_or_else(|| ApiError::invalid("prompt", "`prompt` is required"))?;
    let ids = match prompt {
        Value::String(s) => state
            .tokenizer
            .encode(s, true)
            .map_err(|e| ApiError::invalid("prompt", e.to_string()))?,
        Value::Array(a) if a.len() == 1 && a[0].is_string() => state
            .tokenizer
            .encode(a[0].as_str().unwrap_or(""), true)
            .map_err(|e| ApiError::invalid("prompt", e.to_string()))?,
        Value::Array(a) if !a.is_empty() && a.iter().all(Value::is_u64) => {
            let ids: Vec<u32> = a
                .iter()
                .filter_map(Value::as_u64)
                .map(|v| v as u32)
                .collect();
            if let Some(bad_id) = ids.iter().find(|&&t| t as usize >= state.vocab_size) {
                return Err(ApiError::invalid(
                    "prompt",
                    format!(
                        "token id {bad_id} is outside the vocabulary of {}",
                        state.vocab_size
                    ),
                ));
            }
            ids
        }
        Value::Array(a) if a.len() > 1 && a.iter().all(Value::is_string) => {
            return Err(ApiError::invalid(
                "prompt",
                "batched prompts (a list of several strings) are not supported; send one request per prompt",
            ));
        }
        _ => return Err(bad()),
    };
    if ids.is_empty() {
        return Err(ApiError::invalid("prompt", "`prompt` encodes to no tokens"));
    }
    Ok(ids)
}

/// `POST /v1/completions`.
pub async fn completions(
    State(state): State<Arc<AppState>>,
    body: HttpBody,
) -> Result<Response, ApiError> {
    let value = read_json(body, Dialect::OpenAi).await?;
    let b = Body::new(&value)?;
    for unsupported in ["suffix", "best_of"] {
        if b.get(unsupported).is_some() {
            return Err(ApiError::invalid(
                unsupported,
                format!("`{unsupported}` is not supported"),
            ));
        }
    }
    if b.bool("echo")?.unwrap_or(false) {
        return Err(ApiError::invalid("echo", "`echo` is not supported"));
    }
    let prompt = completion_prompt(&b, &state)?;
    let c = common(&b, false)?;
    // vLLM's extension: the generated ids with each choice (non-streamed), so that a client can
    // resend exactly what the model produced.
    let return_token_ids = b.bool("return_token_ids")?.unwrap_or(false);
    let requested = structured::requested(&b)?;
    let params = sampling_params(&b, &state, 2.0)?;
    let stop = b.stop_list("stop", 16, false)?;
    let max_tokens = token_budget(
        &state,
        prompt.len(),
        Some(b.int("max_tokens", 1, i64::MAX)?.unwrap_or(16)),
        "max_tokens",
    )?;
    let grammar = constraint(
        &state,
        GrammarRequest {
            tools: None,
            requested,
            think: None,
        },
    )
    .await?;
    let req = GenerationRequest {
        prompt,
        params,
        max_tokens,
        stop,
        stop_tokens: state.eos.clone(),
        logprobs: c.logprobs,
        deadline: None,
        thinking: None,
        grammar,
        turn_boundary: None,
    };
    let rxs = submit_n(&state, req, c.n, Dialect::OpenAi).await?;
    let id = request_id("cmpl");
    let model = b.str("model")?.unwrap_or(&state.model_name).to_string();
    if c.stream {
        return Ok(stream_openai(state, rxs, id, model, None, c.include_usage).into_response());
    }
    let wants_logprobs = c.logprobs.is_some();
    whole_response(rxs, id, model, "text_completion", |i, out| {
        let logprobs = if wants_logprobs { completion_logprobs(&state, &out.logprobs) } else { Value::Null };
        let mut choice = json!({"index": i, "text": out.text, "logprobs": logprobs, "finish_reason": openai_finish(out.finish)});
        if return_token_ids {
            choice["token_ids"] = json!(out.tokens);
        }
        choice
    })
    .await
}

/// OpenAI's `usage`: the prompt counted once, `prompt_tokens_details.cached_tokens` the part of it
/// the prefix cache held (first choice's: the other choices of one prompt hit what it computed).
fn usage(prompt_tokens: usize, cached_tokens: usize, completion_tokens: usize) -> Value {
    json!({
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    })
}

/// Waits for every choice and builds the non-streamed response; usage sums the choices.
async fn whole_response(
    rxs: Vec<tokio::sync::mpsc::UnboundedReceiver<StreamEvent>>,
    id: String,
    model: String,
    object: &str,
    choice: impl Fn(usize, super::state::Collected) -> Value,
) -> Result<Response, ApiError> {
    let mut choices = Vec::new();
    let (mut prompt_tokens, mut cached_tokens, mut completion_tokens) = (0, 0, 0);
    for (i, rx) in rxs.into_iter().enumerate() {
        let out = collect(rx).await?;
        prompt_tokens = out.prompt_tokens;
        if i == 0 {
            cached_tokens = out.cached_tokens;
        }
        completion_tokens += out.completion_tokens;
        choices.push(choice(i, out));
    }
    Ok(axum::Json(json!({
        "id": id,
        "object": object,
        "created": unix_now(),
        "model": model,
        "choices": choices,
        "usage": usage(prompt_tokens, cached_tokens, completion_tokens),
    }))
    .into_response())
}

/// Server-sent events in OpenAI's chunk format, `data: [DONE]` last. `chat` holds each choice's
/// reply shape for chat completions (`None`: text completions).
fn stream_openai(
    state: Arc<AppState>,
    rxs: Vec<tokio::sync::mpsc::UnboundedReceiver<StreamEvent>>,
    id: String,
    model: String,
    chat: Option<Vec<ReplyShape>>,
    include_usage: bool,
) -> Sse<impl futures_util::Stream<Item = Result<Event, Infallible>>> {
    let created = unix_now();
    let object = if chat.is_some() {
        "chat.completion.chunk"
    } else {
        "text_completion"
    };
    let n = rxs.len();
    let mut map = StreamMap::new();
    for (i, rx) in rxs.into_iter().enumerate() {
        map.insert(i, UnboundedReceiverStream::new(rx));
    }
    let chunk = move |choices: Value, usage: Option<Value>| {
        let mut v = json!({"id": id, "object": object, "created": created, "model": model, "choices": choices});
        if let Some(u) = usage {
            v["usage"] = u;
        }
        Event::default().data(v.to_string())
    };
    let choices = chat.map(|shapes| {
        shapes
            .iter()
            .enumerate()
            .map(|(i, shape)| ChatChoiceStream::new(i, shape))
            .collect()
    });
    let stream = async_stream_like(map, n, choices, include_usage, state, chunk);
    Sse::new(stream).keep_alive(KeepAlive::default())
}

/// Turns the engine events into SSE events (a small hand-written state machine over the merged
/// channels, so no extra stream macro crate is needed). Chat choices go through their
/// [`ChatChoiceStream`] (reasoning, content and tool-call deltas); completions pass text through.
fn async_stream_like(
    map: StreamMap<usize, UnboundedReceiverStream<StreamEvent>>,
    n: usize,
    chat: Option<Vec<ChatChoiceStream>>,
    include_usage: bool,
    state: Arc<AppState>,
    chunk: impl Fn(Value, Option<Value>) -> Event + Send + 'static,
) -> impl futures_util::Stream<Item = Result<Event, Infallible>> {
    struct S<F> {
        map: StreamMap<usize, UnboundedReceiverStream<StreamEvent>>,
        pending: std::collections::VecDeque<Event>,
        started: bool,
        done: usize,
        finished: bool,
        n: usize,
        chat: Option<Vec<ChatChoiceStream>>,
        include_usage: bool,
        prompt_tokens: usize,
        cached_tokens: usize,
        completion_tokens: usize,
        state: Arc<AppState>,
        chunk: F,
    }
    let s = S {
        map,
        pending: Default::default(),
        started: false,
        done: 0,
        finished: false,
        n,
        chat,
        include_usage,
        prompt_tokens: 0,
        cached_tokens: 0,
        completion_tokens: 0,
        state,
        chunk,
    };
    futures_util::stream::unfold(s, |mut s| async move {
        loop {
            if let Some(ev) = s.pending.pop_front() {
                return Some((Ok(ev), s));
            }
            if s.finished {
                return None;
            }
            if !s.started && s.chat.is_some() {
                s.started = true;
                for i in 0..s.n {
                    let ev = (s.chunk)(
                        json!([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}]),
                        None,
                    );
                    s.pending.push_back(ev);
                }
                continue;
            }
            if s.done == s.n {
                if s.include_usage {
                    let usage = usage(s.prompt_tokens, s.cached_tokens, s.completion_tokens);
                    s.pending.push_back((s.chunk)(json!([]), Some(usage)));
                }
                s.pending.push_back(Event::default().data("[DONE]"));
                s.finished = true;
                continue;
            }
            let Some((i, ev)) = s.map.next().await else {
                // A channel closed without Done: the engine went away.
                s.pending.push_back(
                    Event::default().data(
                        json!({"error": {"message": "the engine stopped", "type": "server_error"}})
                            .to_string(),
                    ),
                );
                s.pending.push_back(Event::default().data("[DONE]"));
                s.finished = true;
                continue;
            };
            let entries = match ev {
                StreamEvent::Delta { text, logprobs, .. } => {
                    if text.is_empty() && logprobs.is_empty() {
                        continue;
                    }
                    match s.chat.as_mut() {
                        Some(choices) => {
                            let lp = if logprobs.is_empty() {
                                Value::Null
                            } else {
                                chat_logprobs(&s.state, &logprobs)
                            };
                            choices[i].delta(&text, lp)
                        }
                        None => {
                            let lp = if logprobs.is_empty() {
                                Value::Null
                            } else {
                                completion_logprobs(&s.state, &logprobs)
                            };
                            vec![
                                json!({"index": i, "text": text, "logprobs": lp, "finish_reason": null}),
                            ]
                        }
                    }
                }
                StreamEvent::Done {
                    finish,
                    prompt_tokens,
                    cached_tokens,
                    completion_tokens,
                } => {
                    s.done += 1;
                    s.prompt_tokens = prompt_tokens;
                    if i == 0 {
                        s.cached_tokens = cached_tokens;
                    }
                    s.completion_tokens += completion_tokens;
                    let reason = openai_finish(Some(finish));
                    match s.chat.as_mut() {
                        Some(choices) => choices[i].done(reason),
                        None => vec![
                            json!({"index": i, "text": "", "logprobs": null, "finish_reason": reason}),
                        ],
                    }
                }
                StreamEvent::Error(message) => {
                    s.done += 1;
                    s.pending.push_back(Event::default().data(
                        json!({"error": {"message": message, "type": "server_error"}}).to_string(),
                    ));
                    continue;
                }
            };
            for entry in entries {
                s.pending.push_back((s.chunk)(json!([entry]), None));
            }
        }
    })
}
