// SPDX-License-Identifier: MIT OR Apache-2.0
//! A fake engine: a deterministic "model" over a fake paged KV cache, so that a wrong block
//! table, position or chunk boundary changes the tokens the scheduler gets back. A slot holds
//! what a real KV entry depends on, every token up to its position (as a hash), so a block shared
//! between sequences reads back right exactly when their tokens agree up to it.

use std::collections::{HashMap, HashSet};

use metrale_scheduler::{BlockTable, SeqId, StepPlan};

/// Token ids the fake model draws from.
pub const VOCAB: u64 = 100;

/// The fake model: the next token after `history` (every token of the sequence so far, position
/// 0 first). It hashes the whole history, so reading back one wrong slot changes it.
pub fn next_token(seq: SeqId, history: &[u32]) -> u32 {
    let mut h = 0xcbf2_9ce4_8422_2325u64 ^ seq.0.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    for &t in history {
        h ^= u64::from(t);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    ((h >> 17) % VOCAB) as u32
}

/// What a KV slot at position `history.len() - 1` holds: it depends on every token up to it.
pub fn kv_entry(history: &[u32]) -> u64 {
    let mut h = 0x2545_f491_4f6c_dd1du64;
    for &t in history {
        h = (h ^ u64::from(t))
            .wrapping_mul(0x0100_0000_01b3)
            .rotate_left(7);
    }
    h
}

/// What the sequence generates when it runs alone: `n` tokens after `prompt`.
pub fn reference(seq: SeqId, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut tokens = prompt.to_vec();
    for _ in 0..n {
        let t = next_token(seq, &tokens);
        tokens.push(t);
    }
    tokens.split_off(prompt.len())
}

/// The KV cache: one [`kv_entry`] per slot, `num_blocks * block_size` slots.
pub struct FakeKv {
    slots: Vec<Option<u64>>,
    block_size: usize,
    /// Each recurrent-state slot's content (running and snapshot slots alike): the
    /// [`kv_entry`] of every token the state has seen.
    states: HashMap<u32, u64>,
}

impl FakeKv {
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        FakeKv {
            slots: vec![None; num_blocks * block_size],
            block_size,
            states: HashMap::new(),
        }
    }

    /// Wipes every block outside `owned` (held by a table or cached), so that a position the
    /// scheduler forgot to recompute after its blocks were freed cannot be read back by luck.
    pub fn wipe_unowned(&mut self, owned: &HashSet<u32>) {
        for (slot, entry) in self.slots.iter_mut().enumerate() {
            if !owned.contains(&((slot / self.block_size) as u32)) {
                *entry = None;
            }
        }
    }

    /// Panics unless positions `0..end` of `table` hold the KV of `history`'s first `end`
    /// tokens.
    pub fn check_prefix(&self, seq: SeqId, table: &BlockTable, history: &[u32], end: usize) {
        for p in 0..end {
            let slot = table.slot(p, self.block_size).unwrap();
            assert_eq!(
                self.slots[slot as usize],
                Some(kv_entry(&history[..=p])),
                "{seq}: position {p} (slot {slot}) does not hold its prefix's KV"
            );
        }
    }

    /// Runs one step through the plan's flat form: writes every token's KV to its slot (each
    /// item's tokens are its history's, `histories[i]` for `plan.items[i]`), then reads each sampled sequence's
    /// whole history back through its block table and applies the model. Returns
    /// `(sequence, token)` per logit row, as an engine would.
    pub fn run(&mut self, plan: &StepPlan, histories: &[Vec<u32>]) -> Vec<(SeqId, u32)> {
        let flat = plan.flatten();
        assert_eq!(flat.tokens.len(), plan.num_tokens());
        assert_eq!(flat.positions.len(), flat.tokens.len());
        assert_eq!(flat.token_seq.len(), flat.tokens.len());
        // The recurrent state, as the engine moves it: every restore before the step, then each
        // item continues its slot's state (which must be its prefix's) unless it starts at 0,
        // then every snapshot after the step.
        for item in &plan.items {
            if let Some(from) = item.restore {
                let slot = item.state_slot.expect("a restore into a state slot");
                let state = self.states.get(&from.0).copied();
                match state {
                    Some(s) => self.states.insert(slot.0, s),
                    None => self.states.remove(&slot.0),
                };
            }
        }
        for (k, item) in plan.items.iter().enumerate() {
            let Some(slot) = item.state_slot else {
                assert!(item.restore.is_none() && item.snapshot.is_none());
                continue;
            };
            let start = item.start_position;
            let end = start + item.tokens.len();
            if start > 0 {
                assert_eq!(
                    self.states.get(&slot.0),
                    Some(&kv_entry(&histories[k][..start])),
                    "{}: state slot {} does not hold the state after position {}",
                    item.seq,
                    slot.0,
                    start - 1
                );
            }
            self.states.insert(slot.0, kv_entry(&histories[k][..end]));
        }
        for item in &plan.items {
            if let (Some(to), Some(slot)) = (item.snapshot, item.state_slot) {
                let state = self.states[&slot.0];
                self.states.insert(to.0, state);
            }
        }
        for ((&token, &pos), &k) in flat.tokens.iter().zip(&flat.positions).zip(&flat.token_seq) {
            let k = k as usize;
            let history = &histories[k];
            assert_eq!(history[pos as usize], token);
            let slot = plan.block_tables[k]
                .slot(pos as usize, self.block_size)
                .unwrap_or_else(|| panic!("{}: no slot for position {pos}", plan.items[k].seq));
            self.slots[slot as usize] = Some(kv_entry(&history[..=pos as usize]));
        }
        let mut results = Vec::new();
        for (&row, &seq) in flat.logit_rows.iter().zip(&flat.logit_seqs) {
            let k = flat.token_seq[row] as usize;
            assert_eq!(
                plan.items[k].seq, seq,
                "logit row {row} names the wrong sequence"
            );
            let last = flat.positions[row] as usize;
            let history = &histories[k][..=last];
            self.check_prefix(seq, &plan.block_tables[k], history, last + 1);
            results.push((seq, next_token(seq, history)));
        }
        results
    }
}

/// splitmix64: a small deterministic generator for the randomized tests.
pub struct Rng(pub u64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + (self.next_u64() % (hi - lo + 1) as u64) as usize
    }

    /// True with probability `1 / n`.
    pub fn one_in(&mut self, n: usize) -> bool {
        self.range(1, n) == 1
    }

    /// `n` token ids.
    pub fn tokens(&mut self, n: usize) -> Vec<u32> {
        (0..n)
            .map(|_| self.range(0, VOCAB as usize - 1) as u32)
            .collect()
    }
}
