// SPDX-License-Identifier: MIT OR Apache-2.0
//! The scheduler's state and its request-side operations: add, finish, cancel, inspect.
//! Building a step lives in `schedule.rs`, applying its results in `complete.rs`.

use std::collections::VecDeque;

use metrale_cache::{BlockAllocator, BlockTable};

use crate::config::{ConfigError, SchedulerConfig};
use crate::plan::SchedulerStats;
use crate::request::{FinishReason, Finished, NewSequence, Rejected, SeqId};
use crate::sequence::{Phase, Sequence};

/// The serving scheduler: the queue, the running set and the KV block pool.
///
/// Lookups by id scan the running set and the queue: both are bounded by `max_num_seqs`, and a
/// scan of a few hundred entries costs less than the step it schedules.
#[derive(Debug)]
pub struct Scheduler {
    pub(crate) config: SchedulerConfig,
    pub(crate) allocator: BlockAllocator,
    /// Admitted sequences, oldest admission first: the order of priority, the most recently
    /// admitted (last) being the first preempted. `len() <= max_running`.
    pub(crate) running: Vec<Sequence>,
    /// Sequences not admitted, front first: new ones join the back, preempted ones the front.
    pub(crate) waiting: VecDeque<Sequence>,
    pub(crate) preemptions: u64,
}

impl Scheduler {
    /// An empty scheduler over a pool of `config.num_blocks` free blocks.
    pub fn new(config: SchedulerConfig) -> Result<Self, ConfigError> {
        config.validate()?;
        Ok(Scheduler {
            allocator: BlockAllocator::new(config.num_blocks),
            config,
            running: Vec::new(),
            waiting: VecDeque::new(),
            preemptions: 0,
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
        });
        Ok(())
    }

    /// Ends a sequence for a reason decided outside the scheduler (stop token or string, client
    /// gone, timeout), wherever it is: waiting, prefilling, decoding or awaiting a sample. Every
    /// block it held is free on return, and a later result for it is ignored.
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
            blocks_used: self.allocator.used_count(),
            blocks_free: self.allocator.free_count(),
            blocks_total: self.allocator.total(),
            preemptions: self.preemptions,
        }
    }

    pub(crate) fn find(&self, seq: SeqId) -> Option<&Sequence> {
        self.running
            .iter()
            .find(|s| s.id == seq)
            .or_else(|| self.waiting.iter().find(|s| s.id == seq))
    }

    /// Returns every block of `seq` to the pool.
    pub(crate) fn release(&mut self, seq: &mut Sequence) {
        // A live sequence's table holds blocks only it owns, all allocated from this pool.
        seq.table
            .release(&mut self.allocator)
            .expect("a live sequence owns its blocks");
    }

    /// Preemption by recompute: frees every block of a running sequence and puts it at the front
    /// of the queue with nothing computed. Its tokens (prompt and every emitted output) are
    /// kept, so on re-admission its prefill covers them all and the step covering its last token
    /// samples the *next* output token: nothing is lost, and nothing is emitted twice.
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
