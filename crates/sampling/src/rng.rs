// SPDX-License-Identifier: MIT OR Apache-2.0
//! The sampler's pseudo-random generator: xoshiro256** seeded through SplitMix64.
//!
//! Written here rather than taken from a crate so that a seed's stream is part of this crate's
//! contract: integer shifts, rotations and wrapping multiplies only, so the same seed gives the
//! same numbers on every platform and no dependency upgrade can change it. Both algorithms are
//! Vigna's public-domain reference designs (<https://prng.di.unimi.it/>); the tests pin their
//! published outputs. Not for cryptography.

/// SplitMix64: a 64-bit state stepped by a constant and scrambled on output.
///
/// Its only job here is to expand one `u64` seed into xoshiro's 256-bit state, as the xoshiro
/// authors recommend; any seed, zero included, gives a well-mixed state.
#[derive(Clone, Debug)]
pub struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    /// A generator whose first output is derived from `seed`.
    pub fn new(seed: u64) -> Self {
        Self { state: seed }
    }

    /// The next 64 uniformly distributed bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

/// xoshiro256**: 256 bits of state, period `2^256 - 1`, passes BigCrush; a few nanoseconds a draw.
#[derive(Clone, Debug)]
pub struct Xoshiro256StarStar {
    /// Never all zero (the one state the generator cannot leave).
    s: [u64; 4],
}

impl Xoshiro256StarStar {
    /// The generator for `seed`: its state is the first four outputs of [`SplitMix64::new`]`(seed)`.
    pub fn seed_from_u64(seed: u64) -> Self {
        let mut expand = SplitMix64::new(seed);
        let s = [
            expand.next_u64(),
            expand.next_u64(),
            expand.next_u64(),
            expand.next_u64(),
        ];
        // SplitMix64 is a bijection of a counter, so four consecutive outputs are never all zero.
        Self { s }
    }

    /// The generator with exactly this state, as the reference implementation is tested.
    ///
    /// # Panics
    /// If `state` is all zero: xoshiro would output zeros forever.
    pub fn from_state(state: [u64; 4]) -> Self {
        assert!(
            state != [0; 4],
            "xoshiro256** cannot start from the all-zero state"
        );
        Self { s: state }
    }

    /// The next 64 uniformly distributed bits.
    pub fn next_u64(&mut self) -> u64 {
        let result = self.s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = self.s[1] << 17;
        self.s[2] ^= self.s[0];
        self.s[3] ^= self.s[1];
        self.s[1] ^= self.s[2];
        self.s[0] ^= self.s[3];
        self.s[2] ^= t;
        self.s[3] = self.s[3].rotate_left(45);
        result
    }

    /// A uniform draw from `[0, 1)` with 53 bits of precision: every multiple of `2^-53` in the
    /// interval is equally likely. The conversion is exact, so it is platform-independent too.
    pub fn next_f64(&mut self) -> f64 {
        const SCALE: f64 = 1.0 / (1u64 << 53) as f64;
        (self.next_u64() >> 11) as f64 * SCALE
    }

    /// A uniform draw from `0..n` by Lemire's multiply-shift (bias below `n / 2^64`, which no
    /// test or sampler here can observe).
    ///
    /// # Panics
    /// If `n` is zero.
    pub fn next_below(&mut self, n: u64) -> u64 {
        assert!(n > 0, "next_below(0) has no value to return");
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splitmix64_matches_the_published_reference_stream() {
        // The first outputs for seed 1234567 of Vigna's splitmix64.c.
        let mut g = SplitMix64::new(1_234_567);
        let got: Vec<u64> = (0..5).map(|_| g.next_u64()).collect();
        assert_eq!(
            got,
            [
                6_457_827_717_110_365_317,
                3_203_168_211_198_807_973,
                9_817_491_932_198_370_423,
                4_593_380_528_125_082_431,
                16_408_922_859_458_223_821,
            ]
        );
    }

    #[test]
    fn xoshiro256starstar_matches_the_reference_from_state_1_2_3_4() {
        let mut g = Xoshiro256StarStar::from_state([1, 2, 3, 4]);
        let got: Vec<u64> = (0..6).map(|_| g.next_u64()).collect();
        assert_eq!(
            got,
            [
                11_520,
                0,
                1_509_978_240,
                1_215_971_899_390_074_240,
                1_216_172_134_540_287_360,
                607_988_272_756_665_600,
            ]
        );
    }

    #[test]
    fn seeding_goes_through_splitmix64() {
        let mut g = Xoshiro256StarStar::seed_from_u64(0);
        let got: Vec<u64> = (0..3).map(|_| g.next_u64()).collect();
        assert_eq!(
            got,
            [
                11_091_344_671_253_066_420,
                13_793_997_310_169_335_082,
                1_900_383_378_846_508_768
            ]
        );
    }

    #[test]
    fn next_f64_stays_in_the_unit_interval_and_fills_it() {
        let mut g = Xoshiro256StarStar::seed_from_u64(7);
        let draws: Vec<f64> = (0..10_000).map(|_| g.next_f64()).collect();
        assert!(draws.iter().all(|&u| (0.0..1.0).contains(&u)));
        let mean = draws.iter().sum::<f64>() / draws.len() as f64;
        assert!((mean - 0.5).abs() < 0.01, "mean {mean}");
    }

    #[test]
    fn next_below_covers_its_range() {
        let mut g = Xoshiro256StarStar::seed_from_u64(3);
        let mut seen = [0u32; 10];
        for _ in 0..10_000 {
            seen[g.next_below(10) as usize] += 1;
        }
        assert!(seen.iter().all(|&c| (900..1100).contains(&c)), "{seen:?}");
    }
}
