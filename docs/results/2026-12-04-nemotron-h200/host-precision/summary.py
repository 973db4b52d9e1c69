# Pools the emulation's per-position errors over every (cut, prompt seed) run in this folder and
# prints, per rounding policy, the positions above transformers-bf16, the mean ratio, the spread of
# the per-position log ratio and the exceedance count a normal log ratio with that mean and spread
# predicts. Run from this folder: /work/pyenv/bin/python summary.py
import json, math, glob
import torch

runs = {"cut2-s0": "cut2-emu-all.json", "cut3-s0": "cut3-emu.json", "cut4-s0": "cut4-emu.json",
        "cut2-s1": "cut2-s1-emu.json", "cut2-s2": "cut2-s2-emu.json",
        "cut4-s1": "cut4-s1-emu.json", "cut4-s2": "cut4-s2-emu.json"}
policies = {
    "engine (today)": ["engine"],
    "B|C f32 (in_proj out + conv out)": ["engine - in_bc, conv_bc", "engine - conv_bc+in_bc"],
    "x|B|C f32 (in_proj out + conv out)": ["engine - in_x, in_bc, conv_x, conv_bc", "engine - conv_bc+conv_x+in_bc+in_x"],
    "all of in_proj out + conv out f32": ["engine - conv_bc+conv_x+in_bc+in_dt+in_x+in_z"],
}
print("| policy | runs | positions | above bf16 | max ratio | mean ratio | sd of log ratio | normal prediction |")
print("|---|---|---|---|---|---|---|---|")
for pol, keys in policies.items():
    ratios, per_run = [], []
    for run, f in runs.items():
        j = json.load(open(f))
        h = torch.tensor(j["transformers_bf16"])
        k = next((k for k in keys if k in j["variants"]), None)
        if k is None:
            continue
        r = torch.tensor(j["variants"][k]) / h
        ratios.append(r)
        per_run.append(f"{run}:{int((r > 1).sum())}")
    r = torch.cat(ratios)
    lr = r.log()
    p = 0.5 * (1 + math.erf(float(lr.mean() / lr.std()) / math.sqrt(2)))
    print(f"| {pol} | {' '.join(per_run)} | {r.numel()} | {int((r > 1).sum())} | {r.max():.3f} | "
          f"{r.mean():.3f} | {lr.std():.3f} | {p * r.numel():.1f} |")
