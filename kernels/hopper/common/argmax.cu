// SPDX-License-Identifier: MIT OR Apache-2.0
// Greedy sampling: out[r] = index of the largest logit of row r. Ties go to the lowest index; NaN
// never wins; a row of all NaN yields 0.
// Launch: grid = (splits, rows), block = 256. Block b of row r takes values
// [b * CHUNK, (b + 1) * CHUNK) of the row (CHUNK = 256 threads x UNROLL 16-byte loads), each thread
// issuing its loads before any comparison; rows whose length is a multiple of 16 bytes' worth of
// values (and 16-byte aligned) are read with vector loads, others one value per load. The blocks
// of a row merge through `scratch` (u64 [2 * rows], zero before the first launch): each takes the
// atomic max of a 64-bit key (the value's order-preserving bits above the complement of its
// index, so that equal values keep the lower index; key 0 is "no value"), then counts itself in;
// the last block of the row reads the key, writes the index and zeroes both words, so the scratch
// is zero again for the next launch. One block per row took 15 us for a 152k-entry f32 row.
#include "common.cuh"

namespace {

constexpr uint32_t THREADS = 256;
constexpr uint32_t UNROLL = 4;

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

// The merge key of (v, i): larger values give larger keys, and of equal values the lower index;
// -0 counts as +0 (they compare equal). Never 0 for a value (-inf maps to 0x007fffff << 32).
__device__ __forceinline__ unsigned long long merge_key(float v, uint32_t i) {
    const uint32_t bits = __float_as_uint(v == 0.0f ? 0.0f : v);
    const uint32_t ordered = (bits & 0x80000000u) ? ~bits : bits | 0x80000000u;
    return ((unsigned long long)ordered << 32) | (0xffffffffu - i);
}

template <typename T>
__device__ void argmax_split(int32_t* out, const T* logits, uint32_t rows, uint32_t cols,
                             unsigned long long* scratch) {
    __shared__ float vals[THREADS / 32];
    __shared__ uint32_t idxs[THREADS / 32];
    const uint32_t r = blockIdx.y;
    if (r >= rows) return;
    const T* row = logits + (size_t)r * cols;
    constexpr uint32_t PER = 16 / sizeof(T);  // values per 16-byte load
    constexpr uint32_t CHUNK = THREADS * UNROLL * PER;
    const uint32_t first = blockIdx.x * CHUNK, last = min(cols, first + CHUNK);
    float best = -INFINITY;
    uint32_t best_i = 0xffffffffu;
    if (cols % PER == 0 && (reinterpret_cast<uintptr_t>(row) & 15) == 0) {
        const float4* vrow = reinterpret_cast<const float4*>(row);
        const uint32_t n = last / PER, base = first / PER + threadIdx.x;
        float4 raw[UNROLL];
#pragma unroll
        for (uint32_t u = 0; u < UNROLL; ++u) {
            const uint32_t c = base + u * THREADS;
            raw[u] = c < n ? __ldg(vrow + c) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
        // Loads past the chunk are skipped by index, not padded: no padding value (a NaN's bits
        // read as bf16 pairs hold zeros) may take part.
#pragma unroll
        for (uint32_t u = 0; u < UNROLL; ++u) {
            const uint32_t c = base + u * THREADS;
            if (c >= n) break;
            float v[PER];
            widen(raw[u], v);
#pragma unroll
            for (uint32_t j = 0; j < PER; ++j) consider(v[j], c * PER + j, best, best_i);
        }
    } else {
        for (uint32_t i = first + threadIdx.x; i < last; i += THREADS)
            consider((float)row[i], i, best, best_i);
    }
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
    if (threadIdx.x != 0) return;
    for (int w = 1; w < (int)(THREADS / 32); ++w) {
        if (idxs[w] != 0xffffffffu && (best_i == 0xffffffffu || better(vals[w], idxs[w], best, best_i))) {
            best = vals[w];
            best_i = idxs[w];
        }
    }
    unsigned long long* key = scratch + r;
    unsigned long long* arrived = scratch + rows + r;
    if (best_i != 0xffffffffu) atomicMax(key, merge_key(best, best_i));
    // The key is in before this block counts itself in; the last block sees every block's key.
    __threadfence();
    if (atomicAdd(arrived, 1ull) != gridDim.x - 1) return;
    const unsigned long long k = atomicExch(key, 0ull);
    atomicExch(arrived, 0ull);
    out[r] = k == 0 ? 0 : (int32_t)(0xffffffffu - (uint32_t)k);
}

}  // namespace

extern "C" __global__ void __launch_bounds__(THREADS)
    argmax_bf16(int32_t* __restrict__ out, const __nv_bfloat16* __restrict__ logits, uint32_t rows,
                uint32_t cols, unsigned long long* __restrict__ scratch) {
    metrale::grid_dependency_sync();
    if (blockDim.x != THREADS) return;
    argmax_split(out, logits, rows, cols, scratch);
}

extern "C" __global__ void __launch_bounds__(THREADS)
    argmax_f32(int32_t* __restrict__ out, const float* __restrict__ logits, uint32_t rows,
               uint32_t cols, unsigned long long* __restrict__ scratch) {
    metrale::grid_dependency_sync();
    if (blockDim.x != THREADS) return;
    argmax_split(out, logits, rows, cols, scratch);
}
