// SPDX-License-Identifier: MIT OR Apache-2.0
//! One engine per tokenizer: the vocabulary, llguidance's factory, and the compiled grammars.

use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use llguidance::ParserFactory;
use llguidance::api::TopLevelGrammar;
use metrale_tokenizer::Tokenizer;
use serde_json::json;
use toktrie::SimpleVob;

use crate::GrammarError;
use crate::cache::Lru;
use crate::matcher::{Matcher, compute_mask};
use crate::spec::{GrammarSpec, with_json_options};
use crate::vocab::Vocab;

/// Compiled grammars kept per engine, least recently used dropped first.
const CACHE_CAPACITY: usize = 256;

/// A compile in progress or done: callers asking for the same spec meanwhile wait for it.
type CacheSlot = Arc<OnceLock<Result<Arc<CompiledGrammar>, GrammarError>>>;

/// Compiles grammars against one tokenizer's vocabulary and starts matchers over them.
///
/// Built once per loaded model: building reads the whole vocabulary and precomputes llguidance's
/// token-class tries (about a second for Qwen3's 151k ids on a 2-core machine, release build).
/// `Send + Sync`: share it behind an `Arc`.
pub struct GrammarEngine {
    factory: ParserFactory,
    vocab: Arc<Vocab>,
    cache: Mutex<Lru<String, CacheSlot>>,
}

impl std::fmt::Debug for GrammarEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarEngine")
            .field("vocab_size", &self.vocab.size)
            .field("eos", &self.vocab.eos)
            .finish_non_exhaustive()
    }
}

/// A grammar compiled for one engine's vocabulary; cheap to share, never mutated.
pub struct CompiledGrammar {
    /// The matcher at the start of the output, mask already computed; each request clones it.
    /// Clones share the lexer's lazily built DFA (behind llguidance's mutex), so what one request
    /// builds the next reuses, and matchers of one grammar take turns at that lock.
    prototype: llguidance::Matcher,
    /// The allowed tokens at the start of the output (engine rules applied).
    initial_mask: SimpleVob,
    vocab: Arc<Vocab>,
}

impl std::fmt::Debug for CompiledGrammar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CompiledGrammar")
            .field("initially_allowed", &self.initial_mask.num_set())
            .finish_non_exhaustive()
    }
}

impl GrammarEngine {
    /// An engine for `tokenizer`'s vocabulary padded to `model_vocab_size` ids (the model's
    /// embedding rows, which may exceed the tokenizer's vocabulary; the extra ids are never
    /// allowed). Masks and logits passed to matchers have that many ids.
    pub fn new(tokenizer: &Tokenizer, model_vocab_size: usize) -> Result<Self, GrammarError> {
        let vocab = Arc::new(Vocab::new(tokenizer, model_vocab_size)?);
        let mut factory = ParserFactory::new_simple(&vocab.env)
            .map_err(|e| GrammarError::Setup(e.to_string()))?;
        factory.quiet();
        // Errors must not echo the output so far (it may be private) or the whole grammar.
        factory.limits_mut().verbose_errors = false;
        Ok(GrammarEngine {
            factory,
            vocab,
            cache: Mutex::new(Lru::new(CACHE_CAPACITY)),
        })
    }

    /// The vocabulary size masks and logits cover.
    pub fn vocab_size(&self) -> usize {
        self.vocab.size
    }

    /// The length of a mask in `u32` words: 32 ids per word, id `i` at bit `i % 32` of word
    /// `i / 32`.
    pub fn mask_words(&self) -> usize {
        self.vocab.mask_words()
    }

    /// The end-of-sequence ids, allowed exactly where the grammar accepts the output.
    pub fn eos_token_ids(&self) -> &[u32] {
        &self.vocab.eos
    }

    /// Compiles `spec`, or returns the grammar compiled for an equal spec before (the last 256
    /// distinct specs are kept; a failure is kept too, so a bad schema repeated costs nothing).
    /// Callers asking for the same spec while it compiles wait for that one compile.
    ///
    /// Errors: [`GrammarError::Invalid`] when llguidance cannot compile the grammar (the message
    /// says why) or the grammar allows no output at all.
    pub fn compile(&self, spec: &GrammarSpec) -> Result<Arc<CompiledGrammar>, GrammarError> {
        let slot = self
            .cache
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get_or_insert_with(spec.cache_key(), CacheSlot::default);
        slot.get_or_init(|| self.build(spec).map(Arc::new)).clone()
    }

    /// A fresh matcher at the start of the output.
    pub fn matcher(&self, grammar: &CompiledGrammar) -> Result<Matcher, GrammarError> {
        if !Arc::ptr_eq(&grammar.vocab, &self.vocab) {
            return Err(GrammarError::ForeignGrammar);
        }
        Ok(Matcher::new(
            grammar.prototype.clone(),
            grammar.initial_mask.clone(),
            self.vocab.clone(),
        ))
    }

    fn build(&self, spec: &GrammarSpec) -> Result<CompiledGrammar, GrammarError> {
        let top = match spec {
            GrammarSpec::JsonObject => TopLevelGrammar::from_json_schema(with_json_options(
                &json!({"type": "object"}),
                false,
            )),
            GrammarSpec::JsonSchema { schema, strict } => {
                TopLevelGrammar::from_json_schema(with_json_options(schema, !strict))
            }
            GrammarSpec::Regex(rx) => TopLevelGrammar::from_regex(rx),
            GrammarSpec::Lark(lark) => TopLevelGrammar::from_lark(lark.clone()),
            GrammarSpec::ToolCalls(tools) => {
                TopLevelGrammar::from_lark(tools.to_lark(|text| self.vocab.special_token(text)))
            }
        };
        let invalid = |message: String| match spec {
            GrammarSpec::ToolCalls(tools) => self.blame_tool(tools, message),
            _ => GrammarError::Invalid {
                kind: spec.kind(),
                message,
            },
        };
        let parser = self
            .factory
            .create_parser(top)
            .map_err(|e| invalid(e.to_string()))?;
        let mut prototype = llguidance::Matcher::new(Ok(parser));
        let initial_mask = compute_mask(&mut prototype, &self.vocab).map_err(|e| match e {
            GrammarError::Matcher(m) => invalid(format!("the grammar allows no output ({m})")),
            other => other,
        })?;
        Ok(CompiledGrammar {
            prototype,
            initial_mask,
            vocab: self.vocab.clone(),
        })
    }

    /// The error for a tool-call grammar that failed with `message`: the first tool whose
    /// argument schema fails on its own is named, else the message stands as it is.
    fn blame_tool(&self, tools: &crate::ToolCallGrammar, message: String) -> GrammarError {
        for (name, schema) in tools.argument_schemas() {
            if let Err(e) = self
                .factory
                .create_parser(TopLevelGrammar::from_json_schema(schema))
            {
                return GrammarError::Invalid {
                    kind: "tool parameters schema",
                    message: format!("tool `{name}`: {e}"),
                };
            }
        }
        GrammarError::Invalid {
            kind: "tool-call grammar",
            message,
        }
    }
}
