// SPDX-License-Identifier: MIT OR Apache-2.0
// Greedy sampling: out[r] = index of the largest logit of row r. Ties go to the lowest index; NaN
// never wins; a row of all NaN yields 0.
// Launch: grid = rows, block = 1024 (any multiple of 32 up to 1024).
#include "common.cuh"

namespace {

__device__ __forceinline__ bool better(float v, uint32_t i, float best, uint32_t best_i) {
    return v > best || (v == best && i < best_i);
}

template <typename T>
__device__ void argmax_row(int32_t* out, const T* logits, uint32_t rows, uint32_t cols) {
    __shared__ float vals[32];
    __shared__ uint32_t idxs[32];
    const uint32_t r = blockIdx.x;
    if (r >= rows) return;
    const T* row = logits + (size_t)r * cols;
    float best = -INFINITY;
    uint32_t best_i = 0xffffffffu;
    // Four loads in flight per thread before any comparison: a 152k-entry row is otherwise a
    // chain of dependent round trips (121 us for one Qwen3 row on the H200).
    constexpr uint32_t UNROLL = 4;
    for (uint32_t base = threadIdx.x; base < cols; base += UNROLL * blockDim.x) {
        float v[UNROLL];
#pragma unroll
        for (uint32_t u = 0; u < UNROLL; ++u) {
            const uint32_t i = base + u * blockDim.x;
            v[u] = i < cols ? (float)row[i] : NAN;
        }
#pragma unroll
        for (uint32_t u = 0; u < UNROLL; ++u) {
            const uint32_t i = base + u * blockDim.x;
            if (!isnan(v[u]) && (best_i == 0xffffffffu || better(v[u], i, best, best_i))) {
                best = v[u];
                best_i = i;
            }
        }
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, best, offset);
        const uint32_t oi = __shfl_xor_sync(0xffffffffu, best_i, offset);
        if (oi != 0xffffffffu && (best_i == 0xffffffffu || better(ov, oi, best, best_i))) {
            best = ov;
            best_i = oi;
        }
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) {
        vals[warp] = best;
        idxs[warp] = best_i;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < (int)(blockDim.x >> 5); ++w) {
            if (idxs[w] != 0xffffffffu && (best_i == 0xffffffffu || better(vals[w], idxs[w], best, best_i))) {
                best = vals[w];
                best_i = idxs[w];
            }
        }
        out[r] = best_i == 0xffffffffu ? 0 : (int32_t)best_i;
    }
}

}  // namespace

extern "C" __global__ void argmax_bf16(int32_t* __restrict__ out,
                                       const __nv_bfloat16* __restrict__ logits, uint32_t rows,
                                       uint32_t cols) {
    metrale::grid_dependency_sync();
    argmax_row(out, logits, rows, cols);
}

extern "C" __global__ void argmax_f32(int32_t* __restrict__ out, const float* __restrict__ logits,
                                      uint32_t rows, uint32_t cols) {
    metrale::grid_dependency_sync();
    argmax_row(out, logits, rows, cols);
}
