// SPDX-License-Identifier: MIT OR Apache-2.0
//! Everything that moves bits on a GPU, behind one trait.
//!
//! The central decision: **model, layer, scheduler and server code hold a `&dyn GpuBackend` and
//! never know which implementation it is.** There are three:
//! - [`CudaBackend`]: the driver API through `cudarc`, loaded at run time (no toolkit at build
//!   time; a missing driver or GPU is an error, never a panic), running the embedded fatbins;
//! - [`HostBackend`]: runs each kernel's Rust reference from `metrale-kernels` on host memory, so
//!   the same model code runs with no GPU, and every CUDA kernel has something to be checked
//!   against;
//! - [`MockBackend`]: executes nothing and records every launch and copy, for tests of launch shape
//!   and order.
//!
//! [`check`] runs every kernel on two backends over random inputs and compares the results.
//! This crate holds no model knowledge and no HTTP; it is the only crate that calls the driver.

mod backend;
pub mod bench;
mod blaslt;
mod capture;
pub mod check;
mod cuda;
mod host;
mod mock;
mod pool;
pub mod probe;
pub mod trace;

pub use backend::{
    Event, GemmFp8Scales, GemmOp, GpuBackend, GpuError, Graph, KernelHandle, PinnedHostBuffer,
    Stream, launch_kernel,
};
pub use cuda::{CudaBackend, operator_switch};
pub use host::HostBackend;
pub use mock::{MockBackend, Recorded};
