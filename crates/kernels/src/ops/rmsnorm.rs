// SPDX-License-Identifier: MIT OR Apache-2.0
//! RMSNorm and the fused residual add + RMSNorm over the f32 residual stream.

use metrale_core::{DevicePtr, LaunchConfig};

use super::ROW_THREADS;
use crate::host::{self, HostError, HostMemory, Kernel, kernel_args};
use crate::names;

kernel_args!(
    /// `out[r, :] = bf16(x * rsqrt(mean(x^2) + eps) * weight)`, in f32 with one rounding.
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
    /// `residual += input` in f32, in place (no add when `input` is null), then
    /// `out = bf16(rmsnorm(residual) * (weight_offset + weight))`, the scale summed in f32
    /// ([`norm_scale`]).
    AddRmsNorm => names::rmsnorm::ADD_RMSNORM_F32RES {
        /// bf16 `[rows, cols]`; must not alias `residual`.
        out: DevicePtr,
        /// f32 `[rows, cols]`, the residual stream, updated in place.
        residual: DevicePtr,
        /// bf16 `[rows, cols]`, or null to normalise the residual as it is.
        input: DevicePtr,
        /// bf16 `[cols]`.
        weight: DevicePtr,
        /// Rows.
        rows: u32,
        /// Row width.
        cols: u32,
        /// Added to the mean square.
        eps: f32,
        /// Added to each weight in f32 before it scales: 1 for a norm whose weight is stored
        /// centred on zero (Qwen3-Next's `1 + weight`), 0 for the plain weight (bit for bit).
        weight_offset: f32,
    }
);

/// The scale a norm weight applies, `offset + w` in f32; an offset of 0 leaves `w` as it is
/// (`-0.0` included), as the kernels' `norm_scale` (norm.cuh) does.
pub(crate) fn norm_scale(w: f32, offset: f32) -> f32 {
    if offset == 0.0 { w } else { offset + w }
}

/// A norm's weights as the scales they apply ([`norm_scale`]).
pub(crate) fn norm_scales(weight: &[f32], offset: f32) -> Vec<f32> {
    weight.iter().map(|&w| norm_scale(w, offset)).collect()
}

/// The reference row normalisation in f32 (the caller rounds once when storing).
pub(super) fn normalize(x: &[f32], weight: &[f32], cols: usize, eps: f32) -> Vec<f32> {
    let mut out = Vec::with_capacity(x.len());
    for row in x.chunks_exact(cols.max(1)) {
        let mean_sq = row.iter().map(|v| v * v).sum::<f32>() / cols as f32;
        let inv = 1.0 / (mean_sq + eps).sqrt();
        out.extend(row.iter().zip(weight).map(|(v, w)| v * inv * w));
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
        let mut res = host::load::<f32>(mem, self.residual, rows * cols)?;
        let w = norm_scales(
            &host::load_bf16(mem, self.weight, cols)?,
            self.weight_offset,
        );
        if !self.input.is_null() {
            let x = host::load_bf16(mem, self.input, rows * cols)?;
            res.iter_mut().zip(&x).for_each(|(r, x)| *r += x);
            host::store(mem, self.residual, &res)?;
        }
        host::store_bf16(mem, self.out, &normalize(&res, &w, cols, self.eps))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::KernelAbi;
    use crate::host::round_bf16;
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
        let want = [round_bf16(3.0 / r), round_bf16(4.0 / r * 0.5), -1.0, 0.5];
        assert_eq!(f32s(&m.get(out, 4)), want.to_vec());
    }

    #[test]
    fn add_rmsnorm_updates_the_f32_residual() {
        let mut m = FlatMemory::new();
        // 1 + 2^-12 is not a bf16 value: an f32 residual keeps it.
        let res = m.put(&[1.0f32, 1.0 + 1.0 / 4096.0]);
        let x = m.put(&bf16s(&[1.0, -3.0]));
        let w = m.put(&bf16s(&[1.0, 1.0]));
        let out = m.put(&bf16s(&[0.0; 2]));
        let k = AddRmsNorm {
            out,
            residual: res,
            input: x,
            weight: w,
            rows: 1,
            cols: 2,
            eps: 0.0,
            weight_offset: 0.0,
        };
        k.reference(&mut m).unwrap();
        assert_eq!(m.get::<f32>(res, 2), vec![2.0, -2.0 + 1.0 / 4096.0]);
        let before = m.get::<f32>(res, 2);
        // A null input normalises the residual without adding.
        AddRmsNorm {
            input: DevicePtr::NULL,
            ..k
        }
        .reference(&mut m)
        .unwrap();
        assert_eq!(m.get::<f32>(res, 2), before);
        assert_eq!(f32s(&m.get(out, 2)), vec![1.0, -1.0]);
    }

    /// Weights centred on zero with offset 1 scale by `1 + w` summed in f32, not by `1 + w`
    /// rounded to bf16 first (what the weights' upload did before the offset existed).
    #[test]
    fn add_rmsnorm_scales_by_the_offset_weight_in_f32() {
        let mut m = FlatMemory::new();
        let (rows, cols) = (3usize, 64usize);
        let res = uniform(11, rows * cols, 4.0);
        let w = f32s(&bf16s(&uniform(12, cols, 0.05)));
        let out = m.put(&bf16s(&vec![0.0; rows * cols]));
        AddRmsNorm {
            out,
            residual: m.put(&res),
            input: DevicePtr::NULL,
            weight: m.put(&bf16s(&w)),
            rows: rows as u32,
            cols: cols as u32,
            eps: 1e-6,
            weight_offset: 1.0,
        }
        .reference(&mut m)
        .unwrap();
        let got = f32s(&m.get(out, rows * cols));
        let (mut want, mut folded) = (Vec::new(), Vec::new());
        for row in res.chunks_exact(cols) {
            let inv = 1.0 / (row.iter().map(|v| v * v).sum::<f32>() / cols as f32 + 1e-6).sqrt();
            for (x, w) in row.iter().zip(&w) {
                want.push(round_bf16(x * inv * (1.0 + w)));
                folded.push(round_bf16(x * inv * round_bf16(1.0 + w)));
            }
        }
        assert_eq!(got, want);
        assert_ne!(
            got, folded,
            "the f32 sum differs from the bf16-rounded one somewhere"
        );
    }

    #[test]
    fn a_zero_offset_keeps_the_weight_bit_for_bit() {
        for w in [0.0f32, -0.0, 1.5, -3.25, 1e-30] {
            assert_eq!(norm_scale(w, 0.0).to_bits(), w.to_bits(), "{w}");
        }
        assert_eq!(norm_scale(-0.0, 1.0), 1.0);
        assert_eq!(norm_scale(0.25, 1.0), 1.25);
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
