//! `kv-eval`: perplexity of one cache configuration (`ppl`), the BER sweep
//! (`sweep`), the quality-versus-bytes frontier (`frontier`), fitting the
//! codebooks of calibrated forms (`calibrate`), and the next-token top-k of
//! a prompt (`top`).

mod abft;
mod accumulate;
mod adapt;
mod batch;
mod calib;
mod frontier;
mod generate;
mod niah;
mod source;
mod stream;

use abft::{AbftRule, FlipSite, abft_rule};
use calib::{
    Calib, calibration_for, calibration_rows, fit_calibration, needs_calibration,
    refuse_calibration_file,
};
use source::{Prepared, Source, load_model, method, method_name, model_path, prepare};

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use clap::{Parser, Subcommand, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use kv_eval::backend::BackendKind;
use kv_eval::cache::{CacheMode, ChannelKind, FaultSpec, KvCache};
use kv_eval::calibration::Part;
use kv_eval::lowrank_report::LowRankReport;
use kv_eval::metrics::{RunConfig, RunMetrics, evaluate};
use kv_eval::sweep::{SweepPoint, SweepReport};
use kv_quant::{CacheForm, FaultTarget, LayerForms};

/// Real-model fault-injection evaluation of KV-cache forms.
#[derive(Parser)]
#[command(version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// Memory budget for everything sized from the flags (paged pools):
    /// bytes, or with K, M, G or T (24G) [default: 80% of the memory
    /// available at start].
    #[arg(long, global = true)]
    memory_limit: Option<String>,
}

/// Which form each layer's keys and values are stored in.
#[derive(clap::Args, Clone)]
struct Forms {
    /// Cache form of keys and values (kv-quant spelling: fp32, fp16, int8,
    /// int4, int4-ch, int4+rot, lm4, vq, int4+secded84+interp,
    /// int4-ch32+win32, ...) or `plain` for the unstored f32 pass.
    #[arg(long, default_value = "plain")]
    form: String,
    /// Form of the keys (default: --form).
    #[arg(long)]
    key_form: Option<String>,
    /// Form of the values (default: --form).
    #[arg(long)]
    value_form: Option<String>,
    /// Per-layer forms, `LAYERS:FORM[/VALUE_FORM];...` (`0,last:fp16;*:int4`);
    /// layers without a rule take --key-form/--value-form.
    #[arg(long)]
    layer_forms: Option<String>,
}

/// The KV backend a run uses.
#[derive(clap::Args, Clone, Copy)]
struct BackendArgs {
    /// KV backend: `auto` (paged where it holds the forms and no per-call
    /// faults are asked for, reencode otherwise), `reencode` (the paper's
    /// protocol: each forward call quantises, encodes and faults the whole
    /// window), `paged` (each token encoded once, when written, into a paged
    /// block) or `dense` (f32 rows, `plain` only).
    #[arg(long, value_enum, default_value_t = Backend::Auto)]
    backend: Backend,
    /// Tokens per block of the paged backend.
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// How attention scores integer-coded keys: `exact` (f32, the
    /// evaluation's reference: every published table uses it), `auto`
    /// (the attention crate's default: `int8` for 4-bit affine levels in
    /// whole-row per-token groups and in per-channel blocks of 16 to 128
    /// tokens, exact for every other),
    /// `int8` (int8-quantized queries, integer dot products) or `int16`
    /// (16-bit query codes as two int8 halves) [default: exact].
    #[arg(long, value_enum)]
    numerics: Option<NumericsArg>,
}

#[derive(Clone, Copy, ValueEnum)]
pub(crate) enum NumericsArg {
    Exact,
    Auto,
    Int8,
    Int16,
}

impl NumericsArg {
    pub(crate) fn numerics(self) -> attention::Numerics {
        match self {
            Self::Exact => attention::Numerics::Exact,
            Self::Auto => attention::Numerics::Auto,
            Self::Int8 => attention::Numerics::Int8Query,
            Self::Int16 => attention::Numerics::Int16Query,
        }
    }
}

#[derive(Clone, Copy, ValueEnum)]
enum Backend {
    Auto,
    Dense,
    Reencode,
    Paged,
}

impl BackendArgs {
    /// The backend for `mode` and `faults` (which `auto` chooses by).
    fn kind(self, mode: &CacheMode, faults: Option<FaultSpec>) -> BackendKind {
        let paged = BackendKind::Paged {
            block_size: self.block_size,
        };
        match self.backend {
            Backend::Auto => BackendKind::auto(mode, faults, self.block_size),
            Backend::Dense => BackendKind::Dense,
            Backend::Reencode => BackendKind::Reencode,
            Backend::Paged => paged,
        }
    }
}

#[derive(Clone, Copy, ValueEnum)]
enum Target {
    Values,
    Metadata,
    Everything,
}

impl From<Target> for FaultTarget {
    fn from(t: Target) -> Self {
        match t {
            Target::Values => FaultTarget::Values,
            Target::Metadata => FaultTarget::Metadata,
            Target::Everything => FaultTarget::Everything,
        }
    }
}

#[derive(Subcommand)]
enum Command {
    /// Perplexity, KL from the clean run, top-k and codec statistics of one configuration.
    Ppl {
        #[command(flatten)]
        source: Source,
        #[command(flatten)]
        forms: Forms,
        #[command(flatten)]
        calib: Calib,
        #[command(flatten)]
        backend: BackendArgs,
        /// Bit error rate of the fault channel.
        #[arg(long, default_value_t = 0.0)]
        ber: f64,
        /// Fault channel: bsc (independent flips), burst, mbu, stuck0, stuck1.
        #[arg(long, default_value = "bsc")]
        channel: String,
        /// Which stored bits are exposed.
        #[arg(long, value_enum, default_value_t = Target::Values)]
        target: Target,
        /// Fault seed.
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Check every matrix product of the forward pass with row checksums
        /// (abft-gemm) under this rule [`--abft` alone: v-abft] and report
        /// how many rows fired.
        #[arg(long, value_enum, num_args = 0..=1, default_missing_value = "v-abft")]
        abft: Option<AbftRule>,
        /// V-ABFT's e_max [default: the design's FP32 value].
        #[arg(long)]
        abft_emax: Option<f64>,
        /// The fixed rule's relative tolerance τ (bound τ·Σ|row|) [default: 1e-3].
        #[arg(long)]
        abft_tau: Option<f64>,
        /// With --abft: flip one random bit of each element of the
        /// --gemm-flip-site (output, running sum or weight) with this
        /// probability (seeded by --seed), and report the detection rate per
        /// bit position.
        #[arg(long, default_value_t = 0.0)]
        gemm_flips: f64,
        /// Where --gemm-flips land: product elements, running sums, or
        /// weights [default: output].
        #[arg(long, value_enum)]
        gemm_flip_site: Option<FlipSite>,
        /// With --abft: correct flagged rows (one corrupted element each,
        /// located by column checksums and rewritten).
        #[arg(long)]
        abft_correct: bool,
        /// Also write the result as JSON to this file.
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// Forms × bit error rates × seeds: the paper's Tables 5 and 7-10, as
    /// Markdown, JSON and an SVG plot in --out.
    Sweep {
        #[command(flatten)]
        source: Source,
        /// Comma-separated cache forms, each FORM or KEY_FORM/VALUE_FORM.
        #[arg(
            long,
            value_delimiter = ',',
            default_value = "fp16,int4,int4+hamming74,int4+secded84,int4+secded84+interp,int4+golay24"
        )]
        forms: Vec<String>,
        #[command(flatten)]
        calib: Calib,
        /// Comma-separated bit error rates.
        #[arg(long, value_delimiter = ',', default_value = "0,1e-4,1e-3,1e-2")]
        bers: Vec<f64>,
        /// Comma-separated fault seeds (each BER > 0 runs every seed).
        #[arg(long, value_delimiter = ',', default_value = "0")]
        seeds: Vec<u64>,
        /// Fault channel: bsc, burst, mbu, stuck0, stuck1.
        #[arg(long, default_value = "bsc")]
        channel: String,
        /// Which stored bits are exposed.
        #[arg(long, value_enum, default_value_t = Target::Values)]
        target: Target,
        /// Output folder for sweep.md, sweep.json and sweep.svg.
        #[arg(long)]
        out: PathBuf,
    },
    /// The quality-versus-bytes frontier: bits per value, PPL, ΔPPL, KL and
    /// top-1 agreement of many key/value/per-layer form configurations at
    /// several context lengths; frontier.md, frontier.json and frontier.svg in --out.
    Frontier(frontier::FrontierArgs),
    /// Spectra of the KV cache per layer and head (keys before and after
    /// RoPE, values) over the calibration text: ranks at 90/99/99.9% of the
    /// energy; lowrank.md, lowrank.json and lowrank.svg in --out.
    LowrankReport {
        /// GGUF model file, Hugging Face folder or fetched model name
        /// (smollm2-135m, qwen2.5-0.5b, qwen2.5-1.5b) [default: smollm2-135m].
        #[arg(long)]
        model: Option<PathBuf>,
        #[command(flatten)]
        calib: Calib,
        /// Output folder.
        #[arg(long)]
        out: PathBuf,
    },
    /// Fits the codebooks (vq) and PCA bases (pca-*) of calibrated forms
    /// on a calibration text and writes them to a file for --calibration.
    Calibrate {
        /// GGUF model file, Hugging Face folder or fetched model name
        /// (smollm2-135m, qwen2.5-0.5b, qwen2.5-1.5b) [default: smollm2-135m].
        #[arg(long)]
        model: Option<PathBuf>,
        /// Comma-separated forms to fit codebooks (vq) and bases (pca-*) for.
        #[arg(long, value_delimiter = ',', default_value = "vq")]
        forms: Vec<String>,
        #[command(flatten)]
        calib: Calib,
        /// Output file (safetensors).
        #[arg(long)]
        out: PathBuf,
    },
    /// Generates text after a prompt on a KV backend (paged by default),
    /// greedy or sampled; streams the continuation to stdout, then prints
    /// tokens/s, the cache's true bytes and the codec statistics to stderr.
    /// On the paged backend faults can accumulate over the decode steps
    /// (--ber-per-step), with a scrubber (--scrub-every).
    Generate(generate::GenerateArgs),
    /// Continuous batching of the model on the paged cache (paged-cache's
    /// scheduler, prefix cache, preemption by recompute or swap) for a
    /// requests file or the seeded workload; outputs and report in --out.
    Batch(batch::BatchArgs),
    /// Needle in a haystack: a passkey hidden at several depths of
    /// haystacks of several lengths, found or not by greedy generation, for
    /// each cache form; niah.md, niah.json and niah.svg (heat maps) in --out.
    Niah(niah::NiahArgs),
    /// Faults accumulating in the paged cache while the model generates,
    /// with and without scrubbing: top-1 agreement and KL per step against
    /// the same form without faults; accumulate.md and .json in --out.
    Accumulate(accumulate::AccumulateArgs),
    /// Adaptive protection on a non-uniform fault map (hot layers, blocks
    /// or rows): each layer's or block's code (Hamming, SECDED, Golay)
    /// chosen from what reading it under SECDED showed, scored against
    /// uniform codes under the same faults.
    Adapt(adapt::AdaptArgs),
    /// The drift of a `shard` cache's decode stream: greedy generations
    /// with the stream off, 4-bit and 8-bit, matched against an fp16 cache.
    ShardStream(stream::StreamArgs),
    /// The top-k next tokens of a prompt with their logits and probabilities.
    Top {
        /// GGUF model file, Hugging Face folder or fetched model name
        /// (smollm2-135m, qwen2.5-0.5b, qwen2.5-1.5b) [default: smollm2-135m].
        #[arg(long)]
        model: Option<PathBuf>,
        /// The prompt.
        #[arg(long, default_value = "The capital of France is")]
        prompt: String,
        /// How many tokens to list.
        #[arg(short, default_value_t = 8)]
        k: usize,
    },
}

type Error = Box<dyn std::error::Error>;

/// The command line, every subcommand taking negative numbers as values:
/// `--ber -1` reaches the flag's own check (which names it and its range)
/// instead of clap's "unexpected argument '-1'".
fn parse_cli() -> Cli {
    use clap::{CommandFactory, FromArgMatches};
    let mut command = Cli::command().allow_negative_numbers(true);
    let names: Vec<String> = command
        .get_subcommands()
        .map(|c| c.get_name().to_string())
        .collect();
    for name in names {
        command = command.mut_subcommand(name, |c| c.allow_negative_numbers(true));
    }
    Cli::from_arg_matches(&command.get_matches()).unwrap_or_else(|e| e.exit())
}

fn main() -> ExitCode {
    let cli = parse_cli();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The cache mode the form flags name (no model needed).
fn mode_of(forms: &Forms) -> Result<CacheMode, Error> {
    let base = CacheMode::parse(&forms.form)?;
    if forms.key_form.is_none() && forms.value_form.is_none() && forms.layer_forms.is_none() {
        return Ok(base);
    }
    let part = |flag: &str, text: &Option<String>| -> Result<Option<CacheForm>, Error> {
        match text.as_deref().unwrap_or(&forms.form) {
            "plain" if text.is_some() || forms.layer_forms.is_none() => Err(format!(
                "{flag} plain: one part cannot stay unstored while the other is stored; use fp32"
            )
            .into()),
            "plain" => Ok(None),
            f => Ok(Some(f.parse()?)),
        }
    };
    let (key, value) = (
        part("--key-form", &forms.key_form)?,
        part("--value-form", &forms.value_form)?,
    );
    let Some(layers) = &forms.layer_forms else {
        let (Some(k), Some(v)) = (key, value) else {
            return Err("give --key-form and --value-form (or --form) a stored form".into());
        };
        return Ok(CacheMode::key_value(k, v));
    };
    let mut spec = layers.clone();
    if let (Some(k), Some(v)) = (key, value)
        && !spec.split(';').any(|r| r.trim_start().starts_with('*'))
    {
        spec.push_str(&format!(";*:{k}/{v}"));
    }
    Ok(CacheMode::layered(spec.parse::<LayerForms>()?, None))
}

/// Refuses exact windows and sinks that leave nothing of a context to quantize.
fn check_segments(mode: &CacheMode, ctx: usize) -> Result<(), Error> {
    Ok(mode.check_context(ctx)?)
}

/// The first entry that appears twice in `items`.
fn first_repeat<T: PartialEq>(items: &[T]) -> Option<&T> {
    items
        .iter()
        .enumerate()
        .find(|(i, x)| items[..*i].contains(x))
        .map(|(_, x)| x)
}

/// Makes the output folder and checks that a file can be written in it,
/// before any work starts (a run of an hour should not end in "cannot
/// write").
fn check_out_dir(out: &Path) -> Result<(), Error> {
    if out.exists() && !out.is_dir() {
        return Err(format!("--out {} exists and is not a folder", out.display()).into());
    }
    std::fs::create_dir_all(out)
        .map_err(|e| format!("--out {}: cannot create the folder: {e}", out.display()))?;
    probe_writable(out, "--out")
}

/// Checks that the output file `path` (`--json`) can be written, before
/// any work starts: not a folder, in a folder that exists (made if need
/// be) and takes new files. The file itself is left as it was.
fn check_out_file(path: &Path, flag: &str) -> Result<(), Error> {
    if path.is_dir() {
        return Err(format!("{flag} {} is a folder; name a file", path.display()).into());
    }
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    std::fs::create_dir_all(parent).map_err(|e| {
        format!(
            "{flag} {}: cannot create {}: {e}",
            path.display(),
            parent.display()
        )
    })?;
    probe_writable(parent, flag)
}

/// Creates and removes a probe file in `dir`.
fn probe_writable(dir: &Path, flag: &str) -> Result<(), Error> {
    let probe = dir.join(format!(".kv-eval-probe-{}", std::process::id()));
    std::fs::write(&probe, b"")
        .and_then(|()| std::fs::remove_file(&probe))
        .map_err(|e| format!("{flag}: cannot write in {}: {e}", dir.display()).into())
}

/// Refuses a bit error rate outside [0, 1], naming `flag`.
fn check_ber(flag: &str, ber: f64) -> Result<(), Error> {
    if !(0.0..=1.0).contains(&ber) {
        return Err(format!("{flag} {ber}: a bit error rate is not in [0, 1]").into());
    }
    Ok(())
}

/// [`evaluate`] with a progress bar labelled `what`, cleared at the end.
fn evaluate_with_bar(
    what: &str,
    model: &dyn kv_model::model::CausalLm,
    tokens: &[u32],
    ctx: usize,
    method: kv_eval::metrics::PplMethod,
    runs: &[RunConfig],
) -> Result<Vec<RunMetrics>, Error> {
    let bar = progress_bar(what);
    let metrics = evaluate(model, tokens, ctx, method, runs, |d, n| {
        bar.set_length(n as u64);
        bar.set_position(d as u64);
    })?;
    bar.finish_and_clear();
    Ok(metrics)
}

fn progress_bar(what: &str) -> ProgressBar {
    let bar = ProgressBar::new(0);
    bar.set_style(
        ProgressStyle::with_template(
            "{msg} [{elapsed_precise}] {wide_bar} {pos}/{len} windows, ETA {eta}",
        )
        .expect("static template")
        .progress_chars("=> "),
    );
    bar.set_message(what.to_string());
    bar
}

fn run(cli: Cli) -> Result<(), Error> {
    if let Some(limit) = &cli.memory_limit {
        kv_eval::budget::set_limit(kv_eval::budget::parse_size(limit)?);
    }
    match cli.command {
        Command::Ppl {
            source,
            forms,
            calib,
            backend,
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
            json,
        } => {
            if let Some(path) = &json {
                check_out_file(path, "--json")?;
            }
            check_ber("--ber", ber)?;
            if !(0.0..=1.0).contains(&gemm_flips) {
                return Err(format!("--gemm-flips {gemm_flips} is not in [0, 1]").into());
            }
            if (gemm_flips > 0.0 || abft_correct) && abft.is_none() {
                return Err(
                    "--gemm-flips and --abft-correct need --abft (they act on checked products)"
                        .into(),
                );
            }
            if gemm_flip_site.is_some() && gemm_flips == 0.0 {
                return Err("--gemm-flip-site goes with --gemm-flips".into());
            }
            let gemm_flip_site = gemm_flip_site.unwrap_or(FlipSite::Output);
            let rule = abft_rule(abft, abft_emax, abft_tau)?;
            let mode = mode_of(&forms)?;
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
            let numerics = backend.numerics;
            let backend = match backend.backend {
                Backend::Auto if gemm_flips > 0.0 => kv_eval::backend::BackendKind::Reencode,
                _ => backend.kind(&mode, Some(faults)),
            };
            backend.check(&mode, Some(faults))?;
            if ber > 0.0 && mode == CacheMode::Plain {
                return Err(
                    "faults need a stored form: pass --form (fp32, int4+secded84, ...)".into(),
                );
            }
            let Prepared {
                mut model,
                tokenizer,
                tokens,
                model_file,
                text_file,
            } = prepare(&source, std::slice::from_ref(&mode))?;
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
            let mode = mode.with_calibration(cal);
            let label = mode.label();
            let run = RunConfig {
                mode,
                faults: Some(faults),
                backend,
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
            if let Some(path) = json {
                let value = serde_json::json!({
                    "model": model_file, "text": text_file, "ctx": source.ctx,
                    "method": method_name(&source), "form": label,
                    "key_form": forms.key_form.as_deref().unwrap_or(&forms.form),
                    "value_form": forms.value_form.as_deref().unwrap_or(&forms.form),
                    "layer_forms": forms.layer_forms, "ber": ber,
                    "channel": channel.name(), "seed": seed,
                    "backend": backend.name(),
                    "ppl": m.ppl, "nll_mean": m.nll_mean, "tokens_scored": m.tokens_scored,
                    "bits_per_value": m.stats.bits_per_value,
                    "key_bits_per_value": m.stats.key_bits_per_value,
                    "value_bits_per_value": m.stats.value_bits_per_value,
                    "tokens_per_second": m.tokens_per_second, "metrics": m,
                    "gemm_checks": checks, "abft_rule": rule.map(|r| r.name()),
                    "gemm_flip_site": (gemm_flips > 0.0).then_some(gemm_flip_site.name()),
                });
                std::fs::write(&path, serde_json::to_string_pretty(&value)?)
                    .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
                println!("wrote {}", path.display());
            }
        }
        Command::Sweep {
            source,
            forms,
            calib,
            bers,
            seeds,
            channel,
            target,
            out,
        } => {
            for &b in &bers {
                check_ber("--bers", b)?;
            }
            if seeds.is_empty() || forms.is_empty() || bers.is_empty() {
                return Err("--forms, --bers and --seeds each need at least one entry".into());
            }
            if let Some(d) = first_repeat(&seeds) {
                return Err(format!("--seeds names {d} twice (each seed is one sample)").into());
            }
            if let Some(b) = first_repeat(&bers) {
                return Err(format!("--bers names {b} twice").into());
            }
            if let Some(f) = first_repeat(&forms) {
                return Err(format!("--forms names {f} twice").into());
            }
            let channel: ChannelKind = channel.parse()?;
            // The flags themselves before what the forms make of them.
            source::check_source(&source)?;
            let mut modes = Vec::new();
            for f in &forms {
                let mode = CacheMode::parse(f)?;
                check_segments(&mode, source.ctx)?;
                modes.push(mode);
            }
            check_out_dir(&out)?;
            let Prepared {
                model,
                tokenizer,
                tokens,
                model_file,
                text_file,
            } = prepare(&source, &modes)?;
            let cal = calibration_for(&modes, &calib, model.as_ref(), &tokenizer)?;
            let modes: Vec<CacheMode> = modes
                .into_iter()
                .map(|m| m.with_calibration(cal.clone()))
                .collect();
            // The oracle first, then every (form, BER, seed); BER 0 needs one seed.
            let mut runs = vec![RunConfig::new(CacheMode::Plain, None)];
            let mut keys = Vec::new();
            for (form, mode) in forms.iter().zip(&modes) {
                for &ber in &bers {
                    let used: &[u64] = if ber == 0.0 { &seeds[..1] } else { &seeds };
                    for &seed in used {
                        runs.push(RunConfig::new(
                            mode.clone(),
                            Some(FaultSpec {
                                channel,
                                ber,
                                seed,
                                target: target.into(),
                                hot: None,
                            }),
                        ));
                        keys.push((form.clone(), ber, seed));
                    }
                }
            }
            eprintln!("{} configurations over {} tokens", runs.len(), tokens.len());
            let started = Instant::now();
            let mut metrics = evaluate_with_bar(
                "sweep",
                model.as_ref(),
                &tokens,
                source.ctx,
                method(&source),
                &runs,
            )?;
            let oracle = metrics.remove(0);
            let report = SweepReport {
                model: model_file,
                text: text_file,
                ctx: source.ctx,
                method: method_name(&source),
                channel: channel.name().into(),
                forms,
                bers,
                seeds,
                oracle,
                points: keys
                    .into_iter()
                    .zip(metrics)
                    .map(|((form, ber, seed), metrics)| SweepPoint {
                        form,
                        ber,
                        seed,
                        metrics,
                    })
                    .collect(),
            };
            println!("{}", report.markdown());
            let files = report.write(&out)?;
            println!(
                "sweep of {} configurations took {:.0} s; wrote:",
                runs.len(),
                started.elapsed().as_secs_f64()
            );
            for f in files {
                println!("  {}", f.display());
            }
        }
        Command::Frontier(args) => frontier::run(args)?,
        Command::LowrankReport { model, calib, out } => {
            refuse_calibration_file(&calib, "lowrank-report")?;
            check_out_dir(&out)?;
            let (model, tokenizer) = load_model(&model_path(&model)?)?;
            let (rows, name) = calibration_rows(&calib, model.as_ref(), &tokenizer)?;
            let report = LowRankReport::compute(model.as_ref(), &rows, &name)?;
            println!(
                "{}",
                report
                    .markdown()
                    .lines()
                    .take(model.layers() + 6)
                    .collect::<Vec<_>>()
                    .join("\n")
            );
            for f in report.write(&out)? {
                println!("wrote {}", f.display());
            }
        }
        Command::Calibrate {
            model,
            forms,
            calib,
            out,
        } => {
            let forms: Vec<(CacheForm, Part)> = forms
                .iter()
                .map(|f| f.parse::<CacheForm>())
                .collect::<Result<Vec<_>, _>>()?
                .into_iter()
                .flat_map(|f| [(f, Part::Key), (f, Part::Value)])
                .collect();
            if !forms.iter().any(|(f, _)| needs_calibration(f)) {
                return Err("no form needs calibration (calibrate vq and pca-* forms)".into());
            }
            refuse_calibration_file(&calib, "calibrate")?;
            check_out_file(&out, "--out")?;
            let (model, tokenizer) = load_model(&model_path(&model)?)?;
            let cal = fit_calibration(&forms, &calib, model.as_ref(), &tokenizer)?;
            cal.save(&out)?;
            println!("wrote {} ({:?})", out.display(), cal.shapes());
        }
        Command::Generate(args) => generate::run(args)?,
        Command::Batch(args) => batch::run(args)?,
        Command::Niah(args) => niah::run(args)?,
        Command::Accumulate(args) => accumulate::run_accumulate(args)?,
        Command::Adapt(args) => adapt::run_adapt(args)?,
        Command::ShardStream(args) => stream::run_stream(args)?,
        Command::Top { model, prompt, k } => {
            if prompt.is_empty() {
                return Err("the prompt is empty".into());
            }
            if k == 0 {
                return Err("-k 0 asks for no tokens".into());
            }
            let (model, tokenizer) = load_model(&model_path(&model)?)?;
            let ids = tokenizer.encode(&prompt)?;
            if ids.is_empty() {
                return Err(format!("{prompt:?} has no tokens").into());
            }
            if let Some(trained) = model.context()
                && ids.len() > trained
            {
                return Err(format!(
                    "the prompt is {} tokens, past the {trained} tokens the model was trained \
                     to: shorten it",
                    ids.len()
                )
                .into());
            }
            if ids.len() > 64 {
                println!("{} tokens: {:?} ...", ids.len(), &ids[..64]);
            } else {
                println!("{prompt:?} -> {ids:?}");
            }
            let mut cache = KvCache::new(CacheMode::Plain, None, 0)?;
            let logits = model.forward(&ids, &mut cache, ids.len() - 1)?;
            let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let z: f64 = logits.iter().map(|&x| f64::from(x - max).exp()).sum();
            let mut order: Vec<usize> = (0..logits.len()).collect();
            order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
            for &i in order.iter().take(k) {
                println!(
                    "{i:6} {:12?} logit {:8.3} p {:.4}",
                    tokenizer.decode(&[i as u32])?,
                    logits[i],
                    f64::from(logits[i] - max).exp() / z
                );
            }
        }
    }
    Ok(())
}

fn print_metrics(form: &str, ber: f64, m: &RunMetrics) {
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
