//! Continuous batching of a model on the paged cache: paged-cache's
//! scheduler ([`serve`]) decides every step, and [`ModelEngine`] runs it: a
//! prefill per admitted request (after the tokens its prefix-cache hit
//! already holds), then one batched forward pass per decode step over
//! every running request ([`CausalLm::forward_batch`]: the projections'
//! weights read once for the whole batch, attention per sequence over its
//! own pages through [`ReservedSlots`]). Preemption really recomputes (the
//! request's prompt and tokens so far are prefilled again) or swaps (its
//! blocks move to the host tier and back).
//!
//! Token `i` of a request is drawn from stream `1 + i` of its seed, so what
//! a request generates does not depend on what it was batched with, on
//! preemption or on recompute (greedy requests take the most likely token).

use std::time::Instant;

use gf2_codes::channel::FaultRng;
use paged_cache::scheduler::{Engine, Report, Request, SchedulerConfig, Workload, serve};
use paged_cache::{KvCacheManager, PrefixCache, ReservedSlots, SeqId};

use super::{Adapted, BatchItem, CausalLm, Sampling};
use crate::error::{ModelError, Result};

/// One request of a batch.
#[derive(Clone, Debug, PartialEq)]
pub struct BatchRequest {
    /// Prompt token ids (at least one).
    pub prompt: Vec<u32>,
    /// Tokens to generate (at least one).
    pub max_new_tokens: usize,
    /// Scheduler step at which it arrives.
    pub arrival_step: u64,
    /// Priority (higher is preempted last).
    pub priority: u32,
    /// How its tokens are picked.
    pub sampling: Sampling,
}

/// What one request produced and when.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct RequestOutput {
    /// Generated token ids.
    pub tokens: Vec<u32>,
    /// Seconds from the batch's start to its arrival.
    pub arrived: f64,
    /// Seconds from the batch's start to each token.
    pub token_times: Vec<f64>,
}

impl RequestOutput {
    /// Time to first token, seconds.
    pub fn ttft(&self) -> f64 {
        self.token_times.first().map_or(0.0, |t| t - self.arrived)
    }

    /// Gaps between successive tokens, seconds.
    pub fn inter_token(&self) -> impl Iterator<Item = f64> + '_ {
        self.token_times.windows(2).map(|w| w[1] - w[0])
    }
}

/// What serving a batch produced: every request's output, the scheduler's
/// report and where the time went.
#[derive(Clone, Debug, PartialEq)]
pub struct Served {
    /// Each request's tokens and times, in request order.
    pub outputs: Vec<RequestOutput>,
    /// The scheduler's counts (steps, preemptions, swaps, prefix hits, ...).
    pub scheduler: Report,
    /// Seconds from the start to the last step.
    pub seconds: f64,
    /// Seconds in prefills.
    pub prefill_seconds: f64,
    /// Seconds in batched decode steps.
    pub decode_seconds: f64,
    /// Batched decode steps run.
    pub decode_steps: u64,
}

/// Called with each request's index and output as it finishes.
pub type OnFinished<'a> = dyn FnMut(usize, &RequestOutput) -> Result<()> + 'a;

/// The engine that runs the scheduler's steps on a model.
pub struct ModelEngine<'a> {
    model: &'a dyn CausalLm,
    requests: &'a [BatchRequest],
    on_finished: &'a mut OnFinished<'a>,
    outputs: Vec<RequestOutput>,
    start: Instant,
    prefill_seconds: f64,
    decode_seconds: f64,
    decode_steps: u64,
}

impl std::fmt::Debug for ModelEngine<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelEngine")
            .field("model", &self.model.describe())
            .field("requests", &self.requests.len())
            .finish_non_exhaustive()
    }
}

impl<'a> ModelEngine<'a> {
    /// An engine for `requests` on `model`, its clock started, handing
    /// each finished request's output to `on_finished`.
    pub fn new(
        model: &'a dyn CausalLm,
        requests: &'a [BatchRequest],
        on_finished: &'a mut OnFinished<'a>,
    ) -> Self {
        Self {
            model,
            requests,
            on_finished,
            outputs: vec![RequestOutput::default(); requests.len()],
            start: Instant::now(),
            prefill_seconds: 0.0,
            decode_seconds: 0.0,
            decode_steps: 0,
        }
    }

    /// Records the token picked from `logits` for `request`, whose cache
    /// holds `held` tokens: its output index is `held − prompt` (a token a
    /// recompute picks again keeps its first pick and time: it was
    /// delivered).
    fn record(&mut self, request: usize, held: usize, logits: &[f32]) {
        let q = &self.requests[request];
        let index = held - q.prompt.len();
        let out = &mut self.outputs[request];
        if index < out.tokens.len() {
            return;
        }
        let mut rng = FaultRng::with_stream(q.sampling.seed, 1 + index as u64);
        out.tokens.push(q.sampling.pick(logits, &mut rng));
        out.token_times.push(self.start.elapsed().as_secs_f64());
    }

    /// What the engine produced, with the scheduler's report.
    fn served(self, scheduler: Report) -> Served {
        Served {
            seconds: self.start.elapsed().as_secs_f64(),
            outputs: self.outputs,
            scheduler,
            prefill_seconds: self.prefill_seconds,
            decode_seconds: self.decode_seconds,
            decode_steps: self.decode_steps,
        }
    }
}

impl<P: PrefixCache> Engine<P> for ModelEngine<'_> {
    type Error = ModelError;

    fn token(&self, request: usize, index: usize) -> u32 {
        self.outputs[request].tokens[index]
    }

    fn prefill(
        &mut self,
        cache: &mut KvCacheManager<P>,
        request: usize,
        seq: SeqId,
        cached: usize,
    ) -> Result<()> {
        let started = Instant::now();
        let logits = prefill(self.model, cache, seq, cached)?;
        let held = cache.tokens(seq)?.len();
        self.record(request, held, &logits);
        self.prefill_seconds += started.elapsed().as_secs_f64();
        Ok(())
    }

    fn decode(&mut self, cache: &mut KvCacheManager<P>, batch: &[(usize, SeqId)]) -> Result<()> {
        let started = Instant::now();
        let seqs: Vec<SeqId> = batch.iter().map(|&(_, seq)| seq).collect();
        let logits = decode_step(self.model, cache, &seqs)?;
        for (&(request, seq), logits) in batch.iter().zip(&logits) {
            let held = cache.tokens(seq)?.len();
            self.record(request, held, logits);
        }
        self.decode_seconds += started.elapsed().as_secs_f64();
        self.decode_steps += 1;
        Ok(())
    }

    fn arrived(&mut self, request: usize) {
        self.outputs[request].arrived = self.start.elapsed().as_secs_f64();
    }

    fn finished(&mut self, request: usize) -> Result<()> {
        (self.on_finished)(request, &self.outputs[request])
    }
}

/// Computes sequence `seq`'s K/V after its first `cached` tokens (which a
/// prefix hit holds already) in its reserved slots, and returns the logits
/// of its last token.
pub fn prefill<P: PrefixCache>(
    model: &dyn CausalLm,
    cache: &mut KvCacheManager<P>,
    seq: SeqId,
    cached: usize,
) -> Result<Vec<f32>> {
    let held = cache.tokens(seq)?.to_vec();
    let tokens = held
        .get(cached..)
        .filter(|t| !t.is_empty())
        .ok_or_else(|| ModelError::InvalidParameter {
            name: "cached",
            reason: format!("{cached} of the sequence's {} tokens", held.len()),
        })?;
    let mut slots = Adapted(ReservedSlots::new(cache, seq, cached)?);
    model.forward(tokens, &mut slots, tokens.len() - 1)
}

/// One batched decode step: each sequence of `seqs` has appended one token
/// whose K/V is not computed yet; computes them all in one forward pass
/// and returns each sequence's logits.
pub fn decode_step<P: PrefixCache>(
    model: &dyn CausalLm,
    cache: &mut KvCacheManager<P>,
    seqs: &[SeqId],
) -> Result<Vec<Vec<f32>>> {
    let mut last = Vec::with_capacity(seqs.len());
    let mut slots = Vec::with_capacity(seqs.len());
    for &seq in seqs {
        let held = cache.tokens(seq)?;
        let Some(&token) = held.last() else {
            return Err(ModelError::InvalidParameter {
                name: "seqs",
                reason: format!("{seq:?} holds no token to decode"),
            });
        };
        last.push([token]);
        slots.push(Adapted(ReservedSlots::new(cache, seq, held.len() - 1)?));
    }
    let mut items: Vec<BatchItem<'_>> = slots
        .iter_mut()
        .zip(&last)
        .map(|(slots, token)| BatchItem {
            tokens: token,
            cache: slots,
            logits_from: 0,
        })
        .collect();
    model.forward_batch(&mut items)
}

/// Refuses, before any work, what no batch can serve: no request, an empty
/// prompt or no token to generate, a request past the model's context,
/// bad sampling parameters.
pub fn check_requests(model: &dyn CausalLm, requests: &[BatchRequest]) -> Result<()> {
    if requests.is_empty() {
        return Err(ModelError::InvalidParameter {
            name: "requests",
            reason: "no request to serve".into(),
        });
    }
    let context = model.context().unwrap_or(usize::MAX);
    for (i, q) in requests.iter().enumerate() {
        q.sampling.check()?;
        if q.prompt.is_empty() || q.max_new_tokens == 0 {
            return Err(ModelError::InvalidParameter {
                name: "requests",
                reason: format!("request {i}: an empty prompt or no token to generate"),
            });
        }
        if q.prompt.len() + q.max_new_tokens > context {
            return Err(ModelError::InvalidParameter {
                name: "requests",
                reason: format!(
                    "request {i}: {} prompt and {} new tokens exceed the model's context of {context}",
                    q.prompt.len(),
                    q.max_new_tokens
                ),
            });
        }
    }
    Ok(())
}

/// Serves `requests` on `model` with continuous batching over `cache`
/// (whose blocks hold the model's K/V), handing each request's output to
/// `on_finished` as it finishes (an error of `on_finished` stops the
/// batch). Refused before any work: what [`check_requests`] refuses, and a
/// request the pool cannot hold (the scheduler's check).
pub fn serve_batch<P: PrefixCache>(
    model: &dyn CausalLm,
    requests: &[BatchRequest],
    cache: &mut KvCacheManager<P>,
    scheduler: &SchedulerConfig,
    on_finished: &mut OnFinished<'_>,
) -> Result<Served> {
    check_requests(model, requests)?;
    let workload = Workload {
        requests: requests
            .iter()
            .enumerate()
            .map(|(id, q)| Request {
                id,
                arrival: q.arrival_step,
                priority: q.priority,
                prompt: q.prompt.clone(),
                shared_prefix: None,
                output_len: q.max_new_tokens - 1,
            })
            .collect(),
    };
    let mut engine = ModelEngine::new(model, requests, on_finished);
    let report = serve(cache, &workload, scheduler, &mut engine)?;
    Ok(engine.served(report))
}
