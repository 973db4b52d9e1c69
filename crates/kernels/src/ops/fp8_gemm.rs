// SPDX-License-Identifier: MIT OR Apache-2.0
//! The FP8 prefill product (`fp8_gemm.cu`): activations quantized to e4m3 per row and 128
//! columns ([`Fp8QuantizeRows`]), then `C = A_q · W_qᵀ (+ bias)` over two e4m3 operands and their
//! f32 scales ([`GemmFp8`]), which the CUDA backend runs through cuBLASLt's block-scaled FP8
//! matmul and other backends through the kernel.
//!
//! Scale layouts, the ones cuBLASLt's modes read under blaslt.rs's operand mapping:
//! - activations (`CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F`): a scale per row and 128 columns,
//!   the row index fastest, in row groups ([`fp8_row_scale`]): cuBLASLt's block-scaled FP8 takes
//!   row counts that are multiples of [`FP8_GEMM_ROW_GROUP`] only (on the H200 17 rows are
//!   `CUBLAS_STATUS_NOT_SUPPORTED`, 16, 32 and 1024 are accepted:
//!   docs/results/2026-12-04-fp8-h200/gemm-3d6aa6e), so rows come in at most two groups
//!   ([`fp8_rows_split`]), each `[ceil(k / 128), rows]`, the second padded with zero rows to a
//!   multiple of 16;
//! - the weight (`CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F`):
//!   [`metrale_model_weights::Fp8Tensor`]'s `[ceil(n / 128), ceil(k / 128)]` row-major, which is
//!   the column-major block grid of the weight as cuBLASLt's first operand, leading dimension
//!   `ceil(k / 128)` (a multiple of 4 by [`gemm_fp8_fits`]: 16-byte strides).
//!
//! The references: the quantization is bit-exact with the weight quantizer's rule (scale =
//! amax / 448, 1 where that is not positive; `f32_to_e4m3(x / scale)`); the product dequantises
//! both operands to f32, sums in f32 and rounds once to bf16.

use metrale_core::fp8::{e4m3_block_scale, e4m3_to_f32, f32_to_e4m3};
use metrale_core::{DevicePtr, LaunchConfig};

use super::blocks_for;
use super::gemv_fp8::{FP8_SCALE_COLS, fp8_product, fp8_weight_f32};
use crate::host::{self, HostError, HostMemory, Kernel, KernelAbi, kernel_args};
use crate::names;

/// Warps of a [`Fp8QuantizeRows`] block, one (row, 128-column block) each.
const QUANTIZE_WARPS: u32 = 8;

/// The output tile edge of the fallback [`GemmFp8`] kernel (16 x 16 threads).
const GEMM_TILE: u32 = 16;

kernel_args!(
    /// `q[m, k] = e4m3(a / scale)` with a scale per row and 128 columns (amax / 448; 1 where
    /// the block is all zero), in the row groups cuBLASLt takes ([`fp8_row_scale`]).
    Fp8QuantizeRows => names::fp8_gemm::FP8_QUANTIZE_ROWS {
        /// e4m3 `[round_up(m, 16), k]`, the rows past `m` zero.
        q: DevicePtr,
        /// f32, [`fp8_row_scale`]'s layout over `round_up(m, 16)` rows (the zero rows' 1).
        scales: DevicePtr,
        /// bf16 `[m, k]`.
        a: DevicePtr,
        /// Rows.
        m: u32,
        /// Columns.
        k: u32,
    }
);

kernel_args!(
    /// `C = dequant(A_q) · dequant(W)ᵀ (+ bias)`, bf16 out: the library FP8 product's kernel
    /// form (W in 128 x 128 blocks).
    GemmFp8 => names::fp8_gemm::GEMM_FP8_BLOCK_SCALED {
        /// bf16 `[m, n]`.
        c: DevicePtr,
        /// e4m3 `[m, k]`.
        a: DevicePtr,
        /// f32, [`Fp8QuantizeRows`]' layout ([`fp8_row_scale`]).
        a_scales: DevicePtr,
        /// e4m3 `[n, k]`.
        w: DevicePtr,
        /// f32 `[ceil(n / 128), ceil(k / 128)]`.
        w_scales: DevicePtr,
        /// bf16 `[n]`, or null.
        bias: DevicePtr,
        /// Rows of A and C.
        m: u32,
        /// Rows of W, columns of C.
        n: u32,
        /// Inputs.
        k: u32,
    }
);

/// Whether an `n x k` FP8 weight in 128 x 128 blocks takes the FP8 library product: `n` a
/// multiple of 16 and `k` of 512. cuBLASLt's FP8 operands want 16-byte leading dimensions and
/// multiples of 16; the weight's scale grid has no padding, so its leading dimension
/// `ceil(k / 128)` must itself be a multiple of 4 floats; whole 128-column blocks avoid asking
/// the library about partial ones (Qwen3-8B's k are 4096 and 12288).
pub fn gemm_fp8_fits(n: u32, k: u32) -> bool {
    n > 0 && n.is_multiple_of(16) && k > 0 && k.is_multiple_of(4 * FP8_SCALE_COLS)
}

/// The row count cuBLASLt's block-scaled FP8 product takes a multiple of.
pub const FP8_GEMM_ROW_GROUP: u32 = 16;

/// Products of at most this many rows that are not a multiple of 16 run as one product of the
/// rows padded to 16 into a scratch of this many rows (then copied out); longer ones as two
/// ([`fp8_rows_split`]). A second product reads the whole weight again, which at decode sizes
/// doubles the step's products (Qwen3-8B FP8 batch 63 as 48 + 16 rows: 10.34 ms against 7.25 at
/// batch 64, docs/results/2026-12-04-fp8-h200/gemm-b93969e).
pub const FP8_GEMM_PAD_ROWS: u32 = 256;

/// An FP8 product of `m` rows as cuBLASLt takes it: `(main, rest)`, the first `main` rows (a
/// multiple of 16) as one product straight into the output, and the `rest` as one product of
/// `rest` rounded up to 16 rows (the quantization's zero rows after them) into the scratch, whose
/// `rest` real rows are copied out. Multiples of 16: `(m, 0)`; up to [`FP8_GEMM_PAD_ROWS`]:
/// `(0, m)`; longer: `(m` rounded down to 16`, m % 16)`.
pub fn fp8_rows_split(m: u32) -> (u32, u32) {
    let g = FP8_GEMM_ROW_GROUP;
    if m.is_multiple_of(g) {
        (m, 0)
    } else if m <= FP8_GEMM_PAD_ROWS {
        (0, m)
    } else {
        (m / g * g, m % g)
    }
}

/// Where row `row`'s scale of k-block `kb` sits among the scales of `m` quantized rows
/// (`kb_count` k-blocks): each group of [`fp8_rows_split`] is its own `[kb_count, rows]` block
/// with the row index fastest, the padded group (rounded up to 16 rows) after the first.
pub fn fp8_row_scale(row: usize, kb: usize, m: usize, kb_count: usize) -> usize {
    let (main, rest) = fp8_rows_split(m as u32);
    let (main, rest) = (main as usize, rest as usize);
    if row < main {
        kb * main + row
    } else {
        let padded = rest.next_multiple_of(FP8_GEMM_ROW_GROUP as usize);
        kb_count * main + kb * padded + (row - main)
    }
}

/// Bytes of the quantized activations of `m x k`: the e4m3 values of `m` rounded up to 16 rows,
/// then (at the next 256-byte boundary) as many rows' scales. Returns (bytes, offset of the
/// scales).
pub fn fp8_rows_bytes(m: usize, k: usize) -> (usize, usize) {
    let rows = m.next_multiple_of(FP8_GEMM_ROW_GROUP as usize);
    let scales_at = (rows * k).next_multiple_of(256);
    let scales = k.div_ceil(FP8_SCALE_COLS as usize) * rows * 4;
    (scales_at + scales, scales_at)
}

/// The launch of a kernel that writes `m x k` quantized rows a warp per (row, 128-column block)
/// over `m` rounded up to 16 rows, 8 warps a block ([`Fp8QuantizeRows`],
/// [`SiluMulFp8Rows`](super::SiluMulFp8Rows)).
pub(crate) fn block_warps_launch(m: u32, k: u32) -> LaunchConfig {
    let rows = m.next_multiple_of(FP8_GEMM_ROW_GROUP);
    let items = u64::from(rows) * u64::from(k.div_ceil(FP8_SCALE_COLS));
    LaunchConfig::linear(
        blocks_for(items, QUANTIZE_WARPS).max(1),
        32 * QUANTIZE_WARPS,
    )
}

impl Kernel for Fp8QuantizeRows {
    fn launch_config(&self) -> LaunchConfig {
        block_warps_launch(self.m, self.k)
    }
    fn reference(&self, mem: &mut dyn HostMemory) -> Result<(), HostError> {
        let (m, k) = (self.m as usize, self.k as usize);
        let a = host::load_bf16(mem, self.a, m * k)?;
        let (q, scales) = quantize_rows(&a, m, k);
        host::store(mem, self.q, &q)?;
        host::store(mem, self.scales, &scales)
    }
}

/// The e4m3 rows and scales [`Fp8QuantizeRows`] writes for the `m x k` values `a` (bf16 values,
/// as f32): the values of `m` rounded up to 16 rows (the rows past `m` zero), then the scales in
/// [`fp8_row_scale`]'s layout (the zero rows' 1). The reference of every launch that writes these
/// rows, so that all write the same bits from the same bf16 values.
pub(crate) fn quantize_rows(a: &[f32], m: usize, k: usize) -> (Vec<u8>, Vec<f32>) {
    let cols = FP8_SCALE_COLS as usize;
    let kb = k.div_ceil(cols);
    let rows = m.next_multiple_of(FP8_GEMM_ROW_GROUP as usize);
    let mut q = vec![0u8; rows * k];
    let mut scales = vec![0f32; kb * rows];
    for r in 0..rows {
        for b in 0..kb {
            let block = r * k + b * cols..r * k + ((b + 1) * cols).min(k);
            // The rows past `m` are zero.
            let values = a.get(block.clone()).unwrap_or(&[]);
            let amax = values.iter().fold(0f32, |s, x| s.max(x.abs()));
            let scale = e4m3_block_scale(amax);
            scales[fp8_row_scale(r, b, m, kb)] = scale;
            for (i, x) in block.zip(values) {
                q[i] = f32_to_e4m3(x / scale);
            }
        }
    }
    (q, scales)
}

impl Kernel for GemmFp8 {
    fn launch_config(&self) -> LaunchConfig {
        LaunchConfig {
            grid: [
                self.n.div_ceil(GEMM_TILE).max(1),
                self.m.div_ceil(GEMM_TILE).max(1),
                1,
            ],
            block: [GEMM_TILE, GEMM_TILE, 1],
            shared_mem_bytes: 0,
        }
    }
    fn reference(&self, mem: &mut dyn HostMemory) -> Result<(), HostError> {
        let (m, n, k) = (self.m as usize, self.n as usize, self.k as usize);
        let cols = FP8_SCALE_COLS as usize;
        let kb = k.div_ceil(cols);
        let bytes = host::view::<u8>(mem, self.a, m * k)?;
        let rows = m.next_multiple_of(FP8_GEMM_ROW_GROUP as usize);
        let s = host::load::<f32>(mem, self.a_scales, kb * rows)?;
        let a: Vec<f32> = (0..m * k)
            .map(|i| {
                let (r, c) = (i / k, i % k);
                e4m3_to_f32(bytes[i]) * s[fp8_row_scale(r, c / cols, m, kb)]
            })
            .collect();
        let w = fp8_weight_f32(Self::NAME, mem, self.w, self.w_scales, (n, k), 7)?;
        let c = fp8_product(mem, &a, &w, self.bias, (m, n, k))?;
        host::store_bf16(mem, self.c, &c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::testing::{FlatMemory, bf16s, f32s, uniform};
    use half::bf16;

    /// Every row count's scales fill `[ceil(k / 128), round_up(m, 16)]` once each, each group of
    /// [`fp8_rows_split`] a whole number of 16 rows, and the padded group only where `m` is not a
    /// multiple of 16.
    #[test]
    fn row_scales_cover_the_padded_rows_once() {
        for m in (1..=600).chain([4095, 4096, 4097, 8191, 8192]) {
            let (main, rest) = fp8_rows_split(m);
            assert_eq!(main % FP8_GEMM_ROW_GROUP, 0, "m={m}");
            assert_eq!(main + rest, m, "m={m}");
            assert_eq!(rest == 0, m % FP8_GEMM_ROW_GROUP == 0, "m={m}");
            assert!(rest <= FP8_GEMM_PAD_ROWS, "m={m}");
            let padded = m.next_multiple_of(FP8_GEMM_ROW_GROUP) as usize;
            for kb_count in [1usize, 3, 96] {
                let mut seen = vec![false; padded * kb_count];
                for row in 0..padded {
                    for kb in 0..kb_count {
                        let i = fp8_row_scale(row, kb, m as usize, kb_count);
                        assert!(!seen[i], "m={m} row={row} kb={kb}: index {i} twice");
                        seen[i] = true;
                    }
                }
                assert!(seen.iter().all(|&s| s), "m={m}");
            }
        }
    }

    /// The quantized rows dequantise to the input within half an e4m3 step of each block's
    /// scale; an all-zero block has scale 1; the scales lie k-block major; the rows padding the
    /// product to 16 are zero with scale 1.
    #[test]
    fn quantized_rows_dequantise_to_the_input() {
        let (m, k) = (3u32, 300u32);
        let mut v = uniform(5, (m * k) as usize, 3.0);
        // Row 1's middle block all zero.
        v[300 + 128..300 + 256].fill(0.0);
        let a = bf16s(&v);
        let mut mem = FlatMemory::new();
        let pa = mem.put(&a);
        let padded = 16usize;
        let pq = mem.put(&vec![0xffu8; padded * k as usize]);
        let ps = mem.put(&[0f32; 3 * 16]);
        Fp8QuantizeRows {
            q: pq,
            scales: ps,
            a: pa,
            m,
            k,
        }
        .reference(&mut mem)
        .unwrap();
        let q = mem.get::<u8>(pq, padded * k as usize);
        let s = mem.get::<f32>(ps, 3 * 16);
        // 3 rows are one group padded to 16: scale (row, kb) at kb * 16 + row.
        assert_eq!(s[16 + 1], 1.0, "row 1, block 1: {s:?}");
        assert!(
            q[(m * k) as usize..].iter().all(|&b| b == 0),
            "pad rows zero"
        );
        for row in m as usize..padded {
            for kb in 0..3 {
                assert_eq!(s[fp8_row_scale(row, kb, m as usize, 3)], 1.0);
            }
        }
        for (i, x) in f32s(&a).iter().enumerate() {
            let (r, c) = (i / k as usize, i % k as usize);
            let scale = s[fp8_row_scale(r, c / 128, m as usize, 3)];
            let back = e4m3_to_f32(q[i]) * scale;
            // e4m3 keeps 3 mantissa bits: within 1/16 of the value, or of 2^-9 scale below.
            assert!(
                (back - x).abs() <= x.abs() / 16.0 + scale / 1024.0,
                "{i}: {x} -> {back}"
            );
        }
        // A block's largest magnitude lands on 448.
        let row0 = &f32s(&a)[..128];
        let amax = row0.iter().fold(0f32, |s, x| s.max(x.abs()));
        assert_eq!(s[0], amax / 448.0);
    }

    /// The FP8 product is the f32 product of the two dequantised operands; reading A's scales
    /// row-major instead (the other layout) changes it.
    #[test]
    fn fp8_gemm_is_the_product_of_the_dequantised_operands() {
        let (m, n, k) = (5u32, 24u32, 256u32);
        let a: Vec<u8> = uniform(1, (m * k) as usize, 400.0)
            .iter()
            .map(|&v| f32_to_e4m3(v))
            .collect();
        let w: Vec<u8> = uniform(2, (n * k) as usize, 400.0)
            .iter()
            .map(|&v| f32_to_e4m3(v))
            .collect();
        // 5 rows are one group padded to 16: 2 k-blocks x 16 scales.
        let a_scales: Vec<f32> = (0..2 * 16).map(|i| 0.001 * (i + 1) as f32).collect();
        let w_scales = [0.002f32, 0.003];
        let mut mem = FlatMemory::new();
        let (pa, pw) = (mem.put(&a), mem.put(&w));
        let (psa, psw) = (mem.put(&a_scales), mem.put(&w_scales));
        let pc = mem.put(&vec![bf16::ZERO; (m * n) as usize]);
        GemmFp8 {
            c: pc,
            a: pa,
            a_scales: psa,
            w: pw,
            w_scales: psw,
            bias: DevicePtr::NULL,
            m,
            n,
            k,
        }
        .reference(&mut mem)
        .unwrap();
        let got = f32s(&mem.get::<bf16>(pc, (m * n) as usize));
        let (m, n, k) = (m as usize, n as usize, k as usize);
        let mut transposed_differs = 0;
        for r in 0..m {
            for j in 0..n {
                let dot = |scale_of: &dyn Fn(usize) -> f32| -> f32 {
                    (0..k)
                        .map(|c| {
                            e4m3_to_f32(a[r * k + c])
                                * scale_of(c / 128)
                                * (e4m3_to_f32(w[j * k + c]) * w_scales[c / 128])
                        })
                        .sum()
                };
                let want = dot(&|b| a_scales[fp8_row_scale(r, b, m, 2)]);
                let g = got[r * n + j];
                assert!((g - want).abs() <= want.abs() / 128.0 + 1e-4, "{g} {want}");
                let other = dot(&|b| a_scales[r * 2 + b]);
                if (g - other).abs() > other.abs() / 64.0 + 1e-3 {
                    transposed_differs += 1;
                }
            }
        }
        assert!(transposed_differs > m * n / 2, "{transposed_differs}");
    }

    #[test]
    fn fits_whole_512_column_pieces_and_16_row_multiples() {
        assert!(gemm_fp8_fits(6144, 4096));
        assert!(gemm_fp8_fits(4096, 12288));
        assert!(!gemm_fp8_fits(4096, 384));
        assert!(!gemm_fp8_fits(4100, 4096));
        // 3 rows take 16 (the padded group): 16 x 1024 values, then 8 k-blocks x 16 scales.
        assert_eq!(fp8_rows_bytes(3, 1024), (16384 + 8 * 16 * 4, 16384));
        assert_eq!(fp8_rows_bytes(3, 100).1, 1792);
        assert_eq!(fp8_rows_bytes(32, 512), (16384 + 4 * 32 * 4, 16384));
    }
}
