//! Verifying a product against its checksums, confirming sampled alarms
//! exactly, and, with row and column checks together, locating a single
//! corrupted element and correcting it from the checksum difference.

use std::cmp::Ordering;

use crate::gemm::{col_checksums, row_checksums};
use crate::matrix::Matrix;
use crate::precision::Precision;
use crate::threshold::{Threshold, VAbft};

/// The outcome of one set of checks.
#[derive(Clone, Debug, PartialEq)]
pub struct Verdict {
    /// `|observed − expected|` per check.
    pub residuals: Vec<f64>,
    /// The bound per check.
    pub thresholds: Vec<f64>,
    /// Checks whose residual exceeds the bound (or is not finite).
    pub flagged: Vec<usize>,
}

impl Verdict {
    fn new(residuals: Vec<f64>, thresholds: Vec<f64>) -> Self {
        let flagged = residuals
            .iter()
            .zip(&thresholds)
            .enumerate()
            // A NaN or infinite residual is always an alarm.
            .filter(|(_, (r, t))| {
                !matches!(r.partial_cmp(t), Some(Ordering::Less | Ordering::Equal))
            })
            .map(|(i, _)| i)
            .collect();
        Self {
            residuals,
            thresholds,
            flagged,
        }
    }

    /// Whether any check fired.
    pub fn fired(&self) -> bool {
        !self.flagged.is_empty()
    }
}

/// Row checks of `C ≟ A·B` under `threshold`.
pub fn verify_rows(a: &Matrix, b: &Matrix, c: &Matrix, threshold: &dyn Threshold) -> Verdict {
    let (sums, bounds) = threshold.rows_with_checksums(a, b, c);
    Verdict::new(sums.residuals(), bounds)
}

/// Column checks of `C ≟ A·B` under `threshold`.
pub fn verify_cols(a: &Matrix, b: &Matrix, c: &Matrix, threshold: &dyn Threshold) -> Verdict {
    Verdict::new(col_checksums(a, b, c).residuals(), threshold.cols(a, b, c))
}

/// Row checks with V-ABFT's sampled statistics (§3.1), every alarm then
/// confirmed with exact (unsampled) statistics: only rows that fail both
/// are flagged. Returns the verdict and how many sampled alarms the
/// confirmation cleared.
pub fn verify_rows_sampled(
    a: &Matrix,
    b: &Matrix,
    c: &Matrix,
    sampled: &VAbft,
) -> (Verdict, usize) {
    let first = verify_rows(a, b, c, sampled);
    if !first.fired() {
        return (first, 0);
    }
    let exact = VAbft {
        sampling: None,
        ..*sampled
    };
    let confirmed = verify_rows(a, b, c, &exact);
    let cleared = first
        .flagged
        .iter()
        .filter(|r| !confirmed.flagged.contains(r))
        .count();
    (confirmed, cleared)
}

/// What [`locate_and_correct`] did.
#[derive(Clone, Debug, PartialEq)]
pub enum Correction {
    /// No check fired.
    Clean,
    /// One row and one column fired; the element was rewritten.
    Corrected {
        /// Row.
        row: usize,
        /// Column.
        col: usize,
        /// The corrupted value.
        was: f32,
        /// The corrected value (rounded to the storage precision).
        now: f32,
    },
    /// The alarms do not point at a single element (several rows or
    /// columns, only one kind fired, or the corrected element still fails).
    Uncorrectable {
        /// Rows flagged.
        rows: Vec<usize>,
        /// Columns flagged.
        cols: Vec<usize>,
    },
}

/// Runs row and column checks; when exactly one row `r` and one column `q`
/// fire, rewrites `C[r,q] −= observed_r − expected_r` (rounded to
/// `precision`) and confirms that both checks then pass.
pub fn locate_and_correct(
    a: &Matrix,
    b: &Matrix,
    c: &mut Matrix,
    precision: Precision,
    threshold: &dyn Threshold,
) -> Correction {
    let rows = verify_rows(a, b, c, threshold);
    let cols = verify_cols(a, b, c, threshold);
    if !rows.fired() && !cols.fired() {
        return Correction::Clean;
    }
    let uncorrectable = |rows: &Verdict, cols: &Verdict| Correction::Uncorrectable {
        rows: rows.flagged.clone(),
        cols: cols.flagged.clone(),
    };
    let (&[r], &[q]) = (rows.flagged.as_slice(), cols.flagged.as_slice()) else {
        return uncorrectable(&rows, &cols);
    };
    let sums = row_checksums(a, b, c);
    let was = c.at(r, q);
    // `was − (observed − expected)`, computed as `expected − Σ_{n≠q} C[r,n]`
    // so that a huge (or non-finite) corrupted value never enters the sum.
    let others: f64 = c
        .row(r)
        .iter()
        .enumerate()
        .filter(|&(n, _)| n != q)
        .map(|(_, &x)| f64::from(x))
        .sum();
    let now = sums.expected[r] - others;
    let now = precision.round(now as f32);
    c.data[r * c.cols + q] = now;
    let (rows2, cols2) = (
        verify_rows(a, b, c, threshold),
        verify_cols(a, b, c, threshold),
    );
    if rows2.fired() || cols2.fired() {
        c.data[r * c.cols + q] = was;
        return uncorrectable(&rows, &cols);
    }
    Correction::Corrected {
        row: r,
        col: q,
        was,
        now,
    }
}
