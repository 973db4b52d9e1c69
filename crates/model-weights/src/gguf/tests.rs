// SPDX-License-Identifier: MIT OR Apache-2.0
//! GGUF reader tests on files written here, byte by byte.

use super::*;

/// Writes a minimal GGUF v3 file.
pub(crate) struct Writer {
    meta: Vec<u8>,
    meta_count: u64,
    table: Vec<u8>,
    data: Vec<u8>,
    tensor_count: u64,
}

impl Writer {
    pub fn new() -> Self {
        Writer {
            meta: Vec::new(),
            meta_count: 0,
            table: Vec::new(),
            data: Vec::new(),
            tensor_count: 0,
        }
    }
    fn string(buf: &mut Vec<u8>, s: &str) {
        buf.extend((s.len() as u64).to_le_bytes());
        buf.extend(s.as_bytes());
    }
    pub fn meta_str(&mut self, k: &str, v: &str) -> &mut Self {
        Self::string(&mut self.meta, k);
        self.meta.extend(8u32.to_le_bytes());
        Self::string(&mut self.meta, v);
        self.meta_count += 1;
        self
    }
    pub fn meta_u32(&mut self, k: &str, v: u32) -> &mut Self {
        Self::string(&mut self.meta, k);
        self.meta.extend(4u32.to_le_bytes());
        self.meta.extend(v.to_le_bytes());
        self.meta_count += 1;
        self
    }
    pub fn meta_f32(&mut self, k: &str, v: f32) -> &mut Self {
        Self::string(&mut self.meta, k);
        self.meta.extend(6u32.to_le_bytes());
        self.meta.extend(v.to_le_bytes());
        self.meta_count += 1;
        self
    }
    /// Adds an F32 tensor with GGML dims (innermost first).
    pub fn tensor_f32(&mut self, name: &str, dims: &[u64], values: &[f32]) -> &mut Self {
        self.tensor_raw(
            name,
            dims,
            0,
            &values
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect::<Vec<_>>(),
        )
    }
    pub fn tensor_raw(
        &mut self,
        name: &str,
        dims: &[u64],
        ggml_type: u32,
        bytes: &[u8],
    ) -> &mut Self {
        Self::string(&mut self.table, name);
        self.table.extend((dims.len() as u32).to_le_bytes());
        for d in dims {
            self.table.extend(d.to_le_bytes());
        }
        self.table.extend(ggml_type.to_le_bytes());
        let offset = self.data.len().next_multiple_of(32);
        self.data.resize(offset, 0);
        self.table.extend((offset as u64).to_le_bytes());
        self.data.extend(bytes);
        self.tensor_count += 1;
        self
    }
    pub fn bytes(&self) -> Vec<u8> {
        let mut out = b"GGUF".to_vec();
        out.extend(3u32.to_le_bytes());
        out.extend(self.tensor_count.to_le_bytes());
        out.extend(self.meta_count.to_le_bytes());
        out.extend(&self.meta);
        out.extend(&self.table);
        out.resize(out.len().next_multiple_of(32), 0);
        out.extend(&self.data);
        out
    }
}

fn tiny_llama() -> Writer {
    let mut w = Writer::new();
    w.meta_str("general.architecture", "llama")
        .meta_u32("llama.embedding_length", 8)
        .meta_u32("llama.feed_forward_length", 16)
        .meta_u32("llama.block_count", 1)
        .meta_u32("llama.attention.head_count", 2)
        .meta_u32("llama.attention.head_count_kv", 1)
        .meta_f32("llama.attention.layer_norm_rms_epsilon", 1e-5)
        .meta_u32("llama.vocab_size", 4);
    // q_proj: 8 output rows (2 heads x head_dim 4), 8 input columns; row r filled with r.
    let q: Vec<f32> = (0..8)
        .flat_map(|r| std::iter::repeat_n(r as f32, 8))
        .collect();
    w.tensor_f32("blk.0.attn_q.weight", &[8, 8], &q);
    w.tensor_f32(
        "token_embd.weight",
        &[8, 4],
        &(0..32).map(|v| v as f32).collect::<Vec<_>>(),
    );
    w
}

fn write(dir: &tempfile::TempDir, name: &str, bytes: &[u8]) -> PathBuf {
    let p = dir.path().join(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

#[test]
fn reads_metadata_config_and_tensors() {
    let dir = tempfile::tempdir().unwrap();
    let g = GgufFile::open(&write(&dir, "m.gguf", &tiny_llama().bytes())).unwrap();
    let c = g.config().unwrap();
    assert_eq!(
        (c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim),
        (8, 2, 1, 4)
    );
    assert!(c.tie_word_embeddings, "no output.weight means a tied head");
    assert_eq!(g.shape("model.embed_tokens.weight"), Some(vec![4, 8]));
    let emb = g.load("model.embed_tokens.weight").unwrap();
    assert_eq!(f32::from(emb.data[9]), 9.0);
    // The converter's interleaving is undone: per head, GGUF rows (0,1,2,3) -> HF rows (0,2,1,3).
    let q = g.load("model.layers.0.self_attn.q_proj.weight").unwrap();
    let rows: Vec<f32> = (0..8).map(|r| f32::from(q.data[r * 8])).collect();
    assert_eq!(rows, vec![0.0, 2.0, 1.0, 3.0, 4.0, 6.0, 5.0, 7.0]);
    assert!(matches!(
        g.load("model.layers.0.mlp.up_proj.weight"),
        Err(WeightError::Missing { .. })
    ));
}

/// A one-layer `qwen3moe` file as llama.cpp's converter lays it out: the config's expert keys,
/// the experts as stacks `[hidden, inter, experts]` (innermost first), a vector shared-expert
/// gate. Read back: the MoE config, the stacks in HF order `[experts, inter, hidden]` with the
/// file's values in place, the shared gate as HF's `[1, hidden]`.
#[test]
fn reads_a_moe_files_experts_as_stacks() {
    let mut w = Writer::new();
    w.meta_str("general.architecture", "qwen3moe")
        .meta_u32("qwen3moe.embedding_length", 4)
        .meta_u32("qwen3moe.feed_forward_length", 6)
        .meta_u32("qwen3moe.block_count", 1)
        .meta_u32("qwen3moe.attention.head_count", 2)
        .meta_u32("qwen3moe.attention.head_count_kv", 1)
        .meta_u32("qwen3moe.expert_count", 2)
        .meta_u32("qwen3moe.expert_used_count", 1)
        .meta_u32("qwen3moe.expert_feed_forward_length", 3)
        .meta_u32("qwen3moe.vocab_size", 4);
    let gate: Vec<f32> = (0..24).map(|v| v as f32).collect();
    w.tensor_f32("blk.0.ffn_gate_exps.weight", &[4, 3, 2], &gate);
    w.tensor_f32(
        "blk.0.ffn_gate_inp_shexp.weight",
        &[4],
        &[1.0, 2.0, 3.0, 4.0],
    );
    let dir = tempfile::tempdir().unwrap();
    let g = GgufFile::open(&write(&dir, "moe.gguf", &w.bytes())).unwrap();
    let m = g.config().unwrap().moe.expect("a MoE config");
    assert_eq!((m.num_experts, m.top_k, m.expert_intermediate), (2, 1, 3));
    let name = "model.layers.0.mlp.experts.gate_proj";
    assert_eq!(g.shape(name), Some(vec![2, 3, 4]));
    let t = g.load(name).unwrap();
    // Expert 1, row 2, column 3 is element ((1 * 3) + 2) * 4 + 3 = 23.
    assert_eq!(f32::from(t.data[23]), 23.0);
    let shared = "model.layers.0.mlp.shared_expert_gate.weight";
    assert_eq!(g.shape(shared), Some(vec![1, 4]));
    assert_eq!(g.load(shared).unwrap().shape, vec![1, 4]);
}

#[test]
fn truncated_file_names_the_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let bytes = tiny_llama().bytes();
    let err = GgufFile::open(&write(&dir, "t.gguf", &bytes[..bytes.len() - 10]))
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("token_embd.weight") && err.contains("truncated"),
        "{err}"
    );
    let err = GgufFile::open(&write(&dir, "h.gguf", &bytes[..40]))
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("truncated or not GGUF"), "{err}");
    let err = GgufFile::open(&write(&dir, "x.gguf", b"not a gguf file"))
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("bad magic"), "{err}");
}

#[test]
fn unsupported_tensor_type_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let mut w = tiny_llama();
    w.tensor_raw("blk.0.ffn_up.weight", &[256, 1], 10, &[0u8; 84]); // Q2_K
    let err = GgufFile::open(&write(&dir, "q2.gguf", &w.bytes()))
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("blk.0.ffn_up.weight")
            && err.contains("Q2_K")
            && err.contains("not supported"),
        "{err}"
    );
}

#[test]
fn hf_names_map_to_llama_cpp_names() {
    assert_eq!(
        gguf_name("model.layers.12.self_attn.k_norm.weight").unwrap(),
        "blk.12.attn_k_norm.weight"
    );
    assert_eq!(
        gguf_name("model.layers.3.self_attn.q_proj.bias").unwrap(),
        "blk.3.attn_q.bias"
    );
    assert_eq!(gguf_name("lm_head.weight").unwrap(), "output.weight");
    // A sparse layer: router, the experts' stacks, the shared expert and its gate.
    for (hf, gguf) in [
        (
            "model.layers.5.mlp.gate.weight",
            "blk.5.ffn_gate_inp.weight",
        ),
        (
            "model.layers.5.mlp.experts.gate_proj",
            "blk.5.ffn_gate_exps.weight",
        ),
        (
            "model.layers.5.mlp.experts.up_proj",
            "blk.5.ffn_up_exps.weight",
        ),
        (
            "model.layers.5.mlp.experts.down_proj",
            "blk.5.ffn_down_exps.weight",
        ),
        (
            "model.layers.5.mlp.shared_expert.up_proj.weight",
            "blk.5.ffn_up_shexp.weight",
        ),
        (
            "model.layers.5.mlp.shared_expert_gate.weight",
            "blk.5.ffn_gate_inp_shexp.weight",
        ),
        // Phi-3's fused projections.
        (
            "model.layers.2.self_attn.qkv_proj.weight",
            "blk.2.attn_qkv.weight",
        ),
        (
            "model.layers.2.mlp.gate_up_proj.weight",
            "blk.2.ffn_up.weight",
        ),
    ] {
        assert_eq!(gguf_name(hf).unwrap(), gguf, "{hf}");
    }
    assert!(gguf_name("model.layers.5.mlp.experts.0.gate_proj.weight").is_none());
    assert!(gguf_name("model.layers.x.mlp.up_proj.weight").is_none());
    assert!(gguf_name("vision_tower.weight").is_none());
}
