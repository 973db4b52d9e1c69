// SPDX-License-Identifier: MIT OR Apache-2.0
// Causal grouped-query attention over a paged KV cache, for decode (and any step the tensor-core
// prefill kernel, prefill_attention.cu, does not take).
//
// Token t of sequence s = token_seq[t] at position p = positions[t] attends to keys 0..=p of
// its sequence, which live in the cache blocks block_tables[s][*] (block_size tokens each; the
// cache is [num_blocks, block_size, kv_heads, head_dim]). Query head h reads kv head
// h / (q_heads / kv_heads). Scores, the softmax state and the weighted sum of values are f32
// (the probabilities that weight the values are rounded to f16), with an online (running max)
// softmax; the output is rounded to bf16 once.
//
// Split-K ("flash decoding"), grouped by kv head: grid = (tokens, kv_heads, splits), block = 4
// warps (8 in the wide entry, paged_attention_qkv_wide_bf16). A block serves the G query heads
// that share its kv head (G = q_heads / kv_heads up to 8; a wider group is split into blocks of
// its largest divisor up to 8, block_group: 16 into two of 8, GLM-4.5's 12 into two of 6), so
// each key and value row is read once per block, not once per query head. Split z takes keys
// [z * keys_per_split, (z + 1) * keys_per_split) of the token's context (one split takes the
// whole context). The split's keys come in tiles of 16, dealt round robin to the warps; each warp
// streams its tiles through its own ring of STAGES shared-memory buffers (K and V, 16 rows each,
// gathered through the block table with 16-byte cp.async), so up to STAGES tiles per warp are in
// flight while it computes on the oldest: a decode step waits for memory about once, not once
// per key tile and value batch. Both products run on tensor cores (mma.sync m16n8k16, f32
// accumulators). Scores: S = Q K^T with the group's queries as the rows of the A operand (G of
// 16 real, held in registers as bf16 fragments) and the tile's keys, read by ldmatrix from K rows
// stored swizzled (chunk c of row r at c ^ (r & 7), free of bank conflicts), as the columns: the
// exact bf16 products summed in f32, then scaled (log2 units, ex2). The online softmax runs on the
// fragments (a head's 16 keys sit in one lane quad). Output: transposed, O^T = V^T P^T, so that
// each lane's probabilities are already the B operand (8 heads as the columns) and no accumulator
// is padding when G = 8: the probabilities are rounded to f16 (relative error at most 2^-11; the
// row sum adds the rounded values, so the output is normalised by the weights it was summed
// with), and V^T comes by the transposing ldmatrix, converted from bf16 to f16 (exact for
// magnitudes 2^-14 to 65504). The warps' running softmaxes merge in shared memory (reusing the
// rings).
// With one split the block writes the bf16 output; with more, it writes each head's partial
// (acc[head_dim], m, l) to `partials` (an empty split writes m = 0, l = 0, acc = 0), and the last
// block of a (token, kv head) to finish - counted in `counters`, which it sets back to zero -
// merges the splits' partials into the bf16 output, so no combine launch is needed
// (attention_combine_bf16 remains for callers that want the partials only). The merge reads only
// the splits that reach into the token's context: a launch may carry more splits than its longest
// context needs (the model buckets its launch shapes so that one decode graph serves a range of
// context lengths), and those are empty.
// Batch-1 decode has kv_heads blocks per split, so splitting the context is what fills the GPU.
#include "async_copy.cuh"
#include "common.cuh"
#include "mma.cuh"
#include "kv_fp8.cuh"
#include "qkv_post.cuh"
#include <cuda_fp16.h>

namespace {
// Warps a block: 4 in paged_attention_bf16 and paged_attention_qkv_bf16 (two blocks an SM at
// head_dim 128), 8 in paged_attention_qkv_wide_bf16 (one block an SM at head_dim 128, each warp's
// ring as deep; for launches of few blocks, where a block's tiles in a row are the latency).
constexpr int NARROW_WARPS = 4;
constexpr int WIDE_WARPS = 8;
constexpr int KEY_TILE = 16;  // keys per warp tile
constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2 = 0.6931471805599453f;

// Tiles in flight per warp: the rings take WARPS * STAGES * 2 * KEY_TILE * HD * 2 bytes (96 KiB at
// head_dim 128 and 4 warps, two blocks per SM; 192 KiB at 8 warps). The FP8 forms' rings hold
// e4m3 tiles (half the bytes) plus one converted K and V tile per warp (4 * KEY_TILE * HD bytes):
// one stage more in the same shared memory at head_dims 64 and 128.
template <int HD, bool FP8>
__host__ __device__ constexpr int stages() {
    return HD >= 256 ? 2 : FP8 ? 4 : 3;
}

// Bytes of one warp's ring (and, FP8, its converted tiles).
template <int HD, bool FP8>
__host__ __device__ constexpr int ring_bytes() {
    return FP8 ? (stages<HD, FP8>() * 2 + 4) * KEY_TILE * HD : stages<HD, FP8>() * 2 * KEY_TILE * HD * 2;
}

// The per-tensor scales of an FP8 cache (kv_fp8.cuh): the cache holds e4m3(k / k), e4m3(v / v).
struct KvScales {
    float k, v;
};

// The fused form's extra inputs (paged_attention_qkv_bf16): the raw QKV product and what
// qkv_rope_kv_write_bf16 takes to turn it into the queries and the newest key and value.
struct Post {
    const __nv_bfloat16* qkv;  // [tokens, (q_heads + 2 kv_heads) * head_dim]
    const __nv_bfloat16* q_norm;
    const __nv_bfloat16* k_norm;
    const int32_t* slots;  // [tokens]: the cache row of each token's own key and value
    void* k_cache;  // the caches attend reads (bf16 or e4m3), to write the newest key and value
    void* v_cache;
    // Shared memory for the group's transformed queries and the newest key and value:
    // [G * head_dim] then [2 * head_dim] bf16 (FP8: the newest key as bf16 and value as f16 of
    // their e4m3 values, as the converted tiles hold them), 16-byte aligned (one static array of the entry
    // point, sized for the largest group and head_dim, so the instantiations share it).
    __nv_bfloat16* smem;
    const float* cos_table;
    const float* sin_table;
    uint32_t max_position;
    float eps;
};

// FP8: the caches hold e4m3 (kv_fp8.cuh). Each warp copies e4m3 tiles into its ring and, once a
// tile has landed, converts it into one bf16 K tile and one f16 V tile (the raw e4m3 values,
// exact), which the products read as the bf16 form reads its ring; k_scale multiplies the score
// scale and v_scale the weighted sums.
template <int HD, int G, bool POST, int WARPS, bool FP8>
__device__ __forceinline__ void attend(
    __nv_bfloat16* __restrict__ out, float* __restrict__ partials, int32_t* __restrict__ counters,
    const __nv_bfloat16* __restrict__ q, const void* __restrict__ k_cache_any,
    const void* __restrict__ v_cache_any, const int32_t* __restrict__ block_tables,
    const int32_t* __restrict__ token_seq, const int32_t* __restrict__ positions,
    uint32_t q_heads, uint32_t kv_heads, uint32_t block_size, uint32_t max_blocks_per_seq,
    uint32_t keys_per_split, float scale, KvScales kv_scales, const Post& post) {
    constexpr int CHUNKS = HD / 8;     // 16-byte pieces of a bf16 key row
    constexpr int CHUNKS8 = HD / 16;   // 16-byte pieces of an e4m3 key row
    constexpr int STAGES = stages<HD, FP8>();
    constexpr int TILE = KEY_TILE * HD;  // bf16 of one K (or V) tile
    constexpr unsigned FULL = 0xffffffffu;
    constexpr int KSTEPS = HD / 16;    // mma k-steps over the head dim
    // Dynamic shared memory (PagedAttention's launch_config, or PagedAttentionQkv's
    // wide_launch_config at 8 warps): the warps' rings
    // [WARPS][STAGES][K tile, V tile] bf16, which the merge reuses once every warp is done:
    // part_acc[WARPS][G][HD], part_m[WARPS][G], part_l[WARPS][G], weight[G][splits] (f32).
    extern __shared__ __align__(16) float smem[];
    float* merge = smem;
    float(*part_acc)[G][HD] = reinterpret_cast<float(*)[G][HD]>(merge);
    float(*part_m)[G] = reinterpret_cast<float(*)[G]>(merge + WARPS * G * HD);
    float(*part_l)[G] = reinterpret_cast<float(*)[G]>(merge + WARPS * G * HD + WARPS * G);

    // A kv head whose query group is wider than 8 is served by gridDim.y / kv_heads blocks, each
    // taking G of its query heads (block_group); otherwise block y is kv head y.
    const uint32_t t = blockIdx.x, kvh = blockIdx.y / (gridDim.y / kv_heads), split = blockIdx.z,
                   splits = gridDim.z;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    unsigned char* ring_bytes_base = reinterpret_cast<unsigned char*>(merge) + warp * ring_bytes<HD, FP8>();
    // bf16: [STAGES][K tile, V tile] bf16. FP8: [STAGES][K tile, V tile] e4m3, then the converted
    // K (bf16) and V (f16) tiles.
    __nv_bfloat16* ring = reinterpret_cast<__nv_bfloat16*>(ring_bytes_base);
    unsigned char* ring8 = ring_bytes_base;
    __nv_bfloat16* conv_k = reinterpret_cast<__nv_bfloat16*>(ring_bytes_base + STAGES * 2 * TILE);
    __nv_bfloat16* conv_v = conv_k + TILE;  // f16 bits
    const __nv_bfloat16* k_cache = static_cast<const __nv_bfloat16*>(k_cache_any);
    const __nv_bfloat16* v_cache = static_cast<const __nv_bfloat16*>(v_cache_any);
    const unsigned char* k_cache8 = static_cast<const unsigned char*>(k_cache_any);
    const unsigned char* v_cache8 = static_cast<const unsigned char*>(v_cache_any);
    const uint32_t h0 = blockIdx.y * G;  // first query head of the block's group
    const int32_t seq = token_seq[t];
    const uint32_t ctx = (uint32_t)positions[t] + 1;
    const uint32_t begin = min(split * keys_per_split, ctx);
    const uint32_t end = splits == 1 ? ctx : min(begin + keys_per_split, ctx);
    const int32_t* table = block_tables + (size_t)seq * max_blocks_per_seq;
    const metrale::BlockSplit blocks(block_size);

    // This warp's tiles: keys begin + (warp + WARPS i) KEY_TILE onwards, i < n_tiles.
    const uint32_t first = begin + warp * KEY_TILE;
    const int n_tiles = first < end ? (int)((end - first + WARPS * KEY_TILE - 1) / (WARPS * KEY_TILE)) : 0;
    auto tile_key = [&](int i) { return first + (uint32_t)i * WARPS * KEY_TILE; };
    // Lane r < KEY_TILE's key of tile i, as a cache slot (0 past the tile or the split).
    auto slot_of = [&](int i) -> uint32_t {
        const uint32_t key = tile_key(i) + (lane & (KEY_TILE - 1));
        return i < n_tiles && key < end ? blocks.slot(table, key) : 0u;
    };
    // Starts the copy of tile i (if it exists) into its ring buffer; commits a group either way,
    // so that the group count stays in step with the tiles.
    auto issue = [&](int i, uint32_t slot) {
        if (FP8 && i < n_tiles) {
            const uint32_t key0 = tile_key(i);
            unsigned char* ks = ring8 + (i % STAGES) * 2 * TILE;
            unsigned char* vs = ks + TILE;
#pragma unroll
            for (int u = 0; u < KEY_TILE * CHUNKS8 / 32; ++u) {
                const int piece = lane + 32 * u, r = piece / CHUNKS8, c = piece % CHUNKS8;
                const uint32_t s = __shfl_sync(FULL, slot, r);
                const bool valid = key0 + r < end;
                const size_t off = valid ? ((size_t)s * kv_heads + kvh) * HD + c * 16 : 0;
                metrale::cp_async_16(metrale::smem_addr(ks + piece * 16), k_cache8 + off, valid);
                metrale::cp_async_16(metrale::smem_addr(vs + piece * 16), v_cache8 + off, valid);
            }
        } else if (!FP8 && i < n_tiles) {
            const uint32_t key0 = tile_key(i);
            __nv_bfloat16* ks = ring + (i % STAGES) * 2 * TILE;
            __nv_bfloat16* vs = ks + TILE;
#pragma unroll
            for (int u = 0; u < KEY_TILE * CHUNKS / 32; ++u) {
                const int piece = lane + 32 * u, r = piece / CHUNKS, c = piece % CHUNKS;
                const uint32_t s = __shfl_sync(FULL, slot, r);
                const bool valid = key0 + r < end;
                const size_t off = valid ? ((size_t)s * kv_heads + kvh) * HD + c * 8 : 0;
                metrale::cp_async_16(metrale::smem_addr(ks + metrale::swizzle<HD>(r, c)), k_cache + off, valid);
                metrale::cp_async_16(metrale::smem_addr(vs + metrale::swizzle<HD>(r, c)), v_cache + off, valid);
            }
        }
        metrale::cp_async_commit();
    };

    // The first STAGES - 1 tiles go out before the queries are loaded, so the two overlap. Their
    // slots (and the next tile's) come from the block table, which no kernel writes (the host
    // uploads it with the step), so they are looked up before the programmatic-launch wait, while
    // the kernel that writes this step's queries and newest keys may still be running; the
    // queries are read only after it, and so is the cache in the plain form (the fused form's
    // first copies: below).
    uint32_t slots[STAGES - 1];
#pragma unroll
    for (int i = 0; i < STAGES - 1; ++i) slots[i] = slot_of(i);
    uint32_t pending = slot_of(STAGES - 1);
    // Fused form: the split holding the token's own key (position ctx - 1) also writes that key
    // and value into the cache, and patches them into its tile (the copy from the cache may have
    // read the slot before this block wrote it). A negative slot writes nothing and patches
    // nothing, as qkv_rope_kv_write_bf16 writes nothing for it.
    const uint32_t newest = ctx - 1;
    const int32_t own_slot = POST ? __ldg(post.slots + t) : -1;
    const bool owner = POST && own_slot >= 0 && begin <= newest && newest < end;
    // Fused form: this thread's first item's norm weight and its cos/sin row (uploaded once, not
    // written by the kernel before) are loaded before the wait, so that after it only the raw
    // head is a memory round trip.
    constexpr uint32_t POST_LANES = HD / 8, PER_PASS = WARPS * 32 / POST_LANES, HALF = HD / 2;
    const uint32_t post_e = 4 * (threadIdx.x % POST_LANES);
    const int32_t post_pos = positions[t];
    const bool rotate = POST && post_pos >= 0 && (uint32_t)post_pos < post.max_position;
    metrale::qkv_post::Params first_params;
    if constexpr (POST) {
        const int item = (int)(threadIdx.x / POST_LANES);
        first_params = metrale::qkv_post::load_params(item < G ? post.q_norm : post.k_norm, rotate,
                                                      post_pos, post.cos_table, post.sin_table,
                                                      post_e, HALF);
    }
    // The plain form's kernel before (qkv_rope_kv_write_bf16) writes the newest key into the
    // cache, so its copies wait. The fused form's kernel before is the QKV product, which writes
    // no cache row (this block writes the newest key itself and patches it into its tile below),
    // so its first copies go out before the wait and land while that product finishes.
    if constexpr (!POST) metrale::grid_dependency_sync();
#pragma unroll
    for (int i = 0; i < STAGES - 1; ++i) issue(i, slots[i]);
    if constexpr (POST) metrale::grid_dependency_sync();

    // Fused form: the group's G query heads, normalised and rotated exactly as
    // qkv_rope_kv_write_bf16 does (the same function, qkv_post.cuh), into shared memory, and for
    // the owner also the newest key (normalised, rotated) and value (as is), while the first
    // tiles are in flight. HD / 8 lanes per head.
    __nv_bfloat16* post_q = post.smem;
    __nv_bfloat16* post_kv = POST ? post.smem + G * HD : nullptr;  // null in the plain form
    if constexpr (POST) {
        const int items = G + (owner ? 2 : 0);  // block-uniform
        const __nv_bfloat16* row = post.qkv + (size_t)t * (q_heads + 2 * kv_heads) * HD;
        for (int base = 0; base < items; base += PER_PASS) {
            const int item = base + (int)(threadIdx.x / POST_LANES);
            const bool live = item < items;
            // Items: the G query heads, then the kv head's key, then its value.
            const uint32_t head = item < G    ? h0 + item
                                  : item == G ? q_heads + kvh
                                              : q_heads + kv_heads + kvh;
            uint2 ra = make_uint2(0, 0), rb = make_uint2(0, 0);
            if (live) {
                ra = __ldg(reinterpret_cast<const uint2*>(row + (size_t)head * HD + post_e));
                rb = __ldg(reinterpret_cast<const uint2*>(row + (size_t)head * HD + HALF + post_e));
            }
            const float ss = metrale::qkv_post::head_sum_sq(ra, rb, POST_LANES);
            if (!live) continue;
            if (item <= G) {
                const __nv_bfloat16* norm = item < G ? post.q_norm : post.k_norm;
                const metrale::qkv_post::Params p =
                    base == 0 ? first_params
                              : metrale::qkv_post::load_params(norm, rotate, post_pos,
                                                               post.cos_table, post.sin_table,
                                                               post_e, HALF);
                // No norm offset: a unit-offset QK-norm takes the separate launches.
                metrale::qkv_post::transform(ra, rb, ss, norm != nullptr, rotate, p, HD, post.eps,
                                             0.0f);
            }
            __nv_bfloat16* dst = item < G ? post_q + item * HD : post_kv + (item - G) * HD;
            if (FP8 && item >= G) {
                // The cache gets e4m3(x / scale); the tile patch, the e4m3 values as the
                // conversion of a copied tile gives them (key bf16, value f16).
                const float sc = item == G ? kv_scales.k : kv_scales.v;
                const uint32_t qa = metrale::kv_fp8::quantize4(ra, sc);
                const uint32_t qb = metrale::kv_fp8::quantize4(rb, sc);
                unsigned char* cache = static_cast<unsigned char*>(item == G ? post.k_cache : post.v_cache);
                unsigned char* out_row = cache + ((size_t)own_slot * kv_heads + kvh) * HD;
                *reinterpret_cast<uint32_t*>(out_row + post_e) = qa;
                *reinterpret_cast<uint32_t*>(out_row + HALF + post_e) = qb;
                const bool key = item == G;
                *reinterpret_cast<uint2*>(dst + post_e) =
                    key ? metrale::kv_fp8::to_bf16x4(qa) : metrale::kv_fp8::to_f16x4(qa);
                *reinterpret_cast<uint2*>(dst + HALF + post_e) =
                    key ? metrale::kv_fp8::to_bf16x4(qb) : metrale::kv_fp8::to_f16x4(qb);
                continue;
            }
            *reinterpret_cast<uint2*>(dst + post_e) = ra;
            *reinterpret_cast<uint2*>(dst + HALF + post_e) = rb;
            if (item >= G) {
                __nv_bfloat16* cache = static_cast<__nv_bfloat16*>(item == G ? post.k_cache : post.v_cache);
                __nv_bfloat16* out_row = cache + ((size_t)own_slot * kv_heads + kvh) * HD;
                *reinterpret_cast<uint2*>(out_row + post_e) = ra;
                *reinterpret_cast<uint2*>(out_row + HALF + post_e) = rb;
            }
        }
        __syncthreads();
    }

    // The group's queries as mma A fragments (rows = query heads, G of the 16 real): lane
    // (g, tg) = (lane / 4, lane % 4) holds row g's dims 2 tg, 2 tg + 1 and 8 + 2 tg, 9 + 2 tg of
    // each k-step; rows 8-15 are always padding.
    const int g_row = lane >> 2, tg = lane & 3;
    uint32_t qf[KSTEPS][4];
    {
        const uint32_t* qrow = reinterpret_cast<const uint32_t*>(
            POST ? post_q + min(g_row, G - 1) * HD
                 : q + ((size_t)t * q_heads + h0 + min(g_row, G - 1)) * HD);
        // The queries of the fused form are in shared memory (no __ldg there).
        auto load_q = [&](int at) -> uint32_t { return POST ? qrow[at] : __ldg(qrow + at); };
#pragma unroll
        for (int ks = 0; ks < KSTEPS; ++ks) {
            qf[ks][0] = g_row < G ? load_q(ks * 8 + tg) : 0u;
            qf[ks][1] = 0u;
            qf[ks][2] = g_row < G ? load_q(ks * 8 + 4 + tg) : 0u;
            qf[ks][3] = 0u;
        }
    }
    // ldmatrix row roles for the K^T B fragments: lanes 0-7 keys 0-7 / dims 0-7 of a k-step,
    // 8-15 keys 0-7 / dims 8-15, 16-23 keys 8-15 / dims 0-7, 24-31 keys 8-15 / dims 8-15.
    const int k_row = (lane & 7) + ((lane >> 4) << 3), k_half = (lane >> 3) & 1;

    const float scale_log2 = (FP8 ? scale * kv_scales.k : scale) * LOG2E;

    // The output transposed, O^T = V^T P^T (dims x 8 heads, G real), as f32 mma accumulators:
    // lane (g, tg) holds dims 16 mt + g and + 8 of heads 2 tg and 2 tg + 1. The softmax state is
    // per S row (head g_row): running max in log2 units and this lane's share of the row sum
    // (keys 2 tg, 2 tg + 1 of each 8-key n-tile).
    float o[HD / 16][4];
#pragma unroll
    for (int d = 0; d < HD / 16; ++d) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.0f;
    float m_row = -INFINITY, l_row = 0.0f;

    for (int i = 0; i < n_tiles; ++i) {
        issue(i + STAGES - 1, pending);  // into the buffer tile i - 1 used
        pending = slot_of(i + STAGES);   // its table read has a whole tile to land
        metrale::cp_async_wait<STAGES - 1>();
        __syncwarp();
        __nv_bfloat16* ks_tile = ring + (i % STAGES) * 2 * TILE;
        __nv_bfloat16* vs_tile = ks_tile + TILE;
        if constexpr (FP8) {
            // The landed e4m3 tile into the converted tiles, swizzled as the bf16 ring's: each
            // 16-byte piece (16 elements) becomes bf16 chunks 2c and 2c + 1 of its row.
            const unsigned char* k8 = ring8 + (i % STAGES) * 2 * TILE;
            const unsigned char* v8 = k8 + TILE;
#pragma unroll
            for (int u = 0; u < KEY_TILE * CHUNKS8 / 32; ++u) {
                const int piece = lane + 32 * u, r = piece / CHUNKS8, c = piece % CHUNKS8;
                const uint4 kw = *reinterpret_cast<const uint4*>(k8 + piece * 16);
                const uint4 vw = *reinterpret_cast<const uint4*>(v8 + piece * 16);
                using namespace metrale::kv_fp8;
                const int a0 = metrale::swizzle<HD>(r, 2 * c), a1 = metrale::swizzle<HD>(r, 2 * c + 1);
                const uint2 k0 = to_bf16x4(kw.x), k1 = to_bf16x4(kw.y), k2 = to_bf16x4(kw.z), k3 = to_bf16x4(kw.w);
                const uint2 v0 = to_f16x4(vw.x), v1 = to_f16x4(vw.y), v2 = to_f16x4(vw.z), v3 = to_f16x4(vw.w);
                *reinterpret_cast<uint4*>(conv_k + a0) = make_uint4(k0.x, k0.y, k1.x, k1.y);
                *reinterpret_cast<uint4*>(conv_k + a1) = make_uint4(k2.x, k2.y, k3.x, k3.y);
                *reinterpret_cast<uint4*>(conv_v + a0) = make_uint4(v0.x, v0.y, v1.x, v1.y);
                *reinterpret_cast<uint4*>(conv_v + a1) = make_uint4(v2.x, v2.y, v3.x, v3.y);
            }
            ks_tile = conv_k;
            vs_tile = conv_v;
            __syncwarp();
        }
        if (owner && newest >= tile_key(i) && newest < tile_key(i) + KEY_TILE) {  // warp-uniform
            const int r = (int)(newest - tile_key(i));
            for (int c = lane; c < CHUNKS; c += 32) {
                const int at = metrale::swizzle<HD>(r, c);
                *reinterpret_cast<uint4*>(ks_tile + at) = *reinterpret_cast<const uint4*>(post_kv + c * 8);
                *reinterpret_cast<uint4*>(vs_tile + at) = *reinterpret_cast<const uint4*>(post_kv + HD + c * 8);
            }
            __syncwarp();
        }
        const uint32_t n = min((uint32_t)KEY_TILE, end - tile_key(i));

        // S = Q K^T on tensor cores: 16 (padded) heads x 16 keys, f32.
        float sc[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
#pragma unroll
        for (int ks = 0; ks < KSTEPS; ++ks) {
            uint32_t b[4];
            metrale::ldmatrix_x4(b, metrale::smem_addr(ks_tile + metrale::swizzle<HD>(k_row, 2 * ks + k_half)));
            metrale::mma_bf16(sc[0], qf[ks], b[0], b[1]);
            metrale::mma_bf16(sc[1], qf[ks], b[2], b[3]);
        }
        // Online softmax on the fragments: this lane holds keys 8 nt + 2 tg + e of row g_row;
        // the row's other keys are in the lanes of the same quad (xor 1, 2). Keys past the tile's
        // n are masked (key 0 of a tile is always valid, so the max is finite).
        float tile_max = -INFINITY;
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const bool valid = (uint32_t)(nt * 8 + 2 * tg + e) < n;
                sc[nt][e] = valid ? sc[nt][e] * scale_log2 : -INFINITY;
                tile_max = fmaxf(tile_max, sc[nt][e]);
            }
        tile_max = fmaxf(tile_max, __shfl_xor_sync(FULL, tile_max, 1));
        tile_max = fmaxf(tile_max, __shfl_xor_sync(FULL, tile_max, 2));
        const float m_new = fmaxf(m_row, tile_max);
        const float corr = metrale::exp2_approx(m_row - m_new);  // 0 on the first tile
        m_row = m_new;
        // P in f16: this lane's keys of row g_row are exactly the B fragment of P^T (keys x
        // heads) for O^T += V^T P^T. The row sum adds the rounded values, so the output is
        // normalised by the weights it was summed with.
        uint32_t pb[2];
        float sum = 0.0f;
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
            const __half2 h = __floats2half2_rn(metrale::exp2_approx(sc[nt][0] - m_new),
                                                metrale::exp2_approx(sc[nt][1] - m_new));
            const float2 f = __half22float2(h);
            sum += f.x + f.y;
            pb[nt] = *reinterpret_cast<const uint32_t*>(&h);
        }
        l_row = l_row * corr + sum;
        // This lane's output columns are heads 2 tg and 2 tg + 1, whose factors sit in lanes
        // 8 tg and 8 tg + 4.
        const float corr0 = __shfl_sync(FULL, corr, 8 * tg), corr1 = __shfl_sync(FULL, corr, 8 * tg + 4);
#pragma unroll
        for (int d = 0; d < HD / 16; ++d) {
            o[d][0] *= corr0;
            o[d][1] *= corr1;
            o[d][2] *= corr0;
            o[d][3] *= corr1;
        }
        // O^T += V^T P^T: V^T A fragments by the transposing ldmatrix (the same lane roles as
        // K's: matrices keys 0-7 / 8-15 x dims 0-7 / 8-15 of the m-tile), converted to f16 (exact
        // for magnitudes 2^-14 to 65504).
#pragma unroll
        for (int mt = 0; mt < HD / 16; ++mt) {
            uint32_t a[4];
            metrale::ldmatrix_x4_trans(a, metrale::smem_addr(vs_tile + metrale::swizzle<HD>(k_row, 2 * mt + k_half)));
            // ldmatrix order: (keys 0-7, dims 0-7), (keys 0-7, dims 8-15), (keys 8-15, dims 0-7),
            // (keys 8-15, dims 8-15) = a0, a1, a2, a3 of the A fragment (rows = dims).
            // (The FP8 forms' converted V tile is f16 already.)
            if constexpr (!FP8) {
#pragma unroll
                for (int e = 0; e < 4; ++e) a[e] = metrale::bf16x2_to_f16x2(a[e]);
            }
            metrale::mma_f16(o[mt], a, pb[0], pb[1]);
        }
        __syncwarp();  // the ring buffer is refilled on the next iteration
    }
    metrale::cp_async_wait<0>();
    __syncthreads();  // every warp is done with its ring: the merge may reuse it

    // The row sum over the quad; the max back in natural-log units for the merge.
    l_row += __shfl_xor_sync(FULL, l_row, 1);
    l_row += __shfl_xor_sync(FULL, l_row, 2);
    if (g_row < G && tg == 0) {
        part_m[warp][g_row] = m_row * LN2;
        part_l[warp][g_row] = l_row;
    }
#pragma unroll
    for (int c = 0; c < 2; ++c) {
        const int head = 2 * tg + c;
        if (head < G) {
#pragma unroll
            for (int mt = 0; mt < HD / 16; ++mt) {
                part_acc[warp][head][16 * mt + g_row] = o[mt][c];
                part_acc[warp][head][16 * mt + g_row + 8] = o[mt][2 + c];
            }
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < G * HD; i += blockDim.x) {
        const int g = i / HD, d = i % HD;
        float big = -INFINITY;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) big = fmaxf(big, part_m[w][g]);
        float total = 0.0f, a = 0.0f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) {
            const float weight = part_l[w][g] > 0.0f ? __expf(part_m[w][g] - big) : 0.0f;
            total += part_l[w][g] * weight;
            a += part_acc[w][g][d] * weight;
        }
        if constexpr (FP8) a *= kv_scales.v;  // the weighted sum of the e4m3 values, scaled
        const size_t head = (size_t)t * q_heads + h0 + g;
        if (splits == 1) {
            out[head * HD + d] = metrale::to_bf16(total > 0.0f ? a / total : 0.0f);
        } else {
            float* part = partials + (head * splits + split) * (HD + 2);
            part[d] = a;
            if (d == 0) {
                part[HD] = total > 0.0f ? big : 0.0f;
                part[HD + 1] = total;
            }
        }
    }
    if (splits == 1) return;

    // The last block of this (token, kv head) to finish merges every split's partial.
    __shared__ int is_last;
    __shared__ float head_total[G];
    __threadfence();  // this block's partials are visible before it is counted
    __syncthreads();
    int32_t* counter = counters + (size_t)t * gridDim.y + blockIdx.y;
    if (threadIdx.x == 0) is_last = atomicAdd(counter, 1) == (int)splits - 1;
    __syncthreads();
    if (!is_last) return;
    __threadfence();
    // The splits holding any of this token's keys (the rest are empty).
    const uint32_t live =
        keys_per_split > 0 ? min(splits, (ctx + keys_per_split - 1) / keys_per_split) : splits;
    // Per-split weights e^(m_z - M) of each head, after the block's own layout in shared memory.
    float* weight = merge + WARPS * G * HD + 2 * WARPS * G;  // [G][splits]
    for (int g = warp; g < G; g += WARPS) {
        const float* ph = partials + ((size_t)t * q_heads + h0 + g) * splits * (HD + 2);
        // Both loads of a split at once, and the first 32 splits' values kept for the second
        // pass: one L2 round trip where live <= 32, not three.
        float big = -INFINITY, l_first = 0.0f, m_first = 0.0f;
        for (uint32_t z = lane; z < live; z += 32) {
            const float lz = __ldcg(ph + z * (HD + 2) + HD + 1), mz = __ldcg(ph + z * (HD + 2) + HD);
            if (z == (uint32_t)lane) {
                l_first = lz;
                m_first = mz;
            }
            if (lz > 0.0f) big = fmaxf(big, mz);
        }
        big = metrale::warp_max(big);
        float total = 0.0f;
        for (uint32_t z = lane; z < live; z += 32) {
            const bool first = z == (uint32_t)lane;
            const float lz = first ? l_first : __ldcg(ph + z * (HD + 2) + HD + 1);
            const float mz = first ? m_first : __ldcg(ph + z * (HD + 2) + HD);
            const float wz = lz > 0.0f ? __expf(mz - big) : 0.0f;
            weight[g * splits + z] = wz;
            total += lz * wz;
        }
        total = metrale::warp_sum(total);
        if (lane == 0) head_total[g] = total;
    }
    __syncthreads();
    // Each thread's PER outputs (element i = threadIdx.x + THREADS j of the G x HD block) sum
    // their splits' partials in split order, as one loop per output would, but with the loads of
    // ZB splits for all PER outputs issued before the first of them is used: one L2 round trip
    // per ZB splits instead of one per output and split batch.
    constexpr int THREADS = WARPS * 32;
    constexpr int PER = (G * HD + THREADS - 1) / THREADS;
    constexpr uint32_t ZB = PER >= 64 ? 1 : 64 / PER;  // at most 64 loads in registers
    float a[PER];
#pragma unroll
    for (int j = 0; j < PER; ++j) a[j] = 0.0f;
    // Partial (z, element i) sits at base + (i / HD) splits (HD + 2) + z (HD + 2) + i % HD.
    const float* base = partials + ((size_t)t * q_heads + h0) * splits * (HD + 2);
    for (uint32_t z0 = 0; z0 < live; z0 += ZB) {
        float v[ZB][PER];
#pragma unroll
        for (uint32_t zz = 0; zz < ZB; ++zz)
#pragma unroll
            for (int j = 0; j < PER; ++j) {
                const int i = min((int)threadIdx.x + THREADS * j, G * HD - 1);
                const size_t off = ((size_t)(i / HD) * splits + z0 + zz) * (HD + 2) + i % HD;
                v[zz][j] = z0 + zz < live ? __ldcg(base + off) : 0.0f;
            }
#pragma unroll
        for (uint32_t zz = 0; zz < ZB; ++zz) {
            if (z0 + zz >= live) break;
#pragma unroll
            for (int j = 0; j < PER; ++j) {
                const int g = min((int)threadIdx.x + THREADS * j, G * HD - 1) / HD;
                a[j] += v[zz][j] * weight[g * splits + z0 + zz];
            }
        }
    }
#pragma unroll
    for (int j = 0; j < PER; ++j) {
        const int i = (int)threadIdx.x + THREADS * j;
        if (i >= G * HD) break;
        const int g = i / HD, d = i % HD;
        const float total = head_total[g];
        out[((size_t)t * q_heads + h0 + g) * HD + d] = metrale::to_bf16(total > 0.0f ? a[j] / total : 0.0f);
    }
    if (threadIdx.x == 0) *counter = 0;  // ready for the next launch
}

template <int HD, bool POST, int WARPS, bool FP8>
__device__ __forceinline__ void attend_group(
    uint32_t group, __nv_bfloat16* __restrict__ out, float* __restrict__ partials,
    int32_t* __restrict__ counters, const __nv_bfloat16* __restrict__ q, const void* __restrict__ k_cache,
    const void* __restrict__ v_cache, const int32_t* __restrict__ block_tables,
    const int32_t* __restrict__ token_seq, const int32_t* __restrict__ positions,
    uint32_t q_heads, uint32_t kv_heads, uint32_t block_size, uint32_t max_blocks_per_seq,
    uint32_t keys_per_split, float scale, KvScales kv_scales, const Post& post) {
#define METRALE_ATTEND(G)                                                                      \
    attend<HD, G, POST, WARPS, FP8>(out, partials, counters, q, k_cache, v_cache, block_tables, token_seq,   \
                        positions, q_heads, kv_heads, block_size, max_blocks_per_seq,          \
                        keys_per_split, scale, kv_scales, post)
    switch (group) {
        case 1: METRALE_ATTEND(1); break;
        case 2: METRALE_ATTEND(2); break;
        case 3: METRALE_ATTEND(3); break;
        case 4: METRALE_ATTEND(4); break;
        case 5: METRALE_ATTEND(5); break;
        case 6: METRALE_ATTEND(6); break;
        case 7: METRALE_ATTEND(7); break;
        case 8: METRALE_ATTEND(8); break;
        default: break;
    }
#undef METRALE_ATTEND
}

// The query heads a block takes of a kv head's group of `whole`: all of them up to 8, else the
// largest divisor of `whole` up to 8 (8 for 16 or 24, 6 for 12, 5 for 10, 7 for 14).
__device__ __forceinline__ uint32_t block_group(uint32_t whole) {
    if (whole <= 8) return whole;
    uint32_t g = 8;
    while (whole % g != 0) --g;
    return g;
}

// Every entry point: the block's bounds check, then attend_group at the launch's head_dim (the
// wide form: 64 or 128; its rings at 256 would not fit an SM).
template <bool POST, int WARPS, bool FP8>
__device__ __forceinline__ void attend_any(
    __nv_bfloat16* __restrict__ out, float* __restrict__ partials, int32_t* __restrict__ counters,
    const __nv_bfloat16* __restrict__ q, const void* __restrict__ k_cache,
    const void* __restrict__ v_cache, const int32_t* __restrict__ block_tables,
    const int32_t* __restrict__ token_seq, const int32_t* __restrict__ positions, uint32_t tokens,
    uint32_t q_heads, uint32_t kv_heads, uint32_t head_dim, uint32_t block_size,
    uint32_t max_blocks_per_seq, uint32_t keys_per_split, uint32_t splits, float scale,
    KvScales kv_scales, const Post& post) {
    // A group wider than 8 query heads takes whole / block_group(whole) blocks of block_group.
    if (kv_heads == 0 || q_heads % kv_heads != 0) return;
    const uint32_t whole = q_heads / kv_heads;
    const uint32_t group = block_group(whole);
    if (blockIdx.x >= tokens || gridDim.y != kv_heads * (whole / group) || gridDim.z != splits)
        return;
#define METRALE_ATTEND(HD)                                                                     \
    attend_group<HD, POST, WARPS, FP8>(group, out, partials, counters, q, k_cache, v_cache, block_tables,  \
                           token_seq, positions, q_heads, kv_heads, block_size,                \
                           max_blocks_per_seq, keys_per_split, scale, kv_scales, post)
    switch (head_dim) {
        case 64: METRALE_ATTEND(64); break;
        case 128: METRALE_ATTEND(128); break;
        case 256:
            if constexpr (WARPS == NARROW_WARPS) METRALE_ATTEND(256);
            break;
        default: break;
    }
#undef METRALE_ATTEND
}
}  // namespace

// Two blocks per SM (the rings' shared memory allows no more at head_dim 128).
// Launch: grid = (tokens, kv_heads, splits), block = 128 (gridDim.z must equal `splits`).
// head_dim must be 64, 128 or 256 and kv_heads must divide q_heads (grid.y = kv_heads * (whole /
// block_group(whole)), whole = q_heads / kv_heads: each block takes block_group query heads of its
// kv head);
// `partials` is f32 [tokens, q_heads, splits, head_dim + 2] and `counters` i32 [tokens, grid.y],
// zero before the launch and zero after it (both unused, may be null, when splits = 1). Dynamic
// shared memory: the larger of the rings
// (4 * stages * 2 * 16 * head_dim bf16, stages = 3, or 2 at head_dim 256) and the merge area
// (4 * G * head_dim + 8 * G + (splits > 1 ? G * splits : 0) floats); see PagedAttention's
// launch_config.
extern "C" __global__ void __launch_bounds__(128, 2) paged_attention_bf16(
    __nv_bfloat16* __restrict__ out, float* __restrict__ partials, int32_t* __restrict__ counters,
    const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k_cache,
    const __nv_bfloat16* __restrict__ v_cache, const int32_t* __restrict__ block_tables,
    const int32_t* __restrict__ token_seq, const int32_t* __restrict__ positions, uint32_t tokens,
    uint32_t q_heads, uint32_t kv_heads, uint32_t head_dim, uint32_t block_size,
    uint32_t max_blocks_per_seq, uint32_t keys_per_split, uint32_t splits, float scale) {
    // The programmatic-launch wait is inside attend, after the block-table lookups.
    attend_any<false, NARROW_WARPS, false>(out, partials, counters, q, k_cache, v_cache, block_tables, token_seq,
                      positions, tokens, q_heads, kv_heads, head_dim, block_size,
                      max_blocks_per_seq, keys_per_split, splits, scale, KvScales{1.0f, 1.0f}, Post{});
}

// paged_attention_bf16 over an FP8 cache (e4m3 [num_blocks, block_size, kv_heads, head_dim] each,
// holding e4m3(k / k_scale) and e4m3(v / v_scale)): the same arithmetic on the e4m3 values (exact
// in bf16 and f16), with the score scale times k_scale and the weighted sums times v_scale.
// Launch: paged_attention_bf16's grid and block; dynamic shared memory the larger of the rings
// (4 * (2 * stages + 4) * 16 * head_dim bytes, stages = 4, or 2 at head_dim 256) and the merge
// area (PagedAttentionFp8's launch_config).
extern "C" __global__ void __launch_bounds__(128, 2) paged_attention_fp8(
    __nv_bfloat16* __restrict__ out, float* __restrict__ partials, int32_t* __restrict__ counters,
    const __nv_bfloat16* __restrict__ q, const uint8_t* __restrict__ k_cache,
    const uint8_t* __restrict__ v_cache, const int32_t* __restrict__ block_tables,
    const int32_t* __restrict__ token_seq, const int32_t* __restrict__ positions, uint32_t tokens,
    uint32_t q_heads, uint32_t kv_heads, uint32_t head_dim, uint32_t block_size,
    uint32_t max_blocks_per_seq, uint32_t keys_per_split, uint32_t splits, float scale,
    float k_scale, float v_scale) {
    attend_any<false, NARROW_WARPS, true>(out, partials, counters, q, k_cache, v_cache, block_tables,
                                          token_seq, positions, tokens, q_heads, kv_heads, head_dim,
                                          block_size, max_blocks_per_seq, keys_per_split, splits,
                                          scale, KvScales{k_scale, v_scale}, Post{});
}

// paged_attention_bf16 with qkv_rope_kv_write_bf16's work folded in, for steps where every token
// is the one new token of its own sequence (decode): the launch takes the raw QKV product instead
// of the queries, and each block normalises and rotates its group's query heads itself (the
// same arithmetic as qkv_rope_kv_write_bf16, so the same bits); the block whose split holds the
// token's position also writes the token's key (normalised, rotated) and value into cache row
// slots[t] and uses them in place of what its copy from that row read. So the outputs, partials
// and cache equal those of the two launches, one launch fewer. Steps where a sequence brings
// several tokens need all of their keys in the cache first: they use the two launches.
// The launch is paged_attention_bf16's (same grid, block and dynamic shared memory); qkv, q_norm,
// k_norm, cos and sin must be 8-, 8-, 8-, 16- and 16-byte aligned (device allocations are).
extern "C" __global__ void __launch_bounds__(128, 2) paged_attention_qkv_bf16(
    __nv_bfloat16* __restrict__ out, float* __restrict__ partials, int32_t* __restrict__ counters,
    const __nv_bfloat16* __restrict__ qkv, __nv_bfloat16* k_cache, __nv_bfloat16* v_cache,
    const int32_t* __restrict__ block_tables, const int32_t* __restrict__ token_seq,
    const int32_t* __restrict__ positions, const int32_t* __restrict__ slots,
    const __nv_bfloat16* __restrict__ q_norm, const __nv_bfloat16* __restrict__ k_norm,
    const float* __restrict__ cos_table, const float* __restrict__ sin_table, uint32_t tokens,
    uint32_t q_heads, uint32_t kv_heads, uint32_t head_dim, uint32_t block_size,
    uint32_t max_blocks_per_seq, uint32_t keys_per_split, uint32_t splits, uint32_t max_position,
    float scale, float eps) {
    __shared__ __align__(16) __nv_bfloat16 post_smem[(8 + 2) * 256];
    const Post post{qkv,       q_norm,    k_norm,       slots, k_cache, v_cache,
                    post_smem, cos_table, sin_table, max_position, eps};
    attend_any<true, NARROW_WARPS, false>(out, partials, counters, nullptr, k_cache, v_cache, block_tables,
                                   token_seq, positions, tokens, q_heads, kv_heads, head_dim,
                                   block_size, max_blocks_per_seq, keys_per_split, splits, scale,
                                   KvScales{1.0f, 1.0f}, post);
}

// paged_attention_qkv_bf16 over an FP8 cache: the newest key and value go into the cache as
// qkv_rope_kv_write_fp8 writes them, and the attention is paged_attention_fp8's. Launch:
// paged_attention_fp8's.
extern "C" __global__ void __launch_bounds__(128, 2) paged_attention_qkv_fp8(
    __nv_bfloat16* __restrict__ out, float* __restrict__ partials, int32_t* __restrict__ counters,
    const __nv_bfloat16* __restrict__ qkv, uint8_t* k_cache, uint8_t* v_cache,
    const int32_t* __restrict__ block_tables, const int32_t* __restrict__ token_seq,
    const int32_t* __restrict__ positions, const int32_t* __restrict__ slots,
    const __nv_bfloat16* __restrict__ q_norm, const __nv_bfloat16* __restrict__ k_norm,
    const float* __restrict__ cos_table, const float* __restrict__ sin_table, uint32_t tokens,
    uint32_t q_heads, uint32_t kv_heads, uint32_t head_dim, uint32_t block_size,
    uint32_t max_blocks_per_seq, uint32_t keys_per_split, uint32_t splits, uint32_t max_position,
    float scale, float eps, float k_scale, float v_scale) {
    __shared__ __align__(16) __nv_bfloat16 post_smem[(8 + 2) * 256];
    const Post post{qkv,       q_norm,    k_norm,       slots, k_cache, v_cache,
                    post_smem, cos_table, sin_table, max_position, eps};
    attend_any<true, NARROW_WARPS, true>(out, partials, counters, nullptr, k_cache, v_cache,
                                         block_tables, token_seq, positions, tokens, q_heads,
                                         kv_heads, head_dim, block_size, max_blocks_per_seq,
                                         keys_per_split, splits, scale, KvScales{k_scale, v_scale},
                                         post);
}

// paged_attention_qkv_bf16 with 8 warps a block (256 threads; one block an SM at head_dim 128):
// the same arithmetic, each warp taking every eighth tile of 16 keys instead of every fourth, so a
// block's keys are split over twice the warps, and the 8 warps' softmax states merge as the 4 do.
// The results are not bit for bit the 4-warp form's: each warp rounds its probabilities to f16
// against its own running max, which now covers other keys, and the f32 sums add in another
// order. At batch 1 (the only batch the fused form runs) the decode attention has one block per
// kv head (8 at Qwen3's sizes) and, unsplit (up to
// 256 keys), each warp works through its tiles one after another: with 8 warps the 160-key
// context is 1-2 tiles a warp, not 2-3, and the first two tiles of every warp (256 keys) are
// copied before the programmatic-launch wait. head_dim 64 or 128 (the rings take 8 * 3 * 2 * 16 *
// head_dim bf16: 192 KiB at 128). Launch: paged_attention_bf16's grid, block = 256, dynamic
// shared memory for 8 warps (PagedAttentionQkv's wide_launch_config).
extern "C" __global__ void __launch_bounds__(256, 1) paged_attention_qkv_wide_bf16(
    __nv_bfloat16* __restrict__ out, float* __restrict__ partials, int32_t* __restrict__ counters,
    const __nv_bfloat16* __restrict__ qkv, __nv_bfloat16* k_cache, __nv_bfloat16* v_cache,
    const int32_t* __restrict__ block_tables, const int32_t* __restrict__ token_seq,
    const int32_t* __restrict__ positions, const int32_t* __restrict__ slots,
    const __nv_bfloat16* __restrict__ q_norm, const __nv_bfloat16* __restrict__ k_norm,
    const float* __restrict__ cos_table, const float* __restrict__ sin_table, uint32_t tokens,
    uint32_t q_heads, uint32_t kv_heads, uint32_t head_dim, uint32_t block_size,
    uint32_t max_blocks_per_seq, uint32_t keys_per_split, uint32_t splits, uint32_t max_position,
    float scale, float eps) {
    if (blockDim.x != WIDE_WARPS * 32) return;
    __shared__ __align__(16) __nv_bfloat16 post_smem[(8 + 2) * 128];
    const Post post{qkv,       q_norm,    k_norm,       slots, k_cache, v_cache,
                    post_smem, cos_table, sin_table, max_position, eps};
    attend_any<true, WIDE_WARPS, false>(out, partials, counters, nullptr, k_cache, v_cache, block_tables,
                                 token_seq, positions, tokens, q_heads, kv_heads, head_dim,
                                 block_size, max_blocks_per_seq, keys_per_split, splits, scale,
                                 KvScales{1.0f, 1.0f}, post);
}

// paged_attention_qkv_wide_bf16 over an FP8 cache (paged_attention_qkv_fp8 with 8 warps). Launch:
// paged_attention_qkv_wide_bf16's grid and block, dynamic shared memory for 8 warps' FP8 rings.
extern "C" __global__ void __launch_bounds__(256, 1) paged_attention_qkv_wide_fp8(
    __nv_bfloat16* __restrict__ out, float* __restrict__ partials, int32_t* __restrict__ counters,
    const __nv_bfloat16* __restrict__ qkv, uint8_t* k_cache, uint8_t* v_cache,
    const int32_t* __restrict__ block_tables, const int32_t* __restrict__ token_seq,
    const int32_t* __restrict__ positions, const int32_t* __restrict__ slots,
    const __nv_bfloat16* __restrict__ q_norm, const __nv_bfloat16* __restrict__ k_norm,
    const float* __restrict__ cos_table, const float* __restrict__ sin_table, uint32_t tokens,
    uint32_t q_heads, uint32_t kv_heads, uint32_t head_dim, uint32_t block_size,
    uint32_t max_blocks_per_seq, uint32_t keys_per_split, uint32_t splits, uint32_t max_position,
    float scale, float eps, float k_scale, float v_scale) {
    if (blockDim.x != WIDE_WARPS * 32) return;
    __shared__ __align__(16) __nv_bfloat16 post_smem[(8 + 2) * 128];
    const Post post{qkv,       q_norm,    k_norm,       slots, k_cache, v_cache,
                    post_smem, cos_table, sin_table, max_position, eps};
    attend_any<true, WIDE_WARPS, true>(out, partials, counters, nullptr, k_cache, v_cache,
                                       block_tables, token_seq, positions, tokens, q_heads,
                                       kv_heads, head_dim, block_size, max_blocks_per_seq,
                                       keys_per_split, splits, scale, KvScales{k_scale, v_scale},
                                       post);
}

// Merges the splits' partials of paged_attention_bf16:
// out = sum_z acc_z e^(m_z - M) / sum_z l_z e^(m_z - M), M = max of m_z over splits with l_z > 0.
// The per-split weights e^(m_z - M) are computed once into shared memory (at most
// MAX_COMBINE_SPLITS splits), then each thread sums its dims over the splits.
// Launch: grid = (tokens, q_heads), block = 128.
constexpr uint32_t MAX_COMBINE_SPLITS = 1024;

extern "C" __global__ void __launch_bounds__(128) attention_combine_bf16(
    __nv_bfloat16* __restrict__ out, const float* __restrict__ partials, uint32_t tokens,
    uint32_t q_heads, uint32_t head_dim, uint32_t splits) {
    metrale::grid_dependency_sync();
    __shared__ float weight[MAX_COMBINE_SPLITS];
    __shared__ float scratch[32];
    const uint32_t t = blockIdx.x, h = blockIdx.y;
    if (t >= tokens || h >= q_heads || splits > MAX_COMBINE_SPLITS) return;
    const size_t stride = head_dim + 2;
    const float* part = partials + ((size_t)t * q_heads + h) * splits * stride;
    float big = -INFINITY;
    for (uint32_t z = threadIdx.x; z < splits; z += blockDim.x)
        if (part[z * stride + head_dim + 1] > 0.0f) big = fmaxf(big, part[z * stride + head_dim]);
    // Block max through the same scratch as block_sum (which synchronises before reusing it).
    big = metrale::warp_max(big);
    if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = big;
    __syncthreads();
    big = -INFINITY;
    for (uint32_t w = 0; w < blockDim.x / 32; ++w) big = fmaxf(big, scratch[w]);
    __syncthreads();
    float total = 0.0f;
    for (uint32_t z = threadIdx.x; z < splits; z += blockDim.x) {
        const float lz = part[z * stride + head_dim + 1];
        const float wz = lz > 0.0f ? __expf(part[z * stride + head_dim] - big) : 0.0f;
        weight[z] = wz;
        total += lz * wz;
    }
    total = metrale::block_sum(total, scratch);  // its barriers also publish `weight`
    for (uint32_t d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float a = 0.0f;
        for (uint32_t z = 0; z < splits; ++z) a += part[z * stride + d] * weight[z];
        out[((size_t)t * q_heads + h) * head_dim + d] =
            metrale::to_bf16(total > 0.0f ? a / total : 0.0f);
    }
}
