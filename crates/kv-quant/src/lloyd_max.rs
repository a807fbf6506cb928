//! Lloyd-Max scalar codebooks for the standard normal distribution, the
//! codebooks of `lm<b>` forms (TurboQuant's MSE quantizer; Shard's decode
//! stream). After a randomized Hadamard rotation every coordinate of a
//! block divided by the block's RMS is close to N(0, 1), so one codebook per
//! bit width serves every token, layer and model: no calibration.
//!
//! The `2^b` centroids solve Lloyd's conditions for N(0, 1): each decision
//! threshold is the midpoint of its two centroids, and each centroid is the
//! mean of the normal over its cell, in closed form
//! `c = (φ(a) − φ(b)) / (Φ(b) − Φ(a))` (the iteration of Shard's blog,
//! section 8, with σ = 1). The iteration starts from the normal quantiles of
//! the cell midpoints and runs in f64 until no centroid moves by more than
//! 1e-13; the tables are built once per width.

use std::sync::OnceLock;

/// Smallest and largest supported width.
pub const BITS: std::ops::RangeInclusive<u8> = 1..=8;

/// A Lloyd-Max codebook for N(0, 1).
#[derive(Clone, Debug, PartialEq)]
pub struct LloydMax {
    centroids: Vec<f32>,
    /// The centroids of widths up to 4 bits, zeros past them: the table
    /// a 16-entry register lookup reads ([`LevelMap::Codebook`](crate::LevelMap::Codebook)).
    padded: Option<[f32; 16]>,
    thresholds: Vec<f32>,
    mse: f64,
}

fn pdf(z: f64) -> f64 {
    (-0.5 * z * z).exp() / (2.0 * std::f64::consts::PI).sqrt()
}

fn cdf(z: f64) -> f64 {
    0.5 * libm::erfc(-z / std::f64::consts::SQRT_2)
}

/// The normal quantile of `p` by bisection on [`cdf`] (start values only).
fn quantile(p: f64) -> f64 {
    let (mut lo, mut hi) = (-40.0f64, 40.0f64);
    for _ in 0..200 {
        let mid = 0.5 * (lo + hi);
        if cdf(mid) < p {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    0.5 * (lo + hi)
}

/// Centroids and thresholds of the `2^bits`-level quantizer, in f64.
fn solve(bits: u8) -> (Vec<f64>, Vec<f64>) {
    let n = 1usize << bits;
    let mut c: Vec<f64> = (0..n)
        .map(|i| quantile((i as f64 + 0.5) / n as f64))
        .collect();
    let mut bounds = vec![0.0; n + 1];
    for _ in 0..100_000 {
        bounds[0] = f64::NEG_INFINITY;
        bounds[n] = f64::INFINITY;
        for k in 1..n {
            bounds[k] = 0.5 * (c[k - 1] + c[k]);
        }
        let mut moved = 0.0f64;
        for k in 0..n {
            let (a, b) = (bounds[k], bounds[k + 1]);
            let mass = cdf(b) - cdf(a);
            let next = if mass < 1e-300 {
                c[k]
            } else {
                (pdf(a) - pdf(b)) / mass
            };
            moved = moved.max((next - c[k]).abs());
            c[k] = next;
        }
        if moved < 1e-13 {
            break;
        }
    }
    let thresholds = (1..n).map(|k| 0.5 * (c[k - 1] + c[k])).collect();
    (c, thresholds)
}

/// Expected squared error of the quantizer on N(0, 1), by integrating
/// `∫ (x − c)² φ(x) dx` over each cell in closed form.
fn mse(c: &[f64], t: &[f64]) -> f64 {
    let n = c.len();
    (0..n)
        .map(|k| {
            let a = if k == 0 { f64::NEG_INFINITY } else { t[k - 1] };
            let b = if k == n - 1 { f64::INFINITY } else { t[k] };
            // ∫ x²φ = Φ − xφ, ∫ xφ = −φ, ∫ φ = Φ over [a, b].
            let (pa, pb) = (pdf(a), pdf(b));
            let xpa = if a.is_finite() { a * pa } else { 0.0 };
            let xpb = if b.is_finite() { b * pb } else { 0.0 };
            let m0 = cdf(b) - cdf(a);
            let m1 = pa - pb;
            let m2 = m0 + xpa - xpb;
            m2 - 2.0 * c[k] * m1 + c[k] * c[k] * m0
        })
        .sum()
}

impl LloydMax {
    /// The codebook of `bits` bits (1 to 8), built once and shared.
    ///
    /// # Panics
    /// If `bits` is outside 1..=8 (forms are validated before they get here).
    pub fn of(bits: u8) -> &'static LloydMax {
        assert!(BITS.contains(&bits), "Lloyd-Max widths are 1 to 8 bits");
        static TABLES: [OnceLock<LloydMax>; 8] = [const { OnceLock::new() }; 8];
        TABLES[usize::from(bits - 1)].get_or_init(|| {
            let (c, t) = solve(bits);
            let centroids: Vec<f32> = c.iter().map(|&v| v as f32).collect();
            let padded = (centroids.len() <= 16).then(|| {
                let mut table = [0.0f32; 16];
                table[..centroids.len()].copy_from_slice(&centroids);
                table
            });
            LloydMax {
                padded,
                centroids,
                thresholds: t.iter().map(|&v| v as f32).collect(),
                mse: mse(&c, &t),
            }
        })
    }

    /// The centroids, ascending (symmetric about 0).
    pub fn centroids(&self) -> &[f32] {
        &self.centroids
    }

    /// The centroids padded with zeros to 16 entries, for widths of at
    /// most 4 bits (`None` above): what attention's kernels look levels up
    /// in, one register per table.
    pub fn padded16(&self) -> Option<&[f32; 16]> {
        self.padded.as_ref()
    }

    /// The decision thresholds between consecutive centroids.
    pub fn thresholds(&self) -> &[f32] {
        &self.thresholds
    }

    /// Expected squared error per coordinate on N(0, 1).
    pub fn mse(&self) -> f64 {
        self.mse
    }

    /// Index of the centroid nearest `x` (a coordinate divided by its block's
    /// RMS); a value exactly on a threshold goes to the lower centroid.
    #[inline]
    pub fn index(&self, x: f32) -> u8 {
        self.thresholds.partition_point(|&t| t < x) as u8
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Max's 1960 table of optimum quantizers for the normal distribution
    /// (distortion per level count), to four significant digits.
    #[test]
    fn distortions_match_the_published_optimum() {
        for (bits, published) in [(1u8, 0.3634), (2, 0.1175), (3, 0.03454), (4, 0.009497)] {
            let m = LloydMax::of(bits).mse();
            assert!(
                (m - published).abs() < 1e-3 * published + 5e-6,
                "{bits}: {m}"
            );
        }
        // Panter–Dite: the distortion approaches (π√3/2)·4^−b from below.
        let asymptote = |b: i32| std::f64::consts::PI * 3f64.sqrt() / 2.0 * 4f64.powi(-b);
        for bits in 5u8..=8 {
            let m = LloydMax::of(bits).mse();
            assert!(
                m < asymptote(i32::from(bits)) && m > 0.8 * asymptote(i32::from(bits)),
                "{bits}: {m}"
            );
        }
        let c = LloydMax::of(1).centroids();
        approx::assert_abs_diff_eq!(
            f64::from(c[1]),
            (2.0 / std::f64::consts::PI).sqrt(),
            epsilon = 1e-6
        );
    }

    #[test]
    fn centroids_are_symmetric_sorted_cell_means() {
        for bits in BITS {
            let lm = LloydMax::of(bits);
            let c = lm.centroids();
            assert_eq!(c.len(), 1 << bits);
            assert!(c.windows(2).all(|w| w[0] < w[1]), "{bits}");
            for (a, b) in c.iter().zip(c.iter().rev()) {
                assert!((a + b).abs() < 1e-6, "{bits}: {a} {b}");
            }
            for (k, &v) in c.iter().enumerate() {
                assert_eq!(usize::from(lm.index(v)), k, "{bits}");
            }
        }
    }

    #[test]
    fn index_is_the_nearest_centroid() {
        let lm = LloydMax::of(3);
        for i in -4000..4000 {
            let x = i as f32 * 1e-3;
            let q = usize::from(lm.index(x));
            let err = (lm.centroids()[q] - x).abs();
            assert!(lm.centroids().iter().all(|c| err <= (c - x).abs()), "{x}");
        }
    }
}
