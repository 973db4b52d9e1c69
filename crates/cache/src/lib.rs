// SPDX-License-Identifier: MIT OR Apache-2.0
//! Paged KV cache bookkeeping: which cache block holds which tokens of which sequence.
//!
//! The central decision: **the KV cache is a pool of fixed-size blocks, and a sequence is a list
//! of block ids** (its [`BlockTable`]), so sequences grow without reallocating and a finished
//! sequence returns its blocks in O(blocks). The device memory itself belongs to the model (one K
//! and one V buffer per layer, `[num_blocks, block_size, kv_heads, head_dim]`); this crate only
//! hands out block ids and maps token positions to cache slots (`block * block_size + offset`),
//! so it is pure CPU logic, tested without a GPU.
//!
//! Two pools: [`BlockAllocator`], a plain free list for single-sequence tools, and
//! [`BlockPool`], the serving pool with prefix caching: full blocks addressed by a hash chain
//! over their tokens, shared by reference count, kept after release and evicted least recently
//! used only when blocks run out (module [`prefix`] says the rules).
//!
//! Beside the blocks, [`StatePool`] hands out the fixed-size recurrent-state slots of a hybrid
//! model's running sequences (module [`state`]), and [`SnapshotPool`] the bounded pool of state
//! snapshots at prefix boundaries that lets a hybrid model take prefix-cache hits (module
//! [`snapshot`]).
#![forbid(unsafe_code)]

pub mod prefix;
pub mod snapshot;
pub mod state;

pub use prefix::{BlockHash, BlockPool, PrefixKey};
pub use snapshot::SnapshotPool;
pub use state::{StatePool, StateSlot};

/// Tokens per block, the engine-wide default (`HARDWARE.toml [defaults] kv_block_size`).
pub const DEFAULT_BLOCK_SIZE: usize = 16;

/// Why a block operation failed.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum CacheError {
    /// Not enough free blocks.
    #[error("KV cache out of blocks: {needed} needed, {free} free of {total}")]
    OutOfBlocks {
        /// Blocks requested.
        needed: usize,
        /// Blocks free.
        free: usize,
        /// Pool size.
        total: usize,
    },
    /// A block freed twice or never allocated.
    #[error("block {0} is not allocated")]
    NotAllocated(u32),
    /// A recurrent-state slot released twice or never handed out.
    #[error("state slot {0} is not held")]
    SlotNotHeld(u32),
}

/// A free list over `num_blocks` block ids. O(1) allocate and free.
#[derive(Debug)]
pub struct BlockAllocator {
    free: Vec<u32>,
    allocated: Vec<bool>,
}

impl BlockAllocator {
    /// A pool of `num_blocks` blocks, all free.
    pub fn new(num_blocks: usize) -> Self {
        // Reversed so that blocks come out in ascending order, which keeps traces readable.
        BlockAllocator {
            free: (0..num_blocks as u32).rev().collect(),
            allocated: vec![false; num_blocks],
        }
    }

    /// Blocks in the pool.
    pub fn total(&self) -> usize {
        self.allocated.len()
    }

    /// Blocks free now.
    pub fn free_count(&self) -> usize {
        self.free.len()
    }

    /// Blocks in use now.
    pub fn used_count(&self) -> usize {
        self.total() - self.free_count()
    }

    /// Takes `n` blocks, all or none.
    pub fn allocate(&mut self, n: usize) -> Result<Vec<u32>, CacheError> {
        if n > self.free.len() {
            return Err(CacheError::OutOfBlocks {
                needed: n,
                free: self.free.len(),
                total: self.total(),
            });
        }
        let blocks = self.free.split_off(self.free.len() - n);
        for &b in &blocks {
            self.allocated[b as usize] = true;
        }
        Ok(blocks.into_iter().rev().collect())
    }

    /// Returns blocks to the pool. Fails without changing anything if any is not allocated.
    pub fn release(&mut self, blocks: &[u32]) -> Result<(), CacheError> {
        let mut seen = std::collections::HashSet::new();
        for &b in blocks {
            if !self.allocated.get(b as usize).copied().unwrap_or(false) || !seen.insert(b) {
                return Err(CacheError::NotAllocated(b));
            }
        }
        for &b in blocks {
            self.allocated[b as usize] = false;
            self.free.push(b);
        }
        Ok(())
    }
}

/// The blocks of one sequence, in order: token at position `p` lives in `blocks[p / block_size]`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BlockTable {
    /// Block ids in position order.
    pub blocks: Vec<u32>,
}

impl BlockTable {
    /// Blocks needed to hold `tokens` tokens.
    pub fn blocks_for(tokens: usize, block_size: usize) -> usize {
        tokens.div_ceil(block_size)
    }

    /// Grows the table from `allocator` so that it holds at least `tokens` tokens.
    pub fn reserve(
        &mut self,
        tokens: usize,
        block_size: usize,
        allocator: &mut BlockAllocator,
    ) -> Result<(), CacheError> {
        let needed = Self::blocks_for(tokens, block_size).saturating_sub(self.blocks.len());
        if needed > 0 {
            self.blocks.extend(allocator.allocate(needed)?);
        }
        Ok(())
    }

    /// Returns every block to `allocator` and empties the table.
    pub fn release(&mut self, allocator: &mut BlockAllocator) -> Result<(), CacheError> {
        allocator.release(&self.blocks)?;
        self.blocks.clear();
        Ok(())
    }

    /// The cache slot of position `pos`, or `None` past the table's capacity.
    pub fn slot(&self, pos: usize, block_size: usize) -> Option<u32> {
        let block = *self.blocks.get(pos / block_size)?;
        Some(block * block_size as u32 + (pos % block_size) as u32)
    }

    /// The table as i32 ids padded with `pad` to `width` entries (the kernel's row format).
    pub fn padded_row(&self, width: usize, pad: i32) -> Vec<i32> {
        let mut row: Vec<i32> = self.blocks.iter().map(|&b| b as i32).collect();
        row.resize(width.max(row.len()), pad);
        row
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tiny deterministic generator for the property tests.
    struct Lcg(u64);
    impl Lcg {
        fn next(&mut self, n: usize) -> usize {
            self.0 = self
                .0
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((self.0 >> 33) % n as u64) as usize
        }
    }

    #[test]
    fn allocate_release_is_all_or_nothing() {
        let mut a = BlockAllocator::new(4);
        let x = a.allocate(3).unwrap();
        assert_eq!(x, vec![0, 1, 2]);
        assert_eq!(
            a.allocate(2),
            Err(CacheError::OutOfBlocks {
                needed: 2,
                free: 1,
                total: 4
            })
        );
        assert_eq!(a.free_count(), 1, "a failed allocation takes nothing");
        assert_eq!(
            a.release(&[0, 0]),
            Err(CacheError::NotAllocated(0)),
            "duplicate in one release"
        );
        assert_eq!(a.release(&[3]), Err(CacheError::NotAllocated(3)));
        assert_eq!(a.release(&[9]), Err(CacheError::NotAllocated(9)));
        assert_eq!(a.used_count(), 3, "a failed release frees nothing");
        a.release(&x).unwrap();
        assert_eq!(a.free_count(), 4);
    }

    #[test]
    fn property_random_sequences_never_share_or_leak_blocks() {
        for seed in 0..50 {
            let mut rng = Lcg(seed);
            let mut alloc = BlockAllocator::new(1 + rng.next(64));
            let mut tables: Vec<(BlockTable, usize)> = Vec::new();
            for _ in 0..500 {
                match rng.next(3) {
                    0 => tables.push((BlockTable::default(), 0)),
                    1 if !tables.is_empty() => {
                        let i = rng.next(tables.len());
                        let (table, len) = &mut tables[i];
                        let grow = *len + 1 + rng.next(40);
                        let before = alloc.free_count();
                        match table.reserve(grow, 16, &mut alloc) {
                            Ok(()) => *len = grow,
                            Err(CacheError::OutOfBlocks { .. }) => {
                                assert_eq!(alloc.free_count(), before)
                            }
                            Err(e) => panic!("{e}"),
                        }
                    }
                    _ if !tables.is_empty() => {
                        let i = rng.next(tables.len());
                        let (mut table, _) = tables.swap_remove(i);
                        table.release(&mut alloc).unwrap();
                    }
                    _ => {}
                }
                // Invariants: every block is owned by at most one table, owned + free = total,
                // and every position of a table maps to a distinct slot inside the pool.
                let mut owned: Vec<u32> = tables
                    .iter()
                    .flat_map(|(t, _)| t.blocks.iter().copied())
                    .collect();
                let n = owned.len();
                owned.sort();
                owned.dedup();
                assert_eq!(owned.len(), n, "a block is in two tables");
                assert_eq!(n + alloc.free_count(), alloc.total(), "blocks leaked");
                for (t, len) in &tables {
                    assert!(t.blocks.len() * 16 >= *len);
                    if *len > 0 {
                        let s = t.slot(len - 1, 16).unwrap();
                        assert!((s as usize) < alloc.total() * 16);
                    }
                }
            }
            for (mut t, _) in tables {
                t.release(&mut alloc).unwrap();
            }
            assert_eq!(alloc.free_count(), alloc.total());
        }
    }

    #[test]
    fn slots_follow_the_table() {
        let t = BlockTable { blocks: vec![7, 2] };
        assert_eq!(t.slot(0, 16), Some(112));
        assert_eq!(t.slot(17, 16), Some(33));
        assert_eq!(t.slot(32, 16), None);
        assert_eq!(t.padded_row(4, -1), vec![7, 2, -1, -1]);
    }
}
