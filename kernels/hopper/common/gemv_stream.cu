// SPDX-License-Identifier: MIT OR Apache-2.0
// One-row GEMV for batch-1 decode as a bulk-copy stream: c[n] = w[n, k] . a[k] (+ bias), bf16.
// The _norm entries first normalise their own A (the residual add + RMSNorm before the product).
//
// gemv_bf16 keeps a warp's weights in registers: at most 4 KiB a warp in flight, 24 warps an SM,
// and a whole column's loads drain before its sums meet, so a launch's bytes in flight dip at
// every column and the last wave runs on part of the SMs. Here the weights go from global memory
// to shared memory with cp.async.bulk (the Hopper bulk copy engine, completion counted in bytes
// on an mbarrier), so a warp keeps a ring of RING bytes in flight whatever its registers, and it
// refills a ring slot as soon as its lanes have read it, across column boundaries: the stream does
// not stop until the warp's last column.
//
// Work split. Every warp of the grid takes a contiguous run of whole columns (the runs differ by
// at most one column; a column's weight row is contiguous, so a run is one contiguous byte range
// of w). Lane 0 of the warp is its producer: it arms the slot's mbarrier with the chunk's byte
// count and issues the copy; all 32 lanes consume. A chunk is one CHUNK-byte piece of one column:
// 4 KiB where a row is whole 4 KiB pieces (k % 2048 == 0), else 2 KiB (k % 1024 == 0, Qwen3-0.6B's
// k of 1024 and 3072), the ring then of 8 slots instead of 4; lane l multiplies the chunk's
// 16-byte pieces l, l + 32, ... with the matching pieces of a, which every block keeps in shared
// memory, into one f32 sum (two dependency chains); at a column's last chunk the warp adds its
// lanes' sums (warp_sum's butterfly) and lane 0 stores bf16(sum + bias). Each column's sum runs
// over the same pieces in the same order on every launch, whatever the grid: deterministic.
//
// The weights are never written by a kernel, so the first `prewait` 4-KiB units (at most 4, the
// whole ring) of every warp's first fill may go out before the programmatic-launch wait; a is read
// only after it. They then share HBM with the launch before, which is slowed by as much as they
// gain when that launch is a short, latency-bound one (Qwen3-8B's attention and add + RMSNorm:
// docs/results/2026-12-02-speed-h200/gemv-stream). `evict_first` streams the weights through L2 as
// evict-first lines.
//
// gemv_bf16_swiglu_stream is the same stream over the fused gate|up weight: a warp's output
// column streams its gate row, then its up row, and stores gemv_bf16_swiglu's epilogue of the two.
//
// The _norm entries (gemv_bf16_stream_norm, gemv_bf16_swiglu_stream_norm) fill a in shared memory
// with bf16(rmsnorm(residual + input) * weight) after the wait instead of copying it, as
// gemv_bf16_norm does (norm.cuh's normalise_input: the bits add_rmsnorm_f32res would store), and
// block 0 stores the f32 sums to residual_out: the add + RMSNorm launch before the product goes, and
// its latency overlaps the ring's first fill.
//
// Dynamic shared memory: a (k bf16, rounded up to 128 bytes), then each warp's ring (RING bytes),
// then each warp's MAX_STAGES mbarriers (8 bytes each), then 32 floats for the norm's reduction:
// gemv_stream_smem_bytes in crates/kernels (ops/gemm.rs). Launch: any grid (the host gives one
// block an SM), 256 threads.
#include <cuda_bf16.h>
#include <stdint.h>

#include <type_traits>

#include "common.cuh"
#include "norm.cuh"

namespace {

constexpr int WARPS = 8;
constexpr uint32_t RING = 16384;    // bytes each warp has in flight: 128 KiB a block
constexpr uint32_t UNIT = 4096;     // the larger chunk; `prewait` counts these
constexpr int MAX_STAGES = RING / 2048;  // slots of the ring of 2-KiB chunks
constexpr uint32_t MAX_K = 1u << 16;  // the host's shared-memory bound is lower (50176)

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void bar_init(uint32_t bar) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar) : "memory");
}

// Arms `bar` for `bytes` of copies (the producer's one arrival), then copies `bytes` from global
// `src` to shared `dst`; the copy's completion counts the bytes off `bar`. With `evict` the lines
// go through L2 under `policy` (evict-first: a weight byte is read once a step, and the
// activations and cache rows the launches around it read should stay in L2 instead).
__device__ __forceinline__ void bulk_copy(uint32_t dst, const void* src, uint32_t bytes,
                                          uint32_t bar, bool evict, uint64_t policy) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes)
                 : "memory");
    if (evict) {
        asm volatile(
            "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
            " [%0], [%1], %2, [%3], %4;" ::"r"(dst),
            "l"(src), "r"(bytes), "r"(bar), "l"(policy)
            : "memory");
    } else {
        asm volatile(
            "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, "
            "[%3];" ::"r"(dst),
            "l"(src), "r"(bytes), "r"(bar)
            : "memory");
    }
}

// Spins until `bar` has completed the phase of the given parity.
__device__ __forceinline__ void bar_wait(uint32_t bar, uint32_t parity) {
    uint32_t done = 0;
    while (!done) {
        asm volatile(
            "{\n"
            ".reg .pred p;\n"
            "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
            "selp.u32 %0, 1, 0, p;\n"
            "}\n"
            : "=r"(done)
            : "r"(bar), "r"(parity)
            : "memory");
    }
}

// The two bf16 of a little-endian pair, widened exactly.
__device__ __forceinline__ float lo(uint32_t v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float hi(uint32_t v) { return __uint_as_float(v & 0xffff0000u); }

// acc[0] takes the even elements of the piece, acc[1] the odd ones.
__device__ __forceinline__ void fma_piece(float (&acc)[2], uint4 w, uint4 a) {
    acc[0] = fmaf(lo(w.x), lo(a.x), acc[0]);
    acc[1] = fmaf(hi(w.x), hi(a.x), acc[1]);
    acc[0] = fmaf(lo(w.y), lo(a.y), acc[0]);
    acc[1] = fmaf(hi(w.y), hi(a.y), acc[1]);
    acc[0] = fmaf(lo(w.z), lo(a.z), acc[0]);
    acc[1] = fmaf(hi(w.z), hi(a.z), acc[1]);
    acc[0] = fmaf(lo(w.w), lo(a.w), acc[0]);
    acc[1] = fmaf(hi(w.w), hi(a.w), acc[1]);
}

// silu(g) * u of the bf16 products, as gemv_bf16_swiglu's epilogue computes it.
__device__ __forceinline__ float swiglu(float g, float u) { return g / (1.0f + __expf(-g)) * u; }

// The stream over `cols` output columns in chunks of CHUNK bytes. Plain: column v's weight row is
// row v of w. SWIGLU: w is [2 cols, k] (gate rows, then up rows) and column v streams gate row v,
// then up row cols + v, and stores silu(bf16(g)) * bf16(u). NORM: A is `norm` normalised, not `a`.
// The caller checked the block size and that CHUNK divides a row: `ok` is the rest of the launch
// contract.
template <bool SWIGLU, uint32_t CHUNK, bool NORM, typename Out>
__device__ __forceinline__ void stream(Out* __restrict__ c,
                                       const __nv_bfloat16* __restrict__ a,
                                       const metrale::NormInput& norm,
                                       const __nv_bfloat16* __restrict__ w,
                                       const __nv_bfloat16* __restrict__ bias, uint32_t m,
                                       uint32_t cols, uint32_t k, uint32_t prewait,
                                       uint32_t evict_first) {
    constexpr uint32_t STAGES = RING / CHUNK;          // ring slots: 4 of 4 KiB or 8 of 2 KiB
    constexpr int PIECES = CHUNK / 16 / 32;            // 16-byte pieces a lane reads a chunk
    static_assert(STAGES <= MAX_STAGES && (STAGES & (STAGES - 1)) == 0, "ring of 2^n slots");
    extern __shared__ __align__(128) unsigned char smem[];
    const uint32_t lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const uintptr_t a_addr = NORM ? 0 : reinterpret_cast<uintptr_t>(a);
    const bool ok = m == 1 && k != 0 && k <= MAX_K &&
                    ((a_addr | reinterpret_cast<uintptr_t>(w)) & 15) == 0;
    const uint32_t a_bytes = ok ? (k * 2 + 127) / 128 * 128 : 0;
    const uint32_t per_row = ok ? k * 2 / CHUNK : 1;
    // Chunks of one output column: one weight row, or the gate row and the up row.
    const uint32_t per_column = SWIGLU ? 2 * per_row : per_row;

    uint4* a_s = reinterpret_cast<uint4*>(smem);
    unsigned char* ring = smem + a_bytes + warp * STAGES * CHUNK;
    const uint32_t bars = smem_u32(smem + a_bytes + WARPS * RING) + warp * MAX_STAGES * 8;
    float* scratch = reinterpret_cast<float*>(smem + a_bytes + WARPS * RING + WARPS * MAX_STAGES * 8);

    // This warp's columns [first, last) and their chunks.
    const uint64_t warps = (uint64_t)gridDim.x * WARPS;
    const uint64_t gw = (uint64_t)blockIdx.x * WARPS + warp;
    const uint32_t first = ok ? (uint32_t)(gw * cols / warps) : 0;
    const uint32_t last = ok ? (uint32_t)((gw + 1) * cols / warps) : 0;
    const uint32_t chunks = (last - first) * per_column;
    const unsigned char* w8 = reinterpret_cast<const unsigned char*>(w);
    const size_t row_bytes = (size_t)k * 2;
    // Where chunk j of this warp's run starts in w.
    auto source = [&](uint32_t j) {
        const uint32_t col = first + j / per_column, r = j % per_column;
        const size_t row = SWIGLU && r >= per_row ? (size_t)cols + col : col;
        return w8 + row * row_bytes + (size_t)(r % per_row) * CHUNK;
    };

    const bool evict = evict_first != 0;
    uint64_t policy = 0;
    if (evict) asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    // The ring's first fill: `prewait` 4-KiB units before the programmatic-launch wait (the weights
    // are never written by a kernel), the rest after it.
    const uint32_t fill = min(chunks, STAGES), early = min(fill, min(prewait, RING / UNIT) * (UNIT / CHUNK));
    if (lane == 0) {
        for (uint32_t s = 0; s < STAGES; ++s) bar_init(bars + 8 * s);
        // Make the initialised barriers visible to the bulk copies (the async proxy).
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        for (uint32_t j = 0; j < early; ++j)
            bulk_copy(smem_u32(ring + j * CHUNK), source(j), CHUNK, bars + 8 * j, evict, policy);
    }
    __syncwarp();

    metrale::grid_dependency_sync();
    if (!ok) return;
    if (lane == 0)
        for (uint32_t j = early; j < fill; ++j)
            bulk_copy(smem_u32(ring + j * CHUNK), source(j), CHUNK, bars + 8 * j, evict, policy);

    if constexpr (NORM) {
        // A from the residual stream (block 0 also stores the sums); ends with a barrier.
        metrale::normalise_input<1>(reinterpret_cast<__nv_bfloat16*>(a_s), norm, k, scratch);
    } else {
        // a into shared memory, whole 16-byte pieces (k % 1024 == 0 here).
        const uint4* a4 = reinterpret_cast<const uint4*>(a);
        for (uint32_t i = threadIdx.x; i < k / 8; i += blockDim.x) a_s[i] = a4[i];
        __syncthreads();
    }

    float acc[2] = {0.f, 0.f};
    float gate = 0.f;
    for (uint32_t j = 0; j < chunks; ++j) {
        const uint32_t s = j % STAGES;
        bar_wait(bars + 8 * s, (j / STAGES) & 1);
        const uint4* slot = reinterpret_cast<const uint4*>(ring + s * CHUNK);
        uint4 wv[PIECES];
#pragma unroll
        for (int i = 0; i < PIECES; ++i) wv[i] = slot[lane + 32 * i];
        // Every lane has its pieces in registers: the slot may take the chunk STAGES on, once the
        // lanes' generic-proxy reads are ordered before the copy's async-proxy write.
        __syncwarp();
        if (lane == 0 && j + STAGES < chunks) {
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
            bulk_copy(smem_u32(ring + s * CHUNK), source(j + STAGES), CHUNK, bars + 8 * s, evict,
                      policy);
        }
        const uint32_t r = j % per_column, seg = r % per_row;
        const uint4* ap = a_s + seg * (CHUNK / 16);
#pragma unroll
        for (int i = 0; i < PIECES; ++i) fma_piece(acc, wv[i], ap[lane + 32 * i]);
        if (seg == per_row - 1) {
            const float sum = metrale::warp_sum(acc[0] + acc[1]);
            acc[0] = acc[1] = 0.f;
            const uint32_t col = first + j / per_column;
            if constexpr (SWIGLU) {
                if (r < per_row) {
                    gate = sum;
                } else if (lane == 0) {
                    const float g = metrale::to_f32(metrale::to_bf16(gate));
                    const float u = metrale::to_f32(metrale::to_bf16(sum));
                    c[col] = metrale::to_bf16(swiglu(g, u));
                }
            } else if (lane == 0) {
                const float b = bias != nullptr ? metrale::to_f32(bias[col]) : 0.f;
                if constexpr (std::is_same_v<Out, float>) {
                    c[col] = sum + b;
                } else {
                    c[col] = metrale::to_bf16(sum + b);
                }
            }
        }
    }
}

// The stream in the chunk a row takes: 4 KiB where k % 2048 == 0, else 2 KiB where k % 1024 == 0;
// any other k, or a block other than 256 threads (warps past 8 would have no barriers), leaves c
// unwritten.
template <bool SWIGLU, bool NORM, typename Out>
__device__ __forceinline__ void stream_any(Out* __restrict__ c,
                                           const __nv_bfloat16* __restrict__ a,
                                           const metrale::NormInput& norm,
                                           const __nv_bfloat16* __restrict__ w,
                                           const __nv_bfloat16* __restrict__ bias, uint32_t m,
                                           uint32_t cols, uint32_t k, uint32_t prewait,
                                           uint32_t evict_first) {
    if (blockDim.x == 32 * WARPS && (k * 2) % 4096 == 0) {
        stream<SWIGLU, 4096, NORM>(c, a, norm, w, bias, m, cols, k, prewait, evict_first);
    } else if (blockDim.x == 32 * WARPS && (k * 2) % 2048 == 0) {
        stream<SWIGLU, 2048, NORM>(c, a, norm, w, bias, m, cols, k, prewait, evict_first);
    } else {
        // Outside the contract: nothing written, but the programmatic-launch wait kept (a launch
        // that skipped it could end before the one it follows, and the next would not wait for
        // that one).
        metrale::grid_dependency_sync();
    }
}

}  // namespace

extern "C" __global__ void __launch_bounds__(256, 1) gemv_bf16_stream(
    __nv_bfloat16* __restrict__ c, const __nv_bfloat16* __restrict__ a,
    const __nv_bfloat16* __restrict__ w, const __nv_bfloat16* __restrict__ bias, uint32_t m,
    uint32_t n, uint32_t k, uint32_t prewait, uint32_t evict_first) {
    stream_any<false, false>(c, a, {}, w, bias, m, n, k, prewait, evict_first);
}

// gemv_bf16_stream with f32 output (the LM head: logits not rounded to bf16), as
// gemv_bf16_f32out. Launch: as gemv_bf16_stream.
extern "C" __global__ void __launch_bounds__(256, 1) gemv_bf16_stream_f32out(
    float* __restrict__ c, const __nv_bfloat16* __restrict__ a,
    const __nv_bfloat16* __restrict__ w, const __nv_bfloat16* __restrict__ bias, uint32_t m,
    uint32_t n, uint32_t k, uint32_t prewait, uint32_t evict_first) {
    stream_any<false, false>(c, a, {}, w, bias, m, n, k, prewait, evict_first);
}

// gemv_bf16_stream of the fused gate|up weight ([2 inter, k], gate rows first) with SiLU x up in
// its epilogue: out[inter] = bf16(silu(g) * u) of the bf16 products, as gemv_bf16_swiglu. No
// bias. Launch: as gemv_bf16_stream.
extern "C" __global__ void __launch_bounds__(256, 1) gemv_bf16_swiglu_stream(
    __nv_bfloat16* __restrict__ out, const __nv_bfloat16* __restrict__ a,
    const __nv_bfloat16* __restrict__ w, uint32_t m, uint32_t inter, uint32_t k, uint32_t prewait,
    uint32_t evict_first) {
    stream_any<true, false>(out, a, {}, w, nullptr, m, inter, k, prewait, evict_first);
}

// gemv_bf16_stream of bf16(rmsnorm(residual + input) * norm_weight): the residual add + RMSNorm
// and the product in one launch, A with the bits add_rmsnorm_f32res would store (as
// gemv_bf16_norm). residual_out (f32 [k], not aliasing residual) takes residual + input, stored by
// block 0; input may be null (nothing added). Launch: as gemv_bf16_stream.
extern "C" __global__ void __launch_bounds__(256, 1) gemv_bf16_stream_norm(
    __nv_bfloat16* __restrict__ c, const float* __restrict__ residual,
    float* __restrict__ residual_out, const __nv_bfloat16* __restrict__ input,
    const __nv_bfloat16* __restrict__ norm_weight, const __nv_bfloat16* __restrict__ w,
    const __nv_bfloat16* __restrict__ bias, uint32_t m, uint32_t n, uint32_t k, float eps,
    uint32_t prewait, uint32_t evict_first) {
    const metrale::NormInput in{residual, residual_out, input, norm_weight, eps};
    stream_any<false, true>(c, nullptr, in, w, bias, m, n, k, prewait, evict_first);
}

// gemv_bf16_swiglu_stream of the normalised row, as gemv_bf16_stream_norm. Launch: as
// gemv_bf16_stream.
extern "C" __global__ void __launch_bounds__(256, 1) gemv_bf16_swiglu_stream_norm(
    __nv_bfloat16* __restrict__ out, const float* __restrict__ residual,
    float* __restrict__ residual_out, const __nv_bfloat16* __restrict__ input,
    const __nv_bfloat16* __restrict__ norm_weight, const __nv_bfloat16* __restrict__ w, uint32_t m,
    uint32_t inter, uint32_t k, float eps, uint32_t prewait, uint32_t evict_first) {
    const metrale::NormInput in{residual, residual_out, input, norm_weight, eps};
    stream_any<true, true>(out, nullptr, in, w, nullptr, m, inter, k, prewait, evict_first);
}
