// SPDX-License-Identifier: MIT OR Apache-2.0
//! Reads the kernel tree: what each `(hardware, model, quant)` target is compiled from.
//!
//! The central decision: **the tree is resolved in exactly one place**. The kernels build script
//! compiles what [`layout::resolve_target`] returns, and every tool that reads the tree (tests,
//! `met doctor`, benchmarks) calls the same function, so "which file does this target compile" has
//! one answer.
//!
//! - [`manifest`]: the typed `HARDWARE.toml`, `MODEL.toml` and `KERNEL.toml`.
//! - [`layout`]: the layer resolver: own leaf, own `common/`, the parent class's pair when
//!   `[hardware] inherits`, `[sources] use`, and whole-file shadows declared in `[shadow]`.
//! - [`closure`]: the content hash of a source's transitive quoted-`#include` closure plus the
//!   flags, arch and compiler that turn it into a binary: the key under which a compiled module is
//!   shared between targets and cached between builds.
//! - [`scan`]: the `extern "C" __global__` entry points a source defines.
//!
//! This crate reads files but never runs a compiler and never touches a GPU.
#![forbid(unsafe_code)]

pub mod closure;
pub mod layout;
pub mod manifest;
pub mod scan;

pub use closure::{ClosureError, CompileKey, include_closure};
pub use layout::{
    LayerKind, LayoutError, ResolvedSource, ResolvedTarget, TargetId, discover_targets,
    resolve_target,
};
pub use manifest::{HardwareManifest, KernelManifest, ModelManifest};
