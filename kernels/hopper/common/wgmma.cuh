// SPDX-License-Identifier: MIT OR Apache-2.0
// Warpgroup tensor-core pieces (sm_90a): shared-memory matrix descriptors for 128-byte swizzled
// tiles, wgmma.mma_async on bf16 with f32 accumulators, and the fences and group waits around it.
//
// The tiles these descriptors describe hold rows of 64 bf16 (128 bytes) in atoms of 8 rows
// (1024 bytes, 1024-aligned); 16-byte chunk c of row r sits at chunk c ^ (r & 7) of the row. A
// matrix wider than 64 elements is several such column blocks, one after the other.
// - K-major operand (rows along M or N, the 64 elements along K): consecutive 8-row groups are
//   1024 bytes apart (the stride byte offset); the leading byte offset is unused for swizzled
//   K-major layouts (1). A k-step of 16 elements inside a 64-element block advances the start
//   address by 32 bytes.
// - MN-major operand (rows along K, the 64 elements along N): consecutive 8-row (8-k) groups are
//   1024 bytes apart (the stride byte offset), and the leading byte offset is the distance between
//   64-element column blocks. A k-step of 16 rows advances the start address by 2048 bytes.
#pragma once
#include <stdint.h>

namespace metrale::wgmma {

// Descriptor of a 128-byte swizzled shared-memory matrix at byte address `addr` (the shared
// window's address, as from __cvta_generic_to_shared) with the given leading and stride byte
// offsets. Base offset 0: the atoms start on 1024-byte boundaries.
__device__ __forceinline__ uint64_t desc_sw128(uint32_t addr, uint32_t lbo, uint32_t sbo) {
    return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)(lbo >> 4) << 16) |
           ((uint64_t)(sbo >> 4) << 32) | (1ull << 62);
}

// Orders this thread's register accesses before the warpgroup's next wgmma.mma_async.
__device__ __forceinline__ void fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }

// Closes the wgmma.mma_async operations issued since the last commit into a group.
__device__ __forceinline__ void commit() {
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

// Waits until at most N committed groups are still running.
template <int N>
__device__ __forceinline__ void wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// Makes the compiler treat `r` as read and written here, so that no access to an accumulator (or
// an A fragment) an in-flight wgmma owns moves across a commit or wait.
__device__ __forceinline__ void fence_operand(float& r) { asm volatile("" : "+f"(r)::"memory"); }
__device__ __forceinline__ void fence_operand(uint32_t& r) {
    asm volatile("" : "+r"(r)::"memory");
}
template <typename T, int N>
__device__ __forceinline__ void fence_operands(T (&r)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) fence_operand(r[i]);
}

// Writes by this thread's generic proxy (st.shared, cp.async) to shared memory become visible to
// the async proxy that wgmma reads through; a barrier after it publishes them to the warpgroup.
__device__ __forceinline__ void fence_proxy_async() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

#define METRALE_F4(d, i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3])
#define METRALE_F16(d, i) \
    METRALE_F4(d, i), METRALE_F4(d, i + 4), METRALE_F4(d, i + 8), METRALE_F4(d, i + 12)

// d (64 x 64 f32) = a (64 x 16, K-major descriptor) * b (16 x 64, K-major descriptor) + (accumulate
// ? d : 0). Thread t of the warpgroup holds, in d[4 i + 0..1], row 16 (t / 32) + (t % 32) / 4,
// columns 8 i + 2 (t % 4) + 0..1, and in d[4 i + 2..3] the same columns of the row 8 below.
__device__ __forceinline__ void mma_m64n64k16_ss(float (&d)[32], uint64_t a, uint64_t b,
                                                 bool accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, "
        "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, "
        "0;\n}\n"
        : METRALE_F16(d, 0), METRALE_F16(d, 16)
        : "l"(a), "l"(b), "r"((int)accumulate));
}

// d (64 x 128 f32) = a * b + (accumulate ? d : 0), as mma_m64n64k16_ss with i up to 15.
__device__ __forceinline__ void mma_m64n128k16_ss(float (&d)[64], uint64_t a, uint64_t b,
                                                  bool accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, "
        "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, "
        "%37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, "
        "%55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
        : METRALE_F16(d, 0), METRALE_F16(d, 16), METRALE_F16(d, 32), METRALE_F16(d, 48)
        : "l"(a), "l"(b), "r"((int)accumulate));
}

// The S = Q K^T product of a 64-row warpgroup tile against 64 or 128 keys.
__device__ __forceinline__ void mma_ss(float (&d)[32], uint64_t a, uint64_t b, bool accumulate) {
    mma_m64n64k16_ss(d, a, b, accumulate);
}
__device__ __forceinline__ void mma_ss(float (&d)[64], uint64_t a, uint64_t b, bool accumulate) {
    mma_m64n128k16_ss(d, a, b, accumulate);
}

// d (64 x 128 f32) += a (64 x 16 bf16 in registers) * b (16 x 128, MN-major descriptor). Each warp
// of the warpgroup holds its 16 rows of a as the A fragment of mma.m16n8k16 (a[0]: row g, k
// 2 (t % 4) + 0..1; a[1]: row g + 8; a[2], a[3]: the same rows at k + 8); d as in
// mma_m64n64k16_ss, with i up to 15.
__device__ __forceinline__ void mma_m64n128k16_rs_nmajor(float (&d)[64],
                                                         const uint32_t (&a)[4], uint64_t b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, "
        "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, "
        "%37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, "
        "%55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
        : METRALE_F16(d, 0), METRALE_F16(d, 16), METRALE_F16(d, 32), METRALE_F16(d, 48)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));
}

#undef METRALE_F16
#undef METRALE_F4

}  // namespace metrale::wgmma
