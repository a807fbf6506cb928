//! The quality-versus-bytes frontier of cache forms: for each configuration
//! (key form, value form, per-layer policy) and context length, the true
//! bits per value, perplexity, its change against the plain run, KL and
//! top-1 agreement, written as Markdown, JSON and an SVG plot of ΔPPL
//! against bits per value with llama.cpp's cache types drawn for reference.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use plotters::prelude::*;
use serde::Serialize;

use crate::error::Result;
use crate::metrics::RunMetrics;

/// The configurations of `kv-eval frontier` by default (each a
/// [`CacheMode::parse`](crate::cache::CacheMode::parse) spelling): the
/// integer forms of part one, KIVI, rotations, Lloyd-Max, QJL, vector
/// quantization, sinks and per-layer policies.
pub const PRESET: &[&str] = &[
    "int8",
    "fp8-e4m3-tok",
    "int4",
    "int4-sym-g32",
    "nf4",
    "int4-g32",
    "int4-ch",
    "int4-ch/int4",
    "int4+rot",
    "lm4",
    "int4-ch+sink4/int4",
    "int4-ch+sink4/lm4",
    "int4-ch+sink4/lm4+sink4",
    "int4-ch+sink4/lm3",
    "int4-ch32+win32/int4+win32",
    "lm3",
    "lm3+qjl",
    "int3-ch+sink4/lm3",
    "int4-ch+sink4/vq",
    "int3-ch+sink4/vq",
    "int3-ch+sink4/lm2",
    "lm2",
    "vq",
    "int2-ch32+win32/int2-g32+win32",
    "0,last:fp16;*:int4-ch+sink4/lm3",
    "0,last:int8;*:int3-ch+sink4/vq",
];

/// The falsification table of the low-rank subspace paper (section 4.1):
/// SubSpace-G by rank and by energy, keys only and values only, before
/// and after RoPE, f16 and int8 coefficients, SubSpace-A with sketches of
/// 2r and 3r rows and chunks of 64, 128 and 256 tokens, and the integer
/// forms of about the same bytes.
pub const LOWRANK_PRESET: &[&str] = &[
    "int8",
    "int4",
    "int4-ch",
    "pca-r64",
    "pca-r48",
    "pca-r32",
    "pca-r16",
    "pca-e0.99",
    "pca-e0.999",
    "pca-r48/fp16",
    "pca-r32/fp16",
    "pca-r16/fp16",
    "fp16/pca-r48",
    "fp16/pca-r32",
    "fp16/pca-r16",
    "pca-r48-pre/fp16",
    "pca-r32-pre/fp16",
    "pca-r48-c8",
    "pca-r32-c8",
    "pca-r48-c4",
    "fd-r32-l64-t2",
    "fd-r32-l128-t2",
    "fd-r32-l256-t2",
    "fd-r32-m96-l128-t2",
    "fd-r48-l128-t2",
    "fd-r32-l128-t2/fp16",
    "fp16/fd-r32-l128-t2",
];

/// llama.cpp's own KV cache types on the default model, corpus and
/// llama.cpp's method at context 256 (llama.cpp b4748, flash attention,
/// against its f16 cache at PPL 10.5469): `(type, bits per value, ΔPPL %)`.
pub const LLAMA_CPP_CTX256: [(&str, f64, f64); 2] = [("q8_0", 8.5, 0.21), ("q4_0", 4.5, 22.3)];

/// One configuration at one context length.
#[derive(Clone, Debug, Serialize)]
pub struct FrontierPoint {
    /// The configuration's spelling.
    pub config: String,
    /// Context length.
    pub ctx: usize,
    /// True stored bits per K/V value (metadata and codebooks included).
    pub bits_per_value: f64,
    /// Bits per key value.
    pub key_bits: f64,
    /// Bits per value-cache value.
    pub value_bits: f64,
    /// The codebooks' share of `bits_per_value`.
    pub codebook_bits: f64,
    /// Perplexity.
    pub ppl: f64,
    /// Change of perplexity against the plain run, percent.
    pub delta_ppl_percent: f64,
    /// Mean KL from the plain run (nats).
    pub kl: f64,
    /// Top-1 agreement with the plain run.
    pub top1_agreement: f64,
    /// Every metric of the run.
    pub metrics: RunMetrics,
}

/// The frontier over several context lengths.
#[derive(Clone, Debug, Serialize)]
pub struct FrontierReport {
    /// Model file.
    pub model: String,
    /// Corpus file.
    pub text: String,
    /// `llamacpp` or `sliding/<stride>`.
    pub method: String,
    /// Corpus tokens used.
    pub tokens: usize,
    /// Calibration text of the codebook forms.
    pub calibration: String,
    /// The plain run per context length.
    pub plain: Vec<(usize, RunMetrics)>,
    /// Every configuration at every context length.
    pub points: Vec<FrontierPoint>,
}

impl FrontierPoint {
    /// A point from a run and the plain run of the same context.
    pub fn new(config: &str, ctx: usize, m: RunMetrics, plain: &RunMetrics) -> Self {
        Self {
            config: config.to_string(),
            ctx,
            bits_per_value: m.stats.bits_per_value,
            key_bits: m.stats.key_bits_per_value,
            value_bits: m.stats.value_bits_per_value,
            codebook_bits: m.stats.codebook_bits_per_value,
            ppl: m.ppl,
            delta_ppl_percent: 100.0 * (m.ppl / plain.ppl - 1.0),
            kl: m.kl_mean,
            top1_agreement: m.top1_agreement,
            metrics: m,
        }
    }

    /// Whether `other` has no more bits and no higher ΔPPL, and is better in one.
    pub fn dominated_by(&self, bits: f64, delta: f64) -> bool {
        bits <= self.bits_per_value
            && delta <= self.delta_ppl_percent
            && (bits < self.bits_per_value || delta < self.delta_ppl_percent)
    }

    /// Whether this point has no more bits and no higher ΔPPL than a point
    /// at `(bits, delta)`, and is better in one.
    pub fn dominates(&self, bits: f64, delta: f64) -> bool {
        self.bits_per_value <= bits
            && self.delta_ppl_percent <= delta
            && (self.bits_per_value < bits || self.delta_ppl_percent < delta)
    }
}

impl FrontierReport {
    fn contexts(&self) -> Vec<usize> {
        self.plain.iter().map(|p| p.0).collect()
    }

    /// The points of one context, by bits per value.
    pub fn at(&self, ctx: usize) -> Vec<&FrontierPoint> {
        let mut pts: Vec<&FrontierPoint> = self.points.iter().filter(|p| p.ctx == ctx).collect();
        pts.sort_by(|a, b| a.bits_per_value.total_cmp(&b.bits_per_value));
        pts
    }

    /// The points no other point of the same context dominates.
    pub fn pareto(&self, ctx: usize) -> Vec<&FrontierPoint> {
        let pts = self.at(ctx);
        pts.iter()
            .filter(|p| {
                !pts.iter()
                    .any(|q| p.dominated_by(q.bits_per_value, q.delta_ppl_percent))
            })
            .copied()
            .collect()
    }

    /// The best ΔPPL at or below `bits` bits per value.
    pub fn best_under(&self, ctx: usize, bits: f64) -> Option<&FrontierPoint> {
        self.at(ctx)
            .into_iter()
            .filter(|p| p.bits_per_value <= bits && p.delta_ppl_percent.is_finite())
            .min_by(|a, b| a.delta_ppl_percent.total_cmp(&b.delta_ppl_percent))
    }

    /// The Markdown report: one table per context, Pareto points in bold.
    pub fn markdown(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "# Quality against bytes\n\nmodel `{}`, text `{}` (first {} tokens), {} method; codebooks fitted on {}. \
             ΔPPL against the plain (f32) run of the same context; bits per value count every stored \
             byte (scales, offsets, gains, codebooks amortised over one sequence).",
            self.model, self.text, self.tokens, self.method, self.calibration
        );
        for (ctx, plain) in &self.plain {
            let pareto: Vec<String> = self.pareto(*ctx).iter().map(|p| p.config.clone()).collect();
            let _ = writeln!(
                s,
                "\n## Context {ctx}\n\nplain PPL {:.4} over {} predictions.\n\n\
                 | configuration | bits/value | K bits | V bits | PPL | ΔPPL | KL | top-1 agreement |\n\
                 |---|---|---|---|---|---|---|---|",
                plain.ppl, plain.tokens_scored
            );
            for p in self.at(*ctx) {
                let name = if pareto.contains(&p.config) {
                    format!("**{}**", p.config)
                } else {
                    p.config.clone()
                };
                let _ = writeln!(
                    s,
                    "| {name} | {:.3} | {:.3} | {:.3} | {:.4} | {:+.2}% | {:.4} | {:.2}% |",
                    p.bits_per_value,
                    p.key_bits,
                    p.value_bits,
                    p.ppl,
                    p.delta_ppl_percent,
                    p.kl,
                    100.0 * p.top1_agreement
                );
            }
            if *ctx == 256 {
                let mut verdicts = Vec::new();
                for (name, bits, delta) in LLAMA_CPP_CTX256 {
                    let beaten = self
                        .at(*ctx)
                        .iter()
                        .filter(|p| p.dominates(bits, delta))
                        .min_by(|a, b| a.delta_ppl_percent.total_cmp(&b.delta_ppl_percent))
                        .map_or("nothing".to_string(), |p| {
                            format!(
                                "{} ({:.3} bits, {:+.2}%)",
                                p.config, p.bits_per_value, p.delta_ppl_percent
                            )
                        });
                    let _ = writeln!(
                        s,
                        "| llama.cpp `{name}` (reference, its own run) | {bits} | | | | {delta:+.2}% | | |",
                    );
                    verdicts.push(format!("llama.cpp `{name}` is dominated by: {beaten}."));
                }
                let _ = writeln!(s, "\n{}", verdicts.join("\n"));
            }
        }
        s
    }

    /// Writes `frontier.md`, `frontier.json` and `frontier.svg` into `dir`.
    pub fn write(&self, dir: &Path) -> Result<Vec<PathBuf>> {
        let plot = |path: &Path| self.plot(path);
        crate::report_files::write(dir, "frontier", &self.markdown(), Some(self), Some(&plot))
    }

    fn plot(&self, path: &Path) -> std::result::Result<(), Box<dyn std::error::Error>> {
        let contexts = self.contexts();
        let width = 640 * contexts.len().max(1) as u32;
        let root = SVGBackend::new(path, (width, 560)).into_drawing_area();
        root.fill(&WHITE)?;
        let panels = root.split_evenly((1, contexts.len().max(1)));
        // ΔPPL on a log axis from 0.01% (smaller or negative changes sit at the floor).
        let floor = 0.01f64;
        let y = |d: f64| d.max(floor).log10();
        for (area, ctx) in panels.iter().zip(&contexts) {
            let pts = self.at(*ctx);
            let max_bits = pts.iter().map(|p| p.bits_per_value).fold(9.0f64, f64::max);
            let max_delta = pts
                .iter()
                .map(|p| p.delta_ppl_percent)
                .filter(|d| d.is_finite())
                .fold(30.0f64, f64::max)
                .min(1e4);
            let mut chart = ChartBuilder::on(area)
                .caption(
                    format!("ΔPPL against bits per value, context {ctx}"),
                    ("sans-serif", 18),
                )
                .margin(14)
                .x_label_area_size(40)
                .y_label_area_size(60)
                .build_cartesian_2d(0.0..max_bits + 0.5, y(floor)..y(max_delta) + 0.2)?;
            chart
                .configure_mesh()
                .x_desc("bits per value (true bytes)")
                .y_desc("ΔPPL % (log)")
                .y_label_formatter(&|v| format!("{:.2}", 10f64.powf(*v)))
                .draw()?;
            let pareto: Vec<String> = self.pareto(*ctx).iter().map(|p| p.config.clone()).collect();
            for p in &pts {
                let at = (p.bits_per_value, y(p.delta_ppl_percent.min(max_delta)));
                let label = (p.config.clone(), (0.08, 0.0), 10);
                labelled_point(&mut chart, at, label, pareto.contains(&p.config))?;
            }
            let mut front: Vec<(f64, f64)> = self
                .pareto(*ctx)
                .iter()
                .map(|p| (p.bits_per_value, y(p.delta_ppl_percent)))
                .collect();
            front.sort_by(|a, b| a.0.total_cmp(&b.0));
            chart.draw_series(LineSeries::new(front, BLUE.stroke_width(1)))?;
            if *ctx == 256 {
                for (name, bits, delta) in LLAMA_CPP_CTX256 {
                    let at = (bits, y(delta));
                    chart.draw_series(std::iter::once(TriangleMarker::new(at, 7, RED.filled())))?;
                    chart.draw_series(std::iter::once(Text::new(
                        format!("llama.cpp {name}"),
                        (at.0 + 0.1, at.1 + 0.05),
                        ("sans-serif", 12).into_font().color(&RED),
                    )))?;
                }
            }
        }
        root.present()?;
        Ok(())
    }
}

/// A chart of ΔPPL (log) against bits per value.
pub(crate) type BitsChart<'a, 'b> = ChartContext<
    'a,
    SVGBackend<'b>,
    Cartesian2d<plotters::coord::types::RangedCoordf64, plotters::coord::types::RangedCoordf64>,
>;

/// One point of a frontier plot and its label (text, offset from the
/// point, font size): blue on the Pareto front, grey off it.
pub(crate) fn labelled_point(
    chart: &mut BitsChart<'_, '_>,
    at: (f64, f64),
    (label, (dx, dy), size): (String, (f64, f64), u32),
    on_front: bool,
) -> std::result::Result<(), Box<dyn std::error::Error>> {
    let color = if on_front {
        BLUE
    } else {
        RGBColor(120, 120, 120)
    };
    chart.draw_series(std::iter::once(Circle::new(at, 4, color.filled())))?;
    chart.draw_series(std::iter::once(Text::new(
        label,
        (at.0 + dx, at.1 + dy),
        ("sans-serif", size).into_font().color(&color),
    )))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::CacheMode;

    fn point(config: &str, bits: f64, delta: f64) -> FrontierPoint {
        let mut m = RunMetrics::default();
        m.stats.bits_per_value = bits;
        m.ppl = 10.0 * (1.0 + delta / 100.0);
        let plain = RunMetrics {
            ppl: 10.0,
            ..RunMetrics::default()
        };
        FrontierPoint::new(config, 256, m, &plain)
    }

    #[test]
    fn pareto_points_and_best_under_a_budget() {
        let report = FrontierReport {
            model: "m".into(),
            text: "t".into(),
            method: "llamacpp".into(),
            tokens: 1,
            calibration: "c".into(),
            plain: vec![(
                256,
                RunMetrics {
                    ppl: 10.0,
                    ..RunMetrics::default()
                },
            )],
            points: vec![
                point("a", 8.0, 0.1),
                point("b", 4.0, 3.0),
                point("c", 4.5, 5.0),
                point("d", 2.0, 12.0),
            ],
        };
        let front: Vec<&str> = report
            .pareto(256)
            .iter()
            .map(|p| p.config.as_str())
            .collect();
        assert_eq!(front, ["d", "b", "a"]);
        assert_eq!(report.best_under(256, 4.2).unwrap().config, "b");
        assert!(report.best_under(256, 1.0).is_none());
        approx::assert_abs_diff_eq!(report.points[1].delta_ppl_percent, 3.0, epsilon = 1e-9);
        let md = report.markdown();
        assert!(md.contains("**b**") && md.contains("| c |"), "{md}");
        assert!(md.contains("llama.cpp `q4_0` is dominated by: b"), "{md}");
        assert!(md.contains("llama.cpp `q8_0` is dominated by: a"), "{md}");
        // The reference rows stay inside the table: the line before each is a row.
        let lines: Vec<&str> = md.lines().collect();
        for (i, line) in lines.iter().enumerate() {
            if line.starts_with("| llama.cpp") {
                assert!(lines[i - 1].starts_with('|'), "{md}");
            }
        }
    }

    #[test]
    fn every_preset_parses() {
        for config in PRESET.iter().chain(LOWRANK_PRESET) {
            CacheMode::parse(config).unwrap_or_else(|e| panic!("{config}: {e}"));
        }
    }
}
