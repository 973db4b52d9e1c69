// SPDX-License-Identifier: MIT OR Apache-2.0
// Gates around a token mixer's output: the gated RMSNorm over groups of channels (Qwen3-Next's
// Gated DeltaNet output norm, the gate after the norm; Mamba-2's MambaRMSNormGated, the gate
// before it) and the sigmoid output gate of Qwen3-Next's gated attention.
// Host references: crates/kernels/src/ops/gated_norm.rs.
//
// Precision: every value is widened to f32, the whole expression computed in f32 and rounded to
// bf16 once, at the store.
#include "norm.cuh"

namespace {

// Threads per block of gated_rmsnorm (a multiple of 32; the group's width is walked in a loop).
constexpr uint32_t GATED_NORM_THREADS = 128;

__device__ __forceinline__ float silu(float x) { return x / (1.0f + expf(-x)); }

}  // namespace

// One (row, group) a block: out is bf16 [rows][groups * width], x the same shape in bf16, or in
// f32 when x_f32 is nonzero (Mamba-2's recurrence hands its output over unrounded); group g of row r is the
// `width` channels at g * width, normalised over those channels alone. The gate z of (r, g, i) is
// at z + r * z_stride + g * width + i (z may be columns of a wider projection row); the weight of
// (g, i) at weight + g * weight_group_stride + i (0: one weight of `width` shared by every group,
// as Qwen3-Next's per-head norm; `width`: a weight of groups * width, as Mamba-2's).
//   gate_first == 0: y = x * rsqrt(mean(x^2) + eps) * w * silu(z)
//   gate_first != 0: u = x * silu(z), y = u * rsqrt(mean(u^2) + eps) * w
// Launch: grid = rows * groups (block b is row b / groups, group b % groups), block = 128.
extern "C" __global__ void __launch_bounds__(GATED_NORM_THREADS)
    gated_rmsnorm(__nv_bfloat16* __restrict__ out, const void* __restrict__ x,
                  const __nv_bfloat16* __restrict__ z, const __nv_bfloat16* __restrict__ weight,
                  uint32_t rows, uint32_t groups, uint32_t width, uint32_t z_stride,
                  uint32_t weight_group_stride, float eps, uint32_t gate_first, uint32_t x_f32) {
    metrale::grid_dependency_sync();
    __shared__ float scratch[32];
    if (groups == 0) return;
    const uint32_t r = blockIdx.x / groups, g = blockIdx.x % groups;
    if (r >= rows) return;
    const size_t base = ((size_t)r * groups + g) * width;
    const __nv_bfloat16* xg = static_cast<const __nv_bfloat16*>(x) + base;
    const float* xg32 = static_cast<const float*>(x) + base;
    const __nv_bfloat16* zg = z + (size_t)r * z_stride + (size_t)g * width;
    const __nv_bfloat16* wg = weight + (size_t)g * weight_group_stride;
    __nv_bfloat16* yg = out + base;
    // The normalised value of element i before the weight: x, or x * silu(z) when the gate comes
    // first. Recomputed in the second pass rather than held (width is not bounded by the block).
    auto value = [&](uint32_t i) {
        const float v = x_f32 ? xg32[i] : metrale::to_f32(xg[i]);
        return gate_first ? v * silu(metrale::to_f32(zg[i])) : v;
    };
    float sq = 0.0f;
    for (uint32_t i = threadIdx.x; i < width; i += blockDim.x) {
        const float v = value(i);
        sq += v * v;
    }
    const float inv = metrale::inverse_rms(sq, width, eps, scratch);
    for (uint32_t i = threadIdx.x; i < width; i += blockDim.x) {
        float y = value(i) * inv * metrale::to_f32(wg[i]);
        if (!gate_first) y *= silu(metrale::to_f32(zg[i]));
        yg[i] = metrale::to_bf16(y);
    }
}

// x[r][i] = bf16(x * sigmoid(gate[r * gate_stride + i])) in place, x bf16 [rows][n] (the attention
// output before o_proj; the gate may be columns of the q projection's wider row).
// Launch: grid = ceil(rows * n / 256), block = 256, one element a thread.
extern "C" __global__ void __launch_bounds__(256)
    sigmoid_gate_mul(__nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ gate,
                     uint32_t rows, uint32_t n, uint32_t gate_stride) {
    metrale::grid_dependency_sync();
    const size_t e = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (n == 0 || e >= (size_t)rows * n) return;
    const size_t r = e / n, i = e % n;
    const float gt = metrale::to_f32(gate[r * gate_stride + i]);
    x[e] = metrale::to_bf16(metrale::to_f32(x[e]) / (1.0f + expf(-gt)));
}
