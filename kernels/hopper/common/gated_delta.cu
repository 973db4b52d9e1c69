// SPDX-License-Identifier: MIT OR Apache-2.0
// Gated DeltaNet token mixer (Qwen3-Next, Qwen3.5): the causal short conv with SiLU over the
// q|k|v channels and its carried state, and the gated delta rule over a recurrent f32 state.
// Host references: crates/kernels/src/ops/gated_delta.rs.
//
// Buffers:
//   conv input  bf16, token t's channels at x + t * x_stride (channels <= x_stride: the conv may
//               read its columns out of a wider projection row); conv output bf16 [tokens][channels]
//   conv state  bf16 [slots][kernel - 1][channels], oldest input first (the last kernel - 1 inputs)
//   conv weight bf16 [channels][kernel], the last tap on the current token; bias bf16 [channels]
//               or null
//   S           f32  [slots][hv][dk][dv], row-major per value head
//   q, k        bf16, token t's key head kh at q + t * qkv_stride + kh * dk (q|k|v share a row)
//   v           bf16, token t's value head h at v + t * qkv_stride + h * dv
//   g, beta     f32  [tokens][hv]: log-decay (<= 0) and write strength
//   o           bf16 [tokens][hv][dv]
//   positions   i32 [tokens]: each token's position in its sequence
//
// Value head h reads key head h / (hv / hk) (the reference's repeat_interleave). A run whose first
// token is at position 0 starts a sequence: its conv and recurrent states start at zero, whatever
// its slot holds (a slot is reused without being cleared), and are written back as always.
#include "gated_delta_chunk.cuh"

namespace {

// Widest conv the kernels hold in registers (Qwen3-Next and Qwen3.5: 4).
constexpr uint32_t CONV_MAX_KERNEL = 8;
// Tokens one thread of gdn_conv1d walks; at least CONV_MAX_KERNEL - 1, so that only the first
// chunk of a run reads the conv state.
constexpr uint32_t CONV_CHUNK = 16;

__device__ __forceinline__ float silu(float x) { return x / (1.0f + __expf(-x)); }

}  // namespace

// One decode token per row, each its own sequence: out[r] = silu(conv(state[slots[r]], x[r])),
// and the state shifted by one input. A row at position 0 reads its old state as zeros.
// Launch: grid = (ceil(channels / 256), rows), block = 256.
extern "C" __global__ void gdn_conv1d_step(__nv_bfloat16* out, const __nv_bfloat16* x,
                                           __nv_bfloat16* conv_state,
                                           const __nv_bfloat16* weight,
                                           const __nv_bfloat16* bias, const int32_t* slots,
                                           const int32_t* positions, uint32_t rows,
                                           uint32_t channels, uint32_t x_stride,
                                           uint32_t kernel) {
    metrale::grid_dependency_sync();
    const uint32_t ch = blockIdx.x * blockDim.x + threadIdx.x;
    const uint32_t row = blockIdx.y;
    if (ch >= channels || row >= rows) return;
    __nv_bfloat16* st = conv_state + (size_t)slots[row] * (kernel - 1) * channels + ch;
    const bool fresh = positions[row] == 0;
    const __nv_bfloat16 xin = x[(size_t)row * x_stride + ch];
    float acc = bias ? metrale::to_f32(bias[ch]) : 0.0f;
    __nv_bfloat16 window[CONV_MAX_KERNEL];
#pragma unroll
    for (uint32_t j = 0; j + 1 < CONV_MAX_KERNEL; ++j) {
        if (j + 1 < kernel) window[j] = fresh ? metrale::to_bf16(0.0f) : st[(size_t)j * channels];
    }
#pragma unroll
    for (uint32_t j = 0; j < CONV_MAX_KERNEL; ++j) {
        if (j + 1 < kernel) {
            acc += metrale::to_f32(weight[(size_t)ch * kernel + j]) * metrale::to_f32(window[j]);
        } else if (j + 1 == kernel) {
            acc += metrale::to_f32(weight[(size_t)ch * kernel + j]) * metrale::to_f32(xin);
        }
    }
    out[(size_t)row * channels + ch] = metrale::to_bf16(silu(acc));
    // Shift: drop the oldest input, append this one.
#pragma unroll
    for (uint32_t j = 0; j + 1 < CONV_MAX_KERNEL; ++j) {
        if (j + 2 < kernel) {
            st[(size_t)j * channels] = window[j + 1];
        } else if (j + 2 == kernel) {
            st[(size_t)j * channels] = xin;
        }
    }
}

// Runs of tokens, each of one sequence (prefill chunks, or a whole step's runs with its decode
// rows as runs of one): run s is rows seq_starts[s] .. seq_starts[s + 1] of x and out, its conv
// state in slot slots[s] (distinct), read as zeros when the run's first token is at position 0.
// Each thread takes one channel over CONV_CHUNK tokens of a run; only the run's first chunk reads
// the state, and the same thread writes the new state after its reads, so no block reads what
// another writes. An empty run leaves its state as it is.
// Launch: grid = (ceil(channels / 256), ceil(max_len / CONV_CHUNK), seqs), block = 256.
extern "C" __global__ void gdn_conv1d(__nv_bfloat16* out, const __nv_bfloat16* x,
                                      __nv_bfloat16* conv_state, const __nv_bfloat16* weight,
                                      const __nv_bfloat16* bias, const int32_t* seq_starts,
                                      const int32_t* slots, const int32_t* positions,
                                      uint32_t seqs, uint32_t max_len, uint32_t channels,
                                      uint32_t x_stride, uint32_t kernel) {
    metrale::grid_dependency_sync();
    const uint32_t ch = blockIdx.x * blockDim.x + threadIdx.x;
    const uint32_t t0 = blockIdx.y * CONV_CHUNK;
    // max_len sizes the grid (a run longer than it is cut short there).
    if (blockIdx.z >= seqs || t0 >= max_len) return;
    const int32_t begin = seq_starts[blockIdx.z];
    const uint32_t len = (uint32_t)(seq_starts[blockIdx.z + 1] - begin);
    if (ch >= channels || t0 >= len) return;
    x += (size_t)begin * x_stride;
    out += (size_t)begin * channels;
    const uint32_t slot = (uint32_t)slots[blockIdx.z];
    const bool fresh = positions[begin] == 0;
    const uint32_t t1 = min(t0 + CONV_CHUNK, len);
    const uint32_t taps = kernel - 1;
    __nv_bfloat16* st = conv_state + (size_t)slot * taps * channels + ch;
    float w[CONV_MAX_KERNEL];
    // window[j]: the input at t - taps + j for the next token t; window[taps] is t itself.
    float window[CONV_MAX_KERNEL];
#pragma unroll
    for (uint32_t j = 0; j < CONV_MAX_KERNEL; ++j) {
        w[j] = j < kernel ? metrale::to_f32(weight[(size_t)ch * kernel + j]) : 0.0f;
        window[j] = 0.0f;
        if (j < taps) {
            if (t0 == 0) {
                window[j] = fresh ? 0.0f : metrale::to_f32(st[(size_t)j * channels]);
            } else {
                window[j] = metrale::to_f32(x[(size_t)(t0 - taps + j) * x_stride + ch]);
            }
        }
    }
    const float b = bias ? metrale::to_f32(bias[ch]) : 0.0f;
    for (uint32_t t = t0; t < t1; ++t) {
        const float xt = metrale::to_f32(x[(size_t)t * x_stride + ch]);
        float acc = b;
#pragma unroll
        for (uint32_t j = 0; j < CONV_MAX_KERNEL; ++j) {
            if (j < taps) acc += w[j] * window[j];
            if (j == taps) acc += w[j] * xt;
        }
        out[(size_t)t * channels + ch] = metrale::to_bf16(silu(acc));
#pragma unroll
        for (uint32_t j = 0; j + 1 < CONV_MAX_KERNEL; ++j) {
            if (j + 1 < taps) window[j] = window[j + 1];
            if (j + 1 == taps) window[j] = xt;
        }
    }
    if (t0 == 0) {
        // The new state is the run's last `taps` inputs: this thread's final window when the run
        // is one chunk (reaching back into the old state, or zeros for a fresh run, when the run
        // is shorter than `taps`), else inputs of the run alone (len > CONV_CHUNK >= taps).
#pragma unroll
        for (uint32_t j = 0; j + 1 < CONV_MAX_KERNEL; ++j) {
            if (j < taps) {
                st[(size_t)j * channels] = t1 == len
                                               ? metrale::to_bf16(window[j])
                                               : x[(size_t)(len - taps + j) * x_stride + ch];
            }
        }
    }
}

// The gated delta rule over each sequence's tokens in order, per (sequence, value head), from and
// back into the state in the sequence's slot. Sequence s owns tokens seq_starts[s] ..
// seq_starts[s + 1] and slot slots[s]: a decode batch is runs of one token, a prefill chunk one
// run (sequential over its tokens; the chunked form is gdn_chunk_prep and gdn_chunk_scan below).
// A sequence whose first token is at position 0 starts from S = 0 (its slot is not read; it is
// still written).
//
// Each column of S evolves on its own given the token's q, k, g, beta and that column's v, so a
// block is one warp owning GDN_COLS columns of one head's S: lane l holds rows
// (l / GDN_COLS) * 64 .. + 64 of column l % GDN_COLS in registers (167 registers, no spill,
// with nvcc 13.0; a whole column a lane spilled at 255). S is read once and written once per
// launch, 64 B a half-warp a row;
// the only exchanges between lanes are the L2 norms of q and k and the two halves of each
// column's dot products. Per token, with k and q normalised:
//   recall = S^T k, delta = beta (v - exp(g) recall), S = exp(g) S + k delta, o = S^T q dk^-1/2.
// Launch: grid = (ceil(dv / GDN_COLS), hv, seqs), block = 32.
namespace {
constexpr uint32_t GDN_COLS = 16;
constexpr uint32_t GDN_ROWS_PER_LANE = GDN_MAX_DK / (32 / GDN_COLS);
}  // namespace

extern "C" __global__ void __launch_bounds__(32)
    gdn_recurrent(__nv_bfloat16* o, float* state, const __nv_bfloat16* q,
                  const __nv_bfloat16* k, const __nv_bfloat16* v, const float* g,
                  const float* beta, const int32_t* seq_starts, const int32_t* slots,
                  const int32_t* positions, uint32_t seqs, uint32_t hv, uint32_t hk, uint32_t dk,
                  uint32_t dv, uint32_t qkv_stride) {
    metrale::grid_dependency_sync();
    if (blockIdx.z >= seqs) return;
    constexpr uint32_t PER_LANE = GDN_MAX_DK / 32;
    __shared__ float qs[GDN_MAX_DK];
    __shared__ float ks[GDN_MAX_DK];
    const uint32_t lane = threadIdx.x;
    const uint32_t col = blockIdx.x * GDN_COLS + lane % GDN_COLS;
    const uint32_t row0 = (lane / GDN_COLS) * GDN_ROWS_PER_LANE;
    const uint32_t h = blockIdx.y;
    const uint32_t seq = blockIdx.z;
    const uint32_t kh = h / (hv / hk);
    const bool live = col < dv;
    const int32_t begin = seq_starts[seq];
    const int32_t end = seq_starts[seq + 1];
    float* s_col = state + ((size_t)slots[seq] * hv + h) * dk * dv + (size_t)row0 * dv + col;
    // An empty run has no first position: its state is read and written back unchanged.
    const bool fresh = begin < end && positions[begin] == 0;

    float s[GDN_ROWS_PER_LANE];
#pragma unroll
    for (uint32_t i = 0; i < GDN_ROWS_PER_LANE; ++i) {
        s[i] = (live && !fresh && row0 + i < dk) ? s_col[(size_t)i * dv] : 0.0f;
    }
    const float q_scale = rsqrtf((float)dk);
    // Token t's inputs, loaded one token ahead so that the next token's loads are in flight
    // while this one computes (a prefill run is latency-bound otherwise).
    float qv[PER_LANE], kv[PER_LANE], v_col = 0.0f, g_t = 0.0f, b = 0.0f;
    auto load_token = [&](int32_t t) {
        const __nv_bfloat16* qt = q + (size_t)t * qkv_stride + (size_t)kh * dk;
        const __nv_bfloat16* kt = k + (size_t)t * qkv_stride + (size_t)kh * dk;
#pragma unroll
        for (uint32_t r = 0; r < PER_LANE; ++r) {
            const uint32_t i = lane + 32 * r;
            qv[r] = i < dk ? metrale::to_f32(qt[i]) : 0.0f;
            kv[r] = i < dk ? metrale::to_f32(kt[i]) : 0.0f;
        }
        v_col = live ? metrale::to_f32(v[(size_t)t * qkv_stride + (size_t)h * dv + col]) : 0.0f;
        g_t = g[(size_t)t * hv + h];
        b = beta[(size_t)t * hv + h];
    };
    if (begin < end) load_token(begin);
    for (int32_t t = begin; t < end; ++t) {
        float qq = 0.0f, kk = 0.0f;
#pragma unroll
        for (uint32_t r = 0; r < PER_LANE; ++r) {
            qq += qv[r] * qv[r];
            kk += kv[r] * kv[r];
        }
        const float decay = expf(g_t);
        const float beta_t = b;
        const float v_t = v_col;
        const float q_norm = q_scale / sqrtf(metrale::warp_sum(qq) + GDN_L2NORM_EPS);
        const float k_norm = 1.0f / sqrtf(metrale::warp_sum(kk) + GDN_L2NORM_EPS);
        __syncwarp();  // the previous token's reads of qs and ks are done
#pragma unroll
        for (uint32_t r = 0; r < PER_LANE; ++r) {
            qs[lane + 32 * r] = qv[r] * q_norm;
            ks[lane + 32 * r] = kv[r] * k_norm;
        }
        __syncwarp();
        if (t + 1 < end) load_token(t + 1);
        float recall = 0.0f;
#pragma unroll
        for (uint32_t i = 0; i < GDN_ROWS_PER_LANE; ++i) recall += s[i] * ks[row0 + i];
        recall += __shfl_xor_sync(0xffffffffu, recall, GDN_COLS);
        const float delta = beta_t * (v_t - decay * recall);
        float out = 0.0f;
#pragma unroll
        for (uint32_t i = 0; i < GDN_ROWS_PER_LANE; ++i) {
            s[i] = s[i] * decay + ks[row0 + i] * delta;
            out += s[i] * qs[row0 + i];
        }
        out += __shfl_xor_sync(0xffffffffu, out, GDN_COLS);
        if (live && lane < GDN_COLS) o[((size_t)t * hv + h) * dv + col] = metrale::to_bf16(out);
    }
#pragma unroll
    for (uint32_t i = 0; i < GDN_ROWS_PER_LANE; ++i) {
        if (live && row0 + i < dk) s_col[(size_t)i * dv] = s[i];
    }
}

// The decay and the write strength of every (token, value head), as Qwen3-Next's gated delta rule
// takes them: g = -exp(a_log[h]) * softplus(a + dt_bias[h]) (softplus(x) = x above 20, as
// PyTorch's), beta = sigmoid(b), f32. b and a of value head h come from the ba product's row as
// the checkpoint groups them: per key head kh, its hv / hk b values then its hv / hk a values;
// h = kh * (hv / hk) + j reads b at kh * 2 (hv / hk) + j and a at that + hv / hk. Token t's row
// starts at ba + t * ba_stride (2 hv when ba is a product of its own; more when b and a are
// columns of a wider projection's row).
// Launch: grid = ceil(tokens * hv / 256), block = 256, one (token, head) a thread.
extern "C" __global__ void __launch_bounds__(256) gdn_gating(
    float* __restrict__ g, float* __restrict__ beta, const __nv_bfloat16* __restrict__ ba,
    const float* __restrict__ a_log, const float* __restrict__ dt_bias, uint32_t tokens,
    uint32_t hv, uint32_t hk, uint32_t ba_stride) {
    metrale::grid_dependency_sync();
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (hk == 0 || hv % hk != 0 || i >= (size_t)tokens * hv) return;
    const uint32_t per = hv / hk;
    const size_t t = i / hv;
    const uint32_t h = (uint32_t)(i % hv), kh = h / per, j = h % per;
    const __nv_bfloat16* row = ba + t * ba_stride + (size_t)kh * 2 * per;
    const float b = metrale::to_f32(row[j]), x = metrale::to_f32(row[per + j]) + dt_bias[h];
    const float softplus = x > 20.0f ? x : log1pf(expf(x));
    g[i] = -expf(a_log[h]) * softplus;
    beta[i] = 1.0f / (1.0f + expf(-b));
}

// The chunked prefill of the gated delta rule, in two launches over the same runs as
// gdn_recurrent (host references and the algebra: crates/kernels/src/ops/gated_delta.rs,
// chunk_factors and chunk_apply). Chunk c of sequence s is its tokens begin + c L .. min(begin +
// (c + 1) L, end), L = chunk_len <= GDN_CHUNK_MAX. Within a chunk of n tokens of value head h,
// with q and k normalised as gdn_recurrent does them, G_i = g_0 + ... + g_i (the chunk's running
// log-decay) and D_ij = exp(G_i - G_j) for j <= i:
//   T    = (I + L)^-1, L_ij = beta_i D_ij k_i.k_j strictly below the diagonal (the delta rule's
//          writes within the chunk solved at once: the UT transform)
//   P_ij = D_ij q_i.k_j for j <= i, else 0 (the decay-masked scores)
// and from the state S entering the chunk (dk x dv):
//   X  = diag(beta) (V - diag(exp(G)) K S)         n x dv
//   V' = T X                                       the values the rule writes, corrected
//   O  = diag(exp(G)) Q S + P V'
//   S  = exp(G_{n-1}) S + (diag(exp(G_{n-1} - G)) K)^T V'
// (the rule's W = T diag(beta exp(G)) K and U = T diag(beta) V, with V' = U - W S, kept as T).
//   1. gdn_chunk_prep, parallel over (chunk, value head, sequence): T and P of every chunk, one
//      row of L floats a token: t_mat and attn f32 [tokens][hv][chunk_len], row i of token
//      first + i (zero right of the diagonal and past the chunk's tokens).
//   2. gdn_chunk_scan, parallel over (block of GDN_SCAN_COLS value columns, value head,
//      sequence), sequential over a run's chunks: each column of S evolves on its own given T, P
//      and the chunk's q, k, v, g, beta, so a block holds its columns of S in shared memory from
//      and back into the slot (zero for a run at position 0, as gdn_recurrent), writing o.
// The sums run in another order than the token-by-token walk's, so the outputs agree with it to
// f32 rounding, not bit for bit. A run with more chunks than max_chunks (the prep's grid) is left
// alone by both launches (its state and outputs unwritten); an empty run leaves its state as it
// is. Shapes outside the limits (dk above GDN_MAX_DK, chunk_len 0 or above GDN_CHUNK_MAX, hv not
// a multiple of hk) write nothing.
namespace {
// Value columns (of S, v and o) one scan block owns.
constexpr uint32_t GDN_SCAN_COLS = 16;
// Shared row stride (floats) of a chunk's q or k row: four floats past a multiple of 32 banks, so
// the float4 reads of eight consecutive rows fall in distinct banks (GDN_T_STRIDE likewise).
constexpr uint32_t GDN_QK_STRIDE = GDN_MAX_DK + 4;
constexpr uint32_t GDN_QK_FLOATS = GDN_CHUNK_MAX * GDN_QK_STRIDE;
constexpr uint32_t GDN_T_FLOATS = GDN_CHUNK_MAX * GDN_T_STRIDE;
// Dynamic shared memory of gdn_chunk_prep: q, k, L, T, G, beta.
constexpr uint32_t GDN_PREP_SMEM = 4 * (2 * GDN_QK_FLOATS + 2 * GDN_T_FLOATS + 2 * GDN_CHUNK_MAX);
// Dynamic shared memory of gdn_chunk_scan: k, q (then T and P over it), S's columns, X, V', G,
// beta and the state update's decays.
constexpr uint32_t GDN_SCAN_QT_FLOATS =
    GDN_QK_FLOATS > 2 * GDN_T_FLOATS ? GDN_QK_FLOATS : 2 * GDN_T_FLOATS;
constexpr uint32_t GDN_SCAN_SMEM =
    4 * (GDN_QK_FLOATS + GDN_SCAN_QT_FLOATS + GDN_MAX_DK * GDN_SCAN_COLS +
         2 * GDN_CHUNK_MAX * GDN_SCAN_COLS + 3 * GDN_CHUNK_MAX);
// The byte counts the host side launches with (GDN_CHUNK_PREP_SMEM, GDN_CHUNK_SCAN_SMEM in
// crates/kernels/src/ops/gated_delta/chunked.rs).
static_assert(GDN_PREP_SMEM == 102912, "the host's gdn_chunk_prep shared memory");
static_assert(GDN_SCAN_SMEM == 85760, "the host's gdn_chunk_scan shared memory");
static_assert(GDN_CHUNK_THREADS == 4 * GDN_CHUNK_MAX, "four threads a chunk row");
static_assert(GDN_CHUNK_THREADS == 2 * GDN_MAX_DK, "two threads a row of S");
static_assert(GDN_SCAN_COLS == 16, "the state update's two halves of eight columns");
static_assert(GDN_MAX_DK % 32 == 0, "whole rounds of a warp over a q or k row");

// Rows 0 .. n - 1 of qs and ks (GDN_QK_STRIDE apart): the chunk's tokens' q (scaled by dk^-1/2)
// and k of key head kh, L2-normalised as gdn_recurrent does; every other element of the
// GDN_CHUNK_MAX x GDN_QK_STRIDE tiles zero. A warp a row, eight rows a warp.
__device__ __forceinline__ void gdn_load_qk(float* qs, float* ks, const __nv_bfloat16* q,
                                            const __nv_bfloat16* k, int32_t first, uint32_t n,
                                            uint32_t kh, uint32_t dk, uint32_t qkv_stride) {
    constexpr uint32_t PER_LANE = GDN_QK_STRIDE / 32 + 1;
    const uint32_t lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const float q_scale = rsqrtf((float)dk);
    for (uint32_t i = warp; i < GDN_CHUNK_MAX; i += GDN_CHUNK_THREADS / 32) {
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
            if (a < GDN_QK_STRIDE) {
                qs[i * GDN_QK_STRIDE + a] = qv[r] * q_norm;
                ks[i * GDN_QK_STRIDE + a] = kv[r] * k_norm;
            }
        }
    }
}

}  // namespace

// Pass 1: per (chunk, value head, sequence), T and P of the chunk (see above) into the rows of
// its tokens. Four threads a row i compute L and P at columns j = i % 4 + 4 m from shared q and k;
// then T by forward substitution (gdn_solve_t).
// Launch: grid = (max_chunks, hv, seqs), block = GDN_CHUNK_THREADS, GDN_PREP_SMEM bytes of
// dynamic shared memory.
extern "C" __global__ void __launch_bounds__(GDN_CHUNK_THREADS)
    gdn_chunk_prep(float* __restrict__ t_mat, float* __restrict__ attn,
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
    extern __shared__ __align__(16) float gdn_smem[];
    float* qs = gdn_smem;
    float* ks = qs + GDN_QK_FLOATS;
    float* ls = ks + GDN_QK_FLOATS;
    float* ts = ls + GDN_T_FLOATS;
    float* gs = ts + GDN_T_FLOATS;
    float* bs = gs + GDN_CHUNK_MAX;
    gdn_load_qk(qs, ks, q, k, first, n, kh, dk, qkv_stride);
    gdn_load_decays(gs, bs, g, beta, first, n, h, hv);
    __syncthreads();

    const uint32_t tid = threadIdx.x;
    const uint32_t i = tid / 4, j0 = tid % 4;
    constexpr uint32_t JS = GDN_CHUNK_MAX / 4;
    float kk[JS], qk[JS];
#pragma unroll
    for (uint32_t m = 0; m < JS; ++m) kk[m] = qk[m] = 0.0f;
    const uint32_t dk4 = (dk + 3) & ~3u;
    for (uint32_t a = 0; a < dk4; a += 4) {
        const float4 ki = *reinterpret_cast<const float4*>(ks + i * GDN_QK_STRIDE + a);
        const float4 qi = *reinterpret_cast<const float4*>(qs + i * GDN_QK_STRIDE + a);
#pragma unroll
        for (uint32_t m = 0; m < JS; ++m) {
            const float4 kj =
                *reinterpret_cast<const float4*>(ks + (j0 + 4 * m) * GDN_QK_STRIDE + a);
            kk[m] += ki.x * kj.x + ki.y * kj.y + ki.z * kj.z + ki.w * kj.w;
            qk[m] += qi.x * kj.x + qi.y * kj.y + qi.z * kj.z + qi.w * kj.w;
        }
    }
    float* attn_row = attn + ((size_t)(first + (int32_t)i) * hv + h) * chunk_len;
#pragma unroll
    for (uint32_t m = 0; m < JS; ++m) {
        const uint32_t j = j0 + 4 * m;
        const float d = (i < n && j <= i) ? expf(gs[i] - gs[j]) : 0.0f;
        ls[i * GDN_T_STRIDE + j] = j < i ? bs[i] * d * kk[m] : 0.0f;
        if (i < n && j < chunk_len) attn_row[j] = d * qk[m];
    }
    __syncthreads();
    gdn_solve_t(ts, ls, n);
    __syncthreads();
    for (uint32_t e = tid; e < n * chunk_len; e += GDN_CHUNK_THREADS) {
        const uint32_t r = e / chunk_len, j = e % chunk_len;
        t_mat[((size_t)(first + (int32_t)r) * hv + h) * chunk_len + j] = ts[r * GDN_T_STRIDE + j];
    }
}

// Pass 2: per (block of GDN_SCAN_COLS value columns, value head, sequence), the run's chunks in
// order from the slot's state (zero at position 0) and back into it, writing o (see above). Per
// chunk: k and q into shared memory; four threads a chunk row i take four columns each of K S
// and Q S (float4 reads of S), then X; T and P over q's tile; V' = T X and O = exp(G) Q S + P V'
// by the same threads; two threads a row of S (eight columns each) update it from k and V'.
// Launch: grid = (ceil(dv / GDN_SCAN_COLS), hv, seqs), block = GDN_CHUNK_THREADS, GDN_SCAN_SMEM
// bytes of dynamic shared memory.
extern "C" __global__ void __launch_bounds__(GDN_CHUNK_THREADS)
    gdn_chunk_scan(__nv_bfloat16* __restrict__ o, float* __restrict__ state,
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
    const uint32_t col0 = blockIdx.x * GDN_SCAN_COLS;
    float* slot = state + ((size_t)slots[seq] * hv + h) * dk * dv;

    extern __shared__ __align__(16) float gdn_smem[];
    float* ks = gdn_smem;
    float* qs = ks + GDN_QK_FLOATS;
    float* ts = qs;  // T and P over q's tile once K S and Q S are read
    float* ps = ts + GDN_T_FLOATS;
    float* ss = qs + GDN_SCAN_QT_FLOATS;
    float* xs = ss + GDN_MAX_DK * GDN_SCAN_COLS;
    float* vs = xs + GDN_CHUNK_MAX * GDN_SCAN_COLS;
    float* gs = vs + GDN_CHUNK_MAX * GDN_SCAN_COLS;
    float* bs = gs + GDN_CHUNK_MAX;
    float* kdec = bs + GDN_CHUNK_MAX;

    const uint32_t tid = threadIdx.x;
    for (uint32_t e = tid; e < GDN_MAX_DK * GDN_SCAN_COLS; e += GDN_CHUNK_THREADS) {
        const uint32_t a = e / GDN_SCAN_COLS, col = col0 + e % GDN_SCAN_COLS;
        ss[e] = (!fresh && a < dk && col < dv) ? slot[(size_t)a * dv + col] : 0.0f;
    }
    // Chunk rows: row i, columns c4 .. c4 + 3 of the block's. State rows: row a, columns
    // c8 .. c8 + 7.
    const uint32_t i = tid / 4, c4 = (tid % 4) * 4;
    const uint32_t a = tid / 2, c8 = (tid % 2) * 8;
    const uint32_t dk4 = (dk + 3) & ~3u;
    const uint32_t chunks = gdn_chunks_of(begin, end, chunk_len);
    for (uint32_t c = 0; c < chunks; ++c) {
        const int32_t first = begin + (int32_t)(c * chunk_len);
        const uint32_t n = (uint32_t)min((int64_t)chunk_len, (int64_t)end - first);
        const uint32_t n4 = (n + 3) & ~3u;
        __syncthreads();  // the previous chunk's reads of k, T, P and V' are done
        gdn_load_qk(qs, ks, q, k, first, n, kh, dk, qkv_stride);
        gdn_load_decays(gs, bs, g, beta, first, n, h, hv);
        float vv[4];
#pragma unroll
        for (uint32_t e = 0; e < 4; ++e) {
            const uint32_t col = col0 + c4 + e;
            vv[e] = (i < n && col < dv)
                        ? metrale::to_f32(v[(size_t)(first + (int32_t)i) * qkv_stride +
                                            (size_t)h * dv + col])
                        : 0.0f;
        }
        __syncthreads();

        // K S and Q S at row i, columns c4 ..
        float kS[4] = {0.0f, 0.0f, 0.0f, 0.0f}, qS[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        for (uint32_t b = 0; b < dk4; b += 4) {
            const float4 kv = *reinterpret_cast<const float4*>(ks + i * GDN_QK_STRIDE + b);
            const float4 qv = *reinterpret_cast<const float4*>(qs + i * GDN_QK_STRIDE + b);
            const float kb[4] = {kv.x, kv.y, kv.z, kv.w}, qb[4] = {qv.x, qv.y, qv.z, qv.w};
#pragma unroll
            for (uint32_t e = 0; e < 4; ++e) {
                const float4 s =
                    *reinterpret_cast<const float4*>(ss + (b + e) * GDN_SCAN_COLS + c4);
                kS[0] += kb[e] * s.x;
                kS[1] += kb[e] * s.y;
                kS[2] += kb[e] * s.z;
                kS[3] += kb[e] * s.w;
                qS[0] += qb[e] * s.x;
                qS[1] += qb[e] * s.y;
                qS[2] += qb[e] * s.z;
                qS[3] += qb[e] * s.w;
            }
        }
        const float eg = expf(gs[i]);
        {
            float4 x;
            x.x = bs[i] * (vv[0] - eg * kS[0]);
            x.y = bs[i] * (vv[1] - eg * kS[1]);
            x.z = bs[i] * (vv[2] - eg * kS[2]);
            x.w = bs[i] * (vv[3] - eg * kS[3]);
            *reinterpret_cast<float4*>(xs + i * GDN_SCAN_COLS + c4) = x;
        }
        if (tid < GDN_CHUNK_MAX) {
            kdec[tid] = tid < n ? expf(gs[n - 1] - gs[tid]) : 0.0f;
        }
        __syncthreads();  // q's tile is free; X is whole

        // T and P of the chunk's rows, zero past its tokens and its chunk_len columns.
        for (uint32_t e = tid; e < GDN_CHUNK_MAX * GDN_CHUNK_MAX; e += GDN_CHUNK_THREADS) {
            const uint32_t r = e / GDN_CHUNK_MAX, j = e % GDN_CHUNK_MAX;
            const bool live = r < n && j < chunk_len;
            const size_t at = ((size_t)(first + (int32_t)r) * hv + h) * chunk_len + j;
            ts[r * GDN_T_STRIDE + j] = live ? t_mat[at] : 0.0f;
            ps[r * GDN_T_STRIDE + j] = live ? attn[at] : 0.0f;
        }
        __syncthreads();

        // V' = T X.
        {
            float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            for (uint32_t j = 0; j < n4; j += 4) {
                const float4 t = *reinterpret_cast<const float4*>(ts + i * GDN_T_STRIDE + j);
                const float tj[4] = {t.x, t.y, t.z, t.w};
#pragma unroll
                for (uint32_t e = 0; e < 4; ++e) {
                    const float4 x =
                        *reinterpret_cast<const float4*>(xs + (j + e) * GDN_SCAN_COLS + c4);
                    acc.x += tj[e] * x.x;
                    acc.y += tj[e] * x.y;
                    acc.z += tj[e] * x.z;
                    acc.w += tj[e] * x.w;
                }
            }
            *reinterpret_cast<float4*>(vs + i * GDN_SCAN_COLS + c4) = acc;
        }
        __syncthreads();

        // O = exp(G) Q S + P V', row i.
        {
            float out[4] = {eg * qS[0], eg * qS[1], eg * qS[2], eg * qS[3]};
            for (uint32_t j = 0; j < n4; j += 4) {
                const float4 p = *reinterpret_cast<const float4*>(ps + i * GDN_T_STRIDE + j);
                const float pj[4] = {p.x, p.y, p.z, p.w};
#pragma unroll
                for (uint32_t e = 0; e < 4; ++e) {
                    const float4 w =
                        *reinterpret_cast<const float4*>(vs + (j + e) * GDN_SCAN_COLS + c4);
                    out[0] += pj[e] * w.x;
                    out[1] += pj[e] * w.y;
                    out[2] += pj[e] * w.z;
                    out[3] += pj[e] * w.w;
                }
            }
            if (i < n) {
                __nv_bfloat16* orow = o + ((size_t)(first + (int32_t)i) * hv + h) * dv;
#pragma unroll
                for (uint32_t e = 0; e < 4; ++e) {
                    const uint32_t col = col0 + c4 + e;
                    if (col < dv) orow[col] = metrale::to_bf16(out[e]);
                }
            }
        }
        // S = exp(G_{n-1}) S + (diag(exp(G_{n-1} - G)) K)^T V', row a (S is not read again
        // before the next chunk's barrier; k and V' are not written).
        if (a < dk) {
            const float total = expf(gs[n - 1]);
            float* srow = ss + a * GDN_SCAN_COLS + c8;
            float4 lo = *reinterpret_cast<const float4*>(srow);
            float4 hi = *reinterpret_cast<const float4*>(srow + 4);
            lo.x *= total;
            lo.y *= total;
            lo.z *= total;
            lo.w *= total;
            hi.x *= total;
            hi.y *= total;
            hi.z *= total;
            hi.w *= total;
            for (uint32_t j = 0; j < n; ++j) {
                const float kj = kdec[j] * ks[j * GDN_QK_STRIDE + a];
                const float4 w0 = *reinterpret_cast<const float4*>(vs + j * GDN_SCAN_COLS + c8);
                const float4 w1 =
                    *reinterpret_cast<const float4*>(vs + j * GDN_SCAN_COLS + c8 + 4);
                lo.x += kj * w0.x;
                lo.y += kj * w0.y;
                lo.z += kj * w0.z;
                lo.w += kj * w0.w;
                hi.x += kj * w1.x;
                hi.y += kj * w1.y;
                hi.z += kj * w1.z;
                hi.w += kj * w1.w;
            }
            *reinterpret_cast<float4*>(srow) = lo;
            *reinterpret_cast<float4*>(srow + 4) = hi;
        }
    }
    __syncthreads();
    for (uint32_t e = tid; e < GDN_MAX_DK * GDN_SCAN_COLS; e += GDN_CHUNK_THREADS) {
        const uint32_t r = e / GDN_SCAN_COLS, col = col0 + e % GDN_SCAN_COLS;
        if (r < dk && col < dv) slot[(size_t)r * dv + col] = ss[e];
    }
}
