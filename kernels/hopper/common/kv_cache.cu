// SPDX-License-Identifier: MIT OR Apache-2.0
// Writes the new tokens' keys and values into the paged KV cache.
// k and v are [tokens, kv_heads * head_dim]; token t goes to cache slot slots[t]
// (= block * block_size + offset; the cache is [num_slots, kv_heads * head_dim]). A negative slot
// skips the token (padding). The bf16 form copies; the fp8 form stores e4m3(x / scale), k_scale
// for keys and v_scale for values (kv_fp8.cuh).
// Launch: grid = tokens, block = 128.
#include "common.cuh"
#include "kv_fp8.cuh"

namespace {
__device__ __forceinline__ void store(__nv_bfloat16* cache, size_t at, __nv_bfloat16 x, float) { cache[at] = x; }
__device__ __forceinline__ void store(uint8_t* cache, size_t at, __nv_bfloat16 x, float scale) {
    cache[at] = metrale::kv_fp8::quantize1(x, scale);
}

template <typename Cache>
__device__ __forceinline__ void write(Cache* __restrict__ k_cache, Cache* __restrict__ v_cache,
                                      const __nv_bfloat16* __restrict__ k,
                                      const __nv_bfloat16* __restrict__ v,
                                      const int32_t* __restrict__ slots, uint32_t tokens,
                                      uint32_t row, float k_scale, float v_scale) {
    metrale::grid_dependency_sync();
    const uint32_t t = blockIdx.x;
    if (t >= tokens) return;
    const int32_t slot = slots[t];
    if (slot < 0) return;
    for (uint32_t i = threadIdx.x; i < row; i += blockDim.x) {
        store(k_cache, (size_t)slot * row + i, k[(size_t)t * row + i], k_scale);
        store(v_cache, (size_t)slot * row + i, v[(size_t)t * row + i], v_scale);
    }
}
}  // namespace

extern "C" __global__ void kv_cache_write_bf16(__nv_bfloat16* __restrict__ k_cache,
                                               __nv_bfloat16* __restrict__ v_cache,
                                               const __nv_bfloat16* __restrict__ k,
                                               const __nv_bfloat16* __restrict__ v,
                                               const int32_t* __restrict__ slots, uint32_t tokens,
                                               uint32_t row) {
    write(k_cache, v_cache, k, v, slots, tokens, row, 1.0f, 1.0f);
}

// The fp8 cache ([num_slots, row] bytes each): e4m3(k / k_scale), e4m3(v / v_scale).
extern "C" __global__ void kv_cache_write_fp8(uint8_t* __restrict__ k_cache,
                                              uint8_t* __restrict__ v_cache,
                                              const __nv_bfloat16* __restrict__ k,
                                              const __nv_bfloat16* __restrict__ v,
                                              const int32_t* __restrict__ slots, uint32_t tokens,
                                              uint32_t row, float k_scale, float v_scale) {
    write(k_cache, v_cache, k, v, slots, tokens, row, k_scale, v_scale);
}
