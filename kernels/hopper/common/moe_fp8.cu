// SPDX-License-Identifier: MIT OR Apache-2.0
// FP8 (E4M3) routed experts: moe.cu's decode launches (moe_gemv_swiglu, moe_gemv_relu2,
// moe_gemv_down) over e4m3 expert stacks with f32 scales, the weights dequantised in registers
// as gemv_fp8.cu does it.
//
// Layouts: moe.cu's stacks ([E, 2 inter, hidden] gate|up, [E, inter, hidden] squared-ReLU up,
// [E, hidden, inter] down) as e4m3 bytes, each stack one [rows, cols] FP8 matrix in
// Fp8Tensor's form (crates/model-weights/src/fp8.rs): scales f32 [ceil(rows / 2^row_shift),
// ceil(cols / 128)], row_shift 7 (128 x 128 blocks: every expert's rows whole blocks) or 0 (a
// scale per row and 128 columns: any width). A weight is e4m3 x its block's scale.
//
// The same launches and output bits rules as the BF16 entries: each first-product row's dot in
// f32, rounded to bf16, then the activation in f32 and one rounding; the down launch's weighted
// sum over the slots in f32 inside each output's dot, one rounding, the shared expert's output
// (computed by the dense products: FP8 experts take no shared slots) added last behind its gate.
// A 16-byte chunk is 16 weights in one 128-column scale block: its 16 products are summed, then
// scaled (sum_j w_j a_j * s = sum_j (w_j s) a_j up to f32 rounding). At batch 1 the bytes are
// the k selected experts' e4m3 weights and their scales: half the BF16 entries' bytes.
#include "common.cuh"
#include "e4m3.cuh"
#include "moe_common.cuh"

namespace {

using namespace metrale::moe;
using metrale::e4m3;
using metrale::e4m3x2;

constexpr int WARPS = 8;
// 16-byte weight loads a lane has in flight: 4 KiB a warp, as moe.cu's.
constexpr int BATCH = 8;
constexpr uint32_t BLOCK_K = 128;
// 16-weight chunks in a 128-column scale block.
constexpr uint32_t CHUNKS_PER_SCALE = BLOCK_K / 16;

// The dot of 16 e4m3 weights (wv) with 16 bf16 elements (x0: the first 8, x1: the next 8).
__device__ __forceinline__ float dot16(const uint4& wv, const uint4& x0, const uint4& x1) {
    const uint32_t w[4] = {wv.x, wv.y, wv.z, wv.w};
    const uint32_t x[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
    float s0 = 0.0f, s1 = 0.0f;
#pragma unroll
    for (int q = 0; q < 4; ++q) {
        // Weight word q holds elements 4q .. 4q + 3; x words 2q and 2q + 1 hold the same.
        const float2 p0 = e4m3x2(w[q]), p1 = e4m3x2(w[q] >> 16);
        s0 = fmaf(p0.x, lo(x[2 * q]), s0);
        s1 = fmaf(p0.y, hi(x[2 * q]), s1);
        s0 = fmaf(p1.x, lo(x[2 * q + 1]), s0);
        s1 = fmaf(p1.y, hi(x[2 * q + 1]), s1);
    }
    return s0 + s1;
}

// out[r] = rows[r] . x over n elements (dequantised: each 128-column block times its scale
// srows[r][block]), on every lane of the warp, ROWS rows streamed together. Vector path: n % 16
// == 0 and x and every row 16-byte aligned; each round issues BATCH / ROWS loads of each row
// before using any.
template <int ROWS>
__device__ __forceinline__ void row_dots(float (&out)[ROWS], const uint8_t* const (&rows)[ROWS],
                                         const float* const (&srows)[ROWS],
                                         const __nv_bfloat16* __restrict__ x, uint32_t n,
                                         uint32_t lane) {
    constexpr int PER = BATCH / ROWS;
    float acc[ROWS];
    bool vec = n % 16 == 0 && aligned16(x);
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        acc[r] = 0.0f;
        vec = vec && aligned16(rows[r]);
    }
    if (vec) {
        const uint32_t chunks = n / 16;
        const uint4* x4 = reinterpret_cast<const uint4*>(x);
        const uint4 zero = make_uint4(0, 0, 0, 0);
        for (uint32_t i = 0; i < chunks; i += 32 * PER) {
            uint4 wv[ROWS][PER];
#pragma unroll
            for (int q = 0; q < PER; ++q) {
                const uint32_t c = i + lane + 32 * q;
#pragma unroll
                for (int r = 0; r < ROWS; ++r)
                    wv[r][q] = c < chunks ? load_stream(reinterpret_cast<const uint4*>(rows[r]) + c)
                                          : zero;
            }
#pragma unroll
            for (int q = 0; q < PER; ++q) {
                const uint32_t c = i + lane + 32 * q;
                if (c < chunks) {
                    const uint4 x0 = __ldg(x4 + 2 * c), x1 = __ldg(x4 + 2 * c + 1);
#pragma unroll
                    for (int r = 0; r < ROWS; ++r)
                        acc[r] = fmaf(dot16(wv[r][q], x0, x1), __ldg(srows[r] + c / CHUNKS_PER_SCALE),
                                      acc[r]);
                }
            }
        }
    } else {
        for (uint32_t i = lane; i < n; i += 32) {
            const float xv = metrale::to_f32(x[i]);
#pragma unroll
            for (int r = 0; r < ROWS; ++r)
                acc[r] = fmaf(e4m3(rows[r][i]) * __ldg(srows[r] + i / BLOCK_K), xv, acc[r]);
        }
    }
#pragma unroll
    for (int r = 0; r < ROWS; ++r) out[r] = metrale::warp_sum(acc[r]);
}

// The decode experts' first product over FP8 stacks (moe_gemv_fp8_swiglu, moe_gemv_fp8_relu2).
template <Act A>
__device__ __forceinline__ void moe_gemv_fp8_act(
    __nv_bfloat16* __restrict__ act, const __nv_bfloat16* __restrict__ x,
    const uint8_t* __restrict__ w, const float* __restrict__ scales,
    const int32_t* __restrict__ ids, uint32_t rows, uint32_t k, uint32_t experts, uint32_t inter,
    uint32_t hidden, uint32_t row_shift) {
    constexpr int R = ExpertAct<A>::ROWS;
    const uint32_t lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const uint32_t a = blockIdx.x, j = blockIdx.y * WARPS + warp;
    // Warp-uniform exits; the kernel has no block barrier.
    if (k == 0 || rows == 0 || j >= inter || a >= rows * k) return;
    const int32_t e = ids[a];
    __nv_bfloat16* out = act + (size_t)a * inter + j;
    if (!valid_expert(e, experts)) {
        if (lane == 0) *out = metrale::to_bf16(0.0f);
        return;
    }
    const uint32_t kb = (hidden + BLOCK_K - 1) / BLOCK_K;
    const uint8_t* wr[R];
    const float* sr[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const size_t row = ((size_t)e * R + r) * inter + j;
        wr[r] = w + row * hidden;
        sr[r] = scales + (row >> row_shift) * kb;
    }
    float v[R];
    row_dots<R>(v, wr, sr, x + (size_t)(a / k) * hidden, hidden, lane);
    if (lane == 0) *out = metrale::to_bf16(ExpertAct<A>::of(v));
}

}  // namespace

// moe_gemv_swiglu over an e4m3 gate|up stack w [E, 2 inter, hidden] (scales of the [E 2 inter,
// hidden] matrix): act[a, j] = bf16(silu(g) * u) for every assignment a = r * k + s of expert
// e = ids[a], g and u the dots of x[r] with the dequantised rows e 2 inter + j and
// e 2 inter + inter + j, each rounded to bf16 first. An assignment with no expert gets zeros. No
// shared-expert slots.
// Launch: grid = (rows * k, ceil(inter / 8)), block = 256: warp w of block (a, b) computes column
// 8 b + w of assignment a, streaming its gate row and its up row together.
extern "C" __global__ void __launch_bounds__(256, 3) moe_gemv_fp8_swiglu(
    __nv_bfloat16* __restrict__ act, const __nv_bfloat16* __restrict__ x,
    const uint8_t* __restrict__ w, const float* __restrict__ scales,
    const int32_t* __restrict__ ids, uint32_t rows, uint32_t k, uint32_t experts, uint32_t inter,
    uint32_t hidden, uint32_t row_shift) {
    metrale::grid_dependency_sync();
    moe_gemv_fp8_act<Act::SwiGlu>(act, x, w, scales, ids, rows, k, experts, inter, hidden,
                                  row_shift);
}

// moe_gemv_relu2 over an e4m3 up stack w [E, inter, hidden]: act[a, j] = bf16(relu(u)^2), u the
// dot of x[r] with the dequantised row e inter + j rounded to bf16 first. Otherwise
// moe_gemv_fp8_swiglu's launch, one row a column.
extern "C" __global__ void __launch_bounds__(256, 3) moe_gemv_fp8_relu2(
    __nv_bfloat16* __restrict__ act, const __nv_bfloat16* __restrict__ x,
    const uint8_t* __restrict__ w, const float* __restrict__ scales,
    const int32_t* __restrict__ ids, uint32_t rows, uint32_t k, uint32_t experts, uint32_t inter,
    uint32_t hidden, uint32_t row_shift) {
    metrale::grid_dependency_sync();
    moe_gemv_fp8_act<Act::Relu2>(act, x, w, scales, ids, rows, k, experts, inter, hidden,
                                 row_shift);
}

// moe_gemv_down over an e4m3 down stack w [E, hidden, inter] (scales of the [E hidden, inter]
// matrix): out[r, h] = bf16(sum over slots s of weights[r, s] * (act[r k + s] . w[ids[r, s], h])
// + g_r * shared[r, h]), f32 throughout, the expert outputs unrounded; slots with no expert add
// nothing and are not read; the shared expert's output (bf16, from the dense products; null for
// none) added last behind g_r = sigmoid(shared_gate[r]) (null: 1). A warp computes one output as
// one dot over the k slots' rows laid end to end (k inter elements, each 16-weight chunk's
// partial dot times its slot's weight and its block's scale): k * inter bytes a warp (6 KiB for
// Qwen3-30B-A3B). Vector path: inter % 16 == 0 and act, w 16-byte aligned; else a scalar loop.
// Launch: grid = (ceil(hidden / 8), rows), block = 256: warp w of block (b, r) computes column
// 8 b + w of row r. rows <= 65535.
extern "C" __global__ void __launch_bounds__(256, 3) moe_gemv_fp8_down(
    __nv_bfloat16* __restrict__ out, const __nv_bfloat16* __restrict__ act,
    const uint8_t* __restrict__ w, const float* __restrict__ scales,
    const int32_t* __restrict__ ids, const float* __restrict__ weights,
    const __nv_bfloat16* __restrict__ shared, const float* __restrict__ shared_gate,
    uint32_t rows, uint32_t k, uint32_t experts, uint32_t hidden, uint32_t inter,
    uint32_t row_shift) {
    metrale::grid_dependency_sync();
    const uint32_t lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const uint32_t r = blockIdx.y, h = blockIdx.x * WARPS + warp;
    // Warp-uniform exits; the kernel has no block barrier.
    if (r >= rows || h >= hidden || k == 0 || k > MAX_TOP_K) return;
    // Lane s < k holds slot s's expert (-1 for none) and weight.
    int32_t my_e = -1;
    float my_w = 0.0f;
    if (lane < k) {
        const int32_t e = ids[(size_t)r * k + lane];
        if (valid_expert(e, experts)) {
            my_e = e;
            my_w = weights[(size_t)r * k + lane];
        }
    }
    const uint32_t kb = (inter + BLOCK_K - 1) / BLOCK_K;
    const __nv_bfloat16* act_row = act + (size_t)r * k * inter;
    const bool vec = inter != 0 && inter % 16 == 0 && aligned16(act) && aligned16(w);
    float acc[2] = {0.0f, 0.0f};
    if (vec) {
        const uint32_t row_chunks = inter / 16, chunks = k * row_chunks;
        const uint4* a4 = reinterpret_cast<const uint4*>(act_row);
        const uint4 zero = make_uint4(0, 0, 0, 0);
        for (uint32_t i = 0; i < chunks; i += 32 * BATCH) {
            uint4 wv[BATCH];
            int32_t es[BATCH];
#pragma unroll
            for (int q = 0; q < BATCH; ++q) {
                const uint32_t c = i + lane + 32 * q;
                const uint32_t s = min(c / row_chunks, k - 1);
                // Every lane takes part in the shuffle, in range or not.
                es[q] = __shfl_sync(FULL, my_e, s);
                wv[q] = c < chunks && es[q] >= 0
                            ? load_stream(reinterpret_cast<const uint4*>(
                                              w + ((size_t)es[q] * hidden + h) * inter) +
                                          (c - s * row_chunks))
                            : zero;
            }
#pragma unroll
            for (int q = 0; q < BATCH; ++q) {
                const uint32_t c = i + lane + 32 * q;
                const uint32_t s = min(c / row_chunks, k - 1);
                const float ws = __shfl_sync(FULL, my_w, s);
                if (c < chunks && es[q] >= 0) {
                    const size_t row = (size_t)es[q] * hidden + h;
                    const float scale =
                        __ldg(scales + (row >> row_shift) * kb + (c - s * row_chunks) / CHUNKS_PER_SCALE);
                    const float d = dot16(wv[q], __ldg(a4 + 2 * c), __ldg(a4 + 2 * c + 1));
                    acc[q & 1] = fmaf(ws, d * scale, acc[q & 1]);
                }
            }
        }
    } else {
        for (uint32_t s = 0; s < k; ++s) {
            const int32_t e = __shfl_sync(FULL, my_e, s);
            const float ws = __shfl_sync(FULL, my_w, s);
            if (e < 0) continue;  // warp-uniform
            const size_t row = (size_t)e * hidden + h;
            const uint8_t* wr = w + row * inter;
            const float* sr = scales + (row >> row_shift) * kb;
            const __nv_bfloat16* ar = act_row + (size_t)s * inter;
            float part = 0.0f;
            for (uint32_t i = lane; i < inter; i += 32)
                part = fmaf(e4m3(wr[i]) * __ldg(sr + i / BLOCK_K), metrale::to_f32(ar[i]), part);
            acc[0] = fmaf(ws, part, acc[0]);
        }
    }
    const float sum = metrale::warp_sum(acc[0] + acc[1]);
    if (lane == 0)
        out[(size_t)r * hidden + h] =
            metrale::to_bf16(add_shared(sum, shared, shared_gate, r, h, hidden));
}
