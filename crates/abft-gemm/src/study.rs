//! The experiments of the design's §5: e_max calibration (§3 note),
//! false-positive rates over clean products, and detection rates per bit
//! and flip direction for single-bit upsets in C, in the f32 accumulator,
//! and in A or B, for each threshold rule.
//!
//! One GEMM serves every bit and direction of a trial: a flip changes one
//! element of C (or one row or column of it), so only the affected
//! checksums are recomputed, exactly as a full re-verification would.

use rand_chacha::ChaCha12Rng;
use rand_core::{Rng, SeedableRng};
use rayon::prelude::*;
use serde::Serialize;

use crate::error::{AbftError, Result};
use crate::gemm::{gemm, row_checksums};
use crate::matrix::{Distribution, Matrix};
use crate::precision::{FlipDirection, Precision, flip_bit};
use crate::threshold::{AAbft, Threshold, VAbft};

/// `(M, K, N)`.
pub type Dims = (usize, usize, usize);

/// The most f32 elements one study product may hold in A, B and C together
/// (2^28, 1 GiB); larger products are refused before any allocation.
pub const MAX_STUDY_ELEMENTS: usize = 1 << 28;

/// Refuses an empty or oversized product and zero trials (a study of no
/// products reports nothing), before anything is allocated.
pub fn check_study(dims: Dims, trials: u64) -> Result<()> {
    let (m, k, n) = dims;
    let elements = m
        .checked_mul(k)
        .zip(k.checked_mul(n))
        .zip(m.checked_mul(n))
        .and_then(|((a, b), c)| a.checked_add(b)?.checked_add(c));
    if m == 0 || k == 0 || n == 0 || elements.is_none_or(|e| e > MAX_STUDY_ELEMENTS) {
        return Err(AbftError::InvalidParameter {
            name: "dims",
            reason: format!(
                "{m}×{k}×{n}: needs positive sizes with at most {MAX_STUDY_ELEMENTS} elements in A, B and C"
            ),
        });
    }
    if trials == 0 {
        return Err(AbftError::InvalidParameter {
            name: "trials",
            reason: "a study needs at least one product".into(),
        });
    }
    Ok(())
}

fn inputs(p: Precision, d: Distribution, dims: Dims, scale: f32, seed: u64) -> (Matrix, Matrix) {
    let (m, k, n) = dims;
    (
        Matrix::random(m, k, d, scale, p, 2 * seed),
        Matrix::random(k, n, d, scale, p, 2 * seed + 1),
    )
}

/// The input scale used for a precision: FP16 by 1e-2 as in the design
/// (§5.1.2 note 2), FP8 by 1/16 so that C stays in E4M3's range.
pub fn input_scale(p: Precision) -> f32 {
    match p {
        Precision::Fp16 => 1e-2,
        Precision::Fp8E4M3 | Precision::Fp8E5M2 => 1.0 / 16.0,
        _ => 1.0,
    }
}

/// e_max by the design's procedure: N(1,1) inputs, the largest relative
/// checksum error `|Σₙ C_mn − Σₖ A_mk Σₙ B_kn| / |Σₖ A_mk Σₙ B_kn|` over
/// every row of `trials` products.
pub fn calibrate_e_max(p: Precision, dims: Dims, trials: u64, seed: u64) -> Result<f64> {
    check_study(dims, trials)?;
    let mut worst = 0.0f64;
    for t in 0..trials {
        let (a, b) = inputs(
            p,
            Distribution::NormalMeanOne,
            dims,
            input_scale(p),
            seed + t,
        );
        let c = gemm(&a, &b, p)?.c;
        let s = row_checksums(&a, &b, &c);
        for (o, e) in s.observed.iter().zip(&s.expected) {
            worst = worst.max((o - e).abs() / e.abs());
        }
    }
    Ok(worst)
}

/// e_max fitted to the threshold formula itself: the largest ratio of a
/// clean row residual to the V-ABFT bound computed with e_max = 1, over
/// every distribution of §5.1 and `trials` products each, times `margin`.
/// Unlike the design's procedure (relative error on N(1,1) inputs), this
/// covers zero-mean inputs, whose residuals the variance terms must bound.
pub fn fit_e_max(p: Precision, dims: Dims, trials: u64, seed: u64, margin: f64) -> Result<f64> {
    check_study(dims, trials)?;
    let unit = VAbft::design(1.0);
    let mut worst = 0.0f64;
    for d in Distribution::ALL {
        for t in 0..trials {
            let (a, b) = inputs(p, d, dims, input_scale(p), seed + t);
            let c = gemm(&a, &b, p)?.c;
            let res = row_checksums(&a, &b, &c).residuals();
            for (r, bound) in res.iter().zip(unit.rows(&a, &b, &c)) {
                worst = worst.max(r / bound);
            }
        }
    }
    Ok(worst * margin)
}

/// Whether a residual exceeds its bound (NaN and infinity always do).
fn exceeds(residual: f64, bound: f64) -> bool {
    !matches!(
        residual.partial_cmp(&bound),
        Some(std::cmp::Ordering::Less | std::cmp::Ordering::Equal)
    )
}

/// Clean trials in which any row check fired, per threshold (one GEMM per
/// trial serves them all).
pub fn false_positives(
    p: Precision,
    d: Distribution,
    dims: Dims,
    thresholds: &[&dyn Threshold],
    trials: u64,
    seed: u64,
) -> Result<Vec<u64>> {
    check_study(dims, trials)?;
    // Trials run in parallel (each is independent and seeded by its index),
    // and counts add up, so the result does not depend on the thread count.
    (0..trials)
        .into_par_iter()
        .map(|t| {
            let (a, b) = inputs(p, d, dims, input_scale(p), seed + t);
            let c = gemm(&a, &b, p)?.c;
            let res = row_checksums(&a, &b, &c).residuals();
            Ok(thresholds
                .iter()
                .map(|th| {
                    let fired = res
                        .iter()
                        .zip(th.rows(&a, &b, &c))
                        .any(|(&r, t)| exceeds(r, t));
                    u64::from(fired)
                })
                .collect::<Vec<u64>>())
        })
        .try_reduce(
            || vec![0; thresholds.len()],
            |x, y| Ok(x.iter().zip(&y).map(|(a, b)| a + b).collect()),
        )
}

/// Where a single bit flips.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
pub enum FlipSite {
    /// An element of C, in its storage format.
    C,
    /// An element of the f32 accumulator before C is rounded.
    Accumulator,
    /// An element of A (after its checksum was taken).
    A,
    /// An element of B (after its checksum was taken).
    B,
}

/// Detection counts of one bit and direction.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Detection {
    /// Trials in which the flip could be injected (the bit held the
    /// direction's starting value).
    pub injected: u64,
    /// Of those, trials in which a row check fired.
    pub detected: u64,
}

impl Detection {
    /// `detected / injected` in percent, `None` when nothing was injected.
    pub fn percent(&self) -> Option<f64> {
        (self.injected > 0).then(|| 100.0 * self.detected as f64 / self.injected as f64)
    }
}

/// Detection counts per threshold, bit and direction (0 = 0→1, 1 = 1→0).
pub type DetectionTable = Vec<Vec<[Detection; 2]>>;

/// Per trial, one random element of the site is hit at each bit in `bits`
/// and each direction, and every threshold judges the result; returns
/// counts indexed `[threshold][bit][direction]`. A-ABFT's bounds depend on
/// C, so they are recomputed for the flipped row.
#[allow(clippy::too_many_arguments)]
pub fn detection(
    p: Precision,
    d: Distribution,
    dims: Dims,
    site: FlipSite,
    bits: &[u32],
    thresholds: &[&dyn Threshold],
    trials: u64,
    seed: u64,
) -> Result<DetectionTable> {
    check_study(dims, trials)?;
    let mut out = vec![vec![[Detection::default(); 2]; bits.len()]; thresholds.len()];
    let (m, k, n) = dims;
    let site_bits = if site == FlipSite::Accumulator {
        Precision::Fp32
    } else {
        p
    };
    for t in 0..trials {
        let (a, b) = inputs(p, d, dims, input_scale(p), seed + t);
        let prod = gemm(&a, &b, p)?;
        let c = &prod.c;
        let sums = row_checksums(&a, &b, c);
        // V-ABFT's bounds depend on A and B only; A-ABFT's on C too, which
        // the flip changes, so those are recomputed per flip below.
        let base: Vec<Vec<f64>> = thresholds.iter().map(|t| t.rows(&a, &b, c)).collect();
        let mut rng = ChaCha12Rng::seed_from_u64(seed ^ 0x5eed_0000 ^ t);
        let (r, q) = match site {
            FlipSite::C | FlipSite::Accumulator => (
                (rng.next_u64() % m as u64) as usize,
                (rng.next_u64() % n as u64) as usize,
            ),
            FlipSite::A => (
                (rng.next_u64() % m as u64) as usize,
                (rng.next_u64() % k as u64) as usize,
            ),
            FlipSite::B => (
                (rng.next_u64() % k as u64) as usize,
                (rng.next_u64() % n as u64) as usize,
            ),
        };
        let x = match site {
            FlipSite::C => c.at(r, q),
            FlipSite::Accumulator => prod.acc.at(r, q),
            FlipSite::A => a.at(r, q),
            FlipSite::B => b.at(r, q),
        };
        for (bi, &bit) in bits.iter().enumerate() {
            for (di, dir) in [FlipDirection::ZeroToOne, FlipDirection::OneToZero]
                .into_iter()
                .enumerate()
            {
                let Some(bad) = flip_bit(x, site_bits, bit, dir) else {
                    continue;
                };
                // (row, new element values of that row) for every row the flip touches.
                let changed: Vec<(usize, Vec<(usize, f32)>)> = match site {
                    FlipSite::C => vec![(r, vec![(q, bad)])],
                    FlipSite::Accumulator => vec![(r, vec![(q, p.round(bad))])],
                    FlipSite::A => {
                        // Row r of C recomputed with A[r,q] = bad.
                        let delta = f64::from(bad) - f64::from(x);
                        let row = (0..n)
                            .map(|j| {
                                let v =
                                    f64::from(prod.acc.at(r, j)) + delta * f64::from(b.at(q, j));
                                (j, p.round(v as f32))
                            })
                            .collect();
                        vec![(r, row)]
                    }
                    FlipSite::B => {
                        // Column q of C recomputed with B[r,q] = bad.
                        let delta = f64::from(bad) - f64::from(x);
                        (0..m)
                            .map(|i| {
                                let v =
                                    f64::from(prod.acc.at(i, q)) + delta * f64::from(a.at(i, r));
                                (i, vec![(q, p.round(v as f32))])
                            })
                            .collect()
                    }
                };
                for (ti, th) in thresholds.iter().enumerate() {
                    let depends_on_c = th.name().starts_with("A-ABFT");
                    let fired = changed.iter().any(|(row, elems)| {
                        let mut obs = sums.observed[*row];
                        for &(j, v) in elems {
                            obs += f64::from(v) - f64::from(c.at(*row, j));
                        }
                        let resid = (obs - sums.expected[*row]).abs();
                        let bound = if depends_on_c {
                            let mut cr = c.row(*row).to_vec();
                            for &(j, v) in elems {
                                cr[j] = v;
                            }
                            aabft_row(&a, &b, *row, &cr, p)
                        } else {
                            base[ti][*row]
                        };
                        exceeds(resid, bound)
                    });
                    out[ti][bi][di].injected += 1;
                    out[ti][bi][di].detected += u64::from(fired);
                }
            }
        }
    }
    Ok(out)
}

/// A-ABFT's bound (FP32 checks, the storage format's ε_low) for one row
/// whose C values are `c_row`.
fn aabft_row(a: &Matrix, b: &Matrix, row: usize, c_row: &[f32], p: Precision) -> f64 {
    let t = AAbft::for_precision(p);
    let b_max: Vec<f64> = b
        .data
        .chunks(b.cols)
        .map(|r| r.iter().fold(0.0f64, |m, &x| m.max(f64::from(x).abs())))
        .collect();
    let max_b = b_max.iter().copied().fold(0.0, f64::max);
    let ar = a.row(row);
    let check1: f64 = ar
        .iter()
        .zip(&b_max)
        .map(|(&x, m)| f64::from(x).abs() * m)
        .sum();
    let max_a = ar.iter().fold(0.0f64, |m, &x| m.max(f64::from(x).abs()));
    let max_c = c_row.iter().fold(0.0f64, |m, &x| m.max(f64::from(x).abs()));
    t.terms(b.cols, a.cols, max_c, check1, max_a, max_b)
        .iter()
        .sum()
}

#[cfg(test)]
mod checks {
    use super::*;

    #[test]
    fn studies_of_no_or_unallocatable_products_are_refused() {
        assert!(check_study((128, 1024, 256), 1).is_ok());
        for (dims, trials) in [
            ((0, 4, 4), 1),
            ((4, 4, 4), 0),
            ((1 << 20, 1 << 20, 1), 1),
            ((usize::MAX, 2, 2), 1),
            ((1 << 32, 1 << 32, 1 << 32), 1),
        ] {
            assert!(
                matches!(
                    check_study(dims, trials),
                    Err(AbftError::InvalidParameter { .. })
                ),
                "{dims:?} {trials}"
            );
            assert!(calibrate_e_max(Precision::Fp32, dims, trials, 0).is_err());
        }
    }
}
