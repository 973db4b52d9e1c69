// SPDX-License-Identifier: MIT OR Apache-2.0
//! The prefix cache in the scheduler: where a hit starts, what it shares, what it never shares,
//! that cached blocks are free capacity, and that two requests with one prefix compute it once.
//! The harness checks on every step that no shared or cached block is written and that a hit's
//! table holds its prefix's KV; outputs are the solo runs'.

mod common;

use common::engine::Rng;
use common::{Harness, config, key};
use metrale_scheduler::{Policy, SchedulerConfig, SeqId, StepPlan};

/// Blocks of 4 tokens, an ample pool, a budget that prefills a short prompt in one step.
fn cached() -> SchedulerConfig {
    SchedulerConfig {
        prefix_cache: Some(key()),
        ..config(Policy::Fifo)
    }
}

fn start_of(plan: &StepPlan, seq: SeqId) -> Option<usize> {
    plan.items
        .iter()
        .find(|i| i.seq == seq)
        .map(|i| i.start_position)
}

/// Tokens fed to the model (prefill and decode) by the steps until idle.
fn run_counting(h: &mut Harness) -> usize {
    let mut computed = 0;
    while !h.sched.is_idle() {
        let (plan, _) = h.step();
        computed += plan.num_tokens();
    }
    computed
}

#[test]
fn a_second_request_starts_at_its_first_uncached_block() {
    let mut h = Harness::new(cached());
    let mut rng = Rng(1);
    let prefix = rng.tokens(13); // three full blocks and one token
    h.add(0, prefix.clone(), 3).unwrap();
    h.run_to_completion(50);
    // Same 13 tokens, then more: the three full blocks hit, the fourth (partial) does not.
    let mut longer = prefix.clone();
    longer.extend(rng.tokens(6));
    h.add(1, longer, 3).unwrap();
    let (plan, _) = h.step();
    assert_eq!(start_of(&plan, SeqId(1)), Some(12));
    assert_eq!(h.sched.cached_tokens(SeqId(1)), Some(12));
    h.run_to_completion(50);
    let stats = h.sched.stats();
    assert_eq!(stats.prefix_hit_tokens, 12);
    assert_eq!(stats.prefix_queried_tokens, 13 + 19);
    assert!(stats.blocks_cached > 0, "released blocks stay cached");
}

#[test]
fn a_request_that_diverges_mid_block_recomputes_that_block() {
    let mut h = Harness::new(cached());
    let mut rng = Rng(2);
    let a = rng.tokens(20);
    h.add(0, a.clone(), 2).unwrap();
    h.run_to_completion(50);
    let mut b = a.clone();
    b[9] = (b[9] + 1) % 100; // inside block 2 (positions 8..12)
    h.add(1, b, 2).unwrap();
    let (plan, _) = h.step();
    assert_eq!(
        start_of(&plan, SeqId(1)),
        Some(8),
        "blocks 0 and 1 shared, 2 recomputed"
    );
    h.run_to_completion(50);
}

#[test]
fn a_fully_cached_prompt_still_computes_its_last_token() {
    let mut h = Harness::new(cached());
    let mut rng = Rng(3);
    for (id, len) in [(0, 16), (2, 17)] {
        let prompt = rng.tokens(len);
        h.add(id, prompt.clone(), 2).unwrap();
        h.run_to_completion(50);
        h.add(id + 1, prompt, 2).unwrap();
        let (plan, _) = h.step();
        // 16 tokens: 3 blocks shared, the 4th (holding the last token) computed privately, so
        // no shared block is written; 17 tokens: all 4 full blocks shared, token 16 computed.
        let want = if len == 16 { 12 } else { 16 };
        assert_eq!(start_of(&plan, SeqId(id + 1)), Some(want), "{len} tokens");
        let item = plan.items.iter().find(|i| i.seq == SeqId(id + 1)).unwrap();
        assert!(item.wants_logits);
        h.run_to_completion(50);
    }
}

#[test]
fn two_requests_with_one_prefix_compute_it_once() {
    let mut rng = Rng(4);
    let prefix = rng.tokens(40);
    let prompts: Vec<Vec<u32>> = (0..3)
        .map(|_| {
            let mut p = prefix.clone();
            p.extend(rng.tokens(3));
            p
        })
        .collect();
    let mut computed = Vec::new();
    for prefix_cache in [None, Some(key())] {
        // A budget of 16 tokens: the prefix takes three steps to prefill.
        let mut h = Harness::new(SchedulerConfig {
            max_step_tokens: 16,
            prefix_cache,
            ..config(Policy::Fifo)
        });
        for (id, p) in prompts.iter().enumerate() {
            h.add(id as u64, p.clone(), 4).unwrap();
        }
        computed.push(run_counting(&mut h));
        if prefix_cache.is_some() {
            // The first computes the 40 shared tokens; the others wait, then hit all ten blocks.
            assert_eq!(h.hits, vec![(SeqId(0), 0), (SeqId(1), 40), (SeqId(2), 40)]);
        }
    }
    // Without the cache each request computes its 43 tokens and 3 decodes; with it, the
    // prefix is computed once.
    assert_eq!(computed, vec![3 * 46, 46 + 2 * 6]);
}

#[test]
fn a_waiting_request_lets_the_ones_behind_it_in_while_its_prefix_is_computed() {
    let mut rng = Rng(5);
    let prefix = rng.tokens(40);
    let mut h = Harness::new(SchedulerConfig {
        max_step_tokens: 16,
        ..cached()
    });
    h.add(0, prefix.clone(), 2).unwrap();
    h.add(1, prefix.clone(), 2).unwrap();
    h.add(2, rng.tokens(5), 2).unwrap();
    let (plan, _) = h.step(); // 0 takes the whole budget
    assert_eq!(start_of(&plan, SeqId(0)), Some(0));
    let (plan, _) = h.step(); // 0 continues; 1 waits for it, 2 is admitted behind it
    assert_eq!(start_of(&plan, SeqId(0)), Some(16));
    assert_eq!(start_of(&plan, SeqId(1)), None);
    h.run_to_completion(50);
    assert_eq!(
        h.hits[2],
        (SeqId(1), 36),
        "1 hits nine blocks and computes its last four"
    );
}

#[test]
fn cached_blocks_are_free_capacity_and_are_evicted_least_recent_first() {
    // Eight blocks; each finished request leaves its full blocks cached.
    let mut h = Harness::new(SchedulerConfig {
        num_blocks: 8,
        ..cached()
    });
    let mut rng = Rng(6);
    let old = rng.tokens(16);
    h.add(0, old.clone(), 1).unwrap();
    h.run_to_completion(20);
    let recent = rng.tokens(16);
    h.add(1, recent.clone(), 1).unwrap();
    h.run_to_completion(20);
    let stats = h.sched.stats();
    assert_eq!((stats.blocks_cached, stats.blocks_free), (8, 8));
    // A new 12-token request needs 3 blocks, none free but for cached ones: admitted at once,
    // no preemption, evicting the oldest request's blocks, tail first.
    h.add(2, rng.tokens(12), 1).unwrap();
    let (plan, _) = h.step();
    assert_eq!(start_of(&plan, SeqId(2)), Some(0));
    h.run_to_completion(20);
    let stats = h.sched.stats();
    assert_eq!(stats.prefix_evicted_blocks, 3);
    assert_eq!(stats.preemptions, 0);
    // The recent prompt is still cached whole; of the old one only the head is left.
    let pool = h.sched.pool();
    let cached_blocks = |tokens: &[u32]| {
        let mut hashes = Vec::new();
        pool.hash_blocks(tokens, &mut hashes);
        pool.lookup(&hashes, tokens).len()
    };
    assert_eq!((cached_blocks(&recent), cached_blocks(&old)), (4, 1));
}

#[test]
fn a_preempted_sequence_reuses_its_own_cached_blocks() {
    // Two sequences that each need most of a 10-block pool: the younger is preempted, and on
    // re-admission finds the full blocks it had registered, if not evicted meanwhile.
    let mut h = Harness::new(SchedulerConfig {
        num_blocks: 10,
        max_step_tokens: 64,
        ..cached()
    });
    let mut rng = Rng(7);
    h.add(0, rng.tokens(20), 16).unwrap();
    h.add(1, rng.tokens(20), 16).unwrap();
    h.run_to_completion(200);
    assert!(
        h.sched.stats().preemptions > 0,
        "the pool was meant to run dry"
    );
    assert!(h.sched.stats().prefix_hit_tokens > 0);
}

#[test]
fn cancelling_while_a_step_is_in_flight_registers_nothing_for_it() {
    let mut h = Harness::new(cached());
    let mut rng = Rng(8);
    let prompt = rng.tokens(12);
    h.add(0, prompt.clone(), 4).unwrap();
    let plan = h.schedule();
    let results = h.run(&plan);
    h.cancel(SeqId(0));
    h.complete(&results);
    assert_eq!(
        h.sched.stats().blocks_cached,
        0,
        "its writes may not have happened"
    );
    h.add(1, prompt, 2).unwrap();
    let (plan, _) = h.step();
    assert_eq!(start_of(&plan, SeqId(1)), Some(0));
    h.run_to_completion(20);
}

#[test]
fn with_caching_off_nothing_is_shared() {
    let mut h = Harness::new(config(Policy::Fifo));
    let prompt = Rng(9).tokens(20);
    for id in 0..3 {
        h.add(id, prompt.clone(), 2).unwrap();
    }
    h.run_to_completion(50);
    let stats = h.sched.stats();
    assert_eq!((stats.prefix_hit_tokens, stats.blocks_cached), (0, 0));
    assert_eq!(h.most_sharers, 1);
}
