// SPDX-License-Identifier: MIT OR Apache-2.0
//! The scheduler's state and its request-side operations: add, finish, cancel, inspect.
//! Building a step lives in `schedule.rs`, applying its results in `complete.rs`.

use std::collections::VecDeque;

use metrale_cache::{BlockPool, BlockTable, SnapshotPool, StatePool, StateSlot};

use crate::config::{ConfigError, SchedulerConfig};
use crate::plan::SchedulerStats;
use crate::request::{FinishReason, Finished, NewSequence, Rejected, SeqId};
use crate::sequence::{Phase, Sequence};

/// A state copy a planned step makes into a snapshot slot.
#[derive(Clone, Copy, Debug)]
pub(crate) struct PendingSnapshot {
    pub(crate) seq: SeqId,
    pub(crate) admission: u64,
    pub(crate) slot: StateSlot,
    /// The sequence's computed length at the copy: the state is the one after `tokens[..boundary]`.
    pub(crate) boundary: usize,
    /// Into the sequence's tail slot (confirmed, not committed, when the step completes).
    pub(crate) tail: bool,
}

/// The serving scheduler: the queue, the running set and the KV block pool (with its prefix
/// cache).
///
/// Lookups by id scan the running set and the queue: both are bounded by `max_num_seqs`, and a
/// scan of a few hundred entries costs less than the step it schedules.
#[derive(Debug)]
pub struct Scheduler {
    pub(crate) config: SchedulerConfig,
    pub(crate) pool: BlockPool,
    /// The recurrent-state slots, for a hybrid model.
    pub(crate) states: Option<StatePool>,
    /// The recurrent-state snapshots at prefix boundaries, for a hybrid model with the prefix
    /// cache on and snapshot slots.
    pub(crate) snapshots: Option<SnapshotPool>,
    /// Snapshots the last plans take: committed by the next `complete_step` if the sequence
    /// still runs under that admission, else given back.
    pub(crate) pending_snapshots: Vec<PendingSnapshot>,
    /// Admitted sequences, oldest admission first: the order of priority, the most recently
    /// admitted (last) being the first preempted. `len() <= max_running`.
    pub(crate) running: Vec<Sequence>,
    /// Sequences not admitted, front first: new ones join the back, preempted ones the front.
    pub(crate) waiting: VecDeque<Sequence>,
    pub(crate) preemptions: u64,
    /// Positions the last plans write, `(sequence, admission, end)`: registered in the prefix
    /// cache by the next `complete_step`, once they are written.
    pub(crate) unconfirmed: Vec<(SeqId, u64, usize)>,
    /// Admissions so far (each sequence's `admission` is drawn from it).
    pub(crate) admissions: u64,
    pub(crate) prefix_queried_tokens: u64,
    pub(crate) prefix_hit_tokens: u64,
}

impl Scheduler {
    /// An empty scheduler over a pool of `config.num_blocks` free blocks.
    pub fn new(config: SchedulerConfig) -> Result<Self, ConfigError> {
        config.validate()?;
        Ok(Scheduler {
            pool: BlockPool::new(config.num_blocks, config.block_size, config.prefix_cache),
            states: config.state_slots.map(StatePool::new),
            snapshots: match (config.state_slots, config.prefix_cache) {
                (Some(slots), Some(_)) if config.state_snapshots > 0 => {
                    Some(SnapshotPool::new(slots as u32, config.state_snapshots))
                }
                _ => None,
            },
            pending_snapshots: Vec::new(),
            config,
            running: Vec::new(),
            waiting: VecDeque::new(),
            preemptions: 0,
            unconfirmed: Vec::new(),
            admissions: 0,
            prefix_queried_tokens: 0,
            prefix_hit_tokens: 0,
        })
    }

    /// The config it was built with.
    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    /// Queues a sequence at the back of the waiting queue.
    ///
    /// The request is checked before the capacity, so that a request that could never run gets
    /// its own error rather than "busy". `max_new_tokens` is clamped to
    /// [`SchedulerConfig::max_total_len`] minus the prompt.
    pub fn add(&mut self, seq: NewSequence) -> Result<(), Rejected> {
        let prompt = seq.prompt.len();
        if prompt == 0 {
            return Err(Rejected::EmptyPrompt);
        }
        if seq.max_new_tokens == 0 {
            return Err(Rejected::ZeroMaxNewTokens);
        }
        if prompt + 1 > self.config.max_seq_len {
            return Err(Rejected::PromptTooLong {
                prompt,
                max_seq_len: self.config.max_seq_len,
            });
        }
        if prompt > self.config.pool_tokens() {
            return Err(Rejected::ExceedsKvPool {
                prompt,
                pool_tokens: self.config.pool_tokens(),
            });
        }
        if self.find(seq.id).is_some() {
            return Err(Rejected::DuplicateId(seq.id));
        }
        if self.running.len() + self.waiting.len() >= self.config.max_num_seqs {
            return Err(Rejected::QueueFull {
                max_num_seqs: self.config.max_num_seqs,
            });
        }
        self.waiting.push_back(Sequence {
            id: seq.id,
            max_new_tokens: seq.max_new_tokens.min(self.config.max_total_len() - prompt),
            prompt_len: prompt,
            prefill_end: prompt,
            tokens: seq.prompt,
            num_computed: 0,
            table: BlockTable::default(),
            last_token_at: seq.arrival,
            hashes: Vec::new(),
            published: 0,
            cached_tokens: None,
            admission: 0,
            slot: None,
            turn_boundary: seq.turn_boundary,
            tail: None,
        });
        Ok(())
    }

    /// Ends a sequence for a reason decided outside the scheduler (stop token or string, client
    /// gone, timeout), wherever it is: waiting, prefilling, decoding or awaiting a sample. Every
    /// block it held is released on return (free, or cached if it holds a registered prefix),
    /// and a later result for it is ignored. Blocks a plan still in flight writes for it are
    /// not registered.
    ///
    /// Returns `None` when no live sequence has that id (it already finished, e.g. by length).
    /// The freed blocks may be handed out by the next `schedule`, so an engine that runs steps
    /// asynchronously must call this only between steps.
    pub fn finish(&mut self, seq: SeqId, reason: FinishReason) -> Option<Finished> {
        let removed = if let Some(i) = self.running.iter().position(|s| s.id == seq) {
            let mut s = self.running.remove(i);
            self.release(&mut s);
            s
        } else {
            let i = self.waiting.iter().position(|s| s.id == seq)?;
            self.waiting.remove(i)?
        };
        Some(Finished {
            reason,
            prompt_tokens: removed.prompt_len,
            output_tokens: removed.output_len(),
            cached_tokens: removed.cached_tokens.unwrap_or(0),
        })
    }

    /// [`Scheduler::finish`] with [`FinishReason::Cancelled`].
    pub fn cancel(&mut self, seq: SeqId) -> Option<Finished> {
        self.finish(seq, FinishReason::Cancelled)
    }

    /// The block table of a live sequence (empty while it waits).
    pub fn block_table(&self, seq: SeqId) -> Option<&BlockTable> {
        self.find(seq).map(|s| &s.table)
    }

    /// Prompt tokens of a live sequence whose KV came from the prefix cache at its first
    /// admission (0 before it, or with caching off): what `usage` reports as cached. A
    /// preempted sequence's later re-admission does not change it. `None` when no live sequence
    /// has that id.
    pub fn cached_tokens(&self, seq: SeqId) -> Option<usize> {
        self.find(seq).map(|s| s.cached_tokens.unwrap_or(0))
    }

    /// The recurrent-state slot of a live sequence: `Some` while it runs on a scheduler with
    /// state slots, `None` while it waits or without them. `None` also when no live sequence
    /// has that id.
    pub fn state_slot(&self, seq: SeqId) -> Option<StateSlot> {
        self.find(seq).and_then(|s| s.slot)
    }

    /// The recurrent-state snapshot pool, read-only (`None` without snapshots): for tests and
    /// diagnostics.
    pub fn snapshots(&self) -> Option<&SnapshotPool> {
        self.snapshots.as_ref()
    }

    /// Drops every committed snapshot (those a step in flight writes stay); returns how many.
    /// For tests and operators; the pool evicts by itself when full.
    pub fn clear_snapshots(&mut self) -> usize {
        self.snapshots.as_mut().map_or(0, SnapshotPool::clear)
    }

    /// The block pool, read-only: reference counts and cache state, for tests and diagnostics.
    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    /// True when no sequence is live.
    pub fn is_idle(&self) -> bool {
        self.running.is_empty() && self.waiting.is_empty()
    }

    /// Counters for `/metrics`.
    pub fn stats(&self) -> SchedulerStats {
        SchedulerStats {
            running: self.running.len(),
            prefilling: self
                .running
                .iter()
                .filter(|s| s.phase() == Phase::Prefill)
                .count(),
            waiting: self.waiting.len(),
            blocks_used: self.pool.used_count(),
            blocks_free: self.pool.free_count(),
            blocks_cached: self.pool.cached_count(),
            state_slots_used: self.states.as_ref().map_or(0, StatePool::used_count),
            state_slots_total: self.states.as_ref().map_or(0, StatePool::total),
            state_snapshots_used: self.snapshots.as_ref().map_or(0, SnapshotPool::used_count),
            state_snapshots_total: self.snapshots.as_ref().map_or(0, SnapshotPool::total),
            state_snapshots_held: self.snapshots.as_ref().map_or(0, SnapshotPool::held_count),
            state_snapshot_evictions: self.snapshots.as_ref().map_or(0, SnapshotPool::evictions),
            blocks_total: self.pool.total(),
            preemptions: self.preemptions,
            prefix_queried_tokens: self.prefix_queried_tokens,
            prefix_hit_tokens: self.prefix_hit_tokens,
            prefix_evicted_blocks: self.pool.evictions(),
        }
    }

    pub(crate) fn find(&self, seq: SeqId) -> Option<&Sequence> {
        self.running
            .iter()
            .find(|s| s.id == seq)
            .or_else(|| self.waiting.iter().find(|s| s.id == seq))
    }

    /// Drops `seq`'s reference to each of its blocks, returns its state slot, and keeps its
    /// tail: committed as the snapshot of its prefix up to the boundary it holds (the end of
    /// its generated text, rounded down to a block), unless a step in flight writes it.
    pub(crate) fn release(&mut self, seq: &mut Sequence) {
        if let Some(tail) = seq.tail.take()
            && !tail.in_flight
        {
            let snaps = self
                .snapshots
                .as_mut()
                .expect("a tail comes from the snapshot pool");
            if tail.holds > 0 {
                self.pool
                    .hash_blocks(&seq.tokens[..tail.holds], &mut seq.hashes);
                let key = seq.hashes[tail.holds / self.config.block_size - 1];
                snaps
                    .commit_held(tail.slot, key, &seq.tokens[..tail.holds])
                    .map(|_| ())
            } else {
                snaps.cancel(tail.slot)
            }
            .expect("a sequence's tail is held");
        }
        // A live sequence's table holds one reference to each of its blocks, all from this pool.
        self.pool
            .release(&mut seq.table)
            .expect("a live sequence holds its blocks");
        seq.published = 0;
        if let Some(slot) = seq.slot.take() {
            self.states
                .as_mut()
                .expect("a slot comes from the state pool")
                .release(slot)
                .expect("a running sequence holds its slot");
        }
    }

    /// Preemption by recompute: releases every block of a running sequence and puts it at the
    /// front of the queue with nothing computed. Its tokens (prompt and every emitted output)
    /// are kept, so on re-admission its prefill covers them all (less what the prefix cache
    /// still holds of them) and the step covering its last token samples the *next* output
    /// token: nothing is lost, and nothing is emitted twice.
    pub(crate) fn preempt(&mut self, mut seq: Sequence) -> SeqId {
        debug_assert_ne!(seq.phase(), Phase::AwaitingSample);
        self.release(&mut seq);
        seq.num_computed = 0;
        seq.prefill_end = seq.tokens.len();
        let id = seq.id;
        self.waiting.push_front(seq);
        self.preemptions += 1;
        id
    }
}
