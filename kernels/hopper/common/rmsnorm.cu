// SPDX-License-Identifier: MIT OR Apache-2.0
// RMSNorm, and the fused residual add + RMSNorm of a pre-norm decoder.
//
// Rounding follows the HF reference exactly: the row is normalised in f32, rounded to bf16, then
// multiplied by the bf16 weight and rounded again; the residual add rounds to bf16 before the norm.
// Launch: grid = rows, block = 256 (any multiple of 32 up to 1024), no dynamic shared memory.
#include "common.cuh"

// out[r, :] = bf16(bf16(x * rsqrt(mean(x^2) + eps)) * weight)
extern "C" __global__ void rmsnorm_bf16(__nv_bfloat16* __restrict__ out,
                                        const __nv_bfloat16* __restrict__ input,
                                        const __nv_bfloat16* __restrict__ weight, uint32_t rows,
                                        uint32_t cols, float eps) {
    __shared__ float scratch[32];
    const uint32_t r = blockIdx.x;
    if (r >= rows) return;
    const __nv_bfloat16* x = input + (size_t)r * cols;
    float sq = 0.0f;
    for (uint32_t i = threadIdx.x; i < cols; i += blockDim.x) {
        const float v = metrale::to_f32(x[i]);
        sq += v * v;
    }
    const float inv = rsqrtf(metrale::block_sum(sq, scratch) / (float)cols + eps);
    __nv_bfloat16* y = out + (size_t)r * cols;
    for (uint32_t i = threadIdx.x; i < cols; i += blockDim.x) {
        const float normed = metrale::to_f32(metrale::to_bf16(metrale::to_f32(x[i]) * inv));
        y[i] = metrale::to_bf16(normed * metrale::to_f32(weight[i]));
    }
}

// residual[r, :] = bf16(residual + input); out[r, :] = rmsnorm(residual[r, :]).
// `residual` is updated in place; `out` must not alias it.
extern "C" __global__ void add_rmsnorm_bf16(__nv_bfloat16* __restrict__ out,
                                            __nv_bfloat16* __restrict__ residual,
                                            const __nv_bfloat16* __restrict__ input,
                                            const __nv_bfloat16* __restrict__ weight,
                                            uint32_t rows, uint32_t cols, float eps) {
    __shared__ float scratch[32];
    const uint32_t r = blockIdx.x;
    if (r >= rows) return;
    __nv_bfloat16* res = residual + (size_t)r * cols;
    const __nv_bfloat16* x = input + (size_t)r * cols;
    float sq = 0.0f;
    for (uint32_t i = threadIdx.x; i < cols; i += blockDim.x) {
        const __nv_bfloat16 s = metrale::to_bf16(metrale::to_f32(res[i]) + metrale::to_f32(x[i]));
        res[i] = s;
        const float v = metrale::to_f32(s);
        sq += v * v;
    }
    const float inv = rsqrtf(metrale::block_sum(sq, scratch) / (float)cols + eps);
    __nv_bfloat16* y = out + (size_t)r * cols;
    // Each thread re-reads only the elements it wrote itself, so no barrier is needed here.
    for (uint32_t i = threadIdx.x; i < cols; i += blockDim.x) {
        const float normed = metrale::to_f32(metrale::to_bf16(metrale::to_f32(res[i]) * inv));
        y[i] = metrale::to_bf16(normed * metrale::to_f32(weight[i]));
    }
}
