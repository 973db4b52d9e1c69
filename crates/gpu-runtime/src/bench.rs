// SPDX-License-Identifier: MIT OR Apache-2.0
//! Kernel timing at the shapes the decode and prefill paths launch: time per launch from CUDA
//! events, and the bytes and FLOPs each launch must move and compute, so that a row can be read
//! against the memory and tensor-core rooflines.
//!
//! Inputs are constant fill patterns, not random values: the kernels here have no data-dependent
//! control flow, and a benchmark must not spend its device time generating data.

use metrale_core::{DevicePtr, KernelArg, KernelName, LaunchConfig};
use metrale_kernels::hardware::hopper;
use metrale_kernels::ops::*;
use metrale_kernels::{Kernel, KernelAbi};

use crate::{GemmOp, GpuBackend, GpuError};

mod fp8;
mod moe;
pub use moe::{MoeShape, NEMOTRON_3_NANO_EXPERTS, QWEN3_30B_A3B_EXPERTS, moe_cases};

/// Builds a launch from the case's device buffers.
type BuildLaunch = Box<dyn Fn(&[DevicePtr]) -> (LaunchConfig, Vec<KernelArg>)>;

/// One benchmark: a kernel at one shape.
pub struct BenchCase {
    /// The kernel.
    pub kernel: KernelName,
    /// What the shape stands for (e.g. "qwen3-8b gate_up m=1").
    pub label: String,
    /// Bytes a launch must read and write at least (the memory floor).
    pub bytes: u64,
    /// Floating-point operations of a launch.
    pub flops: u64,
    /// Buffers to allocate: size and fill byte.
    buffers: Vec<(usize, u8)>,
    /// Buffers uploaded as they are (block tables, positions).
    uploads: Vec<Vec<u8>>,
    /// Builds the launch from the allocated buffers, then the uploads, in order.
    build: BuildLaunch,
    /// Time [`GpuBackend::gemm`] (cuBLASLt on CUDA) for this product instead of the kernel; its
    /// c, a and w are buffers 0, 1 and 2, an FP8 product's activation and weight scales buffers
    /// 3 and 4.
    library_gemm: Option<GemmOp>,
}

/// The timing of one case.
#[derive(Clone, Debug, serde::Serialize)]
pub struct BenchResult {
    /// Kernel function name.
    pub kernel: String,
    /// The case's label.
    pub label: String,
    /// Median microseconds per launch over the timed batches.
    pub us: f64,
    /// Achieved bandwidth, GB/s (bytes / time).
    pub gb_s: f64,
    /// Achieved TFLOP/s.
    pub tflop_s: f64,
}

fn launch_of<K: Kernel>(k: K) -> (LaunchConfig, Vec<KernelArg>) {
    (k.launch_config(), k.args())
}

fn i32_bytes(v: &[i32]) -> Vec<u8> {
    bytemuck::cast_slice(v).to_vec()
}

/// A model's decode-relevant dimensions.
#[derive(Clone, Copy, Debug)]
pub struct Shape {
    /// Name used in labels.
    pub name: &'static str,
    /// Hidden size.
    pub hidden: u32,
    /// MLP intermediate size.
    pub inter: u32,
    /// Query heads.
    pub q_heads: u32,
    /// KV heads.
    pub kv_heads: u32,
    /// Head dimension.
    pub head_dim: u32,
    /// Vocabulary.
    pub vocab: u32,
}

/// Qwen3-8B's dimensions.
pub const QWEN3_8B: Shape = Shape {
    name: "qwen3-8b",
    hidden: 4096,
    inter: 12288,
    q_heads: 32,
    kv_heads: 8,
    head_dim: 128,
    vocab: 151936,
};

/// Qwen3-0.6B's dimensions.
pub const QWEN3_0_6B: Shape = Shape {
    name: "qwen3-0.6b",
    hidden: 1024,
    inter: 3072,
    q_heads: 16,
    kv_heads: 8,
    head_dim: 128,
    vocab: 151936,
};

fn gemv_case(s: &Shape, what: &str, m: u32, n: u32, k: u32, f32_out: bool) -> BenchCase {
    let out_bytes = if f32_out { 4 } else { 2 };
    let kernel = if f32_out {
        GemvF32Out::NAME
    } else {
        Gemv::NAME
    };
    BenchCase {
        kernel,
        label: format!("{} {what} m={m} n={n} k={k}", s.name),
        bytes: (n as u64 * k as u64 + m as u64 * k as u64) * 2 + (m * n) as u64 * out_bytes,
        flops: 2 * m as u64 * n as u64 * k as u64,
        buffers: vec![
            ((m * n) as usize * out_bytes as usize, 0),
            ((m * k) as usize * 2, 0x3C),
            (n as usize * k as usize * 2, 0x3C),
        ],
        uploads: vec![],
        library_gemm: None,
        build: Box::new(move |p| {
            let (c, a, w, bias) = (p[0], p[1], p[2], DevicePtr::NULL);
            if f32_out {
                launch_of(GemvF32Out {
                    c,
                    a,
                    w,
                    bias,
                    m,
                    n,
                    k,
                })
            } else {
                launch_of(Gemv {
                    c,
                    a,
                    w,
                    bias,
                    m,
                    n,
                    k,
                })
            }
        }),
    }
}

/// The gate|up GEMV with SiLU x up in its epilogue: [`gemv_case`]'s gate_up row with half its
/// output.
fn gemv_swiglu_case(s: &Shape, m: u32, inter: u32, k: u32) -> BenchCase {
    let mut case = gemv_case(s, "gate_up+silu*mul", m, 2 * inter, k, false);
    case.kernel = GemvSwiglu::NAME;
    case.bytes -= (m * inter) as u64 * 2;
    case.buffers[0] = ((m * inter) as usize * 2, 0);
    case.build = Box::new(move |p| {
        launch_of(GemvSwiglu {
            out: p[0],
            a: p[1],
            w: p[2],
            m,
            inter,
            k,
        })
    });
    case
}

/// [`gemv_case`] (or, `swiglu`, [`gemv_swiglu_case`]) through the staged entry, as the model
/// launches the products [`gemv_stages`] picks.
fn gemv_staged_case(s: &Shape, what: &str, m: u32, n: u32, k: u32, swiglu: bool) -> BenchCase {
    let mut case = if swiglu {
        gemv_swiglu_case(s, m, n / 2, k)
    } else {
        gemv_case(s, what, m, n, k, false)
    };
    case.label = format!("{} (staged)", case.label);
    if swiglu {
        case.kernel = GemvSwigluStaged::NAME;
        let inter = n / 2;
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
    } else {
        case.kernel = GemvStaged::NAME;
        case.build = Box::new(move |p| {
            launch_of(GemvStaged {
                c: p[0],
                a: p[1],
                w: p[2],
                bias: DevicePtr::NULL,
                m,
                n,
                k,
            })
        });
    }
    case
}

/// [`gemv_case`] of one row through the bulk-copy stream ([`GemvStream`], or with `f32_out`
/// [`GemvStreamF32Out`]), the whole first fill before the wait, no L2 hint.
fn gemv_stream_case(s: &Shape, what: &str, n: u32, k: u32, f32_out: bool) -> BenchCase {
    let mut case = gemv_case(s, what, 1, n, k, f32_out);
    case.label = format!("{} (stream)", case.label);
    // The two entries take the same arguments.
    macro_rules! launch {
        ($entry:ident) => {
            Box::new(move |p: &[DevicePtr]| {
                launch_of($entry {
                    c: p[0],
                    a: p[1],
                    w: p[2],
                    bias: DevicePtr::NULL,
                    m: 1,
                    n,
                    k,
                    prewait: GEMV_STREAM_STAGES,
                    evict_first: 0,
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

/// The residual add + RMSNorm and the product after it in one launch ([`GemvNorm`], or with
/// `swiglu` [`GemvSwigluNorm`] over the `n` interleaved gate|up columns), staged as the model's
/// default policy stages it ([`gemv_stages`]). Bytes: the weight, the residual read and written
/// (f32), the input, the norm weight and the output.
fn gemv_norm_case(s: &Shape, what: &str, m: u32, n: u32, k: u32, swiglu: bool) -> BenchCase {
    let out_cols = if swiglu { n / 2 } else { n };
    let rows = m as u64 * k as u64;
    let stage = u32::from(gemv_stages(m, n, k));
    BenchCase {
        kernel: if swiglu {
            GemvSwigluNorm::NAME
        } else {
            GemvNorm::NAME
        },
        label: format!("{} add+rmsnorm+{what} m={m} n={n} k={k}", s.name),
        bytes: n as u64 * k as u64 * 2
            + rows * (4 + 4 + 2)
            + k as u64 * 2
            + (m * out_cols) as u64 * 2,
        flops: 2 * m as u64 * n as u64 * k as u64 + 4 * rows,
        buffers: vec![
            ((m * out_cols) as usize * 2, 0),
            (rows as usize * 4, 0x3C),
            (rows as usize * 4, 0),
            (rows as usize * 2, 0x3C),
            (k as usize * 2, 0x3C),
            (n as usize * k as usize * 2, 0x3C),
        ],
        uploads: vec![],
        library_gemm: None,
        build: Box::new(move |p| {
            if swiglu {
                launch_of(swiglu_norm_of(p, m, n / 2, k, stage))
            } else {
                launch_of(norm_of(p, m, n, k, stage))
            }
        }),
    }
}

/// [`gemv_norm_case`]'s product on its buffers `p`.
fn norm_of(p: &[DevicePtr], m: u32, n: u32, k: u32, stage: u32) -> GemvNorm {
    GemvNorm {
        c: p[0],
        residual: p[1],
        residual_out: p[2],
        input: p[3],
        norm_weight: p[4],
        w: p[5],
        bias: DevicePtr::NULL,
        m,
        n,
        k,
        eps: 1e-6,
        stage,
    }
}

/// [`gemv_norm_case`]'s SwiGLU product on its buffers `p`.
fn swiglu_norm_of(p: &[DevicePtr], m: u32, inter: u32, k: u32, stage: u32) -> GemvSwigluNorm {
    GemvSwigluNorm {
        out: p[0],
        residual: p[1],
        residual_out: p[2],
        input: p[3],
        norm_weight: p[4],
        w: p[5],
        m,
        inter,
        k,
        eps: 1e-6,
        stage,
    }
}

/// [`gemv_norm_case`] of one row through the normalising bulk-copy stream ([`GemvStreamNorm`], or
/// with `swiglu` [`GemvSwigluStreamNorm`]), the whole first fill before the wait, no L2 hint (the
/// `From` launch of the unstreamed case's product).
fn gemv_stream_norm_case(s: &Shape, what: &str, n: u32, k: u32, swiglu: bool) -> BenchCase {
    let mut case = gemv_norm_case(s, what, 1, n, k, swiglu);
    case.label = format!("{} (stream)", case.label);
    if swiglu {
        case.kernel = GemvSwigluStreamNorm::NAME;
        case.build = Box::new(move |p| {
            launch_of(GemvSwigluStreamNorm::from(swiglu_norm_of(
                p,
                1,
                n / 2,
                k,
                0,
            )))
        });
    } else {
        case.kernel = GemvStreamNorm::NAME;
        case.build = Box::new(move |p| launch_of(GemvStreamNorm::from(norm_of(p, 1, n, k, 0))));
    }
    case
}

/// A GEMV case's own grid (one block per column group), from its launch.
fn launch_grid(case: &BenchCase) -> u32 {
    let ptrs = vec![DevicePtr::NULL; case.buffers.len() + case.uploads.len()];
    (case.build)(&ptrs).0.grid[0]
}

/// A GEMV case of `m` rows over `n` launch columns at the model's default grid
/// ([`gemv_launch_grid`] under [`GEMV_RESIDENT_BLOCKS`] and the default [`GemvGridMode`], as
/// `Model::launch_gemv` launches it).
fn engine_grid(mut case: BenchCase, m: u32, n: u32) -> BenchCase {
    let build = case.build;
    case.build = Box::new(move |p| {
        let (mut config, args) = build(p);
        config.grid[0] = gemv_launch_grid(
            m,
            n,
            config.grid[0],
            GEMV_RESIDENT_BLOCKS,
            GemvGridMode::default(),
        );
        (config, args)
    });
    case
}

/// [`gemv_case`] at one row, launched with `columns` output columns per block instead of the
/// rule's (the kernel recovers the split from the grid).
fn gemv_split_case(s: &Shape, what: &str, n: u32, k: u32, columns: u32) -> BenchCase {
    let mut case = gemv_case(s, what, 1, n, k, false);
    case.label = format!("{} ({columns} columns per block)", case.label);
    let build = case.build;
    case.build = Box::new(move |p| {
        let (mut config, args) = build(p);
        config.grid[0] = n.div_ceil(columns);
        (config, args)
    });
    case
}

/// [`gemv_case`] at one row on [`GEMV_RESIDENT_BLOCKS`] blocks where the cap changes the
/// columns per block (the kernel recovers them from the grid; the blocks loop over the groups).
fn gemv_resident_case(s: &Shape, what: &str, n: u32, k: u32) -> BenchCase {
    let mut case = gemv_case(s, what, 1, n, k, false);
    let columns = gemv_grid_columns(1, n, GEMV_RESIDENT_BLOCKS);
    case.label = format!(
        "{} (resident grid of {columns} columns per block)",
        case.label
    );
    let build = case.build;
    case.build = Box::new(move |p| {
        let (mut config, args) = build(p);
        config.grid[0] = GEMV_RESIDENT_BLOCKS;
        (config, args)
    });
    case
}

/// `C[m, n] = A[m, k] · W[n, k]^T` with bf16 output, pointers left null.
fn product(m: u32, n: u32, k: u32) -> GemmOp {
    GemmOp {
        c: DevicePtr::NULL,
        a: DevicePtr::NULL,
        w: DevicePtr::NULL,
        bias: DevicePtr::NULL,
        m,
        n,
        k,
        f32_out: false,
        fp8: None,
    }
}

fn gemm_case(s: &Shape, what: &str, m: u32, n: u32, k: u32) -> BenchCase {
    BenchCase {
        kernel: Gemm::NAME,
        label: format!("{} {what} m={m} n={n} k={k}", s.name),
        bytes: (n as u64 * k as u64 + m as u64 * k as u64 + m as u64 * n as u64) * 2,
        flops: 2 * m as u64 * n as u64 * k as u64,
        buffers: vec![
            ((m * n) as usize * 2, 0),
            ((m * k) as usize * 2, 0x3C),
            (n as usize * k as usize * 2, 0x3C),
        ],
        uploads: vec![],
        library_gemm: None,
        build: Box::new(move |p| {
            GemmOp {
                c: p[0],
                a: p[1],
                w: p[2],
                ..product(m, n, k)
            }
            .kernel_launch()
        }),
    }
}

/// The same product through [`GpuBackend::gemm`] (cuBLASLt on CUDA).
fn library_gemm_case(s: &Shape, what: &str, m: u32, n: u32, k: u32) -> BenchCase {
    let mut case = gemm_case(s, what, m, n, k);
    case.label = format!("{} {what} m={m} n={n} k={k} (GpuBackend::gemm)", s.name);
    case.library_gemm = Some(product(m, n, k));
    case
}

/// The LM head's product (f32 logits, as the engine writes them) through [`GpuBackend::gemm`].
fn library_lm_head_case(s: &Shape, m: u32) -> BenchCase {
    let (n, k) = (s.vocab, s.hidden);
    let mut case = library_gemm_case(s, "lm_head", m, n, k);
    case.kernel = GemmF32Out::NAME;
    case.bytes = (n as u64 * k as u64 + m as u64 * k as u64) * 2 + m as u64 * n as u64 * 4;
    case.buffers[0] = ((m * n) as usize * 4, 0);
    case.library_gemm = Some(GemmOp {
        f32_out: true,
        ..product(m, n, k)
    });
    case
}

/// Partials room and block target of the model's split attention (crates/model-engine).
const PARTIALS: u32 = 32768;
const TARGET_BLOCKS: u32 = hopper::SM_COUNT * hopper::ATTENTION_BLOCKS_PER_SM;

/// Attention of `tokens` query tokens per sequence (the last `tokens` positions of a `context`
/// long sequence; 1 = decode) over `seqs` sequences, split as the model splits it. With more than
/// one split the combine kernel is timed as its own row; prefill shapes (more than one token) also
/// time the tensor-core prefill kernel over the same tokens, next to the per-query kernel. The
/// FLOPs are causal: 4 · head_dim · q_heads per (query, visible key) pair.
fn attention_cases(s: &Shape, seqs: u32, tokens: u32, context: u32) -> Vec<BenchCase> {
    let block = 16u32;
    let blocks_per_seq = context.div_ceil(block);
    let tables: Vec<i32> = (0..seqs * blocks_per_seq).map(|b| b as i32).collect();
    let kv_row = (s.kv_heads * s.head_dim) as usize;
    let cache = (seqs * blocks_per_seq * block) as usize * kv_row * 2;
    let (qh, kvh, hd) = (s.q_heads, s.kv_heads, s.head_dim);
    let n = seqs * tokens;
    let (keys_per_split, splits) = attention_splits(n, qh, kvh, context, PARTIALS, TARGET_BLOCKS);
    let mut token_seq = Vec::new();
    let mut positions = Vec::new();
    for q in 0..seqs as i32 {
        for t in 0..tokens {
            token_seq.push(q);
            positions.push((context - tokens + t) as i32);
        }
    }
    // Keys each query reads (causal), for the bytes and FLOPs.
    let keys: u64 = positions.iter().map(|&p| p as u64 + 1).sum();
    let what = if tokens == 1 {
        format!("decode attention seqs={seqs} context={context}")
    } else {
        format!("prefill attention tokens={tokens}")
    };
    let partials = (n * qh * splits) as usize * (hd as usize + 2) * 4;
    let attention = BenchCase {
        kernel: PagedAttention::NAME,
        label: format!("{} {what} splits={splits}", s.name),
        // K and V once per kv head (GQA groups share them through L2), q and out once.
        bytes: 2 * (seqs as u64 * context as u64 * kv_row as u64 * 2)
            + 2 * 2 * (n * qh * hd) as u64,
        flops: 4 * keys * (qh * hd) as u64,
        buffers: vec![
            ((n * qh * hd) as usize * 2, 0),
            (partials, 0),
            // The split merge's counters: zero, and left at zero by every launch.
            ((n * kvh) as usize * 4, 0),
            ((n * qh * hd) as usize * 2, 0x3C),
            (cache, 0x3C),
            (cache, 0x3C),
        ],
        uploads: vec![
            i32_bytes(&tables),
            i32_bytes(&token_seq),
            i32_bytes(&positions),
        ],
        library_gemm: None,
        build: Box::new(move |p| {
            launch_of(PagedAttention {
                out: p[0],
                partials: p[1],
                counters: p[2],
                q: p[3],
                k_cache: p[4],
                v_cache: p[5],
                block_tables: p[6],
                token_seq: p[7],
                positions: p[8],
                tokens: n,
                q_heads: qh,
                kv_heads: kvh,
                head_dim: hd,
                block_size: block,
                max_blocks_per_seq: blocks_per_seq,
                keys_per_split,
                splits,
                scale: 1.0 / (hd as f32).sqrt(),
            })
        }),
    };
    let mut out = vec![attention];
    if tokens == 1 {
        // The decode form with the QKV post-processing folded in (the model's decode steps):
        // against the row above plus the qkv-norm+rope+kv-write row of the same token count.
        let slots: Vec<i32> = token_seq
            .iter()
            .zip(&positions)
            .map(|(&q, &p)| q * (blocks_per_seq * block) as i32 + p)
            .collect();
        let heads = qh + 2 * kvh;
        let half_table = (context as usize) * (hd as usize / 2) * 4;
        // The 4-warp form, and where the model may take it (one split, head_dim 64 or 128) the
        // wide form (8 warps a block) on the same arguments.
        let fused = move |p: &[DevicePtr]| PagedAttentionQkv {
            out: p[0],
            partials: p[1],
            counters: p[2],
            qkv: p[3],
            k_cache: p[4],
            v_cache: p[5],
            q_norm: p[6],
            k_norm: p[7],
            cos: p[8],
            sin: p[9],
            block_tables: p[10],
            token_seq: p[11],
            positions: p[12],
            slots: p[13],
            tokens: n,
            q_heads: qh,
            kv_heads: kvh,
            head_dim: hd,
            block_size: block,
            max_blocks_per_seq: blocks_per_seq,
            keys_per_split,
            splits,
            max_position: context,
            scale: 1.0 / (hd as f32).sqrt(),
            eps: 1e-6,
        };
        let wide = splits == 1 && PagedAttentionQkv::wide_takes_head_dim(hd);
        for form in [false, true] {
            if form && !wide {
                continue;
            }
            let (kernel, suffix) = PagedAttentionQkv::form(form);
            out.push(BenchCase {
                kernel,
                label: format!(
                    "{} {what} with qk-norm+rope+kv-write{suffix} splits={splits}",
                    s.name
                ),
                bytes: 2 * (seqs as u64 * context as u64 * kv_row as u64 * 2)
                    + 2 * (n * heads * hd) as u64
                    + 2 * (n * qh * hd) as u64,
                flops: 4 * keys * (qh * hd) as u64,
                buffers: vec![
                    ((n * qh * hd) as usize * 2, 0),
                    (partials, 0),
                    ((n * kvh) as usize * 4, 0),
                    ((n * heads * hd) as usize * 2, 0x3C),
                    (cache, 0x3C),
                    (cache, 0x3C),
                    (hd as usize * 2, 0x3F),
                    (hd as usize * 2, 0x3F),
                    (half_table, 0x3C),
                    (half_table, 0x3C),
                ],
                uploads: vec![
                    i32_bytes(&tables),
                    i32_bytes(&token_seq),
                    i32_bytes(&positions),
                    i32_bytes(&slots),
                ],
                library_gemm: None,
                build: Box::new(move |p| {
                    let k = fused(p);
                    (k.launch_config_of(form), k.args())
                }),
            });
        }
    }
    if tokens > 1 && PrefillAttention::supports_head_dim(hd) {
        // Version 1 on its tiles of 64; version 2 on its tiles of 128 and on tiles of 64 (twice
        // the blocks, each warp's second m-tile idle: the choice for short prompts); version 3
        // (head_dim 128) on tiles of 128 and 64.
        let tiles64 = prefill_attention_tiles(&token_seq, &positions);
        let tiles128 =
            prefill_attention_tiles_of(&token_seq, &positions, PrefillAttentionV2::TILE_TOKENS);
        let mut versions = vec![
            (1, tiles64.clone()),
            (2, tiles128.clone()),
            (2, tiles64.clone()),
        ];
        if PrefillAttentionV3::supports_head_dim(hd) {
            versions.extend([(3, tiles128), (3, tiles64)]);
        }
        for (version, tiles) in versions {
            let num_tiles = tiles.len() as u32;
            let max = tiles.iter().map(|t| t[3]).max().unwrap_or(0);
            let (kernel, label) = match version {
                1 => (
                    PrefillAttention::NAME,
                    format!("{} {what} (tensor cores, {num_tiles} tiles)", s.name),
                ),
                2 => (
                    PrefillAttentionV2::NAME,
                    format!(
                        "{} {what} (tensor cores v2, {num_tiles} tiles of <={max})",
                        s.name
                    ),
                ),
                _ => (
                    PrefillAttentionV3::NAME,
                    format!("{} {what} (wgmma v3, {num_tiles} tiles of <={max})", s.name),
                ),
            };
            out.push(BenchCase {
                kernel,
                label,
                bytes: 2 * (seqs as u64 * context as u64 * kv_row as u64 * 2)
                    + 2 * 2 * (n * qh * hd) as u64,
                flops: 4 * keys * (qh * hd) as u64,
                buffers: vec![
                    ((n * qh * hd) as usize * 2, 0),
                    ((n * qh * hd) as usize * 2, 0x3C),
                    (cache, 0x3C),
                    (cache, 0x3C),
                ],
                uploads: vec![i32_bytes(&tables), i32_bytes(&tiles.concat())],
                library_gemm: None,
                build: Box::new(move |p| {
                    let v1 = PrefillAttention {
                        out: p[0],
                        q: p[1],
                        k_cache: p[2],
                        v_cache: p[3],
                        block_tables: p[4],
                        tiles: p[5],
                        num_tiles,
                        q_heads: qh,
                        kv_heads: kvh,
                        head_dim: hd,
                        block_size: block,
                        max_blocks_per_seq: blocks_per_seq,
                        scale: 1.0 / (hd as f32).sqrt(),
                    };
                    match version {
                        1 => launch_of(v1),
                        2 => launch_of(PrefillAttentionV2::from(v1)),
                        _ => launch_of(PrefillAttentionV3::from(v1)),
                    }
                }),
            });
        }
    }
    out
}

/// The fused qk-norm + RoPE + KV-cache write after the QKV product, for `tokens` tokens at the
/// last positions of a table of at least 4096 rows (Qwen3 shapes: both norms on). The memory
/// floor: the QKV rows read and written once, each token's cos/sin rows, positions and slots.
fn qkv_post_case(s: &Shape, tokens: u32) -> BenchCase {
    let (qh, kvh, hd) = (s.q_heads, s.kv_heads, s.head_dim);
    let heads = u64::from(qh + 2 * kvh);
    let t = tokens as usize;
    let max_position = tokens.max(4096);
    let positions: Vec<i32> = (max_position - tokens..max_position)
        .map(|p| p as i32)
        .collect();
    let slots: Vec<i32> = (0..tokens as i32).collect();
    let table = max_position as usize * hd as usize / 2 * 4;
    let what = if tokens == 1 { "decode" } else { "prefill" };
    BenchCase {
        kernel: QkvRopeKvWrite::NAME,
        label: format!("{} qk-norm+rope+kv-write {what} tokens={tokens}", s.name),
        bytes: u64::from(tokens) * (2 * heads * u64::from(hd) * 2 + u64::from(hd) * 4 + 8)
            + 2 * u64::from(hd) * 2,
        flops: 6 * u64::from(tokens) * u64::from(qh + kvh) * u64::from(hd),
        buffers: vec![
            (t * (qh * hd) as usize * 2, 0),
            (t * (kvh * hd) as usize * 2, 0),
            (t * (kvh * hd) as usize * 2, 0),
            (t * heads as usize * hd as usize * 2, 0x3C),
            (hd as usize * 2, 0x3C),
            (hd as usize * 2, 0x3C),
            (table, 0x3C),
            (table, 0x3C),
        ],
        uploads: vec![i32_bytes(&positions), i32_bytes(&slots)],
        library_gemm: None,
        build: Box::new(move |p| {
            launch_of(QkvRopeKvWrite {
                q_out: p[0],
                k_cache: p[1],
                v_cache: p[2],
                qkv: p[3],
                q_norm: p[4],
                k_norm: p[5],
                cos: p[6],
                sin: p[7],
                positions: p[8],
                slots: p[9],
                tokens,
                q_heads: qh,
                kv_heads: kvh,
                head_dim: hd,
                rotary_dim: hd,
                max_position,
                eps: 1e-6,
                weight_offset: 0.0,
            })
        }),
    }
}

/// The token embedding gather: `tokens` rows of the bf16 table widened into the f32 residual
/// stream (ids spread over the vocabulary).
fn embedding_case(s: &Shape, tokens: u32) -> BenchCase {
    let (h, vocab) = (s.hidden, s.vocab);
    let ids: Vec<i32> = (0..tokens)
        .map(|t| ((u64::from(t) * 7919 + 13) % u64::from(vocab)) as i32)
        .collect();
    BenchCase {
        kernel: Embedding::NAME,
        label: format!("{} embedding tokens={tokens}", s.name),
        bytes: tokens as u64 * (h as u64 * (2 + 4) + 4),
        // One widening per element.
        flops: tokens as u64 * h as u64,
        buffers: vec![
            ((tokens * h) as usize * 4, 0),
            (vocab as usize * h as usize * 2, 0x3C),
        ],
        uploads: vec![bytemuck::cast_slice(&ids).to_vec()],
        library_gemm: None,
        build: Box::new(move |p| {
            launch_of(Embedding {
                out: p[0],
                table: p[1],
                ids: p[2],
                tokens,
                hidden: h,
                vocab,
            })
        }),
    }
}

fn norm_case(s: &Shape, rows: u32) -> BenchCase {
    let h = s.hidden;
    BenchCase {
        kernel: AddRmsNorm::NAME,
        label: format!("{} add+rmsnorm rows={rows}", s.name),
        bytes: rows as u64 * h as u64 * (4 + 4 + 2 + 2),
        flops: 4 * rows as u64 * h as u64,
        buffers: vec![
            ((rows * h) as usize * 2, 0),
            ((rows * h) as usize * 4, 0),
            ((rows * h) as usize * 2, 0x3C),
            (h as usize * 2, 0x3C),
        ],
        uploads: vec![],
        library_gemm: None,
        build: Box::new(move |p| {
            launch_of(AddRmsNorm {
                out: p[0],
                residual: p[1],
                input: p[2],
                weight: p[3],
                rows,
                cols: h,
                eps: 1e-6,
                weight_offset: 0.0,
            })
        }),
    }
}

fn silu_case(s: &Shape, tokens: u32) -> BenchCase {
    let i = s.inter;
    BenchCase {
        kernel: SiluMul::NAME,
        label: format!("{} silu*mul tokens={tokens}", s.name),
        bytes: tokens as u64 * i as u64 * 6,
        flops: 5 * tokens as u64 * i as u64,
        buffers: vec![
            ((tokens * i) as usize * 2, 0),
            ((tokens * i) as usize * 4, 0x3C),
        ],
        uploads: vec![],
        library_gemm: None,
        build: Box::new(move |p| {
            launch_of(SiluMul {
                out: p[0],
                gate_up: p[1],
                tokens,
                inter: i,
            })
        }),
    }
}

/// The device-side argmax of f32 logit rows (greedy decode).
fn argmax_case(s: &Shape, rows: u32) -> BenchCase {
    let v = s.vocab;
    BenchCase {
        kernel: ArgmaxF32::NAME,
        label: format!("{} argmax rows={rows}", s.name),
        bytes: rows as u64 * v as u64 * 4,
        flops: rows as u64 * v as u64,
        buffers: vec![
            (rows as usize * 4, 0),
            (rows as usize * v as usize * 4, 0x3C),
            // Zero, as the engine keeps it between launches.
            (argmax_scratch_bytes(rows as usize), 0),
        ],
        uploads: vec![],
        library_gemm: None,
        build: Box::new(move |p| {
            launch_of(ArgmaxF32 {
                out: p[0],
                logits: p[1],
                rows,
                cols: v,
                scratch: p[2],
            })
        }),
    }
}

/// `phases - 1` grid barriers over `blocks` blocks, one per SM (grid_barrier.cu): the time per
/// barrier of a persistent decode kernel (docs/persistent-decode.md) is the row's time over
/// `phases - 1`. Bytes: the words each block writes and reads, a u32 each per phase.
fn grid_barrier_case(s: &Shape, blocks: u32, phases: u32) -> BenchCase {
    BenchCase {
        kernel: GridBarrier::NAME,
        label: format!(
            "{} grid barrier x{} blocks={blocks}",
            s.name,
            phases.saturating_sub(1)
        ),
        bytes: 8 * blocks as u64 * phases as u64,
        flops: phases as u64,
        // The sync words zero, as the kernel leaves the count between launches.
        buffers: vec![
            (8, 0),
            (2 * blocks as usize * 4, 0),
            (blocks as usize * 4, 0),
        ],
        uploads: vec![],
        library_gemm: None,
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

/// The decode path's kernels at batch 1 (and the GEMV at batch 8), decode attention at several
/// contexts, and the prefill GEMMs and attention at `prefill_tokens`, for one model shape; last,
/// the FP8 KV cache's decode attention and the FP8-weight decode products ([`fp8`]).
pub fn model_cases(s: &Shape, prefill_tokens: &[u32]) -> Vec<BenchCase> {
    let (h, i) = (s.hidden, s.inter);
    let (qd, kvd) = (s.q_heads * s.head_dim, s.kv_heads * s.head_dim);
    let mut out = Vec::new();
    // The GEMV rows at the model's grid (capped at the resident blocks), and at batch 1 also at
    // one block per column group (uncapped), to measure the cap.
    for m in [1u32, 8] {
        for (what, n, k) in [
            ("q_proj", qd, h),
            ("qkv_proj", qd + 2 * kvd, h),
            ("k_proj", kvd, h),
            ("o_proj", h, qd),
            ("gate_up", 2 * i, h),
            ("gate_up+silu*mul", 2 * i, h),
            ("down", h, i),
            ("lm_head", s.vocab, h),
        ] {
            let case = |capped: bool| {
                let case = match what {
                    "gate_up+silu*mul" => gemv_swiglu_case(s, m, i, h),
                    _ => gemv_case(s, what, m, n, k, what == "lm_head"),
                };
                if capped {
                    engine_grid(case, m, n)
                } else {
                    let mut case = case;
                    case.label = format!("{} (uncapped grid)", case.label);
                    case
                }
            };
            let engine = case(true);
            let capped = launch_grid(&engine) != launch_grid(&case(false));
            out.push(engine);
            if m == 1 && capped {
                out.push(case(false));
            }
        }
    }
    // The batch-1 products the model runs through the staged entries.
    for (what, n, k, swiglu) in [
        ("qkv_proj", qd + 2 * kvd, h, false),
        ("o_proj", h, qd, false),
        ("gate_up+silu*mul", 2 * i, h, true),
        ("down", h, i, false),
    ] {
        if gemv_stages(1, n, k) {
            out.push(engine_grid(
                gemv_staged_case(s, what, 1, n, k, swiglu),
                1,
                n,
            ));
        }
    }
    // The batch-1 products the bulk-copy stream takes (the tuning's `gemv_stream`).
    for (what, n, k) in [
        ("qkv_proj", qd + 2 * kvd, h),
        ("o_proj", h, qd),
        ("down", h, i),
    ] {
        if gemv_stream_fits(1, n, k) {
            out.push(gemv_stream_case(s, what, n, k, false));
        }
    }
    if gemv_stream_fits(1, s.vocab, h) {
        out.push(gemv_stream_case(s, "lm_head", s.vocab, h, true));
    }
    if gemv_stream_fits(1, i, h) {
        let mut case = gemv_swiglu_case(s, 1, i, h);
        case.label = format!("{} (stream)", case.label);
        case.kernel = GemvSwigluStream::NAME;
        case.build = Box::new(move |p| {
            launch_of(GemvSwigluStream {
                out: p[0],
                a: p[1],
                w: p[2],
                m: 1,
                inter: i,
                k: h,
                prewait: GEMV_STREAM_STAGES,
                evict_first: 0,
            })
        });
        out.push(case);
    }
    // The same two after a residual add + RMSNorm, the norm in the stream's launch
    // (the tuning's `gemv_stream_norm`, where the stream takes the product).
    for (what, n, swiglu) in [
        ("qkv_proj", qd + 2 * kvd, false),
        ("gate_up+silu*mul", 2 * i, true),
    ] {
        let columns = if swiglu { n / 2 } else { n };
        if gemv_stream_fits(1, columns, h) {
            out.push(gemv_stream_norm_case(s, what, n, h, swiglu));
        }
    }
    // The batch-1 products after a residual add + RMSNorm, which the model runs through the
    // normalising entries.
    for (what, n, swiglu) in [
        ("qkv_proj", qd + 2 * kvd, false),
        ("gate_up+silu*mul", 2 * i, true),
    ] {
        if gemv_norm_fits(1, n, h) {
            out.push(gemv_norm_case(s, what, 1, n, h, swiglu));
        }
    }
    // The batch-1 GEMV at the other column splits than gemv_columns_per_block's (1 to 8 columns
    // per block: 8 to 1 warps on each column's K), to measure that rule; uncapped, one block per
    // column group at that split, so set them against the "(uncapped grid)" rows.
    for (what, n, k) in [
        ("qkv_proj", qd + 2 * kvd, h),
        ("o_proj", h, qd),
        ("gate_up", 2 * i, h),
        ("down", h, i),
    ] {
        for columns in [1u32, 2, 4, 8] {
            if columns != gemv_columns_per_block(1, n, k) {
                out.push(gemv_split_case(s, what, n, k, columns));
            }
        }
        // At the resident blocks where that changes the split (`gemv_grid_mode=resplit`).
        let grid = launch_grid(&gemv_case(s, what, 1, n, k, false));
        let resplit = |mode| gemv_launch_grid(1, n, grid, GEMV_RESIDENT_BLOCKS, mode);
        if resplit(GemvGridMode::Resplit) != resplit(GemvGridMode::Same) {
            out.push(gemv_resident_case(s, what, n, k));
        }
    }
    out.push(embedding_case(s, 1));
    out.push(norm_case(s, 1));
    out.push(qkv_post_case(s, 1));
    out.push(silu_case(s, 1));
    out.push(argmax_case(s, 1));
    out.push(argmax_case(s, 64));
    out.push(grid_barrier_case(s, GEMV_RESIDENT_BLOCKS / 3, 1001));
    // 160 and 256 keys: one split (the harness's batch-1 decode contexts are 32 to 288 keys, 160
    // on average, where the fused attention costs about 7.5 us a layer in the model).
    for context in [160u32, 256, 1024, 8192] {
        out.extend(attention_cases(s, 1, 1, context));
    }
    out.extend(attention_cases(s, 64, 1, 1024));
    // Batched decode through the library GEMM; at m = 8 beside the GEMV rows above, to choose
    // the engine's GEMV row limit by measurement.
    for m in [8u32, 16, 64] {
        if m == 8 {
            out.push(library_gemm_case(s, "qkv_proj", m, qd + 2 * kvd, h));
            out.push(library_gemm_case(s, "o_proj", m, h, qd));
            out.push(library_lm_head_case(s, m));
        }
        out.push(library_gemm_case(s, "gate_up", m, 2 * i, h));
        out.push(library_gemm_case(s, "down", m, h, i));
    }
    for &t in prefill_tokens {
        out.push(gemm_case(s, "q_proj", t, qd, h));
        out.push(gemm_case(s, "gate_up", t, 2 * i, h));
        out.push(gemm_case(s, "down", t, h, i));
        out.push(library_gemm_case(s, "q_proj", t, qd, h));
        out.push(library_gemm_case(s, "gate_up", t, 2 * i, h));
        out.push(library_gemm_case(s, "down", t, h, i));
        out.extend(attention_cases(s, 1, t, t));
        out.push(embedding_case(s, t));
        out.push(norm_case(s, t));
        out.push(qkv_post_case(s, t));
        out.push(silu_case(s, t));
    }
    // The FP8 KV cache's decode attention beside the bf16 one (issue 32: at 32k keys batch 1 and
    // at batch 64), after every other row so that earlier rows keep their order.
    for (seqs, context) in [(1u32, 32768u32), (64, 4096)] {
        if seqs == 1 {
            out.extend(attention_cases(s, seqs, 1, context));
        }
        out.push(fp8_decode_attention_case(s, seqs, context));
    }
    // The FP8-weight decode products beside torch._scaled_mm's rows (issue 32), last for the same
    // reason.
    out.extend(fp8::fp8_product_cases(s));
    // The FP8 prefill product's launches (issue 32 part 2) at batch 64 and the prefill rows,
    // last for the same reason.
    let fp8_rows: Vec<u32> = std::iter::once(64)
        .chain(prefill_tokens.iter().copied())
        .collect();
    out.extend(fp8::fp8_gemm_cases(s, &fp8_rows));
    out
}

/// [`attention_cases`]' decode row over an FP8 cache (`paged_attention_fp8`: e4m3 keys and
/// values, half the bytes), split as the model splits it.
fn fp8_decode_attention_case(s: &Shape, seqs: u32, context: u32) -> BenchCase {
    let block = 16u32;
    let blocks_per_seq = context.div_ceil(block);
    let tables: Vec<i32> = (0..seqs * blocks_per_seq).map(|b| b as i32).collect();
    let kv_row = (s.kv_heads * s.head_dim) as usize;
    let cache = (seqs * blocks_per_seq * block) as usize * kv_row;
    let (qh, kvh, hd) = (s.q_heads, s.kv_heads, s.head_dim);
    let n = seqs;
    let (keys_per_split, splits) = attention_splits(n, qh, kvh, context, PARTIALS, TARGET_BLOCKS);
    let token_seq: Vec<i32> = (0..seqs as i32).collect();
    let positions: Vec<i32> = vec![(context - 1) as i32; seqs as usize];
    let partials = (n * qh * splits) as usize * (hd as usize + 2) * 4;
    BenchCase {
        kernel: PagedAttentionFp8::NAME,
        label: format!(
            "{} decode attention seqs={seqs} context={context} splits={splits} (FP8 KV)",
            s.name
        ),
        // K and V (one byte an element) once per kv head, q and out once.
        bytes: 2 * (seqs as u64 * context as u64 * kv_row as u64) + 2 * 2 * (n * qh * hd) as u64,
        flops: 4 * (seqs as u64 * context as u64) * (qh * hd) as u64,
        buffers: vec![
            ((n * qh * hd) as usize * 2, 0),
            (partials, 0),
            ((n * kvh) as usize * 4, 0),
            ((n * qh * hd) as usize * 2, 0x3C),
            // 0x3C is e4m3 1.5.
            (cache, 0x3C),
            (cache, 0x3C),
        ],
        uploads: vec![
            i32_bytes(&tables),
            i32_bytes(&token_seq),
            i32_bytes(&positions),
        ],
        library_gemm: None,
        build: Box::new(move |p| {
            launch_of(PagedAttentionFp8::of(
                &PagedAttention {
                    out: p[0],
                    partials: p[1],
                    counters: p[2],
                    q: p[3],
                    k_cache: p[4],
                    v_cache: p[5],
                    block_tables: p[6],
                    token_seq: p[7],
                    positions: p[8],
                    tokens: n,
                    q_heads: qh,
                    kv_heads: kvh,
                    head_dim: hd,
                    block_size: block,
                    max_blocks_per_seq: blocks_per_seq,
                    keys_per_split,
                    splits,
                    scale: 1.0 / (hd as f32).sqrt(),
                },
                1.0,
                1.0,
            ))
        }),
    }
}

/// Times every case: `warmup` launches, then `batches` batches of `per_batch` launches between
/// two events; the median batch gives the time per launch.
pub fn run(
    gpu: &dyn GpuBackend,
    cases: &[BenchCase],
    warmup: usize,
    batches: usize,
    per_batch: usize,
) -> Result<Vec<BenchResult>, GpuError> {
    let stream = gpu.default_stream();
    let (start, end) = (gpu.create_event()?, gpu.create_event()?);
    let mut results = Vec::new();
    for case in cases {
        let handle = gpu.kernel(case.kernel)?;
        let mut ptrs = Vec::new();
        for &(bytes, fill) in &case.buffers {
            let p = gpu.alloc(bytes)?;
            gpu.memset(p, fill, bytes, stream)?;
            ptrs.push(p);
        }
        for bytes in &case.uploads {
            let p = gpu.alloc(bytes.len())?;
            gpu.copy_h2d(bytes, p)?;
            ptrs.push(p);
        }
        let (config, args) = (case.build)(&ptrs);
        let op = case.library_gemm.map(|op| GemmOp {
            c: ptrs[0],
            a: ptrs[1],
            w: ptrs[2],
            fp8: op.fp8.map(|_| crate::GemmFp8Scales {
                a: ptrs[3],
                w: ptrs[4],
                tail: ptrs[5],
            }),
            ..op
        });
        let once = || match &op {
            Some(op) => gpu.gemm(op, handle, stream),
            None => gpu.launch(handle, &config, &args, stream),
        };
        for _ in 0..warmup {
            once()?;
        }
        let mut times = Vec::new();
        for _ in 0..batches {
            gpu.record_event(start, stream)?;
            for _ in 0..per_batch {
                once()?;
            }
            gpu.record_event(end, stream)?;
            gpu.synchronize(stream)?;
            times.push(f64::from(gpu.elapsed_ms(start, end)?) * 1e3 / per_batch as f64);
        }
        times.sort_by(f64::total_cmp);
        let us = times[times.len() / 2];
        results.push(BenchResult {
            kernel: case.kernel.function.to_string(),
            label: case.label.clone(),
            us,
            gb_s: case.bytes as f64 / us / 1e3,
            tflop_s: case.flops as f64 / us / 1e6,
        });
        for p in ptrs {
            gpu.free(p)?;
        }
    }
    Ok(results)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::HostBackend;

    #[test]
    fn every_case_launches_on_the_host_backend() {
        // Tiny dimensions so the host references finish quickly; the point is that every case's
        // buffers and arguments are consistent with its kernel's ABI.
        let tiny = Shape {
            name: "tiny",
            hidden: 64,
            inter: 96,
            q_heads: 4,
            kv_heads: 2,
            head_dim: 64,
            vocab: 300,
        };
        let gpu = HostBackend::new(1 << 28);
        let tiny_experts = MoeShape {
            name: "tiny-moe",
            hidden: 64,
            inter: 40,
            experts: 12,
            k: 3,
            activation: metrale_kernels::ops::ExpertActivation::SwiGlu,
        };
        let mut cases = model_cases(&tiny, &[33]);
        cases.extend(moe_cases(&tiny_experts, &[33]));
        cases.extend(moe_cases(
            &MoeShape {
                activation: metrale_kernels::ops::ExpertActivation::Relu2,
                ..tiny_experts
            },
            &[33],
        ));
        // The FP8 stream takes k a multiple of 1024: its rows at a shape where it fits.
        let fp8_tiny = Shape {
            name: "tiny-fp8",
            hidden: 1024,
            inter: 1024,
            q_heads: 8,
            kv_heads: 2,
            head_dim: 128,
            vocab: 300,
        };
        let fp8_rows = fp8::fp8_product_cases(&fp8_tiny);
        assert!(fp8_rows.iter().any(|c| c.label.ends_with(" (stream)")));
        cases.extend(fp8_rows);
        let stream = gpu.default_stream();
        for case in &cases {
            let handle = gpu.kernel(case.kernel).unwrap();
            let mut ptrs = Vec::new();
            for &(bytes, fill) in &case.buffers {
                let p = gpu.alloc(bytes).unwrap();
                gpu.memset(p, fill, bytes, stream).unwrap();
                ptrs.push(p);
            }
            for bytes in &case.uploads {
                let p = gpu.alloc(bytes.len()).unwrap();
                gpu.copy_h2d(bytes, p).unwrap();
                ptrs.push(p);
            }
            let (config, args) = (case.build)(&ptrs);
            gpu.launch(handle, &config, &args, stream)
                .unwrap_or_else(|e| panic!("{}: {e}", case.label));
        }
        assert!(cases.iter().all(|c| c.bytes > 0 && c.flops > 0));
    }

    #[test]
    fn gemv_rows_launch_at_the_models_grid() {
        // Qwen3-8B's batch-1 products have more column groups than resident blocks: their rows
        // launch the capped grid the model launches, and an "(uncapped grid)" row keeps one block
        // per column group for comparison.
        let cases = model_cases(&QWEN3_8B, &[128]);
        let grid = |label: &str| {
            launch_grid(
                cases
                    .iter()
                    .find(|c| c.label == label)
                    .unwrap_or_else(|| panic!("{label}")),
            )
        };
        let mut labels: Vec<_> = cases.iter().map(|c| c.label.as_str()).collect();
        labels.sort_unstable();
        labels.dedup();
        assert_eq!(labels.len(), cases.len(), "labels are unique");
        for what in [
            "qkv_proj m=1 n=6144",
            "gate_up+silu*mul m=1 n=24576",
            "lm_head m=1 n=151936",
        ] {
            let capped = format!("qwen3-8b {what} k=4096");
            assert_eq!(grid(&capped), GEMV_RESIDENT_BLOCKS, "{capped}");
            assert!(grid(&format!("{capped} (uncapped grid)")) > GEMV_RESIDENT_BLOCKS);
        }
        // o_proj: 4096 columns at 8 per block, 512 blocks, capped too.
        assert_eq!(
            grid("qwen3-8b o_proj m=1 n=4096 k=4096"),
            GEMV_RESIDENT_BLOCKS
        );
        // down: one column per block over 4096 blocks, left uncapped; its resplit row takes the
        // resident blocks at 8 columns each.
        assert_eq!(grid("qwen3-8b down m=1 n=4096 k=12288"), 4096);
        assert_eq!(
            grid("qwen3-8b down m=1 n=4096 k=12288 (resident grid of 8 columns per block)"),
            GEMV_RESIDENT_BLOCKS
        );
    }
}
