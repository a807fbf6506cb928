//! Row checks of a model's linear layers, `out = x · wᵀ`, with the weight
//! side prepared once: a model multiplies the same weights for every token,
//! so what the rule needs of `B = wᵀ` (Σₙ B_kn for the checksum; the
//! statistics of B's rows for V-ABFT, their largest magnitudes for A-ABFT)
//! is computed when checking is switched on, and each product then costs its
//! checks O(t·(K + N)) beside the GEMM's O(t·K·N).

use rayon::prelude::*;

use crate::error::{AbftError, Result};
use crate::gemm::{dot_f64, sum_f64};
use crate::matrix::Matrix;
use crate::threshold::{AAbft, BSums, FixedThreshold, Threshold, VAbft, col_stats, stats_of_row};

/// The threshold a [`CheckedLinear`] applies to each row check.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum LinearRule {
    /// V-ABFT: a bound from the statistics of the row of `x` and of `w`.
    VAbft(VAbft),
    /// A-ABFT: a bound from the largest magnitudes of the row of `x`, of
    /// `w` and of the product row.
    AAbft(AAbft),
    /// The fixed relative tolerance `τ·Σₙ|out_n|`.
    Fixed(FixedThreshold),
}

impl LinearRule {
    /// Name for reports.
    pub fn name(&self) -> String {
        match self {
            Self::VAbft(r) => r.name(),
            Self::AAbft(r) => r.name(),
            Self::Fixed(r) => r.name(),
        }
    }
}

impl From<VAbft> for LinearRule {
    fn from(rule: VAbft) -> Self {
        Self::VAbft(rule)
    }
}

impl From<AAbft> for LinearRule {
    fn from(rule: AAbft) -> Self {
        Self::AAbft(rule)
    }
}

impl From<FixedThreshold> for LinearRule {
    fn from(rule: FixedThreshold) -> Self {
        Self::Fixed(rule)
    }
}

/// A weight matrix prepared for the row checks of `x · wᵀ` under one rule.
#[derive(Clone, Debug)]
pub struct CheckedLinear {
    rule: LinearRule,
    /// `Σₙ w[n][k]` for each input channel k (B's row sums).
    b_rows: Vec<f64>,
    /// V-ABFT's sums over B's row statistics (V-ABFT only).
    sums: BSums,
    /// `maxₙ |w[n][k]|` for each input channel k (A-ABFT only).
    b_max: Vec<f64>,
    /// `max |w|` (A-ABFT only).
    max_b: f64,
    /// Output channels (B's columns, the N of the bound).
    outputs: usize,
}

/// What the row checks of one product found.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LinearVerdict {
    /// Rows (tokens) checked.
    pub rows: u64,
    /// Rows whose checksum residual exceeded the bound (or was not finite).
    pub flagged: u64,
}

impl CheckedLinear {
    /// Prepares `w` (`outputs × inputs`) for `rule`.
    pub fn new(w: &Matrix, rule: impl Into<LinearRule>) -> Self {
        let rule = rule.into();
        let b_rows = (0..w.cols)
            .into_par_iter()
            .map(|k| (0..w.rows).map(|n| f64::from(w.at(n, k))).sum())
            .collect();
        let (sums, b_max) = match &rule {
            LinearRule::VAbft(v) => (v.b_sums(&col_stats(w)), Vec::new()),
            LinearRule::AAbft(_) => (
                BSums::default(),
                (0..w.cols)
                    .into_par_iter()
                    .map(|k| (0..w.rows).fold(0.0f64, |m, n| m.max(f64::from(w.at(n, k)).abs())))
                    .collect(),
            ),
            LinearRule::Fixed(_) => (BSums::default(), Vec::new()),
        };
        let max_b = b_max.iter().copied().fold(0.0, f64::max);
        Self {
            rule,
            b_rows,
            sums,
            b_max,
            max_b,
            outputs: w.rows,
        }
    }

    /// The rule this layer was prepared for.
    pub fn rule(&self) -> &LinearRule {
        &self.rule
    }

    /// Row checks of `out = x · wᵀ` (`x`: t rows of the inputs, `out`: t
    /// rows of the outputs, the product alone, without any residual).
    pub fn verify(&self, x: &[f32], out: &[f32]) -> Result<LinearVerdict> {
        let flags = self.flags(x, out)?;
        Ok(LinearVerdict {
            rows: flags.len() as u64,
            flagged: flags.iter().filter(|&&f| f).count() as u64,
        })
    }

    /// [`verify`](Self::verify), row by row: whether each row's check fired.
    pub fn flags(&self, x: &[f32], out: &[f32]) -> Result<Vec<bool>> {
        let k = self.b_rows.len();
        let t = x.len().checked_div(k).unwrap_or(0);
        if t * k != x.len() || out.len() != t * self.outputs {
            return Err(AbftError::Shape(format!(
                "{} inputs and {} outputs for a checked {}×{k} layer",
                x.len(),
                out.len(),
                self.outputs
            )));
        }
        Ok(x.par_chunks(k.max(1))
            .zip(out.par_chunks(self.outputs.max(1)))
            .map(|(xr, cr)| !self.passes(xr, cr))
            .take(t)
            .collect())
    }

    /// Whether one row's checksum residual is within the rule's bound. A NaN
    /// or infinite residual is always an alarm, also against a bound that
    /// the same non-finite output made infinite (A-ABFT, fixed).
    fn passes(&self, xr: &[f32], cr: &[f32]) -> bool {
        let residual = (sum_f64(cr) - dot_f64(xr, &self.b_rows)).abs();
        residual.is_finite() && residual <= self.row_bound(xr, cr)
    }

    /// The rule's bound for one row (`xr` its inputs, `cr` its outputs).
    fn row_bound(&self, xr: &[f32], cr: &[f32]) -> f64 {
        let max_abs = |v: &[f32]| v.iter().fold(0.0f64, |m, &x| m.max(f64::from(x).abs()));
        match &self.rule {
            LinearRule::VAbft(r) => {
                r.bound(&stats_of_row(xr, r.sampling), &self.sums, self.outputs)
            }
            LinearRule::AAbft(r) => {
                let check1: f64 = xr
                    .iter()
                    .zip(&self.b_max)
                    .map(|(&x, m)| f64::from(x).abs() * m)
                    .sum();
                r.terms(
                    self.outputs,
                    xr.len(),
                    max_abs(cr),
                    check1,
                    max_abs(xr),
                    self.max_b,
                )
                .iter()
                .sum()
            }
            LinearRule::Fixed(r) => r.tau * cr.iter().map(|&v| f64::from(v).abs()).sum::<f64>(),
        }
    }
}

impl CheckedLinear {
    /// Corrects the flagged rows `rows` of `out = x · wᵀ`, assuming one
    /// corrupted element per row and no two in one column: a row's error
    /// `δ_r = Σₙ C_rn − Σₖ x_rk·Σₙ w_nk` shows up in exactly one column
    /// checksum (`Σₘ C_mn − Σₖ (Σₘ x_mk)·w_nk`, in f64), and that column is
    /// the one whose residual is nearest `δ_r` (for a non-finite element,
    /// the row's non-finite column). The element is rewritten as
    /// `expected_r − Σ_{n≠q} C_rn`, so a huge or non-finite value never
    /// enters the sum. Rows whose rewrite would not pass their check stay
    /// as they were. Returns how many rows were corrected.
    pub fn correct_rows(
        &self,
        x: &[f32],
        w: &Matrix,
        out: &mut [f32],
        rows: &[usize],
    ) -> Result<usize> {
        let (k, n) = (self.b_rows.len(), self.outputs);
        let t = x.len().checked_div(k).unwrap_or(0);
        if t * k != x.len()
            || out.len() != t * n
            || rows.iter().any(|&r| r >= t)
            || (w.rows, w.cols) != (n, k)
        {
            return Err(AbftError::Shape(format!(
                "rows {rows:?} of {t}: {} inputs, {} outputs for a {}×{} layer checked as {n}×{k}",
                x.len(),
                out.len(),
                w.rows,
                w.cols
            )));
        }
        let mut x_cols = vec![0.0f64; k];
        for r in x.chunks_exact(k) {
            for (s, &v) in x_cols.iter_mut().zip(r) {
                *s += f64::from(v);
            }
        }
        let mut col_residual: Vec<f64> = (0..n)
            .into_par_iter()
            .map(|col| {
                let observed: f64 = (0..t).map(|m| f64::from(out[m * n + col])).sum();
                let expected: f64 = w
                    .row(col)
                    .iter()
                    .zip(&x_cols)
                    .map(|(&a, b)| f64::from(a) * b)
                    .sum();
                observed - expected
            })
            .collect();
        let mut corrected = 0;
        for &r in rows {
            let xr = &x[r * k..][..k];
            let expected = dot_f64(xr, &self.b_rows);
            let cr = &mut out[r * n..][..n];
            let delta = sum_f64(cr) - expected;
            let q = match cr.iter().position(|v| !v.is_finite()) {
                Some(q) => q,
                None => {
                    let mut best = (f64::INFINITY, 0);
                    for (q, &c) in col_residual.iter().enumerate() {
                        let d = (c - delta).abs();
                        if d < best.0 {
                            best = (d, q);
                        }
                    }
                    best.1
                }
            };
            let was = cr[q];
            let others: f64 = cr
                .iter()
                .enumerate()
                .filter(|&(i, _)| i != q)
                .map(|(_, &v)| f64::from(v))
                .sum();
            cr[q] = (expected - others) as f32;
            if cr[q].is_finite() && self.passes(xr, cr) {
                col_residual[q] -= f64::from(was) - f64::from(cr[q]);
                corrected += 1;
            } else {
                cr[q] = was;
            }
        }
        Ok(corrected)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::check::verify_rows;
    use crate::matrix::Distribution;
    use crate::precision::Precision;

    /// The three rules the model's checks can use.
    fn rules() -> [LinearRule; 3] {
        [
            VAbft::design(Precision::Fp32.e_max_ascend()).into(),
            AAbft::for_precision(Precision::Fp32).into(),
            FixedThreshold { tau: 1e-3 }.into(),
        ]
    }

    /// The general rule behind a prepared one.
    fn general(rule: &LinearRule) -> &dyn Threshold {
        match rule {
            LinearRule::VAbft(r) => r,
            LinearRule::AAbft(r) => r,
            LinearRule::Fixed(r) => r,
        }
    }

    /// For every rule, the prepared check flags exactly the rows
    /// `verify_rows` flags on the same product, clean and with one element
    /// corrupted, and its bounds equal the general ones to rounding.
    #[test]
    fn prepared_checks_equal_the_general_ones() {
        let x = Matrix::random(6, 64, Distribution::NormalMeanOne, 1.0, Precision::Fp32, 1);
        let w = Matrix::random(48, 64, Distribution::Uniform, 1.0, Precision::Fp32, 2);
        let mut out = vec![0.0; 6 * 48];
        crate::gemm::linear_into(&mut out, &x.data, &w, false).unwrap();
        let wt = w.transpose();
        for rule in rules() {
            let checked = CheckedLinear::new(&w, rule);
            for corrupt in [None, Some((3, 7, 1e3f32))] {
                let mut c = out.clone();
                if let Some((r, n, d)) = corrupt {
                    c[r * 48 + n] += d;
                }
                let cm = Matrix::new(6, 48, c.clone()).unwrap();
                let v = checked.verify(&x.data, &c).unwrap();
                let verdict = verify_rows(&x, &wt, &cm, general(&rule));
                let name = rule.name();
                assert_eq!(
                    v.flagged as usize,
                    verdict.flagged.len(),
                    "{name} {corrupt:?}"
                );
                assert_eq!(v.rows, 6);
                assert_eq!(
                    v.flagged,
                    u64::from(corrupt.is_some()),
                    "{name} {corrupt:?}"
                );
                let bounds = general(&rule).rows(&x, &wt, &cm);
                for (r, want) in bounds.iter().enumerate() {
                    let got = checked.row_bound(&x.data[r * 64..][..64], &c[r * 48..][..48]);
                    approx::assert_relative_eq!(got, *want, max_relative = 1e-12);
                }
            }
            assert!(checked.verify(&x.data[1..], &out).is_err());
        }
    }

    /// A non-finite output is an alarm for every rule, also for the rules
    /// whose bound it makes infinite.
    #[test]
    fn a_non_finite_output_always_fires() {
        let x = Matrix::random(2, 32, Distribution::NormalMeanOne, 1.0, Precision::Fp32, 6);
        let w = Matrix::random(16, 32, Distribution::Uniform, 1.0, Precision::Fp32, 7);
        let mut out = vec![0.0; 2 * 16];
        crate::gemm::linear_into(&mut out, &x.data, &w, false).unwrap();
        for rule in rules() {
            let checked = CheckedLinear::new(&w, rule);
            for bad in [f32::INFINITY, f32::NEG_INFINITY, f32::NAN] {
                let mut c = out.clone();
                c[16 + 5] = bad;
                assert_eq!(
                    checked.flags(&x.data, &c).unwrap(),
                    [false, true],
                    "{}",
                    rule.name()
                );
            }
        }
    }

    /// One corrupted element, whatever its value (a large error, ∞, NaN),
    /// is found and rewritten to within rounding of the true product.
    #[test]
    fn one_corrupted_element_is_located_and_corrected() {
        for rule in rules() {
            corrects_under(rule);
        }
    }

    fn corrects_under(rule: LinearRule) {
        let x = Matrix::random(9, 64, Distribution::NormalMeanOne, 1.0, Precision::Fp32, 4);
        let w = Matrix::random(40, 64, Distribution::Uniform, 1.0, Precision::Fp32, 5);
        let mut out = vec![0.0; 9 * 40];
        crate::gemm::linear_into(&mut out, &x.data, &w, false).unwrap();
        let checked = CheckedLinear::new(&w, rule);
        for (r, q, bad) in [(2, 17, 1e4f32), (8, 0, f32::INFINITY), (0, 39, f32::NAN)] {
            let mut c = out.clone();
            c[r * 40 + q] = bad;
            let flags = checked.flags(&x.data, &c).unwrap();
            assert_eq!(flags.iter().filter(|&&f| f).count(), 1);
            assert!(flags[r]);
            assert_eq!(checked.correct_rows(&x.data, &w, &mut c, &[r]).unwrap(), 1);
            let true_value = out[r * 40 + q];
            assert!(
                (c[r * 40 + q] - true_value).abs() <= 1e-3 * true_value.abs().max(1.0),
                "{bad}"
            );
            assert!(checked.flags(&x.data, &c).unwrap().iter().all(|&f| !f));
        }
        // Three rows hit in three columns at once.
        let mut c = out.clone();
        c[40 + 3] += 50.0;
        c[4 * 40 + 20] = f32::INFINITY;
        c[7 * 40 + 33] -= 7.0;
        let flagged: Vec<usize> = (0..9)
            .filter(|&r| checked.flags(&x.data, &c).unwrap()[r])
            .collect();
        assert_eq!(flagged, [1, 4, 7]);
        assert_eq!(
            checked.correct_rows(&x.data, &w, &mut c, &flagged).unwrap(),
            3
        );
        for (a, b) in c.iter().zip(&out) {
            approx::assert_abs_diff_eq!(a, b, epsilon = 1e-3 * b.abs().max(1.0));
        }
        assert!(checked.correct_rows(&x.data, &w, &mut c, &[9]).is_err());
    }
}
