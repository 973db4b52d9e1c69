# SPDX-License-Identifier: MIT OR Apache-2.0
"""Greedy decode throughput of `transformers`, the peer figures every engine speed number is reported
next to (DESIGN.md section 7).

Run on the GPU machine (see scripts/gpu/README.md):

    python3 scripts/gpu/transformers_decode_speed.py --model /tmp/metrale-ckpt/qwen3-8b \
        --prompt-tokens 32 --new-tokens 256 --batch 1 --modes eager,static_compile \
        --json /tmp/metrale-out/hf-speed-qwen3-8b.json

Modes, each measured the same way on a freshly loaded model:
  eager           model.generate with the default dynamic KV cache, no compilation.
  static_compile  the recipe of the transformers "Optimizing inference" guide:
                  generation_config.cache_implementation = "static" and
                  model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True),
                  each call preceded by torch.compiler.cudagraph_mark_step_begin() and its logits
                  copied out of the CUDA graph's memory (see run_mode), generate()'s own
                  auto-compilation disabled.
  static_auto     (optional) static cache only, relying on generate()'s own auto-compilation.
  static_compile_loop  the same static cache + torch.compile(mode="reduce-overhead", fullgraph=True)
                  on the decode step, driven by a plain greedy loop instead of generate() (the
                  guide's manual decoding example): eager prefill into a StaticCache, then one
                  compiled forward per token, each after cudagraph_mark_step_begin().

Method: W warm-up generate() calls of N tokens (they trigger compilation and CUDA-graph capture), one
warm-up call of 1 token, then R repetitions of [generate 1 token (time to first token), generate N
tokens], each timed between torch.cuda.synchronize() calls. min_new_tokens = max_new_tokens makes every
call produce exactly N tokens, do_sample=False makes it greedy. Decode throughput counts only the N-1
tokens after the first: B*(N-1) / (median t_total - median t_first). The N-token calls run first so the
1-token calls reuse their (larger) static cache instead of forcing a new one and a recompilation.
"""

import argparse
import json
import time
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM

MODES = ("eager", "static_compile", "static_auto", "static_compile_loop")


def utc_now():
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def median(xs):
    s = sorted(xs)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2


def special_token_ids(config):
    ids = []
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        v = getattr(config, key, None)
        if isinstance(v, int):
            ids.append(v)
        elif isinstance(v, (list, tuple)):
            ids.extend(int(x) for x in v)
    return ids


def random_prompts(batch: int, n: int, vocab_size: int, specials, seed: int) -> torch.Tensor:
    """Deterministic [batch, n] ids avoiding special tokens (same rule as reference_logits.py)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    low = min(specials) if specials else vocab_size
    if low >= vocab_size // 2:
        allowed = torch.arange(low, dtype=torch.int64)
    else:
        mask = torch.ones(vocab_size, dtype=torch.bool)
        mask[torch.tensor(specials, dtype=torch.int64)] = False
        allowed = torch.arange(vocab_size, dtype=torch.int64)[mask]
    idx = torch.randint(0, allowed.numel(), (batch, n), generator=gen)
    return allowed[idx]


def load_model(path: str, dtype):
    kwargs = dict(dtype=dtype, attn_implementation="sdpa")
    try:
        model = AutoModelForCausalLM.from_pretrained(path, device_map="cuda", **kwargs)
    except (ImportError, ValueError) as e:
        # device_map needs `accelerate`; without it, load on the CPU and move (slower, same result).
        if "accelerate" not in str(e):
            raise
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs).to("cuda")
    return model.eval()


def streamed_weight_bytes(model) -> int:
    """Bytes a batch-1 decode step must read: every weight once, except an untied input embedding
    table, of which only B rows are gathered (a tied one is read in full as the lm_head)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())  # tied weights counted once
    emb = model.get_input_embeddings().weight
    out = model.get_output_embeddings()
    tied = out is not None and out.weight.data_ptr() == emb.data_ptr()
    return total if tied else total - emb.numel() * emb.element_size()


def timed_generate(model, ids, mask, n_new: int, pad_id):
    torch.cuda.synchronize()
    t = time.perf_counter()
    seq = model.generate(ids, attention_mask=mask, max_new_tokens=n_new, min_new_tokens=n_new,
                         do_sample=False, pad_token_id=pad_id)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t
    if seq.shape[1] != ids.shape[1] + n_new:
        raise RuntimeError(f"generate produced {seq.shape[1] - ids.shape[1]} tokens, expected {n_new}")
    return dt


def summarize(mode, args, model, firsts, totals, warm, load_s, compile_config):
    """The result row of one mode from its timings (see the module doc for the method)."""
    N = args.new_tokens
    t_first, t_total = median(firsts), median(totals)
    decode_s = t_total - t_first
    decode_tok_s = args.batch * (N - 1) / decode_s if decode_s > 0 else float("nan")
    weight_bytes = streamed_weight_bytes(model)
    roofline_tok_s = args.batch * args.hbm_tb_s * 1e12 / weight_bytes
    result = {
        "mode": mode,
        "decode_tok_s": round(decode_tok_s, 2),
        "ms_per_step": round(1e3 * decode_s / (N - 1), 3),
        "ttft_ms": round(1e3 * t_first, 2),
        "total_s": round(t_total, 4),
        "end_to_end_tok_s": round(args.batch * N / t_total, 2),
        "t_first_s": [round(x, 5) for x in firsts],
        "t_total_s": [round(x, 4) for x in totals],
        "warmup_s": [round(x, 2) for x in warm],
        "load_s": round(load_s, 1),
        "streamed_weight_bytes": weight_bytes,
        "roofline_tok_s": round(roofline_tok_s, 1),
        "fraction_of_roofline": round(decode_tok_s / roofline_tok_s, 4),
        "compile_config": compile_config,
        "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
    }
    print(f"[{mode}] {json.dumps(result)}", flush=True)
    return result


def make_static_cache(model, batch: int, max_len: int, dtype):
    from transformers import StaticCache
    try:  # transformers 5: shapes and dtype are taken from the first update
        return StaticCache(config=model.config, max_cache_len=max_len)
    except TypeError:  # older signature
        return StaticCache(config=model.config, max_batch_size=batch, max_cache_len=max_len,
                           device="cuda", dtype=dtype)


@torch.inference_mode()
def run_loop_mode(args, dtype):
    t0 = time.time()
    model = load_model(args.model, dtype)
    load_s = time.time() - t0
    torch.compiler.reset()
    config = model.config
    ids = random_prompts(args.batch, args.prompt_tokens, config.vocab_size, special_token_ids(config), args.seed).to("cuda")
    P, N = args.prompt_tokens, args.new_tokens
    cache = make_static_cache(model, args.batch, P + N, dtype)

    def step(tok, pos):
        return model(input_ids=tok, past_key_values=cache, cache_position=pos, use_cache=True).logits

    compiled = torch.compile(step, mode="reduce-overhead", fullgraph=True)

    def generate(n_new: int):
        cache.reset()
        logits = step(ids, torch.arange(P, device="cuda"))
        tok = logits[:, -1].argmax(-1, keepdim=True)
        for i in range(1, n_new):
            torch.compiler.cudagraph_mark_step_begin()
            logits = compiled(tok, torch.tensor([P + i - 1], device="cuda"))
            tok = logits[:, -1].argmax(-1, keepdim=True)
        return tok

    def timed(n_new: int):
        torch.cuda.synchronize()
        t = time.perf_counter()
        generate(n_new)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    warm = [timed(N) for _ in range(args.warmup)] + [timed(1)]
    firsts, totals = [], []
    for _ in range(args.repeats):
        firsts.append(timed(1))
        totals.append(timed(N))
    return summarize("static_compile_loop", args, model, firsts, totals, warm, load_s,
                     {"mode": "reduce-overhead", "fullgraph": True, "driver": "manual greedy loop"})


def run_mode(mode: str, args, dtype):
    if mode == "static_compile_loop":
        return run_loop_mode(args, dtype)
    t0 = time.time()
    model = load_model(args.model, dtype)
    load_s = time.time() - t0
    torch.compiler.reset()  # no compiled state carried over from a previous mode

    # eager: explicitly the default dynamic cache (not compileable, so generate() never compiles).
    model.generation_config.cache_implementation = None if mode == "eager" else "static"
    if mode == "static_compile":
        # The guide's recipe, made to survive generate(): with mode="reduce-overhead" every call
        # replays a CUDA graph whose outputs live in memory the next replay overwrites, and
        # generate() still reads the previous step's outputs (2026-11-30 on the H200: "accessing
        # tensor output of CUDAGraphs that has been overwritten by a subsequent run", with and
        # without generate()'s own auto-compilation). So each call marks a new step and hands
        # generate() a copy of the logits (V floats per row: negligible next to the weights).
        compiled = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)

        def forward(*a, **kw):
            torch.compiler.cudagraph_mark_step_begin()
            out = compiled(*a, **kw)
            out.logits = out.logits.clone()
            return out

        model.forward = forward
        model.generation_config.disable_compile = True  # one compilation: ours
    compile_config = None  # None: generate() uses its default CompileConfig when it auto-compiles
    cc = getattr(model.generation_config, "compile_config", None)
    if mode != "eager" and cc is not None:
        compile_config = json.loads(json.dumps(cc.to_dict() if hasattr(cc, "to_dict") else str(cc), default=str))

    config = model.config
    ids = random_prompts(args.batch, args.prompt_tokens, config.vocab_size, special_token_ids(config), args.seed).to("cuda")
    mask = torch.ones_like(ids)
    eos = model.generation_config.eos_token_id
    pad_id = eos[0] if isinstance(eos, (list, tuple)) else eos

    N = args.new_tokens
    warm = []
    for _ in range(args.warmup):
        warm.append(timed_generate(model, ids, mask, N, pad_id))
    warm.append(timed_generate(model, ids, mask, 1, pad_id))

    firsts, totals = [], []
    for _ in range(args.repeats):
        firsts.append(timed_generate(model, ids, mask, 1, pad_id))
        totals.append(timed_generate(model, ids, mask, N, pad_id))
    return summarize(mode, args, model, firsts, totals, warm, load_s, compile_config)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="checkpoint directory")
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--modes", default="eager,static_compile,static_auto", help=f"comma-separated, from: {', '.join(MODES)}")
    ap.add_argument("--warmup", type=int, default=2, help="warm-up generate() calls of --new-tokens (>= 2)")
    ap.add_argument("--repeats", type=int, default=5, help="timed repetitions (the median is reported)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    ap.add_argument("--hbm-tb-s", type=float, default=4.19,
                    help="HBM read bandwidth for the roofline (4.19 TB/s measured on the H200, DESIGN.md)")
    ap.add_argument("--json", required=True, type=Path, help="output JSON file")
    args = ap.parse_args()

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise SystemExit(f"unknown mode(s) {bad}; known: {list(MODES)}")
    if args.new_tokens < 2 or args.warmup < 2 or args.repeats < 1 or args.batch < 1:
        raise SystemExit("need --new-tokens >= 2, --warmup >= 2, --repeats >= 1, --batch >= 1")
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device")
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]

    results = []
    for mode in modes:
        torch.cuda.reset_peak_memory_stats()
        try:
            results.append(run_mode(mode, args, dtype))
        except Exception as e:  # noqa: BLE001 - keep the other modes' numbers; reported and exit 1 below
            print(f"[{mode}] FAILED: {type(e).__name__}: {e}", flush=True)
            results.append({"mode": mode, "error": f"{type(e).__name__}: {e}"[:2000]})

    report = {
        "producer": "scripts/gpu/transformers_decode_speed.py",
        "model": str(Path(args.model).resolve()),
        "batch": args.batch,
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "dtype": args.dtype,
        "attn_implementation": "sdpa",
        "warmup": args.warmup,
        "repeats": args.repeats,
        "seed": args.seed,
        "method": "decode_tok_s = batch*(new_tokens-1) / (median t_total - median t_first); t_first from "
                  "generate(max_new_tokens=1), t_total from generate(max_new_tokens=new_tokens), both with "
                  "min_new_tokens=max_new_tokens, do_sample=False, torch.cuda.synchronize() around each call",
        "results": results,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "cuda_version": str(torch.version.cuda),
        "gpu": torch.cuda.get_device_name(0),
        "date_utc": utc_now(),
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")

    print()
    print(f"{Path(args.model).name}  batch {args.batch}  prompt {args.prompt_tokens}  new {args.new_tokens}  "
          f"{args.dtype}  {report['gpu']}  transformers {transformers.__version__}  torch {torch.__version__}")
    print("| mode | decode tok/s | ms/step | TTFT ms | roofline tok/s | of roofline |")
    print("|---|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['mode']} | failed: {r['error'][:80]} | | | | |")
            continue
        print(f"| {r['mode']} | {r['decode_tok_s']:.1f} | {r['ms_per_step']:.2f} | {r['ttft_ms']:.1f} | "
              f"{r['roofline_tok_s']:.0f} | {100 * r['fraction_of_roofline']:.0f}% |")
    print(f"written to {args.json}")
    if any("error" in r for r in results):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
