// SPDX-License-Identifier: MIT OR Apache-2.0
//! The scheduler's limits and policy, checked once at start-up.

use metrale_cache::PrefixKey;
use thiserror::Error;

/// How the scheduler orders work when it has a choice.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Policy {
    /// First come, first served: waiting sequences are admitted in queue order.
    Fifo,
    /// Service-level-aware interleaving (the book): new prefills are skipped while any decoding
    /// sequence has waited 80% of `tbt_deadline_ms` since its last token, and the queue is
    /// prefilled front first, then shortest prompts.
    Slai {
        /// Time-between-tokens deadline, milliseconds (`--tbt-deadline-ms`). Must be > 0.
        tbt_deadline_ms: u64,
    },
}

/// Limits of the scheduler and the KV pool it hands out.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SchedulerConfig {
    /// Requests admitted at once, running plus waiting; beyond it [`Scheduler::add`] returns
    /// [`Rejected::QueueFull`] (the server answers 429).
    ///
    /// [`Scheduler::add`]: crate::Scheduler::add
    /// [`Rejected::QueueFull`]: crate::Rejected::QueueFull
    pub max_num_seqs: usize,
    /// Sequences holding a running slot, prefilling or decoding (`--max-batch-size`); so also
    /// the most items in one step and the most decode tokens in one step.
    pub max_running: usize,
    /// Tokens per step (`--max-prefill-tokens`): decode tokens count 1 each, prefill chunks fill
    /// the rest. Must be `>= max_running` so that every running sequence can always decode.
    pub max_step_tokens: usize,
    /// Longest sequence, prompt plus output, in tokens (the model's context).
    pub max_seq_len: usize,
    /// Tokens per KV block.
    pub block_size: usize,
    /// KV blocks in the pool.
    pub num_blocks: usize,
    /// Ordering policy.
    pub policy: Policy,
    /// Prefix caching: `Some(key)` shares full KV blocks between sequences whose tokens agree
    /// up to them, `key` standing for everything else that changes the KV (model, cache dtype);
    /// `None` turns it off (`met serve --no-prefix-cache`). See [`Scheduler::schedule`].
    ///
    /// [`Scheduler::schedule`]: crate::Scheduler::schedule
    pub prefix_cache: Option<PrefixKey>,
    /// Recurrent-state slots, for a hybrid model (Gated DeltaNet, Mamba-2 layers): each admitted
    /// sequence holds one from admission to its end or preemption, so at most this many run at
    /// once and admission waits for a free one. `None` for a model without recurrent layers.
    /// With slots, a prefix-cache hit needs a snapshot of the recurrent state at its end too
    /// (`state_snapshots`); without one, the prefill starts at position 0.
    pub state_slots: Option<usize>,
    /// Recurrent-state snapshot slots (hybrid models with the prefix cache on): the model's
    /// state slots `state_slots..state_slots + state_snapshots` hold copies of a sequence's
    /// state at a prefix boundary, so that a later request sharing the prefix resumes there
    /// (see [`Scheduler::schedule`]). 0 turns snapshots off; ignored without `state_slots` or
    /// `prefix_cache`.
    ///
    /// [`Scheduler::schedule`]: crate::Scheduler::schedule
    pub state_snapshots: usize,
}

/// A [`SchedulerConfig`] the scheduler cannot run with.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum ConfigError {
    /// A limit that must be positive is zero.
    #[error("scheduler config: `{field}` is 0; it must be at least 1")]
    Zero {
        /// The field's name.
        field: &'static str,
    },
    /// The step budget cannot hold one decode token per running sequence.
    #[error(
        "scheduler config: max_step_tokens ({max_step_tokens}) is below max_running \
         ({max_running}); raise --max-prefill-tokens to at least --max-batch-size"
    )]
    BudgetBelowBatch {
        /// Tokens per step.
        max_step_tokens: usize,
        /// Running sequences.
        max_running: usize,
    },
}

impl SchedulerConfig {
    /// Checks the limits; [`Scheduler::new`](crate::Scheduler::new) calls it.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let positive = [
            ("max_num_seqs", self.max_num_seqs),
            ("max_running", self.max_running),
            ("max_step_tokens", self.max_step_tokens),
            ("max_seq_len", self.max_seq_len),
            ("block_size", self.block_size),
            ("num_blocks", self.num_blocks),
        ];
        if let Some(&(field, _)) = positive.iter().find(|(_, v)| *v == 0) {
            return Err(ConfigError::Zero { field });
        }
        if self.state_slots == Some(0) {
            return Err(ConfigError::Zero {
                field: "state_slots",
            });
        }
        if let Policy::Slai { tbt_deadline_ms: 0 } = self.policy {
            return Err(ConfigError::Zero {
                field: "tbt_deadline_ms",
            });
        }
        if self.max_step_tokens < self.max_running {
            return Err(ConfigError::BudgetBelowBatch {
                max_step_tokens: self.max_step_tokens,
                max_running: self.max_running,
            });
        }
        Ok(())
    }

    /// KV positions the whole pool holds.
    pub fn pool_tokens(&self) -> usize {
        self.num_blocks * self.block_size
    }

    /// Longest sequence, prompt plus output, that this config can serve: `max_seq_len`, or the
    /// pool plus one when the pool is smaller (a sequence of `L` tokens writes `L - 1` KV
    /// positions: its last sampled token is never fed back).
    pub fn max_total_len(&self) -> usize {
        self.max_seq_len.min(self.pool_tokens() + 1)
    }
}
