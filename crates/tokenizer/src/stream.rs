// SPDX-License-Identifier: MIT OR Apache-2.0
//! Incremental detokenization for streamed responses.
//!
//! A token may end in the middle of a UTF-8 character (byte-level BPE splits emoji and CJK into
//! byte tokens), and some decoders change how a token reads depending on its neighbours. So each
//! step decodes a short window of recent ids twice, without and with the new ids, and emits the
//! difference only once it no longer ends in an incomplete character (U+FFFD). The window then
//! slides forward, so a step costs O(window), not O(sequence).

use crate::{Tokenizer, TokenizerError};

/// The state of one streamed decode. Holds ids, not the tokenizer, so it can live in a request
/// while the tokenizer is shared.
///
/// Invariant: `prefix_offset <= read_offset <= ids.len()`; the text of `ids[..read_offset]` has
/// been returned.
#[derive(Clone, Debug, Default)]
pub struct DecodeStream {
    skip_special_tokens: bool,
    ids: Vec<u32>,
    /// Where the context window starts: ids decoded again only to get their neighbours right.
    prefix_offset: usize,
    /// Ids from here on have not produced text yet.
    read_offset: usize,
}

impl DecodeStream {
    /// A stream that leaves special tokens out of the text when `skip_special_tokens`.
    pub fn new(skip_special_tokens: bool) -> Self {
        DecodeStream {
            skip_special_tokens,
            ..Self::default()
        }
    }

    /// Adds one id; returns the text it completes, or `None` while a character is still
    /// incomplete (or the token adds no text, like a skipped special token). Bytes that never
    /// form a character are held until a later token completes text after them, or until
    /// [`finish`](Self::finish).
    pub fn step(
        &mut self,
        tokenizer: &Tokenizer,
        id: u32,
    ) -> Result<Option<String>, TokenizerError> {
        self.ids.push(id);
        let prefix = tokenizer.decode(
            &self.ids[self.prefix_offset..self.read_offset],
            self.skip_special_tokens,
        )?;
        let text = tokenizer.decode(&self.ids[self.prefix_offset..], self.skip_special_tokens)?;
        if text.len() <= prefix.len() || text.ends_with('\u{FFFD}') {
            return Ok(None);
        }
        let Some(new) = text.get(prefix.len()..) else {
            return Ok(None);
        };
        let new = new.to_string();
        self.prefix_offset = self.read_offset;
        self.read_offset = self.ids.len();
        Ok(Some(new))
    }

    /// Ends the stream: returns the text of ids still held back (an incomplete character becomes
    /// U+FFFD, as [`Tokenizer::decode`] writes it), or `None` if everything was returned.
    pub fn finish(&mut self, tokenizer: &Tokenizer) -> Result<Option<String>, TokenizerError> {
        let prefix = tokenizer.decode(
            &self.ids[self.prefix_offset..self.read_offset],
            self.skip_special_tokens,
        )?;
        let text = tokenizer.decode(&self.ids[self.prefix_offset..], self.skip_special_tokens)?;
        self.prefix_offset = self.read_offset;
        self.read_offset = self.ids.len();
        Ok(text
            .get(prefix.len()..)
            .filter(|s| !s.is_empty())
            .map(str::to_string))
    }

    /// Every id added so far.
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }
}
