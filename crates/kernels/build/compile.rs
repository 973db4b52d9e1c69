// SPDX-License-Identifier: MIT OR Apache-2.0
//! Compiling the selected targets: one nvcc run per distinct compile key, in parallel, cached.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;
use std::time::Instant;

use metrale_closure::{CompileKey, ResolvedTarget, include_closure};

use crate::env;

/// A compiled target: its resolution and, per module, the embedded fatbin.
pub struct CompiledTarget<'a> {
    pub target: &'a ResolvedTarget,
    /// (module name, fatbin in OUT_DIR, compile key)
    pub modules: Vec<(String, PathBuf, String)>,
}

struct Job {
    source: PathBuf,
    include_dirs: Vec<PathBuf>,
    flags: Vec<String>,
    arch: String,
}

const INSTALL_HINT: &str = "nvcc was not found. metrale compiles its CUDA kernels ahead of time and needs nvcc 13.0 (no GPU and no CUDA install needed):\n  scripts/install-nvcc.sh        # pinned PyPI wheels into .venv/nvcc, found automatically\nor point NVCC=/path/to/nvcc or CUDA_HOME at a CUDA 13.0 toolkit.\nTo build without kernels (lint, host-only tests), set METRALE_SKIP_BUILD=1.";

/// NVCC, then CUDA_HOME/bin/nvcc, then PATH, then the project's own .venv/nvcc.
fn find_nvcc() -> Result<PathBuf, String> {
    if let Some(nvcc) = env("NVCC") {
        let p = PathBuf::from(&nvcc);
        return if p.is_file() {
            Ok(p)
        } else {
            Err(format!("NVCC={nvcc} does not exist.\n{INSTALL_HINT}"))
        };
    }
    if let Some(home) = env("CUDA_HOME") {
        let p = Path::new(&home).join("bin/nvcc");
        if p.is_file() {
            return Ok(p);
        }
    }
    if let Some(path) = std::env::var_os("PATH") {
        for dir in std::env::split_paths(&path) {
            let p = dir.join("nvcc");
            if p.is_file() {
                return Ok(p);
            }
        }
    }
    // The manifest directory cargo gives this run, not the one baked in when the build script was
    // compiled: a target directory shared with a worktree elsewhere (scripts/ab-build.sh) reuses
    // a build script compiled there, whose baked-in path may be gone.
    let manifest = std::env::var_os("CARGO_MANIFEST_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")));
    let venv = manifest.join("../../.venv/nvcc/lib");
    if let Ok(entries) = std::fs::read_dir(&venv) {
        for entry in entries.flatten() {
            let p = entry.path().join("site-packages/nvidia/cu13/bin/nvcc");
            if p.is_file() {
                return Ok(p);
            }
        }
    }
    Err(INSTALL_HINT.to_string())
}

/// Where compiled fatbins are kept between builds: `METRALE_KERNEL_CACHE`, else
/// `<target dir>/metrale-kernel-cache` (found from OUT_DIR, which lives inside the target dir).
fn cache_dir(out_dir: &Path) -> PathBuf {
    if let Some(dir) = env("METRALE_KERNEL_CACHE") {
        return PathBuf::from(dir);
    }
    // OUT_DIR = <target>/<profile>/build/<pkg>-<hash>/out
    out_dir
        .ancestors()
        .nth(4)
        .map(|t| t.join("metrale-kernel-cache"))
        .unwrap_or_else(|| out_dir.join("cache"))
}

/// `sm_90a` -> `compute_90a`.
fn virtual_arch(arch: &str) -> String {
    arch.replacen("sm_", "compute_", 1)
}

pub fn compile_targets<'a>(
    selected: &[&'a ResolvedTarget],
    out_dir: &Path,
) -> Result<Vec<CompiledTarget<'a>>, String> {
    let nvcc = find_nvcc()?;
    let version = Command::new(&nvcc)
        .arg("--version")
        .output()
        .map_err(|e| format!("cannot run {}: {e}\n{INSTALL_HINT}", nvcc.display()))?;
    let compiler = String::from_utf8_lossy(&version.stdout).trim().to_string();
    let extra: Vec<String> = env("METRALE_EXTRA_NVCC_FLAGS")
        .map(|f| f.split_whitespace().map(String::from).collect())
        .unwrap_or_default();
    let cache = cache_dir(out_dir);
    std::fs::create_dir_all(&cache).map_err(|e| format!("{}: {e}", cache.display()))?;
    let modules_dir = out_dir.join("modules");
    std::fs::create_dir_all(&modules_dir).map_err(|e| format!("{}: {e}", modules_dir.display()))?;

    let mut jobs: BTreeMap<String, Job> = BTreeMap::new();
    let mut compiled = Vec::new();
    for &target in selected {
        let arch = target.hardware.hardware.arch.clone();
        let mut flags = target.flags.clone();
        flags.extend(extra.iter().cloned());
        let mut modules = Vec::new();
        for source in &target.sources {
            let closure =
                include_closure(&source.path, &target.include_dirs).map_err(|e| e.to_string())?;
            for file in &closure {
                println!("cargo:rerun-if-changed={}", file.display());
            }
            let key = CompileKey::new(&closure, &flags, &arch, &compiler)
                .map_err(|e| e.to_string())?
                .0;
            jobs.entry(key.clone()).or_insert_with(|| Job {
                source: source.path.clone(),
                include_dirs: target.include_dirs.clone(),
                flags: flags.clone(),
                arch: arch.clone(),
            });
            modules.push((
                source.module.clone(),
                modules_dir.join(format!("{key}.fatbin")),
                key,
            ));
        }
        compiled.push(CompiledTarget { target, modules });
    }

    let started = Instant::now();
    let pending: Vec<(&String, &Job)> = jobs
        .iter()
        .filter(|(key, _)| !cache.join(format!("{key}.fatbin")).is_file())
        .collect();
    let threads = env("NUM_JOBS")
        .and_then(|n| n.parse().ok())
        .unwrap_or(2usize)
        .clamp(1, 64);
    let queue = Mutex::new(pending.iter());
    let errors = Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for _ in 0..threads.min(pending.len().max(1)) {
            s.spawn(|| {
                loop {
                    let next = queue.lock().unwrap().next();
                    let Some((key, job)) = next else { break };
                    if let Err(e) = run_nvcc(&nvcc, job, &cache.join(format!("{key}.fatbin"))) {
                        errors.lock().unwrap().push(e);
                    }
                }
            });
        }
    });
    let errors = errors.into_inner().unwrap();
    if !errors.is_empty() {
        return Err(errors.join("\n\n"));
    }
    for key in jobs.keys() {
        let cached = cache.join(format!("{key}.fatbin"));
        let embedded = modules_dir.join(format!("{key}.fatbin"));
        if !embedded.is_file() {
            std::fs::copy(&cached, &embedded).map_err(|e| format!("{}: {e}", cached.display()))?;
        }
    }
    let report = format!(
        "compiler: {}\ntargets: {}\nmodule instances: {}\ndistinct compile keys: {}\ncompiled now: {}\nfrom cache: {}\ncompile wall time: {:.2}s on {threads} threads\ncache: {}\n",
        nvcc.display(),
        compiled.len(),
        compiled.iter().map(|c| c.modules.len()).sum::<usize>(),
        jobs.len(),
        pending.len(),
        jobs.len() - pending.len(),
        started.elapsed().as_secs_f64(),
        cache.display()
    );
    std::fs::write(out_dir.join("kernel-build-report.txt"), report).map_err(|e| e.to_string())?;
    Ok(compiled)
}

fn run_nvcc(nvcc: &Path, job: &Job, output: &Path) -> Result<(), String> {
    let tmp = output.with_extension(format!("tmp{}", std::process::id()));
    let mut cmd = Command::new(nvcc);
    cmd.arg(format!(
        "-gencode=arch={},code=[{},{}]",
        virtual_arch(&job.arch),
        job.arch,
        virtual_arch(&job.arch)
    ))
    .args(["-fatbin", "-std=c++17"])
    .args(&job.flags);
    for dir in &job.include_dirs {
        cmd.arg("-I").arg(dir);
    }
    cmd.arg("-o").arg(&tmp).arg(&job.source);
    let out = cmd
        .output()
        .map_err(|e| format!("cannot run {}: {e}", nvcc.display()))?;
    if !out.status.success() {
        let _ = std::fs::remove_file(&tmp);
        return Err(format!(
            "nvcc failed on {}:\n{:?}\n{}{}",
            job.source.display(),
            cmd,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    std::fs::rename(&tmp, output).map_err(|e| format!("{}: {e}", output.display()))
}
