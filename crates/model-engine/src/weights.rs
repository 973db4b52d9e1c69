// SPDX-License-Identifier: MIT OR Apache-2.0
//! The weight-name map of the generic decoder and the upload of a checkpoint to a device.
//!
//! Llama, Qwen2 and Qwen3 checkpoints use the same HF names; the families differ in which
//! tensors exist (QKV biases, QK-norm weights, a separate LM head), and that follows from the
//! config. Every shape is checked against the config before the first byte is uploaded.

use metrale_config::ModelConfig;
use metrale_core::DevicePtr;
use metrale_gpu_runtime::GpuBackend;
use metrale_model_weights::{HostTensor, WeightSource};

use crate::ModelError;

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
    /// Per-head query norm `[head_dim]` (Qwen3).
    QNorm(usize),
    /// Per-head key norm `[head_dim]` (Qwen3).
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
        }
    }

    /// The shape the config implies.
    pub fn shape(self, c: &ModelConfig) -> Vec<usize> {
        let (h, i, v, hd) = (c.hidden_size, c.intermediate_size, c.vocab_size, c.head_dim);
        let (q, kv) = (c.num_heads * hd, c.num_kv_heads * hd);
        match self {
            TensorRole::Embedding | TensorRole::LmHead => vec![v, h],
            TensorRole::FinalNorm | TensorRole::InputNorm(_) | TensorRole::PostNorm(_) => vec![h],
            TensorRole::Q(_) => vec![q, h],
            TensorRole::K(_) | TensorRole::V(_) => vec![kv, h],
            TensorRole::QBias(_) => vec![q],
            TensorRole::KBias(_) | TensorRole::VBias(_) => vec![kv],
            TensorRole::QNorm(_) | TensorRole::KNorm(_) => vec![hd],
            TensorRole::O(_) => vec![h, q],
            TensorRole::Gate(_) | TensorRole::Up(_) => vec![i, h],
            TensorRole::Down(_) => vec![h, i],
        }
    }
}

/// Every tensor the config implies, in load order.
pub fn expected_tensors(c: &ModelConfig) -> Vec<TensorRole> {
    let mut roles = vec![TensorRole::Embedding];
    for l in 0..c.num_layers {
        roles.extend([
            TensorRole::InputNorm(l),
            TensorRole::Q(l),
            TensorRole::K(l),
            TensorRole::V(l),
        ]);
        if c.attention_bias {
            roles.extend([
                TensorRole::QBias(l),
                TensorRole::KBias(l),
                TensorRole::VBias(l),
            ]);
        }
        if c.qk_norm {
            roles.extend([TensorRole::QNorm(l), TensorRole::KNorm(l)]);
        }
        roles.extend([
            TensorRole::O(l),
            TensorRole::PostNorm(l),
            TensorRole::Gate(l),
            TensorRole::Up(l),
            TensorRole::Down(l),
        ]);
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
    pub(crate) qkv: DevicePtr,
    /// The three biases in the same order, or NULL.
    pub(crate) qkv_bias: DevicePtr,
    pub(crate) q_norm: DevicePtr,
    pub(crate) k_norm: DevicePtr,
    pub(crate) o: DevicePtr,
    pub(crate) post_norm: DevicePtr,
    /// gate rows then up rows: `[2 * intermediate, hidden]`, so one GEMM feeds SiLU-and-mul.
    pub(crate) gate_up: DevicePtr,
    pub(crate) down: DevicePtr,
}

/// All weights on the device.
#[derive(Clone, Debug)]
pub struct DeviceWeights {
    pub(crate) embedding: DevicePtr,
    pub(crate) final_norm: DevicePtr,
    /// The embedding itself when tied.
    pub(crate) lm_head: DevicePtr,
    pub(crate) layers: Vec<LayerWeights>,
    /// Every allocation, for freeing.
    pub(crate) allocations: Vec<DevicePtr>,
    /// Bytes uploaded.
    pub bytes: u64,
}

/// Progress of a load: tensors done, tensors in all, bytes uploaded so far.
pub type LoadProgress<'a> = &'a mut dyn FnMut(usize, usize, u64);

/// Checks every tensor the config needs exists in `source` with the right shape, before any load.
pub fn check_shapes(c: &ModelConfig, source: &dyn WeightSource) -> Result<(), ModelError> {
    for role in expected_tensors(c) {
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

fn upload(
    gpu: &dyn GpuBackend,
    t: &HostTensor,
    allocations: &mut Vec<DevicePtr>,
) -> Result<DevicePtr, ModelError> {
    let bytes: &[u8] = bytemuck::cast_slice(&t.data);
    let ptr = gpu.alloc(bytes.len())?;
    allocations.push(ptr);
    gpu.copy_h2d(bytes, ptr)?;
    Ok(ptr)
}

/// Uploads the checkpoint. Shapes are checked first; on error, whatever was uploaded is freed.
pub fn load(
    c: &ModelConfig,
    source: &dyn WeightSource,
    gpu: &dyn GpuBackend,
    progress: LoadProgress,
) -> Result<DeviceWeights, ModelError> {
    check_shapes(c, source)?;
    let mut allocations = Vec::new();
    let result = load_inner(c, source, gpu, progress, &mut allocations);
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
    gpu: &'a dyn GpuBackend,
    progress: LoadProgress<'a>,
    allocations: &'a mut Vec<DevicePtr>,
    done: usize,
    total: usize,
    bytes: u64,
}

impl Uploader<'_> {
    fn put(&mut self, t: &HostTensor, tensors: usize) -> Result<DevicePtr, ModelError> {
        let p = upload(self.gpu, t, self.allocations)?;
        self.done += tensors;
        self.bytes += t.data.len() as u64 * 2;
        (self.progress)(self.done, self.total, self.bytes);
        Ok(p)
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
    progress: LoadProgress,
    allocations: &mut Vec<DevicePtr>,
) -> Result<DeviceWeights, ModelError> {
    let total = expected_tensors(c).len();
    let mut u = Uploader {
        source,
        gpu,
        progress,
        allocations,
        done: 0,
        total,
        bytes: 0,
    };
    let embedding = u.get(TensorRole::Embedding)?;
    let mut layers = Vec::with_capacity(c.num_layers);
    for l in 0..c.num_layers {
        layers.push(LayerWeights {
            input_norm: u.get(TensorRole::InputNorm(l))?,
            // q, k and v fused row-wise: one [(H + 2 KV) D, hidden] weight, one product.
            qkv: u.get_stacked(&[TensorRole::Q(l), TensorRole::K(l), TensorRole::V(l)])?,
            qkv_bias: if c.attention_bias {
                u.get_stacked(&[
                    TensorRole::QBias(l),
                    TensorRole::KBias(l),
                    TensorRole::VBias(l),
                ])?
            } else {
                DevicePtr::NULL
            },
            q_norm: u.get_if(c.qk_norm, TensorRole::QNorm(l))?,
            k_norm: u.get_if(c.qk_norm, TensorRole::KNorm(l))?,
            o: u.get(TensorRole::O(l))?,
            post_norm: u.get(TensorRole::PostNorm(l))?,
            // gate and up fused row-wise: one [2I, H] weight, one GEMM.
            gate_up: u.get_stacked(&[TensorRole::Gate(l), TensorRole::Up(l)])?,
            down: u.get(TensorRole::Down(l))?,
        });
    }
    let final_norm = u.get(TensorRole::FinalNorm)?;
    let lm_head = if c.tie_word_embeddings {
        embedding
    } else {
        u.get(TensorRole::LmHead)?
    };
    let bytes = u.bytes;
    Ok(DeviceWeights {
        embedding,
        final_norm,
        lm_head,
        layers,
        allocations: std::mem::take(allocations),
        bytes,
    })
}
