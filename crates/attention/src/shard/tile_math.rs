//! The inner loops of attention over a `shard` layer, compiled for each
//! instruction set the kernels use (the configured [`Isa`]): scores of one
//! query over a key tile stored channel by channel, a tile's RoPE pairs
//! turned by their offsets, and VQ weight histograms weighed against the
//! codebook. The crate itself is built for baseline x86-64 (no FMA,
//! 128-bit vectors), where these loops ran 3-4x slower (`shard_decode`,
//! 2026-11-26). Sums use FMA where the host has it, so they can differ in
//! the last bits between hosts, as the FP16 kernels' do; turned keys are
//! the same bits everywhere.

use super::TILE;
use crate::isa::Isa;
use crate::rope::Rope;

/// `cos`, `sin` of `θᵢ·j` for offsets `j < TILE` within a tile, per pair.
#[derive(Debug)]
pub(super) struct OffsetTable {
    /// The two channels of each pair within a head.
    pub(super) index: Vec<(usize, usize)>,
    /// `pairs × TILE` each: pair `i`'s row holds every offset, so a tile's
    /// keys (stored channel by channel) turn with unit-stride loops.
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl OffsetTable {
    pub(super) fn new(rope: &Rope) -> Self {
        let pairs = rope.inv_freq().len();
        let (mut cos, mut sin) = (
            Vec::with_capacity(TILE * pairs),
            Vec::with_capacity(TILE * pairs),
        );
        for &f in rope.inv_freq() {
            for j in 0..TILE {
                let (s, c) = (j as f64 * f).sin_cos();
                cos.push(c as f32);
                sin.push(s as f32);
            }
        }
        let index = (0..pairs).map(|i| rope.pair(i)).collect();
        Self { index, cos, sin }
    }
}

/// A function run by its `body::<FMA>` compiled for AVX-512 and AVX2 (both
/// with FMA) or for the baseline, as its first argument, the configured
/// [`Isa`] (a set this CPU supports), says.
macro_rules! per_isa {
    (
        $(#[$doc:meta])*
        fn $name:ident / $avx512:ident / $avx2:ident ($($arg:ident: $ty:ty),* $(,)?) => $body:ident
    ) => {
        $(#[$doc])*
        pub(super) fn $name(isa: Isa, $($arg: $ty),*) {
            match isa {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: a configured `Isa` is one this CPU supports:
                // AVX-512F and FMA.
                Isa::Avx512 | Isa::Avx512Vnni => unsafe { $avx512($($arg),*) },
                #[cfg(target_arch = "x86_64")]
                // SAFETY: as above: AVX2 and FMA.
                Isa::Avx2 => unsafe { $avx2($($arg),*) },
                _ => $body::<false>($($arg),*),
            }
        }

        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = "avx512f,fma")]
        fn $avx512($($arg: $ty),*) {
            $body::<true>($($arg),*)
        }

        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = "avx2,fma")]
        fn $avx2($($arg: $ty),*) {
            $body::<true>($($arg),*)
        }
    };
}

per_isa! {
    /// `acc[t] = Σ_e q[e]·keys[e·n + t]` for the `n = acc.len()` tokens of a
    /// tile whose keys are stored channel by channel (`q.len()` rows of `n`).
    fn score_tile / score_tile_avx512 / score_tile_avx2
        (q: &[f32], keys: &[f32], acc: &mut [f32]) => score_tile_body
}

per_isa! {
    /// Turns each RoPE pair of each token in a tile stored channel by
    /// channel (`head`: `d` rows of `n`) by its angle at the token's offset
    /// in the tile.
    fn turn_pairs / turn_pairs_avx512 / turn_pairs_avx2
        (head: &mut [f32], n: usize, table: &OffsetTable) => turn_pairs_body
}

per_isa! {
    /// `out[h][e] += Σ_k bins[k][h]·centroids[k][e]`: up to four heads'
    /// weight histograms over a codebook of four-channel centroids, as one
    /// 4×4 block of sums.
    fn weigh_codebook / weigh_codebook_avx512 / weigh_codebook_avx2
        (bins: &[[f32; 4]], centroids: &[[f32; 4]], out: &mut [[f32; 4]; 4]) => weigh_codebook_body
}

/// `a + x·y`, fused where the instruction set has FMA.
#[inline(always)]
fn mul_add<const FMA: bool>(x: f32, y: f32, a: f32) -> f32 {
    if FMA { x.mul_add(y, a) } else { a + x * y }
}

#[inline(always)]
fn score_tile_body<const FMA: bool>(q: &[f32], keys: &[f32], acc: &mut [f32]) {
    debug_assert_eq!(keys.len(), q.len() * acc.len());
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

/// (Two products each, as the scalar rotation rounds them: no FMA on any
/// instruction set, so the turned keys are the same bits everywhere.)
#[inline(always)]
fn turn_pairs_body<const FMA: bool>(head: &mut [f32], n: usize, table: &OffsetTable) {
    for (i, &(a, b)) in table.index.iter().enumerate() {
        let (cos, sin) = (&table.cos[i * TILE..][..n], &table.sin[i * TILE..][..n]);
        // Both layouts put a pair's first channel first (`a < b`).
        let (lo, hi) = head.split_at_mut(b * n);
        let (x, y) = (&mut lo[a * n..][..n], &mut hi[..n]);
        for (((x, y), &c), &s) in x.iter_mut().zip(y).zip(cos).zip(sin) {
            let (p, q) = (*x, *y);
            *x = p * c - q * s;
            *y = p * s + q * c;
        }
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Every instruction set's scores of this host and the generic ones
    /// within rounding of an f64 sum, for whole and partial tiles.
    #[test]
    fn scores_match_an_f64_sum() {
        for (isa, n) in Isa::available()
            .into_iter()
            .flat_map(|isa| [TILE, 37, 1].map(|n| (isa, n)))
        {
            let d = 24;
            let q: Vec<f32> = (0..d).map(|e| (e as f32 * 0.37).sin()).collect();
            let keys: Vec<f32> = (0..d * n).map(|i| (i as f32 * 0.11).cos()).collect();
            let mut acc = vec![f32::NAN; n];
            score_tile(isa, &q, &keys, &mut acc);
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

    /// Codebook sums within rounding of an f64 sum, added to what `out`
    /// held, on every instruction set of this host.
    #[test]
    fn codebook_sums_match_an_f64_sum() {
        for isa in Isa::available() {
            codebook_sums_on(isa);
        }
    }

    fn codebook_sums_on(isa: Isa) {
        let bins: Vec<[f32; 4]> = (0..256)
            .map(|k| std::array::from_fn(|h| ((k * 4 + h) as f32 * 0.61).sin().abs()))
            .collect();
        let centroids: Vec<[f32; 4]> = (0..256)
            .map(|k| std::array::from_fn(|e| ((k * 4 + e) as f32 * 0.23).cos()))
            .collect();
        let mut out = [[1.0f32; 4]; 4];
        weigh_codebook(isa, &bins, &centroids, &mut out);
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

    /// Turned pairs (on every instruction set of this host) equal the
    /// scalar rotation bit for bit, for both layouts.
    #[test]
    fn turned_pairs_equal_the_scalar_rotation() {
        use crate::rope::RopeLayout;
        let (d, n) = (8, 5);
        let layouts = [RopeLayout::Adjacent, RopeLayout::RotateHalf];
        for (isa, layout) in Isa::available()
            .into_iter()
            .flat_map(|isa| layouts.map(|l| (isa, l)))
        {
            let table = OffsetTable::new(&Rope::new(layout, d, d, 100.0).unwrap());
            let head: Vec<f32> = (0..d * n).map(|i| i as f32 - 17.5).collect();
            let mut turned = head.clone();
            turn_pairs(isa, &mut turned, n, &table);
            for (i, &(a, b)) in table.index.iter().enumerate() {
                for t in 0..n {
                    let (c, s) = (table.cos[i * TILE + t], table.sin[i * TILE + t]);
                    let (x, y) = (head[a * n + t], head[b * n + t]);
                    assert_eq!(turned[a * n + t].to_bits(), (x * c - y * s).to_bits());
                    assert_eq!(turned[b * n + t].to_bits(), (x * s + y * c).to_bits());
                }
            }
        }
    }
}
