// SPDX-License-Identifier: MIT OR Apache-2.0
// E4M3 weights to f32, exactly (through f16: every e4m3 value is an f16 value), for the kernels
// that read FP8 weights with their scales in registers (gemv_fp8.cu, moe_fp8.cu).
#pragma once
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <stdint.h>

namespace metrale {

// The two e4m3 of the low 16 bits of v (lower byte first), exactly.
__device__ __forceinline__ float2 e4m3x2(uint32_t v) {
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(v & 0xffffu), __NV_E4M3);
    return __half22float2(__half2(h));
}

__device__ __forceinline__ float e4m3(uint8_t b) {
    const __half_raw h = __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)b, __NV_E4M3);
    return __half2float(__half(h));
}

}  // namespace metrale
