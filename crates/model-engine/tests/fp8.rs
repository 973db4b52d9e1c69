// SPDX-License-Identifier: MIT OR Apache-2.0
//! FP8 linears end to end on the host backend: a tiny Qwen3-shaped model with random weights,
//! its linears quantized at load (`LinearFormat::Fp8Quantize`) or read from an FP8 checkpoint this
//! test writes in the block-scale layout (`quant_method: fp8`, `weight_block_size: [128, 128]`,
//! `*.weight` in float8_e4m3fn beside `*.weight_scale_inv` in f32), against the BF16 model.
//!
//! The bound. E4M3 keeps 3 mantissa bits: rounding to nearest moves a weight by at most 2^-4 of
//! itself (half a unit in the last place), and for weights spread over a binade the error is about
//! uniform, RMS 2^-4 / sqrt(3) = 0.036 of the weight. A product's output `sum_i w_i a_i` then
//! carries `sum_i d_i w_i a_i` with independent `d_i`: 0.036 of the output's RMS. The model has 4
//! FP8 products a layer over 2 layers; if every one carried the whole signal their errors would
//! add in quadrature to 0.036 x sqrt(8) = 0.10 of the logits' RMS, an upper estimate (the
//! embedding and the BF16 LM head add none, and the residual stream dilutes each layer's share).
//! Ignoring the scales multiplies every weight by 1 / scale (about 448 / block amax): far past it.

use std::sync::Arc;

use half::bf16;
use metrale_cache::BlockTable;
use metrale_config::ModelConfig;
use metrale_gpu_runtime::{GpuBackend, HostBackend};
use metrale_model_engine::{
    LinearFormat, Model, ModelOptions, StepInput, TensorRole, Tuning, expected_shape,
    expected_tensors,
};
use metrale_model_weights::{
    Fp8Scheme, Fp8Tensor, HostTensor, SafetensorsCheckpoint, WeightError, WeightSource,
};
use safetensors::Dtype;

/// The upper estimate of the logits' relative error the FP8 linears may cause (module docs).
const FP8_LOGIT_BOUND: f32 = 0.10;

const CONFIG: &str = r#"{"model_type": "qwen3", "hidden_size": 256, "intermediate_size": 512,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
    "num_hidden_layers": 2, "vocab_size": 320, "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0, "max_position_embeddings": 256, "tie_word_embeddings": false}"#;

fn config() -> ModelConfig {
    metrale_config::from_config_json(CONFIG).expect("a valid config")
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

/// The logits of a 9-token prefill (the library path: 9 rows) and then 3 decode steps of one
/// token (the FP8 GEMV), concatenated.
fn logits(source: &dyn WeightSource, format: &LinearFormat) -> Vec<f32> {
    let c = config();
    let gpu: Arc<dyn GpuBackend> = Arc::new(HostBackend::new(1 << 30));
    let options = ModelOptions {
        kv_cache: Default::default(),
        max_tokens_per_step: 16,
        max_seqs: 1,
        max_logit_rows: 1,
        max_seq_len: 64,
        num_blocks: 4,
        block_size: 16,
        state_slots: 0,
    };
    let tuning = Tuning::hopper().expect("the kernel tree's tuning");
    let mut model = Model::load_with(c, source, gpu, options, tuning, format, &mut |_, _, _| {})
        .expect("the model loads on the host");
    let table = BlockTable {
        blocks: vec![0, 1, 2, 3],
    };
    let prompt: Vec<u32> = (0..12).map(|i| (i * 37 + 11) % 320).collect();
    let mut out = Vec::new();
    let mut at = 0u32;
    for chunk in [&prompt[..9], &prompt[9..10], &prompt[10..11], &prompt[11..]] {
        let positions: Vec<u32> = (at..at + chunk.len() as u32).collect();
        out.extend(
            model
                .forward(&StepInput {
                    tokens: chunk,
                    positions: &positions,
                    token_seq: &vec![0; chunk.len()],
                    block_tables: &[&table],
                    logit_rows: &[chunk.len() - 1],
                    state_slots: &[],
                })
                .expect("the step runs"),
        );
        at += chunk.len() as u32;
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
fn fp8_on_the_fly_agrees_with_bf16_within_e4m3_precision() {
    let source = Random(config());
    let bf16 = logits(&source, &LinearFormat::Bf16);
    let fp8 = logits(&source, &LinearFormat::Fp8Quantize);
    let err = relative_l2(&fp8, &bf16);
    eprintln!("FP8 on the fly vs BF16: relative L2 error of the logits {err:.4}");
    assert!(err <= FP8_LOGIT_BOUND, "{err}");
    // Not trivially: the FP8 weights do change the logits.
    assert!(err > 1e-3, "{err}");
}

/// One tensor of a checkpoint being written: its dtype, shape and bytes.
type Entry = (Dtype, Vec<usize>, Vec<u8>);

/// Writes the random model as a fine-grained FP8 checkpoint (every dense linear quantized in
/// 128 x 128 blocks, `weight_scale_inv` beside it; the LM head kept BF16 as
/// `modules_to_not_convert` says), with `scale_of` applied to each stored scale.
fn write_fp8_checkpoint(dir: &std::path::Path, scale_of: impl Fn(f32) -> f32) {
    let c = config();
    let source = Random(c.clone());
    let mut tensors: Vec<(String, Entry)> = Vec::new();
    for role in expected_tensors(&c) {
        let name = role.hf_name();
        let t = source.load(&name).unwrap();
        let linear = matches!(
            role,
            TensorRole::Q(_)
                | TensorRole::K(_)
                | TensorRole::V(_)
                | TensorRole::O(_)
                | TensorRole::Gate(_)
                | TensorRole::Up(_)
                | TensorRole::Down(_)
        );
        if linear {
            let q = Fp8Tensor::quantize(&t).unwrap();
            let scales: Vec<u8> = q
                .scales
                .iter()
                .flat_map(|s| scale_of(*s).to_le_bytes())
                .collect();
            let module = name.strip_suffix(".weight").unwrap();
            tensors.push((
                format!("{module}.weight_scale_inv"),
                (Dtype::F32, vec![q.n.div_ceil(128), q.scale_cols()], scales),
            ));
            tensors.push((name, (Dtype::F8_E4M3, t.shape.clone(), q.data)));
        } else {
            let bytes = t.data.iter().flat_map(|v| v.to_le_bytes()).collect();
            tensors.push((name, (Dtype::BF16, t.shape.clone(), bytes)));
        }
    }
    let views: Vec<(String, safetensors::tensor::TensorView)> = tensors
        .iter()
        .map(|(name, (dtype, shape, bytes))| {
            let view = safetensors::tensor::TensorView::new(*dtype, shape.clone(), bytes).unwrap();
            (name.clone(), view)
        })
        .collect();
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
    let mut json: serde_json::Value = serde_json::from_str(CONFIG).unwrap();
    json["quantization_config"] = serde_json::json!({
        "quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
        "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head"]
    });
    std::fs::write(dir.join("config.json"), json.to_string()).unwrap();
}

/// The checkpoint's logits, loaded as the server loads it: the scheme from its config.json.
fn checkpoint_logits(dir: &std::path::Path) -> Vec<f32> {
    let text = std::fs::read_to_string(dir.join("config.json")).unwrap();
    let scheme = Fp8Scheme::from_config_json(&text)
        .unwrap()
        .expect("an FP8 scheme");
    let checkpoint = SafetensorsCheckpoint::open(dir).unwrap();
    logits(&checkpoint, &LinearFormat::Fp8Stored(scheme))
}

#[test]
fn an_fp8_block_scaled_checkpoint_loads_and_runs() {
    let dir = tempfile::tempdir().unwrap();
    write_fp8_checkpoint(dir.path(), |s| s);
    let stored = checkpoint_logits(dir.path());
    // The same bytes and scales as quantizing at load (every stacked part is whole 128-row
    // blocks), through the same kernels: the same logits.
    let source = Random(config());
    assert_eq!(stored, logits(&source, &LinearFormat::Fp8Quantize));
    let err = relative_l2(&stored, &logits(&source, &LinearFormat::Bf16));
    assert!(err <= FP8_LOGIT_BOUND, "{err}");
    // Without its quantization_config the E4M3 tensors are refused by name, not read as BF16.
    let checkpoint = SafetensorsCheckpoint::open(dir.path()).unwrap();
    let gpu: Arc<dyn GpuBackend> = Arc::new(HostBackend::new(1 << 30));
    let options = ModelOptions {
        kv_cache: Default::default(),
        max_tokens_per_step: 16,
        max_seqs: 1,
        max_logit_rows: 1,
        max_seq_len: 64,
        num_blocks: 4,
        block_size: 16,
        state_slots: 0,
    };
    let err = Model::load(
        config(),
        &checkpoint,
        gpu,
        options,
        Tuning::hopper().unwrap(),
        &mut |_, _, _| {},
    )
    .err()
    .expect("refused")
    .to_string();
    assert!(err.contains("float8_e4m3fn"), "{err}");
}

#[test]
fn a_checkpoint_whose_scales_are_ignored_misses_the_bound() {
    // Scales of 1: the E4M3 values taken as the weights, what a loader or kernel that dropped the
    // scales would compute. The bound catches it more than ten times over.
    let dir = tempfile::tempdir().unwrap();
    write_fp8_checkpoint(dir.path(), |_| 1.0);
    let wrong = checkpoint_logits(dir.path());
    let err = relative_l2(&wrong, &logits(&Random(config()), &LinearFormat::Bf16));
    eprintln!("scales ignored: relative L2 error of the logits {err:.3}");
    assert!(err > 10.0 * FP8_LOGIT_BOUND, "{err}");
}
