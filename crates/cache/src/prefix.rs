// SPDX-License-Identifier: MIT OR Apache-2.0
//! Prefix caching: full KV blocks addressed by their content and shared by reference count.
//!
//! A full block's identity is a hash chain: block `i`'s [`BlockHash`] mixes block `i - 1`'s hash
//! with the block's token ids, and block 0's parent is the [`PrefixKey`], which the caller derives
//! from everything besides the tokens that changes the KV (the model, the cache dtype, the block
//! size). Two sequences whose first `k` blocks hold the same tokens therefore have the same first
//! `k` hashes, and a lookup walks the chain from the start: the longest cached prefix is the
//! longest run of leading hashes found in the cache.
//!
//! Rules the [`BlockPool`] keeps:
//! - **Only full blocks are cached**, and only once their KV is written (the caller registers a
//!   block after the step that fills it completes). A block, once registered, is never written
//!   again: its owner only writes positions after it, and a sharer's first computed position is
//!   past it.
//! - **Sharing is by reference count.** A block is *referenced* (in at least one table), *cached*
//!   (unreferenced but registered: its KV is kept and a lookup may revive it), or *free*. Free
//!   plus cached is the reclaimable capacity ([`BlockPool::free_count`]).
//! - **Eviction is least recently used, and only on demand**: [`BlockPool::allocate`] takes
//!   free blocks first and evicts the cached block released longest ago only when none is left.
//!   A table releases its blocks last-first, so a chain's tail is evicted before its head.
//! - **A hit is checked, not trusted**: a cached entry keeps its parent's hash and its tokens,
//!   and a lookup compares both, so a hash collision costs a miss, never another prefix's KV.

use std::collections::{BTreeMap, HashMap, HashSet};

use crate::{BlockTable, CacheError};

/// The seed of every hash chain: everything besides the token ids that changes the KV a block
/// holds. Derive it with [`PrefixKey::from_bytes`] from a description of the model and the cache
/// format; two pools (or two models in one) with different keys never share a block.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PrefixKey(pub u128);

impl PrefixKey {
    /// A key from arbitrary bytes (e.g. `"<model id>|kv=bf16|block=16"`).
    pub fn from_bytes(bytes: &[u8]) -> Self {
        let words = bytes.chunks(4).map(|c| {
            let mut w = [0u8; 4];
            w[..c.len()].copy_from_slice(c);
            u32::from_le_bytes(w)
        });
        let seed = BlockHash(u128::from(bytes.len() as u64) << 64 | 0x6d65_7472_616c_6521);
        PrefixKey(seed.then(words).0)
    }

    fn root(self) -> BlockHash {
        BlockHash(self.0)
    }
}

/// The identity of a full block: its tokens and, through its parent's hash, every token before
/// them. 128 bits from two independent 64-bit lanes; not cryptographic (lookups also compare the
/// tokens, see the module comment).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockHash(pub u128);

/// splitmix64's finaliser: a bijective 64-bit mix.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl BlockHash {
    /// The hash of a block holding `tokens` whose parent hash is `self`.
    fn then(self, tokens: impl IntoIterator<Item = u32>) -> BlockHash {
        let (mut a, mut b) = (self.0 as u64, (self.0 >> 64) as u64);
        let mut n = 0u64;
        for t in tokens {
            let t = u64::from(t);
            a = mix(a ^ t.wrapping_mul(0x9e37_79b9_7f4a_7c15));
            b = mix(b.rotate_left(23) ^ t ^ 0xd6e8_feb8_6659_fd93);
            n += 1;
        }
        a = mix(a ^ n);
        b = mix(b.wrapping_add(n));
        BlockHash(u128::from(b) << 64 | u128::from(a))
    }
}

/// What a registered block remembers, to check a hit and to unregister on eviction.
#[derive(Debug)]
struct Entry {
    hash: BlockHash,
    parent: BlockHash,
    tokens: Box<[u32]>,
}

/// The KV block pool with prefix caching: a free list, reference counts, the cache of registered
/// full blocks by hash, and the LRU order of the cached ones nobody references.
///
/// With caching off (no [`PrefixKey`]) nothing is ever registered, every block's count is 0 or
/// 1, and it behaves as [`crate::BlockAllocator`].
#[derive(Debug)]
pub struct BlockPool {
    block_size: usize,
    key: Option<PrefixKey>,
    /// Tables holding each block.
    refs: Vec<u32>,
    /// Each block's cache entry while it is registered.
    entries: Vec<Option<Entry>>,
    by_hash: HashMap<BlockHash, u32>,
    /// Unreferenced, unregistered blocks.
    free: Vec<u32>,
    /// Unreferenced registered blocks by release stamp, oldest first: the eviction order.
    lru: BTreeMap<u64, u32>,
    /// Each block's key in `lru` while it is there.
    stamp: Vec<u64>,
    clock: u64,
    evictions: u64,
}

impl BlockPool {
    /// A pool of `num_blocks` free blocks of `block_size` tokens; prefix caching on when `key`
    /// is given.
    pub fn new(num_blocks: usize, block_size: usize, key: Option<PrefixKey>) -> Self {
        BlockPool {
            block_size,
            key,
            refs: vec![0; num_blocks],
            entries: (0..num_blocks).map(|_| None).collect(),
            by_hash: HashMap::new(),
            // Reversed so that blocks come out in ascending order, which keeps traces readable.
            free: (0..num_blocks as u32).rev().collect(),
            lru: BTreeMap::new(),
            stamp: vec![0; num_blocks],
            clock: 0,
            evictions: 0,
        }
    }

    /// Whether prefix caching is on.
    pub fn caching(&self) -> bool {
        self.key.is_some()
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks in the pool.
    pub fn total(&self) -> usize {
        self.refs.len()
    }

    /// Blocks that can be handed out now: free ones plus cached ones nobody references.
    pub fn free_count(&self) -> usize {
        self.free.len() + self.lru.len()
    }

    /// Blocks referenced by at least one table.
    pub fn used_count(&self) -> usize {
        self.total() - self.free_count()
    }

    /// Cached blocks nobody references (part of [`BlockPool::free_count`]).
    pub fn cached_count(&self) -> usize {
        self.lru.len()
    }

    /// Cached blocks evicted to make room, since the pool was made.
    pub fn evictions(&self) -> u64 {
        self.evictions
    }

    /// Tables holding `block`.
    pub fn ref_count(&self, block: u32) -> u32 {
        self.refs[block as usize]
    }

    /// Whether `block` is registered in the cache (its KV is final and may be shared).
    pub fn is_cached(&self, block: u32) -> bool {
        self.entries[block as usize].is_some()
    }

    /// Whether a block with chain hash `hash` is registered (its KV is cached or in use).
    pub fn is_registered(&self, hash: BlockHash) -> bool {
        self.by_hash.contains_key(&hash)
    }

    /// Extends `hashes`, the chain of `tokens`' full blocks, to cover every full block of
    /// `tokens`. Does nothing with caching off.
    pub fn hash_blocks(&self, tokens: &[u32], hashes: &mut Vec<BlockHash>) {
        let Some(key) = self.key else { return };
        let full = tokens.len() / self.block_size;
        while hashes.len() < full {
            let i = hashes.len();
            let parent = hashes.last().copied().unwrap_or(key.root());
            let block = &tokens[i * self.block_size..(i + 1) * self.block_size];
            hashes.push(parent.then(block.iter().copied()));
        }
    }

    /// The cached blocks holding the longest prefix of `hashes` (the chain of `tokens`' full
    /// blocks, from [`BlockPool::hash_blocks`]), in order. Changes nothing: take them with
    /// [`BlockPool::take`] before allocating anything, which could evict them.
    pub fn lookup(&self, hashes: &[BlockHash], tokens: &[u32]) -> Vec<u32> {
        let Some(key) = self.key else {
            return Vec::new();
        };
        let mut blocks = Vec::new();
        let mut parent = key.root();
        for (i, hash) in hashes.iter().enumerate() {
            let Some(&block) = self.by_hash.get(hash) else {
                break;
            };
            let entry = self.entries[block as usize]
                .as_ref()
                .expect("the hash map names registered blocks");
            let want = &tokens[i * self.block_size..(i + 1) * self.block_size];
            if entry.parent != parent || *entry.tokens != *want {
                break; // a collision: a miss, never another prefix's KV
            }
            blocks.push(block);
            parent = *hash;
        }
        blocks
    }

    /// Adds one reference to each of `blocks` (cached blocks from [`BlockPool::lookup`]); one
    /// nobody referenced leaves the eviction order.
    ///
    /// # Panics
    /// If a block is not registered.
    pub fn take(&mut self, blocks: &[u32]) {
        for &b in blocks {
            assert!(self.is_cached(b), "block {b} is not cached");
            if self.refs[b as usize] == 0 {
                self.lru.remove(&self.stamp[b as usize]);
            }
            self.refs[b as usize] += 1;
        }
    }

    /// Takes `n` blocks for one table, all or none: free ones first, then cached ones nobody
    /// references, least recently released first (each such eviction unregisters the block).
    pub fn allocate(&mut self, n: usize) -> Result<Vec<u32>, CacheError> {
        if n > self.free_count() {
            return Err(CacheError::OutOfBlocks {
                needed: n,
                free: self.free_count(),
                total: self.total(),
            });
        }
        let mut blocks = Vec::with_capacity(n);
        for _ in 0..n {
            let b = match self.free.pop() {
                Some(b) => b,
                None => {
                    let (_, b) = self.lru.pop_first().expect("counted above");
                    let entry = self.entries[b as usize].take().expect("cached");
                    self.by_hash.remove(&entry.hash);
                    self.evictions += 1;
                    b
                }
            };
            self.refs[b as usize] = 1;
            blocks.push(b);
        }
        Ok(blocks)
    }

    /// Grows `table` so that it holds at least `tokens` tokens.
    pub fn reserve(&mut self, table: &mut BlockTable, tokens: usize) -> Result<(), CacheError> {
        let needed =
            BlockTable::blocks_for(tokens, self.block_size).saturating_sub(table.blocks.len());
        if needed > 0 {
            table.blocks.extend(self.allocate(needed)?);
        }
        Ok(())
    }

    /// Drops `table`'s reference to each of its blocks and empties it. A block nobody references
    /// any more becomes cached if registered (its KV is kept), else free. The table's blocks are
    /// released last-first, so that a chain's tail is evicted before its head. Fails without
    /// changing anything if a block is unreferenced or listed twice.
    pub fn release(&mut self, table: &mut BlockTable) -> Result<(), CacheError> {
        let mut seen = HashSet::with_capacity(table.blocks.len());
        for &b in &table.blocks {
            if self.refs.get(b as usize).is_none_or(|&r| r == 0) || !seen.insert(b) {
                return Err(CacheError::NotAllocated(b));
            }
        }
        for &b in table.blocks.iter().rev() {
            let r = &mut self.refs[b as usize];
            *r -= 1;
            if *r > 0 {
                continue;
            }
            if self.entries[b as usize].is_some() {
                self.clock += 1;
                self.stamp[b as usize] = self.clock;
                self.lru.insert(self.clock, b);
            } else {
                self.free.push(b);
            }
        }
        table.blocks.clear();
        Ok(())
    }

    /// Registers `block`, whose KV for `tokens` (one full block) is written, as the block with
    /// chain hash `hash` after `parent` (the previous block's hash, or `None` for the first
    /// block). Returns false, changing nothing, when caching is off or another block already
    /// holds that hash (the caller keeps its copy private; it is freed, not cached, on release).
    ///
    /// # Panics
    /// If `block` is unreferenced or already registered, or `tokens` is not one block long.
    pub fn register(
        &mut self,
        block: u32,
        hash: BlockHash,
        parent: Option<BlockHash>,
        tokens: &[u32],
    ) -> bool {
        let Some(key) = self.key else { return false };
        assert!(
            self.refs[block as usize] > 0,
            "block {block} is not referenced"
        );
        assert!(
            !self.is_cached(block),
            "block {block} is already registered"
        );
        assert_eq!(tokens.len(), self.block_size, "a registered block is full");
        if self.by_hash.contains_key(&hash) {
            return false;
        }
        self.by_hash.insert(hash, block);
        self.entries[block as usize] = Some(Entry {
            hash,
            parent: parent.unwrap_or(key.root()),
            tokens: tokens.into(),
        });
        true
    }

    /// Checks the pool's bookkeeping: every block is exactly one of free, cached-unreferenced or
    /// referenced; the hash map and the entries agree; the LRU holds exactly the unreferenced
    /// registered blocks. For tests; O(blocks).
    pub fn check(&self) -> Result<(), String> {
        let mut free = vec![false; self.total()];
        for &b in &self.free {
            if std::mem::replace(&mut free[b as usize], true) {
                return Err(format!("block {b} is on the free list twice"));
            }
            if self.refs[b as usize] != 0 || self.is_cached(b) {
                return Err(format!("free block {b} is referenced or cached"));
            }
        }
        for (&stamp, &b) in &self.lru {
            if free[b as usize] || self.refs[b as usize] != 0 || !self.is_cached(b) {
                return Err(format!("LRU block {b} is free, referenced or not cached"));
            }
            if self.stamp[b as usize] != stamp {
                return Err(format!("LRU block {b} has a stale stamp"));
            }
        }
        let unreferenced = self.refs.iter().filter(|&&r| r == 0).count();
        if unreferenced != self.free.len() + self.lru.len() {
            return Err(format!(
                "{unreferenced} unreferenced blocks, {} free and {} cached",
                self.free.len(),
                self.lru.len()
            ));
        }
        for (hash, &b) in &self.by_hash {
            match &self.entries[b as usize] {
                Some(e) if e.hash == *hash => {}
                _ => return Err(format!("hash map names block {b}, whose entry differs")),
            }
        }
        let registered = self.entries.iter().filter(|e| e.is_some()).count();
        if registered != self.by_hash.len() {
            return Err(format!(
                "{registered} registered blocks, {} hashes",
                self.by_hash.len()
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BS: usize = 4;

    fn pool(n: usize) -> BlockPool {
        BlockPool::new(n, BS, Some(PrefixKey::from_bytes(b"test")))
    }

    fn hashes(p: &BlockPool, tokens: &[u32]) -> Vec<BlockHash> {
        let mut h = Vec::new();
        p.hash_blocks(tokens, &mut h);
        h
    }

    /// Allocates a table for `tokens` and registers its full blocks, as a scheduler does once
    /// the step that wrote them completes.
    fn computed(p: &mut BlockPool, tokens: &[u32]) -> BlockTable {
        let mut t = BlockTable::default();
        p.reserve(&mut t, tokens.len()).unwrap();
        let h = hashes(p, tokens);
        for (i, &hash) in h.iter().enumerate() {
            let parent = i.checked_sub(1).map(|j| h[j]);
            p.register(t.blocks[i], hash, parent, &tokens[i * BS..(i + 1) * BS]);
        }
        t
    }

    #[test]
    fn chains_depend_on_every_earlier_token_and_the_key() {
        let p = pool(1);
        let a = hashes(&p, &[1, 2, 3, 4, 5, 6, 7, 8, 9]);
        assert_eq!(a.len(), 2, "only full blocks");
        let b = hashes(&p, &[1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(a, b);
        let c = hashes(&p, &[0, 2, 3, 4, 5, 6, 7, 8]);
        assert_ne!(a[0], c[0]);
        assert_ne!(a[1], c[1], "block 1 differs through its parent");
        let other = BlockPool::new(1, BS, Some(PrefixKey::from_bytes(b"another model")));
        assert_ne!(hashes(&other, &[1, 2, 3, 4])[0], a[0]);
        let off = BlockPool::new(1, BS, None);
        assert!(hashes(&off, &[1, 2, 3, 4]).is_empty());
    }

    #[test]
    fn a_released_prefix_stays_cached_and_is_found_again() {
        let mut p = pool(8);
        let prompt: Vec<u32> = (0..10).collect();
        let mut t = computed(&mut p, &prompt);
        assert_eq!(t.blocks.len(), 3);
        p.release(&mut t).unwrap();
        assert_eq!(
            p.cached_count(),
            2,
            "two full blocks cached, the partial one freed"
        );
        assert_eq!(p.free_count(), 8);
        assert_eq!(p.used_count(), 0);
        // Same first block, different second: one block hit.
        let mut other = prompt.clone();
        other[5] = 99;
        let hit = p.lookup(&hashes(&p, &other), &other);
        assert_eq!(hit.len(), 1);
        let hit = p.lookup(&hashes(&p, &prompt), &prompt);
        assert_eq!(hit.len(), 2);
        p.take(&hit);
        assert_eq!(p.cached_count(), 0);
        assert_eq!(p.used_count(), 2);
        p.check().unwrap();
        let mut shared = BlockTable { blocks: hit };
        p.release(&mut shared).unwrap();
        p.check().unwrap();
    }

    #[test]
    fn shared_blocks_are_counted_and_freed_by_the_last_holder() {
        let mut p = pool(4);
        let prompt: Vec<u32> = (0..8).collect();
        let mut a = computed(&mut p, &prompt);
        let hit = p.lookup(&hashes(&p, &prompt), &prompt);
        p.take(&hit);
        let mut b = BlockTable { blocks: hit };
        assert_eq!(p.ref_count(a.blocks[0]), 2);
        assert_eq!(p.used_count(), 2);
        p.release(&mut a).unwrap();
        assert_eq!(p.ref_count(b.blocks[0]), 1);
        assert_eq!(p.cached_count(), 0, "still referenced by b");
        let blocks = b.blocks.clone();
        p.release(&mut b).unwrap();
        assert_eq!(p.cached_count(), 2);
        assert_eq!(
            p.release(&mut BlockTable { blocks }),
            Err(CacheError::NotAllocated(0)),
            "a double free is refused"
        );
        p.check().unwrap();
    }

    #[test]
    fn eviction_takes_free_blocks_first_then_the_oldest_tail() {
        let mut p = pool(4);
        let x: Vec<u32> = (0..8).collect();
        let mut tx = computed(&mut p, &x); // blocks 0, 1
        p.release(&mut tx).unwrap(); // released 1 then 0: 1 is the older
        let got = p.allocate(2).unwrap();
        assert_eq!(got, vec![2, 3], "free blocks before cached ones");
        assert_eq!(p.evictions(), 0);
        let got = p.allocate(1).unwrap();
        assert_eq!(got, vec![1], "the chain's tail goes first");
        assert_eq!(p.evictions(), 1);
        assert_eq!(
            p.lookup(&hashes(&p, &x), &x),
            vec![0],
            "the head still hits"
        );
        assert!(p.allocate(2).is_err(), "all or none");
        assert_eq!(p.free_count(), 1);
        p.check().unwrap();
    }

    #[test]
    fn a_duplicate_is_kept_private_and_a_collision_is_a_miss() {
        let mut p = pool(4);
        let x: Vec<u32> = (0..4).collect();
        let _a = computed(&mut p, &x);
        let mut b = BlockTable::default();
        p.reserve(&mut b, 4).unwrap();
        let h = hashes(&p, &x);
        assert!(!p.register(b.blocks[0], h[0], None, &x), "already cached");
        p.release(&mut b).unwrap();
        assert_eq!(p.cached_count(), 0, "the private copy is freed, not cached");
        // A forged hash naming the cached block but other tokens must not hit.
        let y: Vec<u32> = vec![9, 9, 9, 9];
        assert!(p.lookup(&h, &y).is_empty());
        p.check().unwrap();
    }

    #[test]
    fn caching_off_behaves_as_the_plain_allocator() {
        let mut p = BlockPool::new(3, BS, None);
        let mut t = BlockTable::default();
        p.reserve(&mut t, 9).unwrap();
        assert!(!p.register(t.blocks[0], BlockHash(1), None, &[0, 1, 2, 3]));
        p.release(&mut t).unwrap();
        assert_eq!((p.free_count(), p.cached_count()), (3, 0));
        assert!(p.lookup(&[BlockHash(1)], &[0, 1, 2, 3]).is_empty());
        p.check().unwrap();
    }
}
