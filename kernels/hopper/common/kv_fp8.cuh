// SPDX-License-Identifier: MIT OR Apache-2.0
// The FP8 KV cache's element conversions (`--kv-cache-dtype fp8`). A cache element is
// e4m3(bf16(x) / scale): the value the bf16 cache would hold, divided by its layer's per-tensor
// scale (k_scale for keys, v_scale for values) in f32 (IEEE division), rounded to the nearest e4m3
// (ties to even) and saturated to +-448 (cvt.rn.satfinite; NaN stays NaN, 0x7F). Reading it back,
// every e4m3 value is exact in bf16 and in f16, so the attention kernels take the raw e4m3 values
// as their bf16 keys / f16 values and apply the scales in f32: k_scale on the scores, v_scale on
// the weighted sum. The host side is metrale_core::fp8 (the same rounding).
#pragma once
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <stdint.h>

#include "common.cuh"

namespace metrale::kv_fp8 {

// Two f32 to two e4m3 in the low 16 bits, `lo` in the low byte.
__device__ __forceinline__ uint32_t quantize2(float lo, float hi) {
    uint16_t r;
    // cvt ... d, a, b puts a in the upper byte and b in the lower.
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    return r;
}

// Four bf16 (a uint2, element 0 in the low half of .x) divided by `scale`, as four e4m3 bytes
// (element 0 in the low byte).
__device__ __forceinline__ uint32_t quantize4(uint2 x, float scale) {
    const float f0 = __uint_as_float(x.x << 16), f1 = __uint_as_float(x.x & 0xffff0000u);
    const float f2 = __uint_as_float(x.y << 16), f3 = __uint_as_float(x.y & 0xffff0000u);
    return quantize2(__fdiv_rn(f0, scale), __fdiv_rn(f1, scale)) |
           (quantize2(__fdiv_rn(f2, scale), __fdiv_rn(f3, scale)) << 16);
}

// One bf16 divided by `scale`, as an e4m3 byte.
__device__ __forceinline__ uint8_t quantize1(__nv_bfloat16 x, float scale) {
    return (uint8_t)(quantize2(__fdiv_rn(__bfloat162float(x), scale), 0.0f) & 0xffu);
}

// The two e4m3 of the low 16 bits of v as an f16x2 (exact).
__device__ __forceinline__ uint32_t to_f16x2(uint32_t v) {
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(v & 0xffffu), __NV_E4M3);
    return (uint32_t)h.x | ((uint32_t)h.y << 16);
}

// The two e4m3 of the low 16 bits of v as a bf16x2 (exact: through f16 and f32).
__device__ __forceinline__ uint32_t to_bf16x2(uint32_t v) {
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(v & 0xffffu), __NV_E4M3);
    const float2 f = __half22float2(__half2(h));
    const __nv_bfloat162 b = __floats2bfloat162_rn(f.x, f.y);
    return *reinterpret_cast<const uint32_t*>(&b);
}

// Four e4m3 bytes as four bf16 (a uint2) or four f16, exactly.
__device__ __forceinline__ uint2 to_bf16x4(uint32_t v) { return make_uint2(to_bf16x2(v), to_bf16x2(v >> 16)); }
__device__ __forceinline__ uint2 to_f16x4(uint32_t v) { return make_uint2(to_f16x2(v), to_f16x2(v >> 16)); }

}  // namespace metrale::kv_fp8
