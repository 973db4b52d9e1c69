// SPDX-License-Identifier: MIT OR Apache-2.0
//! RMSNorm and the fused residual add + RMSNorm.

use metrale_core::{DevicePtr, LaunchConfig};

use super::ROW_THREADS;
use crate::host::{self, HostError, HostMemory, Kernel, kernel_args, round_bf16};
use crate::names;

kernel_args!(
    /// `out[r, :] = bf16(bf16(x * rsqrt(mean(x^2) + eps)) * weight)`.
    RmsNorm => names::rmsnorm::RMSNORM_BF16 {
        /// bf16 `[rows, cols]`.
        out: DevicePtr,
        /// bf16 `[rows, cols]`.
        input: DevicePtr,
        /// bf16 `[cols]`.
        weight: DevicePtr,
        /// Rows.
        rows: u32,
        /// Row width.
        cols: u32,
        /// Added to the mean square.
        eps: f32,
    }
);

kernel_args!(
    /// `residual = bf16(residual + input)` in place, then `out = rmsnorm(residual)`.
    AddRmsNorm => names::rmsnorm::ADD_RMSNORM_BF16 {
        /// bf16 `[rows, cols]`; must not alias `residual`.
        out: DevicePtr,
        /// bf16 `[rows, cols]`, updated in place.
        residual: DevicePtr,
        /// bf16 `[rows, cols]`.
        input: DevicePtr,
        /// bf16 `[cols]`.
        weight: DevicePtr,
        /// Rows.
        rows: u32,
        /// Row width.
        cols: u32,
        /// Added to the mean square.
        eps: f32,
    }
);

/// The reference row normalisation, with the kernel's rounding points.
fn normalize(x: &[f32], weight: &[f32], cols: usize, eps: f32) -> Vec<f32> {
    let mut out = Vec::with_capacity(x.len());
    for row in x.chunks_exact(cols.max(1)) {
        let mean_sq = row.iter().map(|v| v * v).sum::<f32>() / cols as f32;
        let inv = 1.0 / (mean_sq + eps).sqrt();
        out.extend(row.iter().zip(weight).map(|(v, w)| round_bf16(v * inv) * w));
    }
    out
}

impl Kernel for RmsNorm {
    fn launch_config(&self) -> LaunchConfig {
        LaunchConfig::linear(self.rows, ROW_THREADS)
    }
    fn reference(&self, mem: &mut dyn HostMemory) -> Result<(), HostError> {
        let (rows, cols) = (self.rows as usize, self.cols as usize);
        let x = host::load_bf16(mem, self.input, rows * cols)?;
        let w = host::load_bf16(mem, self.weight, cols)?;
        host::store_bf16(mem, self.out, &normalize(&x, &w, cols, self.eps))
    }
}

impl Kernel for AddRmsNorm {
    fn launch_config(&self) -> LaunchConfig {
        LaunchConfig::linear(self.rows, ROW_THREADS)
    }
    fn reference(&self, mem: &mut dyn HostMemory) -> Result<(), HostError> {
        let (rows, cols) = (self.rows as usize, self.cols as usize);
        let res = host::load_bf16(mem, self.residual, rows * cols)?;
        let x = host::load_bf16(mem, self.input, rows * cols)?;
        let w = host::load_bf16(mem, self.weight, cols)?;
        let sum: Vec<f32> = res.iter().zip(&x).map(|(a, b)| round_bf16(a + b)).collect();
        host::store_bf16(mem, self.residual, &sum)?;
        host::store_bf16(mem, self.out, &normalize(&sum, &w, cols, self.eps))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::KernelAbi;
    use crate::ops::testing::*;
    use metrale_core::{DevicePtr, KernelArg};

    #[test]
    fn rmsnorm_matches_hand_computation() {
        let mut m = FlatMemory::new();
        let x = m.put(&bf16s(&[3.0, 4.0, -1.0, 1.0]));
        let w = m.put(&bf16s(&[1.0, 0.5]));
        let out = m.put(&bf16s(&[0.0; 4]));
        RmsNorm {
            out,
            input: x,
            weight: w,
            rows: 2,
            cols: 2,
            eps: 0.0,
        }
        .reference(&mut m)
        .unwrap();
        // Row 0: rms = sqrt(12.5); row 1: rms = 1.
        let r = 12.5f32.sqrt();
        let want = [
            round_bf16(3.0 / r),
            round_bf16(round_bf16(4.0 / r) * 0.5),
            -1.0,
            0.5,
        ];
        assert_eq!(f32s(&m.get(out, 4)), want.to_vec());
    }

    #[test]
    fn add_rmsnorm_updates_residual() {
        let mut m = FlatMemory::new();
        let res = m.put(&bf16s(&[1.0, 1.0]));
        let x = m.put(&bf16s(&[1.0, -3.0]));
        let w = m.put(&bf16s(&[1.0, 1.0]));
        let out = m.put(&bf16s(&[0.0; 2]));
        AddRmsNorm {
            out,
            residual: res,
            input: x,
            weight: w,
            rows: 1,
            cols: 2,
            eps: 0.0,
        }
        .reference(&mut m)
        .unwrap();
        assert_eq!(f32s(&m.get(res, 2)), vec![2.0, -2.0]);
        assert_eq!(f32s(&m.get(out, 2)), vec![1.0, -1.0]);
    }

    #[test]
    fn args_round_trip_and_mismatch_is_named() {
        let k = RmsNorm {
            out: DevicePtr(1),
            input: DevicePtr(2),
            weight: DevicePtr(3),
            rows: 4,
            cols: 5,
            eps: 1e-6,
        };
        assert_eq!(RmsNorm::from_args(&k.args()).unwrap(), k);
        let mut bad = k.args();
        bad[3] = KernelArg::F32(1.0);
        let err = RmsNorm::from_args(&bad).unwrap_err().to_string();
        assert!(
            err.contains("rows") && err.contains("rmsnorm_bf16"),
            "{err}"
        );
        assert!(RmsNorm::from_args(&bad[..2]).is_err());
    }
}
