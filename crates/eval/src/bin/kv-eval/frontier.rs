//! `kv-eval frontier`: bits per value, PPL, ΔPPL, KL and top-1 agreement
//! of many key/value/per-layer form configurations at several context
//! lengths, on one or more KV backends in one run (one clean pass per
//! window shared by all of them); frontier.md, frontier.json and
//! frontier.svg in --out.

use std::path::PathBuf;
use std::time::Instant;

use clap::ValueEnum;
use kv_eval::backend::BackendKind;
use kv_eval::cache::CacheMode;
use kv_eval::frontier::{FrontierPoint, FrontierReport, LOWRANK_PRESET, PRESET};
use kv_eval::metrics::RunConfig;

use crate::{
    Calib, Error, Prepared, Source, calibration_for, check_out_dir, check_segments,
    evaluate_with_bar, method, method_name, prepare,
};

#[derive(Clone, Copy, ValueEnum)]
enum Preset {
    Frontier,
    Lowrank,
}

/// The flags of `kv-eval frontier`.
#[derive(clap::Args)]
pub(crate) struct FrontierArgs {
    #[command(flatten)]
    source: Source,
    /// Comma-separated context lengths (overrides --ctx).
    #[arg(long, value_delimiter = ',', default_value = "256,2048")]
    contexts: Vec<usize>,
    /// `|`-separated configurations (FORM, KEY/VALUE or a layer policy)
    /// [default: the --preset].
    #[arg(long, value_delimiter = '|')]
    configs: Vec<String>,
    /// The configurations when --configs is not given: `frontier` (the
    /// quality-versus-bytes frontier of kv-quant's forms) or `lowrank`
    /// (the low-rank subspace paper's falsification table).
    #[arg(long, value_enum, default_value_t = Preset::Frontier)]
    preset: Preset,
    /// Comma-separated KV backends every configuration runs on:
    /// `reencode` (the paper's protocol) and `paged<B>` (the paged cache
    /// in blocks of B tokens, read as a server reads it: per-channel,
    /// sink and window forms run each window in steps of one block, so
    /// each block is sealed before the next one reads it). A
    /// configuration a backend cannot hold is skipped with a notice;
    /// points on a paged backend are labelled `CONFIG @paged<B>`.
    #[arg(long, value_delimiter = ',', default_value = "reencode")]
    backends: Vec<String>,
    #[command(flatten)]
    calib: Calib,
    #[command(flatten)]
    evict: crate::args::EvictArgs,
    /// Output folder.
    #[arg(long)]
    out: PathBuf,
}

/// `reencode` or `paged<B>`.
fn parse_backend(text: &str) -> Result<BackendKind, Error> {
    if text == "reencode" {
        return Ok(BackendKind::Reencode);
    }
    let size = text
        .strip_prefix("paged")
        .and_then(|b| b.parse::<usize>().ok())
        .filter(|&b| (1..=4096).contains(&b));
    match size {
        Some(block_size) => Ok(BackendKind::Paged { block_size }),
        None => Err(format!(
            "--backends: `{text}` is neither `reencode` nor `paged<B>` with B from 1 to 4096 \
             tokens per block"
        )
        .into()),
    }
}

/// The label of a point: the configuration, with its backend unless it is
/// the re-encode protocol, and the share its eviction keeps.
fn label(config: &str, backend: BackendKind, eviction: Option<attention::SnapKv>) -> String {
    let evict = eviction.map_or(String::new(), |e| {
        format!(" {}", kv_eval::metrics::eviction_label(&e))
    });
    match backend {
        BackendKind::Paged { block_size } => format!("{config} @paged{block_size}{evict}"),
        _ => format!("{config}{evict}"),
    }
}

/// Runs `kv-eval frontier`.
pub(crate) fn run(args: FrontierArgs) -> Result<(), Error> {
    let FrontierArgs {
        source,
        contexts,
        configs,
        preset,
        backends,
        calib,
        evict,
        out,
    } = args;
    let evictions = evict.policies()?;
    let backends = backends
        .iter()
        .map(|b| parse_backend(b.trim()))
        .collect::<Result<Vec<_>, _>>()?;
    if backends.is_empty() {
        return Err("--backends needs at least one backend".into());
    }
    if evictions.iter().any(Option::is_some) && backends.iter().all(|b| *b == BackendKind::Reencode)
    {
        return Err("--evict runs on paged backends: add --backends paged<B>".into());
    }
    check_out_dir(&out)?;
    let configs: Vec<String> = if configs.is_empty() {
        let preset = match preset {
            Preset::Frontier => PRESET,
            Preset::Lowrank => LOWRANK_PRESET,
        };
        preset.iter().map(|c| c.to_string()).collect()
    } else {
        configs
    };
    if contexts.is_empty() || contexts.iter().any(|&c| c < 2) {
        return Err("--contexts needs context lengths of at least 2".into());
    }
    let mut modes = Vec::new();
    for c in &configs {
        let mode = CacheMode::parse(c)?;
        for &ctx in &contexts {
            check_segments(&mode, ctx)?;
        }
        modes.push(mode);
    }
    let Prepared {
        model,
        tokenizer,
        tokens,
        model_file,
        text_file,
    } = prepare(&source, &modes)?;
    let cal = calibration_for(&modes, &calib, model.as_ref(), &tokenizer)?;
    let calibration = cal
        .as_ref()
        .map_or("(no calibrated form)".to_string(), |c| {
            format!("{} tokens of {}", c.tokens, c.text)
        });
    let modes: Vec<CacheMode> = modes
        .into_iter()
        .map(|m| m.with_calibration(cal.clone()))
        .collect();
    let started = Instant::now();
    let mut report = FrontierReport {
        model: model_file,
        text: text_file,
        method: method_name(&source),
        tokens: tokens.len(),
        calibration,
        plain: Vec::new(),
        points: Vec::new(),
    };
    for &ctx in &contexts {
        let mut runs = vec![RunConfig::new(CacheMode::Plain, None)];
        let mut labels = Vec::new();
        for (config, mode) in configs.iter().zip(&modes) {
            for (&backend, &eviction) in backends
                .iter()
                .flat_map(|b| evictions.iter().map(move |e| (b, e)))
            {
                let name = label(config, backend, eviction);
                let refused = backend.check(mode, None).and_then(|()| match eviction {
                    Some(_) => kv_eval::backend::check_eviction(mode, backend),
                    None => Ok(()),
                });
                if let Err(e) = refused {
                    eprintln!("{name}: skipped ({e})");
                    continue;
                }
                runs.push(RunConfig {
                    backend,
                    eviction,
                    ..RunConfig::new(mode.clone(), None)
                });
                labels.push(name);
            }
        }
        let mut metrics = evaluate_with_bar(
            &format!("frontier at {ctx}"),
            model.as_ref(),
            &tokens,
            ctx,
            method(&source),
            &runs,
        )?;
        let plain = metrics.remove(0);
        for (config, m) in labels.iter().zip(metrics) {
            report
                .points
                .push(FrontierPoint::new(config, ctx, m, &plain));
        }
        report.plain.push((ctx, plain));
        // Rewritten after every context, so a long run leaves
        // what it has measured if it is stopped.
        report.write(&out)?;
        eprintln!(
            "context {ctx} done after {:.0} s (report in {})",
            started.elapsed().as_secs_f64(),
            out.display()
        );
    }
    println!("{}", report.markdown());
    for f in report.write(&out)? {
        println!("wrote {}", f.display());
    }
    Ok(())
}
