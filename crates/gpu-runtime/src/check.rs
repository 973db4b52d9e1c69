// SPDX-License-Identifier: MIT OR Apache-2.0
//! Kernel parity: every kernel, run on a backend under test and on a reference backend over the
//! same fresh random inputs, at several shapes, compared with a stated error metric.
//!
//! The metric, per output:
//! - bf16 outputs: every element within `2^-6 * |ref| + 1e-6` of the reference (two bf16 ulps: the
//!   device's `rsqrtf`/`__expf` can move a value across one bf16 rounding boundary, and a doubly
//!   rounded op can do it twice), and `||out - ref|| / ||ref||` at most 1e-2;
//! - f32 outputs (logits): every element within `1e-3 * |ref| + 1e-3`, rel-L2 at most 1e-2;
//! - integer outputs (token ids): exact.
//!
//! Shapes include the awkward ones: one row, widths that are not a multiple of the block size,
//! out-of-range token ids and positions.

use std::cell::LazyCell;
use std::rc::Rc;

use half::bf16;
use metrale_core::{DevicePtr, KernelArg, KernelName, LaunchConfig};
use metrale_kernels::ops::*;
use metrale_kernels::{HostError, HostMemory, Kernel, KernelAbi};

use crate::{GemmOp, GpuBackend, GpuError};

mod attention_variants;
mod fp8_gemm;
mod gated_delta;
mod gated_norm;
mod gemv_fp8;
mod kv_fp8;
mod mamba2;
mod moe;
mod moe_fp8;
mod moe_fused;
mod moe_relu2;
mod norm_offset;

/// Relative tolerance per bf16 element: two ulps of bf16's 8-bit mantissa.
pub const BF16_ELEMENT_RTOL: f32 = 1.0 / 64.0;
/// Relative tolerance per f32 element (sums accumulated in a different order).
pub const F32_ELEMENT_RTOL: f32 = 1e-3;
/// Absolute floor of the f32 element tolerance, for values near zero.
pub const F32_ELEMENT_ATOL: f32 = 1e-3;
/// Absolute floor of the bf16 element tolerance, as a fraction of the output's RMS: half a bf16
/// ulp at the output's typical magnitude. An element near cancellation (a K-long sum of terms of
/// that magnitude that nearly cancel) carries the absolute error of the sum, not a relative one,
/// so a purely relative bound would flag correct kernels whenever the summation order differs
/// (seen on the H200 with cuBLASLt at K = 4096: -1.5736e-4 against -1.6212e-4).
pub const BF16_ELEMENT_ATOL_OF_RMS: f32 = 1.0 / 512.0;
/// The absolute floor of the decode attention's f32 partials (each split's unnormalised output,
/// max and sum), as a fraction of their RMS. The kernel rounds each probability to f16 before
/// weighting a value (its P V product runs on tensor cores), which the exact host reference does
/// not: a partial's sum over a split's keys carries an error of about 2^-12 of the RMS (the
/// rounding errors of a random walk of terms), which near zero exceeds the default f32 floor.
pub const PAGED_ATTENTION_PARTIALS_ATOL_OF_RMS: f32 = 1.0 / 512.0;
/// Bound on the relative L2 error of a bf16 output.
pub const BF16_REL_L2: f32 = 1e-2;

/// A deterministic generator (SplitMix64), so a failing seed can be replayed.
///
/// Its state is a counter that each draw moves by [`Rng::GAMMA`] before mixing, so
/// [`skip`](Rng::skip) passes any number of draws at once.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    /// What each draw adds to the state.
    const GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;
    /// A generator from a seed.
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }
    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(Self::GAMMA);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [0, 1).
    pub fn uniform(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }
    /// Standard normal (Box-Muller).
    pub fn normal(&mut self) -> f32 {
        let u1 = self.uniform().max(1e-7);
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (std::f32::consts::TAU * u2).cos()
    }
    /// Uniform integer in [0, n).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }
    /// Passes `draws` draws of [`next_u64`](Rng::next_u64) in O(1): the state afterwards is the
    /// one those draws would have left.
    pub fn skip(&mut self, draws: u64) {
        self.0 = self.0.wrapping_add(draws.wrapping_mul(Self::GAMMA));
    }
}

/// How to read an output buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OutputKind {
    /// bf16 values, compared with the bf16 metric.
    Bf16,
    /// i32 values, compared exactly.
    I32,
    /// f32 values, compared with the f32 metric (relative 1e-3 per element, for reordered sums).
    F32,
    /// E4M3 bytes (an FP8 KV cache), compared code by code: equal, or one step apart for at
    /// most one element in a thousand.
    E4m3,
}

/// One buffer of a case: its initial bytes, and whether (and how) it is compared afterwards.
#[derive(Clone)]
struct Buffer {
    init: Init,
    output: Option<OutputKind>,
}

/// A buffer's initial bytes, made on first read and kept (clones share them).
///
/// Bulk random fills ([`bf16_normal`]) are the cost of building the cases (about 2.8 GB at
/// [`Rng::normal`]'s pace), and most callers want a few cases: a fill records where its draws
/// start and moves the generator past them without drawing, so a case dropped unread costs
/// nothing and every later draw is the one a full, eager build would make.
#[derive(Clone)]
struct Init(Rc<Lazy<Vec<u8>>>);

/// A value made on first read.
type Lazy<T> = LazyCell<T, Box<dyn FnOnce() -> T>>;

impl Init {
    fn new(make: impl FnOnce() -> Vec<u8> + 'static) -> Self {
        Init(Rc::new(LazyCell::new(Box::new(make))))
    }
    /// The bytes, drawn now if this is a fill not read before.
    fn bytes(&self) -> &[u8] {
        LazyCell::force(&*self.0).as_slice()
    }
}

impl From<Vec<u8>> for Init {
    fn from(bytes: Vec<u8>) -> Self {
        Init::new(move || bytes)
    }
}

/// `n` bf16 values of N(0, scale²), drawn from `rng` on first read: the generator moves past
/// their draws now (two a value, [`Rng::normal`]'s Box-Muller pair), so nothing drawn later may
/// depend on them.
fn bf16_normal(rng: &mut Rng, n: usize, scale: f32) -> Init {
    let mut from = rng.clone();
    rng.skip(2 * n as u64);
    Init::new(move || {
        let v: Vec<bf16> = (0..n)
            .map(|_| bf16::from_f32(from.normal() * scale))
            .collect();
        bytemuck::cast_slice(&v).to_vec()
    })
}

/// Little-endian bf16 bytes as f32 values.
fn bf16_values(bytes: &[u8]) -> Vec<f32> {
    bytemuck::pod_collect_to_vec::<u8, bf16>(bytes)
        .into_iter()
        .map(f32::from)
        .collect()
}

/// `0..n` in a random order (Fisher-Yates): shuffled cache blocks or slots.
fn shuffled(rng: &mut Rng, n: usize) -> Vec<i32> {
    let mut ids: Vec<i32> = (0..n as i32).collect();
    for i in (1..ids.len()).rev() {
        ids.swap(i, rng.below(i as u64 + 1) as usize);
    }
    ids
}

/// NeoX RoPE cos/sin tables `[max_position, head_dim / 2]` at base 1e6.
fn rope_tables(max_position: u32, head_dim: usize) -> (Vec<f32>, Vec<f32>) {
    let half = head_dim / 2;
    (0..max_position)
        .flat_map(|pos| {
            (0..half).map(move |i| {
                let angle = pos as f32 * 1e6f32.powf(-2.0 * i as f32 / head_dim as f32);
                (angle.cos(), angle.sin())
            })
        })
        .unzip()
}

/// A bf16 norm weight of `n` values around 1.
fn norm_weight(rng: &mut Rng, n: usize) -> Vec<u8> {
    let w: Vec<bf16> = (0..n)
        .map(|_| bf16::from_f32(1.0 + 0.5 * rng.normal()))
        .collect();
    bytemuck::cast_slice(&w).to_vec()
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    bytemuck::cast_slice(v).to_vec()
}

fn i32_bytes(v: &[i32]) -> Vec<u8> {
    bytemuck::cast_slice(v).to_vec()
}

type Build = Box<dyn Fn(&[DevicePtr]) -> (LaunchConfig, Vec<KernelArg>)>;

/// One kernel at one shape.
pub struct Case {
    kernel: KernelName,
    shape: String,
    buffers: Vec<Buffer>,
    build: Build,
    /// Run through [`GpuBackend::gemm`] (cuBLASLt on CUDA) instead of launching the kernel.
    gemm: Option<GemmBuild>,
    /// Extra absolute tolerance for each element of one output buffer, where the reference
    /// knows a correct kernel may differ by more than the metric's bound.
    allowance: Option<Allowance>,
}

/// Extra absolute tolerance per element of output buffer `buffer`: the prefill attention's
/// probabilities that may round to bf16 the other way
/// ([`metrale_kernels::ops::PrefillRow::allowance`]), the decode attention's f16 probabilities
/// and queries that may round the other way
/// ([`metrale_kernels::ops::PagedAttention::allowance`]). Worked out from the case's inputs by
/// the kernel's host model on first read, like the inputs themselves ([`Init`]).
struct Allowance {
    buffer: usize,
    extra: Lazy<Vec<f32>>,
}

impl Allowance {
    fn new(buffer: usize, extra: impl FnOnce() -> Vec<f32> + 'static) -> Self {
        Allowance {
            buffer,
            extra: LazyCell::new(Box::new(extra)),
        }
    }
    /// The extra tolerance per element, worked out now if not read before.
    fn extra(&self) -> &[f32] {
        LazyCell::force(&self.extra).as_slice()
    }
}

/// Runs `bound` on host memory holding `buffers`' initial contents, with the kernel arguments
/// `make` builds from their addresses: an allowance computed from a case's inputs by the
/// kernel's host model (which may write to that scratch copy, as the kernel would), or any other
/// value worked out so (a later launch's inputs made by an earlier launch's reference).
fn host_allowance<K, T>(
    buffers: &[Buffer],
    make: impl Fn(&[DevicePtr]) -> K,
    bound: impl FnOnce(&K, &mut crate::pool::HostPool) -> Result<T, HostError>,
) -> T {
    let mut pool = crate::pool::HostPool::new(u64::MAX);
    let ptrs: Vec<DevicePtr> = buffers
        .iter()
        .map(|b| {
            let init = b.init.bytes();
            let p = pool.alloc(init.len()).expect("unbounded host pool");
            pool.bytes_mut(p, init.len())
                .expect("just allocated")
                .copy_from_slice(init);
            p
        })
        .collect();
    bound(&make(&ptrs), &mut pool).expect("a check case the reference refuses")
}

/// Builds a library GEMM from the case's buffers.
type GemmBuild = Box<dyn Fn(&[DevicePtr]) -> GemmOp>;

fn launch_of<K: Kernel>(k: K) -> (LaunchConfig, Vec<KernelArg>) {
    (k.launch_config(), k.args())
}

/// The outcome of one case.
#[derive(Clone, Debug)]
pub struct CaseResult {
    /// The kernel.
    pub kernel: KernelName,
    /// A description of the shape.
    pub shape: String,
    /// Largest absolute difference over all bf16 outputs (0 for integer outputs that match).
    pub max_abs: f32,
    /// Largest relative L2 error over bf16 outputs.
    pub rel_l2: f32,
    /// Elements outside the element tolerance (bf16) or different (integers).
    pub mismatches: usize,
    /// Elements compared.
    pub elements: usize,
    /// Whether the case passes the metric.
    pub passed: bool,
    /// The first element outside tolerance: (buffer, index, got, want), for diagnosis.
    pub first_mismatch: Option<(usize, usize, f64, f64)>,
}

/// Which implementation a dense-product case runs.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Product {
    /// The GEMM kernel (`Gemm` or `GemmF32Out`).
    Kernel,
    /// [`GpuBackend::gemm`]: cuBLASLt on CUDA, the GEMM kernel elsewhere.
    Library,
    /// The decode GEMV (`Gemv` or `GemvF32Out`).
    Gemv,
}

/// `C = A · W^T (+ bias)` with buffers c, a (N(0, 1)), w (N(0, 1/k), unit-scale outputs), bias.
fn product_case(
    rng: &mut Rng,
    product: Product,
    m: u32,
    n: u32,
    k: u32,
    bias: bool,
    f32_out: bool,
) -> Case {
    let op = GemmOp {
        c: DevicePtr::NULL,
        a: DevicePtr::NULL,
        w: DevicePtr::NULL,
        bias: DevicePtr::NULL,
        m,
        n,
        k,
        f32_out,
        fp8: None,
    };
    let bind = move |p: &[DevicePtr]| GemmOp {
        c: p[0],
        a: p[1],
        w: p[2],
        bias: if bias { p[3] } else { DevicePtr::NULL },
        ..op
    };
    let kernel = match (product, f32_out) {
        (Product::Gemv, false) => Gemv::NAME,
        (Product::Gemv, true) => GemvF32Out::NAME,
        _ => op.kernel_name(),
    };
    let via = if product == Product::Library {
        " via GpuBackend::gemm"
    } else {
        ""
    };
    Case {
        kernel,
        gemm: (product == Product::Library).then(|| Box::new(bind) as GemmBuild),
        allowance: None,
        shape: format!("m={m} n={n} k={k} bias={bias}{via}"),
        buffers: vec![
            Buffer {
                init: vec![0; (m * n) as usize * if f32_out { 4 } else { 2 }].into(),
                output: Some(if f32_out {
                    OutputKind::F32
                } else {
                    OutputKind::Bf16
                }),
            },
            Buffer {
                init: bf16_normal(rng, (m * k) as usize, 1.0),
                output: None,
            },
            Buffer {
                init: bf16_normal(rng, (n * k) as usize, 1.0 / (k as f32).sqrt()),
                output: None,
            },
            Buffer {
                init: bf16_normal(rng, n as usize, 1.0),
                output: None,
            },
        ],
        build: Box::new(move |p| {
            let GemmOp {
                c,
                a,
                w,
                bias,
                m,
                n,
                k,
                ..
            } = bind(p);
            match (product, f32_out) {
                (Product::Gemv, false) => launch_of(Gemv {
                    c,
                    a,
                    w,
                    bias,
                    m,
                    n,
                    k,
                }),
                (Product::Gemv, true) => launch_of(GemvF32Out {
                    c,
                    a,
                    w,
                    bias,
                    m,
                    n,
                    k,
                }),
                _ => bind(p).kernel_launch(),
            }
        }),
    }
}

/// The GEMV over a fused gate|up weight with SwiGLU in its epilogue: Qwen3-8B and Qwen3-0.6B
/// shapes at 1 row (the FMA form) and 5 and 8 rows (the MMA form), an odd `inter`, and k = 130
/// (the scalar path).
fn gemv_swiglu_cases(rng: &mut Rng) -> Vec<Case> {
    [
        (1u32, 12288u32, 4096u32),
        (1, 3072, 1024),
        (5, 3072, 1024),
        (8, 3072, 1024),
        (3, 1001, 256),
        (2, 300, 130),
    ]
    .into_iter()
    .map(|(m, inter, k)| gemv_swiglu_case(rng, m, inter, k))
    .collect()
}

fn gemv_swiglu_case(rng: &mut Rng, m: u32, inter: u32, k: u32) -> Case {
    let n = 2 * inter;
    Case {
        kernel: GemvSwiglu::NAME,
        gemm: None,
        allowance: None,
        shape: format!("m={m} inter={inter} k={k}"),
        buffers: vec![
            Buffer {
                init: vec![0; (m * inter) as usize * 2].into(),
                output: Some(OutputKind::Bf16),
            },
            Buffer {
                init: bf16_normal(rng, (m * k) as usize, 1.0),
                output: None,
            },
            Buffer {
                init: bf16_normal(rng, (n * k) as usize, 2.0 / (k as f32).sqrt()),
                output: None,
            },
        ],
        build: Box::new(move |p| {
            launch_of(GemvSwiglu {
                out: p[0],
                a: p[1],
                w: p[2],
                m,
                inter,
                k,
            })
        }),
    }
}

/// The staged GEMV entries (first weights copied before the programmatic-launch wait) on
/// Qwen3-0.6B's batch-1 products (the shapes the model gives them), 2 to 4 rows, a bias, the
/// scalar path (k = 130), slices shorter than a batch (k = 520) and fewer columns than warps.
/// The same cases as [`Gemv`]'s and [`GemvSwiglu`]'s, launched through the staged entries.
fn gemv_staged_cases(rng: &mut Rng) -> Vec<Case> {
    let mut out = Vec::new();
    for &(m, n, k, bias) in &[
        (1u32, 4096u32, 1024u32, false),
        (1, 1024, 2048, false),
        (1, 1024, 3072, false),
        (4, 1024, 2048, true),
        (3, 1000, 130, true),
        (2, 777, 520, false),
        (1, 5, 4096, false),
    ] {
        let mut case = product_case(rng, Product::Gemv, m, n, k, bias, false);
        case.kernel = GemvStaged::NAME;
        case.build = Box::new(move |p| {
            launch_of(GemvStaged {
                c: p[0],
                a: p[1],
                w: p[2],
                bias: if bias { p[3] } else { DevicePtr::NULL },
                m,
                n,
                k,
            })
        });
        out.push(case);
    }
    for &(m, inter, k) in &[(1u32, 3072u32, 1024u32), (4, 1001, 256), (2, 300, 130)] {
        let mut case = gemv_swiglu_case(rng, m, inter, k);
        case.kernel = GemvSwigluStaged::NAME;
        case.build = Box::new(move |p| {
            launch_of(GemvSwigluStaged {
                out: p[0],
                a: p[1],
                w: p[2],
                m,
                inter,
                k,
            })
        });
        out.push(case);
    }
    out
}

/// The normalising GEMV entries (residual add + RMSNorm into the product): Qwen3-0.6B's and
/// Qwen3-8B's batch-1 qkv and gate|up products with and without the weight stage, 2 to 4 rows, a
/// bias, a null input (the residual copied), the scalar paths (k = 130), a norm row longer than
/// one pass (k = 8192), k a multiple of 4 but not 8 (vector norm, scalar product) and fewer
/// columns than warps. The residual is an output too: it must come back unchanged.
fn gemv_norm_cases(rng: &mut Rng) -> Vec<Case> {
    gemv_norm_cases_of(
        rng,
        &[
            (1u32, 4096u32, 1024u32, false, false, true, 1u32),
            (1, 6144, 4096, false, false, true, 0),
            (1, 6144, 4096, false, false, true, 1),
            (4, 1024, 2048, false, true, true, 1),
            (3, 1000, 130, false, true, true, 0),
            (2, 777, 520, false, false, false, 1),
            (1, 5, 4096, false, false, true, 1),
            (1, 1024, 8192, false, false, true, 0),
            (2, 64, 4100, false, false, true, 1),
            (1, 6144, 1024, true, false, true, 1),
            (1, 24576, 4096, true, false, true, 0),
            (4, 2002, 256, true, false, true, 1),
            (2, 600, 130, true, false, false, 0),
        ],
    )
}

/// One normalising GEMV case per `(m, n, k, swiglu, bias, input, stage)`; for the SwiGLU form n
/// counts gate and up rows.
fn gemv_norm_cases_of(
    rng: &mut Rng,
    shapes: &[(u32, u32, u32, bool, bool, bool, u32)],
) -> Vec<Case> {
    let mut out = Vec::new();
    for &(m, n, k, swiglu, bias, input, stage) in shapes {
        let rows = (m * k) as usize;
        let residual: Vec<f32> = (0..rows).map(|_| 2.0 * rng.normal()).collect();
        let out_elems = (m * if swiglu { n / 2 } else { n }) as usize;
        let kernel = if swiglu {
            GemvSwigluNorm::NAME
        } else {
            GemvNorm::NAME
        };
        out.push(Case {
            kernel,
            gemm: None,
            allowance: None,
            shape: format!("m={m} n={n} k={k} bias={bias} input={input} stage={stage}"),
            buffers: vec![
                Buffer {
                    init: vec![0; out_elems * 2].into(),
                    output: Some(OutputKind::Bf16),
                },
                Buffer {
                    init: f32_bytes(&residual).into(),
                    output: Some(OutputKind::F32),
                },
                Buffer {
                    init: vec![0xAB; rows * 4].into(),
                    output: Some(OutputKind::F32),
                },
                Buffer {
                    init: bf16_normal(rng, rows, 2.0),
                    output: None,
                },
                Buffer {
                    init: norm_weight(rng, k as usize).into(),
                    output: None,
                },
                Buffer {
                    init: bf16_normal(rng, (n * k) as usize, 1.0 / (k as f32).sqrt()),
                    output: None,
                },
                Buffer {
                    init: bf16_normal(rng, n as usize, 1.0),
                    output: None,
                },
            ],
            build: Box::new(move |p| {
                let input = if input { p[3] } else { DevicePtr::NULL };
                if swiglu {
                    launch_of(GemvSwigluNorm {
                        out: p[0],
                        residual: p[1],
                        residual_out: p[2],
                        input,
                        norm_weight: p[4],
                        w: p[5],
                        m,
                        inter: n / 2,
                        k,
                        eps: 1e-6,
                        stage,
                    })
                } else {
                    launch_of(GemvNorm {
                        c: p[0],
                        residual: p[1],
                        residual_out: p[2],
                        input,
                        norm_weight: p[4],
                        w: p[5],
                        bias: if bias { p[6] } else { DevicePtr::NULL },
                        m,
                        n,
                        k,
                        eps: 1e-6,
                        stage,
                    })
                }
            }),
        });
    }
    out
}

/// The fused qk-norm + RoPE + KV-cache write at Qwen3-8B (32/8 heads), Qwen3-0.6B (16/8) and
/// SmolLM2 (9/3, head_dim 64, no qk-norm) shapes, decode (1 token) and a prefill chunk (300),
/// plus head_dim 96 (the scalar path) and 256 (32 lanes per head). Positions are random in a
/// 4096-row table; token 2 is past the table (not rotated) and token 1 has a negative slot; the
/// other tokens write distinct, shuffled slots of a cache with spare rows (compared whole).
fn qkv_post_cases(rng: &mut Rng) -> Vec<Case> {
    let mut out = Vec::new();
    for &(tokens, q_heads, kv_heads, head_dim, norms) in &[
        (1u32, 32u32, 8u32, 128u32, true),
        (300, 32, 8, 128, true),
        (1, 16, 8, 128, true),
        (300, 16, 8, 128, true),
        (1, 9, 3, 64, false),
        (300, 9, 3, 64, false),
        (5, 4, 2, 96, true),
        (3, 8, 1, 256, false),
    ] {
        let max_position = 4096u32;
        let (t, d) = (tokens as usize, head_dim as usize);
        let heads = (q_heads + 2 * kv_heads) as usize;
        let kv_row = kv_heads as usize * d;
        let num_slots = 2 * t + 3;
        let mut positions: Vec<i32> = (0..t)
            .map(|_| 1 + rng.below(u64::from(max_position) - 1) as i32)
            .collect();
        let mut slots = shuffled(rng, num_slots);
        slots.truncate(t);
        if t > 2 {
            positions[2] = max_position as i32 + 3;
            slots[1] = -1;
        }
        let (cos, sin) = rope_tables(max_position, d);
        out.push(Case {
            kernel: QkvRopeKvWrite::NAME,
            gemm: None,
            allowance: None,
            shape: format!(
                "tokens={tokens} heads={q_heads}/{kv_heads} d={head_dim} qk_norm={norms}"
            ),
            buffers: vec![
                Buffer {
                    init: vec![0; t * q_heads as usize * d * 2].into(),
                    output: Some(OutputKind::Bf16),
                },
                Buffer {
                    init: bf16_normal(rng, num_slots * kv_row, 1.0),
                    output: Some(OutputKind::Bf16),
                },
                Buffer {
                    init: bf16_normal(rng, num_slots * kv_row, 1.0),
                    output: Some(OutputKind::Bf16),
                },
                Buffer {
                    init: bf16_normal(rng, t * heads * d, 2.0),
                    output: None,
                },
                Buffer {
                    init: norm_weight(rng, d).into(),
                    output: None,
                },
                Buffer {
                    init: norm_weight(rng, d).into(),
                    output: None,
                },
                Buffer {
                    init: i32_bytes(&positions).into(),
                    output: None,
                },
                Buffer {
                    init: i32_bytes(&slots).into(),
                    output: None,
                },
                Buffer {
                    init: f32_bytes(&cos).into(),
                    output: None,
                },
                Buffer {
                    init: f32_bytes(&sin).into(),
                    output: None,
                },
            ],
            build: Box::new(move |p| {
                let norm = |ptr: DevicePtr| if norms { ptr } else { DevicePtr::NULL };
                launch_of(QkvRopeKvWrite {
                    q_out: p[0],
                    k_cache: p[1],
                    v_cache: p[2],
                    qkv: p[3],
                    q_norm: norm(p[4]),
                    k_norm: norm(p[5]),
                    positions: p[6],
                    slots: p[7],
                    cos: p[8],
                    sin: p[9],
                    tokens,
                    q_heads,
                    kv_heads,
                    head_dim,
                    rotary_dim: head_dim,
                    max_position,
                    eps: 1e-6,
                    weight_offset: 0.0,
                })
            }),
        });
    }
    out
}

/// The decode attention with the QKV post-processing folded in: decode tokens of several
/// sequences (shuffled cache blocks), whole and split (the split holding the newest key patches
/// it into its tile), with and without qk-norm, GQA 1 to 8, head_dim 64 / 128 / 256, one token
/// whose slot is negative (nothing written; the attention reads the cache row as it is). The
/// caches are outputs: the newest rows must be written and nothing else touched.
fn paged_attention_qkv_cases(rng: &mut Rng) -> Vec<Case> {
    paged_attention_qkv_cases_of(
        rng,
        false,
        &[
            (1usize, 1024usize, 32u32, 8u32, 128u32, true, 64u32),
            (1, 1024, 16, 8, 128, true, 64),
            (3, 300, 32, 8, 128, true, 0),
            (3, 300, 32, 8, 128, true, 16),
            (2, 37, 9, 3, 64, false, 16),
            (2, 1500, 8, 1, 128, true, 128),
            (2, 21, 4, 4, 256, false, 8),
            (1, 1, 32, 8, 128, true, 0),
        ],
    )
}

/// The fused decode attention, narrow and wide, over a query group of 16 (Nemotron-3-Nano's 32
/// query heads over 2 kv heads: two blocks of 8 a kv head) and of 12 (GLM-4.5's 96 over 8: two
/// blocks of 6), one split and split.
fn wide_group_attention_cases(rng: &mut Rng) -> Vec<Case> {
    let shapes = [
        (1usize, 1024usize, 32u32, 2u32, 128u32, false, 64u32),
        (3, 300, 32, 2, 128, false, 0),
        (2, 700, 32, 2, 128, true, 128),
        (2, 500, 24, 2, 128, false, 128),
        (1, 90, 24, 2, 128, true, 0),
    ];
    let mut out = paged_attention_qkv_cases_of(rng, false, &shapes);
    out.extend(paged_attention_qkv_cases_of(rng, true, &shapes));
    out
}

/// Shapes of [`paged_attention_qkv_cases_of`]: sequences, context, query heads, kv heads, head
/// dim, qk-norm, keys per split (0: one split).
type AttentionQkvShape = (usize, usize, u32, u32, u32, bool, u32);

/// [`paged_attention_qkv_cases`] over `shapes`, through the wide form (8 warps a block,
/// [`PagedAttentionQkv::WIDE_NAME`]) where `wide`.
fn paged_attention_qkv_cases_of(
    rng: &mut Rng,
    wide: bool,
    shapes: &[AttentionQkvShape],
) -> Vec<Case> {
    let mut out = Vec::new();
    for &(seqs, context, q_heads, kv_heads, head_dim, norms, keys_per_split) in shapes {
        let block_size = 16u32;
        let max_position = 4096u32;
        let d = head_dim as usize;
        let max_blocks = context.div_ceil(block_size as usize);
        let num_blocks = seqs * max_blocks + 3;
        let ids = shuffled(rng, num_blocks);
        let tables: Vec<i32> = ids[..seqs * max_blocks].to_vec();
        // Sequence s's newest token sits at context - 1 - s (all within the tables).
        let token_seq: Vec<i32> = (0..seqs as i32).collect();
        let positions: Vec<i32> = (0..seqs)
            .map(|s| (context - 1 - s.min(context - 1)) as i32)
            .collect();
        let mut slots: Vec<i32> = (0..seqs)
            .map(|s| {
                let p = positions[s] as usize;
                tables[s * max_blocks + p / block_size as usize] * block_size as i32
                    + (p % block_size as usize) as i32
            })
            .collect();
        if seqs > 2 {
            slots[1] = -1;
        }
        let tokens = seqs as u32;
        let splits = if keys_per_split == 0 {
            1
        } else {
            (context as u32).div_ceil(keys_per_split)
        };
        let row = (kv_heads * head_dim) as usize;
        let heads = (q_heads + 2 * kv_heads) as usize;
        let q_len = seqs * (q_heads * head_dim) as usize;
        let partials = seqs * q_heads as usize * splits as usize * (d + 2);
        let (cos, sin) = rope_tables(max_position, d);
        let cache_len = num_blocks * block_size as usize * row;
        let scale = 1.0 / (head_dim as f32).sqrt();
        let buffer = |init: Init, output: Option<OutputKind>| Buffer { init, output };
        let make = move |p: &[DevicePtr]| {
            let norm = |ptr: DevicePtr| if norms { ptr } else { DevicePtr::NULL };
            PagedAttentionQkv {
                out: p[0],
                partials: p[1],
                counters: p[2],
                qkv: p[3],
                k_cache: p[4],
                v_cache: p[5],
                block_tables: p[6],
                token_seq: p[7],
                positions: p[8],
                slots: p[9],
                q_norm: norm(p[10]),
                k_norm: norm(p[11]),
                cos: p[12],
                sin: p[13],
                tokens,
                q_heads,
                kv_heads,
                head_dim,
                block_size,
                max_blocks_per_seq: max_blocks as u32,
                keys_per_split,
                splits,
                max_position,
                scale,
                eps: 1e-6,
            }
        };
        let buffers = vec![
            buffer(vec![0; q_len * 2].into(), Some(OutputKind::Bf16)),
            buffer(
                vec![0; partials * 4].into(),
                (splits > 1).then_some(OutputKind::F32),
            ),
            buffer(
                vec![0; seqs * paged_attention_groups(q_heads, kv_heads) as usize * 4].into(),
                Some(OutputKind::I32),
            ),
            buffer(bf16_normal(rng, seqs * heads * d, 2.0), None),
            buffer(bf16_normal(rng, cache_len, 1.0), Some(OutputKind::Bf16)),
            buffer(bf16_normal(rng, cache_len, 1.0), Some(OutputKind::Bf16)),
            buffer(i32_bytes(&tables).into(), None),
            buffer(i32_bytes(&token_seq).into(), None),
            buffer(i32_bytes(&positions).into(), None),
            buffer(i32_bytes(&slots).into(), None),
            buffer(norm_weight(rng, d).into(), None),
            buffer(norm_weight(rng, d).into(), None),
            buffer(f32_bytes(&cos).into(), None),
            buffer(f32_bytes(&sin).into(), None),
        ];
        // The f16 probabilities' and the bf16 queries' and newest keys' freedom in the partials,
        // or with one split in the output.
        let inputs = buffers.clone();
        let allowance = Some(Allowance::new(if splits > 1 { 1 } else { 0 }, move || {
            host_allowance(&inputs, make, |k, mem| k.allowance(mem))
        }));
        let (kernel, form) = PagedAttentionQkv::form(wide);
        out.push(Case {
            kernel,
            gemm: None,
            allowance,
            shape: format!(
                "seqs={seqs} ctx={context} heads={q_heads}/{kv_heads} d={head_dim} qk_norm={norms} splits={splits}{form}"
            ),
            buffers,
            build: Box::new(move |p| {
                let k = make(p);
                (k.launch_config_of(wide), k.args())
            }),
        });
    }
    out
}

/// Embedding cases over `shapes` (tokens, hidden, vocab; an id of -1 and one of `vocab` where
/// there are more than 2 tokens) through entry `kernel` (`embedding_f32` or `embedding_f32_vec`,
/// which take the same arguments and launch).
fn embedding_cases(rng: &mut Rng, kernel: KernelName, shapes: &[(u32, u32, u32)]) -> Vec<Case> {
    let mut out = Vec::new();
    for &(tokens, hidden, vocab) in shapes {
        let mut ids: Vec<i32> = (0..tokens)
            .map(|_| rng.below(vocab.into()) as i32)
            .collect();
        if tokens > 2 {
            ids[1] = -1;
            ids[2] = vocab as i32;
        }
        out.push(Case {
            kernel,
            gemm: None,
            allowance: None,
            shape: format!("tokens={tokens} hidden={hidden} vocab={vocab}"),
            buffers: vec![
                Buffer {
                    init: vec![0xAB; (tokens * hidden * 4) as usize].into(),
                    output: Some(OutputKind::F32),
                },
                Buffer {
                    init: bf16_normal(rng, (vocab * hidden) as usize, 1.0),
                    output: None,
                },
                Buffer {
                    init: i32_bytes(&ids).into(),
                    output: None,
                },
            ],
            build: Box::new(move |p| {
                launch_of(Embedding {
                    out: p[0],
                    table: p[1],
                    ids: p[2],
                    tokens,
                    hidden,
                    vocab,
                })
            }),
        });
    }
    out
}

/// Every case, with inputs drawn from `seed`. Bulk inputs are drawn when a case is first run
/// (see `Init`), so picking a few cases out of the list costs little more than building them.
pub fn cases(seed: u64) -> Vec<Case> {
    let mut rng = Rng::new(seed);
    let mut out = Vec::new();

    out.extend(embedding_cases(
        &mut rng,
        Embedding::NAME,
        &[(1, 576, 1000), (37, 4096, 5000), (5, 1000, 77)],
    ));

    for &(rows, cols) in &[(1u32, 576u32), (7, 4096), (129, 1000), (3, 5120), (2, 33)] {
        let n = (rows * cols) as usize;
        out.push(Case {
            kernel: RmsNorm::NAME,
            gemm: None,
            allowance: None,
            shape: format!("rows={rows} cols={cols}"),
            buffers: vec![
                Buffer {
                    init: vec![0; n * 2].into(),
                    output: Some(OutputKind::Bf16),
                },
                Buffer {
                    init: bf16_normal(&mut rng, n, 3.0),
                    output: None,
                },
                Buffer {
                    init: bf16_normal(&mut rng, cols as usize, 1.0),
                    output: None,
                },
            ],
            build: Box::new(move |p| {
                launch_of(RmsNorm {
                    out: p[0],
                    input: p[1],
                    weight: p[2],
                    rows,
                    cols,
                    eps: 1e-6,
                })
            }),
        });
        for with_input in [true, false] {
            let residual: Vec<f32> = (0..n).map(|_| 2.0 * rng.normal()).collect();
            out.push(Case {
                kernel: AddRmsNorm::NAME,
                gemm: None,
                allowance: None,
                shape: format!("rows={rows} cols={cols} input={with_input}"),
                buffers: vec![
                    Buffer {
                        init: vec![0; n * 2].into(),
                        output: Some(OutputKind::Bf16),
                    },
                    Buffer {
                        init: f32_bytes(&residual).into(),
                        output: Some(OutputKind::F32),
                    },
                    Buffer {
                        init: bf16_normal(&mut rng, n, 2.0),
                        output: None,
                    },
                    Buffer {
                        init: bf16_normal(&mut rng, cols as usize, 1.0),
                        output: None,
                    },
                ],
                build: Box::new(move |p| {
                    launch_of(AddRmsNorm {
                        out: p[0],
                        residual: p[1],
                        input: if with_input { p[2] } else { DevicePtr::NULL },
                        weight: p[3],
                        rows,
                        cols,
                        eps: 1e-5,
                        weight_offset: 0.0,
                    })
                }),
            });
        }
    }

    // (tokens, heads rotated, head_dim, row stride, offset of the rotated part in the row)
    for &(tokens, heads, head_dim, stride, offset) in &[
        (1u32, 32u32, 128u32, 6144u32, 0u32),
        (13, 3, 64, 960, 576),
        (4, 8, 256, 2048, 0),
    ] {
        let max_position = 512u32;
        let half = (head_dim / 2) as usize;
        let mut positions: Vec<i32> = (0..tokens)
            .map(|_| rng.below(max_position.into()) as i32)
            .collect();
        if tokens > 2 {
            positions[2] = max_position as i32 + 5;
        }
        let (mut cos, mut sin) = (Vec::new(), Vec::new());
        for pos in 0..max_position {
            for i in 0..half {
                let angle = pos as f32 * 10000f32.powf(-2.0 * i as f32 / head_dim as f32);
                cos.push(angle.cos());
                sin.push(angle.sin());
            }
        }
        out.push(Case {
            kernel: RopeNeox::NAME,
            gemm: None,
            allowance: None,
            shape: format!(
                "tokens={tokens} heads={heads} head_dim={head_dim} stride={stride} offset={offset}"
            ),
            buffers: vec![
                Buffer {
                    init: bf16_normal(&mut rng, (tokens * stride) as usize, 1.0),
                    output: Some(OutputKind::Bf16),
                },
                Buffer {
                    init: i32_bytes(&positions).into(),
                    output: None,
                },
                Buffer {
                    init: f32_bytes(&cos).into(),
                    output: None,
                },
                Buffer {
                    init: f32_bytes(&sin).into(),
                    output: None,
                },
            ],
            build: Box::new(move |p| {
                launch_of(RopeNeox {
                    x: p[0].offset(offset as usize * 2),
                    positions: p[1],
                    cos: p[2],
                    sin: p[3],
                    tokens,
                    heads,
                    head_dim,
                    token_stride: stride,
                    max_position,
                })
            }),
        });
    }

    for &(tokens, inter) in &[(1u32, 1536u32), (17, 12288), (5, 1000)] {
        out.push(Case {
            kernel: SiluMul::NAME,
            gemm: None,
            allowance: None,
            shape: format!("tokens={tokens} inter={inter}"),
            buffers: vec![
                Buffer {
                    init: vec![0; (tokens * inter * 2) as usize].into(),
                    output: Some(OutputKind::Bf16),
                },
                Buffer {
                    init: bf16_normal(&mut rng, (tokens * inter * 2) as usize, 2.0),
                    output: None,
                },
            ],
            build: Box::new(move |p| {
                launch_of(SiluMul {
                    out: p[0],
                    gate_up: p[1],
                    tokens,
                    inter,
                })
            }),
        });
    }

    for &n in &[1u32, 1000, 4096 * 7 + 3] {
        out.push(Case {
            kernel: Add::NAME,
            gemm: None,
            allowance: None,
            shape: format!("n={n}"),
            buffers: vec![
                Buffer {
                    init: vec![0; n as usize * 2].into(),
                    output: Some(OutputKind::Bf16),
                },
                Buffer {
                    init: bf16_normal(&mut rng, n as usize, 4.0),
                    output: None,
                },
                Buffer {
                    init: bf16_normal(&mut rng, n as usize, 1.0),
                    output: None,
                },
            ],
            build: Box::new(move |p| {
                launch_of(Add {
                    out: p[0],
                    a: p[1],
                    b: p[2],
                    n,
                })
            }),
        });
    }

    // Dense products. GEMM kernel: decode (m = 1), awkward (nothing a multiple of the tile),
    // prefill-like, and with bias; the same through GpuBackend::gemm (cuBLASLt on CUDA); the GEMV
    // at decode shapes (m = 1..8), an odd k (scalar path), and bias; the f32-output forms.
    for &(m, n, k, bias) in &[
        (1u32, 576u32, 576u32, false),
        (1, 4096, 4096, false),
        (7, 1000, 100, true),
        (130, 1536, 576, false),
        (64, 2048, 1000, true),
    ] {
        out.push(product_case(
            &mut rng,
            Product::Kernel,
            m,
            n,
            k,
            bias,
            false,
        ));
    }
    for &(m, n, k, bias, f32_out) in &[
        (64u32, 2048u32, 1000u32, true, false),
        (300, 4096, 4096, false, false),
        (9, 6144, 1024, true, false),
        (17, 4099, 1024, false, true),
    ] {
        out.push(product_case(
            &mut rng,
            Product::Library,
            m,
            n,
            k,
            bias,
            f32_out,
        ));
    }
    for &(m, n, k, bias) in &[
        (1u32, 4096u32, 4096u32, false),
        (1, 49152, 576, false),
        (8, 1536, 576, true),
        (3, 1000, 130, false),
        (2, 77, 12288, true),
        // K split across 2 warps per column (Qwen3-8B k/v at m = 1); m = 4, the last FMA row
        // count; the MMA form (m > 4) split 8 ways, on a ragged n with a short K slice and bias,
        // and on an odd k (its scalar fallback).
        (1, 1024, 4096, false),
        (4, 1024, 4096, true),
        (8, 1024, 4096, false),
        (5, 77, 576, true),
        (6, 100, 130, false),
    ] {
        out.push(product_case(&mut rng, Product::Gemv, m, n, k, bias, false));
    }
    for &(m, n, k) in &[(1u32, 49152u32, 576u32), (3, 1000, 130), (17, 4099, 1024)] {
        out.push(product_case(
            &mut rng,
            Product::Kernel,
            m,
            n,
            k,
            false,
            true,
        ));
    }
    for &(m, n, k) in &[
        (1u32, 151936u32, 1024u32),
        (8, 49152, 576),
        (3, 1000, 130),
        (7, 4099, 1024),
    ] {
        out.push(product_case(&mut rng, Product::Gemv, m, n, k, false, true));
    }

    // Paged attention: decode of two sequences with shuffled blocks, a causal prefill, GQA ratios,
    // head_dim 64 / 128 / 256, a context that ends mid-block and a long one (1500 keys: each
    // warp's ring of key tiles wraps many times).
    for &(seqs, new_tokens, context, q_heads, kv_heads, head_dim) in &[
        (2usize, 1usize, 37usize, 9u32, 3u32, 64u32),
        (1, 70, 70, 32, 8, 128),
        (3, 1, 300, 16, 16, 128),
        (1, 5, 21, 4, 1, 256),
        (2, 1, 1500, 32, 8, 128),
    ] {
        let block_size = 16u32;
        let max_blocks = context.div_ceil(block_size as usize);
        let num_blocks = seqs * max_blocks + 3;
        // A random permutation of block ids, so tables are not in order.
        let ids = shuffled(&mut rng, num_blocks);
        let tables: Vec<i32> = ids[..seqs * max_blocks].to_vec();
        let (mut token_seq, mut positions) = (Vec::new(), Vec::new());
        for s in 0..seqs {
            for t in 0..new_tokens {
                token_seq.push(s as i32);
                positions.push((context - new_tokens + t) as i32);
            }
        }
        let tokens = token_seq.len() as u32;
        let row = (kv_heads * head_dim) as usize;
        let q_len = tokens as usize * (q_heads * head_dim) as usize;
        let scale = 1.0 / (head_dim as f32).sqrt();
        let q = bf16_normal(&mut rng, q_len, 1.0);
        let k_cache = bf16_normal(&mut rng, num_blocks * block_size as usize * row, 1.0);
        let v_cache = bf16_normal(&mut rng, num_blocks * block_size as usize * row, 1.0);
        // Once whole, once split in 16-key pieces (one key tile), once in 100-key pieces (tiles
        // that straddle splits), once with 3 splits more than the context fills (as a bucketed
        // launch shape carries): the output compared each time; split, also the partials, and
        // the per-(token, kv head) counters, which must be back at zero.
        for (keys_per_split, surplus) in [(0u32, 0u32), (16, 0), (100, 0), (100, 3)] {
            let splits = if keys_per_split == 0 {
                1
            } else {
                (context as u32).div_ceil(keys_per_split) + surplus
            };
            if keys_per_split > 0 && splits == 1 {
                continue;
            }
            let partials =
                tokens as usize * q_heads as usize * splits as usize * (head_dim as usize + 2);
            let make = move |p: &[DevicePtr]| PagedAttention {
                out: p[0],
                partials: p[1],
                counters: p[2],
                q: p[3],
                k_cache: p[4],
                v_cache: p[5],
                block_tables: p[6],
                token_seq: p[7],
                positions: p[8],
                tokens,
                q_heads,
                kv_heads,
                head_dim,
                block_size,
                max_blocks_per_seq: max_blocks as u32,
                keys_per_split,
                splits,
                scale,
            };
            let buffers = vec![
                Buffer {
                    init: vec![0; q_len * 2].into(),
                    output: Some(OutputKind::Bf16),
                },
                Buffer {
                    init: vec![0; partials * 4].into(),
                    output: (splits > 1).then_some(OutputKind::F32),
                },
                Buffer {
                    init: vec![
                        0;
                        (tokens * paged_attention_groups(q_heads, kv_heads)) as usize * 4
                    ]
                    .into(),
                    output: Some(OutputKind::I32),
                },
                Buffer {
                    init: q.clone(),
                    output: None,
                },
                Buffer {
                    init: k_cache.clone(),
                    output: None,
                },
                Buffer {
                    init: v_cache.clone(),
                    output: None,
                },
                Buffer {
                    init: i32_bytes(&tables).into(),
                    output: None,
                },
                Buffer {
                    init: i32_bytes(&token_seq).into(),
                    output: None,
                },
                Buffer {
                    init: i32_bytes(&positions).into(),
                    output: None,
                },
            ];
            // The f16 probabilities' freedom in the partials (the queries are an input).
            let inputs = buffers.clone();
            let allowance = (splits > 1).then(|| {
                Allowance::new(1, move || {
                    let q = bf16_values(inputs[3].init.bytes());
                    host_allowance(&inputs, make, |k, mem| {
                        k.allowance(&q, &vec![0.0; q.len()], &[], mem)
                    })
                })
            });
            out.push(Case {
                kernel: PagedAttention::NAME,
                gemm: None,
                allowance,
                shape: format!(
                    "seqs={seqs} tokens={tokens} ctx={context} heads={q_heads}/{kv_heads} d={head_dim} splits={splits}"
                ),
                buffers,
                build: Box::new(move |p| launch_of(make(p))),
            });
        }
    }
    out.extend(paged_attention_qkv_cases(&mut rng));
    out.extend(gemv_swiglu_cases(&mut rng));
    // Tensor-core prefill attention over query tiles, versions 1, 2 and 3 (3 at head_dim 128 only):
    // one whole tile, 200 tokens (the last tile of 8), a second chunk starting at position 100, two
    // sequences plus a decode token in one launch, 300 tokens (version 2's last tile of 44), 600
    // tokens, a chunk at 300 with a 5-token tile at 1000 over blocks of 24; GQA 1 and 4, head_dim
    // 64 and 128; cache blocks shuffled. The output has 64 spare
    // rows past the last token, which the kernel must leave at zero (zero, not noise, so that the
    // metric's absolute floor stays a fraction of the attention output's RMS).
    // The last two reach version 3's ring reuse (5 key tiles of 128), a chunk after earlier full
    // key tiles at head_dim 128, and a block size that is not a power of two.
    for &(ref runs, q_heads, kv_heads, head_dim, block_size) in &[
        (vec![(0usize, 64usize)], 8u32, 8u32, 128u32, 16u32),
        (vec![(0, 200)], 16, 4, 128, 16),
        (vec![(100, 150)], 16, 4, 64, 16),
        (vec![(0, 70), (37, 30), (300, 1)], 8, 2, 64, 16),
        (vec![(0, 70), (37, 30), (300, 1)], 4, 4, 128, 16),
        (vec![(0, 300)], 8, 2, 128, 16),
        (vec![(0, 600)], 8, 2, 128, 16),
        (vec![(300, 200), (1000, 5)], 8, 2, 128, 24),
    ] {
        let seqs = runs.len();
        let max_blocks = runs
            .iter()
            .map(|&(first, n)| (first + n).div_ceil(block_size as usize))
            .max()
            .unwrap_or(0);
        let num_blocks = seqs * max_blocks + 3;
        let ids = shuffled(&mut rng, num_blocks);
        let tables: Vec<i32> = ids[..seqs * max_blocks].to_vec();
        let (mut token_seq, mut positions) = (Vec::new(), Vec::new());
        for (s, &(first, n)) in runs.iter().enumerate() {
            for p in first..first + n {
                token_seq.push(s as i32);
                positions.push(p as i32);
            }
        }
        let tokens = token_seq.len();
        let row = (kv_heads * head_dim) as usize;
        let width = (q_heads * head_dim) as usize;
        let cache = num_blocks * block_size as usize * row;
        let (q, k_cache, v_cache) = (
            bf16_normal(&mut rng, tokens * width, 1.0),
            bf16_normal(&mut rng, cache, 1.0),
            bf16_normal(&mut rng, cache, 1.0),
        );
        // Version 1 on its tiles of 64; version 2 on its tiles of 128 and, where that cuts the
        // step differently, on tiles of 64 (each warp's second m-tile idle); version 3 likewise.
        let v1_tiles = prefill_attention_tiles(&token_seq, &positions);
        let v2_tiles =
            prefill_attention_tiles_of(&token_seq, &positions, PrefillAttentionV2::TILE_TOKENS);
        // Version 3 (head_dim 128) on the same two cuts.
        let mut variants = vec![(PrefillAttention::NAME, v1_tiles.clone())];
        if v2_tiles != v1_tiles {
            variants.push((PrefillAttentionV2::NAME, v2_tiles.clone()));
        }
        variants.push((PrefillAttentionV2::NAME, v1_tiles.clone()));
        if PrefillAttentionV3::supports_head_dim(head_dim) {
            if v2_tiles != v1_tiles {
                variants.push((PrefillAttentionV3::NAME, v2_tiles));
            }
            variants.push((PrefillAttentionV3::NAME, v1_tiles));
        }
        let scale = 1.0 / (head_dim as f32).sqrt();
        for (kernel, tiles) in variants {
            let num_tiles = tiles.len() as u32;
            let max = tiles.iter().map(|t| t[3]).max().unwrap_or(0);
            let args = PrefillAttention {
                out: DevicePtr::NULL,
                q: DevicePtr::NULL,
                k_cache: DevicePtr::NULL,
                v_cache: DevicePtr::NULL,
                block_tables: DevicePtr::NULL,
                tiles: DevicePtr::NULL,
                num_tiles,
                q_heads,
                kv_heads,
                head_dim,
                block_size,
                max_blocks_per_seq: max_blocks as u32,
                scale,
            };
            let key_tile = if kernel == PrefillAttentionV2::NAME {
                PrefillAttentionV2::KEY_TILE
            } else if kernel == PrefillAttentionV3::NAME {
                PrefillAttentionV3::KEY_TILE
            } else {
                PrefillAttention::KEY_TILE
            };
            let shape = format!(
                "runs={runs:?} tiles={num_tiles} (<={max} tokens) heads={q_heads}/{kv_heads} \
                 d={head_dim}"
            );
            let buffers = vec![
                Buffer {
                    init: vec![0; (tokens + 64) * width * 2].into(),
                    output: Some(OutputKind::Bf16),
                },
                Buffer {
                    init: q.clone(),
                    output: None,
                },
                Buffer {
                    init: k_cache.clone(),
                    output: None,
                },
                Buffer {
                    init: v_cache.clone(),
                    output: None,
                },
                Buffer {
                    init: i32_bytes(&tables).into(),
                    output: None,
                },
                Buffer {
                    init: i32_bytes(&tiles.concat()).into(),
                    output: None,
                },
            ];
            let (inputs, tables) = (buffers.clone(), tables.clone());
            let allowance = Allowance::new(0, move || {
                let q = bf16_values(inputs[1].init.bytes());
                let (k_cache, v_cache): (Vec<bf16>, Vec<bf16>) = (
                    bytemuck::pod_collect_to_vec(inputs[2].init.bytes()),
                    bytemuck::pod_collect_to_vec(inputs[3].init.bytes()),
                );
                let mut extra = vec![0f32; (tokens + 64) * width];
                for row in
                    prefill_attention_rows(&args, key_tile, &tiles, &q, &tables, &k_cache, &v_cache)
                {
                    extra[row.token * width..][..width].copy_from_slice(&row.allowance);
                }
                extra
            });
            out.push(Case {
                kernel,
                gemm: None,
                allowance: Some(allowance),
                shape,
                buffers,
                build: Box::new(move |p| {
                    let v1 = PrefillAttention {
                        out: p[0],
                        q: p[1],
                        k_cache: p[2],
                        v_cache: p[3],
                        block_tables: p[4],
                        tiles: p[5],
                        ..args
                    };
                    if kernel == PrefillAttention::NAME {
                        return launch_of(v1);
                    }
                    if kernel == PrefillAttentionV3::NAME {
                        return launch_of(PrefillAttentionV3::from(v1));
                    }
                    launch_of(PrefillAttentionV2::from(v1))
                }),
            });
        }
    }
    // Merging split partials, some splits empty (l = 0).
    for &(tokens, q_heads, head_dim, splits) in &[(1u32, 32u32, 128u32, 8u32), (5, 9, 64, 3)] {
        let d = head_dim as usize;
        let mut parts = Vec::new();
        for _ in 0..tokens * q_heads * splits {
            let empty = rng.below(4) == 0;
            for _ in 0..d {
                parts.push(if empty { 0.0 } else { 3.0 * rng.normal() });
            }
            parts.push(if empty { 0.0 } else { 2.0 * rng.normal() });
            parts.push(if empty {
                0.0
            } else {
                1.0 + 10.0 * rng.uniform()
            });
        }
        out.push(Case {
            kernel: AttentionCombine::NAME,
            gemm: None,
            allowance: None,
            shape: format!("tokens={tokens} heads={q_heads} d={head_dim} splits={splits}"),
            buffers: vec![
                Buffer {
                    init: vec![0; (tokens * q_heads * head_dim * 2) as usize].into(),
                    output: Some(OutputKind::Bf16),
                },
                Buffer {
                    init: f32_bytes(&parts).into(),
                    output: None,
                },
            ],
            build: Box::new(move |p| {
                launch_of(AttentionCombine {
                    out: p[0],
                    partials: p[1],
                    tokens,
                    q_heads,
                    head_dim,
                    splits,
                })
            }),
        });
    }
    for &(tokens, row) in &[(1u32, 192u32), (37, 1024)] {
        let slots: Vec<i32> = (0..tokens)
            .map(|t| if t == 1 { -1 } else { (t * 3 + 1) as i32 })
            .collect();
        let cache = (tokens as usize * 3 + 2) * row as usize;
        out.push(Case {
            kernel: KvCacheWrite::NAME,
            gemm: None,
            allowance: None,
            shape: format!("tokens={tokens} row={row}"),
            buffers: vec![
                Buffer {
                    init: bf16_normal(&mut rng, cache, 1.0),
                    output: Some(OutputKind::Bf16),
                },
                Buffer {
                    init: bf16_normal(&mut rng, cache, 1.0),
                    output: Some(OutputKind::Bf16),
                },
                Buffer {
                    init: bf16_normal(&mut rng, (tokens * row) as usize, 1.0),
                    output: None,
                },
                Buffer {
                    init: bf16_normal(&mut rng, (tokens * row) as usize, 1.0),
                    output: None,
                },
                Buffer {
                    init: i32_bytes(&slots).into(),
                    output: None,
                },
            ],
            build: Box::new(move |p| {
                launch_of(KvCacheWrite {
                    k_cache: p[0],
                    v_cache: p[1],
                    k: p[2],
                    v: p[3],
                    slots: p[4],
                    tokens,
                    row,
                })
            }),
        });
    }

    out.extend(qkv_post_cases(&mut rng));

    // Rows read by vector loads (lengths a multiple of 8) and one value at a time (1001), and
    // planted ties and NaN: a row of equal values (the first wins), NaN everywhere but two equal
    // maxima at 777 and 3000 (777 wins), all NaN (0).
    let mut planted = vec![1.5f32; 4096];
    planted.extend((0..4096).map(|i| if i == 777 || i == 3000 { 2.0 } else { f32::NAN }));
    planted.extend(vec![f32::NAN; 4096]);
    // Rows split over several blocks (4096 f32 or 8192 bf16 values each), with the planted values
    // in different blocks: equal maxima at 5000 and 20000 (5000 wins), -0 at 9000 against +0 at
    // 20000 in a row of -1 (equal: 9000 wins), and one value in a row of NaN.
    let mut across = (0..30000).map(|_| rng.normal()).collect::<Vec<f32>>();
    across[5000] = 50.0;
    across[20000] = 50.0;
    let mut zeros = vec![-1.0f32; 30000];
    zeros[9000] = -0.0;
    zeros[20000] = 0.0;
    across.extend(zeros);
    across.extend((0..30000).map(|i| if i == 25000 { 3.0 } else { f32::NAN }));
    let argmax_inputs: Vec<(u32, u32, Vec<f32>)> =
        [(1u32, 49152u32), (4, 151936), (3, 1000), (2, 1001)]
            .into_iter()
            .map(|(rows, cols)| {
                let logits = (0..rows * cols).map(|_| rng.normal() * 4.0).collect();
                (rows, cols, logits)
            })
            .chain([(3, 4096, planted), (3, 30000, across)])
            .collect();
    for (rows, cols, logits) in argmax_inputs {
        let bf16_logits: Vec<u8> = logits
            .iter()
            .flat_map(|&x| bf16::from_f32(x).to_le_bytes())
            .collect();
        out.push(Case {
            kernel: ArgmaxBf16::NAME,
            gemm: None,
            allowance: None,
            shape: format!("rows={rows} cols={cols}"),
            buffers: vec![
                Buffer {
                    init: vec![0xFF; rows as usize * 4].into(),
                    output: Some(OutputKind::I32),
                },
                Buffer {
                    init: bf16_logits.into(),
                    output: None,
                },
                // Zero before, and compared as zero after: the last block of each row clears it.
                Buffer {
                    init: vec![0; argmax_scratch_bytes(rows as usize)].into(),
                    output: Some(OutputKind::I32),
                },
            ],
            build: Box::new(move |p| {
                launch_of(ArgmaxBf16 {
                    out: p[0],
                    logits: p[1],
                    rows,
                    cols,
                    scratch: p[2],
                })
            }),
        });
        out.push(Case {
            kernel: ArgmaxF32::NAME,
            gemm: None,
            allowance: None,
            shape: format!("rows={rows} cols={cols}"),
            buffers: vec![
                Buffer {
                    init: vec![0xFF; rows as usize * 4].into(),
                    output: Some(OutputKind::I32),
                },
                Buffer {
                    init: f32_bytes(&logits).into(),
                    output: None,
                },
                Buffer {
                    init: vec![0; argmax_scratch_bytes(rows as usize)].into(),
                    output: Some(OutputKind::I32),
                },
            ],
            build: Box::new(move |p| {
                launch_of(ArgmaxF32 {
                    out: p[0],
                    logits: p[1],
                    rows,
                    cols,
                    scratch: p[2],
                })
            }),
        });
    }
    // Last, so that the earlier cases keep their inputs at a given seed.
    out.extend(gemv_staged_cases(&mut rng));
    out.extend(gemv_norm_cases(&mut rng));
    out.extend(gemv_grid_cases(&mut rng));
    out.push(grid_barrier_case(4, 7));
    out.push(grid_barrier_case(1, 3));
    // Fewer rows than blaslt::HEURISTIC_ROWS through GpuBackend::gemm: the algorithm picked for 16
    // rows on 8 and 5 (Qwen3-8B's down projection at batch 8, split over K on the H200; a bias at
    // 5 rows).
    for &(m, n, k, bias) in &[(8u32, 4096u32, 12288u32, false), (5, 6144, 4096, true)] {
        out.push(product_case(
            &mut rng,
            Product::Library,
            m,
            n,
            k,
            bias,
            false,
        ));
    }
    // Rows of at most 1024 elements at 8 columns a block take two columns a warp (gemv_pairs):
    // Qwen3-0.6B's LM head's k with a ragged last round (f32 out), and a bf16 one with a bias.
    let lm_head = product_case(&mut rng, Product::Gemv, 1, 10007, 1024, false, true);
    out.push(on_grid(lm_head, GEMV_RESIDENT_BLOCKS));
    let short = product_case(&mut rng, Product::Gemv, 1, 777, 512, true, false);
    out.push(on_grid(short, 13));
    // The normalising entries' pair form (one row, k <= 1024, 8 columns a block): a ragged last
    // round with a bias, SwiGLU pairs of a ragged round with no input, unstaged, and blocks that
    // loop over several rounds (the first one staged, the others loaded).
    out.extend(gemv_norm_cases_of(
        &mut rng,
        &[
            (1, 1000, 1024, false, true, true, 1),
            (1, 1030, 520, true, false, false, 1),
            (1, 777, 512, false, false, true, 0),
            (1, 16000, 512, false, true, true, 1),
            (1, 16000, 256, true, false, true, 1),
        ],
    ));
    // The fused decode attention's wide form (8 warps a block): the model's batch-1 shapes
    // (Qwen3-8B's and -0.6B's groups at 160 and 256 keys, one split; a context of one key),
    // contexts that leave some warps without a tile or end mid-tile, a negative slot, head_dim
    // 64, and split launches (the form takes any; the model sends it one split).
    out.extend(paged_attention_qkv_cases_of(
        &mut rng,
        true,
        &[
            (1, 160, 32, 8, 128, true, 0),
            (1, 256, 16, 8, 128, true, 0),
            (1, 1, 32, 8, 128, true, 0),
            (2, 77, 16, 8, 128, true, 0),
            (3, 300, 32, 8, 128, true, 0),
            (2, 37, 9, 3, 64, false, 0),
            (1, 1024, 32, 8, 128, true, 64),
            (2, 1500, 8, 1, 128, true, 128),
            (3, 300, 32, 8, 128, true, 16),
        ],
    ));
    // The embedding's 16-byte form: Qwen3-8B's row, ids out of range, a row not of whole 16-byte
    // pieces (its scalar loop), and more pieces than one round of the block's loads.
    out.extend(embedding_cases(
        &mut rng,
        Embedding::VEC_NAME,
        &[(1, 4096, 3000), (5, 1000, 77), (3, 1001, 50), (2, 9000, 20)],
    ));
    out.extend(gemv_stream_cases(&mut rng));
    // Last, so that every case before keeps its random inputs (tests pin some of them by seed).
    out.extend(moe::moe_cases(&mut rng));
    // After the MoE cases, for the same reason.
    out.extend(attention_variants::attention_variant_cases(&mut rng));
    // After those, for the same reason.
    out.extend(moe::grouped_mma_cases(&mut rng));
    // The FP8-weight products, after every other case for the same reason.
    out.extend(gemv_fp8::gemv_fp8_cases(&mut rng));
    // The Gated DeltaNet kernels, after every other case for the same reason.
    out.extend(gated_delta::gated_delta_cases(&mut rng));
    // The Gated DeltaNet gating, after every other case for the same reason.
    out.extend(gated_delta::gating_cases(&mut rng));
    // The gated RMSNorm and the sigmoid output gate, after every other case for the same reason.
    out.extend(gated_norm::gated_norm_cases(&mut rng));
    // The norms with a weight offset (Qwen3-Next's), after every other case for the same reason.
    out.extend(norm_offset::norm_offset_cases(&mut rng));
    // The Mamba-2 recurrence, after every other case for the same reason.
    out.extend(mamba2::mamba2_cases(&mut rng));
    // Nemotron-H's squared ReLU, after every other case for the same reason.
    for &n in &[1u32, 21504, 4096 * 7 + 3] {
        out.push(Case {
            kernel: Relu2::NAME,
            gemm: None,
            allowance: None,
            shape: format!("n={n}"),
            buffers: vec![
                Buffer {
                    init: vec![0; n as usize * 2].into(),
                    output: Some(OutputKind::Bf16),
                },
                Buffer {
                    init: bf16_normal(&mut rng, n as usize, 2.0),
                    output: None,
                },
            ],
            build: Box::new(move |p| {
                launch_of(Relu2 {
                    out: p[0],
                    x: p[1],
                    n,
                })
            }),
        });
    }
    // Mamba-2's gated norm over the recurrence's f32 output, after every other case for the same
    // reason.
    out.extend(gated_norm::gated_norm_f32_input_cases(&mut rng));
    // Mamba-2's chunked prefill, after every other case for the same reason.
    out.extend(mamba2::mamba2_chunk_cases(&mut rng));
    // The FP8 KV cache's writes and decode attentions, after every other case for the same
    // reason.
    out.extend(kv_fp8::kv_fp8_cases(&mut rng));
    // Nemotron-H's squared-ReLU experts and its router, after every other case for the same
    // reason.
    out.extend(moe_relu2::relu2_expert_cases(&mut rng));
    // Query groups wider than 8 (Nemotron-3-Nano: 32 query heads over 2 kv heads, two blocks a
    // kv head), after every other case for the same reason.
    out.extend(wide_group_attention_cases(&mut rng));
    // The FP8 streams, after every other case for the same reason.
    out.extend(gemv_fp8::gemv_fp8_stream_cases(&mut rng));
    // The fused decode MoE launches, after every other case for the same reason.
    out.extend(moe_fused::moe_fused_cases(&mut rng));
    // The tensor-core FP8 GEMV, after every other case for the same reason.
    out.extend(gemv_fp8::gemv_fp8_mma_cases(&mut rng));
    // The FP8 prefill product (activation quantization, block-scaled FP8 GEMM), after every
    // other case for the same reason.
    out.extend(fp8_gemm::fp8_gemm_cases(&mut rng));
    // The launches that write the FP8 product's quantized rows themselves, after every other
    // case for the same reason.
    out.extend(fp8_gemm::fp8_row_producer_cases(&mut rng));
    // The gated delta rule's chunked prefill, after every other case for the same reason.
    out.extend(gated_delta::gdn_chunk_cases(&mut rng));
    // The FP8 decode experts, after every other case for the same reason.
    out.extend(moe_fp8::moe_fp8_cases(&mut rng));
    // The gated delta rule's chunked prefill on tensor cores, after every other case for the
    // same reason.
    out.extend(gated_delta::gdn_chunk_tc_cases(&mut rng));
    out
}

/// The bulk-copy GEMV stream on Qwen3-8B's batch-1 qkv, o and down products, a bias, fewer
/// columns than the grid's warps (most warps idle) and one column more than its warps (one warp
/// takes two), the first fill all, partly or not at all before the wait, with and without the
/// evict-first hint; its f32 form (the LM head's) on 3000 and 7 columns; its SwiGLU form on
/// Qwen3-8B's gate|up product and on 7 columns.
fn gemv_stream_cases(rng: &mut Rng) -> Vec<Case> {
    let warps = GEMV_STREAM_BLOCKS * 8;
    let mut out = Vec::new();
    for (n, k, bias, prewait, evict_first, f32_out) in [
        (6144u32, 4096u32, false, 4u32, 0u32, false),
        (4096, 4096, false, 4, 1, false),
        (4096, 12288, false, 1, 1, false),
        (1000, 2048, true, 0, 0, false),
        (5, 4096, true, 2, 1, false),
        (warps + 1, 2048, false, 4, 0, false),
        (3000, 4096, false, 4, 1, true),
        (7, 2048, true, 0, 0, true),
    ] {
        out.push(stream_case(rng, n, k, bias, prewait, evict_first, f32_out));
    }
    for (inter, k, prewait, evict_first) in [(12288u32, 4096u32, 4u32, 1u32), (7, 2048, 0, 0)] {
        out.push(swiglu_stream_case(rng, inter, k, prewait, evict_first));
    }
    out.extend(gemv_stream_half_chunk_cases(rng));
    out.extend(gemv_stream_norm_cases(rng));
    // The stream on fewer blocks than the host gives it (a grid cap): each warp takes a longer
    // run of columns, the same sums.
    for (n, k, grid) in [(1056u32, 2048u32, 66u32), (1056, 4096, 33)] {
        out.push(on_grid(stream_case(rng, n, k, false, 4, 0, false), grid));
    }
    out
}

/// A one-row product through [`GemvStream`] (or [`GemvStreamF32Out`] with `f32_out`).
fn stream_case(
    rng: &mut Rng,
    n: u32,
    k: u32,
    bias: bool,
    prewait: u32,
    evict_first: u32,
    f32_out: bool,
) -> Case {
    let mut case = product_case(rng, Product::Gemv, 1, n, k, bias, f32_out);
    // The two entries take the same arguments.
    macro_rules! launch {
        ($entry:ident) => {
            Box::new(move |p: &[DevicePtr]| {
                launch_of($entry {
                    c: p[0],
                    a: p[1],
                    w: p[2],
                    bias: if bias { p[3] } else { DevicePtr::NULL },
                    m: 1,
                    n,
                    k,
                    prewait,
                    evict_first,
                })
            })
        };
    }
    if f32_out {
        case.kernel = GemvStreamF32Out::NAME;
        case.build = launch!(GemvStreamF32Out);
    } else {
        case.kernel = GemvStream::NAME;
        case.build = launch!(GemvStream);
    }
    case
}

/// A one-row SwiGLU product through [`GemvSwigluStream`].
fn swiglu_stream_case(rng: &mut Rng, inter: u32, k: u32, prewait: u32, evict_first: u32) -> Case {
    let mut case = gemv_swiglu_case(rng, 1, inter, k);
    case.kernel = GemvSwigluStream::NAME;
    case.build = Box::new(move |p| {
        launch_of(GemvSwigluStream {
            out: p[0],
            a: p[1],
            w: p[2],
            m: 1,
            inter,
            k,
            prewait,
            evict_first,
        })
    });
    case
}

/// The stream's half-size chunks (rows of whole 2 KiB pieces, not 4 KiB): Qwen3-0.6B's qkv (a
/// bias, one chunk before the wait), down (three chunks a row) and LM head (f32, fewer columns),
/// one column more than the grid's warps, and the SwiGLU form on Qwen3-0.6B's gate|up.
fn gemv_stream_half_chunk_cases(rng: &mut Rng) -> Vec<Case> {
    let warps = GEMV_STREAM_BLOCKS * 8;
    let mut out = Vec::new();
    for (n, k, bias, prewait, evict_first, f32_out) in [
        (4096u32, 1024u32, true, 1u32, 1u32, false),
        (1024, 3072, false, 4, 1, false),
        (10007, 1024, false, 4, 0, true),
        (warps + 1, 1024, false, 2, 0, false),
    ] {
        out.push(stream_case(rng, n, k, bias, prewait, evict_first, f32_out));
    }
    out.push(swiglu_stream_case(rng, 3072, 1024, 4, 1));
    out
}

/// The normalising streams (gemv_norm_cases_of's buffers, the stream's launch): Qwen3-8B's and
/// Qwen3-0.6B's batch-1 qkv and gate|up products, layer 0's (no input: the residual copied), a
/// bias on 5 columns, a row of three half-size chunks, and a norm row longer than one pass
/// (k = 8192), with the first fill all, partly or not at all before the wait and with and without
/// the evict-first hint. The residual is an output too: it must come back unchanged.
fn gemv_stream_norm_cases(rng: &mut Rng) -> Vec<Case> {
    let mut out = Vec::new();
    // (n, k, swiglu, bias, input, prewait, evict_first); for the SwiGLU form n counts gate and up
    // rows.
    for (n, k, swiglu, bias, input, prewait, evict_first) in [
        (6144u32, 4096u32, false, false, true, 4u32, 1u32),
        (24576, 4096, true, false, true, 4, 1),
        (6144, 4096, false, false, false, 2, 0),
        (4096, 1024, false, false, true, 4, 1),
        (6144, 1024, true, false, true, 4, 1),
        (5, 2048, false, true, true, 0, 0),
        (1000, 3072, false, true, true, 1, 0),
        (600, 8192, true, false, true, 4, 0),
    ] {
        let mut case = gemv_norm_cases_of(rng, &[(1, n, k, swiglu, bias, input, 0)]).remove(0);
        case.shape = format!(
            "m=1 n={n} k={k} bias={bias} input={input} prewait={prewait} evict_first={evict_first}"
        );
        if swiglu {
            case.kernel = GemvSwigluStreamNorm::NAME;
            case.build = Box::new(move |p| {
                launch_of(GemvSwigluStreamNorm {
                    out: p[0],
                    residual: p[1],
                    residual_out: p[2],
                    input: if input { p[3] } else { DevicePtr::NULL },
                    norm_weight: p[4],
                    w: p[5],
                    m: 1,
                    inter: n / 2,
                    k,
                    eps: 1e-6,
                    prewait,
                    evict_first,
                })
            });
        } else {
            case.kernel = GemvStreamNorm::NAME;
            case.build = Box::new(move |p| {
                launch_of(GemvStreamNorm {
                    c: p[0],
                    residual: p[1],
                    residual_out: p[2],
                    input: if input { p[3] } else { DevicePtr::NULL },
                    norm_weight: p[4],
                    w: p[5],
                    bias: if bias { p[6] } else { DevicePtr::NULL },
                    m: 1,
                    n,
                    k,
                    eps: 1e-6,
                    prewait,
                    evict_first,
                })
            });
        }
        out.push(case);
    }
    out
}

/// The grid barrier over `blocks` blocks (few enough to be resident on any GPU) and `phases`
/// phases: the checksums say whether each block saw the others' words of the phase before, the
/// sync words whether the count went back to zero and the generation moved once per barrier.
fn grid_barrier_case(blocks: u32, phases: u32) -> Case {
    let words = |n: usize, v: u32| v.to_le_bytes().repeat(n);
    Case {
        kernel: GridBarrier::NAME,
        gemm: None,
        allowance: None,
        shape: format!("blocks={blocks} phases={phases}"),
        buffers: vec![
            Buffer {
                init: words(2, 0).into(),
                output: Some(OutputKind::I32),
            },
            Buffer {
                init: words(2 * blocks as usize, 0x5a5a_5a5a).into(),
                output: Some(OutputKind::I32),
            },
            Buffer {
                init: words(blocks as usize, 0x5a5a_5a5a).into(),
                output: Some(OutputKind::I32),
            },
        ],
        build: Box::new(move |p| {
            launch_of(GridBarrier {
                sync: p[0],
                data: p[1],
                out: p[2],
                blocks,
                phases,
            })
        }),
    }
}

/// `case` launched on `grid` blocks instead of its own launch's.
fn on_grid(mut case: Case, grid: u32) -> Case {
    let build = case.build;
    case.build = Box::new(move |p| {
        let (mut config, args) = build(p);
        config.grid[0] = grid;
        (config, args)
    });
    case.shape = format!("{} grid={grid}", case.shape);
    case
}

/// The GEMV entries on grids other than their launch's, where the blocks loop over the column
/// groups: the model's capped grid (Qwen3-8B's qkv, an LM head and Qwen3-0.6B's gate|up on the
/// resident blocks, 396 on the H200), the balanced one (o_proj's 512 groups on 256 blocks), grids
/// that change the columns per block (8B's down on the resident blocks: 8 columns of one warp
/// each, not one column of 8 warps; the `gemv_grid_mode=resplit` tuning), and a few blocks taking many rounds, in the FMA and MMA
/// forms, the scalar path and the staged entries.
fn gemv_grid_cases(rng: &mut Rng) -> Vec<Case> {
    let mut out = Vec::new();
    for &(m, n, k, bias, grid) in &[
        (1u32, 6144u32, 4096u32, false, GEMV_RESIDENT_BLOCKS),
        (1, 4096, 4096, true, 256),
        (1, 4096, 12288, false, GEMV_RESIDENT_BLOCKS),
        (3, 1000, 130, true, 7),
        (2, 77, 12288, false, 3),
        (6, 1000, 576, true, 5),
    ] {
        let case = product_case(rng, Product::Gemv, m, n, k, bias, false);
        out.push(on_grid(case, grid));
    }
    // An LM head's shape (f32 out), 6144 groups of 8 columns: 16 rounds on the resident blocks.
    let lm_head = product_case(rng, Product::Gemv, 1, 49152, 576, false, true);
    out.push(on_grid(lm_head, GEMV_RESIDENT_BLOCKS));
    for &(m, inter, k, grid) in &[
        (1u32, 3072u32, 1024u32, GEMV_RESIDENT_BLOCKS),
        (4, 1001, 256, 9),
    ] {
        out.push(on_grid(gemv_swiglu_case(rng, m, inter, k), grid));
    }
    // Of the staged entries' cases, a plain and a SwiGLU one of Qwen3-0.6B's, and a ragged one.
    for case in gemv_staged_cases(rng) {
        let shape = case.shape.as_str();
        if shape.starts_with("m=1 n=4096 k=1024 ")
            || shape.starts_with("m=2 n=777 ")
            || shape.starts_with("m=1 inter=3072 ")
        {
            out.push(on_grid(case, 11));
        }
    }
    out
}

/// Runs one case on a backend and returns the bytes of every output buffer afterwards, in the
/// case's buffer order (empty for its inputs, which are not compared: reading them back would
/// only double what a [`Reference`] holds).
fn run_on(gpu: &dyn GpuBackend, case: &Case) -> Result<Vec<Vec<u8>>, GpuError> {
    let handle = gpu.kernel(case.kernel)?;
    let mut ptrs = Vec::new();
    for b in &case.buffers {
        let init = b.init.bytes();
        let p = gpu.alloc(init.len())?;
        gpu.copy_h2d(init, p)?;
        ptrs.push(p);
    }
    let (config, args) = (case.build)(&ptrs);
    let stream = gpu.default_stream();
    match &case.gemm {
        Some(op) => gpu.gemm(&op(&ptrs), handle, stream)?,
        None => gpu.launch(handle, &config, &args, stream)?,
    }
    gpu.synchronize(stream)?;
    let mut results = Vec::new();
    for (b, &p) in case.buffers.iter().zip(&ptrs) {
        let mut bytes = Vec::new();
        if b.output.is_some() {
            bytes.resize(b.init.bytes().len(), 0);
            gpu.copy_d2h(p, &mut bytes)?;
        }
        results.push(bytes);
        gpu.free(p)?;
    }
    Ok(results)
}

/// Compares one case's outputs on `under_test` against `reference`.
pub fn compare(case: &Case, got: &[Vec<u8>], want: &[Vec<u8>]) -> CaseResult {
    let (mut max_abs, mut rel_l2, mut mismatches, mut elements) = (0f32, 0f32, 0usize, 0usize);
    let mut first_mismatch = None;
    for (b_index, ((buffer, g), w)) in case.buffers.iter().zip(got).zip(want).enumerate() {
        match buffer.output {
            None => {}
            Some(OutputKind::E4m3) => {
                let (n, bad, first) = kv_fp8::compare_e4m3(g, w);
                elements += n;
                mismatches += bad;
                if let Some((i, a, b)) = first {
                    first_mismatch.get_or_insert((b_index, i, a, b));
                }
            }
            Some(OutputKind::I32) => {
                let (g, w): (Vec<i32>, Vec<i32>) = (
                    bytemuck::pod_collect_to_vec(g),
                    bytemuck::pod_collect_to_vec(w),
                );
                elements += w.len();
                for (i, (a, b)) in g.iter().zip(&w).enumerate() {
                    if a != b {
                        mismatches += 1;
                        first_mismatch.get_or_insert((b_index, i, f64::from(*a), f64::from(*b)));
                    }
                }
            }
            Some(kind @ (OutputKind::Bf16 | OutputKind::F32)) => {
                let (g, w): (Vec<f32>, Vec<f32>) = if kind == OutputKind::F32 {
                    (
                        bytemuck::pod_collect_to_vec(g),
                        bytemuck::pod_collect_to_vec(w),
                    )
                } else {
                    (bf16_values(g), bf16_values(w))
                };
                let ms = w.iter().map(|&x| f64::from(x) * f64::from(x)).sum::<f64>()
                    / w.len().max(1) as f64;
                let rms = ms.sqrt() as f32;
                let (rtol, atol) = if kind == OutputKind::F32 {
                    let floor = if case.kernel == PagedAttention::NAME
                        || case.kernel == PagedAttentionQkv::NAME
                        || case.kernel == PagedAttentionQkv::WIDE_NAME
                        || kv_fp8::is_fp8_decode_attention(case.kernel)
                    {
                        PAGED_ATTENTION_PARTIALS_ATOL_OF_RMS * rms
                    } else {
                        0.0
                    };
                    (F32_ELEMENT_RTOL, F32_ELEMENT_ATOL.max(floor))
                } else {
                    (
                        BF16_ELEMENT_RTOL,
                        (BF16_ELEMENT_ATOL_OF_RMS * rms).max(1e-6),
                    )
                };
                let allowance = case
                    .allowance
                    .as_ref()
                    .filter(|a| a.buffer == b_index)
                    .map(Allowance::extra);
                let (mut diff2, mut ref2) = (0f64, 0f64);
                for (i, (&a, &b)) in g.iter().zip(&w).enumerate() {
                    let d = (a - b).abs();
                    let extra = allowance.map_or(0.0, |x| x[i]);
                    if d.is_nan() || d > rtol * b.abs() + atol + extra {
                        mismatches += 1;
                        first_mismatch.get_or_insert((b_index, i, f64::from(a), f64::from(b)));
                    }
                    max_abs = max_abs.max(if d.is_nan() { f32::INFINITY } else { d });
                    diff2 += f64::from(d) * f64::from(d);
                    ref2 += f64::from(b) * f64::from(b);
                }
                elements += w.len();
                let rel = if ref2 > 0.0 {
                    (diff2 / ref2).sqrt() as f32
                } else if diff2 > 0.0 {
                    f32::INFINITY
                } else {
                    0.0
                };
                rel_l2 = rel_l2.max(rel);
            }
        }
    }
    CaseResult {
        kernel: case.kernel,
        shape: case.shape.clone(),
        max_abs,
        rel_l2,
        mismatches,
        elements,
        passed: mismatches == 0 && rel_l2 <= BF16_REL_L2,
        first_mismatch,
    }
}

/// Runs every case on both backends and compares.
pub fn run_parity(
    under_test: &dyn GpuBackend,
    reference: &dyn GpuBackend,
    seed: u64,
) -> Result<Vec<CaseResult>, GpuError> {
    run_parity_with(under_test, reference, seed, &|_| true, &mut |_, _| {})
}

/// [`run_parity`] over the cases of the kernels `select` accepts, calling
/// `progress(kernel, shape)` before each case runs (so that a caller can say which case a hung or
/// crashed launch belongs to).
pub fn run_parity_with(
    under_test: &dyn GpuBackend,
    reference: &dyn GpuBackend,
    seed: u64,
    select: &dyn Fn(KernelName) -> bool,
    progress: &mut dyn FnMut(KernelName, &str),
) -> Result<Vec<CaseResult>, GpuError> {
    Reference::for_seed(reference, seed, select)?.check(under_test, progress)
}

/// Cases with their outputs on a reference backend, run once and compared against any number of
/// backends (every kernel target of a GPU checks against the same host outputs).
pub struct Reference {
    cases: Vec<Case>,
    outputs: Vec<Vec<Vec<u8>>>,
}

impl Reference {
    /// Runs `cases` on `reference`.
    pub fn run(reference: &dyn GpuBackend, cases: Vec<Case>) -> Result<Reference, GpuError> {
        let outputs = cases
            .iter()
            .map(|case| run_on(reference, case))
            .collect::<Result<_, _>>()?;
        Ok(Reference { cases, outputs })
    }

    /// The cases of `seed` ([`cases`]) whose kernel `select` accepts, on `reference`.
    pub fn for_seed(
        reference: &dyn GpuBackend,
        seed: u64,
        select: &dyn Fn(KernelName) -> bool,
    ) -> Result<Reference, GpuError> {
        let cases = cases(seed)
            .into_iter()
            .filter(|case| select(case.kernel))
            .collect();
        Reference::run(reference, cases)
    }

    /// Runs every case on `under_test` and compares it with the reference's outputs, calling
    /// `progress(kernel, shape)` before each case runs.
    pub fn check(
        &self,
        under_test: &dyn GpuBackend,
        progress: &mut dyn FnMut(KernelName, &str),
    ) -> Result<Vec<CaseResult>, GpuError> {
        self.cases
            .iter()
            .zip(&self.outputs)
            .map(|(case, want)| {
                progress(case.kernel, &case.shape);
                Ok(compare(case, &run_on(under_test, case)?, want))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{HostBackend, MockBackend};

    /// Two decode attention partials the H200 computed (check-kernels runs of 2026-12-01 at
    /// 264a600 and 392a047, random seeds printed by the runs) that failed the comparison before
    /// the partials had an allowance: one off by f16 probability rounding alone, one by a query
    /// the host rounded from an exact bf16 tie and the GPU the other way. Each must now pass, and
    /// ten times the same error must not (the allowance is a bound, not a blanket).
    ///
    /// The same for a bf16 output of the fused form's 8-warp entry with one split (check-kernels
    /// at 8b8344e, 2026-12-02): one element of 1 978 392 off by 2.5e-4 before one-split launches
    /// had an output allowance. Its allowance (its head's f16 probabilities and query flips,
    /// divided by the row sum) lies between 10 and 20 times that error: twenty times must fail.
    #[test]
    fn decode_attention_allowance_covers_h200_partials() {
        for (seed, shape, buffer, element, gpu, refuse) in [
            (
                1796149587916551593u64,
                "seqs=1 tokens=70 ctx=70 heads=32/8 d=128 splits=4",
                1usize,
                1051497usize,
                3.695_535_7e-2_f32,
                10.0f32,
            ),
            (
                1796149980482499123,
                "seqs=1 ctx=1024 heads=32/8 d=128 qk_norm=true splits=16",
                1,
                60726,
                -1.420_702_3,
                10.0,
            ),
            (
                1796208326377630473,
                "seqs=3 ctx=300 heads=32/8 d=128 qk_norm=true splits=1 (wide)",
                0,
                5650,
                -1.585_483_6e-5,
                20.0,
            ),
        ] {
            let case = cases(seed)
                .into_iter()
                .find(|c| c.shape == shape)
                .expect("case");
            let host = HostBackend::new(1 << 32);
            let want = run_on(&host, &case).unwrap();
            // The buffer's values as f32 (partials) or bf16 (the output), and back.
            let f32_out = case.buffers[buffer].output == Some(OutputKind::F32);
            let read = |bytes: &[u8]| -> Vec<f32> {
                if f32_out {
                    bytemuck::pod_collect_to_vec(bytes)
                } else {
                    bf16_values(bytes)
                }
            };
            let at = |value: f32| {
                let mut got = want.clone();
                let mut values = read(&got[buffer]);
                values[element] = value;
                got[buffer] = if f32_out {
                    bytemuck::cast_slice(&values).to_vec()
                } else {
                    let v: Vec<half::bf16> =
                        values.iter().map(|&x| half::bf16::from_f32(x)).collect();
                    bytemuck::cast_slice(&v).to_vec()
                };
                compare(&case, &got, &want)
            };
            let reference = read(&want[buffer]);
            let error = gpu - reference[element];
            assert!(at(gpu).passed, "{shape}: {:?}", at(gpu));
            let refused = at(reference[element] + refuse * error);
            assert!(!refused.passed, "{shape}: {refused:?}");
        }
    }

    /// Every case on a second host backend against the host reference: all exact, and every
    /// kernel with a host reference has a case. Then on the mock, which runs nothing (outputs keep
    /// their initial bytes): every case must fail. One reference run serves both, as in
    /// check-kernels (most of the cost is drawing the inputs and running the host reference).
    #[test]
    fn host_against_itself_passes_and_metric_rejects_a_wrong_backend() {
        let reference = Reference::for_seed(&HostBackend::new(1 << 30), 7, &|_| true).unwrap();
        let results = reference
            .check(&HostBackend::new(1 << 30), &mut |_, _| {})
            .unwrap();
        assert!(
            results.iter().all(|r| r.passed && r.max_abs == 0.0),
            "{results:?}"
        );
        for k in metrale_kernels::ALL_KERNELS {
            assert!(
                results.iter().any(|r| r.kernel == *k),
                "no parity case for {k}"
            );
        }
        let results = reference
            .check(&MockBackend::new(), &mut |_, _| {})
            .unwrap();
        let passed: Vec<_> = results
            .iter()
            .filter(|r| r.passed)
            .map(|r| format!("{} {}", r.kernel, r.shape))
            .collect();
        assert!(
            passed.is_empty(),
            "cases that cannot tell a no-op from the kernel: {passed:?}"
        );
    }

    #[test]
    fn skip_leaves_the_state_of_the_draws_it_passes() {
        for draws in [0u64, 1, 2, 3, 1000, 123_457] {
            let (mut drawn, mut skipped) = (Rng::new(42), Rng::new(42));
            for _ in 0..draws {
                drawn.next_u64();
            }
            skipped.skip(draws);
            assert_eq!(drawn.next_u64(), skipped.next_u64(), "{draws} draws");
        }
    }

    /// What [`bf16_normal`] drew in place before its fills were lazy.
    fn bf16_normal_eager(rng: &mut Rng, n: usize, scale: f32) -> Vec<u8> {
        let v: Vec<bf16> = (0..n)
            .map(|_| bf16::from_f32(rng.normal() * scale))
            .collect();
        bytemuck::cast_slice(&v).to_vec()
    }

    /// A lazy fill holds the bytes an eager one drew and leaves the generator where it left it,
    /// whether it is read before the draws after it, after them, or never.
    #[test]
    fn a_lazy_fill_draws_what_an_eager_one_did() {
        for (n, scale) in [(0usize, 1.0f32), (1, 2.0), (1000, 0.125), (4099, 3.0)] {
            let mut eager = Rng::new(7);
            let want = bf16_normal_eager(&mut eager, n, scale);
            let after = eager.next_u64();

            let mut lazy = Rng::new(7);
            let fill = bf16_normal(&mut lazy, n, scale);
            assert_eq!(lazy.next_u64(), after, "n={n}: draws after the fill");
            assert_eq!(fill.bytes(), want, "n={n}: the fill read late");

            let mut lazy = Rng::new(7);
            let fill = bf16_normal(&mut lazy, n, scale);
            assert_eq!(fill.bytes(), want, "n={n}: the fill read at once");
            assert_eq!(lazy.next_u64(), after, "n={n}: draws after a read fill");

            let mut lazy = Rng::new(7);
            drop(bf16_normal(&mut lazy, n, scale));
            assert_eq!(lazy.next_u64(), after, "n={n}: draws after an unread fill");
        }
    }

    /// FNV-1a over a case's buffers (each's length, then its initial bytes) and over its
    /// allowance (its buffer, then its values' bits; the offset basis where there is none).
    fn fingerprint(case: &Case) -> (u64, u64) {
        fn fnv(h: &mut u64, bytes: &[u8]) {
            for &b in bytes {
                *h ^= u64::from(b);
                *h = h.wrapping_mul(0x100_0000_01b3);
            }
        }
        let (mut inputs, mut allowance) = (0xcbf2_9ce4_8422_2325u64, 0xcbf2_9ce4_8422_2325u64);
        for b in &case.buffers {
            fnv(&mut inputs, &(b.init.bytes().len() as u64).to_le_bytes());
            fnv(&mut inputs, b.init.bytes());
        }
        if let Some(a) = &case.allowance {
            fnv(&mut allowance, &(a.buffer as u64).to_le_bytes());
            fnv(&mut allowance, bytemuck::cast_slice(a.extra()));
        }
        (inputs, allowance)
    }

    /// Cases picked out of the list, the others dropped unread, hold the inputs and allowances
    /// that the eager build (every input drawn in order, before fills were lazy) gave them: the
    /// first case, the decode attention cases the allowance test pins by seed, a large product,
    /// and the last case (after every other fill). Fingerprints from the eager build at 098110c.
    const PINNED_FINGERPRINTS: &[(u64, KernelName, &str, (u64, u64))] = &[
        (
            1796149587916551593,
            Embedding::NAME,
            "tokens=1 hidden=576 vocab=1000",
            (0x5b74_8c6b_8511_c508, 0xcbf2_9ce4_8422_2325),
        ),
        (
            1796149587916551593,
            Gemm::NAME,
            "m=300 n=4096 k=4096 bias=false via GpuBackend::gemm",
            (0xa772_bbe7_75b5_8813, 0xcbf2_9ce4_8422_2325),
        ),
        (
            1796149587916551593,
            PagedAttention::NAME,
            "seqs=1 tokens=70 ctx=70 heads=32/8 d=128 splits=4",
            (0xb7eb_cb6d_1ddf_d179, 0x126f_79ea_1cdd_e94e),
        ),
        (
            1796149587916551593,
            PrefillAttentionV2::NAME,
            "runs=[(0, 200)] tiles=2 (<=128 tokens) heads=16/4 d=128",
            (0x546a_146e_c6ce_b4b3, 0xabfd_afd4_61c4_361c),
        ),
        (
            1796149587916551593,
            MoeCombine::NAME,
            "rows=5 k=3 experts=7 hidden=130 empty=3 shared gated=true",
            (0xc346_c81b_54f1_3300, 0xcbf2_9ce4_8422_2325),
        ),
        (
            1796149980482499123,
            PagedAttentionQkv::NAME,
            "seqs=1 ctx=1024 heads=32/8 d=128 qk_norm=true splits=16",
            (0x0da7_2132_35f1_7560, 0xb3fe_ae5a_a212_2207),
        ),
        (
            1796208326377630473,
            PagedAttentionQkv::WIDE_NAME,
            "seqs=3 ctx=300 heads=32/8 d=128 qk_norm=true splits=1 (wide)",
            (0xd756_3c08_a7ae_10cc, 0xafe3_e901_beaa_0d52),
        ),
    ];

    #[test]
    fn picked_cases_hold_the_inputs_of_the_eager_build() {
        let mut seeds: Vec<u64> = PINNED_FINGERPRINTS.iter().map(|p| p.0).collect();
        seeds.dedup();
        for seed in seeds {
            let all = cases(seed);
            for (_, kernel, shape, want) in PINNED_FINGERPRINTS.iter().filter(|p| p.0 == seed) {
                let found: Vec<&Case> = all
                    .iter()
                    .filter(|c| c.kernel == *kernel && c.shape == *shape)
                    .collect();
                assert_eq!(found.len(), 1, "{seed} {kernel} {shape}");
                assert_eq!(fingerprint(found[0]), *want, "{seed} {kernel} {shape}");
            }
        }
    }
}
