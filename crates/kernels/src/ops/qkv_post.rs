// SPDX-License-Identifier: MIT OR Apache-2.0
//! The attention block's work between the fused QKV product and attention, as one kernel: per-head
//! RMSNorm of q and k (qk-norm, optional), NeoX RoPE of q and k, and the KV-cache write.
//!
//! It replaces rmsnorm(q), rmsnorm(k), rope(q), rope(k) and kv_cache_write, each of which rounded
//! to bf16: here q and k are rounded once, after the rotation. RoPE may be partial (the first
//! `rotary_dim` elements of each head rotated, the rest passed through: MiniMax-M2).
//!
//! [`QkNormWhole`] is the other QK-norm, MiniMax-M2's: q and k each normalised as one vector over
//! the whole projection, in place on the QKV product, before this kernel runs with its per-head
//! norms null.

use half::bf16;
use metrale_core::{DevicePtr, LaunchConfig};

use super::blocks_for;
use super::rmsnorm::norm_scales;
use super::rope::rotate_half;
use crate::host::{self, HostError, HostMemory, Kernel, KernelAbi, kernel_args};
use crate::names;

kernel_args!(
    /// For every token `t` of `qkv` (rows `q heads | k heads | v heads`): each q head, normalised
    /// by `q_norm` (when not null) and its first `rotary_dim` elements rotated by row
    /// `positions[t]` of the cos/sin tables (not rotated when the position is outside
    /// `[0, max_position)`), rounded once to bf16 into
    /// `q_out`; each k head the same with `k_norm` into row `slots[t]` of `k_cache`; each v head
    /// copied unchanged into row `slots[t]` of `v_cache`. A negative slot skips the cache writes.
    /// The norm is [`RmsNorm`](super::RmsNorm)'s formula over one head with the scale
    /// `weight_offset + w` summed in f32 (the plain weight at 0), the rotation
    /// [`RopeNeox`](super::RopeNeox)'s, both in f32.
    QkvRopeKvWrite => names::qkv_post::QKV_ROPE_KV_WRITE_BF16 {
        /// bf16 `[tokens, q_heads * head_dim]`.
        q_out: DevicePtr,
        /// bf16 `[num_slots, kv_heads * head_dim]`.
        k_cache: DevicePtr,
        /// bf16 `[num_slots, kv_heads * head_dim]`.
        v_cache: DevicePtr,
        /// bf16 `[tokens, (q_heads + 2 * kv_heads) * head_dim]`, the fused QKV product.
        qkv: DevicePtr,
        /// bf16 `[head_dim]`, or null for no q norm.
        q_norm: DevicePtr,
        /// bf16 `[head_dim]`, or null for no k norm.
        k_norm: DevicePtr,
        /// i32 `[tokens]`.
        positions: DevicePtr,
        /// i32 `[tokens]`: each token's cache row; negative skips the token's k and v.
        slots: DevicePtr,
        /// f32 `[max_position, rotary_dim / 2]` (RopeNeox's table at `rotary_dim`).
        cos: DevicePtr,
        /// f32 `[max_position, rotary_dim / 2]`.
        sin: DevicePtr,
        /// Tokens (`tokens * (q_heads + 2 * kv_heads)` below 2^32).
        tokens: u32,
        /// Query heads per token.
        q_heads: u32,
        /// Key (and value) heads per token.
        kv_heads: u32,
        /// Elements per head (even).
        head_dim: u32,
        /// The leading elements of each head that are rotated, pairs `(i, i + rotary_dim / 2)`
        /// (even, at most `head_dim`; `head_dim` for full RoPE).
        rotary_dim: u32,
        /// Rows of the cos/sin tables.
        max_position: u32,
        /// Added to the mean square in the norms.
        eps: f32,
        /// Added to each norm weight in f32 before it scales: 1 for QK-norms whose weights are
        /// stored centred on zero (Qwen3-Next's `1 + weight`), 0 for the plain weights (bit for
        /// bit).
        weight_offset: f32,
    }
);

/// Threads per block of the kernel.
const THREADS: u32 = 256;

/// Lanes that share one (token, head) item: `head_dim / 8` when that is a power of two up to 32
/// (each lane then owns 4 elements of each half of the head), else 32. Mirrors `lanes_per_head`
/// in qkv_post.cu.
fn lanes_per_head(head_dim: u32) -> u32 {
    let lanes = head_dim / 8;
    if head_dim.is_multiple_of(8) && lanes.is_power_of_two() && lanes <= 32 {
        lanes
    } else {
        32
    }
}

/// The reference norm of one head in f32: `x * (1 / sqrt(mean(x^2) + eps)) * w`, the same
/// expression as [`RmsNorm`](super::RmsNorm)'s reference (a test holds them together).
fn normalize_head(x: &mut [f32], weight: &[f32], eps: f32) {
    let mean_sq = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
    let inv = 1.0 / (mean_sq + eps).sqrt();
    for (v, w) in x.iter_mut().zip(weight) {
        *v = *v * inv * w;
    }
}

impl Kernel for QkvRopeKvWrite {
    /// One item per (token, head) over `q_heads + 2 * kv_heads` heads; `256 / lanes_per_head`
    /// items per block of 256 threads.
    fn launch_config(&self) -> LaunchConfig {
        let items = u64::from(self.tokens) * u64::from(self.q_heads + 2 * self.kv_heads);
        let per_block = THREADS / lanes_per_head(self.head_dim);
        LaunchConfig::linear(blocks_for(items, per_block).max(1), THREADS)
    }

    fn reference(&self, mem: &mut dyn HostMemory) -> Result<(), HostError> {
        let q_out = self.write_kv_and_transform_q(mem)?;
        host::store_bf16(mem, self.q_out, &q_out)
    }
}

impl QkvRopeKvWrite {
    /// The reference's work but for storing the queries: writes the caches and returns the
    /// transformed queries `[tokens, q_heads * head_dim]` in f32, before their one rounding to
    /// bf16. `q_out` is not used (the fused decode attention's reference calls this too).
    pub(crate) fn write_kv_and_transform_q(
        &self,
        mem: &mut dyn HostMemory,
    ) -> Result<Vec<f32>, HostError> {
        Ok(self.write_kv_and_transform(mem, CacheWrite::Bf16)?.0)
    }

    /// [`write_kv_and_transform_q`](Self::write_kv_and_transform_q), also returning each token's
    /// new keys `[kv_heads * head_dim]` in f32 before the rounding to bf16 that the cache stores
    /// (empty for a token with a negative slot, which writes nothing). The caches hold `cache`'s
    /// elements.
    pub(crate) fn write_kv_and_transform(
        &self,
        mem: &mut dyn HostMemory,
        cache: CacheWrite,
    ) -> Result<(Vec<f32>, Vec<Vec<f32>>), HostError> {
        let (tokens, qh, kvh, d) = (
            self.tokens as usize,
            self.q_heads as usize,
            self.kv_heads as usize,
            self.head_dim as usize,
        );
        let rot = self.rotary_dim as usize;
        if d == 0 || !d.is_multiple_of(2) || !rot.is_multiple_of(2) || rot > d {
            return Err(HostError::BadArgs {
                kernel: Self::NAME,
                message: format!(
                    "head_dim {d} and rotary_dim {rot}: both even, head_dim positive, \
                     rotary_dim at most head_dim (0: no rotation, Nemotron-H)"
                ),
            });
        }
        let half = rot / 2;
        let heads = qh + 2 * kvh;
        let kv_row = kvh * d;
        let qkv = host::load::<bf16>(mem, self.qkv, tokens * heads * d)?;
        let positions = host::load::<i32>(mem, self.positions, tokens)?;
        let slots = host::load::<i32>(mem, self.slots, tokens)?;
        let table = self.max_position as usize * half;
        let cos = host::load::<f32>(mem, self.cos, table)?;
        let sin = host::load::<f32>(mem, self.sin, table)?;
        let norm = |ptr: DevicePtr| -> Result<Option<Vec<f32>>, HostError> {
            Ok(if ptr.is_null() {
                None
            } else {
                Some(norm_scales(
                    &host::load_bf16(mem, ptr, d)?,
                    self.weight_offset,
                ))
            })
        };
        let (q_norm, k_norm) = (norm(self.q_norm)?, norm(self.k_norm)?);
        // Norm, then rotation, in f32; the caller rounds once.
        let transform = |head: &[bf16], weight: &Option<Vec<f32>>, pos: i32| -> Vec<f32> {
            let mut x: Vec<f32> = head.iter().map(|&v| f32::from(v)).collect();
            if let Some(w) = weight {
                normalize_head(&mut x, w, self.eps);
            }
            if rot > 0 && pos >= 0 && (pos as u32) < self.max_position {
                let at = pos as usize * half;
                rotate_half(&mut x[..rot], &cos[at..at + half], &sin[at..at + half]);
            }
            x
        };
        let mut q_out = Vec::with_capacity(tokens * qh * d);
        let mut keys = Vec::with_capacity(tokens);
        for t in 0..tokens {
            let row = &qkv[t * heads * d..(t + 1) * heads * d];
            for h in 0..qh {
                q_out.extend(transform(&row[h * d..(h + 1) * d], &q_norm, positions[t]));
            }
            if slots[t] < 0 {
                keys.push(Vec::new());
                continue;
            }
            let k: Vec<f32> = (qh..qh + kvh)
                .flat_map(|h| transform(&row[h * d..(h + 1) * d], &k_norm, positions[t]))
                .collect();
            let v = &row[(qh + kvh) * d..(qh + 2 * kvh) * d];
            match cache {
                CacheWrite::Bf16 => {
                    let at = slots[t] as usize * kv_row * 2;
                    host::store_bf16(mem, self.k_cache.offset(at), &k)?;
                    host::store(mem, self.v_cache.offset(at), v)?;
                }
                CacheWrite::Fp8 { k_scale, v_scale } => {
                    let at = slots[t] as usize * kv_row;
                    let k8: Vec<u8> = k
                        .iter()
                        .map(|&x| e4m3_of_bf16(bf16::from_f32(x), k_scale))
                        .collect();
                    let v8: Vec<u8> = v.iter().map(|&x| e4m3_of_bf16(x, v_scale)).collect();
                    host::store(mem, self.k_cache.offset(at), &k8)?;
                    host::store(mem, self.v_cache.offset(at), &v8)?;
                }
            }
            keys.push(k);
        }
        Ok((q_out, keys))
    }
}

/// What the paged cache's elements are, as the cache writes' references store them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum CacheWrite {
    /// The bf16 values.
    Bf16,
    /// [`e4m3_of_bf16`] with the keys' and the values' per-tensor scales.
    Fp8 {
        /// The keys' scale.
        k_scale: f32,
        /// The values' scale.
        v_scale: f32,
    },
}

/// An FP8 cache element: the bf16 value the bf16 cache would hold, divided by `scale` in f32,
/// rounded to the nearest e4m3 (ties to even) and saturated to ±448, as kv_fp8.cuh's
/// `cvt.rn.satfinite` does.
pub fn e4m3_of_bf16(x: bf16, scale: f32) -> u8 {
    metrale_core::fp8::f32_to_e4m3(f32::from(x) / scale)
}

kernel_args!(
    /// MiniMax-M2's QK-norm, in place on the fused QKV product: for every token, its q part (the
    /// first `q_width` elements of its row of `row`) RMS-normalised as one vector with `q_norm`,
    /// and its k part (the next `k_width`) with `k_norm`; the v part untouched. Per vector
    /// [`RmsNorm`](super::RmsNorm)'s formula in f32, rounded once to bf16.
    QkNormWhole => names::qkv_post::QK_NORM_WHOLE_BF16 {
        /// bf16 `[tokens, row]`, updated in place.
        qkv: DevicePtr,
        /// bf16 `[q_width]`.
        q_norm: DevicePtr,
        /// bf16 `[k_width]`.
        k_norm: DevicePtr,
        /// Tokens.
        tokens: u32,
        /// Elements of the q part (`heads * head_dim`).
        q_width: u32,
        /// Elements of the k part (`kv_heads * head_dim`).
        k_width: u32,
        /// Elements of a token's row (`q_width + 2 * k_width`).
        row: u32,
        /// Added to the mean square.
        eps: f32,
    }
);

impl Kernel for QkNormWhole {
    /// One block of 256 threads per (token, part): grid `(tokens, 2)`.
    fn launch_config(&self) -> LaunchConfig {
        LaunchConfig {
            grid: [self.tokens.max(1), 2, 1],
            ..LaunchConfig::linear(1, THREADS)
        }
    }

    fn reference(&self, mem: &mut dyn HostMemory) -> Result<(), HostError> {
        let (t, qw, kw, row) = (
            self.tokens as usize,
            self.q_width as usize,
            self.k_width as usize,
            self.row as usize,
        );
        if qw == 0 || kw == 0 || qw + kw > row {
            return Err(HostError::BadArgs {
                kernel: Self::NAME,
                message: format!(
                    "q_width {qw} and k_width {kw} must be positive and fit row {row}"
                ),
            });
        }
        let q_norm = host::load_bf16(mem, self.q_norm, qw)?;
        let k_norm = host::load_bf16(mem, self.k_norm, kw)?;
        for token in 0..t {
            let at = self.qkv.offset(token * row * 2);
            let mut x = host::load_bf16(mem, at, qw + kw)?;
            let (q, k) = x.split_at_mut(qw);
            normalize_head(q, &q_norm, self.eps);
            normalize_head(k, &k_norm, self.eps);
            host::store_bf16(mem, at, &x)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::testing::*;
    use crate::ops::{KvCacheWrite, RmsNorm, RopeNeox};

    struct Setup {
        op: QkvRopeKvWrite,
        slots_n: usize,
    }

    /// Three tokens (positions 5, 0 and 99, the last outside the 16-row tables), slots 2, -1, 0;
    /// 4 q heads, 2 kv heads, head_dim 8; caches of 4 rows filled with a marker.
    fn setup(m: &mut FlatMemory, norms: bool) -> Setup {
        let (tokens, qh, kvh, d, max_position) = (3usize, 4usize, 2usize, 8usize, 16u32);
        let heads = qh + 2 * kvh;
        let half = d / 2;
        let slots_n = 4;
        let mut cos = Vec::new();
        let mut sin = Vec::new();
        for pos in 0..max_position {
            for i in 0..half {
                let angle = pos as f32 * 10000f32.powf(-2.0 * i as f32 / d as f32);
                cos.push(angle.cos());
                sin.push(angle.sin());
            }
        }
        let op = QkvRopeKvWrite {
            q_out: m.put(&bf16s(&vec![0.0; tokens * qh * d])),
            k_cache: m.put(&bf16s(&vec![7.0; slots_n * kvh * d])),
            v_cache: m.put(&bf16s(&vec![7.0; slots_n * kvh * d])),
            qkv: m.put(&bf16s(&uniform(1, tokens * heads * d, 3.0))),
            q_norm: if norms {
                m.put(&bf16s(&uniform(2, d, 1.5)))
            } else {
                DevicePtr::NULL
            },
            k_norm: if norms {
                m.put(&bf16s(&uniform(3, d, 1.5)))
            } else {
                DevicePtr::NULL
            },
            positions: m.put(&[5i32, 0, 99]),
            slots: m.put(&[2i32, -1, 0]),
            cos: m.put(&cos),
            sin: m.put(&sin),
            tokens: tokens as u32,
            q_heads: qh as u32,
            kv_heads: kvh as u32,
            head_dim: d as u32,
            rotary_dim: d as u32,
            max_position,
            eps: 1e-6,
            weight_offset: 0.0,
        };
        Setup { op, slots_n }
    }

    #[test]
    fn without_qk_norm_it_is_rope_then_kv_write_bit_for_bit() {
        let mut m = FlatMemory::new();
        let Setup { op, slots_n } = setup(&mut m, false);
        let (t, qh, kvh, d) = (3usize, 4usize, 2usize, 8usize);
        let heads = qh + 2 * kvh;
        op.reference(&mut m).unwrap();

        // The unfused path on a copy of qkv: RoPE in place on the q and the k part of each row,
        // then the cache write of the (contiguous) k and v parts.
        let qkv: Vec<bf16> = m.get(op.qkv, t * heads * d);
        let x = m.put(&qkv);
        let rope = |x: DevicePtr, rotated: usize| RopeNeox {
            x,
            positions: op.positions,
            cos: op.cos,
            sin: op.sin,
            tokens: t as u32,
            heads: rotated as u32,
            head_dim: d as u32,
            token_stride: (heads * d) as u32,
            max_position: op.max_position,
        };
        rope(x, qh).reference(&mut m).unwrap();
        rope(x.offset(qh * d * 2), kvh).reference(&mut m).unwrap();
        let roped: Vec<bf16> = m.get(x, t * heads * d);
        let part = |from: usize, n: usize| -> Vec<bf16> {
            (0..t)
                .flat_map(|i| roped[i * heads * d + from..][..n].to_vec())
                .collect()
        };
        let (k, v) = (
            m.put(&part(qh * d, kvh * d)),
            m.put(&part((qh + kvh) * d, kvh * d)),
        );
        let k_cache = m.put(&bf16s(&vec![7.0; slots_n * kvh * d]));
        let v_cache = m.put(&bf16s(&vec![7.0; slots_n * kvh * d]));
        KvCacheWrite {
            k_cache,
            v_cache,
            k,
            v,
            slots: op.slots,
            tokens: t as u32,
            row: (kvh * d) as u32,
        }
        .reference(&mut m)
        .unwrap();

        let bits = |v: Vec<bf16>| v.into_iter().map(bf16::to_bits).collect::<Vec<_>>();
        assert_eq!(
            bits(m.get(op.q_out, t * qh * d)),
            bits(part(0, qh * d)),
            "q"
        );
        let cache = slots_n * kvh * d;
        assert_eq!(bits(m.get(op.k_cache, cache)), bits(m.get(k_cache, cache)));
        assert_eq!(bits(m.get(op.v_cache, cache)), bits(m.get(v_cache, cache)));
        // Slot 1 was nobody's (token 1's slot is -1): still the marker.
        assert!(
            f32s(&m.get(op.k_cache.offset(kvh * d * 2), kvh * d))
                .iter()
                .all(|&x| x == 7.0)
        );
    }

    #[test]
    fn with_qk_norm_it_is_the_f32_composition_rounded_once() {
        let mut m = FlatMemory::new();
        let Setup { op, slots_n } = setup(&mut m, true);
        let (t, qh, kvh, d) = (3usize, 4usize, 2usize, 8usize);
        let (heads, half) = (qh + 2 * kvh, d / 2);
        op.reference(&mut m).unwrap();

        let qkv = f32s(&m.get(op.qkv, t * heads * d));
        let (qw, kw) = (f32s(&m.get(op.q_norm, d)), f32s(&m.get(op.k_norm, d)));
        let cos: Vec<f32> = m.get(op.cos, 16 * half);
        let sin: Vec<f32> = m.get(op.sin, 16 * half);
        let positions = [5usize, 0, 99];
        // Written out: norm, rotation, one rounding.
        let expect = |tok: usize, h: usize, w: &[f32]| -> Vec<f32> {
            let x = &qkv[(tok * heads + h) * d..][..d];
            let ms = x.iter().map(|v| v * v).sum::<f32>() / d as f32;
            let inv = 1.0 / (ms + 1e-6f32).sqrt();
            let n: Vec<f32> = x.iter().zip(w).map(|(v, w)| v * inv * w).collect();
            let mut y = n.clone();
            if positions[tok] < 16 {
                let (c, s) = (
                    &cos[positions[tok] * half..][..half],
                    &sin[positions[tok] * half..][..half],
                );
                for i in 0..half {
                    y[i] = n[i] * c[i] - n[i + half] * s[i];
                    y[i + half] = n[i + half] * c[i] + n[i] * s[i];
                }
            }
            f32s(&bf16s(&y))
        };
        let q_out = f32s(&m.get(op.q_out, t * qh * d));
        for tok in 0..t {
            for h in 0..qh {
                assert_eq!(
                    q_out[(tok * qh + h) * d..][..d],
                    expect(tok, h, &qw)[..],
                    "q token {tok} head {h}"
                );
            }
        }
        let k_cache = f32s(&m.get(op.k_cache, slots_n * kvh * d));
        let v_cache = f32s(&m.get(op.v_cache, slots_n * kvh * d));
        for (tok, slot) in [(0usize, 2usize), (2, 0)] {
            for h in 0..kvh {
                assert_eq!(
                    k_cache[(slot * kvh + h) * d..][..d],
                    expect(tok, qh + h, &kw)[..],
                    "k token {tok} head {h}"
                );
                assert_eq!(
                    v_cache[(slot * kvh + h) * d..][..d],
                    qkv[(tok * heads + qh + kvh + h) * d..][..d],
                    "v token {tok} head {h}"
                );
            }
        }
        assert!(k_cache[kvh * d..2 * kvh * d].iter().all(|&x| x == 7.0));
    }

    /// With weight_offset 1 the head norm scales by `1 + w` in f32: the same outputs as offset 0
    /// over weights holding `1 + w` where that sum is a bf16 value, and the weights' sign and
    /// size (centred on zero) otherwise not folded into a bf16 scale first.
    #[test]
    fn the_weight_offset_adds_to_the_norm_weight_in_f32() {
        let (t, qh, kvh, d) = (3usize, 4usize, 2usize, 8usize);
        let run = |offset: f32, q: &[f32], k: &[f32]| -> (Vec<f32>, Vec<f32>) {
            let mut m = FlatMemory::new();
            let Setup { op, slots_n } = setup(&mut m, true);
            let op = QkvRopeKvWrite {
                q_norm: m.put(&bf16s(q)),
                k_norm: m.put(&bf16s(k)),
                weight_offset: offset,
                ..op
            };
            op.reference(&mut m).unwrap();
            (
                f32s(&m.get(op.q_out, t * qh * d)),
                f32s(&m.get(op.k_cache, slots_n * kvh * d)),
            )
        };
        // Multiples of 2^-4 in [-0.5, 0.5): 1 + w is a bf16 value, so both spell one scale.
        let exact = |seed| -> Vec<f32> {
            uniform(seed, d, 0.5)
                .iter()
                .map(|v| (v * 16.0).round() / 16.0)
                .collect()
        };
        let (q, k) = (exact(21), exact(22));
        let plus_one = |w: &[f32]| w.iter().map(|w| 1.0 + w).collect::<Vec<_>>();
        assert_eq!(run(1.0, &q, &k), run(0.0, &plus_one(&q), &plus_one(&k)));
        // Small weights: 1 + w rounded to bf16 first would lose them.
        let (q, k) = (
            f32s(&bf16s(&uniform(23, d, 0.01))),
            f32s(&bf16s(&uniform(24, d, 0.01))),
        );
        let rounded = |w: &[f32]| f32s(&bf16s(&plus_one(w)));
        assert_ne!(run(1.0, &q, &k), run(0.0, &rounded(&q), &rounded(&k)));
    }

    #[test]
    fn the_head_norm_is_rmsnorms_formula() {
        // RmsNorm's reference rounds once; so must round(normalize_head) on every head.
        let mut m = FlatMemory::new();
        let (rows, d) = (6usize, 64usize);
        let x = uniform(4, rows * d, 4.0);
        let w = uniform(5, d, 2.0);
        let out = m.put(&bf16s(&vec![0.0; rows * d]));
        let (xp, wp) = (m.put(&bf16s(&x)), m.put(&bf16s(&w)));
        RmsNorm {
            out,
            input: xp,
            weight: wp,
            rows: rows as u32,
            cols: d as u32,
            eps: 1e-5,
        }
        .reference(&mut m)
        .unwrap();
        let (x, w) = (f32s(&bf16s(&x)), f32s(&bf16s(&w)));
        let mut mine = x.clone();
        for head in mine.chunks_exact_mut(d) {
            normalize_head(head, &w, 1e-5);
        }
        assert_eq!(f32s(&m.get(out, rows * d)), f32s(&bf16s(&mine)));
    }

    #[test]
    fn launch_covers_every_head_of_every_token() {
        let mut m = FlatMemory::new();
        let op = setup(&mut m, true).op;
        for (tokens, qh, kvh, d, blocks) in [
            (1u32, 32u32, 8u32, 128u32, 3u32), // Qwen3-8B decode: 48 heads, 16 per block
            (1024, 16, 8, 128, 2048),          // Qwen3-0.6B prefill: 32 heads per token
            (7, 9, 3, 64, 4),                  // SmolLM2: 105 heads, 32 per block
            (2, 4, 2, 96, 2),                  // head_dim 96: 32 lanes, 8 per block
        ] {
            let k = QkvRopeKvWrite {
                tokens,
                q_heads: qh,
                kv_heads: kvh,
                head_dim: d,
                ..op
            };
            assert_eq!(k.launch_config().grid, [blocks, 1, 1], "{k:?}");
            assert_eq!(k.launch_config().block, [256, 1, 1]);
        }
        assert_eq!(
            QkvRopeKvWrite::from_args(&op.args()).unwrap(),
            op,
            "the ABI round-trips"
        );
    }

    /// Partial RoPE at rotary_dim = head_dim is the full rotation bit for bit; below it, the
    /// elements past rotary_dim are only normalised (here: copied, no norms), and the leading ones
    /// are a full rotation of a head of rotary_dim elements by the rotary_dim / 2 column table.
    #[test]
    fn partial_rope_rotates_the_leading_elements_and_passes_the_rest() {
        let (t, qh, kvh, d) = (3usize, 4usize, 2usize, 8usize);
        let heads = qh + 2 * kvh;
        let run = |norms: bool, rotary_dim: usize| -> (Vec<f32>, Vec<f32>, Vec<f32>) {
            let mut m = FlatMemory::new();
            let Setup { op, slots_n } = setup(&mut m, norms);
            // A table of rotary_dim / 2 columns, frequencies over rotary_dim.
            let half = rotary_dim / 2;
            let (mut cos, mut sin) = (Vec::new(), Vec::new());
            for pos in 0..op.max_position {
                for i in 0..half {
                    let angle = pos as f32 * 10000f32.powf(-2.0 * i as f32 / rotary_dim as f32);
                    cos.push(angle.cos());
                    sin.push(angle.sin());
                }
            }
            let op = QkvRopeKvWrite {
                rotary_dim: rotary_dim as u32,
                cos: m.put(&cos),
                sin: m.put(&sin),
                ..op
            };
            op.reference(&mut m).unwrap();
            let qkv = f32s(&m.get(op.qkv, t * heads * d));
            let q = f32s(&m.get(op.q_out, t * qh * d));
            let k = f32s(&m.get(op.k_cache, slots_n * kvh * d));
            (qkv, q, k)
        };
        for norms in [false, true] {
            // rotary_dim = head_dim: the full rotation the other tests pin.
            let mut m = FlatMemory::new();
            let Setup { op, slots_n } = setup(&mut m, norms);
            op.reference(&mut m).unwrap();
            let full_q = f32s(&m.get(op.q_out, t * qh * d));
            let full_k = f32s(&m.get(op.k_cache, slots_n * kvh * d));
            let (_, q, k) = run(norms, d);
            assert_eq!((q, k), (full_q, full_k), "norms={norms}");
        }
        // rotary_dim 4 of 8, no norms: elements 4..8 of every q and k head are the input's;
        // elements 0..4 rotated as pairs (0, 2), (1, 3) at position 5 (token 0), unrotated at 0.
        let (qkv, q, k) = run(false, 4);
        let positions = [5usize, 0, 99];
        for tok in 0..t {
            for h in 0..qh {
                let x = &qkv[(tok * heads + h) * d..][..d];
                let y = &q[(tok * qh + h) * d..][..d];
                assert_eq!(y[4..], x[4..], "q token {tok} head {h}: pass-through");
                let p = positions[tok];
                let mut want = x[..4].to_vec();
                if p < 16 {
                    for i in 0..2 {
                        let angle = p as f32 * 10000f32.powf(-2.0 * i as f32 / 4.0);
                        let (c, s) = (angle.cos(), angle.sin());
                        want[i] = x[i] * c - x[i + 2] * s;
                        want[i + 2] = x[i + 2] * c + x[i] * s;
                    }
                }
                assert_eq!(y[..4], f32s(&bf16s(&want))[..], "q token {tok} head {h}");
                if p == 5 {
                    assert_ne!(y[..4], x[..4], "position 5 rotates");
                }
            }
        }
        // Token 0 writes slot 2: its k heads' tails are the input's too.
        for h in 0..kvh {
            let x = &qkv[(qh + h) * d..][..d];
            assert_eq!(k[(2 * kvh + h) * d + 4..][..4], x[4..], "k head {h}");
        }
    }

    #[test]
    fn whole_projection_norm_normalises_q_and_k_as_vectors_and_leaves_v() {
        let mut m = FlatMemory::new();
        let (t, qw, kw) = (3usize, 24usize, 8usize);
        let row = qw + 2 * kw;
        let x = f32s(&bf16s(&uniform(7, t * row, 3.0)));
        let (qn, kn) = (
            f32s(&bf16s(&uniform(8, qw, 1.5))),
            f32s(&bf16s(&uniform(9, kw, 1.5))),
        );
        let op = QkNormWhole {
            qkv: m.put(&bf16s(&x)),
            q_norm: m.put(&bf16s(&qn)),
            k_norm: m.put(&bf16s(&kn)),
            tokens: t as u32,
            q_width: qw as u32,
            k_width: kw as u32,
            row: row as u32,
            eps: 1e-6,
        };
        op.reference(&mut m).unwrap();
        let got = f32s(&m.get(op.qkv, t * row));
        let norm = |v: &[f32], w: &[f32]| -> Vec<f32> {
            let ms = v.iter().map(|a| a * a).sum::<f32>() / v.len() as f32;
            let inv = 1.0 / (ms + 1e-6f32).sqrt();
            f32s(&bf16s(
                &v.iter()
                    .zip(w)
                    .map(|(a, w)| a * inv * w)
                    .collect::<Vec<_>>(),
            ))
        };
        for tok in 0..t {
            let r = &x[tok * row..][..row];
            let g = &got[tok * row..][..row];
            assert_eq!(g[..qw], norm(&r[..qw], &qn)[..], "q of token {tok}");
            assert_eq!(
                g[qw..qw + kw],
                norm(&r[qw..qw + kw], &kn)[..],
                "k of token {tok}"
            );
            assert_eq!(g[qw + kw..], r[qw + kw..], "v of token {tok}");
        }
        // Not the per-head norm: with 3 heads of 8 the q part's heads have their own scales.
        let per_head: Vec<f32> = r_heads(&x[..qw], &qn, 8);
        assert_ne!(got[..qw], per_head[..]);
        assert_eq!(op.launch_config().grid, [3, 2, 1]);
        assert_eq!(QkNormWhole::from_args(&op.args()).unwrap(), op);
    }

    fn r_heads(x: &[f32], w: &[f32], d: usize) -> Vec<f32> {
        let mut y = x.to_vec();
        for (head, w) in y.chunks_exact_mut(d).zip(w.chunks_exact(d)) {
            normalize_head(head, w, 1e-6);
        }
        f32s(&bf16s(&y))
    }
}
