// SPDX-License-Identifier: MIT OR Apache-2.0
//! Time per generated token of constrained decoding with Qwen3's vocabulary: computing the mask
//! (`Matcher::fill_mask`) and moving past the sampled token (`Matcher::advance`).
//!
//! ```text
//! cargo run --release -p metrale-grammar --example mask_bench [-- TOKENIZER_DIR]
//! ```
//!
//! TOKENIZER_DIR defaults to `.cache/test-data/qwen3-tokenizer` (scripts/fetch-test-data.sh).
//! Two grammars: a JSON schema with string, integer, enum, array and nested-object fields, and
//! the hermes tool-call grammar for two tools. Each is walked RUNS times from a fixed seed,
//! drawing every token uniformly from the mask for a few dozen steps and then leaning towards
//! closing what is open, until EOS; only the matcher calls are timed, not the draw.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use metrale_grammar::{GrammarEngine, GrammarSpec, Matcher, ToolChoiceMode, ToolSpec, ToolWire};
use metrale_tokenizer::Tokenizer;
use serde_json::json;

/// Qwen3 checkpoints have 151,936 embedding rows for the tokenizer's 151,669 ids.
const QWEN3_MODEL_VOCAB: usize = 151_936;
const RUNS: u64 = 10;
const MAX_STEPS: usize = 2_000;

fn main() {
    let dir = std::env::args()
        .nth(1)
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            std::env::var_os("METRALE_TEST_DATA")
                .map(PathBuf::from)
                .unwrap_or_else(|| {
                    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../.cache/test-data")
                })
                .join("qwen3-tokenizer")
        });
    let tokenizer = Tokenizer::from_hf_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}; run scripts/fetch-test-data.sh", dir.display()));
    let t = Instant::now();
    let engine = GrammarEngine::new(&tokenizer, QWEN3_MODEL_VOCAB).unwrap();
    println!(
        "engine: {} ids ({} in the tokenizer), built in {:.0} ms",
        engine.vocab_size(),
        tokenizer.vocab_size(),
        ms(t.elapsed())
    );

    let cases = [
        ("JSON schema", schema_spec()),
        ("hermes tool calls (2 tools)", tools_spec()),
    ];
    let mut rows = Vec::new();
    for (name, spec) in &cases {
        let t = Instant::now();
        let grammar = engine.compile(spec).unwrap();
        let compile = t.elapsed();
        let t = Instant::now();
        let _ = engine.compile(spec).unwrap();
        let cached = t.elapsed();
        let runs: Vec<Vec<Step>> = (0..RUNS)
            .map(|seed| {
                let matcher = engine.matcher(&grammar).unwrap();
                walk(&engine, &tokenizer, matcher, &mut Rng(seed))
            })
            .collect();
        println!(
            "{name}: compile {:.1} ms (cached {:.1} µs), {RUNS} runs, {} tokens",
            ms(compile),
            us(cached),
            runs.iter().map(Vec::len).sum::<usize>()
        );
        rows.push((*name, runs));
    }

    println!();
    println!(
        "All steps of all runs (the first run also builds lexer states the later ones reuse):"
    );
    println!();
    let worst_median = table(&rows, 0);
    println!();
    println!("Runs 2 to {RUNS} only (lexer states built by an earlier run of the same grammar):");
    println!();
    table(&rows, 1);
    println!();
    println!(
        "requirement: median under 100 µs per token: {} (worst median {:.1} µs)",
        if worst_median < Duration::from_micros(100) {
            "met"
        } else {
            "NOT met"
        },
        us(worst_median)
    );
}

/// Prints one row per grammar over the steps of runs `first_run..`; returns the worst median.
fn table(rows: &[(&str, Vec<Vec<Step>>)], first_run: usize) -> Duration {
    println!(
        "| grammar | tokens | step median µs | step p99 µs | step mean µs | step max µs | mask median µs | advance median µs |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|");
    let mut worst = Duration::ZERO;
    for (name, runs) in rows {
        let steps: Vec<Step> = runs[first_run..].iter().flatten().copied().collect();
        let mut total: Vec<Duration> = steps.iter().map(|s| s.mask + s.advance).collect();
        let mut mask: Vec<Duration> = steps.iter().map(|s| s.mask).collect();
        let mut advance: Vec<Duration> = steps.iter().map(|s| s.advance).collect();
        let n = total.len();
        let mean = total.iter().sum::<Duration>() / n as u32;
        let median = pct(&mut total, 50.0);
        worst = worst.max(median);
        println!(
            "| {name} | {n} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} |",
            us(median),
            us(pct(&mut total, 99.0)),
            us(mean),
            us(pct(&mut total, 100.0)),
            us(pct(&mut mask, 50.0)),
            us(pct(&mut advance, 50.0)),
        );
    }
    worst
}

fn schema_spec() -> GrammarSpec {
    GrammarSpec::JsonSchema {
        schema: json!({
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 40},
                "age": {"type": "integer", "minimum": 0, "maximum": 150},
                "role": {"enum": ["admin", "user", "guest"]},
                "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
                "address": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"],
                    "additionalProperties": false
                },
                "active": {"type": "boolean"}
            },
            "required": ["name", "age", "role", "tags", "address"],
            "additionalProperties": false
        }),
        strict: true,
    }
}

fn tools_spec() -> GrammarSpec {
    let tools = [
        ToolSpec {
            name: "get_weather".into(),
            parameters: json!({
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "unit": {"enum": ["celsius", "fahrenheit"]},
                    "days": {"type": "integer", "minimum": 1, "maximum": 14}
                },
                "required": ["city"]
            }),
        },
        ToolSpec {
            name: "search".into(),
            parameters: json!({
                "type": "object",
                "properties": {
                    "query": {"type": "string"},
                    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
                    "safe": {"type": "boolean"}
                },
                "required": ["query"],
                "additionalProperties": false
            }),
        },
    ];
    GrammarSpec::tool_calls(ToolWire::Hermes, &tools, ToolChoiceMode::Required).unwrap()
}

/// The matcher's time in one step.
#[derive(Clone, Copy)]
struct Step {
    /// `fill_mask`: computing the mask of allowed tokens and copying it out.
    mask: Duration,
    /// `advance`: moving past the sampled token.
    advance: Duration,
}

/// One output from the start of the grammar to EOS, timing each step's matcher calls.
fn walk(engine: &GrammarEngine, tokenizer: &Tokenizer, mut m: Matcher, rng: &mut Rng) -> Vec<Step> {
    let eos = engine.eos_token_ids();
    let mut mask = vec![0u32; engine.mask_words()];
    let patience = 20 + rng.below(60);
    let mut steps = Vec::new();
    for step in 0..MAX_STEPS {
        let t0 = Instant::now();
        m.fill_mask(&mut mask).unwrap();
        let t1 = Instant::now();
        let token = if step < patience || rng.below(5) == 0 {
            uniform(&mask, rng)
        } else {
            finishing(tokenizer, &mask, eos, rng)
        };
        let t2 = Instant::now();
        m.advance(token).unwrap();
        let t3 = Instant::now();
        steps.push(Step {
            mask: t1 - t0,
            advance: t3 - t2,
        });
        if eos.contains(&token) {
            return steps;
        }
    }
    panic!("no EOS after {MAX_STEPS} tokens");
}

fn is_set(mask: &[u32], id: u32) -> bool {
    mask[id as usize / 32] >> (id % 32) & 1 == 1
}

fn uniform(mask: &[u32], rng: &mut Rng) -> u32 {
    let total: u32 = mask.iter().map(|w| w.count_ones()).sum();
    let mut k = rng.below(total as usize) as u32;
    for (w, &word) in mask.iter().enumerate() {
        let n = word.count_ones();
        if k < n {
            let mut bits = word;
            for _ in 0..k {
                bits &= bits - 1;
            }
            return w as u32 * 32 + bits.trailing_zeros();
        }
        k -= n;
    }
    unreachable!("k < total")
}

/// EOS if allowed; else the next token of `"`, `}` or `]`; else a digit; else uniform.
fn finishing(tokenizer: &Tokenizer, mask: &[u32], eos: &[u32], rng: &mut Rng) -> u32 {
    if let Some(&e) = eos.iter().find(|&&id| is_set(mask, id)) {
        return e;
    }
    for text in ["\"", "}", "]", "0", "1"] {
        if let Some(&id) = tokenizer.encode(text, false).unwrap().first()
            && is_set(mask, id)
        {
            return id;
        }
    }
    uniform(mask, rng)
}

/// SplitMix64.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((z ^ (z >> 31)) % n as u64) as usize
    }
}

/// The `p`th percentile (nearest rank) of `samples`.
fn pct(samples: &mut [Duration], p: f64) -> Duration {
    samples.sort_unstable();
    let rank = ((p / 100.0) * samples.len() as f64).ceil() as usize;
    samples[rank.clamp(1, samples.len()) - 1]
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}
