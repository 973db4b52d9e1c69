// SPDX-License-Identifier: MIT OR Apache-2.0
//! Shared by the grammar tests: the real vocabularies, a seeded RNG, and a sampler that walks a
//! grammar with random tokens from its masks.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use metrale_grammar::{CompiledGrammar, GrammarEngine, GrammarSpec};
use metrale_model_weights::GgufFile;
use metrale_tokenizer::Tokenizer;

/// The test-data directory: `$METRALE_TEST_DATA`, else `.cache/test-data` at the workspace root.
pub fn data_dir() -> PathBuf {
    std::env::var_os("METRALE_TEST_DATA")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.cache/test-data"))
}

/// A path under the test-data directory, which must exist.
pub fn data_path(relative: &str) -> PathBuf {
    let path = data_dir().join(relative);
    assert!(
        path.exists(),
        "{} is missing: run scripts/fetch-test-data.sh (or set METRALE_TEST_DATA to where it put \
         the data)",
        path.display()
    );
    path
}

/// A vocabulary under test, with the model vocabulary size its checkpoint uses.
pub struct Vocab {
    pub tokenizer: Tokenizer,
    pub engine: GrammarEngine,
    /// Ids spelled only with `"`, `}` and `]`: what the sampler prefers when finishing.
    pub closers: Vec<u32>,
    /// Ids spelled only with ASCII digits.
    pub digits: Vec<u32>,
}

fn load(tokenizer: Tokenizer, model_vocab_size: usize) -> Vocab {
    let engine = GrammarEngine::new(&tokenizer, model_vocab_size).unwrap();
    // Byte-level vocabularies spell printable ASCII as itself.
    let spelled_with = |chars: &str| -> Vec<u32> {
        (0..tokenizer.vocab_size() as u32)
            .filter(|&id| {
                tokenizer
                    .id_to_token(id)
                    .is_some_and(|t| !t.is_empty() && t.chars().all(|c| chars.contains(c)))
            })
            .collect()
    };
    let closers = spelled_with("\"}]");
    let digits = spelled_with("0123456789");
    Vocab {
        tokenizer,
        engine,
        closers,
        digits,
    }
}

/// Qwen3's tokenizer (151,669 ids) in a 151,936-row model, as Qwen3 checkpoints have.
pub fn qwen3() -> &'static Vocab {
    static V: OnceLock<Vocab> = OnceLock::new();
    V.get_or_init(|| {
        let t = Tokenizer::from_hf_dir(&data_path("qwen3-tokenizer")).unwrap();
        load(t, 151_936)
    })
}

/// Llama-3.2's tokenizer (128,256 ids, as its model).
pub fn llama3() -> &'static Vocab {
    static V: OnceLock<Vocab> = OnceLock::new();
    V.get_or_init(|| {
        let t = Tokenizer::from_hf_dir(&data_path("llama3-tokenizer")).unwrap();
        let n = t.vocab_size();
        load(t, n)
    })
}

/// SmolLM2-135M's vocabulary read from its GGUF file (49,152 ids).
pub fn smollm2() -> &'static Vocab {
    static V: OnceLock<Vocab> = OnceLock::new();
    V.get_or_init(|| {
        let gguf = GgufFile::open(&data_path("smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")).unwrap();
        let t = Tokenizer::from_gguf(&gguf).unwrap();
        let n = t.vocab_size();
        load(t, n)
    })
}

/// SplitMix64: a small seeded generator, so a failing run can be replayed by its seed.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n`.
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }

    /// Uniform in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    pub fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.below(items.len())]
    }
}

/// Whether `id` is set in `mask`.
pub fn is_set(mask: &[u32], id: u32) -> bool {
    mask[id as usize / 32] >> (id % 32) & 1 == 1
}

/// The ids set in a mask.
pub fn allowed_ids(mask: &[u32]) -> Vec<u32> {
    let mut ids = Vec::new();
    for (w, &word) in mask.iter().enumerate() {
        let mut bits = word;
        while bits != 0 {
            ids.push(w as u32 * 32 + bits.trailing_zeros());
            bits &= bits - 1;
        }
    }
    ids
}

/// A uniformly drawn id among those set in `mask`, or `None` if none is.
pub fn pick_uniform(mask: &[u32], rng: &mut Rng) -> Option<u32> {
    let total: u32 = mask.iter().map(|w| w.count_ones()).sum();
    if total == 0 {
        return None;
    }
    let mut k = rng.below(total as usize) as u32;
    for (w, &word) in mask.iter().enumerate() {
        let n = word.count_ones();
        if k < n {
            let mut bits = word;
            for _ in 0..k {
                bits &= bits - 1;
            }
            return Some(w as u32 * 32 + bits.trailing_zeros());
        }
        k -= n;
    }
    unreachable!("k < total")
}

/// One random walk through a grammar.
pub struct Sample {
    /// The tokens before EOS.
    pub tokens: Vec<u32>,
    /// Those tokens decoded, special tokens included.
    pub text: String,
}

/// Walks `grammar` from its start, drawing each token at random from the mask, until EOS.
///
/// For the first `patience` steps (20 to 80, drawn per run) every allowed token is equally
/// likely; after that the draw leans towards finishing (see `finishing_pick`), which keeps
/// recursive grammars such as JSON, and free text, from growing without end. Every step checks that `apply` masks exactly the ids `fill_mask` leaves out, and
/// that the matcher reports finished exactly once EOS was drawn.
pub fn sample(vocab: &Vocab, grammar: &Arc<CompiledGrammar>, rng: &mut Rng) -> Sample {
    const MAX_STEPS: usize = 4000;
    let engine = &vocab.engine;
    let eos = engine.eos_token_ids();
    let mut matcher = engine.matcher(grammar).unwrap();
    let mut mask = vec![0u32; engine.mask_words()];
    let patience = 20 + rng.below(60);
    let mut tokens = Vec::new();
    for step in 0..MAX_STEPS {
        matcher.fill_mask(&mut mask).unwrap();
        if step % 13 == 3 {
            let mut logits = vec![0.5f32; engine.vocab_size()];
            matcher.apply(&mut logits).unwrap();
            for (id, l) in logits.iter().enumerate() {
                assert_eq!(
                    l.is_finite(),
                    is_set(&mask, id as u32),
                    "apply and fill_mask disagree on id {id}"
                );
            }
        }
        let mut last = mask.len() * 32;
        while last > engine.vocab_size() {
            last -= 1;
            assert!(
                !is_set(&mask, last as u32),
                "mask bit {last} past the vocabulary"
            );
        }
        let token = if step < patience || rng.unit() < 0.2 {
            pick_uniform(&mask, rng)
        } else {
            finishing_pick(vocab, &mask, eos, &tokens, rng)
        }
        .unwrap_or_else(|| panic!("empty mask at step {step}"));
        matcher.advance(token).unwrap_or_else(|e| {
            panic!(
                "advance({token}) failed after {:?}: {e}",
                vocab.tokenizer.decode(&tokens, false)
            )
        });
        if eos.contains(&token) {
            assert!(
                matcher.is_finished(),
                "EOS accepted but matcher not finished"
            );
            let text = vocab.tokenizer.decode(&tokens, false).unwrap();
            return Sample { tokens, text };
        }
        tokens.push(token);
    }
    panic!(
        "no EOS after {MAX_STEPS} tokens: {:?}",
        vocab.tokenizer.decode(&tokens, false)
    );
}

/// Text that closes what is open: a qwen3 XML value, a JSON string, object or list.
const CLOSINGS: [&str; 4] = ["\n</parameter>\n", "\"", "}", "]"];

/// A draw that heads for the end: EOS if allowed; else the next token of a closing text already
/// begun at the end of the output (or begun afresh); else a token made of closing characters,
/// or of digits; else any allowed token.
fn finishing_pick(
    vocab: &Vocab,
    mask: &[u32],
    eos: &[u32],
    tokens: &[u32],
    rng: &mut Rng,
) -> Option<u32> {
    if let Some(&e) = eos.iter().find(|&&id| is_set(mask, id)) {
        return Some(e);
    }
    let tail = vocab
        .tokenizer
        .decode(&tokens[tokens.len().saturating_sub(8)..], false)
        .unwrap_or_default();
    for closing in CLOSINGS {
        let begun = (0..closing.len())
            .rev()
            .find(|&k| tail.ends_with(&closing[..k]))
            .unwrap_or(0);
        let next = vocab.tokenizer.encode(&closing[begun..], false).unwrap();
        if let Some(&id) = next.first()
            && is_set(mask, id)
        {
            return Some(id);
        }
    }
    for class in [&vocab.closers, &vocab.digits] {
        let ids: Vec<u32> = class
            .iter()
            .copied()
            .filter(|&id| is_set(mask, id))
            .collect();
        if !ids.is_empty() {
            return Some(rng.pick(&ids));
        }
    }
    pick_uniform(mask, rng)
}

/// Compiles `spec` with `vocab`'s engine, panicking with the error.
pub fn compile(vocab: &Vocab, spec: &GrammarSpec) -> Arc<CompiledGrammar> {
    vocab
        .engine
        .compile(spec)
        .unwrap_or_else(|e| panic!("{spec:?} does not compile: {e}"))
}
