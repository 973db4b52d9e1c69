// SPDX-License-Identifier: MIT OR Apache-2.0
//! The engine thread: owns the model and the scheduler, runs one step after another, and streams
//! each sequence's tokens to its request.
//!
//! HTTP handlers never touch the model. They send a [`Command`] and get back a channel of
//! [`StreamEvent`]s. Each loop iteration: take new commands; end sequences whose client went away
//! or whose deadline passed; ask the scheduler for a step plan (continuous batching with chunked
//! prefill); run it as one `Model::forward`; sample the rows that want logits (under the
//! sequence's grammar mask when it has one, see [`super::constraint`]; or, for a sequence whose
//! thinking budget is spent, append its block's closing tokens instead); hand the sampled tokens
//! back to the scheduler; turn them into text (streaming detokeniser, stop strings) and send it;
//! end a sequence whose grammar is complete. Every ended sequence returns its KV blocks through
//! the scheduler.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use metrale_cache::BlockTable;
use metrale_model_engine::{Model, StepInput};
use metrale_sampling::{Sampler, SamplingParams};
use metrale_scheduler::{FinishReason as SchedFinish, NewSequence, Rejected, Scheduler, SeqId};
use metrale_tokenizer::{DecodeStream, Tokenizer};
use tokio::sync::{mpsc, oneshot};

use super::constraint::{Constraint, GrammarState};
use super::metrics::Metrics;
use super::stop::{StopMatcher, StopOutcome};
use super::thinking::{BudgetTracker, ThinkingBudget};

/// Why a generation ended, as the APIs report it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finish {
    /// End-of-sequence token, or the request's grammar is complete.
    Stop,
    /// A stop string (its index in the request's list).
    StopString(usize),
    /// Token limit.
    Length,
    /// The request's timeout passed.
    Timeout,
}

/// One token's log-probability and its top alternatives.
#[derive(Clone, Debug)]
pub struct TokenLogprob {
    /// The sampled token.
    pub token: u32,
    /// Its log-probability under the model.
    pub logprob: f32,
    /// The most likely tokens and their log-probabilities, best first.
    pub top: Vec<(u32, f32)>,
}

/// What a request's channel carries.
#[derive(Debug)]
pub enum StreamEvent {
    /// New text (may be empty while a multi-byte character or a possible stop string is held back).
    Delta {
        /// Text to append.
        text: String,
        /// Tokens generated for it.
        tokens: Vec<u32>,
        /// Log-probabilities when asked for.
        logprobs: Vec<TokenLogprob>,
    },
    /// The end, with token counts.
    Done {
        /// Why.
        finish: Finish,
        /// Prompt tokens.
        prompt_tokens: usize,
        /// Of those, tokens whose KV came from the prefix cache.
        cached_tokens: usize,
        /// Generated tokens.
        completion_tokens: usize,
    },
    /// The engine failed this request.
    Error(String),
}

/// One generation request, tokenised and validated.
#[derive(Debug)]
pub struct GenerationRequest {
    /// Prompt ids.
    pub prompt: Vec<u32>,
    /// Sampling.
    pub params: SamplingParams,
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// Stop strings.
    pub stop: Vec<String>,
    /// Tokens that end generation (EOS), not emitted.
    pub stop_tokens: Vec<u32>,
    /// Top log-probabilities to return per token (`Some(0)`: the sampled token's only).
    pub logprobs: Option<usize>,
    /// When the request times out.
    pub deadline: Option<Instant>,
    /// Cap on the tokens spent inside `<think>` blocks (see [`super::thinking`]).
    pub thinking: Option<ThinkingBudget>,
    /// The grammar the output must follow, compiled at admission (see [`super::constraint`]).
    pub grammar: Option<Constraint>,
    /// A chat prompt's tokens before the template's generation prompt (see
    /// [`super::state::ChatPrompt::turn_boundary`]); `None` for a raw prompt.
    pub turn_boundary: Option<usize>,
}

/// Why a request was not admitted.
#[derive(Debug)]
pub enum SubmitError {
    /// Too many requests in flight (429).
    QueueFull(String),
    /// The prompt cannot fit (400).
    Invalid(String),
    /// The engine has stopped (503).
    ShuttingDown,
}

/// Messages to the engine thread.
pub enum Command {
    /// Admit a request (boxed: it is most of the channel's slot size otherwise).
    Submit(
        Box<GenerationRequest>,
        oneshot::Sender<Result<mpsc::UnboundedReceiver<StreamEvent>, SubmitError>>,
    ),
    /// Finish what is running, then stop.
    Shutdown,
}

/// A handle the HTTP layer holds.
#[derive(Clone)]
pub struct EngineHandle {
    tx: std::sync::mpsc::Sender<Command>,
}

impl EngineHandle {
    /// Submits a request and returns its event channel.
    pub async fn submit(
        &self,
        req: GenerationRequest,
    ) -> Result<mpsc::UnboundedReceiver<StreamEvent>, SubmitError> {
        let (reply, wait) = oneshot::channel();
        self.tx
            .send(Command::Submit(Box::new(req), reply))
            .map_err(|_| SubmitError::ShuttingDown)?;
        wait.await.map_err(|_| SubmitError::ShuttingDown)?
    }

    /// Asks the engine to finish in-flight work and stop.
    pub fn shutdown(&self) {
        let _ = self.tx.send(Command::Shutdown);
    }
}

struct Active {
    tx: mpsc::UnboundedSender<StreamEvent>,
    sampler: Sampler,
    detok: DecodeStream,
    stop: StopMatcher,
    stop_tokens: Vec<u32>,
    logprobs: Option<usize>,
    prompt_tokens: usize,
    /// Prompt tokens found in the prefix cache, read from the scheduler at admission.
    cached_tokens: Option<usize>,
    generated: usize,
    arrival: Instant,
    first_token_seen: bool,
    deadline: Option<Instant>,
    budget: Option<BudgetTracker>,
    /// The sequence's walk through its grammar; `None` (no cost) for unconstrained requests.
    grammar: Option<GrammarState>,
}

/// Starts the engine thread.
pub fn start(
    model: Model,
    scheduler: Scheduler,
    tokenizer: Arc<Tokenizer>,
    metrics: Arc<Metrics>,
) -> (EngineHandle, std::thread::JoinHandle<()>) {
    let (tx, rx) = std::sync::mpsc::channel();
    let engine = Engine {
        model,
        scheduler,
        tokenizer,
        metrics,
        active: HashMap::new(),
        next_id: 0,
    };
    // The pool's gauges are in /metrics before the server can answer, not whenever the engine
    // thread first runs (a scrape right after start-up read 0 state slots).
    engine.publish_stats();
    let thread = std::thread::Builder::new()
        .name("met-engine".into())
        .spawn(move || engine.run(rx))
        .expect("spawn the engine thread");
    (EngineHandle { tx }, thread)
}

struct Engine {
    model: Model,
    scheduler: Scheduler,
    tokenizer: Arc<Tokenizer>,
    metrics: Arc<Metrics>,
    active: HashMap<SeqId, Active>,
    next_id: u64,
}

/// One constrained draw: the grammar's bitset, the masked sample, the grammar advanced. On a
/// grammar failure the token drawn without the mask comes back with the error, so the step stays
/// whole and the caller ends the sequence.
fn constrained(
    g: &mut GrammarState,
    sampler: &mut Sampler,
    row: &mut [f32],
) -> Result<u32, (u32, metrale_grammar::GrammarError)> {
    let token = match g.allowed() {
        Ok(Some(allowed)) => sampler.sample_allowed(row, allowed),
        // Waiting for a thinking block to close: unconstrained.
        Ok(None) => sampler.sample(row),
        Err(e) => return Err((sampler.sample(row), e)),
    };
    g.advance(token).map(|()| token).map_err(|e| (token, e))
}

/// `log_softmax(row)[token]` and the top `k` entries.
fn logprobs_of(row: &[f32], token: u32, k: usize) -> TokenLogprob {
    let max = row
        .iter()
        .copied()
        .filter(|v| v.is_finite())
        .fold(f32::NEG_INFINITY, f32::max);
    let lse = max + row.iter().map(|v| (v - max).exp()).sum::<f32>().ln();
    let mut top: Vec<(u32, f32)> = Vec::new();
    if k > 0 {
        let mut idx: Vec<u32> = (0..row.len() as u32).collect();
        let k = k.min(idx.len());
        idx.select_nth_unstable_by(k - 1, |&a, &b| row[b as usize].total_cmp(&row[a as usize]));
        idx.truncate(k);
        idx.sort_by(|&a, &b| row[b as usize].total_cmp(&row[a as usize]).then(a.cmp(&b)));
        top = idx
            .into_iter()
            .map(|i| (i, row[i as usize] - lse))
            .collect();
    }
    TokenLogprob {
        token,
        logprob: row[token as usize] - lse,
        top,
    }
}

impl Engine {
    fn run(mut self, rx: std::sync::mpsc::Receiver<Command>) {
        let mut shutting_down = false;
        loop {
            // Block for work only when there is nothing to run.
            let idle = self.active.is_empty();
            if idle && shutting_down {
                break;
            }
            let first = if idle {
                rx.recv().ok()
            } else {
                rx.try_recv().ok()
            };
            let mut commands: Vec<Command> = first.into_iter().collect();
            commands.extend(rx.try_iter());
            if commands.is_empty() && idle {
                break; // every handle is gone
            }
            for c in commands {
                match c {
                    Command::Submit(req, reply) => {
                        if shutting_down {
                            let _ = reply.send(Err(SubmitError::ShuttingDown));
                        } else {
                            let _ = reply.send(self.admit(*req));
                        }
                    }
                    Command::Shutdown => shutting_down = true,
                }
            }
            self.reap(Instant::now());
            if let Err(e) = self.step() {
                tracing::error!("engine step failed: {e:#}");
                let ids: Vec<SeqId> = self.active.keys().copied().collect();
                for id in ids {
                    self.end(id, None, Some(format!("the engine failed: {e}")));
                }
            }
            self.publish_stats();
        }
        tracing::info!("engine stopped");
    }

    fn admit(
        &mut self,
        req: GenerationRequest,
    ) -> Result<mpsc::UnboundedReceiver<StreamEvent>, SubmitError> {
        let grammar = match req.grammar.as_ref().map(Constraint::start).transpose() {
            Ok(g) => g,
            Err(e) => return Err(SubmitError::Invalid(e.to_string())),
        };
        let id = SeqId(self.next_id);
        self.next_id += 1;
        let now = Instant::now();
        let new = NewSequence {
            id,
            prompt: req.prompt.clone(),
            max_new_tokens: req.max_tokens,
            arrival: now,
            turn_boundary: req.turn_boundary,
        };
        match self.scheduler.add(new) {
            Ok(()) => {}
            Err(Rejected::QueueFull { .. }) => {
                self.metrics
                    .requests_rejected_total
                    .fetch_add(1, Ordering::Relaxed);
                return Err(SubmitError::QueueFull(
                    "the server is at its limit of queued requests (--max-num-seqs); retry later"
                        .into(),
                ));
            }
            Err(other) => return Err(SubmitError::Invalid(other.to_string())),
        }
        let (tx, rx) = mpsc::unbounded_channel();
        self.metrics.requests_total.fetch_add(1, Ordering::Relaxed);
        self.metrics.requests_active.fetch_add(1, Ordering::Relaxed);
        self.metrics
            .prompt_tokens_total
            .fetch_add(req.prompt.len() as u64, Ordering::Relaxed);
        self.active.insert(
            id,
            Active {
                tx,
                sampler: Sampler::new(req.params, &req.prompt),
                detok: DecodeStream::new(true),
                stop: StopMatcher::new(req.stop),
                stop_tokens: req.stop_tokens,
                logprobs: req.logprobs,
                prompt_tokens: req.prompt.len(),
                cached_tokens: None,
                generated: 0,
                arrival: now,
                first_token_seen: false,
                deadline: req.deadline,
                budget: req.thinking.map(BudgetTracker::new),
                grammar,
            },
        );
        Ok(rx)
    }

    /// Ends sequences whose client disconnected or whose deadline passed.
    fn reap(&mut self, now: Instant) {
        let gone: Vec<(SeqId, bool)> = self
            .active
            .iter()
            .filter_map(|(id, a)| {
                if a.tx.is_closed() {
                    Some((*id, false))
                } else if a.deadline.is_some_and(|d| now >= d) {
                    Some((*id, true))
                } else {
                    None
                }
            })
            .collect();
        for (id, timed_out) in gone {
            self.end(
                id,
                if timed_out {
                    Some(Finish::Timeout)
                } else {
                    None
                },
                None,
            );
        }
    }

    /// Removes a sequence: tells the scheduler (which frees its blocks) and the client.
    fn end(&mut self, id: SeqId, finish: Option<Finish>, error: Option<String>) {
        let Some(mut a) = self.active.remove(&id) else {
            return;
        };
        let reason = match finish {
            Some(Finish::Length) => SchedFinish::Length,
            Some(Finish::Stop | Finish::StopString(_)) => SchedFinish::Stop,
            Some(Finish::Timeout) | None => SchedFinish::Cancelled,
        };
        self.scheduler.finish(id, reason);
        self.metrics.requests_active.fetch_sub(1, Ordering::Relaxed);
        // Published before the client hears the end, so a reply is never seen while /metrics
        // still counts the finished request's blocks as referenced.
        self.publish_stats();
        let outcome = match (&error, finish) {
            (Some(_), _) => "error",
            (None, None) => "cancelled",
            (None, Some(Finish::Stop | Finish::StopString(_))) => "stop",
            (None, Some(Finish::Length)) => "length",
            (None, Some(Finish::Timeout)) => "timeout",
        };
        tracing::info!(
            "request {}: {outcome}; {} prompt tokens ({} cached), {} generated, {:.2}s",
            id.0,
            a.prompt_tokens,
            a.cached_tokens.unwrap_or(0),
            a.generated,
            a.arrival.elapsed().as_secs_f64()
        );
        if let Some(message) = error {
            let _ = a.tx.send(StreamEvent::Error(message));
        } else if let Some(finish) = finish {
            let rest = match finish {
                Finish::StopString(_) => String::new(),
                _ => {
                    let mut rest = a
                        .detok
                        .finish(&self.tokenizer)
                        .ok()
                        .flatten()
                        .unwrap_or_default();
                    if let StopOutcome::Emit(t) = a.stop.push(&rest) {
                        rest = t;
                    }
                    rest.push_str(&a.stop.finish());
                    rest
                }
            };
            if !rest.is_empty() {
                let _ = a.tx.send(StreamEvent::Delta {
                    text: rest,
                    tokens: Vec::new(),
                    logprobs: Vec::new(),
                });
            }
            let _ = a.tx.send(StreamEvent::Done {
                finish,
                prompt_tokens: a.prompt_tokens,
                cached_tokens: a.cached_tokens.unwrap_or(0),
                completion_tokens: a.generated,
            });
        }
    }

    fn step(&mut self) -> anyhow::Result<()> {
        let plan = self.scheduler.schedule(Instant::now());
        if !plan.preempted.is_empty() {
            self.metrics
                .preemptions_total
                .fetch_add(plan.preempted.len() as u64, Ordering::Relaxed);
        }
        // A sequence's cached tokens are known from its first admission; read them then, since
        // one that finishes by length in this step is gone from the scheduler before `end`.
        for item in &plan.items {
            if let Some(a) = self.active.get_mut(&item.seq)
                && a.cached_tokens.is_none()
            {
                a.cached_tokens = self.scheduler.cached_tokens(item.seq);
            }
        }
        if plan.items.is_empty() {
            if !self.active.is_empty() {
                // Nothing schedulable right now (e.g. waiting for blocks): do not spin.
                std::thread::sleep(Duration::from_millis(1));
            }
            return Ok(());
        }
        let flat = plan.flatten();
        let table_refs: Vec<&BlockTable> = plan.block_tables.iter().collect();
        let state_slots: Vec<u32> = plan
            .items
            .iter()
            .filter_map(|i| i.state_slot.map(|s| s.0))
            .collect();
        let input = StepInput {
            tokens: &flat.tokens,
            positions: &flat.positions,
            token_seq: &flat.token_seq,
            block_tables: &table_refs,
            logit_rows: &flat.logit_rows,
            state_slots: &state_slots,
        };
        // A hybrid model's prefix-cache hit: the state at the hit's end, copied from its snapshot
        // into the sequence's slot before the step (every restore before any snapshot below).
        for item in &plan.items {
            if let (Some(from), Some(to)) = (item.restore, item.state_slot) {
                self.model.copy_state_slot(from.0, to.0)?;
            }
        }
        // When every row samples greedily with no bias, penalty, grammar or logprobs, the argmax
        // is taken on the device and one id per row comes back instead of the row's logits.
        let device_argmax = flat.logit_seqs.iter().all(|q| {
            self.active.get(q).is_none_or(|a| {
                a.grammar.is_none() && a.logprobs.is_none() && a.sampler.params().is_plain_greedy()
            })
        });
        let (logits, argmax) = if device_argmax {
            (Vec::new(), self.model.forward_argmax(&input)?)
        } else {
            (self.model.forward(&input)?, Vec::new())
        };
        // A chunk that ended on its sequence's snapshot boundary: keep the state there (queued
        // after the step on the same stream).
        for item in &plan.items {
            if let (Some(to), Some(from)) = (item.snapshot, item.state_slot) {
                self.model.copy_state_slot(from.0, to.0)?;
            }
        }
        let row_seqs = flat.logit_seqs;
        let vocab = self.model.config().vocab_size;
        let mut sampled = Vec::with_capacity(row_seqs.len());
        let mut lps: HashMap<SeqId, TokenLogprob> = HashMap::new();
        let mut grammar_failed: Vec<(SeqId, String)> = Vec::new();
        for (r, &seq) in row_seqs.iter().enumerate() {
            let Some(a) = self.active.get_mut(&seq) else {
                continue;
            };
            // A spent thinking budget appends the block's closing tokens instead of sampling.
            let forced = a.budget.as_mut().and_then(BudgetTracker::forced_token);
            if device_argmax {
                let token = forced.unwrap_or(argmax[r]);
                a.sampler.record(token);
                sampled.push((seq, token));
                continue;
            }
            let mut row = logits[r * vocab..(r + 1) * vocab].to_vec();
            let lp_k = a.logprobs;
            let raw = lp_k.map(|_| row.clone());
            let token = match (forced, a.grammar.as_mut()) {
                (Some(token), _) => {
                    // A thinking block's closing text: never fed to a grammar, which waits for it.
                    a.sampler.record(token);
                    token
                }
                (None, None) => a.sampler.sample(&mut row),
                // The mask applies after the bias and penalties, before temperature and filters.
                (None, Some(g)) => match constrained(g, &mut a.sampler, &mut row) {
                    Ok(token) => token,
                    Err((token, e)) => {
                        grammar_failed.push((seq, format!("constrained decoding failed: {e}")));
                        token
                    }
                },
            };
            if let (Some(k), Some(raw)) = (lp_k, raw) {
                lps.insert(seq, logprobs_of(&raw, token, k));
            }
            sampled.push((seq, token));
        }
        let now = Instant::now();
        let events = self
            .scheduler
            .complete_step(&sampled, now)
            .map_err(|e| anyhow::anyhow!("scheduler: {e}"))?;
        for (seq, message) in grammar_failed {
            tracing::warn!("request {}: {message}", seq.0);
            self.end(seq, None, Some(message));
        }
        for ev in events {
            let Some(a) = self.active.get_mut(&ev.seq) else {
                continue;
            };
            if !a.first_token_seen {
                a.first_token_seen = true;
                self.metrics
                    .observe_ttft(now.duration_since(a.arrival).as_secs_f64());
            }
            if a.stop_tokens.contains(&ev.token) {
                self.end(ev.seq, Some(Finish::Stop), None);
                continue;
            }
            a.generated += 1;
            self.metrics
                .generation_tokens_total
                .fetch_add(1, Ordering::Relaxed);
            let text = a
                .detok
                .step(&self.tokenizer, ev.token)
                .ok()
                .flatten()
                .unwrap_or_default();
            if let Some(budget) = a.budget.as_mut() {
                budget.observe(&text);
            }
            let complete = a.grammar.as_mut().is_some_and(|g| {
                g.observe(&text);
                g.is_finished()
            });
            let logprobs: Vec<TokenLogprob> = lps.remove(&ev.seq).into_iter().collect();
            match a.stop.push(&text) {
                StopOutcome::Emit(t) => {
                    let _ = a.tx.send(StreamEvent::Delta {
                        text: t,
                        tokens: vec![ev.token],
                        logprobs,
                    });
                    // A grammar completed by the last allowed token is a stop, not a length.
                    if complete {
                        self.end(ev.seq, Some(Finish::Stop), None);
                    } else if ev.finish.is_some() {
                        self.end(ev.seq, Some(Finish::Length), None);
                    }
                }
                StopOutcome::Stopped(t, which) => {
                    let _ = a.tx.send(StreamEvent::Delta {
                        text: t,
                        tokens: vec![ev.token],
                        logprobs,
                    });
                    self.end(ev.seq, Some(Finish::StopString(which)), None);
                }
            }
        }
        Ok(())
    }

    fn publish_stats(&self) {
        let s = self.scheduler.stats();
        self.metrics
            .kv_blocks_used
            .store(s.blocks_used as u64, Ordering::Relaxed);
        self.metrics
            .kv_blocks_free
            .store(s.blocks_free as u64, Ordering::Relaxed);
        self.metrics
            .kv_blocks_total
            .store(s.blocks_total as u64, Ordering::Relaxed);
        self.metrics
            .sequences_waiting
            .store(s.waiting as u64, Ordering::Relaxed);
        self.metrics
            .sequences_running
            .store(s.running as u64, Ordering::Relaxed);
        let m = &self.metrics;
        m.state_slots_used
            .store(s.state_slots_used as u64, Ordering::Relaxed);
        m.state_slots_total
            .store(s.state_slots_total as u64, Ordering::Relaxed);
        m.state_snapshots_used
            .store(s.state_snapshots_used as u64, Ordering::Relaxed);
        m.state_snapshots_total
            .store(s.state_snapshots_total as u64, Ordering::Relaxed);
        m.state_snapshots_held
            .store(s.state_snapshots_held as u64, Ordering::Relaxed);
        m.state_snapshot_evictions_total
            .store(s.state_snapshot_evictions, Ordering::Relaxed);
        m.kv_blocks_cached
            .store(s.blocks_cached as u64, Ordering::Relaxed);
        m.prefix_cache_queried_tokens_total
            .store(s.prefix_queried_tokens, Ordering::Relaxed);
        m.prefix_cache_hit_tokens_total
            .store(s.prefix_hit_tokens, Ordering::Relaxed);
        m.prefix_cache_evicted_blocks_total
            .store(s.prefix_evicted_blocks, Ordering::Relaxed);
    }
}
