// SPDX-License-Identifier: MIT OR Apache-2.0
// A grid-wide barrier, on its own: the step a persistent decode kernel would take between its
// phases (docs/persistent-decode.md), timed by bench-kernels and checked by check-kernels before
// anything is built on it. Not on the engine's path.
//
// grid_barrier_u32 runs `phases` phases with a barrier between each two. In phase p, block b
// first (p > 0) adds to its checksum the word block (b + 1) % blocks wrote in phase p - 1, then
// writes p * blocks + b to data[p % 2][b]; out[b] is the checksum. A barrier that let a block
// through early, or did not make the other blocks' writes visible, changes the checksums.
//
// The barrier: thread 0 of each block, after the block's barrier and a gpu-scope fence, reads the
// generation word, then adds one to the arrival count; the block that brings the count to
// `blocks` sets it back to zero and then bumps the generation; the others wait for the
// generation to move (the fence after it orders what they read next). Every block must be
// resident at once: the launch takes at most one block per SM. A wait longer than two seconds
// gives up and marks the block's checksum 0xffffffff, so that a grid that cannot be resident fails
// the check instead of hanging.
#include "common.cuh"

namespace {

__device__ __forceinline__ uint64_t global_ns() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// Returns false if the wait timed out (the grid is not all resident).
__device__ __forceinline__ bool grid_barrier(uint32_t* count, uint32_t* generation,
                                             uint32_t blocks) {
    __shared__ bool ok;
    __syncthreads();
    if (threadIdx.x == 0) {
        ok = true;
        __threadfence();
        const uint32_t gen = *reinterpret_cast<volatile uint32_t*>(generation);
        if (atomicAdd(count, 1u) + 1 == blocks) {
            atomicExch(count, 0u);
            __threadfence();
            atomicAdd(generation, 1u);
        } else {
            const uint64_t start = global_ns();
            while (*reinterpret_cast<volatile uint32_t*>(generation) == gen) {
                if (global_ns() - start > 2000000000ull) {
                    ok = false;
                    break;
                }
            }
        }
        __threadfence();
    }
    __syncthreads();
    return ok;
}

}  // namespace

// Launch: grid = blocks (at most one per SM, all resident), block = any multiple of 32. sync is
// u32 [2] (arrival count, generation), zero before the launch; the count is zero again after it
// and the generation has moved by phases - 1. data is u32 [2, blocks], out u32 [blocks].
extern "C" __global__ void grid_barrier_u32(uint32_t* __restrict__ sync, uint32_t* __restrict__ data,
                                            uint32_t* __restrict__ out, uint32_t blocks,
                                            uint32_t phases) {
    metrale::grid_dependency_sync();
    if (gridDim.x != blocks || blocks == 0) return;
    const uint32_t b = blockIdx.x;
    uint32_t sum = 0;
    bool ok = true;
    for (uint32_t p = 0; p < phases; ++p) {
        if (p > 0) {
            ok = grid_barrier(sync, sync + 1, blocks);
            if (!ok) break;
            if (threadIdx.x == 0) {
                sum += *reinterpret_cast<volatile uint32_t*>(data + ((p - 1) % 2) * blocks +
                                                             (b + 1) % blocks);
            }
        }
        if (threadIdx.x == 0) data[(p % 2) * blocks + b] = p * blocks + b;
    }
    if (threadIdx.x == 0) out[b] = ok ? sum : 0xffffffffu;
}
