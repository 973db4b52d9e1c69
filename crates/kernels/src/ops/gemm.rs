// SPDX-License-Identifier: MIT OR Apache-2.0
//! Dense GEMM in HF Linear layout: `C[M, N] = A[M, K] * W[N, K]^T (+ bias)`.

use half::bf16;
use metrale_core::{DevicePtr, LaunchConfig};

use super::blocks_for;
use crate::host::{self, HostError, HostMemory, Kernel, KernelAbi, kernel_args, widen};
use crate::names;
use crate::registry::hardware::hopper;

kernel_args!(
    /// `C = A * W^T (+ bias)`, bf16 output.
    Gemm => names::gemm::GEMM_BF16 {
        /// bf16 `[m, n]`.
        c: DevicePtr,
        /// bf16 `[m, k]`.
        a: DevicePtr,
        /// bf16 `[n, k]` (a Linear weight).
        w: DevicePtr,
        /// bf16 `[n]`, or null.
        bias: DevicePtr,
        /// Rows of A and C.
        m: u32,
        /// Rows of W, columns of C.
        n: u32,
        /// The reduction length.
        k: u32,
    }
);

kernel_args!(
    /// `C = A * W^T (+ bias)`, f32 output (the LM head).
    GemmF32Out => names::gemm::GEMM_BF16_F32OUT {
        /// f32 `[m, n]`.
        c: DevicePtr,
        /// bf16 `[m, k]`.
        a: DevicePtr,
        /// bf16 `[n, k]`.
        w: DevicePtr,
        /// bf16 `[n]`, or null.
        bias: DevicePtr,
        /// Rows of A and C.
        m: u32,
        /// Rows of W, columns of C.
        n: u32,
        /// The reduction length.
        k: u32,
    }
);

kernel_args!(
    /// The same product for decode-sized `m` (at most [`GEMV_MAX_ROWS`]): a weight stream whose
    /// launch geometry comes from [`gemv_columns_per_block`].
    Gemv => names::gemv::GEMV_BF16 {
        /// bf16 `[m, n]`.
        c: DevicePtr,
        /// bf16 `[m, k]`.
        a: DevicePtr,
        /// bf16 `[n, k]`.
        w: DevicePtr,
        /// bf16 `[n]`, or null.
        bias: DevicePtr,
        /// Rows of A and C (at most 8).
        m: u32,
        /// Rows of W, columns of C.
        n: u32,
        /// The reduction length.
        k: u32,
    }
);

kernel_args!(
    /// [`Gemv`] with f32 output (the LM head at decode).
    GemvF32Out => names::gemv::GEMV_BF16_F32OUT {
        /// f32 `[m, n]`.
        c: DevicePtr,
        /// bf16 `[m, k]`.
        a: DevicePtr,
        /// bf16 `[n, k]`.
        w: DevicePtr,
        /// bf16 `[n]`, or null.
        bias: DevicePtr,
        /// Rows of A and C (at most 8).
        m: u32,
        /// Rows of W, columns of C.
        n: u32,
        /// The reduction length.
        k: u32,
    }
);

kernel_args!(
    /// [`Gemv`] of the fused gate|up weight (`w` is `[2 * inter, k]`, gate rows first) with
    /// [`SiluMul`](super::SiluMul) in its epilogue: `out[m, inter] = bf16(silu(g) * u)` of the
    /// bf16-rounded products `g` (gate row) and `u` (up row), the same bits as the two launches
    /// when the column split is the same (it is whenever `gemv_columns_per_block(m, 2 * inter, k)`
    /// is at least 2). No bias.
    GemvSwiglu => names::gemv::GEMV_BF16_SWIGLU {
        /// bf16 `[m, inter]`.
        out: DevicePtr,
        /// bf16 `[m, k]`.
        a: DevicePtr,
        /// bf16 `[2 * inter, k]`: the gate rows, then the up rows.
        w: DevicePtr,
        /// Rows, at most [`GEMV_MAX_ROWS`].
        m: u32,
        /// Columns of the output (half the weight's rows).
        inter: u32,
        /// Inputs.
        k: u32,
    }
);

kernel_args!(
    /// [`Gemv`] for 1 to [`GEMV_FMA_MAX_ROWS`] rows whose first-wave blocks copy half of each
    /// lane's first batch of weights into shared memory before the programmatic-launch wait, so
    /// the weight stream starts while the kernel before it runs. The same bits as [`Gemv`];
    /// [`gemv_stages`] says which products take it.
    GemvStaged => names::gemv::GEMV_BF16_STAGED {
        /// bf16 `[m, n]`.
        c: DevicePtr,
        /// bf16 `[m, k]`.
        a: DevicePtr,
        /// bf16 `[n, k]`.
        w: DevicePtr,
        /// bf16 `[n]`, or null.
        bias: DevicePtr,
        /// Rows of A and C (at most [`GEMV_FMA_MAX_ROWS`]).
        m: u32,
        /// Rows of W, columns of C.
        n: u32,
        /// The reduction length.
        k: u32,
    }
);

kernel_args!(
    /// [`GemvSwiglu`] in [`GemvStaged`]'s form (1 to [`GEMV_FMA_MAX_ROWS`] rows; the same bits).
    GemvSwigluStaged => names::gemv::GEMV_BF16_SWIGLU_STAGED {
        /// bf16 `[m, inter]`.
        out: DevicePtr,
        /// bf16 `[m, k]`.
        a: DevicePtr,
        /// bf16 `[2 * inter, k]`: the gate rows, then the up rows.
        w: DevicePtr,
        /// Rows, at most [`GEMV_FMA_MAX_ROWS`].
        m: u32,
        /// Columns of the output (half the weight's rows).
        inter: u32,
        /// Inputs.
        k: u32,
    }
);

kernel_args!(
    /// [`AddRmsNorm`](super::AddRmsNorm) into [`Gemv`] in one launch, for 1 to
    /// [`GEMV_FMA_MAX_ROWS`] rows: `residual_out = residual + input` in f32 (a copy of `residual`
    /// when `input` is null) and `c = bf16(rmsnorm(residual_out) * norm_weight) * W^T (+ bias)`,
    /// the same bits as the two launches. Every block normalises the rows itself; `stage` (0 or 1)
    /// also copies the first weights before the programmatic-launch wait, as [`GemvStaged`].
    GemvNorm => names::gemv::GEMV_BF16_NORM {
        /// bf16 `[m, n]`.
        c: DevicePtr,
        /// f32 `[m, k]`, the residual stream before the add (read only).
        residual: DevicePtr,
        /// f32 `[m, k]`: the residual stream after the add; must not alias `residual`.
        residual_out: DevicePtr,
        /// bf16 `[m, k]`, or null.
        input: DevicePtr,
        /// bf16 `[k]`, the norm's weight.
        norm_weight: DevicePtr,
        /// bf16 `[n, k]`.
        w: DevicePtr,
        /// bf16 `[n]`, or null.
        bias: DevicePtr,
        /// Rows (at most [`GEMV_FMA_MAX_ROWS`]).
        m: u32,
        /// Rows of W, columns of C.
        n: u32,
        /// The reduction length (the residual's width).
        k: u32,
        /// Added to the mean square.
        eps: f32,
        /// 1 to stage the first weights before the wait, 0 not to.
        stage: u32,
    }
);

kernel_args!(
    /// [`GemvSwiglu`] of the normalised rows, in [`GemvNorm`]'s form (1 to
    /// [`GEMV_FMA_MAX_ROWS`] rows; the same bits as [`AddRmsNorm`](super::AddRmsNorm) then
    /// [`GemvSwiglu`]).
    GemvSwigluNorm => names::gemv::GEMV_BF16_SWIGLU_NORM {
        /// bf16 `[m, inter]`.
        out: DevicePtr,
        /// f32 `[m, k]`, the residual stream before the add (read only).
        residual: DevicePtr,
        /// f32 `[m, k]`: the residual stream after the add; must not alias `residual`.
        residual_out: DevicePtr,
        /// bf16 `[m, k]`, or null.
        input: DevicePtr,
        /// bf16 `[k]`, the norm's weight.
        norm_weight: DevicePtr,
        /// bf16 `[2 * inter, k]`: the gate rows, then the up rows.
        w: DevicePtr,
        /// Rows (at most [`GEMV_FMA_MAX_ROWS`]).
        m: u32,
        /// Columns of the output (half the weight's rows).
        inter: u32,
        /// The reduction length (the residual's width).
        k: u32,
        /// Added to the mean square.
        eps: f32,
        /// 1 to stage the first weights before the wait, 0 not to.
        stage: u32,
    }
);

kernel_args!(
    /// [`Gemv`] of one row as a bulk-copy stream (`gemv_stream.cu`): every warp of the grid takes
    /// a run of whole columns and keeps [`GEMV_STREAM_STAGES`] chunks of its weights in flight
    /// through `cp.async.bulk` into shared memory, refilled as it reads them, so its stream does
    /// not pause at a column's end. For `m = 1` and `k` a multiple of 1024 (chunks of
    /// [`GEMV_STREAM_CHUNK`] bytes where `k` is a multiple of 2048, else of half that;
    /// [`gemv_stream_fits`]). Each column's sum runs in one order
    /// whatever the grid (deterministic); not the same order as [`Gemv`]'s, so not the same bits.
    GemvStream => names::gemv_stream::GEMV_BF16_STREAM {
        /// bf16 `[1, n]`.
        c: DevicePtr,
        /// bf16 `[1, k]`.
        a: DevicePtr,
        /// bf16 `[n, k]`.
        w: DevicePtr,
        /// bf16 `[n]`, or null.
        bias: DevicePtr,
        /// Rows of A and C: 1.
        m: u32,
        /// Rows of W, columns of C.
        n: u32,
        /// The reduction length.
        k: u32,
        /// [`GEMV_STREAM_CHUNK`]-byte units of each warp's ring copied before the
        /// programmatic-launch wait (at most [`GEMV_STREAM_STAGES`], the whole ring; the rest of
        /// the ring's first fill goes out after it).
        prewait: u32,
        /// 1 to stream the weight through L2 as evict-first lines, 0 not to.
        evict_first: u32,
    }
);

kernel_args!(
    /// [`GemvSwiglu`] of one row as [`GemvStream`]'s bulk-copy stream: a warp's output column
    /// streams its gate row, then its up row, and stores `bf16(silu(g) * u)` of the bf16 products.
    /// For `m = 1` and `k` as [`GemvStream`]'s ([`gemv_stream_fits`] of `inter` columns).
    GemvSwigluStream => names::gemv_stream::GEMV_BF16_SWIGLU_STREAM {
        /// bf16 `[1, inter]`.
        out: DevicePtr,
        /// bf16 `[1, k]`.
        a: DevicePtr,
        /// bf16 `[2 * inter, k]`: the gate rows, then the up rows.
        w: DevicePtr,
        /// Rows: 1.
        m: u32,
        /// Columns of the output (half the weight's rows).
        inter: u32,
        /// Inputs.
        k: u32,
        /// As [`GemvStream`]'s.
        prewait: u32,
        /// As [`GemvStream`]'s.
        evict_first: u32,
    }
);

kernel_args!(
    /// [`GemvStream`] with f32 output (the LM head, as [`GemvF32Out`]).
    GemvStreamF32Out => names::gemv_stream::GEMV_BF16_STREAM_F32OUT {
        /// f32 `[1, n]`.
        c: DevicePtr,
        /// bf16 `[1, k]`.
        a: DevicePtr,
        /// bf16 `[n, k]`.
        w: DevicePtr,
        /// bf16 `[n]`, or null.
        bias: DevicePtr,
        /// Rows of A and C: 1.
        m: u32,
        /// Rows of W, columns of C.
        n: u32,
        /// The reduction length.
        k: u32,
        /// As [`GemvStream`]'s.
        prewait: u32,
        /// As [`GemvStream`]'s.
        evict_first: u32,
    }
);

kernel_args!(
    /// [`GemvNorm`] of one row as [`GemvStream`]'s bulk-copy stream: every block normalises the
    /// row into its shared memory after the programmatic-launch wait (the bits
    /// [`AddRmsNorm`](super::AddRmsNorm) would store), block 0 stores `residual_out`, and the
    /// product streams as [`GemvStream`]'s (the same sums). For `m = 1` and `k` as
    /// [`GemvStream`]'s.
    GemvStreamNorm => names::gemv_stream::GEMV_BF16_STREAM_NORM {
        /// bf16 `[1, n]`.
        c: DevicePtr,
        /// f32 `[1, k]`, the residual stream before the add (read only).
        residual: DevicePtr,
        /// f32 `[1, k]`: the residual stream after the add; must not alias `residual`.
        residual_out: DevicePtr,
        /// bf16 `[1, k]`, or null.
        input: DevicePtr,
        /// bf16 `[k]`, the norm's weight.
        norm_weight: DevicePtr,
        /// bf16 `[n, k]`.
        w: DevicePtr,
        /// bf16 `[n]`, or null.
        bias: DevicePtr,
        /// Rows: 1.
        m: u32,
        /// Rows of W, columns of C.
        n: u32,
        /// The reduction length (the residual's width).
        k: u32,
        /// Added to the mean square.
        eps: f32,
        /// As [`GemvStream`]'s.
        prewait: u32,
        /// As [`GemvStream`]'s.
        evict_first: u32,
    }
);

kernel_args!(
    /// [`GemvSwigluNorm`] of one row as [`GemvSwigluStream`]'s bulk-copy stream, the row
    /// normalised as [`GemvStreamNorm`]'s.
    GemvSwigluStreamNorm => names::gemv_stream::GEMV_BF16_SWIGLU_STREAM_NORM {
        /// bf16 `[1, inter]`.
        out: DevicePtr,
        /// f32 `[1, k]`, the residual stream before the add (read only).
        residual: DevicePtr,
        /// f32 `[1, k]`: the residual stream after the add; must not alias `residual`.
        residual_out: DevicePtr,
        /// bf16 `[1, k]`, or null.
        input: DevicePtr,
        /// bf16 `[k]`, the norm's weight.
        norm_weight: DevicePtr,
        /// bf16 `[2 * inter, k]`: the gate rows, then the up rows.
        w: DevicePtr,
        /// Rows: 1.
        m: u32,
        /// Columns of the output (half the weight's rows).
        inter: u32,
        /// The reduction length (the residual's width).
        k: u32,
        /// Added to the mean square.
        eps: f32,
        /// As [`GemvStream`]'s.
        prewait: u32,
        /// As [`GemvStream`]'s.
        evict_first: u32,
    }
);

/// Bytes one bulk copy of [`GemvStream`] moves where a weight row is whole pieces of this size
/// (`k` a multiple of 2048; else half of it: `CHUNK` in gemv_stream.cu), and the unit of its
/// `prewait`.
pub const GEMV_STREAM_CHUNK: u32 = 4096;
/// [`GEMV_STREAM_CHUNK`]s in each warp's ring of [`GemvStream`] (`RING / UNIT` in
/// gemv_stream.cu): the whole ring is in flight.
pub const GEMV_STREAM_STAGES: u32 = 4;
/// The ring's most slots (of half-size chunks), each with its mbarrier (`MAX_STAGES`).
const GEMV_STREAM_MAX_SLOTS: u32 = 2 * GEMV_STREAM_STAGES;

/// [`GemvStream`]'s blocks: one an SM of the Hopper class (its shared memory allows one).
pub const GEMV_STREAM_BLOCKS: u32 = hopper::SM_COUNT;
/// The stream kernel's own bound on `k` (`MAX_K` in gemv_stream.cu: its byte counts are 32-bit);
/// the shared-memory bound below is lower.
const GEMV_STREAM_MAX_K: u32 = 1 << 16;
/// Shared memory a Hopper block may opt in to (227 KiB).
const HOPPER_MAX_BLOCK_SMEM: u32 = 227 * 1024;

/// [`GemvStream`]'s dynamic shared memory: A (`k` bf16, rounded up to 128 bytes), then 8 warps'
/// rings of [`GEMV_STREAM_STAGES`] chunks, then their mbarriers (8 bytes each, one a slot of the
/// half-size chunks' ring), then 32 floats for the normalising entries' reduction.
pub fn gemv_stream_smem_bytes(k: u32) -> u32 {
    // Past the kernel's bound the launch is refused; this keeps the sum in range.
    let k = k.min(GEMV_STREAM_MAX_K);
    let warps = GEMV_WARPS as u32;
    (2 * k).next_multiple_of(128)
        + warps * (GEMV_STREAM_STAGES * GEMV_STREAM_CHUNK + 8 * GEMV_STREAM_MAX_SLOTS)
        + 32 * 4
}

/// Whether an `m x n x k` product can take [`GemvStream`] (or its normalising form): one row,
/// whole half-size chunks a column (`k` a multiple of 1024), and A plus the rings within a block's
/// shared memory (`k` up to 50176: Qwen3-8B's and Qwen3-0.6B's products).
pub fn gemv_stream_fits(m: u32, n: u32, k: u32) -> bool {
    m == 1
        && n > 0
        && (1..=GEMV_STREAM_MAX_K).contains(&k)
        && (2 * k).is_multiple_of(GEMV_STREAM_CHUNK / 2)
        && gemv_stream_smem_bytes(k) <= HOPPER_MAX_BLOCK_SMEM
}

impl From<Gemv> for GemvStream {
    fn from(g: Gemv) -> Self {
        let Gemv {
            c,
            a,
            w,
            bias,
            m,
            n,
            k,
        } = g;
        GemvStream {
            c,
            a,
            w,
            bias,
            m,
            n,
            k,
            prewait: GEMV_STREAM_STAGES,
            evict_first: 0,
        }
    }
}

impl From<Gemv> for GemvStaged {
    fn from(g: Gemv) -> Self {
        let Gemv {
            c,
            a,
            w,
            bias,
            m,
            n,
            k,
        } = g;
        GemvStaged {
            c,
            a,
            w,
            bias,
            m,
            n,
            k,
        }
    }
}

impl From<GemvSwiglu> for GemvSwigluStaged {
    fn from(g: GemvSwiglu) -> Self {
        let GemvSwiglu {
            out,
            a,
            w,
            m,
            inter,
            k,
        } = g;
        GemvSwigluStaged {
            out,
            a,
            w,
            m,
            inter,
            k,
        }
    }
}

/// Most rows [`Gemv`] takes; larger `m` goes to [`Gemm`].
pub const GEMV_MAX_ROWS: u32 = 8;

/// Rows up to which the GEMV computes one output column per warp with FMAs; above, a warp
/// computes [`GEMV_TILE`] columns with tensor-core MMAs. Mirrors `FMA_MAX_M` in gemv.cu.
pub const GEMV_FMA_MAX_ROWS: u32 = 4;
/// Output columns per warp of the GEMV's MMA form (`TILE` in gemv.cu).
const GEMV_TILE: u64 = 8;
/// Warps per GEMV block (256 threads).
const GEMV_WARPS: u64 = 8;
/// Weight bytes one GEMV warp has in flight: 8 loads of 16 bytes per lane (`BATCH` in gemv.cu).
const GEMV_BATCH_BYTES: u64 = 4096;
/// GEMV warps resident at once on the Hopper class: its SMs x its GEMV blocks per SM of 8 warps
/// (`HARDWARE.toml`; the kernel is built with `__launch_bounds__(256, 3)`: 80 registers per thread).
const GEMV_RESIDENT_WARPS: u64 = GEMV_RESIDENT_BLOCKS as u64 * GEMV_WARPS;

/// Weight bytes of one column above which the FMA form splits the column until each warp has one
/// batch. On the H200, Qwen3-8B's down projection at one row (24 KiB columns, n = 4096) took
/// 29.67 us with 8 columns per block (512 blocks, 1.3 waves), 27.61 us with 1 (8 slices of 3 KiB);
/// the 8 KiB columns of its qkv, o and gate_up products were fastest unsplit, and so were
/// Qwen3-0.6B's (docs/results/2026-12-01-speed-h200/ab-swiglu-gemv-split).
const GEMV_LONG_COLUMN_BYTES: u64 = 16 * 1024;

/// Output columns each 256-thread block of the GEMV covers (the grid is `ceil(n / columns)`).
///
/// A warp computes `per_warp` columns (1 for `m <= 4`, 8 for the MMA form) over one slice of K;
/// the `8 * per_warp / columns` warps of a column group split K evenly and add their partial
/// sums in shared memory. The rule: pick the split (1, 2, 4 or 8 slices) that puts the most
/// weight bytes in flight in the first wave of resident warps, counting each warp for at most
/// one batch (4 KiB) of loads, and the fewest slices among equals; then columns longer than
/// [`GEMV_LONG_COLUMN_BYTES`] (FMA form) are split until a warp's share is one batch. Large
/// products are not split otherwise
/// (every resident warp already has a full batch); a small N with a long K is (Qwen3-8B's k/v at
/// m = 1: 2 slices, 2048 warps each streaming 4 KiB, the whole 8 MiB in flight at once).
///
/// gemv.cu recovers `columns` as `next_pow2(ceil(n / gridDim.x))` clamped to
/// `[per_warp, 8 * per_warp]`: the same value whenever `n >= columns`, and otherwise a smaller
/// power of two that still covers `n`.
pub fn gemv_columns_per_block(m: u32, n: u32, k: u32) -> u32 {
    let per_warp = if m <= GEMV_FMA_MAX_ROWS { 1 } else { GEMV_TILE };
    let groups = u64::from(n).div_ceil(per_warp);
    let group_bytes = per_warp * u64::from(k) * 2;
    let in_flight = |slices: u64| {
        (groups * slices).min(GEMV_RESIDENT_WARPS) * (group_bytes / slices).min(GEMV_BATCH_BYTES)
    };
    let mut slices = [2u64, 4, 8].into_iter().fold(1, |best, s| {
        if in_flight(s) > in_flight(best) {
            s
        } else {
            best
        }
    });
    // A long column in the FMA form is split until each warp streams at most one batch: blocks of
    // eight long columns make few, long blocks, and the last wave's tail costs more than the
    // shorter streams do.
    if per_warp == 1 && group_bytes > GEMV_LONG_COLUMN_BYTES {
        slices = [2u64, 4, 8]
            .into_iter()
            .find(|&s| group_bytes / s <= GEMV_BATCH_BYTES)
            .unwrap_or(8)
            .max(slices);
    }
    (per_warp * GEMV_WARPS / slices) as u32
}

/// The GEMV's launch: `ceil(n / columns)` blocks of 256 threads.
fn gemv_launch(m: u32, n: u32, k: u32) -> LaunchConfig {
    let columns = gemv_columns_per_block(m, n, k);
    LaunchConfig::linear(blocks_for(n.into(), columns).max(1), 256)
}

/// Dynamic shared memory of a staged GEMV launch: 8 warps x 32 lanes x the 4 of each lane's 8
/// first 16-byte weight loads copied before the wait (`STAGED` in gemv.cu).
const GEMV_STAGE_BYTES: u32 = 8 * 32 * 4 * 16;

/// Weights (elements) up to which a product of at most [`GEMV_FMA_MAX_ROWS`] rows takes the
/// staged GEMV by default. On the H200 (one kernel entry holding both forms) the stage made
/// Qwen3-0.6B's batch-1 decode 6-8% faster (products of at most 6.3M weights); Qwen3-8B's step
/// (products of 16.8M to 100M weights) was 1-3% slower with the staged path compiled into its
/// GEMV whether it staged or not, and less slow staging every product
/// (docs/results/2026-12-01-speed-h200/gemv-prewait). With the separate entries, staging every
/// product (the tuning's `gemv_stage=all`) made Qwen3-8B's step at 160 keys 4.436 ->
/// 4.559 ms (docs/results/2026-12-01-speed-h200/grid-cap).
const GEMV_STAGE_MAX_WEIGHTS: u64 = 8 << 20;

/// Whether an `m x n x k` product streamed by the GEMV takes the staged entry
/// ([`GemvStaged`], [`GemvSwigluStaged`]; `n` counts the gate and up rows of the latter).
pub fn gemv_stages(m: u32, n: u32, k: u32) -> bool {
    (1..=GEMV_FMA_MAX_ROWS).contains(&m) && u64::from(n) * u64::from(k) <= GEMV_STAGE_MAX_WEIGHTS
}

/// The columns per block the GEMV kernel recovers from a grid of `grid` blocks over `n` columns
/// at `m` rows: next_pow2(ceil(n / grid)) clamped to 1..8, or 8..64 in the MMA form past
/// [`GEMV_FMA_MAX_ROWS`] rows (the SwiGLU form's floor of 2 only makes comparisons stricter).
pub fn gemv_grid_columns(m: u32, n: u32, grid: u32) -> u32 {
    let (lo, hi) = if m <= GEMV_FMA_MAX_ROWS {
        (1, 8)
    } else {
        (8, 64)
    };
    n.div_ceil(grid.max(1))
        .max(1)
        .next_power_of_two()
        .clamp(lo, hi)
}

/// The grid of a GEMV launch of `m` rows over `n` columns capped at `cap` blocks (0: no cap),
/// where the kernel then recovers the same columns per block as from `grid`
/// ([`gemv_grid_columns`]), so the blocks loop over the column groups with the same sums;
/// otherwise `grid` itself.
pub fn gemv_capped_grid(m: u32, n: u32, grid: u32, cap: u32) -> u32 {
    if cap > 0 && grid > cap && gemv_grid_columns(m, n, cap) == gemv_grid_columns(m, n, grid) {
        cap
    } else {
        grid
    }
}

/// [`gemv_capped_grid`] with the column groups spread evenly: the fewest blocks that still take
/// every group in the capped grid's rounds (ceil(grid / capped) groups per block), so that no
/// round runs on a fraction of the blocks (Qwen3-8B's o_proj, 512 groups on a cap of 396: 256
/// blocks of 2 groups, not 116 of 2 and 280 of 1). The same columns per block, so the same sums;
/// where fewer blocks would change them, the capped grid.
pub fn gemv_balanced_grid(m: u32, n: u32, grid: u32, cap: u32) -> u32 {
    let capped = gemv_capped_grid(m, n, grid, cap);
    if capped == grid {
        return grid;
    }
    let balanced = grid.div_ceil(grid.div_ceil(capped));
    if gemv_grid_columns(m, n, balanced) == gemv_grid_columns(m, n, grid) {
        balanced
    } else {
        capped
    }
}

/// How a GEMV launch's grid is capped ([`gemv_launch_grid`]; the model's
/// `gemv_grid_mode` tuning).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum GemvGridMode {
    /// [`gemv_capped_grid`]: capped where the columns per block stay the same (the default).
    #[default]
    Same,
    /// [`gemv_balanced_grid`]: the same, with the column groups spread evenly.
    Balanced,
    /// Capped even where the kernel then takes other columns per block: other splits of K, so
    /// other sums (for measuring products such as Qwen3-8B's down projection, one column per
    /// block over 4096 blocks).
    Resplit,
}

impl GemvGridMode {
    /// The mode `value` names (`same`, `balanced`, `resplit`), or `None`.
    pub fn parse(value: &str) -> Option<GemvGridMode> {
        match value {
            "same" => Some(GemvGridMode::Same),
            "balanced" => Some(GemvGridMode::Balanced),
            "resplit" => Some(GemvGridMode::Resplit),
            _ => None,
        }
    }
}

/// The grid a GEMV launch of `m` rows over `n` columns takes instead of its own `grid` (one block
/// per column group) under a cap of `cap` blocks (0: none) and `mode`.
pub fn gemv_launch_grid(m: u32, n: u32, grid: u32, cap: u32, mode: GemvGridMode) -> u32 {
    match mode {
        GemvGridMode::Same => gemv_capped_grid(m, n, grid, cap),
        GemvGridMode::Balanced => gemv_balanced_grid(m, n, grid, cap),
        GemvGridMode::Resplit if cap > 0 => grid.min(cap),
        GemvGridMode::Resplit => grid,
    }
}

/// GEMV blocks resident at once on the Hopper class (its SMs x its GEMV blocks per SM, from
/// `HARDWARE.toml`; on the H200 132 x 3, the launch bounds). The
/// model's default grid cap for plain and staged GEMV launches ([`gemv_capped_grid`]): on the
/// H200, capping them here made Qwen3-8B's batch-1 decode step at 160 keys 4.436 -> 4.313 ms
/// (generate 225.3 -> 230.7 tok/s) and Qwen3-0.6B's generate 1175.1 -> 1193.2 tok/s
/// (docs/results/2026-12-01-speed-h200/grid-cap).
pub const GEMV_RESIDENT_BLOCKS: u32 = hopper::SM_COUNT * hopper::GEMV_BLOCKS_PER_SM;

/// Shared memory a normalising GEMV block keeps its rows of A in: `m * k` bf16, rounded up to 16
/// bytes (the stage's slots follow).
fn gemv_norm_a_bytes(m: u32, k: u32) -> u32 {
    (m * k * 2).next_multiple_of(16)
}

/// Most shared memory a normalising GEMV block takes for A: with the stage, three blocks still fit
/// on an SM (`__launch_bounds__(256, 3)`).
const GEMV_NORM_MAX_A_BYTES: u32 = 48 * 1024;

/// Whether an `m x n x k` product can take the normalising entries ([`GemvNorm`],
/// [`GemvSwigluNorm`] with `n` gate and up rows): the FMA form's rows, A small enough for shared
/// memory, and at most the resident blocks, so that each block normalises the rows once (the
/// launch caps the grid where a block takes 8 columns; with fewer per block, a grid over the
/// resident blocks would normalise the rows once per column group).
pub fn gemv_norm_fits(m: u32, n: u32, k: u32) -> bool {
    let columns = gemv_columns_per_block(m, n, k);
    (1..=GEMV_FMA_MAX_ROWS).contains(&m)
        && gemv_norm_a_bytes(m, k) <= GEMV_NORM_MAX_A_BYTES
        && (columns == 8 || blocks_for(n.into(), columns) <= GEMV_RESIDENT_BLOCKS)
}

/// The normalising entries' launch for a product whose GEMV takes `columns` per block: the GEMV's
/// grid, but where a block takes the most columns (the kernel then recovers the same count and
/// loops) at most the resident blocks with the column groups spread evenly over them
/// ([`gemv_balanced_grid`]), so that each block normalises the rows once for several column
/// groups and no block's round runs alone: Qwen3-0.6B's QKV product, 512 groups, takes 256
/// blocks of 2, not 116 of 2 and 280 of 1 (on the H200 at batch 1 with 160 keys: 6.65 -> 5.43 us
/// a layer; docs/results/2026-12-02-speed-h200/norm-grid). A's shared memory, and the stage's
/// with `stage`.
///
/// One row over at most [`GEMV_PAIR_MAX_K`] inputs at 8 columns a block takes the kernel's pair
/// form (two columns a warp, 16 a block round: `gemv_norm_pairs` in gemv.cu): one block per 16
/// columns, spread the same way, and a stage of [`GEMV_PAIR_STAGE_BYTES`] (each warp's two rows,
/// whole). Qwen3-0.6B's qkv and gate|up products: 256 and 384 blocks of one round each.
fn gemv_norm_launch(m: u32, n: u32, k: u32, columns: u32, stage: u32) -> LaunchConfig {
    let pairs = gemv_norm_pairs(m, k, columns);
    let mut blocks = blocks_for(n.into(), if pairs { 2 * columns } else { columns }).max(1);
    if columns == 8 {
        blocks = gemv_balanced_grid(m, n, blocks, GEMV_RESIDENT_BLOCKS);
    }
    let stage_bytes = match (stage != 0, pairs) {
        (false, _) => 0,
        (true, false) => GEMV_STAGE_BYTES,
        (true, true) => GEMV_PAIR_STAGE_BYTES,
    };
    LaunchConfig {
        shared_mem_bytes: gemv_norm_a_bytes(m, k) + stage_bytes,
        ..LaunchConfig::linear(blocks, 256)
    }
}

/// Inputs (K) up to which a one-row GEMV at 8 columns a block takes two columns a warp: a row is
/// then at most half a warp's load batch (`PAIR_MAX_K` in gemv.cu).
pub const GEMV_PAIR_MAX_K: u32 = 1024;

/// The normalising pair form's stage: 8 warps x 2 rows x [`GEMV_PAIR_MAX_K`] bf16
/// (`PAIR_STAGE_BYTES` in gemv.cu).
const GEMV_PAIR_STAGE_BYTES: u32 = 8 * 2 * GEMV_PAIR_MAX_K * 2;

/// Whether a normalising launch of `m` rows over `k` inputs at `columns` per block takes the
/// kernel's pair form (which it also requires of the weight's alignment; a misaligned weight
/// takes the one-column form on the same grid, with the same sums).
fn gemv_norm_pairs(m: u32, k: u32, columns: u32) -> bool {
    m == 1 && columns == 8 && k.is_multiple_of(8) && k <= GEMV_PAIR_MAX_K
}

/// A staged launch: `launch` with the stage's shared memory.
fn staged(launch: LaunchConfig) -> LaunchConfig {
    LaunchConfig {
        shared_mem_bytes: GEMV_STAGE_BYTES,
        ..launch
    }
}

/// The staged and normalising entries' row limit, for their references.
fn check_staged_rows(name: metrale_core::KernelName, m: u32) -> Result<(), HostError> {
    if m > GEMV_FMA_MAX_ROWS {
        return Err(HostError::BadArgs {
            kernel: name,
            message: format!("m = {m} exceeds {GEMV_FMA_MAX_ROWS} (the GEMV's FMA form)"),
        });
    }
    Ok(())
}

/// The normalising entries' A: `residual_out = residual + input` stored, and the bf16-rounded
/// rows of `rmsnorm(residual_out) * norm_weight` returned (what [`AddRmsNorm`](super::AddRmsNorm)
/// would write).
#[allow(clippy::too_many_arguments)]
pub(super) fn normalised_input(
    name: metrale_core::KernelName,
    mem: &mut dyn HostMemory,
    residual: DevicePtr,
    residual_out: DevicePtr,
    input: DevicePtr,
    norm_weight: DevicePtr,
    m: u32,
    k: u32,
    eps: f32,
) -> Result<Vec<f32>, HostError> {
    check_staged_rows(name, m)?;
    let (m, k) = (m as usize, k as usize);
    let mut sum = host::load::<f32>(mem, residual, m * k)?;
    if !input.is_null() {
        let x = host::load_bf16(mem, input, m * k)?;
        sum.iter_mut().zip(&x).for_each(|(s, x)| *s += x);
    }
    let weight = host::load_bf16(mem, norm_weight, k)?;
    host::store(mem, residual_out, &sum)?;
    Ok(super::rmsnorm::normalize(&sum, &weight, k, eps)
        .into_iter()
        .map(host::round_bf16)
        .collect())
}

/// The GEMV reference: the GEMM's, after checking `m`.
#[allow(clippy::too_many_arguments)]
fn gemv_reference(
    name: metrale_core::KernelName,
    mem: &dyn HostMemory,
    a: DevicePtr,
    w: DevicePtr,
    bias: DevicePtr,
    m: u32,
    n: u32,
    k: u32,
) -> Result<Vec<f32>, HostError> {
    if m > GEMV_MAX_ROWS {
        return Err(HostError::BadArgs {
            kernel: name,
            message: format!("m = {m} exceeds {GEMV_MAX_ROWS}"),
        });
    }
    reference(mem, a, w, bias, m as usize, n as usize, k as usize)
}

impl Kernel for Gemv {
    fn launch_config(&self) -> LaunchConfig {
        gemv_launch(self.m, self.n, self.k)
    }
    fn reference(&self, mem: &mut dyn HostMemory) -> Result<(), HostError> {
        let c = gemv_reference(
            Self::NAME,
            mem,
            self.a,
            self.w,
            self.bias,
            self.m,
            self.n,
            self.k,
        )?;
        host::store_bf16(mem, self.c, &c)
    }
}

impl Kernel for GemvSwiglu {
    /// The GEMV's launch over the `2 * inter` interleaved columns, at least 2 per block so that
    /// a gate column and its up column share a block.
    fn launch_config(&self) -> LaunchConfig {
        let n = 2 * self.inter;
        LaunchConfig::linear(
            blocks_for(n.into(), swiglu_columns(self.m, n, self.k)).max(1),
            256,
        )
    }
    fn reference(&self, mem: &mut dyn HostMemory) -> Result<(), HostError> {
        let gate_up = gemv_reference(
            Self::NAME,
            mem,
            self.a,
            self.w,
            DevicePtr::NULL,
            self.m,
            2 * self.inter,
            self.k,
        )?;
        host::store_bf16(mem, self.out, &swiglu_rows(&gate_up, self.inter as usize))
    }
}

/// Columns per block of the SwiGLU GEMV over `n` interleaved gate/up columns: the GEMV's, at
/// least 2 so that a gate column and its up column share a block.
fn swiglu_columns(m: u32, n: u32, k: u32) -> u32 {
    gemv_columns_per_block(m, n, k).max(2)
}

/// `silu(g) * u` of the bf16-rounded gate and up halves of each `[2 * inter]` row.
pub(super) fn swiglu_rows(gate_up: &[f32], inter: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(gate_up.len() / 2);
    for row in gate_up.chunks_exact((2 * inter).max(1)) {
        let (gate, up) = row.split_at(inter);
        out.extend(gate.iter().zip(up).map(|(&g, &u)| {
            let (g, u) = (host::round_bf16(g), host::round_bf16(u));
            super::activation::silu(g) * u
        }));
    }
    out
}

impl Kernel for GemvNorm {
    fn launch_config(&self) -> LaunchConfig {
        let columns = gemv_columns_per_block(self.m, self.n, self.k);
        gemv_norm_launch(self.m, self.n, self.k, columns, self.stage)
    }
    fn reference(&self, mem: &mut dyn HostMemory) -> Result<(), HostError> {
        let a = normalised_input(
            Self::NAME,
            mem,
            self.residual,
            self.residual_out,
            self.input,
            self.norm_weight,
            self.m,
            self.k,
            self.eps,
        )?;
        let (m, n, k) = (self.m as usize, self.n as usize, self.k as usize);
        let c = product_of(mem, &a, self.w, self.bias, m, n, k)?;
        host::store_bf16(mem, self.c, &c)
    }
}

impl Kernel for GemvSwigluNorm {
    fn launch_config(&self) -> LaunchConfig {
        let n = 2 * self.inter;
        let columns = swiglu_columns(self.m, n, self.k);
        gemv_norm_launch(self.m, n, self.k, columns, self.stage)
    }
    fn reference(&self, mem: &mut dyn HostMemory) -> Result<(), HostError> {
        let a = normalised_input(
            Self::NAME,
            mem,
            self.residual,
            self.residual_out,
            self.input,
            self.norm_weight,
            self.m,
            self.k,
            self.eps,
        )?;
        let (m, n, k) = (self.m as usize, 2 * self.inter as usize, self.k as usize);
        let gate_up = product_of(mem, &a, self.w, DevicePtr::NULL, m, n, k)?;
        host::store_bf16(mem, self.out, &swiglu_rows(&gate_up, self.inter as usize))
    }
}

impl Kernel for GemvF32Out {
    fn launch_config(&self) -> LaunchConfig {
        gemv_launch(self.m, self.n, self.k)
    }
    fn reference(&self, mem: &mut dyn HostMemory) -> Result<(), HostError> {
        let c = gemv_reference(
            Self::NAME,
            mem,
            self.a,
            self.w,
            self.bias,
            self.m,
            self.n,
            self.k,
        )?;
        host::store(mem, self.c, &c)
    }
}

impl Kernel for GemvStaged {
    fn launch_config(&self) -> LaunchConfig {
        staged(gemv_launch(self.m, self.n, self.k))
    }
    fn reference(&self, mem: &mut dyn HostMemory) -> Result<(), HostError> {
        check_staged_rows(Self::NAME, self.m)?;
        let GemvStaged {
            c,
            a,
            w,
            bias,
            m,
            n,
            k,
        } = *self;
        Gemv {
            c,
            a,
            w,
            bias,
            m,
            n,
            k,
        }
        .reference(mem)
    }
}

impl Kernel for GemvStream {
    fn launch_config(&self) -> LaunchConfig {
        stream_launch(self.k)
    }
    fn reference(&self, mem: &mut dyn HostMemory) -> Result<(), HostError> {
        check_stream(Self::NAME, self.m, self.n, self.k)?;
        let c = gemv_reference(
            Self::NAME,
            mem,
            self.a,
            self.w,
            self.bias,
            self.m,
            self.n,
            self.k,
        )?;
        host::store_bf16(mem, self.c, &c)
    }
}

impl From<GemvF32Out> for GemvStreamF32Out {
    fn from(g: GemvF32Out) -> Self {
        let GemvF32Out {
            c,
            a,
            w,
            bias,
            m,
            n,
            k,
        } = g;
        GemvStreamF32Out {
            c,
            a,
            w,
            bias,
            m,
            n,
            k,
            prewait: GEMV_STREAM_STAGES,
            evict_first: 0,
        }
    }
}

impl Kernel for GemvStreamF32Out {
    fn launch_config(&self) -> LaunchConfig {
        stream_launch(self.k)
    }
    fn reference(&self, mem: &mut dyn HostMemory) -> Result<(), HostError> {
        check_stream(Self::NAME, self.m, self.n, self.k)?;
        let c = gemv_reference(
            Self::NAME,
            mem,
            self.a,
            self.w,
            self.bias,
            self.m,
            self.n,
            self.k,
        )?;
        host::store(mem, self.c, &c)
    }
}

impl From<GemvSwiglu> for GemvSwigluStream {
    fn from(g: GemvSwiglu) -> Self {
        let GemvSwiglu {
            out,
            a,
            w,
            m,
            inter,
            k,
        } = g;
        GemvSwigluStream {
            out,
            a,
            w,
            m,
            inter,
            k,
            prewait: GEMV_STREAM_STAGES,
            evict_first: 0,
        }
    }
}

/// The stream entries' launch: one block an SM, 256 threads, [`gemv_stream_smem_bytes`].
fn stream_launch(k: u32) -> LaunchConfig {
    LaunchConfig {
        shared_mem_bytes: gemv_stream_smem_bytes(k),
        ..LaunchConfig::linear(GEMV_STREAM_BLOCKS, 256)
    }
}

/// The stream's refusal of the launches its kernel would skip (and of `n = 0`, which it would run
/// as nothing); its kernel also skips a or w not 16-byte aligned, which device allocations are.
fn check_stream(name: metrale_core::KernelName, m: u32, n: u32, k: u32) -> Result<(), HostError> {
    if gemv_stream_fits(m, n, k) {
        return Ok(());
    }
    Err(HostError::BadArgs {
        kernel: name,
        message: format!(
            "m = {m}, n = {n}, k = {k}: the stream takes one row, n > 0 and k a multiple of {} \
             with A and its rings in {HOPPER_MAX_BLOCK_SMEM} bytes of shared memory",
            GEMV_STREAM_CHUNK / 4
        ),
    })
}

impl Kernel for GemvSwigluStream {
    fn launch_config(&self) -> LaunchConfig {
        stream_launch(self.k)
    }
    fn reference(&self, mem: &mut dyn HostMemory) -> Result<(), HostError> {
        check_stream(Self::NAME, self.m, self.inter, self.k)?;
        let GemvSwigluStream {
            out,
            a,
            w,
            m,
            inter,
            k,
            ..
        } = *self;
        GemvSwiglu {
            out,
            a,
            w,
            m,
            inter,
            k,
        }
        .reference(mem)
    }
}

impl From<GemvNorm> for GemvStreamNorm {
    fn from(g: GemvNorm) -> Self {
        let GemvNorm {
            c,
            residual,
            residual_out,
            input,
            norm_weight,
            w,
            bias,
            m,
            n,
            k,
            eps,
            ..
        } = g;
        GemvStreamNorm {
            c,
            residual,
            residual_out,
            input,
            norm_weight,
            w,
            bias,
            m,
            n,
            k,
            eps,
            prewait: GEMV_STREAM_STAGES,
            evict_first: 0,
        }
    }
}

impl Kernel for GemvStreamNorm {
    fn launch_config(&self) -> LaunchConfig {
        stream_launch(self.k)
    }
    fn reference(&self, mem: &mut dyn HostMemory) -> Result<(), HostError> {
        check_stream(Self::NAME, self.m, self.n, self.k)?;
        let GemvStreamNorm {
            c,
            residual,
            residual_out,
            input,
            norm_weight,
            w,
            bias,
            m,
            n,
            k,
            eps,
            ..
        } = *self;
        GemvNorm {
            c,
            residual,
            residual_out,
            input,
            norm_weight,
            w,
            bias,
            m,
            n,
            k,
            eps,
            stage: 0,
        }
        .reference(mem)
    }
}

impl From<GemvSwigluNorm> for GemvSwigluStreamNorm {
    fn from(g: GemvSwigluNorm) -> Self {
        let GemvSwigluNorm {
            out,
            residual,
            residual_out,
            input,
            norm_weight,
            w,
            m,
            inter,
            k,
            eps,
            ..
        } = g;
        GemvSwigluStreamNorm {
            out,
            residual,
            residual_out,
            input,
            norm_weight,
            w,
            m,
            inter,
            k,
            eps,
            prewait: GEMV_STREAM_STAGES,
            evict_first: 0,
        }
    }
}

impl Kernel for GemvSwigluStreamNorm {
    fn launch_config(&self) -> LaunchConfig {
        stream_launch(self.k)
    }
    fn reference(&self, mem: &mut dyn HostMemory) -> Result<(), HostError> {
        check_stream(Self::NAME, self.m, self.inter, self.k)?;
        let GemvSwigluStreamNorm {
            out,
            residual,
            residual_out,
            input,
            norm_weight,
            w,
            m,
            inter,
            k,
            eps,
            ..
        } = *self;
        GemvSwigluNorm {
            out,
            residual,
            residual_out,
            input,
            norm_weight,
            w,
            m,
            inter,
            k,
            eps,
            stage: 0,
        }
        .reference(mem)
    }
}

impl Kernel for GemvSwigluStaged {
    fn launch_config(&self) -> LaunchConfig {
        let GemvSwigluStaged {
            out,
            a,
            w,
            m,
            inter,
            k,
        } = *self;
        staged(
            GemvSwiglu {
                out,
                a,
                w,
                m,
                inter,
                k,
            }
            .launch_config(),
        )
    }
    fn reference(&self, mem: &mut dyn HostMemory) -> Result<(), HostError> {
        check_staged_rows(Self::NAME, self.m)?;
        let GemvSwigluStaged {
            out,
            a,
            w,
            m,
            inter,
            k,
        } = *self;
        GemvSwiglu {
            out,
            a,
            w,
            m,
            inter,
            k,
        }
        .reference(mem)
    }
}

fn launch(m: u32, n: u32) -> LaunchConfig {
    LaunchConfig {
        grid: [blocks_for(n.into(), 64), blocks_for(m.into(), 64), 1],
        block: [128, 1, 1],
        shared_mem_bytes: 0,
    }
}

/// `dot(a, w)` with eight independent accumulators, so the loop vectorises.
pub(super) fn dot(a: &[f32], w: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let chunks = a.len() / 8;
    for c in 0..chunks {
        for i in 0..8 {
            acc[i] += a[c * 8 + i] * w[c * 8 + i];
        }
    }
    let mut sum: f32 = acc.iter().sum();
    for i in chunks * 8..a.len() {
        sum += a[i] * w[i];
    }
    sum
}

/// The reference: f32 accumulation of bf16 inputs, bias added before the single rounding, rows of
/// W split across threads.
fn reference(
    mem: &dyn HostMemory,
    a: DevicePtr,
    w: DevicePtr,
    bias: DevicePtr,
    m: usize,
    n: usize,
    k: usize,
) -> Result<Vec<f32>, HostError> {
    let a = host::load_bf16(mem, a, m * k)?;
    product_of(mem, &a, w, bias, m, n, k)
}

/// [`reference`] of an A already in host memory (`m * k` values).
fn product_of(
    mem: &dyn HostMemory,
    a: &[f32],
    w: DevicePtr,
    bias: DevicePtr,
    m: usize,
    n: usize,
    k: usize,
) -> Result<Vec<f32>, HostError> {
    let w = host::view::<bf16>(mem, w, n * k)?;
    let bias = if bias == DevicePtr::NULL {
        None
    } else {
        Some(host::load_bf16(mem, bias, n)?)
    };
    let threads = std::thread::available_parallelism()
        .map_or(1, |t| t.get())
        .min(n.div_ceil(64))
        .max(1);
    let per = n.div_ceil(threads);
    let mut out = vec![0f32; m * n];
    let columns: Vec<Vec<f32>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let (w, bias) = (&w, &bias);
                s.spawn(move || {
                    let (lo, hi) = (t * per, ((t + 1) * per).min(n));
                    let mut part = vec![0f32; m * hi.saturating_sub(lo)];
                    let mut row = vec![0f32; k];
                    for j in lo..hi {
                        for (dst, src) in row.iter_mut().zip(&w[j * k..(j + 1) * k]) {
                            *dst = widen(*src);
                        }
                        let b = bias.as_ref().map_or(0.0, |b| b[j]);
                        for i in 0..m {
                            part[i * (hi - lo) + (j - lo)] = dot(&a[i * k..(i + 1) * k], &row) + b;
                        }
                    }
                    part
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("gemm worker panicked"))
            .collect()
    });
    for (t, part) in columns.iter().enumerate() {
        let (lo, hi) = (t * per, ((t + 1) * per).min(n));
        if hi <= lo {
            continue;
        }
        for i in 0..m {
            out[i * n + lo..i * n + hi].copy_from_slice(&part[i * (hi - lo)..(i + 1) * (hi - lo)]);
        }
    }
    Ok(out)
}

impl Kernel for Gemm {
    fn launch_config(&self) -> LaunchConfig {
        launch(self.m, self.n)
    }
    fn reference(&self, mem: &mut dyn HostMemory) -> Result<(), HostError> {
        let c = reference(
            mem,
            self.a,
            self.w,
            self.bias,
            self.m as usize,
            self.n as usize,
            self.k as usize,
        )?;
        host::store_bf16(mem, self.c, &c)
    }
}

impl Kernel for GemmF32Out {
    fn launch_config(&self) -> LaunchConfig {
        launch(self.m, self.n)
    }
    fn reference(&self, mem: &mut dyn HostMemory) -> Result<(), HostError> {
        let c = reference(
            mem,
            self.a,
            self.w,
            self.bias,
            self.m as usize,
            self.n as usize,
            self.k as usize,
        )?;
        host::store(mem, self.c, &c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::testing::*;

    #[test]
    fn the_stream_takes_one_row_of_whole_chunks_within_shared_memory() {
        // Qwen3-8B's qkv, o, gate|up (its columns) and down; Qwen3-0.6B's (rows of 2 KiB and
        // 6 KiB take the half-size chunks).
        for (n, k) in [
            (6144, 4096),
            (4096, 4096),
            (12288, 4096),
            (4096, 12288),
            (4096, 1024),
            (1024, 2048),
            (3072, 1024),
            (1024, 3072),
        ] {
            assert!(gemv_stream_fits(1, n, k), "{n} x {k}");
        }
        // The largest k whose A and rings fit in 227 KiB, and the next whole chunk.
        assert!(gemv_stream_fits(1, 1, 50176));
        assert_eq!(
            gemv_stream_smem_bytes(50176),
            100352 + 8 * (4 * 4096 + 8 * 8) + 128
        );
        assert!(gemv_stream_smem_bytes(50176) <= 227 * 1024);
        assert!(!gemv_stream_fits(1, 1, 51200));
        // Two rows, no columns, a row not of whole 2 KiB pieces, k = 0, and a k whose byte count
        // would overflow.
        assert!(!gemv_stream_fits(2, 4096, 4096));
        assert!(!gemv_stream_fits(1, 0, 4096));
        assert!(!gemv_stream_fits(1, 4096, 1536));
        assert!(!gemv_stream_fits(1, 4096, 576));
        assert!(!gemv_stream_fits(1, 4096, 0));
        assert!(!gemv_stream_fits(1, 4096, 1 << 31));
        assert!(!gemv_stream_fits(1, 4096, u32::MAX));
    }

    #[test]
    fn gemv_splits_k_where_it_adds_bytes_in_flight_or_columns_are_long() {
        // (m, n, k) -> columns per block.
        for &(m, n, k, columns) in &[
            (1u32, 1024u32, 4096u32, 4u32), // Qwen3-8B k/v: 2 slices, 2048 warps x 4 KiB
            (1, 4096, 4096, 8),             // q, o: no split
            (1, 6144, 4096, 8),             // fused QKV
            (1, 24576, 4096, 8),            // gate_up
            (1, 4096, 12288, 1),            // down: 24 KiB columns, 8 slices of 3 KiB
            (4, 4096, 12288, 1),            // the same at 4 rows (FMA form)
            (1, 4096, 14336, 1),            // Llama-3.1-8B down: 28 KiB, 8 slices
            (1, 1024, 3072, 4),             // Qwen3-0.6B down: 2 slices of 3 KiB
            (1, 2048, 1024, 8),             // Qwen3-0.6B q: rows of 2 KiB, no split
            (4, 1024, 4096, 4),
            (8, 1024, 4096, 8),   // MMA form: 128 tiles x 8 slices
            (8, 4096, 4096, 8),   // 512 tiles x 8 slices = 4096 warps
            (8, 24576, 4096, 32), // 3072 tiles x 2 slices
            (5, 77, 576, 16),
        ] {
            assert_eq!(
                gemv_columns_per_block(m, n, k),
                columns,
                "m={m} n={n} k={k}"
            );
        }
    }

    /// gemv.cu's recovery of the block's column count from the grid, written out in Rust.
    fn recovered_columns(m: u32, n: u32, grid: u32) -> u32 {
        let per_warp = if m <= GEMV_FMA_MAX_ROWS {
            1
        } else {
            GEMV_TILE as u32
        };
        n.div_ceil(grid)
            .next_power_of_two()
            .clamp(per_warp, per_warp * GEMV_WARPS as u32)
    }

    #[test]
    fn gemv_kernel_recovers_the_column_count_from_the_grid() {
        for m in [1u32, 4, 5, 8] {
            for n in (1u32..3000).chain([4096, 6144, 24576, 151936]) {
                for k in [8u32, 130, 576, 1024, 4096, 12288] {
                    let columns = gemv_columns_per_block(m, n, k);
                    let grid = gemv_launch(m, n, k).grid[0];
                    let got = recovered_columns(m, n, grid);
                    assert!(
                        got.is_power_of_two() && got * grid >= n,
                        "m={m} n={n} k={k}: {got} x {grid}"
                    );
                    if n >= columns {
                        assert_eq!(got, columns, "m={m} n={n} k={k}");
                    }
                }
            }
        }
    }

    #[test]
    fn the_staged_entries_take_the_small_fma_form_products() {
        // Qwen3-0.6B's batch-1 products stage; Qwen3-8B's, the LM heads and the MMA form do not.
        for (n, k) in [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)] {
            assert!(gemv_stages(1, n, k) && gemv_stages(4, n, k), "n={n} k={k}");
            assert!(
                !gemv_stages(0, n, k) && !gemv_stages(5, n, k),
                "n={n} k={k}"
            );
        }
        for (n, k) in [
            (6144, 4096),
            (4096, 4096),
            (24576, 4096),
            (4096, 12288),
            (151936, 1024),
        ] {
            assert!(!gemv_stages(1, n, k), "n={n} k={k}");
        }
        let plain = Gemv {
            c: DevicePtr::NULL,
            a: DevicePtr::NULL,
            w: DevicePtr::NULL,
            bias: DevicePtr::NULL,
            m: 1,
            n: 4096,
            k: 1024,
        };
        let (p, s) = (
            plain.launch_config(),
            GemvStaged::from(plain).launch_config(),
        );
        assert_eq!((p.grid, p.block, p.shared_mem_bytes), (s.grid, s.block, 0));
        assert_eq!(s.shared_mem_bytes, GEMV_STAGE_BYTES);
    }

    #[test]
    fn the_staged_references_refuse_the_mma_form() {
        let mut mem = FlatMemory::new();
        let a = mem.put(&bf16s(&[1.0; 5 * 8]));
        let w = mem.put(&bf16s(&[1.0; 2 * 8]));
        let c = mem.put(&[0u8; 5 * 2 * 2]);
        let staged = GemvStaged {
            c,
            a,
            w,
            bias: DevicePtr::NULL,
            m: 5,
            n: 2,
            k: 8,
        };
        assert!(matches!(
            staged.reference(&mut mem),
            Err(HostError::BadArgs { .. })
        ));
        let swiglu = GemvSwigluStaged {
            out: c,
            a,
            w,
            m: 5,
            inter: 1,
            k: 8,
        };
        assert!(matches!(
            swiglu.reference(&mut mem),
            Err(HostError::BadArgs { .. })
        ));
        // Four rows are the staged form's and match the GEMV's reference.
        let four = GemvStaged { m: 4, ..staged };
        four.reference(&mut mem).unwrap();
    }

    #[test]
    fn small_product_with_bias() {
        let mut mem = FlatMemory::new();
        // A = [[1, 2, 3], [4, 5, 6]], W = [[1, 0, 0], [0, 1, 0], [1, 1, 1], [0, 0, 2]]
        let a = mem.put(&bf16s(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]));
        let w = mem.put(&bf16s(&[
            1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0, 2.0,
        ]));
        let bias = mem.put(&bf16s(&[0.5, 0.0, 0.0, -1.0]));
        let c = mem.put(&[0f32; 8]);
        GemmF32Out {
            c,
            a,
            w,
            bias,
            m: 2,
            n: 4,
            k: 3,
        }
        .reference(&mut mem)
        .unwrap();
        assert_eq!(
            mem.get::<f32>(c, 8),
            vec![1.5, 2.0, 6.0, 5.0, 4.5, 5.0, 15.0, 11.0]
        );
        let cb = mem.put(&bf16s(&[0.0; 8]));
        Gemm {
            c: cb,
            a,
            w,
            bias: DevicePtr::NULL,
            m: 2,
            n: 4,
            k: 3,
        }
        .reference(&mut mem)
        .unwrap();
        assert_eq!(
            f32s(&mem.get(cb, 8)),
            vec![1.0, 2.0, 6.0, 6.0, 4.0, 5.0, 15.0, 12.0]
        );
    }

    /// The fused gate|up GEMV with SwiGLU equals the GEMV into a `[m, 2 inter]` buffer followed
    /// by SiluMul, bit for bit (3 rows, inter 5, k 16).
    #[test]
    fn gemv_swiglu_is_gemv_then_silu_mul() {
        let (m, inter, k) = (3usize, 5usize, 16usize);
        let mut mem = FlatMemory::new();
        let a: Vec<f32> = (0..m * k)
            .map(|i| ((i * 7 % 11) as f32 - 5.0) * 0.25)
            .collect();
        let w: Vec<f32> = (0..2 * inter * k)
            .map(|i| ((i * 5 % 13) as f32 - 6.0) * 0.125)
            .collect();
        let (a, w) = (mem.put(&bf16s(&a)), mem.put(&bf16s(&w)));
        let fused_out = mem.put(&bf16s(&vec![0.0; m * inter]));
        let gate_up = mem.put(&bf16s(&vec![0.0; m * 2 * inter]));
        let act = mem.put(&bf16s(&vec![0.0; m * inter]));
        GemvSwiglu {
            out: fused_out,
            a,
            w,
            m: m as u32,
            inter: inter as u32,
            k: k as u32,
        }
        .reference(&mut mem)
        .unwrap();
        Gemv {
            c: gate_up,
            a,
            w,
            bias: DevicePtr::NULL,
            m: m as u32,
            n: 2 * inter as u32,
            k: k as u32,
        }
        .reference(&mut mem)
        .unwrap();
        crate::ops::SiluMul {
            out: act,
            gate_up,
            tokens: m as u32,
            inter: inter as u32,
        }
        .reference(&mut mem)
        .unwrap();
        assert_eq!(
            mem.get::<u16>(fused_out, m * inter),
            mem.get::<u16>(act, m * inter)
        );
    }

    /// The normalising entries against AddRmsNorm then the GEMV (or the SwiGLU GEMV) on the same
    /// inputs: the same product bits, and the sum stored to `residual_out` with `residual` left
    /// as it was; with a null input, `residual_out` is a copy.
    #[test]
    fn gemv_norm_is_add_rmsnorm_then_gemv() {
        let (m, n, k) = (3usize, 10usize, 24usize);
        let values = |n: usize, mul: usize, modulo: usize, scale: f32| -> Vec<f32> {
            (0..n)
                .map(|i| ((i * mul % modulo) as f32 - (modulo / 2) as f32) * scale)
                .collect()
        };
        for with_input in [true, false] {
            let mut mem = FlatMemory::new();
            let residual0 = values(m * k, 7, 17, 0.3);
            let residual = mem.put(&residual0);
            let residual_out = mem.put(&vec![f32::NAN; m * k]);
            let input = if with_input {
                mem.put(&bf16s(&values(m * k, 5, 11, 0.25)))
            } else {
                DevicePtr::NULL
            };
            let norm_weight = mem.put(&bf16s(&values(k, 3, 7, 0.5)));
            let w = mem.put(&bf16s(&values(2 * n * k, 5, 13, 0.125)));
            let bias = mem.put(&bf16s(&values(n, 1, 5, 1.0)));
            let fused = mem.put(&bf16s(&vec![0.0; m * n]));
            let fused_swiglu = mem.put(&bf16s(&vec![0.0; m * n]));
            let (inplace, x) = (mem.put(&residual0), mem.put(&bf16s(&vec![0.0; m * k])));
            let (plain, plain_swiglu) = (
                mem.put(&bf16s(&vec![0.0; m * n])),
                mem.put(&bf16s(&vec![0.0; m * n])),
            );
            let (m32, n32, k32) = (m as u32, n as u32, k as u32);
            GemvNorm {
                c: fused,
                residual,
                residual_out,
                input,
                norm_weight,
                w,
                bias,
                m: m32,
                n: n32,
                k: k32,
                eps: 1e-5,
                stage: 0,
            }
            .reference(&mut mem)
            .unwrap();
            GemvSwigluNorm {
                out: fused_swiglu,
                residual,
                residual_out,
                input,
                norm_weight,
                w,
                m: m32,
                inter: n32,
                k: k32,
                eps: 1e-5,
                stage: 1,
            }
            .reference(&mut mem)
            .unwrap();
            crate::ops::AddRmsNorm {
                out: x,
                residual: inplace,
                input,
                weight: norm_weight,
                rows: m32,
                cols: k32,
                eps: 1e-5,
                weight_offset: 0.0,
            }
            .reference(&mut mem)
            .unwrap();
            Gemv {
                c: plain,
                a: x,
                w,
                bias,
                m: m32,
                n: n32,
                k: k32,
            }
            .reference(&mut mem)
            .unwrap();
            GemvSwiglu {
                out: plain_swiglu,
                a: x,
                w,
                m: m32,
                inter: n32,
                k: k32,
            }
            .reference(&mut mem)
            .unwrap();
            assert_eq!(mem.get::<u16>(fused, m * n), mem.get::<u16>(plain, m * n));
            assert_eq!(
                mem.get::<u16>(fused_swiglu, m * n),
                mem.get::<u16>(plain_swiglu, m * n)
            );
            assert_eq!(mem.get::<f32>(residual, m * k), residual0);
            assert_eq!(
                mem.get::<f32>(residual_out, m * k),
                mem.get::<f32>(inplace, m * k)
            );
        }
    }

    #[test]
    fn gemv_norm_launch_keeps_the_columns_and_sizes_shared_memory() {
        let launch = |m: u32, n: u32, k: u32, stage: u32| {
            GemvNorm {
                c: DevicePtr::NULL,
                residual: DevicePtr::NULL,
                residual_out: DevicePtr::NULL,
                input: DevicePtr::NULL,
                norm_weight: DevicePtr::NULL,
                w: DevicePtr::NULL,
                bias: DevicePtr::NULL,
                m,
                n,
                k,
                eps: 1e-6,
                stage,
            }
            .launch_config()
        };
        // Qwen3 products at 1 and 4 rows, a small N whose GEMV splits K, and a long column.
        for (m, n, k) in [
            (1, 6144, 4096),
            (1, 4096, 1024),
            (4, 6144, 4096),
            (1, 1024, 4096),
            (2, 40, 4096),
            (1, 4096, 12288),
        ] {
            let plain = Gemv {
                c: DevicePtr::NULL,
                a: DevicePtr::NULL,
                w: DevicePtr::NULL,
                bias: DevicePtr::NULL,
                m,
                n,
                k,
            }
            .launch_config();
            let norm = launch(m, n, k, 0);
            assert!(norm.grid[0] <= plain.grid[0], "m={m} n={n} k={k}");
            // One block per column group (per 16 columns in the pair form); past the resident
            // blocks, the groups spread evenly: each block takes the same number of rounds, and
            // the fewest rounds the resident blocks allow.
            let pairs = gemv_norm_pairs(m, k, gemv_columns_per_block(m, n, k));
            let groups = if pairs { n.div_ceil(16) } else { plain.grid[0] };
            if norm.grid[0] < groups {
                let rounds = groups.div_ceil(GEMV_RESIDENT_BLOCKS);
                assert_eq!(norm.grid[0], groups.div_ceil(rounds), "m={m} n={n} k={k}");
            }
            assert_eq!(
                recovered_columns(m, n, norm.grid[0]),
                gemv_columns_per_block(m, n, k),
                "m={m} n={n} k={k}"
            );
            assert_eq!(norm.block, plain.block);
            assert_eq!(norm.shared_mem_bytes, m * k * 2);
            let stage = if pairs {
                GEMV_PAIR_STAGE_BYTES
            } else {
                GEMV_STAGE_BYTES
            };
            assert_eq!(launch(m, n, k, 1).shared_mem_bytes, m * k * 2 + stage);
        }
        // Qwen3-0.6B's QKV product at one row: 256 blocks of one pair round (16 columns), with
        // both rows of every warp staged.
        assert_eq!(launch(1, 4096, 1024, 0).grid[0], 256);
        assert_eq!(launch(1, 4096, 1024, 1).shared_mem_bytes, 2048 + 32 * 1024);
        // Past the resident blocks, pair rounds spread evenly too: 1000 rounds on 334 blocks.
        assert_eq!(launch(1, 16000, 512, 0).grid[0], 334);
        // Rows past 1024 inputs keep one column a warp, and the 16 KiB stage.
        assert_eq!(
            launch(1, 4096, 1032, 1).shared_mem_bytes,
            2064 + GEMV_STAGE_BYTES
        );
        // The SwiGLU form at Qwen3-0.6B's gate|up: 6144 interleaved columns on 384 blocks.
        let swiglu = GemvSwigluNorm {
            out: DevicePtr::NULL,
            residual: DevicePtr::NULL,
            residual_out: DevicePtr::NULL,
            input: DevicePtr::NULL,
            norm_weight: DevicePtr::NULL,
            w: DevicePtr::NULL,
            m: 1,
            inter: 3072,
            k: 1024,
            eps: 1e-6,
            stage: 1,
        }
        .launch_config();
        assert_eq!(swiglu.grid[0], 384);
        assert_eq!(swiglu.shared_mem_bytes, 2048 + GEMV_PAIR_STAGE_BYTES);
        // A rounded up to 16 bytes; the entries take at most 4 rows and 48 KiB of A.
        assert_eq!(launch(3, 8, 130, 0).shared_mem_bytes, 784);
        // Qwen3-8B's and Qwen3-0.6B's qkv and gate|up products at 1 and 4 rows fit.
        for (n, k) in [(6144, 4096), (24576, 4096), (4096, 1024), (6144, 1024)] {
            assert!(
                gemv_norm_fits(1, n, k) && gemv_norm_fits(4, n, k),
                "n={n} k={k}"
            );
        }
        assert!(!gemv_norm_fits(5, 4096, 1024) && !gemv_norm_fits(0, 4096, 1024));
        // A over 48 KiB (4 rows of 8192) does not fit; one row of 8192 does.
        assert!(!gemv_norm_fits(4, 4096, 8192) && gemv_norm_fits(1, 4096, 8192));
        // A long column splits K (fewer than 8 columns per block): past the resident blocks the
        // rows would be normalised once per column group, so it does not fit.
        assert!(gemv_columns_per_block(1, 8192, 12288) < 8);
        assert!(!gemv_norm_fits(1, 8192, 12288));
    }

    #[test]
    fn a_capped_gemv_grid_keeps_the_columns_per_block() {
        for (m, n, k) in [
            (1u32, 151936u32, 1024u32),
            (1, 151936, 4096),
            (1, 4096, 12288),
            (1, 1024, 3072),
            (4, 24576, 4096),
            (8, 24576, 4096),
            (8, 151936, 4096),
            (1, 40, 4096),
        ] {
            let grid = Gemv {
                c: DevicePtr::NULL,
                a: DevicePtr::NULL,
                w: DevicePtr::NULL,
                bias: DevicePtr::NULL,
                m,
                n,
                k,
            }
            .launch_config()
            .grid[0];
            for cap in [0u32, 1, 132, 396, 1000, 100_000] {
                let capped = gemv_capped_grid(m, n, grid, cap);
                assert!(
                    capped <= grid && (capped == grid || capped == cap),
                    "{m} {n} {k}"
                );
                assert_eq!(
                    recovered_columns(m, n, capped),
                    recovered_columns(m, n, grid),
                    "m={m} n={n} k={k} cap={cap}"
                );
            }
        }
        // Qwen3-0.6B's LM head at one row: 18992 blocks of 8 columns become 396 of 8.
        assert_eq!(gemv_capped_grid(1, 151936, 18992, 396), 396);
        // A split column (1 per block) cannot be capped without changing the split.
        assert_eq!(gemv_capped_grid(1, 4096, 4096, 396), 4096);
        assert_eq!(gemv_capped_grid(1, 151936, 18992, 0), 18992);
    }

    #[test]
    fn a_balanced_gemv_grid_takes_the_capped_rounds_on_fewer_blocks() {
        let mut kept_capped = 0;
        for m in [1u32, 4, 5, 8] {
            for n in (1..=30_000u32)
                .step_by(37)
                .chain([4096, 6144, 24576, 151936])
            {
                // The launch's own grid (the most columns per block) and grids of fewer columns.
                let widest = n.div_ceil(if m <= GEMV_FMA_MAX_ROWS { 8 } else { 64 });
                for grid in [widest, n.div_ceil(4), n.div_ceil(2), n, 300.min(n)] {
                    for cap in [0u32, 132, 260, 396] {
                        let capped = gemv_capped_grid(m, n, grid, cap);
                        let balanced = gemv_balanced_grid(m, n, grid, cap);
                        let at = format!("m={m} n={n} grid={grid} cap={cap}");
                        assert!(balanced <= capped, "{at}");
                        // The same columns per block, and the capped grid's rounds.
                        assert_eq!(
                            recovered_columns(m, n, balanced),
                            recovered_columns(m, n, grid),
                            "{at}"
                        );
                        assert_eq!(grid.div_ceil(balanced), grid.div_ceil(capped), "{at}");
                        if capped < grid && balanced == capped && grid % capped != 0 {
                            kept_capped += 1;
                        }
                    }
                }
            }
        }
        // Where fewer blocks would take more columns each, the capped grid stays (n = 1000 on
        // 300 blocks of 4 columns, cap 260: 150 blocks would take 8).
        assert_eq!(gemv_capped_grid(1, 1000, 300, 260), 260);
        assert_eq!(gemv_balanced_grid(1, 1000, 300, 260), 260);
        assert!(kept_capped > 0);
        // Qwen3-8B at one row: o_proj's 512 groups on 256 blocks, qkv's 768 on 384, gate|up's
        // 3072 on 384, the LM head's 18992 on 396.
        assert_eq!(gemv_balanced_grid(1, 4096, 512, 396), 256);
        assert_eq!(gemv_balanced_grid(1, 6144, 768, 396), 384);
        assert_eq!(gemv_balanced_grid(1, 24576, 3072, 396), 384);
        assert_eq!(gemv_balanced_grid(1, 151936, 18992, 396), 396);
    }

    #[test]
    fn gemv_grid_modes() {
        let mode = |v| GemvGridMode::parse(v);
        assert_eq!(mode("same"), Some(GemvGridMode::Same));
        assert_eq!(mode("balanced"), Some(GemvGridMode::Balanced));
        assert_eq!(mode("resplit"), Some(GemvGridMode::Resplit));
        assert_eq!(mode("1"), None);
        assert_eq!(GemvGridMode::default(), GemvGridMode::Same);
        // Qwen3-8B's down projection at one row: one column per block over 4096 blocks. Only
        // the resplit mode caps it (8 columns per block then).
        for m in [GemvGridMode::Same, GemvGridMode::Balanced] {
            assert_eq!(gemv_launch_grid(1, 4096, 4096, 396, m), 4096);
        }
        assert_eq!(
            gemv_launch_grid(1, 4096, 4096, 396, GemvGridMode::Resplit),
            396
        );
        assert_eq!(
            gemv_launch_grid(1, 4096, 4096, 0, GemvGridMode::Resplit),
            4096
        );
        assert_eq!(
            gemv_launch_grid(1, 4096, 512, 396, GemvGridMode::Balanced),
            256
        );
        assert_eq!(gemv_launch_grid(1, 4096, 512, 396, GemvGridMode::Same), 396);
    }

    #[test]
    fn gemv_norm_references_refuse_the_mma_form() {
        let mut mem = FlatMemory::new();
        let k = GemvNorm {
            c: DevicePtr::NULL,
            residual: DevicePtr::NULL,
            residual_out: DevicePtr::NULL,
            input: DevicePtr::NULL,
            norm_weight: DevicePtr::NULL,
            w: DevicePtr::NULL,
            bias: DevicePtr::NULL,
            m: 5,
            n: 8,
            k: 8,
            eps: 1e-6,
            stage: 0,
        };
        let err = k.reference(&mut mem).unwrap_err().to_string();
        assert!(
            err.contains("m = 5") && err.contains("gemv_bf16_norm"),
            "{err}"
        );
    }
}
