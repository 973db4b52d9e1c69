// SPDX-License-Identifier: MIT OR Apache-2.0
//! Tool calls and reasoning out of model output text, whole or streamed.
//!
//! This crate owns the step from the text a model generated to the OpenAI shapes a client sees:
//! ordinary content, `tool_calls` ([`ToolCall`]) and `reasoning_content` ([`ReasoningSplitter`]).
//! It must never load a model, tokenize, or do I/O: the server hands it text and gets events back.
//!
//! The central design decision is that streaming is whole parsing cut into pieces: every decision
//! a parser takes is taken only once the text seen so far fixes it, whatever follows. Hence text
//! that could still become a marker (`<tool_`, `[TOOL_C`, `<thi`) is held back like a stop string,
//! and a tool call is emitted only once its region has ended (its closing tag, the end of its JSON
//! value, or the end of the output). The consequence, checked by the conformance suite, is that
//! [`parse_whole`] and any chunking of the same text through [`ToolParser::push`] fold to the same
//! content and calls. The cost is latency: a call's arguments arrive in one delta when the call
//! closes, not token by token.
//!
//! Malformed output the book lists as recoverable is repaired (a missing closing tag or brace at
//! the end of the output, arguments given as a JSON string, trailing commas, a single call where a
//! list was expected, markdown fences, a literal `</tool_call>` inside a JSON string, a missing
//! `</parameter>`, an empty `{}` body). Output that cannot be repaired comes back verbatim as
//! [`ParseEvent::Text`]: a parser never panics and never drops text it does not understand.
#![forbid(unsafe_code)]
#![deny(missing_docs)]

mod driver;
mod json;
mod reasoning;
mod text;
mod wire;

use std::str::FromStr;

pub use reasoning::{ReasoningEvent, ReasoningSplitter, ThinkStart};

/// One complete tool call, as OpenAI's `tool_calls[i]` carries it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolCall {
    /// `call_` followed by the call's index in the output, zero-padded to 8 digits. Unique within
    /// one output only: a server that needs ids unique across a conversation rewrites them.
    pub id: String,
    /// The function's name, as the model wrote it.
    pub name: String,
    /// The arguments as compact JSON text (an object unless the model wrote another JSON value).
    pub arguments: String,
}

/// One step of a streamed parse. For each call, in index order: one `ToolCallStart`, then
/// `ToolCallArguments` deltas whose concatenation is the call's JSON arguments, then one
/// `ToolCallEnd`. `Text` may come between calls.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ParseEvent {
    /// Ordinary content, outside any tool call.
    Text(String),
    /// A call begins; `index` counts calls from 0 in this output.
    ToolCallStart {
        /// Position of the call in this output.
        index: usize,
        /// See [`ToolCall::id`].
        id: String,
        /// The function's name.
        name: String,
    },
    /// A piece of the call's JSON arguments text.
    ToolCallArguments {
        /// Position of the call in this output.
        index: usize,
        /// Text to append to the call's arguments.
        delta: String,
    },
    /// The call is complete.
    ToolCallEnd {
        /// Position of the call in this output.
        index: usize,
    },
}

/// A streaming tool-call parser for one output. Feed it the text as it is generated, then call
/// [`ToolParser::finish`] once at the end.
pub trait ToolParser {
    /// Takes the next piece of output; returns what that piece (with what was held back) decides.
    fn push(&mut self, chunk: &str) -> Vec<ParseEvent>;
    /// The output has ended: flushes held-back text and closes an unterminated call if it can.
    fn finish(&mut self) -> Vec<ParseEvent>;
}

/// A tool-call wire format, named as `--tool-call-parser` names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Format {
    /// `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, possibly several.
    Hermes,
    /// `<tool_call><function=NAME><parameter=KEY>value</parameter></function></tool_call>`.
    Qwen3Coder,
    /// The Qwen3 XML variant: the same wire syntax as [`Format::Qwen3Coder`].
    Qwen3Xml,
    /// `[TOOL_CALLS][{"name": ..., "arguments": {...}}]`, or `[TOOL_CALLS]NAME[ARGS]{...}`.
    Mistral,
    /// `{"name": ..., "parameters": {...}}` at the start of the output or after `<|python_tag|>`,
    /// several separated by `;`.
    Llama3Json,
    /// An unwrapped JSON call object (or a list of them) as the whole output, maybe fenced.
    BareJson,
}

impl Format {
    /// Every format this crate parses.
    pub const ALL: [Format; 6] = [
        Format::Hermes,
        Format::Qwen3Coder,
        Format::Qwen3Xml,
        Format::Mistral,
        Format::Llama3Json,
        Format::BareJson,
    ];

    /// The book's name for the format (`hermes`, `qwen3_coder`, ...).
    pub fn name(self) -> &'static str {
        match self {
            Format::Hermes => "hermes",
            Format::Qwen3Coder => "qwen3_coder",
            Format::Qwen3Xml => "qwen3_xml",
            Format::Mistral => "mistral",
            Format::Llama3Json => "llama3_json",
            Format::BareJson => "bare_json",
        }
    }
}

/// A tool-call parser name this crate does not know.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "unknown tool-call parser `{0}`; known: hermes, qwen3_coder, qwen3_xml, mistral, llama3_json, bare_json"
)]
pub struct UnknownFormat(pub String);

impl FromStr for Format {
    type Err = UnknownFormat;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Format::ALL
            .into_iter()
            .find(|f| f.name() == s)
            .ok_or_else(|| UnknownFormat(s.to_owned()))
    }
}

impl std::fmt::Display for Format {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A fresh streaming parser for one output in `format` (`Send`, so a server can keep it in the
/// state of a response stream).
pub fn parser_for(format: Format) -> Box<dyn ToolParser + Send> {
    match format {
        Format::Hermes => Box::new(driver::Driver::new(wire::Hermes)),
        Format::Qwen3Coder | Format::Qwen3Xml => Box::new(driver::Driver::new(wire::Qwen3Xml)),
        Format::Mistral => Box::new(driver::Driver::new(wire::Mistral)),
        Format::Llama3Json => Box::new(driver::Driver::new(wire::Llama3Json)),
        Format::BareJson => Box::new(driver::Driver::new(wire::BareJson)),
    }
}

/// A whole output's content and calls.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Parsed {
    /// Every [`ParseEvent::Text`], concatenated.
    pub content: String,
    /// The calls, in index order.
    pub tool_calls: Vec<ToolCall>,
}

impl Parsed {
    /// Folds one event in; events must come in the order a [`ToolParser`] emits them.
    pub fn apply(&mut self, event: ParseEvent) {
        match event {
            ParseEvent::Text(t) => self.content.push_str(&t),
            ParseEvent::ToolCallStart { index, id, name } => {
                debug_assert_eq!(index, self.tool_calls.len());
                self.tool_calls.push(ToolCall {
                    id,
                    name,
                    arguments: String::new(),
                });
            }
            ParseEvent::ToolCallArguments { index, delta } => {
                if let Some(call) = self.tool_calls.get_mut(index) {
                    call.arguments.push_str(&delta);
                }
            }
            ParseEvent::ToolCallEnd { .. } => {}
        }
    }
}

/// Parses a whole output: `push(text)` then `finish()` on a fresh parser, folded.
pub fn parse_whole(format: Format, text: &str) -> Parsed {
    let mut parser = parser_for(format);
    let mut parsed = Parsed::default();
    for event in parser.push(text).into_iter().chain(parser.finish()) {
        parsed.apply(event);
    }
    parsed
}
