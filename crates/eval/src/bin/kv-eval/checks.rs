//! Checks of flags made before any work: output paths that can be
//! written, bit error rates in range, lists without repeats, segments that
//! fit the context.

use std::path::Path;

use kv_eval::cache::CacheMode;

use crate::Error;

/// Refuses exact windows and sinks that leave nothing of a context to quantize.
pub(crate) fn check_segments(mode: &CacheMode, ctx: usize) -> Result<(), Error> {
    Ok(mode.check_context(ctx)?)
}

/// The first entry that appears twice in `items`.
pub(crate) fn first_repeat<T: PartialEq>(items: &[T]) -> Option<&T> {
    items
        .iter()
        .enumerate()
        .find(|(i, x)| items[..*i].contains(x))
        .map(|(_, x)| x)
}

/// Makes the output folder and checks that a file can be written in it,
/// before any work starts (a run of an hour should not end in "cannot
/// write").
pub(crate) fn check_out_dir(out: &Path) -> Result<(), Error> {
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
pub(crate) fn check_out_file(path: &Path, flag: &str) -> Result<(), Error> {
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
pub(crate) fn probe_writable(dir: &Path, flag: &str) -> Result<(), Error> {
    let probe = dir.join(format!(".kv-eval-probe-{}", std::process::id()));
    std::fs::write(&probe, b"")
        .and_then(|()| std::fs::remove_file(&probe))
        .map_err(|e| format!("{flag}: cannot write in {}: {e}", dir.display()).into())
}

/// Refuses a bit error rate outside [0, 1], naming `flag`.
pub(crate) fn check_ber(flag: &str, ber: f64) -> Result<(), Error> {
    if !(0.0..=1.0).contains(&ber) {
        return Err(format!("{flag} {ber}: a bit error rate is not in [0, 1]").into());
    }
    Ok(())
}
