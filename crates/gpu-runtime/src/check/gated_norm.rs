// SPDX-License-Identifier: MIT OR Apache-2.0
//! Parity cases of the output gates (`gated_norm.cu`): the gated RMSNorm at Qwen3-Next's Gated
//! DeltaNet output (32 value heads of 128, one weight shared by every head, the gate after the
//! norm, z read out of the merged qkvz projection's row) for a decode row and a 40-token run; at
//! Nemotron-H's Mamba-2 norm (groups of 1024 and of 512, a weight per group, the gate before the
//! norm); both orders with both weight layouts; ragged widths (below the block's 128 threads, not
//! a multiple of them, above 1024). The sigmoid output gate at Qwen3-Next's attention output (16
//! heads of 256, the gate rows 8192 apart) and at ragged widths and strides.

use metrale_kernels::KernelAbi;
use metrale_kernels::ops::{GateOrder, GatedRmsNorm, SigmoidGateMul};

use super::gated_delta::{f32_normal, input, output};
use super::{Case, OutputKind, Rng, bf16_normal, launch_of, norm_weight};

/// The widths of one gated-norm case.
#[derive(Clone, Copy, Debug)]
struct NormShape {
    rows: u32,
    groups: u32,
    width: u32,
    /// Elements from one row of z to the next.
    z_stride: u32,
    /// 0 (one weight shared by the groups) or `width` (a weight per group).
    weight_group_stride: u32,
    order: GateOrder,
    eps: f32,
    /// `x` in f32 (Mamba-2's recurrence output) instead of bf16.
    x_f32: bool,
}

fn gated_rmsnorm_case(rng: &mut Rng, s: NormShape) -> Case {
    let n = (s.rows * s.groups * s.width) as usize;
    let weight_len = if s.weight_group_stride == 0 {
        s.width
    } else {
        (s.groups - 1) * s.weight_group_stride + s.width
    } as usize;
    Case {
        kernel: GatedRmsNorm::NAME,
        shape: format!(
            "rows={} groups={} width={} z_stride={} weight_group_stride={} order={:?} eps={}{}",
            s.rows,
            s.groups,
            s.width,
            s.z_stride,
            s.weight_group_stride,
            s.order,
            s.eps,
            if s.x_f32 { " x=f32" } else { "" }
        ),
        buffers: vec![
            output(vec![0u8; n * 2].into(), OutputKind::Bf16),
            if s.x_f32 {
                input(f32_normal(rng, n, 1.0))
            } else {
                input(bf16_normal(rng, n, 1.0))
            },
            input(bf16_normal(rng, (s.rows * s.z_stride) as usize, 2.0)),
            input(norm_weight(rng, weight_len).into()),
        ],
        build: Box::new(move |p| {
            launch_of(GatedRmsNorm {
                out: p[0],
                x: p[1],
                z: p[2],
                weight: p[3],
                rows: s.rows,
                groups: s.groups,
                width: s.width,
                z_stride: s.z_stride,
                weight_group_stride: s.weight_group_stride,
                eps: s.eps,
                gate_first: s.order.gate_first(),
                x_f32: u32::from(s.x_f32),
            })
        }),
        gemm: None,
        allowance: None,
    }
}

fn sigmoid_gate_case(rng: &mut Rng, rows: u32, n: u32, gate_stride: u32) -> Case {
    Case {
        kernel: SigmoidGateMul::NAME,
        shape: format!("rows={rows} n={n} gate_stride={gate_stride}"),
        buffers: vec![
            output(bf16_normal(rng, (rows * n) as usize, 1.0), OutputKind::Bf16),
            input(bf16_normal(rng, (rows * gate_stride) as usize, 3.0)),
        ],
        build: Box::new(move |p| {
            launch_of(SigmoidGateMul {
                x: p[0],
                gate: p[1],
                rows,
                n,
                gate_stride,
            })
        }),
        gemm: None,
        allowance: None,
    }
}

/// Every gated-norm and output-gate case, in a fixed order.
pub(super) fn gated_norm_cases(rng: &mut Rng) -> Vec<Case> {
    use GateOrder::{AfterNorm, BeforeNorm};
    let shape = |rows, groups, width, z_stride, weight_group_stride, order, eps| NormShape {
        rows,
        groups,
        width,
        z_stride,
        weight_group_stride,
        order,
        eps,
        x_f32: false,
    };
    let mut out = Vec::new();
    for s in [
        // Qwen3-Next-80B-A3B: z (32 x 128) out of the 12288-element qkvz row.
        shape(1, 32, 128, 12288, 0, AfterNorm, 1e-6),
        shape(40, 32, 128, 12288, 0, AfterNorm, 1e-6),
        shape(3, 32, 128, 4096, 0, AfterNorm, 1e-6),
        // Nemotron-H: 8192 channels in 8 groups of 1024 or 16 of 512, z out of a wider row.
        shape(1, 8, 1024, 8192, 1024, BeforeNorm, 1e-5),
        shape(5, 16, 512, 8192 + 320, 512, BeforeNorm, 1e-5),
        // Each order with the other weight layout.
        shape(3, 4, 512, 2100, 512, AfterNorm, 1e-5),
        shape(2, 3, 128, 384, 0, BeforeNorm, 1e-6),
        // Ragged widths: below the block, not a multiple of it, above 1024.
        shape(4, 3, 37, 111, 37, AfterNorm, 1e-6),
        shape(3, 5, 100, 503, 0, BeforeNorm, 1e-6),
        shape(2, 2, 1500, 3001, 1500, AfterNorm, 1e-5),
    ] {
        out.push(gated_rmsnorm_case(rng, s));
    }
    for (rows, n, gate_stride) in [
        (1u32, 4096u32, 8192u32),
        (40, 4096, 8192),
        (3, 100, 100),
        (5, 1000, 1037),
        (2, 7, 9),
    ] {
        out.push(sigmoid_gate_case(rng, rows, n, gate_stride));
    }
    out
}

/// Mamba-2's gated norm reading the recurrence's f32 output (`x_f32`): Nemotron-H's 8 groups of
/// 1024 for a decode row and a 37-token run, and a ragged shape. Built after every other case.
pub(super) fn gated_norm_f32_input_cases(rng: &mut Rng) -> Vec<Case> {
    [
        (1u32, 8u32, 1024u32, 8192 + 8192 + 2 * 8 * 128 + 128),
        (37, 8, 1024, 8192 + 8192 + 2 * 8 * 128 + 128),
        (3, 5, 100, 503),
    ]
    .into_iter()
    .map(|(rows, groups, width, z_stride)| {
        let s = NormShape {
            rows,
            groups,
            width,
            z_stride,
            weight_group_stride: width,
            order: GateOrder::BeforeNorm,
            eps: 1e-5,
            x_f32: true,
        };
        gated_rmsnorm_case(rng, s)
    })
    .collect()
}
