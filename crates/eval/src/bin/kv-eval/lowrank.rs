//! `kv-eval lowrank-report`: spectra of the KV cache per layer and head.

use std::path::PathBuf;

use kv_eval::lowrank_report::LowRankReport;

use crate::Error;
use crate::calib::{Calib, calibration_rows, refuse_calibration_file};
use crate::checks::check_out_dir;
use crate::source::{load_model, model_path};

/// Spectra of the KV cache per layer and head (keys before and after
/// RoPE, values) over the calibration text: ranks at 90/99/99.9% of the
/// energy; lowrank.md, lowrank.json and lowrank.svg in --out.
#[derive(clap::Args)]
pub(crate) struct LowrankArgs {
    /// GGUF model file, Hugging Face folder or fetched model name
    /// (smollm2-135m, qwen2.5-0.5b, qwen2.5-1.5b) [default: smollm2-135m].
    #[arg(long)]
    pub(crate) model: Option<PathBuf>,
    #[command(flatten)]
    pub(crate) calib: Calib,
    /// Output folder.
    #[arg(long)]
    pub(crate) out: PathBuf,
}

/// Runs `kv-eval lowrank-report`.
pub(crate) fn run(args: LowrankArgs) -> Result<(), Error> {
    let LowrankArgs { model, calib, out } = args;
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
    Ok(())
}
