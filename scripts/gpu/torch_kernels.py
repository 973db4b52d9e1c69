# SPDX-License-Identifier: MIT OR Apache-2.0
"""The PyTorch side of the kernel table: the op(s) PyTorch runs for each row of
`met bench-kernels`, on the same shapes, timed the same way (CUDA events around batches of
launches, the median batch), written as JSON rows whose labels match bench-kernels' labels.

    python3 scripts/gpu/torch_kernels.py --shape qwen3-8b --json /root/results/torch-kernels-qwen3-8b.json

What "the same thing" means per row (bf16 tensors, as transformers runs the model):
  GEMV / GEMM        F.linear(a, w)                           (cuBLAS; the LM head returns bf16)
  add+rmsnorm        the HF Qwen3RMSNorm after a residual add: h = h + x; y = w * norm(h.float()).to(bf16)
  add+rmsnorm+X      that, then the product X (F.linear; and F.silu(g) * u for gate_up+silu*mul)
  gate_up+silu*mul   F.linear(a, w_gate_up), then F.silu(g) * u over its halves
  silu*mul           F.silu(gate) * up over the halves of one [tokens, 2I] tensor
  decode attention   F.scaled_dot_product_attention(q, K, V, enable_gqa=True) over a contiguous
                     [batch, kv_heads, context, head_dim] cache (transformers' static-cache layout)
  prefill attention  the same, causal, over [1, heads, tokens, head_dim]
  argmax             logits.argmax(-1) over f32 logits
  embedding          F.embedding(ids, table).float(): the gather widened to the f32 residual
  fp8 (--fp8, dense shapes) torch._scaled_mm over e4m3 weights with a scale per output row, the
                     bf16 activation quantized to e4m3 per row inside the timed op (amax, divide,
                     cast: dynamic per-token scales, as vLLM's FP8 linear); rows below 16 are padded
                     to 16 (the op's shape rule), the label keeps the real count. Its scales are
                     per row, not met's 128 x 128 blocks: PyTorch has no block-scaled matmul op.
  moe (--shape qwen3-30b-a3b: bench-kernels' expert rows, the same routing: row r's slot s takes
  expert (r k + s) % E) what transformers' routed MLP runs in bf16 (its eager experts loop, as
                     Qwen3MoeSparseMoeBlock): route = F.linear logits' softmax in f32, topk,
                     renormalised; gate_up+silu*mul and grouped gate_up = per touched expert
                     F.linear(x[its rows], w_gate_up[e]) then F.silu(g) * u; down (+combine) = per
                     expert F.linear(act, w_down[e]) * weight, index_add_ into the output;
                     group = one_hot(ids).permute + nonzero (the loop's bookkeeping); combine is
                     inside transformers' down (index_add_), so its row times index_add_ alone
                     (--shape nemotron-3-nano-30b-a3b: NemotronHExperts' loop, squared-ReLU experts
                     without a gate: up+relu2 = per touched expert relu(F.linear(x, w_up[e]))^2,
                     as ACT2FN["relu2"]; route = sigmoid scores, topk, renormalised, * 2.5)
"""

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

MOE_SHAPES = {
    "qwen3-30b-a3b": dict(hidden=2048, inter=768, experts=128, k=8),
    "nemotron-3-nano-30b-a3b": dict(hidden=2688, inter=1856, experts=128, k=6, relu2=True),
}

SHAPES = {
    "qwen3-8b": dict(hidden=4096, inter=12288, q_heads=32, kv_heads=8, head_dim=128, vocab=151936),
    "qwen3-0.6b": dict(hidden=1024, inter=3072, q_heads=16, kv_heads=8, head_dim=128, vocab=151936),
}


def timed(fn, warmup=3, batches=5, per_batch=20):
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(batches):
        start.record()
        for _ in range(per_batch):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / per_batch)
    times.sort()
    return times[len(times) // 2]


def rows_for(name, s, prefill):
    h, i = s["hidden"], s["inter"]
    qh, kvh, hd = s["q_heads"], s["kv_heads"], s["head_dim"]
    qd, kvd = qh * hd, kvh * hd
    bf = torch.bfloat16
    dev = "cuda"
    out = []

    def linear_row(what, m, n, k):
        a = torch.randn(m, k, device=dev, dtype=bf)
        w = torch.randn(n, k, device=dev, dtype=bf) / k**0.5
        us = timed(lambda: F.linear(a, w))
        out.append({"label": f"{name} {what} m={m} n={n} k={k}", "op": "F.linear", "us": us,
                    "bytes": (n * k + m * k + m * n) * 2, "flops": 2 * m * n * k})

    for m in (1, 8):
        linear_row("q_proj", m, qd, h)
        linear_row("qkv_proj", m, qd + 2 * kvd, h)
        linear_row("k_proj", m, kvd, h)
        linear_row("o_proj", m, h, qd)
        linear_row("gate_up", m, 2 * i, h)
        linear_row("down", m, h, i)
        linear_row("lm_head", m, s["vocab"], h)
    for m in (16, 64):
        linear_row("gate_up", m, 2 * i, h)
        linear_row("down", m, h, i)

    def add_norm(hid, x, w):
        r = hid + x
        v = r.float()
        v = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6)
        return w * v.to(bf)

    def fused_rows(m):
        # The engine's fused rows at m rows: SiLU x up after the gate|up product, and the residual
        # add + RMSNorm before the qkv and gate|up products.
        hid = torch.randn(m, h, device=dev, dtype=bf)
        x = torch.randn(m, h, device=dev, dtype=bf)
        nw = torch.ones(h, device=dev, dtype=bf)
        w_qkv = torch.randn(qd + 2 * kvd, h, device=dev, dtype=bf) / h**0.5
        w_gu = torch.randn(2 * i, h, device=dev, dtype=bf) / h**0.5

        def swiglu(a):
            gu = F.linear(a, w_gu)
            return F.silu(gu[:, :i]) * gu[:, i:]

        weight_bytes = (qd + 2 * kvd) * h * 2
        out.append({"label": f"{name} add+rmsnorm+qkv_proj m={m} n={qd + 2 * kvd} k={h}",
                    "op": "HF add + RMSNorm, F.linear", "us": timed(lambda: F.linear(add_norm(hid, x, nw), w_qkv)),
                    "bytes": weight_bytes + m * h * 10 + m * (qd + 2 * kvd) * 2,
                    "flops": 2 * m * (qd + 2 * kvd) * h})
        out.append({"label": f"{name} gate_up+silu*mul m={m} n={2 * i} k={h}",
                    "op": "F.linear, F.silu(g) * u", "us": timed(lambda: swiglu(hid)),
                    "bytes": 2 * i * h * 2 + m * h * 2 + m * i * 2, "flops": 4 * m * i * h})
        out.append({"label": f"{name} add+rmsnorm+gate_up+silu*mul m={m} n={2 * i} k={h}",
                    "op": "HF add + RMSNorm, F.linear, F.silu(g) * u",
                    "us": timed(lambda: swiglu(add_norm(hid, x, nw))),
                    "bytes": 2 * i * h * 2 + m * h * 10 + m * i * 2, "flops": 4 * m * i * h})

    def norm_row(rows):
        hid = torch.randn(rows, h, device=dev, dtype=bf)
        x = torch.randn(rows, h, device=dev, dtype=bf)
        w = torch.ones(h, device=dev, dtype=bf)
        out.append({"label": f"{name} add+rmsnorm rows={rows}", "op": "HF add + RMSNorm (eager)",
                    "us": timed(lambda: add_norm(hid, x, w)), "bytes": rows * h * 2 * 4, "flops": 4 * rows * h})

    def embedding_row(t):
        # The gather into the residual stream as the engine keeps it (f32); transformers' own
        # residual stays bf16, so its embedding is the gather alone.
        table = torch.randn(s["vocab"], h, device=dev, dtype=bf)
        ids = (torch.arange(t, device=dev) * 7919 + 13) % s["vocab"]
        out.append({"label": f"{name} embedding tokens={t}", "op": "F.embedding(ids, table).float()",
                    "us": timed(lambda: F.embedding(ids, table).float()), "bytes": t * (h * 6 + 4),
                    "flops": t * h})

    def silu_row(t):
        gu = torch.randn(t, 2 * i, device=dev, dtype=bf)
        g, u = gu[:, :i], gu[:, i:]
        out.append({"label": f"{name} silu*mul tokens={t}", "op": "F.silu(g) * u",
                    "us": timed(lambda: F.silu(g) * u), "bytes": t * i * 6, "flops": 5 * t * i})

    def attention_row(seqs, tokens, context):
        q = torch.randn(seqs, qh, tokens, hd, device=dev, dtype=bf)
        k = torch.randn(seqs, kvh, context, hd, device=dev, dtype=bf)
        v = torch.randn(seqs, kvh, context, hd, device=dev, dtype=bf)
        causal = tokens > 1
        us = timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True))
        what = (f"decode attention seqs={seqs} context={context}" if tokens == 1
                else f"prefill attention tokens={tokens}")
        keys = seqs * (tokens * (tokens + 1) // 2 if causal else context)
        out.append({"label": f"{name} {what}", "op": "F.scaled_dot_product_attention",
                    "us": us, "bytes": 2 * seqs * context * kvd * 2 + 2 * 2 * seqs * tokens * qd,
                    "flops": 4 * keys * qd})

    def qkv_post_row(t, what):
        # What HF runs between the QKV projections and attention, eagerly: per-head RMSNorm of q
        # and k (Qwen3), NeoX RoPE on both, and the new keys and values written into a cache.
        qkv = torch.randn(t, qd + 2 * kvd, device=dev, dtype=bf)
        qw, kw = torch.ones(hd, device=dev, dtype=bf), torch.ones(hd, device=dev, dtype=bf)
        pos = torch.arange(t, device=dev) + 7
        inv = 1.0 / (1e6 ** (torch.arange(0, hd, 2, device=dev, dtype=torch.float32) / hd))
        ang = pos[:, None].float() * inv[None, :]
        cos = torch.cat([ang.cos(), ang.cos()], -1).to(bf)[:, None, :]
        sin = torch.cat([ang.sin(), ang.sin()], -1).to(bf)[:, None, :]
        k_cache = torch.zeros(t + 64, kvh, hd, device=dev, dtype=bf)
        v_cache = torch.zeros_like(k_cache)
        slots = torch.arange(t, device=dev) + 3

        def rms(x, w):
            v = x.float()
            return w * (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6)).to(bf)

        def rot(x):
            x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
            return x * cos + torch.cat([-x2, x1], -1) * sin

        def f():
            q, k, v = qkv.split([qd, kvd, kvd], -1)
            q = rot(rms(q.view(t, qh, hd), qw))
            k = rot(rms(k.view(t, kvh, hd), kw))
            k_cache.index_copy_(0, slots, k)
            v_cache.index_copy_(0, slots, v.view(t, kvh, hd))
            return q
        out.append({"label": f"{name} qk-norm+rope+kv-write {what} tokens={t}",
                    "op": "HF q/k RMSNorm + RoPE + index_copy_ (eager)", "us": timed(f),
                    "bytes": t * (qd + 2 * kvd) * 2 * 2, "flops": 10 * t * (qd + kvd)})

    embedding_row(1)
    norm_row(1)
    fused_rows(1)
    qkv_post_row(1, "decode")
    silu_row(1)
    attention_row(1, 1, 160)
    attention_row(1, 1, 256)
    attention_row(1, 1, 1024)
    attention_row(1, 1, 8192)
    attention_row(64, 1, 1024)
    for t in prefill:
        linear_row("q_proj", t, qd, h)
        linear_row("gate_up", t, 2 * i, h)
        linear_row("down", t, h, i)
        attention_row(1, t, t)
        embedding_row(t)
        norm_row(t)
        qkv_post_row(t, "prefill")
        silu_row(t)
    for rows in (1, 64):
        logits = torch.randn(rows, s["vocab"], device=dev, dtype=torch.float32)
        out.append({"label": f"{name} argmax rows={rows}", "op": "logits.argmax(-1)",
                    "us": timed(lambda: logits.argmax(-1)), "bytes": rows * s["vocab"] * 4, "flops": rows * s["vocab"]})
    for r in out:
        r["gb_s"] = r["bytes"] / r["us"] / 1e3
        r["tflop_s"] = r["flops"] / r["us"] / 1e6
    return out


def fp8_rows(name, s, prefill):
    """torch._scaled_mm rows at bench-kernels' FP8 product labels (`<shape> fp8 <what> m= n= k=`)."""
    h, i = s["hidden"], s["inter"]
    qd, kvd = s["q_heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
    dev, f8 = "cuda", torch.float8_e4m3fn
    fmax = torch.finfo(f8).max
    out = []

    def row(what, m, n, k):
        rows = max(16, m)
        a = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k**0.5
        w_scale = (w.float().abs().amax(dim=1, keepdim=True) / fmax).clamp(min=1e-12)
        w8 = (w.float() / w_scale).to(f8)
        w_scale_t = w_scale.t().contiguous()  # [1, n]

        def f():
            a_scale = (a.float().abs().amax(dim=1, keepdim=True) / fmax).clamp(min=1e-12)
            a8 = (a.float() / a_scale).to(f8)
            return torch._scaled_mm(a8, w8.t(), scale_a=a_scale, scale_b=w_scale_t, out_dtype=torch.bfloat16)

        op = "torch._scaled_mm (rowwise, act. quantized in the op)" + (f", padded to {rows} rows" if rows != m else "")
        out.append({"label": f"{name} fp8 {what} m={m} n={n} k={k}", "op": op, "us": timed(f),
                    "bytes": n * k + n * 4 + m * k * 2 + m * n * 2, "flops": 2 * m * n * k})

    for m in [1, 8] + list(prefill):
        row("qkv_proj", m, qd + 2 * kvd, h)
        row("o_proj", m, h, qd)
        row("gate_up", m, 2 * i, h)
        row("down", m, h, i)
    for r in out:
        r["gb_s"] = r["bytes"] / r["us"] / 1e3
        r["tflop_s"] = r["flops"] / r["us"] / 1e6
    return out


def moe_rows(name, s, prefill):
    """The routed MLP's pieces at bench-kernels' MoE labels (bench/moe.rs)."""
    h, i, e, k = s["hidden"], s["inter"], s["experts"], s["k"]
    relu2 = s.get("relu2", False)
    # Weight rows a column of the first product reads: gate and up, or up alone.
    rows_per = 1 if relu2 else 2
    first = "up+relu2" if relu2 else "gate_up+silu*mul"
    bf, dev = torch.bfloat16, "cuda"
    w_gate_up = torch.randn(e, rows_per * i, h, device=dev, dtype=bf) * 0.02
    w_down = torch.randn(e, h, i, device=dev, dtype=bf) * 0.02
    router = torch.randn(e, h, device=dev, dtype=bf) * 0.02
    bias = torch.randn(e, device=dev, dtype=torch.float32) * 0.01
    out = []

    def routing(rows):
        ids = (torch.arange(rows * k, device=dev) % e).reshape(rows, k)
        weights = torch.full((rows, k), 1.0 / k, device=dev, dtype=torch.float32)
        return ids, weights

    def per_expert(ids):
        """transformers' loop bookkeeping: for each hit expert, its (slot, row) pairs."""
        mask = F.one_hot(ids, num_classes=e).permute(2, 1, 0)
        hit = (mask.sum(dim=(-1, -2)) > 0).nonzero()
        return [(int(x), *torch.where(mask[int(x)])) for x in hit]

    def gate_up_fn(x, groups, acts):
        def f():
            for j, (ex, _slot, tok) in enumerate(groups):
                if relu2:
                    acts[j] = torch.square(F.relu(F.linear(x[tok], w_gate_up[ex])))
                else:
                    g, u = F.linear(x[tok], w_gate_up[ex]).chunk(2, dim=-1)
                    acts[j] = F.silu(g) * u
        return f

    def down_fn(x, groups, acts, weights):
        final = torch.zeros_like(x)

        def f():
            final.zero_()
            for j, (ex, slot, tok) in enumerate(groups):
                y = F.linear(acts[j], w_down[ex]) * weights[tok, slot, None]
                final.index_add_(0, tok, y.to(final.dtype))
        return f

    def route_row(rows):
        x = torch.randn(rows, h, device=dev, dtype=bf)

        def f():
            logits = F.linear(x, router)
            if relu2:
                p = logits.float().sigmoid()
                _, idx = torch.topk(p + bias, k, dim=-1)
                w = p.gather(1, idx)
                return w / w.sum(-1, keepdim=True) * 2.5, idx
            p = torch.softmax(logits.float(), dim=-1)
            w, idx = torch.topk(p, k, dim=-1)
            return w / w.sum(-1, keepdim=True), idx
        op = "router F.linear, sigmoid, topk on + bias, renormalise" if relu2 else \
            "router F.linear, softmax, topk, renormalise"
        out.append({"label": f"{name} moe route rows={rows} experts={e} k={k}", "op": op, "us": timed(f),
                    "bytes": rows * (e * 4 + k * 8), "flops": rows * e * (4 + k)})

    def touched(rows):
        return min(rows * k, e)

    def expert_rows(rows, gate_label, down_label):
        x = torch.randn(rows, h, device=dev, dtype=bf)
        ids, weights = routing(rows)
        groups = per_expert(ids)
        acts = [None] * len(groups)
        up = gate_up_fn(x, groups, acts)
        up()
        n = rows * k
        op = "per expert F.linear + relu(.)^2" if relu2 else "per expert F.linear + F.silu(g) * u"
        out.append({"label": gate_label, "op": op, "us": timed(up),
                    "bytes": touched(rows) * rows_per * i * h * 2 + rows * h * 2 + n * i * 2,
                    "flops": 2 * n * rows_per * i * h})
        down = down_fn(x, groups, acts, weights)
        out.append({"label": down_label, "op": "per expert F.linear * w, index_add_", "us": timed(down),
                    "bytes": touched(rows) * h * i * 2 + n * i * 2 + n * 8 + rows * h * 2,
                    "flops": 2 * n * h * i})
        return x, ids, weights, groups

    for rows in (1, 8, 32, 64):
        route_row(rows)
        expert_rows(rows, f"{name} moe {first} m={rows} k={k} inter={i} hidden={h}",
                    f"{name} moe down+combine m={rows} k={k} hidden={h} inter={i}")
    for tokens, form in [(t, " mma") for t in (16, 32, 64, 128)] + [(t, "") for t in prefill]:
        route_row(tokens)
        ids, _ = routing(tokens)
        n = tokens * k
        out.append({"label": f"{name} moe group tokens={tokens} k={k} experts={e}",
                    "op": "one_hot + permute + nonzero (transformers' loop)", "us": timed(lambda: per_expert(ids)),
                    "bytes": n * 8 + (e + 1) * 4, "flops": n})
        x, ids, weights, groups = expert_rows(
            tokens, f"{name} moe grouped{form} {first} tokens={tokens}",
            f"{name} moe grouped{form} down tokens={tokens}")
        y = torch.randn(n, h, device=dev, dtype=bf)
        final = torch.zeros(tokens, h, device=dev, dtype=bf)
        tok = torch.arange(n, device=dev) // k
        out.append({"label": f"{name} moe combine tokens={tokens}", "op": "index_add_ (inside transformers' down)",
                    "us": timed(lambda: final.index_add_(0, tok, y)),
                    "bytes": n * (h * 2 + 8) + tokens * h * 2, "flops": 2 * n * h})
    for r in out:
        r["gb_s"] = r["bytes"] / r["us"] / 1e3
        r["tflop_s"] = r["flops"] / r["us"] / 1e6
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES) + sorted(MOE_SHAPES), default="qwen3-8b")
    ap.add_argument("--prefill", default="128,1024,8192")
    ap.add_argument("--json", required=True, type=Path)
    ap.add_argument("--fp8", action="store_true", help="also the FP8 product rows (dense shapes)")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    prefill = [int(x) for x in args.prefill.split(",") if x]
    with torch.inference_mode():
        if args.shape in MOE_SHAPES:
            rows = moe_rows(args.shape, MOE_SHAPES[args.shape], prefill)
        else:
            rows = rows_for(args.shape, SHAPES[args.shape], prefill)
            if args.fp8:
                rows += fp8_rows(args.shape, SHAPES[args.shape], prefill)
    report = {"producer": "scripts/gpu/torch_kernels.py", "shape": args.shape, "torch": torch.__version__,
              "gpu": torch.cuda.get_device_name(0), "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "rows": rows}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    for r in rows:
        print(f"{r['label']:<60} {r['op']:<32} {r['us']:10.2f} us {r['gb_s']:8.0f} GB/s {r['tflop_s']:8.1f} TFLOP/s")


if __name__ == "__main__":
    main()
