# SPDX-License-Identifier: MIT OR Apache-2.0
"""Expert choices that flip between transformers in float32 and in bfloat16, per position: the
test of whether a MoE parity miss is a routing near-tie rather than an engine error.

A router picks the top k of E logits. When the k-th and (k+1)-th logits of the float32 run differ
by less than what bfloat16 activations move them, a bfloat16 run (transformers', the engine's)
may take the other expert, and that position's logits then differ from float32's by the weight
of one expert's output, whoever computes them. This script runs the tokens of a reference file
(scripts/gpu/reference_logits.py) through the checkpoint twice, in float32 and in bfloat16, hooks
every router's input, and chooses the top k the engine's way (float32 logits of the run's own
router input, ties to the lower expert). Per position it reports the layers whose chosen set
differs between the two runs and the smallest float32 margin between the k-th and (k+1)-th
logits, and, given `met parity --json`, joins them with the engine's and transformers-bf16's
errors.

    python3 scripts/gpu/moe_route_flips.py --model /root/ckpt/qwen3-30b-a3b-4l \
        --reference /root/ref/moe.safetensors --parity-json /root/out/parity.json \
        --out /root/out/flips.json
"""

import argparse
import json
from pathlib import Path

import safetensors.torch
import torch
from transformers import AutoModelForCausalLM


DEVICE = "cuda"


def load(path, dtype):
    placement = {} if DEVICE == "cpu" else {"device_map": DEVICE}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="sdpa",
                                                 **placement)
    return (model if dtype == torch.bfloat16 else model.to(dtype)).eval()


def routers(model):
    """The router of every sparse MoE block, `mlp.gate` (Qwen-MoE, MiniMax-M2; Qwen2-MoE's
    shared-expert gate is `mlp.shared_expert_gate` and is not one) or `mixer.gate` (Nemotron-H),
    with the expert correction bias of routings that choose on sigmoid scores plus a bias (on the
    router, Nemotron-H's, or on its block), else None."""
    modules = dict(model.named_modules())
    out = []
    for name, m in modules.items():
        if (name.endswith("mlp.gate") or name.endswith("mixer.gate")) and hasattr(m, "weight"):
            bias = getattr(m, "e_score_correction_bias", None)
            if bias is None:
                bias = getattr(modules[name.rsplit(".", 1)[0]], "e_score_correction_bias", None)
            out.append((name, m, bias))
    return out


@torch.inference_mode()
def router_inputs(model, ids):
    """Per router: its input rows [tokens, hidden] in float32, for one forward pass over `ids`."""
    captured = {}
    hooks = []
    for name, m, _ in routers(model):
        def hook(_m, args, name=name):
            captured[name] = args[0].reshape(-1, args[0].shape[-1]).float().clone()
        hooks.append(m.register_forward_pre_hook(hook))
    model(input_ids=ids[None].to(DEVICE), use_cache=False)
    for h in hooks:
        h.remove()
    return captured


def choices(x, weight, k, bias=None):
    """Top-k expert sets (as sorted index tensors) and the k-th minus (k+1)-th key, per row. The
    key is the logit, or with a correction bias sigmoid(logit) + bias (the engine's choice)."""
    logits = x @ weight.float().t()
    keys = logits if bias is None else torch.sigmoid(logits) + bias.float()
    # Ties to the lower expert: a stable sort on the negated keys.
    order = torch.sort(-keys, dim=-1, stable=True).indices
    top = torch.sort(order[:, :k], dim=-1).values
    vals = torch.gather(keys, 1, order[:, : k + 1])
    return top, (vals[:, k - 1] - vals[:, k])


def compare(model_path, ids, k):
    runs = {}
    weights = biases = None
    for label, dtype in (("f32", torch.float32), ("bf16", torch.bfloat16)):
        model = load(model_path, dtype)
        if weights is None:
            # The bf16 weights (a float32 model holds them widened, exactly).
            weights = {name: m.weight.detach().float().clone() for name, m, _ in routers(model)}
            biases = {name: None if b is None else b.detach().float().clone()
                      for name, _, b in routers(model)}
        runs[label] = router_inputs(model, ids)
        del model
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    layers = sorted(weights, key=lambda n: int(n.split("layers.")[1].split(".")[0]))
    flips = torch.zeros(len(ids), dtype=torch.int32)
    min_margin = torch.full((len(ids),), float("inf"))
    f32_sets = []
    for name in layers:
        top32, margin = choices(runs["f32"][name], weights[name], k, biases[name])
        top16, _ = choices(runs["bf16"][name], weights[name], k, biases[name])
        flips += (top32 != top16).any(dim=-1).cpu().int()
        min_margin = torch.minimum(min_margin, margin.cpu())
        f32_sets.append(top32.cpu())
    return layers, flips, min_margin, f32_sets


def engine_flips(f32_sets, engine_layers, positions):
    """Per position of `positions` (indices into the f32 run's rows), the layers whose engine
    choice (`engine_layers[layer][i]`, the i-th of `positions`) differs from float32's set."""
    out = []
    for i, p in enumerate(positions):
        n = 0
        for layer, sets in enumerate(f32_sets):
            mine = sorted(engine_layers[layer][i])
            n += mine != sets[p].tolist()
        out.append(n)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--reference", required=True, help="reference_logits.py output (its token ids)")
    ap.add_argument("--parity-json", default=None, help="met parity --json output, joined per position")
    ap.add_argument("--engine-routing", default=None,
                    help="met parity --routing-out output: the engine's own expert choices, compared with float32's")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a small checkpoint")
    args = ap.parse_args()
    global DEVICE
    DEVICE = args.device
    torch.set_float32_matmul_precision("highest")
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False

    ref = safetensors.torch.load_file(args.reference)
    config = json.loads(Path(args.model, "config.json").read_text())
    # Qwen3.5's hub config nests the language model's keys under text_config.
    k = int(config.get("num_experts_per_tok") or config["text_config"]["num_experts_per_tok"])
    prompt, decode = ref["prompt_ids"].long(), ref["decode_ids"].long()
    # Teacher forcing is one prefill of prompt + decode ids: decode row i is position P + i.
    short = torch.cat([prompt, decode])
    layers, flips, margin, sets = compare(args.model, short, k)
    engine = json.loads(Path(args.engine_routing).read_text()) if args.engine_routing else None
    rows = {}
    P = len(prompt)
    ours = [None] * len(short)
    if engine:
        ours[:P] = engine_flips(sets, engine["prefill"], range(P))
        # decode[step][layer] holds one row of k ids.
        steps = engine["decode"]
        per_layer = [[steps[i][layer] for i in range(len(steps))] for layer in range(len(sets))]
        ours[P:] = engine_flips(sets, per_layer, range(P, P + len(steps)))
    for p in range(len(short)):
        phase = "prefill" if p < P else "decode"
        rows[(phase, p)] = {"phase": phase, "position": p, "flipped_layers": int(flips[p]),
                            "min_margin": float(margin[p])}
        if ours[p] is not None:
            rows[(phase, p)]["engine_flipped_layers"] = ours[p]
    if "long_prompt_ids" in ref:
        long_ids = ref["long_prompt_ids"].long()
        _, lflips, lmargin, lsets = compare(args.model, long_ids, k)
        lours = engine_flips(lsets, engine["long-prefill"], range(len(long_ids))) if engine else None
        for p in ref["long_positions"].tolist():
            rows[("long-prefill", p)] = {"phase": "long-prefill", "position": p, "flipped_layers": int(lflips[p]),
                                         "min_margin": float(lmargin[p]),
                                         "flips_before": int(lflips[:p].sum())}
            if lours is not None:
                rows[("long-prefill", p)]["engine_flipped_layers"] = lours[p]
                rows[("long-prefill", p)]["engine_flips_before"] = sum(lours[:p])
    if args.parity_json:
        for r in json.loads(Path(args.parity_json).read_text()):
            key = (r["phase"], r["position"])
            if key in rows:
                rows[key]["engine_rel"] = r["rel"]
                rows[key]["transformers_bf16_rel"] = r.get("transformers_bf16_rel")
    out = list(rows.values())
    summary = {}
    for phase in ("prefill", "decode", "long-prefill"):
        rs = [r for r in out if r["phase"] == phase]
        if not rs:
            continue
        misses = [r for r in rs if r.get("engine_rel") is not None and r.get("transformers_bf16_rel") is not None
                  and r["engine_rel"] > r["transformers_bf16_rel"]]
        summary[phase] = {
            "positions": len(rs),
            "positions_with_a_flip": sum(r["flipped_layers"] > 0 for r in rs),
            "engine_above_bf16": len(misses),
            "engine_above_bf16_with_a_flip": sum(r["flipped_layers"] > 0 for r in misses),
        }
        if engine:
            mine = [r for r in rs if r.get("engine_flipped_layers")]
            summary[phase].update({
                "positions_with_an_engine_flip": len(mine),
                "engine_above_bf16_with_an_engine_flip": sum(bool(r.get("engine_flipped_layers")) for r in misses),
                "engine_above_bf16_without_any_flip": sum(
                    not r.get("engine_flipped_layers") and not r["flipped_layers"] for r in misses),
            })
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"model": args.model, "k": k, "routers": len(layers), "summary": summary,
                                    "rows": out}, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    for r in out:
        if r.get("engine_rel") is not None and r.get("transformers_bf16_rel") is not None \
                and r["engine_rel"] > r["transformers_bf16_rel"]:
            print(f"miss {r['phase']} {r['position']}: engine {r['engine_rel']:.3e} bf16 {r['transformers_bf16_rel']:.3e} "
                  f"flipped layers (tf bf16 vs f32) {r['flipped_layers']} (engine vs f32) "
                  f"{r.get('engine_flipped_layers', '-')} min margin {r['min_margin']:.3e}"
                  + (f" flips before {r['flips_before']}" if "flips_before" in r else ""))


if __name__ == "__main__":
    main()
