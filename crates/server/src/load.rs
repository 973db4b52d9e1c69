// SPDX-License-Identifier: MIT OR Apache-2.0
//! From a model argument to a running model: find the files, read the config, pick the backend
//! and the kernel target, upload the weights with a progress line.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, bail};
use metrale_config::ModelConfig;
use metrale_core::KvCacheDtype;
use metrale_gpu_runtime::{CudaBackend, GpuBackend, HostBackend};
use metrale_kernels::{ModelQuery, TargetKernels};
use metrale_model_engine::{LinearFormat, ModelOptions, Tuning};
use metrale_model_weights::{Fp8Scheme, GgufFile, SafetensorsCheckpoint, WeightSource};

/// Where the checkpoint is and what format it has.
pub enum Checkpoint {
    /// A `.gguf` file.
    Gguf(GgufFile),
    /// A directory with `config.json` and safetensors.
    Safetensors {
        dir: PathBuf,
        weights: SafetensorsCheckpoint,
        /// The FP8 scheme of its `quantization_config`, if it has one.
        fp8: Option<Fp8Scheme>,
    },
}

impl Checkpoint {
    /// The weights.
    pub fn source(&self) -> &dyn WeightSource {
        match self {
            Checkpoint::Gguf(g) => g,
            Checkpoint::Safetensors { weights, .. } => weights,
        }
    }

    /// How the dense linears load: the checkpoint's FP8, else quantized to FP8 when
    /// `--quantization fp8` asks, else BF16.
    pub fn linear_format(&self, args: &ModelArgs) -> LinearFormat {
        match (self, args.quantization) {
            (Checkpoint::Safetensors { fp8: Some(s), .. }, _) => LinearFormat::Fp8Stored(s.clone()),
            (_, Some(Quantization::Fp8)) => LinearFormat::Fp8Quantize,
            (_, None) => LinearFormat::Bf16,
        }
    }
}

/// Weight quantization at load (`--quantization`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Quantization {
    /// FP8 E4M3 with an f32 scale per 128x128 block.
    Fp8,
}

/// Backend choice on the command line.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum BackendChoice {
    /// CUDA when a GPU passes the preflight for an embedded target, else the host backend.
    Auto,
    /// The GPU, or an error.
    Cuda,
    /// The CPU reference implementation (slow).
    Host,
}

/// Model-selection flags shared by `generate` and `serve`.
#[derive(clap::Args, Clone, Debug)]
pub struct ModelArgs {
    /// A Hugging Face model id (`Qwen/Qwen3-8B`) found in the local HF cache (HF_HUB_CACHE,
    /// HF_HOME/hub or ~/.cache/huggingface/hub); nothing is downloaded. `met serve` with neither
    /// this nor --model-from-path serves the default model scripts/setup.sh fetches
    /// (SmolLM2-135M-Instruct, .cache/test-data/smollm2/).
    pub model: Option<String>,
    /// A model directory (config.json + *.safetensors + tokenizer files) or a .gguf file.
    #[arg(long, value_name = "PATH", conflicts_with = "model")]
    pub model_from_path: Option<PathBuf>,
    /// Pin the kernel target (`hw/model/quant`, `model/quant` or `model`) instead of resolving it
    /// from the checkpoint's model_type and hidden_size.
    #[arg(long)]
    pub kernel_target: Option<String>,
    /// Where to run.
    #[arg(long, value_enum, default_value_t = BackendChoice::Auto)]
    pub backend: BackendChoice,
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0)]
    pub device: usize,
    /// Longest sequence (prompt plus output) in tokens; default: the model's limit, capped at
    /// 32768 on CUDA and 4096 on the host backend. It sizes the KV cache and the RoPE tables.
    #[arg(long)]
    pub max_seq_len: Option<usize>,
    /// Quantize the dense linear weights at load. `fp8`: q|k|v, o, gate|up and down as FP8 E4M3
    /// with an f32 scale per 128x128 block (each block's largest magnitude / 448), half the bytes
    /// a decode step reads; the embedding, the LM head, norms, MoE routers and experts stay BF16.
    /// An FP8 checkpoint (its config.json's quantization_config) runs in FP8 without this flag.
    #[arg(long, value_enum, value_name = "SCHEME")]
    pub quantization: Option<Quantization>,
    /// The KV cache's element type (vLLM's flag). `auto`: bf16 today. `fp8` (or `fp8_e4m3`):
    /// E4M3 with one f32 scale per layer for the keys and one for the values (the checkpoint's
    /// k_scale / v_scale where it has them, else 1.0), half the bytes a cached token takes, so
    /// the pool holds twice the tokens. Head dims 64, 128 and 256.
    #[arg(long, value_name = "DTYPE", default_value = "auto", value_parser = parse_kv_cache_dtype)]
    pub kv_cache_dtype: KvCacheDtype,
    /// Where the sampling a request leaves unset comes from (vLLM's flag). `auto`: the
    /// checkpoint's generation_config.json (temperature, top_p, top_k, min_p,
    /// repetition_penalty), then the model family's presets for what it leaves out; `off`: the
    /// family's presets only. A GGUF file has no generation_config.json.
    #[arg(long, value_enum, value_name = "SOURCE", default_value_t = GenerationConfig::Auto)]
    pub generation_config: GenerationConfig,
}

/// `--generation-config`.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum GenerationConfig {
    /// The checkpoint's generation_config.json over the family's presets.
    Auto,
    /// The family's presets only.
    Off,
}

/// The sampling defaults of requests: the checkpoint's generation_config.json (with
/// `--generation-config auto`) over the family's presets, and a line saying where they came from.
pub fn sampling_defaults(
    checkpoint: &Checkpoint,
    config: &ModelConfig,
    source: GenerationConfig,
) -> anyhow::Result<(metrale_config::SamplingPresets, String)> {
    let dir = match checkpoint {
        Checkpoint::Safetensors { dir, .. } => Some(dir.as_path()),
        Checkpoint::Gguf(_) => None,
    };
    sampling_defaults_in(dir, config, source)
}

/// [`sampling_defaults`] for a checkpoint in `dir` (`None`: a GGUF file).
fn sampling_defaults_in(
    dir: Option<&Path>,
    config: &ModelConfig,
    source: GenerationConfig,
) -> anyhow::Result<(metrale_config::SamplingPresets, String)> {
    let family = metrale_config::presets(config.family).sampling;
    let file = match (dir, source) {
        (Some(dir), GenerationConfig::Auto) => {
            Some(dir.join("generation_config.json")).filter(|p| p.is_file())
        }
        _ => None,
    };
    let Some(path) = file else {
        return Ok((
            family,
            format!("the {} presets", config.family.model_type()),
        ));
    };
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let json: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("{} is not JSON", path.display()))?;
    let object = json
        .as_object()
        .with_context(|| format!("{} is not a JSON object", path.display()))?;
    let from_file =
        metrale_config::SamplingPresets::from_generation_config(object).map_err(|e| {
            anyhow::anyhow!(
                "{}: {e} (--generation-config off ignores it)",
                path.display()
            )
        })?;
    Ok((
        from_file.or(family),
        format!(
            "{} over the {} presets",
            path.display(),
            config.family.model_type()
        ),
    ))
}

/// `--kv-cache-dtype`: vLLM's names ([`KvCacheDtype`]'s `FromStr`); anything else is refused
/// with the values it takes.
fn parse_kv_cache_dtype(s: &str) -> Result<KvCacheDtype, String> {
    s.parse::<KvCacheDtype>().map_err(|e| e.to_string())
}

fn hf_cache_dirs() -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    if let Ok(d) = std::env::var("HF_HUB_CACHE") {
        dirs.push(PathBuf::from(d));
    }
    if let Ok(d) = std::env::var("HF_HOME") {
        dirs.push(Path::new(&d).join("hub"));
    }
    if let Some(home) = std::env::var_os("HOME") {
        dirs.push(Path::new(&home).join(".cache/huggingface/hub"));
    }
    dirs
}

/// Resolves an HF id through the HF cache layout: `models--{org}--{name}/snapshots/{rev}` with
/// `rev` read from `refs/main` (or the only snapshot).
pub fn resolve_hf_id(id: &str) -> anyhow::Result<PathBuf> {
    let folder = format!("models--{}", id.replace('/', "--"));
    let searched = hf_cache_dirs();
    for cache in &searched {
        let repo = cache.join(&folder);
        if !repo.is_dir() {
            continue;
        }
        if let Ok(rev) = std::fs::read_to_string(repo.join("refs/main")) {
            let snap = repo.join("snapshots").join(rev.trim());
            if snap.is_dir() {
                return Ok(snap);
            }
        }
        let snaps: Vec<PathBuf> = std::fs::read_dir(repo.join("snapshots"))
            .map(|d| d.filter_map(|e| e.ok().map(|e| e.path())).collect())
            .unwrap_or_default();
        if let [one] = snaps.as_slice() {
            return Ok(one.clone());
        }
    }
    bail!(
        "model `{id}` is not in the local Hugging Face cache (looked for {folder} in {}); metrale downloads nothing: put the files there or pass --model-from-path",
        searched
            .iter()
            .map(|d| d.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    )
}

/// The model `met serve` runs when none is named: SmolLM2-135M-Instruct (Q4_1 GGUF), which
/// `scripts/setup.sh` fetches, pinned by sha256, to this path under the repository.
pub const DEFAULT_MODEL: &str = ".cache/test-data/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";

/// Where the default model is: under the current directory, else under the repository the
/// binary was built in, when `exe` is `<repo>/target/<profile>/met` (a binary copied elsewhere
/// has no repository to look in). The error names the places looked in and the command that
/// fetches it.
pub fn default_model(cwd: &Path, exe: Option<&Path>) -> anyhow::Result<PathBuf> {
    let repo = exe.and_then(|e| {
        let target = e.parent()?.parent()?;
        (target.file_name()? == "target").then_some(target.parent()?)
    });
    let mut candidates: Vec<PathBuf> = std::iter::once(cwd)
        .chain(repo)
        .map(|root| root.join(DEFAULT_MODEL))
        .collect();
    candidates.dedup();
    match candidates.iter().find(|p| p.is_file()) {
        Some(found) => Ok(found.clone()),
        None => bail!(
            "no model given, and the default model (SmolLM2-135M-Instruct) is not at {}: run \
             scripts/setup.sh (it fetches it), or name a model (an HF id or --model-from-path PATH)",
            candidates
                .iter()
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>()
                .join(" or ")
        ),
    }
}

/// Opens the checkpoint the flags name and reads its config.
pub fn open_checkpoint(args: &ModelArgs) -> anyhow::Result<(Checkpoint, ModelConfig, Vec<String>)> {
    let (path, mut references) = match (&args.model, &args.model_from_path) {
        (Some(id), None) => (resolve_hf_id(id)?, vec![id.clone()]),
        (None, Some(p)) => (p.clone(), vec![]),
        _ => bail!(
            "name a model: an HF id (met generate Qwen/Qwen3-8B ...) or --model-from-path PATH"
        ),
    };
    if !path.exists() {
        bail!("model path {} does not exist", path.display());
    }
    references.push(path.display().to_string());
    if path.is_file() {
        if path.extension().is_none_or(|e| e != "gguf") {
            bail!(
                "{} is a file but not a .gguf; pass a .gguf file or a model directory with config.json",
                path.display()
            );
        }
        let gguf = GgufFile::open(&path)?;
        let config = gguf
            .config()
            .with_context(|| format!("reading the model config from {}", path.display()))?;
        if let Some(name) = gguf.metadata.get("general.name").and_then(|v| v.as_str()) {
            references.push(name.to_string());
        }
        return Ok((Checkpoint::Gguf(gguf), config, references));
    }
    let config_path = path.join("config.json");
    let text = std::fs::read_to_string(&config_path)
        .with_context(|| format!("reading {}", config_path.display()))?;
    let config = metrale_config::from_config_json(&text)
        .with_context(|| format!("in {}", config_path.display()))?;
    // An unknown quantization scheme is refused here, before any weight is read.
    let fp8 = Fp8Scheme::from_config_json(&text)
        .with_context(|| format!("in {}", config_path.display()))?;
    let weights = SafetensorsCheckpoint::open(&path)?;
    Ok((
        Checkpoint::Safetensors {
            dir: path,
            weights,
            fp8,
        },
        config,
        references,
    ))
}

/// The backend and (for CUDA) the kernel target.
pub struct Placement {
    /// The backend.
    pub gpu: Arc<dyn GpuBackend>,
    /// The embedded target serving the model, if one resolved.
    pub target: Option<&'static TargetKernels>,
    /// One line for the log.
    pub description: String,
}

/// The schedule the model runs with on `placement`: the kernel target's `[tuning]` (the Hopper
/// class's where no target resolved), the operator switches of the environment
/// (`METRALE_CUDA_GRAPHS`), then each `key=value` of `overrides` (`--tune`, for experiments).
/// A value the engine does not take is an error here, before any weight loads.
pub fn tuning(placement: &Placement, overrides: &[String]) -> anyhow::Result<Tuning> {
    let mut t = Tuning::for_placement(placement.target)?;
    t.apply_operator_env()?;
    for pair in overrides {
        t.set_pair(pair).with_context(|| format!("--tune {pair}"))?;
    }
    Ok(t)
}

/// Picks the backend: CUDA when asked or when `auto` finds a GPU that runs the resolved target.
pub fn place(
    args: &ModelArgs,
    config: &ModelConfig,
    references: Vec<String>,
) -> anyhow::Result<Placement> {
    let placement = place_backend(args, config, references)?;
    // A cache the backend or the model's head dim has no kernels for is refused here, before
    // any weight loads.
    ModelOptions::check_kv_cache(config, placement.gpu.as_ref(), args.kv_cache_dtype)?;
    Ok(placement)
}

fn place_backend(
    args: &ModelArgs,
    config: &ModelConfig,
    references: Vec<String>,
) -> anyhow::Result<Placement> {
    let query = ModelQuery {
        model_type: config.family.model_type(),
        hidden_size: config.hidden_size as u64,
        references,
        pinned: args.kernel_target.as_deref(),
        hardware: None,
    };
    let target = metrale_kernels::resolve_target(metrale_kernels::TARGETS, &query);
    let host_target = target.as_ref().ok().copied();
    let host = |why: String| -> anyhow::Result<Placement> {
        let capacity = host_capacity();
        Ok(Placement {
            gpu: Arc::new(HostBackend::new(capacity)),
            target: host_target,
            description: format!("host backend (CPU reference kernels; slow): {why}"),
        })
    };
    match args.backend {
        BackendChoice::Host => host("--backend host".into()),
        BackendChoice::Cuda | BackendChoice::Auto => {
            let info = metrale_gpu_runtime::probe::device_info(args.device);
            let target = match (target, info) {
                (Ok(t), Ok(_)) => t,
                (Err(e), _) if args.backend == BackendChoice::Cuda => return Err(e.into()),
                (_, Err(e)) if args.backend == BackendChoice::Cuda => return Err(e.into()),
                (Err(e), _) => return host(format!("no kernel target: {e}")),
                (_, Err(e)) => return host(format!("no usable GPU: {e}")),
            };
            match CudaBackend::new(args.device, target) {
                Ok(cuda) => {
                    let info = metrale_gpu_runtime::probe::device_info(args.device)?;
                    Ok(Placement {
                        description: format!(
                            "CUDA device {} ({}, {}), kernel target {}",
                            args.device,
                            info.name,
                            info.sm(),
                            target.target
                        ),
                        gpu: Arc::new(cuda),
                        target: Some(target),
                    })
                }
                Err(e) if args.backend == BackendChoice::Auto => host(format!(
                    "the GPU cannot run target {}: {e}",
                    target.target.path()
                )),
                Err(e) => Err(e.into()),
            }
        }
    }
}

/// Simulated device memory for the host backend: half of physical memory, at least 2 GiB.
fn host_capacity() -> u64 {
    let total = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find(|l| l.starts_with("MemTotal:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        })
        .map_or(8 << 30, |kib| kib * 1024);
    (total / 2).max(2 << 30)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sampling_defaults_come_from_generation_config_then_the_family() {
        let config = metrale_config::from_config_json(
            r#"{"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128,
                "num_attention_heads": 1, "num_key_value_heads": 1, "num_hidden_layers": 1,
                "vocab_size": 32, "head_dim": 64}"#,
        )
        .unwrap();
        let dir = tempfile::tempdir().unwrap();
        // No file: Qwen2's presets.
        let (p, from) =
            sampling_defaults_in(Some(dir.path()), &config, GenerationConfig::Auto).unwrap();
        assert_eq!(
            (p.temperature, p.repetition_penalty),
            (Some(0.7), Some(1.05))
        );
        assert!(from.contains("qwen2 presets"), "{from}");
        std::fs::write(
            dir.path().join("generation_config.json"),
            r#"{"temperature": 0.3, "top_k": 5, "eos_token_id": 2}"#,
        )
        .unwrap();
        let (p, from) =
            sampling_defaults_in(Some(dir.path()), &config, GenerationConfig::Auto).unwrap();
        assert_eq!(
            (p.temperature, p.top_k, p.top_p),
            (Some(0.3), Some(5), Some(0.8))
        );
        assert!(from.contains("generation_config.json"), "{from}");
        // `off`, or a GGUF file: the family's presets.
        let (p, _) =
            sampling_defaults_in(Some(dir.path()), &config, GenerationConfig::Off).unwrap();
        assert_eq!(p.temperature, Some(0.7));
        let (p, _) = sampling_defaults_in(None, &config, GenerationConfig::Auto).unwrap();
        assert_eq!(p.temperature, Some(0.7));
        // A value out of range is refused, naming the file, the key and the way around it.
        std::fs::write(dir.path().join("generation_config.json"), r#"{"top_p": 2}"#).unwrap();
        let err = sampling_defaults_in(Some(dir.path()), &config, GenerationConfig::Auto)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("generation_config.json") && err.contains("top_p") && err.contains("off"),
            "{err}"
        );
    }

    #[test]
    fn the_default_model_is_found_in_the_directory_or_beside_the_binary() {
        let root = std::env::temp_dir().join(format!("met-default-model-{}", std::process::id()));
        let repo = root.join("repo");
        let elsewhere = root.join("elsewhere");
        std::fs::create_dir_all(repo.join(".cache/test-data/smollm2")).unwrap();
        std::fs::create_dir_all(&elsewhere).unwrap();
        let exe = repo.join("target/release/met");
        // Missing everywhere: the error names the places and the setup command.
        let err = default_model(&elsewhere, Some(&exe))
            .unwrap_err()
            .to_string();
        assert!(err.contains("scripts/setup.sh"), "{err}");
        assert!(
            err.contains(&elsewhere.join(DEFAULT_MODEL).display().to_string()),
            "{err}"
        );
        assert!(
            err.contains(&repo.join(DEFAULT_MODEL).display().to_string()),
            "{err}"
        );
        // Beside the binary's repository, from another directory.
        std::fs::write(repo.join(DEFAULT_MODEL), b"gguf").unwrap();
        assert_eq!(
            default_model(&elsewhere, Some(&exe)).unwrap(),
            repo.join(DEFAULT_MODEL)
        );
        // The current directory's copy first.
        std::fs::create_dir_all(elsewhere.join(".cache/test-data/smollm2")).unwrap();
        std::fs::write(elsewhere.join(DEFAULT_MODEL), b"gguf").unwrap();
        assert_eq!(
            default_model(&elsewhere, Some(&exe)).unwrap(),
            elsewhere.join(DEFAULT_MODEL)
        );
        // A binary outside a `target/` folder has no repository: only the current directory.
        let copied = root.join("bin/met");
        let cwd = repo.join("crates");
        let err = default_model(&cwd, Some(&copied)).unwrap_err().to_string();
        assert!(
            err.contains(&cwd.join(DEFAULT_MODEL).display().to_string()),
            "{err}"
        );
        assert_eq!(err.matches(DEFAULT_MODEL).count(), 1, "{err}");
        std::fs::remove_dir_all(&root).unwrap();
    }
}
