// SPDX-License-Identifier: MIT OR Apache-2.0
//! Weight files, read into BF16 host tensors under their Hugging Face names.
//!
//! The central decision: **every format answers the same question** — "give me tensor `name` (an HF
//! name such as `model.layers.0.self_attn.q_proj.weight`) as BF16 with its HF shape" — through
//! [`WeightSource`]. Safetensors checkpoints answer it directly (memory-mapped, sharded through
//! `model.safetensors.index.json`); GGUF files answer it by mapping the name to llama.cpp's, then
//! dequantising and undoing the Q/K row permutation llama.cpp's converter applied. Shapes are known
//! from headers alone, so a loader checks every shape against the config before reading any data.
//!
//! This crate reads files; it never touches a GPU.

mod dequant;
mod error;
pub mod fp8;
pub mod gguf;
mod safetensors_source;

pub use error::WeightError;
pub use fp8::{FP8_BLOCK, Fp8Scales, Fp8Scheme, Fp8Tensor};
pub use gguf::GgufFile;
pub use safetensors_source::SafetensorsCheckpoint;

use half::bf16;

/// A tensor in host memory, BF16, row-major, in its HF shape (`[out, in]` for linear weights).
#[derive(Clone, Debug, PartialEq)]
pub struct HostTensor {
    /// Dimensions, outermost first.
    pub shape: Vec<usize>,
    /// Row-major elements.
    pub data: Vec<bf16>,
}

/// Tensors by HF name, whatever the file format.
pub trait WeightSource: Send + Sync {
    /// The HF shape of `name`, or `None` if the source has no such tensor. Reads headers only.
    fn shape(&self, name: &str) -> Option<Vec<usize>>;
    /// Reads `name` as BF16. Errors name the file and the tensor.
    fn load(&self, name: &str) -> Result<HostTensor, WeightError>;
    /// Reads `name` as f32 with its shape: exactly what the file holds for an F32, BF16 or F16
    /// tensor (a value the kernels read in f32, such as a router's correction bias, must not pass
    /// through BF16). The default widens [`WeightSource::load`]'s BF16.
    fn load_f32(&self, name: &str) -> Result<(Vec<usize>, Vec<f32>), WeightError> {
        let t = self.load(name)?;
        Ok((t.shape, t.data.into_iter().map(f32::from).collect()))
    }
    /// Whether `name` is stored as FP8 E4M3 (read it with [`WeightSource::load_e4m3`] and its
    /// scale; [`WeightSource::load`] refuses it).
    fn is_e4m3(&self, _name: &str) -> bool {
        false
    }
    /// Reads an FP8 E4M3 tensor's bytes with its shape.
    fn load_e4m3(&self, name: &str) -> Result<(Vec<usize>, Vec<u8>), WeightError> {
        Err(WeightError::Quantization {
            message: format!("{}: `{name}` is not stored as FP8", self.describe()),
        })
    }
    /// A short description for logs (`SmolLM2-135M-Instruct.Q4_1.gguf (GGUF v3)`).
    fn describe(&self) -> String;
}
