//! `kv-eval batch`: a requests file ([`parse_requests`]) or a synthetic
//! workload served with continuous batching by kv-model's engine
//! ([`kv_model::model::batch`]: paged-cache's scheduler decides every
//! step, a prefill per admitted request, one batched forward pass per
//! decode step) on a paged cache in any of kv-eval's forms and prefix
//! caches, and the report: throughput, time to first token and
//! inter-token latency percentiles, the scheduler's counts; with
//! speculative decoding ([`run_batch_speculative`]) every request drafts
//! with a drafter of its own and the report adds the acceptance.

use gf2_codes::channel::FaultRng;
use kv_model::model::batch::{
    BatchRequest, BatchSpeculation, RequestOutput, Served, check_requests, serve_batch,
    serve_batch_speculative,
};
use kv_model::model::{CausalLm, Sampling, SpeculativeStats};
use paged_cache::scheduler::{Report, SchedulerConfig, Workload};
use paged_cache::{
    BlockStorage, CacheConfig, HashPrefixCache, KvCacheManager, NoPrefixCache, PrefixCache,
    RadixPrefixCache,
};
use serde::{Deserialize, Serialize};

use crate::backend::layer_specs;
use crate::cache::CacheMode;
use crate::error::{EvalError, Result};

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
    /// Why the batch served with another prefix cache than asked, if it
    /// did (forms fitted per sequence turn prefix caching off).
    pub notice: Option<String>,
    /// Drafting and verification, where the batch speculated (a
    /// verification counted per request and step).
    pub speculation: Option<SpeculativeStats>,
}

impl BatchReport {
    /// A Markdown summary.
    pub fn markdown(&self) -> String {
        let notice = self
            .notice
            .as_ref()
            .map_or_else(String::new, |n| format!("Note: {n}\n\n"));
        notice + &self.table()
    }

    /// The Markdown table of [`markdown`](Self::markdown).
    fn table(&self) -> String {
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
        ) + &self.speculation.map_or_else(String::new, |p| {
            format!(
                "\nSpeculation: {} verifications, {} drafted, {} accepted ({:.1}%), {:.2} tokens \
                 per request and step; drafting {:.2} s, verifying {:.2} s.\n",
                p.verify_passes,
                p.drafted,
                p.accepted,
                100.0 * p.acceptance_rate(),
                p.tokens_per_pass(),
                p.draft_seconds,
                p.verify_seconds
            )
        })
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
    paged_cache_for(model, mode, config, prefix, 1)
}

/// [`paged_cache`] serving up to `running` sequences at once: the memory
/// budget counts the tables forms fitted per sequence keep for each.
fn paged_cache_for<P: PrefixCache>(
    model: &dyn CausalLm,
    mode: &CacheMode,
    config: CacheConfig,
    prefix: P,
    running: usize,
) -> Result<KvCacheManager<P>> {
    let specs = layer_specs(model, mode)?;
    for spec in &specs {
        paged_cache::check_pageable(&spec.key, config.block_size)?;
        paged_cache::check_pageable(&spec.value, config.block_size)?;
    }
    let fitted = crate::backend::fitted_tables(model, mode)?;
    crate::budget::check(
        &format!(
            "the device pool of --blocks {} (blocks of {} tokens)",
            config.num_blocks, config.block_size
        ),
        BlockStorage::pool_bytes_fitted(config.num_blocks, config.block_size, &specs, &fitted)?
            .saturating_add(
                BlockStorage::sequence_bytes_fitted(config.block_size, &specs, &fitted)?
                    .saturating_mul(running as u64),
            ),
    )?;
    let storage = BlockStorage::with_fitted(config.num_blocks, config.block_size, &specs, &fitted)?;
    crate::backend::keep_non_finite(&storage);
    Ok(KvCacheManager::with_storage(
        config,
        prefix,
        std::sync::Arc::new(storage),
    )?)
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

/// Called with each request's index and output as it finishes.
pub type OnFinished<'a> = dyn FnMut(usize, &RequestOutput) -> Result<()> + 'a;

/// [`run_batch`], handing each request's output to `on_finished` as the
/// request finishes (to write it out before the batch ends: an error later
/// loses nothing already delivered; an error of `on_finished` stops the
/// batch).
pub fn run_batch_with(
    model: &dyn CausalLm,
    requests: &[BatchRequest],
    config: &BatchConfig,
    on_finished: &mut OnFinished<'_>,
) -> Result<BatchReport> {
    run_batch_inner(model, requests, config, None, on_finished)
}

/// [`run_batch_with`] with speculative decoding: each request drafts up
/// to `speculation.k` tokens a step with its drafter and the batched pass
/// verifies them (kv-model's [`serve_batch_speculative`]); the report
/// adds the acceptance ([`BatchReport::speculation`]). Refused before any
/// work, as well as what `run_batch_with` refuses: `k` of 0 or past the
/// context a prompt leaves, a drafter count other than the requests', a
/// drafter that cannot read the cache (a self-draft on forms without a
/// 4-bit view).
pub fn run_batch_speculative(
    model: &dyn CausalLm,
    requests: &[BatchRequest],
    config: &BatchConfig,
    speculation: BatchSpeculation<'_>,
    on_finished: &mut OnFinished<'_>,
) -> Result<BatchReport> {
    run_batch_inner(model, requests, config, Some(speculation), on_finished)
}

fn run_batch_inner(
    model: &dyn CausalLm,
    requests: &[BatchRequest],
    config: &BatchConfig,
    speculation: Option<BatchSpeculation<'_>>,
    on_finished: &mut OnFinished<'_>,
) -> Result<BatchReport> {
    check_requests(model, requests)?;
    let bs = config.cache.block_size;
    let (prefix, notice) = prefix_for(&config.mode, config.prefix);
    let run = (model, requests, config, speculation);
    let served = match prefix {
        PrefixKind::None => serve_on(NoPrefixCache, run, on_finished)?,
        PrefixKind::Hash => serve_on(HashPrefixCache::new(bs), run, on_finished)?,
        PrefixKind::Radix => serve_on(RadixPrefixCache::new(bs), run, on_finished)?,
    };
    let outputs = served.outputs;
    let generated = outputs.iter().map(|o| o.tokens.len() as u64).sum();
    Ok(BatchReport {
        ttft: Percentiles::of(outputs.iter().map(RequestOutput::ttft).collect()),
        inter_token: Percentiles::of(outputs.iter().flat_map(|o| o.inter_token()).collect()),
        scheduler: served.scheduler,
        seconds: served.seconds,
        prefill_seconds: served.prefill_seconds,
        decode_seconds: served.decode_seconds,
        decode_steps: served.decode_steps,
        generated,
        tokens_per_second: generated as f64 / served.seconds.max(f64::MIN_POSITIVE),
        outputs,
        notice,
        speculation: served.speculation,
    })
}

/// The prefix cache a batch in `mode` serves with when `asked` for one,
/// and why, where it differs: a form fitting its tables on each sequence
/// (`shard-k3`) codes a sequence's blocks on its own tables, fitted on
/// more than the shared prefix, so another sequence reusing them would
/// read its prefix as the first sequence's fit coded it, not its own
/// (paged-cache's manager shares nothing for such forms either);
/// prefix caching is off for it. A sequence preempted by recomputation
/// fits its tables again on its prompt and the tokens it had generated.
pub fn prefix_for(mode: &CacheMode, asked: PrefixKind) -> (PrefixKind, Option<String>) {
    let per_sequence = mode.forms().into_iter().find(|(form, _)| {
        matches!(form.quantizer(), kv_quant::Quantizer::Shard(spec) if !spec.calibrated)
    });
    match per_sequence {
        Some((form, _)) if asked != PrefixKind::None => (
            PrefixKind::None,
            Some(format!(
                "prefix caching is off: {form} fits its tables on each sequence, and a block \
                 coded on one sequence's tables is not another's (its calibrated `-cal` twin \
                 shares blocks)"
            )),
        ),
        _ => (asked, None),
    }
}

/// The batch on a paged cache in `config`'s forms with prefix cache
/// `prefix`, served by kv-model's engine (speculating where a
/// [`BatchSpeculation`] is given).
fn serve_on<P: PrefixCache>(
    prefix: P,
    (model, requests, config, speculation): (
        &dyn CausalLm,
        &[BatchRequest],
        &BatchConfig,
        Option<BatchSpeculation<'_>>,
    ),
    on_finished: &mut OnFinished<'_>,
) -> Result<Served> {
    let running = config.scheduler.max_running.min(requests.len());
    let mut cache = paged_cache_for(model, &config.mode, config.cache, prefix, running)?;
    let mut deliver = |i: usize, out: &RequestOutput| on_finished(i, out).map_err(Into::into);
    let scheduler = &config.scheduler;
    Ok(match speculation {
        None => serve_batch(model, requests, &mut cache, scheduler, &mut deliver)?,
        Some(speculation) => serve_batch_speculative(
            model,
            requests,
            &mut cache,
            scheduler,
            speculation,
            &mut deliver,
        )?,
    })
}
