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
#include "common.cuh"

namespace {

// Widest conv the kernels hold in registers (Qwen3-Next and Qwen3.5: 4).
constexpr uint32_t CONV_MAX_KERNEL = 8;
// Tokens one thread of gdn_conv1d walks; at least CONV_MAX_KERNEL - 1, so that only the first
// chunk of a run reads the conv state.
constexpr uint32_t CONV_CHUNK = 16;
// Widest key head gdn_recurrent holds in registers (a column of S across two lanes).
constexpr uint32_t GDN_MAX_DK = 128;
// Epsilon of the L2 normalisation of q and k.
constexpr float GDN_L2NORM_EPS = 1e-6f;

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
// run (sequential over its tokens; the tensor-core chunked form is separate). A sequence whose
// first token is at position 0 starts from S = 0 (its slot is not read; it is still written).
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
