// SPDX-License-Identifier: MIT OR Apache-2.0
//! `<think>...</think>` reasoning split from content, whole or streamed.
//!
//! Rules (book, "Reasoning / `<think>` blocks" and "Known pitfalls"):
//! - a `<think>` opened by the chat template is announced with [`ThinkStart::InsideThink`];
//! - an empty block (`<think>\n\n</think>\n\n`, as a template forcing thinking off writes it)
//!   produces no reasoning and no content: whitespace at the edges of a block, and right after
//!   `</think>`, is dropped;
//! - a missing `</think>` at the end means everything after `<think>` was reasoning;
//! - a `<think>` the model emits mid-stream opens a block wherever it appears.
//!
//! Marker prefixes are held back, so a partial `<thi` never leaks into either channel.

use crate::text::{TextChannel, held_suffix_len};

const OPEN: &str = "<think>";
const CLOSE: &str = "</think>";

/// Where the output starts relative to a `<think>` block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ThinkStart {
    /// The output starts as content; a `<think>` in it opens reasoning.
    Outside,
    /// The chat template already wrote `<think>`: the output starts as reasoning.
    InsideThink,
}

/// One piece of split output.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReasoningEvent {
    /// Reasoning text (`reasoning_content`).
    Reasoning(String),
    /// Ordinary content.
    Content(String),
}

/// Splits one output's text into reasoning and content as it streams.
#[derive(Debug)]
pub struct ReasoningSplitter {
    buf: String,
    inside: bool,
    reasoning: TextChannel,
    content: TextChannel,
}

impl ReasoningSplitter {
    /// A splitter for one output starting at `start`.
    pub fn new(start: ThinkStart) -> Self {
        ReasoningSplitter {
            buf: String::new(),
            inside: start == ThinkStart::InsideThink,
            reasoning: TextChannel::at_segment_start(),
            content: TextChannel::default(),
        }
    }

    /// Whether the output is inside a reasoning block at this point (what was pushed so far).
    pub fn in_reasoning(&self) -> bool {
        self.inside
    }

    /// Takes the next piece of output; returns what it decides.
    pub fn push(&mut self, chunk: &str) -> Vec<ReasoningEvent> {
        self.buf.push_str(chunk);
        let mut out = Vec::new();
        self.step(false, &mut out);
        out
    }

    /// The output has ended: flushes what was held back (as reasoning if a block is still open).
    pub fn finish(&mut self) -> Vec<ReasoningEvent> {
        let mut out = Vec::new();
        self.step(true, &mut out);
        let reasoning = self.reasoning.finish().map(ReasoningEvent::Reasoning);
        let content = self.content.finish().map(ReasoningEvent::Content);
        out.extend(reasoning.into_iter().chain(content));
        out
    }

    /// Splits a whole output: `(reasoning, content)`.
    pub fn split_whole(start: ThinkStart, text: &str) -> (String, String) {
        let mut splitter = ReasoningSplitter::new(start);
        let (mut reasoning, mut content) = (String::new(), String::new());
        for event in splitter.push(text).into_iter().chain(splitter.finish()) {
            match event {
                ReasoningEvent::Reasoning(r) => reasoning.push_str(&r),
                ReasoningEvent::Content(c) => content.push_str(&c),
            }
        }
        (reasoning, content)
    }

    fn emit(&mut self, text: &str, out: &mut Vec<ReasoningEvent>) {
        let event = if self.inside {
            self.reasoning.push(text).map(ReasoningEvent::Reasoning)
        } else {
            self.content.push(text).map(ReasoningEvent::Content)
        };
        out.extend(event);
    }

    fn step(&mut self, at_end: bool, out: &mut Vec<ReasoningEvent>) {
        loop {
            let marker = if self.inside { CLOSE } else { OPEN };
            match self.buf.find(marker) {
                Some(at) => {
                    let before = self.buf[..at].to_owned();
                    self.emit(&before, out);
                    self.buf.drain(..at + marker.len());
                    if self.inside {
                        self.reasoning.end_segment();
                        self.content.start_segment();
                    } else {
                        self.reasoning.start_segment();
                    }
                    self.inside = !self.inside;
                }
                None => {
                    let held = if at_end {
                        0
                    } else {
                        held_suffix_len(&self.buf, &[marker])
                    };
                    let ready: String = self.buf.drain(..self.buf.len() - held).collect();
                    self.emit(&ready, out);
                    return;
                }
            }
        }
    }
}
