// SPDX-License-Identifier: MIT OR Apache-2.0
// Edge cases of prefill_attention_v3_bf16 against an f64 reference, through the CUDA runtime on a
// cubin (one built from kernels/hopper/common/prefill_attention_v3.cu with nvcc -cubin): a tile
// of 64 (warpgroup 1 all padding), n_keys a multiple of 128, the 3-stage ring wrapping, chunks
// after earlier key tiles, block sizes 1, 24 and 256, mixed sequences, peaky and rising scores,
// 4096 tokens, head_dim 64 (must write nothing), and six repeats of a 1500-token case (races).
// Spare output rows must keep their sentinel. Written during the 2026-12-01 review of version 3;
// NOT YET RUN on a GPU. Build here (the GPU machine has no nvcc), with L the nvcc wheel's lib
// directory (.venv/nvcc/lib/python3.11/site-packages/nvidia/cu13/lib), then carry the binary and
// the cubin (e.g. in .cache/v3dbg) and run it there:
//   nvcc -std=c++17 -cudart static -L$L -o .cache/v3dbg/edge scripts/dev/prefill_v3_edge_cases.cpp
//   .cache/v3dbg/edge .cache/v3dbg/t128_3.cubin     # prints ALL OK or the failing rows
#include <cuda_runtime.h>
#include <cstdio>
#include <cstdlib>
#include <cmath>
#include <vector>
#include <random>
#include <algorithm>
#include <cstring>
static cudaKernel_t g_kernel;
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("CUDA %s at %d: %s\n", #x, __LINE__, cudaGetErrorString(e)); exit(1);} } while (0)
static uint16_t f2bf(float f) { uint32_t u; memcpy(&u, &f, 4); u += 0x7fff + ((u >> 16) & 1); return u >> 16; }
static float bf2f(uint16_t b) { uint32_t u = (uint32_t)b << 16; float f; memcpy(&f, &u, 4); return f; }
struct Run { int first; int n; };
static int failures = 0;
static void run_case(const char* name, std::vector<Run> runs, int qh, int kvh, int bs, int tile_tokens, float qscale,
                     int row_stride, unsigned seed, int head_dim = 128, bool ramp = false) {
  const int d = 128;
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  int seqs = runs.size(), maxb = 0;
  for (auto& r : runs) maxb = std::max(maxb, (r.first + r.n + bs - 1) / bs);
  int nblocks = seqs * maxb + 3;
  std::vector<int> ids(nblocks); for (int i = 0; i < nblocks; ++i) ids[i] = i;
  std::shuffle(ids.begin(), ids.end(), rng);
  std::vector<int> table(ids.begin(), ids.begin() + seqs * maxb);
  std::vector<int> tok_seq, tok_pos;
  for (int s = 0; s < seqs; ++s) for (int p = runs[s].first; p < runs[s].first + runs[s].n; ++p) { tok_seq.push_back(s); tok_pos.push_back(p); }
  int T = tok_seq.size();
  std::vector<int> tiles;
  for (int t = 0; t < T; ++t) {
    int nt = tiles.size() / 4;
    if (nt > 0) { int* l = &tiles[4 * (nt - 1)]; if (l[0] == tok_seq[t] && l[2] + l[3] == tok_pos[t] && l[3] < tile_tokens) { l[3]++; continue; } }
    tiles.insert(tiles.end(), {tok_seq[t], t, tok_pos[t], 1});
  }
  int ntiles = tiles.size() / 4;
  size_t row = (size_t)kvh * d, cache = (size_t)nblocks * bs * row;
  std::vector<uint16_t> q((size_t)T * qh * d), kc(cache), vc(cache);
  for (auto& x : q) x = f2bf(qscale * nd(rng));
  for (size_t i = 0; i < cache; ++i) { kc[i] = f2bf(nd(rng)); vc[i] = f2bf(nd(rng)); }
  if (ramp) {  // scores grow with the key's position: the running max moves every key tile
    for (int s = 0; s < seqs; ++s) for (int p = 0; p < runs[s].first + runs[s].n; ++p) {
      size_t slot = (size_t)table[s * maxb + p / bs] * bs + p % bs;
      for (int k = 0; k < kvh; ++k) kc[(slot * kvh + k) * d] = f2bf(0.02f * p);
    }
    for (int t = 0; t < T; ++t) for (int h = 0; h < qh; ++h) q[((size_t)t * qh + h) * d] = f2bf(4.0f);
  }
  const uint16_t SENT = f2bf(7.0f);
  size_t out_elems = (size_t)(T + 64) * qh * d;
  std::vector<uint16_t> out(out_elems, SENT);
  uint16_t *dq, *dk, *dv, *dout; int *dt, *dtiles;
  CK(cudaMalloc(&dq, q.size() * 2)); CK(cudaMalloc(&dk, cache * 2)); CK(cudaMalloc(&dv, cache * 2));
  CK(cudaMalloc(&dout, out_elems * 2)); CK(cudaMalloc(&dt, table.size() * 4 + 4)); CK(cudaMalloc(&dtiles, tiles.size() * 4 + 16));
  CK(cudaMemcpy(dq, q.data(), q.size() * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dk, kc.data(), cache * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dv, vc.data(), cache * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dout, out.data(), out_elems * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dt, table.data(), table.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dtiles, tiles.data(), tiles.size() * 4, cudaMemcpyHostToDevice));
  const int smem = 128 * 128 * 2 + 3 * 2 * 128 * 128 * 2 + 1024;
  CK(cudaFuncSetAttribute((const void*)g_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  float scale = 1.0f / sqrtf((float)d);
  dim3 grid(qh, std::max(ntiles, 1));
  {
    void* a0 = dout; void* a1 = dq; void* a2 = dk; void* a3 = dv; void* a4 = dt; void* a5 = dtiles;
    uint32_t u0 = ntiles, u1 = qh, u2 = kvh, u3 = head_dim, u4 = bs, u5 = maxb; float f = scale;
    void* args[] = {&a0, &a1, &a2, &a3, &a4, &a5, &u0, &u1, &u2, &u3, &u4, &u5, &f};
    CK(cudaLaunchKernel((const void*)g_kernel, grid, dim3(256), args, smem, 0));
  }
  CK(cudaGetLastError()); CK(cudaDeviceSynchronize());
  CK(cudaMemcpy(out.data(), dout, out_elems * 2, cudaMemcpyDeviceToHost));
  int bad_sent = 0;
  for (size_t i = (size_t)T * qh * d; i < out_elems; ++i) bad_sent += out[i] != SENT;
  double worst = 0; int bad = 0, checked = 0, nan = 0;
  if (head_dim != 128) {
    for (size_t i = 0; i < out_elems; ++i) bad_sent += out[i] != SENT;
  } else {
    std::vector<double> sc, o(d);
    for (int t = 0; t < T; ++t) {
      // all rows of a tile's first/last 2 positions and every row_stride-th row
      int pos = tok_pos[t], s = tok_seq[t];
      bool edge = (t == 0 || t == T - 1 || tok_seq[t - 1] != s || tok_seq[t + 1] != s);
      if (!edge && (t % row_stride) != 0) continue;
      for (int h = 0; h < qh; ++h) {
        int kh = h / (qh / kvh);
        const uint16_t* qv = &q[((size_t)t * qh + h) * d];
        sc.assign(pos + 1, 0); double mx = -1e300;
        for (int k = 0; k <= pos; ++k) {
          size_t slot = (size_t)table[s * maxb + k / bs] * bs + k % bs;
          const uint16_t* kv = &kc[(slot * kvh + kh) * d]; double a = 0;
          for (int i = 0; i < d; ++i) a += (double)bf2f(qv[i]) * bf2f(kv[i]);
          sc[k] = a * scale; mx = std::max(mx, sc[k]);
        }
        double sum = 0; std::fill(o.begin(), o.end(), 0.0);
        for (int k = 0; k <= pos; ++k) {
          double p = exp(sc[k] - mx); sum += p;
          size_t slot = (size_t)table[s * maxb + k / bs] * bs + k % bs;
          const uint16_t* vv = &vc[(slot * kvh + kh) * d];
          for (int i = 0; i < d; ++i) o[i] += p * bf2f(vv[i]);
        }
        double num = 0, den = 0;
        for (int i = 0; i < d; ++i) {
          double r = o[i] / sum, g = bf2f(out[((size_t)t * qh + h) * d + i]);
          if (std::isnan(g)) nan++;
          num += (g - r) * (g - r); den += r * r;
        }
        double rel = sqrt(num / std::max(den, 1e-30));
        checked++; worst = std::max(worst, rel);
        if (!(rel < 2e-2)) { if (bad < 4) printf("   bad: token %d pos %d head %d rel %.3g\n", t, pos, h, rel); bad++; }
      }
    }
  }
  bool fail = bad || bad_sent || nan;
  failures += fail;
  printf("%s %-44s tiles=%d T=%d heads=%d/%d bs=%d checked=%d worst_rel=%.3g bad=%d nan=%d sentinel_bad=%d\n",
         fail ? "FAIL" : "ok  ", name, ntiles, T, qh, kvh, bs, checked, worst, bad, nan, bad_sent);
  cudaFree(dq); cudaFree(dk); cudaFree(dv); cudaFree(dout); cudaFree(dt); cudaFree(dtiles);
}
int main(int argc, char** argv) {
  cudaLibrary_t lib;
  CK(cudaLibraryLoadFromFile(&lib, argc > 1 ? argv[1] : "v3.cubin", nullptr, nullptr, 0, nullptr, nullptr, 0));
  CK(cudaLibraryGetKernel(&g_kernel, lib, "prefill_attention_v3_bf16"));
  run_case("one tile of 64 (wg1 padding)", {{0, 64}}, 8, 8, 16, 128, 1, 1, 1);
  run_case("n_keys = 384 exactly (chunks at 128,256)", {{128, 256}}, 8, 2, 16, 128, 1, 1, 2);
  run_case("ring wrap: 0..1200, bs 24 (non-pow2)", {{0, 1200}}, 4, 2, 24, 128, 1, 3, 3);
  run_case("chunk 300..500, GQA 4, bs 24", {{300, 200}}, 8, 2, 24, 128, 1, 1, 4);
  run_case("small tile at pos 1000 (kt=8)", {{1000, 5}}, 8, 1, 16, 128, 1, 1, 5);
  run_case("mixed seqs + decode-like tiles", {{0, 70}, {37, 30}, {300, 1}, {511, 2}, {640, 129}}, 8, 2, 16, 128, 1, 1, 6);
  run_case("64-token cuts of 0..700", {{0, 700}}, 4, 4, 16, 64, 1, 2, 7);
  run_case("block 256 > key tile, chunk 200..650", {{200, 450}}, 4, 1, 256, 128, 1, 2, 8);
  run_case("block 1", {{0, 300}}, 2, 1, 1, 128, 1, 1, 9);
  run_case("peaky (q x4)", {{0, 800}}, 4, 2, 16, 128, 4, 2, 10);
  run_case("ramp: max moves every tile", {{0, 900}}, 4, 2, 16, 128, 1, 2, 11, 128, true);
  run_case("long 0..4096 (32 key tiles), sampled rows", {{0, 4096}}, 4, 1, 16, 128, 1, 17, 12);
  run_case("head_dim 64 writes nothing", {{0, 200}}, 4, 2, 16, 128, 1, 1, 13, 64);
  // repeat a wrap case several times (races)
  for (unsigned s = 0; s < 6; ++s) run_case("repeat ring wrap 0..1500 heads 32/8", {{0, 1500}}, 32, 8, 16, 128, 1, 11, 100 + s);
  printf(failures ? "FAILURES %d\n" : "ALL OK\n", failures);
  return failures != 0;
}
