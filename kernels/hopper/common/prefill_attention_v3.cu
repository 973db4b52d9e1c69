// SPDX-License-Identifier: MIT OR Apache-2.0
// Causal prefill attention on Hopper's warpgroup MMA (version 3): the tile format, arguments and
// arithmetic of prefill_attention_v2_bf16 (prefill_attention.cu), with S = Q K^T and O += P V
// issued as wgmma.mma_async over shared-memory tiles, for head_dim 128.
//
// grid = (q_heads, num_tiles), block = 2 warpgroups (256 threads); heads run fastest and tile
// num_tiles - 1 - blockIdx.y is taken, as in version 2. Warpgroup w owns query rows
// 64w..64w+63 of the 128-row tile; within it warp i owns rows 16i..16i+15 with the accumulator
// layout of mma.m16n8k16 (rows g = lane / 4 and g + 8, columns 2 (lane % 4) + 0..1 of each
// 8-column block).
//
// Shared memory (dynamic, 224 KiB + alignment): q (128 x 128 bf16) and a ring of 3 stages of K
// and V tiles (128 keys x 128 bf16 each), every tile as two 64-column blocks of 128-byte swizzled
// rows (wgmma.cuh). All 256 threads copy with 16-byte cp.async, keys gathered through the block
// table and zero-filled past the context; the copies run one key tile ahead of the one being
// multiplied, with one barrier per key tile.
//
// Per key tile j, each warpgroup issues S_j = Q K_j^T (8 k-steps of m64n128k16, both operands in
// shared memory) and O += P_{j-1} V_{j-1} (8 k-steps of m64n128k16, P in registers, V read
// N-major) back to back, then the copies of key tile j + 1 (their block-table lookups overlap the
// products), and waits for both products. Warpgroup 0 then masks S_j, updates the running max and
// sum, rescales O by the factor of the max's move and makes P_j (bf16); warpgroup 1 does the same
// for S_j after the next tile's barrier, before issuing that tile's products, so that each
// warpgroup's softmax runs while the other's products keep the tensor cores busy (ping-pong). No
// register the products read or write is touched while they run (docs/results/2026-12-01-speed-
// h200/prefill-v3: a softmax overlapping the warpgroup's own P V product gave wrong outputs). The
// arithmetic is version 2's at key tiles of 128: f32 scores scaled by scale log2(e), ex2 on the
// SFU, probabilities rounded to bf16 for the product and for the row sum (docs/precision.md), the
// output divided by the row sum and rounded to bf16 once. A warpgroup whose rows all precede a
// key tile still multiplies it (fully masked, P = 0): only a tile's last key tile can be one.
#include "async_copy.cuh"
#include "common.cuh"
#include "mma.cuh"
#include "wgmma.cuh"

namespace {
namespace v3 {
constexpr int HD = 128;
constexpr int WARPGROUPS = 2;
constexpr int THREADS = WARPGROUPS * 128;
constexpr int TILE_Q = WARPGROUPS * 64;  // query rows per block
// Keys per stage. 128 against 64 (4 stages, 2 ahead): 8192-token rows 1690 against 1790 us on
// the H200, fewer barriers and softmax reductions per key
// (docs/results/2026-12-01-speed-h200/prefill-v3/variants.txt, call 8).
constexpr int TILE_K = 128;
constexpr int N_TILES = TILE_K / 8;   // 8-key column blocks of S
constexpr int K_STEPS = TILE_K / 16;  // 16-key k-steps of P V
constexpr uint32_t STAGES = 3;
constexpr uint32_t AHEAD = STAGES - 2;  // key tiles copied ahead of the one being multiplied
constexpr uint32_t Q_BLOCK = TILE_Q * 128;  // bytes of one 64-column block of q
constexpr uint32_t KV_BLOCK = TILE_K * 128;  // bytes of one 64-column block of a K or V tile
constexpr uint32_t Q_BYTES = 2 * Q_BLOCK;
constexpr uint32_t KV_BYTES = 2 * KV_BLOCK;  // one K or V tile
constexpr uint32_t STAGE_BYTES = 2 * KV_BYTES;  // K, then V
constexpr uint32_t SMEM_BYTES = Q_BYTES + STAGES * STAGE_BYTES;
// With the 1 KiB of alignment slack, within the 227 KiB a block may take (PrefillAttentionV3's
// SMEM_BYTES on the host).
static_assert(SMEM_BYTES + 1024 <= 227 * 1024, "shared memory over the per-block limit");
constexpr float LOG2E = 1.4426950408889634f;

using metrale::BlockSplit;
using metrale::cp_async_16;
using metrale::cp_async_commit;
using metrale::cp_async_wait;
using metrale::exp2_approx;
using metrale::pack_bf16;
using metrale::smem_addr;
namespace wg = metrale::wgmma;

// Byte offset of 16-byte chunk c (0..15) of row r in a tile of `rows` rows kept as two 64-column
// blocks of 128-byte swizzled rows.
__device__ __forceinline__ uint32_t chunk_offset(uint32_t rows, int r, int c) {
    return (c >> 3) * rows * 128 + r * 128 + (((c & 7) ^ (r & 7)) << 4);
}

// Starts the copy of keys [k0, k0 + TILE_K) of one kv head, K and V, into the stage at shared
// byte address `stage`; keys at or past n_keys are zero-filled.
__device__ __forceinline__ void load_kv(uint32_t stage, const __nv_bfloat16* k_cache,
                                        const __nv_bfloat16* v_cache, const int32_t* table,
                                        const BlockSplit& blocks, uint32_t k0, uint32_t n_keys,
                                        uint32_t kv_heads, uint32_t kvh) {
    const int c = threadIdx.x % 16;
#pragma unroll
    for (int r = threadIdx.x / 16; r < TILE_K; r += THREADS / 16) {
        const uint32_t key = k0 + r;
        const bool valid = key < n_keys;
        size_t off = 0;
        if (valid) off = ((size_t)blocks.slot(table, key) * kv_heads + kvh) * HD + c * 8;
        const uint32_t dst = stage + chunk_offset(TILE_K, r, c);
        cp_async_16(dst, k_cache + off, valid);
        cp_async_16(dst + KV_BYTES, v_cache + off, valid);
    }
}

// O += P V for the V tile of the stage at `stage` (P: this thread's A fragments, K_STEPS k-steps
// of 16 keys). V is N-major: 16-key k-steps 2048 bytes apart, its two 64-column blocks KV_BLOCK apart.
__device__ __forceinline__ void issue_pv(float (&o)[64], const uint32_t (&p)[K_STEPS][4],
                                         uint32_t stage) {
    const uint32_t v = stage + KV_BYTES;
#pragma unroll
    for (int kk = 0; kk < K_STEPS; ++kk)
        wg::mma_m64n128k16_rs_nmajor(o, p[kk], wg::desc_sw128(v + kk * 2048, KV_BLOCK, 1024));
}

__device__ __forceinline__ void attend_tile(
    __nv_bfloat16* __restrict__ out, const __nv_bfloat16* __restrict__ q,
    const __nv_bfloat16* __restrict__ k_cache, const __nv_bfloat16* __restrict__ v_cache,
    const int32_t* __restrict__ block_tables, const int32_t* __restrict__ tile_desc, uint32_t h,
    uint32_t q_heads, uint32_t kv_heads, uint32_t block_size, uint32_t max_blocks_per_seq,
    float scale, uint32_t smem) {
    const int tid = threadIdx.x, group = tid / 128, warp = (tid / 32) % 4, lane = tid & 31;
    const int g = lane >> 2, tg = lane & 3;
    const int32_t seq = tile_desc[0], first_token = tile_desc[1], first_pos = tile_desc[2],
                  count = tile_desc[3];
    if (count <= 0 || count > TILE_Q || first_pos < 0 || seq < 0) return;
    const uint32_t kvh = h / (q_heads / kv_heads);
    const uint32_t n_keys = (uint32_t)first_pos + (uint32_t)count;
    const int32_t* table = block_tables + (size_t)seq * max_blocks_per_seq;
    const BlockSplit blocks(block_size);
    const uint32_t q_smem = smem, kv_smem = smem + Q_BYTES;

    // q rows of the tile (rows past count zero) go with key tile 0 in the first copy group.
    {
        const int c = tid % 16;
#pragma unroll
        for (int r = tid / 16; r < TILE_Q; r += THREADS / 16) {
            const bool valid = r < count;
            const __nv_bfloat16* src = q;
            if (valid) src = q + ((size_t)(first_token + r) * q_heads + h) * HD + c * 8;
            cp_async_16(q_smem + chunk_offset(TILE_Q, r, c), src, valid);
        }
    }
    const uint32_t key_tiles = (n_keys + TILE_K - 1) / TILE_K;
#pragma unroll
    for (uint32_t t = 0; t < AHEAD; ++t) {
        if (t < key_tiles)
            load_kv(kv_smem + t * STAGE_BYTES, k_cache, v_cache, table, blocks, t * TILE_K, n_keys,
                    kv_heads, kvh);
        cp_async_commit();
    }

    // This warpgroup's 64 q rows: 8 k-steps of 16 dims, 32 bytes apart within a 64-column block.
    const uint32_t q_rows = q_smem + group * 64 * 128;
    const int32_t pos0 = first_pos + 64 * group + 16 * warp + g, pos1 = pos0 + 8;
    const int32_t group_first = first_pos + 64 * group;  // the warpgroup's first position
    const float scale_log2 = scale * LOG2E;
    float o[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) o[i] = 0.0f;
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;
    uint32_t p[K_STEPS][4];

    float s[TILE_K / 2];
    // S_j = Q K_j^T and, for j > 0, O += P_{j-1} V_{j-1}, issued as two commit groups. The last
    // writes of O (the rescale) and P come before the fence, so that the products see them.
    auto issue = [&](uint32_t j) {
        const uint32_t k_stage = kv_smem + (j % STAGES) * STAGE_BYTES;
        wg::fence_operands(o);
#pragma unroll
        for (int kk = 0; kk < K_STEPS; ++kk) wg::fence_operands(p[kk]);
        wg::fence();
#pragma unroll
        for (int ks = 0; ks < 8; ++ks) {
            const uint32_t block = (ks >> 2), step = (ks & 3) * 32;
            wg::mma_ss(s, wg::desc_sw128(q_rows + block * Q_BLOCK + step, 16, 1024),
                       wg::desc_sw128(k_stage + block * KV_BLOCK + step, 16, 1024), ks > 0);
        }
        wg::commit();
        if (j > 0) {
            wg::fence();
            issue_pv(o, p, kv_smem + ((j - 1) % STAGES) * STAGE_BYTES);
            wg::commit();
        }
    };
    // Waits for this warpgroup's products; nothing touches their registers while they run (with
    // the softmax overlapping this warpgroup's own P V product, outputs went wrong on the H200 in
    // a way that moved with register allocation).
    auto settle = [&]() {
        wg::wait<0>();
        wg::fence_operands(o);
#pragma unroll
        for (int kk = 0; kk < K_STEPS; ++kk) wg::fence_operands(p[kk]);
        wg::fence_operands(s);
    };
    // The softmax of key tile j from S_j (in s): masks, moves the running max and sum, rescales
    // O (which holds P_{j-1} V_{j-1} by now) and makes P_j.
    auto softmax = [&](uint32_t j) {
        // Causal mask (which also hides the zero-filled keys past the context) where the key
        // tile reaches past the warpgroup's first position.
        const int32_t k0 = (int32_t)(j * TILE_K);
        if (k0 + TILE_K - 1 > group_first) {
#pragma unroll
            for (int i = 0; i < N_TILES; ++i) {
                const int32_t key = k0 + 8 * i + 2 * tg;
                if (key > pos0) s[4 * i] = -INFINITY;
                if (key + 1 > pos0) s[4 * i + 1] = -INFINITY;
                if (key > pos1) s[4 * i + 2] = -INFINITY;
                if (key + 1 > pos1) s[4 * i + 3] = -INFINITY;
            }
        }
        float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
        for (int i = 0; i < N_TILES; ++i) {
            mx0 = fmaxf(mx0, fmaxf(s[4 * i], s[4 * i + 1]));
            mx1 = fmaxf(mx1, fmaxf(s[4 * i + 2], s[4 * i + 3]));
        }
#pragma unroll
        for (int off = 1; off <= 2; off <<= 1) {
            mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, off));
            mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, off));
        }
        // A row whose keys here are all masked keeps its max (finite from tile 0 on: key 0 is
        // every row's) and adds p = 0; the -inf guard only keeps a keyless row at 0, not NaN.
        const float new0 = fmaxf(m0, mx0 * scale_log2), new1 = fmaxf(m1, mx1 * scale_log2);
        const float base0 = new0 == -INFINITY ? 0.0f : new0;
        const float base1 = new1 == -INFINITY ? 0.0f : new1;
        const float corr0 = new0 == m0 ? 1.0f : exp2_approx(m0 - base0);
        const float corr1 = new1 == m1 ? 1.0f : exp2_approx(m1 - base1);
        m0 = new0;
        m1 = new1;
        uint32_t pn[K_STEPS][4];
        float sum0 = 0.0f, sum1 = 0.0f;
#pragma unroll
        for (int i = 0; i < N_TILES; ++i) {
            const __nv_bfloat162 lo =
                __floats2bfloat162_rn(exp2_approx(fmaf(s[4 * i], scale_log2, -base0)),
                                      exp2_approx(fmaf(s[4 * i + 1], scale_log2, -base0)));
            const __nv_bfloat162 hi =
                __floats2bfloat162_rn(exp2_approx(fmaf(s[4 * i + 2], scale_log2, -base1)),
                                      exp2_approx(fmaf(s[4 * i + 3], scale_log2, -base1)));
            const float2 lf = __bfloat1622float2(lo), hf = __bfloat1622float2(hi);
            sum0 += lf.x + lf.y;
            sum1 += hf.x + hf.y;
            // Columns 8i..8i+7 are keys 8 (i % 2).. of k-step i / 2: fragment registers 0/1
            // (rows g / g + 8) for the lower 8 keys, 2/3 for the upper.
            pn[i / 2][(i & 1) * 2] = pack_bf16(lo);
            pn[i / 2][(i & 1) * 2 + 1] = pack_bf16(hi);
        }
        l0 = l0 * corr0 + sum0;
        l1 = l1 * corr1 + sum1;
        if (corr0 != 1.0f || corr1 != 1.0f) {
#pragma unroll
            for (int i = 0; i < 16; ++i) {
                o[4 * i] *= corr0;
                o[4 * i + 1] *= corr0;
                o[4 * i + 2] *= corr1;
                o[4 * i + 3] *= corr1;
            }
        }
#pragma unroll
        for (int kk = 0; kk < K_STEPS; ++kk)
#pragma unroll
            for (int r = 0; r < 4; ++r) p[kk][r] = pn[kk][r];
    };

    // Ping-pong between the warpgroups: warpgroup 1 runs the softmax of key tile j - 1 after the
    // barrier that starts tile j, not before it. So its softmax runs while warpgroup 0's products
    // of tile j keep the tensor cores busy, and warpgroup 0's softmax of tile j while warpgroup
    // 1's products run. Every wgmma issue and wait stays on the path both warpgroups take (in a
    // branch on the warpgroup, ptxas serialises them: C7518); only the softmax is per warpgroup,
    // and it touches no register of a product in flight. Same arithmetic per warpgroup, in the
    // same order, as the lockstep loop.
    for (uint32_t j = 0; j < key_tiles; ++j) {
        // Key tile j has landed for every thread and is visible to the async proxy; both
        // warpgroups are done with the products of tile j + AHEAD - STAGES (waited for in an
        // earlier tile's interval), whose stage tile j + AHEAD takes.
        cp_async_wait<AHEAD - 1>();
        wg::fence_proxy_async();
        __syncthreads();
        // Nothing is in flight here (each warpgroup waited at the end of the last tile); the wait
        // tells ptxas so, which it needs before warpgroup 1's softmax writes the products'
        // registers (without it: C7515, every wgmma serialised).
        settle();
        if (group == 1 && j > 0) softmax(j - 1);
        issue(j);
        // The copies of tile j + AHEAD (block-table lookups and all) go out while the products
        // run: issued before them, their lookups' latency held the products back every tile.
        if (j + AHEAD < key_tiles)
            load_kv(kv_smem + ((j + AHEAD) % STAGES) * STAGE_BYTES, k_cache, v_cache, table,
                    blocks, (j + AHEAD) * TILE_K, n_keys, kv_heads, kvh);
        cp_async_commit();
        settle();
        if (group == 0) softmax(j);
    }
    if (key_tiles > 0) {
        if (group == 1) softmax(key_tiles - 1);
        wg::fence_operands(o);
#pragma unroll
        for (int kk = 0; kk < K_STEPS; ++kk) wg::fence_operands(p[kk]);
        wg::fence();
        issue_pv(o, p, kv_smem + ((key_tiles - 1) % STAGES) * STAGE_BYTES);
        wg::commit();
        wg::wait<0>();
        wg::fence_operands(o);
    }
    // The block's copies are all done (the last groups are empty) before it exits.
    cp_async_wait<0>();

    metrale::store_tile_rows<HD>(out, [&](int d, int j) { return o[4 * d + j]; }, l0, l1,
                                 64 * group + 16 * warp + g, count, first_token, q_heads, h, tg);
}
}  // namespace v3
}  // namespace

// Launch: grid = (q_heads, num_tiles), block = 256, dynamic shared memory 224 KiB + 1 KiB of
// alignment slack. The arguments and tiles are version 2's (count in 1..=128); head_dim must be
// 128 (others write nothing: callers keep version 2); scale must be positive.
extern "C" __global__ void __launch_bounds__(v3::THREADS, 1) prefill_attention_v3_bf16(
    __nv_bfloat16* __restrict__ out, const __nv_bfloat16* __restrict__ q,
    const __nv_bfloat16* __restrict__ k_cache, const __nv_bfloat16* __restrict__ v_cache,
    const int32_t* __restrict__ block_tables, const int32_t* __restrict__ tiles, uint32_t num_tiles,
    uint32_t q_heads, uint32_t kv_heads, uint32_t head_dim, uint32_t block_size,
    uint32_t max_blocks_per_seq, float scale) {
    extern __shared__ __align__(1024) unsigned char v3_smem[];
    metrale::grid_dependency_sync();
    if (blockIdx.y >= num_tiles || blockIdx.x >= q_heads || kv_heads == 0 ||
        q_heads % kv_heads != 0 || blockDim.x != v3::THREADS || head_dim != v3::HD)
        return;
    // The swizzle atoms must start on 1024-byte boundaries.
    const uint32_t base = (metrale::smem_addr(v3_smem) + 1023u) & ~1023u;
    const int32_t* tile_desc = tiles + (size_t)(num_tiles - 1 - blockIdx.y) * 4;
    v3::attend_tile(out, q, k_cache, v_cache, block_tables, tile_desc, blockIdx.x, q_heads,
                    kv_heads, block_size, max_blocks_per_seq, scale, base);
}
