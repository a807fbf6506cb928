//! Frequent directions (Liberty 2013; Ghashami, Liberty, Phillips and
//! Woodruff 2016): a deterministic `m × d` sketch `Â` of a stream of rows
//! `A` such that for every unit vector `x`
//!
//! `0 ≤ ‖A·x‖² − ‖Â·x‖² ≤ ‖A − A_r‖²_F / (m − r)` for every `r < m`.
//!
//! This is the fast variant: the sketch keeps a buffer of `2m` rows; when it
//! is full, an SVD shrinks every squared singular value by the `m`-th one,
//! which zeroes at least `m` rows. Each shrink takes `δ` off at least `m`
//! squared singular values, so the sum of the shrinks is at most
//! `(‖A‖²_F − ‖Â‖²_F)/m`, which gives the bound above (GLPW, section 3).
//! The SVD is the symmetric eigendecomposition of `ÂᵀÂ` (`d × d`, f64).

use nalgebra::{DMatrix, SymmetricEigen};

use crate::error::{LowRankError, Result, check_finite, check_len};

/// A frequent-directions sketch of rows of `d` values.
#[derive(Clone, Debug, PartialEq)]
pub struct FrequentDirections {
    d: usize,
    m: usize,
    /// `2m × d` buffer, rows `0..filled` in use.
    buffer: Vec<f64>,
    filled: usize,
    /// Rows seen.
    seen: u64,
    /// Sum of the shrinks `δ` so far (the sketch's deficit bound).
    shrunk: f64,
}

impl FrequentDirections {
    /// An empty sketch of `m` rows (at least 1) for rows of `d` values.
    pub fn new(m: usize, d: usize) -> Result<Self> {
        if m == 0 || d == 0 {
            return Err(LowRankError::InvalidParameter {
                name: "sketch",
                reason: format!("{m} rows of {d} values hold nothing"),
            });
        }
        Ok(Self {
            d,
            m,
            buffer: vec![0.0; 2 * m * d],
            filled: 0,
            seen: 0,
            shrunk: 0.0,
        })
    }

    /// Rows of the sketch.
    pub fn rows(&self) -> usize {
        self.m
    }

    /// Values per row.
    pub fn dim(&self) -> usize {
        self.d
    }

    /// Rows fed so far.
    pub fn seen(&self) -> u64 {
        self.seen
    }

    /// Sum of the shrinks so far: `‖A·x‖² − ‖Â·x‖² ≤` this for every unit `x`.
    pub fn deficit(&self) -> f64 {
        self.shrunk
    }

    /// Feeds rows (`n × d`, row-major).
    pub fn insert(&mut self, rows: &[f32]) -> Result<()> {
        check_len("rows", rows.len().div_ceil(self.d) * self.d, rows.len())?;
        check_finite(rows, self.d)?;
        for row in rows.chunks_exact(self.d) {
            if self.filled == 2 * self.m {
                self.shrink();
            }
            let at = self.filled * self.d;
            for (b, &x) in self.buffer[at..at + self.d].iter_mut().zip(row) {
                *b = f64::from(x);
            }
            self.filled += 1;
            self.seen += 1;
        }
        Ok(())
    }

    /// The SVD step: every squared singular value less the `m`-th one.
    fn shrink(&mut self) {
        let (v, sigma2) = self.decompose();
        let delta = sigma2.get(self.m - 1).copied().unwrap_or(0.0).max(0.0);
        self.shrunk += delta;
        self.buffer.fill(0.0);
        let mut row = 0;
        for (i, &s2) in sigma2.iter().enumerate() {
            let s = (s2 - delta).max(0.0).sqrt();
            if s == 0.0 {
                continue;
            }
            for j in 0..self.d {
                self.buffer[row * self.d + j] = s * v[(j, i)];
            }
            row += 1;
        }
        self.filled = row;
    }

    /// Right singular vectors (columns) and squared singular values of the
    /// buffer, descending.
    fn decompose(&self) -> (DMatrix<f64>, Vec<f64>) {
        let b = DMatrix::<f64>::from_row_slice(
            self.filled.max(1),
            self.d,
            &self.buffer[..self.filled.max(1) * self.d],
        );
        let g = b.transpose() * &b;
        let eig = SymmetricEigen::new(g);
        let mut order: Vec<usize> = (0..self.d).collect();
        order.sort_by(|&a, &c| eig.eigenvalues[c].total_cmp(&eig.eigenvalues[a]));
        let v = DMatrix::from_fn(self.d, self.d, |r, c| eig.eigenvectors[(r, order[c])]);
        let s2 = order.iter().map(|&i| eig.eigenvalues[i].max(0.0)).collect();
        (v, s2)
    }

    /// The sketch `Â` (`m × d`, row-major): the buffer reduced to its top
    /// `m` directions (the same Gram matrix up to one more shrink).
    pub fn sketch(&self) -> Vec<f32> {
        let mut copy = self.clone();
        if copy.filled > copy.m {
            copy.shrink();
        }
        let mut out = vec![0.0f32; self.m * self.d];
        for (o, &b) in out
            .iter_mut()
            .zip(&copy.buffer[..copy.filled.min(self.m) * self.d])
        {
            *o = b as f32;
        }
        out
    }

    /// The right singular directions of the current sketch with their
    /// squared singular values, largest first (at most `m`; directions of
    /// zero value left out). Each direction is a unit vector of `d` values.
    pub fn directions(&self) -> Vec<(f64, Vec<f64>)> {
        let (v, s2) = self.decompose();
        s2.iter()
            .enumerate()
            .take(self.m)
            .filter(|(_, s)| **s > 0.0)
            .map(|(i, &s)| (s, v.column(i).iter().copied().collect()))
            .collect()
    }

    /// `‖Â·x‖²` of the current sketch for one vector.
    pub fn norm2(&self, x: &[f32]) -> f64 {
        self.buffer[..self.filled * self.d]
            .chunks_exact(self.d)
            .map(|row| {
                let dot: f64 = row.iter().zip(x).map(|(b, &x)| b * f64::from(x)).sum();
                dot * dot
            })
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// `‖A·x‖²` and `‖A − A_r‖²_F` of a row-major matrix, in f64.
    fn exact(a: &[f32], d: usize, x: &[f32], r: usize) -> (f64, f64) {
        let n = a.len() / d;
        let m = DMatrix::<f64>::from_row_iterator(n, d, a.iter().map(|&v| f64::from(v)));
        let ax: f64 = a
            .chunks_exact(d)
            .map(|row| {
                row.iter()
                    .zip(x)
                    .map(|(p, q)| f64::from(*p) * f64::from(*q))
                    .sum::<f64>()
                    .powi(2)
            })
            .sum();
        let eig = SymmetricEigen::new(m.transpose() * &m);
        let mut l: Vec<f64> = eig.eigenvalues.iter().map(|v| v.max(0.0)).collect();
        l.sort_by(|a, b| b.total_cmp(a));
        (ax, l.iter().skip(r).sum())
    }

    fn unit(x: Vec<f32>) -> Vec<f32> {
        let n = x.iter().map(|v| v * v).sum::<f32>().sqrt().max(1e-12);
        x.into_iter().map(|v| v / n).collect()
    }

    fn check_guarantee(a: &[f32], d: usize, m: usize, xs: &[Vec<f32>]) {
        let mut fd = FrequentDirections::new(m, d).unwrap();
        fd.insert(a).unwrap();
        let sketch = fd.sketch();
        for x in xs {
            let x = unit(x.clone());
            let sx: f64 = sketch
                .chunks_exact(d)
                .map(|row| {
                    row.iter()
                        .zip(&x)
                        .map(|(p, q)| f64::from(*p) * f64::from(*q))
                        .sum::<f64>()
                        .powi(2)
                })
                .sum();
            for r in 0..m {
                let (ax, tail) = exact(a, d, &x, r);
                let gap = ax - sx;
                let scale = 1e-4 * (1.0 + ax);
                assert!(gap >= -scale, "negative gap {gap} (r {r})");
                assert!(
                    gap <= tail / (m - r) as f64 + scale,
                    "gap {gap} > {} (r {r}, m {m})",
                    tail / (m - r) as f64
                );
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]

        /// The guarantee on random streams, for every r < m.
        #[test]
        fn guarantee_on_random_streams(
            (d, m, a, xs) in (2usize..10, 2usize..7, 1usize..80).prop_flat_map(|(d, m, n)| (
                Just(d),
                Just(m),
                proptest::collection::vec(-3.0f32..3.0, n * d),
                proptest::collection::vec(proptest::collection::vec(-1.0f32..1.0, d), 4),
            ))
        ) {
            check_guarantee(&a, d, m, &xs);
        }

        /// Adversarial streams: a few heavy directions with rotating noise,
        /// and runs of the same row (many shrinks of one direction).
        #[test]
        fn guarantee_on_adversarial_streams(
            d in 3usize..9,
            m in 2usize..5,
            heavy in 1usize..4,
            n in 10usize..120,
        ) {
            let mut a = Vec::with_capacity(n * d);
            for i in 0..n {
                for j in 0..d {
                    let v = if j < heavy { 50.0 * ((i * (j + 1)) as f32 * 0.7).sin() } else { ((i + j) as f32 * 1.3).cos() * 0.1 };
                    a.push(if i % 7 < 3 { 10.0 * (j == i % d) as u8 as f32 } else { v });
                }
            }
            let xs: Vec<Vec<f32>> = (0..d).map(|k| (0..d).map(|j| if j == k { 1.0 } else { 0.1 }).collect()).collect();
            check_guarantee(&a, d, m, &xs);
        }
    }

    #[test]
    fn bad_sketches_and_rows_are_errors() {
        assert!(FrequentDirections::new(0, 4).is_err());
        let mut fd = FrequentDirections::new(2, 4).unwrap();
        assert!(fd.insert(&[1.0; 5]).is_err());
        assert!(matches!(
            fd.insert(&[1.0, f32::INFINITY, 0.0, 0.0]),
            Err(LowRankError::NonFinite { .. })
        ));
    }
}
