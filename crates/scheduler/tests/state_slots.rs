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

/// Four running slots and two snapshot slots (model slots 4 and 5), the cache on.
fn snapshots() -> SchedulerConfig {
    SchedulerConfig {
        prefix_cache: Some(key()),
        state_snapshots: 2,
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
    h.run_to_completion(100);
    assert_eq!(h.sched.stats().prefix_hit_tokens, 8);
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
        (2, 2)
    );
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
