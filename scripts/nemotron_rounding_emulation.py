# SPDX-License-Identifier: MIT OR Apache-2.0
# Nemotron-H (Mamba-2 + attention + squared-ReLU MLP, 4 layers "M*M-", make_checkpoints.py's init,
# random bf16 weights) on CPU: transformers in float32 against (a) transformers in bf16 and (b)
# float32 with the engine's rounding points emulated by hooks (every product's input and output
# rounded to bf16; then the attention probabilities rounded and renormalised; alone, the in_proj
# outputs or every product's output). Per position: the relative L2 error of the logits against
# float32, how many positions are above transformers-bf16's, and the cosine between each error
# vector and transformers-bf16's (are the two errors correlated?). Usage:
#   /work/pyenv/bin/python scripts/nemotron_rounding_emulation.py [hidden, default 1024]
# (about a minute at 4096 on two cores; transformers' torch fallbacks, no mamba_ssm needed).
import sys, torch, json, math
from transformers import NemotronHConfig, NemotronHForCausalLM
torch.manual_seed(0)
hidden = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
cfg = NemotronHConfig(hidden_size=hidden, intermediate_size=4*hidden, num_hidden_layers=4,
    hybrid_override_pattern="M*M-", mamba_num_heads=hidden//32, mamba_head_dim=64, n_groups=8,
    ssm_state_size=128, num_attention_heads=hidden//128, num_key_value_heads=max(1,hidden//512), head_dim=128,
    attention_head_dim=128, vocab_size=8192, conv_kernel=4, chunk_size=128, use_mamba_kernels=False,
    residual_in_fp32=False, rescale_prenorm_residual=False)
cfg._attn_implementation = "eager"
m = NemotronHForCausalLM(cfg).eval()
with torch.no_grad():
    for n, p in m.named_parameters():
        if n.endswith("norm.weight") or ".norm.weight" in n:
            p.copy_(1 + 0.1 * torch.randn_like(p))
        elif p.dim() == 2:
            p.normal_(0, 0.02)
    for p in m.parameters():
        p.copy_(p.bfloat16().float())   # the bf16 weights both sides hold
ids = torch.randint(0, cfg.vocab_size, (1, 128))
def run(model, hooks=()):
    if isinstance(hooks, str):
        hs = [mod.register_forward_hook(rnd) for mod in lin] + [mod.register_forward_pre_hook(rnd_in) for mod in lin]
        orig = torch.nn.functional.softmax
        if "p" in hooks.split("+"):
            def soft(x, dim=-1, dtype=None, **kw):
                p = orig(x, dim=dim, dtype=dtype)
                pr = p.bfloat16().float()
                return pr / pr.sum(dim=dim, keepdim=True)
            torch.nn.functional.softmax = soft
        with torch.no_grad():
            out = model(ids).logits.float()[0]
        torch.nn.functional.softmax = orig
        for h in hs: h.remove()
        return out
    hs = [mod.register_forward_hook(f) for mod, f in hooks]
    with torch.no_grad():
        out = model(ids).logits.float()[0]
    for h in hs: h.remove()
    return out
ref = run(m)
def rnd(mod, inp, out): return out.bfloat16().float()
lin = [mod for mod in m.modules() if isinstance(mod, torch.nn.Linear) and mod is not m.lm_head]
inproj = [mod for n, mod in m.named_modules() if n.endswith("mixer.in_proj")]
def rnd_in(mod, args): return tuple(a.bfloat16().float() for a in args)
def both(mods): return [(x, rnd) for x in mods]
variants = {
  "every product's input and output rounded (the engine's bf16 GEMMs)": "both",
  "those + the attention probabilities (bf16, renormalised)": "both+p",
  "in_proj outputs rounded": [(x, rnd) for x in inproj],
  "every product's output rounded (the engine's GEMM outputs)": [(x, rnd) for x in lin],
}
import copy
mb = copy.deepcopy(m).bfloat16()
bf = run(mb)
def rel(a): return ((a - ref).norm(dim=-1) / ref.norm(dim=-1))
def cos(a, b):
    da, db = (a - ref), (b - ref)
    return (da * db).sum(-1) / (da.norm(dim=-1) * db.norm(dim=-1))
print(f"hidden {hidden}: transformers-bf16 mean rel err {rel(bf).mean():.3e}")
for name, hooks in variants.items():
    v = run(m, hooks)
    r = rel(v); c = cos(v, bf)
    above = (r > rel(bf)).sum().item()
    print(f"  {name}: mean {r.mean():.3e} ({(r.mean()/rel(bf).mean()):.2f}x bf16), positions above bf16 {above}/128, "
          f"max ratio {(r/rel(bf)).max():.2f}, cosine of its error with bf16's: mean {c.mean():.2f}")
