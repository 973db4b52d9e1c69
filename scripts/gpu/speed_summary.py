# SPDX-License-Identifier: MIT OR Apache-2.0
"""The speed table of one harness run (scripts/gpu/speed.sh): every figure the speed issue asks for,
with the same-run peer figures and the roofline next to it, as JSON and markdown.

    python3 scripts/gpu/speed_summary.py --results /root/results-speed --ckpt /root/ckpt \
        --json summary.json > summary.md

Reads, for each model directory under --ckpt that has results:
  bench-model-<m>.json        met bench-model: TTFT rows and decode steps at 1k-token contexts
  bench-model-short-<m>.json  met bench-model --context 160: decode steps at the mean context of a
                              32-token prompt plus 256 new tokens (the transformers runs' shape)
  met-decode-<m>.txt          met generate, batch 1, 32-token prompt, 256 new tokens
  hf-<m>-b<B>-<mode>.json     scripts/gpu/transformers_decode_speed.py, one mode per file
  hf-prefill-<m>.json         scripts/gpu/transformers_prefill_speed.py
  parity-<m>.json             met parity (optional)
and kernel-table-<shape>.json (scripts/gpu/kernel_table.py). Rooflines: decode from the weight
bytes a step streams plus its KV bytes over --hbm-tb-s; prefill from its FLOPs (2 x non-embedding
parameters x tokens for the products, 2 x tokens^2 x head_dim x heads x layers for causal attention)
over --tc-tflops. Targets are the speed issue's acceptance figures; "pass" reads "missing" where a
figure the target needs is missing.
"""

import argparse
import json
import re
from pathlib import Path

TARGETS = {
    # (model, metric): (comparison, value) — value is a bound on the figure, or on a ratio.
    ("qwen3-8b", "decode tok/s, batch 1"): {"of_roofline_min": 0.85, "vs_static_compile_min": 1.6},
    ("qwen3-0.6b", "decode tok/s, batch 1"): {"min": 1200, "vs_static_compile_min": 4.0},
    ("qwen3-8b", "TTFT ms, 1024 tokens"): {"max": 28},
    ("qwen3-8b", "TTFT ms, 8192 tokens"): {"max": 240},
    ("qwen3-8b", "decode step ms, batch 64, 1k context"): {"of_floor_max": 1.4},
    ("qwen3-8b", "decode tok/s, batch 8"): {"vs_static_compile_min": 1.5},
    ("qwen3-8b", "decode tok/s, batch 32"): {"vs_static_compile_min": 1.5},
}


def load(path: Path):
    return json.loads(path.read_text()) if path.exists() else None


def hf(res: Path, m: str, batch: int, mode: str):
    report = load(res / f"hf-{m}-b{batch}-{mode}.json")
    if not report:
        return None
    ok = [r for r in report["results"] if "error" not in r]
    return ok[0] if ok else None


def params(cfg):
    h, i, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * i
    return per_layer * layers, hd


def judge(target, row):
    """True or False against the target; None where there is no target. A figure the target needs
    that was not measured (the roofline, the floor, the same-run static+compile peer) makes it
    "missing" unless a measured check already fails: a call that lost its peers reads as
    unmeasured, not as a miss."""
    if not target:
        return None
    peer = row["peers"].get("transformers static+compile")
    # (bound, figure the bound is on, whether the figure must be at least the bound)
    checks = [
        (target.get("min"), row["value"], True),
        (target.get("max"), row["value"], False),
        (target.get("of_roofline_min"), row.get("of_roofline"), True),
        (target.get("of_floor_max"), row.get("over_floor"), False),
        (target.get("vs_static_compile_min"), peer and row["value"] / peer, True),
    ]
    results = [None if figure is None else (figure >= bound if at_least else figure <= bound)
               for bound, figure, at_least in checks if bound is not None]
    if False in results:
        return False
    return "missing" if None in results else True


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", required=True, type=Path)
    ap.add_argument("--ckpt", required=True, type=Path)
    ap.add_argument("--hbm-tb-s", type=float, default=4.19)
    ap.add_argument("--tc-tflops", type=float, default=790.0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    res = args.results
    rows = []

    def add(model, metric, value, unit, batch, peers=None, roofline=None, floor=None, note=""):
        row = {"model": model, "precision": "bf16", "batch": batch, "metric": metric, "value": round(value, 3),
               "unit": unit, "peers": {k: v for k, v in (peers or {}).items() if v is not None}, "note": note}
        if roofline is not None:
            row["roofline"] = round(roofline, 3)
            row["of_roofline"] = round(value / roofline, 3)
        if floor is not None:
            row["floor"] = round(floor, 3)
            row["over_floor"] = round(value / floor, 3)
        target = TARGETS.get((model, metric))
        row["target"] = target
        row["pass"] = judge(target, row)
        rows.append(row)

    for cfg_path in sorted(args.ckpt.glob("*/config.json")):
        m = cfg_path.parent.name
        cfg = json.loads(cfg_path.read_text())
        n_params, hd = params(cfg)
        heads, layers = cfg["num_attention_heads"], cfg["num_hidden_layers"]
        decode = res / f"met-decode-{m}.txt"
        if decode.exists():
            found = re.findall(r"decode ([0-9.]+) tok/s", decode.read_text())
            eager, compiled = hf(res, m, 1, "eager"), hf(res, m, 1, "static_compile_loop")
            roof = (compiled or eager or {}).get("roofline_tok_s")
            if found:
                add(m, "decode tok/s, batch 1", float(found[-1]), "tok/s", 1,
                    {"transformers eager": eager and eager["decode_tok_s"],
                     "transformers static+compile": compiled and compiled["decode_tok_s"]},
                    roofline=roof, note="32-token prompt, 256 new tokens, greedy")
        prefill_peer = {r["prompt_tokens"]: r["ttft_ms"] for r in (load(res / f"hf-prefill-{m}.json") or {}).get("rows", [])}
        for r in load(res / f"bench-model-{m}.json") or []:
            if r["kind"].startswith("prefill"):
                p = r["tokens"]
                flops = 2 * n_params * p + 2 * p * p * hd * heads * layers
                add(m, f"TTFT ms, {p} tokens", r["ms"], "ms", 1, {"transformers SDPA": prefill_peer.get(p)},
                    floor=flops / (args.tc_tflops * 1e12) * 1e3, note="floor: tensor-core FLOPs at peak")
            elif r["kind"] == "decode step":
                add(m, f"decode step ms, batch {r['batch']}, 1k context", r["ms"], "ms", r["batch"],
                    floor=r["floor_ms"], note="floor: weights + KV bytes over HBM read bandwidth")
        for r in load(res / f"bench-model-short-{m}.json") or []:
            if r["kind"] == "decode step" and r["batch"] > 1:
                b = r["batch"]
                eager, compiled = hf(res, m, b, "eager"), hf(res, m, b, "static_compile_loop")
                add(m, f"decode tok/s, batch {b}", r["tok_s"], "tok/s", b,
                    {"transformers eager": eager and eager["decode_tok_s"],
                     "transformers static+compile": compiled and compiled["decode_tok_s"]},
                    roofline=r["tok_s"] * r["ms"] / r["floor_ms"] if r.get("floor_ms") else None,
                    note=f"met: decode step at {r['tokens']}-token contexts (the mean of 32 + 256 tokens)")
        parity = load(res / f"parity-{m}.json")
        if parity is not None:
            rows.append({"model": m, "precision": "bf16", "metric": "logit parity", "parity": parity})

    kernels = {}
    for path in sorted(res.glob("kernel-table-*.json")):
        kernels[path.stem.removeprefix("kernel-table-")] = json.loads(path.read_text())

    print("| model | batch | metric | met | peers (same run) | roofline / floor | of roofline | target | pass |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "value" not in r:
            continue
        peers = "; ".join(f"{k} {v:g}" for k, v in r["peers"].items()) or "-"
        bound = r.get("roofline", r.get("floor"))
        ratio = r.get("of_roofline")
        ratio = f"{100 * ratio:.0f}%" if ratio is not None else (f"{r['over_floor']:.2f}x floor" if "over_floor" in r else "-")
        target = json.dumps(r["target"]) if r["target"] else "-"
        ok = {True: "yes", False: "NO", None: "-", "missing": "missing"}[r["pass"]]
        print(f"| {r['model']} | {r['batch']} | {r['metric']} | {r['value']:g} {r['unit']} | {peers} | "
              f"{bound if bound is not None else '-'} | {ratio} | {target} | {ok} |")
    for shape, table in kernels.items():
        slower = [k for k in table if k.get("on_path", True) and k.get("speedup") is not None and k["speedup"] < 1.0]
        print(f"\nkernel table {shape}: {len(table)} rows, {len(slower)} on the engine's path where met is not faster than PyTorch")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "kernel_tables": kernels}, indent=2) + "\n")


if __name__ == "__main__":
    main()
