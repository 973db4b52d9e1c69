// SPDX-License-Identifier: MIT OR Apache-2.0
//! Device memory simulated on the host, for the host and mock backends.
//!
//! Addresses are opaque handles from a bump counter (never host pointers, so no `unsafe`), each
//! allocation its own buffer. Every access is bounds-checked against one live allocation: a kernel
//! reference that reads past its buffer fails loudly instead of reading a neighbour.

use std::collections::BTreeMap;

use metrale_core::DevicePtr;
use metrale_kernels::{HostError, HostMemory};

use crate::GpuError;

/// First address handed out; far from zero so that null and small offsets are never valid.
const BASE: u64 = 0x1000_0000;
/// Allocation alignment, as the CUDA driver guarantees.
const ALIGN: u64 = 256;

/// The allocations of one host-memory backend.
#[derive(Debug)]
pub struct HostPool {
    allocations: BTreeMap<u64, Vec<u8>>,
    next: u64,
    capacity: u64,
    in_use: u64,
}

impl HostPool {
    /// A pool that refuses to hold more than `capacity` bytes at once.
    pub fn new(capacity: u64) -> Self {
        HostPool {
            allocations: BTreeMap::new(),
            next: BASE,
            capacity,
            in_use: 0,
        }
    }

    pub fn alloc(&mut self, bytes: usize) -> Result<DevicePtr, GpuError> {
        if self.in_use + bytes as u64 > self.capacity {
            return Err(GpuError::OutOfMemory {
                bytes,
                detail: format!("host pool holds {} of {} bytes", self.in_use, self.capacity),
            });
        }
        let base = self.next;
        // Leave a gap after every allocation so an off-by-one access hits no allocation at all.
        self.next += (bytes as u64).max(1).next_multiple_of(ALIGN) + ALIGN;
        self.allocations.insert(base, vec![0u8; bytes]);
        self.in_use += bytes as u64;
        Ok(DevicePtr(base))
    }

    pub fn free(&mut self, ptr: DevicePtr) -> Result<(), GpuError> {
        let freed = self.allocations.remove(&ptr.0).ok_or_else(|| {
            GpuError::Memory(format!(
                "free of {ptr}, which is not the start of a live allocation"
            ))
        })?;
        self.in_use -= freed.len() as u64;
        Ok(())
    }

    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    pub fn in_use(&self) -> u64 {
        self.in_use
    }

    fn locate(&self, ptr: DevicePtr, len: usize) -> Option<(u64, usize)> {
        let (&base, buf) = self.allocations.range(..=ptr.0).next_back()?;
        let start = (ptr.0 - base) as usize;
        (start.checked_add(len)? <= buf.len()).then_some((base, start))
    }
}

impl HostMemory for HostPool {
    fn bytes(&self, ptr: DevicePtr, len: usize) -> Result<&[u8], HostError> {
        let (base, start) = self
            .locate(ptr, len)
            .ok_or(HostError::OutOfBounds { ptr, len })?;
        Ok(&self.allocations[&base][start..start + len])
    }

    fn bytes_mut(&mut self, ptr: DevicePtr, len: usize) -> Result<&mut [u8], HostError> {
        let (base, start) = self
            .locate(ptr, len)
            .ok_or(HostError::OutOfBounds { ptr, len })?;
        Ok(&mut self.allocations.get_mut(&base).expect("located")[start..start + len])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounds_are_per_allocation() {
        let mut pool = HostPool::new(1 << 20);
        let a = pool.alloc(10).unwrap();
        let b = pool.alloc(300).unwrap();
        assert_eq!(a.0 % ALIGN, 0);
        assert_eq!(b.0 % ALIGN, 0);
        pool.bytes_mut(a, 10).unwrap().copy_from_slice(&[7; 10]);
        assert_eq!(pool.bytes(a.offset(9), 1).unwrap(), &[7]);
        assert!(
            pool.bytes(a.offset(5), 6).is_err(),
            "runs past the end of a"
        );
        assert!(pool.bytes(a.offset(10), 1).is_err(), "the gap after a");
        assert!(pool.bytes(DevicePtr(0), 1).is_err());
        pool.free(a).unwrap();
        assert!(pool.bytes(a, 1).is_err(), "use after free");
        assert!(pool.free(a).is_err(), "double free");
        assert!(
            pool.free(b.offset(8)).is_err(),
            "free of an interior pointer"
        );
        assert_eq!(pool.in_use(), 300);
        assert!(matches!(
            pool.alloc(1 << 20),
            Err(GpuError::OutOfMemory { .. })
        ));
    }
}
