// SPDX-License-Identifier: MIT OR Apache-2.0
// Element-wise arithmetic. out may alias a or b.
// Launch: grid = ceil(n / 256), block = 256.
#include "common.cuh"

extern "C" __global__ void add_bf16(__nv_bfloat16* out, const __nv_bfloat16* a,
                                    const __nv_bfloat16* b, uint32_t n) {
    metrale::grid_dependency_sync();
    const uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = metrale::to_bf16(metrale::to_f32(a[i]) + metrale::to_f32(b[i]));
}
