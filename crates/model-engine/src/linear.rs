// SPDX-License-Identifier: MIT OR Apache-2.0
//! A product `out[m, n] = a[m, k] · W[n, k]ᵀ (+ bias)` and the one place that picks how it runs.
//!
//! [`Linear::path`] decides from the product's shape, its rows this step and the [`Tuning`]:
//! - [`Path::Library`]: the library GEMM (`GpuBackend::gemm`: cuBLASLt on CUDA) for prefill-sized
//!   products, and past a few rows for wide ones;
//! - [`Path::Stream`]: the bulk-copy GEMV stream (one block an SM, each warp a run of whole
//!   weight rows through a shared-memory ring) for one-row products of the tuning's labels and size;
//! - [`Path::Staged`]: the register GEMV whose first-wave blocks copy their first weights before
//!   the programmatic-launch wait;
//! - [`Path::Gemv`]: the register GEMV.
//!
//! A product after a residual add + RMSNorm may also take the norm into its launch
//! ([`Linear::run_normed`]: the normalising stream or GEMV), and the gate|up product may run
//! SiLU x up in its epilogue ([`SwigluLinear`]). Every form of a path computes the plain form's
//! bits except the streams (other partial sums), so a path choice changes speed, not results,
//! beyond that.
//!
//! The weight's dtype is the linear's own ([`LinearWeight`]): BF16 `[n, k]` row-major, or FP8
//! E4M3 with f32 scales per 128 columns and 128 (or 1) rows, from an FP8 checkpoint or quantized
//! at load. An FP8 product of one row takes the FP8 bulk-copy stream ([`GemvFp8Stream`] and its
//! SwiGLU and normalising forms) where the BF16 stream would (the tuning's labels and size) and
//! the tuning's `gemv_fp8_stream` is on; else, up to `gemv_max_rows` rows (at most
//! [`GEMV_FP8_MAX_ROWS`]), the tensor-core FP8 GEMV ([`GemvFp8Mma`], [`GemvFp8MmaSwiglu`]: A
//! taken as f16, so not the register GEMV's bits) from the tuning's `gemv_fp8_mma_min_rows` rows where it
//! fits, else the FP8 GEMV ([`GemvFp8`], [`GemvFp8Swiglu`]: the weight dequantised in
//! registers); above, the weight dequantised to BF16 into a shared scratch
//! ([`Fp8DequantBf16`]) and the library GEMM, or, with the tuning's `fp8_gemm` where the weight
//! fits ([`gemm_fp8_fits`], 128 x 128 scale blocks), the activations quantized to e4m3 per row
//! and 128 columns ([`Fp8QuantizeRows`]) and the library's block-scaled FP8 GEMM (`GemmOp::fp8`:
//! cuBLASLt's VEC128 x BLK128x128 matmul on CUDA). It folds a norm only in the stream, and takes
//! no stage. The blocks never see the difference.
//!
//! A product's input comes as [`Rows`]: bf16 rows, or, for an FP8 product that
//! [`Linear::takes_fp8_rows`] (the FP8 GEMM with the tuning's `fp8_fused_quantize`), the e4m3
//! rows and scales already in the shared scratch, written by the launch that produced them (the
//! residual add + RMSNorm, [`Residual::add_norm_into`]; SiLU x up, [`SwigluLinear`]) with the
//! bits the quantize launch would have written. The producer asks the consumer's
//! [`Linear::input_rows`] which form to write, and the consumer runs from it ([`Linear::run_rows`]):
//! the decision is the linear's, so a block has one code path for both.

use metrale_core::DevicePtr;
use metrale_gpu_runtime::{GemmFp8Scales, GemmOp, GpuBackend, KernelHandle};
use metrale_kernels::KernelAbi;
use metrale_kernels::ops::{
    Fp8DequantBf16, Fp8QuantizeRows, GEMV_FMA_MAX_ROWS, GEMV_FP8_MAX_ROWS, Gemm, GemmF32Out,
    GemmFp8, Gemv, GemvF32Out, GemvFp8, GemvFp8Mma, GemvFp8MmaSwiglu, GemvFp8Stream,
    GemvFp8StreamNorm, GemvFp8Swiglu, GemvFp8SwigluStream, GemvFp8SwigluStreamNorm, GemvNorm,
    GemvStaged, GemvStream, GemvStreamF32Out, GemvStreamNorm, GemvSwiglu, GemvSwigluNorm,
    GemvSwigluStaged, GemvSwigluStream, GemvSwigluStreamNorm, SiluMul, SiluMulFp8Rows,
    gemm_fp8_fits, gemv_fp8_mma_fits, gemv_fp8_stream_fits, gemv_norm_fits, gemv_stages,
    gemv_stream_fits,
};

use crate::ModelError;
use crate::launch::Launcher;
use crate::residual::{Residual, RmsNorm};
use crate::tuning::{GemvPolicy, Tuning};

/// How one product runs this step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Path {
    Library,
    Stream,
    Staged,
    Gemv,
}

impl GemvPolicy {
    /// Whether an `m x n x k` GEMV product takes the form.
    pub(crate) fn takes(self, m: u32, n: u32, k: u32) -> bool {
        match self {
            GemvPolicy::Off => false,
            GemvPolicy::Small => gemv_stages(m, n, k),
            GemvPolicy::All => (1..=GEMV_FMA_MAX_ROWS).contains(&m),
        }
    }
}

impl Tuning {
    /// Whether an `m`-row product over `k` inputs streams its weight through a GEMV kernel
    /// (otherwise the library GEMM).
    pub(crate) fn gemv_rows(&self, m: u32, k: u32) -> bool {
        m <= self.gemv_max_rows && (m <= self.gemm_wide_k_max_gemv_rows || k < self.gemm_wide_k)
    }
}

/// Whether the stream set `labels` with its weight threshold takes the `m x n x k` product of
/// `label` (`n` counts the gate and up rows of gate_up), whose stream kernel `fits` its shape
/// (`gemv_stream_fits` for a BF16 weight, `gemv_fp8_stream_fits` for FP8).
pub(crate) fn stream_takes(
    labels: &[&str],
    min_weights: u64,
    label: &str,
    (m, n, k): (u32, u32, u32),
    fits: fn(u32, u32, u32) -> bool,
) -> bool {
    let columns = if label == "gate_up" { n / 2 } else { n };
    labels.contains(&label) && u64::from(n) * u64::from(k) >= min_weights && fits(m, columns, k)
}

/// The kernels every product may take.
#[derive(Clone, Copy, Debug)]
pub(crate) struct LinearKernels {
    gemm: KernelHandle,
    gemm_f32out: KernelHandle,
    gemv: KernelHandle,
    gemv_f32out: KernelHandle,
    gemv_staged: KernelHandle,
    gemv_stream: KernelHandle,
    gemv_stream_f32out: KernelHandle,
    gemv_norm: KernelHandle,
    gemv_stream_norm: KernelHandle,
    gemv_swiglu: KernelHandle,
    gemv_swiglu_staged: KernelHandle,
    gemv_swiglu_stream: KernelHandle,
    gemv_swiglu_norm: KernelHandle,
    gemv_swiglu_stream_norm: KernelHandle,
    silu_mul: KernelHandle,
    silu_mul_fp8_rows: KernelHandle,
    gemv_fp8: KernelHandle,
    gemv_fp8_swiglu: KernelHandle,
    gemv_fp8_mma: KernelHandle,
    gemv_fp8_mma_swiglu: KernelHandle,
    gemv_fp8_stream: KernelHandle,
    gemv_fp8_swiglu_stream: KernelHandle,
    gemv_fp8_stream_norm: KernelHandle,
    gemv_fp8_swiglu_stream_norm: KernelHandle,
    fp8_dequant: KernelHandle,
    fp8_quantize: KernelHandle,
    gemm_fp8: KernelHandle,
    /// bf16 scratch for the largest FP8 weight, which an FP8 product's library path dequantises
    /// into (one product runs at a time on the step's stream), or NULL without FP8 weights.
    pub(crate) fp8_scratch: DevicePtr,
    /// The FP8 library product's quantized activations (e4m3 `[rows, k]`) and their scales
    /// (f32 `[ceil(k / 128), rows]`) for the step's most rows and the widest FP8 weight, or NULL
    /// where the tuning's `fp8_gemm` is off or there are no FP8 weights.
    pub(crate) fp8_rows: Fp8Rows,
}

/// The scratch an FP8 library product quantizes its activations into (or their producer writes
/// them to: [`Rows::Fp8`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Fp8Rows {
    /// e4m3 values.
    pub(crate) values: DevicePtr,
    /// Their f32 scales.
    pub(crate) scales: DevicePtr,
    /// bf16 `[FP8_GEMM_PAD_ROWS, n]` for the widest `n`: the library product's padded rows
    /// ([`metrale_gpu_runtime::GemmFp8Scales::tail`]).
    pub(crate) tail: DevicePtr,
}

/// A product's input rows as their producer wrote them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Rows {
    /// bf16 `[m, k]` at this address.
    Bf16(DevicePtr),
    /// e4m3 rows and their scales in the FP8 product's scratch, as [`Fp8QuantizeRows`] writes
    /// them (`m` rounded up to 16 rows, the rows past `m` zero with scale 1): only for a product
    /// that [`Linear::takes_fp8_rows`].
    Fp8(Fp8Rows),
}

impl LinearKernels {
    pub(crate) fn resolve(g: &dyn GpuBackend) -> Result<LinearKernels, ModelError> {
        Ok(LinearKernels {
            gemm: g.kernel(Gemm::NAME)?,
            gemm_f32out: g.kernel(GemmF32Out::NAME)?,
            gemv: g.kernel(Gemv::NAME)?,
            gemv_f32out: g.kernel(GemvF32Out::NAME)?,
            gemv_staged: g.kernel(GemvStaged::NAME)?,
            gemv_stream: g.kernel(GemvStream::NAME)?,
            gemv_stream_f32out: g.kernel(GemvStreamF32Out::NAME)?,
            gemv_norm: g.kernel(GemvNorm::NAME)?,
            gemv_stream_norm: g.kernel(GemvStreamNorm::NAME)?,
            gemv_swiglu: g.kernel(GemvSwiglu::NAME)?,
            gemv_swiglu_staged: g.kernel(GemvSwigluStaged::NAME)?,
            gemv_swiglu_stream: g.kernel(GemvSwigluStream::NAME)?,
            gemv_swiglu_norm: g.kernel(GemvSwigluNorm::NAME)?,
            gemv_swiglu_stream_norm: g.kernel(GemvSwigluStreamNorm::NAME)?,
            silu_mul: g.kernel(SiluMul::NAME)?,
            silu_mul_fp8_rows: g.kernel(SiluMulFp8Rows::NAME)?,
            gemv_fp8: g.kernel(GemvFp8::NAME)?,
            gemv_fp8_swiglu: g.kernel(GemvFp8Swiglu::NAME)?,
            gemv_fp8_mma: g.kernel(GemvFp8Mma::NAME)?,
            gemv_fp8_mma_swiglu: g.kernel(GemvFp8MmaSwiglu::NAME)?,
            gemv_fp8_stream: g.kernel(GemvFp8Stream::NAME)?,
            gemv_fp8_swiglu_stream: g.kernel(GemvFp8SwigluStream::NAME)?,
            gemv_fp8_stream_norm: g.kernel(GemvFp8StreamNorm::NAME)?,
            gemv_fp8_swiglu_stream_norm: g.kernel(GemvFp8SwigluStreamNorm::NAME)?,
            fp8_dequant: g.kernel(Fp8DequantBf16::NAME)?,
            fp8_quantize: g.kernel(Fp8QuantizeRows::NAME)?,
            gemm_fp8: g.kernel(GemmFp8::NAME)?,
            fp8_scratch: DevicePtr::NULL,
            fp8_rows: Fp8Rows::default(),
        })
    }
}

/// A linear's weight on the device: BF16, or FP8 E4M3 with its scales.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LinearWeight {
    /// bf16 or e4m3 `[n, k]`.
    pub(crate) w: DevicePtr,
    /// f32 `[ceil(n / 2^row_shift), ceil(k / 128)]` for an FP8 weight, NULL for BF16.
    pub(crate) scales: DevicePtr,
    /// log2 of the rows one scale covers (7 or 0).
    pub(crate) row_shift: u32,
}

impl LinearWeight {
    /// A BF16 weight.
    pub(crate) fn bf16(w: DevicePtr) -> LinearWeight {
        LinearWeight {
            w,
            scales: DevicePtr::NULL,
            row_shift: 0,
        }
    }
}

/// One product's weight and shape.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Linear {
    /// The launch label (profile rows, tuning sets).
    pub(crate) label: &'static str,
    /// bf16 `[n, k]`, or e4m3 with `fp8`'s scales.
    pub(crate) w: DevicePtr,
    /// The FP8 weight's scales and their row shift, or NULL and 0 for a BF16 weight.
    fp8: (DevicePtr, u32),
    /// bf16 `[n]` or null.
    pub(crate) bias: DevicePtr,
    pub(crate) n: u32,
    pub(crate) k: u32,
    kernels: LinearKernels,
}

impl Linear {
    pub(crate) fn new(
        label: &'static str,
        w: DevicePtr,
        bias: DevicePtr,
        (n, k): (u32, u32),
        kernels: LinearKernels,
    ) -> Linear {
        Linear::of(label, LinearWeight::bf16(w), bias, (n, k), kernels)
    }

    /// A product over `weight`, whatever its dtype.
    pub(crate) fn of(
        label: &'static str,
        weight: LinearWeight,
        bias: DevicePtr,
        (n, k): (u32, u32),
        kernels: LinearKernels,
    ) -> Linear {
        Linear {
            label,
            w: weight.w,
            fp8: (weight.scales, weight.row_shift),
            bias,
            n,
            k,
            kernels,
        }
    }

    /// Whether the weight is FP8.
    fn is_fp8(&self) -> bool {
        !self.fp8.0.is_null()
    }

    /// How the product of `m` rows runs. An FP8 weight takes [`Path::Stream`] (the FP8 stream),
    /// [`Path::Gemv`] (the FP8 GEMV) or [`Path::Library`] (dequantised, then the library GEMM).
    pub(crate) fn path(&self, t: &Tuning, m: u32) -> Path {
        if self.is_fp8() {
            // Not gemv_rows' wide-K rule: that was measured against cuBLASLt on a BF16 weight; an
            // FP8 weight's library path first writes it out as BF16 (5 bytes moved a weight).
            if !(1..=t.gemv_max_rows.min(GEMV_FP8_MAX_ROWS)).contains(&m) {
                Path::Library
            } else if self.streams(t, m) {
                Path::Stream
            } else {
                Path::Gemv
            }
        } else if !t.gemv_rows(m, self.k) {
            Path::Library
        } else if self.streams(t, m) {
            Path::Stream
        } else if t.gemv_stage.takes(m, self.n, self.k) {
            Path::Staged
        } else {
            Path::Gemv
        }
    }

    /// Whether the product's dtype has a stream the tuning takes for it (the labels and size
    /// of `gemv_stream`, and for FP8 the `gemv_fp8_stream` switch). The caller checks the rows.
    fn streams(&self, t: &Tuning, m: u32) -> bool {
        let shape = (m, self.n, self.k);
        let (labels, min) = (&t.gemv_stream, t.gemv_stream_min_weights);
        if self.is_fp8() {
            t.gemv_fp8_stream && stream_takes(labels, min, self.label, shape, gemv_fp8_stream_fits)
        } else {
            stream_takes(labels, min, self.label, shape, gemv_stream_fits)
        }
    }

    /// Whether an FP8 product of `m` rows on [`Path::Gemv`] takes the tensor-core FP8 GEMV (the
    /// tuning's `gemv_fp8_mma_min_rows`, where [`gemv_fp8_mma_fits`]) rather than the register one; for
    /// the SwiGLU form `n` is the gate rows, which fit as the output columns do.
    fn fp8_mma(&self, t: &Tuning, m: u32) -> bool {
        m >= t.gemv_fp8_mma_min_rows && gemv_fp8_mma_fits(m, self.n, self.k)
    }

    /// Whether the product after a residual add + RMSNorm takes the norm into a register GEMV's
    /// launch ([`GemvNorm`], [`GemvSwigluNorm`]): the FMA form, A small enough for shared memory,
    /// as the tuning's `gemv_norm` picks, and a norm that folds ([`RmsNorm::folds`]: the caller
    /// asks that, since the product does not know its norm).
    pub(crate) fn folds_norm(&self, t: &Tuning, m: u32) -> bool {
        !self.is_fp8()
            && t.gemv_rows(m, self.k)
            && gemv_norm_fits(m, self.n, self.k)
            && t.gemv_norm.takes(m, self.n, self.k)
    }

    /// Whether the streamed product does the add + RMSNorm itself ([`GemvStreamNorm`],
    /// [`GemvFp8StreamNorm`]).
    fn stream_folds_norm(&self, t: &Tuning, m: u32) -> bool {
        t.gemv_stream_norm && self.path(t, m) == Path::Stream
    }

    fn stage(&self, t: &Tuning, m: u32) -> u32 {
        u32::from(t.gemv_stage.takes(m, self.n, self.k))
    }

    /// `out = a · Wᵀ (+ bias)` in bf16. `before_fold`: the next launch folds the residual add +
    /// RMSNorm (the carveout rule looks at it).
    pub(crate) fn run(
        &self,
        l: &Launcher,
        out: DevicePtr,
        a: DevicePtr,
        m: u32,
        before_fold: bool,
    ) -> Result<(), ModelError> {
        let t = l.tuning;
        let (label, k) = (self.label, &self.kernels);
        if self.is_fp8() {
            return self.run_fp8(l, out, a, m, before_fold);
        }
        let gemv = Gemv {
            c: out,
            a,
            w: self.w,
            bias: self.bias,
            m,
            n: self.n,
            k: self.k,
        };
        match self.path(t, m) {
            Path::Library => l.gemm(label, &self.gemm_op(out, a, m, false), k.gemm),
            Path::Stream => {
                let stream = GemvStream {
                    prewait: t.gemv_stream_prewait,
                    evict_first: t.gemv_stream_evict.into(),
                    ..GemvStream::from(gemv)
                };
                l.launch_product(k.gemv_stream, label, &stream, before_fold)
            }
            Path::Staged => {
                let staged = GemvStaged::from(gemv);
                l.launch_gemv(k.gemv_staged, label, &staged, (m, self.n), before_fold)
            }
            Path::Gemv => l.launch_gemv(k.gemv, label, &gemv, (m, self.n), before_fold),
        }
    }

    /// `out = a · Wᵀ` accumulated and written in f32 (the LM head: no bf16 rounding of the
    /// logits, so greedy choices are not decided by ties only bf16 creates). The staged form has
    /// no f32 entry: it takes the register GEMV.
    pub(crate) fn run_f32(
        &self,
        l: &Launcher,
        out: DevicePtr,
        a: DevicePtr,
        m: u32,
    ) -> Result<(), ModelError> {
        let t = l.tuning;
        let (label, k) = (self.label, &self.kernels);
        let head = GemvF32Out {
            c: out,
            a,
            w: self.w,
            bias: self.bias,
            m,
            n: self.n,
            k: self.k,
        };
        match self.path(t, m) {
            Path::Library => l.gemm(label, &self.gemm_op(out, a, m, true), k.gemm_f32out),
            Path::Stream => {
                let stream = GemvStreamF32Out {
                    prewait: t.gemv_stream_prewait,
                    evict_first: t.gemv_stream_evict.into(),
                    ..GemvStreamF32Out::from(head)
                };
                l.launch_product(k.gemv_stream_f32out, label, &stream, false)
            }
            Path::Staged | Path::Gemv => {
                l.launch_gemv(k.gemv_f32out, label, &head, (m, self.n), false)
            }
        }
    }

    /// Whether the FP8 product's library path takes the FP8 GEMM (the tuning's `fp8_gemm`, a
    /// weight in 128 x 128 blocks that [`gemm_fp8_fits`], the activations' scratch allocated).
    fn fp8_gemm(&self, t: &Tuning) -> bool {
        t.fp8_gemm
            && self.fp8.1 == 7
            && gemm_fp8_fits(self.n, self.k)
            && !self.kernels.fp8_rows.values.is_null()
    }

    /// Whether the product of `m` rows reads its input as e4m3 rows its producer wrote into the
    /// shared scratch ([`Rows::Fp8`]) rather than quantizing bf16 rows itself: the FP8 GEMM
    /// ([`Path::Library`] and the tuning's `fp8_gemm` where the weight fits) and the tuning's
    /// `fp8_fused_quantize`. A producer asks this (through [`Linear::input_rows`]) before it
    /// chooses its form.
    pub(crate) fn takes_fp8_rows(&self, t: &Tuning, m: u32) -> bool {
        t.fp8_fused_quantize && self.path(t, m) == Path::Library && self.fp8_gemm(t)
    }

    /// The form the product's `m` input rows should be written in: the e4m3 rows in the shared
    /// scratch where it [`takes_fp8_rows`](Linear::takes_fp8_rows), else bf16 at `bf16`.
    pub(crate) fn input_rows(&self, t: &Tuning, m: u32, bf16: DevicePtr) -> Rows {
        match self.takes_fp8_rows(t, m) {
            true => Rows::Fp8(self.kernels.fp8_rows),
            false => Rows::Bf16(bf16),
        }
    }

    /// [`Linear::run`] over input rows in either form ([`Linear::input_rows`]'s for this `m`):
    /// e4m3 rows go straight to the FP8 GEMM.
    pub(crate) fn run_rows(
        &self,
        l: &Launcher,
        out: DevicePtr,
        a: Rows,
        m: u32,
        before_fold: bool,
    ) -> Result<(), ModelError> {
        match a {
            Rows::Bf16(a) => self.run(l, out, a, m, before_fold),
            Rows::Fp8(rows) => {
                debug_assert!(
                    self.takes_fp8_rows(l.tuning, m),
                    "{}: e4m3 rows",
                    self.label
                );
                self.run_fp8_product(l, out, rows, m)
            }
        }
    }

    /// The FP8 product: the FP8 GEMV; the activations quantized and the FP8 library GEMM; or the
    /// weight dequantised into the shared scratch and the library GEMM over it.
    fn run_fp8(
        &self,
        l: &Launcher,
        out: DevicePtr,
        a: DevicePtr,
        m: u32,
        before_fold: bool,
    ) -> Result<(), ModelError> {
        let t = l.tuning;
        let (label, k) = (self.label, &self.kernels);
        let (scales, row_shift) = self.fp8;
        let gemv = GemvFp8 {
            c: out,
            a,
            w: self.w,
            scales,
            bias: self.bias,
            m,
            n: self.n,
            k: self.k,
            row_shift,
        };
        match self.path(t, m) {
            Path::Stream => {
                let stream = GemvFp8Stream {
                    c: out,
                    a,
                    w: self.w,
                    scales,
                    bias: self.bias,
                    m,
                    n: self.n,
                    k: self.k,
                    row_shift,
                    prewait: t.gemv_stream_prewait,
                    evict_first: t.gemv_stream_evict.into(),
                };
                return l.launch_product(k.gemv_fp8_stream, label, &stream, before_fold);
            }
            Path::Gemv | Path::Staged if self.fp8_mma(t, m) => {
                let mma = GemvFp8Mma {
                    c: out,
                    a,
                    w: self.w,
                    scales,
                    bias: self.bias,
                    m,
                    n: self.n,
                    k: self.k,
                    row_shift,
                };
                return l.launch_product(k.gemv_fp8_mma, label, &mma, before_fold);
            }
            Path::Gemv | Path::Staged => {
                return l.launch_product(k.gemv_fp8, label, &gemv, before_fold);
            }
            Path::Library if self.fp8_gemm(t) => return self.run_fp8_gemm(l, out, a, m),
            Path::Library => {}
        }
        self.dequantise(l)?;
        let op = GemmOp {
            w: k.fp8_scratch,
            ..self.gemm_op(out, a, m, false)
        };
        l.gemm(label, &op, k.gemm)
    }

    /// `out = a · Wᵀ (+ bias)` through the FP8 library GEMM: `a` quantized into the shared
    /// activation scratch (one product runs at a time on the step's stream), then the product of
    /// the two e4m3 operands.
    fn run_fp8_gemm(
        &self,
        l: &Launcher,
        out: DevicePtr,
        a: DevicePtr,
        m: u32,
    ) -> Result<(), ModelError> {
        let k = &self.kernels;
        let rows = k.fp8_rows;
        let quantize = Fp8QuantizeRows {
            q: rows.values,
            scales: rows.scales,
            a,
            m,
            k: self.k,
        };
        l.launch(k.fp8_quantize, "fp8_quantize", &quantize)?;
        self.run_fp8_product(l, out, rows, m)
    }

    /// `out = a · Wᵀ (+ bias)` through the FP8 library GEMM from rows already quantized into
    /// `rows` (by [`Fp8QuantizeRows`] or by the producer that wrote them: [`Rows::Fp8`]).
    fn run_fp8_product(
        &self,
        l: &Launcher,
        out: DevicePtr,
        rows: Fp8Rows,
        m: u32,
    ) -> Result<(), ModelError> {
        let op = GemmOp {
            fp8: Some(GemmFp8Scales {
                a: rows.scales,
                w: self.fp8.0,
                tail: rows.tail,
            }),
            ..self.gemm_op(out, rows.values, m, false)
        };
        l.gemm(self.label, &op, self.kernels.gemm_fp8)
    }

    /// The FP8 weight as BF16 in the shared scratch.
    fn dequantise(&self, l: &Launcher) -> Result<(), ModelError> {
        if self.kernels.fp8_scratch.is_null() {
            // Sized at load for the weights the load's tuning dequantises (with `fp8_gemm`, only
            // those the FP8 GEMM cannot take): a step under another tuning must not write it.
            return Err(ModelError::InvalidStep(format!(
                "the FP8 product {} needs the BF16 dequantise scratch, which this model's tuning \
                 at load did not allocate (load it with the tuning it runs with)",
                self.label
            )));
        }
        let (scales, row_shift) = self.fp8;
        let args = Fp8DequantBf16 {
            out: self.kernels.fp8_scratch,
            w: self.w,
            scales,
            n: self.n,
            k: self.k,
            row_shift,
        };
        l.launch(self.kernels.fp8_dequant, "fp8_dequant", &args)
    }

    fn gemm_op(&self, c: DevicePtr, a: DevicePtr, m: u32, f32_out: bool) -> GemmOp {
        GemmOp {
            c,
            a,
            w: self.w,
            bias: self.bias,
            m,
            n: self.n,
            k: self.k,
            f32_out,
            fp8: None,
        }
    }

    /// The residual fold, then the product: `h += pending; out = norm(h) · Wᵀ (+ bias)`, in the
    /// product's launch where a normalising form takes it (never a norm with a weight offset:
    /// [`RmsNorm::folds`]), else as two launches, the fold writing the rows in the form the
    /// product reads ([`Linear::input_rows`]).
    pub(crate) fn run_normed(
        &self,
        l: &Launcher,
        residual: &mut Residual,
        norm: RmsNorm,
        out: DevicePtr,
        m: u32,
    ) -> Result<(), ModelError> {
        let t = l.tuning;
        let k = &self.kernels;
        let fold = GemvNorm {
            c: out,
            residual: residual.current(),
            residual_out: residual.other(),
            input: residual.pending(),
            norm_weight: norm.weight,
            w: self.w,
            bias: self.bias,
            m,
            n: self.n,
            k: self.k,
            eps: norm.eps,
            stage: self.stage(t, m),
        };
        if norm.folds() && self.stream_folds_norm(t, m) && self.is_fp8() {
            let (scales, row_shift) = self.fp8;
            let stream = GemvFp8StreamNorm {
                c: out,
                residual: fold.residual,
                residual_out: fold.residual_out,
                input: fold.input,
                norm_weight: norm.weight,
                w: self.w,
                scales,
                bias: self.bias,
                m,
                n: self.n,
                k: self.k,
                eps: norm.eps,
                row_shift,
                prewait: t.gemv_stream_prewait,
                evict_first: t.gemv_stream_evict.into(),
            };
            l.launch_product(k.gemv_fp8_stream_norm, self.label, &stream, false)?;
            residual.advance(l, self.label);
        } else if norm.folds() && self.stream_folds_norm(t, m) {
            let stream = GemvStreamNorm {
                prewait: t.gemv_stream_prewait,
                evict_first: t.gemv_stream_evict.into(),
                ..GemvStreamNorm::from(fold)
            };
            l.launch_product(k.gemv_stream_norm, self.label, &stream, false)?;
            residual.advance(l, self.label);
        } else if norm.folds() && self.folds_norm(t, m) {
            l.launch(k.gemv_norm, self.label, &fold)?;
            residual.advance(l, self.label);
        } else {
            let x = self.input_rows(t, m, residual.normed());
            residual.add_norm_into(l, norm, m, x)?;
            self.run_rows(l, out, x, m, false)?;
        }
        Ok(())
    }
}

/// The gate|up product (`[2 * inter, k]`: gate rows, then up rows) followed by SiLU(gate) x up.
#[derive(Clone, Copy, Debug)]
pub(crate) struct SwigluLinear {
    pub(crate) gate_up: Linear,
    pub(crate) inter: u32,
    /// bf16 `[tokens, 2 * inter]`: the product where SiLU x up runs in a launch of its own.
    pub(crate) scratch: DevicePtr,
}

impl SwigluLinear {
    /// Whether the product runs SiLU x up in its epilogue this step, into bf16 `act`: returns
    /// that buffer. (A GEMV path: for BF16 exactly the rows [`Tuning::gemv_rows`] takes; for FP8
    /// up to `gemv_max_rows`, at most [`GEMV_FP8_MAX_ROWS`]. Not where the activations are to be
    /// e4m3 rows: the epilogue writes bf16.)
    fn fused(&self, t: &Tuning, m: u32, act: Rows) -> Option<DevicePtr> {
        match act {
            Rows::Bf16(act) if t.fused_swiglu && self.gate_up.path(t, m) != Path::Library => {
                Some(act)
            }
            _ => None,
        }
    }

    /// `h += pending; act = silu(norm(h) · Wgateᵀ) * (norm(h) · Wupᵀ)`, `[m, inter]` in the form
    /// `act` names (the down product's [`Linear::input_rows`]); the norm in the product's launch
    /// as [`Linear::run_normed`] decides.
    pub(crate) fn run_normed(
        &self,
        l: &Launcher,
        residual: &mut Residual,
        norm: RmsNorm,
        act: Rows,
        m: u32,
    ) -> Result<(), ModelError> {
        let t = l.tuning;
        let lin = &self.gate_up;
        let (k, label, inter) = (&lin.kernels, lin.label, self.inter);
        let fused = self.fused(t, m, act);
        let streams_norm = norm.folds() && lin.stream_folds_norm(t, m);
        let fold = GemvSwigluNorm {
            out: fused.unwrap_or(DevicePtr::NULL),
            residual: residual.current(),
            residual_out: residual.other(),
            input: residual.pending(),
            norm_weight: norm.weight,
            w: lin.w,
            m,
            inter,
            k: lin.k,
            eps: norm.eps,
            stage: lin.stage(t, m),
        };
        match fused {
            Some(out) if streams_norm && lin.is_fp8() => {
                let (scales, row_shift) = lin.fp8;
                let stream = GemvFp8SwigluStreamNorm {
                    out,
                    residual: fold.residual,
                    residual_out: fold.residual_out,
                    input: fold.input,
                    norm_weight: norm.weight,
                    w: lin.w,
                    scales,
                    m,
                    inter,
                    k: lin.k,
                    eps: norm.eps,
                    row_shift,
                    prewait: t.gemv_stream_prewait,
                    evict_first: t.gemv_stream_evict.into(),
                };
                l.launch_product(k.gemv_fp8_swiglu_stream_norm, label, &stream, false)?;
            }
            Some(_) if streams_norm => {
                let stream = GemvSwigluStreamNorm {
                    prewait: t.gemv_stream_prewait,
                    evict_first: t.gemv_stream_evict.into(),
                    ..GemvSwigluStreamNorm::from(fold)
                };
                l.launch_product(k.gemv_swiglu_stream_norm, label, &stream, false)?;
            }
            Some(_) if norm.folds() && lin.folds_norm(t, m) => {
                l.launch(k.gemv_swiglu_norm, label, &fold)?;
            }
            None if norm.folds() && lin.folds_norm(t, m) => {
                let product = GemvNorm {
                    c: self.scratch,
                    residual: fold.residual,
                    residual_out: fold.residual_out,
                    input: fold.input,
                    norm_weight: norm.weight,
                    w: lin.w,
                    bias: DevicePtr::NULL,
                    m,
                    n: lin.n,
                    k: lin.k,
                    eps: norm.eps,
                    stage: fold.stage,
                };
                l.launch(k.gemv_norm, label, &product)?;
                self.silu_mul(l, act, m)?;
            }
            _ => {
                let x = lin.input_rows(t, m, residual.normed());
                residual.add_norm_into(l, norm, m, x)?;
                return self.run(l, act, x, m);
            }
        }
        residual.advance(l, label);
        Ok(())
    }

    /// `act = silu(x · Wgateᵀ) * (x · Wupᵀ)` over rows already normalised, `x` and `act` each in
    /// the form their product reads ([`Linear::input_rows`]): SiLU x up in the product's epilogue
    /// where both are bf16 and the path takes it, else the product into the scratch and SiLU x
    /// up in a launch of its own, which writes `act`'s form.
    pub(crate) fn run(&self, l: &Launcher, act: Rows, x: Rows, m: u32) -> Result<(), ModelError> {
        let lin = &self.gate_up;
        match (self.fused(l.tuning, m, act), x) {
            (Some(act), Rows::Bf16(x)) => self.run_fused(l, act, x, m),
            _ => {
                lin.run_rows(l, self.scratch, x, m, false)?;
                self.silu_mul(l, act, m)
            }
        }
    }

    /// The product with SiLU x up in its epilogue, bf16 `x` to bf16 `act`.
    fn run_fused(
        &self,
        l: &Launcher,
        act: DevicePtr,
        x: DevicePtr,
        m: u32,
    ) -> Result<(), ModelError> {
        let t = l.tuning;
        let lin = &self.gate_up;
        let (k, label) = (&lin.kernels, lin.label);
        if lin.is_fp8() {
            let (scales, row_shift) = lin.fp8;
            if lin.path(t, m) == Path::Stream {
                let stream = GemvFp8SwigluStream {
                    out: act,
                    a: x,
                    w: lin.w,
                    scales,
                    m,
                    inter: self.inter,
                    k: lin.k,
                    row_shift,
                    prewait: t.gemv_stream_prewait,
                    evict_first: t.gemv_stream_evict.into(),
                };
                return l.launch_product(k.gemv_fp8_swiglu_stream, label, &stream, false);
            }
            if lin.fp8_mma(t, m) {
                let mma = GemvFp8MmaSwiglu {
                    out: act,
                    a: x,
                    w: lin.w,
                    scales,
                    m,
                    inter: self.inter,
                    k: lin.k,
                    row_shift,
                };
                return l.launch_product(k.gemv_fp8_mma_swiglu, label, &mma, false);
            }
            let swiglu = GemvFp8Swiglu {
                out: act,
                a: x,
                w: lin.w,
                scales,
                m,
                inter: self.inter,
                k: lin.k,
                row_shift,
            };
            return l.launch_product(k.gemv_fp8_swiglu, label, &swiglu, false);
        }
        let swiglu = GemvSwiglu {
            out: act,
            a: x,
            w: lin.w,
            m,
            inter: self.inter,
            k: lin.k,
        };
        match lin.path(t, m) {
            Path::Stream => {
                let stream = GemvSwigluStream {
                    prewait: t.gemv_stream_prewait,
                    evict_first: t.gemv_stream_evict.into(),
                    ..GemvSwigluStream::from(swiglu)
                };
                l.launch_product(k.gemv_swiglu_stream, label, &stream, false)
            }
            Path::Staged => {
                let staged = GemvSwigluStaged::from(swiglu);
                l.launch_gemv(k.gemv_swiglu_staged, label, &staged, (m, lin.n), false)
            }
            Path::Gemv | Path::Library => {
                l.launch_gemv(k.gemv_swiglu, label, &swiglu, (m, lin.n), false)
            }
        }
    }

    /// SiLU x up of the product in the scratch, into `act`'s form: bf16 ([`SiluMul`]) or the
    /// down product's e4m3 rows ([`SiluMulFp8Rows`]: the bits [`SiluMul`] then the quantize
    /// launch would write).
    fn silu_mul(&self, l: &Launcher, act: Rows, m: u32) -> Result<(), ModelError> {
        let (gate_up, inter) = (self.scratch, self.inter);
        let k = &self.gate_up.kernels;
        match act {
            Rows::Bf16(out) => {
                let args = SiluMul {
                    out,
                    gate_up,
                    tokens: m,
                    inter,
                };
                l.launch(k.silu_mul, "silu_mul", &args)
            }
            Rows::Fp8(rows) => {
                let args = SiluMulFp8Rows {
                    q: rows.values,
                    scales: rows.scales,
                    gate_up,
                    tokens: m,
                    inter,
                };
                l.launch(k.silu_mul_fp8_rows, "silu_mul", &args)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::stream_takes;
    use metrale_kernels::ops::{gemv_fp8_stream_fits, gemv_stream_fits};

    #[test]
    fn the_default_stream_set_takes_qwen3_8b_products_not_qwen3_0_6b() {
        let labels = ["qkv", "o", "gate_up", "down"];
        let default = |label, mnk| stream_takes(&labels, 8 << 20, label, mnk, gemv_stream_fits);
        // Qwen3-8B at batch 1: qkv, o, gate|up (both halves' rows), down.
        for (label, mnk) in [
            ("qkv", (1, 6144, 4096)),
            ("o", (1, 4096, 4096)),
            ("gate_up", (1, 24576, 4096)),
            ("down", (1, 4096, 12288)),
        ] {
            assert!(default(label, mnk), "{label} {mnk:?}");
        }
        // Qwen3-0.6B's (under 8M weights), two rows, and the LM head, which is not in the set.
        for (label, mnk) in [
            ("qkv", (1, 4096, 1024)),
            ("o", (1, 1024, 2048)),
            ("gate_up", (1, 6144, 1024)),
            ("down", (1, 1024, 3072)),
            ("down", (2, 4096, 12288)),
            ("lm_head", (1, 151936, 4096)),
        ] {
            assert!(!default(label, mnk), "{label} {mnk:?}");
        }
        // A set with no threshold streams whatever fits, however small: Qwen3-0.6B's o and qkv
        // (rows of 2 KiB, in half-size chunks), not SmolLM2's qkv (rows of 576 elements).
        let bf16 = gemv_stream_fits;
        assert!(stream_takes(&["o"], 0, "o", (1, 1024, 2048), bf16));
        assert!(stream_takes(&["qkv"], 0, "qkv", (1, 4096, 1024), bf16));
        assert!(!stream_takes(&["qkv"], 0, "qkv", (1, 960, 576), bf16));
        // gate_up's columns are half its rows: 7 outputs over 14 rows fit.
        assert!(stream_takes(
            &["gate_up"],
            0,
            "gate_up",
            (1, 14, 2048),
            bf16
        ));
        // The FP8 stream takes the same labels and sizes where its kernel fits: Qwen3-8B's four
        // products, not Qwen3-4B's rows of 2560 inputs (not whole 1-KiB chunks).
        let fp8 = |label, mnk| stream_takes(&labels, 8 << 20, label, mnk, gemv_fp8_stream_fits);
        assert!(fp8("gate_up", (1, 24576, 4096)) && fp8("down", (1, 4096, 12288)));
        assert!(!fp8("qkv", (1, 6144, 2560)) && !fp8("qkv", (2, 6144, 4096)));
    }
}
