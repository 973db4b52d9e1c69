// SPDX-License-Identifier: MIT OR Apache-2.0
//! Recurrent-state slots: the fixed-size memory a hybrid model keeps per running sequence.
//!
//! A Gated DeltaNet or Mamba-2 layer carries, per sequence, a matrix state per head and the last
//! few inputs of its short conv, whatever the sequence's length. The model allocates
//! `slots x (bytes of every recurrent layer's state)` once at start-up; a [`StateSlot`] is an
//! index into it. The scheduler takes one slot per admitted sequence, together with its KV
//! blocks, and returns it when the sequence finishes, is cancelled or is preempted (a preempted
//! sequence recomputes, so its state is rebuilt from its tokens on re-admission). A slot's
//! contents are meaningful only while one sequence holds it: the engine zeroes a slot's state
//! when a sequence's prefill starts at position 0.

use crate::CacheError;

/// An index into the model's recurrent-state buffers, `0..StatePool::total()`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StateSlot(pub u32);

/// A free list over a fixed number of state slots. O(1) allocate and release.
///
/// Invariant: every slot is either free (in the list once) or held (marked), never both.
#[derive(Debug)]
pub struct StatePool {
    free: Vec<u32>,
    held: Vec<bool>,
}

impl StatePool {
    /// A pool of `slots` slots, all free.
    pub fn new(slots: usize) -> Self {
        // Reversed so that slots come out in ascending order.
        StatePool {
            free: (0..slots as u32).rev().collect(),
            held: vec![false; slots],
        }
    }

    /// Slots in the pool.
    pub fn total(&self) -> usize {
        self.held.len()
    }

    /// Slots free to hand out.
    pub fn free_count(&self) -> usize {
        self.free.len()
    }

    /// Slots held by sequences.
    pub fn used_count(&self) -> usize {
        self.total() - self.free_count()
    }

    /// Takes a free slot, or `None` when every slot is held.
    pub fn allocate(&mut self) -> Option<StateSlot> {
        let slot = self.free.pop()?;
        self.held[slot as usize] = true;
        Some(StateSlot(slot))
    }

    /// Returns a held slot to the pool.
    pub fn release(&mut self, slot: StateSlot) -> Result<(), CacheError> {
        match self.held.get_mut(slot.0 as usize) {
            Some(held @ true) => {
                *held = false;
                self.free.push(slot.0);
                Ok(())
            }
            _ => Err(CacheError::SlotNotHeld(slot.0)),
        }
    }

    /// Whether `slot` is held.
    pub fn is_held(&self, slot: StateSlot) -> bool {
        self.held.get(slot.0 as usize).copied().unwrap_or(false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_come_out_once_and_go_back_once() {
        let mut pool = StatePool::new(3);
        let a = pool.allocate().unwrap();
        let b = pool.allocate().unwrap();
        let c = pool.allocate().unwrap();
        assert_eq!((a, b, c), (StateSlot(0), StateSlot(1), StateSlot(2)));
        assert_eq!(pool.allocate(), None, "every slot held");
        assert_eq!(pool.used_count(), 3);
        pool.release(b).unwrap();
        assert_eq!(pool.release(b), Err(CacheError::SlotNotHeld(1)));
        assert_eq!(pool.release(StateSlot(7)), Err(CacheError::SlotNotHeld(7)));
        assert!(!pool.is_held(b) && pool.is_held(a));
        assert_eq!(pool.allocate(), Some(b));
        for s in [a, b, c] {
            pool.release(s).unwrap();
        }
        assert_eq!((pool.free_count(), pool.used_count()), (3, 0));
    }
}
