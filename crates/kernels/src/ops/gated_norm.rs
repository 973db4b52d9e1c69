// SPDX-License-Identifier: MIT OR Apache-2.0
//! The gates around a token mixer's output (`gated_norm.cu`): the gated RMSNorm over groups of
//! channels, and the sigmoid output gate. Their arguments, launch geometry and host references.
//!
//! The gated RMSNorm comes in two gate orders, one entry point with a flag ([`GateOrder`]):
//! Qwen3-Next's Gated DeltaNet normalises each value head's output and then gates it
//! (`Qwen3NextRMSNormGated`), Mamba-2 gates first and normalises the gated value over each group
//! of heads (`MambaRMSNormGated`, [`super::mamba2::gated_rms_norm`]). Every value is widened to
//! f32 and the whole expression rounded to bf16 once.

use metrale_core::{DevicePtr, LaunchConfig};

use super::activation::silu;
use super::blocks_for;
use crate::host::{self, HostError, HostMemory, Kernel, KernelAbi, kernel_args};
use crate::names;

/// Threads per block of [`GatedRmsNorm`] (`GATED_NORM_THREADS`); one block a (row, group), the
/// group's width walked in a loop.
pub const GATED_NORM_THREADS: u32 = 128;
/// Threads per block of [`SigmoidGateMul`], one element a thread.
const GATE_THREADS: u32 = 256;

/// Where the gate `silu(z)` applies in [`GatedRmsNorm`] (its `gate_first` argument).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GateOrder {
    /// `y = x * rsqrt(mean(x^2) + eps) * w * silu(z)`: Qwen3-Next's gated norm.
    AfterNorm,
    /// `u = x * silu(z)`, `y = u * rsqrt(mean(u^2) + eps) * w`: Mamba-2's.
    BeforeNorm,
}

impl GateOrder {
    /// The kernel's `gate_first` flag.
    pub const fn gate_first(self) -> u32 {
        match self {
            GateOrder::AfterNorm => 0,
            GateOrder::BeforeNorm => 1,
        }
    }

    /// The order a `gate_first` flag selects (any nonzero value gates first).
    pub const fn from_gate_first(flag: u32) -> GateOrder {
        if flag == 0 {
            GateOrder::AfterNorm
        } else {
            GateOrder::BeforeNorm
        }
    }
}

kernel_args!(
    /// The gated RMSNorm of every (row, group): `out` is bf16 `[rows, groups * width]`, `x` the
    /// same shape in bf16 or, with `x_f32`, in f32 (Mamba-2's recurrence output, unrounded);
    /// group `g` of row `r` the `width` channels at `g * width`, normalised over those alone and
    /// gated by `z` in the order `gate_first` says ([`GateOrder`]).
    GatedRmsNorm => names::gated_norm::GATED_RMSNORM {
        /// bf16 `[rows, groups * width]`.
        out: DevicePtr,
        /// bf16 `[rows, groups * width]`, or f32 when `x_f32` is nonzero.
        x: DevicePtr,
        /// bf16 gate, element `(r, g, i)` at `r * z_stride + g * width + i`.
        z: DevicePtr,
        /// bf16 weight, element `(g, i)` at `g * weight_group_stride + i`.
        weight: DevicePtr,
        /// Rows (tokens).
        rows: u32,
        /// Groups a row (value heads for Qwen3-Next, norm groups for Mamba-2).
        groups: u32,
        /// Channels a group, the width of the mean.
        width: u32,
        /// Elements from one row of `z` to the next, at least `groups * width`.
        z_stride: u32,
        /// Elements from one group's weight to the next: 0 shares one weight of `width` across
        /// the groups (Qwen3-Next), `width` reads a weight of `groups * width` (Mamba-2).
        weight_group_stride: u32,
        /// Added to the mean square.
        eps: f32,
        /// [`GateOrder::gate_first`]: 0 gates after the norm, nonzero before it.
        gate_first: u32,
        /// Nonzero: `x` is f32 (read as it is), else bf16.
        x_f32: u32,
    }
);

kernel_args!(
    /// The sigmoid output gate, in place: `x[r, i] = bf16(x * sigmoid(gate[r * gate_stride + i]))`
    /// (Qwen3-Next's gated attention, before `o_proj`).
    SigmoidGateMul => names::gated_norm::SIGMOID_GATE_MUL {
        /// bf16 `[rows, n]`, updated.
        x: DevicePtr,
        /// bf16, row `r` at `r * gate_stride`.
        gate: DevicePtr,
        /// Rows (tokens).
        rows: u32,
        /// Elements a row.
        n: u32,
        /// Elements from one row of `gate` to the next, at least `n`.
        gate_stride: u32,
    }
);

/// One group's gated RMSNorm in f32 (the caller rounds once): `x`, `z` and `weight` of the
/// group's `width` channels.
pub fn gated_rms_norm_group(
    x: &[f32],
    z: &[f32],
    weight: &[f32],
    eps: f32,
    order: GateOrder,
) -> Vec<f32> {
    assert!(x.len() == z.len() && x.len() == weight.len());
    let normed: Vec<f32> = match order {
        GateOrder::AfterNorm => x.to_vec(),
        GateOrder::BeforeNorm => x.iter().zip(z).map(|(x, z)| x * silu(*z)).collect(),
    };
    let mean_sq = normed.iter().map(|v| v * v).sum::<f32>() / x.len().max(1) as f32;
    let inv = 1.0 / (mean_sq + eps).sqrt();
    normed
        .iter()
        .zip(weight)
        .zip(z)
        .map(|((v, w), z)| match order {
            GateOrder::AfterNorm => v * inv * w * silu(*z),
            GateOrder::BeforeNorm => v * inv * w,
        })
        .collect()
}

fn bad_args(kernel: metrale_core::KernelName, message: String) -> HostError {
    HostError::BadArgs { kernel, message }
}

/// A bf16 tensor at `ptr + offset` elements.
fn at_bf16(ptr: DevicePtr, offset: usize) -> DevicePtr {
    ptr.offset(offset * std::mem::size_of::<half::bf16>())
}

impl Kernel for GatedRmsNorm {
    fn launch_config(&self) -> LaunchConfig {
        let blocks = u64::from(self.rows) * u64::from(self.groups);
        LaunchConfig::linear(blocks_for(blocks.max(1), 1), GATED_NORM_THREADS)
    }
    fn reference(&self, mem: &mut dyn HostMemory) -> Result<(), HostError> {
        let (rows, groups, width) = (
            self.rows as usize,
            self.groups as usize,
            self.width as usize,
        );
        let (z_stride, w_stride) = (self.z_stride as usize, self.weight_group_stride as usize);
        if z_stride < groups * width {
            return Err(bad_args(
                Self::NAME,
                format!("z_stride {z_stride} < groups * width = {}", groups * width),
            ));
        }
        let order = GateOrder::from_gate_first(self.gate_first);
        let x = if self.x_f32 != 0 {
            host::load::<f32>(mem, self.x, rows * groups * width)?
        } else {
            host::load_bf16(mem, self.x, rows * groups * width)?
        };
        // The weights of every group, as the kernel reads them (shared when the stride is 0).
        let weights = (0..groups)
            .map(|g| host::load_bf16(mem, at_bf16(self.weight, g * w_stride), width))
            .collect::<Result<Vec<_>, _>>()?;
        let mut out = Vec::with_capacity(x.len());
        for r in 0..rows {
            let z = host::load_bf16(mem, at_bf16(self.z, r * z_stride), groups * width)?;
            for (g, w) in weights.iter().enumerate() {
                let at = g * width..(g + 1) * width;
                let xg = &x[r * groups * width..][at.clone()];
                out.extend(gated_rms_norm_group(xg, &z[at], w, self.eps, order));
            }
        }
        host::store_bf16(mem, self.out, &out)
    }
}

impl Kernel for SigmoidGateMul {
    fn launch_config(&self) -> LaunchConfig {
        let n = u64::from(self.rows) * u64::from(self.n);
        LaunchConfig::linear(blocks_for(n.max(1), GATE_THREADS), GATE_THREADS)
    }
    fn reference(&self, mem: &mut dyn HostMemory) -> Result<(), HostError> {
        let (rows, n, stride) = (
            self.rows as usize,
            self.n as usize,
            self.gate_stride as usize,
        );
        if stride < n {
            return Err(bad_args(
                Self::NAME,
                format!("gate_stride {stride} < n = {n}"),
            ));
        }
        let mut x = host::load_bf16(mem, self.x, rows * n)?;
        for (r, row) in x.chunks_exact_mut(n.max(1)).enumerate() {
            let gate = host::load_bf16(mem, at_bf16(self.gate, r * stride), n)?;
            for (x, g) in row.iter_mut().zip(gate) {
                *x /= 1.0 + (-g).exp();
            }
        }
        host::store_bf16(mem, self.x, &x)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::round_bf16;
    use crate::ops::testing::*;

    fn silu_f(z: f32) -> f32 {
        z / (1.0 + (-z).exp())
    }

    /// Qwen3-Next's order on one row of two groups of two, the weight shared (stride 0) and the
    /// gate read out of a wider row: each group normalised over its own two channels, then
    /// weighted and gated.
    #[test]
    fn gate_after_norm_matches_hand_computation() {
        let mut m = FlatMemory::new();
        let x = m.put(&bf16s(&[3.0, 4.0, -1.0, 1.0]));
        // z_stride 6: two junk gate values after the row's four.
        let z = m.put(&bf16s(&[1.0, -2.0, 0.5, 0.0, 77.0, 77.0]));
        let weight = m.put(&bf16s(&[1.0, 0.5]));
        let out = m.put(&bf16s(&[0.0; 4]));
        GatedRmsNorm {
            out,
            x,
            z,
            weight,
            rows: 1,
            groups: 2,
            width: 2,
            z_stride: 6,
            weight_group_stride: 0,
            eps: 0.0,
            gate_first: GateOrder::AfterNorm.gate_first(),
            x_f32: 0,
        }
        .reference(&mut m)
        .unwrap();
        // Group 0: rms = sqrt(12.5); group 1: rms = 1.
        let r = 12.5f32.sqrt();
        let want = [
            round_bf16(3.0 / r * silu_f(1.0)),
            round_bf16(4.0 / r * 0.5 * silu_f(-2.0)),
            round_bf16(-silu_f(0.5)),
            0.0,
        ];
        assert_eq!(f32s(&m.get(out, 4)), want);
    }

    /// Mamba-2's order with a weight per group (stride `width`) is Mamba-2's reference,
    /// `mamba2::gated_rms_norm`, over two rows of three groups, with `x` in bf16 and in f32 (the
    /// recurrence's unrounded output: not rounded on the way in).
    #[test]
    fn gate_before_norm_is_mamba2s_gated_norm() {
        let (rows, groups, width) = (2usize, 3usize, 4usize);
        let inner = groups * width;
        let round = |v: Vec<f32>| v.into_iter().map(round_bf16).collect::<Vec<_>>();
        let (z, w) = (
            round(uniform(2, rows * inner, 2.0)),
            round(uniform(3, inner, 1.0)),
        );
        let eps = 1e-5;
        for x_f32 in [0u32, 1] {
            let x = uniform(1, rows * inner, 2.0);
            let x = if x_f32 == 0 { round(x) } else { x };
            let mut m = FlatMemory::new();
            let out = m.put(&bf16s(&vec![0.0; rows * inner]));
            let xp = if x_f32 == 0 {
                m.put(&bf16s(&x))
            } else {
                m.put(&x)
            };
            let (zp, wp) = (m.put(&bf16s(&z)), m.put(&bf16s(&w)));
            GatedRmsNorm {
                out,
                x: xp,
                z: zp,
                weight: wp,
                rows: rows as u32,
                groups: groups as u32,
                width: width as u32,
                z_stride: inner as u32,
                weight_group_stride: width as u32,
                eps,
                gate_first: GateOrder::BeforeNorm.gate_first(),
                x_f32,
            }
            .reference(&mut m)
            .unwrap();
            let want = super::super::mamba2::gated_rms_norm(&x, &z, &w, width, eps);
            let got = f32s(&m.get(out, rows * inner));
            for (g, w) in got.iter().zip(&want) {
                assert!(
                    (g - w).abs() <= 2f32.powi(-8) * w.abs() + 1e-6,
                    "x_f32 {x_f32}: {g} vs {w}"
                );
            }
        }
    }

    /// The output gate multiplies each row by the sigmoid of its gate row, read `gate_stride`
    /// apart.
    #[test]
    fn sigmoid_gate_reads_gate_rows_stride_apart() {
        let mut m = FlatMemory::new();
        let x = m.put(&bf16s(&[2.0, -1.0, 0.5, 4.0]));
        let gate = m.put(&bf16s(&[0.0, 1.0, 9.0, -3.0, 2.0, 9.0]));
        SigmoidGateMul {
            x,
            gate,
            rows: 2,
            n: 2,
            gate_stride: 3,
        }
        .reference(&mut m)
        .unwrap();
        let sigmoid = |g: f32| 1.0 / (1.0 + (-g).exp());
        let want = [
            1.0,
            round_bf16(-sigmoid(1.0)),
            round_bf16(0.5 * sigmoid(-3.0)),
            round_bf16(4.0 * sigmoid(2.0)),
        ];
        assert_eq!(f32s(&m.get(x, 4)), want);
    }
}
