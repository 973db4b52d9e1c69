// SPDX-License-Identifier: MIT OR Apache-2.0
// Writes the new tokens' keys and values into the paged KV cache.
// k and v are [tokens, kv_heads * head_dim]; token t goes to cache slot slots[t]
// (= block * block_size + offset; the cache is [num_slots, kv_heads * head_dim]). A negative slot
// skips the token (padding).
// Launch: grid = tokens, block = 128.
#include "common.cuh"

extern "C" __global__ void kv_cache_write_bf16(__nv_bfloat16* __restrict__ k_cache,
                                               __nv_bfloat16* __restrict__ v_cache,
                                               const __nv_bfloat16* __restrict__ k,
                                               const __nv_bfloat16* __restrict__ v,
                                               const int32_t* __restrict__ slots, uint32_t tokens,
                                               uint32_t row) {
    metrale::grid_dependency_sync();
    const uint32_t t = blockIdx.x;
    if (t >= tokens) return;
    const int32_t slot = slots[t];
    if (slot < 0) return;
    for (uint32_t i = threadIdx.x; i < row; i += blockDim.x) {
        k_cache[(size_t)slot * row + i] = k[(size_t)t * row + i];
        v_cache[(size_t)slot * row + i] = v[(size_t)t * row + i];
    }
}
