// SPDX-License-Identifier: MIT OR Apache-2.0
//! Paged KV cache writes and causal grouped-query attention over the cache.

use half::bf16;
use metrale_core::{DevicePtr, LaunchConfig};

use crate::host::{self, HostError, HostMemory, Kernel, KernelAbi, kernel_args, widen};
use crate::names;

kernel_args!(
    /// Causal GQA: token `t` (sequence `token_seq[t]`, position `positions[t]`) attends to keys
    /// `0..=positions[t]` of its sequence in the paged cache.
    PagedAttention => names::attention::PAGED_ATTENTION_BF16 {
        /// bf16 `[tokens, q_heads * head_dim]`.
        out: DevicePtr,
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
        /// Elements per head (at most 256).
        head_dim: u32,
        /// Tokens per cache block.
        block_size: u32,
        /// Columns of `block_tables`.
        max_blocks_per_seq: u32,
        /// Score scale (`1 / sqrt(head_dim)`).
        scale: f32,
    }
);

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

impl Kernel for PagedAttention {
    fn launch_config(&self) -> LaunchConfig {
        LaunchConfig {
            grid: [self.tokens, self.q_heads, 1],
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
        let mut out = vec![0f32; t_n * qh * d];
        let mut scores = Vec::new();
        for t in 0..t_n {
            let (seq, pos) = (token_seq[t] as usize, positions[t]);
            if pos < 0 || (pos as usize) >= maxb * bs {
                return Err(bad(format!(
                    "token {t} has position {pos}, outside its block table of {maxb} blocks"
                )));
            }
            let table = &tables[seq * maxb..(seq + 1) * maxb];
            for h in 0..qh {
                let kv = h / (qh / kvh);
                let qv = &q[(t * qh + h) * d..][..d];
                let slot = |j: usize| (table[j / bs] as usize * bs + j % bs) * row + kv * d;
                scores.clear();
                for j in 0..=pos as usize {
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
                let o = &mut out[(t * qh + h) * d..][..d];
                for (j, p) in scores.iter().enumerate() {
                    let v = &v_cache[slot(j)..][..d];
                    for (acc, x) in o.iter_mut().zip(v) {
                        *acc += p * widen(*x);
                    }
                }
                for acc in o.iter_mut() {
                    *acc /= total;
                }
            }
        }
        drop((k_cache, v_cache));
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

    #[test]
    fn attends_causally_through_the_block_table() {
        let mut m = FlatMemory::new();
        // One kv head of dim 2, block size 2; the sequence's blocks are 1 then 0 (out of order).
        // Keys: pos0 = (1,0) pos1 = (0,1) pos2 = (1,1); values = (10,0), (0,10), (5,5).
        let k_cache = m.put(&bf16s(&[1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0]));
        let v_cache = m.put(&bf16s(&[5.0, 5.0, 0.0, 0.0, 10.0, 0.0, 0.0, 10.0]));
        let tables = m.put(&[1i32, 0]);
        let q = m.put(&bf16s(&[0.0, 0.0, 0.0, 0.0]));
        let seq = m.put(&[0i32, 0]);
        let pos = m.put(&[0i32, 2]);
        let out = m.put(&bf16s(&[0.0; 4]));
        PagedAttention {
            out,
            q,
            k_cache,
            v_cache,
            block_tables: tables,
            token_seq: seq,
            positions: pos,
            tokens: 2,
            q_heads: 1,
            kv_heads: 1,
            head_dim: 2,
            block_size: 2,
            max_blocks_per_seq: 2,
            scale: 1.0,
        }
        .reference(&mut m)
        .unwrap();
        // Zero queries weight keys uniformly: position 0 sees value 0 only, position 2 the mean.
        assert_eq!(f32s(&m.get(out, 4)), vec![10.0, 0.0, 5.0, 5.0]);
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
