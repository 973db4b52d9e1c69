// SPDX-License-Identifier: MIT OR Apache-2.0
//! The router: scores, top k and weights of each row, from the router's f32 logits.

use metrale_core::{DevicePtr, KernelArg, LaunchConfig};

use super::{MOE_MAX_EXPERTS, MOE_MAX_TOP_K, bad_args, check_experts};
use crate::host::{self, ArgType, HostError, HostMemory, Kernel, KernelAbi, kernel_args};
use crate::names;

/// How a router turns logits into scores (`scoring` of moe.cu's `moe_route`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MoeScoring {
    /// `softmax(logits)` over every expert, the top k of it (Qwen2-MoE, Qwen3-MoE).
    Softmax,
    /// `sigmoid(logits)`; the top k of `score + correction_bias`, weighted by the unbiased score
    /// (MiniMax-M2, DeepSeek-V3 without its expert groups).
    Sigmoid,
}

impl MoeScoring {
    /// The kernel's code (`SCORING_*` in moe.cu).
    pub const fn code(self) -> u32 {
        match self {
            MoeScoring::Softmax => 0,
            MoeScoring::Sigmoid => 1,
        }
    }
}

impl ArgType for MoeScoring {
    const KIND: &'static str = "u32";
    fn into_arg(self) -> KernelArg {
        KernelArg::U32(self.code())
    }
    fn from_arg(arg: &KernelArg) -> Option<Self> {
        match arg {
            KernelArg::U32(0) => Some(MoeScoring::Softmax),
            KernelArg::U32(1) => Some(MoeScoring::Sigmoid),
            _ => None,
        }
    }
}

kernel_args!(
    /// Per row of router logits: scores ([`MoeScoring`]), the top k, their weights, optionally
    /// renormalised to sum 1, times `scale` ([`route_row`] says exactly how). Ties go to the lower
    /// expert id; slots are in choice order, the best first.
    MoeRoute => names::moe::MOE_ROUTE {
        /// i32 `[rows, k]`: the chosen experts.
        topk_ids: DevicePtr,
        /// f32 `[rows, k]`: their weights.
        topk_weights: DevicePtr,
        /// f32 `[rows, experts]`: the router's product, finite.
        logits: DevicePtr,
        /// f32 `[experts]` added to the sigmoid scores for the choice only, or null (zero).
        /// Ignored by softmax scoring.
        correction_bias: DevicePtr,
        /// Rows (tokens).
        rows: u32,
        /// Experts, at most [`MOE_MAX_EXPERTS`].
        experts: u32,
        /// Experts a row takes, 1 to [`MOE_MAX_TOP_K`] and at most `experts`.
        k: u32,
        /// Softmax or sigmoid scores.
        scoring: MoeScoring,
        /// 1 to divide the k weights by their sum (`norm_topk_prob`), 0 not to.
        renormalize: u32,
        /// Every weight is multiplied by this (`routed_scaling_factor`; 1 for Qwen).
        scale: f32,
    }
);

/// Rows of a routing block: one warp a row (`ROUTE_THREADS / 32` in moe.cu).
const ROUTE_ROWS_PER_BLOCK: u32 = 4;

/// One row's routing, as `moe_route` computes it: `(expert, weight)` for each of the `k` slots.
///
/// - Softmax: the top k are chosen on the logits (softmax is monotone, so they are the top k of the
///   scores, and host and device choose from the same bits); weight = `exp(l - max) / sum` over
///   every expert.
/// - Sigmoid: score = `1 / (1 + exp(-l))`; the top k are chosen on `score + bias[e]` (no bias:
///   zero), weight = score.
///
/// A NaN key counts as -inf; equal keys go to the lower expert id. Then with `renormalize` each
/// weight is divided by the k weights' sum (added in slot order; a zero sum leaves them zero), and
/// every weight is multiplied by `scale`.
///
/// # Panics
/// If `k > logits.len()`, or `bias` is shorter than `logits`.
pub fn route_row(
    logits: &[f32],
    bias: Option<&[f32]>,
    k: usize,
    scoring: MoeScoring,
    renormalize: bool,
    scale: f32,
) -> Vec<(i32, f32)> {
    assert!(k <= logits.len(), "k = {k} > {} experts", logits.len());
    let finite_key = |v: f32| if v.is_nan() { f32::NEG_INFINITY } else { v };
    let (keys, scores): (Vec<f32>, Vec<f32>) = match scoring {
        MoeScoring::Softmax => {
            let keys: Vec<f32> = logits.iter().map(|&l| finite_key(l)).collect();
            let max = keys.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let exps: Vec<f32> = keys.iter().map(|&l| (l - max).exp()).collect();
            let sum: f32 = exps.iter().sum();
            (keys, exps.iter().map(|&x| x / sum).collect())
        }
        MoeScoring::Sigmoid => logits
            .iter()
            .enumerate()
            .map(|(e, &l)| {
                let score = 1.0 / (1.0 + (-l).exp());
                (finite_key(score + bias.map_or(0.0, |b| b[e])), score)
            })
            .unzip(),
    };
    let mut order: Vec<usize> = (0..logits.len()).collect();
    // Keys are never NaN, so the order is total; -0 and +0 are equal keys.
    order.sort_by(|&a, &b| keys[b].partial_cmp(&keys[a]).unwrap().then(a.cmp(&b)));
    let mut chosen: Vec<(i32, f32)> = order[..k].iter().map(|&e| (e as i32, scores[e])).collect();
    if renormalize {
        let total = chosen.iter().fold(0f32, |s, &(_, w)| s + w);
        for (_, w) in &mut chosen {
            *w = if total > 0.0 { *w / total } else { 0.0 };
        }
    }
    for (_, w) in &mut chosen {
        *w *= scale;
    }
    chosen
}

impl Kernel for MoeRoute {
    fn launch_config(&self) -> LaunchConfig {
        LaunchConfig::linear(
            self.rows.div_ceil(ROUTE_ROWS_PER_BLOCK).max(1),
            ROUTE_ROWS_PER_BLOCK * 32,
        )
    }
    fn reference(&self, mem: &mut dyn HostMemory) -> Result<(), HostError> {
        check_experts(Self::NAME, self.experts, self.k)?;
        if self.k > self.experts {
            return Err(bad_args(
                Self::NAME,
                format!("k = {} exceeds experts = {}", self.k, self.experts),
            ));
        }
        debug_assert!(self.experts <= MOE_MAX_EXPERTS && self.k <= MOE_MAX_TOP_K);
        let (rows, experts, k) = (self.rows as usize, self.experts as usize, self.k as usize);
        let logits = host::load::<f32>(mem, self.logits, rows * experts)?;
        let bias = match self.scoring {
            MoeScoring::Sigmoid if !self.correction_bias.is_null() => {
                Some(host::load::<f32>(mem, self.correction_bias, experts)?)
            }
            _ => None,
        };
        let (mut ids, mut weights) = (Vec::with_capacity(rows * k), Vec::with_capacity(rows * k));
        for row in logits.chunks_exact(experts) {
            for (e, w) in route_row(
                row,
                bias.as_deref(),
                k,
                self.scoring,
                self.renormalize != 0,
                self.scale,
            ) {
                ids.push(e);
                weights.push(w);
            }
        }
        host::store(mem, self.topk_ids, &ids)?;
        host::store(mem, self.topk_weights, &weights)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::testing::*;

    fn close(got: &[(i32, f32)], want: &[(i32, f32)]) {
        assert_eq!(got.len(), want.len(), "{got:?} vs {want:?}");
        for (g, w) in got.iter().zip(want) {
            assert_eq!(g.0, w.0, "{got:?} vs {want:?}");
            assert!(
                (g.1 - w.1).abs() <= 1e-6 * w.1.abs().max(1.0),
                "{got:?} vs {want:?}"
            );
        }
    }

    #[test]
    fn softmax_top_k_with_and_without_renormalisation() {
        // Logits ln 1, ln 2, ln 3, ln 4: softmax = 0.1, 0.2, 0.3, 0.4.
        let logits: Vec<f32> = [1f32, 2.0, 3.0, 4.0].iter().map(|x| x.ln()).collect();
        let plain = route_row(&logits, None, 2, MoeScoring::Softmax, false, 1.0);
        close(&plain, &[(3, 0.4), (2, 0.3)]);
        // norm_topk_prob: 0.4 / 0.7 and 0.3 / 0.7.
        let norm = route_row(&logits, None, 2, MoeScoring::Softmax, true, 1.0);
        close(&norm, &[(3, 4.0 / 7.0), (2, 3.0 / 7.0)]);
        // The scale applies after the renormalisation.
        let scaled = route_row(&logits, None, 2, MoeScoring::Softmax, true, 2.5);
        close(&scaled, &[(3, 10.0 / 7.0), (2, 7.5 / 7.0)]);
        // k = E with renormalisation: the weights are the softmax itself, best first.
        let all = route_row(&logits, None, 4, MoeScoring::Softmax, true, 1.0);
        close(&all, &[(3, 0.4), (2, 0.3), (1, 0.2), (0, 0.1)]);
    }

    #[test]
    fn sigmoid_chooses_on_biased_scores_and_weights_unbiased_ones() {
        // Scores sigmoid(0) = 0.5, sigmoid(ln 3) = 0.75, sigmoid(-ln 3) = 0.25.
        let logits = [0.0f32, 3f32.ln(), -(3f32.ln())];
        // Unbiased: experts 1 then 0.
        let plain = route_row(&logits, None, 2, MoeScoring::Sigmoid, false, 1.0);
        close(&plain, &[(1, 0.75), (0, 0.5)]);
        // A bias of +0.6 on expert 2 puts it first (0.85), but its weight stays 0.25.
        let bias = [0.0f32, 0.0, 0.6];
        let biased = route_row(&logits, Some(&bias), 2, MoeScoring::Sigmoid, false, 1.0);
        close(&biased, &[(2, 0.25), (1, 0.75)]);
        // Renormalised (0.25 / 1.0, 0.75 / 1.0) and scaled by 2.5 (DeepSeek-V3's factor).
        let norm = route_row(&logits, Some(&bias), 2, MoeScoring::Sigmoid, true, 2.5);
        close(&norm, &[(2, 0.625), (1, 1.875)]);
    }

    #[test]
    fn ties_go_to_the_lower_expert_and_nan_never_wins() {
        // Equal logits: the lowest ids, in order, each weighted 1/E by softmax.
        let flat = route_row(&[0.5; 6], None, 3, MoeScoring::Softmax, false, 1.0);
        close(&flat, &[(0, 1.0 / 6.0), (1, 1.0 / 6.0), (2, 1.0 / 6.0)]);
        // A tie between 1 and 3 at the top, 2 just below: 1, 3, 2.
        let logits = [0.0f32, 2.0, 1.0, 2.0];
        let ids: Vec<i32> = route_row(&logits, None, 3, MoeScoring::Softmax, false, 1.0)
            .iter()
            .map(|&(e, _)| e)
            .collect();
        assert_eq!(ids, vec![1, 3, 2]);
        // Sigmoid ties made by the bias: expert 0's score 0.5 + 0.5 equals expert 1's
        // sigmoid(40) = 1 (exactly, in f32); the lower id first, each weighted by its own score.
        let got = route_row(
            &[0.0, 40.0, -40.0],
            Some(&[0.5, 0.0, 0.0]),
            2,
            MoeScoring::Sigmoid,
            false,
            1.0,
        );
        assert_eq!(got, vec![(0, 0.5), (1, 1.0)]);
        // -0 and +0 are equal keys: the lower id first.
        let ids: Vec<i32> = route_row(&[-1.0, 0.0, -0.0], None, 2, MoeScoring::Softmax, false, 1.0)
            .iter()
            .map(|&(e, _)| e)
            .collect();
        assert_eq!(ids, vec![1, 2]);
        // A NaN logit is never chosen before a number (it counts as -inf).
        let ids: Vec<i32> = route_row(
            &[f32::NAN, -3.0, f32::NAN, -5.0],
            None,
            2,
            MoeScoring::Softmax,
            false,
            1.0,
        )
        .iter()
        .map(|&(e, _)| e)
        .collect();
        assert_eq!(ids, vec![1, 3]);
    }

    #[test]
    fn a_zero_sum_leaves_the_weights_zero() {
        // Sigmoid scores that underflow to 0: the renormalisation does not divide by zero.
        let got = route_row(&[-200.0, -300.0], None, 2, MoeScoring::Sigmoid, true, 1.0);
        assert_eq!(got, vec![(0, 0.0), (1, 0.0)]);
    }

    #[test]
    fn the_reference_routes_every_row_and_refuses_bad_shapes() {
        let mut m = FlatMemory::new();
        // Two rows of 3 experts; the bias is ignored by softmax scoring.
        let logits = m.put(&[1f32.ln(), 3f32.ln(), 2f32.ln(), 0.0, 0.0, 5.0]);
        let bias = m.put(&[100f32, 0.0, 0.0]);
        let ids = m.put(&[-7i32; 4]);
        let weights = m.put(&[-7f32; 4]);
        let route = MoeRoute {
            topk_ids: ids,
            topk_weights: weights,
            logits,
            correction_bias: bias,
            rows: 2,
            experts: 3,
            k: 2,
            scoring: MoeScoring::Softmax,
            renormalize: 1,
            scale: 1.0,
        };
        route.reference(&mut m).unwrap();
        assert_eq!(m.get::<i32>(ids, 4), vec![1, 2, 2, 0]);
        let w = m.get::<f32>(weights, 4);
        assert!(
            (w[0] - 0.6).abs() < 1e-6 && (w[1] - 0.4).abs() < 1e-6,
            "{w:?}"
        );
        assert!((w[0] + w[1] - 1.0).abs() < 1e-6 && (w[2] + w[3] - 1.0).abs() < 1e-6);
        // The sigmoid form takes the bias: expert 0 first in both rows.
        MoeRoute {
            scoring: MoeScoring::Sigmoid,
            ..route
        }
        .reference(&mut m)
        .unwrap();
        assert_eq!(m.get::<i32>(ids, 4)[0], 0);
        assert_eq!(m.get::<i32>(ids, 4)[2], 0);
        // The scoring goes through the argument list and back.
        let sig = MoeRoute {
            scoring: MoeScoring::Sigmoid,
            ..route
        };
        assert_eq!(MoeRoute::from_args(&sig.args()).unwrap(), sig);
        // k > experts, k > 16, too many experts, unknown scoring codes.
        for bad in [
            MoeRoute { k: 4, ..route },
            MoeRoute {
                k: MOE_MAX_TOP_K + 1,
                experts: 64,
                ..route
            },
            MoeRoute {
                experts: MOE_MAX_EXPERTS + 1,
                ..route
            },
        ] {
            assert!(bad.reference(&mut m).is_err(), "{bad:?}");
        }
        let mut args = route.args();
        args[7] = KernelArg::U32(2);
        assert!(MoeRoute::from_args(&args).is_err());
        // One warp a row, four rows a block.
        assert_eq!(route.launch_config().grid, [1, 1, 1]);
        assert_eq!(
            MoeRoute { rows: 9, ..route }.launch_config(),
            LaunchConfig::linear(3, 128)
        );
    }
}
