// SPDX-License-Identifier: MIT OR Apache-2.0
//! The Mamba-2 entry points (`mamba2.cu`): their arguments, launch geometry and host references,
//! which read the device layouts and run the f32 references of the parent module.
//!
//! Layouts (elements; `inner = heads * head_dim`, `N = state_size`): the conv's output is bf16
//! rows of `xbc_stride` elements a token, x (`inner`) then every group's B (`groups * N`) then
//! every group's C (`groups * N`); the raw `dt` is bf16, token `t`'s head `h` at
//! `t * dt_stride + h` (the dt columns of in_proj's output row); `a_log`, `dt_bias` and `d` are
//! f32 `[heads]`; the state is f32 `[slots, heads, head_dim, N]`; the output `y` is f32
//! `[tokens, inner]`. Head `h` reads group `h / (heads / groups)`'s B and C.
//!
//! The conv in front is `gated_delta`'s [`super::super::GdnConv1d`] (and its decode form) as it
//! stands: `channels = inner + 2 groups N`, `x` at the in_proj row's x column with `x_stride` the
//! row's width, the conv bias, the same per-run slots and positions. The gated norm after it is
//! [`super::super::GatedRmsNorm`] with the gate first.
//!
//! Fresh sequences: a run whose first token is at position 0 starts from a zero state whatever
//! its slot holds, and writes its state back as any other run does.

use metrale_core::{DevicePtr, LaunchConfig};

use super::{Mamba2Params, Mamba2Shape, SsdInputs, ssd_recurrent};
use crate::host::{self, HostError, HostMemory, Kernel, KernelAbi, kernel_args};
use crate::names;
use crate::ops::blocks_for;

/// Widest state (`state_size`, N) [`Mamba2Recurrent`] takes (`M2_MAX_STATE` in `mamba2.cu`): a
/// channel's row of the state in the registers of [`MAMBA2_STATE_LANES`] lanes.
pub const MAMBA2_MAX_STATE: u32 = 128;
/// `state_size` must be a multiple of this (the state moves in float4 pieces).
pub const MAMBA2_STATE_MULTIPLE: u32 = 4;
/// Lanes sharing one channel's state row (`M2_LANES`).
pub const MAMBA2_STATE_LANES: u32 = 8;
/// Channels of one head a block of [`Mamba2Recurrent`] owns (`M2_CHANNELS`); `head_dim` has no
/// limit of its own (the grid covers it in blocks of these).
pub const MAMBA2_CHANNELS: u32 = 16;

kernel_args!(
    /// The Mamba-2 SSD recurrence over each sequence's tokens in order, from and back into the f32
    /// state in the sequence's slot: sequence `s` owns tokens `seq_starts[s] .. seq_starts[s + 1]`
    /// and slot `slots[s]` (distinct), and starts from a zero state instead of its slot when
    /// `positions[seq_starts[s]] == 0`; an empty run leaves its state alone. A decode batch is
    /// runs of one token; a prefill chunk one run, walked token by token. Per head `h` (group
    /// `g = h / (heads / groups)`) and token: `dt = clamp(softplus(dt_raw + dt_bias[h]), dt_min,
    /// dt_max)`, `H = exp(-dt exp(a_log[h])) H + dt x B_g^T`, `y = H C_g + d[h] x` in f32
    /// ([`super::ssd_recurrent`]). Shapes outside the limits ([`MAMBA2_MAX_STATE`],
    /// [`MAMBA2_STATE_MULTIPLE`], `groups` dividing `heads`, strides at least their rows,
    /// `dt_min <= dt_max`) write nothing.
    Mamba2Recurrent => names::mamba2::MAMBA2_RECURRENT {
        /// f32 `[tokens, heads * head_dim]` (the gated norm reads it unrounded).
        y: DevicePtr,
        /// f32 `[slots, heads, head_dim, state_size]`, updated.
        state: DevicePtr,
        /// bf16 conv output, token `t`'s row x | B | C at `t * xbc_stride`.
        xbc: DevicePtr,
        /// bf16 raw steps, token `t`'s head `h` at `t * dt_stride + h`.
        dt_raw: DevicePtr,
        /// f32 `[heads]`: `A = -exp(a_log)`.
        a_log: DevicePtr,
        /// f32 `[heads]`: added to the raw step before the softplus.
        dt_bias: DevicePtr,
        /// f32 `[heads]`: the skip connection's scale.
        d: DevicePtr,
        /// i32 `[seqs + 1]`: each sequence's first token, then the total.
        seq_starts: DevicePtr,
        /// i32 `[seqs]`: each sequence's state slot.
        slots: DevicePtr,
        /// i32 `[tokens]`: each token's position (only each sequence's first is read).
        positions: DevicePtr,
        /// Sequences.
        seqs: u32,
        /// SSM heads.
        heads: u32,
        /// Channels a head.
        head_dim: u32,
        /// N: the width of B, C and each channel's state, at most [`MAMBA2_MAX_STATE`], a
        /// multiple of [`MAMBA2_STATE_MULTIPLE`].
        state_size: u32,
        /// Groups of heads sharing one B and one C (dividing `heads`).
        groups: u32,
        /// Elements from one token's x | B | C row to the next, at least
        /// `heads * head_dim + 2 * groups * state_size`.
        xbc_stride: u32,
        /// Elements from one token's raw steps to the next, at least `heads`.
        dt_stride: u32,
        /// Lower bound of the step after the softplus (0 for none).
        dt_min: f32,
        /// Upper bound of the step after the softplus (`f32::INFINITY` for none).
        dt_max: f32,
    }
);

fn bad_args(message: String) -> HostError {
    HostError::BadArgs {
        kernel: Mamba2Recurrent::NAME,
        message,
    }
}

/// A bf16 tensor at `ptr + offset` elements.
fn at_bf16(ptr: DevicePtr, offset: usize) -> DevicePtr {
    ptr.offset(offset * std::mem::size_of::<half::bf16>())
}

impl Mamba2Recurrent {
    /// The layer's widths, or why the kernel refuses them.
    pub fn shape(&self) -> Result<Mamba2Shape, HostError> {
        let (heads, head_dim, n, groups) = (
            self.heads as usize,
            self.head_dim as usize,
            self.state_size as usize,
            self.groups as usize,
        );
        if heads == 0 || groups == 0 || !heads.is_multiple_of(groups) {
            return Err(bad_args(format!(
                "heads = {heads} must be a positive multiple of groups = {groups}"
            )));
        }
        if head_dim == 0 {
            return Err(bad_args("head_dim = 0".into()));
        }
        if n == 0
            || self.state_size > MAMBA2_MAX_STATE
            || !self.state_size.is_multiple_of(MAMBA2_STATE_MULTIPLE)
        {
            return Err(bad_args(format!(
                "state_size = {n}: a multiple of {MAMBA2_STATE_MULTIPLE} in \
                 {MAMBA2_STATE_MULTIPLE}..={MAMBA2_MAX_STATE}"
            )));
        }
        let shape = Mamba2Shape {
            heads,
            head_dim,
            state_size: n,
            groups,
        };
        if (self.xbc_stride as usize) < shape.conv_channels() {
            return Err(bad_args(format!(
                "xbc_stride {} < inner + 2 groups state_size = {}",
                self.xbc_stride,
                shape.conv_channels()
            )));
        }
        if (self.dt_stride as usize) < heads {
            return Err(bad_args(format!(
                "dt_stride {} < heads = {heads}",
                self.dt_stride
            )));
        }
        // False for a NaN bound too, as the kernel's test.
        let ordered = self.dt_min <= self.dt_max;
        if !ordered {
            return Err(bad_args(format!(
                "dt limit [{}, {}] is empty",
                self.dt_min, self.dt_max
            )));
        }
        Ok(shape)
    }
}

/// A run's inputs to the recurrence (x, B, C, raw dt; row-major per token) read out of the
/// device layouts: `xbc` rows and `dt_raw` rows at their strides (elements).
pub(super) type RunInputs = (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>);

pub(super) fn load_run(
    mem: &dyn HostMemory,
    (xbc, xbc_stride): (DevicePtr, usize),
    (dt_raw, dt_stride): (DevicePtr, usize),
    shape: &Mamba2Shape,
    tokens: std::ops::Range<usize>,
) -> Result<RunInputs, HostError> {
    let (heads, inner) = (shape.heads, shape.inner());
    let bc = shape.groups * shape.state_size;
    let len = tokens.len();
    let (mut x, mut b, mut c, mut dt) = (
        Vec::with_capacity(len * inner),
        Vec::with_capacity(len * bc),
        Vec::with_capacity(len * bc),
        Vec::with_capacity(len * heads),
    );
    for t in tokens {
        let row = host::load_bf16(mem, at_bf16(xbc, t * xbc_stride), inner + 2 * bc)?;
        x.extend_from_slice(&row[..inner]);
        b.extend_from_slice(&row[inner..inner + bc]);
        c.extend_from_slice(&row[inner + bc..]);
        dt.extend(host::load_bf16(mem, at_bf16(dt_raw, t * dt_stride), heads)?);
    }
    Ok((x, b, c, dt))
}

impl Kernel for Mamba2Recurrent {
    fn launch_config(&self) -> LaunchConfig {
        LaunchConfig {
            grid: [
                blocks_for(self.head_dim.into(), MAMBA2_CHANNELS).max(1),
                self.heads.max(1),
                self.seqs.max(1),
            ],
            block: [MAMBA2_CHANNELS * MAMBA2_STATE_LANES, 1, 1],
            shared_mem_bytes: 0,
        }
    }
    fn reference(&self, mem: &mut dyn HostMemory) -> Result<(), HostError> {
        let shape = self.shape()?;
        let (heads, inner) = (shape.heads, shape.inner());
        let a_log = host::load::<f32>(mem, self.a_log, heads)?;
        let dt_bias = host::load::<f32>(mem, self.dt_bias, heads)?;
        let d = host::load::<f32>(mem, self.d, heads)?;
        let params = Mamba2Params {
            a_log: &a_log,
            dt_bias: &dt_bias,
            d: &d,
            dt_limit: (self.dt_min, self.dt_max),
        };
        let seqs = self.seqs as usize;
        let (xbc_stride, dt_stride) = (self.xbc_stride as usize, self.dt_stride as usize);
        let starts = host::load::<i32>(mem, self.seq_starts, seqs + 1)?;
        let slots = host::load::<i32>(mem, self.slots, seqs)?;
        let tokens = usize::try_from(starts[seqs]).unwrap_or(0);
        let state_bytes = shape.state_len() * std::mem::size_of::<f32>();
        for s in 0..seqs {
            let (begin, end) = (starts[s], starts[s + 1]);
            let (Ok(begin), Ok(end), Ok(slot)) = (
                usize::try_from(begin),
                usize::try_from(end),
                usize::try_from(slots[s]),
            ) else {
                return Err(bad_args(format!(
                    "sequence {s}: tokens {begin}..{end}, slot {}",
                    slots[s]
                )));
            };
            if begin > end || end > tokens {
                return Err(bad_args(format!(
                    "sequence {s}: tokens {begin}..{end} of {tokens}"
                )));
            }
            if begin == end {
                // No first token, so no position: the state stays as it is (as on the GPU).
                continue;
            }
            let position = host::load::<i32>(
                mem,
                self.positions.offset(begin * std::mem::size_of::<i32>()),
                1,
            )?[0];
            let (x, b, c, dt) = load_run(
                mem,
                (self.xbc, xbc_stride),
                (self.dt_raw, dt_stride),
                &shape,
                begin..end,
            )?;
            let state_at = self.state.offset(slot * state_bytes);
            let mut state = if position == 0 {
                vec![0.0; shape.state_len()]
            } else {
                host::load::<f32>(mem, state_at, shape.state_len())?
            };
            let inputs = SsdInputs {
                x: &x,
                b: &b,
                c: &c,
                dt: &dt,
            };
            let out = ssd_recurrent(&shape, &params, &inputs, &mut state);
            host::store(mem, state_at, &state)?;
            host::store(mem, self.y.offset(begin * inner * 4), &out)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::super::ssd_chunked;
    use super::*;
    use crate::host::round_bf16;
    use crate::ops::testing::*;

    /// Widths of the tests: four heads in two groups, ragged head_dim and a state of 12.
    const SHAPE: Mamba2Shape = Mamba2Shape {
        heads: 4,
        head_dim: 3,
        state_size: 12,
        groups: 2,
    };

    fn rounded(v: Vec<f32>) -> Vec<f32> {
        v.into_iter().map(round_bf16).collect()
    }

    /// One case's inputs in flat memory: `xbc` rows `xbc_stride` apart (the gap junk), `dt` rows
    /// `dt_stride` apart, per-head parameters, and a state of `slots` random slots.
    struct Setup {
        mem: FlatMemory,
        kernel: Mamba2Recurrent,
        /// The bf16-exact values written, per token: xbc rows (packed), dt rows (packed).
        xbc: Vec<f32>,
        dt: Vec<f32>,
        a_log: Vec<f32>,
        dt_bias: Vec<f32>,
        d: Vec<f32>,
        old: Vec<f32>,
    }

    fn setup(
        shape: Mamba2Shape,
        lens: &[usize],
        slots: &[i32],
        positions: &[i32],
        strides: (usize, usize),
        seed: u64,
    ) -> Setup {
        let (xbc_stride, dt_stride) = strides;
        let tokens: usize = lens.iter().sum();
        let (conv, heads) = (shape.conv_channels(), shape.heads);
        let wide_xbc = rounded(uniform(seed, tokens * xbc_stride, 1.0));
        let wide_dt = rounded(uniform(seed + 1, tokens * dt_stride, 2.0));
        let packed = |wide: &[f32], stride: usize, width: usize| -> Vec<f32> {
            (0..tokens)
                .flat_map(|t| wide[t * stride..t * stride + width].to_vec())
                .collect()
        };
        let a_log: Vec<f32> = (0..heads).map(|h| (1.0 + h as f32).ln()).collect();
        let dt_bias = uniform(seed + 2, heads, 1.0);
        let d = uniform(seed + 3, heads, 1.0);
        let n_slots = slots.iter().copied().max().unwrap_or(0) as usize + 2;
        let old = uniform(seed + 4, n_slots * shape.state_len(), 0.5);
        let mut mem = FlatMemory::new();
        let mut starts = vec![0i32];
        for len in lens {
            starts.push(starts.last().unwrap() + *len as i32);
        }
        let kernel = Mamba2Recurrent {
            y: mem.put(&vec![0.0f32; tokens * shape.inner()]),
            state: mem.put(&old),
            xbc: mem.put(&bf16s(&wide_xbc)),
            dt_raw: mem.put(&bf16s(&wide_dt)),
            a_log: mem.put(&a_log),
            dt_bias: mem.put(&dt_bias),
            d: mem.put(&d),
            seq_starts: mem.put(&starts),
            slots: mem.put(slots),
            positions: mem.put(positions),
            seqs: lens.len() as u32,
            heads: heads as u32,
            head_dim: shape.head_dim as u32,
            state_size: shape.state_size as u32,
            groups: shape.groups as u32,
            xbc_stride: xbc_stride as u32,
            dt_stride: dt_stride as u32,
            dt_min: 0.0,
            dt_max: f32::INFINITY,
        };
        Setup {
            mem,
            kernel,
            xbc: packed(&wide_xbc, xbc_stride, conv),
            dt: packed(&wide_dt, dt_stride, heads),
            a_log,
            dt_bias,
            d,
            old,
        }
    }

    impl Setup {
        fn params(&self) -> Mamba2Params<'_> {
            Mamba2Params {
                a_log: &self.a_log,
                dt_bias: &self.dt_bias,
                d: &self.d,
                dt_limit: (self.kernel.dt_min, self.kernel.dt_max),
            }
        }
        /// Tokens `t` of the packed inputs, split into x, B, C and dt.
        fn parts(
            &self,
            shape: &Mamba2Shape,
            t: std::ops::Range<usize>,
        ) -> (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>) {
            let (conv, inner) = (shape.conv_channels(), shape.inner());
            let bc = shape.groups * shape.state_size;
            let col = |from: usize, to: usize| -> Vec<f32> {
                t.clone()
                    .flat_map(|t| self.xbc[t * conv + from..t * conv + to].to_vec())
                    .collect()
            };
            (
                col(0, inner),
                col(inner, inner + bc),
                col(inner + bc, conv),
                self.dt[t.start * shape.heads..t.end * shape.heads].to_vec(),
            )
        }
        fn run(&mut self) {
            let k = self.kernel;
            k.reference(&mut self.mem).unwrap();
        }
    }

    /// Two sequences in one launch, as a step lays them out: a fresh prefill run (position 0)
    /// whose slot holds another sequence's state, and a continuing decode row; each against
    /// `ssd_recurrent` from the state it should start from. The other slots are untouched.
    #[test]
    fn runs_start_fresh_or_from_their_slot() {
        let lens = [5usize, 1];
        let mut m = setup(
            SHAPE,
            &lens,
            &[2, 0],
            &[0, 1, 2, 3, 4, 17],
            (SHAPE.conv_channels(), SHAPE.heads),
            21,
        );
        m.run();
        let n = SHAPE.state_len();
        let run = |t: std::ops::Range<usize>, state: &mut Vec<f32>| {
            let (x, b, c, dt) = m.parts(&SHAPE, t);
            let inputs = SsdInputs {
                x: &x,
                b: &b,
                c: &c,
                dt: &dt,
            };
            ssd_recurrent(&SHAPE, &m.params(), &inputs, state)
        };
        let mut fresh = vec![0.0; n];
        let mut cont = m.old[..n].to_vec();
        let want = [run(0..5, &mut fresh), run(5..6, &mut cont)].concat();
        let got = m.mem.get::<f32>(m.kernel.y, 6 * SHAPE.inner());
        assert_eq!(got, want);
        let state = m.mem.get::<f32>(m.kernel.state, 4 * n);
        assert_eq!(state[..n], cont[..]);
        assert_eq!(state[n..2 * n], m.old[n..2 * n]);
        assert_eq!(state[2 * n..3 * n], fresh[..]);
        assert_eq!(state[3 * n..], m.old[3 * n..4 * n]);
        // The fresh run did not read its slot: from the slot's old state it differs.
        let mut from_old = m.old[2 * n..3 * n].to_vec();
        let stale = run(0..5, &mut from_old);
        assert_ne!(stale[..], got[..5 * SHAPE.inner()]);
    }

    /// A prefill run through the kernel's reference agrees with the chunked (SSD) form over the
    /// same run, and a run split into a prefill chunk and decode rows (the state carried through
    /// the slot) agrees with the run in one launch.
    #[test]
    fn a_run_agrees_with_the_chunked_form_and_with_itself_split() {
        let shape = Mamba2Shape {
            heads: 8,
            head_dim: 5,
            state_size: 16,
            groups: 8,
        };
        let len = 19;
        let positions: Vec<i32> = (0..len as i32).map(|t| 40 + t).collect();
        let strides = (shape.conv_channels() + 3, shape.heads + 5);
        let mut whole = setup(shape, &[len], &[1], &positions, strides, 5);
        whole.run();
        let n = shape.state_len();
        let y_whole = whole.mem.get::<f32>(whole.kernel.y, len * shape.inner());
        let state_whole = whole.mem.get::<f32>(whole.kernel.state.offset(n * 4), n);
        let (x, b, c, dt) = whole.parts(&shape, 0..len);
        let inputs = SsdInputs {
            x: &x,
            b: &b,
            c: &c,
            dt: &dt,
        };
        let mut chunked_state = whole.old[n..2 * n].to_vec();
        let chunked = ssd_chunked(&shape, &whole.params(), &inputs, &mut chunked_state, 8);
        for (g, w) in y_whole.iter().zip(&chunked) {
            assert!((g - w).abs() <= 1e-2 * w.abs() + 1e-4, "{g} vs chunked {w}");
        }
        for (g, w) in state_whole.iter().zip(&chunked_state) {
            assert!((g - w).abs() <= 1e-4 * w.abs() + 1e-5, "{g} vs {w}");
        }
        // The same run as a prefill chunk of 12, then 7 decode launches of one row each.
        let mut split = setup(shape, &[len], &[1], &positions, strides, 5);
        let k = split.kernel;
        let i32_at = |p: DevicePtr, i: usize| p.offset(4 * i);
        let launch = |mem: &mut FlatMemory, from: usize, to: usize| {
            let starts = mem.put(&[0i32, (to - from) as i32]);
            Mamba2Recurrent {
                y: k.y.offset(from * shape.inner() * 4),
                xbc: at_bf16(k.xbc, from * strides.0),
                dt_raw: at_bf16(k.dt_raw, from * strides.1),
                seq_starts: starts,
                positions: i32_at(k.positions, from),
                ..k
            }
            .reference(mem)
            .unwrap();
        };
        launch(&mut split.mem, 0, 12);
        for t in 12..len {
            launch(&mut split.mem, t, t + 1);
        }
        assert_eq!(
            split.mem.get::<f32>(k.y, len * shape.inner()),
            y_whole,
            "split outputs"
        );
        assert_eq!(
            split.mem.get::<f32>(k.state.offset(n * 4), n),
            state_whole,
            "split state"
        );
    }

    /// Rows read `xbc_stride` and `dt_stride` apart give what packed rows give; an empty run
    /// leaves its slot alone; the step's limits clamp it.
    #[test]
    fn strides_empty_runs_and_the_step_limit() {
        let lens = [3usize, 0, 2];
        let positions = [0, 1, 2, 9, 10];
        let packed_strides = (SHAPE.conv_channels(), SHAPE.heads);
        let mut packed = setup(SHAPE, &lens, &[0, 1, 2], &positions, packed_strides, 8);
        packed.run();
        // The same values in wider rows.
        let wide_strides = (SHAPE.conv_channels() + 7, SHAPE.heads + 2);
        let mut wide = setup(SHAPE, &lens, &[0, 1, 2], &positions, wide_strides, 8);
        let tokens = 5;
        let mut xbc = vec![99.0f32; tokens * wide_strides.0];
        let mut dt = vec![-99.0f32; tokens * wide_strides.1];
        for t in 0..tokens {
            let conv = SHAPE.conv_channels();
            xbc[t * wide_strides.0..][..conv].copy_from_slice(&packed.xbc[t * conv..][..conv]);
            dt[t * wide_strides.1..][..SHAPE.heads]
                .copy_from_slice(&packed.dt[t * SHAPE.heads..][..SHAPE.heads]);
        }
        wide.kernel.xbc = wide.mem.put(&bf16s(&xbc));
        wide.kernel.dt_raw = wide.mem.put(&bf16s(&dt));
        wide.run();
        let n = SHAPE.state_len();
        let y = |s: &Setup| s.mem.get::<f32>(s.kernel.y, tokens * SHAPE.inner());
        assert_eq!(y(&wide), y(&packed));
        let states = |s: &Setup| s.mem.get::<f32>(s.kernel.state, 3 * n);
        assert_eq!(states(&wide), states(&packed));
        assert_eq!(states(&packed)[n..2 * n], packed.old[n..2 * n], "empty run");
        // A tight limit changes the outputs: every step pinned to 0.05.
        let mut clamped = setup(SHAPE, &lens, &[0, 1, 2], &positions, packed_strides, 8);
        clamped.kernel.dt_min = 0.05;
        clamped.kernel.dt_max = 0.05;
        clamped.run();
        let fixed = Mamba2Params {
            dt_limit: (0.05, 0.05),
            ..packed.params()
        };
        let (x, b, c, dt) = packed.parts(&SHAPE, 0..3);
        let mut state = vec![0.0; n];
        let want = ssd_recurrent(
            &SHAPE,
            &fixed,
            &SsdInputs {
                x: &x,
                b: &b,
                c: &c,
                dt: &dt,
            },
            &mut state,
        );
        assert_eq!(y(&clamped)[..3 * SHAPE.inner()], want[..]);
        assert_ne!(y(&clamped), y(&packed));
    }

    /// Shapes outside the limits are refused before anything is written.
    #[test]
    fn bad_shapes_are_refused() {
        let strides = (SHAPE.conv_channels(), SHAPE.heads);
        let base = setup(SHAPE, &[2], &[0], &[0, 1], strides, 3);
        for (what, edit) in [
            (
                "state_size 130",
                Mamba2Recurrent {
                    state_size: 130,
                    ..base.kernel
                },
            ),
            (
                "state_size 6",
                Mamba2Recurrent {
                    state_size: 6,
                    ..base.kernel
                },
            ),
            (
                "groups 3",
                Mamba2Recurrent {
                    groups: 3,
                    ..base.kernel
                },
            ),
            (
                "xbc_stride",
                Mamba2Recurrent {
                    xbc_stride: strides.0 as u32 - 1,
                    ..base.kernel
                },
            ),
            (
                "dt_stride",
                Mamba2Recurrent {
                    dt_stride: 3,
                    ..base.kernel
                },
            ),
            (
                "dt limit",
                Mamba2Recurrent {
                    dt_min: 1.0,
                    dt_max: 0.5,
                    ..base.kernel
                },
            ),
            (
                "dt limit NaN",
                Mamba2Recurrent {
                    dt_min: f32::NAN,
                    ..base.kernel
                },
            ),
        ] {
            let mut mem = base.mem.clone();
            assert!(edit.reference(&mut mem).is_err(), "{what}");
            assert_eq!(mem.bytes, base.mem.bytes, "{what} wrote");
        }
    }
}
