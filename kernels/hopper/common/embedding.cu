// SPDX-License-Identifier: MIT OR Apache-2.0
// Token embedding gather into the f32 residual stream: out[t, :] = f32(table[ids[t], :]). An id
// outside [0, vocab) yields a zero row instead of reading out of bounds (the engine validates ids
// before they reach the GPU; this is the last line of defence).
// Launch: grid = tokens, block = 256.
#include "common.cuh"

extern "C" __global__ void embedding_f32(float* __restrict__ out,
                                         const __nv_bfloat16* __restrict__ table,
                                         const int32_t* __restrict__ ids, uint32_t tokens,
                                         uint32_t hidden, uint32_t vocab) {
    metrale::grid_dependency_sync();
    const uint32_t t = blockIdx.x;
    if (t >= tokens) return;
    const int32_t id = ids[t];
    float* dst = out + (size_t)t * hidden;
    if (id < 0 || (uint32_t)id >= vocab) {
        for (uint32_t i = threadIdx.x; i < hidden; i += blockDim.x) dst[i] = 0.0f;
        return;
    }
    const __nv_bfloat16* src = table + (size_t)id * hidden;
    for (uint32_t i = threadIdx.x; i < hidden; i += blockDim.x) dst[i] = metrale::to_f32(src[i]);
}
