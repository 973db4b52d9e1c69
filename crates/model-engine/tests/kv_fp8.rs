// SPDX-License-Identifier: MIT OR Apache-2.0
//! The FP8 KV cache end to end on the host backend: a tiny Qwen3-shaped model with random
//! weights (head_dim 128, GQA 2), its logits with `--kv-cache-dtype fp8` against the bf16 cache's.
//!
//! The bound. Each cached key and value element is rounded to E4M3 (3 mantissa bits: at most 2^-4
//! of itself, RMS about 0.036 of it for values spread over a binade). A score `q . k` then carries
//! about 0.036 of its size in error and each attention output about 0.036 of its RMS; the
//! attention output is one of two additions to the residual stream a layer, so over 2 layers the
//! logits' relative error stays well under 0.036 x sqrt(2) x 2 = 0.10. Reading the cache with a
//! wrong scale (every value off by a factor), or in a wrong layout (another head's keys), moves the
//! logits by far more than that; the kernels' tests and check-kernels hold the scale and layout
//! exactly.

use std::sync::Arc;

use half::bf16;
use metrale_cache::BlockTable;
use metrale_config::ModelConfig;
use metrale_core::KvCacheDtype;
use metrale_gpu_runtime::{GpuBackend, HostBackend};
use metrale_model_engine::{Model, ModelError, ModelOptions, StepInput, Tuning, expected_shape};
use metrale_model_weights::{HostTensor, WeightError, WeightSource};

const BOUND: f32 = 0.10;

fn config(head_dim: usize) -> ModelConfig {
    let json = format!(
        r#"{{"model_type": "qwen3", "hidden_size": 256, "intermediate_size": 512,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": {head_dim},
        "num_hidden_layers": 2, "vocab_size": 320, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "max_position_embeddings": 256, "tie_word_embeddings": false}}"#
    );
    metrale_config::from_config_json(&json).expect("a valid config")
}

/// Random weights at the config's shapes, the same for a name every time.
struct Random(ModelConfig);

impl WeightSource for Random {
    fn shape(&self, name: &str) -> Option<Vec<usize>> {
        expected_shape(&self.0, name)
    }

    fn load(&self, name: &str) -> Result<HostTensor, WeightError> {
        let shape = self.shape(name).expect("an expected tensor");
        let n: usize = shape.iter().product();
        let mut seed = name.bytes().fold(0x9E37_79B9_7F4A_7C15u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x100_0000_01B3)
        });
        let mut uniform = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed >> 11) as f32 / (1u64 << 53) as f32 * 2.0 - 1.0
        };
        let (offset, scale) = if name.contains("norm") {
            (1.0, 0.2)
        } else if shape.len() == 2 && !name.contains("embed") {
            (0.0, 1.7 / (shape[1] as f32).sqrt())
        } else {
            (0.0, 1.0)
        };
        let data = (0..n)
            .map(|_| bf16::from_f32(offset + scale * uniform()))
            .collect();
        Ok(HostTensor { shape, data })
    }

    fn describe(&self) -> String {
        "random".into()
    }
}

/// [`Random`] with per-layer FP8 KV cache scales under the names `names` gives (`{l}` the layer).
struct Scaled {
    inner: Random,
    /// (name pattern, value).
    scales: Vec<(String, f32)>,
}

impl Scaled {
    fn find(&self, name: &str) -> Option<f32> {
        (0..2).find_map(|l| {
            self.scales
                .iter()
                .find(|(n, _)| n.replace("{l}", &l.to_string()) == name)
                .map(|&(_, v)| v)
        })
    }
}

impl WeightSource for Scaled {
    fn shape(&self, name: &str) -> Option<Vec<usize>> {
        match self.find(name) {
            Some(_) => Some(vec![]),
            None => self.inner.shape(name),
        }
    }
    fn load(&self, name: &str) -> Result<HostTensor, WeightError> {
        self.inner.load(name)
    }
    fn load_f32(&self, name: &str) -> Result<(Vec<usize>, Vec<f32>), WeightError> {
        match self.find(name) {
            Some(v) => Ok((vec![], vec![v])),
            None => {
                let t = self.inner.load(name)?;
                Ok((t.shape, t.data.into_iter().map(f32::from).collect()))
            }
        }
    }
    fn describe(&self) -> String {
        "random with KV scales".into()
    }
}

fn scaled(scales: &[(&str, f32)]) -> Scaled {
    Scaled {
        inner: Random(config(128)),
        scales: scales.iter().map(|&(n, v)| (n.to_string(), v)).collect(),
    }
}

fn load(kv_cache: KvCacheDtype, fused: bool) -> Result<Model, ModelError> {
    load_from(&Random(config(128)), kv_cache, fused)
}

fn load_from(
    source: &dyn WeightSource,
    kv_cache: KvCacheDtype,
    fused: bool,
) -> Result<Model, ModelError> {
    let c = config(128);
    let gpu: Arc<dyn GpuBackend> = Arc::new(HostBackend::new(1 << 30));
    let options = ModelOptions {
        kv_cache,
        max_tokens_per_step: 16,
        max_seqs: 2,
        max_logit_rows: 2,
        max_seq_len: 64,
        num_blocks: 8,
        block_size: 16,
        state_slots: 0,
    };
    let mut tuning = Tuning::hopper().expect("the kernel tree's tuning");
    tuning.fused_qkv_attention = fused;
    Model::load(c, source, gpu, options, tuning, &mut |_, _, _| {})
}

/// The logits of: sequence 0's 9-token prefill; then a mixed step (sequence 0's next token beside
/// sequence 1's 5-token prefill); then 3 decode steps of sequence 0 alone (one token: the fused
/// decode attention where `fused`), concatenated.
fn logits(kv_cache: KvCacheDtype, fused: bool) -> Vec<f32> {
    logits_of(load(kv_cache, fused).expect("the model loads on the host"))
}

fn logits_of(mut model: Model) -> Vec<f32> {
    let tables = [
        BlockTable {
            blocks: vec![3, 0, 5, 1],
        },
        BlockTable {
            blocks: vec![2, 6, 4, 7],
        },
    ];
    let prompt: Vec<u32> = (0..13).map(|i| (i * 37 + 11) % 320).collect();
    let other: Vec<u32> = (0..5).map(|i| (i * 53 + 7) % 320).collect();
    let mut out = Vec::new();
    let mut run = |tokens: &[u32], positions: &[u32], seqs: &[u32], rows: &[usize]| {
        out.extend(
            model
                .forward(&StepInput {
                    tokens,
                    positions,
                    token_seq: seqs,
                    block_tables: &[&tables[0], &tables[1]],
                    logit_rows: rows,
                    state_slots: &[],
                })
                .expect("the step runs"),
        );
    };
    let p: Vec<u32> = (0..9).collect();
    run(&prompt[..9], &p, &[0; 9], &[8]);
    let mut mixed = vec![prompt[9]];
    mixed.extend(&other);
    run(&mixed, &[9, 0, 1, 2, 3, 4], &[0, 1, 1, 1, 1, 1], &[0, 5]);
    for at in 10..13u32 {
        run(&prompt[at as usize..at as usize + 1], &[at], &[0], &[0]);
    }
    out
}

/// `|got - want| / |want|` over all logits.
fn relative_l2(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    let d: f64 = got
        .iter()
        .zip(want)
        .map(|(a, b)| f64::from(a - b).powi(2))
        .sum();
    let r: f64 = want.iter().map(|b| f64::from(*b).powi(2)).sum();
    (d / r).sqrt() as f32
}

#[test]
fn fp8_kv_agrees_with_bf16_kv_within_e4m3_precision() {
    let bf16 = logits(KvCacheDtype::Bf16, true);
    let fp8 = logits(KvCacheDtype::Fp8, true);
    let err = relative_l2(&fp8, &bf16);
    eprintln!("FP8 KV vs BF16 KV: relative L2 error of the logits {err:.4}");
    assert!(err <= BOUND, "{err}");
    // Not trivially: the e4m3 cache does change the logits.
    assert!(err > 1e-4, "{err}");
    // The fused decode attention over the FP8 cache computes what the two launches do.
    let unfused = logits(KvCacheDtype::Fp8, false);
    assert_eq!(fp8, unfused);
}

#[test]
fn fp8_kv_at_a_head_dim_without_kernels_is_refused() {
    let c = config(96);
    let gpu = HostBackend::new(1 << 30);
    let err = ModelOptions::check_kv_cache(&c, &gpu, KvCacheDtype::Fp8).unwrap_err();
    assert!(err.to_string().contains("head_dim 96"), "{err}");
    ModelOptions::check_kv_cache(&c, &gpu, KvCacheDtype::Bf16).unwrap();
    assert!(load(KvCacheDtype::Fp8, true).is_ok());
}

/// A backend whose kernel set lacks the FP8 cache's kernels is refused by name, before loading.
#[test]
fn fp8_kv_on_a_backend_without_its_kernels_is_refused() {
    let c = config(128);
    let gpu = metrale_gpu_runtime::MockBackend::new().without_module("prefill_attention");
    let err = ModelOptions::check_kv_cache(&c, &gpu, KvCacheDtype::Fp8).unwrap_err();
    let said = err.to_string();
    assert!(
        said.contains("prefill_attention_v2_fp8") && said.contains("--kv-cache-dtype bf16"),
        "{said}"
    );
    ModelOptions::check_kv_cache(
        &c,
        &metrale_gpu_runtime::MockBackend::new(),
        KvCacheDtype::Fp8,
    )
    .unwrap();
}

#[test]
fn the_fp8_pool_takes_half_the_bytes() {
    let c = config(128);
    let (b, f) = (
        ModelOptions::kv_bytes_per_block(&c, 16, KvCacheDtype::Bf16),
        ModelOptions::kv_bytes_per_block(&c, 16, KvCacheDtype::Fp8),
    );
    assert_eq!(b, 2 * f);
    assert_eq!(f, 2 * 2 * 16 * 2 * 128);
}

/// The checkpoint's `k_scale` / `v_scale` under each layout's names are read per layer; a pair
/// with one half missing, or a scale that is not positive, is refused.
#[test]
fn checkpoint_kv_scales_are_read_under_every_layout() {
    use metrale_model_engine::checkpoint_kv_scales;
    let attn = "model.layers.{l}.self_attn";
    for (k, v) in [("k_scale", "v_scale"), ("k_proj.k_scale", "v_proj.v_scale")] {
        let s = scaled(&[
            (&format!("{attn}.{k}"), 0.5),
            (&format!("{attn}.{v}"), 0.25),
        ]);
        assert_eq!(checkpoint_kv_scales(&s, 1).unwrap(), Some((0.5, 0.25)));
    }
    let s = scaled(&[(&format!("{attn}.kv_scale"), 0.75)]);
    assert_eq!(checkpoint_kv_scales(&s, 0).unwrap(), Some((0.75, 0.75)));
    assert_eq!(checkpoint_kv_scales(&scaled(&[]), 0).unwrap(), None);
    let half = scaled(&[(&format!("{attn}.k_scale"), 0.5)]);
    let err = checkpoint_kv_scales(&half, 0).unwrap_err().to_string();
    assert!(err.contains("k_scale") && err.contains("pair"), "{err}");
    let zero = scaled(&[
        (&format!("{attn}.k_scale"), 0.0),
        (&format!("{attn}.v_scale"), 1.0),
    ]);
    assert!(checkpoint_kv_scales(&zero, 0).is_err());
}

/// A model whose checkpoint has KV scales uses them: the logits move (other e4m3 roundings, in
/// another range) but stay within the bound of the bf16 cache's; the log line says so.
#[test]
fn checkpoint_kv_scales_reach_the_cache() {
    let attn = "model.layers.{l}.self_attn";
    let source = scaled(&[
        (&format!("{attn}.k_scale"), 0.03),
        (&format!("{attn}.v_scale"), 0.007),
    ]);
    let model = load_from(&source, KvCacheDtype::Fp8, true).unwrap();
    let said = model.kv_cache_scales().to_string();
    assert!(
        said.contains("k_scale / v_scale in 2 attention layers"),
        "{said}"
    );
    let with_scales = logits_of(model);
    let bf16 = logits(KvCacheDtype::Bf16, true);
    let unit = logits(KvCacheDtype::Fp8, true);
    let err = relative_l2(&with_scales, &bf16);
    eprintln!("FP8 KV with checkpoint scales vs BF16 KV: relative L2 error {err:.4}");
    assert!(err <= BOUND, "{err}");
    assert_ne!(with_scales, unit, "the scales changed nothing");
    let unit_said = load(KvCacheDtype::Fp8, true)
        .unwrap()
        .kv_cache_scales()
        .to_string();
    assert!(unit_said.contains("scales 1.0"), "{unit_said}");
}
