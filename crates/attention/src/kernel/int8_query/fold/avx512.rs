//! [`fold_heads`](super::fold_heads) in AVX-512 registers: up to four query
//! heads of one key head folded together, sixteen channels a vector.
//!
//! Vector `r` of a chunk of 64 channels holds classes `2r` (lanes 0..8)
//! and `2r + 1` (lanes 8..16), so its 256-bit halves are the AVX2 body's
//! vectors `2r` and `2r + 1`: the class peaks, scales and code sums go
//! through the AVX2 body's own steps ([`ClassScales`]), and the folded
//! sums' sixteen lanes are the portable fold's sixteen. The operations are
//! those of [`fold_classes`](super::fold_classes) lane by lane, so the
//! bits are the same (tested against the portable composition).

use std::arch::x86_64::*;

use super::FoldedHead;
use super::avx2::{ClassScales, ROUND, lane_maxima, lane_sums};

/// The 256-bit halves of four vectors, in order: vector `k` of the result
/// is half `k mod 2` of `v[k / 2]`.
#[inline(always)]
fn halves_ps(v: [__m512; 4]) -> [__m256; 8] {
    // SAFETY: register-only AVX-512F operations; only inlined into
    // `fold_heads`. A loop filling an array, no closure (see `reduce16`
    // in `vnni.rs`).
    unsafe {
        let mut out = [_mm256_setzero_ps(); 8];
        for (k, v) in v.iter().enumerate() {
            out[2 * k] = _mm512_castps512_ps256(*v);
            out[2 * k + 1] = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(*v)));
        }
        out
    }
}

/// [`halves_ps`] for integer vectors.
#[inline(always)]
fn halves_epi32(v: [__m512i; 4]) -> [__m256i; 8] {
    // SAFETY: as in `halves_ps`.
    unsafe {
        let mut out = [_mm256_setzero_si256(); 8];
        for (k, v) in v.iter().enumerate() {
            out[2 * k] = _mm512_castsi512_si256(*v);
            out[2 * k + 1] = _mm512_extracti64x4_epi64::<1>(*v);
        }
        out
    }
}

/// The sixteen lanes' sum in lane order, as the portable fold ends.
#[inline(always)]
fn lane_order_sum(v: __m512) -> f32 {
    let mut x = [0.0f32; 16];
    // SAFETY: one 16-lane store into 16 floats.
    unsafe { _mm512_storeu_ps(x.as_mut_ptr(), v) };
    x.iter().sum()
}

/// [`fold_heads`](super::fold_heads) for `H` heads.
///
/// # Safety
/// The CPU must have AVX-512F and BW; `a.len()` (`d`) must be a multiple
/// of 64, `q.len()` must be `H·d`, and `b`, `folded` and `codes` at least
/// `d`, `H·d` and `H·d` long.
#[target_feature(enable = "avx512f,avx512bw")]
#[allow(clippy::needless_range_loop)] // `r` and `j` index pointers and several arrays together
pub(super) unsafe fn fold_heads<const H: usize>(
    q: &[f32],
    a: &[f32],
    b: &[f32],
    folded: &mut [f32],
    codes: &mut [i8],
) -> Option<[FoldedHead; super::HEADS_TOGETHER]> {
    let d = a.len();
    debug_assert!(d.is_multiple_of(64) && q.len() == H * d && b.len() >= d);
    debug_assert!(folded.len() >= H * d && codes.len() >= H * d);
    let (q, a, b, f, out) = (
        q.as_ptr(),
        a.as_ptr(),
        b.as_ptr(),
        folded.as_mut_ptr(),
        codes.as_mut_ptr(),
    );
    let mut heads = [FoldedHead::default(); super::HEADS_TOGETHER];
    // SAFETY: vector `i` of head `j` covers values `j·d + 16i..+16`,
    // `i < d/16`, within `H·d` for `q`, `folded` and `codes`; `a` and `b`
    // are read at `16i..16i + 16 <= d`.
    unsafe {
        let infinity = _mm512_set1_ps(f32::INFINITY);
        // Pass 1: every head's fold, sums, finite test and peaks per
        // channel modulo 64, the scales' loads shared.
        let mut sums = [_mm512_setzero_ps(); H];
        let mut offsets = [_mm512_setzero_ps(); H];
        let mut peaks = [[_mm512_setzero_ps(); 4]; H];
        let mut non_finite: __mmask16 = 0;
        for chunk in 0..d / 64 {
            for r in 0..4 {
                let i = 4 * chunk + r;
                let (ai, bi) = (
                    _mm512_loadu_ps(a.add(16 * i)),
                    _mm512_loadu_ps(b.add(16 * i)),
                );
                for j in 0..H {
                    let qi = _mm512_loadu_ps(q.add(j * d + 16 * i));
                    let x = _mm512_mul_ps(qi, ai);
                    _mm512_storeu_ps(f.add(j * d + 16 * i), x);
                    sums[j] = _mm512_add_ps(sums[j], x);
                    offsets[j] = _mm512_add_ps(offsets[j], _mm512_mul_ps(qi, bi));
                    let m = _mm512_abs_ps(x);
                    // Not below infinity, or unordered: ±∞ or NaN.
                    non_finite |= _mm512_cmp_ps_mask::<_CMP_NLT_UQ>(m, infinity);
                    // `if a > p { a } else { p }`, as the portable peaks.
                    peaks[j][r] = _mm512_max_ps(m, peaks[j][r]);
                }
            }
        }
        if non_finite != 0 {
            return None;
        }
        // Pass 2, head by head: class scales, then the codes.
        let (low, high) = (_mm512_set1_ps(-127.0), _mm512_set1_ps(127.0));
        let (round, round_bits) = (
            _mm512_set1_ps(ROUND),
            _mm512_set1_epi32(ROUND.to_bits() as i32),
        );
        // Every head's class scales first: their dependency chains
        // (maxima, two divisions) side by side.
        let mut scales = [const { None }; H];
        for (j, s) in scales.iter_mut().enumerate() {
            *s = ClassScales::of(lane_maxima(halves_ps(peaks[j])), d);
        }
        for (j, scales) in scales.into_iter().enumerate() {
            let (folded_sum, offset_sum) = (lane_order_sum(sums[j]), lane_order_sum(offsets[j]));
            let Some(scales) = scales else {
                std::ptr::write_bytes(out.add(j * d), 0, d);
                heads[j] = FoldedHead::zero(folded_sum, offset_sum);
                continue;
            };
            // Vector `r`'s inverses: class `2r` in lanes 0..8, `2r + 1` in 8..16.
            let inv = _mm512_castps256_ps512(scales.inv);
            let mut class_inv = [_mm512_setzero_ps(); 4];
            for (r, v) in class_inv.iter_mut().enumerate() {
                let (lo, hi) = (2 * r as i32, 2 * r as i32 + 1);
                let index = _mm512_set_epi32(
                    hi, hi, hi, hi, hi, hi, hi, hi, lo, lo, lo, lo, lo, lo, lo, lo,
                );
                *v = _mm512_permutexvar_ps(index, inv);
            }
            let mut class_sums = [_mm512_setzero_si512(); 4];
            for chunk in 0..d / 64 {
                for r in 0..4 {
                    let at = j * d + 16 * (4 * chunk + r);
                    let y = _mm512_mul_ps(_mm512_loadu_ps(f.add(at)), class_inv[r]);
                    let y = _mm512_min_ps(_mm512_max_ps(y, low), high);
                    let c =
                        _mm512_sub_epi32(_mm512_castps_si512(_mm512_add_ps(y, round)), round_bits);
                    class_sums[r] = _mm512_add_epi32(class_sums[r], c);
                    // Codes are within ±127: the saturating narrowing keeps them.
                    _mm_storeu_si128(out.add(at).cast(), _mm512_cvtsepi32_epi8(c));
                }
            }
            let (weights, code_sum) = scales.weighted_sum(lane_sums(halves_epi32(class_sums)));
            heads[j] = FoldedHead {
                folded_sum,
                offset_sum,
                unit: scales.unit,
                weights,
                code_sum,
            };
        }
        Some(heads)
    }
}
