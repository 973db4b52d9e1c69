// SPDX-License-Identifier: MIT OR Apache-2.0
// One-row GEMV for batch-1 decode as a bulk-copy stream: c[n] = w[n, k] . a[k] (+ bias), a and c
// bf16, w bf16 (gemv_bf16_*) or FP8 E4M3 with f32 block scales (gemv_fp8_*, below). The _norm
// entries first normalise their own A (the residual add + RMSNorm before the product).
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
// The FP8 entries (gemv_fp8_stream, gemv_fp8_swiglu_stream and their _norm forms) are the same
// stream over e4m3 rows with gemv_fp8.cu's scale layout: scales[ceil(rows / 2^row_shift),
// k / 128] (row_shift 7: 128 x 128 blocks; 0: a scale per row and 128 columns), a weight being
// e4m3 x its block's scale. A row is k bytes, so its chunks are 4, 2 or 1 KiB (k % 4096, 2048 or
// 1024 == 0; the ring then of 4, 8 or 16 slots: the same 16 KiB in flight a warp), and the
// producer copies each chunk's CHUNK / 128 scales with it into a ring of scales of as many slots,
// counted on the same mbarrier. A lane's 16-byte piece is 16 weights inside one 128-column block:
// it widens them exactly (cvt e4m3x2 -> f16x2, then f32), sums their 16 products with a in f32,
// and adds that sum times the block's scale to its sums (the scale applied once a piece, as
// gemv_fp8 does; one bf16 rounding at the output). A piece takes 32 bytes of a, so lanes 4 apart
// would read a in the same banks: the FP8 form keeps a with the two 16-byte halves of every piece
// p with p & 4 swapped (a_unit), which makes the lanes' reads of a conflict-free. The bf16
// entries compile as they did before the FP8 ones joined the template (the same PTX).
//
// Dynamic shared memory: a (k bf16, rounded up to 128 bytes), then each warp's ring (RING bytes),
// then each warp's mbarriers (8 bytes each: MAX_STAGES of the format's smallest chunk), then 32
// floats for the norm's reduction, then (FP8) each warp's ring of scales (RING / 32 bytes):
// gemv_stream_smem_bytes and gemv_fp8_stream_smem_bytes in crates/kernels. Launch: any grid (the
// host gives one block an SM), 256 threads.
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <stdint.h>

#include <type_traits>

#include "common.cuh"
#include "norm.cuh"

namespace {

constexpr int WARPS = 8;
constexpr uint32_t RING = 16384;    // bytes each warp has in flight: 128 KiB a block
constexpr uint32_t UNIT = 4096;     // the largest chunk; `prewait` counts these
constexpr uint32_t MAX_K = 1u << 16;  // the host's shared-memory bound is lower (50176)
constexpr uint32_t SCALE_COLS = 128;  // FP8 columns a scale covers

// A bf16 weight [rows, k], row-major.
struct Bf16Weight {
    static constexpr uint32_t BYTES = 2;         // a weight's bytes
    static constexpr uint32_t MIN_CHUNK = 2048;  // the smallest chunk a row is cut into
    const __nv_bfloat16* w;
    // The format's own part of the launch contract.
    __device__ __forceinline__ bool fits() const { return true; }
};

// An e4m3 weight [rows, k], row-major, with f32 scales [ceil(rows / 2^row_shift), k / 128].
struct Fp8Weight {
    static constexpr uint32_t BYTES = 1;
    static constexpr uint32_t MIN_CHUNK = 1024;
    const uint8_t* w;
    const float* scales;
    uint32_t row_shift;
    // Scales whole 16-byte units for the bulk copies, and a row shift that is one.
    __device__ __forceinline__ bool fits() const {
        return (reinterpret_cast<uintptr_t>(scales) & 15) == 0 && row_shift < 32;
    }
};

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

// bulk_copy without the arrival: `bar` expects `bytes` more of the phase the producer's
// bulk_copy then arrives on (the FP8 chunk's scales, copied just before its weights).
__device__ __forceinline__ void bulk_copy_more(uint32_t dst, const void* src, uint32_t bytes,
                                               uint32_t bar) {
    asm volatile("mbarrier.expect_tx.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
            dst),
        "l"(src), "r"(bytes), "r"(bar)
        : "memory");
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

// The two e4m3 of the low 16 bits of v (lower byte first), exactly: cvt to f16x2, then f32.
__device__ __forceinline__ float2 e4m3x2(uint32_t v) {
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(v & 0xffffu), __NV_E4M3);
    return __half22float2(__half2(h));
}

// acc + scale * (the 16 e4m3 of w) . (the 16 bf16 of a0, then a1), the products summed in order
// in one f32 chain.
__device__ __forceinline__ float fma_fp8_piece(float acc, uint4 w, uint4 a0, uint4 a1,
                                               float scale) {
    const uint32_t ws[4] = {w.x, w.y, w.z, w.w};
    const uint32_t as[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
    float s = 0.f;
#pragma unroll
    for (int q = 0; q < 4; ++q) {
        const float2 p = e4m3x2(ws[q]), r = e4m3x2(ws[q] >> 16);
        s = fmaf(p.x, lo(as[2 * q]), s);
        s = fmaf(p.y, hi(as[2 * q]), s);
        s = fmaf(r.x, lo(as[2 * q + 1]), s);
        s = fmaf(r.y, hi(as[2 * q + 1]), s);
    }
    return fmaf(s, scale, acc);
}

// Where the 16-byte unit u of a (elements 8u .. 8u + 7) lies in shared memory: in place for bf16
// weights; for FP8, the two halves of every 32-byte piece p = u / 2 with p & 4 swapped, so that
// lanes 4 apart (pieces 4 apart) read different banks.
template <typename W>
__device__ __forceinline__ uint32_t a_unit(uint32_t u) {
    if constexpr (std::is_same_v<W, Fp8Weight>) {
        return u ^ ((u >> 3) & 1);
    } else {
        return u;
    }
}

// silu(g) * u of the bf16 products, as gemv_bf16_swiglu's epilogue computes it.
__device__ __forceinline__ float swiglu(float g, float u) { return g / (1.0f + __expf(-g)) * u; }

// The stream over `cols` output columns in chunks of CHUNK bytes. Plain: column v's weight row is
// row v of w. SWIGLU: w is [2 cols, k] (gate rows, then up rows) and column v streams gate row v,
// then up row cols + v, and stores silu(bf16(g)) * bf16(u). NORM: A is `norm` normalised, not `a`.
// The caller checked the block size and that CHUNK divides a row: `ok` is the rest of the launch
// contract.
template <typename W, bool SWIGLU, uint32_t CHUNK, bool NORM, typename Out>
__device__ __forceinline__ void stream(Out* __restrict__ c,
                                       const __nv_bfloat16* __restrict__ a,
                                       const metrale::NormInput& norm, const W& weight,
                                       const __nv_bfloat16* __restrict__ bias, uint32_t m,
                                       uint32_t cols, uint32_t k, uint32_t prewait,
                                       uint32_t evict_first) {
    constexpr bool FP8 = std::is_same_v<W, Fp8Weight>;
    constexpr uint32_t STAGES = RING / CHUNK;          // ring slots: 4 of 4 KiB ... 16 of 1 KiB
    constexpr uint32_t MAX_STAGES = RING / W::MIN_CHUNK;  // slots of the smallest chunk's ring
    constexpr int PIECES = CHUNK / 16 / 32;            // 16-byte pieces a lane reads a chunk
    // A chunk's scales (FP8): one a 128 columns, a whole number of 16-byte copies.
    constexpr uint32_t SCALE_BYTES = FP8 ? CHUNK / SCALE_COLS * 4 : 0;
    static_assert(STAGES <= MAX_STAGES && (STAGES & (STAGES - 1)) == 0, "ring of 2^n slots");
    static_assert(SCALE_BYTES % 16 == 0, "bulk copies of whole 16-byte units");
    extern __shared__ __align__(128) unsigned char smem[];
    const uint32_t lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const uintptr_t a_addr = NORM ? 0 : reinterpret_cast<uintptr_t>(a);
    const bool ok = m == 1 && k != 0 && k <= MAX_K &&
                    ((a_addr | reinterpret_cast<uintptr_t>(weight.w)) & 15) == 0 && weight.fits();
    const uint32_t a_bytes = ok ? (k * 2 + 127) / 128 * 128 : 0;
    const uint32_t per_row = ok ? k * W::BYTES / CHUNK : 1;
    // Chunks of one output column: one weight row, or the gate row and the up row.
    const uint32_t per_column = SWIGLU ? 2 * per_row : per_row;

    uint4* a_s = reinterpret_cast<uint4*>(smem);
    unsigned char* ring = smem + a_bytes + warp * STAGES * CHUNK;
    const uint32_t bars = smem_u32(smem + a_bytes + WARPS * RING) + warp * MAX_STAGES * 8;
    float* scratch = reinterpret_cast<float*>(smem + a_bytes + WARPS * RING + WARPS * MAX_STAGES * 8);
    // FP8: slot s of this warp's ring of scales, which holds the scales of the chunk in slot s.
    auto scale_slot = [&](uint32_t s) {
        return scratch + 32 + warp * (STAGES * SCALE_BYTES / 4) + s * (SCALE_BYTES / 4);
    };

    // This warp's columns [first, last) and their chunks.
    const uint64_t warps = (uint64_t)gridDim.x * WARPS;
    const uint64_t gw = (uint64_t)blockIdx.x * WARPS + warp;
    const uint32_t first = ok ? (uint32_t)(gw * cols / warps) : 0;
    const uint32_t last = ok ? (uint32_t)((gw + 1) * cols / warps) : 0;
    const uint32_t chunks = (last - first) * per_column;
    const unsigned char* w8 = reinterpret_cast<const unsigned char*>(weight.w);
    const size_t row_bytes = (size_t)k * W::BYTES;

    // Where chunk j of this warp's run starts in w.
    auto source = [&](uint32_t j) {
        const uint32_t col = first + j / per_column, r = j % per_column;
        const size_t row = SWIGLU && r >= per_row ? (size_t)cols + col : col;
        return w8 + row * row_bytes + (size_t)(r % per_row) * CHUNK;
    };
    // FP8: copies the scales of chunk j into scale slot s, on slot s's barrier (before the chunk's
    // own bulk_copy arrives on it), under the default policy: a block's scales serve 128 rows.
    auto copy_scales = [&](uint32_t j, uint32_t s) {
        if constexpr (FP8) {
            const uint32_t col = first + j / per_column, r = j % per_column;
            const size_t row = SWIGLU && r >= per_row ? (size_t)cols + col : col;
            const float* src = weight.scales + (row >> weight.row_shift) * (k / SCALE_COLS) +
                               (r % per_row) * (CHUNK / SCALE_COLS);
            bulk_copy_more(smem_u32(scale_slot(s)), src, SCALE_BYTES, bars + 8 * s);
        }
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
        for (uint32_t j = 0; j < early; ++j) {
            copy_scales(j, j);
            bulk_copy(smem_u32(ring + j * CHUNK), source(j), CHUNK, bars + 8 * j, evict, policy);
        }
    }
    __syncwarp();

    metrale::grid_dependency_sync();
    if (!ok) return;
    if (lane == 0)
        for (uint32_t j = early; j < fill; ++j) {
            copy_scales(j, j);
            bulk_copy(smem_u32(ring + j * CHUNK), source(j), CHUNK, bars + 8 * j, evict, policy);
        }

    if constexpr (NORM) {
        // A from the residual stream (block 0 also stores the sums); ends with a barrier.
        metrale::normalise_input<1>(reinterpret_cast<__nv_bfloat16*>(a_s), norm, k, scratch);
        if constexpr (FP8) {
            // Into a_unit's order: swap the halves of the pieces it swaps (disjoint pairs).
            for (uint32_t p = threadIdx.x; p < k / 16; p += blockDim.x) {
                if (a_unit<W>(2 * p) != 2 * p) {
                    const uint4 x = a_s[2 * p], y = a_s[2 * p + 1];
                    a_s[2 * p] = y;
                    a_s[2 * p + 1] = x;
                }
            }
            __syncthreads();
        }
    } else {
        // a into shared memory, whole 16-byte pieces (k % 1024 == 0 here).
        const uint4* a4 = reinterpret_cast<const uint4*>(a);
        for (uint32_t i = threadIdx.x; i < k / 8; i += blockDim.x) a_s[a_unit<W>(i)] = a4[i];
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
        // FP8: piece lane + 32 i of the chunk lies in its 128-column block (lane + 32 i) / 8.
        float scale[FP8 ? PIECES : 1];
        if constexpr (FP8) {
            const float* slot_scales = scale_slot(s);
#pragma unroll
            for (int i = 0; i < PIECES; ++i) scale[i] = slot_scales[lane / 8 + 4 * i];
        }
        // Every lane has its pieces in registers: the slot may take the chunk STAGES on, once the
        // lanes' generic-proxy reads are ordered before the copy's async-proxy write.
        __syncwarp();
        if (lane == 0 && j + STAGES < chunks) {
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
            copy_scales(j + STAGES, s);
            bulk_copy(smem_u32(ring + s * CHUNK), source(j + STAGES), CHUNK, bars + 8 * s, evict,
                      policy);
        }
        const uint32_t r = j % per_column, seg = r % per_row;
        if constexpr (FP8) {
            // The lane's pieces lane + 32 i all have p & 4 == lane & 4: their units of a in
            // a_unit's order are the first and second half, or the second and first.
            const uint32_t swap = (lane >> 2) & 1;
            const uint4* a_first = a_s + 2 * (seg * (CHUNK / 16) + lane) + swap;
            const uint4* a_second = a_s + 2 * (seg * (CHUNK / 16) + lane) + (swap ^ 1);
#pragma unroll
            for (int i = 0; i < PIECES; ++i) {
                acc[i & 1] = fma_fp8_piece(acc[i & 1], wv[i], a_first[64 * i], a_second[64 * i],
                                           scale[i]);
            }
        } else {
            const uint4* ap = a_s + seg * (CHUNK / 16);
#pragma unroll
            for (int i = 0; i < PIECES; ++i) fma_piece(acc, wv[i], ap[lane + 32 * i]);
        }
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

// The stream in the largest chunk that divides a row: 4 KiB, else 2 KiB, else (FP8) 1 KiB; any
// other k, or a block other than 256 threads (warps past 8 would have no barriers), leaves c
// unwritten.
template <typename W, bool SWIGLU, bool NORM, typename Out>
__device__ __forceinline__ void stream_any(Out* __restrict__ c,
                                           const __nv_bfloat16* __restrict__ a,
                                           const metrale::NormInput& norm, const W& weight,
                                           const __nv_bfloat16* __restrict__ bias, uint32_t m,
                                           uint32_t cols, uint32_t k, uint32_t prewait,
                                           uint32_t evict_first) {
    const uint32_t row_bytes = k * W::BYTES;
    // The format's smallest chunk where it is below 2 KiB (FP8's 1 KiB; bf16 rows have none).
    constexpr uint32_t SMALL = W::MIN_CHUNK;
    if (blockDim.x == 32 * WARPS && row_bytes % 4096 == 0) {
        stream<W, SWIGLU, 4096, NORM>(c, a, norm, weight, bias, m, cols, k, prewait, evict_first);
    } else if (blockDim.x == 32 * WARPS && row_bytes % 2048 == 0) {
        stream<W, SWIGLU, 2048, NORM>(c, a, norm, weight, bias, m, cols, k, prewait, evict_first);
    } else if (SMALL < 2048 && blockDim.x == 32 * WARPS && row_bytes % SMALL == 0) {
        stream<W, SWIGLU, SMALL, NORM>(c, a, norm, weight, bias, m, cols, k, prewait, evict_first);
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
    stream_any<Bf16Weight, false, false>(c, a, {}, Bf16Weight{w}, bias, m, n, k, prewait,
                                         evict_first);
}

// gemv_bf16_stream with f32 output (the LM head: logits not rounded to bf16), as
// gemv_bf16_f32out. Launch: as gemv_bf16_stream.
extern "C" __global__ void __launch_bounds__(256, 1) gemv_bf16_stream_f32out(
    float* __restrict__ c, const __nv_bfloat16* __restrict__ a,
    const __nv_bfloat16* __restrict__ w, const __nv_bfloat16* __restrict__ bias, uint32_t m,
    uint32_t n, uint32_t k, uint32_t prewait, uint32_t evict_first) {
    stream_any<Bf16Weight, false, false>(c, a, {}, Bf16Weight{w}, bias, m, n, k, prewait,
                                         evict_first);
}

// gemv_bf16_stream of the fused gate|up weight ([2 inter, k], gate rows first) with SiLU x up in
// its epilogue: out[inter] = bf16(silu(g) * u) of the bf16 products, as gemv_bf16_swiglu. No
// bias. Launch: as gemv_bf16_stream.
extern "C" __global__ void __launch_bounds__(256, 1) gemv_bf16_swiglu_stream(
    __nv_bfloat16* __restrict__ out, const __nv_bfloat16* __restrict__ a,
    const __nv_bfloat16* __restrict__ w, uint32_t m, uint32_t inter, uint32_t k, uint32_t prewait,
    uint32_t evict_first) {
    stream_any<Bf16Weight, true, false>(out, a, {}, Bf16Weight{w}, nullptr, m, inter, k, prewait,
                                        evict_first);
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
    stream_any<Bf16Weight, false, true>(c, nullptr, in, Bf16Weight{w}, bias, m, n, k, prewait,
                                        evict_first);
}

// gemv_bf16_swiglu_stream of the normalised row, as gemv_bf16_stream_norm. Launch: as
// gemv_bf16_stream.
extern "C" __global__ void __launch_bounds__(256, 1) gemv_bf16_swiglu_stream_norm(
    __nv_bfloat16* __restrict__ out, const float* __restrict__ residual,
    float* __restrict__ residual_out, const __nv_bfloat16* __restrict__ input,
    const __nv_bfloat16* __restrict__ norm_weight, const __nv_bfloat16* __restrict__ w, uint32_t m,
    uint32_t inter, uint32_t k, float eps, uint32_t prewait, uint32_t evict_first) {
    const metrale::NormInput in{residual, residual_out, input, norm_weight, eps};
    stream_any<Bf16Weight, true, true>(out, nullptr, in, Bf16Weight{w}, nullptr, m, inter, k,
                                       prewait, evict_first);
}

// gemv_bf16_stream over an e4m3 weight [n, k] with f32 scales [ceil(n / 2^row_shift), k / 128]
// (row_shift 7 or 0; a weight is e4m3 x its scale): c = bf16(a . w + bias), the same product as
// gemv_fp8 (m = 1) in another order of f32 sums. k % 1024 == 0; a, w and scales 16-byte aligned.
// Launch: as gemv_bf16_stream, with gemv_fp8_stream_smem_bytes.
extern "C" __global__ void __launch_bounds__(256, 1) gemv_fp8_stream(
    __nv_bfloat16* __restrict__ c, const __nv_bfloat16* __restrict__ a,
    const uint8_t* __restrict__ w, const float* __restrict__ scales,
    const __nv_bfloat16* __restrict__ bias, uint32_t m, uint32_t n, uint32_t k, uint32_t row_shift,
    uint32_t prewait, uint32_t evict_first) {
    stream_any<Fp8Weight, false, false>(c, a, {}, Fp8Weight{w, scales, row_shift}, bias, m, n, k,
                                        prewait, evict_first);
}

// gemv_fp8_stream of the fused gate|up e4m3 weight ([2 inter, k], gate rows first; scales of the
// stacked rows) with SiLU x up in its epilogue, as gemv_fp8_swiglu. Launch: as gemv_fp8_stream.
extern "C" __global__ void __launch_bounds__(256, 1) gemv_fp8_swiglu_stream(
    __nv_bfloat16* __restrict__ out, const __nv_bfloat16* __restrict__ a,
    const uint8_t* __restrict__ w, const float* __restrict__ scales, uint32_t m, uint32_t inter,
    uint32_t k, uint32_t row_shift, uint32_t prewait, uint32_t evict_first) {
    stream_any<Fp8Weight, true, false>(out, a, {}, Fp8Weight{w, scales, row_shift}, nullptr, m,
                                       inter, k, prewait, evict_first);
}

// gemv_fp8_stream of the normalised row, as gemv_bf16_stream_norm. Launch: as gemv_fp8_stream.
extern "C" __global__ void __launch_bounds__(256, 1) gemv_fp8_stream_norm(
    __nv_bfloat16* __restrict__ c, const float* __restrict__ residual,
    float* __restrict__ residual_out, const __nv_bfloat16* __restrict__ input,
    const __nv_bfloat16* __restrict__ norm_weight, const uint8_t* __restrict__ w,
    const float* __restrict__ scales, const __nv_bfloat16* __restrict__ bias, uint32_t m,
    uint32_t n, uint32_t k, float eps, uint32_t row_shift, uint32_t prewait,
    uint32_t evict_first) {
    const metrale::NormInput in{residual, residual_out, input, norm_weight, eps};
    stream_any<Fp8Weight, false, true>(c, nullptr, in, Fp8Weight{w, scales, row_shift}, bias, m, n,
                                       k, prewait, evict_first);
}

// gemv_fp8_swiglu_stream of the normalised row, as gemv_bf16_stream_norm. Launch: as
// gemv_fp8_stream.
extern "C" __global__ void __launch_bounds__(256, 1) gemv_fp8_swiglu_stream_norm(
    __nv_bfloat16* __restrict__ out, const float* __restrict__ residual,
    float* __restrict__ residual_out, const __nv_bfloat16* __restrict__ input,
    const __nv_bfloat16* __restrict__ norm_weight, const uint8_t* __restrict__ w,
    const float* __restrict__ scales, uint32_t m, uint32_t inter, uint32_t k, float eps,
    uint32_t row_shift, uint32_t prewait, uint32_t evict_first) {
    const metrale::NormInput in{residual, residual_out, input, norm_weight, eps};
    stream_any<Fp8Weight, true, true>(out, nullptr, in, Fp8Weight{w, scales, row_shift}, nullptr, m,
                                      inter, k, prewait, evict_first);
}
