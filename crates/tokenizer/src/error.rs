// SPDX-License-Identifier: MIT OR Apache-2.0
//! Errors that say what was wrong and, where the user can act, what to do.

use std::path::PathBuf;

/// What can go wrong loading a tokenizer, tokenizing, or rendering a chat template.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// A file cannot be read.
    #[error("{path}: {message}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        message: String,
    },
    /// A Hugging Face tokenizer file is malformed or describes something this crate cannot load.
    #[error("{path}: {message}")]
    Format {
        /// The file.
        path: PathBuf,
        /// What is wrong and what to do.
        message: String,
    },
    /// A GGUF file's tokenizer metadata is missing, malformed or unsupported.
    #[error("GGUF tokenizer metadata: {0}")]
    Gguf(String),
    /// Encoding text failed inside the tokenizer.
    #[error("encoding failed: {0}")]
    Encode(String),
    /// Decoding ids failed inside the tokenizer.
    #[error("decoding failed: {0}")]
    Decode(String),
    /// A token id is not in the vocabulary.
    #[error(
        "token id {id} is outside the vocabulary ({vocab_size} tokens): the ids do not come from \
         this tokenizer's model"
    )]
    UnknownId {
        /// The offending id.
        id: u32,
        /// Number of ids the tokenizer knows, added tokens included.
        vocab_size: usize,
    },
    /// The chat template does not parse.
    #[error("the chat template does not compile: {0}")]
    TemplateSyntax(String),
    /// Rendering the chat template failed (an undefined method, a type error, ...).
    #[error("rendering the chat template failed: {0}")]
    TemplateRender(String),
    /// The template called `raise_exception(message)`: it refuses these messages or options.
    #[error("the chat template rejected the conversation: {message}")]
    TemplateRaised {
        /// The message the template passed to `raise_exception`.
        message: String,
    },
}
