// SPDX-License-Identifier: MIT OR Apache-2.0
//! The model: one generic decoder, its weights on a device, and the step that runs it.
//!
//! The central decision: **a model is a plan of blocks, not a file.** The config gives a typed
//! [`LayerPlan`] (per layer: its blocks, each with its norm, its kind and the kind's parameters);
//! the step walks it, one block module per kind (`blocks/`), every product through one
//! [`linear`](crate::linear) that picks its kernel, the schedule in one [`Tuning`]. Llama, Qwen2
//! and Qwen3 are parameter points of the same two blocks; adding a model of a known shape is a
//! config mapping, a new kind of layer a new block module.
//!
//! Everything here runs through `&dyn GpuBackend`: the same code drives the CUDA, host and mock
//! backends. No file I/O: weights come from a `metrale_model_weights::WeightSource`.
#![forbid(unsafe_code)]

mod ahead;
mod blocks;
pub mod generate;
mod instrument;
mod launch;
mod linear;
pub mod model;
pub mod plan;
mod profile;
mod residual;
pub mod rope;
pub mod tuning;
pub mod weights;

pub use model::{KvCacheScales, Model, ModelError, ModelOptions, StepInput};
pub use plan::LayerPlan;
pub use tuning::{Tuning, TuningError};
pub use weights::{
    LinearFormat, LoadProgress, TensorRole, checkpoint_kv_scales, expected_shape, expected_tensors,
};
