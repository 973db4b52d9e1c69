// SPDX-License-Identifier: MIT OR Apache-2.0
//! What every handler shares, and the request pieces common to both APIs.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::http::StatusCode;
use metrale_config::SamplingPresets;
use metrale_sampling::SamplingParams;
use metrale_tokenizer::{RenderOptions, Tokenizer};
use metrale_toolcall::ThinkStart;
use serde_json::Value;
use tokio::sync::mpsc;

use super::constraint::GrammarSupport;
use super::engine::{
    EngineHandle, Finish, GenerationRequest, StreamEvent, SubmitError, TokenLogprob,
};
use super::error::{ApiError, Dialect};
use super::metrics::Metrics;
use super::params::Body;
use super::reply::think_start;

/// Largest accepted request body.
pub const BODY_LIMIT: usize = 1 << 20;

/// Shared by all handlers.
pub struct AppState {
    /// The engine.
    pub engine: EngineHandle,
    /// The model's tokenizer and chat template.
    pub tokenizer: Arc<Tokenizer>,
    /// The name `/v1/models` reports.
    pub model_name: String,
    /// Longest sequence, tokens.
    pub max_seq_len: usize,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// End-of-sequence ids.
    pub eos: Vec<u32>,
    /// The model's sampling presets (crates/config/src/presets.rs).
    pub presets: SamplingPresets,
    /// Per-request time limit.
    pub request_timeout: Option<Duration>,
    /// Metrics.
    pub metrics: Arc<Metrics>,
    /// Tool-call wire format for requests with tools (`--tool-call-parser`, else the family's preset).
    pub tool_parser: Option<metrale_toolcall::Format>,
    /// Whether chat answers are split at `<think>` blocks into `reasoning_content` and thinking
    /// blocks (`--reasoning-parser`, else the family's preset).
    pub reasoning: bool,
    /// Render chat templates with `enable_thinking=false` unless a request says otherwise
    /// (`--disable-thinking`).
    pub disable_thinking: bool,
    /// The server's cap on reasoning tokens per sequence (`--max-thinking-budget`, else
    /// the family's preset); requests may lower it.
    pub max_thinking_budget: Option<usize>,
    /// Token ids of `\n</think>\n\n`, appended when a thinking budget runs out.
    pub think_close: Vec<u32>,
    /// Cap on `max_tokens` for requests that offer tools (`--tool-max-tokens`).
    pub tool_max_tokens: usize,
    /// Constrained decoding: the grammar engine, `--tool-grammar` and the tool-call wire.
    pub grammar: GrammarSupport,
    /// Server start, seconds since the epoch (the `created` of the model).
    pub created: u64,
}

/// Seconds since the epoch.
pub fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Sampling fields shared by the OpenAI routes (Anthropic maps its own onto the same struct).
pub fn sampling_params(
    b: &Body,
    state: &AppState,
    temperature_max: f64,
) -> Result<SamplingParams, ApiError> {
    let p = &state.presets;
    let top_k = match b.int("top_k", -1, 1 << 20)? {
        Some(k) if k > 0 => Some(k as u32),
        Some(_) => None,
        None => p.top_k,
    };
    let mut logit_bias = Vec::new();
    if let Some(bias) = b.object("logit_bias")? {
        if bias.len() > 1024 {
            return Err(ApiError::invalid(
                "logit_bias",
                "`logit_bias` may hold at most 1024 entries",
            ));
        }
        for (k, v) in bias {
            let id: u32 = k.parse().map_err(|_| {
                ApiError::invalid(
                    "logit_bias",
                    format!("`logit_bias` key `{k}` is not a token id"),
                )
            })?;
            if id as usize >= state.vocab_size {
                return Err(ApiError::invalid(
                    "logit_bias",
                    format!(
                        "`logit_bias` token id {id} is outside the vocabulary of {}",
                        state.vocab_size
                    ),
                ));
            }
            let v = v
                .as_f64()
                .filter(|v| (-100.0..=100.0).contains(v))
                .ok_or_else(|| {
                    ApiError::invalid(
                        "logit_bias",
                        format!(
                            "`logit_bias` value for {id} must be a number between -100 and 100"
                        ),
                    )
                })?;
            logit_bias.push((id, v as f32));
        }
    }
    let params = SamplingParams {
        temperature: b
            .num("temperature", 0.0, temperature_max)?
            .map(|v| v as f32)
            .or(p.temperature)
            .unwrap_or(1.0),
        top_p: b
            .num("top_p", 0.0, 1.0)?
            .map(|v| v as f32)
            .or(p.top_p)
            .unwrap_or(1.0),
        top_k,
        min_p: b
            .num("min_p", 0.0, 1.0)?
            .map(|v| v as f32)
            .or(p.min_p)
            .unwrap_or(0.0),
        repetition_penalty: b
            .num("repetition_penalty", 0.01, 10.0)?
            .map(|v| v as f32)
            .or(p.repetition_penalty)
            .unwrap_or(1.0),
        presence_penalty: b.num("presence_penalty", -2.0, 2.0)?.unwrap_or(0.0) as f32,
        frequency_penalty: b.num("frequency_penalty", -2.0, 2.0)?.unwrap_or(0.0) as f32,
        logit_bias,
        seed: b.int("seed", i64::MIN, i64::MAX)?.map(|s| s as u64),
    };
    if params.top_p <= 0.0 {
        return Err(ApiError::invalid("top_p", "`top_p` must be greater than 0"));
    }
    params
        .validate(state.vocab_size)
        .map_err(|e| ApiError::invalid("sampling", e.to_string()))?;
    Ok(params)
}

/// A conversation through the chat template and the tokenizer.
pub struct ChatPrompt {
    /// Prompt ids.
    pub ids: Vec<u32>,
    /// Where the answer starts relative to a `<think>` block; `None` when the reasoning parser
    /// is off.
    pub think: Option<ThinkStart>,
    /// The prompt's tokens before the template's generation prompt (the assistant turn's
    /// opening, `<|im_start|>assistant\n` and any `<think>` block the template opens): where a
    /// later turn of this conversation is sure to agree with this one's tokens, since templates
    /// may render an earlier answer's turn otherwise than the generation prompt started it
    /// (Qwen3's and Qwen3.5's drop its `<think>` block). A hybrid model snapshots its state
    /// there. `None` when the rendering without the generation prompt is not a token prefix of
    /// this one.
    pub turn_boundary: Option<usize>,
}

/// Renders `messages` (OpenAI-shaped, as templates take them) and tokenizes the result.
pub fn chat_prompt(
    state: &AppState,
    messages: &[Value],
    options: &RenderOptions,
) -> Result<ChatPrompt, ApiError> {
    let template = state.tokenizer.chat_template().ok_or_else(|| {
        ApiError::invalid(
            "messages",
            "this model has no chat template; use /v1/completions",
        )
    })?;
    let text = template.render(messages, options).map_err(|e| {
        ApiError::invalid(
            "messages",
            format!("the chat template refused these messages: {e}"),
        )
    })?;
    let ids = state
        .tokenizer
        .encode(&text, false)
        .map_err(|e| ApiError::invalid("messages", e.to_string()))?;
    let turn_boundary = if options.add_generation_prompt {
        turn_boundary(state, template, messages, options, &text, &ids)
    } else {
        Some(ids.len())
    };
    Ok(ChatPrompt {
        ids,
        think: state.reasoning.then(|| think_start(&text)),
        turn_boundary,
    })
}

/// Where the generation prompt starts in `ids` (the rendering of `messages` with it): the
/// rendering without it must be a text prefix, and the rest must tokenize to the last ids (the
/// generation prompt opens with a special token in the templates we serve, so tokenization does
/// not merge across the seam). Only a hint: a wrong one costs a snapshot in a useless place.
fn turn_boundary(
    state: &AppState,
    template: &metrale_tokenizer::ChatTemplate,
    messages: &[Value],
    options: &RenderOptions,
    text: &str,
    ids: &[u32],
) -> Option<usize> {
    let without = RenderOptions {
        add_generation_prompt: false,
        ..options.clone()
    };
    let base = template.render(messages, &without).ok()?;
    let opening = text.strip_prefix(base.as_str())?;
    let tail = state.tokenizer.encode(opening, false).ok()?;
    ids.ends_with(&tail).then(|| ids.len() - tail.len())
}

/// Checks the prompt fits and works out the token budget.
pub fn token_budget(
    state: &AppState,
    prompt_len: usize,
    requested: Option<i64>,
    field: &str,
) -> Result<usize, ApiError> {
    if prompt_len + 1 > state.max_seq_len {
        return Err(ApiError::invalid(
            "messages",
            format!(
                "the prompt is {prompt_len} tokens but this server's context is {} tokens (prompt plus at least one generated token)",
                state.max_seq_len
            ),
        ));
    }
    let room = state.max_seq_len - prompt_len;
    Ok(match requested {
        Some(n) => {
            let n = n as usize;
            if n > room {
                return Err(ApiError::invalid(
                    field,
                    format!(
                        "`{field}` = {n} does not fit: the prompt is {prompt_len} tokens and the context is {} tokens, leaving {room}",
                        state.max_seq_len
                    ),
                ));
            }
            n
        }
        None => room,
    })
}

/// Submits `n` copies of a request (seeds `seed + i`) and returns their event channels. Each copy
/// walks its own grammar (the engine starts one per sequence).
pub async fn submit_n(
    state: &AppState,
    req: GenerationRequest,
    n: usize,
    dialect: Dialect,
) -> Result<Vec<mpsc::UnboundedReceiver<StreamEvent>>, ApiError> {
    let mut rxs = Vec::with_capacity(n);
    for i in 0..n {
        let mut params = req.params.clone();
        params.seed = params.seed.map(|s| s.wrapping_add(i as u64));
        let one = GenerationRequest {
            prompt: req.prompt.clone(),
            params,
            max_tokens: req.max_tokens,
            stop: req.stop.clone(),
            stop_tokens: req.stop_tokens.clone(),
            logprobs: req.logprobs,
            deadline: state.request_timeout.map(|t| Instant::now() + t),
            thinking: req.thinking.clone(),
            grammar: req.grammar.clone(),
            turn_boundary: req.turn_boundary,
        };
        match state.engine.submit(one).await {
            Ok(rx) => rxs.push(rx),
            Err(e) => {
                // Earlier copies end when their receivers drop with `rxs`.
                return Err(match e {
                    SubmitError::QueueFull(m) => ApiError::new(StatusCode::TOO_MANY_REQUESTS, m),
                    SubmitError::Invalid(m) => ApiError::invalid("messages", m),
                    SubmitError::ShuttingDown => ApiError::new(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "the server is shutting down",
                    ),
                }
                .with_dialect(dialect));
            }
        }
    }
    Ok(rxs)
}

/// A whole (non-streamed) generation.
#[derive(Debug, Default)]
pub struct Collected {
    /// Text.
    pub text: String,
    /// Tokens.
    pub tokens: Vec<u32>,
    /// Log-probabilities, when asked for.
    pub logprobs: Vec<TokenLogprob>,
    /// Why it ended.
    pub finish: Option<Finish>,
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Of those, tokens whose KV came from the prefix cache.
    pub cached_tokens: usize,
    /// Generated tokens.
    pub completion_tokens: usize,
}

/// Reads a channel to its end.
pub async fn collect(mut rx: mpsc::UnboundedReceiver<StreamEvent>) -> Result<Collected, ApiError> {
    let mut c = Collected::default();
    while let Some(ev) = rx.recv().await {
        match ev {
            StreamEvent::Delta {
                text,
                tokens,
                logprobs,
            } => {
                c.text.push_str(&text);
                c.tokens.extend(tokens);
                c.logprobs.extend(logprobs);
            }
            StreamEvent::Done {
                finish,
                prompt_tokens,
                cached_tokens,
                completion_tokens,
            } => {
                c.finish = Some(finish);
                c.prompt_tokens = prompt_tokens;
                c.cached_tokens = cached_tokens;
                c.completion_tokens = completion_tokens;
                break;
            }
            StreamEvent::Error(e) => {
                return Err(ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e));
            }
        }
    }
    Ok(c)
}

/// The OpenAI `finish_reason` of an end.
pub fn openai_finish(f: Option<Finish>) -> Value {
    match f {
        Some(Finish::Stop | Finish::StopString(_)) => "stop".into(),
        Some(Finish::Length) => "length".into(),
        Some(Finish::Timeout) => "timeout".into(),
        None => Value::Null,
    }
}
