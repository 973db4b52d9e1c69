// SPDX-License-Identifier: MIT OR Apache-2.0
//! `met serve`: the OpenAI- and Anthropic-compatible HTTP server.
//!
//! Start-up: open the checkpoint, pick the backend and kernel target, size the KV pool, load the
//! weights (while the grammar engine is built over the vocabulary on its own thread), start the
//! engine thread, bind, and only then log `Listening on`. Requests flow handler (validation; a
//! request's grammar compiled, see [`constraint`]) → [`engine::EngineHandle`] → engine thread
//! (scheduler + model + per-sequence sampler, masked by the sequence's grammar) → per-request
//! channel → JSON or SSE. Ctrl-C / SIGTERM stop accepting, let in-flight requests finish (up to
//! [`DRAIN`]), then stop the engine.

mod anthropic;
mod constraint;
mod engine;
mod error;
mod metrics;
mod misc;
mod openai;
mod params;
mod reply;
mod state;
mod stop;
mod structured;
mod thinking;
mod tools;

use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use anyhow::{Context, bail};
use axum::Router;
use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use metrale_cache::DEFAULT_BLOCK_SIZE;
use metrale_core::KvCacheDtype;
use metrale_grammar::GrammarEngine;
use metrale_model_engine::{Model, ModelOptions};
use metrale_scheduler::{Policy, PrefixKey, Scheduler, SchedulerConfig};

use crate::generate::tokenizer_for;
use crate::load::{self, ModelArgs};
use error::ApiError;
use state::AppState;

/// How long in-flight requests may run after a shutdown signal.
pub const DRAIN: Duration = Duration::from_secs(30);

/// Scheduling policy on the command line.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum PolicyArg {
    /// First come, first served.
    Fifo,
    /// SLO-aware: no new prefills while a running sequence nears its time-between-tokens deadline.
    Slai,
}

/// How chat answers are read for reasoning.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum ReasoningParserArg {
    /// `<think>...</think>` blocks (Qwen3, DeepSeek-R1 and others) become `reasoning_content`
    /// and thinking blocks.
    #[value(alias = "qwen3", alias = "deepseek_r1")]
    Think,
    /// No splitting: reasoning stays in the content.
    None,
}

/// Constrained decoding of tool calls a request demands (`--tool-grammar`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum ToolGrammarArg {
    /// Constrain `tool_choice` required / named (Anthropic any / tool) to calls in the
    /// server's tool-call format; when that cannot be done (no grammar for this vocabulary, a
    /// tool list the grammar cannot express) parse the unconstrained answer instead.
    Auto,
    /// As `auto`, but refuse to start without a tool-call format and a grammar engine, and
    /// answer a request whose tools cannot be constrained with 400.
    On,
    /// Never constrain tool calls: parse them from the unconstrained answer.
    Off,
}

/// Options of `met serve`.
#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    /// Address to bind. 0.0.0.0 exposes the server to the network (a warning is logged).
    #[arg(long, default_value = "127.0.0.1")]
    bind: String,
    /// Port to listen on.
    #[arg(long, default_value_t = 8888)]
    port: u16,
    /// The model name /v1/models reports (requests may name any model: one model per server).
    #[arg(long, alias = "served-model-name")]
    model_name: Option<String>,
    /// Most sequences in one decode step. Default: the hardware class's (CUDA), 16 (host).
    #[arg(long)]
    max_batch_size: Option<usize>,
    /// Token budget of one step (chunked prefill). Default: the hardware class's (CUDA), 512 (host).
    #[arg(long)]
    max_prefill_tokens: Option<usize>,
    /// Most requests admitted at once (running + queued); more are refused with 429.
    #[arg(long, default_value_t = 128)]
    max_num_seqs: usize,
    /// Fraction of device memory the engine may use (weights + KV cache + scratch).
    #[arg(long)]
    gpu_memory_utilization: Option<f64>,
    /// Scheduling policy.
    #[arg(long, value_enum, default_value_t = PolicyArg::Fifo)]
    scheduler: PolicyArg,
    /// SLAI's time-between-tokens deadline, ms.
    #[arg(long, default_value_t = 100)]
    tbt_deadline_ms: u64,
    /// Seconds a request may run before it is ended (0: no limit).
    #[arg(long, default_value_t = 600)]
    request_timeout: u64,
    /// Tool-call wire format (hermes, qwen3_coder, qwen3_xml, mistral, llama3_json, bare_json)
    /// that answers to requests offering `tools` are parsed with, streamed or not, into
    /// `tool_calls` / `tool_use` blocks. Default: the model family's preset
    /// (crates/config/src/presets.rs).
    #[arg(long)]
    tool_call_parser: Option<String>,
    /// Cap on max_tokens (the whole completion, reasoning included) of requests that offer
    /// `tools`.
    #[arg(long, default_value_t = 8192)]
    tool_max_tokens: usize,
    /// Constrained decoding of tool calls when a request's `tool_choice` demands one (`required`,
    /// a named function; Anthropic `any`, `tool`): the answer is masked, token by token, to
    /// calls in the tool-call format whose arguments follow each tool's schema. `auto`: do so
    /// when the server has a tool-call format and a grammar for its vocabulary, else parse only;
    /// `on`: the same, but refuse to start (or answer 400) where it cannot; `off`: parse only.
    /// `tool_choice: auto` is never constrained. With the reasoning parser on, the grammar
    /// starts after the `<think>` block closes.
    #[arg(long, value_enum, default_value_t = ToolGrammarArg::Auto)]
    tool_grammar: ToolGrammarArg,
    /// Reasoning format of chat answers: `think` splits <think> blocks into `reasoning_content`
    /// (OpenAI) and thinking blocks (Anthropic), `none` leaves them in the content. Default: the
    /// model family's preset.
    #[arg(long, value_enum)]
    reasoning_parser: Option<ReasoningParserArg>,
    /// Render chat templates with enable_thinking=false (Qwen3 then writes an empty <think>
    /// block and answers directly), unless a request sets `chat_template_kwargs.enable_thinking`
    /// or Anthropic `thinking`.
    #[arg(long)]
    disable_thinking: bool,
    /// Most tokens a sequence may spend inside <think> blocks; at the limit the engine appends
    /// "\n</think>\n\n" instead of sampling, and the model goes on to answer. A request's
    /// `thinking_budget` (Anthropic: `thinking.budget_tokens`) may lower it. Default: the model
    /// family's preset, else no limit.
    #[arg(long)]
    max_thinking_budget: Option<usize>,
    /// Require `Authorization: Bearer <token>` (or `x-api-key`) on every API route.
    #[arg(long)]
    require_auth: bool,
    /// An accepted token (repeatable).
    #[arg(long)]
    auth_token: Vec<String>,
    /// A file of accepted tokens, one per line.
    #[arg(long)]
    auth_tokens_file: Option<std::path::PathBuf>,
    /// Turn prefix caching off. It is on by default: the full KV blocks (16 tokens each) of
    /// earlier requests are kept while the pool has room and shared, so a request that repeats
    /// an earlier prompt's start (a system prompt, the conversation so far) computes only the
    /// tokens after it, in whole blocks; usage reports them as cached tokens.
    #[arg(long)]
    no_prefix_cache: bool,
    /// Override one schedule choice for an experiment, as key=value (repeatable): the keys of
    /// metrale_model_engine::Tuning, as `met generate --tune` takes them. The defaults are the
    /// kernel target's measured ones (docs/decisions.md); an unknown key or a bad value is refused
    /// at start-up.
    #[arg(long = "tune", value_name = "KEY=VALUE")]
    tune: Vec<String>,
}

/// Constant-time equality, so a wrong token's timing says nothing about the right one.
fn same(a: &[u8], b: &[u8]) -> bool {
    let mut diff = (a.len() ^ b.len()) as u8;
    for i in 0..a.len().max(b.len()) {
        diff |= a.get(i).copied().unwrap_or(0) ^ b.get(i).copied().unwrap_or(0);
    }
    diff == 0
}

async fn auth(State(tokens): State<Arc<Vec<String>>>, req: Request, next: Next) -> Response {
    let path = req.uri().path();
    if path.starts_with("/health") {
        return next.run(req).await;
    }
    let headers = req.headers();
    let given = headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .or_else(|| headers.get("x-api-key").and_then(|v| v.to_str().ok()));
    let ok = given.is_some_and(|g| {
        tokens
            .iter()
            .fold(false, |acc, t| acc | same(g.as_bytes(), t.as_bytes()))
    });
    if ok {
        return next.run(req).await;
    }
    let dialect = if path.starts_with("/v1/messages") {
        error::Dialect::Anthropic
    } else {
        error::Dialect::OpenAi
    };
    let message = if given.is_some() {
        "the bearer token is not valid"
    } else {
        "this server requires `Authorization: Bearer <token>`"
    };
    ApiError::new(StatusCode::UNAUTHORIZED, message)
        .with_dialect(dialect)
        .into_response()
}

/// POST bodies must be JSON (or carry no Content-Type at all).
async fn json_only(req: Request, next: Next) -> Response {
    if req.method() == axum::http::Method::POST {
        let dialect = if req.uri().path().starts_with("/v1/messages") {
            error::Dialect::Anthropic
        } else {
            error::Dialect::OpenAi
        };
        if let Err(e) = openai::check_content_type(req.headers(), dialect) {
            return e.into_response();
        }
    }
    next.run(req).await
}

fn router(state: Arc<AppState>, tokens: Option<Arc<Vec<String>>>) -> Router {
    let unsupported = [
        "/v1/embeddings",
        "/v1/images/generations",
        "/v1/images/edits",
        "/v1/images/variations",
        "/v1/audio/speech",
        "/v1/audio/transcriptions",
        "/v1/audio/translations",
        "/v1/moderations",
        "/v1/files",
        "/v1/fine_tuning/jobs",
        "/v1/batches",
        "/v1/assistants",
        "/v1/threads",
        "/v1/responses",
        "/v1/rerank",
    ];
    let mut app = Router::new()
        .route("/v1/chat/completions", post(openai::chat_completions))
        .route("/v1/completions", post(openai::completions))
        .route("/v1/messages", post(anthropic::messages))
        .route("/v1/messages/count_tokens", post(anthropic::count_tokens))
        .route("/v1/models", get(misc::models))
        .route("/v1/models/{id}", get(misc::model))
        .route("/tokenize", post(misc::tokenize))
        .route("/detokenize", post(misc::detokenize))
        .route("/health", get(misc::health))
        .route("/health/live", get(misc::health))
        .route("/metrics", get(misc::metrics))
        .route("/openapi.json", get(misc::openapi));
    for path in unsupported {
        app = app.route(path, axum::routing::any(misc::not_supported));
    }
    let app = app
        .fallback(misc::not_found)
        .method_not_allowed_fallback(|| async {
            ApiError::new(
                StatusCode::METHOD_NOT_ALLOWED,
                "this route does not accept that method",
            )
        })
        .with_state(state)
        .layer(axum::middleware::from_fn(json_only));
    match tokens {
        Some(t) => app.layer(axum::middleware::from_fn_with_state(t, auth)),
        None => app,
    }
}

fn auth_tokens(args: &Args) -> anyhow::Result<Option<Arc<Vec<String>>>> {
    let mut tokens = args.auth_token.clone();
    if let Some(path) = &args.auth_tokens_file {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading --auth-tokens-file {}", path.display()))?;
        tokens.extend(
            text.lines()
                .map(str::trim)
                .filter(|l| !l.is_empty() && !l.starts_with('#'))
                .map(String::from),
        );
    }
    if !args.require_auth {
        if !tokens.is_empty() {
            bail!(
                "--auth-token/--auth-tokens-file given without --require-auth; add --require-auth"
            );
        }
        return Ok(None);
    }
    if tokens.is_empty() {
        bail!("--require-auth needs at least one token (--auth-token or --auth-tokens-file)");
    }
    Ok(Some(Arc::new(tokens)))
}

/// Runs `met serve`.
pub fn run(args: &Args) -> anyhow::Result<ExitCode> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    let tokens = auth_tokens(args)?;
    let addr: SocketAddr = format!("{}:{}", args.bind, args.port)
        .parse()
        .with_context(|| {
            format!(
                "--bind {} --port {} is not an address",
                args.bind, args.port
            )
        })?;
    if args.bind == "0.0.0.0" || args.bind == "::" {
        tracing::warn!(
            "binding {} exposes this server to every network this machine is on{}",
            args.bind,
            if tokens.is_none() {
                ", without authentication (see --require-auth)"
            } else {
                ""
            }
        );
    }
    let mut model_args = args.model.clone();
    if model_args.model.is_none() && model_args.model_from_path.is_none() {
        let cwd = std::env::current_dir().context("reading the current directory")?;
        let exe = std::env::current_exe().ok();
        let path = load::default_model(&cwd, exe.as_deref())?;
        tracing::info!(
            "no model given: serving the default model, SmolLM2-135M-Instruct (Q4_1 GGUF), from {}",
            path.display()
        );
        model_args.model_from_path = Some(path);
    }
    let (checkpoint, config, references) = load::open_checkpoint(&model_args)?;
    let tokenizer = Arc::new(tokenizer_for(&checkpoint)?);
    let (sampling, sampling_source) =
        load::sampling_defaults(&checkpoint, &config, model_args.generation_config)?;
    tracing::info!(
        "sampling defaults: {} (from {sampling_source})",
        sampling.describe()
    );
    let placement = load::place(&model_args, &config, references.clone())?;
    tracing::info!("backend: {}", placement.description);
    if let Some(t) = placement.target {
        tracing::info!("kernel target: {}", t.target);
    }
    let gpu = placement.gpu.clone();
    // Checked before anything loads: a bad operator switch stops the start-up here.
    let tuning = load::tuning(&placement, &args.tune)?;
    let on_gpu = gpu.kind() == "cuda";
    let defaults = placement.target.map(|t| t.defaults).unwrap_or_default();
    let max_seq_len =
        args.model
            .max_seq_len
            .unwrap_or(
                config
                    .max_position_embeddings
                    .min(if on_gpu { 32768 } else { 4096 }),
            );
    let block_size = defaults
        .kv_block_size
        .map_or(DEFAULT_BLOCK_SIZE, |b| b as usize);
    // The hardware class's batch describes the GPU; the host backend defaults to a small one.
    let max_batch = args
        .max_batch_size
        .unwrap_or(if on_gpu {
            defaults.max_batch_size.map_or(8, |b| b as usize)
        } else {
            16
        })
        .max(1);
    let step_tokens = args
        .max_prefill_tokens
        .unwrap_or(if on_gpu {
            defaults.max_prefill_tokens.map_or(8192, |t| t as usize)
        } else {
            512
        })
        .max(max_batch);
    let blocks_per_seq = max_seq_len.div_ceil(block_size);
    let kv_dtype = model_args.kv_cache_dtype;
    let kv_block_bytes = ModelOptions::kv_bytes_per_block(&config, block_size, kv_dtype);
    // A hybrid model's recurrent layers keep a fixed-size state per running sequence: one slot
    // for every sequence the batch may run, and with the prefix cache twice as many snapshot
    // slots (the state at a prefix's end, which a hit resumes from: at most half of them are
    // running sequences' tails, the state at the end of their answer so far), all taken out of
    // the memory budget before the KV pool.
    let state_slot_bytes = ModelOptions::state_bytes_per_slot(&config);
    let running_slots = if state_slot_bytes > 0 { max_batch } else { 0 };
    let snapshot_slots = if args.no_prefix_cache {
        0
    } else {
        2 * running_slots
    };
    let state_slots = running_slots + snapshot_slots;
    let state_bytes = state_slot_bytes as f64 * state_slots as f64;
    // The pool: what the memory budget allows (CUDA) or what the decode batch needs at full length
    // (host, where memory is the machine's own), and never more than all admitted requests need.
    let wanted = args.max_num_seqs.max(1) * blocks_per_seq;
    let num_blocks = if on_gpu {
        let util = args
            .gpu_memory_utilization
            .or(defaults.gpu_memory_utilization)
            .unwrap_or(0.9);
        if !(0.05..=1.0).contains(&util) {
            bail!("--gpu-memory-utilization {util} must be between 0.05 and 1");
        }
        let total = gpu.total_memory()? as f64;
        let weights = config.parameter_count() as f64 * 2.0;
        let scratch = (step_tokens * (config.hidden_size * 8 + config.intermediate_size * 3) * 2
            + max_batch * config.vocab_size * 4) as f64;
        let budget = total * util - weights - scratch - state_bytes - (1u64 << 30) as f64;
        if budget < kv_block_bytes as f64 * blocks_per_seq as f64 {
            bail!(
                "the KV cache does not fit: {:.1} GiB of device memory at utilization {util} leaves {:.2} GiB after weights and scratch; raise --gpu-memory-utilization or lower --max-seq-len",
                total / (1u64 << 30) as f64,
                budget / (1u64 << 30) as f64
            );
        }
        ((budget / kv_block_bytes as f64) as usize).min(wanted)
    } else {
        (max_batch * blocks_per_seq).min(wanted)
    };
    let step_seqs = max_batch + step_tokens.min(64);
    let options = ModelOptions {
        kv_cache: model_args.kv_cache_dtype,
        max_tokens_per_step: step_tokens,
        max_seqs: step_seqs,
        max_logit_rows: step_seqs,
        max_seq_len,
        num_blocks,
        block_size,
        state_slots,
    };
    if state_slots > 0 {
        tracing::info!(
            "recurrent state: {state_slots} slots of {:.1} MiB ({:.2} GiB): {running_slots} for running sequences, {snapshot_slots} for prefix snapshots",
            state_slot_bytes as f64 / (1u64 << 20) as f64,
            state_bytes / (1u64 << 30) as f64
        );
    }
    tracing::info!(
        "KV cache: {kv_dtype}, {num_blocks} blocks of {block_size} tokens = {} tokens ({:.2} GiB, {} bytes a token); max_seq_len {max_seq_len}, batch {max_batch}, step budget {step_tokens} tokens",
        num_blocks * block_size,
        (num_blocks as u64 * kv_block_bytes) as f64 / (1u64 << 30) as f64,
        kv_block_bytes / block_size as u64
    );
    // The tool-call format, checked before the long weight load.
    let presets = metrale_config::presets(config.family);
    let behavior = presets.behavior;
    let tool_parser = match args
        .tool_call_parser
        .as_deref()
        .or(behavior.tool_call_parser)
    {
        Some(name) => Some(
            name.parse::<metrale_toolcall::Format>()
                .map_err(|e| anyhow::anyhow!("--tool-call-parser: {e}"))?,
        ),
        None => None,
    };
    if args.tool_max_tokens == 0 {
        bail!("--tool-max-tokens must be at least 1");
    }
    if args.tool_grammar == ToolGrammarArg::On && tool_parser.is_none() {
        bail!(
            "--tool-grammar on needs a tool-call format, and this model has none: pass --tool-call-parser"
        );
    }
    // The grammar engine reads the whole vocabulary (about a second for 150k ids): built once,
    // on its own thread while the weights load.
    let grammar_build = {
        let tokenizer = tokenizer.clone();
        let vocab_size = config.vocab_size;
        std::thread::Builder::new()
            .name("met-grammar".into())
            .spawn(move || {
                let started = std::time::Instant::now();
                GrammarEngine::new(&tokenizer, vocab_size).map(|e| (e, started.elapsed()))
            })
            .context("starting the grammar engine's thread")?
    };
    let started = std::time::Instant::now();
    let mut last = usize::MAX;
    let mut progress = |done: usize, total: usize, bytes: u64| {
        let pct = done * 100 / total.max(1);
        if pct / 25 != last / 25 || done == total {
            tracing::info!(
                "loading weights: {pct}% ({done}/{total} tensors, {:.0} MiB)",
                bytes as f64 / (1 << 20) as f64
            );
            last = pct;
        }
    };
    let mut model = Model::load_with(
        config.clone(),
        checkpoint.source(),
        gpu,
        options,
        tuning,
        &checkpoint.linear_format(&model_args),
        &mut progress,
    )?;
    tracing::info!("weights loaded in {:.1}s", started.elapsed().as_secs_f64());
    tracing::info!("{}", model.kv_cache_scales());
    if model.gpu().kind() == "cuda" {
        // The first request should not pay the GEMM library's set-up.
        let t = std::time::Instant::now();
        model.warm_up()?;
        tracing::info!("warm-up step in {:.0} ms", t.elapsed().as_secs_f64() * 1e3);
    }
    let policy = match args.scheduler {
        PolicyArg::Fifo => Policy::Fifo,
        PolicyArg::Slai => Policy::Slai {
            tbt_deadline_ms: args.tbt_deadline_ms,
        },
    };
    // Everything besides the tokens that decides a block's KV: the checkpoint, its config, the
    // cache's dtype and the block size.
    let prefix_cache = (!args.no_prefix_cache).then(|| {
        let source = model_args
            .model_from_path
            .as_ref()
            .map(|p| p.display().to_string())
            .or_else(|| model_args.model.clone())
            .unwrap_or_default();
        PrefixKey::from_bytes(prefix_key_text(&source, &config, kv_dtype, block_size).as_bytes())
    });
    tracing::info!(
        "prefix cache: {}",
        if prefix_cache.is_some() {
            "on (full KV blocks shared between requests; --no-prefix-cache turns it off)"
        } else {
            "off"
        }
    );
    let scheduler = Scheduler::new(SchedulerConfig {
        max_num_seqs: args.max_num_seqs.max(1),
        max_running: max_batch,
        max_step_tokens: step_tokens,
        max_seq_len,
        block_size,
        num_blocks,
        policy,
        prefix_cache,
        state_slots: (running_slots > 0).then_some(running_slots),
        state_snapshots: snapshot_slots,
    })
    .map_err(|e| anyhow::anyhow!("scheduler settings: {e}"))?;
    let grammar_engine = match grammar_build.join() {
        Ok(Ok((engine, took))) => {
            tracing::info!(
                "constrained decoding: grammar engine over {} ids ready in {:.2}s",
                engine.vocab_size(),
                took.as_secs_f64()
            );
            Ok(Arc::new(engine))
        }
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err("building the grammar engine panicked".to_owned()),
    };
    if let Err(why) = &grammar_engine {
        if args.tool_grammar == ToolGrammarArg::On {
            bail!("--tool-grammar on: constrained decoding is not available for this model: {why}");
        }
        tracing::warn!(
            "constrained decoding is not available for this model ({why}): requests with \
             response_format or guided_* get 400, and tool_choice required / named is parsed only"
        );
    }
    let reasoning = match args.reasoning_parser {
        Some(ReasoningParserArg::Think) => true,
        Some(ReasoningParserArg::None) => false,
        None => behavior.reasoning,
    };
    let max_thinking_budget = args
        .max_thinking_budget
        .or(behavior.thinking_budget.map(|b| b as usize));
    let think_close = tokenizer
        .encode(thinking::CLOSE_THINK, false)
        .context("tokenizing the text that closes a thinking block")?;
    let think_open = match tokenizer.encode("<think>", false).as_deref() {
        Ok([id]) => Some(*id),
        _ => None,
    };
    let grammar = constraint::GrammarSupport {
        engine: grammar_engine,
        tool_grammar: args.tool_grammar,
        wire: tool_parser.map(constraint::wire_of),
        think_open,
    };
    let metrics = Arc::new(metrics::Metrics::default());
    metrics
        .kv_cache_capacity_tokens
        .store((num_blocks * block_size) as u64, Ordering::Relaxed);
    metrics
        .kv_cache_bytes_per_token
        .store(kv_block_bytes / block_size as u64, Ordering::Relaxed);
    let _ = metrics.kv_cache_dtype.set(kv_dtype.name());
    let (engine, engine_thread) =
        engine::start(model, scheduler, tokenizer.clone(), metrics.clone());
    let mut eos: Vec<u32> = tokenizer.eos_token_ids().to_vec();
    eos.extend(&config.eos_token_ids);
    eos.sort();
    eos.dedup();
    let model_name = args
        .model_name
        .clone()
        .or_else(|| model_args.model.clone())
        .unwrap_or_else(|| {
            model_args
                .model_from_path
                .as_ref()
                .and_then(|p| p.file_stem())
                .map_or("model".into(), |s| s.to_string_lossy().into_owned())
        });
    let state = Arc::new(AppState {
        engine: engine.clone(),
        tokenizer,
        model_name,
        max_seq_len,
        vocab_size: config.vocab_size,
        eos,
        presets: sampling,
        request_timeout: (args.request_timeout > 0)
            .then(|| Duration::from_secs(args.request_timeout)),
        metrics,
        created: state::unix_now(),
        tool_parser,
        reasoning,
        disable_thinking: args.disable_thinking,
        max_thinking_budget,
        think_close,
        tool_max_tokens: args.tool_max_tokens,
        grammar,
    });
    let app = router(state, tokens);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let served = runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind(addr).await.with_context(|| format!("binding {addr}"))?;
        tracing::info!("Listening on {addr}");
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        let server = axum::serve(listener, app).with_graceful_shutdown(async move {
            shutdown_signal().await;
            tracing::info!("shutting down: no new connections; in-flight requests may run for up to {}s", DRAIN.as_secs());
            let _ = stop_tx.send(true);
        });
        let mut stop_rx = stop_rx;
        tokio::select! {
            r = server => r.context("serving")?,
            _ = async { let _ = stop_rx.wait_for(|v| *v).await; tokio::time::sleep(DRAIN).await } => {
                tracing::warn!("in-flight requests still running after {}s; cancelling them", DRAIN.as_secs());
            }
        }
        anyhow::Ok(())
    });
    engine.shutdown();
    drop(engine);
    runtime.shutdown_timeout(Duration::from_secs(1));
    let _ = engine_thread.join();
    served?;
    tracing::info!("stopped");
    Ok(ExitCode::SUCCESS)
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        if let Ok(mut s) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        {
            s.recv().await;
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {}
        _ = term => {}
    }
}

/// The text the prefix cache's [`PrefixKey`] hashes: everything besides the tokens that decides a
/// block's KV contents (the checkpoint, its config, the cache's element type, the block size), so
/// that blocks written under another KV dtype are never found.
fn prefix_key_text(
    source: &str,
    config: &impl std::fmt::Debug,
    kv: KvCacheDtype,
    block_size: usize,
) -> String {
    format!("{source}|{config:?}|kv={}|block={block_size}", kv.name())
}

#[cfg(test)]
mod tests {
    use super::{KvCacheDtype, PrefixKey, prefix_key_text, same};

    /// Issue 31: a block cached under one KV dtype is never found under another.
    #[test]
    fn the_prefix_address_includes_the_kv_dtype() {
        let key = |kv| PrefixKey::from_bytes(prefix_key_text("m", &"config", kv, 16).as_bytes());
        assert_ne!(key(KvCacheDtype::Bf16), key(KvCacheDtype::Fp8));
        assert_eq!(key(KvCacheDtype::Fp8), key(KvCacheDtype::Fp8));
        assert!(prefix_key_text("m", &"c", KvCacheDtype::Fp8, 16).contains("kv=fp8_e4m3"));
    }

    #[test]
    fn constant_time_comparison_is_equality() {
        assert!(same(b"secret", b"secret"));
        assert!(!same(b"secret", b"secreT"));
        assert!(!same(b"secret", b"secret2"));
        assert!(!same(b"", b"x"));
        assert!(same(b"", b""));
    }
}
