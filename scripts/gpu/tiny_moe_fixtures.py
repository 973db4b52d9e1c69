#!/usr/bin/env python3
# SPDX-License-Identifier: MIT OR Apache-2.0
"""Tiny random MoE checkpoints and their transformers greedy transcripts, the CI fixtures of
crates/model-engine/tests/moe_fixtures.rs (runs on the GPU machine: transformers + torch).

For each of qwen3_moe and qwen2_moe (with its shared expert): a config at toy widths, weights
~ N(0, 0.1) for matrices (larger than make_checkpoints.py's 0.02 so that routing and logits have
margins at this size) and 1 + N(0, 0.1) for norms from torch.Generator(seed), saved by
transformers (its own layout), then greedy decoding of fixed prompt ids in float32 with the
logits of every step and the top-2 margins. Writes <out>/<name>/{config.json, model.safetensors,
transcript.json}.

    python3 scripts/gpu/tiny_moe_fixtures.py --out crates/model-engine/tests/fixtures
"""
import argparse
import json
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

COMMON = {
    "hidden_size": 128, "intermediate_size": 192, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 64, "num_hidden_layers": 3, "vocab_size": 256, "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0, "max_position_embeddings": 256, "tie_word_embeddings": False,
    "hidden_act": "silu", "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
}
CONFIGS = {
    "tiny-qwen3-moe": dict(COMMON, model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"],
                           num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                           norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1]),
    "tiny-qwen2-moe": dict(COMMON, model_type="qwen2_moe", architectures=["Qwen2MoeForCausalLM"],
                           num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
                           shared_expert_intermediate_size=48, norm_topk_prob=False,
                           decoder_sparse_step=1, mlp_only_layers=[]),
}
PROMPT = [1, 17, 99, 3, 250, 42, 7, 128, 64, 200, 5, 33]
STEPS = 16


def make(name: str, out: Path, seed: int):
    cfg_dict = dict(CONFIGS[name])
    model_type = cfg_dict.pop("model_type")
    cfg = AutoConfig.for_model(model_type, **cfg_dict)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
            elif p.ndim == 1:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    d = out / name
    d.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(d, safe_serialization=True)
    # The engine reads the hub's config.json keys; transformers 5 writes them too.
    f32 = model.float().cuda().eval()
    ids = list(PROMPT)
    steps = []
    with torch.no_grad():
        for _ in range(STEPS):
            logits = f32(torch.tensor([ids], device="cuda")).logits[0, -1].float().cpu()
            top = torch.topk(logits, 2)
            nxt = int(top.indices[0])
            steps.append({"id": nxt, "margin": float(top.values[0] - top.values[1]),
                          "logits": [round(float(x), 6) for x in logits]})
            ids.append(nxt)
    transcript = {"produced_by": "scripts/gpu/tiny_moe_fixtures.py", "seed": seed,
                  "dtype": "float32 on the bf16 weights", "transformers": __import__("transformers").__version__,
                  "torch": torch.__version__, "gpu": torch.cuda.get_device_name(),
                  "prompt_ids": PROMPT, "steps": steps}
    (d / "transcript.json").write_text(json.dumps(transcript))
    for f in d.iterdir():
        print(name, f.name, f.stat().st_size)
    print(name, "ids", [s["id"] for s in steps], "min margin", min(s["margin"] for s in steps))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    for name in CONFIGS:
        make(name, args.out, args.seed)


if __name__ == "__main__":
    main()
