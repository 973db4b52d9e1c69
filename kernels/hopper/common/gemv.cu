// SPDX-License-Identifier: MIT OR Apache-2.0
// Skinny GEMM for decode: C[M, N] = A[M, K] * W[N, K]^T (+ bias), M <= 8 rows.
//
// At decode the weight is read once per step and every byte of it is used M times, so the kernel
// is a weight stream: one warp per output column n reads W's row n with 16-byte loads (8 bf16),
// multiplies it with every row of A (small, served from L1/L2) and reduces across the warp. Grid
// = ceil(N / 8) blocks of 8 warps. K not a multiple of 8 takes a scalar path (no vector loads on
// misaligned rows). f32 accumulation, one rounding at the output (none for the f32-output form
// the LM head uses).
// Launch: grid = ceil(N / 8), block = 256.
#include "common.cuh"

namespace {
constexpr int MAX_M = 8;
constexpr int WARPS = 8;
constexpr int UNROLL = 4;

__device__ __forceinline__ void fma8(float* acc, const uint4& w, const uint4& a) {
    const __nv_bfloat162* w2 = reinterpret_cast<const __nv_bfloat162*>(&w);
    const __nv_bfloat162* a2 = reinterpret_cast<const __nv_bfloat162*>(&a);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 wf = __bfloat1622float2(w2[i]);
        const float2 af = __bfloat1622float2(a2[i]);
        *acc = fmaf(wf.x, af.x, *acc);
        *acc = fmaf(wf.y, af.y, *acc);
    }
}
__device__ __forceinline__ void store(__nv_bfloat16* p, float v) { *p = metrale::to_bf16(v); }
__device__ __forceinline__ void store(float* p, float v) { *p = v; }

template <typename Out>
__device__ __forceinline__ void gemv(Out* __restrict__ c, const __nv_bfloat16* __restrict__ a,
                                     const __nv_bfloat16* __restrict__ w,
                                     const __nv_bfloat16* __restrict__ bias, uint32_t m,
                                     uint32_t n, uint32_t k) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const uint32_t col = blockIdx.x * WARPS + warp;
    if (col >= n || m > MAX_M) return;
    float acc[MAX_M];
#pragma unroll
    for (int r = 0; r < MAX_M; ++r) acc[r] = 0.0f;
    const __nv_bfloat16* wrow = w + (size_t)col * k;
    if (k % 8 == 0) {
        const uint4* w4 = reinterpret_cast<const uint4*>(wrow);
        const uint32_t chunks = k / 8;
        uint32_t i = lane;
        // Four independent 16-byte weight loads in flight per lane before any is used: at M = 1
        // a warp otherwise waits one full memory latency per 512 bytes.
        for (; i + 3 * 32 < chunks; i += 4 * 32) {
            uint4 wv[UNROLL];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) wv[u] = __ldg(w4 + i + u * 32);
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
#pragma unroll
                for (int r = 0; r < MAX_M; ++r) {
                    if (r < (int)m) {
                        const uint4 av =
                            __ldg(reinterpret_cast<const uint4*>(a + (size_t)r * k) + i + u * 32);
                        fma8(&acc[r], wv[u], av);
                    }
                }
            }
        }
        for (; i < chunks; i += 32) {
            const uint4 wv = __ldg(w4 + i);
#pragma unroll
            for (int r = 0; r < MAX_M; ++r) {
                if (r < (int)m) {
                    const uint4 av = __ldg(reinterpret_cast<const uint4*>(a + (size_t)r * k) + i);
                    fma8(&acc[r], wv, av);
                }
            }
        }
    } else {
        for (uint32_t i = lane; i < k; i += 32) {
            const float wv = metrale::to_f32(wrow[i]);
#pragma unroll
            for (int r = 0; r < MAX_M; ++r)
                if (r < (int)m) acc[r] = fmaf(wv, metrale::to_f32(a[(size_t)r * k + i]), acc[r]);
        }
    }
    const float b = bias != nullptr ? metrale::to_f32(bias[col]) : 0.0f;
#pragma unroll
    for (int r = 0; r < MAX_M; ++r) {
        if (r < (int)m) {
            const float v = metrale::warp_sum(acc[r]);
            if (lane == 0) store(&c[(size_t)r * n + col], v + b);
        }
    }
}
}  // namespace

extern "C" __global__ void __launch_bounds__(256) gemv_bf16(__nv_bfloat16* __restrict__ c,
                                                            const __nv_bfloat16* __restrict__ a,
                                                            const __nv_bfloat16* __restrict__ w,
                                                            const __nv_bfloat16* __restrict__ bias,
                                                            uint32_t m, uint32_t n, uint32_t k) {
    gemv(c, a, w, bias, m, n, k);
}

extern "C" __global__ void __launch_bounds__(256) gemv_bf16_f32out(
    float* __restrict__ c, const __nv_bfloat16* __restrict__ a,
    const __nv_bfloat16* __restrict__ w, const __nv_bfloat16* __restrict__ bias, uint32_t m,
    uint32_t n, uint32_t k) {
    gemv(c, a, w, bias, m, n, k);
}
