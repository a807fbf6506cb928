//! The spectra of the KV cache (`kv-eval lowrank-report`): per layer and KV
//! head, the eigenvalues of the covariance of keys before RoPE, keys after
//! RoPE and values over calibration rows, and the rank that retains 90%,
//! 99% and 99.9% of the energy; written as Markdown, JSON and an SVG plot
//! of the 90% and 99% ranks per layer.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use kv_lowrank::{Basis, BasisStorage};
use kv_quant::RankRule;
use plotters::prelude::*;
use rayon::prelude::*;
use serde::Serialize;

use crate::calibration::{CalibrationRows, Part};
use crate::error::Result;
use kv_model::model::CausalLm;

/// Which rows a spectrum is of.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum RowKind {
    /// Keys with RoPE undone.
    KeyPreRope,
    /// Keys as cached (after RoPE).
    KeyPostRope,
    /// Values.
    Value,
}

impl RowKind {
    /// Every kind, in table order.
    pub const ALL: [RowKind; 3] = [RowKind::KeyPreRope, RowKind::KeyPostRope, RowKind::Value];

    /// A short label.
    pub fn label(self) -> &'static str {
        match self {
            RowKind::KeyPreRope => "K pre-RoPE",
            RowKind::KeyPostRope => "K post-RoPE",
            RowKind::Value => "V",
        }
    }
}

/// The spectrum of one head.
#[derive(Clone, Debug, Serialize)]
pub struct HeadSpectrum {
    /// Layer.
    pub layer: usize,
    /// KV head.
    pub head: usize,
    /// Rows.
    pub kind: RowKind,
    /// Ranks retaining 90%, 99% and 99.9% of the energy.
    pub ranks: [usize; 3],
    /// Eigenvalues over their sum, largest first.
    pub normalized: Vec<f64>,
}

/// Every head's spectra.
#[derive(Clone, Debug, Serialize)]
pub struct LowRankReport {
    /// The model's description.
    pub model: String,
    /// Where the rows came from.
    pub text: String,
    /// Rows per head.
    pub tokens: usize,
    /// Channels per head.
    pub head_dim: usize,
    /// Layers.
    pub layers: usize,
    /// KV heads.
    pub heads: usize,
    /// The spectra, layer-major.
    pub spectra: Vec<HeadSpectrum>,
}

impl LowRankReport {
    /// Spectra of every layer, head and kind over `rows`.
    pub fn compute(model: &dyn CausalLm, rows: &CalibrationRows, text: &str) -> Result<Self> {
        let d = model.head_dim();
        let heads = model.kv_channels() / d;
        let jobs: Vec<(usize, usize, RowKind)> = (0..model.layers())
            .flat_map(|l| (0..heads).flat_map(move |h| RowKind::ALL.map(|k| (l, h, k))))
            .collect();
        let spectra = jobs
            .into_par_iter()
            .map(|(layer, head, kind)| {
                let (part, rope) = match kind {
                    RowKind::KeyPreRope => (Part::Key, model.rope()),
                    RowKind::KeyPostRope => (Part::Key, None),
                    RowKind::Value => (Part::Value, None),
                };
                let data = rows.head_rows(layer, part, head, d, rope)?;
                let (_, spectrum) =
                    Basis::fit(&data, rows.tokens, d, RankRule::Fixed(1), BasisStorage::F16)?;
                let total: f64 = spectrum
                    .eigenvalues
                    .iter()
                    .sum::<f64>()
                    .max(f64::MIN_POSITIVE);
                Ok(HeadSpectrum {
                    layer,
                    head,
                    kind,
                    ranks: [0.9, 0.99, 0.999].map(|e| spectrum.rank_for_energy(e)),
                    normalized: spectrum.eigenvalues.iter().map(|l| l / total).collect(),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            model: model.describe(),
            text: text.to_string(),
            tokens: rows.tokens,
            head_dim: d,
            layers: model.layers(),
            heads,
            spectra,
        })
    }

    fn mean_rank(&self, layer: usize, kind: RowKind, level: usize) -> f64 {
        let r: Vec<usize> = self
            .spectra
            .iter()
            .filter(|s| s.layer == layer && s.kind == kind)
            .map(|s| s.ranks[level])
            .collect();
        r.iter().sum::<usize>() as f64 / r.len().max(1) as f64
    }

    /// The Markdown report: a summary per layer (mean over heads) and the
    /// full table per head.
    pub fn markdown(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "# Ranks of the KV cache\n\nmodel `{}`, {} rows of `{}` per head, heads of {} channels: \
             the rank retaining 90 / 99 / 99.9% of each head's energy (eigenvalues of the centred covariance).\n",
            self.model, self.tokens, self.text, self.head_dim
        );
        let _ = writeln!(
            s,
            "| layer | K pre-RoPE | K post-RoPE | V |\n|---|---|---|---|"
        );
        for l in 0..self.layers {
            let cell = |k| {
                format!(
                    "{:.1} / {:.1} / {:.1}",
                    self.mean_rank(l, k, 0),
                    self.mean_rank(l, k, 1),
                    self.mean_rank(l, k, 2)
                )
            };
            let _ = writeln!(
                s,
                "| {l} | {} | {} | {} |",
                cell(RowKind::KeyPreRope),
                cell(RowKind::KeyPostRope),
                cell(RowKind::Value)
            );
        }
        let mean_over = |k: RowKind, level: usize| {
            (0..self.layers)
                .map(|l| self.mean_rank(l, k, level))
                .sum::<f64>()
                / self.layers.max(1) as f64
        };
        let _ = writeln!(
            s,
            "| all | {:.1} / {:.1} / {:.1} | {:.1} / {:.1} / {:.1} | {:.1} / {:.1} / {:.1} |",
            mean_over(RowKind::KeyPreRope, 0),
            mean_over(RowKind::KeyPreRope, 1),
            mean_over(RowKind::KeyPreRope, 2),
            mean_over(RowKind::KeyPostRope, 0),
            mean_over(RowKind::KeyPostRope, 1),
            mean_over(RowKind::KeyPostRope, 2),
            mean_over(RowKind::Value, 0),
            mean_over(RowKind::Value, 1),
            mean_over(RowKind::Value, 2),
        );
        let _ = writeln!(
            s,
            "\n## Per head\n\n| layer | head | rows | r90 | r99 | r99.9 | top-4 eigenvalue shares |\n|---|---|---|---|---|---|---|"
        );
        for sp in &self.spectra {
            let top: Vec<String> = sp
                .normalized
                .iter()
                .take(4)
                .map(|v| format!("{v:.3}"))
                .collect();
            let _ = writeln!(
                s,
                "| {} | {} | {} | {} | {} | {} | {} |",
                sp.layer,
                sp.head,
                sp.kind.label(),
                sp.ranks[0],
                sp.ranks[1],
                sp.ranks[2],
                top.join(", ")
            );
        }
        s
    }

    /// Writes `lowrank.md`, `lowrank.json` and `lowrank.svg` into `dir`.
    pub fn write(&self, dir: &Path) -> Result<Vec<PathBuf>> {
        let plot = |path: &Path| self.plot(path);
        crate::report_files::write(dir, "lowrank", &self.markdown(), Some(self), Some(&plot))
    }

    fn plot(&self, path: &Path) -> std::result::Result<(), Box<dyn std::error::Error>> {
        let root = SVGBackend::new(path, (900, 520)).into_drawing_area();
        root.fill(&WHITE)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(
                format!(
                    "rank for 90% (thin) and 99% (thick) of the energy, heads of {}",
                    self.head_dim
                ),
                ("sans-serif", 18),
            )
            .margin(14)
            .x_label_area_size(40)
            .y_label_area_size(50)
            .build_cartesian_2d(
                -0.5f64..self.layers as f64 - 0.5,
                0f64..self.head_dim as f64 + 1.0,
            )?;
        chart
            .configure_mesh()
            .x_desc("layer")
            .y_desc("rank (mean over heads)")
            .draw()?;
        for (i, kind) in RowKind::ALL.into_iter().enumerate() {
            let color = Palette99::pick(i).to_rgba();
            for (level, width) in [(1usize, 2u32), (0, 1)] {
                let pts: Vec<(f64, f64)> = (0..self.layers)
                    .map(|l| (l as f64, self.mean_rank(l, kind, level)))
                    .collect();
                let series = chart.draw_series(LineSeries::new(pts, color.stroke_width(width)))?;
                if level == 1 {
                    series
                        .label(kind.label())
                        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], color));
                }
            }
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()?;
        root.present()?;
        Ok(())
    }
}
