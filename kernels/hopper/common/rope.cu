// SPDX-License-Identifier: MIT OR Apache-2.0
// Rotary position embedding, rotate-half (GPT-NeoX / HF Llama) layout, in place.
//
// x is [tokens, token_stride] bf16 and the rotated heads start at x: head h of token t is
// x[t * token_stride + h * head_dim ..][..head_dim], so one call can rotate the q or the k part of
// a fused QKV row. cos and sin are f32 [max_position, head_dim / 2] tables computed on the host at
// load (they carry any RoPE scaling). Pairs are (i, i + head_dim / 2). The rotation is computed in
// f32 and each output rounded to bf16 once.
// Launch: grid = (tokens, heads), block = 64.
#include "common.cuh"

extern "C" __global__ void rope_neox_bf16(__nv_bfloat16* __restrict__ x,
                                          const int32_t* __restrict__ positions,
                                          const float* __restrict__ cos_table,
                                          const float* __restrict__ sin_table, uint32_t tokens,
                                          uint32_t heads, uint32_t head_dim,
                                          uint32_t token_stride, uint32_t max_position) {
    metrale::grid_dependency_sync();
    const uint32_t t = blockIdx.x;
    const uint32_t h = blockIdx.y;
    if (t >= tokens || h >= heads) return;
    const int32_t pos = positions[t];
    if (pos < 0 || (uint32_t)pos >= max_position) return;
    const uint32_t half = head_dim / 2;
    __nv_bfloat16* head = x + (size_t)t * token_stride + (size_t)h * head_dim;
    const float* c = cos_table + (size_t)pos * half;
    const float* s = sin_table + (size_t)pos * half;
    for (uint32_t i = threadIdx.x; i < half; i += blockDim.x) {
        const float a = metrale::to_f32(head[i]);
        const float b = metrale::to_f32(head[i + half]);
        head[i] = metrale::to_bf16(a * c[i] - b * s[i]);
        head[i + half] = metrale::to_bf16(b * c[i] + a * s[i]);
    }
}
