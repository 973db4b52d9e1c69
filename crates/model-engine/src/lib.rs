// SPDX-License-Identifier: MIT OR Apache-2.0
//! The model: one generic decoder, its weights on a device, and the step that runs it.
//!
//! The central decision: **an architecture is a parameter point, not a file.** Llama, Qwen2 and
//! Qwen3 differ only in flags of [`metrale_config::ModelConfig`] (QKV bias, QK-norm, tied
//! embeddings, RoPE scaling) and share one weight-name map ([`weights::TensorRole`]) and one
//! forward pass ([`model::Model::forward`]). Adding a model of a known shape is a config mapping,
//! not a new forward pass.
//!
//! Everything here runs through `&dyn GpuBackend`: the same code drives the CUDA, host and mock
//! backends. No file I/O: weights come from a `metrale_model_weights::WeightSource`.
#![forbid(unsafe_code)]

pub mod generate;
pub mod model;
mod profile;
pub mod rope;
pub mod weights;

pub use model::{Model, ModelError, ModelOptions, StepInput};
pub use weights::{LoadProgress, TensorRole, expected_tensors};
