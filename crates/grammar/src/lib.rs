// SPDX-License-Identifier: MIT OR Apache-2.0
//! Grammar-constrained decoding: which tokens may come next.
//!
//! This crate owns the book's constrained-decoding step: a grammar (a JSON schema, "any JSON
//! object", a regex, a Lark grammar, or the tool-call wire format a model was trained on) is
//! compiled once per tokenizer, and each request then walks it one token at a time, getting a
//! bitmask of the tokens that keep the output valid. It never does I/O, never samples, and never
//! touches a GPU: the server hands it token ids and gets masks back.
//!
//! The central decision (DESIGN.md section 8) is to use `llguidance` rather than write a grammar
//! engine: it compiles JSON schemas and Lark grammars to an Earley parser over a lazily built
//! lexer DFA and walks the vocabulary's token trie per step, which is XGrammar's role in the book
//! at a comparable per-token cost. What this crate adds is the part that is ours:
//!
//! - **The vocabulary as bytes** ([`GrammarEngine::new`]): each id of the model's vocabulary is
//!   given the bytes it decodes to, read from our tokenizer (byte-level BPE inverted through the
//!   GPT-2 byte map, SentencePiece `<0xNN>` and `▁`). Special tokens (`<|im_end|>`) are spelled
//!   the way toktrie marks them, `0xFF` followed by their text, so plain text can never produce
//!   them; ids past the tokenizer's vocabulary (embedding padding) have no bytes and are never
//!   allowed.
//! - **One compile per grammar** ([`GrammarEngine::compile`]): compiled grammars are cached by
//!   their spec (LRU, 256 entries), and the first step's mask is computed at compile time, so a
//!   schema that cannot be compiled fails there (the server's HTTP 400) and not mid-generation.
//! - **Forced text in the model's own tokens**: where the grammar leaves no choice (a fixed
//!   key, a closing tag), llguidance allows only the tokenizer's own tokenization of the forced
//!   text, which keeps the model on token sequences it was trained on (byte-level vocabularies;
//!   for SentencePiece ones every spelling stays allowed).
//! - **End of sequence as a grammar fact** ([`Matcher`]): the model's EOS tokens are allowed
//!   exactly when the output so far is a complete sentence of the grammar.
//! - **Tool calls in the model's own wire format** ([`GrammarSpec::tool_calls`]): hermes,
//!   qwen3_coder/qwen3_xml, mistral, llama3_json and bare_json, each written so that
//!   `metrale-toolcall` parses it back to the calls it stands for, with every call's arguments
//!   constrained by its tool's JSON schema.
//!
//! Compiled grammars are shared (`Arc`, `Send + Sync`); a [`Matcher`] is one request's state.
#![forbid(unsafe_code)]
#![deny(missing_docs)]

mod cache;
mod engine;
mod error;
mod matcher;
mod spec;
mod toolcall;
mod vocab;

pub use engine::{CompiledGrammar, GrammarEngine};
pub use error::GrammarError;
pub use matcher::Matcher;
pub use spec::GrammarSpec;
pub use toolcall::{ToolCallGrammar, ToolChoiceMode, ToolSpec, ToolWire};

/// The sharing the server relies on: one engine and its grammars across threads, each request's
/// matcher moved to whichever thread runs the step.
const _: () = {
    const fn shared<T: Send + Sync>() {}
    const fn movable<T: Send>() {}
    shared::<GrammarEngine>();
    shared::<CompiledGrammar>();
    movable::<Matcher>();
};
