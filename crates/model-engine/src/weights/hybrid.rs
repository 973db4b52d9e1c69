// SPDX-License-Identifier: MIT OR Apache-2.0
//! The tensors of the hybrid families, under the names transformers writes.
//!
//! Qwen3-Next keeps the decoder's two blocks a layer and its names (`input_layernorm`,
//! `self_attn.*`, `post_attention_layernorm`, `mlp.*`): only a Gated DeltaNet layer's mixer is
//! new (`linear_attn.*`, [`GdnTensor`]), and its attention's q projection is twice as wide (each
//! head's query rows, then that head's output-gate rows). Nemotron-H names everything else: one
//! `norm` and one `mixer` a layer, whatever the mixer is (Mamba-2, attention, MLP or experts),
//! `model.embeddings` and `model.norm_f` ([`NemotronTensor`]); the hub's checkpoints (NVIDIA's
//! own modeling code) say `backbone.` for `model.` and hold one tensor per expert, which
//! transformers' conversion stacks into `mixer.experts.up_proj` / `down_proj`; both are read.
//! Qwen3.5 is Qwen3-Next with the Gated DeltaNet's projections split (`in_proj_qkv`, `_z`, `_b`,
//! `_a`); its hub checkpoints, written by the multimodal model, hold the text model under
//! `model.language_model.` (the vision tower and MTP weights are not read).

use metrale_config::{GdnProjection, HybridConfig, Mixer, ModelConfig, ModelFamily};

use super::{ExpertLayout, TensorRole, mlp_roles};

/// A Gated DeltaNet layer's tensors (`model.layers.{l}.linear_attn.*`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GdnTensor {
    /// `in_proj_qkvz` `[2 * key_dim + 2 * value_dim, hidden]`, rows grouped by key head (q, k,
    /// then the v and z of the value heads sharing it), Qwen3-Next.
    InProjQkvz,
    /// `in_proj_ba` `[2 * value_heads, hidden]`, grouped by key head likewise (b, then a).
    InProjBa,
    /// `in_proj_qkv` `[2 * key_dim + value_dim, hidden]`: all q, all k, all v (Qwen3.5).
    InProjQkv,
    /// `in_proj_z` `[value_dim, hidden]` (Qwen3.5).
    InProjZ,
    /// `in_proj_b` `[value_heads, hidden]` (Qwen3.5).
    InProjB,
    /// `in_proj_a` `[value_heads, hidden]` (Qwen3.5).
    InProjA,
    /// The depthwise conv over q|k|v, `[2 * key_dim + value_dim, 1, conv_kernel]`, no bias.
    Conv,
    /// `[value_heads]`, added to `a` before the softplus.
    DtBias,
    /// `[value_heads]`: the decay rate is `-exp(A_log)`.
    ALog,
    /// The gated RMSNorm over one value head, `[value_head_dim]`, scaling by `weight` (not
    /// `1 + weight`).
    Norm,
    /// `out_proj` `[hidden, value_dim]`.
    OutProj,
}

impl GdnTensor {
    fn suffix(self) -> &'static str {
        match self {
            GdnTensor::InProjQkvz => "in_proj_qkvz.weight",
            GdnTensor::InProjBa => "in_proj_ba.weight",
            GdnTensor::InProjQkv => "in_proj_qkv.weight",
            GdnTensor::InProjZ => "in_proj_z.weight",
            GdnTensor::InProjB => "in_proj_b.weight",
            GdnTensor::InProjA => "in_proj_a.weight",
            GdnTensor::Conv => "conv1d.weight",
            GdnTensor::DtBias => "dt_bias",
            GdnTensor::ALog => "A_log",
            GdnTensor::Norm => "norm.weight",
            GdnTensor::OutProj => "out_proj.weight",
        }
    }
}

/// A Mamba-2 mixer's tensors (Nemotron-H's `model.layers.{l}.mixer.*`, Granite's
/// `model.layers.{l}.mamba.*`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MambaTensor {
    /// `in_proj` `[inner + conv_channels + heads, hidden]`: z, then x|B|C, then dt.
    InProj,
    /// The depthwise conv over x|B|C, `[conv_channels, 1, conv_kernel]`.
    Conv,
    /// `[conv_channels]` (`use_conv_bias`).
    ConvBias,
    /// `[heads]`, added to dt before the softplus.
    DtBias,
    /// `[heads]`: the rate is `-exp(A_log)`.
    ALog,
    /// `[heads]`: the skip connection's scale.
    D,
    /// The gated RMSNorm, `[inner]`, normalising over `inner / n_groups` channels at a time.
    Norm,
    /// `out_proj` `[hidden, inner]`.
    OutProj,
}

impl MambaTensor {
    pub(super) fn suffix(self) -> &'static str {
        match self {
            MambaTensor::InProj => "in_proj.weight",
            MambaTensor::Conv => "conv1d.weight",
            MambaTensor::ConvBias => "conv1d.bias",
            MambaTensor::DtBias => "dt_bias",
            MambaTensor::ALog => "A_log",
            MambaTensor::D => "D",
            MambaTensor::Norm => "norm.weight",
            MambaTensor::OutProj => "out_proj.weight",
        }
    }
}

/// Nemotron-H's tensors: the embedding, the final norm, and per layer one norm and one mixer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NemotronTensor {
    /// `model.embeddings.weight` `[vocab, hidden]`.
    Embedding,
    /// `model.norm_f.weight` `[hidden]`.
    FinalNorm,
    /// The layer's one pre-norm `[hidden]`.
    Norm(usize),
    /// A Mamba-2 mixer's tensor.
    Mamba(usize, MambaTensor),
    /// Attention (no bias, no QK-norm, no RoPE): `[heads * head_dim, hidden]`.
    Q(usize),
    /// `[kv_heads * head_dim, hidden]`.
    K(usize),
    /// `[kv_heads * head_dim, hidden]`.
    V(usize),
    /// `[hidden, heads * head_dim]`.
    O(usize),
    /// The squared-ReLU MLP's up `[intermediate, hidden]` (no gate product).
    Up(usize),
    /// `[hidden, intermediate]`.
    Down(usize),
    /// The experts' router `mixer.gate.weight` `[experts, hidden]`.
    Router(usize),
    /// `mixer.gate.e_score_correction_bias` `[experts]` (read as f32).
    CorrectionBias(usize),
    /// Expert `.1`'s up `[expert_intermediate, hidden]` (the hub's per-expert layout).
    ExpertUp(usize, usize),
    /// Expert `.1`'s down `[hidden, expert_intermediate]`.
    ExpertDown(usize, usize),
    /// Every expert's up `[experts, expert_intermediate, hidden]` (transformers' stacks).
    ExpertsUp(usize),
    /// Every expert's down `[experts, hidden, expert_intermediate]`.
    ExpertsDown(usize),
    /// The ungated shared expert's up `[shared_intermediate, hidden]`.
    SharedUp(usize),
    /// `[hidden, shared_intermediate]`.
    SharedDown(usize),
}

impl NemotronTensor {
    /// transformers' name.
    pub(super) fn hf_name(self) -> String {
        let mixer = |l: usize, rest: &str| format!("model.layers.{l}.mixer.{rest}");
        match self {
            NemotronTensor::Embedding => "model.embeddings.weight".into(),
            NemotronTensor::FinalNorm => "model.norm_f.weight".into(),
            NemotronTensor::Norm(l) => format!("model.layers.{l}.norm.weight"),
            NemotronTensor::Mamba(l, t) => mixer(l, t.suffix()),
            NemotronTensor::Q(l) => mixer(l, "q_proj.weight"),
            NemotronTensor::K(l) => mixer(l, "k_proj.weight"),
            NemotronTensor::V(l) => mixer(l, "v_proj.weight"),
            NemotronTensor::O(l) => mixer(l, "o_proj.weight"),
            NemotronTensor::Up(l) => mixer(l, "up_proj.weight"),
            NemotronTensor::Down(l) => mixer(l, "down_proj.weight"),
            NemotronTensor::Router(l) => mixer(l, "gate.weight"),
            NemotronTensor::CorrectionBias(l) => mixer(l, "gate.e_score_correction_bias"),
            NemotronTensor::ExpertUp(l, e) => mixer(l, &format!("experts.{e}.up_proj.weight")),
            NemotronTensor::ExpertDown(l, e) => mixer(l, &format!("experts.{e}.down_proj.weight")),
            NemotronTensor::ExpertsUp(l) => mixer(l, "experts.up_proj"),
            NemotronTensor::ExpertsDown(l) => mixer(l, "experts.down_proj"),
            NemotronTensor::SharedUp(l) => mixer(l, "shared_experts.up_proj.weight"),
            NemotronTensor::SharedDown(l) => mixer(l, "shared_experts.down_proj.weight"),
        }
    }

    /// The shape `c` implies (empty where `c` has no such tensor).
    pub(super) fn shape(self, c: &ModelConfig) -> Vec<usize> {
        let (h, hd) = (c.hidden_size, c.head_dim);
        let (q, kv) = (c.num_heads * hd, c.num_kv_heads * hd);
        match self {
            NemotronTensor::Embedding => vec![c.vocab_size, h],
            NemotronTensor::FinalNorm | NemotronTensor::Norm(_) => vec![h],
            NemotronTensor::Mamba(_, t) => mamba_shape(t, c),
            NemotronTensor::Q(_) => vec![q, h],
            NemotronTensor::K(_) | NemotronTensor::V(_) => vec![kv, h],
            NemotronTensor::O(_) => vec![h, q],
            NemotronTensor::Up(_) => vec![c.intermediate_size, h],
            NemotronTensor::Down(_) => vec![h, c.intermediate_size],
            _ => {
                let Some(m) = &c.moe else {
                    return Vec::new();
                };
                let (e, i) = (m.num_experts, m.expert_intermediate);
                let s = m.shared_expert_intermediate.unwrap_or(0);
                match self {
                    NemotronTensor::Router(_) => vec![e, h],
                    NemotronTensor::CorrectionBias(_) => vec![e],
                    NemotronTensor::ExpertUp(..) => vec![i, h],
                    NemotronTensor::ExpertDown(..) => vec![h, i],
                    NemotronTensor::ExpertsUp(_) => vec![e, i, h],
                    NemotronTensor::ExpertsDown(_) => vec![e, h, i],
                    NemotronTensor::SharedUp(_) => vec![s, h],
                    NemotronTensor::SharedDown(_) => vec![h, s],
                    _ => unreachable!("dense tensors are shaped above"),
                }
            }
        }
    }
}

/// transformers' name of a Gated DeltaNet tensor of layer `l`.
pub(super) fn gdn_name(l: usize, t: GdnTensor) -> String {
    format!("model.layers.{l}.linear_attn.{}", t.suffix())
}

/// The shape of a Gated DeltaNet tensor (empty for a config without Gated DeltaNet layers).
pub(super) fn gdn_shape(t: GdnTensor, c: &ModelConfig) -> Vec<usize> {
    let Some(g) = c.hybrid.as_ref().and_then(|h| h.gated_delta_net) else {
        return Vec::new();
    };
    let h = c.hidden_size;
    let (kd, vd, nv) = (
        g.key_heads * g.key_head_dim,
        g.value_heads * g.value_head_dim,
        g.value_heads,
    );
    match t {
        GdnTensor::InProjQkvz => vec![2 * kd + 2 * vd, h],
        GdnTensor::InProjBa => vec![2 * nv, h],
        GdnTensor::InProjQkv => vec![2 * kd + vd, h],
        GdnTensor::InProjZ => vec![vd, h],
        GdnTensor::InProjB | GdnTensor::InProjA => vec![nv, h],
        GdnTensor::Conv => vec![g.conv_channels(), 1, g.conv_kernel],
        GdnTensor::DtBias | GdnTensor::ALog => vec![nv],
        GdnTensor::Norm => vec![g.value_head_dim],
        GdnTensor::OutProj => vec![h, vd],
    }
}

pub(super) fn mamba_shape(t: MambaTensor, c: &ModelConfig) -> Vec<usize> {
    let Some(m) = c.hybrid.as_ref().and_then(|h| h.mamba2) else {
        return Vec::new();
    };
    let (h, inner, ch) = (c.hidden_size, m.inner(), m.conv_channels());
    match t {
        MambaTensor::InProj => vec![inner + ch + m.heads, h],
        MambaTensor::Conv => vec![ch, 1, m.conv_kernel],
        MambaTensor::ConvBias => vec![ch],
        MambaTensor::DtBias | MambaTensor::ALog | MambaTensor::D => vec![m.heads],
        MambaTensor::Norm => vec![inner],
        MambaTensor::OutProj => vec![h, inner],
    }
}

/// The names hub checkpoints of the hybrid families give the tensor transformers names `name`:
/// Nemotron-H's (NVIDIA's modeling code) `backbone.` for `model.` (and
/// `backbone.embedding.weight` for the embedding); Qwen3.5's, written by its multimodal model,
/// the text model under `model.language_model.`. Empty for a name outside `model.`.
pub(super) fn prefixed_names(name: &str) -> Vec<String> {
    let Some(rest) = name.strip_prefix("model.") else {
        return Vec::new();
    };
    let mut names = vec![format!("backbone.{rest}")];
    if rest == "embeddings.weight" {
        names.push("backbone.embedding.weight".into());
    }
    names.push(format!("model.language_model.{rest}"));
    names
}

/// Every tensor of a hybrid model, in load order, sparse layers' experts in `layout`.
pub(super) fn tensors(
    c: &ModelConfig,
    hybrid: &HybridConfig,
    layout: &dyn Fn(usize) -> ExpertLayout,
) -> Vec<TensorRole> {
    match c.family {
        ModelFamily::NemotronH => nemotron_tensors(c, hybrid, layout),
        _ => qwen_tensors(c, hybrid, layout),
    }
}

/// Qwen3-Next, Qwen3.5 and Granite 4.0: the decoder's names, with a Gated DeltaNet or Mamba-2
/// mixer where the pattern has one.
fn qwen_tensors(
    c: &ModelConfig,
    hybrid: &HybridConfig,
    layout: &dyn Fn(usize) -> ExpertLayout,
) -> Vec<TensorRole> {
    let gdn = |l: usize, t: GdnTensor| TensorRole::GatedDeltaNet(l, t);
    let mut roles = vec![TensorRole::Embedding];
    for (l, layer) in hybrid.layers.iter().enumerate() {
        roles.push(TensorRole::InputNorm(l));
        match layer.mixer {
            Some(Mixer::GatedDeltaNet) => {
                let split = hybrid
                    .gated_delta_net
                    .is_some_and(|g| g.projection == GdnProjection::SplitQkvZBA);
                if split {
                    roles.extend([
                        gdn(l, GdnTensor::InProjQkv),
                        gdn(l, GdnTensor::InProjZ),
                        gdn(l, GdnTensor::InProjB),
                        gdn(l, GdnTensor::InProjA),
                    ]);
                } else {
                    roles.extend([gdn(l, GdnTensor::InProjQkvz), gdn(l, GdnTensor::InProjBa)]);
                }
                roles.extend([
                    gdn(l, GdnTensor::Conv),
                    gdn(l, GdnTensor::DtBias),
                    gdn(l, GdnTensor::ALog),
                    gdn(l, GdnTensor::Norm),
                    gdn(l, GdnTensor::OutProj),
                ]);
            }
            Some(Mixer::Mamba2) => {
                let bias = hybrid.mamba2.is_some_and(|m| m.conv_bias);
                for t in [
                    MambaTensor::InProj,
                    MambaTensor::Conv,
                    MambaTensor::ConvBias,
                    MambaTensor::DtBias,
                    MambaTensor::ALog,
                    MambaTensor::D,
                    MambaTensor::Norm,
                    MambaTensor::OutProj,
                ] {
                    if t != MambaTensor::ConvBias || bias {
                        roles.push(TensorRole::Mamba(l, t));
                    }
                }
            }
            _ => {
                roles.extend([TensorRole::Q(l), TensorRole::K(l), TensorRole::V(l)]);
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
                roles.push(TensorRole::O(l));
            }
        }
        roles.push(TensorRole::PostNorm(l));
        roles.extend(mlp_roles(c, l, layout(l)));
    }
    roles.push(TensorRole::FinalNorm);
    if !c.tie_word_embeddings {
        roles.push(TensorRole::LmHead);
    }
    roles
}

/// Nemotron-H: one norm and one mixer a layer.
fn nemotron_tensors(
    c: &ModelConfig,
    hybrid: &HybridConfig,
    layout: &dyn Fn(usize) -> ExpertLayout,
) -> Vec<TensorRole> {
    use metrale_config::Ffn;
    let n = TensorRole::NemotronH;
    let mut roles = vec![n(NemotronTensor::Embedding)];
    let conv_bias = hybrid.mamba2.is_some_and(|m| m.conv_bias);
    for (l, layer) in hybrid.layers.iter().enumerate() {
        roles.push(n(NemotronTensor::Norm(l)));
        match (layer.mixer, layer.ffn) {
            (Some(Mixer::Mamba2), _) => {
                let m = |t| n(NemotronTensor::Mamba(l, t));
                roles.extend([m(MambaTensor::InProj), m(MambaTensor::Conv)]);
                if conv_bias {
                    roles.push(m(MambaTensor::ConvBias));
                }
                roles.extend([
                    m(MambaTensor::DtBias),
                    m(MambaTensor::ALog),
                    m(MambaTensor::D),
                    m(MambaTensor::Norm),
                    m(MambaTensor::OutProj),
                ]);
            }
            (Some(_), _) => roles.extend([
                n(NemotronTensor::Q(l)),
                n(NemotronTensor::K(l)),
                n(NemotronTensor::V(l)),
                n(NemotronTensor::O(l)),
            ]),
            (None, Some(Ffn::Sparse)) => {
                roles.extend([
                    n(NemotronTensor::Router(l)),
                    n(NemotronTensor::CorrectionBias(l)),
                ]);
                if layout(l) == ExpertLayout::Fused {
                    roles.extend([
                        n(NemotronTensor::ExpertsUp(l)),
                        n(NemotronTensor::ExpertsDown(l)),
                    ]);
                } else {
                    let experts = c.moe.as_ref().map_or(0, |m| m.num_experts);
                    for e in 0..experts {
                        roles.extend([
                            n(NemotronTensor::ExpertUp(l, e)),
                            n(NemotronTensor::ExpertDown(l, e)),
                        ]);
                    }
                }
                if c.moe
                    .as_ref()
                    .is_some_and(|m| m.shared_expert_intermediate.is_some())
                {
                    roles.extend([
                        n(NemotronTensor::SharedUp(l)),
                        n(NemotronTensor::SharedDown(l)),
                    ]);
                }
            }
            (None, _) => roles.extend([n(NemotronTensor::Up(l)), n(NemotronTensor::Down(l))]),
        }
    }
    roles.push(n(NemotronTensor::FinalNorm));
    if !c.tie_word_embeddings {
        roles.push(TensorRole::LmHead);
    }
    roles
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::sync::Arc;

    use metrale_gpu_runtime::{GpuBackend, HostBackend};
    use metrale_model_weights::{HostTensor, WeightError, WeightSource};

    use super::{GdnTensor, ModelConfig, TensorRole};
    use crate::weights::{check_shapes, expected_tensors};
    use crate::{Model, ModelError, ModelOptions, Tuning};

    /// Qwen3-Next-80B-A3B's config.json, the keys the weights depend on.
    const QWEN3_NEXT_80B: &str = r#"{"model_type":"qwen3_next","hidden_size":2048,
      "intermediate_size":5120,"num_hidden_layers":48,"num_attention_heads":16,
      "num_key_value_heads":2,"head_dim":256,"partial_rotary_factor":0.25,"rms_norm_eps":1e-06,
      "rope_theta":5000000,"max_position_embeddings":262144,"vocab_size":151936,
      "full_attention_interval":4,"linear_conv_kernel_dim":4,"linear_key_head_dim":128,
      "linear_num_key_heads":16,"linear_num_value_heads":32,"linear_value_head_dim":128,
      "decoder_sparse_step":1,"mlp_only_layers":[],"moe_intermediate_size":512,
      "norm_topk_prob":true,"num_experts":512,"num_experts_per_tok":10,
      "shared_expert_intermediate_size":512,"tie_word_embeddings":false}"#;

    /// NVIDIA-Nemotron-3-Nano-30B-A3B's config.json, the keys the weights depend on.
    const NEMOTRON_3_NANO: &str = r#"{"model_type":"nemotron_h","hidden_size":2688,
      "hybrid_override_pattern":"MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
      "intermediate_size":1856,"layer_norm_epsilon":1e-05,"mamba_head_dim":64,
      "mamba_num_heads":64,"n_groups":8,"ssm_state_size":128,"conv_kernel":4,"chunk_size":128,
      "use_conv_bias":true,"max_position_embeddings":262144,"mlp_hidden_act":"relu2",
      "moe_intermediate_size":1856,"moe_shared_expert_intermediate_size":3712,
      "n_routed_experts":128,"n_shared_experts":1,"norm_topk_prob":true,"num_attention_heads":32,
      "num_experts_per_tok":6,"num_hidden_layers":52,"num_key_value_heads":2,"head_dim":128,
      "routed_scaling_factor":2.5,"rope_theta":10000,"vocab_size":131072,
      "tie_word_embeddings":false}"#;

    /// Qwen3.5-35B-A3B's config.json: the text model under `text_config` (the vision tower cut).
    const QWEN35_35B_A3B: &str = r#"{"architectures":["Qwen3_5MoeForConditionalGeneration"],
      "model_type":"qwen3_5_moe","tie_word_embeddings":false,
      "text_config":{"attention_bias":false,"attn_output_gate":true,"full_attention_interval":4,
        "head_dim":256,"hidden_act":"silu","hidden_size":2048,"linear_conv_kernel_dim":4,
        "linear_key_head_dim":128,"linear_num_key_heads":16,"linear_num_value_heads":32,
        "linear_value_head_dim":128,"max_position_embeddings":262144,
        "model_type":"qwen3_5_moe_text","moe_intermediate_size":512,"num_attention_heads":16,
        "num_experts":256,"num_experts_per_tok":8,"num_hidden_layers":40,"num_key_value_heads":2,
        "rms_norm_eps":1e-06,"rope_parameters":{"mrope_interleaved":true,
        "mrope_section":[11,11,10],"partial_rotary_factor":0.25,"rope_theta":10000000,
        "rope_type":"default"},"shared_expert_intermediate_size":512,"vocab_size":248320},
      "vision_config":{"depth":27,"model_type":"qwen3_5_moe"}}"#;

    type Table = BTreeMap<String, Vec<usize>>;

    /// The tensors `Qwen3NextForCausalLM` holds at Qwen3-Next-80B-A3B's config, written out from
    /// transformers' module definitions (modeling_qwen3_next.py): `Qwen3NextGatedDeltaNet`
    /// (key_dim = 16 * 128, value_dim = 32 * 128, conv_dim = 2 key_dim + value_dim),
    /// `Qwen3NextAttention` (q_proj `heads * head_dim * 2`), `Qwen3NextSparseMoeBlock`. `fused`:
    /// the experts as transformers 5 holds them (`gate_up_proj`, `down_proj` stacks), else one
    /// tensor per expert as the hub's checkpoint stores them.
    fn qwen3_next_as_transformers_writes_it(fused: bool) -> Table {
        let (hidden, vocab, layers, experts, moe_i, shared_i) = (2048, 151936, 48, 512, 512, 512);
        let (key_dim, value_dim, value_heads, head_v_dim) = (16 * 128, 32 * 128, 32, 128);
        let conv_dim = 2 * key_dim + value_dim;
        let (heads, kv_heads, head_dim) = (16, 2, 256);
        let mut t = Table::new();
        let mut put = |name: String, shape: &[usize]| {
            assert!(t.insert(name, shape.to_vec()).is_none());
        };
        put("model.embed_tokens.weight".into(), &[vocab, hidden]);
        for l in 0..layers {
            let p = |rest: &str| format!("model.layers.{l}.{rest}");
            put(p("input_layernorm.weight"), &[hidden]);
            put(p("post_attention_layernorm.weight"), &[hidden]);
            if (l + 1) % 4 == 0 {
                put(
                    p("self_attn.q_proj.weight"),
                    &[heads * head_dim * 2, hidden],
                );
                put(p("self_attn.k_proj.weight"), &[kv_heads * head_dim, hidden]);
                put(p("self_attn.v_proj.weight"), &[kv_heads * head_dim, hidden]);
                put(p("self_attn.o_proj.weight"), &[hidden, heads * head_dim]);
                put(p("self_attn.q_norm.weight"), &[head_dim]);
                put(p("self_attn.k_norm.weight"), &[head_dim]);
            } else {
                let a = |rest: &str| p(&format!("linear_attn.{rest}"));
                put(
                    a("in_proj_qkvz.weight"),
                    &[key_dim * 2 + value_dim * 2, hidden],
                );
                put(a("in_proj_ba.weight"), &[value_heads * 2, hidden]);
                put(a("conv1d.weight"), &[conv_dim, 1, 4]);
                put(a("dt_bias"), &[value_heads]);
                put(a("A_log"), &[value_heads]);
                put(a("norm.weight"), &[head_v_dim]);
                put(a("out_proj.weight"), &[hidden, value_dim]);
            }
            put(p("mlp.gate.weight"), &[experts, hidden]);
            if fused {
                put(p("mlp.experts.gate_up_proj"), &[experts, 2 * moe_i, hidden]);
                put(p("mlp.experts.down_proj"), &[experts, hidden, moe_i]);
            } else {
                for e in 0..experts {
                    put(
                        p(&format!("mlp.experts.{e}.gate_proj.weight")),
                        &[moe_i, hidden],
                    );
                    put(
                        p(&format!("mlp.experts.{e}.up_proj.weight")),
                        &[moe_i, hidden],
                    );
                    put(
                        p(&format!("mlp.experts.{e}.down_proj.weight")),
                        &[hidden, moe_i],
                    );
                }
            }
            put(p("mlp.shared_expert.gate_proj.weight"), &[shared_i, hidden]);
            put(p("mlp.shared_expert.up_proj.weight"), &[shared_i, hidden]);
            put(p("mlp.shared_expert.down_proj.weight"), &[hidden, shared_i]);
            put(p("mlp.shared_expert_gate.weight"), &[1, hidden]);
        }
        put("model.norm.weight".into(), &[hidden]);
        put("lm_head.weight".into(), &[vocab, hidden]);
        t
    }

    /// The tensors `NemotronHForCausalLM` holds at Nemotron-3-Nano's config, written out from
    /// transformers' module definitions (modeling_nemotron_h.py): `NemotronHMamba2Mixer`
    /// (intermediate = 64 * 64, conv_dim = intermediate + 2 * 8 * 128, in_proj `intermediate +
    /// conv_dim + heads`), `NemotronHAttention`, `NemotronHMoE` (`NemotronHExperts` stacks,
    /// the router's correction bias, `shared_experts`). `prefix` is `model.` (transformers) or
    /// `backbone.` (the hub); `fused` as for Qwen3-Next.
    fn nemotron_nano_as_written(prefix: &str, fused: bool) -> Table {
        let pattern = "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME";
        let (hidden, vocab, experts, moe_i, shared_i) = (2688, 131072, 128, 1856, 3712);
        let (heads, head_dim, groups, state) = (64, 64, 8, 128);
        let inner = heads * head_dim;
        let conv_dim = inner + 2 * groups * state;
        let (q, kv) = (32 * 128, 2 * 128);
        let mut t = Table::new();
        let mut put = |name: String, shape: &[usize]| {
            assert!(t.insert(name, shape.to_vec()).is_none());
        };
        put(format!("{prefix}embeddings.weight"), &[vocab, hidden]);
        for (l, kind) in pattern.chars().enumerate() {
            let p = |rest: &str| format!("{prefix}layers.{l}.{rest}");
            let m = |rest: &str| p(&format!("mixer.{rest}"));
            put(p("norm.weight"), &[hidden]);
            match kind {
                'M' => {
                    put(m("in_proj.weight"), &[inner + conv_dim + heads, hidden]);
                    put(m("conv1d.weight"), &[conv_dim, 1, 4]);
                    put(m("conv1d.bias"), &[conv_dim]);
                    put(m("dt_bias"), &[heads]);
                    put(m("A_log"), &[heads]);
                    put(m("D"), &[heads]);
                    put(m("norm.weight"), &[inner]);
                    put(m("out_proj.weight"), &[hidden, inner]);
                }
                '*' => {
                    put(m("q_proj.weight"), &[q, hidden]);
                    put(m("k_proj.weight"), &[kv, hidden]);
                    put(m("v_proj.weight"), &[kv, hidden]);
                    put(m("o_proj.weight"), &[hidden, q]);
                }
                'E' => {
                    put(m("gate.weight"), &[experts, hidden]);
                    put(m("gate.e_score_correction_bias"), &[experts]);
                    if fused {
                        put(m("experts.up_proj"), &[experts, moe_i, hidden]);
                        put(m("experts.down_proj"), &[experts, hidden, moe_i]);
                    } else {
                        for e in 0..experts {
                            put(m(&format!("experts.{e}.up_proj.weight")), &[moe_i, hidden]);
                            put(
                                m(&format!("experts.{e}.down_proj.weight")),
                                &[hidden, moe_i],
                            );
                        }
                    }
                    put(m("shared_experts.up_proj.weight"), &[shared_i, hidden]);
                    put(m("shared_experts.down_proj.weight"), &[hidden, shared_i]);
                }
                _ => unreachable!("the pattern has M, * and E"),
            }
        }
        put(format!("{prefix}norm_f.weight"), &[hidden]);
        put("lm_head.weight".into(), &[vocab, hidden]);
        t
    }

    /// The text model of `Qwen3_5MoeForConditionalGeneration` at Qwen3.5-35B-A3B's config,
    /// written out from transformers' module definitions (modeling_qwen3_5_moe.py): the Gated
    /// DeltaNet's `in_proj_qkv` (2 key_dim + value_dim), `in_proj_z` (value_dim), `in_proj_b` and
    /// `in_proj_a` (value heads), the rest as Qwen3-Next with every layer sparse. `prefix`: the
    /// text model's (`model.`) or the multimodal checkpoint's (`model.language_model.`).
    fn qwen35_as_written(prefix: &str, fused: bool) -> Table {
        let (hidden, vocab, layers, experts, moe_i, shared_i) = (2048, 248320, 40, 256, 512, 512);
        let (key_dim, value_dim, value_heads) = (16 * 128, 32 * 128, 32);
        let (q, kv, head_dim) = (16 * 256, 2 * 256, 256);
        let mut t = Table::new();
        let mut put = |name: String, shape: &[usize]| {
            assert!(t.insert(name, shape.to_vec()).is_none());
        };
        put(format!("{prefix}embed_tokens.weight"), &[vocab, hidden]);
        for l in 0..layers {
            let p = |rest: &str| format!("{prefix}layers.{l}.{rest}");
            put(p("input_layernorm.weight"), &[hidden]);
            put(p("post_attention_layernorm.weight"), &[hidden]);
            if (l + 1) % 4 == 0 {
                put(p("self_attn.q_proj.weight"), &[q * 2, hidden]);
                put(p("self_attn.k_proj.weight"), &[kv, hidden]);
                put(p("self_attn.v_proj.weight"), &[kv, hidden]);
                put(p("self_attn.o_proj.weight"), &[hidden, q]);
                put(p("self_attn.q_norm.weight"), &[head_dim]);
                put(p("self_attn.k_norm.weight"), &[head_dim]);
            } else {
                let a = |rest: &str| p(&format!("linear_attn.{rest}"));
                put(a("in_proj_qkv.weight"), &[key_dim * 2 + value_dim, hidden]);
                put(a("in_proj_z.weight"), &[value_dim, hidden]);
                put(a("in_proj_b.weight"), &[value_heads, hidden]);
                put(a("in_proj_a.weight"), &[value_heads, hidden]);
                put(a("conv1d.weight"), &[key_dim * 2 + value_dim, 1, 4]);
                put(a("dt_bias"), &[value_heads]);
                put(a("A_log"), &[value_heads]);
                put(a("norm.weight"), &[128]);
                put(a("out_proj.weight"), &[hidden, value_dim]);
            }
            put(p("mlp.gate.weight"), &[experts, hidden]);
            if fused {
                put(p("mlp.experts.gate_up_proj"), &[experts, 2 * moe_i, hidden]);
                put(p("mlp.experts.down_proj"), &[experts, hidden, moe_i]);
            } else {
                for e in 0..experts {
                    put(
                        p(&format!("mlp.experts.{e}.gate_proj.weight")),
                        &[moe_i, hidden],
                    );
                    put(
                        p(&format!("mlp.experts.{e}.up_proj.weight")),
                        &[moe_i, hidden],
                    );
                    put(
                        p(&format!("mlp.experts.{e}.down_proj.weight")),
                        &[hidden, moe_i],
                    );
                }
            }
            put(p("mlp.shared_expert.gate_proj.weight"), &[shared_i, hidden]);
            put(p("mlp.shared_expert.up_proj.weight"), &[shared_i, hidden]);
            put(p("mlp.shared_expert.down_proj.weight"), &[hidden, shared_i]);
            put(p("mlp.shared_expert_gate.weight"), &[1, hidden]);
        }
        put(format!("{prefix}norm.weight"), &[hidden]);
        put("lm_head.weight".into(), &[vocab, hidden]);
        t
    }

    /// A checkpoint that has the table's tensors (their shapes only).
    struct Checkpoint(Table);

    impl WeightSource for Checkpoint {
        fn shape(&self, name: &str) -> Option<Vec<usize>> {
            self.0.get(name).cloned()
        }
        fn load(&self, name: &str) -> Result<HostTensor, WeightError> {
            Err(WeightError::Missing {
                source_desc: self.describe(),
                name: name.into(),
            })
        }
        fn describe(&self) -> String {
            "a table of shapes".into()
        }
    }

    fn engine_table(c: &ModelConfig) -> Table {
        expected_tensors(c)
            .into_iter()
            .map(|r| (r.hf_name(), r.shape(c)))
            .collect()
    }

    /// The entries of `a` and `b` that differ, for the failure message.
    fn differences(a: &Table, b: &Table) -> Vec<String> {
        let mut out: Vec<String> = a
            .iter()
            .filter(|(k, v)| b.get(*k) != Some(v))
            .map(|(k, v)| format!("engine {k} {v:?} vs {:?}", b.get(k)))
            .collect();
        out.extend(
            b.keys()
                .filter(|k| !a.contains_key(*k))
                .map(|k| format!("engine lacks {k}")),
        );
        out.truncate(8);
        out
    }

    fn elements(t: &Table) -> u64 {
        t.values().map(|s| s.iter().product::<usize>() as u64).sum()
    }

    #[test]
    fn qwen3_next_80b_expects_the_tensors_transformers_writes() {
        let c = metrale_config::from_config_json(QWEN3_NEXT_80B).unwrap();
        let per_expert = qwen3_next_as_transformers_writes_it(false);
        let engine = engine_table(&c);
        assert!(
            engine == per_expert,
            "{:?}",
            differences(&engine, &per_expert)
        );
        // The config crate counts the same parameters on its own.
        assert_eq!(elements(&per_expert), c.parameter_count());
        // transformers 5's expert stacks pass the shape check as they are.
        let fused = Checkpoint(qwen3_next_as_transformers_writes_it(true));
        check_shapes(&c, &fused).unwrap();
        assert_eq!(
            TensorRole::GatedDeltaNet(0, GdnTensor::Conv).hf_name(),
            "model.layers.0.linear_attn.conv1d.weight"
        );
        assert_eq!(TensorRole::Q(3).shape(&c), [8192, 2048]);
    }

    #[test]
    fn nemotron_3_nano_expects_the_tensors_transformers_writes() {
        let c = metrale_config::from_config_json(NEMOTRON_3_NANO).unwrap();
        let per_expert = nemotron_nano_as_written("model.", false);
        let engine = engine_table(&c);
        assert!(
            engine == per_expert,
            "{:?}",
            differences(&engine, &per_expert)
        );
        assert_eq!(elements(&per_expert), c.parameter_count());
        // transformers' stacks, and the hub's `backbone.` names with one tensor per expert.
        check_shapes(&c, &Checkpoint(nemotron_nano_as_written("model.", true))).unwrap();
        check_shapes(
            &c,
            &Checkpoint(nemotron_nano_as_written("backbone.", false)),
        )
        .unwrap();
        let mut old_embedding = nemotron_nano_as_written("backbone.", true);
        let e = old_embedding.remove("backbone.embeddings.weight").unwrap();
        old_embedding.insert("backbone.embedding.weight".into(), e);
        check_shapes(&c, &Checkpoint(old_embedding)).unwrap();
    }

    #[test]
    fn qwen35_35b_a3b_expects_the_text_model_transformers_writes() {
        let c = metrale_config::from_config_json(QWEN35_35B_A3B).unwrap();
        let per_expert = qwen35_as_written("model.", false);
        let engine = engine_table(&c);
        assert!(
            engine == per_expert,
            "{:?}",
            differences(&engine, &per_expert)
        );
        assert_eq!(elements(&per_expert), c.parameter_count());
        // The hub's multimodal checkpoint nests the text model, in either expert layout.
        for fused in [true, false] {
            let hub = qwen35_as_written("model.language_model.", fused);
            check_shapes(&c, &Checkpoint(hub)).unwrap();
        }
    }

    #[test]
    fn a_wrong_width_is_refused_by_name() {
        // A Qwen3-Next attention q projection without its gate rows, and a Mamba-2 conv without
        // the B and C channels, are what a loader that missed them would expect.
        let c = metrale_config::from_config_json(QWEN3_NEXT_80B).unwrap();
        let mut t = qwen3_next_as_transformers_writes_it(true);
        t.insert(
            "model.layers.3.self_attn.q_proj.weight".into(),
            vec![4096, 2048],
        );
        let err = check_shapes(&c, &Checkpoint(t)).unwrap_err();
        assert!(
            matches!(&err, ModelError::ShapeMismatch { name, .. }
                if name == "model.layers.3.self_attn.q_proj.weight"),
            "{err}"
        );
        let c = metrale_config::from_config_json(NEMOTRON_3_NANO).unwrap();
        let mut t = nemotron_nano_as_written("model.", true);
        t.insert(
            "model.layers.0.mixer.conv1d.weight".into(),
            vec![4096, 1, 4],
        );
        let err = check_shapes(&c, &Checkpoint(t)).unwrap_err();
        assert!(
            err.to_string().contains("layers.0.mixer.conv1d.weight"),
            "{err}"
        );
    }

    /// `Model::load`'s error on `checkpoint`.
    fn load_error(config: &str, checkpoint: Table) -> String {
        let gpu: Arc<dyn GpuBackend> = Arc::new(HostBackend::new(1 << 20));
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
        Model::load(
            metrale_config::from_config_json(config).unwrap(),
            &Checkpoint(checkpoint),
            gpu,
            options,
            Tuning::hopper().unwrap(),
            &mut |_, _, _| {},
        )
        .err()
        .expect("a hybrid model is refused")
        .to_string()
    }

    #[test]
    fn model_load_takes_nemotron_3_nanos_experts_in_both_layouts() {
        // The plan runs and the shape check passes for the stacks transformers holds and the
        // hub's per-expert tensors (under backbone.): the first error is the table's, at the
        // first weight read (it holds shapes only). An empty checkpoint fails the shape check.
        let want = "no tensor `model.embeddings.weight`";
        for table in [
            nemotron_nano_as_written("model.", true),
            nemotron_nano_as_written("model.", false),
        ] {
            let err = load_error(NEMOTRON_3_NANO, table);
            assert!(err.contains(want), "{err}");
        }
        let err = load_error(
            NEMOTRON_3_NANO,
            nemotron_nano_as_written("backbone.", false),
        );
        assert!(err.contains("backbone.embeddings.weight"), "{err}");
        let err = load_error(NEMOTRON_3_NANO, Table::new());
        assert!(!err.contains(want), "{err}");
    }
}
