//! Faults that accumulate while the model generates (beyond the ECC
//! KV-cache paper, which faults a cache once): every decode step, each bit
//! of the resident blocks of a paged cache flips with a small probability,
//! and a scrubber may rewrite what its code corrects every few steps, before
//! single errors pair up into uncorrectable ones.
//!
//! For each form the clean run generates `steps` tokens greedily after the
//! prompt (the same form, no faults). Each faulty run then replays those
//! tokens (teacher forcing: the same context at every step, so the runs can
//! be compared step by step) while faults accumulate, and measures at every
//! step the KL divergence of its next-token distribution from the clean
//! run's, and whether its top-1 token is still the clean one.

use std::path::{Path, PathBuf};

use gf2_codes::channel::FaultChannel;
use kv_quant::{FaultTarget, ScrubStats};
use serde::Serialize;

use crate::backend::paged_backend;
use crate::cache::{CacheMode, ChannelKind};
use crate::error::{EvalError, Result};
use crate::metrics::{kl, probabilities, row_facts};
use kv_model::model::CausalLm;

/// The experiment's fixed settings.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AccumulateConfig {
    /// Decode steps after the prompt.
    pub steps: usize,
    /// Tokens per paged block.
    pub block_size: usize,
    /// Bit error rate applied to every resident block before each step.
    pub ber_per_step: f64,
    /// The fault channel.
    pub channel: ChannelKind,
    /// Which stored bits are exposed.
    pub target: FaultTarget,
    /// Seed; step `s` draws from its own stream of it.
    pub seed: u64,
}

/// One form × scrub interval.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct AccumulateRow {
    /// The form.
    pub form: String,
    /// Scrub every this many steps (`None`: never).
    pub scrub_every: Option<usize>,
    /// Fraction of steps whose top-1 token is the clean run's.
    pub agreement: f64,
    /// Mean KL(clean ‖ faulty) over the steps (nats).
    pub kl_mean: f64,
    /// Mean KL over the last quarter of the steps (where faults have piled up).
    pub kl_last_quarter: f64,
    /// KL at every step.
    pub kl_per_step: Vec<f64>,
    /// Bits flipped into the resident blocks and fitted tables.
    pub injected_flips: u64,
    /// Of them, bits flipped into fitted tables (a `vq` codebook, calibrated bases).
    pub table_flips: u64,
    /// Words of the fitted tables as they read at the end: corrected
    /// (their code corrects them on every read; a scrub rewrites them),
    /// detected (read as zero), wrong (miscorrected or silent).
    pub table_words: [u64; 3],
    /// Value codewords the scrubber rewrote.
    pub scrub_corrected: u64,
    /// Value codewords the scrubber found uncorrectable.
    pub scrub_detected: u64,
    /// Value codewords attention's reads corrected.
    pub read_corrected: u64,
    /// Value codewords attention's reads found uncorrectable.
    pub read_detected: u64,
}

/// The experiment's rows, with its settings.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct AccumulateReport {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Decode steps.
    pub steps: usize,
    /// Bit error rate per step.
    pub ber_per_step: f64,
    /// Rows, form-major.
    pub rows: Vec<AccumulateRow>,
}

/// Runs every form of `forms` with every scrub interval of `scrubs` after
/// `prompt` (see the module docs).
pub fn run(
    model: &dyn CausalLm,
    prompt: &[u32],
    forms: &[CacheMode],
    scrubs: &[Option<usize>],
    config: &AccumulateConfig,
    mut on_row: impl FnMut(&AccumulateRow),
) -> Result<AccumulateReport> {
    if prompt.is_empty() || config.steps == 0 {
        return Err(EvalError::InvalidParameter {
            name: "accumulate",
            reason: "a prompt and at least one step are needed".into(),
        });
    }
    if scrubs.contains(&Some(0)) {
        return Err(EvalError::InvalidParameter {
            name: "scrub-every",
            reason: "scrub every 1 or more steps".into(),
        });
    }
    if !(0.0..=1.0).contains(&config.ber_per_step) {
        return Err(EvalError::InvalidParameter {
            name: "ber-per-step",
            reason: format!("{} is not in [0, 1]", config.ber_per_step),
        });
    }
    let channel = config.channel.build(config.ber_per_step)?;
    let vocab = model.vocab();
    let tokens = prompt.len() + config.steps;
    let mut rows = Vec::new();
    for mode in forms {
        // The clean run: greedy tokens and their logits, same form, no faults.
        let mut cache =
            kv_model::model::Adapted(paged_backend(model, mode, None, config.block_size, tokens)?);
        let first = model.forward(prompt, &mut cache, prompt.len() - 1)?;
        let mut next = argmax(&first[..vocab]);
        let mut clean = CleanRun::default();
        for _ in 0..config.steps {
            clean.forced.push(next);
            let logits = model.forward(&[next], &mut cache, 0)?;
            // Each clean row's facts once, for every faulty replay.
            let facts = row_facts(&logits);
            next = facts.top5[0];
            clean.probs.extend(probabilities(&logits, facts.lse));
            clean.logits.extend_from_slice(&logits);
            clean.lse.push(facts.lse);
            clean.top.push(next);
        }
        for &scrub_every in scrubs {
            let row = faulty_run(
                model,
                prompt,
                &clean,
                mode,
                scrub_every,
                config,
                channel.as_ref(),
            )?;
            on_row(&row);
            rows.push(row);
        }
    }
    Ok(AccumulateReport {
        prompt_tokens: prompt.len(),
        steps: config.steps,
        ber_per_step: config.ber_per_step,
        rows,
    })
}

fn argmax(logits: &[f32]) -> u32 {
    row_facts(logits).top5[0]
}

/// The clean run of one form: the tokens it picked (replayed by the faulty
/// runs) and, per step, its logits, their log-sum-exp, probabilities and
/// top-1 token.
#[derive(Default)]
struct CleanRun {
    forced: Vec<u32>,
    logits: Vec<f32>,
    probs: Vec<f32>,
    lse: Vec<f64>,
    top: Vec<u32>,
}

/// One faulty replay of the clean run's tokens.
fn faulty_run(
    model: &dyn CausalLm,
    prompt: &[u32],
    clean: &CleanRun,
    mode: &CacheMode,
    scrub_every: Option<usize>,
    config: &AccumulateConfig,
    channel: &(dyn FaultChannel + Send + Sync),
) -> Result<AccumulateRow> {
    let vocab = model.vocab();
    let backend = paged_backend(
        model,
        mode,
        None,
        config.block_size,
        prompt.len() + clean.forced.len(),
    )?;
    let mut cache = kv_model::model::Adapted(backend);
    model.forward(prompt, &mut cache, prompt.len() - 1)?;
    let mut injected = 0;
    let mut scrubbed = ScrubStats::default();
    let mut kls = Vec::with_capacity(clean.forced.len());
    let mut agree = 0usize;
    let rows = clean
        .logits
        .chunks_exact(vocab)
        .zip(clean.probs.chunks_exact(vocab));
    for (step, (&token, (p_logits, p_probs))) in clean.forced.iter().zip(rows).enumerate() {
        let seed = config.seed ^ (step as u64).wrapping_mul(0xd1b5_4a32_d192_ed03);
        injected += cache.0.inject(channel, seed, config.target)?;
        if scrub_every.is_some_and(|n| (step + 1) % n == 0) {
            scrubbed += cache.0.scrub()?;
        }
        let logits = model.forward(&[token], &mut cache, 0)?;
        let q = row_facts(&logits);
        let d = if q.finite {
            kl(p_logits, clean.lse[step], p_probs, &logits, q.lse)
        } else {
            f64::INFINITY
        };
        kls.push(d);
        agree += usize::from(q.top5[0] == clean.top[step]);
    }
    let n = kls.len();
    let mean = |xs: &[f64]| xs.iter().sum::<f64>() / xs.len().max(1) as f64;
    let reads = cache.0.read_stats();
    Ok(AccumulateRow {
        form: mode.label(),
        scrub_every,
        agreement: agree as f64 / n as f64,
        kl_mean: mean(&kls),
        kl_last_quarter: mean(&kls[n - n.div_ceil(4)..]),
        kl_per_step: kls,
        injected_flips: injected,
        table_flips: cache.0.table_flips(),
        table_words: {
            let t = cache.0.table_stats()?;
            [t.corrected, t.detected, t.miscorrected + t.silent]
        },
        scrub_corrected: scrubbed.values.corrected,
        scrub_detected: scrubbed.values.detected,
        read_corrected: reads.keys.values.corrected + reads.values.values.corrected,
        read_detected: reads.keys.values.detected + reads.values.values.detected,
    })
}

impl AccumulateReport {
    /// The table as Markdown.
    pub fn markdown(&self) -> String {
        let mut s = format!(
            "## Faults accumulating during generation\n\n{} prompt tokens, {} greedy steps replayed \
             while every resident bit flips with probability {:e} before each step; KL and top-1 \
             agreement against the same form without faults.\n\n\
             | form | scrub every | top-1 agreement | mean KL | KL, last quarter | flips | scrub corrected | scrub detected | reads corrected | reads detected |\n\
             |---|---|---|---|---|---|---|---|---|---|\n",
            self.prompt_tokens, self.steps, self.ber_per_step
        );
        for r in &self.rows {
            s.push_str(&format!(
                "| `{}` | {} | {:.2}% | {:.4} | {:.4} | {}{} | {} | {} | {} | {} |\n",
                r.form,
                r.scrub_every
                    .map_or("never".to_string(), |n| format!("{n} steps")),
                100.0 * r.agreement,
                r.kl_mean,
                r.kl_last_quarter,
                r.injected_flips,
                if r.table_flips > 0 {
                    let [c, d, w] = r.table_words;
                    format!(
                        " ({} in fitted tables: words corrected {c}, detected {d}, wrong {w})",
                        r.table_flips
                    )
                } else {
                    String::new()
                },
                r.scrub_corrected,
                r.scrub_detected,
                r.read_corrected,
                r.read_detected
            ));
        }
        s
    }

    /// Writes `accumulate.md` and `accumulate.json` into `dir`.
    pub fn write(&self, dir: &Path) -> Result<Vec<PathBuf>> {
        crate::report_files::write(dir, "accumulate", &self.markdown(), Some(self), None)
    }
}
