//! AVX2 integer scores, for CPUs without AVX-512 VNNI: two rows times up to
//! four heads in eight accumulators of 8 i32 lanes. Written by hand because
//! the portable loop is scalar (the compiler does not find the nibble
//! split); measured with `decode_timing` on an AVX2-only Zen 3 host.
//!
//! Levels packed two per byte (at most 15) meet the int8 codes in
//! `vpmaddubsw` (u8 × i8 → pairwise i16 sums, at most 2·15·128 = 3,840, so
//! exact without saturation), two of whose sums are added in i16 (7,680)
//! and widened by `vpmaddwd` against ones, or against a head's class
//! weights (at most [`super::classes::max_weight`], each i32 lane one class:
//! see [`super::classes`]). Levels one per byte (up to 255)
//! and NF4 images (up to 255) would saturate `vpmaddubsw`, so they are
//! widened to i16 first and multiplied by `vpmaddwd`: exact too. The sums
//! are the portable loop's, to the bit.

use std::arch::x86_64::*;

use super::{DotBlock, Prefetcher};

/// Rows per step: `2 × H ≤ 8` accumulators and the rows' levels fit the
/// sixteen registers.
const ROWS: usize = 2;

/// [`super::integer_sums`] with AVX2.
///
/// # Safety
/// The CPU must have AVX2, and `b`'s bounds must hold as
/// [`super::integer_sums`] checks them.
#[target_feature(enable = "avx2")]
pub(super) unsafe fn integer_sums(b: DotBlock<'_>, out: &mut [i32], prefetch: &mut Prefetcher) {
    match (b.packed, b.image.is_some()) {
        (false, false) => heads::<false, false>(b, out, prefetch),
        (false, true) => heads::<false, true>(b, out, prefetch),
        (true, false) => heads::<true, false>(b, out, prefetch),
        (true, true) => heads::<true, true>(b, out, prefetch),
    }
}

/// [`block`] for `b`'s number of heads.
#[inline(always)]
fn heads<const PACKED: bool, const IMAGE: bool>(
    b: DotBlock<'_>,
    out: &mut [i32],
    prefetch: &mut Prefetcher,
) {
    match b.heads {
        1 => block::<1, PACKED, IMAGE>(b, out, prefetch),
        2 => block::<2, PACKED, IMAGE>(b, out, prefetch),
        3 => block::<3, PACKED, IMAGE>(b, out, prefetch),
        _ => block::<4, PACKED, IMAGE>(b, out, prefetch),
    }
}

/// Rows of `b` in pairs, then the last one.
#[inline(always)]
fn block<const H: usize, const PACKED: bool, const IMAGE: bool>(
    b: DotBlock<'_>,
    out: &mut [i32],
    prefetch: &mut Prefetcher,
) {
    let pairs = b.rows / ROWS * ROWS;
    for t in (0..pairs).step_by(ROWS) {
        if t % 4 == 0 {
            prefetch.step();
        }
        let acc = if PACKED {
            nibble_lanes::<H, ROWS, IMAGE>(b, t)
        } else {
            lanes::<H, ROWS, IMAGE>(b, t)
        };
        store::<H, ROWS>(acc, out, b.rows, t);
    }
    for t in pairs..b.rows {
        let acc = if PACKED {
            nibble_lanes::<H, 1, IMAGE>(b, t)
        } else {
            lanes::<H, 1, IMAGE>(b, t)
        };
        store::<H, 1>(acc, out, b.rows, t);
    }
}

/// `b`'s image in both 128-bit lanes, for `vpshufb` (NF4 levels are
/// nibbles: bit 7, which would zero a byte, is never set); zeros without
/// `IMAGE`.
#[inline(always)]
fn image_lanes<const IMAGE: bool>(b: DotBlock<'_>) -> __m256i {
    // SAFETY: only inlined into `integer_sums` (AVX2); the image is 16 readable bytes.
    unsafe {
        match b.image {
            Some(m) if IMAGE => _mm256_broadcastsi128_si256(_mm_loadu_si128(m.as_ptr().cast())),
            _ => _mm256_setzero_si256(),
        }
    }
}

/// `acc += Σ pairs of (levels · codes)` for 16 levels and 16 codes, both
/// widened to i16 (levels unsigned, codes signed).
#[inline(always)]
fn madd16(acc: __m256i, levels: __m128i, codes: __m128i) -> __m256i {
    // SAFETY: register-only AVX2 operations; only inlined into `integer_sums`.
    unsafe {
        _mm256_add_epi32(
            acc,
            _mm256_madd_epi16(_mm256_cvtepu8_epi16(levels), _mm256_cvtepi8_epi16(codes)),
        )
    }
}

/// The accumulators of heads `j < H` and rows `t..t + R`, for levels one
/// per byte: 16 channels per step, read in place; a shorter last step
/// through zero-padded copies.
#[inline(always)]
fn lanes<const H: usize, const R: usize, const IMAGE: bool>(
    b: DotBlock<'_>,
    t: usize,
) -> [[__m256i; R]; H] {
    // SAFETY: only inlined into `integer_sums` (AVX2). Rows `t..t + R` are
    // below `b.rows`; every 16-byte read in place is within `start + len
    // <= ch` of its row or `(H − 1)·code_stride + len` of the codes (the
    // last partial step reads copies).
    unsafe {
        let mut acc = [[_mm256_setzero_si256(); R]; H];
        let row = |r: usize| b.levels.as_ptr().add((t + r) * b.ch + b.start);
        let codes = |j: usize| b.codes.as_ptr().add(j * b.code_stride);
        let mut c = 0;
        while c + 16 <= b.len {
            let rows: [*const u8; R] = std::array::from_fn(|r| row(r).add(c));
            let heads: [*const i8; H] = std::array::from_fn(|j| codes(j).add(c));
            step16::<H, R, IMAGE>(b, &mut acc, rows, heads);
            c += 16;
        }
        let n = b.len - c;
        if n > 0 {
            // Bytes past the segment are zero levels (image[0] with an
            // image) against zero codes.
            let mut level_buf = [[0u8; 16]; R];
            for (r, buf) in level_buf.iter_mut().enumerate() {
                std::ptr::copy_nonoverlapping(row(r).add(c), buf.as_mut_ptr(), n);
            }
            let mut code_buf = [[0i8; 16]; H];
            for (j, buf) in code_buf.iter_mut().enumerate() {
                std::ptr::copy_nonoverlapping(codes(j).add(c), buf.as_mut_ptr(), n);
            }
            let rows: [*const u8; R] = std::array::from_fn(|r| level_buf[r].as_ptr());
            let heads: [*const i8; H] = std::array::from_fn(|j| code_buf[j].as_ptr());
            step16::<H, R, IMAGE>(b, &mut acc, rows, heads);
        }
        acc
    }
}

/// One step of 16 channels of levels one per byte: 16 levels at
/// `rows[r]` against 16 codes at `heads[j]`, both widened to i16.
#[inline(always)]
fn step16<const H: usize, const R: usize, const IMAGE: bool>(
    b: DotBlock<'_>,
    acc: &mut [[__m256i; R]; H],
    rows: [*const u8; R],
    heads: [*const i8; H],
) {
    // SAFETY: only inlined into `integer_sums` (AVX2); the callers pass
    // pointers to 16 readable bytes each.
    unsafe {
        let image = _mm256_castsi256_si128(image_lanes::<IMAGE>(b));
        let mut k = [_mm_setzero_si128(); R];
        for (k, p) in k.iter_mut().zip(rows) {
            *k = _mm_loadu_si128(p.cast());
            if IMAGE {
                *k = _mm_shuffle_epi8(image, *k);
            }
        }
        for (acc, p) in acc.iter_mut().zip(heads) {
            let q = _mm_loadu_si128(p.cast());
            for (a, k) in acc.iter_mut().zip(&k) {
                *a = madd16(*a, *k, q);
            }
        }
    }
}

/// [`lanes`] for levels packed two per byte, in units of 64 channels (32
/// bytes of a row): a unit's low nibbles (its even channels) meet 32 even
/// codes and its high nibbles 32 odd codes. In a block of 128 channels
/// of the split codes, unit `u` reads even codes `32u..` and odd codes
/// `64 + 32u..`; a last block of 64 channels, even `0..32` and odd
/// `32..64`; any other last block goes through zeroed copies laid out as a
/// block of 128.
#[inline(always)]
fn nibble_lanes<const H: usize, const R: usize, const IMAGE: bool>(
    b: DotBlock<'_>,
    t: usize,
) -> [[__m256i; R]; H] {
    // SAFETY: only inlined into `integer_sums` (AVX2). Rows `t..t + R` are
    // below `b.rows`; every 32-byte load of a row is within `(start + len)
    // / 2 <= ch / 2` of it, every 32-byte load of codes within `(H −
    // 1)·code_stride + len` (a partial last block reads copies).
    unsafe {
        let mut acc = [[_mm256_setzero_si256(); R]; H];
        // Each head's `vpmaddwd` multipliers: its class weights, or ones.
        let weights: [__m256i; H] = std::array::from_fn(|j| match b.lane_weights {
            Some(w) => _mm256_loadu_si256(w[j].as_ptr().cast()),
            None => _mm256_set1_epi16(1),
        });
        let row = |r: usize| b.levels.as_ptr().add((t + r) * (b.ch / 2) + b.start / 2);
        let codes = |j: usize| b.codes.as_ptr().add(j * b.code_stride);
        let mut c = 0;
        while c + 128 <= b.len {
            for u in 0..2 {
                let rows: [*const u8; R] = std::array::from_fn(|r| row(r).add(c / 2 + 32 * u));
                let even: [*const i8; H] = std::array::from_fn(|j| codes(j).add(c + 32 * u));
                let odd: [*const i8; H] = std::array::from_fn(|j| codes(j).add(c + 64 + 32 * u));
                unit64::<H, R, IMAGE>(b, &mut acc, rows, even, odd, &weights);
            }
            c += 128;
        }
        let half = (b.len - c) / 2;
        if half == 32 {
            let rows: [*const u8; R] = std::array::from_fn(|r| row(r).add(c / 2));
            let even: [*const i8; H] = std::array::from_fn(|j| codes(j).add(c));
            let odd: [*const i8; H] = std::array::from_fn(|j| codes(j).add(c + 32));
            unit64::<H, R, IMAGE>(b, &mut acc, rows, even, odd, &weights);
        } else if half > 0 {
            // A block of `2·half` channels, as the first `half` bytes of a
            // block of 128 (even codes at 0.., odd at 64..), zero-padded.
            let mut level_buf = [[0u8; 64]; R];
            for (r, buf) in level_buf.iter_mut().enumerate() {
                std::ptr::copy_nonoverlapping(row(r).add(c / 2), buf.as_mut_ptr(), half);
            }
            let mut code_buf = [[0i8; 128]; H];
            for (j, buf) in code_buf.iter_mut().enumerate() {
                std::ptr::copy_nonoverlapping(codes(j).add(c), buf.as_mut_ptr(), half);
                std::ptr::copy_nonoverlapping(codes(j).add(c + half), buf[64..].as_mut_ptr(), half);
            }
            for u in 0..half.div_ceil(32) {
                let rows: [*const u8; R] = std::array::from_fn(|r| level_buf[r][32 * u..].as_ptr());
                let even: [*const i8; H] = std::array::from_fn(|j| code_buf[j][32 * u..].as_ptr());
                let odd: [*const i8; H] =
                    std::array::from_fn(|j| code_buf[j][64 + 32 * u..].as_ptr());
                unit64::<H, R, IMAGE>(b, &mut acc, rows, even, odd, &weights);
            }
        }
        acc
    }
}

/// One unit of 64 packed channels: 32 bytes at `rows[r]`, 32 even codes
/// at `even[j]` and 32 odd codes at `odd[j]`, head `j`'s pair sums widened
/// against `weights[j]` (ones, or its class weights: i32 lane `m` holds
/// channels `8m..8m + 8` of the unit).
#[inline(always)]
fn unit64<const H: usize, const R: usize, const IMAGE: bool>(
    b: DotBlock<'_>,
    acc: &mut [[__m256i; R]; H],
    rows: [*const u8; R],
    even: [*const i8; H],
    odd: [*const i8; H],
    weights: &[__m256i; H],
) {
    // SAFETY: only inlined into `integer_sums` (AVX2); the callers pass
    // pointers to 32 readable bytes each.
    unsafe {
        let image = image_lanes::<IMAGE>(b);
        let nibble = _mm256_set1_epi8(0x0F);
        let mut e = [_mm256_setzero_si256(); R];
        let mut o = [_mm256_setzero_si256(); R];
        for r in 0..R {
            let x = _mm256_loadu_si256(rows[r].cast());
            e[r] = _mm256_and_si256(x, nibble);
            o[r] = _mm256_and_si256(_mm256_srli_epi16::<4>(x), nibble);
            if IMAGE {
                e[r] = _mm256_shuffle_epi8(image, e[r]);
                o[r] = _mm256_shuffle_epi8(image, o[r]);
            }
        }
        for j in 0..H {
            let qe = _mm256_loadu_si256(even[j].cast());
            let qo = _mm256_loadu_si256(odd[j].cast());
            for r in 0..R {
                acc[j][r] = if IMAGE {
                    // Images reach 255: widened, as in `lanes` (no closures
                    // here: they would be compiled without AVX2).
                    let a = madd16(
                        acc[j][r],
                        _mm256_castsi256_si128(e[r]),
                        _mm256_castsi256_si128(qe),
                    );
                    let a = madd16(
                        a,
                        _mm256_extracti128_si256::<1>(e[r]),
                        _mm256_extracti128_si256::<1>(qe),
                    );
                    let a = madd16(a, _mm256_castsi256_si128(o[r]), _mm256_castsi256_si128(qo));
                    madd16(
                        a,
                        _mm256_extracti128_si256::<1>(o[r]),
                        _mm256_extracti128_si256::<1>(qo),
                    )
                } else {
                    let s = _mm256_add_epi16(
                        _mm256_maddubs_epi16(e[r], qe),
                        _mm256_maddubs_epi16(o[r], qo),
                    );
                    _mm256_add_epi32(acc[j][r], _mm256_madd_epi16(s, weights[j]))
                };
            }
        }
    }
}

/// Sums the lanes of each accumulator and stores head `j`, row `r` at
/// `out[j·rows + t + r]`.
#[inline(always)]
fn store<const H: usize, const R: usize>(
    acc: [[__m256i; R]; H],
    out: &mut [i32],
    rows: usize,
    t: usize,
) {
    if H == 4 && R == 2 {
        // The eight sums at once (two levels of `vphaddd`, then the two
        // 128-bit halves added): integer sums are exact in any order.
        let mut sums = [0i32; 8];
        // SAFETY: register-only AVX2 operations but the store into `sums`
        // (8 i32); only inlined into `integer_sums`.
        unsafe {
            // No closures around the intrinsics: they would be compiled
            // without AVX2.
            let mut x = [_mm256_setzero_si256(); 4];
            for (j, x) in x.iter_mut().enumerate() {
                *x = _mm256_hadd_epi32(acc[j][0], acc[j][1]);
            }
            let y = [_mm256_hadd_epi32(x[0], x[1]), _mm256_hadd_epi32(x[2], x[3])];
            // Lane k of the 128-bit halves of y[0] holds a part of sum k
            // (of the first four); of y[1], of sums 4 + k.
            let z = _mm256_add_epi32(
                _mm256_permute2x128_si256::<0x20>(y[0], y[1]),
                _mm256_permute2x128_si256::<0x31>(y[0], y[1]),
            );
            _mm256_storeu_si256(sums.as_mut_ptr().cast(), z);
        }
        for j in 0..H {
            out[j * rows + t..][..R].copy_from_slice(&sums[j * R..][..R]);
        }
        return;
    }
    for (j, acc) in acc.iter().enumerate() {
        for (r, a) in acc.iter().enumerate() {
            // SAFETY: register-only AVX2 operations; only inlined into `integer_sums`.
            let sum = unsafe {
                let x = _mm_add_epi32(
                    _mm256_castsi256_si128(*a),
                    _mm256_extracti128_si256::<1>(*a),
                );
                let x = _mm_add_epi32(x, _mm_shuffle_epi32::<0b01_00_11_10>(x));
                let x = _mm_add_epi32(x, _mm_shuffle_epi32::<0b10_11_00_01>(x));
                _mm_cvtsi128_si32(x)
            };
            out[j * rows + t + r] = sum;
        }
    }
}
