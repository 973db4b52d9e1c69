// SPDX-License-Identifier: MIT OR Apache-2.0
//! The pre-tokenizers behind GGUF's `tokenizer.ggml.pre` names.
//!
//! GGUF keeps a byte-level BPE vocabulary and its merges verbatim but replaces the pre-tokenizer
//! (how text is cut into words before BPE) with a name. Each supported name maps back to what the
//! model's original `tokenizer.json` did (split regexes, digit splitting, NFC), because that is
//! what the model was trained with and what llama.cpp's golden vectors, made with
//! `transformers`, expect. The regexes are the `tokenizer.json` ones, not llama.cpp's rewrites.

use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::punctuation::Punctuation;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{PreTokenizerWrapper, SplitDelimiterBehavior};

use crate::TokenizerError;

/// Contractions, then letters with at most one leading non-letter, then single digits, then
/// punctuation runs (with a following newline run), then newline runs, then other spaces (a
/// space before a word stays with the word). The Qwen2 `tokenizer.json` regex.
const QWEN2_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// As Qwen2, but numbers split in runs of up to three digits. The Llama-3 `tokenizer.json` regex.
const LLAMA3_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// As Qwen2, but combining marks (`\p{M}`) count as letters. The Qwen3.5 `tokenizer.json` regex.
const QWEN35_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// DeepSeek LLM's letters: Latin, Greek, Cyrillic, Armenian, Georgian, Cherokee and other cased
/// scripts (escaped, since several code points here are canonically equivalent to others).
const DEEPSEEK_LLM_LETTERS: &str = r"\s?[A-Za-z\x{B5}\x{C0}-\x{D6}\x{D8}-\x{F6}\x{F8}-\x{1BA}\x{1BC}-\x{1BF}\x{1C4}-\x{293}\x{295}-\x{2AF}\x{370}-\x{373}\x{376}\x{377}\x{37B}-\x{37D}\x{37F}\x{386}\x{388}-\x{38A}\x{38C}\x{38E}-\x{3A1}\x{3A3}-\x{3F5}\x{3F7}-\x{481}\x{48A}-\x{52F}\x{531}-\x{556}\x{10A0}-\x{10C5}\x{13A0}-\x{13F5}\x{13F8}-\x{13FD}\x{1C90}-\x{1CBA}\x{1CBD}-\x{1CBF}\x{1D00}-\x{1D2B}\x{1D6B}-\x{1D77}\x{1D79}-\x{1D9A}\x{1E00}-\x{1F15}\x{1F18}-\x{1F1D}\x{1F20}-\x{1F45}\x{1F48}-\x{1F4D}\x{1F50}-\x{1F57}\x{1F59}\x{1F5B}\x{1F5D}\x{1F5F}-\x{1F7D}\x{1F80}-\x{1FB4}\x{1FB6}-\x{1FBC}\x{1FBE}\x{1FC2}-\x{1FC4}\x{1FC6}-\x{1FCC}\x{1FD0}-\x{1FD3}\x{1FD6}-\x{1FDB}\x{1FE0}-\x{1FEC}\x{1FF2}-\x{1FF4}\x{1FF6}-\x{1FFC}\x{2102}\x{2107}\x{210A}-\x{2113}\x{2115}\x{2119}-\x{211D}\x{2124}\x{2126}\x{2128}\x{212A}-\x{212D}\x{212F}-\x{2134}\x{2139}\x{213C}-\x{213F}\x{2145}-\x{2149}\x{214E}\x{2183}\x{2184}\x{2C00}-\x{2C7B}\x{2C7E}-\x{2CE4}\x{2CEB}-\x{2CEE}\x{2CF2}\x{2CF3}\x{A640}-\x{A66D}\x{A680}-\x{A69B}\x{A722}-\x{A76F}\x{A771}-\x{A787}\x{A78B}-\x{A78E}\x{AB70}-\x{ABBF}\x{FB00}-\x{FB06}\x{FB13}-\x{FB17}\x{FF21}-\x{FF3A}\x{FF41}-\x{FF5A}\x{10400}-\x{1044F}\x{104B0}-\x{104D3}\x{104D8}-\x{104FB}\x{10C80}-\x{10CB2}\x{10CC0}-\x{10CF2}\x{118A0}-\x{118DF}\x{1E900}-\x{1E943}]+";
/// DeepSeek LLM's punctuation: ASCII and full-width symbols, curly quotes, ideographic space/marks.
const DEEPSEEK_LLM_PUNCTUATION: &str =
    r"\s?[!-/:-~\x{FF01}-\x{FF0F}\x{FF1A}-\x{FF5E}\x{2018}-\x{201F}\x{3000}-\x{3002}]+";
/// DeepSeek's CJK runs (CJK ideographs, U+0800..U+4E00, Hangul syllables).
const DEEPSEEK_CJK: &str = r"[\x{4E00}-\x{9FA5}\x{800}-\x{4E00}\x{AC00}-\x{D7FF}]+";

/// The pre-tokenizers this crate can rebuild, by the families that use them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum PreTokenizer {
    /// GPT-2's own regex inside the byte-level step (GPT-2, MPT, GPT-NeoX, files without a name).
    Gpt2,
    /// Every digit alone, then GPT-2's regex (StarCoder, SmolLM, Refact, Command-R).
    StarCoder,
    /// [`LLAMA3_REGEX`]; BPE takes a whole word that is in the vocabulary without merging.
    Llama3,
    /// [`QWEN2_REGEX`] after NFC.
    Qwen2,
    /// [`QWEN35_REGEX`], without normalization (combining marks stay separate tokens).
    Qwen35,
    /// Punctuation runs, GPT-2's regex, digit runs, then groups of three digits.
    Falcon,
    /// Newlines, then runs of cased-script letters, of punctuation, of trailing spaces and of
    /// CJK, then digit runs; no GPT-2 regex.
    DeepSeekLlm,
    /// Newlines, letters, punctuation, CJK, single digits; no GPT-2 regex.
    DeepSeekCoder,
}

/// Every `tokenizer.ggml.pre` name accepted, for the error message.
pub(crate) const SUPPORTED_PRE: &str = "gpt-2, gpt2, mpt, default (or none), starcoder, smollm, \
    refact, command-r, llama-bpe, llama3, llama-v3, qwen2, deepseek-r1-qwen, qwen35, falcon, \
    deepseek-llm, deepseek-coder";

impl PreTokenizer {
    pub(crate) fn from_name(name: &str) -> Option<Self> {
        Some(match name {
            "gpt-2" | "gpt2" | "mpt" | "default" => Self::Gpt2,
            "starcoder" | "smollm" | "refact" | "command-r" => Self::StarCoder,
            "llama-bpe" | "llama3" | "llama-v3" => Self::Llama3,
            "qwen2" | "deepseek-r1-qwen" => Self::Qwen2,
            "qwen35" => Self::Qwen35,
            "falcon" => Self::Falcon,
            "deepseek-llm" => Self::DeepSeekLlm,
            "deepseek-coder" => Self::DeepSeekCoder,
            _ => return None,
        })
    }

    /// The `tokenizers` pre-tokenizer: an optional split step, then the byte-level mapping.
    pub(crate) fn build(self) -> Result<PreTokenizerWrapper, TokenizerError> {
        let byte_level = |use_regex| {
            ByteLevel::default()
                .add_prefix_space(false)
                .use_regex(use_regex)
        };
        let split = |regex: &str| {
            Split::new(
                SplitPattern::Regex(regex.to_string()),
                SplitDelimiterBehavior::Isolated,
                false,
            )
            .map_err(|e| TokenizerError::Gguf(format!("pre-tokenizer regex does not compile: {e}")))
        };
        let steps: Vec<PreTokenizerWrapper> = match self {
            Self::Gpt2 => return Ok(byte_level(true).into()),
            Self::StarCoder => vec![Digits::new(true).into(), byte_level(true).into()],
            Self::Llama3 => vec![split(LLAMA3_REGEX)?.into(), byte_level(false).into()],
            Self::Qwen2 => vec![split(QWEN2_REGEX)?.into(), byte_level(false).into()],
            Self::Qwen35 => vec![split(QWEN35_REGEX)?.into(), byte_level(false).into()],
            Self::Falcon => vec![
                Punctuation::new(SplitDelimiterBehavior::Contiguous).into(),
                byte_level(true).into(),
                Digits::new(false).into(),
                split(r"[0-9][0-9][0-9]")?.into(),
            ],
            Self::DeepSeekLlm => vec![
                split(r"[\r\n]")?.into(),
                split(DEEPSEEK_LLM_LETTERS)?.into(),
                split(DEEPSEEK_LLM_PUNCTUATION)?.into(),
                split(r"\s+$")?.into(),
                split(DEEPSEEK_CJK)?.into(),
                Digits::new(false).into(),
                byte_level(false).into(),
            ],
            Self::DeepSeekCoder => vec![
                split(r"[\r\n]")?.into(),
                split(r"\s?\p{L}+")?.into(),
                split(r"\s?\p{P}+")?.into(),
                split(DEEPSEEK_CJK)?.into(),
                Digits::new(true).into(),
                byte_level(false).into(),
            ],
        };
        Ok(Sequence::new(steps).into())
    }

    /// Whether the original `tokenizer.json` NFC-normalizes text before splitting.
    pub(crate) fn nfc(self) -> bool {
        matches!(self, Self::Qwen2)
    }

    /// Whether BPE looks a whole pre-token up before merging (tiktoken's behaviour, kept by
    /// Llama-3's `tokenizer.json` and by llama.cpp for it).
    pub(crate) fn ignore_merges(self) -> bool {
        matches!(self, Self::Llama3)
    }

    /// Whether the model adds BOS when the file does not say (llama.cpp's default for Llama-3).
    pub(crate) fn adds_bos_by_default(self) -> bool {
        matches!(self, Self::Llama3)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_map_to_families_and_every_pipeline_builds() {
        assert_eq!(
            PreTokenizer::from_name("smollm"),
            Some(PreTokenizer::StarCoder)
        );
        assert_eq!(
            PreTokenizer::from_name("llama-bpe"),
            Some(PreTokenizer::Llama3)
        );
        assert!(PreTokenizer::from_name("tekken").is_none());
        for name in SUPPORTED_PRE.split(", ") {
            let name = name.trim_end_matches(" (or none)");
            let pre = PreTokenizer::from_name(name)
                .unwrap_or_else(|| panic!("{name} is listed but not accepted"));
            pre.build().unwrap();
        }
    }
}
