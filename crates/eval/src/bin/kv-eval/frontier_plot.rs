//! `kv-eval frontier-plot`: several `frontier` runs (their frontier.json)
//! as one figure at one context, a panel per model with its own Pareto
//! front and the goals drawn; frontier.md and frontier.svg in --out.

use std::path::PathBuf;

use kv_eval::frontier_merge::MergedFrontier;

use crate::{Error, check_out_dir};

/// The flags of `kv-eval frontier-plot`.
#[derive(clap::Args)]
pub(crate) struct FrontierPlotArgs {
    /// Comma-separated frontier.json files of `kv-eval frontier` runs.
    #[arg(long, value_delimiter = ',', required = true)]
    inputs: Vec<PathBuf>,
    /// The context length whose points are plotted.
    #[arg(long, default_value_t = 2048)]
    context: usize,
    /// Comma-separated goals drawn on every panel, each `BITS:PERCENT`
    /// (at most BITS bits per value for at most PERCENT ΔPPL).
    #[arg(long, value_delimiter = ',', default_value = "2.5:10,2:20")]
    goals: Vec<String>,
    /// Output folder.
    #[arg(long)]
    out: PathBuf,
}

/// `BITS:PERCENT`, both finite and positive.
fn goal(s: &str) -> Result<(f64, f64), Error> {
    let parsed = s.split_once(':').and_then(|(b, d)| {
        let (b, d) = (b.trim().parse::<f64>().ok()?, d.trim().parse::<f64>().ok()?);
        (b.is_finite() && d.is_finite() && b > 0.0 && d > 0.0).then_some((b, d))
    });
    parsed.ok_or_else(|| {
        format!("--goals {s:?} is not BITS:PERCENT with both finite and positive (e.g. 2.5:10)")
            .into()
    })
}

pub(crate) fn run(args: FrontierPlotArgs) -> Result<(), Error> {
    let goals = args
        .goals
        .iter()
        .map(|s| goal(s))
        .collect::<Result<Vec<_>, _>>()?;
    check_out_dir(&args.out)?;
    let merged = MergedFrontier::read(&args.inputs, args.context, goals)?;
    for path in merged.write(&args.out)? {
        eprintln!("wrote {}", path.display());
    }
    Ok(())
}
