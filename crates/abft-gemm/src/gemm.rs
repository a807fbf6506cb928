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
    let lhs = MatRef::from_row_major_slice(&a.data, a.rows, a.cols);
    let rhs = MatRef::from_row_major_slice(&b.data, b.rows, b.cols);
    matmul(dst, Accum::Replace, lhs, rhs, 1.0f32, Par::rayon(0));
    Matrix {
        rows: a.rows,
        cols: b.cols,
        data: out,
    }
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
