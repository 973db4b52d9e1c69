// SPDX-License-Identifier: MIT OR Apache-2.0
//! `met`: the metrale engine's one binary.
//!
//! This crate owns the command line and (as the engine grows) the HTTP server and scheduler. It
//! never calls the GPU driver itself: every device operation goes through
//! `metrale_gpu_runtime::GpuBackend`.
#![forbid(unsafe_code)]

mod bench_kernels;
mod bench_model;
mod check_kernels;
mod doctor;
mod generate;
mod load;
mod parity;
mod perplexity;
mod serve;

use clap::{Parser, Subcommand};

/// The version line: crate version, git commit, and how many kernel targets are embedded.
fn long_version() -> &'static str {
    static VERSION: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    VERSION.get_or_init(|| {
        format!(
            "{} (commit {}, {} embedded kernel targets)",
            env!("CARGO_PKG_VERSION"),
            env!("MET_GIT_COMMIT"),
            metrale_kernels::TARGETS.len()
        )
    })
}

/// metrale: a pure-Rust LLM inference engine with ahead-of-time compiled CUDA kernels.
#[derive(Parser)]
#[command(name = "met", version = long_version(), about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Report the GPUs, the embedded kernel targets, the arch preflight and the GPU libraries.
    /// Exits non-zero when a required check fails (no GPU, no kernels, no target this GPU can run).
    Doctor(doctor::Args),
    /// Run every CUDA kernel of a target against its host reference on fresh random inputs at
    /// several shapes and report the error of each. Needs a GPU. Exits non-zero on any failure.
    CheckKernels(check_kernels::Args),
    /// Generate a completion for one prompt, streamed to stdout (timings go to stderr). Uses the
    /// GPU when one can run the model's kernel target, else the host backend, and says which.
    Generate(generate::Args),
    /// Time the decode and prefill kernels at a model's shapes on this GPU (µs per launch,
    /// achieved GB/s and TFLOP/s against the rooflines). Needs a GPU.
    BenchKernels(bench_kernels::Args),
    /// Time the model's forward step as the server runs it: time to first logits for prompts of
    /// several lengths, and decode step time at several batch sizes against its memory floor.
    BenchModel(bench_model::Args),
    /// Compare the model's logits with a reference file from transformers
    /// (scripts/gpu/reference_logits.py) at every position; exits non-zero above the tolerance.
    Parity(parity::Args),
    /// Score text files with teacher forcing: per-token negative log-likelihood and perplexity
    /// (to compare weight formats, e.g. BF16 against --quantization fp8, on the same text).
    Perplexity(perplexity::Args),
    /// Serve the model over an OpenAI- and Anthropic-compatible HTTP API with continuous
    /// batching over a paged KV cache. Logs `Listening on <addr>` once ready.
    Serve(serve::Args),
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Doctor(args) => doctor::run(&args),
        Command::CheckKernels(args) => check_kernels::run(&args),
        Command::BenchKernels(args) => bench_kernels::run(&args),
        Command::BenchModel(args) => bench_model::run(&args),
        Command::Generate(args) => generate::run(&args),
        Command::Parity(args) => parity::run(&args),
        Command::Perplexity(args) => perplexity::run(&args),
        Command::Serve(args) => serve::run(&args),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
