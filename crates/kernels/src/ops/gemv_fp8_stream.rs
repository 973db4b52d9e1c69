// SPDX-License-Identifier: MIT OR Apache-2.0
//! One-row products over FP8 (E4M3) weights as the bulk-copy stream: `gemv_stream.cu`'s
//! `gemv_fp8_*` entries, the FP8 form of [`GemvStream`](super::GemvStream) and its SwiGLU and
//! normalising forms, for batch-1 decode.
//!
//! The weight layout is [`GemvFp8`]'s (`[n, k]` e4m3 bytes, f32 scales
//! `[ceil(n / 2^row_shift), ceil(k / 128)]`); the kernels take `k` a multiple of 1024 (an e4m3 row
//! of whole 1, 2 or 4 KiB chunks: [`gemv_fp8_stream_fits`]). Every warp of the grid streams a run
//! of whole rows through a shared-memory ring with each chunk's scales, dequantises in registers
//! (exactly) and sums in f32, one scale a 16-weight piece: [`GemvFp8`]'s values in another order
//! of f32 sums, so the references are [`GemvFp8`]'s, [`GemvFp8Swiglu`]'s and, for the normalising
//! forms, the A that [`AddRmsNorm`](super::AddRmsNorm) would store.

use metrale_core::{DevicePtr, LaunchConfig};

use super::gemm::{
    GEMV_STREAM_BLOCKS, GEMV_STREAM_CHUNK, GEMV_STREAM_STAGES, normalised_input, swiglu_rows,
};
use super::gemv_fp8::{FP8_SCALE_COLS, fp8_product, fp8_weight_f32};
use super::{GemvFp8, GemvFp8Swiglu};
use crate::host::{self, HostError, HostMemory, Kernel, KernelAbi, kernel_args};
use crate::names;

kernel_args!(
    /// [`GemvFp8`] of one row as a bulk-copy stream (`gemv_fp8_stream`): `c = a · Wᵀ (+ bias)`,
    /// W e4m3 with its scales, bf16 out. For `m = 1` and `k` a multiple of 1024
    /// ([`gemv_fp8_stream_fits`]); `a`, `w` and `scales` 16-byte aligned (device allocations
    /// are), else the kernel writes nothing.
    GemvFp8Stream => names::gemv_stream::GEMV_FP8_STREAM {
        /// bf16 `[1, n]`.
        c: DevicePtr,
        /// bf16 `[1, k]`.
        a: DevicePtr,
        /// e4m3 `[n, k]`.
        w: DevicePtr,
        /// f32 `[ceil(n / 2^row_shift), k / 128]`.
        scales: DevicePtr,
        /// bf16 `[n]`, or null.
        bias: DevicePtr,
        /// Rows of A and C: 1.
        m: u32,
        /// Rows of W, columns of C.
        n: u32,
        /// Inputs.
        k: u32,
        /// log2 of the rows a scale covers: 7 (128 x 128 blocks) or 0 (a scale per row).
        row_shift: u32,
        /// 4-KiB units of each warp's ring copied before the programmatic-launch wait (at most
        /// [`GEMV_STREAM_STAGES`]), as [`GemvStream`](super::GemvStream)'s.
        prewait: u32,
        /// 1 to stream the weight through L2 as evict-first lines, 0 not to.
        evict_first: u32,
    }
);

kernel_args!(
    /// [`GemvFp8Swiglu`] of one row as [`GemvFp8Stream`]'s stream: a warp's output column streams
    /// its gate row, then its up row, and stores `bf16(silu(g) * u)` of the bf16 products.
    GemvFp8SwigluStream => names::gemv_stream::GEMV_FP8_SWIGLU_STREAM {
        /// bf16 `[1, inter]`.
        out: DevicePtr,
        /// bf16 `[1, k]`.
        a: DevicePtr,
        /// e4m3 `[2 * inter, k]`: the gate rows, then the up rows.
        w: DevicePtr,
        /// f32 `[ceil(2 * inter / 2^row_shift), k / 128]`.
        scales: DevicePtr,
        /// Rows: 1.
        m: u32,
        /// Output columns (half the weight's rows).
        inter: u32,
        /// Inputs.
        k: u32,
        /// log2 of the rows a scale covers.
        row_shift: u32,
        /// As [`GemvFp8Stream`]'s.
        prewait: u32,
        /// As [`GemvFp8Stream`]'s.
        evict_first: u32,
    }
);

kernel_args!(
    /// [`GemvFp8Stream`] of the normalised row, as [`GemvStreamNorm`](super::GemvStreamNorm):
    /// `residual_out = residual + input` in f32 (stored by block 0) and
    /// `c = bf16(rmsnorm(residual_out) * norm_weight) · Wᵀ (+ bias)`, A with the bits
    /// [`AddRmsNorm`](super::AddRmsNorm) would store.
    GemvFp8StreamNorm => names::gemv_stream::GEMV_FP8_STREAM_NORM {
        /// bf16 `[1, n]`.
        c: DevicePtr,
        /// f32 `[1, k]`, the residual stream before the add (read only).
        residual: DevicePtr,
        /// f32 `[1, k]`: the residual stream after the add; must not alias `residual`.
        residual_out: DevicePtr,
        /// bf16 `[1, k]`, or null.
        input: DevicePtr,
        /// bf16 `[k]`, the norm's weight.
        norm_weight: DevicePtr,
        /// e4m3 `[n, k]`.
        w: DevicePtr,
        /// f32 `[ceil(n / 2^row_shift), k / 128]`.
        scales: DevicePtr,
        /// bf16 `[n]`, or null.
        bias: DevicePtr,
        /// Rows: 1.
        m: u32,
        /// Rows of W, columns of C.
        n: u32,
        /// The reduction length (the residual's width).
        k: u32,
        /// Added to the mean square.
        eps: f32,
        /// log2 of the rows a scale covers.
        row_shift: u32,
        /// As [`GemvFp8Stream`]'s.
        prewait: u32,
        /// As [`GemvFp8Stream`]'s.
        evict_first: u32,
    }
);

kernel_args!(
    /// [`GemvFp8SwigluStream`] of the normalised row, as [`GemvFp8StreamNorm`].
    GemvFp8SwigluStreamNorm => names::gemv_stream::GEMV_FP8_SWIGLU_STREAM_NORM {
        /// bf16 `[1, inter]`.
        out: DevicePtr,
        /// f32 `[1, k]`, the residual stream before the add (read only).
        residual: DevicePtr,
        /// f32 `[1, k]`: the residual stream after the add; must not alias `residual`.
        residual_out: DevicePtr,
        /// bf16 `[1, k]`, or null.
        input: DevicePtr,
        /// bf16 `[k]`, the norm's weight.
        norm_weight: DevicePtr,
        /// e4m3 `[2 * inter, k]`: the gate rows, then the up rows.
        w: DevicePtr,
        /// f32 `[ceil(2 * inter / 2^row_shift), k / 128]`.
        scales: DevicePtr,
        /// Rows: 1.
        m: u32,
        /// Output columns (half the weight's rows).
        inter: u32,
        /// The reduction length (the residual's width).
        k: u32,
        /// Added to the mean square.
        eps: f32,
        /// log2 of the rows a scale covers.
        row_shift: u32,
        /// As [`GemvFp8Stream`]'s.
        prewait: u32,
        /// As [`GemvFp8Stream`]'s.
        evict_first: u32,
    }
);

/// Bytes each warp's ring holds (`RING` in gemv_stream.cu): the whole ring is in flight.
const RING_BYTES: u32 = GEMV_STREAM_STAGES * GEMV_STREAM_CHUNK;
/// The smallest chunk of an e4m3 row (`Fp8Weight::MIN_CHUNK`): `k` a multiple of it.
const FP8_MIN_CHUNK: u32 = 1024;
/// Warps a block of the stream (`WARPS`).
const WARPS: u32 = 8;
/// The kernel's own bound on `k` (`MAX_K`).
const MAX_K: u32 = 1 << 16;
/// Shared memory a Hopper block may opt in to (227 KiB).
const HOPPER_MAX_BLOCK_SMEM: u32 = 227 * 1024;

/// The FP8 stream's dynamic shared memory: A (`k` bf16, rounded up to 128 bytes), then 8 warps'
/// rings, then their mbarriers (one a slot of the 1-KiB chunks' ring), then 32 floats for the
/// normalising entries' reduction, then 8 warps' rings of scales (a 4-byte scale per 128 bytes
/// of ring).
pub fn gemv_fp8_stream_smem_bytes(k: u32) -> u32 {
    // Past the kernel's bound the launch is refused; this keeps the sum in range.
    let k = k.min(MAX_K);
    let slots = RING_BYTES / FP8_MIN_CHUNK;
    (2 * k).next_multiple_of(128)
        + WARPS * (RING_BYTES + 8 * slots)
        + 32 * 4
        + WARPS * RING_BYTES / FP8_SCALE_COLS * 4
}

/// Whether an `m x n x k` FP8 product can take [`GemvFp8Stream`] (or its SwiGLU form over `n`
/// output columns, or a normalising form): one row, `k` a multiple of 1024 (whole 1-KiB chunks a
/// row), and A plus the rings within a block's shared memory (`k` up to 47104).
pub fn gemv_fp8_stream_fits(m: u32, n: u32, k: u32) -> bool {
    m == 1
        && n > 0
        && (1..=MAX_K).contains(&k)
        && k.is_multiple_of(FP8_MIN_CHUNK)
        && gemv_fp8_stream_smem_bytes(k) <= HOPPER_MAX_BLOCK_SMEM
}

/// The FP8 stream's launch: one block an SM, 256 threads, [`gemv_fp8_stream_smem_bytes`].
fn stream_launch(k: u32) -> LaunchConfig {
    LaunchConfig {
        shared_mem_bytes: gemv_fp8_stream_smem_bytes(k),
        ..LaunchConfig::linear(GEMV_STREAM_BLOCKS, 256)
    }
}

/// The refusal of the launches the kernel would skip (and of `n = 0`, which it would run as
/// nothing).
fn check(name: metrale_core::KernelName, m: u32, n: u32, k: u32) -> Result<(), HostError> {
    if gemv_fp8_stream_fits(m, n, k) {
        return Ok(());
    }
    Err(HostError::BadArgs {
        kernel: name,
        message: format!(
            "m = {m}, n = {n}, k = {k}: the FP8 stream takes one row, n > 0 and k a multiple of \
             {FP8_MIN_CHUNK} with A and its rings in {HOPPER_MAX_BLOCK_SMEM} bytes of shared memory"
        ),
    })
}

impl Kernel for GemvFp8Stream {
    fn launch_config(&self) -> LaunchConfig {
        stream_launch(self.k)
    }
    fn reference(&self, mem: &mut dyn HostMemory) -> Result<(), HostError> {
        check(Self::NAME, self.m, self.n, self.k)?;
        let GemvFp8Stream {
            c,
            a,
            w,
            scales,
            bias,
            m,
            n,
            k,
            row_shift,
            ..
        } = *self;
        GemvFp8 {
            c,
            a,
            w,
            scales,
            bias,
            m,
            n,
            k,
            row_shift,
        }
        .reference(mem)
    }
}

impl Kernel for GemvFp8SwigluStream {
    fn launch_config(&self) -> LaunchConfig {
        stream_launch(self.k)
    }
    fn reference(&self, mem: &mut dyn HostMemory) -> Result<(), HostError> {
        check(Self::NAME, self.m, self.inter, self.k)?;
        let GemvFp8SwigluStream {
            out,
            a,
            w,
            scales,
            m,
            inter,
            k,
            row_shift,
            ..
        } = *self;
        GemvFp8Swiglu {
            out,
            a,
            w,
            scales,
            m,
            inter,
            k,
            row_shift,
        }
        .reference(mem)
    }
}

impl Kernel for GemvFp8StreamNorm {
    fn launch_config(&self) -> LaunchConfig {
        stream_launch(self.k)
    }
    fn reference(&self, mem: &mut dyn HostMemory) -> Result<(), HostError> {
        check(Self::NAME, self.m, self.n, self.k)?;
        let a = normalised_input(
            Self::NAME,
            mem,
            self.residual,
            self.residual_out,
            self.input,
            self.norm_weight,
            self.m,
            self.k,
            self.eps,
        )?;
        let (n, k) = (self.n as usize, self.k as usize);
        let w = fp8_weight_f32(Self::NAME, mem, self.w, self.scales, (n, k), self.row_shift)?;
        let c = fp8_product(mem, &a, &w, self.bias, (1, n, k))?;
        host::store_bf16(mem, self.c, &c)
    }
}

impl Kernel for GemvFp8SwigluStreamNorm {
    fn launch_config(&self) -> LaunchConfig {
        stream_launch(self.k)
    }
    fn reference(&self, mem: &mut dyn HostMemory) -> Result<(), HostError> {
        check(Self::NAME, self.m, self.inter, self.k)?;
        let a = normalised_input(
            Self::NAME,
            mem,
            self.residual,
            self.residual_out,
            self.input,
            self.norm_weight,
            self.m,
            self.k,
            self.eps,
        )?;
        let (n, k) = (2 * self.inter as usize, self.k as usize);
        let w = fp8_weight_f32(Self::NAME, mem, self.w, self.scales, (n, k), self.row_shift)?;
        let gate_up = fp8_product(mem, &a, &w, DevicePtr::NULL, (1, n, k))?;
        host::store_bf16(mem, self.out, &swiglu_rows(&gate_up, self.inter as usize))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::AddRmsNorm;
    use crate::ops::testing::{FlatMemory, bf16s, f32s, uniform};
    use half::bf16;
    use metrale_core::fp8::f32_to_e4m3;

    #[test]
    fn the_fp8_stream_fits_qwen3_8b_and_0_6b_and_refuses_what_its_kernel_skips() {
        // Qwen3-8B: qkv, o, gate|up (12288 columns), down; Qwen3-0.6B's 1024 and 3072; up to the
        // shared-memory bound.
        for (n, k) in [
            (6144, 4096),
            (4096, 4096),
            (12288, 4096),
            (4096, 12288),
            (1024, 3072),
            (4096, 1024),
            (1, 47104),
        ] {
            assert!(gemv_fp8_stream_fits(1, n, k), "{n} {k}");
        }
        for (m, n, k) in [
            (2, 4096, 4096),
            (1, 0, 4096),
            (1, 4096, 2560),
            (1, 4096, 576),
            (1, 4096, 48128),
        ] {
            assert!(!gemv_fp8_stream_fits(m, n, k), "{m} {n} {k}");
        }
        // Qwen3-8B's down product: 24 KiB of A, 133 KiB of rings, barriers and scales.
        assert_eq!(
            gemv_fp8_stream_smem_bytes(12288),
            24576 + 8 * (16384 + 128) + 128 + 8 * 512
        );
    }

    /// The normalising form is the product of what AddRmsNorm stores: one launch computes the
    /// two launches' bits, the residual stream included.
    #[test]
    fn the_normalising_fp8_stream_is_add_rmsnorm_then_the_fp8_stream() {
        let (n, k) = (24u32, 1024u32);
        let w: Vec<u8> = uniform(3, (n * k) as usize, 300.0)
            .iter()
            .map(|&v| f32_to_e4m3(v))
            .collect();
        let scales: Vec<f32> = (0..(n * k / 128) as usize)
            .map(|i| 0.001 * (1 + i % 5) as f32)
            .collect();
        let residual = uniform(4, k as usize, 2.0);
        let input = bf16s(&uniform(5, k as usize, 1.0));
        let norm_weight = bf16s(&uniform(6, k as usize, 1.0));
        let bias = bf16s(&uniform(7, n as usize, 1.0));
        let mut mem = FlatMemory::new();
        let (pw, ps, pr, pi, pn, pb) = (
            mem.put(&w),
            mem.put(&scales),
            mem.put(&residual),
            mem.put(&input),
            mem.put(&norm_weight),
            mem.put(&bias),
        );
        // The fused form writes the sum to residual_out; AddRmsNorm updates its residual in place.
        let (res_fused, res_split) = (mem.put(&vec![0f32; k as usize]), mem.put(&residual));
        let x = mem.put(&vec![bf16::ZERO; k as usize]);
        let (fused, split) = (
            mem.put(&vec![bf16::ZERO; n as usize]),
            mem.put(&vec![bf16::ZERO; n as usize]),
        );
        GemvFp8StreamNorm {
            c: fused,
            residual: pr,
            residual_out: res_fused,
            input: pi,
            norm_weight: pn,
            w: pw,
            scales: ps,
            bias: pb,
            m: 1,
            n,
            k,
            eps: 1e-6,
            row_shift: 0,
            prewait: 4,
            evict_first: 1,
        }
        .reference(&mut mem)
        .unwrap();
        AddRmsNorm {
            out: x,
            residual: res_split,
            input: pi,
            weight: pn,
            rows: 1,
            cols: k,
            eps: 1e-6,
            weight_offset: 0.0,
        }
        .reference(&mut mem)
        .unwrap();
        GemvFp8Stream {
            c: split,
            a: x,
            w: pw,
            scales: ps,
            bias: pb,
            m: 1,
            n,
            k,
            row_shift: 0,
            prewait: 4,
            evict_first: 1,
        }
        .reference(&mut mem)
        .unwrap();
        assert_eq!(
            mem.get::<f32>(res_fused, k as usize),
            mem.get::<f32>(res_split, k as usize)
        );
        let got = mem.get::<bf16>(fused, n as usize);
        assert_eq!(got, mem.get::<bf16>(split, n as usize));
        assert!(f32s(&got).iter().any(|v| v.abs() > 0.1), "{got:?}");
        // A row the kernel would skip is refused, not computed.
        let refused = GemvFp8Stream {
            k: 1000,
            ..GemvFp8Stream {
                c: split,
                a: x,
                w: pw,
                scales: ps,
                bias: pb,
                m: 1,
                n,
                k,
                row_shift: 0,
                prewait: 4,
                evict_first: 1,
            }
        };
        assert!(refused.reference(&mut mem).is_err());
    }
}
