// SPDX-License-Identifier: MIT OR Apache-2.0
//! Element types the engine stores on a device.

use std::fmt;

/// An element type of a device tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    /// IEEE binary32.
    F32,
    /// IEEE binary16.
    F16,
    /// bfloat16: binary32 with the low 16 mantissa bits dropped.
    BF16,
    /// FP8 with 4 exponent and 3 mantissa bits (OCP E4M3, no infinities).
    Fp8E4M3,
    /// FP8 with 5 exponent and 2 mantissa bits.
    Fp8E5M2,
    /// 4-bit float with 2 exponent bits and 1 mantissa bit (NVFP4 payload), two per byte.
    E2M1,
    /// Signed 32-bit integer (token ids, positions).
    I32,
    /// Unsigned 32-bit integer (block tables, indices).
    U32,
    /// Unsigned byte.
    U8,
}

impl DType {
    /// Bits per element: bits, not bytes, because [`DType::E2M1`] is sub-byte.
    pub const fn element_size_bits(self) -> usize {
        match self {
            DType::F32 | DType::I32 | DType::U32 => 32,
            DType::F16 | DType::BF16 => 16,
            DType::Fp8E4M3 | DType::Fp8E5M2 | DType::U8 => 8,
            DType::E2M1 => 4,
        }
    }

    /// Bytes taken by `n` elements, rounded up to a whole byte.
    pub const fn bytes_for(self, n: usize) -> usize {
        (n * self.element_size_bits()).div_ceil(8)
    }

    /// The lower-case name used in manifests and messages (`bf16`, `f32`, ...).
    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::Fp8E4M3 => "fp8e4m3",
            DType::Fp8E5M2 => "fp8e5m2",
            DType::E2M1 => "e2m1",
            DType::I32 => "i32",
            DType::U32 => "u32",
            DType::U8 => "u8",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sub_byte_sizes_round_up() {
        assert_eq!(DType::E2M1.bytes_for(3), 2);
        assert_eq!(DType::BF16.bytes_for(3), 6);
        assert_eq!(DType::F32.bytes_for(0), 0);
    }
}
