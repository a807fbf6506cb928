//! Checksum thresholds: V-ABFT (design §3, both variance estimators of §2.1
//! and optional sampling of §3.1), A-ABFT (design §4, its four terms), and a
//! fixed relative threshold (the SEA-style baseline).
//!
//! Every threshold gives one bound per row check; the column bounds are the
//! row bounds of the transposed product `Cᵀ = Bᵀ·Aᵀ`, computed from column
//! statistics without transposing anything.

use rayon::prelude::*;

use crate::gemm::{Checksums, dot_f64, row_checksums, sum_f64};
use crate::matrix::Matrix;
use crate::precision::Precision;

/// Statistics of one row (or column) of a matrix.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Stats {
    /// Values counted.
    pub n: usize,
    /// Mean.
    pub mean: f64,
    /// Largest value.
    pub max: f64,
    /// Smallest value.
    pub min: f64,
    /// Largest magnitude.
    pub max_abs: f64,
    /// Sum of magnitudes.
    pub sum_abs: f64,
    /// Population variance (exact, for the `Exact` estimator and tests).
    pub var: f64,
}

impl Stats {
    /// Statistics of `xs` (two passes, f64): the reference for [`Stats::of_slice`].
    pub fn of(xs: impl Iterator<Item = f32> + Clone) -> Stats {
        let mut acc = Accumulator::default();
        for x in xs.clone() {
            acc.add_slice(&[x]);
        }
        let mut s = acc.finish();
        s.var = xs.map(|x| (f64::from(x) - s.mean).powi(2)).sum::<f64>() / s.n.max(1) as f64;
        s
    }

    /// Statistics of a slice in one pass over 8 independent lanes (which the
    /// compiler vectorises); the variance is `E[x²] − mean²` in f64.
    pub fn of_slice(xs: &[f32]) -> Stats {
        let mut acc = Accumulator::default();
        acc.add_slice(xs);
        acc.finish()
    }
}

/// Running sums of [`Stats`], kept in 8 lanes.
#[derive(Clone, Copy, Debug)]
struct Accumulator {
    n: usize,
    sum: [f64; 8],
    sumsq: [f64; 8],
    sum_abs: [f64; 8],
    max: [f32; 8],
    min: [f32; 8],
}

impl Default for Accumulator {
    fn default() -> Self {
        Self {
            n: 0,
            sum: [0.0; 8],
            sumsq: [0.0; 8],
            sum_abs: [0.0; 8],
            max: [f32::NEG_INFINITY; 8],
            min: [f32::INFINITY; 8],
        }
    }
}

impl Accumulator {
    fn add_slice(&mut self, xs: &[f32]) {
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx512f") {
                // SAFETY: the CPU has AVX-512F.
                return unsafe { self.add_slice_avx512(xs) };
            }
            if is_x86_feature_detected!("avx2") {
                // SAFETY: the CPU has AVX2.
                return unsafe { self.add_slice_avx2(xs) };
            }
        }
        self.add_slice_body(xs);
    }

    /// [`add_slice`](Self::add_slice) compiled for AVX-512F: on the
    /// baseline SSE2 target the 8-lane f64 sums spill to the stack; here each
    /// is one register. Same additions, same order, so bit-identical (tested;
    /// Rust never contracts `a * b + c` into a fused multiply-add).
    ///
    /// # Safety
    /// The CPU must have AVX-512F.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    unsafe fn add_slice_avx512(&mut self, xs: &[f32]) {
        self.add_slice_body(xs);
    }

    /// As [`add_slice_avx512`](Self::add_slice_avx512), for AVX2.
    ///
    /// # Safety
    /// The CPU must have AVX2.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    unsafe fn add_slice_avx2(&mut self, xs: &[f32]) {
        self.add_slice_body(xs);
    }

    #[inline(always)]
    fn add_slice_body(&mut self, xs: &[f32]) {
        self.n += xs.len();
        // 16 values per step into two sets of lanes: two independent chains
        // per running sum and extreme (the max/min selects are a serial
        // compare-and-blend chain otherwise).
        let mut pairs = xs.chunks_exact(16);
        let mut second = Accumulator::default();
        for c in &mut pairs {
            let (lo, hi) = c.split_at(8);
            for l in 0..8 {
                let (x, y) = (lo[l], hi[l]);
                let (d, e) = (f64::from(x), f64::from(y));
                self.sum[l] += d;
                second.sum[l] += e;
                self.sumsq[l] += d * d;
                second.sumsq[l] += e * e;
                self.sum_abs[l] += d.abs();
                second.sum_abs[l] += e.abs();
                self.max[l] = if x > self.max[l] { x } else { self.max[l] };
                second.max[l] = if y > second.max[l] { y } else { second.max[l] };
                self.min[l] = if x < self.min[l] { x } else { self.min[l] };
                second.min[l] = if y < second.min[l] { y } else { second.min[l] };
            }
        }
        for l in 0..8 {
            self.sum[l] += second.sum[l];
            self.sumsq[l] += second.sumsq[l];
            self.sum_abs[l] += second.sum_abs[l];
            self.max[l] = self.max[l].max(second.max[l]);
            self.min[l] = self.min[l].min(second.min[l]);
        }
        let mut chunks = pairs.remainder().chunks_exact(8);
        for c in &mut chunks {
            for (l, &x) in c.iter().enumerate() {
                let d = f64::from(x);
                self.sum[l] += d;
                self.sumsq[l] += d * d;
                self.sum_abs[l] += d.abs();
                self.max[l] = if x > self.max[l] { x } else { self.max[l] };
                self.min[l] = if x < self.min[l] { x } else { self.min[l] };
            }
        }
        for (l, &x) in chunks.remainder().iter().enumerate() {
            let d = f64::from(x);
            self.sum[l] += d;
            self.sumsq[l] += d * d;
            self.sum_abs[l] += d.abs();
            self.max[l] = self.max[l].max(x);
            self.min[l] = self.min[l].min(x);
        }
    }

    fn finish(&self) -> Stats {
        let n = self.n.max(1) as f64;
        let mean = self.sum.iter().sum::<f64>() / n;
        let max = f64::from(self.max.iter().copied().fold(f32::NEG_INFINITY, f32::max));
        let min = f64::from(self.min.iter().copied().fold(f32::INFINITY, f32::min));
        Stats {
            n: self.n,
            mean,
            max,
            min,
            max_abs: max.abs().max(min.abs()),
            sum_abs: self.sum_abs.iter().sum(),
            var: (self.sumsq.iter().sum::<f64>() / n - mean * mean).max(0.0),
        }
    }
}

/// Row statistics (`sample`: only indices `i mod period < keep`).
fn row_stats(m: &Matrix, sample: Option<Sampling>) -> Vec<Stats> {
    m.data
        .par_chunks(m.cols)
        .map(|r| stats_of_row(r, sample))
        .collect()
}

/// Statistics of one row, every element or a strided sample.
pub(crate) fn stats_of_row(r: &[f32], sample: Option<Sampling>) -> Stats {
    match sample {
        None => Stats::of_slice(r),
        Some(s) => {
            let mut acc = Accumulator::default();
            for c in r.chunks(s.period) {
                acc.add_slice(&c[..s.keep.min(c.len())]);
            }
            acc.finish()
        }
    }
}

/// Column statistics, one pass over the rows per block of 64 columns.
pub(crate) fn col_stats(m: &Matrix) -> Vec<Stats> {
    (0..m.cols)
        .step_by(64)
        .collect::<Vec<_>>()
        .into_par_iter()
        .flat_map_iter(|c0| {
            let width = 64.min(m.cols - c0);
            let mut accs = vec![Accumulator::default(); width];
            for r in 0..m.rows {
                let row = &m.data[r * m.cols + c0..r * m.cols + c0 + width];
                for (a, &x) in accs.iter_mut().zip(row) {
                    a.add_slice(&[x]);
                }
            }
            accs.into_iter().map(|a| a.finish())
        })
        .collect()
}

/// How V-ABFT estimates a standard deviation from a row's statistics.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum VarianceEstimator {
    /// Extreme-value theory (§2.1.1): `σ ≈ (max − mean)/√(2 ln n)`.
    ExtremeValue,
    /// The distribution-free bound (§2.1.2): `σ² ≤ (max − mean)(mean − min)`.
    MaxMinBound,
    /// The exact standard deviation (a reference, not part of the design).
    Exact,
}

impl VarianceEstimator {
    /// The estimated standard deviation.
    pub fn sigma(self, s: &Stats) -> f64 {
        match self {
            Self::ExtremeValue => {
                if s.n < 2 {
                    0.0
                } else {
                    (s.max - s.mean) / (2.0 * (s.n as f64).ln()).sqrt()
                }
            }
            Self::MaxMinBound => ((s.max - s.mean) * (s.mean - s.min)).max(0.0).sqrt(),
            Self::Exact => s.var.sqrt(),
        }
    }
}

/// Strided sampling of A's rows (§3.1): indices with `i mod period < keep`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Sampling {
    /// Stride period (32 in the design).
    pub period: usize,
    /// Indices kept per period (16 in the design).
    pub keep: usize,
}

/// A threshold rule for row and column checks.
pub trait Threshold: Sync {
    /// Name for reports.
    fn name(&self) -> String;
    /// One bound per row of C.
    fn rows(&self, a: &Matrix, b: &Matrix, c: &Matrix) -> Vec<f64>;
    /// One bound per column of C.
    fn cols(&self, a: &Matrix, b: &Matrix, c: &Matrix) -> Vec<f64>;
    /// The row checksums and the row bounds together; rules whose bounds
    /// read the same rows as the checksums override this to read each row
    /// once (same values as the separate calls).
    fn rows_with_checksums(&self, a: &Matrix, b: &Matrix, c: &Matrix) -> (Checksums, Vec<f64>) {
        (row_checksums(a, b, c), self.rows(a, b, c))
    }
}

/// V-ABFT (design §3):
///
/// `T_m = e_max·( N|μ_Am|·Σₖ|μ_Bk| + c·√(N·μ_Am²·Σₖσ_Bk² + N²·σ_Am²·Σₖμ_Bk²) + c·√N·σ_Am·√(Σₖσ_Bk²) )`
///
/// with `μ`, `σ` the mean and estimated standard deviation of row m of A
/// and of row k of B, and `c` the variance coefficient (4 in the formula,
/// 2.5 in the design's experiments).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct VAbft {
    /// Error-factor bound e_max.
    pub e_max: f64,
    /// Variance coefficient `c`.
    pub coefficient: f64,
    /// Standard-deviation estimator.
    pub estimator: VarianceEstimator,
    /// Sample A's rows for μ_Am and σ_Am.
    pub sampling: Option<Sampling>,
}

impl VAbft {
    /// The design's experimental setting: e_max for `precision`, c = 2.5,
    /// the max/min bound, no sampling.
    pub fn design(e_max: f64) -> Self {
        Self {
            e_max,
            coefficient: 2.5,
            estimator: VarianceEstimator::MaxMinBound,
            sampling: None,
        }
    }

    /// The bound for one check from the statistics of its A-side vector
    /// (`sa`, length K) and of every B-side vector (`sb`, K of them, each of
    /// length `n`).
    pub(crate) fn bound(&self, sa: &Stats, sb: &BSums, n: usize) -> f64 {
        let n = n as f64;
        let mu_a = sa.mean;
        let sigma_a = self.estimator.sigma(sa);
        let c = self.coefficient;
        self.e_max
            * (n * mu_a.abs() * sb.sum_abs_mu
                + c * (n * mu_a * mu_a * sb.sum_sigma2 + n * n * sigma_a * sigma_a * sb.sum_mu2)
                    .sqrt()
                + c * n.sqrt() * sigma_a * sb.sum_sigma2.sqrt())
    }

    pub(crate) fn b_sums(&self, stats: &[Stats]) -> BSums {
        let mut s = BSums::default();
        for st in stats {
            let sigma = self.estimator.sigma(st);
            s.sum_abs_mu += st.mean.abs();
            s.sum_sigma2 += sigma * sigma;
            s.sum_mu2 += st.mean * st.mean;
        }
        s
    }
}

/// `Σₖ|μ_Bk|`, `Σₖσ_Bk²`, `Σₖμ_Bk²`.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct BSums {
    sum_abs_mu: f64,
    sum_sigma2: f64,
    sum_mu2: f64,
}

impl Threshold for VAbft {
    fn name(&self) -> String {
        format!(
            "V-ABFT(e_max {:.3e}, c {}, {:?}{})",
            self.e_max,
            self.coefficient,
            self.estimator,
            if self.sampling.is_some() {
                ", sampled"
            } else {
                ""
            }
        )
    }

    fn rows(&self, a: &Matrix, b: &Matrix, _c: &Matrix) -> Vec<f64> {
        let sb = self.b_sums(&row_stats(b, None));
        row_stats(a, self.sampling)
            .iter()
            .map(|sa| self.bound(sa, &sb, b.cols))
            .collect()
    }

    fn rows_with_checksums(&self, a: &Matrix, b: &Matrix, c: &Matrix) -> (Checksums, Vec<f64>) {
        // One pass over each row of B (its sum for the checksum, its
        // statistics for the bound) and of A (its dot product with B's row
        // sums, its statistics): the row is still in L1 for the second loop,
        // so A and B stream from memory once instead of twice.
        let (b_rows, b_stats): (Vec<f64>, Vec<Stats>) = b
            .data
            .par_chunks(b.cols)
            .map(|r| (sum_f64(r), Stats::of_slice(r)))
            .unzip();
        let sb = self.b_sums(&b_stats);
        let (expected, bounds): (Vec<f64>, Vec<f64>) = a
            .data
            .par_chunks(a.cols)
            .map(|r| {
                let bound = self.bound(&stats_of_row(r, self.sampling), &sb, b.cols);
                (dot_f64(r, &b_rows), bound)
            })
            .unzip();
        let observed = c.data.par_chunks(c.cols).map(sum_f64).collect();
        (Checksums { observed, expected }, bounds)
    }

    fn cols(&self, a: &Matrix, b: &Matrix, _c: &Matrix) -> Vec<f64> {
        // Cᵀ = Bᵀ·Aᵀ: the A-side vectors are B's columns, the B-side ones A's columns.
        let sb = self.b_sums(&col_stats(a));
        col_stats(b)
            .iter()
            .map(|sa| self.bound(sa, &sb, a.rows))
            .collect()
    }
}

/// A-ABFT (design §4): `E = E_sum-C + E_ele-round + E_check1 + E_check2` with
///
/// - `E_sum-C = √(⅛·Σᵢ₌₁ᴺ i²)·max|C_m·|·ε_high`
/// - `E_ele-round = ε_low·√N·max|C_m·|`
/// - `E_check1 = Σₖ |A_mk|·δ₁ₖ`, `δ₁ₖ = ε_high·√(⅛·Σᵢ₌₁ᴺ i²)·max|B_k·|`
/// - `E_check2 = ε_high·√(⅛·Σₖ₌₁ᴷ k² + K/12)·max|B|·max|A_m·|`
///
/// with `ε_high = 2⁻²³` and `ε_low` the storage format's unit roundoff
/// (the design's 2⁻⁸ for BF16).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AAbft {
    /// ε of the verification arithmetic (FP32: 2⁻²³).
    pub eps_high: f64,
    /// ε of the storage format.
    pub eps_low: f64,
}

impl AAbft {
    /// A-ABFT verifying a product stored in `precision` with FP32 checks.
    pub fn for_precision(precision: Precision) -> Self {
        Self {
            eps_high: 2f64.powi(-23),
            eps_low: precision.unit_roundoff(),
        }
    }

    /// `√(⅛·Σᵢ₌₁ⁿ i²)`.
    pub fn sum_factor(n: usize) -> f64 {
        let n = n as f64;
        (n * (n + 1.0) * (2.0 * n + 1.0) / 6.0 / 8.0).sqrt()
    }

    /// The four terms for one check: `max_c = max|C_m·|`, `sa` the A-side
    /// statistics, `check1 = Σₖ|A_mk|·max|B_k·|`, `max_b = max|B|`.
    pub fn terms(
        &self,
        n: usize,
        k: usize,
        max_c: f64,
        check1: f64,
        max_a: f64,
        max_b: f64,
    ) -> [f64; 4] {
        let fac_n = Self::sum_factor(n);
        [
            fac_n * max_c * self.eps_high,
            self.eps_low * (n as f64).sqrt() * max_c,
            self.eps_high * fac_n * check1,
            self.eps_high * (Self::sum_factor(k).powi(2) + k as f64 / 12.0).sqrt() * max_b * max_a,
        ]
    }
}

impl Threshold for AAbft {
    fn name(&self) -> String {
        format!("A-ABFT(eps_low {:.3e})", self.eps_low)
    }

    fn rows(&self, a: &Matrix, b: &Matrix, c: &Matrix) -> Vec<f64> {
        let b_max: Vec<f64> = row_stats(b, None).iter().map(|s| s.max_abs).collect();
        let max_b = b_max.iter().copied().fold(0.0, f64::max);
        let c_max: Vec<f64> = row_stats(c, None).iter().map(|s| s.max_abs).collect();
        a.data
            .par_chunks(a.cols)
            .zip(c_max.par_iter())
            .map(|(r, &mc)| {
                let check1: f64 = r
                    .iter()
                    .zip(&b_max)
                    .map(|(&x, m)| f64::from(x).abs() * m)
                    .sum();
                let max_a = r.iter().fold(0.0f64, |m, &x| m.max(f64::from(x).abs()));
                self.terms(b.cols, a.cols, mc, check1, max_a, max_b)
                    .iter()
                    .sum()
            })
            .collect()
    }

    fn cols(&self, a: &Matrix, b: &Matrix, c: &Matrix) -> Vec<f64> {
        // Cᵀ = Bᵀ·Aᵀ: "rows of B" become columns of A, and so on.
        let a_cols = col_stats(a);
        let a_max: Vec<f64> = a_cols.iter().map(|s| s.max_abs).collect();
        let max_a_all = a_max.iter().copied().fold(0.0, f64::max);
        let c_cols = col_stats(c);
        (0..b.cols)
            .into_par_iter()
            .map(|n| {
                let (mut check1, mut max_b) = (0.0f64, 0.0f64);
                for (k, am) in a_max.iter().enumerate() {
                    let x = f64::from(b.data[k * b.cols + n]).abs();
                    check1 += x * am;
                    max_b = max_b.max(x);
                }
                self.terms(a.rows, b.rows, c_cols[n].max_abs, check1, max_b, max_a_all)
                    .iter()
                    .sum()
            })
            .collect()
    }
}

/// The fixed-threshold baseline: `T_m = τ·Σₙ|C_mn|`, one relative
/// tolerance for every size, distribution and precision (SEA-style).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FixedThreshold {
    /// Relative tolerance τ.
    pub tau: f64,
}

impl Threshold for FixedThreshold {
    fn name(&self) -> String {
        format!("fixed(τ {:.1e})", self.tau)
    }

    fn rows(&self, _a: &Matrix, _b: &Matrix, c: &Matrix) -> Vec<f64> {
        row_stats(c, None)
            .iter()
            .map(|s| self.tau * s.sum_abs)
            .collect()
    }

    fn cols(&self, _a: &Matrix, _b: &Matrix, c: &Matrix) -> Vec<f64> {
        col_stats(c).iter().map(|s| self.tau * s.sum_abs).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn wide_vector_statistics_equal_the_baseline_loop() {
        let xs: Vec<f32> = (0..1_003)
            .map(|i| ((i * 7_919) % 1_000) as f32 / 37.0 - 13.0)
            .collect();
        #[cfg(target_arch = "x86_64")]
        {
            let (avx512, avx2) = (
                is_x86_feature_detected!("avx512f"),
                is_x86_feature_detected!("avx2"),
            );
            for len in [0, 1, 7, 8, 15, 16, 17, 100, 1_003] {
                let mut base = Accumulator::default();
                base.add_slice_body(&xs[..len]);
                let want = format!("{:?}", base.finish());
                if avx512 {
                    let mut a = Accumulator::default();
                    // SAFETY: AVX-512F detected above.
                    unsafe { a.add_slice_avx512(&xs[..len]) };
                    assert_eq!(format!("{:?}", a.finish()), want, "avx512 {len}");
                }
                if avx2 {
                    let mut a = Accumulator::default();
                    // SAFETY: AVX2 detected above.
                    unsafe { a.add_slice_avx2(&xs[..len]) };
                    assert_eq!(format!("{:?}", a.finish()), want, "avx2 {len}");
                }
            }
            for (present, name) in [(avx512, "AVX-512F"), (avx2, "AVX2")] {
                if !present {
                    test_support::skip(
                        test_support::Requirement::Isa,
                        "abft-gemm",
                        "wide_vector_statistics_equal_the_baseline_loop",
                        &format!("no {name}: that path was not compared"),
                    );
                }
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        test_support::skip(
            test_support::Requirement::Isa,
            "abft-gemm",
            "wide_vector_statistics_equal_the_baseline_loop",
            "not x86-64: there is no wide path",
        );
    }

    #[test]
    fn fused_row_checks_equal_the_separate_ones() {
        use crate::matrix::Distribution;
        for (m, k, n) in [(3, 5, 7), (17, 64, 9), (40, 100, 33)] {
            let a = Matrix::random(m, k, Distribution::NormalMeanOne, 1.0, Precision::Bf16, 1);
            let b = Matrix::random(k, n, Distribution::Uniform, 1.0, Precision::Bf16, 2);
            let c = crate::gemm::gemm(&a, &b, Precision::Bf16).unwrap().c;
            for sampling in [None, Some(Sampling { period: 4, keep: 2 })] {
                let v = VAbft {
                    sampling,
                    ..VAbft::design(Precision::Bf16.e_max_ascend())
                };
                let (sums, bounds) = v.rows_with_checksums(&a, &b, &c);
                assert_eq!(sums, row_checksums(&a, &b, &c));
                assert_eq!(bounds, v.rows(&a, &b, &c));
            }
        }
    }

    proptest! {
        /// The one-pass lane statistics equal the two-pass f64 reference.
        #[test]
        fn one_pass_stats_match_the_reference(xs in prop::collection::vec(-1e3f32..1e3, 1..300)) {
            let fast = Stats::of_slice(&xs);
            let slow = Stats::of(xs.iter().copied());
            prop_assert_eq!((fast.n, fast.max, fast.min, fast.max_abs), (slow.n, slow.max, slow.min, slow.max_abs));
            let tol = |a: f64, b: f64, s: f64| (a - b).abs() <= 1e-9 * s.max(1.0);
            prop_assert!(tol(fast.mean, slow.mean, slow.max_abs));
            prop_assert!(tol(fast.sum_abs, slow.sum_abs, slow.sum_abs));
            prop_assert!(tol(fast.var, slow.var, slow.max_abs * slow.max_abs));
        }
    }

    #[test]
    fn column_stats_are_row_stats_of_the_transpose() {
        let m = Matrix::random(
            70,
            130,
            crate::Distribution::NormalMeanOne,
            1.0,
            crate::Precision::Fp32,
            4,
        );
        let t = m.transpose();
        for (c, r) in col_stats(&m).iter().zip(row_stats(&t, None)) {
            assert_eq!((c.n, c.max, c.min), (r.n, r.max, r.min));
            assert!((c.mean - r.mean).abs() < 1e-12 && (c.var - r.var).abs() < 1e-9);
        }
    }
}
