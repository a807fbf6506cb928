//! `kv-eval sweep`: forms × bit error rates × seeds, the paper's tables,
//! as Markdown, JSON and an SVG plot.

use std::path::PathBuf;
use std::time::Instant;

use kv_eval::cache::{CacheMode, ChannelKind, FaultSpec};
use kv_eval::metrics::RunConfig;
use kv_eval::sweep::{SweepPoint, SweepReport};

use crate::Error;
use crate::args::Target;
use crate::calib::{Calib, calibration_for};
use crate::checks::{check_ber, check_out_dir, check_segments, first_repeat};
use crate::progress::evaluate_with_bar;
use crate::source::{self, Prepared, Source, method, method_name, prepare};

/// Forms × bit error rates × seeds: the paper's Tables 5 and 7-10, as
/// Markdown, JSON and an SVG plot in --out.
#[derive(clap::Args)]
pub(crate) struct SweepArgs {
    #[command(flatten)]
    pub(crate) source: Source,
    /// Comma-separated cache forms, each FORM or KEY_FORM/VALUE_FORM.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "fp16,int4,int4+hamming74,int4+secded84,int4+secded84+interp,int4+golay24"
    )]
    pub(crate) forms: Vec<String>,
    #[command(flatten)]
    pub(crate) calib: Calib,
    /// Comma-separated bit error rates.
    #[arg(long, value_delimiter = ',', default_value = "0,1e-4,1e-3,1e-2")]
    pub(crate) bers: Vec<f64>,
    /// Comma-separated fault seeds (each BER > 0 runs every seed).
    #[arg(long, value_delimiter = ',', default_value = "0")]
    pub(crate) seeds: Vec<u64>,
    /// Fault channel: bsc, burst, mbu, stuck0, stuck1.
    #[arg(long, default_value = "bsc")]
    pub(crate) channel: String,
    /// Which stored bits are exposed.
    #[arg(long, value_enum, default_value_t = Target::Values)]
    pub(crate) target: Target,
    /// Output folder for sweep.md, sweep.json and sweep.svg.
    #[arg(long)]
    pub(crate) out: PathBuf,
}

/// Runs `kv-eval sweep`.
pub(crate) fn run(args: SweepArgs) -> Result<(), Error> {
    let SweepArgs {
        source,
        forms,
        calib,
        bers,
        seeds,
        channel,
        target,
        out,
    } = args;
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
    Ok(())
}
