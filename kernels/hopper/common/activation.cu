// SPDX-License-Identifier: MIT OR Apache-2.0
// SwiGLU: out[t, i] = bf16(silu(gate[t, i]) * up[t, i]), computed in f32 and rounded once.
// gate_up is [tokens, 2 * inter] with the gate half first.
// A grid-stride loop over 8-element pieces (16-byte loads and stores) when inter % 8 == 0, else
// over single elements; any grid is correct. Launch: grid = ceil(tokens * inter / (8 * 256))
// blocks (ceil(tokens * inter / 256) without the vector path), block = 256.
#include "common.cuh"

namespace {
__device__ __forceinline__ float swiglu(float g, float u) { return g / (1.0f + __expf(-g)) * u; }
}  // namespace

extern "C" __global__ void silu_mul_bf16(__nv_bfloat16* __restrict__ out,
                                         const __nv_bfloat16* __restrict__ gate_up,
                                         uint32_t tokens, uint32_t inter) {
    metrale::grid_dependency_sync();
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    const size_t first = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (inter % 8 == 0) {
        const size_t pieces_per_row = inter / 8, pieces = (size_t)tokens * pieces_per_row;
        for (size_t p = first; p < pieces; p += stride) {
            const size_t t = p / pieces_per_row, i = (p - t * pieces_per_row) * 8;
            const uint4 g = *reinterpret_cast<const uint4*>(gate_up + t * 2 * inter + i);
            const uint4 u = *reinterpret_cast<const uint4*>(gate_up + t * 2 * inter + inter + i);
            const __nv_bfloat162* g2 = reinterpret_cast<const __nv_bfloat162*>(&g);
            const __nv_bfloat162* u2 = reinterpret_cast<const __nv_bfloat162*>(&u);
            uint4 o;
            __nv_bfloat162* o2 = reinterpret_cast<__nv_bfloat162*>(&o);
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float2 gf = __bfloat1622float2(g2[e]), uf = __bfloat1622float2(u2[e]);
                o2[e] = __floats2bfloat162_rn(swiglu(gf.x, uf.x), swiglu(gf.y, uf.y));
            }
            *reinterpret_cast<uint4*>(out + t * inter + i) = o;
        }
        return;
    }
    for (size_t idx = first; idx < (size_t)tokens * inter; idx += stride) {
        const size_t t = idx / inter;
        const size_t i = idx - t * inter;
        const float g = metrale::to_f32(gate_up[t * 2 * inter + i]);
        const float u = metrale::to_f32(gate_up[t * 2 * inter + inter + i]);
        out[idx] = metrale::to_bf16(swiglu(g, u));
    }
}

// Squared ReLU (Nemotron-H's MLP): out[i] = bf16(max(x[i], 0)^2) in f32. In place is allowed.
// Launch: grid = ceil(n / 256), block = 256, one element a thread.
extern "C" __global__ void relu2_bf16(__nv_bfloat16* out, const __nv_bfloat16* x, uint32_t n) {
    metrale::grid_dependency_sync();
    const uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const float v = fmaxf(metrale::to_f32(x[i]), 0.0f);
    out[i] = metrale::to_bf16(v * v);
}
