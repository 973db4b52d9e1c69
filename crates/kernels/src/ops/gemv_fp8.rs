// SPDX-License-Identifier: MIT OR Apache-2.0
//! Decode products over FP8 (E4M3) weights with f32 scales per 128 columns and `2^row_shift` rows
//! (`gemv_fp8.cu`), and the dequantisation to BF16 the library path takes in part 1.
//!
//! The weight layout is [`metrale_model_weights::Fp8Tensor`]'s: `[n, k]` e4m3 bytes row-major,
//! scales `[ceil(n / 2^row_shift), ceil(k / 128)]`; a weight is `e4m3 × scale`. The references
//! dequantise in f32 (the kernels' registers) and sum in f32, one bf16 rounding at the
//! output, as the BF16 GEMV's.

use half::bf16;
use metrale_core::fp8::e4m3_to_f32;
use metrale_core::{DevicePtr, KernelName, LaunchConfig};

use super::blocks_for;
use crate::host::{self, HostError, HostMemory, Kernel, KernelAbi, kernel_args};
use crate::names;

/// Columns (inputs) per scale.
pub const FP8_SCALE_COLS: u32 = 128;

/// Most rows the FP8 GEMV takes (its FMA form is instantiated for 1 to 8).
pub const GEMV_FP8_MAX_ROWS: u32 = 8;

/// Output columns a block of the FP8 GEMV covers: one a warp, 8 warps.
const COLUMNS_PER_BLOCK: u32 = 8;

kernel_args!(
    /// `C = A · Wᵀ (+ bias)` with W in e4m3 and its scales, bf16 out, 1 to 8 rows.
    GemvFp8 => names::gemv_fp8::GEMV_FP8 {
        /// bf16 `[m, n]`.
        c: DevicePtr,
        /// bf16 `[m, k]`.
        a: DevicePtr,
        /// e4m3 `[n, k]`.
        w: DevicePtr,
        /// f32 `[ceil(n / 2^row_shift), ceil(k / 128)]`.
        scales: DevicePtr,
        /// bf16 `[n]`, or null.
        bias: DevicePtr,
        /// Rows of A and C (1 to 8).
        m: u32,
        /// Rows of W, columns of C.
        n: u32,
        /// Inputs.
        k: u32,
        /// log2 of the rows a scale covers: 7 (128 x 128 blocks) or 0 (a scale per row).
        row_shift: u32,
    }
);

kernel_args!(
    /// [`GemvFp8`] of the fused gate|up weight (`[2 * inter, k]`, gate rows first) with SiLU x up
    /// in its epilogue: `out[m, inter] = bf16(silu(g) * u)` of the bf16-rounded products (what
    /// [`GemvFp8`] then [`SiluMul`](super::SiluMul) compute).
    GemvFp8Swiglu => names::gemv_fp8::GEMV_FP8_SWIGLU {
        /// bf16 `[m, inter]`.
        out: DevicePtr,
        /// bf16 `[m, k]`.
        a: DevicePtr,
        /// e4m3 `[2 * inter, k]`.
        w: DevicePtr,
        /// f32 `[ceil(2 * inter / 2^row_shift), ceil(k / 128)]`.
        scales: DevicePtr,
        /// Rows (1 to 8).
        m: u32,
        /// Output columns (half the weight's rows).
        inter: u32,
        /// Inputs.
        k: u32,
        /// log2 of the rows a scale covers.
        row_shift: u32,
    }
);

kernel_args!(
    /// `out[n, k] = bf16(e4m3 × scale)`: an FP8 weight as BF16, for the library GEMM.
    Fp8DequantBf16 => names::gemv_fp8::FP8_DEQUANT_BF16 {
        /// bf16 `[n, k]`.
        out: DevicePtr,
        /// e4m3 `[n, k]`.
        w: DevicePtr,
        /// f32 scales.
        scales: DevicePtr,
        /// Rows.
        n: u32,
        /// Columns.
        k: u32,
        /// log2 of the rows a scale covers.
        row_shift: u32,
    }
);

/// The FP8 weight `[n, k]` dequantised to f32 (`e4m3 × scale`, the kernels' register values).
pub fn fp8_weight_f32(
    name: KernelName,
    mem: &dyn HostMemory,
    w: DevicePtr,
    scales: DevicePtr,
    (n, k): (usize, usize),
    row_shift: u32,
) -> Result<Vec<f32>, HostError> {
    if row_shift > 16 {
        return Err(HostError::BadArgs {
            kernel: name,
            message: format!("row_shift {row_shift} is not a scale layout (0 or 7)"),
        });
    }
    let kb = k.div_ceil(FP8_SCALE_COLS as usize);
    let rows = n.div_ceil(1 << row_shift);
    let bytes = host::view::<u8>(mem, w, n * k)?;
    let s = host::load::<f32>(mem, scales, rows * kb)?;
    Ok((0..n * k)
        .map(|i| {
            let (r, c) = (i / k, i % k);
            e4m3_to_f32(bytes[i]) * s[(r >> row_shift) * kb + c / FP8_SCALE_COLS as usize]
        })
        .collect())
}

fn check_rows(name: KernelName, m: u32) -> Result<(), HostError> {
    if !(1..=GEMV_FP8_MAX_ROWS).contains(&m) {
        return Err(HostError::BadArgs {
            kernel: name,
            message: format!("m = {m} is not 1 to {GEMV_FP8_MAX_ROWS}"),
        });
    }
    Ok(())
}

/// `A · Wᵀ (+ bias)` in f32 of an A in device memory and a dequantised W.
fn product(
    mem: &dyn HostMemory,
    a: DevicePtr,
    w: &[f32],
    bias: DevicePtr,
    (m, n, k): (usize, usize, usize),
) -> Result<Vec<f32>, HostError> {
    let a = host::load_bf16(mem, a, m * k)?;
    fp8_product(mem, &a, w, bias, (m, n, k))
}

/// `A · Wᵀ (+ bias)` in f32 of rows `a` and a dequantised W (the FP8 streams' normalised A too).
pub(super) fn fp8_product(
    mem: &dyn HostMemory,
    a: &[f32],
    w: &[f32],
    bias: DevicePtr,
    (m, n, k): (usize, usize, usize),
) -> Result<Vec<f32>, HostError> {
    let bias = if bias.is_null() {
        vec![0.0; n]
    } else {
        host::load_bf16(mem, bias, n)?
    };
    let mut out = vec![0f32; m * n];
    for r in 0..m {
        let row = &a[r * k..(r + 1) * k];
        for j in 0..n {
            let col = &w[j * k..(j + 1) * k];
            let dot: f32 = row.iter().zip(col).map(|(x, y)| x * y).sum();
            out[r * n + j] = dot + bias[j];
        }
    }
    Ok(out)
}

impl Kernel for GemvFp8 {
    fn launch_config(&self) -> LaunchConfig {
        LaunchConfig::linear(blocks_for(self.n.into(), COLUMNS_PER_BLOCK).max(1), 256)
    }
    fn reference(&self, mem: &mut dyn HostMemory) -> Result<(), HostError> {
        check_rows(Self::NAME, self.m)?;
        let (m, n, k) = (self.m as usize, self.n as usize, self.k as usize);
        let w = fp8_weight_f32(Self::NAME, mem, self.w, self.scales, (n, k), self.row_shift)?;
        let c = product(mem, self.a, &w, self.bias, (m, n, k))?;
        host::store_bf16(mem, self.c, &c)
    }
}

impl Kernel for GemvFp8Swiglu {
    fn launch_config(&self) -> LaunchConfig {
        LaunchConfig::linear(blocks_for(self.inter.into(), COLUMNS_PER_BLOCK).max(1), 256)
    }
    fn reference(&self, mem: &mut dyn HostMemory) -> Result<(), HostError> {
        check_rows(Self::NAME, self.m)?;
        let (m, inter, k) = (self.m as usize, self.inter as usize, self.k as usize);
        let w = fp8_weight_f32(
            Self::NAME,
            mem,
            self.w,
            self.scales,
            (2 * inter, k),
            self.row_shift,
        )?;
        let gate_up = product(mem, self.a, &w, DevicePtr::NULL, (m, 2 * inter, k))?;
        let mut out = Vec::with_capacity(m * inter);
        for row in gate_up.chunks_exact((2 * inter).max(1)) {
            let (gate, up) = row.split_at(inter);
            out.extend(gate.iter().zip(up).map(|(&g, &u)| {
                let (g, u) = (host::round_bf16(g), host::round_bf16(u));
                super::activation::silu(g) * u
            }));
        }
        host::store_bf16(mem, self.out, &out)
    }
}

impl Kernel for Fp8DequantBf16 {
    fn launch_config(&self) -> LaunchConfig {
        let weights = u64::from(self.n) * u64::from(self.k);
        let per_thread = if self.k.is_multiple_of(16) { 16 } else { 1 };
        LaunchConfig::linear(blocks_for(weights.div_ceil(per_thread), 256).max(1), 256)
    }
    fn reference(&self, mem: &mut dyn HostMemory) -> Result<(), HostError> {
        let (n, k) = (self.n as usize, self.k as usize);
        let w = fp8_weight_f32(Self::NAME, mem, self.w, self.scales, (n, k), self.row_shift)?;
        let out: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
        host::store(mem, self.out, &out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::testing::{FlatMemory, bf16s, f32s, uniform};
    use metrale_core::fp8::f32_to_e4m3;

    /// The FP8 GEMV equals the BF16 GEMV of the dequantised weight; ignoring the scales (all 1)
    /// does not.
    #[test]
    fn fp8_gemv_is_the_product_of_the_dequantised_weight() {
        let (m, n, k) = (3u32, 40u32, 300u32);
        let w: Vec<u8> = uniform(1, (n * k) as usize, 400.0)
            .iter()
            .map(|&v| f32_to_e4m3(v))
            .collect();
        // Scales per 128 x 128 block: ceil(40 / 128) = 1 row of ceil(300 / 128) = 3.
        let scales = [0.01f32, 0.02, 0.005];
        let a = bf16s(&uniform(2, (m * k) as usize, 1.0));
        let mut mem = FlatMemory::new();
        let (pa, pw, ps) = (mem.put(&a), mem.put(&w), mem.put(&scales));
        let pc = mem.put(&vec![bf16::ZERO; (m * n) as usize]);
        let run = |mem: &mut FlatMemory, scales: DevicePtr| {
            GemvFp8 {
                c: pc,
                a: pa,
                w: pw,
                scales,
                bias: DevicePtr::NULL,
                m,
                n,
                k,
                row_shift: 7,
            }
            .reference(mem)
            .unwrap();
            f32s(&mem.get::<bf16>(pc, (m * n) as usize))
        };
        let got = run(&mut mem, ps);
        let want: Vec<f32> = (0..(m * n) as usize)
            .map(|i| {
                let (r, j) = (i / n as usize, i % n as usize);
                let dot: f32 = (0..k as usize)
                    .map(|c| {
                        f32::from(a[r * k as usize + c])
                            * e4m3_to_f32(w[j * k as usize + c])
                            * scales[c / 128]
                    })
                    .sum();
                f32::from(bf16::from_f32(dot))
            })
            .collect();
        for (g, w) in got.iter().zip(&want) {
            assert!((g - w).abs() <= w.abs() / 128.0 + 1e-3, "{g} {w}");
        }
        let ones = mem.put(&[1.0f32; 3]);
        let unscaled = run(&mut mem, ones);
        let off = unscaled
            .iter()
            .zip(&want)
            .filter(|(u, w)| (*u - *w).abs() > w.abs() / 8.0 + 1e-2)
            .count();
        assert!(off > (m * n) as usize / 2, "{off}");
        // The dequantisation writes e4m3 x scale rounded to bf16.
        let po = mem.put(&vec![bf16::ZERO; (n * k) as usize]);
        Fp8DequantBf16 {
            out: po,
            w: pw,
            scales: ps,
            n,
            k,
            row_shift: 7,
        }
        .reference(&mut mem)
        .unwrap();
        let d = mem.get::<bf16>(po, (n * k) as usize);
        assert_eq!(d[301], bf16::from_f32(e4m3_to_f32(w[301]) * 0.01));
        assert_eq!(d[299], bf16::from_f32(e4m3_to_f32(w[299]) * 0.005));
    }
}
