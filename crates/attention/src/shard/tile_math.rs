//! The inner loops of attention over a `shard` layer, compiled for each
//! instruction set the kernels use ([`crate::kernel::isa`]): scores of one
//! query over a key tile stored channel by channel, and a tile's RoPE
//! pairs turned by their offsets. The crate itself is built for baseline
//! x86-64 (no FMA, 128-bit vectors), where these loops ran 3-4x slower
//! (`shard_decode`, 2026-11-26). Scores use FMA where the host has it, so
//! they can differ in the last bits between hosts, as the FP16 kernels'
//! do; turned keys are the same bits everywhere.

use super::TILE;
use crate::kernel::{Isa, isa};

/// `acc[t] = Σ_e q[e]·keys[e·n + t]` for the `n = acc.len()` tokens of a
/// tile whose keys are stored channel by channel (`q.len()` rows of `n`).
pub(super) fn score_tile(q: &[f32], keys: &[f32], acc: &mut [f32]) {
    debug_assert_eq!(keys.len(), q.len() * acc.len());
    match isa() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `isa()` found AVX-512F and FMA on this host.
        Isa::Avx512 => unsafe { score_tile_avx512(q, keys, acc) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `isa()` found AVX2 and FMA on this host.
        Isa::Avx2 => unsafe { score_tile_avx2(q, keys, acc) },
        Isa::Generic => score_tile_body::<false>(q, keys, acc),
    }
}

/// Turns RoPE pair `i` of each token in a tile stored channel by channel
/// (`head`: `d` rows of `n`): rows `a` and `b` of `index[i] = (a, b)`
/// (`a < b`) by the angles whose `cos`/`sin` are row `i` of `cos`/`sin`
/// (`pairs × stride`, offsets `0..n` used).
pub(super) fn turn_pairs(
    head: &mut [f32],
    n: usize,
    index: &[(usize, usize)],
    cos: &[f32],
    sin: &[f32],
    stride: usize,
) {
    match isa() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `isa()` found AVX-512F and FMA on this host.
        Isa::Avx512 => unsafe { turn_pairs_avx512(head, n, index, cos, sin, stride) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `isa()` found AVX2 and FMA on this host.
        Isa::Avx2 => unsafe { turn_pairs_avx2(head, n, index, cos, sin, stride) },
        Isa::Generic => turn_pairs_body(head, n, index, cos, sin, stride),
    }
}

/// `out[h][e] += Σ_k bins[k][h]·centroids[k][e]`: up to four heads' weight
/// histograms over a codebook of four-channel centroids, as one 4×4 block
/// of sums (a vector of 16 lanes per bin where the host has AVX-512).
pub(super) fn weigh_codebook(bins: &[[f32; 4]], centroids: &[[f32; 4]], out: &mut [[f32; 4]; 4]) {
    match isa() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `isa()` found AVX-512F and FMA on this host.
        Isa::Avx512 => unsafe { weigh_codebook_avx512(bins, centroids, out) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `isa()` found AVX2 and FMA on this host.
        Isa::Avx2 => unsafe { weigh_codebook_avx2(bins, centroids, out) },
        Isa::Generic => weigh_codebook_body::<false>(bins, centroids, out),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,fma")]
fn weigh_codebook_avx512(bins: &[[f32; 4]], centroids: &[[f32; 4]], out: &mut [[f32; 4]; 4]) {
    weigh_codebook_body::<true>(bins, centroids, out);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn weigh_codebook_avx2(bins: &[[f32; 4]], centroids: &[[f32; 4]], out: &mut [[f32; 4]; 4]) {
    weigh_codebook_body::<true>(bins, centroids, out);
}

#[inline(always)]
fn weigh_codebook_body<const FMA: bool>(
    bins: &[[f32; 4]],
    centroids: &[[f32; 4]],
    out: &mut [[f32; 4]; 4],
) {
    let mut acc = [[0.0f32; 4]; 4];
    for (b, c) in bins.iter().zip(centroids) {
        for (a, &w) in acc.iter_mut().zip(b) {
            for (a, &c) in a.iter_mut().zip(c) {
                *a = mul_add::<FMA>(w, c, *a);
            }
        }
    }
    for (o, a) in out.iter_mut().zip(&acc) {
        for (o, &a) in o.iter_mut().zip(a) {
            *o += a;
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,fma")]
fn score_tile_avx512(q: &[f32], keys: &[f32], acc: &mut [f32]) {
    score_tile_body::<true>(q, keys, acc);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn score_tile_avx2(q: &[f32], keys: &[f32], acc: &mut [f32]) {
    score_tile_body::<true>(q, keys, acc);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,fma")]
fn turn_pairs_avx512(
    head: &mut [f32],
    n: usize,
    index: &[(usize, usize)],
    cos: &[f32],
    sin: &[f32],
    stride: usize,
) {
    turn_pairs_body(head, n, index, cos, sin, stride);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn turn_pairs_avx2(
    head: &mut [f32],
    n: usize,
    index: &[(usize, usize)],
    cos: &[f32],
    sin: &[f32],
    stride: usize,
) {
    turn_pairs_body(head, n, index, cos, sin, stride);
}

/// `a + x·y`, fused where the instruction set has FMA.
#[inline(always)]
fn mul_add<const FMA: bool>(x: f32, y: f32, a: f32) -> f32 {
    if FMA { x.mul_add(y, a) } else { a + x * y }
}

#[inline(always)]
fn score_tile_body<const FMA: bool>(q: &[f32], keys: &[f32], acc: &mut [f32]) {
    let n = acc.len();
    if n == TILE {
        // A whole tile: the sums stay in registers across the channels.
        let mut a = [0.0f32; TILE];
        for (&x, row) in q.iter().zip(keys.as_chunks::<TILE>().0) {
            for (a, &k) in a.iter_mut().zip(row) {
                *a = mul_add::<FMA>(x, k, *a);
            }
        }
        acc.copy_from_slice(&a);
        return;
    }
    acc.fill(0.0);
    for (&x, row) in q.iter().zip(keys.chunks_exact(n)) {
        for (a, &k) in acc.iter_mut().zip(row) {
            *a = mul_add::<FMA>(x, k, *a);
        }
    }
}

#[inline(always)]
fn turn_pairs_body(
    head: &mut [f32],
    n: usize,
    index: &[(usize, usize)],
    cos: &[f32],
    sin: &[f32],
    stride: usize,
) {
    for (i, &(a, b)) in index.iter().enumerate() {
        let (cos, sin) = (&cos[i * stride..][..n], &sin[i * stride..][..n]);
        let (lo, hi) = head.split_at_mut(b * n);
        let (x, y) = (&mut lo[a * n..][..n], &mut hi[..n]);
        // Two products each, as the scalar rotation rounds them (no FMA),
        // so the turned keys are the same bits on every instruction set.
        for (((x, y), &c), &s) in x.iter_mut().zip(y).zip(cos).zip(sin) {
            let (p, q) = (*x, *y);
            *x = p * c - q * s;
            *y = p * s + q * c;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// This host's instruction set's scores and the generic ones within
    /// rounding of an f64 sum, for whole and partial tiles.
    #[test]
    fn scores_match_an_f64_sum() {
        for n in [TILE, 37, 1] {
            let d = 24;
            let q: Vec<f32> = (0..d).map(|e| (e as f32 * 0.37).sin()).collect();
            let keys: Vec<f32> = (0..d * n).map(|i| (i as f32 * 0.11).cos()).collect();
            let mut acc = vec![f32::NAN; n];
            score_tile(&q, &keys, &mut acc);
            let mut generic = vec![f32::NAN; n];
            score_tile_body::<false>(&q, &keys, &mut generic);
            for t in 0..n {
                let want: f64 = (0..d)
                    .map(|e| f64::from(q[e]) * f64::from(keys[e * n + t]))
                    .sum();
                let bound = 1e-5 * (1.0 + want.abs());
                assert!((f64::from(acc[t]) - want).abs() <= bound, "n {n} t {t}");
                assert!((f64::from(generic[t]) - want).abs() <= bound, "n {n} t {t}");
            }
        }
    }

    /// Codebook sums within rounding of an f64 sum, added to what `out` held.
    #[test]
    fn codebook_sums_match_an_f64_sum() {
        let bins: Vec<[f32; 4]> = (0..256)
            .map(|k| std::array::from_fn(|h| ((k * 4 + h) as f32 * 0.61).sin().abs()))
            .collect();
        let centroids: Vec<[f32; 4]> = (0..256)
            .map(|k| std::array::from_fn(|e| ((k * 4 + e) as f32 * 0.23).cos()))
            .collect();
        let mut out = [[1.0f32; 4]; 4];
        weigh_codebook(&bins, &centroids, &mut out);
        for h in 0..4 {
            for e in 0..4 {
                let want: f64 = 1.0
                    + (0..256)
                        .map(|k| f64::from(bins[k][h]) * f64::from(centroids[k][e]))
                        .sum::<f64>();
                assert!((f64::from(out[h][e]) - want).abs() <= 1e-5 * want.abs().max(1.0));
            }
        }
    }

    /// Turned pairs (on this host's instruction set) equal the scalar
    /// rotation bit for bit, for both layouts.
    #[test]
    fn turned_pairs_equal_the_scalar_rotation() {
        let (d, n, stride) = (8, 5, 7);
        let cos: Vec<f32> = (0..4 * stride).map(|i| (i as f32 * 0.3).cos()).collect();
        let sin: Vec<f32> = (0..4 * stride).map(|i| (i as f32 * 0.3).sin()).collect();
        for index in [
            vec![(0, 1), (2, 3), (4, 5), (6, 7)],
            vec![(0, 4), (1, 5), (2, 6), (3, 7)],
        ] {
            let head: Vec<f32> = (0..d * n).map(|i| i as f32 - 17.5).collect();
            let mut turned = head.clone();
            turn_pairs(&mut turned, n, &index, &cos, &sin, stride);
            for (i, &(a, b)) in index.iter().enumerate() {
                for t in 0..n {
                    let (c, s) = (cos[i * stride + t], sin[i * stride + t]);
                    let (x, y) = (head[a * n + t], head[b * n + t]);
                    assert_eq!(turned[a * n + t].to_bits(), (x * c - y * s).to_bits());
                    assert_eq!(turned[b * n + t].to_bits(), (x * s + y * c).to_bits());
                }
            }
        }
    }
}
