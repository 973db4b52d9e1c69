// SPDX-License-Identifier: MIT OR Apache-2.0
//! The weight-name map of the generic decoder and the upload of a checkpoint to a device.
//!
//! Llama, Qwen2 and Qwen3 checkpoints and their MoE variants (and OLMoE's) use the same HF names; the families
//! differ in which tensors exist (QKV biases, QK-norm weights, a separate LM head, a sparse
//! layer's router, experts and shared expert), and that follows from the config. A sparse
//! layer's experts come in either of the two layouts `transformers` writes: one tensor per expert
//! and projection (the hub's checkpoints), or the fused `experts.gate_up_proj` / `down_proj`
//! stacks (transformers 5); both upload as the same stacks. MiniMax-M2's original checkpoints
//! name a sparse layer `block_sparse_moe` and its experts' products `w1` / `w3` / `w2` (Mixtral's
//! names): the loader reads them as transformers' names ([`original_names`]). Every shape is
//! checked against the config before the first byte is uploaded. The hybrid families' tensors
//! (Gated DeltaNet and Mamba-2 mixers, Nemotron-H's one-block layers) are listed by `hybrid`;
//! `Model::load` refuses a mixer wider than its kernels before reading any tensor
//! (`LayerPlan::check_runnable`).
//!
//! The dense linears (q|k|v, o, gate|up, down, and a shared expert's gate|up and down) upload
//! in the [`LinearFormat`] asked for: BF16, quantized at load to FP8 in 128 x 128 blocks, or the
//! checkpoint's own FP8 weights and scales (its `quantization_config`: [`Fp8Scheme`]), stacked
//! as the products read them ([`Fp8Tensor::stack`]). A sparse layer's routed experts follow the
//! format too: each expert's projections quantized at load on their own 128 x 128 grids (as the
//! hub's FP8 checkpoints store them), or read from the checkpoint's per-expert `weight` and scale
//! tensors where every expert tensor of the layer is FP8 and converted, then stacked over the
//! experts into one FP8 matrix per stack (128 x 128 blocks where every projection fills whole
//! 128-row blocks, else a scale per row: any width). FP8 expert stacks stored whole
//! (transformers 5's `experts.gate_up_proj`) are refused before anything uploads; the BF16
//! stacked layouts quantize at load like the per-expert one. The embedding, the LM head, norms,
//! routers and the shared expert's sigmoid gate stay BF16: an FP8 checkpoint's other E4M3
//! tensors (and experts it does not store wholly in FP8) are dequantised to BF16 at load.

use half::bf16;
use metrale_config::{
    Ffn, GatedDeltaNetConfig, GdnProjection, Mixer, ModelConfig, ModelFamily, Multipliers, QkNorm,
    RouterKind,
};
use metrale_core::DevicePtr;
use metrale_gpu_runtime::GpuBackend;
use metrale_model_weights::{Fp8Scheme, Fp8Tensor, HostTensor, WeightError, WeightSource};

use crate::ModelError;
use crate::linear::LinearWeight;

mod hybrid;
pub use hybrid::{GdnTensor, MambaTensor, NemotronTensor};

/// How the dense linears' weights reach the device.
#[derive(Clone, Debug, Default, PartialEq)]
pub enum LinearFormat {
    /// BF16, as a BF16 checkpoint stores them.
    #[default]
    Bf16,
    /// Quantized at load from BF16 to E4M3 in 128 x 128 blocks, each block's scale its largest
    /// magnitude / 448 (`--quantization fp8`).
    Fp8Quantize,
    /// The checkpoint's FP8 weights and scales; modules its scheme leaves unconverted stay BF16.
    Fp8Stored(Fp8Scheme),
}

impl LinearFormat {
    /// Whether the linears are FP8.
    pub fn is_fp8(&self) -> bool {
        *self != LinearFormat::Bf16
    }
}

/// What a tensor is for, independent of how a file names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TensorRole {
    /// `[vocab, hidden]`.
    Embedding,
    /// `[hidden]`.
    FinalNorm,
    /// `[vocab, hidden]` (absent when tied).
    LmHead,
    /// Pre-attention norm `[hidden]`.
    InputNorm(usize),
    /// `[heads * head_dim, hidden]`.
    Q(usize),
    /// `[kv_heads * head_dim, hidden]`.
    K(usize),
    /// `[kv_heads * head_dim, hidden]`.
    V(usize),
    /// `[heads * head_dim]` (Qwen2).
    QBias(usize),
    /// `[kv_heads * head_dim]` (Qwen2).
    KBias(usize),
    /// `[kv_heads * head_dim]` (Qwen2).
    VBias(usize),
    /// Query norm: per head `[head_dim]` (Qwen3), or over the whole projection
    /// `[heads * head_dim]` (MiniMax-M2).
    QNorm(usize),
    /// Key norm: per head `[head_dim]`, or over the whole projection `[kv_heads * head_dim]`.
    KNorm(usize),
    /// `[hidden, heads * head_dim]`.
    O(usize),
    /// Pre-MLP norm `[hidden]`.
    PostNorm(usize),
    /// `[intermediate, hidden]`.
    Gate(usize),
    /// `[intermediate, hidden]`.
    Up(usize),
    /// `[hidden, intermediate]`.
    Down(usize),
    /// A sparse layer's router `[experts, hidden]`.
    Router(usize),
    /// A sigmoid router's per-expert correction bias `[experts]`, added to the scores for the
    /// choice only (MiniMax-M2); read as f32.
    CorrectionBias(usize),
    /// Expert `.1`'s gate `[expert_intermediate, hidden]` (the per-expert layout).
    ExpertGate(usize, usize),
    /// Expert `.1`'s up `[expert_intermediate, hidden]`.
    ExpertUp(usize, usize),
    /// Expert `.1`'s down `[hidden, expert_intermediate]`.
    ExpertDown(usize, usize),
    /// Every expert's gate rows then up rows `[experts, 2 * expert_intermediate, hidden]` (the
    /// fused layout).
    ExpertsGateUp(usize),
    /// Every expert's down `[experts, hidden, expert_intermediate]` (the fused and the split
    /// layouts).
    ExpertsDown(usize),
    /// Every expert's gate `[experts, expert_intermediate, hidden]` (the split layout: GGUF's
    /// `ffn_gate_exps`).
    ExpertsGate(usize),
    /// Every expert's up `[experts, expert_intermediate, hidden]` (GGUF's `ffn_up_exps`).
    ExpertsUp(usize),
    /// The shared expert's gate `[shared_intermediate, hidden]` (Qwen2-MoE).
    SharedGate(usize),
    /// The shared expert's up `[shared_intermediate, hidden]`.
    SharedUp(usize),
    /// The shared expert's down `[hidden, shared_intermediate]`.
    SharedDown(usize),
    /// The shared expert's sigmoid gate `[1, hidden]`.
    SharedExpertGate(usize),
    /// A Gated DeltaNet layer's tensor (Qwen3-Next, Qwen3.5).
    GatedDeltaNet(usize, GdnTensor),
    /// A Mamba-2 mixer's tensor under the decoder's names (Granite 4.0's `mamba.`).
    Mamba(usize, MambaTensor),
    /// q, k and v stored as one `[(heads + 2 kv_heads) head_dim, hidden]` (Phi-3's `qkv_proj`).
    Qkv(usize),
    /// gate and up stored as one `[2 intermediate, hidden]` (Phi-3's `gate_up_proj`).
    GateUp(usize),
    /// A Nemotron-H tensor: its layers name their one block `mixer` whatever it is.
    NemotronH(NemotronTensor),
}

impl TensorRole {
    /// The HF name.
    pub fn hf_name(self) -> String {
        let layer = |i: usize, rest: &str| format!("model.layers.{i}.{rest}");
        match self {
            TensorRole::Embedding => "model.embed_tokens.weight".into(),
            TensorRole::FinalNorm => "model.norm.weight".into(),
            TensorRole::LmHead => "lm_head.weight".into(),
            TensorRole::InputNorm(i) => layer(i, "input_layernorm.weight"),
            TensorRole::Q(i) => layer(i, "self_attn.q_proj.weight"),
            TensorRole::K(i) => layer(i, "self_attn.k_proj.weight"),
            TensorRole::V(i) => layer(i, "self_attn.v_proj.weight"),
            TensorRole::QBias(i) => layer(i, "self_attn.q_proj.bias"),
            TensorRole::KBias(i) => layer(i, "self_attn.k_proj.bias"),
            TensorRole::VBias(i) => layer(i, "self_attn.v_proj.bias"),
            TensorRole::QNorm(i) => layer(i, "self_attn.q_norm.weight"),
            TensorRole::KNorm(i) => layer(i, "self_attn.k_norm.weight"),
            TensorRole::O(i) => layer(i, "self_attn.o_proj.weight"),
            TensorRole::PostNorm(i) => layer(i, "post_attention_layernorm.weight"),
            TensorRole::Gate(i) => layer(i, "mlp.gate_proj.weight"),
            TensorRole::Up(i) => layer(i, "mlp.up_proj.weight"),
            TensorRole::Down(i) => layer(i, "mlp.down_proj.weight"),
            TensorRole::Router(i) => layer(i, "mlp.gate.weight"),
            TensorRole::CorrectionBias(i) => layer(i, "mlp.e_score_correction_bias"),
            TensorRole::ExpertGate(i, e) => layer(i, &format!("mlp.experts.{e}.gate_proj.weight")),
            TensorRole::ExpertUp(i, e) => layer(i, &format!("mlp.experts.{e}.up_proj.weight")),
            TensorRole::ExpertDown(i, e) => layer(i, &format!("mlp.experts.{e}.down_proj.weight")),
            TensorRole::ExpertsGateUp(i) => layer(i, "mlp.experts.gate_up_proj"),
            TensorRole::ExpertsDown(i) => layer(i, "mlp.experts.down_proj"),
            TensorRole::ExpertsGate(i) => layer(i, "mlp.experts.gate_proj"),
            TensorRole::ExpertsUp(i) => layer(i, "mlp.experts.up_proj"),
            TensorRole::SharedGate(i) => layer(i, "mlp.shared_expert.gate_proj.weight"),
            TensorRole::SharedUp(i) => layer(i, "mlp.shared_expert.up_proj.weight"),
            TensorRole::SharedDown(i) => layer(i, "mlp.shared_expert.down_proj.weight"),
            TensorRole::SharedExpertGate(i) => layer(i, "mlp.shared_expert_gate.weight"),
            TensorRole::GatedDeltaNet(i, t) => hybrid::gdn_name(i, t),
            TensorRole::Mamba(i, t) => layer(i, &format!("mamba.{}", t.suffix())),
            TensorRole::Qkv(i) => layer(i, "self_attn.qkv_proj.weight"),
            TensorRole::GateUp(i) => layer(i, "mlp.gate_up_proj.weight"),
            TensorRole::NemotronH(t) => t.hf_name(),
        }
    }

    /// The shape the config implies.
    pub fn shape(self, c: &ModelConfig) -> Vec<usize> {
        let (h, i, v, hd) = (c.hidden_size, c.intermediate_size, c.vocab_size, c.head_dim);
        let (q, kv) = (c.num_heads * hd, c.num_kv_heads * hd);
        // A gated attention's q projection also computes the output gate: per head, head_dim
        // query rows then head_dim gate rows.
        let q_rows = match &c.hybrid {
            Some(hybrid) if hybrid.attention_output_gate => 2 * q,
            _ => q,
        };
        match self {
            TensorRole::Embedding | TensorRole::LmHead => vec![v, h],
            TensorRole::FinalNorm | TensorRole::InputNorm(_) | TensorRole::PostNorm(_) => vec![h],
            TensorRole::Q(_) => vec![q_rows, h],
            TensorRole::K(_) | TensorRole::V(_) => vec![kv, h],
            TensorRole::QBias(_) => vec![q_rows],
            TensorRole::KBias(_) | TensorRole::VBias(_) => vec![kv],
            TensorRole::QNorm(_) | TensorRole::KNorm(_) if c.qk_norm == QkNorm::PerHead => {
                vec![hd]
            }
            TensorRole::QNorm(_) => vec![q],
            TensorRole::KNorm(_) => vec![kv],
            TensorRole::O(_) => vec![h, q],
            TensorRole::Gate(_) | TensorRole::Up(_) => vec![i, h],
            TensorRole::Down(_) => vec![h, i],
            TensorRole::GatedDeltaNet(_, t) => hybrid::gdn_shape(t, c),
            TensorRole::Mamba(_, t) => hybrid::mamba_shape(t, c),
            TensorRole::Qkv(_) => vec![q + 2 * kv, h],
            TensorRole::GateUp(_) => vec![2 * i, h],
            TensorRole::NemotronH(t) => t.shape(c),
            _ => moe_shape(self, c),
        }
    }
}

/// The shape of a sparse layer's tensor (empty for a config without MoE: no such tensor exists).
fn moe_shape(role: TensorRole, c: &ModelConfig) -> Vec<usize> {
    let Some(m) = &c.moe else {
        return Vec::new();
    };
    let (h, e, i) = (c.hidden_size, m.num_experts, m.expert_intermediate);
    let s = m.shared_expert_intermediate.unwrap_or(0);
    match role {
        TensorRole::Router(_) => vec![e, h],
        TensorRole::CorrectionBias(_) => vec![e],
        TensorRole::ExpertGate(..) | TensorRole::ExpertUp(..) => vec![i, h],
        TensorRole::ExpertDown(..) => vec![h, i],
        TensorRole::ExpertsGateUp(_) => vec![e, 2 * i, h],
        TensorRole::ExpertsDown(_) => vec![e, h, i],
        TensorRole::ExpertsGate(_) | TensorRole::ExpertsUp(_) => vec![e, i, h],
        TensorRole::SharedGate(_) | TensorRole::SharedUp(_) => vec![s, h],
        TensorRole::SharedDown(_) => vec![h, s],
        TensorRole::SharedExpertGate(_) => vec![1, h],
        _ => unreachable!("dense roles are shaped by TensorRole::shape"),
    }
}

/// How a checkpoint stores a sparse layer's experts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpertLayout {
    /// One tensor per expert and projection (`mlp.experts.{e}.gate_proj.weight`, ...).
    PerExpert,
    /// The stacks transformers 5 writes (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`).
    Fused,
    /// One stack per projection (`mlp.experts.gate_proj`, `up_proj`, `down_proj`: what a GGUF
    /// file's `ffn_gate_exps`, `ffn_up_exps`, `ffn_down_exps` are read as).
    Split,
}

impl ExpertLayout {
    /// The layout of layer `l`'s experts in `source`: fused where it has the fused stack
    /// (Nemotron-H's: its up stack).
    pub fn of(source: &dyn WeightSource, l: usize) -> ExpertLayout {
        let has = |role: TensorRole| source.shape(&role.hf_name()).is_some();
        if has(TensorRole::ExpertsGateUp(l))
            || has(TensorRole::NemotronH(NemotronTensor::ExpertsUp(l)))
        {
            ExpertLayout::Fused
        } else if has(TensorRole::ExpertsGate(l)) {
            ExpertLayout::Split
        } else {
            ExpertLayout::PerExpert
        }
    }
}

/// Layer `l`'s q, k and v projections, stacked in this order: three tensors, or the one a
/// family stores fused.
pub(crate) fn qkv_roles(c: &ModelConfig, l: usize) -> Vec<TensorRole> {
    match c.family.fused_projections() {
        true => vec![TensorRole::Qkv(l)],
        false => vec![TensorRole::Q(l), TensorRole::K(l), TensorRole::V(l)],
    }
}

/// Layer `l`'s dense gate and up projections, stacked gate first: two tensors, or the one a family
/// stores fused.
fn gate_up_roles(c: &ModelConfig, l: usize) -> Vec<TensorRole> {
    match c.family.fused_projections() {
        true => vec![TensorRole::GateUp(l)],
        false => vec![TensorRole::Gate(l), TensorRole::Up(l)],
    }
}

/// Layer `l`'s MLP tensors: the dense ones, or a sparse layer's router, experts in `layout` and
/// shared expert.
fn mlp_roles(c: &ModelConfig, l: usize, layout: ExpertLayout) -> Vec<TensorRole> {
    let Some(m) = c.moe.as_ref().filter(|m| m.is_sparse(l)) else {
        let mut roles = gate_up_roles(c, l);
        roles.push(TensorRole::Down(l));
        return roles;
    };
    let mut roles = vec![TensorRole::Router(l)];
    if m.router == RouterKind::SigmoidBias {
        roles.push(TensorRole::CorrectionBias(l));
    }
    match layout {
        ExpertLayout::Fused => {
            roles.extend([TensorRole::ExpertsGateUp(l), TensorRole::ExpertsDown(l)])
        }
        ExpertLayout::Split => roles.extend([
            TensorRole::ExpertsGate(l),
            TensorRole::ExpertsUp(l),
            TensorRole::ExpertsDown(l),
        ]),
        ExpertLayout::PerExpert => {
            for e in 0..m.num_experts {
                roles.extend([
                    TensorRole::ExpertGate(l, e),
                    TensorRole::ExpertUp(l, e),
                    TensorRole::ExpertDown(l, e),
                ]);
            }
        }
    }
    if m.shared_expert_intermediate.is_some() {
        roles.extend([
            TensorRole::SharedGate(l),
            TensorRole::SharedUp(l),
            TensorRole::SharedDown(l),
        ]);
        if m.shared_expert_gated {
            roles.push(TensorRole::SharedExpertGate(l));
        }
    }
    roles
}

/// Every tensor the config implies, in load order, sparse layers' experts in the per-expert
/// layout.
pub fn expected_tensors(c: &ModelConfig) -> Vec<TensorRole> {
    tensors_in(c, &|_| ExpertLayout::PerExpert)
}

/// The shape the config implies for the tensor named `name` (HF name, per-expert layout), or
/// `None` if the config has no such tensor: what a synthetic weight source reports.
pub fn expected_shape(c: &ModelConfig, name: &str) -> Option<Vec<usize>> {
    expected_tensors(c)
        .into_iter()
        .find(|role| role.hf_name() == name)
        .map(|role| role.shape(c))
}

/// Every tensor the config implies, each sparse layer's experts in the layout `layout` gives.
fn tensors_in(c: &ModelConfig, layout: &dyn Fn(usize) -> ExpertLayout) -> Vec<TensorRole> {
    if let Some(h) = &c.hybrid {
        return hybrid::tensors(c, h, layout);
    }
    let mut roles = vec![TensorRole::Embedding];
    for l in 0..c.num_layers {
        roles.push(TensorRole::InputNorm(l));
        roles.extend(qkv_roles(c, l));
        if c.attention_bias {
            roles.extend([
                TensorRole::QBias(l),
                TensorRole::KBias(l),
                TensorRole::VBias(l),
            ]);
        }
        if c.qk_norm.any() {
            roles.extend([TensorRole::QNorm(l), TensorRole::KNorm(l)]);
        }
        roles.extend([TensorRole::O(l), TensorRole::PostNorm(l)]);
        roles.extend(mlp_roles(c, l, layout(l)));
    }
    roles.push(TensorRole::FinalNorm);
    if !c.tie_word_embeddings {
        roles.push(TensorRole::LmHead);
    }
    roles
}

/// One decoder layer's tensors on the device. Absent optional tensors are [`DevicePtr::NULL`].
#[derive(Clone, Debug)]
pub struct LayerWeights {
    pub(crate) input_norm: DevicePtr,
    /// q rows, then k rows, then v rows: `[(heads + 2 * kv_heads) * head_dim, hidden]`, so one
    /// product computes all three.
    pub(crate) qkv: LinearWeight,
    /// The three biases in the same order, or NULL.
    pub(crate) qkv_bias: DevicePtr,
    pub(crate) q_norm: DevicePtr,
    pub(crate) k_norm: DevicePtr,
    pub(crate) o: LinearWeight,
    pub(crate) post_norm: DevicePtr,
    /// gate rows then up rows: `[2 * intermediate, hidden]`, so one GEMM feeds SiLU-and-mul
    /// (NULL in a sparse layer).
    pub(crate) gate_up: LinearWeight,
    pub(crate) down: LinearWeight,
    /// A sparse layer's MLP.
    pub(crate) moe: Option<MoeWeights>,
    /// A Gated DeltaNet layer's mixer (its attention tensors are then NULL).
    pub(crate) gdn: Option<GdnWeights>,
    /// A Mamba-2 layer's mixer (Nemotron-H).
    pub(crate) mamba: Option<MambaWeights>,
    /// A gated attention's output-gate rows of `q_proj`, `[heads * head_dim, hidden]` (each
    /// head's second half, Qwen3-Next), or NULL.
    pub(crate) attn_gate: LinearWeight,
    /// The FP8 KV cache's per-tensor scales of this layer's keys and values: the checkpoint's
    /// `k_scale` / `v_scale`, else 1.0 (used only with `--kv-cache-dtype fp8`).
    pub(crate) kv_scales: (f32, f32),
}

/// A Mamba-2 mixer's tensors on the device (Nemotron-H).
#[derive(Clone, Debug)]
pub struct MambaWeights {
    /// `[inner + conv channels + heads, hidden]`: z, then x | B | C (the conv's channels), then
    /// dt, as the checkpoint stores it.
    pub(crate) in_proj: LinearWeight,
    /// bf16 `[conv channels, conv_kernel]`.
    pub(crate) conv: DevicePtr,
    /// bf16 `[conv channels]`, or NULL without a conv bias.
    pub(crate) conv_bias: DevicePtr,
    /// f32 `[heads]` each.
    pub(crate) dt_bias: DevicePtr,
    pub(crate) a_log: DevicePtr,
    pub(crate) d: DevicePtr,
    /// bf16 `[inner]`: the grouped gated RMSNorm's weight.
    pub(crate) norm: DevicePtr,
    /// `[hidden, inner]`.
    pub(crate) out: LinearWeight,
}

/// A Gated DeltaNet mixer's tensors on the device, in the layout its kernels read.
#[derive(Clone, Debug)]
pub struct GdnWeights {
    /// One product for every input of the mixer, `[conv + value_dim + 2 * value_heads, hidden]`:
    /// every key head's q rows, then every key head's k rows, then every value head's v rows
    /// (the conv's channels, in the conv weight's order), the z rows, then b and a grouped per key
    /// head (its `value_heads / key_heads` b rows, then as many a rows) as `gdn_gating` reads
    /// them. Both checkpoint layouts (Qwen3-Next's `in_proj_qkvz` / `in_proj_ba` grouped per key
    /// head, Qwen3.5's four products) are rearranged into it at load.
    pub(crate) in_proj: LinearWeight,
    /// bf16 `[conv channels, conv_kernel]`.
    pub(crate) conv: DevicePtr,
    /// f32 `[value_heads]`.
    pub(crate) dt_bias: DevicePtr,
    /// f32 `[value_heads]`.
    pub(crate) a_log: DevicePtr,
    /// bf16 `[value_head_dim]`: the gated RMSNorm's weight, shared by every head.
    pub(crate) norm: DevicePtr,
    /// `[hidden, value_dim]`.
    pub(crate) out: LinearWeight,
}

impl LayerWeights {
    /// A layer with its norms and nothing else yet (the loaders fill in what the layer has).
    fn norms_only(input_norm: DevicePtr, post_norm: DevicePtr) -> LayerWeights {
        let null = LinearWeight::bf16(DevicePtr::NULL);
        LayerWeights {
            input_norm,
            qkv: null,
            qkv_bias: DevicePtr::NULL,
            q_norm: DevicePtr::NULL,
            k_norm: DevicePtr::NULL,
            o: null,
            post_norm,
            gate_up: null,
            down: null,
            moe: None,
            gdn: None,
            mamba: None,
            attn_gate: null,
            kv_scales: (1.0, 1.0),
        }
    }
}

/// A sparse layer's MLP tensors on the device.
#[derive(Clone, Debug)]
pub struct MoeWeights {
    /// `[experts, hidden]`.
    pub(crate) router: DevicePtr,
    /// `[experts, 2 * expert_intermediate, hidden]`: each expert's gate rows, then its up rows;
    /// squared-ReLU experts (Nemotron-H): `[experts, expert_intermediate, hidden]`, up rows only.
    /// BF16, or FP8 as one `[experts * rows, hidden]` matrix with its scales (every expert's
    /// projections quantized, or read, on their own block grids, then stacked: 128 x 128 blocks
    /// where each projection fills whole 128-row blocks, else a scale per row).
    pub(crate) experts_gate_up: LinearWeight,
    /// `[experts, hidden, expert_intermediate]`, in the same format as `experts_gate_up`.
    pub(crate) experts_down: LinearWeight,
    /// The shared expert's gate rows then up rows `[2 * shared_intermediate, hidden]` (one
    /// product feeds SiLU x up, as the dense MLP's), its up rows `[shared_intermediate, hidden]`
    /// where it is squared ReLU (Nemotron-H), or NULL without a shared expert. A dense linear:
    /// in the [`LinearFormat`] the dense products take.
    pub(crate) shared_gate_up: LinearWeight,
    /// `[hidden, shared_intermediate]`, or NULL.
    pub(crate) shared_down: LinearWeight,
    /// The shared expert's sigmoid gate `[1, hidden]`, or NULL.
    pub(crate) shared_gate: DevicePtr,
    /// f32 `[experts]`: a sigmoid router's correction bias, or NULL.
    pub(crate) correction_bias: DevicePtr,
}

/// All weights on the device.
#[derive(Clone, Debug)]
pub struct DeviceWeights {
    pub(crate) embedding: DevicePtr,
    pub(crate) final_norm: DevicePtr,
    /// The embedding itself when tied.
    pub(crate) lm_head: DevicePtr,
    pub(crate) layers: Vec<LayerWeights>,
    /// Attention layers whose FP8 KV cache scales came from the checkpoint
    /// ([`checkpoint_kv_scales`]); the others' are 1.0.
    pub kv_scaled_layers: usize,
    /// Every allocation, for freeing.
    pub(crate) allocations: Vec<DevicePtr>,
    /// Bytes uploaded.
    pub bytes: u64,
    /// Elements of the largest FP8 linear weight (0 without any): the BF16 scratch its library
    /// path dequantises into.
    pub(crate) fp8_max_weights: usize,
    /// Inputs of the widest FP8 linear weight (0 without any): the FP8 library product's
    /// quantized activations are that wide.
    pub(crate) fp8_max_k: usize,
    /// Outputs of the tallest FP8 linear weight (0 without any): the FP8 library product's
    /// scratch for its last rows is that wide.
    pub(crate) fp8_max_n: usize,
    /// Elements of the largest FP8 linear weight the FP8 library product cannot take (not in
    /// 128 x 128 blocks, or not [`metrale_kernels::ops::gemm_fp8_fits`]; 0 without any): with
    /// the tuning's `fp8_gemm` on, only those dequantise into the BF16 scratch.
    pub(crate) fp8_max_dequant_weights: usize,
}

/// The FP8 KV cache scales of attention layer `l` in the checkpoint, `(k_scale, v_scale)`, where
/// it has them: `self_attn.k_scale` / `v_scale` (compressed-tensors, llm-compressor, vLLM's own),
/// `self_attn.k_proj.k_scale` / `v_proj.v_scale` (NVIDIA ModelOpt), or the older single
/// `self_attn.kv_scale` for both (AutoFP8). Each a scalar f32 (a cached element is `e4m3(x /
/// scale)`); a tensor of several (per-head) scales gives its largest, the per-tensor scale that
/// saturates none of them. A checkpoint with one of the pair and not the other, or a scale that
/// is not finite and positive, is refused.
pub fn checkpoint_kv_scales(
    source: &dyn WeightSource,
    l: usize,
) -> Result<Option<(f32, f32)>, ModelError> {
    let attn = format!("model.layers.{l}.self_attn");
    let read = |names: [String; 3]| -> Result<Option<(String, f32)>, ModelError> {
        let Some(name) = names.into_iter().find(|n| source.shape(n).is_some()) else {
            return Ok(None);
        };
        let (_, values) = source.load_f32(&name)?;
        let scale = values.iter().copied().fold(f32::NAN, f32::max);
        if !(scale.is_finite() && scale > 0.0) || values.iter().any(|v| !v.is_finite()) {
            return Err(ModelError::KvCache(format!(
                "{name} holds {values:?}: an FP8 KV cache scale must be finite and positive"
            )));
        }
        Ok(Some((name, scale)))
    };
    let k = read([
        format!("{attn}.k_scale"),
        format!("{attn}.k_proj.k_scale"),
        format!("{attn}.kv_scale"),
    ])?;
    let v = read([
        format!("{attn}.v_scale"),
        format!("{attn}.v_proj.v_scale"),
        format!("{attn}.kv_scale"),
    ])?;
    match (k, v) {
        (Some((_, k)), Some((_, v))) => Ok(Some((k, v))),
        (None, None) => Ok(None),
        (Some((name, _)), None) | (None, Some((name, _))) => Err(ModelError::KvCache(format!(
            "the checkpoint has {name} but not its pair (k_scale and v_scale come together)"
        ))),
    }
}

/// Progress of a load: tensors done, tensors in all, bytes uploaded so far.
pub type LoadProgress<'a> = &'a mut dyn FnMut(usize, usize, u64);

/// The names MiniMax-M2's original checkpoints (and Mixtral's) may give the tensor transformers
/// names `name`, in the order tried: a sparse layer's `mlp.` as `block_sparse_moe.` and its
/// experts' `gate_proj` / `up_proj` / `down_proj` as `w1` / `w3` / `w2`; then the `w` names under
/// `mlp.`. Empty for a name outside a layer's MLP.
pub fn original_names(name: &str) -> Vec<String> {
    let Some((layer, rest)) = name.split_once(".mlp.") else {
        return Vec::new();
    };
    let w_names = rest.strip_prefix("experts.").and_then(|expert| {
        let (e, proj) = expert.split_once('.')?;
        let w = match proj {
            "gate_proj.weight" => "w1.weight",
            "up_proj.weight" => "w3.weight",
            "down_proj.weight" => "w2.weight",
            _ => return None,
        };
        Some(format!("experts.{e}.{w}"))
    });
    match w_names {
        Some(w) => vec![
            format!("{layer}.block_sparse_moe.{w}"),
            format!("{layer}.mlp.{w}"),
        ],
        None => vec![format!("{layer}.block_sparse_moe.{rest}")],
    }
}

/// The names DeepSeek-V3-style checkpoints (GLM-4.5) give the tensor this loader names `name`:
/// the shared expert under `mlp.shared_experts.` and the router's correction bias inside the
/// router (`mlp.gate.e_score_correction_bias`). Empty for other names.
pub fn deepseek_names(name: &str) -> Vec<String> {
    let Some((layer, rest)) = name.split_once(".mlp.") else {
        return Vec::new();
    };
    if let Some(proj) = rest.strip_prefix("shared_expert.") {
        vec![format!("{layer}.mlp.shared_experts.{proj}")]
    } else if rest == "e_score_correction_bias" {
        vec![format!("{layer}.mlp.gate.e_score_correction_bias")]
    } else {
        Vec::new()
    }
}

/// `source` with every tensor also under transformers' name where the file has it under an
/// original name ([`original_names`], [`deepseek_names`], then the hybrid families' prefixes: Nemotron-H's
/// `backbone.`, Qwen3.5's `model.language_model.`); a name the file has wins.
struct Named<'a>(&'a dyn WeightSource);

/// The names Granite's checkpoints give the tensor this loader names `name`: the router, the
/// experts' fused stacks and the shared MLP under `block_sparse_moe.` and `shared_mlp.`, whose
/// `input_linear` holds the gate rows then the up rows (`.1`: which half this tensor is). The
/// shared MLP is a sparse layer's shared expert, or a dense layer's MLP.
pub fn granite_names(name: &str) -> Vec<(String, Option<usize>)> {
    let Some((layer, rest)) = name.split_once(".mlp.") else {
        return Vec::new();
    };
    let whole = |names: &[&str]| {
        names
            .iter()
            .map(|n| (format!("{layer}.{n}"), None))
            .collect::<Vec<_>>()
    };
    let input = |half| {
        vec![(
            format!("{layer}.shared_mlp.input_linear.weight"),
            Some(half),
        )]
    };
    match rest {
        "gate.weight" => whole(&[
            "block_sparse_moe.router.layer.weight",
            "block_sparse_moe.router.weight",
        ]),
        "experts.gate_up_proj" => whole(&[
            "block_sparse_moe.input_linear.weight",
            "block_sparse_moe.experts.gate_up_proj",
        ]),
        "experts.down_proj" => whole(&[
            "block_sparse_moe.output_linear.weight",
            "block_sparse_moe.experts.down_proj",
        ]),
        "shared_expert.gate_proj.weight" | "gate_proj.weight" => input(0),
        "shared_expert.up_proj.weight" | "up_proj.weight" => input(1),
        "shared_expert.down_proj.weight" | "down_proj.weight" => {
            whole(&["shared_mlp.output_linear.weight"])
        }
        _ => Vec::new(),
    }
}

/// Where a tensor is stored: under `name`, whole or (`half`) one half of its rows.
struct Found {
    name: String,
    half: Option<usize>,
}

impl Named<'_> {
    /// Where `source` has the tensor: `name`, or the first original name it has.
    fn find(&self, name: &str) -> Found {
        if self.0.shape(name).is_some() {
            return Found {
                name: name.to_string(),
                half: None,
            };
        }
        original_names(name)
            .into_iter()
            .chain(deepseek_names(name))
            .chain(hybrid::prefixed_names(name))
            .map(|n| (n, None))
            .chain(granite_names(name))
            .find(|(n, _)| self.0.shape(n).is_some())
            .map_or_else(
                || Found {
                    name: name.to_string(),
                    half: None,
                },
                |(name, half)| Found { name, half },
            )
    }
}

/// Half `half` of a tensor's rows (its first axis).
fn half_rows<T: Copy>(shape: &[usize], data: &[T], half: usize) -> (Vec<usize>, Vec<T>) {
    let rows = shape[0] / 2;
    let row: usize = shape[1..].iter().product();
    let mut out = shape.to_vec();
    out[0] = rows;
    (
        out,
        data[half * rows * row..(half + 1) * rows * row].to_vec(),
    )
}

impl WeightSource for Named<'_> {
    fn shape(&self, name: &str) -> Option<Vec<usize>> {
        let f = self.find(name);
        let mut shape = self.0.shape(&f.name)?;
        if f.half.is_some() {
            shape[0] /= 2;
        }
        Some(shape)
    }

    fn load(&self, name: &str) -> Result<HostTensor, WeightError> {
        let f = self.find(name);
        let t = self.0.load(&f.name)?;
        Ok(match f.half {
            None => t,
            Some(h) => {
                let (shape, data) = half_rows(&t.shape, &t.data, h);
                HostTensor { shape, data }
            }
        })
    }

    fn load_f32(&self, name: &str) -> Result<(Vec<usize>, Vec<f32>), WeightError> {
        let f = self.find(name);
        let (shape, values) = self.0.load_f32(&f.name)?;
        Ok(match f.half {
            None => (shape, values),
            Some(h) => half_rows(&shape, &values, h),
        })
    }

    fn is_e4m3(&self, name: &str) -> bool {
        // Half a stored FP8 tensor reads through `load` (dequantised).
        let f = self.find(name);
        f.half.is_none() && self.0.is_e4m3(&f.name)
    }

    fn load_e4m3(&self, name: &str) -> Result<(Vec<usize>, Vec<u8>), WeightError> {
        self.0.load_e4m3(&self.find(name).name)
    }

    fn describe(&self) -> String {
        self.0.describe()
    }
}

/// `source` with a model's constant multipliers ([`Multipliers`], Granite's) folded into the
/// weights they meet, so that no kernel applies them: the embedding rows times `embedding` (the
/// same bf16 values as transformers' product), the LM head divided by `logits` (a tied head is
/// the embedding read again, divided), and every block's output product (`o_proj`, `down_proj`,
/// the experts' down stacks, a mixer's `out_proj`) times `residual`, each rounded to bf16 once. A
/// scaled tensor stored as FP8 reads as BF16 (its dequantised values, scaled).
struct Scaled<'a> {
    source: &'a dyn WeightSource,
    multipliers: Multipliers,
    tied: bool,
}

const EMBEDDING: &str = "model.embed_tokens.weight";
const LM_HEAD: &str = "lm_head.weight";

impl Scaled<'_> {
    /// The factor `name`'s values are multiplied by.
    fn factor(&self, name: &str) -> f32 {
        let m = &self.multipliers;
        let block_output = name.starts_with("model.layers.")
            && [
                ".o_proj.weight",
                "down_proj.weight",
                ".experts.down_proj",
                ".out_proj.weight",
            ]
            .iter()
            .any(|end| name.ends_with(end));
        match name {
            EMBEDDING => m.embedding,
            LM_HEAD => 1.0 / m.logits,
            _ if block_output => m.residual,
            _ => 1.0,
        }
    }

    /// The tensor `name` is read from: a tied LM head is the embedding.
    fn stored(&self, name: &str) -> String {
        if name == LM_HEAD && self.tied && self.source.shape(LM_HEAD).is_none() {
            EMBEDDING.to_string()
        } else {
            name.to_string()
        }
    }
}

impl WeightSource for Scaled<'_> {
    fn shape(&self, name: &str) -> Option<Vec<usize>> {
        self.source.shape(&self.stored(name))
    }

    fn load(&self, name: &str) -> Result<HostTensor, WeightError> {
        let mut t = self.source.load(&self.stored(name))?;
        let f = self.factor(name);
        if f != 1.0 {
            for x in &mut t.data {
                *x = bf16::from_f32(x.to_f32() * f);
            }
        }
        Ok(t)
    }

    fn load_f32(&self, name: &str) -> Result<(Vec<usize>, Vec<f32>), WeightError> {
        let (shape, mut values) = self.source.load_f32(&self.stored(name))?;
        let f = self.factor(name);
        values.iter_mut().for_each(|x| *x *= f);
        Ok((shape, values))
    }

    fn is_e4m3(&self, name: &str) -> bool {
        self.factor(name) == 1.0 && self.source.is_e4m3(&self.stored(name))
    }

    fn load_e4m3(&self, name: &str) -> Result<(Vec<usize>, Vec<u8>), WeightError> {
        self.source.load_e4m3(&self.stored(name))
    }

    fn describe(&self) -> String {
        self.source.describe()
    }
}

/// `source` with its E4M3 tensors readable as BF16 (`e4m3 × scale`, the scale tensor beside each
/// as the scheme names it), for the tensors that stay BF16 in part 1 (MoE experts, unconverted
/// stacks' FP8 parts).
struct Dequantized<'a> {
    source: &'a dyn WeightSource,
    scheme: Option<&'a Fp8Scheme>,
}

/// The FP8 weight `name` (`<module>.weight`) with its scales as `scheme` stores them.
fn stored_fp8(
    source: &dyn WeightSource,
    scheme: &Fp8Scheme,
    name: &str,
) -> Result<Fp8Tensor, WeightError> {
    let (shape, data) = source.load_e4m3(name)?;
    let module = name.strip_suffix(".weight").unwrap_or(name);
    let scale_name = format!("{module}.{}", scheme.scale_name);
    let (scale_shape, scales) = source.load_f32(&scale_name)?;
    let [n, k] = shape[..] else {
        return Err(WeightError::Quantization {
            message: format!("FP8 tensor `{name}` has shape {shape:?}, not a matrix"),
        });
    };
    Fp8Tensor::from_stored((n, k), data, scales, &scale_shape, scheme.scales).map_err(|message| {
        WeightError::Quantization {
            message: format!("`{name}` with `{scale_name}`: {message}"),
        }
    })
}

impl WeightSource for Dequantized<'_> {
    fn shape(&self, name: &str) -> Option<Vec<usize>> {
        self.source.shape(name)
    }

    fn load(&self, name: &str) -> Result<HostTensor, WeightError> {
        match self.scheme {
            Some(scheme) if self.source.is_e4m3(name) => {
                Ok(stored_fp8(self.source, scheme, name)?.dequantize())
            }
            _ => self.source.load(name),
        }
    }

    fn load_f32(&self, name: &str) -> Result<(Vec<usize>, Vec<f32>), WeightError> {
        match self.scheme {
            Some(_) if self.source.is_e4m3(name) => {
                let t = self.load(name)?;
                Ok((t.shape, t.data.into_iter().map(f32::from).collect()))
            }
            _ => self.source.load_f32(name),
        }
    }

    fn is_e4m3(&self, name: &str) -> bool {
        self.source.is_e4m3(name)
    }

    fn load_e4m3(&self, name: &str) -> Result<(Vec<usize>, Vec<u8>), WeightError> {
        self.source.load_e4m3(name)
    }

    fn describe(&self) -> String {
        self.source.describe()
    }
}

/// Where one of a sparse layer's expert stacks (the first product's, or the down product's)
/// comes from in the checkpoint.
enum StackParts {
    /// Per expert, its tensors of the stack in row order (gate then up; up; down).
    PerExpert(Vec<Vec<TensorRole>>),
    /// Tensors `[experts, rows, cols]` whose expert slices, each cut into `.1` equal row pieces
    /// (its projections: the fused gate|up's gate and up), make each expert's rows in order.
    Stack(Vec<(TensorRole, usize)>),
}

/// A sparse layer's expert stacks in the checkpoint.
struct ExpertParts {
    experts: usize,
    /// The first product's: gate|up, or squared ReLU's up.
    first: StackParts,
    down: StackParts,
}

impl StackParts {
    fn roles(&self) -> Vec<TensorRole> {
        match self {
            StackParts::PerExpert(each) => each.iter().flatten().copied().collect(),
            StackParts::Stack(stacks) => stacks.iter().map(|(r, _)| *r).collect(),
        }
    }
}

impl ExpertParts {
    /// The per-expert layout's tensors of both stacks, each in row order.
    fn per_expert_roles(&self) -> (Vec<TensorRole>, Vec<TensorRole>) {
        (self.first.roles(), self.down.roles())
    }
}

/// Refuses FP8 expert tensors in a layout the loader does not read (before anything uploads):
/// stacked expert tensors (`mlp.experts.gate_up_proj`, `experts.up_proj`, ...) stored as E4M3.
/// FP8 experts are read as one tensor per expert and projection with its scales beside it (the
/// hub's FP8 checkpoints: Qwen3-30B-A3B-FP8, DeepSeek-V3, MiniMax-M2).
fn check_fp8_expert_layout(c: &ModelConfig, source: &dyn WeightSource) -> Result<(), ModelError> {
    for role in source_tensors(c, source) {
        let stacked = matches!(
            role,
            TensorRole::ExpertsGateUp(_)
                | TensorRole::ExpertsDown(_)
                | TensorRole::ExpertsGate(_)
                | TensorRole::ExpertsUp(_)
                | TensorRole::NemotronH(NemotronTensor::ExpertsUp(_))
                | TensorRole::NemotronH(NemotronTensor::ExpertsDown(_))
        );
        let name = role.hf_name();
        if stacked && source.is_e4m3(&name) {
            return Err(ModelError::Unsupported(format!(
                "`{name}` in {} is a stack of every expert stored as FP8 (float8_e4m3fn): that \
                 layout's scales are not read; FP8 experts load from one tensor per expert and \
                 projection (`...experts.{{e}}.gate_proj.weight` with its scale tensor), or \
                 convert the checkpoint's experts to BF16",
                source.describe()
            )));
        }
    }
    Ok(())
}

/// Every tensor the config needs from `source`, its sparse layers' experts in the layout the
/// source has.
fn source_tensors(c: &ModelConfig, source: &dyn WeightSource) -> Vec<TensorRole> {
    tensors_in(c, &|l| ExpertLayout::of(source, l))
}

/// Checks every tensor the config needs exists in `source` with the right shape, before any load.
pub fn check_shapes(c: &ModelConfig, source: &dyn WeightSource) -> Result<(), ModelError> {
    let source = &Named(source);
    for role in source_tensors(c, source) {
        let name = role.hf_name();
        let want = role.shape(c);
        match source.shape(&name) {
            None => {
                return Err(ModelError::MissingTensor {
                    name,
                    checkpoint: source.describe(),
                });
            }
            Some(got) if got != want => {
                return Err(ModelError::ShapeMismatch {
                    name,
                    expected: want,
                    found: got,
                    checkpoint: source.describe(),
                });
            }
            Some(_) => {}
        }
    }
    Ok(())
}

/// Uploads the checkpoint, its linears in BF16.
pub fn load(
    c: &ModelConfig,
    source: &dyn WeightSource,
    gpu: &dyn GpuBackend,
    progress: LoadProgress,
) -> Result<DeviceWeights, ModelError> {
    load_with(c, source, gpu, &LinearFormat::Bf16, false, progress)
}

/// Uploads the checkpoint, its linears in `format`. Shapes are checked first; on error, whatever
/// was uploaded is freed.
pub fn load_with(
    c: &ModelConfig,
    source: &dyn WeightSource,
    gpu: &dyn GpuBackend,
    format: &LinearFormat,
    fp8_experts: bool,
    progress: LoadProgress,
) -> Result<DeviceWeights, ModelError> {
    check_shapes(c, source)?;
    let scheme = match format {
        LinearFormat::Fp8Stored(scheme) => {
            scheme.check_patterns()?;
            Some(scheme)
        }
        _ => None,
    };
    let dequantized = Dequantized { source, scheme };
    let named = Named(&dequantized);
    let scaled = Scaled {
        source: &named,
        multipliers: c.multipliers,
        tied: c.tie_word_embeddings,
    };
    let source: &dyn WeightSource = if c.multipliers.weights_unscaled() {
        &named
    } else {
        &scaled
    };
    if scheme.is_some() {
        check_fp8_expert_layout(c, source)?;
    }
    let mut allocations = Vec::new();
    let result = load_inner(
        c,
        source,
        gpu,
        format,
        fp8_experts,
        progress,
        &mut allocations,
    );
    if result.is_err() {
        for p in allocations {
            let _ = gpu.free(p);
        }
    }
    result
}

/// Uploads tensors one by one, counting progress.
struct Uploader<'a> {
    source: &'a dyn WeightSource,
    format: &'a LinearFormat,
    /// Whether FP8 formats make the routed experts FP8 (the tuning's `moe_fp8_experts`).
    fp8_experts: bool,
    fp8_max_weights: usize,
    fp8_max_k: usize,
    fp8_max_n: usize,
    fp8_max_dequant_weights: usize,
    gpu: &'a dyn GpuBackend,
    progress: LoadProgress<'a>,
    allocations: &'a mut Vec<DevicePtr>,
    done: usize,
    total: usize,
    bytes: u64,
}

impl Uploader<'_> {
    /// Counts an FP8 weight of `n x k` in blocks of `2^row_shift` rows towards the BF16 scratch
    /// where the FP8 library product cannot take it.
    fn note_fp8_dequant(&mut self, n: usize, k: usize, row_shift: u32) {
        let fits = row_shift == 7
            && u32::try_from(n).is_ok_and(|n| {
                u32::try_from(k).is_ok_and(|k| metrale_kernels::ops::gemm_fp8_fits(n, k))
            });
        if !fits {
            self.fp8_max_dequant_weights = self.fp8_max_dequant_weights.max(n * k);
        }
    }

    fn put(&mut self, t: &HostTensor, tensors: usize) -> Result<DevicePtr, ModelError> {
        self.put_bytes(bytemuck::cast_slice(&t.data), tensors)
    }

    fn put_bytes(&mut self, bytes: &[u8], tensors: usize) -> Result<DevicePtr, ModelError> {
        let ptr = self.gpu.alloc(bytes.len())?;
        self.allocations.push(ptr);
        self.gpu.copy_h2d(bytes, ptr)?;
        self.done += tensors;
        self.bytes += bytes.len() as u64;
        (self.progress)(self.done, self.total, self.bytes);
        Ok(ptr)
    }

    /// A dense linear: `roles` stacked along their rows, in the uploader's format.
    fn linear(&mut self, roles: &[TensorRole]) -> Result<LinearWeight, ModelError> {
        let names: Vec<String> = roles.iter().map(|r| r.hf_name()).collect();
        let fp8 = match self.format {
            LinearFormat::Bf16 => None,
            LinearFormat::Fp8Quantize => {
                let mut shape = Vec::new();
                let mut data = Vec::new();
                for name in &names {
                    let t = self.source.load(name)?;
                    if shape.is_empty() {
                        shape = t.shape.clone();
                    } else {
                        shape[0] += t.shape[0];
                    }
                    data.extend_from_slice(&t.data);
                }
                let quantized = Fp8Tensor::quantize(&HostTensor { shape, data }).map_err(|e| {
                    WeightError::Quantization {
                        message: format!("quantizing {}: {e}", names.join(" | ")),
                    }
                })?;
                Some(quantized)
            }
            LinearFormat::Fp8Stored(scheme) => {
                // FP8 when every part is stored FP8 and converted; a stack with a BF16 part
                // stays BF16 (its FP8 parts dequantised).
                let all = names.iter().all(|n| {
                    self.source.is_e4m3(n)
                        && scheme.converts(n.strip_suffix(".weight").unwrap_or(n))
                });
                if all {
                    let parts = names
                        .iter()
                        .map(|n| stored_fp8(self.source, scheme, n))
                        .collect::<Result<Vec<_>, _>>()?;
                    Some(Fp8Tensor::stack(parts))
                } else {
                    None
                }
            }
        };
        match fp8 {
            Some(t) => {
                self.fp8_max_weights = self.fp8_max_weights.max(t.n * t.k);
                self.fp8_max_k = self.fp8_max_k.max(t.k);
                self.fp8_max_n = self.fp8_max_n.max(t.n);
                self.note_fp8_dequant(t.n, t.k, t.row_shift());
                let w = self.put_bytes(&t.data, 0)?;
                let scales = self.put_bytes(bytemuck::cast_slice(&t.scales), roles.len())?;
                Ok(LinearWeight {
                    w,
                    scales,
                    row_shift: t.row_shift(),
                })
            }
            None => Ok(LinearWeight::bf16(self.get_stacked(roles)?)),
        }
    }

    /// A dense linear from rows already assembled on the host (`tensors` of the checkpoint's
    /// went into it), in the uploader's format.
    fn linear_host(&mut self, t: HostTensor, tensors: usize) -> Result<LinearWeight, ModelError> {
        if matches!(self.format, LinearFormat::Fp8Quantize) {
            let q = Fp8Tensor::quantize(&t).map_err(|e| WeightError::Quantization {
                message: format!("quantizing a stacked product of {:?}: {e}", t.shape),
            })?;
            self.fp8_max_weights = self.fp8_max_weights.max(q.n * q.k);
            self.fp8_max_k = self.fp8_max_k.max(q.k);
            self.fp8_max_n = self.fp8_max_n.max(q.n);
            self.note_fp8_dequant(q.n, q.k, q.row_shift());
            let w = self.put_bytes(&q.data, 0)?;
            let scales = self.put_bytes(bytemuck::cast_slice(&q.scales), tensors)?;
            return Ok(LinearWeight {
                w,
                scales,
                row_shift: q.row_shift(),
            });
        }
        Ok(LinearWeight::bf16(self.put(&t, tensors)?))
    }

    /// A norm's weight as the checkpoint stores it. A unit-offset norm's (Qwen3-Next's, which
    /// scale by `1 + weight`) stays centred on zero: its kernel adds the 1 in f32
    /// ([`crate::plan::NormKind::weight_offset`]), where `1 + weight` rounded to bf16 here would
    /// move each channel's scale by up to half a bf16 ulp, the same way at every token.
    fn get_norm(&mut self, role: TensorRole) -> Result<DevicePtr, ModelError> {
        self.get(role)
    }

    /// A gated attention's q|k|v product and its output-gate product, from `q_proj`'s per-head
    /// query and gate halves.
    fn gated_qkv(
        &mut self,
        c: &ModelConfig,
        l: usize,
    ) -> Result<(LinearWeight, LinearWeight), ModelError> {
        let q = self.source.load(&TensorRole::Q(l).hf_name())?;
        let k = self.source.load(&TensorRole::K(l).hf_name())?;
        let v = self.source.load(&TensorRole::V(l).hf_name())?;
        let hidden = c.hidden_size;
        let half = c.head_dim * hidden;
        let (mut qkv, mut gate) = (Vec::new(), Vec::new());
        for head in q.data.chunks_exact(2 * half) {
            qkv.extend_from_slice(&head[..half]);
            gate.extend_from_slice(&head[half..]);
        }
        qkv.extend_from_slice(&k.data);
        qkv.extend_from_slice(&v.data);
        let rows = |d: &Vec<bf16>| d.len() / hidden;
        let qkv = HostTensor {
            shape: vec![rows(&qkv), hidden],
            data: qkv,
        };
        let gate = HostTensor {
            shape: vec![rows(&gate), hidden],
            data: gate,
        };
        Ok((self.linear_host(qkv, 3)?, self.linear_host(gate, 0)?))
    }

    /// Layer `l`'s Gated DeltaNet mixer, its input products rearranged into one
    /// ([`GdnWeights::in_proj`]).
    fn gdn(&mut self, g: &GatedDeltaNetConfig, l: usize) -> Result<GdnWeights, ModelError> {
        let name = |t: GdnTensor| TensorRole::GatedDeltaNet(l, t).hf_name();
        let load = |u: &Self, t: GdnTensor| u.source.load(&name(t));
        let (nk, nv, dk, dv) = (g.key_heads, g.value_heads, g.key_head_dim, g.value_head_dim);
        let per = nv / nk;
        let (q, k, v, z, ba, tensors);
        match g.projection {
            GdnProjection::SplitQkvZBA => {
                let qkv = load(self, GdnTensor::InProjQkv)?;
                let hidden = qkv.shape[1];
                let (kd, vd) = (nk * dk * hidden, nv * dv * hidden);
                q = qkv.data[..kd].to_vec();
                k = qkv.data[kd..2 * kd].to_vec();
                v = qkv.data[2 * kd..2 * kd + vd].to_vec();
                z = load(self, GdnTensor::InProjZ)?.data;
                let (b, a) = (
                    load(self, GdnTensor::InProjB)?.data,
                    load(self, GdnTensor::InProjA)?.data,
                );
                let group = per * hidden;
                let mut grouped = Vec::with_capacity(b.len() + a.len());
                for (bg, ag) in b.chunks_exact(group).zip(a.chunks_exact(group)) {
                    grouped.extend_from_slice(bg);
                    grouped.extend_from_slice(ag);
                }
                ba = grouped;
                tensors = 4;
            }
            _ => {
                let qkvz = load(self, GdnTensor::InProjQkvz)?;
                let hidden = qkvz.shape[1];
                let (kh, vh) = (dk * hidden, per * dv * hidden);
                let (mut qs, mut ks, mut vs, mut zs) =
                    (Vec::new(), Vec::new(), Vec::new(), Vec::new());
                for group in qkvz.data.chunks_exact(2 * kh + 2 * vh) {
                    qs.extend_from_slice(&group[..kh]);
                    ks.extend_from_slice(&group[kh..2 * kh]);
                    vs.extend_from_slice(&group[2 * kh..2 * kh + vh]);
                    zs.extend_from_slice(&group[2 * kh + vh..]);
                }
                (q, k, v, z) = (qs, ks, vs, zs);
                ba = load(self, GdnTensor::InProjBa)?.data;
                tensors = 2;
            }
        }
        let hidden = (q.len() / (nk * dk)).max(1);
        let data = [q, k, v, z, ba].concat();
        let in_proj = HostTensor {
            shape: vec![data.len() / hidden, hidden],
            data,
        };
        let in_proj = self.linear_host(in_proj, tensors)?;
        let conv = self.get(TensorRole::GatedDeltaNet(l, GdnTensor::Conv))?;
        let dt_bias = self.get_f32(TensorRole::GatedDeltaNet(l, GdnTensor::DtBias))?;
        let a_log = self.get_f32(TensorRole::GatedDeltaNet(l, GdnTensor::ALog))?;
        let norm = self.get(TensorRole::GatedDeltaNet(l, GdnTensor::Norm))?;
        let out = self.linear(&[TensorRole::GatedDeltaNet(l, GdnTensor::OutProj)])?;
        Ok(GdnWeights {
            in_proj,
            conv,
            dt_bias,
            a_log,
            norm,
            out,
        })
    }

    /// `role` uploaded as f32, its values exactly as the file holds them.
    fn get_f32(&mut self, role: TensorRole) -> Result<DevicePtr, ModelError> {
        let (_, values) = self.source.load_f32(&role.hf_name())?;
        self.put_bytes(bytemuck::cast_slice(&values), 1)
    }

    fn get(&mut self, role: TensorRole) -> Result<DevicePtr, ModelError> {
        let t = self.source.load(&role.hf_name())?;
        self.put(&t, 1)
    }

    fn get_if(&mut self, present: bool, role: TensorRole) -> Result<DevicePtr, ModelError> {
        if present {
            self.get(role)
        } else {
            Ok(DevicePtr::NULL)
        }
    }

    /// A dense linear of `roles` where `present`, else a null BF16 weight.
    fn linear_if(
        &mut self,
        present: bool,
        roles: &[TensorRole],
    ) -> Result<LinearWeight, ModelError> {
        if present {
            self.linear(roles)
        } else {
            Ok(LinearWeight::bf16(DevicePtr::NULL))
        }
    }

    /// A Mamba-2 mixer's weights, `role` naming each of its tensors (Nemotron-H's or Granite's).
    fn mamba(
        &mut self,
        c: &ModelConfig,
        role: &dyn Fn(MambaTensor) -> TensorRole,
    ) -> Result<MambaWeights, ModelError> {
        let bias = c
            .hybrid
            .as_ref()
            .and_then(|h| h.mamba2)
            .is_some_and(|s| s.conv_bias);
        Ok(MambaWeights {
            in_proj: self.linear(&[role(MambaTensor::InProj)])?,
            conv: self.get(role(MambaTensor::Conv))?,
            conv_bias: self.get_if(bias, role(MambaTensor::ConvBias))?,
            dt_bias: self.get_f32(role(MambaTensor::DtBias))?,
            a_log: self.get_f32(role(MambaTensor::ALog))?,
            d: self.get_f32(role(MambaTensor::D))?,
            norm: self.get(role(MambaTensor::Norm))?,
            out: self.linear(&[role(MambaTensor::OutProj)])?,
        })
    }

    /// Layer `l`'s sparse MLP, its experts stacked as the kernels read them whatever the layout,
    /// and its shared expert if the config has one.
    fn moe(&mut self, m: &metrale_config::MoeConfig, l: usize) -> Result<MoeWeights, ModelError> {
        let router = self.get(TensorRole::Router(l))?;
        let correction_bias = match m.router {
            RouterKind::SigmoidBias => self.get_f32(TensorRole::CorrectionBias(l))?,
            RouterKind::Softmax => DevicePtr::NULL,
        };
        let layout = ExpertLayout::of(self.source, l);
        let parts = ExpertParts {
            experts: m.num_experts,
            first: match layout {
                ExpertLayout::Fused => StackParts::Stack(vec![(TensorRole::ExpertsGateUp(l), 2)]),
                ExpertLayout::Split => StackParts::Stack(vec![
                    (TensorRole::ExpertsGate(l), 1),
                    (TensorRole::ExpertsUp(l), 1),
                ]),
                ExpertLayout::PerExpert => StackParts::PerExpert(
                    (0..m.num_experts)
                        .map(|e| vec![TensorRole::ExpertGate(l, e), TensorRole::ExpertUp(l, e)])
                        .collect(),
                ),
            },
            down: match layout {
                ExpertLayout::PerExpert => StackParts::PerExpert(
                    (0..m.num_experts)
                        .map(|e| vec![TensorRole::ExpertDown(l, e)])
                        .collect(),
                ),
                _ => StackParts::Stack(vec![(TensorRole::ExpertsDown(l), 1)]),
            },
        };
        let (experts_gate_up, experts_down) = match self.fp8_experts(&parts)? {
            Some(stacks) => stacks,
            None => {
                let (gate_up, down) = match layout {
                    ExpertLayout::Fused => (
                        self.get(TensorRole::ExpertsGateUp(l))?,
                        self.get(TensorRole::ExpertsDown(l))?,
                    ),
                    ExpertLayout::Split => (
                        self.get_interleaved(TensorRole::ExpertsGate(l), TensorRole::ExpertsUp(l))?,
                        self.get(TensorRole::ExpertsDown(l))?,
                    ),
                    ExpertLayout::PerExpert => {
                        let (first, down) = parts.per_expert_roles();
                        (self.get_stacked(&first)?, self.get_stacked(&down)?)
                    }
                };
                (LinearWeight::bf16(gate_up), LinearWeight::bf16(down))
            }
        };
        let shared = m.shared_expert_intermediate.is_some();
        Ok(MoeWeights {
            router,
            experts_gate_up,
            experts_down,
            shared_gate_up: self.linear_if(
                shared,
                &[TensorRole::SharedGate(l), TensorRole::SharedUp(l)],
            )?,
            shared_down: self.linear_if(shared, &[TensorRole::SharedDown(l)])?,
            shared_gate: self.get_if(
                shared && m.shared_expert_gated,
                TensorRole::SharedExpertGate(l),
            )?,
            correction_bias,
        })
    }

    /// A sparse layer's expert stacks in FP8 where the format makes them FP8: quantized at load
    /// (each expert's projections on their own 128 x 128 block grids, as FP8 checkpoints store
    /// them), or the checkpoint's FP8 experts where every expert tensor of the layer is stored
    /// FP8 and converted; `None` for BF16 experts (a BF16 format, or an FP8 checkpoint whose
    /// experts are not all FP8: those stay BF16, their FP8 tensors dequantised). Each stack is
    /// one [`Fp8Tensor`] of the experts' rows ([`Fp8Tensor::stack`]).
    fn fp8_experts(
        &mut self,
        parts: &ExpertParts,
    ) -> Result<Option<(LinearWeight, LinearWeight)>, ModelError> {
        let stack = |u: &Self, p: &StackParts| -> Result<Fp8Tensor, ModelError> {
            match u.format {
                LinearFormat::Bf16 => unreachable!("BF16 experts take no FP8 stack"),
                LinearFormat::Fp8Quantize => u.quantized_stack(p, parts.experts),
                LinearFormat::Fp8Stored(scheme) => match p {
                    StackParts::PerExpert(each) => {
                        let mut experts = Vec::with_capacity(each.len());
                        for roles in each {
                            let projections = roles
                                .iter()
                                .map(|r| stored_fp8(u.source, scheme, &r.hf_name()))
                                .collect::<Result<Vec<_>, _>>()?;
                            experts.push(Fp8Tensor::stack(projections));
                        }
                        Ok(Fp8Tensor::stack(experts))
                    }
                    StackParts::Stack(stacks) => Err(ModelError::Unsupported(format!(
                        "FP8 expert stacks ({}) are not read",
                        stacks[0].0.hf_name()
                    ))),
                },
            }
        };
        if !self.fp8_experts {
            return Ok(None);
        }
        match self.format {
            LinearFormat::Bf16 => return Ok(None),
            LinearFormat::Fp8Quantize => {}
            LinearFormat::Fp8Stored(scheme) => {
                let roles = [parts.first.roles(), parts.down.roles()].concat();
                let all = roles.iter().all(|r| {
                    let name = r.hf_name();
                    self.source.is_e4m3(&name)
                        && scheme.converts(name.strip_suffix(".weight").unwrap_or(&name))
                });
                if !all {
                    return Ok(None);
                }
            }
        }
        let tensors = parts.first.roles().len() + parts.down.roles().len();
        let (first, down) = (stack(self, &parts.first)?, stack(self, &parts.down)?);
        let upload = |u: &mut Self, t: &Fp8Tensor, tensors: usize| {
            let w = u.put_bytes(&t.data, 0)?;
            let scales = u.put_bytes(bytemuck::cast_slice(&t.scales), tensors)?;
            Ok::<_, ModelError>(LinearWeight {
                w,
                scales,
                row_shift: t.row_shift(),
            })
        };
        let first = upload(self, &first, parts.first.roles().len())?;
        let down = upload(self, &down, tensors - parts.first.roles().len())?;
        Ok(Some((first, down)))
    }

    /// One expert stack quantized at load: every expert's projections (each a piece of rows)
    /// quantized in 128 x 128 blocks of their own, then stacked.
    fn quantized_stack(&self, p: &StackParts, experts: usize) -> Result<Fp8Tensor, ModelError> {
        let quantize = |t: HostTensor, what: &dyn Fn() -> String| {
            Fp8Tensor::quantize(&t).map_err(|e| {
                ModelError::from(WeightError::Quantization {
                    message: format!("quantizing {}: {e}", what()),
                })
            })
        };
        let mut stacked = Vec::with_capacity(experts);
        match p {
            StackParts::PerExpert(each) => {
                for roles in each {
                    let mut projections = Vec::with_capacity(roles.len());
                    for r in roles {
                        let name = r.hf_name();
                        projections.push(quantize(self.source.load(&name)?, &|| name.clone())?);
                    }
                    stacked.push(Fp8Tensor::stack(projections));
                }
            }
            StackParts::Stack(stacks) => {
                let tensors = stacks
                    .iter()
                    .map(|(r, _)| self.source.load(&r.hf_name()))
                    .collect::<Result<Vec<_>, _>>()?;
                for e in 0..experts {
                    let mut projections = Vec::new();
                    for (t, &(role, pieces)) in tensors.iter().zip(stacks) {
                        let [n, rows, cols] = t.shape[..] else {
                            return Err(ModelError::Unsupported(format!(
                                "`{}` has shape {:?}, not [experts, rows, cols]",
                                role.hf_name(),
                                t.shape
                            )));
                        };
                        let expert = &t.data[e * rows * cols..(e + 1) * rows * cols];
                        let each = rows / pieces.max(1);
                        for (i, piece) in expert.chunks_exact((each * cols).max(1)).enumerate() {
                            let what = || format!("{}[{e}] piece {i} of {n}", role.hf_name());
                            let t = HostTensor {
                                shape: vec![each, cols],
                                data: piece.to_vec(),
                            };
                            projections.push(quantize(t, &what)?);
                        }
                    }
                    stacked.push(Fp8Tensor::stack(projections));
                }
            }
        }
        Ok(Fp8Tensor::stack(stacked))
    }

    /// Nemotron-H layer `l`'s experts (`mixer.*`): the router and its correction bias, the
    /// squared-ReLU experts' up and down stacks in either layout (`experts.{e}.up_proj.weight`,
    /// the hub's; `experts.up_proj`, transformers' stacks), the ungated shared expert.
    fn nemotron_moe(
        &mut self,
        m: &metrale_config::MoeConfig,
        l: usize,
    ) -> Result<MoeWeights, ModelError> {
        let n = TensorRole::NemotronH;
        let router = self.get(n(NemotronTensor::Router(l)))?;
        let correction_bias = self.get_f32(n(NemotronTensor::CorrectionBias(l)))?;
        let fused = ExpertLayout::of(self.source, l) == ExpertLayout::Fused;
        let per_expert = |role: fn(usize, usize) -> NemotronTensor| {
            StackParts::PerExpert((0..m.num_experts).map(|e| vec![n(role(l, e))]).collect())
        };
        let parts = match fused {
            true => ExpertParts {
                experts: m.num_experts,
                first: StackParts::Stack(vec![(n(NemotronTensor::ExpertsUp(l)), 1)]),
                down: StackParts::Stack(vec![(n(NemotronTensor::ExpertsDown(l)), 1)]),
            },
            false => ExpertParts {
                experts: m.num_experts,
                first: per_expert(NemotronTensor::ExpertUp),
                down: per_expert(NemotronTensor::ExpertDown),
            },
        };
        let (experts_gate_up, experts_down) = match self.fp8_experts(&parts)? {
            Some(stacks) => stacks,
            None if fused => (
                LinearWeight::bf16(self.get(n(NemotronTensor::ExpertsUp(l)))?),
                LinearWeight::bf16(self.get(n(NemotronTensor::ExpertsDown(l)))?),
            ),
            None => {
                let (up, down) = parts.per_expert_roles();
                (
                    LinearWeight::bf16(self.get_stacked(&up)?),
                    LinearWeight::bf16(self.get_stacked(&down)?),
                )
            }
        };
        let shared = m.shared_expert_intermediate.is_some();
        Ok(MoeWeights {
            router,
            experts_gate_up,
            experts_down,
            shared_gate_up: self.linear_if(shared, &[n(NemotronTensor::SharedUp(l))])?,
            shared_down: self.linear_if(shared, &[n(NemotronTensor::SharedDown(l))])?,
            shared_gate: DevicePtr::NULL,
            correction_bias,
        })
    }

    /// Two stacks `[n, rows, cols]` interleaved along their first axis into `[n, 2 rows, cols]`:
    /// entry `j`'s rows of `a`, then its rows of `b` (the split layout's gate and up stacks as
    /// the kernels read every expert's gate|up).
    fn get_interleaved(&mut self, a: TensorRole, b: TensorRole) -> Result<DevicePtr, ModelError> {
        let (ta, tb) = (
            self.source.load(&a.hf_name())?,
            self.source.load(&b.hf_name())?,
        );
        let n = ta.shape.first().copied().unwrap_or(0);
        if ta.shape != tb.shape || n == 0 {
            return Err(ModelError::ShapeMismatch {
                name: b.hf_name(),
                expected: ta.shape.clone(),
                found: tb.shape.clone(),
                checkpoint: self.source.describe(),
            });
        }
        let each = ta.data.len() / n;
        let mut data = Vec::with_capacity(2 * ta.data.len());
        for (x, y) in ta.data.chunks_exact(each).zip(tb.data.chunks_exact(each)) {
            data.extend_from_slice(x);
            data.extend_from_slice(y);
        }
        let mut shape = ta.shape.clone();
        shape[1] *= 2;
        self.put(&HostTensor { shape, data }, 2)
    }

    /// Tensors with the same trailing shape, stacked along their first axis into one device
    /// tensor.
    fn get_stacked(&mut self, roles: &[TensorRole]) -> Result<DevicePtr, ModelError> {
        let mut shape = Vec::new();
        let mut data = Vec::new();
        for &role in roles {
            let t = self.source.load(&role.hf_name())?;
            if shape.is_empty() {
                shape = t.shape.clone();
            } else {
                shape[0] += t.shape[0];
            }
            data.extend_from_slice(&t.data);
        }
        self.put(&HostTensor { shape, data }, roles.len())
    }
}

fn load_inner(
    c: &ModelConfig,
    source: &dyn WeightSource,
    gpu: &dyn GpuBackend,
    format: &LinearFormat,
    fp8_experts: bool,
    progress: LoadProgress,
    allocations: &mut Vec<DevicePtr>,
) -> Result<DeviceWeights, ModelError> {
    let total = source_tensors(c, source).len();
    let mut u = Uploader {
        source,
        format,
        fp8_experts,
        fp8_max_weights: 0,
        fp8_max_k: 0,
        fp8_max_n: 0,
        fp8_max_dequant_weights: 0,
        gpu,
        progress,
        allocations,
        done: 0,
        total,
        bytes: 0,
    };
    if c.family == ModelFamily::NemotronH {
        return nemotron(c, u);
    }
    let embedding = u.get(TensorRole::Embedding)?;
    let gate = c.hybrid.as_ref().is_some_and(|h| h.attention_output_gate);
    let mut layers = Vec::with_capacity(c.num_layers);
    let mut kv_scaled_layers = 0;
    for l in 0..c.num_layers {
        let dense = !c.moe.as_ref().is_some_and(|m| m.is_sparse(l));
        let dense = match c.hybrid.as_ref().and_then(|h| h.layers[l].ffn) {
            Some(Ffn::Sparse) => false,
            Some(Ffn::Dense) => true,
            None => dense,
        };
        let mixer = c.hybrid.as_ref().and_then(|h| h.layers[l].mixer);
        let gdn_mixer = mixer == Some(Mixer::GatedDeltaNet);
        let mamba_mixer = mixer == Some(Mixer::Mamba2);
        let input_norm = u.get_norm(TensorRole::InputNorm(l))?;
        let mut layer = LayerWeights::norms_only(input_norm, DevicePtr::NULL);
        if gdn_mixer {
            let g = c
                .hybrid
                .as_ref()
                .and_then(|h| h.gated_delta_net)
                .expect("a Gated DeltaNet layer has its shape");
            layer.gdn = Some(u.gdn(&g, l)?);
        } else if mamba_mixer {
            layer.mamba = Some(u.mamba(c, &|t| TensorRole::Mamba(l, t))?);
        } else if gate {
            // q_proj holds, per head, head_dim query rows then head_dim gate rows: the query
            // rows stack with k and v into one product, the gate rows make their own.
            let (qkv, attn_gate) = u.gated_qkv(c, l)?;
            layer.qkv = qkv;
            layer.attn_gate = attn_gate;
        } else {
            // q, k and v fused row-wise: one [(H + 2 KV) D, hidden] weight, one product.
            layer.qkv = u.linear(&qkv_roles(c, l))?;
        }
        if !gdn_mixer && !mamba_mixer {
            if c.attention_bias {
                layer.qkv_bias = u.get_stacked(&[
                    TensorRole::QBias(l),
                    TensorRole::KBias(l),
                    TensorRole::VBias(l),
                ])?;
            }
            if c.qk_norm.any() {
                layer.q_norm = u.get_norm(TensorRole::QNorm(l))?;
                layer.k_norm = u.get_norm(TensorRole::KNorm(l))?;
            }
            layer.o = u.linear(&[TensorRole::O(l)])?;
            if let Some(scales) = checkpoint_kv_scales(u.source, l)? {
                layer.kv_scales = scales;
                kv_scaled_layers += 1;
            }
        }
        layer.post_norm = u.get_norm(TensorRole::PostNorm(l))?;
        if dense {
            // gate and up fused row-wise: one [2I, H] weight, one GEMM.
            layer.gate_up = u.linear(&gate_up_roles(c, l))?;
            layer.down = u.linear(&[TensorRole::Down(l)])?;
        } else if let Some(m) = &c.moe {
            layer.moe = Some(u.moe(m, l)?);
        }
        layers.push(layer);
    }
    let final_norm = u.get_norm(TensorRole::FinalNorm)?;
    // A tied head is the embedding, unless multipliers scale the two apart.
    let lm_head = if c.tie_word_embeddings && c.multipliers.weights_unscaled() {
        embedding
    } else {
        u.get(TensorRole::LmHead)?
    };
    let (bytes, fp8_max_weights, fp8_max_k) = (u.bytes, u.fp8_max_weights, u.fp8_max_k);
    Ok(DeviceWeights {
        fp8_max_weights,
        fp8_max_k,
        fp8_max_n: u.fp8_max_n,
        fp8_max_dequant_weights: u.fp8_max_dequant_weights,
        kv_scaled_layers,
        embedding,
        final_norm,
        lm_head,
        layers,
        allocations: std::mem::take(allocations),
        bytes,
    })
}

/// Nemotron-H: one norm and one mixer a layer (Mamba-2, attention without RoPE, the squared-ReLU
/// MLP, or the squared-ReLU experts), under its own names. The layer's one norm serves as both
/// `input_norm` and `post_norm` (whichever block the layer has reads it); the MLP's up product
/// goes in `gate_up`, the experts' up stack in [`MoeWeights::experts_gate_up`] and the shared
/// expert's up in `shared_gate_up` (no gate: the activation is the block's).
fn nemotron(c: &ModelConfig, mut u: Uploader) -> Result<DeviceWeights, ModelError> {
    let n = TensorRole::NemotronH;
    let hybrid = c.hybrid.as_ref().expect("Nemotron-H has a layer pattern");
    let embedding = u.get(n(NemotronTensor::Embedding))?;
    let mut layers = Vec::with_capacity(c.num_layers);
    for (l, layer) in hybrid.layers.iter().enumerate() {
        let norm = u.get(n(NemotronTensor::Norm(l)))?;
        let mut w = LayerWeights::norms_only(norm, norm);
        match (layer.mixer, layer.ffn) {
            (Some(Mixer::Mamba2), _) => {
                w.mamba = Some(u.mamba(c, &|t| n(NemotronTensor::Mamba(l, t)))?);
            }
            (Some(Mixer::Attention), _) => {
                w.qkv = u.linear(&[
                    n(NemotronTensor::Q(l)),
                    n(NemotronTensor::K(l)),
                    n(NemotronTensor::V(l)),
                ])?;
                w.o = u.linear(&[n(NemotronTensor::O(l))])?;
            }
            (None, Some(Ffn::Dense)) => {
                w.gate_up = u.linear(&[n(NemotronTensor::Up(l))])?;
                w.down = u.linear(&[n(NemotronTensor::Down(l))])?;
            }
            (None, Some(Ffn::Sparse)) => {
                let m = c.moe.as_ref().expect("an E layer has the config's experts");
                w.moe = Some(u.nemotron_moe(m, l)?);
            }
            _ => {
                return Err(ModelError::Unsupported(format!(
                    "Nemotron-H layer {l}: {layer:?} is not loaded (its layers are Mamba-2, \
                     attention, dense MLP or experts)"
                )));
            }
        }
        layers.push(w);
    }
    let final_norm = u.get(n(NemotronTensor::FinalNorm))?;
    // A tied head is the embedding, unless multipliers scale the two apart.
    let lm_head = if c.tie_word_embeddings && c.multipliers.weights_unscaled() {
        embedding
    } else {
        u.get(TensorRole::LmHead)?
    };
    Ok(DeviceWeights {
        fp8_max_weights: u.fp8_max_weights,
        fp8_max_k: u.fp8_max_k,
        fp8_max_n: u.fp8_max_n,
        fp8_max_dequant_weights: u.fp8_max_dequant_weights,
        // Nemotron-H's attention layers take no checkpoint KV scales (1.0).
        kv_scaled_layers: 0,
        embedding,
        final_norm,
        lm_head,
        layers,
        allocations: std::mem::take(u.allocations),
        bytes: u.bytes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn minimax(qk: &str) -> ModelConfig {
        metrale_config::from_config_json(&format!(
            r#"{{"model_type": "minimax_m2", "hidden_size": 256, "intermediate_size": 96,
                "num_local_experts": 16, "num_experts_per_tok": 4, "num_attention_heads": 4,
                "num_key_value_heads": 2, "head_dim": 64, "rotary_dim": 32,
                "num_hidden_layers": 2, "vocab_size": 320 {qk}}}"#
        ))
        .unwrap()
    }

    #[test]
    fn minimax_m2_has_whole_width_qk_norms_and_a_correction_bias() {
        let c = minimax("");
        let roles = expected_tensors(&c);
        assert_eq!(TensorRole::QNorm(1).shape(&c), [256]);
        assert_eq!(TensorRole::KNorm(1).shape(&c), [128]);
        assert!(roles.contains(&TensorRole::CorrectionBias(1)));
        assert_eq!(TensorRole::CorrectionBias(1).shape(&c), [16]);
        assert_eq!(
            TensorRole::CorrectionBias(0).hf_name(),
            "model.layers.0.mlp.e_score_correction_bias"
        );
        assert_eq!(
            expected_shape(&c, "model.layers.1.mlp.e_score_correction_bias"),
            Some(vec![16])
        );
        // A softmax router has none.
        let qwen3_moe = metrale_config::from_config_json(
            r#"{"model_type": "qwen3_moe", "hidden_size": 256, "intermediate_size": 512,
                "moe_intermediate_size": 96, "num_experts": 16, "num_experts_per_tok": 4,
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
                "num_hidden_layers": 2, "vocab_size": 320}"#,
        )
        .unwrap();
        assert!(
            !expected_tensors(&qwen3_moe)
                .iter()
                .any(|r| matches!(r, TensorRole::CorrectionBias(_)))
        );
        assert_eq!(TensorRole::QNorm(0).shape(&qwen3_moe), [64]);
    }

    #[test]
    fn original_minimax_names_map_to_transformers_names() {
        assert_eq!(
            original_names("model.layers.3.mlp.experts.7.gate_proj.weight"),
            [
                "model.layers.3.block_sparse_moe.experts.7.w1.weight",
                "model.layers.3.mlp.experts.7.w1.weight"
            ]
        );
        assert_eq!(
            original_names("model.layers.3.mlp.experts.7.up_proj.weight")[0],
            "model.layers.3.block_sparse_moe.experts.7.w3.weight"
        );
        assert_eq!(
            original_names("model.layers.3.mlp.experts.7.down_proj.weight")[0],
            "model.layers.3.block_sparse_moe.experts.7.w2.weight"
        );
        assert_eq!(
            original_names("model.layers.0.mlp.e_score_correction_bias"),
            ["model.layers.0.block_sparse_moe.e_score_correction_bias"]
        );
        assert_eq!(
            original_names("model.layers.0.mlp.gate.weight"),
            ["model.layers.0.block_sparse_moe.gate.weight"]
        );
        assert!(original_names("model.layers.0.self_attn.q_norm.weight").is_empty());
    }

    /// A source holding the tensors under the original names, shapes only.
    struct Original(ModelConfig);

    impl WeightSource for Original {
        fn shape(&self, name: &str) -> Option<Vec<usize>> {
            expected_tensors(&self.0)
                .into_iter()
                .find(|r| original_names(&r.hf_name()).first().map(String::as_str) == Some(name))
                .or_else(|| {
                    expected_tensors(&self.0)
                        .into_iter()
                        .find(|r| r.hf_name() == name && original_names(name).is_empty())
                })
                .map(|r| r.shape(&self.0))
        }
        fn load(&self, name: &str) -> Result<HostTensor, WeightError> {
            Err(WeightError::Missing {
                source_desc: "shapes only".into(),
                name: name.into(),
            })
        }
        fn describe(&self) -> String {
            "original names".into()
        }
    }

    #[test]
    fn a_checkpoint_in_the_original_layout_passes_the_shape_check() {
        let c = minimax("");
        let source = Original(c.clone());
        assert!(
            source
                .shape("model.layers.1.mlp.experts.0.gate_proj.weight")
                .is_none()
        );
        check_shapes(&c, &source).expect("every tensor found under its original name");
        assert_eq!(
            ExpertLayout::of(&Named(&source), 1),
            ExpertLayout::PerExpert
        );
    }
}
