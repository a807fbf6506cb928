//! The BER sweep of the ECC KV-cache paper's section 6: cache forms × bit
//! error rates × seeds, aggregated as mean ± 95% confidence interval (Student
//! t over seeds), written as the paper's Tables 5 and 7–10 in Markdown, as
//! JSON, and as an SVG plot of perplexity and KL divergence against BER.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use serde::Serialize;
use statrs::distribution::{ContinuousCDF, StudentsT};

use crate::error::Result;
use crate::metrics::RunMetrics;

/// One evaluated point: a form at a BER with one seed.
#[derive(Clone, Debug, Serialize)]
pub struct SweepPoint {
    /// The cache form's spelling (`plain` for the unquantised oracle).
    pub form: String,
    /// Bit error rate.
    pub ber: f64,
    /// Fault seed.
    pub seed: u64,
    /// Its metrics.
    pub metrics: RunMetrics,
}

/// Mean and 95% confidence half-width over seeds.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct MeanCi {
    /// Mean.
    pub mean: f64,
    /// Half-width of the 95% t interval (0 with one seed).
    pub ci95: f64,
    /// Seeds.
    pub n: usize,
}

impl MeanCi {
    /// The mean and t-interval half-width of `xs`.
    pub fn of(xs: &[f64]) -> Self {
        let n = xs.len();
        let mean = xs.iter().sum::<f64>() / n.max(1) as f64;
        let ci95 = if n < 2 {
            0.0
        } else {
            let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1) as f64;
            let t = StudentsT::new(0.0, 1.0, (n - 1) as f64)
                .map(|d| d.inverse_cdf(0.975))
                .unwrap_or(f64::NAN);
            t * (var / n as f64).sqrt()
        };
        Self { mean, ci95, n }
    }

    fn show(&self, digits: usize, scale: f64, suffix: &str) -> String {
        let m = self.mean * scale;
        if !m.is_finite() {
            return format!("{m}");
        }
        let c = self.ci95 * scale;
        if self.n > 1 && c > 0.5 * 10f64.powi(-(digits as i32)) {
            format!("{m:.digits$} ± {c:.digits$}{suffix}")
        } else {
            format!("{m:.digits$}{suffix}")
        }
    }
}

/// The aggregated sweep: forms (rows) × BERs (columns).
#[derive(Clone, Debug, Serialize)]
pub struct SweepReport {
    /// Model file.
    pub model: String,
    /// Corpus file.
    pub text: String,
    /// Context length and method.
    pub ctx: usize,
    /// `llamacpp` or `sliding/<stride>`.
    pub method: String,
    /// Fault channel name.
    pub channel: String,
    /// Forms, in row order.
    pub forms: Vec<String>,
    /// BERs, in column order.
    pub bers: Vec<f64>,
    /// Seeds used at BER > 0.
    pub seeds: Vec<u64>,
    /// The fault-free unquantised oracle.
    pub oracle: RunMetrics,
    /// Every evaluated point.
    pub points: Vec<SweepPoint>,
}

impl SweepReport {
    fn cell(&self, form: &str, ber: f64, f: impl Fn(&RunMetrics) -> f64) -> MeanCi {
        let xs: Vec<f64> = self
            .points
            .iter()
            .filter(|p| p.form == form && p.ber == ber)
            .map(|p| f(&p.metrics))
            .collect();
        MeanCi::of(&xs)
    }

    fn table(
        &self,
        out: &mut String,
        title: &str,
        oracle: Option<String>,
        show: impl Fn(MeanCi) -> String,
        f: impl Fn(&RunMetrics) -> f64 + Copy,
    ) {
        let _ = writeln!(out, "\n**{title}**\n");
        let _ = write!(out, "| form | bits/value |");
        for b in &self.bers {
            let _ = write!(out, " p = {} |", ber_label(*b));
        }
        let _ = write!(out, "\n|---|---|");
        for _ in &self.bers {
            let _ = write!(out, "---|");
        }
        out.push('\n');
        if let Some(o) = oracle {
            let _ = write!(out, "| fp32 oracle (no faults) | 32 |");
            for _ in &self.bers {
                let _ = write!(out, " {o} |");
            }
            out.push('\n');
        }
        for form in &self.forms {
            let bits = self
                .points
                .iter()
                .find(|p| &p.form == form)
                .map_or(f64::NAN, |p| p.metrics.stats.bits_per_value);
            let _ = write!(out, "| {form} | {bits:.3} |");
            for &b in &self.bers {
                let _ = write!(out, " {} |", show(self.cell(form, b, f)));
            }
            out.push('\n');
        }
    }

    /// The Markdown report: the paper's Tables 5, 7, 8, 9 and 10 in its
    /// layout (mean ± 95% CI over seeds where there is more than one).
    pub fn markdown(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "# KV-cache fault sweep\n\nmodel `{}`, text `{}`, {} method, context {}, channel {}, seeds {:?}; {} predictions scored per run.",
            self.model,
            self.text,
            self.method,
            self.ctx,
            self.channel,
            self.seeds,
            self.oracle.tokens_scored
        );
        let o = &self.oracle;
        self.table(
            &mut s,
            "Perplexity (paper Table 5)",
            Some(format!("{:.4}", o.ppl)),
            |c| c.show(4, 1.0, ""),
            |m| m.ppl,
        );
        self.table(
            &mut s,
            "Codewords corrected (paper Table 7)",
            None,
            |c| c.show(0, 1.0, ""),
            |m| m.stats.corrected as f64,
        );
        self.table(
            &mut s,
            "Codewords detected as uncorrectable (paper Table 8)",
            None,
            |c| c.show(0, 1.0, ""),
            |m| m.stats.detected as f64,
        );
        self.table(
            &mut s,
            "Miscorrected + silent words (beyond the paper)",
            None,
            |c| c.show(0, 1.0, ""),
            |m| (m.stats.miscorrected + m.stats.silent) as f64,
        );
        self.table(
            &mut s,
            "KL divergence from the clean run, nats (paper Table 9)",
            Some("0.0000".into()),
            |c| c.show(4, 1.0, ""),
            |m| m.kl_mean,
        );
        self.table(
            &mut s,
            "Top-5 accuracy (paper Table 10)",
            Some(format!("{:.2}%", 100.0 * o.top5_accuracy)),
            |c| c.show(2, 100.0, "%"),
            |m| m.top5_accuracy,
        );
        self.table(
            &mut s,
            "Top-1 agreement with the clean run",
            Some("100.00%".into()),
            |c| c.show(2, 100.0, "%"),
            |m| m.top1_agreement,
        );
        s
    }

    /// Writes `sweep.md`, `sweep.json` and `sweep.svg` into `dir`; returns their paths.
    pub fn write(&self, dir: &Path) -> Result<Vec<PathBuf>> {
        let plot = |path: &Path| self.plot(path);
        crate::report_files::write(dir, "sweep", &self.markdown(), Some(self), Some(&plot))
    }

    fn plot(&self, path: &Path) -> std::result::Result<(), Box<dyn std::error::Error>> {
        let root = SVGBackend::new(path, (1200, 500)).into_drawing_area();
        root.fill(&WHITE)?;
        let (left, right) = root.split_horizontally(600);
        let n = self.bers.len();
        let labels: Vec<String> = self.bers.iter().map(|b| ber_label(*b)).collect();
        let metric: [Metric; 2] = [|m| m.ppl, |m| m.kl_mean];
        let panels = [
            (&left, "perplexity", metric[0]),
            (&right, "KL from clean (nats)", metric[1]),
        ];
        for (area, name, f) in panels {
            let series: Vec<(String, Vec<f64>)> = self
                .forms
                .iter()
                .map(|form| {
                    let ys = self
                        .bers
                        .iter()
                        .map(|&b| self.cell(form, b, f).mean)
                        .collect();
                    (form.clone(), ys)
                })
                .collect();
            let finite = series
                .iter()
                .flat_map(|s| s.1.iter())
                .filter(|y| y.is_finite());
            let lo = finite
                .clone()
                .fold(f64::INFINITY, |a, &b| a.min(b))
                .min(f(&self.oracle));
            let hi = finite
                .fold(f64::NEG_INFINITY, |a, &b| a.max(b))
                .max(f(&self.oracle));
            let (lo, hi) = if lo.is_finite() && hi > lo {
                (lo, hi)
            } else {
                (lo.min(0.0), lo.max(0.0) + 1.0)
            };
            // A log axis once the spread passes two decades (failing forms),
            // ticked at 1, 2 and 5 times powers of ten.
            let log = lo > 0.0 && hi / lo > 100.0;
            let map = |y: f64| if log { y.ln() } else { y };
            let (bottom, top) = if log {
                (lo.ln() - 0.1, hi.ln() + 0.1)
            } else {
                (lo - 0.05 * (hi - lo), hi + 0.05 * (hi - lo))
            };
            let ticks: Vec<f64> = axis_ticks(lo, hi, log).into_iter().map(map).collect();
            let mut chart = ChartBuilder::on(area)
                .caption(format!("{name} against bit error rate"), ("sans-serif", 18))
                .margin(12)
                .x_label_area_size(36)
                .y_label_area_size(60)
                .build_cartesian_2d(-0.2f64..(n as f64 - 0.8), bottom..top)?;
            let x_labels = labels.clone();
            chart
                .configure_mesh()
                .x_labels(n)
                .x_label_formatter(&|x| {
                    let i = x.round() as usize;
                    x_labels.get(i).cloned().unwrap_or_default()
                })
                .y_labels(0)
                .disable_y_mesh()
                .x_desc("bit error rate")
                .y_desc("▲ at the top: infinite or NaN")
                .draw()?;
            // The y ticks, drawn here: plotters places its own at evenly
            // spaced points of the axis, which on a log axis were powers of e.
            let right = n as f64 - 0.8;
            for &t in &ticks {
                chart.draw_series(LineSeries::new([(-0.2, t), (right, t)], BLACK.mix(0.12)))?;
                let (px, py) = chart.backend_coord(&(-0.2, t));
                let label = tick_label(if log { t.exp() } else { t });
                let style = ("sans-serif", 12)
                    .into_font()
                    .into_text_style(&root)
                    .pos(Pos::new(HPos::Right, VPos::Center));
                root.draw(&Text::new(label, (px - 6, py), style))?;
            }
            for (i, (form, ys)) in series.iter().enumerate() {
                let color = Palette99::pick(i).to_rgba();
                let pts: Vec<(f64, f64)> = ys
                    .iter()
                    .enumerate()
                    .filter(|(_, y)| y.is_finite())
                    .map(|(x, &y)| (x as f64, map(y)))
                    .collect();
                chart
                    .draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))?
                    .label(form.as_str())
                    .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], color));
                chart.draw_series(pts.into_iter().map(|p| Circle::new(p, 3, color.filled())))?;
                // Runs whose metric is infinite or NaN (an unprotected form
                // under faults) are marked at the top instead of vanishing.
                let failed = ys.iter().enumerate().filter(|(_, y)| !y.is_finite());
                chart.draw_series(
                    failed.map(|(x, _)| TriangleMarker::new((x as f64, top), 7, color.filled())),
                )?;
            }
            chart
                .configure_series_labels()
                .background_style(WHITE.mix(0.8))
                .border_style(BLACK)
                .position(SeriesLabelPosition::UpperLeft)
                .draw()?;
        }
        root.present()?;
        Ok(())
    }
}

/// A metric read off a run.
type Metric = fn(&RunMetrics) -> f64;

/// The y ticks of `lo..=hi`: on a log axis, 1, 2 and 5 times the powers of
/// ten inside it; on a linear one, about six multiples of a 1-2-5 step.
fn axis_ticks(lo: f64, hi: f64, log: bool) -> Vec<f64> {
    if !(lo.is_finite() && hi.is_finite() && hi > lo) {
        return vec![lo];
    }
    if log {
        let first = lo.log10().floor() as i32;
        let last = hi.log10().ceil() as i32;
        return (first..=last)
            .flat_map(|e| [1.0, 2.0, 5.0].map(|m| m * 10f64.powi(e)))
            .filter(|t| *t >= lo * 0.999 && *t <= hi * 1.001)
            .collect();
    }
    let raw = (hi - lo) / 6.0;
    let mag = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0]
        .into_iter()
        .map(|m| m * mag)
        .find(|s| *s >= raw)
        .unwrap_or(10.0 * mag);
    let mut t = (lo / step).ceil() * step;
    let mut ticks = Vec::new();
    while t <= hi + step * 1e-9 && ticks.len() < 50 {
        ticks.push(t);
        t += step;
    }
    ticks
}

/// A tick's text: no more digits than it needs (10, 20, 0.05, 12.5).
fn tick_label(v: f64) -> String {
    let s = format!("{v:.4}");
    let s = s.trim_end_matches('0').trim_end_matches('.');
    if s == "-0" { "0".into() } else { s.into() }
}

/// `0`, `1e-4`, `0.003`…
pub fn ber_label(b: f64) -> String {
    if b == 0.0 {
        "0".into()
    } else if b.log10().fract().abs() < 1e-9 {
        format!("1e{}", b.log10().round() as i64)
    } else {
        format!("{b}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A sweep whose `fp16` runs fail (infinite perplexity) at the higher
    /// rate: the plot keeps a marker for them and ticks its log axis at
    /// 10, 20, 50, not at powers of e.
    #[test]
    fn the_plot_marks_failed_runs_and_ticks_decades() {
        let metrics = |ppl: f64| RunMetrics {
            ppl,
            kl_mean: ppl / 100.0,
            ..RunMetrics::default()
        };
        let point = |form: &str, ber: f64, ppl: f64| SweepPoint {
            form: form.into(),
            ber,
            seed: 0,
            metrics: metrics(ppl),
        };
        let report = SweepReport {
            model: "m".into(),
            text: "t".into(),
            ctx: 256,
            method: "llamacpp".into(),
            channel: "iid".into(),
            forms: vec!["fp16".into(), "int4+secded84".into()],
            bers: vec![0.0, 1e-3, 1e-2],
            seeds: vec![0],
            oracle: metrics(10.5),
            points: vec![
                point("fp16", 0.0, 10.5),
                point("fp16", 1e-3, 14.0),
                point("fp16", 1e-2, f64::INFINITY),
                point("int4+secded84", 0.0, 11.0),
                point("int4+secded84", 1e-3, 11.2),
                point("int4+secded84", 1e-2, 3000.0),
            ],
        };
        let dir = std::env::temp_dir().join(format!("kv-eval-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let svg = dir.join("sweep.svg");
        report.plot(&svg).unwrap();
        let text = std::fs::read_to_string(&svg).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        let label = |t: &str| format!("\n{t}\n</text>");
        for tick in ["20", "50", "100", "1000"] {
            assert!(text.contains(&label(tick)), "no tick {tick}");
        }
        assert!(!text.contains(&label("20.086")), "a power of e is ticked");
        // One triangle per failed run (fp16 at 1e-2), in each panel.
        assert_eq!(text.matches("<polygon").count(), 2, "{text}");
    }

    #[test]
    fn log_ticks_are_one_two_five_decades() {
        assert_eq!(
            axis_ticks(12.0, 600.0, true),
            [20.0, 50.0, 100.0, 200.0, 500.0]
        );
        let linear = axis_ticks(10.0, 11.0, false);
        assert!(linear.len() >= 4 && linear.len() <= 11, "{linear:?}");
        assert!(linear.iter().all(|t| (10.0..=11.0).contains(t)));
        assert_eq!(tick_label(20.000000001), "20");
        assert_eq!(tick_label(0.05), "0.05");
        assert_eq!(tick_label(12.5), "12.5");
    }

    #[test]
    fn confidence_interval_uses_student_t() {
        let c = MeanCi::of(&[1.0, 2.0, 3.0]);
        assert_eq!(c.mean, 2.0);
        // t(0.975, 2) = 4.302653, sd = 1, n = 3.
        assert!(
            (c.ci95 - 4.302_653 / 3f64.sqrt()).abs() < 1e-5,
            "{}",
            c.ci95
        );
        let one = MeanCi::of(&[5.0]);
        assert_eq!((one.mean, one.ci95), (5.0, 0.0));
        assert_eq!(c.show(2, 1.0, ""), "2.00 ± 2.48");
    }

    #[test]
    fn ber_labels() {
        assert_eq!(ber_label(0.0), "0");
        assert_eq!(ber_label(1e-4), "1e-4");
        assert_eq!(ber_label(1e-2), "1e-2");
        assert_eq!(ber_label(0.003), "0.003");
    }
}
