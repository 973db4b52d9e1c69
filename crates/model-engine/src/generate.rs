// SPDX-License-Identifier: MIT OR Apache-2.0
//! Generating one sequence: chunked prefill, then decode steps, each token handed to a callback.
//!
//! This is the single-request path (`met generate`, parity runs); the server's scheduler batches
//! many sequences through the same [`Model::forward`].

use std::time::{Duration, Instant};

use metrale_cache::{BlockAllocator, BlockTable};
use metrale_sampling::Sampler;

use crate::{Model, ModelError, StepInput};

/// Why generation stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-sequence token was sampled (it is not part of the output).
    Stop,
    /// `max_new_tokens` were generated.
    Length,
    /// The callback asked to stop.
    Cancelled,
}

/// What the callback says after each token.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flow {
    /// Keep generating.
    Continue,
    /// Stop now.
    Stop,
}

/// The outcome of [`generate`].
#[derive(Clone, Debug)]
pub struct Generated {
    /// Output tokens (without the stop token).
    pub tokens: Vec<u32>,
    /// Why it ended.
    pub finish: FinishReason,
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Time from start to the first sampled token (prefill plus one sample).
    pub time_to_first_token: Duration,
    /// Time spent after the first token.
    pub decode_time: Duration,
}

impl Generated {
    /// Tokens per second after the first token.
    pub fn decode_tokens_per_second(&self) -> f64 {
        let n = self.tokens.len().saturating_sub(1);
        if n == 0 || self.decode_time.is_zero() {
            0.0
        } else {
            n as f64 / self.decode_time.as_secs_f64()
        }
    }
}

/// A generation request.
pub struct Request<'a> {
    /// Prompt token ids (at least one).
    pub prompt: &'a [u32],
    /// Most tokens to generate.
    pub max_new_tokens: usize,
    /// Tokens that end the sequence.
    pub stop_tokens: &'a [u32],
    /// The sampler, seeded with the prompt for its penalties.
    pub sampler: Sampler,
}

/// Runs one sequence to completion. `on_token` sees each output token as it is sampled; the KV
/// blocks the sequence used are returned to `allocator` whatever happens.
pub fn generate(
    model: &mut Model,
    allocator: &mut BlockAllocator,
    mut request: Request,
    on_token: &mut dyn FnMut(u32) -> Flow,
) -> Result<Generated, ModelError> {
    let prompt_len = request.prompt.len();
    let max_len = model.options().max_seq_len;
    if prompt_len == 0 {
        return Err(ModelError::InvalidStep("the prompt is empty".into()));
    }
    if prompt_len >= max_len {
        return Err(ModelError::InvalidStep(format!(
            "the prompt has {prompt_len} tokens but the context holds {max_len} (prompt plus at least one generated token)"
        )));
    }
    let total = (prompt_len + request.max_new_tokens).min(max_len);
    let mut table = BlockTable::default();
    let result = run(model, allocator, &mut table, &mut request, total, on_token);
    table
        .release(allocator)
        .expect("the sequence owns its blocks");
    result
}

fn run(
    model: &mut Model,
    allocator: &mut BlockAllocator,
    table: &mut BlockTable,
    request: &mut Request,
    total: usize,
    on_token: &mut dyn FnMut(u32) -> Flow,
) -> Result<Generated, ModelError> {
    let block_size = model.options().block_size;
    table
        .reserve(total, block_size, allocator)
        .map_err(|e| ModelError::InvalidStep(e.to_string()))?;
    let start = Instant::now();
    let chunk = model.options().max_tokens_per_step;
    let prompt = request.prompt;
    // Greedy without bias or penalties takes the argmax on the device: one id comes back per
    // step instead of a row of logits.
    let device_argmax = request.sampler.params().is_plain_greedy();
    let pick = |model: &mut Model, input: &StepInput, sampler: &mut Sampler| {
        if device_argmax {
            let token = model.forward_argmax(input)?[0];
            sampler.record(token);
            Ok::<u32, ModelError>(token)
        } else {
            let mut logits = model.forward(input)?;
            Ok(sampler.sample(&mut logits))
        }
    };
    let mut first = None;
    for begin in (0..prompt.len()).step_by(chunk) {
        let end = (begin + chunk).min(prompt.len());
        let positions: Vec<u32> = (begin as u32..end as u32).collect();
        let seq = vec![0u32; end - begin];
        let last = [end - begin - 1];
        let rows: &[usize] = if end == prompt.len() { &last } else { &[] };
        let input = StepInput {
            tokens: &prompt[begin..end],
            positions: &positions,
            token_seq: &seq,
            block_tables: &[table],
            logit_rows: rows,
            state_slots: model.solo_state_slot(),
        };
        if rows.is_empty() {
            model.forward(&input)?;
        } else {
            first = Some(pick(model, &input, &mut request.sampler)?);
        }
    }
    let next = first.ok_or_else(|| ModelError::InvalidStep("empty prompt".into()))?;
    let first_token_at = start.elapsed();
    let mut tokens = Vec::new();
    let (stop_tokens, max_new) = (request.stop_tokens, request.max_new_tokens);
    // Takes one sampled token: Some(reason) when generation ends with it.
    let mut accept = |tokens: &mut Vec<u32>, next: u32| {
        if stop_tokens.contains(&next) {
            return Some(FinishReason::Stop);
        }
        tokens.push(next);
        if on_token(next) == Flow::Stop {
            return Some(FinishReason::Cancelled);
        }
        let pos = prompt.len() + tokens.len() - 1;
        if tokens.len() >= max_new || pos + 1 >= total {
            return Some(FinishReason::Length);
        }
        None
    };
    let finish = if let Some(finish) = accept(&mut tokens, next) {
        finish
    } else if device_argmax && model.decode_ahead_steps() > 0 {
        // Greedy on the device with steps queued ahead of the host (the tuning's `decode_ahead`): no
        // round trip per token; a stop token is seen a few steps late and those steps discarded.
        let position = prompt.len() + tokens.len() - 1;
        let steps = (total - 1 - position).min(max_new - tokens.len());
        let mut finish = FinishReason::Length;
        let sampler = &mut request.sampler;
        model.decode_ahead(table, next, position, steps, &mut |id| {
            sampler.record(id);
            match accept(&mut tokens, id) {
                Some(f) => {
                    finish = f;
                    false
                }
                None => true,
            }
        })?;
        finish
    } else {
        let mut next = next;
        loop {
            let pos = prompt.len() + tokens.len() - 1;
            let input = StepInput {
                tokens: &[next],
                positions: &[pos as u32],
                token_seq: &[0],
                block_tables: &[table],
                logit_rows: &[0],
                state_slots: model.solo_state_slot(),
            };
            next = pick(model, &input, &mut request.sampler)?;
            if let Some(finish) = accept(&mut tokens, next) {
                break finish;
            }
        }
    };
    Ok(Generated {
        tokens,
        finish,
        prompt_tokens: prompt.len(),
        time_to_first_token: first_token_at,
        decode_time: start.elapsed().saturating_sub(first_token_at),
    })
}
