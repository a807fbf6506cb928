//! AVX2 value sums, for CPUs without AVX-512 VNNI: `vpmaddwd` on two rows
//! of 8 channels at a time (the rows' levels interleaved into 16-bit
//! pairs, each head's two weight codes broadcast as one 32-bit pair), the
//! same exact i32 sums as `vpdpwssd`. Heads go two at a time, so that
//! their accumulators stay in the sixteen registers.

use std::arch::x86_64::*;

use super::super::Prefetcher;
use super::SumBlock;

/// [`super::integer_sums`] with AVX2.
///
/// # Safety
/// The CPU must have AVX2, and `b`'s bounds must hold as
/// [`super::integer_sums`] checks them.
#[target_feature(enable = "avx2")]
pub(super) unsafe fn sums<const H: usize>(
    b: SumBlock<'_>,
    out: &mut [i32],
    prefetch: &mut Prefetcher,
) {
    let mut j = 0;
    while j < H {
        if H - j >= 2 {
            heads::<2>(b, j, out, prefetch);
            j += 2;
        } else {
            heads::<1>(b, j, out, prefetch);
            j += 1;
        }
    }
}

/// [`super::round_codes`] eight lanes at a time, with the same
/// operations in the same order (product, times `inv`, plus one half,
/// capped, truncated), packed to 16 bits.
///
/// # Safety
/// The CPU must have AVX2.
#[target_feature(enable = "avx2")]
pub(super) unsafe fn round_codes(w: &[f32], a: &[f32], inv: f32, code_max: f32, codes: &mut [u16]) {
    let out = codes.as_chunks_mut::<{ super::LANES }>().0;
    let (inv, half, top) = (
        _mm256_set1_ps(inv),
        _mm256_set1_ps(0.5),
        _mm256_set1_ps(code_max),
    );
    for ((c, w), a) in out.iter_mut().zip(super::chunks(w)).zip(super::chunks(a)) {
        let mut lanes = [_mm256_setzero_si256(); 2];
        for (k, lanes) in lanes.iter_mut().enumerate() {
            // SAFETY: each chunk holds 16 floats; unaligned loads.
            let x = unsafe {
                _mm256_mul_ps(
                    _mm256_loadu_ps(w.as_ptr().add(8 * k)),
                    _mm256_loadu_ps(a.as_ptr().add(8 * k)),
                )
            };
            let r = _mm256_add_ps(_mm256_mul_ps(x, inv), half);
            *lanes = _mm256_cvttps_epi32(_mm256_min_ps(r, top));
        }
        // `packus` packs within 128-bit halves; the permute restores lane order.
        let packed =
            _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_packus_epi32(lanes[0], lanes[1]));
        // SAFETY: the chunk holds 16 codes.
        unsafe { _mm256_storeu_si256(c.as_mut_ptr().cast(), packed) };
    }
}

/// Heads `j0..j0 + G`, every channel of the segment.
#[inline(always)]
fn heads<const G: usize>(b: SumBlock<'_>, j0: usize, out: &mut [i32], prefetch: &mut Prefetcher) {
    match (b.packed, b.image.is_some()) {
        (false, false) => bytes::<G, false>(b, j0, out, prefetch),
        (false, true) => bytes::<G, true>(b, j0, out, prefetch),
        (true, false) => nibbles::<G, false>(b, j0, out, prefetch),
        (true, true) => nibbles::<G, true>(b, j0, out, prefetch),
    }
}

/// Head `j`'s weight codes of rows `2p` and `2p + 1`, in every 32-bit lane.
#[inline(always)]
fn code_pair(b: SumBlock<'_>, j: usize, p: usize) -> __m256i {
    // SAFETY: only inlined into `sums` (AVX2); `(j, p)` index the codes
    // below `(H − 1)·stride + 2·pairs` (checked by `integer_sums`).
    unsafe {
        let pair = b.codes.as_ptr().add(j * b.stride + 2 * p);
        _mm256_set1_epi32(pair.cast::<i32>().read_unaligned())
    }
}

/// `b`'s image for `vpshufb` (NF4 levels are nibbles: bit 7 is never set);
/// zeros without `IMAGE`.
#[inline(always)]
fn image<const IMAGE: bool>(b: SumBlock<'_>) -> __m128i {
    // SAFETY: only inlined into `sums` (AVX2); the image is 16 readable bytes.
    unsafe {
        match b.image {
            Some(m) if IMAGE => _mm_loadu_si128(m.as_ptr().cast()),
            _ => _mm_setzero_si128(),
        }
    }
}

/// Levels one per byte, 16 channels per step: per pair of rows, channels
/// 0-7 and 8-15 as 16-bit pairs (row `2p`'s level, row `2p + 1`'s).
#[inline(always)]
fn bytes<const G: usize, const IMAGE: bool>(
    b: SumBlock<'_>,
    j0: usize,
    out: &mut [i32],
    prefetch: &mut Prefetcher,
) {
    let pairs = b.rows.div_ceil(2);
    // SAFETY: only inlined into `sums` (AVX2). Every level read is in row
    // `t < rows` at channel `start + c + 15 < start + len <= ch`; every
    // store is below `H·len`.
    unsafe {
        let image = image::<IMAGE>(b);
        let at = |t: usize, c: usize| b.levels.as_ptr().add(t * b.ch + b.start + c);
        for c in (0..b.len).step_by(16) {
            let mut acc = [[_mm256_setzero_si256(); 2]; G];
            for p in 0..pairs {
                if j0 == 0 && (b.in_head + c).is_multiple_of(64) && p % 2 == 0 {
                    prefetch.step();
                }
                let t = 2 * p;
                let mut r0 = _mm_loadu_si128(at(t, c).cast());
                // An odd last row pairs with zeros (its code is 0 too).
                let mut r1 = if t + 1 < b.rows {
                    _mm_loadu_si128(at(t + 1, c).cast())
                } else {
                    _mm_setzero_si128()
                };
                if IMAGE {
                    r0 = _mm_shuffle_epi8(image, r0);
                    r1 = _mm_shuffle_epi8(image, r1);
                }
                let lo = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(r0, r1));
                let hi = _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(r0, r1));
                for (g, acc) in acc.iter_mut().enumerate() {
                    let w = code_pair(b, j0 + g, p);
                    acc[0] = _mm256_add_epi32(acc[0], _mm256_madd_epi16(lo, w));
                    acc[1] = _mm256_add_epi32(acc[1], _mm256_madd_epi16(hi, w));
                }
            }
            for (g, acc) in acc.iter().enumerate() {
                let o = out.as_mut_ptr().add((j0 + g) * b.len + c);
                _mm256_storeu_si256(o.cast(), acc[0]);
                _mm256_storeu_si256(o.add(8).cast(), acc[1]);
            }
        }
    }
}

/// Levels packed two per byte, 32 channels (16 bytes of a row) per step:
/// per pair of rows, the rows' bytes interleaved hold in their low
/// nibbles the 16-bit pairs of the even channels and in their high
/// nibbles those of the odd ones, 8 channels per vector.
#[inline(always)]
fn nibbles<const G: usize, const IMAGE: bool>(
    b: SumBlock<'_>,
    j0: usize,
    out: &mut [i32],
    prefetch: &mut Prefetcher,
) {
    let pairs = b.rows.div_ceil(2);
    let row_bytes = b.ch / 2;
    // SAFETY: only inlined into `sums` (AVX2). Every byte read is in row
    // `t < rows` at byte `(start + c) / 2 + 15 < (start + len) / 2 <= ch
    // / 2`; every store is below `H·len`.
    unsafe {
        let image = image::<IMAGE>(b);
        let nibble = _mm_set1_epi8(0x0F);
        let at = |t: usize, c: usize| b.levels.as_ptr().add(t * row_bytes + (b.start + c) / 2);
        for c in (0..b.len).step_by(32) {
            // [even 0-14, even 16-30, odd 1-15, odd 17-31] per head.
            let mut acc = [[_mm256_setzero_si256(); 4]; G];
            for p in 0..pairs {
                if j0 == 0 && (b.in_head + c).is_multiple_of(64) && p % 2 == 0 {
                    prefetch.step();
                }
                let t = 2 * p;
                let r0 = _mm_loadu_si128(at(t, c).cast());
                // An odd last row pairs with zeros (its code is 0 too).
                let r1 = if t + 1 < b.rows {
                    _mm_loadu_si128(at(t + 1, c).cast())
                } else {
                    _mm_setzero_si128()
                };
                let mut v = [_mm256_setzero_si256(); 4];
                for (k, both) in [_mm_unpacklo_epi8(r0, r1), _mm_unpackhi_epi8(r0, r1)]
                    .into_iter()
                    .enumerate()
                {
                    let mut even = _mm_and_si128(both, nibble);
                    let mut odd = _mm_and_si128(_mm_srli_epi16::<4>(both), nibble);
                    if IMAGE {
                        even = _mm_shuffle_epi8(image, even);
                        odd = _mm_shuffle_epi8(image, odd);
                    }
                    v[k] = _mm256_cvtepu8_epi16(even);
                    v[2 + k] = _mm256_cvtepu8_epi16(odd);
                }
                for (g, acc) in acc.iter_mut().enumerate() {
                    let w = code_pair(b, j0 + g, p);
                    for (a, v) in acc.iter_mut().zip(&v) {
                        *a = _mm256_add_epi32(*a, _mm256_madd_epi16(*v, w));
                    }
                }
            }
            // Channel order: even and odd lanes interleaved back.
            for (g, acc) in acc.iter().enumerate() {
                let o = out.as_mut_ptr().add((j0 + g) * b.len + c);
                for k in 0..2 {
                    let (e, d) = (acc[k], acc[2 + k]);
                    let lo = _mm256_unpacklo_epi32(e, d); // e0 d0 e1 d1 | e4 d4 e5 d5
                    let hi = _mm256_unpackhi_epi32(e, d); // e2 d2 e3 d3 | e6 d6 e7 d7
                    let first = _mm256_permute2x128_si256::<0x20>(lo, hi);
                    let second = _mm256_permute2x128_si256::<0x31>(lo, hi);
                    _mm256_storeu_si256(o.add(16 * k).cast(), first);
                    _mm256_storeu_si256(o.add(16 * k + 8).cast(), second);
                }
            }
        }
    }
}
