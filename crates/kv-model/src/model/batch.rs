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
//!
//! With [`BatchSpeculation`] each request drafts up to `k` tokens a step
//! with a [`Drafter`] of its own (prompt lookup, a draft model on a cache
//! of its own, or the target reading its cache's draft view) or with one
//! draft model for all of them ([`BatchModelDrafter`], batched); the
//! scheduler appends them after the request's next token, the batched
//! pass verifies every request's drafts at once
//! ([`CausalLm::forward_batch_keeping`], the acceptance rules of
//! [`generate_speculative`](super::generate_speculative)) and the rejected
//! rows never enter the cache. A step that decides tokens from output
//! index `i` on draws from stream `1 + i`: greedy output is the plain
//! batch's, and sampled output has the target's distribution, but a
//! sampled request's tokens then depend on the drafts it was given (which
//! the pool, its neighbours and a drafter's own stream change); a step
//! without drafts draws what the plain batch draws.

use std::time::Instant;

use attention::KvBackend;
use gf2_codes::channel::FaultRng;
use paged_cache::scheduler::{
    DecodeItem, DraftItem, Engine, Report, Request, SchedulerConfig, Workload, serve,
};
use paged_cache::{KvCacheManager, PrefixCache, ReservedSlots, SeqId};

use super::batch_draft::DraftAsk;
pub use super::batch_draft::{BatchDrafters, BatchModelDrafter};
use super::speculative::verify;
use super::{Adapted, BatchItem, CausalLm, Draft, Drafter, Sampling, SpeculativeStats};
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
    /// Drafting and verification, where the batch speculated (a
    /// verification pass counted per request and step).
    pub speculation: Option<SpeculativeStats>,
}

/// Speculative decoding in a batch: each request drafts up to `k` tokens a
/// step, with a drafter of its own or with one draft model for all.
#[derive(Debug)]
pub struct BatchSpeculation<'a> {
    /// Drafts per request and step, at most (at least 1, and at most the
    /// context a request's prompt leaves).
    pub k: usize,
    /// How the requests draft.
    pub drafters: BatchDrafters<'a>,
}

/// A speculating engine's drafters (a request's dropped when it
/// finishes).
enum Drafting<'a> {
    PerRequest(Vec<Option<Box<dyn Drafter + 'a>>>),
    Model(BatchModelDrafter<'a>),
}

/// A speculating engine's drafters, their last drafts and the counts.
struct Speculating<'a> {
    k: usize,
    drafters: Drafting<'a>,
    drafts: Vec<Draft>,
    stats: SpeculativeStats,
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
    speculation: Option<Speculating<'a>>,
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
            speculation: None,
        }
    }

    /// Drafts with `speculation` (see [`BatchSpeculation`]); refuses `k`
    /// of 0 or not below the model's context, and drafters for another
    /// number of requests.
    pub fn speculating(mut self, speculation: BatchSpeculation<'a>) -> Result<Self> {
        let BatchSpeculation { k, drafters } = speculation;
        let count = match &drafters {
            BatchDrafters::PerRequest(d) => d.len(),
            BatchDrafters::Model(m) => m.requests(),
        };
        if count != self.requests.len() {
            return Err(ModelError::InvalidParameter {
                name: "drafters",
                reason: format!(
                    "drafters for {count} requests, the batch has {}",
                    self.requests.len()
                ),
            });
        }
        // A request's drafts are capped by the room its output has left,
        // so `k` is refused only where no request could ever take it.
        let context = self.model.context().unwrap_or(usize::MAX);
        if k == 0 || k >= context {
            return Err(ModelError::InvalidParameter {
                name: "k",
                reason: format!(
                    "{k} drafts per step: at least 1 and less than the model's context of \
                     {context}"
                ),
            });
        }
        self.speculation = Some(Speculating {
            k,
            drafts: vec![Draft::default(); count],
            drafters: match drafters {
                BatchDrafters::PerRequest(d) => {
                    Drafting::PerRequest(d.into_iter().map(Some).collect())
                }
                BatchDrafters::Model(m) => Drafting::Model(m),
            },
            stats: SpeculativeStats::default(),
        });
        Ok(self)
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
            speculation: self.speculation.map(|s| s.stats),
        }
    }

    /// A speculating decode step: every item's next token and drafts run
    /// as one batched pass, each item keeping its accepted drafts; returns
    /// how many each kept.
    fn verify_step<P: PrefixCache>(
        &mut self,
        cache: &mut KvCacheManager<P>,
        batch: &[DecodeItem],
    ) -> Result<Vec<usize>> {
        let spec = self.speculation.as_mut().expect("a speculating engine");
        let vocab = self.model.vocab();
        let mut feeds = Vec::with_capacity(batch.len());
        let mut slots = Vec::with_capacity(batch.len());
        let mut drafts = Vec::with_capacity(batch.len());
        let mut firsts = Vec::with_capacity(batch.len());
        for item in batch {
            let held = cache.tokens(item.seq)?;
            let written = held.len() - 1 - item.drafted;
            let feed = held[written..].to_vec();
            let last = &spec.drafts[item.request];
            if last.tokens.get(..item.drafted) != Some(&feed[1..]) {
                return Err(ModelError::InvalidParameter {
                    name: "drafts",
                    reason: format!(
                        "request {}: the step's drafts are not the ones drafted",
                        item.request
                    ),
                });
            }
            drafts.push(Draft {
                tokens: feed[1..].to_vec(),
                probs: last.probs.iter().take(item.drafted).cloned().collect(),
            });
            firsts.push(written + 1 - self.requests[item.request].prompt.len());
            feeds.push(feed);
            slots.push(Adapted(ReservedSlots::new(cache, item.seq, written)?));
        }
        let mut items: Vec<BatchItem<'_>> = slots
            .iter_mut()
            .zip(&feeds)
            .map(|(slots, feed)| BatchItem {
                tokens: feed,
                cache: slots,
                logits_from: 0,
            })
            .collect();
        let mut yielded = vec![Vec::new(); batch.len()];
        let requests = self.requests;
        self.model
            .forward_batch_keeping(&mut items, &mut |i, logits| {
                let sampling = &requests[batch[i].request].sampling;
                let mut rng = FaultRng::with_stream(sampling.seed, 1 + firsts[i] as u64);
                yielded[i] = verify(logits, vocab, &drafts[i], sampling, &mut rng);
                yielded[i].len()
            })?;
        let mut kept = Vec::with_capacity(batch.len());
        for ((item, tokens), &first) in batch.iter().zip(yielded).zip(&firsts) {
            let out = &mut self.outputs[item.request];
            let now = self.start.elapsed().as_secs_f64();
            for (index, &token) in (first..).zip(&tokens) {
                if index >= out.tokens.len() {
                    out.tokens.push(token);
                    out.token_times.push(now);
                }
            }
            let accepted = tokens.len() - 1;
            spec.stats.verify_passes += 1;
            spec.stats.drafted += item.drafted as u64;
            spec.stats.accepted += accepted as u64;
            kept.push(accepted);
        }
        Ok(kept)
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

    fn draft(
        &mut self,
        cache: &mut KvCacheManager<P>,
        batch: &[DraftItem],
    ) -> Result<Vec<Vec<u32>>> {
        let mut out = vec![Vec::new(); batch.len()];
        let Some(spec) = self.speculation.as_mut() else {
            return Ok(out);
        };
        let started = Instant::now();
        let mut asks = Vec::new();
        for (j, item) in batch.iter().enumerate() {
            let (request, seq) = (item.request, item.seq);
            let q = &self.requests[request];
            let held = cache.tokens(seq)?.len();
            // The context is the cache's tokens and the next one.
            let generated = &self.outputs[request].tokens;
            let known = (held + 1).checked_sub(q.prompt.len());
            let Some(next) = known.and_then(|n| generated.get(..n)) else {
                return Err(ModelError::InvalidParameter {
                    name: "seq",
                    reason: format!(
                        "request {request}: {held} tokens held, {} generated",
                        generated.len()
                    ),
                });
            };
            let mut context = q.prompt.clone();
            context.extend_from_slice(next);
            let mut target = Adapted(ReservedSlots::new(cache, seq, held)?);
            // A verification stops at the end of a block a staged form
            // seals (as in `generate_speculative`).
            let sealed = target
                .rows_before_seal()
                .map_or(usize::MAX, |rows| rows.saturating_sub(1));
            let k = spec.k.min(item.max).min(sealed);
            if k == 0 {
                spec.drafts[request] = Draft::default();
                continue;
            }
            match &mut spec.drafters {
                Drafting::PerRequest(drafters) => {
                    let Some(drafter) = drafters[request].as_mut() else {
                        continue;
                    };
                    let mut draft = drafter.propose_on(&context, k, &mut target)?;
                    draft.tokens.truncate(k);
                    draft.probs.truncate(draft.tokens.len());
                    spec.drafts[request] = draft;
                }
                Drafting::Model(_) => asks.push((
                    j,
                    DraftAsk {
                        request,
                        context,
                        k,
                    },
                )),
            }
        }
        if let Drafting::Model(model) = &mut spec.drafters {
            let (at, asks): (Vec<usize>, Vec<DraftAsk>) = asks.into_iter().unzip();
            for (j, tokens) in at.into_iter().zip(model.propose_all(&asks)?) {
                spec.drafts[batch[j].request] = Draft {
                    tokens,
                    probs: Vec::new(),
                };
            }
        }
        let vocab = self.model.vocab();
        for (item, out) in batch.iter().zip(&mut out) {
            let tokens = &spec.drafts[item.request].tokens;
            if let Some(&bad) = tokens.iter().find(|&&d| d as usize >= vocab) {
                return Err(ModelError::TokenId { id: bad, vocab });
            }
            out.clone_from(tokens);
        }
        spec.stats.draft_seconds += started.elapsed().as_secs_f64();
        Ok(out)
    }

    fn decode(
        &mut self,
        cache: &mut KvCacheManager<P>,
        batch: &[DecodeItem],
    ) -> Result<Vec<usize>> {
        let started = Instant::now();
        let kept = if self.speculation.is_some() {
            self.verify_step(cache, batch)?
        } else {
            let seqs: Vec<SeqId> = batch.iter().map(|item| item.seq).collect();
            let logits = decode_step(self.model, cache, &seqs)?;
            for (item, logits) in batch.iter().zip(&logits) {
                let held = cache.tokens(item.seq)?.len();
                self.record(item.request, held, logits);
            }
            vec![0; batch.len()]
        };
        let seconds = started.elapsed().as_secs_f64();
        self.decode_seconds += seconds;
        if let Some(spec) = self.speculation.as_mut() {
            spec.stats.verify_seconds += seconds;
        }
        self.decode_steps += 1;
        Ok(kept)
    }

    fn arrived(&mut self, request: usize) {
        self.outputs[request].arrived = self.start.elapsed().as_secs_f64();
    }

    fn finished(&mut self, request: usize) -> Result<()> {
        match self.speculation.as_mut().map(|s| &mut s.drafters) {
            Some(Drafting::PerRequest(drafters)) => drafters[request] = None,
            Some(Drafting::Model(model)) => model.release(request),
            None => {}
        }
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
    serve_batch_with(model, requests, cache, scheduler, None, on_finished)
}

/// [`serve_batch`] with every request drafting with its drafter of
/// `speculation` (see [`BatchSpeculation`]). Refused before any work, as
/// well as what `serve_batch` refuses: what [`ModelEngine::speculating`]
/// refuses, and a drafter that cannot read the cache
/// ([`Drafter::check_target`]).
pub fn serve_batch_speculative<'a, P: PrefixCache>(
    model: &'a dyn CausalLm,
    requests: &'a [BatchRequest],
    cache: &mut KvCacheManager<P>,
    scheduler: &SchedulerConfig,
    speculation: BatchSpeculation<'a>,
    on_finished: &'a mut OnFinished<'a>,
) -> Result<Served> {
    serve_batch_with(
        model,
        requests,
        cache,
        scheduler,
        Some(speculation),
        on_finished,
    )
}

fn serve_batch_with<'a, P: PrefixCache>(
    model: &'a dyn CausalLm,
    requests: &'a [BatchRequest],
    cache: &mut KvCacheManager<P>,
    scheduler: &SchedulerConfig,
    speculation: Option<BatchSpeculation<'a>>,
    on_finished: &'a mut OnFinished<'a>,
) -> Result<Served> {
    check_requests(model, requests)?;
    let mut engine = ModelEngine::new(model, requests, on_finished);
    if let Some(mut speculation) = speculation {
        if let BatchDrafters::PerRequest(drafters) = &mut speculation.drafters {
            check_targets(cache, &requests[0].prompt[..1], drafters)?;
        }
        engine = engine.speculating(speculation)?;
    }
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
    let report = serve(cache, &workload, scheduler, &mut engine)?;
    Ok(engine.served(report))
}

/// Asks every drafter whether it can read `cache` ([`Drafter::check_target`])
/// through a scratch sequence of `tokens` (nothing written; freed after).
fn check_targets<P: PrefixCache>(
    cache: &mut KvCacheManager<P>,
    tokens: &[u32],
    drafters: &mut [Box<dyn Drafter + '_>],
) -> Result<()> {
    let (seq, _) = cache.add_sequence(tokens, 0)?;
    let checked = ReservedSlots::new(cache, seq, tokens.len())
        .map_err(ModelError::from)
        .and_then(|slots| {
            let mut target = Adapted(slots);
            drafters
                .iter()
                .try_for_each(|d| d.check_target(&mut target))
        });
    cache.free(seq)?;
    checked
}
