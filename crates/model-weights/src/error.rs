// SPDX-License-Identifier: MIT OR Apache-2.0
//! Errors that name the file and, where there is one, the tensor.

use std::path::PathBuf;

/// What can go wrong reading weights.
#[derive(Debug, thiserror::Error)]
pub enum WeightError {
    /// The file cannot be opened or read.
    #[error("{path}: {message}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        message: String,
    },
    /// The file is not in the expected format, or is cut short.
    #[error("{path}: {message}")]
    Format {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// One tensor is malformed (truncated, unsupported type, bad shape).
    #[error("{path}: tensor `{tensor}`: {message}")]
    Tensor {
        /// The file.
        path: PathBuf,
        /// The tensor (as named in the file).
        tensor: String,
        /// What is wrong.
        message: String,
    },
    /// No file of the checkpoint has the tensor.
    #[error("{source_desc}: no tensor `{name}`")]
    Missing {
        /// The checkpoint.
        source_desc: String,
        /// The HF name asked for.
        name: String,
    },
    /// The checkpoint's quantization is not one the engine runs, or its tensors do not fit it.
    #[error("quantization: {message}")]
    Quantization {
        /// What was found and what is supported.
        message: String,
    },
}
