// SPDX-License-Identifier: MIT OR Apache-2.0
//! Randomized property test: random configs (pool sizes down to one block, budgets, batch
//! sizes, both policies), random arrivals and lengths (invalid ones included), cancellations and
//! stops between steps and while a step is in flight, and a random clock. The harness checks
//! every invariant on every step (budget, batch size, block ownership and exact reservation,
//! positions, logits, no duplicate or lost token, solo-run outputs, priority by admission); this
//! file checks the refusals and that everything drains with every block free.

mod common;

use std::time::Duration;

use common::Harness;
use common::engine::Rng;
use metrale_scheduler::{FinishReason, Policy, Rejected, SchedulerConfig, SeqId};

fn random_config(rng: &mut Rng) -> SchedulerConfig {
    let max_running = rng.range(1, 6);
    SchedulerConfig {
        max_num_seqs: rng.range(1, 12),
        max_running,
        max_step_tokens: rng.range(max_running, max_running + 24),
        max_seq_len: rng.range(2, 80),
        block_size: rng.range(1, 8),
        num_blocks: rng.range(1, 40),
        policy: if rng.one_in(2) {
            Policy::Fifo
        } else {
            Policy::Slai {
                tbt_deadline_ms: rng.range(1, 30) as u64,
            }
        },
    }
}

/// What `add` must answer, from the documented rules, in their documented order.
fn expected(cfg: &SchedulerConfig, live: usize, prompt: usize, max_new: usize) -> Option<Rejected> {
    if prompt == 0 {
        Some(Rejected::EmptyPrompt)
    } else if max_new == 0 {
        Some(Rejected::ZeroMaxNewTokens)
    } else if prompt + 1 > cfg.max_seq_len {
        Some(Rejected::PromptTooLong {
            prompt,
            max_seq_len: cfg.max_seq_len,
        })
    } else if prompt > cfg.pool_tokens() {
        Some(Rejected::ExceedsKvPool {
            prompt,
            pool_tokens: cfg.pool_tokens(),
        })
    } else if live >= cfg.max_num_seqs {
        Some(Rejected::QueueFull {
            max_num_seqs: cfg.max_num_seqs,
        })
    } else {
        None
    }
}

fn random_live(h: &Harness, rng: &mut Rng) -> Option<SeqId> {
    let ids: Vec<SeqId> = h.live.keys().copied().collect();
    (!ids.is_empty()).then(|| ids[rng.range(0, ids.len() - 1)])
}

fn run_seed(seed: u64) {
    let mut rng = Rng(seed);
    let cfg = random_config(&mut rng);
    let mut h = Harness::new(cfg.clone());
    let mut next_id = 0;
    let mut accepted = 0;
    let longest = cfg.max_seq_len.min(cfg.pool_tokens()) + 2;
    for _ in 0..rng.range(20, 200) {
        for _ in 0..rng.range(0, 2) {
            let prompt = rng.range(0, longest);
            let max_new = rng.range(0, 30);
            let want = expected(&cfg, h.live.len(), prompt, max_new);
            let got = h.add(next_id, rng.tokens(prompt), max_new).err();
            assert_eq!(got, want, "seed {seed}: add({prompt}, {max_new})");
            accepted += usize::from(got.is_none());
            next_id += 1;
        }
        if rng.one_in(10)
            && let Some(id) = random_live(&h, &mut rng)
        {
            let reason = [FinishReason::Cancelled, FinishReason::Stop][rng.range(0, 1)];
            h.finish(id, reason);
        }
        h.tick = Duration::from_micros(rng.range(0, 12_000) as u64);
        let plan = h.schedule();
        let results = h.run(&plan);
        if rng.one_in(10)
            && let Some(id) = random_live(&h, &mut rng)
        {
            h.cancel(id); // while the step is in flight: its result must be ignored
        }
        h.complete(&results);
    }
    h.run_to_completion(100_000);
    assert_eq!(h.finished.len(), accepted, "seed {seed}");
}

#[test]
fn random_workloads_keep_every_invariant() {
    for seed in 0..400 {
        run_seed(seed);
    }
}
