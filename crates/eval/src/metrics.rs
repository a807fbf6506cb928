//! Perplexity (llama.cpp's chunked method and the paper's sliding window),
//! KL divergence from the clean run, top-1/top-5 accuracy and agreement, and
//! the codec statistics of each cache configuration, evaluated window by
//! window so that the clean logits of a window are computed once and shared
//! by every configuration.

use std::time::Instant;

use rayon::prelude::*;
use serde::Serialize;

use attention::{DenseBackend, Evicting, KvBackend, SnapKv};

use crate::backend::{
    BackendKind, check_eviction, check_eviction_memory, paged_backend, paged_stats, seals_blocks,
};
use crate::cache::{CacheMode, CacheStats, FaultSpec, KvCache};
use crate::error::{EvalError, Result};
use kv_model::model::Adapted;
use kv_model::model::CausalLm;

/// How the token stream is cut into windows and which predictions count.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PplMethod {
    /// llama.cpp's `llama-perplexity`: non-overlapping chunks of `ctx`
    /// tokens; in each, the predictions from position `ctx/2` on
    /// (`ctx − 1 − ctx/2` per chunk).
    LlamaCpp,
    /// The sliding window of the paper (and of Hugging Face's perplexity
    /// guide): windows of `ctx` tokens starting every `stride` tokens, each
    /// scoring only the tokens the previous window did not.
    Sliding {
        /// Window step.
        stride: usize,
    },
}

/// One window: `len` tokens from `start`; logits rows `first_scored..len−1`
/// each predict the following token.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Window {
    /// First token of the window.
    pub start: usize,
    /// Tokens in the window.
    pub len: usize,
    /// First logits row scored.
    pub first_scored: usize,
}

impl Window {
    /// Predictions scored in this window.
    pub fn scored(&self) -> usize {
        self.len - 1 - self.first_scored
    }
}

/// The windows of `n` tokens under `method` with context `ctx`.
pub fn windows(n: usize, ctx: usize, method: PplMethod) -> Result<Vec<Window>> {
    if ctx < 2 {
        return Err(EvalError::InvalidParameter {
            name: "ctx",
            reason: format!("{ctx} is below 2"),
        });
    }
    Ok(match method {
        PplMethod::LlamaCpp => (0..n / ctx)
            .map(|i| Window {
                start: i * ctx,
                len: ctx,
                first_scored: ctx / 2,
            })
            .collect(),
        PplMethod::Sliding { stride } => {
            if stride == 0 || stride > ctx {
                return Err(EvalError::InvalidParameter {
                    name: "stride",
                    reason: format!("{stride} is not in 1..={ctx}"),
                });
            }
            let mut out = Vec::new();
            let mut prev_end = 0;
            let mut begin = 0;
            while begin < n {
                let end = (begin + ctx).min(n);
                let len = end - begin;
                let target = end - prev_end;
                // Rows whose next token is one of the last `target` tokens.
                let first = (len - target).saturating_sub(1);
                if len >= 2 && first < len - 1 {
                    out.push(Window {
                        start: begin,
                        len,
                        first_scored: first,
                    });
                }
                prev_end = end;
                if end == n {
                    break;
                }
                begin += stride;
            }
            out
        }
    })
}

/// How an eviction policy is named in reports: `evict<keep>`, and
/// ` sinks<S>` where every head keeps the first S tokens.
pub fn eviction_label(policy: &SnapKv) -> String {
    match policy.sinks() {
        0 => format!("evict{}", policy.keep()),
        s => format!("evict{} sinks{s}", policy.keep()),
    }
}

/// One cache configuration to evaluate.
#[derive(Clone, Debug, PartialEq)]
pub struct RunConfig {
    /// Where attention reads K and V from.
    pub mode: CacheMode,
    /// Faults injected into the stores (none when `None` or at BER 0).
    pub faults: Option<FaultSpec>,
    /// The KV backend the model runs on.
    pub backend: BackendKind,
    /// Token eviction at the end of each window's unscored prefix
    /// (SnapKV, [`attention::Evicting`]); the dense and paged backends.
    pub eviction: Option<SnapKv>,
}

impl RunConfig {
    /// `mode` with `faults` on the re-encode backend (the paper's protocol).
    pub fn new(mode: CacheMode, faults: Option<FaultSpec>) -> Self {
        Self {
            mode,
            faults,
            backend: BackendKind::Reencode,
            eviction: None,
        }
    }

    /// Whether this is the unquantised, fault-free plain pass without
    /// eviction (its logits are the clean pass's).
    pub fn is_clean_plain(&self) -> bool {
        self.mode == CacheMode::Plain
            && self.faults.is_none_or(|f| f.ber == 0.0)
            && self.eviction.is_none()
    }
}

/// Metrics of one configuration over the scored predictions.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct RunMetrics {
    /// `exp(nll_mean)`.
    pub ppl: f64,
    /// Mean negative log-likelihood (nats).
    pub nll_mean: f64,
    /// Predictions scored.
    pub tokens_scored: u64,
    /// Tokens run through the model.
    pub tokens_processed: u64,
    /// Forward-pass seconds of this configuration.
    pub seconds: f64,
    /// `tokens_processed / seconds`.
    pub tokens_per_second: f64,
    /// Mean KL(clean ‖ this) of the next-token distributions (nats).
    pub kl_mean: f64,
    /// Fraction of predictions whose top-1 token is the true next token.
    pub top1_accuracy: f64,
    /// Fraction whose top-5 tokens hold the true next token.
    pub top5_accuracy: f64,
    /// Fraction whose top-1 token equals the clean run's.
    pub top1_agreement: f64,
    /// Fraction whose top-5 tokens hold the clean run's top-1 token.
    pub top5_agreement: f64,
    /// Predictions whose logits held NaN or ±∞ (scored as infinite NLL).
    pub non_finite_predictions: u64,
    /// Codec statistics.
    pub stats: StatsReport,
}

/// Two runs' quality figures compared with a tolerance (`approx`):
/// perplexity, mean NLL, KL, accuracies and agreements within `epsilon`
/// (absolute) or `max_relative`, and the counts of predictions scored,
/// tokens processed and non-finite predictions equal. Timings and codec
/// statistics are not compared.
impl approx::AbsDiffEq for RunMetrics {
    type Epsilon = f64;

    fn default_epsilon() -> f64 {
        f64::EPSILON
    }

    fn abs_diff_eq(&self, other: &Self, epsilon: f64) -> bool {
        self.counts() == other.counts()
            && self
                .quality()
                .iter()
                .zip(other.quality())
                .all(|(a, b)| a.abs_diff_eq(&b, epsilon))
    }
}

impl approx::RelativeEq for RunMetrics {
    fn default_max_relative() -> f64 {
        f64::EPSILON
    }

    fn relative_eq(&self, other: &Self, epsilon: f64, max_relative: f64) -> bool {
        self.counts() == other.counts()
            && self
                .quality()
                .iter()
                .zip(other.quality())
                .all(|(a, b)| a.relative_eq(&b, epsilon, max_relative))
    }
}

impl RunMetrics {
    /// The figures [`approx`] compares with a tolerance.
    fn quality(&self) -> [f64; 8] {
        [
            self.ppl,
            self.nll_mean,
            self.kl_mean,
            self.top1_accuracy,
            self.top5_accuracy,
            self.top1_agreement,
            self.top5_agreement,
            f64::from(u8::from(self.ppl.is_finite())),
        ]
    }

    /// The counts [`approx`] compares exactly.
    fn counts(&self) -> [u64; 3] {
        [
            self.tokens_scored,
            self.tokens_processed,
            self.non_finite_predictions,
        ]
    }
}

/// The codec statistics of a run in report form.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct StatsReport {
    /// Bits flipped by the channel.
    pub injected_flips: u64,
    /// Codewords (or values) read.
    pub words: u64,
    /// Words corrected.
    pub corrected: u64,
    /// Words detected as uncorrectable.
    pub detected: u64,
    /// Words decoded to a wrong codeword.
    pub miscorrected: u64,
    /// Words changed without any detection (unprotected forms, or
    /// undetectable patterns).
    pub silent: u64,
    /// Values erased (then kept, zeroed or interpolated by the policy).
    pub erased_values: u64,
    /// Metadata words corrected, detected, miscorrected, silent.
    pub metadata: [u64; 4],
    /// Words of the fitted tables (codebooks, calibrated bases) read, and
    /// of them corrected, detected, miscorrected, silent (tables faulted
    /// under `--target metadata|everything`; summed over calls).
    pub tables: [u64; 5],
    /// Non-finite attention outputs.
    pub non_finite_attention: u64,
    /// Stored bits per K/V value, metadata and codebooks included (a
    /// codebook counted with every window that uses it).
    pub bits_per_value: f64,
    /// Stored bits per key value.
    pub key_bits_per_value: f64,
    /// Stored bits per value-cache value.
    pub value_bits_per_value: f64,
    /// The codebooks' share of `bits_per_value`.
    pub codebook_bits_per_value: f64,
    /// Mean and largest runtime error certificates of each low-rank layer
    /// (empty for runs without low-rank forms).
    pub certificates: Vec<LayerCertificate>,
    /// Value codewords read, corrected and detected per layer (what a
    /// scrubber sees of each layer's memory; re-encode backend).
    pub layers: Vec<crate::cache::LayerCodewords>,
    /// The same per block of rows (`blocks[2·layer + part][block]`), for
    /// forms read block by block with `observe` set; empty otherwise.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub blocks: Vec<Vec<crate::cache::LayerCodewords>>,
}

impl StatsReport {
    /// The value-word counts in one array: injected flips, words,
    /// corrected, detected, miscorrected, silent, erased values.
    pub fn value_counts(&self) -> [u64; 7] {
        [
            self.injected_flips,
            self.words,
            self.corrected,
            self.detected,
            self.miscorrected,
            self.silent,
            self.erased_values,
        ]
    }
}

/// The error certificates of one layer over a run (see `kv_lowrank::certificate`).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct LayerCertificate {
    /// The layer.
    pub layer: usize,
    /// Certificates summed (query heads × queries × calls).
    pub count: u64,
    /// Mean bound on a logit's change.
    pub logit_mean: f64,
    /// Largest bound on a logit's change.
    pub logit_max: f64,
    /// Mean bound on an attention output's change (Euclidean).
    pub output_mean: f64,
    /// Largest bound on an attention output's change.
    pub output_max: f64,
}

impl From<&CacheStats> for StatsReport {
    fn from(s: &CacheStats) -> Self {
        let mut v = s.keys.values;
        v += s.values.values;
        let mut m = s.keys.metadata;
        m += s.values.metadata;
        Self {
            injected_flips: s.injected_flips,
            words: v.words,
            corrected: v.corrected,
            detected: v.detected,
            miscorrected: v.miscorrected,
            silent: v.silent,
            erased_values: s.keys.erased_values + s.values.erased_values,
            metadata: [m.corrected, m.detected, m.miscorrected, m.silent],
            tables: {
                let t = &s.tables;
                [t.words, t.corrected, t.detected, t.miscorrected, t.silent]
            },
            non_finite_attention: s.non_finite,
            bits_per_value: bits(s.stored_bytes, s.stored_values),
            key_bits_per_value: bits(s.part_bytes[0], s.stored_values / 2),
            value_bits_per_value: bits(s.part_bytes[1], s.stored_values / 2),
            codebook_bits_per_value: if s.stored_values == 0 {
                0.0
            } else {
                bits(s.codebook_bytes, s.stored_values)
            },
            certificates: s
                .certificates
                .iter()
                .enumerate()
                .filter(|(_, c)| c.count > 0)
                .map(|(layer, c)| LayerCertificate {
                    layer,
                    count: c.count,
                    logit_mean: c.logit_sum / c.count as f64,
                    logit_max: c.logit_max,
                    output_mean: c.output_sum / c.count as f64,
                    output_max: c.output_max,
                })
                .collect(),
            layers: s.layers.clone(),
            blocks: s.blocks.clone(),
        }
    }
}

/// Bits per value of `bytes` over `values` values (32 for the unstored pass).
fn bits(bytes: u64, values: u64) -> f64 {
    if values == 0 {
        32.0
    } else {
        8.0 * bytes as f64 / values as f64
    }
}

/// Running sums of one configuration.
#[derive(Clone, Debug, Default)]
struct Sums {
    nll: f64,
    kl: f64,
    scored: u64,
    processed: u64,
    seconds: f64,
    top1: u64,
    top5: u64,
    agree1: u64,
    agree5: u64,
    non_finite: u64,
    stats: CacheStats,
}

/// Per-row facts of one logits row.
pub(crate) struct Row {
    pub(crate) lse: f64,
    pub(crate) top5: [u32; 5],
    pub(crate) finite: bool,
}

pub(crate) fn row_facts(logits: &[f32]) -> Row {
    let finite = logits.iter().all(|x| x.is_finite());
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    // exp in f32 (relative error ~1e-7), summed in f64.
    let sum: f64 = logits.iter().map(|&x| f64::from((x - max).exp())).sum();
    let mut top = [(f32::NEG_INFINITY, u32::MAX); 5];
    for (i, &x) in logits.iter().enumerate() {
        // Strictly greater keeps the lowest index first among equal logits.
        if x > top[4].0 {
            let mut j = 4;
            while j > 0 && x > top[j - 1].0 {
                top[j] = top[j - 1];
                j -= 1;
            }
            top[j] = (x, i as u32);
        }
    }
    Row {
        lse: f64::from(max) + sum.ln(),
        top5: top.map(|t| t.1),
        finite,
    }
}

/// The clean distribution of a row, `p = exp(logit − lse)` in f32.
pub(crate) fn probabilities(logits: &[f32], lse: f64) -> Vec<f32> {
    logits
        .iter()
        .map(|&a| (f64::from(a) - lse).exp() as f32)
        .collect()
}

/// KL(p ‖ q) for the clean row `p` (logits, log-sum-exp `lp`, probabilities
/// `probs`) and a row `q` with log-sum-exp `lq`:
/// `Σ pᵢ((aᵢ − lp) − (bᵢ − lq)) = Σ pᵢ(aᵢ − bᵢ) + (lq − lp)·Σ pᵢ`, which needs
/// no exponential per configuration.
pub(crate) fn kl(p: &[f32], lp: f64, probs: &[f32], q: &[f32], lq: f64) -> f64 {
    let mut dot = 0.0f64;
    let mut mass = 0.0f64;
    for ((&a, &b), &pi) in p.iter().zip(q).zip(probs) {
        dot += f64::from(pi) * f64::from(a - b);
        mass += f64::from(pi);
    }
    (dot + (lq - lp) * mass).max(0.0)
}

/// Runs one window of `run` from a fresh cache on its backend: the logits
/// from `logits_from` on and the cache's statistics.
fn run_window(
    model: &dyn CausalLm,
    run: &RunConfig,
    input: &[u32],
    logits_from: usize,
    window: usize,
) -> Result<(Vec<f32>, CacheStats)> {
    if let Some(policy) = run.eviction {
        return run_evicting(model, run, policy, input, logits_from);
    }
    match run.backend {
        BackendKind::Reencode => {
            let mut cache = KvCache::new(run.mode.clone(), run.faults, window as u64)?;
            let logits = model.forward(input, &mut cache, logits_from)?;
            Ok((logits, cache.stats().clone()))
        }
        BackendKind::Dense => {
            run.backend.check(&run.mode, run.faults)?;
            let mut cache = Adapted(DenseBackend::new());
            let logits = model.forward(input, &mut cache, logits_from)?;
            Ok((logits, CacheStats::default()))
        }
        BackendKind::Paged { block_size } => {
            let mut cache = Adapted(paged_backend(
                model,
                &run.mode,
                run.faults,
                block_size,
                input.len(),
            )?);
            // Forms whose blocks are sealed when a step commits are read as
            // a server reads them: the window runs in steps of one block,
            // so each block's queries see the blocks before it sealed and
            // their own block exact, as token-by-token decoding does.
            // Row-local forms hold the same bytes either way: one step.
            let step = if seals_blocks(&run.mode, block_size) {
                block_size
            } else {
                input.len()
            };
            let mut logits = Vec::new();
            for (i, chunk) in input.chunks(step).enumerate() {
                let from = logits_from.saturating_sub(i * step).min(chunk.len());
                logits.extend(model.forward(chunk, &mut cache, from)?);
            }
            Ok((logits, paged_stats(&cache.0, model, input.len())?))
        }
    }
}

/// [`run_window`] with SnapKV's eviction after the window's unscored
/// prefix (its first `logits_from` tokens: the prompt), so every scored
/// prediction reads the evicted cache; the steps as without eviction (one
/// block where forms seal blocks, else the prefix and the rest whole). A
/// window that scores from its first token evicts nothing. Bits count the
/// rows held at the window's end against every token of the window.
fn run_evicting(
    model: &dyn CausalLm,
    run: &RunConfig,
    policy: SnapKv,
    input: &[u32],
    logits_from: usize,
) -> Result<(Vec<f32>, CacheStats)> {
    check_eviction(&run.mode, run.backend)?;
    check_eviction_memory(model, logits_from)?;
    match run.backend {
        BackendKind::Dense => {
            let mut cache = Adapted(Evicting::new(DenseBackend::new(), policy)?);
            let logits = evicting_steps(model, &mut cache, input, logits_from)?;
            let inner = cache.0.inner();
            let values = 2 * (input.len() * model.kv_channels() * model.layers()) as u64;
            let bytes = inner.held_bytes();
            Ok((
                logits,
                CacheStats {
                    stored_bytes: bytes,
                    stored_values: values,
                    part_bytes: [bytes / 2, bytes / 2],
                    ..CacheStats::default()
                },
            ))
        }
        BackendKind::Paged { block_size } => {
            let paged = paged_backend(model, &run.mode, run.faults, block_size, input.len())?;
            let mut cache = Adapted(Evicting::new(paged, policy)?);
            let logits = evicting_steps(model, &mut cache, input, logits_from)?;
            Ok((logits, paged_stats(cache.0.inner(), model, input.len())?))
        }
        BackendKind::Reencode => unreachable!("refused by check_eviction"),
    }
}

/// The steps of [`run_evicting`]: the prefix, the eviction, the rest.
fn evicting_steps<B>(
    model: &dyn CausalLm,
    cache: &mut Adapted<Evicting<B>>,
    input: &[u32],
    logits_from: usize,
) -> Result<Vec<f32>>
where
    B: KvBackend,
    kv_model::ModelError: From<B::Error>,
{
    let mut logits = Vec::new();
    let mut done = 0;
    while done < input.len() {
        if done == logits_from && done > 0 && cache.0.eviction().is_none() {
            cache.0.evict().map_err(kv_model::ModelError::from)?;
        }
        let end = if done < logits_from {
            logits_from
        } else {
            input.len()
        };
        let n = cache
            .0
            .rows_before_seal()
            .unwrap_or(end - done)
            .min(end - done);
        let from = logits_from.saturating_sub(done).min(n);
        logits.extend(model.forward(&input[done..done + n], cache, from)?);
        done += n;
    }
    Ok(logits)
}

/// Evaluates every configuration over the windows of `tokens`, calling
/// `progress(windows_done, windows_total)` after each window.
pub fn evaluate(
    model: &dyn CausalLm,
    tokens: &[u32],
    ctx: usize,
    method: PplMethod,
    runs: &[RunConfig],
    mut progress: impl FnMut(usize, usize),
) -> Result<Vec<RunMetrics>> {
    let wins = windows(tokens.len(), ctx, method)?;
    if wins.iter().all(|w| w.scored() == 0) {
        return Err(EvalError::InvalidParameter {
            name: "tokens",
            reason: format!(
                "{} tokens in windows of {ctx} score no prediction",
                tokens.len()
            ),
        });
    }
    let vocab = model.vocab();
    let mut sums = vec![Sums::default(); runs.len()];
    let need_clean = runs.iter().any(|r| !r.is_clean_plain());
    for (w, win) in wins.iter().enumerate() {
        let input = &tokens[win.start..win.start + win.len];
        let targets = &tokens[win.start + win.first_scored + 1..win.start + win.len];
        let rows = win.scored();
        let mut clean_seconds = 0.0;
        let clean = if need_clean {
            let started = Instant::now();
            let mut cache = KvCache::new(CacheMode::Plain, None, w as u64)?;
            let logits = model.forward(&input[..win.len - 1], &mut cache, win.first_scored)?;
            clean_seconds = started.elapsed().as_secs_f64();
            let facts: Vec<Row> = logits.par_chunks(vocab).map(row_facts).collect();
            let probs: Vec<Vec<f32>> = logits
                .par_chunks(vocab)
                .zip(&facts)
                .map(|(row, f)| probabilities(row, f.lse))
                .collect();
            Some((logits, facts, probs))
        } else {
            None
        };
        for (run, s) in runs.iter().zip(&mut sums) {
            s.processed += (win.len - 1) as u64;
            let owned;
            let (logits, facts) = match &clean {
                // The clean plain pass is the reference itself: reuse it.
                Some((logits, facts, _)) if run.is_clean_plain() => {
                    s.seconds += clean_seconds;
                    (logits, facts)
                }
                _ => {
                    let started = Instant::now();
                    let (logits, stats) =
                        run_window(model, run, &input[..win.len - 1], win.first_scored, w)?;
                    s.seconds += started.elapsed().as_secs_f64();
                    s.stats += stats;
                    let facts: Vec<Row> = logits.par_chunks(vocab).map(row_facts).collect();
                    owned = (logits, facts);
                    (&owned.0, &owned.1)
                }
            };
            let per_row: Vec<(f64, f64, bool, bool, bool, bool, bool)> = (0..rows)
                .into_par_iter()
                .map(|r| {
                    let row = &logits[r * vocab..(r + 1) * vocab];
                    let f = &facts[r];
                    let target = targets[r];
                    let nll = if f.finite {
                        f.lse - f64::from(row[target as usize])
                    } else {
                        f64::INFINITY
                    };
                    let (kl_v, a1, a5) = match &clean {
                        Some((cl, cf, cp)) => {
                            let crow = &cl[r * vocab..(r + 1) * vocab];
                            let c = &cf[r];
                            let kl_v = if f.finite {
                                kl(crow, c.lse, &cp[r], row, f.lse)
                            } else {
                                f64::INFINITY
                            };
                            (kl_v, f.top5[0] == c.top5[0], f.top5.contains(&c.top5[0]))
                        }
                        None => (0.0, true, true),
                    };
                    (
                        nll,
                        kl_v,
                        f.top5[0] == target,
                        f.top5.contains(&target),
                        a1,
                        a5,
                        f.finite,
                    )
                })
                .collect();
            for (nll, kl_v, t1, t5, a1, a5, finite) in per_row {
                s.nll += nll;
                s.kl += kl_v;
                s.top1 += u64::from(t1);
                s.top5 += u64::from(t5);
                s.agree1 += u64::from(a1);
                s.agree5 += u64::from(a5);
                s.non_finite += u64::from(!finite);
            }
            s.scored += rows as u64;
        }
        progress(w + 1, wins.len());
    }
    Ok(sums
        .into_iter()
        .map(|s| {
            let n = s.scored.max(1) as f64;
            let nll_mean = s.nll / n;
            RunMetrics {
                ppl: nll_mean.exp(),
                nll_mean,
                tokens_scored: s.scored,
                tokens_processed: s.processed,
                seconds: s.seconds,
                tokens_per_second: s.processed as f64 / s.seconds.max(1e-9),
                kl_mean: s.kl / n,
                top1_accuracy: s.top1 as f64 / n,
                top5_accuracy: s.top5 as f64 / n,
                top1_agreement: s.agree1 as f64 / n,
                top5_agreement: s.agree5 as f64 / n,
                non_finite_predictions: s.non_finite,
                stats: StatsReport::from(&s.stats),
            }
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn run_metrics_compare_with_a_tolerance_and_counts_exactly() {
        let a = RunMetrics {
            ppl: 10.0,
            nll_mean: 10f64.ln(),
            tokens_scored: 100,
            tokens_processed: 200,
            seconds: 1.0,
            ..RunMetrics::default()
        };
        let close = RunMetrics {
            ppl: 10.0 * (1.0 + 1e-7),
            seconds: 5.0,
            ..a.clone()
        };
        assert!(approx::relative_eq!(a, close, max_relative = 1e-6));
        assert!(!approx::relative_eq!(a, close, max_relative = 1e-9));
        let far = RunMetrics {
            ppl: 10.1,
            ..a.clone()
        };
        assert!(!approx::relative_eq!(a, far, max_relative = 1e-3));
        assert!(approx::abs_diff_eq!(a, far, epsilon = 0.2));
        let fewer = RunMetrics {
            tokens_scored: 99,
            ..a.clone()
        };
        assert!(!approx::abs_diff_eq!(a, fewer, epsilon = 1.0));
    }

    #[test]
    fn llamacpp_windows_score_the_second_half() {
        let w = windows(1000, 256, PplMethod::LlamaCpp).unwrap();
        assert_eq!(w.len(), 3);
        assert_eq!(
            w[1],
            Window {
                start: 256,
                len: 256,
                first_scored: 128
            }
        );
        assert_eq!(w[0].scored(), 256 - 1 - 128);
    }

    #[test]
    fn sliding_windows_score_every_token_once() {
        for (n, ctx, stride) in [
            (1000, 256, 128),
            (300, 256, 128),
            (256, 256, 128),
            (97, 16, 5),
            (50, 8, 8),
        ] {
            let w = windows(n, ctx, PplMethod::Sliding { stride }).unwrap();
            let mut predicted = vec![0u32; n];
            for win in &w {
                assert!(win.len <= ctx);
                for r in win.first_scored..win.len - 1 {
                    predicted[win.start + r + 1] += 1;
                }
            }
            assert_eq!(predicted[0], 0);
            if stride < ctx {
                assert!(predicted[1..].iter().all(|&c| c == 1), "{n} {ctx} {stride}");
            } else {
                // Disjoint windows: each window's first token has no context.
                for (i, &c) in predicted.iter().enumerate() {
                    assert_eq!(c, u32::from(i % ctx != 0), "{n} {ctx} {stride} {i}");
                }
            }
        }
        assert!(windows(10, 8, PplMethod::Sliding { stride: 0 }).is_err());
        assert!(windows(10, 1, PplMethod::LlamaCpp).is_err());
    }

    #[test]
    fn row_facts_orders_top5_and_kl_is_zero_on_itself() {
        let row = [0.5f32, 3.0, -1.0, 3.0, 2.0, 7.0, 0.0];
        let f = row_facts(&row);
        assert_eq!(f.top5, [5, 1, 3, 4, 0]);
        let lse = row.iter().map(|&x| f64::from(x).exp()).sum::<f64>().ln();
        approx::assert_abs_diff_eq!(f.lse, lse, epsilon = 1e-6);
        let probs = probabilities(&row, f.lse);
        assert!(kl(&row, f.lse, &probs, &row, f.lse).abs() < 1e-12);
        let other = [0.0f32; 7];
        let lo = 7f64.ln();
        let p: Vec<f64> = row.iter().map(|&x| (f64::from(x) - lse).exp()).collect();
        let want: f64 = p.iter().map(|&p| p * (p.ln() + lo)).sum();
        approx::assert_abs_diff_eq!(kl(&row, f.lse, &probs, &other, lo), want, epsilon = 1e-6);
    }
}
