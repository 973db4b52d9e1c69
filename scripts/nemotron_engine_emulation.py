# SPDX-License-Identifier: MIT OR Apache-2.0
"""Nemotron-H (Mamba-2 + attention + squared-ReLU MLP) written out in float32 torch, with every point
where the engine rounds an activation to bf16 (or keeps it in f32) as a switch, run on a checkpoint
and the prompt / decode ids of a `reference_logits.py --dtype float32 --also-bf16` file.

Per position (prompt and teacher-forced decode rows alike) it prints the relative L2 error of the
logits against the reference's float32 ones, next to transformers-bf16's, for the engine's rounding
policy and for that policy with one rounding point removed (or added) at a time; with `--engine
PARITY.json` (`met parity --json` on the same checkpoint and reference) it first checks that the
emulation reproduces the engine's per-position errors (correlation, ratio).

    /work/pyenv/bin/python scripts/nemotron_engine_emulation.py --model CKPT --reference REF \
        [--engine parity.json] [--variants all|NAME,...] [--json out.json]

The rounding points (names used by --variants; the engine's policy rounds every one of them):
    norm       a block's RMSNorm output (bf16(x * rsqrt(mean x^2 + eps) * w))
    in_z       Mamba in_proj output, the gate z columns
    in_x       Mamba in_proj output, the x columns (the conv's input)
    in_bc      Mamba in_proj output, the B | C columns (the conv's input)
    in_dt      Mamba in_proj output, the dt columns (before + dt_bias and the softplus)
    conv_x     the conv + bias + SiLU output, x columns (as the recurrence reads them)
    conv_bc    the conv + bias + SiLU output, B | C columns
    gnorm      the gated RMSNorm's output (out_proj's input)
    out        out_proj's output (the block output added to the f32 residual)
    qkv        q, k, v projections' outputs
    probs      attention probabilities (bf16 in prefill, f16 in decode rows; renormalised)
    attn       attention output (o_proj's input)
    o          o_proj's output
    mlp_up     the MLP's up product output
    mlp_act    relu^2 output (down's input)
    mlp_down   down's output
    final      final norm's output (the LM head's input)
`residual` (not in the engine's policy) rounds the residual stream after every add, as transformers
bf16 does.
"""

import argparse
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

ENGINE = ["norm", "in_z", "in_x", "in_bc", "in_dt", "conv_x", "conv_bc", "gnorm", "out", "qkv", "probs", "attn", "o",
          "mlp_up", "mlp_act", "mlp_down", "final"]


def bf(x):
    return x.bfloat16().float()


def f16(x):
    return x.half().float()


class Model:
    def __init__(self, path: Path):
        cfg = json.loads((path / "config.json").read_text())
        self.cfg = cfg
        w = {}
        for f in sorted(path.glob("*.safetensors")):
            w.update(load_file(str(f)))
        self.w = {k: v.float() for k, v in w.items()}
        pre = "backbone." if any(k.startswith("backbone.") for k in w) else "model."
        self.pre = pre
        self.pattern = cfg["hybrid_override_pattern"]
        self.eps = cfg.get("layer_norm_epsilon", cfg.get("rms_norm_eps", 1e-5))
        self.heads = cfg["mamba_num_heads"]
        self.head_dim = cfg["mamba_head_dim"]
        self.groups = cfg["n_groups"]
        self.state = cfg["ssm_state_size"]
        self.inner = self.heads * self.head_dim
        self.kernel = cfg["conv_kernel"]
        self.dt_min = cfg.get("time_step_min", 0.0)

    def t(self, name):
        return self.w[self.pre + name]

    def forward(self, ids, R, decode_from, dt_floor=None):
        """Logits [T, V] for ids [T]; R is the set of rounding points; rows from `decode_from` on
        take the decode attention's f16 probabilities."""
        r = lambda key, x: bf(x) if key in R else x
        self.R = R
        h = self.t("embeddings.weight")[ids]
        for i, kind in enumerate(self.pattern):
            L = f"layers.{i}."
            x = r("norm", rms(h, self.t(L + "norm.weight"), self.eps))
            if kind == "M":
                y = self.mamba(x, L + "mixer.", r, dt_floor)
            elif kind == "*":
                y = self.attention(x, L + "mixer.", r, decode_from)
            elif kind == "-":
                m = L + "mixer."
                u = r("mlp_up", x @ self.t(m + "up_proj.weight").T)
                a = r("mlp_act", torch.relu(u) ** 2)
                y = r("mlp_down", a @ self.t(m + "down_proj.weight").T)
            else:
                raise SystemExit(f"layer kind {kind!r} not emulated")
            h = h + y
            if "residual" in R:
                h = bf(h)
        x = r("final", rms(h, self.t("norm_f.weight"), self.eps))
        return x @ self.w["lm_head.weight"].T

    def mamba(self, x, m, r, dt_floor):
        T = x.shape[0]
        H, P, G, N, inner = self.heads, self.head_dim, self.groups, self.state, self.inner
        proj = x @ self.t(m + "in_proj.weight").T
        conv_ch = inner + 2 * G * N
        z = r("in_z", proj[:, :inner])
        xbc = torch.cat([r("in_x", proj[:, inner:2 * inner]), r("in_bc", proj[:, 2 * inner:inner + conv_ch])], 1)
        dt = r("in_dt", proj[:, inner + conv_ch:])
        cw = self.t(m + "conv1d.weight").reshape(conv_ch, self.kernel)
        cb = self.t(m + "conv1d.bias") if (self.pre + m + "conv1d.bias") in self.w else 0.0
        padded = torch.cat([xbc.new_zeros(self.kernel - 1, conv_ch), xbc], 0)
        conv = sum(padded[k:k + T] * cw[:, k] for k in range(self.kernel)) + cb
        conv = F.silu(conv)
        conv = torch.cat([r("conv_x", conv[:, :inner]), r("conv_bc", conv[:, inner:])], 1)
        xs, B, C = conv[:, :inner], conv[:, inner:inner + G * N], conv[:, inner + G * N:]
        dt = F.softplus(dt + self.t(m + "dt_bias"))
        if dt_floor is not None:
            dt = dt.clamp(min=dt_floor)
        A = -torch.exp(self.t(m + "A_log"))
        D = self.t(m + "D")
        xs = xs.reshape(T, H, P)
        rep = H // G
        B = B.reshape(T, G, N).repeat_interleave(rep, 1)
        C = C.reshape(T, G, N).repeat_interleave(rep, 1)
        state = x.new_zeros(H, P, N, dtype=torch.float64)
        ys = []
        for t in range(T):
            decay = torch.exp(dt[t] * A).double()
            state = state * decay[:, None, None] + (dt[t, :, None, None] * xs[t, :, :, None] * B[t, :, None, :]).double()
            ys.append((state * C[t, :, None, :].double()).sum(-1).float())
        y = torch.stack(ys) + xs * D[None, :, None]
        y = y.reshape(T, inner)
        # Gated RMSNorm, gate first, per group of heads.
        g = y * F.silu(z)
        gs = g.reshape(T, G, inner // G)
        gs = gs * torch.rsqrt(gs.pow(2).mean(-1, keepdim=True) + self.eps)
        g = r("gnorm", gs.reshape(T, inner) * self.t(m + "norm.weight"))
        return r("out", g @ self.t(m + "out_proj.weight").T)

    def attention(self, x, m, r, decode_from):
        T = x.shape[0]
        cfg = self.cfg
        nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        hd = cfg.get("head_dim") or cfg["attention_head_dim"]
        q = r("qkv", x @ self.t(m + "q_proj.weight").T).reshape(T, nh, hd).transpose(0, 1)
        k = r("qkv", x @ self.t(m + "k_proj.weight").T).reshape(T, nkv, hd).transpose(0, 1)
        v = r("qkv", x @ self.t(m + "v_proj.weight").T).reshape(T, nkv, hd).transpose(0, 1)
        k = k.repeat_interleave(nh // nkv, 0)
        v = v.repeat_interleave(nh // nkv, 0)
        s = (q @ k.transpose(1, 2)) / math.sqrt(hd)
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        p = torch.exp(s - s.amax(-1, keepdim=True))
        pr = p
        if "probs" in self.R:
            pr = p.clone()
            pr[:, :decode_from] = bf(p[:, :decode_from])
            pr[:, decode_from:] = f16(p[:, decode_from:])
        o = (pr @ v) / pr.sum(-1, keepdim=True)
        o = r("attn", o.transpose(0, 1).reshape(T, nh * hd))
        return r("o", o @ self.t(m + "o_proj.weight").T)


def rms(h, w, eps):
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * w


def rel(a, b):
    return ((a - b).norm(dim=-1) / b.norm(dim=-1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--reference", type=Path, required=True)
    ap.add_argument("--engine", type=Path)
    ap.add_argument("--variants", default="all")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    ref = load_file(str(args.reference))
    ids = torch.cat([ref["prompt_ids"].long(), ref["decode_ids"].long()])
    n_prompt = ref["prompt_ids"].numel()
    ref32 = torch.cat([ref["prompt_logits"], ref["decode_logits"]])
    ref16 = torch.cat([ref["prompt_logits_bf16"], ref["decode_logits_bf16"]])
    bf_err = rel(ref16, ref32)
    model = Model(args.model)

    def run(R, dt_floor=None):
        return rel(model.forward(ids, R, n_prompt, dt_floor), ref32)

    exact = run(set(), dt_floor=model.dt_min)
    print(f"no rounding (f32, dt clamped at {model.dt_min} as transformers' torch scan): "
          f"max rel err {exact.max():.2e} (the emulation's own distance from the reference)")
    variants = {"engine": set(ENGINE)}
    names = ENGINE + ["residual"]
    if args.variants == "all":
        for n in ENGINE:
            variants[f"engine - {n}"] = set(ENGINE) - {n}
        variants["engine + residual"] = set(ENGINE) | {"residual"}
        variants["engine - in_x, in_bc, conv_x, conv_bc"] = set(ENGINE) - {"in_x", "in_bc", "conv_x", "conv_bc"}
        variants["engine - in_bc, conv_bc"] = set(ENGINE) - {"in_bc", "conv_bc"}
        for n in ENGINE:
            variants[f"only {n}"] = {n}
    else:
        for v in args.variants.split(","):
            if v == "engine":
                continue
            if v.startswith("only:"):
                variants[v] = set(v[5:].split("+"))
            else:
                drop = set(v.split("+"))
                assert drop <= set(names), drop
                variants[f"engine - {'+'.join(sorted(drop))}"] = set(ENGINE) - drop
    out = {"transformers_bf16": bf_err.tolist(), "exact": exact.tolist(), "variants": {}}
    eng = None
    if args.engine:
        j = json.loads(args.engine.read_text())
        eng = engine_errors(j, n_prompt, ids.numel())
        out["engine"] = eng.tolist()
    print(f"transformers-bf16: mean {bf_err.mean():.4e} max {bf_err.max():.4e}")
    if eng is not None:
        report("engine (met parity)", eng, bf_err)
    for name, R in variants.items():
        e = run(R)
        out["variants"][name] = e.tolist()
        report(name, e, bf_err, eng)
    if args.json:
        args.json.write_text(json.dumps(out))


def engine_errors(j, n_prompt, n):
    """Per-position relative errors from `met parity --json` (a list of rows with phase, position,
    rel), prompt rows then decode rows in the reference's order."""
    pre = [r["rel"] for r in j if r["phase"] == "prefill"]
    dec = [r["rel"] for r in j if r["phase"] == "decode"]
    assert len(pre) == n_prompt and len(pre) + len(dec) == n, (len(pre), len(dec))
    return torch.tensor(pre + dec)


def report(name, e, bf_err, eng=None):
    above = (e > bf_err).nonzero().flatten().tolist()
    ratio = e / bf_err
    line = (f"{name:32s} mean {e.mean():.4e} ({(e.mean() / bf_err.mean()):.3f}x bf16) "
            f"max ratio {ratio.max():.3f} above {len(above):3d}: {above[:12]}")
    if eng is not None:
        c = torch.corrcoef(torch.stack([e, eng]))[0, 1]
        line += f" | corr w/ engine {c:.3f}, mean ratio {(e / eng).mean():.3f}"
    print(line, flush=True)


if __name__ == "__main__":
    main()
