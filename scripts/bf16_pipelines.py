# SPDX-License-Identifier: MIT OR Apache-2.0
"""How far bf16 pipelines sit from the f32 function of the same bf16 weights (no GPU; numpy).

Position 0 of a random Qwen3-shaped decoder (attention = v at position 0) with
scripts/gpu/make_checkpoints.py's init (matrices N(0, 0.02), norm weights 1 + N(0, 0.1); with
--residual-std the o and down projections use that std instead). Each pipeline is compared with
the f64-accumulated, unrounded run; the figures are ‖out − truth‖ / ‖truth‖ of the logits. This
is the table of docs/precision.md:

    python3 scripts/bf16_pipelines.py --shape 0.6b     # about 3 minutes on 2 cores
    python3 scripts/bf16_pipelines.py --shape 8b       # about 15 minutes, weights made per layer

Pipelines:
  hf        what a bf16 PyTorch model rounds: the residual after every add, a norm's output before
            and after its weight, silu(g) before the product with u, every projection output
  hf64      the same with f64 matmul accumulation (two correct bf16 pipelines, compared)
  f32res    hf's rounding points, but an f32 residual stream
  engine    f32 residual, one rounding per stored activation (metrale's policy)
  engine without rounding X   the same with one rounding point removed (0.6b only)

The 0.6b weights are drawn exactly as scripts/bf16_noise_floor.py draws them (the vocabulary cut to
1/8; the metric is a ratio); the 8b ones from one generator per layer (vocabulary cut to 1/16).
"""
import argparse

import numpy as np


def bf(x):
    x = np.asarray(x, np.float32)
    b = x.view(np.uint32).astype(np.uint64)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
    return b.astype(np.uint32).view(np.float32)


def ident(x):
    return np.asarray(x, np.float32)


def mm(x, w, acc):
    if acc == "f64":
        return (w.astype(np.float64) @ x.astype(np.float64)).astype(np.float32)
    return (w @ x).astype(np.float32)


class Pipeline:
    """Rounding choices: `res` for the residual after an add; `x`, `v`, `proj`, `gu`, `act` for the
    norm output, v, o/down outputs, gate/up outputs and SwiGLU output; `double` rounds a norm's
    output before its weight and silu(g) before the product (HF's order)."""

    def __init__(self, res, x, v, proj, gu, act, double, acc="f32"):
        self.res, self.x, self.v, self.proj, self.gu, self.act = res, x, v, proj, gu, act
        self.double, self.acc = double, acc

    def norm(self, h, w):
        y = h / np.sqrt(np.mean(h * h) + 1e-6)
        return self.x(w * self.x(y)) if self.double else self.x(w * y)

    def layer(self, h, lw, shape):
        kvh, qh, hd = shape["kvh"], shape["qh"], shape["hd"]
        x = self.norm(h, lw["n1"])
        v = self.v(mm(x, lw["v"], self.acc))
        a = np.repeat(v.reshape(kvh, hd), qh // kvh, axis=0).reshape(-1)
        h = self.res(h + self.proj(mm(a, lw["o"], self.acc)))
        x = self.norm(h, lw["n2"])
        g, u = self.gu(mm(x, lw["g"], self.acc)), self.gu(mm(x, lw["u"], self.acc))
        s = self.act(self.act(g / (1 + np.exp(-g))) * u) if self.double else self.act(g / (1 + np.exp(-g)) * u)
        return self.res(h + self.proj(mm(s, lw["d"], self.acc)))


PIPELINES = {
    "truth": Pipeline(ident, ident, ident, ident, ident, ident, False, "f64"),
    "hf": Pipeline(bf, bf, bf, bf, bf, bf, True),
    "hf64": Pipeline(bf, bf, bf, bf, bf, bf, True, "f64"),
    "f32res": Pipeline(ident, bf, bf, bf, bf, bf, True),
    "engine": Pipeline(ident, bf, bf, bf, bf, bf, False),
}
ABLATIONS = {
    "engine without rounding x": Pipeline(ident, ident, bf, bf, bf, bf, False),
    "engine without rounding v": Pipeline(ident, bf, ident, bf, bf, bf, False),
    "engine without rounding o/down outputs": Pipeline(ident, bf, bf, ident, bf, bf, False),
    "engine without rounding gate/up": Pipeline(ident, bf, bf, bf, ident, bf, False),
    "engine without rounding SwiGLU output": Pipeline(ident, bf, bf, bf, bf, ident, False),
}


def rel(a, b):
    return np.linalg.norm(a - b) / np.linalg.norm(b)


def run_06b(residual_std):
    H, I, L, V, HD, QH, KVH = 1024, 3072, 28, 151936 // 8, 128, 16, 8
    shape = dict(kvh=KVH, qh=QH, hd=HD)
    rng = np.random.default_rng(0)
    W = lambda o, i, s=0.02: bf(rng.normal(0, s, (o, i)).astype(np.float32))  # noqa: E731
    N = lambda d: bf(1 + rng.normal(0, 0.1, d).astype(np.float32))  # noqa: E731
    emb = W(V, H)
    layers = [dict(n1=N(H), v=W(KVH * HD, H), o=W(H, QH * HD, residual_std), n2=N(H), g=W(I, H), u=W(I, H),
                   d=W(H, I, residual_std)) for _ in range(L)]
    fn = N(H)
    tok = 123

    def logits(p):
        h = emb[tok].astype(np.float32).copy()
        for lw in layers:
            h = p.layer(h, lw, shape)
        return mm(p.norm(h, fn), emb, p.acc)

    out = {name: logits(p) for name, p in {**PIPELINES, **ABLATIONS}.items()}
    return out


def run_8b(residual_std):
    H, I, L, V, HD, QH, KVH = 4096, 12288, 36, 151936 // 16, 128, 32, 8
    shape = dict(kvh=KVH, qh=QH, hd=HD)
    W = lambda rng, o, i, s=0.02: bf(rng.standard_normal((o, i), dtype=np.float32) * s)  # noqa: E731
    N = lambda rng, d: bf(1 + 0.1 * rng.standard_normal(d, dtype=np.float32))  # noqa: E731
    r0 = np.random.default_rng(0)
    emb, head, fn = W(r0, V, H), W(r0, V, H), N(r0, H)
    tok = 123
    names = ["truth", "hf", "hf64", "f32res"]
    hs = {k: emb[tok].astype(np.float32).copy() for k in names}
    for li in range(L):
        rng = np.random.default_rng(1000 + li)
        lw = dict(n1=N(rng, H), v=W(rng, KVH * HD, H), o=W(rng, H, QH * HD, residual_std), n2=N(rng, H),
                  g=W(rng, I, H), u=W(rng, I, H), d=W(rng, H, I, residual_std))
        for k in names:
            hs[k] = PIPELINES[k].layer(hs[k], lw, shape)
    return {k: mm(PIPELINES[k].norm(hs[k], fn), head, PIPELINES[k].acc) for k in names}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=["0.6b", "8b"], default="0.6b")
    ap.add_argument("--residual-std", type=float, default=0.02,
                    help="std of the o and down projections (0.02: make_checkpoints.py; 0.02/sqrt(2L): GPT-2 style)")
    args = ap.parse_args()
    out = (run_06b if args.shape == "0.6b" else run_8b)(args.residual_std)
    truth = out.pop("truth")
    print(f"shape {args.shape}, o/down std {args.residual_std}, logit std {truth.std():.2f}")
    for name, v in out.items():
        print(f"  {name:<40} {rel(v, truth):.3e}")
    print(f"  {'hf against hf64':<40} {rel(out['hf'], out['hf64']):.3e}")


if __name__ == "__main__":
    main()
