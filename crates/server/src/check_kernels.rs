// SPDX-License-Identifier: MIT OR Apache-2.0
//! `met check-kernels`: every CUDA kernel against its host reference, on this GPU.

use std::process::ExitCode;

use anyhow::Context;
use metrale_gpu_runtime::check::{
    self, BF16_ELEMENT_ATOL_OF_RMS, BF16_ELEMENT_RTOL, BF16_REL_L2, F32_ELEMENT_ATOL,
    F32_ELEMENT_RTOL, PAGED_ATTENTION_PARTIALS_ATOL_OF_RMS,
};
use metrale_gpu_runtime::{CudaBackend, HostBackend};

/// Options of `met check-kernels`.
#[derive(clap::Args)]
pub struct Args {
    /// Kernel target to check (`hw/model/quant`, `model/quant` or `model`); default: every
    /// embedded target whose arch this GPU passes.
    #[arg(long)]
    kernel_target: Option<String>,
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0)]
    device: usize,
    /// Seed of the random inputs; default: derived from the clock, and printed.
    #[arg(long)]
    seed: Option<u64>,
    /// Check only the kernels whose name (`module::function`) contains this text.
    #[arg(long)]
    kernel: Option<String>,
}

/// Runs `met check-kernels`.
pub fn run(args: &Args) -> anyhow::Result<ExitCode> {
    let seed = args.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64)
    });
    let info = metrale_gpu_runtime::probe::device_info(args.device)
        .context("check-kernels needs a CUDA GPU")?;
    let targets: Vec<_> = metrale_kernels::TARGETS
        .iter()
        .filter(|t| match &args.kernel_target {
            Some(pin) => {
                let k = &t.target;
                *pin == k.path() || *pin == format!("{}/{}", k.model, k.quant) || *pin == k.model
            }
            None => t
                .target
                .arch
                .parse::<metrale_core::SmArch>()
                .is_ok_and(|a| {
                    a.preflight(info.compute_capability.0, info.compute_capability.1)
                        .passes
                }),
        })
        .collect();
    if targets.is_empty() {
        anyhow::bail!(
            "no embedded kernel target to check on {} ({}); embedded: {}",
            info.name,
            info.sm(),
            metrale_kernels::TARGETS
                .iter()
                .map(|t| t.target.path())
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    println!("met {}", crate::long_version());
    println!(
        "GPU {}: {} ({}), seed {seed}",
        args.device,
        info.name,
        info.sm()
    );
    println!(
        "metric: bf16 outputs need every element within {BF16_ELEMENT_RTOL:.4}*|ref| + {BF16_ELEMENT_ATOL_OF_RMS:.5}*rms(ref) (the prefill attention also allows, per element, the effect of the bf16 probabilities its reference finds within 2^10 f32 ulps of a rounding boundary rounding the other way) and rel-L2 <= {BF16_REL_L2:e}; f32 outputs within {F32_ELEMENT_RTOL:e}*|ref| + {F32_ELEMENT_ATOL:e} (for the decode attention's split partials, whose probabilities are f16, the absolute term is the larger of {F32_ELEMENT_ATOL:e} and {PAGED_ATTENTION_PARTIALS_ATOL_OF_RMS:.5}*rms(ref)); token ids must match exactly"
    );
    let mut failures = 0;
    let mut total = 0;
    // The host references once for every target (the same inputs at a seed).
    let select = |kernel: metrale_core::KernelName| {
        args.kernel
            .as_ref()
            .is_none_or(|only| kernel.to_string().contains(only.as_str()))
    };
    let reference = check::Reference::for_seed(&HostBackend::new(16 << 30), seed, &select)?;
    for target in targets {
        let cuda = CudaBackend::new(args.device, target)
            .with_context(|| format!("loading {}", target.target.path()))?;
        let results = reference.check(&cuda, &mut |kernel, shape| {
            eprintln!("checking {kernel} {shape}");
        })?;
        println!(
            "\ntarget {} ({} modules)",
            target.target.path(),
            target.modules.len()
        );
        println!(
            "  {:<32} {:<52} {:>10} {:>10} {:>12}  result",
            "kernel", "shape", "max_abs", "rel_l2", "mismatched"
        );
        for r in &results {
            total += 1;
            if !r.passed {
                failures += 1;
            }
            println!(
                "  {:<32} {:<52} {:>10.3e} {:>10.3e} {:>5}/{:<6}  {}",
                r.kernel.to_string(),
                r.shape,
                r.max_abs,
                r.rel_l2,
                r.mismatches,
                r.elements,
                if r.passed { "pass" } else { "FAIL" }
            );
            if let Some((buffer, index, got, want)) = r.first_mismatch {
                println!(
                    "    first mismatch: buffer {buffer} element {index}: got {got:e}, want {want:e}"
                );
            }
        }
    }
    println!("\n{} of {total} cases pass", total - failures);
    Ok(if failures == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}
