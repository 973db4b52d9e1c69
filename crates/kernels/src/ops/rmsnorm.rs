// SPDX-License-Identifier: MIT OR Apache-2.0
//! RMSNorm and the fused residual add + RMSNorm over the f32 residual stream.

use metrale_core::{DevicePtr, LaunchConfig};

use super::ROW_THREADS;
use super::fp8_gemm::{FP8_GEMM_ROW_GROUP, quantize_rows};
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

kernel_args!(
    /// [`AddRmsNorm`] with its output as the FP8 library product's activation rows: the residual
    /// updated as there, each row's `bf16(rmsnorm(residual) * (weight_offset + weight))` as there,
    /// then those bf16 rows quantized as [`Fp8QuantizeRows`](super::Fp8QuantizeRows) quantizes
    /// them (e4m3 with a scale per row and 128 columns, [`fp8_row_scale`](super::fp8_row_scale)'s
    /// layout over `rows` rounded up to 16, the rows past `rows` zero with scale 1): the two
    /// launches' bits in one.
    AddRmsNormFp8Rows => names::rmsnorm::ADD_RMSNORM_F32RES_FP8_ROWS {
        /// e4m3 `[round_up(rows, 16), cols]`.
        q: DevicePtr,
        /// f32, [`fp8_row_scale`](super::fp8_row_scale)'s layout over `round_up(rows, 16)` rows.
        scales: DevicePtr,
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
        /// As [`AddRmsNorm`]'s.
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

impl AddRmsNorm {
    /// The reference's work before the store: the residual updated in memory, the normalised
    /// rows returned in f32 (the kernel rounds each to bf16 as it stores it).
    fn add_and_normalise(&self, mem: &mut dyn HostMemory) -> Result<Vec<f32>, HostError> {
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
        Ok(normalize(&res, &w, cols, self.eps))
    }
}

impl Kernel for AddRmsNorm {
    fn launch_config(&self) -> LaunchConfig {
        LaunchConfig::linear(self.rows, ROW_THREADS)
    }
    fn reference(&self, mem: &mut dyn HostMemory) -> Result<(), HostError> {
        let y = self.add_and_normalise(mem)?;
        host::store_bf16(mem, self.out, &y)
    }
}

impl Kernel for AddRmsNormFp8Rows {
    fn launch_config(&self) -> LaunchConfig {
        // A block a row, the rows past `rows` up to the multiple of 16 included.
        LaunchConfig::linear(
            self.rows.next_multiple_of(FP8_GEMM_ROW_GROUP).max(1),
            ROW_THREADS,
        )
    }
    /// [`AddRmsNorm`]'s reference, then [`Fp8QuantizeRows`](super::Fp8QuantizeRows)' of its bf16
    /// rows.
    fn reference(&self, mem: &mut dyn HostMemory) -> Result<(), HostError> {
        let bf16_form = AddRmsNorm {
            out: DevicePtr::NULL,
            residual: self.residual,
            input: self.input,
            weight: self.weight,
            rows: self.rows,
            cols: self.cols,
            eps: self.eps,
            weight_offset: self.weight_offset,
        };
        let y: Vec<f32> = bf16_form
            .add_and_normalise(mem)?
            .into_iter()
            .map(host::round_bf16)
            .collect();
        let (q, scales) = quantize_rows(&y, self.rows as usize, self.cols as usize);
        host::store(mem, self.q, &q)?;
        host::store(mem, self.scales, &scales)
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

    /// The FP8-rows form writes what AddRmsNorm then Fp8QuantizeRows write (codes, scales, the
    /// residual), bit for bit, at row counts that are and are not multiples of 16, above the
    /// padded group's 256 rows (two groups), with and without an input, and with a weight
    /// offset; the rows past `rows` are zero with scale 1.
    #[test]
    fn the_fp8_rows_form_is_add_rmsnorm_then_fp8_quantize_rows() {
        use crate::ops::{FP8_GEMM_ROW_GROUP, Fp8QuantizeRows, fp8_row_scale};
        for (rows, cols, with_input, offset) in [
            (5u32, 1024u32, true, 0.0f32),
            (32, 256, true, 0.0),
            (47, 384, false, 0.0),
            (300, 128, true, 1.0),
            (3, 130, true, 0.0),
        ] {
            let n = (rows * cols) as usize;
            let padded = rows.next_multiple_of(FP8_GEMM_ROW_GROUP) as usize;
            let kb = cols.div_ceil(128) as usize;
            let mut m = FlatMemory::new();
            let res = m.put(&uniform(21, n, 4.0));
            let input = m.put(&bf16s(&uniform(22, n, 2.0)));
            let weight = m.put(&bf16s(&uniform(23, cols as usize, 1.5)));
            let out = m.put(&bf16s(&vec![0.0; n]));
            let q = m.put(&vec![0x55u8; padded * cols as usize]);
            let scales = m.put(&vec![-1f32; padded * kb]);
            let mut two = m.clone();
            let norm = AddRmsNorm {
                out,
                residual: res,
                input: if with_input { input } else { DevicePtr::NULL },
                weight,
                rows,
                cols,
                eps: 1e-6,
                weight_offset: offset,
            };
            norm.reference(&mut two).unwrap();
            Fp8QuantizeRows {
                q,
                scales,
                a: out,
                m: rows,
                k: cols,
            }
            .reference(&mut two)
            .unwrap();
            AddRmsNormFp8Rows {
                q,
                scales,
                residual: res,
                input: norm.input,
                weight,
                rows,
                cols,
                eps: 1e-6,
                weight_offset: offset,
            }
            .reference(&mut m)
            .unwrap();
            let shape = format!("rows={rows} cols={cols}");
            let codes = m.get::<u8>(q, padded * cols as usize);
            assert_eq!(codes, two.get::<u8>(q, padded * cols as usize), "{shape}");
            let s = m.get::<f32>(scales, padded * kb);
            assert_eq!(s, two.get::<f32>(scales, padded * kb), "{shape}");
            assert_eq!(m.get::<f32>(res, n), two.get::<f32>(res, n), "{shape}");
            assert!(codes[n..].iter().all(|&c| c == 0), "{shape}: pad rows zero");
            for row in rows as usize..padded {
                for b in 0..kb {
                    assert_eq!(s[fp8_row_scale(row, b, rows as usize, kb)], 1.0, "{shape}");
                }
            }
            // Not all zero: the codes carry the rows.
            assert!(codes[..n].iter().any(|&c| c != 0), "{shape}");
        }
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
