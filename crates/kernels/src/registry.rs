// SPDX-License-Identifier: MIT OR Apache-2.0
//! The generated registry of embedded targets and the types it is made of.
//!
//! `build/main.rs` writes `$OUT_DIR/registry.rs`; this module includes it. With
//! `METRALE_SKIP_BUILD=1` [`TARGETS`] is empty but [`names`] is complete, so every crate compiles
//! the same way with or without nvcc.

use metrale_core::KernelTarget;

/// One compiled module: a fatbin with SASS for the target's arch plus PTX of the same virtual arch.
#[derive(Debug)]
pub struct KernelModule {
    /// Module name (source stem unless `[modules]` renamed it).
    pub name: &'static str,
    /// Content hash of the source's include closure, flags, arch and compiler.
    pub compile_key: &'static str,
    /// The fatbin bytes, loadable with `cuModuleLoadData`.
    pub image: &'static [u8],
}

/// Which checkpoints a target serves (`MODEL.toml` `[model]`).
#[derive(Debug)]
pub struct ModelMatch {
    /// HF `model_type` values.
    pub model_types: &'static [&'static str],
    /// The exact `hidden_size`, or `None` for any.
    pub hidden_size: Option<u64>,
    /// Tie-breaking substrings matched against the model's id, name and directory.
    pub match_names: &'static [&'static str],
}

/// Serving levers of `HARDWARE.toml` `[defaults]`.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub struct ServingDefaults {
    /// Fraction of free device memory to use.
    pub gpu_memory_utilization: Option<f64>,
    /// Largest decode batch.
    pub max_batch_size: Option<u32>,
    /// Prompt tokens per prefill chunk.
    pub max_prefill_tokens: Option<u32>,
    /// Tokens per KV block.
    pub kv_block_size: Option<u32>,
}

/// Facts of the class's reference part (`HARDWARE.toml` `[memory]`).
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub struct HardwareMemory {
    /// Device memory, GiB.
    pub capacity_gib: Option<f64>,
    /// Measured read bandwidth, GB/s.
    pub bandwidth_gbs: Option<f64>,
    /// L2, MiB.
    pub l2_mib: Option<f64>,
    /// SM count.
    pub sm_count: Option<u32>,
}

/// Launch-geometry facts of the class (`HARDWARE.toml` `sm_count` and `[schedule]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HardwareSchedule {
    /// Streaming multiprocessors of the reference part.
    pub sm_count: u32,
    /// GEMV blocks resident per SM.
    pub gemv_blocks_per_sm: u32,
    /// Decode attention blocks a split launch aims for per SM.
    pub attention_blocks_per_sm: u32,
}

impl HardwareSchedule {
    /// The facts the Hopper class's `HARDWARE.toml` gives ([`hardware::hopper`]): the kernels
    /// every target of this tree runs are Hopper's.
    pub const HOPPER: HardwareSchedule = HardwareSchedule {
        sm_count: hardware::hopper::SM_COUNT,
        gemv_blocks_per_sm: hardware::hopper::GEMV_BLOCKS_PER_SM,
        attention_blocks_per_sm: hardware::hopper::ATTENTION_BLOCKS_PER_SM,
    };
}

/// Everything embedded for one `(hardware, model, quant)` target.
#[derive(Debug)]
pub struct TargetKernels {
    /// The dispatch key.
    pub target: KernelTarget,
    /// `HARDWARE.toml` `name`.
    pub hardware_name: &'static str,
    /// `HARDWARE.toml` `vendor`.
    pub vendor: &'static str,
    /// Hash over the modules' compile keys and every manifest the target read.
    pub closure_hash: &'static str,
    /// Compiled modules, sorted by name.
    pub modules: &'static [KernelModule],
    /// Which checkpoints it serves.
    pub serves: ModelMatch,
    /// Serving defaults of the hardware class.
    pub defaults: ServingDefaults,
    /// Memory facts of the hardware class.
    pub memory: HardwareMemory,
    /// Launch-geometry facts of the class.
    pub schedule: HardwareSchedule,
    /// Schedule defaults (`key`, value): the class's `HARDWARE.toml` `[tuning]` under the
    /// target's `KERNEL.toml` `[tuning]` tables; the engine's `Tuning` applies them at load.
    pub tuning: &'static [(&'static str, &'static str)],
}

impl TargetKernels {
    /// The module of that name, if this target has it.
    pub fn module(&self, name: &str) -> Option<&KernelModule> {
        self.modules.iter().find(|m| m.name == name)
    }

    /// Total bytes of embedded images.
    pub fn image_bytes(&self) -> usize {
        self.modules.iter().map(|m| m.image.len()).sum()
    }
}

include!(concat!(env!("OUT_DIR"), "/registry.rs"));
