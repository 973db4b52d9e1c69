// SPDX-License-Identifier: MIT OR Apache-2.0
//! The prefill experts: assignments grouped by expert, grouped tensor-core products over each
//! expert's rows, and the weighted combine back into token order.
//!
//! The products are the GEMM baseline's WMMA tiles (64 x 64, K by 32, no pipelining): correct
//! first; a block takes one expert and walks its rows, so a launch is `experts` blocks deep
//! whatever the routing (no device-to-host read of the counts).

use std::borrow::Cow;

use half::bf16;
use metrale_core::{DevicePtr, KernelName, LaunchConfig};

use super::{
    ExpertActivation, add_shared, bad_args, check_experts, expert_act, expert_down, expert_of,
};
use crate::host::{self, HostError, HostMemory, Kernel, KernelAbi, kernel_args};
use crate::names;
use crate::ops::blocks_for;

kernel_args!(
    /// Groups the `n = rows * k` assignments by expert: `offsets[e]` is the first position of
    /// expert `e`'s assignments (`offsets[experts]` = the assignments that have an expert) and
    /// `sorted[offsets[e]..offsets[e + 1]]` holds them in increasing order (so by token);
    /// `sorted` past `offsets[experts]` is -1 ([`group_by_expert`]). One block; the same output on
    /// every run.
    MoeGroup => names::moe::MOE_GROUP {
        /// i32 `[experts + 1]`.
        offsets: DevicePtr,
        /// i32 `[n]`: assignments in expert order.
        sorted: DevicePtr,
        /// i32 `[n]`: the router's `topk_ids`.
        ids: DevicePtr,
        /// Assignments (`rows * k`).
        n: u32,
        /// Experts, at most [`MOE_MAX_EXPERTS`].
        experts: u32,
    }
);

kernel_args!(
    /// The grouped gate|up product with SwiGLU, in expert order: for every position `p` of
    /// expert `e`'s slice of [`MoeGroup`]'s output, with assignment `a = sorted[p]`,
    /// `act[p] = ` [`MoeGemvSwiglu`](super::MoeGemvSwiglu)'s row for `a`. Positions past
    /// `offsets[experts]` are not written.
    MoeGemmSwiglu => names::moe::MOE_GEMM_SWIGLU {
        /// bf16 `[n, inter]`, in expert order.
        act: DevicePtr,
        /// bf16 `[rows, hidden]`.
        x: DevicePtr,
        /// bf16 `[experts, 2 * inter, hidden]`.
        w: DevicePtr,
        /// i32 `[experts + 1]` ([`MoeGroup`]).
        offsets: DevicePtr,
        /// i32 `[n]` ([`MoeGroup`]).
        sorted: DevicePtr,
        /// Slots a row (an assignment's row is `a / k`).
        k: u32,
        /// Experts.
        experts: u32,
        /// Each expert's width.
        inter: u32,
        /// The model's width.
        hidden: u32,
    }
);

kernel_args!(
    /// The grouped down product, back in assignment order: for every position `p` of expert `e`'s
    /// slice, `y[sorted[p], h] = bf16(act[p] . w[e, h])` (each expert output rounded to bf16, as
    /// `transformers` in bf16 rounds it). Assignments with no expert are not written.
    MoeGemmDown => names::moe::MOE_GEMM_DOWN {
        /// bf16 `[n, hidden]`, in assignment order.
        y: DevicePtr,
        /// bf16 `[n, inter]`: [`MoeGemmSwiglu`]'s output, in expert order.
        act: DevicePtr,
        /// bf16 `[experts, hidden, inter]`.
        w: DevicePtr,
        /// i32 `[experts + 1]` ([`MoeGroup`]).
        offsets: DevicePtr,
        /// i32 `[n]` ([`MoeGroup`]).
        sorted: DevicePtr,
        /// Experts.
        experts: u32,
        /// The model's width.
        hidden: u32,
        /// Each expert's width.
        inter: u32,
    }
);

kernel_args!(
    /// [`MoeGemmSwiglu`]'s output as a weight stream, for few rows an expert (decode batches): a
    /// warp holds one column of one expert and streams its gate and up rows once per 8 of the
    /// expert's rows; experts no row chose read nothing. The same values (f32 sums in another
    /// order).
    MoeGroupedGemvSwiglu => names::moe::MOE_GROUPED_GEMV_SWIGLU {
        /// bf16 `[n, inter]`, in expert order.
        act: DevicePtr,
        /// bf16 `[rows, hidden]`.
        x: DevicePtr,
        /// bf16 `[experts, 2 * inter, hidden]`.
        w: DevicePtr,
        /// i32 `[experts + 1]` ([`MoeGroup`]).
        offsets: DevicePtr,
        /// i32 `[n]` ([`MoeGroup`]).
        sorted: DevicePtr,
        /// Slots a row (an assignment's row is `a / k`).
        k: u32,
        /// Experts.
        experts: u32,
        /// Each expert's width.
        inter: u32,
        /// The model's width.
        hidden: u32,
    }
);

kernel_args!(
    /// [`MoeGemmDown`]'s output as a weight stream, for few rows an expert: a warp holds one
    /// output column of one expert and streams its down row once per 8 of the expert's rows.
    MoeGroupedGemvDown => names::moe::MOE_GROUPED_GEMV_DOWN {
        /// bf16 `[n, hidden]`, in assignment order.
        y: DevicePtr,
        /// bf16 `[n, inter]`: the gate|up output, in expert order.
        act: DevicePtr,
        /// bf16 `[experts, hidden, inter]`.
        w: DevicePtr,
        /// i32 `[experts + 1]` ([`MoeGroup`]).
        offsets: DevicePtr,
        /// i32 `[n]` ([`MoeGroup`]).
        sorted: DevicePtr,
        /// Experts.
        experts: u32,
        /// The model's width.
        hidden: u32,
        /// Each expert's width.
        inter: u32,
    }
);

kernel_args!(
    /// The grouped up product with squared ReLU (Nemotron-H's experts), in expert order: for every
    /// position `p` of expert `e`'s slice, with assignment `a = sorted[p]`, `act[p] = `
    /// [`MoeGemvRelu2`](super::MoeGemvRelu2)'s row for `a`. [`MoeGemmSwiglu`]'s tiles, their 64
    /// columns all up rows.
    MoeGemmRelu2 => names::moe::MOE_GEMM_RELU2 {
        /// bf16 `[n, inter]`, in expert order.
        act: DevicePtr,
        /// bf16 `[rows, hidden]`.
        x: DevicePtr,
        /// bf16 `[experts, inter, hidden]`.
        w: DevicePtr,
        /// i32 `[experts + 1]` ([`MoeGroup`]).
        offsets: DevicePtr,
        /// i32 `[n]` ([`MoeGroup`]).
        sorted: DevicePtr,
        /// Slots a row (an assignment's row is `a / k`).
        k: u32,
        /// Experts.
        experts: u32,
        /// Each expert's width.
        inter: u32,
        /// The model's width.
        hidden: u32,
    }
);

kernel_args!(
    /// [`MoeGemmRelu2`]'s output as a weight stream for few rows an expert:
    /// [`MoeGroupedGemvSwiglu`]'s launch, a warp streaming one up row.
    MoeGroupedGemvRelu2 => names::moe::MOE_GROUPED_GEMV_RELU2 {
        /// bf16 `[n, inter]`, in expert order.
        act: DevicePtr,
        /// bf16 `[rows, hidden]`.
        x: DevicePtr,
        /// bf16 `[experts, inter, hidden]`.
        w: DevicePtr,
        /// i32 `[experts + 1]` ([`MoeGroup`]).
        offsets: DevicePtr,
        /// i32 `[n]` ([`MoeGroup`]).
        sorted: DevicePtr,
        /// Slots a row (an assignment's row is `a / k`).
        k: u32,
        /// Experts.
        experts: u32,
        /// Each expert's width.
        inter: u32,
        /// The model's width.
        hidden: u32,
    }
);

same_args!(MoeGemmSwiglu <-> MoeGemmRelu2 {
    act, x, w, offsets, sorted, k, experts, inter, hidden
});
same_args!(MoeGemmRelu2 <-> MoeGroupedGemvRelu2 {
    act, x, w, offsets, sorted, k, experts, inter, hidden
});

same_args!(MoeGemmSwiglu <-> MoeGroupedGemvSwiglu {
    act, x, w, offsets, sorted, k, experts, inter, hidden
});
same_args!(MoeGemmDown <-> MoeGroupedGemvDown {
    y, act, w, offsets, sorted, experts, hidden, inter
});

/// Output columns of a grouped weight-stream block (8 warps, a column each: `WARPS` in moe.cu).
const STREAM_COLUMNS: u32 = 8;

impl Kernel for MoeGroupedGemvSwiglu {
    /// One block per expert and 8 columns.
    fn launch_config(&self) -> LaunchConfig {
        LaunchConfig {
            grid: [
                blocks_for(self.inter.into(), STREAM_COLUMNS).max(1),
                self.experts.max(1),
                1,
            ],
            block: [256, 1, 1],
            shared_mem_bytes: 0,
        }
    }
    fn reference(&self, mem: &mut dyn HostMemory) -> Result<(), HostError> {
        first_reference(
            Self::NAME,
            &MoeGemmSwiglu::from(*self),
            ExpertActivation::SwiGlu,
            mem,
        )
    }
}

impl Kernel for MoeGroupedGemvRelu2 {
    /// [`MoeGroupedGemvSwiglu`]'s launch.
    fn launch_config(&self) -> LaunchConfig {
        MoeGroupedGemvSwiglu::from(MoeGemmSwiglu::from(MoeGemmRelu2::from(*self))).launch_config()
    }
    fn reference(&self, mem: &mut dyn HostMemory) -> Result<(), HostError> {
        first_reference(
            Self::NAME,
            &MoeGemmSwiglu::from(MoeGemmRelu2::from(*self)),
            ExpertActivation::Relu2,
            mem,
        )
    }
}

impl Kernel for MoeGroupedGemvDown {
    /// One block per expert and 8 output columns.
    fn launch_config(&self) -> LaunchConfig {
        LaunchConfig {
            grid: [
                blocks_for(self.hidden.into(), STREAM_COLUMNS).max(1),
                self.experts.max(1),
                1,
            ],
            block: [256, 1, 1],
            shared_mem_bytes: 0,
        }
    }
    fn reference(&self, mem: &mut dyn HostMemory) -> Result<(), HostError> {
        down_reference(Self::NAME, &MoeGemmDown::from(*self), mem)
    }
}

kernel_args!(
    /// The weighted combine: `out[r, h] = bf16(sum over slots s, in order, of weights[r, s] *
    /// y[r * k + s, h] + g_r * shared[r, h])` in f32; slots with no expert add nothing (their `y`
    /// rows are not read); the shared expert's term as in
    /// [`MoeGemvDown`](crate::ops::MoeGemvDown): added last, `g_r = sigmoid(shared_gate[r])`.
    MoeCombine => names::moe::MOE_COMBINE {
        /// bf16 `[rows, hidden]`.
        out: DevicePtr,
        /// bf16 `[rows * k, hidden]`: [`MoeGemmDown`]'s output.
        y: DevicePtr,
        /// i32 `[rows, k]`.
        ids: DevicePtr,
        /// f32 `[rows, k]`.
        weights: DevicePtr,
        /// bf16 `[rows, hidden]`: the shared expert's output (Qwen2-MoE), or null for none.
        shared: DevicePtr,
        /// f32 `[rows]`: the shared expert's gate logits, `g_r = sigmoid(shared_gate[r])`; null
        /// for `g_r = 1`.
        shared_gate: DevicePtr,
        /// Rows (tokens).
        rows: u32,
        /// Slots a row.
        k: u32,
        /// Experts (ids outside `[0, experts)` are empty slots).
        experts: u32,
        /// The model's width.
        hidden: u32,
    }
);

/// Threads of [`MoeGroup`]'s one block (`GROUP_WARPS * 32` in moe.cu).
const GROUP_THREADS: u32 = 512;
/// Output columns of a grouped-product block (`BN` in moe.cu); the SwiGLU form's tile holds half
/// as many gate columns and their up columns.
const TILE_COLUMNS: u32 = 64;

/// [`MoeGroup`]'s result on the host: `(offsets [experts + 1], sorted [ids.len()])`.
pub fn group_by_expert(ids: &[i32], experts: usize) -> (Vec<i32>, Vec<i32>) {
    let mut counts = vec![0i32; experts];
    for &id in ids {
        if let Some(e) = expert_of(id, experts) {
            counts[e] += 1;
        }
    }
    let mut offsets = Vec::with_capacity(experts + 1);
    let mut at = 0i32;
    offsets.push(0);
    for c in &counts {
        at += c;
        offsets.push(at);
    }
    let mut cursor = offsets[..experts].to_vec();
    let mut sorted = vec![-1i32; ids.len()];
    for (a, &id) in ids.iter().enumerate() {
        if let Some(e) = expert_of(id, experts) {
            sorted[cursor[e] as usize] = a as i32;
            cursor[e] += 1;
        }
    }
    (offsets, sorted)
}

/// Reads [`MoeGroup`]'s output as far as a grouped product reads it (`offsets`, and `sorted` up to
/// `offsets[experts]`), and checks that it is one: offsets rising from 0, positions naming
/// assignments.
fn load_groups(
    kernel: metrale_core::KernelName,
    mem: &dyn HostMemory,
    offsets: DevicePtr,
    sorted: DevicePtr,
    experts: usize,
) -> Result<(Vec<i32>, Vec<i32>), HostError> {
    let offsets = host::load::<i32>(mem, offsets, experts + 1)?;
    if offsets[0] != 0 || offsets.windows(2).any(|w| w[0] > w[1]) {
        return Err(bad_args(
            kernel,
            format!("offsets {offsets:?} do not rise from 0"),
        ));
    }
    let sorted = host::load::<i32>(mem, sorted, offsets[experts] as usize)?;
    if let Some(p) = sorted.iter().position(|&a| a < 0) {
        return Err(bad_args(
            kernel,
            format!("sorted[{p}] = {} is not an assignment", sorted[p]),
        ));
    }
    Ok((offsets, sorted))
}

impl Kernel for MoeGroup {
    fn launch_config(&self) -> LaunchConfig {
        LaunchConfig::linear(1, GROUP_THREADS)
    }
    fn reference(&self, mem: &mut dyn HostMemory) -> Result<(), HostError> {
        check_experts(Self::NAME, self.experts, 1)?;
        let ids = host::load::<i32>(mem, self.ids, self.n as usize)?;
        let (offsets, sorted) = group_by_expert(&ids, self.experts as usize);
        host::store(mem, self.offsets, &offsets)?;
        host::store(mem, self.sorted, &sorted)
    }
}

impl Kernel for MoeGemmSwiglu {
    /// One block per expert and 32 output columns (the tile's 64 gate and up columns).
    fn launch_config(&self) -> LaunchConfig {
        LaunchConfig {
            grid: [
                blocks_for(self.inter.into(), TILE_COLUMNS / 2).max(1),
                self.experts.max(1),
                1,
            ],
            block: [128, 1, 1],
            shared_mem_bytes: 0,
        }
    }
    fn reference(&self, mem: &mut dyn HostMemory) -> Result<(), HostError> {
        first_reference(Self::NAME, self, ExpertActivation::SwiGlu, mem)
    }
}

impl MoeGemmRelu2 {
    /// Extra tolerance per `act` element (position order, as the reference stores it): where an
    /// up product lies so near a bf16 rounding boundary that an f32 sum in another order (a
    /// tensor-core tile's) may round it the other way, the difference that makes once squared,
    /// plus one bf16 step of the result; zero elsewhere. The window is `2^-18` of the sum of the
    /// products' magnitudes, far above any f32 order's effect at these widths.
    pub fn flip_allowance(&self, mem: &dyn HostMemory) -> Result<Vec<f32>, HostError> {
        self.flip_allowance_of(Self::NAME, Stack::Bf16(self.w), mem)
    }

    /// [`MoeGemmRelu2::flip_allowance`] over the weights of `stack` (`self.w` unread).
    pub(super) fn flip_allowance_of(
        &self,
        name: KernelName,
        stack: Stack,
        mem: &dyn HostMemory,
    ) -> Result<Vec<f32>, HostError> {
        check_experts(name, self.experts, self.k)?;
        let (k, experts) = (self.k as usize, self.experts as usize);
        let (inter, hidden) = (self.inter as usize, self.hidden as usize);
        let (offsets, sorted) = load_groups(name, mem, self.offsets, self.sorted, experts)?;
        let rows = sorted
            .iter()
            .map(|&a| a as usize / k + 1)
            .max()
            .unwrap_or(0);
        let x = host::load_bf16(mem, self.x, rows * hidden)?;
        let square = |v: f32| crate::host::round_bf16(v.max(0.0) * v.max(0.0));
        let mut out = Vec::with_capacity(offsets[experts] as usize * inter);
        for e in 0..experts {
            let slice = &sorted[offsets[e] as usize..offsets[e + 1] as usize];
            if slice.is_empty() {
                continue;
            }
            let w = stack.expert(name, mem, e, (inter, hidden))?;
            for &a in slice {
                let xr = &x[(a as usize / k) * hidden..][..hidden];
                for j in 0..inter {
                    let wr = &w[j * hidden..][..hidden];
                    let (mut u, mut mag) = (0f64, 0f64);
                    for (x, w) in xr.iter().zip(wr) {
                        let t = f64::from(*x) * f64::from(*w);
                        u += t;
                        mag += t.abs();
                    }
                    // The bf16 values on either side of u and the midpoint between them.
                    let bits = (u as f32).to_bits() & 0xffff_0000;
                    let (lo, hi) = (f32::from_bits(bits), f32::from_bits(bits + 0x1_0000));
                    let mid = (f64::from(lo) + f64::from(hi)) / 2.0;
                    out.push(if (u - mid).abs() <= mag * 2f64.powi(-18) {
                        let (a, b) = (square(lo), square(hi));
                        (a - b).abs() + a.abs().max(b.abs()) * 2f32.powi(-8)
                    } else {
                        0.0
                    });
                }
            }
        }
        Ok(out)
    }
}

impl Kernel for MoeGemmRelu2 {
    /// One block per expert and 64 output columns (the tile's 64 up columns).
    fn launch_config(&self) -> LaunchConfig {
        LaunchConfig {
            grid: [
                blocks_for(self.inter.into(), TILE_COLUMNS).max(1),
                self.experts.max(1),
                1,
            ],
            block: [128, 1, 1],
            shared_mem_bytes: 0,
        }
    }
    fn reference(&self, mem: &mut dyn HostMemory) -> Result<(), HostError> {
        first_reference(
            Self::NAME,
            &MoeGemmSwiglu::from(*self),
            ExpertActivation::Relu2,
            mem,
        )
    }
}

impl Kernel for MoeGemmDown {
    /// One block per expert and 64 output columns.
    fn launch_config(&self) -> LaunchConfig {
        LaunchConfig {
            grid: [
                blocks_for(self.hidden.into(), TILE_COLUMNS).max(1),
                self.experts.max(1),
                1,
            ],
            block: [128, 1, 1],
            shared_mem_bytes: 0,
        }
    }
    fn reference(&self, mem: &mut dyn HostMemory) -> Result<(), HostError> {
        down_reference(Self::NAME, self, mem)
    }
}

impl Kernel for MoeCombine {
    fn launch_config(&self) -> LaunchConfig {
        let outputs = u64::from(self.rows) * u64::from(self.hidden);
        LaunchConfig::linear(blocks_for(outputs.max(1), 256), 256)
    }
    fn reference(&self, mem: &mut dyn HostMemory) -> Result<(), HostError> {
        let (rows, k, experts) = (self.rows as usize, self.k as usize, self.experts as usize);
        let hidden = self.hidden as usize;
        let ids = host::load::<i32>(mem, self.ids, rows * k)?;
        let weights = host::load::<f32>(mem, self.weights, rows * k)?;
        let y = host::load_bf16(mem, self.y, rows * k * hidden)?;
        let mut out = vec![0f32; rows * hidden];
        for (r, row) in out.chunks_exact_mut(hidden.max(1)).enumerate().take(rows) {
            for s in 0..k {
                let a = r * k + s;
                if expert_of(ids[a], experts).is_some() {
                    let ya = &y[a * hidden..(a + 1) * hidden];
                    for (o, &v) in row.iter_mut().zip(ya) {
                        *o = weights[a].mul_add(v, *o);
                    }
                }
            }
        }
        add_shared(mem, &mut out, self.shared, self.shared_gate, hidden)?;
        host::store_bf16(mem, self.out, &out)
    }
}

/// An expert stack as the grouped products' references read it: bf16, or e4m3 with f32 scales
/// (the FP8 forms', [`fp8`](super::fp8)'s layout).
#[derive(Clone, Copy, Debug)]
pub(super) enum Stack {
    Bf16(DevicePtr),
    Fp8 {
        w: DevicePtr,
        scales: DevicePtr,
        row_shift: u32,
    },
}

impl Stack {
    /// Expert `e`'s `rows` rows of `cols` as bf16: a bf16 stack's own, an FP8 stack's as
    /// [`Fp8DequantBf16`](crate::ops::Fp8DequantBf16) writes them (`bf16(e4m3 × scale)`), so an
    /// FP8 form's reference is its BF16 form's over the dequantised stack, bit for bit.
    fn expert<'m>(
        self,
        name: KernelName,
        mem: &'m dyn HostMemory,
        e: usize,
        (rows, cols): (usize, usize),
    ) -> Result<Cow<'m, [bf16]>, HostError> {
        match self {
            Stack::Bf16(w) => host::view::<bf16>(mem, w.offset(e * rows * cols * 2), rows * cols),
            Stack::Fp8 {
                w,
                scales,
                row_shift,
            } => Ok(Cow::Owned(
                super::fp8::fp8_rows(name, mem, (w, scales), (e * rows, rows, cols), row_shift)?
                    .into_iter()
                    .map(bf16::from_f32)
                    .collect(),
            )),
        }
    }
}

/// The grouped first product's reference for either activation (`a`'s fields are every form's):
/// [`MoeGemmSwiglu`]'s and [`MoeGemmRelu2`]'s, and their weight-stream and tensor-core forms',
/// errors named `name`.
pub(super) fn first_reference(
    name: KernelName,
    a: &MoeGemmSwiglu,
    activation: ExpertActivation,
    mem: &mut dyn HostMemory,
) -> Result<(), HostError> {
    first_reference_of(name, a, Stack::Bf16(a.w), activation, mem)
}

/// [`first_reference`] over the weights of `stack` (`a.w` unread).
pub(super) fn first_reference_of(
    name: KernelName,
    a: &MoeGemmSwiglu,
    stack: Stack,
    activation: ExpertActivation,
    mem: &mut dyn HostMemory,
) -> Result<(), HostError> {
    check_experts(name, a.experts, a.k)?;
    let (k, experts) = (a.k as usize, a.experts as usize);
    let (inter, hidden) = (a.inter as usize, a.hidden as usize);
    let (offsets, sorted) = load_groups(name, mem, a.offsets, a.sorted, experts)?;
    // The rows of x the assignments name.
    let rows = sorted
        .iter()
        .map(|&a| a as usize / k + 1)
        .max()
        .unwrap_or(0);
    let x = host::load_bf16(mem, a.x, rows * hidden)?;
    let per = activation.rows_per_column() * inter;
    let total = offsets[experts] as usize;
    let mut act = Vec::with_capacity(total * inter);
    for e in 0..experts {
        let slice = &sorted[offsets[e] as usize..offsets[e + 1] as usize];
        if slice.is_empty() {
            continue;
        }
        let w = stack.expert(name, &*mem, e, (per, hidden))?;
        for &a in slice {
            let r = a as usize / k;
            act.extend(expert_act(
                &x[r * hidden..(r + 1) * hidden],
                &w,
                0,
                inter,
                hidden,
                activation,
            ));
        }
    }
    host::store_bf16(mem, a.act, &act)
}

/// [`MoeGemmDown`]'s reference (also [`MoeGroupedGemvDown`]'s), errors named `name`.
pub(super) fn down_reference(
    name: KernelName,
    a: &MoeGemmDown,
    mem: &mut dyn HostMemory,
) -> Result<(), HostError> {
    down_reference_of(name, a, Stack::Bf16(a.w), mem)
}

/// [`down_reference`] over the weights of `stack` (`a.w` unread).
pub(super) fn down_reference_of(
    name: KernelName,
    a: &MoeGemmDown,
    stack: Stack,
    mem: &mut dyn HostMemory,
) -> Result<(), HostError> {
    check_experts(name, a.experts, 1)?;
    let experts = a.experts as usize;
    let (hidden, inter) = (a.hidden as usize, a.inter as usize);
    let (offsets, sorted) = load_groups(name, mem, a.offsets, a.sorted, experts)?;
    let total = offsets[experts] as usize;
    let act = host::load_bf16(mem, a.act, total * inter)?;
    let mut rows = Vec::with_capacity(total);
    for e in 0..experts {
        let (begin, end) = (offsets[e] as usize, offsets[e + 1] as usize);
        if begin == end {
            continue;
        }
        let w = stack.expert(name, &*mem, e, (hidden, inter))?;
        for p in begin..end {
            let y = expert_down(&act[p * inter..(p + 1) * inter], &w, 0, hidden, inter);
            rows.push((sorted[p] as usize, y));
        }
    }
    for (assignment, y) in rows {
        let at = DevicePtr(a.y.0 + (assignment * hidden * 2) as u64);
        host::store_bf16(mem, at, &y)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::moe::MOE_MAX_EXPERTS;
    use crate::ops::testing::*;
    use crate::ops::{MoeGemvDown, MoeGemvRelu2, MoeGemvSwiglu};

    /// An up product exactly between two bf16 values gets the squares' difference; one on a
    /// bf16 value gets nothing.
    #[test]
    fn relu2_flip_allowance_covers_products_at_a_rounding_boundary() {
        let mut m = FlatMemory::new();
        // One row, one expert, k = 1, two columns over hidden 2: u = 1 + 2^-8 (the midpoint of
        // bf16 1 and 1 + 2^-7) and u = 1.
        let x = m.put(&bf16s(&[1.0, 1.0]));
        let w = m.put(&bf16s(&[1.0, 2f32.powi(-8), 1.0, 0.0]));
        let offsets = m.put(&[0i32, 1]);
        let sorted = m.put(&[0i32]);
        let gemm = MoeGemmRelu2 {
            act: DevicePtr::NULL,
            x,
            w,
            offsets,
            sorted,
            k: 1,
            experts: 1,
            inter: 2,
            hidden: 2,
        };
        let extra = gemm.flip_allowance(&m).unwrap();
        let step = 1.0 + 2f32.powi(-7);
        assert!(extra[0] >= step * step - 1.0, "{extra:?}");
        assert_eq!(extra[1], 0.0);
    }

    #[test]
    fn grouping_orders_by_expert_then_assignment() {
        // Two rows of k = 3 over 4 experts, one empty slot (-1) and one id past the experts.
        let ids = [2, 0, 3, 0, 2, -1, 9, 2, 1];
        let (offsets, sorted) = group_by_expert(&ids, 4);
        assert_eq!(offsets, vec![0, 2, 3, 6, 7]);
        assert_eq!(sorted, vec![1, 3, 8, 0, 4, 7, 2, -1, -1]);
        // No assignments at all, and every one on one expert.
        assert_eq!(group_by_expert(&[], 3), (vec![0, 0, 0, 0], vec![]));
        assert_eq!(
            group_by_expert(&[1, 1, 1], 2),
            (vec![0, 0, 3], vec![0, 1, 2])
        );
    }

    #[test]
    fn the_grouped_path_equals_the_decode_path_up_to_the_expert_rounding() {
        // 70 rows (more than one 64-row tile for some experts), 5 experts, k = 2, one empty slot.
        let (rows, experts, k, hidden, inter) = (70usize, 5usize, 2usize, 40usize, 24usize);
        let x = bf16s(&uniform(11, rows * hidden, 1.0));
        let gate_up = bf16s(&uniform(12, experts * 2 * inter * hidden, 0.3));
        let down = bf16s(&uniform(13, experts * hidden * inter, 0.3));
        let mut ids: Vec<i32> = (0..rows * k)
            .map(|a| ((a * 7 + a / k * 3) % experts) as i32)
            .collect();
        for r in 0..rows {
            if ids[r * k] == ids[r * k + 1] {
                ids[r * k + 1] = (ids[r * k + 1] + 1) % experts as i32;
            }
        }
        ids[5] = -1;
        let weights = uniform(14, rows * k, 1.0);
        let (n, e_u, k_u) = ((rows * k) as u32, experts as u32, k as u32);
        let mut m = FlatMemory::new();
        let (xp, wgu, wd) = (m.put(&x), m.put(&gate_up), m.put(&down));
        let (idp, wp) = (m.put(&ids), m.put(&weights));
        let offsets = m.put(&vec![-5i32; experts + 1]);
        let sorted = m.put(&vec![-5i32; rows * k]);
        MoeGroup {
            offsets,
            sorted,
            ids: idp,
            n,
            experts: e_u,
        }
        .reference(&mut m)
        .unwrap();
        let act = m.put(&bf16s(&vec![0.0; rows * k * inter]));
        let y = m.put(&bf16s(&vec![0.0; rows * k * hidden]));
        let out = m.put(&bf16s(&vec![9.0; rows * hidden]));
        MoeGemmSwiglu {
            act,
            x: xp,
            w: wgu,
            offsets,
            sorted,
            k: k_u,
            experts: e_u,
            inter: inter as u32,
            hidden: hidden as u32,
        }
        .reference(&mut m)
        .unwrap();
        MoeGemmDown {
            y,
            act,
            w: wd,
            offsets,
            sorted,
            experts: e_u,
            hidden: hidden as u32,
            inter: inter as u32,
        }
        .reference(&mut m)
        .unwrap();
        MoeCombine {
            out,
            y,
            ids: idp,
            weights: wp,
            shared: DevicePtr::NULL,
            shared_gate: DevicePtr::NULL,
            rows: rows as u32,
            k: k_u,
            experts: e_u,
            hidden: hidden as u32,
        }
        .reference(&mut m)
        .unwrap();
        // The decode path on the same inputs.
        let dact = m.put(&bf16s(&vec![0.0; rows * k * inter]));
        let dout = m.put(&bf16s(&vec![9.0; rows * hidden]));
        MoeGemvSwiglu {
            shared_act: DevicePtr::NULL,
            shared_w: DevicePtr::NULL,
            shared_inter: 0,
            act: dact,
            x: xp,
            w: wgu,
            ids: idp,
            rows: rows as u32,
            k: k_u,
            experts: e_u,
            inter: inter as u32,
            hidden: hidden as u32,
        }
        .reference(&mut m)
        .unwrap();
        MoeGemvDown {
            shared_act: DevicePtr::NULL,
            shared_w: DevicePtr::NULL,
            shared_inter: 0,
            out: dout,
            act: dact,
            w: wd,
            ids: idp,
            weights: wp,
            shared: DevicePtr::NULL,
            shared_gate: DevicePtr::NULL,
            rows: rows as u32,
            k: k_u,
            experts: e_u,
            hidden: hidden as u32,
            inter: inter as u32,
        }
        .reference(&mut m)
        .unwrap();
        // The activations are the same rows, in expert order.
        let (offs, sort) = group_by_expert(&ids, experts);
        let grouped: Vec<bf16> = m.get(act, rows * k * inter);
        let decoded: Vec<bf16> = m.get(dact, rows * k * inter);
        for p in 0..offs[experts] as usize {
            let a = sort[p] as usize;
            assert_eq!(
                grouped[p * inter..(p + 1) * inter],
                decoded[a * inter..(a + 1) * inter]
            );
        }
        // The outputs differ by the rounding of each expert output to bf16 (the grouped path's).
        let (g, d) = (
            f32s(&m.get(out, rows * hidden)),
            f32s(&m.get(dout, rows * hidden)),
        );
        let scale = d.iter().map(|v| v.abs()).fold(0f32, f32::max);
        for (i, (g, d)) in g.iter().zip(&d).enumerate() {
            assert!((g - d).abs() <= scale / 64.0, "{i}: {g} vs {d}");
        }
    }

    #[test]
    fn the_grouped_squared_relu_forms_are_the_decode_rows_in_expert_order() {
        // Nemotron-3-Nano's top 6, over 8 experts and 20 rows, at small widths; one empty slot.
        let (rows, experts, k, hidden, inter) = (20usize, 8usize, 6usize, 40usize, 24usize);
        let x = bf16s(&uniform(31, rows * hidden, 1.0));
        let up = bf16s(&uniform(32, experts * inter * hidden, 0.3));
        let mut ids: Vec<i32> = (0..rows)
            .flat_map(|r| (0..k).map(move |s| ((r * 3 + s) % experts) as i32))
            .collect();
        ids[7] = -1;
        let (offs, sort) = group_by_expert(&ids, experts);
        let mut m = FlatMemory::new();
        let (xp, wu, idp) = (m.put(&x), m.put(&up), m.put(&ids));
        let (offsets, sorted) = (m.put(&offs), m.put(&sort));
        let n = rows * k;
        let decoded = m.put(&bf16s(&vec![0.0; n * inter]));
        MoeGemvRelu2 {
            shared_act: DevicePtr::NULL,
            shared_w: DevicePtr::NULL,
            shared_inter: 0,
            act: decoded,
            x: xp,
            w: wu,
            ids: idp,
            rows: rows as u32,
            k: k as u32,
            experts: experts as u32,
            inter: inter as u32,
            hidden: hidden as u32,
        }
        .reference(&mut m)
        .unwrap();
        let decoded: Vec<bf16> = m.get(decoded, n * inter);
        let gemm = MoeGemmRelu2 {
            act: DevicePtr::NULL,
            x: xp,
            w: wu,
            offsets,
            sorted,
            k: k as u32,
            experts: experts as u32,
            inter: inter as u32,
            hidden: hidden as u32,
        };
        type Form<'a> = &'a dyn Fn(DevicePtr, &mut FlatMemory);
        let forms: [Form; 3] = [
            &|act, m| MoeGemmRelu2 { act, ..gemm }.reference(m).unwrap(),
            &|act, m| {
                MoeGroupedGemvRelu2::from(MoeGemmRelu2 { act, ..gemm })
                    .reference(m)
                    .unwrap()
            },
            &|act, m| {
                crate::ops::MoeGroupedMmaRelu2::from(MoeGemmRelu2 { act, ..gemm })
                    .reference(m)
                    .unwrap()
            },
        ];
        for (f, form) in forms.iter().enumerate() {
            let act = m.put(&bf16s(&vec![0.0; n * inter]));
            form(act, &mut m);
            let grouped: Vec<bf16> = m.get(act, n * inter);
            for p in 0..offs[experts] as usize {
                let a = sort[p] as usize;
                assert_eq!(
                    grouped[p * inter..(p + 1) * inter],
                    decoded[a * inter..(a + 1) * inter],
                    "form {f} position {p}"
                );
            }
        }
        // Nano's widths: 64 up columns a tile block, 32 a tensor-core warp (128 a block).
        let nano = MoeGemmRelu2 {
            inter: 1856,
            hidden: 2688,
            experts: 128,
            ..gemm
        };
        assert_eq!(nano.launch_config().grid, [29, 128, 1]);
        assert_eq!(
            crate::ops::MoeGroupedMmaRelu2::from(nano)
                .launch_config()
                .grid,
            [15, 128, 1]
        );
        assert_eq!(
            MoeGroupedGemvRelu2::from(nano).launch_config().grid,
            [232, 128, 1]
        );
    }

    #[test]
    fn the_shared_expert_joins_both_epilogues_behind_its_sigmoid_gate() {
        // 3 rows, k = 2 of 3 experts, one empty slot; the expert outputs given directly (y for
        // the combine; for the decode launch, expert e's down rows are the identity scaled by
        // e + 1, so act's rows are y's divided by that).
        let (rows, k, experts, hidden) = (3usize, 2usize, 3usize, 4usize);
        let ids = [0i32, 2, 1, -1, 2, 0];
        let weights = [0.75f32, 0.25, 1.0, 0.5, 0.5, 0.5];
        let y: Vec<f32> = (0..rows * k * hidden)
            .map(|i| ((i * 5 % 11) as f32 - 5.0) / 4.0)
            .collect();
        let shared: Vec<f32> = (0..rows * hidden)
            .map(|i| ((i * 3 % 7) as f32 - 3.0) / 2.0)
            .collect();
        // sigmoid(0) = 1/2; the others saturate to 1 and 0 within f32.
        let logits = [0.0f32, 40.0, -40.0];
        let mut down = vec![0f32; experts * hidden * hidden];
        for e in 0..experts {
            for h in 0..hidden {
                down[(e * hidden + h) * hidden + h] = (e + 1) as f32;
            }
        }
        let act: Vec<f32> = (0..rows * k * hidden)
            .map(|i| match ids[i / hidden] {
                e if e >= 0 => y[i] / (e + 1) as f32,
                _ => 0.0,
            })
            .collect();
        let mut m = FlatMemory::new();
        let (yp, idp, wp) = (m.put(&bf16s(&y)), m.put(&ids), m.put(&weights));
        let (sp, gp) = (m.put(&bf16s(&shared)), m.put(&logits));
        let (actp, wd) = (m.put(&bf16s(&act)), m.put(&bf16s(&down)));
        for gated in [false, true] {
            let gate = if gated { gp } else { DevicePtr::NULL };
            let (out, dout) = (
                m.put(&bf16s(&vec![9.0; rows * hidden])),
                m.put(&bf16s(&vec![9.0; rows * hidden])),
            );
            MoeCombine {
                out,
                y: yp,
                ids: idp,
                weights: wp,
                shared: sp,
                shared_gate: gate,
                rows: rows as u32,
                k: k as u32,
                experts: experts as u32,
                hidden: hidden as u32,
            }
            .reference(&mut m)
            .unwrap();
            MoeGemvDown {
                shared_act: DevicePtr::NULL,
                shared_w: DevicePtr::NULL,
                shared_inter: 0,
                out: dout,
                act: actp,
                w: wd,
                ids: idp,
                weights: wp,
                shared: sp,
                shared_gate: gate,
                rows: rows as u32,
                k: k as u32,
                experts: experts as u32,
                hidden: hidden as u32,
                inter: hidden as u32,
            }
            .reference(&mut m)
            .unwrap();
            // Every value is a multiple of 1/16 well inside bf16's precision: exact.
            let mut want = vec![0f32; rows * hidden];
            for r in 0..rows {
                let g = if gated { [0.5, 1.0, 0.0][r] } else { 1.0 };
                for h in 0..hidden {
                    let routed: f32 = (0..k)
                        .filter(|&s| ids[r * k + s] >= 0)
                        .map(|s| weights[r * k + s] * y[(r * k + s) * hidden + h])
                        .sum();
                    want[r * hidden + h] = routed + g * shared[r * hidden + h];
                }
            }
            assert_eq!(
                f32s(&m.get(out, rows * hidden)),
                want,
                "combine, gated {gated}"
            );
            assert_eq!(
                f32s(&m.get(dout, rows * hidden)),
                want,
                "decode, gated {gated}"
            );
        }
    }

    #[test]
    fn grouped_references_refuse_a_broken_grouping() {
        let mut m = FlatMemory::new();
        let offsets = m.put(&[0i32, 3, 2]);
        let sorted = m.put(&[0i32, 1, 2]);
        let z = m.put(&[0u8; 4096]);
        let down = MoeGemmDown {
            y: z,
            act: z,
            w: z,
            offsets,
            sorted,
            experts: 2,
            hidden: 4,
            inter: 4,
        };
        assert!(down.reference(&mut m).is_err());
        // The launches: one block per expert and column tile; the combine one thread an output.
        assert_eq!(down.launch_config().grid, [1, 2, 1]);
        assert_eq!(
            MoeGemmSwiglu {
                act: z,
                x: z,
                w: z,
                offsets,
                sorted,
                k: 8,
                experts: 128,
                inter: 768,
                hidden: 2048,
            }
            .launch_config()
            .grid,
            [24, 128, 1]
        );
        assert!(
            MoeGroup {
                offsets,
                sorted,
                ids: z,
                n: 4,
                experts: MOE_MAX_EXPERTS + 1,
            }
            .reference(&mut m)
            .is_err()
        );
    }
}
