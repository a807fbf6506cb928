//! Text generation on a KV backend: prefill the prompt in one step, then one
//! token per step, greedy or sampled (temperature and nucleus, from a seeded
//! stream). On the paged backend, faults can accumulate over time: before
//! each decode step the resident blocks take flips at a given rate, and a
//! scrubber can rewrite single-bit errors every few steps before they pair up.

use std::time::Instant;

use attention::DenseBackend;
use gf2_codes::channel::{FaultChannel, FaultRng};
use kv_quant::{FaultTarget, KvDecodeStats, ScrubStats};
use paged_cache::PagedBackend;

use crate::backend::{BackendKind, paged_backend};
use crate::cache::{CacheMode, ChannelKind, KvCache};
use crate::error::{EvalError, Result};
use kv_model::model::Adapted;
use kv_model::model::CausalLm;

/// How tokens are picked from the logits.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sampling {
    /// Softmax temperature; 0 picks the most likely token (greedy).
    pub temperature: f64,
    /// Nucleus: sample among the most likely tokens whose probabilities sum
    /// to at least this, in (0, 1].
    pub top_p: f64,
    /// Seed of the sampling stream.
    pub seed: u64,
}

impl Default for Sampling {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_p: 1.0,
            seed: 0,
        }
    }
}

impl Sampling {
    /// Refuses a negative or non-finite temperature and a top-p outside (0, 1].
    pub fn check(&self) -> Result<()> {
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(EvalError::InvalidParameter {
                name: "temperature",
                reason: format!("{} is not a finite value ≥ 0", self.temperature),
            });
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(EvalError::InvalidParameter {
                name: "top-p",
                reason: format!("{} is not in (0, 1]", self.top_p),
            });
        }
        Ok(())
    }
}

/// Faults that accumulate in the resident blocks of a paged cache.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepFaults {
    /// The channel.
    pub channel: ChannelKind,
    /// Bit error rate applied to every resident block before each decode step.
    pub ber_per_step: f64,
    /// Which buffers are hit.
    pub target: FaultTarget,
    /// Seed; step `s` draws from its own stream of it.
    pub seed: u64,
    /// Scrub every resident block after this many steps (`None`: never).
    pub scrub_every: Option<usize>,
}

/// What a generation asks for.
#[derive(Clone, Debug, PartialEq)]
pub struct GenerateConfig {
    /// Cache forms (`plain` for f32 rows).
    pub mode: CacheMode,
    /// The backend (dense, re-encode or paged).
    pub backend: BackendKind,
    /// Tokens the cache holds at most (prompt and continuation).
    pub context: usize,
    /// Tokens to generate at most.
    pub max_new: usize,
    /// How tokens are picked.
    pub sampling: Sampling,
    /// Faults accumulating over steps (paged backend only).
    pub faults: Option<StepFaults>,
    /// Prompt tokens per step: `None` runs the prompt in one step (a
    /// server's prefill, which reads a staged form's own rows exact);
    /// `Some(block_size)` runs it a block at a time, so each block's
    /// queries read the blocks before it sealed, as decoding does (what
    /// evaluations of staged forms use).
    pub prefill_step: Option<usize>,
}

/// What a generation produced and measured.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Generation {
    /// The generated token ids (without the prompt).
    pub tokens: Vec<u32>,
    /// Seconds of the prompt's step.
    pub prefill_seconds: f64,
    /// Seconds of the decode steps (faults and scrubbing included).
    pub decode_seconds: f64,
    /// Bytes of K and V the cache holds at the end, counted from its
    /// buffers (the re-encode backend holds f32 rows and encodes them anew
    /// on each step, so it counts those rows).
    pub cache_bytes: u64,
    /// Decode statistics of keys and values read by attention (paged backend).
    pub reads: [KvDecodeStats; 2],
    /// Bits flipped in the resident blocks.
    pub injected_flips: u64,
    /// What the scrubber found and fixed.
    pub scrubbed: ScrubStats,
    /// NaN and infinite K/V values the paged cache stored (faults in an
    /// unprotected form: stored as the form stores numbers, and counted).
    pub non_finite_stored: u64,
}

impl Generation {
    /// Decode steps per second (the prompt step excluded).
    pub fn tokens_per_second(&self) -> f64 {
        let steps = self.tokens.len().saturating_sub(1);
        if self.decode_seconds > 0.0 {
            steps as f64 / self.decode_seconds
        } else {
            0.0
        }
    }
}

/// The cache of one generation.
enum GenCache {
    Dense(Adapted<DenseBackend>),
    Reencode(Box<KvCache>),
    Paged(Box<Adapted<PagedBackend>>),
}

impl GenCache {
    fn model_cache(&mut self) -> &mut kv_model::model::ModelCache {
        match self {
            Self::Dense(c) => c,
            Self::Reencode(c) => c.as_mut(),
            Self::Paged(c) => c.as_mut(),
        }
    }
}

/// Picks the next token from one row of logits.
pub(crate) fn pick(logits: &[f32], sampling: &Sampling, rng: &mut FaultRng) -> u32 {
    let argmax = || {
        logits
            .iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1).then(b.0.cmp(&a.0)))
            .map_or(0, |(i, _)| i as u32)
    };
    if sampling.temperature == 0.0 {
        return argmax();
    }
    let max = f64::from(logits.iter().copied().fold(f32::NEG_INFINITY, f32::max));
    let mut probs: Vec<(u32, f64)> = logits
        .iter()
        .enumerate()
        .map(|(i, &x)| {
            (
                i as u32,
                ((f64::from(x) - max) / sampling.temperature).exp(),
            )
        })
        .collect();
    let total: f64 = probs.iter().map(|p| p.1).sum();
    if !(total.is_finite() && total > 0.0) {
        return argmax();
    }
    probs.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    let mut kept = 0.0;
    let mut n = 0;
    for &(_, p) in &probs {
        kept += p / total;
        n += 1;
        if kept >= sampling.top_p {
            break;
        }
    }
    let nucleus = &probs[..n];
    let mass: f64 = nucleus.iter().map(|p| p.1).sum();
    let mut u = rng.next_f64() * mass;
    for &(id, p) in nucleus {
        if u < p {
            return id;
        }
        u -= p;
    }
    nucleus[n - 1].0
}

/// Generates up to `config.max_new` tokens after `prompt`, calling
/// `on_token` with each as soon as it is picked. Bad input (an empty or
/// too long prompt, bad sampling parameters, a form the backend cannot
/// hold, faults on a backend without resident blocks) is refused before
/// any work.
pub fn generate(
    model: &dyn CausalLm,
    prompt: &[u32],
    config: &GenerateConfig,
    mut on_token: impl FnMut(u32) -> Result<()>,
) -> Result<Generation> {
    config.sampling.check()?;
    if prompt.is_empty() {
        return Err(EvalError::InvalidParameter {
            name: "prompt",
            reason: "the prompt has no token".into(),
        });
    }
    if prompt.len() > config.context {
        return Err(EvalError::InvalidParameter {
            name: "prompt",
            reason: format!(
                "{} tokens do not fit a context of {}",
                prompt.len(),
                config.context
            ),
        });
    }
    config.backend.check(&config.mode, None)?;
    let channel: Option<(StepFaults, Box<dyn FaultChannel + Send + Sync>)> = match config.faults {
        Some(f) if f.ber_per_step > 0.0 || f.scrub_every.is_some() => {
            if !matches!(config.backend, BackendKind::Paged { .. }) {
                return Err(EvalError::InvalidParameter {
                    name: "ber-per-step",
                    reason: "faults accumulate in the resident blocks of the paged backend \
                             (--backend paged)"
                        .into(),
                });
            }
            if f.scrub_every == Some(0) {
                return Err(EvalError::InvalidParameter {
                    name: "scrub-every",
                    reason: "scrub every 1 or more steps".into(),
                });
            }
            if !(0.0..=1.0).contains(&f.ber_per_step) {
                return Err(EvalError::InvalidParameter {
                    name: "ber-per-step",
                    reason: format!("{} is not in [0, 1]", f.ber_per_step),
                });
            }
            Some((f, f.channel.build(f.ber_per_step)?))
        }
        _ => None,
    };
    let capacity = config
        .context
        .min(prompt.len().saturating_add(config.max_new));
    let mut cache = match config.backend {
        BackendKind::Dense => GenCache::Dense(Adapted(DenseBackend::new())),
        BackendKind::Reencode => {
            GenCache::Reencode(Box::new(KvCache::new(config.mode.clone(), None, 0)?))
        }
        BackendKind::Paged { block_size } => GenCache::Paged(Box::new(Adapted(paged_backend(
            model,
            &config.mode,
            None,
            block_size,
            capacity,
        )?))),
    };
    let vocab = model.vocab();
    let mut rng = FaultRng::with_stream(config.sampling.seed, 1);
    let mut out = Generation::default();
    let started = Instant::now();
    let step = match config.prefill_step {
        Some(0) => {
            return Err(EvalError::InvalidParameter {
                name: "prefill-step",
                reason: "a prefill step holds at least one token".into(),
            });
        }
        Some(n) => n,
        None => prompt.len(),
    };
    let mut logits = Vec::new();
    for chunk in prompt.chunks(step) {
        logits = model.forward(chunk, cache.model_cache(), chunk.len() - 1)?;
    }
    out.prefill_seconds = started.elapsed().as_secs_f64();
    if config.max_new == 0 {
        return finish(out, &cache);
    }
    let mut next = pick(&logits[..vocab], &config.sampling, &mut rng);
    on_token(next)?;
    out.tokens.push(next);
    let started = Instant::now();
    let mut step = 0;
    // The picked token enters the cache with the next step.
    while out.tokens.len() < config.max_new && prompt.len() + out.tokens.len() <= config.context {
        if let (Some((f, ch)), GenCache::Paged(p)) = (&channel, &cache) {
            let seed = f.seed ^ (step as u64).wrapping_mul(0xd1b5_4a32_d192_ed03);
            out.injected_flips += p.0.inject(ch.as_ref(), seed, f.target)?;
            if f.scrub_every.is_some_and(|n| (step + 1) % n == 0) {
                out.scrubbed += p.0.scrub()?;
            }
        }
        let logits = model.forward(&[next], cache.model_cache(), 0)?;
        next = pick(&logits, &config.sampling, &mut rng);
        on_token(next)?;
        out.tokens.push(next);
        step += 1;
    }
    out.decode_seconds = started.elapsed().as_secs_f64();
    finish(out, &cache)
}

fn finish(mut out: Generation, cache: &GenCache) -> Result<Generation> {
    match cache {
        GenCache::Dense(c) => {
            out.cache_bytes = (0..)
                .map_while(|l| c.0.rows(l))
                .map(|(k, v)| 4 * (k.len() + v.len()) as u64)
                .sum();
        }
        GenCache::Reencode(c) => out.cache_bytes = c.held_bytes(),
        GenCache::Paged(c) => {
            out.cache_bytes = c.0.stored_bytes()? as u64;
            let r = c.0.read_stats();
            out.reads = [r.keys, r.values];
            out.non_finite_stored = c.0.storage().non_finite_written();
        }
    }
    Ok(out)
}
