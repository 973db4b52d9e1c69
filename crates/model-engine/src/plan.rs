// SPDX-License-Identifier: MIT OR Apache-2.0
//! The layer plan: what each decoder layer is, typed, built once from the config.
//!
//! A model is a stack of layers; a layer is a sequence of blocks, each of which folds the
//! previous block's output into the residual stream, normalises it, and leaves its own output to
//! be folded by the next ([`crate::residual`]). The plan says which kind each block is and with
//! which parameters; [`crate::model::Model`] builds one block module per entry
//! ([`crate::blocks`]) and the step walks them in order. A new kind of layer (MoE, Gated
//! DeltaNet, Mamba-2, sliding-window or MLA attention) is a new variant here and a new block
//! module, with nothing else changed.

use metrale_config::{
    Ffn, GatedDeltaNetConfig, HybridLayer, Mamba2Config, Mixer, MlpActivation, ModelConfig, QkNorm,
    RouterKind,
};
use metrale_kernels::ops::{
    GDN_CONV_MAX_KERNEL, GDN_MAX_DK, MAMBA2_MAX_STATE, MAMBA2_STATE_MULTIPLE,
};

/// How a block's input is normalised.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum NormKind {
    /// RMSNorm with a learned scale.
    Rms {
        /// Added to the mean square.
        eps: f32,
    },
    /// RMSNorm scaling by `1 + weight`, its weight stored centred on zero (Qwen3-Next, Qwen3.5).
    RmsUnitOffset {
        /// Added to the mean square.
        eps: f32,
    },
}

impl NormKind {
    /// The epsilon.
    pub fn rms_eps(self) -> Result<f32, crate::ModelError> {
        match self {
            NormKind::Rms { eps } | NormKind::RmsUnitOffset { eps } => Ok(eps),
        }
    }

    /// What the norm kernel adds to each weight, in f32, before it scales: 1 for a unit-offset
    /// norm (its weight is uploaded as the checkpoint stores it, centred on zero), else 0.
    pub fn weight_offset(self) -> f32 {
        match self {
            NormKind::Rms { .. } => 0.0,
            NormKind::RmsUnitOffset { .. } => 1.0,
        }
    }
}

/// How a block's output joins the residual stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ResidualFold {
    /// Pre-norm: `h += block(norm(h))`; the add is folded into the next block's norm.
    PreNorm,
}

/// Grouped-query self-attention over the paged KV cache, with RoPE.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttentionSpec {
    /// Query heads.
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Per-head width.
    pub head_dim: usize,
    /// The q, k and v products carry biases (Qwen2).
    pub qkv_bias: bool,
    /// The RMSNorm of q and k before RoPE: none, per head (Qwen3) or over the whole projection
    /// (MiniMax-M2).
    pub qk_norm: QkNorm,
    /// The leading elements of each head that RoPE rotates (`head_dim`, or fewer for partial
    /// rotary: MiniMax-M2's 64 of 128, Qwen3-Next's 64 of 256); 0 for no position encoding
    /// (Nemotron-H's attention layers).
    pub rotary_dim: usize,
    /// The q/k norms scale by `1 + weight` (Qwen3-Next): the per-head norm kernel adds the 1 in
    /// f32 to the weight as the checkpoint stores it.
    pub qk_norm_unit_offset: bool,
    /// The q projection is `2 * heads * head_dim` wide, each head's q followed by its gate; the
    /// attention output is multiplied by `sigmoid(gate)` per element before `o_proj`
    /// (Qwen3-Next, Qwen3.5).
    pub output_gate: bool,
    /// The scores' scale: `1 / sqrt(head_dim)`, or the config's (Granite's
    /// `attention_multiplier`).
    pub scale: f32,
}

impl AttentionSpec {
    /// Whether RoPE rotates only part of each head.
    pub fn partial_rotary(&self) -> bool {
        self.rotary_dim != self.head_dim
    }

    /// Whether q and k are rotated at all.
    pub fn rope(&self) -> bool {
        self.rotary_dim != 0
    }
}

/// A Gated DeltaNet token mixer (Qwen3-Next, Qwen3.5): projections to q, k, v, the output gate
/// z, and per value head the write strength b and the decay a; a causal depthwise conv (with
/// its state) and silu over q, k and v; per value head the gated delta rule over a
/// `key_head_dim x value_head_dim` f32 state, q and k L2-normalised and q scaled by
/// `key_head_dim^-1/2`; an RMSNorm of each head's output times `silu(z)`; the out projection.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GatedDeltaNetSpec {
    /// The shape and the projection layout.
    pub shape: GatedDeltaNetConfig,
    /// Epsilon of the gated RMSNorm (plain weight, normalised before the gate).
    pub norm_eps: f32,
    /// Which of a state slot's recurrent layers this is (`0..LayerPlan::recurrent_layers()`).
    pub state_index: usize,
}

/// A Mamba-2 token mixer (Nemotron-H): one projection to z, x, B, C and dt; a causal depthwise
/// conv (with its state) and silu over x, B and C; per head the SSD recurrence over a
/// `head_dim x state_size` f32 state with decay `exp(dt * A)` and the skip `D`; an RMSNorm over
/// `groups` groups of `y * silu(z)`; the out projection.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Mamba2Spec {
    /// The shape.
    pub shape: Mamba2Config,
    /// Epsilon of the grouped gated RMSNorm (gated before it is normalised).
    pub norm_eps: f32,
    /// Which of a state slot's recurrent layers this is (`0..LayerPlan::recurrent_layers()`).
    pub state_index: usize,
}

/// A sparse MLP: a router picks `top_k` of `experts` SwiGLU MLPs per token, whose outputs are
/// summed with the routing weights (plus a shared expert behind a sigmoid gate, if any).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MoeSpec {
    /// Routed experts.
    pub experts: usize,
    /// Experts each token takes.
    pub top_k: usize,
    /// Each expert's gate and up width.
    pub intermediate: usize,
    /// Scores from the router's logits.
    pub router: RouterKind,
    /// The top k weights renormalised to sum to 1.
    pub norm_topk_prob: bool,
    /// Routed weights multiplied by this.
    pub routed_scaling: f32,
    /// The shared expert's width, if any.
    pub shared_intermediate: Option<usize>,
    /// The shared expert's output is scaled by its sigmoid gate (Qwen2-MoE, Qwen3-Next); else
    /// added as it is (Nemotron-H, GLM-4.5).
    pub shared_gated: bool,
    /// The experts' (and shared expert's) form: SwiGLU, or squared ReLU with no gate product
    /// and the shared expert added ungated (Nemotron-H).
    pub activation: MlpActivation,
}

/// The feed-forward block.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum MlpKind {
    /// `down(silu(x Wgate) * x Wup)`.
    DenseSwiglu {
        /// The gate and up products' width.
        intermediate: usize,
    },
    /// `down(relu(x Wup)^2)` (Nemotron-H).
    DenseRelu2 {
        /// The up product's width.
        intermediate: usize,
    },
    /// Mixture of experts.
    Moe(MoeSpec),
}

/// One block of a layer.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum BlockKind {
    /// Token mixing by attention.
    Attention(AttentionSpec),
    /// Channel mixing.
    Mlp(MlpKind),
    /// Token mixing by the gated delta rule, with recurrent state.
    GatedDeltaNet(GatedDeltaNetSpec),
    /// Token mixing by the Mamba-2 SSD recurrence, with recurrent state.
    Mamba2(Mamba2Spec),
}

impl BlockKind {
    /// Whether the block keeps per-sequence recurrent state between steps.
    pub fn recurrent(&self) -> bool {
        matches!(self, BlockKind::GatedDeltaNet(_) | BlockKind::Mamba2(_))
    }
}

/// One block and the norm in front of it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BlockSpec {
    /// The norm of its input.
    pub norm: NormKind,
    /// How its output joins the residual.
    pub fold: ResidualFold,
    /// What it computes.
    pub kind: BlockKind,
}

/// A decoder layer: its blocks in order.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerSpec {
    /// The blocks, in the order the step runs them.
    pub blocks: Vec<BlockSpec>,
}

/// The whole stack, and the norm before the LM head.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerPlan {
    /// One entry per decoder layer.
    pub layers: Vec<LayerSpec>,
    /// The final norm.
    pub final_norm: NormKind,
}

impl LayerPlan {
    /// The plan of a config. The non-hybrid families are pre-norm attention then an MLP in every
    /// layer, dense (Llama, Qwen2, Qwen3) or, in a MoE model's sparse layers, a mixture of
    /// experts; they differ in the attention's parameters. A hybrid family's layers follow its
    /// pattern ([`metrale_config::HybridConfig::layers`]): Qwen3-Next's two blocks a layer with
    /// Gated DeltaNet or gated attention as the mixer, Nemotron-H's one block a layer.
    ///
    /// The plan describes every kind the config crate accepts; [`LayerPlan::check_runnable`]
    /// says which of them the engine cannot run yet.
    pub fn from_config(c: &ModelConfig) -> Result<LayerPlan, crate::ModelError> {
        if !matches!(c.head_dim, 64 | 128 | 256) {
            return Err(crate::ModelError::Unsupported(format!(
                "head_dim {}: the attention kernels take 64, 128 or 256",
                c.head_dim
            )));
        }
        // The decode attention serves up to 8 query heads a block; a wider group takes several
        // blocks of its largest divisor up to 8. Every kv head must have a whole group.
        if c.num_kv_heads == 0 || !c.num_heads.is_multiple_of(c.num_kv_heads) {
            return Err(crate::ModelError::Unsupported(format!(
                "{} query heads over {} kv heads: each kv head must serve a whole group of query \
                 heads",
                c.num_heads, c.num_kv_heads
            )));
        }
        let hybrid = c.hybrid.as_ref();
        let norm = match hybrid {
            Some(h) if h.norm_unit_offset => NormKind::RmsUnitOffset {
                eps: c.rms_norm_eps,
            },
            _ => NormKind::Rms {
                eps: c.rms_norm_eps,
            },
        };
        let block = |kind| BlockSpec {
            norm,
            fold: ResidualFold::PreNorm,
            kind,
        };
        let attention = AttentionSpec {
            scale: c
                .multipliers
                .attention
                .unwrap_or(1.0 / (c.head_dim as f32).sqrt()),
            heads: c.num_heads,
            kv_heads: c.num_kv_heads,
            head_dim: c.head_dim,
            qkv_bias: c.attention_bias,
            qk_norm: c.qk_norm,
            rotary_dim: match hybrid {
                Some(h) if !h.attention_rope => 0,
                _ => c.rotary_dim,
            },
            qk_norm_unit_offset: hybrid.is_some_and(|h| h.norm_unit_offset) && c.qk_norm.any(),
            output_gate: hybrid.is_some_and(|h| h.attention_output_gate),
        };
        let activation = hybrid.map_or(MlpActivation::SwiGlu, |h| h.mlp_activation);
        let dense = match activation {
            MlpActivation::SwiGlu => MlpKind::DenseSwiglu {
                intermediate: c.intermediate_size,
            },
            MlpActivation::Relu2 => MlpKind::DenseRelu2 {
                intermediate: c.intermediate_size,
            },
        };
        let sparse = c.moe.as_ref().map(|m| {
            MlpKind::Moe(MoeSpec {
                experts: m.num_experts,
                top_k: m.top_k,
                intermediate: m.expert_intermediate,
                router: m.router,
                norm_topk_prob: m.norm_topk_prob,
                routed_scaling: m.routed_scaling,
                shared_intermediate: m.shared_expert_intermediate,
                shared_gated: m.shared_expert_gated,
                activation,
            })
        });
        let Some(h) = hybrid else {
            let layers = (0..c.num_layers)
                .map(|l| {
                    let mlp = match (&c.moe, sparse) {
                        (Some(m), Some(s)) if m.is_sparse(l) => s,
                        _ => dense,
                    };
                    // SmolLM3's layers without position encoding.
                    let attention = match c.nope_layers.contains(&l) {
                        true => AttentionSpec {
                            rotary_dim: 0,
                            ..attention
                        },
                        false => attention,
                    };
                    LayerSpec {
                        blocks: vec![
                            block(BlockKind::Attention(attention)),
                            block(BlockKind::Mlp(mlp)),
                        ],
                    }
                })
                .collect();
            return Ok(LayerPlan {
                layers,
                final_norm: norm,
            });
        };
        let mut state_index = 0;
        let mut layers = Vec::with_capacity(h.layers.len());
        for (l, &HybridLayer { mixer, ffn }) in h.layers.iter().enumerate() {
            let mut blocks = Vec::with_capacity(2);
            let missing = |what: &str| {
                crate::ModelError::Unsupported(format!(
                    "layer {l} has a {what} but the config gives no shape for it"
                ))
            };
            match mixer {
                Some(Mixer::Attention) => blocks.push(block(BlockKind::Attention(attention))),
                Some(Mixer::GatedDeltaNet) => {
                    let shape = h.gated_delta_net.ok_or_else(|| missing("Gated DeltaNet"))?;
                    blocks.push(block(BlockKind::GatedDeltaNet(GatedDeltaNetSpec {
                        shape,
                        norm_eps: c.rms_norm_eps,
                        state_index,
                    })));
                    state_index += 1;
                }
                Some(Mixer::Mamba2) => {
                    let shape = h.mamba2.ok_or_else(|| missing("Mamba-2 mixer"))?;
                    blocks.push(block(BlockKind::Mamba2(Mamba2Spec {
                        shape,
                        norm_eps: c.rms_norm_eps,
                        state_index,
                    })));
                    state_index += 1;
                }
                None => {}
            }
            match ffn {
                Some(Ffn::Dense) => blocks.push(block(BlockKind::Mlp(dense))),
                Some(Ffn::Sparse) => {
                    let moe = sparse.ok_or_else(|| missing("mixture of experts"))?;
                    blocks.push(block(BlockKind::Mlp(moe)));
                }
                None => {}
            }
            layers.push(LayerSpec { blocks });
        }
        Ok(LayerPlan {
            layers,
            final_norm: norm,
        })
    }

    /// Refuses a plan with a block the engine has no kernels for, naming the missing piece: a
    /// recurrent mixer wider than its kernels.
    pub fn check_runnable(&self) -> Result<(), crate::ModelError> {
        let refuse = |why: &str| Err(crate::ModelError::Unsupported(why.to_string()));
        self.final_norm.rms_eps()?;
        for (l, b) in self.blocks() {
            b.norm.rms_eps()?;
            match b.kind {
                BlockKind::GatedDeltaNet(g) => {
                    let s = g.shape;
                    if s.key_head_dim > GDN_MAX_DK as usize
                        || s.conv_kernel < 2
                        || s.conv_kernel > GDN_CONV_MAX_KERNEL as usize
                        || s.key_heads == 0
                        || s.value_heads % s.key_heads != 0
                    {
                        return refuse(&format!(
                            "layer {l} is Gated DeltaNet with key heads of {} (the kernels take \
                             up to {GDN_MAX_DK}), a conv of {} taps (2 to \
                             {GDN_CONV_MAX_KERNEL}) and {} value heads over {} key heads (a \
                             whole multiple)",
                            s.key_head_dim, s.conv_kernel, s.value_heads, s.key_heads
                        ));
                    }
                }
                BlockKind::Mamba2(m) => {
                    let s = m.shape;
                    if s.state_size == 0
                        || s.state_size > MAMBA2_MAX_STATE as usize
                        || s.state_size % MAMBA2_STATE_MULTIPLE as usize != 0
                        || s.groups == 0
                        || s.heads % s.groups != 0
                        || s.conv_kernel < 2
                        || s.conv_kernel > GDN_CONV_MAX_KERNEL as usize
                    {
                        return refuse(&format!(
                            "layer {l} is Mamba-2 with a state of {} (the kernel takes a multiple \
                             of {MAMBA2_STATE_MULTIPLE} up to {MAMBA2_MAX_STATE}), {} heads in {} \
                             groups (a whole multiple) and a conv of {} taps (2 to \
                             {GDN_CONV_MAX_KERNEL})",
                            s.state_size, s.heads, s.groups, s.conv_kernel
                        ));
                    }
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// Layers with recurrent state: how many per-layer states a sequence's state slot holds.
    pub fn recurrent_layers(&self) -> usize {
        self.blocks().filter(|(_, b)| b.kind.recurrent()).count()
    }

    /// Every block of every layer, in step order, with its layer index.
    pub fn blocks(&self) -> impl Iterator<Item = (usize, &BlockSpec)> {
        self.layers
            .iter()
            .enumerate()
            .flat_map(|(l, layer)| layer.blocks.iter().map(move |b| (l, b)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qwen3_is_attention_then_mlp_in_every_layer_with_its_flags() {
        let c = metrale_config::from_config_json(
            r#"{"model_type": "qwen3", "hidden_size": 256, "intermediate_size": 512,
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
                "num_hidden_layers": 3, "vocab_size": 512, "rms_norm_eps": 1e-6,
                "rope_theta": 1000000.0, "max_position_embeddings": 256}"#,
        )
        .unwrap();
        let plan = LayerPlan::from_config(&c).unwrap();
        assert_eq!(plan.layers.len(), 3);
        assert_eq!(plan.blocks().count(), 6);
        let kinds: Vec<_> = plan.layers[2].blocks.iter().map(|b| b.kind).collect();
        assert_eq!(
            kinds,
            [
                BlockKind::Attention(AttentionSpec {
                    heads: 4,
                    kv_heads: 2,
                    head_dim: 64,
                    qkv_bias: false,
                    qk_norm: QkNorm::PerHead,
                    rotary_dim: 64,
                    qk_norm_unit_offset: false,
                    output_gate: false,
                    scale: 1.0 / 64f32.sqrt(),
                }),
                BlockKind::Mlp(MlpKind::DenseSwiglu { intermediate: 512 }),
            ]
        );
        assert_eq!(plan.final_norm, NormKind::Rms { eps: 1e-6 });
    }

    #[test]
    fn qwen2_moe_has_sparse_layers_with_a_shared_expert_every_second_layer() {
        let c = metrale_config::from_config_json(
            r#"{"model_type": "qwen2_moe", "hidden_size": 256, "intermediate_size": 512,
                "moe_intermediate_size": 64, "shared_expert_intermediate_size": 128,
                "num_experts": 8, "num_experts_per_tok": 2, "decoder_sparse_step": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 4,
                "vocab_size": 512, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
                "max_position_embeddings": 256}"#,
        )
        .unwrap();
        let plan = LayerPlan::from_config(&c).unwrap();
        let mlps: Vec<_> = plan.layers.iter().map(|l| l.blocks[1].kind).collect();
        let moe = BlockKind::Mlp(MlpKind::Moe(MoeSpec {
            experts: 8,
            top_k: 2,
            intermediate: 64,
            router: RouterKind::Softmax,
            norm_topk_prob: false,
            routed_scaling: 1.0,
            shared_intermediate: Some(128),
            shared_gated: true,
            activation: MlpActivation::SwiGlu,
        }));
        let dense = BlockKind::Mlp(MlpKind::DenseSwiglu { intermediate: 512 });
        assert_eq!(mlps, [dense, moe, dense, moe]);
    }

    #[test]
    fn minimax_m2_is_whole_projection_qk_norm_partial_rope_and_biased_sigmoid_experts() {
        let c = metrale_config::from_config_json(
            r#"{"model_type": "minimax_m2", "hidden_size": 3072, "intermediate_size": 1536,
                "num_local_experts": 256, "num_experts_per_tok": 8, "num_attention_heads": 48,
                "num_key_value_heads": 8, "head_dim": 128, "rotary_dim": 64,
                "num_hidden_layers": 4, "vocab_size": 200064, "rms_norm_eps": 1e-6,
                "rope_theta": 5000000.0, "max_position_embeddings": 196608}"#,
        )
        .unwrap();
        let plan = LayerPlan::from_config(&c).unwrap();
        let attention = AttentionSpec {
            heads: 48,
            kv_heads: 8,
            head_dim: 128,
            qkv_bias: false,
            qk_norm: QkNorm::Whole,
            rotary_dim: 64,
            qk_norm_unit_offset: false,
            output_gate: false,
            scale: 1.0 / 128f32.sqrt(),
        };
        assert!(attention.partial_rotary());
        let moe = MoeSpec {
            experts: 256,
            top_k: 8,
            intermediate: 1536,
            router: RouterKind::SigmoidBias,
            norm_topk_prob: true,
            routed_scaling: 1.0,
            shared_intermediate: None,
            shared_gated: false,
            activation: MlpActivation::SwiGlu,
        };
        for layer in &plan.layers {
            let kinds: Vec<_> = layer.blocks.iter().map(|b| b.kind).collect();
            assert_eq!(
                kinds,
                [
                    BlockKind::Attention(attention),
                    BlockKind::Mlp(MlpKind::Moe(moe))
                ]
            );
        }
    }
}

#[cfg(test)]
mod hybrid_tests {
    use super::*;
    use metrale_config::GdnProjection;

    /// Qwen3-Next-80B-A3B's config.json, the keys the plan reads.
    const QWEN3_NEXT_80B: &str = r#"{"model_type":"qwen3_next","hidden_size":2048,
      "intermediate_size":5120,"num_hidden_layers":48,"num_attention_heads":16,
      "num_key_value_heads":2,"head_dim":256,"partial_rotary_factor":0.25,"rms_norm_eps":1e-06,
      "rope_theta":5000000,"max_position_embeddings":262144,"vocab_size":151936,
      "full_attention_interval":4,"linear_conv_kernel_dim":4,"linear_key_head_dim":128,
      "linear_num_key_heads":16,"linear_num_value_heads":32,"linear_value_head_dim":128,
      "decoder_sparse_step":1,"mlp_only_layers":[],"moe_intermediate_size":512,
      "norm_topk_prob":true,"num_experts":512,"num_experts_per_tok":10,
      "shared_expert_intermediate_size":512,"tie_word_embeddings":false}"#;

    /// NVIDIA-Nemotron-3-Nano-30B-A3B's config.json, the keys the plan reads.
    const NEMOTRON_3_NANO: &str = r#"{"model_type":"nemotron_h","hidden_size":2688,
      "hybrid_override_pattern":"MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
      "intermediate_size":1856,"layer_norm_epsilon":1e-05,"mamba_head_dim":64,
      "mamba_num_heads":64,"n_groups":8,"ssm_state_size":128,"conv_kernel":4,"chunk_size":128,
      "use_conv_bias":true,"max_position_embeddings":262144,"mlp_hidden_act":"relu2",
      "moe_intermediate_size":1856,"moe_shared_expert_intermediate_size":3712,
      "n_routed_experts":128,"n_shared_experts":1,"norm_topk_prob":true,"num_attention_heads":32,
      "num_experts_per_tok":6,"num_hidden_layers":52,"num_key_value_heads":2,"head_dim":128,
      "routed_scaling_factor":2.5,"rope_theta":10000,"vocab_size":131072}"#;

    fn plan(text: &str) -> LayerPlan {
        LayerPlan::from_config(&metrale_config::from_config_json(text).unwrap()).unwrap()
    }

    #[test]
    fn qwen3_next_80b_is_gated_deltanet_three_layers_in_four_then_gated_attention() {
        let plan = plan(QWEN3_NEXT_80B);
        assert_eq!(plan.layers.len(), 48);
        assert_eq!(plan.recurrent_layers(), 36);
        let norm = NormKind::RmsUnitOffset { eps: 1e-6 };
        assert_eq!(plan.final_norm, norm);
        let attention = AttentionSpec {
            heads: 16,
            kv_heads: 2,
            head_dim: 256,
            qkv_bias: false,
            qk_norm: QkNorm::PerHead,
            rotary_dim: 64,
            qk_norm_unit_offset: true,
            output_gate: true,
            scale: 1.0 / 256f32.sqrt(),
        };
        let moe = MlpKind::Moe(MoeSpec {
            experts: 512,
            top_k: 10,
            intermediate: 512,
            router: RouterKind::Softmax,
            norm_topk_prob: true,
            routed_scaling: 1.0,
            shared_intermediate: Some(512),
            shared_gated: true,
            activation: MlpActivation::SwiGlu,
        });
        let mut state_index = 0;
        for (l, layer) in plan.layers.iter().enumerate() {
            assert!(layer.blocks.iter().all(|b| b.norm == norm));
            let kinds: Vec<_> = layer.blocks.iter().map(|b| b.kind).collect();
            let mixer = if l % 4 == 3 {
                BlockKind::Attention(attention)
            } else {
                let spec = GatedDeltaNetSpec {
                    shape: GatedDeltaNetConfig {
                        key_heads: 16,
                        value_heads: 32,
                        key_head_dim: 128,
                        value_head_dim: 128,
                        conv_kernel: 4,
                        projection: GdnProjection::GroupedQkvzBa,
                    },
                    norm_eps: 1e-6,
                    state_index,
                };
                state_index += 1;
                BlockKind::GatedDeltaNet(spec)
            };
            assert_eq!(kinds, [mixer, BlockKind::Mlp(moe)], "layer {l}");
        }
        assert_eq!(state_index, 36);
    }

    #[test]
    fn nemotron_3_nano_is_one_block_a_layer_in_its_patterns_order() {
        let plan = plan(NEMOTRON_3_NANO);
        assert_eq!(plan.layers.len(), 52);
        assert!(plan.layers.iter().all(|l| l.blocks.len() == 1));
        let letters: String = plan
            .layers
            .iter()
            .map(|l| match l.blocks[0].kind {
                BlockKind::Mamba2(_) => 'M',
                BlockKind::Attention(_) => '*',
                BlockKind::Mlp(MlpKind::Moe(_)) => 'E',
                BlockKind::Mlp(_) => '-',
                BlockKind::GatedDeltaNet(_) => '?',
            })
            .collect();
        assert_eq!(
            letters,
            "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"
        );
        assert_eq!(plan.final_norm, NormKind::Rms { eps: 1e-5 });
        let BlockKind::Mamba2(m) = plan.layers[2].blocks[0].kind else {
            panic!("layer 2 is Mamba-2");
        };
        assert_eq!(m.state_index, 1, "the second Mamba-2 layer");
        assert_eq!(
            (m.shape.heads, m.shape.head_dim, m.shape.state_size),
            (64, 64, 128)
        );
        let BlockKind::Attention(a) = plan.layers[5].blocks[0].kind else {
            panic!("layer 5 is attention");
        };
        assert!(!a.rope() && !a.output_gate && a.qk_norm == QkNorm::None);
        let BlockKind::Mlp(MlpKind::Moe(e)) = plan.layers[1].blocks[0].kind else {
            panic!("layer 1 is experts");
        };
        assert_eq!(e.activation, MlpActivation::Relu2);
        assert_eq!((e.router, e.routed_scaling), (RouterKind::SigmoidBias, 2.5));
        assert_eq!(plan.recurrent_layers(), 23);
    }

    #[test]
    fn plans_without_kernels_are_refused_naming_the_missing_piece() {
        // Qwen3-Next runs (Gated DeltaNet, gated attention, unit-offset norms); so does
        // Nemotron-3-Nano (Mamba-2, attention without RoPE, squared-ReLU experts).
        plan(QWEN3_NEXT_80B)
            .check_runnable()
            .expect("qwen3_next runs");
        plan(NEMOTRON_3_NANO)
            .check_runnable()
            .expect("nemotron-3-nano runs");
        let mut p = plan(NEMOTRON_3_NANO);
        if let BlockKind::Mamba2(m) = &mut p.layers[0].blocks[0].kind {
            m.shape.state_size = 256;
        }
        let err = p.check_runnable().unwrap_err().to_string();
        assert!(
            err.contains("layer 0 is Mamba-2 with a state of 256"),
            "{err}"
        );
        // A Gated DeltaNet wider than the kernels' registers is refused with its shape.
        let mut p = plan(QWEN3_NEXT_80B);
        if let BlockKind::GatedDeltaNet(g) = &mut p.layers[0].blocks[0].kind {
            g.shape.key_head_dim = 256;
        }
        let err = p.check_runnable().unwrap_err().to_string();
        assert!(
            err.contains("layer 0 is Gated DeltaNet with key heads of 256"),
            "{err}"
        );
        // And a non-hybrid plan passes.
        let qwen3 = metrale_config::from_config_json(
            r#"{"model_type": "qwen3", "hidden_size": 256, "intermediate_size": 512,
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
                "num_hidden_layers": 2, "vocab_size": 512}"#,
        )
        .unwrap();
        let p = LayerPlan::from_config(&qwen3).unwrap();
        assert!(p.check_runnable().is_ok());
        assert_eq!(p.recurrent_layers(), 0);
    }

    #[test]
    fn every_whole_query_group_is_taken() {
        let config = |heads: u32, kv: u32| {
            metrale_config::from_config_json(&format!(
                r#"{{"model_type": "qwen3", "hidden_size": 256, "intermediate_size": 512,
                    "num_attention_heads": {heads}, "num_key_value_heads": {kv}, "head_dim": 64,
                    "num_hidden_layers": 1, "vocab_size": 512, "rms_norm_eps": 1e-6,
                    "rope_theta": 1000000.0, "max_position_embeddings": 256}}"#
            ))
            .expect("a qwen3 config")
        };
        // Any whole group: up to 8 a kv head in one block, wider ones (Nemotron-3-Nano's 16,
        // GLM-4.5's 12) in several.
        for (heads, kv) in [(4, 2), (8, 1), (32, 2), (48, 2), (24, 2), (96, 8)] {
            assert!(
                LayerPlan::from_config(&config(heads, kv)).is_ok(),
                "{heads}/{kv}"
            );
        }
    }
}
