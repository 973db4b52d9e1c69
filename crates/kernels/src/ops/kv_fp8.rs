// SPDX-License-Identifier: MIT OR Apache-2.0
//! The FP8 (e4m3) KV cache's kernels (`--kv-cache-dtype fp8`): the cache writes that quantize and
//! the decode attentions that read e4m3, each the bf16 form's arguments plus the layer's two
//! per-tensor scales.
//!
//! A cache element is `e4m3(bf16(x) / scale)` ([`e4m3_of_bf16`]): the value the bf16 cache would
//! hold, divided by the keys' or the values' scale, rounded to the nearest e4m3 and saturated to
//! ±448. The attention reads the raw e4m3 values (exact in bf16 and f16) and applies the scales in
//! f32: `k_scale` multiplies the score scale, `v_scale` the weighted sums. So each reference is
//! its bf16 twin's over the decoded cache (`CacheRead::Fp8`, `CacheWrite::Fp8`), and a kernel
//! differs from its bf16 form only in how it moves and converts the cache.

use half::bf16;
use metrale_core::{DevicePtr, KvCacheDtype, LaunchConfig};

use super::attention::{
    CacheRead, PAGED_ATTENTION_WIDE_WARPS, paged_attention_smem_bytes_for, prefill_reference_over,
};
use super::qkv_post::CacheWrite;
pub use super::qkv_post::e4m3_of_bf16;
use super::{
    PagedAttention, PagedAttentionQkv, PrefillAttention, PrefillAttentionV2, QkvRopeKvWrite,
};
use crate::host::{self, HostError, HostMemory, Kernel, KernelAbi, kernel_args, widen};
use crate::names;

kernel_args!(
    /// [`KvCacheWrite`](super::KvCacheWrite) into an FP8 cache: `k_cache[slots[t]] =
    /// e4m3(k[t] / k_scale)`, `v_cache[slots[t]] = e4m3(v[t] / v_scale)`; a negative slot skips
    /// the token.
    KvCacheWriteFp8 => names::kv_cache::KV_CACHE_WRITE_FP8 {
        /// e4m3 `[num_slots, row]`.
        k_cache: DevicePtr,
        /// e4m3 `[num_slots, row]`.
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
        /// The keys' per-tensor scale (positive).
        k_scale: f32,
        /// The values' per-tensor scale (positive).
        v_scale: f32,
    }
);

impl Kernel for KvCacheWriteFp8 {
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
            let at = slot as usize * row;
            let quantize = |x: &[bf16], scale: f32| -> Vec<u8> {
                x.iter().map(|&e| e4m3_of_bf16(e, scale)).collect()
            };
            host::store(
                mem,
                self.k_cache.offset(at),
                &quantize(&k[t * row..][..row], self.k_scale),
            )?;
            host::store(
                mem,
                self.v_cache.offset(at),
                &quantize(&v[t * row..][..row], self.v_scale),
            )?;
        }
        Ok(())
    }
}

kernel_args!(
    /// [`QkvRopeKvWrite`] into an FP8 cache: the same queries; each key and value element the
    /// bf16 the other form stores, then `e4m3(x / k_scale)` / `e4m3(x / v_scale)`.
    QkvRopeKvWriteFp8 => names::qkv_post::QKV_ROPE_KV_WRITE_FP8 {
        /// bf16 `[tokens, q_heads * head_dim]`.
        q_out: DevicePtr,
        /// e4m3 `[num_slots, kv_heads * head_dim]`.
        k_cache: DevicePtr,
        /// e4m3 `[num_slots, kv_heads * head_dim]`.
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
        /// f32 `[max_position, rotary_dim / 2]`.
        cos: DevicePtr,
        /// f32 `[max_position, rotary_dim / 2]`.
        sin: DevicePtr,
        /// Tokens.
        tokens: u32,
        /// Query heads per token.
        q_heads: u32,
        /// Key (and value) heads per token.
        kv_heads: u32,
        /// Elements per head (even).
        head_dim: u32,
        /// The leading elements of each head that are rotated.
        rotary_dim: u32,
        /// Rows of the cos/sin tables.
        max_position: u32,
        /// Added to the mean square in the norms.
        eps: f32,
        /// Added to each norm weight in f32 before it scales.
        weight_offset: f32,
        /// The keys' per-tensor scale (positive).
        k_scale: f32,
        /// The values' per-tensor scale (positive).
        v_scale: f32,
    }
);

impl QkvRopeKvWriteFp8 {
    /// `post` writing into FP8 caches with these scales.
    pub fn of(post: &QkvRopeKvWrite, k_scale: f32, v_scale: f32) -> Self {
        let p = *post;
        QkvRopeKvWriteFp8 {
            q_out: p.q_out,
            k_cache: p.k_cache,
            v_cache: p.v_cache,
            qkv: p.qkv,
            q_norm: p.q_norm,
            k_norm: p.k_norm,
            positions: p.positions,
            slots: p.slots,
            cos: p.cos,
            sin: p.sin,
            tokens: p.tokens,
            q_heads: p.q_heads,
            kv_heads: p.kv_heads,
            head_dim: p.head_dim,
            rotary_dim: p.rotary_dim,
            max_position: p.max_position,
            eps: p.eps,
            weight_offset: p.weight_offset,
            k_scale,
            v_scale,
        }
    }

    /// The bf16 form's arguments (the same buffers).
    pub fn bf16(&self) -> QkvRopeKvWrite {
        QkvRopeKvWrite {
            q_out: self.q_out,
            k_cache: self.k_cache,
            v_cache: self.v_cache,
            qkv: self.qkv,
            q_norm: self.q_norm,
            k_norm: self.k_norm,
            positions: self.positions,
            slots: self.slots,
            cos: self.cos,
            sin: self.sin,
            tokens: self.tokens,
            q_heads: self.q_heads,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            rotary_dim: self.rotary_dim,
            max_position: self.max_position,
            eps: self.eps,
            weight_offset: self.weight_offset,
        }
    }

    fn write(&self) -> CacheWrite {
        CacheWrite::Fp8 {
            k_scale: self.k_scale,
            v_scale: self.v_scale,
        }
    }
}

impl Kernel for QkvRopeKvWriteFp8 {
    fn launch_config(&self) -> LaunchConfig {
        self.bf16().launch_config()
    }
    fn reference(&self, mem: &mut dyn HostMemory) -> Result<(), HostError> {
        let (q_out, _) = self.bf16().write_kv_and_transform(mem, self.write())?;
        host::store_bf16(mem, self.q_out, &q_out)
    }
}

kernel_args!(
    /// [`PagedAttention`] over an FP8 cache: the same arithmetic on the raw e4m3 keys and values,
    /// the scores scaled by `scale * k_scale`, the weighted sums (partials and output) by
    /// `v_scale`.
    PagedAttentionFp8 => names::attention::PAGED_ATTENTION_FP8 {
        /// bf16 `[tokens, q_heads * head_dim]`.
        out: DevicePtr,
        /// f32 `[tokens, q_heads, splits, head_dim + 2]` (written when `splits > 1`).
        partials: DevicePtr,
        /// i32 `[tokens, kv_heads]`, zero before the launch and after it.
        counters: DevicePtr,
        /// bf16 `[tokens, q_heads * head_dim]`.
        q: DevicePtr,
        /// e4m3 `[num_blocks, block_size, kv_heads, head_dim]`.
        k_cache: DevicePtr,
        /// e4m3, same layout as `k_cache`.
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
        /// Key/value heads (divides `q_heads`; a group wider than 8 query heads is split into
        /// blocks, as in [`crate::ops::paged_attention_block_group`]).
        kv_heads: u32,
        /// Elements per head: 64, 128 or 256.
        head_dim: u32,
        /// Tokens per cache block.
        block_size: u32,
        /// Columns of `block_tables`.
        max_blocks_per_seq: u32,
        /// Keys per split.
        keys_per_split: u32,
        /// Context splits (the launch's grid z).
        splits: u32,
        /// Score scale (`1 / sqrt(head_dim)`).
        scale: f32,
        /// The keys' per-tensor scale.
        k_scale: f32,
        /// The values' per-tensor scale.
        v_scale: f32,
    }
);

impl PagedAttentionFp8 {
    /// `attention` over FP8 caches with these scales.
    pub fn of(attention: &PagedAttention, k_scale: f32, v_scale: f32) -> Self {
        let a = *attention;
        PagedAttentionFp8 {
            out: a.out,
            partials: a.partials,
            counters: a.counters,
            q: a.q,
            k_cache: a.k_cache,
            v_cache: a.v_cache,
            block_tables: a.block_tables,
            token_seq: a.token_seq,
            positions: a.positions,
            tokens: a.tokens,
            q_heads: a.q_heads,
            kv_heads: a.kv_heads,
            head_dim: a.head_dim,
            block_size: a.block_size,
            max_blocks_per_seq: a.max_blocks_per_seq,
            keys_per_split: a.keys_per_split,
            splits: a.splits,
            scale: a.scale,
            k_scale,
            v_scale,
        }
    }

    /// The bf16 form's arguments (the same buffers).
    pub fn bf16(&self) -> PagedAttention {
        PagedAttention {
            out: self.out,
            partials: self.partials,
            counters: self.counters,
            q: self.q,
            k_cache: self.k_cache,
            v_cache: self.v_cache,
            block_tables: self.block_tables,
            token_seq: self.token_seq,
            positions: self.positions,
            tokens: self.tokens,
            q_heads: self.q_heads,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            block_size: self.block_size,
            max_blocks_per_seq: self.max_blocks_per_seq,
            keys_per_split: self.keys_per_split,
            splits: self.splits,
            scale: self.scale,
        }
    }

    fn read(&self) -> CacheRead {
        CacheRead::Fp8 {
            k_scale: self.k_scale,
            v_scale: self.v_scale,
        }
    }

    /// [`PagedAttention::allowance`] with the queries an input (no flips): the f16
    /// probabilities' freedom, per element of the partials (or with one split of the output).
    pub fn allowance(&self, q: &[f32], mem: &dyn HostMemory) -> Result<Vec<f32>, HostError> {
        self.bf16()
            .allowance_over(self.read(), q, &vec![0.0; q.len()], &[], mem)
    }
}

impl Kernel for PagedAttentionFp8 {
    fn launch_config(&self) -> LaunchConfig {
        LaunchConfig {
            shared_mem_bytes: paged_attention_smem_bytes_for(
                KvCacheDtype::Fp8,
                4,
                self.q_heads / self.kv_heads.max(1),
                self.head_dim,
                self.splits,
            ),
            ..self.bf16().launch_config()
        }
    }
    fn reference(&self, mem: &mut dyn HostMemory) -> Result<(), HostError> {
        let a = self.bf16();
        a.check_group(Self::NAME)?;
        let n = (self.tokens * self.q_heads * self.head_dim) as usize;
        let q = host::load_bf16(mem, self.q, n)?;
        a.attend_host(&q, mem, Self::NAME, self.read())
    }
}

kernel_args!(
    /// [`PagedAttentionQkv`] over an FP8 cache: the newest key and value written as
    /// [`QkvRopeKvWriteFp8`] writes them, the attention [`PagedAttentionFp8`]'s.
    PagedAttentionQkvFp8 => names::attention::PAGED_ATTENTION_QKV_FP8 {
        /// bf16 `[tokens, q_heads * head_dim]`.
        out: DevicePtr,
        /// f32 `[tokens, q_heads, splits, head_dim + 2]` (written when `splits > 1`).
        partials: DevicePtr,
        /// i32 `[tokens, kv_heads]`, zero before the launch and after it.
        counters: DevicePtr,
        /// bf16 `[tokens, (q_heads + 2 * kv_heads) * head_dim]`, the fused QKV product.
        qkv: DevicePtr,
        /// e4m3 `[num_blocks, block_size, kv_heads, head_dim]`; row `slots[t]` is written.
        k_cache: DevicePtr,
        /// e4m3, same layout as `k_cache`.
        v_cache: DevicePtr,
        /// i32 `[num_seqs, max_blocks_per_seq]`.
        block_tables: DevicePtr,
        /// i32 `[tokens]`: the sequence of each token, no sequence twice.
        token_seq: DevicePtr,
        /// i32 `[tokens]`: the position of each token.
        positions: DevicePtr,
        /// i32 `[tokens]`: each token's cache row; negative skips the write.
        slots: DevicePtr,
        /// bf16 `[head_dim]`, or null for no q norm.
        q_norm: DevicePtr,
        /// bf16 `[head_dim]`, or null for no k norm.
        k_norm: DevicePtr,
        /// f32 `[max_position, head_dim / 2]`.
        cos: DevicePtr,
        /// f32 `[max_position, head_dim / 2]`.
        sin: DevicePtr,
        /// Query tokens.
        tokens: u32,
        /// Query heads.
        q_heads: u32,
        /// Key/value heads.
        kv_heads: u32,
        /// Elements per head: 64, 128 or 256.
        head_dim: u32,
        /// Tokens per cache block.
        block_size: u32,
        /// Columns of `block_tables`.
        max_blocks_per_seq: u32,
        /// Keys per split.
        keys_per_split: u32,
        /// Context splits (the launch's grid z).
        splits: u32,
        /// Rows of the cos/sin tables.
        max_position: u32,
        /// Score scale (`1 / sqrt(head_dim)`).
        scale: f32,
        /// Added to the mean square in the norms.
        eps: f32,
        /// The keys' per-tensor scale.
        k_scale: f32,
        /// The values' per-tensor scale.
        v_scale: f32,
    }
);

impl PagedAttentionQkvFp8 {
    /// The wide form (8 warps a block), as [`PagedAttentionQkv::WIDE_NAME`] is to its bf16 form.
    pub const WIDE_NAME: metrale_core::KernelName = names::attention::PAGED_ATTENTION_QKV_WIDE_FP8;

    /// The one launch for `post` then `attention` over FP8 caches ([`PagedAttentionQkv::fuse`]'s
    /// conditions apply).
    pub fn fuse(post: &QkvRopeKvWriteFp8, attention: &PagedAttentionFp8) -> Self {
        Self::of(
            &PagedAttentionQkv::fuse(&post.bf16(), &attention.bf16()),
            attention.k_scale,
            attention.v_scale,
        )
    }

    /// `fused` over FP8 caches with these scales.
    pub fn of(fused: &PagedAttentionQkv, k_scale: f32, v_scale: f32) -> Self {
        let f = *fused;
        PagedAttentionQkvFp8 {
            out: f.out,
            partials: f.partials,
            counters: f.counters,
            qkv: f.qkv,
            k_cache: f.k_cache,
            v_cache: f.v_cache,
            block_tables: f.block_tables,
            token_seq: f.token_seq,
            positions: f.positions,
            slots: f.slots,
            q_norm: f.q_norm,
            k_norm: f.k_norm,
            cos: f.cos,
            sin: f.sin,
            tokens: f.tokens,
            q_heads: f.q_heads,
            kv_heads: f.kv_heads,
            head_dim: f.head_dim,
            block_size: f.block_size,
            max_blocks_per_seq: f.max_blocks_per_seq,
            keys_per_split: f.keys_per_split,
            splits: f.splits,
            max_position: f.max_position,
            scale: f.scale,
            eps: f.eps,
            k_scale,
            v_scale,
        }
    }

    /// The bf16 form's arguments (the same buffers).
    pub fn bf16(&self) -> PagedAttentionQkv {
        PagedAttentionQkv {
            out: self.out,
            partials: self.partials,
            counters: self.counters,
            qkv: self.qkv,
            k_cache: self.k_cache,
            v_cache: self.v_cache,
            block_tables: self.block_tables,
            token_seq: self.token_seq,
            positions: self.positions,
            slots: self.slots,
            q_norm: self.q_norm,
            k_norm: self.k_norm,
            cos: self.cos,
            sin: self.sin,
            tokens: self.tokens,
            q_heads: self.q_heads,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            block_size: self.block_size,
            max_blocks_per_seq: self.max_blocks_per_seq,
            keys_per_split: self.keys_per_split,
            splits: self.splits,
            max_position: self.max_position,
            scale: self.scale,
            eps: self.eps,
        }
    }

    /// The entry point of the 4-warp or (`wide`) the 8-warp form and its label suffix.
    pub fn form(wide: bool) -> (metrale_core::KernelName, &'static str) {
        if wide {
            (Self::WIDE_NAME, " (wide)")
        } else {
            (Self::NAME, "")
        }
    }

    /// The launch of the 4-warp or (`wide`) the 8-warp form.
    pub fn launch_config_of(&self, wide: bool) -> LaunchConfig {
        if wide {
            self.wide_launch_config()
        } else {
            self.launch_config()
        }
    }

    /// The wide form's launch: 256 threads and the 8 warps' FP8 rings.
    pub fn wide_launch_config(&self) -> LaunchConfig {
        LaunchConfig {
            block: [32 * PAGED_ATTENTION_WIDE_WARPS, 1, 1],
            shared_mem_bytes: paged_attention_smem_bytes_for(
                KvCacheDtype::Fp8,
                PAGED_ATTENTION_WIDE_WARPS,
                self.q_heads / self.kv_heads.max(1),
                self.head_dim,
                self.splits,
            ),
            ..self.launch_config()
        }
    }

    /// [`PagedAttentionQkv::allowance`] over the FP8 cache: the queries' bf16 flips as there; the
    /// newest key's elements whose bf16 value may round the other way on the GPU and whose two
    /// bf16 candidates quantize to different e4m3 values flip by that e4m3 step. Writes the
    /// newest keys and values into the caches in `mem`, as the kernel does.
    pub fn allowance(&self, mem: &mut dyn HostMemory) -> Result<Vec<f32>, HostError> {
        let (post, attention) = self.bf16().parts();
        let (exact, keys) = post.write_kv_and_transform(mem, self.write())?;
        let q: Vec<f32> = exact.iter().map(|&x| widen(bf16::from_f32(x))).collect();
        let q_flip: Vec<f32> = exact.iter().map(|x| super::attention::q_flip(*x)).collect();
        let key_flip: Vec<Vec<f32>> = keys
            .iter()
            .map(|k| k.iter().map(|&x| self.key_flip(x)).collect())
            .collect();
        attention.allowance_over(self.read(), &q, &q_flip, &key_flip, mem)
    }

    /// How far the e4m3 of key element `x` (f32, before its bf16 rounding) may move if the GPU
    /// rounds it to the other bf16 neighbour (in raw e4m3 units).
    fn key_flip(&self, x: f32) -> f32 {
        let ulp = super::attention::q_flip(x);
        if ulp == 0.0 {
            return 0.0;
        }
        let near = bf16::from_f32(x);
        let other = if f32::from(near) > x {
            bf16::from_f32(f32::from(near) - ulp)
        } else {
            bf16::from_f32(f32::from(near) + ulp)
        };
        let decode = |b: bf16| metrale_core::fp8::e4m3_to_f32(e4m3_of_bf16(b, self.k_scale));
        (decode(near) - decode(other)).abs()
    }

    fn write(&self) -> CacheWrite {
        CacheWrite::Fp8 {
            k_scale: self.k_scale,
            v_scale: self.v_scale,
        }
    }

    fn read(&self) -> CacheRead {
        CacheRead::Fp8 {
            k_scale: self.k_scale,
            v_scale: self.v_scale,
        }
    }
}

impl Kernel for PagedAttentionQkvFp8 {
    fn launch_config(&self) -> LaunchConfig {
        LaunchConfig {
            shared_mem_bytes: paged_attention_smem_bytes_for(
                KvCacheDtype::Fp8,
                4,
                self.q_heads / self.kv_heads.max(1),
                self.head_dim,
                self.splits,
            ),
            ..self.bf16().launch_config()
        }
    }
    fn reference(&self, mem: &mut dyn HostMemory) -> Result<(), HostError> {
        self.bf16()
            .reference_over(mem, Self::NAME, self.write(), self.read())
    }
}

/// The host reference of [`PagedAttentionQkvFp8::WIDE_NAME`]: the fused FP8 form's, after
/// refusing the launches the kernel would skip (a block of other than 8 warps, a head_dim other
/// than 64 or 128).
pub(crate) fn paged_attention_qkv_wide_fp8_reference(
    mem: &mut dyn HostMemory,
    config: &LaunchConfig,
    args: &[metrale_core::KernelArg],
) -> Result<(), HostError> {
    let k = PagedAttentionQkvFp8::from_args(args)?;
    let threads = 32 * PAGED_ATTENTION_WIDE_WARPS;
    if config.block != [threads, 1, 1] || !PagedAttentionQkv::wide_takes_head_dim(k.head_dim) {
        return Err(HostError::BadArgs {
            kernel: PagedAttentionQkvFp8::WIDE_NAME,
            message: format!(
                "block {:?}, head_dim {}: the wide form takes blocks of {threads} threads and \
                 head_dim 64 or 128 (wide_launch_config)",
                config.block, k.head_dim
            ),
        });
    }
    k.bf16()
        .reference_over(mem, PagedAttentionQkvFp8::WIDE_NAME, k.write(), k.read())
}

kernel_args!(
    /// [`PrefillAttentionV2`] over an FP8 cache: the same tiles and arithmetic on the raw e4m3
    /// keys and values, the score scale times `k_scale`, the outputs times `v_scale`. The
    /// version the engine takes for prefill tiles over an FP8 cache (head dims 64 and 128).
    PrefillAttentionV2Fp8 => names::prefill_attention::PREFILL_ATTENTION_V2_FP8 {
        /// bf16 `[tokens, q_heads * head_dim]`.
        out: DevicePtr,
        /// bf16 `[tokens, q_heads * head_dim]`.
        q: DevicePtr,
        /// e4m3 `[num_blocks, block_size, kv_heads, head_dim]`.
        k_cache: DevicePtr,
        /// e4m3, same layout as `k_cache`.
        v_cache: DevicePtr,
        /// i32 `[num_seqs, max_blocks_per_seq]`.
        block_tables: DevicePtr,
        /// i32 `[num_tiles, 4]`: `(seq, first_token, first_position, count)` per tile.
        tiles: DevicePtr,
        /// Query tiles (the launch's grid y, at most 65535).
        num_tiles: u32,
        /// Query heads (the launch's grid x).
        q_heads: u32,
        /// Key/value heads (divides `q_heads`).
        kv_heads: u32,
        /// Elements per head: 64 or 128.
        head_dim: u32,
        /// Tokens per cache block.
        block_size: u32,
        /// Columns of `block_tables`.
        max_blocks_per_seq: u32,
        /// Score scale (`1 / sqrt(head_dim)`), positive.
        scale: f32,
        /// The keys' per-tensor scale.
        k_scale: f32,
        /// The values' per-tensor scale.
        v_scale: f32,
    }
);

impl PrefillAttentionV2Fp8 {
    /// `v1`'s arguments (the tiles cut for version 2) over FP8 caches with these scales.
    pub fn of(v1: &PrefillAttention, k_scale: f32, v_scale: f32) -> Self {
        let a = *v1;
        PrefillAttentionV2Fp8 {
            out: a.out,
            q: a.q,
            k_cache: a.k_cache,
            v_cache: a.v_cache,
            block_tables: a.block_tables,
            tiles: a.tiles,
            num_tiles: a.num_tiles,
            q_heads: a.q_heads,
            kv_heads: a.kv_heads,
            head_dim: a.head_dim,
            block_size: a.block_size,
            max_blocks_per_seq: a.max_blocks_per_seq,
            scale: a.scale,
            k_scale,
            v_scale,
        }
    }

    /// The arguments in version 1's struct (the references' common form).
    pub fn v1(&self) -> PrefillAttention {
        PrefillAttention {
            out: self.out,
            q: self.q,
            k_cache: self.k_cache,
            v_cache: self.v_cache,
            block_tables: self.block_tables,
            tiles: self.tiles,
            num_tiles: self.num_tiles,
            q_heads: self.q_heads,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            block_size: self.block_size,
            max_blocks_per_seq: self.max_blocks_per_seq,
            scale: self.scale,
        }
    }
}

impl Kernel for PrefillAttentionV2Fp8 {
    fn launch_config(&self) -> LaunchConfig {
        PrefillAttentionV2::from(self.v1()).launch_config()
    }
    fn reference(&self, mem: &mut dyn HostMemory) -> Result<(), HostError> {
        prefill_reference_over(
            &self.v1(),
            Self::NAME,
            PrefillAttentionV2::TILE_TOKENS,
            PrefillAttentionV2::KEY_TILE,
            mem,
            CacheRead::Fp8 {
                k_scale: self.k_scale,
                v_scale: self.v_scale,
            },
        )
    }
}

/// The cache element dtype's kernels exist for this head dim: the decode attention's FP8 forms
/// take 64, 128 and 256 (the wide form 64 and 128).
pub fn fp8_attention_takes_head_dim(head_dim: u32) -> bool {
    matches!(head_dim, 64 | 128 | 256)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::testing::{FlatMemory, bf16s, uniform};
    use metrale_core::fp8::{e4m3_to_f32, f32_to_e4m3};

    #[test]
    fn cache_write_divides_rounds_and_saturates() {
        let mut m = FlatMemory::new();
        let kc = m.put(&[0u8; 8]);
        let vc = m.put(&[0u8; 8]);
        // 1.0 / 2 = 0.5; 3.0 / 2 = 1.5; 1000 / 2 = 500 saturates to 448; -0.3 / 2 rounds.
        let k = m.put(&bf16s(&[1.0, 3.0, 1000.0, -0.3]));
        let v = m.put(&bf16s(&[5.0, 6.0, 7.0, 8.0]));
        let slots = m.put(&[3i32, -1]);
        KvCacheWriteFp8 {
            k_cache: kc,
            v_cache: vc,
            k,
            v,
            slots,
            tokens: 2,
            row: 2,
            k_scale: 2.0,
            v_scale: 0.5,
        }
        .reference(&mut m)
        .unwrap();
        let kb: Vec<u8> = m.get(kc, 8);
        let decoded: Vec<f32> = kb.iter().map(|&b| e4m3_to_f32(b)).collect();
        assert_eq!(decoded, vec![0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.5, 1.5]);
        let vb: Vec<u8> = m.get(vc, 8);
        assert_eq!(&vb[6..], &[f32_to_e4m3(10.0), f32_to_e4m3(12.0)]);
        assert_eq!(e4m3_of_bf16(bf16::from_f32(1000.0), 2.0), 0x7E);
        assert_eq!(e4m3_of_bf16(bf16::from_f32(-1000.0), 1.0), 0xFE);
    }

    /// Keys and values quantized with power-of-two scales (so that `e4m3 x scale` is exact in
    /// bf16): the FP8 attention's reference equals the bf16 attention's over the dequantized
    /// cache, bit for bit, whole and split; with a wrong scale or the cache read as bf16 bytes
    /// it does not.
    #[test]
    fn fp8_attention_is_the_bf16_attention_over_the_dequantized_cache() {
        let (d, qh, kvh, bs, maxb) = (64usize, 4usize, 2usize, 16usize, 4usize);
        let (ks, vs) = (0.25f32, 4.0f32);
        let cache_n = 2 * maxb * bs * kvh * d;
        let quant = |x: &[f32], s: f32| -> Vec<u8> {
            x.iter().map(|&v| f32_to_e4m3(v * 8.0 / s)).collect()
        };
        let k8 = quant(&uniform(3, cache_n, 1.0), ks);
        let v8 = quant(&uniform(4, cache_n, 1.0), vs);
        let deq =
            |b: &[u8], s: f32| bf16s(&b.iter().map(|&x| e4m3_to_f32(x) * s).collect::<Vec<_>>());
        let tables: Vec<i32> = vec![5, 2, 7, 0, 1, 3, 4, 6];
        let (token_seq, positions) = (vec![0i32, 1], vec![50i32, 33]);
        let q = bf16s(&uniform(5, 2 * qh * d, 1.0));
        for (keys_per_split, splits) in [(0u32, 1u32), (16, 4)] {
            let mut m = FlatMemory::new();
            let parts = 2 * qh * splits as usize * (d + 2);
            let base = PagedAttention {
                out: m.put(&vec![bf16::ZERO; 2 * qh * d]),
                partials: m.put(&vec![0f32; parts]),
                counters: m.put(&[0i32; 4]),
                q: m.put(&q),
                k_cache: m.put(&deq(&k8, ks)),
                v_cache: m.put(&deq(&v8, vs)),
                block_tables: m.put(&tables),
                token_seq: m.put(&token_seq),
                positions: m.put(&positions),
                tokens: 2,
                q_heads: qh as u32,
                kv_heads: kvh as u32,
                head_dim: d as u32,
                block_size: bs as u32,
                max_blocks_per_seq: maxb as u32,
                keys_per_split,
                splits,
                scale: 0.125,
            };
            base.reference(&mut m).unwrap();
            let want: Vec<bf16> = m.get(base.out, 2 * qh * d);
            let want_parts: Vec<f32> = m.get(base.partials, parts);
            let run = |k_scale: f32, v_scale: f32, k8: &[u8], v8: &[u8]| {
                let mut m = m.clone();
                let fp8 = PagedAttentionFp8 {
                    k_cache: m.put(k8),
                    v_cache: m.put(v8),
                    out: m.put(&vec![bf16::ZERO; 2 * qh * d]),
                    partials: m.put(&vec![0f32; parts]),
                    ..PagedAttentionFp8::of(&base, k_scale, v_scale)
                };
                fp8.reference(&mut m).unwrap();
                let out: Vec<bf16> = m.get(fp8.out, 2 * qh * d);
                (out, m.get::<f32>(fp8.partials, parts))
            };
            let (got, got_parts) = run(ks, vs, &k8, &v8);
            assert_eq!(got, want, "splits {splits}");
            assert_eq!(got_parts, want_parts, "splits {splits}");
            assert_ne!(run(ks, 1.0, &k8, &v8).0, want, "a wrong v_scale");
            assert_ne!(run(1.0, vs, &k8, &v8).0, want, "a wrong k_scale");
            // The keys of kv head 1 read as kv head 0's (a layout error).
            let mut swapped = k8.clone();
            for row in swapped.chunks_exact_mut(kvh * d) {
                row.rotate_left(d);
            }
            assert_ne!(run(ks, vs, &swapped, &v8).0, want, "a wrong layout");
        }
    }

    /// The FP8 prefill attention's reference is version 2's over the dequantized cache, bit for
    /// bit where the scales are powers of two; a wrong scale moves it.
    #[test]
    fn fp8_prefill_is_version_2_over_the_dequantized_cache() {
        let (d, qh, kvh, bs, maxb) = (128usize, 4usize, 2usize, 16usize, 12usize);
        let (ks, vs) = (2.0f32, 0.125f32);
        let cache_n = maxb * bs * kvh * d;
        let k8: Vec<u8> = uniform(21, cache_n, 3.0)
            .iter()
            .map(|&x| f32_to_e4m3(x))
            .collect();
        let v8: Vec<u8> = uniform(22, cache_n, 3.0)
            .iter()
            .map(|&x| f32_to_e4m3(x))
            .collect();
        let deq =
            |b: &[u8], s: f32| bf16s(&b.iter().map(|&x| e4m3_to_f32(x) * s).collect::<Vec<_>>());
        let tables: Vec<i32> = (0..maxb as i32).map(|b| (b * 5) % maxb as i32).collect();
        let (token_seq, positions): (Vec<i32>, Vec<i32>) = (30..170).map(|p| (0, p)).unzip();
        let tokens = token_seq.len();
        let tiles = crate::ops::prefill_attention_tiles_of(&token_seq, &positions, 128);
        let mut m = FlatMemory::new();
        let v1 = PrefillAttention {
            out: m.put(&vec![bf16::ZERO; tokens * qh * d]),
            q: m.put(&bf16s(&uniform(23, tokens * qh * d, 1.0))),
            k_cache: m.put(&deq(&k8, ks)),
            v_cache: m.put(&deq(&v8, vs)),
            block_tables: m.put(&tables),
            tiles: m.put(&tiles.concat()),
            num_tiles: tiles.len() as u32,
            q_heads: qh as u32,
            kv_heads: kvh as u32,
            head_dim: d as u32,
            block_size: bs as u32,
            max_blocks_per_seq: maxb as u32,
            scale: 1.0 / (d as f32).sqrt(),
        };
        let mut want_m = m.clone();
        PrefillAttentionV2::from(v1).reference(&mut want_m).unwrap();
        let want: Vec<bf16> = want_m.get(v1.out, tokens * qh * d);
        let run = |k_scale: f32| {
            let mut m = m.clone();
            let fp8 = PrefillAttentionV2Fp8 {
                k_cache: m.put(&k8),
                v_cache: m.put(&v8),
                ..PrefillAttentionV2Fp8::of(&v1, k_scale, vs)
            };
            fp8.reference(&mut m).unwrap();
            m.get::<bf16>(v1.out, tokens * qh * d)
        };
        assert_eq!(run(ks), want);
        assert_ne!(run(1.0), want);
    }

    fn post(m: &mut FlatMemory, cache: usize, cache_bytes: usize) -> QkvRopeKvWrite {
        let (t, qh, kvh, d, maxpos) = (3usize, 4usize, 2usize, 64usize, 64usize);
        let half = d / 2;
        let cos: Vec<f32> = (0..maxpos * half)
            .map(|i| (i as f32 * 0.01).cos())
            .collect();
        let sin: Vec<f32> = (0..maxpos * half)
            .map(|i| (i as f32 * 0.01).sin())
            .collect();
        QkvRopeKvWrite {
            q_out: m.put(&vec![bf16::ZERO; t * qh * d]),
            k_cache: m.put(&vec![0u8; cache * cache_bytes]),
            v_cache: m.put(&vec![0u8; cache * cache_bytes]),
            qkv: m.put(&bf16s(&uniform(11, t * (qh + 2 * kvh) * d, 3.0))),
            q_norm: m.put(&bf16s(&uniform(12, d, 1.0))),
            k_norm: m.put(&bf16s(&uniform(13, d, 1.0))),
            positions: m.put(&[3i32, 17, 40]),
            slots: m.put(&[5i32, -1, 0]),
            cos: m.put(&cos),
            sin: m.put(&sin),
            tokens: t as u32,
            q_heads: qh as u32,
            kv_heads: kvh as u32,
            head_dim: d as u32,
            rotary_dim: d as u32,
            max_position: maxpos as u32,
            eps: 1e-6,
            weight_offset: 0.0,
        }
    }

    /// The FP8 cache write stores the bf16 form's cache values quantized, and the same queries.
    #[test]
    fn qkv_post_fp8_is_the_bf16_write_quantized() {
        let cache = 8 * 2 * 64;
        let mut m = FlatMemory::new();
        let b = post(&mut m, cache, 2);
        b.reference(&mut m).unwrap();
        let mut m8 = FlatMemory::new();
        let p8 = QkvRopeKvWriteFp8::of(&post(&mut m8, cache, 1), 0.5, 3.0);
        p8.reference(&mut m8).unwrap();
        assert_eq!(
            m.get::<bf16>(b.q_out, 3 * 4 * 64),
            m8.get::<bf16>(p8.q_out, 3 * 4 * 64)
        );
        for (cache16, cache8, scale) in [(b.k_cache, p8.k_cache, 0.5), (b.v_cache, p8.v_cache, 3.0)]
        {
            let want: Vec<u8> = m
                .get::<bf16>(cache16, cache)
                .iter()
                .map(|&x| e4m3_of_bf16(x, scale))
                .collect();
            assert_eq!(m8.get::<u8>(cache8, cache), want);
        }
    }

    /// The fused FP8 decode attention is the FP8 cache write, then the FP8 attention.
    #[test]
    fn fused_fp8_is_write_then_attend() {
        let (qh, kvh, d, bs, maxb) = (4u32, 2u32, 64u32, 16u32, 4u32);
        let cache = (maxb * bs * kvh * d) as usize;
        let mut m = FlatMemory::new();
        let p = post(&mut m, cache, 1);
        let tables = m.put(&[0i32, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3]);
        let seqs = m.put(&[0i32, 1, 2]);
        let parts = 3 * qh as usize * 4 * (d as usize + 2);
        let attention = PagedAttention {
            out: m.put(&vec![bf16::ZERO; 3 * (qh * d) as usize]),
            partials: m.put(&vec![0f32; parts]),
            counters: m.put(&[0i32; 6]),
            q: p.q_out,
            k_cache: p.k_cache,
            v_cache: p.v_cache,
            block_tables: tables,
            token_seq: seqs,
            positions: p.positions,
            tokens: 3,
            q_heads: qh,
            kv_heads: kvh,
            head_dim: d,
            block_size: bs,
            max_blocks_per_seq: maxb,
            keys_per_split: 16,
            splits: 4,
            scale: 0.125,
        };
        let (post8, att8) = (
            QkvRopeKvWriteFp8::of(&p, 0.5, 2.0),
            PagedAttentionFp8::of(&attention, 0.5, 2.0),
        );
        let mut two = m.clone();
        post8.reference(&mut two).unwrap();
        att8.reference(&mut two).unwrap();
        let fused = PagedAttentionQkvFp8::fuse(&post8, &att8);
        fused.reference(&mut m).unwrap();
        let n = 3 * (qh * d) as usize;
        assert_eq!(m.get::<bf16>(fused.out, n), two.get::<bf16>(att8.out, n));
        assert_eq!(
            m.get::<u8>(p.k_cache, cache),
            two.get::<u8>(p.k_cache, cache)
        );
        assert_eq!(
            m.get::<f32>(fused.partials, parts),
            two.get::<f32>(att8.partials, parts)
        );
    }
}
