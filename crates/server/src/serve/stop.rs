// SPDX-License-Identifier: MIT OR Apache-2.0
//! Stop strings over streamed text: text is released only once no stop string can still begin in
//! it, so a stop string split across tokens is caught and never emitted.

/// Watches a stream of text chunks for any of a set of stop strings.
#[derive(Debug, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    /// Position of each kept stop string in the caller's list (empty strings are dropped).
    index: Vec<usize>,
    /// Text received but not yet released (it may be the start of a stop string).
    held: String,
}

/// What a chunk of text amounts to.
#[derive(Debug, PartialEq, Eq)]
pub enum StopOutcome {
    /// Text that is safe to emit (possibly empty).
    Emit(String),
    /// Stop string number `.1` (in the order given) was found: emit `.0` (everything before it),
    /// then finish.
    Stopped(String, usize),
}

impl StopMatcher {
    /// A matcher for `stops` (empty strings are ignored).
    pub fn new(stops: Vec<String>) -> Self {
        let (index, stops) = stops
            .into_iter()
            .enumerate()
            .filter(|(_, s)| !s.is_empty())
            .unzip();
        StopMatcher {
            stops,
            index,
            held: String::new(),
        }
    }

    /// Feeds the next chunk of generated text.
    pub fn push(&mut self, chunk: &str) -> StopOutcome {
        self.held.push_str(chunk);
        if self.stops.is_empty() {
            return StopOutcome::Emit(std::mem::take(&mut self.held));
        }
        // The earliest complete stop string ends the output.
        let found = self
            .stops
            .iter()
            .enumerate()
            .filter_map(|(i, s)| self.held.find(s.as_str()).map(|at| (at, i)))
            .min();
        if let Some((at, which)) = found {
            let out = self.held[..at].to_string();
            self.held.clear();
            return StopOutcome::Stopped(out, self.index[which]);
        }
        // Hold back the longest suffix that is a proper prefix of some stop string.
        let keep = self
            .stops
            .iter()
            .flat_map(|s| {
                (1..s.len())
                    .filter(|&n| s.is_char_boundary(n))
                    .map(move |n| &s[..n])
            })
            .filter(|prefix| self.held.ends_with(prefix))
            .map(str::len)
            .max()
            .unwrap_or(0);
        let cut = self.held.len() - keep;
        let out = self.held[..cut].to_string();
        self.held.drain(..cut);
        StopOutcome::Emit(out)
    }

    /// The end of generation: whatever was held is released.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds `chunks`, returns the emitted text and whether a stop fired.
    fn run(stops: &[&str], chunks: &[&str]) -> (String, bool) {
        let mut m = StopMatcher::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = String::new();
        for c in chunks {
            match m.push(c) {
                StopOutcome::Emit(t) => out.push_str(&t),
                StopOutcome::Stopped(t, _) => {
                    out.push_str(&t);
                    return (out, true);
                }
            }
        }
        out.push_str(&m.finish());
        (out, false)
    }

    #[test]
    fn stop_split_across_chunks_is_never_emitted() {
        assert_eq!(
            run(&["END"], &["hello E", "N", "D world"]),
            ("hello ".into(), true)
        );
        assert_eq!(run(&["\n\n"], &["a\n", "\nb"]), ("a".into(), true));
        assert_eq!(
            run(&["xyz"], &["abc", "xy"]),
            ("abcxy".into(), false),
            "a held prefix is released at the end"
        );
        assert_eq!(run(&[], &["a", "b"]), ("ab".into(), false));
        assert_eq!(run(&["é!"], &["caf", "é", "!"]), ("caf".into(), true));
    }

    #[test]
    fn reports_which_stop_string_matched() {
        let mut m = StopMatcher::new(vec!["".into(), "zz".into(), "b".into()]);
        assert_eq!(m.push("aab"), StopOutcome::Stopped("aa".into(), 2));
    }

    #[test]
    fn property_any_chunking_gives_the_same_result() {
        let texts = [
            "the cat sat on the mat. END of story",
            "no stop here at all",
            "ENENDD",
            "aaaa\n\nbbbb",
            "ééé stop ééé",
        ];
        let stops: &[&[&str]] = &[&["END"], &["\n\n", "mat"], &["stop", "NEN"], &[]];
        let mut seed = 7u64;
        for text in texts {
            for s in stops {
                let whole = run(s, &[text]);
                for _ in 0..50 {
                    // Random split points on char boundaries.
                    let mut chunks = Vec::new();
                    let mut rest = text;
                    while !rest.is_empty() {
                        seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
                        let mut n = 1 + (seed >> 33) as usize % 4;
                        while n < rest.len() && !rest.is_char_boundary(n) {
                            n += 1;
                        }
                        let n = n.min(rest.len());
                        chunks.push(&rest[..n]);
                        rest = &rest[n..];
                    }
                    assert_eq!(run(s, &chunks), whole, "{text:?} {s:?} {chunks:?}");
                }
            }
        }
    }
}
