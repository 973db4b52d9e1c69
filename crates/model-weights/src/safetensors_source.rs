// SPDX-License-Identifier: MIT OR Apache-2.0
//! Hugging Face safetensors checkpoints: one file or shards listed by
//! `model.safetensors.index.json`, each memory-mapped.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use half::{bf16, f16};
use safetensors::{Dtype, SafeTensors};

use crate::{HostTensor, WeightError, WeightSource};

/// A tensor's dtype, shape and byte range within its shard's data section.
type Entry = (Dtype, Vec<usize>, (usize, usize));

struct Shard {
    path: PathBuf,
    map: memmap2::Mmap,
    /// Where the data section starts (8-byte length + JSON header).
    data_start: usize,
    /// name -> (dtype, shape, byte range within the data section)
    tensors: BTreeMap<String, Entry>,
}

/// A safetensors checkpoint directory.
pub struct SafetensorsCheckpoint {
    dir: PathBuf,
    shards: Vec<Shard>,
    /// tensor name -> shard index
    index: BTreeMap<String, usize>,
}

fn io(path: &Path) -> impl Fn(std::io::Error) -> WeightError + '_ {
    move |e| WeightError::Io {
        path: path.to_path_buf(),
        message: e.to_string(),
    }
}

fn open_shard(path: &Path) -> Result<Shard, WeightError> {
    let file = std::fs::File::open(path).map_err(io(path))?;
    // SAFETY: read-only private map; the weight file is assumed not to change while in use.
    let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io(path))?;
    let (header_len, metadata) =
        SafeTensors::read_metadata(&map).map_err(|e| WeightError::Format {
            path: path.to_path_buf(),
            message: format!("not a valid safetensors file ({e}); it may be truncated"),
        })?;
    let data_start = 8 + header_len;
    let data_len = map.len().saturating_sub(data_start);
    let mut tensors = BTreeMap::new();
    for (name, info) in metadata.tensors() {
        let (start, end) = info.data_offsets;
        if end > data_len || start > end {
            return Err(WeightError::Tensor {
                path: path.to_path_buf(),
                tensor: name,
                message: format!(
                    "data {start}..{end} runs past the end of the file's data ({data_len} bytes): the file is truncated"
                ),
            });
        }
        tensors.insert(name, (info.dtype, info.shape.clone(), (start, end)));
    }
    Ok(Shard {
        path: path.to_path_buf(),
        map,
        data_start,
        tensors,
    })
}

impl SafetensorsCheckpoint {
    /// Opens every shard of the checkpoint in `dir`: those named by `model.safetensors.index.json`
    /// when it exists, else every `*.safetensors` file.
    pub fn open(dir: &Path) -> Result<Self, WeightError> {
        let index_path = dir.join("model.safetensors.index.json");
        let mut files: Vec<PathBuf> = if index_path.is_file() {
            let text = std::fs::read_to_string(&index_path).map_err(io(&index_path))?;
            let json: serde_json::Value =
                serde_json::from_str(&text).map_err(|e| WeightError::Format {
                    path: index_path.clone(),
                    message: e.to_string(),
                })?;
            let map = json["weight_map"]
                .as_object()
                .ok_or_else(|| WeightError::Format {
                    path: index_path.clone(),
                    message: "no `weight_map` object".into(),
                })?;
            let mut shards: Vec<PathBuf> = map
                .values()
                .filter_map(|v| v.as_str())
                .map(|f| dir.join(f))
                .collect();
            shards.sort();
            shards.dedup();
            shards
        } else {
            let entries = std::fs::read_dir(dir).map_err(io(dir))?;
            entries
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
                .collect()
        };
        files.sort();
        if files.is_empty() {
            return Err(WeightError::Format {
                path: dir.to_path_buf(),
                message: "no .safetensors files in the directory".into(),
            });
        }
        let shards = files
            .iter()
            .map(|f| open_shard(f))
            .collect::<Result<Vec<_>, _>>()?;
        let mut index = BTreeMap::new();
        for (i, s) in shards.iter().enumerate() {
            for name in s.tensors.keys() {
                index.insert(name.clone(), i);
            }
        }
        Ok(SafetensorsCheckpoint {
            dir: dir.to_path_buf(),
            shards,
            index,
        })
    }

    /// Every tensor name in the checkpoint.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.index.keys().map(String::as_str)
    }
}

impl WeightSource for SafetensorsCheckpoint {
    fn shape(&self, name: &str) -> Option<Vec<usize>> {
        let shard = &self.shards[*self.index.get(name)?];
        shard.tensors.get(name).map(|(_, s, _)| s.clone())
    }

    fn load(&self, name: &str) -> Result<HostTensor, WeightError> {
        let (dtype, shape, bytes) = self.bytes(name)?;
        let data: Vec<bf16> = match dtype {
            Dtype::BF16 => bytemuck::pod_collect_to_vec(bytes),
            Dtype::F16 => bytes
                .chunks_exact(2)
                .map(|c| bf16::from_f32(f16::from_le_bytes([c[0], c[1]]).to_f32()))
                .collect(),
            _ => bytes
                .chunks_exact(4)
                .map(|c| bf16::from_f32(f32::from_le_bytes([c[0], c[1], c[2], c[3]])))
                .collect(),
        };
        Ok(HostTensor { shape, data })
    }

    fn load_f32(&self, name: &str) -> Result<(Vec<usize>, Vec<f32>), WeightError> {
        let (dtype, shape, bytes) = self.bytes(name)?;
        let data: Vec<f32> = match dtype {
            Dtype::BF16 => bytes
                .chunks_exact(2)
                .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            Dtype::F16 => bytes
                .chunks_exact(2)
                .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            _ => bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
        };
        Ok((shape, data))
    }

    fn is_e4m3(&self, name: &str) -> bool {
        self.entry(name)
            .is_some_and(|(dtype, _)| dtype == Dtype::F8_E4M3)
    }

    fn load_e4m3(&self, name: &str) -> Result<(Vec<usize>, Vec<u8>), WeightError> {
        let (_, shape, bytes) = self.bytes_of(name, &[Dtype::F8_E4M3])?;
        Ok((shape, bytes.to_vec()))
    }

    fn describe(&self) -> String {
        format!(
            "{} ({} safetensors shard(s))",
            self.dir.display(),
            self.shards.len()
        )
    }
}

impl SafetensorsCheckpoint {
    /// Tensor `name`'s dtype and shard, if the checkpoint has it.
    fn entry(&self, name: &str) -> Option<(Dtype, &Shard)> {
        let shard = &self.shards[*self.index.get(name)?];
        shard.tensors.get(name).map(|(d, _, _)| (*d, shard))
    }

    /// Tensor `name`'s dtype (BF16, F16 or F32), shape and data bytes, their length checked.
    fn bytes(&self, name: &str) -> Result<(Dtype, Vec<usize>, &[u8]), WeightError> {
        self.bytes_of(name, &[Dtype::BF16, Dtype::F16, Dtype::F32])
    }

    /// Tensor `name`'s dtype (one of `dtypes`), shape and data bytes, their length checked.
    fn bytes_of(
        &self,
        name: &str,
        dtypes: &[Dtype],
    ) -> Result<(Dtype, Vec<usize>, &[u8]), WeightError> {
        let shard = self
            .index
            .get(name)
            .map(|&i| &self.shards[i])
            .ok_or_else(|| WeightError::Missing {
                source_desc: self.describe(),
                name: name.to_string(),
            })?;
        let (dtype, shape, (start, end)) = &shard.tensors[name];
        let bytes = &shard.map[shard.data_start + start..shard.data_start + end];
        let elements: usize = shape.iter().product();
        let err = |message: String| WeightError::Tensor {
            path: shard.path.clone(),
            tensor: name.to_string(),
            message,
        };
        let width = match dtype {
            Dtype::F8_E4M3 if dtypes.contains(dtype) => 1,
            Dtype::F8_E4M3 => {
                return Err(err(
                    "stored as float8_e4m3fn: it is read with its scale, as the checkpoint's \
                     quantization_config says (an FP8 tensor outside a quantized linear is not \
                     supported)"
                        .into(),
                ));
            }
            Dtype::BF16 | Dtype::F16 if dtypes.contains(dtype) => 2,
            Dtype::F32 if dtypes.contains(dtype) => 4,
            other => {
                return Err(err(format!(
                    "dtype {other:?} is not supported here ({dtypes:?})"
                )));
            }
        };
        if bytes.len() != elements * width {
            return Err(err(format!(
                "{} bytes of data for shape {shape:?} of {dtype:?}",
                bytes.len()
            )));
        }
        Ok((*dtype, shape.clone(), bytes))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write_checkpoint(dir: &Path) {
        let a: Vec<u8> = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0]
            .iter()
            .flat_map(|v| bf16::from_f32(*v).to_le_bytes())
            .collect();
        let b: Vec<u8> = [0.5f32, -1.0, 1.0 + 1.0 / 1024.0]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let views = vec![
            (
                "w.a",
                safetensors::tensor::TensorView::new(Dtype::BF16, vec![2, 3], &a).unwrap(),
            ),
            (
                "w.b",
                safetensors::tensor::TensorView::new(Dtype::F32, vec![3], &b).unwrap(),
            ),
        ];
        safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
    }

    #[test]
    fn loads_and_converts() {
        let dir = tempfile::tempdir().unwrap();
        write_checkpoint(dir.path());
        let ck = SafetensorsCheckpoint::open(dir.path()).unwrap();
        assert_eq!(ck.shape("w.a"), Some(vec![2, 3]));
        let a = ck.load("w.a").unwrap();
        assert_eq!(f32::from(a.data[5]), 6.0);
        let b = ck.load("w.b").unwrap();
        assert_eq!(
            b.data.iter().map(|v| f32::from(*v)).collect::<Vec<_>>(),
            vec![0.5, -1.0, 1.0]
        );
        // load_f32 reads F32 exactly (1 + 2^-10 is not a bf16) and widens BF16.
        assert_eq!(
            ck.load_f32("w.b").unwrap(),
            (vec![3], vec![0.5, -1.0, 1.0 + 1.0 / 1024.0])
        );
        assert_eq!(ck.load_f32("w.a").unwrap().1[5], 6.0);
        assert!(matches!(ck.load("nope"), Err(WeightError::Missing { .. })));
        assert!(matches!(
            ck.load_f32("nope"),
            Err(WeightError::Missing { .. })
        ));
    }

    #[test]
    fn truncated_file_is_an_error_naming_file_and_tensor() {
        let dir = tempfile::tempdir().unwrap();
        write_checkpoint(dir.path());
        let path = dir.path().join("model.safetensors");
        let bytes = std::fs::read(&path).unwrap();
        std::fs::write(&path, &bytes[..bytes.len() - 4]).unwrap();
        let err = SafetensorsCheckpoint::open(dir.path())
            .err()
            .expect("truncated file refused")
            .to_string();
        assert!(
            err.contains("model.safetensors") && (err.contains("truncated")),
            "{err}"
        );
        std::fs::write(&path, b"garbage").unwrap();
        assert!(SafetensorsCheckpoint::open(dir.path()).is_err());
        let empty = tempfile::tempdir().unwrap();
        assert!(
            SafetensorsCheckpoint::open(empty.path())
                .err()
                .unwrap()
                .to_string()
                .contains("no .safetensors")
        );
    }
}
