#!/usr/bin/env python3
# SPDX-License-Identifier: MIT OR Apache-2.0
"""The expert choices of the tiny minimax_m2 CI fixture at every position, with each router's
gap between its k-th and (k+1)-th key, from an independent float64 forward of the checkpoint
(numpy; runs on any machine). Writes routing.json beside transcript.json.

Why: random routers put experts within bf16's reach of each other at some positions, and a bf16
engine may take the other expert there; crates/model-engine/tests/moe_fixtures.rs compares the
engine's own choices (routing capture) with these and checks logits only up to the first
position where they differ, after asserting that the difference sits on a near-tie (a small
gap here). The forward is checked against transformers' transcript: the logits of the last step
must agree to 1e-5 or nothing is written.

    python3 scripts/minimax_fixture_routing.py crates/model-engine/tests/fixtures/tiny-minimax-m2
"""
import json
import struct
import sys
from pathlib import Path

import numpy as np


def tensors(path: Path):
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])

    def get(name):
        v = header[name]
        a, b = v["data_offsets"]
        if v["dtype"] != "BF16":
            raise SystemExit(f"{name}: {v['dtype']}, expected BF16")
        bits = np.frombuffer(raw[8 + n + a:8 + n + b], dtype=np.uint16).astype(np.uint32) << 16
        return bits.view(np.float32).reshape(v["shape"]).astype(np.float64)
    return get


def main():
    d = Path(sys.argv[1])
    cfg = json.loads((d / "config.json").read_text())
    t = json.loads((d / "transcript.json").read_text())
    W = tensors(d / "model.safetensors")
    eps, hd = cfg["rms_norm_eps"], cfg["head_dim"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    rope = cfg["rope_parameters"]
    rot, theta = int(hd * rope.get("partial_rotary_factor", 1.0)), rope["rope_theta"]
    k = cfg["num_experts_per_tok"]

    def rms(x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w

    def rotate(x, pos):  # x [tokens, heads, hd]: rotate_half over the first `rot` dims
        inv = 1.0 / theta ** (np.arange(0, rot, 2) / rot)
        ang = np.concatenate([pos[:, None] * inv] * 2, -1)[:, None, :]
        xr = x[..., :rot]
        half = np.concatenate([-xr[..., rot // 2:], xr[..., :rot // 2]], -1)
        return np.concatenate([xr * np.cos(ang) + half * np.sin(ang), x[..., rot:]], -1)

    ids = t["prompt_ids"] + [s["id"] for s in t["steps"]][:-1]
    n = len(ids)
    pos = np.arange(n, dtype=np.float64)
    x = W("model.embed_tokens.weight")[ids]
    layers = []
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        a = rms(x, W(p + "input_layernorm.weight"))
        q = rms(a @ W(p + "self_attn.q_proj.weight").T, W(p + "self_attn.q_norm.weight")).reshape(n, nh, hd)
        kk = rms(a @ W(p + "self_attn.k_proj.weight").T, W(p + "self_attn.k_norm.weight")).reshape(n, nkv, hd)
        v = (a @ W(p + "self_attn.v_proj.weight").T).reshape(n, nkv, hd)
        q, kk = rotate(q, pos), rotate(kk, pos)
        out = np.zeros((n, nh, hd))
        mask = np.triu(np.full((n, n), -np.inf), 1)
        for h in range(nh):
            s = q[:, h] @ kk[:, h // (nh // nkv)].T / np.sqrt(hd) + mask
            s = np.exp(s - s.max(-1, keepdims=True))
            out[:, h] = (s / s.sum(-1, keepdims=True)) @ v[:, h // (nh // nkv)]
        x = x + out.reshape(n, -1) @ W(p + "self_attn.o_proj.weight").T
        m = rms(x, W(p + "post_attention_layernorm.weight"))
        score = 1.0 / (1.0 + np.exp(-(m @ W(p + "block_sparse_moe.gate.weight").T)))
        key = score + W(p + "block_sparse_moe.e_score_correction_bias")
        y = np.zeros_like(x)
        experts, gaps = [], []
        for r in range(n):
            order = np.argsort(-key[r], kind="stable")
            top = order[:k]
            experts.append(sorted(int(e) for e in top))
            gaps.append(float(key[r, order[k - 1]] - key[r, order[k]]))
            w = score[r, top] / score[r, top].sum()
            for e, we in zip(top, w):
                g = m[r] @ W(p + f"block_sparse_moe.experts.{e}.w1.weight").T
                u = m[r] @ W(p + f"block_sparse_moe.experts.{e}.w3.weight").T
                y[r] += we * ((g / (1.0 + np.exp(-g)) * u) @ W(p + f"block_sparse_moe.experts.{e}.w2.weight").T)
        x = x + y
        layers.append({"experts": experts, "gaps": gaps})
    logits = rms(x, W("model.norm.weight")) @ W("lm_head.weight").T
    want = np.array(t["steps"][-1]["logits"])
    err = float(np.linalg.norm(logits[-1] - want) / np.linalg.norm(want))
    if err > 1e-5:
        raise SystemExit(f"the float64 forward is {err:.2e} from transformers' last step: not written")
    (d / "routing.json").write_text(json.dumps({
        "produced_by": "scripts/minimax_fixture_routing.py (numpy float64 forward)",
        "last_step_relative_l2_vs_transcript": err,
        "positions": n,
        "layers": layers,
    }) + "\n")
    smallest = sorted((g, l, r) for l, ly in enumerate(layers) for r, g in enumerate(ly["gaps"]))[:3]
    print(f"routing.json: {n} positions, {len(layers)} layers; forward {err:.1e} from transformers; "
          f"smallest gaps {smallest}")


if __name__ == "__main__":
    main()
