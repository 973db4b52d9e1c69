// SPDX-License-Identifier: MIT OR Apache-2.0
//! The decode router in one launch: the router's product, the shared expert's gate logit and
//! the routing, for steps of at most [`MOE_ROUTER_MAX_ROWS`] rows.
//!
//! The two launches it replaces (the f32-output GEMV, then [`MoeRoute`]) each cost a launch and
//! a dependency wait for a few microseconds of work at batch 1 (Qwen3-30B-A3B: 512 KiB of router
//! weights, 128 logits a row). Here every block computes 8 of the logits for every row; the last
//! block to finish, counted in a zeroed counter it sets back to zero, routes the rows from the
//! logits the others wrote (as `attention.cu`'s split merge does).

use half::bf16;
use metrale_core::{DevicePtr, LaunchConfig};

use super::route::{MoeRoute, MoeScoring};
use super::{bad_args, check_experts};
use crate::host::{self, HostError, HostMemory, Kernel, KernelAbi, kernel_args, widen};
use crate::names;

/// Most rows [`MoeRouter`] takes (`ROUTER_MAX_ROWS` in moe.cu: its last block routes a row a
/// warp).
pub const MOE_ROUTER_MAX_ROWS: u32 = 8;

/// Logit columns a router block computes, one a warp (`ROUTER_WARPS` in moe.cu).
const ROUTER_COLUMNS_PER_BLOCK: u32 = 8;

kernel_args!(
    /// The router of a decode step: `logits[r, e] = x[r] . w[e]` in f32 (the f32-output GEMV's
    /// value), `shared_logit[r] = x[r] . shared_gate_w` where the shared expert has a gate, then
    /// each row's top k and weights from those logits exactly as [`MoeRoute`] makes them
    /// ([`route_row`](crate::ops::route_row)). `counter` is zero before and after.
    MoeRouter => names::moe::MOE_ROUTER {
        /// i32 `[rows, k]`: the chosen experts.
        topk_ids: DevicePtr,
        /// f32 `[rows, k]`: their weights.
        topk_weights: DevicePtr,
        /// f32 `[rows, experts]`: the router's product (written, then read by the last block).
        logits: DevicePtr,
        /// f32 `[rows]`: the shared expert's gate logits; unused (may be null) when
        /// `shared_gate_w` is null.
        shared_logit: DevicePtr,
        /// u32 `[1]`: the blocks' arrival count, zero before the launch and left zero.
        counter: DevicePtr,
        /// bf16 `[rows, hidden]`: the normalised hidden states.
        x: DevicePtr,
        /// bf16 `[experts, hidden]`: the router's weight.
        w: DevicePtr,
        /// bf16 `[hidden]`: the shared expert's gate (one output column), or null for none.
        shared_gate_w: DevicePtr,
        /// f32 `[experts]` added to the sigmoid scores for the choice only, or null (zero).
        correction_bias: DevicePtr,
        /// Rows (tokens), 1 to [`MOE_ROUTER_MAX_ROWS`].
        rows: u32,
        /// Experts, as [`MoeRoute`]'s.
        experts: u32,
        /// Experts a row takes, as [`MoeRoute`]'s.
        k: u32,
        /// Softmax or sigmoid scores.
        scoring: MoeScoring,
        /// 1 to divide the k weights by their sum (`norm_topk_prob`), 0 not to.
        renormalize: u32,
        /// Every weight is multiplied by this (`routed_scaling_factor`).
        scale: f32,
        /// The model's width.
        hidden: u32,
    }
);

impl MoeRouter {
    /// The routing half: [`MoeRoute`] on this launch's logits.
    pub fn route(&self) -> MoeRoute {
        MoeRoute {
            topk_ids: self.topk_ids,
            topk_weights: self.topk_weights,
            logits: self.logits,
            correction_bias: self.correction_bias,
            rows: self.rows,
            experts: self.experts,
            k: self.k,
            scoring: self.scoring,
            renormalize: self.renormalize,
            scale: self.scale,
        }
    }

    /// Logit columns: the experts, and the shared expert's gate where there is one.
    fn columns(&self) -> u32 {
        self.experts + u32::from(!self.shared_gate_w.is_null())
    }
}

impl Kernel for MoeRouter {
    /// Eight logit columns a block, one a warp.
    fn launch_config(&self) -> LaunchConfig {
        LaunchConfig::linear(
            self.columns().div_ceil(ROUTER_COLUMNS_PER_BLOCK).max(1),
            ROUTER_COLUMNS_PER_BLOCK * 32,
        )
    }
    fn reference(&self, mem: &mut dyn HostMemory) -> Result<(), HostError> {
        check_experts(Self::NAME, self.experts, self.k)?;
        if !(1..=MOE_ROUTER_MAX_ROWS).contains(&self.rows) {
            return Err(bad_args(
                Self::NAME,
                format!("rows = {} is not in 1..={MOE_ROUTER_MAX_ROWS}", self.rows),
            ));
        }
        if self.k > self.experts {
            return Err(bad_args(
                Self::NAME,
                format!("k = {} exceeds experts = {}", self.k, self.experts),
            ));
        }
        let (rows, experts, hidden) = (
            self.rows as usize,
            self.experts as usize,
            self.hidden as usize,
        );
        let x = host::load_bf16(mem, self.x, rows * hidden)?;
        let dots = |mem: &dyn HostMemory, w: DevicePtr, n: usize| -> Result<Vec<f32>, HostError> {
            let w = host::view::<bf16>(mem, w, n * hidden)?;
            let mut row = vec![0f32; hidden];
            let mut out = vec![0f32; rows * n];
            for c in 0..n {
                for (dst, src) in row.iter_mut().zip(&w[c * hidden..(c + 1) * hidden]) {
                    *dst = widen(*src);
                }
                for r in 0..rows {
                    out[r * n + c] = crate::ops::gemm::dot(&x[r * hidden..(r + 1) * hidden], &row);
                }
            }
            Ok(out)
        };
        let logits = dots(mem, self.w, experts)?;
        if !self.shared_gate_w.is_null() {
            let gate = dots(mem, self.shared_gate_w, 1)?;
            host::store(mem, self.shared_logit, &gate)?;
        }
        host::store(mem, self.logits, &logits)?;
        self.route().reference(mem)?;
        host::store(mem, self.counter, &[0u32])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::route_row;
    use crate::ops::testing::*;

    #[test]
    fn the_router_is_the_product_then_the_routing() {
        // 3 rows, 5 experts, top 2 of sigmoid scores with a bias, and a shared gate column.
        let (rows, experts, k, hidden) = (3usize, 5usize, 2usize, 24usize);
        let x = f32s(&bf16s(&uniform(1, rows * hidden, 1.0)));
        let w = f32s(&bf16s(&uniform(2, experts * hidden, 0.5)));
        let g = f32s(&bf16s(&uniform(3, hidden, 0.5)));
        let bias = [0.0f32, 0.25, -0.25, 0.0, 0.5];
        let mut m = FlatMemory::new();
        let (xp, wp, gp, bp) = (
            m.put(&bf16s(&x)),
            m.put(&bf16s(&w)),
            m.put(&bf16s(&g)),
            m.put(&bias),
        );
        let (ids, weights) = (m.put(&[-7i32; 6]), m.put(&[-7f32; 6]));
        let (logits, shared_logit) = (m.put(&[-7f32; 15]), m.put(&[-7f32; 3]));
        let counter = m.put(&[0u32]);
        let router = MoeRouter {
            topk_ids: ids,
            topk_weights: weights,
            logits,
            shared_logit,
            counter,
            x: xp,
            w: wp,
            shared_gate_w: gp,
            correction_bias: bp,
            rows: rows as u32,
            experts: experts as u32,
            k: k as u32,
            scoring: MoeScoring::Sigmoid,
            renormalize: 1,
            scale: 2.5,
            hidden: hidden as u32,
        };
        router.reference(&mut m).unwrap();
        let dot = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(a, b)| a * b).sum::<f32>();
        let (got_logits, got_gate) = (m.get::<f32>(logits, 15), m.get::<f32>(shared_logit, 3));
        let (got_ids, got_w) = (m.get::<i32>(ids, 6), m.get::<f32>(weights, 6));
        for r in 0..rows {
            let xr = &x[r * hidden..(r + 1) * hidden];
            let want: Vec<f32> = (0..experts)
                .map(|e| dot(xr, &w[e * hidden..(e + 1) * hidden]))
                .collect();
            for (g, w) in got_logits[r * experts..(r + 1) * experts].iter().zip(&want) {
                assert!((g - w).abs() < 1e-5, "row {r}: {g} vs {w}");
            }
            assert!((got_gate[r] - dot(xr, &g)).abs() < 1e-5);
            let routed = route_row(
                &got_logits[r * experts..(r + 1) * experts],
                Some(&bias),
                k,
                MoeScoring::Sigmoid,
                true,
                2.5,
            );
            for (s, (e, wt)) in routed.into_iter().enumerate() {
                assert_eq!(got_ids[r * k + s], e);
                assert_eq!(got_w[r * k + s], wt);
            }
        }
        assert_eq!(m.get::<u32>(counter, 1), vec![0]);
        assert_eq!(MoeRouter::from_args(&router.args()).unwrap(), router);
        // 5 experts and the gate: one block; 128 experts and a gate: 17.
        assert_eq!(router.launch_config(), LaunchConfig::linear(1, 256));
        let wide = MoeRouter {
            experts: 128,
            ..router
        };
        assert_eq!(wide.launch_config().grid, [17, 1, 1]);
        let ungated = MoeRouter {
            shared_gate_w: DevicePtr::NULL,
            ..wide
        };
        assert_eq!(ungated.launch_config().grid, [16, 1, 1]);
        // No rows, more rows than a block routes, k past the experts.
        for bad in [
            MoeRouter { rows: 0, ..router },
            MoeRouter {
                rows: MOE_ROUTER_MAX_ROWS + 1,
                ..router
            },
            MoeRouter { k: 6, ..router },
        ] {
            assert!(bad.reference(&mut m).is_err(), "{bad:?}");
        }
    }
}
