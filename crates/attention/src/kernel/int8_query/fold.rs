//! One query head folded with a block's per-channel key scales and coded
//! by channel class: `q'_c = q_c·a_c`, the sums `Σ q'` and `Σ q_c·b_c`,
//! and the class codes of `q'` ([`super::classes`]) with their weighted
//! sum. The per-channel pass does this once per head and group of tokens.
//! The portable composition keeps `q'` and 64 lane peaks in arrays the
//! compiler spills: at 64 tokens a group it was a fifth of a paged
//! `int4-ch` decode at 32/8/128 (`perf`, paged-cache's
//! `paged_decode_timing`). The AVX2 body keeps them in registers for heads
//! of a multiple of 64 channels: a tenth of the decode, which went from
//! 12.3-12.8 to 10.7-10.9 ms over 16K tokens on one Zen 3 thread. With
//! AVX-512, [`fold_heads`] folds up to four query heads of one key head
//! together (`avx512.rs`): one thread's decode over 64K tokens in blocks
//! of 64 on the Intel VNNI host went from 26.8 to 23.7 ms, the fold from
//! 13.5% of it to 7%. All give the same bits: the same float operations
//! on the same lanes in the same order (tested).

use super::Dot;
use super::classes::{quantize_classes, weighted_code_sum};

/// One head's folded query, coded by class.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(super) struct FoldedHead {
    /// `Σ_c q_c·a_c`, summed as [`fold`] sums it.
    pub(super) folded_sum: f32,
    /// `Σ_c q_c·b_c`, likewise.
    pub(super) offset_sum: f32,
    /// The unit `u` of the class scales `u·w_k`.
    pub(super) unit: f32,
    /// The class weights, each twice (as `vpmaddwd` reads them).
    pub(super) weights: [i16; 16],
    /// `Σ_c w_class(c)·code_c`.
    pub(super) code_sum: i64,
}

impl FoldedHead {
    /// A head whose folded query is all zeros: unit, weights and codes 0.
    #[cfg(target_arch = "x86_64")]
    fn zero(folded_sum: f32, offset_sum: f32) -> Self {
        Self {
            folded_sum,
            offset_sum,
            ..Self::default()
        }
    }
}

/// Query heads folded together by [`fold_heads`]: the GQA group's heads
/// that share one key head's scales, four at a time.
pub(super) const HEADS_TOGETHER: usize = 4;

/// One head's fold: `folded = q·a` channel by channel, and `(Σ folded,
/// Σ q·b)` each summed as [`super::lane_sum`] sums them (16 lanes in chunk
/// order, the rest into the first lanes, then the lanes in order): the
/// same bits as the three passes it replaces, in one.
#[inline(always)]
pub(super) fn fold(q: &[f32], a: &[f32], b: &[f32], folded: &mut [f32]) -> (f32, f32) {
    let (mut sums, mut offsets) = ([0.0f32; 16], [0.0f32; 16]);
    let (qs, q_rest) = q.as_chunks::<16>();
    let (as_, a_rest) = a[..q.len()].as_chunks::<16>();
    let (bs, b_rest) = b[..q.len()].as_chunks::<16>();
    let (fs, f_rest) = folded[..q.len()].as_chunks_mut::<16>();
    // Whole arrays by value, so that the lanes stay in registers (an
    // indexed loop over them was compiled scalar).
    for (((q, a), b), f) in qs.iter().zip(as_).zip(bs).zip(fs) {
        let x: [f32; 16] = std::array::from_fn(|l| q[l] * a[l]);
        *f = x;
        sums = std::array::from_fn(|l| sums[l] + x[l]);
        offsets = std::array::from_fn(|l| offsets[l] + q[l] * b[l]);
    }
    for (l, f) in f_rest.iter_mut().enumerate() {
        *f = q_rest[l] * a_rest[l];
        sums[l] += *f;
        offsets[l] += q_rest[l] * b_rest[l];
    }
    (sums.iter().sum(), offsets.iter().sum())
}

/// Folds one head (`q`, with the scales `a` and offsets `b` of its
/// channels) and codes `q'` by class into `codes`, with `folded` as room
/// for `q'`; `None` when `q'` is not finite. The AVX2 body runs where
/// `dot` says the CPU has it and the head is a multiple of 64 channels.
#[inline(always)]
pub(super) fn fold_classes(
    q: &[f32],
    a: &[f32],
    b: &[f32],
    folded: &mut [f32],
    codes: &mut [i8],
    dot: Dot,
) -> Option<FoldedHead> {
    let d = q.len();
    #[cfg(target_arch = "x86_64")]
    if matches!(dot, Dot::Avx2 | Dot::Vnni)
        && d.is_multiple_of(64)
        && a.len() >= d
        && b.len() >= d
        && folded.len() >= d
        && codes.len() >= d
    {
        // SAFETY: a `Dot` is that of a supported `Isa`, and both of these
        // come with AVX2 (`Isa::Avx2` and `Isa::Avx512Vnni` need it); the
        // lengths are checked above.
        return unsafe { avx2::fold_classes(q, a, b, folded, codes) };
    }
    let _ = dot;
    fold_classes_portable(q, a, b, folded, codes)
}

/// [`fold_classes`] for up to [`HEADS_TOGETHER`] query heads of one key
/// head: `q` holds `n` heads of `d = a.len()` channels (`n·d` values,
/// `codes` and `folded` as many), folded with the same `a` and `b`; the
/// first `n` results are theirs. `None` when any head's `q'` is not finite
/// (the caller then scores the whole tile exactly, as for one head).
/// AVX-512 folds the heads together where `dot` is VNNI and `d` a multiple
/// of 64: their loads of `a` and `b` are shared and their dependency
/// chains interleave, which one head at a time left waiting on latencies
/// (about 110 ns a head on the Intel VNNI host at 128 channels, `perf`).
/// Elsewhere one head at a time by [`fold_classes`]. The same bits either
/// way (tested).
#[inline(always)]
pub(super) fn fold_heads(
    q: &[f32],
    a: &[f32],
    b: &[f32],
    folded: &mut [f32],
    codes: &mut [i8],
    dot: Dot,
) -> Option<[FoldedHead; HEADS_TOGETHER]> {
    let d = a.len();
    let n = q.len() / d.max(1);
    assert!(
        (1..=HEADS_TOGETHER).contains(&n)
            && q.len() == n * d
            && b.len() >= d
            && folded.len() >= n * d
            && codes.len() >= n * d,
        "fold_heads: {} query values, {d} channels, {} folded, {} codes",
        q.len(),
        folded.len(),
        codes.len()
    );
    #[cfg(target_arch = "x86_64")]
    if dot == Dot::Vnni && d.is_multiple_of(64) {
        // SAFETY: `Dot::Vnni` is only that of a supported
        // `Isa::Avx512Vnni` (AVX-512F and BW); the lengths are checked above.
        return unsafe {
            match n {
                1 => avx512::fold_heads::<1>(q, a, b, folded, codes),
                2 => avx512::fold_heads::<2>(q, a, b, folded, codes),
                3 => avx512::fold_heads::<3>(q, a, b, folded, codes),
                _ => avx512::fold_heads::<4>(q, a, b, folded, codes),
            }
        };
    }
    let mut heads = [FoldedHead::default(); HEADS_TOGETHER];
    for (j, head) in heads.iter_mut().take(n).enumerate() {
        let span = j * d..(j + 1) * d;
        *head = fold_classes(
            &q[span.clone()],
            a,
            b,
            &mut folded[span.clone()],
            &mut codes[span],
            dot,
        )?;
    }
    Some(heads)
}

/// [`fold_classes`] as the composition of [`fold`],
/// [`quantize_classes`] and [`weighted_code_sum`].
#[inline(always)]
fn fold_classes_portable(
    q: &[f32],
    a: &[f32],
    b: &[f32],
    folded: &mut [f32],
    codes: &mut [i8],
) -> Option<FoldedHead> {
    let d = q.len();
    let (folded_sum, offset_sum) = fold(q, a, b, folded);
    let (unit, weights) = quantize_classes(&folded[..d], &mut codes[..d])?;
    Some(FoldedHead {
        folded_sum,
        offset_sum,
        unit,
        weights,
        code_sum: weighted_code_sum(&codes[..d], &weights),
    })
}

#[cfg(target_arch = "x86_64")]
mod avx512;

#[cfg(target_arch = "x86_64")]
mod avx2 {
    //! [`fold_classes`](super::fold_classes) in AVX2 registers: eight
    //! channels a vector, vector `i` of a head in class `i mod 8`.

    use std::arch::x86_64::*;

    use super::super::classes::max_weight;
    use super::FoldedHead;

    /// Adds 1.5·2^23: rounds to the nearest integer, ties to even (as
    /// [`quantize_classes`](super::quantize_classes) does).
    pub(super) const ROUND: f32 = 12_582_912.0;

    /// `max` of the even-indexed and odd-indexed interleavings of `x` and
    /// `y` (a step of [`lane_maxima`]; a function, not a closure, so that
    /// it is compiled with AVX2 where it is inlined).
    #[inline(always)]
    fn pair_maxima(x: __m256, y: __m256) -> __m256 {
        // SAFETY: register-only AVX operations; only inlined into
        // `fold_classes` (AVX2).
        unsafe { _mm256_max_ps(_mm256_unpacklo_ps(x, y), _mm256_unpackhi_ps(x, y)) }
    }

    /// The second step of [`lane_maxima`].
    #[inline(always)]
    fn quad_maxima(x: __m256, y: __m256) -> __m256 {
        // SAFETY: as in `pair_maxima`.
        unsafe {
            _mm256_max_ps(
                _mm256_shuffle_ps::<0b01_00_01_00>(x, y),
                _mm256_shuffle_ps::<0b11_10_11_10>(x, y),
            )
        }
    }

    /// The lane-wise maxima of eight vectors, vector `k`'s in lane `k`.
    #[inline(always)]
    pub(super) fn lane_maxima(p: [__m256; 8]) -> __m256 {
        let lo = quad_maxima(pair_maxima(p[0], p[1]), pair_maxima(p[2], p[3]));
        let hi = quad_maxima(pair_maxima(p[4], p[5]), pair_maxima(p[6], p[7]));
        // SAFETY: as in `pair_maxima`.
        unsafe {
            _mm256_max_ps(
                _mm256_permute2f128_ps::<0x20>(lo, hi),
                _mm256_permute2f128_ps::<0x31>(lo, hi),
            )
        }
    }

    /// The lane sums of eight i32 vectors, vector `k`'s in lane `k`.
    #[inline(always)]
    pub(super) fn lane_sums(p: [__m256i; 8]) -> __m256i {
        // SAFETY: register-only AVX2 operations; only inlined into
        // `fold_classes` (AVX2).
        unsafe {
            // `vphaddd` twice sums lanes in pairs, then pairs of pairs:
            // per 128-bit half, the partial sums of four vectors.
            let lo =
                _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
            let hi =
                _mm256_hadd_epi32(_mm256_hadd_epi32(p[4], p[5]), _mm256_hadd_epi32(p[6], p[7]));
            _mm256_add_epi32(
                _mm256_permute2x128_si256::<0x20>(lo, hi),
                _mm256_permute2x128_si256::<0x31>(lo, hi),
            )
        }
    }

    /// A head's class scales, from its class peaks: the unit `u`, the
    /// weights `w_k` (whole numbers as floats) and the inverses
    /// `1/(u·w_k)` (0 where `w_k` is 0 or the inverse is not finite), class
    /// `k` in lane `k`: the operations of
    /// [`quantize_classes`](super::quantize_classes), lane by lane.
    pub(super) struct ClassScales {
        pub(super) unit: f32,
        w: __m256,
        pub(super) inv: __m256,
    }

    impl ClassScales {
        /// The scales of a head of `d` channels whose class `k` peaks at
        /// lane `k` of `class_peaks`; `None` when every peak is zero.
        #[inline(always)]
        pub(super) fn of(class_peaks: __m256, d: usize) -> Option<Self> {
            // SAFETY: register-only AVX operations; only inlined into the
            // folds (AVX2, or AVX-512F, which implies it).
            unsafe {
                let magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFF_FFFF));
                let infinity = _mm256_set1_ps(f32::INFINITY);
                // The largest class peak (a maximum, the same in any order).
                let top = _mm256_max_ps(
                    class_peaks,
                    _mm256_permute2f128_ps::<0x01>(class_peaks, class_peaks),
                );
                let top = _mm256_max_ps(top, _mm256_shuffle_ps::<0b01_00_11_10>(top, top));
                let top = _mm256_max_ps(top, _mm256_shuffle_ps::<0b10_11_00_01>(top, top));
                let peak = _mm256_cvtss_f32(top);
                if peak == 0.0 {
                    return None;
                }
                let max_weight = f32::from(max_weight(d));
                let unit = peak / (127.0 * max_weight);
                let wmax = _mm256_set1_ps(max_weight);
                let w = _mm256_min_ps(
                    _mm256_round_ps::<{ _MM_FROUND_TO_POS_INF | _MM_FROUND_NO_EXC }>(
                        _mm256_div_ps(_mm256_mul_ps(wmax, class_peaks), _mm256_set1_ps(peak)),
                    ),
                    wmax,
                );
                let inv =
                    _mm256_div_ps(_mm256_set1_ps(1.0), _mm256_mul_ps(_mm256_set1_ps(unit), w));
                let usable = _mm256_and_ps(
                    _mm256_cmp_ps::<_CMP_GT_OQ>(w, _mm256_setzero_ps()),
                    _mm256_cmp_ps::<_CMP_LT_OQ>(_mm256_and_ps(inv, magnitude), infinity),
                );
                Some(Self {
                    unit,
                    w,
                    inv: _mm256_and_ps(inv, usable),
                })
            }
        }

        /// The weights, each twice as `vpmaddwd` reads them, and `Σ_k
        /// w_k·Σ(class k's codes)` from the class code sums (class `k` in
        /// lane `k`).
        #[inline(always)]
        pub(super) fn weighted_sum(&self, class_sums: __m256i) -> ([i16; 16], i64) {
            // SAFETY: register-only AVX2 operations and stores into local
            // arrays of 16 i16 and 8 i32; only inlined into the folds.
            unsafe {
                // The weights are whole numbers in 0..=W: exact as i32,
                // each twice as i16 (`w_k` in both halves of lane `k`).
                let wi = _mm256_cvttps_epi32(self.w);
                let mut weights = [0i16; 16];
                _mm256_storeu_si256(
                    weights.as_mut_ptr().cast(),
                    _mm256_or_si256(wi, _mm256_slli_epi32::<16>(wi)),
                );
                // At most `d·127·W` in magnitude, which `max_weight` keeps
                // inside i32.
                let mut terms = [0i32; 8];
                _mm256_storeu_si256(
                    terms.as_mut_ptr().cast(),
                    _mm256_mullo_epi32(class_sums, wi),
                );
                (weights, terms.iter().map(|&t| i64::from(t)).sum())
            }
        }
    }

    /// The sixteen lanes of two vectors, in order.
    #[inline(always)]
    fn sixteen(v: [__m256; 2]) -> [f32; 16] {
        let mut x = [0.0f32; 16];
        // SAFETY: two 8-lane stores into 16 floats.
        unsafe {
            _mm256_storeu_ps(x.as_mut_ptr(), v[0]);
            _mm256_storeu_ps(x.as_mut_ptr().add(8), v[1]);
        }
        x
    }

    /// [`fold_classes`](super::fold_classes) for a head of a multiple of
    /// 64 channels.
    ///
    /// # Safety
    /// The CPU must have AVX2; `q.len()` must be a multiple of 64 and `a`,
    /// `b`, `folded` and `codes` at least as long.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn fold_classes(
        q: &[f32],
        a: &[f32],
        b: &[f32],
        folded: &mut [f32],
        codes: &mut [i8],
    ) -> Option<FoldedHead> {
        let d = q.len();
        debug_assert!(d.is_multiple_of(64) && a.len() >= d && b.len() >= d);
        debug_assert!(folded.len() >= d && codes.len() >= d);
        let (q, a, b, f) = (q.as_ptr(), a.as_ptr(), b.as_ptr(), folded.as_mut_ptr());
        // SAFETY: every load and store is within the first `d` values of
        // its slice (vector `i` covers `8i..8i + 8`, `i < d/8`; `codes`
        // takes 32 bytes at `32j`, `j < d/32`).
        unsafe {
            let magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFF_FFFF));
            let infinity = _mm256_set1_ps(f32::INFINITY);
            // Pass 1: the fold, its sums (lanes 0..8 and 8..16 of the
            // portable sixteen), the finite test and the peaks per
            // channel modulo 64.
            let (mut sums, mut offsets) = ([_mm256_setzero_ps(); 2], [_mm256_setzero_ps(); 2]);
            let mut peaks = [_mm256_setzero_ps(); 8];
            let mut finite = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
            // Whole chunks of 64 channels, their eight vectors unrolled, so
            // that the accumulators are registers (indexed by a running
            // vector count they were kept in memory, `perf`).
            for chunk in 0..d / 64 {
                for r in 0..8 {
                    let i = 8 * chunk + r;
                    let qi = _mm256_loadu_ps(q.add(8 * i));
                    let x = _mm256_mul_ps(qi, _mm256_loadu_ps(a.add(8 * i)));
                    _mm256_storeu_ps(f.add(8 * i), x);
                    sums[r % 2] = _mm256_add_ps(sums[r % 2], x);
                    let qb = _mm256_mul_ps(qi, _mm256_loadu_ps(b.add(8 * i)));
                    offsets[r % 2] = _mm256_add_ps(offsets[r % 2], qb);
                    let m = _mm256_and_ps(x, magnitude);
                    finite = _mm256_and_ps(finite, _mm256_cmp_ps::<_CMP_LT_OQ>(m, infinity));
                    // `if a > p { a } else { p }`, as the portable peaks.
                    peaks[r] = _mm256_max_ps(m, peaks[r]);
                }
            }
            // The lanes in order, as `fold` ends.
            let folded_sum: f32 = sixteen(sums).iter().sum();
            let offset_sum: f32 = sixteen(offsets).iter().sum();
            if _mm256_movemask_ps(finite) != 0xFF {
                return None;
            }
            // Pass 2: class peaks and weights, then the codes.
            let Some(scales) = ClassScales::of(lane_maxima(peaks), d) else {
                codes[..d].fill(0);
                return Some(FoldedHead::zero(folded_sum, offset_sum));
            };
            let (unit, inv) = (scales.unit, scales.inv);
            let (low, high) = (_mm256_set1_ps(-127.0), _mm256_set1_ps(127.0));
            let (round, round_bits) = (
                _mm256_set1_ps(ROUND),
                _mm256_set1_epi32(ROUND.to_bits() as i32),
            );
            let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
            let mut class_sums = [_mm256_setzero_si256(); 8];
            let out = codes.as_mut_ptr();
            let mut class_inv = [inv; 8];
            for (k, v) in class_inv.iter_mut().enumerate() {
                *v = _mm256_permutevar8x32_ps(inv, _mm256_set1_epi32(k as i32));
            }
            for chunk in 0..d / 64 {
                for half in 0..2 {
                    let mut c = [_mm256_setzero_si256(); 4];
                    for (r, c) in c.iter_mut().enumerate() {
                        let (k, i) = (4 * half + r, 8 * chunk + 4 * half + r);
                        let y = _mm256_mul_ps(_mm256_loadu_ps(f.add(8 * i)), class_inv[k]);
                        let y = _mm256_min_ps(_mm256_max_ps(y, low), high);
                        *c = _mm256_sub_epi32(
                            _mm256_castps_si256(_mm256_add_ps(y, round)),
                            round_bits,
                        );
                        class_sums[k] = _mm256_add_epi32(class_sums[k], *c);
                    }
                    let bytes = _mm256_packs_epi16(
                        _mm256_packs_epi32(c[0], c[1]),
                        _mm256_packs_epi32(c[2], c[3]),
                    );
                    _mm256_storeu_si256(
                        out.add(64 * chunk + 32 * half).cast(),
                        _mm256_permutevar8x32_epi32(bytes, order),
                    );
                }
            }
            let (weights, code_sum) = scales.weighted_sum(lane_sums(class_sums));
            Some(FoldedHead {
                folded_sum,
                offset_sum,
                unit,
                weights,
                code_sum,
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A generator of f32 values of every kind the fold meets: smooth
    /// values, outlier channels, zeros, tiny values.
    fn values(n: usize, seed: u64, spread: f32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|c| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                let u = (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
                match s % 11 {
                    0 => 0.0,
                    1 => u * spread * 40.0,
                    2 => u * 1e-30,
                    _ => u * spread * (1.0 + (c % 7) as f32),
                }
            })
            .collect()
    }

    /// The AVX2 body gives the portable composition's bits: sums, unit,
    /// weights, codes and code sum, over heads of 64 to 512 channels,
    /// classes left all zero, whole heads of zeros and non-finite folds.
    #[test]
    fn the_avx2_fold_gives_the_portable_bits() {
        let dots = Dot::available();
        let Some(&dot) = dots.iter().find(|&&d| d != Dot::Portable) else {
            test_support::skip(
                test_support::Requirement::Isa,
                "attention",
                "the_avx2_fold_gives_the_portable_bits",
                "no AVX2: only the portable fold exists",
            );
            return;
        };
        let mut checked = 0;
        for d in [64, 128, 192, 256, 512] {
            for seed in 0..60u64 {
                let q = values(d, seed, 2.0);
                let mut a = values(d, seed + 1000, 0.1);
                let b = values(d, seed + 2000, 1.0);
                match seed % 6 {
                    // Class 3 of every chunk all zero.
                    1 => (0..d).filter(|c| c % 64 / 8 == 3).for_each(|c| a[c] = 0.0),
                    // The whole head zero.
                    2 => a.fill(0.0),
                    // A non-finite fold.
                    3 => a[(seed as usize * 37) % d] = f32::INFINITY,
                    4 => a[(seed as usize * 11) % d] = f32::NAN,
                    _ => {}
                }
                let (mut f1, mut f2) = (vec![0.0f32; d], vec![0.0f32; d]);
                let (mut c1, mut c2) = (vec![0i8; d], vec![0i8; d]);
                let portable = fold_classes_portable(&q, &a, &b, &mut f1, &mut c1);
                let fast = fold_classes(&q, &a, &b, &mut f2, &mut c2, dot);
                let bits = |h: Option<FoldedHead>| {
                    h.map(|h| {
                        (
                            h.folded_sum.to_bits(),
                            h.offset_sum.to_bits(),
                            h.unit.to_bits(),
                            h.weights,
                            h.code_sum,
                        )
                    })
                };
                assert_eq!(bits(fast), bits(portable), "d {d} seed {seed}");
                if portable.is_some() {
                    assert_eq!(c2, c1, "codes, d {d} seed {seed}");
                    assert_eq!(
                        f2.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                        f1.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
                    );
                    checked += 1;
                }
            }
        }
        // The non-finite seeds are a third; the rest were compared whole.
        assert!(checked >= 5 * 40, "{checked} finite folds compared");
    }

    /// Heads folded together give each head's portable bits (sums, unit,
    /// weights, codes, code sum), one to four heads over 64 to 512
    /// channels, with zero classes, zero heads and tiny values; one head's
    /// non-finite fold makes the whole call `None`. Run on every way this
    /// CPU folds (AVX-512 where it has VNNI).
    #[test]
    fn heads_folded_together_give_each_heads_portable_bits() {
        if !crate::Isa::Avx512Vnni.is_supported() {
            test_support::skip(
                test_support::Requirement::Isa,
                "attention",
                "heads_folded_together_give_each_heads_portable_bits",
                "no AVX-512 VNNI: only the one-head folds were compared",
            );
        }
        let mut compared = 0;
        for dot in Dot::available() {
            for d in [64, 128, 192, 512] {
                for n in 1..=HEADS_TOGETHER {
                    for seed in 0..24u64 {
                        let q = values(n * d, seed, 2.0);
                        let mut a = values(d, seed + 1000, 0.1);
                        let b = values(d, seed + 2000, 1.0);
                        let mut q = q;
                        match seed % 6 {
                            1 => (0..d).filter(|c| c % 64 / 8 == 5).for_each(|c| a[c] = 0.0),
                            // The last head all zero.
                            2 => q[(n - 1) * d..].fill(0.0),
                            3 => a[(seed as usize * 37) % d] = f32::INFINITY,
                            4 => q[(n - 1) * d + (seed as usize * 11) % d] = f32::NAN,
                            _ => {}
                        }
                        let mut codes = vec![0i8; n * d];
                        let mut folded = vec![0.0f32; n * d];
                        let together = fold_heads(&q, &a, &b, &mut folded, &mut codes, dot);
                        let mut expected = Vec::new();
                        let mut expected_codes = vec![0i8; n * d];
                        for j in 0..n {
                            let mut f = vec![0.0f32; d];
                            expected.push(fold_classes_portable(
                                &q[j * d..][..d],
                                &a,
                                &b,
                                &mut f,
                                &mut expected_codes[j * d..][..d],
                            ));
                        }
                        let any_none = expected.iter().any(Option::is_none);
                        let Some(heads) = together else {
                            assert!(any_none, "{dot:?} d {d} n {n} seed {seed}: None");
                            continue;
                        };
                        assert!(!any_none, "{dot:?} d {d} n {n} seed {seed}: Some");
                        for (j, e) in expected.iter().enumerate() {
                            let (h, e) = (heads[j], e.unwrap());
                            let bits = |h: FoldedHead| {
                                (
                                    h.folded_sum.to_bits(),
                                    h.offset_sum.to_bits(),
                                    h.unit.to_bits(),
                                    h.weights,
                                    h.code_sum,
                                )
                            };
                            assert_eq!(
                                bits(h),
                                bits(e),
                                "{dot:?} d {d} n {n} seed {seed} head {j}"
                            );
                        }
                        assert_eq!(codes, expected_codes, "{dot:?} d {d} n {n} seed {seed}");
                        compared += 1;
                    }
                }
            }
        }
        // Two seeds in six are non-finite.
        assert!(compared >= 4 * 4 * 16, "{compared} calls compared");
    }

    /// Heads that are not a multiple of 64 channels take the portable
    /// composition whatever the CPU.
    #[test]
    fn other_head_sizes_fold_portably() {
        for d in [2, 32, 96, 100] {
            let (q, a, b) = (values(d, 1, 1.0), values(d, 2, 0.3), values(d, 3, 1.0));
            let (mut f1, mut f2) = (vec![0.0f32; d], vec![0.0f32; d]);
            let (mut c1, mut c2) = (vec![0i8; d], vec![0i8; d]);
            let expected = fold_classes_portable(&q, &a, &b, &mut f1, &mut c1);
            assert!(expected.is_some());
            assert_eq!(
                fold_classes(&q, &a, &b, &mut f2, &mut c2, crate::Isa::detect().dot()),
                expected
            );
            assert_eq!(c2, c1, "d {d}");
        }
    }
}
