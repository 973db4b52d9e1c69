// SPDX-License-Identifier: MIT OR Apache-2.0
//! Recurrent-state slots (hybrid models): one per running sequence, taken at admission with its
//! blocks, returned on finish, cancel and preemption; admission waits when none is free; no
//! prefix-cache hits. The random workloads of `properties.rs` check the same invariants under
//! load; these pin the individual rules. With snapshot slots, a hit resumes from a snapshot
//! of the state at the hit's end.

mod common;

use common::{Harness, config, key};
use metrale_scheduler::{
    ConfigError, Policy, Scheduler, SchedulerConfig, SeqId, StateSlot, StepPlan,
};

const A: SeqId = SeqId(0);
const B: SeqId = SeqId(1);
const C: SeqId = SeqId(2);

fn slots(n: usize) -> SchedulerConfig {
    SchedulerConfig {
        state_slots: Some(n),
        ..config(Policy::Fifo)
    }
}

fn planned(plan: &StepPlan) -> Vec<(SeqId, Option<StateSlot>)> {
    plan.items.iter().map(|i| (i.seq, i.state_slot)).collect()
}

#[test]
fn admission_waits_for_a_free_slot_and_a_cancel_frees_one() {
    let mut h = Harness::new(slots(1));
    h.add(0, vec![1, 2, 3], 4).unwrap();
    h.add(1, vec![4, 5], 4).unwrap();
    let (plan, _) = h.step();
    // Running room for 8, but one slot: B waits.
    assert_eq!(planned(&plan), [(A, Some(StateSlot(0)))]);
    assert_eq!(h.sched.state_slot(B), None);
    let stats = h.sched.stats();
    assert_eq!(
        (stats.running, stats.waiting, stats.state_slots_used),
        (1, 1, 1)
    );
    h.cancel(A);
    assert_eq!(h.sched.stats().state_slots_used, 0);
    let (plan, _) = h.step();
    assert_eq!(planned(&plan), [(B, Some(StateSlot(0)))]);
    h.run_to_completion(100);
}

#[test]
fn a_finish_by_length_returns_the_slot_to_the_next_in_line() {
    let mut h = Harness::new(slots(2));
    for id in 0..3 {
        h.add(id, vec![10 + id as u32; 3], 2).unwrap();
    }
    let (plan, _) = h.step();
    assert_eq!(
        planned(&plan),
        [(A, Some(StateSlot(0))), (B, Some(StateSlot(1)))]
    );
    // Two outputs each: the second step's decode finishes A and B by length.
    h.step();
    assert_eq!(h.sched.stats().state_slots_used, 0);
    let (plan, _) = h.step();
    assert_eq!(planned(&plan), [(C, Some(StateSlot(1)))]);
    h.run_to_completion(100);
}

#[test]
fn preemption_returns_the_slot_and_readmission_takes_one_again() {
    // Blocks of 2 tokens, 4 blocks: two growing sequences cannot both fit.
    let mut h = Harness::new(SchedulerConfig {
        block_size: 2,
        num_blocks: 4,
        max_step_tokens: 8,
        ..slots(2)
    });
    h.add(0, vec![1, 2, 3], 8).unwrap();
    h.add(1, vec![4, 5, 6], 8).unwrap();
    let mut preempted = false;
    while !h.sched.is_idle() {
        let (plan, _) = h.step();
        for p in &plan.preempted {
            preempted = true;
            assert_eq!(h.sched.state_slot(*p), None, "{p} kept its slot");
        }
        let stats = h.sched.stats();
        assert_eq!(stats.state_slots_used, stats.running);
    }
    assert!(preempted, "the pool was meant to run dry");
    assert_eq!(h.sched.stats().state_slots_used, 0);
}

#[test]
fn with_slots_the_prefix_cache_gives_no_hits() {
    let mut h = Harness::new(SchedulerConfig {
        prefix_cache: Some(key()),
        ..slots(4)
    });
    let prompt: Vec<u32> = (0..20).collect();
    h.add(0, prompt.clone(), 2).unwrap();
    h.run_to_completion(100);
    h.add(1, prompt, 2).unwrap();
    let (plan, _) = h.step();
    assert_eq!(
        plan.items[0].start_position, 0,
        "a hit without the recurrent state"
    );
    h.run_to_completion(100);
    assert_eq!(h.sched.stats().prefix_hit_tokens, 0);
}

/// Four running slots and three snapshot slots (model slots 4 to 6, at most one a tail), the
/// cache on.
fn snapshots() -> SchedulerConfig {
    SchedulerConfig {
        prefix_cache: Some(key()),
        state_snapshots: 3,
        ..slots(4)
    }
}

#[test]
fn a_prefill_is_cut_at_its_snapshot_boundary_and_a_longer_prompt_resumes_there() {
    let mut h = Harness::new(snapshots());
    // 10 tokens, blocks of 4: the boundary is 8, the last full block before the last token.
    let first: Vec<u32> = (0..10).collect();
    h.add(0, first.clone(), 2).unwrap();
    let (plan, _) = h.step();
    let item = &plan.items[0];
    assert_eq!((item.start_position, item.tokens.len()), (0, 8), "cut at 8");
    assert_eq!((item.restore, item.snapshot), (None, Some(StateSlot(4))));
    let (plan, _) = h.step();
    assert_eq!(
        (plan.items[0].start_position, plan.items[0].snapshot),
        (8, None)
    );
    h.run_to_completion(100);
    assert_eq!(h.sched.snapshots().unwrap().live_count(), 1);
    // The next turn: the first prompt and more. Its hit ends at the snapshot (8), its own
    // boundary is 12.
    let mut second = first.clone();
    second.extend(50..55);
    h.add(1, second, 2).unwrap();
    let (plan, _) = h.step();
    let item = &plan.items[0];
    assert_eq!(item.start_position, 8);
    assert_eq!(item.tokens.len(), 4, "cut at its own boundary, 12");
    assert_eq!(
        (item.restore, item.snapshot),
        (Some(StateSlot(4)), Some(StateSlot(5)))
    );
    assert_eq!(h.sched.cached_tokens(B), Some(8));
    // Its prompt ends at 15; the decode of position 15 reaches 16, a block boundary past 12:
    // the state there goes to its tail slot, the snapshot of its 16 tokens once it ends.
    h.step();
    let (plan, _) = h.step();
    assert_eq!(plan.items[0].start_position, 15);
    assert_eq!(plan.items[0].snapshot, Some(StateSlot(6)), "its tail");
    assert!(h.sched.is_idle(), "that decode was its last");
    assert_eq!(
        h.sched.snapshots().unwrap().live_count(),
        3,
        "the tail kept"
    );
    h.run_to_completion(100);
    assert_eq!(h.sched.stats().prefix_hit_tokens, 8);
    assert_eq!(h.sched.stats().state_snapshots_held, 0);
    // The same first prompt again: a hit at 8 from the first snapshot, nothing new to keep.
    h.add(2, first, 2).unwrap();
    let (plan, _) = h.step();
    let item = &plan.items[0];
    assert_eq!(
        (item.start_position, item.restore, item.snapshot),
        (8, Some(StateSlot(4)), None)
    );
    h.run_to_completion(100);
    let stats = h.sched.stats();
    assert_eq!(
        (stats.state_snapshots_used, stats.state_snapshots_total),
        (3, 3)
    );
    assert_eq!(stats.state_snapshot_evictions, 0);
}

#[test]
fn the_answer_is_kept_at_its_last_block_boundary_and_the_next_turn_resumes_after_it() {
    let mut h = Harness::new(snapshots());
    // 10 prompt tokens, 9 generated: positions 0..18 are computed (the last token is never fed
    // back). Past the prompt's boundary (8), the decodes reaching 12 and 16 copy the state into
    // one tail slot; it is the snapshot of the first 16 tokens once the sequence ends.
    let prompt: Vec<u32> = (0..10).collect();
    h.add(0, prompt.clone(), 9).unwrap();
    let mut copies = Vec::new();
    while !h.sched.is_idle() {
        let (plan, _) = h.step();
        for item in &plan.items {
            if let Some(slot) = item.snapshot {
                copies.push((item.start_position + item.tokens.len(), slot));
            }
        }
    }
    let tail = StateSlot(5);
    assert_eq!(copies, [(8, StateSlot(4)), (12, tail), (16, tail)]);
    let snaps = h.sched.snapshots().unwrap();
    assert_eq!((snaps.live_count(), snaps.held_count()), (2, 0));
    // Every full block of the conversation so far, the answer's too, is in the prefix cache.
    let mut conversation = prompt.clone();
    conversation.extend(&h.outputs[&A]);
    let pool = h.sched.pool();
    let mut hashes = Vec::new();
    pool.hash_blocks(&conversation, &mut hashes);
    assert_eq!(
        pool.lookup(&hashes, &conversation).len(),
        4,
        "18 computed: 4 blocks"
    );
    // The next turn: the conversation and a new message. It resumes at 16, from the tail.
    conversation.extend([70, 71, 72, 73, 74]);
    h.add(1, conversation, 2).unwrap();
    let (plan, _) = h.step();
    let item = &plan.items[0];
    assert_eq!((item.start_position, item.restore), (16, Some(tail)));
    assert_eq!(h.sched.cached_tokens(B), Some(16));
    h.run_to_completion(100);
}

#[test]
fn a_tail_in_flight_at_a_cancel_is_given_back_and_one_confirmed_is_kept() {
    let mut h = Harness::new(snapshots());
    h.add(0, (0..10).collect(), 20).unwrap();
    // Prefill to 8 (snapshot), to 10 (samples), decodes 10 and 11: the one reaching 12 copies.
    for _ in 0..3 {
        h.step();
    }
    let plan = h.schedule();
    assert_eq!(plan.items[0].snapshot, Some(StateSlot(5)));
    let results = h.run(&plan);
    h.cancel(A);
    assert_eq!(
        h.sched.snapshots().unwrap().held_count(),
        1,
        "left to the step in flight"
    );
    h.complete(&results);
    let snaps = h.sched.snapshots().unwrap();
    assert_eq!(
        (snaps.live_count(), snaps.held_count(), snaps.used_count()),
        (1, 0, 1)
    );
    // The same again, cancelled between steps: its tail holds 12 and is kept.
    h.add(1, (0..10).collect(), 20).unwrap();
    for _ in 0..3 {
        h.step();
    }
    h.cancel(B);
    let snaps = h.sched.snapshots().unwrap();
    assert_eq!((snaps.live_count(), snaps.held_count()), (2, 0));
    let mut next: Vec<u32> = (0..10).collect();
    next.extend(&h.outputs[&B]);
    next.push(99);
    h.add(2, next, 1).unwrap();
    let (plan, _) = h.step();
    assert_eq!(
        plan.items[0].start_position, 12,
        "resumes from the kept tail"
    );
    h.run_to_completion(100);
}

#[test]
fn a_chat_prompt_snapshots_at_its_turn_boundary() {
    let mut h = Harness::new(snapshots());
    // 20 tokens, the generation prompt from 13 on: the snapshot is at 12, not at 16.
    let prompt: Vec<u32> = (0..20).collect();
    h.add_turn(0, prompt.clone(), 1, Some(13)).unwrap();
    let (plan, _) = h.step();
    assert_eq!(
        (plan.items[0].tokens.len(), plan.items[0].snapshot),
        (12, Some(StateSlot(4)))
    );
    h.run_to_completion(100);
    // The next turn renders the answer's turn without the generation prompt's tail (as Qwen3's
    // template drops an earlier answer's `<think>` block): it agrees up to 13 only.
    let mut next = prompt[..13].to_vec();
    next.extend(40..50);
    h.add_turn(1, next, 1, Some(21)).unwrap();
    let (plan, _) = h.step();
    assert_eq!(
        (plan.items[0].start_position, plan.items[0].restore),
        (12, Some(StateSlot(4)))
    );
    h.run_to_completion(100);
}

#[test]
fn without_a_snapshot_at_the_prefix_end_there_is_no_hit() {
    let mut h = Harness::new(snapshots());
    let first: Vec<u32> = (0..10).collect();
    h.add(0, first.clone(), 2).unwrap();
    h.run_to_completion(100);
    // Shares the first block only (the snapshot is at 8): KV for 4 tokens, no state there.
    let mut other = first[..6].to_vec();
    other.extend([90, 91, 92, 93]);
    h.add(1, other, 2).unwrap();
    let (plan, _) = h.step();
    assert_eq!(
        (plan.items[0].start_position, plan.items[0].restore),
        (0, None)
    );
    h.run_to_completion(100);
}

#[test]
fn a_cancel_while_the_snapshot_step_is_in_flight_gives_the_slot_back() {
    let mut h = Harness::new(snapshots());
    h.add(0, (0..10).collect(), 2).unwrap();
    let plan = h.schedule();
    assert_eq!(plan.items[0].snapshot, Some(StateSlot(4)));
    let results = h.run(&plan);
    h.cancel(A);
    h.complete(&results);
    let snaps = h.sched.snapshots().unwrap();
    assert_eq!((snaps.used_count(), snaps.live_count()), (0, 0));
    snaps.check().unwrap();
}

#[test]
fn zero_slots_is_refused() {
    assert_eq!(
        Scheduler::new(slots(0)).unwrap_err(),
        ConfigError::Zero {
            field: "state_slots"
        }
    );
}

#[test]
fn hybrid_requests_sharing_a_prefix_admitted_together_compute_it_once() {
    let mut rng = common::engine::Rng(4);
    let prefix = rng.tokens(40);
    let mut h = Harness::new(SchedulerConfig {
        max_step_tokens: 16,
        ..snapshots()
    });
    for id in 0..3 {
        let mut p = prefix.clone();
        p.extend(rng.tokens(3));
        h.add(id, p, 4).unwrap();
    }
    let mut computed = 0;
    while !h.sched.is_idle() {
        let (plan, _) = h.step();
        computed += plan.num_tokens();
    }
    // The first computes the 40 shared tokens and snapshots the state there; the others wait
    // for that snapshot, then resume from it: 43 + 3 decodes, then 3 + 3 each.
    assert_eq!(h.hits, vec![(A, 0), (B, 40), (C, 40)]);
    assert_eq!(computed, 46 + 2 * 6);
}
