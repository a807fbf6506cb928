//! `kv-eval ppl`: perplexity, KL from the clean run, top-k and codec
//! statistics of one configuration, with optional GEMM checks and flips,
//! or faults in the stored weights and their checks.

use std::path::PathBuf;

use kv_eval::cache::{CacheMode, ChannelKind, FaultSpec};
use kv_eval::metrics::{RunConfig, RunMetrics};

use crate::Error;
use crate::abft::{self, AbftRule, FlipSite, abft_rule};
use crate::args::{Backend, BackendArgs, EvictArgs, Forms, Target, mode_of};
use crate::calib::{Calib, calibration_for};
use crate::checks::{check_ber, check_out_file, check_segments};
use crate::progress::evaluate_with_bar;
use crate::source::{Prepared, Source, method, method_name, prepare};

/// Perplexity, KL from the clean run, top-k and codec statistics of one configuration.
#[derive(clap::Args)]
pub(crate) struct PplArgs {
    #[command(flatten)]
    pub(crate) source: Source,
    #[command(flatten)]
    pub(crate) forms: Forms,
    #[command(flatten)]
    pub(crate) calib: Calib,
    #[command(flatten)]
    pub(crate) backend: BackendArgs,
    #[command(flatten)]
    pub(crate) evict: EvictArgs,
    /// Bit error rate of the fault channel.
    #[arg(long, default_value_t = 0.0)]
    pub(crate) ber: f64,
    /// Fault channel: bsc (independent flips), burst, mbu, stuck0, stuck1.
    #[arg(long, default_value = "bsc")]
    pub(crate) channel: String,
    /// Which stored bits are exposed.
    #[arg(long, value_enum, default_value_t = Target::Values)]
    pub(crate) target: Target,
    /// Fault seed.
    #[arg(long, default_value_t = 0)]
    pub(crate) seed: u64,
    /// Check every matrix product of the forward pass with row checksums
    /// (abft-gemm) under this rule [`--abft` alone: v-abft] and report
    /// how many rows fired.
    #[arg(long, value_enum, num_args = 0..=1, default_missing_value = "v-abft")]
    pub(crate) abft: Option<AbftRule>,
    /// V-ABFT's e_max [default: the design's FP32 value].
    #[arg(long)]
    pub(crate) abft_emax: Option<f64>,
    /// The fixed rule's relative tolerance τ (bound τ·Σ|row|) [default: 1e-3].
    #[arg(long)]
    pub(crate) abft_tau: Option<f64>,
    /// With --abft: flip one random bit of each element of the
    /// --gemm-flip-site (output, running sum or weight) with this
    /// probability (seeded by --seed), and report the detection rate per
    /// bit position.
    #[arg(long, default_value_t = 0.0)]
    pub(crate) gemm_flips: f64,
    /// Where --gemm-flips land: product elements, running sums, or
    /// weights [default: output].
    #[arg(long, value_enum)]
    pub(crate) gemm_flip_site: Option<FlipSite>,
    /// With --abft: correct flagged rows (one corrupted element each,
    /// located by column checksums and rewritten).
    #[arg(long)]
    pub(crate) abft_correct: bool,
    /// Flip every stored weight bit with this probability per forward
    /// pass (seeded by --seed); flips stay until a check repairs them.
    #[arg(long, default_value_t = 0.0)]
    pub(crate) weight_flips: f64,
    /// Check the stored weights (a CRC-32 per row, an XOR parity row per
    /// group) and rebuild damaged rows before the products of every Nth
    /// pass, or never.
    #[arg(long, default_value = "never", value_parser = parse_check_every)]
    pub(crate) weight_check: Every,
    /// Rows per parity group of the weight checks.
    #[arg(long, default_value_t = kv_model::model::DEFAULT_ROWS_PER_GROUP)]
    pub(crate) weight_group: usize,
    /// Also write the result as JSON to this file.
    #[arg(long)]
    pub(crate) json: Option<PathBuf>,
}

/// How often the stored weights are checked: every N passes, or never.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Every(Option<u64>);

/// `never` or a number of passes (at least 1).
fn parse_check_every(s: &str) -> Result<Every, String> {
    if s == "never" {
        return Ok(Every(None));
    }
    match s.parse::<u64>() {
        Ok(n) if n >= 1 => Ok(Every(Some(n))),
        _ => Err(format!(
            "{s:?} is neither `never` nor a number of passes of at least 1"
        )),
    }
}

/// Runs `kv-eval ppl`.
pub(crate) fn run(args: PplArgs) -> Result<(), Error> {
    let PplArgs {
        source,
        forms,
        calib,
        backend,
        evict,
        ber,
        channel,
        target,
        seed,
        abft,
        abft_emax,
        abft_tau,
        gemm_flips,
        gemm_flip_site,
        abft_correct,
        weight_flips,
        weight_check,
        weight_group,
        json,
    } = args;
    if let Some(path) = &json {
        check_out_file(path, "--json")?;
    }
    check_ber("--ber", ber)?;
    if !(0.0..=1.0).contains(&gemm_flips) {
        return Err(format!("--gemm-flips {gemm_flips} is not in [0, 1]").into());
    }
    if (gemm_flips > 0.0 || abft_correct) && abft.is_none() {
        return Err(
            "--gemm-flips and --abft-correct need --abft (they act on checked products)".into(),
        );
    }
    if gemm_flip_site.is_some() && gemm_flips == 0.0 {
        return Err("--gemm-flip-site goes with --gemm-flips".into());
    }
    let gemm_flip_site = gemm_flip_site.unwrap_or(FlipSite::Output);
    let weight_faults = (weight_flips != 0.0 || weight_check.0.is_some())
        .then(|| {
            kv_eval::weight_faults::WeightFaults::new(
                kv_eval::weight_faults::WeightFaultConfig {
                    rate: weight_flips,
                    seed,
                    check_every: weight_check.0,
                    rows_per_group: weight_group,
                },
                kv_model::weights::Isa::detect(),
            )
        })
        .transpose()?
        .map(std::sync::Arc::new);
    if weight_faults.is_some() && abft.is_some() {
        return Err(
            "--weight-flips/--weight-check and --abft both compute every product: \
                    use one"
                .into(),
        );
    }
    let rule = abft_rule(abft, abft_emax, abft_tau)?;
    let eviction = evict.policy()?;
    let mode = mode_of(&forms)?;
    if weight_faults.is_some() && mode != CacheMode::Plain {
        return Err(format!(
            "--weight-flips/--weight-check run on the plain cache (the clean reference \
             pass would read the faulty weights too), not {}",
            mode.label()
        )
        .into());
    }
    check_segments(&mode, source.ctx)?;
    let channel: ChannelKind = channel.parse()?;
    let faults = FaultSpec {
        channel,
        ber,
        seed,
        target: target.into(),
        hot: None,
    };
    // GEMM flips can make K/V non-finite, which the paged cache
    // refuses to store: `auto` keeps them on the re-encode backend.
    let (numerics, isa) = (backend.numerics, backend.isa);
    let backend = match backend.backend {
        Backend::Auto if gemm_flips > 0.0 => kv_eval::backend::BackendKind::Reencode,
        Backend::Auto if eviction.is_some() => kv_eval::backend::BackendKind::Paged {
            block_size: backend.block_size,
        },
        _ => backend.kind(&mode, Some(faults)),
    };
    backend.check(&mode, Some(faults))?;
    if eviction.is_some() {
        kv_eval::backend::check_eviction(&mode, backend)?;
    }
    if ber > 0.0 && mode == CacheMode::Plain {
        return Err("faults need a stored form: pass --form (fp32, int4+secded84, ...)".into());
    }
    let Prepared {
        mut model,
        tokenizer,
        tokens,
        model_file,
        text_file,
    } = prepare(&source, std::slice::from_ref(&mode))?;
    // Pinned before the calibration passes, which run the model too.
    if let Some(isa) = isa {
        model.set_attention_isa(isa)?;
    }
    let cal = calibration_for(
        std::slice::from_ref(&mode),
        &calib,
        model.as_ref(),
        &tokenizer,
    )?;
    if let Some(n) = numerics {
        model.set_numerics(n.numerics());
    }
    let mut checks = None;
    if let Some(rule) = rule {
        let flips = (gemm_flips > 0.0).then_some(kv_eval::gemm_checks::GemmFlips {
            rate: gemm_flips,
            seed,
            site: gemm_flip_site.into(),
        });
        checks = kv_eval::gemm_checks::install(
            model.as_mut(),
            Some(kv_eval::gemm_checks::GemmCheckConfig {
                rule,
                flips,
                correct: abft_correct,
            }),
        )?;
    }
    if let Some(faults) = &weight_faults {
        kv_eval::budget::check(
            "--weight-flips/--weight-check: a faulty copy of the weights, their parity rows \
             and CRCs",
            kv_eval::weight_faults::WeightFaults::memory_needed(model.as_ref(), weight_group),
        )?;
        model.set_projection_hook(Some(faults.clone()));
    }
    let mode = mode.with_calibration(cal);
    let label = match eviction {
        Some(e) => format!(
            "{} {} (window {}, pool {})",
            mode.label(),
            kv_eval::metrics::eviction_label(&e),
            e.window(),
            e.pool()
        ),
        None => mode.label(),
    };
    let run = RunConfig {
        mode,
        faults: Some(faults),
        backend,
        eviction,
    };
    eprintln!("backend: {}", backend.name());
    let m = evaluate_with_bar(
        &label,
        model.as_ref(),
        &tokens,
        source.ctx,
        method(&source),
        &[run],
    )?
    .remove(0);
    print_metrics(&label, ber, &m);
    let checks = checks.map(|c| c.stats());
    if let Some(c) = checks {
        abft::print_checks(rule, &c, abft_correct, gemm_flips > 0.0);
    }
    let weight_stats = weight_faults.map(|w| w.stats());
    if let Some(w) = &weight_stats {
        print_weight_faults(w, weight_check.0);
    }
    if let Some(path) = json {
        let value = serde_json::json!({
            "model": model_file, "text": text_file, "ctx": source.ctx,
            "method": method_name(&source), "form": label,
            "key_form": forms.key_form.as_deref().unwrap_or(&forms.form),
            "value_form": forms.value_form.as_deref().unwrap_or(&forms.form),
            "layer_forms": forms.layer_forms, "ber": ber,
            "channel": channel.name(), "seed": seed,
            "backend": backend.name(),
            "evict": eviction.map(|e| serde_json::json!({
                "keep": e.keep(), "window": e.window(), "pool": e.pool(),
                "sinks": e.sinks(),
            })),
            "ppl": m.ppl, "nll_mean": m.nll_mean, "tokens_scored": m.tokens_scored,
            "bits_per_value": m.stats.bits_per_value,
            "key_bits_per_value": m.stats.key_bits_per_value,
            "value_bits_per_value": m.stats.value_bits_per_value,
            "tokens_per_second": m.tokens_per_second, "metrics": m,
            "gemm_checks": checks, "abft_rule": rule.map(|r| r.name()),
            "gemm_flip_site": (gemm_flips > 0.0).then_some(gemm_flip_site.name()),
            "weight_flips": weight_flips, "weight_check_every": weight_check.0,
            "weight_group": weight_group, "weight_faults": weight_stats,
        });
        std::fs::write(&path, serde_json::to_string_pretty(&value)?)
            .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
        println!("wrote {}", path.display());
    }
    Ok(())
}

/// Prints what the stored weights' faults and checks did.
fn print_weight_faults(w: &kv_eval::weight_faults::WeightFaultStats, every: Option<u64>) {
    let schedule = every.map_or("never".to_string(), |n| format!("every {n} passes"));
    println!(
        "weights: {} bits flipped over {} passes ({} stored bytes; checks {schedule}: {}, \
         {:.3} s; guard {} bytes, {:.2}%)",
        w.flips,
        w.passes,
        w.weight_bytes,
        w.checks,
        w.check_seconds,
        w.guard_bytes,
        100.0 * w.guard_bytes as f64 / (w.weight_bytes.max(1)) as f64
    );
    println!(
        "  flipped bits: {} corrected, {} miscorrected, {} detected (rows left), {} silent, \
         {} cancelled, {} pending; rows repaired {} ({} by their CRC), left {}, parity rows \
         recomputed {}",
        w.corrected,
        w.miscorrected,
        w.detected,
        w.silent,
        w.cancelled,
        w.pending,
        w.rows_repaired,
        w.rows_repaired_by_crc,
        w.rows_unrepaired,
        w.parity_rebuilt
    );
}

/// Prints one run's metrics (perplexity, agreement, codec counts, low-rank
/// certificates).
pub(crate) fn print_metrics(form: &str, ber: f64, m: &RunMetrics) {
    println!(
        "form {form}, BER {ber}: PPL {:.4} (mean NLL {:.5}) over {} predictions; {:.1} tokens/s",
        m.ppl, m.nll_mean, m.tokens_scored, m.tokens_per_second
    );
    println!(
        "  KL from clean {:.5} nats; top-1 acc {:.2}%, top-5 acc {:.2}%; top-1 agreement {:.2}%, top-5 agreement {:.2}%",
        m.kl_mean,
        100.0 * m.top1_accuracy,
        100.0 * m.top5_accuracy,
        100.0 * m.top1_agreement,
        100.0 * m.top5_agreement
    );
    let s = &m.stats;
    let [
        flips,
        words,
        corrected,
        detected,
        miscorrected,
        silent,
        erased,
    ] = s.value_counts();
    println!(
        "  {flips} flips injected; {words} words: {corrected} corrected, {detected} detected, {miscorrected} miscorrected, {silent} silent; {erased} values erased; {:.3} bits/value",
        s.bits_per_value
    );
    let [m_corr, m_det, m_wrong, m_silent] = s.metadata;
    if m_corr + m_det + m_wrong + m_silent > 0 {
        println!(
            "  metadata words: {m_corr} corrected, {m_det} detected, {m_wrong} miscorrected, {m_silent} silent"
        );
    }
    let [t_words, t_corr, t_det, t_wrong, t_silent] = s.tables;
    if t_corr + t_det + t_wrong + t_silent > 0 {
        println!(
            "  fitted-table words (codebooks, bases; summed over calls): {t_words} read, {t_corr} corrected, {t_det} detected (read as 0), {t_wrong} miscorrected, {t_silent} silent"
        );
    }
    if !s.certificates.is_empty() {
        let n: u64 = s.certificates.iter().map(|c| c.count).sum();
        let mean = |f: fn(&kv_eval::metrics::LayerCertificate) -> f64| {
            s.certificates
                .iter()
                .map(|c| f(c) * c.count as f64)
                .sum::<f64>()
                / n.max(1) as f64
        };
        let max = |f: fn(&kv_eval::metrics::LayerCertificate) -> f64| {
            s.certificates.iter().map(f).fold(0.0, f64::max)
        };
        println!(
            "  certificates over {} low-rank layers: logit error ≤ {:.4} mean, {:.4} max; output error ≤ {:.4} mean, {:.4} max",
            s.certificates.len(),
            mean(|c| c.logit_mean),
            max(|c| c.logit_max),
            mean(|c| c.output_mean),
            max(|c| c.output_max)
        );
    }
}
