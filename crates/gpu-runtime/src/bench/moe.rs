// SPDX-License-Identifier: MIT OR Apache-2.0
//! Bench rows of the MoE kernels (`moe.cu`, and `moe_fp8.cu`'s FP8 decode launches) at a sparse
//! model's expert shapes.
//!
//! Routing is uploaded, not filled: row `r`'s slot `s` takes expert `(r * k + s) % experts`, so a
//! batch of `rows` touches `min(rows * k, experts)` distinct experts, every one once where it can
//! (the decode rows' bytes are those experts' weights: the memory floor the issue sets the decode
//! step against).

use metrale_core::DevicePtr;
use metrale_kernels::KernelAbi;
use metrale_kernels::ops::{
    ExpertActivation, MoeCombine, MoeGemmDown, MoeGemmRelu2, MoeGemmSwiglu, MoeGemvDown,
    MoeGemvFp8Down, MoeGemvFp8Relu2, MoeGemvFp8Swiglu, MoeGemvRelu2, MoeGemvSwiglu, MoeGroup,
    MoeGroupedMmaDown, MoeGroupedMmaRelu2, MoeGroupedMmaSwiglu, MoeRoute, MoeRouter, MoeScoring,
    MoeWgmmaDown, MoeWgmmaRelu2, MoeWgmmaSwiglu, group_by_expert,
};

use super::{BenchCase, i32_bytes, launch_of};

/// A sparse MLP's dimensions.
#[derive(Clone, Copy, Debug)]
pub struct MoeShape {
    /// Name used in labels.
    pub name: &'static str,
    /// Hidden size.
    pub hidden: u32,
    /// Each expert's width (`moe_intermediate_size`).
    pub inter: u32,
    /// Routed experts.
    pub experts: u32,
    /// Experts a token takes.
    pub k: u32,
    /// The experts' first product: SwiGLU (gate|up) or squared ReLU (up only).
    pub activation: ExpertActivation,
}

/// Qwen3-30B-A3B's experts.
pub const QWEN3_30B_A3B_EXPERTS: MoeShape = MoeShape {
    name: "qwen3-30b-a3b",
    hidden: 2048,
    inter: 768,
    experts: 128,
    k: 8,
    activation: ExpertActivation::SwiGlu,
};

/// NVIDIA-Nemotron-3-Nano-30B-A3B's experts (squared ReLU, no gate product; its router sigmoid).
pub const NEMOTRON_3_NANO_EXPERTS: MoeShape = MoeShape {
    name: "nemotron-3-nano-30b-a3b",
    hidden: 2688,
    inter: 1856,
    experts: 128,
    k: 6,
    activation: ExpertActivation::Relu2,
};

impl MoeShape {
    /// Weight rows an expert's first product reads per activation column.
    fn first_rows(&self) -> u64 {
        self.activation.rows_per_column() as u64
    }

    /// The first product's label.
    fn first_label(&self) -> &'static str {
        match self.activation {
            ExpertActivation::SwiGlu => "gate_up+silu*mul",
            ExpertActivation::Relu2 => "up+relu2",
        }
    }
}

/// The uploaded routing of `rows` rows: `(r * k + s) % experts`.
fn spread_ids(s: &MoeShape, rows: u32) -> Vec<i32> {
    (0..rows * s.k).map(|a| (a % s.experts) as i32).collect()
}

/// Distinct experts `rows` rows of [`spread_ids`] touch.
fn touched(s: &MoeShape, rows: u32) -> u64 {
    u64::from((rows * s.k).min(s.experts))
}

/// The shape's router scoring: softmax for the SwiGLU models, sigmoid for Nemotron-H.
fn scoring(s: &MoeShape) -> MoeScoring {
    match s.activation {
        ExpertActivation::SwiGlu => MoeScoring::Softmax,
        ExpertActivation::Relu2 => MoeScoring::Sigmoid,
    }
}

/// The router in one launch at a decode batch: bytes are the router's weight, the input rows,
/// the logits written and read back, the choices.
fn router_case(s: &MoeShape, rows: u32) -> BenchCase {
    let (h, e, k, scoring) = (s.hidden, s.experts, s.k, scoring(s));
    BenchCase {
        kernel: MoeRouter::NAME,
        label: format!("{} moe router rows={rows} experts={e} k={k}", s.name),
        bytes: u64::from(e) * u64::from(h) * 2
            + u64::from(rows) * (u64::from(h) * 2 + u64::from(e) * 8 + u64::from(k) * 8),
        flops: 2 * u64::from(rows) * u64::from(e) * u64::from(h),
        buffers: vec![
            (rows as usize * k as usize * 4, 0),
            (rows as usize * k as usize * 4, 0),
            (rows as usize * e as usize * 4, 0),
            (rows as usize * 4, 0),
            (4, 0),
            (rows as usize * h as usize * 2, 0x3C),
            (e as usize * h as usize * 2, 0x3C),
        ],
        uploads: vec![],
        library_gemm: None,
        build: Box::new(move |p| {
            launch_of(MoeRouter {
                topk_ids: p[0],
                topk_weights: p[1],
                logits: p[2],
                shared_logit: p[3],
                counter: p[4],
                x: p[5],
                w: p[6],
                shared_gate_w: DevicePtr::NULL,
                correction_bias: DevicePtr::NULL,
                rows,
                experts: e,
                k,
                scoring,
                renormalize: 1,
                scale: 1.0,
                hidden: h,
            })
        }),
    }
}

fn route_case(s: &MoeShape, rows: u32) -> BenchCase {
    let (e, k, scoring) = (s.experts, s.k, scoring(s));
    BenchCase {
        kernel: MoeRoute::NAME,
        label: format!("{} moe route rows={rows} experts={e} k={k}", s.name),
        bytes: u64::from(rows) * (u64::from(e) * 4 + u64::from(k) * 8),
        flops: u64::from(rows) * u64::from(e) * (4 + u64::from(k)),
        buffers: vec![
            (rows as usize * k as usize * 4, 0),
            (rows as usize * k as usize * 4, 0),
            (rows as usize * e as usize * 4, 0x3C),
        ],
        uploads: vec![],
        library_gemm: None,
        build: Box::new(move |p| {
            launch_of(MoeRoute {
                topk_ids: p[0],
                topk_weights: p[1],
                logits: p[2],
                correction_bias: DevicePtr::NULL,
                rows,
                experts: e,
                k,
                scoring,
                renormalize: 1,
                scale: 1.0,
            })
        }),
    }
}

/// The decode first launch (gate|up, or up alone) at `rows` rows: bytes are the touched experts'
/// first-product weights, the input rows and the activations.
fn gemv_first_case(s: &MoeShape, rows: u32) -> BenchCase {
    let (h, i, e, k, activation) = (s.hidden, s.inter, s.experts, s.k, s.activation);
    let (n, r) = (u64::from(rows * k), s.first_rows());
    BenchCase {
        kernel: match activation {
            ExpertActivation::SwiGlu => MoeGemvSwiglu::NAME,
            ExpertActivation::Relu2 => MoeGemvRelu2::NAME,
        },
        label: format!(
            "{} moe {} m={rows} k={k} inter={i} hidden={h}",
            s.name,
            s.first_label()
        ),
        bytes: touched(s, rows) * r * u64::from(i) * u64::from(h) * 2
            + u64::from(rows) * u64::from(h) * 2
            + n * u64::from(i) * 2,
        flops: 2 * n * r * u64::from(i) * u64::from(h),
        buffers: vec![
            ((n * u64::from(i)) as usize * 2, 0),
            (rows as usize * h as usize * 2, 0x3C),
            (e as usize * r as usize * i as usize * h as usize * 2, 0x3C),
        ],
        uploads: vec![i32_bytes(&spread_ids(s, rows))],
        library_gemm: None,
        build: Box::new(move |p| {
            let args = MoeGemvSwiglu {
                shared_act: DevicePtr::NULL,
                shared_w: DevicePtr::NULL,
                shared_inter: 0,
                act: p[0],
                x: p[1],
                w: p[2],
                ids: p[3],
                rows,
                k,
                experts: e,
                inter: i,
                hidden: h,
            };
            match activation {
                ExpertActivation::SwiGlu => launch_of(args),
                ExpertActivation::Relu2 => launch_of(MoeGemvRelu2::from(args)),
            }
        }),
    }
}

/// The decode down launch with the weighted slot sum at `rows` rows.
fn gemv_down_case(s: &MoeShape, rows: u32) -> BenchCase {
    let (h, i, e, k) = (s.hidden, s.inter, s.experts, s.k);
    let n = u64::from(rows * k);
    BenchCase {
        kernel: MoeGemvDown::NAME,
        label: format!(
            "{} moe down+combine m={rows} k={k} hidden={h} inter={i}",
            s.name
        ),
        bytes: touched(s, rows) * u64::from(h) * u64::from(i) * 2
            + n * u64::from(i) * 2
            + n * 8
            + u64::from(rows) * u64::from(h) * 2,
        flops: 2 * n * u64::from(h) * u64::from(i),
        buffers: vec![
            (rows as usize * h as usize * 2, 0),
            ((n * u64::from(i)) as usize * 2, 0x3C),
            (e as usize * h as usize * i as usize * 2, 0x3C),
            (n as usize * 4, 0x3C),
        ],
        uploads: vec![i32_bytes(&spread_ids(s, rows))],
        library_gemm: None,
        build: Box::new(move |p| {
            launch_of(MoeGemvDown {
                shared_act: DevicePtr::NULL,
                shared_w: DevicePtr::NULL,
                shared_inter: 0,
                out: p[0],
                act: p[1],
                w: p[2],
                weights: p[3],
                ids: p[4],
                shared: DevicePtr::NULL,
                shared_gate: DevicePtr::NULL,
                rows,
                k,
                experts: e,
                hidden: h,
                inter: i,
            })
        }),
    }
}

/// Which kernels a grouped step's two products take.
#[derive(Clone, Copy, PartialEq)]
enum Grouped {
    /// The WMMA tiles (`moe_gemm_*`): prefill, from `moe_tensor_core_min_rows` tokens.
    Tiles,
    /// The mma.sync weight streams (`moe_grouped_mma_*`): decode batches below that.
    Mma,
}

/// A grouped step at `tokens` rows: the grouping, both grouped products (over a grouping made on
/// the host and uploaded) in `form`, and the combine.
fn grouped_cases(s: &MoeShape, tokens: u32, form: Grouped) -> Vec<BenchCase> {
    let (h, i, e, k, activation) = (s.hidden, s.inter, s.experts, s.k, s.activation);
    let r = s.first_rows();
    let n = tokens * k;
    let n64 = u64::from(n);
    let ids = spread_ids(s, tokens);
    let (offsets, sorted) = group_by_expert(&ids, e as usize);
    let expert_bytes = touched(s, tokens) * u64::from(i) * u64::from(h) * 2;
    let (offsets_up, sorted_up) = (i32_bytes(&offsets), i32_bytes(&sorted));
    vec![
        BenchCase {
            kernel: MoeGroup::NAME,
            label: format!("{} moe group tokens={tokens} k={k} experts={e}", s.name),
            bytes: n64 * 8 + (u64::from(e) + 1) * 4,
            flops: n64,
            buffers: vec![((e as usize + 1) * 4, 0), (n as usize * 4, 0)],
            uploads: vec![i32_bytes(&ids)],
            library_gemm: None,
            build: Box::new(move |p| {
                launch_of(MoeGroup {
                    offsets: p[0],
                    sorted: p[1],
                    ids: p[2],
                    n,
                    experts: e,
                })
            }),
        },
        BenchCase {
            // The tiles as the engine runs them: on warpgroup MMA (these shapes' widths fit).
            kernel: match (form, activation) {
                (Grouped::Tiles, ExpertActivation::SwiGlu) => MoeWgmmaSwiglu::NAME,
                (Grouped::Tiles, ExpertActivation::Relu2) => MoeWgmmaRelu2::NAME,
                (Grouped::Mma, ExpertActivation::SwiGlu) => MoeGroupedMmaSwiglu::NAME,
                (Grouped::Mma, ExpertActivation::Relu2) => MoeGroupedMmaRelu2::NAME,
            },
            label: format!(
                "{} moe grouped{} {} tokens={tokens}",
                s.name,
                if form == Grouped::Mma { " mma" } else { "" },
                s.first_label()
            ),
            bytes: r * expert_bytes + u64::from(tokens) * u64::from(h) * 2 + n64 * u64::from(i) * 2,
            flops: 2 * n64 * r * u64::from(i) * u64::from(h),
            buffers: vec![
                (n as usize * i as usize * 2, 0),
                (tokens as usize * h as usize * 2, 0x3C),
                (e as usize * r as usize * i as usize * h as usize * 2, 0x3C),
            ],
            uploads: vec![offsets_up.clone(), sorted_up.clone()],
            library_gemm: None,
            build: Box::new(move |p| {
                let args = MoeGemmSwiglu {
                    act: p[0],
                    x: p[1],
                    w: p[2],
                    offsets: p[3],
                    sorted: p[4],
                    k,
                    experts: e,
                    inter: i,
                    hidden: h,
                };
                match (form, activation) {
                    (Grouped::Tiles, ExpertActivation::SwiGlu) => {
                        launch_of(MoeWgmmaSwiglu::from(args))
                    }
                    (Grouped::Mma, ExpertActivation::SwiGlu) => {
                        launch_of(MoeGroupedMmaSwiglu::from(args))
                    }
                    (Grouped::Tiles, ExpertActivation::Relu2) => {
                        launch_of(MoeWgmmaRelu2::from(MoeGemmRelu2::from(args)))
                    }
                    (Grouped::Mma, ExpertActivation::Relu2) => {
                        launch_of(MoeGroupedMmaRelu2::from(MoeGemmRelu2::from(args)))
                    }
                }
            }),
        },
        BenchCase {
            kernel: match form {
                Grouped::Tiles => MoeWgmmaDown::NAME,
                Grouped::Mma => MoeGroupedMmaDown::NAME,
            },
            label: format!(
                "{} moe grouped{} down tokens={tokens}",
                s.name,
                if form == Grouped::Mma { " mma" } else { "" }
            ),
            bytes: expert_bytes + n64 * (u64::from(i) + u64::from(h)) * 2,
            flops: 2 * n64 * u64::from(h) * u64::from(i),
            buffers: vec![
                (n as usize * h as usize * 2, 0),
                (n as usize * i as usize * 2, 0x3C),
                (e as usize * h as usize * i as usize * 2, 0x3C),
            ],
            uploads: vec![offsets_up, sorted_up],
            library_gemm: None,
            build: Box::new(move |p| {
                let args = MoeGemmDown {
                    y: p[0],
                    act: p[1],
                    w: p[2],
                    offsets: p[3],
                    sorted: p[4],
                    experts: e,
                    hidden: h,
                    inter: i,
                };
                match form {
                    Grouped::Tiles => launch_of(MoeWgmmaDown::from(args)),
                    Grouped::Mma => launch_of(MoeGroupedMmaDown::from(args)),
                }
            }),
        },
        BenchCase {
            kernel: MoeCombine::NAME,
            label: format!("{} moe combine tokens={tokens}", s.name),
            bytes: n64 * (u64::from(h) * 2 + 8) + u64::from(tokens) * u64::from(h) * 2,
            flops: 2 * n64 * u64::from(h),
            buffers: vec![
                (tokens as usize * h as usize * 2, 0),
                (n as usize * h as usize * 2, 0x3C),
                (n as usize * 4, 0x3C),
            ],
            uploads: vec![i32_bytes(&ids)],
            library_gemm: None,
            build: Box::new(move |p| {
                launch_of(MoeCombine {
                    out: p[0],
                    y: p[1],
                    weights: p[2],
                    ids: p[3],
                    shared: DevicePtr::NULL,
                    shared_gate: DevicePtr::NULL,
                    rows: tokens,
                    k,
                    experts: e,
                    hidden: h,
                })
            }),
        },
    ]
}

/// The MoE kernels of one sparse MLP: routing and the decode experts at batch 1, 8, 32 and 64,
/// and the prefill path at `prefill_tokens`.
pub fn moe_cases(s: &MoeShape, prefill_tokens: &[u32]) -> Vec<BenchCase> {
    let mut out = Vec::new();
    for rows in [1u32, 8] {
        out.push(router_case(s, rows));
    }
    for rows in [1u32, 8, 32, 64] {
        out.push(route_case(s, rows));
        out.push(gemv_first_case(s, rows));
        out.push(gemv_down_case(s, rows));
        out.push(fp8_first_case(s, rows));
        out.push(fp8_down_case(s, rows));
    }
    // Decode batches from moe_grouped_min_rows: the mma weight streams.
    for t in [16u32, 32, 64, 128] {
        out.push(route_case(s, t));
        out.extend(grouped_cases(s, t, Grouped::Mma));
    }
    for &t in prefill_tokens {
        out.push(route_case(s, t));
        out.extend(grouped_cases(s, t, Grouped::Tiles));
    }
    out
}

/// Bytes of the f32 scales of an FP8 stack of `rows` rows and `cols` columns in 128 x 128 blocks.
fn fp8_scale_bytes(rows: u64, cols: u32) -> u64 {
    rows.div_ceil(128) * u64::from(cols.div_ceil(128)) * 4
}

/// The decode first launch over FP8 experts (128 x 128 blocks, weights e4m3 1.5 and scales about
/// 0.0115 from the 0x3C fill): bytes are the touched experts' e4m3 weights and their scales, the
/// input rows and the activations.
fn fp8_first_case(s: &MoeShape, rows: u32) -> BenchCase {
    let (h, i, e, k, activation) = (s.hidden, s.inter, s.experts, s.k, s.activation);
    let (n, r) = (u64::from(rows * k), s.first_rows());
    let stack_rows = u64::from(e) * r * u64::from(i);
    let touched_rows = touched(s, rows) * r * u64::from(i);
    BenchCase {
        kernel: match activation {
            ExpertActivation::SwiGlu => MoeGemvFp8Swiglu::NAME,
            ExpertActivation::Relu2 => MoeGemvFp8Relu2::NAME,
        },
        label: format!(
            "{} moe fp8 {} m={rows} k={k} inter={i} hidden={h}",
            s.name,
            s.first_label()
        ),
        bytes: touched_rows * u64::from(h)
            + fp8_scale_bytes(touched_rows, h)
            + u64::from(rows) * u64::from(h) * 2
            + n * u64::from(i) * 2,
        flops: 2 * n * r * u64::from(i) * u64::from(h),
        buffers: vec![
            ((n * u64::from(i)) as usize * 2, 0),
            (rows as usize * h as usize * 2, 0x3C),
            ((stack_rows * u64::from(h)) as usize, 0x3C),
            (fp8_scale_bytes(stack_rows, h) as usize, 0x3C),
        ],
        uploads: vec![i32_bytes(&spread_ids(s, rows))],
        library_gemm: None,
        build: Box::new(move |p| {
            let args = MoeGemvFp8Swiglu {
                act: p[0],
                x: p[1],
                w: p[2],
                scales: p[3],
                ids: p[4],
                rows,
                k,
                experts: e,
                inter: i,
                hidden: h,
                row_shift: 7,
            };
            match activation {
                ExpertActivation::SwiGlu => launch_of(args),
                ExpertActivation::Relu2 => launch_of(MoeGemvFp8Relu2::from(args)),
            }
        }),
    }
}

/// The decode down launch over FP8 experts with the weighted slot sum at `rows` rows.
fn fp8_down_case(s: &MoeShape, rows: u32) -> BenchCase {
    let (h, i, e, k) = (s.hidden, s.inter, s.experts, s.k);
    let n = u64::from(rows * k);
    let stack_rows = u64::from(e) * u64::from(h);
    let touched_rows = touched(s, rows) * u64::from(h);
    BenchCase {
        kernel: MoeGemvFp8Down::NAME,
        label: format!(
            "{} moe fp8 down+combine m={rows} k={k} hidden={h} inter={i}",
            s.name
        ),
        bytes: touched_rows * u64::from(i)
            + fp8_scale_bytes(touched_rows, i)
            + n * u64::from(i) * 2
            + n * 8
            + u64::from(rows) * u64::from(h) * 2,
        flops: 2 * n * u64::from(h) * u64::from(i),
        buffers: vec![
            (rows as usize * h as usize * 2, 0),
            ((n * u64::from(i)) as usize * 2, 0x3C),
            ((stack_rows * u64::from(i)) as usize, 0x3C),
            (fp8_scale_bytes(stack_rows, i) as usize, 0x3C),
            (n as usize * 4, 0x3C),
        ],
        uploads: vec![i32_bytes(&spread_ids(s, rows))],
        library_gemm: None,
        build: Box::new(move |p| {
            launch_of(MoeGemvFp8Down {
                out: p[0],
                act: p[1],
                w: p[2],
                scales: p[3],
                weights: p[4],
                ids: p[5],
                shared: DevicePtr::NULL,
                shared_gate: DevicePtr::NULL,
                rows,
                k,
                experts: e,
                hidden: h,
                inter: i,
                row_shift: 7,
            })
        }),
    }
}
