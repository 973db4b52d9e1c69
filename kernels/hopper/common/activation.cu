// SPDX-License-Identifier: MIT OR Apache-2.0
// SwiGLU: out[t, i] = bf16(silu(gate[t, i]) * up[t, i]), computed in f32 and rounded once.
// gate_up is [tokens, 2 * inter] with the gate half first.
// Launch: grid = ceil(tokens * inter / 256), block = 256.
#include "common.cuh"

extern "C" __global__ void silu_mul_bf16(__nv_bfloat16* __restrict__ out,
                                         const __nv_bfloat16* __restrict__ gate_up,
                                         uint32_t tokens, uint32_t inter) {
    metrale::grid_dependency_sync();
    const size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (size_t)tokens * inter) return;
    const size_t t = idx / inter;
    const size_t i = idx - t * inter;
    const float g = metrale::to_f32(gate_up[t * 2 * inter + i]);
    const float u = metrale::to_f32(gate_up[t * 2 * inter + inter + i]);
    out[idx] = metrale::to_bf16(g / (1.0f + expf(-g)) * u);
}
