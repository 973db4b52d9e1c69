// SPDX-License-Identifier: MIT OR Apache-2.0
//! The SLAI policy, as the book states it: "New prefills are skipped while any active sequence
//! has waited 80% of --tbt-deadline-ms since its last token, and the queue is prefilled front
//! first, then shortest prompts."

mod common;

use std::time::Duration;

use common::engine::Rng;
use common::{Harness, config};
use metrale_scheduler::{Policy, SchedulerConfig, SeqId, StepPlan};

const A: SeqId = SeqId(0);
const B: SeqId = SeqId(1);

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn seqs(plan: &StepPlan) -> Vec<SeqId> {
    plan.items.iter().map(|i| i.seq).collect()
}

/// SLAI with a deadline no test reaches: only the admission order matters.
fn slai_no_deadline() -> SchedulerConfig {
    config(Policy::Slai {
        tbt_deadline_ms: 1_000_000,
    })
}

#[test]
fn prefill_is_skipped_while_a_decode_nears_its_deadline() {
    let mut cfg = config(Policy::Slai {
        tbt_deadline_ms: 100,
    });
    cfg.max_step_tokens = 8;
    let mut h = Harness::new(cfg);
    h.tick = Duration::ZERO; // the test sets the clock
    h.add(0, vec![1, 2], 50).unwrap();
    h.step(); // A's first token at t = 0
    h.add(1, (0..20).collect(), 1).unwrap();

    // 80% of the deadline since A's last token: decodes only, B is not admitted.
    h.clock = ms(80);
    let (plan, _) = h.step(); // A's token at t = 80
    assert_eq!(seqs(&plan), [A]);
    assert_eq!(h.sched.stats().waiting, 1);

    // Just under 80%: B is admitted with the budget left after A's decode.
    h.clock = ms(80) + ms(80) - Duration::from_micros(1);
    let (plan, _) = h.step();
    assert_eq!(seqs(&plan), [A, B]);
    assert_eq!(plan.items[1].tokens.len(), 7);
    let t = h.clock;

    // A continuing prefill is skipped too.
    h.clock = t + ms(90);
    let (plan, _) = h.step();
    assert_eq!(seqs(&plan), [A]);
    assert_eq!(h.sched.stats().prefilling, 1);
    h.clock += ms(1);
    let (plan, _) = h.step();
    assert_eq!(seqs(&plan), [A, B]);

    h.tick = ms(1);
    h.run_to_completion(100);
}

#[test]
fn the_deadline_counts_decoding_sequences_only() {
    let mut h = Harness::new(config(Policy::Slai {
        tbt_deadline_ms: 10,
    }));
    h.tick = Duration::ZERO;
    // A prefilling sequence that has waited long does not block admissions.
    h.add(0, (0..40).collect(), 2).unwrap();
    h.clock = ms(50);
    h.step(); // 32 of A's 40 prompt tokens
    h.add(1, vec![1], 1).unwrap();
    let (plan, _) = h.step();
    assert_eq!(seqs(&plan), [A, B]);
    h.tick = ms(1);
    h.run_to_completion(100);
}

#[test]
fn admission_is_front_first_then_shortest_prompt() {
    let lengths = [20, 30, 5, 10, 5];
    let admitted = |policy_cfg: SchedulerConfig| {
        let mut cfg = policy_cfg;
        cfg.max_running = 3;
        cfg.max_step_tokens = 64;
        let mut h = Harness::new(cfg);
        let mut rng = Rng(1);
        for (id, &n) in lengths.iter().enumerate() {
            h.add(id as u64, rng.tokens(n), 2).unwrap();
        }
        let (plan, _) = h.step();
        h.run_to_completion(100);
        seqs(&plan)
    };
    assert_eq!(admitted(slai_no_deadline()), [0, 2, 4].map(SeqId));
    assert_eq!(admitted(config(Policy::Fifo)), [0, 1, 2].map(SeqId));
}

#[test]
fn a_preempted_sequence_at_the_front_is_admitted_before_shorter_ones() {
    let mut cfg = slai_no_deadline();
    cfg.block_size = 2;
    cfg.num_blocks = 4;
    cfg.max_running = 3;
    cfg.max_step_tokens = 8;
    let mut h = Harness::new(cfg);
    for (id, prompt) in [[1, 2], [3, 4], [5, 6]].into_iter().enumerate() {
        h.add(id as u64, prompt.to_vec(), 5).unwrap();
    }
    h.step(); // A, B, C admitted, one block each
    h.add(3, vec![7], 1).unwrap(); // no running slot for D
    let (plan, _) = h.step();
    assert_eq!(plan.preempted, [SeqId(2)], "C gives way to B");
    let (plan, _) = h.step();
    assert_eq!(
        seqs(&plan),
        [A, B],
        "C (3 tokens) is at the front and does not fit; D waits"
    );
    let (plan, _) = h.step();
    assert_eq!(
        plan.preempted,
        [B],
        "B gives way to A and goes in front of C"
    );
    // The queue is now [B (5 tokens), C (3), D (1)]: B first, then the rest shortest first.
    let mut order = Vec::new();
    while !h.sched.is_idle() {
        let (plan, _) = h.step();
        for item in &plan.items {
            if item.seq != A && !order.contains(&item.seq) {
                order.push(item.seq);
            }
        }
    }
    assert_eq!(order, [B, SeqId(3), SeqId(2)]);
}
