#!/usr/bin/env python3
# SPDX-License-Identifier: MIT OR Apache-2.0
# Runs prefill_attention_v3_bf16 cubins (variants of kernels/hopper/common/prefill_attention_v3.cu,
# built with nvcc -cubin; t<keys>_<stages>.cubin names a variant's key tile and stage count for its
# shared memory size) on the GPU through the driver API: on causal sequences over a shuffled paged
# cache, each 128-query tile's worst error against a torch f32 reference (which tiles and rows go
# wrong), then the time of a 1024- and an 8192-token launch at Qwen3-8B's heads. Needs torch and a
# GPU. Usage: prefill_v3_debug.py CUBIN...
import ctypes
import sys

import torch

cuda = ctypes.CDLL("libcuda.so.1")


def tile_keys(cubin):
    """Keys per stage: a cubin named t<keys>_<stages>.cubin, else 64."""
    name = cubin.split("/")[-1]
    return int(name[1:name.index("_")]) if name.startswith("t") and name[1].isdigit() else 64


def ck(r, what):
    if r != 0:
        raise RuntimeError(f"{what}: CUresult {r}")


def run(cubin, stages, tokens=300, q_heads=8, kv_heads=2, block=16, seed=0, timed=False):
    torch.manual_seed(seed)
    d = 128
    dev = torch.device("cuda")
    blocks = (tokens + block - 1) // block
    perm = torch.randperm(blocks + 3)[:blocks].to(torch.int32)
    q = torch.randn(tokens, q_heads, d, device=dev).to(torch.bfloat16)
    kc = torch.randn(blocks + 3, block, kv_heads, d, device=dev).to(torch.bfloat16)
    vc = torch.randn(blocks + 3, block, kv_heads, d, device=dev).to(torch.bfloat16)
    table = perm.to(dev)
    tiles = []
    for t0 in range(0, tokens, 128):
        tiles.append([0, t0, t0, min(128, tokens - t0)])
    tiles_t = torch.tensor(tiles, dtype=torch.int32, device=dev)
    out = torch.zeros(tokens + 64, q_heads, d, device=dev, dtype=torch.bfloat16)
    if timed:
        return launch_timed(cubin, stages, q, kc, vc, table, tiles, tiles_t, out, q_heads, kv_heads, d, block, blocks)
    # Reference: gather keys by position.
    pos = torch.arange(tokens)
    slots = perm[pos // block].long() * block + pos % block
    k = kc.view(-1, kv_heads, d)[slots.to(dev)].float()
    v = vc.view(-1, kv_heads, d)[slots.to(dev)].float()
    group = q_heads // kv_heads
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    s = torch.einsum("thd,khd->htk", q.float(), k) / d ** 0.5
    mask = torch.triu(torch.ones(tokens, tokens, dtype=torch.bool, device=dev), 1)
    s = s.masked_fill(mask, float("-inf"))
    ref = torch.einsum("htk,khd->thd", torch.softmax(s, -1), v)

    mod = ctypes.c_void_p()
    data = open(cubin, "rb").read()
    ck(cuda.cuModuleLoadData(ctypes.byref(mod), data), "cuModuleLoadData")
    fn = ctypes.c_void_p()
    ck(cuda.cuModuleGetFunction(ctypes.byref(fn), mod, b"prefill_attention_v3_bf16"), "GetFunction")
    smem = 128 * 128 * 2 + stages * 2 * tile_keys(cubin) * 128 * 2 + 1024
    ck(cuda.cuFuncSetAttribute(fn, 8, ctypes.c_int(smem)), "SetAttribute")  # MAX_DYNAMIC_SHARED
    args = [ctypes.c_uint64(out.data_ptr()), ctypes.c_uint64(q.data_ptr()), ctypes.c_uint64(kc.data_ptr()),
            ctypes.c_uint64(vc.data_ptr()), ctypes.c_uint64(table.data_ptr()), ctypes.c_uint64(tiles_t.data_ptr()),
            ctypes.c_uint32(len(tiles)), ctypes.c_uint32(q_heads), ctypes.c_uint32(kv_heads), ctypes.c_uint32(d),
            ctypes.c_uint32(block), ctypes.c_uint32(blocks), ctypes.c_float(1.0 / d ** 0.5)]
    ptrs = (ctypes.c_void_p * len(args))(*[ctypes.cast(ctypes.byref(a), ctypes.c_void_p) for a in args])
    torch.cuda.synchronize()
    ck(cuda.cuLaunchKernel(fn, q_heads, len(tiles), 1, 256, 1, 1, smem, None, ptrs, None), "Launch")
    ck(cuda.cuCtxSynchronize(), "sync")
    got = out[:tokens].float()
    err = (got - ref).abs()
    lines = []
    for t0 in range(0, tokens, 128):
        e = err[t0:t0 + 128]
        rows = (e.amax(dim=(1, 2)) > 0.05).nonzero().flatten().tolist()
        lines.append(f"tile@{t0}: max {e.max().item():.3g}, bad rows {len(rows)}"
                     + (f" (first {rows[:6]})" if rows else ""))
    heads_bad = (err.amax(dim=(0, 2)) > 0.05).nonzero().flatten().tolist()
    cuda.cuModuleUnload(mod)
    return f"{cubin}: " + "; ".join(lines) + f"; bad heads {heads_bad}"


def launch_timed(cubin, stages, q, kc, vc, table, tiles, tiles_t, out, q_heads, kv_heads, d, block, blocks):
    mod = ctypes.c_void_p()
    ck(cuda.cuModuleLoadData(ctypes.byref(mod), open(cubin, "rb").read()), "cuModuleLoadData")
    fn = ctypes.c_void_p()
    ck(cuda.cuModuleGetFunction(ctypes.byref(fn), mod, b"prefill_attention_v3_bf16"), "GetFunction")
    smem = 128 * 128 * 2 + stages * 2 * tile_keys(cubin) * 128 * 2 + 1024
    ck(cuda.cuFuncSetAttribute(fn, 8, ctypes.c_int(smem)), "SetAttribute")
    args = [ctypes.c_uint64(out.data_ptr()), ctypes.c_uint64(q.data_ptr()), ctypes.c_uint64(kc.data_ptr()),
            ctypes.c_uint64(vc.data_ptr()), ctypes.c_uint64(table.data_ptr()), ctypes.c_uint64(tiles_t.data_ptr()),
            ctypes.c_uint32(len(tiles)), ctypes.c_uint32(q_heads), ctypes.c_uint32(kv_heads), ctypes.c_uint32(d),
            ctypes.c_uint32(block), ctypes.c_uint32(blocks), ctypes.c_float(1.0 / d ** 0.5)]
    ptrs = (ctypes.c_void_p * len(args))(*[ctypes.cast(ctypes.byref(a), ctypes.c_void_p) for a in args])
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    for _ in range(3):
        ck(cuda.cuLaunchKernel(fn, q_heads, len(tiles), 1, 256, 1, 1, smem, stream, ptrs, None), "Launch")
    start.record()
    reps = 20
    for _ in range(reps):
        ck(cuda.cuLaunchKernel(fn, q_heads, len(tiles), 1, 256, 1, 1, smem, stream, ptrs, None), "Launch")
    end.record()
    torch.cuda.synchronize()
    us = start.elapsed_time(end) * 1e3 / reps
    n = q.shape[0]
    flops = 4 * q_heads * d * n * (n + 1) / 2
    cuda.cuModuleUnload(mod)
    return f"{cubin}: {n} tokens {q_heads}/{kv_heads} heads: {us:.1f} us, {flops / us / 1e6:.1f} TFLOP/s"


if __name__ == "__main__":
    torch.zeros(1, device="cuda")  # the primary context, current on this thread
    for c in sys.argv[1:]:
        stages = int(c.split("_")[-1][0])
        for tokens, seed in ((300, 0), (300, 1), (1100, 2), (1100, 3)):
            r = run(c, stages, tokens=tokens, seed=seed)
            bad = "nan" in r or "bad rows 0;" not in r or any(f"bad rows {n}" in r for n in range(1, 129))
            print(("FAIL " if bad else "ok   ") + r[:300], flush=True)
        for tokens in (1024, 8192):
            print(run(c, stages, tokens=tokens, q_heads=32, kv_heads=8, timed=True), flush=True)
