//! Progress bars over perplexity windows.

use indicatif::{ProgressBar, ProgressStyle};
use kv_eval::metrics::{RunConfig, RunMetrics, evaluate};

use crate::Error;

/// [`evaluate`] with a progress bar labelled `what`, cleared at the end.
pub(crate) fn evaluate_with_bar(
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

pub(crate) fn progress_bar(what: &str) -> ProgressBar {
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
