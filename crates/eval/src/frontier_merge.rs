//! Several `kv-eval frontier` runs as one figure: [`MergedFrontier`] reads
//! their `frontier.json` files, keeps one context, groups the points by
//! model (one panel each, its own Pareto front) and writes a Markdown
//! table and an SVG plot of ΔPPL against bits per value, with the goals
//! drawn as corners (at most `bits` bits for at most `ΔPPL` percent). Each
//! point keeps the ΔPPL its own run measured against its own plain pass,
//! so runs of one model merge only if they scored the same tokens (the
//! merge refuses runs of one model over different token counts, texts or
//! methods).

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use plotters::prelude::*;
use serde::Deserialize;

use crate::error::{EvalError, Result};
use crate::frontier::labelled_point;

/// What the merge reads of one frontier point (`frontier.json`).
#[derive(Clone, Debug, Deserialize)]
pub struct MergedPoint {
    /// The configuration as the run named it.
    pub config: String,
    /// Context length.
    pub ctx: usize,
    /// Bits per value, every stored byte counted.
    #[serde(deserialize_with = "finite_or_nan")]
    pub bits_per_value: f64,
    /// Bits per key value.
    #[serde(deserialize_with = "finite_or_nan")]
    pub key_bits: f64,
    /// Bits per value value.
    #[serde(deserialize_with = "finite_or_nan")]
    pub value_bits: f64,
    /// Perplexity.
    #[serde(deserialize_with = "finite_or_nan")]
    pub ppl: f64,
    /// ΔPPL against the run's own plain pass, in percent.
    #[serde(deserialize_with = "finite_or_nan")]
    pub delta_ppl_percent: f64,
    /// Mean KL divergence from the plain pass.
    #[serde(deserialize_with = "finite_or_nan")]
    pub kl: f64,
    /// Top-1 agreement with the plain pass.
    #[serde(deserialize_with = "finite_or_nan")]
    pub top1_agreement: f64,
}

/// What the merge reads of a plain pass.
#[derive(Clone, Debug, Deserialize)]
struct PlainRun {
    #[serde(deserialize_with = "finite_or_nan")]
    ppl: f64,
}

/// A number as `frontier.json` writes it: `null` for a NaN or infinite
/// one (a diverged run), read as NaN.
fn finite_or_nan<'de, D: serde::Deserializer<'de>>(d: D) -> std::result::Result<f64, D::Error> {
    Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
}

/// What the merge reads of one `frontier.json`.
#[derive(Clone, Debug, Deserialize)]
struct RunFile {
    model: String,
    text: String,
    method: String,
    tokens: usize,
    plain: Vec<(usize, PlainRun)>,
    points: Vec<MergedPoint>,
}

/// One model's points at the merged context.
#[derive(Clone, Debug)]
pub struct Panel {
    /// The model's file name.
    pub model: String,
    /// Tokens scored from the start of the text.
    pub tokens: usize,
    /// Plain perplexity of the context.
    pub plain_ppl: f64,
    /// The points, by bits per value.
    pub points: Vec<MergedPoint>,
}

impl Panel {
    /// Whether `p` lies on this panel's Pareto front (a point whose run
    /// diverged, ΔPPL not finite, never does).
    pub fn on_front(&self, p: &MergedPoint) -> bool {
        p.delta_ppl_percent.is_finite()
            && !self.points.iter().any(|q| {
                q.bits_per_value <= p.bits_per_value
                    && q.delta_ppl_percent <= p.delta_ppl_percent
                    && (q.bits_per_value < p.bits_per_value
                        || q.delta_ppl_percent < p.delta_ppl_percent)
            })
    }
}

/// Frontier runs merged at one context, a panel per model.
#[derive(Clone, Debug)]
pub struct MergedFrontier {
    /// The context length kept.
    pub ctx: usize,
    /// One panel per model, in the order the runs named them.
    pub panels: Vec<Panel>,
    /// Goals drawn on every panel: at most `.0` bits for at most `.1`
    /// percent ΔPPL.
    pub goals: Vec<(f64, f64)>,
}

impl MergedFrontier {
    /// Reads `files` (each a `frontier.json`) and keeps their points at
    /// `ctx`, or why not: a file that cannot be read or parsed, runs of
    /// one model over different tokens, a run without that context, no
    /// point at all.
    pub fn read(files: &[PathBuf], ctx: usize, goals: Vec<(f64, f64)>) -> Result<Self> {
        let mut panels: Vec<(Panel, String, String)> = Vec::new();
        for file in files {
            let report =
                |e: &dyn std::fmt::Display| EvalError::Report(format!("{}: {e}", file.display()));
            let text = std::fs::read_to_string(file).map_err(|e| report(&e))?;
            let run: RunFile = serde_json::from_str(&text).map_err(|e| report(&e))?;
            let Some((_, plain)) = run.plain.iter().find(|(c, _)| *c == ctx) else {
                return Err(report(&format!("the run has no context {ctx}")));
            };
            let model = Path::new(&run.model)
                .file_name()
                .map_or(run.model.clone(), |n| n.to_string_lossy().into_owned());
            let source = format!("{} ({} method)", run.text, run.method);
            let points = run.points.into_iter().filter(|p| p.ctx == ctx);
            match panels.iter_mut().find(|(p, _, _)| p.model == model) {
                Some((panel, text, _)) => {
                    // The same tokens give the same plain pass, bit for bit
                    // within a build; another build's moves it a little.
                    let same_plain = (panel.plain_ppl - plain.ppl).abs() <= 1e-9 * plain.ppl;
                    if panel.tokens != run.tokens || *text != source || !same_plain {
                        return Err(report(&format!(
                            "{model} was scored over {} tokens of {text} (plain PPL {}) in another \
                             run, here over {} of {source} (plain PPL {}): their ΔPPL do not compare",
                            panel.tokens, panel.plain_ppl, run.tokens, plain.ppl
                        )));
                    }
                    for p in points {
                        if panel.points.iter().any(|q| q.config == p.config) {
                            return Err(report(&format!(
                                "{} of {model} is in another run too: keep one",
                                p.config
                            )));
                        }
                        panel.points.push(p);
                    }
                }
                None => panels.push((
                    Panel {
                        model: model.clone(),
                        tokens: run.tokens,
                        plain_ppl: plain.ppl,
                        points: points.collect(),
                    },
                    source,
                    file.display().to_string(),
                )),
            }
        }
        let mut panels: Vec<Panel> = panels.into_iter().map(|(p, _, _)| p).collect();
        if panels.iter().all(|p| p.points.is_empty()) {
            return Err(EvalError::Report(format!(
                "no point at context {ctx} in {} files",
                files.len()
            )));
        }
        for panel in &mut panels {
            panel
                .points
                .sort_by(|a, b| a.bits_per_value.total_cmp(&b.bits_per_value));
        }
        Ok(Self { ctx, panels, goals })
    }

    /// The Markdown tables: per model its points, numbered as the plot
    /// labels them, the Pareto front in bold.
    pub fn markdown(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(s, "# Quality against bytes, context {}", self.ctx);
        for panel in &self.panels {
            let _ = writeln!(
                s,
                "\n## {}\n\nfirst {} tokens, plain PPL {:.4}.\n\n\
                 | # | configuration | bits | K / V bits | PPL | ΔPPL | KL | top-1 agreement |\n\
                 |---|---|---|---|---|---|---|---|",
                panel.model, panel.tokens, panel.plain_ppl
            );
            for (i, p) in panel.points.iter().enumerate() {
                let bold = |x: String| {
                    if panel.on_front(p) {
                        format!("**{x}**")
                    } else {
                        x
                    }
                };
                let _ = writeln!(
                    s,
                    "| {} | `{}` | {} | {:.3} / {:.3} | {:.4} | {} | {:.4} | {:.2}% |",
                    i + 1,
                    p.config,
                    bold(format!("{:.3}", p.bits_per_value)),
                    p.key_bits,
                    p.value_bits,
                    p.ppl,
                    bold(format!("{:+.2}%", p.delta_ppl_percent)),
                    p.kl,
                    100.0 * p.top1_agreement
                );
            }
        }
        s
    }

    /// Writes `frontier.md` and `frontier.svg` into `dir`.
    pub fn write(&self, dir: &Path) -> Result<Vec<PathBuf>> {
        let plot = |path: &Path| self.plot(path);
        crate::report_files::write(dir, "frontier", &self.markdown(), None, Some(&plot))
    }

    fn plot(&self, path: &Path) -> std::result::Result<(), Box<dyn std::error::Error>> {
        let n = self.panels.len().max(1);
        let root = SVGBackend::new(path, (520 * n as u32, 480)).into_drawing_area();
        root.fill(&WHITE)?;
        // ΔPPL on a log axis from 0.1% (smaller changes sit at the floor).
        let floor = 0.1f64;
        let y = |d: f64| d.max(floor).log10();
        // Bits from the half bit below the fewest, so the points spread.
        let min_bits = self
            .panels
            .iter()
            .flat_map(|p| &p.points)
            .map(|p| p.bits_per_value)
            .fold(f64::INFINITY, f64::min);
        let min_bits = if min_bits.is_finite() {
            (min_bits - 0.5).max(0.0).floor()
        } else {
            0.0
        };
        let max_bits = self
            .panels
            .iter()
            .flat_map(|p| &p.points)
            .map(|p| p.bits_per_value)
            .fold(4.0f64, f64::max);
        let max_delta = self
            .panels
            .iter()
            .flat_map(|p| &p.points)
            .map(|p| p.delta_ppl_percent)
            .filter(|d| d.is_finite())
            .fold(30.0f64, f64::max)
            .min(1e4);
        for (area, panel) in root.split_evenly((1, n)).iter().zip(&self.panels) {
            let mut chart = ChartBuilder::on(area)
                .caption(
                    format!("{}, context {}", panel.model, self.ctx),
                    ("sans-serif", 15),
                )
                .margin(12)
                .x_label_area_size(36)
                .y_label_area_size(54)
                .build_cartesian_2d(min_bits..max_bits + 0.3, y(floor)..y(max_delta) + 0.15)?;
            chart
                .configure_mesh()
                .x_desc("bits per value (true bytes)")
                .y_desc("ΔPPL % (log)")
                .y_label_formatter(&|v| format!("{:.1}", 10f64.powf(*v)))
                .draw()?;
            for &(bits, delta) in &self.goals {
                let corner = [(min_bits, y(delta)), (bits, y(delta)), (bits, y(floor))];
                chart.draw_series(LineSeries::new(corner, RED.mix(0.5).stroke_width(1)))?;
                chart.draw_series(std::iter::once(Text::new(
                    format!("goal: ≤{bits} bits, ≤+{delta}%"),
                    (min_bits + 0.05, y(delta) + 0.04),
                    ("sans-serif", 10).into_font().color(&RED),
                )))?;
            }
            for (i, p) in panel.points.iter().enumerate() {
                let at = (p.bits_per_value, y(p.delta_ppl_percent.min(max_delta)));
                let label = (format!("{}", i + 1), (0.05, 0.03), 11);
                labelled_point(&mut chart, at, label, panel.on_front(p))?;
            }
            let front: Vec<(f64, f64)> = panel
                .points
                .iter()
                .filter(|p| panel.on_front(p))
                .map(|p| (p.bits_per_value, y(p.delta_ppl_percent.min(max_delta))))
                .collect();
            chart.draw_series(LineSeries::new(front, BLUE.stroke_width(1)))?;
        }
        root.present()?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(model: &str, tokens: usize, points: &[(&str, f64, f64)]) -> String {
        let points: Vec<String> = points
            .iter()
            .map(|(c, bits, delta)| {
                format!(
                    r#"{{"config":"{c}","ctx":2048,"bits_per_value":{bits},"key_bits":{bits},
                    "value_bits":{bits},"codebook_bits":0,"ppl":{},"delta_ppl_percent":{delta},
                    "kl":0.1,"top1_agreement":0.9,"metrics":{{}}}}"#,
                    10.0 * (1.0 + delta / 100.0)
                )
            })
            .collect();
        format!(
            r#"{{"model":"/m/{model}","text":"t","method":"llamacpp","tokens":{tokens},
            "calibration":"c","plain":[[2048,{{"ppl":10.0}}]],"points":[{}]}}"#,
            points.join(",")
        )
    }

    /// A fresh folder of this test process.
    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("kv-eval-merge-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn files(dir: &Path, runs: &[String]) -> Vec<PathBuf> {
        runs.iter()
            .enumerate()
            .map(|(i, r)| {
                let f = dir.join(format!("run{i}.json"));
                std::fs::write(&f, r).unwrap();
                f
            })
            .collect()
    }

    #[test]
    fn runs_merge_by_model_with_each_panels_front() {
        let dir = scratch("merge");
        let runs = [
            run("a.gguf", 100, &[("x", 3.0, 10.0), ("y", 2.0, 30.0)]),
            run("b.gguf", 50, &[("x", 3.0, 2.0)]),
            run("a.gguf", 100, &[("z", 2.5, 40.0)]),
        ];
        let merged = MergedFrontier::read(&files(dir.as_path(), &runs), 2048, vec![(2.5, 10.0)]);
        let merged = merged.unwrap();
        assert_eq!(merged.panels.len(), 2);
        // A diverged point (serde_json writes its NaN as null) is read and
        // kept off the front.
        let diverged = run("c.gguf", 10, &[("w", 2.0, 5.0), ("v", 1.0, 1.0)])
            .replacen("\"delta_ppl_percent\":1", "\"delta_ppl_percent\":null", 1)
            .replacen("\"ppl\":10.1", "\"ppl\":null", 1);
        let c = MergedFrontier::read(&files(dir.as_path(), &[diverged]), 2048, vec![]).unwrap();
        let c = &c.panels[0];
        assert!(c.points[0].delta_ppl_percent.is_nan() && !c.on_front(&c.points[0]));
        assert!(c.on_front(&c.points[1]));
        let a = &merged.panels[0];
        let configs: Vec<&str> = a.points.iter().map(|p| p.config.as_str()).collect();
        assert_eq!(configs, ["y", "z", "x"], "by bits");
        let front: Vec<bool> = a.points.iter().map(|p| a.on_front(p)).collect();
        assert_eq!(front, [true, false, true], "z is dominated by y");
        let md = merged.markdown();
        assert!(md.contains("| 2 | `z` | 2.500 |"), "{md}");
        assert!(md.contains("**+10.00%**"), "{md}");
        let out = dir.as_path().join("out");
        let written = merged.write(&out).unwrap();
        assert!(
            std::fs::read_to_string(&written[1])
                .unwrap()
                .contains("<svg")
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn runs_that_do_not_compare_are_refused() {
        let dir = scratch("refused");
        let runs = [
            run("a.gguf", 100, &[("x", 3.0, 10.0)]),
            run("a.gguf", 200, &[("y", 2.0, 5.0)]),
        ];
        let e = MergedFrontier::read(&files(dir.as_path(), &runs), 2048, vec![]).unwrap_err();
        assert!(e.to_string().contains("do not compare"), "{e}");
        let twice = [
            run("a.gguf", 100, &[("x", 3.0, 10.0)]),
            run("a.gguf", 100, &[("x", 3.0, 9.0)]),
        ];
        let e = MergedFrontier::read(&files(dir.as_path(), &twice), 2048, vec![]).unwrap_err();
        assert!(
            e.to_string().contains("x of a.gguf is in another run"),
            "{e}"
        );
        let other_plain =
            run("a.gguf", 100, &[("y", 2.0, 5.0)]).replace("\"ppl\":10.0}", "\"ppl\":10.5}");
        let runs2 = [runs[0].clone(), other_plain];
        let e = MergedFrontier::read(&files(dir.as_path(), &runs2), 2048, vec![]).unwrap_err();
        assert!(e.to_string().contains("plain PPL 10.5"), "{e}");
        let e = MergedFrontier::read(&files(dir.as_path(), &runs[..1]), 256, vec![]).unwrap_err();
        assert!(e.to_string().contains("no context 256"), "{e}");
        std::fs::write(dir.as_path().join("bad.json"), "{").unwrap();
        let e = MergedFrontier::read(&[dir.as_path().join("bad.json")], 2048, vec![]).unwrap_err();
        assert!(e.to_string().contains("bad.json"), "{e}");
        let e =
            MergedFrontier::read(&[dir.as_path().join("missing.json")], 2048, vec![]).unwrap_err();
        assert!(e.to_string().contains("missing.json"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
