// SPDX-License-Identifier: MIT OR Apache-2.0
//! The model's vocabulary as llguidance sees it: the bytes each id stands for.
//!
//! Invariants of the table built here, which the rest of the crate relies on:
//! - it has exactly the model's vocabulary size (the embedding rows), which may exceed the
//!   tokenizer's; ids with no token have no bytes, so no grammar can allow them;
//! - an ordinary token's bytes are what the tokenizer's decoder turns it into, so the bytes of
//!   `encode(text)` concatenate to `text`;
//! - a special token (a control token such as `<|im_end|>`) is `0xFF` followed by its text, the
//!   marker toktrie reserves for them (`TokTrie::SPECIAL_TOKEN_MARKER`): no UTF-8 text contains
//!   `0xFF`, so text never produces one, and a Lark grammar names one as `<|im_end|>` or
//!   `<[151645]>`. Added tokens that are not special (Qwen's `<tool_call>`) are ordinary text.

use std::collections::HashMap;
use std::sync::Arc;

use metrale_tokenizer::Tokenizer;
use serde_json::Value;
use toktrie::{SimpleVob, TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};

use crate::GrammarError;

/// Spellings of an end-of-sequence token, for tokenizers that name none.
const EOS_FALLBACKS: &[&str] = &[
    "<|endoftext|>",
    "</s>",
    "<|im_end|>",
    "<|eot_id|>",
    "<|end_of_text|>",
    "<eos>",
];

/// What an engine knows about its vocabulary, shared by every grammar and matcher it makes.
pub(crate) struct Vocab {
    /// The token trie over the model's vocabulary, with the tokenizer for llguidance's own use.
    pub(crate) env: TokEnv,
    /// The model's vocabulary size: mask bits and logits per step.
    pub(crate) size: usize,
    /// Ids that have bytes (ordinary or special); the rest are never allowed.
    pub(crate) valid: SimpleVob,
    /// The ids that end generation; allowed exactly when the grammar accepts.
    pub(crate) eos: Vec<TokenId>,
}

impl Vocab {
    pub(crate) fn new(
        tokenizer: &Tokenizer,
        model_vocab_size: usize,
    ) -> Result<Self, GrammarError> {
        let hf = tokenizer.as_hf_tokenizer();
        let tokenizer_size = tokenizer.vocab_size();
        if model_vocab_size < tokenizer_size {
            return Err(GrammarError::VocabTooSmall {
                model: model_vocab_size,
                tokenizer: tokenizer_size,
            });
        }
        let spelling = spelling(hf)?;
        let words = token_bytes(hf, spelling, model_vocab_size)?;
        let eos = eos_tokens(tokenizer, &words)?;

        let mut valid = SimpleVob::alloc(model_vocab_size);
        for (id, word) in words.iter().enumerate() {
            if !word.is_empty() {
                valid.allow_token(id as TokenId);
            }
        }
        let mut info = TokRxInfo::new(model_vocab_size as u32, eos[0]);
        info.tok_bos = tokenizer.bos_token_id();
        info.tok_pad = tokenizer.pad_token_id();
        let trie = TokTrie::from(&info, &words).with_eos_tokens(&eos);
        let env: TokEnv = Arc::new(TrieEnv {
            trie,
            tokenizer: hf.clone(),
            canonical: spelling == Spelling::ByteLevel,
        });
        Ok(Vocab {
            env,
            size: model_vocab_size,
            valid,
            eos,
        })
    }

    /// `u32` words in a mask: 32 ids per word, id `i` at bit `i % 32` of word `i / 32`.
    pub(crate) fn mask_words(&self) -> usize {
        self.size.div_ceil(32)
    }

    /// The id of the special token spelled `text`, if the vocabulary has one.
    pub(crate) fn special_token(&self, text: &str) -> Option<TokenId> {
        self.env.tok_trie().get_special_token(text)
    }
}

/// How a tokenizer's vocabulary strings become bytes, read off its decoder.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Spelling {
    /// GPT-2 byte-level BPE (Llama-3, Qwen2/3, SmolLM2): each byte is one printable character.
    ByteLevel,
    /// SentencePiece: `▁` is a space, `<0xNN>` is the byte `NN`, other text is itself.
    SentencePiece,
}

fn spelling(hf: &tokenizers::Tokenizer) -> Result<Spelling, GrammarError> {
    let Some(decoder) = hf.get_decoder() else {
        return Err(GrammarError::UnsupportedTokenizer("no decoder".into()));
    };
    let json = serde_json::to_value(decoder)
        .map_err(|e| GrammarError::UnsupportedTokenizer(format!("unreadable decoder: {e}")))?;
    let mut types = Vec::new();
    collect_types(&json, &mut types);
    if types.iter().any(|t| t == "ByteLevel") {
        Ok(Spelling::ByteLevel)
    } else if types
        .iter()
        .any(|t| matches!(t.as_str(), "ByteFallback" | "Metaspace" | "Replace"))
    {
        Ok(Spelling::SentencePiece)
    } else {
        Err(GrammarError::UnsupportedTokenizer(types.join(", ")))
    }
}

/// Every `"type"` in a serialized decoder, nested sequences included.
fn collect_types(v: &Value, out: &mut Vec<String>) {
    match v {
        Value::Object(m) => {
            if let Some(Value::String(t)) = m.get("type") {
                out.push(t.clone());
            }
            m.values().for_each(|x| collect_types(x, out));
        }
        Value::Array(a) => a.iter().for_each(|x| collect_types(x, out)),
        _ => {}
    }
}

/// The bytes of every id below `size`; empty for ids with no token.
fn token_bytes(
    hf: &tokenizers::Tokenizer,
    spelling: Spelling,
    size: usize,
) -> Result<Vec<Vec<u8>>, GrammarError> {
    let added = hf.get_added_tokens_decoder();
    let unicode_to_byte = gpt2_unicode_to_byte();
    let mut words = vec![Vec::new(); size];
    for (id, word) in words.iter_mut().enumerate().take(hf.get_vocab_size(true)) {
        let id = id as u32;
        if let Some(token) = added.get(&id) {
            *word = if token.special {
                let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                w.extend_from_slice(token.content.as_bytes());
                w
            } else {
                token.content.as_bytes().to_vec()
            };
            continue;
        }
        let Some(spelled) = hf.id_to_token(id) else {
            continue;
        };
        *word = match spelling {
            // A character outside the byte map means the entry is not a real token: no bytes.
            Spelling::ByteLevel => spelled
                .chars()
                .map(|c| unicode_to_byte.get(&c).copied())
                .collect::<Option<Vec<u8>>>()
                .unwrap_or_default(),
            Spelling::SentencePiece => sentencepiece_bytes(&spelled),
        };
    }
    Ok(words)
}

/// GPT-2's byte-to-character map, inverted. Printable Latin-1 bytes (`!`..=`~`, `¡`..=`¬`,
/// `®`..=`ÿ`) stand for themselves; the other 68 bytes, in increasing order, take the
/// characters from U+0100 on.
fn gpt2_unicode_to_byte() -> HashMap<char, u8> {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut next = 0x100u32;
    (0..=255u8)
        .map(|b| {
            let c = if printable(b) {
                char::from(b)
            } else {
                let c = char::from_u32(next).expect("U+0100..U+0144 are characters");
                next += 1;
                c
            };
            (c, b)
        })
        .collect()
}

fn sentencepiece_bytes(spelled: &str) -> Vec<u8> {
    if let Some(hex) = spelled
        .strip_prefix("<0x")
        .and_then(|s| s.strip_suffix('>'))
        .filter(|h| h.len() == 2)
        && let Ok(byte) = u8::from_str_radix(hex, 16)
    {
        return vec![byte];
    }
    spelled.replace('\u{2581}', " ").into_bytes()
}

/// The tokenizer's EOS ids, or a conventionally named special token when it names none.
fn eos_tokens(tokenizer: &Tokenizer, words: &[Vec<u8>]) -> Result<Vec<TokenId>, GrammarError> {
    if !tokenizer.eos_token_ids().is_empty() {
        return Ok(tokenizer.eos_token_ids().to_vec());
    }
    EOS_FALLBACKS
        .iter()
        .filter_map(|t| tokenizer.token_to_id(t))
        .find(|&id| words[id as usize].first() == Some(&TokTrie::SPECIAL_TOKEN_MARKER))
        .map(|id| vec![id])
        .ok_or(GrammarError::NoEosToken)
}

/// toktrie's view of our tokenizer. Where a grammar forces text (a fixed key, a closing tag),
/// llguidance allows only the tokenization this gives for it (its "forced tokens"), so it must
/// spell exactly the text: the tokenizer's own ids when they do, else the trie's greedy split.
struct TrieEnv {
    trie: TokTrie,
    tokenizer: tokenizers::Tokenizer,
    /// Whether the tokenizer's encoding of a fragment is how it encodes that text in context:
    /// true for byte-level BPE; SentencePiece prepends a space to fragments, so there llguidance
    /// forces nothing and the mask allows every spelling.
    canonical: bool,
}

impl TrieEnv {
    /// Whether `ids` (none of them special) spell exactly `text`.
    fn spells(&self, ids: &[TokenId], text: &[u8]) -> bool {
        let mut rest = text;
        for &id in ids {
            if self.trie.is_special_token(id) {
                return false;
            }
            match rest.strip_prefix(self.trie.token(id)) {
                Some(r) => rest = r,
                None => return false,
            }
        }
        rest.is_empty()
    }
}

impl TokenizerEnv for TrieEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.trie.tokenize_with_greedy_fallback(s, |text| {
            if let Ok(enc) = self.tokenizer.encode_fast(text, false)
                && self.spells(enc.get_ids(), text.as_bytes())
            {
                return enc.get_ids().to_vec();
            }
            self.trie.greedy_tokenize(text.as_bytes())
        })
    }

    fn tokenize_is_canonical(&self) -> bool {
        self.canonical
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpt2_map_covers_every_byte_once() {
        let map = gpt2_unicode_to_byte();
        assert_eq!(map.len(), 256);
        assert_eq!(map[&'Ġ'], b' ');
        assert_eq!(map[&'Ċ'], b'\n');
        assert_eq!(map[&'!'], b'!');
        assert_eq!(map[&'ÿ'], 0xFF);
        assert_eq!(map[&'\u{100}'], 0);
    }

    #[test]
    fn sentencepiece_spellings() {
        assert_eq!(sentencepiece_bytes("<0x0A>"), b"\n");
        assert_eq!(sentencepiece_bytes("▁the"), b" the");
        assert_eq!(sentencepiece_bytes("<0xZZ>"), b"<0xZZ>");
    }
}
