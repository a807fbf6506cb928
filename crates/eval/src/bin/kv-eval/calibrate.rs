//! `kv-eval calibrate`: fits the codebooks, bases and Shard tables of
//! calibrated forms.

use std::path::PathBuf;

use kv_eval::calibration::Part;
use kv_quant::CacheForm;

use crate::Error;
use crate::calib::{Calib, fit_calibration, needs_calibration, refuse_calibration_file};
use crate::checks::check_out_file;
use crate::source::{load_model, model_path};

/// Fits the codebooks (vq), PCA bases (pca-*) and Shard tables
/// (shard-*-cal) of calibrated forms on a calibration text and writes them
/// to a file for --calibration.
#[derive(clap::Args)]
pub(crate) struct CalibrateArgs {
    /// GGUF model file, Hugging Face folder or fetched model name
    /// (smollm2-135m, qwen2.5-0.5b, qwen2.5-1.5b) [default: smollm2-135m].
    #[arg(long)]
    pub(crate) model: Option<PathBuf>,
    /// Comma-separated forms to fit codebooks (vq, cq), bases (pca-*) and
    /// Shard tables (shard-*-cal) for.
    #[arg(long, value_delimiter = ',', default_value = "vq")]
    pub(crate) forms: Vec<String>,
    #[command(flatten)]
    pub(crate) calib: Calib,
    /// Output file (safetensors).
    #[arg(long)]
    pub(crate) out: PathBuf,
}

/// Runs `kv-eval calibrate`.
pub(crate) fn run(args: CalibrateArgs) -> Result<(), Error> {
    let CalibrateArgs {
        model,
        forms,
        calib,
        out,
    } = args;
    let forms: Vec<(CacheForm, Part)> = forms
        .iter()
        .map(|f| f.parse::<CacheForm>())
        .collect::<Result<Vec<_>, _>>()?
        .into_iter()
        .flat_map(|f| {
            // Pair codebooks of keys before RoPE are fitted for keys alone
            // (a `pca-*-pre` form fits value bases too, without `-pre`).
            let pairs = matches!(f.quantizer(), kv_quant::Quantizer::Vq(s) if s.pre_rope);
            let parts: &[Part] = if pairs {
                &[Part::Key]
            } else {
                &[Part::Key, Part::Value]
            };
            parts.iter().map(move |&p| (f, p))
        })
        .collect();
    if !forms.iter().any(|(f, _)| needs_calibration(f)) {
        return Err(
            "no form needs calibration (calibrate vq, cq, pca-* and shard-*-cal forms)".into(),
        );
    }
    refuse_calibration_file(&calib, "calibrate")?;
    check_out_file(&out, "--out")?;
    let (model, tokenizer) = load_model(&model_path(&model)?)?;
    let cal = fit_calibration(&forms, &calib, model.as_ref(), &tokenizer)?;
    cal.save(&out)?;
    println!("wrote {} ({:?})", out.display(), cal.shapes());
    Ok(())
}
