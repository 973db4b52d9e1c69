// SPDX-License-Identifier: MIT OR Apache-2.0
//! Plain text between markers: held-back marker prefixes and whitespace at segment edges.

/// Length in bytes of the longest suffix of `buf` that is a proper prefix of one of `markers`:
/// text that must be held back because the next chunk could complete a marker.
pub(crate) fn held_suffix_len(buf: &str, markers: &[&str]) -> usize {
    let longest = markers.iter().map(|m| m.len()).max().unwrap_or(0);
    let max = longest.saturating_sub(1).min(buf.len());
    (1..=max)
        .rev()
        .find(|&k| {
            let start = buf.len() - k;
            buf.is_char_boundary(start) && markers.iter().any(|m| m.starts_with(&buf[start..]))
        })
        .unwrap_or(0)
}

/// The earliest occurrence of any of `markers` in `buf`: (byte offset, marker).
pub(crate) fn find_first<'m>(buf: &str, markers: &[&'m str]) -> Option<(usize, &'m str)> {
    markers
        .iter()
        .filter_map(|m| buf.find(m).map(|at| (at, *m)))
        .min_by_key(|&(at, m)| (at, std::cmp::Reverse(m.len())))
}

/// One channel of text (content, or reasoning) whose segments are trimmed where they touch a
/// marker: whitespace right after a segment starts is dropped, and trailing whitespace is held
/// until more text of the same segment shows it was inner whitespace. Text inside a segment is
/// passed through verbatim.
#[derive(Debug, Default)]
pub(crate) struct TextChannel {
    /// Trailing whitespace not yet known to be inner.
    pending_ws: String,
    /// Drop whitespace until the next non-whitespace character.
    trim_leading: bool,
}

impl TextChannel {
    /// A channel whose first segment starts at a marker (its leading whitespace is dropped).
    pub(crate) fn at_segment_start() -> Self {
        TextChannel {
            pending_ws: String::new(),
            trim_leading: true,
        }
    }

    /// Takes confirmed text; returns what may be emitted now.
    pub(crate) fn push(&mut self, text: &str) -> Option<String> {
        let text = if self.trim_leading {
            let t = text.trim_start();
            self.trim_leading = t.is_empty();
            t
        } else {
            text
        };
        if text.is_empty() {
            return None;
        }
        let body = text.trim_end().len();
        if body == 0 {
            self.pending_ws.push_str(text);
            return None;
        }
        let mut out = std::mem::take(&mut self.pending_ws);
        out.push_str(&text[..body]);
        self.pending_ws.push_str(&text[body..]);
        Some(out)
    }

    /// The segment ends at a marker: its held trailing whitespace is dropped.
    pub(crate) fn end_segment(&mut self) {
        self.pending_ws.clear();
    }

    /// A new segment starts after a marker: its leading whitespace will be dropped. Whitespace
    /// still held from before the marker is kept (it is inner to the channel).
    pub(crate) fn start_segment(&mut self) {
        self.trim_leading = true;
    }

    /// The output ended: held trailing whitespace is text after all.
    pub(crate) fn finish(&mut self) -> Option<String> {
        let ws = std::mem::take(&mut self.pending_ws);
        (!ws.is_empty()).then_some(ws)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holds_back_marker_prefixes_only() {
        assert_eq!(held_suffix_len("abc <tool_", &["<tool_call>"]), 6);
        assert_eq!(held_suffix_len("abc <tool_call", &["<tool_call>"]), 10);
        assert_eq!(held_suffix_len("abc <toox", &["<tool_call>"]), 0);
        assert_eq!(held_suffix_len("é<", &["<think>"]), 1);
        assert_eq!(held_suffix_len("", &["<think>"]), 0);
    }

    #[test]
    fn channel_trims_only_segment_edges() {
        let mut c = TextChannel::at_segment_start();
        assert_eq!(c.push("\n\n"), None);
        assert_eq!(c.push(" a b "), Some("a b".into()));
        assert_eq!(c.push(" c\n"), Some("  c".into()));
        c.end_segment();
        assert_eq!(c.finish(), None);
    }
}
