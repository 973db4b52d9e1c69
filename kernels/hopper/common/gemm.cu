// SPDX-License-Identifier: MIT OR Apache-2.0
// Dense GEMM with the weight in HF Linear layout: C[M, N] = A[M, K] * W[N, K]^T (+ bias[N]).
// bf16 inputs, f32 accumulation on tensor cores (WMMA 16x16x16), one rounding at the output.
//
// Version 1: the simplest tensor-core tiling that handles every shape. A block computes a 64x64
// tile of C with 4 warps (2x2, 32x32 each), stepping K by 32 through shared memory; loads outside
// M, N or K are zero-filled, so no shape needs padding. No pipelining yet: speed work is its own
// issue, this version is the correctness baseline the faster ones are checked against.
// Launch: grid = (ceil(N / 64), ceil(M / 64)), block = 128. `bias` may be null.
#include <mma.h>
#include "common.cuh"

namespace {

constexpr int BM = 64, BN = 64, BK = 32, PAD = 8;

template <typename OutT>
__device__ __forceinline__ OutT convert_out(float v);
template <>
__device__ __forceinline__ __nv_bfloat16 convert_out<__nv_bfloat16>(float v) { return metrale::to_bf16(v); }
template <>
__device__ __forceinline__ float convert_out<float>(float v) { return v; }

template <typename OutT>
__device__ void gemm_tile(OutT* __restrict__ c, const __nv_bfloat16* __restrict__ a,
                          const __nv_bfloat16* __restrict__ w, const __nv_bfloat16* __restrict__ bias,
                          uint32_t m, uint32_t n, uint32_t k) {
    using namespace nvcuda;
    __shared__ __align__(32) __nv_bfloat16 as[BM][BK + PAD];
    __shared__ __align__(32) __nv_bfloat16 ws[BN][BK + PAD];
    __shared__ __align__(32) float cs[BM][BN + 4];

    const uint32_t row0 = blockIdx.y * BM, col0 = blockIdx.x * BN;
    const int warp = threadIdx.x >> 5;
    const int wr = warp >> 1, wc = warp & 1;

    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[2][2];
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 2; ++j) wmma::fill_fragment(acc[i][j], 0.0f);

    const __nv_bfloat16 zero = metrale::to_bf16(0.0f);
    for (uint32_t k0 = 0; k0 < k; k0 += BK) {
        // 64 rows x 32 columns per operand, 16 elements per thread.
        for (int idx = threadIdx.x; idx < BM * BK; idx += blockDim.x) {
            const int r = idx / BK, cc = idx % BK;
            const uint32_t gk = k0 + cc;
            const uint32_t ar = row0 + r, wr_ = col0 + r;
            as[r][cc] = (ar < m && gk < k) ? a[(size_t)ar * k + gk] : zero;
            ws[r][cc] = (wr_ < n && gk < k) ? w[(size_t)wr_ * k + gk] : zero;
        }
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < BK; kk += 16) {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> fa[2];
            wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> fb[2];
#pragma unroll
            for (int i = 0; i < 2; ++i) wmma::load_matrix_sync(fa[i], &as[wr * 32 + i * 16][kk], BK + PAD);
            // W is [N, K] row-major, i.e. W^T is K x N column-major with leading dimension K.
#pragma unroll
            for (int j = 0; j < 2; ++j) wmma::load_matrix_sync(fb[j], &ws[wc * 32 + j * 16][kk], BK + PAD);
#pragma unroll
            for (int i = 0; i < 2; ++i)
#pragma unroll
                for (int j = 0; j < 2; ++j) wmma::mma_sync(acc[i][j], fa[i], fb[j], acc[i][j]);
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 2; ++j)
            wmma::store_matrix_sync(&cs[wr * 32 + i * 16][wc * 32 + j * 16], acc[i][j], BN + 4, wmma::mem_row_major);
    __syncthreads();
    for (int idx = threadIdx.x; idx < BM * BN; idx += blockDim.x) {
        const int r = idx / BN, cc = idx % BN;
        const uint32_t gr = row0 + r, gc = col0 + cc;
        if (gr < m && gc < n) {
            float v = cs[r][cc];
            if (bias != nullptr) v += metrale::to_f32(bias[gc]);
            c[(size_t)gr * n + gc] = convert_out<OutT>(v);
        }
    }
}

}  // namespace

extern "C" __global__ void __launch_bounds__(128) gemm_bf16(__nv_bfloat16* c, const __nv_bfloat16* a,
                                                            const __nv_bfloat16* w, const __nv_bfloat16* bias,
                                                            uint32_t m, uint32_t n, uint32_t k) {
    metrale::grid_dependency_sync();
    gemm_tile(c, a, w, bias, m, n, k);
}

// The same GEMM writing f32 (the LM head, whose logits feed the sampler).
extern "C" __global__ void __launch_bounds__(128) gemm_bf16_f32out(float* c, const __nv_bfloat16* a,
                                                                   const __nv_bfloat16* w, const __nv_bfloat16* bias,
                                                                   uint32_t m, uint32_t n, uint32_t k) {
    metrale::grid_dependency_sync();
    gemm_tile(c, a, w, bias, m, n, k);
}
