// SPDX-License-Identifier: MIT OR Apache-2.0
// One head of the QKV post-processing (qk-norm, NeoX RoPE), the vector form: a group of
// L = head_dim / 8 lanes (a power of two up to 32, aligned within the warp) takes one head, lane j
// owning elements [4 j, 4 j + 4) and [head_dim / 2 + 4 j, head_dim / 2 + 4 j + 4). Shared by
// qkv_post.cu (all heads of all tokens) and the decode attention that does the same work for its
// own heads (attention.cu), so that both round the same f32 values to the same bf16 bits.
#pragma once
#include "common.cuh"
#include "norm.cuh"

namespace metrale {
namespace qkv_post {

// Sum over an aligned group of `lanes` lanes (a power of two). Every lane of the warp calls it.
__device__ __forceinline__ float group_sum(float v, uint32_t lanes) {
    for (uint32_t o = lanes / 2; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ void unpack4(uint2 v, float (&f)[4]) {
    f[0] = __uint_as_float(v.x << 16);
    f[1] = __uint_as_float(v.x & 0xffff0000u);
    f[2] = __uint_as_float(v.y << 16);
    f[3] = __uint_as_float(v.y & 0xffff0000u);
}

__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
    const __nv_bfloat162 p = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&p);
}

__device__ __forceinline__ uint2 pack4(const float (&f)[4]) {
    return make_uint2(pack2(f[0], f[1]), pack2(f[2], f[3]));
}

// The sum of squares of one head over its lane group, from this lane's two raw 4-element pieces
// (ra = elements [e, e + 4), rb = [half + e, half + e + 4)). Every lane of the warp calls it.
__device__ __forceinline__ float head_sum_sq(uint2 ra, uint2 rb, uint32_t lanes) {
    float a[4], b[4];
    unpack4(ra, a);
    unpack4(rb, b);
    float ss = 0.0f;
#pragma unroll
    for (int i = 0; i < 4; ++i) ss += a[i] * a[i] + b[i] * b[i];
    return group_sum(ss, lanes);
}

// What transform reads besides the head: this lane's pieces of the norm weight and of row `pos`
// of the cos/sin tables. Neither depends on the kernel before (weights and tables are uploaded
// once), so a kernel may load them before its programmatic-launch wait.
struct Params {
    uint2 wa = make_uint2(0, 0), wb = make_uint2(0, 0);  // norm weight [e, e + 4), [half + e, ..)
    float4 c = make_float4(0, 0, 0, 0), s = make_float4(0, 0, 0, 0);  // cos, sin [e, e + 4)
};

// `norm`, `cos_table` and `sin_table` must be 8-, 16- and 16-byte aligned at the lane's elements;
// a null norm or rotate == false loads nothing for it.
__device__ __forceinline__ Params load_params(const __nv_bfloat16* norm, bool rotate, int32_t pos,
                                              const float* cos_table, const float* sin_table,
                                              uint32_t e, uint32_t half) {
    Params p;
    if (norm != nullptr) {
        p.wa = __ldg(reinterpret_cast<const uint2*>(norm + e));
        p.wb = __ldg(reinterpret_cast<const uint2*>(norm + half + e));
    }
    if (rotate) {
        const size_t row = (size_t)pos * half + e;
        p.c = __ldg(reinterpret_cast<const float4*>(cos_table + row));
        p.s = __ldg(reinterpret_cast<const float4*>(sin_table + row));
    }
    return p;
}

// The norm's scaling of this lane's pieces: x * inv * (offset + w) (inv = rsqrt(ss / head_dim +
// eps); the scale is norm.cuh's norm_scale: an offset of 0 is the plain weight bit for bit).
__device__ __forceinline__ void apply_norm(float (&a)[4], float (&b)[4], float inv, uint2 wa_bits,
                                           uint2 wb_bits, float offset) {
    float wa[4], wb[4];
    unpack4(wa_bits, wa);
    unpack4(wb_bits, wb);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        a[i] = a[i] * inv * norm_scale(wa[i], offset);
        b[i] = b[i] * inv * norm_scale(wb[i], offset);
    }
}

// The NeoX rotation of this lane's pairs (a[i], b[i]) by its cos/sin pieces.
__device__ __forceinline__ void apply_rope(float (&a)[4], float (&b)[4], float4 c4, float4 s4) {
    const float c[4] = {c4.x, c4.y, c4.z, c4.w}, s[4] = {s4.x, s4.y, s4.z, s4.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float x0 = a[i], x1 = b[i];
        a[i] = x0 * c[i] - x1 * s[i];
        b[i] = x1 * c[i] + x0 * s[i];
    }
}

// This lane's two pieces of a q or k head after the norm (when `norm`: x * rsqrt(ss / head_dim +
// eps) * (offset + w), rmsnorm_bf16's formula at offset 0) and the rotation (when `rotate`),
// rounded once to bf16; `p` from load_params with the same norm and rotate.
__device__ __forceinline__ void transform(uint2& ra, uint2& rb, float ss, bool norm, bool rotate,
                                          const Params& p, uint32_t head_dim, float eps,
                                          float offset) {
    float a[4], b[4];
    unpack4(ra, a);
    unpack4(rb, b);
    if (norm) apply_norm(a, b, rsqrtf(ss / (float)head_dim + eps), p.wa, p.wb, offset);
    if (rotate) apply_rope(a, b, p.c, p.s);
    ra = pack4(a);
    rb = pack4(b);
}

// transform with each load right before its use (the same arithmetic): for a kernel with many
// heads in flight and few registers to hold the parameters early (qkv_post.cu).
__device__ __forceinline__ void transform_loading(uint2& ra, uint2& rb, float ss,
                                                  const __nv_bfloat16* norm, bool rotate,
                                                  int32_t pos, const float* cos_table,
                                                  const float* sin_table, uint32_t e,
                                                  uint32_t half, uint32_t head_dim, float eps,
                                                  float offset) {
    float a[4], b[4];
    unpack4(ra, a);
    unpack4(rb, b);
    if (norm != nullptr)
        apply_norm(a, b, rsqrtf(ss / (float)head_dim + eps),
                   __ldg(reinterpret_cast<const uint2*>(norm + e)),
                   __ldg(reinterpret_cast<const uint2*>(norm + half + e)), offset);
    if (rotate) {
        const size_t row = (size_t)pos * half + e;
        apply_rope(a, b, __ldg(reinterpret_cast<const float4*>(cos_table + row)),
                   __ldg(reinterpret_cast<const float4*>(sin_table + row)));
    }
    ra = pack4(a);
    rb = pack4(b);
}

}  // namespace qkv_post
}  // namespace metrale
