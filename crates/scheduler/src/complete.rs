// SPDX-License-Identifier: MIT OR Apache-2.0
//! Applying a step's sampled tokens: record them, finish by length, return the events to stream.

use std::collections::HashSet;
use std::time::Instant;

use crate::plan::TokenEvent;
use crate::request::{FinishReason, SeqId, StepError};
use crate::scheduler::Scheduler;
use crate::sequence::Phase;

impl Scheduler {
    /// Records the tokens sampled for a plan's items that wanted logits, one `(sequence, token)`
    /// per such item, at time `now`, and returns one event per token, in `results` order.
    ///
    /// A sequence that reaches its `max_new_tokens` (already clamped to `max_seq_len` and the KV
    /// pool) finishes with [`FinishReason::Length`] on that event; it is removed and its blocks
    /// are free on return. A result for a sequence that is no longer live (finished or
    /// cancelled since the plan) is ignored. A result for a live sequence that is not awaiting a
    /// sample, or a second result for one, is an error and nothing is applied.
    ///
    /// Tokens are only ever appended at the end of a sequence, so each output index is emitted
    /// once: a preempted sequence recomputes its emitted tokens as input and resumes sampling
    /// after them.
    ///
    /// Call it once after every plan that had items, in order, when the step has run (with no
    /// results when no item wanted logits): it also completes the plan for the prefix cache,
    /// registering every block the step filled, before a sequence that finishes here releases
    /// its blocks. A plan that never completes (the step failed) registers nothing.
    pub fn complete_step(
        &mut self,
        results: &[(SeqId, u32)],
        now: Instant,
    ) -> Result<Vec<TokenEvent>, StepError> {
        let mut seen = HashSet::with_capacity(results.len());
        for &(seq, _) in results {
            let awaiting = match self.find(seq) {
                None => true, // gone: ignored below
                Some(s) => s.phase() == Phase::AwaitingSample,
            };
            if !awaiting || !seen.insert(seq) {
                return Err(StepError::NotAwaitingSample(seq));
            }
        }
        self.register_written_blocks();
        self.commit_snapshots();
        let mut events = Vec::with_capacity(results.len());
        for &(seq, token) in results {
            let Some(i) = self.running.iter().position(|s| s.id == seq) else {
                continue;
            };
            let s = &mut self.running[i];
            s.tokens.push(token);
            s.last_token_at = now;
            let output_index = s.output_len() - 1;
            let finish = (s.output_len() >= s.max_new_tokens).then_some(FinishReason::Length);
            if finish.is_some() {
                let mut s = self.running.remove(i);
                self.release(&mut s);
            }
            events.push(TokenEvent {
                seq,
                token,
                output_index,
                finish,
            });
        }
        Ok(events)
    }

    /// Commits the snapshots the completed plans took, and confirms the boundary each tail slot
    /// now holds, for sequences still running under the admission that planned them; gives the
    /// others' slots back.
    fn commit_snapshots(&mut self) {
        let pending = std::mem::take(&mut self.pending_snapshots);
        let Some(snaps) = self.snapshots.as_mut() else {
            return;
        };
        for p in pending {
            let live = self
                .running
                .iter_mut()
                .find(|s| s.id == p.seq && s.admission == p.admission);
            match live {
                Some(s) if p.tail => {
                    let tail = s.tail.as_mut().expect("a running sequence keeps its tail");
                    debug_assert_eq!(tail.slot, p.slot);
                    tail.holds = p.boundary;
                    tail.in_flight = false;
                    Ok(())
                }
                Some(s) => snaps.commit(p.slot, &s.tokens[..p.boundary]),
                // Ended (or preempted) while the step was in flight: its release left the slot.
                None => snaps.cancel(p.slot),
            }
            .expect("a planned snapshot's slot is pending or held");
        }
    }

    /// Registers in the prefix cache the full blocks the completed plans wrote, for sequences
    /// still running under the admission that planned them (one cancelled or preempted since
    /// has released its blocks, and its writes may not have happened).
    fn register_written_blocks(&mut self) {
        let writes = std::mem::take(&mut self.unconfirmed);
        if !self.pool.caching() {
            return;
        }
        let block_size = self.config.block_size;
        for (seq, admission, end) in writes {
            let Some(s) = self
                .running
                .iter_mut()
                .find(|s| s.id == seq && s.admission == admission)
            else {
                continue;
            };
            let full = end / block_size;
            self.pool
                .hash_blocks(&s.tokens[..full * block_size], &mut s.hashes);
            while s.published < full {
                let i = s.published;
                let parent = i.checked_sub(1).map(|j| s.hashes[j]);
                let tokens = &s.tokens[i * block_size..(i + 1) * block_size];
                self.pool
                    .register(s.table.blocks[i], s.hashes[i], parent, tokens);
                s.published += 1;
            }
        }
    }
}
