// SPDX-License-Identifier: MIT OR Apache-2.0
//! `met bench-model`: the model-level rows of the speed table, measured through the model's step
//! exactly as the server runs a greedy batch (step inputs uploaded, decode steps replayed from
//! their CUDA graph, the argmax of each row taken on the device and copied back).
//!
//! - prefill: time to first logits for a prompt of P tokens (one step, logits of the last row);
//! - decode: the time of one decode step at batch B, every sequence holding C cached tokens,
//!   against the step's memory floor (every weight byte once, plus every cached K/V byte the
//!   step attends to, over the measured read bandwidth; an untied input embedding is not counted,
//!   the step gathers only B of its rows; of a MoE layer's experts, only those the B rows are
//!   expected to choose, see `untouched_expert_bytes`);
//! - decode, device time only: the same step timed by two events around its launches (from
//!   after the upload to after the argmax; the host's submission of the launches falls inside),
//!   so that the row above minus this one is the rest of the host's round trip between steps
//!   (the upload, the read-back, the work in between), which a greedy decode pays per token.
//!
//! Token ids are drawn from a fixed-seed generator. The KV cache of the decode rows is reserved
//! but not filled by a prefill: a step's cost does not depend on the cached values, and filling
//! 64 contexts of 1k tokens with the per-query prefill attention would cost more device time than
//! the measurement. Every configuration is run once untimed first (cuBLASLt plans its shapes on
//! first use), then timed; the median is reported.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use anyhow::bail;
use metrale_cache::{BlockAllocator, BlockTable, DEFAULT_BLOCK_SIZE};
use metrale_gpu_runtime::trace::{TraceRecord, spans_us};
use metrale_model_engine::plan::{BlockKind, LayerPlan, MlpKind};
use metrale_model_engine::{Model, ModelOptions, StepInput};

use crate::load::{self, ModelArgs};

/// Options of `met bench-model`.
#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    /// Prompt lengths whose time to first logits is measured (comma-separated).
    #[arg(long, default_value = "128,1024,8192", value_delimiter = ',')]
    prefill: Vec<usize>,
    /// Decode batch sizes (comma-separated).
    #[arg(long, default_value = "1,8,32,64", value_delimiter = ',')]
    batches: Vec<usize>,
    /// Cached tokens per sequence in the decode rows.
    #[arg(long, default_value_t = 1024)]
    context: usize,
    /// Timed repetitions per row (the median is reported).
    #[arg(long, default_value_t = 5)]
    repeats: usize,
    /// Memory read bandwidth for the floor column, TB/s (measured on the H200: DESIGN.md).
    #[arg(long, default_value_t = 4.19)]
    hbm_tb_s: f64,
    /// Write the rows as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// After the timed rows, run each configuration once more with an event after every launch
    /// and print where its time went, per kernel label (graph replay is off for that run).
    #[arg(long)]
    profile: bool,
    /// Timing experiment: after the rows, time the decode steps again once per launch label
    /// given here (comma-separated; the labels of --profile), with that label's launches left
    /// out of the replayed graph. The difference to the full step is what those launches cost
    /// in place. The outputs of those steps are wrong; they are only timed.
    #[arg(long, value_delimiter = ',')]
    skip_each: Vec<String>,
    /// After the timed rows, run each decode configuration twice more (once profiled for the
    /// launch labels, unless --profile already did, and once with the kernels' trace on, from
    /// its graph when graphs are on) and print the traced step's timeline: per launch, how long
    /// block 0 waited at the programmatic-launch wait and the span from that wait's release to
    /// the next launch's. Needs a trace build (METRALE_EXTRA_NVCC_FLAGS=-DMETRALE_TRACE);
    /// cuBLASLt's launches have no record, so steps that use it are shown unlabelled.
    #[arg(long)]
    timeline: bool,
    /// Override one schedule choice for an experiment, as key=value (repeatable): the keys of
    /// metrale_model_engine::Tuning (e.g. `--tune gemv_stage=off --tune gemv_stream=qkv+o`); the
    /// defaults are the kernel target's measured ones (docs/decisions.md).
    #[arg(long = "tune", value_name = "KEY=VALUE")]
    tune: Vec<String>,
}

/// A decode configuration's trace: the step's launch labels (from a profiled run) and the
/// records of the traced replay, or `None` when the kernels have no trace.
type Timeline = (Vec<&'static str>, Option<Vec<TraceRecord>>);

#[derive(serde::Serialize)]
struct Row {
    kind: &'static str,
    /// The launch label left out (`--skip-each` rows).
    #[serde(skip_serializing_if = "Option::is_none")]
    without: Option<String>,
    batch: usize,
    tokens: usize,
    ms: f64,
    floor_ms: Option<f64>,
    tok_s: f64,
}

/// The expert weight bytes a decode step of `batch` rows is expected not to read: in each MoE
/// layer, the experts no row chooses. The expectation is under uniform routing (each row's `k`
/// experts a uniform draw of `k` of `E`, rows independent): `E (1 - k / E)^batch` experts
/// untouched. Random-weight routers route close to uniformly; a trained model's routing is
/// skewed, touches fewer experts, and has a lower floor than this.
fn untouched_expert_bytes(plan: &LayerPlan, hidden: usize, batch: usize) -> f64 {
    plan.blocks()
        .filter_map(|(_, b)| match b.kind {
            BlockKind::Mlp(MlpKind::Moe(m)) => Some(m),
            _ => None,
        })
        .map(|m| {
            let (e, k) = (m.experts as f64, m.top_k as f64);
            let untouched = e * (1.0 - k / e).powi(batch as i32);
            // gate, up and down, bf16.
            untouched * (3 * m.intermediate * hidden * 2) as f64
        })
        .sum()
}

fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Runs `met bench-model`.
pub fn run(args: &Args) -> anyhow::Result<ExitCode> {
    if args.repeats == 0 || args.batches.contains(&0) || args.prefill.contains(&0) {
        bail!("--repeats, --batches and --prefill must be positive");
    }
    if args.model.max_seq_len.is_some() {
        bail!("bench-model sizes its sequences from --prefill and --context; drop --max-seq-len");
    }
    let (checkpoint, config, references) = load::open_checkpoint(&args.model)?;
    let placement = load::place(&args.model, &config, references)?;
    eprintln!("met: {}", placement.description);
    let block_size = DEFAULT_BLOCK_SIZE;
    let max_batch = args.batches.iter().copied().max().unwrap_or(1);
    let max_prefill = args.prefill.iter().copied().max().unwrap_or(1);
    let max_seq_len = max_prefill.max(args.context + 1) + 1;
    let blocks_per_seq = max_seq_len.div_ceil(block_size);
    let options = ModelOptions {
        kv_cache: args.model.kv_cache_dtype,
        max_tokens_per_step: max_prefill.max(max_batch),
        max_seqs: max_batch,
        max_logit_rows: max_batch,
        max_seq_len,
        num_blocks: (max_batch.max(1) + 1) * blocks_per_seq,
        block_size,
        state_slots: max_batch.max(1),
    };
    if max_seq_len > config.max_position_embeddings {
        bail!(
            "--context/--prefill need {max_seq_len} positions; the model has {}",
            config.max_position_embeddings
        );
    }
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
    let mut seed = 0x9E37_79B9_7F4A_7C15u64;
    let mut next_id = || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        (seed % config.vocab_size.min(32000) as u64) as u32
    };
    let mut rows = Vec::new();
    let mut profiles = Vec::new();

    for &p in &args.prefill {
        let mut table = BlockTable::default();
        table.reserve(p, block_size, &mut allocator)?;
        let tokens: Vec<u32> = (0..p).map(|_| next_id()).collect();
        let positions: Vec<u32> = (0..p as u32).collect();
        let seq = vec![0u32; p];
        let step = StepInput {
            tokens: &tokens,
            positions: &positions,
            token_seq: &seq,
            block_tables: &[&table],
            logit_rows: &[p - 1],
            state_slots: model.solo_state_slot(),
        };
        model.forward_argmax(&step)?;
        let mut times = Vec::new();
        for _ in 0..args.repeats {
            let t = Instant::now();
            model.forward_argmax(&step)?;
            times.push(t.elapsed().as_secs_f64() * 1e3);
        }
        if args.profile {
            profiles.push((
                format!("prefill {p} tokens"),
                profile_step(&mut model, &step)?,
            ));
        }
        table.release(&mut allocator)?;
        let ms = median(times);
        rows.push(Row {
            kind: "prefill (time to first logits)",
            without: None,
            batch: 1,
            tokens: p,
            ms,
            floor_ms: None,
            tok_s: p as f64 / ms * 1e3,
        });
    }

    let kv_per_token =
        ModelOptions::kv_bytes_per_block(&config, 1, args.model.kv_cache_dtype) as f64;
    // A decode step reads every weight once, except an untied input embedding, of which it
    // gathers only B rows (a tied one is read whole as the LM head).
    let untied_embedding = if config.tie_word_embeddings {
        0.0
    } else {
        (config.vocab_size * config.hidden_size * 2) as f64
    };
    let mut timelines = Vec::new();
    for &b in &args.batches {
        let (ms, device_ms, profile, timeline) =
            time_decode(&mut model, &mut allocator, &mut next_id, b, args, true)?;
        if let Some(launches) = profile {
            profiles.push((
                format!("decode batch {b}, context {}", args.context),
                launches,
            ));
        }
        if let Some(timeline) = timeline {
            timelines.push((
                format!("decode batch {b}, context {}", args.context),
                timeline,
            ));
        }
        let bytes = model.weight_bytes() as f64
            - untied_embedding
            - untouched_expert_bytes(model.plan(), config.hidden_size, b)
            + b as f64 * (args.context + 1) as f64 * kv_per_token;
        rows.push(Row {
            kind: "decode step",
            without: None,
            batch: b,
            tokens: args.context,
            ms,
            floor_ms: Some(bytes / (args.hbm_tb_s * 1e12) * 1e3),
            tok_s: b as f64 / ms * 1e3,
        });
        rows.push(Row {
            kind: "decode step, device time only",
            without: None,
            batch: b,
            tokens: args.context,
            ms: device_ms,
            floor_ms: None,
            tok_s: b as f64 / device_ms * 1e3,
        });
    }

    for label in &args.skip_each {
        model.set_skip(&[label.as_str()])?;
        for &b in &args.batches {
            let (ms, _, _, _) =
                time_decode(&mut model, &mut allocator, &mut next_id, b, args, false)?;
            rows.push(Row {
                kind: "timing experiment (wrong outputs): decode step without",
                without: Some(label.clone()),
                batch: b,
                tokens: args.context,
                ms,
                floor_ms: None,
                tok_s: b as f64 / ms * 1e3,
            });
        }
        model.set_skip(&[])?;
    }
    println!("met {}", crate::long_version());
    println!("{}", placement.description);
    println!("| row | batch | tokens | ms | floor ms | of floor | tok/s |");
    println!("|---|---|---|---|---|---|---|");
    for r in &rows {
        let (floor, of) = match r.floor_ms {
            Some(f) => (format!("{f:.3}"), format!("{:.0}%", 100.0 * f / r.ms)),
            None => ("-".into(), "-".into()),
        };
        let kind = match &r.without {
            Some(label) => format!("{} {label}", r.kind),
            None => r.kind.to_string(),
        };
        println!(
            "| {kind} | {} | {} | {:.3} | {floor} | {of} | {:.1} |",
            r.batch, r.tokens, r.ms, r.tok_s
        );
    }
    for (what, launches) in &profiles {
        print_profile(what, launches);
    }
    for (what, (labels, records)) in &timelines {
        print_timeline(what, labels, records.as_deref());
    }
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&rows)?)?;
    }
    Ok(ExitCode::SUCCESS)
}

/// The median time of a decode step of `b` sequences of `args.context` cached tokens (each row's
/// argmax taken on the device), after one untimed step; with `detail`, also the median device
/// time of as many more (events around the step's launches) and, with `--profile`, the launches
/// of one more step with their times (the timing experiments need neither).
#[allow(clippy::type_complexity)]
fn time_decode(
    model: &mut Model,
    allocator: &mut BlockAllocator,
    next_id: &mut dyn FnMut() -> u32,
    b: usize,
    args: &Args,
    detail: bool,
) -> anyhow::Result<(f64, f64, Option<Vec<(&'static str, f64)>>, Option<Timeline>)> {
    let block_size = model.options().block_size;
    let mut tables = Vec::new();
    for _ in 0..b {
        let mut t = BlockTable::default();
        t.reserve(args.context + 1, block_size, allocator)?;
        tables.push(t);
    }
    let refs: Vec<&BlockTable> = tables.iter().collect();
    let tokens: Vec<u32> = (0..b).map(|_| next_id()).collect();
    let positions = vec![args.context as u32; b];
    let seq: Vec<u32> = (0..b as u32).collect();
    let logit_rows: Vec<usize> = (0..b).collect();
    // A hybrid model's sequences each take a state slot (their state is whatever the slot
    // holds: the step's cost does not depend on it).
    let state_slots: Vec<u32> = match model.solo_state_slot() {
        [] => Vec::new(),
        _ => (0..b as u32).collect(),
    };
    let step = StepInput {
        tokens: &tokens,
        positions: &positions,
        token_seq: &seq,
        block_tables: &refs,
        logit_rows: &logit_rows,
        state_slots: &state_slots,
    };
    model.forward_argmax(&step)?;
    let mut times = Vec::new();
    for _ in 0..args.repeats {
        let t = Instant::now();
        model.forward_argmax(&step)?;
        times.push(t.elapsed().as_secs_f64() * 1e3);
    }
    // The same steps' device time alone (events from after the upload to after the argmax):
    // the difference is the host's round trip between steps.
    let mut device = Vec::new();
    if detail {
        model.set_step_timing(true)?;
        for _ in 0..args.repeats {
            model.forward_argmax(&step)?;
            device.extend(model.last_step_gpu_ms().map(f64::from));
        }
        model.set_step_timing(false)?;
    }
    let profile = if detail && args.profile {
        Some(profile_step(model, &step)?)
    } else {
        None
    };
    let timeline = if detail && args.timeline {
        let launches = match &profile {
            Some(launches) => launches.clone(),
            None => profile_step(model, &step)?,
        };
        let labels: Vec<&'static str> = launches.into_iter().map(|(label, _)| label).collect();
        let records = model.trace_step(&step)?;
        Some((labels, records))
    } else {
        None
    };
    for mut t in tables {
        t.release(allocator)?;
    }
    Ok((median(times), median(device), profile, timeline))
}

/// One more run of `step` with an event after every launch; the launches in order with their ms.
fn profile_step(model: &mut Model, step: &StepInput) -> anyhow::Result<Vec<(&'static str, f64)>> {
    model.set_profile(true);
    model.forward_argmax(step)?;
    let launches = model.profile()?;
    model.set_profile(false);
    Ok(launches)
}

/// Where a step's GPU time went: per label, launches, total ms and share, largest first.
fn print_profile(what: &str, launches: &[(&'static str, f64)]) {
    let total: f64 = launches.iter().map(|(_, ms)| ms).sum();
    let mut by_label: Vec<(&str, usize, f64)> = group_by_label(launches.iter().copied())
        .into_iter()
        .map(|(label, ms)| (label, ms.len(), ms.iter().sum()))
        .collect();
    by_label.sort_by(|a, b| b.2.total_cmp(&a.2));
    println!();
    println!(
        "profile: {what}: {} launches, {total:.3} ms between the first and last event",
        launches.len()
    );
    println!("| launch | count | ms | share | µs each |");
    println!("|---|---|---|---|---|");
    for (label, count, ms) in by_label {
        println!(
            "| {label} | {count} | {ms:.3} | {:.1}% | {:.1} |",
            100.0 * ms / total.max(1e-12),
            1e3 * ms / count as f64
        );
    }
}

/// A traced step's launches (`--timeline`): per label, the launches, the mean wait of block 0 at
/// the programmatic-launch wait and the mean span from its release to the next launch's, then
/// every launch in order. Labels pair with records by position only when every launch recorded
/// (each of ours does; cuBLASLt's do not).
fn print_timeline(what: &str, labels: &[&'static str], records: Option<&[TraceRecord]>) {
    println!();
    let Some(records) = records else {
        println!(
            "timeline: {what}: these kernels have no trace (build with METRALE_EXTRA_NVCC_FLAGS=-DMETRALE_TRACE)"
        );
        return;
    };
    let spans = spans_us(records);
    let paired = records.len() == labels.len();
    let total = match (records.first(), records.last()) {
        (Some(a), Some(b)) => b.released_ns.saturating_sub(a.released_ns) as f64 / 1e3,
        _ => 0.0,
    };
    println!(
        "timeline: {what}: {} launches recorded of {} launched, {total:.1} µs from the first wait's release to the last, clock step {}{}",
        records.len(),
        labels.len(),
        clock_step_ns(records).map_or("unknown".to_string(), |ns| format!("{ns} ns")),
        if paired {
            ""
        } else {
            " (counts differ: launches are not labelled)"
        }
    );
    let label = |i: usize| if paired { labels[i] } else { "?" };
    if paired {
        println!("| launch | count | waited µs (mean) | span µs (mean) | span µs (sum) |");
        println!("|---|---|---|---|---|");
        for (l, launches) in group_by_label(labels.iter().copied().zip(spans.iter().copied())) {
            let count = launches.len();
            let waited: f64 = launches.iter().map(|(waited, _)| waited).sum();
            let spans: Vec<f64> = launches.iter().filter_map(|&(_, span)| span).collect();
            let span: f64 = spans.iter().sum();
            println!(
                "| {l} | {count} | {:.2} | {:.2} | {span:.1} |",
                waited / count as f64,
                span / spans.len().max(1) as f64
            );
        }
    }
    println!("| # | launch | blocks x threads | SM | waited µs | span µs |");
    println!("|---|---|---|---|---|---|");
    for (i, (r, (waited, span))) in records.iter().zip(&spans).enumerate() {
        let span = span.map_or("-".to_string(), |s| format!("{s:.2}"));
        println!(
            "| {i} | {} | {} x {} | {} | {waited:.2} | {span} |",
            label(i),
            r.blocks,
            r.threads,
            r.sm
        );
    }
}

/// `items`' values grouped by label, the labels in the order they first appear.
fn group_by_label<V>(
    items: impl IntoIterator<Item = (&'static str, V)>,
) -> Vec<(&'static str, Vec<V>)> {
    let mut groups: Vec<(&'static str, Vec<V>)> = Vec::new();
    for (label, value) in items {
        match groups.iter_mut().find(|(l, _)| *l == label) {
            Some((_, values)) => values.push(value),
            None => groups.push((label, vec![value])),
        }
    }
    groups
}

/// The smallest non-zero difference between any two of the records' timestamps: an upper bound on
/// the %globaltimer's tick here (some GPUs tick it only every microsecond), so the timeline's
/// resolution is printed beside it.
fn clock_step_ns(records: &[TraceRecord]) -> Option<u64> {
    let mut stamps: Vec<u64> = records
        .iter()
        .flat_map(|r| [r.entered_ns, r.released_ns])
        .collect();
    stamps.sort_unstable();
    stamps
        .windows(2)
        .map(|w| w[1] - w[0])
        .filter(|&d| d > 0)
        .min()
}

#[cfg(test)]
mod tests {
    use super::{LayerPlan, group_by_label, untouched_expert_bytes};

    #[test]
    fn the_moe_floor_counts_the_experts_a_batch_is_expected_to_touch() {
        // 2 layers, the first dense (mlp_only_layers), the second 8 of 128 experts of width 768.
        let c = metrale_config::from_config_json(
            r#"{"model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144,
                "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                "num_hidden_layers": 2, "vocab_size": 1024, "rms_norm_eps": 1e-6,
                "rope_theta": 1000000.0, "max_position_embeddings": 256, "num_experts": 128,
                "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": true,
                "decoder_sparse_step": 1, "mlp_only_layers": [0]}"#,
        )
        .unwrap();
        let plan = LayerPlan::from_config(&c).unwrap();
        let expert = (3 * 768 * 2048 * 2) as f64;
        // One row touches its 8 experts exactly.
        assert_eq!(untouched_expert_bytes(&plan, 2048, 1), 120.0 * expert);
        // 64 rows: 128 (15/16)^64 = 2.05 experts expected untouched.
        let u64 = untouched_expert_bytes(&plan, 2048, 64) / expert;
        assert!(
            (u64 - 128.0 * (15.0f64 / 16.0).powi(64)).abs() < 1e-9,
            "{u64}"
        );
        assert!((2.0..2.1).contains(&u64), "{u64}");
    }

    #[test]
    fn labels_group_in_first_seen_order() {
        let groups = group_by_label([("qkv", 1), ("attention", 2), ("qkv", 3), ("o", 4)]);
        assert_eq!(
            groups,
            vec![("qkv", vec![1, 3]), ("attention", vec![2]), ("o", vec![4])]
        );
        assert!(group_by_label(Vec::<(&'static str, u8)>::new()).is_empty());
    }
}
