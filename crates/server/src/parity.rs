// SPDX-License-Identifier: MIT OR Apache-2.0
//! `met parity`: the engine's logits against a reference file from `transformers`
//! (scripts/gpu/reference_logits.py), position by position, with teacher forcing.
//!
//! The reference holds a prompt and its logits at every position, a greedy continuation and its
//! logits (step i fed `decode_ids[i]` at position P + i), and optionally a long prompt with logits
//! at a few positions. The engine runs the same tokens (the prompt as one prefill with logits for
//! every row, then the reference's decode tokens one step at a time, then the long prompt as a
//! second sequence) and reports ‖out − ref‖ / ‖ref‖ and the max absolute error per row.
//!
//! The reference's metadata names the dtype transformers computed in. A bfloat16 reference holds
//! bf16 logits widened to f32 (its LM head runs in the model's dtype), so the engine's f32 logits
//! are rounded to bf16 the same way before the comparison, so that the metric measures the model,
//! not the output format; a float32 reference (the f32 function of the same bf16 weights, the one
//! docs/precision.md judges the engine against) is compared as it is.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, bail};
use metrale_cache::{BlockAllocator, BlockTable, DEFAULT_BLOCK_SIZE};
use metrale_model_engine::{Model, ModelOptions, StepInput};
use safetensors::{Dtype, SafeTensors};

use crate::load::{self, ModelArgs};

/// Options of `met parity`.
#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    /// The reference file written by scripts/gpu/reference_logits.py.
    #[arg(long)]
    reference: PathBuf,
    /// Largest ‖out − ref‖ / ‖ref‖ allowed at any position.
    #[arg(long, default_value_t = 1e-2)]
    tolerance: f64,
    /// Write the per-position errors as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Write the experts every MoE layer chose at every position as JSON here (a MoE model;
    /// decode steps then run without graphs): `{"prefill" | "long-prefill": [layer][position]
    /// [slot], "decode": [step][layer][slot]}`, for scripts/gpu/moe_route_flips.py.
    #[arg(long)]
    routing_out: Option<PathBuf>,
    /// Override one schedule choice, as key=value (repeatable), as `met generate --tune`: to
    /// check a path's parity before it becomes a default.
    #[arg(long = "tune", value_name = "KEY=VALUE")]
    tune: Vec<String>,
}

struct Tensor {
    shape: Vec<usize>,
    f32s: Vec<f32>,
    i32s: Vec<i32>,
}

/// The reference's tensors, and the dtype its metadata says transformers computed in.
fn read_reference(path: &PathBuf) -> anyhow::Result<(BTreeMap<String, Tensor>, Option<String>)> {
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let (_, meta) = SafeTensors::read_metadata(&bytes)
        .with_context(|| format!("parsing {}", path.display()))?;
    let dtype = meta
        .metadata()
        .as_ref()
        .and_then(|m| m.get("dtype").cloned());
    let st =
        SafeTensors::deserialize(&bytes).with_context(|| format!("parsing {}", path.display()))?;
    let mut out = BTreeMap::new();
    for (name, view) in st.tensors() {
        let data = view.data();
        let (f32s, i32s) = match view.dtype() {
            Dtype::F32 => (
                data.chunks_exact(4)
                    .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                    .collect(),
                vec![],
            ),
            Dtype::I32 => (
                vec![],
                data.chunks_exact(4)
                    .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
                    .collect(),
            ),
            Dtype::I64 => (
                vec![],
                data.chunks_exact(8)
                    .map(|c| i64::from_le_bytes(c.try_into().unwrap()) as i32)
                    .collect(),
            ),
            other => bail!(
                "{}: tensor {name} has dtype {other:?}; expected F32 or I32",
                path.display()
            ),
        };
        out.insert(
            name,
            Tensor {
                shape: view.shape().to_vec(),
                f32s,
                i32s,
            },
        );
    }
    Ok((out, dtype))
}

/// ‖a − b‖ / ‖b‖ and max |a − b|, with `a` first rounded to bf16 when `round` (a bf16 reference).
fn errors(a: &[f32], b: &[f32], round: bool) -> (f64, f64) {
    let (mut d2, mut r2, mut max) = (0f64, 0f64, 0f64);
    for (x, y) in a.iter().zip(b) {
        let x = if round {
            f32::from(half::bf16::from_f32(*x))
        } else {
            *x
        };
        let d = (x as f64 - *y as f64).abs();
        d2 += d * d;
        r2 += (*y as f64) * (*y as f64);
        max = max.max(d);
    }
    ((d2 / r2.max(f64::MIN_POSITIVE)).sqrt(), max)
}

fn argmax(row: &[f32]) -> usize {
    row.iter()
        .enumerate()
        .fold((0, f32::NEG_INFINITY), |best, (i, &v)| {
            if v > best.1 { (i, v) } else { best }
        })
        .0
}

#[derive(serde::Serialize)]
struct Row {
    phase: &'static str,
    position: usize,
    rel: f64,
    max_abs: f64,
    argmax_matches: bool,
    /// The same metric for transformers' own bf16 run against this reference, when the file
    /// holds one (reference_logits.py --also-bf16).
    transformers_bf16_rel: Option<f64>,
}

/// Runs `met parity`.
pub fn run(args: &Args) -> anyhow::Result<ExitCode> {
    let (reference, ref_dtype) = read_reference(&args.reference)?;
    let round = ref_dtype.as_deref() != Some("float32");
    // transformers' bf16 logits for row `i` of tensor `name`, measured against the reference.
    let peer = |name: &str, i: usize, theirs: &[f32]| -> Option<f64> {
        let t = reference.get(&format!("{name}_bf16"))?;
        let v = theirs.len();
        let row = t.f32s.get(i * v..(i + 1) * v)?;
        Some(errors(row, theirs, false).0)
    };
    eprintln!(
        "met: reference computed in {}; engine logits {}",
        ref_dtype
            .as_deref()
            .unwrap_or("an unrecorded dtype (taken as bfloat16)"),
        if round {
            "rounded to bf16 before comparing"
        } else {
            "compared as f32"
        }
    );
    let get = |name: &str| {
        reference
            .get(name)
            .with_context(|| format!("{} has no tensor `{name}`", args.reference.display()))
    };
    let prompt: Vec<u32> = get("prompt_ids")?.i32s.iter().map(|&v| v as u32).collect();
    let prompt_logits = get("prompt_logits")?;
    let decode_ids: Vec<u32> = get("decode_ids")?.i32s.iter().map(|&v| v as u32).collect();
    let decode_logits = get("decode_logits")?;
    let long = reference
        .get("long_prompt_ids")
        .map(|t| t.i32s.iter().map(|&v| v as u32).collect::<Vec<u32>>());

    let (checkpoint, config, references) = load::open_checkpoint(&args.model)?;
    let placement = load::place(&args.model, &config, references)?;
    eprintln!("met: {}", placement.description);
    let vocab = config.vocab_size;
    if prompt_logits.shape.last() != Some(&vocab) {
        bail!(
            "reference logits have shape {:?}, the model's vocabulary is {vocab}",
            prompt_logits.shape
        );
    }
    let long_len = long.as_ref().map_or(0, Vec::len);
    let max_seq_len = (prompt.len() + decode_ids.len()).max(long_len) + 1;
    let block_size = DEFAULT_BLOCK_SIZE;
    let blocks_per_seq = max_seq_len.div_ceil(block_size);
    let options = ModelOptions {
        kv_cache: args.model.kv_cache_dtype,
        max_tokens_per_step: prompt.len().max(long_len),
        max_seqs: 1,
        max_logit_rows: prompt.len().max(8),
        max_seq_len,
        num_blocks: 2 * blocks_per_seq,
        block_size,
        state_slots: 1,
    };
    let tuning = crate::load::tuning(&placement, &args.tune)?;
    let mut model = Model::load_with(
        config.clone(),
        checkpoint.source(),
        placement.gpu.clone(),
        options,
        tuning,
        &checkpoint.linear_format(&args.model),
        &mut |_, _, _| {},
    )?;
    eprintln!("met: {}", model.kv_cache_scales());
    let mut allocator = BlockAllocator::new(options.num_blocks);
    let mut rows: Vec<Row> = Vec::new();
    let capture = args.routing_out.is_some();
    model.set_routing_capture(capture)?;
    let mut routing = serde_json::Map::new();
    // [layer][position][slot] of the last step's `n` rows.
    let by_position = |model: &Model, n: usize| -> anyhow::Result<serde_json::Value> {
        let layers = model.captured_routing(n)?;
        let k = layers.first().map_or(1, |l| l.len() / n.max(1)).max(1);
        Ok(serde_json::json!(
            layers
                .iter()
                .map(|l| l.chunks(k).map(<[i32]>::to_vec).collect::<Vec<_>>())
                .collect::<Vec<_>>()
        ))
    };

    let mut table = BlockTable::default();
    table.reserve(prompt.len() + decode_ids.len(), block_size, &mut allocator)?;
    let positions: Vec<u32> = (0..prompt.len() as u32).collect();
    let all_rows: Vec<usize> = (0..prompt.len()).collect();
    let seq = vec![0u32; prompt.len()];
    let logits = model.forward(&StepInput {
        tokens: &prompt,
        positions: &positions,
        token_seq: &seq,
        block_tables: &[&table],
        logit_rows: &all_rows,
        state_slots: model.solo_state_slot(),
    })?;
    if capture {
        routing.insert("prefill".into(), by_position(&model, prompt.len())?);
    }
    let mut decode_routing = Vec::new();
    for p in 0..prompt.len() {
        let (ours, theirs) = (
            &logits[p * vocab..(p + 1) * vocab],
            &prompt_logits.f32s[p * vocab..(p + 1) * vocab],
        );
        let (rel, max_abs) = errors(ours, theirs, round);
        rows.push(Row {
            phase: "prefill",
            position: p,
            rel,
            max_abs,
            argmax_matches: argmax(ours) == argmax(theirs),
            transformers_bf16_rel: peer("prompt_logits", p, theirs),
        });
    }
    // Step i feeds the reference's decode_ids[i] at position P + i (teacher forcing).
    for (i, &id) in decode_ids.iter().enumerate() {
        let pos = (prompt.len() + i) as u32;
        let logits = model.forward(&StepInput {
            tokens: &[id],
            positions: &[pos],
            token_seq: &[0],
            block_tables: &[&table],
            logit_rows: &[0],
            state_slots: model.solo_state_slot(),
        })?;
        if capture {
            decode_routing.push(serde_json::json!(model.captured_routing(1)?));
        }
        let theirs = &decode_logits.f32s[i * vocab..(i + 1) * vocab];
        let (rel, max_abs) = errors(&logits, theirs, round);
        rows.push(Row {
            phase: "decode",
            position: pos as usize,
            rel,
            max_abs,
            argmax_matches: argmax(&logits) == argmax(theirs),
            transformers_bf16_rel: peer("decode_logits", i, theirs),
        });
    }
    table.release(&mut allocator)?;
    if let Some(long) = &long {
        let long_positions: Vec<usize> = get("long_positions")?
            .i32s
            .iter()
            .map(|&v| v as usize)
            .collect();
        let long_logits = get("long_logits")?;
        let mut table = BlockTable::default();
        table.reserve(long.len(), block_size, &mut allocator)?;
        let positions: Vec<u32> = (0..long.len() as u32).collect();
        let seq = vec![0u32; long.len()];
        let logits = model.forward(&StepInput {
            tokens: long,
            positions: &positions,
            token_seq: &seq,
            block_tables: &[&table],
            logit_rows: &long_positions,
            state_slots: model.solo_state_slot(),
        })?;
        if capture {
            routing.insert("long-prefill".into(), by_position(&model, long.len())?);
        }
        for (i, &p) in long_positions.iter().enumerate() {
            let (ours, theirs) = (
                &logits[i * vocab..(i + 1) * vocab],
                &long_logits.f32s[i * vocab..(i + 1) * vocab],
            );
            let (rel, max_abs) = errors(ours, theirs, round);
            rows.push(Row {
                phase: "long-prefill",
                position: p,
                rel,
                max_abs,
                argmax_matches: argmax(ours) == argmax(theirs),
                transformers_bf16_rel: peer("long_logits", i, theirs),
            });
        }
        table.release(&mut allocator)?;
    }

    println!(
        "parity: {} against {}",
        args.model
            .model_from_path
            .as_ref()
            .map_or(String::new(), |p| p.display().to_string()),
        args.reference.display()
    );
    println!(
        "| phase | positions | max rel err | mean rel err | max abs err | argmax agree | transformers bf16: max (mean) rel err |"
    );
    println!("|---|---|---|---|---|---|---|");
    let mut worst = 0f64;
    for phase in ["prefill", "decode", "long-prefill"] {
        let r: Vec<&Row> = rows.iter().filter(|r| r.phase == phase).collect();
        if r.is_empty() {
            continue;
        }
        let max_rel = r.iter().map(|r| r.rel).fold(0.0, f64::max);
        worst = worst.max(max_rel);
        let peer: Vec<f64> = r.iter().filter_map(|r| r.transformers_bf16_rel).collect();
        let peer = if peer.is_empty() {
            "-".to_string()
        } else {
            format!(
                "{:.3e} ({:.3e})",
                peer.iter().copied().fold(0.0, f64::max),
                peer.iter().sum::<f64>() / peer.len() as f64
            )
        };
        println!(
            "| {phase} | {} | {max_rel:.3e} | {:.3e} | {:.3e} | {}/{} | {peer} |",
            r.len(),
            r.iter().map(|r| r.rel).sum::<f64>() / r.len() as f64,
            r.iter().map(|r| r.max_abs).fold(0.0, f64::max),
            r.iter().filter(|r| r.argmax_matches).count(),
            r.len()
        );
    }
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&rows)?)?;
    }
    if let Some(path) = &args.routing_out {
        routing.insert("decode".into(), serde_json::Value::Array(decode_routing));
        std::fs::write(path, serde_json::to_string(&routing)?)?;
    }
    let pass = worst <= args.tolerance;
    println!(
        "parity: worst ‖out−ref‖/‖ref‖ = {worst:.3e} (tolerance {:.0e}): {}",
        args.tolerance,
        if pass { "PASS" } else { "FAIL" }
    );
    Ok(if pass {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}
