// SPDX-License-Identifier: MIT OR Apache-2.0
//! FP8 routed experts end to end on the host backend: a tiny qwen3_moe with random weights (a
//! dense MLP layer and two sparse ones; expert width 96, so each expert's gate and up rows fill
//! no whole 128-row block and the stacks take a scale per row), its linears and experts quantized
//! at load (`LinearFormat::Fp8Quantize`) or read from an FP8 checkpoint this test writes (every
//! linear and every expert projection `*.weight` in float8_e4m3fn beside `*.weight_scale_inv`),
//! against the BF16 model. A 20-token prefill takes the grouped expert path (the tensor-core
//! weight streams' FP8 forms, the Hopper tree's `moe_grouped_min_rows` 16) or the per-assignment
//! FP8 launches (`moe_grouped_min_rows` 64), the decode steps the FP8 decode launches; with every
//! step grouped, the FP8 forms give the logits of BF16 experts holding the dequantised weights
//! bit for bit (the path that dequantised a layer's stacks into a BF16 scratch did the same).
//!
//! The bound, as `fp8.rs` works it out: E4M3's rounding error is about 0.036 of a product's
//! output RMS; the model has 3 layers of attention (q|k|v and o), one dense MLP (gate|up, down)
//! and two sparse layers (the experts' gate|up and down, per token the same count of products):
//! 12 FP8 products, whose errors if each carried the whole signal would add in quadrature to
//! 0.036 x sqrt(12) = 0.125 of the logits' RMS, an upper estimate (measured: 0.102). Ignoring the
//! experts' scales multiplies their weights by about 448 / block amax: far past it (1.26).

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

/// The upper estimate of the logits' relative error the FP8 products may cause (module docs).
const FP8_LOGIT_BOUND: f32 = 0.125;

const CONFIG: &str = r#"{"model_type": "qwen3_moe", "hidden_size": 256, "intermediate_size": 512,
    "moe_intermediate_size": 96, "num_experts": 8, "num_experts_per_tok": 2,
    "norm_topk_prob": true, "decoder_sparse_step": 1, "mlp_only_layers": [1],
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
    "num_hidden_layers": 3, "vocab_size": 320, "rms_norm_eps": 1e-6,
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
        } else if name.ends_with("mlp.gate.weight") {
            // The router: logits spread over a few units, so routing is not a near-tie.
            (0.0, 8.0 / (shape[1] as f32).sqrt())
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

fn options() -> ModelOptions {
    ModelOptions {
        kv_cache: Default::default(),
        max_tokens_per_step: 32,
        max_seqs: 1,
        max_logit_rows: 1,
        max_seq_len: 64,
        num_blocks: 4,
        block_size: 16,
        state_slots: 0,
    }
}

/// The prompt: 20 tokens of prefill (the grouped expert path), then 4 decode steps.
fn prompt() -> Vec<u32> {
    (0..24).map(|i| (i * 37 + 11) % 320).collect()
}

/// Every step's logits (the prefill's last row, then each decode step's), teacher-forced on
/// [`prompt`].
fn logits(source: &dyn WeightSource, format: &LinearFormat) -> Vec<Vec<f32>> {
    // The prefill's FP8 experts on the grouped path (the Hopper tree's threshold is 16 rows).
    logits_with(source, format, fp8_experts())
}

/// The kernel tree's tuning with the routed experts FP8 where the linears are (the tree keeps
/// them BF16 until their kernels have run on a GPU).
fn fp8_experts() -> Tuning {
    let mut tuning = Tuning::hopper().expect("the kernel tree's tuning");
    tuning.set("moe_fp8_experts", "on").unwrap();
    tuning
}

/// [`logits`] under `tuning`.
fn logits_with(source: &dyn WeightSource, format: &LinearFormat, tuning: Tuning) -> Vec<Vec<f32>> {
    let gpu: Arc<dyn GpuBackend> = Arc::new(HostBackend::new(1 << 30));
    let mut model = Model::load_with(
        config(),
        source,
        gpu,
        options(),
        tuning,
        format,
        &mut |_, _, _| {},
    )
    .expect("the model loads on the host");
    let table = BlockTable {
        blocks: vec![0, 1, 2, 3],
    };
    let prompt = prompt();
    let mut out = Vec::new();
    let mut at = 0usize;
    let mut chunks = vec![&prompt[..20]];
    chunks.extend(prompt[20..].chunks(1));
    for chunk in chunks {
        let positions: Vec<u32> = (at as u32..(at + chunk.len()) as u32).collect();
        out.push(
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
        at += chunk.len();
    }
    out
}

/// `|got - want| / |want|` over every step's logits.
fn relative_l2(got: &[Vec<f32>], want: &[Vec<f32>]) -> f32 {
    let (mut d, mut r) = (0f64, 0f64);
    for (g, w) in got.iter().zip(want) {
        assert_eq!(g.len(), w.len());
        d += g
            .iter()
            .zip(w)
            .map(|(a, b)| f64::from(a - b).powi(2))
            .sum::<f64>();
        r += w.iter().map(|b| f64::from(*b).powi(2)).sum::<f64>();
    }
    (d / r).sqrt() as f32
}

fn argmax(v: &[f32]) -> usize {
    (0..v.len())
        .max_by(|&a, &b| v[a].total_cmp(&v[b]).then(b.cmp(&a)))
        .unwrap()
}

/// The top-2 margin of a step's logits relative to their RMS.
fn margin(v: &[f32]) -> f32 {
    let mut s = v.to_vec();
    s.sort_by(|a, b| b.total_cmp(a));
    let rms = (v.iter().map(|x| x * x).sum::<f32>() / v.len() as f32).sqrt();
    (s[0] - s[1]) / rms
}

#[test]
fn fp8_experts_agree_with_bf16_within_e4m3_precision() {
    let source = Random(config());
    let bf16 = logits(&source, &LinearFormat::Bf16);
    let fp8 = logits(&source, &LinearFormat::Fp8Quantize);
    let err = relative_l2(&fp8, &bf16);
    eprintln!("FP8 (linears and experts) vs BF16: relative L2 error of the logits {err:.4}");
    assert!(err <= FP8_LOGIT_BOUND, "{err}");
    assert!(err > 1e-3, "the FP8 weights change the logits: {err}");
    // Greedy choices: the same wherever BF16's top-2 margin is wider than twice the FP8 error
    // (relative to the logits' RMS, as the error is); closer margins may flip either way.
    // Random weights give narrow margins (0.01 to 0.3 of the RMS here, 0.10 the error), so few
    // steps qualify: the greedy text on real weights is `moe_exact.rs`'s FP8 test (SmolLM2's
    // FFN as experts against dense SmolLM2, both FP8).
    let mut compared = 0;
    for (step, (f, b)) in fp8.iter().zip(&bf16).enumerate() {
        let m = margin(b);
        eprintln!(
            "step {step}: BF16 argmax {} (margin {m:.3}), FP8 argmax {}",
            argmax(b),
            argmax(f)
        );
        if m > 2.0 * err {
            compared += 1;
            assert_eq!(argmax(f), argmax(b), "step {step}");
        }
    }
    assert!(compared >= 1, "no step had a clear choice");
    // The 20-token prefill's experts on the per-assignment FP8 launches instead (products of
    // the f32 dequantised weights, not of their bf16 rounding; expert outputs unrounded before
    // the weighted sum): as close to BF16, and near the grouped run.
    let mut per = fp8_experts();
    per.set("moe_grouped_min_rows", "64").unwrap();
    let per_assignment = logits_with(&source, &LinearFormat::Fp8Quantize, per);
    let err2 = relative_l2(&per_assignment, &bf16);
    let apart = relative_l2(&per_assignment, &fp8);
    eprintln!("per-assignment prefill: {err2:.4} from BF16, {apart:.2e} from the grouped run");
    assert!(err2 <= FP8_LOGIT_BOUND, "{err2}");
    assert!(apart > 0.0 && apart <= 0.1 * err, "{apart}");
}

/// One tensor of a checkpoint being written: its dtype, shape and bytes.
type Entry = (Dtype, Vec<usize>, Vec<u8>);

/// Whether a tensor is an FP8 linear of the written checkpoint: the dense products and every
/// expert projection (not the router, the embedding, the LM head or the norms).
fn is_fp8_linear(role: TensorRole) -> bool {
    matches!(
        role,
        TensorRole::Q(_)
            | TensorRole::K(_)
            | TensorRole::V(_)
            | TensorRole::O(_)
            | TensorRole::Gate(_)
            | TensorRole::Up(_)
            | TensorRole::Down(_)
            | TensorRole::ExpertGate(..)
            | TensorRole::ExpertUp(..)
            | TensorRole::ExpertDown(..)
    )
}

/// Writes the random model as a fine-grained FP8 checkpoint (each FP8 linear quantized in
/// 128 x 128 blocks, `weight_scale_inv` beside it; the router BF16, and the LM head as
/// `modules_to_not_convert` says), with `expert_scale` applied to each expert's stored scales.
fn write_fp8_checkpoint(dir: &std::path::Path, expert_scale: impl Fn(f32) -> f32) {
    let c = config();
    let source = Random(c.clone());
    let mut tensors: Vec<(String, Entry)> = Vec::new();
    for role in expected_tensors(&c) {
        let name = role.hf_name();
        let t = source.load(&name).unwrap();
        if is_fp8_linear(role) {
            let expert = matches!(
                role,
                TensorRole::ExpertGate(..) | TensorRole::ExpertUp(..) | TensorRole::ExpertDown(..)
            );
            let q = Fp8Tensor::quantize(&t).unwrap();
            let scales: Vec<u8> = q
                .scales
                .iter()
                .map(|&s| if expert { expert_scale(s) } else { s })
                .flat_map(f32::to_le_bytes)
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
    write(dir, &tensors, |json| {
        json["quantization_config"] = serde_json::json!({
            "quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
            "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head"]
        });
    });
}

fn write(
    dir: &std::path::Path,
    tensors: &[(String, Entry)],
    edit: impl FnOnce(&mut serde_json::Value),
) {
    let views: Vec<(String, safetensors::tensor::TensorView)> = tensors
        .iter()
        .map(|(name, (dtype, shape, bytes))| {
            let view = safetensors::tensor::TensorView::new(*dtype, shape.clone(), bytes).unwrap();
            (name.clone(), view)
        })
        .collect();
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
    let mut json: serde_json::Value = serde_json::from_str(CONFIG).unwrap();
    edit(&mut json);
    std::fs::write(dir.join("config.json"), json.to_string()).unwrap();
}

fn scheme(dir: &std::path::Path) -> Fp8Scheme {
    let text = std::fs::read_to_string(dir.join("config.json")).unwrap();
    Fp8Scheme::from_config_json(&text)
        .unwrap()
        .expect("an FP8 scheme")
}

/// The checkpoint's logits, loaded as the server loads it: the scheme from its config.json.
fn checkpoint_logits(dir: &std::path::Path) -> Vec<Vec<f32>> {
    let checkpoint = SafetensorsCheckpoint::open(dir).unwrap();
    logits(&checkpoint, &LinearFormat::Fp8Stored(scheme(dir)))
}

#[test]
fn an_fp8_checkpoint_with_fp8_experts_runs_as_quantizing_at_load() {
    let dir = tempfile::tempdir().unwrap();
    write_fp8_checkpoint(dir.path(), |s| s);
    let stored = checkpoint_logits(dir.path());
    // The same bytes and scales as quantizing at load (every dense stack's parts are whole
    // 128-row blocks; each expert's projections are quantized on their own grids both ways),
    // through the same kernels: the same logits.
    let source = Random(config());
    assert!(stored == logits(&source, &LinearFormat::Fp8Quantize));
    // The experts' scales are read: with every expert scale 1 (the E4M3 codes taken as the
    // weights) the logits miss the bound many times over.
    let wrong = tempfile::tempdir().unwrap();
    write_fp8_checkpoint(wrong.path(), |_| 1.0);
    let err = relative_l2(
        &checkpoint_logits(wrong.path()),
        &logits(&source, &LinearFormat::Bf16),
    );
    eprintln!("expert scales ignored: relative L2 error of the logits {err:.3}");
    assert!(err > 10.0 * FP8_LOGIT_BOUND, "{err}");
}

#[test]
fn fp8_expert_stacks_are_refused_before_loading() {
    // transformers 5's fused expert stacks stored as E4M3: a layout whose scales the loader does
    // not read, refused by name before any weight uploads.
    let c = config();
    let source = Random(c.clone());
    let m = c.moe.as_ref().unwrap();
    let (e, i, h) = (m.num_experts, m.expert_intermediate, c.hidden_size);
    let mut tensors: Vec<(String, Entry)> = Vec::new();
    for role in expected_tensors(&c) {
        if matches!(
            role,
            TensorRole::ExpertGate(..) | TensorRole::ExpertUp(..) | TensorRole::ExpertDown(..)
        ) {
            continue;
        }
        let name = role.hf_name();
        let t = source.load(&name).unwrap();
        let bytes = t.data.iter().flat_map(|v| v.to_le_bytes()).collect();
        tensors.push((name, (Dtype::BF16, t.shape.clone(), bytes)));
    }
    for l in [0, 2] {
        let layer = |rest: &str| format!("model.layers.{l}.mlp.experts.{rest}");
        tensors.push((
            layer("gate_up_proj"),
            (Dtype::F8_E4M3, vec![e, 2 * i, h], vec![0x38; e * 2 * i * h]),
        ));
        tensors.push((
            layer("down_proj"),
            (Dtype::F8_E4M3, vec![e, h, i], vec![0x38; e * h * i]),
        ));
    }
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), &tensors, |json| {
        json["quantization_config"] = serde_json::json!({
            "quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
            "modules_to_not_convert": ["lm_head"]
        });
    });
    let checkpoint = SafetensorsCheckpoint::open(dir.path()).unwrap();
    let gpu: Arc<dyn GpuBackend> = Arc::new(HostBackend::new(1 << 30));
    let err = Model::load_with(
        c,
        &checkpoint,
        gpu,
        options(),
        fp8_experts(),
        &LinearFormat::Fp8Stored(scheme(dir.path())),
        &mut |done, _, _| assert_eq!(done, 0, "refused before any upload"),
    )
    .err()
    .expect("refused")
    .to_string();
    assert!(
        err.contains("mlp.experts.gate_up_proj") && err.contains("stored as FP8"),
        "{err}"
    );
}

/// Writes the random model twice: as an FP8 checkpoint whose expert projections alone are FP8
/// (each quantized in 128 x 128 blocks, `weight_scale_inv` beside it; every other linear BF16 and
/// named in `modules_to_not_convert`) into `fp8`, and as a BF16 checkpoint whose experts hold
/// those FP8 weights dequantised (`bf16(e4m3 × scale)`, what `fp8_dequant_bf16` writes) into
/// `bf16`.
fn write_expert_checkpoints(fp8: &std::path::Path, bf16: &std::path::Path) {
    let c = config();
    let source = Random(c.clone());
    let mut quantized: Vec<(String, Entry)> = Vec::new();
    let mut dequantized: Vec<(String, Entry)> = Vec::new();
    let bf16_entry = |t: &HostTensor| -> Entry {
        let bytes = t.data.iter().flat_map(|v| v.to_le_bytes()).collect();
        (Dtype::BF16, t.shape.clone(), bytes)
    };
    for role in expected_tensors(&c) {
        let name = role.hf_name();
        let t = source.load(&name).unwrap();
        let expert = matches!(
            role,
            TensorRole::ExpertGate(..) | TensorRole::ExpertUp(..) | TensorRole::ExpertDown(..)
        );
        if !expert {
            quantized.push((name.clone(), bf16_entry(&t)));
            dequantized.push((name, bf16_entry(&t)));
            continue;
        }
        let q = Fp8Tensor::quantize(&t).unwrap();
        let scales = q.scales.iter().flat_map(|s| s.to_le_bytes()).collect();
        let module = name.strip_suffix(".weight").unwrap();
        quantized.push((
            format!("{module}.weight_scale_inv"),
            (Dtype::F32, vec![q.n.div_ceil(128), q.scale_cols()], scales),
        ));
        let mut back = q.dequantize();
        back.shape = t.shape.clone();
        dequantized.push((name.clone(), bf16_entry(&back)));
        quantized.push((name, (Dtype::F8_E4M3, t.shape.clone(), q.data)));
    }
    write(fp8, &quantized, |json| {
        json["quantization_config"] = serde_json::json!({
            "quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
            "weight_block_size": [128, 128],
            "modules_to_not_convert": [
                "lm_head", "self_attn", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"
            ]
        });
    });
    write(bf16, &dequantized, |_| {});
}

/// The FP8 experts' grouped forms give the logits of BF16 experts holding the dequantised
/// weights, bit for bit, on the host: with every step grouped (`moe_grouped_min_rows` 1), the
/// tensor-core weight streams' FP8 forms (`moe_tensor_core_min_rows` 1000) and the
/// warpgroup-MMA tiles' (1), against the BF16 forms over the BF16 checkpoint. That is what the
/// path they replace computed (each layer's stacks dequantised into a BF16 scratch, then the
/// BF16 forms); every other product is the same BF16 product in both models.
#[test]
fn fp8_grouped_experts_give_the_logits_of_the_dequantised_bf16_experts() {
    let (fp8, bf16) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    write_expert_checkpoints(fp8.path(), bf16.path());
    let fp8_checkpoint = SafetensorsCheckpoint::open(fp8.path()).unwrap();
    let bf16_checkpoint = SafetensorsCheckpoint::open(bf16.path()).unwrap();
    let format = LinearFormat::Fp8Stored(scheme(fp8.path()));
    let original = logits(&Random(config()), &LinearFormat::Bf16);
    for tensor_core_min_rows in ["1000", "1"] {
        let tuning = || {
            let mut t = fp8_experts();
            t.set("moe_grouped_min_rows", "1").unwrap();
            t.set("moe_tensor_core_min_rows", tensor_core_min_rows)
                .unwrap();
            t
        };
        let got = logits_with(&fp8_checkpoint, &format, tuning());
        let want = logits_with(&bf16_checkpoint, &LinearFormat::Bf16, tuning());
        let err = relative_l2(&got, &original);
        eprintln!(
            "moe_tensor_core_min_rows {tensor_core_min_rows}: {err:.4} from the BF16 experts \
             before quantization"
        );
        assert!(err > 1e-3, "the experts are FP8: {err}");
        assert!(
            got == want,
            "moe_tensor_core_min_rows {tensor_core_min_rows}: not the dequantised experts' \
             logits (relative L2 {:.3e})",
            relative_l2(&got, &want)
        );
    }
}
