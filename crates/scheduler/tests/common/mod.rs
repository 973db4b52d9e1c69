// SPDX-License-Identifier: MIT OR Apache-2.0
//! The scripted engine loop the scheduler tests share: a [`Harness`] owns a scheduler, a fake
//! engine ([`engine::FakeKv`]) and a scripted clock, drives schedule / run / complete_step, and
//! checks every invariant of the output contract on every step:
//! - a plan stays within `max_step_tokens` and `max_running`, one item per live sequence;
//! - each item feeds the sequence's next unwritten tokens, at their positions, and wants logits
//!   exactly when it reaches the sequence's last token;
//! - every live sequence's table holds exactly the blocks for the positions written, and no
//!   block is in two tables; used + free = total;
//! - events come once per output index, in order, and a finished sequence's output is the one
//!   it produces when run alone.

#![allow(dead_code)]

pub mod engine;

use std::collections::{BTreeMap, HashSet};
use std::time::{Duration, Instant};

use metrale_scheduler::{
    BlockTable, FinishReason, NewSequence, Policy, Rejected, Scheduler, SchedulerConfig, SeqId,
    StepPlan, TokenEvent,
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
    }
}

/// What the harness knows of a live sequence.
pub struct Live {
    pub prompt: Vec<u32>,
    /// `max_new_tokens` after the scheduler's documented clamp.
    pub max_new: usize,
    /// KV positions written so far (`0..written`).
    pub written: usize,
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
        }
    }

    pub fn now(&self) -> Instant {
        self.t0 + self.clock
    }

    /// Adds sequence `id` with `prompt`, arriving now.
    pub fn add(&mut self, id: u64, prompt: Vec<u32>, max_new: usize) -> Result<(), Rejected> {
        let seq = SeqId(id);
        self.sched.add(NewSequence {
            id: seq,
            prompt: prompt.clone(),
            max_new_tokens: max_new,
            arrival: self.now(),
        })?;
        let limit = self.sched.config().max_total_len() - prompt.len();
        self.live.insert(
            seq,
            Live {
                prompt,
                max_new: max_new.min(limit),
                written: 0,
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

    /// Runs the plan on the fake engine.
    pub fn run(&mut self, plan: &StepPlan) -> Vec<(SeqId, u32)> {
        let owned: HashSet<u32> = self
            .live
            .keys()
            .flat_map(|&s| self.sched.block_table(s).unwrap().blocks.clone())
            .collect();
        self.kv.wipe_unowned(&owned);
        self.kv.run(plan)
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
        let held = self.sched.block_table(id).unwrap().blocks.len();
        let finished = match reason {
            FinishReason::Cancelled => self.sched.cancel(id),
            _ => self.sched.finish(id, reason),
        }
        .expect("the scheduler knows it");
        assert_eq!(finished.reason, reason);
        assert_eq!(finished.prompt_tokens, live.prompt.len());
        let out = &self.outputs[&id];
        assert_eq!(finished.output_tokens, out.len());
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
        for (item, table) in plan.items.iter().zip(&plan.block_tables) {
            assert!(seen.insert(item.seq), "{} planned twice", item.seq);
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
            if !self.admitted.contains(&item.seq) {
                assert_eq!(item.start_position, 0, "{} admitted mid-prompt", item.seq);
                self.admitted.push(item.seq);
            }
        }
    }

    /// State invariants between calls.
    pub fn check_state(&self) {
        let cfg = self.sched.config();
        let stats = self.sched.stats();
        let mut blocks = HashSet::new();
        for (&seq, live) in &self.live {
            let table = self.sched.block_table(seq).expect("live sequence known");
            assert_eq!(
                table.blocks.len(),
                BlockTable::blocks_for(live.written, cfg.block_size),
                "{seq}: blocks reserved beyond the positions written"
            );
            for &b in &table.blocks {
                assert!((b as usize) < cfg.num_blocks);
                assert!(blocks.insert(b), "block {b} is in two tables");
            }
        }
        assert_eq!(stats.blocks_used, blocks.len(), "blocks leaked");
        assert_eq!(stats.blocks_used + stats.blocks_free, stats.blocks_total);
        assert_eq!(stats.blocks_total, cfg.num_blocks);
        assert_eq!(stats.running + stats.waiting, self.live.len());
        assert!(stats.running <= cfg.max_running);
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
