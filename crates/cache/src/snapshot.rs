// SPDX-License-Identifier: MIT OR Apache-2.0
//! Recurrent-state snapshots: a hybrid model's state at a prefix boundary, kept so that a later
//! request sharing the prefix resumes there instead of recomputing it from position 0.
//!
//! The KV cache alone cannot serve a hybrid model's hit: its Gated DeltaNet / Mamba-2 layers
//! need the recurrent state after the prefix, which is one fixed-size state slot, not a list of
//! blocks. A [`SnapshotPool`] manages a bounded range of extra state slots (numbered after the
//! running sequences' slots, in the same device buffers) that hold copies of a sequence's state
//! taken at a full-block boundary, keyed by the prefix cache's chain hash of the block ending
//! there ([`crate::BlockHash`], which covers every token before it).
//!
//! Rules:
//! - **Reserve, then commit.** The scheduler reserves a slot when it plans the prefill chunk
//!   that ends at the boundary ([`SnapshotPool::reserve`]: the slot is *pending*); the engine
//!   copies the sequence's state into it after the step; once the step completes the slot is
//!   committed under its key ([`SnapshotPool::commit`]: *live*), or given back if the sequence
//!   ended meanwhile ([`SnapshotPool::cancel`]).
//! - **Or hold, then commit under the key known at the end.** A running sequence's *tail* slot
//!   ([`SnapshotPool::hold`]: *held*, no key yet) is overwritten with its state each time its
//!   computed length reaches a block boundary; when the sequence ends, the slot is committed
//!   under the chain hash of the last boundary it holds ([`SnapshotPool::commit_held`]), or
//!   given back. At most half the pool is held at once, so that prompts can still snapshot.
//! - **A hit is checked, not trusted**: a live snapshot keeps its prefix's tokens and
//!   [`SnapshotPool::find`] compares them, as the block cache does.
//! - **Bounded, least recently used**: a reservation takes a free slot, else evicts a live
//!   snapshot: first the oldest one whose prefix's KV is gone (the caller says which keys are
//!   stale), else the least recently used. Pending and held slots are never evicted.
//! - **Snapshots hold no KV blocks.** A snapshot is usable only while the prefix cache still
//!   holds its prefix's blocks (admission requires both), but it does not pin them: cached
//!   blocks stay free capacity, so snapshots never cause an admission to wait or a preemption.

use std::collections::{BTreeMap, HashMap};

use crate::{BlockHash, CacheError, StateSlot};

#[derive(Debug)]
enum Entry {
    Free,
    /// Reserved for the snapshot of the prefix with this key; written by a step in flight.
    Pending(BlockHash),
    /// A running sequence's tail slot: written at each of its block boundaries, keyed when the
    /// sequence ends.
    Held,
    /// Holds the state after `tokens`, whose chain hash is `key`; `stamp` orders the LRU.
    Live {
        key: BlockHash,
        tokens: Box<[u32]>,
        stamp: u64,
    },
}

/// A bounded pool of snapshot slots `first..first + total` with LRU eviction.
///
/// Invariant: every slot is exactly one of free (on the free list once), pending, held or live;
/// the key map names exactly the pending and live slots, one per key; the LRU holds exactly the
/// live slots, each under its stamp; at most `total / 2` slots are held.
#[derive(Debug)]
pub struct SnapshotPool {
    first: u32,
    entries: Vec<Entry>,
    free: Vec<u32>,
    by_key: HashMap<BlockHash, u32>,
    lru: BTreeMap<u64, u32>,
    clock: u64,
    evictions: u64,
    held: usize,
}

impl SnapshotPool {
    /// A pool of `total` snapshot slots, all free, numbered `first..first + total` (the model's
    /// state slots after the running ones).
    pub fn new(first: u32, total: usize) -> Self {
        SnapshotPool {
            first,
            entries: (0..total).map(|_| Entry::Free).collect(),
            // Reversed so that slots come out in ascending order.
            free: (0..total as u32).rev().collect(),
            by_key: HashMap::new(),
            lru: BTreeMap::new(),
            clock: 0,
            evictions: 0,
            held: 0,
        }
    }

    /// Snapshot slots in the pool.
    pub fn total(&self) -> usize {
        self.entries.len()
    }

    /// Slots holding a snapshot or reserved for one.
    pub fn used_count(&self) -> usize {
        self.total() - self.free.len()
    }

    /// Slots holding a committed snapshot.
    pub fn live_count(&self) -> usize {
        self.lru.len()
    }

    /// Slots reserved for a snapshot a step in flight writes.
    pub fn pending_count(&self) -> usize {
        self.used_count() - self.live_count() - self.held
    }

    /// Tail slots held by running sequences ([`SnapshotPool::hold`]).
    pub fn held_count(&self) -> usize {
        self.held
    }

    /// Whether [`SnapshotPool::hold`] would succeed: fewer than half the slots are held, and a
    /// slot is free or live.
    pub fn can_hold(&self) -> bool {
        self.held < self.total() / 2 && self.can_reserve()
    }

    /// Live snapshots evicted to make room, since the pool was made.
    pub fn evictions(&self) -> u64 {
        self.evictions
    }

    /// Whether a snapshot with this key is live or pending.
    pub fn has_key(&self, key: BlockHash) -> bool {
        self.by_key.contains_key(&key)
    }

    /// Whether a snapshot with this key is reserved and written by a step in flight.
    pub fn is_pending(&self, key: BlockHash) -> bool {
        self.by_key
            .get(&key)
            .is_some_and(|&i| matches!(self.entries[i as usize], Entry::Pending(_)))
    }

    /// Whether [`SnapshotPool::reserve`] would succeed: a slot is free or live.
    pub fn can_reserve(&self) -> bool {
        !self.free.is_empty() || !self.lru.is_empty()
    }

    fn index(&self, slot: StateSlot) -> Option<usize> {
        let i = slot.0.checked_sub(self.first)? as usize;
        (i < self.entries.len()).then_some(i)
    }

    /// The live snapshot of the prefix `tokens` whose chain hash is `key`, if any. Changes
    /// nothing; [`SnapshotPool::touch`] marks it used.
    pub fn find(&self, key: BlockHash, tokens: &[u32]) -> Option<StateSlot> {
        let &i = self.by_key.get(&key)?;
        match &self.entries[i as usize] {
            Entry::Live { tokens: t, .. } if **t == *tokens => Some(StateSlot(self.first + i)),
            _ => None, // pending, or a hash collision: a miss
        }
    }

    /// Marks a live snapshot most recently used (a hit that will be restored).
    ///
    /// # Panics
    /// If `slot` is not live.
    pub fn touch(&mut self, slot: StateSlot) {
        let i = self.index(slot).expect("a snapshot slot");
        let Entry::Live { stamp, .. } = &mut self.entries[i] else {
            panic!("snapshot slot {} is not live", slot.0);
        };
        self.lru.remove(stamp);
        self.clock += 1;
        *stamp = self.clock;
        self.lru.insert(self.clock, i as u32);
    }

    /// Reserves a slot for the snapshot keyed `key` (not live or pending already): a free one,
    /// else the oldest live snapshot for which `stale` holds, else the least recently used live
    /// one. `None` when every slot is pending or held.
    pub fn reserve(
        &mut self,
        key: BlockHash,
        stale: impl Fn(BlockHash) -> bool,
    ) -> Option<StateSlot> {
        assert!(!self.has_key(key), "a snapshot of this prefix exists");
        let i = self.take_slot(stale)?;
        self.entries[i as usize] = Entry::Pending(key);
        self.by_key.insert(key, i);
        Some(StateSlot(self.first + i))
    }

    /// Holds a slot as a running sequence's tail (see the module comment), taken as
    /// [`SnapshotPool::reserve`] takes one. `None` when half the slots are held already, or
    /// every slot is pending or held.
    pub fn hold(&mut self, stale: impl Fn(BlockHash) -> bool) -> Option<StateSlot> {
        if self.held >= self.total() / 2 {
            return None;
        }
        let i = self.take_slot(stale)?;
        self.entries[i as usize] = Entry::Held;
        self.held += 1;
        Some(StateSlot(self.first + i))
    }

    /// A free slot, else the oldest stale live one, else the least recently used live one
    /// (evicted).
    fn take_slot(&mut self, stale: impl Fn(BlockHash) -> bool) -> Option<u32> {
        if let Some(i) = self.free.pop() {
            return Some(i);
        }
        let victim = self
            .lru
            .iter()
            .find(|&(_, &i)| match &self.entries[i as usize] {
                Entry::Live { key, .. } => stale(*key),
                _ => false,
            })
            .or_else(|| self.lru.iter().next())
            .map(|(&stamp, &i)| (stamp, i))?;
        self.lru.remove(&victim.0);
        let Entry::Live { key, .. } = &self.entries[victim.1 as usize] else {
            unreachable!("the LRU holds live slots");
        };
        self.by_key.remove(key);
        self.entries[victim.1 as usize] = Entry::Free;
        self.evictions += 1;
        Some(victim.1)
    }

    /// Commits a held tail slot as the snapshot of the prefix `tokens`, whose chain hash is
    /// `key`: it holds the state after them. When a snapshot with that key is live or pending
    /// already, the slot is freed instead; returns whether it was committed.
    pub fn commit_held(
        &mut self,
        slot: StateSlot,
        key: BlockHash,
        tokens: &[u32],
    ) -> Result<bool, CacheError> {
        let i = self.index(slot).ok_or(CacheError::SlotNotHeld(slot.0))?;
        if !matches!(self.entries[i], Entry::Held) {
            return Err(CacheError::SlotNotHeld(slot.0));
        }
        self.held -= 1;
        if self.has_key(key) {
            self.entries[i] = Entry::Free;
            self.free.push(i as u32);
            return Ok(false);
        }
        self.entries[i] = Entry::Pending(key);
        self.by_key.insert(key, i as u32);
        self.commit(slot, tokens)?;
        Ok(true)
    }

    /// Commits a pending slot: it now holds the state after `tokens` (its key's prefix).
    pub fn commit(&mut self, slot: StateSlot, tokens: &[u32]) -> Result<(), CacheError> {
        let i = self.index(slot).ok_or(CacheError::SlotNotHeld(slot.0))?;
        let Entry::Pending(key) = self.entries[i] else {
            return Err(CacheError::SlotNotHeld(slot.0));
        };
        self.clock += 1;
        self.entries[i] = Entry::Live {
            key,
            tokens: tokens.into(),
            stamp: self.clock,
        };
        self.lru.insert(self.clock, i as u32);
        Ok(())
    }

    /// Gives a pending or held slot back (its sequence ended before the step that writes it
    /// completed, or holds no boundary worth keeping).
    pub fn cancel(&mut self, slot: StateSlot) -> Result<(), CacheError> {
        let i = self.index(slot).ok_or(CacheError::SlotNotHeld(slot.0))?;
        match self.entries[i] {
            Entry::Pending(key) => {
                self.by_key.remove(&key);
            }
            Entry::Held => self.held -= 1,
            _ => return Err(CacheError::SlotNotHeld(slot.0)),
        }
        self.entries[i] = Entry::Free;
        self.free.push(i as u32);
        Ok(())
    }

    /// Drops every live snapshot (pending and held ones stay); returns how many.
    pub fn clear(&mut self) -> usize {
        let live: Vec<u32> = std::mem::take(&mut self.lru).into_values().collect();
        for &i in &live {
            if let Entry::Live { key, .. } = &self.entries[i as usize] {
                self.by_key.remove(key);
            }
            self.entries[i as usize] = Entry::Free;
            self.free.push(i);
        }
        live.len()
    }

    /// Checks the bookkeeping (the invariant above). For tests; O(slots).
    pub fn check(&self) -> Result<(), String> {
        let mut on_free = vec![false; self.total()];
        for &i in &self.free {
            if std::mem::replace(&mut on_free[i as usize], true) {
                return Err(format!("snapshot slot {i} is free twice"));
            }
        }
        let mut keyed = 0;
        let mut held = 0;
        for (i, e) in self.entries.iter().enumerate() {
            let key = match e {
                Entry::Free if on_free[i] => continue,
                Entry::Free => return Err(format!("snapshot slot {i} is free but not listed")),
                _ if on_free[i] => return Err(format!("snapshot slot {i} is listed but used")),
                Entry::Held => {
                    held += 1;
                    continue;
                }
                Entry::Pending(key) => key,
                Entry::Live { key, stamp, .. } => {
                    if self.lru.get(stamp) != Some(&(i as u32)) {
                        return Err(format!("live snapshot slot {i} is not in the LRU"));
                    }
                    key
                }
            };
            if self.by_key.get(key) != Some(&(i as u32)) {
                return Err(format!("snapshot slot {i}'s key names another slot"));
            }
            keyed += 1;
        }
        if held != self.held || held > self.total() / 2 {
            return Err(format!(
                "{held} held slots, counted {} of {}",
                self.held,
                self.total()
            ));
        }
        if keyed != self.by_key.len() {
            return Err(format!("{keyed} keyed slots, {} keys", self.by_key.len()));
        }
        let live = self
            .entries
            .iter()
            .filter(|e| matches!(e, Entry::Live { .. }))
            .count();
        if live != self.lru.len() {
            return Err(format!("{live} live slots, {} in the LRU", self.lru.len()));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const K1: BlockHash = BlockHash(1);
    const K2: BlockHash = BlockHash(2);
    const K3: BlockHash = BlockHash(3);

    #[test]
    fn reserve_commit_find_and_cancel() {
        let mut p = SnapshotPool::new(4, 2);
        let a = p.reserve(K1, |_| false).unwrap();
        assert_eq!(a, StateSlot(4), "numbered after the running slots");
        assert!(p.has_key(K1) && p.is_pending(K1));
        assert_eq!(p.find(K1, &[1, 2]), None, "pending is not a hit");
        p.commit(a, &[1, 2]).unwrap();
        assert_eq!(p.find(K1, &[1, 2]), Some(a));
        assert_eq!(p.find(K1, &[1, 3]), None, "a collision is a miss");
        assert_eq!(p.commit(a, &[1, 2]), Err(CacheError::SlotNotHeld(4)));
        let b = p.reserve(K2, |_| false).unwrap();
        assert_eq!(
            (p.used_count(), p.live_count(), p.pending_count()),
            (2, 1, 1)
        );
        p.cancel(b).unwrap();
        assert_eq!(p.cancel(b), Err(CacheError::SlotNotHeld(5)));
        assert_eq!(p.cancel(StateSlot(0)), Err(CacheError::SlotNotHeld(0)));
        assert!(!p.has_key(K2));
        p.check().unwrap();
        assert_eq!(p.clear(), 1);
        assert_eq!(p.used_count(), 0);
        p.check().unwrap();
    }

    #[test]
    fn eviction_takes_stale_then_least_recently_used_never_pending() {
        let mut p = SnapshotPool::new(0, 2);
        let a = p.reserve(K1, |_| false).unwrap();
        p.commit(a, &[1]).unwrap();
        let b = p.reserve(K2, |_| false).unwrap();
        p.commit(b, &[2]).unwrap();
        p.touch(a); // b is now the least recently used
        let c = p.reserve(K3, |_| false).unwrap();
        assert_eq!(c, b);
        assert_eq!(p.evictions(), 1);
        assert_eq!(p.find(K2, &[2]), None);
        assert!(
            p.reserve(K2, |_| false).is_some(),
            "evicts a, the only live one"
        );
        assert!(!p.can_reserve(), "both pending");
        assert_eq!(p.reserve(BlockHash(9), |_| false), None);
        p.check().unwrap();
        let mut q = SnapshotPool::new(0, 2);
        for (k, t) in [(K1, 1), (K2, 2)] {
            let s = q.reserve(k, |_| false).unwrap();
            q.commit(s, &[t]).unwrap();
        }
        // K1 is the least recently used, but K2's prefix is gone from the block cache.
        let s = q.reserve(K3, |k| k == K2).unwrap();
        assert_eq!(s, StateSlot(1));
        assert!(q.find(K1, &[1]).is_some());
        q.check().unwrap();
    }

    #[test]
    fn a_held_tail_is_keyed_at_the_end_never_evicted_and_capped_at_half() {
        let mut p = SnapshotPool::new(0, 4);
        let a = p.reserve(K1, |_| false).unwrap();
        p.commit(a, &[1]).unwrap();
        let t = p.hold(|_| false).unwrap();
        assert_eq!(p.held_count(), 1);
        assert_eq!(
            (p.used_count(), p.live_count(), p.pending_count()),
            (2, 1, 0)
        );
        let u = p.hold(|_| false).unwrap();
        assert!(
            !p.can_hold() && p.hold(|_| false).is_none(),
            "half the pool held"
        );
        assert!(p.can_reserve(), "prompts still get slots");
        p.check().unwrap();
        // The two free slots go to snapshots, then the live ones are evicted; held ones never.
        let b = p.reserve(K2, |_| false).unwrap();
        p.commit(b, &[2]).unwrap();
        let c = p.reserve(K3, |_| false).unwrap();
        assert_eq!(c, a, "the least recently used live slot");
        assert_eq!(p.evictions(), 1);
        assert!(p.reserve(BlockHash(7), |_| false).is_some());
        assert_eq!(
            p.reserve(BlockHash(8), |_| false),
            None,
            "pending and held only"
        );
        // Keyed at the end: a new key commits, one already present frees the slot.
        assert_eq!(p.commit_held(t, BlockHash(5), &[5, 5]), Ok(true));
        assert_eq!(p.find(BlockHash(5), &[5, 5]), Some(t));
        assert_eq!(p.commit_held(u, K3, &[3]), Ok(false), "K3 is pending");
        assert_eq!(
            p.commit_held(u, K3, &[3]),
            Err(CacheError::SlotNotHeld(u.0))
        );
        assert_eq!(p.held_count(), 0);
        let v = p.hold(|_| false).unwrap();
        assert_eq!(v, u, "the freed slot");
        p.cancel(v).unwrap();
        assert_eq!(p.cancel(v), Err(CacheError::SlotNotHeld(v.0)));
        p.check().unwrap();
        let q = SnapshotPool::new(0, 1);
        assert!(!q.can_hold(), "one slot: no tails");
    }
}
