// SPDX-License-Identifier: MIT OR Apache-2.0
//! Paged KV cache writes and causal grouped-query attention over the cache.

use half::bf16;
use metrale_core::{DevicePtr, LaunchConfig};

use crate::host::{self, HostError, HostMemory, Kernel, KernelAbi, kernel_args, widen};
use crate::names;

kernel_args!(
    /// Causal GQA: token `t` (sequence `token_seq[t]`, position `positions[t]`) attends to keys
    /// `0..=positions[t]` of its sequence in the paged cache. With `splits > 1` split `z` covers
    /// keys `[z * keys_per_split, (z + 1) * keys_per_split)` and writes its unnormalised partial
    /// `(acc[head_dim], m, l)` to `partials` for [`AttentionCombine`]; with one split the output
    /// is written directly.
    PagedAttention => names::attention::PAGED_ATTENTION_BF16 {
        /// bf16 `[tokens, q_heads * head_dim]` (written when `splits == 1`).
        out: DevicePtr,
        /// f32 `[tokens, q_heads, splits, head_dim + 2]` (written when `splits > 1`).
        partials: DevicePtr,
        /// bf16 `[tokens, q_heads * head_dim]`.
        q: DevicePtr,
        /// bf16 `[num_blocks, block_size, kv_heads, head_dim]`.
        k_cache: DevicePtr,
        /// bf16, same layout as `k_cache`.
        v_cache: DevicePtr,
        /// i32 `[num_seqs, max_blocks_per_seq]`.
        block_tables: DevicePtr,
        /// i32 `[tokens]`: the sequence of each token.
        token_seq: DevicePtr,
        /// i32 `[tokens]`: the position of each token.
        positions: DevicePtr,
        /// Query tokens.
        tokens: u32,
        /// Query heads.
        q_heads: u32,
        /// Key/value heads (divides `q_heads`).
        kv_heads: u32,
        /// Elements per head: 64, 128 or 256.
        head_dim: u32,
        /// Tokens per cache block.
        block_size: u32,
        /// Columns of `block_tables`.
        max_blocks_per_seq: u32,
        /// Keys per split (covering the longest context in `splits` splits).
        keys_per_split: u32,
        /// Context splits (the launch's grid z).
        splits: u32,
        /// Score scale (`1 / sqrt(head_dim)`).
        scale: f32,
    }
);

kernel_args!(
    /// Merges [`PagedAttention`]'s split partials into the bf16 output.
    AttentionCombine => names::attention::ATTENTION_COMBINE_BF16 {
        /// bf16 `[tokens, q_heads * head_dim]`.
        out: DevicePtr,
        /// f32 `[tokens, q_heads, splits, head_dim + 2]`.
        partials: DevicePtr,
        /// Query tokens.
        tokens: u32,
        /// Query heads.
        q_heads: u32,
        /// Elements per head.
        head_dim: u32,
        /// Splits per (token, head).
        splits: u32,
    }
);

/// Keys per split and splits for a launch of `tokens` query tokens over `q_heads` heads whose
/// longest context is `max_context` keys, given room for `max_partials` partials: split until
/// the launch has about `target_blocks` blocks, never below 64 keys per split.
pub fn attention_splits(
    tokens: u32,
    q_heads: u32,
    max_context: u32,
    max_partials: u32,
    target_blocks: u32,
) -> (u32, u32) {
    let rows = (tokens * q_heads).max(1);
    let want = target_blocks.div_ceil(rows);
    let by_len = max_context / 64;
    let room = max_partials / rows;
    let splits = want.min(by_len).min(room).max(1);
    (max_context.div_ceil(splits).max(1), splits)
}

kernel_args!(
    /// Copies each token's k and v rows into cache slot `slots[t]`; a negative slot skips it.
    KvCacheWrite => names::kv_cache::KV_CACHE_WRITE_BF16 {
        /// bf16 `[num_slots, row]`.
        k_cache: DevicePtr,
        /// bf16 `[num_slots, row]`.
        v_cache: DevicePtr,
        /// bf16 `[tokens, row]`.
        k: DevicePtr,
        /// bf16 `[tokens, row]`.
        v: DevicePtr,
        /// i32 `[tokens]`.
        slots: DevicePtr,
        /// Tokens.
        tokens: u32,
        /// `kv_heads * head_dim`.
        row: u32,
    }
);

impl Kernel for AttentionCombine {
    fn launch_config(&self) -> LaunchConfig {
        LaunchConfig {
            grid: [self.tokens, self.q_heads, 1],
            block: [128, 1, 1],
            shared_mem_bytes: 0,
        }
    }
    fn reference(&self, mem: &mut dyn HostMemory) -> Result<(), HostError> {
        let (rows, d, z) = (
            (self.tokens * self.q_heads) as usize,
            self.head_dim as usize,
            self.splits as usize,
        );
        let parts = host::load::<f32>(mem, self.partials, rows * z * (d + 2))?;
        let mut out = vec![0f32; rows * d];
        for (r, o) in out.chunks_exact_mut(d.max(1)).enumerate() {
            let part = |s: usize| &parts[(r * z + s) * (d + 2)..][..d + 2];
            let live: Vec<usize> = (0..z).filter(|&s| part(s)[d + 1] > 0.0).collect();
            let big = live
                .iter()
                .map(|&s| part(s)[d])
                .fold(f32::NEG_INFINITY, f32::max);
            let total: f32 = live
                .iter()
                .map(|&s| part(s)[d + 1] * (part(s)[d] - big).exp())
                .sum();
            for (i, x) in o.iter_mut().enumerate() {
                let a: f32 = live
                    .iter()
                    .map(|&s| part(s)[i] * (part(s)[d] - big).exp())
                    .sum();
                *x = if total > 0.0 { a / total } else { 0.0 };
            }
        }
        host::store_bf16(mem, self.out, &out)
    }
}

impl Kernel for PagedAttention {
    fn launch_config(&self) -> LaunchConfig {
        LaunchConfig {
            grid: [self.tokens, self.q_heads, self.splits],
            block: [128, 1, 1],
            shared_mem_bytes: 0,
        }
    }
    fn reference(&self, mem: &mut dyn HostMemory) -> Result<(), HostError> {
        let (t_n, qh, kvh, d) = (
            self.tokens as usize,
            self.q_heads as usize,
            self.kv_heads as usize,
            self.head_dim as usize,
        );
        let (bs, maxb) = (self.block_size as usize, self.max_blocks_per_seq as usize);
        let bad = |message: String| HostError::BadArgs {
            kernel: Self::NAME,
            message,
        };
        if kvh == 0 || qh % kvh != 0 {
            return Err(bad(format!(
                "q_heads {qh} is not a multiple of kv_heads {kvh}"
            )));
        }
        let q = host::load_bf16(mem, self.q, t_n * qh * d)?;
        let token_seq = host::load::<i32>(mem, self.token_seq, t_n)?;
        let positions = host::load::<i32>(mem, self.positions, t_n)?;
        let seqs = token_seq
            .iter()
            .map(|&s| s.max(0) as usize + 1)
            .max()
            .unwrap_or(0);
        let tables = host::load::<i32>(mem, self.block_tables, seqs * maxb)?;
        // The cache extent this launch may touch: the largest block any table names.
        let blocks = tables
            .iter()
            .map(|&b| b.max(0) as usize + 1)
            .max()
            .unwrap_or(0);
        let row = kvh * d;
        let k_cache = host::view::<bf16>(mem, self.k_cache, blocks * bs * row)?;
        let v_cache = host::view::<bf16>(mem, self.v_cache, blocks * bs * row)?;
        if !matches!(d, 64 | 128 | 256) {
            return Err(bad(format!("head_dim {d} is not 64, 128 or 256")));
        }
        let (z, per) = (self.splits.max(1) as usize, self.keys_per_split as usize);
        let mut out = vec![0f32; t_n * qh * d];
        let mut parts = vec![0f32; if z > 1 { t_n * qh * z * (d + 2) } else { 0 }];
        let mut scores = Vec::new();
        for t in 0..t_n {
            let (seq, pos) = (token_seq[t] as usize, positions[t]);
            if pos < 0 || (pos as usize) >= maxb * bs {
                return Err(bad(format!(
                    "token {t} has position {pos}, outside its block table of {maxb} blocks"
                )));
            }
            let ctx = pos as usize + 1;
            if z > 1 && ctx > z * per {
                return Err(bad(format!(
                    "token {t}: context {ctx} exceeds {z} splits of {per} keys"
                )));
            }
            let table = &tables[seq * maxb..(seq + 1) * maxb];
            for h in 0..qh {
                let kv = h / (qh / kvh);
                let qv = &q[(t * qh + h) * d..][..d];
                let slot = |j: usize| (table[j / bs] as usize * bs + j % bs) * row + kv * d;
                for split in 0..z {
                    let keys = if z == 1 {
                        0..ctx
                    } else {
                        (split * per).min(ctx)..((split + 1) * per).min(ctx)
                    };
                    scores.clear();
                    for j in keys.clone() {
                        let k = &k_cache[slot(j)..][..d];
                        scores.push(
                            qv.iter().zip(k).map(|(a, b)| a * widen(*b)).sum::<f32>() * self.scale,
                        );
                    }
                    let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    let mut total = 0f32;
                    for s in scores.iter_mut() {
                        *s = (*s - max).exp();
                        total += *s;
                    }
                    let mut acc = vec![0f32; d];
                    for (j, p) in keys.zip(&scores) {
                        let v = &v_cache[slot(j)..][..d];
                        for (a, x) in acc.iter_mut().zip(v) {
                            *a += p * widen(*x);
                        }
                    }
                    if z == 1 {
                        let o = &mut out[(t * qh + h) * d..][..d];
                        for (o, a) in o.iter_mut().zip(&acc) {
                            *o = a / total;
                        }
                    } else {
                        let part = &mut parts[((t * qh + h) * z + split) * (d + 2)..][..d + 2];
                        if total > 0.0 {
                            part[..d].copy_from_slice(&acc);
                            part[d] = max;
                            part[d + 1] = total;
                        }
                    }
                }
            }
        }
        drop((k_cache, v_cache));
        if z > 1 {
            return host::store(mem, self.partials, &parts);
        }
        host::store_bf16(mem, self.out, &out)
    }
}

impl Kernel for KvCacheWrite {
    fn launch_config(&self) -> LaunchConfig {
        LaunchConfig::linear(self.tokens, 128)
    }
    fn reference(&self, mem: &mut dyn HostMemory) -> Result<(), HostError> {
        let (t_n, row) = (self.tokens as usize, self.row as usize);
        let slots = host::load::<i32>(mem, self.slots, t_n)?;
        let k = host::load::<bf16>(mem, self.k, t_n * row)?;
        let v = host::load::<bf16>(mem, self.v, t_n * row)?;
        for (t, &slot) in slots.iter().enumerate() {
            if slot < 0 {
                continue;
            }
            let at = slot as usize * row * 2;
            host::store(mem, self.k_cache.offset(at), &k[t * row..(t + 1) * row])?;
            host::store(mem, self.v_cache.offset(at), &v[t * row..(t + 1) * row])?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::testing::*;

    /// Head dim 64 with only the first two dims non-zero: one kv head, block size 2, the
    /// sequence's blocks are 1 then 0 (out of order). Values: pos0 = (10,0), pos1 = (0,10),
    /// pos2 = (5,5); queries are zero, so attention weights keys uniformly.
    fn causal_setup(m: &mut FlatMemory) -> PagedAttention {
        const D: usize = 64;
        let row = |a: f32, b: f32| {
            let mut r = vec![0f32; D];
            r[0] = a;
            r[1] = b;
            r
        };
        // Slots: block 0 = (slot 0, slot 1), block 1 = (slot 2, slot 3); pos j lives in
        // block table[j / 2] = [1, 0][j / 2].
        let values = [row(5.0, 5.0), row(0.0, 0.0), row(10.0, 0.0), row(0.0, 10.0)].concat();
        let k_cache = m.put(&bf16s(&vec![0.5; 4 * D]));
        let v_cache = m.put(&bf16s(&values));
        PagedAttention {
            out: m.put(&bf16s(&[0.0; 2 * D])),
            partials: m.put(&vec![0f32; 2 * 2 * (D + 2)]),
            q: m.put(&bf16s(&[0.0; 2 * D])),
            k_cache,
            v_cache,
            block_tables: m.put(&[1i32, 0]),
            token_seq: m.put(&[0i32, 0]),
            positions: m.put(&[0i32, 2]),
            tokens: 2,
            q_heads: 1,
            kv_heads: 1,
            head_dim: D as u32,
            block_size: 2,
            max_blocks_per_seq: 2,
            keys_per_split: 0,
            splits: 1,
            scale: 1.0,
        }
    }

    #[test]
    fn attends_causally_through_the_block_table() {
        let mut m = FlatMemory::new();
        let k = causal_setup(&mut m);
        k.reference(&mut m).unwrap();
        // Position 0 sees value 0 only, position 2 the mean of all three.
        let out = f32s(&m.get(k.out, 128));
        assert_eq!((out[0], out[1], out[64], out[65]), (10.0, 0.0, 5.0, 5.0));
    }

    #[test]
    fn split_partials_combine_to_the_whole() {
        let mut m = FlatMemory::new();
        let k = PagedAttention {
            keys_per_split: 2,
            splits: 2,
            ..causal_setup(&mut m)
        };
        k.reference(&mut m).unwrap();
        let parts = m.get::<f32>(k.partials, 2 * 2 * 66);
        // Token 0 (one key): split 0 has it (m = 0, l = 1), split 1 is empty.
        assert_eq!((parts[0], parts[64], parts[65]), (10.0, 0.0, 1.0));
        assert!(parts[66..132].iter().all(|&x| x == 0.0));
        let out = m.put(&bf16s(&[0.0; 128]));
        AttentionCombine {
            out,
            partials: k.partials,
            tokens: 2,
            q_heads: 1,
            head_dim: 64,
            splits: 2,
        }
        .reference(&mut m)
        .unwrap();
        let out = f32s(&m.get(out, 128));
        assert_eq!((out[0], out[1], out[64], out[65]), (10.0, 0.0, 5.0, 5.0));
    }

    #[test]
    fn splits_cover_the_context_and_fill_the_gpu() {
        // Batch-1 decode at 1k context over 32 heads: 9 splits (288 blocks) of 114 keys.
        assert_eq!(attention_splits(1, 32, 1024, 32768, 264), (114, 9));
        // A large prefill needs no split.
        assert_eq!(attention_splits(4096, 32, 4096, 32768, 264).1, 1);
        // Never below 64 keys per split, never beyond the partials' room.
        assert_eq!(attention_splits(1, 32, 100, 32768, 264), (100, 1));
        assert_eq!(attention_splits(1, 32, 128, 32768, 264), (64, 2));
        let (per, splits) = attention_splits(64, 32, 100_000, 32768, 100_000);
        assert!(64 * 32 * splits <= 32768 && per * splits >= 100_000);
    }

    #[test]
    fn kv_write_lands_in_slots() {
        let mut m = FlatMemory::new();
        let kc = m.put(&bf16s(&[0.0; 8]));
        let vc = m.put(&bf16s(&[0.0; 8]));
        let k = m.put(&bf16s(&[1.0, 2.0, 3.0, 4.0]));
        let v = m.put(&bf16s(&[5.0, 6.0, 7.0, 8.0]));
        let slots = m.put(&[3i32, -1]);
        KvCacheWrite {
            k_cache: kc,
            v_cache: vc,
            k,
            v,
            slots,
            tokens: 2,
            row: 2,
        }
        .reference(&mut m)
        .unwrap();
        assert_eq!(
            f32s(&m.get(kc, 8)),
            vec![0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 2.0]
        );
        assert_eq!(
            f32s(&m.get(vc, 8)),
            vec![0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 5.0, 6.0]
        );
    }
}
