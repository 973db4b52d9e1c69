// SPDX-License-Identifier: MIT OR Apache-2.0
//! Decode products over FP8 (E4M3) weights on the tensor cores (`gemv_fp8_mma.cu`): the e4m3
//! weight converted to f16 (exactly) and multiplied by A in f16 with `mma.sync` m16n8k16, f32
//! accumulators, for 1 to 8 rows.
//!
//! The weight layout is [`GemvFp8`]'s; `k` must be a multiple of 128 (whole scale columns:
//! [`gemv_fp8_mma_fits`]). What differs from [`GemvFp8`] is A: the kernel stages it as f16, so
//! the references convert each bf16 of A the same way ([`activation_f16`]: exact for
//! `2^-14 <= |x| <= 65504`, subnormal rounding below, finite values saturated at `±65504`) and
//! then sum in f32 per 128-column piece, each piece's sum times its scale: the kernel's values up
//! to the order of f32 sums.

use half::f16;
use metrale_core::fp8::e4m3_to_f32;
use metrale_core::{DevicePtr, KernelName, LaunchConfig};

use super::blocks_for;
use super::gemm::swiglu_rows;
use super::gemv_fp8::{FP8_SCALE_COLS, GEMV_FP8_MAX_ROWS};
use crate::host::{self, HostError, HostMemory, Kernel, KernelAbi, kernel_args};
use crate::names;

kernel_args!(
    /// [`GemvFp8`](super::GemvFp8) on the tensor cores: `c = a · Wᵀ (+ bias)`, W e4m3 with its
    /// scales, A taken as f16 ([`activation_f16`]), bf16 out. For 1 to 8 rows and `k` a multiple
    /// of 128 ([`gemv_fp8_mma_fits`]); `a` and `w` 16-byte aligned, else the kernel writes
    /// nothing.
    GemvFp8Mma => names::gemv_fp8_mma::GEMV_FP8_MMA {
        /// bf16 `[m, n]`.
        c: DevicePtr,
        /// bf16 `[m, k]`.
        a: DevicePtr,
        /// e4m3 `[n, k]`.
        w: DevicePtr,
        /// f32 `[ceil(n / 2^row_shift), k / 128]`.
        scales: DevicePtr,
        /// bf16 `[n]`, or null.
        bias: DevicePtr,
        /// Rows of A and C (1 to 8).
        m: u32,
        /// Rows of W, columns of C.
        n: u32,
        /// Inputs: a multiple of 128.
        k: u32,
        /// log2 of the rows a scale covers: 7 (128 x 128 blocks) or 0 (a scale per row).
        row_shift: u32,
    }
);

kernel_args!(
    /// [`GemvFp8Mma`] of the fused gate|up weight (`[2 * inter, k]`, gate rows first) with SiLU x
    /// up in its epilogue: `out[m, inter] = bf16(silu(g) * u)` of the bf16-rounded products, as
    /// [`GemvFp8Swiglu`](super::GemvFp8Swiglu).
    GemvFp8MmaSwiglu => names::gemv_fp8_mma::GEMV_FP8_MMA_SWIGLU {
        /// bf16 `[m, inter]`.
        out: DevicePtr,
        /// bf16 `[m, k]`.
        a: DevicePtr,
        /// e4m3 `[2 * inter, k]`.
        w: DevicePtr,
        /// f32 `[ceil(2 * inter / 2^row_shift), k / 128]`.
        scales: DevicePtr,
        /// Rows (1 to 8).
        m: u32,
        /// Output columns (half the weight's rows).
        inter: u32,
        /// Inputs: a multiple of 128.
        k: u32,
        /// log2 of the rows a scale covers.
        row_shift: u32,
    }
);

/// Output columns a block covers (one 16-row tile of W; the SwiGLU form also the 16 up rows).
const TILE_COLUMNS: u32 = 16;
/// The warps' partial fragments ahead of A (`RED_BYTES`: 8 warps x 2 tiles x 32 lanes x 16 bytes).
const RED_BYTES: u32 = 8 * 2 * 32 * 16;
/// f16 past each staged row of A (`A_PAD`).
const A_PAD: u32 = 8;
/// Shared memory a Hopper block may opt in to (227 KiB).
const HOPPER_MAX_BLOCK_SMEM: u32 = 227 * 1024;
/// The largest finite f16: the activation's saturation bound.
const F16_MAX: f32 = 65504.0;

/// The dynamic shared memory of an `m`-row launch: the warps' partial fragments, then A as f16
/// (`m` rows of `k + 8`).
pub fn gemv_fp8_mma_smem_bytes(m: u32, k: u32) -> u64 {
    u64::from(RED_BYTES) + u64::from(m) * (u64::from(k) + u64::from(A_PAD)) * 2
}

/// Whether an `m x n x k` FP8 product (or its SwiGLU form over `n` output columns) can take
/// [`GemvFp8Mma`]: 1 to 8 rows, `n > 0`, `k` a positive multiple of 128, and A as f16 within a
/// block's shared memory (`k` up to 13952 at 8 rows, 112000 at one).
pub fn gemv_fp8_mma_fits(m: u32, n: u32, k: u32) -> bool {
    (1..=GEMV_FP8_MAX_ROWS).contains(&m)
        && n > 0
        && k > 0
        && k.is_multiple_of(FP8_SCALE_COLS)
        && gemv_fp8_mma_smem_bytes(m, k) <= u64::from(HOPPER_MAX_BLOCK_SMEM)
}

/// A bf16 activation as the kernel's f16 operand, back in f32: finite values beyond `±65504`
/// saturate to `±65504` (inf and NaN pass through), then round to nearest even in f16 (exact
/// for `2^-14 <= |x| <= 65504`; below, the f16 subnormal grid of `2^-24`).
pub fn activation_f16(x: f32) -> f32 {
    let x = if x.is_finite() && x.abs() > F16_MAX {
        F16_MAX.copysign(x)
    } else {
        x
    };
    f16::from_f32(x).to_f32()
}

fn launch(m: u32, columns: u32, k: u32) -> LaunchConfig {
    LaunchConfig {
        // Past the fit (refused by the reference) the size is clamped to stay a u32.
        shared_mem_bytes: gemv_fp8_mma_smem_bytes(m, k).min(u64::from(u32::MAX)) as u32,
        ..LaunchConfig::linear(blocks_for(columns.into(), TILE_COLUMNS).max(1), 256)
    }
}

fn check(name: KernelName, m: u32, n: u32, k: u32, row_shift: u32) -> Result<(), HostError> {
    if !gemv_fp8_mma_fits(m, n, k) {
        return Err(HostError::BadArgs {
            kernel: name,
            message: format!(
                "m = {m}, n = {n}, k = {k}: the FP8 mma GEMV takes 1 to {GEMV_FP8_MAX_ROWS} \
                 rows, n > 0 and k a multiple of {FP8_SCALE_COLS} with A as f16 in \
                 {HOPPER_MAX_BLOCK_SMEM} bytes of shared memory"
            ),
        });
    }
    if row_shift > 16 {
        return Err(HostError::BadArgs {
            kernel: name,
            message: format!("row_shift {row_shift} is not a scale layout (0 or 7)"),
        });
    }
    Ok(())
}

/// The kernel's `A · Wᵀ (+ bias)` in f32: A through [`activation_f16`], each 128-column piece's
/// f32 sum of exact e4m3 x f16 products times its scale, the pieces summed in f32.
fn mma_product(
    mem: &dyn HostMemory,
    (a, w, scales, bias): (DevicePtr, DevicePtr, DevicePtr, DevicePtr),
    (m, n, k): (usize, usize, usize),
    row_shift: u32,
) -> Result<Vec<f32>, HostError> {
    let piece = FP8_SCALE_COLS as usize;
    let kb = k / piece;
    let a: Vec<f32> = host::load_bf16(mem, a, m * k)?
        .into_iter()
        .map(activation_f16)
        .collect();
    let w: Vec<f32> = host::view::<u8>(mem, w, n * k)?
        .iter()
        .map(|&b| e4m3_to_f32(b))
        .collect();
    let s = host::load::<f32>(mem, scales, n.div_ceil(1 << row_shift) * kb)?;
    let bias = if bias.is_null() {
        vec![0.0; n]
    } else {
        host::load_bf16(mem, bias, n)?
    };
    let mut out = vec![0f32; m * n];
    for r in 0..m {
        for j in 0..n {
            let (row, col) = (&a[r * k..(r + 1) * k], &w[j * k..(j + 1) * k]);
            let srow = &s[(j >> row_shift) * kb..][..kb];
            let dot: f32 = (row.chunks_exact(piece).zip(col.chunks_exact(piece)))
                .zip(srow)
                .map(|((x, y), &scale)| x.iter().zip(y).map(|(x, y)| x * y).sum::<f32>() * scale)
                .sum();
            out[r * n + j] = dot + bias[j];
        }
    }
    Ok(out)
}

impl Kernel for GemvFp8Mma {
    fn launch_config(&self) -> LaunchConfig {
        launch(self.m, self.n, self.k)
    }
    fn reference(&self, mem: &mut dyn HostMemory) -> Result<(), HostError> {
        check(Self::NAME, self.m, self.n, self.k, self.row_shift)?;
        let (m, n, k) = (self.m as usize, self.n as usize, self.k as usize);
        let ptrs = (self.a, self.w, self.scales, self.bias);
        let c = mma_product(mem, ptrs, (m, n, k), self.row_shift)?;
        host::store_bf16(mem, self.c, &c)
    }
}

impl Kernel for GemvFp8MmaSwiglu {
    fn launch_config(&self) -> LaunchConfig {
        launch(self.m, self.inter, self.k)
    }
    fn reference(&self, mem: &mut dyn HostMemory) -> Result<(), HostError> {
        check(Self::NAME, self.m, self.inter, self.k, self.row_shift)?;
        let (m, inter, k) = (self.m as usize, self.inter as usize, self.k as usize);
        let ptrs = (self.a, self.w, self.scales, DevicePtr::NULL);
        let gate_up = mma_product(mem, ptrs, (m, 2 * inter, k), self.row_shift)?;
        host::store_bf16(mem, self.out, &swiglu_rows(&gate_up, inter))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::testing::{FlatMemory, bf16s, f32s, uniform};
    use crate::ops::{GemvFp8, GemvFp8Swiglu};
    use half::bf16;
    use metrale_core::fp8::f32_to_e4m3;

    #[test]
    fn the_activation_is_exact_in_f16s_normal_range_and_saturates_beyond() {
        for x in [1.0f32, -0.3984375, 2.0f32.powi(-14), 65280.0, -1024.5] {
            let b = f32::from(bf16::from_f32(x));
            assert_eq!(activation_f16(b), b, "{x}");
        }
        // 65280 is the largest bf16 below f16's 65504; the next, 65536, saturates.
        assert_eq!(activation_f16(65536.0), 65504.0);
        assert_eq!(activation_f16(1.0e5), 65504.0);
        assert_eq!(activation_f16(-3.0e38), -65504.0);
        assert_eq!(activation_f16(f32::INFINITY), f32::INFINITY);
        assert!(activation_f16(f32::NAN).is_nan());
        // Subnormal: 2^-20 + 2^-27 keeps only the 2^-24 grid; 2^-26 rounds to zero.
        let tiny = 2.0f32.powi(-20) + 2.0f32.powi(-27);
        assert_eq!(activation_f16(tiny), 2.0f32.powi(-20));
        assert_eq!(activation_f16(2.0f32.powi(-26)), 0.0);
    }

    #[test]
    fn the_mma_gemv_fits_qwen3_8b_at_1_to_8_rows_and_refuses_what_its_kernel_skips() {
        for m in [1, 8] {
            for (n, k) in [(6144, 4096), (4096, 4096), (12288, 4096), (4096, 12288)] {
                assert!(gemv_fp8_mma_fits(m, n, k), "{m} {n} {k}");
            }
        }
        assert!(gemv_fp8_mma_fits(8, 1, 13952));
        assert!(gemv_fp8_mma_fits(1, 1, 112000));
        for (m, n, k) in [
            (0, 4096, 4096),
            (9, 4096, 4096),
            (1, 0, 4096),
            (1, 4096, 4000),
            (1, 4096, 0),
            (8, 4096, 14080),
        ] {
            assert!(!gemv_fp8_mma_fits(m, n, k), "{m} {n} {k}");
        }
    }

    /// With A exact in f16 the mma forms equal the register GEMV up to f32 summation order; an
    /// activation past f16's range is saturated, which the register GEMV does not do.
    #[test]
    fn the_mma_gemv_is_the_fp8_gemv_of_the_f16_activation() {
        let (m, n, k) = (3u32, 40u32, 384u32);
        let w: Vec<u8> = uniform(1, (2 * n * k) as usize, 400.0)
            .iter()
            .map(|&v| f32_to_e4m3(v))
            .collect();
        let scales: Vec<f32> = (0..(2 * n * k / 128) as usize)
            .map(|i| 0.001 * (1 + i % 7) as f32)
            .collect();
        let mut a = bf16s(&uniform(2, (m * k) as usize, 1.0));
        let bias = bf16s(&uniform(3, n as usize, 1.0));
        let mut mem = FlatMemory::new();
        let (pw, ps, pb) = (mem.put(&w), mem.put(&scales), mem.put(&bias));
        let pa = mem.put(&a);
        let out = |mem: &mut FlatMemory| mem.put(&vec![bf16::ZERO; (m * n) as usize]);
        let (mma, reg, mma_sw, reg_sw) =
            (out(&mut mem), out(&mut mem), out(&mut mem), out(&mut mem));
        let run = |mem: &mut FlatMemory, pa: DevicePtr| {
            GemvFp8Mma {
                c: mma,
                a: pa,
                w: pw,
                scales: ps,
                bias: pb,
                m,
                n,
                k,
                row_shift: 0,
            }
            .reference(mem)
            .unwrap();
            GemvFp8 {
                c: reg,
                a: pa,
                w: pw,
                scales: ps,
                bias: pb,
                m,
                n,
                k,
                row_shift: 0,
            }
            .reference(mem)
            .unwrap();
            GemvFp8MmaSwiglu {
                out: mma_sw,
                a: pa,
                w: pw,
                scales: ps,
                m,
                inter: n,
                k,
                row_shift: 7,
            }
            .reference(mem)
            .unwrap();
            GemvFp8Swiglu {
                out: reg_sw,
                a: pa,
                w: pw,
                scales: ps,
                m,
                inter: n,
                k,
                row_shift: 7,
            }
            .reference(mem)
            .unwrap();
            let get = |p| f32s(&mem.get::<bf16>(p, (m * n) as usize));
            (get(mma), get(reg), get(mma_sw), get(reg_sw))
        };
        let close = |x: &[f32], y: &[f32]| {
            x.iter()
                .zip(y)
                .all(|(x, y)| (x - y).abs() <= y.abs() / 64.0 + 1e-2)
        };
        let (got, want, got_sw, want_sw) = run(&mut mem, pa);
        assert!(close(&got, &want), "{got:?} {want:?}");
        assert!(close(&got_sw, &want_sw), "{got_sw:?} {want_sw:?}");
        assert!(got.iter().any(|v| v.abs() > 0.1), "{got:?}");
        // One activation far past f16's range: the forms part.
        a[5] = bf16::from_f32(3.0e6);
        let pa = mem.put(&a);
        let (got, want, _, _) = run(&mut mem, pa);
        assert!(!close(&got[..n as usize], &want[..n as usize]));
        // k not a multiple of 128 is refused, as the kernel skips it.
        let refused = GemvFp8Mma {
            c: mma,
            a: pa,
            w: pw,
            scales: ps,
            bias: pb,
            m,
            n,
            k: 320,
            row_shift: 0,
        };
        assert!(refused.reference(&mut mem).is_err());
    }
}
