// SPDX-License-Identifier: MIT OR Apache-2.0
// Mixture of Experts: routing, the selected experts' MLPs (SwiGLU or squared ReLU), and the
// weighted combine.
//
// Layouts (bf16 weights and activations, f32 accumulation, routing in f32):
// - router logits f32 [m, E] (the router's product, an f32-output GEMV or GEMM);
// - topk_ids i32 [m, k] and topk_weights f32 [m, k]: row r's slot s takes expert ids[r, s] with
//   weight weights[r, s]. An "assignment" is a (row, slot) pair, numbered a = r * k + s. An id
//   outside [0, E) is "no expert" (expert parallelism may leave a slot empty): its expert output
//   is zero and it adds nothing to the row;
// - SwiGLU experts (`_swiglu` entries): gate|up weights stacked [E, 2 inter, hidden], expert e's
//   inter gate rows, then its inter up rows (the dense model's fused gate|up, once per expert);
//   squared-ReLU experts (`_relu2` entries, Nemotron-H: no gate product): up weights stacked
//   [E, inter, hidden]. Each pair of entries is one template over the activation (ExpertAct);
//   down weights stacked [E, hidden, inter] for both.
//
// Decode (few rows): the router's product and moe_route, or both in one launch (moe_router, up to
// 8 rows), then moe_gemv_swiglu (act [m k, inter], one row per assignment),
// then moe_gemv_down (out [m, hidden], the weighted sum over slots inside each output's dot).
// Both expert launches are weight streams like gemv.cu's FMA form: a warp computes one output
// (both gate and up rows, or every slot's down row) with 16-byte L1-no-allocate loads, 4 KiB in
// flight per warp. At batch 1 the weight bytes are exactly those of the k selected experts.
//
// Prefill (many rows): moe_route, moe_group (per-expert offsets and the assignments in expert
// order), moe_gemm_swiglu (the grouped gate|up product into act in expert order), moe_gemm_down
// (the grouped down product, each row stored back at its assignment), moe_combine (the weighted
// sum over slots). Every sum over slots runs in slot order: no atomics, the same bits on every
// run. A shared expert (Qwen2-MoE: a dense SwiGLU MLP every token takes, run by the dense
// products) joins in the epilogue of moe_gemv_down or moe_combine, behind its sigmoid gate.
#include <cuda_fp8.h>
#include <mma.h>

#include "common.cuh"
#include "moe_common.cuh"

using namespace metrale::moe;

namespace {


// moe_route's `scoring`: MoeScoring in ops/moe.rs.
constexpr uint32_t SCORING_SOFTMAX = 0;
constexpr uint32_t SCORING_SIGMOID = 1;

// ---------------------------------------------------------------------------------------------
// Routing.

// Threads of a routing block: one warp a row.
constexpr uint32_t ROUTE_THREADS = 128;
constexpr int ROUTE_PER_LANE = MAX_EXPERTS / 32;

// (v, e) beats (best, best_e): a larger key, or an equal key and a lower expert. An empty best
// (best_e == FULL) loses to anything.
__device__ __forceinline__ bool route_better(float v, uint32_t e, float best, uint32_t best_e) {
    return best_e == FULL || v > best || (v == best && e < best_e);
}

// One row's routing by one warp (moe_route, and moe_router's last block): scores, the top k,
// their weights.
// - softmax: weight_e = softmax(logits)_e; the top k are chosen on the logits themselves (softmax
//   is monotone, so they are the top k of the scores, and host and device choose from the same
//   bits);
// - sigmoid: score_e = sigmoid(logit_e); the top k are chosen on score_e + correction_bias[e]
//   (bias may be null: zero), and weighted by the unbiased score_e.
// Ties go to the lower expert id; a NaN key counts as -inf. Slots are in choice order (the best
// first). Then with `renormalize` the k weights are divided by their sum (added in slot order;
// a zero sum leaves them zero), and every weight is multiplied by `scale`.
// The logits are read through L2 (ld.global.cg): moe_router's other blocks wrote them in the same
// launch. The caller has checked experts, k and scoring (route_args_ok).
__device__ __forceinline__ void route_row_warp(int32_t* __restrict__ ids_out,
                                               float* __restrict__ weights_out,
                                               const float* in,
                                               const float* __restrict__ correction_bias,
                                               uint32_t experts, uint32_t k, uint32_t scoring,
                                               uint32_t renormalize, float scale, uint32_t lane) {
    // Lane l holds experts l, l + 32, ...: key (what the top k is chosen on) and score (what the
    // weight is made of; for softmax, exp(logit - max) before the division by the sum).
    float key[ROUTE_PER_LANE], score[ROUTE_PER_LANE];
    uint32_t live = 0;
    float max_logit = -INFINITY;
#pragma unroll
    for (int j = 0; j < ROUTE_PER_LANE; ++j) {
        const uint32_t e = lane + 32 * j;
        key[j] = -INFINITY;
        score[j] = 0.0f;
        if (e < experts) {
            live |= 1u << j;
            const float l = __ldcg(in + e);
            if (scoring == SCORING_SOFTMAX) {
                key[j] = isnan(l) ? -INFINITY : l;
                max_logit = fmaxf(max_logit, key[j]);
            } else {
                score[j] = 1.0f / (1.0f + expf(-l));
                const float b = correction_bias != nullptr ? correction_bias[e] : 0.0f;
                const float v = score[j] + b;
                key[j] = isnan(v) ? -INFINITY : v;
            }
        }
    }
    float sum = 0.0f;
    if (scoring == SCORING_SOFTMAX) {
        max_logit = metrale::warp_max(max_logit);
#pragma unroll
        for (int j = 0; j < ROUTE_PER_LANE; ++j) {
            if ((live >> j) & 1u) {
                score[j] = expf(key[j] - max_logit);
                sum += score[j];
            }
        }
        sum = metrale::warp_sum(sum);
    }
    // k rounds of a warp argmax over the live entries; lane t keeps slot t.
    int32_t my_id = 0;
    float my_weight = 0.0f;
    for (uint32_t t = 0; t < k; ++t) {
        float best = -INFINITY;
        uint32_t best_e = FULL;
#pragma unroll
        for (int j = 0; j < ROUTE_PER_LANE; ++j) {
            const uint32_t e = lane + 32 * j;
            if (((live >> j) & 1u) && route_better(key[j], e, best, best_e)) {
                best = key[j];
                best_e = e;
            }
        }
        // A strict total order on (key, expert), so every lane ends with the same winner.
#pragma unroll
        for (int offset = 16; offset > 0; offset >>= 1) {
            const float ob = __shfl_xor_sync(FULL, best, offset);
            const uint32_t oe = __shfl_xor_sync(FULL, best_e, offset);
            if (oe != FULL && route_better(ob, oe, best, best_e)) {
                best = ob;
                best_e = oe;
            }
        }
        // k <= experts: some entry is still live, so best_e is an expert.
        float w = 0.0f;
#pragma unroll
        for (int j = 0; j < ROUTE_PER_LANE; ++j)
            if (lane + 32 * j == best_e) w = score[j];
        w = __shfl_sync(FULL, w, best_e & 31);
        if (lane == (best_e & 31)) live &= ~(1u << (best_e >> 5));
        if (lane == t) {
            my_id = (int32_t)best_e;
            my_weight = scoring == SCORING_SOFTMAX ? w / sum : w;
        }
    }
    if (renormalize != 0) {
        float total = 0.0f;
        for (uint32_t t = 0; t < k; ++t) total += __shfl_sync(FULL, my_weight, t);
        my_weight = total > 0.0f ? my_weight / total : 0.0f;
    }
    if (lane < k) {
        ids_out[lane] = my_id;
        weights_out[lane] = my_weight * scale;
    }
}

// The routing arguments both routing entries take.
__device__ __forceinline__ bool route_args_ok(uint32_t experts, uint32_t k, uint32_t scoring) {
    return experts != 0 && experts <= MAX_EXPERTS && k != 0 && k <= MAX_TOP_K && k <= experts &&
           scoring <= SCORING_SIGMOID;
}

}  // namespace

// Per row of router logits: scores, the top k, their weights (route_row_warp says how).
// Logits must be finite. Nothing is written when experts > MAX_EXPERTS, k > MAX_TOP_K, k > experts,
// k == 0 or scoring is unknown (the host reference refuses these).
// Launch: grid = ceil(rows / 4), block = 128: warp w of block b takes row 4 b + w.
extern "C" __global__ void __launch_bounds__(ROUTE_THREADS) moe_route(
    int32_t* __restrict__ topk_ids, float* __restrict__ topk_weights,
    const float* __restrict__ logits, const float* __restrict__ correction_bias, uint32_t rows,
    uint32_t experts, uint32_t k, uint32_t scoring, uint32_t renormalize, float scale) {
    metrale::grid_dependency_sync();
    const uint32_t lane = threadIdx.x & 31;
    const uint32_t row = blockIdx.x * (ROUTE_THREADS / 32) + (threadIdx.x >> 5);
    // Warp-uniform exits; the kernel has no block barrier.
    if (row >= rows || !route_args_ok(experts, k, scoring)) return;
    route_row_warp(topk_ids + (size_t)row * k, topk_weights + (size_t)row * k,
                   logits + (size_t)row * experts, correction_bias, experts, k, scoring,
                   renormalize, scale, lane);
}

namespace {

// ---------------------------------------------------------------------------------------------
// Decode: the experts as weight streams.

constexpr int WARPS = 8;
// 16-byte loads a lane has in flight: 4 KiB a warp, as gemv.cu's BATCH.
constexpr int BATCH = 8;

// acc[0] += even products of the 8 bf16 pairs of w and x, acc[1] += the odd ones.
__device__ __forceinline__ void fma8(float (&acc)[2], const uint4& wv, const uint4& xv) {
    const uint32_t w[4] = {wv.x, wv.y, wv.z, wv.w};
    const uint32_t x[4] = {xv.x, xv.y, xv.z, xv.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        acc[0] = fmaf(lo(w[j]), lo(x[j]), acc[0]);
        acc[1] = fmaf(hi(w[j]), hi(x[j]), acc[1]);
    }
}

// The dot of 8 bf16 pairs, from zero.
__device__ __forceinline__ float dot8(const uint4& wv, const uint4& xv) {
    float acc[2] = {0.0f, 0.0f};
    fma8(acc, wv, xv);
    return acc[0] + acc[1];
}

// out[r] = rows[r] . x over n elements, on every lane of the warp, for ROWS rows streamed
// together. Vector path: n % 8 == 0 and every row 16-byte aligned; each round issues
// BATCH / ROWS loads of each row before using any (BATCH in flight a lane either way).
template <int ROWS>
__device__ __forceinline__ void row_dots(float (&out)[ROWS],
                                         const __nv_bfloat16* const (&rows)[ROWS],
                                         const __nv_bfloat16* __restrict__ x, uint32_t n,
                                         uint32_t lane) {
    constexpr int PER = BATCH / ROWS;
    float acc[ROWS][2];
    bool vec = n % 8 == 0 && aligned16(x);
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        acc[r][0] = acc[r][1] = 0.0f;
        vec = vec && aligned16(rows[r]);
    }
    if (vec) {
        const uint32_t chunks = n / 8;
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
                    const uint4 xv = __ldg(x4 + c);
#pragma unroll
                    for (int r = 0; r < ROWS; ++r) fma8(acc[r], wv[r][q], xv);
                }
            }
        }
    } else {
        for (uint32_t i = lane; i < n; i += 32) {
            const float xv = metrale::to_f32(x[i]);
#pragma unroll
            for (int r = 0; r < ROWS; ++r)
                acc[r][0] = fmaf(metrale::to_f32(rows[r][i]), xv, acc[r][0]);
        }
    }
#pragma unroll
    for (int r = 0; r < ROWS; ++r) out[r] = metrale::warp_sum(acc[r][0] + acc[r][1]);
}

// Expert e's weight row for column j's activation row r (0 ..< ROWS) in the stacked w.
template <Act A>
__device__ __forceinline__ const __nv_bfloat16* expert_row(const __nv_bfloat16* w, uint32_t e,
                                                           uint32_t r, uint32_t j, uint32_t inter,
                                                           uint32_t hidden) {
    constexpr uint32_t R = ExpertAct<A>::ROWS;
    return w + ((size_t)e * R * inter + (size_t)r * inter + j) * hidden;
}

// Shared-expert slots of a row: its shared_inter columns in pieces of the routed width (the last
// piece partial).
__device__ __forceinline__ uint32_t shared_slots(const void* shared_w, uint32_t inter,
                                                 uint32_t shared_inter) {
    return shared_w != nullptr && inter != 0 ? (shared_inter + inter - 1) / inter : 0;
}

// The decode experts' first product (moe_gemv_swiglu, moe_gemv_relu2).
template <Act A>
__device__ __forceinline__ void moe_gemv_act(
    __nv_bfloat16* __restrict__ act, const __nv_bfloat16* __restrict__ x,
    const __nv_bfloat16* __restrict__ w, const int32_t* __restrict__ ids,
    __nv_bfloat16* __restrict__ shared_act, const __nv_bfloat16* __restrict__ shared_w,
    uint32_t rows, uint32_t k, uint32_t experts, uint32_t inter, uint32_t hidden,
    uint32_t shared_inter) {
    constexpr int R = ExpertAct<A>::ROWS;
    const uint32_t lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const uint32_t a = blockIdx.x, j = blockIdx.y * WARPS + warp;
    const uint32_t routed = rows * k;
    // Warp-uniform exits; the kernel has no block barrier.
    if (k == 0 || rows == 0 || j >= inter) return;
    if (a >= routed) {
        // A shared-expert slot: a = routed + p * rows + r takes columns p * inter + j of row r
        // (the rows of one piece adjacent, as the routed assignments of one column block are).
        const uint32_t sa = a - routed, r = sa % rows, col = (sa / rows) * inter + j;
        if (sa >= rows * shared_slots(shared_w, inter, shared_inter) || col >= shared_inter)
            return;
        const __nv_bfloat16* wr[R];
#pragma unroll
        for (int q = 0; q < R; ++q) wr[q] = expert_row<A>(shared_w, 0, q, col, shared_inter, hidden);
        float v[R];
        row_dots<R>(v, wr, x + (size_t)r * hidden, hidden, lane);
        if (lane == 0)
            shared_act[(size_t)r * shared_inter + col] = metrale::to_bf16(ExpertAct<A>::of(v));
        return;
    }
    const int32_t e = ids[a];
    __nv_bfloat16* out = act + (size_t)a * inter + j;
    if (!valid_expert(e, experts)) {
        if (lane == 0) *out = metrale::to_bf16(0.0f);
        return;
    }
    const __nv_bfloat16* wr[R];
#pragma unroll
    for (int r = 0; r < R; ++r) wr[r] = expert_row<A>(w, (uint32_t)e, r, j, inter, hidden);
    float v[R];
    row_dots<R>(v, wr, x + (size_t)(a / k) * hidden, hidden, lane);
    if (lane == 0) *out = metrale::to_bf16(ExpertAct<A>::of(v));
}

// ---------------------------------------------------------------------------------------------
// Decode routing in one launch.

// Rows moe_router takes: its last block routes one row a warp. Must match MOE_ROUTER_MAX_ROWS in
// ops/moe/router.rs.
constexpr uint32_t ROUTER_MAX_ROWS = 8;
constexpr uint32_t ROUTER_WARPS = ROUTER_MAX_ROWS;

// out[r] = x[r] . wr over n elements for every row r < rows (at most ROUTER_MAX_ROWS; x is
// [rows, n]), on every lane: the weight row streamed once with BATCH loads a lane in flight, the
// rows' activations through L1. Vector path: n % 8 == 0 and x, wr 16-byte aligned.
__device__ __forceinline__ void router_dots(float (&out)[ROUTER_MAX_ROWS],
                                            const __nv_bfloat16* __restrict__ wr,
                                            const __nv_bfloat16* __restrict__ x, uint32_t rows,
                                            uint32_t n, uint32_t lane) {
    float acc[ROUTER_MAX_ROWS][2];
#pragma unroll
    for (uint32_t r = 0; r < ROUTER_MAX_ROWS; ++r) acc[r][0] = acc[r][1] = 0.0f;
    if (n % 8 == 0 && aligned16(x) && aligned16(wr)) {
        const uint32_t chunks = n / 8;
        const uint4* w4 = reinterpret_cast<const uint4*>(wr);
        const uint4* x4 = reinterpret_cast<const uint4*>(x);
        const uint4 zero = make_uint4(0, 0, 0, 0);
        for (uint32_t i = 0; i < chunks; i += 32 * BATCH) {
            uint4 wv[BATCH];
#pragma unroll
            for (int q = 0; q < BATCH; ++q) {
                const uint32_t c = i + lane + 32 * q;
                wv[q] = c < chunks ? load_stream(w4 + c) : zero;
            }
#pragma unroll
            for (int q = 0; q < BATCH; ++q) {
                const uint32_t c = i + lane + 32 * q;
                if (c < chunks) {
#pragma unroll
                    for (uint32_t r = 0; r < ROUTER_MAX_ROWS; ++r)
                        if (r < rows) fma8(acc[r], wv[q], __ldg(x4 + (size_t)r * chunks + c));
                }
            }
        }
    } else {
        for (uint32_t i = lane; i < n; i += 32) {
            const float wv = metrale::to_f32(wr[i]);
#pragma unroll
            for (uint32_t r = 0; r < ROUTER_MAX_ROWS; ++r)
                if (r < rows) acc[r][0] = fmaf(wv, metrale::to_f32(x[(size_t)r * n + i]), acc[r][0]);
        }
    }
#pragma unroll
    for (uint32_t r = 0; r < ROUTER_MAX_ROWS; ++r) out[r] = metrale::warp_sum(acc[r][0] + acc[r][1]);
}

}  // namespace

// The router of a decode step in one launch: logits[r, e] = x[r] . w[e] (f32, as the f32-output
// GEMV computes them), shared_logit[r] = x[r] . shared_gate_w where a shared expert's gate is
// given (Qwen2-MoE, Qwen3-Next, Qwen3.5; its sigmoid is taken where the gate is applied), then
// each row's routing as moe_route computes it from those logits (route_row_warp). Every block
// computes 8 of the E (+ 1) columns for every row, one warp a column streaming its weight row
// once; the last block to finish (counted in `counter`, which it sets back to zero, so the next
// launch and a graph replay find it zero) routes the rows, one warp a row, reading the logits
// the other blocks wrote. counter must be zero before the first launch.
// Nothing is written when rows is 0 or above ROUTER_MAX_ROWS, or the routing arguments are ones
// moe_route refuses (the host reference refuses these).
// Launch: grid = ceil((E + (shared_gate_w ? 1 : 0)) / 8), block = 256.
extern "C" __global__ void __launch_bounds__(ROUTER_WARPS * 32) moe_router(
    int32_t* __restrict__ topk_ids, float* __restrict__ topk_weights, float* logits,
    float* __restrict__ shared_logit, uint32_t* __restrict__ counter,
    const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ w,
    const __nv_bfloat16* __restrict__ shared_gate_w, const float* __restrict__ correction_bias,
    uint32_t rows, uint32_t experts, uint32_t k, uint32_t scoring, uint32_t renormalize,
    float scale, uint32_t hidden) {
    __shared__ bool is_last;
    metrale::grid_dependency_sync();
    // Grid-uniform exits, before the count: every block takes part or none does.
    if (rows == 0 || rows > ROUTER_MAX_ROWS || !route_args_ok(experts, k, scoring) ||
        blockDim.x != ROUTER_WARPS * 32)
        return;
    const uint32_t lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const uint32_t column = blockIdx.x * ROUTER_WARPS + warp;
    const uint32_t columns = experts + (shared_gate_w != nullptr ? 1u : 0u);
    if (column < columns) {
        const __nv_bfloat16* wr =
            column < experts ? w + (size_t)column * hidden : shared_gate_w;
        float dots[ROUTER_MAX_ROWS];
        router_dots(dots, wr, x, rows, hidden, lane);
        if (lane == 0) {
#pragma unroll
            for (uint32_t r = 0; r < ROUTER_MAX_ROWS; ++r) {
                if (r >= rows) break;
                if (column < experts)
                    logits[(size_t)r * experts + column] = dots[r];
                else
                    shared_logit[r] = dots[r];
            }
        }
    }
    // This block's logits are visible before it is counted; the last block sees every block's.
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) is_last = atomicAdd(counter, 1u) == gridDim.x - 1;
    __syncthreads();
    if (!is_last) return;
    __threadfence();
    if (warp < rows)
        route_row_warp(topk_ids + (size_t)warp * k, topk_weights + (size_t)warp * k,
                       logits + (size_t)warp * experts, correction_bias, experts, k, scoring,
                       renormalize, scale, lane);
    if (threadIdx.x == 0) *counter = 0;  // ready for the next launch
}

// act[a, j] = bf16(silu(g) * u) for every assignment a = r * k + s of expert e = ids[a], with
// g = x[r] . w[e, j] and u = x[r] . w[e, inter + j] each rounded to bf16 first (the bits of a
// bf16 gate|up product followed by silu_mul_bf16). An assignment with no expert gets zeros.
// Rows that chose the same expert each read its weights (from L2 when their blocks run together:
// a block's neighbours in launch order are the other assignments' blocks of the same columns).
// With a shared expert (shared_w non-null: its gate|up [2 shared_inter, hidden], gate rows
// first) every row also takes it in extra slots after the routed assignments, each of at most
// inter of its columns: shared_act[r, c] = the same function of shared_w's rows c and
// shared_inter + c (the bits of the shared expert's own gate|up product and silu_mul_bf16).
// Launch: grid = (rows * (k + ceil(shared_inter / inter)), ceil(inter / 8)) (no shared slots
// where shared_w is null), block = 256: warp w of block (a, b) computes column 8 b + w of slot a,
// streaming its gate row and its up row together.
extern "C" __global__ void __launch_bounds__(256, 3) moe_gemv_swiglu(
    __nv_bfloat16* __restrict__ act, const __nv_bfloat16* __restrict__ x,
    const __nv_bfloat16* __restrict__ w, const int32_t* __restrict__ ids,
    __nv_bfloat16* __restrict__ shared_act, const __nv_bfloat16* __restrict__ shared_w,
    uint32_t rows, uint32_t k, uint32_t experts, uint32_t inter, uint32_t hidden,
    uint32_t shared_inter) {
    metrale::grid_dependency_sync();
    moe_gemv_act<Act::SwiGlu>(act, x, w, ids, shared_act, shared_w, rows, k, experts, inter,
                              hidden, shared_inter);
}

// act[a, j] = bf16(relu(u)^2) for every assignment a = r * k + s of expert e = ids[a], with
// u = x[r] . w[e, j] rounded to bf16 first (the bits of a bf16 up product followed by relu2_bf16);
// w is the squared-ReLU experts' up stack [E, inter, hidden], shared_w the shared expert's up
// rows [shared_inter, hidden] (Nemotron-H's, ungated). Otherwise moe_gemv_swiglu: zeros for an
// assignment with no expert, the shared slots, the same launch, a warp streaming its one up row.
extern "C" __global__ void __launch_bounds__(256, 3) moe_gemv_relu2(
    __nv_bfloat16* __restrict__ act, const __nv_bfloat16* __restrict__ x,
    const __nv_bfloat16* __restrict__ w, const int32_t* __restrict__ ids,
    __nv_bfloat16* __restrict__ shared_act, const __nv_bfloat16* __restrict__ shared_w,
    uint32_t rows, uint32_t k, uint32_t experts, uint32_t inter, uint32_t hidden,
    uint32_t shared_inter) {
    metrale::grid_dependency_sync();
    moe_gemv_act<Act::Relu2>(act, x, w, ids, shared_act, shared_w, rows, k, experts, inter,
                             hidden, shared_inter);
}

// out[r, h] = bf16(sum over slots s of weights[r, s] * (act[r k + s] . w[ids[r, s], h])
// + g_r * (shared_act[r] . shared_w[h]) + g_r * shared[r, h]), f32 throughout: the expert outputs
// are not rounded before they are weighted and added. The shared expert (Qwen2-MoE, Qwen3-Next,
// Qwen3.5 behind its sigmoid gate; Nemotron-H ungated) comes in one of two forms: as extra slots
// of this launch (shared_w non-null: its down weight [hidden, shared_inter] and moe_gemv_swiglu's
// or moe_gemv_relu2's shared_act [rows, shared_inter]; its output is not rounded either), or as
// its output computed by the dense products (shared non-null: bf16, added last). Its gate
// g_r = sigmoid(shared_gate[r]) is taken here (shared_gate null: g_r = 1). A warp computes one
// output as a single dot over the k slots' rows and the shared expert's row laid end to end
// (k * inter + shared_inter elements, each 16-byte chunk's partial dot scaled by its slot's
// weight), so every warp streams all of its row's experts: k * inter * 2 bytes (12 KiB for
// Qwen3-30B-A3B) and shared_inter * 2 more. Slots with no expert add nothing and are not read.
// The order of the sum is fixed by the shape (deterministic). Output bf16: the MLP's output as
// the dense down product gives it, which the next residual add + norm takes.
// Launch: grid = (ceil(hidden / 8), rows), block = 256: warp w of block (b, r) computes column
// 8 b + w of row r. rows <= 65535.
extern "C" __global__ void __launch_bounds__(256, 3) moe_gemv_down(
    __nv_bfloat16* __restrict__ out, const __nv_bfloat16* __restrict__ act,
    const __nv_bfloat16* __restrict__ w, const int32_t* __restrict__ ids,
    const float* __restrict__ weights, const __nv_bfloat16* __restrict__ shared,
    const float* __restrict__ shared_gate, const __nv_bfloat16* __restrict__ shared_act,
    const __nv_bfloat16* __restrict__ shared_w, uint32_t rows, uint32_t k, uint32_t experts,
    uint32_t hidden, uint32_t inter, uint32_t shared_inter) {
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
    // The shared expert's slots, where this launch computes them: its gate, activations and row.
    const bool slots = shared_w != nullptr;
    const float g = shared_gate != nullptr ? 1.0f / (1.0f + expf(-shared_gate[r])) : 1.0f;
    const uint32_t shared_n = slots ? shared_inter : 0;
    const __nv_bfloat16* shared_row = shared_act + (size_t)r * shared_n;
    const __nv_bfloat16* shared_wr = shared_w + (size_t)h * shared_n;
    const __nv_bfloat16* act_row = act + (size_t)r * k * inter;
    const bool vec = inter % 8 == 0 && aligned16(act) && aligned16(w) &&
                     (!slots || (shared_n % 8 == 0 && aligned16(shared_act) && aligned16(shared_w)));
    float acc[2] = {0.0f, 0.0f};
    if (vec) {
        const uint32_t row_chunks = inter / 8, routed = k * row_chunks;
        const uint32_t chunks = routed + shared_n / 8;
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
                const uint4* src = nullptr;
                if (c < routed && es[q] >= 0)
                    src = reinterpret_cast<const uint4*>(w + ((size_t)es[q] * hidden + h) * inter) +
                          (c - s * row_chunks);
                else if (c >= routed && c < chunks)
                    src = reinterpret_cast<const uint4*>(shared_wr) + (c - routed);
                wv[q] = src != nullptr ? load_stream(src) : zero;
            }
#pragma unroll
            for (int q = 0; q < BATCH; ++q) {
                const uint32_t c = i + lane + 32 * q;
                const uint32_t s = min(c / row_chunks, k - 1);
                const float ws = __shfl_sync(FULL, my_w, s);
                if (c < routed && es[q] >= 0) {
                    const uint4 av = __ldg(reinterpret_cast<const uint4*>(act_row) + c);
                    acc[q & 1] = fmaf(ws, dot8(wv[q], av), acc[q & 1]);
                } else if (c >= routed && c < chunks) {
                    const uint4 av = __ldg(reinterpret_cast<const uint4*>(shared_row) + (c - routed));
                    acc[q & 1] = fmaf(g, dot8(wv[q], av), acc[q & 1]);
                }
            }
        }
    } else {
        for (uint32_t s = 0; s < k; ++s) {
            const int32_t e = __shfl_sync(FULL, my_e, s);
            const float ws = __shfl_sync(FULL, my_w, s);
            if (e < 0) continue;  // warp-uniform
            const __nv_bfloat16* wr = w + ((size_t)e * hidden + h) * inter;
            const __nv_bfloat16* ar = act_row + (size_t)s * inter;
            float part = 0.0f;
            for (uint32_t i = lane; i < inter; i += 32)
                part = fmaf(metrale::to_f32(wr[i]), metrale::to_f32(ar[i]), part);
            acc[0] = fmaf(ws, part, acc[0]);
        }
        float part = 0.0f;
        for (uint32_t i = lane; i < shared_n; i += 32)
            part = fmaf(metrale::to_f32(shared_wr[i]), metrale::to_f32(shared_row[i]), part);
        acc[1] = fmaf(g, part, acc[1]);
    }
    const float sum = metrale::warp_sum(acc[0] + acc[1]);
    if (lane == 0)
        out[(size_t)r * hidden + h] =
            metrale::to_bf16(add_shared(sum, shared, shared_gate, r, h, hidden));
}

namespace {

// ---------------------------------------------------------------------------------------------
// Prefill: grouping by expert.

constexpr uint32_t GROUP_WARPS = 16;

}  // namespace

// Groups the n = m k assignments by expert: offsets[e] = the first position of expert e's
// assignments (offsets[E] = the assignments that have an expert), and sorted[offsets[e] ..
// offsets[e + 1]) = expert e's assignments a = r k + s in increasing order (so by token); sorted
// past offsets[E] is -1. No atomics on the result: each warp takes a contiguous run of the
// assignments, counts them per expert in its own histogram, and places them in order, so the
// output is the same on every run.
// Launch: grid = 1, block = 512 (GROUP_WARPS warps). experts <= MAX_EXPERTS (else nothing is
// written).
extern "C" __global__ void __launch_bounds__(GROUP_WARPS * 32) moe_group(
    int32_t* __restrict__ offsets, int32_t* __restrict__ sorted, const int32_t* __restrict__ ids,
    uint32_t n, uint32_t experts) {
    // Warp w's count (then cursor) of expert e at hist[w][e]; the experts' first positions.
    __shared__ int32_t hist[GROUP_WARPS][MAX_EXPERTS];
    __shared__ int32_t start[MAX_EXPERTS + 1];
    metrale::grid_dependency_sync();
    if (blockIdx.x != 0 || experts == 0 || experts > MAX_EXPERTS || blockDim.x != GROUP_WARPS * 32)
        return;
    const uint32_t lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (uint32_t i = threadIdx.x; i < GROUP_WARPS * MAX_EXPERTS; i += blockDim.x)
        (&hist[0][0])[i] = 0;
    __syncthreads();
    const uint32_t per = (n + GROUP_WARPS - 1) / GROUP_WARPS;
    const uint32_t begin = min(warp * per, n), end = min(begin + per, n);
    for (uint32_t i = begin + lane; i < end; i += 32) {
        const int32_t e = ids[i];
        if (valid_expert(e, experts)) atomicAdd(&hist[warp][e], 1);  // a count: any order
    }
    __syncthreads();
    // Per expert: the warps' counts become exclusive prefixes over the warps; start[e] = total.
    for (uint32_t e = threadIdx.x; e < experts; e += blockDim.x) {
        int32_t run = 0;
        for (uint32_t q = 0; q < GROUP_WARPS; ++q) {
            const int32_t c = hist[q][e];
            hist[q][e] = run;
            run += c;
        }
        start[e] = run;
    }
    __syncthreads();
    // Exclusive scan of the totals over the experts: warp 0, a run of experts a lane.
    if (warp == 0) {
        const uint32_t each = (experts + 31) / 32;
        const uint32_t e0 = min(lane * each, experts), e1 = min(e0 + each, experts);
        int32_t local = 0;
        for (uint32_t e = e0; e < e1; ++e) local += start[e];
        int32_t inclusive = local;
#pragma unroll
        for (int offset = 1; offset < 32; offset <<= 1) {
            const int32_t v = __shfl_up_sync(FULL, inclusive, offset);
            if ((int)lane >= offset) inclusive += v;
        }
        int32_t at = inclusive - local;
        for (uint32_t e = e0; e < e1; ++e) {
            const int32_t c = start[e];
            start[e] = at;
            offsets[e] = at;
            at += c;
        }
        if (lane == 31) {
            start[experts] = inclusive;
            offsets[experts] = inclusive;
        }
    }
    __syncthreads();
    // Placement, each warp over its run in order: lanes with the same expert rank among
    // themselves by lane, and the group's lowest lane moves the warp's cursor for that expert.
    for (uint32_t base = begin; base < end; base += 32) {
        const uint32_t i = base + lane;
        const int32_t raw = i < end ? ids[i] : -1;
        const bool ok = i < end && valid_expert(raw, experts);
        const int32_t e = ok ? raw : -1;
        const uint32_t same = __match_any_sync(FULL, e);
        const uint32_t rank = __popc(same & ((1u << lane) - 1));
        if (ok) sorted[start[e] + hist[warp][e] + (int32_t)rank] = (int32_t)i;
        __syncwarp();
        if (ok && rank == 0) hist[warp][e] += __popc(same);
        __syncwarp();
    }
    for (uint32_t i = (uint32_t)start[experts] + threadIdx.x; i < n; i += blockDim.x) sorted[i] = -1;
}

namespace {

// ---------------------------------------------------------------------------------------------
// Decode batches: the grouped products as weight streams. At 16 to a few hundred rows an expert
// has a handful of rows (64 rows of top 8 of 128: 4 on average), far from a tensor-core tile; the
// step is the stream of the touched experts' weights. A warp holds one output column of one
// expert and streams its weight row once per GROUP_ROWS of the expert's rows, their partial dots
// in registers. Untouched experts' blocks return before reading anything.

// Rows of an expert a warp carries per pass over its weight row.
constexpr int GROUP_ROWS = 8;

}  // namespace

namespace {

// The grouped weight-stream first product (moe_grouped_gemv_swiglu, moe_grouped_gemv_relu2).
template <Act A>
__device__ __forceinline__ void moe_grouped_gemv_act(
    __nv_bfloat16* __restrict__ act, const __nv_bfloat16* __restrict__ x,
    const __nv_bfloat16* __restrict__ w, const int32_t* __restrict__ offsets,
    const int32_t* __restrict__ sorted, uint32_t k, uint32_t experts, uint32_t inter,
    uint32_t hidden) {
    constexpr int R = ExpertAct<A>::ROWS;
    const uint32_t lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const uint32_t e = blockIdx.y, j = blockIdx.x * WARPS + warp;
    // Warp-uniform exits; the kernel has no block barrier.
    if (e >= experts || k == 0 || j >= inter) return;
    const int32_t begin = offsets[e], end = offsets[e + 1];
    if (begin >= end) return;
    const __nv_bfloat16* wr[R];
    bool vec = hidden % 8 == 0 && aligned16(x);
#pragma unroll
    for (int r = 0; r < R; ++r) {
        wr[r] = expert_row<A>(w, e, r, j, inter, hidden);
        vec = vec && aligned16(wr[r]);
    }
    for (int32_t p0 = begin; p0 < end; p0 += GROUP_ROWS) {
        const int np = min(GROUP_ROWS, end - p0);
        const __nv_bfloat16* xr[GROUP_ROWS];
#pragma unroll
        for (int i = 0; i < GROUP_ROWS; ++i)
            xr[i] = x + (size_t)((uint32_t)sorted[p0 + min(i, np - 1)] / k) * hidden;
        float acc[R][GROUP_ROWS];
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
            for (int i = 0; i < GROUP_ROWS; ++i) acc[r][i] = 0.0f;
        if (vec) {
            constexpr int PER = BATCH / R;
            const uint32_t chunks = hidden / 8;
            const uint4 zero = make_uint4(0, 0, 0, 0);
            for (uint32_t c0 = 0; c0 < chunks; c0 += 32 * PER) {
                uint4 wv[R][PER];
#pragma unroll
                for (int q = 0; q < PER; ++q) {
                    const uint32_t c = c0 + lane + 32 * q;
#pragma unroll
                    for (int r = 0; r < R; ++r)
                        wv[r][q] = c < chunks ? load_stream(reinterpret_cast<const uint4*>(wr[r]) + c)
                                              : zero;
                }
#pragma unroll
                for (int q = 0; q < PER; ++q) {
                    const uint32_t c = c0 + lane + 32 * q;
                    if (c >= chunks) continue;
#pragma unroll
                    for (int i = 0; i < GROUP_ROWS; ++i) {
                        if (i >= np) break;
                        const uint4 xv = __ldg(reinterpret_cast<const uint4*>(xr[i]) + c);
#pragma unroll
                        for (int r = 0; r < R; ++r) acc[r][i] += dot8(wv[r][q], xv);
                    }
                }
            }
        } else {
            for (uint32_t c = lane; c < hidden; c += 32) {
                float wv[R];
#pragma unroll
                for (int r = 0; r < R; ++r) wv[r] = metrale::to_f32(wr[r][c]);
#pragma unroll
                for (int i = 0; i < GROUP_ROWS; ++i) {
                    if (i >= np) break;
                    const float xv = metrale::to_f32(xr[i][c]);
#pragma unroll
                    for (int r = 0; r < R; ++r) acc[r][i] = fmaf(wv[r], xv, acc[r][i]);
                }
            }
        }
#pragma unroll
        for (int i = 0; i < GROUP_ROWS; ++i) {
            if (i >= np) break;
            float v[R];
#pragma unroll
            for (int r = 0; r < R; ++r) v[r] = metrale::warp_sum(acc[r][i]);
            if (lane == 0)
                act[(size_t)(p0 + i) * inter + j] = metrale::to_bf16(ExpertAct<A>::of(v));
        }
    }
}

}  // namespace

// moe_gemm_swiglu's output (act[p] for every position p of every expert's slice, in expert
// order, the same bits but for the order of the f32 sums), for few rows per expert.
// Launch: grid = (ceil(inter / 8), experts), block = 256: warp w of block (b, e) computes column
// 8 b + w of expert e for all its positions, streaming its gate and up rows once per 8 positions.
extern "C" __global__ void __launch_bounds__(256) moe_grouped_gemv_swiglu(
    __nv_bfloat16* __restrict__ act, const __nv_bfloat16* __restrict__ x,
    const __nv_bfloat16* __restrict__ w, const int32_t* __restrict__ offsets,
    const int32_t* __restrict__ sorted, uint32_t k, uint32_t experts, uint32_t inter,
    uint32_t hidden) {
    metrale::grid_dependency_sync();
    moe_grouped_gemv_act<Act::SwiGlu>(act, x, w, offsets, sorted, k, experts, inter, hidden);
}

// moe_gemm_relu2's output for few rows per expert: moe_grouped_gemv_swiglu's launch with one up
// row a column (w: [E, inter, hidden]).
extern "C" __global__ void __launch_bounds__(256) moe_grouped_gemv_relu2(
    __nv_bfloat16* __restrict__ act, const __nv_bfloat16* __restrict__ x,
    const __nv_bfloat16* __restrict__ w, const int32_t* __restrict__ offsets,
    const int32_t* __restrict__ sorted, uint32_t k, uint32_t experts, uint32_t inter,
    uint32_t hidden) {
    metrale::grid_dependency_sync();
    moe_grouped_gemv_act<Act::Relu2>(act, x, w, offsets, sorted, k, experts, inter, hidden);
}

// moe_gemm_down's output (y[sorted[p], h] = bf16(act[p] . w[e, h]) for every position p of every
// expert's slice, the same bits but for the order of the f32 sums), for few rows per expert.
// Launch: grid = (ceil(hidden / 8), experts), block = 256: warp w of block (b, e) computes column
// 8 b + w of expert e for all its positions, streaming its down row once per 8 positions.
extern "C" __global__ void __launch_bounds__(256) moe_grouped_gemv_down(
    __nv_bfloat16* __restrict__ y, const __nv_bfloat16* __restrict__ act,
    const __nv_bfloat16* __restrict__ w, const int32_t* __restrict__ offsets,
    const int32_t* __restrict__ sorted, uint32_t experts, uint32_t hidden, uint32_t inter) {
    metrale::grid_dependency_sync();
    const uint32_t lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const uint32_t e = blockIdx.y, h = blockIdx.x * WARPS + warp;
    if (e >= experts || h >= hidden) return;
    const int32_t begin = offsets[e], end = offsets[e + 1];
    if (begin >= end) return;
    const __nv_bfloat16* row = w + ((size_t)e * hidden + h) * inter;
    const bool vec = inter % 8 == 0 && aligned16(row) && aligned16(act);
    for (int32_t p0 = begin; p0 < end; p0 += GROUP_ROWS) {
        const int np = min(GROUP_ROWS, end - p0);
        const __nv_bfloat16* ar = act + (size_t)p0 * inter;
        float acc[GROUP_ROWS];
#pragma unroll
        for (int i = 0; i < GROUP_ROWS; ++i) acc[i] = 0.0f;
        if (vec) {
            const uint32_t chunks = inter / 8;
            const uint4* w4 = reinterpret_cast<const uint4*>(row);
            const uint4* a4 = reinterpret_cast<const uint4*>(ar);
            const uint4 zero = make_uint4(0, 0, 0, 0);
            for (uint32_t c0 = 0; c0 < chunks; c0 += 32 * BATCH) {
                uint4 wv[BATCH];
#pragma unroll
                for (int q = 0; q < BATCH; ++q) {
                    const uint32_t c = c0 + lane + 32 * q;
                    wv[q] = c < chunks ? load_stream(w4 + c) : zero;
                }
#pragma unroll
                for (int q = 0; q < BATCH; ++q) {
                    const uint32_t c = c0 + lane + 32 * q;
                    if (c >= chunks) continue;
#pragma unroll
                    for (int i = 0; i < GROUP_ROWS; ++i) {
                        if (i >= np) break;
                        acc[i] += dot8(wv[q], __ldg(a4 + (size_t)i * chunks + c));
                    }
                }
            }
        } else {
            for (uint32_t c = lane; c < inter; c += 32) {
                const float wv = metrale::to_f32(row[c]);
#pragma unroll
                for (int i = 0; i < GROUP_ROWS; ++i) {
                    if (i >= np) break;
                    acc[i] = fmaf(wv, metrale::to_f32(ar[(size_t)i * inter + c]), acc[i]);
                }
            }
        }
#pragma unroll
        for (int i = 0; i < GROUP_ROWS; ++i) {
            if (i >= np) break;
            const float v = metrale::warp_sum(acc[i]);
            if (lane == 0) y[(size_t)sorted[p0 + i] * hidden + h] = metrale::to_bf16(v);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Decode batches on tensor cores: the same products as the weight streams above, with each
// weight element read once and multiplied on the tensor cores (mma.sync m16n8k16, bf16 in, f32
// accumulators) against up to MMA_ROWS of the expert's rows at a time. The weights are the A
// operand (16 output columns a tile), the expert's activation rows the B operand (8 rows a tile,
// missing rows zero). A lane loads its fragments straight from global memory, 16 bytes at a time:
// the dot product does not care which k a fragment slot holds as long as A and B agree, so lane
// (g, t) of a warp takes elements [8 t, 8 t + 8) of every 32-element chunk of its rows (weight
// rows g and g + 8, activation row g) and feeds words 0-1 to one mma and words 2-3 to the next.
// The four lanes of a row read 64 contiguous bytes; no shared memory, no barrier.
// The FP8 forms (moe_grouped_mma_fp8_*) read e4m3 stacks the same way, 16 weights a 16-byte load
// (lane (g, t) takes elements [16 t, 16 t + 16) of every 64), and turn each into bf16(e4m3 x
// scale) in registers before the mmas: the weights the BF16 forms read from the stacks
// dequantised by fp8_dequant_bf16, at half the bytes and without that pass.

namespace {

constexpr int MMA_WARPS = 4;
// n8 tiles a warp holds: rows of an expert per pass over its weights.
constexpr int MMA_ROW_TILES = 4;
constexpr int MMA_ROWS = 8 * MMA_ROW_TILES;
// 32-element chunks of K a lane loads before the first mma of a round: 2 tiles x 2 rows x
// MMA_DEPTH 16-byte weight loads in flight, 8 KiB a warp.
constexpr int MMA_DEPTH = 4;

// d += A (16 x 16) * B (16 x 8), bf16 operands, f32 accumulators; a0..a3 and b0, b1 in the PTX
// fragment order (a0: row g, k 2t; a1: row g + 8, k 2t; a2: row g, k 2t + 8; a3: row g + 8,
// k 2t + 8; b0: k 2t, column g; b1: k 2t + 8, column g).
__device__ __forceinline__ void mma_bf16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                         uint32_t a3, uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Elements [k0, k0 + 8) of `row` (k0 % 8 == 0) as 4 bf16 pairs; zeros past k and for a null row.
// `vec` (k % 8 == 0, the row 16-byte aligned): one 16-byte load, a streaming one for weights.
template <bool STREAM>
__device__ __forceinline__ uint4 load8(const __nv_bfloat16* __restrict__ row, uint32_t k0,
                                       uint32_t k, bool vec) {
    if (row == nullptr || k0 >= k) return make_uint4(0, 0, 0, 0);
    if (vec) {
        const uint4* p = reinterpret_cast<const uint4*>(row + k0);
        return STREAM ? load_stream(p) : __ldg(p);
    }
    uint32_t v[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
        const uint32_t i = k0 + 2 * q;
        const uint32_t l = i < k ? __bfloat16_as_ushort(row[i]) : 0u;
        const uint32_t h = i + 1 < k ? __bfloat16_as_ushort(row[i + 1]) : 0u;
        v[q] = l | (h << 16);
    }
    return make_uint4(v[0], v[1], v[2], v[3]);
}

// bf16(e4m3 x s) of the two e4m3 in the low 16 bits of v (the lower byte in the low half): the
// bits fp8_dequant_bf16 (gemv_fp8.cu) stores, so that an FP8 form multiplies the weights its BF16
// form would read from the dequantised stack.
__device__ __forceinline__ uint32_t e4m3x2_scaled(uint32_t v, float s) {
    const __half2_raw h =
        __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(v & 0xffffu), __NV_E4M3);
    const float2 f = __half22float2(__half2(h));
    const __nv_bfloat162 b = __floats2bfloat162_rn(f.x * s, f.y * s);
    return *reinterpret_cast<const uint32_t*>(&b);
}

// The 8 e4m3 of words lo, hi (lowest byte first) as 4 pairs of bf16(e4m3 x s).
__device__ __forceinline__ uint4 e4m3x8_scaled(uint32_t lo, uint32_t hi, float s) {
    return make_uint4(e4m3x2_scaled(lo, s), e4m3x2_scaled(lo >> 16, s), e4m3x2_scaled(hi, s),
                      e4m3x2_scaled(hi >> 16, s));
}

// A stacked weight [rows, cols] as the grouped tensor-core products read it, bf16 or FP8; each
// hands a lane's rows to a pass (Rows) and says whether its 16-byte path applies.
// - Rows::SPAN: the k elements of a row one 16-byte load holds, handed to the mmas as SPAN / 8
//   pieces of 4 bf16 pairs (Rows::piece);
// - Rows::scales(c0, k): what a round of loads from column c0 needs besides the bytes.
struct Bf16Rows {
    static constexpr uint32_t SPAN = 8;
    const __nv_bfloat16* row[2][2];
    struct Scales {};
    __device__ __forceinline__ Scales scales(uint32_t, uint32_t) const { return {}; }
    template <bool VEC>
    __device__ __forceinline__ uint4 load(int m, int h, uint32_t k0, uint32_t k) const {
        return load8<true>(row[m][h], k0, k, VEC);
    }
    __device__ __forceinline__ uint4 piece(const uint4& raw, const Scales&, int, int, int,
                                           int) const {
        return raw;
    }
};

struct Bf16Stack {
    using Rows = Bf16Rows;
    const __nv_bfloat16* w;
    __device__ __forceinline__ bool vec(uint32_t cols) const {
        return cols % 8 == 0 && aligned16(w);
    }
    __device__ __forceinline__ void set(Rows& r, int m, int h, size_t row, uint32_t cols,
                                        bool valid) const {
        r.row[m][h] = valid ? w + row * cols : nullptr;
    }
};

// FP8 rows: a load is 16 e4m3 of one 128-column scale block (k0 % 16 == 0), each piece turned
// into bf16(e4m3 x scale) in registers. A round of MMA_DEPTH loads from c0 (a multiple of 256)
// spans two scale blocks, whose scales the lane reads once a round (zero past k or for a null
// row; the bytes there are zeros too).
struct Fp8Rows {
    static constexpr uint32_t SPAN = 16;
    const uint8_t* row[2][2];
    const float* scale[2][2];  // the row's scales, one a 128 columns
    struct Scales {
        float s[2][2][2];
    };
    __device__ __forceinline__ Scales scales(uint32_t c0, uint32_t k) const {
        Scales sc;
#pragma unroll
        for (int m = 0; m < 2; ++m)
#pragma unroll
            for (int h = 0; h < 2; ++h)
#pragma unroll
                for (int b = 0; b < 2; ++b) {
                    const uint32_t k0 = c0 + 128 * b;
                    sc.s[m][h][b] =
                        row[m][h] != nullptr && k0 < k ? __ldg(scale[m][h] + k0 / 128) : 0.0f;
                }
        return sc;
    }
    template <bool VEC>
    __device__ __forceinline__ uint4 load(int m, int h, uint32_t k0, uint32_t k) const {
        const uint8_t* r = row[m][h];
        if (r == nullptr || k0 >= k) return make_uint4(0, 0, 0, 0);
        if (VEC) return load_stream(reinterpret_cast<const uint4*>(r + k0));
        uint32_t v[4] = {0u, 0u, 0u, 0u};
#pragma unroll
        for (uint32_t i = 0; i < 16; ++i)
            if (k0 + i < k) v[i / 4] |= (uint32_t)r[k0 + i] << (8 * (i % 4));
        return make_uint4(v[0], v[1], v[2], v[3]);
    }
    // Piece q (weights 8 q ..< 8 q + 8) of load d of a round (columns c0 + 64 d + 16 t ..).
    __device__ __forceinline__ uint4 piece(const uint4& raw, const Scales& sc, int d, int m, int h,
                                           int q) const {
        const float s = sc.s[m][h][d / 2];
        return q == 0 ? e4m3x8_scaled(raw.x, raw.y, s) : e4m3x8_scaled(raw.z, raw.w, s);
    }
};

// e4m3 with f32 scales [ceil(rows / 2^row_shift), ceil(cols / 128)] (moe_fp8.cu's stacks).
struct Fp8Stack {
    using Rows = Fp8Rows;
    const uint8_t* w;
    const float* scales;
    uint32_t row_shift;
    __device__ __forceinline__ bool vec(uint32_t cols) const {
        return cols % 16 == 0 && aligned16(w);
    }
    __device__ __forceinline__ void set(Rows& r, int m, int h, size_t row, uint32_t cols,
                                        bool valid) const {
        r.row[m][h] = valid ? w + row * cols : nullptr;
        r.scale[m][h] = valid ? scales + (row >> row_shift) * ((cols + 127) / 128) : nullptr;
    }
};

// One warp's pass over K: acc[m][n] += W_m (16 x K) * X_n (8 x K)^T for the two weight tiles m and
// the first `tiles` row tiles n (warp-uniform). Lane (g, t) supplies w's rows [m][h], weight row
// g + 8 h of tile m, and x[n], activation row g of tile n (null: zeros); it loads columns
// [SPAN t, SPAN t + SPAN) of every 4 SPAN of them. On return lane (g, t) holds acc[m][n][i] = the
// sum for weight row g + 8 (i >> 1) of tile m and activation row 2 t + (i & 1) of tile n.
template <typename W, bool VEC>
__device__ __forceinline__ void mma_pass_of(float (&acc)[2][MMA_ROW_TILES][4], const W& w,
                                            const __nv_bfloat16* const (&x)[MMA_ROW_TILES],
                                            int tiles, uint32_t k, uint32_t t) {
    constexpr uint32_t CHUNK = 4 * W::SPAN;  // columns one load of a row's four lanes covers
    static_assert(W::SPAN == 8 || CHUNK * MMA_DEPTH == 256, "an FP8 round is two scale blocks");
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int n = 0; n < MMA_ROW_TILES; ++n)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[m][n][i] = 0.0f;
    for (uint32_t c0 = 0; c0 < k; c0 += CHUNK * MMA_DEPTH) {
        uint4 wv[MMA_DEPTH][2][2];
#pragma unroll
        for (int d = 0; d < MMA_DEPTH; ++d)
#pragma unroll
            for (int m = 0; m < 2; ++m)
#pragma unroll
                for (int h = 0; h < 2; ++h)
                    wv[d][m][h] = w.template load<VEC>(m, h, c0 + CHUNK * d + W::SPAN * t, k);
        const typename W::Scales sc = w.scales(c0, k);
#pragma unroll
        for (int d = 0; d < MMA_DEPTH; ++d) {
#pragma unroll
            for (int q = 0; q < (int)W::SPAN / 8; ++q) {
                uint4 a[2][2];
#pragma unroll
                for (int m = 0; m < 2; ++m)
#pragma unroll
                    for (int h = 0; h < 2; ++h) a[m][h] = w.piece(wv[d][m][h], sc, d, m, h, q);
#pragma unroll
                for (int n = 0; n < MMA_ROW_TILES; ++n) {
                    if (n >= tiles) break;
                    const uint4 xv =
                        load8<false>(x[n], c0 + CHUNK * d + W::SPAN * t + 8 * q, k, VEC);
#pragma unroll
                    for (int m = 0; m < 2; ++m) {
                        const uint4 lo = a[m][0], hi = a[m][1];
                        mma_bf16(acc[m][n], lo.x, hi.x, lo.y, hi.y, xv.x, xv.y);
                        mma_bf16(acc[m][n], lo.z, hi.z, lo.w, hi.w, xv.z, xv.w);
                    }
                }
            }
        }
    }
}

// mma_pass_of on the 16-byte path where `vec`, else element by element.
template <typename W>
__device__ __forceinline__ void mma_pass(float (&acc)[2][MMA_ROW_TILES][4], const W& w,
                                         const __nv_bfloat16* const (&x)[MMA_ROW_TILES],
                                         int tiles, uint32_t k, bool vec, uint32_t t) {
    if (vec)
        mma_pass_of<W, true>(acc, w, x, tiles, k, t);
    else
        mma_pass_of<W, false>(acc, w, x, tiles, k, t);
}

}  // namespace

namespace {

// Columns a warp of the grouped tensor-core first product computes: its two 16-row weight tiles
// are one column tile's gate and up rows (SwiGLU), or two column tiles' up rows (ReLU^2).
template <Act A>
__device__ constexpr uint32_t mma_columns() {
    return 32 / ExpertAct<A>::ROWS;
}

// The grouped tensor-core first product (moe_grouped_mma_swiglu, moe_grouped_mma_relu2 and their
// FP8 forms) over the stack w [E ROWS inter, hidden]. Tile m holds activation row m % ROWS of
// column tile m / ROWS.
template <Act A, typename Stack>
__device__ __forceinline__ void moe_grouped_mma_act(
    __nv_bfloat16* __restrict__ act, const __nv_bfloat16* __restrict__ x, const Stack& w,
    const int32_t* __restrict__ offsets, const int32_t* __restrict__ sorted, uint32_t k,
    uint32_t experts, uint32_t inter, uint32_t hidden) {
    constexpr int R = ExpertAct<A>::ROWS;
    const uint32_t lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const uint32_t g = lane >> 2, t = lane & 3;
    const uint32_t e = blockIdx.y, j0 = (blockIdx.x * MMA_WARPS + warp) * mma_columns<A>();
    // Warp-uniform exits; the kernel has no block barrier.
    if (e >= experts || k == 0 || j0 >= inter) return;
    const int32_t begin = offsets[e], end = offsets[e + 1];
    if (begin >= end) return;
    const bool vec = w.vec(hidden) && aligned16(x);
    typename Stack::Rows wr;
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const uint32_t j = j0 + 16 * (m / R) + g + 8 * h;
            w.set(wr, m, h, ((size_t)e * R + m % R) * inter + j, hidden, j < inter);
        }
    for (int32_t p0 = begin; p0 < end; p0 += MMA_ROWS) {
        const int np = min(MMA_ROWS, end - p0);
        const __nv_bfloat16* xr[MMA_ROW_TILES];
#pragma unroll
        for (int n = 0; n < MMA_ROW_TILES; ++n) {
            const int i = 8 * n + (int)g;
            xr[n] = i < np ? x + (size_t)((uint32_t)sorted[p0 + i] / k) * hidden : nullptr;
        }
        float acc[2][MMA_ROW_TILES][4];
        mma_pass(acc, wr, xr, (np + 7) / 8, hidden, vec, t);
#pragma unroll
        for (int n = 0; n < MMA_ROW_TILES; ++n)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int r = 8 * n + 2 * (int)t + (i & 1);
#pragma unroll
                for (int c = 0; c < 2 / R; ++c) {
                    const uint32_t j = j0 + 16 * c + g + 8 * (i >> 1);
                    float v[R];
#pragma unroll
                    for (int q = 0; q < R; ++q) v[q] = acc[c * R + q][n][i];
                    if (r < np && j < inter)
                        act[(size_t)(p0 + r) * inter + j] = metrale::to_bf16(ExpertAct<A>::of(v));
                }
            }
    }
}

// The grouped tensor-core down product (moe_grouped_mma_down and its FP8 form) over the stack
// w [E hidden, inter].
template <typename Stack>
__device__ __forceinline__ void moe_grouped_mma_down_of(
    __nv_bfloat16* __restrict__ y, const __nv_bfloat16* __restrict__ act, const Stack& w,
    const int32_t* __restrict__ offsets, const int32_t* __restrict__ sorted, uint32_t experts,
    uint32_t hidden, uint32_t inter) {
    const uint32_t lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const uint32_t g = lane >> 2, t = lane & 3;
    const uint32_t e = blockIdx.y, h0 = (blockIdx.x * MMA_WARPS + warp) * 32;
    if (e >= experts || h0 >= hidden) return;
    const int32_t begin = offsets[e], end = offsets[e + 1];
    if (begin >= end) return;
    const bool vec = w.vec(inter) && aligned16(act);
    typename Stack::Rows wr;
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const uint32_t c = h0 + 16 * m + g + 8 * h;
            w.set(wr, m, h, (size_t)e * hidden + c, inter, c < hidden);
        }
    for (int32_t p0 = begin; p0 < end; p0 += MMA_ROWS) {
        const int np = min(MMA_ROWS, end - p0);
        const __nv_bfloat16* ar[MMA_ROW_TILES];
#pragma unroll
        for (int n = 0; n < MMA_ROW_TILES; ++n) {
            const int i = 8 * n + (int)g;
            ar[n] = i < np ? act + (size_t)(p0 + i) * inter : nullptr;
        }
        float acc[2][MMA_ROW_TILES][4];
        mma_pass(acc, wr, ar, (np + 7) / 8, inter, vec, t);
#pragma unroll
        for (int n = 0; n < MMA_ROW_TILES; ++n)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int r = 8 * n + 2 * (int)t + (i & 1);
                if (r >= np) continue;
                const size_t a = (size_t)sorted[p0 + r];
#pragma unroll
                for (int m = 0; m < 2; ++m) {
                    const uint32_t c = h0 + 16 * m + g + 8 * (i >> 1);
                    if (c < hidden) y[a * hidden + c] = metrale::to_bf16(acc[m][n][i]);
                }
            }
    }
}

}  // namespace

// moe_grouped_gemv_swiglu's output (act[p] for every position p of every expert's slice, in
// expert order; the same values but for the order of the f32 sums) on tensor cores.
// Launch: grid = (ceil(inter / 64), experts), block = 128: warp w of block (b, e) computes
// columns [64 b + 16 w, 64 b + 16 w + 16) of expert e (a gate tile and its up tile) for 32 of
// the expert's positions a pass, reading those 32 weight rows once a pass.
extern "C" __global__ void __launch_bounds__(MMA_WARPS * 32) moe_grouped_mma_swiglu(
    __nv_bfloat16* __restrict__ act, const __nv_bfloat16* __restrict__ x,
    const __nv_bfloat16* __restrict__ w, const int32_t* __restrict__ offsets,
    const int32_t* __restrict__ sorted, uint32_t k, uint32_t experts, uint32_t inter,
    uint32_t hidden) {
    metrale::grid_dependency_sync();
    moe_grouped_mma_act<Act::SwiGlu>(act, x, Bf16Stack{w}, offsets, sorted, k, experts, inter,
                                     hidden);
}

// moe_grouped_gemv_relu2's output on tensor cores (w: [E, inter, hidden]).
// Launch: grid = (ceil(inter / 128), experts), block = 128: warp w of block (b, e) computes
// columns [128 b + 32 w, 128 b + 32 w + 32) of expert e (two tiles of 16 up rows) for 32 of the
// expert's positions a pass.
extern "C" __global__ void __launch_bounds__(MMA_WARPS * 32) moe_grouped_mma_relu2(
    __nv_bfloat16* __restrict__ act, const __nv_bfloat16* __restrict__ x,
    const __nv_bfloat16* __restrict__ w, const int32_t* __restrict__ offsets,
    const int32_t* __restrict__ sorted, uint32_t k, uint32_t experts, uint32_t inter,
    uint32_t hidden) {
    metrale::grid_dependency_sync();
    moe_grouped_mma_act<Act::Relu2>(act, x, Bf16Stack{w}, offsets, sorted, k, experts, inter,
                                    hidden);
}

// moe_grouped_gemv_down's output (y[sorted[p], h] = bf16(act[p] . w[e, h]) for every position p
// of every expert's slice) on tensor cores.
// Launch: grid = (ceil(hidden / 128), experts), block = 128: warp w of block (b, e) computes
// columns [128 b + 32 w, 128 b + 32 w + 32) of expert e (two tiles of 16) for 32 of the expert's
// positions a pass, reading those 32 down rows once a pass.
extern "C" __global__ void __launch_bounds__(MMA_WARPS * 32) moe_grouped_mma_down(
    __nv_bfloat16* __restrict__ y, const __nv_bfloat16* __restrict__ act,
    const __nv_bfloat16* __restrict__ w, const int32_t* __restrict__ offsets,
    const int32_t* __restrict__ sorted, uint32_t experts, uint32_t hidden, uint32_t inter) {
    metrale::grid_dependency_sync();
    moe_grouped_mma_down_of(y, act, Bf16Stack{w}, offsets, sorted, experts, hidden, inter);
}

// The FP8 forms: moe_grouped_mma_swiglu, _relu2 and _down over e4m3 stacks with f32 scales
// (moe_fp8.cu's layout: each stack one [rows, cols] FP8 matrix, scales [ceil(rows /
// 2^row_shift), ceil(cols / 128)]), each weight taken as bf16(e4m3 x scale), the bits
// fp8_dequant_bf16 writes: the values of the BF16 forms over the dequantised stacks, f32 sums in
// another order (a lane's 16-byte load holds 16 weights, so the mmas group K differently). The
// same launches; the 16-byte path needs the K width a multiple of 16 (else element by element).
// The register file is theirs (~194 registers, two blocks an SM: 64 KiB of e4m3 in flight): left
// to itself ptxas fits the SwiGLU form in 168 and spills.
extern "C" __global__ void __launch_bounds__(MMA_WARPS * 32, 1) moe_grouped_mma_fp8_swiglu(
    __nv_bfloat16* __restrict__ act, const __nv_bfloat16* __restrict__ x,
    const uint8_t* __restrict__ w, const float* __restrict__ scales,
    const int32_t* __restrict__ offsets, const int32_t* __restrict__ sorted, uint32_t k,
    uint32_t experts, uint32_t inter, uint32_t hidden, uint32_t row_shift) {
    metrale::grid_dependency_sync();
    moe_grouped_mma_act<Act::SwiGlu>(act, x, Fp8Stack{w, scales, row_shift}, offsets, sorted, k,
                                     experts, inter, hidden);
}

extern "C" __global__ void __launch_bounds__(MMA_WARPS * 32, 1) moe_grouped_mma_fp8_relu2(
    __nv_bfloat16* __restrict__ act, const __nv_bfloat16* __restrict__ x,
    const uint8_t* __restrict__ w, const float* __restrict__ scales,
    const int32_t* __restrict__ offsets, const int32_t* __restrict__ sorted, uint32_t k,
    uint32_t experts, uint32_t inter, uint32_t hidden, uint32_t row_shift) {
    metrale::grid_dependency_sync();
    moe_grouped_mma_act<Act::Relu2>(act, x, Fp8Stack{w, scales, row_shift}, offsets, sorted, k,
                                    experts, inter, hidden);
}

extern "C" __global__ void __launch_bounds__(MMA_WARPS * 32, 1) moe_grouped_mma_fp8_down(
    __nv_bfloat16* __restrict__ y, const __nv_bfloat16* __restrict__ act,
    const uint8_t* __restrict__ w, const float* __restrict__ scales,
    const int32_t* __restrict__ offsets, const int32_t* __restrict__ sorted, uint32_t experts,
    uint32_t hidden, uint32_t inter, uint32_t row_shift) {
    metrale::grid_dependency_sync();
    moe_grouped_mma_down_of(y, act, Fp8Stack{w, scales, row_shift}, offsets, sorted, experts,
                            hidden, inter);
}

namespace {

// ---------------------------------------------------------------------------------------------
// Prefill: the grouped products, WMMA 16x16x16 tiles as gemm.cu's baseline (correct first; no
// pipelining).

constexpr int BM = 64, BN = 64, BK = 32, PAD = 8;
constexpr int GEMM_THREADS = 128;

// Rows [0, BM) x columns [k0, k0 + BK) of a tile operand into shared memory: row r comes from
// src_rows[r] (null: zeros), elements past k are zero. Vector loads where every row is 16-byte
// aligned and k % 8 == 0 (`vec`).
__device__ __forceinline__ void load_tile(__nv_bfloat16 (&dst)[BM][BK + PAD],
                                          const __nv_bfloat16* const (&src_rows)[BM], uint32_t k0,
                                          uint32_t k, bool vec) {
    const __nv_bfloat16 zero = metrale::to_bf16(0.0f);
    if (vec) {
        // 16-byte chunks: BM rows x BK / 8 chunks.
        for (int idx = threadIdx.x; idx < BM * (BK / 8); idx += GEMM_THREADS) {
            const int r = idx / (BK / 8), c = idx % (BK / 8);
            const uint32_t gk = k0 + 8 * c;
            uint4 v = make_uint4(0, 0, 0, 0);
            if (src_rows[r] != nullptr && gk < k) v = *reinterpret_cast<const uint4*>(src_rows[r] + gk);
            *reinterpret_cast<uint4*>(&dst[r][8 * c]) = v;
        }
    } else {
        for (int idx = threadIdx.x; idx < BM * BK; idx += GEMM_THREADS) {
            const int r = idx / BK, c = idx % BK;
            const uint32_t gk = k0 + c;
            dst[r][c] = (src_rows[r] != nullptr && gk < k) ? src_rows[r][gk] : zero;
        }
    }
}

// c_tile = A_tile (BM x k, rows a_rows) * W_tile (BN x k, rows w_rows)^T in f32, into `cs`.
// Every thread of the block calls it (barriers inside).
__device__ __forceinline__ void tile_product(float (&cs)[BM][BN + 4],
                                             __nv_bfloat16 (&as)[BM][BK + PAD],
                                             __nv_bfloat16 (&ws)[BN][BK + PAD],
                                             const __nv_bfloat16* const (&a_rows)[BM],
                                             const __nv_bfloat16* const (&w_rows)[BN], uint32_t k,
                                             bool vec) {
    using namespace nvcuda;
    const int warp = threadIdx.x >> 5;
    const int wr = warp >> 1, wc = warp & 1;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[2][2];
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 2; ++j) wmma::fill_fragment(acc[i][j], 0.0f);
    for (uint32_t k0 = 0; k0 < k; k0 += BK) {
        load_tile(as, a_rows, k0, k, vec);
        load_tile(ws, w_rows, k0, k, vec);
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < BK; kk += 16) {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> fa[2];
            wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> fb[2];
#pragma unroll
            for (int i = 0; i < 2; ++i) wmma::load_matrix_sync(fa[i], &as[wr * 32 + i * 16][kk], BK + PAD);
#pragma unroll
            for (int j = 0; j < 2; ++j) wmma::load_matrix_sync(fb[j], &ws[wc * 32 + j * 16][kk], BK + PAD);
#pragma unroll
            for (int i = 0; i < 2; ++i)
#pragma unroll
                for (int j = 0; j < 2; ++j) wmma::mma_sync(acc[i][j], fa[i], fb[j], acc[i][j]);
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 2; ++j)
            wmma::store_matrix_sync(&cs[wr * 32 + i * 16][wc * 32 + j * 16], acc[i][j], BN + 4,
                                    wmma::mem_row_major);
    __syncthreads();
}

}  // namespace

namespace {

// The grouped tensor-core first product (moe_gemm_swiglu, moe_gemm_relu2): a block's 64 tile
// columns are COLS = 64 / ROWS activation columns, tile column t holding row t / COLS of column
// t % COLS (SwiGLU: 32 gate columns then their up columns; ReLU^2: 64 up columns).
template <Act A>
__device__ __forceinline__ void moe_gemm_act(__nv_bfloat16* __restrict__ act,
                                             const __nv_bfloat16* __restrict__ x,
                                             const __nv_bfloat16* __restrict__ w,
                                             const int32_t* __restrict__ offsets,
                                             const int32_t* __restrict__ sorted, uint32_t k,
                                             uint32_t experts, uint32_t inter, uint32_t hidden) {
    constexpr int R = ExpertAct<A>::ROWS;
    constexpr int COLS = BN / R;
    __shared__ __align__(32) __nv_bfloat16 as[BM][BK + PAD];
    __shared__ __align__(32) __nv_bfloat16 ws[BN][BK + PAD];
    __shared__ __align__(32) float cs[BM][BN + 4];
    __shared__ const __nv_bfloat16* a_rows[BM];
    __shared__ const __nv_bfloat16* w_rows[BN];
    const uint32_t e = blockIdx.y, j0 = blockIdx.x * COLS;
    // Block-uniform exits, before any barrier.
    if (e >= experts || k == 0 || j0 >= inter) return;
    const int32_t begin = offsets[e], end = offsets[e + 1];
    if (threadIdx.x < BN) {
        const uint32_t j = j0 + threadIdx.x % COLS, r = threadIdx.x / COLS;
        w_rows[threadIdx.x] = j < inter ? expert_row<A>(w, e, r, j, inter, hidden) : nullptr;
    }
    const bool vec = hidden % 8 == 0 && aligned16(x) && aligned16(w);
    for (int32_t p0 = begin; p0 < end; p0 += BM) {
        // The previous tile's readers of a_rows are past tile_product's last barrier.
        if (threadIdx.x < BM) {
            const int32_t p = p0 + (int32_t)threadIdx.x;
            a_rows[threadIdx.x] =
                p < end ? x + (size_t)((uint32_t)sorted[p] / k) * hidden : nullptr;
        }
        __syncthreads();
        tile_product(cs, as, ws, a_rows, w_rows, hidden, vec);
        for (int idx = threadIdx.x; idx < BM * COLS; idx += GEMM_THREADS) {
            const int r = idx / COLS, c = idx % COLS;
            const int32_t p = p0 + r;
            const uint32_t j = j0 + c;
            float v[R];
#pragma unroll
            for (int q = 0; q < R; ++q) v[q] = cs[r][q * COLS + c];
            if (p < end && j < inter)
                act[(size_t)p * inter + j] = metrale::to_bf16(ExpertAct<A>::of(v));
        }
        __syncthreads();
    }
}

}  // namespace

// The grouped gate|up product with SwiGLU: for every position p of expert e's slice
// [offsets[e], offsets[e + 1]) (moe_group's), with assignment a = sorted[p] of row a / k,
// act[p, j] = bf16(silu(g) * u) of g = x[a / k] . w[e, j] and u = x[a / k] . w[e, inter + j], each
// rounded to bf16 first (moe_gemv_swiglu's values, in expert order). Positions past offsets[E]
// are not written.
// Launch: grid = (ceil(inter / 32), experts), block = 128: block (b, e) computes columns
// [32 b, 32 b + 32) of expert e's slice, 64 rows at a time, as a 64 x 64 tile of the gate rows
// (tile columns 0..31) and the up rows (32..63) of those columns. 28 KiB of static shared memory.
extern "C" __global__ void __launch_bounds__(GEMM_THREADS) moe_gemm_swiglu(
    __nv_bfloat16* __restrict__ act, const __nv_bfloat16* __restrict__ x,
    const __nv_bfloat16* __restrict__ w, const int32_t* __restrict__ offsets,
    const int32_t* __restrict__ sorted, uint32_t k, uint32_t experts, uint32_t inter,
    uint32_t hidden) {
    metrale::grid_dependency_sync();
    moe_gemm_act<Act::SwiGlu>(act, x, w, offsets, sorted, k, experts, inter, hidden);
}

// The grouped up product with squared ReLU: act[p, j] = bf16(relu(u)^2) of u = x[a / k] . w[e, j]
// rounded to bf16 first (moe_gemv_relu2's values, in expert order); w: [E, inter, hidden].
// Launch: grid = (ceil(inter / 64), experts), block = 128: block (b, e) computes columns
// [64 b, 64 b + 64) of expert e's slice, 64 rows at a time.
extern "C" __global__ void __launch_bounds__(GEMM_THREADS) moe_gemm_relu2(
    __nv_bfloat16* __restrict__ act, const __nv_bfloat16* __restrict__ x,
    const __nv_bfloat16* __restrict__ w, const int32_t* __restrict__ offsets,
    const int32_t* __restrict__ sorted, uint32_t k, uint32_t experts, uint32_t inter,
    uint32_t hidden) {
    metrale::grid_dependency_sync();
    moe_gemm_act<Act::Relu2>(act, x, w, offsets, sorted, k, experts, inter, hidden);
}

// The grouped down product: for every position p of expert e's slice, y[sorted[p], h] =
// bf16(act[p] . w[e, h]): each row goes back to its assignment's place, so y is [m k, hidden] in
// assignment order, ready for moe_combine. Assignments with no expert are not written.
// Launch: grid = (ceil(hidden / 64), experts), block = 128: block (b, e) computes columns
// [64 b, 64 b + 64) of expert e's slice, 64 rows at a time.
extern "C" __global__ void __launch_bounds__(GEMM_THREADS) moe_gemm_down(
    __nv_bfloat16* __restrict__ y, const __nv_bfloat16* __restrict__ act,
    const __nv_bfloat16* __restrict__ w, const int32_t* __restrict__ offsets,
    const int32_t* __restrict__ sorted, uint32_t experts, uint32_t hidden, uint32_t inter) {
    __shared__ __align__(32) __nv_bfloat16 as[BM][BK + PAD];
    __shared__ __align__(32) __nv_bfloat16 ws[BN][BK + PAD];
    __shared__ __align__(32) float cs[BM][BN + 4];
    __shared__ const __nv_bfloat16* a_rows[BM];
    __shared__ const __nv_bfloat16* w_rows[BN];
    metrale::grid_dependency_sync();
    const uint32_t e = blockIdx.y, h0 = blockIdx.x * BN;
    if (e >= experts || h0 >= hidden) return;
    const int32_t begin = offsets[e], end = offsets[e + 1];
    if (threadIdx.x < BN) {
        const uint32_t h = h0 + threadIdx.x;
        w_rows[threadIdx.x] = h < hidden ? w + ((size_t)e * hidden + h) * inter : nullptr;
    }
    const bool vec = inter % 8 == 0 && aligned16(act) && aligned16(w);
    for (int32_t p0 = begin; p0 < end; p0 += BM) {
        if (threadIdx.x < BM) {
            const int32_t p = p0 + (int32_t)threadIdx.x;
            a_rows[threadIdx.x] = p < end ? act + (size_t)p * inter : nullptr;
        }
        __syncthreads();
        tile_product(cs, as, ws, a_rows, w_rows, inter, vec);
        for (int idx = threadIdx.x; idx < BM * BN; idx += GEMM_THREADS) {
            const int r = idx / BN, c = idx % BN;
            const int32_t p = p0 + r;
            const uint32_t h = h0 + c;
            if (p < end && h < hidden) y[(size_t)sorted[p] * hidden + h] = metrale::to_bf16(cs[r][c]);
        }
        __syncthreads();
    }
}

// out[r, h] = bf16(sum over slots s, in order, of weights[r, s] * y[r k + s, h]
// + g_r * shared[r, h]) in f32; slots with no expert add nothing (their y rows are not read). The
// shared expert's term as in moe_gemv_down: added last, g_r = sigmoid(shared_gate[r]) (null: 1),
// no term where shared is null.
// Launch: grid = ceil(rows * hidden / 256), block = 256, one output a thread.
extern "C" __global__ void __launch_bounds__(256) moe_combine(
    __nv_bfloat16* __restrict__ out, const __nv_bfloat16* __restrict__ y,
    const int32_t* __restrict__ ids, const float* __restrict__ weights,
    const __nv_bfloat16* __restrict__ shared, const float* __restrict__ shared_gate, uint32_t rows,
    uint32_t k, uint32_t experts, uint32_t hidden) {
    metrale::grid_dependency_sync();
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (hidden == 0 || i >= (size_t)rows * hidden) return;
    const size_t r = i / hidden, h = i % hidden;
    float sum = 0.0f;
    for (uint32_t s = 0; s < k; ++s) {
        const size_t a = r * k + s;
        if (valid_expert(ids[a], experts))
            sum = fmaf(weights[a], metrale::to_f32(y[a * hidden + h]), sum);
    }
    out[i] = metrale::to_bf16(add_shared(sum, shared, shared_gate, r, h, hidden));
}

// ---------------------------------------------------------------------------------------------
// Prefill on Hopper's warpgroup MMA: the grouped products of moe_gemm_* (same arguments, same
// values up to the order of the f32 sums) as a persistent tile loop.
//
// A tile is 128 positions of one expert's slice (its rows) x 128 weight rows, K in 64-element
// pieces. Tiles are numbered expert by expert (within an expert, row tiles fastest, so the blocks
// running together share that expert's weight columns through L2); every block first turns
// offsets into each expert's first tile number in shared memory (one warp's scan), then takes
// tiles blockIdx.x, blockIdx.x + gridDim.x, ... So the work is spread evenly whatever the
// routing: moe_gemm_*'s one block per expert and column group walks a popular expert's rows
// alone.
//
// The pieces of all of a block's tiles form one stream: the copies of piece g + AHEAD (possibly
// of the next tile) go out while the products of piece g run, so a tile's start costs no
// pipeline fill. Shared memory: STAGES stages of A (128 rows x 64 bf16) and B (128 x 64), each a
// 16 KiB tile of 128-byte swizzled rows (wgmma.cuh), filled by 16-byte cp.async from all 256
// threads (rows gathered through `sorted`, zeros past the slice or the weight's rows). Each of
// the two warpgroups multiplies its 64 rows of A by the 128 rows of B (m64n128k16, both operands
// K-major in shared memory), one commit group a piece, at most one group in flight across the
// barrier that starts the next piece.
//
// The FP8 forms (moe_wgmma_fp8_*: e4m3 weight stacks with f32 scales) stage B as it lies, 128
// rows x 64 e4m3 (8 KiB a stage, each thread copying two rows' 16-byte chunks and those rows'
// scales of the piece), and each thread turns the chunks it copied itself (visible to it once
// its cp.async group is waited for, no barrier needed) into bf16(e4m3 x scale), the bits
// fp8_dequant_bf16 writes, in a 16 KiB swizzled B tile just before the barrier that publishes the
// piece. The converted tiles are a ring of three: piece g's tile was last read by the products of
// piece g - 3, which both warpgroups have waited for before the barrier of piece g - 1. So the
// products are the BF16 forms' over the dequantised stacks, the same bits, and shared memory is
// 6 x 26 KiB + 3 x 16 KiB = 204 KiB against the BF16 forms' 192 KiB.

#include "async_copy.cuh"
#include "wgmma.cuh"

namespace {
namespace moe_wg {
namespace wg = metrale::wgmma;
constexpr int THREADS = 256;
constexpr uint32_t BM = 128, BN = 128, BK = 64;
constexpr uint32_t STAGES = 6, AHEAD = STAGES - 2;
constexpr uint32_t TILE_BYTES = BM * BK * 2;  // one operand's piece in bf16: 16 KiB
// Rows of each operand a thread copies per piece (128 rows x 8 chunks over 256 threads).
constexpr int ROWS_PER_THREAD = BM * 8 / THREADS;
// FP8 B: rows a thread copies per piece (128 rows x 4 chunks of 16 e4m3 over 256 threads).
constexpr int FP8_ROWS_PER_THREAD = BN * 4 / THREADS;

// The dynamic shared memory of a form, from a 1024-byte aligned base: STAGES stages of A's piece
// and B's (bf16; FP8: the e4m3 bytes, then each thread's rows' scales), then FP8's ring of
// converted B tiles.
template <bool FP8>
struct Smem {
    static constexpr uint32_t B_STAGED = FP8 ? BN * BK + THREADS * FP8_ROWS_PER_THREAD * 4
                                             : TILE_BYTES;
    static constexpr uint32_t STAGE = TILE_BYTES + B_STAGED;
    static constexpr uint32_t RING = FP8 ? 3 : 0;
    static constexpr uint32_t BYTES = STAGES * STAGE + RING * TILE_BYTES;
    static_assert(STAGE % 1024 == 0, "every stage's A tile on a swizzle atom");
    static_assert(BYTES + 1024 + 2 * 4 * (MAX_EXPERTS + 1) <= 227 * 1024,
                  "shared memory over the per-block limit");
};

// Whether an entry takes its launch: 1 to MAX_EXPERTS experts, the block it was written for,
// both widths its pieces read a multiple of `multiple` (8 bf16 or 16 e4m3: 16-byte chunks), and
// the A and B operands 16-byte aligned (otherwise it writes nothing and callers keep moe_gemm_*).
__device__ __forceinline__ bool takes(uint32_t experts, uint32_t multiple, uint32_t width_a,
                                      uint32_t width_b, const void* a, const void* b) {
    return experts != 0 && experts <= MAX_EXPERTS && width_a % multiple == 0 &&
           width_b % multiple == 0 && aligned16(a) && aligned16(b) && blockDim.x == THREADS;
}

// Byte offset of 16-byte chunk c of row r in a 128-byte swizzled tile.
__device__ __forceinline__ uint32_t chunk_at(uint32_t r, uint32_t c) {
    return r * 128 + ((c ^ (r & 7)) << 4);
}

// 4 bytes global -> shared (through L1: a piece's scales are read by several rows and tiles);
// with `valid` false the destination is zero-filled and `src` is not read.
__device__ __forceinline__ void cp_async_4(uint32_t dst, const void* src, bool valid) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src),
                 "r"(valid ? 4 : 0)
                 : "memory");
}

__device__ __forceinline__ uint4 ld_shared_v4(uint32_t a) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "r"(a));
    return v;
}

__device__ __forceinline__ float ld_shared_f32(uint32_t a) {
    float v;
    asm volatile("ld.shared.f32 %0, [%1];" : "=f"(v) : "r"(a));
    return v;
}

__device__ __forceinline__ void st_shared_v4(uint32_t a, const uint4& v) {
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(a), "r"(v.x), "r"(v.y),
                 "r"(v.z), "r"(v.w)
                 : "memory");
}

// Where a block's tile lies: expert e, its slice's positions [begin, end) of which the tile takes
// [p0, p0 + BM), and the tile's first weight row group `col` (in units of the form's columns).
struct Tile {
    uint32_t e, col;
    int32_t p0, end;
};

// The first tile number of every expert (tile_start[e]; tile_start[experts] = all tiles), from
// offsets copied to off_s. One warp scans; the caller syncs.
__device__ __forceinline__ void scan_tiles(int32_t* tile_start, const int32_t* off_s,
                                           uint32_t experts, uint32_t col_tiles) {
    if (threadIdx.x >= 32) return;
    const uint32_t lane = threadIdx.x;
    int32_t carry = 0;
    for (uint32_t base = 0; base < experts; base += 32) {
        const uint32_t e = base + lane;
        int32_t n = 0;
        if (e < experts) {
            const int32_t rows = off_s[e + 1] - off_s[e];
            n = rows > 0 ? (int32_t)(((uint32_t)rows + BM - 1) / BM * col_tiles) : 0;
        }
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int32_t v = __shfl_up_sync(FULL, n, o);
            if ((int)lane >= o) n += v;
        }
        if (e < experts) tile_start[e + 1] = carry + n;
        carry += __shfl_sync(FULL, n, 31);
    }
    if (lane == 0) tile_start[0] = 0;
}

__device__ __forceinline__ Tile tile_of(int32_t t, const int32_t* tile_start, const int32_t* off_s,
                                        uint32_t experts) {
    // The last expert whose first tile is at or before t (empty experts share the next one's).
    uint32_t lo = 0, hi = experts - 1;
    while (lo < hi) {
        const uint32_t mid = (lo + hi + 1) / 2;
        if (tile_start[mid] <= t) lo = mid;
        else hi = mid - 1;
    }
    const uint32_t e = lo;
    const int32_t begin = off_s[e], end = off_s[e + 1];
    const int32_t row_tiles = (end - begin + (int32_t)BM - 1) / (int32_t)BM;
    const int32_t local = t - tile_start[e];
    return Tile{e, (uint32_t)(local / row_tiles), begin + (local % row_tiles) * (int32_t)BM, end};
}

// The weights of a form: a bf16 stack, or an e4m3 one with its scales (Fp8Stack's layout).
// row(s, cols) is stack row s's first element; an FP8 stack also gives its scales.
struct Bf16B {
    static constexpr bool FP8 = false;
    const __nv_bfloat16* w;
    __device__ const __nv_bfloat16* row(size_t s, uint32_t cols) const { return w + s * cols; }
};
struct Fp8B {
    static constexpr bool FP8 = true;
    const uint8_t* w;
    const float* scales;
    uint32_t row_shift;
    __device__ const uint8_t* row(size_t s, uint32_t cols) const { return w + s * cols; }
    __device__ const float* scale_row(size_t s, uint32_t cols) const {
        return scales + (s >> row_shift) * ((cols + 127) / 128);
    }
};

// The grouped first product (SwiGLU: each tile's 128 weight rows are 64 gate rows and the same 64
// columns' up rows; ReLU^2: 128 up rows) and the down product, as policies of the loop below:
// b_row(t, r, s) sets the stack row s of tile row r, false past the weight's rows.
template <Act A, typename B>
struct First {
    static constexpr uint32_t R = ExpertAct<A>::ROWS;
    static constexpr uint32_t COLS = BN / R;  // activation columns a tile
    __nv_bfloat16* act;
    const __nv_bfloat16* x;
    B w;
    const int32_t* sorted;
    uint32_t k, inter, hidden;

    __device__ uint32_t depth() const { return hidden; }
    __device__ uint32_t col_tiles() const { return (inter + COLS - 1) / COLS; }
    __device__ const __nv_bfloat16* a_row(int32_t p) const {
        return x + (size_t)((uint32_t)sorted[p] / k) * hidden;
    }
    __device__ bool b_row(const Tile& t, uint32_t r, size_t& s) const {
        const uint32_t j = t.col * COLS + r % COLS;
        s = ((size_t)t.e * R + r / COLS) * inter + j;
        return j < inter;
    }
    // Thread columns: acc[4 i + q] is tile column 8 i + 2 tg + (q & 1) of row 16 warp + g
    // (+ 8 for q >= 2); activation column c takes tile columns c + COLS s for s < R.
    __device__ void store(const Tile& t, const float (&acc)[64], int32_t row0, uint32_t tg) const {
#pragma unroll
        for (uint32_t i = 0; i < COLS / 8; ++i)
#pragma unroll
            for (uint32_t q = 0; q < 4; ++q) {
                const int32_t p = t.p0 + row0 + 8 * (int32_t)(q >> 1);
                const uint32_t j = t.col * COLS + 8 * i + 2 * tg + (q & 1);
                float v[R];
#pragma unroll
                for (uint32_t s = 0; s < R; ++s) v[s] = acc[4 * (i + s * COLS / 8) + q];
                if (p < t.end && j < inter)
                    act[(size_t)p * inter + j] = metrale::to_bf16(ExpertAct<A>::of(v));
            }
    }
};

template <typename B>
struct Down {
    __nv_bfloat16* y;
    const __nv_bfloat16* act;
    B w;
    const int32_t* sorted;
    uint32_t hidden, inter;

    __device__ uint32_t depth() const { return inter; }
    __device__ uint32_t col_tiles() const { return (hidden + BN - 1) / BN; }
    __device__ const __nv_bfloat16* a_row(int32_t p) const { return act + (size_t)p * inter; }
    __device__ bool b_row(const Tile& t, uint32_t r, size_t& s) const {
        const uint32_t h = t.col * BN + r;
        s = (size_t)t.e * hidden + h;
        return h < hidden;
    }
    __device__ void store(const Tile& t, const float (&acc)[64], int32_t row0, uint32_t tg) const {
#pragma unroll
        for (uint32_t half = 0; half < 2; ++half) {
            const int32_t p = t.p0 + row0 + 8 * (int32_t)half;
            if (p >= t.end) continue;
            __nv_bfloat16* yr = y + (size_t)sorted[p] * hidden;
#pragma unroll
            for (uint32_t i = 0; i < BN / 8; ++i)
#pragma unroll
                for (uint32_t q = 0; q < 2; ++q) {
                    const uint32_t h = t.col * BN + 8 * i + 2 * tg + q;
                    if (h < hidden) yr[h] = metrale::to_bf16(acc[4 * i + 2 * half + q]);
                }
        }
    }
};

template <typename Form>
__device__ __forceinline__ void grouped_tiles(const Form& f, const int32_t* __restrict__ offsets,
                                              uint32_t experts, unsigned char* smem_raw) {
    constexpr bool FP8 = decltype(f.w)::FP8;
    using S = Smem<FP8>;
    __shared__ int32_t off_s[MAX_EXPERTS + 1];
    __shared__ int32_t tile_start[MAX_EXPERTS + 1];
    const uint32_t tid = threadIdx.x, group = tid / 128, warp = (tid / 32) % 4, lane = tid & 31;
    const uint32_t g = lane >> 2, tg = lane & 3;
    for (uint32_t i = tid; i <= experts; i += THREADS) off_s[i] = offsets[i];
    __syncthreads();
    const uint32_t col_tiles = f.col_tiles();
    scan_tiles(tile_start, off_s, experts, col_tiles);
    __syncthreads();
    const int32_t tiles = tile_start[experts];
    const int32_t mine =
        (int32_t)blockIdx.x < tiles ? (tiles - (int32_t)blockIdx.x + (int32_t)gridDim.x - 1) / (int32_t)gridDim.x : 0;
    const uint32_t depth = f.depth(), pieces = (depth + BK - 1) / BK;
    const uint32_t steps = (uint32_t)mine * pieces;
    const uint32_t base = (metrale::smem_addr(smem_raw) + 1023u) & ~1023u;
    const uint32_t ring = base + STAGES * S::STAGE;

    // The copier's tile (the one piece g + AHEAD belongs to) and its rows.
    int32_t copy_n = -1;
    Tile copy_tile{};
    const __nv_bfloat16* a_rows[ROWS_PER_THREAD];
    const __nv_bfloat16* b_rows[ROWS_PER_THREAD];
    // FP8: the thread's B rows (tid / 4 + 64 i, chunk tid % 4) and their scales.
    const uint8_t* q_rows[FP8_ROWS_PER_THREAD];
    const float* q_scales[FP8_ROWS_PER_THREAD];
    const uint32_t chunk = tid % 8;
    const void* any = offsets;  // a valid address for the zero-filling copies, which read nothing
    auto copy = [&](uint32_t step) {
        const int32_t n = (int32_t)(step / pieces);
        const uint32_t piece = step % pieces;
        if (n != copy_n) {
            copy_n = n;
            copy_tile = tile_of((int32_t)blockIdx.x + n * (int32_t)gridDim.x, tile_start, off_s, experts);
#pragma unroll
            for (int i = 0; i < ROWS_PER_THREAD; ++i) {
                const uint32_t r = tid / 8 + 32 * i;
                const int32_t p = copy_tile.p0 + (int32_t)r;
                a_rows[i] = p < copy_tile.end ? f.a_row(p) : nullptr;
                if constexpr (!FP8) {
                    size_t s;
                    b_rows[i] = f.b_row(copy_tile, r, s) ? f.w.row(s, depth) : nullptr;
                }
            }
            if constexpr (FP8) {
#pragma unroll
                for (int i = 0; i < FP8_ROWS_PER_THREAD; ++i) {
                    size_t s;
                    const bool in = f.b_row(copy_tile, tid / 4 + 64 * i, s);
                    q_rows[i] = in ? f.w.row(s, depth) : nullptr;
                    q_scales[i] = in ? f.w.scale_row(s, depth) : nullptr;
                }
            }
        }
        const uint32_t stage = base + (step % STAGES) * S::STAGE;
        const uint32_t k0 = piece * BK + chunk * 8;
        const bool in = k0 < depth;
#pragma unroll
        for (int i = 0; i < ROWS_PER_THREAD; ++i) {
            const uint32_t r = tid / 8 + 32 * i;
            const bool av = in && a_rows[i] != nullptr;
            metrale::cp_async_16(stage + chunk_at(r, chunk), av ? a_rows[i] + k0 : any, av);
            if constexpr (!FP8) {
                const bool bv = in && b_rows[i] != nullptr;
                metrale::cp_async_16(stage + TILE_BYTES + chunk_at(r, chunk),
                                     bv ? b_rows[i] + k0 : any, bv);
            }
        }
        if constexpr (FP8) {
            // 16 e4m3 of one scale block (depth % 16 == 0: a chunk is all in or all out).
            const uint32_t kq = piece * BK + 16 * (tid % 4);
#pragma unroll
            for (int i = 0; i < FP8_ROWS_PER_THREAD; ++i) {
                const uint32_t r = tid / 4 + 64 * i;
                const bool bv = kq < depth && q_rows[i] != nullptr;
                metrale::cp_async_16(stage + TILE_BYTES + r * BK + 16 * (tid % 4),
                                     bv ? q_rows[i] + kq : any, bv);
                const bool sv = piece * BK < depth && q_scales[i] != nullptr;
                cp_async_4(stage + TILE_BYTES + BN * BK + (FP8_ROWS_PER_THREAD * tid + i) * 4,
                           sv ? q_scales[i] + piece * BK / 128 : any, sv);
            }
        }
    };
    // FP8: piece `step`'s e4m3 chunks this thread copied, as bf16(e4m3 x scale) into the ring's
    // tile of the piece (zeros where the copies zero-filled).
    auto convert = [&](uint32_t step) {
        const uint32_t staged = base + (step % STAGES) * S::STAGE + TILE_BYTES;
        const uint32_t tile = ring + (step % 3) * TILE_BYTES;
        const uint32_t c = tid % 4;
#pragma unroll
        for (int i = 0; i < FP8_ROWS_PER_THREAD; ++i) {
            const uint32_t r = tid / 4 + 64 * i;
            const uint4 q = ld_shared_v4(staged + r * BK + 16 * c);
            const float s = ld_shared_f32(staged + BN * BK + (FP8_ROWS_PER_THREAD * tid + i) * 4);
            st_shared_v4(tile + chunk_at(r, 2 * c), e4m3x8_scaled(q.x, q.y, s));
            st_shared_v4(tile + chunk_at(r, 2 * c + 1), e4m3x8_scaled(q.z, q.w, s));
        }
    };

#pragma unroll
    for (uint32_t s = 0; s < AHEAD; ++s) {
        if (s < steps) copy(s);
        metrale::cp_async_commit();
    }
    float acc[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) acc[i] = 0.0f;
    uint32_t step = 0;
    for (int32_t n = 0; n < mine; ++n) {
        for (uint32_t piece = 0; piece < pieces; ++piece, ++step) {
            // Piece `step` has landed for every thread and is visible to the async proxy; both
            // warpgroups are done with the products of piece step - 2, whose stage piece
            // step + AHEAD takes (FP8: and with those of piece step - 3, whose ring tile piece
            // step takes).
            metrale::cp_async_wait<AHEAD - 1>();
            if constexpr (FP8) convert(step);
            wg::fence_proxy_async();
            __syncthreads();
            const uint32_t stage = base + (step % STAGES) * S::STAGE;
            const uint32_t a_tile = stage + group * 64 * 128;
            const uint32_t b_tile = FP8 ? ring + (step % 3) * TILE_BYTES : stage + TILE_BYTES;
            wg::fence();
#pragma unroll
            for (uint32_t ks = 0; ks < BK / 16; ++ks)
                wg::mma_m64n128k16_ss(acc, wg::desc_sw128(a_tile + ks * 32, 16, 1024),
                                      wg::desc_sw128(b_tile + ks * 32, 16, 1024),
                                      piece > 0 || ks > 0);
            wg::commit();
            // The copies of piece step + AHEAD (of this tile or the next) go out while the
            // products run; one product group stays in flight across the next barrier.
            if (step + AHEAD < steps) copy(step + AHEAD);
            metrale::cp_async_commit();
            wg::wait<1>();
        }
        // The tile's products done, it is stored while the next tile's first copies are in
        // flight.
        wg::wait<0>();
        wg::fence_operands(acc);
        const Tile t = tile_of((int32_t)blockIdx.x + n * (int32_t)gridDim.x, tile_start, off_s,
                               experts);
        f.store(t, acc, (int32_t)(64 * group + 16 * warp + g), tg);
        wg::fence_operands(acc);
    }
    // The block's copies are all done (the last groups are empty) before it exits.
    metrale::cp_async_wait<0>();
}
}  // namespace moe_wg
}  // namespace

// The grouped gate|up product with SwiGLU on warpgroup MMA: moe_gemm_swiglu's arguments and
// values (act[p, j] for every position p of every expert's slice, in expert order; f32 sums in
// another order). Needs hidden % 8 == 0, inter % 8 == 0 and 16-byte aligned x and w (otherwise
// nothing is written: callers keep moe_gemm_swiglu) and 1 <= experts <= MAX_EXPERTS.
// Launch: grid = a block per SM (any count works), block = 256, dynamic shared memory
// moe_wg::Smem<false>::BYTES + 1 KiB.
extern "C" __global__ void __launch_bounds__(moe_wg::THREADS, 1) moe_wgmma_swiglu(
    __nv_bfloat16* __restrict__ act, const __nv_bfloat16* __restrict__ x,
    const __nv_bfloat16* __restrict__ w, const int32_t* __restrict__ offsets,
    const int32_t* __restrict__ sorted, uint32_t k, uint32_t experts, uint32_t inter,
    uint32_t hidden) {
    extern __shared__ __align__(1024) unsigned char moe_wg_smem[];
    metrale::grid_dependency_sync();
    if (k == 0 || !moe_wg::takes(experts, 8, hidden, inter, x, w)) return;
    const moe_wg::First<Act::SwiGlu, moe_wg::Bf16B> f{act, x, {w}, sorted, k, inter, hidden};
    moe_wg::grouped_tiles(f, offsets, experts, moe_wg_smem);
}

// The grouped up product with squared ReLU on warpgroup MMA: moe_gemm_relu2's arguments and
// values; otherwise as moe_wgmma_swiglu.
extern "C" __global__ void __launch_bounds__(moe_wg::THREADS, 1) moe_wgmma_relu2(
    __nv_bfloat16* __restrict__ act, const __nv_bfloat16* __restrict__ x,
    const __nv_bfloat16* __restrict__ w, const int32_t* __restrict__ offsets,
    const int32_t* __restrict__ sorted, uint32_t k, uint32_t experts, uint32_t inter,
    uint32_t hidden) {
    extern __shared__ __align__(1024) unsigned char moe_wg_smem[];
    metrale::grid_dependency_sync();
    if (k == 0 || !moe_wg::takes(experts, 8, hidden, inter, x, w)) return;
    const moe_wg::First<Act::Relu2, moe_wg::Bf16B> f{act, x, {w}, sorted, k, inter, hidden};
    moe_wg::grouped_tiles(f, offsets, experts, moe_wg_smem);
}

// The grouped down product on warpgroup MMA: moe_gemm_down's arguments and values (y[sorted[p]]
// for every position p, in assignment order). Needs inter % 8 == 0 and 16-byte aligned act and w;
// otherwise as moe_wgmma_swiglu.
extern "C" __global__ void __launch_bounds__(moe_wg::THREADS, 1) moe_wgmma_down(
    __nv_bfloat16* __restrict__ y, const __nv_bfloat16* __restrict__ act,
    const __nv_bfloat16* __restrict__ w, const int32_t* __restrict__ offsets,
    const int32_t* __restrict__ sorted, uint32_t experts, uint32_t hidden, uint32_t inter) {
    extern __shared__ __align__(1024) unsigned char moe_wg_smem[];
    metrale::grid_dependency_sync();
    if (!moe_wg::takes(experts, 8, inter, inter, act, w)) return;
    const moe_wg::Down<moe_wg::Bf16B> f{y, act, {w}, sorted, hidden, inter};
    moe_wg::grouped_tiles(f, offsets, experts, moe_wg_smem);
}

// The FP8 forms: moe_wgmma_swiglu, _relu2 and _down over e4m3 stacks with f32 scales (the layout
// of moe_grouped_mma_fp8_*), each weight bf16(e4m3 x scale) as fp8_dequant_bf16 writes it: the
// BF16 forms' bits over the dequantised stacks. Need the widths multiples of 16 (hidden and
// inter; the down form: inter), 16-byte aligned x / act and w, 1 <= experts <= MAX_EXPERTS
// (otherwise nothing is written). Launch: the BF16 forms', dynamic shared memory
// Smem<true>::BYTES + 1 KiB.
extern "C" __global__ void __launch_bounds__(moe_wg::THREADS, 1) moe_wgmma_fp8_swiglu(
    __nv_bfloat16* __restrict__ act, const __nv_bfloat16* __restrict__ x,
    const uint8_t* __restrict__ w, const float* __restrict__ scales,
    const int32_t* __restrict__ offsets, const int32_t* __restrict__ sorted, uint32_t k,
    uint32_t experts, uint32_t inter, uint32_t hidden, uint32_t row_shift) {
    extern __shared__ __align__(1024) unsigned char moe_wg_smem[];
    metrale::grid_dependency_sync();
    if (k == 0 || !moe_wg::takes(experts, 16, hidden, inter, x, w)) return;
    const moe_wg::First<Act::SwiGlu, moe_wg::Fp8B> f{
        act, x, {w, scales, row_shift}, sorted, k, inter, hidden};
    moe_wg::grouped_tiles(f, offsets, experts, moe_wg_smem);
}

extern "C" __global__ void __launch_bounds__(moe_wg::THREADS, 1) moe_wgmma_fp8_relu2(
    __nv_bfloat16* __restrict__ act, const __nv_bfloat16* __restrict__ x,
    const uint8_t* __restrict__ w, const float* __restrict__ scales,
    const int32_t* __restrict__ offsets, const int32_t* __restrict__ sorted, uint32_t k,
    uint32_t experts, uint32_t inter, uint32_t hidden, uint32_t row_shift) {
    extern __shared__ __align__(1024) unsigned char moe_wg_smem[];
    metrale::grid_dependency_sync();
    if (k == 0 || !moe_wg::takes(experts, 16, hidden, inter, x, w)) return;
    const moe_wg::First<Act::Relu2, moe_wg::Fp8B> f{
        act, x, {w, scales, row_shift}, sorted, k, inter, hidden};
    moe_wg::grouped_tiles(f, offsets, experts, moe_wg_smem);
}

extern "C" __global__ void __launch_bounds__(moe_wg::THREADS, 1) moe_wgmma_fp8_down(
    __nv_bfloat16* __restrict__ y, const __nv_bfloat16* __restrict__ act,
    const uint8_t* __restrict__ w, const float* __restrict__ scales,
    const int32_t* __restrict__ offsets, const int32_t* __restrict__ sorted, uint32_t experts,
    uint32_t hidden, uint32_t inter, uint32_t row_shift) {
    extern __shared__ __align__(1024) unsigned char moe_wg_smem[];
    metrale::grid_dependency_sync();
    if (!moe_wg::takes(experts, 16, inter, inter, act, w)) return;
    const moe_wg::Down<moe_wg::Fp8B> f{y, act, {w, scales, row_shift}, sorted, hidden, inter};
    moe_wg::grouped_tiles(f, offsets, experts, moe_wg_smem);
}
