// SPDX-License-Identifier: MIT OR Apache-2.0
//! Host references for the Gated DeltaNet token mixer (Qwen3-Next, Qwen3.5): the causal short
//! conv with its state, and the gated delta rule, step by step (the decode form) and chunk by
//! chunk (the chunked prefill's form), checked here against each other. The entry points of
//! `gated_delta.cu` (the conv's decode and run forms, the recurrent rule, the gating) are in
//! `kernels`, the chunked prefill's two launches (`gdn_chunk_prep`, `gdn_chunk_scan`) in
//! `chunked` and their tensor-core forms (`gdn_chunk_prep_tc`, `gdn_chunk_scan_tc`, with the
//! bf16 roundings they apply) in `tensor_cores`: their arguments read the device layouts and run these references, a run at
//! position 0 starting from zero states. The gated output norm is `ops::gated_norm`.
//!
//! The rule, per value head, over a state `S` of `dk x dv` f32 (`dk` the key width, `dv` the
//! value width), for each token with query `q`, key `k` (both L2-normalised, `q` then scaled by
//! `dk^-1/2`), value `v`, log-decay `g <= 0` and write strength `beta` in (0, 1):
//!
//! ```text
//! S  = exp(g) * S
//! S += k (beta * (v - S^T k))^T      the delta rule: move S^T k towards v
//! o  = S^T q
//! ```
//!
//! Everything is f32 here; the kernels read bf16 activations and keep the state in f32.

mod chunked;
mod kernels;
mod tensor_cores;

pub use chunked::{
    GDN_CHUNK_MAX, GDN_CHUNK_PREP_SMEM, GDN_CHUNK_SCAN_SMEM, GDN_CHUNK_THREADS, GDN_SCAN_COLS,
    GdnChunkPrep, GdnChunkScan,
};
pub use kernels::{
    GDN_CONV_CHUNK, GDN_CONV_MAX_KERNEL, GDN_MAX_DK, GDN_RECURRENT_COLS, GdnConv1d, GdnConv1dStep,
    GdnGating, GdnRecurrent,
};
pub use tensor_cores::{
    GDN_CHUNK_PREP_TC_SMEM, GDN_CHUNK_SCAN_TC_SMEM, GDN_CHUNK_SCAN_TC_THREADS, GdnChunkPrepTc,
    GdnChunkScanTc, chunk_apply_tc, chunk_factors_tc, gated_delta_chunked_tc,
};

/// Epsilon of the L2 normalisation of q and k (as the reference implementation's `l2norm`).
pub const L2NORM_EPS: f32 = 1e-6;

/// One value head's inputs over a sequence of `len` tokens, row-major per token.
#[derive(Clone, Debug)]
pub struct GatedDeltaInputs<'a> {
    /// Key width.
    pub dk: usize,
    /// Value width.
    pub dv: usize,
    /// Queries, `len x dk`, not yet normalised.
    pub q: &'a [f32],
    /// Keys, `len x dk`, not yet normalised.
    pub k: &'a [f32],
    /// Values, `len x dv`.
    pub v: &'a [f32],
    /// Log-decays, `len` (`-exp(A_log) * softplus(a + dt_bias)` in the model).
    pub g: &'a [f32],
    /// Write strengths, `len` (`sigmoid(b)` in the model).
    pub beta: &'a [f32],
}

impl GatedDeltaInputs<'_> {
    fn len(&self) -> usize {
        self.g.len()
    }

    /// Token `t`'s q and k, L2-normalised, q scaled by `dk^-1/2`.
    fn qk(&self, t: usize) -> (Vec<f32>, Vec<f32>) {
        let dk = self.dk;
        let mut q = l2_normalised(&self.q[t * dk..(t + 1) * dk]);
        let k = l2_normalised(&self.k[t * dk..(t + 1) * dk]);
        let scale = (dk as f32).powf(-0.5);
        q.iter_mut().for_each(|x| *x *= scale);
        (q, k)
    }
}

/// `x / sqrt(sum x^2 + eps)`.
pub fn l2_normalised(x: &[f32]) -> Vec<f32> {
    let inv = 1.0 / (x.iter().map(|v| v * v).sum::<f32>() + L2NORM_EPS).sqrt();
    x.iter().map(|v| v * inv).collect()
}

/// The recurrent form: one token at a time, `state` (`dk x dv`, row-major) updated in place;
/// returns the outputs, `len x dv`. The decode step is this with `len == 1`.
pub fn gated_delta_recurrent(x: &GatedDeltaInputs, state: &mut [f32]) -> Vec<f32> {
    let (dk, dv) = (x.dk, x.dv);
    assert_eq!(state.len(), dk * dv);
    let mut out = vec![0.0; x.len() * dv];
    let mut kv = vec![0.0; dv];
    for t in 0..x.len() {
        let (q, k) = x.qk(t);
        let decay = x.g[t].exp();
        state.iter_mut().for_each(|s| *s *= decay);
        // kv = S^T k: what the state recalls for this key.
        kv.fill(0.0);
        for (i, &ki) in k.iter().enumerate() {
            for (o, s) in kv.iter_mut().zip(&state[i * dv..(i + 1) * dv]) {
                *o += s * ki;
            }
        }
        let v = &x.v[t * dv..(t + 1) * dv];
        let delta: Vec<f32> = v
            .iter()
            .zip(&kv)
            .map(|(v, m)| x.beta[t] * (v - m))
            .collect();
        for (i, &ki) in k.iter().enumerate() {
            for (s, d) in state[i * dv..(i + 1) * dv].iter_mut().zip(&delta) {
                *s += ki * d;
            }
        }
        let o = &mut out[t * dv..(t + 1) * dv];
        for (i, &qi) in q.iter().enumerate() {
            for (o, s) in o.iter_mut().zip(&state[i * dv..(i + 1) * dv]) {
                *o += s * qi;
            }
        }
    }
    out
}

/// The chunked form: the same outputs and final state as [`gated_delta_recurrent`], computed
/// `chunk` tokens at a time with matrix products (the form the chunked prefill kernels take):
/// [`chunk_factors`] then [`chunk_apply`] for each chunk in order.
///
/// Within a chunk of `c` tokens, with `G_i` the running sum of `g` up to token `i` (inclusive)
/// and `D_ij = exp(G_i - G_j)` for `j <= i`: the delta rule's writes are solved for all tokens
/// at once. `T = (I + L)^-1` with `L_ij = beta_i D_ij k_i.k_j` strictly below the diagonal
/// (forward substitution); `U = T (beta v)` and `W = T (beta exp(G) k)`. Then, from the state
/// `S` entering the chunk, the corrected values are `V' = U - W S = T (beta (v - exp(G) k S))`,
/// the outputs `O = (exp(G) q) S + ((q k^T) * D, lower triangle with the diagonal) V'`, and the
/// state leaving it `exp(G_c) S + (exp(G_c - G) k)^T V'`.
pub fn gated_delta_chunked(x: &GatedDeltaInputs, state: &mut [f32], chunk: usize) -> Vec<f32> {
    let (dk, dv) = (x.dk, x.dv);
    assert!(chunk > 0);
    assert_eq!(state.len(), dk * dv);
    let mut out = Vec::with_capacity(x.len() * dv);
    let mut start = 0;
    while start < x.len() {
        let c = chunk.min(x.len() - start);
        let part = x.part(start..start + c);
        let factors = chunk_factors(&part);
        out.extend(chunk_apply(&part, &factors, state));
        start += c;
    }
    out
}

/// What [`chunk_factors`] makes of one chunk of `c` tokens: both `c x c`, row-major.
#[derive(Clone, Debug, PartialEq)]
pub struct ChunkFactors {
    /// `T = (I + L)^-1`, `L_ij = beta_i exp(G_i - G_j) k_i.k_j` strictly below the diagonal:
    /// lower triangular with a unit diagonal.
    pub t: Vec<f32>,
    /// `P_ij = exp(G_i - G_j) q_i.k_j` for `j <= i`, zero above the diagonal.
    pub attn: Vec<f32>,
}

impl GatedDeltaInputs<'_> {
    /// Tokens `range` of these inputs.
    fn part(&self, range: std::ops::Range<usize>) -> GatedDeltaInputs<'_> {
        let (dk, dv) = (self.dk, self.dv);
        GatedDeltaInputs {
            dk,
            dv,
            q: &self.q[range.start * dk..range.end * dk],
            k: &self.k[range.start * dk..range.end * dk],
            v: &self.v[range.start * dv..range.end * dv],
            g: &self.g[range.clone()],
            beta: &self.beta[range],
        }
    }

    /// The running sums of `g`: `G_i = g_0 + ... + g_i`.
    fn cumulative_decay(&self) -> Vec<f32> {
        self.g
            .iter()
            .scan(0.0f32, |acc, g| {
                *acc += g;
                Some(*acc)
            })
            .collect()
    }
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// The state-independent part of one chunk (all of `x`'s tokens): `T` by forward substitution
/// (row `i` of `T` is `e_i - sum_{m<i} L_im T_m`) and the decay-masked scores. Reads `q`, `k`,
/// `g` and `beta` (not `v`).
pub fn chunk_factors(x: &GatedDeltaInputs) -> ChunkFactors {
    let c = x.len();
    let (q, k): (Vec<Vec<f32>>, Vec<Vec<f32>>) = (0..c).map(|t| x.qk(t)).unzip();
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

/// One chunk (all of `x`'s tokens) from the `state` entering it (`dk x dv`, updated to the state
/// leaving it), given its [`chunk_factors`]; returns the outputs, `len x dv`:
/// `X = beta (v - exp(G) k S)`, `V' = T X`, `O = exp(G) q S + P V'`,
/// `S = exp(G_last) S + (exp(G_last - G) k)^T V'`.
pub fn chunk_apply(x: &GatedDeltaInputs, f: &ChunkFactors, state: &mut [f32]) -> Vec<f32> {
    let (c, dk, dv) = (x.len(), x.dk, x.dv);
    assert_eq!(state.len(), dk * dv);
    assert_eq!(f.t.len(), c * c);
    assert_eq!(f.attn.len(), c * c);
    let mut out = vec![0.0f32; c * dv];
    if c == 0 {
        return out;
    }
    let (q, k): (Vec<Vec<f32>>, Vec<Vec<f32>>) = (0..c).map(|t| x.qk(t)).unzip();
    let cum = x.cumulative_decay();
    // v^T S for a row vector v: what the state recalls for it.
    let recall = |v: &[f32], state: &[f32]| -> Vec<f32> {
        let mut r = vec![0.0f32; dv];
        for (a, &va) in v.iter().enumerate() {
            for (o, s) in r.iter_mut().zip(&state[a * dv..(a + 1) * dv]) {
                *o += va * s;
            }
        }
        r
    };
    // X = beta (v - exp(G) k S).
    let mut xs = vec![0.0f32; c * dv];
    for i in 0..c {
        let ks = recall(&k[i], state);
        let (decay, beta) = (cum[i].exp(), x.beta[i]);
        for ((o, v), r) in xs[i * dv..(i + 1) * dv]
            .iter_mut()
            .zip(&x.v[i * dv..(i + 1) * dv])
            .zip(&ks)
        {
            *o = beta * (v - decay * r);
        }
    }
    // V' = T X.
    let mut v_new = vec![0.0f32; c * dv];
    for i in 0..c {
        for j in 0..=i {
            let tij = f.t[i * c + j];
            for (o, xv) in v_new[i * dv..(i + 1) * dv]
                .iter_mut()
                .zip(&xs[j * dv..(j + 1) * dv])
            {
                *o += tij * xv;
            }
        }
    }
    // O = exp(G) q S + P V'.
    for i in 0..c {
        let qs = recall(&q[i], state);
        let decay = cum[i].exp();
        let o = &mut out[i * dv..(i + 1) * dv];
        for (o, r) in o.iter_mut().zip(&qs) {
            *o = decay * r;
        }
        for j in 0..=i {
            let p = f.attn[i * c + j];
            for (o, v) in o.iter_mut().zip(&v_new[j * dv..(j + 1) * dv]) {
                *o += p * v;
            }
        }
    }
    // S = exp(G_last) S + (exp(G_last - G) k)^T V'.
    let last = cum[c - 1];
    state.iter_mut().for_each(|s| *s *= last.exp());
    for j in 0..c {
        let scale = (last - cum[j]).exp();
        for (a, &ka) in k[j].iter().enumerate() {
            for (s, v) in state[a * dv..(a + 1) * dv]
                .iter_mut()
                .zip(&v_new[j * dv..(j + 1) * dv])
            {
                *s += scale * ka * v;
            }
        }
    }
    out
}

/// The causal depthwise conv in front of the mixer, then silu: for channel `ch` and token `t`,
/// `silu(bias[ch] + sum_j weight[ch][j] * x[t - (kernel - 1) + j][ch])`, the inputs before the
/// sequence's first token taken from `state` (the previous `kernel - 1` tokens, oldest first,
/// `(kernel - 1) x channels`), which is left holding the last `kernel - 1` inputs.
///
/// `x` is `len x channels`; `weight` is `channels x kernel` (the checkpoint's conv1d weight
/// without its middle axis), its last tap on the current token.
pub fn causal_conv1d_silu(
    x: &[f32],
    channels: usize,
    weight: &[f32],
    bias: Option<&[f32]>,
    state: &mut [f32],
) -> Vec<f32> {
    let kernel = weight.len() / channels;
    assert_eq!(weight.len(), channels * kernel);
    assert_eq!(state.len(), (kernel - 1) * channels);
    assert_eq!(x.len() % channels, 0);
    let len = x.len() / channels;
    // The window: the state's tokens, then the sequence's.
    let mut window = state.to_vec();
    window.extend_from_slice(x);
    let mut out = vec![0.0; x.len()];
    for t in 0..len {
        for ch in 0..channels {
            let mut acc = bias.map_or(0.0, |b| b[ch]);
            for j in 0..kernel {
                acc += weight[ch * kernel + j] * window[(t + j) * channels + ch];
            }
            out[t * channels + ch] = acc / (1.0 + (-acc).exp());
        }
    }
    state.copy_from_slice(&window[len * channels..]);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A small deterministic generator (xorshift), uniform in [-1, 1).
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> f32 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            (self.0 >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        }
        fn vec(&mut self, n: usize) -> Vec<f32> {
            (0..n).map(|_| self.next()).collect()
        }
    }

    struct Sequence {
        dk: usize,
        dv: usize,
        q: Vec<f32>,
        k: Vec<f32>,
        v: Vec<f32>,
        g: Vec<f32>,
        beta: Vec<f32>,
    }

    impl Sequence {
        fn random(rng: &mut Rng, len: usize, dk: usize, dv: usize) -> Sequence {
            Sequence {
                dk,
                dv,
                q: rng.vec(len * dk),
                k: rng.vec(len * dk),
                v: rng.vec(len * dv),
                // Decays from exp(-2) to exp(-0.01), as softplus-gated decays land.
                g: (0..len).map(|_| -0.01 - (rng.next() + 1.0)).collect(),
                beta: (0..len).map(|_| 0.5 + 0.49 * rng.next()).collect(),
            }
        }

        fn inputs(&self, tokens: std::ops::Range<usize>) -> GatedDeltaInputs<'_> {
            let (dk, dv) = (self.dk, self.dv);
            GatedDeltaInputs {
                dk,
                dv,
                q: &self.q[tokens.start * dk..tokens.end * dk],
                k: &self.k[tokens.start * dk..tokens.end * dk],
                v: &self.v[tokens.start * dv..tokens.end * dv],
                g: &self.g[tokens.clone()],
                beta: &self.beta[tokens],
            }
        }
    }

    fn max_diff(a: &[f32], b: &[f32]) -> f32 {
        assert_eq!(a.len(), b.len());
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f32::max)
    }

    #[test]
    fn one_step_from_zero_state_writes_beta_v_under_k() {
        // From S = 0: S = beta k v^T, so o = beta (q.k) v with q, k normalised and q scaled.
        let (q, k, v) = ([3.0, 4.0], [0.0, 2.0], [1.0, -2.0, 0.5]);
        let x = GatedDeltaInputs {
            dk: 2,
            dv: 3,
            q: &q,
            k: &k,
            v: &v,
            g: &[-0.5],
            beta: &[0.25],
        };
        let mut state = vec![0.0; 6];
        let o = gated_delta_recurrent(&x, &mut state);
        // q/|q| = (0.6, 0.8), k/|k| = (0, 1): q.k = 0.8, scaled by 2^-1/2.
        let qk = 0.8 / 2f32.sqrt();
        let want: Vec<f32> = v.iter().map(|v| 0.25 * qk * v).collect();
        assert!(max_diff(&o, &want) < 1e-6, "{o:?} vs {want:?}");
        assert!(max_diff(&state, &[0.0, 0.0, 0.0, 0.25, -0.5, 0.125]) < 1e-6);
    }

    #[test]
    fn the_chunked_form_equals_the_recurrent_one() {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        let (len, dk, dv) = (37, 16, 8);
        let seq = Sequence::random(&mut rng, len, dk, dv);
        let initial = rng.vec(dk * dv);
        let mut recurrent_state = initial.clone();
        let want = gated_delta_recurrent(&seq.inputs(0..len), &mut recurrent_state);
        for chunk in [1, 4, 8, 16, 64] {
            let mut state = initial.clone();
            let got = gated_delta_chunked(&seq.inputs(0..len), &mut state, chunk);
            assert!(max_diff(&got, &want) < 1e-4, "chunk {chunk}: outputs");
            assert!(
                max_diff(&state, &recurrent_state) < 1e-4,
                "chunk {chunk}: state"
            );
        }
    }

    #[test]
    fn two_calls_with_the_state_carried_equal_one() {
        let mut rng = Rng(12345);
        let (len, split, dk, dv) = (29, 11, 8, 8);
        let seq = Sequence::random(&mut rng, len, dk, dv);
        let mut whole_state = vec![0.0; dk * dv];
        let whole = gated_delta_chunked(&seq.inputs(0..len), &mut whole_state, 8);
        // A prefill in two chunks (the second at a chunk size that does not divide it), then
        // the last three tokens as decode steps.
        let mut state = vec![0.0; dk * dv];
        let mut out = gated_delta_chunked(&seq.inputs(0..split), &mut state, 8);
        out.extend(gated_delta_chunked(
            &seq.inputs(split..len - 3),
            &mut state,
            5,
        ));
        for t in len - 3..len {
            out.extend(gated_delta_recurrent(&seq.inputs(t..t + 1), &mut state));
        }
        assert!(max_diff(&out, &whole) < 1e-4);
        assert!(max_diff(&state, &whole_state) < 1e-4);
    }

    #[test]
    fn the_conv_carries_its_state_across_calls() {
        let mut rng = Rng(777);
        let (channels, kernel, len) = (6, 4, 10);
        let x = rng.vec(len * channels);
        let weight = rng.vec(channels * kernel);
        let bias = rng.vec(channels);
        let mut state = vec![0.0; (kernel - 1) * channels];
        let whole = causal_conv1d_silu(&x, channels, &weight, Some(&bias), &mut state);
        // Token 0 sees only itself (the state starts at zero): silu(bias + w[last] * x).
        let z = bias[0] + weight[kernel - 1] * x[0];
        assert!((whole[0] - z / (1.0 + (-z).exp())).abs() < 1e-6);
        assert_eq!(state, x[(len - 3) * channels..]);
        // A prefill chunk of 3, then one token at a time.
        let mut state2 = vec![0.0; (kernel - 1) * channels];
        let mut out = causal_conv1d_silu(
            &x[..3 * channels],
            channels,
            &weight,
            Some(&bias),
            &mut state2,
        );
        for t in 3..len {
            let step = &x[t * channels..(t + 1) * channels];
            out.extend(causal_conv1d_silu(
                step,
                channels,
                &weight,
                Some(&bias),
                &mut state2,
            ));
        }
        assert!(max_diff(&out, &whole) < 1e-6);
        assert_eq!(state2, state);
    }
}
