// SPDX-License-Identifier: MIT OR Apache-2.0
//! Randomized property test: random configs (pool sizes down to one block, budgets, batch
//! sizes, both policies, prefix caching on or off), random arrivals and lengths (invalid ones
//! included) over prompts that share random prefixes of a few stems (so they hit the prefix cache
//! at and between block boundaries, and some are identical) or continue a finished sequence's
//! prompt and output (the next turn of a conversation, which resumes from the snapshot its
//! predecessor's tail left), random turn boundaries, cancellations and stops between
//! steps and while a step is in flight, preemptions, and a random clock. The harness checks every
//! invariant on every step (budget, batch size, block reference counts against the tables, no
//! write into a shared or cached block, exact reservation, a hit's table holding its prefix's KV,
//! positions, logits, no duplicate or lost token, solo-run outputs, priority by admission, one
//! recurrent-state slot per running sequence and none shared or leaked); this file checks the
//! refusals and that everything drains with every reference count zero, every block free or
//! cached and every state slot free.

mod common;

use std::time::Duration;

use common::engine::Rng;
use common::{Harness, key};
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
        prefix_cache: (!rng.one_in(4)).then(key),
        // A hybrid model's state slots in a third of the workloads, down to one slot.
        state_slots: rng.one_in(3).then(|| rng.range(1, max_running + 1)),
        // Snapshot slots (used only with state slots and the cache), none in a fifth; tails
        // from two on.
        state_snapshots: rng.range(0, 4),
    }
}

/// A prompt of `n` tokens: a random-length prefix of one of `stems`, then random tokens.
fn overlapping_prompt(rng: &mut Rng, stems: &[Vec<u32>], n: usize) -> Vec<u32> {
    let stem = &stems[rng.range(0, stems.len() - 1)];
    let shared = rng.range(0, n.min(stem.len()));
    let mut prompt = stem[..shared].to_vec();
    prompt.extend(rng.tokens(n - shared));
    prompt
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

/// Runs one random workload; returns the prompt tokens it found cached, the most tables that
/// held one block at once, whether it had state slots, and how many admissions resumed past the
/// prompt of the sequence whose conversation they continue (from that one's output).
fn run_seed(seed: u64) -> (u64, u32, bool, usize) {
    let mut rng = Rng(seed);
    let cfg = random_config(&mut rng);
    let mut h = Harness::new(cfg.clone());
    let mut next_id = 0;
    let mut accepted = 0;
    let longest = cfg.max_seq_len.min(cfg.pool_tokens()) + 2;
    let stems: Vec<Vec<u32>> = (0..3).map(|_| rng.tokens(longest)).collect();
    // Continuations added: (id, the prompt length of the sequence they continue).
    let mut continuations: Vec<(SeqId, usize)> = Vec::new();
    // Prompts of sequences added, by id.
    let mut prompts: Vec<Vec<u32>> = Vec::new();
    for _ in 0..rng.range(20, 200) {
        for _ in 0..rng.range(0, 2) {
            let finished: Vec<SeqId> = h.finished.keys().copied().collect();
            let (tokens, turn) = if !finished.is_empty() && rng.one_in(3) {
                // The next turn: a finished sequence's prompt, its output, a new message.
                let prev = finished[rng.range(0, finished.len() - 1)];
                let mut tokens = prompts[prev.0 as usize].clone();
                continuations.push((SeqId(next_id), tokens.len()));
                tokens.extend(&h.outputs[&prev]);
                let turn = tokens.len() + rng.range(0, 3);
                let new = rng.range(0, 6);
                tokens.extend(rng.tokens(new));
                (tokens, rng.one_in(2).then_some(turn))
            } else {
                let n = rng.range(0, longest);
                let tokens = overlapping_prompt(&mut rng, &stems, n);
                let turn = rng.one_in(4).then(|| rng.range(0, n + 2));
                (tokens, turn)
            };
            let prompt = tokens.len();
            let max_new = rng.range(0, 30);
            let want = expected(&cfg, h.live.len(), prompt, max_new);
            prompts.push(tokens.clone());
            let got = h.add_turn(next_id, tokens, max_new, turn).err();
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
    let resumed_answers = continuations
        .iter()
        .filter(|(id, base)| h.hits.iter().any(|(s, hit)| s == id && hit > base))
        .count();
    let stats = h.sched.stats();
    assert_eq!(stats.blocks_used, 0);
    assert_eq!(stats.state_slots_used, 0, "seed {seed}: state slots leaked");
    assert_eq!(stats.state_slots_total, cfg.state_slots.unwrap_or(0));
    if cfg.prefix_cache.is_none() || (cfg.state_slots.is_some() && cfg.state_snapshots == 0) {
        assert_eq!(stats.prefix_hit_tokens, 0);
    }
    // Dropping the snapshots leaves nothing held.
    h.sched.clear_snapshots();
    assert_eq!(h.sched.stats().state_snapshots_used, 0);
    if cfg.prefix_cache.is_none() {
        assert_eq!(stats.blocks_cached, 0);
    }
    (
        stats.prefix_hit_tokens,
        h.most_sharers,
        cfg.state_slots.is_some(),
        resumed_answers,
    )
}

#[test]
fn random_workloads_keep_every_invariant() {
    let runs: Vec<(u64, u32, bool, usize)> = (0..400).map(run_seed).collect();
    let hit: u64 = runs.iter().map(|r| r.0).sum();
    let hybrid_hit: u64 = runs.iter().filter(|r| r.2).map(|r| r.0).sum();
    let hybrid_hits = runs.iter().filter(|r| r.2 && r.0 > 0).count();
    assert!(
        hybrid_hits > 10,
        "only {hybrid_hits} hybrid workloads resumed from a snapshot ({hybrid_hit} tokens)"
    );
    // A hybrid continuation resumes past its previous prompt only from a tail snapshot; these
    // crowded workloads seldom keep one long enough (the next test does).
    let hybrid_answers: usize = runs.iter().filter(|r| r.2).map(|r| r.3).sum();
    assert!(
        hybrid_answers > 0,
        "no hybrid continuation resumed inside an answer"
    );
    let shared = runs.iter().filter(|r| r.1 > 1).count();
    assert!(
        hit > 10_000,
        "the workloads hardly hit the prefix cache: {hit} tokens"
    );
    assert!(
        shared > 50,
        "only {shared} workloads shared a block between live sequences"
    );
}

/// A conversation's latest turn: its id and prompt length.
type Turn = (SeqId, usize);

/// Random multi-turn conversations on a hybrid model: each turn resends the previous turn's
/// prompt and output plus a new message, sometimes with a turn boundary; turns are cancelled or
/// stopped at random, small pools preempt. Besides every invariant of the harness (each restored
/// state is its prefix's), later turns must resume from the previous answer's tail.
#[test]
fn random_hybrid_conversations_resume_from_their_answers() {
    let mut resumed = 0;
    let mut turns = 0;
    for seed in 0..150u64 {
        let mut rng = Rng(seed ^ 0x5eed);
        let max_running = rng.range(1, 5);
        let cfg = SchedulerConfig {
            max_num_seqs: 16,
            max_running,
            max_step_tokens: rng.range(max_running, max_running + 40),
            max_seq_len: rng.range(60, 300),
            block_size: rng.range(1, 8),
            num_blocks: rng.range(12, 120),
            policy: if rng.one_in(2) {
                Policy::Fifo
            } else {
                Policy::Slai {
                    tbt_deadline_ms: rng.range(1, 30) as u64,
                }
            },
            prefix_cache: Some(key()),
            state_slots: Some(rng.range(1, max_running)),
            state_snapshots: rng.range(2, 8),
        };
        let mut h = Harness::new(cfg.clone());
        // Per conversation: its latest turn's id and prompt length, and its transcript.
        let mut convs: Vec<(Option<Turn>, Vec<u32>)> = Vec::new();
        for _ in 0..rng.range(1, 4) {
            let n = rng.range(4, 40);
            convs.push((None, rng.tokens(n)));
        }
        let mut next_id = 0;
        let mut continuations = Vec::new();
        for _ in 0..rng.range(50, 300) {
            for conv in convs.iter_mut() {
                if conv.0.is_some_and(|(id, _)| h.live.contains_key(&id)) || !rng.one_in(3) {
                    continue;
                }
                if let Some((id, base)) = conv.0 {
                    conv.1.extend(&h.outputs[&id]);
                    continuations.push((id, SeqId(next_id), base));
                }
                let turn = conv.1.len() + rng.range(0, 2);
                let new = rng.range(1, 8);
                conv.1.extend(rng.tokens(new));
                if conv.1.len() + 1 >= cfg.max_total_len() {
                    conv.1.truncate(rng.range(4, 20)); // a new conversation
                    conv.0 = None;
                    continue;
                }
                let turn = rng.one_in(2).then_some(turn);
                h.add_turn(next_id, conv.1.clone(), rng.range(1, 30), turn)
                    .unwrap();
                conv.0 = Some((SeqId(next_id), conv.1.len()));
                next_id += 1;
                turns += 1;
            }
            if rng.one_in(15)
                && let Some(id) = random_live(&h, &mut rng)
            {
                let reason = [FinishReason::Cancelled, FinishReason::Stop][rng.range(0, 1)];
                h.finish(id, reason);
            }
            let plan = h.schedule();
            let results = h.run(&plan);
            if rng.one_in(20)
                && let Some(id) = random_live(&h, &mut rng)
            {
                h.cancel(id);
            }
            h.complete(&results);
        }
        h.run_to_completion(100_000);
        resumed += continuations
            .iter()
            .filter(|(_, id, base)| h.hits.iter().any(|(s, hit)| s == id && hit > base))
            .count();
    }
    // A coverage floor, not a hit rate: first turns, answers too short to reach a block past
    // the prompt's snapshot, cancelled turns and crowded pools resume elsewhere (811 of 4,500
    // turns when written).
    assert!(
        resumed * 10 > turns,
        "{resumed} of {turns} turns resumed inside the previous answer"
    );
}
