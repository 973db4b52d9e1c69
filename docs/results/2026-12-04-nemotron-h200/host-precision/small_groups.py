# The mechanism behind the engine's per-position spikes on the 2-layer cut (layer 0, Mamba-2): the
# gated RMSNorm's output error caused by rounding B and C alone (in_proj output and conv output),
# per position and group, against how small that group's y * silu(z) is. Run from the repository
# root with the cut-2 checkpoint at /work/hp/cut-2 (cuts.sh):
#   /work/pyenv/bin/python docs/results/2026-12-04-nemotron-h200/host-precision/small_groups.py
import sys, torch, torch.nn.functional as F
sys.path.insert(0, "scripts")
import nemotron_engine_emulation as E
from safetensors.torch import load_file
torch.set_grad_enabled(False)
m = E.Model(__import__("pathlib").Path("/work/hp/cut-2/nemotron-h-4l+smoke"))
ref = load_file("/work/hp/cut-2/ref.safetensors")
ids = torch.cat([ref["prompt_ids"].long(), ref["decode_ids"].long()])
h = m.t("embeddings.weight")[ids]
x = E.bf(E.rms(h, m.t("layers.0.norm.weight"), m.eps))
# capture the gated norm input pieces by re-running the mamba with hooks: copy of Model.mamba internals
def parts(R):
    r = lambda k, v: E.bf(v) if k in R else v
    T=x.shape[0]; H,P,G,N,inner = m.heads,m.head_dim,m.groups,m.state,m.inner; mm="layers.0.mixer."
    proj = x @ m.t(mm+"in_proj.weight").T; cc = inner+2*G*N
    z = proj[:, :inner]; xbc = torch.cat([r("in_x", proj[:, inner:2*inner]), r("in_bc", proj[:, 2*inner:inner+cc])],1); dt=proj[:, inner+cc:]
    cw = m.t(mm+"conv1d.weight").reshape(cc, m.kernel); cb = m.t(mm+"conv1d.bias")
    pad = torch.cat([xbc.new_zeros(m.kernel-1, cc), xbc],0)
    conv = F.silu(sum(pad[k:k+T]*cw[:,k] for k in range(m.kernel))+cb)
    conv = torch.cat([r("conv_x", conv[:, :inner]), r("conv_bc", conv[:, inner:])],1)
    xs,B,C = conv[:,:inner].reshape(T,H,P), conv[:,inner:inner+G*N].reshape(T,G,N).repeat_interleave(H//G,1), conv[:,inner+G*N:].reshape(T,G,N).repeat_interleave(H//G,1)
    dt = F.softplus(dt+m.t(mm+"dt_bias")); A=-torch.exp(m.t(mm+"A_log"))
    st = torch.zeros(H,P,N,dtype=torch.float64); ch=[]
    for t in range(T):
        st = st*torch.exp(dt[t]*A).double()[:,None,None] + (dt[t,:,None,None]*xs[t,:,:,None]*B[t,:,None,:]).double()
        ch.append((st*C[t,:,None,:].double()).sum(-1).float())
    ch = torch.stack(ch); skip = xs*m.t(mm+"D")[None,:,None]
    return ch.reshape(T,inner), skip.reshape(T,inner), z
ch0, sk0, z = parts(set())
ch1, sk1, _ = parts({"in_bc","conv_bc"})
g0 = (ch0+sk0)*F.silu(z); g1=(ch1+sk1)*F.silu(z)
G=m.groups; T=g0.shape[0]
def grp(v): return v.reshape(T,G,-1)
n0 = grp(g0)/grp(g0).pow(2).mean(-1,keepdim=True).add(m.eps).sqrt()
n1 = grp(g1)/grp(g1).pow(2).mean(-1,keepdim=True).add(m.eps).sqrt()
err = (n1-n0).reshape(T,-1).norm(dim=-1)/n0.reshape(T,-1).norm(dim=-1)
gerr = (n1-n0).norm(dim=-1)/n0.norm(dim=-1)   # [T, G]
chf = grp(ch0).norm(dim=-1)/grp(ch0+sk0).norm(dim=-1)
top = err.argsort(descending=True)[:8].tolist()
print("gated-norm output rel err from B|C rounding: mean %.2e" % err.mean())
for p in top:
    gmax = int(gerr[p].argmax())
    print(f"pos {p}: err {err[p]:.2e} ({err[p]/err.mean():.1f}x mean); worst group {gmax} err {gerr[p,gmax]:.2e}, its |C.H|/|y| {chf[p,gmax]:.2f}, "
          f"its |y| / median |y| {(grp(g0)[p,gmax].norm()/grp(g0).norm(dim=-1).median()):.2f}")
print("median over (pos, group) of |C.H|/|y|: %.2f"%chf.median())
import json
gn = grp(g0).norm(dim=-1); small = (gn / gn.median()).min(-1).values   # per position, the smallest group's |y*silu(z)| over the median
e = json.load(open("docs/results/2026-12-04-nemotron-h200/host-precision/cut2-host-before.json"))
r = torch.tensor([v["rel"] for v in e]); hb = torch.tensor([v["transformers_bf16_rel"] for v in e])
mask = small < 0.3
print("positions with a group below 0.3x median |y*silu(z)|:", mask.nonzero().flatten().tolist())
for name, v in [("engine", r), ("transformers-bf16", hb)]:
    print(f"{name}: mean err at those {v[mask].mean():.3e}, elsewhere {v[~mask].mean():.3e}, corr(err, -log small) {torch.corrcoef(torch.stack([v, -small.log()]))[0,1]:.2f}")
print("engine above bf16:", (r > hb).nonzero().flatten().tolist(), "smallest-group ratio there:", [round(float(small[p]),2) for p in (r > hb).nonzero().flatten().tolist()])
