//! A continuous-batching scheduler (Orca's iteration-level scheduling with
//! vLLM's admission watermark and preemption) driving a [`KvCacheManager`]
//! and an [`Engine`] that computes the steps: [`serve`] runs it with any
//! engine (kv-eval's real model), [`simulate`] over a metadata-only cache
//! with fixed tokens.
//!
//! Each step:
//! 1. requests that have arrived join the waiting queue (first come, first served);
//! 2. swapped-out requests come back first, while the free blocks left
//!    stay above the watermark;
//! 3. waiting requests are admitted in order while free blocks stay above
//!    the watermark and the step's prefill token budget lasts: their prompt
//!    is looked up in the prefix cache and the rest is prefilled (a request
//!    preempted by recompute comes back with the tokens it had generated);
//! 4. every running request grows by one token, and by the tokens its
//!    engine drafts after it ([`Engine::draft`], speculative decoding; the
//!    drafts are dropped before anything is preempted for them); when
//!    blocks run out, the lowest-priority request (the newest among
//!    equals) is preempted, by recompute (its blocks freed, lazily cached)
//!    or by swap (moved to the host tier; recompute when the host tier is
//!    full); a victim that had appended this step gives those tokens back
//!    first;
//! 5. the engine decodes the requests that appended, as one batch, and
//!    says how many drafts each keeps; the rest are cut off again;
//! 6. finished requests enter the prefix cache and are freed.
//!
//! [`Workload::generate`] draws requests from a seed with a stable
//! generator (gf2-codes' ChaCha8-based `FaultRng`), so a seed gives the
//! same workload and the same report on every machine.

use std::collections::VecDeque;

use gf2_codes::channel::FaultRng;
use serde::Serialize;

use crate::error::{PagedCacheError, Result};
use crate::manager::{CacheConfig, KvCacheManager, SeqId};
use crate::prefix::PrefixCache;

/// Parameters of a simulated workload.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct WorkloadConfig {
    /// Seed of every random draw.
    pub seed: u64,
    /// Requests in all.
    pub requests: usize,
    /// Mean arrivals per step (Poisson).
    pub arrivals_per_step: f64,
    /// Prompt lengths, uniform in `min..=max` (shared prefix included).
    pub prompt_len: (usize, usize),
    /// Output lengths, uniform in `min..=max`.
    pub output_len: (usize, usize),
    /// Distinct shared prefixes (system prompts, few-shot headers); 0 for none.
    pub shared_prefixes: usize,
    /// Tokens of each shared prefix.
    pub shared_prefix_len: usize,
    /// Fraction of requests that start with a shared prefix.
    pub shared_fraction: f64,
    /// Priority levels (0 is the lowest); drawn uniformly.
    pub priorities: u32,
    /// Token ids are drawn below this.
    pub vocab: u32,
}

impl Default for WorkloadConfig {
    fn default() -> Self {
        Self {
            seed: 0,
            requests: 400,
            arrivals_per_step: 2.0,
            prompt_len: (64, 512),
            output_len: (16, 256),
            shared_prefixes: 4,
            shared_prefix_len: 192,
            shared_fraction: 0.6,
            priorities: 3,
            vocab: 49_152,
        }
    }
}

/// One simulated request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Request {
    /// Index in the workload.
    pub id: usize,
    /// Step at which it arrives.
    pub arrival: u64,
    /// Priority (higher is more important).
    pub priority: u32,
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// The shared prefix the prompt starts with (index into the workload's
    /// prefixes), if any.
    pub shared_prefix: Option<usize>,
    /// Tokens appended after the prompt (one per decode step, or more
    /// where an engine's drafts are kept). A model engine samples a token
    /// from the prefill's logits too, so it generates `output_len + 1`
    /// tokens.
    pub output_len: usize,
}

/// The most token ids a workload may hold (prompts and shared prefixes):
/// 2^28, a GiB of ids.
pub const MAX_WORKLOAD_TOKENS: usize = 1 << 28;

/// A generated list of requests, in arrival order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Workload {
    /// The requests.
    pub requests: Vec<Request>,
}

fn uniform(rng: &mut FaultRng, (lo, hi): (usize, usize)) -> usize {
    lo + rng.below((hi - lo + 1) as u64) as usize
}

impl Workload {
    /// Draws a workload.
    pub fn generate(config: &WorkloadConfig) -> Result<Self> {
        let bad = |name, reason: &str| {
            Err(PagedCacheError::InvalidParameter {
                name,
                reason: reason.into(),
            })
        };
        if config.prompt_len.0 == 0 || config.prompt_len.0 > config.prompt_len.1 {
            return bad("prompt_len", "needs 1 <= min <= max");
        }
        if config.output_len.0 == 0 || config.output_len.0 > config.output_len.1 {
            return bad("output_len", "needs 1 <= min <= max");
        }
        if !(config.arrivals_per_step.is_finite() && config.arrivals_per_step > 0.0) {
            return bad("arrivals_per_step", "needs a positive rate");
        }
        if !(0.0..=1.0).contains(&config.shared_fraction) {
            return bad("shared_fraction", "needs a fraction in [0, 1]");
        }
        if config.vocab == 0 || config.priorities == 0 {
            return bad("vocab/priorities", "need at least one");
        }
        // Every token id is held at once: refuse workloads past the budget
        // before drawing (and before sizes can overflow).
        let budget = MAX_WORKLOAD_TOKENS;
        let tokens = |n: usize, len: usize| n.checked_mul(len).filter(|&t| t <= budget);
        if tokens(config.requests, config.prompt_len.1).is_none()
            || tokens(config.shared_prefixes, config.shared_prefix_len).is_none()
            || config.output_len.1 > budget
        {
            return Err(PagedCacheError::InvalidParameter {
                name: "requests",
                reason: format!(
                    "{} requests of up to {} prompt tokens ({} shared prefixes of {}, outputs up to {}) \
                     exceed the simulation's budget of {budget} tokens",
                    config.requests,
                    config.prompt_len.1,
                    config.shared_prefixes,
                    config.shared_prefix_len,
                    config.output_len.1
                ),
            });
        }
        let mut rng = FaultRng::with_stream(config.seed, 0);
        let prefixes: Vec<Vec<u32>> = (0..config.shared_prefixes)
            .map(|_| {
                (0..config.shared_prefix_len)
                    .map(|_| rng.below(u64::from(config.vocab)) as u32)
                    .collect()
            })
            .collect();
        let mut requests = Vec::with_capacity(config.requests);
        let mut clock = 0.0f64;
        for id in 0..config.requests {
            // Exponential gaps: Poisson arrivals.
            clock += -(1.0 - rng.next_f64()).ln() / config.arrivals_per_step;
            let len = uniform(&mut rng, config.prompt_len);
            let mut prompt = Vec::with_capacity(len);
            let mut shared_prefix = None;
            if !prefixes.is_empty() && rng.next_f64() < config.shared_fraction {
                let i = rng.below(prefixes.len() as u64) as usize;
                let p = &prefixes[i];
                prompt.extend_from_slice(&p[..p.len().min(len - 1)]);
                shared_prefix = Some(i);
            }
            while prompt.len() < len {
                prompt.push(rng.below(u64::from(config.vocab)) as u32);
            }
            requests.push(Request {
                id,
                arrival: clock as u64,
                priority: rng.below(u64::from(config.priorities)) as u32,
                prompt,
                shared_prefix,
                output_len: uniform(&mut rng, config.output_len),
            });
        }
        Ok(Self { requests })
    }
}

/// How a request is preempted when blocks run out.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Preemption {
    /// Free its blocks and prefill it again later.
    Recompute,
    /// Move its blocks to the host tier and back later.
    Swap,
}

/// Scheduler settings.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct SchedulerConfig {
    /// Device blocks, block size and host blocks.
    #[serde(skip)]
    pub cache: CacheConfig,
    /// Fraction of blocks that admission keeps free (vLLM's watermark).
    pub watermark: f64,
    /// Prompt tokens prefilled per step (at least one request is always admitted).
    pub max_prefill_tokens: usize,
    /// Requests running at once.
    pub max_running: usize,
    /// Preemption mode.
    pub preemption: Preemption,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        Self {
            cache: CacheConfig {
                num_blocks: 2048,
                block_size: 16,
                host_blocks: 4096,
            },
            watermark: 0.01,
            max_prefill_tokens: 4096,
            max_running: 256,
            preemption: Preemption::Recompute,
        }
    }
}

/// What a simulation measured.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Report {
    /// Prefix cache (`hash`, `radix`, `none`).
    pub prefix_cache: String,
    /// Preemption mode.
    pub preemption: String,
    /// Steps until every request finished.
    pub steps: u64,
    /// Requests finished.
    pub finished: usize,
    /// Tokens processed per step (prefilled + decoded), mean.
    pub tokens_per_step: f64,
    /// Tokens decoded (generated).
    pub decoded_tokens: u64,
    /// Prompt tokens prefilled (not found cached).
    pub prefilled_tokens: u64,
    /// Preemptions by recompute.
    pub preempted_recompute: u64,
    /// Preemptions by swap.
    pub preempted_swap: u64,
    /// Prompt tokens found in the prefix cache over prompt tokens looked up.
    pub prefix_hit_rate: f64,
    /// Blocks in use over all blocks, mean over steps.
    pub mean_utilisation: f64,
    /// Highest utilisation of any step.
    pub peak_utilisation: f64,
    /// Allocated but unused slots per running request, mean over steps.
    pub mean_waste_per_seq: f64,
    /// Largest unused slots of any one request at any step (always below the block size).
    pub max_waste_per_seq: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// Blocks copied on write.
    pub cow_copies: u64,
    /// Mean running requests per step.
    pub mean_running: f64,
    /// Tokens drafted after the decoded ones (speculative decoding).
    pub drafted_tokens: u64,
    /// Drafted tokens the engine kept (counted in `decoded_tokens` too).
    pub accepted_tokens: u64,
}

struct Running {
    request: usize,
    seq: SeqId,
    generated: usize,
    /// Tokens it appended for the current step's decode (its next token
    /// and the drafts after it; 0 when it does not decode this step).
    appended: usize,
    /// The drafts its engine proposed for the current step, not yet
    /// appended.
    drafts: Vec<u32>,
}

/// A request to draft for, in a decode step ([`Engine::draft`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DraftItem {
    /// The request.
    pub request: usize,
    /// Its sequence: its tokens before the next one, K/V computed.
    pub seq: SeqId,
    /// Drafts it may take at most (what its output has room for after
    /// its next token).
    pub max: usize,
}

/// One request's share of a decode step ([`Engine::decode`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DecodeItem {
    /// The request.
    pub request: usize,
    /// Its sequence.
    pub seq: SeqId,
    /// Drafted tokens appended after its next token (0 without
    /// speculation): the step's last `1 + drafted` tokens hold no K/V yet.
    pub drafted: usize,
}

/// Token `i` generated by request `r` (a fixed function, so recomputed
/// requests regenerate the same tokens).
fn generated_token(r: usize, i: usize, vocab: u32) -> u32 {
    let mut x = (r as u64) << 32 ^ i as u64 ^ 0x9E37_79B9_7F4A_7C15;
    x ^= x >> 33;
    x = x.wrapping_mul(0xFF51_AFD7_ED55_8CCD);
    x ^= x >> 33;
    (x % u64::from(vocab)) as u32
}

/// The model side of continuous batching: what [`serve`] asks of whatever
/// computes the K/V rows and picks the tokens (a real model in kv-eval;
/// [`simulate`] uses a fixed token function and computes nothing).
///
/// Slots come from the scheduler: when [`prefill`](Self::prefill) or
/// [`decode`](Self::decode) is called, every slot the engine must write is
/// already reserved in `cache` and exclusive to its sequence (a shared block
/// was copied first), so the engine can write them through
/// [`ReservedSlots`](crate::ReservedSlots).
pub trait Engine<P: PrefixCache> {
    /// The engine's error; the cache manager's errors convert into it.
    type Error: From<PagedCacheError>;

    /// The token request `request` appends at its decode step `index`
    /// (counted from 0 after its prompt). Asked only after the step that
    /// decides it: the prefill for index 0, decode step `index - 1` after.
    fn token(&self, request: usize, index: usize) -> u32;

    /// Request `request` was admitted as `seq`: its first `cached` tokens
    /// hold K/V already (a prefix-cache hit); compute the rest (at least
    /// the last token, whose logits decide what it appends first).
    fn prefill(
        &mut self,
        cache: &mut KvCacheManager<P>,
        request: usize,
        seq: SeqId,
        cached: usize,
    ) -> std::result::Result<(), Self::Error>;

    /// For each item of `batch` (every running request with room for a
    /// draft, asked once a step and all together, so an engine may draft
    /// them in one batched pass), up to `max` tokens to append after its
    /// next token this step, for the decode step to verify (speculative
    /// decoding). The default drafts nothing (plain decoding).
    fn draft(
        &mut self,
        cache: &mut KvCacheManager<P>,
        batch: &[DraftItem],
    ) -> std::result::Result<Vec<Vec<u32>>, Self::Error> {
        let _ = cache;
        Ok(vec![Vec::new(); batch.len()])
    }

    /// One decode step: each item of `batch` has just appended its next
    /// token and `drafted` tokens after it; compute their K/V (and so what
    /// each appends next) and return how many of each item's drafts it
    /// keeps (at most `drafted`; the scheduler cuts the rest off the
    /// sequence, so an engine keeps their K/V out of the cache, as
    /// [`ReservedSlots`](crate::ReservedSlots)' `commit_prefix` does).
    fn decode(
        &mut self,
        cache: &mut KvCacheManager<P>,
        batch: &[DecodeItem],
    ) -> std::result::Result<Vec<usize>, Self::Error>;

    /// Request `request` joined the waiting queue (its arrival step came).
    fn arrived(&mut self, _request: usize) {}

    /// Request `request` ran its last decode step (an engine may deliver
    /// its output now; an error stops the serving with it).
    fn finished(&mut self, _request: usize) -> std::result::Result<(), Self::Error> {
        Ok(())
    }
}

impl SchedulerConfig {
    /// Refuses a watermark outside [0, 1) and `max_running` 0 (the
    /// scheduler's own parameters; `cache` is checked where a cache is
    /// made).
    pub fn check(&self) -> Result<()> {
        if !(0.0..1.0).contains(&self.watermark) {
            return Err(PagedCacheError::InvalidParameter {
                name: "watermark",
                reason: format!(
                    "{}: the fraction of blocks kept free must be in [0, 1)",
                    self.watermark
                ),
            });
        }
        if self.max_running == 0 {
            return Err(PagedCacheError::InvalidParameter {
                name: "max_running",
                reason: "0: no request could ever run".into(),
            });
        }
        Ok(())
    }
}

/// The simulation's engine: request `r`'s token `i` is a fixed function of
/// `(r, i)`, and nothing is computed.
struct Simulated {
    vocab: u32,
}

impl<P: PrefixCache> Engine<P> for Simulated {
    type Error = PagedCacheError;

    fn token(&self, request: usize, index: usize) -> u32 {
        generated_token(request, index, self.vocab)
    }

    fn prefill(&mut self, _: &mut KvCacheManager<P>, _: usize, _: SeqId, _: usize) -> Result<()> {
        Ok(())
    }

    fn decode(&mut self, _: &mut KvCacheManager<P>, batch: &[DecodeItem]) -> Result<Vec<usize>> {
        Ok(vec![0; batch.len()])
    }
}

/// Runs `workload` to completion on a metadata-only cache and reports.
pub fn simulate<P: PrefixCache>(
    workload: &Workload,
    vocab: u32,
    config: &SchedulerConfig,
    prefix: P,
) -> Result<Report> {
    let mut cache = KvCacheManager::new(config.cache, prefix)?;
    serve(&mut cache, workload, config, &mut Simulated { vocab })
}

/// Serves `workload` to completion on `cache` (whose pool, block size and
/// host tier are used; `config.cache` is not) with `engine` computing the
/// steps, and reports. See the module docs for the policy; a request runs
/// `output_len` decode steps, and a request whose whole prompt is found
/// cached recomputes its last token (its logits are needed).
pub fn serve<P: PrefixCache, E: Engine<P>>(
    cache: &mut KvCacheManager<P>,
    workload: &Workload,
    config: &SchedulerConfig,
    engine: &mut E,
) -> std::result::Result<Report, E::Error> {
    config.check()?;
    let bs = cache.block_size();
    let total = cache.pool().num_blocks();
    let watermark = (config.watermark * total as f64).ceil() as usize;
    let reqs = &workload.requests;
    if let Some(q) = reqs
        .iter()
        .find(|q| q.prompt.is_empty() || (q.prompt.len() + q.output_len).div_ceil(bs) > total)
    {
        return Err(PagedCacheError::InvalidParameter {
            name: "workload",
            reason: format!(
                "request {} grows to {} tokens, more than the pool's {} blocks of {bs} hold \
                 (or has no prompt)",
                q.id,
                q.prompt.len() + q.output_len,
                total
            ),
        }
        .into());
    }
    // Tokens each request has generated so far (kept across recompute).
    let mut generated = vec![0usize; reqs.len()];
    let mut waiting: VecDeque<usize> = VecDeque::new();
    let mut swapped: Vec<(usize, SeqId)> = Vec::new();
    let mut running: Vec<Running> = Vec::new();
    let mut next_arrival = 0;
    let mut report = Report {
        prefix_cache: cache.prefix_cache().name().into(),
        preemption: format!("{:?}", config.preemption).to_lowercase(),
        block_size: bs,
        ..Report::default()
    };
    let start = cache.stats();
    let (mut tokens_sum, mut util_sum, mut waste_sum, mut waste_n, mut running_sum) =
        (0u64, 0.0, 0.0, 0u64, 0u64);
    let mut step = 0u64;
    while report.finished < reqs.len() {
        while next_arrival < reqs.len() && reqs[next_arrival].arrival <= step {
            waiting.push_back(next_arrival);
            engine.arrived(next_arrival);
            next_arrival += 1;
        }
        let mut step_tokens = 0u64;
        // Swapped-out requests first: highest priority, then oldest.
        swapped.sort_by_key(|&(r, _)| (std::cmp::Reverse(reqs[r].priority), r));
        while let Some(&(r, seq)) = swapped.first() {
            let blocks = cache.tokens(seq)?.len().div_ceil(bs);
            // Alone, a request may dip into the watermark (as admission does).
            let reserve = if running.is_empty() { 0 } else { watermark };
            if cache.available_blocks() < blocks + reserve || running.len() >= config.max_running {
                break;
            }
            cache.swap_in(seq)?;
            swapped.remove(0);
            running.push(Running {
                request: r,
                seq,
                generated: generated[r],
                appended: 0,
                drafts: Vec::new(),
            });
        }
        // Admission.
        let mut budget = config.max_prefill_tokens;
        let mut admitted = 0;
        while let Some(&r) = waiting.front() {
            if running.len() >= config.max_running || !swapped.is_empty() {
                break;
            }
            let mut tokens = reqs[r].prompt.clone();
            tokens.extend((0..generated[r]).map(|i| engine.token(r, i)));
            let blocks = tokens.len().div_ceil(bs) + 1;
            if blocks > total {
                return Err(PagedCacheError::InvalidParameter {
                    name: "workload",
                    reason: format!("request {r} needs {blocks} blocks, the pool has {total}"),
                }
                .into());
            }
            let fits = cache.available_blocks() >= blocks + watermark || running.is_empty();
            if !fits || (admitted > 0 && tokens.len() > budget) {
                break;
            }
            let Some((seq, cached)) = admit(cache, &tokens)? else {
                break;
            };
            waiting.pop_front();
            engine.prefill(cache, r, seq, cached)?;
            // Prefilled and written: full prompt blocks become findable now.
            cache.cache_prefix(seq, tokens.len() / bs * bs)?;
            let computed = (tokens.len() - cached) as u64;
            report.prefilled_tokens += computed;
            step_tokens += computed;
            budget = budget.saturating_sub(tokens.len() - cached);
            admitted += 1;
            running.push(Running {
                request: r,
                seq,
                generated: generated[r],
                appended: 0,
                drafts: Vec::new(),
            });
        }
        if running.is_empty() && next_arrival == reqs.len() {
            // Nothing runs, nothing more arrives, and nothing was
            // admitted or swapped in: every later step would be this one.
            return Err(PagedCacheError::InvalidParameter {
                name: "workload",
                reason: format!(
                    "no progress at step {step}: {} waiting, {} swapped out, {} of {total} \
                     blocks available, {} host blocks free",
                    waiting.len(),
                    swapped.len(),
                    cache.available_blocks(),
                    cache.host_free()
                ),
            }
            .into());
        }
        // Decode: one token per running request (and its drafts),
        // preempting when short.
        // Every running request with room for drafts drafts now, all
        // together (a preempted request's drafts go unused).
        let (asks, at): (Vec<DraftItem>, Vec<usize>) = running
            .iter()
            .enumerate()
            .filter_map(|(j, run)| {
                let left = reqs[run.request].output_len.saturating_sub(run.generated);
                let ask = DraftItem {
                    request: run.request,
                    seq: run.seq,
                    max: left.saturating_sub(1),
                };
                (left > 1).then_some((ask, j))
            })
            .unzip();
        if !asks.is_empty() {
            let drafted = engine.draft(cache, &asks)?;
            if drafted.len() != asks.len() {
                return Err(PagedCacheError::InvalidParameter {
                    name: "engine",
                    reason: format!(
                        "drafted for {} of the step's {} requests",
                        drafted.len(),
                        asks.len()
                    ),
                }
                .into());
            }
            for ((ask, mut d), &j) in asks.iter().zip(drafted).zip(&at) {
                d.truncate(ask.max);
                running[j].drafts = d;
            }
        }
        let mut i = 0;
        // The step of the request being appended (kept while others are
        // preempted for it).
        let mut pending: Option<(SeqId, Vec<u32>)> = None;
        while i < running.len() {
            let (r, seq) = (running[i].request, running[i].seq);
            let left = reqs[r].output_len.saturating_sub(running[i].generated);
            if left == 0 {
                i += 1;
                continue;
            }
            let step = match pending.take() {
                Some((s, step)) if s == seq => step,
                _ => {
                    let mut step = vec![engine.token(r, running[i].generated)];
                    step.append(&mut running[i].drafts);
                    step
                }
            };
            // Drafts are dropped before anyone is preempted for them: this
            // request's first, then those appended before it this step.
            let appended = match cache.append(seq, &step) {
                Err(PagedCacheError::PoolExhausted { .. }) if step.len() > 1 => {
                    cache.append(seq, &step[..1]).map(|()| 1)
                }
                other => other.map(|()| step.len()),
            };
            match appended {
                Ok(n) => {
                    running[i].generated += 1;
                    running[i].appended = n;
                    generated[r] = running[i].generated;
                    report.decoded_tokens += 1;
                    report.drafted_tokens += n as u64 - 1;
                    step_tokens += 1;
                    i += 1;
                }
                Err(PagedCacheError::PoolExhausted { .. }) => {
                    // From now on only its next token is appended.
                    pending = Some((seq, step[..1].to_vec()));
                    if let Some(run) = running.iter_mut().find(|run| run.appended > 1) {
                        cache.truncate(run.seq, run.appended - 1)?;
                        report.drafted_tokens -= run.appended as u64 - 1;
                        run.appended = 1;
                        continue;
                    }
                    let victim = (0..running.len())
                        .min_by_key(|&j| {
                            let q = &reqs[running[j].request];
                            (
                                q.priority,
                                std::cmp::Reverse(q.arrival),
                                std::cmp::Reverse(q.id),
                            )
                        })
                        .expect("running is not empty");
                    let mut v = running.remove(victim);
                    if v.appended > 0 {
                        // Its step did not happen: the tokens appended
                        // without K/V go, so it comes back whole.
                        cache.truncate(v.seq, v.appended)?;
                        v.generated -= 1;
                        generated[v.request] = v.generated;
                        report.decoded_tokens -= 1;
                        report.drafted_tokens -= v.appended as u64 - 1;
                        step_tokens -= 1;
                    }
                    let swap = config.preemption == Preemption::Swap
                        && cache.host_free() >= cache.block_table(v.seq)?.len();
                    if swap {
                        cache.swap_out(v.seq)?;
                        swapped.push((v.request, v.seq));
                        report.preempted_swap += 1;
                    } else {
                        cache.free(v.seq)?;
                        waiting.push_front(v.request);
                        report.preempted_recompute += 1;
                    }
                    if victim < i {
                        i -= 1;
                    }
                }
                Err(e) => return Err(e.into()),
            }
        }
        let batch: Vec<DecodeItem> = running
            .iter_mut()
            .filter_map(|run| {
                let n = std::mem::take(&mut run.appended);
                (n > 0).then_some(DecodeItem {
                    request: run.request,
                    seq: run.seq,
                    drafted: n - 1,
                })
            })
            .collect();
        if !batch.is_empty() {
            let kept = engine.decode(cache, &batch)?;
            if kept.len() != batch.len() {
                return Err(PagedCacheError::InvalidParameter {
                    name: "engine",
                    reason: format!(
                        "decode answered for {} of the step's {} requests",
                        kept.len(),
                        batch.len()
                    ),
                }
                .into());
            }
            for (item, &kept) in batch.iter().zip(&kept) {
                if kept > item.drafted {
                    return Err(PagedCacheError::InvalidParameter {
                        name: "engine",
                        reason: format!(
                            "request {} keeps {kept} of its {} drafts",
                            item.request, item.drafted
                        ),
                    }
                    .into());
                }
                if item.drafted > kept {
                    cache.truncate(item.seq, item.drafted - kept)?;
                }
                let run = running
                    .iter_mut()
                    .find(|run| run.seq == item.seq)
                    .expect("a decoded request runs");
                run.generated += kept;
                generated[item.request] = run.generated;
                report.decoded_tokens += kept as u64;
                report.accepted_tokens += kept as u64;
                step_tokens += kept as u64;
            }
        }
        // Finish.
        let mut j = 0;
        while j < running.len() {
            let r = running[j].request;
            if running[j].generated >= reqs[r].output_len {
                let seq = running.remove(j).seq;
                let len = cache.tokens(seq)?.len();
                cache.cache_prefix(seq, len)?;
                cache.free(seq)?;
                engine.finished(r)?;
                report.finished += 1;
            } else {
                j += 1;
            }
        }
        // Measure.
        for run in &running {
            let waste = cache.block_table(run.seq)?.len() * bs - cache.tokens(run.seq)?.len();
            report.max_waste_per_seq = report.max_waste_per_seq.max(waste);
            waste_sum += waste as f64;
            waste_n += 1;
        }
        running_sum += running.len() as u64;
        tokens_sum += step_tokens;
        util_sum += cache.pool().num_used() as f64 / total as f64;
        report.peak_utilisation = report
            .peak_utilisation
            .max(cache.pool().num_used() as f64 / total as f64);
        step += 1;
        if step > 100_000_000 {
            return Err(PagedCacheError::InvalidParameter {
                name: "workload",
                reason: "the simulation made no progress".into(),
            }
            .into());
        }
    }
    let stats = cache.stats();
    report.steps = step;
    report.tokens_per_step = tokens_sum as f64 / step.max(1) as f64;
    report.mean_utilisation = util_sum / step.max(1) as f64;
    report.mean_waste_per_seq = waste_sum / waste_n.max(1) as f64;
    report.mean_running = running_sum as f64 / step.max(1) as f64;
    let (hit, looked_up) = (
        stats.hit_tokens - start.hit_tokens,
        stats.lookup_tokens - start.lookup_tokens,
    );
    report.prefix_hit_rate = hit as f64 / looked_up.max(1) as f64;
    report.cow_copies = stats.cow_copies - start.cow_copies;
    Ok(report)
}

/// Adds a sequence of `tokens`; returns it and the tokens whose K/V it
/// holds already, or `None` when the pool is short. A whole prompt found
/// cached gives its last token back, so that token is computed (its logits
/// decide what comes next) into a slot of its own.
fn admit<P: PrefixCache>(
    cache: &mut KvCacheManager<P>,
    tokens: &[u32],
) -> Result<Option<(SeqId, usize)>> {
    let (seq, hit) = match cache.add_sequence(tokens, 0) {
        Ok(x) => x,
        Err(PagedCacheError::PoolExhausted { .. }) => return Ok(None),
        Err(e) => return Err(e),
    };
    if hit < tokens.len() {
        return Ok(Some((seq, hit)));
    }
    cache.truncate(seq, 1)?;
    match cache.append(seq, &tokens[tokens.len() - 1..]) {
        Ok(()) => Ok(Some((seq, tokens.len() - 1))),
        Err(PagedCacheError::PoolExhausted { .. }) => {
            cache.free(seq)?;
            Ok(None)
        }
        Err(e) => Err(e),
    }
}

/// The reports as a Markdown table.
pub fn markdown(reports: &[Report]) -> String {
    let mut s = String::from(
        "| prefix cache | preemption | steps | tokens/step | running | decoded | prefilled | \
         preempted (recompute/swap) | prefix hit rate | utilisation mean/peak | waste/seq mean/max (slots) |\n\
         |---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in reports {
        s += &format!(
            "| {} | {} | {} | {:.1} | {:.1} | {} | {} | {}/{} | {:.1}% | {:.1}%/{:.1}% | {:.2}/{} (block {}) |\n",
            r.prefix_cache,
            r.preemption,
            r.steps,
            r.tokens_per_step,
            r.mean_running,
            r.decoded_tokens,
            r.prefilled_tokens,
            r.preempted_recompute,
            r.preempted_swap,
            100.0 * r.prefix_hit_rate,
            100.0 * r.mean_utilisation,
            100.0 * r.peak_utilisation,
            r.mean_waste_per_seq,
            r.max_waste_per_seq,
            r.block_size,
        );
    }
    s
}
