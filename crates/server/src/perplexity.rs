// SPDX-License-Identifier: MIT OR Apache-2.0
//! `met perplexity`: the model's per-token negative log-likelihood over text files, with teacher
//! forcing, to compare weight formats (BF16 against `--quantization fp8` or an FP8 checkpoint)
//! and KV cache element types (`--kv-cache-dtype fp8` against bf16) on the same text.
//!
//! Each file is one document, encoded with the tokenizer's special tokens (BOS where it adds
//! one) and scored in windows of at most `--window` tokens that do not overlap; each window
//! starts a fresh sequence at position 0, and every token of it but the first is predicted from
//! the ones before it. A window is prefilled in chunks of `--chunk` tokens with the logits of
//! every row (f32, as the LM head's output leaves the engine); the log-softmax and the sums run in
//! f64. Perplexity is `exp(mean NLL)` over every predicted token of every file.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{Context, bail};
use metrale_cache::{BlockAllocator, BlockTable, DEFAULT_BLOCK_SIZE};
use metrale_model_engine::{Model, ModelOptions, StepInput};

use crate::generate::tokenizer_for;
use crate::load::{self, ModelArgs};

/// Options of `met perplexity`.
#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    /// A text file to score, one document (repeatable; a directory scores its `*.txt` files in
    /// name order).
    #[arg(long, required = true, value_name = "PATH")]
    text: Vec<PathBuf>,
    /// Most tokens of a window (one sequence from position 0); a longer document is cut into
    /// windows that do not overlap, each one's first token unscored. Also capped by
    /// --max-seq-len and the model's position limit.
    #[arg(long, default_value_t = 1024)]
    window: usize,
    /// Tokens per prefill step (every row's f32 logits come back to the host). Default: 256 on
    /// the host backend, 512 on a GPU.
    #[arg(long)]
    chunk: Option<usize>,
    /// Write the figures as JSON here: per file and in total, tokens scored, mean NLL (nats) and
    /// perplexity, and every scored token's NLL.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Override one schedule choice, as key=value (repeatable), as `met generate --tune`.
    #[arg(long = "tune", value_name = "KEY=VALUE")]
    tune: Vec<String>,
}

/// `-log softmax(row)[target]` in f64.
pub fn nll(row: &[f32], target: usize) -> f64 {
    let max = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)) as f64;
    let sum: f64 = row.iter().map(|&v| (v as f64 - max).exp()).sum();
    max + sum.ln() - row[target] as f64
}

/// The files `--text` names: each file, and each directory's `*.txt` in name order.
fn text_files(paths: &[PathBuf]) -> anyhow::Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    for p in paths {
        if p.is_dir() {
            let mut found: Vec<PathBuf> = std::fs::read_dir(p)
                .with_context(|| format!("reading {}", p.display()))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|f| f.extension().is_some_and(|e| e == "txt"))
                .collect();
            if found.is_empty() {
                bail!("{} has no .txt files", p.display());
            }
            found.sort();
            out.extend(found);
        } else {
            out.push(p.clone());
        }
    }
    Ok(out)
}

#[derive(serde::Serialize)]
struct FileFigures {
    path: String,
    tokens: usize,
    mean_nll: f64,
    perplexity: f64,
    nll: Vec<f64>,
}

/// Runs `met perplexity`.
pub fn run(args: &Args) -> anyhow::Result<ExitCode> {
    if args.window < 2 {
        bail!("--window must be at least 2 tokens");
    }
    let files = text_files(&args.text)?;
    let (checkpoint, config, references) = load::open_checkpoint(&args.model)?;
    let tokenizer = tokenizer_for(&checkpoint)?;
    let mut documents = Vec::new();
    for f in &files {
        let text =
            std::fs::read_to_string(f).with_context(|| format!("reading {}", f.display()))?;
        let ids = tokenizer.encode(&text, true)?;
        if ids.len() < 2 {
            bail!("{} encodes to fewer than 2 tokens", f.display());
        }
        documents.push(ids);
    }
    let placement = load::place(&args.model, &config, references)?;
    eprintln!("met: {}", placement.description);
    let on_gpu = placement.gpu.kind() == "cuda";
    let longest = documents.iter().map(Vec::len).max().unwrap_or(2);
    let window = args
        .window
        .min(longest)
        .min(args.model.max_seq_len.unwrap_or(usize::MAX))
        .min(config.max_position_embeddings);
    let chunk = args
        .chunk
        .unwrap_or(if on_gpu { 512 } else { 256 })
        .clamp(1, window);
    let block_size = placement
        .target
        .and_then(|t| t.defaults.kv_block_size)
        .map_or(DEFAULT_BLOCK_SIZE, |b| b as usize);
    let options = ModelOptions {
        kv_cache: args.model.kv_cache_dtype,
        max_tokens_per_step: chunk,
        max_seqs: 1,
        max_logit_rows: chunk,
        max_seq_len: window,
        num_blocks: window.div_ceil(block_size),
        block_size,
        state_slots: 1,
    };
    let format = checkpoint.linear_format(&args.model);
    eprintln!(
        "met: linear weights {}; windows of {window} tokens, prefill chunks of {chunk}",
        match &format {
            metrale_model_engine::LinearFormat::Bf16 => "BF16".to_string(),
            metrale_model_engine::LinearFormat::Fp8Quantize =>
                "quantized to FP8 at load (--quantization fp8)".to_string(),
            metrale_model_engine::LinearFormat::Fp8Stored(s) =>
                format!("the checkpoint's FP8 ({})", s.method),
        }
    );
    let started = Instant::now();
    let tuning = load::tuning(&placement, &args.tune)?;
    let mut model = Model::load_with(
        config.clone(),
        checkpoint.source(),
        placement.gpu.clone(),
        options,
        tuning,
        &format,
        &mut |_, _, _| {},
    )?;
    eprintln!("met: loaded in {:.1}s", started.elapsed().as_secs_f64());
    eprintln!("met: {}", model.kv_cache_scales());
    let vocab = config.vocab_size;
    let started = Instant::now();
    let mut allocator = BlockAllocator::new(options.num_blocks);
    let mut figures = Vec::new();
    for (path, ids) in files.iter().zip(&documents) {
        let mut scores = Vec::with_capacity(ids.len());
        for win in ids.chunks(window).filter(|w| w.len() >= 2) {
            let mut table = BlockTable::default();
            table.reserve(win.len(), block_size, &mut allocator)?;
            let mut at = 0;
            while at < win.len() {
                let part = &win[at..(at + chunk).min(win.len())];
                let positions: Vec<u32> = (at as u32..(at + part.len()) as u32).collect();
                let rows: Vec<usize> = (0..part.len()).collect();
                let logits = model.forward(&StepInput {
                    tokens: part,
                    positions: &positions,
                    token_seq: &vec![0; part.len()],
                    block_tables: &[&table],
                    logit_rows: &rows,
                    state_slots: model.solo_state_slot(),
                })?;
                // Row i predicts the token at position at + i + 1.
                for (i, row) in logits.chunks_exact(vocab).enumerate() {
                    if let Some(&next) = win.get(at + i + 1) {
                        scores.push(nll(row, next as usize));
                    }
                }
                at += part.len();
            }
            table.release(&mut allocator)?;
        }
        let mean = scores.iter().sum::<f64>() / scores.len() as f64;
        println!(
            "{}: {} tokens, mean NLL {mean:.5} nats, perplexity {:.4}",
            path.display(),
            scores.len(),
            mean.exp()
        );
        figures.push(FileFigures {
            path: path.display().to_string(),
            tokens: scores.len(),
            mean_nll: mean,
            perplexity: mean.exp(),
            nll: scores,
        });
    }
    let tokens: usize = figures.iter().map(|f| f.tokens).sum();
    let total: f64 = figures.iter().flat_map(|f| &f.nll).sum();
    let mean = total / tokens as f64;
    println!(
        "total: {tokens} tokens, mean NLL {mean:.5} nats, perplexity {:.4}",
        mean.exp()
    );
    eprintln!("met: scored in {:.1}s", started.elapsed().as_secs_f64());
    if let Some(out) = &args.json {
        let json = serde_json::json!({
            "model": checkpoint_name(&args.model),
            "weights": match &format {
                metrale_model_engine::LinearFormat::Bf16 => "bf16",
                _ => "fp8",
            },
            "kv_cache": args.model.kv_cache_dtype.name(),
            "backend": placement.gpu.kind(),
            "window": window,
            "tokens": tokens,
            "mean_nll": mean,
            "perplexity": mean.exp(),
            "files": figures,
        });
        std::fs::write(out, serde_json::to_string_pretty(&json)?)
            .with_context(|| format!("writing {}", out.display()))?;
    }
    Ok(ExitCode::SUCCESS)
}

fn checkpoint_name(m: &ModelArgs) -> String {
    match (&m.model, &m.model_from_path) {
        (Some(id), _) => id.clone(),
        (_, Some(p)) => p.display().to_string(),
        _ => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::nll;

    #[test]
    fn nll_is_the_negative_log_softmax() {
        // Uniform over 4: ln 4 whichever the target.
        assert!((nll(&[0.5; 4], 2) - 4f64.ln()).abs() < 1e-12);
        // Large logits do not overflow: the softmax is shift-invariant.
        let row = [1000.0, 1001.0, 999.0];
        let want = -(1f64.exp() / (1.0 + 1f64.exp() + (-1f64).exp())).ln();
        assert!((nll(&row, 1) - want).abs() < 1e-12);
    }
}
