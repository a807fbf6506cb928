//! A report's files in its output folder: `<stem>.md`, and where the
//! report has them `<stem>.json` and an SVG plot `<stem>.svg`, each
//! failure an [`EvalError::Report`] that names the file (the one writer
//! of every report of this crate).

use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::error::{EvalError, Result};

/// Draws a plot into the SVG file at the path it is given.
pub(crate) type Plot<'a> = &'a dyn Fn(&Path) -> std::result::Result<(), Box<dyn std::error::Error>>;

/// Writes `dir/<stem>.md` (`markdown`), `dir/<stem>.json` (`json`, pretty)
/// and `dir/<stem>.svg` (`plot`), making `dir` if need be; returns the
/// paths written, in that order.
pub(crate) fn write(
    dir: &Path,
    stem: &str,
    markdown: &str,
    json: Option<&dyn erased::Json>,
    plot: Option<Plot<'_>>,
) -> Result<Vec<PathBuf>> {
    let report = |what: &Path, e: &dyn std::fmt::Display| {
        EvalError::Report(format!("{}: {e}", what.display()))
    };
    std::fs::create_dir_all(dir).map_err(|e| report(dir, &e))?;
    let md = dir.join(format!("{stem}.md"));
    std::fs::write(&md, markdown).map_err(|e| report(&md, &e))?;
    let mut written = vec![md];
    if let Some(value) = json {
        let path = dir.join(format!("{stem}.json"));
        let text = value.pretty().map_err(|e| report(&path, &e))?;
        std::fs::write(&path, text).map_err(|e| report(&path, &e))?;
        written.push(path);
    }
    if let Some(plot) = plot {
        let path = dir.join(format!("{stem}.svg"));
        plot(&path).map_err(|e| report(&path, &e))?;
        written.push(path);
    }
    Ok(written)
}

/// A serializable report behind a `dyn` reference.
pub(crate) mod erased {
    /// Pretty JSON of any [`Serialize`](super::Serialize) value.
    pub(crate) trait Json {
        /// The value as pretty-printed JSON.
        fn pretty(&self) -> serde_json::Result<String>;
    }

    impl<T: super::Serialize> Json for T {
        fn pretty(&self) -> serde_json::Result<String> {
            serde_json::to_string_pretty(self)
        }
    }
}
