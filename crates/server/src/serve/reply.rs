// SPDX-License-Identifier: MIT OR Apache-2.0
//! From a chat answer's generated text to its parts: reasoning, content and tool calls.
//!
//! Both APIs, streamed or not, go through one [`ReplyStream`] per choice: the streamed routes push
//! each text delta as the engine sends it; the non-streamed ones push the whole text once and fold
//! the events into a [`Reply`]. The toolcall crate decides only what the text seen so far fixes,
//! so every chunking of one text folds to the same reply. That is why a greedy stream, folded by a
//! client, equals the non-streamed answer (reasoning, content and tool calls), ids included: a
//! call's id depends only on the request id, the choice and the call's index.
//!
//! The API shapes live here too, as pure functions over the events, so that the streamed and the
//! non-streamed answers are built from the same steps and can be tested without a model: OpenAI
//! chunk deltas ([`ChatChoiceStream`]) and Anthropic content blocks ([`BlockWriter`]).

use metrale_toolcall::{
    Format, ParseEvent, ReasoningEvent, ReasoningSplitter, ThinkStart, ToolCall, ToolParser,
    parser_for,
};
use serde_json::{Value, json};

/// How one choice's text is read.
#[derive(Clone, Debug, Default)]
pub struct ReplyShape {
    /// Parse tool calls in this wire format (the request offered tools and allows calls).
    pub tool_parser: Option<Format>,
    /// Split `<think>` reasoning off, starting inside a block when the template opened one.
    pub think: Option<ThinkStart>,
    /// A call's id is this prefix followed by the call's index in the choice.
    pub call_id_prefix: String,
}

/// Where the output starts relative to a `<think>` block, from the rendered prompt: inside when
/// the template's generation prompt ends by opening one.
pub fn think_start(prompt_text: &str) -> ThinkStart {
    if prompt_text.trim_end().ends_with("<think>") {
        ThinkStart::InsideThink
    } else {
        ThinkStart::Outside
    }
}

/// The id prefix of the calls of choice `choice` out of `n` in the response `request_id`
/// (`chatcmpl-…`, `msg_…`): `{kind}_{suffix}_` where the suffix is the request id after its first
/// `-` or `_`, with `{choice}_` added when there are several choices. Ids are thus unique within a
/// response and across responses of one server (request ids are).
pub fn call_id_prefix(kind: &str, request_id: &str, choice: usize, n: usize) -> String {
    let suffix = request_id
        .split_once(['-', '_'])
        .map_or(request_id, |(_, s)| s);
    if n > 1 {
        format!("{kind}_{suffix}_{choice}_")
    } else {
        format!("{kind}_{suffix}_")
    }
}

/// One step of a reply, in output order. For each call: one `ToolCallStart`, then
/// `ToolCallArguments` whose concatenation is its JSON arguments, then one `ToolCallEnd`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ReplyEvent {
    /// Reasoning text (`reasoning_content`, a thinking block).
    Reasoning(String),
    /// Ordinary content.
    Content(String),
    /// A call begins.
    ToolCallStart {
        /// Position of the call in this choice.
        index: usize,
        /// The call's id (see [`ReplyShape::call_id_prefix`]).
        id: String,
        /// The function's name.
        name: String,
    },
    /// A piece of the call's JSON arguments.
    ToolCallArguments {
        /// Position of the call in this choice.
        index: usize,
        /// Text to append to the arguments.
        delta: String,
    },
    /// The call is complete.
    ToolCallEnd {
        /// Position of the call in this choice.
        index: usize,
    },
}

/// Reads one choice's text as it streams: the reasoning splitter first, then the tool-call parser
/// over the content it lets through.
pub struct ReplyStream {
    splitter: Option<ReasoningSplitter>,
    parser: Option<Box<dyn ToolParser + Send>>,
    call_id_prefix: String,
    calls: usize,
}

impl ReplyStream {
    /// A reader for one choice.
    pub fn new(shape: &ReplyShape) -> Self {
        ReplyStream {
            splitter: shape.think.map(ReasoningSplitter::new),
            parser: shape.tool_parser.map(parser_for),
            call_id_prefix: shape.call_id_prefix.clone(),
            calls: 0,
        }
    }

    /// Takes the next piece of generated text; returns what it decides.
    pub fn push(&mut self, text: &str) -> Vec<ReplyEvent> {
        let mut out = Vec::new();
        match self.splitter.as_mut() {
            Some(s) => {
                let pieces = s.push(text);
                self.route(pieces, &mut out);
            }
            None => self.content(text, &mut out),
        }
        out
    }

    /// The text has ended: flushes what was held back and closes an unterminated call.
    pub fn finish(&mut self) -> Vec<ReplyEvent> {
        let mut out = Vec::new();
        if let Some(s) = self.splitter.as_mut() {
            let pieces = s.finish();
            self.route(pieces, &mut out);
        }
        if let Some(p) = self.parser.as_mut() {
            let events = p.finish();
            self.parsed(events, &mut out);
        }
        out
    }

    /// Whether any tool call was emitted so far.
    pub fn made_calls(&self) -> bool {
        self.calls > 0
    }

    fn route(&mut self, pieces: Vec<ReasoningEvent>, out: &mut Vec<ReplyEvent>) {
        for piece in pieces {
            match piece {
                ReasoningEvent::Reasoning(r) => out.push(ReplyEvent::Reasoning(r)),
                ReasoningEvent::Content(c) => self.content(&c, out),
            }
        }
    }

    fn content(&mut self, text: &str, out: &mut Vec<ReplyEvent>) {
        match self.parser.as_mut() {
            Some(p) => {
                let events = p.push(text);
                self.parsed(events, out);
            }
            None if text.is_empty() => {}
            None => out.push(ReplyEvent::Content(text.to_owned())),
        }
    }

    fn parsed(&mut self, events: Vec<ParseEvent>, out: &mut Vec<ReplyEvent>) {
        for event in events {
            out.push(match event {
                ParseEvent::Text(t) => ReplyEvent::Content(t),
                ParseEvent::ToolCallStart { index, name, .. } => {
                    self.calls = self.calls.max(index + 1);
                    ReplyEvent::ToolCallStart {
                        index,
                        id: format!("{}{index}", self.call_id_prefix),
                        name,
                    }
                }
                ParseEvent::ToolCallArguments { index, delta } => {
                    ReplyEvent::ToolCallArguments { index, delta }
                }
                ParseEvent::ToolCallEnd { index } => ReplyEvent::ToolCallEnd { index },
            });
        }
    }
}

/// A whole reply: the events of one choice folded.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Reply {
    /// Every reasoning piece, concatenated.
    pub reasoning: String,
    /// Every content piece, concatenated.
    pub content: String,
    /// The calls, in index order.
    pub tool_calls: Vec<ToolCall>,
}

/// Whether a reply that made tool calls ends as a call (`tool_calls` / `tool_use`): yes, unless
/// `max_tokens` cut it, which stays `length` / `max_tokens` as in OpenAI's API, so that a client
/// sees that the output was cut even after complete calls.
pub fn ends_in_calls(made_calls: bool, cut_at_max_tokens: bool) -> bool {
    made_calls && !cut_at_max_tokens
}

impl Reply {
    /// Reads a whole text: one push, then the finish.
    pub fn whole(shape: &ReplyShape, text: &str) -> Reply {
        let mut stream = ReplyStream::new(shape);
        let mut reply = Reply::default();
        for event in stream.push(text).into_iter().chain(stream.finish()) {
            reply.apply(event);
        }
        reply
    }

    /// Folds one event in.
    pub fn apply(&mut self, event: ReplyEvent) {
        match event {
            ReplyEvent::Reasoning(r) => self.reasoning.push_str(&r),
            ReplyEvent::Content(c) => self.content.push_str(&c),
            ReplyEvent::ToolCallStart { id, name, .. } => self.tool_calls.push(ToolCall {
                id,
                name,
                arguments: String::new(),
            }),
            ReplyEvent::ToolCallArguments { index, delta } => {
                if let Some(call) = self.tool_calls.get_mut(index) {
                    call.arguments.push_str(&delta);
                }
            }
            ReplyEvent::ToolCallEnd { .. } => {}
        }
    }

    /// The OpenAI assistant message: `content` (null when calls leave no content), then
    /// `reasoning_content` and `tool_calls` when there are any.
    pub fn openai_message(&self) -> Value {
        let mut message = json!({"role": "assistant", "content": self.content});
        if !self.reasoning.is_empty() {
            message["reasoning_content"] = self.reasoning.clone().into();
        }
        if !self.tool_calls.is_empty() {
            if self.content.trim().is_empty() {
                message["content"] = Value::Null;
            }
            message["tool_calls"] = self
                .tool_calls
                .iter()
                .map(|c| json!({"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}))
                .collect::<Vec<_>>()
                .into();
        }
        message
    }
}

/// One streamed OpenAI chat choice: text deltas in, `choices[]` entries out.
pub struct ChatChoiceStream {
    index: usize,
    reply: ReplyStream,
}

impl ChatChoiceStream {
    /// The stream of choice `index`.
    pub fn new(index: usize, shape: &ReplyShape) -> Self {
        ChatChoiceStream {
            index,
            reply: ReplyStream::new(shape),
        }
    }

    /// The choice entries for one engine delta. `logprobs` (the delta's, or null) rides on the
    /// first entry; a delta that decides nothing but carries log-probabilities still gets one
    /// entry (with empty content), so that no token's log-probability is lost.
    pub fn delta(&mut self, text: &str, logprobs: Value) -> Vec<Value> {
        let events = self.reply.push(text);
        let mut entries = self.entries(events);
        if entries.is_empty() && !logprobs.is_null() {
            entries.push(self.entry(json!({"content": ""})));
        }
        if let Some(first) = entries.first_mut() {
            first["logprobs"] = logprobs;
        }
        entries
    }

    /// The entries that end the choice: what was held back, then the one with `finish_reason`
    /// (`tool_calls` when the choice ends in calls, [`ends_in_calls`], else `finish`).
    pub fn done(&mut self, finish: Value) -> Vec<Value> {
        let events = self.reply.finish();
        let mut entries = self.entries(events);
        let reason = if ends_in_calls(self.reply.made_calls(), finish == "length") {
            "tool_calls".into()
        } else {
            finish
        };
        let mut last = self.entry(json!({}));
        last["finish_reason"] = reason;
        entries.push(last);
        entries
    }

    fn entry(&self, delta: Value) -> Value {
        json!({"index": self.index, "delta": delta, "logprobs": null, "finish_reason": null})
    }

    /// One entry per event, adjacent text of one channel merged; a call's end adds nothing.
    fn entries(&self, events: Vec<ReplyEvent>) -> Vec<Value> {
        let mut deltas: Vec<Value> = Vec::new();
        for event in events {
            let (key, text) = match event {
                ReplyEvent::Reasoning(t) => ("reasoning_content", t),
                ReplyEvent::Content(t) => ("content", t),
                ReplyEvent::ToolCallStart { index, id, name } => {
                    deltas.push(
                        json!({"tool_calls": [{"index": index, "id": id, "type": "function",
                        "function": {"name": name, "arguments": ""}}]}),
                    );
                    continue;
                }
                ReplyEvent::ToolCallArguments { index, delta } => {
                    deltas.push(
                        json!({"tool_calls": [{"index": index, "function": {"arguments": delta}}]}),
                    );
                    continue;
                }
                ReplyEvent::ToolCallEnd { .. } => continue,
            };
            match deltas.last_mut().and_then(|d| d.get_mut(key)) {
                Some(Value::String(prev)) => prev.push_str(&text),
                _ => deltas.push(json!({key: text})),
            }
        }
        deltas.into_iter().map(|d| self.entry(d)).collect()
    }
}

/// One step of an Anthropic answer's content blocks.
#[derive(Clone, Debug, PartialEq)]
pub enum BlockOp {
    /// `content_block_start`.
    Start {
        /// Block index.
        index: usize,
        /// The block as it starts (empty text, empty thinking, a tool_use with empty input).
        block: Value,
    },
    /// `content_block_delta`.
    Delta {
        /// Block index.
        index: usize,
        /// `text_delta`, `thinking_delta` or `input_json_delta`.
        delta: Value,
    },
    /// `content_block_stop`.
    Stop {
        /// Block index.
        index: usize,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum BlockKind {
    Thinking,
    Text,
    ToolUse,
}

/// Turns reply events into Anthropic content blocks: thinking for reasoning, text for content,
/// tool_use for each call; a block opens with its first event and closes when another kind
/// starts (a call closes at its end).
#[derive(Debug, Default)]
pub struct BlockWriter {
    open: Option<(usize, BlockKind)>,
    next: usize,
}

impl BlockWriter {
    /// The block steps for `events`.
    pub fn apply(&mut self, events: Vec<ReplyEvent>) -> Vec<BlockOp> {
        let mut ops = Vec::new();
        for event in events {
            match event {
                ReplyEvent::Reasoning(t) => {
                    let index = self.ensure(
                        BlockKind::Thinking,
                        json!({"type": "thinking", "thinking": "", "signature": ""}),
                        &mut ops,
                    );
                    ops.push(BlockOp::Delta {
                        index,
                        delta: json!({"type": "thinking_delta", "thinking": t}),
                    });
                }
                ReplyEvent::Content(t) => {
                    let index = self.ensure(
                        BlockKind::Text,
                        json!({"type": "text", "text": ""}),
                        &mut ops,
                    );
                    ops.push(BlockOp::Delta {
                        index,
                        delta: json!({"type": "text_delta", "text": t}),
                    });
                }
                ReplyEvent::ToolCallStart { id, name, .. } => {
                    self.close(&mut ops);
                    self.ensure(
                        BlockKind::ToolUse,
                        json!({"type": "tool_use", "id": id, "name": name, "input": {}}),
                        &mut ops,
                    );
                }
                ReplyEvent::ToolCallArguments { delta, .. } => {
                    if let Some((index, BlockKind::ToolUse)) = self.open {
                        ops.push(BlockOp::Delta {
                            index,
                            delta: json!({"type": "input_json_delta", "partial_json": delta}),
                        });
                    }
                }
                ReplyEvent::ToolCallEnd { .. } => self.close(&mut ops),
            }
        }
        ops
    }

    /// The answer has ended: closes the open block; an answer with no block gets one empty text
    /// block, so that every answer has content.
    pub fn finish(&mut self) -> Vec<BlockOp> {
        let mut ops = Vec::new();
        if self.next == 0 {
            self.ensure(
                BlockKind::Text,
                json!({"type": "text", "text": ""}),
                &mut ops,
            );
        }
        self.close(&mut ops);
        ops
    }

    fn ensure(&mut self, kind: BlockKind, block: Value, ops: &mut Vec<BlockOp>) -> usize {
        match self.open {
            Some((index, open)) if open == kind => index,
            _ => {
                self.close(ops);
                let index = self.next;
                self.next += 1;
                self.open = Some((index, kind));
                ops.push(BlockOp::Start { index, block });
                index
            }
        }
    }

    fn close(&mut self, ops: &mut Vec<BlockOp>) {
        if let Some((index, _)) = self.open.take() {
            ops.push(BlockOp::Stop { index });
        }
    }
}

/// Folds block steps into the `content` array, as Anthropic's SDKs accumulate a stream: deltas
/// append to the block's text or thinking; a tool_use block's `partial_json` pieces are parsed
/// into its `input` when it stops (`{}` when there were none).
pub fn fold_blocks(ops: &[BlockOp]) -> Vec<Value> {
    let mut blocks: Vec<Value> = Vec::new();
    let mut json_text: Vec<String> = Vec::new();
    for op in ops {
        match op {
            BlockOp::Start { block, .. } => {
                blocks.push(block.clone());
                json_text.push(String::new());
            }
            BlockOp::Delta { index, delta } => {
                let (Some(block), Some(partial)) =
                    (blocks.get_mut(*index), json_text.get_mut(*index))
                else {
                    continue;
                };
                let piece = |key: &str| delta[key].as_str().unwrap_or_default().to_owned();
                match delta["type"].as_str() {
                    Some("text_delta") => append(&mut block["text"], &piece("text")),
                    Some("thinking_delta") => append(&mut block["thinking"], &piece("thinking")),
                    Some("input_json_delta") => partial.push_str(&piece("partial_json")),
                    _ => {}
                }
            }
            BlockOp::Stop { index } => {
                let (Some(block), Some(partial)) = (blocks.get_mut(*index), json_text.get(*index))
                else {
                    continue;
                };
                if block["type"] == "tool_use" && !partial.is_empty() {
                    block["input"] = serde_json::from_str(partial)
                        .unwrap_or_else(|_| Value::String(partial.clone()));
                }
            }
        }
    }
    blocks
}

fn append(field: &mut Value, text: &str) {
    let mut s = field.as_str().unwrap_or_default().to_owned();
    s.push_str(text);
    *field = s.into();
}

#[cfg(test)]
mod tests;
