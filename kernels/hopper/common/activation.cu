// SPDX-License-Identifier: MIT OR Apache-2.0
// SwiGLU: out[t, i] = bf16(silu(gate[t, i]) * up[t, i]), computed in f32 and rounded once.
// gate_up is [tokens, 2 * inter] with the gate half first.
// A grid-stride loop over 8-element pieces (16-byte loads and stores) when inter % 8 == 0, else
// over single elements; any grid is correct. Launch: grid = ceil(tokens * inter / (8 * 256))
// blocks (ceil(tokens * inter / 256) without the vector path), block = 256.
#include "common.cuh"
#include "fp8_rows.cuh"

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

// silu_mul_bf16 with its output as the FP8 library product's activation rows (fp8_rows.cuh)
// instead of bf16, for a product that reads them (the engine's down product on the FP8 GEMM):
// each value bf16(silu(g) * u) as silu_mul_bf16 stores it, those bf16 rows quantized as
// fp8_quantize_rows quantizes them, so one launch stores the bits of the two. q is e4m3
// [round_up(tokens, 16), inter], scales f32 in fp8_rows' layout over round_up(tokens, 16) rows;
// the rows past `tokens` are zero values with scales 1.
// One warp per (row, 128-column block) over the padded rows, each lane 4 consecutive columns
// (8-byte loads of gate and up and a 4-byte store where inter % 4 == 0 and the bases are aligned,
// else element by element), 8 warps a block: grid = ceil(round_up(tokens, 16) *
// ceil(inter / 128) / 8), block = 256.
extern "C" __global__ void __launch_bounds__(256) silu_mul_fp8_rows(
    uint8_t* __restrict__ q, float* __restrict__ scales, const __nv_bfloat16* __restrict__ gate_up,
    uint32_t tokens, uint32_t inter) {
    using metrale::fp8_rows::SCALE_K;
    metrale::grid_dependency_sync();
    const uint32_t lane = threadIdx.x % 32;
    const uint32_t kb_count = (inter + SCALE_K - 1) / SCALE_K;
    const size_t item = (size_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (item >= (size_t)metrale::fp8_rows::padded_rows(tokens) * kb_count) return;
    const uint32_t row = (uint32_t)(item / kb_count), kb = (uint32_t)(item % kb_count);
    const uint32_t col = kb * SCALE_K + lane * 4;
    const bool aligned = (uintptr_t)gate_up % 8 == 0 && (uintptr_t)q % 4 == 0;
    const bool vector = aligned && inter % 4 == 0 && col + 4 <= inter;
    __nv_bfloat16 y[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) y[j] = metrale::to_bf16(0.0f);
    if (row < tokens) {
        const __nv_bfloat16* g = gate_up + (size_t)row * 2 * inter + col;
        const __nv_bfloat16* u = g + inter;
        if (vector) {
            const uint2 gv = *reinterpret_cast<const uint2*>(g);
            const uint2 uv = *reinterpret_cast<const uint2*>(u);
            const __nv_bfloat162* g2 = reinterpret_cast<const __nv_bfloat162*>(&gv);
            const __nv_bfloat162* u2 = reinterpret_cast<const __nv_bfloat162*>(&uv);
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const float2 gf = __bfloat1622float2(g2[e]), uf = __bfloat1622float2(u2[e]);
                const __nv_bfloat162 o = __floats2bfloat162_rn(swiglu(gf.x, uf.x), swiglu(gf.y, uf.y));
                y[2 * e] = o.x;
                y[2 * e + 1] = o.y;
            }
        } else {
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                if (col + j < inter) {
                    y[j] = metrale::to_bf16(swiglu(metrale::to_f32(g[j]), metrale::to_f32(u[j])));
                }
            }
        }
    }
    metrale::fp8_rows::store_block4(q + (size_t)row * inter + col, scales,
                                    metrale::fp8_rows::row_scale(row, kb, tokens, kb_count),
                                    metrale::fp8_rows::pack(y),
                                    metrale::fp8_rows::valid_columns(col, inter), vector);
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
