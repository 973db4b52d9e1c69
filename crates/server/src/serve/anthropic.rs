// SPDX-License-Identifier: MIT OR Apache-2.0
//! `POST /v1/messages` (Anthropic Messages) and `/v1/messages/count_tokens`.
//!
//! A conversation's content blocks map onto the OpenAI-shaped messages chat templates take:
//! `tool_use` blocks become an assistant's `tool_calls`, `tool_result` blocks `role: tool`
//! messages, `thinking` blocks its `reasoning_content`; `tools` become OpenAI function tools. The
//! answer is read like a chat completion's ([`super::reply`]) and written as thinking, text and
//! tool_use blocks, `stop_reason: "tool_use"` when it made calls (unless `max_tokens` cut it).

use std::convert::Infallible;
use std::sync::Arc;

use axum::body::Body as HttpBody;
use axum::extract::State;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use std::collections::HashMap;

use metrale_tokenizer::RenderOptions;
use serde_json::{Value, json};

use super::constraint::{GrammarRequest, constraint};
use super::engine::{Finish, GenerationRequest, StreamEvent};
use super::error::{ApiError, Dialect};
use super::openai::read_json;
use super::params::{Body, content_text};
use super::reply::{
    BlockOp, BlockWriter, ReplyShape, ReplyStream, call_id_prefix, ends_in_calls, fold_blocks,
};
use super::state::{
    AppState, ChatPrompt, chat_prompt, collect, sampling_params, submit_n, token_budget, unix_now,
};
use super::thinking::request_budget;
use super::tools::{Tools, anthropic_tools};

fn anthropic(e: ApiError) -> ApiError {
    e.with_dialect(Dialect::Anthropic)
}

/// A Messages request's conversation, through the chat template.
struct Prepared {
    prompt: ChatPrompt,
    tools: Tools,
    /// `thinking.budget_tokens`.
    budget_tokens: Option<usize>,
}

/// `thinking`: `{"type": "enabled", "budget_tokens": N}` or `{"type": "disabled"}`; absent, the
/// server's default. Returns the template's `enable_thinking` and the request's budget.
fn thinking(b: &Body, state: &AppState) -> Result<(Option<bool>, Option<usize>), ApiError> {
    let Some(o) = b.object("thinking")? else {
        return Ok((state.disable_thinking.then_some(false), None));
    };
    match o.get("type").and_then(Value::as_str) {
        Some("enabled") => {
            let budget = o
                .get("budget_tokens")
                .and_then(Value::as_u64)
                .filter(|&n| n >= 1)
                .ok_or_else(|| {
                    ApiError::invalid(
                        "thinking.budget_tokens",
                        "`thinking.budget_tokens` must be a positive integer when thinking is enabled",
                    )
                })?;
            Ok((Some(true), Some(budget as usize)))
        }
        Some("disabled") => Ok((Some(false), None)),
        _ => Err(ApiError::invalid(
            "thinking.type",
            "`thinking.type` must be `enabled` or `disabled`",
        )),
    }
}

/// The text of a block's string field.
fn block_str<'a>(block: &'a Value, key: &str, field: &str) -> Result<&'a str, ApiError> {
    block.get(key).and_then(Value::as_str).ok_or_else(|| {
        ApiError::invalid(
            format!("{field}.{key}"),
            format!("`{field}.{key}` must be a string"),
        )
    })
}

/// A user message's content blocks: text becomes user turns, each `tool_result` a `role: tool`
/// message (named after the `tool_use` it answers, when the conversation has it), in order.
fn user_blocks(
    blocks: &[Value],
    field: &str,
    call_names: &HashMap<String, String>,
    chat: &mut Vec<Value>,
) -> Result<(), ApiError> {
    let mut text: Option<String> = None;
    let before = chat.len();
    for (k, block) in blocks.iter().enumerate() {
        let bfield = format!("{field}[{k}]");
        match block_str(block, "type", &bfield)? {
            "text" => text
                .get_or_insert_with(String::new)
                .push_str(block_str(block, "text", &bfield)?),
            "tool_result" => {
                if let Some(t) = text.take() {
                    chat.push(json!({"role": "user", "content": t}));
                }
                let id = block_str(block, "tool_use_id", &bfield)?;
                let content = match block.get("content") {
                    None | Some(Value::Null) => String::new(),
                    Some(c) => content_text(c, &format!("{bfield}.content"))?,
                };
                if block
                    .get("is_error")
                    .is_some_and(|e| !e.is_boolean() && !e.is_null())
                {
                    return Err(ApiError::invalid(
                        format!("{bfield}.is_error"),
                        format!("`{bfield}.is_error` must be true or false"),
                    ));
                }
                chat.push(json!({"role": "tool", "tool_call_id": id, "name": call_names.get(id), "content": content}));
            }
            other => {
                return Err(ApiError::invalid(
                    format!("{bfield}.type"),
                    format!(
                        "`{bfield}.type` `{other}` is not supported in user messages (text, tool_result)"
                    ),
                ));
            }
        }
    }
    if let Some(t) = text {
        chat.push(json!({"role": "user", "content": t}));
    } else if chat.len() == before {
        chat.push(json!({"role": "user", "content": ""}));
    }
    Ok(())
}

/// An assistant message's content blocks: text, thinking (as `reasoning_content`) and
/// `tool_use` (as `tool_calls` with object arguments, as templates take them).
fn assistant_blocks(
    blocks: &[Value],
    field: &str,
    call_names: &mut HashMap<String, String>,
) -> Result<Value, ApiError> {
    let (mut content, mut reasoning, mut calls) = (String::new(), String::new(), Vec::new());
    for (k, block) in blocks.iter().enumerate() {
        let bfield = format!("{field}[{k}]");
        match block_str(block, "type", &bfield)? {
            "text" => content.push_str(block_str(block, "text", &bfield)?),
            "thinking" => reasoning.push_str(block_str(block, "thinking", &bfield)?),
            "redacted_thinking" => {}
            "tool_use" => {
                let id = block_str(block, "id", &bfield)?;
                let name = block_str(block, "name", &bfield)?;
                let input = match block.get("input") {
                    None | Some(Value::Null) => json!({}),
                    Some(v @ Value::Object(_)) => v.clone(),
                    Some(_) => {
                        return Err(ApiError::invalid(
                            format!("{bfield}.input"),
                            format!("`{bfield}.input` must be an object"),
                        ));
                    }
                };
                call_names.insert(id.to_owned(), name.to_owned());
                calls.push(json!({"id": id, "type": "function", "function": {"name": name, "arguments": input}}));
            }
            other => {
                return Err(ApiError::invalid(
                    format!("{bfield}.type"),
                    format!(
                        "`{bfield}.type` `{other}` is not supported in assistant messages (text, thinking, tool_use)"
                    ),
                ));
            }
        }
    }
    let mut message = json!({"role": "assistant", "content": content});
    if !reasoning.is_empty() {
        message["reasoning_content"] = reasoning.into();
    }
    if !calls.is_empty() {
        message["tool_calls"] = calls.into();
    }
    Ok(message)
}

/// The conversation of a Messages request in the OpenAI shape templates take.
fn conversation(b: &Body) -> Result<Vec<Value>, ApiError> {
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
    let mut call_names = HashMap::new();
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
        let cfield = format!("{field}.content");
        let content = m
            .get("content")
            .ok_or_else(|| ApiError::invalid(&cfield, format!("`{cfield}` is required")))?;
        match (content, role) {
            (Value::Array(blocks), "user") => user_blocks(blocks, &cfield, &call_names, &mut chat)?,
            (Value::Array(blocks), _) => {
                chat.push(assistant_blocks(blocks, &cfield, &mut call_names)?)
            }
            (c, _) => chat.push(json!({"role": role, "content": content_text(c, &cfield)?})),
        }
    }
    Ok(chat)
}

/// Checks a Messages request's conversation, tools and thinking, and renders the prompt.
fn prepare(b: &Body, state: &AppState) -> Result<Prepared, ApiError> {
    let chat = conversation(b)?;
    let tools = anthropic_tools(b)?;
    let (enable_thinking, budget_tokens) = thinking(b, state)?;
    let prompt = chat_prompt(
        state,
        &chat,
        &RenderOptions {
            add_generation_prompt: true,
            tools: tools.for_template(),
            enable_thinking,
            ..Default::default()
        },
    )?;
    Ok(Prepared {
        prompt,
        tools,
        budget_tokens,
    })
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
    let p = prepare(&b, &state).map_err(anthropic)?;
    let max_tokens = b
        .int("max_tokens", 1, i64::MAX)
        .map_err(anthropic)?
        .ok_or_else(|| anthropic(ApiError::invalid("max_tokens", "`max_tokens` is required")))?;
    let mut max_tokens = token_budget(&state, p.prompt.ids.len(), Some(max_tokens), "max_tokens")
        .map_err(anthropic)?;
    if p.tools.offered() {
        max_tokens = max_tokens.min(state.tool_max_tokens);
    }
    let tool_parser = p.tools.parser(&state, "tool_choice").map_err(anthropic)?;
    let params = sampling_params(&b, &state, 1.0).map_err(anthropic)?;
    let stop = b.stop_list("stop_sequences", 16, true).map_err(anthropic)?;
    let stream = b.bool("stream").map_err(anthropic)?.unwrap_or(false);
    let model = b
        .str("model")
        .map_err(anthropic)?
        .unwrap_or(&state.model_name)
        .to_string();
    let input_tokens = p.prompt.ids.len();
    let think = p.prompt.think;
    let grammar = constraint(
        &state,
        GrammarRequest {
            tools: Some(&p.tools),
            requested: None,
            think,
        },
    )
    .await
    .map_err(anthropic)?;
    let req = GenerationRequest {
        thinking: request_budget(&state, think, p.budget_tokens),
        turn_boundary: p.prompt.turn_boundary,
        prompt: p.prompt.ids,
        params,
        max_tokens,
        stop: stop.clone(),
        stop_tokens: state.eos.clone(),
        logprobs: None,
        deadline: None,
        grammar,
    };
    let mut rxs = submit_n(&state, req, 1, Dialect::Anthropic).await?;
    let rx = rxs.pop().expect("one receiver");
    let id = format!("msg_{:x}{:08x}", unix_now(), rand_suffix());
    let shape = ReplyShape {
        tool_parser,
        think,
        call_id_prefix: call_id_prefix("toolu", &id, 0, 1),
    };
    if !stream {
        let out = collect(rx).await.map_err(anthropic)?;
        let stop_sequence = match out.finish {
            Some(Finish::StopString(i)) => {
                stop.get(i).cloned().map(Value::from).unwrap_or(Value::Null)
            }
            _ => Value::Null,
        };
        let mut reply = ReplyStream::new(&shape);
        let mut blocks = BlockWriter::default();
        let mut ops = blocks.apply(reply.push(&out.text));
        ops.extend(blocks.apply(reply.finish()));
        ops.extend(blocks.finish());
        let cut = matches!(out.finish, Some(Finish::Length));
        let stop_reason = if ends_in_calls(reply.made_calls(), cut) {
            "tool_use"
        } else {
            stop_reason(out.finish)
        };
        return Ok(axum::Json(json!({
            "id": id,
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": fold_blocks(&ops),
            "stop_reason": stop_reason,
            "stop_sequence": stop_sequence,
            "usage": usage(out.prompt_tokens, out.cached_tokens, out.completion_tokens),
        }))
        .into_response());
    }
    Ok(stream_anthropic(rx, id, model, stop, input_tokens, shape).into_response())
}

/// Anthropic's `usage`: as Anthropic counts, `input_tokens` are the prompt tokens not read from
/// the cache and `cache_read_input_tokens` those that were (their sum is the prompt); nothing is
/// written to a cache at a price here, so `cache_creation_input_tokens` is 0.
fn usage(prompt_tokens: usize, cached_tokens: usize, output_tokens: usize) -> Value {
    json!({
        "input_tokens": prompt_tokens - cached_tokens,
        "output_tokens": output_tokens,
        "cache_read_input_tokens": cached_tokens,
        "cache_creation_input_tokens": 0,
    })
}

fn rand_suffix() -> u32 {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

fn event(name: &str, data: Value) -> Event {
    Event::default().event(name).data(data.to_string())
}

/// A content-block step as an SSE event.
fn block_event(op: BlockOp) -> Event {
    match op {
        BlockOp::Start { index, block } => event(
            "content_block_start",
            json!({"type": "content_block_start", "index": index, "content_block": block}),
        ),
        BlockOp::Delta { index, delta } => event(
            "content_block_delta",
            json!({"type": "content_block_delta", "index": index, "delta": delta}),
        ),
        BlockOp::Stop { index } => event(
            "content_block_stop",
            json!({"type": "content_block_stop", "index": index}),
        ),
    }
}

fn stream_anthropic(
    rx: tokio::sync::mpsc::UnboundedReceiver<StreamEvent>,
    id: String,
    model: String,
    stop: Vec<String>,
    input_tokens: usize,
    shape: ReplyShape,
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
        reply: ReplyStream,
        blocks: BlockWriter,
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
        reply: ReplyStream::new(&shape),
        blocks: BlockWriter::default(),
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
            }
            match ev {
                Some(StreamEvent::Delta { text, .. }) => {
                    let ops = s.blocks.apply(s.reply.push(&text));
                    s.pending.extend(ops.into_iter().map(block_event));
                }
                Some(StreamEvent::Done {
                    finish,
                    prompt_tokens,
                    cached_tokens,
                    completion_tokens,
                }) => {
                    let mut ops = s.blocks.apply(s.reply.finish());
                    ops.extend(s.blocks.finish());
                    s.pending.extend(ops.into_iter().map(block_event));
                    let stop_sequence = match finish {
                        Finish::StopString(i) => s
                            .stop
                            .get(i)
                            .cloned()
                            .map(Value::from)
                            .unwrap_or(Value::Null),
                        _ => Value::Null,
                    };
                    let cut = matches!(finish, Finish::Length);
                    let stop_reason = if ends_in_calls(s.reply.made_calls(), cut) {
                        "tool_use"
                    } else {
                        stop_reason(Some(finish))
                    };
                    s.pending.push_back(event(
                        "message_delta",
                        json!({"type": "message_delta",
                        "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                        "usage": usage(prompt_tokens, cached_tokens, completion_tokens)}),
                    ));
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
    let p = prepare(&b, &state).map_err(anthropic)?;
    Ok(axum::Json(json!({"input_tokens": p.prompt.ids.len()})).into_response())
}

#[cfg(test)]
mod tests {
    use metrale_tokenizer::ChatTemplate;

    use super::*;

    /// Qwen3's chat template, from the pinned test data (scripts/fetch-test-data.sh).
    fn qwen3_template() -> ChatTemplate {
        let dir = std::env::var_os("METRALE_TEST_DATA")
            .map(std::path::PathBuf::from)
            .unwrap_or_else(|| {
                std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../.cache/test-data")
            });
        let path = dir.join("qwen3-tokenizer/tokenizer_config.json");
        let text = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("{}: {e}; run scripts/fetch-test-data.sh", path.display()));
        let config: Value = serde_json::from_str(&text).unwrap();
        ChatTemplate::new(
            config["chat_template"].as_str().unwrap(),
            None,
            Some("<|im_end|>".into()),
        )
        .unwrap()
    }

    fn render(messages: &[Value], tools: Vec<Value>) -> String {
        qwen3_template()
            .render(
                messages,
                &RenderOptions {
                    add_generation_prompt: true,
                    tools: Some(tools),
                    ..Default::default()
                },
            )
            .unwrap()
    }

    /// One tool round trip, as each API spells it, renders to one prompt: the call's arguments
    /// as the object the template dumps (not a JSON string inside a string), the result as a
    /// `<tool_response>`.
    #[test]
    fn a_tool_round_trip_renders_the_same_from_both_apis() {
        let openai = json!({"messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": "{\"location\": \"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "{\"temperature\": 15}"},
        ]});
        let anthropic = json!({"system": "Be brief.", "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                "input": {"location": "Paris"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                "content": [{"type": "text", "text": "{\"temperature\": 15}"}]}]},
        ]});
        let tools = vec![
            json!({"type": "function", "function": {"name": "get_weather",
            "parameters": {"type": "object", "properties": {"location": {"type": "string"}}}}}),
        ];
        let from_openai = render(
            &crate::serve::openai::chat_messages(&Body::new(&openai).unwrap()).unwrap(),
            tools.clone(),
        );
        let chat = conversation(&Body::new(&anthropic).unwrap()).unwrap();
        assert_eq!(chat[3]["role"], "tool");
        assert_eq!(chat[3]["name"], "get_weather", "named after its tool_use");
        let from_anthropic = render(&chat, tools);
        assert_eq!(from_openai, from_anthropic);
        assert!(
            from_openai.contains(
                "<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"location\": \"Paris\"}}\n</tool_call><|im_end|>\n"
            ),
            "{from_openai}"
        );
        assert!(
            from_openai.contains(
                "<|im_start|>user\n<tool_response>\n{\"temperature\": 15}\n</tool_response><|im_end|>\n"
            ),
            "{from_openai}"
        );
        assert!(from_openai.contains("# Tools"), "{from_openai}");
    }

    #[test]
    fn content_blocks_map_to_template_messages() {
        let body = json!({"messages": [
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "hmm", "signature": "x"},
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": "42"},
                {"type": "text", "text": "Thanks."}]},
        ]});
        let chat = conversation(&Body::new(&body).unwrap()).unwrap();
        assert_eq!(
            chat,
            vec![
                json!({"role": "assistant", "content": "Checking.", "reasoning_content": "hmm",
                    "tool_calls": [{"id": "t1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]}),
                json!({"role": "tool", "tool_call_id": "t1", "name": "f", "content": "42"}),
                json!({"role": "user", "content": "Thanks."}),
            ]
        );
        let bad =
            json!({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]});
        let e = conversation(&Body::new(&bad).unwrap()).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[0].content[0].type"));
        let bad = json!({"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]});
        let e = conversation(&Body::new(&bad).unwrap()).unwrap_err();
        assert_eq!(
            e.param.as_deref(),
            Some("messages[0].content[0].tool_use_id")
        );
    }
}
