# SPDX-License-Identifier: MIT OR Apache-2.0
"""Which block-scaled FP8 matmuls cuBLASLt accepts on this GPU, asked directly through ctypes.

The engine's FP8 prefill product (crates/gpu-runtime/src/blaslt.rs, `GemmOp::fp8`) asks cuBLASLt
for `C[m, n] = A[m, k] . W[n, k]^T` with the weight as cuBLASLt's A (128x128 block scales) and the
activations as its B (a scale per row and 128 columns). This script asks the heuristic the same
question while varying one thing at a time (scale modes, whether the scale pointers are set before
the heuristic, the row count, the bias epilogue) and prints the status of each, then runs the
accepted form on random data and compares it with a float32 product of the dequantised operands
(scales laid out as blaslt.rs documents). Needs torch with CUDA (for memory and the reference).

    python3 scripts/gpu/blaslt_fp8_probe.py [--n 2048 --k 4096]
    python3 scripts/gpu/blaslt_fp8_probe.py --time [--rows 16,64,128,1024]

`--time`: instead, at Qwen3-8B's four product shapes and each row count, ask the heuristic for up
to 16 algorithms of the engine's form and time each (CUDA events, median of 20 after 5 warm-up
runs): the first (what the engine takes) against the fastest, with the weight's read bandwidth.
"""
import argparse
import ctypes
import glob
import os
import sys

import torch

COMPUTE_32F = 68
R_32F, R_16BF, R_8F_E4M3 = 0, 14, 28
TRANSA, TRANSB, EPILOGUE, BIAS_POINTER, BIAS_TYPE = 3, 4, 7, 8, 26
A_SCALE_POINTER, B_SCALE_POINTER, A_SCALE_MODE, B_SCALE_MODE = 17, 18, 31, 32
SCALAR, VEC128, BLK128 = 0, 4, 5
EPI_DEFAULT, EPI_BIAS = 1, 4
PREF_WORKSPACE = 1
WORKSPACE = 32 << 20
# sizeof(cublasLtMatmulHeuristicResult_t): the 64-byte algorithm, size_t workspace, status, waves,
# int[4].
RESULT_BYTES = 96


def load():
    names = []
    for base in sys.path:
        names += glob.glob(os.path.join(base, "nvidia", "*", "lib", "libcublasLt.so*"))
    names += ["libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"]
    for name in names:
        try:
            return ctypes.CDLL(name), name
        except OSError:
            continue
    raise SystemExit("no libcublasLt found")


LT, LT_NAME = load()
c_p = ctypes.c_void_p


def ok(status, what):
    if status != 0:
        raise RuntimeError(f"{what}: status {status}")


class Lt:
    def __init__(self):
        self.handle = c_p()
        ok(LT.cublasLtCreate(ctypes.byref(self.handle)), "create")
        self.ws = torch.empty(WORKSPACE, dtype=torch.uint8, device="cuda")

    def desc(self, a_mode, b_mode, a_scale, b_scale, bias):
        d = c_p()
        ok(LT.cublasLtMatmulDescCreate(ctypes.byref(d), COMPUTE_32F, R_32F), "desc")

        def set_i32(attr, v):
            x = ctypes.c_int32(v)
            ok(LT.cublasLtMatmulDescSetAttribute(d, attr, ctypes.byref(x), 4), f"attr {attr}")

        def set_ptr(attr, p):
            x = ctypes.c_uint64(p)
            ok(LT.cublasLtMatmulDescSetAttribute(d, attr, ctypes.byref(x), 8), f"attr {attr}")

        set_i32(TRANSA, 1)
        set_i32(TRANSB, 0)
        set_i32(A_SCALE_MODE, a_mode)
        set_i32(B_SCALE_MODE, b_mode)
        if a_scale is not None:
            set_ptr(A_SCALE_POINTER, a_scale)
        if b_scale is not None:
            set_ptr(B_SCALE_POINTER, b_scale)
        if bias is not None:
            set_i32(EPILOGUE, EPI_BIAS)
            set_i32(BIAS_TYPE, R_16BF)
            set_ptr(BIAS_POINTER, bias)
        return d

    @staticmethod
    def layout(dtype, rows, cols, ld):
        lay = c_p()
        ok(LT.cublasLtMatrixLayoutCreate(ctypes.byref(lay), dtype, ctypes.c_uint64(rows),
                                         ctypes.c_uint64(cols), ctypes.c_int64(ld)), "layout")
        return lay

    def heuristic(self, d, wl, al, cl, count=1):
        pref = c_p()
        ok(LT.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "pref")
        ws = ctypes.c_uint64(WORKSPACE)
        ok(LT.cublasLtMatmulPreferenceSetAttribute(pref, PREF_WORKSPACE, ctypes.byref(ws), 8), "pref attr")
        result = ctypes.create_string_buffer(RESULT_BYTES * count)
        found = ctypes.c_int32(0)
        status = LT.cublasLtMatmulAlgoGetHeuristic(self.handle, d, wl, al, cl, cl, pref, count, result,
                                                   ctypes.byref(found))
        LT.cublasLtMatmulPreferenceDestroy(pref)
        return status, found.value, result


def time_algorithms(rows):
    """The engine's FP8 form at Qwen3-8B's product shapes: every algorithm the heuristic offers."""
    lt = Lt()
    stream = torch.cuda.current_stream()
    alpha, beta = ctypes.c_float(1.0), ctypes.c_float(0.0)
    print("| product | m | algorithms | first us | best us (index) | weight GB/s first / best |")
    print("|---|---|---|---|---|---|")
    for name, n, k in [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 24576, 4096), ("down", 4096, 12288)]:
        kb, nb = k // 128, n // 128
        w8 = torch.randint(0, 120, (n, k), dtype=torch.uint8, device="cuda")
        w_scale = torch.full((nb, kb), 0.01, device="cuda")
        for m in rows:
            a8 = torch.randint(0, 120, (m, k), dtype=torch.uint8, device="cuda")
            a_scale = torch.full((kb, m), 0.01, device="cuda")
            c = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
            d = lt.desc(BLK128, VEC128, w_scale.data_ptr(), a_scale.data_ptr(), None)
            wl, al, cl = lt.layout(R_8F_E4M3, k, n, k), lt.layout(R_8F_E4M3, k, m, k), lt.layout(R_16BF, n, m, n)
            status, found, results = lt.heuristic(d, wl, al, cl, count=16)
            times = []
            for i in range(found):
                algo = ctypes.byref(results, i * RESULT_BYTES)

                def run():
                    return LT.cublasLtMatmul(lt.handle, d, ctypes.byref(alpha), c_p(w8.data_ptr()), wl,
                                             c_p(a8.data_ptr()), al, ctypes.byref(beta), c_p(c.data_ptr()), cl,
                                             c_p(c.data_ptr()), cl, algo, c_p(lt.ws.data_ptr()),
                                             ctypes.c_size_t(WORKSPACE), c_p(stream.cuda_stream))
                if run() != 0:
                    times.append(float("inf"))
                    continue
                for _ in range(5):
                    run()
                samples = []
                for _ in range(20):
                    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    e0.record()
                    run()
                    e1.record()
                    e1.synchronize()
                    samples.append(e0.elapsed_time(e1) * 1000)
                times.append(sorted(samples)[len(samples) // 2])
            if not times:
                print(f"| {name} | {m} | 0 (status {status}) | - | - | - |")
                continue
            best = min(range(len(times)), key=lambda i: times[i])
            gb = n * k / 1e3
            print(f"| {name} | {m} | {found} | {times[0]:.2f} | {times[best]:.2f} ({best}) | "
                  f"{gb / times[0]:.0f} / {gb / times[best]:.0f} |")
            for x in (wl, al, cl):
                LT.cublasLtMatrixLayoutDestroy(x)
            LT.cublasLtMatmulDescDestroy(d)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--time", action="store_true")
    ap.add_argument("--rows", default="16,64,128,1024")
    args = ap.parse_args()
    if args.time:
        time_algorithms([int(r) for r in args.rows.split(",")])
        return
    n, k = args.n, args.k
    LT.cublasLtGetVersion.restype = ctypes.c_size_t
    print(f"library {LT_NAME} version {LT.cublasLtGetVersion()}; GPU {torch.cuda.get_device_name()}")
    lt = Lt()
    torch.manual_seed(0)
    mmax = 1024
    w32 = torch.randn(n, k, device="cuda")
    a32 = torch.randn(mmax, k, device="cuda")
    kb, nb = (k + 127) // 128, (n + 127) // 128
    w_scale = torch.rand(nb, kb, device="cuda") * 0.01 + 0.005
    bias = torch.randn(n, device="cuda").to(torch.bfloat16)
    w8 = (w32 / w_scale.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]).clamp(-448, 448).to(torch.float8_e4m3fn)

    print("| a_mode (weight) | b_mode (acts) | pointers before heuristic | m | bias | status | found |")
    print("|---|---|---|---|---|---|---|")
    modes = {"BLK128": BLK128, "VEC128": VEC128, "SCALAR": SCALAR}
    accepted = []
    for am, bm in [("BLK128", "VEC128"), ("VEC128", "BLK128"), ("VEC128", "VEC128"), ("SCALAR", "SCALAR")]:
        for ptrs in (False, True):
            for m in (17, 16, 32, 1024):
                for with_bias in (False, True):
                    a_sc = torch.ones(kb, m, device="cuda")
                    d = lt.desc(modes[am], modes[bm], w_scale.data_ptr() if ptrs else None,
                                a_sc.data_ptr() if ptrs else None, bias.data_ptr() if with_bias else None)
                    wl = lt.layout(R_8F_E4M3, k, n, k)
                    al = lt.layout(R_8F_E4M3, k, m, k)
                    cl = lt.layout(R_16BF, n, m, n)
                    status, found, _ = lt.heuristic(d, wl, al, cl)
                    print(f"| {am} | {bm} | {ptrs} | {m} | {with_bias} | {status} | {found} |")
                    if status == 0 and found and am == "BLK128" and bm == "VEC128":
                        accepted.append((ptrs, m, with_bias))
                    for x in (wl, al, cl):
                        LT.cublasLtMatrixLayoutDestroy(x)
                    LT.cublasLtMatmulDescDestroy(d)

    # Run the engine's form where accepted and compare with float32.
    for ptrs, m, with_bias in accepted:
        a = a32[:m]
        # Activation scales: a scale per row and 128 columns, stored [kb][m] (m fastest).
        blocks = a.view(m, kb, 128) if k % 128 == 0 else None
        if blocks is None:
            continue
        a_scale = (blocks.abs().amax(-1) / 448).clamp_min(1e-12)  # [m, kb]
        a8 = (blocks / a_scale[..., None]).view(m, k).to(torch.float8_e4m3fn)
        a_scale_t = a_scale.t().contiguous()  # [kb, m]
        d = lt.desc(BLK128, VEC128, w_scale.data_ptr(), a_scale_t.data_ptr(),
                    bias.data_ptr() if with_bias else None)
        wl, al, cl = lt.layout(R_8F_E4M3, k, n, k), lt.layout(R_8F_E4M3, k, m, k), lt.layout(R_16BF, n, m, n)
        status, found, result = lt.heuristic(d, wl, al, cl)
        c = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        alpha, beta = ctypes.c_float(1.0), ctypes.c_float(0.0)
        st = LT.cublasLtMatmul(lt.handle, d, ctypes.byref(alpha), c_p(w8.data_ptr()), wl, c_p(a8.data_ptr()), al,
                               ctypes.byref(beta), c_p(c.data_ptr()), cl, c_p(c.data_ptr()), cl, result,
                               c_p(lt.ws.data_ptr()), ctypes.c_size_t(WORKSPACE), c_p(torch.cuda.current_stream().cuda_stream))
        torch.cuda.synchronize()
        w_deq = w8.float() * w_scale.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
        a_deq = (a8.float().view(m, kb, 128) * a_scale[..., None]).view(m, k)
        ref = a_deq @ w_deq.t() + (bias.float() if with_bias else 0)
        rel = ((c.float() - ref).norm() / ref.norm()).item()
        print(f"run ptrs={ptrs} m={m} bias={with_bias}: status {st}, rel-L2 vs f32 of the dequantised operands {rel:.3e}")


if __name__ == "__main__":
    main()
