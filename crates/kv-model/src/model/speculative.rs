//! Speculative decoding on any KV backend: a [`Drafter`] proposes up to
//! `k` tokens, the target runs `[last, d₁ … d_k]` as one step (the prefill
//! path: a causal mask over the new rows) and keeps only what it accepts
//! ([`CausalLm::forward_keeping`], which commits a prefix of the step
//! through `KvBackend::commit_prefix`: rejected rows never enter the cache,
//! so a paged cache seals exactly what plain decoding would have sealed).
//!
//! Acceptance:
//! - **greedy** (temperature 0): `dᵢ` is accepted while it is the target's
//!   argmax after `d₁ … dᵢ₋₁`; the next token is the target's argmax where
//!   the first draft failed (or after the last one). The output is plain
//!   greedy decoding's wherever a row of a step has the bits it has alone
//!   (kv-model's products on stored weights do, by construction);
//! - **sampled**: the standard rejection rule (Leviathan et al. 2023, Chen
//!   et al. 2023): `dᵢ ~ q` is accepted with probability
//!   `min(1, p(dᵢ)/q(dᵢ))`, where `p` is the target's distribution under
//!   the same temperature and nucleus as [`Sampling::pick`]; at the first
//!   rejection the token is drawn from `max(0, p − q)` renormalised; after
//!   `k` acceptances a bonus token is drawn from `p`. The output has the
//!   target's distribution whatever the drafter proposes. A drafter whose
//!   proposals are deterministic (prompt lookup, a greedy draft model) has
//!   `q` one-hot.
//!
//! Drafters: [`PromptLookup`] (the last 3 or 2 tokens matched earlier in
//! the prompt and output, what followed proposed; single-token matches
//! proposed too little that was accepted to pay for their verification), [`ModelDrafter`] (a
//! smaller model with the same vocabulary, on a cache of its own, cut back
//! to the accepted tokens before each proposal) and [`SelfDrafter`] (the
//! target itself reading the draft view of its own cache: QuantSpec's
//! self-speculation over a hierarchical `int8h` cache, whose drafts read
//! the upper 4-bit plane and whose verification reads both).

use std::time::Instant;

use attention::{DraftOverlay, KvBackend, ReadView};
use gf2_codes::channel::FaultRng;

use super::{CausalLm, GenerateOptions, Generated, ModelCache, Sampling, check_prompt};
use crate::error::{ModelError, Result};

/// Proposes the tokens a target model then verifies.
pub trait Drafter {
    /// Up to `k` tokens to follow `context` (the prompt and every token
    /// generated so far; never empty). Fewer (none) where it has nothing to
    /// propose.
    fn propose(&mut self, context: &[u32], k: usize) -> Result<Draft>;

    /// [`propose`](Self::propose) given the target's cache (holding every
    /// token of `context` but the last, no step open), for drafters that
    /// read it ([`SelfDrafter`]); the default ignores it.
    fn propose_on(
        &mut self,
        context: &[u32],
        k: usize,
        target: &mut ModelCache<'_>,
    ) -> Result<Draft> {
        let _ = target;
        self.propose(context, k)
    }

    /// Refuses a target cache the drafter cannot read, before any work
    /// (a self-speculative draft needs a cache with a draft view); the
    /// default accepts any.
    fn check_target(&self, target: &mut ModelCache<'_>) -> Result<()> {
        let _ = target;
        Ok(())
    }
}

/// What a [`Drafter`] proposes.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Draft {
    /// The proposed tokens.
    pub tokens: Vec<u32>,
    /// The distribution each token was drawn from (one row of vocabulary
    /// size per token), or empty where the proposals are deterministic.
    pub probs: Vec<Vec<f64>>,
}

/// How speculative generation runs: [`GenerateOptions`] and the number of
/// drafts per verification.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SpeculativeOptions {
    /// Context, tokens to generate, sampling, prefill steps (as plain
    /// generation).
    pub generate: GenerateOptions,
    /// Tokens drafted per verification pass, at most (at least 1).
    pub k: usize,
}

/// What drafting and verification did.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct SpeculativeStats {
    /// Target passes over a drafted step (one per decode step).
    pub verify_passes: u64,
    /// Tokens drafted.
    pub drafted: u64,
    /// Drafted tokens the target accepted.
    pub accepted: u64,
    /// Seconds spent drafting.
    pub draft_seconds: f64,
    /// Seconds spent in the target's passes.
    pub verify_seconds: f64,
}

impl SpeculativeStats {
    /// Accepted drafts over drafted tokens.
    pub fn acceptance_rate(&self) -> f64 {
        self.accepted as f64 / (self.drafted.max(1)) as f64
    }

    /// Tokens generated per target pass (accepted drafts plus the target's
    /// own token).
    pub fn tokens_per_pass(&self) -> f64 {
        (self.accepted + self.verify_passes) as f64 / (self.verify_passes.max(1)) as f64
    }
}

/// The tokens, timings and drafting statistics of a speculative run.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SpeculativeGenerated {
    /// Tokens and timings, as plain generation reports them.
    pub generated: Generated,
    /// Drafting and verification.
    pub stats: SpeculativeStats,
}

/// Refuses `k` of 0 or above the context left after the prompt, and what
/// [`check_prompt`] refuses.
pub fn check_speculative(prompt: &[u32], options: &SpeculativeOptions) -> Result<()> {
    check_prompt(prompt, &options.generate)?;
    let left = options.generate.context - prompt.len();
    if options.k == 0 || options.k > left {
        return Err(ModelError::InvalidParameter {
            name: "k",
            reason: format!(
                "{} drafts per step: at least 1 and at most the {left} tokens of context left \
                 after the prompt",
                options.k
            ),
        });
    }
    Ok(())
}

/// Generates from `prompt` like [`generate`](super::generate), each decode
/// step verifying what `drafter` proposes (greedy acceptance, or the
/// rejection rule for sampled decoding).
/// `before_step(i, cache)` runs before decode step `i` (a step may now
/// yield several tokens); `on_token` sees each token as it is accepted.
pub fn generate_speculative<C, E>(
    model: &dyn CausalLm,
    cache: &mut C,
    drafter: &mut dyn Drafter,
    prompt: &[u32],
    options: &SpeculativeOptions,
    mut before_step: impl FnMut(usize, &mut C) -> std::result::Result<(), E>,
    mut on_token: impl FnMut(u32) -> std::result::Result<(), E>,
) -> std::result::Result<SpeculativeGenerated, E>
where
    C: KvBackend<Error = ModelError> + 'static,
    E: From<ModelError>,
{
    let opts = &options.generate;
    opts.sampling.check()?;
    check_speculative(prompt, options)?;
    drafter.check_target(&mut *cache)?;
    let vocab = model.vocab();
    let mut rng = opts.sampling.stream();
    let mut out = SpeculativeGenerated::default();
    let started = Instant::now();
    let mut logits = Vec::new();
    for chunk in prompt.chunks(opts.prefill_step.unwrap_or(prompt.len())) {
        logits = model.forward(chunk, cache, chunk.len() - 1)?;
    }
    out.generated.prefill_seconds = started.elapsed().as_secs_f64();
    if opts.max_new == 0 {
        return Ok(out);
    }
    let mut next = opts.sampling.pick(&logits[..vocab], &mut rng);
    on_token(next)?;
    let mut context = prompt.to_vec();
    context.push(next);
    let started = Instant::now();
    let mut step = 0;
    while context.len() - prompt.len() < opts.max_new && context.len() <= opts.context {
        before_step(step, cache)?;
        step += 1;
        let remaining = opts.max_new - (context.len() - prompt.len());
        // A verification stops at the end of a block a staged form seals:
        // its later rows would read that block staged where plain
        // decoding's read it sealed.
        let sealed = cache
            .rows_before_seal()
            .map_or(usize::MAX, |rows| rows.saturating_sub(1));
        let want = options
            .k
            .min(remaining - 1)
            .min(opts.context - context.len())
            .min(sealed);
        let t = Instant::now();
        let mut draft = if want > 0 {
            drafter.propose_on(&context, want, &mut *cache)?
        } else {
            Draft::default()
        };
        draft.tokens.truncate(want);
        draft.probs.truncate(draft.tokens.len());
        if let Some(&bad) = draft.tokens.iter().find(|&&d| d as usize >= vocab) {
            return Err(ModelError::TokenId { id: bad, vocab }.into());
        }
        out.stats.draft_seconds += t.elapsed().as_secs_f64();
        let t = Instant::now();
        let mut feed = Vec::with_capacity(1 + draft.tokens.len());
        feed.push(next);
        feed.extend_from_slice(&draft.tokens);
        let mut new_tokens = Vec::new();
        let cache: &mut ModelCache<'_> = cache;
        model.forward_keeping(&feed, cache, 0, &mut |logits| {
            new_tokens = verify(logits, vocab, &draft, &opts.sampling, &mut rng);
            new_tokens.len()
        })?;
        out.stats.verify_seconds += t.elapsed().as_secs_f64();
        out.stats.verify_passes += 1;
        out.stats.drafted += draft.tokens.len() as u64;
        out.stats.accepted += (new_tokens.len() - 1) as u64;
        for &token in &new_tokens {
            on_token(token)?;
        }
        context.extend_from_slice(&new_tokens);
        next = *new_tokens.last().expect("a verification yields a token");
    }
    out.generated.decode_seconds = started.elapsed().as_secs_f64();
    out.generated.tokens = context[prompt.len()..].to_vec();
    Ok(out)
}

/// The tokens a verification pass yields: the accepted drafts and the
/// target's own token after them (at least one token).
pub(crate) fn verify(
    logits: &[f32],
    vocab: usize,
    draft: &Draft,
    sampling: &Sampling,
    rng: &mut FaultRng,
) -> Vec<u32> {
    let mut tokens = Vec::with_capacity(draft.tokens.len() + 1);
    for (i, &d) in draft.tokens.iter().enumerate() {
        let row = &logits[i * vocab..(i + 1) * vocab];
        match sampling.distribution(row) {
            // Greedy: the draft stands while it is the argmax.
            None => {
                let t = sampling.pick(row, rng);
                tokens.push(t);
                if t != d {
                    return tokens;
                }
            }
            Some(p) => {
                let q = draft.probs.get(i);
                let q_d = q.map_or(1.0, |q| q[d as usize]);
                let accept = if q_d > 0.0 {
                    (p[d as usize] / q_d).min(1.0)
                } else {
                    0.0
                };
                if rng.next_f64() < accept {
                    tokens.push(d);
                    continue;
                }
                tokens.push(residual(&p, q.map(Vec::as_slice), d, rng));
                return tokens;
            }
        }
    }
    let row = &logits[draft.tokens.len() * vocab..(draft.tokens.len() + 1) * vocab];
    tokens.push(sampling.pick(row, rng));
    tokens
}

/// A draw from `max(0, p − q)` renormalised (`q` one-hot at `d` where
/// `None`); from `p` where that leaves no mass.
fn residual(p: &[f64], q: Option<&[f64]>, d: u32, rng: &mut FaultRng) -> u32 {
    let weight = |i: usize| match q {
        Some(q) => (p[i] - q[i]).max(0.0),
        None if i == d as usize => 0.0,
        None => p[i],
    };
    let mass: f64 = (0..p.len()).map(weight).sum();
    let (weight, mass): (&dyn Fn(usize) -> f64, f64) = if mass > 0.0 {
        (&weight, mass)
    } else {
        (&|i| p[i], p.iter().sum())
    };
    let mut u = rng.next_f64() * mass;
    let mut last = 0;
    for i in 0..p.len() {
        let w = weight(i);
        if w > 0.0 {
            last = i;
            if u < w {
                return i as u32;
            }
            u -= w;
        }
    }
    last as u32
}

/// Prompt-lookup drafting: the longest suffix of the context, `max_ngram`
/// tokens down to `min_ngram`, found earlier in the context (the most
/// recent match); the tokens that followed it are proposed. Deterministic,
/// free, and strong where the output copies the input (edits, code,
/// extraction). The default matches 3 or 2 tokens: on the corpus'
/// prompts single-token matches were accepted too rarely to pay for the
/// verification they cost (kv-eval's `docs/speculative.md`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PromptLookup {
    /// Longest suffix matched.
    pub max_ngram: usize,
    /// Shortest suffix matched (at least 1).
    pub min_ngram: usize,
}

impl Default for PromptLookup {
    /// Suffixes of 3 tokens down to 2.
    fn default() -> Self {
        Self {
            max_ngram: 3,
            min_ngram: 2,
        }
    }
}

impl PromptLookup {
    /// Checks the n-gram range (`1 ≤ min_ngram ≤ max_ngram`).
    pub fn new(min_ngram: usize, max_ngram: usize) -> Result<Self> {
        if min_ngram == 0 || min_ngram > max_ngram {
            return Err(ModelError::InvalidParameter {
                name: "ngram",
                reason: format!(
                    "suffixes of {min_ngram} to {max_ngram} tokens (need 1 ≤ min ≤ max)"
                ),
            });
        }
        Ok(Self {
            max_ngram,
            min_ngram,
        })
    }
}

impl Drafter for PromptLookup {
    fn propose(&mut self, context: &[u32], k: usize) -> Result<Draft> {
        let len = context.len();
        for n in (self.min_ngram..=self.max_ngram.min(len.saturating_sub(1))).rev() {
            let suffix = &context[len - n..];
            // The most recent earlier occurrence that has a token after it.
            if let Some(start) = (0..len - n).rev().find(|&s| &context[s..s + n] == suffix) {
                let from = start + n;
                let tokens = context[from..(from + k).min(len)].to_vec();
                return Ok(Draft {
                    tokens,
                    probs: Vec::new(),
                });
            }
        }
        Ok(Draft::default())
    }
}

/// Refuses a draft model whose vocabulary is not the target's `vocab`.
pub(crate) fn check_draft_vocab(model: &dyn CausalLm, vocab: usize) -> Result<()> {
    if model.vocab() != vocab {
        return Err(ModelError::InvalidParameter {
            name: "draft model",
            reason: format!(
                "a vocabulary of {} tokens, the target's has {vocab} (a drafter needs the \
                 target's tokenizer)",
                model.vocab()
            ),
        });
    }
    Ok(())
}

/// A draft model with the target's vocabulary, on a cache of its own: each
/// proposal cuts its cache back to the tokens it shares with the context
/// (the target's accepted tokens), catches up on the rest and drafts `k`
/// tokens one step each, greedy or sampled as `sampling` says.
pub struct ModelDrafter<'m, C> {
    model: &'m dyn CausalLm,
    cache: C,
    fed: Vec<u32>,
    sampling: Sampling,
    rng: FaultRng,
}

impl<C> std::fmt::Debug for ModelDrafter<'_, C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelDrafter")
            .field("model", &self.model.describe())
            .field("fed", &self.fed.len())
            .field("sampling", &self.sampling)
            .finish()
    }
}

impl<'m, C> ModelDrafter<'m, C>
where
    C: KvBackend<Error = ModelError> + 'static,
{
    /// Drafts with `model` on `cache` (empty) for a target of `vocab`
    /// tokens; refuses a model of another vocabulary.
    pub fn new(
        model: &'m dyn CausalLm,
        cache: C,
        vocab: usize,
        sampling: Sampling,
    ) -> Result<Self> {
        sampling.check()?;
        check_draft_vocab(model, vocab)?;
        if cache.tokens() != 0 {
            return Err(ModelError::InvalidParameter {
                name: "draft cache",
                reason: format!("holds {} tokens already (give it empty)", cache.tokens()),
            });
        }
        Ok(Self {
            model,
            cache,
            fed: Vec::new(),
            rng: FaultRng::with_stream(sampling.seed, 2),
            sampling,
        })
    }

    /// The drafter's cache.
    pub fn cache(&self) -> &C {
        &self.cache
    }
}

impl<C> Drafter for ModelDrafter<'_, C>
where
    C: KvBackend<Error = ModelError> + 'static,
{
    fn propose(&mut self, context: &[u32], k: usize) -> Result<Draft> {
        let mut draft = Draft::default();
        if context.is_empty() || k == 0 {
            return Ok(draft);
        }
        let shared = self
            .fed
            .iter()
            .zip(context)
            .take_while(|(a, b)| a == b)
            .count()
            .min(context.len() - 1);
        self.cache.truncate(shared)?;
        self.fed.truncate(shared);
        let cache: &mut ModelCache<'_> = &mut self.cache;
        let new = &context[shared..];
        let mut logits = self.model.forward(new, cache, new.len() - 1)?;
        self.fed.extend_from_slice(new);
        let deterministic = self.sampling.temperature == 0.0;
        for i in 0..k {
            let p = self.sampling.distribution(&logits);
            let token = self.sampling.pick(&logits, &mut self.rng);
            if !deterministic {
                // A row without a finite distribution took its argmax: q
                // is one-hot there.
                draft.probs.push(p.unwrap_or_else(|| {
                    let mut one = vec![0.0; logits.len()];
                    one[token as usize] = 1.0;
                    one
                }));
            }
            draft.tokens.push(token);
            if i + 1 < k {
                logits = self.model.forward(&[token], cache, 0)?;
                self.fed.push(token);
            }
        }
        Ok(draft)
    }
}

/// Self-speculative drafting (QuantSpec, arXiv 2502.10424): the target
/// model drafts for itself, reading its own cache in the draft view (the
/// upper 4-bit plane of a hierarchical `int8h` form, half the bytes) with
/// the drafted tokens' rows kept beside it ([`DraftOverlay`]: the
/// target's cache is never written by a draft). Verification then reads
/// the cache whole. Greedy or sampled as `sampling` says.
pub struct SelfDrafter<'m> {
    model: &'m dyn CausalLm,
    sampling: Sampling,
    rng: FaultRng,
    skip: Vec<usize>,
}

impl<'m> SelfDrafter<'m> {
    /// Drafts with `model`, the target itself.
    pub fn new(model: &'m dyn CausalLm, sampling: Sampling) -> Result<Self> {
        sampling.check()?;
        Ok(Self {
            model,
            rng: FaultRng::with_stream(sampling.seed, 3),
            sampling,
            skip: Vec::new(),
        })
    }

    /// Drafts with `layers` skipped (LayerSkip's shallower draft, on top
    /// of the draft view): Llama-family forward passes pass the hidden
    /// state through them. Refuses a layer the model lacks, and skipping
    /// every layer.
    pub fn skipping(mut self, layers: &[usize]) -> Result<Self> {
        let n = self.model.layers();
        if !layers.is_empty() && !self.model.can_skip_layers() {
            return Err(ModelError::InvalidParameter {
                name: "skip",
                reason: format!(
                    "{} runs every layer of its forward pass",
                    self.model.describe()
                ),
            });
        }
        if let Some(&bad) = layers.iter().find(|&&l| l >= n) {
            return Err(ModelError::InvalidParameter {
                name: "skip",
                reason: format!("layer {bad} of a model of {n} layers (0 to {})", n - 1),
            });
        }
        let mut skip = layers.to_vec();
        skip.sort_unstable();
        skip.dedup();
        if skip.len() == n {
            return Err(ModelError::InvalidParameter {
                name: "skip",
                reason: format!("all {n} layers: a draft runs at least one"),
            });
        }
        self.skip = skip;
        Ok(self)
    }

    /// The layers the draft skips.
    pub fn skipped(&self) -> &[usize] {
        &self.skip
    }
}

impl std::fmt::Debug for SelfDrafter<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SelfDrafter")
            .field("model", &self.model.describe())
            .field("sampling", &self.sampling)
            .field("skip", &self.skip)
            .finish()
    }
}

impl Drafter for SelfDrafter<'_> {
    /// Refused: a self-speculative draft reads the target's cache
    /// ([`propose_on`](Drafter::propose_on)).
    fn propose(&mut self, _context: &[u32], _k: usize) -> Result<Draft> {
        Err(ModelError::InvalidParameter {
            name: "drafter",
            reason: "a self-speculative draft reads the target's own cache: it proposes \
                     through propose_on"
                .into(),
        })
    }

    /// Refuses a cache without a draft view (some layer's form keeps no
    /// 4-bit view); leaves it in the full view.
    fn check_target(&self, target: &mut ModelCache<'_>) -> Result<()> {
        target.set_read_view(ReadView::Draft)?;
        target.set_read_view(ReadView::Full)
    }

    fn propose_on(
        &mut self,
        context: &[u32],
        k: usize,
        target: &mut ModelCache<'_>,
    ) -> Result<Draft> {
        let mut draft = Draft::default();
        let Some(&last) = context.last() else {
            return Ok(draft);
        };
        let mut overlay = DraftOverlay::new(target)?;
        overlay.skip_layers(&self.skip);
        let deterministic = self.sampling.temperature == 0.0;
        let mut token = last;
        for _ in 0..k {
            let logits = self.model.forward(&[token], &mut overlay, 0)?;
            let p = self.sampling.distribution(&logits);
            token = self.sampling.pick(&logits, &mut self.rng);
            if !deterministic {
                draft.probs.push(p.unwrap_or_else(|| {
                    let mut one = vec![0.0; logits.len()];
                    one[token as usize] = 1.0;
                    one
                }));
            }
            draft.tokens.push(token);
        }
        Ok(draft)
    }
}
