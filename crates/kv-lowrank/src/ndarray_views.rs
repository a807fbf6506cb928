//! `ndarray` entry points (feature `ndarray`): fitting a basis to an
//! `n × d` view of keys or values, and projecting and reconstructing whole
//! matrices of rows as arrays.
//!
//! A view in standard (row-major, contiguous) layout is read in place; other
//! layouts are copied once into row-major order.

use ndarray::{Array2, ArrayView2};

use kv_quant::RankRule;

use crate::basis::{Basis, BasisStorage, Spectrum};
use crate::error::{Result, check_len};

impl Basis {
    /// [`Basis::fit`] of the rows of an `n × d` view.
    pub fn fit_array(
        rows: ArrayView2<'_, f32>,
        rule: RankRule,
        storage: BasisStorage,
    ) -> Result<(Basis, Spectrum)> {
        let (n, d) = rows.dim();
        let data = rows.as_standard_layout();
        Self::fit(
            data.as_slice().expect("standard layout is contiguous"),
            n,
            d,
            rule,
            storage,
        )
    }

    /// The coefficients (`n × rank`) of the rows of an `n × dim` view.
    pub fn project_array(&self, rows: ArrayView2<'_, f32>) -> Result<Array2<f32>> {
        check_len("rows to project (columns)", self.dim(), rows.ncols())?;
        Ok(map_rows(rows, self.rank(), |x, c| self.project(x, c)))
    }

    /// The rows (`n × dim`) of coefficients given as an `n × rank` view.
    pub fn reconstruct_array(&self, coeffs: ArrayView2<'_, f32>) -> Result<Array2<f32>> {
        check_len("coefficients (columns)", self.rank(), coeffs.ncols())?;
        Ok(map_rows(coeffs, self.dim(), |c, x| self.reconstruct(c, x)))
    }
}

/// An `n × width` array whose row `i` is `f(row i of input)`; each input
/// row is gathered into one reused contiguous buffer (views may be strided).
fn map_rows(
    input: ArrayView2<'_, f32>,
    width: usize,
    f: impl Fn(&[f32], &mut [f32]),
) -> Array2<f32> {
    let mut out = Array2::zeros((input.nrows(), width));
    let mut row_buf = vec![0.0; input.ncols()];
    for (row, mut o) in input.rows().into_iter().zip(out.rows_mut()) {
        row_buf
            .iter_mut()
            .zip(row.iter())
            .for_each(|(b, &r)| *b = r);
        f(
            &row_buf,
            o.as_slice_mut()
                .expect("rows of a new array are contiguous"),
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::LowRankError;

    /// Rows on a rank-3 subspace of 8 dimensions plus a mean.
    fn low_rank_rows(n: usize) -> Array2<f32> {
        Array2::from_shape_fn((n, 8), |(i, j)| {
            let (a, b, c) = (
                (i as f32 * 0.37).sin(),
                (i as f32 * 0.11).cos(),
                i as f32 / n as f32,
            );
            a * (j as f32 - 3.5) + b * ((j % 3) as f32) + c * ((j * j) as f32 / 10.0) + 0.5
        })
    }

    #[test]
    fn views_fit_and_round_trip_as_slices_do() {
        let x = low_rank_rows(64);
        let (basis, _) = Basis::fit_array(x.view(), RankRule::Fixed(3), BasisStorage::F16).unwrap();
        let (want, _) = Basis::fit(
            x.as_slice().unwrap(),
            64,
            8,
            RankRule::Fixed(3),
            BasisStorage::F16,
        )
        .unwrap();
        assert_eq!(basis, want);
        let coeffs = basis.project_array(x.view()).unwrap();
        assert_eq!(coeffs.dim(), (64, 3));
        let back = basis.reconstruct_array(coeffs.view()).unwrap();
        // Row by row through the slice methods: the same bits.
        let (mut c, mut r) = (vec![0.0; 3], vec![0.0; 8]);
        for i in 0..64 {
            basis.project(x.row(i).as_slice().unwrap(), &mut c);
            assert_eq!(coeffs.row(i).as_slice().unwrap(), &c[..]);
            basis.reconstruct(&c, &mut r);
            assert_eq!(back.row(i).as_slice().unwrap(), &r[..]);
        }
        // Rank 3 holds the rows up to the f16 rounding of the basis.
        let worst = back
            .iter()
            .zip(x.iter())
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(worst < 0.05, "largest reconstruction error {worst}");
        // A transposed (column-major) view of the same rows fits the same basis.
        let xt = x.t().to_owned();
        let (from_t, _) = Basis::fit_array(xt.t(), RankRule::Fixed(3), BasisStorage::F16).unwrap();
        assert_eq!(from_t, want);
    }

    #[test]
    fn wrong_widths_are_refused() {
        let x = low_rank_rows(32);
        let (basis, _) = Basis::fit_array(x.view(), RankRule::Fixed(2), BasisStorage::F16).unwrap();
        let narrow = Array2::<f32>::zeros((4, 7));
        assert!(matches!(
            basis.project_array(narrow.view()),
            Err(LowRankError::ShapeMismatch { .. })
        ));
        assert!(matches!(
            basis.reconstruct_array(narrow.view()),
            Err(LowRankError::ShapeMismatch { .. })
        ));
        let nan = Array2::from_elem((4, 8), f32::NAN);
        assert!(Basis::fit_array(nan.view(), RankRule::Fixed(1), BasisStorage::F16).is_err());
    }
}
