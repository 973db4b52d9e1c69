// SPDX-License-Identifier: MIT OR Apache-2.0
//! The chunked prefill of the gated delta rule (`gated_delta.cu`: `gdn_chunk_prep`,
//! `gdn_chunk_scan`), two launches that together do what one [`GdnRecurrent`] launch does for
//! runs of many tokens, with the state-independent work of every chunk in parallel.
//!
//! Chunk `c` of sequence `s` is its tokens `begin + c L .. min(begin + (c + 1) L, end)` (`L` =
//! `chunk_len`, at most [`GDN_CHUNK_MAX`]). [`GdnChunkPrep`] computes, per chunk and value head,
//! the chunk's [`ChunkFactors`] (the UT transform `T` of the delta rule's writes within the chunk
//! and the decay-masked scores `P`) into two scratch buffers, one row of `L` f32 a token; then
//! [`GdnChunkScan`] walks each run's chunks in order per value head (a block per
//! [`GDN_SCAN_COLS`] columns of the state, which evolve independently) from and back into the
//! state in the run's slot, writing the outputs as [`GdnRecurrent`] does. Scratch: `t_mat` and
//! `attn` f32 `[tokens, hv, chunk_len]`, row `i` of a chunk in the row of its token `first + i`,
//! zero right of the diagonal. The f32 algebra is [`chunk_factors`] and [`chunk_apply`]; the
//! results agree with the token-by-token walk to f32 rounding (sums in another order).

use metrale_core::{DevicePtr, KernelName, LaunchConfig};

use super::kernels::{at_bf16, bad_args, position_at};
use super::{ChunkFactors, GDN_MAX_DK, GatedDeltaInputs, chunk_apply, chunk_factors};
use crate::host::{self, HostError, HostMemory, Kernel, KernelAbi, kernel_args};
use crate::names;
use crate::ops::blocks_for;

/// The longest chunk the kernels take (`GDN_CHUNK_MAX` in `gated_delta.cu`); the engine's chunk.
pub const GDN_CHUNK_MAX: u32 = 64;
/// Threads of a block of either launch (`GDN_CHUNK_THREADS`).
pub const GDN_CHUNK_THREADS: u32 = 256;
/// Value columns one [`GdnChunkScan`] block owns (`GDN_SCAN_COLS`).
pub const GDN_SCAN_COLS: u32 = 16;
/// Dynamic shared memory of a [`GdnChunkPrep`] block (`GDN_PREP_SMEM`, checked there by a
/// `static_assert`): a chunk's q and k, `L` and `T`, its decays and write strengths.
pub const GDN_CHUNK_PREP_SMEM: u32 = 102_912;
/// Dynamic shared memory of a [`GdnChunkScan`] block (`GDN_SCAN_SMEM`): a chunk's k, its q with
/// `T` and `P` over it, the block's columns of the state, `X` and `V'`, decays.
pub const GDN_CHUNK_SCAN_SMEM: u32 = 85_760;

kernel_args!(
    /// The chunked prefill's first pass: per chunk and value head, `T` and `P`
    /// ([`ChunkFactors`]) of the chunk into the rows of its tokens. Sequence `s` owns tokens
    /// `seq_starts[s] .. seq_starts[s + 1]`; q and k as [`GdnRecurrent`] reads them
    /// (L2-normalised here, q scaled by `dk^-1/2`). Nothing is written for a run with more than
    /// `max_chunks` chunks.
    GdnChunkPrep => names::gated_delta::GDN_CHUNK_PREP {
        /// f32 `[tokens, hv, chunk_len]`: row `i` of each chunk's `T`.
        t_mat: DevicePtr,
        /// f32 `[tokens, hv, chunk_len]`: row `i` of each chunk's `P`.
        attn: DevicePtr,
        /// bf16 queries, token `t`'s key head `kh` at `t * qkv_stride + kh * dk`.
        q: DevicePtr,
        /// bf16 keys, as `q`.
        k: DevicePtr,
        /// f32 `[tokens, hv]`: log-decays, `<= 0`.
        g: DevicePtr,
        /// f32 `[tokens, hv]`: write strengths.
        beta: DevicePtr,
        /// i32 `[seqs + 1]`: each sequence's first token, then the total.
        seq_starts: DevicePtr,
        /// Sequences.
        seqs: u32,
        /// Value heads.
        hv: u32,
        /// Key heads (dividing `hv`).
        hk: u32,
        /// Key width, at most [`GDN_MAX_DK`].
        dk: u32,
        /// Elements from one token's q (k) row to the next.
        qkv_stride: u32,
        /// Tokens a chunk, 1 to [`GDN_CHUNK_MAX`].
        chunk_len: u32,
        /// Chunks of the longest run (`ceil(longest / chunk_len)`): the grid's first dimension.
        max_chunks: u32,
    }
);

kernel_args!(
    /// The chunked prefill's second pass: each run's chunks in order per value head, from and
    /// back into the f32 state in the run's slot (`S = 0` instead of the slot when the run's
    /// first token is at position 0), with `T` and `P` from [`GdnChunkPrep`]; writes `o` as
    /// [`GdnRecurrent`] does. An empty run leaves its state as it is; a run with more than
    /// `max_chunks` chunks is left alone.
    GdnChunkScan => names::gated_delta::GDN_CHUNK_SCAN {
        /// bf16 `[tokens, hv, dv]`.
        o: DevicePtr,
        /// f32 `[slots, hv, dk, dv]`, updated.
        state: DevicePtr,
        /// bf16 queries, as [`GdnChunkPrep`]'s.
        q: DevicePtr,
        /// bf16 keys.
        k: DevicePtr,
        /// bf16 values, token `t`'s head `h` at `t * qkv_stride + h * dv`.
        v: DevicePtr,
        /// f32 `[tokens, hv]`: log-decays.
        g: DevicePtr,
        /// f32 `[tokens, hv]`: write strengths.
        beta: DevicePtr,
        /// f32 `[tokens, hv, chunk_len]`: `T`, from [`GdnChunkPrep`].
        t_mat: DevicePtr,
        /// f32 `[tokens, hv, chunk_len]`: `P`, from [`GdnChunkPrep`].
        attn: DevicePtr,
        /// i32 `[seqs + 1]`.
        seq_starts: DevicePtr,
        /// i32 `[seqs]`: each sequence's state slot (distinct).
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
        /// Tokens a chunk, as [`GdnChunkPrep`]'s.
        chunk_len: u32,
        /// As [`GdnChunkPrep`]'s.
        max_chunks: u32,
    }
);

/// The widths as `usize` `(hv, hk, dk)`, checked against the kernels' limits.
fn checked(
    name: KernelName,
    (hv, hk, dk): (u32, u32, u32),
    chunk_len: u32,
    max_chunks: u32,
) -> Result<(usize, usize, usize), HostError> {
    if hk == 0 || hv % hk != 0 || dk == 0 || dk > GDN_MAX_DK {
        return Err(bad_args(
            name,
            format!("dk = {dk} (1..={GDN_MAX_DK}), hv = {hv} a multiple of hk = {hk}"),
        ));
    }
    if chunk_len == 0 || chunk_len > GDN_CHUNK_MAX || max_chunks == 0 {
        return Err(bad_args(
            name,
            format!("chunk_len = {chunk_len} (1..={GDN_CHUNK_MAX}), max_chunks = {max_chunks}"),
        ));
    }
    Ok((hv as usize, hk as usize, dk as usize))
}

/// Each sequence's token range, checked (ordered, inside the total), and its chunk count within
/// `max_chunks`.
fn runs(
    name: KernelName,
    mem: &dyn HostMemory,
    seq_starts: DevicePtr,
    seqs: u32,
    (chunk_len, max_chunks): (u32, u32),
) -> Result<Vec<std::ops::Range<usize>>, HostError> {
    let seqs = seqs as usize;
    let starts = host::load::<i32>(mem, seq_starts, seqs + 1)?;
    let total = usize::try_from(starts[seqs]).unwrap_or(0);
    let mut out = Vec::with_capacity(seqs);
    for s in 0..seqs {
        let run = match (usize::try_from(starts[s]), usize::try_from(starts[s + 1])) {
            (Ok(b), Ok(e)) if b <= e && e <= total => b..e,
            _ => {
                return Err(bad_args(
                    name,
                    format!(
                        "sequence {s}: tokens {}..{} of {total}",
                        starts[s],
                        starts[s + 1]
                    ),
                ));
            }
        };
        let chunks = run.len().div_ceil(chunk_len as usize);
        if chunks > max_chunks as usize {
            return Err(bad_args(
                name,
                format!(
                    "sequence {s}: {} tokens make {chunks} chunks of {chunk_len}, more than \
                     max_chunks {max_chunks}",
                    run.len()
                ),
            ));
        }
        out.push(run);
    }
    Ok(out)
}

/// One value head's inputs over a run, as f32: what [`GatedDeltaInputs`] borrows.
struct HeadRun {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    g: Vec<f32>,
    beta: Vec<f32>,
}

impl HeadRun {
    /// Value head `h`'s (key head `kh`'s) q, k and, where `dv > 0`, v over `tokens`, with its
    /// `g` and `beta` out of the launch-wide `[tokens, hv]` arrays.
    #[allow(clippy::too_many_arguments)]
    fn load(
        mem: &dyn HostMemory,
        (q, k, v): (DevicePtr, DevicePtr, DevicePtr),
        (g, beta): (&[f32], &[f32]),
        (h, kh, hv): (usize, usize, usize),
        (dk, dv, stride): (usize, usize, usize),
        tokens: std::ops::Range<usize>,
    ) -> Result<HeadRun, HostError> {
        let len = tokens.len();
        let mut run = HeadRun {
            q: Vec::with_capacity(len * dk),
            k: Vec::with_capacity(len * dk),
            v: Vec::with_capacity(len * dv),
            g: tokens.clone().map(|t| g[t * hv + h]).collect(),
            beta: tokens.clone().map(|t| beta[t * hv + h]).collect(),
        };
        for t in tokens {
            run.q
                .extend(host::load_bf16(mem, at_bf16(q, t * stride + kh * dk), dk)?);
            run.k
                .extend(host::load_bf16(mem, at_bf16(k, t * stride + kh * dk), dk)?);
            if dv > 0 {
                run.v
                    .extend(host::load_bf16(mem, at_bf16(v, t * stride + h * dv), dv)?);
            }
        }
        Ok(run)
    }

    /// The run as the f32 references take it.
    fn inputs(&self, dk: usize, dv: usize) -> GatedDeltaInputs<'_> {
        GatedDeltaInputs {
            dk,
            dv,
            q: &self.q,
            k: &self.k,
            v: &self.v,
            g: &self.g,
            beta: &self.beta,
        }
    }
}

/// The offset (bytes) of token `t`'s row of value head `h` in a `[tokens, hv, chunk_len]` f32
/// scratch.
fn scratch_row(t: usize, h: usize, hv: usize, chunk_len: usize) -> usize {
    (t * hv + h) * chunk_len * std::mem::size_of::<f32>()
}

/// One chunk's `T` and `P` from its q, k, g and beta: [`chunk_factors`] (the CUDA-core
/// launches), or its tensor-core form with bf16 operands.
pub(super) type FactorsFn = fn(&GatedDeltaInputs) -> ChunkFactors;
/// One chunk's outputs and state update given its factors: [`chunk_apply`], or its tensor-core
/// form.
pub(super) type ApplyFn = fn(&GatedDeltaInputs, &ChunkFactors, &mut [f32]) -> Vec<f32>;

impl Kernel for GdnChunkPrep {
    fn launch_config(&self) -> LaunchConfig {
        LaunchConfig {
            grid: [self.max_chunks.max(1), self.hv.max(1), self.seqs.max(1)],
            block: [GDN_CHUNK_THREADS, 1, 1],
            shared_mem_bytes: GDN_CHUNK_PREP_SMEM,
        }
    }
    fn reference(&self, mem: &mut dyn HostMemory) -> Result<(), HostError> {
        self.reference_with(Self::NAME, chunk_factors, mem)
    }
}

impl GdnChunkPrep {
    /// The prep's reference with `factors` for each chunk; errors name `name`.
    pub(super) fn reference_with(
        &self,
        name: KernelName,
        factors: FactorsFn,
        mem: &mut dyn HostMemory,
    ) -> Result<(), HostError> {
        let (hv, hk, dk) = checked(
            name,
            (self.hv, self.hk, self.dk),
            self.chunk_len,
            self.max_chunks,
        )?;
        let (chunk_len, stride) = (self.chunk_len as usize, self.qkv_stride as usize);
        let runs = runs(
            name,
            mem,
            self.seq_starts,
            self.seqs,
            (self.chunk_len, self.max_chunks),
        )?;
        let tokens = runs.iter().map(|r| r.end).max().unwrap_or(0);
        let g = host::load::<f32>(mem, self.g, tokens * hv)?;
        let beta = host::load::<f32>(mem, self.beta, tokens * hv)?;
        for run in runs {
            for h in 0..hv {
                let head = HeadRun::load(
                    mem,
                    (self.q, self.k, DevicePtr::NULL),
                    (&g, &beta),
                    (h, h / (hv / hk), hv),
                    (dk, 0, stride),
                    run.clone(),
                )?;
                let x = head.inputs(dk, 0);
                let mut start = 0;
                while start < run.len() {
                    let n = chunk_len.min(run.len() - start);
                    let f = factors(&x.part(start..start + n));
                    for i in 0..n {
                        let t = run.start + start + i;
                        let mut row = vec![0.0f32; chunk_len];
                        row[..n].copy_from_slice(&f.t[i * n..(i + 1) * n]);
                        host::store(
                            mem,
                            self.t_mat.offset(scratch_row(t, h, hv, chunk_len)),
                            &row,
                        )?;
                        row[..n].copy_from_slice(&f.attn[i * n..(i + 1) * n]);
                        host::store(
                            mem,
                            self.attn.offset(scratch_row(t, h, hv, chunk_len)),
                            &row,
                        )?;
                    }
                    start += n;
                }
            }
        }
        Ok(())
    }
}

impl Kernel for GdnChunkScan {
    fn launch_config(&self) -> LaunchConfig {
        LaunchConfig {
            grid: [
                blocks_for(self.dv.into(), GDN_SCAN_COLS).max(1),
                self.hv.max(1),
                self.seqs.max(1),
            ],
            block: [GDN_CHUNK_THREADS, 1, 1],
            shared_mem_bytes: GDN_CHUNK_SCAN_SMEM,
        }
    }
    fn reference(&self, mem: &mut dyn HostMemory) -> Result<(), HostError> {
        self.reference_with(Self::NAME, chunk_apply, mem)
    }
}

impl GdnChunkScan {
    /// The scan's reference with `apply` for each chunk; errors name `name`.
    pub(super) fn reference_with(
        &self,
        name: KernelName,
        apply: ApplyFn,
        mem: &mut dyn HostMemory,
    ) -> Result<(), HostError> {
        let (hv, hk, dk) = checked(
            name,
            (self.hv, self.hk, self.dk),
            self.chunk_len,
            self.max_chunks,
        )?;
        let (dv, chunk_len, stride) = (
            self.dv as usize,
            self.chunk_len as usize,
            self.qkv_stride as usize,
        );
        let runs = runs(
            name,
            mem,
            self.seq_starts,
            self.seqs,
            (self.chunk_len, self.max_chunks),
        )?;
        let slots = host::load::<i32>(mem, self.slots, runs.len())?;
        let tokens = runs.iter().map(|r| r.end).max().unwrap_or(0);
        let g = host::load::<f32>(mem, self.g, tokens * hv)?;
        let beta = host::load::<f32>(mem, self.beta, tokens * hv)?;
        let head_bytes = dk * dv * std::mem::size_of::<f32>();
        for (s, run) in runs.into_iter().enumerate() {
            if run.is_empty() {
                // No first token, so no position: the state stays as it is (as on the GPU).
                continue;
            }
            let slot = usize::try_from(slots[s])
                .map_err(|_| bad_args(name, format!("sequence {s}: slot {}", slots[s])))?;
            let fresh = position_at(mem, self.positions, run.start)? == 0;
            for h in 0..hv {
                let head = HeadRun::load(
                    mem,
                    (self.q, self.k, self.v),
                    (&g, &beta),
                    (h, h / (hv / hk), hv),
                    (dk, dv, stride),
                    run.clone(),
                )?;
                let x = head.inputs(dk, dv);
                let state_at = self.state.offset((slot * hv + h) * head_bytes);
                let mut state = if fresh {
                    vec![0.0; dk * dv]
                } else {
                    host::load::<f32>(mem, state_at, dk * dv)?
                };
                let mut start = 0;
                while start < run.len() {
                    let n = chunk_len.min(run.len() - start);
                    let mut f = ChunkFactors {
                        t: Vec::with_capacity(n * n),
                        attn: Vec::with_capacity(n * n),
                    };
                    for i in 0..n {
                        let at = scratch_row(run.start + start + i, h, hv, chunk_len);
                        f.t.extend(&host::load::<f32>(mem, self.t_mat.offset(at), n)?);
                        f.attn
                            .extend(&host::load::<f32>(mem, self.attn.offset(at), n)?);
                    }
                    let out = apply(&x.part(start..start + n), &f, &mut state);
                    for i in 0..n {
                        let t = run.start + start + i;
                        host::store_bf16(
                            mem,
                            at_bf16(self.o, (t * hv + h) * dv),
                            &out[i * dv..(i + 1) * dv],
                        )?;
                    }
                    start += n;
                }
                host::store(mem, state_at, &state)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::round_bf16;
    use crate::ops::gated_delta::dot;
    use crate::ops::testing::*;
    use crate::ops::{GdnChunkPrepTc, GdnChunkScanTc, GdnRecurrent};

    /// The widths and chunk of one comparison, and which pair of launches runs it.
    struct Shape {
        hv: u32,
        hk: u32,
        dk: u32,
        dv: u32,
        chunk_len: u32,
        tensor_cores: bool,
    }

    /// Runs of 1, 5, 64, 100 and 300 tokens in one launch (in slots 5, 0, 3, 6, 2 of 7), the
    /// 64-token run fresh over a slot of junk and the others continuing from nonzero states:
    /// the two passes give the recurrent walk's outputs (to a bf16 step) and states (to f32
    /// rounding), and leave the other slots alone. The tensor-core pair (`GdnChunkPrepTc`,
    /// `GdnChunkScanTc`) is held to its rounding bound instead: eight bf16 roundings (`8 u`,
    /// `u = 2^-9`) of the largest output and of the largest state element.
    fn the_two_passes_agree_with_the_recurrent_walk_at(shape: Shape) {
        let Shape {
            hv,
            hk,
            dk,
            dv,
            chunk_len,
            tensor_cores,
        } = shape;
        let lens = [1usize, 5, 64, 100, 300];
        let tokens: usize = lens.iter().sum();
        let (h, n) = (hv as usize, (dk * dv) as usize);
        // q | k | v a token, three elements of padding after them.
        let stride = (2 * hk * dk + hv * dv + 3) as usize;
        let rows: Vec<f32> = uniform(1, tokens * stride, 1.0)
            .iter()
            .map(|&x| round_bf16(x))
            .collect();
        // Decays from exp(-0.3) to exp(-0.001): a chunk's entering state still matters at its end.
        let g: Vec<f32> = uniform(2, tokens * h, 1.0)
            .iter()
            .map(|u| -0.001 - 0.15 * (u + 1.0))
            .collect();
        let beta: Vec<f32> = uniform(3, tokens * h, 0.5)
            .iter()
            .map(|u| u + 0.5)
            .collect();
        let slots_total = 7usize;
        let old = uniform(4, slots_total * h * n, 0.5);
        let mut starts = vec![0i32];
        for len in lens {
            starts.push(starts.last().unwrap() + len as i32);
        }
        let slots = [5i32, 0, 3, 6, 2];
        let mut positions = Vec::new();
        for (s, len) in lens.iter().enumerate() {
            let first = if s == 2 { 0 } else { 11 + 7 * s as i32 };
            positions.extend((0..*len as i32).map(|t| first + t));
        }
        let max_chunks = 300u32.div_ceil(chunk_len);

        let mut m = FlatMemory::new();
        let row = m.put(&bf16s(&rows));
        let (q, k, v) = (
            row,
            at_bf16(row, (hk * dk) as usize),
            at_bf16(row, (2 * hk * dk) as usize),
        );
        let (g_at, beta_at) = (m.put(&g), m.put(&beta));
        let (starts_at, slots_at, positions_at) =
            (m.put(&starts), m.put(&slots), m.put(&positions));
        let o_rec = m.put(&bf16s(&vec![0.0; tokens * h * dv as usize]));
        let o_chunk = m.put(&bf16s(&vec![0.0; tokens * h * dv as usize]));
        let (state_rec, state_chunk) = (m.put(&old), m.put(&old));
        let scratch = tokens * h * chunk_len as usize;
        let (t_mat, attn) = (
            m.put(&vec![f32::NAN; scratch]),
            m.put(&vec![f32::NAN; scratch]),
        );
        let seqs = lens.len() as u32;
        GdnRecurrent {
            o: o_rec,
            state: state_rec,
            q,
            k,
            v,
            g: g_at,
            beta: beta_at,
            seq_starts: starts_at,
            slots: slots_at,
            positions: positions_at,
            seqs,
            hv,
            hk,
            dk,
            dv,
            qkv_stride: stride as u32,
        }
        .reference(&mut m)
        .unwrap();
        let prep = GdnChunkPrep {
            t_mat,
            attn,
            q,
            k,
            g: g_at,
            beta: beta_at,
            seq_starts: starts_at,
            seqs,
            hv,
            hk,
            dk,
            qkv_stride: stride as u32,
            chunk_len,
            max_chunks,
        };
        let scan = GdnChunkScan {
            o: o_chunk,
            state: state_chunk,
            q,
            k,
            v,
            g: g_at,
            beta: beta_at,
            t_mat,
            attn,
            seq_starts: starts_at,
            slots: slots_at,
            positions: positions_at,
            seqs,
            hv,
            hk,
            dk,
            dv,
            qkv_stride: stride as u32,
            chunk_len,
            max_chunks,
        };
        if tensor_cores {
            GdnChunkPrepTc(prep).reference(&mut m).unwrap();
            GdnChunkScanTc(scan).reference(&mut m).unwrap();
        } else {
            prep.reference(&mut m).unwrap();
            scan.reference(&mut m).unwrap();
        }

        let label = format!(
            "hv={hv} hk={hk} dk={dk} dv={dv} chunk_len={chunk_len} tensor_cores={tensor_cores}"
        );
        // bf16's unit roundoff, eight times: the tensor-core pair's bound (tensor_cores.rs).
        let bound = 8.0 / 512.0;
        let want = f32s(&m.get(o_rec, tokens * h * dv as usize));
        let got = f32s(&m.get(o_chunk, tokens * h * dv as usize));
        let scale = want.iter().fold(0.0f32, |a, x| a.max(x.abs()));
        assert!(scale > 0.05, "{label}: degenerate outputs");
        for (i, (x, y)) in got.iter().zip(&want).enumerate() {
            let tol = if tensor_cores {
                bound * scale
            } else {
                y.abs() / 64.0 + 1e-5
            };
            assert!((x - y).abs() <= tol, "{label}: o[{i}] {x} vs {y}");
        }
        let want = m.get::<f32>(state_rec, slots_total * h * n);
        let got = m.get::<f32>(state_chunk, slots_total * h * n);
        let state_scale = want.iter().fold(0.0f32, |a, x| a.max(x.abs()));
        for (i, (x, y)) in got.iter().zip(&want).enumerate() {
            let tol = if tensor_cores {
                bound * state_scale
            } else {
                1e-4 * y.abs().max(1.0)
            };
            assert!((x - y).abs() <= tol, "{label}: state[{i}] {x} vs {y}");
        }
        // Slots 1 and 4 hold no run: untouched.
        for slot in [1, 4] {
            let at = slot * h * n;
            assert_eq!(
                got[at..at + h * n],
                old[at..at + h * n],
                "{label}: slot {slot}"
            );
        }
        // A run of more chunks than max_chunks is refused, not cut.
        let short = GdnChunkScan {
            max_chunks: max_chunks - 1,
            ..scan
        };
        assert!(short.reference(&mut m).is_err(), "{label}");
        assert!(GdnChunkScanTc(short).reference(&mut m).is_err(), "{label}");
    }

    #[test]
    fn the_two_passes_agree_with_the_recurrent_walk_at_qwen3_next_widths() {
        // dk = dv = 128 as Qwen3-Next and Qwen3.5; one value head a key head, then two.
        for tensor_cores in [false, true] {
            for (hv, hk) in [(2, 2), (4, 2)] {
                the_two_passes_agree_with_the_recurrent_walk_at(Shape {
                    hv,
                    hk,
                    dk: 128,
                    dv: 128,
                    chunk_len: GDN_CHUNK_MAX,
                    tensor_cores,
                });
            }
        }
    }

    #[test]
    fn the_two_passes_agree_with_the_recurrent_walk_at_small_widths() {
        // Widths not a multiple of four, and short chunks (many of them, a partial last).
        for tensor_cores in [false, true] {
            the_two_passes_agree_with_the_recurrent_walk_at(Shape {
                hv: 6,
                hk: 3,
                dk: 20,
                dv: 12,
                chunk_len: GDN_CHUNK_MAX,
                tensor_cores,
            });
            the_two_passes_agree_with_the_recurrent_walk_at(Shape {
                hv: 3,
                hk: 3,
                dk: 32,
                dv: 17,
                chunk_len: 16,
                tensor_cores,
            });
            the_two_passes_agree_with_the_recurrent_walk_at(Shape {
                hv: 2,
                hk: 1,
                dk: 8,
                dv: 8,
                chunk_len: 7,
                tensor_cores,
            });
        }
    }

    /// The prep's rows: `T` with a unit diagonal and `P` zero right of the diagonal and past a
    /// chunk's tokens; one-token chunks are `T = 1`, `P = q.k`.
    #[test]
    fn the_prep_writes_lower_triangular_rows() {
        let (hv, hk, dk, chunk_len) = (2u32, 1u32, 4u32, 4u32);
        let tokens = 6usize;
        let stride = 2 * dk as usize;
        let rows: Vec<f32> = uniform(9, tokens * stride, 1.0)
            .iter()
            .map(|&x| round_bf16(x))
            .collect();
        let mut m = FlatMemory::new();
        let row = m.put(&bf16s(&rows));
        let scratch = tokens * hv as usize * chunk_len as usize;
        let (t_mat, attn) = (
            m.put(&vec![f32::NAN; scratch]),
            m.put(&vec![f32::NAN; scratch]),
        );
        GdnChunkPrep {
            t_mat,
            attn,
            q: row,
            k: at_bf16(row, dk as usize),
            g: m.put(&vec![-0.5f32; tokens * hv as usize]),
            beta: m.put(&vec![0.75f32; tokens * hv as usize]),
            // A run of 5 (chunks of 4 and 1), then one of 1.
            seq_starts: m.put(&[0i32, 5, 6]),
            seqs: 2,
            hv,
            hk,
            dk,
            qkv_stride: stride as u32,
            chunk_len,
            max_chunks: 2,
        }
        .reference(&mut m)
        .unwrap();
        let (t, p) = (m.get::<f32>(t_mat, scratch), m.get::<f32>(attn, scratch));
        let c = chunk_len as usize;
        for token in 0..tokens {
            let i = if token < 4 { token } else { 0 };
            for h in 0..hv as usize {
                let at = (token * hv as usize + h) * c;
                assert_eq!(t[at + i], 1.0, "token {token} head {h}");
                for j in i + 1..c {
                    assert_eq!((t[at + j], p[at + j]), (0.0, 0.0), "token {token} {j}");
                }
                assert!(t[at..at + c].iter().all(|x| x.is_finite()));
            }
        }
        // A one-token chunk: P = q.k with q scaled by dk^-1/2, both normalised.
        let (qv, kv) = (
            &rows[5 * stride..5 * stride + 4],
            &rows[5 * stride + 4..6 * stride],
        );
        let norm = |x: &[f32]| x.iter().map(|v| v * v).sum::<f32>().sqrt();
        let want = dot(qv, kv) / (norm(qv) * norm(kv) * 2.0);
        assert!((p[5 * hv as usize * c] - want).abs() < 1e-5);
    }
}
