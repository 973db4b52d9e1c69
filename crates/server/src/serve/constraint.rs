// SPDX-License-Identifier: MIT OR Apache-2.0
//! Constrained decoding in `met serve`: which grammar a request gets, compiled at admission, and
//! each sequence's walk through it at the engine's sampling point.
//!
//! The flow, per request:
//! 1. **Admission** (the HTTP handler, before submitting): the request's grammar is chosen
//!    ([`constraint`]): the tool-call grammar when `tool_choice` demands a call and
//!    `--tool-grammar` allows it, else what `response_format` / `guided_*` /
//!    `structured_outputs` ask for ([`super::structured`]), else none. It is compiled on tokio's
//!    blocking pool (the grammar crate caches compiled grammars by spec), so a grammar that cannot
//!    be compiled is a 400 naming its field, with llguidance's reason, and never reaches the
//!    engine.
//! 2. **Sampling** (the engine thread): each sequence starts its own [`GrammarState`] (one per
//!    choice of `n`), and at every step asks it for the allowed-token bitset; the sampler applies
//!    it after the logit bias and penalties and before temperature, top-k, top-p and min-p
//!    (`Sampler::sample_allowed`).
//! 3. **Advance**: the sampled token moves the state on; when the grammar is complete (nothing
//!    but EOS may follow) the sequence ends with `finish_reason: "stop"`, and EOS itself is
//!    allowed exactly where the grammar accepts.
//!
//! Requests without a grammar carry `None` and pay nothing. The grammar engine (the vocabulary
//! as llguidance sees it) is built once at start-up, on its own thread while the weights load.
//!
//! Reasoning models (the reasoning parser on): a grammar covers the answer, not the reasoning.
//! When the template opened a `<think>` block, the grammar waits, unconstrained, until the
//! output closes it (its text is followed the way the reply is split). When the template did
//! not open one, the first token may also be `<think>` (if the vocabulary has it as one token):
//! the model may reason first, and the grammar starts once the block closes. Tokens the thinking
//! budget forces are never fed to the grammar (they are all inside the block or its closing
//! text).

use std::sync::Arc;

use axum::http::StatusCode;
use metrale_grammar::{
    CompiledGrammar, GrammarEngine, GrammarError, GrammarSpec, Matcher, ToolChoiceMode, ToolSpec,
    ToolWire,
};
use metrale_toolcall::{Format, ReasoningSplitter, ThinkStart};
use serde_json::Value;

use super::ToolGrammarArg;
use super::error::ApiError;
use super::state::AppState;
use super::structured::Requested;
use super::tools::{ToolChoice, Tools};

/// What the server can constrain, settled at start-up.
pub struct GrammarSupport {
    /// The engine over the model's vocabulary, or why it could not be built.
    pub engine: Result<Arc<GrammarEngine>, String>,
    /// `--tool-grammar`: whether `tool_choice` required / named is enforced.
    pub tool_grammar: ToolGrammarArg,
    /// The wire the tool-call grammar writes: the server's tool-call format.
    pub wire: Option<ToolWire>,
    /// The id of `<think>` when the vocabulary has it as one token (the first token a grammar
    /// lets a reasoning model write besides its own).
    pub think_open: Option<u32>,
}

/// The tool-call grammar's wire for a tool-call parser format (the same syntax, so what the
/// grammar writes the parser reads back).
pub fn wire_of(format: Format) -> ToolWire {
    match format {
        Format::Hermes => ToolWire::Hermes,
        Format::Qwen3Coder | Format::Qwen3Xml => ToolWire::Qwen3Xml,
        Format::Mistral => ToolWire::Mistral,
        Format::Llama3Json => ToolWire::Llama3Json,
        Format::BareJson => ToolWire::BareJson,
    }
}

/// What a request brings to the choice of its grammar.
pub struct GrammarRequest<'a> {
    /// The tools offered and `tool_choice` (chat and messages routes).
    pub tools: Option<&'a Tools>,
    /// The grammar the request's own fields ask for.
    pub requested: Option<Requested>,
    /// Where the answer starts relative to a `<think>` block; `None` when the reasoning parser
    /// is off or for text completions.
    pub think: Option<ThinkStart>,
}

/// A request's grammar, compiled; cloned into each choice, each of which starts its own walk.
#[derive(Clone, Debug)]
pub struct Constraint {
    engine: Arc<GrammarEngine>,
    grammar: Arc<CompiledGrammar>,
    think: Option<ThinkStart>,
    think_open: Option<u32>,
}

/// The grammar for a request, compiled, or `None` when it has none.
///
/// A `tool_choice` that demands a call (`required`, a named function, Anthropic `any` / `tool`)
/// gets the tool-call grammar unless `--tool-grammar off`; the request's `response_format` is
/// then not applied (the answer is the call). Under `auto` a tool list the grammar cannot express
/// falls back to parsing only (logged); under `on` it is a 400 naming `tools`. Otherwise the
/// request's own grammar, if any, is compiled; failing that is a 400 naming its field.
pub async fn constraint(
    state: &AppState,
    req: GrammarRequest<'_>,
) -> Result<Option<Constraint>, ApiError> {
    let support = &state.grammar;
    if let Some(tools) = req.tools
        && let Some(mode) = demanded(tools)
    {
        return tool_constraint(support, tools, mode, req.think).await;
    }
    let Some(Requested { spec, field }) = req.requested else {
        return Ok(None);
    };
    let engine = support.engine.as_ref().map_err(|why| {
        ApiError::invalid(
            &field,
            format!("`{field}` needs constrained decoding, which this server cannot do for its model: {why}"),
        )
    })?;
    let grammar = compile(engine, spec)
        .await?
        .map_err(|e| ApiError::invalid(&field, format!("`{field}`: {e}")))?;
    Ok(Some(Constraint::new(support, engine, grammar, req.think)))
}

/// The tool-call mode `tool_choice` demands, if it demands a call.
fn demanded(tools: &Tools) -> Option<ToolChoiceMode> {
    if !tools.offered() {
        return None;
    }
    match &tools.choice {
        ToolChoice::Required if tools.single_call => Some(ToolChoiceMode::RequiredOne),
        ToolChoice::Required => Some(ToolChoiceMode::Required),
        ToolChoice::Named(name) => Some(ToolChoiceMode::Named(name.clone())),
        ToolChoice::Auto | ToolChoice::None => None,
    }
}

async fn tool_constraint(
    support: &GrammarSupport,
    tools: &Tools,
    mode: ToolChoiceMode,
    think: Option<ThinkStart>,
) -> Result<Option<Constraint>, ApiError> {
    // Without a wire the handler has already refused the request (no parser); without an engine
    // `--tool-grammar on` refused to start, so `auto` parses only.
    let (ToolGrammarArg::Auto | ToolGrammarArg::On, Some(wire), Ok(engine)) =
        (support.tool_grammar, support.wire, &support.engine)
    else {
        return Ok(None);
    };
    let specs: Vec<ToolSpec> = tools
        .defs
        .iter()
        .map(|d| ToolSpec {
            name: d["function"]["name"]
                .as_str()
                .unwrap_or_default()
                .to_owned(),
            parameters: d["function"]
                .get("parameters")
                .cloned()
                .unwrap_or(Value::Null),
        })
        .collect();
    let compiled = match GrammarSpec::tool_calls(wire, &specs, mode) {
        Ok(spec) => compile(engine, spec).await?,
        Err(e) => Err(e),
    };
    match compiled {
        Ok(grammar) => Ok(Some(Constraint::new(support, engine, grammar, think))),
        Err(e) if support.tool_grammar == ToolGrammarArg::On => Err(ApiError::invalid(
            "tools",
            format!(
                "`tool_choice` demands a call, and --tool-grammar on requires it to be constrained, but {e}"
            ),
        )),
        Err(e) => {
            tracing::warn!(
                "tool_choice demands a call but the tool-call grammar cannot be built ({e}); \
                 parsing the unconstrained answer instead (--tool-grammar auto)"
            );
            Ok(None)
        }
    }
}

/// Compiles `spec` on the blocking pool (a large schema can take milliseconds or more).
async fn compile(
    engine: &Arc<GrammarEngine>,
    spec: GrammarSpec,
) -> Result<Result<Arc<CompiledGrammar>, GrammarError>, ApiError> {
    let engine = engine.clone();
    tokio::task::spawn_blocking(move || engine.compile(&spec))
        .await
        .map_err(|e| {
            ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("compiling the grammar failed: {e}"),
            )
        })
}

impl Constraint {
    fn new(
        support: &GrammarSupport,
        engine: &Arc<GrammarEngine>,
        grammar: Arc<CompiledGrammar>,
        think: Option<ThinkStart>,
    ) -> Self {
        Constraint {
            engine: engine.clone(),
            grammar,
            think,
            think_open: support.think_open,
        }
    }

    /// A fresh walk through the grammar, for one sequence.
    pub fn start(&self) -> Result<GrammarState, GrammarError> {
        Ok(GrammarState {
            matcher: self.engine.matcher(&self.grammar)?,
            allowed: vec![0; self.engine.mask_words()],
            waiting: (self.think == Some(ThinkStart::InsideThink))
                .then(|| ReasoningSplitter::new(ThinkStart::InsideThink)),
            think_open: self
                .think_open
                .filter(|_| self.think == Some(ThinkStart::Outside)),
        })
    }
}

/// One sequence's place in its grammar, kept by the engine thread.
///
/// Per step: [`GrammarState::allowed`], sample under it, [`GrammarState::advance`] with the
/// sampled token; [`GrammarState::observe`] with every token's text (forced ones too).
pub struct GrammarState {
    matcher: Matcher,
    /// Scratch for the bitset handed to the sampler.
    allowed: Vec<u32>,
    /// While the output is inside a `<think>` block: the grammar waits for its close.
    waiting: Option<ReasoningSplitter>,
    /// `<think>`'s id while the output may still open a block: only before the grammar's first
    /// token, and only when the output starts outside one.
    think_open: Option<u32>,
}

impl GrammarState {
    /// The tokens that may come next as a bitset (token `i` is bit `i % 32` of word `i / 32`),
    /// or `None` while the grammar waits for a `<think>` block to close.
    pub fn allowed(&mut self) -> Result<Option<&[u32]>, GrammarError> {
        if self.waiting.is_some() {
            return Ok(None);
        }
        self.matcher.fill_mask(&mut self.allowed)?;
        if let Some(id) = self.think_open
            && let Some(word) = self.allowed.get_mut(id as usize / 32)
        {
            *word |= 1 << (id % 32);
        }
        Ok(Some(&self.allowed))
    }

    /// Moves past `token`, sampled under the bitset [`GrammarState::allowed`] just gave.
    /// `<think>` as the first token opens a block the grammar waits out (even where the grammar
    /// itself would allow `<think>`: the reply is read the same way, as reasoning).
    pub fn advance(&mut self, token: u32) -> Result<(), GrammarError> {
        if self.waiting.is_some() {
            return Ok(());
        }
        if self.think_open.take() == Some(token) {
            self.waiting = Some(ReasoningSplitter::new(ThinkStart::InsideThink));
            return Ok(());
        }
        self.matcher.advance(token)
    }

    /// Follows the text of each generated token (sampled or forced), for the close of a
    /// `<think>` block the grammar waits on.
    pub fn observe(&mut self, text: &str) {
        if let Some(splitter) = &mut self.waiting {
            splitter.push(text);
            if !splitter.in_reasoning() {
                self.waiting = None;
            }
        }
    }

    /// Whether the output is complete: nothing but EOS may follow.
    pub fn is_finished(&self) -> bool {
        self.waiting.is_none() && self.matcher.is_finished()
    }
}

#[cfg(test)]
mod tests;
