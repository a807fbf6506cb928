//! Continuous batching of a real model on the paged cache (`kv-eval
//! batch`): paged-cache's scheduler ([`serve`]) decides every step, and
//! [`ModelEngine`] runs it: a prefill per admitted request (after the
//! tokens its prefix-cache hit already holds), then one batched forward
//! pass per decode step over every running request ([`CausalLm::forward_batch`]:
//! the projections' weights read once for the whole batch, attention per
//! sequence over its own pages through [`ReservedSlots`]). Preemption
//! really recomputes (the request's prompt and tokens so far are prefilled
//! again) or swaps (its blocks move to the host tier and back).
//!
//! Token `i` of a request is drawn from stream `i` of its seed, so what a
//! request generates does not depend on what it was batched with, on
//! preemption or on recompute (greedy requests take the most likely token).

use std::time::Instant;

use gf2_codes::channel::FaultRng;
use paged_cache::scheduler::{Engine, Report, Request, SchedulerConfig, Workload, serve};
use paged_cache::{
    BlockStorage, CacheConfig, HashPrefixCache, KvCacheManager, NoPrefixCache, PrefixCache,
    RadixPrefixCache, ReservedSlots, SeqId,
};
use serde::{Deserialize, Serialize};

use crate::backend::layer_specs;
use crate::cache::CacheMode;
use crate::error::{EvalError, Result};
use kv_model::model::Adapted;
use kv_model::model::Sampling;
use kv_model::model::{BatchItem, CausalLm};

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

/// One line of a requests file (JSON).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RequestLine {
    prompt: String,
    max_new_tokens: usize,
    #[serde(default)]
    arrival_step: u64,
    #[serde(default)]
    priority: u32,
    #[serde(default)]
    temperature: f64,
    #[serde(default = "one")]
    top_p: f64,
    #[serde(default)]
    seed: u64,
}

fn one() -> f64 {
    1.0
}

/// The latest `arrival_step` a requests file may give (the scheduler gives
/// up on a run after 100,000,000 steps; idle steps before an arrival count).
pub const MAX_ARRIVAL_STEP: u64 = 10_000_000;

/// Reads a requests file: one JSON object per line (`prompt`,
/// `max_new_tokens`, optional `arrival_step`, `priority`, `temperature`,
/// `top_p`, `seed`; blank lines skipped), prompts tokenised by `encode`.
/// Every refusal names its line: malformed JSON, unknown or missing
/// fields, a negative count, an empty prompt, no token to generate, a
/// prompt and tokens past `context`, a temperature below 0, a top-p
/// outside (0, 1], an arrival past [`MAX_ARRIVAL_STEP`].
pub fn parse_requests(
    text: &str,
    context: usize,
    mut encode: impl FnMut(&str) -> Result<Vec<u32>>,
) -> Result<Vec<BatchRequest>> {
    let mut requests = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let bad = |reason: String| EvalError::InvalidParameter {
            name: "requests",
            reason: format!("line {}: {reason}", i + 1),
        };
        let r: RequestLine = serde_json::from_str(line).map_err(|e| bad(e.to_string()))?;
        if r.max_new_tokens == 0 {
            return Err(bad(
                "max_new_tokens is 0 (a request generates at least one token)".into(),
            ));
        }
        if r.arrival_step > MAX_ARRIVAL_STEP {
            return Err(bad(format!(
                "arrival_step {} is past the last arrival the scheduler waits for \
                 ({MAX_ARRIVAL_STEP})",
                r.arrival_step
            )));
        }
        let sampling = Sampling {
            temperature: r.temperature,
            top_p: r.top_p,
            seed: r.seed,
        };
        sampling.check().map_err(|e| bad(e.to_string()))?;
        let prompt = encode(&r.prompt).map_err(|e| bad(e.to_string()))?;
        if prompt.is_empty() {
            return Err(bad("the prompt has no token".into()));
        }
        if prompt.len().saturating_add(r.max_new_tokens) > context {
            return Err(bad(format!(
                "{} prompt tokens and {} new ones exceed the context of {context}",
                prompt.len(),
                r.max_new_tokens
            )));
        }
        requests.push(BatchRequest {
            prompt,
            max_new_tokens: r.max_new_tokens,
            arrival_step: r.arrival_step,
            priority: r.priority,
            sampling,
        });
    }
    if requests.is_empty() {
        return Err(EvalError::InvalidParameter {
            name: "requests",
            reason: "the file holds no request".into(),
        });
    }
    Ok(requests)
}

/// The simulator's seeded workload (arrivals, priorities, lengths, which
/// requests share which prefix) with real text: shared prefix `p` is the
/// corpus tokens from `p × shared_prefix_len` on, and the rest of each
/// prompt a corpus passage after them at an offset drawn from the seed.
/// Greedy; `output_len` new tokens each.
pub fn workload_requests(
    corpus: &[u32],
    config: &paged_cache::scheduler::WorkloadConfig,
) -> Result<Vec<BatchRequest>> {
    let workload = Workload::generate(config)?;
    let shared = config.shared_prefixes * config.shared_prefix_len;
    let longest = config.prompt_len.1;
    if corpus.len() < shared + 2 * longest {
        return Err(EvalError::InvalidParameter {
            name: "workload",
            reason: format!(
                "the corpus has {} tokens; the workload's prefixes and prompts need {}",
                corpus.len(),
                shared + 2 * longest
            ),
        });
    }
    let mut rng = FaultRng::with_stream(config.seed, 1);
    Ok(workload
        .requests
        .iter()
        .map(|q| {
            let mut prompt = Vec::with_capacity(q.prompt.len());
            if let Some(p) = q.shared_prefix {
                let n = config.shared_prefix_len.min(q.prompt.len() - 1);
                let start = p * config.shared_prefix_len;
                prompt.extend_from_slice(&corpus[start..start + n]);
            }
            let rest = q.prompt.len() - prompt.len();
            let offset = shared + rng.below((corpus.len() - shared - rest) as u64) as usize;
            prompt.extend_from_slice(&corpus[offset..offset + rest]);
            BatchRequest {
                prompt,
                max_new_tokens: q.output_len.max(1),
                arrival_step: q.arrival,
                priority: q.priority,
                sampling: Sampling::default(),
            }
        })
        .collect())
}

/// Which prefix cache the batch's paged cache uses.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub enum PrefixKind {
    /// No prefix caching.
    None,
    /// vLLM's chained block hashes.
    #[default]
    Hash,
    /// SGLang's token radix tree.
    Radix,
}

/// How a batch is served.
#[derive(Clone, Debug, PartialEq)]
pub struct BatchConfig {
    /// Cache forms per layer (`plain`: f32 rows).
    pub mode: CacheMode,
    /// Device blocks, block size and host blocks.
    pub cache: CacheConfig,
    /// The prefix cache.
    pub prefix: PrefixKind,
    /// Watermark, prefill budget, batch size limit and preemption mode
    /// (its `cache` is ignored: `cache` above is used).
    pub scheduler: SchedulerConfig,
}

/// What one request produced and when.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
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

/// 50th, 90th and 99th percentiles (nearest rank), seconds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Percentiles {
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
}

impl Percentiles {
    /// Of `values` (zeros when empty).
    pub fn of(mut values: Vec<f64>) -> Self {
        if values.is_empty() {
            return Self::default();
        }
        values.sort_by(f64::total_cmp);
        let rank =
            |p: f64| values[((p * values.len() as f64).ceil() as usize).clamp(1, values.len()) - 1];
        Self {
            p50: rank(0.5),
            p90: rank(0.9),
            p99: rank(0.99),
        }
    }
}

/// What a batch measured.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct BatchReport {
    /// The scheduler's report (steps, prefix hit rate, preemptions,
    /// utilisation).
    pub scheduler: Report,
    /// Per request, in input order.
    pub outputs: Vec<RequestOutput>,
    /// Wall seconds of the whole batch.
    pub seconds: f64,
    /// Seconds in prefills.
    pub prefill_seconds: f64,
    /// Seconds in batched decode steps.
    pub decode_seconds: f64,
    /// Batched decode steps run.
    pub decode_steps: u64,
    /// Tokens generated, all requests.
    pub generated: u64,
    /// Generated tokens per wall second.
    pub tokens_per_second: f64,
    /// Time to first token.
    pub ttft: Percentiles,
    /// Inter-token latency.
    pub inter_token: Percentiles,
}

impl BatchReport {
    /// A Markdown summary.
    pub fn markdown(&self) -> String {
        let s = &self.scheduler;
        let ms = |p: &Percentiles| {
            format!(
                "{:.1} / {:.1} / {:.1}",
                1e3 * p.p50,
                1e3 * p.p90,
                1e3 * p.p99
            )
        };
        format!(
            "| requests | generated | seconds | tokens/s | TTFT p50/p90/p99 (ms) | ITL p50/p90/p99 (ms) | \
             steps | mean batch | prefilled | prefix hit rate | preempted (recompute/swap) | utilisation mean/peak |\n\
             |---|---|---|---|---|---|---|---|---|---|---|---|\n\
             | {} | {} | {:.2} | {:.1} | {} | {} | {} | {:.1} | {} | {:.1}% | {}/{} | {:.1}%/{:.1}% |\n",
            self.outputs.len(),
            self.generated,
            self.seconds,
            self.tokens_per_second,
            ms(&self.ttft),
            ms(&self.inter_token),
            s.steps,
            s.mean_running,
            s.prefilled_tokens,
            100.0 * s.prefix_hit_rate,
            s.preempted_recompute,
            s.preempted_swap,
            100.0 * s.mean_utilisation,
            100.0 * s.peak_utilisation,
        )
    }
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
}

impl<P: PrefixCache> Engine<P> for ModelEngine<'_> {
    type Error = EvalError;

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

/// A paged cache whose blocks hold `model`'s K/V in `mode`'s forms
/// (every layer's key and value form must be pageable).
pub fn paged_cache<P: PrefixCache>(
    model: &dyn CausalLm,
    mode: &CacheMode,
    config: CacheConfig,
    prefix: P,
) -> Result<KvCacheManager<P>> {
    let specs = layer_specs(model, mode)?;
    for spec in &specs {
        paged_cache::check_pageable(&spec.key, config.block_size)?;
        paged_cache::check_pageable(&spec.value, config.block_size)?;
    }
    let fitted = crate::backend::fitted_tables(mode, specs.len())?;
    crate::budget::check(
        &format!(
            "the device pool of --blocks {} (blocks of {} tokens)",
            config.num_blocks, config.block_size
        ),
        BlockStorage::pool_bytes_fitted(config.num_blocks, config.block_size, &specs, &fitted)?,
    )?;
    let storage = BlockStorage::with_fitted(config.num_blocks, config.block_size, &specs, &fitted)?;
    crate::backend::keep_non_finite(&storage);
    Ok(KvCacheManager::with_storage(
        config,
        prefix,
        std::sync::Arc::new(storage),
    )?)
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
        .ok_or_else(|| EvalError::InvalidParameter {
            name: "cached",
            reason: format!("{cached} of the sequence's {} tokens", held.len()),
        })?;
    let mut slots = Adapted(ReservedSlots::new(cache, seq, cached)?);
    Ok(model.forward(tokens, &mut slots, tokens.len() - 1)?)
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
            return Err(EvalError::InvalidParameter {
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
    Ok(model.forward_batch(&mut items)?)
}

/// Serves `requests` on `model` with continuous batching (see the module
/// docs). Refused before any work: no request, a request past the model's
/// context, forms a block cannot hold, a request the pool cannot hold
/// (the scheduler's check).
pub fn run_batch(
    model: &dyn CausalLm,
    requests: &[BatchRequest],
    config: &BatchConfig,
) -> Result<BatchReport> {
    run_batch_with(model, requests, config, &mut |_, _| Ok(()))
}

/// [`run_batch`], handing each request's output to `on_finished` as the
/// request finishes (to write it out before the batch ends: an error later
/// loses nothing already delivered; an error of `on_finished` stops the
/// batch).
pub fn run_batch_with<'a>(
    model: &'a dyn CausalLm,
    requests: &'a [BatchRequest],
    config: &BatchConfig,
    on_finished: &'a mut OnFinished<'a>,
) -> Result<BatchReport> {
    if requests.is_empty() {
        return Err(EvalError::InvalidParameter {
            name: "requests",
            reason: "no request to serve".into(),
        });
    }
    let context = model.context().unwrap_or(usize::MAX);
    for (i, q) in requests.iter().enumerate() {
        q.sampling.check()?;
        if q.prompt.is_empty() || q.max_new_tokens == 0 {
            return Err(EvalError::InvalidParameter {
                name: "requests",
                reason: format!("request {i}: an empty prompt or no token to generate"),
            });
        }
        if q.prompt.len() + q.max_new_tokens > context {
            return Err(EvalError::InvalidParameter {
                name: "requests",
                reason: format!(
                    "request {i}: {} prompt and {} new tokens exceed the model's context of {context}",
                    q.prompt.len(),
                    q.max_new_tokens
                ),
            });
        }
    }
    let bs = config.cache.block_size;
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
    let scheduler = match config.prefix {
        PrefixKind::None => serve_on(NoPrefixCache, config, &workload, &mut engine)?,
        PrefixKind::Hash => {
            let prefix = HashPrefixCache::new(bs);
            serve_on(prefix, config, &workload, &mut engine)?
        }
        PrefixKind::Radix => {
            let prefix = RadixPrefixCache::new(bs);
            serve_on(prefix, config, &workload, &mut engine)?
        }
    };
    let seconds = engine.start.elapsed().as_secs_f64();
    let outputs = engine.outputs;
    let generated = outputs.iter().map(|o| o.tokens.len() as u64).sum();
    Ok(BatchReport {
        ttft: Percentiles::of(outputs.iter().map(RequestOutput::ttft).collect()),
        inter_token: Percentiles::of(outputs.iter().flat_map(|o| o.inter_token()).collect()),
        scheduler,
        seconds,
        prefill_seconds: engine.prefill_seconds,
        decode_seconds: engine.decode_seconds,
        decode_steps: engine.decode_steps,
        generated,
        tokens_per_second: generated as f64 / seconds.max(f64::MIN_POSITIVE),
        outputs,
    })
}

fn serve_on<P: PrefixCache>(
    prefix: P,
    config: &BatchConfig,
    workload: &Workload,
    engine: &mut ModelEngine<'_>,
) -> Result<Report> {
    let mut cache = paged_cache(engine.model, &config.mode, config.cache, prefix)?;
    serve(&mut cache, workload, &config.scheduler, engine)
}
