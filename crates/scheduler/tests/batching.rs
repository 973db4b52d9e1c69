// SPDX-License-Identifier: MIT OR Apache-2.0
//! Continuous batching and chunked prefill: how a step is filled, and that batching never
//! changes what a sequence generates.

mod common;

use common::engine::Rng;
use common::{Harness, config};
use metrale_scheduler::{Policy, SeqId};

#[test]
fn batched_outputs_match_solo_runs() {
    let mut cfg = config(Policy::Fifo);
    cfg.max_running = 4;
    cfg.max_step_tokens = 16;
    let mut h = Harness::new(cfg);
    let mut rng = Rng(7);
    // Sequences arrive while others run: (prompt length, max_new, steps before the next).
    let arrivals = [
        (1, 5, 0),
        (3, 12, 2),
        (17, 1, 0),
        (40, 9, 5),
        (5, 20, 1),
        (64, 3, 0),
    ];
    for (id, &(prompt, max_new, wait)) in arrivals.iter().enumerate() {
        h.add(id as u64, rng.tokens(prompt), max_new).unwrap();
        for _ in 0..wait {
            h.step();
        }
    }
    h.run_to_completion(500);
    // The harness compared each output with its solo run when it finished.
    assert_eq!(h.finished.len(), arrivals.len());
    for (id, &(_, max_new, _)) in arrivals.iter().enumerate() {
        assert_eq!(h.outputs[&SeqId(id as u64)].len(), max_new);
    }
    assert_eq!(h.sched.stats().preemptions, 0, "the pool was ample");
}

#[test]
fn long_prompt_is_chunked_within_budget_and_only_the_last_chunk_samples() {
    let mut cfg = config(Policy::Fifo);
    cfg.max_step_tokens = 8;
    let mut h = Harness::new(cfg);
    let prompt: Vec<u32> = (0..30).collect();
    h.add(1, prompt.clone(), 2).unwrap();
    let mut chunks = Vec::new();
    for _ in 0..4 {
        let (plan, events) = h.step();
        assert_eq!(plan.items.len(), 1);
        let item = &plan.items[0];
        assert_eq!(
            item.tokens[..],
            prompt[item.start_position..][..item.tokens.len()]
        );
        chunks.push((item.start_position, item.tokens.len(), item.wants_logits));
        assert_eq!(events.len(), usize::from(item.wants_logits));
        let stats = h.sched.stats();
        assert_eq!(stats.prefilling, usize::from(!item.wants_logits));
    }
    assert_eq!(
        chunks,
        [(0, 8, false), (8, 8, false), (16, 8, false), (24, 6, true)]
    );
    // Then one decode: the first output token fed back at position 30.
    let (plan, events) = h.step();
    assert_eq!(plan.items[0].start_position, 30);
    assert_eq!(plan.items[0].tokens, [h.outputs[&SeqId(1)][0]]);
    assert!(events[0].finish.is_some());
    assert!(h.sched.is_idle());
}

#[test]
fn decodes_take_one_token_each_and_prefill_fills_the_rest() {
    let mut cfg = config(Policy::Fifo);
    cfg.max_running = 4;
    cfg.max_step_tokens = 10;
    let mut h = Harness::new(cfg);
    for id in 0..3 {
        h.add(id, vec![1, 2], 50).unwrap();
    }
    let (plan, _) = h.step(); // all three prefilled in one step
    assert_eq!(plan.num_tokens(), 6);
    h.add(9, (0..40).collect(), 1).unwrap();
    for _ in 0..5 {
        let (plan, _) = h.step();
        let decodes = &plan.items[..3];
        assert!(
            decodes
                .iter()
                .all(|i| i.tokens.len() == 1 && i.wants_logits)
        );
        assert_eq!(plan.items[3].seq, SeqId(9), "decodes come first");
        assert_eq!(plan.items[3].tokens.len(), 7, "the chunk fills the budget");
        assert_eq!(plan.num_tokens(), 10);
    }
    let (plan, events) = h.step();
    assert_eq!(plan.items[3].tokens.len(), 40 - 35);
    assert!(
        events
            .iter()
            .any(|e| e.seq == SeqId(9) && e.finish.is_some())
    );
}

#[test]
fn max_running_caps_the_batch_and_admission_is_fifo() {
    let mut cfg = config(Policy::Fifo);
    cfg.max_running = 2;
    let mut h = Harness::new(cfg);
    let mut rng = Rng(3);
    let lengths = [9, 2, 5, 1, 7, 3];
    for (id, &n) in lengths.iter().enumerate() {
        h.add(id as u64, rng.tokens(n), 4).unwrap();
    }
    let mut first_seen = Vec::new();
    while !h.sched.is_idle() {
        let (plan, _) = h.step();
        assert!(plan.items.len() <= 2);
        for item in &plan.items {
            if !first_seen.contains(&item.seq) {
                first_seen.push(item.seq);
            }
        }
    }
    assert_eq!(first_seen, (0..6).map(SeqId).collect::<Vec<_>>());
}

#[test]
fn flatten_lays_out_the_model_step() {
    let mut cfg = config(Policy::Fifo);
    cfg.max_running = 2;
    cfg.max_step_tokens = 6;
    let mut h = Harness::new(cfg);
    h.add(1, vec![5], 3).unwrap();
    h.step();
    h.add(2, vec![7, 8, 9, 10, 11, 12, 13], 3).unwrap();
    let plan = h.schedule();
    let flat = plan.flatten();
    let first = h.outputs[&SeqId(1)][0];
    assert_eq!(flat.tokens, [first, 7, 8, 9, 10, 11]);
    assert_eq!(flat.positions, [1, 0, 1, 2, 3, 4]);
    assert_eq!(flat.token_seq, [0, 1, 1, 1, 1, 1]);
    assert_eq!(
        flat.logit_rows,
        [0],
        "the chunk does not reach the prompt's end"
    );
    assert_eq!(flat.logit_seqs, [SeqId(1)]);
    let results = h.run(&plan);
    h.complete(&results);
    h.run_to_completion(20);
}

#[test]
fn every_block_is_free_after_everything_finishes() {
    let mut cfg = config(Policy::Fifo);
    cfg.num_blocks = 40;
    cfg.block_size = 3;
    let mut h = Harness::new(cfg);
    let mut rng = Rng(11);
    for id in 0..12 {
        let n = rng.range(1, 20);
        h.add(id, rng.tokens(n), rng.range(1, 15)).unwrap();
    }
    h.run_to_completion(1000);
    let stats = h.sched.stats();
    assert_eq!((stats.running, stats.waiting, stats.blocks_used), (0, 0, 0));
}
