// SPDX-License-Identifier: MIT OR Apache-2.0
//! The chunked prefill of the gated delta rule with its matrix products on tensor cores
//! (`gated_delta_tc.cu`: `gdn_chunk_prep_tc`, `gdn_chunk_scan_tc`): the arguments, grids and
//! scratch of [`GdnChunkPrep`] and [`GdnChunkScan`], the algebra of [`chunk_factors`] and
//! [`chunk_apply`] with bf16 operands and f32 accumulation, as flash-linear-attention's
//! `chunk_gated_delta_rule` rounds them. The engine takes this pair instead of the CUDA-core one
//! under the tuning's `gdn_chunk_tensor_cores`.
//!
//! Exactly these values are rounded to bf16 (`round_bf16`, nearest even) before a product, here
//! as in the kernels; everything else is f32:
//!
//! ```text
//! q^ = bf16(q * (dk^-1/2 / sqrt(|q|^2 + eps)))   k^ = bf16(k / sqrt(|k|^2 + eps))
//! prep:  L_ij = beta_i D_ij (k^_i . k^_j), P_ij = D_ij (q^_i . k^_j), T = (I + L)^-1 in f32
//! scan:  S^ = bf16(S)                       (the state entering the chunk, kept f32)
//!        X  = bf16(beta (v - exp(G) k^ S^))
//!        V' = bf16(T) X
//!        O  = exp(G) q^ S^ + bf16(P) bf16(V')
//!        S  = exp(G_last) S + k^^T bf16(exp(G_last - G) V')
//! ```
//!
//! The differences from the f32 form are first order in bf16's unit roundoff `u = 2^-9`: on the
//! longest path an output meets eight roundings (q^ or k^, S^, X, T, P, V', the update's W that
//! reached the state it reads, and its own bf16 store), so within a chunk it moves by at most
//! about `8 u` of the sum of its terms' magnitudes, and the state by the same through `S^` and
//! `W`. The tests state what they observe against that bound.

use metrale_core::{KernelArg, KernelName, LaunchConfig};

use super::{
    ChunkFactors, GDN_CHUNK_THREADS, GDN_SCAN_COLS, GatedDeltaInputs, GdnChunkPrep, GdnChunkScan,
    L2NORM_EPS, dot,
};
use crate::host::{HostError, HostMemory, Kernel, KernelAbi, round_bf16};
use crate::names;
use crate::ops::blocks_for;

/// Threads of a [`GdnChunkScanTc`] block (`TC_SCAN_THREADS`): four warps, a 16-row m-tile of the
/// chunk and 32 rows of the state each.
pub const GDN_CHUNK_SCAN_TC_THREADS: u32 = 128;
/// Dynamic shared memory of a [`GdnChunkPrepTc`] block (`TC_PREP_SMEM` in `gated_delta_tc.cu`,
/// checked there by a `static_assert`): q^ and k^ in bf16, `L`, `P` and `T` in f32, decays.
pub const GDN_CHUNK_PREP_TC_SMEM: u32 = 87_552;
/// Dynamic shared memory of a [`GdnChunkScanTc`] block (`TC_SCAN_SMEM`): q^, k^, `T`, `P`, the
/// block's columns of `S^`, `X`, `V'` and `W` in bf16, decays.
pub const GDN_CHUNK_SCAN_TC_SMEM: u32 = 69_376;

/// [`GdnChunkPrep`]'s arguments for its tensor-core form, `gdn_chunk_prep_tc`: the same grid and
/// outputs, `T` and `P` from [`chunk_factors_tc`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GdnChunkPrepTc(pub GdnChunkPrep);

/// [`GdnChunkScan`]'s arguments for its tensor-core form, `gdn_chunk_scan_tc`: the same grid
/// (four warps a block instead of eight) and outputs, each chunk by [`chunk_apply_tc`]. Its `T`
/// and `P` are [`GdnChunkPrepTc`]'s.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GdnChunkScanTc(pub GdnChunkScan);

impl KernelAbi for GdnChunkPrepTc {
    const NAME: KernelName = names::gated_delta_tc::GDN_CHUNK_PREP_TC;
    const KINDS: &'static [&'static str] = GdnChunkPrep::KINDS;
    fn args(&self) -> Vec<KernelArg> {
        self.0.args()
    }
    fn from_args(args: &[KernelArg]) -> Result<Self, HostError> {
        GdnChunkPrep::from_args(args).map(GdnChunkPrepTc)
    }
}

impl KernelAbi for GdnChunkScanTc {
    const NAME: KernelName = names::gated_delta_tc::GDN_CHUNK_SCAN_TC;
    const KINDS: &'static [&'static str] = GdnChunkScan::KINDS;
    fn args(&self) -> Vec<KernelArg> {
        self.0.args()
    }
    fn from_args(args: &[KernelArg]) -> Result<Self, HostError> {
        GdnChunkScan::from_args(args).map(GdnChunkScanTc)
    }
}

impl Kernel for GdnChunkPrepTc {
    fn launch_config(&self) -> LaunchConfig {
        LaunchConfig {
            shared_mem_bytes: GDN_CHUNK_PREP_TC_SMEM,
            ..self.0.launch_config()
        }
    }
    fn reference(&self, mem: &mut dyn HostMemory) -> Result<(), HostError> {
        self.0.reference_with(Self::NAME, chunk_factors_tc, mem)
    }
}

impl Kernel for GdnChunkScanTc {
    fn launch_config(&self) -> LaunchConfig {
        let s = &self.0;
        LaunchConfig {
            grid: [
                blocks_for(s.dv.into(), GDN_SCAN_COLS).max(1),
                s.hv.max(1),
                s.seqs.max(1),
            ],
            block: [GDN_CHUNK_SCAN_TC_THREADS, 1, 1],
            shared_mem_bytes: GDN_CHUNK_SCAN_TC_SMEM,
        }
    }
    fn reference(&self, mem: &mut dyn HostMemory) -> Result<(), HostError> {
        self.0.reference_with(Self::NAME, chunk_apply_tc, mem)
    }
}

// The prep keeps the CUDA-core prep's block (eight warps: the products' four m-tiles by two
// halves, and four threads a column of the forward substitution).
const _: () = assert!(GDN_CHUNK_THREADS == 256);

impl GatedDeltaInputs<'_> {
    /// Token `t`'s q^ and k^ (see the module's table): the norm's inverse (times `dk^-1/2` for q)
    /// first, then the product, then the rounding, as the kernels compute them.
    fn qk_bf16(&self, t: usize) -> (Vec<f32>, Vec<f32>) {
        let dk = self.dk;
        let (q, k) = (&self.q[t * dk..(t + 1) * dk], &self.k[t * dk..(t + 1) * dk]);
        let squares = |x: &[f32]| x.iter().map(|v| v * v).sum::<f32>();
        let q_inv = (dk as f32).powf(-0.5) / (squares(q) + L2NORM_EPS).sqrt();
        let k_inv = 1.0 / (squares(k) + L2NORM_EPS).sqrt();
        (
            q.iter().map(|v| round_bf16(v * q_inv)).collect(),
            k.iter().map(|v| round_bf16(v * k_inv)).collect(),
        )
    }
}

/// [`chunk_factors`](super::chunk_factors) as `gdn_chunk_prep_tc` computes it: the dot products
/// over q^ and k^ (exact bf16 products summed in f32), `L`, `P` and the forward substitution in
/// f32. `T` and `P` are returned unrounded (the scan rounds them as it loads them).
pub fn chunk_factors_tc(x: &GatedDeltaInputs) -> ChunkFactors {
    let c = x.len();
    let (q, k): (Vec<Vec<f32>>, Vec<Vec<f32>>) = (0..c).map(|t| x.qk_bf16(t)).unzip();
    let cum = x.cumulative_decay();
    let mut t = vec![0.0f32; c * c];
    let mut attn = vec![0.0f32; c * c];
    for i in 0..c {
        t[i * c + i] = 1.0;
        for m in 0..i {
            let l_im = x.beta[i] * (cum[i] - cum[m]).exp() * dot(&k[i], &k[m]);
            for j in 0..=m {
                t[i * c + j] -= l_im * t[m * c + j];
            }
        }
        for j in 0..=i {
            attn[i * c + j] = (cum[i] - cum[j]).exp() * dot(&q[i], &k[j]);
        }
    }
    ChunkFactors { t, attn }
}

/// [`chunk_apply`](super::chunk_apply) as `gdn_chunk_scan_tc` computes it, with the roundings of
/// the module's table; `state` stays f32.
pub fn chunk_apply_tc(x: &GatedDeltaInputs, f: &ChunkFactors, state: &mut [f32]) -> Vec<f32> {
    let (c, dk, dv) = (x.len(), x.dk, x.dv);
    assert_eq!(state.len(), dk * dv);
    assert_eq!(f.t.len(), c * c);
    assert_eq!(f.attn.len(), c * c);
    let mut out = vec![0.0f32; c * dv];
    if c == 0 {
        return out;
    }
    let (q, k): (Vec<Vec<f32>>, Vec<Vec<f32>>) = (0..c).map(|t| x.qk_bf16(t)).unzip();
    let cum = x.cumulative_decay();
    let s_hat: Vec<f32> = state.iter().map(|&s| round_bf16(s)).collect();
    let t_hat: Vec<f32> = f.t.iter().map(|&v| round_bf16(v)).collect();
    let p_hat: Vec<f32> = f.attn.iter().map(|&v| round_bf16(v)).collect();
    // r^T S^ for a row r: what the rounded state recalls for it.
    let recall = |r: &[f32]| -> Vec<f32> {
        let mut o = vec![0.0f32; dv];
        for (a, &ra) in r.iter().enumerate() {
            for (o, s) in o.iter_mut().zip(&s_hat[a * dv..(a + 1) * dv]) {
                *o += ra * s;
            }
        }
        o
    };
    // X = bf16(beta (v - exp(G) k^ S^)).
    let mut xs = vec![0.0f32; c * dv];
    for i in 0..c {
        let ks = recall(&k[i]);
        let (decay, beta) = (cum[i].exp(), x.beta[i]);
        for ((o, v), r) in xs[i * dv..(i + 1) * dv]
            .iter_mut()
            .zip(&x.v[i * dv..(i + 1) * dv])
            .zip(&ks)
        {
            *o = round_bf16(beta * (v - decay * r));
        }
    }
    // V' = T^ X, then V'^ and W = bf16(exp(G_last - G) V').
    let last = cum[c - 1];
    let (mut v_hat, mut w) = (vec![0.0f32; c * dv], vec![0.0f32; c * dv]);
    for i in 0..c {
        let mut acc = vec![0.0f32; dv];
        for j in 0..=i {
            let tij = t_hat[i * c + j];
            for (o, xv) in acc.iter_mut().zip(&xs[j * dv..(j + 1) * dv]) {
                *o += tij * xv;
            }
        }
        let d = (last - cum[i]).exp();
        for (e, a) in acc.iter().enumerate() {
            v_hat[i * dv + e] = round_bf16(*a);
            w[i * dv + e] = round_bf16(d * a);
        }
    }
    // O = exp(G) q^ S^ + P^ V'^.
    for i in 0..c {
        let qs = recall(&q[i]);
        let decay = cum[i].exp();
        let o = &mut out[i * dv..(i + 1) * dv];
        for (o, r) in o.iter_mut().zip(&qs) {
            *o = decay * r;
        }
        for j in 0..=i {
            let p = p_hat[i * c + j];
            for (o, v) in o.iter_mut().zip(&v_hat[j * dv..(j + 1) * dv]) {
                *o += p * v;
            }
        }
    }
    // S = exp(G_last) S + k^^T W.
    state.iter_mut().for_each(|s| *s *= last.exp());
    for j in 0..c {
        for (a, &ka) in k[j].iter().enumerate() {
            for (s, wv) in state[a * dv..(a + 1) * dv]
                .iter_mut()
                .zip(&w[j * dv..(j + 1) * dv])
            {
                *s += ka * wv;
            }
        }
    }
    out
}

/// [`gated_delta_chunked`](super::gated_delta_chunked) in the tensor-core form:
/// [`chunk_factors_tc`] then [`chunk_apply_tc`] for each chunk of `chunk` tokens in order.
pub fn gated_delta_chunked_tc(x: &GatedDeltaInputs, state: &mut [f32], chunk: usize) -> Vec<f32> {
    assert!(chunk > 0);
    let mut out = Vec::with_capacity(x.len() * x.dv);
    let mut start = 0;
    while start < x.len() {
        let c = chunk.min(x.len() - start);
        let part = x.part(start..start + c);
        out.extend(chunk_apply_tc(&part, &chunk_factors_tc(&part), state));
        start += c;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::super::{gated_delta_chunked, gated_delta_recurrent};
    use super::*;
    use crate::ops::testing::uniform;

    /// bf16's unit roundoff (round to nearest with 8 significant bits).
    const U: f32 = 1.0 / 512.0;

    fn max_abs(a: &[f32]) -> f32 {
        a.iter().fold(0.0f32, |m, x| m.max(x.abs()))
    }

    fn max_diff(a: &[f32], b: &[f32]) -> f32 {
        assert_eq!(a.len(), b.len());
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f32::max)
    }

    /// One run of `len` tokens at `dk x dv` from a nonzero state, bf16 inputs as the kernels
    /// read them: the tensor-core form against the f32 chunked form and the recurrent walk.
    /// Returns (output difference, state difference), each as a fraction of the f32 form's
    /// largest magnitude, against the walk and against the f32 chunked form.
    fn compare(len: usize, dk: usize, dv: usize, seed: u64) -> [(f32, f32); 2] {
        let bf = |v: Vec<f32>| -> Vec<f32> { v.into_iter().map(round_bf16).collect() };
        let (q, k, v) = (
            bf(uniform(seed, len * dk, 1.0)),
            bf(uniform(seed + 1, len * dk, 1.0)),
            bf(uniform(seed + 2, len * dv, 1.0)),
        );
        // Decays from exp(-0.3) to exp(-0.001) a token and strong writes: a chunk's entering
        // state still matters at its end, the state's errors carry over many chunks.
        let g: Vec<f32> = uniform(seed + 3, len, 1.0)
            .iter()
            .map(|u| -0.001 - 0.15 * (u + 1.0))
            .collect();
        let beta: Vec<f32> = uniform(seed + 4, len, 0.5)
            .iter()
            .map(|u| u + 0.5)
            .collect();
        let x = GatedDeltaInputs {
            dk,
            dv,
            q: &q,
            k: &k,
            v: &v,
            g: &g,
            beta: &beta,
        };
        let initial = uniform(seed + 5, dk * dv, 0.5);
        let (mut s_walk, mut s_f32, mut s_tc) = (initial.clone(), initial.clone(), initial);
        let walk = gated_delta_recurrent(&x, &mut s_walk);
        let f32s = gated_delta_chunked(&x, &mut s_f32, 64);
        let tc = gated_delta_chunked_tc(&x, &mut s_tc, 64);
        let (o_scale, s_scale) = (max_abs(&f32s), max_abs(&s_f32));
        assert!(
            o_scale > 0.01 && s_scale > 0.05,
            "degenerate: |o| {o_scale}, |S| {s_scale}"
        );
        [
            (
                max_diff(&tc, &walk) / o_scale,
                max_diff(&s_tc, &s_walk) / s_scale,
            ),
            (
                max_diff(&tc, &f32s) / o_scale,
                max_diff(&s_tc, &s_f32) / s_scale,
            ),
        ]
    }

    /// The tensor-core form stays within the bound its roundings give (eight bf16 roundings on
    /// an output's longest path: `8 u` of the largest output, and of the largest state element)
    /// of the f32 chunked form and of the recurrent walk, over 300 tokens (four full chunks and
    /// a partial one) continuing from a nonzero state, at Qwen3.5's dk = dv = 128 and at ragged
    /// small widths. Measured (these seeds): outputs 3.2e-3, 4.1e-3, 3.6e-3 and states 4.9e-3,
    /// 3.7e-3, 5.3e-3 of their scale from the f32 form (1.6 to 2.7 u; the same from the walk,
    /// which the f32 form matches to f32 rounding): a third of the bound.
    #[test]
    fn the_tensor_core_form_stays_within_bf16_rounding_of_the_f32_forms() {
        for (dk, dv, seed) in [(128, 128, 11), (20, 12, 23), (32, 17, 31)] {
            let [walk, f32s] = compare(300, dk, dv, seed);
            println!(
                "dk={dk} dv={dv}: against the walk o {:.2e} S {:.2e}; against the f32 chunks \
                 o {:.2e} S {:.2e} (bound {:.2e})",
                walk.0,
                walk.1,
                f32s.0,
                f32s.1,
                8.0 * U
            );
            for (what, d) in [
                ("o vs walk", walk.0),
                ("S vs walk", walk.1),
                ("o vs f32", f32s.0),
                ("S vs f32", f32s.1),
            ] {
                assert!(d <= 8.0 * U, "dk={dk} dv={dv}: {what} {d:e} > 8u");
            }
            // And it is not the f32 form: the roundings show.
            assert!(f32s.0 > 1e-5, "dk={dk} dv={dv}: no rounding seen");
        }
    }

    /// With every operand already a bf16 value and the state bf16-exact, the only roundings
    /// left are those of X, T, P, V' and W: a sanity check that q^, k^ and S^ are rounded where
    /// the table says (rounding them again changes nothing).
    #[test]
    fn rounding_is_idempotent_on_the_rounded_operands() {
        let (dk, dv) = (16, 8);
        let q: Vec<f32> = uniform(3, 2 * dk, 1.0);
        let x = GatedDeltaInputs {
            dk,
            dv,
            q: &q,
            k: &q,
            v: &[0.0; 16],
            g: &[-0.1, -0.2],
            beta: &[0.5, 0.5],
        };
        let (qh, kh) = x.qk_bf16(1);
        assert!(qh.iter().chain(&kh).all(|&v| round_bf16(v) == v));
        // A zero state and zero values: zero outputs, zero state.
        let mut state = vec![0.0; dk * dv];
        let o = gated_delta_chunked_tc(&x, &mut state, 64);
        assert!(o.iter().chain(&state).all(|&v| v == 0.0));
    }
}
