// SPDX-License-Identifier: MIT OR Apache-2.0
//! The Gated DeltaNet entry points (`gated_delta.cu`): their arguments, launch geometry and host
//! references, which read the device layouts and run the f32 references of the parent module.
//!
//! Layouts (elements): the conv's input is bf16 rows of `x_stride` elements a token, its `channels`
//! first (so it can read q | k | v out of a wider projection row), its output bf16
//! `[tokens, channels]`; the conv state is bf16 `[slots, kernel - 1, channels]`, oldest input
//! first; the recurrent state `S` is f32 `[slots, hv, dk, dv]`; q, k and v are bf16 rows of
//! `qkv_stride` elements a token (the conv's output, q | k | v), key head `kh` at `kh * dk`, value
//! head `h` at `h * dv` of `v`; `g` and `beta` are f32 `[tokens, hv]`; the output is bf16
//! `[tokens, hv, dv]`. Value head `h` reads key head `h / (hv / hk)`.
//!
//! Fresh sequences: each launch takes the tokens' positions, and a run (a decode row, a prefill
//! chunk) whose first token is at position 0 starts from zero conv and recurrent states whatever
//! its slot holds, so that a slot freed by one sequence is taken by the next without a clear. The
//! state is written back as for any other run.

use half::bf16;
use metrale_core::{DevicePtr, KernelName, LaunchConfig};

use super::{GatedDeltaInputs, causal_conv1d_silu, gated_delta_recurrent};
use crate::host::{self, HostError, HostMemory, Kernel, KernelAbi, kernel_args};
use crate::names;
use crate::ops::blocks_for;

/// Widest conv the kernels take (`CONV_MAX_KERNEL` in `gated_delta.cu`).
pub const GDN_CONV_MAX_KERNEL: u32 = 8;
/// Tokens one thread of [`GdnConv1d`] walks (`CONV_CHUNK`).
pub const GDN_CONV_CHUNK: u32 = 16;
/// Widest key head [`GdnRecurrent`] takes (`GDN_MAX_DK`): a column of `S` in two lanes'
/// registers.
pub const GDN_MAX_DK: u32 = 128;
/// Columns of `S` one block (one warp) of [`GdnRecurrent`] owns (`GDN_COLS`).
pub const GDN_RECURRENT_COLS: u32 = 16;

const CONV_THREADS: u32 = 256;

kernel_args!(
    /// One decode token a row, each row its own sequence: `out[r] = silu(bias + conv over the
    /// state in slot slots[r] then x[r])`, and that state shifted by one input. Rows' slots are
    /// distinct; a row at position 0 reads its old state as zeros.
    GdnConv1dStep => names::gated_delta::GDN_CONV1D_STEP {
        /// bf16 `[rows, channels]`.
        out: DevicePtr,
        /// bf16, row `r` at `r * x_stride`: the q|k|v projection.
        x: DevicePtr,
        /// bf16 `[slots, kernel - 1, channels]`, updated.
        conv_state: DevicePtr,
        /// bf16 `[channels, kernel]`.
        weight: DevicePtr,
        /// bf16 `[channels]`, or null for none.
        bias: DevicePtr,
        /// i32 `[rows]`: each row's state slot.
        slots: DevicePtr,
        /// i32 `[rows]`: each row's token position; 0 starts from a zero state.
        positions: DevicePtr,
        /// Rows (sequences).
        rows: u32,
        /// Channels (`2 * hk * dk + hv * dv`).
        channels: u32,
        /// Elements from one row of `x` to the next, at least `channels`.
        x_stride: u32,
        /// Conv width, 2 to [`GDN_CONV_MAX_KERNEL`].
        kernel: u32,
    }
);

kernel_args!(
    /// Runs of tokens, each of one sequence, through the conv, from and back into each run's
    /// state: run `s` is rows `seq_starts[s] .. seq_starts[s + 1]` of `x` and `out`, its state in
    /// slot `slots[s]` (distinct), read as zeros when `positions[seq_starts[s]] == 0`. Prefill
    /// chunks, or a whole step with its decode rows as runs of one (the addressing of
    /// [`GdnRecurrent`]). An empty run leaves its state as it is.
    GdnConv1d => names::gated_delta::GDN_CONV1D {
        /// bf16 `[tokens, channels]`.
        out: DevicePtr,
        /// bf16, token `t` at `t * x_stride`.
        x: DevicePtr,
        /// bf16 `[slots, kernel - 1, channels]`, updated.
        conv_state: DevicePtr,
        /// bf16 `[channels, kernel]`.
        weight: DevicePtr,
        /// bf16 `[channels]`, or null for none.
        bias: DevicePtr,
        /// i32 `[seqs + 1]`: each run's first row, then the total.
        seq_starts: DevicePtr,
        /// i32 `[seqs]`: each run's state slot.
        slots: DevicePtr,
        /// i32 `[tokens]`: each token's position (only each run's first is read).
        positions: DevicePtr,
        /// Runs.
        seqs: u32,
        /// The longest run (sizes the grid; a longer run is cut short).
        max_len: u32,
        /// Channels.
        channels: u32,
        /// Elements from one token's row of `x` to the next, at least `channels`.
        x_stride: u32,
        /// Conv width, 2 to [`GDN_CONV_MAX_KERNEL`].
        kernel: u32,
    }
);

kernel_args!(
    /// The gated delta rule over each sequence's tokens in order (q and k L2-normalised, q scaled
    /// by `dk^-1/2`), from and back into the f32 state in the sequence's slot: sequence `s` owns
    /// tokens `seq_starts[s] .. seq_starts[s + 1]` and slot `slots[s]` (distinct), and starts
    /// from `S = 0` instead of its slot when `positions[seq_starts[s]] == 0`. A decode batch is
    /// runs of one token; a prefill chunk one run, walked token by token.
    GdnRecurrent => names::gated_delta::GDN_RECURRENT {
        /// bf16 `[tokens, hv, dv]`.
        o: DevicePtr,
        /// f32 `[slots, hv, dk, dv]`, updated.
        state: DevicePtr,
        /// bf16 queries, token `t`'s key head `kh` at `t * qkv_stride + kh * dk`.
        q: DevicePtr,
        /// bf16 keys, as `q`.
        k: DevicePtr,
        /// bf16 values, token `t`'s head `h` at `t * qkv_stride + h * dv`.
        v: DevicePtr,
        /// f32 `[tokens, hv]`: log-decays, `<= 0`.
        g: DevicePtr,
        /// f32 `[tokens, hv]`: write strengths.
        beta: DevicePtr,
        /// i32 `[seqs + 1]`: each sequence's first token, then the total.
        seq_starts: DevicePtr,
        /// i32 `[seqs]`: each sequence's state slot.
        slots: DevicePtr,
        /// i32 `[tokens]`: each token's position (only each sequence's first is read).
        positions: DevicePtr,
        /// Sequences.
        seqs: u32,
        /// Value heads.
        hv: u32,
        /// Key heads (dividing `hv`).
        hk: u32,
        /// Key width, at most [`GDN_MAX_DK`].
        dk: u32,
        /// Value width.
        dv: u32,
        /// Elements from one token's q (k, v) row to the next.
        qkv_stride: u32,
    }
);

/// A refusal of `kernel`'s arguments.
pub(super) fn bad_args(kernel: KernelName, message: String) -> HostError {
    HostError::BadArgs { kernel, message }
}

fn check_kernel(name: KernelName, kernel: u32) -> Result<(), HostError> {
    if !(2..=GDN_CONV_MAX_KERNEL).contains(&kernel) {
        return Err(bad_args(
            name,
            format!("conv width {kernel} outside 2..={GDN_CONV_MAX_KERNEL}"),
        ));
    }
    Ok(())
}

/// A bf16 tensor at `ptr + offset` elements.
pub(super) fn at_bf16(ptr: DevicePtr, offset: usize) -> DevicePtr {
    ptr.offset(offset * std::mem::size_of::<bf16>())
}

/// The position of token `index` (a run's first): 0 starts a sequence.
pub(super) fn position_at(
    mem: &dyn HostMemory,
    positions: DevicePtr,
    index: usize,
) -> Result<i32, HostError> {
    Ok(host::load::<i32>(mem, positions.offset(index * std::mem::size_of::<i32>()), 1)?[0])
}

/// What every run of one conv launch shares: the state buffer, the weights (f32) and the widths.
struct ConvLaunch {
    conv_state: DevicePtr,
    weight: Vec<f32>,
    bias: Option<Vec<f32>>,
    channels: usize,
    x_stride: usize,
}

impl ConvLaunch {
    #[allow(clippy::too_many_arguments)]
    fn load(
        name: KernelName,
        mem: &dyn HostMemory,
        conv_state: DevicePtr,
        weight: DevicePtr,
        bias: DevicePtr,
        channels: u32,
        x_stride: u32,
        kernel: u32,
    ) -> Result<ConvLaunch, HostError> {
        check_kernel(name, kernel)?;
        if x_stride < channels {
            return Err(bad_args(
                name,
                format!("x_stride {x_stride} < channels {channels}"),
            ));
        }
        let (channels, kernel) = (channels as usize, kernel as usize);
        let weight_f32 = host::load_bf16(mem, weight, channels * kernel)?;
        let bias = if bias.is_null() {
            None
        } else {
            Some(host::load_bf16(mem, bias, channels)?)
        };
        Ok(ConvLaunch {
            conv_state,
            weight: weight_f32,
            bias,
            channels,
            x_stride: x_stride as usize,
        })
    }

    /// The conv of one run of `len` tokens (`x` rows `x_stride` apart, `out` contiguous) over the
    /// state in `slot`, read as zeros when `fresh` (f32 inputs, the state rounded back to bf16,
    /// which is exact: it holds bf16 inputs or zeros).
    fn run(
        &self,
        mem: &mut dyn HostMemory,
        out: DevicePtr,
        x: DevicePtr,
        slot: usize,
        len: usize,
        fresh: bool,
    ) -> Result<(), HostError> {
        let channels = self.channels;
        let taps = self.weight.len() / channels.max(1) - 1;
        let state_at = at_bf16(self.conv_state, slot * taps * channels);
        let mut state = if fresh {
            vec![0.0; taps * channels]
        } else {
            host::load_bf16(mem, state_at, taps * channels)?
        };
        let mut xs = Vec::with_capacity(len * channels);
        for t in 0..len {
            xs.extend(host::load_bf16(
                mem,
                at_bf16(x, t * self.x_stride),
                channels,
            )?);
        }
        let y = causal_conv1d_silu(
            &xs,
            channels,
            &self.weight,
            self.bias.as_deref(),
            &mut state,
        );
        host::store_bf16(mem, out, &y)?;
        host::store_bf16(mem, state_at, &state)
    }
}

impl Kernel for GdnConv1dStep {
    fn launch_config(&self) -> LaunchConfig {
        LaunchConfig {
            grid: [
                blocks_for(self.channels.into(), CONV_THREADS).max(1),
                self.rows.max(1),
                1,
            ],
            block: [CONV_THREADS, 1, 1],
            shared_mem_bytes: 0,
        }
    }
    fn reference(&self, mem: &mut dyn HostMemory) -> Result<(), HostError> {
        let conv = ConvLaunch::load(
            Self::NAME,
            mem,
            self.conv_state,
            self.weight,
            self.bias,
            self.channels,
            self.x_stride,
            self.kernel,
        )?;
        let rows = self.rows as usize;
        let slots = host::load::<i32>(mem, self.slots, rows)?;
        let positions = host::load::<i32>(mem, self.positions, rows)?;
        for (r, &slot) in slots.iter().enumerate() {
            let slot = usize::try_from(slot)
                .map_err(|_| bad_args(Self::NAME, format!("row {r}: slot {slot} < 0")))?;
            conv.run(
                mem,
                at_bf16(self.out, r * conv.channels),
                at_bf16(self.x, r * conv.x_stride),
                slot,
                1,
                positions[r] == 0,
            )?;
        }
        Ok(())
    }
}

impl Kernel for GdnConv1d {
    fn launch_config(&self) -> LaunchConfig {
        LaunchConfig {
            grid: [
                blocks_for(self.channels.into(), CONV_THREADS).max(1),
                self.max_len.div_ceil(GDN_CONV_CHUNK).max(1),
                self.seqs.max(1),
            ],
            block: [CONV_THREADS, 1, 1],
            shared_mem_bytes: 0,
        }
    }
    fn reference(&self, mem: &mut dyn HostMemory) -> Result<(), HostError> {
        let conv = ConvLaunch::load(
            Self::NAME,
            mem,
            self.conv_state,
            self.weight,
            self.bias,
            self.channels,
            self.x_stride,
            self.kernel,
        )?;
        let seqs = self.seqs as usize;
        let starts = host::load::<i32>(mem, self.seq_starts, seqs + 1)?;
        let slots = host::load::<i32>(mem, self.slots, seqs)?;
        for s in 0..seqs {
            let (begin, end, slot) = (starts[s], starts[s + 1], slots[s]);
            let (Ok(b0), Ok(e0), Ok(slot)) = (
                usize::try_from(begin),
                usize::try_from(end),
                usize::try_from(slot),
            ) else {
                return Err(bad_args(
                    Self::NAME,
                    format!("run {s}: rows {begin}..{end}, slot {slot}"),
                ));
            };
            if b0 > e0 || e0 - b0 > self.max_len as usize {
                return Err(bad_args(
                    Self::NAME,
                    format!("run {s}: rows {begin}..{end}, max_len {}", self.max_len),
                ));
            }
            if e0 == b0 {
                // No first token, so no position: the state stays as it is (as on the GPU).
                continue;
            }
            let fresh = position_at(mem, self.positions, b0)? == 0;
            conv.run(
                mem,
                at_bf16(self.out, b0 * conv.channels),
                at_bf16(self.x, b0 * conv.x_stride),
                slot,
                e0 - b0,
                fresh,
            )?;
        }
        Ok(())
    }
}

impl Kernel for GdnRecurrent {
    fn launch_config(&self) -> LaunchConfig {
        LaunchConfig {
            grid: [
                blocks_for(self.dv.into(), GDN_RECURRENT_COLS).max(1),
                self.hv.max(1),
                self.seqs.max(1),
            ],
            block: [32, 1, 1],
            shared_mem_bytes: 0,
        }
    }
    fn reference(&self, mem: &mut dyn HostMemory) -> Result<(), HostError> {
        let (hv, hk, dk, dv) = (
            self.hv as usize,
            self.hk as usize,
            self.dk as usize,
            self.dv as usize,
        );
        if dk == 0 || self.dk > GDN_MAX_DK || hk == 0 || hv % hk != 0 {
            return Err(bad_args(
                Self::NAME,
                format!("dk = {dk} (1..={GDN_MAX_DK}), hv = {hv} a multiple of hk = {hk}"),
            ));
        }
        let seqs = self.seqs as usize;
        let stride = self.qkv_stride as usize;
        let starts = host::load::<i32>(mem, self.seq_starts, seqs + 1)?;
        let slots = host::load::<i32>(mem, self.slots, seqs)?;
        let tokens = usize::try_from(starts[seqs]).unwrap_or(0);
        let g = host::load::<f32>(mem, self.g, tokens * hv)?;
        let beta = host::load::<f32>(mem, self.beta, tokens * hv)?;
        let head_bytes = dk * dv * std::mem::size_of::<f32>();
        for s in 0..seqs {
            let (begin, end) = (starts[s], starts[s + 1]);
            let (Ok(begin), Ok(end), Ok(slot)) = (
                usize::try_from(begin),
                usize::try_from(end),
                usize::try_from(slots[s]),
            ) else {
                return Err(bad_args(
                    Self::NAME,
                    format!("sequence {s}: tokens {begin}..{end}, slot {}", slots[s]),
                ));
            };
            if begin > end || end > tokens {
                return Err(bad_args(
                    Self::NAME,
                    format!("sequence {s}: tokens {begin}..{end} of {tokens}"),
                ));
            }
            let len = end - begin;
            let fresh = len > 0 && position_at(mem, self.positions, begin)? == 0;
            for h in 0..hv {
                let kh = h / (hv / hk);
                let (mut q, mut k, mut v) = (
                    Vec::with_capacity(len * dk),
                    Vec::with_capacity(len * dk),
                    Vec::with_capacity(len * dv),
                );
                for t in begin..end {
                    q.extend(host::load_bf16(
                        mem,
                        at_bf16(self.q, t * stride + kh * dk),
                        dk,
                    )?);
                    k.extend(host::load_bf16(
                        mem,
                        at_bf16(self.k, t * stride + kh * dk),
                        dk,
                    )?);
                    v.extend(host::load_bf16(
                        mem,
                        at_bf16(self.v, t * stride + h * dv),
                        dv,
                    )?);
                }
                let gs: Vec<f32> = (begin..end).map(|t| g[t * hv + h]).collect();
                let betas: Vec<f32> = (begin..end).map(|t| beta[t * hv + h]).collect();
                let state_at = self.state.offset((slot * hv + h) * head_bytes);
                let mut state = if fresh {
                    vec![0.0; dk * dv]
                } else {
                    host::load::<f32>(mem, state_at, dk * dv)?
                };
                let inputs = GatedDeltaInputs {
                    dk,
                    dv,
                    q: &q,
                    k: &k,
                    v: &v,
                    g: &gs,
                    beta: &betas,
                };
                let out = gated_delta_recurrent(&inputs, &mut state);
                host::store(mem, state_at, &state)?;
                for (i, t) in (begin..end).enumerate() {
                    host::store_bf16(
                        mem,
                        at_bf16(self.o, (t * hv + h) * dv),
                        &out[i * dv..(i + 1) * dv],
                    )?;
                }
            }
        }
        Ok(())
    }
}

kernel_args!(
    /// The gated delta rule's decay and write strength of every (token, value head), as
    /// Qwen3-Next computes them from its `ba` product: `g = -exp(a_log[h]) * softplus(a +
    /// dt_bias[h])`, `beta = sigmoid(b)`, f32; `b` and `a` of head `h = kh * (hv / hk) + j` at
    /// `kh * 2 (hv / hk) + j` and that `+ hv / hk` of the token's row (the checkpoint's grouping
    /// per key head), token `t`'s row at `ba + t * ba_stride`.
    GdnGating => names::gated_delta::GDN_GATING {
        /// f32 `[tokens, hv]`.
        g: DevicePtr,
        /// f32 `[tokens, hv]`.
        beta: DevicePtr,
        /// bf16, token `t`'s `2 hv` values at `t * ba_stride`.
        ba: DevicePtr,
        /// f32 `[hv]`.
        a_log: DevicePtr,
        /// f32 `[hv]`.
        dt_bias: DevicePtr,
        /// Tokens.
        tokens: u32,
        /// Value heads.
        hv: u32,
        /// Key heads (divides `hv`).
        hk: u32,
        /// Elements from one token's row of `ba` to the next, at least `2 hv` (`2 hv` when `ba`
        /// is a product of its own, more when b and a are columns of a wider projection row).
        ba_stride: u32,
    }
);

/// PyTorch's softplus (beta 1, threshold 20).
fn softplus(x: f32) -> f32 {
    if x > 20.0 { x } else { x.exp().ln_1p() }
}

impl Kernel for GdnGating {
    fn launch_config(&self) -> LaunchConfig {
        let n = u64::from(self.tokens) * u64::from(self.hv);
        LaunchConfig::linear(blocks_for(n.max(1), 256), 256)
    }
    fn reference(&self, mem: &mut dyn HostMemory) -> Result<(), HostError> {
        let (tokens, hv, hk) = (self.tokens as usize, self.hv as usize, self.hk as usize);
        if hk == 0 || hv % hk != 0 {
            return Err(bad_args(
                Self::NAME,
                format!("hv = {hv} must be a multiple of hk = {hk}"),
            ));
        }
        let (per, stride) = (hv / hk, self.ba_stride as usize);
        if stride < 2 * hv {
            return Err(bad_args(
                Self::NAME,
                format!("ba_stride {stride} < 2 hv = {}", 2 * hv),
            ));
        }
        let a_log = host::load::<f32>(mem, self.a_log, hv)?;
        let dt_bias = host::load::<f32>(mem, self.dt_bias, hv)?;
        let (mut g, mut beta) = (vec![0f32; tokens * hv], vec![0f32; tokens * hv]);
        for t in 0..tokens {
            let row = host::load_bf16(mem, at_bf16(self.ba, t * stride), 2 * hv)?;
            for h in 0..hv {
                let (kh, j) = (h / per, h % per);
                let (b, a) = (row[kh * 2 * per + j], row[kh * 2 * per + per + j]);
                g[t * hv + h] = -a_log[h].exp() * softplus(a + dt_bias[h]);
                beta[t * hv + h] = 1.0 / (1.0 + (-b).exp());
            }
        }
        host::store(mem, self.g, &g)?;
        host::store(mem, self.beta, &beta)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::round_bf16;
    use crate::ops::testing::*;

    #[test]
    fn the_step_conv_reads_and_shifts_its_rows_slot() {
        // Two channels, width 3 (2 taps), two slots; the row takes slot 1.
        let mut m = FlatMemory::new();
        let x = m.put(&bf16s(&[1.0, -2.0]));
        let out = m.put(&bf16s(&[0.0; 2]));
        // slot 0 then slot 1, each [taps, channels], oldest first.
        let state = m.put(&bf16s(&[9.0, 9.0, 9.0, 9.0, 0.5, 0.25, 2.0, 1.0]));
        let weight = m.put(&bf16s(&[1.0, 2.0, 3.0, -1.0, 0.5, 1.0]));
        let slots = m.put(&[1i32]);
        let positions = m.put(&[7i32]);
        GdnConv1dStep {
            out,
            x,
            conv_state: state,
            weight,
            bias: DevicePtr::NULL,
            slots,
            positions,
            rows: 1,
            channels: 2,
            x_stride: 2,
            kernel: 3,
        }
        .reference(&mut m)
        .unwrap();
        let silu = |z: f32| z / (1.0 + (-z).exp());
        let want = [
            round_bf16(silu(0.5 + 2.0 * 2.0 + 3.0 * 1.0)),
            round_bf16(silu(-0.25 + 0.5 * 1.0 - 2.0)),
        ];
        assert_eq!(f32s(&m.get(out, 2)), want);
        assert_eq!(
            f32s(&m.get(state, 8)),
            [9.0, 9.0, 9.0, 9.0, 2.0, 1.0, 1.0, -2.0]
        );
    }

    #[test]
    fn the_recurrent_kernel_maps_value_heads_onto_key_heads() {
        // hv = 4 over hk = 2: value heads 0 and 1 read key head 0, heads 2 and 3 key head 1 (the
        // reference's repeat_interleave). From a zero state the output is
        // beta (q.k) v / sqrt(dk) per head, q and k normalised.
        let mut m = FlatMemory::new();
        let (dk, dv) = (2usize, 1usize);
        // One token's row: q (2 key heads x dk), k (2 x dk), v (4 value heads x dv).
        let row = m.put(&bf16s(&[
            3.0, 4.0, 1.0, 0.0, // q
            0.0, 2.0, 5.0, 0.0, // k
            1.0, -2.0, 0.5, 4.0, // v
        ]));
        let o = m.put(&bf16s(&[0.0; 4]));
        let state = m.put(&[0f32; 4]);
        let g = m.put(&[-0.5f32, -1.0, -0.1, -2.0]);
        let beta = m.put(&[0.25f32, 0.5, 0.75, 1.0]);
        let starts = m.put(&[0i32, 1]);
        let slots = m.put(&[0i32]);
        let positions = m.put(&[0i32]);
        GdnRecurrent {
            o,
            state,
            q: row,
            k: row.offset(2 * 2 * dk),
            v: row.offset(2 * 4 * dk),
            g,
            beta,
            seq_starts: starts,
            slots,
            positions,
            seqs: 1,
            hv: 4,
            hk: 2,
            dk: dk as u32,
            dv: dv as u32,
            qkv_stride: 12,
        }
        .reference(&mut m)
        .unwrap();
        // Key head 0: q/|q| = (0.6, 0.8), k/|k| = (0, 1); key head 1: both (1, 0).
        let qk = [0.8 / 2f32.sqrt(), 1.0 / 2f32.sqrt()];
        let want = [
            round_bf16(0.25 * qk[0]),
            round_bf16(0.5 * qk[0] * -2.0),
            round_bf16(0.75 * qk[1] * 0.5),
            round_bf16(qk[1] * 4.0),
        ];
        let got = f32s(&m.get(o, 4));
        for (g, w) in got.iter().zip(&want) {
            assert!((g - w).abs() <= 1e-2 * w.abs(), "{got:?} vs {want:?}");
        }
    }

    /// The gating reads each value head's b and a where the checkpoint groups them (per key
    /// head: its b values, then its a values), and takes softplus's linear branch above 20.
    #[test]
    fn gating_reads_b_and_a_per_key_head() {
        let mut m = FlatMemory::new();
        // hv = 4 over hk = 2: key head 0 holds b0 b1 a0 a1, key head 1 b2 b3 a2 a3.
        let ba = m.put(&bf16s(&[0.0, 1.0, 0.5, 30.0, -1.0, 2.0, -0.5, 0.0]));
        let (g, beta) = (m.put(&[0f32; 4]), m.put(&[0f32; 4]));
        let a_log = m.put(&[0f32, 0.0, (2f32).ln(), 0.0]);
        let dt_bias = m.put(&[0f32; 4]);
        GdnGating {
            g,
            beta,
            ba,
            a_log,
            dt_bias,
            tokens: 1,
            hv: 4,
            hk: 2,
            ba_stride: 8,
        }
        .reference(&mut m)
        .unwrap();
        let sigmoid = |x: f32| 1.0 / (1.0 + (-x).exp());
        let softplus = |x: f32| (1.0 + x.exp()).ln();
        let want_beta = [sigmoid(0.0), sigmoid(1.0), sigmoid(-1.0), sigmoid(2.0)];
        let want_g = [-softplus(0.5), -30.0, -2.0 * softplus(-0.5), -softplus(0.0)];
        let (got_g, got_beta) = (m.get::<f32>(g, 4), m.get::<f32>(beta, 4));
        for h in 0..4 {
            assert!(
                (got_beta[h] - want_beta[h]).abs() < 1e-6,
                "beta {got_beta:?}"
            );
            assert!(
                (got_g[h] - want_g[h]).abs() < 1e-5,
                "g {got_g:?} vs {want_g:?}"
            );
        }
    }

    /// A row at position 0 reads its slot as zeros (the slot still holds the previous
    /// sequence's inputs) and leaves it holding zeros then its own input; a row at a later
    /// position reads its slot. Rows of x are `x_stride` apart, the gap never read.
    #[test]
    fn the_step_conv_starts_a_fresh_row_from_zeros() {
        let mut m = FlatMemory::new();
        // Two rows of two channels, x_stride 3: the third element of each row is junk.
        let x = m.put(&bf16s(&[1.0, -2.0, 99.0, 0.5, 1.5, 99.0]));
        let out = m.put(&bf16s(&[0.0; 4]));
        // Width 3 (2 taps), two slots: row 0 (fresh) takes slot 1, row 1 (continuing) slot 0.
        let state = m.put(&bf16s(&[0.5, 0.25, 2.0, 1.0, 9.0, 9.0, 9.0, 9.0]));
        let weight = m.put(&bf16s(&[1.0, 2.0, 3.0, -1.0, 0.5, 1.0]));
        let bias = m.put(&bf16s(&[0.125, -0.25]));
        GdnConv1dStep {
            out,
            x,
            conv_state: state,
            weight,
            bias,
            slots: m.put(&[1i32, 0]),
            positions: m.put(&[0i32, 12]),
            rows: 2,
            channels: 2,
            x_stride: 3,
            kernel: 3,
        }
        .reference(&mut m)
        .unwrap();
        let silu = |z: f32| z / (1.0 + (-z).exp());
        let want = [
            round_bf16(silu(0.125 + 3.0 * 1.0)),
            round_bf16(silu(-0.25 + 1.0 * -2.0)),
            round_bf16(silu(0.125 + 1.0 * 0.5 + 2.0 * 2.0 + 3.0 * 0.5)),
            round_bf16(silu(-0.25 - 0.25 + 0.5 * 1.0 + 1.0 * 1.5)),
        ];
        assert_eq!(f32s(&m.get(out, 4)), want);
        assert_eq!(
            f32s(&m.get(state, 8)),
            [2.0, 1.0, 0.5, 1.5, 0.0, 0.0, 1.0, -2.0]
        );
    }

    /// The run conv on two runs in one launch: a fresh one (position 0) shorter than the taps,
    /// whose new state reaches back into zeros, not its slot's old inputs; a continuing one that
    /// reads its slot. Each against the f32 conv over the state it should start from.
    #[test]
    fn the_run_conv_starts_a_fresh_run_from_zeros() {
        let (channels, kernel, stride) = (3usize, 4usize, 5usize);
        let taps = kernel - 1;
        let lens = [2usize, 4];
        let tokens: usize = lens.iter().sum();
        let x_rows = uniform(1, tokens * stride, 1.0);
        let weight = uniform(2, channels * kernel, 0.5);
        let old = uniform(3, 2 * taps * channels, 1.0);
        let round = |v: &[f32]| v.iter().map(|&x| round_bf16(x)).collect::<Vec<_>>();
        let (x_rows, weight, old) = (round(&x_rows), round(&weight), round(&old));
        let mut m = FlatMemory::new();
        let x = m.put(&bf16s(&x_rows));
        let out = m.put(&bf16s(&vec![0.0; tokens * channels]));
        let state = m.put(&bf16s(&old));
        // Run 0 (fresh) in slot 1, run 1 (continuing, at position 2) in slot 0.
        GdnConv1d {
            out,
            x,
            conv_state: state,
            weight: m.put(&bf16s(&weight)),
            bias: DevicePtr::NULL,
            seq_starts: m.put(&[0i32, 2, 6]),
            slots: m.put(&[1i32, 0]),
            positions: m.put(&[0i32, 1, 2, 3, 4, 5]),
            seqs: 2,
            max_len: 4,
            channels: channels as u32,
            x_stride: stride as u32,
            kernel: kernel as u32,
        }
        .reference(&mut m)
        .unwrap();
        let dense = |rows: std::ops::Range<usize>| -> Vec<f32> {
            rows.flat_map(|t| x_rows[t * stride..t * stride + channels].to_vec())
                .collect()
        };
        let n = taps * channels;
        let mut fresh_state = vec![0.0; n];
        let fresh_out = causal_conv1d_silu(&dense(0..2), channels, &weight, None, &mut fresh_state);
        let mut cont_state = old[..n].to_vec();
        let cont_out = causal_conv1d_silu(&dense(2..6), channels, &weight, None, &mut cont_state);
        let want: Vec<f32> = round(&[fresh_out, cont_out].concat());
        assert_eq!(f32s(&m.get(out, tokens * channels)), want);
        // The fresh run's new state: one zero input, then its two inputs.
        assert_eq!(fresh_state[..channels], [0.0; 3]);
        assert_eq!(
            f32s(&m.get(state, 2 * n)),
            [cont_state, fresh_state].concat()
        );
    }

    /// A sequence at position 0 starts from `S = 0` whatever its slot holds, and writes its
    /// state back; one at a later position starts from its slot.
    #[test]
    fn the_recurrent_kernel_starts_a_fresh_sequence_from_zero() {
        let (dk, dv, hv) = (4usize, 3usize, 1usize);
        let stride = 2 * dk + hv * dv;
        let rows = uniform(11, 3 * stride, 1.0)
            .iter()
            .map(|&x| round_bf16(x))
            .collect::<Vec<_>>();
        let old = uniform(12, 2 * dk * dv, 1.0);
        let (g, beta) = ([-0.3f32, -0.7, -0.1], [0.6f32, 0.3, 0.9]);
        let mut m = FlatMemory::new();
        let row = m.put(&bf16s(&rows));
        let o = m.put(&bf16s(&[0.0; 9]));
        let state = m.put(&old);
        // Sequence 0: tokens 0..2 in slot 0, fresh; sequence 1: token 2 in slot 1, continuing.
        GdnRecurrent {
            o,
            state,
            q: row,
            k: row.offset(2 * dk),
            v: row.offset(2 * 2 * dk),
            g: m.put(&g),
            beta: m.put(&beta),
            seq_starts: m.put(&[0i32, 2, 3]),
            slots: m.put(&[0i32, 1]),
            positions: m.put(&[0i32, 1, 9]),
            seqs: 2,
            hv: hv as u32,
            hk: 1,
            dk: dk as u32,
            dv: dv as u32,
            qkv_stride: stride as u32,
        }
        .reference(&mut m)
        .unwrap();
        let part = |t: std::ops::Range<usize>, at: usize, width: usize| -> Vec<f32> {
            t.flat_map(|t| rows[t * stride + at..t * stride + at + width].to_vec())
                .collect()
        };
        let run = |t: std::ops::Range<usize>, state: &mut Vec<f32>| {
            let (q, k, v) = (
                part(t.clone(), 0, dk),
                part(t.clone(), dk, dk),
                part(t.clone(), 2 * dk, dv),
            );
            let x = GatedDeltaInputs {
                dk,
                dv,
                q: &q,
                k: &k,
                v: &v,
                g: &g[t.clone()],
                beta: &beta[t],
            };
            gated_delta_recurrent(&x, state)
        };
        let mut fresh = vec![0.0; dk * dv];
        let mut cont = old[dk * dv..].to_vec();
        let want = [run(0..2, &mut fresh), run(2..3, &mut cont)].concat();
        let got = f32s(&m.get(o, 9));
        for (g, w) in got.iter().zip(&want) {
            assert_eq!(*g, round_bf16(*w), "{got:?} vs {want:?}");
        }
        assert_eq!(m.get::<f32>(state, 2 * dk * dv), [fresh, cont].concat());
    }

    /// The gating reads token t's row at `t * ba_stride`: a stride wider than `2 hv` (b and a
    /// columns of a wider row) gives what the packed rows give.
    #[test]
    fn gating_reads_rows_ba_stride_apart() {
        let (tokens, hv, hk, stride) = (3usize, 4usize, 2usize, 11usize);
        let wide = uniform(5, tokens * stride, 4.0);
        let packed: Vec<f32> = (0..tokens)
            .flat_map(|t| wide[t * stride..t * stride + 2 * hv].to_vec())
            .collect();
        let mut m = FlatMemory::new();
        let a_log = m.put(&[0.1f32, 0.2, 0.3, 0.4]);
        let dt_bias = m.put(&[0.5f32, -0.5, 1.0, 0.0]);
        let mut run = |ba: &[f32], ba_stride: usize| {
            let (g, beta) = (m.put(&[0f32; 12]), m.put(&[0f32; 12]));
            let ba = m.put(&bf16s(ba));
            GdnGating {
                g,
                beta,
                ba,
                a_log,
                dt_bias,
                tokens: tokens as u32,
                hv: hv as u32,
                hk: hk as u32,
                ba_stride: ba_stride as u32,
            }
            .reference(&mut m)
            .unwrap();
            (m.get::<f32>(g, 12), m.get::<f32>(beta, 12))
        };
        let want = run(&packed, 2 * hv);
        assert_eq!(run(&wide, stride), want);
    }
}
