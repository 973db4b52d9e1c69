// SPDX-License-Identifier: MIT OR Apache-2.0
//! The streaming driver shared by every format: text, held-back marker prefixes, call regions.
//!
//! The driver alternates between three modes. `Start` looks at the beginning of the output (and
//! the text right after a call) for a call that needs no marker, such as a bare JSON object.
//! `Text` passes content through, holding back a suffix that could begin a marker. `Region`
//! buffers a call's text until the format says where it ends; the region is then parsed into
//! calls, or, if it cannot be, emitted verbatim (marker included) as text.
//!
//! Invariant behind whole == streamed: every [`Wire`] answer is stable under appending text (an
//! end found stays found at the same place; "not yet" on a text means "not yet" on its
//! prefixes), so the driver's decisions do not depend on where the chunks were cut.

use crate::json::RawCall;
use crate::text::{TextChannel, find_first, held_suffix_len};
use crate::{ParseEvent, ToolParser};

/// What the start of the output (or the text after a call) says.
pub(crate) enum StartDecision {
    /// Not known yet: wait for more text.
    Undecided,
    /// Ordinary text.
    Text,
    /// A call region starts after `skip` bytes of separators (dropped).
    Call { skip: usize },
}

/// Where a call region ends, in bytes from the region's start (just after its opening marker).
#[derive(Debug, Clone, Copy)]
pub(crate) struct RegionEnd {
    /// The call text: `region[..body]`.
    pub body: usize,
    /// What the region takes, closing marker included: `region[..consumed]`.
    pub consumed: usize,
}

/// One format's syntax, as the driver asks about it.
pub(crate) trait Wire {
    /// Markers that open a call region anywhere in the text.
    const OPENERS: &'static [&'static str];

    /// Whether `text` (the output's start, or what follows a call) opens a call without a marker.
    fn start(&self, _text: &str) -> StartDecision {
        StartDecision::Text
    }

    /// Where the region ends, once the text fixes it.
    fn find_end(&self, region: &str) -> Option<RegionEnd>;

    /// At the end of the output, for a region [`Wire::find_end`] never closed: a weaker end to
    /// try, or `None` to take the whole rest as the call.
    fn fallback_end(&self, _region: &str) -> Option<RegionEnd> {
        None
    }

    /// The calls in a region's body; `None` when it cannot be read as calls (it becomes text),
    /// an empty list for an empty call (dropped).
    fn parse_body(&self, body: &str) -> Option<Vec<RawCall>>;
}

enum Mode {
    Start,
    Text,
    Region { opener: &'static str },
}

/// A [`ToolParser`] for the format `W`.
pub(crate) struct Driver<W> {
    wire: W,
    /// Text received but not yet decided.
    buf: String,
    mode: Mode,
    content: TextChannel,
    calls_emitted: usize,
    out: Vec<ParseEvent>,
}

impl<W: Wire> Driver<W> {
    pub(crate) fn new(wire: W) -> Self {
        Driver {
            wire,
            buf: String::new(),
            mode: Mode::Start,
            content: TextChannel::default(),
            calls_emitted: 0,
            out: Vec::new(),
        }
    }

    fn text(&mut self, text: &str) {
        if let Some(t) = self.content.push(text) {
            self.out.push(ParseEvent::Text(t));
        }
    }

    /// Decides as much of the buffer as the text seen so far allows; everything at the end.
    fn step(&mut self, at_end: bool) {
        loop {
            match self.mode {
                Mode::Start => match self.wire.start(&self.buf) {
                    StartDecision::Undecided if !at_end => return,
                    StartDecision::Undecided => {
                        let separators_only = self
                            .buf
                            .trim_matches(|c: char| c.is_whitespace() || c == ';')
                            .is_empty();
                        if self.calls_emitted > 0 && separators_only {
                            self.buf.clear();
                        }
                        self.mode = Mode::Text;
                    }
                    StartDecision::Text => self.mode = Mode::Text,
                    StartDecision::Call { skip } => {
                        self.buf.drain(..skip);
                        self.mode = Mode::Region { opener: "" };
                    }
                },
                Mode::Text => match find_first(&self.buf, W::OPENERS) {
                    Some((at, opener)) => {
                        let before = self.buf[..at].to_owned();
                        self.text(&before);
                        self.buf.drain(..at + opener.len());
                        self.mode = Mode::Region { opener };
                    }
                    None => {
                        let held = if at_end {
                            0
                        } else {
                            held_suffix_len(&self.buf, W::OPENERS)
                        };
                        let ready: String = self.buf.drain(..self.buf.len() - held).collect();
                        self.text(&ready);
                        return;
                    }
                },
                Mode::Region { opener } => {
                    let end = match self.wire.find_end(&self.buf) {
                        Some(end) => end,
                        None if !at_end => return,
                        None => self.wire.fallback_end(&self.buf).unwrap_or(RegionEnd {
                            body: self.buf.len(),
                            consumed: self.buf.len(),
                        }),
                    };
                    self.close_region(opener, end);
                }
            }
        }
    }

    fn close_region(&mut self, opener: &'static str, end: RegionEnd) {
        let region: String = self.buf.drain(..end.consumed).collect();
        match self.wire.parse_body(&region[..end.body]) {
            Some(calls) => {
                self.content.end_segment();
                for (name, args) in calls {
                    let index = self.calls_emitted;
                    self.calls_emitted += 1;
                    let id = format!("call_{index:08}");
                    self.out.push(ParseEvent::ToolCallStart { index, id, name });
                    let delta = args.to_string();
                    self.out
                        .push(ParseEvent::ToolCallArguments { index, delta });
                    self.out.push(ParseEvent::ToolCallEnd { index });
                }
                self.content.start_segment();
                self.mode = Mode::Start;
            }
            None => {
                self.text(opener);
                self.text(&region);
                self.mode = Mode::Text;
            }
        }
    }
}

impl<W: Wire> ToolParser for Driver<W> {
    fn push(&mut self, chunk: &str) -> Vec<ParseEvent> {
        self.buf.push_str(chunk);
        self.step(false);
        std::mem::take(&mut self.out)
    }

    fn finish(&mut self) -> Vec<ParseEvent> {
        self.step(true);
        if let Some(t) = self.content.finish() {
            self.out.push(ParseEvent::Text(t));
        }
        std::mem::take(&mut self.out)
    }
}
