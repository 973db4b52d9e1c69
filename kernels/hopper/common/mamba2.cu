// SPDX-License-Identifier: MIT OR Apache-2.0
// Mamba-2 token mixer (Nemotron-H): the SSD recurrence over a recurrent f32 state, token by token
// (decode batches, and prefill runs walked sequentially). The causal conv with SiLU over x|B|C in
// front of it is gated_delta.cu's gdn_conv1d / gdn_conv1d_step (its bias, x_stride and per-run
// slots and positions fit: channels = inner + 2 groups N, x at the in_proj row's x column); the
// gated RMSNorm after it is gated_norm.cu's gated_rmsnorm with the gate first.
// Host references: crates/kernels/src/ops/mamba2.rs (ssd_recurrent) and ops/mamba2/kernels.rs.
//
// Buffers (inner = heads * head_dim, N = state_size):
//   xbc       bf16, token t's conv output row at xbc + t * xbc_stride: x (inner), then every
//             group's B (groups * N), then every group's C (groups * N)
//   dt_raw    bf16, token t's head h at dt_raw + t * dt_stride + h (the dt columns of in_proj's
//             output, before the bias and the softplus)
//   a_log, dt_bias, d   f32 [heads]
//   state     f32 [slots][heads][head_dim][N], row-major per head (as transformers keeps it)
//   y         f32 [tokens][inner], before the gated norm (which reads it unrounded: the
//             reference, transformers, hands the scan's f32 output to the norm too)
//
// Head h reads group h / (heads / groups)'s B and C (the reference's repeat_interleave). A run
// whose first token is at position 0 starts a sequence: its state starts at zero, whatever its
// slot holds (a slot is reused without being cleared), and is written back as always.
#include "common.cuh"

namespace {

// Widest state (N) the kernel holds in registers: a channel's row across M2_LANES lanes.
constexpr uint32_t M2_MAX_STATE = 128;
// Lanes that share one channel's state row; each holds M2_PER_LANE values of it.
constexpr uint32_t M2_LANES = 8;
constexpr uint32_t M2_PER_LANE = M2_MAX_STATE / M2_LANES;
// float4 pieces a lane holds: lane `sub` of a channel holds n = 4 sub + 4 M2_LANES k + j.
constexpr uint32_t M2_PIECES = M2_PER_LANE / 4;
// Channels of one head a block owns; block = M2_CHANNELS * M2_LANES threads.
constexpr uint32_t M2_CHANNELS = 16;
constexpr uint32_t M2_THREADS = M2_CHANNELS * M2_LANES;
// Values of one token's B|C each thread stages (2 * M2_MAX_STATE over the block).
constexpr uint32_t M2_BC_PER_THREAD = 2 * M2_MAX_STATE / M2_THREADS;
static_assert(M2_PER_LANE % 4 == 0, "a lane's row part is whole float4 pieces");
static_assert(2 * M2_MAX_STATE % M2_THREADS == 0, "B|C staged in whole rounds");

}  // namespace

namespace {

// What one walk of the recurrence does (mamba2_walk): the whole run from and back into the slot
// (decode, sequential prefill), one chunk from zero to its local state (the chunked prefill's first
// pass), or one chunk from its start state to its outputs (its last pass).
enum class Walk { Recurrent, ChunkState, ChunkScan };

// The argument shapes every walk shares; limits as mamba2_recurrent's comment says.
__device__ __forceinline__ bool m2_shape_ok(uint32_t heads, uint32_t head_dim, uint32_t n_state,
                                            uint32_t groups, uint32_t xbc_stride,
                                            uint32_t dt_stride, float dt_min, float dt_max) {
    return groups != 0 && heads % groups == 0 && n_state != 0 && n_state <= M2_MAX_STATE &&
           n_state % 4 == 0 && head_dim != 0 &&
           (uint64_t)xbc_stride >= (uint64_t)heads * head_dim + 2ull * groups * n_state &&
           dt_stride >= heads && dt_min <= dt_max;
}

// One block's walk over tokens [begin, end) of head h, channels of block x, from `init` (null:
// zero) to `out_state` (null: not written), writing y unless the walk is ChunkState. A
// ChunkState walk also writes the product of its steps' decays to *decay_out (one thread).
template <Walk W>
__device__ __forceinline__ void mamba2_walk(
    float* __restrict__ y, const float* init, float* out_state, float* decay_out,
    const __nv_bfloat16* __restrict__ xbc, const __nv_bfloat16* __restrict__ dt_raw,
    const float* __restrict__ a_log, const float* __restrict__ dt_bias,
    const float* __restrict__ d, int32_t begin, int32_t end, uint32_t h, uint32_t heads,
    uint32_t head_dim, uint32_t n_state, uint32_t groups, uint32_t xbc_stride,
    uint32_t dt_stride, float dt_min, float dt_max) {
    __shared__ __align__(16) float bc_s[2][2 * M2_MAX_STATE];
    const uint32_t tid = threadIdx.x;
    const uint32_t sub = tid % M2_LANES;
    const uint32_t p = blockIdx.x * M2_CHANNELS + tid / M2_LANES;
    const bool live = p < head_dim;
    const uint32_t g = h / (heads / groups);
    const size_t inner = (size_t)heads * head_dim;
    const size_t row_at = ((size_t)h * head_dim + p) * n_state;

    float4 s[M2_PIECES];
#pragma unroll
    for (uint32_t k = 0; k < M2_PIECES; ++k) {
        const uint32_t n0 = 4 * sub + 4 * M2_LANES * k;
        s[k] = (live && init != nullptr && n0 < n_state)
                   ? *reinterpret_cast<const float4*>(init + row_at + n0)
                   : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
    const float rate = -expf(a_log[h]);
    const float bias = dt_bias[h];
    const float skip = d[h];
    float decay_prod = 1.0f;

    // Token t's inputs, loaded one token ahead: this thread's share of the group's B|C (B then C,
    // 2 N values over the block), its channel's x and the head's raw dt.
    float bc_next[M2_BC_PER_THREAD], x_next = 0.0f, dt_next = 0.0f;
    const size_t b_at = inner + (size_t)g * n_state;
    const size_t c_at = inner + ((size_t)groups + g) * n_state;
    auto load_token = [&](int32_t t) {
        const __nv_bfloat16* r = xbc + (size_t)t * xbc_stride;
#pragma unroll
        for (uint32_t i = 0; i < M2_BC_PER_THREAD; ++i) {
            const uint32_t j = tid + i * M2_THREADS;
            bc_next[i] = j < n_state       ? metrale::to_f32(r[b_at + j])
                         : j < 2 * n_state ? metrale::to_f32(r[c_at + j - n_state])
                                           : 0.0f;
        }
        x_next = live ? metrale::to_f32(r[(size_t)h * head_dim + p]) : 0.0f;
        dt_next = metrale::to_f32(dt_raw[(size_t)t * dt_stride + h]);
    };
    load_token(begin);
    for (int32_t t = begin; t < end; ++t) {
        // Buffer t & 1 was last read two tokens ago, before the previous token's barrier.
        float* bc = bc_s[(t - begin) & 1];
#pragma unroll
        for (uint32_t i = 0; i < M2_BC_PER_THREAD; ++i) bc[tid + i * M2_THREADS] = bc_next[i];
        const float xv = x_next;
        const float raw = dt_next + bias;
        __syncthreads();
        if (t + 1 < end) load_token(t + 1);
        const float softplus = raw > 20.0f ? raw : log1pf(expf(raw));
        const float dt = fminf(fmaxf(softplus, dt_min), dt_max);
        const float decay = expf(dt * rate);
        decay_prod *= decay;
        const float dx = dt * xv;
        float acc = 0.0f;
#pragma unroll
        for (uint32_t k = 0; k < M2_PIECES; ++k) {
            const uint32_t n0 = 4 * sub + 4 * M2_LANES * k;
            if (n0 < n_state) {
                const float4 b = *reinterpret_cast<const float4*>(bc + n0);
                s[k].x = decay * s[k].x + dx * b.x;
                s[k].y = decay * s[k].y + dx * b.y;
                s[k].z = decay * s[k].z + dx * b.z;
                s[k].w = decay * s[k].w + dx * b.w;
                if constexpr (W != Walk::ChunkState) {
                    const float4 c = *reinterpret_cast<const float4*>(bc + n_state + n0);
                    acc += s[k].x * c.x + s[k].y * c.y + s[k].z * c.z + s[k].w * c.w;
                }
            }
        }
        if constexpr (W != Walk::ChunkState) {
#pragma unroll
            for (uint32_t off = M2_LANES / 2; off > 0; off /= 2) {
                acc += __shfl_xor_sync(0xffffffffu, acc, off);
            }
            if (live && sub == 0) y[(size_t)t * inner + (size_t)h * head_dim + p] = acc + skip * xv;
        }
    }
    if (out_state != nullptr) {
#pragma unroll
        for (uint32_t k = 0; k < M2_PIECES; ++k) {
            const uint32_t n0 = 4 * sub + 4 * M2_LANES * k;
            if (live && n0 < n_state)
                *reinterpret_cast<float4*>(out_state + row_at + n0) = s[k];
        }
    }
    if (W == Walk::ChunkState && decay_out != nullptr && blockIdx.x == 0 && tid == 0) {
        *decay_out = decay_prod;
    }
}

}  // namespace

// The SSD recurrence over each sequence's tokens in order, per (sequence, head, block of
// M2_CHANNELS channels), from and back into the state in the sequence's slot. Sequence s owns
// tokens seq_starts[s] .. seq_starts[s + 1] and slot slots[s] (distinct): a decode batch is runs
// of one token, a prefill chunk one run (walked token by token; the tensor-core chunked scan is
// separate). A sequence whose first token is at position 0 starts from H = 0 (its slot is not
// read; it is still written). An empty run leaves its state as it is. Per token, for each channel
// p of head h (group g):
//   dt = clamp(softplus(dt_raw + dt_bias[h]), dt_min, dt_max)   (softplus(x) = x above 20)
//   H[p][:] = exp(-dt exp(a_log[h])) H[p][:] + dt x[p] B_g[:]
//   y[p] = H[p][:] . C_g[:] + d[h] x[p]   (f32)
//
// Each channel's row of H (N <= M2_MAX_STATE f32) lives in the registers of M2_LANES lanes, as
// float4 pieces 4 M2_LANES apart, so a warp's loads and stores of the state are whole 128-byte
// lines of four rows; the state is read once and written once a launch. A token's B and C are
// staged in shared memory (double-buffered: one barrier a token), and the next token's inputs
// are loaded while this one computes. The only exchange between lanes is each channel's
// output sum (three shuffles).
// Shapes outside the limits (N not a multiple of 4 or above M2_MAX_STATE, groups not dividing
// heads, strides narrower than their rows, dt_min > dt_max) write nothing.
// Launch: grid = (ceil(head_dim / M2_CHANNELS), heads, seqs), block = M2_THREADS.
extern "C" __global__ void __launch_bounds__(M2_THREADS)
    mamba2_recurrent(float* __restrict__ y, float* __restrict__ state,
                     const __nv_bfloat16* __restrict__ xbc,
                     const __nv_bfloat16* __restrict__ dt_raw, const float* __restrict__ a_log,
                     const float* __restrict__ dt_bias, const float* __restrict__ d,
                     const int32_t* __restrict__ seq_starts, const int32_t* __restrict__ slots,
                     const int32_t* __restrict__ positions, uint32_t seqs, uint32_t heads,
                     uint32_t head_dim, uint32_t state_size, uint32_t groups, uint32_t xbc_stride,
                     uint32_t dt_stride, float dt_min, float dt_max) {
    metrale::grid_dependency_sync();
    if (blockIdx.z >= seqs || blockIdx.y >= heads ||
        !m2_shape_ok(heads, head_dim, state_size, groups, xbc_stride, dt_stride, dt_min, dt_max)) {
        return;
    }
    const uint32_t seq = blockIdx.z;
    const int32_t begin = seq_starts[seq];
    const int32_t end = seq_starts[seq + 1];
    // An empty run has no first position: its state is left as it is.
    if (begin >= end) return;
    float* slot = state + (size_t)slots[seq] * heads * head_dim * state_size;
    const bool fresh = positions[begin] == 0;
    mamba2_walk<Walk::Recurrent>(y, fresh ? nullptr : slot, slot, nullptr, xbc, dt_raw, a_log,
                                 dt_bias, d, begin, end, blockIdx.y, heads, head_dim, state_size,
                                 groups, xbc_stride, dt_stride, dt_min, dt_max);
}

// The chunked prefill of the recurrence, in three launches over the same arguments as
// mamba2_recurrent plus the chunk length L, the most chunks a sequence has (max_chunks) and two
// scratch buffers: chunk_states f32 [seqs][max_chunks][heads][head_dim][N] and chunk_decay f32
// [seqs][max_chunks][heads]. Chunk c of sequence s is its tokens begin + c L .. min(begin + (c+1) L,
// end). Because H after a chunk is (its decays' product) * (H before it) + (the chunk walked from
// zero), the chunks' local passes run in parallel, one short sequential pass joins them, and the
// outputs run in parallel again:
//   1. mamba2_chunk_state: every chunk from zero; its final state into chunk_states[s][c], the
//      product of its decays into chunk_decay[s][c][h];
//   2. mamba2_chunk_carry: per state element, in chunk order: chunk_states[s][c] becomes the state
//      the chunk starts from (the slot's, or zero for a sequence starting at position 0, then
//      carried), and the state after the last chunk goes back into the slot;
//   3. mamba2_chunk_scan: every chunk from its start state, writing y (f32) as mamba2_recurrent.
// The work is about twice the sequential walk's, in max_chunks times as many blocks. The sums run
// in another order than the sequential walk's (the carried state is added once per chunk), so the
// outputs agree with it to f32 rounding, not bit for bit.
// Launch (1 and 3): grid = (ceil(head_dim / M2_CHANNELS), heads, seqs * max_chunks), block =
// M2_THREADS; (2): grid = (ceil(heads * head_dim * N / 256), seqs), block = 256.
extern "C" __global__ void __launch_bounds__(M2_THREADS)
    mamba2_chunk_state(float* __restrict__ chunk_states, float* __restrict__ chunk_decay,
                       const __nv_bfloat16* __restrict__ xbc,
                       const __nv_bfloat16* __restrict__ dt_raw, const float* __restrict__ a_log,
                       const float* __restrict__ dt_bias, const float* __restrict__ d,
                       const int32_t* __restrict__ seq_starts, uint32_t seqs, uint32_t heads,
                       uint32_t head_dim, uint32_t state_size, uint32_t groups,
                       uint32_t xbc_stride, uint32_t dt_stride, float dt_min, float dt_max,
                       uint32_t chunk_len, uint32_t max_chunks) {
    metrale::grid_dependency_sync();
    if (chunk_len == 0 || max_chunks == 0 || blockIdx.z >= seqs * max_chunks ||
        blockIdx.y >= heads ||
        !m2_shape_ok(heads, head_dim, state_size, groups, xbc_stride, dt_stride, dt_min, dt_max)) {
        return;
    }
    const uint32_t seq = blockIdx.z / max_chunks, c = blockIdx.z % max_chunks;
    const int64_t first = (int64_t)seq_starts[seq] + (int64_t)c * chunk_len;
    const int32_t end = seq_starts[seq + 1];
    if (first >= end) return;
    const int32_t last = (int32_t)min((int64_t)end, first + chunk_len);
    const size_t at = (size_t)seq * max_chunks + c;
    mamba2_walk<Walk::ChunkState>(
        nullptr, nullptr, chunk_states + at * heads * head_dim * state_size,
        chunk_decay + at * heads + blockIdx.y, xbc, dt_raw, a_log, dt_bias, d, (int32_t)first,
        last, blockIdx.y, heads, head_dim, state_size, groups, xbc_stride, dt_stride, dt_min,
        dt_max);
}

extern "C" __global__ void __launch_bounds__(256)
    mamba2_chunk_carry(float* __restrict__ chunk_states, const float* __restrict__ chunk_decay,
                       float* __restrict__ state, const int32_t* __restrict__ seq_starts,
                       const int32_t* __restrict__ slots, const int32_t* __restrict__ positions,
                       uint32_t seqs, uint32_t heads, uint32_t head_dim, uint32_t state_size,
                       uint32_t chunk_len, uint32_t max_chunks) {
    metrale::grid_dependency_sync();
    const size_t per_seq = (size_t)heads * head_dim * state_size;
    const size_t e = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    const uint32_t seq = blockIdx.y;
    if (chunk_len == 0 || max_chunks == 0 || seq >= seqs || e >= per_seq) return;
    const int32_t begin = seq_starts[seq], end = seq_starts[seq + 1];
    if (begin >= end) return;
    const uint32_t chunks = (uint32_t)(((int64_t)end - begin + chunk_len - 1) / chunk_len);
    if (chunks > max_chunks) return;
    const uint32_t h = (uint32_t)(e / ((size_t)head_dim * state_size));
    float* slot = state + (size_t)slots[seq] * per_seq;
    float carried = positions[begin] == 0 ? 0.0f : slot[e];
    for (uint32_t c = 0; c < chunks; ++c) {
        const size_t at = (size_t)seq * max_chunks + c;
        float* cs = chunk_states + at * per_seq + e;
        const float local = *cs;
        *cs = carried;
        carried = fmaf(chunk_decay[at * heads + h], carried, local);
    }
    slot[e] = carried;
}

extern "C" __global__ void __launch_bounds__(M2_THREADS)
    mamba2_chunk_scan(float* __restrict__ y, const float* __restrict__ chunk_states,
                      const __nv_bfloat16* __restrict__ xbc,
                      const __nv_bfloat16* __restrict__ dt_raw, const float* __restrict__ a_log,
                      const float* __restrict__ dt_bias, const float* __restrict__ d,
                      const int32_t* __restrict__ seq_starts, uint32_t seqs, uint32_t heads,
                      uint32_t head_dim, uint32_t state_size, uint32_t groups,
                      uint32_t xbc_stride, uint32_t dt_stride, float dt_min, float dt_max,
                      uint32_t chunk_len, uint32_t max_chunks) {
    metrale::grid_dependency_sync();
    if (chunk_len == 0 || max_chunks == 0 || blockIdx.z >= seqs * max_chunks ||
        blockIdx.y >= heads ||
        !m2_shape_ok(heads, head_dim, state_size, groups, xbc_stride, dt_stride, dt_min, dt_max)) {
        return;
    }
    const uint32_t seq = blockIdx.z / max_chunks, c = blockIdx.z % max_chunks;
    const int64_t first = (int64_t)seq_starts[seq] + (int64_t)c * chunk_len;
    const int32_t end = seq_starts[seq + 1];
    if (first >= end) return;
    const int32_t last = (int32_t)min((int64_t)end, first + chunk_len);
    const size_t at = (size_t)seq * max_chunks + c;
    mamba2_walk<Walk::ChunkScan>(y, chunk_states + at * heads * head_dim * state_size, nullptr,
                                 nullptr, xbc, dt_raw, a_log, dt_bias, d, (int32_t)first, last,
                                 blockIdx.y, heads, head_dim, state_size, groups, xbc_stride,
                                 dt_stride, dt_min, dt_max);
}
