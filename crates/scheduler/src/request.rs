// SPDX-License-Identifier: MIT OR Apache-2.0
//! What comes in (a new sequence), what goes out when it ends, and the typed refusals.

use std::fmt;
use std::time::Instant;

use thiserror::Error;

/// A sequence's id, chosen by the caller and unique among live sequences. Reusing the id of a
/// finished sequence while a step that planned it is in flight would pair that step's result
/// with the new sequence; a server numbers requests with a counter and never reuses one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SeqId(pub u64);

impl fmt::Display for SeqId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "sequence {}", self.0)
    }
}

/// A request for the scheduler: a tokenized prompt and how much to generate.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NewSequence {
    /// Unique among live sequences.
    pub id: SeqId,
    /// Prompt token ids; at least one.
    pub prompt: Vec<u32>,
    /// Most tokens to generate; at least one. Clamped so that prompt plus output fits
    /// `max_seq_len` and the KV pool ([`SchedulerConfig::max_total_len`]).
    ///
    /// [`SchedulerConfig::max_total_len`]: crate::SchedulerConfig::max_total_len
    pub max_new_tokens: usize,
    /// When the request arrived; the SLAI clock of a sequence starts here.
    pub arrival: Instant,
    /// For a chat request, the prompt tokens before the chat template's generation prompt (the
    /// assistant turn's opening): the part a later turn of the same conversation renders the
    /// same way. A hybrid model keeps its prompt's state snapshot at the last block boundary at
    /// or before it rather than before the last token (see [`Scheduler::schedule`]). `None`
    /// for a raw prompt; a value past the prompt counts as its end.
    ///
    /// [`Scheduler::schedule`]: crate::Scheduler::schedule
    pub turn_boundary: Option<usize>,
}

/// Why a sequence ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FinishReason {
    /// It generated its `max_new_tokens` (possibly clamped by `max_seq_len` or the KV pool).
    /// The only reason the scheduler decides itself.
    Length,
    /// A stop token or stop string, detected by the caller.
    Stop,
    /// The client went away.
    Cancelled,
    /// The server gave up on it (timeout, engine error).
    Aborted,
}

/// What [`Scheduler::finish`](crate::Scheduler::finish) removed: the usage numbers of the response.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Finished {
    /// The reason given.
    pub reason: FinishReason,
    /// Prompt tokens, as added (not counting tokens folded in by preemption).
    pub prompt_tokens: usize,
    /// Tokens generated and emitted.
    pub output_tokens: usize,
    /// Prompt tokens whose KV came from the prefix cache at its first admission
    /// ([`Scheduler::cached_tokens`](crate::Scheduler::cached_tokens)).
    pub cached_tokens: usize,
}

/// Why [`Scheduler::add`](crate::Scheduler::add) refused a sequence. Nothing is queued.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum Rejected {
    /// `max_num_seqs` sequences are already running or waiting (HTTP 429).
    #[error("server busy: {max_num_seqs} requests are already admitted; retry later")]
    QueueFull {
        /// The limit.
        max_num_seqs: usize,
    },
    /// No room for a single output token within `max_seq_len`.
    #[error(
        "prompt of {prompt} tokens leaves no room for output within the context of \
         {max_seq_len} tokens; shorten it to at most {} tokens", max_seq_len.saturating_sub(1)
    )]
    PromptTooLong {
        /// Prompt tokens.
        prompt: usize,
        /// The limit on prompt plus output.
        max_seq_len: usize,
    },
    /// The prompt alone needs more KV positions than the whole pool holds.
    #[error(
        "prompt of {prompt} tokens exceeds the whole KV cache ({pool_tokens} tokens); shorten \
         it or give the server more KV blocks"
    )]
    ExceedsKvPool {
        /// Prompt tokens.
        prompt: usize,
        /// KV positions in the pool.
        pool_tokens: usize,
    },
    /// The prompt has no tokens.
    #[error("empty prompt: a sequence needs at least one token")]
    EmptyPrompt,
    /// `max_new_tokens` is zero.
    #[error("max_new_tokens is 0; ask for at least one token")]
    ZeroMaxNewTokens,
    /// The id belongs to a live sequence.
    #[error("{0} is already live; ids must be unique")]
    DuplicateId(SeqId),
}

/// A [`Scheduler::complete_step`](crate::Scheduler::complete_step) result that does not match
/// the plan. Nothing was applied.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum StepError {
    /// The sequence is live but no planned item of it wanted logits (or it got two results).
    #[error("a sampled token for {0}, which is not waiting for one")]
    NotAwaitingSample(SeqId),
}
