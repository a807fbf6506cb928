//! V-ABFT row checks of a model's linear layers, `out = x · wᵀ`, with the
//! weight side prepared once: a model multiplies the same weights for every
//! token, so Σₙ B_kn and the statistics of B's rows (`B = wᵀ`, so w's
//! columns) are computed when checking is switched on, and each product then
//! costs its checks O(t·(K + N)) beside the GEMM's O(t·K·N).

use rayon::prelude::*;

use crate::error::{AbftError, Result};
use crate::gemm::{dot_f64, sum_f64};
use crate::matrix::Matrix;
use crate::threshold::{BSums, VAbft, col_stats, stats_of_row};

/// A weight matrix prepared for V-ABFT row checks of `x · wᵀ`.
#[derive(Clone, Debug)]
pub struct CheckedLinear {
    /// `Σₙ w[n][k]` for each input channel k (B's row sums).
    b_rows: Vec<f64>,
    /// V-ABFT's sums over B's row statistics.
    sums: BSums,
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
    pub fn new(w: &Matrix, rule: &VAbft) -> Self {
        let b_rows = (0..w.cols)
            .into_par_iter()
            .map(|k| (0..w.rows).map(|n| f64::from(w.at(n, k))).sum())
            .collect();
        Self {
            b_rows,
            sums: rule.b_sums(&col_stats(w)),
            outputs: w.rows,
        }
    }

    /// Row checks of `out = x · wᵀ` (`x`: t rows of the inputs, `out`: t
    /// rows of the outputs, the product alone, without any residual).
    pub fn verify(&self, rule: &VAbft, x: &[f32], out: &[f32]) -> Result<LinearVerdict> {
        let flags = self.flags(rule, x, out)?;
        Ok(LinearVerdict {
            rows: flags.len() as u64,
            flagged: flags.iter().filter(|&&f| f).count() as u64,
        })
    }

    /// [`verify`](Self::verify), row by row: whether each row's check fired.
    pub fn flags(&self, rule: &VAbft, x: &[f32], out: &[f32]) -> Result<Vec<bool>> {
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
            .map(|(xr, cr)| {
                let residual = (sum_f64(cr) - dot_f64(xr, &self.b_rows)).abs();
                let bound = rule.bound(&stats_of_row(xr, rule.sampling), &self.sums, self.outputs);
                // A NaN or infinite residual is always an alarm.
                !matches!(
                    residual.partial_cmp(&bound),
                    Some(std::cmp::Ordering::Less | std::cmp::Ordering::Equal)
                )
            })
            .take(t)
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::check::verify_rows;
    use crate::matrix::Distribution;
    use crate::precision::Precision;

    /// The prepared check flags exactly the rows `verify_rows` flags on
    /// the same product, clean and with one element corrupted.
    #[test]
    fn prepared_checks_equal_the_general_ones() {
        let rule = VAbft::design(Precision::Fp32.e_max_ascend());
        let x = Matrix::random(6, 64, Distribution::NormalMeanOne, 1.0, Precision::Fp32, 1);
        let w = Matrix::random(48, 64, Distribution::Uniform, 1.0, Precision::Fp32, 2);
        let mut out = vec![0.0; 6 * 48];
        crate::gemm::linear_into(&mut out, &x.data, &w, false).unwrap();
        let checked = CheckedLinear::new(&w, &rule);
        let wt = w.transpose();
        for corrupt in [None, Some((3, 7, 1e3f32))] {
            let mut c = out.clone();
            if let Some((r, n, d)) = corrupt {
                c[r * 48 + n] += d;
            }
            let v = checked.verify(&rule, &x.data, &c).unwrap();
            let general = verify_rows(&x, &wt, &Matrix::new(6, 48, c.clone()).unwrap(), &rule);
            assert_eq!(v.flagged as usize, general.flagged.len(), "{corrupt:?}");
            assert_eq!(v.rows, 6);
            assert_eq!(v.flagged, u64::from(corrupt.is_some()));
        }
        assert!(checked.verify(&rule, &x.data[1..], &out).is_err());
    }
}
