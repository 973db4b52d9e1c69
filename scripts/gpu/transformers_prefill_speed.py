# SPDX-License-Identifier: MIT OR Apache-2.0
"""Time to first token of `transformers` (bf16, SDPA attention) for prompts of several lengths: the
peer column of the TTFT rows of the speed table (scripts/gpu/speed.sh models).

    python3 scripts/gpu/transformers_prefill_speed.py --model /root/ckpt/qwen3-8b \
        --prompt-tokens 128,1024,8192 --json hf-prefill-qwen3-8b.json

Method: per prompt length, one forward pass over the whole prompt with a fresh dynamic KV cache
(use_cache=True, as generate() prefills) that keeps only the last position's logits
(logits_to_keep=1, what generate() asks for), followed by the argmax of those logits: the work
between a prompt arriving and its first token. Two untimed warm-up passes, then the median of
--repeats passes, each between torch.cuda.synchronize() calls.
"""

import argparse
import json
import time
from pathlib import Path

import torch
import transformers

from transformers_decode_speed import load_model, median, random_prompts, special_token_ids, utc_now


@torch.inference_mode()
def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="checkpoint directory")
    ap.add_argument("--prompt-tokens", default="128,1024,8192", help="comma-separated prompt lengths")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", required=True, type=Path)
    args = ap.parse_args()
    model = load_model(args.model, torch.bfloat16)
    config = model.config
    rows = []
    for p in (int(x) for x in args.prompt_tokens.split(",")):
        ids = random_prompts(1, p, config.vocab_size, special_token_ids(config), args.seed).to("cuda")

        def once():
            torch.cuda.synchronize()
            t = time.perf_counter()
            out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
            out.logits[:, -1].argmax(-1).item()
            torch.cuda.synchronize()
            return time.perf_counter() - t

        for _ in range(2):
            once()
        times = [once() for _ in range(args.repeats)]
        row = {"prompt_tokens": p, "ttft_ms": round(1e3 * median(times), 3), "times_ms": [round(1e3 * t, 3) for t in times]}
        print(json.dumps(row), flush=True)
        rows.append(row)
    report = {
        "producer": "scripts/gpu/transformers_prefill_speed.py",
        "model": str(Path(args.model).resolve()),
        "dtype": "bfloat16",
        "attn_implementation": "sdpa",
        "repeats": args.repeats,
        "rows": rows,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "gpu": torch.cuda.get_device_name(0),
        "date_utc": utc_now(),
    }
    args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
