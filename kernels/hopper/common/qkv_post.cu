// SPDX-License-Identifier: MIT OR Apache-2.0
// The attention block's work between the fused QKV product and attention, in one pass: per-head
// RMSNorm of q and k (Qwen3's qk-norm; skipped where the norm weight is null), NeoX RoPE of q and
// k, q into its own buffer, k and v into the paged KV cache.
//
// qkv is bf16 [tokens, (q_heads + 2 kv_heads) * head_dim], each row q heads | k heads | v heads.
// Per head, in f32 from the bf16 input: x * rsqrt(mean(x^2) + eps) * (weight_offset + w)
// (rmsnorm_bf16's formula at weight_offset 0, the plain weight bit for bit; Qwen3-Next's q/k norms
// keep their weight centred on zero and pass 1; the scale is norm.cuh's norm_scale),
// then the pairs (i, i + rotary_dim / 2), i < rotary_dim / 2, rotated by row positions[t] of the
// cos/sin tables [max_position, rotary_dim / 2] (rope_neox_bf16's; a position outside
// [0, max_position) is not rotated; elements from rotary_dim on are not rotated: partial RoPE,
// MiniMax-M2's 64 of 128), then ONE rounding to bf16 (the unfused path rounds after the norm and
// again after the rotation). V heads are copied bit for bit. Token t's k and v heads go to cache row slots[t] (the cache is
// [num_slots, kv_heads * head_dim]); a negative slot skips them (its q is still written).
//
// Work split: one item per (token, head) over the q_heads + 2 kv_heads heads of a token, in qkv's
// order, so item i's input starts at qkv + i * head_dim. L = head_dim / 8 lanes take an item when
// that is a power of two <= 32 (head_dim 64 -> 8 lanes, 128 -> 16, 256 -> 32): each lane owns 4
// consecutive elements of each half (8-byte loads and stores, one float4 of cos and of sin), and
// the sum of squares is a shuffle reduction over the L lanes. Any other head_dim, a partial
// rotation, or a pointer not aligned for those vectors, takes a scalar loop with the same geometry (L = 32 when
// head_dim / 8 does not fit). A block of 256 threads takes 256 / L consecutive items, and the
// grid must cover them all (tokens * (q_heads + 2 kv_heads) < 2^32).
// Registers: 32 (8 blocks, 2048 threads per SM), no spills: the norm weight and cos/sin pieces are
// loaded where they are used (loading them with the input needed 40 registers, 6 blocks per SM, and
// the 8192-token prefill row went from 69.4 to 77.4 us on the H200: bench-kernels in
// docs/results/2026-12-01-speed-h200/harness-e20ced0 and ab-fused-qkv-attention/run2-51c3637).
// Launch: grid = ceil(tokens * (q_heads + 2 kv_heads) / (256 / L)), block = 256.
#include "common.cuh"
#include "norm.cuh"
#include "kv_fp8.cuh"
#include "qkv_post.cuh"

namespace {
// Lanes per item; must match `lanes_per_head` in crates/kernels/src/ops/qkv_post.rs.
__device__ __forceinline__ uint32_t lanes_per_head(uint32_t head_dim) {
    const uint32_t l = head_dim / 8;
    return head_dim % 8 == 0 && l >= 1 && l <= 32 && (l & (l - 1)) == 0 ? l : 32;
}

__device__ __forceinline__ bool aligned(const void* p, uintptr_t bytes) {
    return (reinterpret_cast<uintptr_t>(p) & (bytes - 1)) == 0;
}

// Where an item's result goes: q_out (bf16), or k_cache / v_cache row `slot` (the cache's
// element type: bf16, or e4m3 of the value divided by `scale`). Both null: nowhere (a k or v head
// of a token whose slot is negative, or no item).
template <typename Cache>
struct Dst {
    __nv_bfloat16* q;
    Cache* cache;
    float scale;
    __device__ __forceinline__ bool none() const { return q == nullptr && cache == nullptr; }
    // Elements [at, at + 4) from four bf16.
    __device__ __forceinline__ void store4(uint32_t at, uint2 x) const;
    __device__ __forceinline__ void store1(uint32_t at, __nv_bfloat16 x) const;
};

template <>
__device__ __forceinline__ void Dst<__nv_bfloat16>::store4(uint32_t at, uint2 x) const {
    *reinterpret_cast<uint2*>((q != nullptr ? q : cache) + at) = x;
}
template <>
__device__ __forceinline__ void Dst<__nv_bfloat16>::store1(uint32_t at, __nv_bfloat16 x) const {
    (q != nullptr ? q : cache)[at] = x;
}
template <>
__device__ __forceinline__ void Dst<uint8_t>::store4(uint32_t at, uint2 x) const {
    if (q != nullptr)
        *reinterpret_cast<uint2*>(q + at) = x;
    else
        *reinterpret_cast<uint32_t*>(cache + at) = metrale::kv_fp8::quantize4(x, scale);
}
template <>
__device__ __forceinline__ void Dst<uint8_t>::store1(uint32_t at, __nv_bfloat16 x) const {
    if (q != nullptr)
        q[at] = x;
    else
        cache[at] = metrale::kv_fp8::quantize1(x, scale);
}

template <typename Cache>
__device__ __forceinline__ Dst<Cache> destination(bool live, uint32_t t, uint32_t h, int32_t slot,
                                                  __nv_bfloat16* q_out, Cache* k_cache,
                                                  Cache* v_cache, uint32_t q_heads,
                                                  uint32_t kv_heads, uint32_t head_dim,
                                                  float k_scale, float v_scale) {
    if (!live) return {nullptr, nullptr, 1.0f};
    if (h < q_heads) return {q_out + ((uint64_t)t * q_heads + h) * head_dim, nullptr, 1.0f};
    if (slot < 0) return {nullptr, nullptr, 1.0f};
    const uint32_t kv = h - q_heads;
    return kv < kv_heads
               ? Dst<Cache>{nullptr, k_cache + ((uint64_t)slot * kv_heads + kv) * head_dim, k_scale}
               : Dst<Cache>{nullptr, v_cache + ((uint64_t)slot * kv_heads + kv - kv_heads) * head_dim,
                            v_scale};
}

}  // namespace

namespace {
template <typename Cache>
__device__ __forceinline__ void qkv_post(
    __nv_bfloat16* __restrict__ q_out, Cache* __restrict__ k_cache,
    Cache* __restrict__ v_cache, const __nv_bfloat16* __restrict__ qkv,
    const __nv_bfloat16* __restrict__ q_norm, const __nv_bfloat16* __restrict__ k_norm,
    const int32_t* __restrict__ positions, const int32_t* __restrict__ slots,
    const float* __restrict__ cos_table, const float* __restrict__ sin_table, uint32_t tokens,
    uint32_t q_heads, uint32_t kv_heads, uint32_t head_dim, uint32_t rotary_dim,
    uint32_t max_position, float eps, float weight_offset, float k_scale, float v_scale) {
    metrale::grid_dependency_sync();
    const uint32_t lanes = lanes_per_head(head_dim);
    const uint32_t per_block = blockDim.x / lanes;
    const uint32_t group = threadIdx.x / lanes, j = threadIdx.x % lanes;
    const uint32_t heads = q_heads + 2 * kv_heads;
    // Items are counted in 32 bits: tokens * (q_heads + 2 kv_heads) < 2^32.
    const uint32_t total = tokens * heads;
    const uint32_t half = head_dim / 2;
    const bool vec = head_dim == 8 * lanes && rotary_dim == head_dim && aligned(qkv, 8) && aligned(q_out, 8) &&
                     aligned(k_cache, 8) && aligned(v_cache, 8) && aligned(q_norm, 8) &&
                     aligned(k_norm, 8) && aligned(cos_table, 16) && aligned(sin_table, 16);
    // One item per lane group; the grid covers every item (no stride loop: it costs registers).
    // Lanes past the last item still reach the shuffle, which needs the whole warp.
    const uint32_t item = blockIdx.x * per_block + group;
    const bool live = item < total;
    const uint32_t t = live ? item / heads : 0;
    const uint32_t h = live ? item % heads : 0;
    const bool is_q = h < q_heads, is_v = h >= q_heads + kv_heads;
    const __nv_bfloat16* x = qkv + (size_t)(live ? item : 0) * head_dim;
    // Everything that depends only on the item is loaded before anything branches on it: the
    // position, the slot and (vector path) this lane's input, one memory latency in all.
    const int32_t pos = live ? __ldg(positions + t) : -1;
    const int32_t slot = live && !is_q ? __ldg(slots + t) : -1;
    // This lane's elements on the vector path: [e, e + 4) and [half + e, half + e + 4).
    const uint32_t e = 4 * j;
    uint2 ra = make_uint2(0, 0), rb = make_uint2(0, 0);
    if (vec && live) {
        ra = __ldg(reinterpret_cast<const uint2*>(x + e));
        rb = __ldg(reinterpret_cast<const uint2*>(x + half + e));
    }
    const Dst<Cache> dst = destination(live, t, h, slot, q_out, k_cache, v_cache, q_heads, kv_heads,
                                       head_dim, k_scale, v_scale);
    const __nv_bfloat16* norm = is_q ? q_norm : is_v ? nullptr : k_norm;
    const bool rotate = !is_v && pos >= 0 && (uint32_t)pos < max_position;
    if (vec) {
        const float ss = metrale::qkv_post::head_sum_sq(ra, rb, lanes);
        if (dst.none()) return;
        if (!is_v)
            metrale::qkv_post::transform_loading(ra, rb, ss, norm, rotate, pos, cos_table,
                                                 sin_table, e, half, head_dim, eps,
                                                 weight_offset);
        dst.store4(e, ra);
        dst.store4(half + e, rb);
    } else {
        float ss = 0.0f;
        if (!dst.none() && norm != nullptr) {
            for (uint32_t i = j; i < head_dim; i += lanes) {
                const float v = metrale::to_f32(x[i]);
                ss += v * v;
            }
        }
        ss = metrale::qkv_post::group_sum(ss, lanes);
        if (dst.none()) return;
        if (is_v) {
            for (uint32_t i = j; i < head_dim; i += lanes) dst.store1(i, x[i]);
            return;
        }
        const float inv = rsqrtf(ss / (float)head_dim + eps);
        // The rotated pairs (i, i + rotary_dim / 2), then the elements past rotary_dim.
        const uint32_t rhalf = rotary_dim / 2;
        for (uint32_t i = j; i < rhalf; i += lanes) {
            float x0 = metrale::to_f32(x[i]), x1 = metrale::to_f32(x[i + rhalf]);
            if (norm != nullptr) {
                x0 = x0 * inv * metrale::norm_scale(metrale::to_f32(norm[i]), weight_offset);
                x1 = x1 * inv *
                     metrale::norm_scale(metrale::to_f32(norm[i + rhalf]), weight_offset);
            }
            if (rotate) {
                const size_t row = (size_t)pos * rhalf + i;
                const float c = cos_table[row], s = sin_table[row];
                const float y0 = x0 * c - x1 * s, y1 = x1 * c + x0 * s;
                x0 = y0;
                x1 = y1;
            }
            dst.store1(i, metrale::to_bf16(x0));
            dst.store1(i + rhalf, metrale::to_bf16(x1));
        }
        for (uint32_t i = rotary_dim + j; i < head_dim; i += lanes) {
            float v = metrale::to_f32(x[i]);
            if (norm != nullptr)
                v = v * inv * metrale::norm_scale(metrale::to_f32(norm[i]), weight_offset);
            dst.store1(i, metrale::to_bf16(v));
        }
    }
}
}  // namespace

extern "C" __global__ void __launch_bounds__(256, 8) qkv_rope_kv_write_bf16(
    __nv_bfloat16* __restrict__ q_out, __nv_bfloat16* __restrict__ k_cache,
    __nv_bfloat16* __restrict__ v_cache, const __nv_bfloat16* __restrict__ qkv,
    const __nv_bfloat16* __restrict__ q_norm, const __nv_bfloat16* __restrict__ k_norm,
    const int32_t* __restrict__ positions, const int32_t* __restrict__ slots,
    const float* __restrict__ cos_table, const float* __restrict__ sin_table, uint32_t tokens,
    uint32_t q_heads, uint32_t kv_heads, uint32_t head_dim, uint32_t rotary_dim,
    uint32_t max_position, float eps, float weight_offset) {
    qkv_post(q_out, k_cache, v_cache, qkv, q_norm, k_norm, positions, slots, cos_table, sin_table,
             tokens, q_heads, kv_heads, head_dim, rotary_dim, max_position, eps, weight_offset,
             1.0f, 1.0f);
}

// qkv_rope_kv_write_bf16 into an FP8 cache ([num_slots, kv_heads * head_dim] bytes each): each
// key and value element is the bf16 the other form stores, then e4m3(x / k_scale) or
// e4m3(x / v_scale) (kv_fp8.cuh). The queries are the other form's, bit for bit.
extern "C" __global__ void __launch_bounds__(256, 8) qkv_rope_kv_write_fp8(
    __nv_bfloat16* __restrict__ q_out, uint8_t* __restrict__ k_cache,
    uint8_t* __restrict__ v_cache, const __nv_bfloat16* __restrict__ qkv,
    const __nv_bfloat16* __restrict__ q_norm, const __nv_bfloat16* __restrict__ k_norm,
    const int32_t* __restrict__ positions, const int32_t* __restrict__ slots,
    const float* __restrict__ cos_table, const float* __restrict__ sin_table, uint32_t tokens,
    uint32_t q_heads, uint32_t kv_heads, uint32_t head_dim, uint32_t rotary_dim,
    uint32_t max_position, float eps, float weight_offset, float k_scale, float v_scale) {
    qkv_post(q_out, k_cache, v_cache, qkv, q_norm, k_norm, positions, slots, cos_table, sin_table,
             tokens, q_heads, kv_heads, head_dim, rotary_dim, max_position, eps, weight_offset,
             k_scale, v_scale);
}

// MiniMax-M2's QK-norm, in place on the fused QKV product before qkv_rope_kv_write_bf16 (which
// then runs with its per-head norms null): each token's q part (its first q_width elements) is
// RMS-normalised as one vector with q_norm [q_width], and its k part (the next k_width) with
// k_norm [k_width]; the v part is not touched. Per vector, rmsnorm_bf16's formula: bf16(x *
// rsqrt(mean(x^2) + eps) * w) in f32, one rounding. Each element is read and written by the same
// thread, after the block's reduction, so the update in place is safe.
// Launch: grid = (tokens, 2) (y = 0 the q part, 1 the k part), block = 256, no dynamic shared
// memory.
extern "C" __global__ void qk_norm_whole_bf16(__nv_bfloat16* __restrict__ qkv,
                                              const __nv_bfloat16* __restrict__ q_norm,
                                              const __nv_bfloat16* __restrict__ k_norm,
                                              uint32_t tokens, uint32_t q_width, uint32_t k_width,
                                              uint32_t row, float eps) {
    metrale::grid_dependency_sync();
    __shared__ float scratch[32];
    const uint32_t t = blockIdx.x;
    if (t >= tokens) return;
    const bool is_k = blockIdx.y == 1;
    const uint32_t cols = is_k ? k_width : q_width;
    const __nv_bfloat16* w = is_k ? k_norm : q_norm;
    __nv_bfloat16* x = qkv + (size_t)t * row + (is_k ? q_width : 0);
    float sq = 0.0f;
    for (uint32_t i = threadIdx.x; i < cols; i += blockDim.x) {
        const float v = metrale::to_f32(x[i]);
        sq += v * v;
    }
    const float inv = metrale::inverse_rms(sq, cols, eps, scratch);
    for (uint32_t i = threadIdx.x; i < cols; i += blockDim.x) {
        x[i] = metrale::to_bf16(metrale::to_f32(x[i]) * inv * metrale::to_f32(w[i]));
    }
}
