// SPDX-License-Identifier: MIT OR Apache-2.0
// The four-column pieces of the residual add + RMSNorm, shared by add_rmsnorm_f32res (rmsnorm.cu)
// and the GEMV entries that normalise their own input (gemv.cu, gemv_stream.cu), so that all compute
// the same bits: a thread sums the squares of its pieces in column order, 4 columns at a time.
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

// The scale a norm weight applies: offset + w in f32 (Qwen3-Next's norms keep their weight
// centred on zero and scale by 1 + weight). An offset of 0 leaves w as it is, -0.0 included, so a
// norm without one computes the bits it computed before the offset existed.
__device__ __forceinline__ float norm_scale(float w, float offset) {
    return offset == 0.0f ? w : offset + w;
}

// bf16(v * inv * (offset + w)) of four columns, packed (norm_scale).
__device__ __forceinline__ uint2 scaled4(float4 v, float inv, uint2 wv, float offset) {
    float4 w = widen4(wv);
    w.x = norm_scale(w.x, offset);
    w.y = norm_scale(w.y, offset);
    w.z = norm_scale(w.z, offset);
    w.w = norm_scale(w.w, offset);
    const __nv_bfloat162 lo = __floats2bfloat162_rn(v.x * inv * w.x, v.y * inv * w.y);
    const __nv_bfloat162 hi = __floats2bfloat162_rn(v.z * inv * w.z, v.w * inv * w.w);
    uint2 o;
    o.x = *reinterpret_cast<const uint32_t*>(&lo);
    o.y = *reinterpret_cast<const uint32_t*>(&hi);
    return o;
}

// bf16(v * inv * w) of four columns, packed: scaled4 without an offset (the normalising GEMVs).
__device__ __forceinline__ uint2 scaled4(float4 v, float inv, uint2 wv) {
    return scaled4(v, inv, wv, 0.0f);
}

// The row's inverse RMS from the threads' sums of squares (a block-wide reduction).
__device__ __forceinline__ float inverse_rms(float sq, uint32_t cols, float eps, float* scratch) {
    return rsqrtf(block_sum(sq, scratch) / (float)cols + eps);
}

__device__ __forceinline__ bool aligned(const void* p, uintptr_t bytes) {
    return (reinterpret_cast<uintptr_t>(p) & (bytes - 1)) == 0;
}

// The input of the GEMV entries that normalise their own A (gemv.cu's gemv_bf16_norm and
// gemv_bf16_swiglu_norm, gemv_stream.cu's _norm entries): A is bf16(rmsnorm(residual + input) *
// weight) row by row, computed as add_rmsnorm_f32res computes it.
struct NormInput {
    const float* residual;         // f32 [m, k]
    float* residual_out;           // f32 [m, k]: residual + input, stored by block 0; 16-byte
                                   // aligned where `residual` is, or the rows take the scalar
                                   // path, which add_rmsnorm_f32res would not take
    const __nv_bfloat16* input;    // bf16 [m, k], or null (nothing added)
    const __nv_bfloat16* weight;   // bf16 [k]
    float eps;
};

// Fills the block's shared-memory A ([M, k] bf16) from `in`; block 0 also stores the f32 sums to
// in.residual_out (which must not alias in.residual: the other blocks still read it). The pieces,
// the per-thread order of the sums of squares and the reduction are add_rmsnorm_f32res's at 256
// threads (above), so A has the bits that kernel's output would have. `scratch` takes the
// reduction (32 floats). Whole block; ends with a barrier.
template <int M>
__device__ __forceinline__ void normalise_input(__nv_bfloat16* a, const NormInput& in, uint32_t k,
                                                float* scratch) {
    constexpr int UNROLL = 4;  // add_rmsnorm_f32res's pieces per thread in one pass
    const uint32_t step = blockDim.x;
    const bool keep = blockIdx.x == 0;
#pragma unroll 1
    for (int r = 0; r < M; ++r) {
        const float* res = in.residual + (size_t)r * k;
        float* out_res = in.residual_out + (size_t)r * k;
        const __nv_bfloat16* x = in.input == nullptr ? nullptr : in.input + (size_t)r * k;
        __nv_bfloat16* y = a + (size_t)r * k;
        float sq = 0.0f;
        const bool vec = k % 4 == 0 && aligned(res, 16) && aligned(out_res, 16) &&
                         aligned(in.weight, 8) && (x == nullptr || aligned(x, 8));
        if (vec) {
            const uint32_t n4 = k / 4;
            const float4* res4 = reinterpret_cast<const float4*>(res);
            float4* keep4 = reinterpret_cast<float4*>(out_res);
            const uint2* x4 = reinterpret_cast<const uint2*>(x);
            const uint2* w4 = reinterpret_cast<const uint2*>(in.weight);
            uint2* y4 = reinterpret_cast<uint2*>(y);
            if (n4 <= step * UNROLL) {
                // The row in one pass from registers (Qwen3's 1024 and 4096 columns).
                float4 v[UNROLL];
                uint2 xv[UNROLL], wv[UNROLL];
#pragma unroll
                for (int u = 0; u < UNROLL; ++u) {
                    const uint32_t i = threadIdx.x + u * step;
                    if (i < n4) {
                        v[u] = res4[i];
                        if (x != nullptr) xv[u] = x4[i];
                        wv[u] = w4[i];
                    }
                }
#pragma unroll
                for (int u = 0; u < UNROLL; ++u) {
                    const uint32_t i = threadIdx.x + u * step;
                    if (i < n4) {
                        if (x != nullptr) add4(v[u], xv[u]);
                        if (keep) keep4[i] = v[u];
                        sq = add_squares4(sq, v[u]);
                    }
                }
                const float inv = inverse_rms(sq, k, in.eps, scratch);
#pragma unroll
                for (int u = 0; u < UNROLL; ++u) {
                    const uint32_t i = threadIdx.x + u * step;
                    if (i < n4) y4[i] = scaled4(v[u], inv, wv[u]);
                }
            } else {
                // Longer rows: the sums of squares, then the sums again (the same f32 adds).
                for (uint32_t i = threadIdx.x; i < n4; i += step) {
                    float4 v = res4[i];
                    if (x != nullptr) add4(v, x4[i]);
                    if (keep) keep4[i] = v;
                    sq = add_squares4(sq, v);
                }
                const float inv = inverse_rms(sq, k, in.eps, scratch);
                for (uint32_t i = threadIdx.x; i < n4; i += step) {
                    float4 v = res4[i];
                    if (x != nullptr) add4(v, x4[i]);
                    y4[i] = scaled4(v, inv, w4[i]);
                }
            }
        } else {
            for (uint32_t i = threadIdx.x; i < k; i += step) {
                float v = res[i];
                if (x != nullptr) v += to_f32(x[i]);
                if (keep) out_res[i] = v;
                sq += v * v;
            }
            const float inv = inverse_rms(sq, k, in.eps, scratch);
            for (uint32_t i = threadIdx.x; i < k; i += step) {
                float v = res[i];
                if (x != nullptr) v += to_f32(x[i]);
                y[i] = to_bf16(v * inv * to_f32(in.weight[i]));
            }
        }
    }
    __syncthreads();
}

}  // namespace metrale
