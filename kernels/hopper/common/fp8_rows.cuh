// SPDX-License-Identifier: MIT OR Apache-2.0
// The FP8 library product's activation rows (ops/fp8_gemm.rs): e4m3 values [round_up(M, 16), K]
// and an f32 scale per row and 128 columns, scale = amax / 448 over the block's bf16 values (1
// where that is not positive: an all-zero block), each value e4m3(x / scale) (IEEE division, round
// to nearest even, saturating: kv_fp8.cuh's conversions). The scales are k-block major with the
// row index fastest, in at most two row groups each [ceil(K / 128), rows] (row_scale below, the
// layout fp8_gemm.cu's header explains); rows past M up to the multiple of 16 are zero values with
// scale 1.
//
// Shared by every launch that writes these rows, so that all store the same bits from the same
// bf16 values: fp8_quantize_rows (fp8_gemm.cu) from bf16 activations in memory, and the producers
// that write their output in this form instead of bf16 (add_rmsnorm_f32res_fp8_rows in rmsnorm.cu,
// silu_mul_fp8_rows in activation.cu), each rounding its value to bf16 first as its bf16 form
// stores it.
#pragma once
#include <stdint.h>

#include "common.cuh"
#include "kv_fp8.cuh"

namespace metrale::fp8_rows {

// Columns a scale covers.
constexpr uint32_t SCALE_K = 128;
constexpr float E4M3_MAX = 448.0f;
// The row count a cuBLASLt block-scaled FP8 product takes a multiple of, and the longest product
// padded whole (ops/fp8_gemm.rs FP8_GEMM_ROW_GROUP, FP8_GEMM_PAD_ROWS).
constexpr uint32_t ROW_GROUP = 16;
constexpr uint32_t PAD_ROWS = 256;

// M rounded up to the row group: the rows written.
__device__ __forceinline__ uint32_t padded_rows(uint32_t m) {
    return (m + ROW_GROUP - 1) / ROW_GROUP * ROW_GROUP;
}

// The index of row `row`'s scale of k-block `kb` among M rows' scales (ops/fp8_gemm.rs
// fp8_row_scale): M a multiple of 16 is one group; M up to PAD_ROWS one group padded to 16; longer
// M is M rounded down to 16 rows, then the other M % 16 padded to 16.
__device__ __forceinline__ size_t row_scale(uint32_t row, uint32_t kb, uint32_t m,
                                            uint32_t kb_count) {
    const uint32_t main = m % ROW_GROUP == 0 ? m : (m <= PAD_ROWS ? 0 : m / ROW_GROUP * ROW_GROUP);
    if (row < main) return (size_t)kb * main + row;
    const uint32_t padded = padded_rows(m - main);
    return (size_t)kb_count * main + (size_t)kb * padded + (row - main);
}

// Element j (0..3) of four packed bf16 (element 0 in the low half of .x).
__device__ __forceinline__ __nv_bfloat16 element(uint2 x, int j) {
    const uint32_t word = j < 2 ? x.x : x.y;
    return __ushort_as_bfloat16((unsigned short)(j % 2 == 0 ? word & 0xffffu : word >> 16));
}

// Four bf16 packed as element() reads them.
__device__ __forceinline__ uint2 pack(const __nv_bfloat16 (&x)[4]) {
    const uint32_t b0 = __bfloat16_as_ushort(x[0]), b1 = __bfloat16_as_ushort(x[1]);
    const uint32_t b2 = __bfloat16_as_ushort(x[2]), b3 = __bfloat16_as_ushort(x[3]);
    return make_uint2(b0 | (b1 << 16), b2 | (b3 << 16));
}

// One row's 128-column block, a warp's worth: lane l holds the block's columns 4l..4l+3 as four
// bf16 `x` (packed as pack() does; zeros where the row has no such column). Stores the block's
// scale at scales[scale_at] (lane 0) and the e4m3 codes of the lane's first `valid` (0 to 4)
// columns at `dst`: one 4-byte store where `vector` (then valid is 4 and dst 4-byte aligned), else
// byte by byte. A warp-wide shuffle: every lane of the warp calls it.
__device__ __forceinline__ void store_block4(uint8_t* dst, float* scales, size_t scale_at, uint2 x,
                                             uint32_t valid, bool vector) {
    float amax = 0.0f;
#pragma unroll
    for (int j = 0; j < 4; ++j) amax = fmaxf(amax, fabsf(to_f32(element(x, j))));
    amax = warp_max(amax);
    float scale = __fdiv_rn(amax, E4M3_MAX);
    if (!(amax > 0.0f && scale > 0.0f)) scale = 1.0f;
    if ((threadIdx.x & 31) == 0) scales[scale_at] = scale;
    if (vector) {
        *reinterpret_cast<uint32_t*>(dst) = kv_fp8::quantize4(x, scale);
    } else {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            if ((uint32_t)j < valid) dst[j] = kv_fp8::quantize1(element(x, j), scale);
        }
    }
}

// The columns of a row of `k` that a lane whose four start at `col` holds (0 to 4).
__device__ __forceinline__ uint32_t valid_columns(uint32_t col, uint32_t k) {
    return col >= k ? 0u : min(4u, k - col);
}

}  // namespace metrale::fp8_rows
