// SPDX-License-Identifier: MIT OR Apache-2.0
//! The vocabulary as bytes: real tokenizers' encodings walk a literal grammar of their own text,
//! special tokens never come from text, padding ids are never allowed, and EOS is allowed
//! exactly where the grammar accepts.

mod common;

use common::{Vocab, allowed_ids, is_set, llama3, qwen3, smollm2};
use metrale_grammar::{GrammarError, GrammarSpec};

/// Texts whose tokens cover byte-level spaces and newlines, multi-byte UTF-8 split across
/// tokens, digits, punctuation runs and (for Qwen) a non-special added token.
const TEXTS: &[&str] = &[
    "Hello, world!",
    "  two leading spaces\n\ttab, then\r\nCRLF and trailing   ",
    "naïve café — 東京タワー 🚀🧪 ∑x² ≠ ∞",
    "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\": 12.5e-3}}\n</tool_call>",
    "fn main() {\n    println!(\"{}\", 1_000_000);\n}\n",
    "Ｆｕｌｌ-width, ǅ, ß, İ, and a zero\u{200b}width space",
];

/// Walks the tokenizer's own encoding of `text` through the grammar "exactly `text`".
fn walk_own_encoding(vocab: &Vocab, text: &str) {
    let engine = &vocab.engine;
    let spec = GrammarSpec::Regex(regex::escape(text));
    let grammar = engine.compile(&spec).unwrap();
    let mut matcher = engine.matcher(&grammar).unwrap();
    let ids = vocab.tokenizer.encode(text, false).unwrap();
    let mut mask = vec![0u32; engine.mask_words()];
    for (i, &id) in ids.iter().enumerate() {
        matcher.fill_mask(&mut mask).unwrap();
        assert!(
            is_set(&mask, id),
            "{text:?}: token {i} ({id}, {:?}) not allowed",
            vocab.tokenizer.id_to_token(id)
        );
        for &eos in engine.eos_token_ids() {
            assert!(!is_set(&mask, eos), "{text:?}: EOS allowed before the end");
        }
        matcher.advance(id).unwrap();
    }
    matcher.fill_mask(&mut mask).unwrap();
    assert_eq!(
        allowed_ids(&mask),
        engine.eos_token_ids(),
        "{text:?}: at the end only EOS"
    );
    assert!(
        matcher.is_finished(),
        "{text:?}: complete, nothing can follow"
    );
    matcher.advance(engine.eos_token_ids()[0]).unwrap();
    assert!(matcher.is_finished());
}

#[test]
fn qwen3_encodings_spell_their_text() {
    for text in TEXTS {
        walk_own_encoding(qwen3(), text);
    }
}

#[test]
fn llama3_encodings_spell_their_text() {
    for text in TEXTS {
        walk_own_encoding(llama3(), text);
    }
}

#[test]
fn smollm2_gguf_encodings_spell_their_text() {
    for text in TEXTS {
        walk_own_encoding(smollm2(), text);
    }
}

#[test]
fn qwen3_tool_call_is_one_text_token() {
    // `<tool_call>` is an added token that is not special: ordinary text, which the tokenizer
    // encodes as one token. Text the grammar forces is allowed only as the tokenizer's own
    // tokenization (llguidance's forced tokens), so that token and nothing else is allowed.
    let v = qwen3();
    let ids = v.tokenizer.encode("<tool_call>", false).unwrap();
    assert_eq!(ids, [151657]);
    let g = v
        .engine
        .compile(&GrammarSpec::Regex("<tool_call>".into()))
        .unwrap();
    let mut m = v.engine.matcher(&g).unwrap();
    let mut mask = vec![0u32; v.engine.mask_words()];
    m.fill_mask(&mut mask).unwrap();
    assert_eq!(allowed_ids(&mask), [151657]);

    // Where the text is not forced, it may also be spelled in pieces.
    let g = v
        .engine
        .compile(&GrammarSpec::Regex("<tool_call>|<x>".into()))
        .unwrap();
    let mut m = v.engine.matcher(&g).unwrap();
    m.fill_mask(&mut mask).unwrap();
    assert!(is_set(&mask, 151657));
    assert!(is_set(&mask, v.tokenizer.token_to_id("<").unwrap()));
}

#[test]
fn special_tokens_never_come_from_text() {
    let v = qwen3();
    let im_start = v.tokenizer.token_to_id("<|im_start|>").unwrap();
    let mut mask = vec![0u32; v.engine.mask_words()];

    // As text, `<|im_start|>` is spelled in ordinary tokens only.
    let text = v
        .engine
        .compile(&GrammarSpec::Regex(r"<\|im_start\|>user".into()))
        .unwrap();
    let mut m = v.engine.matcher(&text).unwrap();
    m.fill_mask(&mut mask).unwrap();
    assert!(!is_set(&mask, im_start));
    assert!(is_set(&mask, v.tokenizer.token_to_id("<").unwrap()));

    // Named in Lark, it is the special token and nothing else.
    let lark = v
        .engine
        .compile(&GrammarSpec::Lark(
            "start: <|im_start|> \"user\" \"\\n\" /[a-z]{1,5}/".into(),
        ))
        .unwrap();
    let mut m = v.engine.matcher(&lark).unwrap();
    m.fill_mask(&mut mask).unwrap();
    assert_eq!(allowed_ids(&mask), [im_start]);
    m.advance(im_start).unwrap();
    for id in v.tokenizer.encode("user\nabc", false).unwrap() {
        m.advance(id).unwrap();
    }
    m.fill_mask(&mut mask).unwrap();
    assert!(is_set(&mask, v.engine.eos_token_ids()[0]));
}

#[test]
fn padding_ids_are_never_allowed() {
    // Qwen3's embedding has 151,936 rows for 151,669 tokens; even "any token" excludes the rest.
    let v = qwen3();
    assert_eq!(v.engine.vocab_size(), 151_936);
    assert_eq!(v.engine.mask_words(), 151_936 / 32);
    let g = v
        .engine
        .compile(&GrammarSpec::Lark("start: <[*]>".into()))
        .unwrap();
    let mut m = v.engine.matcher(&g).unwrap();
    let mut mask = vec![0u32; v.engine.mask_words()];
    m.fill_mask(&mut mask).unwrap();
    let allowed = allowed_ids(&mask);
    let tokenizer_size = v.tokenizer.vocab_size() as u32;
    assert_eq!(*allowed.last().unwrap(), tokenizer_size - 1);
    // Every real id but EOS (the grammar has not accepted yet).
    assert_eq!(allowed.len(), tokenizer_size as usize - 1);
    assert!(matches!(
        m.advance(tokenizer_size + 5),
        Err(GrammarError::TokenNotAllowed { .. })
    ));
}

#[test]
fn eos_is_allowed_exactly_when_the_grammar_accepts() {
    let v = qwen3();
    let eos = v.engine.eos_token_ids()[0];
    let g = v
        .engine
        .compile(&GrammarSpec::Regex("[0-9]{2,3}".into()))
        .unwrap();
    let mut m = v.engine.matcher(&g).unwrap();
    let mut mask = vec![0u32; v.engine.mask_words()];
    let mut logits = vec![0f32; v.engine.vocab_size()];
    let digit = |d: &str| v.tokenizer.token_to_id(d).unwrap();
    for (fed, accepting) in [(0, false), (1, false), (2, true)] {
        m.fill_mask(&mut mask).unwrap();
        assert_eq!(is_set(&mask, eos), accepting, "after {fed} digits");
        logits.fill(0.0);
        m.apply(&mut logits).unwrap();
        assert_eq!(logits[eos as usize].is_finite(), accepting);
        assert!(!m.is_finished());
        m.advance(digit(&fed.to_string())).unwrap();
    }
    // Three digits: complete, and nothing but EOS can follow.
    assert!(m.is_finished());
    m.fill_mask(&mut mask).unwrap();
    assert_eq!(allowed_ids(&mask), [eos]);
    assert!(matches!(
        m.advance(digit("7")),
        Err(GrammarError::TokenNotAllowed { token }) if token == digit("7")
    ));
}

#[test]
fn eos_before_acceptance_is_refused() {
    let v = llama3();
    let g = v.engine.compile(&GrammarSpec::Regex("abc".into())).unwrap();
    let mut m = v.engine.matcher(&g).unwrap();
    let eos = v.engine.eos_token_ids()[0];
    assert_eq!(
        m.advance(eos),
        Err(GrammarError::TokenNotAllowed { token: eos })
    );
}
