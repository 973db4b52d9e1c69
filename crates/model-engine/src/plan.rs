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

use metrale_config::{ModelConfig, QkNorm, RouterKind};

/// How a block's input is normalised.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum NormKind {
    /// RMSNorm with a learned scale.
    Rms {
        /// Added to the mean square.
        eps: f32,
    },
}

/// How a block's output joins the residual stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ResidualFold {
    /// Pre-norm: `h += block(norm(h))`; the add is folded into the next block's norm.
    PreNorm,
}

/// Grouped-query self-attention over the paged KV cache, with RoPE.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
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
    /// rotary: MiniMax-M2's 64 of 128).
    pub rotary_dim: usize,
}

impl AttentionSpec {
    /// Whether RoPE rotates only part of each head.
    pub fn partial_rotary(&self) -> bool {
        self.rotary_dim != self.head_dim
    }
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
}

/// The feed-forward block.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum MlpKind {
    /// `down(silu(x Wgate) * x Wup)`.
    DenseSwiglu {
        /// The gate and up products' width.
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
    /// The plan of a config: every family the config crate accepts is pre-norm attention then
    /// an MLP in every layer, dense (Llama, Qwen2, Qwen3) or, in a MoE model's sparse layers,
    /// a mixture of experts; they differ in the attention's parameters.
    ///
    /// A layer kind the engine has no block for is refused here, before any weight loads.
    pub fn from_config(c: &ModelConfig) -> Result<LayerPlan, crate::ModelError> {
        if !matches!(c.head_dim, 64 | 128 | 256) {
            return Err(crate::ModelError::Unsupported(format!(
                "head_dim {}: the attention kernels take 64, 128 or 256",
                c.head_dim
            )));
        }
        let norm = NormKind::Rms {
            eps: c.rms_norm_eps,
        };
        let block = |kind| BlockSpec {
            norm,
            fold: ResidualFold::PreNorm,
            kind,
        };
        let attention = AttentionSpec {
            heads: c.num_heads,
            kv_heads: c.num_kv_heads,
            head_dim: c.head_dim,
            qkv_bias: c.attention_bias,
            qk_norm: c.qk_norm,
            rotary_dim: c.rotary_dim,
        };
        let dense = MlpKind::DenseSwiglu {
            intermediate: c.intermediate_size,
        };
        let mlp = |l: usize| match &c.moe {
            Some(m) if m.is_sparse(l) => MlpKind::Moe(MoeSpec {
                experts: m.num_experts,
                top_k: m.top_k,
                intermediate: m.expert_intermediate,
                router: m.router,
                norm_topk_prob: m.norm_topk_prob,
                routed_scaling: m.routed_scaling,
                shared_intermediate: m.shared_expert_intermediate,
            }),
            _ => dense,
        };
        let layers = (0..c.num_layers)
            .map(|l| LayerSpec {
                blocks: vec![
                    block(BlockKind::Attention(attention)),
                    block(BlockKind::Mlp(mlp(l))),
                ],
            })
            .collect();
        Ok(LayerPlan {
            layers,
            final_norm: norm,
        })
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
