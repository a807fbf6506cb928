//! `vpdpbusd` on 64 levels at a time (128 when packed two per byte: a
//! byte vector's low and high nibbles against the even and odd code
//! planes): four rows times up to four heads in sixteen accumulators,
//! folded together by one transposing reduction. Heads of 64 channels or
//! fewer put two rows in a vector instead ([`row_pairs`]), eight
//! accumulators for four rows of four heads, each half its own row.
//!
//! Class-weighted codes ([`super::classes`]) take the same accumulators:
//! lane `m` of a packed block's accumulator sums channels `8m..8m + 8`
//! of its block of 128 (or, for the last block of 64 channels or fewer of
//! a longer head, lanes `m` and `m + 8` the even and odd ones of channels
//! `8m..8m + 8`), so lane `m` holds class `m mod 8` alone, and the
//! reduction's first step,
//! which adds lanes `m` and `m + 8`, leaves one class a lane: each is
//! multiplied by its head's class weight there (`vpmulld`, eight per four
//! rows of four heads) and summed on. Integer sums in any order, so the
//! same bits as AVX2's `vpmaddwd` against the weights and the portable
//! loop: `vpdpbusd`, `vpmulld` and the additions wrap modulo 2^32, so the
//! result is the exact sum wherever that fits in i32, which
//! [`super::classes::weights_fit`] guarantees.

use std::arch::x86_64::*;

use super::{DotBlock, Prefetcher};

/// [`super::integer_sums`] with AVX-512 VNNI.
///
/// # Safety
/// The CPU must have AVX-512F/BW/VL/VNNI (as `Isa::Avx512Vnni` does), and
/// `b`'s bounds must hold as
/// [`super::integer_sums`] checks them.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn integer_sums(b: DotBlock<'_>, out: &mut [i32], prefetch: &mut Prefetcher) {
    match (b.packed, b.image.is_some(), b.lane_weights.is_some()) {
        (false, false, _) => heads::<false, false, false>(b, out, prefetch),
        (false, true, _) => heads::<false, true, false>(b, out, prefetch),
        (true, false, false) => heads::<true, false, false>(b, out, prefetch),
        (true, false, true) => heads::<true, false, true>(b, out, prefetch),
        (true, true, _) => heads::<true, true, false>(b, out, prefetch),
    }
}

/// [`block`] for `b`'s number of heads.
#[inline(always)]
fn heads<const PACKED: bool, const IMAGE: bool, const WEIGHTED: bool>(
    b: DotBlock<'_>,
    out: &mut [i32],
    prefetch: &mut Prefetcher,
) {
    match b.heads {
        1 => block::<1, PACKED, IMAGE, WEIGHTED>(b, out, prefetch),
        2 => block::<2, PACKED, IMAGE, WEIGHTED>(b, out, prefetch),
        3 => block::<3, PACKED, IMAGE, WEIGHTED>(b, out, prefetch),
        _ => block::<4, PACKED, IMAGE, WEIGHTED>(b, out, prefetch),
    }
}

/// Rows of `b`; with `IMAGE`, each level is read through `b.image`; with
/// `WEIGHTED`, each class's sums times its head's weight.
#[inline(always)]
fn block<const H: usize, const PACKED: bool, const IMAGE: bool, const WEIGHTED: bool>(
    b: DotBlock<'_>,
    out: &mut [i32],
    prefetch: &mut Prefetcher,
) {
    let quads = b.rows / 4 * 4;
    if b.len <= 64 {
        // Heads of 64 channels or fewer: two rows a vector.
        row_pairs::<H, PACKED, IMAGE, WEIGHTED>(b, out, prefetch, quads);
    } else {
        let weights4 = pair_weights::<H, 4, WEIGHTED>(b);
        for t in (0..quads).step_by(4) {
            prefetch.step();
            let sums = if PACKED {
                nibble_lanes::<H, 4, IMAGE>(b, t)
            } else {
                lanes::<H, 4, IMAGE>(b, t)
            };
            store::<H, 4, WEIGHTED>(sums, out, b.rows, t, &weights4);
        }
    }
    if quads == b.rows {
        return;
    }
    let weights1 = pair_weights::<H, 1, WEIGHTED>(b);
    for t in quads..b.rows {
        let sums = if PACKED {
            nibble_lanes::<H, 1, IMAGE>(b, t)
        } else {
            lanes::<H, 1, IMAGE>(b, t)
        };
        store::<H, 1, WEIGHTED>(sums, out, b.rows, t, &weights1);
    }
}

/// [`block`]'s rows `0..quads` for heads of at most 64 channels: rows `t`
/// and `t + 1` of a head share a vector, row `t`'s in its low 256 bits and
/// row `t + 1`'s in its high ones, so each `vpdpbusd` serves two rows
/// against codes broadcast to both halves (loaded once per call). Packed
/// levels (one block of the split codes) give a vector per nibble plane
/// against the even and odd codes; a byte a level, a vector per 32
/// channels (0..32, 32..64) against those codes. Lane `m` of each half
/// then sums channels `8m..8m + 8` of its row when packed, class `m` alone
/// ([`super::classes`]): with `WEIGHTED` (packed only) each lane is
/// multiplied by its head's class weight. [`reduce_pairs`] sums each half.
/// Against one row a vector this halves the reduction's shuffles per sum,
/// which held the integer scores at 9/3/64 (`perf annotate`: the
/// reduction's shuffles were their hottest instructions). Integer sums,
/// so the same bits.
#[inline(always)]
fn row_pairs<const H: usize, const PACKED: bool, const IMAGE: bool, const WEIGHTED: bool>(
    b: DotBlock<'_>,
    out: &mut [i32],
    prefetch: &mut Prefetcher,
    quads: usize,
) {
    // The bytes of each code vector (packed: a plane's, each a row's
    // bytes; a byte a level: channels 0..32 and 32..len), and where the
    // second starts.
    let ones = |n: usize| if n >= 32 { u32::MAX } else { (1u32 << n) - 1 };
    let (first, second, split) = if PACKED {
        (ones(b.len / 2), ones(b.len / 2), b.len / 2)
    } else {
        (ones(b.len.min(32)), ones(b.len.saturating_sub(32)), 32)
    };
    // SAFETY: only inlined into `integer_sums` (AVX-512F/BW/VL/VNNI). Every
    // level byte read is below `start + len <= ch` (`(start + len) / 2 <=
    // ch / 2` packed) of a row `< quads <= b.rows`, every code below
    // `(H − 1)·code_stride + len`, the rest masked off (`len <= 64`).
    unsafe {
        let image = image_lanes::<IMAGE>(b);
        let nibble = _mm512_set1_epi8(0x0F);
        // Each head's two code vectors in both 256-bit halves, and its
        // class weights (class `m` in lanes `m` and `8 + m`).
        let mut codes = [[_mm512_setzero_si512(); 2]; H];
        // `pair_weights`' pair `2j` for four rows: head `j`'s twice.
        let pairs = pair_weights::<H, 4, WEIGHTED>(b);
        let mut weights = [_mm512_setzero_si512(); H];
        for j in 0..H {
            weights[j] = pairs[2 * j];
            let p = b.codes.as_ptr().add(j * b.code_stride);
            codes[j][0] = _mm512_broadcast_i64x4(_mm256_maskz_loadu_epi8(first, p.cast()));
            // At most `len` past the head's codes (bytes of 32 channels
            // or fewer: an empty mask there).
            let rest = p.add(split.min(b.len));
            codes[j][1] = _mm512_broadcast_i64x4(_mm256_maskz_loadu_epi8(second, rest.cast()));
        }
        let stride = if PACKED { b.ch / 2 } else { b.ch };
        let row = |r: usize| {
            b.levels
                .as_ptr()
                .add(r * stride + if PACKED { b.start / 2 } else { b.start })
        };
        let mut sums = [0i32; 16];
        for t in (0..quads).step_by(4) {
            prefetch.step();
            let mut v = [_mm512_setzero_si512(); 8];
            for pair in 0..2 {
                let (r0, r1) = (row(t + 2 * pair), row(t + 2 * pair + 1));
                let mut x = if PACKED {
                    let both = _mm512_inserti64x4::<1>(
                        _mm512_castsi256_si512(_mm256_maskz_loadu_epi8(first, r0.cast())),
                        _mm256_maskz_loadu_epi8(first, r1.cast()),
                    );
                    [
                        _mm512_and_si512(both, nibble),
                        _mm512_and_si512(_mm512_srli_epi16::<4>(both), nibble),
                    ]
                } else {
                    let mask = u64::from(first) | u64::from(second) << 32;
                    let (a, c) = (
                        _mm512_maskz_loadu_epi8(mask, r0.cast()),
                        _mm512_maskz_loadu_epi8(mask, r1.cast()),
                    );
                    // Channels 0..32 of both rows, then 32..64.
                    [
                        _mm512_shuffle_i64x2::<0x44>(a, c),
                        _mm512_shuffle_i64x2::<0xEE>(a, c),
                    ]
                };
                if IMAGE {
                    // Masked-off bytes become image[0], against zero codes.
                    x = [
                        _mm512_shuffle_epi8(image, x[0]),
                        _mm512_shuffle_epi8(image, x[1]),
                    ];
                }
                for j in 0..H {
                    let acc = _mm512_dpbusd_epi32(_mm512_setzero_si512(), x[0], codes[j][0]);
                    let acc = _mm512_dpbusd_epi32(acc, x[1], codes[j][1]);
                    v[2 * j + pair] = if WEIGHTED {
                        _mm512_mullo_epi32(acc, weights[j])
                    } else {
                        acc
                    };
                }
            }
            // Lane `2m + h` is vector `m`'s half `h`: head `j`, row `t + r`
            // at lane `4j + r`, as `store` lays them out.
            _mm512_storeu_si512(sums.as_mut_ptr().cast(), reduce_pairs(v));
            for j in 0..H {
                out[j * b.rows + t..][..4].copy_from_slice(&sums[4 * j..][..4]);
            }
        }
    }
}

/// Lane `2m + h` of the result is the sum of half `h` (lanes `8h..8h + 8`)
/// of `v[m]`: pairs of 128-bit blocks first (blocks 0 and 1, 2 and 3),
/// which leaves each half's four partial lanes in one block, as
/// [`reduce16`]'s second step leaves each vector's, then its last steps.
#[inline(always)]
fn reduce_pairs(v: [__m512i; 8]) -> __m512i {
    // SAFETY: only inlined into `integer_sums` (AVX-512F); no memory is touched.
    unsafe {
        let mut x = [_mm512_setzero_si512(); 4];
        for (p, x) in x.iter_mut().enumerate() {
            let (a, b) = (v[2 * p], v[2 * p + 1]);
            *x = _mm512_add_epi32(
                _mm512_shuffle_i32x4::<0x88>(a, b),
                _mm512_shuffle_i32x4::<0xDD>(a, b),
            );
        }
        reduce_blocks(x)
    }
}

/// The multipliers of [`reduce16`]'s eight pair vectors with `WEIGHTED`:
/// pair `p` holds accumulators `2p` and `2p + 1` (head `i / R` for
/// accumulator `i`), class `k` of the first in lane `k` and of the second
/// in lane `8 + k`, so its lanes are those heads' class weights (zero for
/// accumulators past the heads). Unused (zeros) without `WEIGHTED`.
#[inline(always)]
fn pair_weights<const H: usize, const R: usize, const WEIGHTED: bool>(
    b: DotBlock<'_>,
) -> [__m512i; 8] {
    // SAFETY: only inlined into `integer_sums` (AVX-512F); each head's
    // weights are 16 readable i16. Loops, not closures (see `reduce16`).
    unsafe {
        let mut v = [_mm512_setzero_si512(); 8];
        let Some(weights) = b.lane_weights.filter(|_| WEIGHTED) else {
            return v;
        };
        // Lanes 0..8 from the first operand's even lanes, 8..16 from the
        // second's: the weights come twice each, as `vpmaddwd` reads them.
        let evens = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
        for (p, v) in v.iter_mut().enumerate() {
            let mut pair = [_mm512_setzero_si512(); 2];
            for (half, w) in pair.iter_mut().enumerate() {
                let i = 2 * p + half;
                if i < H * R {
                    let head = _mm256_loadu_si256(weights[i / R].as_ptr().cast());
                    *w = _mm512_cvtepi16_epi32(head);
                }
            }
            *v = _mm512_permutex2var_epi32(pair[0], evens, pair[1]);
        }
        v
    }
}

/// `b`'s image in every 128-bit lane, for `vpshufb` (NF4 levels are
/// nibbles: bit 7, which would zero a byte, is never set); zeros without
/// `IMAGE`.
#[inline(always)]
fn image_lanes<const IMAGE: bool>(b: DotBlock<'_>) -> __m512i {
    // SAFETY: only inlined into `integer_sums` (AVX-512F); the image is 16
    // readable bytes.
    unsafe {
        match b.image {
            Some(m) if IMAGE => _mm512_broadcast_i32x4(_mm_loadu_si128(m.as_ptr().cast())),
            _ => _mm512_setzero_si512(),
        }
    }
}

/// The accumulators of heads `j < H` and rows `t..t + R`.
#[inline(always)]
fn lanes<const H: usize, const R: usize, const IMAGE: bool>(
    b: DotBlock<'_>,
    t: usize,
) -> [[__m512i; R]; H] {
    // SAFETY: only inlined into `integer_sums` (AVX-512F/BW/VNNI). Rows
    // `t..t + R` are below `b.rows`; every byte read is below
    // `start + len <= ch` of its row or `(H − 1)·code_stride + len` of
    // the codes, the rest masked off.
    unsafe {
        let image = image_lanes::<IMAGE>(b);
        let mut acc = [[_mm512_setzero_si512(); R]; H];
        let mut c = 0;
        while c < b.len {
            let n = (b.len - c).min(64);
            let mask = if n == 64 { u64::MAX } else { (1u64 << n) - 1 };
            let mut k = [_mm512_setzero_si512(); R];
            for (r, k) in k.iter_mut().enumerate() {
                let p = b.levels.as_ptr().add((t + r) * b.ch + b.start + c);
                *k = _mm512_maskz_loadu_epi8(mask, p.cast());
                if IMAGE {
                    // Masked-off bytes become image[0], against zero codes.
                    *k = _mm512_shuffle_epi8(image, *k);
                }
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

/// [`lanes`] for levels packed two per byte, block by block of the split
/// codes: a block of `m` channels (128, the last one fewer) is `m/2` bytes
/// of a row, whose low nibbles (even channels) go against the block's
/// first `m/2` codes and high nibbles (odd channels) against the next
/// `m/2`; a block of 64 channels or fewer as one vector, its low nibbles
/// in lanes 0.. and high ones in lanes 32.., against its codes placed the
/// same way.
#[inline(always)]
fn nibble_lanes<const H: usize, const R: usize, const IMAGE: bool>(
    b: DotBlock<'_>,
    t: usize,
) -> [[__m512i; R]; H] {
    // SAFETY: only inlined into `integer_sums` (AVX-512F/BW/VNNI). Rows
    // `t..t + R` are below `b.rows`; every byte read is below `(start +
    // len) / 2 <= ch / 2` of its row, or `(H − 1)·code_stride + len` of
    // the codes, the rest masked off.
    unsafe {
        let image = image_lanes::<IMAGE>(b);
        let nibble = _mm512_set1_epi8(0x0F);
        let row = |r: usize| b.levels.as_ptr().add((t + r) * (b.ch / 2) + b.start / 2);
        let mut acc = [[_mm512_setzero_si512(); R]; H];
        let mut c = 0;
        // Whole blocks of 128 channels, then the last block of `2·half`.
        while c + 128 <= b.len {
            let mut even = [_mm512_setzero_si512(); R];
            let mut odd = [_mm512_setzero_si512(); R];
            for r in 0..R {
                let x = _mm512_loadu_si512(row(r).add(c / 2).cast());
                even[r] = _mm512_and_si512(x, nibble);
                odd[r] = _mm512_and_si512(_mm512_srli_epi16::<4>(x), nibble);
                if IMAGE {
                    even[r] = _mm512_shuffle_epi8(image, even[r]);
                    odd[r] = _mm512_shuffle_epi8(image, odd[r]);
                }
            }
            for (j, acc) in acc.iter_mut().enumerate() {
                let p = b.codes.as_ptr().add(j * b.code_stride + c);
                let qe = _mm512_loadu_si512(p.cast());
                let qo = _mm512_loadu_si512(p.add(64).cast());
                for ((a, e), o) in acc.iter_mut().zip(&even).zip(&odd) {
                    *a = _mm512_dpbusd_epi32(*a, *e, qe);
                    *a = _mm512_dpbusd_epi32(*a, *o, qo);
                }
            }
            c += 128;
        }
        let half = (b.len - c) / 2;
        if half > 32 {
            let mask = (1u64 << half) - 1;
            let mut even = [_mm512_setzero_si512(); R];
            let mut odd = [_mm512_setzero_si512(); R];
            for r in 0..R {
                let x = _mm512_maskz_loadu_epi8(mask, row(r).add(c / 2).cast());
                even[r] = _mm512_and_si512(x, nibble);
                odd[r] = _mm512_and_si512(_mm512_srli_epi16::<4>(x), nibble);
                if IMAGE {
                    // Lanes past the nibbles become image[0], against zero codes.
                    even[r] = _mm512_shuffle_epi8(image, even[r]);
                    odd[r] = _mm512_shuffle_epi8(image, odd[r]);
                }
            }
            for (j, acc) in acc.iter_mut().enumerate() {
                let p = b.codes.as_ptr().add(j * b.code_stride + c);
                let qe = _mm512_maskz_loadu_epi8(mask, p.cast());
                let qo = _mm512_maskz_loadu_epi8(mask, p.add(half).cast());
                for ((a, e), o) in acc.iter_mut().zip(&even).zip(&odd) {
                    *a = _mm512_dpbusd_epi32(*a, *e, qe);
                    *a = _mm512_dpbusd_epi32(*a, *o, qo);
                }
            }
        } else if half > 0 {
            let mask = (1u64 << half) - 1;
            let mut v = [_mm512_setzero_si512(); R];
            for (r, v) in v.iter_mut().enumerate() {
                let x = _mm512_maskz_loadu_epi8(mask, row(r).add(c / 2).cast());
                let even = _mm512_and_si512(x, nibble);
                let odd = _mm512_and_si512(_mm512_srli_epi16::<4>(x), nibble);
                *v = _mm512_inserti64x4::<1>(even, _mm512_castsi512_si256(odd));
                if IMAGE {
                    *v = _mm512_shuffle_epi8(image, *v);
                }
            }
            for (j, acc) in acc.iter_mut().enumerate() {
                let p = b.codes.as_ptr().add(j * b.code_stride + c);
                let qe = _mm512_maskz_loadu_epi8(mask, p.cast());
                let qo = _mm512_maskz_loadu_epi8(mask, p.add(half).cast());
                let q = _mm512_inserti64x4::<1>(qe, _mm512_castsi512_si256(qo));
                for (a, v) in acc.iter_mut().zip(&v) {
                    *a = _mm512_dpbusd_epi32(*a, *v, q);
                }
            }
        }
        acc
    }
}

/// Folds the accumulators (with `WEIGHTED`, each class times its weight
/// in `weights`, [`pair_weights`]) and stores head `j`, row `r` at
/// `out[j·rows + t + r]`.
#[inline(always)]
fn store<const H: usize, const R: usize, const WEIGHTED: bool>(
    acc: [[__m512i; R]; H],
    out: &mut [i32],
    rows: usize,
    t: usize,
    weights: &[__m512i; 8],
) {
    let mut sums = [0i32; 16];
    // SAFETY: only inlined into `integer_sums` (AVX-512F); `sums` holds 16 values.
    unsafe {
        let mut v = [_mm512_setzero_si512(); 16];
        for (j, a) in acc.iter().enumerate() {
            v[j * R..][..R].copy_from_slice(a);
        }
        _mm512_storeu_si512(sums.as_mut_ptr().cast(), reduce16::<WEIGHTED>(v, weights));
    }
    for j in 0..H {
        out[j * rows + t..][..R].copy_from_slice(&sums[j * R..][..R]);
    }
}

/// Lane `i` of the result is the sum of the 16 lanes of `v[i]`
/// (integer additions, so their order does not matter); with `WEIGHTED`,
/// the pair vectors of the first step (lane `k` of `v[2p]` plus lane
/// `k + 8`, then `v[2p + 1]`'s likewise) are multiplied by `weights[p]`
/// lane by lane first. Written with
/// loops filling arrays and no closures: a closure (as `std::array::from_fn`
/// takes) is compiled without the target features, so the intrinsics in it
/// become calls whenever the inliner gives up on it, which it did once the
/// kernel had NF4 instantiations too (`int4` decode 2.2x slower, seen with
/// `perf`).
#[inline(always)]
fn reduce16<const WEIGHTED: bool>(v: [__m512i; 16], weights: &[__m512i; 8]) -> __m512i {
    // SAFETY: only inlined into `integer_sums` (AVX-512F); no memory is touched.
    unsafe {
        // 128-bit blocks of pairs: lanes 0..8 hold v[2p]'s half sums, 8..16 v[2p + 1]'s.
        let mut w = [_mm512_setzero_si512(); 8];
        for (p, w) in w.iter_mut().enumerate() {
            let (a, b) = (v[2 * p], v[2 * p + 1]);
            *w = _mm512_add_epi32(
                _mm512_shuffle_i32x4::<0x44>(a, b),
                _mm512_shuffle_i32x4::<0xEE>(a, b),
            );
        }
        if WEIGHTED {
            for (w, m) in w.iter_mut().zip(weights) {
                *w = _mm512_mullo_epi32(*w, *m);
            }
        }
        let mut x = [_mm512_setzero_si512(); 4];
        for (p, x) in x.iter_mut().enumerate() {
            let (a, b) = (w[2 * p], w[2 * p + 1]);
            *x = _mm512_add_epi32(
                _mm512_shuffle_i32x4::<0x88>(a, b),
                _mm512_shuffle_i32x4::<0xDD>(a, b),
            );
        }
        reduce_blocks(x)
    }
}

/// The last steps of [`reduce16`] and [`reduce_pairs`]: block `k` of
/// `x[q]` holds four partial lanes of item `4q + k`; lane `i` of the
/// result is item `i`'s sum.
#[inline(always)]
fn reduce_blocks(x: [__m512i; 4]) -> __m512i {
    // SAFETY: only inlined into `integer_sums` (AVX-512F); no memory is touched.
    unsafe {
        let mut y = [_mm512_setzero_si512(); 2];
        for (p, y) in y.iter_mut().enumerate() {
            let (a, b) = (
                _mm512_castsi512_ps(x[2 * p]),
                _mm512_castsi512_ps(x[2 * p + 1]),
            );
            *y = _mm512_add_epi32(
                _mm512_castps_si512(_mm512_shuffle_ps::<0x44>(a, b)),
                _mm512_castps_si512(_mm512_shuffle_ps::<0xEE>(a, b)),
            );
        }
        let (a, b) = (_mm512_castsi512_ps(y[0]), _mm512_castsi512_ps(y[1]));
        let z = _mm512_add_epi32(
            _mm512_castps_si512(_mm512_shuffle_ps::<0x88>(a, b)),
            _mm512_castps_si512(_mm512_shuffle_ps::<0xDD>(a, b)),
        );
        let order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
        _mm512_permutexvar_epi32(order, z)
    }
}
