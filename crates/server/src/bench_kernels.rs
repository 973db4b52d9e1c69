// SPDX-License-Identifier: MIT OR Apache-2.0
//! `met bench-kernels`: time per launch of the decode and prefill kernels at a model's shapes,
//! against the memory and tensor-core rooflines of DESIGN.md section 7.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, bail};
use metrale_gpu_runtime::CudaBackend;
use metrale_gpu_runtime::bench::{
    self, NEMOTRON_3_NANO_EXPERTS, QWEN3_0_6B, QWEN3_8B, QWEN3_30B_A3B_EXPERTS,
};

/// Options of `met bench-kernels`.
#[derive(clap::Args)]
pub struct Args {
    /// Model shape: qwen3-8b or qwen3-0.6b, or qwen3-30b-a3b or nemotron-3-nano-30b-a3b (their
    /// MoE kernels only).
    #[arg(long, default_value = "qwen3-8b")]
    shape: String,
    /// Prefill lengths for the GEMM and prefill-attention rows (comma-separated).
    #[arg(long, default_value = "128,1024,8192", value_delimiter = ',')]
    prefill: Vec<u32>,
    /// Memory read bandwidth for the roofline column, TB/s (measured on the H200: DESIGN.md).
    #[arg(long, default_value_t = 4.19)]
    hbm_tb_s: f64,
    /// Dense bf16 tensor-core rate for the roofline column, TFLOP/s (measured cuBLAS GEMM on the
    /// H200: DESIGN.md).
    #[arg(long, default_value_t = 790.0)]
    tensor_tflop_s: f64,
    /// Kernel target whose kernels are timed (default: the first embedded one).
    #[arg(long)]
    kernel_target: Option<String>,
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0)]
    device: usize,
    /// Write the results as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
}

/// Runs `met bench-kernels`.
pub fn run(args: &Args) -> anyhow::Result<ExitCode> {
    let (name, cases) = match args.shape.as_str() {
        "qwen3-8b" => (QWEN3_8B.name, bench::model_cases(&QWEN3_8B, &args.prefill)),
        "qwen3-0.6b" => (
            QWEN3_0_6B.name,
            bench::model_cases(&QWEN3_0_6B, &args.prefill),
        ),
        "qwen3-30b-a3b" => (
            QWEN3_30B_A3B_EXPERTS.name,
            bench::moe_cases(&QWEN3_30B_A3B_EXPERTS, &args.prefill),
        ),
        "nemotron-3-nano-30b-a3b" => (
            NEMOTRON_3_NANO_EXPERTS.name,
            bench::moe_cases(&NEMOTRON_3_NANO_EXPERTS, &args.prefill),
        ),
        other => bail!(
            "unknown --shape {other}; known: qwen3-8b, qwen3-0.6b, qwen3-30b-a3b, \
             nemotron-3-nano-30b-a3b"
        ),
    };
    let target = match &args.kernel_target {
        Some(pin) => metrale_kernels::TARGETS
            .iter()
            .find(|t| t.target.path() == *pin || t.target.model == *pin)
            .with_context(|| format!("no embedded kernel target {pin}"))?,
        None => metrale_kernels::TARGETS
            .first()
            .context("no kernel target embedded")?,
    };
    let gpu = CudaBackend::new(args.device, target)
        .with_context(|| format!("loading {}", target.target.path()))?;
    eprintln!(
        "met bench-kernels: {} cases at {} shapes on {}",
        cases.len(),
        name,
        target.target.path()
    );
    let results = bench::run(&gpu, &cases, 3, 5, 20)?;
    println!("met {}", crate::long_version());
    println!(
        "| kernel | shape | µs | GB/s | % of {} TB/s | TFLOP/s | % of {} TFLOP/s |",
        args.hbm_tb_s, args.tensor_tflop_s
    );
    println!("|---|---|---|---|---|---|---|");
    for r in &results {
        println!(
            "| {} | {} | {:.2} | {:.0} | {:.1}% | {:.1} | {:.1}% |",
            r.kernel,
            r.label,
            r.us,
            r.gb_s,
            100.0 * r.gb_s / (args.hbm_tb_s * 1e3),
            r.tflop_s,
            100.0 * r.tflop_s / args.tensor_tflop_s
        );
    }
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&results)?)?;
    }
    Ok(ExitCode::SUCCESS)
}
