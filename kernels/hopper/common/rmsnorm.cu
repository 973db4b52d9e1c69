// SPDX-License-Identifier: MIT OR Apache-2.0
// RMSNorm, and the fused residual add + RMSNorm of a pre-norm decoder.
//
// Precision: the residual stream is f32 and every sum into it is exact f32 arithmetic; a norm's
// output is computed in f32 and rounded to bf16 once, as the input of the next GEMM. Rounding the
// residual to bf16 after every add (as a bf16 PyTorch model does) is the largest source of error
// against the f32 function of the same bf16 weights; see docs/precision.md.
// Launch: grid = rows, block = 256 (any multiple of 32 up to 1024), no dynamic shared memory
// (add_rmsnorm_f32res_fp8_rows: grid = rows rounded up to 16).
#include "fp8_rows.cuh"
#include "norm.cuh"

// out[r, :] = bf16(x * rsqrt(mean(x^2) + eps) * weight), x bf16 (Qwen3's per-head q/k norm).
extern "C" __global__ void rmsnorm_bf16(__nv_bfloat16* __restrict__ out,
                                        const __nv_bfloat16* __restrict__ input,
                                        const __nv_bfloat16* __restrict__ weight, uint32_t rows,
                                        uint32_t cols, float eps) {
    metrale::grid_dependency_sync();
    __shared__ float scratch[32];
    const uint32_t r = blockIdx.x;
    if (r >= rows) return;
    const __nv_bfloat16* x = input + (size_t)r * cols;
    float sq = 0.0f;
    for (uint32_t i = threadIdx.x; i < cols; i += blockDim.x) {
        const float v = metrale::to_f32(x[i]);
        sq += v * v;
    }
    const float inv = metrale::inverse_rms(sq, cols, eps, scratch);
    __nv_bfloat16* y = out + (size_t)r * cols;
    for (uint32_t i = threadIdx.x; i < cols; i += blockDim.x) {
        y[i] = metrale::to_bf16(metrale::to_f32(x[i]) * inv * metrale::to_f32(weight[i]));
    }
}

namespace {
constexpr int UNROLL = 4;  // 16-byte pieces per thread in flight per pass
using metrale::add4;
using metrale::add_squares4;
using metrale::aligned;
using metrale::inverse_rms;
using metrale::scaled4;
}  // namespace

// residual[r, :] += input[r, :] in f32 (skipped when input is null); then
// out[r, :] = bf16(residual * rsqrt(mean(residual^2) + eps) * (weight_offset + weight)), the scale
// summed in f32 (norm.cuh's norm_scale): weight_offset 1 for Qwen3-Next's norms, whose weight is
// stored centred on zero; 0 for every other model, the plain weight bit for bit.
// `residual` is f32 and updated in place; `out` must not alias it.
// When cols % 4 == 0 (and the rows are aligned) each thread moves 4 columns per access and keeps
// UNROLL accesses in flight: a decode row (one block) is otherwise a chain of dependent loads.
extern "C" __global__ void add_rmsnorm_f32res(__nv_bfloat16* __restrict__ out,
                                              float* __restrict__ residual,
                                              const __nv_bfloat16* __restrict__ input,
                                              const __nv_bfloat16* __restrict__ weight,
                                              uint32_t rows, uint32_t cols, float eps,
                                              float weight_offset) {
    metrale::grid_dependency_sync();
    __shared__ float scratch[32];
    const uint32_t r = blockIdx.x;
    if (r >= rows) return;
    float* res = residual + (size_t)r * cols;
    const __nv_bfloat16* x = input == nullptr ? nullptr : input + (size_t)r * cols;
    __nv_bfloat16* y = out + (size_t)r * cols;
    const bool vec = cols % 4 == 0 && aligned(res, 16) && aligned(y, 8) && aligned(weight, 8) &&
                     (x == nullptr || aligned(x, 8));
    float sq = 0.0f;
    if (vec) {
        const uint32_t n4 = cols / 4, step = blockDim.x;
        float4* res4 = reinterpret_cast<float4*>(res);
        const uint2* x4 = reinterpret_cast<const uint2*>(x);
        const uint2* w4 = reinterpret_cast<const uint2*>(weight);
        uint2* y4 = reinterpret_cast<uint2*>(y);
        if (n4 <= step * UNROLL) {
            // The row in one pass (Qwen3's 1024 and 4096 columns at 256 threads): the weights
            // load with the residual and the input, and the output is computed from registers,
            // so a decode row waits for memory once instead of twice. The same arithmetic in the
            // same order as the loops below.
            float4 v[UNROLL];
            uint2 xv[UNROLL], wv[UNROLL];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const uint32_t i = threadIdx.x + u * step;
                if (i < n4) {
                    v[u] = res4[i];
                    if (x != nullptr) xv[u] = x4[i];
                    wv[u] = w4[i];
                }
            }
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const uint32_t i = threadIdx.x + u * step;
                if (i < n4) {
                    if (x != nullptr) {
                        add4(v[u], xv[u]);
                        res4[i] = v[u];
                    }
                    sq = add_squares4(sq, v[u]);
                }
            }
            const float inv = inverse_rms(sq, cols, eps, scratch);
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const uint32_t i = threadIdx.x + u * step;
                if (i < n4) y4[i] = scaled4(v[u], inv, wv[u], weight_offset);
            }
            return;
        }
        for (uint32_t base = threadIdx.x; base < n4; base += step * UNROLL) {
            float4 v[UNROLL];
            uint2 xv[UNROLL];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const uint32_t i = base + u * step;
                if (i < n4) {
                    v[u] = res4[i];
                    if (x != nullptr) xv[u] = x4[i];
                }
            }
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const uint32_t i = base + u * step;
                if (i < n4) {
                    if (x != nullptr) {
                        add4(v[u], xv[u]);
                        res4[i] = v[u];
                    }
                    sq = add_squares4(sq, v[u]);
                }
            }
        }
        const float inv = inverse_rms(sq, cols, eps, scratch);
        // Each thread re-reads only the pieces it wrote itself, so no barrier is needed here.
        for (uint32_t base = threadIdx.x; base < n4; base += step * UNROLL) {
            float4 v[UNROLL];
            uint2 wv[UNROLL];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const uint32_t i = base + u * step;
                if (i < n4) {
                    v[u] = res4[i];
                    wv[u] = w4[i];
                }
            }
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const uint32_t i = base + u * step;
                if (i < n4) y4[i] = scaled4(v[u], inv, wv[u], weight_offset);
            }
        }
        return;
    }
    for (uint32_t i = threadIdx.x; i < cols; i += blockDim.x) {
        float s = res[i];
        if (x != nullptr) {
            s += metrale::to_f32(x[i]);
            res[i] = s;
        }
        sq += s * s;
    }
    const float inv = inverse_rms(sq, cols, eps, scratch);
    // Each thread re-reads only the elements it wrote itself, so no barrier is needed here.
    for (uint32_t i = threadIdx.x; i < cols; i += blockDim.x) {
        y[i] = metrale::to_bf16(res[i] * inv *
                                metrale::norm_scale(metrale::to_f32(weight[i]), weight_offset));
    }
}

// add_rmsnorm_f32res with its output as the FP8 library product's activation rows (fp8_rows.cuh)
// instead of bf16, for a product that reads them (the engine's qkv and gate|up products on the
// FP8 GEMM): the residual updated as add_rmsnorm_f32res updates it, each normalised value rounded
// to bf16 as that kernel stores it, and those bf16 rows quantized as fp8_quantize_rows quantizes
// them, so one launch stores the bits of the two (with the same vector-path choice: the rows
// aligned, as the engine's buffers are). q is e4m3 [round_up(rows, 16), cols], scales f32 in
// fp8_rows' layout over round_up(rows, 16) rows; the blocks past `rows` write their row's zero
// values and scales 1.
// The sums of squares are add_rmsnorm_f32res's, thread by thread. The output is taken a 128-column
// block a warp: in the vector path thread t's 4-column pieces t, t + blockDim.x, ... lie in
// k-blocks warp, warp + warps, ... (blockDim.x a multiple of 32), so each warp holds whole blocks
// and every loop over pieces runs while any lane of the warp has one (store_block4 is warp-wide);
// the scalar path (cols % 4 != 0, or rows not aligned) re-reads the row by k-block a warp after
// the reduction's barriers have made the residual's stores visible to the block.
// Launch: grid = round_up(rows, 16), block = 256 (any multiple of 32 up to 1024).
extern "C" __global__ void add_rmsnorm_f32res_fp8_rows(uint8_t* __restrict__ q,
                                                       float* __restrict__ scales,
                                                       float* __restrict__ residual,
                                                       const __nv_bfloat16* __restrict__ input,
                                                       const __nv_bfloat16* __restrict__ weight,
                                                       uint32_t rows, uint32_t cols, float eps,
                                                       float weight_offset) {
    using metrale::fp8_rows::row_scale;
    using metrale::fp8_rows::SCALE_K;
    using metrale::fp8_rows::store_block4;
    using metrale::fp8_rows::valid_columns;
    metrale::grid_dependency_sync();
    __shared__ float scratch[32];
    const uint32_t r = blockIdx.x;
    if (r >= metrale::fp8_rows::padded_rows(rows)) return;
    const uint32_t lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
    const uint32_t kb_count = (cols + SCALE_K - 1) / SCALE_K;
    uint8_t* qr = q + (size_t)r * cols;
    if (r >= rows) {
        // A zero row of the last group.
        const bool vector = cols % 4 == 0 && aligned(q, 4);
        for (uint32_t kb = warp; kb < kb_count; kb += warps) {
            const uint32_t col = kb * SCALE_K + lane * 4;
            store_block4(qr + col, scales, row_scale(r, kb, rows, kb_count), make_uint2(0, 0),
                         valid_columns(col, cols), vector && col + 4 <= cols);
        }
        return;
    }
    float* res = residual + (size_t)r * cols;
    const __nv_bfloat16* x = input == nullptr ? nullptr : input + (size_t)r * cols;
    const bool vec = cols % 4 == 0 && aligned(res, 16) && aligned(q, 4) && aligned(weight, 8) &&
                     (x == nullptr || aligned(x, 8));
    float sq = 0.0f;
    if (vec) {
        const uint32_t n4 = cols / 4, step = blockDim.x;
        float4* res4 = reinterpret_cast<float4*>(res);
        const uint2* x4 = reinterpret_cast<const uint2*>(x);
        const uint2* w4 = reinterpret_cast<const uint2*>(weight);
        // Piece i's block (k-block i / 32, the warp's) and its codes: the warp's pieces from
        // i - lane; lanes past the row hold zeros and store nothing.
        auto store = [&](uint32_t i, uint2 y) {
            const bool real = i < n4;
            store_block4(qr + 4 * (size_t)i, scales, row_scale(r, i / 32, rows, kb_count),
                         real ? y : make_uint2(0, 0), real ? 4u : 0u, real);
        };
        if (n4 <= step * UNROLL) {
            // The row in one pass from registers, as add_rmsnorm_f32res takes it.
            float4 v[UNROLL];
            uint2 xv[UNROLL], wv[UNROLL];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const uint32_t i = threadIdx.x + u * step;
                if (i < n4) {
                    v[u] = res4[i];
                    if (x != nullptr) xv[u] = x4[i];
                    wv[u] = w4[i];
                }
            }
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const uint32_t i = threadIdx.x + u * step;
                if (i < n4) {
                    if (x != nullptr) {
                        add4(v[u], xv[u]);
                        res4[i] = v[u];
                    }
                    sq = add_squares4(sq, v[u]);
                }
            }
            const float inv = inverse_rms(sq, cols, eps, scratch);
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const uint32_t i = threadIdx.x + u * step;
                if (i - lane < n4) {
                    store(i, i < n4 ? scaled4(v[u], inv, wv[u], weight_offset) : make_uint2(0, 0));
                }
            }
            return;
        }
        for (uint32_t base = threadIdx.x; base < n4; base += step * UNROLL) {
            float4 v[UNROLL];
            uint2 xv[UNROLL];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const uint32_t i = base + u * step;
                if (i < n4) {
                    v[u] = res4[i];
                    if (x != nullptr) xv[u] = x4[i];
                }
            }
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const uint32_t i = base + u * step;
                if (i < n4) {
                    if (x != nullptr) {
                        add4(v[u], xv[u]);
                        res4[i] = v[u];
                    }
                    sq = add_squares4(sq, v[u]);
                }
            }
        }
        const float inv = inverse_rms(sq, cols, eps, scratch);
        // Each thread re-reads only the pieces it wrote itself; the loop runs while the warp has
        // a piece.
        for (uint32_t base = threadIdx.x; base - lane < n4; base += step * UNROLL) {
            float4 v[UNROLL];
            uint2 wv[UNROLL];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const uint32_t i = base + u * step;
                if (i < n4) {
                    v[u] = res4[i];
                    wv[u] = w4[i];
                }
            }
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const uint32_t i = base + u * step;
                if (i - lane < n4) {
                    store(i, i < n4 ? scaled4(v[u], inv, wv[u], weight_offset) : make_uint2(0, 0));
                }
            }
        }
        return;
    }
    for (uint32_t i = threadIdx.x; i < cols; i += blockDim.x) {
        float s = res[i];
        if (x != nullptr) {
            s += metrale::to_f32(x[i]);
            res[i] = s;
        }
        sq += s * s;
    }
    // The reduction's barriers make every thread's residual stores visible to the block.
    const float inv = inverse_rms(sq, cols, eps, scratch);
    for (uint32_t kb = warp; kb < kb_count; kb += warps) {
        const uint32_t col = kb * SCALE_K + lane * 4;
        __nv_bfloat16 y[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const uint32_t c = col + j;
            y[j] = c < cols ? metrale::to_bf16(res[c] * inv *
                                               metrale::norm_scale(metrale::to_f32(weight[c]),
                                                                   weight_offset))
                            : metrale::to_bf16(0.0f);
        }
        store_block4(qr + col, scales, row_scale(r, kb, rows, kb_count), metrale::fp8_rows::pack(y),
                     valid_columns(col, cols), false);
    }
}
