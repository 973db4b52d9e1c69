// SPDX-License-Identifier: MIT OR Apache-2.0
//! `met doctor`: what this machine and this binary can do, as text or JSON.

use std::process::ExitCode;

use metrale_core::SmArch;
use metrale_gpu_runtime::GpuError;
use metrale_gpu_runtime::probe::{self, DriverInfo, LibraryStatus};
use serde::Serialize;

/// Options of `met doctor`.
#[derive(clap::Args)]
pub struct Args {
    /// Print the report as one JSON object instead of text.
    #[arg(long)]
    json: bool,
}

#[derive(Serialize)]
struct Report {
    version: &'static str,
    ok: bool,
    driver: Option<DriverJson>,
    gpu_error: Option<String>,
    targets: Vec<TargetJson>,
    preflight: Vec<PreflightJson>,
    libraries: Vec<LibraryJson>,
    checks: Vec<Check>,
}

#[derive(Serialize)]
struct DriverJson {
    cuda_version: String,
    devices: Vec<DeviceJson>,
}

#[derive(Serialize)]
struct DeviceJson {
    ordinal: usize,
    name: String,
    total_memory_bytes: u64,
    compute_capability: String,
    sm: String,
    sm_count: u32,
}

#[derive(Serialize)]
struct TargetJson {
    target: String,
    arch: String,
    modules: usize,
    image_bytes: usize,
    model_types: Vec<&'static str>,
    hidden_size: Option<u64>,
    closure_hash: &'static str,
}

#[derive(Serialize)]
struct PreflightJson {
    device: usize,
    hardware: &'static str,
    arch: &'static str,
    passes: bool,
    reason: String,
}

#[derive(Serialize)]
struct LibraryJson {
    name: &'static str,
    loaded: bool,
    loaded_from: Option<String>,
}

#[derive(Serialize)]
struct Check {
    name: &'static str,
    /// `pass`, `fail` (required check; exit code 1) or `warn` (optional capability missing).
    status: &'static str,
    detail: String,
}

fn gather() -> Report {
    let driver: Result<DriverInfo, GpuError> = probe::probe_driver();
    let mut checks = Vec::new();

    let (driver_json, gpu_error) = match &driver {
        Ok(info) => {
            checks.push(Check {
                name: "gpu",
                status: "pass",
                detail: format!(
                    "{} CUDA device(s), driver supports CUDA {}.{}",
                    info.devices.len(),
                    info.cuda_version.0,
                    info.cuda_version.1
                ),
            });
            let devices = info
                .devices
                .iter()
                .map(|d| DeviceJson {
                    ordinal: d.ordinal,
                    name: d.name.clone(),
                    total_memory_bytes: d.total_memory,
                    compute_capability: format!(
                        "{}.{}",
                        d.compute_capability.0, d.compute_capability.1
                    ),
                    sm: d.sm(),
                    sm_count: d.sm_count,
                })
                .collect();
            (
                Some(DriverJson {
                    cuda_version: format!("{}.{}", info.cuda_version.0, info.cuda_version.1),
                    devices,
                }),
                None,
            )
        }
        Err(e) => {
            checks.push(Check {
                name: "gpu",
                status: "fail",
                detail: format!("no usable GPU: {e}"),
            });
            (None, Some(e.to_string()))
        }
    };

    let targets: Vec<TargetJson> = metrale_kernels::TARGETS
        .iter()
        .map(|t| TargetJson {
            target: t.target.path(),
            arch: t.target.arch.to_string(),
            modules: t.modules.len(),
            image_bytes: t.image_bytes(),
            model_types: t.serves.model_types.to_vec(),
            hidden_size: t.serves.hidden_size,
            closure_hash: t.closure_hash,
        })
        .collect();
    checks.push(if targets.is_empty() {
        Check {
            name: "kernels",
            status: "fail",
            detail: "this binary embeds no kernel targets (built with METRALE_SKIP_BUILD=1?)"
                .into(),
        }
    } else {
        Check {
            name: "kernels",
            status: "pass",
            detail: format!(
                "{} targets, {} modules embedded",
                targets.len(),
                targets.iter().map(|t| t.modules).sum::<usize>()
            ),
        }
    });

    // One preflight per (device, hardware class): can this GPU run the class's binaries?
    let mut preflight = Vec::new();
    if let Ok(info) = &driver {
        let mut classes: Vec<(&'static str, &'static str)> = metrale_kernels::TARGETS
            .iter()
            .map(|t| (t.target.hardware, t.target.arch))
            .collect();
        classes.dedup();
        for d in &info.devices {
            for &(hardware, arch) in &classes {
                let result = match arch.parse::<SmArch>() {
                    Ok(a) => a.preflight(d.compute_capability.0, d.compute_capability.1),
                    Err(e) => metrale_core::Preflight {
                        passes: false,
                        reason: e.to_string(),
                    },
                };
                preflight.push(PreflightJson {
                    device: d.ordinal,
                    hardware,
                    arch,
                    passes: result.passes,
                    reason: result.reason,
                });
            }
        }
        let any = preflight.iter().any(|p| p.passes);
        checks.push(Check {
            name: "preflight",
            status: if any { "pass" } else { "fail" },
            detail: if any {
                "at least one GPU can run an embedded target".into()
            } else {
                "no GPU can run any embedded target's binaries".into()
            },
        });
    }

    let libraries: Vec<LibraryStatus> = vec![probe::probe_cublaslt(), probe::probe_nccl()];
    for lib in &libraries {
        checks.push(Check {
            name: if lib.name == "NCCL" {
                "nccl"
            } else {
                "cublaslt"
            },
            status: if lib.loaded_from.is_some() {
                "pass"
            } else {
                "warn"
            },
            detail: match &lib.loaded_from {
                Some(from) => format!("{} loads from {from}", lib.name),
                None => format!(
                    "{} cannot be loaded (tried {})",
                    lib.name,
                    lib.tried.join(", ")
                ),
            },
        });
    }

    Report {
        version: crate::long_version(),
        ok: checks.iter().all(|c| c.status != "fail"),
        driver: driver_json,
        gpu_error,
        targets,
        preflight,
        libraries: libraries
            .into_iter()
            .map(|l| LibraryJson {
                name: l.name,
                loaded: l.loaded_from.is_some(),
                loaded_from: l.loaded_from,
            })
            .collect(),
        checks,
    }
}

fn gib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}

fn print_text(r: &Report) {
    println!("met {}", r.version);
    println!("\nGPUs");
    match (&r.driver, &r.gpu_error) {
        (Some(d), _) => {
            println!("  driver supports CUDA {}", d.cuda_version);
            for dev in &d.devices {
                println!(
                    "  [{}] {}  {:.1} GiB  compute {} ({})  {} SMs",
                    dev.ordinal,
                    dev.name,
                    gib(dev.total_memory_bytes),
                    dev.compute_capability,
                    dev.sm,
                    dev.sm_count
                );
            }
        }
        (None, Some(e)) => println!("  none: {e}"),
        (None, None) => {}
    }
    println!("\nEmbedded kernel targets");
    if r.targets.is_empty() {
        println!("  none");
    }
    for t in &r.targets {
        let width = t.hidden_size.map_or("any hidden_size".to_string(), |h| {
            format!("hidden_size {h}")
        });
        println!(
            "  {:<24} {:<8} {:>2} modules {:>8.1} KiB  serves {:?}, {width}",
            t.target,
            t.arch,
            t.modules,
            t.image_bytes as f64 / 1024.0,
            t.model_types
        );
    }
    if !r.preflight.is_empty() {
        println!("\nArch preflight");
        for p in &r.preflight {
            println!(
                "  GPU {} / {} ({}): {} — {}",
                p.device,
                p.hardware,
                p.arch,
                if p.passes { "pass" } else { "FAIL" },
                p.reason
            );
        }
    }
    println!("\nLibraries");
    for l in &r.libraries {
        match &l.loaded_from {
            Some(from) => println!("  {:<9} loads from {from}", l.name),
            None => println!("  {:<9} not loadable", l.name),
        }
    }
    println!("\nChecks");
    for c in &r.checks {
        println!("  {:<4} {:<10} {}", c.status, c.name, c.detail);
    }
    println!(
        "\n{}",
        if r.ok {
            "doctor: all required checks pass"
        } else {
            "doctor: a required check failed"
        }
    );
}

/// Runs `met doctor`.
pub fn run(args: &Args) -> anyhow::Result<ExitCode> {
    let report = gather();
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print_text(&report);
    }
    Ok(if report.ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}
