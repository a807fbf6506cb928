//! The randomized Hadamard rotation of `+rot` forms (QuaRot, TurboQuant):
//! every block of `N` consecutive channels (`N` a power of two) is mapped to
//! `y = H·D·x / √N`, with `H` the Sylvester–Hadamard matrix (`H² = N·I`) and
//! `D` a fixed diagonal of random signs. The map is orthogonal, so dot
//! products within a block are preserved, and it spreads an outlier channel
//! evenly over the block, which makes each rotated coordinate of a token
//! nearly Gaussian with variance `‖x‖²/N`.
//!
//! Keys can stay rotated in the cache: rotating the query by the same map
//! leaves every score unchanged. Values can be summed rotated and rotated
//! back once per output ([`Hadamard::unrotate`]), since the map is linear.
//!
//! The transform is the in-place fast Walsh–Hadamard butterfly, `N·log₂N`
//! additions. The signs come from the workspace's seeded stream
//! ([`FaultRng`] with seed [`SIGN_SEED`], stream `N`), so every run,
//! machine and release rotates alike.

use std::sync::OnceLock;

use gf2_codes::channel::FaultRng;

use crate::error::{KvQuantError, Result};
use crate::spec::MAX_ROTATION_BLOCK;

/// Seed of the random signs.
pub const SIGN_SEED: u64 = 0x005E_ED0F_4AD4;

/// The rotation of one block size.
#[derive(Clone, Debug, PartialEq)]
pub struct Hadamard {
    block: usize,
    signs: Vec<f32>,
    scale: f32,
}

impl Hadamard {
    /// The rotation of blocks of `block` channels (a power of two from 2 to
    /// 4096), built once per size and shared.
    pub fn of(block: usize) -> Result<&'static Hadamard> {
        if !block.is_power_of_two() || !(2..=MAX_ROTATION_BLOCK).contains(&block) {
            return Err(KvQuantError::InvalidParameter {
                name: "rotation block",
                reason: format!("{block} is not a power of two from 2 to {MAX_ROTATION_BLOCK}"),
            });
        }
        static CACHE: OnceLock<Vec<OnceLock<Hadamard>>> = OnceLock::new();
        let cache = CACHE.get_or_init(|| {
            (0..=MAX_ROTATION_BLOCK.trailing_zeros())
                .map(|_| OnceLock::new())
                .collect()
        });
        Ok(cache[block.trailing_zeros() as usize].get_or_init(|| Self::build(block)))
    }

    fn build(block: usize) -> Hadamard {
        let mut rng = FaultRng::with_stream(SIGN_SEED, block as u64);
        let mut signs = Vec::with_capacity(block);
        while signs.len() < block {
            let bits = rng.next_u64();
            for i in 0..64.min(block - signs.len()) {
                signs.push(if bits >> i & 1 == 1 { -1.0 } else { 1.0 });
            }
        }
        Hadamard {
            block,
            signs,
            scale: 1.0 / (block as f32).sqrt(),
        }
    }

    /// Channels per block.
    pub fn block(&self) -> usize {
        self.block
    }

    /// The diagonal of signs `D`.
    pub fn signs(&self) -> &[f32] {
        &self.signs
    }

    /// Rotates every block of `x` in place: `x ← H·D·x/√N`.
    ///
    /// # Panics
    /// If `x.len()` is not a multiple of the block.
    pub fn rotate(&self, x: &mut [f32]) {
        self.check(x);
        crate::simd::with_avx2(|| {
            for b in x.chunks_exact_mut(self.block) {
                for (v, s) in b.iter_mut().zip(&self.signs) {
                    *v *= s;
                }
                butterfly(b);
                for v in b.iter_mut() {
                    *v *= self.scale;
                }
            }
        });
    }

    /// Undoes [`rotate`](Self::rotate) on every block: `x ← D·H·x/√N`.
    ///
    /// # Panics
    /// If `x.len()` is not a multiple of the block.
    pub fn unrotate(&self, x: &mut [f32]) {
        self.check(x);
        crate::simd::with_avx2(|| {
            for b in x.chunks_exact_mut(self.block) {
                butterfly(b);
                for (v, s) in b.iter_mut().zip(&self.signs) {
                    *v *= s * self.scale;
                }
            }
        });
    }

    fn check(&self, x: &[f32]) {
        assert!(
            x.len().is_multiple_of(self.block),
            "{} values are not whole blocks of {}",
            x.len(),
            self.block
        );
    }
}

/// The unnormalised Walsh–Hadamard transform of one block, in place.
#[inline(always)]
fn butterfly(x: &mut [f32]) {
    let n = x.len();
    let mut h = 1;
    while h < n {
        for pair in x.chunks_exact_mut(2 * h) {
            let (a, b) = pair.split_at_mut(h);
            for (a, b) in a.iter_mut().zip(b.iter_mut()) {
                let (u, v) = (*a, *b);
                *a = u + v;
                *b = u - v;
            }
        }
        h *= 2;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// `H` by its definition, `H[i][j] = (−1)^popcount(i & j)`.
    fn hadamard_entry(i: usize, j: usize) -> f64 {
        if (i & j).count_ones().is_multiple_of(2) {
            1.0
        } else {
            -1.0
        }
    }

    #[test]
    fn the_matrix_is_orthogonal_and_the_butterfly_is_h_times_d() {
        for block in [2usize, 4, 16, 64, 128] {
            let r = Hadamard::of(block).unwrap();
            // Columns of the rotation: images of the unit vectors.
            let columns: Vec<Vec<f32>> = (0..block)
                .map(|j| {
                    let mut e = vec![0.0; block];
                    e[j] = 1.0;
                    r.rotate(&mut e);
                    e
                })
                .collect();
            for (j, col) in columns.iter().enumerate() {
                for (i, &v) in col.iter().enumerate() {
                    let expect =
                        hadamard_entry(i, j) * f64::from(r.signs()[j]) / (block as f64).sqrt();
                    approx::assert_abs_diff_eq!(f64::from(v), expect, epsilon = 1e-6);
                }
            }
            for a in 0..block {
                for b in 0..block {
                    let dot: f64 = columns[a]
                        .iter()
                        .zip(&columns[b])
                        .map(|(x, y)| f64::from(*x) * f64::from(*y))
                        .sum();
                    let expect = if a == b { 1.0 } else { 0.0 };
                    approx::assert_abs_diff_eq!(dot, expect, epsilon = 1e-5);
                }
            }
        }
    }

    #[test]
    fn signs_are_pinned_and_balanced() {
        let r = Hadamard::of(64).unwrap();
        let negative = r.signs().iter().filter(|&&s| s < 0.0).count();
        assert!((16..48).contains(&negative), "{negative}");
        // The same signs on every call and every build.
        assert_eq!(Hadamard::build(64), *r);
        assert!(Hadamard::of(48).is_err());
        assert!(Hadamard::of(1).is_err());
        assert!(Hadamard::of(8192).is_err());
    }

    proptest! {
        #[test]
        fn rotation_preserves_dot_products_and_round_trips(
            x in proptest::collection::vec(-10f32..10.0, 128),
            y in proptest::collection::vec(-10f32..10.0, 128),
            log_block in 1u32..8,
        ) {
            let r = Hadamard::of(1 << log_block).unwrap();
            let (mut rx, mut ry) = (x.clone(), y.clone());
            r.rotate(&mut rx);
            r.rotate(&mut ry);
            let dot = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(p, q)| f64::from(*p) * f64::from(*q)).sum::<f64>();
            let norm = dot(&x, &x).sqrt() * dot(&y, &y).sqrt();
            prop_assert!(approx::abs_diff_eq!(dot(&x, &y), dot(&rx, &ry), epsilon = 1e-5 * norm.max(1.0)));
            r.unrotate(&mut rx);
            for (a, b) in rx.iter().zip(&x) {
                prop_assert!(approx::abs_diff_eq!(a, b, epsilon = 1e-5 * (1.0 + b.abs())));
            }
        }
    }
}
