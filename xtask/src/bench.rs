//! `cargo xtask bench`: run criterion benches, pair each figure with its
//! same-run baseline, print a table and optionally write JSON.
//!
//! Results are read from criterion's own output
//! (`target/criterion/**/new/{benchmark,estimates}.json`), keeping only files
//! written by this run, so stale figures from earlier runs never mix in.

use crate::cargo;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use anyhow::{Context, Result, bail};
use clap::Args;
use serde::{Deserialize, Serialize};

/// Arguments of `cargo xtask bench`.
#[derive(Args, Debug)]
pub(crate) struct BenchArgs {
    /// Crates whose benches to run (all workspace crates with benches when empty).
    crates: Vec<String>,
    /// Also write the figures as a JSON array to this file.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Only run benchmarks whose id contains this string (criterion filter).
    #[arg(long)]
    filter: Option<String>,
}

/// One reported figure: the JSON schema of `--json`.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub(crate) struct Figure {
    bench: String,
    value: f64,
    unit: String,
    baseline: String,
    baseline_value: f64,
    ratio: f64,
}

#[derive(Deserialize)]
struct Metadata {
    packages: Vec<Package>,
    workspace_members: Vec<String>,
    target_directory: PathBuf,
}

#[derive(Deserialize)]
struct Package {
    name: String,
    id: String,
    targets: Vec<Target>,
}

#[derive(Deserialize)]
struct Target {
    kind: Vec<String>,
}

#[derive(Deserialize)]
struct CriterionBenchmark {
    group_id: String,
    function_id: Option<String>,
    throughput: Option<BTreeMap<String, u64>>,
}

#[derive(Deserialize)]
struct CriterionEstimates {
    mean: PointEstimate,
}

#[derive(Deserialize)]
struct PointEstimate {
    point_estimate: f64,
}

/// One measured function: throughput per second in `unit`.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Measurement {
    group: String,
    function: String,
    value: f64,
    unit: &'static str,
}

fn metadata() -> Result<Metadata> {
    let out = crate::stdout_of(
        cargo().args(["metadata", "--format-version", "1", "--no-deps"]),
        "cargo metadata",
    )?;
    serde_json::from_slice(&out).context("parsing cargo metadata")
}

/// Runs the benches and reports.
pub(crate) fn run(args: &BenchArgs) -> Result<()> {
    let meta = metadata()?;
    let with_benches: Vec<&str> = meta
        .packages
        .iter()
        .filter(|p| meta.workspace_members.contains(&p.id))
        .filter(|p| {
            p.targets
                .iter()
                .any(|t| t.kind.iter().any(|k| k == "bench"))
        })
        .map(|p| p.name.as_str())
        .collect();
    let crates: Vec<&str> = if args.crates.is_empty() {
        with_benches.clone()
    } else {
        for c in &args.crates {
            if !with_benches.contains(&c.as_str()) {
                bail!(
                    "crate {c:?} has no benches in this workspace (crates with benches: {})",
                    with_benches.join(", ")
                );
            }
        }
        args.crates.iter().map(String::as_str).collect()
    };

    let started = SystemTime::now();
    for krate in &crates {
        eprintln!("== cargo bench -p {krate}");
        let mut cmd = cargo();
        cmd.args(["bench", "-p", krate, "--benches", "--"]);
        if let Some(f) = &args.filter {
            cmd.arg(f);
        }
        let status = cmd
            .status()
            .with_context(|| format!("running cargo bench -p {krate}"))?;
        if !status.success() {
            bail!("cargo bench -p {krate} failed ({status})");
        }
    }

    let criterion_dir = meta.target_directory.join("criterion");
    let measurements = collect(&criterion_dir, started)?;
    let measurements: Vec<Measurement> = measurements
        .into_iter()
        .filter(|m| crates.iter().any(|c| m.group.starts_with(&format!("{c}/"))))
        .collect();
    if measurements.is_empty() {
        bail!(
            "no criterion results from this run under {}; are the groups named <crate>/<figure>?",
            criterion_dir.display()
        );
    }
    let figures = pair_with_baselines(&measurements);
    if figures.is_empty() {
        bail!(
            "no figure has a baseline measured in this run (does --filter exclude the baseline-* functions?)"
        );
    }
    print!("{}", table(&figures));
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&figures)? + "\n")
            .with_context(|| format!("writing {}", path.display()))?;
        eprintln!("wrote {} figures to {}", figures.len(), path.display());
    }
    Ok(())
}

/// Reads every `new/benchmark.json` under `dir` modified since `since`.
fn collect(dir: &Path, since: SystemTime) -> Result<Vec<Measurement>> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for entry in entries {
            let path = entry?.path();
            if path.is_dir() {
                stack.push(path);
            } else if path.ends_with("new/benchmark.json") {
                let modified = std::fs::metadata(&path)?.modified()?;
                if modified >= since {
                    out.push(read_measurement(&path)?);
                }
            }
        }
    }
    out.sort_by(|a, b| (&a.group, &a.function).cmp(&(&b.group, &b.function)));
    Ok(out)
}

fn read_measurement(benchmark_json: &Path) -> Result<Measurement> {
    let bench: CriterionBenchmark = serde_json::from_str(&std::fs::read_to_string(benchmark_json)?)
        .with_context(|| format!("parsing {}", benchmark_json.display()))?;
    let estimates_path = benchmark_json.with_file_name("estimates.json");
    let est: CriterionEstimates = serde_json::from_str(&std::fs::read_to_string(&estimates_path)?)
        .with_context(|| format!("parsing {}", estimates_path.display()))?;
    let ns = est.mean.point_estimate;
    let (value, unit) = throughput(bench.throughput.as_ref(), ns);
    Ok(Measurement {
        group: bench.group_id,
        function: bench.function_id.unwrap_or_default(),
        value,
        unit,
    })
}

/// Converts a mean time per iteration (ns) into a rate: bytes per ns is GB/s,
/// elements per ns is G elements/s; without a throughput, iterations per second.
fn throughput(declared: Option<&BTreeMap<String, u64>>, ns: f64) -> (f64, &'static str) {
    match declared.and_then(|t| t.iter().next()) {
        Some((kind, &n)) if kind.starts_with("Bytes") => (n as f64 / ns, "GB/s"),
        Some((_, &n)) => (n as f64 / ns, "Gelem/s"),
        None => (1e9 / ns, "iter/s"),
    }
}

/// Pairs each measurement with its baseline in the same group.
///
/// A function `F` is paired with `baseline-F` when the group has one (a
/// baseline that does the same work as `F`, for example a streaming read of
/// exactly `F`'s bytes). Otherwise it is paired with the group's baseline: the
/// one `baseline-*` function that names no function of the group. A group
/// with several such baselines is ambiguous and its unpaired figures are
/// skipped with a warning.
fn pair_with_baselines(measurements: &[Measurement]) -> Vec<Figure> {
    let mut figures = Vec::new();
    let mut groups: BTreeMap<&str, Vec<&Measurement>> = BTreeMap::new();
    for m in measurements {
        groups.entry(&m.group).or_default().push(m);
    }
    for (group, members) in groups {
        let (baselines, functions): (Vec<&Measurement>, Vec<&Measurement>) = members
            .iter()
            .partition(|m| m.function.starts_with("baseline-"));
        let names_a_function = |b: &Measurement| {
            functions
                .iter()
                .any(|f| b.function == format!("baseline-{}", f.function))
        };
        let group_wide: Vec<&Measurement> = baselines
            .iter()
            .copied()
            .filter(|b| !names_a_function(b))
            .collect();
        for m in functions {
            let own = format!("baseline-{}", m.function);
            let base = match baselines.iter().find(|b| b.function == own) {
                Some(b) => *b,
                None => match group_wide.as_slice() {
                    [b] => *b,
                    [] => {
                        eprintln!(
                            "warning: {group}/{} has no baseline ({own} or a group-wide baseline-*); not reported",
                            m.function
                        );
                        continue;
                    }
                    _ => {
                        eprintln!(
                            "warning: {group}/{} has no {own} and the group has {} group-wide baselines; not reported",
                            m.function,
                            group_wide.len()
                        );
                        continue;
                    }
                },
            };
            if m.unit != base.unit {
                eprintln!(
                    "warning: {group}/{} is in {} but its baseline is in {}; skipped",
                    m.function, m.unit, base.unit
                );
                continue;
            }
            figures.push(Figure {
                bench: format!("{group}/{}", m.function),
                value: m.value,
                unit: m.unit.to_string(),
                baseline: format!("{group}/{}", base.function),
                baseline_value: base.value,
                ratio: m.value / base.value,
            });
        }
    }
    figures
}

fn table(figures: &[Figure]) -> String {
    let width = figures
        .iter()
        .map(|f| f.bench.len())
        .max()
        .unwrap_or(5)
        .max(5);
    let bwidth = figures
        .iter()
        .map(|f| f.baseline.len())
        .max()
        .unwrap_or(8)
        .max(8);
    let mut s = format!(
        "\n{:<width$}  {:>14}  {:<bwidth$}  {:>14}  {:>7}\n",
        "bench", "value", "baseline", "baseline value", "ratio"
    );
    s += &format!("{}\n", "-".repeat(width + bwidth + 45));
    for f in figures {
        s += &format!(
            "{:<width$}  {:>8} {:<7}  {:<bwidth$}  {:>8} {:<7}  {:>7.3}\n",
            f.bench,
            number(f.value),
            f.unit,
            f.baseline,
            number(f.baseline_value),
            f.unit,
            f.ratio
        );
    }
    s += "(ratio = value / baseline, both in the same unit; higher is better)\n";
    s
}

/// Three decimals, or three significant digits in scientific notation for
/// rates below 0.01 (model throughput in Gelem/s).
fn number(v: f64) -> String {
    if v == 0.0 || v.abs() >= 0.01 {
        format!("{v:.3}")
    } else {
        format!("{v:.2e}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(group: &str, function: &str, value: f64, unit: &'static str) -> Measurement {
        Measurement {
            group: group.into(),
            function: function.into(),
            value,
            unit,
        }
    }

    #[test]
    fn figures_pair_with_their_group_baseline() {
        let ms = [
            m("c/a", "baseline-memcpy", 10.0, "GB/s"),
            m("c/a", "fast", 15.0, "GB/s"),
            m("c/a", "other-unit", 1.0, "Gelem/s"),
            m("c/b", "x", 1.0, "GB/s"),
        ];
        let figs = pair_with_baselines(&ms);
        assert_eq!(figs.len(), 1);
        assert_eq!(figs[0].bench, "c/a/fast");
        assert_eq!(figs[0].baseline, "c/a/baseline-memcpy");
        assert!((figs[0].ratio - 1.5).abs() < 1e-12);
        let json = serde_json::to_value(&figs).unwrap();
        let keys: Vec<&str> = json[0]
            .as_object()
            .unwrap()
            .keys()
            .map(String::as_str)
            .collect();
        assert_eq!(
            keys,
            [
                "baseline",
                "baseline_value",
                "bench",
                "ratio",
                "unit",
                "value"
            ]
        );
    }

    #[test]
    fn a_function_prefers_its_own_baseline() {
        let ms = [
            m("c/a", "baseline-stream-read", 10.0, "GB/s"),
            m("c/a", "baseline-int4", 20.0, "GB/s"),
            m("c/a", "int4", 5.0, "GB/s"),
            m("c/a", "fp16", 4.0, "GB/s"),
            // Two group-wide baselines: `y` cannot be paired.
            m("c/b", "baseline-one", 1.0, "GB/s"),
            m("c/b", "baseline-two", 1.0, "GB/s"),
            m("c/b", "y", 1.0, "GB/s"),
        ];
        let figs = pair_with_baselines(&ms);
        let pairs: Vec<(&str, &str, f64)> = figs
            .iter()
            .map(|f| (f.bench.as_str(), f.baseline.as_str(), f.ratio))
            .collect();
        assert_eq!(
            pairs,
            [
                ("c/a/int4", "c/a/baseline-int4", 0.25),
                ("c/a/fp16", "c/a/baseline-stream-read", 0.4),
            ]
        );
    }

    #[test]
    fn small_rates_keep_their_digits() {
        assert_eq!(number(12.5), "12.500");
        assert_eq!(number(4.81e-7), "4.81e-7");
        assert_eq!(number(0.0), "0.000");
    }

    #[test]
    fn throughput_units() {
        let bytes = BTreeMap::from([("Bytes".to_string(), 1000u64)]);
        assert_eq!(throughput(Some(&bytes), 100.0), (10.0, "GB/s"));
        let elems = BTreeMap::from([("Elements".to_string(), 50u64)]);
        assert_eq!(throughput(Some(&elems), 100.0), (0.5, "Gelem/s"));
        assert_eq!(throughput(None, 1e6), (1000.0, "iter/s"));
    }
}
