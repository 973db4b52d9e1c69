# SPDX-License-Identifier: MIT OR Apache-2.0
"""The kernel table: `met bench-kernels --json` rows next to scripts/gpu/torch_kernels.py rows of the
same run, matched by label, as markdown (stdout) and JSON.

    python3 scripts/gpu/kernel_table.py --met bench-kernels-qwen3-8b.json \
        --torch torch-kernels-qwen3-8b.json --json kernel-table-qwen3-8b.json

A met row's label may carry a suffix the PyTorch row does not (" (GpuBackend::gemm)" for the
library GEMM path, " splits=N" for split attention, " (tensor cores v2, N tiles of <=T)" and
" (wgmma v3, N tiles of <=T)" for the prefill attention's versions 2 and 3, " (N columns per
block)" and " (resident grid of N columns per block)" for the GEMV at a split it does not use,
 " (uncapped grid)" for the GEMV on one block per column group, " (staged)" for the staged GEMV
entries, " (stream)" for the one-row bulk-copy stream (gemv_bf16_stream), " (mma)" for the tensor-core FP8 GEMV, " (wide)" for the fused decode attention's 8-warp form); a split attention's combine kernel is added to its attention row, since PyTorch's one
call does both. "speedup" is PyTorch time over met time:
above 1, met is faster. Rows where met is not faster are listed after the table, and then the
PyTorch rows no met row matches (the FP8 products at prefill sizes, which the engine runs as a
dequantisation to BF16 and the library GEMM: no one kernel to time).
"""

import argparse
import json
import re
from pathlib import Path


def shown(label: str) -> str:
    """The label as the table shows it: without the library-path and split suffixes."""
    label = label.replace(" (GpuBackend::gemm)", "")
    return re.sub(r" splits=\d+$", "", label)


def base(label: str) -> str:
    """The label the PyTorch row of the same computation has: also without the prefill attention's
    tiling suffixes."""
    label = re.sub(r" \(tensor cores, \d+ tiles\)$", "", shown(label))
    label = re.sub(r" \((resident grid of )?\d+ columns per block\)$", "", label)
    label = re.sub(r" \((staged|stream|mma)\)$", "", label)
    label = label.replace(" (wide)", "")
    label = re.sub(r" \(uncapped grid\)$", "", label)
    return re.sub(r" \((tensor cores v2|wgmma v3), \d+ tiles of <=\d+\)$", "", label)


# The engine's product rule (crates/model-engine, Model::streams_weight): the GEMV up to
# GEMV_MAX_ROWS rows, except that past GEMV_WIDE_K_MAX_ROWS rows a product over GEMV_WIDE_K or more
# inputs goes to the library GEMM.
GEMV_MAX_ROWS, GEMV_WIDE_K_MAX_ROWS, GEMV_WIDE_K = 8, 4, 4096
# An FP8 weight's product (the bench's "<shape> fp8 ..." rows; crates/model-engine, Linear::path):
# the FP8 GEMV (gemv_fp8) at 1 to GEMV_FP8_MAX_ROWS rows, with no wide-K rule (the library path
# first writes the weight out as BF16) and no staged or normalising register entries; at one row
# the FP8 stream under the same STREAM_PRODUCTS, threshold and STREAM_NORM as BF16 (the tuning's
# gemv_fp8_stream: FP8_STREAM, as HARDWARE.toml sets it: off since stream-1062fda).
GEMV_FP8_MAX_ROWS = 8
FP8_STREAM = False
# The tensor-core FP8 GEMV (gemv_fp8_mma, the bench's " (mma)" rows) in place of gemv_fp8 from
# FP8_MMA_MIN_ROWS to GEMV_FP8_MAX_ROWS rows where it fits (every speed-model product: K a
# multiple of 128): the tuning's gemv_fp8_mma_min_rows, 2 in HARDWARE.toml. The FP8 stream,
# where it streams, comes first.
FP8_MMA_MIN_ROWS = 2
# Products the GEMV streams through its staged entries (crates/kernels, gemv_stages): 1 to
# GEMV_FMA_MAX_ROWS rows and at most GEMV_STAGE_MAX_WEIGHTS weights.
GEMV_FMA_MAX_ROWS, GEMV_STAGE_MAX_WEIGHTS = 4, 8 << 20
# Products after a residual add + RMSNorm (qkv, gate|up) that the model runs through the
# normalising entries (METRALE_GEMV_NORM's default, small): the products gemv_stages picks (1 to
# GEMV_FMA_MAX_ROWS rows, at most GEMV_STAGE_MAX_WEIGHTS weights) whose A fits in
# GEMV_NORM_MAX_A_BYTES of shared memory (crates/kernels, gemv_norm_fits,
# which also asks for 8 columns per block or a grid of resident blocks: true of every qkv and
# gate|up product of the speed models, whose columns are short).
GEMV_NORM_MAX_A_BYTES = 48 * 1024
NORMED_PRODUCTS = ("qkv_proj", "gate_up", "gate_up+silu*mul")
# The engine's prefill attention at head_dim 128 (the speed models'): version 3 on query tiles of 128
# (versions 1 and 2, and v3 on tiles of 64, are benched for comparison).
PREFILL_KERNEL, PREFILL_TILE = "prefill_attention_v3_bf16", 128
# The fused decode attention (qk-norm + RoPE + KV write folded in) runs only at batch 1 (one
# sequence, one token: crates/model-engine's fused_post); its wide form (ATTENTION_WIDE_BLOCKS)
# takes one-split launches of at most that many (token, kv head) blocks. The table is made for the
# speed models' shapes, which have SPEED_KV_HEADS kv heads.
ATTENTION_WIDE_BLOCKS, SPEED_KV_HEADS = 16, 8
# The one-row products the engine runs through the bulk-copy stream (gemv_bf16_stream,
# gemv_bf16_swiglu_stream): crates/model-engine's DEFAULT_STREAM_LABELS for the binary measured, by
# the bench's names (qkv_proj, o_proj, gate_up+silu*mul, down), given with --stream-products
# (speed.sh passes all four, main's default, unless TABLE_STREAM_PRODUCTS says otherwise); the
# bench has a (stream) row exactly where gemv_stream_fits, and the engine's default set streams
# only products of at least 8M weights (GEMV_STREAM_MIN_WEIGHTS), which the bench's stream rows are
# at the Qwen3-8B shape it is run on.
STREAM_PRODUCTS = ()
# Whether the binary's streamed qkv and gate|up products do the residual add + RMSNorm before them
# in their own launch (gemv_bf16_stream_norm, gemv_bf16_swiglu_stream_norm: crates/model-engine's
# GEMV_STREAM_NORM, on since wip/stream-norm; --stream-norm): their "add+rmsnorm+X ... (stream)"
# rows are then on the path and the plain X stream rows are not.
STREAM_NORM = False
NORMED_STREAM_PRODUCTS = ("qkv_proj", "gate_up+silu*mul")
# The default set's weight threshold (GEMV_STREAM_MIN_WEIGHTS; n counts gate and up rows).
STREAM_MIN_WEIGHTS = 8 << 20


def on_path(r, wide_labels=frozenset(), stream_labels=frozenset()) -> bool:
    """Whether the engine launches this row's kernel for this shape on CUDA: the WMMA GEMM is only
    the fallback when cuBLASLt is missing (every GEMM row of the engine's path is the
    GpuBackend::gemm one), a product takes the GEMV or the library by the rule above (the other
    row at that size is the measured alternative; a GEMV product runs through the staged entry
    exactly when gemv_stages picks it, and the qkv and gate|up products gemv_stages picks through
    the normalising entries, which do the add + RMSNorm before them), and prefill attention runs on the wgmma kernel
    version 3 over tiles of 128, not versions 1 or 2, v3 on tiles of 64, or the per-query
    paged_attention_bf16, all kept in the bench for comparison; the fused decode attention runs at
    one sequence only, through its wide form where the bench has a (wide) row for the shape."""
    label = r["label"]
    if r["kernel"] == "gemm_bf16" and "(GpuBackend::gemm)" not in label:
        return False
    if r["kernel"].startswith("paged_attention_qkv"):
        seqs = re.search(r" seqs=(\d+) ", label)
        if seqs is None or int(seqs.group(1)) != 1:  # the fused form is batch 1's only
            return False
        wide = SPEED_KV_HEADS <= ATTENTION_WIDE_BLOCKS
        if "(wide)" in label:
            return wide
        return not (wide and shown(label) in wide_labels)
    if "columns per block)" in label:  # the GEMV at a column split the engine does not pick
        return False
    if label.endswith("(uncapped grid)"):  # the engine caps the GEMV's grid at the resident blocks
        return False
    if r["kernel"] == "grid_barrier_u32":  # a measurement for docs/persistent-decode.md
        return False
    mk = re.search(r" m=(\d+) n=\d+ k=(\d+)", label)
    if mk:
        m, k = int(mk.group(1)), int(mk.group(2))
        fp8 = " fp8 " in label
        if fp8:
            gemv = 1 <= m <= GEMV_FP8_MAX_ROWS
        else:
            gemv = m <= GEMV_MAX_ROWS and (m <= GEMV_WIDE_K_MAX_ROWS or k < GEMV_WIDE_K)
        if gemv != r["kernel"].startswith("gemv"):
            return False
        n = int(re.search(r" n=(\d+)", label).group(1))
        stages = not fp8 and 1 <= m <= GEMV_FMA_MAX_ROWS and n * k <= GEMV_STAGE_MAX_WEIGHTS
        folds = gemv and stages and m * k * 2 <= GEMV_NORM_MAX_A_BYTES
        what = re.search(r" (\S+) m=\d+ n=", label).group(1)
        product = what.removeprefix("add+rmsnorm+")
        streamed = (m == 1 and product in STREAM_PRODUCTS and n * k >= STREAM_MIN_WEIGHTS
                    and (FP8_STREAM or not fp8))
        norm_streamed = streamed and STREAM_NORM and product in NORMED_STREAM_PRODUCTS
        if r["kernel"].endswith("_stream_norm"):
            return norm_streamed
        if r["kernel"].endswith("_norm"):
            return folds and not norm_streamed
        if label.endswith(" (stream)"):
            return streamed and not norm_streamed
        if label.endswith(" (mma)"):
            return m >= FP8_MMA_MIN_ROWS and not streamed and what != "gate_up"
        if fp8 and gemv and m >= FP8_MMA_MIN_ROWS and r["kernel"] in ("gemv_fp8", "gemv_fp8_swiglu"):
            return False
        if streamed and shown(label) + " (stream)" in stream_labels:
            return False
        if folds and what in NORMED_PRODUCTS:
            return False
        if gemv and what == "gate_up":  # the GEMV's gate|up runs with SiLU x up in its epilogue
            return False
        return not gemv or stages == r["kernel"].endswith("_staged")
    if "prefill attention" in label:
        tiles = re.search(r"tiles of <=(\d+)\)", label)
        return r["kernel"] == PREFILL_KERNEL and tiles is not None and int(tiles.group(1)) == PREFILL_TILE
    return True


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--met", required=True, type=Path)
    ap.add_argument("--torch", required=True, type=Path)
    ap.add_argument("--hbm-tb-s", type=float, default=4.19)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--stream-products", default="",
                    help="comma-separated products the binary streams by default (see STREAM_PRODUCTS)")
    ap.add_argument("--stream-norm", action="store_true",
                    help="the binary's streamed qkv and gate|up products do the add + RMSNorm (see STREAM_NORM)")
    args = ap.parse_args()
    global STREAM_PRODUCTS
    STREAM_PRODUCTS = tuple(p for p in args.stream_products.split(",") if p)
    global STREAM_NORM
    STREAM_NORM = args.stream_norm
    met_rows = json.loads(args.met.read_text())
    torch_rows = {r["label"]: r for r in json.loads(args.torch.read_text())["rows"]}

    combine = {}
    for r in met_rows:
        m = re.match(r"(.*) combine of \d+ splits$", r["label"])
        if m:
            combine[m.group(1)] = r["us"]
    # The fused decode attention's shapes that also have a row of its wide form.
    wide_labels = {shown(r["label"]).replace(" (wide)", "") for r in met_rows if "(wide)" in r["label"]}
    stream_labels = {shown(r["label"]) for r in met_rows if r["label"].endswith(" (stream)")}
    table = []
    for r in met_rows:
        if "combine of" in r["label"]:
            continue
        key = base(r["label"])
        us = r["us"] + combine.get(key, 0.0)
        t = torch_rows.get(key)
        path = "cuBLASLt" if "(GpuBackend::gemm)" in r["label"] else r["kernel"]
        row = {"label": shown(r["label"]), "met": path, "on_path": on_path(r, wide_labels, stream_labels), "met_us": round(us, 2),
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
              "fallback, the GEMV or library product on the other side of the engine's rule, prefill attention "
              "versions 1 and 2, version 3 on tiles of 64, the per-query kernel), kept for comparison.")
    matched = {base(r["label"]) for r in met_rows}
    unmatched = [t for label, t in torch_rows.items() if label not in matched]
    if unmatched:
        print(f"\n{len(unmatched)} PyTorch rows have no met row at their label:")
        for t in unmatched:
            print(f"- {t['label']} ({t['op']}): {t['us']:.2f} µs")
    if args.json:
        args.json.write_text(json.dumps(table, indent=2) + "\n")


if __name__ == "__main__":
    main()
