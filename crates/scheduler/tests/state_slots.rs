// SPDX-License-Identifier: MIT OR Apache-2.0
//! Recurrent-state slots (hybrid models): one per running sequence, taken at admission with its
//! blocks, returned on finish, cancel and preemption; admission waits when none is free; no
//! prefix-cache hits. The random workloads of `properties.rs` check the same invariants under
//! load; these pin the individual rules.

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

#[test]
fn zero_slots_is_refused() {
    assert_eq!(
        Scheduler::new(slots(0)).unwrap_err(),
        ConfigError::Zero {
            field: "state_slots"
        }
    );
}
