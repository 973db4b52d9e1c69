// SPDX-License-Identifier: MIT OR Apache-2.0
// Decode products over FP8 (E4M3) weights with f32 block scales: C[M, N] = A[M, K] * W[N, K]^T
// (+ bias), M <= 8 rows, A bf16, W e4m3 with scales[ceil(N / 2^row_shift), ceil(K / 128)]
// (row_shift 7: a scale per 128 x 128 block; 0: a scale per row and 128 columns), the weight
// being e4m3 x its block's scale. The weight is dequantised in registers (cvt e4m3x2 -> f16x2,
// exact, then f32) and accumulated in f32; one rounding at the output.
//
// A weight stream, as gemv.cu's FMA form: one output column per warp, each lane streaming 16-byte
// chunks (16 weights) of the column's row, BATCH = 8 loads in flight per lane (4 KiB per warp),
// L1-no-allocate. An FP8 row of 4096 inputs is 4 KiB: one batch. A 16-element chunk starts at a
// multiple of 16, so it lies inside one 128-column block and takes one scale: the lane forms the
// chunk's 16 products per row of A, then adds them times the scale (sum_j w_j a_j * s = sum_j
// (w_j s) a_j up to f32 rounding). A is 32 bytes per chunk and row, read through L1 (every warp of
// the block re-reads it). K not a multiple of 16 (or W / A misaligned) takes a scalar loop.
// Arithmetic per 16 weight bytes and row: 8 cvt + 16 f16->f32 + 16 FMA + 1: issue-bound beyond
// 3-4 rows as gemv.cu's FMA form is; a tensor-core form for 5-8 rows is part 2's (with wgmma e4m3).
// Launch: grid = ceil(N / 8) (gemv_fp8_swiglu: ceil(inter / 8)), block = 256; a smaller grid is
// covered by a block-stride loop.
#include "common.cuh"
#include "e4m3.cuh"

namespace {

using metrale::e4m3;
using metrale::e4m3x2;

constexpr int WARPS = 8;
// 16-byte weight loads each lane has in flight: 8 (4 KiB a warp) up to 2 rows; fewer above, where
// the rows' accumulators and A pieces take the registers (BATCH in column_dot; 8 spilled at 80
// registers from 3 rows up). 2 KiB a warp at 24 warps an SM is still ~48 KiB in flight per SM.
// From 5 rows ptxas still spills ~100 bytes (the rows of A in flight): part 2 gives 5-8 rows a
// tensor-core form.
constexpr uint32_t BLOCK_K = 128;

__device__ __forceinline__ uint4 load_stream(const uint4* p) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
    return v;
}

__device__ __forceinline__ float lo(uint32_t v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float hi(uint32_t v) { return __uint_as_float(v & 0xffff0000u); }

__device__ __forceinline__ float swiglu(float g, float u) { return g / (1.0f + __expf(-g)) * u; }

// acc[r] += scale * (16 weights of wv) . (A row r's 16 elements at chunk `chunk`).
template <int M>
__device__ __forceinline__ void fma_chunk(float (&acc)[M], const uint4& wv, float scale,
                                          const uint4* __restrict__ a, uint32_t a_row_pieces,
                                          uint32_t chunk) {
    float w[16];
    const uint32_t words[4] = {wv.x, wv.y, wv.z, wv.w};
#pragma unroll
    for (int q = 0; q < 4; ++q) {
        const float2 p0 = e4m3x2(words[q]), p1 = e4m3x2(words[q] >> 16);
        w[4 * q] = p0.x;
        w[4 * q + 1] = p0.y;
        w[4 * q + 2] = p1.x;
        w[4 * q + 3] = p1.y;
    }
#pragma unroll
    for (int r = 0; r < M; ++r) {
        const uint4 a0 = __ldg(a + (size_t)r * a_row_pieces + 2 * chunk);
        const uint4 a1 = __ldg(a + (size_t)r * a_row_pieces + 2 * chunk + 1);
        const uint32_t x[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
        float s0 = 0.0f, s1 = 0.0f;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            s0 = fmaf(w[2 * j], lo(x[j]), s0);
            s1 = fmaf(w[2 * j + 1], hi(x[j]), s1);
        }
        acc[r] = fmaf(s0 + s1, scale, acc[r]);
    }
}

// out[r] = sum over K of W[row, :] . A[r, :] (dequantised), on every lane. Warp-uniform.
template <int M>
__device__ __forceinline__ void column_dot(float (&out)[M], const uint8_t* __restrict__ w,
                                           const float* __restrict__ scales,
                                           const __nv_bfloat16* __restrict__ a, uint32_t row,
                                           uint32_t k, uint32_t row_shift, bool vec, int lane) {
    float acc[M];
#pragma unroll
    for (int r = 0; r < M; ++r) acc[r] = 0.0f;
    const uint32_t kb = (k + BLOCK_K - 1) / BLOCK_K;
    const float* srow = scales + (size_t)(row >> row_shift) * kb;
    const uint8_t* wrow = w + (size_t)row * k;
    constexpr int BATCH = M <= 2 ? 8 : 4;
    if (vec) {
        const uint32_t chunks = k / 16;
        const uint4* w4 = reinterpret_cast<const uint4*>(wrow);
        const uint4* a4 = reinterpret_cast<const uint4*>(a);
        const uint32_t a_pieces = k / 8;
        uint32_t i = 0;
        for (; i + 32 * BATCH <= chunks; i += 32 * BATCH) {
            uint4 wv[BATCH];
#pragma unroll
            for (int u = 0; u < BATCH; ++u) wv[u] = load_stream(w4 + i + lane + 32 * u);
#pragma unroll
            for (int u = 0; u < BATCH; ++u) {
                const uint32_t c = i + lane + 32 * u;
                fma_chunk<M>(acc, wv[u], __ldg(srow + c / 8), a4, a_pieces, c);
            }
        }
        if (i < chunks) {
            // The rest, fewer than BATCH chunks per lane: predicated loads, all issued first.
            uint4 wv[BATCH];
#pragma unroll
            for (int u = 0; u < BATCH; ++u) {
                const uint32_t c = i + lane + 32 * u;
                wv[u] = c < chunks ? load_stream(w4 + c) : make_uint4(0, 0, 0, 0);
            }
#pragma unroll
            for (int u = 0; u < BATCH; ++u) {
                const uint32_t c = i + lane + 32 * u;
                if (c < chunks) fma_chunk<M>(acc, wv[u], __ldg(srow + c / 8), a4, a_pieces, c);
            }
        }
    } else {
        for (uint32_t e = lane; e < k; e += 32) {
            const float wf = e4m3(wrow[e]) * __ldg(srow + e / BLOCK_K);
#pragma unroll
            for (int r = 0; r < M; ++r)
                acc[r] = fmaf(wf, metrale::to_f32(a[(size_t)r * k + e]), acc[r]);
        }
    }
#pragma unroll
    for (int r = 0; r < M; ++r) out[r] = metrale::warp_sum(acc[r]);
}

__device__ __forceinline__ bool vector_ok(const void* a, const void* w, uint32_t k) {
    return k % 16 == 0 && ((reinterpret_cast<uintptr_t>(a) | reinterpret_cast<uintptr_t>(w)) & 15) == 0;
}

template <int M>
__device__ void gemv_rows(__nv_bfloat16* __restrict__ c, const __nv_bfloat16* __restrict__ a,
                          const uint8_t* __restrict__ w, const float* __restrict__ scales,
                          const __nv_bfloat16* __restrict__ bias, uint32_t n, uint32_t k,
                          uint32_t row_shift) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const bool vec = vector_ok(a, w, k);
    for (uint32_t col = blockIdx.x * WARPS + warp; col < n; col += gridDim.x * WARPS) {
        float out[M];
        column_dot<M>(out, w, scales, a, col, k, row_shift, vec, lane);
        if (lane == 0) {
            const float b = bias != nullptr ? metrale::to_f32(bias[col]) : 0.0f;
#pragma unroll
            for (int r = 0; r < M; ++r) c[(size_t)r * n + col] = metrale::to_bf16(out[r] + b);
        }
    }
}

// Output column j of [M, inter]: gate row j and up row inter + j, each rounded to bf16, then
// bf16(silu(g) * u) (silu_mul_bf16's formula on what gemv_fp8 would store).
template <int M>
__device__ void swiglu_rows(__nv_bfloat16* __restrict__ out, const __nv_bfloat16* __restrict__ a,
                            const uint8_t* __restrict__ w, const float* __restrict__ scales,
                            uint32_t inter, uint32_t k, uint32_t row_shift) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const bool vec = vector_ok(a, w, k);
    for (uint32_t col = blockIdx.x * WARPS + warp; col < inter; col += gridDim.x * WARPS) {
        float g[M], u[M];
        column_dot<M>(g, w, scales, a, col, k, row_shift, vec, lane);
        column_dot<M>(u, w, scales, a, inter + col, k, row_shift, vec, lane);
        if (lane == 0) {
#pragma unroll
            for (int r = 0; r < M; ++r) {
                const float gr = metrale::to_f32(metrale::to_bf16(g[r]));
                const float ur = metrale::to_f32(metrale::to_bf16(u[r]));
                out[(size_t)r * inter + col] = metrale::to_bf16(swiglu(gr, ur));
            }
        }
    }
}

}  // namespace

// C = A * W^T (+ bias), bf16 out, W e4m3 with block scales. m = 1..8 (other m: nothing).
extern "C" __global__ void __launch_bounds__(256, 3) gemv_fp8(
    __nv_bfloat16* __restrict__ c, const __nv_bfloat16* __restrict__ a,
    const uint8_t* __restrict__ w, const float* __restrict__ scales,
    const __nv_bfloat16* __restrict__ bias, uint32_t m, uint32_t n, uint32_t k, uint32_t row_shift) {
    metrale::grid_dependency_sync();
    switch (m) {
        case 1: gemv_rows<1>(c, a, w, scales, bias, n, k, row_shift); break;
        case 2: gemv_rows<2>(c, a, w, scales, bias, n, k, row_shift); break;
        case 3: gemv_rows<3>(c, a, w, scales, bias, n, k, row_shift); break;
        case 4: gemv_rows<4>(c, a, w, scales, bias, n, k, row_shift); break;
        case 5: gemv_rows<5>(c, a, w, scales, bias, n, k, row_shift); break;
        case 6: gemv_rows<6>(c, a, w, scales, bias, n, k, row_shift); break;
        case 7: gemv_rows<7>(c, a, w, scales, bias, n, k, row_shift); break;
        case 8: gemv_rows<8>(c, a, w, scales, bias, n, k, row_shift); break;
        default: break;  // the host reference refuses m > 8
    }
}

// The gate|up product over the fused [2 inter, k] e4m3 weight (gate rows first) with SiLU x up in
// its epilogue: out[m, inter] = bf16(silu(g) * u) of the bf16-rounded products. m = 1..8.
extern "C" __global__ void __launch_bounds__(256, 3) gemv_fp8_swiglu(
    __nv_bfloat16* __restrict__ out, const __nv_bfloat16* __restrict__ a,
    const uint8_t* __restrict__ w, const float* __restrict__ scales, uint32_t m, uint32_t inter,
    uint32_t k, uint32_t row_shift) {
    metrale::grid_dependency_sync();
    switch (m) {
        case 1: swiglu_rows<1>(out, a, w, scales, inter, k, row_shift); break;
        case 2: swiglu_rows<2>(out, a, w, scales, inter, k, row_shift); break;
        case 3: swiglu_rows<3>(out, a, w, scales, inter, k, row_shift); break;
        case 4: swiglu_rows<4>(out, a, w, scales, inter, k, row_shift); break;
        case 5: swiglu_rows<5>(out, a, w, scales, inter, k, row_shift); break;
        case 6: swiglu_rows<6>(out, a, w, scales, inter, k, row_shift); break;
        case 7: swiglu_rows<7>(out, a, w, scales, inter, k, row_shift); break;
        case 8: swiglu_rows<8>(out, a, w, scales, inter, k, row_shift); break;
        default: break;
    }
}

// out[n, k] = bf16(e4m3 x scale) of every weight: the FP8 product's library path dequantises into
// a scratch weight the BF16 GEMM then reads (part 1; the e4m3 tensor-core GEMM replaces it).
// Each thread takes 16 weights (k % 16 == 0, aligned) or one (otherwise), grid-stride.
// Launch: grid = ceil(n * k / 16 / 256) (one per weight with the scalar form), block = 256.
extern "C" __global__ void __launch_bounds__(256) fp8_dequant_bf16(
    __nv_bfloat16* __restrict__ out, const uint8_t* __restrict__ w,
    const float* __restrict__ scales, uint32_t n, uint32_t k, uint32_t row_shift) {
    metrale::grid_dependency_sync();
    const uint32_t kb = (k + BLOCK_K - 1) / BLOCK_K;
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    if (vector_ok(out, w, k)) {
        const size_t chunks = (size_t)n * k / 16;
        for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < chunks; i += stride) {
            const uint32_t row = (uint32_t)(i * 16 / k), col = (uint32_t)(i * 16 % k);
            const float s = __ldg(scales + (size_t)(row >> row_shift) * kb + col / BLOCK_K);
            const uint4 wv = __ldg(reinterpret_cast<const uint4*>(w) + i);
            const uint32_t words[4] = {wv.x, wv.y, wv.z, wv.w};
            uint32_t packed[8];
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const float2 p0 = e4m3x2(words[q]), p1 = e4m3x2(words[q] >> 16);
                const __nv_bfloat162 b0 = __floats2bfloat162_rn(p0.x * s, p0.y * s);
                const __nv_bfloat162 b1 = __floats2bfloat162_rn(p1.x * s, p1.y * s);
                packed[2 * q] = *reinterpret_cast<const uint32_t*>(&b0);
                packed[2 * q + 1] = *reinterpret_cast<const uint32_t*>(&b1);
            }
            uint4* dst = reinterpret_cast<uint4*>(out) + 2 * i;
            dst[0] = make_uint4(packed[0], packed[1], packed[2], packed[3]);
            dst[1] = make_uint4(packed[4], packed[5], packed[6], packed[7]);
        }
    } else {
        const size_t total = (size_t)n * k;
        for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
            const uint32_t row = (uint32_t)(i / k), col = (uint32_t)(i % k);
            const float s = __ldg(scales + (size_t)(row >> row_shift) * kb + col / BLOCK_K);
            out[i] = metrale::to_bf16(e4m3(w[i]) * s);
        }
    }
}
