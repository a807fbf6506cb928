//! A dense row-major f32 matrix and the seeded test distributions of the
//! design's §5.1: N(1e-6, 1), N(1, 1), U(-1, 1) and N(0, 1) truncated to
//! [-1, 1], each rounded to a storage precision.

use faer::MatRef;
use rand_chacha::ChaCha8Rng;
use rand_core::{Rng, SeedableRng};
use rayon::prelude::*;

use crate::error::{AbftError, Result};
use crate::precision::Precision;

/// A dense row-major `rows × cols` matrix.
#[derive(Clone, Debug, PartialEq)]
pub struct Matrix {
    /// Rows.
    pub rows: usize,
    /// Columns.
    pub cols: usize,
    /// `rows × cols` values, row-major.
    pub data: Vec<f32>,
}

impl Matrix {
    /// A matrix from its values.
    pub fn new(rows: usize, cols: usize, data: Vec<f32>) -> Result<Self> {
        if data.len() != rows * cols {
            return Err(AbftError::Shape(format!(
                "{} values for a {rows}×{cols} matrix",
                data.len()
            )));
        }
        Ok(Self { rows, cols, data })
    }

    /// Element `(r, c)`.
    pub fn at(&self, r: usize, c: usize) -> f32 {
        self.data[r * self.cols + c]
    }

    /// Row `r`.
    pub fn row(&self, r: usize) -> &[f32] {
        &self.data[r * self.cols..(r + 1) * self.cols]
    }

    /// Stacks matrices with the same column count, one under the other
    /// (fused projections: Q, K and V as one matrix).
    pub fn stack(parts: &[Matrix]) -> Result<Self> {
        let Some(cols) = parts.first().map(|p| p.cols) else {
            return Err(AbftError::Shape("nothing to stack".into()));
        };
        if parts.iter().any(|p| p.cols != cols) {
            return Err(AbftError::Shape(
                "stacked matrices differ in column count".into(),
            ));
        }
        let data = parts.iter().flat_map(|p| p.data.iter().copied()).collect();
        Self::new(parts.iter().map(|p| p.rows).sum(), cols, data)
    }

    /// A faer view of the values.
    pub fn view(&self) -> MatRef<'_, f32> {
        MatRef::from_row_major_slice(&self.data, self.rows, self.cols)
    }

    /// The transpose.
    pub fn transpose(&self) -> Matrix {
        let mut t = vec![0.0; self.data.len()];
        for r in 0..self.rows {
            for c in 0..self.cols {
                t[c * self.rows + r] = self.data[r * self.cols + c];
            }
        }
        Matrix {
            rows: self.cols,
            cols: self.rows,
            data: t,
        }
    }

    /// Every element rounded to `p`.
    pub fn rounded(&self, p: Precision) -> Matrix {
        let mut data = self.data.clone();
        data.par_chunks_mut(1 << 14)
            .for_each(|chunk| p.round_slice(chunk));
        Matrix {
            rows: self.rows,
            cols: self.cols,
            data,
        }
    }

    /// `rows × cols` draws of `dist` with `seed`, scaled by `scale` and
    /// rounded to `p`.
    pub fn random(
        rows: usize,
        cols: usize,
        dist: Distribution,
        scale: f32,
        p: Precision,
        seed: u64,
    ) -> Matrix {
        // Each row has its own stream of the seed: rows are drawn in
        // parallel and the result does not depend on the thread count.
        let mut data = vec![0.0f32; rows * cols];
        data.par_chunks_mut(cols.max(1))
            .enumerate()
            .for_each(|(r, row)| {
                let mut rng = ChaCha8Rng::seed_from_u64(seed);
                rng.set_stream(r as u64);
                dist.fill(&mut rng, row);
                if scale != 1.0 {
                    row.iter_mut().for_each(|x| *x *= scale);
                }
                p.round_slice(row);
            });
        Matrix { rows, cols, data }
    }
}

/// The input distributions of the design's experiments (§5.1).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Distribution {
    /// Normal, mean 1e-6, variance 1.
    NormalNearZero,
    /// Normal, mean 1, variance 1.
    NormalMeanOne,
    /// Uniform on [-1, 1].
    Uniform,
    /// Standard normal truncated to [-1, 1].
    TruncatedNormal,
}

impl Distribution {
    /// The four, in the design's column order.
    pub const ALL: [Distribution; 4] = [
        Distribution::NormalNearZero,
        Distribution::NormalMeanOne,
        Distribution::Uniform,
        Distribution::TruncatedNormal,
    ];

    /// The design's column heading.
    pub fn label(self) -> &'static str {
        match self {
            Self::NormalNearZero => "N(1e-6,1)",
            Self::NormalMeanOne => "N(1,1)",
            Self::Uniform => "U(-1,1)",
            Self::TruncatedNormal => "N(0,1) in [-1,1]",
        }
    }

    fn uniform01(rng: &mut ChaCha8Rng) -> f64 {
        // 53 random bits in [0, 1).
        (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    fn normal(rng: &mut ChaCha8Rng) -> f64 {
        // The ziggurat of `rand_distr` (pinned by Cargo.lock, so a seed
        // gives the same draws); it replaced Box–Muller, whose logarithm and
        // sine/cosine made input generation most of the study's time.
        rand_distr::Distribution::<f64>::sample(&rand_distr::StandardNormal, rng)
    }

    /// Fills `out` with draws.
    pub fn fill(self, rng: &mut ChaCha8Rng, out: &mut [f32]) {
        for o in out.iter_mut() {
            *o = self.sample(rng) as f32;
        }
    }

    /// One draw.
    pub fn sample(self, rng: &mut ChaCha8Rng) -> f64 {
        match self {
            Self::NormalNearZero => 1e-6 + Self::normal(rng),
            Self::NormalMeanOne => 1.0 + Self::normal(rng),
            Self::Uniform => 2.0 * Self::uniform01(rng) - 1.0,
            Self::TruncatedNormal => loop {
                let x = Self::normal(rng);
                if x.abs() <= 1.0 {
                    break x;
                }
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn distributions_have_their_moments() {
        for d in Distribution::ALL {
            let m = Matrix::random(200, 500, d, 1.0, Precision::Fp32, 3);
            let n = m.data.len() as f64;
            let mean = m.data.iter().map(|&x| f64::from(x)).sum::<f64>() / n;
            let var = m
                .data
                .iter()
                .map(|&x| (f64::from(x) - mean).powi(2))
                .sum::<f64>()
                / n;
            let (want_mean, want_var) = match d {
                Distribution::NormalNearZero => (0.0, 1.0),
                Distribution::NormalMeanOne => (1.0, 1.0),
                Distribution::Uniform => (0.0, 1.0 / 3.0),
                // Var of N(0,1) truncated to [-1,1]: 1 − 2φ(1)/(2Φ(1) − 1) = 0.29112.
                Distribution::TruncatedNormal => (0.0, 0.291_125),
            };
            approx::assert_abs_diff_eq!(mean, want_mean, epsilon = 0.01);
            approx::assert_abs_diff_eq!(var, want_var, epsilon = 0.01);
        }
        assert_eq!(
            Matrix::random(3, 4, Distribution::Uniform, 1.0, Precision::Bf16, 9),
            Matrix::random(3, 4, Distribution::Uniform, 1.0, Precision::Bf16, 9)
        );
    }
}
