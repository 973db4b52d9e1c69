// SPDX-License-Identifier: MIT OR Apache-2.0
//! Host references for the Mamba-2 token mixer (Nemotron-H): the SSD recurrence step by step (the
//! decode form) and chunk by chunk (the prefill form a tensor-core scan takes), the gated RMSNorm
//! over groups, and the whole mixer between its two projections with its conv and SSM state.
//! The CUDA entry point of the recurrent form (`mamba2.cu`: decode batches and sequential prefill
//! runs over per-slot state) is in `kernels`; its arguments read the device layouts and run
//! [`ssd_recurrent`]. The conv in front of it is `gated_delta`'s run conv as it stands, the gated
//! norm after it `gated_norm`'s with the gate first. These references are checked here against
//! each other.
//!
//! Per head `h` (of `heads`, each `head_dim` channels wide) and token `t`, with the head's group
//! `g = h / (heads / groups)` supplying `B_t` and `C_t` (`state_size` wide each):
//!
//! ```text
//! dt = clamp(softplus(dt_raw + dt_bias[h]), limit)      a positive step
//! A  = -exp(A_log[h])                                   a negative rate
//! H  = exp(dt A) H + dt x_t B_t^T                       H: head_dim x state_size, f32
//! y  = H C_t + D[h] x_t
//! ```
//!
//! then `out = rmsnorm_groups(y * silu(z)) * weight`. The state `H` of a sequence is
//! `heads x head_dim x state_size` f32, row-major, as transformers' `recurrent_states`.
//! Everything is f32 here; the kernels read bf16 activations and keep the state in f32.

use super::gated_delta::causal_conv1d_silu;

mod chunked;
mod kernels;

pub use chunked::{Mamba2ChunkCarry, Mamba2ChunkScan, Mamba2ChunkState};
pub use kernels::{
    MAMBA2_CHANNELS, MAMBA2_MAX_STATE, MAMBA2_STATE_LANES, MAMBA2_STATE_MULTIPLE, Mamba2Recurrent,
};

/// One Mamba-2 layer's widths.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mamba2Shape {
    /// SSM heads; each has one scalar decay per token.
    pub heads: usize,
    /// Channels per head.
    pub head_dim: usize,
    /// Width of B, C and of each channel's state (N).
    pub state_size: usize,
    /// Groups of heads sharing one B and one C; a divisor of `heads`.
    pub groups: usize,
}

impl Mamba2Shape {
    /// `heads * head_dim`: the width of x, y and z.
    pub fn inner(&self) -> usize {
        self.heads * self.head_dim
    }

    /// Channels through the conv: x, then every group's B, then every group's C.
    pub fn conv_channels(&self) -> usize {
        self.inner() + 2 * self.groups * self.state_size
    }

    /// f32 elements of one sequence's SSM state.
    pub fn state_len(&self) -> usize {
        self.inner() * self.state_size
    }

    fn group_of(&self, head: usize) -> usize {
        head / (self.heads / self.groups)
    }
}

/// The per-head parameters of the recurrence.
#[derive(Clone, Copy, Debug)]
pub struct Mamba2Params<'a> {
    /// `heads`: the log of the negated rate, `A = -exp(A_log)`.
    pub a_log: &'a [f32],
    /// `heads`: added to the projected `dt` before the softplus.
    pub dt_bias: &'a [f32],
    /// `heads`: the skip connection's scale.
    pub d: &'a [f32],
    /// `dt` after the softplus is clamped to `[lo, hi]`. transformers' kernel path takes the
    /// config's `time_step_limit` (Nemotron-H: `(0, inf)`, a no-op on a softplus); its torch path
    /// clamps below at `time_step_min` and leaves the top open.
    pub dt_limit: (f32, f32),
}

/// A sequence's inputs to the recurrence, row-major per token, after the conv.
#[derive(Clone, Copy, Debug)]
pub struct SsdInputs<'a> {
    /// `len x inner`.
    pub x: &'a [f32],
    /// `len x groups * state_size`.
    pub b: &'a [f32],
    /// `len x groups * state_size`.
    pub c: &'a [f32],
    /// `len x heads`, as projected (before the bias and the softplus).
    pub dt: &'a [f32],
}

/// `torch.nn.functional.softplus` (beta 1, threshold 20: above it, the identity).
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 { x } else { x.exp().ln_1p() }
}

impl Mamba2Params<'_> {
    /// Token `t`'s step of head `h`: `clamp(softplus(dt + dt_bias), limit)`.
    pub(crate) fn step(&self, dt_raw: f32, h: usize) -> f32 {
        softplus(dt_raw + self.dt_bias[h]).clamp(self.dt_limit.0, self.dt_limit.1)
    }

    pub(crate) fn rate(&self, h: usize) -> f32 {
        -self.a_log[h].exp()
    }
}

/// Checks the lengths of `x` against `shape` and returns the token count.
fn tokens(shape: &Mamba2Shape, x: &SsdInputs, state: &[f32]) -> usize {
    assert_eq!(
        shape.heads % shape.groups,
        0,
        "heads must be a multiple of groups"
    );
    assert_eq!(state.len(), shape.state_len());
    let len = x.dt.len() / shape.heads;
    assert_eq!(x.dt.len(), len * shape.heads);
    assert_eq!(x.x.len(), len * shape.inner());
    assert_eq!(x.b.len(), len * shape.groups * shape.state_size);
    assert_eq!(x.c.len(), len * shape.groups * shape.state_size);
    len
}

/// The recurrent form: one token at a time, `state` (`heads x head_dim x state_size`) updated in
/// place; returns `y` (`len x inner`, before the gated norm). The decode step is this with one
/// token.
pub fn ssd_recurrent(
    shape: &Mamba2Shape,
    p: &Mamba2Params,
    x: &SsdInputs,
    state: &mut [f32],
) -> Vec<f32> {
    let len = tokens(shape, x, state);
    let (pd, n, inner) = (shape.head_dim, shape.state_size, shape.inner());
    let bc = shape.groups * n;
    let mut y = vec![0.0; len * inner];
    for t in 0..len {
        for h in 0..shape.heads {
            let g = shape.group_of(h);
            let b = &x.b[t * bc + g * n..t * bc + (g + 1) * n];
            let c = &x.c[t * bc + g * n..t * bc + (g + 1) * n];
            let dt = p.step(x.dt[t * shape.heads + h], h);
            let decay = (dt * p.rate(h)).exp();
            for ch in 0..pd {
                let xv = x.x[t * inner + h * pd + ch];
                let row = &mut state[(h * pd + ch) * n..(h * pd + ch + 1) * n];
                let mut acc = 0.0;
                for ((s, bn), cn) in row.iter_mut().zip(b).zip(c) {
                    *s = decay * *s + dt * xv * bn;
                    acc += *s * cn;
                }
                y[t * inner + h * pd + ch] = acc + p.d[h] * xv;
            }
        }
    }
    y
}

/// The chunked form (SSD): the same outputs and final state as [`ssd_recurrent`], computed
/// `chunk` tokens at a time as matrix products.
///
/// Within a chunk of `c` tokens, per head, with `a_i = dt_i A` and the segment sum
/// `s_ij = a_{j+1} + ... + a_i` (`j <= i`; summed, not differenced, as transformers'
/// `segment_sum` for stability), the decay matrix is `L_ij = exp(s_ij)` and, from the state `H`
/// entering the chunk,
///
/// ```text
/// y_i   = sum_{j<=i} L_ij (C_i . B_j) dt_j x_j        intra-chunk: masked "attention"
///       + exp(a_0 + ... + a_i) H C_i                  inter-chunk: the carried state
///       + D x_i
/// H_out = exp(a_0 + ... + a_{c-1}) H + sum_j L_{c-1,j} dt_j x_j B_j^T
/// ```
pub fn ssd_chunked(
    shape: &Mamba2Shape,
    p: &Mamba2Params,
    x: &SsdInputs,
    state: &mut [f32],
    chunk: usize,
) -> Vec<f32> {
    assert!(chunk > 0);
    let len = tokens(shape, x, state);
    let (pd, n, inner) = (shape.head_dim, shape.state_size, shape.inner());
    let bc = shape.groups * n;
    let dot = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f32>();
    let mut y = vec![0.0; len * inner];
    let mut start = 0;
    while start < len {
        let c = chunk.min(len - start);
        for h in 0..shape.heads {
            let g = shape.group_of(h);
            let b_of = |i: usize| &x.b[(start + i) * bc + g * n..(start + i) * bc + (g + 1) * n];
            let c_of = |i: usize| &x.c[(start + i) * bc + g * n..(start + i) * bc + (g + 1) * n];
            let x_of = |i: usize| {
                let at = (start + i) * inner + h * pd;
                &x.x[at..at + pd]
            };
            let dt: Vec<f32> = (0..c)
                .map(|i| p.step(x.dt[(start + i) * shape.heads + h], h))
                .collect();
            let a: Vec<f32> = dt.iter().map(|dt| dt * p.rate(h)).collect();
            // L_ij = exp(a_{j+1} + ... + a_i), lower triangle with the diagonal (L_ii = 1).
            let mut decay = vec![0.0f32; c * c];
            for i in 0..c {
                let mut seg = 0.0f32;
                for j in (0..=i).rev() {
                    decay[i * c + j] = seg.exp();
                    seg += a[j];
                }
            }
            // From the chunk's start: exp(a_0 + ... + a_i).
            let mut from_start = vec![0.0f32; c];
            let mut acc = 0.0;
            for (i, ai) in a.iter().enumerate() {
                acc += ai;
                from_start[i] = acc.exp();
            }
            let h_state = &mut state[h * pd * n..(h + 1) * pd * n];
            for i in 0..c {
                let out = &mut y[(start + i) * inner + h * pd..(start + i) * inner + (h + 1) * pd];
                // Intra-chunk: M_ij = L_ij (C_i . B_j) dt_j, applied to x_j.
                for j in 0..=i {
                    let m = decay[i * c + j] * dot(c_of(i), b_of(j)) * dt[j];
                    for (o, xv) in out.iter_mut().zip(x_of(j)) {
                        *o += m * xv;
                    }
                }
                // Inter-chunk: the entering state, decayed to token i, read by C_i; the skip.
                for (ch, (o, xv)) in out.iter_mut().zip(x_of(i)).enumerate() {
                    *o += from_start[i] * dot(&h_state[ch * n..(ch + 1) * n], c_of(i));
                    *o += p.d[h] * xv;
                }
            }
            // The state leaving the chunk.
            let total = from_start[c - 1];
            h_state.iter_mut().for_each(|s| *s *= total);
            for j in 0..c {
                let w = decay[(c - 1) * c + j] * dt[j];
                for (ch, xv) in x_of(j).iter().enumerate() {
                    for (s, bn) in h_state[ch * n..(ch + 1) * n].iter_mut().zip(b_of(j)) {
                        *s += w * xv * bn;
                    }
                }
            }
        }
        start += c;
    }
    y
}

/// The gated RMSNorm after the scan (transformers' `Zamba2RMSNormGated`, the gate before the
/// norm): per token, `u = y * silu(z)`, each run of `group_size` channels of `u` divided by its
/// root mean square (with `eps` under the root), then scaled by `weight` (`y.len()` a multiple of
/// `weight.len()`, which is a multiple of `group_size`).
pub fn gated_rms_norm(
    y: &[f32],
    z: &[f32],
    weight: &[f32],
    group_size: usize,
    eps: f32,
) -> Vec<f32> {
    let width = weight.len();
    assert_eq!(y.len(), z.len());
    assert_eq!(y.len() % width, 0);
    assert_eq!(width % group_size, 0);
    let gated: Vec<f32> = y
        .iter()
        .zip(z)
        .map(|(y, z)| y * z / (1.0 + (-z).exp()))
        .collect();
    let mut out = vec![0.0; y.len()];
    for (o, u) in out
        .chunks_exact_mut(group_size)
        .zip(gated.chunks_exact(group_size))
    {
        let mean_sq = u.iter().map(|v| v * v).sum::<f32>() / group_size as f32;
        let inv = 1.0 / (mean_sq + eps).sqrt();
        for (o, v) in o.iter_mut().zip(u) {
            *o = v * inv;
        }
    }
    for row in out.chunks_exact_mut(width) {
        row.iter_mut().zip(weight).for_each(|(o, w)| *o *= w);
    }
    out
}

/// One Mamba-2 layer's weights between its two projections, as f32.
#[derive(Clone, Copy, Debug)]
pub struct Mamba2Mixer<'a> {
    /// The layer's widths.
    pub shape: Mamba2Shape,
    /// The recurrence's per-head parameters.
    pub params: Mamba2Params<'a>,
    /// The depthwise conv, `conv_channels x conv_kernel` (the checkpoint's `[C, 1, K]`).
    pub conv_weight: &'a [f32],
    /// `conv_channels`, where the config has `use_conv_bias`.
    pub conv_bias: Option<&'a [f32]>,
    /// The gated norm's weight, `inner`.
    pub norm_weight: &'a [f32],
    /// The gated norm's epsilon (`layer_norm_epsilon`).
    pub norm_eps: f32,
}

/// One sequence's recurrent state in one Mamba-2 layer.
#[derive(Clone, Debug, PartialEq)]
pub struct Mamba2State {
    /// The conv's last `conv_kernel - 1` inputs, oldest first, `(conv_kernel - 1) x
    /// conv_channels`.
    pub conv: Vec<f32>,
    /// `heads x head_dim x state_size`.
    pub ssm: Vec<f32>,
}

impl Mamba2State {
    /// The state before a sequence's first token: all zeros.
    pub fn zeroed(shape: &Mamba2Shape, conv_kernel: usize) -> Mamba2State {
        Mamba2State {
            conv: vec![0.0; (conv_kernel - 1) * shape.conv_channels()],
            ssm: vec![0.0; shape.state_len()],
        }
    }
}

/// How the scan runs: both give the same values up to the order of f32 sums.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScanForm {
    /// [`ssd_recurrent`].
    Recurrent,
    /// [`ssd_chunked`] with this chunk.
    Chunked(usize),
}

impl Mamba2Mixer<'_> {
    /// The mixer over `len` tokens of `in_proj`'s output (`len x (inner + conv_channels +
    /// heads)`: z, then x|B|C, then dt; Nemotron-H has no extra MLP columns), updating `state`;
    /// returns the gated norm's output, `len x inner`, ready for `out_proj`.
    pub fn forward(&self, projected: &[f32], state: &mut Mamba2State, form: ScanForm) -> Vec<f32> {
        let s = &self.shape;
        let (inner, conv) = (s.inner(), s.conv_channels());
        let width = inner + conv + s.heads;
        assert_eq!(projected.len() % width, 0);
        let len = projected.len() / width;
        let column = |from: usize, to: usize| -> Vec<f32> {
            projected
                .chunks_exact(width)
                .flat_map(|row| row[from..to].iter().copied())
                .collect()
        };
        let z = column(0, inner);
        let xbc = column(inner, inner + conv);
        let dt = column(inner + conv, width);
        let xbc = causal_conv1d_silu(
            &xbc,
            conv,
            self.conv_weight,
            self.conv_bias,
            &mut state.conv,
        );
        let bc = s.groups * s.state_size;
        let part = |from: usize, to: usize| -> Vec<f32> {
            xbc.chunks_exact(conv)
                .flat_map(|row| row[from..to].iter().copied())
                .collect()
        };
        let (x, b, c) = (
            part(0, inner),
            part(inner, inner + bc),
            part(inner + bc, conv),
        );
        debug_assert_eq!(x.len(), len * inner);
        let inputs = SsdInputs {
            x: &x,
            b: &b,
            c: &c,
            dt: &dt,
        };
        let y = match form {
            ScanForm::Recurrent => ssd_recurrent(s, &self.params, &inputs, &mut state.ssm),
            ScanForm::Chunked(chunk) => {
                ssd_chunked(s, &self.params, &inputs, &mut state.ssm, chunk)
            }
        };
        gated_rms_norm(&y, &z, self.norm_weight, inner / s.groups, self.norm_eps)
    }
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

    fn max_diff(a: &[f32], b: &[f32]) -> f32 {
        assert_eq!(a.len(), b.len());
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f32::max)
    }

    /// Four heads in two groups: heads 0, 1 read group 0's B and C, heads 2, 3 group 1's.
    const SHAPE: Mamba2Shape = Mamba2Shape {
        heads: 4,
        head_dim: 3,
        state_size: 5,
        groups: 2,
    };

    struct Params {
        a_log: Vec<f32>,
        dt_bias: Vec<f32>,
        d: Vec<f32>,
    }

    impl Params {
        fn random(rng: &mut Rng, heads: usize) -> Params {
            Params {
                // Rates from 1 to e^1.5 (A = -exp(A_log)), as log(1..heads) initialises them.
                a_log: (0..heads).map(|_| 0.75 + 0.75 * rng.next()).collect(),
                dt_bias: rng.vec(heads),
                d: rng.vec(heads),
            }
        }
        fn view(&self) -> Mamba2Params<'_> {
            Mamba2Params {
                a_log: &self.a_log,
                dt_bias: &self.dt_bias,
                d: &self.d,
                dt_limit: (0.0, f32::INFINITY),
            }
        }
    }

    struct Sequence {
        x: Vec<f32>,
        b: Vec<f32>,
        c: Vec<f32>,
        dt: Vec<f32>,
    }

    impl Sequence {
        fn random(rng: &mut Rng, s: &Mamba2Shape, len: usize) -> Sequence {
            let bc = s.groups * s.state_size;
            Sequence {
                x: rng.vec(len * s.inner()),
                b: rng.vec(len * bc),
                c: rng.vec(len * bc),
                dt: rng.vec(len * s.heads),
            }
        }
        fn inputs(&self, s: &Mamba2Shape, t: std::ops::Range<usize>) -> SsdInputs<'_> {
            let bc = s.groups * s.state_size;
            SsdInputs {
                x: &self.x[t.start * s.inner()..t.end * s.inner()],
                b: &self.b[t.start * bc..t.end * bc],
                c: &self.c[t.start * bc..t.end * bc],
                dt: &self.dt[t.start * s.heads..t.end * s.heads],
            }
        }
    }

    #[test]
    fn one_step_by_hand() {
        // One head, one channel, N = 2, from H = (1, -1): dt = softplus(0.5 + 0.5) = ln(1 + e),
        // A = -2, H = e^{-2 dt} H + dt x B, y = H . C + D x.
        let shape = Mamba2Shape {
            heads: 1,
            head_dim: 1,
            state_size: 2,
            groups: 1,
        };
        let p = Mamba2Params {
            a_log: &[2f32.ln()],
            dt_bias: &[0.5],
            d: &[0.25],
            dt_limit: (0.0, f32::INFINITY),
        };
        let (x, b, c) = (2.0f32, [1.0f32, 3.0], [0.5f32, -1.0]);
        let inputs = SsdInputs {
            x: &[x],
            b: &b,
            c: &c,
            dt: &[0.5],
        };
        let mut state = vec![1.0, -1.0];
        let y = ssd_recurrent(&shape, &p, &inputs, &mut state);
        let dt = 1f32.exp().ln_1p();
        let decay = (-2.0 * dt).exp();
        let h = [decay + dt * x * b[0], -decay + dt * x * b[1]];
        assert!(max_diff(&state, &h) < 1e-6, "{state:?} vs {h:?}");
        let want = h[0] * c[0] + h[1] * c[1] + 0.25 * x;
        assert!((y[0] - want).abs() < 1e-5, "{} vs {want}", y[0]);
    }

    #[test]
    fn the_step_is_clamped_to_the_limit() {
        let p = Mamba2Params {
            a_log: &[0.0],
            dt_bias: &[0.0],
            d: &[0.0],
            dt_limit: (0.01, 0.5),
        };
        assert_eq!(p.step(-30.0, 0), 0.01);
        assert_eq!(p.step(30.0, 0), 0.5);
        assert!((p.step(-1.0, 0) - (-1f32).exp().ln_1p()).abs() < 1e-7);
        assert_eq!(softplus(25.0), 25.0);
    }

    #[test]
    fn the_chunked_form_equals_the_recurrent_one() {
        let mut rng = Rng(0x2545_f491_4f6c_dd1d);
        let len = 37;
        let params = Params::random(&mut rng, SHAPE.heads);
        let seq = Sequence::random(&mut rng, &SHAPE, len);
        let initial = rng.vec(SHAPE.state_len());
        let mut want_state = initial.clone();
        let want = ssd_recurrent(
            &SHAPE,
            &params.view(),
            &seq.inputs(&SHAPE, 0..len),
            &mut want_state,
        );
        for chunk in [1, 3, 8, 16, 64] {
            let mut state = initial.clone();
            let got = ssd_chunked(
                &SHAPE,
                &params.view(),
                &seq.inputs(&SHAPE, 0..len),
                &mut state,
                chunk,
            );
            assert!(max_diff(&got, &want) < 1e-4, "chunk {chunk}: outputs");
            assert!(max_diff(&state, &want_state) < 1e-4, "chunk {chunk}: state");
        }
    }

    #[test]
    fn the_groups_select_their_own_b_and_c() {
        // With group 1's B and C zeroed, heads 2 and 3 see only the decayed state and the skip;
        // heads 0 and 1 are unchanged.
        let mut rng = Rng(99);
        let len = 6;
        let params = Params::random(&mut rng, SHAPE.heads);
        let seq = Sequence::random(&mut rng, &SHAPE, len);
        let mut muted = Sequence {
            x: seq.x.clone(),
            b: seq.b.clone(),
            c: seq.c.clone(),
            dt: seq.dt.clone(),
        };
        let n = SHAPE.state_size;
        for t in 0..len {
            let g1 = t * 2 * n + n..(t + 1) * 2 * n;
            muted.b[g1.clone()].fill(0.0);
            muted.c[g1].fill(0.0);
        }
        let mut s0 = vec![0.0; SHAPE.state_len()];
        let mut s1 = vec![0.0; SHAPE.state_len()];
        let y = ssd_recurrent(&SHAPE, &params.view(), &seq.inputs(&SHAPE, 0..len), &mut s0);
        let ym = ssd_recurrent(
            &SHAPE,
            &params.view(),
            &muted.inputs(&SHAPE, 0..len),
            &mut s1,
        );
        let half = SHAPE.inner() / 2;
        for t in 0..len {
            let row = t * SHAPE.inner();
            assert_eq!(y[row..row + half], ym[row..row + half]);
            for h in 2..4 {
                for ch in 0..SHAPE.head_dim {
                    let at = row + h * SHAPE.head_dim + ch;
                    assert!((ym[at] - params.d[h] * seq.x[at]).abs() < 1e-6);
                }
            }
        }
    }

    #[test]
    fn the_gated_norm_equals_a_written_out_one() {
        // Width 4 in two groups of 2, two tokens.
        let y = [1.0f32, -2.0, 0.5, 3.0, 0.0, 1.0, -1.0, 2.0];
        let z = [0.5f32, 1.0, -2.0, 0.0, 3.0, -0.5, 1.5, 2.0];
        let w = [1.0f32, 2.0, 0.5, -1.0];
        let eps = 1e-5;
        let got = gated_rms_norm(&y, &z, &w, 2, eps);
        let silu = |v: f32| v / (1.0 + (-v).exp());
        let mut want = Vec::new();
        for t in 0..2 {
            for g in 0..2 {
                let at = t * 4 + g * 2;
                let (u0, u1) = (y[at] * silu(z[at]), y[at + 1] * silu(z[at + 1]));
                let r = ((u0 * u0 + u1 * u1) / 2.0 + eps).sqrt();
                want.push(u0 / r * w[g * 2]);
                want.push(u1 / r * w[g * 2 + 1]);
            }
        }
        assert!(max_diff(&got, &want) < 1e-6, "{got:?} vs {want:?}");
        // One group over the whole width is another norm.
        let whole = gated_rms_norm(&y, &z, &w, 4, eps);
        assert!(max_diff(&whole, &want) > 1e-2);
    }

    struct Weights {
        params: Params,
        conv_weight: Vec<f32>,
        conv_bias: Vec<f32>,
        norm_weight: Vec<f32>,
    }

    impl Weights {
        fn mixer(&self) -> Mamba2Mixer<'_> {
            Mamba2Mixer {
                shape: SHAPE,
                params: self.params.view(),
                conv_weight: &self.conv_weight,
                conv_bias: Some(&self.conv_bias),
                norm_weight: &self.norm_weight,
                norm_eps: 1e-5,
            }
        }
    }

    #[test]
    fn a_run_split_in_two_with_the_state_carried_equals_one_pass() {
        let mut rng = Rng(4242);
        let kernel = 4;
        let conv = SHAPE.conv_channels();
        let weights = Weights {
            params: Params::random(&mut rng, SHAPE.heads),
            conv_weight: rng.vec(conv * kernel),
            conv_bias: rng.vec(conv),
            norm_weight: rng.vec(SHAPE.inner()),
        };
        let mixer = weights.mixer();
        let (len, split) = (23, 9);
        let width = SHAPE.inner() + conv + SHAPE.heads;
        let projected = rng.vec(len * width);
        let mut whole_state = Mamba2State::zeroed(&SHAPE, kernel);
        let whole = mixer.forward(&projected, &mut whole_state, ScanForm::Chunked(8));
        // A prefill chunk (chunked at 4), a second chunk (chunked at 5), then decode steps.
        let mut state = Mamba2State::zeroed(&SHAPE, kernel);
        let mut out = mixer.forward(
            &projected[..split * width],
            &mut state,
            ScanForm::Chunked(4),
        );
        out.extend(mixer.forward(
            &projected[split * width..(len - 3) * width],
            &mut state,
            ScanForm::Chunked(5),
        ));
        for t in len - 3..len {
            let row = &projected[t * width..(t + 1) * width];
            out.extend(mixer.forward(row, &mut state, ScanForm::Recurrent));
        }
        assert!(max_diff(&out, &whole) < 1e-4, "{}", max_diff(&out, &whole));
        assert!(max_diff(&state.ssm, &whole_state.ssm) < 1e-4);
        assert_eq!(state.conv, whole_state.conv);
        // Restarting the second part from a zeroed state instead is visibly different.
        let mut fresh = Mamba2State::zeroed(&SHAPE, kernel);
        let restarted = mixer.forward(&projected[split * width..], &mut fresh, ScanForm::Recurrent);
        assert!(max_diff(&restarted, &whole[split * SHAPE.inner()..]) > 1e-2);
    }
}
