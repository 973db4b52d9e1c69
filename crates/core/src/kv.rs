// SPDX-License-Identifier: MIT OR Apache-2.0
//! The element type of the paged KV cache (`--kv-cache-dtype`).

use std::fmt;
use std::str::FromStr;

/// What one element of the paged KV cache is. A property of the cache: the pool's bytes per
/// token, the kernels that write and read it, and the prefix cache's content address follow from
/// it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum KvCacheDtype {
    /// bf16, the values the attention block computes (`auto` today).
    #[default]
    Bf16,
    /// FP8 E4M3: `e4m3(x / scale)` with one f32 scale per layer for the keys and one for the
    /// values (checkpoint `k_scale` / `v_scale`, else 1.0), saturated to ±448
    /// ([`crate::fp8::f32_to_e4m3`]); half the bytes of bf16.
    Fp8,
}

impl KvCacheDtype {
    /// Bytes of one cache element.
    pub const fn element_bytes(self) -> usize {
        match self {
            KvCacheDtype::Bf16 => 2,
            KvCacheDtype::Fp8 => 1,
        }
    }

    /// The name in logs, metrics and the prefix cache's address (`bf16`, `fp8_e4m3`).
    pub const fn name(self) -> &'static str {
        match self {
            KvCacheDtype::Bf16 => "bf16",
            KvCacheDtype::Fp8 => "fp8_e4m3",
        }
    }
}

impl fmt::Display for KvCacheDtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A `--kv-cache-dtype` value the engine does not take.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "--kv-cache-dtype {0:?} is not supported: use auto (bf16 today), bf16 or fp8 (e4m3; also \
     fp8_e4m3). fp16, fp8_e5m2 and other element types have no kernels"
)]
pub struct UnknownKvCacheDtype(pub String);

impl FromStr for KvCacheDtype {
    type Err = UnknownKvCacheDtype;

    /// vLLM's names: `auto` (the model's compute type: bf16), `bf16` / `bfloat16`, `fp8` /
    /// `fp8_e4m3`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" | "bf16" | "bfloat16" => Ok(KvCacheDtype::Bf16),
            "fp8" | "fp8_e4m3" => Ok(KvCacheDtype::Fp8),
            other => Err(UnknownKvCacheDtype(other.to_string())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vllm_names_parse_and_others_are_refused() {
        assert_eq!("auto".parse(), Ok(KvCacheDtype::Bf16));
        assert_eq!("bf16".parse(), Ok(KvCacheDtype::Bf16));
        assert_eq!("fp8".parse(), Ok(KvCacheDtype::Fp8));
        assert_eq!("fp8_e4m3".parse(), Ok(KvCacheDtype::Fp8));
        for bad in ["fp16", "fp8_e5m2", "junk", "", "FP8"] {
            let err = bad.parse::<KvCacheDtype>().unwrap_err();
            assert!(err.to_string().contains("use auto"), "{err}");
        }
        assert_eq!(KvCacheDtype::Fp8.element_bytes(), 1);
        assert_eq!(KvCacheDtype::Bf16.element_bytes(), 2);
    }
}
