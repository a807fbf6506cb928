//! Text generation on one of kv-eval's KV backends, through kv-model's
//! [`generate`](kv_model::model::generate) (the prompt in one step, then
//! one token per step, greedy or sampled) or its
//! [`generate_speculative`](kv_model::model::generate_speculative) (each
//! decode step verifying a drafter's tokens: [`generate_speculative`]).
//! On the paged backend, faults can accumulate over time: before each
//! decode step the resident blocks take flips at a given rate, and a
//! scrubber can rewrite single-bit errors every few steps before they pair
//! up. With an eviction policy, the prompt's tokens are evicted once
//! after the prompt step (SnapKV: [`attention::Evicting`]), before the
//! first decode step.

use attention::{DenseBackend, Evicting, SnapKv};
use gf2_codes::channel::FaultChannel;
use kv_quant::{FaultTarget, KvDecodeStats, ScrubStats};
use paged_cache::PagedBackend;

use crate::backend::{BackendKind, paged_backend};
use crate::cache::{CacheMode, ChannelKind, KvCache};
use crate::error::{EvalError, Result};
use attention::KvBackend;
use kv_model::ModelError;
use kv_model::model::{
    Adapted, CausalLm, Drafter, GenerateOptions, Generated, Sampling, SpeculativeOptions,
    SpeculativeStats, check_prompt, check_speculative,
};

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
    /// Token eviction after the prompt (dense and paged backends; forms
    /// coded after RoPE).
    pub eviction: Option<SnapKv>,
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
    /// Bytes of the fitted tables the paged cache's forms read: calibrated
    /// ones stored once beside the blocks, and those fitted on this
    /// sequence (not in `cache_bytes`).
    pub table_bytes: u64,
    /// Decode statistics of keys and values read by attention (paged backend).
    pub reads: [KvDecodeStats; 2],
    /// Bits flipped in the resident blocks.
    pub injected_flips: u64,
    /// What the scrubber found and fixed.
    pub scrubbed: ScrubStats,
    /// Bits of `injected_flips` that hit the fitted tables (codebooks,
    /// calibrated bases), and how the tables' words decode at the end
    /// (paged backend).
    pub tables: (u64, gf2_codes::DecodeStats),
    /// NaN and infinite K/V values the paged cache stored (faults in an
    /// unprotected form: stored as the form stores numbers, and counted).
    pub non_finite_stored: u64,
    /// Drafting and verification, where the run speculated.
    pub speculation: Option<SpeculativeStats>,
    /// What the eviction after the prompt kept, where it ran.
    pub eviction: Option<attention::Eviction>,
}

/// How the decode steps run: one token each, or verifying a drafter's.
enum Decode<'d> {
    Plain,
    Speculative {
        drafter: &'d mut dyn Drafter,
        k: usize,
        stats: SpeculativeStats,
    },
}

impl Decode<'_> {
    /// kv-model's generation on `cache`, plain or speculative, with
    /// `before_step` between decode steps.
    fn run<C>(
        &mut self,
        model: &dyn CausalLm,
        cache: &mut C,
        prompt: &[u32],
        options: &GenerateOptions,
        before_step: impl FnMut(usize, &mut C) -> Result<()>,
        on_token: impl FnMut(u32) -> Result<()>,
    ) -> Result<Generated>
    where
        C: KvBackend<Error = ModelError> + 'static,
    {
        match self {
            Decode::Plain => {
                kv_model::model::generate(model, cache, prompt, options, before_step, on_token)
            }
            Decode::Speculative { drafter, k, stats } => {
                let options = SpeculativeOptions {
                    generate: *options,
                    k: *k,
                };
                let out = kv_model::model::generate_speculative(
                    model,
                    cache,
                    &mut **drafter,
                    prompt,
                    &options,
                    before_step,
                    on_token,
                )?;
                *stats = out.stats;
                Ok(out.generated)
            }
        }
    }
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

/// Generates up to `config.max_new` tokens after `prompt` (kv-model's
/// [`generate`](kv_model::model::generate) on the configured backend),
/// calling `on_token` with each as soon as it is picked. Bad input (an
/// empty or too long prompt, bad sampling parameters, a form the backend
/// cannot hold, faults on a backend without resident blocks) is refused
/// before any work.
pub fn generate(
    model: &dyn CausalLm,
    prompt: &[u32],
    config: &GenerateConfig,
    on_token: impl FnMut(u32) -> Result<()>,
) -> Result<Generation> {
    generate_with(model, prompt, config, Decode::Plain, on_token)
}

/// [`generate`] with speculative decoding: each decode step drafts up to
/// `k` tokens with `drafter` and keeps what the model accepts (kv-model's
/// [`generate_speculative`](kv_model::model::generate_speculative)); the
/// drafting statistics are in [`Generation::speculation`]. A `k` of 0 or
/// past the context left after the prompt is refused before any work.
pub fn generate_speculative(
    model: &dyn CausalLm,
    drafter: &mut dyn Drafter,
    k: usize,
    prompt: &[u32],
    config: &GenerateConfig,
    on_token: impl FnMut(u32) -> Result<()>,
) -> Result<Generation> {
    let decode = Decode::Speculative {
        drafter,
        k,
        stats: SpeculativeStats::default(),
    };
    generate_with(model, prompt, config, decode, on_token)
}

/// [`generate`] with its decode steps run by `decode`.
fn generate_with(
    model: &dyn CausalLm,
    prompt: &[u32],
    config: &GenerateConfig,
    mut decode: Decode<'_>,
    mut on_token: impl FnMut(u32) -> Result<()>,
) -> Result<Generation> {
    let options = GenerateOptions {
        context: config.context,
        max_new: config.max_new,
        sampling: config.sampling,
        prefill_step: config.prefill_step,
    };
    options.sampling.check()?;
    check_prompt(prompt, &options)?;
    if let Decode::Speculative { k, .. } = &decode {
        check_speculative(
            prompt,
            &SpeculativeOptions {
                generate: options,
                k: *k,
            },
        )?;
    }
    config.backend.check(&config.mode, None)?;
    if config.eviction.is_some() {
        crate::backend::check_eviction(&config.mode, config.backend)?;
        crate::backend::check_eviction_memory(model, prompt.len())?;
    }
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
    let mut out = Generation::default();
    let generated = match config.backend {
        BackendKind::Dense => {
            let mut cache = Adapted(Evicting::with_policy(DenseBackend::new(), config.eviction)?);
            let evict = |step: usize, cache: &mut Adapted<Evicting<DenseBackend>>| -> Result<()> {
                evict_after_prompt(step, &mut cache.0)
            };
            let g = decode.run(model, &mut cache, prompt, &options, evict, &mut on_token)?;
            out.cache_bytes = cache.0.inner().held_bytes();
            out.eviction = cache.0.eviction();
            g
        }
        BackendKind::Reencode => {
            let mut cache = KvCache::new(config.mode.clone(), None, 0)?;
            let g = decode.run(
                model,
                &mut cache,
                prompt,
                &options,
                no_faults,
                &mut on_token,
            )?;
            out.cache_bytes = cache.held_bytes();
            g
        }
        BackendKind::Paged { block_size } => {
            let backend = paged_backend(model, &config.mode, None, block_size, capacity)?;
            let mut cache = Adapted(Evicting::with_policy(backend, config.eviction)?);
            let (mut flips, mut scrubbed) = (0, ScrubStats::default());
            let faults = |step: usize, cache: &mut Adapted<Evicting<PagedBackend>>| -> Result<()> {
                evict_after_prompt(step, &mut cache.0)?;
                let cache = cache.0.inner();
                if let Some((f, ch)) = &channel {
                    let seed = f.seed ^ (step as u64).wrapping_mul(0xd1b5_4a32_d192_ed03);
                    flips += cache.inject(ch.as_ref(), seed, f.target)?;
                    if f.scrub_every.is_some_and(|n| (step + 1).is_multiple_of(n)) {
                        scrubbed += cache.scrub()?;
                    }
                }
                Ok(())
            };
            let g = decode.run(model, &mut cache, prompt, &options, faults, &mut on_token)?;
            (out.injected_flips, out.scrubbed) = (flips, scrubbed);
            out.eviction = cache.0.eviction();
            let cache = Adapted(cache.0.inner());
            out.tables = (cache.0.table_flips(), cache.0.table_stats()?);
            out.cache_bytes = cache.0.stored_bytes()? as u64;
            let fitted = match cache.0.sequence() {
                Some(seq) => cache.0.manager().sequence_tables(seq)?.stored_bytes(),
                None => 0,
            };
            out.table_bytes = (cache.0.storage().shared_bytes() + fitted) as u64;
            let r = cache.0.read_stats();
            out.reads = [r.keys, r.values];
            out.non_finite_stored = cache.0.storage().non_finite_written();
            g
        }
    };
    out.tokens = generated.tokens;
    out.prefill_seconds = generated.prefill_seconds;
    out.decode_seconds = generated.decode_seconds;
    if let Decode::Speculative { stats, .. } = decode {
        out.speculation = Some(stats);
    }
    Ok(out)
}

/// Nothing between decode steps.
fn no_faults<C>(_: usize, _: &mut C) -> Result<()> {
    Ok(())
}

/// Evicts before the first decode step (step 0), where the cache has a
/// policy.
fn evict_after_prompt<B>(step: usize, cache: &mut Evicting<B>) -> Result<()>
where
    B: KvBackend,
    EvalError: From<B::Error>,
{
    if step == 0 && cache.policy().is_some() {
        cache.evict()?;
    }
    Ok(())
}
