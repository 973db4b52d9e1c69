// SPDX-License-Identifier: MIT OR Apache-2.0
//! FP8 (E4M3) linear weights: how a checkpoint says it stores them ([`Fp8Scheme`], read from
//! `config.json`'s `quantization_config`), and the one in-memory form every scheme becomes
//! ([`Fp8Tensor`]), which the on-the-fly quantizer also produces.
//!
//! The in-memory form: the E4M3 bytes of the `[n, k]` weight, row-major, and f32 scales
//! `[ceil(n / block_rows), ceil(k / 128)]`, the weight being `e4m3 × scale` of its block.
//! `block_rows` is 128 (the block layout of the hub's FP8 checkpoints and of on-the-fly
//! quantization) or 1 (a scale per row and 128 columns: what per-channel scales, and stacks whose
//! parts' blocks do not line up, become). A per-tensor scale is the 128-row layout with every
//! block's scale equal. So one kernel family, which looks up a scale per 128 columns and
//! `block_rows` rows, serves every scheme.

use half::bf16;
use metrale_core::fp8::{e4m3_block_scale, e4m3_to_f32, f32_to_e4m3};
use serde_json::Value;

use crate::{HostTensor, WeightError};

/// Columns (inputs) per scale, in every scheme the engine runs.
pub const FP8_BLOCK: usize = 128;

/// How a checkpoint's scales cover its FP8 weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fp8Scales {
    /// One f32 per 128 x 128 block, `weight_scale_inv` `[ceil(n/128), ceil(k/128)]`
    /// (`quant_method: fp8` with `weight_block_size: [128, 128]`: Qwen3-*-FP8, DeepSeek-V3,
    /// MiniMax-M2; compressed-tensors `strategy: block`, `weight_scale`).
    Block,
    /// One f32 per output row, `weight_scale` `[n]` or `[n, 1]` (compressed-tensors
    /// `strategy: channel`; ModelOpt `FP8_PER_CHANNEL_PER_TOKEN`).
    Channel,
    /// One f32 for the tensor, `weight_scale` `[]` or `[1]` (compressed-tensors
    /// `strategy: tensor`; ModelOpt `FP8`).
    Tensor,
}

/// A checkpoint's FP8 weight scheme: the scales, the scale tensor's name, and the modules kept in
/// BF16. Activation settings (`activation_scheme`, `input_activations`, ModelOpt's
/// `input_scale`) are read past: the engine's products take bf16 activations.
#[derive(Clone, Debug, PartialEq)]
pub struct Fp8Scheme {
    /// How the scales cover the weight.
    pub scales: Fp8Scales,
    /// The scale tensor beside `<module>.weight`: `weight_scale_inv` or `weight_scale`.
    pub scale_name: &'static str,
    /// Modules the checkpoint keeps unquantized (`modules_to_not_convert`, `ignore`,
    /// `exclude_modules`): names, name suffixes, or `re:` patterns of `.*` and literals.
    pub not_converted: Vec<String>,
    /// The `quant_method`, for messages.
    pub method: String,
}

fn refuse(message: String) -> WeightError {
    WeightError::Quantization { message }
}

fn strings(v: Option<&Value>) -> Vec<String> {
    match v {
        Some(Value::Array(a)) => a
            .iter()
            .filter_map(Value::as_str)
            .map(String::from)
            .collect(),
        _ => Vec::new(),
    }
}

impl Fp8Scheme {
    /// The FP8 scheme `config.json` declares (`quantization_config`), `None` without one. A
    /// scheme the engine does not run (another method, another block size, an FP8 format other
    /// than E4M3, weights of other than 8 bits, different schemes for different modules) is an
    /// error naming what it found.
    pub fn from_config_json(text: &str) -> Result<Option<Fp8Scheme>, WeightError> {
        let value: Value = serde_json::from_str(text)
            .map_err(|e| refuse(format!("config.json is not JSON: {e}")))?;
        match value.get("quantization_config") {
            None | Some(Value::Null) => Ok(None),
            Some(q) => Fp8Scheme::from_quantization_config(q).map(Some),
        }
    }

    /// The scheme of one `quantization_config` object.
    pub fn from_quantization_config(q: &Value) -> Result<Fp8Scheme, WeightError> {
        let method = q
            .get("quant_method")
            .and_then(Value::as_str)
            .unwrap_or("(none)")
            .to_string();
        match method.as_str() {
            "fp8" => Self::finegrained(q, method),
            "compressed-tensors" => Self::compressed_tensors(q, method),
            "modelopt" => Self::modelopt(q, method),
            other => Err(refuse(format!(
                "quantization_config.quant_method `{other}` is not supported; the engine runs FP8 \
                 weights (`fp8` with 128x128 blocks, `compressed-tensors` float 8-bit per tensor, \
                 channel or 128x128 block, `modelopt` FP8) or unquantized checkpoints"
            ))),
        }
    }

    /// transformers' fine-grained FP8: `weight_block_size` `[128, 128]` (per-tensor without one).
    fn finegrained(q: &Value, method: String) -> Result<Fp8Scheme, WeightError> {
        if let Some(fmt) = q.get("fmt").and_then(Value::as_str)
            && fmt != "e4m3"
        {
            return Err(refuse(format!(
                "quantization_config.fmt `{fmt}`: only e4m3 FP8 weights are supported"
            )));
        }
        let scales = match q.get("weight_block_size") {
            None | Some(Value::Null) => Fp8Scales::Tensor,
            Some(b) if *b == serde_json::json!([128, 128]) => Fp8Scales::Block,
            Some(b) => {
                return Err(refuse(format!(
                    "quantization_config.weight_block_size {b}: only [128, 128] blocks are supported"
                )));
            }
        };
        Ok(Fp8Scheme {
            scale_name: match scales {
                Fp8Scales::Block => "weight_scale_inv",
                _ => "weight_scale",
            },
            scales,
            not_converted: strings(q.get("modules_to_not_convert")),
            method,
        })
    }

    /// compressed-tensors `float-quantized`: one config group of float 8-bit weights.
    fn compressed_tensors(q: &Value, method: String) -> Result<Fp8Scheme, WeightError> {
        let format = q.get("format").and_then(Value::as_str).unwrap_or("");
        if !matches!(format, "float-quantized" | "naive-quantized") {
            return Err(refuse(format!(
                "compressed-tensors format `{format}` is not supported (float-quantized only)"
            )));
        }
        let groups = q
            .get("config_groups")
            .and_then(Value::as_object)
            .filter(|g| !g.is_empty())
            .ok_or_else(|| refuse("compressed-tensors config without config_groups".into()))?;
        if groups.len() != 1 {
            return Err(refuse(format!(
                "compressed-tensors config with {} config_groups: one scheme for every module is \
                 supported",
                groups.len()
            )));
        }
        let (name, group) = groups.iter().next().expect("one group");
        let w = group
            .get("weights")
            .ok_or_else(|| refuse(format!("config group `{name}` has no `weights`")))?;
        let field = |k: &str| w.get(k).cloned().unwrap_or(Value::Null);
        if field("type") != "float" || field("num_bits") != 8 {
            return Err(refuse(format!(
                "config group `{name}` weights are type {} with {} bits: only float 8-bit (FP8 \
                 E4M3) weights are supported",
                field("type"),
                field("num_bits")
            )));
        }
        if field("dynamic") == true {
            return Err(refuse(format!(
                "config group `{name}` quantizes weights dynamically: stored scales are needed"
            )));
        }
        let strategy = field("strategy");
        let scales = match strategy.as_str() {
            Some("tensor") => Fp8Scales::Tensor,
            Some("channel") => Fp8Scales::Channel,
            Some("block") if field("block_structure") == serde_json::json!([128, 128]) => {
                Fp8Scales::Block
            }
            _ => {
                return Err(refuse(format!(
                    "config group `{name}` weight strategy {strategy} (block_structure {}): \
                     tensor, channel and 128x128 block are supported",
                    field("block_structure")
                )));
            }
        };
        Ok(Fp8Scheme {
            scales,
            scale_name: "weight_scale",
            not_converted: strings(q.get("ignore")),
            method,
        })
    }

    /// NVIDIA ModelOpt: `quant_algo` `FP8` (per tensor) or `FP8_PER_CHANNEL_PER_TOKEN`.
    fn modelopt(q: &Value, method: String) -> Result<Fp8Scheme, WeightError> {
        // hf_quant_config.json nests the fields under `quantization`; config.json has them flat.
        let q = q.get("quantization").unwrap_or(q);
        let algo = q.get("quant_algo").and_then(Value::as_str).unwrap_or("");
        let scales = match algo {
            "FP8" => Fp8Scales::Tensor,
            "FP8_PER_CHANNEL_PER_TOKEN" => Fp8Scales::Channel,
            other => {
                return Err(refuse(format!(
                    "ModelOpt quant_algo `{other}` is not supported (FP8, \
                     FP8_PER_CHANNEL_PER_TOKEN)"
                )));
            }
        };
        let mut not_converted = strings(q.get("exclude_modules"));
        not_converted.extend(strings(q.get("ignore")));
        Ok(Fp8Scheme {
            scales,
            scale_name: "weight_scale",
            not_converted,
            method,
        })
    }

    /// Whether the checkpoint stores module `module` (`model.layers.0.self_attn.q_proj`) in FP8:
    /// not when a not-converted entry names it, is a dotted suffix of it or (transformers'
    /// rule for `modules_to_not_convert`) a substring of it, or is a `re:` pattern matching it.
    pub fn converts(&self, module: &str) -> bool {
        !self
            .not_converted
            .iter()
            .any(|entry| match entry.strip_prefix("re:") {
                Some(pattern) => pattern_matches(pattern, module),
                None => module.contains(entry.as_str()),
            })
    }

    /// Refuses `re:` patterns [`Fp8Scheme::converts`] cannot read (anything but `.*` and
    /// literal characters, `\.` for a dot, and a final `$`).
    pub fn check_patterns(&self) -> Result<(), WeightError> {
        for entry in &self.not_converted {
            if let Some(p) = entry.strip_prefix("re:") {
                let literal = p
                    .replace(".*", "")
                    .replace("\\.", "")
                    .trim_end_matches('$')
                    .to_string();
                if literal.chars().any(|c| "^$()[]{}|+?\\".contains(c)) {
                    return Err(refuse(format!(
                        "not-converted pattern `{entry}`: only `.*`, `\\.`, literals and a final \
                         `$` are read"
                    )));
                }
            }
        }
        Ok(())
    }
}

/// `pattern` (`.*` wildcards, `\.` or `.` for a dot, a final `$` anchoring the end) against the
/// start of `name`, as Python's `re.match` does.
fn pattern_matches(pattern: &str, name: &str) -> bool {
    let anchored = pattern.ends_with('$');
    let pattern = pattern.trim_end_matches('$').replace("\\.", ".");
    let pieces: Vec<&str> = pattern.split(".*").collect();
    let mut rest = name;
    for (i, piece) in pieces.iter().enumerate() {
        let last = i + 1 == pieces.len();
        if i == 0 {
            let Some(r) = rest.strip_prefix(piece) else {
                return false;
            };
            rest = r;
            if last {
                return !anchored || rest.is_empty();
            }
            continue;
        }
        if last && anchored {
            return rest.ends_with(piece);
        }
        match rest.find(piece) {
            Some(at) => rest = &rest[at + piece.len()..],
            None => return false,
        }
    }
    true
}

/// An `[n, k]` linear weight in E4M3 with f32 scales (the module docs give the layout).
#[derive(Clone, Debug, PartialEq)]
pub struct Fp8Tensor {
    /// Output rows.
    pub n: usize,
    /// Inputs.
    pub k: usize,
    /// E4M3 bytes, `[n, k]` row-major.
    pub data: Vec<u8>,
    /// f32 `[ceil(n / block_rows), ceil(k / 128)]`.
    pub scales: Vec<f32>,
    /// Rows per scale: 128 or 1.
    pub block_rows: usize,
}

impl Fp8Tensor {
    /// Columns of the scale grid.
    pub fn scale_cols(&self) -> usize {
        self.k.div_ceil(FP8_BLOCK)
    }

    /// log2 of `block_rows` (the kernels' `scale_row_shift`).
    pub fn row_shift(&self) -> u32 {
        self.block_rows.trailing_zeros()
    }

    /// The scale of element `(r, c)`.
    pub fn scale(&self, r: usize, c: usize) -> f32 {
        self.scales[r / self.block_rows * self.scale_cols() + c / FP8_BLOCK]
    }

    /// Quantizes a BF16 `[n, k]` weight in 128 x 128 blocks: each block's scale is its largest
    /// magnitude / 448 (so that value maps to E4M3's largest), each element `e4m3(x / scale)`,
    /// rounded to nearest even. An all-zero block gets scale 1. A NaN or infinite weight is
    /// refused (its block would have no meaningful scale), naming the tensor's position.
    pub fn quantize(t: &HostTensor) -> Result<Fp8Tensor, String> {
        let [n, k] = t.shape[..] else {
            return Err(format!("shape {:?} is not a matrix", t.shape));
        };
        let (rb, cb) = (n.div_ceil(FP8_BLOCK), k.div_ceil(FP8_BLOCK));
        let mut scales = vec![0f32; rb * cb];
        let mut data = vec![0u8; n * k];
        if n == 0 || k == 0 {
            return Ok(Fp8Tensor {
                n,
                k,
                data,
                scales,
                block_rows: FP8_BLOCK,
            });
        }
        // The 128-row bands are independent (their own scales, their own rows): spread over the
        // machine's threads, a band at a time (an 8B model's linears take tens of seconds on
        // one core). The result does not depend on the split.
        let threads = std::thread::available_parallelism()
            .map_or(1, |p| p.get())
            .min(rb.max(1));
        let bands_per = rb.div_ceil(threads.max(1)).max(1);
        let band = FP8_BLOCK * k;
        let results: Vec<Result<(), String>> = std::thread::scope(|scope| {
            let workers: Vec<_> = scales
                .chunks_mut(bands_per * cb)
                .zip(data.chunks_mut(bands_per * band))
                .zip(t.data.chunks(bands_per * band))
                .enumerate()
                .map(|(i, ((scales, out), src))| {
                    scope.spawn(move || {
                        quantize_bands(src, out, scales, k, i * bands_per * FP8_BLOCK)
                    })
                })
                .collect();
            workers
                .into_iter()
                .map(|w| {
                    w.join()
                        .unwrap_or_else(|_| Err("a quantizing thread panicked".into()))
                })
                .collect()
        });
        results.into_iter().collect::<Result<(), String>>()?;
        Ok(Fp8Tensor {
            n,
            k,
            data,
            scales,
            block_rows: FP8_BLOCK,
        })
    }

    /// A stored weight and its scales in `scheme`'s layout (`scales` as the file holds them,
    /// shape `scale_shape`), checked against the weight's shape.
    pub fn from_stored(
        (n, k): (usize, usize),
        data: Vec<u8>,
        scales: Vec<f32>,
        scale_shape: &[usize],
        kind: Fp8Scales,
    ) -> Result<Fp8Tensor, String> {
        let cb = k.div_ceil(FP8_BLOCK);
        let bad = || {
            format!(
                "scale shape {scale_shape:?} does not fit {kind:?} scales of a [{n}, {k}] weight"
            )
        };
        let (scales, block_rows) = match kind {
            Fp8Scales::Block => {
                if scale_shape != [n.div_ceil(FP8_BLOCK), cb] {
                    return Err(bad());
                }
                (scales, FP8_BLOCK)
            }
            Fp8Scales::Channel => {
                if scales.len() != n || !matches!(scale_shape, [_] | [_, 1]) {
                    return Err(bad());
                }
                let per_row = scales
                    .iter()
                    .flat_map(|&s| std::iter::repeat_n(s, cb))
                    .collect();
                (per_row, 1)
            }
            Fp8Scales::Tensor => {
                if scales.len() != 1 {
                    return Err(bad());
                }
                (vec![scales[0]; n.div_ceil(FP8_BLOCK) * cb], FP8_BLOCK)
            }
        };
        if let Some(s) = scales.iter().find(|s| !s.is_finite()) {
            return Err(format!("scale {s} is not finite"));
        }
        if data.len() != n * k {
            return Err(format!("{} bytes for a [{n}, {k}] weight", data.len()));
        }
        Ok(Fp8Tensor {
            n,
            k,
            data,
            scales,
            block_rows,
        })
    }

    /// The weight as BF16 (each element `e4m3 × scale`, rounded once).
    pub fn dequantize(&self) -> HostTensor {
        let data = (0..self.n * self.k)
            .map(|i| {
                let (r, c) = (i / self.k, i % self.k);
                bf16::from_f32(e4m3_to_f32(self.data[i]) * self.scale(r, c))
            })
            .collect();
        HostTensor {
            shape: vec![self.n, self.k],
            data,
        }
    }

    /// The same scales one per row (`block_rows` 1).
    fn per_row(self) -> Fp8Tensor {
        if self.block_rows == 1 {
            return self;
        }
        let cb = self.scale_cols();
        let scales = (0..self.n)
            .flat_map(|r| {
                let at = r / self.block_rows * cb;
                self.scales[at..at + cb].to_vec()
            })
            .collect();
        Fp8Tensor {
            scales,
            block_rows: 1,
            ..self
        }
    }

    /// Tensors of the same `k` stacked along their rows (q|k|v, gate|up): the 128-row layout
    /// when every part has it and every part but the last fills whole 128-row blocks, else a
    /// scale per row (the same values either way).
    pub fn stack(parts: Vec<Fp8Tensor>) -> Fp8Tensor {
        let aligned = parts.iter().all(|p| p.block_rows == FP8_BLOCK)
            && parts[..parts.len() - 1]
                .iter()
                .all(|p| p.n.is_multiple_of(FP8_BLOCK));
        let parts: Vec<Fp8Tensor> = if aligned {
            parts
        } else {
            parts.into_iter().map(Fp8Tensor::per_row).collect()
        };
        let mut out = Fp8Tensor {
            n: 0,
            k: parts[0].k,
            data: Vec::new(),
            scales: Vec::new(),
            block_rows: parts[0].block_rows,
        };
        for p in parts {
            assert_eq!(p.k, out.k, "stacked FP8 weights share k");
            out.n += p.n;
            out.data.extend(p.data);
            out.scales.extend(p.scales);
        }
        out
    }
}

/// [`Fp8Tensor::quantize`] over whole 128-row bands: `src` and `out` are the bands' elements
/// (`[rows, k]`, rows a multiple of 128 but for the last band), `scales` their scale rows;
/// `first_row` names positions in errors.
fn quantize_bands(
    src: &[bf16],
    out: &mut [u8],
    scales: &mut [f32],
    k: usize,
    first_row: usize,
) -> Result<(), String> {
    let cb = k.div_ceil(FP8_BLOCK);
    for (i, v) in src.iter().enumerate() {
        let x = f32::from(*v);
        if !x.is_finite() {
            return Err(format!("element ({}, {}) is {x}", first_row + i / k, i % k));
        }
        let s = &mut scales[i / k / FP8_BLOCK * cb + i % k / FP8_BLOCK];
        *s = s.max(x.abs());
    }
    for s in scales.iter_mut() {
        *s = e4m3_block_scale(*s);
    }
    for (i, (v, o)) in src.iter().zip(out.iter_mut()).enumerate() {
        let s = scales[i / k / FP8_BLOCK * cb + i % k / FP8_BLOCK];
        *o = f32_to_e4m3(f32::from(*v) / s);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tensor(n: usize, k: usize, f: impl Fn(usize, usize) -> f32) -> HostTensor {
        HostTensor {
            shape: vec![n, k],
            data: (0..n * k)
                .map(|i| bf16::from_f32(f(i / k, i % k)))
                .collect(),
        }
    }

    #[test]
    fn block_scale_is_the_block_amax_over_448_and_representable_values_survive() {
        // Block (0, 0) holds E4M3 values times 2 (exact after dividing by its scale, 2.0: amax
        // 896 = 448 x 2); block (0, 1) is all zero; block (1, 0) has amax 3.
        let t = tensor(130, 200, |r, c| match (r / 128, c / 128) {
            (0, 0) => {
                e4m3_to_f32(((r * 7 + c) % 0x7F) as u8) * 2.0 * if c % 2 == 0 { 1.0 } else { -1.0 }
            }
            (0, 1) => 0.0,
            _ if (r, c) == (129, 5) => -3.0,
            _ => ((r + c) % 4) as f32 - 1.0,
        });
        let q = Fp8Tensor::quantize(&t).unwrap();
        assert_eq!((q.n, q.k, q.block_rows, q.scale_cols()), (130, 200, 128, 2));
        let amax = (0..128 * 128)
            .map(|i| f32::from(t.data[i / 128 * 200 + i % 128]).abs())
            .fold(0.0, f32::max);
        assert_eq!(q.scales[0], amax / 448.0);
        assert_eq!(q.scales[0], 2.0);
        assert_eq!(q.scales[1], 1.0, "an all-zero block has scale 1");
        assert_eq!(q.scales[2], 3.0 / 448.0);
        let back = q.dequantize();
        for r in 0..128 {
            for c in 0..128 {
                assert_eq!(
                    back.data[r * 200 + c],
                    t.data[r * 200 + c],
                    "({r}, {c}) exact"
                );
            }
        }
        // Elsewhere within e4m3's half unit (1/16 relative) of the block's value, or of the
        // smallest subnormal step times the scale.
        for (i, (b, a)) in back.data.iter().zip(&t.data).enumerate() {
            let (a, b) = (f32::from(*a), f32::from(*b));
            let s = q.scale(i / 200, i % 200);
            assert!(
                (a - b).abs() <= a.abs() / 16.0 + s / 1024.0 + a.abs() / 256.0,
                "{i}: {a} {b}"
            );
        }
    }

    #[test]
    fn nan_and_infinity_are_refused() {
        for bad in [f32::NAN, f32::INFINITY] {
            let t = tensor(4, 4, |r, c| if (r, c) == (2, 3) { bad } else { 1.0 });
            let err = Fp8Tensor::quantize(&t).unwrap_err();
            assert!(err.contains("(2, 3)"), "{err}");
        }
    }

    #[test]
    fn stored_layouts_become_the_same_form_and_stacks_keep_values() {
        let data: Vec<u8> = (0..(200 * 130)).map(|i| (i % 0x7E) as u8).collect();
        let block = Fp8Tensor::from_stored(
            (200, 130),
            data.clone(),
            vec![1.0, 2.0, 3.0, 4.0],
            &[2, 2],
            Fp8Scales::Block,
        )
        .unwrap();
        assert_eq!(block.scale(199, 129), 4.0);
        assert_eq!(block.scale(127, 129), 2.0);
        let channel = Fp8Tensor::from_stored(
            (200, 130),
            data.clone(),
            (0..200).map(|r| r as f32).collect(),
            &[200, 1],
            Fp8Scales::Channel,
        )
        .unwrap();
        assert_eq!((channel.block_rows, channel.scale(7, 129)), (1, 7.0));
        let tensor =
            Fp8Tensor::from_stored((200, 130), data.clone(), vec![0.5], &[], Fp8Scales::Tensor)
                .unwrap();
        assert_eq!((tensor.block_rows, tensor.scale(199, 0)), (128, 0.5));
        assert!(
            Fp8Tensor::from_stored(
                (200, 130),
                data.clone(),
                vec![1.0; 4],
                &[1, 4],
                Fp8Scales::Block
            )
            .is_err()
        );
        // 200 rows are not whole blocks: the stack after them takes a scale per row.
        let values = |t: &Fp8Tensor| t.dequantize().data;
        let stacked = Fp8Tensor::stack(vec![block.clone(), tensor.clone()]);
        assert_eq!(stacked.block_rows, 1);
        assert_eq!(values(&stacked), [values(&block), values(&tensor)].concat());
        // Whole blocks first: the 128-row layout stays.
        let whole = Fp8Tensor::from_stored(
            (128, 130),
            data[..128 * 130].to_vec(),
            vec![1.0, 2.0],
            &[1, 2],
            Fp8Scales::Block,
        )
        .unwrap();
        let stacked = Fp8Tensor::stack(vec![whole.clone(), block.clone()]);
        assert_eq!(stacked.block_rows, 128);
        assert_eq!(values(&stacked), [values(&whole), values(&block)].concat());
    }

    #[test]
    fn schemes_of_each_format() {
        let finegrained = r#"{"model_type":"qwen3","quantization_config":{"activation_scheme":"dynamic",
            "fmt":"e4m3","quant_method":"fp8","weight_block_size":[128,128],
            "modules_to_not_convert":["lm_head","model.layers.3.mlp.gate"]}}"#;
        let s = Fp8Scheme::from_config_json(finegrained).unwrap().unwrap();
        assert_eq!(
            (s.scales, s.scale_name),
            (Fp8Scales::Block, "weight_scale_inv")
        );
        assert!(s.converts("model.layers.0.self_attn.q_proj"));
        assert!(!s.converts("lm_head"));
        assert!(!s.converts("model.layers.3.mlp.gate"));
        let ct = r#"{"quantization_config":{"quant_method":"compressed-tensors","format":"float-quantized",
            "config_groups":{"group_0":{"targets":["Linear"],"weights":{"type":"float","num_bits":8,
            "strategy":"channel","symmetric":true,"dynamic":false},"input_activations":{"type":"float",
            "num_bits":8,"strategy":"token","dynamic":true}}},"ignore":["lm_head","re:.*mlp.gate$"]}}"#;
        let s = Fp8Scheme::from_config_json(ct).unwrap().unwrap();
        assert_eq!(
            (s.scales, s.scale_name),
            (Fp8Scales::Channel, "weight_scale")
        );
        assert!(!s.converts("model.layers.1.mlp.gate"));
        assert!(s.converts("model.layers.1.mlp.gate_proj"));
        s.check_patterns().unwrap();
        let tensor = ct.replace("\"channel\"", "\"tensor\"");
        assert_eq!(
            Fp8Scheme::from_config_json(&tensor)
                .unwrap()
                .unwrap()
                .scales,
            Fp8Scales::Tensor
        );
        let modelopt = r#"{"quantization_config":{"quant_method":"modelopt","quant_algo":"FP8",
            "kv_cache_quant_algo":null,"exclude_modules":["lm_head"]}}"#;
        let s = Fp8Scheme::from_config_json(modelopt).unwrap().unwrap();
        assert_eq!(
            (s.scales, s.scale_name),
            (Fp8Scales::Tensor, "weight_scale")
        );
        assert!(!s.converts("lm_head") && s.converts("model.layers.0.mlp.down_proj"));
        assert_eq!(
            Fp8Scheme::from_config_json(r#"{"model_type":"qwen3"}"#).unwrap(),
            None
        );
    }

    #[test]
    fn unknown_schemes_are_refused_by_name() {
        for (text, want) in [
            (
                r#"{"quantization_config":{"quant_method":"awq","bits":4}}"#,
                "`awq`",
            ),
            (
                r#"{"quantization_config":{"quant_method":"fp8","weight_block_size":[64,64]}}"#,
                "[64,64]",
            ),
            (
                r#"{"quantization_config":{"quant_method":"fp8","fmt":"e5m2","weight_block_size":[128,128]}}"#,
                "e5m2",
            ),
            (
                r#"{"quantization_config":{"quant_method":"compressed-tensors","format":"pack-quantized","config_groups":{}}}"#,
                "pack-quantized",
            ),
            (
                r#"{"quantization_config":{"quant_method":"compressed-tensors","format":"float-quantized",
                "config_groups":{"g":{"weights":{"type":"int","num_bits":4,"strategy":"group"}}}}}"#,
                "bits",
            ),
            (
                r#"{"quantization_config":{"quant_method":"modelopt","quant_algo":"NVFP4"}}"#,
                "NVFP4",
            ),
        ] {
            let err = Fp8Scheme::from_config_json(text).unwrap_err().to_string();
            assert!(err.contains(want), "{want}: {err}");
        }
        let s = Fp8Scheme {
            scales: Fp8Scales::Tensor,
            scale_name: "weight_scale",
            not_converted: vec!["re:model\\.layers\\.(0|1)\\.mlp".into()],
            method: "compressed-tensors".into(),
        };
        assert!(s.check_patterns().is_err());
    }

    #[test]
    fn patterns_match_as_python_re_match() {
        assert!(pattern_matches(".*mlp.gate$", "model.layers.1.mlp.gate"));
        assert!(!pattern_matches(
            ".*mlp.gate$",
            "model.layers.1.mlp.gate_proj"
        ));
        assert!(pattern_matches(
            ".*self_attn.*",
            "model.layers.1.self_attn.q_proj"
        ));
        assert!(pattern_matches("lm_head", "lm_head"));
        assert!(!pattern_matches("head", "lm_head"));
    }

    #[test]
    fn quantizing_in_threads_gives_the_one_thread_result() {
        // Three bands and a partial one, columns not a multiple of 128, values over many binades.
        let (n, k) = (3 * 128 + 5, 200);
        let data: Vec<bf16> = (0..n * k)
            .map(|i| {
                let x = ((i * 2654435761usize) % 1000) as f32 / 1000.0 - 0.5;
                bf16::from_f32(x * (1 << (i % 7)) as f32)
            })
            .collect();
        let t = HostTensor {
            shape: vec![n, k],
            data: data.clone(),
        };
        let q = Fp8Tensor::quantize(&t).unwrap();
        let mut out = vec![0u8; n * k];
        let mut scales = vec![0f32; n.div_ceil(128) * k.div_ceil(128)];
        quantize_bands(&data, &mut out, &mut scales, k, 0).unwrap();
        assert_eq!(q.data, out);
        assert_eq!(q.scales, scales);
        let empty = HostTensor {
            shape: vec![0, 7],
            data: vec![],
        };
        assert!(Fp8Tensor::quantize(&empty).unwrap().data.is_empty());
    }
}
