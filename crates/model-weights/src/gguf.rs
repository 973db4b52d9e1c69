// SPDX-License-Identifier: MIT OR Apache-2.0
//! GGUF: one file with metadata, tokenizer and (usually quantised) tensors.
//!
//! Layout (little-endian): magic `GGUF`, version, tensor count, metadata count, the metadata
//! key/values, the tensor table (name, dims innermost first, GGML type, offset), then the tensor
//! data at `general.alignment` (default 32). Every offset and size is checked against the file's
//! length, so a truncated file is an error naming the first tensor it cuts.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use half::bf16;
use metrale_config::{ConfigError, MetaValue, ModelConfig, ModelFamily};

use crate::dequant::{block_geometry, dequantize, type_name};
use crate::{HostTensor, WeightError, WeightSource};

/// One entry of the tensor table.
#[derive(Clone, Debug)]
pub struct GgufTensor {
    /// The llama.cpp name (`blk.0.attn_q.weight`).
    pub name: String,
    /// Dimensions, innermost first (GGML order).
    pub dims: Vec<u64>,
    /// GGML type id.
    pub ggml_type: u32,
    /// Byte offset from the start of the data section.
    pub offset: u64,
}

impl GgufTensor {
    /// Elements.
    pub fn elements(&self) -> u64 {
        self.dims.iter().product()
    }
    /// The shape in HF order (outermost first).
    pub fn hf_shape(&self) -> Vec<usize> {
        self.dims.iter().rev().map(|&d| d as usize).collect()
    }
}

/// An open, memory-mapped GGUF file.
pub struct GgufFile {
    path: PathBuf,
    map: memmap2::Mmap,
    /// Format version.
    pub version: u32,
    /// Every metadata key/value.
    pub metadata: BTreeMap<String, MetaValue>,
    /// The tensor table, in file order.
    pub tensors: Vec<GgufTensor>,
    data_start: usize,
}

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
    path: &'a Path,
}

impl Reader<'_> {
    fn err(&self, what: &str) -> WeightError {
        WeightError::Format {
            path: self.path.to_path_buf(),
            message: format!(
                "{what} at byte {} (file is {} bytes: truncated or not GGUF)",
                self.at,
                self.bytes.len()
            ),
        }
    }
    fn take(&mut self, n: usize) -> Result<&[u8], WeightError> {
        let end = self
            .at
            .checked_add(n)
            .filter(|&e| e <= self.bytes.len())
            .ok_or_else(|| self.err("unexpected end of header"))?;
        let s = &self.bytes[self.at..end];
        self.at = end;
        Ok(s)
    }
    fn u32(&mut self) -> Result<u32, WeightError> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().unwrap()))
    }
    fn u64(&mut self) -> Result<u64, WeightError> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().unwrap()))
    }
    fn string(&mut self) -> Result<String, WeightError> {
        let len = self.u64()?;
        if len > 1 << 30 {
            return Err(self.err("implausible string length"));
        }
        let bytes = self.take(len as usize)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| self.err("string is not UTF-8"))
    }
    fn value(&mut self, ty: u32, depth: usize) -> Result<MetaValue, WeightError> {
        Ok(match ty {
            0 => MetaValue::U64(self.take(1)?[0].into()),
            1 => MetaValue::I64((self.take(1)?[0] as i8).into()),
            2 => MetaValue::U64(u16::from_le_bytes(self.take(2)?.try_into().unwrap()).into()),
            3 => MetaValue::I64(i16::from_le_bytes(self.take(2)?.try_into().unwrap()).into()),
            4 => MetaValue::U64(self.u32()?.into()),
            5 => MetaValue::I64(i32::from_le_bytes(self.take(4)?.try_into().unwrap()).into()),
            6 => MetaValue::F64(f32::from_le_bytes(self.take(4)?.try_into().unwrap()).into()),
            7 => MetaValue::Bool(self.take(1)?[0] != 0),
            8 => MetaValue::Str(self.string()?),
            9 => {
                if depth > 2 {
                    return Err(self.err("arrays nested too deep"));
                }
                let item = self.u32()?;
                let len = self.u64()?;
                if len > (self.bytes.len() - self.at) as u64 {
                    return Err(self.err("array longer than the file"));
                }
                let mut items = Vec::with_capacity(len as usize);
                for _ in 0..len {
                    items.push(self.value(item, depth + 1)?);
                }
                MetaValue::Array(items)
            }
            10 => MetaValue::U64(self.u64()?),
            11 => MetaValue::I64(self.u64()? as i64),
            12 => MetaValue::F64(f64::from_le_bytes(self.take(8)?.try_into().unwrap())),
            other => return Err(self.err(&format!("unknown metadata value type {other}"))),
        })
    }
}

impl GgufFile {
    /// Opens and parses the header and tensor table; checks every tensor's type and extent.
    pub fn open(path: &Path) -> Result<Self, WeightError> {
        let io = |e: std::io::Error| WeightError::Io {
            path: path.to_path_buf(),
            message: e.to_string(),
        };
        let file = std::fs::File::open(path).map_err(io)?;
        // SAFETY: the map is read-only and private to this process; like every inference engine we
        // assume nobody truncates the weight file while it is being served.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io)?;
        let mut r = Reader {
            bytes: &map,
            at: 0,
            path,
        };
        if r.take(4).ok() != Some(b"GGUF".as_slice()) {
            return Err(WeightError::Format {
                path: path.to_path_buf(),
                message: "not a GGUF file (bad magic)".into(),
            });
        }
        let version = r.u32()?;
        if !(2..=3).contains(&version) {
            return Err(WeightError::Format {
                path: path.to_path_buf(),
                message: format!("GGUF version {version} is not supported (2 or 3)"),
            });
        }
        let tensor_count = r.u64()?;
        let kv_count = r.u64()?;
        let mut metadata = BTreeMap::new();
        for _ in 0..kv_count {
            let key = r.string()?;
            let ty = r.u32()?;
            metadata.insert(key, r.value(ty, 0)?);
        }
        let mut tensors = Vec::new();
        for _ in 0..tensor_count {
            let name = r.string()?;
            let n_dims = r.u32()?;
            if n_dims > 4 {
                return Err(r.err(&format!("tensor `{name}` has {n_dims} dimensions")));
            }
            let dims = (0..n_dims)
                .map(|_| r.u64())
                .collect::<Result<Vec<_>, _>>()?;
            let ggml_type = r.u32()?;
            let offset = r.u64()?;
            tensors.push(GgufTensor {
                name,
                dims,
                ggml_type,
                offset,
            });
        }
        let alignment = metadata
            .get("general.alignment")
            .and_then(MetaValue::as_u64)
            .unwrap_or(32)
            .max(1) as usize;
        let data_start = r.at.next_multiple_of(alignment);
        let gguf = GgufFile {
            path: path.to_path_buf(),
            version,
            metadata,
            tensors,
            data_start,
            map,
        };
        for t in &gguf.tensors {
            gguf.extent(t)?;
        }
        Ok(gguf)
    }

    /// The byte range of a tensor's data, checked against the file.
    fn extent(&self, t: &GgufTensor) -> Result<std::ops::Range<usize>, WeightError> {
        let err = |message: String| WeightError::Tensor {
            path: self.path.clone(),
            tensor: t.name.clone(),
            message,
        };
        let (block_len, block_bytes) = block_geometry(t.ggml_type).ok_or_else(|| {
            err(format!(
                "tensor type {} is not supported (supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q4_K, Q5_K, Q6_K)",
                type_name(t.ggml_type)
            ))
        })?;
        let elements = t.elements();
        if !elements.is_multiple_of(block_len as u64) {
            return Err(err(format!(
                "{elements} elements is not a whole number of {}-element blocks",
                block_len
            )));
        }
        let bytes = elements / block_len as u64 * block_bytes as u64;
        let start = self.data_start as u64 + t.offset;
        let end = start + bytes;
        if end > self.map.len() as u64 {
            return Err(err(format!(
                "data {start}..{end} runs past the end of the file ({} bytes): the file is truncated",
                self.map.len()
            )));
        }
        Ok(start as usize..end as usize)
    }

    /// The model config the metadata describes.
    pub fn config(&self) -> Result<ModelConfig, ConfigError> {
        metrale_config::from_gguf_metadata(&self.metadata, self.tensor("output.weight").is_some())
    }

    /// The tensor-table entry of a llama.cpp name.
    pub fn tensor(&self, name: &str) -> Option<&GgufTensor> {
        self.tensors.iter().find(|t| t.name == name)
    }

    fn family(&self) -> Option<ModelFamily> {
        match self
            .metadata
            .get("general.architecture")
            .and_then(MetaValue::as_str)?
        {
            "llama" => Some(ModelFamily::Llama),
            "granite" => Some(ModelFamily::Granite),
            "qwen2" => Some(ModelFamily::Qwen2),
            "qwen3" => Some(ModelFamily::Qwen3),
            _ => None,
        }
    }

    fn head_counts(&self) -> (usize, usize) {
        let arch = self
            .metadata
            .get("general.architecture")
            .and_then(MetaValue::as_str)
            .unwrap_or("");
        let get = |k: &str| {
            self.metadata
                .get(&format!("{arch}.{k}"))
                .and_then(MetaValue::as_u64)
                .unwrap_or(1) as usize
        };
        let heads = get("attention.head_count");
        let kv = self
            .metadata
            .get(&format!("{arch}.attention.head_count_kv"))
            .and_then(MetaValue::as_u64)
            .map_or(heads, |v| v as usize);
        (heads, kv)
    }
}

/// The llama.cpp name of an HF tensor name, for the families the engine runs.
pub fn gguf_name(hf: &str) -> Option<String> {
    let fixed = match hf {
        "model.embed_tokens.weight" => Some("token_embd.weight"),
        "model.norm.weight" => Some("output_norm.weight"),
        "lm_head.weight" => Some("output.weight"),
        _ => None,
    };
    if let Some(f) = fixed {
        return Some(f.to_string());
    }
    let rest = hf.strip_prefix("model.layers.")?;
    let (layer, rest) = rest.split_once('.')?;
    layer.parse::<u32>().ok()?;
    // A sparse layer's experts, one stack per projection ([experts, rows, cols] in HF order).
    let stack = match rest {
        "mlp.experts.gate_proj" => Some("ffn_gate_exps"),
        "mlp.experts.up_proj" => Some("ffn_up_exps"),
        "mlp.experts.down_proj" => Some("ffn_down_exps"),
        _ => None,
    };
    if let Some(s) = stack {
        return Some(format!("blk.{layer}.{s}.weight"));
    }
    let (module, suffix) = rest.rsplit_once('.')?;
    let gguf = match module {
        "input_layernorm" => "attn_norm",
        "self_attn.q_proj" => "attn_q",
        "self_attn.k_proj" => "attn_k",
        "self_attn.v_proj" => "attn_v",
        "self_attn.o_proj" => "attn_output",
        // Phi-3's fused q|k|v and gate|up (llama.cpp's `attn_qkv`, and `ffn_up` of twice the
        // width, gate rows first).
        "self_attn.qkv_proj" => "attn_qkv",
        "mlp.gate_up_proj" => "ffn_up",
        "self_attn.q_norm" => "attn_q_norm",
        "self_attn.k_norm" => "attn_k_norm",
        "post_attention_layernorm" => "ffn_norm",
        "mlp.gate_proj" => "ffn_gate",
        "mlp.up_proj" => "ffn_up",
        "mlp.down_proj" => "ffn_down",
        "mlp.gate" => "ffn_gate_inp",
        "mlp.shared_expert.gate_proj" => "ffn_gate_shexp",
        "mlp.shared_expert.up_proj" => "ffn_up_shexp",
        "mlp.shared_expert.down_proj" => "ffn_down_shexp",
        "mlp.shared_expert_gate" => "ffn_gate_inp_shexp",
        _ => return None,
    };
    Some(format!("blk.{layer}.{gguf}.{suffix}"))
}

/// The HF shape of a tensor GGUF stores with another rank: the shared expert's gate, HF's
/// `[1, hidden]` (a linear to one output), is a vector `[hidden]` in llama.cpp's files.
fn shape_as_hf(hf: &str, shape: Vec<usize>) -> Vec<usize> {
    if hf.ends_with("mlp.shared_expert_gate.weight") && shape.len() == 1 {
        vec![1, shape[0]]
    } else {
        shape
    }
}

/// Undoes llama.cpp's converter permutation of Q/K rows: within each head, GGUF row `2i + j`
/// holds HF row `j * head_dim / 2 + i` (the converter interleaves the two rotate-half halves).
fn unpermute_rows(data: &[f32], heads: usize, cols: usize) -> Vec<f32> {
    let rows = data.len() / cols.max(1);
    let head_dim = rows / heads.max(1);
    let half = head_dim / 2;
    let mut out = vec![0f32; data.len()];
    for h in 0..heads {
        for i in 0..half {
            for j in 0..2 {
                let src = h * head_dim + 2 * i + j;
                let dst = h * head_dim + j * half + i;
                out[dst * cols..(dst + 1) * cols]
                    .copy_from_slice(&data[src * cols..(src + 1) * cols]);
            }
        }
    }
    out
}

impl WeightSource for GgufFile {
    fn shape(&self, name: &str) -> Option<Vec<usize>> {
        self.tensor(&gguf_name(name)?)
            .map(|t| shape_as_hf(name, t.hf_shape()))
    }

    fn load(&self, name: &str) -> Result<HostTensor, WeightError> {
        let missing = || WeightError::Missing {
            source_desc: self.describe(),
            name: name.to_string(),
        };
        let gname = gguf_name(name).ok_or_else(missing)?;
        let t = self.tensor(&gname).ok_or_else(missing)?;
        let range = self.extent(t)?;
        let mut values = Vec::with_capacity(t.elements() as usize);
        dequantize(t.ggml_type, &self.map[range], &mut values);
        let shape = shape_as_hf(name, t.hf_shape());
        // llama.cpp's converter permutes Q/K rows for Llama and the architectures built on its
        // converter (Granite).
        if matches!(
            self.family(),
            Some(ModelFamily::Llama | ModelFamily::Granite)
        ) {
            let (heads, kv_heads) = self.head_counts();
            let cols = if shape.len() == 2 { shape[1] } else { 1 };
            if gname.ends_with("attn_q.weight") || gname.ends_with("attn_q.bias") {
                values = unpermute_rows(&values, heads, cols);
            } else if gname.ends_with("attn_k.weight") || gname.ends_with("attn_k.bias") {
                values = unpermute_rows(&values, kv_heads, cols);
            }
        }
        Ok(HostTensor {
            shape,
            data: values.into_iter().map(bf16::from_f32).collect(),
        })
    }

    fn describe(&self) -> String {
        format!("{} (GGUF v{})", self.path.display(), self.version)
    }
}

#[cfg(test)]
mod tests;
