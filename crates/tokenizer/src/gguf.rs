// SPDX-License-Identifier: MIT OR Apache-2.0
//! A GGUF file's embedded vocabulary, rebuilt as the `tokenizers` pipeline of the model's
//! original `tokenizer.json`: byte-level BPE over the stored tokens and merges, the pre-tokenizer
//! the `tokenizer.ggml.pre` name stands for ([`PreTokenizer`]), or SentencePiece BPE over the
//! tokens and their scores (`spm_tokenizer`); control and user-defined tokens as added tokens,
//! and the BOS/EOS wrapping the file asks for.

use std::collections::BTreeMap;

use metrale_config::MetaValue;
use metrale_model_weights::GgufFile;
use tokenizers::AddedToken;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{BPE, Merges, Vocab};
use tokenizers::normalizers::NFC;
use tokenizers::processors::template::{SpecialToken, TemplateProcessing};

use crate::pretokenizer::{PreTokenizer, SUPPORTED_PRE};
use crate::{ChatTemplate, Tokenizer, TokenizerError};

/// GGUF `tokenizer.ggml.token_type` values (llama.cpp's `llama_token_type`).
const TOKEN_TYPE_CONTROL: u64 = 3;
const TOKEN_TYPE_USER_DEFINED: u64 = 4;

/// Typed reads of GGUF metadata whose errors name the key.
struct Meta<'a>(&'a BTreeMap<String, MetaValue>);

impl Meta<'_> {
    fn get(&self, key: &str) -> Option<&MetaValue> {
        self.0.get(key)
    }
    fn str(&self, key: &str) -> Result<Option<&str>, TokenizerError> {
        self.get(key)
            .map(|v| {
                v.as_str()
                    .ok_or_else(|| TokenizerError::Gguf(format!("`{key}` is not a string")))
            })
            .transpose()
    }
    fn u32(&self, key: &str) -> Result<Option<u32>, TokenizerError> {
        self.get(key)
            .map(|v| {
                v.as_u64()
                    .and_then(|v| u32::try_from(v).ok())
                    .ok_or_else(|| TokenizerError::Gguf(format!("`{key}` is not a token id")))
            })
            .transpose()
    }
    fn bool(&self, key: &str) -> Option<bool> {
        match self.get(key) {
            Some(MetaValue::Bool(b)) => Some(*b),
            _ => None,
        }
    }
    fn strings(&self, key: &str) -> Result<Option<Vec<&str>>, TokenizerError> {
        let Some(value) = self.get(key) else {
            return Ok(None);
        };
        let bad = || TokenizerError::Gguf(format!("`{key}` is not an array of strings"));
        let items = value.as_array().ok_or_else(bad)?;
        items
            .iter()
            .map(|v| v.as_str().ok_or_else(bad))
            .collect::<Result<Vec<_>, _>>()
            .map(Some)
    }
}

impl Tokenizer {
    /// Builds the tokenizer a GGUF file embeds: byte-level BPE (`tokenizer.ggml.model = "gpt2"`)
    /// from `tokenizer.ggml.tokens` and `.merges`, the pre-tokenizer `tokenizer.ggml.pre` names,
    /// or SentencePiece BPE (`"llama"`) from the tokens and `tokenizer.ggml.scores`,
    /// control and user-defined tokens as added tokens (matched whole), BOS/EOS/padding ids, and
    /// the chat template(s).
    pub fn from_gguf(gguf: &GgufFile) -> Result<Self, TokenizerError> {
        let meta = Meta(&gguf.metadata);
        let model = meta.str("tokenizer.ggml.model")?.ok_or_else(|| {
            TokenizerError::Gguf(
                "the file has no `tokenizer.ggml.model`: it embeds no tokenizer; serve the model's \
                 Hugging Face checkpoint directory (config.json, safetensors, tokenizer.json) \
                 instead"
                    .into(),
            )
        })?;
        let tokens = meta
            .strings("tokenizer.ggml.tokens")?
            .ok_or_else(|| TokenizerError::Gguf("`tokenizer.ggml.tokens` is missing".into()))?;
        let (mut inner, bos_by_default) = match model {
            "gpt2" => {
                let pre_name = meta.str("tokenizer.ggml.pre")?.unwrap_or("default");
                let pre = PreTokenizer::from_name(pre_name).ok_or_else(|| {
                    TokenizerError::Gguf(format!(
                        "pre-tokenizer `{pre_name}` (tokenizer.ggml.pre) is not supported \
                         (supported: {SUPPORTED_PRE}); serve the model's Hugging Face checkpoint \
                         directory instead"
                    ))
                })?;
                (
                    bpe_tokenizer(&meta, pre, &tokens)?,
                    pre.adds_bos_by_default(),
                )
            }
            // SentencePiece BPE (Llama 2, Mistral, Mixtral, Phi-3): llama.cpp adds BOS unless
            // told otherwise.
            "llama" => (spm_tokenizer(&meta, &tokens)?, true),
            _ => {
                return Err(TokenizerError::Gguf(format!(
                    "tokenizer model `{model}` is not supported (supported: `gpt2`, byte-level \
                     BPE; `llama`, SentencePiece BPE); serve the model's Hugging Face checkpoint \
                     directory instead"
                )));
            }
        };
        let ids = SpecialIds::read(&meta, tokens.len())?;
        let add_bos = meta
            .bool("tokenizer.ggml.add_bos_token")
            .unwrap_or(bos_by_default);
        let add_eos = meta.bool("tokenizer.ggml.add_eos_token").unwrap_or(false);
        let with_text = |id: u32| (tokens[id as usize], id);
        let wrap_bos = ids.bos.filter(|_| add_bos).map(with_text);
        let wrap_eos = ids.eos.first().copied().filter(|_| add_eos).map(with_text);
        if wrap_bos.is_some() || wrap_eos.is_some() {
            inner.with_post_processor(Some(wrap_template(wrap_bos, wrap_eos)?));
        }
        let templates = chat_templates(&meta, &ids, &tokens)?;
        Ok(Tokenizer {
            inner,
            bos_token_id: ids.bos,
            eos_token_ids: ids.eos,
            pad_token_id: ids.pad,
            templates,
        })
    }
}

/// The BPE model, pre-tokenizer, byte-level decoder and added tokens.
fn bpe_tokenizer(
    meta: &Meta<'_>,
    pre: PreTokenizer,
    tokens: &[&str],
) -> Result<tokenizers::Tokenizer, TokenizerError> {
    let merges = meta.strings("tokenizer.ggml.merges")?.ok_or_else(|| {
        TokenizerError::Gguf(
            "`tokenizer.ggml.merges` is missing (a BPE vocabulary needs it)".into(),
        )
    })?;
    let types = token_types(meta, tokens.len())?;

    let vocab = vocab_of(tokens)?;
    let merges = merges
        .iter()
        .enumerate()
        .map(|(rank, line)| {
            split_merge(line).ok_or_else(|| {
                TokenizerError::Gguf(format!(
                    "merge {rank} `{line}` is not two tokens separated by a space"
                ))
            })
        })
        .collect::<Result<Merges, _>>()?;
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .ignore_merges(pre.ignore_merges())
        .build()
        .map_err(|e| TokenizerError::Gguf(format!("the BPE vocabulary is inconsistent: {e}")))?;

    let mut inner = tokenizers::Tokenizer::new(bpe);
    if pre.nfc() {
        inner
            .with_normalizer(Some(NFC))
            .map_err(|e| TokenizerError::Gguf(format!("cannot set the normalizer: {e}")))?;
    }
    inner.with_pre_tokenizer(Some(pre.build()?));
    inner.with_decoder(Some(ByteLevelDecoder::default()));
    add_typed_tokens(&mut inner, tokens, &types)?;
    Ok(inner)
}

/// A SentencePiece BPE vocabulary (`tokenizer.ggml.model = "llama"`) as the `tokenizers` pipeline
/// transformers converts it to: spaces as `▁` and one `▁` before the text (and after each special
/// token, as llama.cpp adds it, where `tokenizer.ggml.add_space_prefix` is not false), BPE whose
/// merges are every split of a token into two tokens, ranked by the merged token's score (the
/// piece SentencePiece merges first), characters outside the vocabulary as their `<0xXX>` byte
/// tokens; control and user-defined tokens added whole.
fn spm_tokenizer(
    meta: &Meta<'_>,
    tokens: &[&str],
) -> Result<tokenizers::Tokenizer, TokenizerError> {
    use tokenizers::decoders::byte_fallback::ByteFallback;
    use tokenizers::decoders::fuse::Fuse;
    use tokenizers::decoders::sequence::Sequence as DecoderSequence;
    use tokenizers::decoders::strip::Strip;
    use tokenizers::normalizers::{Prepend, Replace, Sequence as NormalizerSequence};

    let key = "tokenizer.ggml.scores";
    let bad = || TokenizerError::Gguf(format!("`{key}` is not an array of numbers"));
    let scores = meta
        .get(key)
        .ok_or_else(|| {
            TokenizerError::Gguf(format!(
                "`{key}` is missing (a SentencePiece vocabulary needs it)"
            ))
        })?
        .as_array()
        .ok_or_else(bad)?
        .iter()
        .map(|v| v.as_f64().ok_or_else(bad))
        .collect::<Result<Vec<_>, _>>()?;
    if scores.len() != tokens.len() {
        return Err(TokenizerError::Gguf(format!(
            "`{key}` has {} entries but `tokenizer.ggml.tokens` has {}",
            scores.len(),
            tokens.len()
        )));
    }
    let types = token_types(meta, tokens.len())?;
    let vocab = vocab_of(tokens)?;
    // Every way a token splits into two tokens, the splits of one token by their parts' ids,
    // the tokens by descending score (a stable sort: equal scores keep id order).
    let mut merges: Vec<(f64, u32, u32, u32)> = Vec::new();
    for (id, &token) in tokens.iter().enumerate() {
        for (at, _) in token.char_indices().skip(1) {
            let (l, r) = token.split_at(at);
            if let (Some(&a), Some(&b)) = (vocab.get(l), vocab.get(r)) {
                merges.push((scores[id], id as u32, a, b));
            }
        }
    }
    merges.sort_by(|x, y| {
        y.0.total_cmp(&x.0)
            .then(x.1.cmp(&y.1))
            .then(x.2.cmp(&y.2))
            .then(x.3.cmp(&y.3))
    });
    let merges: Merges = merges
        .into_iter()
        .map(|(_, _, a, b)| {
            (
                tokens[a as usize].to_string(),
                tokens[b as usize].to_string(),
            )
        })
        .collect();
    let mut builder = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .byte_fallback(true)
        .fuse_unk(true);
    let unk = meta.u32("tokenizer.ggml.unknown_token_id")?;
    if let Some(unk) = unk.and_then(|u| tokens.get(u as usize)) {
        builder = builder.unk_token(unk.to_string());
    }
    let bpe = builder.build().map_err(|e| {
        TokenizerError::Gguf(format!("the SentencePiece vocabulary is inconsistent: {e}"))
    })?;
    let mut inner = tokenizers::Tokenizer::new(bpe);
    let space = Replace::new(" ", "▁")
        .map_err(|e| TokenizerError::Gguf(format!("cannot build the normalizer: {e}")))?;
    let normalizer = match meta.bool("tokenizer.ggml.add_space_prefix").unwrap_or(true) {
        true => NormalizerSequence::new(vec![Prepend::new("▁".into()).into(), space.into()]),
        false => NormalizerSequence::new(vec![space.into()]),
    };
    inner
        .with_normalizer(Some(normalizer))
        .map_err(|e| TokenizerError::Gguf(format!("cannot set the normalizer: {e}")))?;
    let unspace = Replace::new("▁", " ")
        .map_err(|e| TokenizerError::Gguf(format!("cannot build the decoder: {e}")))?;
    inner.with_decoder(Some(DecoderSequence::new(vec![
        unspace.into(),
        ByteFallback::default().into(),
        Fuse::default().into(),
        Strip::new(' ', 1, 0).into(),
    ])));
    add_typed_tokens(&mut inner, tokens, &types)?;
    Ok(inner)
}

/// Token to id, refusing a token that appears twice.
fn vocab_of(tokens: &[&str]) -> Result<Vocab, TokenizerError> {
    let mut vocab = Vocab::default();
    for (id, &token) in tokens.iter().enumerate() {
        if let Some(first) = vocab.insert(token.to_string(), id as u32) {
            return Err(TokenizerError::Gguf(format!(
                "token `{token}` appears twice in `tokenizer.ggml.tokens` (ids {first} and {id})"
            )));
        }
    }
    Ok(vocab)
}

/// Control tokens as special added tokens (skipped by `decode(.., true)`); user-defined ones
/// (Qwen's `<tool_call>`) as ordinary text that is still matched whole, as in their
/// tokenizer.json.
fn add_typed_tokens(
    inner: &mut tokenizers::Tokenizer,
    tokens: &[&str],
    types: &[u64],
) -> Result<(), TokenizerError> {
    let added: Vec<AddedToken> = tokens
        .iter()
        .zip(types)
        .filter_map(|(&token, &ty)| match ty {
            TOKEN_TYPE_CONTROL => Some(AddedToken::from(token, true)),
            TOKEN_TYPE_USER_DEFINED => Some(AddedToken::from(token, false).normalized(false)),
            _ => None,
        })
        .collect();
    inner.add_special_tokens(added).map_err(|e| {
        TokenizerError::Gguf(format!(
            "cannot add the control and user-defined tokens: {e}"
        ))
    })?;
    Ok(())
}

/// The token ids the metadata names, each checked against the vocabulary.
struct SpecialIds {
    bos: Option<u32>,
    /// EOS, then EOT and EOM (llama.cpp ends generation on each), without repeats.
    eos: Vec<u32>,
    pad: Option<u32>,
    unk: Option<u32>,
}

impl SpecialIds {
    fn read(meta: &Meta<'_>, n_tokens: usize) -> Result<Self, TokenizerError> {
        let id = |key: &str| -> Result<Option<u32>, TokenizerError> {
            match meta.u32(key)? {
                Some(id) if id as usize >= n_tokens => Err(TokenizerError::Gguf(format!(
                    "`{key}` = {id} is outside the vocabulary ({n_tokens} tokens)"
                ))),
                id => Ok(id),
            }
        };
        let mut eos = Vec::new();
        for key in [
            "tokenizer.ggml.eos_token_id",
            "tokenizer.ggml.eot_token_id",
            "tokenizer.ggml.eom_token_id",
        ] {
            if let Some(e) = id(key)?
                && !eos.contains(&e)
            {
                eos.push(e);
            }
        }
        Ok(SpecialIds {
            bos: id("tokenizer.ggml.bos_token_id")?,
            eos,
            pad: id("tokenizer.ggml.padding_token_id")?,
            unk: id("tokenizer.ggml.unknown_token_id")?,
        })
    }
}

/// `tokenizer.chat_template` (as `default`) and the named `tokenizer.chat_template.<name>` ones,
/// rendered with the special tokens' text as `transformers` would pass them.
fn chat_templates(
    meta: &Meta<'_>,
    ids: &SpecialIds,
    tokens: &[&str],
) -> Result<Vec<(String, ChatTemplate)>, TokenizerError> {
    let mut sources = Vec::new();
    if let Some(source) = meta.str("tokenizer.chat_template")? {
        sources.push(("default".to_string(), source));
    }
    for name in meta
        .strings("tokenizer.chat_templates")?
        .unwrap_or_default()
    {
        if let Some(source) = meta.str(&format!("tokenizer.chat_template.{name}"))? {
            sources.push((name.to_string(), source));
        }
    }
    let text = |id: Option<u32>| id.map(|id| tokens[id as usize].to_string());
    sources
        .into_iter()
        .map(|(name, source)| {
            let mut template =
                ChatTemplate::new(source, text(ids.bos), text(ids.eos.first().copied()))?;
            for (key, id) in [("unk_token", ids.unk), ("pad_token", ids.pad)] {
                if let Some(token) = text(id) {
                    template = template.with_variable(key, serde_json::Value::String(token));
                }
            }
            Ok((name, template))
        })
        .collect()
}

/// The token types, one per token; all "normal" when the file has none.
fn token_types(meta: &Meta<'_>, n_tokens: usize) -> Result<Vec<u64>, TokenizerError> {
    let key = "tokenizer.ggml.token_type";
    let Some(value) = meta.get(key) else {
        return Ok(vec![1; n_tokens]);
    };
    let bad = || TokenizerError::Gguf(format!("`{key}` is not an array of integers"));
    let types = value
        .as_array()
        .ok_or_else(bad)?
        .iter()
        .map(|v| v.as_u64().ok_or_else(bad))
        .collect::<Result<Vec<_>, _>>()?;
    if types.len() != n_tokens {
        return Err(TokenizerError::Gguf(format!(
            "`{key}` has {} entries but `tokenizer.ggml.tokens` has {n_tokens}",
            types.len()
        )));
    }
    Ok(types)
}

/// Splits a merge `"a b"` at the first space after the first character (a token may itself be a
/// space, as llama.cpp allows).
fn split_merge(line: &str) -> Option<(String, String)> {
    let first_len = line.chars().next()?.len_utf8();
    let at = first_len + line[first_len..].find(' ')?;
    Some((line[..at].to_string(), line[at + 1..].to_string()))
}

/// The post-processor that adds BOS before and/or EOS after each sequence. Template pieces are
/// keyed `bos`/`eos` rather than by the token text, which may contain the template syntax's `:`.
fn wrap_template(
    bos: Option<(&str, u32)>,
    eos: Option<(&str, u32)>,
) -> Result<TemplateProcessing, TokenizerError> {
    let err = |e: String| TokenizerError::Gguf(format!("cannot build the BOS/EOS template: {e}"));
    let seq = |name: &str, type_id: u32| {
        let key = |t: Option<(&str, u32)>, key: &str| t.map(|_| format!("{key}:{type_id}"));
        [
            key(bos, "bos"),
            Some(format!("${name}:{type_id}")),
            key(eos, "eos"),
        ]
        .into_iter()
        .flatten()
        .collect::<Vec<_>>()
    };
    let mut specials = Vec::new();
    for (key, token) in [("bos", bos), ("eos", eos)] {
        if let Some((text, id)) = token {
            specials.push(
                SpecialToken::new(key.into(), vec![id], vec![text.into()])
                    .map_err(|e| err(e.to_string()))?,
            );
        }
    }
    TemplateProcessing::builder()
        .try_single(seq("A", 0))
        .map_err(err)?
        .try_pair([seq("A", 0), seq("B", 1)].concat())
        .map_err(err)?
        .special_tokens(specials)
        .build()
        .map_err(|e| err(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merges_split_after_the_first_character() {
        assert_eq!(split_merge("Ġ t"), Some(("Ġ".into(), "t".into())));
        assert_eq!(split_merge("  x"), Some((" ".into(), "x".into())));
        assert_eq!(split_merge("ab"), None);
    }
}
