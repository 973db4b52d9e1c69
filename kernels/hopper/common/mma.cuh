// SPDX-License-Identifier: MIT OR Apache-2.0
// Warp-level tensor-core pieces shared by the attention kernels: ldmatrix, mma.sync m16n8k16 on
// bf16 (and f16) with f32 accumulators, ex2, and bf16 pair packing and conversion.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

namespace metrale {

// Four 8x8 b16 matrices; lanes 8i..8i+7 give the row addresses of matrix i, and lane l receives
// elements (l / 4, 2 (l % 4)) and (l / 4, 2 (l % 4) + 1) of each matrix in r[i].
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

// The same, transposed: lane l receives elements (2 (l % 4), l / 4) and (2 (l % 4) + 1, l / 4).
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

// d += a (16x16, row) * b (16x8, col), bf16 inputs, f32 accumulators.
__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// d += a (16x16, row) * b (16x8, col), f16 inputs, f32 accumulators.
__device__ __forceinline__ void mma_f16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                        uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// A pair of bf16 (low half first) as a pair of f16, each rounded to nearest.
__device__ __forceinline__ uint32_t bf16x2_to_f16x2(uint32_t x) {
    const __half2 h = __floats2half2_rn(__uint_as_float(x << 16), __uint_as_float(x & 0xffff0000u));
    return *reinterpret_cast<const uint32_t*>(&h);
}

// 2^x on the SFU; 2^-inf = 0.
__device__ __forceinline__ float exp2_approx(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ uint32_t pack_bf16(__nv_bfloat162 v) {
    return *reinterpret_cast<uint32_t*>(&v);
}

// The end of an attention tile for one lane (g, tg) = (lane / 4, lane % 4) of a 16-row slice of
// f32 accumulators in the mma layout (rows r0 and r0 + 8, columns 8 d + 2 tg and + 1 of each of the
// HD / 8 n-tiles; acc(d, j) is the lane's accumulator j of n-tile d): the row sums l0 and l1, this
// lane's shares, are completed over the quad, and the rows are divided by them (a zero sum gives
// zeros) and stored as bf16 pairs to out[(first_token + row) * q_heads + head][HD]. Rows at or
// past `count` are not written.
template <int HD, typename Acc>
__device__ __forceinline__ void store_tile_rows(__nv_bfloat16* out, Acc acc, float l0, float l1,
                                                int r0, int count, int first_token,
                                                uint32_t q_heads, uint32_t head, int tg) {
#pragma unroll
    for (int off = 1; off <= 2; off <<= 1) {
        l0 += __shfl_xor_sync(0xffffffffu, l0, off);
        l1 += __shfl_xor_sync(0xffffffffu, l1, off);
    }
    const int r1 = r0 + 8;
    const float inv0 = l0 > 0.0f ? 1.0f / l0 : 0.0f, inv1 = l1 > 0.0f ? 1.0f / l1 : 0.0f;
    if (r0 < count) {
        __nv_bfloat16* dst = out + ((size_t)(first_token + r0) * q_heads + head) * HD + 2 * tg;
#pragma unroll
        for (int d = 0; d < HD / 8; ++d)
            *reinterpret_cast<__nv_bfloat162*>(dst + d * 8) =
                __floats2bfloat162_rn(acc(d, 0) * inv0, acc(d, 1) * inv0);
    }
    if (r1 < count) {
        __nv_bfloat16* dst = out + ((size_t)(first_token + r1) * q_heads + head) * HD + 2 * tg;
#pragma unroll
        for (int d = 0; d < HD / 8; ++d)
            *reinterpret_cast<__nv_bfloat162*>(dst + d * 8) =
                __floats2bfloat162_rn(acc(d, 2) * inv1, acc(d, 3) * inv1);
    }
}

}  // namespace metrale
