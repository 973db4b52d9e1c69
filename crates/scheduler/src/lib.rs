// SPDX-License-Identifier: MIT OR Apache-2.0
//! The serving scheduler: which tokens of which sequences the next model step computes.
//!
//! The central decision: **the scheduler is a CPU-only state machine with a typed output.** It
//! owns the request queue, the per-sequence progress and the KV block pool (with its prefix
//! cache: full blocks shared between sequences whose tokens agree), and each call to
//! [`Scheduler::schedule`] returns a [`StepPlan`]: a flat list of [`PlanItem`]s (a decode token or
//! a prefill chunk, each with its positions) plus the block table of every sequence in it, with
//! the blocks for every position the step writes already reserved. The engine runs the plan and
//! hands back the sampled tokens through [`Scheduler::complete_step`], which returns the
//! [`TokenEvent`]s to stream. The scheduler never runs a model, touches a GPU, does I/O or reads
//! a clock: the caller passes `now` as an [`std::time::Instant`] to every call that needs time, so
//! the whole policy (continuous batching, chunked prefill, preemption by recompute, the SLAI
//! deadline rule) is tested on the CPU with a scripted engine and a scripted clock.
//!
//! Life of a sequence: [`Scheduler::add`] (or a typed [`Rejected`]) → waiting → admitted, its
//! prompt prefilled over one or more steps → one decode token per step → finished by
//! [`FinishReason::Length`] in [`Scheduler::complete_step`] or by the caller through
//! [`Scheduler::finish`] / [`Scheduler::cancel`]. Under KV pressure a running sequence may be
//! preempted back to the front of the queue and recomputed later; that never drops, corrupts or
//! repeats a token (see [`Scheduler::schedule`]). With the prefix cache on, admission starts a
//! sequence's prefill at its first uncached token (reported by [`Scheduler::cached_tokens`]).
//!
//! The engine loop, with a stand-in for the model and the sampler:
//!
//! ```
//! use std::time::Instant;
//! use metrale_scheduler::{NewSequence, Policy, PrefixKey, Scheduler, SchedulerConfig, SeqId};
//!
//! let mut scheduler = Scheduler::new(SchedulerConfig {
//!     max_num_seqs: 256,
//!     max_running: 64,
//!     max_step_tokens: 512,
//!     max_seq_len: 4096,
//!     block_size: 16,
//!     num_blocks: 1024,
//!     policy: Policy::Slai { tbt_deadline_ms: 50 },
//!     prefix_cache: Some(PrefixKey::from_bytes(b"model id|kv=bf16|block=16")),
//!     state_slots: None,
//!     state_snapshots: 0,
//! })?;
//! let prompt = vec![1, 2, 3];
//! scheduler.add(NewSequence {
//!     id: SeqId(7), prompt, max_new_tokens: 4, arrival: Instant::now(), turn_boundary: None,
//! })?;
//! let mut streamed = Vec::new();
//! while !scheduler.is_idle() {
//!     let plan = scheduler.schedule(Instant::now());
//!     let step = plan.flatten(); // + plan.block_tables: the model step's input
//!     let sampled: Vec<u32> = step.logit_rows.iter().map(|&row| step.tokens[row] + 1).collect();
//!     let results: Vec<(SeqId, u32)> = step.logit_seqs.iter().copied().zip(sampled).collect();
//!     streamed.extend(scheduler.complete_step(&results, Instant::now())?);
//! }
//! assert_eq!(streamed.iter().map(|e| e.token).collect::<Vec<_>>(), [4, 5, 6, 7]);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
#![forbid(unsafe_code)]
#![deny(missing_docs)]

mod complete;
mod config;
mod plan;
mod request;
mod schedule;
mod scheduler;
mod sequence;

pub use config::{ConfigError, Policy, SchedulerConfig};
pub use plan::{FlatStep, PlanItem, SchedulerStats, StepPlan, TokenEvent};
pub use request::{FinishReason, Finished, NewSequence, Rejected, SeqId, StepError};
pub use scheduler::Scheduler;

/// Re-exported so that callers can name the plan's block tables, the pool, the prefix-cache key,
/// the state slots and the snapshot pool without depending on the cache crate themselves.
pub use metrale_cache::{BlockPool, BlockTable, PrefixKey, SnapshotPool, StateSlot};
