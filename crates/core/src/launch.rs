// SPDX-License-Identifier: MIT OR Apache-2.0
//! The typed form of a kernel launch, shared by every backend.
//!
//! A launch is a [`KernelName`], a [`LaunchConfig`] and a list of [`KernelArg`]s in the order of
//! the kernel's C signature. The CUDA backend turns the list into the `void*[]` the driver wants;
//! the host backend hands it to the kernel's Rust reference; the mock backend records it. No layer
//! code ever builds a raw pointer array.

use std::fmt;

/// An address in a backend's device memory. On the host and mock backends it is an opaque handle
/// into the backend's own allocations, not a host pointer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct DevicePtr(pub u64);

impl DevicePtr {
    /// The null address.
    pub const NULL: DevicePtr = DevicePtr(0);

    /// Whether this is [`DevicePtr::NULL`] (an optional operand left out).
    pub const fn is_null(self) -> bool {
        self.0 == 0
    }

    /// This address advanced by `bytes`.
    pub const fn offset(self, bytes: usize) -> DevicePtr {
        DevicePtr(self.0 + bytes as u64)
    }
}

impl fmt::Display for DevicePtr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#x}", self.0)
    }
}

/// One kernel argument, by value, as the kernel's C signature declares it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum KernelArg {
    /// A device pointer (`T*` / `const T*`).
    Ptr(DevicePtr),
    /// `int32_t` / `int`.
    I32(i32),
    /// `uint32_t` / `unsigned`.
    U32(u32),
    /// `uint64_t`.
    U64(u64),
    /// `float`.
    F32(f32),
}

impl KernelArg {
    /// A short name of the variant, for error messages.
    pub const fn kind(&self) -> &'static str {
        match self {
            KernelArg::Ptr(_) => "pointer",
            KernelArg::I32(_) => "i32",
            KernelArg::U32(_) => "u32",
            KernelArg::U64(_) => "u64",
            KernelArg::F32(_) => "f32",
        }
    }
}

/// Grid, block and dynamic shared memory of a launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LaunchConfig {
    /// Blocks in x, y, z.
    pub grid: [u32; 3],
    /// Threads per block in x, y, z.
    pub block: [u32; 3],
    /// Dynamic shared memory per block, in bytes.
    pub shared_mem_bytes: u32,
}

impl LaunchConfig {
    /// A one-dimensional grid of `blocks` blocks of `threads` threads, no dynamic shared memory.
    pub const fn linear(blocks: u32, threads: u32) -> Self {
        LaunchConfig {
            grid: [blocks, 1, 1],
            block: [threads, 1, 1],
            shared_mem_bytes: 0,
        }
    }
}

/// A kernel function inside a compiled module. Build-generated constants in `metrale-kernels`
/// carry these, so no code spells a kernel name by hand.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct KernelName {
    /// Module name (the source file's stem unless `KERNEL.toml` `[modules]` renames it).
    pub module: &'static str,
    /// The `extern "C"` function name.
    pub function: &'static str,
}

impl fmt::Display for KernelName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}::{}", self.module, self.function)
    }
}
