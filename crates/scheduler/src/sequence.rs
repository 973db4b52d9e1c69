// SPDX-License-Identifier: MIT OR Apache-2.0
//! One live sequence's progress: its tokens, how many of them are in the KV cache, its blocks.

use std::time::Instant;

use metrale_cache::{BlockHash, BlockTable, StateSlot};

use crate::request::SeqId;

/// Where a running sequence stands; a waiting one has no blocks and nothing computed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Phase {
    /// Part of its prefill (prompt, plus the output folded in by a preemption) is not planned.
    Prefill,
    /// Prefill done; its last sampled token is the next token to feed.
    Decode,
    /// Every token is planned and a planned item wants its logits: the next token is being
    /// sampled. Not schedulable, and never a preemption victim, until its result arrives.
    AwaitingSample,
}

/// A live sequence.
///
/// Invariants: `num_computed <= tokens.len()`; the table holds at least `num_computed` positions;
/// `tokens[prompt_len..]` have each been emitted exactly once; a waiting sequence has an empty
/// table, `num_computed == 0` and `published == 0`; the table's first `published` blocks are
/// full, written, and were offered to the prefix cache (taken from it, or registered unless a
/// copy was there first); no position below `published * block_size` is ever written again;
/// with state slots, a running sequence holds exactly one and a waiting one none; a waiting one
/// holds no tail.
#[derive(Debug)]
pub(crate) struct Sequence {
    pub(crate) id: SeqId,
    /// The prompt followed by every token sampled so far.
    pub(crate) tokens: Vec<u32>,
    /// Tokens of the prompt as added.
    pub(crate) prompt_len: usize,
    /// Output tokens after which it finishes with `Length` (already clamped).
    pub(crate) max_new_tokens: usize,
    /// Positions `0..num_computed` are written to the KV cache, or planned to be.
    pub(crate) num_computed: usize,
    /// `tokens.len()` at admission: the prefill (prompt, and after a preemption the output so
    /// far too) ends there; the step covering position `prefill_end - 1` wants logits.
    pub(crate) prefill_end: usize,
    /// Blocks holding positions `0..num_computed`.
    pub(crate) table: BlockTable,
    /// When its last token was emitted (its arrival before the first): the SLAI clock.
    pub(crate) last_token_at: Instant,
    /// The prefix cache's hash chain over the full blocks of `tokens`, extended as needed
    /// (empty with caching off).
    pub(crate) hashes: Vec<BlockHash>,
    /// Leading blocks of the table that are in the prefix cache or were offered to it.
    pub(crate) published: usize,
    /// Prompt tokens found in the prefix cache at its first admission; `None` before it.
    pub(crate) cached_tokens: Option<usize>,
    /// Which admission this is (the scheduler's count at the time): a step's writes are
    /// registered only for the admission that planned them.
    pub(crate) admission: u64,
    /// Its recurrent-state slot, held from admission to release (hybrid models only).
    pub(crate) slot: Option<StateSlot>,
    /// See [`crate::NewSequence::turn_boundary`].
    pub(crate) turn_boundary: Option<usize>,
    /// Its tail snapshot slot while running, once it reached a block boundary past its
    /// prefill's snapshot boundary (hybrid models with snapshots).
    pub(crate) tail: Option<Tail>,
}

/// A running sequence's tail snapshot slot: the state at the last block boundary its computed
/// tokens reached, committed as a snapshot of that prefix when the sequence ends.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Tail {
    pub(crate) slot: StateSlot,
    /// The boundary whose state the slot holds, written by a completed step; 0 before the first.
    pub(crate) holds: usize,
    /// A planned step writes the slot and has not completed: at release the slot is left to
    /// that step's `complete_step`, which gives it back.
    pub(crate) in_flight: bool,
}

impl Sequence {
    /// Tokens generated, each emitted once.
    pub(crate) fn output_len(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    pub(crate) fn phase(&self) -> Phase {
        if self.num_computed == self.tokens.len() {
            Phase::AwaitingSample
        } else if self.num_computed < self.prefill_end {
            Phase::Prefill
        } else {
            Phase::Decode
        }
    }
}
