//! `vpdpbusd` on 64 levels at a time: four rows times up to four heads
//! in sixteen accumulators, folded together by one transposing reduction.

use std::arch::x86_64::*;

use super::{DotBlock, Prefetcher};

/// [`super::integer_sums`] with AVX-512 VNNI.
///
/// # Safety
/// The CPU must have AVX-512F/BW/VNNI, and `b`'s bounds must hold as
/// [`super::integer_sums`] checks them.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
pub(super) unsafe fn integer_sums(b: DotBlock<'_>, out: &mut [i32], prefetch: &mut Prefetcher) {
    match b.heads {
        1 => block::<1>(b, out, prefetch),
        2 => block::<2>(b, out, prefetch),
        3 => block::<3>(b, out, prefetch),
        _ => block::<4>(b, out, prefetch),
    }
}

#[inline(always)]
fn block<const H: usize>(b: DotBlock<'_>, out: &mut [i32], prefetch: &mut Prefetcher) {
    let quads = b.rows / 4 * 4;
    for t in (0..quads).step_by(4) {
        prefetch.step();
        let sums = lanes::<H, 4>(b, t);
        store::<H, 4>(sums, out, b.rows, t);
    }
    for t in quads..b.rows {
        let sums = lanes::<H, 1>(b, t);
        store::<H, 1>(sums, out, b.rows, t);
    }
}

/// The accumulators of heads `j < H` and rows `t..t + R`.
#[inline(always)]
fn lanes<const H: usize, const R: usize>(b: DotBlock<'_>, t: usize) -> [[__m512i; R]; H] {
    // SAFETY: only inlined into `integer_sums` (AVX-512F/BW/VNNI). Rows
    // `t..t + R` are below `b.rows`; every byte read is below
    // `start + len <= ch` of its row or `(H − 1)·code_stride + len` of
    // the codes, the rest masked off.
    unsafe {
        let mut acc = [[_mm512_setzero_si512(); R]; H];
        let mut c = 0;
        while c < b.len {
            let n = (b.len - c).min(64);
            let mask = if n == 64 { u64::MAX } else { (1u64 << n) - 1 };
            let mut k = [_mm512_setzero_si512(); R];
            for (r, k) in k.iter_mut().enumerate() {
                let p = b.levels.as_ptr().add((t + r) * b.ch + b.start + c);
                *k = _mm512_maskz_loadu_epi8(mask, p.cast());
            }
            for (j, acc) in acc.iter_mut().enumerate() {
                let p = b.codes.as_ptr().add(j * b.code_stride + c);
                let qc = _mm512_maskz_loadu_epi8(mask, p.cast());
                for (a, k) in acc.iter_mut().zip(&k) {
                    *a = _mm512_dpbusd_epi32(*a, *k, qc);
                }
            }
            c += 64;
        }
        acc
    }
}

/// Folds the accumulators and stores head `j`, row `r` at `out[j·rows + t + r]`.
#[inline(always)]
fn store<const H: usize, const R: usize>(
    acc: [[__m512i; R]; H],
    out: &mut [i32],
    rows: usize,
    t: usize,
) {
    let mut sums = [0i32; 16];
    // SAFETY: only inlined into `integer_sums` (AVX-512F); `sums` holds 16 values.
    unsafe {
        let mut v = [_mm512_setzero_si512(); 16];
        for (j, a) in acc.iter().enumerate() {
            v[j * R..][..R].copy_from_slice(a);
        }
        _mm512_storeu_si512(sums.as_mut_ptr().cast(), reduce16(v));
    }
    for j in 0..H {
        out[j * rows + t..][..R].copy_from_slice(&sums[j * R..][..R]);
    }
}

/// Lane `i` of the result is the sum of the 16 lanes of `v[i]`
/// (integer additions, so their order does not matter).
#[inline(always)]
fn reduce16(v: [__m512i; 16]) -> __m512i {
    // SAFETY: only inlined into `integer_sums` (AVX-512F); no memory is touched.
    unsafe {
        let ps = |x: __m512i| _mm512_castsi512_ps(x);
        let si = |x: __m512| _mm512_castps_si512(x);
        // 128-bit blocks of pairs: lanes 0..8 hold v[2p]'s half sums, 8..16 v[2p + 1]'s.
        let w: [__m512i; 8] = std::array::from_fn(|p| {
            let (a, b) = (v[2 * p], v[2 * p + 1]);
            _mm512_add_epi32(
                _mm512_shuffle_i32x4::<0x44>(a, b),
                _mm512_shuffle_i32x4::<0xEE>(a, b),
            )
        });
        let x: [__m512i; 4] = std::array::from_fn(|p| {
            let (a, b) = (w[2 * p], w[2 * p + 1]);
            _mm512_add_epi32(
                _mm512_shuffle_i32x4::<0x88>(a, b),
                _mm512_shuffle_i32x4::<0xDD>(a, b),
            )
        });
        let y: [__m512i; 2] = std::array::from_fn(|p| {
            let (a, b) = (ps(x[2 * p]), ps(x[2 * p + 1]));
            _mm512_add_epi32(
                si(_mm512_shuffle_ps::<0x44>(a, b)),
                si(_mm512_shuffle_ps::<0xEE>(a, b)),
            )
        });
        let (a, b) = (ps(y[0]), ps(y[1]));
        let z = _mm512_add_epi32(
            si(_mm512_shuffle_ps::<0x88>(a, b)),
            si(_mm512_shuffle_ps::<0xDD>(a, b)),
        );
        let order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
        _mm512_permutexvar_epi32(order, z)
    }
}
