// SPDX-License-Identifier: MIT OR Apache-2.0
//! The scheduler's output contract: one step's plan, the events of its results, and the counters
//! for `/metrics`.

use metrale_cache::{BlockTable, StateSlot};

use crate::request::{FinishReason, SeqId};

/// The work of one sequence in one step: a decode token or a prefill chunk.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlanItem {
    /// The sequence.
    pub seq: SeqId,
    /// Token ids to feed, at positions `start_position..start_position + tokens.len()`. Never
    /// empty. One token (the last sampled one) for a decode; a prefill chunk otherwise.
    pub tokens: Vec<u32>,
    /// Position of `tokens[0]` within the sequence (0-based). Positions below it are already in
    /// the KV cache, written by earlier steps.
    pub start_position: usize,
    /// Whether the engine samples a token from the logits of this item's last token. True
    /// exactly when the item covers the sequence's last token: always for a decode, only on the
    /// final chunk of a prefill. Every such item needs a result in
    /// [`Scheduler::complete_step`](crate::Scheduler::complete_step).
    pub wants_logits: bool,
    /// The sequence's recurrent-state slot (hybrid models; `None` without state slots). An item
    /// at `start_position` 0 starts from a zeroed state; every later item continues the state
    /// the slot holds. No two items of a step share a slot.
    pub state_slot: Option<StateSlot>,
    /// A prefix-cache hit on a hybrid model: before the step, copy this snapshot slot into
    /// `state_slot` (the state after the first `start_position` tokens), which the item then
    /// continues. Only on an admission's first item. Every restore of a step is done before any
    /// of its snapshots ([`PlanItem::snapshot`]) are taken.
    pub restore: Option<StateSlot>,
    /// After the step, copy `state_slot` into this snapshot slot: the item ends at a block
    /// boundary whose state is kept for later requests sharing the prefix, either a prefill
    /// chunk ending at the sequence's snapshot boundary, or (its *tail*) any item ending at a
    /// block boundary past it, the copy overwriting the previous one (see
    /// [`Scheduler::schedule`](crate::Scheduler::schedule)).
    pub snapshot: Option<StateSlot>,
}

/// One step: what the engine runs next.
///
/// Invariants: at most one item per sequence; at most `max_running` items; the items' tokens sum
/// to at most `max_step_tokens`; decode items come before prefill chunks; every position an item
/// writes is covered by its block table; no block is in two tables.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StepPlan {
    /// The work, decodes first, then prefill chunks (continuing ones before new admissions).
    pub items: Vec<PlanItem>,
    /// `block_tables[i]` is the block table of `items[i].seq`, blocks already reserved for every
    /// position the step writes; a snapshot (cloned: a few KiB per sequence at long contexts),
    /// valid until the next `schedule`, `finish` or `cancel`.
    pub block_tables: Vec<BlockTable>,
    /// Sequences preempted by this call: their blocks are freed and they wait at the front of
    /// the queue, to be recomputed. Informational: nothing is lost and nothing is re-emitted.
    pub preempted: Vec<SeqId>,
}

impl StepPlan {
    /// True when there is nothing to run (idle, or every live sequence awaits a sample).
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// Tokens in the step.
    pub fn num_tokens(&self) -> usize {
        self.items.iter().map(|i| i.tokens.len()).sum()
    }

    /// The step as the flat arrays a model step consumes (`metrale_model_engine::StepInput`),
    /// with [`StepPlan::block_tables`] as its block tables.
    pub fn flatten(&self) -> FlatStep {
        let n = self.num_tokens();
        let mut flat = FlatStep {
            tokens: Vec::with_capacity(n),
            positions: Vec::with_capacity(n),
            token_seq: Vec::with_capacity(n),
            logit_rows: Vec::new(),
            logit_seqs: Vec::new(),
        };
        for (index, item) in self.items.iter().enumerate() {
            flat.tokens.extend_from_slice(&item.tokens);
            let end = item.start_position + item.tokens.len();
            flat.positions
                .extend((item.start_position..end).map(|p| p as u32));
            flat.token_seq
                .extend(std::iter::repeat_n(index as u32, item.tokens.len()));
            if item.wants_logits {
                flat.logit_rows.push(flat.tokens.len() - 1);
                flat.logit_seqs.push(item.seq);
            }
        }
        flat
    }
}

/// A [`StepPlan`] as flat per-token arrays.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FlatStep {
    /// Token ids of every item, in item order.
    pub tokens: Vec<u32>,
    /// Position of each token within its sequence.
    pub positions: Vec<u32>,
    /// Index into the plan's items (and block tables) of each token's sequence.
    pub token_seq: Vec<u32>,
    /// Token indices whose logits are wanted, ascending, one per item with `wants_logits`.
    pub logit_rows: Vec<usize>,
    /// The sequence of each logit row: pair it with the row's sampled token for
    /// [`Scheduler::complete_step`](crate::Scheduler::complete_step).
    pub logit_seqs: Vec<SeqId>,
}

/// A sampled token for the caller to stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TokenEvent {
    /// The sequence.
    pub seq: SeqId,
    /// The token id.
    pub token: u32,
    /// 0-based index of the token in the sequence's output; each index is emitted once, in
    /// order, preemption or not.
    pub output_index: usize,
    /// Set on the sequence's last event; the sequence is gone and its blocks are free.
    pub finish: Option<FinishReason>,
}

/// Counters for `/metrics`, a snapshot.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SchedulerStats {
    /// Sequences holding a running slot (prefilling or decoding); `<= max_running`.
    pub running: usize,
    /// Of `running`, those still prefilling.
    pub prefilling: usize,
    /// Sequences in the queue, never admitted or preempted.
    pub waiting: usize,
    /// KV blocks referenced by live sequences (a shared block counts once).
    pub blocks_used: usize,
    /// KV blocks that can be handed out: free ones plus cached ones nobody references;
    /// `blocks_used + blocks_free == blocks_total`.
    pub blocks_free: usize,
    /// Of `blocks_free`, the blocks holding a cached prefix (kept until evicted).
    pub blocks_cached: usize,
    /// Recurrent-state slots held by running sequences (0 without state slots).
    pub state_slots_used: usize,
    /// Recurrent-state slots in the pool (0 without state slots).
    pub state_slots_total: usize,
    /// Recurrent-state snapshot slots holding a snapshot or reserved for one (0 without).
    pub state_snapshots_used: usize,
    /// Recurrent-state snapshot slots in the pool (0 without).
    pub state_snapshots_total: usize,
    /// Of `state_snapshots_used`, the running sequences' tail slots (their latest block
    /// boundary's state, a snapshot once they end).
    pub state_snapshots_held: usize,
    /// Snapshots evicted to make room since start-up (a counter).
    pub state_snapshot_evictions: u64,
    /// KV blocks in the pool.
    pub blocks_total: usize,
    /// Preemptions since start-up (a counter).
    pub preemptions: u64,
    /// Tokens looked up in the prefix cache since start-up, every token of each admitted
    /// sequence's prefill, counted at each admission (a counter).
    pub prefix_queried_tokens: u64,
    /// Of those, tokens found cached, whose KV was not computed again (a counter).
    pub prefix_hit_tokens: u64,
    /// Cached blocks evicted to make room since start-up (a counter).
    pub prefix_evicted_blocks: u64,
}
