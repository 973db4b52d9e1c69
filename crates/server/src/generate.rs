// SPDX-License-Identifier: MIT OR Apache-2.0
//! `met generate`: one prompt in, the completion streamed to stdout, timings to stderr.

use std::io::Write;
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{Context, bail};
use metrale_cache::{BlockAllocator, DEFAULT_BLOCK_SIZE};
use metrale_model_engine::generate::{FinishReason, Flow, Request, generate};
use metrale_model_engine::{Model, ModelOptions};
use metrale_sampling::{Sampler, SamplingParams};
use metrale_tokenizer::{DecodeStream, RenderOptions, Tokenizer};

use crate::load::{self, Checkpoint, ModelArgs};

/// Options of `met generate`.
#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    /// The prompt text.
    #[arg(long)]
    prompt: String,
    /// Apply the model's chat template to the prompt as one user message.
    #[arg(long)]
    chat: bool,
    /// Most tokens to generate.
    #[arg(long, default_value_t = 256)]
    max_tokens: usize,
    /// Sampling temperature; 0 is greedy. Default: the model's preset (crates/config/src/presets.rs), else 1.0.
    #[arg(long)]
    temperature: Option<f32>,
    /// Nucleus sampling mass. Default: the model's preset, else 1.0 (off).
    #[arg(long)]
    top_p: Option<f32>,
    /// Top-k cut. Default: the model's preset, else off.
    #[arg(long)]
    top_k: Option<u32>,
    /// Seed for sampling; the same seed gives the same output.
    #[arg(long)]
    seed: Option<u64>,
    /// Print the token ids of the prompt and of the output to stderr.
    #[arg(long)]
    print_ids: bool,
    /// Keep generating past end-of-sequence tokens (for benchmarks: exactly --max-tokens tokens).
    #[arg(long)]
    ignore_eos: bool,
    /// Run one warm-up step before the prompt, as `met serve` does on a GPU, so that TTFT does
    /// not include one-time set-up (the GEMM library's handle and plans).
    #[arg(long)]
    warm_up: bool,
    /// Override one schedule choice for an experiment, as key=value (repeatable): the keys of
    /// metrale_model_engine::Tuning, e.g. `--tune fused_swiglu=false --tune decode_ahead=0`.
    /// The defaults are the kernel target's measured ones (docs/decisions.md).
    #[arg(long = "tune", value_name = "KEY=VALUE")]
    tune: Vec<String>,
}

/// Loads the tokenizer that belongs to the checkpoint.
pub fn tokenizer_for(checkpoint: &Checkpoint) -> anyhow::Result<Tokenizer> {
    Ok(match checkpoint {
        Checkpoint::Gguf(g) => {
            Tokenizer::from_gguf(g).context("reading the tokenizer embedded in the GGUF file")?
        }
        Checkpoint::Safetensors { dir, .. } => Tokenizer::from_hf_dir(dir)
            .with_context(|| format!("reading the tokenizer in {}", dir.display()))?,
    })
}

/// Runs `met generate`.
pub fn run(args: &Args) -> anyhow::Result<ExitCode> {
    let (checkpoint, config, references) = load::open_checkpoint(&args.model)?;
    let tokenizer = tokenizer_for(&checkpoint)?;
    let placement = load::place(&args.model, &config, references)?;
    eprintln!("met: {}", placement.description);
    let on_gpu = placement.gpu.kind() == "cuda";
    let cap = if on_gpu { 32768 } else { 4096 };
    let max_seq_len = args
        .model
        .max_seq_len
        .unwrap_or(config.max_position_embeddings.min(cap));
    if max_seq_len < 2 {
        bail!("--max-seq-len must be at least 2");
    }

    let prompt_text = if args.chat {
        let template = tokenizer
            .chat_template()
            .context("--chat needs a chat template, and this model has none")?;
        let messages = [serde_json::json!({"role": "user", "content": args.prompt})];
        template.render(
            &messages,
            &RenderOptions {
                add_generation_prompt: true,
                ..Default::default()
            },
        )?
    } else {
        args.prompt.clone()
    };
    // A chat template writes its own special tokens; a raw prompt gets the tokenizer's (BOS).
    let prompt = tokenizer.encode(&prompt_text, !args.chat)?;
    if prompt.is_empty() {
        bail!("the prompt encodes to no tokens");
    }
    if prompt.len() >= max_seq_len {
        bail!(
            "the prompt has {} tokens but the context is {max_seq_len} tokens (prompt plus at least one generated token); shorten the prompt or raise --max-seq-len (the model allows {})",
            prompt.len(),
            config.max_position_embeddings
        );
    }

    let block_size = placement
        .target
        .and_then(|t| t.defaults.kv_block_size)
        .map_or(DEFAULT_BLOCK_SIZE, |b| b as usize);
    let chunk = if on_gpu {
        placement
            .target
            .and_then(|t| t.defaults.max_prefill_tokens)
            .map_or(8192, |c| c as usize)
    } else {
        512
    };
    let options = ModelOptions {
        kv_cache: args.model.kv_cache_dtype,
        max_tokens_per_step: chunk.min(max_seq_len),
        max_seqs: 1,
        max_logit_rows: 1,
        max_seq_len,
        num_blocks: max_seq_len.div_ceil(block_size),
        block_size,
        state_slots: 1,
    };
    let started = Instant::now();
    let mut last_percent = usize::MAX;
    let mut progress = |done: usize, total: usize, bytes: u64| {
        let percent = done * 100 / total.max(1);
        if percent != last_percent && (percent.is_multiple_of(10) || done == total) {
            eprint!(
                "\rmet: loading weights {percent:>3}% ({done}/{total} tensors, {:.0} MiB)",
                bytes as f64 / (1 << 20) as f64
            );
            last_percent = percent;
        }
    };
    let tuning = crate::load::tuning(&placement, &args.tune)?;
    let mut model = Model::load_with(
        config.clone(),
        checkpoint.source(),
        placement.gpu.clone(),
        options,
        tuning,
        &checkpoint.linear_format(&args.model),
        &mut progress,
    )?;
    eprintln!(" in {:.1}s", started.elapsed().as_secs_f64());
    eprintln!("met: {}", model.kv_cache_scales());
    if args.warm_up {
        let t = Instant::now();
        model.warm_up()?;
        eprintln!(
            "met: warm-up step in {:.0} ms",
            t.elapsed().as_secs_f64() * 1e3
        );
    }

    let (presets, source) =
        load::sampling_defaults(&checkpoint, &config, args.model.generation_config)?;
    eprintln!(
        "met: sampling defaults: {} (from {source})",
        presets.describe()
    );
    let params = SamplingParams {
        temperature: args.temperature.or(presets.temperature).unwrap_or(1.0),
        top_p: args.top_p.or(presets.top_p).unwrap_or(1.0),
        top_k: args.top_k.or(presets.top_k),
        min_p: presets.min_p.unwrap_or(0.0),
        repetition_penalty: presets.repetition_penalty.unwrap_or(1.0),
        seed: args.seed,
        ..SamplingParams::default()
    };
    params.validate(config.vocab_size)?;
    let mut stop: Vec<u32> = tokenizer.eos_token_ids().to_vec();
    stop.extend(&config.eos_token_ids);
    stop.sort();
    stop.dedup();
    if args.ignore_eos {
        stop.clear();
    }

    let mut allocator = BlockAllocator::new(options.num_blocks);
    let mut stream = DecodeStream::new(true);
    let mut stdout = std::io::stdout().lock();
    let mut write_error = None;
    let mut on_token = |id: u32| {
        if let Ok(Some(text)) = stream.step(&tokenizer, id)
            && let Err(e) = stdout
                .write_all(text.as_bytes())
                .and_then(|_| stdout.flush())
        {
            write_error = Some(e);
            return Flow::Stop;
        }
        Flow::Continue
    };
    let request = Request {
        prompt: &prompt,
        max_new_tokens: args.max_tokens,
        stop_tokens: &stop,
        sampler: Sampler::new(params, &prompt),
    };
    let out = generate(&mut model, &mut allocator, request, &mut on_token)?;
    if let Some(e) = write_error {
        // A closed pipe (e.g. `| head`) is not an error worth a message.
        if e.kind() != std::io::ErrorKind::BrokenPipe {
            return Err(e.into());
        }
    }
    if let Ok(Some(rest)) = stream.finish(&tokenizer) {
        let _ = write!(stdout, "{rest}");
    }
    let _ = writeln!(stdout);
    if args.print_ids {
        eprintln!("prompt ids: {prompt:?}");
        eprintln!("output ids: {:?}", out.tokens);
    }
    let finish = match out.finish {
        FinishReason::Stop => "stop",
        FinishReason::Length => "length",
        FinishReason::Cancelled => "cancelled",
    };
    eprintln!(
        "met: {} prompt tokens, {} generated ({finish}); TTFT {:.1} ms; decode {:.1} tok/s",
        out.prompt_tokens,
        out.tokens.len(),
        out.time_to_first_token.as_secs_f64() * 1e3,
        out.decode_tokens_per_second()
    );
    let (graphs, capture) = model.graph_captures();
    if graphs > 0 {
        eprintln!(
            "met: {graphs} decode-step graphs captured, {:.1} ms of capture and instantiation",
            capture.as_secs_f64() * 1e3
        );
    }
    Ok(ExitCode::SUCCESS)
}
