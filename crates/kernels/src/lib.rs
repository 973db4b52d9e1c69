// SPDX-License-Identifier: MIT OR Apache-2.0
//! The kernels: compiled ahead of time, embedded, and each paired with its host reference.
//!
//! The central decision: **a kernel's ABI is written once, in Rust, next to its reference**. Each
//! op in [`ops`] is a typed argument struct implementing [`Kernel`]: its entry point (a
//! build-generated constant from [`names`]), its launch geometry, its argument list in C order, and
//! a Rust reference implementation. The CUDA backend launches the embedded binary with those
//! arguments; the host backend runs the reference on the same arguments; the parity check compares
//! the two. No code spells a kernel name or builds a `void*[]` by hand.
//!
//! - [`registry`]: the generated registry, one [`TargetKernels`] per embedded target;
//! - [`resolve`]: which target serves a checkpoint, chosen at start-up;
//! - [`host`]: the memory interface references run against, and the table of references.
//!
//! No I/O here: the tree was read and compiled by the build script; at run time this crate only
//! holds bytes and pure functions.
#![forbid(unsafe_code)]

pub mod host;
pub mod ops;
pub mod registry;
pub mod resolve;

pub use host::{HostError, HostKernelFn, HostMemory, Kernel, KernelAbi, host_reference};
pub use registry::{
    ALL_KERNELS, HardwareSchedule, KernelModule, TARGETS, TargetKernels, hardware, names,
};
pub use resolve::{ModelQuery, ResolveError, resolve_target};
