// SPDX-License-Identifier: MIT OR Apache-2.0
//! A grid-wide barrier on its own (grid_barrier.cu): what a persistent decode kernel would pay
//! between its phases (docs/persistent-decode.md). Measured and checked, not on the engine's path.

use metrale_core::{DevicePtr, LaunchConfig};

use crate::host::{self, HostError, HostMemory, Kernel, kernel_args};
use crate::names;

kernel_args!(
    /// `phases` phases over `blocks` blocks with a grid barrier between each two: in phase p
    /// block b adds the word block (b + 1) % blocks wrote in phase p - 1 to its checksum, then
    /// writes `p * blocks + b`.
    GridBarrier => names::grid_barrier::GRID_BARRIER_U32 {
        /// u32 `[2]`: the arrival count (zero before and after) and the generation (moved by
        /// `phases - 1`).
        sync: DevicePtr,
        /// u32 `[2, blocks]`: the words of the last two phases.
        data: DevicePtr,
        /// u32 `[blocks]`: each block's checksum (0xffffffff where a wait timed out).
        out: DevicePtr,
        /// Blocks, at most one per SM (all must be resident at once).
        blocks: u32,
        /// Phases.
        phases: u32,
    }
);

/// Threads of a barrier block: the persistent kernel's block size.
const THREADS: u32 = 256;

impl GridBarrier {
    /// Block b's checksum: the words of blocks (b + 1) % blocks over phases 0..phases - 1,
    /// wrapping.
    pub fn checksum(blocks: u32, phases: u32, b: u32) -> u32 {
        (1..phases).fold(0u32, |sum, p| {
            sum.wrapping_add((p - 1).wrapping_mul(blocks).wrapping_add((b + 1) % blocks))
        })
    }
}

impl Kernel for GridBarrier {
    fn launch_config(&self) -> LaunchConfig {
        LaunchConfig {
            grid: [self.blocks.max(1), 1, 1],
            block: [THREADS, 1, 1],
            shared_mem_bytes: 0,
        }
    }
    fn reference(&self, mem: &mut dyn HostMemory) -> Result<(), HostError> {
        let (blocks, phases) = (self.blocks, self.phases);
        if blocks == 0 {
            return Ok(());
        }
        let sync = host::load::<u32>(mem, self.sync, 2)?;
        host::store(
            mem,
            self.sync,
            &[sync[0], sync[1].wrapping_add(phases.saturating_sub(1))],
        )?;
        let mut data = host::load::<u32>(mem, self.data, 2 * blocks as usize)?;
        for p in phases.saturating_sub(2)..phases {
            for b in 0..blocks {
                data[((p % 2) * blocks + b) as usize] = p * blocks + b;
            }
        }
        host::store(mem, self.data, &data)?;
        let out: Vec<u32> = (0..blocks)
            .map(|b| Self::checksum(blocks, phases, b))
            .collect();
        host::store(mem, self.out, &out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::testing::*;

    #[test]
    fn checksums_and_state() {
        // 3 blocks, 4 phases: block 0 reads block 1's words of phases 0, 1, 2: 1, 4, 7.
        assert_eq!(GridBarrier::checksum(3, 4, 0), 1 + 4 + 7);
        // Block 2 reads block 0: 0, 3, 6.
        assert_eq!(GridBarrier::checksum(3, 4, 2), 9);
        assert_eq!(GridBarrier::checksum(3, 1, 0), 0);
        let mut m = FlatMemory::new();
        let sync = m.put(&[0u32, 5]);
        let data = m.put(&[0u32; 6]);
        let out = m.put(&[0u32; 3]);
        let k = GridBarrier {
            sync,
            data,
            out,
            blocks: 3,
            phases: 4,
        };
        k.reference(&mut m).unwrap();
        assert_eq!(m.get::<u32>(sync, 2), vec![0, 8]);
        // Phase 2 in data[0], phase 3 in data[1].
        assert_eq!(m.get::<u32>(data, 6), vec![6, 7, 8, 9, 10, 11]);
        assert_eq!(m.get::<u32>(out, 3), vec![12, 15, 9]);
        assert_eq!(k.launch_config().grid, [3, 1, 1]);
    }
}
