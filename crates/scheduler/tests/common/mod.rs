// SPDX-License-Identifier: MIT OR Apache-2.0
//! The scripted engine loop the scheduler tests share: a [`Harness`] owns a scheduler, a fake
//! engine ([`engine::FakeKv`]) and a scripted clock, drives schedule / run / complete_step, and
//! checks every invariant of the output contract on every step:
//! - a plan stays within `max_step_tokens` and `max_running`, one item per live sequence;
//! - each item feeds the sequence's next unwritten tokens, at their positions, and wants logits
//!   exactly when it reaches the sequence's last token;
//! - every live sequence's table holds exactly the blocks for the positions written; a block in
//!   two tables is a registered prefix-cache block, and each block's reference count is the
//!   number of tables holding it; no step writes into a shared or registered block; used + free
//!   = total, and the pool's own bookkeeping checks out;
//! - a sequence admitted at a non-zero position (a prefix-cache hit) starts at a block boundary
//!   before its last token, and its table already holds its prefix's KV there;
//! - events come once per output index, in order, and a finished sequence's output is the one
//!   it produces when run alone;
//! - with state slots (hybrid models), the fake engine keeps each slot's recurrent state (the
//!   hash of the tokens it has seen): an item that does not start at 0 must find its slot
//!   holding exactly its prefix's state, after a restore from a snapshot for a hit; a snapshot
//!   is taken only at the sequence's snapshot boundary or, into its tail slot, at a block boundary
//!   past it, into a snapshot slot; a tail committed at a sequence's end is restored later only
//!   as the state after exactly its prefix (the fake engine checks every restored state).

#![allow(dead_code)]

pub mod engine;

use std::collections::{BTreeMap, HashSet};
use std::time::{Duration, Instant};

use metrale_scheduler::{
    BlockTable, FinishReason, NewSequence, Policy, PrefixKey, Rejected, Scheduler, SchedulerConfig,
    SeqId, StepPlan, TokenEvent,
};

use engine::{FakeKv, reference};

/// A config with ample limits; tests override the fields they exercise.
pub fn config(policy: Policy) -> SchedulerConfig {
    SchedulerConfig {
        max_num_seqs: 64,
        max_running: 8,
        max_step_tokens: 32,
        max_seq_len: 256,
        block_size: 4,
        num_blocks: 256,
        policy,
        prefix_cache: None,
        state_slots: None,
        state_snapshots: 0,
    }
}

/// The key the prefix-cache tests use.
pub fn key() -> PrefixKey {
    PrefixKey::from_bytes(b"fake model")
}

/// What the harness knows of a live sequence.
pub struct Live {
    pub prompt: Vec<u32>,
    /// `max_new_tokens` after the scheduler's documented clamp.
    pub max_new: usize,
    /// KV positions written so far (`0..written`).
    pub written: usize,
    /// Its turn boundary (`NewSequence::turn_boundary`).
    pub turn: Option<usize>,
    /// Its history's length at its last admission: where that prefill ends.
    pub prefill_end: usize,
}

/// The scripted engine loop.
pub struct Harness {
    pub sched: Scheduler,
    pub kv: FakeKv,
    pub t0: Instant,
    /// Scripted clock: time since `t0`.
    pub clock: Duration,
    /// Clock advance per step.
    pub tick: Duration,
    pub live: BTreeMap<SeqId, Live>,
    /// Every token emitted, per sequence, finished or not.
    pub outputs: BTreeMap<SeqId, Vec<u32>>,
    pub finished: BTreeMap<SeqId, FinishReason>,
    pub steps: usize,
    /// Admitted sequences, oldest admission first, as seen from the plans.
    admitted: Vec<SeqId>,
    /// Sequences planned with `wants_logits` whose result has not come back.
    pending: HashSet<SeqId>,
    /// Prompt tokens each sequence's first admission found cached, in admission order.
    pub hits: Vec<(SeqId, usize)>,
    /// The most live tables that held one block at once.
    pub most_sharers: u32,
}

impl Harness {
    pub fn new(config: SchedulerConfig) -> Self {
        Harness {
            kv: FakeKv::new(config.num_blocks, config.block_size),
            sched: Scheduler::new(config).expect("valid config"),
            t0: Instant::now(),
            clock: Duration::ZERO,
            tick: Duration::from_millis(1),
            live: BTreeMap::new(),
            outputs: BTreeMap::new(),
            finished: BTreeMap::new(),
            steps: 0,
            admitted: Vec::new(),
            pending: HashSet::new(),
            hits: Vec::new(),
            most_sharers: 0,
        }
    }

    pub fn now(&self) -> Instant {
        self.t0 + self.clock
    }

    /// Adds sequence `id` with `prompt`, arriving now.
    pub fn add(&mut self, id: u64, prompt: Vec<u32>, max_new: usize) -> Result<(), Rejected> {
        self.add_turn(id, prompt, max_new, None)
    }

    /// Adds sequence `id` with `prompt` and a turn boundary, arriving now.
    pub fn add_turn(
        &mut self,
        id: u64,
        prompt: Vec<u32>,
        max_new: usize,
        turn: Option<usize>,
    ) -> Result<(), Rejected> {
        let seq = SeqId(id);
        self.sched.add(NewSequence {
            id: seq,
            prompt: prompt.clone(),
            max_new_tokens: max_new,
            arrival: self.now(),
            turn_boundary: turn,
        })?;
        let limit = self.sched.config().max_total_len() - prompt.len();
        self.live.insert(
            seq,
            Live {
                prompt,
                max_new: max_new.min(limit),
                written: 0,
                turn,
                prefill_end: 0,
            },
        );
        self.outputs.insert(seq, Vec::new());
        self.check_state();
        Ok(())
    }

    /// Schedules at the current time and checks the plan.
    pub fn schedule(&mut self) -> StepPlan {
        let plan = self.sched.schedule(self.now());
        self.check_plan(&plan);
        plan
    }

    /// The sequence's tokens so far, prompt then output.
    pub fn history(&self, seq: SeqId) -> Vec<u32> {
        let live = &self.live[&seq];
        live.prompt
            .iter()
            .chain(&self.outputs[&seq])
            .copied()
            .collect()
    }

    /// Runs the plan on the fake engine, after checking that it writes no shared block.
    pub fn run(&mut self, plan: &StepPlan) -> Vec<(SeqId, u32)> {
        let pool = self.sched.pool();
        let mut owned: HashSet<u32> = self
            .live
            .keys()
            .flat_map(|&s| self.sched.block_table(s).unwrap().blocks.clone())
            .collect();
        owned.extend((0..pool.total() as u32).filter(|&b| pool.is_cached(b)));
        self.kv.wipe_unowned(&owned);
        let bs = self.sched.config().block_size;
        for (item, table) in plan.items.iter().zip(&plan.block_tables) {
            let end = item.start_position + item.tokens.len();
            for p in item.start_position..end {
                let b = table.blocks[p / bs];
                assert!(
                    pool.ref_count(b) == 1 && !pool.is_cached(b),
                    "{}: position {p} writes block {b}, shared ({} refs) or cached ({})",
                    item.seq,
                    pool.ref_count(b),
                    pool.is_cached(b)
                );
            }
        }
        let histories: Vec<Vec<u32>> = plan.items.iter().map(|i| self.history(i.seq)).collect();
        self.kv.run(plan, &histories)
    }

    /// Hands the results back, checks the events, advances the clock.
    pub fn complete(&mut self, results: &[(SeqId, u32)]) -> Vec<TokenEvent> {
        let events = self.sched.complete_step(results, self.now()).unwrap();
        for (seq, _) in results {
            self.pending.remove(seq);
        }
        for e in &events {
            let live = self.live.get(&e.seq).expect("event for a live sequence");
            let out = self.outputs.get_mut(&e.seq).unwrap();
            assert_eq!(
                e.output_index,
                out.len(),
                "{}: duplicate or skipped event",
                e.seq
            );
            out.push(e.token);
            if let Some(reason) = e.finish {
                assert_eq!(reason, FinishReason::Length);
                assert_eq!(out.len(), live.max_new, "{}: finished early", e.seq);
                assert_eq!(
                    *out,
                    reference(e.seq, &live.prompt, live.max_new),
                    "{}: output differs from a solo run",
                    e.seq
                );
                self.live.remove(&e.seq);
                self.admitted.retain(|s| *s != e.seq);
                self.finished.insert(e.seq, reason);
                assert!(self.sched.block_table(e.seq).is_none());
            } else {
                assert!(out.len() < live.max_new, "{}: ran past max_new", e.seq);
            }
        }
        self.steps += 1;
        self.clock += self.tick;
        self.check_state();
        events
    }

    /// One engine-loop iteration.
    pub fn step(&mut self) -> (StepPlan, Vec<TokenEvent>) {
        let plan = self.schedule();
        let results = self.run(&plan);
        let events = self.complete(&results);
        (plan, events)
    }

    /// Steps until nothing is live; panics after `max_steps` (a livelock).
    pub fn run_to_completion(&mut self, max_steps: usize) {
        let start = self.steps;
        while !self.sched.is_idle() {
            assert!(
                self.steps - start < max_steps,
                "no completion after {max_steps} steps"
            );
            self.step();
        }
        assert!(self.live.is_empty());
        let stats = self.sched.stats();
        assert_eq!(stats.blocks_free, stats.blocks_total, "blocks leaked");
        assert_eq!(stats.state_slots_used, 0, "state slots leaked");
        if let Some(snaps) = self.sched.snapshots() {
            assert_eq!(snaps.pending_count(), 0, "a snapshot slot left pending");
            assert_eq!(snaps.held_count(), 0, "a tail slot left held");
            assert_eq!(stats.state_snapshots_held, 0);
            assert_eq!(stats.state_snapshots_used, snaps.live_count());
            snaps.check().unwrap();
        }
        let pool = self.sched.pool();
        for b in 0..pool.total() as u32 {
            assert_eq!(
                pool.ref_count(b),
                0,
                "block {b} still referenced after the drain"
            );
        }
        pool.check().unwrap();
    }

    /// Cancels `id`; see [`Harness::finish`].
    pub fn cancel(&mut self, id: SeqId) {
        self.finish(id, FinishReason::Cancelled);
    }

    /// Finishes `id` from outside, checking that its blocks came back and that its output so
    /// far is a prefix of its solo run.
    pub fn finish(&mut self, id: SeqId, reason: FinishReason) {
        let live = self.live.remove(&id).expect("finish a live sequence");
        self.admitted.retain(|s| *s != id);
        self.pending.remove(&id);
        let before = self.sched.stats().blocks_used;
        let pool = self.sched.pool();
        let held = self.sched.block_table(id).unwrap().blocks.iter();
        let held = held.filter(|&&b| pool.ref_count(b) == 1).count();
        let finished = match reason {
            FinishReason::Cancelled => self.sched.cancel(id),
            _ => self.sched.finish(id, reason),
        }
        .expect("the scheduler knows it");
        assert_eq!(finished.reason, reason);
        assert_eq!(finished.prompt_tokens, live.prompt.len());
        let out = &self.outputs[&id];
        assert_eq!(finished.output_tokens, out.len());
        let first_hit = self.hits.iter().find(|(s, _)| *s == id).map_or(0, |h| h.1);
        assert_eq!(finished.cached_tokens, first_hit);
        assert_eq!(*out, reference(id, &live.prompt, out.len()));
        assert_eq!(self.sched.stats().blocks_used, before - held);
        assert!(self.sched.block_table(id).is_none());
        self.finished.insert(id, reason);
        self.check_state();
    }

    fn check_plan(&mut self, plan: &StepPlan) {
        let cfg = self.sched.config().clone();
        assert_eq!(plan.items.len(), plan.block_tables.len());
        assert!(
            plan.items.len() <= cfg.max_running,
            "batch over max_running"
        );
        assert!(plan.num_tokens() <= cfg.max_step_tokens, "step over budget");
        // Priority is admission order: with nothing in flight, the oldest running sequence is
        // never preempted, and under FIFO it advances every step.
        if let (true, Some(oldest)) = (self.pending.is_empty(), self.admitted.first()) {
            assert!(
                !plan.preempted.contains(oldest),
                "the oldest, {oldest}, was preempted"
            );
            if cfg.policy == Policy::Fifo {
                assert!(
                    plan.items.iter().any(|i| i.seq == *oldest),
                    "{oldest} stalled"
                );
            }
        }
        self.admitted.retain(|s| !plan.preempted.contains(s));
        let mut seen = HashSet::new();
        for p in &plan.preempted {
            assert!(seen.insert(*p), "{p} preempted twice");
            let live = self.live.get_mut(p).expect("preempted a live sequence");
            live.written = 0;
            assert!(self.sched.block_table(*p).unwrap().blocks.is_empty());
        }
        let mut seen = HashSet::new();
        let mut slots = HashSet::new();
        let mut snap_slots = HashSet::new();
        for (item, table) in plan.items.iter().zip(&plan.block_tables) {
            assert!(seen.insert(item.seq), "{} planned twice", item.seq);
            assert_eq!(item.state_slot, self.sched.state_slot(item.seq));
            assert_eq!(item.state_slot.is_some(), cfg.state_slots.is_some());
            if let Some(slot) = item.state_slot {
                assert!(slots.insert(slot), "{slot:?} in two items of a step");
            }
            assert!(!plan.preempted.contains(&item.seq));
            assert!(!item.tokens.is_empty());
            assert_eq!(Some(table), self.sched.block_table(item.seq));
            let live = self
                .live
                .get_mut(&item.seq)
                .expect("planned a live sequence");
            let history: Vec<u32> = live
                .prompt
                .iter()
                .chain(&self.outputs[&item.seq])
                .copied()
                .collect();
            let end = item.start_position + item.tokens.len();
            if self.admitted.contains(&item.seq) {
                assert!(
                    item.restore.is_none(),
                    "{}: a restore after admission",
                    item.seq
                );
            } else {
                // An admission: from 0, or from a block boundary the prefix cache holds.
                let start = item.start_position;
                assert_eq!(live.written, 0);
                assert_eq!(start % cfg.block_size, 0, "{}: hit mid-block", item.seq);
                assert!(
                    start < history.len(),
                    "{}: nothing left to compute",
                    item.seq
                );
                let snapshots = cfg.state_slots.is_some()
                    && cfg.prefix_cache.is_some()
                    && cfg.state_snapshots > 0;
                if cfg.prefix_cache.is_none() || (cfg.state_slots.is_some() && !snapshots) {
                    assert_eq!(start, 0, "{} admitted mid-prompt", item.seq);
                }
                if cfg.state_slots.is_some() {
                    assert_eq!(
                        item.restore.is_some(),
                        start > 0,
                        "{}: a hybrid hit restores a snapshot, and only a hit",
                        item.seq
                    );
                }
                if let Some(r) = item.restore {
                    let first = cfg.state_slots.unwrap() as u32;
                    assert!(
                        (first..first + cfg.state_snapshots as u32).contains(&r.0),
                        "{}: restore from {r:?}, not a snapshot slot",
                        item.seq
                    );
                }
                self.kv.check_prefix(item.seq, table, &history, start);
                if !self.hits.iter().any(|(s, _)| *s == item.seq) {
                    let prompt = start.min(live.prompt.len());
                    assert_eq!(self.sched.cached_tokens(item.seq), Some(prompt));
                    self.hits.push((item.seq, prompt));
                }
                live.written = start;
                live.prefill_end = history.len();
                self.admitted.push(item.seq);
            }
            if let Some(snap) = item.snapshot {
                let first = cfg.state_slots.expect("snapshots need state slots") as u32;
                assert!((first..first + cfg.state_snapshots as u32).contains(&snap.0));
                assert!(snap_slots.insert(snap), "{snap:?} written twice in a step");
                let last = live.prefill_end - 1;
                let boundary =
                    live.turn.map_or(last, |t| t.min(last)) / cfg.block_size * cfg.block_size;
                let tail = end.is_multiple_of(cfg.block_size) && end > boundary;
                assert!(
                    end == boundary || tail,
                    "{}: a snapshot at {end}, neither its boundary {boundary} nor a tail",
                    item.seq
                );
                assert!(end < history.len() || tail);
            }
            assert_eq!(
                item.start_position, live.written,
                "{}: gap or overlap",
                item.seq
            );
            assert_eq!(item.tokens[..], history[item.start_position..end]);
            assert_eq!(item.wants_logits, end == history.len());
            live.written = end;
            if item.wants_logits {
                self.pending.insert(item.seq);
            }
        }
    }

    /// State invariants between calls.
    pub fn check_state(&mut self) {
        let cfg = self.sched.config();
        let stats = self.sched.stats();
        let pool = self.sched.pool();
        let mut holders: BTreeMap<u32, u32> = BTreeMap::new();
        for (&seq, live) in &self.live {
            let table = self.sched.block_table(seq).expect("live sequence known");
            assert_eq!(
                table.blocks.len(),
                BlockTable::blocks_for(live.written, cfg.block_size),
                "{seq}: blocks reserved beyond the positions written"
            );
            for &b in &table.blocks {
                assert!((b as usize) < cfg.num_blocks);
                *holders.entry(b).or_default() += 1;
            }
        }
        for b in 0..cfg.num_blocks as u32 {
            let n = holders.get(&b).copied().unwrap_or(0);
            assert_eq!(pool.ref_count(b), n, "block {b}: reference count vs tables");
            assert!(
                n <= 1 || pool.is_cached(b),
                "block {b} is in {n} tables, not cached"
            );
            self.most_sharers = self.most_sharers.max(n);
        }
        pool.check().unwrap();
        if let Some(snaps) = self.sched.snapshots() {
            snaps.check().unwrap();
            assert_eq!(stats.state_snapshots_used, snaps.used_count());
            assert_eq!(stats.state_snapshots_total, cfg.state_snapshots);
        } else {
            assert_eq!(stats.state_snapshots_total, 0);
        }
        assert_eq!(stats.blocks_used, holders.len(), "blocks leaked");
        assert_eq!(stats.blocks_used + stats.blocks_free, stats.blocks_total);
        assert_eq!(stats.blocks_total, cfg.num_blocks);
        assert_eq!(stats.running + stats.waiting, self.live.len());
        assert!(stats.running <= cfg.max_running);
        // State slots: one per running sequence, none per waiting one, never two alike.
        let mut slots = HashSet::new();
        for &seq in self.live.keys() {
            if let Some(slot) = self.sched.state_slot(seq) {
                assert!(slots.insert(slot), "{slot:?} held by two sequences");
                assert!((slot.0 as usize) < cfg.state_slots.unwrap_or(0));
            }
        }
        match cfg.state_slots {
            Some(total) => {
                assert_eq!(
                    slots.len(),
                    stats.running,
                    "a running sequence without a slot"
                );
                assert_eq!(stats.state_slots_used, stats.running);
                assert_eq!(stats.state_slots_total, total);
                assert!(stats.running <= total);
            }
            None => assert_eq!((stats.state_slots_used, slots.len()), (0, 0)),
        }
        assert!(stats.prefilling <= stats.running);
        assert!(self.live.len() <= cfg.max_num_seqs);
        for seq in self.finished.keys() {
            assert!(
                self.sched.block_table(*seq).is_none(),
                "{seq} outlived its finish"
            );
        }
    }
}
