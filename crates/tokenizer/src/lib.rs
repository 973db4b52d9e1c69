// SPDX-License-Identifier: MIT OR Apache-2.0
//! Text ⇄ token ids, streaming detokenization, and chat templates.
//!
//! The central decision: **one tokenization engine, Hugging Face `tokenizers`, whatever the model
//! file.** A Hugging Face checkpoint's `tokenizer.json` is loaded as is; a GGUF file's embedded
//! vocabulary (tokens, merges, token types, the `tokenizer.ggml.pre` name) is turned into the same
//! `tokenizers` pipeline the original `tokenizer.json` described (byte-level BPE, the model's
//! pre-tokenizer regex, its added tokens). So both formats give the ids the model was trained on,
//! which llama.cpp's golden vectors (made with `transformers`) check.
//!
//! Chat templates are rendered with MiniJinja set up the way `transformers` sets up Jinja2
//! (`trim_blocks`, `lstrip_blocks`, a `tojson` that is Python's `json.dumps`, `raise_exception`,
//! `strftime_now`, ordered dicts, Python string methods), and the inputs are prepared the way
//! `apply_chat_template` prepares them; the tests compare against strings `transformers` rendered.
//!
//! This crate reads tokenizer files and model metadata; it never touches a GPU or the network.

#![forbid(unsafe_code)]

mod error;
mod gguf;
mod hf;
mod pretokenizer;
mod python;
mod stream;
mod strftime;
mod template;

pub use error::TokenizerError;
pub use stream::DecodeStream;
pub use template::{ChatTemplate, RenderOptions};

/// A loaded tokenizer: the encoder/decoder, the ids that delimit sequences, and the chat
/// template(s) the model ships with.
///
/// Invariant: every id it reports (`bos_token_id`, `eos_token_ids`, `pad_token_id`) is in the
/// vocabulary.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    bos_token_id: Option<u32>,
    eos_token_ids: Vec<u32>,
    pad_token_id: Option<u32>,
    /// Named templates in the order the model files list them; the unnamed one is `"default"`.
    templates: Vec<(String, ChatTemplate)>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size())
            .field("bos_token_id", &self.bos_token_id)
            .field("eos_token_ids", &self.eos_token_ids)
            .field("pad_token_id", &self.pad_token_id)
            .field(
                "templates",
                &self.templates.iter().map(|(n, _)| n).collect::<Vec<_>>(),
            )
            .finish()
    }
}

impl Tokenizer {
    /// Encodes `text`. Added and special tokens written in the text (`<|im_start|>`) are matched
    /// whole, as in `transformers`; `add_special_tokens` adds what the model adds around a
    /// sequence (Llama-3's `<|begin_of_text|>`; nothing for Qwen).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizerError> {
        let encoding = self
            .inner
            .encode_fast(text, add_special_tokens)
            .map_err(|e| TokenizerError::Encode(e.to_string()))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// Decodes `ids` to text; special tokens (control tokens such as `<|im_end|>`) are left out
    /// when `skip_special_tokens`. Bytes that do not form valid UTF-8 become U+FFFD, as in
    /// `transformers`; use [`DecodeStream`] to decode a growing sequence without them.
    ///
    /// Unlike `transformers`, no "clean-up of tokenization spaces" is applied, so
    /// `decode(encode(s)) == s`.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, TokenizerError> {
        let vocab_size = self.vocab_size();
        if let Some(&id) = ids.iter().find(|&&id| id as usize >= vocab_size) {
            return Err(TokenizerError::UnknownId { id, vocab_size });
        }
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(|e| TokenizerError::Decode(e.to_string()))
    }

    /// Number of ids, added tokens included (the model's embedding may have more rows).
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The beginning-of-sequence token, if the model has one.
    pub fn bos_token_id(&self) -> Option<u32> {
        self.bos_token_id
    }

    /// Every id that ends generation: the tokenizer's EOS first, then the ones
    /// `generation_config.json` (or GGUF's EOT/EOM keys) add. May be empty.
    pub fn eos_token_ids(&self) -> &[u32] {
        &self.eos_token_ids
    }

    /// The padding token, if the model names one.
    pub fn pad_token_id(&self) -> Option<u32> {
        self.pad_token_id
    }

    /// The id of a token given in its vocabulary spelling (`<|im_end|>`, `Ġthe`).
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The vocabulary spelling of an id (byte-level BPE spells a space `Ġ`).
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The model's chat template: the one named `default`, or the only one. `None` if the model
    /// ships none.
    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.chat_template_named("default")
            .or(match self.templates.as_slice() {
                [(_, only)] => Some(only),
                _ => None,
            })
    }

    /// A named template (models may ship several, e.g. `default` and `tool_use`; `transformers`
    /// picks `tool_use` when tools are given and it exists).
    pub fn chat_template_named(&self, name: &str) -> Option<&ChatTemplate> {
        self.templates
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, t)| t)
    }

    /// The names of the chat templates the model ships, in file order.
    pub fn chat_template_names(&self) -> impl Iterator<Item = &str> {
        self.templates.iter().map(|(n, _)| n.as_str())
    }

    /// The underlying Hugging Face tokenizer, for components that consume one directly
    /// (constrained decoding builds its token trie from it).
    pub fn as_hf_tokenizer(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }
}
