#!/usr/bin/env python3
# SPDX-License-Identifier: MIT OR Apache-2.0
# CPU check of the decode attention's fragment plumbing (attention.cu on this branch): ldmatrix and
# mma.sync m16n8k16 emulated from the PTX ISA's fragment layouts, the kernel's lane roles and swizzle
# applied to one 16-key tile, S = Q K^T and O^T = V^T P^T compared with numpy. The emulator is
# validated on prefill v2's P V, which passes check-kernels on the H200. Needs numpy only.
import numpy as np
rng = np.random.default_rng(0)
HD, G, KT = 128, 4, 16
Q = rng.standard_normal((G, HD)); K = rng.standard_normal((KT, HD)); V = rng.standard_normal((KT, HD))
P = rng.random((G, KT))

def swz(row, chunk):  # element offset in a swizzled tile (HD-wide rows, 8-element chunks)
    return row * HD + ((chunk ^ (row & 7)) << 3)
def tile_smem(M):  # stored swizzled
    s = np.zeros(KT * HD)
    for r in range(KT):
        for c in range(HD // 8):
            s[swz(r, c):swz(r, c) + 8] = M[r, c * 8:(c + 1) * 8]
    return s
Ks, Vs = tile_smem(K), tile_smem(V)

def ldmatrix_x4(addr_of_lane, smem, trans=False):
    # addr_of_lane(l) -> element offset of the 8-element row lane l points at
    rows = [[smem[addr_of_lane(8 * i + j): addr_of_lane(8 * i + j) + 8] for j in range(8)] for i in range(4)]
    regs = np.zeros((32, 4, 2))
    for l in range(32):
        for i in range(4):
            m = np.array(rows[i])  # 8x8 stored
            if not trans:
                regs[l, i] = m[l >> 2, (l % 4) * 2:(l % 4) * 2 + 2]
            else:
                regs[l, i] = [m[(l % 4) * 2, l >> 2], m[(l % 4) * 2 + 1, l >> 2]]
    return regs

def mma(a, b, c):
    # a: [32][4][2], b: [32][2][2], c: [32][4] -> d
    A = np.zeros((16, 16)); B = np.zeros((16, 8))
    for l in range(32):
        g, t = l >> 2, l % 4
        for e in range(2):
            A[g, t * 2 + e] = a[l, 0, e]; A[g + 8, t * 2 + e] = a[l, 1, e]
            A[g, t * 2 + 8 + e] = a[l, 2, e]; A[g + 8, t * 2 + 8 + e] = a[l, 3, e]
            B[t * 2 + e, g] = b[l, 0, e]; B[t * 2 + 8 + e, g] = b[l, 1, e]
    D = A @ B
    d = c.copy()
    for l in range(32):
        g, t = l >> 2, l % 4
        d[l] += [D[g, 2 * t], D[g, 2 * t + 1], D[g + 8, 2 * t], D[g + 8, 2 * t + 1]]
    return d

# S = Q K^T, code: qf[ks] = {row g: u32 at ks*8+tg (dims ks*16+2tg..), 0, ks*8+4+tg, 0}
sc = [np.zeros((32, 4)), np.zeros((32, 4))]
for ks in range(HD // 16):
    qf = np.zeros((32, 4, 2))
    for l in range(32):
        g, tg = l >> 2, l & 3
        if g < G:
            qf[l, 0] = Q[g, ks * 16 + 2 * tg: ks * 16 + 2 * tg + 2]
            qf[l, 2] = Q[g, ks * 16 + 8 + 2 * tg: ks * 16 + 8 + 2 * tg + 2]
    addr = lambda l: swz((l & 7) + ((l >> 4) << 3), 2 * ks + ((l >> 3) & 1))
    b = ldmatrix_x4(addr, Ks)
    sc[0] = mma(qf, b[:, [0, 1]], sc[0]); sc[1] = mma(qf, b[:, [2, 3]], sc[1])
S = np.zeros((16, 16))
for l in range(32):
    g, tg = l >> 2, l & 3
    for nt in range(2):
        S[g, nt * 8 + 2 * tg] = sc[nt][l, 0]; S[g, nt * 8 + 2 * tg + 1] = sc[nt][l, 1]
print("S error", np.abs(S[:G] - Q @ K.T).max())

# O^T += V^T P^T with pb[nt] = P[g][nt*8 + 2tg .. +1] (from the S layout)
pb = np.zeros((32, 2, 2))
for l in range(32):
    g, tg = l >> 2, l & 3
    if g < G:
        for nt in range(2):
            pb[l, nt] = P[g, nt * 8 + 2 * tg: nt * 8 + 2 * tg + 2]
O = np.zeros((HD, 8))
for mt in range(HD // 16):
    addr = lambda l: swz((l & 7) + ((l >> 4) << 3), 2 * mt + ((l >> 3) & 1))
    a = ldmatrix_x4(addr, Vs, trans=True)
    o = mma(a, pb, np.zeros((32, 4)))
    for l in range(32):
        g, tg = l >> 2, l & 3
        for c in range(2):
            O[16 * mt + g, 2 * tg + c] = o[l, c]; O[16 * mt + g + 8, 2 * tg + c] = o[l, 2 + c]
print("O error", np.abs(O[:, :G].T - P @ V).max())
# Validate the emulator on version 2's known-good P V (A = P rows = 16 queries, B = V via the
# transposing ldmatrix with its lane roles).
Pq = rng.random((16, KT))
pa = np.zeros((32, 4, 2))
for l in range(32):
    g, t = l >> 2, l % 4
    pa[l, 0] = Pq[g, 2 * t:2 * t + 2]; pa[l, 1] = Pq[g + 8, 2 * t:2 * t + 2]
    pa[l, 2] = Pq[g, 8 + 2 * t:8 + 2 * t + 2]; pa[l, 3] = Pq[g + 8, 8 + 2 * t:8 + 2 * t + 2]
Oq = np.zeros((16, HD))
for dp in range(HD // 16):
    addr = lambda l: swz((l & 7) + (((l >> 3) & 1) << 3), 2 * dp + (l >> 4))
    b = ldmatrix_x4(addr, Vs, trans=True)
    for half, regs in ((0, [0, 1]), (1, [2, 3])):
        o = mma(pa, b[:, regs], np.zeros((32, 4)))
        for l in range(32):
            g, t = l >> 2, l % 4
            n0 = (2 * dp + half) * 8
            Oq[g, n0 + 2 * t:n0 + 2 * t + 2] = o[l, :2]; Oq[g + 8, n0 + 2 * t:n0 + 2 * t + 2] = o[l, 2:]
print("v2 P V (known good on the GPU) error", np.abs(Oq - Pq @ V).max())
