# SPDX-License-Identifier: MIT OR Apache-2.0
"""Golden greedy transcripts of SmolLM2-135M-Instruct from transformers, for the engine's CI test.

transformers reads the same GGUF file the engine reads (its own GGUF loader dequantises the Q4_1 /
Q8_0 tensors and undoes llama.cpp's Q/K permutation), keeps the weights in bfloat16 as the engine
does, renders the chat template and tokenizes with the GGUF's own vocabulary, then decodes
greedily. The JSON it writes is committed as crates/server/tests/fixtures/smollm2_golden.json.

Run on the GPU machine (needs the `gguf` package; carry its wheel if missing):
    python3 scripts/gpu/smollm2_golden.py --gguf /path/SmolLM2-135M-Instruct.Q4_1.gguf --out golden.json
"""
import argparse
import datetime
import json
import os
import sys

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three primary colors.",
    "Explain in one sentence what a CPU does.",
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()

    folder, name = os.path.split(os.path.abspath(args.gguf))
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.bfloat16).to(args.device)
    model.eval()
    eos = tok.eos_token_id
    cases = []
    for prompt in PROMPTS:
        messages = [{"role": "user", "content": prompt}]
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        # The template writes its own special tokens: no BOS is added on top.
        ids = tok(text, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            out = model.generate(
                torch.tensor([ids], device=args.device),
                max_new_tokens=args.max_new_tokens,
                do_sample=False,
                eos_token_id=eos,
                pad_token_id=eos,
                output_scores=True,
                return_dict_in_generate=True,
            )
        new = out.sequences[0, len(ids):].tolist()
        # The reference's own top-2 margin at every step: where it is within one bf16 step of the
        # top logit, the reference itself is tied at its precision, and a correct engine may pick
        # either token.
        margins, ulps = [], []
        for score in out.scores:
            top = torch.topk(score[0].float(), 2).values
            margins.append(float(top[0] - top[1]))
            ulps.append(float(torch.finfo(torch.bfloat16).eps * 2 ** torch.floor(torch.log2(top[0].abs()))))
        if eos in new:
            cut = new.index(eos)
            new, margins, ulps = new[:cut], margins[:cut + 1], ulps[:cut + 1]
        cases.append({
            "prompt": prompt,
            "chat_text": text,
            "prompt_ids": ids,
            "output_ids": new,
            "top2_margins": margins,
            "bf16_ulp_of_top": ulps,
            "output_text": tok.decode(new),
        })
        print(json.dumps({"prompt": prompt, "output": tok.decode(new)}), flush=True)
    result = {
        "produced_by": "python3 scripts/gpu/smollm2_golden.py --gguf SmolLM2-135M-Instruct.Q4_1.gguf --out golden.json",
        "model": name,
        "dtype": "bfloat16",
        "max_new_tokens": args.max_new_tokens,
        "eos_token_id": eos,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "cases": cases,
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1, ensure_ascii=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
