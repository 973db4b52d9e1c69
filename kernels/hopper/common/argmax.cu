// SPDX-License-Identifier: MIT OR Apache-2.0
// Greedy sampling: out[r] = index of the largest logit of row r. Ties go to the lowest index; NaN
// never wins; a row of all NaN yields 0.
// Launch: grid = rows, block = 1024 (any multiple of 32 up to 1024). Rows whose length is a
// multiple of 16 bytes' worth of values (and 16-byte aligned) are read with vector loads, others
// one value per load.
#include "common.cuh"

namespace {

__device__ __forceinline__ bool better(float v, uint32_t i, float best, uint32_t best_i) {
    return v > best || (v == best && i < best_i);
}

// Keeps (v, i) as the thread's best if it beats it (NaN never does).
__device__ __forceinline__ void consider(float v, uint32_t i, float& best, uint32_t& best_i) {
    if (!isnan(v) && (best_i == 0xffffffffu || better(v, i, best, best_i))) {
        best = v;
        best_i = i;
    }
}

__device__ __forceinline__ void widen(const float4& raw, float (&v)[4]) {
    v[0] = raw.x;
    v[1] = raw.y;
    v[2] = raw.z;
    v[3] = raw.w;
}

__device__ __forceinline__ void widen(const float4& raw, float (&v)[8]) {
    const uint32_t w[4] = {__float_as_uint(raw.x), __float_as_uint(raw.y), __float_as_uint(raw.z),
                           __float_as_uint(raw.w)};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        v[2 * j] = __uint_as_float(w[j] << 16);
        v[2 * j + 1] = __uint_as_float(w[j] & 0xffff0000u);
    }
}

template <typename T>
__device__ void argmax_row(int32_t* out, const T* logits, uint32_t rows, uint32_t cols) {
    __shared__ float vals[32];
    __shared__ uint32_t idxs[32];
    const uint32_t r = blockIdx.x;
    if (r >= rows) return;
    const T* row = logits + (size_t)r * cols;
    float best = -INFINITY;
    uint32_t best_i = 0xffffffffu;
    // One block streams the whole row, so its speed is the bytes it keeps in flight: 16-byte
    // loads, UNROLL of them per thread issued before any comparison (128 KiB per block). Scalar
    // loads, 4 per thread, took 20 us for one Qwen3 row (152k f32) on the H200; before that, one
    // load at a time took 121 us.
    constexpr uint32_t PER = 16 / sizeof(T);  // values per 16-byte load
    constexpr uint32_t UNROLL = 8;
    uint32_t head = 0;  // values before this index are covered by the vector loop
    if (cols % PER == 0 && (reinterpret_cast<uintptr_t>(row) & 15) == 0) {
        const float4* vrow = reinterpret_cast<const float4*>(row);
        const uint32_t n = cols / PER;
        for (uint32_t base = threadIdx.x; base < n; base += UNROLL * blockDim.x) {
            float4 raw[UNROLL];
#pragma unroll
            for (uint32_t u = 0; u < UNROLL; ++u) {
                const uint32_t c = base + u * blockDim.x;
                raw[u] = c < n ? __ldg(vrow + c) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            }
            // Loads past the row are skipped by index, not padded: no padding value (a NaN's bits
            // read as bf16 pairs hold zeros) may take part.
#pragma unroll
            for (uint32_t u = 0; u < UNROLL; ++u) {
                const uint32_t c = base + u * blockDim.x;
                if (c >= n) break;
                float v[PER];
                widen(raw[u], v);
#pragma unroll
                for (uint32_t j = 0; j < PER; ++j) consider(v[j], c * PER + j, best, best_i);
            }
        }
        head = cols;
    }
    for (uint32_t i = head + threadIdx.x; i < cols; i += blockDim.x) consider((float)row[i], i, best, best_i);
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, best, offset);
        const uint32_t oi = __shfl_xor_sync(0xffffffffu, best_i, offset);
        if (oi != 0xffffffffu && (best_i == 0xffffffffu || better(ov, oi, best, best_i))) {
            best = ov;
            best_i = oi;
        }
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) {
        vals[warp] = best;
        idxs[warp] = best_i;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < (int)(blockDim.x >> 5); ++w) {
            if (idxs[w] != 0xffffffffu && (best_i == 0xffffffffu || better(vals[w], idxs[w], best, best_i))) {
                best = vals[w];
                best_i = idxs[w];
            }
        }
        out[r] = best_i == 0xffffffffu ? 0 : (int32_t)best_i;
    }
}

}  // namespace

extern "C" __global__ void __launch_bounds__(1024)
    argmax_bf16(int32_t* __restrict__ out, const __nv_bfloat16* __restrict__ logits, uint32_t rows,
                uint32_t cols) {
    metrale::grid_dependency_sync();
    argmax_row(out, logits, rows, cols);
}

extern "C" __global__ void __launch_bounds__(1024)
    argmax_f32(int32_t* __restrict__ out, const float* __restrict__ logits, uint32_t rows,
               uint32_t cols) {
    metrale::grid_dependency_sync();
    argmax_row(out, logits, rows, cols);
}
