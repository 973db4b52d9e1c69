// SPDX-License-Identifier: MIT OR Apache-2.0
//! What can go wrong, said so that the person who caused it can fix it.

/// An error from building the engine, compiling a grammar or walking it.
///
/// `Invalid` and `Tools` are the caller's input (the server answers them with HTTP 400); the
/// engine-setup variants are the model's files; `TokenNotAllowed` and `Matcher` mean the caller
/// fed a token the mask did not allow, or the grammar hit a limit mid-generation.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GrammarError {
    /// The tokenizer's decoder is not one whose tokens map to bytes in a way we know.
    #[error(
        "the tokenizer's decoder ({0}) is neither byte-level BPE nor SentencePiece with byte \
         fallback, so constrained decoding cannot tell which bytes its tokens stand for"
    )]
    UnsupportedTokenizer(String),
    /// The model's vocabulary (embedding rows) is smaller than the tokenizer's.
    #[error(
        "the model's vocabulary has {model} ids but the tokenizer has {tokenizer}; pass the \
         model's vocabulary size (its embedding rows), which is at least the tokenizer's"
    )]
    VocabTooSmall {
        /// The vocabulary size passed in.
        model: usize,
        /// The tokenizer's vocabulary size, added tokens included.
        tokenizer: usize,
    },
    /// The tokenizer names no end-of-sequence token, so no grammar could let generation end.
    #[error(
        "the tokenizer names no end-of-sequence token (and has none of <|endoftext|>, </s>, \
         <|im_end|>, <|eot_id|>, <|end_of_text|>, <eos>), so a grammar could never end the output"
    )]
    NoEosToken,
    /// llguidance could not be set up for this vocabulary.
    #[error("cannot set up constrained decoding for this tokenizer: {0}")]
    Setup(String),
    /// The grammar the caller gave cannot be compiled.
    #[error("invalid {kind}: {message}")]
    Invalid {
        /// What was being compiled: `JSON schema`, `regex`, `Lark grammar`, ...
        kind: &'static str,
        /// Why, as llguidance says it.
        message: String,
    },
    /// The tools or tool choice cannot be turned into a grammar.
    #[error("cannot constrain tool calls: {0}")]
    Tools(String),
    /// A token the current mask does not allow was fed to [`crate::Matcher::advance`].
    #[error("token {token} is not allowed by the grammar at this point of the output")]
    TokenNotAllowed {
        /// The id that was fed.
        token: u32,
    },
    /// The matcher failed mid-generation (a parser limit, or an earlier error it is stuck in).
    #[error("grammar matcher failed: {0}")]
    Matcher(String),
    /// A mask or logits buffer of the wrong length was passed.
    #[error("the {what} has {got} entries but the model's vocabulary needs {expected}")]
    BufferLength {
        /// `mask` (32 ids per word) or `logits` (one per id).
        what: &'static str,
        /// The length the engine's vocabulary needs.
        expected: usize,
        /// The length passed.
        got: usize,
    },
    /// A grammar compiled by one engine was given to another.
    #[error("the grammar was compiled by another engine (for another tokenizer)")]
    ForeignGrammar,
}
