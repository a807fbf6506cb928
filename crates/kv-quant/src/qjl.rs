//! The 1-bit quantized Johnson–Lindenstrauss sketch of a residual (QJL;
//! TurboQuant's inner-product variant, `+qjl` on `lm<b>` forms).
//!
//! For a block's residual `r` (rotated coordinates minus their Lloyd-Max
//! reconstruction) the store keeps `s = sign(S·r)` (one bit per coordinate)
//! and `‖r‖`, with `S` an `N × N` matrix of independent standard normals.
//! Decoding gives `r̃ = √(π/2)/N · ‖r‖ · Sᵀ·s`, an unbiased estimate of `r`
//! over the draw of `S` (`E[Sᵀ sign(S r)] = N·√(2/π)·r/‖r‖`), so the inner
//! product of a query with `x̂ + r̃` is unbiased too. Its variance is large;
//! whether the bias removed is worth the variance added is measured on the
//! real model (kv-eval's frontier).
//!
//! `S` is drawn once per block size from the workspace's seeded stream
//! ([`FaultRng`], seed [`SKETCH_SEED`], stream `N`), by Box–Muller over
//! `libm` so every machine draws the same matrix.

use std::sync::OnceLock;

use gf2_codes::channel::FaultRng;

use crate::spec::MAX_ROTATION_BLOCK;

/// Seed of the sketch matrices of the stores.
pub const SKETCH_SEED: u64 = 0x0051_C0DE;

/// A QJL sketch matrix for blocks of `N` coordinates.
#[derive(Clone, Debug, PartialEq)]
pub struct QjlSketch {
    n: usize,
    /// `N × N`, row-major.
    matrix: Vec<f32>,
}

impl QjlSketch {
    /// The sketch of blocks of `n` coordinates drawn from `seed`.
    pub fn with_seed(n: usize, seed: u64) -> Self {
        let mut rng = FaultRng::with_stream(seed, n as u64);
        let mut matrix = Vec::with_capacity(n * n);
        while matrix.len() < n * n {
            // Box–Muller: two normals from two uniforms in (0, 1].
            let u1 = 1.0 - rng.next_f64();
            let u2 = rng.next_f64();
            let radius = libm::sqrt(-2.0 * libm::log(u1));
            let angle = 2.0 * std::f64::consts::PI * u2;
            matrix.push((radius * libm::cos(angle)) as f32);
            matrix.push((radius * libm::sin(angle)) as f32);
        }
        matrix.truncate(n * n);
        Self { n, matrix }
    }

    /// The stores' sketch for blocks of `n` coordinates (a power of two up
    /// to the largest rotation block), built once and shared.
    ///
    /// # Panics
    /// If `n` is not such a power of two.
    pub fn of(n: usize) -> &'static QjlSketch {
        assert!(
            n.is_power_of_two() && (2..=MAX_ROTATION_BLOCK).contains(&n),
            "QJL blocks are powers of two up to {MAX_ROTATION_BLOCK}"
        );
        static CACHE: OnceLock<Vec<OnceLock<QjlSketch>>> = OnceLock::new();
        let cache = CACHE.get_or_init(|| {
            (0..=MAX_ROTATION_BLOCK.trailing_zeros())
                .map(|_| OnceLock::new())
                .collect()
        });
        cache[n.trailing_zeros() as usize].get_or_init(|| Self::with_seed(n, SKETCH_SEED))
    }

    /// Coordinates per block.
    pub fn len(&self) -> usize {
        self.n
    }

    /// Whether the sketch is empty (never, for a built sketch).
    pub fn is_empty(&self) -> bool {
        self.n == 0
    }

    /// The sign bits of `S·r` (bit `i` set when row `i` gives a value ≥ 0),
    /// written one per entry of `bits` (0 or 1).
    pub fn signs(&self, r: &[f32], bits: &mut [u8]) {
        for (row, b) in self.matrix.chunks_exact(self.n).zip(bits.iter_mut()) {
            let dot: f32 = row.iter().zip(r).map(|(s, x)| s * x).sum();
            *b = u8::from(dot >= 0.0);
        }
    }

    /// Adds the residual estimate `√(π/2)/N · norm · Sᵀ·s` to `out`, with
    /// `s` the ±1 signs given as bits (0 or 1).
    pub fn add_estimate(&self, bits: &[u8], norm: f32, out: &mut [f32]) {
        let k = (std::f32::consts::PI / 2.0).sqrt() / self.n as f32 * norm;
        for (row, &b) in self.matrix.chunks_exact(self.n).zip(bits) {
            let s = if b == 1 { k } else { -k };
            for (o, &m) in out.iter_mut().zip(row) {
                *o += s * m;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Averaged over independent sketches, the estimate of `⟨q, r⟩` tends to
    /// the true value (unbiasedness), while one estimate is noisy.
    #[test]
    fn estimates_are_unbiased_over_the_draw_of_s() {
        let n = 32;
        let r: Vec<f32> = (0..n).map(|i| ((i * 7 % 11) as f32 - 5.0) * 0.1).collect();
        let q: Vec<f32> = (0..n).map(|i| ((i * 3 % 5) as f32 - 2.0) * 0.3).collect();
        let norm = r.iter().map(|x| x * x).sum::<f32>().sqrt();
        let truth: f64 = q.iter().zip(&r).map(|(a, b)| f64::from(a * b)).sum();
        let trials = 4000;
        let mut mean = 0.0f64;
        let mut bits = vec![0u8; n];
        for seed in 0..trials {
            let s = QjlSketch::with_seed(n, seed);
            s.signs(&r, &mut bits);
            let mut est = vec![0.0f32; n];
            s.add_estimate(&bits, norm, &mut est);
            mean += q
                .iter()
                .zip(&est)
                .map(|(a, b)| f64::from(a * b))
                .sum::<f64>();
        }
        mean /= trials as f64;
        assert!(
            (mean - truth).abs() < 0.05 * truth.abs().max(0.1),
            "{mean} vs {truth}"
        );
    }

    #[test]
    fn the_stores_sketch_is_pinned() {
        let a = QjlSketch::of(64);
        assert_eq!(*a, QjlSketch::with_seed(64, SKETCH_SEED));
        assert_eq!(a.len(), 64);
        let mean: f32 = a.matrix.iter().sum::<f32>() / a.matrix.len() as f32;
        let var: f32 = a.matrix.iter().map(|x| x * x).sum::<f32>() / a.matrix.len() as f32;
        assert!(mean.abs() < 0.05 && (var - 1.0).abs() < 0.1, "{mean} {var}");
    }
}
