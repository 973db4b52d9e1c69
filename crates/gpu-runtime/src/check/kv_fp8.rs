// SPDX-License-Identifier: MIT OR Apache-2.0
//! Parity cases of the FP8 KV cache's kernels (`--kv-cache-dtype fp8`): the cache writes that
//! quantize (`kv_cache_write_fp8`, `qkv_rope_kv_write_fp8`) and the decode attentions that read
//! e4m3 (`paged_attention_fp8`, whole and split, and the fused `paged_attention_qkv_fp8` and its
//! wide form), at Qwen3-8B's (32 query heads, 8 kv heads of 128) and Qwen3-0.6B's (16 / 8 of 128)
//! shapes, SmolLM2's (9 / 3 of 64), head_dim 256, a long context (4096 keys), batches of several
//! sequences over shuffled blocks, and scales that saturate some elements to ±448.
//!
//! Cache contents are E4M3 codes of N(0, 1) draws (every binade near unit scale, subnormals
//! included), so scores and values sit where real keys do once divided by their scale. Written
//! caches are compared as e4m3 ([`OutputKind::E4m3`]: equal, or one step apart where the GPU's
//! f32 put a value across a rounding boundary, at most one element in a thousand).

use metrale_core::DevicePtr;
use metrale_core::fp8::f32_to_e4m3;
use metrale_kernels::KernelAbi;
use metrale_kernels::ops::{
    KvCacheWriteFp8, PagedAttention, PagedAttentionFp8, PagedAttentionQkv, PagedAttentionQkvFp8,
    PrefillAttention, PrefillAttentionV2, PrefillAttentionV2Fp8, QkvRopeKvWrite, QkvRopeKvWriteFp8,
    prefill_attention_rows, prefill_attention_tiles_of,
};

use super::{
    Allowance, Buffer, Case, Init, OutputKind, Rng, bf16_normal, bf16_values, f32_bytes,
    host_allowance, i32_bytes, launch_of, norm_weight, rope_tables, shuffled,
};

/// Every case, in a fixed order.
pub(super) fn kv_fp8_cases(rng: &mut Rng) -> Vec<Case> {
    let mut out = cache_write_cases(rng);
    out.extend(qkv_post_cases(rng));
    out.extend(attention_cases(rng));
    out.extend(fused_cases(rng, false));
    out.extend(fused_cases(rng, true));
    out.extend(prefill_cases(rng));
    out
}

/// `n` E4M3 codes of N(0, 1) draws, made on first read (two draws a value).
fn e4m3_normal(rng: &mut Rng, n: usize) -> Init {
    let mut from = rng.clone();
    rng.skip(2 * n as u64);
    Init::new(move || (0..n).map(|_| f32_to_e4m3(from.normal())).collect())
}

fn buffer(init: Init, output: Option<OutputKind>) -> Buffer {
    Buffer { init, output }
}

/// The plain cache write: Qwen3-8B's kv row (8 x 128) for 7 tokens, SmolLM2's (3 x 64) for 300,
/// one slot negative; scales 0.37 / 1.9 and 0.01 / 0.004 (N(0, 4) inputs: many saturate).
fn cache_write_cases(rng: &mut Rng) -> Vec<Case> {
    let mut out = Vec::new();
    for &(tokens, row, k_scale, v_scale) in
        &[(7u32, 1024u32, 0.37f32, 1.9f32), (300, 192, 0.01, 0.004)]
    {
        let (t, r) = (tokens as usize, row as usize);
        let num_slots = 2 * t + 3;
        let mut slots = shuffled(rng, num_slots);
        slots.truncate(t);
        slots[1] = -1;
        out.push(Case {
            kernel: KvCacheWriteFp8::NAME,
            gemm: None,
            allowance: None,
            shape: format!("tokens={tokens} row={row} scales={k_scale}/{v_scale}"),
            buffers: vec![
                buffer(e4m3_normal(rng, num_slots * r), Some(OutputKind::E4m3)),
                buffer(e4m3_normal(rng, num_slots * r), Some(OutputKind::E4m3)),
                buffer(bf16_normal(rng, t * r, 2.0), None),
                buffer(bf16_normal(rng, t * r, 2.0), None),
                buffer(i32_bytes(&slots).into(), None),
            ],
            build: Box::new(move |p| {
                launch_of(KvCacheWriteFp8 {
                    k_cache: p[0],
                    v_cache: p[1],
                    k: p[2],
                    v: p[3],
                    slots: p[4],
                    tokens,
                    row,
                    k_scale,
                    v_scale,
                })
            }),
        });
    }
    out
}

/// QK-norm, RoPE and the FP8 cache write: Qwen3-8B and Qwen3-0.6B at 1 and 300 tokens, SmolLM2's
/// heads without norms, head_dim 96 (the scalar path); scales 1 and small ones that saturate.
fn qkv_post_cases(rng: &mut Rng) -> Vec<Case> {
    let mut out = Vec::new();
    for &(tokens, q_heads, kv_heads, head_dim, norms, k_scale, v_scale) in &[
        (1u32, 32u32, 8u32, 128u32, true, 1.0f32, 1.0f32),
        (300, 32, 8, 128, true, 0.03, 0.02),
        (300, 16, 8, 128, true, 0.7, 1.3),
        (300, 9, 3, 64, false, 0.05, 0.004),
        (5, 4, 2, 96, true, 0.25, 0.5),
    ] {
        let max_position = 4096u32;
        let (t, d) = (tokens as usize, head_dim as usize);
        let heads = (q_heads + 2 * kv_heads) as usize;
        let kv_row = kv_heads as usize * d;
        let num_slots = 2 * t + 3;
        let mut positions: Vec<i32> = (0..t)
            .map(|_| rng.below(u64::from(max_position)) as i32)
            .collect();
        let mut slots = shuffled(rng, num_slots);
        slots.truncate(t);
        if t > 2 {
            positions[2] = max_position as i32 + 3;
            slots[1] = -1;
        }
        let (cos, sin) = rope_tables(max_position, d);
        out.push(Case {
            kernel: QkvRopeKvWriteFp8::NAME,
            gemm: None,
            allowance: None,
            shape: format!(
                "tokens={tokens} heads={q_heads}/{kv_heads} d={head_dim} qk_norm={norms} scales={k_scale}/{v_scale}"
            ),
            buffers: vec![
                buffer(
                    vec![0; t * q_heads as usize * d * 2].into(),
                    Some(OutputKind::Bf16),
                ),
                buffer(e4m3_normal(rng, num_slots * kv_row), Some(OutputKind::E4m3)),
                buffer(e4m3_normal(rng, num_slots * kv_row), Some(OutputKind::E4m3)),
                buffer(bf16_normal(rng, t * heads * d, 2.0), None),
                buffer(norm_weight(rng, d).into(), None),
                buffer(norm_weight(rng, d).into(), None),
                buffer(i32_bytes(&positions).into(), None),
                buffer(i32_bytes(&slots).into(), None),
                buffer(f32_bytes(&cos).into(), None),
                buffer(f32_bytes(&sin).into(), None),
            ],
            build: Box::new(move |p| {
                let norm = |ptr: DevicePtr| if norms { ptr } else { DevicePtr::NULL };
                launch_of(QkvRopeKvWriteFp8::of(
                    &QkvRopeKvWrite {
                        q_out: p[0],
                        k_cache: p[1],
                        v_cache: p[2],
                        qkv: p[3],
                        q_norm: norm(p[4]),
                        k_norm: norm(p[5]),
                        positions: p[6],
                        slots: p[7],
                        cos: p[8],
                        sin: p[9],
                        tokens,
                        q_heads,
                        kv_heads,
                        head_dim,
                        rotary_dim: head_dim,
                        max_position,
                        eps: 1e-6,
                        weight_offset: 0.0,
                    },
                    k_scale,
                    v_scale,
                ))
            }),
        });
    }
    out
}

/// The decode attention over an FP8 cache: (sequences, new tokens each, context, query heads,
/// kv heads, head_dim). Qwen3-8B batch 4 at 300 keys and batch 1 at 4096, Qwen3-0.6B with a
/// 70-token causal run, SmolLM2's heads at 37 keys (mid-block), head_dim 256; each whole, split in
/// 16- and 100-key pieces, and with 3 surplus splits. Scales 0.8 / 1.7.
fn attention_cases(rng: &mut Rng) -> Vec<Case> {
    let mut out = Vec::new();
    let (k_scale, v_scale) = (0.8f32, 1.7f32);
    for &(seqs, new_tokens, context, q_heads, kv_heads, head_dim) in &[
        (4usize, 1usize, 300usize, 32u32, 8u32, 128u32),
        (1, 1, 4096, 32, 8, 128),
        (1, 70, 70, 16, 8, 128),
        (2, 1, 37, 9, 3, 64),
        (1, 5, 21, 4, 1, 256),
    ] {
        let block_size = 16u32;
        let max_blocks = context.div_ceil(block_size as usize);
        let num_blocks = seqs * max_blocks + 3;
        let ids = shuffled(rng, num_blocks);
        let tables: Vec<i32> = ids[..seqs * max_blocks].to_vec();
        let (mut token_seq, mut positions) = (Vec::new(), Vec::new());
        for s in 0..seqs {
            for t in 0..new_tokens {
                token_seq.push(s as i32);
                // Sequences of different lengths: sequence s ends s keys early.
                positions.push((context - new_tokens + t - s.min(context - new_tokens)) as i32);
            }
        }
        let tokens = token_seq.len() as u32;
        let row = (kv_heads * head_dim) as usize;
        let q_len = tokens as usize * (q_heads * head_dim) as usize;
        let scale = 1.0 / (head_dim as f32).sqrt();
        let q = bf16_normal(rng, q_len, 1.0);
        let k_cache = e4m3_normal(rng, num_blocks * block_size as usize * row);
        let v_cache = e4m3_normal(rng, num_blocks * block_size as usize * row);
        for (keys_per_split, surplus) in [(0u32, 0u32), (16, 0), (100, 0), (100, 3)] {
            let splits = if keys_per_split == 0 {
                1
            } else {
                (context as u32).div_ceil(keys_per_split) + surplus
            };
            if keys_per_split > 0 && splits == 1 {
                continue;
            }
            let partials =
                tokens as usize * q_heads as usize * splits as usize * (head_dim as usize + 2);
            let make = move |p: &[DevicePtr]| {
                PagedAttentionFp8::of(
                    &PagedAttention {
                        out: p[0],
                        partials: p[1],
                        counters: p[2],
                        q: p[3],
                        k_cache: p[4],
                        v_cache: p[5],
                        block_tables: p[6],
                        token_seq: p[7],
                        positions: p[8],
                        tokens,
                        q_heads,
                        kv_heads,
                        head_dim,
                        block_size,
                        max_blocks_per_seq: max_blocks as u32,
                        keys_per_split,
                        splits,
                        scale,
                    },
                    k_scale,
                    v_scale,
                )
            };
            let buffers = vec![
                buffer(vec![0; q_len * 2].into(), Some(OutputKind::Bf16)),
                buffer(
                    vec![0; partials * 4].into(),
                    (splits > 1).then_some(OutputKind::F32),
                ),
                buffer(
                    vec![0; (tokens * kv_heads) as usize * 4].into(),
                    Some(OutputKind::I32),
                ),
                buffer(q.clone(), None),
                buffer(k_cache.clone(), None),
                buffer(v_cache.clone(), None),
                buffer(i32_bytes(&tables).into(), None),
                buffer(i32_bytes(&token_seq).into(), None),
                buffer(i32_bytes(&positions).into(), None),
            ];
            let inputs = buffers.clone();
            let allowance = (splits > 1).then(|| {
                Allowance::new(1, move || {
                    let q = bf16_values(inputs[3].init.bytes());
                    host_allowance(&inputs, make, |k, mem| k.allowance(&q, mem))
                })
            });
            out.push(Case {
                kernel: PagedAttentionFp8::NAME,
                gemm: None,
                allowance,
                shape: format!(
                    "seqs={seqs} tokens={tokens} ctx={context} heads={q_heads}/{kv_heads} d={head_dim} splits={splits}"
                ),
                buffers,
                build: Box::new(move |p| launch_of(make(p))),
            });
        }
    }
    out
}

/// The fused decode attention over an FP8 cache (through the wide form where `wide`): (sequences,
/// context, query heads, kv heads, head_dim, qk-norm, keys per split). Qwen3-8B at 4096 keys
/// (batch 1, unsplit and split in 64s) and batch 3 at 300, Qwen3-0.6B at 1024, SmolLM2's heads;
/// head_dim 256 on the narrow form only; scales 0.05 / 0.03 (N(0, 4) inputs, some saturate).
fn fused_cases(rng: &mut Rng, wide: bool) -> Vec<Case> {
    let mut shapes = vec![
        (1usize, 4096usize, 32u32, 8u32, 128u32, true, 0u32),
        (1, 4096, 32, 8, 128, true, 64),
        (1, 1024, 16, 8, 128, true, 64),
        (3, 300, 32, 8, 128, true, 16),
        (2, 37, 9, 3, 64, false, 0),
    ];
    if !wide {
        shapes.push((2, 21, 4, 4, 256, false, 8));
    }
    let (k_scale, v_scale) = (0.05f32, 0.03f32);
    let mut out = Vec::new();
    for (seqs, context, q_heads, kv_heads, head_dim, norms, keys_per_split) in shapes {
        let block_size = 16u32;
        let max_position = 4096u32;
        let d = head_dim as usize;
        let max_blocks = context.div_ceil(block_size as usize);
        let num_blocks = seqs * max_blocks + 3;
        let ids = shuffled(rng, num_blocks);
        let tables: Vec<i32> = ids[..seqs * max_blocks].to_vec();
        let token_seq: Vec<i32> = (0..seqs as i32).collect();
        let positions: Vec<i32> = (0..seqs)
            .map(|s| (context - 1 - s.min(context - 1)) as i32)
            .collect();
        let mut slots: Vec<i32> = (0..seqs)
            .map(|s| {
                let p = positions[s] as usize;
                tables[s * max_blocks + p / block_size as usize] * block_size as i32
                    + (p % block_size as usize) as i32
            })
            .collect();
        if seqs > 2 {
            slots[1] = -1;
        }
        let tokens = seqs as u32;
        let splits = if keys_per_split == 0 {
            1
        } else {
            (context as u32).div_ceil(keys_per_split)
        };
        let row = (kv_heads * head_dim) as usize;
        let heads = (q_heads + 2 * kv_heads) as usize;
        let q_len = seqs * (q_heads * head_dim) as usize;
        let partials = seqs * q_heads as usize * splits as usize * (d + 2);
        let (cos, sin) = rope_tables(max_position, d);
        let cache_len = num_blocks * block_size as usize * row;
        let scale = 1.0 / (head_dim as f32).sqrt();
        let make = move |p: &[DevicePtr]| {
            let norm = |ptr: DevicePtr| if norms { ptr } else { DevicePtr::NULL };
            PagedAttentionQkvFp8::of(
                &PagedAttentionQkv {
                    out: p[0],
                    partials: p[1],
                    counters: p[2],
                    qkv: p[3],
                    k_cache: p[4],
                    v_cache: p[5],
                    block_tables: p[6],
                    token_seq: p[7],
                    positions: p[8],
                    slots: p[9],
                    q_norm: norm(p[10]),
                    k_norm: norm(p[11]),
                    cos: p[12],
                    sin: p[13],
                    tokens,
                    q_heads,
                    kv_heads,
                    head_dim,
                    block_size,
                    max_blocks_per_seq: max_blocks as u32,
                    keys_per_split,
                    splits,
                    max_position,
                    scale,
                    eps: 1e-6,
                },
                k_scale,
                v_scale,
            )
        };
        let buffers = vec![
            buffer(vec![0; q_len * 2].into(), Some(OutputKind::Bf16)),
            buffer(
                vec![0; partials * 4].into(),
                (splits > 1).then_some(OutputKind::F32),
            ),
            buffer(
                vec![
                    0;
                    seqs * metrale_kernels::ops::paged_attention_groups(q_heads, kv_heads) as usize
                        * 4
                ]
                .into(),
                Some(OutputKind::I32),
            ),
            buffer(bf16_normal(rng, seqs * heads * d, 2.0), None),
            buffer(e4m3_normal(rng, cache_len), Some(OutputKind::E4m3)),
            buffer(e4m3_normal(rng, cache_len), Some(OutputKind::E4m3)),
            buffer(i32_bytes(&tables).into(), None),
            buffer(i32_bytes(&token_seq).into(), None),
            buffer(i32_bytes(&positions).into(), None),
            buffer(i32_bytes(&slots).into(), None),
            buffer(norm_weight(rng, d).into(), None),
            buffer(norm_weight(rng, d).into(), None),
            buffer(f32_bytes(&cos).into(), None),
            buffer(f32_bytes(&sin).into(), None),
        ];
        let inputs = buffers.clone();
        let allowance = Some(Allowance::new(if splits > 1 { 1 } else { 0 }, move || {
            host_allowance(&inputs, make, |k, mem| k.allowance(mem))
        }));
        let (kernel, form) = PagedAttentionQkvFp8::form(wide);
        out.push(Case {
            kernel,
            gemm: None,
            allowance,
            shape: format!(
                "seqs={seqs} ctx={context} heads={q_heads}/{kv_heads} d={head_dim} qk_norm={norms} splits={splits}{form}"
            ),
            buffers,
            build: Box::new(move |p| {
                let k = make(p);
                (k.launch_config_of(wide), k.args())
            }),
        });
    }
    out
}

/// Version 2's prefill attention over an FP8 cache: (runs of (first position, tokens) one a
/// sequence, query heads, kv heads, head_dim, block size). Qwen3-8B's heads on a 600-token prompt
/// and on a chunk at 300 with a 5-token tile at 1000 (blocks of 24: not a power of two),
/// Qwen3-0.6B's on two sequences and a decode token, SmolLM2's (head_dim 64) on a second chunk;
/// tiles of 128 and, where that cuts differently, of 64. Scales 0.6 / 1.4. The allowance is the
/// bf16 reference's over the decoded cache (its probabilities near a bf16 rounding boundary),
/// times v_scale.
fn prefill_cases(rng: &mut Rng) -> Vec<Case> {
    let (k_scale, v_scale) = (0.6f32, 1.4f32);
    let mut out = Vec::new();
    for &(ref runs, q_heads, kv_heads, head_dim, block_size) in &[
        (vec![(0usize, 600usize)], 32u32, 8u32, 128u32, 16u32),
        (vec![(300, 200), (1000, 5)], 32, 8, 128, 24),
        (vec![(0, 70), (37, 30), (300, 1)], 16, 8, 128, 16),
        (vec![(100, 150)], 9, 3, 64, 16),
    ] {
        let seqs = runs.len();
        let max_blocks = runs
            .iter()
            .map(|&(first, n)| (first + n).div_ceil(block_size as usize))
            .max()
            .unwrap_or(0);
        let num_blocks = seqs * max_blocks + 3;
        let ids = shuffled(rng, num_blocks);
        let tables: Vec<i32> = ids[..seqs * max_blocks].to_vec();
        let (mut token_seq, mut positions) = (Vec::new(), Vec::new());
        for (s, &(first, n)) in runs.iter().enumerate() {
            for p in first..first + n {
                token_seq.push(s as i32);
                positions.push(p as i32);
            }
        }
        let tokens = token_seq.len();
        let row = (kv_heads * head_dim) as usize;
        let width = (q_heads * head_dim) as usize;
        let cache = num_blocks * block_size as usize * row;
        let q = bf16_normal(rng, tokens * width, 1.0);
        let k_cache = e4m3_normal(rng, cache);
        let v_cache = e4m3_normal(rng, cache);
        let v2_tiles =
            prefill_attention_tiles_of(&token_seq, &positions, PrefillAttentionV2::TILE_TOKENS);
        let v1_tiles = prefill_attention_tiles_of(&token_seq, &positions, 64);
        let mut cuts = vec![v2_tiles.clone()];
        if v1_tiles != v2_tiles {
            cuts.push(v1_tiles);
        }
        for tiles in cuts {
            let num_tiles = tiles.len() as u32;
            let max = tiles.iter().map(|t| t[3]).max().unwrap_or(0);
            let args = PrefillAttention {
                out: DevicePtr::NULL,
                q: DevicePtr::NULL,
                k_cache: DevicePtr::NULL,
                v_cache: DevicePtr::NULL,
                block_tables: DevicePtr::NULL,
                tiles: DevicePtr::NULL,
                num_tiles,
                q_heads,
                kv_heads,
                head_dim,
                block_size,
                max_blocks_per_seq: max_blocks as u32,
                scale: 1.0 / (head_dim as f32).sqrt(),
            };
            let buffers = vec![
                buffer(
                    vec![0; (tokens + 64) * width * 2].into(),
                    Some(OutputKind::Bf16),
                ),
                buffer(q.clone(), None),
                buffer(k_cache.clone(), None),
                buffer(v_cache.clone(), None),
                buffer(i32_bytes(&tables).into(), None),
                buffer(i32_bytes(&tiles.concat()).into(), None),
            ];
            let (inputs, tables, tiles_for) = (buffers.clone(), tables.clone(), tiles.clone());
            let allowance = Allowance::new(0, move || {
                let q = bf16_values(inputs[1].init.bytes());
                let decode = |b: &[u8]| -> Vec<half::bf16> {
                    b.iter()
                        .map(|&x| half::bf16::from_f32(metrale_core::fp8::e4m3_to_f32(x)))
                        .collect()
                };
                let (kc, vc) = (
                    decode(inputs[2].init.bytes()),
                    decode(inputs[3].init.bytes()),
                );
                let scaled = PrefillAttention {
                    scale: args.scale * k_scale,
                    ..args
                };
                let mut extra = vec![0f32; (tokens + 64) * width];
                for r in prefill_attention_rows(
                    &scaled,
                    PrefillAttentionV2::KEY_TILE,
                    &tiles_for,
                    &q,
                    &tables,
                    &kc,
                    &vc,
                ) {
                    let at = &mut extra[r.token * width..][..width];
                    for (e, a) in at.iter_mut().zip(&r.allowance) {
                        *e = a * v_scale;
                    }
                }
                extra
            });
            out.push(Case {
                kernel: PrefillAttentionV2Fp8::NAME,
                gemm: None,
                allowance: Some(allowance),
                shape: format!(
                    "runs={runs:?} tiles={num_tiles} (<={max} tokens) heads={q_heads}/{kv_heads} d={head_dim} block={block_size}"
                ),
                buffers,
                build: Box::new(move |p| {
                    let v1 = PrefillAttention {
                        out: p[0],
                        q: p[1],
                        k_cache: p[2],
                        v_cache: p[3],
                        block_tables: p[4],
                        tiles: p[5],
                        ..args
                    };
                    launch_of(PrefillAttentionV2Fp8::of(&v1, k_scale, v_scale))
                }),
            });
        }
    }
    out
}

/// Whether `kernel` is one of the FP8 decode attentions (whose f32 partials take the decode
/// attention's absolute floor).
pub(super) fn is_fp8_decode_attention(kernel: metrale_core::KernelName) -> bool {
    kernel == PagedAttentionFp8::NAME
        || kernel == PagedAttentionQkvFp8::NAME
        || kernel == PagedAttentionQkvFp8::WIDE_NAME
}

/// The e4m3 comparison of a written cache: per element equal, or one e4m3 step apart (the
/// GPU's f32 put the value across a rounding boundary: its bf16 or its quotient by the scale);
/// at most one element in a thousand (and at least one allowed) one step apart. Returns
/// (elements compared, mismatches, the first mismatch's index, got and want values).
pub(super) fn compare_e4m3(got: &[u8], want: &[u8]) -> (usize, usize, Option<(usize, f64, f64)>) {
    let step = |a: u8, b: u8| {
        // Same sign and adjacent codes (codes are ordered by magnitude within a sign), or the
        // two zeros.
        (a & 0x80 == b & 0x80 && (a & 0x7F).abs_diff(b & 0x7F) == 1)
            || (a & 0x7F == 0 && b & 0x7F == 0)
    };
    let value = |x: u8| f64::from(metrale_core::fp8::e4m3_to_f32(x));
    let (mut steps, mut mismatches, mut first, mut first_step) = (0usize, 0usize, None, None);
    for (i, (&a, &b)) in got.iter().zip(want).enumerate() {
        if a == b {
            continue;
        }
        if step(a, b) {
            steps += 1;
            first_step.get_or_insert((i, value(a), value(b)));
            continue;
        }
        mismatches += 1;
        first.get_or_insert((i, value(a), value(b)));
    }
    let allowed_steps = (want.len() / 1000).max(1);
    if steps > allowed_steps {
        mismatches += steps;
        first = first.or(first_step);
    }
    (want.len(), mismatches, first)
}
