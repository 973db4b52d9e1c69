# SPDX-License-Identifier: MIT OR Apache-2.0
"""Reference logits from `transformers` for one checkpoint: the numbers our engine is checked against.

Run on the GPU machine (see scripts/gpu/README.md):

    python3 scripts/gpu/reference_logits.py --model /tmp/metrale-ckpt/qwen3-0.6b \
        --out /tmp/metrale-ref/qwen3-0.6b.safetensors \
        --prompt-tokens 128 --decode-steps 64 --long-prompt-tokens 4096 --seed 0

Writes one safetensors file (P = prompt tokens, S = decode steps, V = vocab, L = long prompt):

    prompt_ids          int32   [P]     the random prompt
    prompt_logits       float32 [P, V]  prefill logits at every prompt position
    decode_ids          int32   [S]     greedy tokens: decode_ids[0] = argmax(prompt_logits[P-1]),
                                        decode_ids[i+1] = argmax(decode_logits[i])
    decode_logits       float32 [S, V]  decode_logits[i] = logits of the decode step that feeds
                                        decode_ids[i] at position P+i (KV cache of everything before)
    decode_top2_margin  float32 [S]     top-1 minus top-2 logit of the distribution decode_ids[i] was
                                        picked from (0 = a tie; small = a fragile greedy choice)
    long_prompt_ids     int32   [L]     (only with --long-prompt-tokens) a second random prompt
    long_positions      int32   [n]     positions whose logits are kept (default 0, L/4-1, L/2-1, L-1)
    long_logits         float32 [n, V]  prefill logits of the long prompt at those positions

plus string metadata (model dir, dtype, versions, date, GPU, seed, these definitions and the model's
config.json), and prints one compact JSON summary line on stdout.

Greedy means torch.argmax, which returns the first index on ties. The weights are always the bf16
values the engine holds (a GGUF is dequantised to bf16, as the engine does, before any widening);
logits are computed in --dtype. float32 gives the exact function of those weights, the reference
docs/precision.md judges the engine against; with --also-bf16 the same model is then run again in
bfloat16 on the same tokens (teacher-forced on the f32 greedy ids) and stored as

    prompt_logits_bf16 / decode_logits_bf16 / long_logits_bf16   float32, shapes as above

so that one file says how far transformers' own bf16 run is from the f32 function.
"""

import argparse
import json
import time
from pathlib import Path

import safetensors
import safetensors.torch
import torch
import transformers
from transformers import AutoModelForCausalLM

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# Where the model runs: the GPU, or (--device cpu) the CPU for a check of this script on a small model.
DEVICE = "cuda"


def utc_now():
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def special_token_ids(config):
    ids = []
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        v = getattr(config, key, None)
        if isinstance(v, int):
            ids.append(v)
        elif isinstance(v, (list, tuple)):
            ids.extend(int(x) for x in v)
    return ids


def random_prompt(n: int, vocab_size: int, specials, seed: int) -> torch.Tensor:
    """Deterministic ids that avoid special tokens (same rule as make_checkpoints.py). Qwen3 and
    Llama-3 keep all special (and unused padding) rows at the top of the vocabulary, so when the named
    specials sit in the upper half we draw below the lowest of them; otherwise we exclude the named ids.
    A CPU generator makes the ids identical on every machine."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    low = min(specials) if specials else vocab_size
    if low >= vocab_size // 2:
        allowed = torch.arange(low, dtype=torch.int64)
    else:
        mask = torch.ones(vocab_size, dtype=torch.bool)
        mask[torch.tensor(specials, dtype=torch.int64)] = False
        allowed = torch.arange(vocab_size, dtype=torch.int64)[mask]
    idx = torch.randint(0, allowed.numel(), (n,), generator=gen)
    return allowed[idx]


def top2_margin(logits: torch.Tensor) -> float:
    v = torch.topk(logits.float(), 2).values
    return (v[0] - v[1]).item()


def stats(t: torch.Tensor):
    return {"shape": list(t.shape), "std": round(t.std().item(), 5), "mean": round(t.mean().item(), 5),
            "finite": bool(torch.isfinite(t).all().item())}


def default_long_positions(n: int):
    return sorted({p for p in (0, n // 4 - 1, n // 2 - 1, n - 1) if p >= 0})


def load_model(path: str, dtype, gguf_file=None):
    """Loads the checkpoint with bf16 weights (as the engine holds them), then casts to `dtype`."""
    kwargs = dict(dtype=torch.bfloat16, attn_implementation="sdpa")
    if gguf_file:
        # A GGUF checkpoint: transformers dequantises it with its own loader (needs `gguf`).
        kwargs["gguf_file"] = gguf_file
    try:
        if DEVICE == "cpu":
            model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
        else:
            model = AutoModelForCausalLM.from_pretrained(path, device_map=DEVICE, **kwargs)
    except (ImportError, ValueError) as e:
        # device_map needs `accelerate`; without it, load on the CPU and move (slower, same result).
        if "accelerate" not in str(e):
            raise
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs).to(DEVICE)
    # .to() casts buffers as well as weights; a bf16 model keeps RoPE's inv_freq in f32, so only
    # widen (never narrow) after loading.
    return (model if dtype == torch.bfloat16 else model.to(dtype)).eval()


@torch.inference_mode()
def teacher_forced(model, prompt: torch.Tensor, decode_ids: torch.Tensor):
    """Prompt logits, then the logits after feeding each of `decode_ids` in turn. The cache that
    model() returns is whatever the model keeps: for the hybrid families (qwen3_next, qwen3_5_moe,
    nemotron_h) transformers' DynamicCache(config=...) holds the attention layers' KV and the
    recurrent layers' conv and recurrent states, and a one-token step takes their recurrent decode
    path (the prefill their chunked one)."""
    out = model(input_ids=prompt[None].to(DEVICE), use_cache=True)
    prompt_logits = out.logits[0].float()
    cache = out.past_key_values
    del out
    steps = []
    for cur in decode_ids.tolist():
        out = model(input_ids=torch.tensor([[cur]], device=DEVICE), past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        steps.append(out.logits[0, -1].float())
        del out
    decode_logits = torch.stack(steps) if steps else prompt_logits.new_zeros((0, prompt_logits.shape[-1]))
    return prompt_logits, decode_logits


def rel_err(a: torch.Tensor, b: torch.Tensor):
    """Per-row ||a - b|| / ||b||."""
    return ((a - b).norm(dim=-1) / b.norm(dim=-1)).tolist()


@torch.inference_mode()
def prefill_and_decode(model, prompt: torch.Tensor, steps: int):
    out = model(input_ids=prompt[None].to(DEVICE), use_cache=True)
    prompt_logits = out.logits[0].float()
    cache = out.past_key_values
    del out

    ids, step_logits, margins = [], [], []
    picked_from = prompt_logits[-1]
    for i in range(steps):
        cur = int(torch.argmax(picked_from).item())
        ids.append(cur)
        margins.append(top2_margin(picked_from))
        out = model(input_ids=torch.tensor([[cur]], device=DEVICE), past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        picked_from = out.logits[0, -1].float()
        step_logits.append(picked_from)
        del out
    decode_logits = torch.stack(step_logits) if steps else prompt_logits.new_zeros((0, prompt_logits.shape[-1]))
    return prompt_logits, torch.tensor(ids, dtype=torch.int32), decode_logits, torch.tensor(margins, dtype=torch.float32)


@torch.inference_mode()
def generate_check(model, prompt: torch.Tensor, decode_ids: torch.Tensor):
    """Independent cross-check of the hand-written decode loop: transformers' own greedy generate()
    must pick the same tokens. generate() stops at EOS and our loop does not, so only the common
    prefix is compared. Diagnostic only: an error here does not invalidate the reference."""
    try:
        eos = model.generation_config.eos_token_id
        pad = eos[0] if isinstance(eos, (list, tuple)) else eos
        ids = prompt[None].to(DEVICE)
        seq = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=int(decode_ids.numel()),
                             do_sample=False, pad_token_id=pad)
        new = seq[0, ids.shape[1]:].cpu().to(torch.int32)
        n = min(new.numel(), decode_ids.numel())
        agree = 0
        while agree < n and int(new[agree]) == int(decode_ids[agree]):
            agree += 1
        return {"generated": int(new.numel()), "agree_prefix": agree, "compared": n, "ok": agree == n}
    except Exception as e:  # noqa: BLE001 - report, do not fail the run
        return {"error": f"{type(e).__name__}: {e}"[:300]}


@torch.inference_mode()
def long_prefill(model, ids: torch.Tensor, positions):
    out = model(input_ids=ids[None].to(DEVICE), use_cache=False)
    logits = out.logits[0, torch.tensor(positions, device=DEVICE)].float()
    del out
    return logits


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="checkpoint directory (config.json + safetensors, or the GGUF's directory)")
    ap.add_argument("--gguf-file", default=None, help="file name of a GGUF checkpoint inside --model")
    ap.add_argument("--out", required=True, type=Path, help="output .safetensors file")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--decode-steps", type=int, default=64)
    ap.add_argument("--long-prompt-tokens", type=int, default=None)
    ap.add_argument("--long-positions", default=None,
                    help="comma-separated positions of the long prompt to keep (default 0,L/4-1,L/2-1,L-1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    ap.add_argument("--also-bf16", action="store_true",
                    help="with --dtype float32: also store transformers' bf16 logits for the same tokens")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu to check this script on a small model")
    args = ap.parse_args()
    global DEVICE
    DEVICE = args.device
    if args.prompt_tokens < 1 or args.decode_steps < 0:
        raise SystemExit("--prompt-tokens must be >= 1 and --decode-steps >= 0")
    if DEVICE.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("no CUDA device")

    # A float32 reference must really be float32: keep TF32 out of the matmuls. And a bfloat16
    # reference must accumulate its GEMMs in float32 throughout: PyTorch by default lets cuBLAS
    # reduce split-K partial sums in reduced precision, which adds a rounding per GEMM that no
    # careful bf16 engine (nor transformers on another GPU) would reproduce.
    torch.set_float32_matmul_precision("highest")
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
    torch.manual_seed(args.seed)
    t0 = time.time()
    model = load_model(args.model, DTYPES[args.dtype], args.gguf_file)
    config = model.config
    vocab = config.vocab_size
    specials = special_token_ids(config)
    t_load = time.time() - t0

    prompt = random_prompt(args.prompt_tokens, vocab, specials, args.seed)
    prompt_logits, decode_ids, decode_logits, margins = prefill_and_decode(model, prompt, args.decode_steps)
    gen_check = generate_check(model, prompt, decode_ids) if args.decode_steps else None

    tensors = {
        "prompt_ids": prompt.to(torch.int32),
        "prompt_logits": prompt_logits.cpu(),
        "decode_ids": decode_ids,
        "decode_logits": decode_logits.cpu(),
        "decode_top2_margin": margins,
    }
    summary_long = None
    if args.long_prompt_tokens:
        L = args.long_prompt_tokens
        if args.long_positions:
            positions = sorted({int(p) for p in args.long_positions.split(",")})
        else:
            positions = default_long_positions(L)
        if not positions or positions[0] < 0 or positions[-1] >= L:
            raise SystemExit(f"--long-positions must lie in [0, {L})")
        # A different seed than the short prompt, so the two prefills share no prefix.
        long_ids = random_prompt(L, vocab, specials, args.seed + 1)
        long_logits = long_prefill(model, long_ids, positions)
        tensors["long_prompt_ids"] = long_ids.to(torch.int32)
        tensors["long_positions"] = torch.tensor(positions, dtype=torch.int32)
        tensors["long_logits"] = long_logits.cpu()
        summary_long = {"tokens": L, "positions": positions, "logits": stats(long_logits),
                        "argmax": long_logits.argmax(-1).tolist()}

    config_json = Path(args.model, "config.json")
    metadata = {
        "format": "pt",
        "producer": "scripts/gpu/reference_logits.py",
        "model_dir": str(Path(args.model).resolve()),
        "model_type": str(getattr(config, "model_type", "")),
        "dtype": args.dtype,
        "attn_implementation": "sdpa",
        "seed": str(args.seed),
        "prompt_tokens": str(args.prompt_tokens),
        "decode_steps": str(args.decode_steps),
        "long_prompt_tokens": str(args.long_prompt_tokens or 0),
        "prompt_rule": "torch.Generator('cpu').manual_seed(seed) (seed+1 for the long prompt), "
                       "ids uniform below the lowest named special id when that id is in the upper half "
                       "of the vocabulary, else uniform over the vocabulary minus the named special ids",
        "decode_rule": "decode_ids[0]=argmax(prompt_logits[-1]); decode_logits[i]=logits after feeding "
                       "decode_ids[i] at position prompt_tokens+i; decode_ids[i+1]=argmax(decode_logits[i]); "
                       "argmax = first index on ties; no stop at EOS",
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "safetensors_version": getattr(safetensors, "__version__", "unknown"),
        "cuda_version": str(torch.version.cuda),
        "gpu": torch.cuda.get_device_name(0) if DEVICE.startswith("cuda") else "cpu",
        "date_utc": utc_now(),
        "config_json": config_json.read_text() if config_json.is_file() else "",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    safetensors.torch.save_file({k: v.contiguous() for k, v in tensors.items()}, str(args.out), metadata=metadata)

    bf16_summary = None
    if args.also_bf16:
        # A fresh bf16 load, not model.to(bfloat16): .to() would also cast the f32 buffers (RoPE's
        # inv_freq) that transformers keeps in f32 in a model loaded in bf16.
        del model
        if DEVICE.startswith("cuda"):
            torch.cuda.empty_cache()
        model = load_model(args.model, torch.bfloat16, args.gguf_file)
        p16, d16 = teacher_forced(model, prompt, decode_ids)
        tensors["prompt_logits_bf16"] = p16.cpu()
        tensors["decode_logits_bf16"] = d16.cpu()
        errs = {"prompt": rel_err(p16, prompt_logits), "decode": rel_err(d16, decode_logits)}
        if args.long_prompt_tokens:
            l16 = long_prefill(model, long_ids, positions)
            tensors["long_logits_bf16"] = l16.cpu()
            errs["long"] = rel_err(l16, long_logits)
        bf16_summary = {k: {"max": round(max(v), 5), "mean": round(sum(v) / len(v), 5)} for k, v in errs.items() if v}
        metadata["also_bf16"] = "prompt_logits_bf16, decode_logits_bf16, long_logits_bf16: the same model in bfloat16, same tokens"
        safetensors.torch.save_file({k: v.contiguous() for k, v in tensors.items()}, str(args.out), metadata=metadata)

    summary = {
        "transformers_bf16_vs_this": bf16_summary,
        "out": str(args.out),
        "bytes": args.out.stat().st_size,
        "model": metadata["model_dir"],
        "dtype": args.dtype,
        "gpu": metadata["gpu"],
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "prompt_logits": stats(prompt_logits),
        "decode_logits": stats(decode_logits) if args.decode_steps else None,
        "decode_ids": decode_ids.tolist(),
        "decode_min_margin": round(margins.min().item(), 5) if args.decode_steps else None,
        "decode_ties": int((margins == 0).sum().item()),
        "generate_check": gen_check,
        "long": summary_long,
        "seconds": {"load": round(t_load, 1), "total": round(time.time() - t0, 1)},
    }
    print(json.dumps(summary, separators=(",", ":")), flush=True)


if __name__ == "__main__":
    main()
