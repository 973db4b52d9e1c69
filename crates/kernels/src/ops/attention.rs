// SPDX-License-Identifier: MIT OR Apache-2.0
//! Paged KV cache writes and causal grouped-query attention over the cache.

use half::bf16;
use metrale_core::{DevicePtr, LaunchConfig};

use super::QkvRopeKvWrite;
use super::qkv_post::CacheWrite;
use crate::host::{self, HostError, HostMemory, Kernel, KernelAbi, kernel_args, widen};
use crate::names;
use metrale_core::KvCacheDtype;

kernel_args!(
    /// Causal GQA: token `t` (sequence `token_seq[t]`, position `positions[t]`) attends to keys
    /// `0..=positions[t]` of its sequence in the paged cache. With `splits > 1` split `z` covers
    /// keys `[z * keys_per_split, (z + 1) * keys_per_split)` and writes its unnormalised partial
    /// `(acc[head_dim], m, l)` to `partials`; the last block of each (token, kv head) to finish
    /// merges them into the output (as [`AttentionCombine`] would). With one split the output is
    /// written directly.
    PagedAttention => names::attention::PAGED_ATTENTION_BF16 {
        /// bf16 `[tokens, q_heads * head_dim]`.
        out: DevicePtr,
        /// f32 `[tokens, q_heads, splits, head_dim + 2]` (written when `splits > 1`).
        partials: DevicePtr,
        /// i32 `[tokens, kv_heads]`, zero before the launch and after it: the blocks of each
        /// (token, kv head) done so far (used when `splits > 1`).
        counters: DevicePtr,
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
        /// Key/value heads (divides `q_heads`; a group wider than 8 query heads is split into
        /// blocks of [`paged_attention_block_group`] heads).
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
    /// [`QkvRopeKvWrite`] and then [`PagedAttention`] in one launch, for decode steps (every
    /// token the one new token of its own sequence): each block normalises and rotates its query
    /// group from the raw QKV product itself, and the block whose split holds a token's position
    /// writes the token's key and value into cache row `slots[t]` and attends to them. Outputs,
    /// partials, counters and caches are those of the two launches, bit for bit (the kernel shares
    /// the transform with qkv_post.cu). The launch is [`PagedAttention`]'s.
    PagedAttentionQkv => names::attention::PAGED_ATTENTION_QKV_BF16 {
        /// bf16 `[tokens, q_heads * head_dim]`.
        out: DevicePtr,
        /// f32 `[tokens, q_heads, splits, head_dim + 2]` (written when `splits > 1`).
        partials: DevicePtr,
        /// i32 `[tokens, kv_heads]`, zero before the launch and after it.
        counters: DevicePtr,
        /// bf16 `[tokens, (q_heads + 2 * kv_heads) * head_dim]`, the fused QKV product.
        qkv: DevicePtr,
        /// bf16 `[num_blocks, block_size, kv_heads, head_dim]`; row `slots[t]` is written.
        k_cache: DevicePtr,
        /// bf16, same layout as `k_cache`.
        v_cache: DevicePtr,
        /// i32 `[num_seqs, max_blocks_per_seq]`.
        block_tables: DevicePtr,
        /// i32 `[tokens]`: the sequence of each token, no sequence twice.
        token_seq: DevicePtr,
        /// i32 `[tokens]`: the position of each token.
        positions: DevicePtr,
        /// i32 `[tokens]`: each token's cache row (its block table's slot for its position);
        /// negative skips the write, and the attention then reads the row as it is.
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
        /// Key/value heads (divides `q_heads`; a group wider than 8 query heads is split into
        /// blocks of [`paged_attention_block_group`] heads).
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
    }
);

impl PagedAttentionQkv {
    /// The one launch for `post` followed by `attention` (the same tokens over the same caches;
    /// `post.q_out` and `attention.q` are not needed). The fused kernel rotates whole heads and
    /// scales by the plain norm weights: `post` must not be a partial rotation nor have a norm
    /// weight offset.
    ///
    /// # Panics
    /// If `post.rotary_dim` is not its `head_dim`, or `post.weight_offset` is not 0.
    pub fn fuse(post: &QkvRopeKvWrite, attention: &PagedAttention) -> Self {
        assert_eq!(
            post.rotary_dim, post.head_dim,
            "the fused decode attention rotates whole heads"
        );
        assert_eq!(
            post.weight_offset, 0.0,
            "the fused decode attention takes no norm weight offset"
        );
        PagedAttentionQkv {
            out: attention.out,
            partials: attention.partials,
            counters: attention.counters,
            qkv: post.qkv,
            k_cache: attention.k_cache,
            v_cache: attention.v_cache,
            block_tables: attention.block_tables,
            token_seq: attention.token_seq,
            positions: attention.positions,
            slots: post.slots,
            q_norm: post.q_norm,
            k_norm: post.k_norm,
            cos: post.cos,
            sin: post.sin,
            tokens: attention.tokens,
            q_heads: attention.q_heads,
            kv_heads: attention.kv_heads,
            head_dim: attention.head_dim,
            block_size: attention.block_size,
            max_blocks_per_seq: attention.max_blocks_per_seq,
            keys_per_split: attention.keys_per_split,
            splits: attention.splits,
            max_position: post.max_position,
            scale: attention.scale,
            eps: post.eps,
        }
    }

    /// The two launches it stands for.
    pub fn parts(&self) -> (QkvRopeKvWrite, PagedAttention) {
        (
            QkvRopeKvWrite {
                q_out: DevicePtr::NULL,
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
                rotary_dim: self.head_dim,
                max_position: self.max_position,
                eps: self.eps,
                weight_offset: 0.0,
            },
            PagedAttention {
                out: self.out,
                partials: self.partials,
                counters: self.counters,
                q: DevicePtr::NULL,
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
            },
        )
    }
}

/// Warps a block of [`PagedAttentionQkv`]'s wide form (`paged_attention_qkv_wide_bf16`).
pub const PAGED_ATTENTION_WIDE_WARPS: u32 = 8;

impl PagedAttentionQkv {
    /// The wide form's entry point: the same arguments and arithmetic with 8 warps a block (one
    /// block an SM), each warp taking every eighth 16-key tile instead of every fourth; for
    /// launches of few blocks (batch-1 decode), where a block's tiles one after another are the
    /// attention's latency. Its results are not bit for bit the 4-warp form's: each warp rounds
    /// its probabilities to f16 against its own running max (over other keys than a 4-warp
    /// block's warp), and the warps' f32 sums merge in another order.
    pub const WIDE_NAME: metrale_core::KernelName = names::attention::PAGED_ATTENTION_QKV_WIDE_BF16;

    /// Whether the wide form can take this launch: head_dim 64 or 128 (at 256 its rings would not
    /// fit an SM).
    pub fn wide_fits(&self) -> bool {
        Self::wide_takes_head_dim(self.head_dim)
    }

    /// The head dims the wide form takes: 64 and 128.
    pub fn wide_takes_head_dim(head_dim: u32) -> bool {
        matches!(head_dim, 64 | 128)
    }

    /// The entry point of the 4-warp or (`wide`) the 8-warp form, and a suffix that names it in a
    /// case's or bench row's label.
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

    /// The wide form's launch: the same grid, 256 threads, the 8 warps' rings (192 KiB at
    /// head_dim 128).
    pub fn wide_launch_config(&self) -> LaunchConfig {
        LaunchConfig {
            block: [32 * PAGED_ATTENTION_WIDE_WARPS, 1, 1],
            shared_mem_bytes: paged_attention_smem_bytes_of(
                PAGED_ATTENTION_WIDE_WARPS,
                self.q_heads / self.kv_heads.max(1),
                self.head_dim,
                self.splits,
            ),
            ..self.launch_config()
        }
    }
}

/// The host reference of the wide entry ([`PagedAttentionQkv::WIDE_NAME`]): the fused form's,
/// after refusing the launches the kernel would skip without writing anything (a block of other
/// than 8 warps, a head_dim it does not take), so that a host run catches what the GPU would not
/// report.
pub(crate) fn paged_attention_qkv_wide_reference(
    mem: &mut dyn HostMemory,
    config: &LaunchConfig,
    args: &[metrale_core::KernelArg],
) -> Result<(), HostError> {
    let k = PagedAttentionQkv::from_args(args)?;
    let threads = 32 * PAGED_ATTENTION_WIDE_WARPS;
    if config.block != [threads, 1, 1] || !k.wide_fits() {
        return Err(HostError::BadArgs {
            kernel: PagedAttentionQkv::WIDE_NAME,
            message: format!(
                "block {:?}, head_dim {}: the wide form takes blocks of {threads} threads and \
                 head_dim 64 or 128 (wide_launch_config)",
                config.block, k.head_dim
            ),
        });
    }
    k.reference(mem)
}

impl PagedAttentionQkv {
    /// [`PagedAttention::allowance`] for the fused form: its queries come out of the
    /// f32 normalisation and rotation, and one within a hair of a bf16 rounding boundary
    /// ([`Q_FLIP_MARGIN_ULPS`]) may round the other way on the GPU (seen on the H200: -1.23046875,
    /// a tie on the host, moved a partial by 7e-3); so may the newest key it writes and patches
    /// into its tile. With one split, the allowance is the bf16 output's (the 8-warp form put one
    /// output element of 2 million 2.5e-4 from the reference on the H200, within its f16
    /// probabilities' freedom; check.rs's test holds it). Writes the newest keys and values
    /// into the caches in `mem`, as the kernel does, since the attention reads them.
    pub fn allowance(&self, mem: &mut dyn HostMemory) -> Result<Vec<f32>, HostError> {
        let (post, attention) = self.parts();
        let (exact, keys) = post.write_kv_and_transform(mem, CacheWrite::Bf16)?;
        let q: Vec<f32> = exact.iter().map(|&x| widen(bf16::from_f32(x))).collect();
        let flip = |x: &f32| bf16_flip_within(x.abs(), Q_FLIP_MARGIN_ULPS).unwrap_or(0.0);
        let q_flip: Vec<f32> = exact.iter().map(flip).collect();
        let key_flip: Vec<Vec<f32>> = keys.iter().map(|k| k.iter().map(flip).collect()).collect();
        attention.allowance(&q, &q_flip, &key_flip, mem)
    }
}

impl Kernel for PagedAttentionQkv {
    fn launch_config(&self) -> LaunchConfig {
        self.parts().1.launch_config()
    }

    /// [`QkvRopeKvWrite`]'s reference (cache writes, queries rounded once to bf16), then
    /// [`PagedAttention`]'s on those queries. Refuses a sequence named by two tokens: the kernel
    /// would not see the other token's key.
    fn reference(&self, mem: &mut dyn HostMemory) -> Result<(), HostError> {
        self.reference_over(mem, Self::NAME, CacheWrite::Bf16, CacheRead::Bf16)
    }
}

impl PagedAttentionQkv {
    /// [`reference`](Kernel::reference) over caches of the given elements (the FP8 forms'),
    /// errors naming `kernel`.
    pub(crate) fn reference_over(
        &self,
        mem: &mut dyn HostMemory,
        kernel: metrale_core::KernelName,
        write: CacheWrite,
        read: CacheRead,
    ) -> Result<(), HostError> {
        let (post, attention) = self.parts();
        attention.check_group(kernel)?;
        if !matches!(self.head_dim, 64 | 128 | 256) {
            return Err(HostError::BadArgs {
                kernel,
                message: format!("head_dim {} is not 64, 128 or 256", self.head_dim),
            });
        }
        let mut token_seq = host::load::<i32>(mem, self.token_seq, self.tokens as usize)?;
        token_seq.sort_unstable();
        if let Some(w) = token_seq.windows(2).find(|w| w[0] == w[1]) {
            return Err(HostError::BadArgs {
                kernel,
                message: format!("sequence {} has more than one token in the launch", w[0]),
            });
        }
        let q: Vec<f32> = post
            .write_kv_and_transform(mem, write)?
            .0
            .into_iter()
            .map(|x| widen(bf16::from_f32(x)))
            .collect();
        attention.attend_host(&q, mem, kernel, read)
    }
}

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
        /// Splits per (token, head), at most [`MAX_COMBINE_SPLITS`].
        splits: u32,
    }
);

kernel_args!(
    /// Causal attention of prefill query tiles on tensor cores. Tile `i` of `tiles` is
    /// `(seq, first_token, first_position, count)`: `count` (1..=64) consecutive tokens of
    /// sequence `seq` from `first_token` on, at positions `first_position..first_position +
    /// count`; token `first_token + r` attends to keys `0..=first_position + r` of its sequence in
    /// the paged cache, so a later chunk of a chunked prefill reads the earlier chunks' keys from
    /// the cache. Only tokens a tile names are written. Built by [`prefill_attention_tiles`].
    ///
    /// The kernel rounds the softmax probabilities to bf16 for the `P V` product (f32 scores,
    /// max, sums and accumulators; docs/precision.md), and the reference does the same, with the
    /// kernel's 64-key tiles and running max. Head dims 64 and 128 only ([`PrefillAttention::supports_head_dim`]): for
    /// others the kernel writes nothing and callers use [`PagedAttention`].
    PrefillAttention => names::prefill_attention::PREFILL_ATTENTION_BF16 {
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
        /// i32 `[num_tiles, 4]`: `(seq, first_token, first_position, count)` per tile.
        tiles: DevicePtr,
        /// Query tiles (the launch's grid x).
        num_tiles: u32,
        /// Query heads (the launch's grid y).
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
    }
);

kernel_args!(
    /// [`PrefillAttention`] with 128-token query tiles (8 m-tiles of 16 rows, two per warp, sharing
    /// each K and V fragment) and double-buffered keys: the same arguments and tile format, with
    /// `count` in 1..=[`PrefillAttentionV2::TILE_TOKENS`] (128; tiles of up to 64 are valid and
    /// give twice the blocks for short prompts). Its online softmax steps over
    /// [`PrefillAttentionV2::KEY_TILE`] keys, so its bf16 probabilities round against a running
    /// max updated every 16 keys instead of every 64: outputs differ from version 1's by bf16
    /// rounding only. Tiles from [`prefill_attention_tiles_of`] with its tile size.
    PrefillAttentionV2 => names::prefill_attention::PREFILL_ATTENTION_V2_BF16 {
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
    }
);

kernel_args!(
    /// [`PrefillAttentionV2`] on Hopper's warpgroup MMA (wgmma): the same arguments and tiles
    /// (`count` in 1..=[`PrefillAttentionV3::TILE_TOKENS`]), two warpgroups of 64 query rows per
    /// tile, keys in stages of [`PrefillAttentionV3::KEY_TILE`] through a 3-stage shared-memory
    /// ring. Its online softmax steps over 128 keys, so its outputs differ from the other
    /// versions' by bf16 rounding only. Head dim 128 only
    /// ([`PrefillAttentionV3::supports_head_dim`]): for others the kernel writes nothing and
    /// callers keep version 2.
    PrefillAttentionV3 => names::prefill_attention_v3::PREFILL_ATTENTION_V3_BF16 {
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
        /// i32 `[num_tiles, 4]`: `(seq, first_token, first_position, count)` per tile.
        tiles: DevicePtr,
        /// Query tiles (the launch's grid y, at most 65535).
        num_tiles: u32,
        /// Query heads (the launch's grid x).
        q_heads: u32,
        /// Key/value heads (divides `q_heads`).
        kv_heads: u32,
        /// Elements per head: 128.
        head_dim: u32,
        /// Tokens per cache block.
        block_size: u32,
        /// Columns of `block_tables`.
        max_blocks_per_seq: u32,
        /// Score scale (`1 / sqrt(head_dim)`), positive.
        scale: f32,
    }
);

/// The query heads one decode attention block takes of a kv head's group of `whole`: all of them
/// up to 8, else the largest divisor of `whole` up to 8 (attention.cu's `block_group`: 8 for 16,
/// 6 for GLM-4.5's 12).
pub fn paged_attention_block_group(whole: u32) -> u32 {
    if whole <= 8 {
        return whole;
    }
    (1..=8)
        .rev()
        .find(|g| whole.is_multiple_of(*g))
        .unwrap_or(1)
}

/// Blocks of a decode attention launch per token and split: one a kv head, or, where a kv head's
/// query group is wider than 8, one per [`paged_attention_block_group`] of its query heads.
pub fn paged_attention_groups(q_heads: u32, kv_heads: u32) -> u32 {
    let whole = q_heads / kv_heads.max(1);
    q_heads / paged_attention_block_group(whole).max(1)
}

/// Dynamic shared memory of a [`PagedAttention`] launch, in bytes, for query groups of `group`
/// heads (a block takes at most 8 of them): the larger of the 4 warps' rings of 16-key K and V
/// tiles (3 stages, 2 at head_dim 256) and the f32 merge area (each warp's partial output and
/// softmax state, and per-split weights when `splits > 1`). Mirrors attention.cu.
pub fn paged_attention_smem_bytes(group: u32, head_dim: u32, splits: u32) -> u32 {
    paged_attention_smem_bytes_of(4, group, head_dim, splits)
}

/// [`paged_attention_smem_bytes`] for blocks of `warps` warps (8: the wide form,
/// [`PagedAttentionQkv::wide_launch_config`]).
pub fn paged_attention_smem_bytes_of(warps: u32, group: u32, head_dim: u32, splits: u32) -> u32 {
    paged_attention_smem_bytes_for(KvCacheDtype::Bf16, warps, group, head_dim, splits)
}

/// [`paged_attention_smem_bytes_of`] over a cache of `dtype`: the FP8 forms' rings hold e4m3
/// tiles, 4 stages (2 at head_dim 256), and one converted K and V tile per warp. Mirrors
/// attention.cu's `ring_bytes`.
pub fn paged_attention_smem_bytes_for(
    dtype: KvCacheDtype,
    warps: u32,
    group: u32,
    head_dim: u32,
    splits: u32,
) -> u32 {
    const KEY_TILE: u32 = 16;
    // A block takes at most 8 query heads (wider groups take several blocks).
    let group = paged_attention_block_group(group);
    let rings = match (dtype, head_dim >= 256) {
        (KvCacheDtype::Bf16, true) => warps * 2 * 2 * KEY_TILE * head_dim * 2,
        (KvCacheDtype::Bf16, false) => warps * 3 * 2 * KEY_TILE * head_dim * 2,
        (KvCacheDtype::Fp8, true) => warps * (2 * 2 + 4) * KEY_TILE * head_dim,
        (KvCacheDtype::Fp8, false) => warps * (4 * 2 + 4) * KEY_TILE * head_dim,
    };
    let weights = if splits > 1 { group * splits } else { 0 };
    let merge = (warps * group * head_dim + 2 * warps * group + weights) * 4;
    rings.max(merge)
}

/// Keys per split and splits for a [`PagedAttention`] launch of `tokens` query tokens over
/// `q_heads` query and `kv_heads` kv heads whose longest context is `max_context` keys, given room
/// for `max_partials` partials (one per token, query head and split): split into as many pieces
/// as keep the launch at or under `target_blocks` blocks (one per token, kv head and split; at
/// least one split), never beyond the partials' room. The shape is bucketed, so that one launch shape (and one captured decode graph) serves a
/// whole range of context lengths: the split count is at most the context's 64-key pieces rounded
/// up to a power of two, and the keys per split is a power of two, at least 64. So the shape
/// changes only where the context doubles, and a launch may carry more splits than its context
/// fills (fewer than half of them empty, which the kernel passes over). A context of at most
/// [`ATTENTION_UNSPLIT_KEYS`] keys is not split. One split is `(0, 1)`: the whole context.
pub fn attention_splits(
    tokens: u32,
    q_heads: u32,
    kv_heads: u32,
    max_context: u32,
    max_partials: u32,
    target_blocks: u32,
) -> (u32, u32) {
    attention_splits_of(
        tokens,
        q_heads,
        kv_heads,
        max_context,
        max_partials,
        target_blocks,
        ATTENTION_SPLIT_KEYS,
        ATTENTION_UNSPLIT_KEYS,
    )
}

/// The fewest keys a split of [`attention_splits`] takes: 64, one 16-key tile per warp.
pub const ATTENTION_SPLIT_KEYS: u32 = 64;

/// The longest context [`attention_splits`] leaves in one piece: 256 keys. Up to there a split's
/// partials round trip and merge cost more than its extra blocks bring. On the H200, splits of at
/// least 256 keys (one split up to 256 keys) against 64: Qwen3-8B's decode step at 160 keys 4.83
/// -> 4.76 ms at batch 1 and 5.18 -> 5.04 ms at batch 8, Qwen3-0.6B's 32 + 256-token generation
/// 1129 -> 1157 tok/s; but Qwen3-0.6B's step at 1k keys 0.94 -> 1.01 ms, so longer contexts keep
/// 64-key splits (docs/results/2026-12-01-speed-h200/decode-defaults).
pub const ATTENTION_UNSPLIT_KEYS: u32 = 256;

/// [`attention_splits`] with at least `split_keys` keys per split (a power of two, at least 64;
/// other values are rounded up to one): the context's pieces are `split_keys` long. Longer splits
/// give each warp several tiles in flight and fewer splits to merge, at fewer blocks; a context of
/// at most `split_keys` or `unsplit_keys` keys is not split (no partials, no merge). `unsplit_keys`
/// is rounded up to a power of two, so the shape still changes only where the context doubles.
#[allow(clippy::too_many_arguments)]
pub fn attention_splits_of(
    tokens: u32,
    q_heads: u32,
    kv_heads: u32,
    max_context: u32,
    max_partials: u32,
    target_blocks: u32,
    split_keys: u32,
    unsplit_keys: u32,
) -> (u32, u32) {
    // Rounded up to a power of two, saturating (a value past 2^31 leaves every context whole,
    // or takes splits of 2^31 keys).
    let pow2 = |x: u32| x.checked_next_power_of_two().unwrap_or(1 << 31);
    if unsplit_keys > 0 && (unsplit_keys > 1 << 31 || max_context <= pow2(unsplit_keys)) {
        return (0, 1);
    }
    let split_keys = pow2(split_keys.max(ATTENTION_SPLIT_KEYS));
    let blocks = (tokens * paged_attention_groups(q_heads, kv_heads)).max(1);
    // Rounded down: a split that leaves fewer blocks than the target is never added (at
    // Qwen3-8B batch 32, 256 (token, kv head) pairs, two splits were 4% slower than one on the
    // H200; docs/results/2026-12-01-speed-h200/ab-fused-qkv-attention).
    let want = (target_blocks / blocks).max(1);
    let by_len = max_context.div_ceil(split_keys).max(1).next_power_of_two();
    let room = max_partials / (tokens * q_heads).max(1);
    let splits = want.min(by_len).min(room).max(1);
    if splits == 1 {
        return (0, 1);
    }
    let per = max_context
        .div_ceil(splits)
        .next_power_of_two()
        .max(split_keys);
    (per, splits)
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

/// Most splits [`AttentionCombine`] merges (its per-split weights live in shared memory).
pub const MAX_COMBINE_SPLITS: u32 = 1024;

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
        if self.splits > MAX_COMBINE_SPLITS {
            return Err(HostError::BadArgs {
                kernel: Self::NAME,
                message: format!(
                    "{} splits; the combine takes at most {MAX_COMBINE_SPLITS}",
                    self.splits
                ),
            });
        }
        let parts = host::load::<f32>(mem, self.partials, rows * z * (d + 2))?;
        host::store_bf16(mem, self.out, &combine(&parts, rows, d, z))
    }
}

/// Merges `rows` rows of `z` split partials `(acc[d], m, l)` each into normalised outputs:
/// `sum_z acc_z e^(m_z - M) / sum_z l_z e^(m_z - M)` over the splits with `l_z > 0`.
fn combine(parts: &[f32], rows: usize, d: usize, z: usize) -> Vec<f32> {
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
    out
}

/// One sequence's keys and values of one kv head, read through its block table.
struct SeqKv<'a> {
    k_cache: &'a [bf16],
    v_cache: &'a [bf16],
    table: &'a [i32],
    block_size: usize,
    /// Elements per cache slot: `kv_heads * head_dim`.
    row: usize,
    /// Offset of the kv head in a slot: `kv_head * head_dim`.
    head: usize,
    head_dim: usize,
}

impl SeqKv<'_> {
    /// Element offset of key `j`'s row.
    fn slot(&self, j: usize) -> usize {
        (self.table[j / self.block_size] as usize * self.block_size + j % self.block_size)
            * self.row
            + self.head
    }

    /// Key `j`'s row.
    fn key(&self, j: usize) -> &[bf16] {
        &self.k_cache[self.slot(j)..][..self.head_dim]
    }

    /// Value `j`'s row.
    fn value(&self, j: usize) -> &[bf16] {
        &self.v_cache[self.slot(j)..][..self.head_dim]
    }

    /// The raw (unscaled) dot product of query `qv` with key `j`, summed in f32 in order.
    fn dot(&self, qv: &[f32], j: usize) -> f32 {
        qv.iter().zip(self.key(j)).map(|(a, b)| a * widen(*b)).sum()
    }

    /// Attention of query `qv` over `keys`, all f32: the unnormalised weighted sum of the values,
    /// the largest scaled score and the sum of `exp(score - max)` (zeros, `-inf` and 0 for no
    /// keys). `scores` is scratch.
    fn attend(
        &self,
        qv: &[f32],
        keys: std::ops::Range<usize>,
        scale: f32,
        scores: &mut Vec<f32>,
    ) -> (Vec<f32>, f32, f32) {
        let d = self.head_dim;
        scores.clear();
        for j in keys.clone() {
            scores.push(self.dot(qv, j) * scale);
        }
        let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut total = 0f32;
        for s in scores.iter_mut() {
            *s = (*s - max).exp();
            total += *s;
        }
        let mut acc = vec![0f32; d];
        for (j, p) in keys.zip(scores.iter()) {
            let v = self.value(j);
            for (a, x) in acc.iter_mut().zip(v) {
                *a += p * widen(*x);
            }
        }
        (acc, max, total)
    }

    /// Per element of [`attend`](Self::attend)'s split partial (the `head_dim` weighted sums, the
    /// max, the sum), how far a correct decode attention kernel can stray from it:
    /// - the kernel rounds each probability to f16 before it weights its value (relative error
    ///   at most 2^-11, whatever running max it was taken against; below f16's normal range the
    ///   error is absolute, at most 2^-25, which the comparison's floor covers), so a weighted
    ///   sum may move by up to 2^-11 of `sum_j p_j |v_j|`;
    /// - `q_flip` (per element of `qv`, zero for most) is one bf16 ulp where the query came out
    ///   of an f32 computation within a hair of a bf16 rounding boundary (the fused form's
    ///   normalised, rotated queries), which the GPU may round the other way: key `j`'s score
    ///   then moves by up to `ds_j = scale * sum_i q_flip_i |k_ji|`, the max by up to
    ///   `D = max_j ds_j`, and each probability relative to the max by a factor within
    ///   `e^(+-(ds_j + D))`;
    /// - `newest` (the fused form): the key at that position, which the kernel rounds from its
    ///   own f32 values, with one bf16 ulp per element near a rounding boundary; its score moves
    ///   by up to `scale * sum_i |q_i| k_flip_i` more.
    ///
    /// Both together: `p_j` may end up anywhere within `p_j * [1 - g_j, 1 + g_j]` with
    /// `g_j = (1 + 2^-11) e^(ds_j + D) - 1`; the sums' bounds are `sum_j p_j |v_j| g_j` and
    /// `sum_j p_j g_j`, the max's `D`. The f32 summation order is left to the comparison's
    /// relative tolerance.
    fn attend_allowance(
        &self,
        qv: &[f32],
        q_flip: &[f32],
        newest: Option<(usize, &[f32])>,
        keys: std::ops::Range<usize>,
        scale: f32,
    ) -> Vec<f32> {
        let d = self.head_dim;
        let mut scores = Vec::with_capacity(keys.len());
        let mut shifts = Vec::with_capacity(keys.len());
        for j in keys.clone() {
            scores.push(self.dot(qv, j) * scale);
            let mut shift = q_flip
                .iter()
                .zip(self.key(j))
                .map(|(f, b)| f * widen(*b).abs())
                .sum::<f32>();
            // The newest key, which the fused kernel rounds from its own f32 values: each of its
            // elements near a bf16 boundary may differ by its flip from the cache's.
            if let Some((_, k_flip)) = newest.filter(|&(at, _)| at == j) {
                shift += qv.iter().zip(k_flip).map(|(q, f)| q.abs() * f).sum::<f32>();
            }
            shifts.push(shift * scale);
        }
        let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let max_shift = shifts.iter().copied().fold(0f32, f32::max);
        let mut bound = vec![0f32; d + 2];
        for ((j, s), shift) in keys.zip(&scores).zip(&shifts) {
            let p = (s - max).exp();
            let g = (1.0 + F16_PROBABILITY_ROUNDING) * (shift + max_shift).exp() - 1.0;
            let v = self.value(j);
            for (b, x) in bound.iter_mut().zip(v) {
                *b += p * widen(*x).abs() * g;
            }
            bound[d + 1] += p * g;
        }
        bound[d] = max_shift;
        bound
    }

    /// Attention of query `qv` over keys `0..ctx` as the tensor-core prefill kernels compute it:
    /// keys in tiles of `tile` (the kernel's online-softmax step) from key 0, a running max
    /// updated per tile, each probability rounded to bf16 before it weights its value and before
    /// it joins the row sum. Returns the normalised f32 output and, per element, its
    /// [rounding allowance](PrefillRow::allowance).
    fn attend_tiled(
        &self,
        qv: &[f32],
        ctx: usize,
        tile: usize,
        scale: f32,
        scores: &mut Vec<f32>,
    ) -> (Vec<f32>, Vec<f32>) {
        let d = self.head_dim;
        // The keys whose probability sat near a bf16 rounding boundary: (key, the size of a flip
        // in the probability, the running max it was taken against).
        let mut near = Vec::new();
        // The kernel's arithmetic: raw dot products, the max kept in log2 units
        // (max dot * scale * log2 e) and p = 2^(dot * scale * log2 e - max) with a fused
        // multiply-add, so that a probability lands on the same side of a bf16 rounding boundary
        // as on the GPU far more often than with e^(dot * scale - max).
        let scale_log2 = scale * std::f32::consts::LOG2_E;
        let (mut max, mut total) = (f32::NEG_INFINITY, 0f32);
        let mut acc = vec![0f32; d];
        for start in (0..ctx).step_by(tile) {
            let keys = start..(start + tile).min(ctx);
            scores.clear();
            for j in keys.clone() {
                scores.push(self.dot(qv, j));
            }
            let tile_max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let new_max = max.max(tile_max * scale_log2);
            let corr = (max - new_max).exp2();
            total *= corr;
            acc.iter_mut().for_each(|a| *a *= corr);
            for (j, s) in keys.zip(scores.iter()) {
                let exact = s.mul_add(scale_log2, -new_max).exp2();
                if let Some(flip) = bf16_flip(exact) {
                    near.push((j, flip, new_max));
                }
                let p = widen(bf16::from_f32(exact));
                total += p;
                let v = self.value(j);
                for (a, x) in acc.iter_mut().zip(v) {
                    *a += p * widen(*x);
                }
            }
            max = new_max;
        }
        let out: Vec<f32> = acc.iter().map(|a| a / total).collect();
        // A flip of key j's probability by f (taken against running max m_j, so weighing
        // f * 2^(m_j - max) in the end) moves the output by that weight times (v_j - out) / total,
        // to first order; every near key flipping together bounds what a correct kernel can do.
        let mut allowance = vec![0f32; d];
        for (j, flip, m) in near {
            let w = flip * (m - max).exp2() / total;
            let v = self.value(j);
            for ((a, x), o) in allowance.iter_mut().zip(v).zip(&out) {
                *a += w * (widen(*x) - o).abs();
            }
        }
        (out, allowance)
    }
}

/// The decode attention's rounding of a probability to f16: at most half an ulp of its 11-bit
/// significand, relative.
const F16_PROBABILITY_ROUNDING: f32 = 1.0 / 2048.0;

/// How close, in f32 ulps, a probability may sit to a bf16 rounding boundary before the GPU may
/// round it the other way: its dot product (in another summation order) and its 2^x (ex2.approx,
/// within 2 ulps) differ from the host's in the last few bits; 2^10 ulps (1.2e-4 relative) is a
/// margin far above that, which flags about 3% of the probabilities.
const BF16_FLIP_MARGIN_ULPS: u32 = 1 << 10;

/// If `p` (a non-negative f32 about to be rounded to bf16) lies within [`BF16_FLIP_MARGIN_ULPS`]
/// of a bf16 rounding boundary: how much its bf16 value changes when it rounds the other way (one
/// bf16 ulp at its magnitude).
fn bf16_flip(p: f32) -> Option<f32> {
    bf16_flip_within(p, BF16_FLIP_MARGIN_ULPS)
}

/// How close, in f32 ulps, a query or new key element may sit to a bf16 rounding boundary before
/// the fused decode attention may round it the other way: the GPU computes the host's
/// normalisation and rotation in f32 in another summation order with an approximate reciprocal
/// square root (within 2 ulps), so its values differ from the host's in the last few bits; 64
/// ulps is far above that and flags about 0.2% of the elements (each flag widens its head's
/// allowance). Not a strict bound: where the rotation's `x cos - y sin` nearly cancels, the two
/// sides can differ by more ulps of the (small) result, but a flip of a small value is a small
/// step, below what the comparison's floor already allows.
const Q_FLIP_MARGIN_ULPS: u32 = 64;

/// One bf16 ulp of `x` where the fused decode attention may round this query or new key element
/// (f32) to the other bf16 neighbour ([`Q_FLIP_MARGIN_ULPS`]), else 0.
pub(crate) fn q_flip(x: f32) -> f32 {
    bf16_flip_within(x.abs(), Q_FLIP_MARGIN_ULPS).unwrap_or(0.0)
}

/// [`bf16_flip`] with a margin of `margin` f32 ulps.
fn bf16_flip_within(p: f32, margin: u32) -> Option<f32> {
    let bits = p.to_bits();
    let from_boundary = (bits & 0xffff).abs_diff(0x8000);
    (p.is_normal() && from_boundary < margin).then(|| f32::from_bits(bits & 0x7f80_0000) / 128.0)
}

impl Kernel for PagedAttention {
    fn launch_config(&self) -> LaunchConfig {
        // One block per (token, kv head, split) serves the kv head's whole query group; its
        // shared memory holds each warp's ring of key/value tiles, which the merge of the 4
        // warps' partial outputs and softmax state reuses (attention.cu).
        let bytes = paged_attention_smem_bytes(
            self.q_heads / self.kv_heads.max(1),
            self.head_dim,
            self.splits,
        );
        LaunchConfig {
            grid: [
                self.tokens,
                paged_attention_groups(self.q_heads, self.kv_heads),
                self.splits,
            ],
            block: [128, 1, 1],
            shared_mem_bytes: bytes,
        }
    }
    fn reference(&self, mem: &mut dyn HostMemory) -> Result<(), HostError> {
        self.check_group(Self::NAME)?;
        let n = (self.tokens * self.q_heads * self.head_dim) as usize;
        let q = host::load_bf16(mem, self.q, n)?;
        self.attend_host(&q, mem, Self::NAME, CacheRead::Bf16)
    }
}

impl PagedAttention {
    pub(crate) fn check_group(&self, kernel: metrale_core::KernelName) -> Result<(), HostError> {
        let (qh, kvh) = (self.q_heads, self.kv_heads);
        if kvh == 0 || qh % kvh != 0 {
            return Err(HostError::BadArgs {
                kernel,
                message: format!("q_heads {qh} is not a multiple of kv_heads {kvh}"),
            });
        }
        Ok(())
    }

    /// The reference with the queries given (`[tokens, q_heads * head_dim]`, f32 holding bf16
    /// values) instead of read from `q`; errors name `kernel`.
    pub(crate) fn attend_host(
        &self,
        q: &[f32],
        mem: &mut dyn HostMemory,
        kernel: metrale_core::KernelName,
        cache: CacheRead,
    ) -> Result<(), HostError> {
        let outputs = self.attend_splits(q, None, mem, kernel, cache)?;
        if self.splits > 1 {
            host::store(mem, self.partials, &outputs.parts)?;
        }
        host::store_bf16(mem, self.out, &outputs.out)
    }

    /// Per element of `partials` (`[tokens, q_heads, splits, head_dim + 2]`), or with one split
    /// of the bf16 output (`[tokens, q_heads * head_dim]`, before its rounding), how far a correct
    /// kernel's value can stray from the reference's: see `SeqKv::attend_allowance`. `q` as [`attend_host`](Self::attend_host) takes it, `q_flip`
    /// per query element one bf16 ulp where the GPU may round it the other way (zeros where the
    /// queries are an input), `key_flip` per token the same for the key it writes at its
    /// position (`[kv_heads * head_dim]`; empty, or no entry, where the kernel writes none).
    pub fn allowance(
        &self,
        q: &[f32],
        q_flip: &[f32],
        key_flip: &[Vec<f32>],
        mem: &dyn HostMemory,
    ) -> Result<Vec<f32>, HostError> {
        self.allowance_over(CacheRead::Bf16, q, q_flip, key_flip, mem)
    }

    /// [`allowance`](Self::allowance) over a cache read as `cache` (`key_flip` in the units the
    /// cache holds: raw e4m3 values for an FP8 cache).
    pub(crate) fn allowance_over(
        &self,
        cache: CacheRead,
        q: &[f32],
        q_flip: &[f32],
        key_flip: &[Vec<f32>],
        mem: &dyn HostMemory,
    ) -> Result<Vec<f32>, HostError> {
        let flips = Flips {
            q: q_flip,
            newest_key: key_flip,
        };
        Ok(self
            .attend_splits(q, Some(flips), mem, Self::NAME, cache)?
            .allowance)
    }

    /// The reference's outputs without storing them, and given `flips` the comparison's
    /// allowance ([`allowance`](PagedAttention::allowance)).
    fn attend_splits(
        &self,
        q: &[f32],
        flips: Option<Flips>,
        mem: &dyn HostMemory,
        kernel: metrale_core::KernelName,
        cache: CacheRead,
    ) -> Result<SplitOutputs, HostError> {
        let (t_n, qh, kvh, d) = (
            self.tokens as usize,
            self.q_heads as usize,
            self.kv_heads as usize,
            self.head_dim as usize,
        );
        let (bs, maxb) = (self.block_size as usize, self.max_blocks_per_seq as usize);
        let bad = |message: String| HostError::BadArgs { kernel, message };
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
        let (k_cache, v_cache) = cache.load(mem, self.k_cache, self.v_cache, blocks * bs * row)?;
        // An FP8 cache holds e4m3(k / k_scale), e4m3(v / v_scale): the raw values (exact in bf16)
        // are the keys and values, k_scale joins the score scale, v_scale scales the sums.
        let (score_scale, v_scale) = match cache {
            CacheRead::Bf16 => (self.scale, 1.0),
            CacheRead::Fp8 { k_scale, v_scale } => (self.scale * k_scale, v_scale),
        };
        if !matches!(d, 64 | 128 | 256) {
            return Err(bad(format!("head_dim {d} is not 64, 128 or 256")));
        }
        let (z, per) = (self.splits.max(1) as usize, self.keys_per_split as usize);
        let mut out = vec![0f32; t_n * qh * d];
        let mut parts = vec![0f32; if z > 1 { t_n * qh * z * (d + 2) } else { 0 }];
        // Given flips: the partials' allowance, or with one split the output's.
        let allowance_len = match (flips.is_some(), z > 1) {
            (false, _) => 0,
            (true, true) => parts.len(),
            (true, false) => out.len(),
        };
        let mut allowance = vec![0f32; allowance_len];
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
            for h in 0..qh {
                let kv = SeqKv {
                    k_cache: &k_cache,
                    v_cache: &v_cache,
                    table: &tables[seq * maxb..(seq + 1) * maxb],
                    block_size: bs,
                    row,
                    head: h / (qh / kvh) * d,
                    head_dim: d,
                };
                let qv = &q[(t * qh + h) * d..][..d];
                for split in 0..z {
                    let keys = if z == 1 {
                        0..ctx
                    } else {
                        (split * per).min(ctx)..((split + 1) * per).min(ctx)
                    };
                    let bound = flips.map(|f| {
                        let q_flip = &f.q[(t * qh + h) * d..][..d];
                        let newest = f
                            .newest_key
                            .get(t)
                            .filter(|k| !k.is_empty())
                            .map(|k| (pos as usize, &k[kv.head..][..d]));
                        let mut b =
                            kv.attend_allowance(qv, q_flip, newest, keys.clone(), score_scale);
                        b[..d].iter_mut().for_each(|x| *x *= v_scale);
                        b
                    });
                    if let (Some(bound), true) = (&bound, z > 1) {
                        allowance[((t * qh + h) * z + split) * (d + 2)..][..d + 2]
                            .copy_from_slice(bound);
                    }
                    let (mut acc, max, total) = kv.attend(qv, keys, score_scale, &mut scores);
                    if v_scale != 1.0 {
                        acc.iter_mut().for_each(|a| *a *= v_scale);
                    }
                    if z == 1 {
                        let o = &mut out[(t * qh + h) * d..][..d];
                        for (o, a) in o.iter_mut().zip(&acc) {
                            *o = a / total;
                        }
                        // out = acc / l: each weighted sum may move by its bound and the sum
                        // by its own, so the quotient by (bound_i + |out_i| bound_l) / l (to
                        // first order; the bounds are far below l).
                        if let Some(bound) = &bound {
                            let at = &mut allowance[(t * qh + h) * d..][..d];
                            for ((a, b), o) in at.iter_mut().zip(bound).zip(o.iter()) {
                                *a = (b + o.abs() * bound[d + 1]) / total;
                            }
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
        if z > 1 {
            out = combine(&parts, t_n * qh, d, z);
        }
        Ok(SplitOutputs {
            out,
            parts,
            allowance,
        })
    }
}

/// How the decode attention's reference reads the paged cache.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum CacheRead {
    /// bf16 elements.
    Bf16,
    /// e4m3 elements holding `k / k_scale` and `v / v_scale` (`metrale_core::fp8`).
    Fp8 {
        /// The keys' per-tensor scale.
        k_scale: f32,
        /// The values' per-tensor scale.
        v_scale: f32,
    },
}

impl CacheRead {
    /// Both caches' first `n` elements as bf16: borrowed for a bf16 cache, the raw e4m3 values
    /// (exact in bf16, unscaled) for an FP8 one.
    #[allow(clippy::type_complexity)]
    fn load<'m>(
        self,
        mem: &'m dyn HostMemory,
        k: DevicePtr,
        v: DevicePtr,
        n: usize,
    ) -> Result<(std::borrow::Cow<'m, [bf16]>, std::borrow::Cow<'m, [bf16]>), HostError> {
        match self {
            CacheRead::Bf16 => Ok((
                host::view::<bf16>(mem, k, n)?,
                host::view::<bf16>(mem, v, n)?,
            )),
            CacheRead::Fp8 { .. } => {
                let decode = |p: DevicePtr| -> Result<Vec<bf16>, HostError> {
                    Ok(mem
                        .bytes(p, n)?
                        .iter()
                        .map(|&b| bf16::from_f32(metrale_core::fp8::e4m3_to_f32(b)))
                        .collect())
                };
                Ok((decode(k)?.into(), decode(v)?.into()))
            }
        }
    }
}

/// The rounding freedom [`PagedAttention::attend_splits`] bounds: per query element and per
/// token's newest key element, one bf16 ulp where the GPU may round the other way, else zero.
#[derive(Clone, Copy)]
struct Flips<'a> {
    q: &'a [f32],
    newest_key: &'a [Vec<f32>],
}

/// [`PagedAttention::attend_splits`]'s results.
struct SplitOutputs {
    /// The f32 outputs before their bf16 rounding.
    out: Vec<f32>,
    /// The split partials, merged into `out` (empty for one split).
    parts: Vec<f32>,
    /// Given `q_flip`, the partials' allowance
    /// ([`allowance`](PagedAttention::allowance)), or with one split the bf16
    /// output's; else empty.
    allowance: Vec<f32>,
}

impl PrefillAttention {
    /// Most query tokens in one tile (the kernel's 4 warps of 16 rows).
    pub const TILE_TOKENS: u32 = 64;
    /// Keys per online-softmax step (the kernel's shared-memory key tile).
    pub const KEY_TILE: u32 = 64;

    /// Whether the kernel covers this head dimension (64 and 128; callers keep
    /// [`PagedAttention`] for the others).
    pub const fn supports_head_dim(head_dim: u32) -> bool {
        matches!(head_dim, 64 | 128)
    }
}

impl PrefillAttentionV2 {
    /// Most query tokens in one tile (the kernel's 4 warps of two 16-row m-tiles).
    pub const TILE_TOKENS: u32 = 128;
    /// Keys per online-softmax step (half the kernel's 32-key shared-memory tile).
    pub const KEY_TILE: u32 = 16;

    /// Whether the kernel covers this head dimension (64 and 128; callers keep
    /// [`PagedAttention`] for the others).
    pub const fn supports_head_dim(head_dim: u32) -> bool {
        matches!(head_dim, 64 | 128)
    }
}

impl PrefillAttentionV3 {
    /// Most query tokens in one tile (the kernel's 2 warpgroups of 64 rows).
    pub const TILE_TOKENS: u32 = 128;
    /// Keys per online-softmax step (the kernel's shared-memory key tile).
    pub const KEY_TILE: u32 = 128;
    /// Dynamic shared memory of a launch: q (128 x 128 bf16) and 3 stages of a K and a V tile
    /// (128 x 128 bf16 each), plus 1 KiB for aligning the swizzle atoms. Mirrors
    /// prefill_attention_v3.cu.
    pub const SMEM_BYTES: u32 = 128 * 128 * 2 + 3 * 2 * 128 * 128 * 2 + 1024;

    /// Whether the kernel covers this head dimension (128 only; callers keep
    /// [`PrefillAttentionV2`] for the others).
    pub const fn supports_head_dim(head_dim: u32) -> bool {
        head_dim == 128
    }
}

/// The query tiles of [`PrefillAttention`] for a step's tokens (`token_seq[t]`, `positions[t]`),
/// [`PrefillAttention::TILE_TOKENS`] tokens at most: [`prefill_attention_tiles_of`].
pub fn prefill_attention_tiles(token_seq: &[i32], positions: &[i32]) -> Vec<[i32; 4]> {
    prefill_attention_tiles_of(token_seq, positions, PrefillAttention::TILE_TOKENS)
}

/// The query tiles of a step's tokens (`token_seq[t]`, `positions[t]`): runs of consecutive tokens
/// of one sequence at consecutive positions, cut every `tile_tokens` tokens, as
/// `(seq, first_token, first_position, count)`. A decode token is a tile of one. Never more tiles
/// than tokens. `tile_tokens` is at most the kernel's `TILE_TOKENS`
/// ([`PrefillAttention::TILE_TOKENS`], [`PrefillAttentionV2::TILE_TOKENS`]).
pub fn prefill_attention_tiles_of(
    token_seq: &[i32],
    positions: &[i32],
    tile_tokens: u32,
) -> Vec<[i32; 4]> {
    let mut tiles: Vec<[i32; 4]> = Vec::new();
    for (t, (&seq, &pos)) in token_seq.iter().zip(positions).enumerate() {
        if let Some([s, _, first, count]) = tiles.last_mut()
            && *s == seq
            && *first + *count == pos
            && (*count as u32) < tile_tokens
        {
            *count += 1;
            continue;
        }
        tiles.push([seq, t as i32, pos, 1]);
    }
    tiles
}

/// `From` between the prefill attention versions' arguments, which are the same fields (each
/// version brings its own launch geometry and reference steps with its type).
macro_rules! same_prefill_args {
    ($($from:ident => $to:ident),* $(,)?) => {$(
        impl From<$from> for $to {
            fn from(a: $from) -> Self {
                $to {
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
                }
            }
        }
    )*};
}

same_prefill_args!(
    PrefillAttention => PrefillAttentionV2,
    PrefillAttention => PrefillAttentionV3,
    PrefillAttentionV2 => PrefillAttention,
    PrefillAttentionV3 => PrefillAttention,
);

impl Kernel for PrefillAttentionV3 {
    fn launch_config(&self) -> LaunchConfig {
        LaunchConfig {
            // As version 2: heads fastest, one block for an empty launch.
            grid: [self.q_heads, self.num_tiles.max(1), 1],
            block: [256, 1, 1],
            shared_mem_bytes: Self::SMEM_BYTES,
        }
    }
    fn reference(&self, mem: &mut dyn HostMemory) -> Result<(), HostError> {
        if !Self::supports_head_dim(self.head_dim) {
            return Err(HostError::BadArgs {
                kernel: Self::NAME,
                message: format!(
                    "head_dim {} is not 128 (use prefill attention version 2)",
                    self.head_dim
                ),
            });
        }
        prefill_reference(
            &PrefillAttention::from(*self),
            Self::NAME,
            Self::TILE_TOKENS,
            Self::KEY_TILE,
            mem,
        )
    }
}

impl Kernel for PrefillAttention {
    fn launch_config(&self) -> LaunchConfig {
        LaunchConfig {
            // One block for an empty launch, which returns at once (a zero grid is a driver error).
            grid: [self.num_tiles.max(1), self.q_heads, 1],
            block: [128, 1, 1],
            shared_mem_bytes: 0,
        }
    }
    fn reference(&self, mem: &mut dyn HostMemory) -> Result<(), HostError> {
        prefill_reference(self, Self::NAME, Self::TILE_TOKENS, Self::KEY_TILE, mem)
    }
}

impl Kernel for PrefillAttentionV2 {
    fn launch_config(&self) -> LaunchConfig {
        LaunchConfig {
            // Heads fastest, so that blocks resident together read the same keys; one block for
            // an empty launch, which returns at once (a zero grid is a driver error).
            grid: [self.q_heads, self.num_tiles.max(1), 1],
            block: [128, 1, 1],
            shared_mem_bytes: 0,
        }
    }
    fn reference(&self, mem: &mut dyn HostMemory) -> Result<(), HostError> {
        // The same arguments as version 1's, read with its own tile and key-tile sizes.
        let args = PrefillAttention::from(*self);
        prefill_reference(&args, Self::NAME, Self::TILE_TOKENS, Self::KEY_TILE, mem)
    }
}

/// The host reference of the prefill attention kernels: `kernel` (for errors) takes tiles of up
/// to `tile_tokens` tokens and steps its online softmax over `key_tile` keys.
pub(crate) fn prefill_reference(
    k: &PrefillAttention,
    kernel: metrale_core::KernelName,
    tile_tokens: u32,
    key_tile: u32,
    mem: &mut dyn HostMemory,
) -> Result<(), HostError> {
    prefill_reference_over(k, kernel, tile_tokens, key_tile, mem, CacheRead::Bf16)
}

/// [`prefill_reference`] over a cache read as `cache` (an FP8 cache: the raw e4m3 values with
/// the score scale times `k_scale` and the outputs times `v_scale`).
pub(crate) fn prefill_reference_over(
    k: &PrefillAttention,
    kernel: metrale_core::KernelName,
    tile_tokens: u32,
    key_tile: u32,
    mem: &mut dyn HostMemory,
    cache: CacheRead,
) -> Result<(), HostError> {
    let (qh, kvh, d) = (k.q_heads as usize, k.kv_heads as usize, k.head_dim as usize);
    let (bs, maxb) = (k.block_size as usize, k.max_blocks_per_seq as usize);
    let bad = |message: String| HostError::BadArgs { kernel, message };
    if kvh == 0 || qh % kvh != 0 {
        return Err(bad(format!(
            "q_heads {qh} is not a multiple of kv_heads {kvh}"
        )));
    }
    if !PrefillAttention::supports_head_dim(k.head_dim) {
        return Err(bad(format!(
            "head_dim {d} is not 64 or 128 (use paged attention)"
        )));
    }
    let tiles = host::load::<i32>(mem, k.tiles, 4 * k.num_tiles as usize)?;
    let tiles: Vec<[i32; 4]> = tiles
        .chunks_exact(4)
        .map(|c| [c[0], c[1], c[2], c[3]])
        .collect();
    for (i, &[seq, first, pos, count]) in tiles.iter().enumerate() {
        if seq < 0 || first < 0 || pos < 0 || !(1..=tile_tokens as i32).contains(&count) {
            return Err(bad(format!(
                "tile {i} (seq {seq}, first token {first}, first position {pos}, count \
                 {count}) is not a tile of 1..={tile_tokens} tokens"
            )));
        }
        if (pos + count) as usize > maxb * bs {
            return Err(bad(format!(
                "tile {i} reaches position {}, outside its block table of {maxb} blocks",
                pos + count - 1
            )));
        }
    }
    let tokens = tiles
        .iter()
        .map(|t| (t[1] + t[3]) as usize)
        .max()
        .unwrap_or(0);
    let seqs = tiles.iter().map(|t| t[0] as usize + 1).max().unwrap_or(0);
    let q = host::load_bf16(mem, k.q, tokens * qh * d)?;
    let tables = host::load::<i32>(mem, k.block_tables, seqs * maxb)?;
    let blocks = tables
        .iter()
        .map(|&b| b.max(0) as usize + 1)
        .max()
        .unwrap_or(0);
    let row = kvh * d;
    let (k_cache, v_cache) = cache.load(mem, k.k_cache, k.v_cache, blocks * bs * row)?;
    let (scaled, v_scale) = match cache {
        CacheRead::Bf16 => (*k, 1.0),
        CacheRead::Fp8 { k_scale, v_scale } => (
            PrefillAttention {
                scale: k.scale * k_scale,
                ..*k
            },
            v_scale,
        ),
    };
    let rows = prefill_attention_rows(&scaled, key_tile, &tiles, &q, &tables, &k_cache, &v_cache);
    drop((k_cache, v_cache));
    for PrefillRow { token, mut out, .. } in rows {
        if v_scale != 1.0 {
            out.iter_mut().for_each(|x| *x *= v_scale);
        }
        host::store_bf16(mem, k.out.offset(token * qh * d * 2), &out)?;
    }
    Ok(())
}

/// One token's row of the prefill attention reference ([`prefill_attention_rows`]).
#[derive(Clone, Debug)]
pub struct PrefillRow {
    /// The token: the row of `out` it belongs in.
    pub token: usize,
    /// Its `q_heads * head_dim` outputs before the bf16 store.
    pub out: Vec<f32>,
    /// Per output, how far a correct kernel can stray from it: a probability within a hair of a
    /// bf16 rounding boundary may round the other way on the GPU (whose scores and 2^x differ from
    /// the host's in the last bits), which moves the outputs of its row by up to one bf16 ulp of
    /// the probability times the value's distance from the output, over the row's sum. This is
    /// that bound summed over the row's near-boundary probabilities; zero for most rows.
    pub allowance: Vec<f32>,
}

/// The host reference of the prefill attention kernels on host data: every token named by
/// `tiles` (`(seq, first_token, first_position, count)`, as the kernels take them), its keys
/// stepped through in tiles of `key_tile` (the kernel's online-softmax step). `q` is
/// `[tokens, q_heads * head_dim]`, `block_tables` `[seqs, max_blocks_per_seq]`, the caches as the
/// kernels read them; `k`'s pointers are not used.
///
/// # Panics
/// If the tiles name tokens, sequences or positions outside the slices (the kernels' reference
/// checks them first).
pub fn prefill_attention_rows(
    k: &PrefillAttention,
    key_tile: u32,
    tiles: &[[i32; 4]],
    q: &[f32],
    block_tables: &[i32],
    k_cache: &[bf16],
    v_cache: &[bf16],
) -> Vec<PrefillRow> {
    let (qh, kvh, d) = (k.q_heads as usize, k.kv_heads as usize, k.head_dim as usize);
    let (bs, maxb) = (k.block_size as usize, k.max_blocks_per_seq as usize);
    let mut rows = Vec::new();
    let mut scores = Vec::new();
    for &[seq, first, pos, count] in tiles {
        let (seq, first, pos) = (seq as usize, first as usize, pos as usize);
        for i in 0..count as usize {
            let token = first + i;
            let mut out = vec![0f32; qh * d];
            let mut allowance = vec![0f32; qh * d];
            for h in 0..qh {
                let kv = SeqKv {
                    k_cache,
                    v_cache,
                    table: &block_tables[seq * maxb..(seq + 1) * maxb],
                    block_size: bs,
                    row: kvh * d,
                    head: h / (qh / kvh) * d,
                    head_dim: d,
                };
                let qv = &q[(token * qh + h) * d..][..d];
                let (o, a) =
                    kv.attend_tiled(qv, pos + i + 1, key_tile as usize, k.scale, &mut scores);
                out[h * d..][..d].copy_from_slice(&o);
                allowance[h * d..][..d].copy_from_slice(&a);
            }
            rows.push(PrefillRow {
                token,
                out,
                allowance,
            });
        }
    }
    rows
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
    fn a_block_takes_the_largest_divisor_of_its_group_up_to_8() {
        for (whole, block) in [
            (1, 1),
            (7, 7),
            (8, 8),
            (9, 3),
            (10, 5),
            (12, 6),
            (16, 8),
            (24, 8),
        ] {
            assert_eq!(paged_attention_block_group(whole), block, "{whole}");
        }
        // Blocks a token: GLM-4.5's 96 query heads over 8 kv heads in 16 blocks of 6,
        // Nemotron-3-Nano's 32 over 2 in 4 of 8, Qwen3-8B's 32 over 8 in one a kv head.
        assert_eq!(paged_attention_groups(96, 8), 16);
        assert_eq!(paged_attention_groups(32, 2), 4);
        assert_eq!(paged_attention_groups(32, 8), 8);
    }

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
            counters: m.put(&[0i32; 2]),
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
        // The split launch merged them itself, into the same output.
        let merged = f32s(&m.get(k.out, 128));
        assert_eq!(merged, out);
    }

    /// The partials' allowance: f16 rounding alone gives 2^-11 of `sum p |v|` per weighted sum;
    /// a flip-prone newest key widens only the split that holds it, by the score shift it can
    /// cause (`scale * sum |q| k_flip`), in the max's entry too.
    #[test]
    fn allowance_bounds_rounding_and_the_newest_key() {
        let mut m = FlatMemory::new();
        let k = PagedAttention {
            keys_per_split: 2,
            splits: 2,
            ..causal_setup(&mut m)
        };
        // Every score the same (q all ones against keys all 0.5): p = 1 for every key.
        let q = vec![1.0f32; 2 * 64];
        let none = k.allowance(&q, &vec![0.0; 128], &[], &m).unwrap();
        let at = |t: usize, split: usize, i: usize| (t * 2 + split) * 66 + i;
        let f16 = F16_PROBABILITY_ROUNDING;
        // Token 1 (position 2): split 0 holds keys 0 and 1 (values (10, 0) and (0, 10)), split 1
        // key 2 (value (5, 5)).
        assert!((none[at(1, 0, 0)] - 10.0 * f16).abs() < 1e-6);
        assert!((none[at(1, 0, 65)] - 2.0 * f16).abs() < 1e-6);
        assert!((none[at(1, 1, 0)] - 5.0 * f16).abs() < 1e-6);
        assert_eq!(none[at(1, 1, 64)], 0.0);
        // Token 1's new key (position 2) may flip by 0.01 in every element.
        let keys = vec![Vec::new(), vec![0.01f32; 64]];
        let flipped = k.allowance(&q, &vec![0.0; 128], &keys, &m).unwrap();
        let shift = 64.0 * 0.01;
        let g = (1.0 + f16) * (2.0f32 * shift).exp() - 1.0;
        assert!((flipped[at(1, 1, 0)] - 5.0 * g).abs() < 1e-4);
        assert!((flipped[at(1, 1, 64)] - shift).abs() < 1e-6);
        for i in 0..66 {
            assert_eq!(flipped[at(1, 0, i)], none[at(1, 0, i)], "split 0, {i}");
            assert_eq!(flipped[at(0, 0, i)], none[at(0, 0, i)], "token 0, {i}");
        }
    }

    #[test]
    fn splits_cover_the_context_and_fill_the_gpu() {
        // Batch-1 decode at 4k context over 8 kv heads: 33 splits (264 blocks) of 128 keys (the
        // last one empty).
        assert_eq!(attention_splits(1, 32, 8, 4096, 32768, 264), (128, 33));
        // At 1k, the context's 16 pieces of 64 keys bound it: 16 splits (128 blocks).
        assert_eq!(attention_splits(1, 32, 8, 1024, 32768, 264), (64, 16));
        // One key more rounds the pieces up to 32 (17 of them filled), not down to 9 of 128.
        assert_eq!(attention_splits(1, 32, 8, 1025, 32768, 264), (64, 32));
        // A large prefill needs no split; neither does a context of at most 256 keys (a 257th
        // key gives 8 pieces of 64, where 64-key pieces alone split 100 keys 2 ways).
        assert_eq!(attention_splits(4096, 32, 8, 4096, 32768, 264), (0, 1));
        assert_eq!(attention_splits(1, 32, 8, 64, 32768, 264), (0, 1));
        assert_eq!(attention_splits(1, 32, 8, 256, 32768, 264), (0, 1));
        assert_eq!(attention_splits(8, 32, 8, 256, 32768, 264), (0, 1));
        assert_eq!(attention_splits(1, 32, 8, 257, 32768, 264), (64, 8));
        assert_eq!(
            attention_splits_of(1, 32, 8, 100, 32768, 264, 64, 0),
            (64, 2)
        );
        // Rounded up to a power of two.
        assert_eq!(
            attention_splits_of(1, 32, 8, 300, 32768, 264, 64, 200),
            (64, 8)
        );
        assert_eq!(
            attention_splits_of(1, 32, 8, 256, 32768, 264, 64, 200),
            (0, 1)
        );
        // Rounded down: batch 8 (64 pairs) splits 4 ways (256 blocks); batch 32 (256 pairs) not
        // at all, where rounding up gave 2 splits and 512 blocks.
        assert_eq!(attention_splits(8, 32, 8, 1024, 32768, 264), (256, 4));
        assert_eq!(attention_splits(32, 32, 8, 1024, 32768, 264), (0, 1));
        // Never beyond the partials' room (per query head).
        let (per, splits) = attention_splits(64, 32, 8, 100_000, 32768, 100_000);
        assert!(64 * 32 * splits <= 32768 && per * splits >= 100_000);
        // For every batch size and context: the splits cover the context, fewer than half of
        // them are empty, and the shape changes only where the context doubles or the keys per
        // split do: a 256-token generation from a 32-token prompt meets at most 4 shapes.
        for tokens in [1u32, 2, 8, 32, 64] {
            let mut shapes = Vec::new();
            for ctx in 1..=20_000u32 {
                let (per, splits) = attention_splits(tokens, 32, 8, ctx, 32768, 264);
                if splits > 1 {
                    let filled = ctx.div_ceil(per);
                    assert!(per.is_power_of_two() && per >= 64, "{tokens} {ctx}: {per}");
                    assert!(
                        filled <= splits && 2 * filled > splits,
                        "{tokens} {ctx}: {per} x {splits}"
                    );
                }
                if shapes.last() != Some(&(per, splits)) {
                    shapes.push((per, splits));
                }
            }
            let generation: std::collections::BTreeSet<_> = (32..=288)
                .map(|ctx| attention_splits(tokens, 32, 8, ctx, 32768, 264))
                .collect();
            assert!(generation.len() <= 4, "{tokens}: {generation:?}");
            // Logarithmic in the context: a handful of shapes up to 20k keys.
            assert!(shapes.len() <= 12, "{tokens}: {shapes:?}");
        }
    }

    #[test]
    fn longer_splits_split_less() {
        // An unsplit threshold that is not a power of two is rounded up to one (200 -> 256), so
        // the shape still changes only where the context doubles (up to 2k keys; past 33 x 64
        // keys the block target also moves the keys per split).
        for ctx in 2..=2048u32 {
            let shape = |c| attention_splits_of(1, 32, 8, c, 32768, 264, 64, 200);
            if shape(ctx) != shape(ctx - 1) {
                assert!((ctx - 1).is_power_of_two(), "{ctx}: {:?}", shape(ctx));
            }
            assert_eq!(shape(ctx).1 == 1, ctx <= 256, "{ctx}");
        }
        // Huge values saturate: past 2^31 unsplit keys no context is split; split keys past
        // 2^31 take splits of 2^31 keys (one, at any context a u32 holds).
        assert_eq!(
            attention_splits_of(1, 32, 8, u32::MAX, 1 << 30, 264, 64, u32::MAX),
            (0, 1)
        );
        assert_eq!(
            attention_splits_of(1, 32, 8, 1 << 20, 1 << 30, 264, u32::MAX, 0),
            (0, 1)
        );
        // Batch 1 at 160 keys: 4 splits of 64, 1 of 256; at 1k, 16 of 64 or 4 of 256.
        assert_eq!(
            attention_splits_of(1, 32, 8, 160, 32768, 264, 64, 0),
            (64, 4)
        );
        assert_eq!(
            attention_splits_of(1, 32, 8, 160, 32768, 264, 256, 0),
            (0, 1)
        );
        assert_eq!(
            attention_splits_of(1, 32, 8, 1024, 32768, 264, 256, 0),
            (256, 4)
        );
        // Rounded up to a power of two of at least 64.
        assert_eq!(
            attention_splits_of(1, 32, 8, 1024, 32768, 264, 200, 0),
            attention_splits_of(1, 32, 8, 1024, 32768, 264, 256, 0)
        );
        assert_eq!(
            attention_splits_of(1, 32, 8, 1024, 32768, 264, 0, 0),
            attention_splits(1, 32, 8, 1024, 32768, 264)
        );
        // Still covering the context, fewer than half the splits empty, per >= split_keys.
        for ctx in 1..=5000u32 {
            let (per, splits) = attention_splits_of(1, 32, 8, ctx, 32768, 264, 256, 0);
            if splits > 1 {
                let filled = ctx.div_ceil(per);
                assert!(
                    per >= 256 && filled <= splits && 2 * filled > splits,
                    "{ctx}"
                );
            } else {
                assert_eq!(per, 0);
            }
        }
    }

    #[test]
    fn decode_attention_shared_memory_fits_a_hopper_block() {
        // Every group size and head dim the kernel takes, with as many splits as a partials
        // buffer of 32768 allows a single query head: within the 227 KiB a block may opt in to
        // on sm_90 (beyond it the launch fails).
        for group in 1..=8u32 {
            for head_dim in [64u32, 128, 256] {
                for splits in [1u32, 2, 33, 32768 / group] {
                    let bytes = paged_attention_smem_bytes(group, head_dim, splits);
                    assert!(
                        bytes <= 227 * 1024,
                        "group {group}, head_dim {head_dim}, {splits} splits: {bytes} bytes"
                    );
                }
            }
        }
        // Qwen3-8B's decode (group 4, head_dim 128): the 3-stage rings, 96 KiB; two blocks per SM.
        assert_eq!(paged_attention_smem_bytes(4, 128, 16), 96 * 1024);
        // The wide form (8 warps) at the head dims it takes: within the same 227 KiB beside its
        // 2.5 KiB of static shared memory.
        for group in 1..=8u32 {
            for head_dim in [64u32, 128] {
                for splits in [1u32, 2, 33, 32768 / group] {
                    let bytes = paged_attention_smem_bytes_of(8, group, head_dim, splits);
                    assert!(
                        bytes + 2560 <= 227 * 1024,
                        "wide: {group} {head_dim} {splits}: {bytes}"
                    );
                }
            }
        }
        assert_eq!(paged_attention_smem_bytes_of(8, 4, 128, 1), 192 * 1024);
    }

    #[test]
    fn prefill_tiles_cut_runs_of_one_sequence() {
        // Sequence 0: positions 10..140 (cut at 64); sequence 1: a decode token; sequence 0
        // again after a gap in positions.
        let mut seq = vec![0i32; 130];
        let mut pos: Vec<i32> = (10..140).collect();
        seq.push(1);
        pos.push(7);
        seq.extend([0, 0]);
        pos.extend([200, 201]);
        assert_eq!(
            prefill_attention_tiles(&seq, &pos),
            vec![
                [0, 0, 10, 64],
                [0, 64, 74, 64],
                [0, 128, 138, 2],
                [1, 130, 7, 1],
                [0, 131, 200, 2]
            ]
        );
        assert!(prefill_attention_tiles(&[], &[]).is_empty());
    }

    /// A deterministic bf16 fill in [-2, 2).
    fn noise(n: usize, seed: u64) -> Vec<bf16> {
        bf16s(&uniform(seed, n, 2.0))
    }

    #[test]
    fn prefill_reference_agrees_with_paged_reference_to_bf16_probabilities() {
        // Two sequences with out-of-order blocks of 16: a second prefill chunk (positions
        // 100..170, keys of the first chunk already cached) and a first chunk (0..40), plus a
        // decode token of a third sequence; GQA 4, head_dim 64.
        const D: usize = 64;
        let (qh, kvh, bs, maxb) = (8usize, 2usize, 16usize, 11usize);
        let tables: Vec<i32> = (0..3 * maxb as i32).map(|b| (b * 7) % 33).collect();
        let mut token_seq = Vec::new();
        let mut positions = Vec::new();
        for (seq, range) in [(0, 100..170), (1, 0..40), (2, 150..151)] {
            for p in range {
                token_seq.push(seq);
                positions.push(p);
            }
        }
        let tokens = token_seq.len();
        let tiles = prefill_attention_tiles(&token_seq, &positions);
        assert_eq!(tiles.len(), 4);
        let mut m = FlatMemory::new();
        let cache = 33 * bs * kvh * D;
        let (q, k_cache, v_cache) = (
            m.put(&noise(tokens * qh * D, 1)),
            m.put(&noise(cache, 2)),
            m.put(&noise(cache, 3)),
        );
        let block_tables = m.put(&tables);
        // One spare row past the last token, which neither kernel may write.
        let sentinel = bf16s(&vec![7.0; (tokens + 1) * qh * D]);
        let (paged_out, prefill_out) = (m.put(&sentinel), m.put(&sentinel));
        let scale = 1.0 / (D as f32).sqrt();
        PagedAttention {
            out: paged_out,
            partials: DevicePtr::NULL,
            counters: DevicePtr::NULL,
            q,
            k_cache,
            v_cache,
            block_tables,
            token_seq: m.put(&token_seq),
            positions: m.put(&positions),
            tokens: tokens as u32,
            q_heads: qh as u32,
            kv_heads: kvh as u32,
            head_dim: D as u32,
            block_size: bs as u32,
            max_blocks_per_seq: maxb as u32,
            keys_per_split: 0,
            splits: 1,
            scale,
        }
        .reference(&mut m)
        .unwrap();
        PrefillAttention {
            out: prefill_out,
            q,
            k_cache,
            v_cache,
            block_tables,
            tiles: m.put(&tiles.concat()),
            num_tiles: tiles.len() as u32,
            q_heads: qh as u32,
            kv_heads: kvh as u32,
            head_dim: D as u32,
            block_size: bs as u32,
            max_blocks_per_seq: maxb as u32,
            scale,
        }
        .reference(&mut m)
        .unwrap();
        let n = (tokens + 1) * qh * D;
        let (paged, prefill) = (m.get::<bf16>(paged_out, n), m.get::<bf16>(prefill_out, n));
        // The same attention up to the prefill kernel's bf16 probabilities: a relative L2
        // difference of the order of bf16's precision, far below that of a wrong key or mask.
        let live = tokens * qh * D;
        let (mut diff, mut norm) = (0f64, 0f64);
        for (a, b) in paged[..live].iter().zip(&prefill[..live]) {
            let (a, b) = (f64::from(widen(*a)), f64::from(widen(*b)));
            diff += (a - b) * (a - b);
            norm += a * a;
        }
        let rel = (diff / norm).sqrt();
        assert!(rel > 0.0 && rel < 5e-3, "relative L2 difference {rel}");
        assert!(prefill[tokens * qh * D..].iter().all(|&x| x == sentinel[0]));
        assert!(prefill[..tokens * qh * D].iter().all(|&x| x != sentinel[0]));
    }

    #[test]
    fn bf16_flip_flags_probabilities_near_a_rounding_boundary() {
        // 1 + 2^-8 lies halfway between the bf16 values 1 and 1 + 2^-7.
        let half = 1.0f32 + 1.0 / 256.0;
        let ulps = |x: f32, n: i32| f32::from_bits(x.to_bits().wrapping_add_signed(n));
        assert_eq!(bf16_flip(half), Some(1.0 / 128.0));
        assert_eq!(bf16_flip(ulps(half, 1023)), Some(1.0 / 128.0));
        assert_eq!(bf16_flip(ulps(half, -1023)), Some(1.0 / 128.0));
        assert_eq!(bf16_flip(ulps(half, 1024)), None);
        assert_eq!(bf16_flip(1.0), None);
        assert_eq!(bf16_flip(0.0), None);
        // Below 1 the bf16 step halves: 0.75 + 2^-9 is halfway between 0.75 and 0.75 + 2^-8.
        assert_eq!(bf16_flip(0.75 + 1.0 / 512.0), Some(1.0 / 256.0));
    }

    #[test]
    fn prefill_allowance_bounds_every_near_probability_rounding_the_other_way() {
        // One sequence of 48 tokens, 2 heads of 64 sharing one kv head, key tiles of 16; inputs
        // with a wide spread of scores so that many probabilities are far below 1.
        const D: usize = 64;
        let (tokens, qh, bs) = (48usize, 2usize, 16usize);
        let q: Vec<f32> = noise(tokens * qh * D, 11)
            .iter()
            .map(|&x| widen(x))
            .collect();
        let (k_cache, v_cache) = (noise(tokens * D, 12), noise(tokens * D, 13));
        let tables = [0i32, 1, 2];
        let args = PrefillAttention {
            out: DevicePtr::NULL,
            q: DevicePtr::NULL,
            k_cache: DevicePtr::NULL,
            v_cache: DevicePtr::NULL,
            block_tables: DevicePtr::NULL,
            tiles: DevicePtr::NULL,
            num_tiles: 1,
            q_heads: qh as u32,
            kv_heads: 1,
            head_dim: D as u32,
            block_size: bs as u32,
            max_blocks_per_seq: 3,
            scale: 1.0 / (D as f32).sqrt(),
        };
        let key_tile = 16;
        let tiles = [[0, 0, 0, tokens as i32]];
        let rows = prefill_attention_rows(&args, key_tile, &tiles, &q, &tables, &k_cache, &v_cache);
        assert_eq!(rows.len(), tokens);
        // The kernel's arithmetic written out again, except that every probability the
        // reference flags rounds to the bf16 value on the other side of its rounding boundary.
        let scale_log2 = args.scale * std::f32::consts::LOG2_E;
        let (mut flagged_rows, mut moved) = (0, 0);
        for row in &rows {
            for h in 0..qh {
                let qv = &q[(row.token * qh + h) * D..][..D];
                let (mut max, mut total, mut acc) = (f32::NEG_INFINITY, 0f32, [0f32; D]);
                for start in (0..=row.token).step_by(key_tile as usize) {
                    let keys = start..(start + key_tile as usize).min(row.token + 1);
                    let scores: Vec<f32> = keys
                        .clone()
                        .map(|j| {
                            let kj = &k_cache[j * D..][..D];
                            qv.iter().zip(kj).map(|(a, b)| a * widen(*b)).sum::<f32>()
                        })
                        .collect();
                    let tile_max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    let new_max = max.max(tile_max * scale_log2);
                    let corr = (max - new_max).exp2();
                    total *= corr;
                    acc.iter_mut().for_each(|a| *a *= corr);
                    for (j, s) in keys.zip(&scores) {
                        let exact = s.mul_add(scale_log2, -new_max).exp2();
                        let near = widen(bf16::from_f32(exact));
                        let p = match bf16_flip(exact) {
                            Some(step) if near > exact => near - step,
                            Some(step) => near + step,
                            None => near,
                        };
                        total += p;
                        for (a, x) in acc.iter_mut().zip(&v_cache[j * D..][..D]) {
                            *a += p * widen(*x);
                        }
                    }
                    max = new_max;
                }
                let (out, allowance) = (&row.out[h * D..][..D], &row.allowance[h * D..][..D]);
                flagged_rows += usize::from(allowance.iter().any(|&a| a > 0.0));
                for d in 0..D {
                    let diff = (acc[d] / total - out[d]).abs();
                    moved += usize::from(diff > 0.0);
                    // First order in the flips, so a hair of slack for the second.
                    assert!(
                        diff <= allowance[d] * 1.01 + 1e-7,
                        "token {} head {h} dim {d}: moved {diff}, allowance {}",
                        row.token,
                        allowance[d]
                    );
                }
            }
        }
        // Not vacuous: some rows have near probabilities and their flips move outputs, yet the
        // rows without any are held to the plain bound.
        assert!(
            moved > 0 && flagged_rows > 0 && flagged_rows < tokens * qh,
            "{flagged_rows} {moved}"
        );
    }

    #[test]
    fn prefill_reference_refuses_bad_tiles_and_head_dims() {
        let mut m = FlatMemory::new();
        let base = causal_setup(&mut m);
        let k = PrefillAttention {
            out: base.out,
            q: base.q,
            k_cache: base.k_cache,
            v_cache: base.v_cache,
            block_tables: base.block_tables,
            tiles: m.put(&[0i32, 0, 0, 65]),
            num_tiles: 1,
            q_heads: 1,
            kv_heads: 1,
            head_dim: 64,
            block_size: 2,
            max_blocks_per_seq: 2,
            scale: 1.0,
        };
        assert!(k.reference(&mut m).is_err());
        let past_table = m.put(&[0i32, 0, 2, 3]);
        let k = PrefillAttention {
            tiles: past_table,
            ..k
        };
        assert!(k.reference(&mut m).is_err());
        let ok = m.put(&[0i32, 0, 0, 2]);
        assert!(
            PrefillAttention { tiles: ok, ..k }
                .reference(&mut m)
                .is_ok()
        );
        let k = PrefillAttention {
            tiles: ok,
            head_dim: 256,
            ..k
        };
        assert!(k.reference(&mut m).is_err());
    }

    #[test]
    fn prefill_tiles_of_cut_at_the_tile_size() {
        let seq = vec![0i32; 300];
        let pos: Vec<i32> = (5..305).collect();
        assert_eq!(
            prefill_attention_tiles_of(&seq, &pos, PrefillAttentionV2::TILE_TOKENS),
            vec![[0, 0, 5, 128], [0, 128, 133, 128], [0, 256, 261, 44]]
        );
        assert_eq!(
            prefill_attention_tiles_of(&seq, &pos, PrefillAttention::TILE_TOKENS),
            prefill_attention_tiles(&seq, &pos)
        );
    }

    /// Version 2's reference on a second chunk of 200 tokens (two 128-token tiles), a first
    /// chunk and a decode token, GQA 4, head_dim 128, shuffled blocks of 16, against version 1's.
    #[test]
    fn prefill_v2_reference_differs_from_v1_by_its_key_tile_only() {
        const D: usize = 128;
        let (qh, kvh, bs, maxb, nblocks) = (8usize, 2usize, 16usize, 19usize, 61usize);
        let tables: Vec<i32> = (0..3 * maxb as i32).map(|b| (b * 7) % 61).collect();
        let (mut token_seq, mut positions) = (Vec::new(), Vec::new());
        for (seq, range) in [(0, 100..300), (1, 0..40), (2, 150..151)] {
            for p in range {
                token_seq.push(seq);
                positions.push(p);
            }
        }
        let tokens = token_seq.len();
        let mut m = FlatMemory::new();
        let cache = nblocks * bs * kvh * D;
        let (q, k_cache, v_cache) = (
            m.put(&noise(tokens * qh * D, 4)),
            m.put(&noise(cache, 5)),
            m.put(&noise(cache, 6)),
        );
        let block_tables = m.put(&tables);
        let sentinel = bf16s(&vec![7.0; (tokens + 1) * qh * D]);
        let n = (tokens + 1) * qh * D;
        let v1 = PrefillAttention {
            out: m.put(&sentinel),
            q,
            k_cache,
            v_cache,
            block_tables,
            tiles: DevicePtr::NULL,
            num_tiles: 0,
            q_heads: qh as u32,
            kv_heads: kvh as u32,
            head_dim: D as u32,
            block_size: bs as u32,
            max_blocks_per_seq: maxb as u32,
            scale: 1.0 / (D as f32).sqrt(),
        };
        // The reference for tiles of up to `tile_tokens` and softmax steps of `key_tile` keys, run
        // on the step cut into tiles of `cut` tokens.
        let run = |m: &mut FlatMemory, cut: u32, tile_tokens: u32, key_tile: u32| {
            let tiles = prefill_attention_tiles_of(&token_seq, &positions, cut);
            let k = PrefillAttention {
                out: m.put(&sentinel),
                tiles: m.put(&tiles.concat()),
                num_tiles: tiles.len() as u32,
                ..v1
            };
            prefill_reference(&k, PrefillAttentionV2::NAME, tile_tokens, key_tile, m).unwrap();
            m.get::<bf16>(k.out, n)
        };
        let v1_out = run(&mut m, 64, 64, PrefillAttention::KEY_TILE);
        let v2_out = run(&mut m, 128, 128, PrefillAttentionV2::KEY_TILE);
        // A row does not depend on the tile it is in, only on the key tile.
        assert_eq!(run(&mut m, 64, 128, PrefillAttentionV2::KEY_TILE), v2_out);
        assert_eq!(run(&mut m, 128, 128, PrefillAttention::KEY_TILE), v1_out);
        // Through the op: version 2's tiles of 128 (3 of the 4 tiles are full or 72 long).
        let tiles = prefill_attention_tiles_of(&token_seq, &positions, 128);
        assert_eq!(tiles.len(), 4);
        let k = PrefillAttentionV2 {
            out: m.put(&sentinel),
            q,
            k_cache,
            v_cache,
            block_tables,
            tiles: m.put(&tiles.concat()),
            num_tiles: tiles.len() as u32,
            q_heads: qh as u32,
            kv_heads: kvh as u32,
            head_dim: D as u32,
            block_size: bs as u32,
            max_blocks_per_seq: maxb as u32,
            scale: v1.scale,
        };
        k.reference(&mut m).unwrap();
        assert_eq!(m.get::<bf16>(k.out, n), v2_out);
        // The running max moving every 16 keys instead of 64 changes bf16 roundings only.
        let live = tokens * qh * D;
        let (mut diff, mut norm) = (0f64, 0f64);
        for (a, b) in v1_out[..live].iter().zip(&v2_out[..live]) {
            let (a, b) = (f64::from(widen(*a)), f64::from(widen(*b)));
            diff += (a - b) * (a - b);
            norm += a * a;
        }
        let rel = (diff / norm).sqrt();
        assert!(rel > 0.0 && rel < 5e-3, "relative L2 difference {rel}");
        assert!(v2_out[live..].iter().all(|&x| x == sentinel[0]));
        assert!(v2_out[..live].iter().all(|&x| x != sentinel[0]));
    }

    /// Version 3's reference is the common reference at 128-key softmax steps on tiles of up to
    /// 128 tokens (bf16 roundings away from version 1's), for head_dim 128 only.
    #[test]
    fn prefill_v3_reference_steps_over_128_keys() {
        const D: usize = 128;
        let (qh, kvh, bs, maxb, nblocks) = (4usize, 2usize, 16usize, 12usize, 30usize);
        let tables: Vec<i32> = (0..2 * maxb as i32).map(|b| (b * 11) % 30).collect();
        let (mut token_seq, mut positions) = (Vec::new(), Vec::new());
        for (seq, range) in [(0, 30..190), (1, 0..3)] {
            for p in range {
                token_seq.push(seq);
                positions.push(p);
            }
        }
        let tokens = token_seq.len();
        let mut m = FlatMemory::new();
        let cache = nblocks * bs * kvh * D;
        let n = (tokens + 1) * qh * D;
        let sentinel = bf16s(&vec![7.0; n]);
        let tiles64 = prefill_attention_tiles_of(&token_seq, &positions, 64);
        let tiles128 = prefill_attention_tiles_of(&token_seq, &positions, 128);
        let v1 = PrefillAttention {
            out: m.put(&sentinel),
            q: m.put(&noise(tokens * qh * D, 7)),
            k_cache: m.put(&noise(cache, 8)),
            v_cache: m.put(&noise(cache, 9)),
            block_tables: m.put(&tables),
            tiles: m.put(&tiles64.concat()),
            num_tiles: tiles64.len() as u32,
            q_heads: qh as u32,
            kv_heads: kvh as u32,
            head_dim: D as u32,
            block_size: bs as u32,
            max_blocks_per_seq: maxb as u32,
            scale: 1.0 / (D as f32).sqrt(),
        };
        v1.reference(&mut m).unwrap();
        let v1_out = m.get::<bf16>(v1.out, n);
        let v3 = PrefillAttentionV3 {
            out: m.put(&sentinel),
            tiles: m.put(&tiles128.concat()),
            num_tiles: tiles128.len() as u32,
            ..PrefillAttentionV3::from(v1)
        };
        v3.reference(&mut m).unwrap();
        let v3_out = m.get::<bf16>(v3.out, n);
        let direct = PrefillAttention {
            out: m.put(&sentinel),
            tiles: v3.tiles,
            num_tiles: v3.num_tiles,
            ..v1
        };
        prefill_reference(&direct, PrefillAttentionV3::NAME, 128, 128, &mut m).unwrap();
        assert_eq!(m.get::<bf16>(direct.out, n), v3_out);
        let live = tokens * qh * D;
        let (mut diff, mut norm) = (0f64, 0f64);
        for (a, b) in v1_out[..live].iter().zip(&v3_out[..live]) {
            let (a, b) = (f64::from(widen(*a)), f64::from(widen(*b)));
            diff += (a - b) * (a - b);
            norm += a * a;
        }
        let rel = (diff / norm).sqrt();
        assert!(rel > 0.0 && rel < 5e-3, "relative L2 difference {rel}");
        assert!(v3_out[live..].iter().all(|&x| x == sentinel[0]));
        assert_eq!(v3.launch_config().grid, [qh as u32, 3, 1]);
        assert_eq!(v3.launch_config().block, [256, 1, 1]);
        // Head dim 64 is version 2's.
        assert!(
            PrefillAttentionV3 { head_dim: 64, ..v3 }
                .reference(&mut m)
                .is_err()
        );
    }

    #[test]
    fn prefill_v2_reference_takes_tiles_of_128() {
        let mut m = FlatMemory::new();
        let base = causal_setup(&mut m);
        // One sequence of 130 positions over blocks of 2.
        let table: Vec<i32> = (0..65).map(|b| b % 2).collect();
        let k = PrefillAttentionV2 {
            out: m.put(&bf16s(&vec![0.0; 129 * 64])),
            q: m.put(&bf16s(&vec![0.0; 129 * 64])),
            k_cache: base.k_cache,
            v_cache: base.v_cache,
            block_tables: m.put(&table),
            tiles: m.put(&[0i32, 0, 0, 129]),
            num_tiles: 1,
            q_heads: 1,
            kv_heads: 1,
            head_dim: 64,
            block_size: 2,
            max_blocks_per_seq: 65,
            scale: 1.0,
        };
        assert!(k.reference(&mut m).is_err());
        let ok = m.put(&[0i32, 0, 0, 128]);
        assert!(
            PrefillAttentionV2 { tiles: ok, ..k }
                .reference(&mut m)
                .is_ok()
        );
        assert_eq!(
            PrefillAttentionV2 { tiles: ok, ..k }.launch_config().grid,
            [1, 1, 1]
        );
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

    /// Two decode tokens (sequences 0 and 1, positions 3 and 1, block size 2, 2 q heads on one
    /// kv head, head_dim 64) through the fused reference and through the two launches it stands
    /// for on a copy of the memory: same output and caches. A sequence named twice is refused.
    #[test]
    fn fused_qkv_attention_is_qkv_post_then_attention() {
        const D: usize = 64;
        let mut m = FlatMemory::new();
        let values = |n: usize, seed: f32| -> Vec<f32> {
            (0..n)
                .map(|i| (i as f32 * 0.37 + seed).sin() * 2.0)
                .collect()
        };
        let half = D / 2;
        let (cos, sin): (Vec<f32>, Vec<f32>) = (0..8 * half)
            .map(|i| ((i as f32 * 0.1).cos(), (i as f32 * 0.1).sin()))
            .unzip();
        let fused = PagedAttentionQkv {
            out: m.put(&bf16s(&[0.0; 2 * 2 * D])),
            partials: m.put(&[0f32; 1]),
            counters: m.put(&[0i32; 2]),
            qkv: m.put(&bf16s(&values(2 * 4 * D, 0.3))),
            k_cache: m.put(&bf16s(&values(8 * D, 1.1))),
            v_cache: m.put(&bf16s(&values(8 * D, 2.9))),
            // Sequence 0: blocks 2, 0; sequence 1: blocks 3, 1.
            block_tables: m.put(&[2i32, 0, 3, 1]),
            token_seq: m.put(&[0i32, 1]),
            positions: m.put(&[3i32, 1]),
            slots: m.put(&[1i32, 7]),
            q_norm: m.put(&bf16s(&values(D, 4.0))),
            k_norm: m.put(&bf16s(&values(D, 5.0))),
            cos: m.put(&cos),
            sin: m.put(&sin),
            tokens: 2,
            q_heads: 2,
            kv_heads: 1,
            head_dim: D as u32,
            block_size: 2,
            max_blocks_per_seq: 2,
            keys_per_split: 0,
            splits: 1,
            max_position: 8,
            scale: 0.125,
            eps: 1e-6,
        };
        let mut two = m.clone();
        fused.reference(&mut m).unwrap();
        let (mut post, mut attention) = fused.parts();
        assert_eq!(PagedAttentionQkv::fuse(&post, &attention), fused);
        let q = two.put(&bf16s(&[0.0; 2 * 2 * D]));
        post.q_out = q;
        attention.q = q;
        post.reference(&mut two).unwrap();
        attention.reference(&mut two).unwrap();
        for (ptr, n) in [
            (fused.out, 4 * D),
            (fused.k_cache, 8 * D),
            (fused.v_cache, 8 * D),
        ] {
            assert_eq!(m.get::<u16>(ptr, n), two.get::<u16>(ptr, n));
        }
        // The newest value was written (slot 1 of sequence 0; one kv head, so elements D..2D).
        let before: Vec<u16> = bf16s(&values(8 * D, 2.9))[D..2 * D]
            .iter()
            .map(|b| b.to_bits())
            .collect();
        assert_ne!(m.get::<u16>(fused.v_cache.offset(D * 2), D), before);

        let twice = PagedAttentionQkv {
            token_seq: m.put(&[1i32, 1]),
            ..fused
        };
        let err = twice.reference(&mut m).unwrap_err();
        assert!(format!("{err}").contains("more than one token"), "{err}");

        // The wide entry's host reference: the fused form's outputs at its own launch, and a
        // refusal of the launches its kernel would skip (the 4-warp block, head_dim 256).
        let mut wide = two.clone();
        let run = |mem: &mut FlatMemory, k: &PagedAttentionQkv, config: &LaunchConfig| {
            paged_attention_qkv_wide_reference(mem, config, &k.args())
        };
        run(&mut wide, &fused, &fused.wide_launch_config()).unwrap();
        assert_eq!(
            wide.get::<u16>(fused.out, 4 * D),
            m.get::<u16>(fused.out, 4 * D)
        );
        let narrow = run(&mut wide, &fused, &fused.launch_config()).unwrap_err();
        assert!(
            format!("{narrow}").contains("blocks of 256 threads"),
            "{narrow}"
        );
        let d256 = PagedAttentionQkv {
            head_dim: 256,
            ..fused
        };
        assert!(!d256.wide_fits());
        assert!(run(&mut wide, &d256, &d256.wide_launch_config()).is_err());
    }
}
