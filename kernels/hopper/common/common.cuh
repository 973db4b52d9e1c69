// SPDX-License-Identifier: MIT OR Apache-2.0
// Helpers shared by the Hopper baseline kernels: bf16 conversion and block reductions.
#pragma once
#include <cuda_bf16.h>
#include <stdint.h>

#ifdef METRALE_TRACE
// A trace build's in-step timeline (METRALE_EXTRA_NVCC_FLAGS=-DMETRALE_TRACE; `met bench-model
// --timeline`). When the host has pointed this module's metrale_trace_buffer at device memory (u64
// words: the records written, the capacity in records, then four words a record), block 0 of
// every launch records the %globaltimer when it reached its programmatic-launch wait and when the
// wait returned, its grid's block count (high half) and block size (low half), and its SM.
// Release builds have neither the variable nor the code.
extern "C" {
__device__ unsigned long long* metrale_trace_buffer = nullptr;
}
#endif

namespace metrale {

#ifdef METRALE_TRACE
// Records a trace buffer holds (the host allocates room for this many: trace.rs TRACE_CAPACITY).
constexpr unsigned long long TRACE_CAPACITY = 1ull << 16;

__device__ __forceinline__ unsigned long long trace_clock() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// The trace buffer for block 0's thread 0 of a traced launch, else null.
__device__ __forceinline__ unsigned long long* trace_buffer() {
    if ((threadIdx.x | threadIdx.y | threadIdx.z) != 0 || (blockIdx.x | blockIdx.y | blockIdx.z) != 0) {
        return nullptr;
    }
    return metrale_trace_buffer;
}

// Block 0's record (see metrale_trace_buffer) in slot `slot`.
__device__ __forceinline__ void trace_record(unsigned long long* buf, unsigned long long slot,
                                             unsigned long long entered,
                                             unsigned long long released) {
    if (slot >= TRACE_CAPACITY) return;
    unsigned int sm;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    unsigned long long* r = buf + 2 + 4 * slot;
    r[0] = entered;
    r[1] = released;
    r[2] = ((unsigned long long)(gridDim.x * gridDim.y * gridDim.z) << 32) |
           (blockDim.x * blockDim.y * blockDim.z);
    r[3] = sm;
}
#endif

// Programmatic dependent launch. The CUDA backend may launch a kernel while the one before it on
// the stream is still running (unless METRALE_PDL=0); such a kernel must not write global memory,
// nor read any that a kernel of the step writes, until the previous grid has finished and its
// writes are visible. Every kernel entry calls this first, except for work on data no kernel
// writes (the decode attention looks up its block-table slots before it, the staged GEMVs copy
// weights) and, in the fused decode attention, cache rows that only kernels launched before the
// one just before it can have written (that one is the QKV product); it also lets the next
// kernel be scheduled as soon as this one's blocks have passed the wait. Because every kernel
// launches its dependents only after its own wait, a kernel's pre-wait code overlaps only the
// kernel just before it: every earlier kernel has finished by then. Never launch dependents
// before the wait: a GEMV that did read stale data in a kernel two launches later (Qwen3-0.6B
// parity failed while every kernel passed alone; docs/results/2026-12-01-speed-h200/
// gemv-prewait). Loads issued before the wait whose values are first used after it may be moved
// after it by ptxas (seen in the SASS); cp.async and prefetches stay. Without a programmatic
// dependency both instructions do nothing.
__device__ __forceinline__ void grid_dependency_sync() {
#ifdef METRALE_TRACE
    // The slot is taken before the wait, so that its atomic's latency hides behind the wait and
    // launch order is slot order (the next launch starts only after this one's blocks have
    // passed their waits); the record's stores go out after the dependents are launched.
    unsigned long long* trace = trace_buffer();
    const unsigned long long entered = trace_clock();
    const unsigned long long slot = trace != nullptr ? atomicAdd(trace, 1ull) : 0;
#endif
    asm volatile("griddepcontrol.wait;" ::: "memory");
#ifdef METRALE_TRACE
    const unsigned long long released = trace_clock();
#endif
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#ifdef METRALE_TRACE
    if (trace != nullptr) trace_record(trace, slot, entered, released);
#endif
}

__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ __nv_bfloat16 to_bf16(float x) { return __float2bfloat16_rn(x); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1)
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
    return v;
}

// Sum over the whole block; every thread gets the result. blockDim.x must be a multiple of 32
// and at most 1024. `scratch` holds 32 floats.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    v = warp_sum(v);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    const int warps = blockDim.x >> 5;
    v = (threadIdx.x < warps) ? scratch[threadIdx.x] : 0.0f;
    if (warp == 0) v = warp_sum(v);
    if (threadIdx.x == 0) scratch[0] = v;
    __syncthreads();
    v = scratch[0];
    __syncthreads();
    return v;
}

}  // namespace metrale
