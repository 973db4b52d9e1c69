// SPDX-License-Identifier: MIT OR Apache-2.0
// The chunked gated delta rule with its matrix products on tensor cores (mma.sync m16n8k16, bf16
// operands, f32 accumulators): gdn_chunk_prep_tc and gdn_chunk_scan_tc take gdn_chunk_prep's and
// gdn_chunk_scan's arguments, grids and scratch (T and P f32 [tokens][hv][chunk_len]); the
// algebra, the buffers and the limits are described above gdn_chunk_prep in gated_delta.cu. Host
// references: crates/kernels/src/ops/gated_delta/tensor_cores.rs (chunk_factors_tc,
// chunk_apply_tc), which round the same values.
//
// Precision, as flash-linear-attention's chunk_gated_delta_rule: every tensor-core operand is
// bf16 and every product accumulates in f32; the running log-decays, the decays, the triangular
// solve and the state carried from chunk to chunk stay f32. Rounded to bf16 before a product:
//   q^ = bf16(q dk^-1/2 / |q|), k^ = bf16(k / |k|)   (the norms in f32 from the bf16 inputs)
//   S^ = bf16(S), the state entering the chunk       (K S, Q S)
//   X  = bf16(beta (v - exp(G) k^ S^))                (V' = T^ X)
//   T^ = bf16(T), P^ = bf16(P)                        (T solved and P scaled in f32 by the prep)
//   V'^ = bf16(V'), W = bf16(exp(G_{n-1} - G) V')     (O = exp(G) q^ S^ + P^ V'^, S += k^T W)
// while L = beta D (k^ k^T) and P = D (q^ k^T) are f32 from the products, and S is f32 in
// registers for the whole run (S = exp(G_{n-1}) S + k^T W accumulates into it). Where this
// differs from flash-linear-attention: it stores U = T^ bf16(beta v) and W' = T^ bf16(beta exp(G)
// k) in bf16 and forms V' = U - W' S^; here the difference v - exp(G) k^ S^ is formed in f32
// before its one rounding (X), so a state that already predicts v well loses no digits to the
// cancellation.
//
// Work at Qwen3.5-35B-A3B's Gated DeltaNet widths (32 value heads over 16 key heads, dk = dv =
// 128; Qwen3-Next-80B-A3B's are the same), one sequence of 8192 tokens: 128 chunks of 64 tokens a
// value head, 4096 (chunk, head) pairs a layer. Per pair, as issued (n-tiles or k-steps wholly
// right of the diagonal skipped, 20 of 32 n-tiles and 10 of 16 k-steps):
//   prep  K K^T and Q K^T        2 x 2 x 64 x 64 x 128 x 20/32  = 1.31 MFLOP  tensor cores
//         T = (I + L)^-1         sum_r sum_{j<r} (r - j) x 2    = 0.09 MFLOP  CUDA cores, f32
//   scan  K S and Q S            2 x 2 x 64 x 128 x 128         = 4.19 MFLOP  tensor cores
//         T X and P V'           2 x 2 x 64 x 64 x 128 x 10/16  = 1.31 MFLOP  tensor cores
//         S += K^T W             2 x 128 x 64 x 128             = 2.10 MFLOP  tensor cores
// so 8.9 MFLOP a pair, 36.5 GFLOP a layer (43.4 GFLOP counted as full dense products; the CUDA-
// core pair issues about that, 1.79 ms a layer on the H200: 24 TFLOP/s).
// Bytes, the same layer: q and k 32 MiB each, v 64 MiB, g and beta 2 MiB (read once from DRAM);
// T and P 2 x 64 MiB f32 written by the prep and read back by the scan; o 64 MiB; the state
// 2 MiB in and 2 MiB out: about 0.45 GiB, 0.10 ms at 4.8 TB/s. Through L2 the scan reads more:
// each of a head's 8 blocks of 16 columns reads its chunk's q and k (16 readers a key head: 1
// GiB) and T and P (8 readers: 1 GiB), about 2.1 GiB a layer in all, ~0.2 ms at L2 speed.
// Expected: the prep ~0.05 ms (4096 independent blocks, 2 an SM), the scan ~0.25-0.4 ms (256
// blocks, one wave at 3 an SM, 128 chunks in order a block, four barriers a chunk, the next
// chunk's loads not yet overlapped with this one's products): 0.3-0.45 ms a layer against the
// CUDA-core pair's 1.79 ms. GPU-unverified (docs/decisions.md).
#include "gated_delta_chunk.cuh"
#include "mma.cuh"

namespace {
// Threads of a scan block: four warps, each a 16-row m-tile of the chunk (and 32 rows of S).
constexpr uint32_t TC_SCAN_THREADS = 128;
// Value columns (of S, v and o) one scan block owns: two n-tiles of 8.
constexpr uint32_t TC_SCAN_COLS = 16;
// bf16 row strides of the shared tiles: 8 elements (16 bytes) past a multiple of 16, so the
// eight 16-byte rows an ldmatrix reads fall in distinct bank groups.
constexpr uint32_t TC_QK_STRIDE = GDN_MAX_DK + 8;     // q^, k^: 272 bytes
constexpr uint32_t TC_T_STRIDE = GDN_CHUNK_MAX + 8;   // T^, P^: 144 bytes
constexpr uint32_t TC_COL_STRIDE = TC_SCAN_COLS + 8;  // S^, X, V'^, W: 48 bytes
constexpr uint32_t TC_QK_ELEMS = GDN_CHUNK_MAX * TC_QK_STRIDE;
constexpr uint32_t TC_T_ELEMS = GDN_CHUNK_MAX * TC_T_STRIDE;
constexpr uint32_t TC_COL_ELEMS = GDN_CHUNK_MAX * TC_COL_STRIDE;
constexpr uint32_t TC_F32_T_FLOATS = GDN_CHUNK_MAX * GDN_T_STRIDE;
// Dynamic shared memory of gdn_chunk_prep_tc: q^ and k^ (bf16), L, P and T (f32), G, beta.
constexpr uint32_t TC_PREP_SMEM = 2 * 2 * TC_QK_ELEMS + 4 * (3 * TC_F32_T_FLOATS + 2 * GDN_CHUNK_MAX);
// Dynamic shared memory of gdn_chunk_scan_tc: q^, k^, T^, P^, S^ (dk x 16), X, V'^ and W (bf16),
// then G, beta and the state update's decays (f32).
constexpr uint32_t TC_SCAN_SMEM =
    2 * (2 * TC_QK_ELEMS + 2 * TC_T_ELEMS + GDN_MAX_DK * TC_COL_STRIDE + 3 * TC_COL_ELEMS) +
    4 * 3 * GDN_CHUNK_MAX;
// The byte counts the host side launches with (GDN_CHUNK_PREP_TC_SMEM, GDN_CHUNK_SCAN_TC_SMEM in
// crates/kernels/src/ops/gated_delta/tensor_cores.rs).
static_assert(TC_PREP_SMEM == 87552, "the host's gdn_chunk_prep_tc shared memory");
static_assert(TC_SCAN_SMEM == 69376, "the host's gdn_chunk_scan_tc shared memory");
static_assert(GDN_CHUNK_MAX == 4 * 16, "four m-tiles a chunk, a warp each");
static_assert(GDN_MAX_DK == (TC_SCAN_THREADS / 32) * 32, "32 rows of S a scan warp");
static_assert(GDN_CHUNK_THREADS == 8 * 32, "the prep's eight warps: four m-tiles x two halves");
static_assert((2 * TC_QK_ELEMS) % 8 == 0 && (2 * TC_T_ELEMS) % 16 == 0 &&
                  (2 * TC_COL_ELEMS) % 16 == 0 && (2 * GDN_MAX_DK * TC_COL_STRIDE) % 16 == 0,
              "16-byte aligned tiles for ldmatrix");

// Rows 0 .. n - 1 of the bf16 tiles qs and ks (TC_QK_STRIDE apart): q^ and k^ of the chunk's
// tokens and key head kh (see above: q scaled by dk^-1/2, both L2-normalised in f32, then
// rounded); every other element of the GDN_CHUNK_MAX x TC_QK_STRIDE tiles zero. A warp a row.
template <uint32_t THREADS>
__device__ __forceinline__ void gdn_load_qk_bf16(__nv_bfloat16* qs, __nv_bfloat16* ks,
                                                 const __nv_bfloat16* q, const __nv_bfloat16* k,
                                                 int32_t first, uint32_t n, uint32_t kh,
                                                 uint32_t dk, uint32_t qkv_stride) {
    constexpr uint32_t PER_LANE = (TC_QK_STRIDE + 31) / 32;
    const uint32_t lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const float q_scale = rsqrtf((float)dk);
    for (uint32_t i = warp; i < GDN_CHUNK_MAX; i += THREADS / 32) {
        const size_t at = (size_t)(first + (int32_t)i) * qkv_stride + (size_t)kh * dk;
        float qv[PER_LANE], kv[PER_LANE], qq = 0.0f, kk = 0.0f;
#pragma unroll
        for (uint32_t r = 0; r < PER_LANE; ++r) {
            const uint32_t a = lane + 32 * r;
            const bool live = i < n && a < dk;
            qv[r] = live ? metrale::to_f32(q[at + a]) : 0.0f;
            kv[r] = live ? metrale::to_f32(k[at + a]) : 0.0f;
            qq += qv[r] * qv[r];
            kk += kv[r] * kv[r];
        }
        const float q_norm = q_scale / sqrtf(metrale::warp_sum(qq) + GDN_L2NORM_EPS);
        const float k_norm = 1.0f / sqrtf(metrale::warp_sum(kk) + GDN_L2NORM_EPS);
#pragma unroll
        for (uint32_t r = 0; r < PER_LANE; ++r) {
            const uint32_t a = lane + 32 * r;
            if (a < TC_QK_STRIDE) {
                qs[i * TC_QK_STRIDE + a] = metrale::to_bf16(qv[r] * q_norm);
                ks[i * TC_QK_STRIDE + a] = metrale::to_bf16(kv[r] * k_norm);
            }
        }
    }
}

// The shared-window byte address of element (row, col) of a bf16 tile `stride` elements a row.
__device__ __forceinline__ uint32_t tile_at(uint32_t base, uint32_t row, uint32_t col,
                                            uint32_t stride) {
    return base + (row * stride + col) * 2;
}

// The A fragment (16 x 16, row-major) at rows m0.., columns k0.. of a bf16 tile.
__device__ __forceinline__ void load_a(uint32_t (&a)[4], uint32_t base, uint32_t m0, uint32_t k0,
                                       uint32_t stride) {
    const uint32_t lane = threadIdx.x % 32;
    metrale::ldmatrix_x4(a, tile_at(base, m0 + lane % 16, k0 + 8 * (lane / 16), stride));
}

// The A fragment (16 x 16) of the transpose of a bf16 tile: A[m][k] = tile[k0 + k][m0 + m].
__device__ __forceinline__ void load_a_trans(uint32_t (&a)[4], uint32_t base, uint32_t m0,
                                             uint32_t k0, uint32_t stride) {
    const uint32_t lane = threadIdx.x % 32, i = lane / 8;
    metrale::ldmatrix_x4_trans(
        a, tile_at(base, k0 + lane % 8 + 8 * (i / 2), m0 + 8 * (i % 2), stride));
}

// The B fragments of two n-tiles (16 x 8 each, k0.., columns n0.. and n0 + 8..) of a bf16 tile
// stored k-major (tile[k][n]): b[0], b[1] the first n-tile's, b[2], b[3] the second's.
__device__ __forceinline__ void load_b_kn(uint32_t (&b)[4], uint32_t base, uint32_t k0,
                                          uint32_t n0, uint32_t stride) {
    const uint32_t lane = threadIdx.x % 32;
    metrale::ldmatrix_x4_trans(
        b, tile_at(base, k0 + lane % 8 + 8 * ((lane / 8) % 2), n0 + 8 * (lane / 16), stride));
}

// The same of a bf16 tile stored n-major (tile[n][k], the B of a product with a tile's
// transpose, as K^T in K K^T).
__device__ __forceinline__ void load_b_nk(uint32_t (&b)[4], uint32_t base, uint32_t k0,
                                          uint32_t n0, uint32_t stride) {
    const uint32_t lane = threadIdx.x % 32;
    metrale::ldmatrix_x4(
        b, tile_at(base, n0 + lane % 8 + 8 * (lane / 16), k0 + 8 * ((lane / 8) % 2), stride));
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
    return (uint32_t)__cvta_generic_to_shared(p);
}

}  // namespace

// Pass 1, tensor-core form of gdn_chunk_prep (same arguments, grid and outputs): per (chunk,
// value head, sequence), q^ and k^ into shared memory; warp w takes m-tile w % 4 (16 rows) and
// n-tiles 4 (w / 4) .. + 3 of K K^T and Q K^T (those wholly right of the m-tile's diagonal
// skipped), then L and P in f32 from the accumulators; T by forward substitution in f32
// (gdn_solve_t); P and T out, a row a token.
// Launch: grid = (max_chunks, hv, seqs), block = GDN_CHUNK_THREADS, TC_PREP_SMEM bytes of dynamic
// shared memory.
extern "C" __global__ void __launch_bounds__(GDN_CHUNK_THREADS)
    gdn_chunk_prep_tc(float* __restrict__ t_mat, float* __restrict__ attn,
                      const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k,
                      const float* __restrict__ g, const float* __restrict__ beta,
                      const int32_t* __restrict__ seq_starts, uint32_t seqs, uint32_t hv,
                      uint32_t hk, uint32_t dk, uint32_t qkv_stride, uint32_t chunk_len,
                      uint32_t max_chunks) {
    metrale::grid_dependency_sync();
    if (!gdn_chunk_shape_ok(hv, hk, dk, chunk_len, max_chunks) || blockIdx.z >= seqs ||
        blockIdx.y >= hv || blockIdx.x >= max_chunks) {
        return;
    }
    const uint32_t h = blockIdx.y, kh = h / (hv / hk);
    int32_t first = 0;
    uint32_t n = 0;
    if (!gdn_chunk_at(seq_starts, blockIdx.z, blockIdx.x, chunk_len, max_chunks, &first, &n)) {
        return;
    }
    extern __shared__ __align__(16) unsigned char gdn_tc_smem[];
    __nv_bfloat16* qs = reinterpret_cast<__nv_bfloat16*>(gdn_tc_smem);
    __nv_bfloat16* ks = qs + TC_QK_ELEMS;
    float* ls = reinterpret_cast<float*>(ks + TC_QK_ELEMS);
    float* ps = ls + TC_F32_T_FLOATS;
    float* ts = ps + TC_F32_T_FLOATS;
    float* gs = ts + TC_F32_T_FLOATS;
    float* bs = gs + GDN_CHUNK_MAX;
    gdn_load_qk_bf16<GDN_CHUNK_THREADS>(qs, ks, q, k, first, n, kh, dk, qkv_stride);
    gdn_load_decays(gs, bs, g, beta, first, n, h, hv);
    __syncthreads();

    const uint32_t tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const uint32_t mt = warp % 4, nt0 = 4 * (warp / 4);
    // n-tile pairs (nt0 + 2p, nt0 + 2p + 1) with a column at or left of the m-tile's last row
    // 16 mt + 15: nt <= 2 mt + 1 (nt is even, so a pair is live or dead as a whole).
    const uint32_t qa = smem_addr(qs), ka = smem_addr(ks);
    const uint32_t dk16 = (dk + 15) & ~15u;
    float kk[4][4], qk[4][4];
#pragma unroll
    for (uint32_t t = 0; t < 4; ++t) {
#pragma unroll
        for (uint32_t e = 0; e < 4; ++e) kk[t][e] = qk[t][e] = 0.0f;
    }
    for (uint32_t kb = 0; kb < dk16; kb += 16) {
        uint32_t ak[4], aq[4];
        load_a(ak, ka, 16 * mt, kb, TC_QK_STRIDE);
        load_a(aq, qa, 16 * mt, kb, TC_QK_STRIDE);
#pragma unroll
        for (uint32_t p = 0; p < 2; ++p) {
            const uint32_t nt = nt0 + 2 * p;
            if (nt > 2 * mt + 1) break;
            uint32_t b[4];
            load_b_nk(b, ka, kb, 8 * nt, TC_QK_STRIDE);
            metrale::mma_bf16(kk[2 * p], ak, b[0], b[1]);
            metrale::mma_bf16(kk[2 * p + 1], ak, b[2], b[3]);
            metrale::mma_bf16(qk[2 * p], aq, b[0], b[1]);
            metrale::mma_bf16(qk[2 * p + 1], aq, b[2], b[3]);
        }
    }
    // L_ij = beta_i D_ij k^_i.k^_j (j < i) and P_ij = D_ij q^_i.k^_j (j <= i), f32. Entries right
    // of the diagonal and in skipped tiles are never read.
    const uint32_t g8 = lane / 4, tg = lane % 4;
#pragma unroll
    for (uint32_t t = 0; t < 4; ++t) {
        const uint32_t nt = nt0 + t;
        if (nt > 2 * mt + 1) break;
#pragma unroll
        for (uint32_t e = 0; e < 4; ++e) {
            const uint32_t i = 16 * mt + g8 + 8 * (e / 2), j = 8 * nt + 2 * tg + e % 2;
            const float d = (i < n && j <= i) ? expf(gs[i] - gs[j]) : 0.0f;
            ls[i * GDN_T_STRIDE + j] = j < i ? bs[i] * d * kk[t][e] : 0.0f;
            ps[i * GDN_T_STRIDE + j] = d * qk[t][e];
        }
    }
    __syncthreads();
    gdn_solve_t(ts, ls, n);
    for (uint32_t e = tid; e < n * chunk_len; e += GDN_CHUNK_THREADS) {
        const uint32_t r = e / chunk_len, j = e % chunk_len;
        attn[((size_t)(first + (int32_t)r) * hv + h) * chunk_len + j] =
            j <= r ? ps[r * GDN_T_STRIDE + j] : 0.0f;
    }
    __syncthreads();
    for (uint32_t e = tid; e < n * chunk_len; e += GDN_CHUNK_THREADS) {
        const uint32_t r = e / chunk_len, j = e % chunk_len;
        t_mat[((size_t)(first + (int32_t)r) * hv + h) * chunk_len + j] = ts[r * GDN_T_STRIDE + j];
    }
}

// Pass 2, tensor-core form of gdn_chunk_scan (same arguments, grid and outputs): per (block of
// TC_SCAN_COLS value columns, value head, sequence), the run's chunks in order. Warp w holds rows
// 32 w .. 32 w + 31 of the block's columns of S in f32 registers (the accumulator layout of two
// m-tiles by two n-tiles) for the whole run, publishing S^ = bf16(S) to shared memory before each
// chunk. Per chunk: q^, k^, T^, P^, G, beta into shared memory and this lane's v into registers;
// warp w takes the chunk's rows 16 w .. 16 w + 15 of K S and Q S (k-steps over dk), forms X in
// f32 and rounds it; of V' = T^ X and of O += P^ V'^ (k-steps up to its diagonal block); then its
// rows of S += k^T W (k-steps over the chunk's tokens).
// Launch: grid = (ceil(dv / TC_SCAN_COLS), hv, seqs), block = TC_SCAN_THREADS, TC_SCAN_SMEM bytes
// of dynamic shared memory.
extern "C" __global__ void __launch_bounds__(TC_SCAN_THREADS)
    gdn_chunk_scan_tc(__nv_bfloat16* __restrict__ o, float* __restrict__ state,
                      const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k,
                      const __nv_bfloat16* __restrict__ v, const float* __restrict__ g,
                      const float* __restrict__ beta, const float* __restrict__ t_mat,
                      const float* __restrict__ attn, const int32_t* __restrict__ seq_starts,
                      const int32_t* __restrict__ slots, const int32_t* __restrict__ positions,
                      uint32_t seqs, uint32_t hv, uint32_t hk, uint32_t dk, uint32_t dv,
                      uint32_t qkv_stride, uint32_t chunk_len, uint32_t max_chunks) {
    metrale::grid_dependency_sync();
    if (!gdn_chunk_shape_ok(hv, hk, dk, chunk_len, max_chunks) || blockIdx.z >= seqs ||
        blockIdx.y >= hv) {
        return;
    }
    const uint32_t seq = blockIdx.z, h = blockIdx.y, kh = h / (hv / hk);
    const int32_t begin = seq_starts[seq], end = seq_starts[seq + 1];
    // An empty run has no first position: its state is left as it is.
    if (begin >= end || gdn_chunks_of(begin, end, chunk_len) > max_chunks) return;
    const bool fresh = positions[begin] == 0;
    const uint32_t col0 = blockIdx.x * TC_SCAN_COLS;
    float* slot = state + ((size_t)slots[seq] * hv + h) * dk * dv;

    extern __shared__ __align__(16) unsigned char gdn_tc_smem[];
    __nv_bfloat16* qs = reinterpret_cast<__nv_bfloat16*>(gdn_tc_smem);
    __nv_bfloat16* ks = qs + TC_QK_ELEMS;
    __nv_bfloat16* ts = ks + TC_QK_ELEMS;
    __nv_bfloat16* ps = ts + TC_T_ELEMS;
    __nv_bfloat16* ss = ps + TC_T_ELEMS;
    __nv_bfloat16* xs = ss + GDN_MAX_DK * TC_COL_STRIDE;
    __nv_bfloat16* vs = xs + TC_COL_ELEMS;
    __nv_bfloat16* ws = vs + TC_COL_ELEMS;
    float* gs = reinterpret_cast<float*>(ws + TC_COL_ELEMS);
    float* bs = gs + GDN_CHUNK_MAX;
    float* kdec = bs + GDN_CHUNK_MAX;
    const uint32_t qa = smem_addr(qs), ka = smem_addr(ks), ta = smem_addr(ts), pa = smem_addr(ps),
                   sa = smem_addr(ss), xa = smem_addr(xs), va = smem_addr(vs), wa = smem_addr(ws);

    const uint32_t tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const uint32_t g8 = lane / 4, tg = lane % 4;
    const uint32_t dk16 = (dk + 15) & ~15u;
    // S: st[mi][nt][e] is row 32 warp + 16 mi + g8 + 8 (e / 2), column 8 nt + 2 tg + e % 2.
    float st[2][2][4];
#pragma unroll
    for (uint32_t mi = 0; mi < 2; ++mi) {
#pragma unroll
        for (uint32_t nt = 0; nt < 2; ++nt) {
#pragma unroll
            for (uint32_t e = 0; e < 4; ++e) {
                const uint32_t a = 32 * warp + 16 * mi + g8 + 8 * (e / 2);
                const uint32_t col = col0 + 8 * nt + 2 * tg + e % 2;
                st[mi][nt][e] = (!fresh && a < dk && col < dv) ? slot[(size_t)a * dv + col] : 0.0f;
            }
        }
    }
    // S^ = bf16(S) for the next K S and Q S (rows past dk hold zeros).
    auto publish_state = [&]() {
#pragma unroll
        for (uint32_t mi = 0; mi < 2; ++mi) {
#pragma unroll
            for (uint32_t nt = 0; nt < 2; ++nt) {
#pragma unroll
                for (uint32_t half = 0; half < 2; ++half) {
                    const uint32_t a = 32 * warp + 16 * mi + g8 + 8 * half;
                    *reinterpret_cast<__nv_bfloat162*>(ss + a * TC_COL_STRIDE + 8 * nt + 2 * tg) =
                        __floats2bfloat162_rn(st[mi][nt][2 * half], st[mi][nt][2 * half + 1]);
                }
            }
        }
    };
    publish_state();

    const uint32_t m0 = 16 * warp;  // this warp's chunk rows
    const uint32_t chunks = gdn_chunks_of(begin, end, chunk_len);
    for (uint32_t c = 0; c < chunks; ++c) {
        const int32_t first = begin + (int32_t)(c * chunk_len);
        const uint32_t n = (uint32_t)min((int64_t)chunk_len, (int64_t)end - first);
        __syncthreads();  // the previous chunk's reads of every tile are done; S^ is whole
        gdn_load_qk_bf16<TC_SCAN_THREADS>(qs, ks, q, k, first, n, kh, dk, qkv_stride);
        gdn_load_decays(gs, bs, g, beta, first, n, h, hv);
        // T^ and P^, zero past the chunk's tokens and its chunk_len columns.
        for (uint32_t e = tid; e < GDN_CHUNK_MAX * GDN_CHUNK_MAX / 2; e += TC_SCAN_THREADS) {
            const uint32_t r = e / (GDN_CHUNK_MAX / 2), j = 2 * (e % (GDN_CHUNK_MAX / 2));
            const size_t at = ((size_t)(first + (int32_t)r) * hv + h) * chunk_len + j;
            const bool live0 = r < n && j < chunk_len, live1 = r < n && j + 1 < chunk_len;
            *reinterpret_cast<__nv_bfloat162*>(ts + r * TC_T_STRIDE + j) = __floats2bfloat162_rn(
                live0 ? t_mat[at] : 0.0f, live1 ? t_mat[at + 1] : 0.0f);
            *reinterpret_cast<__nv_bfloat162*>(ps + r * TC_T_STRIDE + j) = __floats2bfloat162_rn(
                live0 ? attn[at] : 0.0f, live1 ? attn[at + 1] : 0.0f);
        }
        // This lane's v: rows m0 + g8 (+ 8), columns 8 nt + 2 tg (+ 1) of the block's.
        float vv[2][4];
#pragma unroll
        for (uint32_t nt = 0; nt < 2; ++nt) {
#pragma unroll
            for (uint32_t e = 0; e < 4; ++e) {
                const uint32_t row = m0 + g8 + 8 * (e / 2), col = col0 + 8 * nt + 2 * tg + e % 2;
                vv[nt][e] = (row < n && col < dv)
                                ? metrale::to_f32(v[(size_t)(first + (int32_t)row) * qkv_stride +
                                                    (size_t)h * dv + col])
                                : 0.0f;
            }
        }
        __syncthreads();

        // K S and Q S at rows m0 .., the block's 16 columns.
        float kS[2][4] = {}, qS[2][4] = {};
        for (uint32_t kb = 0; kb < dk16; kb += 16) {
            uint32_t ak[4], aq[4], b[4];
            load_a(ak, ka, m0, kb, TC_QK_STRIDE);
            load_a(aq, qa, m0, kb, TC_QK_STRIDE);
            load_b_kn(b, sa, kb, 0, TC_COL_STRIDE);
            metrale::mma_bf16(kS[0], ak, b[0], b[1]);
            metrale::mma_bf16(kS[1], ak, b[2], b[3]);
            metrale::mma_bf16(qS[0], aq, b[0], b[1]);
            metrale::mma_bf16(qS[1], aq, b[2], b[3]);
        }
        // X = bf16(beta (v - exp(G) K S)); O starts at exp(G) Q S.
        float out[2][4];
        {
            const uint32_t r0 = m0 + g8, r1 = r0 + 8;
            const float e0 = expf(gs[r0]), e1 = expf(gs[r1]);
            const float b0 = bs[r0], b1 = bs[r1];
#pragma unroll
            for (uint32_t nt = 0; nt < 2; ++nt) {
                const uint32_t col = 8 * nt + 2 * tg;
                *reinterpret_cast<__nv_bfloat162*>(xs + r0 * TC_COL_STRIDE + col) =
                    __floats2bfloat162_rn(b0 * (vv[nt][0] - e0 * kS[nt][0]),
                                          b0 * (vv[nt][1] - e0 * kS[nt][1]));
                *reinterpret_cast<__nv_bfloat162*>(xs + r1 * TC_COL_STRIDE + col) =
                    __floats2bfloat162_rn(b1 * (vv[nt][2] - e1 * kS[nt][2]),
                                          b1 * (vv[nt][3] - e1 * kS[nt][3]));
                out[nt][0] = e0 * qS[nt][0];
                out[nt][1] = e0 * qS[nt][1];
                out[nt][2] = e1 * qS[nt][2];
                out[nt][3] = e1 * qS[nt][3];
            }
        }
        if (tid < GDN_CHUNK_MAX) kdec[tid] = tid < n ? expf(gs[n - 1] - gs[tid]) : 0.0f;
        __syncthreads();  // X and the decays are whole

        // V' = T^ X at rows m0 .. (T is lower triangular: k-steps up to the diagonal block);
        // V'^ and W = bf16(exp(G_{n-1} - G) V') out.
        {
            float acc[2][4] = {};
            for (uint32_t kt = 0; kt <= warp; ++kt) {
                uint32_t a[4], b[4];
                load_a(a, ta, m0, 16 * kt, TC_T_STRIDE);
                load_b_kn(b, xa, 16 * kt, 0, TC_COL_STRIDE);
                metrale::mma_bf16(acc[0], a, b[0], b[1]);
                metrale::mma_bf16(acc[1], a, b[2], b[3]);
            }
            const uint32_t r0 = m0 + g8, r1 = r0 + 8;
            const float d0 = kdec[r0], d1 = kdec[r1];
#pragma unroll
            for (uint32_t nt = 0; nt < 2; ++nt) {
                const uint32_t col = 8 * nt + 2 * tg;
                *reinterpret_cast<__nv_bfloat162*>(vs + r0 * TC_COL_STRIDE + col) =
                    __floats2bfloat162_rn(acc[nt][0], acc[nt][1]);
                *reinterpret_cast<__nv_bfloat162*>(vs + r1 * TC_COL_STRIDE + col) =
                    __floats2bfloat162_rn(acc[nt][2], acc[nt][3]);
                *reinterpret_cast<__nv_bfloat162*>(ws + r0 * TC_COL_STRIDE + col) =
                    __floats2bfloat162_rn(d0 * acc[nt][0], d0 * acc[nt][1]);
                *reinterpret_cast<__nv_bfloat162*>(ws + r1 * TC_COL_STRIDE + col) =
                    __floats2bfloat162_rn(d1 * acc[nt][2], d1 * acc[nt][3]);
            }
        }
        __syncthreads();  // V'^ and W are whole

        // O += P^ V'^ at rows m0 .., out as bf16.
        for (uint32_t kt = 0; kt <= warp; ++kt) {
            uint32_t a[4], b[4];
            load_a(a, pa, m0, 16 * kt, TC_T_STRIDE);
            load_b_kn(b, va, 16 * kt, 0, TC_COL_STRIDE);
            metrale::mma_bf16(out[0], a, b[0], b[1]);
            metrale::mma_bf16(out[1], a, b[2], b[3]);
        }
#pragma unroll
        for (uint32_t nt = 0; nt < 2; ++nt) {
#pragma unroll
            for (uint32_t e = 0; e < 4; ++e) {
                const uint32_t row = m0 + g8 + 8 * (e / 2), col = col0 + 8 * nt + 2 * tg + e % 2;
                if (row < n && col < dv) {
                    o[((size_t)(first + (int32_t)row) * hv + h) * dv + col] =
                        metrale::to_bf16(out[nt][e]);
                }
            }
        }
        // S = exp(G_{n-1}) S + k^T W at this warp's rows of S (k-steps over the chunk's tokens;
        // rows past n of k^ and W are zero).
        {
            const float total = expf(gs[n - 1]);
#pragma unroll
            for (uint32_t mi = 0; mi < 2; ++mi) {
#pragma unroll
                for (uint32_t nt = 0; nt < 2; ++nt) {
#pragma unroll
                    for (uint32_t e = 0; e < 4; ++e) st[mi][nt][e] *= total;
                }
            }
            const uint32_t k_steps = (n + 15) / 16;
#pragma unroll
            for (uint32_t mi = 0; mi < 2; ++mi) {
                const uint32_t r0 = 32 * warp + 16 * mi;
                if (r0 >= dk16) break;
                for (uint32_t kt = 0; kt < k_steps; ++kt) {
                    uint32_t a[4], b[4];
                    load_a_trans(a, ka, r0, 16 * kt, TC_QK_STRIDE);
                    load_b_kn(b, wa, 16 * kt, 0, TC_COL_STRIDE);
                    metrale::mma_bf16(st[mi][0], a, b[0], b[1]);
                    metrale::mma_bf16(st[mi][1], a, b[2], b[3]);
                }
            }
        }
        // S^ for the next chunk: its K S and Q S read it after the loop's first barrier, and no
        // warp reads S^ between this chunk's first barrier after K S and that one.
        publish_state();
    }
#pragma unroll
    for (uint32_t mi = 0; mi < 2; ++mi) {
#pragma unroll
        for (uint32_t nt = 0; nt < 2; ++nt) {
#pragma unroll
            for (uint32_t e = 0; e < 4; ++e) {
                const uint32_t a = 32 * warp + 16 * mi + g8 + 8 * (e / 2);
                const uint32_t col = col0 + 8 * nt + 2 * tg + e % 2;
                if (a < dk && col < dv) slot[(size_t)a * dv + col] = st[mi][nt][e];
            }
        }
    }
}
