// SPDX-License-Identifier: MIT OR Apache-2.0
//! Bench rows of the FP8-weight decode products (`gemv_fp8.cu`, and `gemv_stream.cu`'s
//! `gemv_fp8_*` entries) at a dense model's shapes, labelled `<shape> fp8 <what> m= n= k=` as
//! scripts/gpu/torch_kernels.py --fp8 labels its `torch._scaled_mm` rows, so that the kernel table
//! sets them side by side.
//!
//! The rows are the kernels the engine launches for an FP8 product (crates/model-engine,
//! `Linear::path`): at one row the FP8 stream where it fits (its SwiGLU form for gate|up, and for
//! qkv and gate|up its forms with the residual add + RMSNorm before the product), up to
//! [`GEMV_FP8_MAX_ROWS`] rows the tensor-core FP8 GEMV (`gemv_fp8_mma.cu`, from the tuning's
//! `gemv_fp8_mma_min_rows`) where it fits, else the register FP8 GEMV. As the BF16 rows, the register GEMV
//! has the bare label, the stream's rows end in " (stream)" and the tensor-core GEMV's in " (mma)". Above [`GEMV_FP8_MAX_ROWS`] rows the
//! engine writes the weight out as BF16 and runs the library GEMM: no one launch stands for that,
//! so prefill-sized FP8 products have PyTorch rows only. The plain gate|up product, which the
//! engine always runs with SiLU x up in its epilogue, is kept because PyTorch's row is the plain
//! product.
//!
//! [`fp8_gemm_cases`]: the FP8 prefill product (`fp8_gemm.cu`, the engine's path with the
//! tuning's `fp8_gemm` on): the activation quantization (`<shape> fp8 quantize m= k=`) and the
//! block-scaled FP8 GEMM through `GpuBackend::gemm` (cuBLASLt on CUDA) under the product labels
//! plus " (GpuBackend::gemm)". PyTorch's rows quantize the activations inside the op, so the
//! quantize row of the product's k belongs to the sum.
//!
//! Weights are e4m3 1.5 (fill 0x3C) in 128 x 128 blocks whose f32 scales fill with 0x3C too
//! (about 0.0115), as do the bf16 activations: outputs near 1, no NaN or subnormal anywhere. The
//! kernels' work does not depend on the values (no zero skipping; the e4m3 conversion takes the
//! same instructions for every code).

use metrale_core::DevicePtr;
use metrale_kernels::KernelAbi;
use metrale_kernels::ops::{
    AddRmsNormFp8Rows, FP8_GEMM_PAD_ROWS, FP8_GEMM_ROW_GROUP, FP8_SCALE_COLS, Fp8QuantizeRows,
    GEMV_FP8_MAX_ROWS, GEMV_STREAM_STAGES, GemmFp8, GemvFp8, GemvFp8Mma, GemvFp8MmaSwiglu,
    GemvFp8Stream, GemvFp8StreamNorm, GemvFp8Swiglu, GemvFp8SwigluStream, GemvFp8SwigluStreamNorm,
    SiluMulFp8Rows, gemm_fp8_fits, gemv_fp8_mma_fits, gemv_fp8_stream_fits,
};

use super::{BenchCase, Shape, launch_of};
use crate::{GemmFp8Scales, GemmOp};

/// log2 of the rows a scale covers: 128 x 128 blocks, as FP8 checkpoints ship them.
const ROW_SHIFT: u32 = 7;
/// The fill of every input: e4m3 1.5, bf16 and f32 about 0.0115.
const FILL: u8 = 0x3C;

/// One FP8 product of the decode step: `m` rows through an `[n, k]` weight.
#[derive(Clone, Copy, Debug)]
struct Fp8Product {
    /// The product's name in labels (torch_kernels.py's for the plain products).
    what: &'static str,
    m: u32,
    /// Weight rows (gate and up rows both, for the SwiGLU product).
    n: u32,
    k: u32,
    /// SiLU(gate) x up in the epilogue: `n / 2` output columns.
    swiglu: bool,
    /// The engine runs it after a residual add + RMSNorm that the stream can take into its
    /// launch (qkv, and gate|up in its SwiGLU form).
    after_norm: bool,
}

impl Fp8Product {
    fn out_cols(self) -> u32 {
        if self.swiglu { self.n / 2 } else { self.n }
    }

    fn label(self, s: &Shape) -> String {
        let Fp8Product { what, m, n, k, .. } = self;
        format!("{} fp8 {what} m={m} n={n} k={k}", s.name)
    }

    /// Bytes of the e4m3 weight and its f32 scales.
    fn weight_bytes(self) -> u64 {
        let blocks =
            self.n.div_ceil(1 << ROW_SHIFT) as u64 * self.k.div_ceil(FP8_SCALE_COLS) as u64;
        self.n as u64 * self.k as u64 + blocks * 4
    }

    fn scale_buffer(self) -> (usize, u8) {
        let blocks = self.n.div_ceil(1 << ROW_SHIFT) * self.k.div_ceil(FP8_SCALE_COLS);
        (blocks as usize * 4, FILL)
    }

    fn flops(self) -> u64 {
        2 * self.m as u64 * self.n as u64 * self.k as u64
    }

    /// Whether the FP8 stream takes the product (the engine's test, on its output columns).
    fn streams(self) -> bool {
        gemv_fp8_stream_fits(self.m, self.out_cols(), self.k)
    }

    /// Whether the tensor-core FP8 GEMV takes the product (the engine's test).
    fn mmas(self) -> bool {
        gemv_fp8_mma_fits(self.m, self.out_cols(), self.k)
    }
}

/// The product through the register FP8 GEMV ([`GemvFp8`], [`GemvFp8Swiglu`]) on its own grid,
/// as the engine launches it. Bytes: the weight and scales, A and the output.
fn gemv_case(s: &Shape, p: Fp8Product) -> BenchCase {
    let Fp8Product { m, n, k, .. } = p;
    let out = (m * p.out_cols()) as usize * 2;
    BenchCase {
        kernel: if p.swiglu {
            GemvFp8Swiglu::NAME
        } else {
            GemvFp8::NAME
        },
        label: p.label(s),
        bytes: p.weight_bytes() + m as u64 * k as u64 * 2 + out as u64,
        flops: p.flops(),
        buffers: vec![
            (out, 0),
            ((m * k) as usize * 2, FILL),
            (n as usize * k as usize, FILL),
            p.scale_buffer(),
        ],
        uploads: vec![],
        library_gemm: None,
        build: Box::new(move |b| {
            if p.swiglu {
                launch_of(GemvFp8Swiglu {
                    out: b[0],
                    a: b[1],
                    w: b[2],
                    scales: b[3],
                    m,
                    inter: n / 2,
                    k,
                    row_shift: ROW_SHIFT,
                })
            } else {
                launch_of(GemvFp8 {
                    c: b[0],
                    a: b[1],
                    w: b[2],
                    scales: b[3],
                    bias: DevicePtr::NULL,
                    m,
                    n,
                    k,
                    row_shift: ROW_SHIFT,
                })
            }
        }),
    }
}

/// [`gemv_case`]'s one-row product through the FP8 stream ([`GemvFp8Stream`],
/// [`GemvFp8SwigluStream`]), the whole first fill before the wait, no L2 hint, as the BF16
/// stream's rows.
fn stream_case(s: &Shape, p: Fp8Product) -> BenchCase {
    let mut case = gemv_case(s, p);
    case.label = format!("{} (stream)", case.label);
    let Fp8Product { n, k, .. } = p;
    if p.swiglu {
        case.kernel = GemvFp8SwigluStream::NAME;
        case.build = Box::new(move |b| {
            launch_of(GemvFp8SwigluStream {
                out: b[0],
                a: b[1],
                w: b[2],
                scales: b[3],
                m: 1,
                inter: n / 2,
                k,
                row_shift: ROW_SHIFT,
                prewait: GEMV_STREAM_STAGES,
                evict_first: 0,
            })
        });
    } else {
        case.kernel = GemvFp8Stream::NAME;
        case.build = Box::new(move |b| {
            launch_of(GemvFp8Stream {
                c: b[0],
                a: b[1],
                w: b[2],
                scales: b[3],
                bias: DevicePtr::NULL,
                m: 1,
                n,
                k,
                row_shift: ROW_SHIFT,
                prewait: GEMV_STREAM_STAGES,
                evict_first: 0,
            })
        });
    }
    case
}

/// [`gemv_case`]'s product through the tensor-core FP8 GEMV ([`GemvFp8Mma`],
/// [`GemvFp8MmaSwiglu`]) on its own grid, labelled with " (mma)".
fn mma_case(s: &Shape, p: Fp8Product) -> BenchCase {
    let mut case = gemv_case(s, p);
    case.label = format!("{} (mma)", case.label);
    let Fp8Product { m, n, k, .. } = p;
    if p.swiglu {
        case.kernel = GemvFp8MmaSwiglu::NAME;
        case.build = Box::new(move |b| {
            launch_of(GemvFp8MmaSwiglu {
                out: b[0],
                a: b[1],
                w: b[2],
                scales: b[3],
                m,
                inter: n / 2,
                k,
                row_shift: ROW_SHIFT,
            })
        });
    } else {
        case.kernel = GemvFp8Mma::NAME;
        case.build = Box::new(move |b| {
            launch_of(GemvFp8Mma {
                c: b[0],
                a: b[1],
                w: b[2],
                scales: b[3],
                bias: DevicePtr::NULL,
                m,
                n,
                k,
                row_shift: ROW_SHIFT,
            })
        });
    }
    case
}

/// The residual add + RMSNorm and the one-row product after it in the FP8 stream's launch
/// ([`GemvFp8StreamNorm`], [`GemvFp8SwigluStreamNorm`]), labelled `add+rmsnorm+<what>` as the
/// BF16 normalising rows. Bytes: the weight and scales, the residual read and written (f32), the
/// input, the norm weight and the output.
fn stream_norm_case(s: &Shape, p: Fp8Product) -> BenchCase {
    let Fp8Product { what, n, k, .. } = p;
    let out = p.out_cols() as usize * 2;
    BenchCase {
        kernel: if p.swiglu {
            GemvFp8SwigluStreamNorm::NAME
        } else {
            GemvFp8StreamNorm::NAME
        },
        label: format!("{} fp8 add+rmsnorm+{what} m=1 n={n} k={k} (stream)", s.name),
        bytes: p.weight_bytes() + k as u64 * (4 + 4 + 2) + k as u64 * 2 + out as u64,
        flops: p.flops() + 4 * k as u64,
        buffers: vec![
            (out, 0),
            (k as usize * 4, FILL),
            (k as usize * 4, 0),
            (k as usize * 2, FILL),
            (k as usize * 2, FILL),
            (n as usize * k as usize, FILL),
            p.scale_buffer(),
        ],
        uploads: vec![],
        library_gemm: None,
        build: Box::new(move |b| {
            if p.swiglu {
                launch_of(GemvFp8SwigluStreamNorm {
                    out: b[0],
                    residual: b[1],
                    residual_out: b[2],
                    input: b[3],
                    norm_weight: b[4],
                    w: b[5],
                    scales: b[6],
                    m: 1,
                    inter: n / 2,
                    k,
                    eps: 1e-6,
                    row_shift: ROW_SHIFT,
                    prewait: GEMV_STREAM_STAGES,
                    evict_first: 0,
                })
            } else {
                launch_of(GemvFp8StreamNorm {
                    c: b[0],
                    residual: b[1],
                    residual_out: b[2],
                    input: b[3],
                    norm_weight: b[4],
                    w: b[5],
                    scales: b[6],
                    bias: DevicePtr::NULL,
                    m: 1,
                    n,
                    k,
                    eps: 1e-6,
                    row_shift: ROW_SHIFT,
                    prewait: GEMV_STREAM_STAGES,
                    evict_first: 0,
                })
            }
        }),
    }
}

/// The FP8 products of a dense model's decode step: the register FP8 GEMV at 1 and
/// [`GEMV_FP8_MAX_ROWS`] rows, then at one row the FP8 stream where it fits, plain and after the
/// add + RMSNorm (qkv, gate|up), then the tensor-core FP8 GEMV at 1 and [`GEMV_FP8_MAX_ROWS`] rows
/// where it fits (after the others, so that their rows keep their places).
pub(super) fn fp8_product_cases(s: &Shape) -> Vec<BenchCase> {
    let (h, i) = (s.hidden, s.inter);
    let (qd, kvd) = (s.q_heads * s.head_dim, s.kv_heads * s.head_dim);
    let products = |m| {
        let plain = |what, n, k| Fp8Product {
            what,
            m,
            n,
            k,
            swiglu: false,
            after_norm: false,
        };
        [
            Fp8Product {
                after_norm: true,
                ..plain("qkv_proj", qd + 2 * kvd, h)
            },
            plain("o_proj", h, qd),
            plain("gate_up", 2 * i, h),
            Fp8Product {
                swiglu: true,
                after_norm: true,
                ..plain("gate_up+silu*mul", 2 * i, h)
            },
            plain("down", h, i),
        ]
    };
    let mut out = Vec::new();
    for m in [1, GEMV_FP8_MAX_ROWS] {
        out.extend(products(m).map(|p| gemv_case(s, p)));
    }
    let one_row = products(1);
    out.extend(
        one_row
            .iter()
            .filter(|p| p.streams())
            .map(|&p| stream_case(s, p)),
    );
    out.extend(
        one_row
            .iter()
            .filter(|p| p.streams() && p.after_norm)
            .map(|&p| stream_norm_case(s, p)),
    );
    for m in [1, GEMV_FP8_MAX_ROWS] {
        out.extend(
            products(m)
                .into_iter()
                .filter(|p| p.mmas())
                .map(|p| mma_case(s, p)),
        );
    }
    out
}

/// The FP8 prefill product at each of `rows`: the activation quantization at each input width
/// of the step's products, the add + RMSNorm and SiLU x up that write the quantized rows
/// themselves (the engine's default with `fp8_gemm`), then qkv, o, gate|up and down through
/// `GpuBackend::gemm` with `GemmOp::fp8` where the weight fits ([`gemm_fp8_fits`]).
pub(super) fn fp8_gemm_cases(s: &Shape, rows: &[u32]) -> Vec<BenchCase> {
    let (h, i) = (s.hidden, s.inter);
    let (qd, kvd) = (s.q_heads * s.head_dim, s.kv_heads * s.head_dim);
    let mut out = Vec::new();
    for &m in rows {
        let mut widths = vec![h, qd, i];
        widths.sort_unstable();
        widths.dedup();
        for k in widths {
            out.push(quantize_case(s, m, k));
        }
        out.push(norm_rows_case(s, m));
        out.push(silu_rows_case(s, m));
        for (what, n, k) in [
            ("qkv_proj", qd + 2 * kvd, h),
            ("o_proj", h, qd),
            ("gate_up", 2 * i, h),
            ("down", h, i),
        ] {
            if gemm_fp8_fits(n, k) {
                out.push(library_case(s, what, m, n, k));
            }
        }
    }
    out
}

fn quantize_case(s: &Shape, m: u32, k: u32) -> BenchCase {
    let padded = m.next_multiple_of(FP8_GEMM_ROW_GROUP);
    let scales = (k.div_ceil(FP8_SCALE_COLS) * padded) as usize * 4;
    let (elements, floor) = ((m * k) as usize, u64::from(m) * u64::from(k));
    BenchCase {
        kernel: Fp8QuantizeRows::NAME,
        label: format!("{} fp8 quantize m={m} k={k}", s.name),
        bytes: floor * 3 + scales as u64,
        flops: floor * 2,
        buffers: vec![
            ((padded * k) as usize, 0),
            (scales, 0),
            (elements * 2, FILL),
        ],
        uploads: vec![],
        build: Box::new(move |p| {
            launch_of(Fp8QuantizeRows {
                q: p[0],
                scales: p[1],
                a: p[2],
                m,
                k,
            })
        }),
        library_gemm: None,
    }
}

/// The quantized rows' buffers of `m x k` (e4m3 values over `m` rounded up to 16 rows, then their
/// scales) and their bytes written.
fn quantized_rows(m: u32, k: u32) -> ([(usize, u8); 2], u64) {
    let padded = m.next_multiple_of(FP8_GEMM_ROW_GROUP);
    let scales = (k.div_ceil(FP8_SCALE_COLS) * padded) as usize * 4;
    let values = (padded * k) as usize;
    ([(values, 0), (scales, 0)], (values + scales) as u64)
}

/// The residual add + RMSNorm over `m` rows writing the quantized rows ([`AddRmsNormFp8Rows`]):
/// the residual read and written in f32, the input and the weight read.
fn norm_rows_case(s: &Shape, m: u32) -> BenchCase {
    let h = s.hidden;
    let ([q, scales], written) = quantized_rows(m, h);
    let elements = u64::from(m) * u64::from(h);
    BenchCase {
        kernel: AddRmsNormFp8Rows::NAME,
        label: format!("{} add+rmsnorm fp8 rows m={m} k={h}", s.name),
        bytes: elements * (4 + 4 + 2) + written,
        flops: elements * 6,
        buffers: vec![
            q,
            scales,
            ((m * h) as usize * 4, 0),
            ((m * h) as usize * 2, FILL),
            (h as usize * 2, FILL),
        ],
        uploads: vec![],
        build: Box::new(move |p| {
            launch_of(AddRmsNormFp8Rows {
                q: p[0],
                scales: p[1],
                residual: p[2],
                input: p[3],
                weight: p[4],
                rows: m,
                cols: h,
                eps: 1e-6,
                weight_offset: 0.0,
            })
        }),
        library_gemm: None,
    }
}

/// SiLU x up over `m` rows writing the quantized rows ([`SiluMulFp8Rows`]).
fn silu_rows_case(s: &Shape, m: u32) -> BenchCase {
    let i = s.inter;
    let ([q, scales], written) = quantized_rows(m, i);
    let elements = u64::from(m) * u64::from(i);
    BenchCase {
        kernel: SiluMulFp8Rows::NAME,
        label: format!("{} silu*mul fp8 rows m={m} k={i}", s.name),
        bytes: elements * 4 + written,
        flops: elements * 7,
        buffers: vec![q, scales, ((m * i) as usize * 4, FILL)],
        uploads: vec![],
        build: Box::new(move |p| {
            launch_of(SiluMulFp8Rows {
                q: p[0],
                scales: p[1],
                gate_up: p[2],
                tokens: m,
                inter: i,
            })
        }),
        library_gemm: None,
    }
}

fn library_case(s: &Shape, what: &str, m: u32, n: u32, k: u32) -> BenchCase {
    let kb = k.div_ceil(FP8_SCALE_COLS) as usize;
    let padded = m.next_multiple_of(FP8_GEMM_ROW_GROUP);
    let a_scales = kb * padded as usize * 4;
    let w_scales = kb * n.div_ceil(FP8_SCALE_COLS) as usize * 4;
    let (m64, n64, k64) = (u64::from(m), u64::from(n), u64::from(k));
    BenchCase {
        kernel: GemmFp8::NAME,
        label: format!("{} fp8 {what} m={m} n={n} k={k} (GpuBackend::gemm)", s.name),
        bytes: n64 * k64 + m64 * k64 + m64 * n64 * 2 + (a_scales + w_scales) as u64,
        flops: 2 * m64 * n64 * k64,
        buffers: vec![
            ((m * n) as usize * 2, 0),
            ((padded * k) as usize, FILL),
            ((n * k) as usize, FILL),
            (a_scales, FILL),
            (w_scales, FILL),
            ((FP8_GEMM_PAD_ROWS * n) as usize * 2, 0),
        ],
        uploads: vec![],
        build: Box::new(move |p| {
            launch_of(GemmFp8 {
                c: p[0],
                a: p[1],
                a_scales: p[3],
                w: p[2],
                w_scales: p[4],
                bias: DevicePtr::NULL,
                m,
                n,
                k,
            })
        }),
        library_gemm: Some(GemmOp {
            c: DevicePtr::NULL,
            a: DevicePtr::NULL,
            w: DevicePtr::NULL,
            bias: DevicePtr::NULL,
            m,
            n,
            k,
            f32_out: false,
            fp8: Some(GemmFp8Scales {
                a: DevicePtr::NULL,
                w: DevicePtr::NULL,
                tail: DevicePtr::NULL,
            }),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::super::{QWEN3_8B, model_cases};

    /// torch_kernels.py --fp8's product labels at 1 and 8 rows each have the register GEMV's row,
    /// and at one row the stream's (" (stream)", which kernel_table.py strips to match); the
    /// prefill sizes have none.
    #[test]
    fn fp8_rows_take_torch_kernels_labels() {
        let cases = model_cases(&QWEN3_8B, &[128]);
        let kernel = |label: &str| {
            cases
                .iter()
                .find(|c| c.label == label)
                .map(|c| c.kernel.function)
        };
        for (what, n, k) in [
            ("qkv_proj", 6144, 4096),
            ("o_proj", 4096, 4096),
            ("gate_up", 24576, 4096),
            ("down", 4096, 12288),
        ] {
            let label = |m| format!("qwen3-8b fp8 {what} m={m} n={n} k={k}");
            for m in [1, 8] {
                assert_eq!(kernel(&label(m)), Some("gemv_fp8"), "{}", label(m));
            }
            let stream = format!("{} (stream)", label(1));
            assert_eq!(kernel(&stream), Some("gemv_fp8_stream"), "{stream}");
            for m in [1, 8] {
                let mma = format!("{} (mma)", label(m));
                assert_eq!(kernel(&mma), Some("gemv_fp8_mma"), "{mma}");
            }
            assert_eq!(kernel(&label(128)), None);
        }
        for (label, function) in [
            ("gate_up+silu*mul m=1", "gemv_fp8_swiglu"),
            ("gate_up+silu*mul m=8", "gemv_fp8_swiglu"),
            ("gate_up+silu*mul m=1", "gemv_fp8_swiglu_stream"),
            ("gate_up+silu*mul m=1", "gemv_fp8_mma_swiglu"),
            ("gate_up+silu*mul m=8", "gemv_fp8_mma_swiglu"),
            (
                "add+rmsnorm+gate_up+silu*mul m=1",
                "gemv_fp8_swiglu_stream_norm",
            ),
        ] {
            let suffix = if function.contains("stream") {
                " (stream)"
            } else if function.contains("mma") {
                " (mma)"
            } else {
                ""
            };
            let label = format!("qwen3-8b fp8 {label} n=24576 k=4096{suffix}");
            assert_eq!(kernel(&label), Some(function), "{label}");
        }
        assert_eq!(
            kernel("qwen3-8b fp8 add+rmsnorm+qkv_proj m=1 n=6144 k=4096 (stream)"),
            Some("gemv_fp8_stream_norm")
        );
    }
}
