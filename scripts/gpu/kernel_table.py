# SPDX-License-Identifier: MIT OR Apache-2.0
"""The kernel table: `met bench-kernels --json` rows next to scripts/gpu/torch_kernels.py rows of the
same run, matched by label, as markdown (stdout) and JSON.

    python3 scripts/gpu/kernel_table.py --met bench-kernels-qwen3-8b.json \
        --torch torch-kernels-qwen3-8b.json --json kernel-table-qwen3-8b.json

A met row's label may carry a suffix the PyTorch row does not (" (GpuBackend::gemm)" for the
library GEMM path, " splits=N" for split attention); a split attention's combine kernel is added
to its attention row, since PyTorch's one call does both. "speedup" is PyTorch time over met time:
above 1, met is faster. Rows where met is not faster are listed after the table.
"""

import argparse
import json
import re
from pathlib import Path


def base(label: str) -> str:
    label = label.replace(" (GpuBackend::gemm)", "")
    label = re.sub(r" \(tensor cores, \d+ tiles\)$", "", label)
    return re.sub(r" splits=\d+$", "", label)


def on_path(r) -> bool:
    """Whether the engine launches this row's kernel for this shape on CUDA: the WMMA GEMM is only
    the fallback when cuBLASLt is missing (every GEMM row of the engine's path is the
    GpuBackend::gemm one), products of at most 8 rows take the GEMV (the library rows there are
    the measured alternative), and prefill attention runs on the tensor-core kernel, not the
    per-query paged_attention_bf16 kept in the bench for comparison."""
    if r["kernel"] == "gemm_bf16" and "(GpuBackend::gemm)" not in r["label"]:
        return False
    m = re.search(r" m=(\d+) ", r["label"])
    if "(GpuBackend::gemm)" in r["label"] and m and int(m.group(1)) <= 8:
        return False  # the engine takes the GEMV up to 8 rows; this is the library alternative
    if r["kernel"] == "paged_attention_bf16" and "prefill attention" in r["label"]:
        return False
    return True


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--met", required=True, type=Path)
    ap.add_argument("--torch", required=True, type=Path)
    ap.add_argument("--hbm-tb-s", type=float, default=4.19)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    met_rows = json.loads(args.met.read_text())
    torch_rows = {r["label"]: r for r in json.loads(args.torch.read_text())["rows"]}

    combine = {}
    for r in met_rows:
        m = re.match(r"(.*) combine of \d+ splits$", r["label"])
        if m:
            combine[m.group(1)] = r["us"]
    table = []
    for r in met_rows:
        if "combine of" in r["label"]:
            continue
        key = base(r["label"])
        us = r["us"] + combine.get(key, 0.0)
        t = torch_rows.get(key)
        path = "cuBLASLt" if "(GpuBackend::gemm)" in r["label"] else r["kernel"]
        row = {"label": key, "met": path, "on_path": on_path(r), "met_us": round(us, 2),
               "met_gb_s": round(r["gb_s"] * r["us"] / us), "met_of_hbm": round(r["gb_s"] * r["us"] / us / (args.hbm_tb_s * 1e3), 3),
               "torch_op": t["op"] if t else None, "torch_us": round(t["us"], 2) if t else None,
               "speedup": round(t["us"] / us, 2) if t else None}
        table.append(row)

    print("| shape | met | on path | µs | of HBM roofline | PyTorch | µs | speedup |")
    print("|---|---|---|---|---|---|---|---|")
    for r in table:
        torch_us = f"{r['torch_us']:.2f}" if r["torch_us"] is not None else "-"
        speed = f"{r['speedup']:.2f}x" if r["speedup"] is not None else "-"
        print(f"| {r['label']} | {r['met']} | {'yes' if r['on_path'] else 'no'} | {r['met_us']:.2f} | {100 * r['met_of_hbm']:.1f}% | {r['torch_op'] or '-'} | {torch_us} | {speed} |")
    slower = [r for r in table if r["on_path"] and r["speedup"] is not None and r["speedup"] < 1.0]
    if slower:
        print("\nRows on the engine's path where met is not faster than PyTorch:")
        for r in slower:
            print(f"- {r['label']} ({r['met']}): {r['met_us']:.2f} µs against {r['torch_us']:.2f} µs")
    off = [r for r in table if not r["on_path"]]
    if off:
        print(f"\n{len(off)} rows are kernels the engine does not launch on CUDA for that shape (the WMMA GEMM "
              "fallback, the per-query prefill attention), kept for comparison.")
    if args.json:
        args.json.write_text(json.dumps(table, indent=2) + "\n")


if __name__ == "__main__":
    main()
