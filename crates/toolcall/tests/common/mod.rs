// SPDX-License-Identifier: MIT OR Apache-2.0
//! Chunkings of a text for the streaming tests: a small seeded PRNG and split generators.

/// SplitMix64: tiny, seeded, the same on every platform.
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

    /// Uniform in `0..n` (n > 0).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

/// Every way of cutting `text` the tests use: one char per chunk, each single cut at a char
/// boundary (so next to and between multi-byte characters), and seeded random chunkings.
pub fn chunkings(text: &str) -> Vec<Vec<&str>> {
    let bounds: Vec<usize> = text.char_indices().map(|(i, _)| i).skip(1).collect();
    let mut out = Vec::new();
    out.push(
        text.char_indices()
            .map(|(i, c)| &text[i..i + c.len_utf8()])
            .collect(),
    );
    for &b in &bounds {
        out.push(vec![&text[..b], &text[b..]]);
    }
    for seed in 0..64u64 {
        let mut rng = Rng::new(seed);
        let max_chunk = 1 + rng.below(12);
        let mut cuts = vec![0];
        let mut at = 0;
        while at < bounds.len() {
            at += 1 + rng.below(max_chunk);
            if at <= bounds.len() {
                cuts.push(bounds[at - 1]);
            }
        }
        cuts.push(text.len());
        cuts.dedup();
        out.push(cuts.windows(2).map(|w| &text[w[0]..w[1]]).collect());
    }
    out
}
