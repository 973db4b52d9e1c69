// SPDX-License-Identifier: MIT OR Apache-2.0
// Decode products over FP8 (E4M3) weights on the tensor cores: C[M, N] = A[M, K] * W[N, K]^T
// (+ bias), M = 1..8 rows, A bf16, W e4m3 with f32 scales[ceil(N / 2^row_shift), K / 128] as
// gemv_fp8.cu's, K a multiple of 128. The register GEMV spends ~2.5 instructions a weight byte
// (cvt, f16->f32, FMA per weight); here a weight costs half a cvt (e4m3x2 -> f16x2, exact) and the
// products go to mma.sync m16n8k16 (f16 in, f32 accumulate): per 2 KiB piece a warp issues ~45
// instructions (4 loads, 16 cvt, 8 mma, 4 shared loads, 4 FMA, addressing), ~0.02 a byte against
// the register GEMV's ~0.09, so the product should be bound by HBM as the BF16 stream is.
//
// The mma: A operand = 16 weight rows (16 output columns) x 16 k, B operand = 16 k x 8 columns,
// the rows of the activation (column j = activation row j; rows past M repeat row M - 1 and their
// outputs are dropped), D = 16 output columns x 8 activation rows in f32. The order of k inside
// one mma is free as long as A and B agree, so each lane takes contiguous bytes: lane (g, tg) =
// (lane / 4, lane % 4) loads 16 weights of row g and 16 of row g + 8 at k = 64 s + 16 tg of a
// 64-k step s, and feeds them as 4 mmas, mma j taking k + 4 j .. + 3 of them (a0 / a2 the low /
// high e4m3 pair of word j of row g, a1 / a3 of row g + 8; b0 / b1 the f16 pairs at k + 4 j and
// + 4 j + 2 of activation row g).
//
// Work split: a block = 8 warps = one tile of 16 output columns (gemv_fp8_mma_swiglu: 16 gate and
// the 16 matching up columns) over all of K; warp w takes the 128-k pieces w, w + 8, ... (a piece
// = one scale column), 2 pieces (1 for the SwiGLU form's two tiles) = 4 KiB of weight in flight a
// warp, L1-no-allocate loads. Each piece accumulates in a fresh f32 fragment that is then added
// times its scale (the lane's rows g and g + 8 each take their own: row_shift 0 or 7), so a scale
// multiplies the f32 sum of its 128 products, exactly as the host reference. The 8 warps' partial
// fragments meet in shared memory; 128 threads sum them (warp order) and store. Before the
// programmatic-launch wait each warp prefetches its first 4 KiB of weight into L2.
//
// The activation: each warp converts its own pieces of A to f16 in shared memory once ([M][K + 8]
// f16, the pad keeps the 8 rows' reads off the same banks). bf16 -> f16 is exact for
// 2^-14 <= |x| <= 65504; smaller values lose low bits as f16 subnormals (under 2^-25: zero), and
// finite values beyond +-65504 saturate to +-65504 (not to inf, which would turn a finite product
// into inf or NaN); inf and NaN pass through. The host reference (crates/kernels
// ops/gemv_fp8_mma.rs) converts the same way.
// Launch: grid = ceil(N / 16) (SwiGLU: ceil(inter / 16); a smaller grid is covered by a
// block-stride loop), block = 256, dynamic shared = 8 KiB + M (K + 8) * 2 (gemv_fp8_mma_smem_bytes).
// Other M, K not a multiple of 128 or W / A not 16-byte aligned: nothing is written.
#include <cuda_fp16.h>

#include "common.cuh"

namespace {

constexpr int WARPS = 8;
constexpr uint32_t PIECE_K = 128;  // one scale column
constexpr uint32_t TILE = 16;      // output columns a block
constexpr uint32_t A_PAD = 8;      // f16 past each staged row of A
constexpr float F16_MAX = 65504.0f;
// The warps' partial fragments ahead of A in shared memory: room for the SwiGLU form's two tiles.
constexpr uint32_t RED_BYTES = WARPS * 2 * 32 * 16;

__device__ __forceinline__ void prefetch_l2(const uint8_t* p) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

__device__ __forceinline__ uint4 load_stream(const uint8_t* p) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
    return v;
}

// The four e4m3 of w (lowest byte first) as two f16 pairs, exactly.
__device__ __forceinline__ void e4m3x4_to_f16(uint32_t w, uint32_t& lo, uint32_t& hi) {
    asm("{\n .reg .b16 l, h;\n mov.b32 {l, h}, %2;\n cvt.rn.f16x2.e4m3x2 %0, l;\n"
        " cvt.rn.f16x2.e4m3x2 %1, h;\n}"
        : "=r"(lo), "=r"(hi)
        : "r"(w));
}

// d += a (16x16, row) * b (16x8, col), f16 in, f32 accumulators.
__device__ __forceinline__ void mma_f16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                        uint32_t a3, uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// bf16 -> f16 as the header says: finite values saturate at +-65504, inf and NaN pass through.
__device__ __forceinline__ float f16_range(float x) {
    return fabsf(x) > F16_MAX && fabsf(x) != INFINITY ? copysignf(F16_MAX, x) : x;
}

__device__ __forceinline__ uint32_t bf16x2_to_f16x2(uint32_t x) {
    const __half2 h = __floats2half2_rn(f16_range(__uint_as_float(x << 16)),
                                        f16_range(__uint_as_float(x & 0xffff0000u)));
    return *reinterpret_cast<const uint32_t*>(&h);
}

// The weight of one piece for one lane: rows g and g + 8, steps 0 and 1.
struct PieceLoad {
    uint4 w[2][2];  // [step][row g, row g + 8]
    float s_lo, s_hi;
};

// The parameters a warp needs to walk one 16-row tile of W.
struct Tile {
    const uint8_t* row_lo;  // row g of the tile (clamped into the weight), at k = 16 tg
    const uint8_t* row_hi;  // row g + 8
    const float* scale_lo;  // the scale row of row g
    const float* scale_hi;
};

__device__ __forceinline__ Tile tile_at(const uint8_t* __restrict__ w,
                                        const float* __restrict__ scales, uint32_t first,
                                        uint32_t last, uint32_t k, uint32_t row_shift, int g,
                                        int tg) {
    const uint32_t lo = min(first + g, last), hi = min(first + g + 8, last);
    const uint32_t kb = k / PIECE_K;
    return Tile{w + (size_t)lo * k + 16 * tg, w + (size_t)hi * k + 16 * tg,
                scales + (size_t)(lo >> row_shift) * kb, scales + (size_t)(hi >> row_shift) * kb};
}

__device__ __forceinline__ PieceLoad load_piece(const Tile& t, uint32_t piece) {
    PieceLoad p;
    const size_t off = (size_t)piece * PIECE_K;
#pragma unroll
    for (int s = 0; s < 2; ++s) {
        p.w[s][0] = load_stream(t.row_lo + off + 64 * s);
        p.w[s][1] = load_stream(t.row_hi + off + 64 * s);
    }
    p.s_lo = __ldg(t.scale_lo + piece);
    p.s_hi = __ldg(t.scale_hi + piece);
    return p;
}

// acc += scale * (the piece's 16 x 128 weights) . (A's 128 k of the piece), in fragment layout.
// a_row: this lane's activation row in shared memory at k = 16 tg.
__device__ __forceinline__ void consume_piece(float (&acc)[4], const PieceLoad& p,
                                              const __half* a_row, uint32_t piece) {
    float part[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int s = 0; s < 2; ++s) {
        const uint4* a4 = reinterpret_cast<const uint4*>(a_row + piece * PIECE_K + 64 * s);
        const uint4 x0 = a4[0], x1 = a4[1];
        const uint32_t b[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
        const uint32_t lo[4] = {p.w[s][0].x, p.w[s][0].y, p.w[s][0].z, p.w[s][0].w};
        const uint32_t hi[4] = {p.w[s][1].x, p.w[s][1].y, p.w[s][1].z, p.w[s][1].w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            uint32_t a0, a2, a1, a3;
            e4m3x4_to_f16(lo[j], a0, a2);
            e4m3x4_to_f16(hi[j], a1, a3);
            mma_f16(part, a0, a1, a2, a3, b[2 * j], b[2 * j + 1]);
        }
    }
    acc[0] = fmaf(part[0], p.s_lo, acc[0]);
    acc[1] = fmaf(part[1], p.s_lo, acc[1]);
    acc[2] = fmaf(part[2], p.s_hi, acc[2]);
    acc[3] = fmaf(part[3], p.s_hi, acc[3]);
}

// This warp's pieces of A's m rows as f16 into a_s ([m][k + A_PAD]): 4 elements a lane a piece
// and row, 8 of those loads in flight before their stores.
__device__ __forceinline__ void stage_a(__half* a_s, const __nv_bfloat16* __restrict__ a,
                                        uint32_t m, uint32_t k, int warp, int lane) {
    const uint32_t kb = k / PIECE_K;
    const uint32_t pieces = (uint32_t)warp < kb ? (kb - warp + WARPS - 1) / WARPS : 0;
    const uint32_t total = m * pieces;
    constexpr int LOADS = 8;
    for (uint32_t i0 = 0; i0 < total; i0 += LOADS) {
        uint2 x[LOADS];
        size_t at[LOADS];
#pragma unroll
        for (int u = 0; u < LOADS; ++u) {
            const uint32_t i = i0 + u;
            if (i < total) {
                const uint32_t r = i / pieces, e = (warp + (i % pieces) * WARPS) * PIECE_K + 4 * lane;
                x[u] = *reinterpret_cast<const uint2*>(a + (size_t)r * k + e);
                at[u] = (size_t)r * (k + A_PAD) + e;
            }
        }
#pragma unroll
        for (int u = 0; u < LOADS; ++u) {
            if (i0 + u < total)
                *reinterpret_cast<uint2*>(a_s + at[u]) =
                    make_uint2(bf16x2_to_f16x2(x[u].x), bf16x2_to_f16x2(x[u].y));
        }
    }
    __syncwarp();
}

// The block's tiles: for each, every warp's partial f32 fragments of TILES tiles (the plain form
// 1, SwiGLU 2: gate then up) into red[warp][tile][lane][4], then `store(column, row, sums)` by
// threads 0..127 (column = tid / 8, row = tid % 8) for the tile's columns below `columns`.
template <int TILES, typename Tiles, typename Store>
__device__ __forceinline__ void run_tiles(const __nv_bfloat16* __restrict__ a, uint32_t m,
                                          uint32_t columns, uint32_t k, Tiles tiles,
                                          Store store) {
    extern __shared__ __align__(16) unsigned char smem[];
    float4* red = reinterpret_cast<float4*>(smem);  // [WARPS][TILES][32], in RED_BYTES
    __half* a_s = reinterpret_cast<__half*>(smem + RED_BYTES);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, tg = lane & 3;
    const uint32_t kb = k / PIECE_K;
    constexpr int BATCH = 2 / TILES;  // pieces in flight a tile: 4 KiB of weight a warp
    if (blockIdx.x * TILE < columns) {
        // The first batch's weight lines into L2 before the programmatic-launch wait (no kernel
        // writes W): prefetches stay before it, where plain loads may be moved after it.
        Tile t[TILES];
        tiles(t, blockIdx.x * TILE, g, tg);
#pragma unroll
        for (int u = 0; u < BATCH; ++u) {
            const uint32_t p = warp + u * WARPS;
            if (p < kb) {
#pragma unroll
                for (int i = 0; i < TILES; ++i) {
                    const size_t off = (size_t)p * PIECE_K;
                    prefetch_l2(t[i].row_lo + off);
                    prefetch_l2(t[i].row_lo + off + 64);
                    prefetch_l2(t[i].row_hi + off);
                    prefetch_l2(t[i].row_hi + off + 64);
                }
            }
        }
    }
    metrale::grid_dependency_sync();
    // A is staged by each warp after its first weight loads are out, so that its latency hides
    // behind theirs; a warp with no pieces never reads it.
    bool staged = false;
    const __half* a_row = a_s + (size_t)min((uint32_t)g, m - 1) * (k + A_PAD) + 16 * tg;
    for (uint32_t first = blockIdx.x * TILE; first < columns; first += gridDim.x * TILE) {
        Tile t[TILES];
        tiles(t, first, g, tg);
        float acc[TILES][4] = {};
        uint32_t p = warp;
        for (; p + (BATCH - 1) * WARPS < kb; p += BATCH * WARPS) {
            PieceLoad ld[TILES][BATCH];
#pragma unroll
            for (int u = 0; u < BATCH; ++u)
#pragma unroll
                for (int i = 0; i < TILES; ++i) ld[i][u] = load_piece(t[i], p + u * WARPS);
            if (!staged) {
                stage_a(a_s, a, m, k, warp, lane);
                staged = true;
            }
#pragma unroll
            for (int u = 0; u < BATCH; ++u)
#pragma unroll
                for (int i = 0; i < TILES; ++i) consume_piece(acc[i], ld[i][u], a_row, p + u * WARPS);
        }
        if (BATCH > 1 && p < kb) {
            PieceLoad ld[TILES];
#pragma unroll
            for (int i = 0; i < TILES; ++i) ld[i] = load_piece(t[i], p);
            if (!staged) {
                stage_a(a_s, a, m, k, warp, lane);
                staged = true;
            }
#pragma unroll
            for (int i = 0; i < TILES; ++i) consume_piece(acc[i], ld[i], a_row, p);
        }
#pragma unroll
        for (int i = 0; i < TILES; ++i)
            red[(warp * TILES + i) * 32 + lane] = make_float4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]);
        __syncthreads();
        if (threadIdx.x < TILE * 8) {
            // D[col][row] sits in lane (col % 8) * 4 + row / 2, element (col / 8) * 2 + row % 2.
            const uint32_t col = threadIdx.x >> 3, row = threadIdx.x & 7;
            const int src = (col & 7) * 4 + (row >> 1), e = (col >> 3) * 2 + (row & 1);
            float sum[TILES];
#pragma unroll
            for (int i = 0; i < TILES; ++i) {
                sum[i] = 0.0f;
                for (int v = 0; v < WARPS; ++v)
                    sum[i] += reinterpret_cast<const float*>(&red[(v * TILES + i) * 32 + src])[e];
            }
            if (row < m && first + col < columns) store(first + col, row, sum);
        }
        __syncthreads();
    }
}

__device__ __forceinline__ bool args_ok(const void* a, const void* w, uint32_t m, uint32_t k) {
    return m >= 1 && m <= 8 && k > 0 && k % PIECE_K == 0 &&
           ((reinterpret_cast<uintptr_t>(a) | reinterpret_cast<uintptr_t>(w)) & 15) == 0;
}

}  // namespace

// C = A * W^T (+ bias), bf16 out, W e4m3 with block scales, on the tensor cores. m = 1..8.
extern "C" __global__ void __launch_bounds__(256, 2) gemv_fp8_mma(
    __nv_bfloat16* __restrict__ c, const __nv_bfloat16* __restrict__ a,
    const uint8_t* __restrict__ w, const float* __restrict__ scales,
    const __nv_bfloat16* __restrict__ bias, uint32_t m, uint32_t n, uint32_t k, uint32_t row_shift) {
    if (!args_ok(a, w, m, k) || n == 0) {
        metrale::grid_dependency_sync();  // every kernel waits (common.cuh)
        return;
    }
    run_tiles<1>(
        a, m, n, k,
        [&](Tile (&t)[1], uint32_t first, int g, int tg) {
            t[0] = tile_at(w, scales, first, n - 1, k, row_shift, g, tg);
        },
        [&](uint32_t col, uint32_t row, const float (&sum)[1]) {
            const float b = bias != nullptr ? metrale::to_f32(bias[col]) : 0.0f;
            c[(size_t)row * n + col] = metrale::to_bf16(sum[0] + b);
        });
}

// The gate|up product over the fused [2 inter, k] e4m3 weight (gate rows first) with SiLU x up in
// its epilogue, as gemv_fp8_swiglu: out[m, inter] = bf16(silu(g) * u) of the bf16-rounded
// products. m = 1..8.
extern "C" __global__ void __launch_bounds__(256, 2) gemv_fp8_mma_swiglu(
    __nv_bfloat16* __restrict__ out, const __nv_bfloat16* __restrict__ a,
    const uint8_t* __restrict__ w, const float* __restrict__ scales, uint32_t m, uint32_t inter,
    uint32_t k, uint32_t row_shift) {
    if (!args_ok(a, w, m, k) || inter == 0) {
        metrale::grid_dependency_sync();
        return;
    }
    run_tiles<2>(
        a, m, inter, k,
        [&](Tile (&t)[2], uint32_t first, int g, int tg) {
            t[0] = tile_at(w, scales, first, inter - 1, k, row_shift, g, tg);
            t[1] = tile_at(w, scales, inter + first, 2 * inter - 1, k, row_shift, g, tg);
        },
        [&](uint32_t col, uint32_t row, const float (&sum)[2]) {
            const float gr = metrale::to_f32(metrale::to_bf16(sum[0]));
            const float ur = metrale::to_f32(metrale::to_bf16(sum[1]));
            out[(size_t)row * inter + col] = metrale::to_bf16(gr / (1.0f + __expf(-gr)) * ur);
        });
}
