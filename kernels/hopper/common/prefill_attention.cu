// SPDX-License-Identifier: MIT OR Apache-2.0
// Causal prefill attention on tensor cores over the paged KV cache (FlashAttention-2 schedule).
//
// The launch covers query tiles: up to 64 consecutive step tokens of one sequence at consecutive
// positions. Token first_token + i of a tile sits at position first_position + i and attends to
// keys 0..=first_position + i of its sequence; keys of earlier chunks are already in the cache, so
// a chunked prefill is a tile whose first position is not 0. Query head h reads kv head
// h / (q_heads / kv_heads); the cache is [num_blocks, block_size, kv_heads, head_dim] and the keys of
// a sequence are found through its block table, as in paged_attention_bf16.
//
// Version 1: grid = (num_tiles, q_heads), block = 4 warps; warp w owns query rows 16w..16w+15 of
// the tile. The tile's q rows are staged in shared memory once and held as mma A fragments. Keys
// come in tiles of 64 rows (K and V 64 x head_dim bf16 each, gathered row by row through the block
// table with 16-byte cp.async; keys past the context are zero-filled, never read): while a warp
// multiplies S = Q K^T for key tile j the V tile j is in flight, and while it multiplies O += P V
// the K tile j + 1 is. Scores are f32 (mma.sync m16n8k16 bf16 -> f32), scaled by scale * log2(e)
// so that the online softmax runs on ex2; the running max and sum are f32. The probabilities are
// rounded to bf16 to feed the P V mma (f32 accumulation), and the row sum adds the rounded values,
// so the weights the output is normalised by are the weights it was summed with
// (docs/precision.md). The output is divided by the row sum and rounded to bf16 once; rows of a
// tile past its count are never written. Only key tiles that reach past the tile's first position
// are masked; key tiles past its last position are never visited.
//
// Shared memory rows are head_dim bf16 in 16-byte chunks; chunk c of row r is stored at chunk
// c ^ (r & 7), so the 8 row addresses of every ldmatrix phase fall in distinct bank groups.
// Blocks take tiles last first: with causal masking the last tiles of a sequence carry the most
// keys, and starting them first shortens the launch's tail.
#include "async_copy.cuh"
#include "common.cuh"
#include "kv_fp8.cuh"
#include "mma.cuh"

namespace {
constexpr int WARPS = 4;
constexpr int THREADS = WARPS * 32;
constexpr int TILE_Q = WARPS * 16;  // query rows per block
constexpr int TILE_K = 64;          // keys per shared-memory tile
constexpr int MAX_HD = 128;
constexpr float LOG2E = 1.4426950408889634f;

using metrale::BlockSplit;
using metrale::cp_async_16;
using metrale::cp_async_commit;
using metrale::cp_async_wait;
using metrale::smem_addr;
using metrale::swizzle;

using metrale::exp2_approx;
using metrale::ldmatrix_x4;
using metrale::ldmatrix_x4_trans;
using metrale::mma_bf16;
using metrale::pack_bf16;

// Starts the copy of keys [k0, k0 + TILE_K) of one kv head into a swizzled shared tile; keys at or
// past n_keys are zero-filled.
template <int HD>
__device__ __forceinline__ void load_kv_tile(__nv_bfloat16* tile, const __nv_bfloat16* cache,
                                             const int32_t* table, const BlockSplit& blocks,
                                             uint32_t k0, uint32_t n_keys, uint32_t kv_heads,
                                             uint32_t kvh) {
    constexpr int CHUNKS = HD / 8;
    const int chunk = threadIdx.x % CHUNKS;
#pragma unroll
    for (int r = threadIdx.x / CHUNKS; r < TILE_K; r += THREADS / CHUNKS) {
        const uint32_t key = k0 + r;
        const bool valid = key < n_keys;
        const __nv_bfloat16* src = cache;
        if (valid)
            src = cache + ((size_t)blocks.slot(table, key) * kv_heads + kvh) * HD + chunk * 8;
        cp_async_16(smem_addr(tile + swizzle<HD>(r, chunk)), src, valid);
    }
}

template <int HD>
__device__ __forceinline__ void attend_tile(
    __nv_bfloat16* __restrict__ out, const __nv_bfloat16* __restrict__ q,
    const __nv_bfloat16* __restrict__ k_cache, const __nv_bfloat16* __restrict__ v_cache,
    const int32_t* __restrict__ block_tables, const int32_t* __restrict__ tile_desc,
    uint32_t q_heads, uint32_t kv_heads, uint32_t block_size, uint32_t max_blocks_per_seq,
    float scale, __nv_bfloat16* sk, __nv_bfloat16* sv) {
    constexpr int CHUNKS = HD / 8;      // 16-byte pieces of a row
    constexpr int KSTEPS = HD / 16;     // k-steps of Q K^T over the head dim
    constexpr int OUT_TILES = HD / 8;   // 8-dim n-tiles of the output
    constexpr int KEY_TILES = TILE_K / 8;  // 8-key n-tiles of the scores

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int32_t seq = tile_desc[0], first_token = tile_desc[1], first_pos = tile_desc[2],
                  count = tile_desc[3];
    if (count <= 0 || count > TILE_Q || first_pos < 0 || seq < 0) return;
    const uint32_t h = blockIdx.y;
    const uint32_t kvh = h / (q_heads / kv_heads);
    const uint32_t n_keys = (uint32_t)first_pos + (uint32_t)count;
    const int32_t* table = block_tables + (size_t)seq * max_blocks_per_seq;
    const BlockSplit blocks(block_size);

    // q rows of the tile into sv (V's buffer is free until the first key tile), rows past count
    // zero; then key tile 0.
    {
        const int chunk = tid % CHUNKS;
#pragma unroll
        for (int r = tid / CHUNKS; r < TILE_Q; r += THREADS / CHUNKS) {
            const bool valid = r < count;
            const __nv_bfloat16* src = q;
            if (valid) src = q + ((size_t)(first_token + r) * q_heads + h) * HD + chunk * 8;
            cp_async_16(smem_addr(sv + swizzle<HD>(r, chunk)), src, valid);
        }
    }
    cp_async_commit();
    load_kv_tile<HD>(sk, k_cache, table, blocks, 0, n_keys, kv_heads, kvh);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();

    // A fragments of this warp's 16 rows: matrices (rows 0-7 | 8-15) x (dims 0-7 | 8-15) of each
    // 16-dim k-step, which is a0..a3 of mma.m16n8k16.
    uint32_t qf[KSTEPS][4];
#pragma unroll
    for (int ks = 0; ks < KSTEPS; ++ks)
        ldmatrix_x4(qf[ks], smem_addr(sv + swizzle<HD>(warp * 16 + (lane & 15), 2 * ks + (lane >> 4))));

    // This thread's accumulator rows are g = lane / 4 and g + 8 of the warp's 16; its columns
    // are 2 (lane % 4) and 2 (lane % 4) + 1 of every 8-wide n-tile.
    const int g = lane >> 2, tg = lane & 3;
    const int32_t pos0 = first_pos + warp * 16 + g, pos1 = pos0 + 8;
    // Warps whose rows are all past count skip the arithmetic (not the loads and barriers).
    const bool live = warp * 16 < count;
    const float scale_log2 = scale * LOG2E;
    float o[OUT_TILES][4];
#pragma unroll
    for (int d = 0; d < OUT_TILES; ++d) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.0f;
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;

    const uint32_t key_tiles = (n_keys + TILE_K - 1) / TILE_K;
    for (uint32_t j = 0; j < key_tiles; ++j) {
        const uint32_t k0 = j * TILE_K;
        // K tile j has landed, and every warp is done with sv (q or V tile j - 1).
        cp_async_wait<0>();
        __syncthreads();
        load_kv_tile<HD>(sv, v_cache, table, blocks, k0, n_keys, kv_heads, kvh);
        cp_async_commit();

        uint32_t p[TILE_K / 16][4];  // bf16 probabilities as A fragments, per 16-key k-step
        if (live) {
            float s[KEY_TILES][4];
#pragma unroll
            for (int n = 0; n < KEY_TILES; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
            // B fragments of K^T: matrices (keys 0-7 | 8-15 of a 16-key pair of n-tiles) x
            // (dims 0-7 | 8-15 of the k-step); lanes 8-15 take the upper dims, 16-31 the upper keys.
#pragma unroll
            for (int ks = 0; ks < KSTEPS; ++ks) {
#pragma unroll
                for (int np = 0; np < KEY_TILES / 2; ++np) {
                    uint32_t b[4];
                    const int row = np * 16 + (lane & 7) + ((lane >> 4) << 3);
                    ldmatrix_x4(b, smem_addr(sk + swizzle<HD>(row, 2 * ks + ((lane >> 3) & 1))));
                    mma_bf16(s[2 * np], qf[ks], b[0], b[1]);
                    mma_bf16(s[2 * np + 1], qf[ks], b[2], b[3]);
                }
            }
            // Causal mask (which also hides the zero-filled keys past the context) where the key
            // tile reaches past the tile's first position.
            if (k0 + TILE_K - 1 > (uint32_t)first_pos) {
#pragma unroll
                for (int n = 0; n < KEY_TILES; ++n) {
                    const int32_t key = (int32_t)k0 + n * 8 + 2 * tg;
                    if (key > pos0) s[n][0] = -INFINITY;
                    if (key + 1 > pos0) s[n][1] = -INFINITY;
                    if (key > pos1) s[n][2] = -INFINITY;
                    if (key + 1 > pos1) s[n][3] = -INFINITY;
                }
            }
            // Online softmax over the row's 64 keys: 16 per thread, the other 48 in the 3 lanes of
            // the same quad. Every row has key 0 in tile 0, so m is finite from the first tile on;
            // the -inf guard only keeps a fully masked row at p = 0 instead of NaN.
            float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
            for (int n = 0; n < KEY_TILES; ++n) {
                mx0 = fmaxf(mx0, fmaxf(s[n][0], s[n][1]));
                mx1 = fmaxf(mx1, fmaxf(s[n][2], s[n][3]));
            }
#pragma unroll
            for (int off = 1; off <= 2; off <<= 1) {
                mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, off));
                mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, off));
            }
            const float new0 = fmaxf(m0, mx0 * scale_log2), new1 = fmaxf(m1, mx1 * scale_log2);
            const float base0 = new0 == -INFINITY ? 0.0f : new0;
            const float base1 = new1 == -INFINITY ? 0.0f : new1;
            const float corr0 = exp2_approx(m0 - base0), corr1 = exp2_approx(m1 - base1);
            m0 = new0;
            m1 = new1;
            float sum0 = 0.0f, sum1 = 0.0f;
#pragma unroll
            for (int n = 0; n < KEY_TILES; ++n) {
                const __nv_bfloat162 lo =
                    __floats2bfloat162_rn(exp2_approx(fmaf(s[n][0], scale_log2, -base0)),
                                          exp2_approx(fmaf(s[n][1], scale_log2, -base0)));
                const __nv_bfloat162 hi =
                    __floats2bfloat162_rn(exp2_approx(fmaf(s[n][2], scale_log2, -base1)),
                                          exp2_approx(fmaf(s[n][3], scale_log2, -base1)));
                const float2 lf = __bfloat1622float2(lo), hf = __bfloat1622float2(hi);
                sum0 += lf.x + lf.y;
                sum1 += hf.x + hf.y;
                // n-tile n is keys 8 (n % 2)..8 (n % 2) + 7 of k-step n / 2: a0/a1 (rows g / g + 8)
                // for the lower 8 keys, a2/a3 for the upper.
                p[n / 2][(n & 1) * 2] = pack_bf16(lo);
                p[n / 2][(n & 1) * 2 + 1] = pack_bf16(hi);
            }
            l0 = l0 * corr0 + sum0;
            l1 = l1 * corr1 + sum1;
#pragma unroll
            for (int d = 0; d < OUT_TILES; ++d) {
                o[d][0] *= corr0;
                o[d][1] *= corr0;
                o[d][2] *= corr1;
                o[d][3] *= corr1;
            }
        }

        // Every warp is done with sk: start key tile j + 1 (an empty group on the last tile keeps
        // the wait counts uniform), then wait for V tile j.
        __syncthreads();
        if (j + 1 < key_tiles)
            load_kv_tile<HD>(sk, k_cache, table, blocks, k0 + TILE_K, n_keys, kv_heads, kvh);
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();

        if (live) {
            // B fragments of V (keys x dims, row-major in shared memory) through the transposing
            // ldmatrix: matrices (keys 0-7 | 8-15 of the k-step) x (dims 0-7 | 8-15 of a pair of
            // output n-tiles); lanes 8-15 take the upper keys, 16-31 the upper dims.
#pragma unroll
            for (int kk = 0; kk < TILE_K / 16; ++kk) {
#pragma unroll
                for (int dp = 0; dp < OUT_TILES / 2; ++dp) {
                    uint32_t b[4];
                    const int row = kk * 16 + (lane & 7) + (((lane >> 3) & 1) << 3);
                    ldmatrix_x4_trans(b, smem_addr(sv + swizzle<HD>(row, 2 * dp + (lane >> 4))));
                    mma_bf16(o[2 * dp], p[kk], b[0], b[1]);
                    mma_bf16(o[2 * dp + 1], p[kk], b[2], b[3]);
                }
            }
        }
    }

    if (!live) return;
    metrale::store_tile_rows<HD>(out, [&](int d, int j) { return o[d][j]; }, l0, l1, warp * 16 + g,
                                 count, first_token, q_heads, h, tg);
}
}  // namespace

// Launch: grid = (num_tiles, q_heads), block = 128, no dynamic shared memory (32 KiB static).
// `tiles` is i32 [num_tiles, 4] = (seq, first_token, first_position, count), count in 1..=64.
// head_dim must be 64 or 128 (other head dims write nothing: callers keep paged_attention_bf16);
// scale must be positive.
extern "C" __global__ void __launch_bounds__(THREADS) prefill_attention_bf16(
    __nv_bfloat16* __restrict__ out, const __nv_bfloat16* __restrict__ q,
    const __nv_bfloat16* __restrict__ k_cache, const __nv_bfloat16* __restrict__ v_cache,
    const int32_t* __restrict__ block_tables, const int32_t* __restrict__ tiles, uint32_t num_tiles,
    uint32_t q_heads, uint32_t kv_heads, uint32_t head_dim, uint32_t block_size,
    uint32_t max_blocks_per_seq, float scale) {
    __shared__ __align__(128) __nv_bfloat16 sk[TILE_K * MAX_HD];
    __shared__ __align__(128) __nv_bfloat16 sv[TILE_K * MAX_HD];
    metrale::grid_dependency_sync();
    if (blockIdx.x >= num_tiles || blockIdx.y >= q_heads || kv_heads == 0 ||
        q_heads % kv_heads != 0 || blockDim.x != THREADS)
        return;
    const int32_t* tile_desc = tiles + (size_t)(num_tiles - 1 - blockIdx.x) * 4;
#define METRALE_PREFILL(HD)                                                                  \
    attend_tile<HD>(out, q, k_cache, v_cache, block_tables, tile_desc, q_heads, kv_heads,     \
                    block_size, max_blocks_per_seq, scale, sk, sv)
    switch (head_dim) {
        case 64: METRALE_PREFILL(64); break;
        case 128: METRALE_PREFILL(128); break;
        default: break;
    }
#undef METRALE_PREFILL
}

// Version 2: 128-row query tiles, each warp two m-tiles of 16 rows that share every K and V
// fragment it loads, so shared-memory reads per mma FLOP halve against version 1 and L2 reads of
// K and V per FLOP halve with the doubled tile.
//
// grid = (q_heads, num_tiles), block = 4 warps; heads run fastest so that the blocks resident
// together read the same keys (the query heads of one kv head hit the same L2 lines), and tile
// num_tiles - 1 - blockIdx.y is taken so the longest tiles start first. Warp w owns rows
// 16w..16w+15 (m-tile 0) and 64 + 16w..64 + 16w + 15 (m-tile 1): an early and a late run of rows,
// so that near the diagonal, where late rows see more keys, the warps stay balanced. The q rows
// are staged once through shared memory and held as A fragments (64 registers at head_dim 128).
// Keys come in tiles of 32 (K and V each 32 x head_dim bf16), double-buffered: one barrier per
// key tile, after which tile j + 1 is issued into the other buffer while tile j is multiplied.
// An m-tile whose rows all precede a key tile, or lie past the tile's count, skips its mma and
// softmax for it (a warp-uniform test). The arithmetic per key tile is version 1's: scores f32,
// running max in log2 units, p = ex2(fma(dot, scale log2 e, -max)) rounded to bf16 for the P V
// mma and for the row sum; the output rescale is skipped when no row's max moved (a factor of
// exactly 1). Shared memory: 2 stages x (K, V) x 32 x 128 bf16 = 32 KiB static.
namespace {
namespace v2 {
constexpr int WARPS = 4;
constexpr int THREADS = WARPS * 32;
constexpr int M_TILES = 2;                    // 16-row m-tiles per warp
constexpr int TILE_Q = WARPS * 16 * M_TILES;  // query rows per block
constexpr int TILE_K = 32;                    // keys per shared-memory tile
constexpr int SUB_K = 16;                     // keys per online-softmax step
constexpr int STAGES = 2;
constexpr int MAX_HD = 128;
constexpr int KEY_TILES = SUB_K / 8;   // 8-key n-tiles of the scores
constexpr int KEY_STEPS = SUB_K / 16;  // 16-key k-steps of P V
// The q staging (TILE_Q rows) fits in the key buffers (STAGES x 2 x TILE_K rows).
static_assert(TILE_Q <= STAGES * 2 * TILE_K, "q rows must fit in the K/V buffers");

// Starts the copy of keys [k0, k0 + TILE_K) of one kv head, K and V, into swizzled shared tiles;
// keys at or past n_keys are zero-filled.
template <int HD>
__device__ __forceinline__ void load_kv(__nv_bfloat16* sk, __nv_bfloat16* sv,
                                        const __nv_bfloat16* k_cache,
                                        const __nv_bfloat16* v_cache, const int32_t* table,
                                        const BlockSplit& blocks, uint32_t k0, uint32_t n_keys,
                                        uint32_t kv_heads, uint32_t kvh) {
    constexpr int CHUNKS = HD / 8;
    const int chunk = threadIdx.x % CHUNKS;
#pragma unroll
    for (int r = threadIdx.x / CHUNKS; r < TILE_K; r += THREADS / CHUNKS) {
        const uint32_t key = k0 + r;
        const bool valid = key < n_keys;
        size_t off = 0;
        if (valid) off = ((size_t)blocks.slot(table, key) * kv_heads + kvh) * HD + chunk * 8;
        const int dst = swizzle<HD>(r, chunk);
        cp_async_16(smem_addr(sk + dst), k_cache + off, valid);
        cp_async_16(smem_addr(sv + dst), v_cache + off, valid);
    }
}

// One warp's running state: q A fragments, output accumulators, running max (log2 units) and
// this thread's share of the row sums, for rows g and g + 8 of each m-tile.
template <int HD>
struct WarpState {
    uint32_t qf[M_TILES][HD / 16][4];
    float o[M_TILES][HD / 8][4];
    float m[M_TILES][2];
    float l[M_TILES][2];
};

// Online softmax of one m-tile's scores for one key tile: updates the max and sum, rescales the
// output, and leaves the bf16 probabilities as P V A fragments. `mask` applies the causal mask
// (keys past pos0 / pos0 + 8 for rows g / g + 8).
template <int HD>
__device__ __forceinline__ void softmax(float (&s)[KEY_TILES][4], uint32_t (&p)[KEY_STEPS][4],
                                        float (&o)[HD / 8][4], float (&m)[2], float (&l)[2],
                                        float scale_log2, bool mask, int32_t k0, int32_t pos0,
                                        int tg) {
    if (mask) {
        const int32_t pos1 = pos0 + 8;
#pragma unroll
        for (int n = 0; n < KEY_TILES; ++n) {
            const int32_t key = k0 + n * 8 + 2 * tg;
            if (key > pos0) s[n][0] = -INFINITY;
            if (key + 1 > pos0) s[n][1] = -INFINITY;
            if (key > pos1) s[n][2] = -INFINITY;
            if (key + 1 > pos1) s[n][3] = -INFINITY;
        }
    }
    float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
    for (int n = 0; n < KEY_TILES; ++n) {
        mx0 = fmaxf(mx0, fmaxf(s[n][0], s[n][1]));
        mx1 = fmaxf(mx1, fmaxf(s[n][2], s[n][3]));
    }
#pragma unroll
    for (int off = 1; off <= 2; off <<= 1) {
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, off));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, off));
    }
    // A row whose keys in this tile are all masked keeps its max (finite: key 0 is in tile 0)
    // and adds p = 0; the -inf guard only keeps a row with no key at all at 0 instead of NaN.
    const float new0 = fmaxf(m[0], mx0 * scale_log2), new1 = fmaxf(m[1], mx1 * scale_log2);
    const float base0 = new0 == -INFINITY ? 0.0f : new0;
    const float base1 = new1 == -INFINITY ? 0.0f : new1;
    const float corr0 = new0 == m[0] ? 1.0f : exp2_approx(m[0] - base0);
    const float corr1 = new1 == m[1] ? 1.0f : exp2_approx(m[1] - base1);
    m[0] = new0;
    m[1] = new1;
    float sum0 = 0.0f, sum1 = 0.0f;
#pragma unroll
    for (int n = 0; n < KEY_TILES; ++n) {
        const __nv_bfloat162 lo =
            __floats2bfloat162_rn(exp2_approx(fmaf(s[n][0], scale_log2, -base0)),
                                  exp2_approx(fmaf(s[n][1], scale_log2, -base0)));
        const __nv_bfloat162 hi =
            __floats2bfloat162_rn(exp2_approx(fmaf(s[n][2], scale_log2, -base1)),
                                  exp2_approx(fmaf(s[n][3], scale_log2, -base1)));
        const float2 lf = __bfloat1622float2(lo), hf = __bfloat1622float2(hi);
        sum0 += lf.x + lf.y;
        sum1 += hf.x + hf.y;
        // n-tile n is keys 8 (n % 2)..8 (n % 2) + 7 of k-step n / 2: a0/a1 (rows g / g + 8) for
        // the lower 8 keys, a2/a3 for the upper.
        p[n / 2][(n & 1) * 2] = pack_bf16(lo);
        p[n / 2][(n & 1) * 2 + 1] = pack_bf16(hi);
    }
    l[0] = l[0] * corr0 + sum0;
    l[1] = l[1] * corr1 + sum1;
    // Past the first tiles the max rarely moves; a factor of exactly 1 changes nothing.
    if (__any_sync(0xffffffffu, corr0 != 1.0f || corr1 != 1.0f)) {
#pragma unroll
        for (int d = 0; d < HD / 8; ++d) {
            o[d][0] *= corr0;
            o[d][1] *= corr0;
            o[d][2] *= corr1;
            o[d][3] *= corr1;
        }
    }
}

// One key tile for the m-tiles in LIVE (bit t: m-tile t sees a key of the tile): S = Q K^T,
// online softmax, O += P V. `mask` bit t: m-tile t needs the causal mask.
// `k_addr` and `v_addr` are this lane's shared byte addresses of its first K and V fragment rows
// with its swizzle term ((chunk bit ^ row & 7) << 4) folded in: the swizzled chunk of k-step ks
// (or dim pair dp) is 2 ks ^ that term, one xor with an immediate, because the tile base and row
// offsets have bits 4-7 clear (the buffer is 1024-aligned and rows are 16 keys apart).
template <int HD, int LIVE>
__device__ __forceinline__ void key_tile(WarpState<HD>& st, uint32_t k_addr, uint32_t v_addr,
                                         float scale_log2, int mask, int32_t k0,
                                         const int32_t (&pos0)[M_TILES]) {
    constexpr int KSTEPS = HD / 16;
    constexpr int OUT_TILES = HD / 8;
    const int lane = threadIdx.x & 31, tg = lane & 3;
    float s[M_TILES][KEY_TILES][4];
#pragma unroll
    for (int t = 0; t < M_TILES; ++t)
#pragma unroll
        for (int n = 0; n < KEY_TILES; ++n) s[t][n][0] = s[t][n][1] = s[t][n][2] = s[t][n][3] = 0.0f;
    // B fragments of K^T as in version 1: matrices (keys 0-7 | 8-15 of a 16-key pair of n-tiles)
    // x (dims 0-7 | 8-15 of the k-step); lanes 8-15 take the upper dims, 16-31 the upper keys.
#pragma unroll
    for (int ks = 0; ks < KSTEPS; ++ks) {
#pragma unroll
        for (int np = 0; np < KEY_TILES / 2; ++np) {
            uint32_t b[4];
            ldmatrix_x4(b, (k_addr ^ (ks << 5)) + np * 16 * HD * 2);
#pragma unroll
            for (int t = 0; t < M_TILES; ++t) {
                if (!(LIVE & (1 << t))) continue;
                mma_bf16(s[t][2 * np], st.qf[t][ks], b[0], b[1]);
                mma_bf16(s[t][2 * np + 1], st.qf[t][ks], b[2], b[3]);
            }
        }
    }
    uint32_t p[M_TILES][KEY_STEPS][4];
#pragma unroll
    for (int t = 0; t < M_TILES; ++t) {
        if (!(LIVE & (1 << t))) continue;
        softmax<HD>(s[t], p[t], st.o[t], st.m[t], st.l[t], scale_log2, (mask >> t) & 1, k0,
                    pos0[t], tg);
    }
    // B fragments of V through the transposing ldmatrix, as in version 1: matrices (keys 0-7 |
    // 8-15 of the k-step) x (dims 0-7 | 8-15 of a pair of output n-tiles); lanes 8-15 take the
    // upper keys, 16-31 the upper dims.
#pragma unroll
    for (int kk = 0; kk < KEY_STEPS; ++kk) {
#pragma unroll
        for (int dp = 0; dp < OUT_TILES / 2; ++dp) {
            uint32_t b[4];
            ldmatrix_x4_trans(b, (v_addr ^ (dp << 5)) + kk * 16 * HD * 2);
#pragma unroll
            for (int t = 0; t < M_TILES; ++t) {
                if (!(LIVE & (1 << t))) continue;
                mma_bf16(st.o[t][2 * dp], p[t][kk], b[0], b[1]);
                mma_bf16(st.o[t][2 * dp + 1], p[t][kk], b[2], b[3]);
            }
        }
    }
}

// FP8 cache (prefill_attention_v2_fp8): starts the copy of keys [k0, k0 + TILE_K) of one kv
// head, K then V, as raw e4m3 rows (HD bytes each, not swizzled) into `raw`; keys at or past
// n_keys are zero-filled.
template <int HD>
__device__ __forceinline__ void load_kv8(unsigned char* raw, const unsigned char* k_cache,
                                         const unsigned char* v_cache, const int32_t* table,
                                         const BlockSplit& blocks, uint32_t k0, uint32_t n_keys,
                                         uint32_t kv_heads, uint32_t kvh) {
    constexpr int CHUNKS8 = HD / 16;
    const int chunk = threadIdx.x % CHUNKS8;
#pragma unroll
    for (int r = threadIdx.x / CHUNKS8; r < TILE_K; r += THREADS / CHUNKS8) {
        const uint32_t key = k0 + r;
        const bool valid = key < n_keys;
        size_t off = 0;
        if (valid) off = ((size_t)blocks.slot(table, key) * kv_heads + kvh) * HD + chunk * 16;
        cp_async_16(smem_addr(raw + r * HD + chunk * 16), k_cache + off, valid);
        cp_async_16(smem_addr(raw + (TILE_K + r) * HD + chunk * 16), v_cache + off, valid);
    }
}

// FP8 cache: the landed raw K and V tile into the swizzled bf16 stage `stage` (K rows then V
// rows), each e4m3 exactly as bf16; the whole block takes part.
template <int HD>
__device__ __forceinline__ void convert_kv8(__nv_bfloat16* stage, const unsigned char* raw) {
    constexpr int CHUNKS8 = HD / 16;
#pragma unroll
    for (int p = threadIdx.x; p < 2 * TILE_K * CHUNKS8; p += THREADS) {
        const int r = p / CHUNKS8, c = p % CHUNKS8;  // r < 2 TILE_K: K rows, then V rows
        const uint4 w = *reinterpret_cast<const uint4*>(raw + r * HD + c * 16);
        using namespace metrale::kv_fp8;
        const uint2 a = to_bf16x4(w.x), b = to_bf16x4(w.y), e = to_bf16x4(w.z), f = to_bf16x4(w.w);
        // Row r of K (r < TILE_K) or row r - TILE_K of V: the swizzle takes the row within its
        // tile, which has the same low 3 bits (TILE_K is a multiple of 8).
        __nv_bfloat16* row = stage + (r / TILE_K) * TILE_K * HD;
        const int rr = r % TILE_K;
        *reinterpret_cast<uint4*>(row + swizzle<HD>(rr, 2 * c)) = make_uint4(a.x, a.y, b.x, b.y);
        *reinterpret_cast<uint4*>(row + swizzle<HD>(rr, 2 * c + 1)) = make_uint4(e.x, e.y, f.x, f.y);
    }
}

// FP8: the caches are e4m3 (kv_fp8.cuh), scaled by k_scale (into the score scale) and v_scale
// (on the output). Each key tile is copied raw into the second half of the shared buffer (two
// stages) and converted, once it has landed, into one bf16 stage at the start, which the
// arithmetic reads as the bf16 form reads its stages: one barrier more a key tile, the same
// shared memory.
template <int HD, bool FP8>
__device__ __forceinline__ void attend_tile(
    __nv_bfloat16* __restrict__ out, const __nv_bfloat16* __restrict__ q,
    const void* __restrict__ k_cache_any, const void* __restrict__ v_cache_any,
    const int32_t* __restrict__ block_tables, const int32_t* __restrict__ tile_desc,
    uint32_t h, uint32_t q_heads, uint32_t kv_heads, uint32_t block_size,
    uint32_t max_blocks_per_seq, float scale, float k_scale, float v_scale, __nv_bfloat16* smem) {
    const __nv_bfloat16* k_cache = static_cast<const __nv_bfloat16*>(k_cache_any);
    const __nv_bfloat16* v_cache = static_cast<const __nv_bfloat16*>(v_cache_any);
    const unsigned char* k_cache8 = static_cast<const unsigned char*>(k_cache_any);
    const unsigned char* v_cache8 = static_cast<const unsigned char*>(v_cache_any);
    constexpr int CHUNKS = HD / 8;
    constexpr int KSTEPS = HD / 16;
    constexpr int OUT_TILES = HD / 8;
    constexpr int STAGE = 2 * TILE_K * HD;  // elements of one stage: K then V

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int32_t seq = tile_desc[0], first_token = tile_desc[1], first_pos = tile_desc[2],
                  count = tile_desc[3];
    if (count <= 0 || count > TILE_Q || first_pos < 0 || seq < 0) return;
    const uint32_t kvh = h / (q_heads / kv_heads);
    const uint32_t n_keys = (uint32_t)first_pos + (uint32_t)count;
    const int32_t* table = block_tables + (size_t)seq * max_blocks_per_seq;
    const BlockSplit blocks(block_size);

    // q rows of the tile across the whole buffer, rows past count zero.
    {
        const int chunk = tid % CHUNKS;
#pragma unroll
        for (int r = tid / CHUNKS; r < TILE_Q; r += THREADS / CHUNKS) {
            const bool valid = r < count;
            const __nv_bfloat16* src = q;
            if (valid) src = q + ((size_t)(first_token + r) * q_heads + h) * HD + chunk * 8;
            cp_async_16(smem_addr(smem + swizzle<HD>(r, chunk)), src, valid);
        }
    }
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();

    WarpState<HD> st;
    // Rows of m-tile t: 16 (warp + WARPS t) .. + 15. A fragments as in version 1.
    int32_t row0[M_TILES], pos0[M_TILES], last[M_TILES];
#pragma unroll
    for (int t = 0; t < M_TILES; ++t) {
        row0[t] = 16 * (warp + WARPS * t);
        // The last position a row of the m-tile attends from; -1 (no key) when it has no rows.
        last[t] = row0[t] < count ? first_pos + min(row0[t] + 15, count - 1) : -1;
        pos0[t] = first_pos + row0[t] + (lane >> 2);
#pragma unroll
        for (int ks = 0; ks < KSTEPS; ++ks)
            ldmatrix_x4(st.qf[t][ks],
                        smem_addr(smem + swizzle<HD>(row0[t] + (lane & 15), 2 * ks + (lane >> 4))));
#pragma unroll
        for (int d = 0; d < OUT_TILES; ++d)
            st.o[t][d][0] = st.o[t][d][1] = st.o[t][d][2] = st.o[t][d][3] = 0.0f;
        st.m[t][0] = st.m[t][1] = -INFINITY;
        st.l[t][0] = st.l[t][1] = 0.0f;
    }
    // Every warp holds its q before key tile 0 overwrites the buffer.
    __syncthreads();
    // FP8: two raw stages of 2 TILE_K rows of HD bytes after the one bf16 stage.
    unsigned char* raw = reinterpret_cast<unsigned char*>(smem + STAGE);
    if constexpr (FP8)
        load_kv8<HD>(raw, k_cache8, v_cache8, table, blocks, 0, n_keys, kv_heads, kvh);
    else
        load_kv<HD>(smem, smem + TILE_K * HD, k_cache, v_cache, table, blocks, 0, n_keys,
                    kv_heads, kvh);
    cp_async_commit();

    // K fragment rows: (lane & 7) + 8 (lane / 16), chunk bit (lane / 8) & 1; V fragment rows:
    // (lane & 7) + 8 ((lane / 8) & 1), chunk bit lane / 16 (version 1's ldmatrix lane roles).
    const uint32_t smem_base = smem_addr(smem);
    const uint32_t k_lane = ((lane & 7) + ((lane >> 4) << 3)) * HD * 2 +
                            ((((lane >> 3) & 1) ^ (lane & 7)) << 4);
    const uint32_t v_lane = ((lane & 7) + (((lane >> 3) & 1) << 3)) * HD * 2 +
                            (((lane >> 4) ^ (lane & 7)) << 4);
    const float scale_log2 = (FP8 ? scale * k_scale : scale) * LOG2E;
    const uint32_t key_tiles = (n_keys + TILE_K - 1) / TILE_K;
    for (uint32_t j = 0; j < key_tiles; ++j) {
        const int32_t k0 = (int32_t)(j * TILE_K);
        // Key tile j has landed for every thread, and every warp is done with tile j - 1, whose
        // buffer tile j + 1 now takes.
        cp_async_wait<0>();
        __syncthreads();
        if (j + 1 < key_tiles) {
            if constexpr (FP8) {
                load_kv8<HD>(raw + ((j + 1) & 1) * STAGE, k_cache8, v_cache8, table, blocks,
                             k0 + TILE_K, n_keys, kv_heads, kvh);
            } else {
                __nv_bfloat16* next = smem + ((j + 1) & 1) * STAGE;
                load_kv<HD>(next, next + TILE_K * HD, k_cache, v_cache, table, blocks,
                            k0 + TILE_K, n_keys, kv_heads, kvh);
            }
        }
        cp_async_commit();
        if constexpr (FP8) {
            // Raw tile j into the bf16 stage, which every warp is done with (tile j - 1).
            convert_kv8<HD>(smem, raw + (j & 1) * STAGE);
            __syncthreads();
        }
        const uint32_t stage = smem_base + (FP8 ? 0 : (j & 1) * STAGE * 2);
#pragma unroll
        for (int c = 0; c < TILE_K / SUB_K; ++c) {
            const int32_t k = k0 + c * SUB_K;
            const uint32_t k_addr = stage + c * SUB_K * HD * 2 + k_lane;
            const uint32_t v_addr = stage + (TILE_K + c * SUB_K) * HD * 2 + v_lane;
            // Masking where the keys reach past an m-tile's first position (which also hides the
            // zero-filled keys past the context).
            const int mask = (k + SUB_K - 1 > first_pos + row0[0] ? 1 : 0) |
                             (k + SUB_K - 1 > first_pos + row0[1] ? 2 : 0);
            const bool a0 = k <= last[0], a1 = k <= last[1];
            if (a0 && a1)
                key_tile<HD, 3>(st, k_addr, v_addr, scale_log2, mask, k, pos0);
            else if (a1)
                key_tile<HD, 2>(st, k_addr, v_addr, scale_log2, mask, k, pos0);
            else if (a0)
                key_tile<HD, 1>(st, k_addr, v_addr, scale_log2, mask, k, pos0);
        }
    }

    const int g = lane >> 2, tg = lane & 3;
#pragma unroll
    for (int t = 0; t < M_TILES; ++t) {
        metrale::store_tile_rows<HD>(
            out, [&](int d, int j) { return FP8 ? st.o[t][d][j] * v_scale : st.o[t][d][j]; },
            st.l[t][0], st.l[t][1], row0[t] + g, count, first_token, q_heads, h, tg);
    }
}
}  // namespace v2
}  // namespace

// Launch: grid = (q_heads, num_tiles), block = 128, no dynamic shared memory (32 KiB static).
// `tiles` is i32 [num_tiles, 4] = (seq, first_token, first_position, count), count in 1..=128
// (tiles of up to 64 are valid too, at half the rows per block). head_dim must be 64 or 128 (other
// head dims write nothing); scale must be positive.
extern "C" __global__ void __launch_bounds__(v2::THREADS, 2) prefill_attention_v2_bf16(
    __nv_bfloat16* __restrict__ out, const __nv_bfloat16* __restrict__ q,
    const __nv_bfloat16* __restrict__ k_cache, const __nv_bfloat16* __restrict__ v_cache,
    const int32_t* __restrict__ block_tables, const int32_t* __restrict__ tiles, uint32_t num_tiles,
    uint32_t q_heads, uint32_t kv_heads, uint32_t head_dim, uint32_t block_size,
    uint32_t max_blocks_per_seq, float scale) {
    __shared__ __align__(1024) __nv_bfloat16 smem[v2::STAGES * 2 * v2::TILE_K * v2::MAX_HD];
    metrale::grid_dependency_sync();
    if (blockIdx.y >= num_tiles || blockIdx.x >= q_heads || kv_heads == 0 ||
        q_heads % kv_heads != 0 || blockDim.x != v2::THREADS)
        return;
    const int32_t* tile_desc = tiles + (size_t)(num_tiles - 1 - blockIdx.y) * 4;
#define METRALE_PREFILL_V2(HD)                                                                 \
    v2::attend_tile<HD, false>(out, q, k_cache, v_cache, block_tables, tile_desc, blockIdx.x,    \
                               q_heads, kv_heads, block_size, max_blocks_per_seq, scale, 1.0f,  \
                               1.0f, smem)
    switch (head_dim) {
        case 64: METRALE_PREFILL_V2(64); break;
        case 128: METRALE_PREFILL_V2(128); break;
        default: break;
    }
#undef METRALE_PREFILL_V2
}

// prefill_attention_v2_bf16 over an FP8 cache (e4m3 [num_blocks, block_size, kv_heads, head_dim]
// each, holding e4m3(k / k_scale) and e4m3(v / v_scale)): the same arithmetic on the e4m3 values
// (exact in bf16), the score scale times k_scale, the output times v_scale. The launch is
// prefill_attention_v2_bf16's (the same 32 KiB of static shared memory).
extern "C" __global__ void __launch_bounds__(v2::THREADS, 2) prefill_attention_v2_fp8(
    __nv_bfloat16* __restrict__ out, const __nv_bfloat16* __restrict__ q,
    const uint8_t* __restrict__ k_cache, const uint8_t* __restrict__ v_cache,
    const int32_t* __restrict__ block_tables, const int32_t* __restrict__ tiles, uint32_t num_tiles,
    uint32_t q_heads, uint32_t kv_heads, uint32_t head_dim, uint32_t block_size,
    uint32_t max_blocks_per_seq, float scale, float k_scale, float v_scale) {
    __shared__ __align__(1024) __nv_bfloat16 smem[v2::STAGES * 2 * v2::TILE_K * v2::MAX_HD];
    metrale::grid_dependency_sync();
    if (blockIdx.y >= num_tiles || blockIdx.x >= q_heads || kv_heads == 0 ||
        q_heads % kv_heads != 0 || blockDim.x != v2::THREADS)
        return;
    const int32_t* tile_desc = tiles + (size_t)(num_tiles - 1 - blockIdx.y) * 4;
#define METRALE_PREFILL_V2(HD)                                                                 \
    v2::attend_tile<HD, true>(out, q, k_cache, v_cache, block_tables, tile_desc, blockIdx.x,     \
                              q_heads, kv_heads, block_size, max_blocks_per_seq, scale, k_scale, \
                              v_scale, smem)
    switch (head_dim) {
        case 64: METRALE_PREFILL_V2(64); break;
        case 128: METRALE_PREFILL_V2(128); break;
        default: break;
    }
#undef METRALE_PREFILL_V2
}
