//! Calibrated forms (`vq` codebooks, `pca-*` bases): the `--calibration`
//! flags, and loading or fitting what the modes of a run need.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use kv_eval::cache::CacheMode;
use kv_eval::calibration::{Calibration, CalibrationRows, Part};
use kv_eval::paths;
use kv_model::model::CausalLm;
use kv_model::tokenizer::{ReadLimits, TextTokenizer};
use kv_quant::{CacheForm, FitOptions};

use crate::Error;

/// Where calibrated forms (`vq`) get their codebooks.
#[derive(clap::Args, Clone)]
pub(crate) struct Calib {
    /// Calibration file written by `kv-eval calibrate`.
    #[arg(long)]
    pub(crate) calibration: Option<PathBuf>,
    /// Fit the codebooks on this text (disjoint from --text) when a form
    /// needs them [default: the fetched Python 3.11 HOWTOs].
    #[arg(long)]
    pub(crate) calib_text: Option<PathBuf>,
    /// Calibration tokens used (from the start of the calibration text).
    #[arg(long, default_value_t = 8192)]
    pub(crate) calib_tokens: usize,
    /// Window length of the calibration passes.
    #[arg(long, default_value_t = 512)]
    pub(crate) calib_ctx: usize,
}

/// Refuses `--calibration` for a command that fits on the calibration
/// text itself (`calibrate`, `lowrank-report`): the file would be ignored.
pub(crate) fn refuse_calibration_file(calib: &Calib, command: &str) -> Result<(), Error> {
    match &calib.calibration {
        Some(path) => Err(format!(
            "{command} reads the calibration text (--calib-text), not a calibration file: \
             drop --calibration {}",
            path.display()
        )
        .into()),
        None => Ok(()),
    }
}

/// The calibration the modes need (loaded from --calibration or fitted on
/// --calib-text), or `None` when no form needs one.
pub(crate) fn calibration_for(
    modes: &[CacheMode],
    calib: &Calib,
    model: &dyn CausalLm,
    tokenizer: &TextTokenizer,
) -> Result<Option<Arc<Calibration>>, Error> {
    let forms: Vec<(CacheForm, Part)> = modes.iter().flat_map(CacheMode::forms).collect();
    if !forms.iter().any(|(f, _)| needs_calibration(f)) {
        return Ok(None);
    }
    if let Some(path) = &calib.calibration {
        let cal = Calibration::load(path)?;
        cal.check_model(model)?;
        eprintln!(
            "calibration {}: codebooks {:?} from {} tokens of {}",
            path.display(),
            cal.shapes(),
            cal.tokens,
            cal.text
        );
        return Ok(Some(Arc::new(cal)));
    }
    let cal = fit_calibration(&forms, calib, model, tokenizer)?;
    Ok(Some(Arc::new(cal)))
}

/// Whether a form needs data fitted on a calibration text.
pub(crate) fn needs_calibration(form: &CacheForm) -> bool {
    form.quantizer().needs_codebook() || form.quantizer().needs_bases()
}

/// Fits the codebooks and bases of `forms` on the calibration text.
pub(crate) fn fit_calibration(
    forms: &[(CacheForm, Part)],
    calib: &Calib,
    model: &dyn CausalLm,
    tokenizer: &TextTokenizer,
) -> Result<Calibration, Error> {
    let started = Instant::now();
    let (rows, name) = calibration_rows(calib, model, tokenizer)?;
    let cal = Calibration::fit(model, &rows, &name, forms, FitOptions::default())?;
    eprintln!(
        "fitted codebooks {:?} on {} tokens of {} in {:.1} s",
        cal.shapes(),
        rows.tokens,
        name,
        started.elapsed().as_secs_f64()
    );
    Ok(cal)
}

/// The K/V rows of the calibration text and its file name.
pub(crate) fn calibration_rows(
    calib: &Calib,
    model: &dyn CausalLm,
    tokenizer: &TextTokenizer,
) -> Result<(CalibrationRows, String), Error> {
    let path = calib
        .calib_text
        .clone()
        .unwrap_or_else(paths::default_calibration_text);
    let text = std::fs::File::open(&path).map_err(|e| {
        format!(
            "cannot read calibration text {}: {e} (run `cargo xtask fetch-model`, or pass --calib-text FILE or --calibration FILE)",
            path.display()
        )
    })?;
    let limits = ReadLimits {
        max_tokens: Some(calib.calib_tokens),
        ..ReadLimits::default()
    };
    let tokens = tokenizer
        .encode_reader(text, limits)
        .map_err(|e| format!("{}: {e}", path.display()))?;
    let rows = CalibrationRows::collect(model, &tokens, calib.calib_ctx)?;
    let name = path.file_name().map_or_else(
        || path.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    );
    Ok((rows, name))
}
