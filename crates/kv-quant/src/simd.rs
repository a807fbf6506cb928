//! Run-time selected wide-vector paths of the decoders: f16 → f32
//! conversion with F16C/AVX-512 instructions, and a wrapper that compiles
//! the level loops for AVX2 when the CPU has it. Every path gives the same
//! values as the scalar code (no fused multiply-add is introduced: Rust
//! never contracts `a * b + c`).

/// Converts little-endian IEEE half floats (`2·out.len()` bytes, the
/// FP16 form's row bytes) to f32, exactly, with AVX-512 or F16C when the
/// CPU has them.
///
/// # Panics
/// If `src` does not hold exactly `2·out.len()` bytes.
pub fn f16_to_f32(src: &[u8], out: &mut [f32]) {
    assert_eq!(src.len(), 2 * out.len(), "f16_to_f32: byte count");
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512F.
            return unsafe { x86::f16_to_f32_avx512(src, out) };
        }
        if is_x86_feature_detected!("f16c") && is_x86_feature_detected!("avx") {
            // SAFETY: the CPU has F16C and AVX.
            return unsafe { x86::f16_to_f32_f16c(src, out) };
        }
    }
    f16_to_f32_scalar(src, out);
}

fn f16_to_f32_scalar(src: &[u8], out: &mut [f32]) {
    for (o, b) in out.iter_mut().zip(src.chunks_exact(2)) {
        *o = half::f16::from_le_bytes([b[0], b[1]]).to_f32();
    }
}

/// Unpacks 4-bit levels, two per byte, low nibble first: `levels[2i]` is
/// `packed[i] & 15` and `levels[2i + 1]` is `packed[i] >> 4`, for
/// `levels.len() / 2` whole bytes (an odd last level is the caller's).
///
/// With AVX-512BW or AVX2: each byte is widened to a 16-bit lane and
/// becomes `(x & 0xF) | (x << 4 & 0xF00)`, whose little-endian bytes are the
/// two levels in order: three instructions per 32 or 16 bytes, where the
/// scalar pair stores were not vectorised (13% of an `int4` decode-attention
/// call, `perf`).
///
/// # Panics
/// If `packed` holds fewer than `levels.len() / 2` bytes.
pub(crate) fn unpack_nibbles(packed: &[u8], levels: &mut [u8]) {
    let packed = &packed[..levels.len() / 2];
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx512bw") {
            // SAFETY: the CPU has AVX-512F and AVX-512BW.
            return unsafe { x86::unpack_nibbles_avx512(packed, levels) };
        }
        if is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2.
            return unsafe { x86::unpack_nibbles_avx2(packed, levels) };
        }
    }
    unpack_nibbles_scalar(packed, levels);
}

fn unpack_nibbles_scalar(packed: &[u8], levels: &mut [u8]) {
    for (pair, &b) in levels.chunks_exact_mut(2).zip(packed) {
        pair[0] = b & 0xF;
        pair[1] = b >> 4;
    }
}

/// Pairs of values from 2-d codebooks: `out[2j..2j + 2]` is `gain` times
/// centroid `codes[j]` of codebook `first + j` (`centroids`: codebooks of
/// `k` centroids of two values each), the decode of a `cq-d2` gain block.
/// With AVX-512 eight pairs are one gather of 64-bit words (a centroid's
/// two f32 values) and one product: the same products as the scalar loop,
/// bit for bit, where that loop took a fifth of a SmolLM2 decode step with
/// `cq-d2` values (`perf`).
///
/// # Panics
/// If `k` is not a power of two, a codebook lies outside `centroids`, or
/// `out` does not hold two values per code.
pub(crate) fn centroid_pairs(
    (centroids, k, first): (&[f32], usize, usize),
    codes: &[u8],
    gain: f32,
    out: &mut [f32],
) {
    assert_eq!(out.len(), 2 * codes.len());
    let books = centroids.len() / (2 * k);
    // Codes are read modulo `k` (a power of two), so no scan is needed for
    // the gathers to stay within the codebooks; a store's codes are below
    // `k` already (their width is log2 k bits).
    assert!(k.is_power_of_two() && first + codes.len() <= books);
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx512f") && centroids.len() < i32::MAX as usize / 8 {
        // SAFETY: the CPU has AVX-512F; every gathered pair lies within
        // `centroids` (asserted above) and its offset fits in i32.
        return unsafe { x86::centroid_pairs_avx512((centroids, k, first), codes, gain, out) };
    }
    centroid_pairs_scalar((centroids, k, first), codes, gain, out);
}

fn centroid_pairs_scalar(
    (centroids, k, first): (&[f32], usize, usize),
    codes: &[u8],
    gain: f32,
    out: &mut [f32],
) {
    for (j, (o, &c)) in out.chunks_exact_mut(2).zip(codes).enumerate() {
        let at = 2 * ((first + j) * k + (usize::from(c) & (k - 1)));
        (o[0], o[1]) = (gain * centroids[at], gain * centroids[at + 1]);
    }
}

/// Runs `f` compiled for AVX2 when the CPU has it (the closure and what it
/// inlines are compiled inside a function with those features enabled).
#[inline(always)]
pub(crate) fn with_avx2<R>(f: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2.
            return unsafe { x86::run_avx2(f) };
        }
    }
    f()
}

/// Whether the CPU has AVX2 and F16C (the write path's fast region).
#[cfg(target_arch = "x86_64")]
#[inline]
pub(crate) fn has_avx2_f16c() -> bool {
    is_x86_feature_detected!("avx2") && is_x86_feature_detected!("f16c")
}

/// [`round_to`](crate::int::round_to) with the f16 step done by F16C's
/// `vcvtps2ph` in the requested rounding direction: the f32 is first
/// rounded in that direction, and directed rounding twice is directed
/// rounding once, so the results are identical (tested on every f16 and
/// many f64 values). Only inlined into functions with F16C enabled.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) fn round_f16c(
    ty: crate::spec::ScaleType,
    x: f64,
    toward: crate::int::Toward,
    what: &'static str,
) -> crate::error::Result<f32> {
    use crate::int::Toward;
    use std::arch::x86_64::*;
    if ty != crate::spec::ScaleType::F16 {
        return crate::int::round_to(ty, x, toward, what);
    }
    let v = crate::int::directed_f32(x, toward);
    // SAFETY: callers run with F16C enabled (see above); register-only intrinsics.
    let rounded = unsafe {
        let a = _mm_set_ss(v);
        let h = match toward {
            Toward::Down => _mm_cvtps_ph::<{ _MM_FROUND_TO_NEG_INF }>(a),
            Toward::Up => _mm_cvtps_ph::<{ _MM_FROUND_TO_POS_INF }>(a),
            Toward::Nearest => _mm_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT }>(a),
        };
        _mm_cvtss_f32(_mm_cvtph_ps(h))
    };
    if rounded.is_finite() {
        Ok(rounded)
    } else {
        crate::int::round_to(ty, x, toward, what)
    }
}

/// Minimum and maximum of finite values with AVX2 (`(+∞, −∞)` for none).
///
/// # Safety
/// Callers must run with AVX2 enabled (inside a `#[target_feature]` function).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) unsafe fn range_avx2(xs: &[f32]) -> (f32, f32) {
    use std::arch::x86_64::*;
    // SAFETY: AVX2 per the contract; loads are unaligned within `xs`.
    unsafe {
        let (mut lo0, mut lo1) = (_mm256_set1_ps(f32::INFINITY), _mm256_set1_ps(f32::INFINITY));
        let (mut hi0, mut hi1) = (
            _mm256_set1_ps(f32::NEG_INFINITY),
            _mm256_set1_ps(f32::NEG_INFINITY),
        );
        let (chunks, rest) = xs.as_chunks::<16>();
        for c in chunks {
            let a = _mm256_loadu_ps(c.as_ptr());
            let b = _mm256_loadu_ps(c.as_ptr().add(8));
            lo0 = _mm256_min_ps(lo0, a);
            lo1 = _mm256_min_ps(lo1, b);
            hi0 = _mm256_max_ps(hi0, a);
            hi1 = _mm256_max_ps(hi1, b);
        }
        let (mut lo_lanes, mut hi_lanes) = ([0f32; 8], [0f32; 8]);
        _mm256_storeu_ps(lo_lanes.as_mut_ptr(), _mm256_min_ps(lo0, lo1));
        _mm256_storeu_ps(hi_lanes.as_mut_ptr(), _mm256_max_ps(hi0, hi1));
        let mut lo = lo_lanes.iter().fold(f32::INFINITY, |a, &b| a.min(b));
        let mut hi = hi_lanes.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
        for &x in rest {
            lo = lo.min(x);
            hi = hi.max(x);
        }
        (lo, hi)
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// # Safety
    /// The CPU must have AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn run_avx2<R>(f: impl FnOnce() -> R) -> R {
        f()
    }

    /// # Safety
    /// The CPU must have AVX-512F; `src` holds `2·out.len()` bytes.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn f16_to_f32_avx512(src: &[u8], out: &mut [f32]) {
        let (chunks, tail) = out.as_chunks_mut::<16>();
        for (i, o) in chunks.iter_mut().enumerate() {
            let s = &src[32 * i..][..32];
            // SAFETY: `s` holds 32 bytes and `o` 16 floats; unaligned access.
            unsafe {
                let h = _mm256_loadu_si256(s.as_ptr().cast());
                _mm512_storeu_ps(o.as_mut_ptr(), _mm512_cvtph_ps(h));
            }
        }
        let done = 16 * chunks.len();
        super::f16_to_f32_scalar(&src[2 * done..], tail);
    }

    /// # Safety
    /// The CPU must have AVX-512F; `k` is a power of two and codebooks
    /// `first..first + codes.len()` lie within `centroids`, whose length
    /// fits an i32 eight times over; `out` holds two values per code.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn centroid_pairs_avx512(
        (centroids, k, first): (&[f32], usize, usize),
        codes: &[u8],
        gain: f32,
        out: &mut [f32],
    ) {
        let (chunks, _) = codes.as_chunks::<8>();
        let steps = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        let g = _mm512_set1_ps(gain);
        let base = centroids.as_ptr().cast::<f64>();
        for (i, c) in chunks.iter().enumerate() {
            // Pair index of code j: (first + j)·k + code.
            let book = (first + 8 * i) as i32;
            let books = _mm256_mullo_epi32(
                _mm256_add_epi32(_mm256_set1_epi32(book), steps),
                _mm256_set1_epi32(k as i32),
            );
            // SAFETY: `c` holds 8 bytes; the gathered pairs lie within
            // `centroids` (the caller's contract); `out` holds 16 values
            // from 16·i.
            unsafe {
                let codes = _mm256_and_si256(
                    _mm256_cvtepu8_epi32(_mm_loadl_epi64(c.as_ptr().cast())),
                    _mm256_set1_epi32(k as i32 - 1),
                );
                let pairs = _mm512_i32gather_pd::<8>(_mm256_add_epi32(books, codes), base);
                let v = _mm512_mul_ps(_mm512_castpd_ps(pairs), g);
                _mm512_storeu_ps(out.as_mut_ptr().add(16 * i), v);
            }
        }
        let done = 8 * chunks.len();
        super::centroid_pairs_scalar(
            (centroids, k, first + done),
            &codes[done..],
            gain,
            &mut out[2 * done..],
        );
    }

    /// # Safety
    /// The CPU must have AVX-512F and AVX-512BW; `levels` holds at least
    /// `2·packed.len()` bytes.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) unsafe fn unpack_nibbles_avx512(packed: &[u8], levels: &mut [u8]) {
        let (chunks, tail) = packed.as_chunks::<32>();
        for (i, c) in chunks.iter().enumerate() {
            let o = &mut levels[64 * i..][..64];
            // SAFETY: `c` holds 32 bytes and `o` 64; unaligned access.
            unsafe {
                let x = _mm512_cvtepu8_epi16(_mm256_loadu_si256(c.as_ptr().cast()));
                let lo = _mm512_and_si512(x, _mm512_set1_epi16(0xF));
                let hi = _mm512_and_si512(_mm512_slli_epi16::<4>(x), _mm512_set1_epi16(0xF00));
                _mm512_storeu_si512(o.as_mut_ptr().cast(), _mm512_or_si512(lo, hi));
            }
        }
        let done = 32 * chunks.len();
        super::unpack_nibbles_scalar(tail, &mut levels[2 * done..]);
    }

    /// # Safety
    /// The CPU must have AVX2; `levels` holds at least `2·packed.len()` bytes.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn unpack_nibbles_avx2(packed: &[u8], levels: &mut [u8]) {
        let (chunks, tail) = packed.as_chunks::<16>();
        for (i, c) in chunks.iter().enumerate() {
            let o = &mut levels[32 * i..][..32];
            // SAFETY: `c` holds 16 bytes and `o` 32; unaligned access.
            unsafe {
                let x = _mm256_cvtepu8_epi16(_mm_loadu_si128(c.as_ptr().cast()));
                let lo = _mm256_and_si256(x, _mm256_set1_epi16(0xF));
                let hi = _mm256_and_si256(_mm256_slli_epi16::<4>(x), _mm256_set1_epi16(0xF00));
                _mm256_storeu_si256(o.as_mut_ptr().cast(), _mm256_or_si256(lo, hi));
            }
        }
        let done = 16 * chunks.len();
        super::unpack_nibbles_scalar(tail, &mut levels[2 * done..]);
    }

    /// # Safety
    /// The CPU must have F16C and AVX; `src` holds `2·out.len()` bytes.
    #[target_feature(enable = "avx,f16c")]
    pub(super) unsafe fn f16_to_f32_f16c(src: &[u8], out: &mut [f32]) {
        let (chunks, tail) = out.as_chunks_mut::<8>();
        for (i, o) in chunks.iter_mut().enumerate() {
            let s = &src[16 * i..][..16];
            // SAFETY: `s` holds 16 bytes and `o` 8 floats; unaligned access.
            unsafe {
                let h = _mm_loadu_si128(s.as_ptr().cast());
                _mm256_storeu_ps(o.as_mut_ptr(), _mm256_cvtph_ps(h));
            }
        }
        let done = 8 * chunks.len();
        super::f16_to_f32_scalar(&src[2 * done..], tail);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every byte value, at every length around the vector widths, unpacks
    /// as the scalar loop does, on each path this CPU has.
    #[test]
    fn nibbles_unpack_like_the_scalar_loop() {
        let packed: Vec<u8> = (0..=255u8).chain((0..=255u8).rev()).collect();
        for n in [0, 1, 2, 15, 16, 17, 31, 32, 33, 63, 64, 65, 200, 511] {
            let mut want = vec![0xAA; 2 * n + 1];
            unpack_nibbles_scalar(&packed[..n], &mut want);
            let mut got = vec![0xAA; 2 * n + 1];
            unpack_nibbles(&packed[..n + 1], &mut got[..2 * n]);
            assert_eq!(got, want, "{n} bytes");
            #[cfg(target_arch = "x86_64")]
            if is_x86_feature_detected!("avx2") {
                let mut avx2 = vec![0xAA; 2 * n + 1];
                // SAFETY: the CPU has AVX2; `avx2` holds 2n bytes.
                unsafe { x86::unpack_nibbles_avx2(&packed[..n], &mut avx2) };
                assert_eq!(avx2, want, "{n} bytes, AVX2");
            }
        }
    }

    /// Centroid pairs come out as the scalar loop writes them, bit for bit,
    /// at every length around the vector width and for each codebook size.
    #[test]
    fn centroid_pairs_are_the_scalar_products() {
        for k in [2usize, 16, 256] {
            let books = 40;
            let centroids: Vec<f32> = (0..books * k * 2)
                .map(|i| ((i * 7919 % 1000) as f32 - 500.0) * 1.3e-3)
                .collect();
            for (n, first) in [
                (0, 0),
                (1, 3),
                (7, 0),
                (8, 1),
                (9, 5),
                (17, 2),
                (40, 0),
                (31, 9),
            ] {
                let codes: Vec<u8> = (0..n).map(|j| ((j * 37 + 11) % k) as u8).collect();
                let mut want = vec![0.0; 2 * n];
                centroid_pairs_scalar((&centroids, k, first), &codes, -1.7, &mut want);
                let mut got = vec![f32::NAN; 2 * n];
                centroid_pairs((&centroids, k, first), &codes, -1.7, &mut got);
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(&got),
                    bits(&want),
                    "k {k}, {n} codes from book {first}"
                );
            }
        }
    }

    /// The F16C rounding gives exactly the portable rounding, on every f16
    /// neighbourhood and across the range.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn f16c_rounding_equals_the_portable_rounding() {
        use crate::int::{Toward, round_to};
        use crate::spec::ScaleType;
        if !has_avx2_f16c() {
            return test_support::skip(
                test_support::Requirement::Isa,
                "kv-quant",
                "f16c_rounding_equals_the_portable_rounding",
                "no AVX2/F16C on this CPU",
            );
        }
        #[target_feature(enable = "f16c")]
        unsafe fn fast(x: f64, t: Toward) -> crate::error::Result<f32> {
            round_f16c(ScaleType::F16, x, t, "t")
        }
        let mut xs: Vec<f64> = Vec::new();
        for bits in 0..=0x7BFFu16 {
            let h = f64::from(half::f16::from_bits(bits).to_f32());
            for x in [h, -h, h * (1.0 + 1e-9), h * (1.0 - 1e-9), -h * (1.0 + 3e-4)] {
                xs.push(x);
            }
        }
        xs.extend([1e-12, -1e-12, 65504.0, 65519.9, 65520.0, 1e6, -1e6, 0.0]);
        for x in xs {
            for t in [Toward::Down, Toward::Up, Toward::Nearest] {
                // SAFETY: F16C checked above.
                let a = unsafe { fast(x, t) };
                let b = round_to(ScaleType::F16, x, t, "t");
                match (a, b) {
                    (Ok(a), Ok(b)) => assert_eq!(a.to_bits(), b.to_bits(), "{x} {t:?}"),
                    (Err(_), Err(_)) => {}
                    (a, b) => panic!("{x} {t:?}: {a:?} vs {b:?}"),
                }
            }
        }
    }

    #[test]
    fn every_f16_converts_like_the_scalar_path() {
        // All 65536 bit patterns, NaN payloads compared by bits.
        let src: Vec<u8> = (0..=u16::MAX).flat_map(u16::to_le_bytes).collect();
        let (mut fast, mut slow) = (vec![0f32; 65536], vec![0f32; 65536]);
        f16_to_f32(&src, &mut fast);
        f16_to_f32_scalar(&src, &mut slow);
        assert!(
            fast.iter()
                .zip(&slow)
                .all(|(a, b)| a.to_bits() == b.to_bits())
        );
        // Odd lengths exercise the tails.
        for n in [0, 1, 7, 9, 15, 17, 33] {
            let mut out = vec![0f32; n];
            f16_to_f32(&src[2 * 1000..2 * (1000 + n)], &mut out);
            assert_eq!(out, slow[1000..1000 + n]);
        }
    }
}
