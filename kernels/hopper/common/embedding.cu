// SPDX-License-Identifier: MIT OR Apache-2.0
// Token embedding gather into the f32 residual stream: out[t, :] = f32(table[ids[t], :]). An id
// outside [0, vocab) yields a zero row instead of reading out of bounds (the engine validates ids
// before they reach the GPU; this is the last line of defence).
// Launch: grid = tokens, block = 256.
#include "common.cuh"

namespace {
constexpr uint32_t VEC_PER = 4;

// Both entries: the row of token blockIdx.x, through 16-byte loads where VEC and the row is whole
// 16-byte pieces (up to VEC_PER a thread, all issued before the first store), else 2 bytes an
// iteration.
template <bool VEC>
__device__ __forceinline__ void gather(float* __restrict__ out, const __nv_bfloat16* __restrict__ table,
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
    const bool whole =
        VEC && hidden % 8 == 0 && ((uintptr_t)table & 15) == 0 && ((uintptr_t)out & 15) == 0;
    if (!whole) {
        for (uint32_t i = threadIdx.x; i < hidden; i += blockDim.x) dst[i] = metrale::to_f32(src[i]);
        return;
    }
    const uint4* pieces = reinterpret_cast<const uint4*>(src);
    float4* to = reinterpret_cast<float4*>(dst);
    const uint32_t n = hidden / 8;
    for (uint32_t base = threadIdx.x; base < n; base += blockDim.x * VEC_PER) {
        uint4 v[VEC_PER];
#pragma unroll
        for (uint32_t j = 0; j < VEC_PER; ++j) {
            const uint32_t p = base + j * blockDim.x;
            v[j] = p < n ? __ldg(pieces + p) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (uint32_t j = 0; j < VEC_PER; ++j) {
            const uint32_t p = base + j * blockDim.x;
            if (p >= n) break;
            // A bf16's f32 is its 16 bits shifted up: exact.
            const uint32_t w[4] = {v[j].x, v[j].y, v[j].z, v[j].w};
            to[2 * p] = make_float4(__uint_as_float(w[0] << 16), __uint_as_float(w[0] & 0xffff0000u),
                                    __uint_as_float(w[1] << 16), __uint_as_float(w[1] & 0xffff0000u));
            to[2 * p + 1] = make_float4(__uint_as_float(w[2] << 16), __uint_as_float(w[2] & 0xffff0000u),
                                        __uint_as_float(w[3] << 16), __uint_as_float(w[3] & 0xffff0000u));
        }
    }
}
}  // namespace

extern "C" __global__ void embedding_f32(float* __restrict__ out,
                                         const __nv_bfloat16* __restrict__ table,
                                         const int32_t* __restrict__ ids, uint32_t tokens,
                                         uint32_t hidden, uint32_t vocab) {
    gather<false>(out, table, ids, tokens, hidden, vocab);
}

// embedding_f32 with 16-byte loads, for measuring (the model launches it under the tuning's
// embedding_vec): each thread loads up to VEC_PER 8-element pieces of the row, all before
// its first store, so a row costs one memory round trip after the id's instead of one per few
// elements (embedding_f32 copies 2 bytes an iteration: 6.5 us at Qwen3-8B's hidden 4096 on the
// H200, the step's first launch; docs/results/2026-12-02-speed-h200/attention-wide, timelines).
// The same values. A row that is not whole 16-byte pieces (hidden not a multiple of 8, or table /
// out not 16-byte aligned) takes embedding_f32's loop.
// Launch: grid = tokens, block = 256.
extern "C" __global__ void embedding_f32_vec(float* __restrict__ out,
                                             const __nv_bfloat16* __restrict__ table,
                                             const int32_t* __restrict__ ids, uint32_t tokens,
                                             uint32_t hidden, uint32_t vocab) {
    gather<true>(out, table, ids, tokens, hidden, vocab);
}
