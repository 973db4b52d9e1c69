// SPDX-License-Identifier: MIT OR Apache-2.0
//! FP8 E4M3 (`float8_e4m3fn`, the OCP "FN" variant Hopper's tensor cores and PyTorch use): one
//! sign bit, four exponent bits (bias 7), three mantissa bits. Finite range ±448; no infinities;
//! `0x7F` and `0xFF` are NaN. Subnormals are `m × 2⁻⁹` for `m` in 1..=7, so the smallest positive
//! value is 2⁻⁹ and every E4M3 value is exact in f16, bf16 and f32.
//!
//! The encoder rounds to nearest, ties to even, and **saturates**: a finite value beyond ±448
//! (after rounding) becomes ±448, as PyTorch's `to(float8_e4m3fn)` after the clamp every FP8
//! quantizer applies. Infinities also saturate; NaN encodes as `0x7F`. Callers that must not
//! accept NaN or infinities (the weight quantizer) refuse them before encoding.

/// The largest finite E4M3 magnitude.
pub const E4M3_MAX: f32 = 448.0;

/// The scale of a block (weight or activation) whose largest magnitude is `amax`, so that it maps
/// to ±448: `amax / 448`, or 1 where that is not a positive number (an all-zero block, or one so
/// small the quotient underflows). Every FP8 quantizer of the engine and its references uses it.
pub fn e4m3_block_scale(amax: f32) -> f32 {
    if amax > 0.0 && amax / E4M3_MAX > 0.0 {
        amax / E4M3_MAX
    } else {
        1.0
    }
}

/// The NaN encoding the encoder produces (`0x7F`; `0xFF` is NaN too).
pub const E4M3_NAN: u8 = 0x7F;

/// The value of an E4M3 byte (exact).
pub fn e4m3_to_f32(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let exp = i32::from((b >> 3) & 0xF);
    let man = f32::from(b & 7);
    if exp == 0xF && b & 7 == 7 {
        return f32::NAN;
    }
    let magnitude = if exp == 0 {
        man * (1.0 / 512.0)
    } else {
        (1.0 + man / 8.0) * 2f32.powi(exp - 7)
    };
    sign * magnitude
}

/// `x` rounded to the nearest E4M3 value (ties to even), saturating at ±448; NaN becomes
/// [`E4M3_NAN`].
pub fn f32_to_e4m3(x: f32) -> u8 {
    if x.is_nan() {
        return E4M3_NAN;
    }
    let sign = if x.is_sign_negative() { 0x80u8 } else { 0 };
    let a = x.abs();
    let magnitude = if a < 1.0 / 64.0 {
        // Below the smallest normal (2^-6): multiples of 2^-9, and the code is the multiple
        // (8 x 2^-9 rounds up into the smallest normal, code 0x08, as it should).
        (a * 512.0).round_ties_even() as u8
    } else if a >= E4M3_MAX {
        0x7E
    } else {
        // A normal f32 in [2^-6, 448): keep 3 of its 23 mantissa bits, ties to even; a carry out of
        // the mantissa moves into the exponent field, which is what rounding up to 2^(e+1) means.
        let bits = a.to_bits();
        let exp = (bits >> 23) as i32 - 127;
        let man = bits & 0x7F_FFFF;
        let (q, rest) = (man >> 20, man & 0xF_FFFF);
        let up = rest > 0x8_0000 || (rest == 0x8_0000 && q & 1 == 1);
        let code = (((exp + 7) as u32) << 3) + q + u32::from(up);
        // 464 and above would round to the NaN code: saturate.
        code.min(0x7E) as u8
    };
    sign | magnitude
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_finite_code_round_trips_and_the_nans_are_0x7f_and_0xff() {
        for b in 0..=255u8 {
            let v = e4m3_to_f32(b);
            if b & 0x7F == 0x7F {
                assert!(v.is_nan(), "{b:#x}");
                continue;
            }
            assert_eq!(f32_to_e4m3(v), b, "{b:#x} = {v}");
        }
        assert_eq!(e4m3_to_f32(0x7E), 448.0);
        assert_eq!(e4m3_to_f32(0x01), 1.0 / 512.0);
        assert_eq!(e4m3_to_f32(0x08), 1.0 / 64.0);
        assert_eq!(e4m3_to_f32(0x38), 1.0);
        assert_eq!(e4m3_to_f32(0xB8), -1.0);
    }

    #[test]
    fn rounds_to_nearest_even_and_saturates() {
        // Between 1 (0x38) and 1.125 (0x39): the midpoint goes to the even code, 1.0.
        assert_eq!(f32_to_e4m3(1.0625), 0x38);
        assert_eq!(f32_to_e4m3(1.0626), 0x39);
        // Between 1.125 and 1.25 the midpoint goes up to the even 1.25 (0x3A).
        assert_eq!(f32_to_e4m3(1.1875), 0x3A);
        // Subnormals: 1.5 x 2^-9 ties to 2 x 2^-9; 0.5 x 2^-9 ties to zero.
        assert_eq!(f32_to_e4m3(1.5 / 512.0), 0x02);
        assert_eq!(f32_to_e4m3(0.5 / 512.0), 0x00);
        assert_eq!(f32_to_e4m3(7.5 / 512.0), 0x08);
        // Above 1.875 (0x3F), the top mantissa: rounding up carries into the exponent (2.0).
        assert_eq!(f32_to_e4m3(1.96875), 0x40);
        // Saturation: past the top, and the infinities.
        for v in [448.0, 449.0, 464.0, 480.0, 1e30, f32::INFINITY] {
            assert_eq!(f32_to_e4m3(v), 0x7E, "{v}");
            assert_eq!(f32_to_e4m3(-v), 0xFE, "{v}");
        }
        assert_eq!(f32_to_e4m3(f32::NAN), E4M3_NAN);
        assert_eq!(f32_to_e4m3(-0.0), 0x80);
        // The relative error of a normal value is at most half a unit of its 3-bit mantissa.
        let mut x = 1.0 / 64.0;
        while x < 448.0 {
            let e = (e4m3_to_f32(f32_to_e4m3(x)) - x).abs() / x;
            assert!(e <= 1.0 / 16.0 + 1e-7, "{x}: {e}");
            x *= 1.0137;
        }
    }
}
