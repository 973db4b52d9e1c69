// SPDX-License-Identifier: MIT OR Apache-2.0
//! Every path a product, a norm fold and the attention can take, run end to end on the host
//! backend and compared with the plain path (the library GEMM for every product, no fusion).
//!
//! A tiny Qwen3-shaped config (hidden 1024, so rows are whole 2 KiB pieces the bulk-copy stream
//! takes and short enough for the two-columns-a-warp form; 8 heads of 128, 2 kv heads, 2 layers)
//! with random weights runs the same steps (prefills of six sequences, decode steps of 1, 3 and 6
//! rows, a mixed step) under tunings that between them take every GEMV entry, the streams with
//! and without the norm, the normalising and SwiGLU forms, capped grids, the fused decode
//! attention and each prefill attention version. A recording backend (the host backend, which
//! remembers the kernel of every launch) shows each entry ran; every step's logits must match
//! the plain path's within the BF16 rounding the forms differ by.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};

use half::bf16;
use metrale_cache::BlockTable;
use metrale_config::ModelConfig;
use metrale_core::{DevicePtr, KernelArg, KernelName, LaunchConfig};
use metrale_gpu_runtime::{
    Event, GemmOp, GpuBackend, GpuError, Graph, HostBackend, KernelHandle, PinnedHostBuffer, Stream,
};
use metrale_kernels::KernelAbi;
use metrale_kernels::ops::*;
use metrale_model_engine::{LinearFormat, Model, ModelOptions, StepInput, Tuning, expected_shape};
use metrale_model_weights::{HostTensor, WeightError, WeightSource};

/// The host backend, remembering the kernel of every launch.
struct Recording {
    host: HostBackend,
    names: Mutex<Vec<KernelName>>,
    launched: Mutex<BTreeSet<String>>,
}

impl Recording {
    fn new() -> Recording {
        Recording {
            host: HostBackend::new(4 << 30),
            names: Mutex::new(Vec::new()),
            launched: Mutex::new(BTreeSet::new()),
        }
    }

    fn note(&self, kernel: KernelHandle) {
        let names = self.names.lock().unwrap();
        let name = names[kernel.0 as usize];
        self.launched.lock().unwrap().insert(name.to_string());
    }

    fn take(&self) -> BTreeSet<String> {
        std::mem::take(&mut self.launched.lock().unwrap())
    }
}

impl GpuBackend for Recording {
    fn kind(&self) -> &'static str {
        "host"
    }
    fn alloc(&self, bytes: usize) -> Result<DevicePtr, GpuError> {
        self.host.alloc(bytes)
    }
    fn free(&self, ptr: DevicePtr) -> Result<(), GpuError> {
        self.host.free(ptr)
    }
    fn copy_h2d(&self, src: &[u8], dst: DevicePtr) -> Result<(), GpuError> {
        self.host.copy_h2d(src, dst)
    }
    fn copy_d2h(&self, src: DevicePtr, dst: &mut [u8]) -> Result<(), GpuError> {
        self.host.copy_d2h(src, dst)
    }
    fn copy_d2h_on(&self, src: DevicePtr, dst: &mut [u8], s: Stream) -> Result<(), GpuError> {
        self.host.copy_d2h_on(src, dst, s)
    }
    fn copy_d2d(
        &self,
        src: DevicePtr,
        dst: DevicePtr,
        n: usize,
        s: Stream,
    ) -> Result<(), GpuError> {
        self.host.copy_d2d(src, dst, n, s)
    }
    fn memset(&self, p: DevicePtr, v: u8, n: usize, s: Stream) -> Result<(), GpuError> {
        self.host.memset(p, v, n, s)
    }
    fn total_memory(&self) -> Result<u64, GpuError> {
        self.host.total_memory()
    }
    fn free_memory(&self) -> Result<u64, GpuError> {
        self.host.free_memory()
    }
    fn alloc_host_pinned(&self, bytes: usize) -> Result<PinnedHostBuffer, GpuError> {
        self.host.alloc_host_pinned(bytes)
    }
    fn kernel(&self, name: KernelName) -> Result<KernelHandle, GpuError> {
        // The wrapper's own handles: an index into `names`, resolved again on the host per launch.
        self.host.kernel(name)?;
        let mut names = self.names.lock().unwrap();
        names.push(name);
        Ok(KernelHandle(names.len() as u32 - 1))
    }
    fn launch(
        &self,
        kernel: KernelHandle,
        config: &LaunchConfig,
        args: &[KernelArg],
        stream: Stream,
    ) -> Result<(), GpuError> {
        self.note(kernel);
        let name = self.names.lock().unwrap()[kernel.0 as usize];
        let inner = self.host.kernel(name)?;
        self.host.launch(inner, config, args, stream)
    }
    fn gemm(&self, op: &GemmOp, kernel: KernelHandle, stream: Stream) -> Result<(), GpuError> {
        let (config, args) = op.kernel_launch();
        self.launch(kernel, &config, &args, stream)
    }
    fn create_stream(&self) -> Result<Stream, GpuError> {
        self.host.create_stream()
    }
    fn synchronize(&self, s: Stream) -> Result<(), GpuError> {
        self.host.synchronize(s)
    }
    fn create_event(&self) -> Result<Event, GpuError> {
        self.host.create_event()
    }
    fn record_event(&self, e: Event, s: Stream) -> Result<(), GpuError> {
        self.host.record_event(e, s)
    }
    fn stream_wait_event(&self, s: Stream, e: Event) -> Result<(), GpuError> {
        self.host.stream_wait_event(s, e)
    }
    fn elapsed_ms(&self, a: Event, b: Event) -> Result<f32, GpuError> {
        self.host.elapsed_ms(a, b)
    }
    fn begin_capture(&self, s: Stream) -> Result<(), GpuError> {
        self.host.begin_capture(s)
    }
    fn end_capture(&self, s: Stream) -> Result<Graph, GpuError> {
        self.host.end_capture(s)
    }
    fn launch_graph(&self, g: Graph, s: Stream) -> Result<(), GpuError> {
        self.host.launch_graph(g, s)
    }
}

/// Random weights of every tensor a config implies: norms near 1, products scaled by
/// 1/sqrt(inputs), the embedding of unit size.
struct Random(ModelConfig);

impl WeightSource for Random {
    fn shape(&self, name: &str) -> Option<Vec<usize>> {
        expected_shape(&self.0, name)
    }

    fn load(&self, name: &str) -> Result<HostTensor, WeightError> {
        let shape = self
            .shape(name)
            .expect("the loader asks only for expected tensors");
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
        } else if name.contains("correction_bias") {
            // Of the sigmoid scores' scale, so that it moves some choices, not all.
            (0.0, 0.05)
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

fn config() -> ModelConfig {
    metrale_config::from_config_json(
        r#"{"model_type": "qwen3", "hidden_size": 1024, "intermediate_size": 1024,
            "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 128,
            "num_hidden_layers": 2, "vocab_size": 384, "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0, "max_position_embeddings": 512,
            "tie_word_embeddings": false}"#,
    )
    .expect("a valid config")
}

const SEQS: usize = 6;
const BLOCK: usize = 16;
const BLOCKS_PER_SEQ: usize = 4;

/// The logits of every step of the script under `tuning`, and the kernels it launched.
fn run(tuning: Tuning) -> (Vec<Vec<f32>>, BTreeSet<String>) {
    run_with(tuning, &LinearFormat::Bf16)
}

/// [`run`] with the linears' weights in `format`.
fn run_with(tuning: Tuning, format: &LinearFormat) -> (Vec<Vec<f32>>, BTreeSet<String>) {
    let c = config();
    let gpu = Arc::new(Recording::new());
    let options = ModelOptions {
        kv_cache: Default::default(),
        max_tokens_per_step: 24,
        max_seqs: SEQS,
        max_logit_rows: SEQS,
        max_seq_len: BLOCK * BLOCKS_PER_SEQ,
        num_blocks: SEQS * BLOCKS_PER_SEQ,
        block_size: BLOCK,
        state_slots: 0,
    };
    let backend: Arc<dyn GpuBackend> = gpu.clone();
    let mut model = Model::load_with(
        c.clone(),
        &Random(c),
        backend,
        options,
        tuning,
        format,
        &mut |_, _, _| {},
    )
    .expect("the model loads on the host");
    let tables: Vec<BlockTable> = (0..SEQS)
        .map(|s| BlockTable {
            blocks: (0..BLOCKS_PER_SEQ as u32)
                .map(|b| (s * BLOCKS_PER_SEQ) as u32 + b)
                .collect(),
        })
        .collect();
    let mut next = [0u32; SEQS];
    let mut outputs = Vec::new();
    let token = |s: usize, p: usize| ((s * 131 + p * 17 + 5) % 384) as u32;
    // (sequence, tokens it brings) per step: prefills of 20 (two chunks), 7, 3, 2, 1, 1 tokens;
    // decode steps of 1, 3 and 6 rows; a mixed step (two decode rows, then a 5-token chunk).
    let script: Vec<Vec<(usize, usize)>> = vec![
        vec![(0, 12)],
        vec![(0, 8)],
        vec![(1, 7)],
        vec![(2, 3), (3, 2)],
        vec![(4, 1), (5, 1)],
        vec![(0, 1)],
        vec![(0, 1)],
        vec![(0, 1), (1, 1), (2, 1)],
        (0..SEQS).map(|s| (s, 1)).collect(),
        vec![(3, 1), (4, 1), (1, 5)],
    ];
    for step in &script {
        let (mut tokens, mut positions, mut seq_of, mut rows) = (vec![], vec![], vec![], vec![]);
        let step_tables: Vec<&BlockTable> = step.iter().map(|&(s, _)| &tables[s]).collect();
        for (i, &(s, count)) in step.iter().enumerate() {
            for _ in 0..count {
                tokens.push(token(s, next[s] as usize));
                positions.push(next[s]);
                seq_of.push(i as u32);
                next[s] += 1;
            }
            rows.push(tokens.len() - 1);
        }
        let logits = model
            .forward(&StepInput {
                tokens: &tokens,
                positions: &positions,
                token_seq: &seq_of,
                block_tables: &step_tables,
                logit_rows: &rows,
                state_slots: &[],
            })
            .expect("the step runs");
        outputs.push(logits);
    }
    (outputs, gpu.take())
}

fn tuned(pairs: &[&str]) -> Tuning {
    let mut t = Tuning::hopper().expect("the kernel tree's tuning");
    for p in pairs {
        t.set_pair(p).unwrap_or_else(|e| panic!("{p}: {e}"));
    }
    t
}

/// The largest difference of two runs' logits over the spread of the reference's.
fn relative_error(got: &[Vec<f32>], want: &[Vec<f32>]) -> f32 {
    let spread = want.iter().flatten().fold(0f32, |m, x| m.max(x.abs()));
    let diff = got
        .iter()
        .flatten()
        .zip(want.iter().flatten())
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    assert_eq!(got.iter().flatten().count(), want.iter().flatten().count());
    diff / spread
}

#[test]
fn every_linear_and_attention_path_matches_the_plain_path() {
    let plain = Tuning::plain(metrale_kernels::HardwareSchedule::HOPPER);
    let (want, plain_kernels) = run(plain);
    assert!(
        plain_kernels.contains(&Gemm::NAME.to_string()),
        "{plain_kernels:?}"
    );
    assert!(
        !plain_kernels.iter().any(|k| k.contains("gemv")),
        "{plain_kernels:?}"
    );
    let all_streams = "gemv_stream=qkv+o+gate_up+down+lm_head";
    let variants: Vec<(&str, Tuning)> = vec![
        ("the kernel tree's defaults", tuned(&[])),
        (
            "streams with the norm",
            tuned(&[all_streams, "gemv_stream_min_weights=0"]),
        ),
        (
            "streams without the norm, no prewait",
            tuned(&[
                all_streams,
                "gemv_stream_min_weights=0",
                "gemv_stream_norm=false",
                "gemv_norm=off",
                "gemv_stream_prewait=0",
                "gemv_stream_evict=false",
            ]),
        ),
        (
            "plain GEMVs, separate launches",
            tuned(&[
                "gemv_stage=off",
                "gemv_norm=off",
                "fused_qkv_attention=false",
                "prefill_attention=v2",
            ]),
        ),
        (
            "staged and normalising everywhere, SiLU apart",
            tuned(&["gemv_stage=all", "gemv_norm=all", "fused_swiglu=false"]),
        ),
        (
            "capped grids, wide attention off, the library past one row",
            tuned(&[
                "gemv_grid_cap=7",
                "gemv_grid_mode=balanced",
                "grid_caps=o=3+down=5",
                "attention_wide_blocks=0",
                "gemm_wide_k=1024",
                "gemm_wide_k_max_gemv_rows=1",
                "embedding_vec=true",
                "prefill_attention=v1",
                "attention_unsplit_keys=0",
                "attention_split_keys=16",
            ]),
        ),
    ];
    let mut seen = BTreeSet::new();
    for (what, tuning) in variants {
        let (got, kernels) = run(tuning);
        let err = relative_error(&got, &want);
        println!("{what}: relative error {err:.3e}, kernels {kernels:?}");
        assert!(
            err < 2e-2,
            "{what}: relative logit error {err:.3e} against the plain path"
        );
        seen.extend(kernels);
    }
    // Between them the variants ran every form of the product, the norm fold and the attention.
    let names = [
        Gemv::NAME,
        GemvF32Out::NAME,
        GemvStaged::NAME,
        GemvStream::NAME,
        GemvStreamF32Out::NAME,
        GemvStreamNorm::NAME,
        GemvNorm::NAME,
        GemvSwiglu::NAME,
        GemvSwigluStaged::NAME,
        GemvSwigluStream::NAME,
        GemvSwigluNorm::NAME,
        GemvSwigluStreamNorm::NAME,
        SiluMul::NAME,
        AddRmsNorm::NAME,
        Gemm::NAME,
        GemmF32Out::NAME,
        QkvRopeKvWrite::NAME,
        PagedAttention::NAME,
        PagedAttentionQkv::NAME,
        PagedAttentionQkv::WIDE_NAME,
        PrefillAttention::NAME,
        PrefillAttentionV2::NAME,
        PrefillAttentionV3::NAME,
        Embedding::NAME,
        Embedding::VEC_NAME,
    ];
    let missing: Vec<String> = names
        .iter()
        .map(|n| n.to_string())
        .filter(|n| !seen.contains(n))
        .collect();
    assert!(missing.is_empty(), "never launched: {missing:?}");
}

/// The FP8 linears' paths (weights quantized at load): the FP8 GEMV against the plain path (each
/// FP8 weight dequantised to BF16, then the library GEMM) within the BF16 rounding of the
/// dequantised weights; the FP8 streams with and without the norm (rows of 1024 inputs, whole
/// 1-KiB chunks) against the FP8 GEMV, exactly: on the host their references are the GEMV's
/// (the GPU sums in another order), so any difference is a launch that passed the wrong
/// weight, scales, row shift or input. The tensor-core FP8 GEMV (A as f16, per-piece scale
/// sums: not the register GEMV's bits) against the plain path as the FP8 GEMV is. Between them
/// every FP8 product entry runs. The prefill rows take the dequantise path here (`fp8_gemm` off:
/// the FP8 GEMM's quantized activations are `fp8_gemm_matches_the_dequantise_path`'s subject).
#[test]
fn every_fp8_linear_path_matches_the_plain_path() {
    let fp8 = LinearFormat::Fp8Quantize;
    let plain = Tuning::plain(metrale_kernels::HardwareSchedule::HOPPER);
    let (want, plain_kernels) = run_with(plain, &fp8);
    assert!(
        plain_kernels.contains(&Fp8DequantBf16::NAME.to_string()),
        "{plain_kernels:?}"
    );
    let streams = "gemv_stream=qkv+o+gate_up+down";
    let (gemv, mut seen) = run_with(
        tuned(&[
            streams,
            "gemv_stream_min_weights=0",
            "fp8_gemm=off",
            "gemv_fp8_stream=off",
            "gemv_fp8_mma_min_rows=off",
        ]),
        &fp8,
    );
    let err = relative_error(&gemv, &want);
    println!("the FP8 GEMV: relative error {err:.3e}, kernels {seen:?}");
    assert!(err < 2e-2, "the FP8 GEMV: relative logit error {err:.3e}");
    let (mma, kernels) = run_with(
        tuned(&[
            streams,
            "gemv_stream_min_weights=0",
            "fp8_gemm=off",
            "gemv_fp8_stream=off",
            "gemv_fp8_mma_min_rows=1",
        ]),
        &fp8,
    );
    let err = relative_error(&mma, &want);
    println!("the tensor-core FP8 GEMV: relative error {err:.3e}, kernels {kernels:?}");
    assert!(
        err < 2e-2,
        "the tensor-core FP8 GEMV: relative logit error {err:.3e}"
    );
    seen.extend(kernels);
    let variants: Vec<(&str, Tuning)> = vec![
        (
            "FP8 streams with the norm",
            tuned(&[
                streams,
                "gemv_stream_min_weights=0",
                "fp8_gemm=off",
                "gemv_fp8_stream=on",
                "gemv_fp8_mma_min_rows=off",
            ]),
        ),
        (
            "FP8 streams without the norm, no prewait",
            tuned(&[
                streams,
                "gemv_stream_min_weights=0",
                "fp8_gemm=off",
                "gemv_fp8_stream=on",
                "gemv_fp8_mma_min_rows=off",
                "gemv_stream_norm=false",
                "gemv_stream_prewait=0",
                "gemv_stream_evict=false",
            ]),
        ),
    ];
    for (what, tuning) in variants {
        let (got, kernels) = run_with(tuning, &fp8);
        println!("{what}: kernels {kernels:?}");
        assert!(got == gemv, "{what}: not the FP8 GEMV's logits");
        seen.extend(kernels);
    }
    let names = [
        GemvFp8::NAME,
        GemvFp8Swiglu::NAME,
        GemvFp8Mma::NAME,
        GemvFp8MmaSwiglu::NAME,
        GemvFp8Stream::NAME,
        GemvFp8SwigluStream::NAME,
        GemvFp8StreamNorm::NAME,
        GemvFp8SwigluStreamNorm::NAME,
    ];
    let missing: Vec<String> = names
        .iter()
        .map(|n| n.to_string())
        .filter(|n| !seen.contains(n))
        .collect();
    assert!(missing.is_empty(), "never launched: {missing:?}");
}

/// The FP8 library product (`fp8_gemm=on`: activations quantized to e4m3 per row and 128
/// columns, then the block-scaled FP8 GEMM) against the dequantise path (`fp8_gemm=off`: each FP8
/// weight dequantised to BF16, then the BF16 library GEMM) over the same script, whose prefills of
/// 12, 8 and 7 rows take the library path (more rows than the FP8 GEMV's 8 in the first). Every
/// FP8 product of this config fits (`k` 1024, 128 x 128 scale blocks), so the on run launches
/// no dequantisation at all. The activations' e4m3 rounding (3 mantissa bits: up to 1/16 of a
/// value, every input of every product of the prefills) is the error beyond the dequantise
/// path's, which reaches the decode steps through the cache: 4.56e-2 of the logit spread when
/// written, bound 6e-2; the activations' scales read in the other layout (row-major) give 0.40.
#[test]
fn fp8_gemm_matches_the_dequantise_path() {
    let fp8 = LinearFormat::Fp8Quantize;
    let (want, kernels) = run_with(tuned(&["fp8_gemm=off"]), &fp8);
    assert!(
        kernels.contains(&Fp8DequantBf16::NAME.to_string())
            && !kernels.contains(&GemmFp8::NAME.to_string()),
        "{kernels:?}"
    );
    let (got, kernels) = run_with(tuned(&["fp8_gemm=on"]), &fp8);
    let err = relative_error(&got, &want);
    println!("the FP8 library product: relative error {err:.3e}, kernels {kernels:?}");
    assert!(
        err < 6e-2,
        "the FP8 library product: relative logit error {err:.3e}"
    );
    for name in [Fp8QuantizeRows::NAME, GemmFp8::NAME] {
        assert!(kernels.contains(&name.to_string()), "{name}: {kernels:?}");
    }
    assert!(
        !kernels.contains(&Fp8DequantBf16::NAME.to_string()),
        "{kernels:?}"
    );
}

/// With the FP8 library product, the residual add + RMSNorm before qkv and gate|up and SiLU x up
/// before down write those products' e4m3 rows and scales themselves (`fp8_fused_quantize`, on
/// by default: `add_rmsnorm_f32res_fp8_rows`, `silu_mul_fp8_rows`) instead of bf16 rows that
/// `fp8_quantize_rows` then quantizes (off): the same logits, bit for bit, over the script, with
/// the hopper tuning (the 12-row prefill on the FP8 GEMM) and with every product on it
/// (`gemv_max_rows=0`: every step, 1 to 20 rows, padded to 16). The o projection, fed by the
/// attention, keeps its quantize launch.
#[test]
fn fused_fp8_quantize_gives_the_separate_launches_bits() {
    let fp8 = LinearFormat::Fp8Quantize;
    let fused = [AddRmsNormFp8Rows::NAME, SiluMulFp8Rows::NAME];
    for extra in [None, Some("gemv_max_rows=0")] {
        let with = |pairs: &[&str]| {
            let mut all = pairs.to_vec();
            all.extend(extra);
            tuned(&all)
        };
        let (want, kernels) = run_with(with(&["fp8_gemm=on", "fp8_fused_quantize=off"]), &fp8);
        for name in fused {
            assert!(!kernels.contains(&name.to_string()), "{name}: {kernels:?}");
        }
        let (got, kernels) = run_with(with(&["fp8_gemm=on"]), &fp8);
        println!("{extra:?}: kernels {kernels:?}");
        for name in fused.iter().chain(&[Fp8QuantizeRows::NAME, GemmFp8::NAME]) {
            assert!(kernels.contains(&name.to_string()), "{name}: {kernels:?}");
        }
        let bits =
            |v: &[Vec<f32>]| -> Vec<u32> { v.iter().flatten().map(|x| x.to_bits()).collect() };
        assert!(
            bits(&got) == bits(&want),
            "{extra:?}: the fused quantization changed the logits (relative error {:.3e})",
            relative_error(&got, &want)
        );
    }
}

/// A prompt's last logits on a MoE config with random weights, on the host: by one prefill
/// step (the experts over many rows), or fed one token a step (the decode kernels at one row).
fn moe_prompt_logits(
    c: &ModelConfig,
    prompt: &[u32],
    tuning: Tuning,
    one_by_one: bool,
) -> Vec<f32> {
    moe_prompt_logits_of(&Random(c.clone()), c, prompt, tuning, one_by_one)
}

/// [`moe_prompt_logits`] on the weights of `source`.
fn moe_prompt_logits_of(
    source: &dyn WeightSource,
    c: &ModelConfig,
    prompt: &[u32],
    tuning: Tuning,
    one_by_one: bool,
) -> Vec<f32> {
    let gpu: Arc<dyn GpuBackend> = Arc::new(HostBackend::new(1 << 30));
    moe_prompt_logits_on(
        gpu,
        source,
        c,
        prompt,
        (tuning, &LinearFormat::Bf16),
        one_by_one,
    )
}

/// [`moe_prompt_logits_of`] on `gpu`, the linears' weights in `format`.
fn moe_prompt_logits_on(
    gpu: Arc<dyn GpuBackend>,
    source: &dyn WeightSource,
    c: &ModelConfig,
    prompt: &[u32],
    (tuning, format): (Tuning, &LinearFormat),
    one_by_one: bool,
) -> Vec<f32> {
    let options = ModelOptions {
        kv_cache: Default::default(),
        max_tokens_per_step: 32,
        max_seqs: 1,
        max_logit_rows: 1,
        max_seq_len: 64,
        num_blocks: 4,
        block_size: 16,
        state_slots: 0,
    };
    let mut model = Model::load_with(
        c.clone(),
        source,
        gpu,
        options,
        tuning,
        format,
        &mut |_, _, _| {},
    )
    .expect("the MoE model loads on the host");
    let table = BlockTable {
        blocks: vec![0, 1, 2, 3],
    };
    let chunks: Vec<&[u32]> = match one_by_one {
        true => prompt.chunks(1).collect(),
        false => vec![prompt],
    };
    let mut at = 0u32;
    let mut logits = Vec::new();
    for chunk in chunks {
        let positions: Vec<u32> = (at..at + chunk.len() as u32).collect();
        logits = model
            .forward(&StepInput {
                tokens: chunk,
                positions: &positions,
                token_seq: &vec![0; chunk.len()],
                block_tables: &[&table],
                logit_rows: &[chunk.len() - 1],
                state_slots: &[],
            })
            .expect("the step runs");
        at += chunk.len() as u32;
    }
    logits
}

/// A MoE config's prompt logits agree within bf16 rounding between one prefill step and one
/// token a step, under the plain path, the kernel tree's defaults and every form of the grouped
/// expert products; one token a step, the router in one launch and in two agree exactly.
fn moe_prefill_and_decode_agree(c: &ModelConfig) {
    let prompt: Vec<u32> = (0..21)
        .map(|i| (i * 37 + 11) % c.vocab_size as u32)
        .collect();
    let plain = Tuning::plain(metrale_kernels::HardwareSchedule::HOPPER);
    let want = moe_prompt_logits(c, &prompt, plain.clone(), false);
    assert!(want.iter().all(|x| x.is_finite()));
    for (what, tuning, one_by_one) in [
        ("plain, one token a step", plain, true),
        ("tree, one prefill step", tuned(&[]), false),
        ("tree, one token a step", tuned(&[]), true),
        (
            "tree with the shared expert's own launches, one token a step",
            tuned(&["moe_fused_shared_expert=off"]),
            true,
        ),
        (
            "grouped experts on tensor cores, one prefill step",
            tuned(&["moe_grouped_min_rows=2", "moe_tensor_core_min_rows=2"]),
            false,
        ),
        (
            "grouped experts as CUDA-core weight streams, one prefill step",
            tuned(&[
                "moe_grouped_min_rows=2",
                "moe_tensor_core_min_rows=1000",
                "moe_grouped_mma=off",
            ]),
            false,
        ),
        (
            "grouped experts as tensor-core weight streams, one prefill step",
            tuned(&[
                "moe_grouped_min_rows=2",
                "moe_tensor_core_min_rows=1000",
                "moe_grouped_mma=on",
            ]),
            false,
        ),
    ] {
        let got = moe_prompt_logits(c, &prompt, tuning, one_by_one);
        let err = relative_error(&[got], std::slice::from_ref(&want));
        println!("{what}: relative error {err:.3e}");
        assert!(err < 2e-2, "{what}: {err:.3e}");
    }
    // The router in one launch makes the logits, the shared gate's logit and the choices the
    // separate launches make: on the host, the same bits.
    let fused = moe_prompt_logits(c, &prompt, tuned(&["moe_fused_router=on"]), true);
    let separate = moe_prompt_logits(c, &prompt, tuned(&["moe_fused_router=off"]), true);
    assert!(fused == separate, "the fused router changed the logits");
}

/// A tiny Qwen3-MoE (16 experts, top 4) on the host, prefill against decode; layer 1 stays dense
/// (`mlp_only_layers`).
#[test]
fn a_tiny_qwen3_moe_prefills_and_decodes_alike() {
    let c = metrale_config::from_config_json(
        r#"{"model_type": "qwen3_moe", "hidden_size": 256, "intermediate_size": 512,
            "moe_intermediate_size": 96, "num_experts": 16, "num_experts_per_tok": 4,
            "norm_topk_prob": true, "decoder_sparse_step": 1, "mlp_only_layers": [1],
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
            "num_hidden_layers": 3, "vocab_size": 320, "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0, "max_position_embeddings": 256,
            "tie_word_embeddings": false}"#,
    )
    .expect("a valid config");
    moe_prefill_and_decode_agree(&c);
}

/// A tiny Qwen2-MoE (12 experts, top 4, not renormalised; a shared expert behind its sigmoid
/// gate; q, k, v biases) on the host, prefill against decode; `decoder_sparse_step` 2 leaves
/// layers 0 and 2 dense.
#[test]
fn a_tiny_qwen2_moe_with_a_shared_expert_prefills_and_decodes_alike() {
    let c = metrale_config::from_config_json(
        r#"{"model_type": "qwen2_moe", "hidden_size": 256, "intermediate_size": 384,
            "moe_intermediate_size": 64, "shared_expert_intermediate_size": 160,
            "num_experts": 12, "num_experts_per_tok": 4, "decoder_sparse_step": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2,
            "num_hidden_layers": 4, "vocab_size": 320, "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0, "max_position_embeddings": 256,
            "tie_word_embeddings": false}"#,
    )
    .expect("a valid config");
    let m = c.moe.as_ref().expect("a MoE config");
    assert!(c.attention_bias && !m.norm_topk_prob);
    assert_eq!(m.shared_expert_intermediate, Some(160));
    assert_eq!(
        (0..4).map(|l| m.is_sparse(l)).collect::<Vec<_>>(),
        [false, true, false, true]
    );
    moe_prefill_and_decode_agree(&c);
}

/// A tiny MiniMax-M2 (16 experts, top 4, sigmoid routing with a correction bias; q and k
/// normalised over their whole projections; RoPE on 32 of each head's 64 elements) on the host,
/// prefill against decode.
#[test]
fn a_tiny_minimax_m2_prefills_and_decodes_alike() {
    let c = metrale_config::from_config_json(
        r#"{"model_type": "minimax_m2", "hidden_size": 256, "intermediate_size": 96,
            "num_local_experts": 16, "num_experts_per_tok": 4, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 64, "rotary_dim": 32,
            "num_hidden_layers": 3, "vocab_size": 320, "rms_norm_eps": 1e-6,
            "rope_theta": 5000000.0, "max_position_embeddings": 256,
            "scoring_func": "sigmoid", "use_routing_bias": true, "use_qk_norm": true,
            "qk_norm_type": "per_layer", "tie_word_embeddings": false}"#,
    )
    .expect("a valid config");
    assert_eq!(
        (c.qk_norm, c.rotary_dim),
        (metrale_config::QkNorm::Whole, 32)
    );
    moe_prefill_and_decode_agree(&c);
}

/// A tiny Nemotron-H with experts, "E*E-" (squared-ReLU experts without a gate product, 8 of them,
/// top 2 by sigmoid scores plus the correction bias, renormalised and scaled by 2.5, an ungated
/// squared-ReLU shared expert; attention without RoPE; a dense squared-ReLU MLP; no Mamba-2
/// layer, so no recurrent state) on the host, prefill against decode in every form of the
/// experts.
#[test]
fn a_tiny_nemotron_h_with_experts_prefills_and_decodes_alike() {
    let c = metrale_config::from_config_json(
        r#"{"model_type": "nemotron_h", "hidden_size": 256, "intermediate_size": 192,
            "hybrid_override_pattern": "E*E-", "num_hidden_layers": 4,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
            "mamba_num_heads": 16, "mamba_head_dim": 16, "n_groups": 2, "ssm_state_size": 16,
            "conv_kernel": 4, "expand": 2, "use_conv_bias": true, "mamba_hidden_act": "silu",
            "chunk_size": 128, "mlp_hidden_act": "relu2", "mlp_bias": false, "use_bias": false,
            "layer_norm_epsilon": 1e-5, "vocab_size": 320, "max_position_embeddings": 256,
            "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 48,
            "moe_shared_expert_intermediate_size": 96, "n_group": 1, "topk_group": 1,
            "norm_topk_prob": true, "routed_scaling_factor": 2.5,
            "tie_word_embeddings": false}"#,
    )
    .expect("a valid config");
    let m = c.moe.as_ref().expect("a MoE config");
    assert_eq!((m.num_experts, m.top_k, m.routed_scaling), (8, 2, 2.5));
    moe_prefill_and_decode_agree(&c);
}

/// [`Random`]'s weights with every router correction bias zero.
struct WithoutCorrectionBias(Random);

impl WeightSource for WithoutCorrectionBias {
    fn shape(&self, name: &str) -> Option<Vec<usize>> {
        self.0.shape(name)
    }
    fn load(&self, name: &str) -> Result<HostTensor, WeightError> {
        let mut t = self.0.load(name)?;
        if name.ends_with("e_score_correction_bias") {
            t.data.fill(bf16::ZERO);
        }
        Ok(t)
    }
    fn describe(&self) -> String {
        "random, no correction bias".into()
    }
}

/// The correction bias reaches the routing: the tiny MiniMax-M2 without it gives other logits
/// (its 0.05-scale bias moves some of the top 4 of 16 experts).
#[test]
fn the_minimax_m2_correction_bias_changes_the_routing() {
    let c = metrale_config::from_config_json(
        r#"{"model_type": "minimax_m2", "hidden_size": 256, "intermediate_size": 96,
            "num_local_experts": 16, "num_experts_per_tok": 4, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 64, "rotary_dim": 32,
            "num_hidden_layers": 2, "vocab_size": 320, "rope_theta": 5000000.0,
            "max_position_embeddings": 256}"#,
    )
    .expect("a valid config");
    let prompt: Vec<u32> = (0..9).map(|i| (i * 37 + 11) % 320).collect();
    let plain = Tuning::plain(metrale_kernels::HardwareSchedule::HOPPER);
    let with = moe_prompt_logits(&c, &prompt, plain.clone(), false);
    let without = moe_prompt_logits_of(
        &WithoutCorrectionBias(Random(c.clone())),
        &c,
        &prompt,
        plain,
        false,
    );
    let err = relative_error(&[without], &[with]);
    println!("without the bias: relative difference {err:.3e}");
    assert!(err > 5e-2, "{err:.3e}");
}

/// Routing capture: each sparse layer's expert choices for every row of the step, k distinct
/// experts a row; nothing for a dense layer, nothing with capture off.
#[test]
fn routing_capture_reports_every_sparse_layers_choices() {
    let c = metrale_config::from_config_json(
        r#"{"model_type": "qwen3_moe", "hidden_size": 256, "intermediate_size": 512,
            "moe_intermediate_size": 96, "num_experts": 16, "num_experts_per_tok": 4,
            "norm_topk_prob": true, "decoder_sparse_step": 1, "mlp_only_layers": [1],
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
            "num_hidden_layers": 3, "vocab_size": 320, "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0, "max_position_embeddings": 256,
            "tie_word_embeddings": false}"#,
    )
    .expect("a valid config");
    let gpu: Arc<dyn GpuBackend> = Arc::new(HostBackend::new(1 << 30));
    let options = ModelOptions {
        kv_cache: Default::default(),
        max_tokens_per_step: 32,
        max_seqs: 1,
        max_logit_rows: 1,
        max_seq_len: 64,
        num_blocks: 4,
        block_size: 16,
        state_slots: 0,
    };
    let mut model = Model::load(
        c.clone(),
        &Random(c.clone()),
        gpu,
        options,
        tuned(&[]),
        &mut |_, _, _| {},
    )
    .expect("the MoE model loads on the host");
    let table = BlockTable {
        blocks: vec![0, 1, 2, 3],
    };
    let prompt: Vec<u32> = (0..21).map(|i| (i * 37 + 11) % 320).collect();
    let positions: Vec<u32> = (0..21).collect();
    let step = |model: &mut Model, tokens: &[u32], positions: &[u32]| {
        model
            .forward(&StepInput {
                tokens,
                positions,
                token_seq: &vec![0; tokens.len()],
                block_tables: &[&table],
                logit_rows: &[tokens.len() - 1],
                state_slots: &[],
            })
            .expect("the step runs");
    };
    step(&mut model, &prompt, &positions);
    assert!(
        model.captured_routing(21).unwrap().is_empty(),
        "capture is off"
    );
    model.set_routing_capture(true).unwrap();
    step(&mut model, &prompt, &positions);
    let layers = model.captured_routing(21).unwrap();
    assert_eq!(layers.len(), 2, "layers 0 and 2 are sparse");
    let mut seen = std::collections::HashSet::new();
    for layer in &layers {
        assert_eq!(layer.len(), 21 * 4);
        for row in layer.chunks(4) {
            let distinct: std::collections::HashSet<_> = row.iter().collect();
            assert_eq!(distinct.len(), 4, "{row:?}");
            assert!(row.iter().all(|&e| (0..16).contains(&e)), "{row:?}");
            seen.extend(row.iter().copied());
        }
    }
    assert!(
        seen.len() > 4,
        "the rows choose different experts: {seen:?}"
    );
    step(&mut model, &[5], &[21]);
    let one = model.captured_routing(1).unwrap();
    assert_eq!((one.len(), one[0].len()), (2, 4));
    assert!(
        model.captured_routing(33).is_err(),
        "more rows than a step holds"
    );
}

/// [`Random`]'s weights with each sparse layer's experts as one stack per projection (the split
/// layout a GGUF file's `ffn_{gate,up,down}_exps` are read in) instead of one tensor per expert.
struct SplitExperts(Random);

impl SplitExperts {
    /// The layer and projection of a stack name, `model.layers.{l}.mlp.experts.{proj}`.
    fn stack(name: &str) -> Option<(usize, &str)> {
        let rest = name.strip_prefix("model.layers.")?;
        let (l, proj) = rest.split_once(".mlp.experts.")?;
        if !matches!(proj, "gate_proj" | "up_proj" | "down_proj") {
            return None;
        }
        Some((l.parse().ok()?, proj))
    }
    fn experts(&self) -> usize {
        self.0.0.moe.as_ref().map_or(0, |m| m.num_experts)
    }
}

impl WeightSource for SplitExperts {
    fn shape(&self, name: &str) -> Option<Vec<usize>> {
        if let Some((l, proj)) = Self::stack(name) {
            let one = self
                .0
                .shape(&format!("model.layers.{l}.mlp.experts.0.{proj}.weight"))?;
            return Some([vec![self.experts()], one].concat());
        }
        if name.contains(".mlp.experts.") {
            return None; // no per-expert tensors
        }
        self.0.shape(name)
    }

    fn load(&self, name: &str) -> Result<HostTensor, WeightError> {
        let Some((l, proj)) = Self::stack(name) else {
            return self.0.load(name);
        };
        let mut data = Vec::new();
        for e in 0..self.experts() {
            data.extend(
                self.0
                    .load(&format!("model.layers.{l}.mlp.experts.{e}.{proj}.weight"))?
                    .data,
            );
        }
        Ok(HostTensor {
            shape: self.shape(name).expect("a stack"),
            data,
        })
    }

    fn describe(&self) -> String {
        "random, experts split by projection".into()
    }
}

/// The split expert layout (GGUF's stacks) loads to the same model as the per-expert one: the
/// same logits, bit for bit, for qwen3_moe and for qwen2_moe with its shared expert.
#[test]
fn split_expert_stacks_load_as_the_per_expert_tensors() {
    for json in [
        r#"{"model_type": "qwen3_moe", "hidden_size": 256, "intermediate_size": 512,
            "moe_intermediate_size": 96, "num_experts": 16, "num_experts_per_tok": 4,
            "norm_topk_prob": true, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 64, "num_hidden_layers": 2, "vocab_size": 320, "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0, "max_position_embeddings": 256,
            "tie_word_embeddings": false}"#,
        r#"{"model_type": "qwen2_moe", "hidden_size": 256, "intermediate_size": 512,
            "moe_intermediate_size": 64, "num_experts": 6, "num_experts_per_tok": 2,
            "shared_expert_intermediate_size": 128, "norm_topk_prob": false,
            "num_attention_heads": 4, "num_key_value_heads": 4, "num_hidden_layers": 2,
            "vocab_size": 320, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
            "max_position_embeddings": 256, "tie_word_embeddings": false}"#,
    ] {
        let c = metrale_config::from_config_json(json).expect("a valid config");
        let prompt: Vec<u32> = (0..21).map(|i| (i * 37 + 11) % 320).collect();
        let plain = Tuning::plain(metrale_kernels::HardwareSchedule::HOPPER);
        let want = moe_prompt_logits(&c, &prompt, plain.clone(), false);
        let split = SplitExperts(Random(c.clone()));
        assert_eq!(
            split.shape("model.layers.1.mlp.experts.gate_proj"),
            Some(vec![
                c.moe.as_ref().unwrap().num_experts,
                c.moe.as_ref().unwrap().expert_intermediate,
                256
            ])
        );
        let got = moe_prompt_logits_of(&split, &c, &prompt, plain, false);
        assert_eq!(got, want, "{:?}", c.family);
    }
}

/// FP8 experts (everything quantized at load, `moe_fp8_experts` on) take the grouped path's FP8
/// forms, with no
/// dequantised copy of their stacks: the tensor-core weight streams' (`moe_grouped_mma_fp8_*`)
/// below `moe_tensor_core_min_rows`, the warpgroup-MMA tiles' (`moe_wgmma_fp8_*`) from it, for
/// SwiGLU experts (a tiny Qwen3-MoE) and squared-ReLU ones (a tiny Nemotron-H with a shared
/// expert); the two forms give the same logits (on the host their references are both the BF16
/// forms' over the dequantised stacks: `tests/moe_fp8.rs` checks those against BF16 experts
/// holding the dequantised weights), and the per-assignment FP8 launches (the f32 dequantised
/// weights, expert outputs unrounded) differ from them by less than the FP8 weights differ from
/// BF16 ones. Random routers make that difference large for the Qwen3-MoE (4.98e-2 of the
/// logits' spread, against 1.12e-1 from BF16: near-tied experts picked differently downstream;
/// its BF16 paths differ by 5.2e-3) and small for the Nemotron-H (6.0e-3 against 4.78e-2).
#[test]
fn fp8_experts_take_the_grouped_fp8_forms() {
    let qwen3_moe = metrale_config::from_config_json(
        r#"{"model_type": "qwen3_moe", "hidden_size": 256, "intermediate_size": 512,
            "moe_intermediate_size": 96, "num_experts": 16, "num_experts_per_tok": 4,
            "norm_topk_prob": true, "decoder_sparse_step": 1, "mlp_only_layers": [1],
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
            "num_hidden_layers": 3, "vocab_size": 320, "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0, "max_position_embeddings": 256,
            "tie_word_embeddings": false}"#,
    )
    .expect("a valid config");
    let nemotron_h = metrale_config::from_config_json(
        r#"{"model_type": "nemotron_h", "hidden_size": 256, "intermediate_size": 192,
            "hybrid_override_pattern": "E*E-", "num_hidden_layers": 4,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
            "mamba_num_heads": 16, "mamba_head_dim": 16, "n_groups": 2, "ssm_state_size": 16,
            "conv_kernel": 4, "expand": 2, "use_conv_bias": true, "mamba_hidden_act": "silu",
            "chunk_size": 128, "mlp_hidden_act": "relu2", "mlp_bias": false, "use_bias": false,
            "layer_norm_epsilon": 1e-5, "vocab_size": 320, "max_position_embeddings": 256,
            "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 48,
            "moe_shared_expert_intermediate_size": 96, "n_group": 1, "topk_group": 1,
            "norm_topk_prob": true, "routed_scaling_factor": 2.5,
            "tie_word_embeddings": false}"#,
    )
    .expect("a valid config");
    let fp8 = LinearFormat::Fp8Quantize;
    for (c, relu2) in [(qwen3_moe, false), (nemotron_h, true)] {
        let prompt: Vec<u32> = (0..21)
            .map(|i| (i * 37 + 11) % c.vocab_size as u32)
            .collect();
        let source = Random(c.clone());
        // The tree keeps experts BF16 until their FP8 kernels have run on a GPU: on here.
        let run = |pairs: &[&str]| {
            let gpu = Arc::new(Recording::new());
            let backend: Arc<dyn GpuBackend> = gpu.clone();
            let mut all = vec!["moe_fp8_experts=on"];
            all.extend(pairs);
            let logits =
                moe_prompt_logits_on(backend, &source, &c, &prompt, (tuned(&all), &fp8), false);
            (logits, gpu.take())
        };
        let (want, _) = run(&["moe_grouped_min_rows=64"]);
        let (streams, launched) = run(&["moe_tensor_core_min_rows=1000"]);
        let (tiles, launched_tiles) = run(&["moe_tensor_core_min_rows=2"]);
        let (mma, wgmma, bf16_forms) = match relu2 {
            false => (
                [MoeGroupedMmaFp8Swiglu::NAME, MoeGroupedMmaFp8Down::NAME],
                [MoeWgmmaFp8Swiglu::NAME, MoeWgmmaFp8Down::NAME],
                [MoeGroupedMmaSwiglu::NAME, MoeWgmmaSwiglu::NAME],
            ),
            true => (
                [MoeGroupedMmaFp8Relu2::NAME, MoeGroupedMmaFp8Down::NAME],
                [MoeWgmmaFp8Relu2::NAME, MoeWgmmaFp8Down::NAME],
                [MoeGroupedMmaRelu2::NAME, MoeWgmmaRelu2::NAME],
            ),
        };
        for (forms, kernels) in [(mma, &launched), (wgmma, &launched_tiles)] {
            for name in forms.iter().chain(&[MoeGroup::NAME]) {
                assert!(kernels.contains(&name.to_string()), "{name}: {kernels:?}");
            }
            for name in bf16_forms {
                assert!(!kernels.contains(&name.to_string()), "{name}: {kernels:?}");
            }
        }
        assert!(streams == tiles, "relu2 {relu2}: the two FP8 forms differ");
        let err = relative_error(&[streams], std::slice::from_ref(&want));
        // The BF16 model's logits: how far the FP8 weights move them.
        let gpu: Arc<dyn GpuBackend> = Arc::new(HostBackend::new(1 << 30));
        let bf16 = (tuned(&[]), &LinearFormat::Bf16);
        let bf16 = moe_prompt_logits_on(gpu, &source, &c, &prompt, bf16, false);
        let quantization = relative_error(&[tiles], std::slice::from_ref(&bf16));
        println!(
            "relu2 {relu2}: grouped FP8 forms vs per-assignment FP8 {err:.3e}, FP8 vs BF16 \
             {quantization:.3e}"
        );
        assert!(
            err > 0.0 && err < quantization,
            "relu2 {relu2}: {err:.3e} against {quantization:.3e}"
        );
    }
}
