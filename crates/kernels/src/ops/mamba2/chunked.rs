// SPDX-License-Identifier: MIT OR Apache-2.0
//! The chunked prefill of the Mamba-2 recurrence (`mamba2.cu`: `mamba2_chunk_state`,
//! `mamba2_chunk_carry`, `mamba2_chunk_scan`), three launches that together do what one
//! [`Mamba2Recurrent`] launch does for runs of many tokens, with the chunks of a run in parallel.
//!
//! Chunk `c` of sequence `s` is its tokens `begin + c L .. min(begin + (c + 1) L, end)`. The
//! state after a chunk is the product of its steps' decays times the state before it plus the
//! chunk walked from a zero state, so: [`Mamba2ChunkState`] walks every chunk from zero (its final
//! state into `chunk_states[s][c]`, its decays' product into `chunk_decay[s][c][h]`);
//! [`Mamba2ChunkCarry`] turns, per state element and in chunk order, each `chunk_states[s][c]`
//! into the state the chunk starts from (the slot's, or zero at position 0, then carried) and
//! writes the final state to the slot; [`Mamba2ChunkScan`] walks every chunk from its start state
//! and writes `y` as [`Mamba2Recurrent`] does. Scratch: `chunk_states` f32 `[seqs, max_chunks,
//! heads, head_dim, state_size]`, `chunk_decay` f32 `[seqs, max_chunks, heads]`.

use metrale_core::{DevicePtr, LaunchConfig};

use super::kernels::load_run;
use super::{Mamba2Params, Mamba2Shape, SsdInputs, ssd_recurrent};
use crate::host::{self, HostError, HostMemory, Kernel, KernelAbi, kernel_args};
use crate::names;
use crate::ops::blocks_for;
use crate::ops::{MAMBA2_CHANNELS, MAMBA2_STATE_LANES, Mamba2Recurrent};

/// Threads of a [`Mamba2ChunkCarry`] block, one state element each.
const CARRY_THREADS: u32 = 256;

kernel_args!(
    /// The chunked prefill's first pass: every chunk of every sequence walked from a zero state;
    /// its final state into `chunk_states`, the product of its steps' decays into `chunk_decay`.
    /// Arguments as [`Mamba2Recurrent`]'s; nothing is written for chunks past a sequence's end.
    Mamba2ChunkState => names::mamba2::MAMBA2_CHUNK_STATE {
        /// f32 `[seqs, max_chunks, heads, head_dim, state_size]`.
        chunk_states: DevicePtr,
        /// f32 `[seqs, max_chunks, heads]`.
        chunk_decay: DevicePtr,
        /// bf16 conv output, token `t`'s row x | B | C at `t * xbc_stride`.
        xbc: DevicePtr,
        /// bf16 raw steps, token `t`'s head `h` at `t * dt_stride + h`.
        dt_raw: DevicePtr,
        /// f32 `[heads]`.
        a_log: DevicePtr,
        /// f32 `[heads]`.
        dt_bias: DevicePtr,
        /// f32 `[heads]`.
        d: DevicePtr,
        /// i32 `[seqs + 1]`.
        seq_starts: DevicePtr,
        /// Sequences.
        seqs: u32,
        /// SSM heads.
        heads: u32,
        /// Channels a head.
        head_dim: u32,
        /// N.
        state_size: u32,
        /// Groups of heads sharing B and C.
        groups: u32,
        /// Elements between x | B | C rows.
        xbc_stride: u32,
        /// Elements between raw step rows.
        dt_stride: u32,
        /// Step lower bound.
        dt_min: f32,
        /// Step upper bound.
        dt_max: f32,
        /// Tokens a chunk (L).
        chunk_len: u32,
        /// Chunks of the longest sequence (`ceil(longest / L)`): the scratch's second dimension.
        max_chunks: u32,
    }
);

kernel_args!(
    /// The chunked prefill's second pass: per sequence and state element, in chunk order, each
    /// chunk's local state becomes the state it starts from (the slot's, or zero when the
    /// sequence starts at position 0, then `decay * carried + local`), and the state after the
    /// last chunk goes into the slot.
    Mamba2ChunkCarry => names::mamba2::MAMBA2_CHUNK_CARRY {
        /// f32 `[seqs, max_chunks, heads, head_dim, state_size]`: local states in, start states
        /// out.
        chunk_states: DevicePtr,
        /// f32 `[seqs, max_chunks, heads]`.
        chunk_decay: DevicePtr,
        /// f32 `[slots, heads, head_dim, state_size]`, updated.
        state: DevicePtr,
        /// i32 `[seqs + 1]`.
        seq_starts: DevicePtr,
        /// i32 `[seqs]`.
        slots: DevicePtr,
        /// i32 `[tokens]` (each sequence's first read).
        positions: DevicePtr,
        /// Sequences.
        seqs: u32,
        /// SSM heads.
        heads: u32,
        /// Channels a head.
        head_dim: u32,
        /// N.
        state_size: u32,
        /// Tokens a chunk.
        chunk_len: u32,
        /// The scratch's chunk dimension; a sequence with more chunks is left alone.
        max_chunks: u32,
    }
);

kernel_args!(
    /// The chunked prefill's last pass: every chunk walked from its start state
    /// (`chunk_states` after [`Mamba2ChunkCarry`]), `y` written as [`Mamba2Recurrent`] writes it.
    Mamba2ChunkScan => names::mamba2::MAMBA2_CHUNK_SCAN {
        /// f32 `[tokens, heads * head_dim]`.
        y: DevicePtr,
        /// f32 `[seqs, max_chunks, heads, head_dim, state_size]`: start states.
        chunk_states: DevicePtr,
        /// bf16 conv output.
        xbc: DevicePtr,
        /// bf16 raw steps.
        dt_raw: DevicePtr,
        /// f32 `[heads]`.
        a_log: DevicePtr,
        /// f32 `[heads]`.
        dt_bias: DevicePtr,
        /// f32 `[heads]`.
        d: DevicePtr,
        /// i32 `[seqs + 1]`.
        seq_starts: DevicePtr,
        /// Sequences.
        seqs: u32,
        /// SSM heads.
        heads: u32,
        /// Channels a head.
        head_dim: u32,
        /// N.
        state_size: u32,
        /// Groups of heads sharing B and C.
        groups: u32,
        /// Elements between x | B | C rows.
        xbc_stride: u32,
        /// Elements between raw step rows.
        dt_stride: u32,
        /// Step lower bound.
        dt_min: f32,
        /// Step upper bound.
        dt_max: f32,
        /// Tokens a chunk.
        chunk_len: u32,
        /// The scratch's chunk dimension.
        max_chunks: u32,
    }
);

/// The widths, checked as [`Mamba2Recurrent`] checks them (the same limits).
#[allow(clippy::too_many_arguments)]
fn checked_shape(
    heads: u32,
    head_dim: u32,
    state_size: u32,
    groups: u32,
    xbc_stride: u32,
    dt_stride: u32,
    (dt_min, dt_max): (f32, f32),
) -> Result<Mamba2Shape, HostError> {
    let p = DevicePtr::NULL;
    Mamba2Recurrent {
        y: p,
        state: p,
        xbc: p,
        dt_raw: p,
        a_log: p,
        dt_bias: p,
        d: p,
        seq_starts: p,
        slots: p,
        positions: p,
        seqs: 0,
        heads,
        head_dim,
        state_size,
        groups,
        xbc_stride,
        dt_stride,
        dt_min,
        dt_max,
    }
    .shape()
}

fn bad(kernel: metrale_core::KernelName, message: String) -> HostError {
    HostError::BadArgs { kernel, message }
}

/// Each sequence's token range, checked (ordered, inside the total).
fn runs(
    kernel: metrale_core::KernelName,
    mem: &dyn HostMemory,
    seq_starts: DevicePtr,
    seqs: u32,
) -> Result<Vec<std::ops::Range<usize>>, HostError> {
    let seqs = seqs as usize;
    let starts = host::load::<i32>(mem, seq_starts, seqs + 1)?;
    let total = usize::try_from(starts[seqs]).unwrap_or(0);
    (0..seqs)
        .map(
            |s| match (usize::try_from(starts[s]), usize::try_from(starts[s + 1])) {
                (Ok(b), Ok(e)) if b <= e && e <= total => Ok(b..e),
                _ => Err(bad(
                    kernel,
                    format!(
                        "sequence {s}: tokens {}..{} of {total}",
                        starts[s],
                        starts[s + 1]
                    ),
                )),
            },
        )
        .collect()
}

/// The chunks of a run of `len` tokens at `chunk_len` a chunk, or why they do not fit.
fn chunks_of(
    kernel: metrale_core::KernelName,
    len: usize,
    chunk_len: u32,
    max_chunks: u32,
) -> Result<usize, HostError> {
    if chunk_len == 0 {
        return Err(bad(kernel, "chunk_len = 0".into()));
    }
    let chunks = len.div_ceil(chunk_len as usize);
    if chunks > max_chunks as usize {
        return Err(bad(
            kernel,
            format!(
                "a run of {len} tokens has {chunks} chunks of {chunk_len}, more than max_chunks {max_chunks}"
            ),
        ));
    }
    Ok(chunks)
}

/// The per-head parameters in host memory.
struct Params {
    a_log: Vec<f32>,
    dt_bias: Vec<f32>,
    d: Vec<f32>,
    limit: (f32, f32),
}

impl Params {
    fn load(
        mem: &dyn HostMemory,
        (a_log, dt_bias, d): (DevicePtr, DevicePtr, DevicePtr),
        heads: usize,
        limit: (f32, f32),
    ) -> Result<Params, HostError> {
        Ok(Params {
            a_log: host::load::<f32>(mem, a_log, heads)?,
            dt_bias: host::load::<f32>(mem, dt_bias, heads)?,
            d: host::load::<f32>(mem, d, heads)?,
            limit,
        })
    }
    fn view(&self) -> Mamba2Params<'_> {
        Mamba2Params {
            a_log: &self.a_log,
            dt_bias: &self.dt_bias,
            d: &self.d,
            dt_limit: self.limit,
        }
    }
}

fn walk_grid(head_dim: u32, heads: u32, seqs: u32, max_chunks: u32) -> LaunchConfig {
    LaunchConfig {
        grid: [
            blocks_for(head_dim.into(), MAMBA2_CHANNELS).max(1),
            heads.max(1),
            (seqs * max_chunks).max(1),
        ],
        block: [MAMBA2_CHANNELS * MAMBA2_STATE_LANES, 1, 1],
        shared_mem_bytes: 0,
    }
}

impl Mamba2ChunkState {
    /// The second pass over this one's scratch: the start states carried into the sequences'
    /// `slots` of `state`.
    pub fn carry(
        &self,
        state: DevicePtr,
        slots: DevicePtr,
        positions: DevicePtr,
    ) -> Mamba2ChunkCarry {
        Mamba2ChunkCarry {
            chunk_states: self.chunk_states,
            chunk_decay: self.chunk_decay,
            state,
            seq_starts: self.seq_starts,
            slots,
            positions,
            seqs: self.seqs,
            heads: self.heads,
            head_dim: self.head_dim,
            state_size: self.state_size,
            chunk_len: self.chunk_len,
            max_chunks: self.max_chunks,
        }
    }

    /// The last pass over the same inputs and scratch, writing `y`.
    pub fn scan(&self, y: DevicePtr) -> Mamba2ChunkScan {
        Mamba2ChunkScan {
            y,
            chunk_states: self.chunk_states,
            xbc: self.xbc,
            dt_raw: self.dt_raw,
            a_log: self.a_log,
            dt_bias: self.dt_bias,
            d: self.d,
            seq_starts: self.seq_starts,
            seqs: self.seqs,
            heads: self.heads,
            head_dim: self.head_dim,
            state_size: self.state_size,
            groups: self.groups,
            xbc_stride: self.xbc_stride,
            dt_stride: self.dt_stride,
            dt_min: self.dt_min,
            dt_max: self.dt_max,
            chunk_len: self.chunk_len,
            max_chunks: self.max_chunks,
        }
    }
}

impl Kernel for Mamba2ChunkState {
    fn launch_config(&self) -> LaunchConfig {
        walk_grid(self.head_dim, self.heads, self.seqs, self.max_chunks)
    }
    fn reference(&self, mem: &mut dyn HostMemory) -> Result<(), HostError> {
        let shape = checked_shape(
            self.heads,
            self.head_dim,
            self.state_size,
            self.groups,
            self.xbc_stride,
            self.dt_stride,
            (self.dt_min, self.dt_max),
        )?;
        let params = Params::load(
            mem,
            (self.a_log, self.dt_bias, self.d),
            shape.heads,
            (self.dt_min, self.dt_max),
        )?;
        let p = params.view();
        let n = shape.state_len();
        for (s, run) in runs(Self::NAME, mem, self.seq_starts, self.seqs)?
            .into_iter()
            .enumerate()
        {
            let chunks = chunks_of(Self::NAME, run.len(), self.chunk_len, self.max_chunks)?;
            for c in 0..chunks {
                let first = run.start + c * self.chunk_len as usize;
                let tokens = first..run.end.min(first + self.chunk_len as usize);
                let (x, b, cc, dt) = load_run(
                    mem,
                    (self.xbc, self.xbc_stride as usize),
                    (self.dt_raw, self.dt_stride as usize),
                    &shape,
                    tokens.clone(),
                )?;
                let mut state = vec![0.0; n];
                let inputs = SsdInputs {
                    x: &x,
                    b: &b,
                    c: &cc,
                    dt: &dt,
                };
                ssd_recurrent(&shape, &p, &inputs, &mut state);
                let decay: Vec<f32> = (0..shape.heads)
                    .map(|h| {
                        (0..tokens.len())
                            .map(|t| (p.step(dt[t * shape.heads + h], h) * p.rate(h)).exp())
                            .product()
                    })
                    .collect();
                let at = s * self.max_chunks as usize + c;
                host::store(mem, self.chunk_states.offset(at * n * 4), &state)?;
                host::store(mem, self.chunk_decay.offset(at * shape.heads * 4), &decay)?;
            }
        }
        Ok(())
    }
}

impl Kernel for Mamba2ChunkCarry {
    fn launch_config(&self) -> LaunchConfig {
        let per_seq = u64::from(self.heads) * u64::from(self.head_dim) * u64::from(self.state_size);
        LaunchConfig {
            grid: [
                blocks_for(per_seq.max(1), CARRY_THREADS),
                self.seqs.max(1),
                1,
            ],
            block: [CARRY_THREADS, 1, 1],
            shared_mem_bytes: 0,
        }
    }
    fn reference(&self, mem: &mut dyn HostMemory) -> Result<(), HostError> {
        let (heads, per_head) = (
            self.heads as usize,
            self.head_dim as usize * self.state_size as usize,
        );
        let n = heads * per_head;
        let slots = host::load::<i32>(mem, self.slots, self.seqs as usize)?;
        for (s, run) in runs(Self::NAME, mem, self.seq_starts, self.seqs)?
            .into_iter()
            .enumerate()
        {
            if run.is_empty() {
                continue;
            }
            let chunks = chunks_of(Self::NAME, run.len(), self.chunk_len, self.max_chunks)?;
            let slot = usize::try_from(slots[s])
                .map_err(|_| bad(Self::NAME, format!("sequence {s}: slot {}", slots[s])))?;
            let position = host::load::<i32>(mem, self.positions.offset(run.start * 4), 1)?[0];
            let slot_at = self.state.offset(slot * n * 4);
            let mut carried = if position == 0 {
                vec![0.0; n]
            } else {
                host::load::<f32>(mem, slot_at, n)?
            };
            for c in 0..chunks {
                let at = s * self.max_chunks as usize + c;
                let local = host::load::<f32>(mem, self.chunk_states.offset(at * n * 4), n)?;
                let decay = host::load::<f32>(mem, self.chunk_decay.offset(at * heads * 4), heads)?;
                host::store(mem, self.chunk_states.offset(at * n * 4), &carried)?;
                for (e, (h, l)) in carried.iter_mut().zip(&local).enumerate() {
                    *h = decay[e / per_head].mul_add(*h, *l);
                }
            }
            host::store(mem, slot_at, &carried)?;
        }
        Ok(())
    }
}

impl Kernel for Mamba2ChunkScan {
    fn launch_config(&self) -> LaunchConfig {
        walk_grid(self.head_dim, self.heads, self.seqs, self.max_chunks)
    }
    fn reference(&self, mem: &mut dyn HostMemory) -> Result<(), HostError> {
        let shape = checked_shape(
            self.heads,
            self.head_dim,
            self.state_size,
            self.groups,
            self.xbc_stride,
            self.dt_stride,
            (self.dt_min, self.dt_max),
        )?;
        let params = Params::load(
            mem,
            (self.a_log, self.dt_bias, self.d),
            shape.heads,
            (self.dt_min, self.dt_max),
        )?;
        let p = params.view();
        let (n, inner) = (shape.state_len(), shape.inner());
        for (s, run) in runs(Self::NAME, mem, self.seq_starts, self.seqs)?
            .into_iter()
            .enumerate()
        {
            let chunks = chunks_of(Self::NAME, run.len(), self.chunk_len, self.max_chunks)?;
            for c in 0..chunks {
                let first = run.start + c * self.chunk_len as usize;
                let tokens = first..run.end.min(first + self.chunk_len as usize);
                let (x, b, cc, dt) = load_run(
                    mem,
                    (self.xbc, self.xbc_stride as usize),
                    (self.dt_raw, self.dt_stride as usize),
                    &shape,
                    tokens.clone(),
                )?;
                let at = s * self.max_chunks as usize + c;
                let mut state = host::load::<f32>(mem, self.chunk_states.offset(at * n * 4), n)?;
                let inputs = SsdInputs {
                    x: &x,
                    b: &b,
                    c: &cc,
                    dt: &dt,
                };
                let y = ssd_recurrent(&shape, &p, &inputs, &mut state);
                host::store(mem, self.y.offset(first * inner * 4), &y)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::testing::*;

    /// The three passes over two sequences (one continuing from its slot, one starting at
    /// position 0 over a slot full of junk), chunks of 5 over runs of 13 and 7 (ragged last
    /// chunks), agree with one recurrent launch: the same y and final states to f32 rounding.
    #[test]
    fn the_three_passes_agree_with_the_recurrent_walk() {
        let shape = Mamba2Shape {
            heads: 4,
            head_dim: 3,
            state_size: 8,
            groups: 2,
        };
        let (lens, chunk_len) = ([13usize, 7], 5u32);
        let tokens: usize = lens.iter().sum();
        let (n, inner) = (shape.state_len(), shape.inner());
        let xbc_stride = shape.conv_channels() + 2;
        let dt_stride = shape.heads + 1;
        let xbc = bf16s(&uniform(1, tokens * xbc_stride, 1.0));
        let dt = bf16s(&uniform(2, tokens * dt_stride, 2.0));
        let a_log: Vec<f32> = (0..shape.heads).map(|h| (1.0 + h as f32).ln()).collect();
        let dt_bias = uniform(3, shape.heads, 1.0);
        let d = uniform(4, shape.heads, 1.0);
        let old = uniform(5, 3 * n, 0.5);
        let starts = [0i32, 13, 20];
        let slots = [2i32, 0];
        let mut positions: Vec<i32> = (0..13).map(|t| 40 + t).collect();
        positions.extend(0..7);
        let max_chunks = 3u32;

        let mut mem = FlatMemory::new();
        let p = (
            mem.put(&xbc),
            mem.put(&dt),
            mem.put(&a_log),
            mem.put(&dt_bias),
            mem.put(&d),
            mem.put(&starts),
            mem.put(&slots),
            mem.put(&positions),
        );
        let (y_rec, y_chunk) = (
            mem.put(&vec![0.0f32; tokens * inner]),
            mem.put(&vec![0.0f32; tokens * inner]),
        );
        let (state_rec, state_chunk) = (mem.put(&old), mem.put(&old));
        let chunk_states = mem.put(&vec![f32::NAN; 2 * max_chunks as usize * n]);
        let chunk_decay = mem.put(&vec![f32::NAN; 2 * max_chunks as usize * shape.heads]);
        let (heads, head_dim, state_size, groups) = (4, 3, 8, 2);
        let (xs, ds) = (xbc_stride as u32, dt_stride as u32);
        Mamba2Recurrent {
            y: y_rec,
            state: state_rec,
            xbc: p.0,
            dt_raw: p.1,
            a_log: p.2,
            dt_bias: p.3,
            d: p.4,
            seq_starts: p.5,
            slots: p.6,
            positions: p.7,
            seqs: 2,
            heads,
            head_dim,
            state_size,
            groups,
            xbc_stride: xs,
            dt_stride: ds,
            dt_min: 0.0,
            dt_max: f32::INFINITY,
        }
        .reference(&mut mem)
        .unwrap();
        let pass1 = Mamba2ChunkState {
            chunk_states,
            chunk_decay,
            xbc: p.0,
            dt_raw: p.1,
            a_log: p.2,
            dt_bias: p.3,
            d: p.4,
            seq_starts: p.5,
            seqs: 2,
            heads,
            head_dim,
            state_size,
            groups,
            xbc_stride: xs,
            dt_stride: ds,
            dt_min: 0.0,
            dt_max: f32::INFINITY,
            chunk_len,
            max_chunks,
        };
        pass1.reference(&mut mem).unwrap();
        pass1
            .carry(state_chunk, p.6, p.7)
            .reference(&mut mem)
            .unwrap();
        let scan = pass1.scan(y_chunk);
        scan.reference(&mut mem).unwrap();
        let close = |a: &[f32], b: &[f32], what: &str| {
            for (i, (x, y)) in a.iter().zip(b).enumerate() {
                assert!(
                    (x - y).abs() <= 1e-5 * y.abs().max(1.0),
                    "{what}[{i}]: {x} vs {y}"
                );
            }
        };
        close(
            &mem.get::<f32>(y_chunk, tokens * inner),
            &mem.get::<f32>(y_rec, tokens * inner),
            "y",
        );
        close(
            &mem.get::<f32>(state_chunk, 3 * n),
            &mem.get::<f32>(state_rec, 3 * n),
            "state",
        );
        // The untouched slot kept its old state; the fresh sequence did not read its junk.
        assert_eq!(mem.get::<f32>(state_chunk.offset(n * 4), n), old[n..2 * n]);
        // A run longer than max_chunks chunks is refused, not cut.
        let short = Mamba2ChunkScan {
            max_chunks: 2,
            ..scan
        };
        assert!(short.reference(&mut mem).is_err());
    }
}
