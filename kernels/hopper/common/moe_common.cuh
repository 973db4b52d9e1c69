// SPDX-License-Identifier: MIT OR Apache-2.0
// What the MoE kernels (moe.cu, moe_fp8.cu) share: their bounds, the expert-id test, the
// experts' activations (ExpertAct: each row's dot rounded to bf16 first, then the activation in
// f32), the shared expert's epilogue term, and the weight-stream load.
#pragma once
#include <stdint.h>

#include "common.cuh"

namespace metrale::moe {

// Most experts any MoE entry takes (the routing warp holds 16 a lane; moe_group's per-warp
// histograms fill 32 KiB of shared memory). Must match MOE_MAX_EXPERTS in ops/moe.rs.
constexpr uint32_t MAX_EXPERTS = 512;
// Most experts a row takes. Must match MOE_MAX_TOP_K in ops/moe.rs.
constexpr uint32_t MAX_TOP_K = 16;
constexpr uint32_t FULL = 0xffffffffu;

// An id outside [0, experts) is "no expert" (expert parallelism may leave a slot empty).
__device__ __forceinline__ bool valid_expert(int32_t e, uint32_t experts) {
    return e >= 0 && (uint32_t)e < experts;
}

__device__ __forceinline__ bool aligned16(const void* p) {
    return (reinterpret_cast<uintptr_t>(p) & 15) == 0;
}

// As gemv.cu's: a weight byte is read once, so it does not displace the activations in L1.
__device__ __forceinline__ uint4 load_stream(const uint4* p) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
    return v;
}

// The low and high bf16 of a packed pair, as f32.
__device__ __forceinline__ float lo(uint32_t v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float hi(uint32_t v) { return __uint_as_float(v & 0xffff0000u); }

__device__ __forceinline__ float swiglu(float g, float u) { return g / (1.0f + __expf(-g)) * u; }

// silu(g) * u of the bf16-rounded products, as silu_mul_bf16 computes it on what a bf16 gate|up
// product stores.
__device__ __forceinline__ float swiglu_of_products(float g, float u) {
    return swiglu(metrale::to_f32(metrale::to_bf16(g)), metrale::to_f32(metrale::to_bf16(u)));
}

// The experts' activation, a template parameter of every first-product entry. ROWS weight rows a
// column: SwiGLU's gate row j and up row inter + j, ReLU^2's up row j. of() takes those rows'
// f32 dots and rounds each to bf16 first (what a bf16 product stores), then applies the
// activation in f32; the caller rounds the result once (the bits of a bf16 gate|up product and
// silu_mul_bf16, or of a bf16 up product and relu2_bf16).
enum class Act { SwiGlu, Relu2 };
template <Act A>
struct ExpertAct;
template <>
struct ExpertAct<Act::SwiGlu> {
    static constexpr int ROWS = 2;
    __device__ __forceinline__ static float of(const float (&v)[2]) {
        return swiglu_of_products(v[0], v[1]);
    }
};
template <>
struct ExpertAct<Act::Relu2> {
    static constexpr int ROWS = 1;
    __device__ __forceinline__ static float of(const float (&v)[1]) {
        const float u = fmaxf(metrale::to_f32(metrale::to_bf16(v[0])), 0.0f);
        return u * u;
    }
};

// The shared expert's term added to a row's routed sum, in f32 before the one rounding:
// sum + g * shared[r, h] with g = sigmoid(shared_gate[r]) (1 where shared_gate is null); the sum
// unchanged where shared is null (no shared expert).
__device__ __forceinline__ float add_shared(float sum, const __nv_bfloat16* __restrict__ shared,
                                            const float* __restrict__ shared_gate, size_t r,
                                            size_t h, uint32_t hidden) {
    if (shared == nullptr) return sum;
    const float g = shared_gate != nullptr ? 1.0f / (1.0f + expf(-shared_gate[r])) : 1.0f;
    return fmaf(g, metrale::to_f32(shared[r * hidden + h]), sum);
}

}  // namespace metrale::moe
