// SPDX-License-Identifier: MIT OR Apache-2.0
//! Building one step: the scheduling algorithm.

use std::collections::HashSet;
use std::time::Instant;

use metrale_cache::{BlockHash, BlockPool, BlockTable, SnapshotPool, StateSlot};

use crate::config::Policy;
use crate::plan::{PlanItem, StepPlan};
use crate::request::SeqId;
use crate::scheduler::{PendingSnapshot, Scheduler};
use crate::sequence::{Phase, Sequence, Tail};

impl Scheduler {
    /// Plans the next step at time `now` (read only by the SLAI deadline rule).
    ///
    /// Algorithm (vLLM v1 style: one token budget per step rather than separate prefill and
    /// decode phases; a sequence is its tokens and how many of them are in the KV cache). The
    /// budget is `max_step_tokens`. **First**, the running sequences are visited oldest admission
    /// first: a decoding sequence gets one token (its last sampled one); a prefilling sequence
    /// gets the next chunk of its prompt, as large as the budget allows after keeping one token
    /// for each decoding sequence still to be visited, so chunks never crowd out decodes; a
    /// sequence whose sample is still outstanding is skipped. Before an item enters the plan,
    /// blocks are reserved for exactly the positions it writes. When the pool is short, a chunk
    /// shrinks to the free blocks; when not even one token fits, the most recently admitted
    /// sequence admitted after the one in need (hence not yet planned) and with no outstanding
    /// sample is preempted by recompute: its blocks are freed and it goes to the front of the
    /// queue with every token it has, prompt and output, to be prefilled again later. This
    /// repeats until the token fits; when no such sequence is left, the one in need is preempted
    /// itself. So priority is admission order: with no sample outstanding, the oldest running
    /// sequence is never preempted and advances every step (but SLAI's decode-only steps), which
    /// rules out livelock. **Second**, unless this call preempted (memory is tight), waiting
    /// sequences are admitted while a running slot, budget and free blocks for their first chunk
    /// (up to the remaining budget) remain; the first that does not fit stops admission, so the
    /// front of the queue is never overtaken and a long prompt cannot starve. FIFO admits in
    /// queue order; SLAI admits the front of the queue first (the last preempted sequence if
    /// any, else the oldest arrival), then the rest by shortest prompt. **Third**, SLAI's
    /// deadline rule: while any decoding sequence has gone 80% of `tbt_deadline_ms` since its
    /// last token, prefill chunks and admissions are skipped and the step holds decodes only.
    /// An item wants logits exactly when it covers its sequence's last token, so a prefill
    /// samples only on its final chunk, and a recomputed sequence samples its next output token,
    /// never one it already emitted: preemption delays a sequence but never drops, changes or
    /// repeats a token.
    ///
    /// **Prefix caching** (`SchedulerConfig::prefix_cache`). At admission a sequence looks up the
    /// longest run of its leading full blocks in the cache, at most `(len - 1) / block_size`
    /// blocks so that its last token is always computed (it needs logits) and its first
    /// computed position lies past every shared block; it takes those blocks by reference and
    /// its first chunk starts at the first uncached token, through the same path as any later
    /// chunk of a chunked prefill. A sequence that diverges mid-block shares the blocks before
    /// that block and recomputes from its start. Blocks are registered when full and written:
    /// [`Scheduler::complete_step`] registers the full blocks of the plan it completes. Cached
    /// blocks nobody references count as free (evicted least recently released first when
    /// taken), so they never block an admission or force a preemption. **Admission rule** for
    /// prefixes being computed: when the first block a waiting sequence would have to compute
    /// is one a running sequence is computing now (planned, not yet registered), the waiting
    /// sequence is skipped this step and keeps its place, and the sequences behind it may be
    /// admitted; once the block is registered it is a hit. So two requests with the same
    /// prefix admitted together compute it once, the second waiting at most the first's
    /// prefill, and it cannot wait forever: the running sequence registers the block, or ends
    /// or is preempted, which drops it from the running set.
    ///
    /// **State slots** (`SchedulerConfig::state_slots`, hybrid models). An admission also takes
    /// a recurrent-state slot; when none is free, admission stops there (the front keeps its
    /// place, as when blocks run out). The slot is returned with the blocks whenever they are:
    /// finish, cancel, finish by length, preemption. A prefill that starts at position 0 starts
    /// from a zero state.
    ///
    /// **Snapshots** (`SchedulerConfig::state_snapshots`, state slots with the prefix cache).
    /// A hybrid model's hit needs the recurrent state after the prefix as well as its KV. Each
    /// prefill keeps one snapshot, at its *snapshot boundary*: the last full-block boundary at or
    /// before its last token, `((prefill_end - 1) / block_size) * block_size` (the furthest
    /// point a hit can reach, since a hit never covers the last token; a later request that
    /// resends this prompt plus more resumes there), or at or before its
    /// [`NewSequence::turn_boundary`](crate::NewSequence::turn_boundary) when that comes first
    /// (a chat template may render this turn's opening otherwise in the next turn). The chunk that crosses
    /// the boundary is cut to end on it and carries [`PlanItem::snapshot`], a slot reserved in
    /// the [`SnapshotPool`] under the chain hash of the block ending there; the engine copies
    /// the sequence's state into it after the step, and `complete_step` commits it (or gives it
    /// back if the sequence ended meanwhile). No snapshot is taken when one of that prefix
    /// exists, is being written, or every snapshot slot is being written. At admission the hit
    /// is the longest cached prefix (as above) that ends at a boundary with a live snapshot; the
    /// first item carries [`PlanItem::restore`], which the engine copies into the sequence's own
    /// slot before the step; with no such snapshot there is no hit and the prefill runs from 0.
    /// The admission rule for prefixes being computed waits only for a running sequence's
    /// snapshot boundary, until its snapshot is committed (a shared prefix without a snapshot
    /// at its end is no hit to wait for).
    ///
    /// **Tails.** Past its snapshot boundary, each item that ends on a block boundary (a decode
    /// every `block_size` tokens, a prefill chunk that happens to) also carries
    /// [`PlanItem::snapshot`]: the sequence's *tail* slot, held in the [`SnapshotPool`] from
    /// its first such item (if fewer than half the pool is held) and overwritten by each. When
    /// the sequence ends, however it ends, its tail becomes the snapshot of its tokens up to the
    /// last boundary a completed step copied (the end of its generated text, rounded down to a
    /// block), so the next turn of a conversation that resends the answer resumes after it.
    /// A tail written by a step still in flight at the end is given back instead.
    pub fn schedule(&mut self, now: Instant) -> StepPlan {
        let decode_only = self.decode_deadline_near(now);
        let mut step = StepBuilder {
            budget: self.config.max_step_tokens,
            items: Vec::new(),
            preempted: Vec::new(),
            writes: Vec::new(),
            snapshots: Vec::new(),
        };
        self.schedule_running(decode_only, &mut step);
        if !decode_only && step.preempted.is_empty() {
            self.admit_waiting(&mut step);
        }
        self.unconfirmed.append(&mut step.writes);
        self.pending_snapshots.append(&mut step.snapshots);
        step.into_plan()
    }

    /// SLAI: whether a decoding sequence has waited 80% of the deadline since its last token.
    fn decode_deadline_near(&self, now: Instant) -> bool {
        let Policy::Slai { tbt_deadline_ms } = self.config.policy else {
            return false;
        };
        // 80% of the deadline, in microseconds, compared exactly in integers.
        let threshold_us = u128::from(tbt_deadline_ms) * 800;
        self.running.iter().any(|s| {
            s.phase() == Phase::Decode
                && now.saturating_duration_since(s.last_token_at).as_micros() >= threshold_us
        })
    }

    /// The first part of the algorithm: decodes and continuing prefill chunks, with preemption.
    fn schedule_running(&mut self, decode_only: bool, step: &mut StepBuilder) {
        // Budget kept back: one token for every decoding sequence not yet visited.
        let mut decodes_ahead = self
            .running
            .iter()
            .filter(|s| s.phase() == Phase::Decode)
            .count();
        let mut i = 0;
        while i < self.running.len() {
            let s = &self.running[i];
            let phase = s.phase();
            let want = match phase {
                Phase::Decode => {
                    decodes_ahead -= 1;
                    debug_assert!(
                        step.budget > decodes_ahead,
                        "max_step_tokens >= max_running"
                    );
                    1
                }
                Phase::Prefill if !decode_only => {
                    (s.prefill_end - s.num_computed).min(step.budget - decodes_ahead)
                }
                Phase::Prefill | Phase::AwaitingSample => 0,
            };
            if want == 0 {
                i += 1;
                continue;
            }
            loop {
                let fit = self.tokens_that_fit(i, want);
                if fit == want || (phase == Phase::Prefill && fit > 0) {
                    let s = &mut self.running[i];
                    let mut fit = fit;
                    let mut snapshot = None;
                    let start = s.num_computed;
                    if phase == Phase::Prefill
                        && let Some((cut, key)) =
                            snapshot_target(&self.pool, self.snapshots.as_ref(), s, start, fit)
                    {
                        fit = cut;
                        snapshot = reserve_snapshot(&self.pool, self.snapshots.as_mut(), key);
                    }
                    self.pool
                        .reserve(&mut s.table, s.num_computed + fit)
                        .expect("the free blocks were counted");
                    let copy = match snapshot {
                        Some(slot) => Some((slot, false)),
                        None => tail_target(&self.pool, self.snapshots.as_mut(), s, start + fit)
                            .map(|slot| (slot, true)),
                    };
                    step.plan(s, fit, phase == Phase::Decode, None, copy);
                    i += 1;
                    break;
                }
                if let Some(j) = self.victim_after(i) {
                    let victim = self.running.remove(j);
                    if victim.phase() == Phase::Decode {
                        decodes_ahead -= 1;
                    }
                    step.preempted.push(self.preempt(victim));
                } else {
                    // Nothing admitted after it is left to give way: it waits itself, and the
                    // sequence that moves into index `i` is visited next.
                    let itself = self.running.remove(i);
                    step.preempted.push(self.preempt(itself));
                    break;
                }
            }
        }
    }

    /// Of `want` more tokens for `running[i]`, how many its blocks and the free ones can hold.
    fn tokens_that_fit(&self, i: usize, want: usize) -> usize {
        let s = &self.running[i];
        let capacity = (s.table.blocks.len() + self.pool.free_count()) * self.config.block_size;
        want.min(capacity - s.num_computed)
    }

    /// The preemption victim for `running[i]`: the most recently admitted sequence after it
    /// with nothing in flight. Those after `i` are not planned yet in this step, so preempting
    /// one never takes back an item already planned.
    fn victim_after(&self, i: usize) -> Option<usize> {
        (i + 1..self.running.len())
            .rev()
            .find(|&j| self.running[j].phase() != Phase::AwaitingSample)
    }

    /// The second part of the algorithm: admissions from the queue, each applied at once (its
    /// cached blocks taken before anything is allocated, so that no allocation evicts a block
    /// an admission counted on).
    fn admit_waiting(&mut self, step: &mut StepBuilder) {
        let block_size = self.config.block_size;
        let mut computing = self.blocks_being_computed();
        let mut admitted = Vec::new(); // queue indices, in admission order
        for index in self.admission_order() {
            if self.running.len() + admitted.len() >= self.config.max_running || step.budget == 0 {
                break;
            }
            if self.states.as_ref().is_some_and(|p| p.free_count() == 0) {
                break; // every state slot is held: wait for a sequence to end
            }
            let s = &mut self.waiting[index];
            let hybrid = self.states.is_some();
            // A hit leaves at least the last token to compute (see `schedule`); with state slots
            // but no snapshots there are no hits (the recurrent state of a prefix is not kept).
            let limit = if hybrid && self.snapshots.is_none() {
                0
            } else {
                (s.tokens.len() - 1) / block_size
            };
            self.pool.hash_blocks(&s.tokens, &mut s.hashes);
            let limit = limit.min(s.hashes.len());
            let mut hit = self.pool.lookup(&s.hashes[..limit], &s.tokens);
            let mut restore = None;
            if hybrid && let Some(snaps) = &self.snapshots {
                // The longest hit that ends where a snapshot of the state was taken.
                let found = (1..=hit.len()).rev().find_map(|k| {
                    snaps
                        .find(s.hashes[k - 1], &s.tokens[..k * block_size])
                        .map(|slot| (k, slot))
                });
                hit.truncate(found.map_or(0, |(k, _)| k));
                restore = found.map(|(_, slot)| slot);
            }
            let waits = if let (true, Some(snaps)) = (hybrid, &self.snapshots) {
                // A running sequence will snapshot a longer prefix of this one, or a step in
                // flight is writing that snapshot.
                s.hashes[hit.len()..limit]
                    .iter()
                    .any(|h| computing.contains(h) || snaps.is_pending(*h))
            } else {
                // A running sequence is computing this one's next block.
                hit.len() < limit && computing.contains(&s.hashes[hit.len()])
            };
            if waits {
                continue; // wait for it
            }
            let start = hit.len() * block_size;
            let mut chunk = (s.tokens.len() - start).min(step.budget);
            let target = snapshot_target(&self.pool, self.snapshots.as_ref(), s, start, chunk);
            if let Some((cut, _)) = target {
                chunk = cut;
            }
            let new_blocks = BlockTable::blocks_for(start + chunk, block_size) - hit.len();
            let revived = hit.iter().filter(|&&b| self.pool.ref_count(b) == 0).count();
            if new_blocks + revived > self.pool.free_count() {
                break;
            }
            self.pool.take(&hit);
            s.table.blocks = hit;
            self.pool
                .reserve(&mut s.table, start + chunk)
                .expect("the free blocks were counted");
            s.published = start / block_size;
            s.slot = self.states.as_mut().map(|p| {
                p.allocate()
                    .expect("a free slot was counted before admission")
            });
            s.num_computed = start;
            s.prefill_end = s.tokens.len();
            s.cached_tokens.get_or_insert(start.min(s.prompt_len));
            self.admissions += 1;
            s.admission = self.admissions;
            self.prefix_queried_tokens += s.tokens.len() as u64;
            self.prefix_hit_tokens += start as u64;
            if let (Some(slot), Some(snaps)) = (restore, self.snapshots.as_mut()) {
                snaps.touch(slot);
            }
            let copy = match target
                .and_then(|(_, key)| reserve_snapshot(&self.pool, self.snapshots.as_mut(), key))
            {
                Some(slot) => Some((slot, false)),
                None => tail_target(&self.pool, self.snapshots.as_mut(), s, start + chunk)
                    .map(|slot| (slot, true)),
            };
            computing.extend(computing_keys(&self.pool, hybrid, s));
            step.plan(s, chunk, false, restore, copy);
            admitted.push(index);
        }
        if admitted.is_empty() {
            return;
        }
        let mut queue: Vec<Option<Sequence>> = self.waiting.drain(..).map(Some).collect();
        for index in admitted {
            let s = queue[index]
                .take()
                .expect("each queue index is admitted once");
            self.running.push(s);
        }
        self.waiting = queue.into_iter().flatten().collect();
    }

    /// Hashes of the full blocks running sequences hold or will hold and have not registered:
    /// the prefixes being computed now, which a waiting sequence waits for instead of
    /// computing them again. Empty with caching off.
    fn blocks_being_computed(&mut self) -> HashSet<BlockHash> {
        if !self.pool.caching() || self.waiting.is_empty() {
            return HashSet::new();
        }
        let hybrid = self.states.is_some();
        let mut computing = HashSet::new();
        for s in &mut self.running {
            computing.extend(computing_keys(&self.pool, hybrid, s));
        }
        computing
    }

    /// Queue indices in the order the policy admits them.
    fn admission_order(&self) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.waiting.len()).collect();
        if let Policy::Slai { .. } = self.config.policy
            && order.len() > 2
        {
            // The front first; the rest by shortest prefill, ties in queue order (stable sort).
            order[1..].sort_by_key(|&i| self.waiting[i].tokens.len());
        }
        order
    }
}

/// What a running sequence computes that a waiting one sharing its prefix would rather wait for
/// than compute again: the hashes of its full blocks not yet registered, or for a hybrid model
/// the key of the snapshot it will take (a shared prefix is a hit only where a snapshot is).
fn computing_keys(pool: &BlockPool, hybrid: bool, s: &mut Sequence) -> Vec<BlockHash> {
    if !hybrid {
        pool.hash_blocks(&s.tokens, &mut s.hashes);
        return s.hashes[s.published..].to_vec();
    }
    let b = snapshot_boundary(s, pool.block_size());
    if b == 0 || s.num_computed >= b || !pool.caching() {
        return Vec::new();
    }
    pool.hash_blocks(&s.tokens[..b], &mut s.hashes);
    vec![s.hashes[b / pool.block_size() - 1]]
}

/// Where a sequence's prefill snapshots its recurrent state: the last full-block boundary at or
/// before its turn boundary, or without one its last prefill token (0: none). See
/// [`Scheduler::schedule`].
pub(crate) fn snapshot_boundary(s: &Sequence, block_size: usize) -> usize {
    let end = s.prefill_end - 1;
    s.turn_boundary.map_or(end, |t| t.min(end)) / block_size * block_size
}

/// For an item that brings `s`'s computed length to `end`: when `end` is a block boundary past
/// its snapshot boundary, its tail slot (held now if it has none and the pool can spare one),
/// marked as written by the step in flight. See [`Scheduler::schedule`].
fn tail_target(
    pool: &BlockPool,
    snapshots: Option<&mut SnapshotPool>,
    s: &mut Sequence,
    end: usize,
) -> Option<StateSlot> {
    let snaps = snapshots?;
    let bs = pool.block_size();
    if s.slot.is_none() || !end.is_multiple_of(bs) || end <= snapshot_boundary(s, bs) {
        return None;
    }
    let tail = match &mut s.tail {
        Some(tail) => tail,
        None => {
            let slot = snaps.hold(|h| !pool.is_registered(h))?;
            s.tail.insert(Tail {
                slot,
                holds: 0,
                in_flight: false,
            })
        }
    };
    debug_assert!(!tail.in_flight, "one item a sequence a step");
    tail.in_flight = true;
    Some(tail.slot)
}

/// For `n` prefill tokens of `s` from position `start`: when they reach its snapshot boundary
/// and a snapshot is to be taken there, the length that ends the chunk on it and the snapshot's
/// key (the chain hash of the block ending there). `None` without snapshots, when the boundary
/// is out of reach or already passed, when a snapshot of that prefix exists or is being written,
/// or when no slot can be reserved.
fn snapshot_target(
    pool: &BlockPool,
    snapshots: Option<&SnapshotPool>,
    s: &mut Sequence,
    start: usize,
    n: usize,
) -> Option<(usize, BlockHash)> {
    let snaps = snapshots?;
    let bs = pool.block_size();
    let b = snapshot_boundary(s, bs);
    if b == 0 || start >= b || start + n < b {
        return None;
    }
    pool.hash_blocks(&s.tokens[..b], &mut s.hashes);
    let key = s.hashes[b / bs - 1];
    (!snaps.has_key(key) && snaps.can_reserve()).then_some((b - start, key))
}

/// Reserves a snapshot slot for `key`, evicting first a snapshot whose prefix's blocks the cache
/// no longer holds (it could never be a hit again).
fn reserve_snapshot(
    pool: &BlockPool,
    snapshots: Option<&mut SnapshotPool>,
    key: BlockHash,
) -> Option<StateSlot> {
    snapshots?.reserve(key, |h| !pool.is_registered(h))
}

/// The step under construction.
struct StepBuilder {
    /// Tokens left in the budget.
    budget: usize,
    /// Planned items, each with its table snapshot and whether it is a decode.
    items: Vec<(PlanItem, BlockTable, bool)>,
    /// Sequences preempted so far.
    preempted: Vec<SeqId>,
    /// `(sequence, admission, end)` of each planned item: positions below `end` are written
    /// once the step completes.
    writes: Vec<(SeqId, u64, usize)>,
    /// The state copies into snapshot slots the step makes.
    snapshots: Vec<PendingSnapshot>,
}

impl StepBuilder {
    /// Puts the next `n` tokens of `seq` in the step; its blocks must already hold them.
    /// `restore`: the snapshot its state starts from; `snapshot`: the slot its state is copied
    /// to after the step, and whether it is the sequence's tail (else the chunk ends on its
    /// snapshot boundary).
    fn plan(
        &mut self,
        seq: &mut Sequence,
        n: usize,
        decode: bool,
        restore: Option<StateSlot>,
        snapshot: Option<(StateSlot, bool)>,
    ) {
        let start = seq.num_computed;
        seq.num_computed += n;
        self.budget -= n;
        let item = PlanItem {
            seq: seq.id,
            tokens: seq.tokens[start..seq.num_computed].to_vec(),
            start_position: start,
            wants_logits: seq.num_computed == seq.tokens.len(),
            state_slot: seq.slot,
            restore,
            snapshot: snapshot.map(|(slot, _)| slot),
        };
        if let Some((slot, tail)) = snapshot {
            self.snapshots.push(PendingSnapshot {
                seq: seq.id,
                admission: seq.admission,
                slot,
                boundary: seq.num_computed,
                tail,
            });
        }
        self.items.push((item, seq.table.clone(), decode));
        self.writes.push((seq.id, seq.admission, seq.num_computed));
    }

    fn into_plan(mut self) -> StepPlan {
        // Stable: decodes first, each group in the order planned.
        self.items.sort_by_key(|&(_, _, decode)| !decode);
        let (items, block_tables) = self
            .items
            .into_iter()
            .map(|(item, table, _)| (item, table))
            .unzip();
        StepPlan {
            items,
            block_tables,
            preempted: self.preempted,
        }
    }
}
