// SPDX-License-Identifier: MIT OR Apache-2.0
// RMSNorm, and the fused residual add + RMSNorm of a pre-norm decoder.
//
// Precision: the residual stream is f32 and every sum into it is exact f32 arithmetic; a norm's
// output is computed in f32 and rounded to bf16 once, as the input of the next GEMM. Rounding the
// residual to bf16 after every add (as a bf16 PyTorch model does) is the largest source of error
// against the f32 function of the same bf16 weights; see docs/precision.md.
// Launch: grid = rows, block = 256 (any multiple of 32 up to 1024), no dynamic shared memory.
#include "common.cuh"

// out[r, :] = bf16(x * rsqrt(mean(x^2) + eps) * weight), x bf16 (Qwen3's per-head q/k norm).
extern "C" __global__ void rmsnorm_bf16(__nv_bfloat16* __restrict__ out,
                                        const __nv_bfloat16* __restrict__ input,
                                        const __nv_bfloat16* __restrict__ weight, uint32_t rows,
                                        uint32_t cols, float eps) {
    metrale::grid_dependency_sync();
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
        y[i] = metrale::to_bf16(metrale::to_f32(x[i]) * inv * metrale::to_f32(weight[i]));
    }
}

// residual[r, :] += input[r, :] in f32 (skipped when input is null); then
// out[r, :] = bf16(residual * rsqrt(mean(residual^2) + eps) * weight).
// `residual` is f32 and updated in place; `out` must not alias it.
extern "C" __global__ void add_rmsnorm_f32res(__nv_bfloat16* __restrict__ out,
                                              float* __restrict__ residual,
                                              const __nv_bfloat16* __restrict__ input,
                                              const __nv_bfloat16* __restrict__ weight,
                                              uint32_t rows, uint32_t cols, float eps) {
    metrale::grid_dependency_sync();
    __shared__ float scratch[32];
    const uint32_t r = blockIdx.x;
    if (r >= rows) return;
    float* res = residual + (size_t)r * cols;
    const __nv_bfloat16* x = input == nullptr ? nullptr : input + (size_t)r * cols;
    float sq = 0.0f;
    for (uint32_t i = threadIdx.x; i < cols; i += blockDim.x) {
        float s = res[i];
        if (x != nullptr) {
            s += metrale::to_f32(x[i]);
            res[i] = s;
        }
        sq += s * s;
    }
    const float inv = rsqrtf(metrale::block_sum(sq, scratch) / (float)cols + eps);
    __nv_bfloat16* y = out + (size_t)r * cols;
    // Each thread re-reads only the elements it wrote itself, so no barrier is needed here.
    for (uint32_t i = threadIdx.x; i < cols; i += blockDim.x) {
        y[i] = metrale::to_bf16(res[i] * inv * metrale::to_f32(weight[i]));
    }
}
