// SPDX-License-Identifier: MIT OR Apache-2.0
//! Sampling: one sequence's next token from its f32 logits, on the CPU.
//!
//! This crate owns the path from a row of logits to a token id: the request's knobs
//! ([`SamplingParams`], checked once by [`SamplingParams::validate`]), and the per-sequence state
//! that applies them ([`Sampler`]: logit bias, repetition, presence and frequency penalties,
//! temperature, top-k, top-p, min-p, and a seeded draw, optionally restricted to an allowed-token
//! bitset, which is how a grammar's mask reaches it: [`Sampler::sample_allowed`]). It must never
//! touch a GPU, do I/O (it reads the clock only to seed a sampler given no seed), or know a model,
//! a tokenizer or a grammar: the engine hands it logits (and a mask) and gets a token back. A
//! greedy sequence whose argmax ran on the device only reports its token through
//! [`Sampler::record`].
//!
//! The central design decision is reproducibility: a seed names one token sequence on every
//! platform and toolchain. Hence the crate's own generator ([`rng`]), its own exponential instead
//! of the platform libm's, and a canonical (ascending-id) order for the candidates a random
//! number walks, whatever order the selections and sorts left them in.
//!
//! Cost for a vocabulary of ~150k: a few linear passes (temper, weigh, draw), a linear selection
//! over integer keys for top-k or for the nucleus (a full sort only when the nucleus is most of
//! the vocabulary), and no allocation per step once the scratch has grown.
#![forbid(unsafe_code)]
#![deny(missing_docs)]

mod filters;
mod mask;
mod params;
mod penalties;
pub mod rng;
mod sampler;
mod softmax;

pub use params::{SamplingError, SamplingParams};
pub use sampler::Sampler;
