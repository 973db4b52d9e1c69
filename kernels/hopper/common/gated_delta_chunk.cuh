// SPDX-License-Identifier: MIT OR Apache-2.0
// What the chunked gated delta rule's two pairs of launches share (gated_delta.cu: the CUDA-core
// gdn_chunk_prep and gdn_chunk_scan; gated_delta_tc.cu: their tensor-core forms): the limits,
// a run's chunks, a chunk's running log-decays, and the forward substitution that gives T. The
// algebra and the buffers are described above gdn_chunk_prep in gated_delta.cu.
#pragma once
#include "common.cuh"

namespace {

// Widest key head the rule's kernels take (gdn_recurrent: a column of S across two lanes).
constexpr uint32_t GDN_MAX_DK = 128;
// Epsilon of the L2 normalisation of q and k.
constexpr float GDN_L2NORM_EPS = 1e-6f;
// Longest chunk (rows of T and P).
constexpr uint32_t GDN_CHUNK_MAX = 64;
// Threads of a block of the CUDA-core launches and of the tensor-core prep: four a chunk row
// (or a column of T), and (the CUDA-core scan's state update) two a row of S.
constexpr uint32_t GDN_CHUNK_THREADS = 256;
// Shared row stride (floats) of a row of T, L or P: four floats past a multiple of 32 banks.
constexpr uint32_t GDN_T_STRIDE = GDN_CHUNK_MAX + 4;

// The argument limits every chunked launch shares.
__device__ __forceinline__ bool gdn_chunk_shape_ok(uint32_t hv, uint32_t hk, uint32_t dk,
                                                   uint32_t chunk_len, uint32_t max_chunks) {
    return hk != 0 && hv % hk == 0 && dk != 0 && dk <= GDN_MAX_DK && chunk_len != 0 &&
           chunk_len <= GDN_CHUNK_MAX && max_chunks != 0;
}

// Chunks of a run of len tokens.
__device__ __forceinline__ uint32_t gdn_chunks_of(int32_t begin, int32_t end, uint32_t chunk_len) {
    return (uint32_t)(((int64_t)end - begin + chunk_len - 1) / chunk_len);
}

// gs[i] = G_i, the running sum of the chunk's log-decays of head h (tokens past n add 0), and
// bs[i] = beta_i (0 past n); the first warp, as an inclusive scan of two halves of 32.
__device__ __forceinline__ void gdn_load_decays(float* gs, float* bs, const float* g,
                                                const float* beta, int32_t first, uint32_t n,
                                                uint32_t h, uint32_t hv) {
    static_assert(GDN_CHUNK_MAX == 64, "two tokens a lane");
    if (threadIdx.x >= 32) return;
    const uint32_t lane = threadIdx.x;
    const size_t lo_at = (size_t)(first + (int32_t)lane) * hv + h;
    const size_t hi_at = lo_at + (size_t)32 * hv;
    float lo = lane < n ? g[lo_at] : 0.0f, hi = lane + 32 < n ? g[hi_at] : 0.0f;
    bs[lane] = lane < n ? beta[lo_at] : 0.0f;
    bs[lane + 32] = lane + 32 < n ? beta[hi_at] : 0.0f;
#pragma unroll
    for (uint32_t off = 1; off < 32; off *= 2) {
        const float x = __shfl_up_sync(0xffffffffu, lo, off);
        const float y = __shfl_up_sync(0xffffffffu, hi, off);
        if (lane >= off) {
            lo += x;
            hi += y;
        }
    }
    hi += __shfl_sync(0xffffffffu, lo, 31);
    gs[lane] = lo;
    gs[lane + 32] = hi;
}

// The chunk (seq, c) a block of a prep takes, or false: past its run's end, or its run has more
// chunks than max_chunks.
__device__ __forceinline__ bool gdn_chunk_at(const int32_t* seq_starts, uint32_t seq, uint32_t c,
                                             uint32_t chunk_len, uint32_t max_chunks,
                                             int32_t* first, uint32_t* n) {
    const int32_t begin = seq_starts[seq], end = seq_starts[seq + 1];
    const int64_t at = (int64_t)begin + (int64_t)c * chunk_len;
    if (at >= end || gdn_chunks_of(begin, end, chunk_len) > max_chunks) return false;
    *first = (int32_t)at;
    *n = (uint32_t)min((int64_t)chunk_len, (int64_t)end - at);
    return true;
}

// T = (I + L)^-1 into rows 0 .. n - 1 of ts, in f32, from L strictly below the diagonal of ls
// (both GDN_T_STRIDE apart; only ls[r][m] with m < r < n is read), by forward substitution
// column by column: T_jj = 1, T_rj = -sum_{j<=m<r} L_rm T_mj below, 0 above (row r of T is
// e_r - sum_{m<r} L_rm T_m, and column j needs only column j). Four threads a column (the
// block's GDN_CHUNK_THREADS) split each sum. Callers publish ls before and read ts after a
// barrier.
__device__ __forceinline__ void gdn_solve_t(float* ts, const float* ls, uint32_t n) {
    static_assert(GDN_CHUNK_THREADS == 4 * GDN_CHUNK_MAX, "four threads a column of T");
    const uint32_t j = threadIdx.x / 4, part = threadIdx.x % 4;
    for (uint32_t r = 0; r < n; ++r) {
        float sum = 0.0f;
        if (r > j) {
            for (uint32_t m = j + part; m < r; m += 4) {
                sum += ls[r * GDN_T_STRIDE + m] * ts[m * GDN_T_STRIDE + j];
            }
        }
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        if (part == 0) ts[r * GDN_T_STRIDE + j] = r == j ? 1.0f : (r > j ? -sum : 0.0f);
        __syncwarp();
    }
}

}  // namespace
