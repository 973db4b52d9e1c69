// SPDX-License-Identifier: MIT OR Apache-2.0
//! The three manifests of the kernel tree, typed. Unknown keys are errors, so a typo in a manifest
//! fails the build instead of being silently ignored.

use std::collections::BTreeMap;
use std::path::Path;

use serde::Deserialize;

use crate::layout::LayoutError;

/// `kernels/<hw>/HARDWARE.toml`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HardwareManifest {
    /// Identity, vendor, arch and inheritance.
    pub hardware: HardwareSection,
    /// Memory and compute facts of the class's reference part.
    #[serde(default)]
    pub memory: MemorySection,
    /// Serving levers the class runs with, baked into the binary.
    #[serde(default)]
    pub defaults: ServingDefaults,
    /// Compiler flags for every source of every target of the class.
    #[serde(default)]
    pub build: BuildSection,
    /// Resident blocks per SM of the kernels whose launch geometry depends on them.
    #[serde(default)]
    pub schedule: ScheduleSection,
    /// The engine's measured schedule defaults for the class (`key = value`, the keys of
    /// `metrale_model_engine::Tuning`); a leaf's `KERNEL.toml` `[tuning]` overrides them.
    #[serde(default)]
    pub tuning: BTreeMap<String, toml::Value>,
}

/// `[schedule]` of `HARDWARE.toml`: how many blocks of a kernel family one SM holds at once, from
/// the kernels' launch bounds and shared memory. Launch geometry multiplies them by `sm_count`.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScheduleSection {
    /// GEMV blocks resident per SM (`__launch_bounds__(256, 3)` in gemv.cu).
    pub gemv_blocks_per_sm: Option<u32>,
    /// Decode attention blocks a split launch aims for per SM.
    pub attention_blocks_per_sm: Option<u32>,
}

/// `[hardware]` of `HARDWARE.toml`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HardwareSection {
    /// Human-readable name of the class (`NVIDIA Hopper`).
    pub name: String,
    /// `nvidia`, `amd`, `apple` or `intel` (and their spellings).
    pub vendor: String,
    /// The arch the sources are compiled for, verbatim (`sm_90a`).
    pub arch: String,
    /// Another class directory whose leaves and `common/` this class reuses.
    pub inherits: Option<String>,
}

/// `[memory]` of `HARDWARE.toml`: the reference part's facts, used for sizing and rooflines.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MemorySection {
    /// Device memory, GiB.
    pub capacity_gib: Option<f64>,
    /// Measured device-memory read bandwidth, GB/s.
    pub bandwidth_gbs: Option<f64>,
    /// L2 cache, MiB.
    pub l2_mib: Option<f64>,
    /// Streaming multiprocessors.
    pub sm_count: Option<u32>,
    /// Shared memory per SM usable by one block, KiB.
    pub shared_mem_per_block_kib: Option<u32>,
}

/// `[defaults]` of `HARDWARE.toml`: serving levers, read before the environment and the CLI.
#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ServingDefaults {
    /// Fraction of free device memory the engine may take for weights, KV cache and scratch.
    pub gpu_memory_utilization: Option<f64>,
    /// Largest decode batch.
    pub max_batch_size: Option<u32>,
    /// Prompt tokens per prefill chunk.
    pub max_prefill_tokens: Option<u32>,
    /// Tokens per KV cache block.
    pub kv_block_size: Option<u32>,
}

/// `[build]` of `HARDWARE.toml` or `KERNEL.toml`.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BuildSection {
    /// Extra compiler flags, appended in tree order (hardware, common, leaf).
    #[serde(default)]
    pub flags: Vec<String>,
}

/// `kernels/<hw>/<model>/MODEL.toml`: which checkpoints the model directory serves.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelManifest {
    /// Matching rules.
    pub model: ModelSection,
}

/// `[model]` of `MODEL.toml`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSection {
    /// HF `model_type` values this directory serves (`["qwen3"]`).
    pub model_types: Vec<String>,
    /// The exact `hidden_size` served; absent means any (a wildcard declaration).
    pub hidden_size: Option<u64>,
    /// Substrings that, found in the model id, `--model-name` or the model directory, prefer this
    /// target when several declarations match equally.
    #[serde(default)]
    pub match_names: Vec<String>,
}

/// `KERNEL.toml` of a `common/` or leaf directory.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KernelManifest {
    /// Flags for the target's sources.
    #[serde(default)]
    pub build: BuildSection,
    /// File stem to module name overrides.
    #[serde(default)]
    pub modules: BTreeMap<String, String>,
    /// Sources from elsewhere in the tree that join this layer.
    #[serde(default)]
    pub sources: SourcesSection,
    /// Stem to reason: the files of this layer that deliberately replace a lower layer's.
    #[serde(default)]
    pub shadow: BTreeMap<String, String>,
    /// Schedule defaults of this layer, over the class's `HARDWARE.toml` `[tuning]`.
    #[serde(default)]
    pub tuning: BTreeMap<String, toml::Value>,
}

/// `[sources]` of `KERNEL.toml`.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SourcesSection {
    /// Paths relative to the `kernels/` root (`hopper/qwen3/bf16/rope.cu`).
    #[serde(default, rename = "use")]
    pub use_: Vec<String>,
}

/// Reads and parses one manifest, naming the file in any error.
pub(crate) fn read<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T, LayoutError> {
    let text = std::fs::read_to_string(path).map_err(|e| LayoutError::Io {
        path: path.to_path_buf(),
        message: e.to_string(),
    })?;
    toml::from_str(&text).map_err(|e| LayoutError::Manifest {
        path: path.to_path_buf(),
        message: e.to_string(),
    })
}
