# SPDX-License-Identifier: MIT OR Apache-2.0
"""Random-weight checkpoints at the real configs of Qwen3-0.6B, Qwen3-8B and Llama-3.1-8B (and of
the MoE models, some at reduced depth: Qwen3-30B-A3B, Qwen1.5-MoE-A2.7B, MiniMax-M2, Mixtral-8x7B,
GLM-4.5-Air, and OLMoE-1B-7B at full depth; Granite-3.3-8B, Phi-4 and Seed-OSS-36B at reduced
depth, SmolLM3-3B at full depth; and of the
hybrid models: Qwen3-Next-80B-A3B and Qwen3.5-35B-A3B at 4 layers, Qwen3.5-35B-A3B at full depth,
Nemotron-H-8B at 4 layers and at full depth, NVIDIA-Nemotron-3-Nano-30B-A3B at 5 layers and at
full depth).

No machine here can reach a model hub, so the engine's large-model tests and speed runs use models
with the exact public shapes and random weights (decode speed does not depend on weight values).
Each checkpoint is an ordinary Hugging Face directory (config.json, *.safetensors, generation
config) that both `transformers` (the logits reference) and our engine load.

Run on the GPU machine (see scripts/gpu/README.md):

    python3 scripts/gpu/make_checkpoints.py --out /tmp/metrale-ckpt \
        --models qwen3-0.6b,qwen3-8b,llama-3.1-8b --seed 0

Every checkpoint is written to `<out>/<name>.partial`, checked (finite, well-scaled logits; a reload
through `from_pretrained` gives the same logits), and only then renamed to `<out>/<name>`, so a
directory under its final name is always complete; a second run skips it.

Without a GPU (a smoke test of this script: `--device cpu`, and `--override KEY=JSON` to shrink a
config, e.g. `--override hidden_size=256 --override num_experts=16`) the checkpoint is written
under `<name>+smoke` instead, so it is never taken for the real one. Its weights are not the
GPU's: the generator lives on the device the model is built on (`torch.Generator(device)`), and
a CPU and a CUDA generator draw different numbers from the same seed. To compare two backends or
machines position by position, run both on one checkpoint file (2026-12-04: a host-vs-H200
comparison on two checkpoints of the same seed was read as a GPU kernel error; it was the weights).
"""

import argparse
import json
import math
import time
from pathlib import Path

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM

# The public config.json of each model, key for key (Hugging Face hub: Qwen/Qwen3-0.6B, Qwen/Qwen3-8B,
# meta-llama/Llama-3.1-8B). These dicts are written out verbatim as the checkpoint's config.json so
# our engine is tested on exactly the format real checkpoints ship (rope_theta / rope_scaling /
# torch_dtype), not on the newer layout transformers 5 writes (rope_parameters / dtype).
MODELS = {
    "qwen3-0.6b": {
        "architectures": ["Qwen3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 1024,
        "initializer_range": 0.02,
        "intermediate_size": 3072,
        "max_position_embeddings": 40960,
        "max_window_layers": 28,
        "model_type": "qwen3",
        "num_attention_heads": 16,
        "num_hidden_layers": 28,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "sliding_window": None,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 151936,
    },
    "qwen3-8b": {
        "architectures": ["Qwen3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 12288,
        "max_position_embeddings": 40960,
        "max_window_layers": 36,
        "model_type": "qwen3",
        "num_attention_heads": 32,
        "num_hidden_layers": 36,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 151936,
    },
    # The base model (eos 128001); Llama-3.1-8B-Instruct differs only in eos [128001, 128008, 128009].
    # Its public config has no head_dim (it is hidden_size / num_attention_heads = 128); it is written
    # out explicitly so every checkpoint states it, which transformers accepts and which changes nothing.
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 14336,
        "max_position_embeddings": 131072,
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "factor": 8.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": 128256,
    },
    # Qwen3-30B-A3B's public config.json (128 experts, top 8, expert width 768, hidden 2048, 32/4
    # heads of 128), 4 of its 48 layers: parity at the real widths within the GPU machine's disk
    # and transformers' f32 memory.
    "qwen3-30b-a3b-4l": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "decoder_sparse_step": 1,
        "eos_token_id": 151645,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "intermediate_size": 6144,
        "max_position_embeddings": 40960,
        "max_window_layers": 4,
        "mlp_only_layers": [],
        "model_type": "qwen3_moe",
        "moe_intermediate_size": 768,
        "norm_topk_prob": True,
        "num_attention_heads": 32,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 4,
        "num_key_value_heads": 4,
        "output_router_logits": False,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.001,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 151936,
    },
    # Qwen1.5-MoE-A2.7B's public config.json (qwen2_moe: 60 experts, top 4 not renormalised,
    # expert width 1408, a shared expert of width 5632 behind its sigmoid gate, hidden 2048, 16/16
    # heads of 128 with q/k/v biases), 4 of its 24 layers.
    "qwen1.5-moe-a2.7b-4l": {
        "architectures": ["Qwen2MoeForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "decoder_sparse_step": 1,
        "eos_token_id": 151643,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "intermediate_size": 5632,
        "max_position_embeddings": 8192,
        "max_window_layers": 4,
        "model_type": "qwen2_moe",
        "moe_intermediate_size": 1408,
        "norm_topk_prob": False,
        "num_attention_heads": 16,
        "num_experts": 60,
        "num_experts_per_tok": 4,
        "num_hidden_layers": 4,
        "num_key_value_heads": 16,
        "output_router_logits": False,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.001,
        "shared_expert_intermediate_size": 5632,
        "sliding_window": 32768,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 151936,
    },
    # MiniMax-M2's public config.json (minimax_m2: 256 experts of width 1536, top 8, sigmoid
    # routing with a per-expert correction bias; q and k RMS-normalised over their whole
    # projections; RoPE on 64 of each head's 128 elements; hidden 3072, 48/8 heads of 128), 4 of
    # its 62 layers, without its FP8 quantization block and its MTP modules (use_mtp off: the
    # engine and transformers run the main layers only). RoPE's base and rotary fraction are
    # given as transformers 5 reads them (rope_parameters, which its MiniMax-M2 rotary embedding
    # takes partial_rotary_factor from) beside the hub's rotary_dim; the engine reads either and
    # refuses them if they disagree.
    "minimax-m2-4l": {
        "architectures": ["MiniMaxM2ForCausalLM"],
        "attn_type_list": [1, 1, 1, 1],
        "bos_token_id": 200034,
        "eos_token_id": 200020,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 3072,
        "initializer_range": 0.02,
        "intermediate_size": 1536,
        "max_position_embeddings": 196608,
        "model_type": "minimax_m2",
        "num_attention_heads": 48,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 4,
        "num_key_value_heads": 8,
        "num_local_experts": 256,
        "qk_norm_type": "per_layer",
        "rms_norm_eps": 1e-06,
        "rope_parameters": {"partial_rotary_factor": 0.5, "rope_theta": 5000000.0, "rope_type": "default"},
        "rotary_dim": 64,
        "router_aux_loss_coef": 0.001,
        "scoring_func": "sigmoid",
        "shared_intermediate_size": 0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_mtp": False,
        "use_qk_norm": True,
        "use_routing_bias": True,
        "vocab_size": 200064,
    },
    # Mixtral-8x7B-v0.1's public config.json (mixtral: Llama attention with 32/8 heads of 128, 8
    # experts of width 14336 in every layer, top 2 renormalised), 4 of its 32 layers.
    "mixtral-8x7b-4l": {
        "architectures": ["MixtralForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 14336,
        "max_position_embeddings": 32768,
        "model_type": "mixtral",
        "num_attention_heads": 32,
        "num_experts_per_tok": 2,
        "num_hidden_layers": 4,
        "num_key_value_heads": 8,
        "num_local_experts": 8,
        "output_router_logits": False,
        "rms_norm_eps": 1e-05,
        "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.02,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": 32000,
    },
    # OLMoE-1B-7B-0924's public config.json (olmoe: 16/16 heads of 128, q and k RMS-normalised over
    # their whole projections, 64 experts of width 1024 in every layer, top 8 not renormalised),
    # at its full depth (16 layers, 6.9B parameters, 14 GB).
    "olmoe-1b-7b": {
        "architectures": ["OlmoeForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "clip_qkv": None,
        "eos_token_id": 50279,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "intermediate_size": 1024,
        "max_position_embeddings": 4096,
        "model_type": "olmoe",
        "norm_topk_prob": False,
        "num_attention_heads": 16,
        "num_experts": 64,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 16,
        "num_key_value_heads": 16,
        "output_router_logits": False,
        "pad_token_id": 1,
        "rms_norm_eps": 1e-05,
        "rope_scaling": None,
        "rope_theta": 10000.0,
        "router_aux_loss_coef": 0.01,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": 50304,
    },
    # GLM-4.5-Air's public config.json (glm4_moe: 96/8 heads of 128 with q|k|v biases, RoPE on half of
    # each head; layer 0 dense of width 10944, then 128 experts of width 1408, top 8 under the
    # biased sigmoid router, and one ungated shared expert), 4 of its 46 layers, without its MTP
    # layer (num_nextn_predict_layers: transformers builds none either).
    "glm-4.5-air-4l": {
        "architectures": ["Glm4MoeForCausalLM"],
        "attention_bias": True,
        "attention_dropout": 0.0,
        "eos_token_id": [151329, 151336, 151338],
        "first_k_dense_replace": 1,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 10944,
        "max_position_embeddings": 131072,
        "model_type": "glm4_moe",
        "moe_intermediate_size": 1408,
        "n_group": 1,
        "n_routed_experts": 128,
        "n_shared_experts": 1,
        "norm_topk_prob": True,
        "num_attention_heads": 96,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 4,
        "num_key_value_heads": 8,
        "num_nextn_predict_layers": 0,
        "pad_token_id": 151329,
        "partial_rotary_factor": 0.5,
        "rms_norm_eps": 1e-05,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "routed_scaling_factor": 1.0,
        "tie_word_embeddings": False,
        "topk_group": 1,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_qk_norm": False,
        "vocab_size": 151552,
    },
    # Granite-3.3-8B-Instruct's public config.json (granite: Llama's decoder with 32/8 heads of 128,
    # tied embeddings, and its embedding / residual / attention / logit multipliers), 4 of its 40
    # layers.
    "granite-3.3-8b-4l": {
        "architectures": ["GraniteForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attention_multiplier": 0.0078125,
        "bos_token_id": 0,
        "embedding_multiplier": 12.0,
        "eos_token_id": 0,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 12800,
        "logits_scaling": 16.0,
        "max_position_embeddings": 131072,
        "mlp_bias": False,
        "model_type": "granite",
        "num_attention_heads": 32,
        "num_hidden_layers": 4,
        "num_key_value_heads": 8,
        "pad_token_id": 0,
        "residual_multiplier": 0.22,
        "rms_norm_eps": 1e-05,
        "rope_scaling": None,
        "rope_theta": 10000000.0,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": 49159,
    },
    # Phi-4's public config.json (phi3: 40/10 heads of 128, q|k|v and gate|up stored fused),
    # 4 of its 40 layers.
    "phi-4-4l": {
        "architectures": ["Phi3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 100257,
        "embd_pdrop": 0.0,
        "eos_token_id": 100265,
        "hidden_act": "silu",
        "hidden_size": 5120,
        "initializer_range": 0.02,
        "intermediate_size": 17920,
        "max_position_embeddings": 16384,
        "model_type": "phi3",
        "num_attention_heads": 40,
        "num_hidden_layers": 4,
        "num_key_value_heads": 10,
        "original_max_position_embeddings": 16384,
        "pad_token_id": 100349,
        "resid_pdrop": 0.0,
        "rms_norm_eps": 1e-05,
        "rope_scaling": None,
        "rope_theta": 250000,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": 100352,
    },
    # Seed-OSS-36B's widths (seed_oss: q|k|v biases, 80 query heads over 8 kv heads, whose groups
    # of 10 the decode attention splits into two blocks of 5), 4 of its 64 layers.
    "seed-oss-36b-4l": {
        "architectures": ["SeedOssForCausalLM"],
        "attention_bias": True,
        "attention_out_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 0,
        "eos_token_id": 2,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 5120,
        "initializer_range": 0.02,
        "intermediate_size": 27648,
        "max_position_embeddings": 524288,
        "mlp_bias": False,
        "model_type": "seed_oss",
        "num_attention_heads": 80,
        "num_hidden_layers": 4,
        "num_key_value_heads": 8,
        "pad_token_id": 1,
        "residual_dropout": 0.0,
        "rms_norm_eps": 1e-06,
        "rope_theta": 10000000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": 155136,
    },
    # SmolLM3-3B's widths (smollm3: 16/4 heads of 128, every fourth layer without RoPE, tied
    # embeddings), at its full depth (36 layers, 3.1B parameters).
    "smollm3-3b": {
        "architectures": ["SmolLM3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 128000,
        "eos_token_id": 128012,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "intermediate_size": 11008,
        "max_position_embeddings": 65536,
        "mlp_bias": False,
        "model_type": "smollm3",
        "no_rope_layer_interval": 4,
        "num_attention_heads": 16,
        "num_hidden_layers": 36,
        "num_key_value_heads": 4,
        "pad_token_id": 128004,
        "rms_norm_eps": 1e-06,
        "rope_theta": 5000000.0,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 128256,
    },
    # SmolLM2-135M's widths (hidden 576, 9 query / 3 kv heads of 64, intermediate 1536, 30 layers,
    # tied embeddings, its eps and theta) with the Qwen3 tokenizer's vocabulary, so that the Qwen3
    # tokenizer the GPU machine is given fits it: the shapes the real GGUF runs on CUDA (k = 576,
    # 1536), without carrying its 98 MB.
    "smollm2-widths": {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "head_dim": 64,
        "hidden_act": "silu",
        "hidden_size": 576,
        "initializer_range": 0.02,
        "intermediate_size": 1536,
        "max_position_embeddings": 8192,
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": 9,
        "num_hidden_layers": 30,
        "num_key_value_heads": 3,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_scaling": None,
        "rope_theta": 100000,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": 151936,
    },
    # Qwen3-Next-80B-A3B-Instruct's public config.json (qwen3_next: hidden 2048; one gated
    # full-attention layer (16/2 heads of 256, q|gate projection, partial RoPE on 64 of each
    # head's 256, theta 1e7) after every three Gated DeltaNet layers (16 q/k heads and 32 value
    # heads of 128, a 4-tap conv); in every layer 512 experts of width 512, top 10 renormalised,
    # and a shared expert of width 512 behind its sigmoid gate), 4 of its 48 layers: the pattern
    # comes from full_attention_interval, as the hub's config gives it (no layer_types). Its MTP
    # layer is not written. The same values as transformers' Qwen3NextConfig defaults (checked in
    # 5.17) and slime's scripts/models/qwen3-next-80B-A3B.sh.
    "qwen3-next-80b-a3b-4l": {
        "architectures": ["Qwen3NextForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "decoder_sparse_step": 1,
        "eos_token_id": 151645,
        "full_attention_interval": 4,
        "head_dim": 256,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "intermediate_size": 5120,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_value_head_dim": 128,
        "max_position_embeddings": 262144,
        "mlp_only_layers": [],
        "model_type": "qwen3_next",
        "moe_intermediate_size": 512,
        "norm_topk_prob": True,
        "num_attention_heads": 16,
        "num_experts": 512,
        "num_experts_per_tok": 10,
        "num_hidden_layers": 4,
        "num_key_value_heads": 2,
        "output_router_logits": False,
        "partial_rotary_factor": 0.25,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 10000000,
        "router_aux_loss_coef": 0.001,
        "shared_expert_intermediate_size": 512,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 151936,
    },
    # Qwen3.5-35B-A3B's config.json as the hub ships it (qwen3_5_moe: the multimodal model, the
    # text model under text_config; its vision_config is left out, which transformers fills with
    # its defaults and neither side reads): Qwen3-Next's layout with the Gated DeltaNet's
    # projections split, 40 layers, 256 experts top 8 (always renormalised), vocabulary 248320,
    # interleaved M-RoPE sections (text-only positions make it plain RoPE on 64 of 256), 4 of its
    # 40 layers. The values are transformers' Qwen3_5MoeTextConfig defaults (5.17) and slime's
    # scripts/models/qwen3.5-35B-A3B.sh; eos, the MTP and M-RoPE keys from a published inventory
    # of the hub config. What is built and saved is the text-only causal LM that
    # AutoModelForCausalLM makes of this config (Qwen3_5MoeForCausalLM: weights under model.,
    # one tensor per expert), not the hub's model.language_model. / model.visual. layout; no MTP
    # weights.
    "qwen3.5-35b-a3b-4l": {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "image_token_id": 248056,
        "model_type": "qwen3_5_moe",
        "text_config": {
            "attention_bias": False,
            "attention_dropout": 0.0,
            "attn_output_gate": True,
            "eos_token_id": 248044,
            "full_attention_interval": 4,
            "head_dim": 256,
            "hidden_act": "silu",
            "hidden_size": 2048,
            "initializer_range": 0.02,
            "layer_types": ["linear_attention"] * 3 + ["full_attention"],
            "linear_conv_kernel_dim": 4,
            "linear_key_head_dim": 128,
            "linear_num_key_heads": 16,
            "linear_num_value_heads": 32,
            "linear_value_head_dim": 128,
            "mamba_ssm_dtype": "float32",
            "max_position_embeddings": 262144,
            "model_type": "qwen3_5_moe_text",
            "moe_intermediate_size": 512,
            "mtp_num_hidden_layers": 1,
            "mtp_use_dedicated_embeddings": False,
            "num_attention_heads": 16,
            "num_experts": 256,
            "num_experts_per_tok": 8,
            "num_hidden_layers": 4,
            "num_key_value_heads": 2,
            "output_router_logits": False,
            "partial_rotary_factor": 0.25,
            "rms_norm_eps": 1e-06,
            "rope_parameters": {
                "mrope_interleaved": True,
                "mrope_section": [11, 11, 10],
                "partial_rotary_factor": 0.25,
                "rope_theta": 10000000,
                "rope_type": "default",
            },
            "router_aux_loss_coef": 0.001,
            "shared_expert_intermediate_size": 512,
            "tie_word_embeddings": False,
            "use_cache": True,
            "vocab_size": 248320,
        },
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "video_token_id": 248057,
        "vision_end_token_id": 248054,
        "vision_start_token_id": 248053,
    },
    # Nemotron-H-8B-Base-8K's public config.json (nemotron_h: hidden 4096; one block a layer from
    # hybrid_override_pattern: M Mamba-2 (128 heads of 64, 8 groups, state 128, a 4-tap conv with
    # bias, gated RMSNorm over 8 groups), * attention (32/8 heads of 128, no RoPE), - a squared-ReLU
    # MLP of width 21504; vocabulary 131072), 4 of its 52 layers ("M*M-" where the hub's is
    # "M-M-M-M*-M-..."), without its auto_map (NVIDIA's remote code: transformers has its own),
    # time_step_limit (JSON has no infinity; (0, inf) is the default) and time_step_rank. The hub
    # says attention_head_dim; transformers 5.17 reads head_dim only (and defaults it to 128), so
    # both are written.
    "nemotron-h-4l": {
        "architectures": ["NemotronHForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attention_head_dim": 128,
        "bos_token_id": 1,
        "chunk_size": 128,
        "conv_kernel": 4,
        "eos_token_id": 2,
        "expand": 2,
        "head_dim": 128,
        "hidden_dropout": 0.0,
        "hidden_size": 4096,
        "hybrid_override_pattern": "M*M-",
        "initializer_range": 0.02,
        "intermediate_size": 21504,
        "layer_norm_epsilon": 1e-05,
        "mamba_head_dim": 64,
        "mamba_hidden_act": "silu",
        "mamba_num_heads": 128,
        "mamba_proj_bias": False,
        "max_position_embeddings": 8192,
        "mlp_bias": False,
        "mlp_hidden_act": "relu2",
        "model_type": "nemotron_h",
        "n_groups": 8,
        "num_attention_heads": 32,
        "num_hidden_layers": 4,
        "num_key_value_heads": 8,
        "num_logits_to_keep": 1,
        "pad_token_id": 0,
        "rescale_prenorm_residual": True,
        "residual_in_fp32": False,
        "rms_norm_eps": 1e-05,
        "ssm_state_size": 128,
        "tie_word_embeddings": False,
        "time_step_floor": 0.0001,
        "time_step_max": 0.1,
        "time_step_min": 0.001,
        "torch_dtype": "bfloat16",
        "use_bias": False,
        "use_cache": True,
        "use_conv_bias": True,
        "use_mamba_kernels": True,
        "vocab_size": 131072,
    },
    # NVIDIA-Nemotron-3-Nano-30B-A3B-BF16's public config.json (nemotron_h with experts: hidden
    # 2688; M Mamba-2 (64 heads of 64, 8 groups, state 128), * attention (32/2 heads of 128, no
    # RoPE), E a mixture of 128 squared-ReLU experts of width 1856 without a gate product, top 6
    # by sigmoid scores plus e_score_correction_bias (one group), renormalised and scaled by 2.5,
    # and an ungated squared-ReLU shared expert of width 3712), 5 of its 52 layers ("MEM*E": each
    # layer kind, the experts twice; the hub's is "MEMEM*EMEMEM*..."), without its auto_map.
    "nemotron-3-nano-30b-a3b-4l": {
        "architectures": ["NemotronHForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 1,
        "chunk_size": 128,
        "conv_kernel": 4,
        "eos_token_id": 2,
        "expand": 2,
        "head_dim": 128,
        "hidden_dropout": 0.0,
        "hidden_size": 2688,
        "hybrid_override_pattern": "MEM*E",
        "initializer_range": 0.02,
        "intermediate_size": 1856,
        "layer_norm_epsilon": 1e-05,
        "mamba_head_dim": 64,
        "mamba_hidden_act": "silu",
        "mamba_num_heads": 64,
        "mamba_proj_bias": False,
        "mamba_ssm_cache_dtype": "float32",
        "max_position_embeddings": 262144,
        "mlp_bias": False,
        "mlp_hidden_act": "relu2",
        "model_type": "nemotron_h",
        "moe_intermediate_size": 1856,
        "moe_shared_expert_intermediate_size": 3712,
        "n_group": 1,
        "n_groups": 8,
        "n_routed_experts": 128,
        "n_shared_experts": 1,
        "norm_eps": 1e-05,
        "norm_topk_prob": True,
        "num_attention_heads": 32,
        "num_experts_per_tok": 6,
        "num_hidden_layers": 5,
        "num_key_value_heads": 2,
        "num_logits_to_keep": 1,
        "pad_token_id": 0,
        "partial_rotary_factor": 1.0,
        "rescale_prenorm_residual": True,
        "residual_in_fp32": False,
        "rope_theta": 10000,
        "routed_scaling_factor": 2.5,
        "sliding_window": None,
        "ssm_state_size": 128,
        "tie_word_embeddings": False,
        "time_step_floor": 0.0001,
        "time_step_max": 0.1,
        "time_step_min": 0.001,
        "topk_group": 1,
        "torch_dtype": "bfloat16",
        "use_bias": False,
        "use_cache": True,
        "use_conv_bias": True,
        "use_mamba_kernels": True,
        "vocab_size": 131072,
    },
}

# Qwen3-30B-A3B at its full depth (48 layers, 61 GB of bf16): the MoE speed target. Write it to
# /dev/shm on the GPU machine (128 GiB of memory, 64 GiB of disk).
MODELS["qwen3-30b-a3b"] = dict(MODELS["qwen3-30b-a3b-4l"], num_hidden_layers=48, max_window_layers=48)
# Qwen3.5-35B-A3B at its full depth (40 layers, about 70 GB of bf16): the hybrid speed target, too
# large for transformers' float32 on one H200; /dev/shm as for qwen3-30b-a3b.
MODELS["qwen3.5-35b-a3b"] = dict(MODELS["qwen3.5-35b-a3b-4l"], text_config=dict(
    MODELS["qwen3.5-35b-a3b-4l"]["text_config"], num_hidden_layers=40,
    layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 10))

# Nemotron-H-8B at its full depth (52 layers, about 16 GB of bf16): the hub's pattern, 24 Mamba-2,
# 4 attention and 24 squared-ReLU MLP layers; the 80%-of-roofline target.
MODELS["nemotron-h-8b"] = dict(MODELS["nemotron-h-4l"], num_hidden_layers=52,
    hybrid_override_pattern="M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-")
assert len(MODELS["nemotron-h-8b"]["hybrid_override_pattern"]) == 52
# NVIDIA-Nemotron-3-Nano-30B-A3B at its full depth (52 layers: 23 Mamba-2, 23 experts, 6 attention;
# 31.6B parameters, about 63 GB of bf16, too large for transformers' float32 on one H200): the
# speed target of the hybrid with experts; /dev/shm as for qwen3-30b-a3b.
MODELS["nemotron-3-nano-30b-a3b"] = dict(MODELS["nemotron-3-nano-30b-a3b-4l"], num_hidden_layers=52,
    hybrid_override_pattern="MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME")
assert len(MODELS["nemotron-3-nano-30b-a3b"]["hybrid_override_pattern"]) == 52

# Which real tokenizer belongs next to each checkpoint (copied in with --tokenizer FAMILY=DIR).
TOKENIZER_FAMILY = {
    "qwen3-0.6b": "qwen3",
    "qwen3-8b": "qwen3",
    "llama-3.1-8b": "llama3",
    "smollm2-widths": "qwen3",
    "qwen3-30b-a3b-4l": "qwen3",
    "qwen3-30b-a3b": "qwen3",
    # Qwen1.5's tokenizer is Qwen2's: the same 151,936-entry vocabulary as Qwen3's.
    "qwen1.5-moe-a2.7b-4l": "qwen3",
    # No MiniMax tokenizer on the GPU machine; Qwen3's 151,669 ids all fit under its 200,064 rows
    # (parity feeds random ids either way).
    "minimax-m2-4l": "qwen3",
    # Mixtral's (32,000 rows), OLMoE's (50,304) and GLM-4.5's (151,552) vocabularies are smaller
    # than the Qwen3 tokenizer's ids, and their own tokenizers are not on the GPU machine: none is
    # copied (parity and bench-model feed ids).
    "mixtral-8x7b-4l": None,
    "olmoe-1b-7b": None,
    "glm-4.5-air-4l": None,
    "granite-3.3-8b-4l": None,
    # Phi-4's (100,352 rows), Seed-OSS's (155,136) and SmolLM3's (Llama 3's, 128,256) vocabularies
    # are not Qwen3's: none is copied (parity feeds ids).
    "phi-4-4l": None,
    "seed-oss-36b-4l": None,
    "smollm3-3b": None,
    # Qwen3-Next's tokenizer is Qwen3's.
    "qwen3-next-80b-a3b-4l": "qwen3",
    # Qwen3.5's own tokenizer (248,320 rows) is not on the GPU machine, and Qwen3's does not hold
    # its eos ids (248044, 248046): met refuses that pairing, so none is copied (parity and
    # bench-model feed ids).
    "qwen3.5-35b-a3b-4l": None,
    "qwen3.5-35b-a3b": None,
    # Nemotron-H's 131,072 rows hold fewer ids than Qwen3's tokenizer has: none is copied.
    "nemotron-h-4l": None,
    "nemotron-h-8b": None,
    "nemotron-3-nano-30b-a3b-4l": None,
    "nemotron-3-nano-30b-a3b": None,
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")

# Initialisation. std 0.02 (the configs' initializer_range) keeps every projection's output at
# roughly unit scale after the pre-norms, so activations stay well-scaled through all layers.
# Norm weights get 1 + N(0, 0.1) rather than exactly 1: with all-ones weights an engine that
# ignores a norm weight, or applies the wrong head's q_norm/k_norm, would still match the reference.
LINEAR_STD = 0.02
NORM_NOISE_STD = 0.1
# MiniMax-M2's router correction bias, a buffer transformers initialises to zero: N(0, 0.01), about
# the gaps between neighbouring sigmoid scores of 256 experts at these weights, so that the biased
# top 8 differ from the unbiased ones and an engine that drops the bias fails parity.
CORRECTION_BIAS_STD = 0.01
# The hybrid models' own tensors, at values of the kind a trained model has rather than
# transformers' constants (names the other models do not have, so their checkpoints are unchanged):
#   Qwen3-Next / Qwen3.5 RMSNorms (input/post-attention, final, q_norm, k_norm) scale by
#   (1 + weight): N(0, NORM_NOISE_STD), the same 1 +- 0.1 scale as the other models' norms; their
#   Gated DeltaNet's gated norm scales by weight: 1 + N(0, 0.1), as do all of Nemotron-H's norms.
#   Gated DeltaNet: A_log = log A with A log-uniform in GDN_A_RANGE (heads from long memory to
#   none; transformers draws A uniform in [0.01, 16]), dt_bias 1 + N(0, 0.1) (transformers: 1).
#   Mamba-2: A_log = log U(1, 16) (Mamba-2's A_init_range), dt_bias = softplus^-1(dt) with dt
#   log-uniform in MAMBA_DT_RANGE: clear of time_step_min (0.001), the floor transformers
#   clamps dt to in its chunked prefill scan and not in its one-token decode step; D 1 + N(0, 0.1).
#   Both: the depthwise conv's taps N(0, CONV_STD) (at 0.02 the conv would shrink q/k/v 25-fold
#   and leave silu linear), its bias (Nemotron-H) zero like every bias.
GDN_A_RANGE = (0.01, 16.0)
MAMBA_A_RANGE = (1.0, 16.0)
MAMBA_DT_RANGE = (0.3, 1.0)
CONV_STD = 0.3
UNIT_OFFSET_NORMS = {"Qwen3NextRMSNorm", "Qwen3_5MoeRMSNorm", "Qwen3_5RMSNorm"}

PROBE_TOKENS = 64
# Logits of a working random model have a std of order 1 (about 0.02 * sqrt(hidden_size)).
# Far outside this band the checkpoint would be useless as a reference, so we refuse to write it.
LOGITS_STD_RANGE = (0.1, 50.0)


def utc_now():
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def rmtree(path: Path):
    # pathlib has no recursive delete; only used on our own *.partial directories.
    if not path.exists():
        return
    for child in path.iterdir():
        if child.is_dir() and not child.is_symlink():
            rmtree(child)
        else:
            child.unlink()
    path.rmdir()


def checkpoint_is_complete(path: Path) -> bool:
    """A directory counts as done when it has a config and every weight file it names."""
    if not (path / "config.json").is_file():
        return False
    if (path / "model.safetensors").is_file():
        return True
    index = path / "model.safetensors.index.json"
    if not index.is_file():
        return False
    try:
        shards = set(json.loads(index.read_text())["weight_map"].values())
    except (ValueError, KeyError):
        return False
    return bool(shards) and all((path / s).is_file() for s in shards)


def special_token_ids(cfg: dict):
    ids = []
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        v = cfg.get(key)
        if isinstance(v, int):
            ids.append(v)
        elif isinstance(v, list):
            ids.extend(int(x) for x in v)
    return ids


def random_prompt(n: int, vocab_size: int, specials, seed: int) -> torch.Tensor:
    """Deterministic ids that avoid special tokens. Qwen3 and Llama-3 keep all special (and unused
    padding) rows at the top of the vocabulary, so when the named specials sit in the upper half we
    draw below the lowest of them; otherwise we just exclude the named ids."""
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


def text_config(cfg: dict) -> dict:
    """The text model's keys of a hub config: Qwen3.5's nest it under text_config (the top level
    fills in the rest), the others are flat."""
    text = cfg.get("text_config")
    if text is None:
        return cfg
    return dict({k: v for k, v in cfg.items() if k not in ("text_config", "vision_config")}, **text)


def inverse_softplus(y: torch.Tensor) -> torch.Tensor:
    return y + torch.log(-torch.expm1(-y))


@torch.no_grad()
def reinit_weights(model, seed: int, device: str):
    """Overwrite every parameter from our own generator, so the weights depend only on the seed and
    this function (not on whatever init transformers' version happens to run in from_config)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    counts = {"matrix": 0, "norm": 0, "bias": 0}
    # The hybrid families' modules, by class: which norms scale by (1 + weight), and which
    # A_log / dt_bias belong to a Gated DeltaNet or to a Mamba-2 mixer.
    offset_norms, gdn, mamba = set(), set(), set()
    for mname, m in model.named_modules():
        cls = type(m).__name__
        if cls in UNIT_OFFSET_NORMS:
            offset_norms.add(f"{mname}.weight")
        elif cls.endswith("GatedDeltaNet"):
            gdn.add(mname)
        elif cls.endswith("Mamba2Mixer"):
            mamba.add(mname)

    def count(rule):
        counts[rule] = counts.get(rule, 0) + 1

    def uniform_(p, lo, hi):
        return p.uniform_(lo, hi, generator=gen)

    # named_parameters() lists a tied parameter once, so a tied lm_head is the embedding.
    for name, p in model.named_parameters():
        owner = name.rsplit(".", 1)[0]
        if name.endswith(".bias"):
            p.zero_()
            count("bias")
        elif name.endswith(".A_log") and owner in gdn:
            uniform_(p, math.log(GDN_A_RANGE[0]), math.log(GDN_A_RANGE[1]))
            count("gdn A_log")
        elif name.endswith(".dt_bias") and owner in gdn:
            p.normal_(1.0, NORM_NOISE_STD, generator=gen)
            count("gdn dt_bias")
        elif name.endswith(".A_log") and owner in mamba:
            # Drawn in f32 and rounded once into the parameter's dtype.
            a = torch.empty(p.shape, device=p.device).uniform_(*MAMBA_A_RANGE, generator=gen)
            p.copy_(a.log())
            count("mamba A_log")
        elif name.endswith(".dt_bias") and owner in mamba:
            lo, hi = math.log(MAMBA_DT_RANGE[0]), math.log(MAMBA_DT_RANGE[1])
            dt = torch.empty(p.shape, device=p.device).uniform_(lo, hi, generator=gen).exp()
            p.copy_(inverse_softplus(dt))
            count("mamba dt_bias")
        elif name.endswith(".conv1d.weight"):
            p.normal_(0.0, CONV_STD, generator=gen)
            count("conv")
        elif name in offset_norms:  # Qwen3-Next / Qwen3.5 RMSNorms: x * (1 + weight)
            p.normal_(0.0, NORM_NOISE_STD, generator=gen)
            count("norm (1 + w)")
        elif p.ndim == 1:  # RMSNorm weights (input/post-attention, q_norm/k_norm, final norm; gated
            # norms), Mamba-2's D
            p.normal_(1.0, NORM_NOISE_STD, generator=gen)
            counts["norm"] += 1
        else:  # embeddings, attention and MLP projections, lm_head
            p.normal_(0.0, LINEAR_STD, generator=gen)
            counts["matrix"] += 1
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.normal_(0.0, CORRECTION_BIAS_STD, generator=gen)
            counts["correction_bias"] = counts.get("correction_bias", 0) + 1
    return counts


def expected_rotary_dim(hub_cfg: dict):
    """Elements of each head RoPE rotates by the hub config: rotary_dim (MiniMax-M2), or head_dim
    times partial_rotary_factor (inside rope_parameters, or at the top level); None when the config
    says neither (all of each head, or no RoPE at all)."""
    cfg = text_config(hub_cfg)
    if cfg.get("rotary_dim") is not None:
        return cfg["rotary_dim"]
    factor = (cfg.get("rope_parameters") or {}).get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    if factor is None or cfg.get("model_type") == "nemotron_h":
        return None
    return int(cfg["head_dim"] * factor)


def check_rotary(name: str, hub_cfg: dict, model):
    """A partial-rotary config must reach transformers' rotary embedding: it must rotate
    rotary_dim elements of each head (inv_freq of rotary_dim / 2), or the reference is another
    model than the engine's."""
    rotary_dim = expected_rotary_dim(hub_cfg)
    if rotary_dim is None:
        return
    got = model.model.rotary_emb.inv_freq.numel()
    if got != rotary_dim // 2:
        raise SystemExit(f"[{name}] transformers rotates {2 * got} elements of each head, the config says "
                         f"{rotary_dim}: its rotary fraction was not read")


def mamba_dt_hooks(model, found: list):
    """Forward hooks that append the smallest dt = softplus(dt rows of in_proj + dt_bias) of each
    Mamba-2 mixer to `found`: transformers clamps dt to >= time_step_min in its chunked (prefill)
    scan and not in its one-token decode step, so a dt near the floor would make its own two paths
    differ (reported, not refused)."""
    hooks = []
    for _, m in model.named_modules():
        if type(m).__name__.endswith("Mamba2Mixer"):
            def hook(mod, args, out, mixer=m):
                dt = out[..., -mixer.num_heads:].float() + mixer.dt_bias.float()
                found.append(torch.nn.functional.softplus(dt).min().item())
            hooks.append(m.in_proj.register_forward_hook(hook))
    return hooks


@torch.inference_mode()
def probe(model, ids: torch.Tensor, device: str):
    """Logits and per-layer activation scale on a short random prompt."""
    dts = []
    hooks = mamba_dt_hooks(model, dts)
    out = model(input_ids=ids[None].to(device), output_hidden_states=True, use_cache=False)
    for h in hooks:
        h.remove()
    logits = out.logits[0].float()
    hs = out.hidden_states or ()
    picks = sorted({0, 1, len(hs) // 2, len(hs) - 2, len(hs) - 1}) if len(hs) > 2 else []
    hidden_rms = {str(i): round(hs[i][0].float().pow(2).mean().sqrt().item(), 4) for i in picks}
    stats = {
        "logits_std": round(logits.std().item(), 4),
        "logits_mean": round(logits.mean().item(), 4),
        "logits_absmax": round(logits.abs().max().item(), 4),
        "mean_top1_prob": round(torch.softmax(logits, -1).max(-1).values.mean().item(), 6),
        "distinct_argmax": int(logits.argmax(-1).unique().numel()),
        "finite": bool(torch.isfinite(logits).all().item()),
        # hidden_states[0] is the embedding output, then the layers' outputs (in current transformers
        # the last entry is taken after the final norm); RMS growing slowly through the layers, neither
        # exploding nor vanishing, is what we want.
        "hidden_rms": hidden_rms,
    }
    if dts:
        stats["mamba_dt_min"] = round(min(dts), 6)
    return logits, stats


FINGERPRINT_KEYS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "rms_norm_eps", "tie_word_embeddings", "max_position_embeddings",
    "attention_bias", "rope_parameters", "bos_token_id", "eos_token_id", "hidden_act",
    # The hybrid families' (None on both sides for the others).
    "layer_types", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
    "linear_value_head_dim", "linear_conv_kernel_dim", "num_experts", "num_experts_per_tok",
    "mamba_num_heads", "mamba_head_dim", "ssm_state_size", "n_groups", "conv_kernel",
    "layer_norm_epsilon", "mlp_hidden_act",
    # Nemotron-H's experts.
    "n_routed_experts", "moe_intermediate_size", "moe_shared_expert_intermediate_size",
    "routed_scaling_factor", "n_group", "topk_group", "norm_topk_prob",
)


def config_fingerprint(cfg):
    """The config fields that decide the forward pass, as transformers holds them in memory."""
    return json.dumps({k: getattr(cfg, k, None) for k in FINGERPRINT_KEYS}, sort_keys=True, default=str)


def copy_tokenizer(name: str, dest: Path, tokenizer_dirs: dict):
    src = tokenizer_dirs.get(TOKENIZER_FAMILY.get(name))
    if src is None:
        return []
    copied = []
    for fname in TOKENIZER_FILES:
        if (Path(src) / fname).is_file():
            (dest / fname).write_bytes((Path(src) / fname).read_bytes())
            copied.append(fname)
    if "tokenizer.json" not in copied:
        raise SystemExit(f"--tokenizer {TOKENIZER_FAMILY[name]}={src}: no tokenizer.json there")
    return copied


def with_overrides(hub_cfg: dict, overrides: dict) -> dict:
    """The hub config with `overrides` set in its text model's keys (a smoke test's shrunk widths)."""
    cfg = json.loads(json.dumps(hub_cfg))
    (cfg["text_config"] if "text_config" in cfg else cfg).update(overrides)
    return cfg


def empty_cache(device: str):
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def make_one(name: str, out_dir: Path, seed: int, max_shard_size: str, verify: bool, tokenizer_dirs: dict,
             device: str = "cuda", overrides: dict | None = None):
    final = out_dir / (f"{name}+smoke" if overrides or device == "cpu" else name)
    if checkpoint_is_complete(final):
        copied = copy_tokenizer(name, final, tokenizer_dirs)
        print(f"[{name}] complete checkpoint at {final}, skipped" + (f" (tokenizer: {copied})" if copied else ""), flush=True)
        return {"name": name, "path": str(final), "skipped": True}

    t0 = time.time()
    hub_cfg = with_overrides(MODELS[name], overrides or {})
    text_cfg = text_config(hub_cfg)
    # A deep copy: transformers adopts the rope_scaling dict as rope_parameters and adds keys to it,
    # which must not leak into the config.json we write out.
    kwargs = {k: v for k, v in json.loads(json.dumps(hub_cfg)).items() if k != "model_type"}
    # Legacy keys (rope_theta, rope_scaling, torch_dtype) are accepted and converted by
    # transformers 5, exactly as when it loads the same dict from a hub config.json.
    config = AutoConfig.for_model(hub_cfg["model_type"], **kwargs)

    # Built straight on the GPU in bf16: an 8B model in fp32 on the CPU would take minutes and 32 GB.
    # (Qwen3.5's multimodal config gives the text-only Qwen3_5MoeForCausalLM here, its config the
    # text config.)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    model.eval()
    torch.manual_seed(seed)
    counts = reinit_weights(model, seed, device)
    check_rotary(name, hub_cfg, model)
    n_params = sum(p.numel() for p in model.parameters())
    t_build = time.time() - t0

    probe_ids = random_prompt(PROBE_TOKENS, text_cfg["vocab_size"], special_token_ids(text_cfg), seed)
    logits, stats = probe(model, probe_ids, device)
    print(f"[{name}] {n_params / 1e9:.3f} B params ({counts}), built in {t_build:.1f} s; probe: {json.dumps(stats)}", flush=True)
    lo, hi = LOGITS_STD_RANGE
    # Granite divides its logits by logits_scaling (16 for Granite-3.3-8B): the band holds for them
    # before that division.
    std = stats["logits_std"] * text_cfg.get("logits_scaling", 1.0)
    if not stats["finite"] or not (lo <= std <= hi):
        raise SystemExit(f"[{name}] degenerate logits (std {stats['logits_std']}, finite {stats['finite']}); not saved")

    partial = out_dir / f"{name}.partial"
    rmtree(partial)
    partial.mkdir(parents=True)
    t1 = time.time()
    # transformers 5 always writes safetensors (the safe_serialization argument is gone) and
    # defaults to 50 GB shards; 5 GB gives an index plus several shards for the 8B models, the same
    # layout as the hub checkpoints, so the engine's sharded loader is exercised.
    model.save_pretrained(partial, max_shard_size=max_shard_size)
    # Keep what transformers 5 wrote (rope_parameters / dtype layout) for reference, and put the
    # hub-format config.json in its place.
    (partial / "config.json").rename(partial / "config.transformers.json")
    written_cfg = dict(hub_cfg, transformers_version=transformers.__version__)
    (partial / "config.json").write_text(json.dumps(written_cfg, indent=2, sort_keys=True) + "\n")
    t_save = time.time() - t1
    # What the reloaded model's config is compared with (for Qwen3.5 the text config the model was
    # built with, not the multimodal one).
    built_cfg = model.config
    del model
    empty_cache(device)

    check = None
    if verify:
        # Reload through the hub-format config.json: catches a config transformers reads differently
        # from the one the weights were made with (e.g. RoPE scaling lost) and tied-weight mistakes.
        t2 = time.time()
        placement = {} if device == "cpu" else {"device_map": device}
        reloaded = AutoModelForCausalLM.from_pretrained(
            partial, dtype=torch.bfloat16, attn_implementation="sdpa", **placement
        )
        reloaded.eval()
        check_rotary(name, hub_cfg, reloaded)
        logits2, _ = probe(reloaded, probe_ids, device)
        diff = (logits2 - logits).abs().max().item()
        rel = ((logits2 - logits).norm() / logits.norm()).item()
        cfg_before, cfg_after = config_fingerprint(built_cfg), config_fingerprint(reloaded.config)
        check = {"max_abs_diff": diff, "rel_l2": rel, "config_equal": cfg_before == cfg_after,
                 "seconds": round(time.time() - t2, 1)}
        print(f"[{name}] reload check: {json.dumps(check)}", flush=True)
        del reloaded
        empty_cache(device)
        # A 64-token probe barely sees RoPE scaling, so the config is compared field by field.
        if cfg_before != cfg_after:
            raise SystemExit(f"[{name}] config.json reads back differently:\n  made with {cfg_before}\n  "
                             f"reloaded  {cfg_after}\nleft at {partial}")
        # Same weights and kernels normally give identical logits; the margin only tolerates a
        # different (but equivalent) load path. A lost tied/untied lm_head gives rel ~ 1.
        if rel > 2e-2:
            raise SystemExit(f"[{name}] reloaded checkpoint gives different logits (rel {rel:.3e}); left at {partial}")

    tokenizer = copy_tokenizer(name, partial, tokenizer_dirs)
    record = {
        "name": name,
        "seed": seed,
        "init": {"linear_std": LINEAR_STD, "norm": f"1 + N(0, {NORM_NOISE_STD})", "bias": "zeros",
                 "correction_bias": f"N(0, {CORRECTION_BIAS_STD})",
                 "unit_offset_norms": f"N(0, {NORM_NOISE_STD}) (they scale by 1 + weight)",
                 "gdn": {"A_log": f"log of log-uniform{GDN_A_RANGE}", "dt_bias": f"1 + N(0, {NORM_NOISE_STD})"},
                 "mamba2": {"A_log": f"log U{MAMBA_A_RANGE}", "D": f"1 + N(0, {NORM_NOISE_STD})",
                            "dt_bias": f"softplus^-1(dt), dt log-uniform{MAMBA_DT_RANGE}"},
                 "conv1d_weight": f"N(0, {CONV_STD})",
                 "counts": counts,
                 "generator": f"torch.Generator('{device}').manual_seed(seed), parameters in named_parameters() order"},
        "overrides": overrides or None,
        "params": n_params,
        "probe": {"tokens": PROBE_TOKENS, "prompt_seed": seed, **stats},
        "reload_check": check,
        "tokenizer_files": tokenizer,
        "max_shard_size": max_shard_size,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0) if device.startswith("cuda") else "cpu",
        "date": utc_now(),
        "seconds": {"build": round(t_build, 1), "save": round(t_save, 1), "total": round(time.time() - t0, 1)},
    }
    (partial / "metrale_checkpoint.json").write_text(json.dumps(record, indent=2) + "\n")
    if final.exists():
        rmtree(final)  # an incomplete leftover under the final name
    partial.rename(final)
    print(f"[{name}] written to {final} in {record['seconds']['total']} s (save {t_save:.1f} s)", flush=True)
    return {"name": name, "path": str(final), "skipped": False, **record}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path, help="directory that receives one sub-directory per model")
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, from: {', '.join(MODELS)}")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-shard-size", default="5GB")
    ap.add_argument("--no-verify", action="store_true", help="skip the reload-and-compare check")
    ap.add_argument("--tokenizer", action="append", default=[], metavar="FAMILY=DIR",
                    help="copy tokenizer.json (+ tokenizer_config.json) from DIR into every checkpoint of "
                         "FAMILY (qwen3 or llama3); repeatable")
    ap.add_argument("--device", default="cuda",
                    help="cuda (the checkpoints), or cpu for a smoke test (written as <name>+smoke; "
                         "other weights than cuda's for the same seed)")
    ap.add_argument("--override", action="append", default=[], metavar="KEY=JSON",
                    help="set a key of the text model's config (a smoke test at shrunk widths; the "
                         "checkpoint is written as <name>+smoke); repeatable")
    args = ap.parse_args()
    overrides = {}
    for spec in args.override:
        key, _, value = spec.partition("=")
        try:
            overrides[key] = json.loads(value)
        except ValueError:
            raise SystemExit(f"--override {spec!r}: the value must be JSON")

    names = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in names if m not in MODELS]
    if unknown:
        raise SystemExit(f"unknown model(s) {unknown}; known: {list(MODELS)}")
    tokenizer_dirs = {}
    for spec in args.tokenizer:
        family, _, path = spec.partition("=")
        if family not in set(TOKENIZER_FAMILY.values()) - {None} or not path:
            raise SystemExit(f"--tokenizer {spec!r}: expected qwen3=DIR or llama3=DIR")
        tokenizer_dirs[family] = path
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: this script builds the models on the GPU (--device cpu: a smoke test)")

    args.out.mkdir(parents=True, exist_ok=True)
    where = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu"
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, {where}", flush=True)
    results = [make_one(n, args.out, args.seed, args.max_shard_size, not args.no_verify, tokenizer_dirs,
                        args.device, overrides) for n in names]
    print(json.dumps({"checkpoints": [{k: r[k] for k in ("name", "path", "skipped")} for r in results]}))


if __name__ == "__main__":
    main()
