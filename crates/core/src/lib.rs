// SPDX-License-Identifier: MIT OR Apache-2.0
//! The vocabulary every metrale crate shares.
//!
//! This crate owns the small types that cross crate boundaries: element types ([`DType`]), the
//! runtime dispatch key of a compiled kernel set ([`KernelTarget`]), SM architectures and the arch
//! preflight ([`SmArch`]), and the typed form of a kernel launch ([`KernelArg`], [`LaunchConfig`],
//! [`KernelName`]), and the FP8 E4M3 codec ([`fp8`]) the weight quantizer and the host references
//! share.
//!
//! It must never allocate GPU memory, parse a model config, or do I/O: it is the bottom of the
//! dependency graph and every other crate builds on it.
#![forbid(unsafe_code)]

pub mod arch;
pub mod dtype;
pub mod fp8;
pub mod kv;
pub mod launch;
pub mod target;

pub use arch::{ArchError, Preflight, SmArch};
pub use dtype::DType;
pub use kv::{KvCacheDtype, UnknownKvCacheDtype};
pub use launch::{DevicePtr, KernelArg, KernelName, LaunchConfig};
pub use target::{KernelTarget, Vendor};
