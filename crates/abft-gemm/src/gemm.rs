//! GEMM `C = A·B` with an explicit rounding model, and its row and column
//! checksums.
//!
//! Rounding model (the thresholds depend on it):
//! 1. A and B hold values of the storage precision (inputs given as f32 are
//!    rounded to it, nearest-even, first).
//! 2. Products and sums are f32 fused multiply-adds in faer's blocked order:
//!    the "black box" accumulation of design §2.2.
//! 3. C is the f32 accumulator rounded once to the storage precision.
//! 4. Checksums are summed in f64, so the check path adds no rounding of its
//!    own worth modelling; the thresholds bound the GEMM's rounding alone.

use faer::linalg::matmul::matmul;
use faer::{Accum, MatMut, MatRef, Par};
use rayon::prelude::*;

use crate::error::{AbftError, Result};
use crate::matrix::Matrix;
use crate::precision::Precision;

/// The product in both forms.
#[derive(Clone, Debug, PartialEq)]
pub struct Product {
    /// The f32 accumulator (before rounding to the storage precision).
    pub acc: Matrix,
    /// C in the storage precision.
    pub c: Matrix,
}

/// Checks shapes, emptiness and finiteness of `A·B`.
pub fn check_inputs(a: &Matrix, b: &Matrix) -> Result<()> {
    if a.rows == 0 || a.cols == 0 {
        return Err(AbftError::Empty("A"));
    }
    if b.rows == 0 || b.cols == 0 {
        return Err(AbftError::Empty("B"));
    }
    if a.cols != b.rows {
        return Err(AbftError::Shape(format!(
            "A is {}×{} but B is {}×{}",
            a.rows, a.cols, b.rows, b.cols
        )));
    }
    for (name, m) in [("A", a), ("B", b)] {
        if let Some(i) = m.data.iter().position(|x| !x.is_finite()) {
            return Err(AbftError::NonFinite {
                matrix: name,
                row: i / m.cols,
                col: i % m.cols,
                value: m.data[i],
            });
        }
    }
    Ok(())
}

/// `acc = A·B` in f32 (faer, all threads), both inputs already in the
/// storage precision.
pub fn multiply_f32(a: &Matrix, b: &Matrix) -> Matrix {
    let mut out = vec![0.0f32; a.rows * b.cols];
    let dst = MatMut::from_row_major_slice_mut(&mut out, a.rows, b.cols);
    matmul(
        dst,
        Accum::Replace,
        a.view(),
        b.view(),
        1.0f32,
        Par::rayon(0),
    );
    Matrix {
        rows: a.rows,
        cols: b.cols,
        data: out,
    }
}

/// A linear layer over a batch: `out (=|+=) x · wᵀ`, with `x` holding
/// `t` rows of `w.cols` inputs and `out` `t` rows of `w.rows` outputs (f32,
/// faer, all threads). The model's projections run through it, so the GEMMs
/// this crate checks are the ones a model computes.
pub fn linear_into(out: &mut [f32], x: &[f32], w: &Matrix, accumulate: bool) -> Result<()> {
    let t = x.len().checked_div(w.cols).unwrap_or(0);
    if t * w.cols != x.len() || out.len() != t * w.rows {
        return Err(AbftError::Shape(format!(
            "{} inputs and {} outputs for a {}×{} layer",
            x.len(),
            out.len(),
            w.rows,
            w.cols
        )));
    }
    let dst = MatMut::from_row_major_slice_mut(out, t, w.rows);
    let lhs = MatRef::from_row_major_slice(x, t, w.cols);
    let accum = if accumulate {
        Accum::Add
    } else {
        Accum::Replace
    };
    matmul(dst, accum, lhs, w.view().transpose(), 1.0f32, Par::rayon(0));
    Ok(())
}

/// `C = A·B` under the rounding model above.
pub fn gemm(a: &Matrix, b: &Matrix, precision: Precision) -> Result<Product> {
    check_inputs(a, b)?;
    let (a, b) = if precision == Precision::Fp32 {
        (std::borrow::Cow::Borrowed(a), std::borrow::Cow::Borrowed(b))
    } else {
        (
            std::borrow::Cow::Owned(a.rounded(precision)),
            std::borrow::Cow::Owned(b.rounded(precision)),
        )
    };
    let acc = multiply_f32(&a, &b);
    let c = round_to(&acc, precision);
    Ok(Product { acc, c })
}

/// The accumulator rounded to the storage precision.
pub fn round_to(acc: &Matrix, precision: Precision) -> Matrix {
    if precision == Precision::Fp32 {
        return acc.clone();
    }
    acc.rounded(precision)
}

/// Row checksums: `observed[m] = Σₙ C[m,n]` and
/// `expected[m] = Σₖ A[m,k]·(Σₙ B[k,n])`, in f64.
#[derive(Clone, Debug, PartialEq)]
pub struct Checksums {
    /// From C.
    pub observed: Vec<f64>,
    /// From A and B.
    pub expected: Vec<f64>,
}

impl Checksums {
    /// `|observed − expected|` per entry.
    pub fn residuals(&self) -> Vec<f64> {
        self.observed
            .iter()
            .zip(&self.expected)
            .map(|(o, e)| (o - e).abs())
            .collect()
    }
}

/// `Σ xs` in f64 over 8 lanes (vectorised; the order is fixed, so the
/// result is reproducible, and the same on every instruction set).
pub fn sum_f64(xs: &[f32]) -> f64 {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx512f") {
        // SAFETY: the CPU has AVX-512F.
        return unsafe { wide::sum_f64(xs) };
    }
    sum_f64_body(xs)
}

/// [`dot_f64`]'s and [`sum_f64`]'s loops compiled for AVX-512F, where
/// their 8-lane f64 sums fit one register each (on the baseline SSE2
/// target they take four). Bit-identical to the baseline loops (tested).
#[cfg(target_arch = "x86_64")]
mod wide {
    /// # Safety
    /// The CPU must have AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn sum_f64(xs: &[f32]) -> f64 {
        super::sum_f64_body(xs)
    }

    /// # Safety
    /// The CPU must have AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn dot_f64(xs: &[f32], ys: &[f64]) -> f64 {
        super::dot_f64_body(xs, ys)
    }
}

#[inline(always)]
fn sum_f64_body(xs: &[f32]) -> f64 {
    let mut lanes = [0.0f64; 8];
    let mut chunks = xs.chunks_exact(8);
    for c in &mut chunks {
        for (lane, &x) in lanes.iter_mut().zip(c) {
            *lane += f64::from(x);
        }
    }
    let tail: f64 = chunks.remainder().iter().map(|&x| f64::from(x)).sum();
    lanes.iter().sum::<f64>() + tail
}

/// `Σ xs·ys` in f64 over 8 lanes.
pub(crate) fn dot_f64(xs: &[f32], ys: &[f64]) -> f64 {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx512f") {
        // SAFETY: the CPU has AVX-512F.
        return unsafe { wide::dot_f64(xs, ys) };
    }
    dot_f64_body(xs, ys)
}

#[inline(always)]
fn dot_f64_body(xs: &[f32], ys: &[f64]) -> f64 {
    let mut lanes = [0.0f64; 8];
    let mut cx = xs.chunks_exact(8);
    let mut cy = ys.chunks_exact(8);
    for (x, y) in (&mut cx).zip(&mut cy) {
        for ((lane, &x), y) in lanes.iter_mut().zip(x).zip(y) {
            *lane += f64::from(x) * y;
        }
    }
    let tail: f64 = cx
        .remainder()
        .iter()
        .zip(cy.remainder())
        .map(|(&x, y)| f64::from(x) * y)
        .sum();
    lanes.iter().sum::<f64>() + tail
}

/// Row checksums of `C ≟ A·B`.
pub fn row_checksums(a: &Matrix, b: &Matrix, c: &Matrix) -> Checksums {
    let b_rows: Vec<f64> = b.data.par_chunks(b.cols).map(sum_f64).collect();
    let expected = a
        .data
        .par_chunks(a.cols)
        .map(|r| dot_f64(r, &b_rows))
        .collect();
    let observed = c.data.par_chunks(c.cols).map(sum_f64).collect();
    Checksums { observed, expected }
}

/// Column checksums: `observed[n] = Σₘ C[m,n]`,
/// `expected[n] = Σₖ (Σₘ A[m,k])·B[k,n]`, in f64.
pub fn col_checksums(a: &Matrix, b: &Matrix, c: &Matrix) -> Checksums {
    let col_sums = |m: &Matrix| -> Vec<f64> {
        let mut s = vec![0.0f64; m.cols];
        for r in m.data.chunks(m.cols) {
            for (s, &x) in s.iter_mut().zip(r) {
                *s += f64::from(x);
            }
        }
        s
    };
    let a_cols = col_sums(a);
    let mut expected = vec![0.0f64; b.cols];
    for (k, r) in b.data.chunks(b.cols).enumerate() {
        for (e, &x) in expected.iter_mut().zip(r) {
            *e += a_cols[k] * f64::from(x);
        }
    }
    Checksums {
        observed: col_sums(c),
        expected,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn linear_layers_equal_an_f64_loop_and_refuse_bad_shapes() {
        let (t, rows, cols) = (5, 7, 11);
        let w = Matrix::new(
            rows,
            cols,
            (0..rows * cols).map(|i| (i as f32 * 0.37).sin()).collect(),
        )
        .unwrap();
        let x: Vec<f32> = (0..t * cols).map(|i| (i as f32 * 0.11).cos()).collect();
        let mut out = vec![1.0f32; t * rows];
        linear_into(&mut out, &x, &w, true).unwrap();
        for r in 0..t {
            for o in 0..rows {
                let want: f64 = 1.0
                    + (0..cols)
                        .map(|c| f64::from(x[r * cols + c]) * f64::from(w.at(o, c)))
                        .sum::<f64>();
                let got = f64::from(out[r * rows + o]);
                assert!(
                    (got - want).abs() <= 1e-5 * (1.0 + want.abs()),
                    "{got} vs {want}"
                );
            }
        }
        assert!(linear_into(&mut out, &x[1..], &w, false).is_err());
        assert!(linear_into(&mut out[1..], &x, &w, false).is_err());
        let stacked = Matrix::stack(&[w.clone(), w.clone()]).unwrap();
        assert_eq!((stacked.rows, stacked.row(rows + 2)), (2 * rows, w.row(2)));
        assert!(Matrix::stack(&[w.clone(), w.transpose()]).is_err());
        assert!(Matrix::stack(&[]).is_err());
    }

    #[test]
    fn wide_vector_sums_equal_the_baseline_loops() {
        let xs: Vec<f32> = (0..1_001)
            .map(|i| ((i * 7_919) % 1_000) as f32 / 37.0 - 13.0)
            .collect();
        let ys: Vec<f64> = (0..1_001).map(|i| f64::from(i) * 0.37 - 90.0).collect();
        #[cfg(target_arch = "x86_64")]
        if !is_x86_feature_detected!("avx512f") {
            return test_support::skip(
                test_support::Requirement::Isa,
                "abft-gemm",
                "wide_vector_sums_equal_the_baseline_loops",
                "no AVX-512F: the wide loops cannot run",
            );
        }
        for len in [0, 1, 7, 8, 9, 64, 1_001] {
            // SAFETY: AVX-512F checked above (x86-64 only; the test is
            // compiled for other targets without the wide module).
            #[cfg(target_arch = "x86_64")]
            let (sum, dot) = unsafe {
                (
                    wide::sum_f64(&xs[..len]),
                    wide::dot_f64(&xs[..len], &ys[..len]),
                )
            };
            #[cfg(not(target_arch = "x86_64"))]
            let (sum, dot) = (sum_f64(&xs[..len]), dot_f64(&xs[..len], &ys[..len]));
            assert_eq!(sum.to_bits(), sum_f64_body(&xs[..len]).to_bits());
            assert_eq!(
                dot.to_bits(),
                dot_f64_body(&xs[..len], &ys[..len]).to_bits()
            );
        }
    }
}
