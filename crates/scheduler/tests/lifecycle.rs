// SPDX-License-Identifier: MIT OR Apache-2.0
//! A sequence's life outside the steady state: refusals at `add`, the length clamps, `finish`
//! and `cancel` in every state, results that do not match the plan, and bad configs.

mod common;

use common::{Harness, config};
use metrale_scheduler::{
    ConfigError, FinishReason, NewSequence, Policy, Rejected, Scheduler, SchedulerConfig, SeqId,
    StepError,
};

#[test]
fn queue_full_beyond_max_num_seqs_counts_running_and_waiting() {
    let mut cfg = config(Policy::Fifo);
    cfg.max_num_seqs = 3;
    cfg.max_running = 2;
    let mut h = Harness::new(cfg);
    for id in 0..3 {
        h.add(id, vec![1, 2, 3], 2).unwrap();
    }
    h.step(); // two running, one waiting
    let err = h.add(3, vec![1], 1).unwrap_err();
    assert_eq!(err, Rejected::QueueFull { max_num_seqs: 3 });
    assert!(err.to_string().contains("retry later"));
    h.step(); // the first two finish
    h.add(3, vec![1], 1).unwrap();
    h.run_to_completion(20);
}

#[test]
fn bad_requests_are_refused_with_their_own_error_even_when_full() {
    let mut cfg = config(Policy::Fifo);
    cfg.max_num_seqs = 1;
    cfg.max_seq_len = 10;
    cfg.num_blocks = 2;
    cfg.block_size = 4; // 8 KV positions
    let mut h = Harness::new(cfg.clone());
    h.add(0, vec![1], 1).unwrap();
    let cases = [
        (vec![], 1, Rejected::EmptyPrompt),
        (vec![1], 0, Rejected::ZeroMaxNewTokens),
        (
            vec![0; 10],
            1,
            Rejected::PromptTooLong {
                prompt: 10,
                max_seq_len: 10,
            },
        ),
        (
            vec![0; 9],
            1,
            Rejected::ExceedsKvPool {
                prompt: 9,
                pool_tokens: 8,
            },
        ),
        (vec![0; 8], 1, Rejected::QueueFull { max_num_seqs: 1 }),
    ];
    for (prompt, max_new, want) in cases {
        assert_eq!(h.add(1, prompt, max_new), Err(want));
    }
    assert_eq!(h.add(0, vec![1], 1), Err(Rejected::DuplicateId(SeqId(0))));
    assert_eq!(h.sched.stats().waiting, 1, "a refusal queues nothing");
    let msg = Rejected::PromptTooLong {
        prompt: 10,
        max_seq_len: 10,
    }
    .to_string();
    assert!(msg.contains("at most 9 tokens"), "{msg}");
}

#[test]
fn max_new_tokens_is_clamped_to_the_context_and_the_pool() {
    // The context: 10 prompt tokens of 16 leave 6.
    let mut cfg = config(Policy::Fifo);
    cfg.max_seq_len = 16;
    let mut h = Harness::new(cfg);
    h.add(0, (0..10).collect(), 100).unwrap();
    h.run_to_completion(50);
    assert_eq!(h.outputs[&SeqId(0)].len(), 6);

    // The pool: 12 KV positions hold a sequence of 13 tokens (the last is never fed back).
    let mut cfg = config(Policy::Fifo);
    cfg.num_blocks = 3;
    let mut h = Harness::new(cfg);
    h.add(0, (0..10).collect(), 100).unwrap();
    h.add(1, (0..12).collect(), 100).unwrap();
    h.run_to_completion(50);
    assert_eq!(h.outputs[&SeqId(0)].len(), 3);
    assert_eq!(h.outputs[&SeqId(1)].len(), 1);
}

/// Drives three sequences into a state with `reach`, cancels sequence 1 there (unless `reach`
/// did), and checks the others still complete with their solo outputs.
fn cancel_in_state(max_running: usize, num_blocks: usize, reach: impl FnOnce(&mut Harness)) {
    let mut cfg = config(Policy::Fifo);
    cfg.max_running = max_running;
    cfg.max_step_tokens = 4;
    cfg.block_size = 2;
    cfg.num_blocks = num_blocks;
    let mut h = Harness::new(cfg);
    h.add(0, vec![1, 2, 3], 6).unwrap();
    h.add(1, vec![4, 5], 6).unwrap();
    h.add(2, vec![10, 11], 3).unwrap();
    reach(&mut h);
    if h.live.contains_key(&SeqId(1)) {
        // Checks that its blocks came back and that its output so far is a prefix of its solo
        // run.
        h.cancel(SeqId(1));
    }
    h.run_to_completion(100);
    assert!(h.sched.cancel(SeqId(1)).is_none(), "already gone");
}

#[test]
fn cancel_frees_blocks_in_every_state() {
    // Waiting: one running slot, taken by sequence 0.
    cancel_in_state(1, 8, |h| {
        h.step();
        assert_eq!(h.sched.block_table(SeqId(1)).unwrap().blocks, []);
    });
    // Prefilling: the budget of 4 gives sequence 0 three tokens and sequence 1 one of two.
    cancel_in_state(2, 8, |h| {
        h.step();
        assert_eq!(h.sched.stats().prefilling, 1);
    });
    // Awaiting its sample: the engine ran the step, the client left before the results came.
    cancel_in_state(2, 8, |h| {
        while h.outputs[&SeqId(1)].len() < 2 {
            h.step();
        }
        let plan = h.schedule();
        assert!(
            plan.items
                .iter()
                .any(|i| i.seq == SeqId(1) && i.wants_logits)
        );
        let results = h.run(&plan);
        h.cancel(SeqId(1));
        let events = h.complete(&results);
        assert!(
            events.iter().all(|e| e.seq != SeqId(1)),
            "its result is ignored"
        );
    });
    // Decoding, between steps.
    cancel_in_state(2, 8, |h| {
        while h.outputs[&SeqId(1)].len() < 3 {
            h.step();
        }
    });
    // Preempted: back in the queue, with output already emitted.
    cancel_in_state(2, 4, |h| {
        loop {
            let (plan, _) = h.step();
            if plan.preempted.contains(&SeqId(1)) {
                break;
            }
            assert!(h.steps < 50, "sequence 1 was never preempted");
        }
        assert!(!h.outputs[&SeqId(1)].is_empty());
    });
}

#[test]
fn finish_reports_usage_and_frees_blocks() {
    let mut h = Harness::new(config(Policy::Fifo));
    h.add(0, vec![1, 2, 3], 10).unwrap();
    h.step();
    h.step();
    let finished = h.sched.finish(SeqId(0), FinishReason::Stop).unwrap();
    assert_eq!(finished.reason, FinishReason::Stop);
    assert_eq!((finished.prompt_tokens, finished.output_tokens), (3, 2));
    assert_eq!(h.sched.stats().blocks_used, 0);
    assert!(h.sched.is_idle());
    assert!(h.sched.finish(SeqId(0), FinishReason::Aborted).is_none());
    assert!(h.sched.finish(SeqId(99), FinishReason::Aborted).is_none());
}

#[test]
fn results_that_do_not_match_the_plan_are_refused_whole() {
    let mut h = Harness::new(config(Policy::Fifo));
    h.add(1, vec![1], 3).unwrap();
    h.add(0, (0..40).collect(), 3).unwrap(); // a two-chunk prompt
    let now = h.now();
    let plan = h.sched.schedule(now);
    assert_eq!(plan.items.len(), 2);
    assert!(plan.items[0].wants_logits && !plan.items[1].wants_logits);
    let refused = [
        vec![(SeqId(1), 5), (SeqId(0), 5)], // 0's chunk wanted no logits
        vec![(SeqId(1), 5), (SeqId(1), 6)], // two results for one item
    ];
    for results in refused {
        let bad = results[1].0;
        assert_eq!(
            h.sched.complete_step(&results, now),
            Err(StepError::NotAwaitingSample(bad))
        );
    }
    // Nothing was applied: the good result still goes through, once. Unknown ids are ignored.
    let events = h
        .sched
        .complete_step(&[(SeqId(1), 5), (SeqId(42), 1)], now)
        .unwrap();
    assert_eq!(events.len(), 1);
    assert_eq!((events[0].token, events[0].output_index), (5, 0));
}

#[test]
fn bad_configs_are_refused() {
    let good = config(Policy::Fifo);
    let with = |f: &dyn Fn(&mut SchedulerConfig)| {
        let mut c = good.clone();
        f(&mut c);
        Scheduler::new(c).unwrap_err()
    };
    assert_eq!(
        with(&|c| c.block_size = 0),
        ConfigError::Zero {
            field: "block_size"
        }
    );
    assert_eq!(
        with(&|c| c.policy = Policy::Slai { tbt_deadline_ms: 0 }),
        ConfigError::Zero {
            field: "tbt_deadline_ms"
        }
    );
    let err = with(&|c| c.max_step_tokens = 4);
    assert_eq!(
        err,
        ConfigError::BudgetBelowBatch {
            max_step_tokens: 4,
            max_running: 8
        }
    );
    assert!(err.to_string().contains("--max-prefill-tokens"));
    let mut s = Scheduler::new(good).unwrap();
    let now = std::time::Instant::now();
    assert!(s.schedule(now).is_empty(), "idle");
    s.add(NewSequence {
        id: SeqId(1),
        prompt: vec![1],
        max_new_tokens: 1,
        arrival: now,
        turn_boundary: None,
    })
    .unwrap();
    assert!(!s.schedule(now).is_empty());
}
