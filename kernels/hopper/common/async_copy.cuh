// SPDX-License-Identifier: MIT OR Apache-2.0
// Global -> shared copies for the attention kernels: 16-byte cp.async, the swizzled row layout of
// shared K/V tiles, and the paged-cache slot of a key.
#pragma once
#include <stdint.h>

namespace metrale {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared, bypassing L1; with `valid` false the destination is zero-filled and
// `src` is not read.
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
                 "r"(valid ? 16 : 0)
                 : "memory");
}

__device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}

// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Element offset of 16-byte chunk `chunk` of row `row` in a swizzled tile of HD-wide rows.
template <int HD>
__device__ __forceinline__ int swizzle(int row, int chunk) {
    return row * HD + ((chunk ^ (row & 7)) << 3);
}

// Cache block and offset of a key: shifts when block_size is a power of two.
struct BlockSplit {
    uint32_t size, shift;
    bool pow2;
    __device__ __forceinline__ explicit BlockSplit(uint32_t block_size)
        : size(block_size), shift(__ffs(block_size) - 1), pow2((block_size & (block_size - 1)) == 0) {}
    __device__ __forceinline__ uint32_t slot(const int32_t* table, uint32_t key) const {
        const uint32_t b = pow2 ? key >> shift : key / size;
        const uint32_t o = pow2 ? key & (size - 1) : key - b * size;
        return (uint32_t)table[b] * size + o;
    }
};

}  // namespace metrale
