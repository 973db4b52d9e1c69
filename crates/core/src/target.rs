// SPDX-License-Identifier: MIT OR Apache-2.0
//! The runtime dispatch key of a compiled kernel set, and hardware vendors.

use std::fmt;
use std::str::FromStr;

/// Identifies one compiled kernel set: a (hardware class, model, quantization) point of the kernel
/// tree, plus the SM arch its binaries were built for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct KernelTarget {
    /// Hardware class directory under `kernels/` (`hopper`).
    pub hardware: &'static str,
    /// The arch string of the class's `HARDWARE.toml`, verbatim (`sm_90a`).
    pub arch: &'static str,
    /// Model directory (`qwen3`).
    pub model: &'static str,
    /// Quantization directory (`bf16`).
    pub quant: &'static str,
}

impl KernelTarget {
    /// The `hardware/model/quant` spelling used by `--kernel-target` and in messages.
    pub fn path(&self) -> String {
        format!("{}/{}/{}", self.hardware, self.model, self.quant)
    }
}

impl fmt::Display for KernelTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}/{}/{} ({})",
            self.hardware, self.model, self.quant, self.arch
        )
    }
}

/// A GPU vendor, as named by `HARDWARE.toml`'s `vendor` field.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Vendor {
    /// NVIDIA; kernels are CUDA sources compiled with nvcc.
    Nvidia,
    /// AMD; kernels would be HIP sources.
    Amd,
    /// Apple; kernels would be Metal sources.
    Apple,
    /// Intel; kernels would be SYCL sources.
    Intel,
}

/// A vendor spelling nobody recognises.
#[derive(Debug, thiserror::Error)]
#[error(
    "unknown GPU vendor `{0}` (expected one of: nvidia, cuda, amd, rocm, hip, apple, metal, intel, oneapi, sycl)"
)]
pub struct UnknownVendor(pub String);

impl FromStr for Vendor {
    type Err = UnknownVendor;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "nvidia" | "cuda" => Ok(Vendor::Nvidia),
            "amd" | "rocm" | "hip" => Ok(Vendor::Amd),
            "apple" | "metal" => Ok(Vendor::Apple),
            "intel" | "oneapi" | "sycl" => Ok(Vendor::Intel),
            _ => Err(UnknownVendor(s.to_string())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vendor_spellings() {
        assert_eq!("CUDA".parse::<Vendor>().unwrap(), Vendor::Nvidia);
        assert_eq!("rocm".parse::<Vendor>().unwrap(), Vendor::Amd);
        let err = "acme".parse::<Vendor>().unwrap_err().to_string();
        assert!(err.contains("acme") && err.contains("nvidia"), "{err}");
    }
}
