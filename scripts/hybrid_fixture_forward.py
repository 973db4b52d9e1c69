#!/usr/bin/env python3
# SPDX-License-Identifier: MIT OR Apache-2.0
"""An independent float64 forward of the tiny hybrid fixtures (scripts/gpu/tiny_hybrid_fixtures.py)
written from their safetensors alone with numpy, token by token in the recurrent form: a check that
the transcripts are the functions the engine implements, and a reading of the layouts in code.

    python3 scripts/hybrid_fixture_forward.py crates/model-engine/tests/fixtures/tiny-qwen3-next

For every step of transcript.json it prints the relative L2 distance between these logits and
transformers' (float32 on the same bf16 weights; ~1e-6 expected) and asserts it is under 1e-4.

What it spells out (transformers 5.17's modeling code, read and checked against its output):

Qwen3-Next / Qwen3.5 (Gated DeltaNet layers and gated attention layers):
  * every RMSNorm outside the Gated DeltaNet (input/post-attention, final, q_norm, k_norm) is
    x / rms(x) * (1 + w); the Gated DeltaNet's output norm is x / rms(x) * w * silu(z) per value
    head (eps rms_norm_eps).
  * Qwen3-Next's in_proj_qkvz rows are grouped by key head: for each of the key heads, q (dk), k
    (dk), then v and z of its nv/nk value heads (dv each); in_proj_ba likewise: b then a, nv/nk
    each. Qwen3.5's in_proj_qkv is all q, all k, all v; in_proj_z, in_proj_b, in_proj_a per value
    head.
  * the depthwise conv (conv1d.weight [C, 1, K], no bias) runs over the channels [all q | all k |
    all v] (head-major), causal, then silu.
  * q and k are L2-normalised per head (x * rsqrt(sum x^2 + 1e-6)), q scaled by dk^-0.5; value
    head h reads key head h // (nv / nk).
  * g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b); per token S <- S * exp(g);
    S <- S + k (beta (v - S^T k))^T; o = S^T q, S of [dk, dv] per value head, from zero.
  * attention: q_proj gives per head [query (hd) | gate (hd)]; o = softmax(q k^T / sqrt(hd)) v,
    times sigmoid(gate), then o_proj; RoPE (rotate-half) on the first hd * partial_rotary_factor
    elements of q and k, after q_norm / k_norm.
  * MoE: softmax over the router logits, top k, renormalised (Qwen3.5 always; Qwen3-Next with
    norm_topk_prob), SwiGLU experts; plus the shared expert times sigmoid(shared_expert_gate).

Nemotron-H (one block a layer: x + mixer(rmsnorm(x) * w)):
  * Mamba-2: in_proj gives [gate z (H*P) | x B C (H*P + 2*G*N) | dt (H)]; the conv (with bias) runs
    over x B C, then silu; dt = softplus(dt + dt_bias) (transformers' chunked prefill also clamps
    it to >= time_step_min, its decode step does not: the fixtures keep clear of it); A =
    -exp(A_log); per head h (group h // (H / G)) state [P, N]: s <- s * exp(dt A) + dt x B^T,
    y = s C + D x; then y * silu(z), RMS-normalised in G groups of H*P/G, times w; out_proj.
  * attention without RoPE; MLP down(relu(up(x))^2).
  * experts (moe): scores sigmoid(x @ gate.weight^T); the top k of scores + e_score_correction_bias
    (one group), weighted by their unbiased scores, renormalised (norm_topk_prob), times
    routed_scaling_factor; each expert down(relu(up(x))^2), no gate product; plus the shared
    expert down(relu(up(x))^2), ungated.
"""
import json
import sys
from pathlib import Path

import numpy as np


def load(d: Path):
    """Every tensor of model.safetensors as float64, read without torch: the fixtures hold bf16
    (the top half of an f32), which numpy has no type for, and f32."""
    raw = (d / "model.safetensors").read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    out = {}
    for k, meta in header.items():
        if k == "__metadata__":
            continue
        a, b = meta["data_offsets"]
        buf = raw[8 + n + a:8 + n + b]
        if meta["dtype"] == "BF16":
            f32 = (np.frombuffer(buf, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)
        elif meta["dtype"] == "F32":
            f32 = np.frombuffer(buf, dtype=np.float32)
        else:
            raise SystemExit(f"{k}: dtype {meta['dtype']} is not read here")
        out[k] = f32.astype(np.float64).reshape(meta["shape"])
    return out


def rms(x, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)


def silu(x):
    return x / (1 + np.exp(-x))


def softplus(x):
    return np.where(x > 20, x, np.log1p(np.exp(np.minimum(x, 20))))


def sigmoid(x):
    return 1 / (1 + np.exp(-x))


def causal_conv(x, w, bias=None):
    """x [T, C], w [C, 1, K]: out[t] = sum_j w[:, j] x[t - K + 1 + j] (zeros before the start)."""
    K = w.shape[-1]
    xp = np.concatenate([np.zeros((K - 1, x.shape[1])), x])
    out = sum(w[:, 0, j] * xp[j:j + len(x)] for j in range(K))
    return out + (bias if bias is not None else 0)


def rope(x, pos, rot, theta):
    """rotate-half RoPE on the first `rot` elements of the last axis; x [T, heads, hd]."""
    inv = 1.0 / theta ** (np.arange(0, rot, 2) / rot)
    f = pos[:, None] * inv[None]
    cos, sin = np.cos(np.concatenate([f, f], -1))[:, None], np.sin(np.concatenate([f, f], -1))[:, None]
    r, rest = x[..., :rot], x[..., rot:]
    half = rot // 2
    rotated = np.concatenate([-r[..., half:], r[..., :half]], -1)
    return np.concatenate([r * cos + rotated * sin, rest], -1)


def attention(q, k, v):
    """Causal softmax attention, q [T, H, d], k/v [T, KV, d]; GQA by head // (H / KV)."""
    T, H, d = q.shape
    rep = H // k.shape[1]
    k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
    s = np.einsum("thd,shd->hts", q, k) / np.sqrt(d)
    s = s + np.triu(np.full((T, T), -np.inf), 1)[None]
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("hts,shd->thd", p, v)


def qwen_forward(W, cfg, ids, prefix):
    T = len(ids)
    eps = cfg["rms_norm_eps"]
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    H, KV, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    rope_p = cfg.get("rope_parameters") or {}
    rot = int(hd * rope_p.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    theta = rope_p.get("rope_theta", cfg.get("rope_theta"))
    topk, E = cfg["num_experts_per_tok"], cfg["num_experts"]
    renorm = cfg.get("norm_topk_prob", True)
    offset_norm = lambda x, w: rms(x, eps) * (1 + w)  # noqa: E731
    x = W[f"{prefix}embed_tokens.weight"][ids]
    for layer, kind in enumerate(cfg["layer_types"]):
        p = f"{prefix}layers.{layer}."
        n = offset_norm(x, W[p + "input_layernorm.weight"])
        if kind == "linear_attention":
            a_ = p + "linear_attn."
            if a_ + "in_proj_qkvz.weight" in W:  # Qwen3-Next: grouped by key head
                g = nv // nk
                qkvz = (n @ W[a_ + "in_proj_qkvz.weight"].T).reshape(T, nk, 2 * dk + 2 * g * dv)
                q, k = qkvz[..., :dk], qkvz[..., dk:2 * dk]
                v = qkvz[..., 2 * dk:2 * dk + g * dv].reshape(T, nv, dv)
                z = qkvz[..., 2 * dk + g * dv:].reshape(T, nv, dv)
                ba = (n @ W[a_ + "in_proj_ba.weight"].T).reshape(T, nk, 2 * g)
                b, a = ba[..., :g].reshape(T, nv), ba[..., g:].reshape(T, nv)
                mixed = np.concatenate([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], -1)
            else:  # Qwen3.5: split projections
                mixed = n @ W[a_ + "in_proj_qkv.weight"].T
                z = (n @ W[a_ + "in_proj_z.weight"].T).reshape(T, nv, dv)
                b, a = n @ W[a_ + "in_proj_b.weight"].T, n @ W[a_ + "in_proj_a.weight"].T
            mixed = silu(causal_conv(mixed, W[a_ + "conv1d.weight"]))
            q = mixed[:, :nk * dk].reshape(T, nk, dk)
            k = mixed[:, nk * dk:2 * nk * dk].reshape(T, nk, dk)
            v = mixed[:, 2 * nk * dk:].reshape(T, nv, dv)
            l2 = lambda t: t / np.sqrt((t * t).sum(-1, keepdims=True) + 1e-6)  # noqa: E731
            q, k = l2(q) * dk ** -0.5, l2(k)
            q, k = np.repeat(q, nv // nk, axis=1), np.repeat(k, nv // nk, axis=1)
            beta = sigmoid(b)
            gdecay = -np.exp(W[a_ + "A_log"]) * softplus(a + W[a_ + "dt_bias"])
            S = np.zeros((nv, dk, dv))
            o = np.zeros((T, nv, dv))
            for t in range(T):
                S = S * np.exp(gdecay[t])[:, None, None]
                kv = np.einsum("hk,hkv->hv", k[t], S)
                delta = (v[t] - kv) * beta[t][:, None]
                S = S + k[t][:, :, None] * delta[:, None, :]
                o[t] = np.einsum("hk,hkv->hv", q[t], S)
            o = rms(o, eps) * W[a_ + "norm.weight"] * silu(z)
            x = x + o.reshape(T, -1) @ W[a_ + "out_proj.weight"].T
        else:
            a_ = p + "self_attn."
            qg = (n @ W[a_ + "q_proj.weight"].T).reshape(T, H, 2 * hd)
            q, gate = qg[..., :hd], qg[..., hd:].reshape(T, H * hd)
            q = offset_norm(q, W[a_ + "q_norm.weight"])
            k = offset_norm((n @ W[a_ + "k_proj.weight"].T).reshape(T, KV, hd), W[a_ + "k_norm.weight"])
            v = (n @ W[a_ + "v_proj.weight"].T).reshape(T, KV, hd)
            pos = np.arange(T, dtype=np.float64)
            q, k = rope(q, pos, rot, theta), rope(k, pos, rot, theta)
            o = attention(q, k, v).reshape(T, H * hd) * sigmoid(gate)
            x = x + o @ W[a_ + "o_proj.weight"].T
        n = offset_norm(x, W[p + "post_attention_layernorm.weight"])
        m = p + "mlp."
        logits = n @ W[m + "gate.weight"].T
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        out = np.zeros_like(x)
        for t in range(T):
            top = np.argsort(-probs[t], kind="stable")[:topk]
            wts = probs[t, top] / (probs[t, top].sum() if renorm else 1.0)
            for e, w in zip(top, wts):
                e_ = f"{m}experts.{e}."
                hdn = silu(n[t] @ W[e_ + "gate_proj.weight"].T) * (n[t] @ W[e_ + "up_proj.weight"].T)
                out[t] += w * (hdn @ W[e_ + "down_proj.weight"].T)
        s_ = m + "shared_expert."
        shared = (silu(n @ W[s_ + "gate_proj.weight"].T) * (n @ W[s_ + "up_proj.weight"].T)) @ W[s_ + "down_proj.weight"].T
        x = x + out + sigmoid(n @ W[m + "shared_expert_gate.weight"].T) * shared
        assert E == W[m + "gate.weight"].shape[0]
    return offset_norm(x, W[f"{prefix}norm.weight"]) @ W["lm_head.weight"].T


def nemotron_forward(W, cfg, ids):
    T = len(ids)
    eps = cfg["layer_norm_epsilon"]
    H, P, N, G = cfg["mamba_num_heads"], cfg["mamba_head_dim"], cfg["ssm_state_size"], cfg["n_groups"]
    AH, KV, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    inner = H * P
    x = W["backbone.embeddings.weight"][ids]
    for layer, kind in enumerate(cfg["layers_block_type"]):
        p = f"backbone.layers.{layer}."
        n = rms(x, eps) * W[p + "norm.weight"]
        m = p + "mixer."
        if kind == "linear_attention":  # Mamba-2
            proj = n @ W[m + "in_proj.weight"].T
            z, xbc, dt = proj[:, :inner], proj[:, inner:2 * inner + 2 * G * N], proj[:, 2 * inner + 2 * G * N:]
            xbc = silu(causal_conv(xbc, W[m + "conv1d.weight"], W.get(m + "conv1d.bias")))
            xs = xbc[:, :inner].reshape(T, H, P)
            B = xbc[:, inner:inner + G * N].reshape(T, G, N)
            C = xbc[:, inner + G * N:].reshape(T, G, N)
            dt = softplus(dt + W[m + "dt_bias"])
            A = -np.exp(W[m + "A_log"])
            grp = np.arange(H) // (H // G)
            s = np.zeros((H, P, N))
            y = np.zeros((T, H, P))
            for t in range(T):
                s = s * np.exp(dt[t] * A)[:, None, None] + (dt[t][:, None] * xs[t])[:, :, None] * B[t][grp][:, None, :]
                y[t] = np.einsum("hpn,hn->hp", s, C[t][grp]) + W[m + "D"][:, None] * xs[t]
            y = y.reshape(T, inner) * silu(z)
            y = rms(y.reshape(T, G, inner // G), eps).reshape(T, inner) * W[m + "norm.weight"]
            x = x + y @ W[m + "out_proj.weight"].T
        elif kind == "full_attention":
            q = (n @ W[m + "q_proj.weight"].T).reshape(T, AH, hd)
            k = (n @ W[m + "k_proj.weight"].T).reshape(T, KV, hd)
            v = (n @ W[m + "v_proj.weight"].T).reshape(T, KV, hd)
            x = x + attention(q, k, v).reshape(T, AH * hd) @ W[m + "o_proj.weight"].T
        elif kind == "mlp":
            x = x + (np.maximum(n @ W[m + "up_proj.weight"].T, 0) ** 2) @ W[m + "down_proj.weight"].T
        elif kind == "moe":
            assert cfg.get("n_group", 1) == 1 and cfg.get("moe_latent_size") is None
            topk = cfg["num_experts_per_tok"]
            scores = sigmoid(n @ W[m + "gate.weight"].T)
            keys = scores + W[m + "gate.e_score_correction_bias"]
            out = np.zeros_like(x)
            for t in range(T):
                top = np.argsort(-keys[t], kind="stable")[:topk]
                wts = scores[t, top]
                if cfg.get("norm_topk_prob", True):
                    wts = wts / (wts.sum() + 1e-20)
                wts = wts * cfg.get("routed_scaling_factor", 1.0)
                for e, w in zip(top, wts):
                    e_ = f"{m}experts.{e}."
                    hdn = np.maximum(n[t] @ W[e_ + "up_proj.weight"].T, 0) ** 2
                    out[t] += w * (hdn @ W[e_ + "down_proj.weight"].T)
            s_ = m + "shared_experts."
            shared = (np.maximum(n @ W[s_ + "up_proj.weight"].T, 0) ** 2) @ W[s_ + "down_proj.weight"].T
            x = x + out + shared
        else:
            raise SystemExit(f"layer {layer}: {kind} is not in this check")
    return rms(x, eps) * W["backbone.norm_f.weight"] @ W["lm_head.weight"].T


def main():
    d = Path(sys.argv[1])
    cfg = json.loads((d / "config.json").read_text())
    t = json.loads((d / "transcript.json").read_text())
    W = load(d)
    ids = t["prompt_ids"] + [s["id"] for s in t["steps"]][:-1]
    if cfg["model_type"] == "nemotron_h":
        logits = nemotron_forward(W, cfg, ids)
    else:
        text = dict(cfg, **cfg.get("text_config", {}))
        prefix = "model.language_model." if "model.language_model.embed_tokens.weight" in W else "model."
        logits = qwen_forward(W, text, ids, prefix)
    P = len(t["prompt_ids"])
    worst = 0.0
    for i, s in enumerate(t["steps"]):
        want = np.array(s["logits"])
        got = logits[P - 1 + i]
        rel = float(np.linalg.norm(got - want) / np.linalg.norm(want))
        worst = max(worst, rel)
        assert int(np.argmax(got)) == s["id"] or s["margin"] < 1e-3, (i, int(np.argmax(got)), s["id"])
    print(f"{d.name}: {len(t['steps'])} steps, worst relative L2 {worst:.2e} from transformers' float32")
    assert worst < 1e-4, worst


if __name__ == "__main__":
    main()
