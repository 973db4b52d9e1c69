// SPDX-License-Identifier: MIT OR Apache-2.0
// The FP8 prefill product's own launches (issue 32, part 2): C[M, N] = A[M, K] * W[N, K]^T (+ bias)
// with both operands in e4m3 and f32 block scales, for cuBLASLt's block-scaled FP8 matmul
// (A: CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F, W: CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F).
//
// fp8_quantize_rows: bf16 activations [M, K] -> e4m3 [M, K] and a scale per row and 128 columns,
// scale = amax / 448 (1 where that is not positive: an all-zero block), each element
// e4m3(x / scale) (IEEE division, round to nearest even, saturating: kv_fp8.cuh's conversions).
// The scales are written k-block major with the row index fastest: the "outer-dim-major"
// [rows, ceil(K / 128)] layout the VEC128 mode reads (the M-contiguous layout torch._scaled_mm
// asks of its 1x128 operand). cuBLASLt's block-scaled FP8 takes row counts that are multiples of
// 16 only, so the rows come in at most two groups, each a product of its own and each
// [ceil(K / 128), rows] with the row index fastest: M a multiple of 16 is one group; M up to
// PAD_ROWS (256) is one group padded with zero rows to a multiple of 16; longer M is M rounded
// down to 16 (MAIN) rows, then the other M % 16 padded to 16 (ops/fp8_gemm.rs fp8_rows_split).
// The zero rows' values are 0 and their scales 1. fp8_rows.cuh (shared with the producers that
// write these rows themselves) holds the index (row_scale) and the per-block quantization.
// Launch: one warp per (row, 128-column block) over the padded rows, 8 warps a block:
// grid = ceil(round_up(M, 16) * ceil(K / 128) / 8), block = 256.
//
// gemm_fp8_block_scaled: the same product without the library (backends where cuBLASLt is absent):
// one thread per output element, per 128-column block an f32 dot of the e4m3 values, times the two
// scales, summed in f32; one bf16 rounding at the output. Simple, not fast: the engine takes the
// FP8 product only with cuBLASLt present in measured runs. W's scales are Fp8Tensor's
// [ceil(N / 128), ceil(K / 128)] row-major. Launch: grid = (ceil(N / 16), ceil(M / 16)),
// block = (16, 16).
#include <cuda_fp8.h>

#include "common.cuh"
#include "fp8_rows.cuh"

namespace {

using metrale::fp8_rows::SCALE_K;
using metrale::fp8_rows::padded_rows;
// The index of row `row`'s scale of k-block `kb` among M rows' scales (the header's layout).
using metrale::fp8_rows::row_scale;

}  // namespace

extern "C" __global__ void __launch_bounds__(256) fp8_quantize_rows(
    uint8_t* __restrict__ q, float* __restrict__ scales, const __nv_bfloat16* __restrict__ a,
    uint32_t m, uint32_t k) {
    metrale::grid_dependency_sync();
    const uint32_t lane = threadIdx.x % 32;
    const uint32_t kb_count = (k + SCALE_K - 1) / SCALE_K;
    const size_t item = (size_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    const uint32_t padded = padded_rows(m);
    if (item >= (size_t)padded * kb_count) return;
    const uint32_t row = (uint32_t)(item / kb_count), kb = (uint32_t)(item % kb_count);
    const bool real = row < m;  // else a zero row of the last group
    // Each lane takes 4 consecutive columns of the block: one 8-byte load and one 4-byte store
    // where K is a multiple of 4 and the bases are aligned (rows then stay aligned), else element
    // by element.
    const uint32_t col = kb * SCALE_K + lane * 4;
    const __nv_bfloat16* src = a + (size_t)row * k + col;
    const bool aligned = ((uintptr_t)a % 8 == 0) && ((uintptr_t)q % 4 == 0);
    const bool vector = aligned && (k % 4 == 0) && col + 4 <= k;
    uint2 v = make_uint2(0, 0);
    if (real && vector) {
        v = *reinterpret_cast<const uint2*>(src);
    } else if (real) {
        __nv_bfloat16 x[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) x[j] = col + j < k ? src[j] : __float2bfloat16_rn(0.0f);
        v = metrale::fp8_rows::pack(x);
    }
    metrale::fp8_rows::store_block4(q + (size_t)row * k + col, scales,
                                    row_scale(row, kb, m, kb_count), v,
                                    metrale::fp8_rows::valid_columns(col, k), vector);
}

extern "C" __global__ void __launch_bounds__(256) gemm_fp8_block_scaled(
    __nv_bfloat16* __restrict__ c, const uint8_t* __restrict__ a,
    const float* __restrict__ a_scales, const uint8_t* __restrict__ w,
    const float* __restrict__ w_scales, const __nv_bfloat16* __restrict__ bias, uint32_t m,
    uint32_t n, uint32_t k) {
    metrale::grid_dependency_sync();
    const uint32_t col = blockIdx.x * 16 + threadIdx.x, row = blockIdx.y * 16 + threadIdx.y;
    if (row >= m || col >= n) return;
    const uint32_t kb_count = (k + SCALE_K - 1) / SCALE_K;
    const uint8_t* ar = a + (size_t)row * k;
    const uint8_t* wr = w + (size_t)col * k;
    float acc = 0.0f;
    for (uint32_t kb = 0; kb < kb_count; ++kb) {
        const uint32_t end = min(k, (kb + 1) * SCALE_K);
        float dot = 0.0f;
        for (uint32_t i = kb * SCALE_K; i < end; ++i) {
            const __half_raw ha = __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)ar[i], __NV_E4M3);
            const __half_raw hw = __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)wr[i], __NV_E4M3);
            dot = fmaf(__half2float(__half(ha)), __half2float(__half(hw)), dot);
        }
        acc = fmaf(dot, a_scales[row_scale(row, kb, m, kb_count)] * w_scales[(size_t)(col / SCALE_K) * kb_count + kb], acc);
    }
    if (bias != nullptr) acc += metrale::to_f32(bias[col]);
    c[(size_t)row * n + col] = metrale::to_bf16(acc);
}
