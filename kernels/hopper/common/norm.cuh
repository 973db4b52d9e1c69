// SPDX-License-Identifier: MIT OR Apache-2.0
// The four-column pieces of the residual add + RMSNorm, shared by add_rmsnorm_f32res (rmsnorm.cu)
// and the GEMV entries that normalise their own input (gemv.cu), so that both compute the same
// bits: a thread sums the squares of its pieces in column order, 4 columns at a time.
#pragma once
#include "common.cuh"

namespace metrale {

// Four bf16 columns, widened exactly.
__device__ __forceinline__ float4 widen4(uint2 v) {
    const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&v.x));
    const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&v.y));
    return make_float4(a.x, a.y, b.x, b.y);
}

__device__ __forceinline__ void add4(float4& v, uint2 x) {
    const float4 a = widen4(x);
    v.x += a.x;
    v.y += a.y;
    v.z += a.z;
    v.w += a.w;
}

// A thread's running sum of squares after one more piece.
__device__ __forceinline__ float add_squares4(float sq, float4 v) {
    return sq + (v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w);
}

// bf16(v * inv * w) of four columns, packed.
__device__ __forceinline__ uint2 scaled4(float4 v, float inv, uint2 wv) {
    const float4 w = widen4(wv);
    const __nv_bfloat162 lo = __floats2bfloat162_rn(v.x * inv * w.x, v.y * inv * w.y);
    const __nv_bfloat162 hi = __floats2bfloat162_rn(v.z * inv * w.z, v.w * inv * w.w);
    uint2 o;
    o.x = *reinterpret_cast<const uint32_t*>(&lo);
    o.y = *reinterpret_cast<const uint32_t*>(&hi);
    return o;
}

// The row's inverse RMS from the threads' sums of squares (a block-wide reduction).
__device__ __forceinline__ float inverse_rms(float sq, uint32_t cols, float eps, float* scratch) {
    return rsqrtf(block_sum(sq, scratch) / (float)cols + eps);
}

__device__ __forceinline__ bool aligned(const void* p, uintptr_t bytes) {
    return (reinterpret_cast<uintptr_t>(p) & (bytes - 1)) == 0;
}

}  // namespace metrale
