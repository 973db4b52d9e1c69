// SPDX-License-Identifier: MIT OR Apache-2.0
// Causal grouped-query attention over a paged KV cache, for prefill and decode alike.
//
// Token t of sequence s = token_seq[t] at position p = positions[t] attends to keys 0..=p of
// its sequence, which live in the cache blocks block_tables[s][*] (block_size tokens each; the
// cache is [num_blocks, block_size, kv_heads, head_dim]). Query head h reads kv head
// h / (q_heads / kv_heads). Scores, probabilities and the weighted sum of values are f32, with an
// online (running max) softmax; the output is rounded to bf16 once.
//
// Version 1: one block of 4 warps per (token, query head); warp w takes keys w, w+4, ...; each
// lane holds head_dim / 32 elements (head_dim <= 256); the 4 partial softmaxes are merged in shared
// memory at the end. Prefill is O(tokens x context) like decode, without K/V reuse across queries.
// Launch: grid = (tokens, q_heads), block = 128.
#include "common.cuh"

namespace {
constexpr int WARPS = 4;
constexpr int MAX_PER_LANE = 8;  // head_dim <= 256
}  // namespace

extern "C" __global__ void __launch_bounds__(128) paged_attention_bf16(
    __nv_bfloat16* __restrict__ out, const __nv_bfloat16* __restrict__ q,
    const __nv_bfloat16* __restrict__ k_cache, const __nv_bfloat16* __restrict__ v_cache,
    const int32_t* __restrict__ block_tables, const int32_t* __restrict__ token_seq,
    const int32_t* __restrict__ positions, uint32_t tokens, uint32_t q_heads, uint32_t kv_heads,
    uint32_t head_dim, uint32_t block_size, uint32_t max_blocks_per_seq, float scale) {
    __shared__ float part_m[WARPS], part_l[WARPS];
    __shared__ float part_acc[WARPS][MAX_PER_LANE * 32];

    const uint32_t t = blockIdx.x, h = blockIdx.y;
    if (t >= tokens || h >= q_heads) return;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const uint32_t kvh = h / (q_heads / kv_heads);
    const int32_t seq = token_seq[t];
    const int32_t pos = positions[t];
    const int32_t* table = block_tables + (size_t)seq * max_blocks_per_seq;
    const size_t row = (size_t)kv_heads * head_dim;

    float qv[MAX_PER_LANE], acc[MAX_PER_LANE];
    const __nv_bfloat16* qh = q + ((size_t)t * q_heads + h) * head_dim;
#pragma unroll
    for (int i = 0; i < MAX_PER_LANE; ++i) {
        const uint32_t d = lane + 32 * i;
        qv[i] = d < head_dim ? metrale::to_f32(qh[d]) : 0.0f;
        acc[i] = 0.0f;
    }
    float m = -INFINITY, l = 0.0f;
    for (int32_t j = warp; j <= pos; j += WARPS) {
        const int32_t block = table[j / block_size];
        const size_t base = ((size_t)block * block_size + j % block_size) * row + (size_t)kvh * head_dim;
        float dot = 0.0f;
#pragma unroll
        for (int i = 0; i < MAX_PER_LANE; ++i) {
            const uint32_t d = lane + 32 * i;
            if (d < head_dim) dot += qv[i] * metrale::to_f32(k_cache[base + d]);
        }
        const float s = metrale::warp_sum(dot) * scale;
        const float m_new = fmaxf(m, s);
        const float corr = __expf(m - m_new);
        const float p = __expf(s - m_new);
        l = l * corr + p;
#pragma unroll
        for (int i = 0; i < MAX_PER_LANE; ++i) {
            const uint32_t d = lane + 32 * i;
            const float v = d < head_dim ? metrale::to_f32(v_cache[base + d]) : 0.0f;
            acc[i] = acc[i] * corr + p * v;
        }
        m = m_new;
    }
    if (lane == 0) {
        part_m[warp] = m;
        part_l[warp] = l;
    }
#pragma unroll
    for (int i = 0; i < MAX_PER_LANE; ++i) part_acc[warp][lane + 32 * i] = acc[i];
    __syncthreads();
    if (warp != 0) return;
    float big = -INFINITY;
    for (int w = 0; w < WARPS; ++w) big = fmaxf(big, part_m[w]);
    float total = 0.0f, weight[WARPS];
    for (int w = 0; w < WARPS; ++w) {
        weight[w] = part_l[w] > 0.0f ? __expf(part_m[w] - big) : 0.0f;
        total += part_l[w] * weight[w];
    }
    const float inv = total > 0.0f ? 1.0f / total : 0.0f;
    __nv_bfloat16* o = out + ((size_t)t * q_heads + h) * head_dim;
#pragma unroll
    for (int i = 0; i < MAX_PER_LANE; ++i) {
        const uint32_t d = lane + 32 * i;
        if (d < head_dim) {
            float v = 0.0f;
            for (int w = 0; w < WARPS; ++w) v += part_acc[w][d] * weight[w];
            o[d] = metrale::to_bf16(v * inv);
        }
    }
}
