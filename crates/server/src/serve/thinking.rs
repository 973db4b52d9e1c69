// SPDX-License-Identifier: MIT OR Apache-2.0
//! The thinking budget: a sequence that has spent its reasoning tokens gets its `<think>` block
//! closed for it.
//!
//! The engine follows each sequence's text through a [`ReasoningSplitter`] (the same rules that
//! split `reasoning_content` off), counting the tokens generated inside a block. Once the count
//! reaches the budget while a block is open, the next sampling steps append the tokens of
//! `\n</think>\n\n` instead of sampling, one per step, so the model continues from a closed block
//! and answers. The budget covers all blocks of the output together (a block the model reopens
//! is closed again at once). Forced tokens pass through the scheduler like sampled ones (they
//! take KV slots and count as generated tokens).

use std::collections::VecDeque;

use metrale_toolcall::{ReasoningSplitter, ThinkStart};

use super::state::AppState;

/// The text appended to close a reasoning block at the budget.
pub const CLOSE_THINK: &str = "\n</think>\n\n";

/// A request's cap on reasoning tokens, as the engine applies it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ThinkingBudget {
    /// Most tokens the sequence may generate inside `<think>` blocks, all blocks together.
    pub max_tokens: usize,
    /// Whether the output starts inside a block (the chat template opened it).
    pub start: ThinkStart,
    /// The token ids of [`CLOSE_THINK`].
    pub close: Vec<u32>,
}

/// The budget of a chat request: the smaller of the server's (`--max-thinking-budget`, else
/// the family's preset) and the request's; none when the reasoning parser is off (`think` is `None`),
/// neither sets one, or the closing text does not tokenize.
pub fn request_budget(
    state: &AppState,
    think: Option<ThinkStart>,
    requested: Option<usize>,
) -> Option<ThinkingBudget> {
    let start = think?;
    let max_tokens = match (state.max_thinking_budget, requested) {
        (Some(server), Some(request)) => server.min(request),
        (server, request) => server.or(request)?,
    };
    (!state.think_close.is_empty()).then(|| ThinkingBudget {
        max_tokens,
        start,
        close: state.think_close.clone(),
    })
}

/// One sequence's budget as it generates.
pub struct BudgetTracker {
    budget: ThinkingBudget,
    splitter: ReasoningSplitter,
    /// Tokens generated inside a block so far.
    spent: usize,
    /// Closing tokens still to append.
    forced: VecDeque<u32>,
    /// A close was forced and the text has not yet left the block (the detokeniser may hold a
    /// token's text back a step); no second close is forced meanwhile.
    closing: bool,
}

impl BudgetTracker {
    /// A tracker for a sequence starting at `budget.start`.
    pub fn new(budget: ThinkingBudget) -> Self {
        BudgetTracker {
            splitter: ReasoningSplitter::new(budget.start),
            budget,
            spent: 0,
            forced: VecDeque::new(),
            closing: false,
        }
    }

    /// At the sampling point: the token to append instead of sampling, if the budget forces one.
    pub fn forced_token(&mut self) -> Option<u32> {
        if self.forced.is_empty()
            && !self.closing
            && self.splitter.in_reasoning()
            && self.spent >= self.budget.max_tokens
        {
            self.closing = true;
            self.forced.extend(&self.budget.close);
        }
        self.forced.pop_front()
    }

    /// Records the detokenised text of the token just generated (sampled or forced).
    pub fn observe(&mut self, text: &str) {
        self.splitter.push(text);
        if self.splitter.in_reasoning() {
            self.spent += 1;
        } else {
            self.closing = false;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs a tracker over a scripted model that would write `script` forever: returns the text
    /// of the first `steps` tokens (forced ones included, as `[id]`).
    fn run(budget: usize, start: ThinkStart, script: &[&str], steps: usize) -> String {
        // Close tokens: 1 = "\n", 2 = "</think>", 3 = "\n\n".
        let text_of = |id: u32| ["", "\n", "</think>", "\n\n"][id as usize].to_string();
        let mut t = BudgetTracker::new(ThinkingBudget {
            max_tokens: budget,
            start,
            close: vec![1, 2, 3],
        });
        let mut out = String::new();
        for i in 0..steps {
            let text = match t.forced_token() {
                Some(id) => text_of(id),
                None => script[i.min(script.len() - 1)].to_string(),
            };
            t.observe(&text);
            out.push_str(&text);
        }
        out
    }

    #[test]
    fn closes_the_block_at_the_budget() {
        let out = run(3, ThinkStart::InsideThink, &["a", "b", "c", "d", "e"], 8);
        assert_eq!(out, "abc\n</think>\n\nee");
        let out = run(2, ThinkStart::Outside, &["<think>", "x", "y", "z"], 7);
        // `<think>` itself is a reasoning token: it and one more reach the budget.
        assert_eq!(out, "<think>x\n</think>\n\nzz");
        let (reasoning, content) = ReasoningSplitter::split_whole(ThinkStart::Outside, &out);
        assert_eq!((reasoning.as_str(), content.as_str()), ("x", "zz"));
    }

    #[test]
    fn a_zero_budget_closes_before_the_first_token() {
        let out = run(0, ThinkStart::InsideThink, &["a"], 4);
        assert_eq!(out, "\n</think>\n\na");
    }

    #[test]
    fn nothing_is_forced_outside_a_block() {
        let out = run(1, ThinkStart::Outside, &["plain ", "answer"], 4);
        assert_eq!(out, "plain answeransweranswer");
        let out = run(1, ThinkStart::Outside, &["a", "<think>", "b", "c"], 6);
        assert_eq!(
            out, "a<think>\n</think>\n\nc",
            "a reopened block is closed at once"
        );
    }

    #[test]
    fn a_delayed_close_is_not_forced_twice() {
        // The closing tag's text arrives one step late (held by the detokeniser).
        let mut t = BudgetTracker::new(ThinkingBudget {
            max_tokens: 1,
            start: ThinkStart::InsideThink,
            close: vec![1, 2],
        });
        assert_eq!(t.forced_token(), None);
        t.observe("a");
        assert_eq!(t.forced_token(), Some(1));
        t.observe("\n");
        assert_eq!(t.forced_token(), Some(2));
        t.observe("");
        assert_eq!(
            t.forced_token(),
            None,
            "still closing: nothing more is forced"
        );
        t.observe("</think>");
        assert_eq!(t.forced_token(), None);
    }
}
