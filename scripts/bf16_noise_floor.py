# SPDX-License-Identifier: MIT OR Apache-2.0
# The bf16 noise floor of the random checkpoints (no GPU; numpy). Position-0 forward of a random
# Qwen3-0.6B-shaped model (attention = v at position 0):
# f32 truth vs bf16 pipelines at HF rounding points, and two bf16 pipelines that differ only in
# matmul accumulation precision (f32 vs f64 before rounding).
import numpy as np, sys
# Qwen3-0.6B shape (vocabulary cut to 1/8: the metric is a ratio), make_checkpoints.py init.
H, I, L, V, HD, QH, KVH = 1024, 3072, 28, 151936 // 8, 128, 16, 8
if len(sys.argv) > 1 and sys.argv[1] == '8b':
    H, I, L, V, HD, QH, KVH = 4096, 12288, 36, 151936 // 16, 128, 32, 8
rng = np.random.default_rng(0)
def bf(x):
    x = np.asarray(x, np.float32)
    b = x.view(np.uint32).astype(np.uint64)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
    return b.astype(np.uint32).view(np.float32)
W = lambda o, i: bf(rng.normal(0, 0.02, (o, i)).astype(np.float32))
N = lambda d: bf(1 + rng.normal(0, 0.1, d).astype(np.float32))
emb = W(V, H)
layers = [dict(n1=N(H), v=W(KVH*HD, H), o=W(H, QH*HD), n2=N(H), g=W(I, H), u=W(I, H), d=W(H, I)) for _ in range(L)]
fn = N(H)
tok = 123
def mm(x, w, mode):
    if mode == 'f64': return (w.astype(np.float64) @ x.astype(np.float64)).astype(np.float32)
    return (w @ x).astype(np.float32)
def run(r, mode):
    h = emb[tok].copy()
    def norm(x, w):
        x32 = x.astype(np.float32)
        y = r(x32 / np.sqrt(np.mean(x32 * x32) + 1e-6))
        return r(w * y)
    for l in layers:
        x = norm(h, l['n1'])
        v = r(mm(x, l['v'], mode))
        # One key: attention returns v, each kv head shared by its query heads.
        a = np.repeat(v.reshape(KVH, HD), QH // KVH, axis=0).reshape(-1)
        h = r(h + r(mm(a, l['o'], mode)))
        x = norm(h, l['n2'])
        g = r(mm(x, l['g'], mode)); u = r(mm(x, l['u'], mode))
        s = r(g / (1 + np.exp(-g)))
        h = r(h + r(mm(r(s * u), l['d'], mode)))
    x = norm(h, fn)
    return r(mm(x, emb, mode))
ident = lambda x: np.asarray(x, np.float32)
truth = run(ident, 'f64')
b32 = run(bf, 'f32')
b64 = run(bf, 'f64')
rel = lambda a, b: np.linalg.norm(a - b) / np.linalg.norm(b)
print(f"{'8b' if H == 4096 else '0.6b'}: bf16 vs f32 truth {rel(b32, truth):.3e}; bf16(f32 acc) vs bf16(f64 acc) {rel(b32, b64):.3e}; logit std {truth.std():.2f}")
