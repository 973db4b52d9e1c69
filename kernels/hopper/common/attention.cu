// SPDX-License-Identifier: MIT OR Apache-2.0
// Causal grouped-query attention over a paged KV cache, for decode (and any step the tensor-core
// prefill kernel, prefill_attention.cu, does not take).
//
// Token t of sequence s = token_seq[t] at position p = positions[t] attends to keys 0..=p of
// its sequence, which live in the cache blocks block_tables[s][*] (block_size tokens each; the
// cache is [num_blocks, block_size, kv_heads, head_dim]). Query head h reads kv head
// h / (q_heads / kv_heads). Scores, probabilities and the weighted sum of values are f32, with an
// online (running max) softmax; the output is rounded to bf16 once.
//
// Split-K ("flash decoding"), grouped by kv head: grid = (tokens, kv_heads, splits), block = 4
// warps. A block serves all G = q_heads / kv_heads query heads (up to 8) that share its kv head,
// so each key and value row is read once per block, not once per query head. Split z takes keys
// [z * keys_per_split, (z + 1) * keys_per_split) of the token's context (one split takes the
// whole context). A warp takes 32 keys at a time, one per lane: each lane reads its key's whole
// row with 16-byte loads and scores it against the G scaled queries in shared memory; the tile's
// probabilities are then broadcast lane by lane while each lane accumulates its head_dim / 32
// output dims of every head from the (coalesced) value rows. The 4 warps' running softmaxes merge
// in shared memory. With one split the block writes the bf16 output; with more, it writes each
// head's partial (acc[head_dim], m, l) to `partials` (an empty split writes m = 0, l = 0,
// acc = 0), and the last block of a (token, kv head) to finish - counted in `counters`, which it
// sets back to zero - merges the splits' partials into the bf16 output, so no combine launch is
// needed (attention_combine_bf16 remains for callers that want the partials only).
// Batch-1 decode has kv_heads blocks per split, so splitting the context is what fills the GPU.
#include "common.cuh"

namespace {
constexpr int WARPS = 4;

template <int HD, int G>
__device__ __forceinline__ void attend(
    __nv_bfloat16* __restrict__ out, float* __restrict__ partials, int32_t* __restrict__ counters,
    const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k_cache,
    const __nv_bfloat16* __restrict__ v_cache, const int32_t* __restrict__ block_tables,
    const int32_t* __restrict__ token_seq, const int32_t* __restrict__ positions,
    uint32_t q_heads, uint32_t kv_heads, uint32_t block_size, uint32_t max_blocks_per_seq,
    uint32_t keys_per_split, float scale) {
    constexpr int PER_LANE = HD / 32;  // output dims per lane
    constexpr int CHUNKS = HD / 8;     // 16-byte pieces of a key row
    // Dynamic shared memory, laid out per instantiation (attention_smem_floats):
    // qs[G][HD], part_acc[WARPS][G][HD], part_m[WARPS][G], part_l[WARPS][G].
    extern __shared__ __align__(16) float smem[];
    float(*qs)[HD] = reinterpret_cast<float(*)[HD]>(smem);
    float(*part_acc)[G][HD] = reinterpret_cast<float(*)[G][HD]>(smem + G * HD);
    float(*part_m)[G] = reinterpret_cast<float(*)[G]>(smem + (WARPS + 1) * G * HD);
    float(*part_l)[G] = reinterpret_cast<float(*)[G]>(smem + (WARPS + 1) * G * HD + WARPS * G);

    const uint32_t t = blockIdx.x, kvh = blockIdx.y, split = blockIdx.z, splits = gridDim.z;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const uint32_t h0 = kvh * G;  // first query head of the group
    const int32_t seq = token_seq[t];
    const uint32_t ctx = (uint32_t)positions[t] + 1;
    const uint32_t begin = split * keys_per_split;
    const uint32_t end = splits == 1 ? ctx : min(begin + keys_per_split, ctx);
    const int32_t* table = block_tables + (size_t)seq * max_blocks_per_seq;
    const size_t row = (size_t)kv_heads * HD;

    const __nv_bfloat16* qg = q + ((size_t)t * q_heads + h0) * HD;
    for (int i = threadIdx.x; i < G * HD; i += blockDim.x)
        qs[i / HD][i % HD] = metrale::to_f32(qg[i]) * scale;
    __syncthreads();

    float m[G], l[G], acc[G][PER_LANE];
#pragma unroll
    for (int g = 0; g < G; ++g) {
        m[g] = -INFINITY;
        l[g] = 0.0f;
#pragma unroll
        for (int i = 0; i < PER_LANE; ++i) acc[g][i] = 0.0f;
    }

    for (uint32_t tile = begin + warp * 32; tile < end; tile += WARPS * 32) {
        const uint32_t j = tile + lane;
        const bool valid = j < end;
        size_t base = 0;
        float s[G];
#pragma unroll
        for (int g = 0; g < G; ++g) s[g] = -INFINITY;
        if (valid) {
            base = ((size_t)table[j / block_size] * block_size + j % block_size) * row +
                   (size_t)kvh * HD;
            const uint4* k4 = reinterpret_cast<const uint4*>(k_cache + base);
            uint4 kv[CHUNKS];
#pragma unroll
            for (int c = 0; c < CHUNKS; ++c) kv[c] = __ldg(k4 + c);
            float dot[G];
#pragma unroll
            for (int g = 0; g < G; ++g) dot[g] = 0.0f;
#pragma unroll
            for (int c = 0; c < CHUNKS; ++c) {
                const __nv_bfloat162* k2 = reinterpret_cast<const __nv_bfloat162*>(&kv[c]);
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const float2 kf = __bfloat1622float2(k2[e]);
#pragma unroll
                    for (int g = 0; g < G; ++g) {
                        dot[g] = fmaf(qs[g][c * 8 + 2 * e], kf.x, dot[g]);
                        dot[g] = fmaf(qs[g][c * 8 + 2 * e + 1], kf.y, dot[g]);
                    }
                }
            }
#pragma unroll
            for (int g = 0; g < G; ++g) s[g] = dot[g];
        }
        float p[G];
#pragma unroll
        for (int g = 0; g < G; ++g) {
            const float m_new = fmaxf(m[g], metrale::warp_max(s[g]));
            p[g] = valid ? __expf(s[g] - m_new) : 0.0f;
            const float corr = __expf(m[g] - m_new);  // 0 on the first tile (m = -inf)
            l[g] = l[g] * corr + metrale::warp_sum(p[g]);
#pragma unroll
            for (int i = 0; i < PER_LANE; ++i) acc[g][i] *= corr;
            m[g] = m_new;
        }
        // Value rows in batches of VB: all of a batch's loads are issued before its first FMA,
        // so a warp waits for memory once per batch instead of once per key. Keys are still
        // accumulated in order.
        constexpr uint32_t VB = HD >= 256 ? 4 : 8;
        const uint32_t n = min(32u, end - tile);
        for (uint32_t k0 = 0; k0 < n; k0 += VB) {
            float2 vf[VB][PER_LANE / 2];
#pragma unroll
            for (uint32_t u = 0; u < VB; ++u) {
                const uint32_t kk = k0 + u;
                const size_t vb = __shfl_sync(0xffffffffu, base, kk & 31);
                if (kk < n) {
                    const __nv_bfloat162* vrow =
                        reinterpret_cast<const __nv_bfloat162*>(v_cache + vb + lane * PER_LANE);
#pragma unroll
                    for (int i = 0; i < PER_LANE / 2; ++i) vf[u][i] = __bfloat1622float2(vrow[i]);
                }
            }
#pragma unroll
            for (uint32_t u = 0; u < VB; ++u) {
                const uint32_t kk = k0 + u;
                if (kk >= n) break;
#pragma unroll
                for (int g = 0; g < G; ++g) {
                    const float pk = __shfl_sync(0xffffffffu, p[g], kk);
#pragma unroll
                    for (int i = 0; i < PER_LANE / 2; ++i) {
                        acc[g][2 * i] = fmaf(pk, vf[u][i].x, acc[g][2 * i]);
                        acc[g][2 * i + 1] = fmaf(pk, vf[u][i].y, acc[g][2 * i + 1]);
                    }
                }
            }
        }
    }

#pragma unroll
    for (int g = 0; g < G; ++g) {
        if (lane == 0) {
            part_m[warp][g] = m[g];
            part_l[warp][g] = l[g];
        }
#pragma unroll
        for (int i = 0; i < PER_LANE; ++i) part_acc[warp][g][lane * PER_LANE + i] = acc[g][i];
    }
    __syncthreads();
    for (int i = threadIdx.x; i < G * HD; i += blockDim.x) {
        const int g = i / HD, d = i % HD;
        float big = -INFINITY;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) big = fmaxf(big, part_m[w][g]);
        float total = 0.0f, a = 0.0f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) {
            const float weight = part_l[w][g] > 0.0f ? __expf(part_m[w][g] - big) : 0.0f;
            total += part_l[w][g] * weight;
            a += part_acc[w][g][d] * weight;
        }
        const size_t head = (size_t)t * q_heads + h0 + g;
        if (splits == 1) {
            out[head * HD + d] = metrale::to_bf16(total > 0.0f ? a / total : 0.0f);
        } else {
            float* part = partials + (head * splits + split) * (HD + 2);
            part[d] = a;
            if (d == 0) {
                part[HD] = total > 0.0f ? big : 0.0f;
                part[HD + 1] = total;
            }
        }
    }
    if (splits == 1) return;

    // The last block of this (token, kv head) to finish merges every split's partial.
    __shared__ int is_last;
    __shared__ float head_total[G];
    __threadfence();  // this block's partials are visible before it is counted
    __syncthreads();
    int32_t* counter = counters + (size_t)t * kv_heads + kvh;
    if (threadIdx.x == 0) is_last = atomicAdd(counter, 1) == (int)splits - 1;
    __syncthreads();
    if (!is_last) return;
    __threadfence();
    // Per-split weights e^(m_z - M) of each head, after the block's own layout in shared memory.
    float* weight = smem + (WARPS + 1) * G * HD + 2 * WARPS * G;  // [G][splits]
    for (int g = warp; g < G; g += WARPS) {
        const float* ph = partials + ((size_t)t * q_heads + h0 + g) * splits * (HD + 2);
        float big = -INFINITY;
        for (uint32_t z = lane; z < splits; z += 32)
            if (__ldcg(ph + z * (HD + 2) + HD + 1) > 0.0f) big = fmaxf(big, __ldcg(ph + z * (HD + 2) + HD));
        big = metrale::warp_max(big);
        float total = 0.0f;
        for (uint32_t z = lane; z < splits; z += 32) {
            const float lz = __ldcg(ph + z * (HD + 2) + HD + 1);
            const float wz = lz > 0.0f ? __expf(__ldcg(ph + z * (HD + 2) + HD) - big) : 0.0f;
            weight[g * splits + z] = wz;
            total += lz * wz;
        }
        total = metrale::warp_sum(total);
        if (lane == 0) head_total[g] = total;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < G * HD; i += blockDim.x) {
        const int g = i / HD, d = i % HD;
        const size_t head = (size_t)t * q_heads + h0 + g;
        const float* ph = partials + head * splits * (HD + 2);
        float a = 0.0f;
        for (uint32_t z = 0; z < splits; ++z) a += __ldcg(ph + z * (HD + 2) + d) * weight[g * splits + z];
        const float total = head_total[g];
        out[head * HD + d] = metrale::to_bf16(total > 0.0f ? a / total : 0.0f);
    }
    if (threadIdx.x == 0) *counter = 0;  // ready for the next launch
}

template <int HD>
__device__ __forceinline__ void attend_group(
    uint32_t group, __nv_bfloat16* __restrict__ out, float* __restrict__ partials,
    int32_t* __restrict__ counters, const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k_cache,
    const __nv_bfloat16* __restrict__ v_cache, const int32_t* __restrict__ block_tables,
    const int32_t* __restrict__ token_seq, const int32_t* __restrict__ positions,
    uint32_t q_heads, uint32_t kv_heads, uint32_t block_size, uint32_t max_blocks_per_seq,
    uint32_t keys_per_split, float scale) {
#define METRALE_ATTEND(G)                                                                      \
    attend<HD, G>(out, partials, counters, q, k_cache, v_cache, block_tables, token_seq, positions,      \
                  q_heads, kv_heads, block_size, max_blocks_per_seq, keys_per_split, scale)
    switch (group) {
        case 1: METRALE_ATTEND(1); break;
        case 2: METRALE_ATTEND(2); break;
        case 3: METRALE_ATTEND(3); break;
        case 4: METRALE_ATTEND(4); break;
        case 5: METRALE_ATTEND(5); break;
        case 6: METRALE_ATTEND(6); break;
        case 7: METRALE_ATTEND(7); break;
        case 8: METRALE_ATTEND(8); break;
        default: break;
    }
#undef METRALE_ATTEND
}
}  // namespace

// At most 128 registers (4 blocks per SM): a batch-64 decode's 512 blocks then fit in one wave.
// The common instances (head_dim 128, groups up to 4) need no more; the largest (head_dim 256,
// group 8) spill.
// Launch: grid = (tokens, kv_heads, splits), block = 128 (gridDim.z must equal `splits`).
// head_dim must be 64, 128 or 256 and q_heads / kv_heads at most 8;
// `partials` is f32 [tokens, q_heads, splits, head_dim + 2] and `counters` i32 [tokens, kv_heads],
// zero before the launch and zero after it (both unused, may be null, when splits = 1). Dynamic
// shared memory: ((4 + 1) * G * head_dim + 8 * G + (splits > 1 ? G * splits : 0)) floats.
extern "C" __global__ void __launch_bounds__(128, 4) paged_attention_bf16(
    __nv_bfloat16* __restrict__ out, float* __restrict__ partials, int32_t* __restrict__ counters,
    const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k_cache,
    const __nv_bfloat16* __restrict__ v_cache, const int32_t* __restrict__ block_tables,
    const int32_t* __restrict__ token_seq, const int32_t* __restrict__ positions, uint32_t tokens,
    uint32_t q_heads, uint32_t kv_heads, uint32_t head_dim, uint32_t block_size,
    uint32_t max_blocks_per_seq, uint32_t keys_per_split, uint32_t splits, float scale) {
    metrale::grid_dependency_sync();
    if (blockIdx.x >= tokens || blockIdx.y >= kv_heads || gridDim.z != splits) return;
    const uint32_t group = q_heads / kv_heads;
#define METRALE_ATTEND(HD)                                                                     \
    attend_group<HD>(group, out, partials, counters, q, k_cache, v_cache, block_tables, token_seq,       \
                     positions, q_heads, kv_heads, block_size, max_blocks_per_seq,             \
                     keys_per_split, scale)
    switch (head_dim) {
        case 64: METRALE_ATTEND(64); break;
        case 128: METRALE_ATTEND(128); break;
        case 256: METRALE_ATTEND(256); break;
        default: break;
    }
#undef METRALE_ATTEND
}

// Merges the splits' partials of paged_attention_bf16:
// out = sum_z acc_z e^(m_z - M) / sum_z l_z e^(m_z - M), M = max of m_z over splits with l_z > 0.
// The per-split weights e^(m_z - M) are computed once into shared memory (at most
// MAX_COMBINE_SPLITS splits), then each thread sums its dims over the splits.
// Launch: grid = (tokens, q_heads), block = 128.
constexpr uint32_t MAX_COMBINE_SPLITS = 1024;

extern "C" __global__ void __launch_bounds__(128) attention_combine_bf16(
    __nv_bfloat16* __restrict__ out, const float* __restrict__ partials, uint32_t tokens,
    uint32_t q_heads, uint32_t head_dim, uint32_t splits) {
    metrale::grid_dependency_sync();
    __shared__ float weight[MAX_COMBINE_SPLITS];
    __shared__ float scratch[32];
    const uint32_t t = blockIdx.x, h = blockIdx.y;
    if (t >= tokens || h >= q_heads || splits > MAX_COMBINE_SPLITS) return;
    const size_t stride = head_dim + 2;
    const float* part = partials + ((size_t)t * q_heads + h) * splits * stride;
    float big = -INFINITY;
    for (uint32_t z = threadIdx.x; z < splits; z += blockDim.x)
        if (part[z * stride + head_dim + 1] > 0.0f) big = fmaxf(big, part[z * stride + head_dim]);
    // Block max through the same scratch as block_sum (which synchronises before reusing it).
    big = metrale::warp_max(big);
    if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = big;
    __syncthreads();
    big = -INFINITY;
    for (uint32_t w = 0; w < blockDim.x / 32; ++w) big = fmaxf(big, scratch[w]);
    __syncthreads();
    float total = 0.0f;
    for (uint32_t z = threadIdx.x; z < splits; z += blockDim.x) {
        const float lz = part[z * stride + head_dim + 1];
        const float wz = lz > 0.0f ? __expf(part[z * stride + head_dim] - big) : 0.0f;
        weight[z] = wz;
        total += lz * wz;
    }
    total = metrale::block_sum(total, scratch);  // its barriers also publish `weight`
    for (uint32_t d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float a = 0.0f;
        for (uint32_t z = 0; z < splits; ++z) a += part[z * stride + d] * weight[z];
        out[((size_t)t * q_heads + h) * head_dim + d] =
            metrale::to_bf16(total > 0.0f ? a / total : 0.0f);
    }
}
