// SPDX-License-Identifier: MIT OR Apache-2.0
// Skinny GEMM for decode: C[M, N] = A[M, K] * W[N, K]^T (+ bias), M <= 8 rows.
//
// At decode the weight is read once per step and each of its bytes is used M times, so the kernel
// is a weight stream: its speed is the number of weight bytes it keeps in flight. Weight loads are
// 16 bytes per lane with an L1-no-allocate hint (a weight byte is never read twice, and letting it
// through L1 would evict A, which every warp of the SM re-reads from there).
//
// Work split. A block is 8 warps (256 threads) and covers COLS consecutive output columns. A warp
// computes `per_warp` columns (1 or 8, below) over one slice of K; the `slices` = 8 * per_warp /
// COLS warps of a column group split K into equal slices (whole 512-byte pieces of a weight row
// in the FMA form, 64-byte pieces in the MMA form) and their partial sums meet in shared memory,
// added in slice order (deterministic). The host
// picks COLS (`gemv_columns_per_block`, crates/kernels/src/ops/gemm.rs) and launches
// ceil(N / COLS) blocks; the kernel recovers COLS = next_pow2(ceil(N / gridDim.x)) clamped to
// [per_warp, 8 * per_warp], which equals the host's choice whenever N >= COLS and otherwise is a
// smaller power of two that still covers N (more warps per column); a grid too small for COLS is
// covered by a block-stride loop. So the launch ABI is only (grid, 256 threads).
//
// Two inner products, picked by M at compile time (the body is instantiated for M = 1..8):
// - M <= FMA_MAX_M: one output column per warp. Each lane streams 16-byte chunks of the weight
//   row, BATCH loads (4 KiB per warp) issued together, and does 8 FMAs per chunk and row of A
//   (A is re-read from L1). This costs about 8 + 17 M instructions per 16 weight bytes: fine up
//   to M = 4, issue-bound beyond. One row over at most PAIR_MAX_K = 1024 inputs at 8 columns a
//   block (one warp a column) takes two columns a warp instead (gemv_pairs: a column's row is
//   only half a batch, so the warp loads two rows at once), with the same sums; a block then
//   covers 16 columns a round, so a launch of ceil(N / 8) blocks leaves half of them idle (the
//   model caps plain GEMV grids at the 396 resident blocks, where they loop).
// - M > FMA_MAX_M: eight output columns per warp through mma.sync m16n8k16 (bf16 in, f32
//   accumulate), so the arithmetic is two MMAs per 512 weight bytes whatever M is. Lane (g, t)
//   (g = lane / 4, t = lane % 4) loads 16 bytes of weight row g and of A row g at chunk 4 i + t;
//   the weight is the B operand (n8 = the 8 columns), A the first 8 rows of the 16-row A operand
//   (rows 8..15 are zero), and the k slots {2t, 2t + 1, 2t + 8, 2t + 9} of the first MMA take
//   elements 0..3 of the lane's chunk, those of the second MMA elements 4..7. Both operands use
//   the same slot -> k map, so the products pair up and the sum over the 32 k is unchanged.
//
// K not a multiple of 8 (or A / W not 16-byte aligned) takes a scalar path (no vector loads on
// misaligned rows). f32 accumulation (FMA or the tensor core's f32 accumulator), bias added in
// f32, one rounding at the output (none for the f32-output form the LM head uses).
// Registers: one kernel holds all eight bodies, so it gets the largest one's count; the launch
// bounds fix it at 80 (3 blocks, 24 warps per SM: at 3 to 4 KiB in flight per warp, about twice
// the bytes an SM needs in flight to cover HBM latency at full bandwidth), no spills
// (gemv_bf16_swiglu, with the interleaved rows and the pair epilogue: 8 bytes spilled).
// Launch: grid = ceil(N / COLS), block = 256, COLS in {1, 2, 4, 8} (M <= 4) or {8, 16, 32, 64};
// the host may cap the grid where the blocks then loop (and the normalising entries' pair form
// takes one block per 16 columns).
#include "async_copy.cuh"
#include "common.cuh"
#include "norm.cuh"

namespace {

using metrale::normalise_input;
using metrale::NormInput;

constexpr int MAX_M = 8;
constexpr int WARPS = 8;
// Rows up to which the FMA form is used; must match GEMV_FMA_MAX_ROWS in ops/gemm.rs.
constexpr int FMA_MAX_M = 4;
// Output columns per warp in the MMA form (the n of m16n8k16).
constexpr int TILE = 8;
// 16-byte weight loads each lane has in flight: 4 KiB per warp.
constexpr int BATCH = 8;
// The staged entries (gemv_bf16_staged, gemv_bf16_swiglu_staged): of a lane's first batch, the
// loads copied into shared memory before the programmatic-launch wait; the launch gives
// WARPS * 32 * STAGED 16-byte slots (16 KiB) of dynamic shared memory.
constexpr int STAGED = 4;
constexpr uint32_t STAGE_BYTES = WARPS * 32 * STAGED * 16;

__device__ __forceinline__ uint4 load_stream(const uint4* p) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
    return v;
}

// The two bf16 of a little-endian pair, widened exactly.
__device__ __forceinline__ float lo(uint32_t v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float hi(uint32_t v) { return __uint_as_float(v & 0xffff0000u); }

__device__ __forceinline__ uint32_t div_ceil(uint32_t a, uint32_t b) { return (a + b - 1) / b; }
__device__ __forceinline__ uint32_t next_pow2(uint32_t x) {
    return x <= 1 ? 1u : 1u << (32 - __clz(x - 1));
}

// The weight row behind output column v of n: v itself, or in the SwiGLU form the columns
// interleave the two halves of W: gate row v / 2 for even v, up row n / 2 + v / 2 for odd.
template <bool SWIGLU>
__device__ __forceinline__ uint32_t weight_row(uint32_t v, uint32_t n) {
    return !SWIGLU ? v : (v & 1) ? (n >> 1) + (v >> 1) : v >> 1;
}

__device__ __forceinline__ float swiglu(float g, float u) { return g / (1.0f + __expf(-g)) * u; }

__device__ __forceinline__ void store(__nv_bfloat16* p, float v) { *p = metrale::to_bf16(v); }
__device__ __forceinline__ void store(float* p, float v) { *p = v; }

// A 16-byte piece of A: through the read-only cache from global memory, or from shared memory.
template <bool A_SHARED>
__device__ __forceinline__ uint4 load_a(const uint4* p) {
    if constexpr (A_SHARED) {
        return *p;
    } else {
        return __ldg(p);
    }
}

// acc[r][0] takes the even elements of the chunk, acc[r][1] the odd ones: two dependency chains.
// A chunk with live == false contributes nothing (its A loads are skipped, its weights are 0).
// A_SHARED: A is in shared memory (the entries that normalise their input), not global.
template <int M, bool A_SHARED = false>
__device__ __forceinline__ void fma_chunk(float (&acc)[M][2], const uint4& wv,
                                          const uint4* __restrict__ a, uint32_t chunk,
                                          uint32_t row_chunks, bool live = true) {
    const uint32_t w[4] = {wv.x, wv.y, wv.z, wv.w};
#pragma unroll
    for (int r = 0; r < M; ++r) {
        const uint4 av =
            live ? load_a<A_SHARED>(a + (size_t)r * row_chunks + chunk) : make_uint4(0, 0, 0, 0);
        const uint32_t x[4] = {av.x, av.y, av.z, av.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            acc[r][0] = fmaf(lo(w[j]), lo(x[j]), acc[r][0]);
            acc[r][1] = fmaf(hi(w[j]), hi(x[j]), acc[r][1]);
        }
    }
}

// The 16-byte chunks [begin, end) of a K-row that slice `slice` of `slices` takes in the FMA
// form: whole 512-byte pieces of the row, so every warp load is 4 full lines.
__device__ __forceinline__ uint2 fma_slice(uint32_t k, uint32_t slice, uint32_t slices) {
    const uint32_t chunks = k / 8;
    const uint32_t per = div_ceil(div_ceil(chunks, slices), 32) * 32;
    const uint32_t begin = min(slice * per, chunks);
    return make_uint2(begin, min(begin + per, chunks));
}

// The staged entries, before the programmatic-launch wait: the first STAGED loads of the lane's
// first batch of its warp's first column (chunks [begin, end) of `w4`) are copied into `staged`
// (the warp's STAGED * 32 16-byte slots; copies past the slice are zero-filled). Copies, because
// ptxas moves register loads issued before griddepcontrol.wait to after it (seen in the SASS) and
// keeps cp.async in place. Weights are never written by a kernel, so they may be read early.
__device__ __forceinline__ void stage_first(uint4* staged, const uint4* __restrict__ w4,
                                            uint2 range, int lane) {
#pragma unroll
    for (int u = 0; u < STAGED; ++u) {
        const uint32_t c = range.x + lane + 32 * u;
        metrale::cp_async_16(metrale::smem_addr(staged + 32 * u + lane), w4 + (c < range.y ? c : 0),
                             c < range.y);
    }
    metrale::cp_async_commit();
}

// out[r] = sum over this warp's slice of K of w_row[k] * a[r, k], on every lane. Warp-uniform.
// STAGE with `primed` set: stage_first copied the first STAGED loads of the first batch into
// `staged` (the warp's slots); this call takes them from there and clears `primed`. Same sums in
// the same order either way. A_SHARED: `a` is in shared memory.
template <int M, bool STAGE = false, bool A_SHARED = false>
__device__ __forceinline__ void column_dot(float (&out)[M], const __nv_bfloat16* __restrict__ w_row,
                                           const __nv_bfloat16* __restrict__ a, uint32_t k,
                                           uint32_t slice, uint32_t slices, bool vec, int lane,
                                           bool* primed = nullptr, const uint4* staged = nullptr) {
    float acc[M][2];
#pragma unroll
    for (int r = 0; r < M; ++r) acc[r][0] = acc[r][1] = 0.0f;
    if (vec) {
        const uint32_t chunks = k / 8;
        // Slices are whole 512-byte pieces of the row, so every warp load is 4 full lines
        // (fma_slice computes the same range).
        const uint32_t per = div_ceil(div_ceil(chunks, slices), 32) * 32;
        const uint32_t begin = min(slice * per, chunks), end = min(begin + per, chunks);
        const uint4* w4 = reinterpret_cast<const uint4*>(w_row);
        const uint4* a4 = reinterpret_cast<const uint4*>(a);
        uint32_t i = begin;
        if constexpr (STAGE) {
            if (*primed) {
                // The first batch in the tail's predicated form (a full batch takes every chunk,
                // as the loop below would).
                *primed = false;
                uint4 wv[BATCH];
#pragma unroll
                for (int u = STAGED; u < BATCH; ++u) {
                    const uint32_t c = i + lane + 32 * u;
                    wv[u] = c < end ? load_stream(w4 + c) : make_uint4(0, 0, 0, 0);
                }
                metrale::cp_async_wait<0>();
#pragma unroll
                for (int u = 0; u < STAGED; ++u) wv[u] = staged[32 * u + lane];
#pragma unroll
                for (int u = 0; u < BATCH; ++u) {
                    const uint32_t c = i + lane + 32 * u;
                    fma_chunk<M, A_SHARED>(acc, wv[u], a4, c, chunks, c < end);
                }
                i += 32 * BATCH;
            }
        }
        for (; i + 32 * BATCH <= end; i += 32 * BATCH) {
            uint4 wv[BATCH];
#pragma unroll
            for (int u = 0; u < BATCH; ++u) wv[u] = load_stream(w4 + i + lane + 32 * u);
#pragma unroll
            for (int u = 0; u < BATCH; ++u) fma_chunk<M, A_SHARED>(acc, wv[u], a4, i + lane + 32 * u, chunks);
        }
        if (i < end) {
            // The rest of the slice, fewer than BATCH chunks per lane: predicated loads, still all
            // issued before the first is used.
            uint4 wv[BATCH];
#pragma unroll
            for (int u = 0; u < BATCH; ++u) {
                const uint32_t c = i + lane + 32 * u;
                wv[u] = c < end ? load_stream(w4 + c) : make_uint4(0, 0, 0, 0);
            }
#pragma unroll
            for (int u = 0; u < BATCH; ++u) {
                const uint32_t c = i + lane + 32 * u;
                fma_chunk<M, A_SHARED>(acc, wv[u], a4, c, chunks, c < end);
            }
        }
    } else {
        const uint32_t per = div_ceil(k, slices);
        const uint32_t begin = min(slice * per, k), end = min(begin + per, k);
        for (uint32_t e = begin + lane; e < end; e += 32) {
            const float wf = metrale::to_f32(w_row[e]);
#pragma unroll
            for (int r = 0; r < M; ++r)
                acc[r][0] = fmaf(wf, metrale::to_f32(a[(size_t)r * k + e]), acc[r][0]);
        }
    }
#pragma unroll
    for (int r = 0; r < M; ++r) out[r] = metrale::warp_sum(acc[r][0] + acc[r][1]);
}

// d += A(16 x 16, rows 8..15 zero) * B(16 x 8), bf16 operands, f32 accumulator.
__device__ __forceinline__ void mma_16816(float (&d)[4], uint32_t a0, uint32_t a2, uint32_t b0,
                                          uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(0u), "r"(a2), "r"(0u), "r"(b0), "r"(b1));
}

// The MMA form over one slice of K for columns n0..n0+7: on return lane (g, t) holds
// d[0] += C[g, n0 + 2t] and d[1] += C[g, n0 + 2t + 1] (partial over the slice; rows g >= M are 0).
// Requires K % 8 == 0 and 16-byte aligned A and W. Warp-uniform.
template <int M, bool SWIGLU>
__device__ __forceinline__ void tile_mma(float (&d)[4], const __nv_bfloat16* __restrict__ w,
                                         const __nv_bfloat16* __restrict__ a, uint32_t n,
                                         uint32_t k, uint32_t n0, uint32_t slice, uint32_t slices,
                                         int lane) {
    const int g = lane >> 2, t = lane & 3;
    const uint32_t chunks = k / 8;
    // Slices are whole 32-element blocks: each row's four lanes read 64 contiguous bytes.
    const uint32_t per = div_ceil(div_ceil(chunks, slices), 4) * 4;
    const uint32_t begin = min(slice * per, chunks), end = min(begin + per, chunks);
    const bool w_live = n0 + g < n, a_live = g < M;
    const uint4* w4 =
        reinterpret_cast<const uint4*>(w + (size_t)(w_live ? weight_row<SWIGLU>(n0 + g, n) : 0) * k);
    const uint4* a4 = reinterpret_cast<const uint4*>(a + (size_t)(a_live ? g : 0) * k);
    const uint4 zero = make_uint4(0, 0, 0, 0);
    // A second accumulator for the second MMA of each chunk halves the dependent MMA chain.
    float e[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    uint32_t i = begin;
    for (; i + 4 * BATCH <= end; i += 4 * BATCH) {
        uint4 wv[BATCH];
#pragma unroll
        for (int u = 0; u < BATCH; ++u) wv[u] = w_live ? load_stream(w4 + i + 4 * u + t) : zero;
#pragma unroll
        for (int u = 0; u < BATCH; ++u) {
            const uint4 av = a_live ? __ldg(a4 + i + 4 * u + t) : zero;
            mma_16816(d, av.x, av.y, wv[u].x, wv[u].y);
            mma_16816(e, av.z, av.w, wv[u].z, wv[u].w);
        }
    }
    if (i < end) {
        // A lane past the slice's end holds zeros in both operands: the same k slots of every
        // row and column, so the products it stands for are all zero.
        uint4 wv[BATCH];
#pragma unroll
        for (int u = 0; u < BATCH; ++u) {
            const uint32_t c = i + 4 * u + t;
            wv[u] = w_live && c < end ? load_stream(w4 + c) : zero;
        }
#pragma unroll
        for (int u = 0; u < BATCH; ++u) {
            if (i + 4 * u < end) {  // warp-uniform: some lane of the block is live
                const uint32_t c = i + 4 * u + t;
                const uint4 av = a_live && c < end ? __ldg(a4 + c) : zero;
                mma_16816(d, av.x, av.y, wv[u].x, wv[u].y);
                mma_16816(e, av.z, av.w, wv[u].z, wv[u].w);
            }
        }
    }
#pragma unroll
    for (int q = 0; q < 4; ++q) d[q] += e[q];
}

// partial holds WARPS x (MAX_M x TILE) floats: warp w's partial sum for row r and its j-th
// column at partial[w * 64 + r * 8 + j].
// SWIGLU (bf16 output, no bias): the n columns interleave gate and up rows (weight_row), and the
// output is c[r, j] = bf16(silu(g) * u) of g and u the bf16-rounded products of gate row j and up
// row n / 2 + j (silu_mul_bf16's formula on what gemv_bf16 would store), c being [M, n / 2].
// Pairs never straddle blocks: cols is at least 2.
// STAGE (FMA form only; the caller has not waited): the staged and normalising entries. With
// `staged` (the block's 16 KiB of stage slots) not null, the block copies its warps' first weights
// there before the wait (stage_first, column_dot). NORM: `a` is the block's shared-memory A, which
// normalise_input fills from `norm` after the wait.
template <int M, bool SWIGLU, bool STAGE, typename Out, bool NORM = false>
__device__ __forceinline__ void gemv(Out* __restrict__ c, const __nv_bfloat16* __restrict__ a,
                                     const __nv_bfloat16* __restrict__ w,
                                     const __nv_bfloat16* __restrict__ bias, uint32_t n,
                                     uint32_t k, float* partial, uint4* staged,
                                     const NormInput* norm = nullptr) {
    constexpr bool MMA = M > FMA_MAX_M;
    constexpr uint32_t PER_WARP = MMA ? TILE : 1;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const uint32_t cols = min(max(next_pow2(div_ceil(n, gridDim.x)), max(PER_WARP, SWIGLU ? 2u : 1u)),
                              PER_WARP * WARPS);
    const uint32_t slices = WARPS * PER_WARP / cols;
    const uint32_t group = warp / slices, slice = warp % slices;
    const bool vec = k % 8 == 0 &&
                     ((reinterpret_cast<uintptr_t>(a) | reinterpret_cast<uintptr_t>(w)) & 15) == 0;
    float* mine = partial + warp * (MAX_M * TILE);
    static_assert(!(STAGE && MMA), "the staged entries take the FMA form only");
    static_assert(!NORM || STAGE, "the normalising entries wait in the body");
    // The blocks of the first wave (3 per SM, the launch bounds) of a launch that gives the
    // stage's shared memory copy their warps' first weights before the wait: only they can be
    // resident while the kernel before runs. Later blocks just wait. Dependents are launched
    // after the wait, never before (common.cuh).
    bool primed = false;
    if constexpr (STAGE) {
        uint32_t sms;
        asm("mov.u32 %0, %%nsmid;" : "=r"(sms));
        const uint32_t first = blockIdx.x * cols + group;
        if (staged != nullptr && blockIdx.x < 3 * sms && vec && first < n) {
            const __nv_bfloat16* w_row = w + (size_t)weight_row<SWIGLU>(first, n) * k;
            stage_first(staged + warp * 32 * STAGED, reinterpret_cast<const uint4*>(w_row),
                        fma_slice(k, slice, slices), lane);
            primed = true;
        }
        metrale::grid_dependency_sync();
    }
    // NORM: `a` is the block's own shared memory (gemv_norm), written here and read only after
    // normalise_input's closing barrier.
    if constexpr (NORM) normalise_input<M>(const_cast<__nv_bfloat16*>(a), *norm, k, partial);
    for (uint32_t base = blockIdx.x * cols; base < n; base += gridDim.x * cols) {
        const uint32_t first = base + group * PER_WARP;
        if constexpr (MMA) {
            if (vec) {
                float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                tile_mma<M, SWIGLU>(d, w, a, n, k, first, slice, slices, lane);
                const int g = lane >> 2, t = lane & 3;
                if (g < M) {
                    mine[g * TILE + 2 * t] = d[0];
                    mine[g * TILE + 2 * t + 1] = d[1];
                }
            } else {
                for (uint32_t j = 0; j < TILE; ++j) {
                    float out[M];
                    if (first + j < n) {
                        column_dot<M>(out, w + (size_t)weight_row<SWIGLU>(first + j, n) * k, a, k,
                                      slice, slices, false, lane);
                    } else {
#pragma unroll
                        for (int r = 0; r < M; ++r) out[r] = 0.0f;
                    }
                    if (lane == 0) {
#pragma unroll
                        for (int r = 0; r < M; ++r) mine[r * TILE + j] = out[r];
                    }
                }
            }
        } else {
            float out[M];
            if (first < n) {
                column_dot<M, STAGE, NORM>(out, w + (size_t)weight_row<SWIGLU>(first, n) * k, a,
                                           k, slice, slices, vec, lane, &primed,
                                           staged + warp * 32 * STAGED);
            } else {
#pragma unroll
                for (int r = 0; r < M; ++r) out[r] = 0.0f;
            }
            if (lane == 0) {
#pragma unroll
                for (int r = 0; r < M; ++r) mine[r * TILE] = out[r];
            }
        }
        __syncthreads();
        auto column_sum = [&](uint32_t r, uint32_t cc) {
            const uint32_t grp = cc / PER_WARP, j = cc % PER_WARP;
            float s = 0.0f;
            for (uint32_t q = 0; q < slices; ++q)
                s += partial[(grp * slices + q) * (MAX_M * TILE) + r * TILE + j];
            return s;
        };
        if constexpr (SWIGLU) {
            const uint32_t half_n = n / 2;
            {
                // One thread per (row, gate/up pair) of the block's columns.
                for (uint32_t i = threadIdx.x; i < cols / 2 * M; i += blockDim.x) {
                    const uint32_t r = i / (cols / 2), cc = 2 * (i % (cols / 2));
                    if (base + cc >= n) continue;
                    const float g = metrale::to_f32(metrale::to_bf16(column_sum(r, cc)));
                    const float u = metrale::to_f32(metrale::to_bf16(column_sum(r, cc + 1)));
                    store(&c[(size_t)r * half_n + (base + cc) / 2], swiglu(g, u));
                }
            }
            __syncthreads();
            continue;
        }
        // Consecutive threads take consecutive columns of one row: coalesced stores.
        for (uint32_t i = threadIdx.x; i < cols * M; i += blockDim.x) {
            const uint32_t r = i / cols, cc = i % cols, col = base + cc;
            if (col >= n) continue;
            float s = column_sum(r, cc);
            if (bias != nullptr) s += metrale::to_f32(bias[col]);
            store(&c[(size_t)r * n + col], s);
        }
        __syncthreads();
    }
}

// Rows of at most PAIR_MAX_K elements (a warp's half batch: 4 loads a lane) take two columns a
// warp in gemv_pairs.
constexpr uint32_t PAIR_MAX_K = 32 * (BATCH / 2) * 8;

// Whether gemv<1> would take 8 columns a block (next_pow2(ceil(n / gridDim.x)) >= 8, so one warp
// a column, K unsplit) over a short, vector-aligned row: then gemv_pairs computes the same sums.
// (The SwiGLU form's floor of 2 columns a block is below 8, so the same test holds for it.)
__device__ __forceinline__ bool pairs_fit(const __nv_bfloat16* a, const __nv_bfloat16* w, uint32_t n,
                                          uint32_t k) {
    const bool vec = k % 8 == 0 &&
                     ((reinterpret_cast<uintptr_t>(a) | reinterpret_cast<uintptr_t>(w)) & 15) == 0;
    return vec && k <= PAIR_MAX_K && next_pow2(div_ceil(n, gridDim.x)) >= (uint32_t)WARPS;
}

// The normalising pair form's stage: each warp's two rows of at most PAIR_MAX_K elements, whole
// (BATCH / 2 16-byte loads a lane each): 32 KiB a block. Must match GEMV_PAIR_STAGE_BYTES in
// ops/gemm.rs.
constexpr uint32_t PAIR_STAGE_BYTES = WARPS * 2 * 32 * (BATCH / 2) * 16;

// The pair forms' loads: lane `lane`'s HALF chunks of the weight rows behind columns col[0] and
// col[1] (zero past n or the row), all issued before any is used.
template <bool SWIGLU>
__device__ __forceinline__ void pair_load(uint4 (&wv)[2][BATCH / 2], const __nv_bfloat16* __restrict__ w,
                                          const uint32_t (&col)[2], uint32_t n, uint32_t k, int lane) {
    const uint32_t chunks = k / 8;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        const uint4* w4 =
            reinterpret_cast<const uint4*>(w + (size_t)weight_row<SWIGLU>(min(col[j], n - 1), n) * k);
#pragma unroll
        for (int u = 0; u < BATCH / 2; ++u) {
            const uint32_t ch = lane + 32 * u;
            wv[j][u] = col[j] < n && ch < chunks ? load_stream(w4 + ch) : make_uint4(0, 0, 0, 0);
        }
    }
}

// The pair forms' sums, on every lane: each column's as gemv<1>'s one-column form computes it (the
// same chunks per lane in the same order, the same warp sum). A_SHARED: A is in shared memory.
template <bool A_SHARED>
__device__ __forceinline__ void pair_sums(float (&sum)[2], const uint4 (&wv)[2][BATCH / 2],
                                          const __nv_bfloat16* __restrict__ a, uint32_t k, int lane) {
    const uint32_t chunks = k / 8;
    const uint4* a4 = reinterpret_cast<const uint4*>(a);
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        float acc[1][2] = {{0.0f, 0.0f}};
#pragma unroll
        for (int u = 0; u < BATCH / 2; ++u) {
            const uint32_t ch = lane + 32 * u;
            fma_chunk<1, A_SHARED>(acc, wv[j][u], a4, ch, chunks, ch < chunks);
        }
        // 0 + : a zero sum stored as +0, as gemv<1>'s block reduction (which starts at 0) does.
        sum[j] = 0.0f + metrale::warp_sum(acc[0][0] + acc[0][1]);
    }
}

// Lane 0 stores the pair's columns below n, each with its bias (when there is one) added.
template <typename Out>
__device__ __forceinline__ void pair_store(Out* __restrict__ c, const float (&sum)[2],
                                           const uint32_t (&col)[2], uint32_t n,
                                           const __nv_bfloat16* __restrict__ bias, int lane) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        if (lane == 0 && col[j] < n) {
            float s = sum[j];
            if (bias != nullptr) s += metrale::to_f32(bias[col[j]]);
            store(&c[col[j]], s);
        }
    }
}

// gemv<1> (one row, plain entry) for rows of at most PAIR_MAX_K elements, two columns a warp: warp
// w of a block round takes columns base + w and base + 8 + w and issues both columns' weight loads
// (4 a lane each, a whole batch) before using any, so a warp keeps 4 KiB in flight where the one
// column form's half-empty batch kept 2. Each column's sum is the one-column form's bit for bit
// (pair_sums, the bias added after), and lane 0 stores it: one warp per column needs no block
// reduction.
template <typename Out>
__device__ __forceinline__ void gemv_pairs(Out* __restrict__ c, const __nv_bfloat16* __restrict__ a,
                                           const __nv_bfloat16* __restrict__ w,
                                           const __nv_bfloat16* __restrict__ bias, uint32_t n,
                                           uint32_t k) {
    constexpr uint32_t ROUND = 2 * WARPS;  // columns a block takes a round
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (uint32_t base = blockIdx.x * ROUND; base < n; base += gridDim.x * ROUND) {
        const uint32_t col[2] = {base + warp, base + WARPS + warp};
        uint4 wv[2][BATCH / 2];
        pair_load<false>(wv, w, col, n, k, lane);
        float sum[2];
        pair_sums<false>(sum, wv, a, k, lane);
        pair_store(c, sum, col, n, bias, lane);
    }
}

// The normalising entries' one-row form for rows of at most PAIR_MAX_K elements at 8 columns a
// block (gemv_pairs' condition, with A in shared memory): two columns a warp, 16 a block round.
// With `staged` (PAIR_STAGE_BYTES: both rows of each warp's first round, whole) the first-wave
// blocks copy those rows before the programmatic-launch wait, so a block's first round needs no
// weight load after it. The plain form stores each column from lane 0; the SwiGLU form meets the
// gate and up sums of each pair (adjacent columns, neighbouring warps) in `partial` and stores
// silu_mul_bf16's formula of their bf16 roundings, as gemv<1, true> does. Same bits as gemv<1>'s
// normalising form. The caller has not waited.
template <bool SWIGLU>
__device__ __forceinline__ void gemv_norm_pairs(__nv_bfloat16* __restrict__ c, __nv_bfloat16* a,
                                                const NormInput& in,
                                                const __nv_bfloat16* __restrict__ w,
                                                const __nv_bfloat16* __restrict__ bias, uint32_t n,
                                                uint32_t k, float* partial, uint4* staged) {
    constexpr int HALF = BATCH / 2;
    constexpr uint32_t ROUND = 2 * WARPS;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const uint32_t chunks = k / 8;
    // This warp's [2][HALF][32] slots, where there is a stage.
    uint4* mine = staged != nullptr ? staged + warp * 2 * 32 * HALF : nullptr;
    bool primed = false;
    {
        uint32_t sms;
        asm("mov.u32 %0, %%nsmid;" : "=r"(sms));
        const uint32_t base = blockIdx.x * ROUND;
        if (staged != nullptr && blockIdx.x < 3 * sms && base < n) {
            // stage_first's copies (a row is its STAGED loads), both rows in one commit group:
            // written out, as calling stage_first per row changed the register allocation of
            // every normalising body (nvdisasm), which the H200 figures were not measured with.
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                const uint32_t col = base + j * WARPS + warp;
                const uint4* w4 = reinterpret_cast<const uint4*>(
                    w + (size_t)weight_row<SWIGLU>(min(col, n - 1), n) * k);
#pragma unroll
                for (int u = 0; u < HALF; ++u) {
                    const uint32_t ch = lane + 32 * u;
                    const bool live = col < n && ch < chunks;
                    metrale::cp_async_16(metrale::smem_addr(mine + (j * HALF + u) * 32 + lane),
                                         w4 + (live ? ch : 0), live);
                }
            }
            metrale::cp_async_commit();
            primed = true;
        }
    }
    metrale::grid_dependency_sync();
    normalise_input<1>(a, in, k, partial);
    for (uint32_t base = blockIdx.x * ROUND; base < n; base += gridDim.x * ROUND) {
        const uint32_t col[2] = {base + warp, base + WARPS + warp};
        uint4 wv[2][HALF];
        if (primed) {
            // Each lane reads back only its own copies.
            primed = false;
            metrale::cp_async_wait<0>();
#pragma unroll
            for (int j = 0; j < 2; ++j)
#pragma unroll
                for (int u = 0; u < HALF; ++u) wv[j][u] = mine[(j * HALF + u) * 32 + lane];
        } else {
            pair_load<SWIGLU>(wv, w, col, n, k, lane);
        }
        float sum[2];
        pair_sums<true>(sum, wv, a, k, lane);
        if constexpr (SWIGLU) {
            // Column base + v's sum at partial[v]; thread i < 8 takes the pair (2i, 2i + 1).
            if (lane == 0) {
                partial[warp] = sum[0];
                partial[WARPS + warp] = sum[1];
            }
            __syncthreads();
            const uint32_t cc = 2 * threadIdx.x;
            if (threadIdx.x < ROUND / 2 && base + cc < n) {
                const float g = metrale::to_f32(metrale::to_bf16(partial[cc]));
                const float u = metrale::to_f32(metrale::to_bf16(partial[cc + 1]));
                store(&c[(base + cc) / 2], swiglu(g, u));
            }
            __syncthreads();
        } else {
            pair_store(c, sum, col, n, bias, lane);
        }
    }
}

template <bool SWIGLU = false, typename Out>
__device__ __forceinline__ void gemv_any(Out* __restrict__ c, const __nv_bfloat16* __restrict__ a,
                                         const __nv_bfloat16* __restrict__ w,
                                         const __nv_bfloat16* __restrict__ bias, uint32_t m,
                                         uint32_t n, uint32_t k) {
    __shared__ float partial[WARPS * MAX_M * TILE];
    if (n == 0) return;
    switch (m) {
        case 1:
            if (!SWIGLU && pairs_fit(a, w, n, k)) {
                gemv_pairs(c, a, w, bias, n, k);
            } else {
                gemv<1, SWIGLU, false>(c, a, w, bias, n, k, partial, nullptr);
            }
            break;
        case 2: gemv<2, SWIGLU, false>(c, a, w, bias, n, k, partial, nullptr); break;
        case 3: gemv<3, SWIGLU, false>(c, a, w, bias, n, k, partial, nullptr); break;
        case 4: gemv<4, SWIGLU, false>(c, a, w, bias, n, k, partial, nullptr); break;
        case 5: gemv<5, SWIGLU, false>(c, a, w, bias, n, k, partial, nullptr); break;
        case 6: gemv<6, SWIGLU, false>(c, a, w, bias, n, k, partial, nullptr); break;
        case 7: gemv<7, SWIGLU, false>(c, a, w, bias, n, k, partial, nullptr); break;
        case 8: gemv<8, SWIGLU, false>(c, a, w, bias, n, k, partial, nullptr); break;
        default: break;  // m = 0, or m > 8 (the host reference refuses it)
    }
}

// The staged entries' body: rows 1 to 4 (the FMA form) only; the caller has not waited.
template <bool SWIGLU = false>
__device__ __forceinline__ void gemv_staged(__nv_bfloat16* __restrict__ c,
                                            const __nv_bfloat16* __restrict__ a,
                                            const __nv_bfloat16* __restrict__ w,
                                            const __nv_bfloat16* __restrict__ bias, uint32_t m,
                                            uint32_t n, uint32_t k) {
    __shared__ float partial[WARPS * MAX_M * TILE];
    extern __shared__ uint4 dynamic[];
    uint32_t bytes;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(bytes));
    uint4* staged = bytes >= STAGE_BYTES ? dynamic : nullptr;
    if (n == 0) return;
    switch (m) {
        case 1: gemv<1, SWIGLU, true>(c, a, w, bias, n, k, partial, staged); break;
        case 2: gemv<2, SWIGLU, true>(c, a, w, bias, n, k, partial, staged); break;
        case 3: gemv<3, SWIGLU, true>(c, a, w, bias, n, k, partial, staged); break;
        case 4: gemv<4, SWIGLU, true>(c, a, w, bias, n, k, partial, staged); break;
        default: break;  // m = 0, or m > 4 (the host reference refuses it)
    }
}

// The normalising entries' body (rows 1 to 4; the caller has not waited). Dynamic shared memory:
// A ([m, k] bf16, rounded up to 16 bytes), then with `stage` set the stage slots: 16 KiB, or
// PAIR_STAGE_BYTES (32 KiB) for the pair form, which stages only with that much.
template <bool SWIGLU = false>
__device__ __forceinline__ void gemv_norm(__nv_bfloat16* __restrict__ c, const NormInput& in,
                                          const __nv_bfloat16* __restrict__ w,
                                          const __nv_bfloat16* __restrict__ bias, uint32_t m,
                                          uint32_t n, uint32_t k, uint32_t stage) {
    __shared__ float partial[WARPS * MAX_M * TILE];
    extern __shared__ uint4 dynamic[];
    uint32_t bytes;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(bytes));
    const uint32_t a_bytes = (m * k * 2 + 15) / 16 * 16;
    __nv_bfloat16* a = reinterpret_cast<__nv_bfloat16*>(dynamic);
    if (m == 1 && pairs_fit(a, w, n, k)) {
        // The pair form stages only with room for both rows of every warp (the host gives it).
        uint4* staged = stage != 0 && bytes >= a_bytes + PAIR_STAGE_BYTES ? dynamic + a_bytes / 16 : nullptr;
        gemv_norm_pairs<SWIGLU>(c, a, in, w, bias, n, k, partial, staged);
        return;
    }
    uint4* staged = stage != 0 && bytes >= a_bytes + STAGE_BYTES ? dynamic + a_bytes / 16 : nullptr;
    switch (m) {
        case 1: gemv<1, SWIGLU, true, __nv_bfloat16, true>(c, a, w, bias, n, k, partial, staged, &in); break;
        case 2: gemv<2, SWIGLU, true, __nv_bfloat16, true>(c, a, w, bias, n, k, partial, staged, &in); break;
        case 3: gemv<3, SWIGLU, true, __nv_bfloat16, true>(c, a, w, bias, n, k, partial, staged, &in); break;
        case 4: gemv<4, SWIGLU, true, __nv_bfloat16, true>(c, a, w, bias, n, k, partial, staged, &in); break;
        default: break;  // m = 0, or m > 4 (the host reference refuses it)
    }
}
}  // namespace

extern "C" __global__ void __launch_bounds__(256, 3) gemv_bf16(__nv_bfloat16* __restrict__ c,
                                                            const __nv_bfloat16* __restrict__ a,
                                                            const __nv_bfloat16* __restrict__ w,
                                                            const __nv_bfloat16* __restrict__ bias,
                                                            uint32_t m, uint32_t n, uint32_t k) {
    metrale::grid_dependency_sync();
    gemv_any(c, a, w, bias, m, n, k);
}

extern "C" __global__ void __launch_bounds__(256, 3) gemv_bf16_f32out(
    float* __restrict__ c, const __nv_bfloat16* __restrict__ a,
    const __nv_bfloat16* __restrict__ w, const __nv_bfloat16* __restrict__ bias, uint32_t m,
    uint32_t n, uint32_t k) {
    metrale::grid_dependency_sync();
    gemv_any(c, a, w, bias, m, n, k);
}

// gemv_bf16 of the gate and up projections with silu_mul_bf16 in its epilogue: w is the fused
// [2 inter, k] gate|up weight, out is [m, inter] = bf16(silu(g) * u) of the bf16 products g and u
// (the same bits as gemv_bf16 into a [m, 2 inter] buffer then silu_mul_bf16, when the launch has
// the same columns per block as that gemv_bf16 launch: each column's sum runs over the same
// slices). No bias. Launch: grid = ceil(2 inter / COLS), block = 256, COLS >= 2.
extern "C" __global__ void __launch_bounds__(256, 3) gemv_bf16_swiglu(
    __nv_bfloat16* __restrict__ out, const __nv_bfloat16* __restrict__ a,
    const __nv_bfloat16* __restrict__ w, uint32_t m, uint32_t inter, uint32_t k) {
    metrale::grid_dependency_sync();
    if (inter == 0) return;
    gemv_any<true>(out, a, w, nullptr, m, 2 * inter, k);
}

// gemv_bf16 for rows 1 to 4 whose first-wave blocks copy the first half of each lane's first
// weight batch into shared memory before the programmatic-launch wait, so the weight stream starts
// while the kernel before it runs. Kept apart from gemv_bf16 so that the entries of the
// products that do not stage keep their code (giving gemv_bf16 itself this path made Qwen3-8B's
// batch-1 step 1-4% slower although none of its launches staged; docs/results/2026-12-01-speed-
// h200/gemv-prewait). Launch: gemv_bf16's grid and block with 16 KiB of dynamic shared memory.
extern "C" __global__ void __launch_bounds__(256, 3) gemv_bf16_staged(
    __nv_bfloat16* __restrict__ c, const __nv_bfloat16* __restrict__ a,
    const __nv_bfloat16* __restrict__ w, const __nv_bfloat16* __restrict__ bias, uint32_t m,
    uint32_t n, uint32_t k) {
    gemv_staged(c, a, w, bias, m, n, k);
}

// gemv_bf16_swiglu in gemv_bf16_staged's form (rows 1 to 4; 16 KiB of dynamic shared memory).
extern "C" __global__ void __launch_bounds__(256, 3) gemv_bf16_swiglu_staged(
    __nv_bfloat16* __restrict__ out, const __nv_bfloat16* __restrict__ a,
    const __nv_bfloat16* __restrict__ w, uint32_t m, uint32_t inter, uint32_t k) {
    if (inter == 0) return;
    gemv_staged<true>(out, a, w, nullptr, m, 2 * inter, k);
}

// gemv_bf16 (rows 1 to 4) of bf16(rmsnorm(residual + input) * norm_weight): add_rmsnorm_f32res and
// the product in one launch, the same bits as the two. Every block normalises the rows into its
// shared memory after the wait; block 0 stores residual + input to residual_out (not `residual`:
// the other blocks read it). `input` may be null (nothing added; residual_out gets a copy). With
// `stage` set the first-wave blocks also copy their first weights before the wait
// (gemv_bf16_staged). One row over at most PAIR_MAX_K inputs at 8 columns a block takes the pair
// form (gemv_norm_pairs). Launch: gemv_bf16's block and columns per block (one block per 16
// columns in the pair form), over at most as many blocks as are resident (a block covers several
// column groups), with m * k * 2 bytes (rounded up to 16) plus, with `stage`, 16 KiB of dynamic
// shared memory (32 KiB in the pair form).
extern "C" __global__ void __launch_bounds__(256, 3) gemv_bf16_norm(
    __nv_bfloat16* __restrict__ c, const float* __restrict__ residual,
    float* __restrict__ residual_out, const __nv_bfloat16* __restrict__ input,
    const __nv_bfloat16* __restrict__ norm_weight, const __nv_bfloat16* __restrict__ w,
    const __nv_bfloat16* __restrict__ bias, uint32_t m, uint32_t n, uint32_t k, float eps,
    uint32_t stage) {
    const NormInput in{residual, residual_out, input, norm_weight, eps};
    gemv_norm(c, in, w, bias, m, n, k, stage);
}

// gemv_bf16_swiglu in gemv_bf16_norm's form: the gate|up product with SiLU x up in its epilogue,
// of the normalised rows. Launch: as gemv_bf16_norm over the 2 inter interleaved columns.
extern "C" __global__ void __launch_bounds__(256, 3) gemv_bf16_swiglu_norm(
    __nv_bfloat16* __restrict__ out, const float* __restrict__ residual,
    float* __restrict__ residual_out, const __nv_bfloat16* __restrict__ input,
    const __nv_bfloat16* __restrict__ norm_weight, const __nv_bfloat16* __restrict__ w, uint32_t m,
    uint32_t inter, uint32_t k, float eps, uint32_t stage) {
    const NormInput in{residual, residual_out, input, norm_weight, eps};
    gemv_norm<true>(out, in, w, nullptr, m, 2 * inter, k, stage);
}
