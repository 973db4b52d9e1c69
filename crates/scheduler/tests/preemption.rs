// SPDX-License-Identifier: MIT OR Apache-2.0
//! Preemption by recompute under a small KV pool: who gives way, where it goes, and that every
//! sequence still produces its solo output with no token emitted twice.

mod common;

use common::engine::Rng;
use common::{Harness, config};
use metrale_scheduler::{Policy, SchedulerConfig, SeqId};

const A: SeqId = SeqId(0);
const B: SeqId = SeqId(1);
const C: SeqId = SeqId(2);

/// Blocks of two tokens; `num_blocks` of them; `max_running` sequences.
fn small(num_blocks: usize, max_running: usize) -> SchedulerConfig {
    SchedulerConfig {
        block_size: 2,
        num_blocks,
        max_running,
        max_step_tokens: 8,
        ..config(Policy::Fifo)
    }
}

fn seqs(plan: &metrale_scheduler::StepPlan) -> Vec<SeqId> {
    plan.items.iter().map(|i| i.seq).collect()
}

#[test]
fn tiny_pool_preempts_and_still_completes_every_sequence() {
    for policy in [Policy::Fifo, Policy::Slai { tbt_deadline_ms: 5 }] {
        let mut cfg = config(policy);
        cfg.num_blocks = 6;
        cfg.block_size = 4;
        let mut h = Harness::new(cfg);
        let mut rng = Rng(5);
        for id in 0..4 {
            let n = rng.range(5, 9);
            h.add(id, rng.tokens(n), 12).unwrap();
        }
        // The harness checks every event's output index (no duplicates, no gaps) and each
        // finished output against the solo run.
        h.run_to_completion(500);
        assert_eq!(h.finished.len(), 4);
        assert!(h.outputs.values().all(|o| o.len() == 12));
        assert!(
            h.sched.stats().preemptions > 0,
            "{policy:?}: the pool is too small for all four"
        );
    }
}

#[test]
fn the_most_recently_admitted_gives_way_and_waits_at_the_front() {
    let mut h = Harness::new(small(4, 3));
    for (id, prompt) in [[1, 2], [3, 4], [5, 6]].into_iter().enumerate() {
        h.add(id as u64, prompt.to_vec(), 5).unwrap();
    }
    h.add(3, vec![7], 1).unwrap();
    // Step 1: A, B and C are admitted (one block each); D finds no running slot.
    let (plan, _) = h.step();
    assert_eq!(seqs(&plan), [A, B, C]);
    assert_eq!(h.sched.stats().blocks_free, 1);
    // Step 2: A takes the last block; B needs one and C, admitted after it, gives way.
    let (plan, _) = h.step();
    assert_eq!(seqs(&plan), [A, B]);
    assert_eq!(plan.preempted, [C]);
    let stats = h.sched.stats();
    assert_eq!((stats.running, stats.waiting, stats.preemptions), (2, 2, 1));
    assert_eq!(h.sched.block_table(C).unwrap().blocks, []);
    // Step 3: C (prompt + 1 output = 3 tokens, 2 blocks) is at the front and does not fit;
    // D behind it would, but FIFO admission stops at the front.
    let (plan, _) = h.step();
    assert_eq!(seqs(&plan), [A, B]);
    // Step 4: A, the oldest, needs a block: B gives way, not A.
    let (plan, _) = h.step();
    assert_eq!(seqs(&plan), [A]);
    assert_eq!(plan.preempted, [B]);
    // Step 5: A finishes; then B (front) is recomputed before C and D.
    let (_, events) = h.step();
    assert_eq!(
        events[0].finish,
        Some(metrale_scheduler::FinishReason::Length)
    );
    let (plan, _) = h.step();
    assert_eq!(seqs(&plan), [B]);
    let item = &plan.items[0];
    assert_eq!(
        (item.start_position, item.tokens.len()),
        (0, 5),
        "prompt + 3 outputs"
    );
    assert!(item.wants_logits);
    h.run_to_completion(100);
}

#[test]
fn the_victim_is_the_newest_of_several() {
    let mut h = Harness::new(small(3, 3));
    h.add(0, vec![1, 2], 3).unwrap();
    h.add(1, vec![3], 3).unwrap();
    h.add(2, vec![4], 3).unwrap();
    h.step(); // one block each, none free
    // A's decode at position 2 needs a block: C, the newest, gives way, not B.
    let (plan, _) = h.step();
    assert_eq!(seqs(&plan), [A, B]);
    assert_eq!(plan.preempted, [C]);
    h.run_to_completion(100);
}

#[test]
fn the_newest_sequence_in_need_preempts_itself() {
    let mut h = Harness::new(small(3, 2));
    h.add(0, vec![1, 2], 3).unwrap();
    h.add(1, vec![3, 4], 3).unwrap();
    h.step();
    // A takes the last free block; B needs one and nothing was admitted after it.
    let (plan, _) = h.step();
    assert_eq!(seqs(&plan), [A]);
    assert_eq!(plan.preempted, [B]);
    h.run_to_completion(100);
}

#[test]
fn admission_waits_until_the_first_chunk_fits() {
    let mut cfg = small(5, 2);
    cfg.max_step_tokens = 16;
    let mut h = Harness::new(cfg);
    h.add(0, vec![1, 2, 3, 4, 5, 6], 2).unwrap(); // 3 blocks
    h.step();
    h.add(1, (0..9).collect(), 1).unwrap(); // a first chunk of 9 tokens: 5 blocks
    // A's decode at position 6 takes a 4th block; B's chunk does not fit the one left, and
    // admission never preempts.
    let (plan, _) = h.step();
    assert_eq!(seqs(&plan), [A]);
    assert_eq!(h.sched.stats().waiting, 1);
    // A finished on that step; now B fits.
    let (plan, _) = h.step();
    assert_eq!(seqs(&plan), [B]);
    h.run_to_completion(100);
    assert_eq!(h.sched.stats().preemptions, 0);
}

#[test]
fn a_running_prefill_shrinks_its_chunk_to_the_free_blocks_before_preempting() {
    let mut h = Harness::new(small(6, 2));
    h.add(0, vec![1, 2], 3).unwrap();
    h.add(1, (0..12).collect(), 1).unwrap();
    // Step 1: A's prompt (1 block) and 6 of B's 12 tokens (3 blocks); 2 blocks free.
    let (plan, _) = h.step();
    assert_eq!(plan.items[1].tokens.len(), 6);
    // Step 2: A's decode takes a block; B wants 6 more but 1 block is free: it takes 2 tokens.
    let (plan, _) = h.step();
    assert_eq!(seqs(&plan), [A, B]);
    assert_eq!(
        (plan.items[1].start_position, plan.items[1].tokens.len()),
        (6, 2)
    );
    assert!(plan.preempted.is_empty());
    // Step 3: no block is free and B is the newest: it waits itself, A goes on.
    let (plan, _) = h.step();
    assert_eq!(seqs(&plan), [A]);
    assert_eq!(plan.preempted, [B]);
    h.run_to_completion(100);
}

#[test]
fn a_sequence_awaiting_its_sample_is_neither_rescheduled_nor_preempted() {
    let mut h = Harness::new(small(2, 2));
    h.add(0, vec![1, 2], 3).unwrap();
    h.add(1, vec![3, 4], 3).unwrap();
    let plan = h.schedule();
    let results = h.run(&plan);
    assert!(h.schedule().is_empty(), "both await their samples");
    // Only A's sample comes back for now.
    let a = results.iter().find(|r| r.0 == A).copied().unwrap();
    let b = results.iter().find(|r| r.0 == B).copied().unwrap();
    h.complete(&[a]);
    // A needs a block; B holds the other but awaits its sample, so A waits itself.
    let plan = h.schedule();
    assert!(plan.is_empty());
    assert_eq!(plan.preempted, [A]);
    h.complete(&[b]);
    h.run_to_completion(100);
}

#[test]
fn preemption_never_duplicates_or_loses_tokens_over_many_pools() {
    for seed in 0..40 {
        let mut rng = Rng(seed);
        let mut cfg = config(Policy::Fifo);
        cfg.block_size = rng.range(1, 4);
        cfg.num_blocks = rng.range(4, 12);
        cfg.max_running = rng.range(2, 6);
        cfg.max_step_tokens = rng.range(cfg.max_running, 16);
        let mut h = Harness::new(cfg.clone());
        for id in 0..6 {
            let n = rng.range(1, cfg.num_blocks * cfg.block_size);
            h.add(id, rng.tokens(n), rng.range(1, 20)).unwrap();
        }
        h.run_to_completion(5000);
    }
}
