//! The x86 [`Lanes`]: one AVX-512 register ([`Zmm`]) or two AVX2
//! registers ([`Ymm2`]), and the kernel's entries compiled for each.

use std::arch::x86_64::*;

use kv_quant::LevelRows;

use super::lanes::{Lanes, Stash, gathered};
use super::{KernelScratch, Partial, Tile, attend_tile_lanes};
use crate::source::TileRows;

/// [`attend_tile`](crate::kernel::attend_tile) with AVX-512 ([`attend_tile_lanes`]).
///
/// # Safety
/// The CPU must have AVX-512F/BW/VL, AVX2, FMA and F16C; the scratch must
/// be sized for `tile.rows` rows of `tile.geometry` (as `attend_tile` does).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub(in crate::kernel) unsafe fn attend_tile_avx512(
    tile: Tile<'_>,
    keys: Option<TileRows<'_>>,
    values: TileRows<'_>,
    int_values: Option<LevelRows<'_>>,
    scratch: &mut KernelScratch,
    partial: &mut Partial,
) {
    // SAFETY: the caller checked the features and sized the scratch.
    unsafe { attend_tile_lanes::<Zmm>(tile, keys, values, int_values, scratch, partial) }
}

/// [`attend_tile`](crate::kernel::attend_tile) with AVX2 ([`attend_tile_lanes`]).
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C; the scratch must be sized for
/// `tile.rows` rows of `tile.geometry` (as `attend_tile` does).
#[target_feature(enable = "avx2,fma,f16c")]
pub(in crate::kernel) unsafe fn attend_tile_avx2(
    tile: Tile<'_>,
    keys: Option<TileRows<'_>>,
    values: TileRows<'_>,
    int_values: Option<LevelRows<'_>>,
    scratch: &mut KernelScratch,
    partial: &mut Partial,
) {
    // SAFETY: the caller checked the features and sized the scratch.
    unsafe { attend_tile_lanes::<Ymm2>(tile, keys, values, int_values, scratch, partial) }
}

/// The mask of the lowest `n < 16` lanes (all 16 for `n = 16`).
#[inline(always)]
pub(super) fn mask(n: usize) -> u16 {
    ((1u32 << n) - 1) as u16
}

/// One AVX-512 register.
#[derive(Clone, Copy)]
pub(in crate::kernel) struct Zmm(__m512);

// SAFETY (every method's block): inlined only into `attend_tile_avx512`
// (AVX-512F/BW/VL, AVX2, FMA, F16C); the caller keeps pointers valid for
// the lanes read (masked lanes are not read).
#[allow(clippy::undocumented_unsafe_blocks)] // one contract, stated above
impl Lanes for Zmm {
    const FMA: bool = true;
    const WIDENS_IN_REGISTERS: bool = true;
    const SCORE_ROWS: usize = 4;
    const VALUE_BLOCKS: usize = 16;

    #[inline(always)]
    unsafe fn zero() -> Self {
        unsafe { Self(_mm512_setzero_ps()) }
    }
    #[inline(always)]
    unsafe fn splat(x: f32) -> Self {
        unsafe { Self(_mm512_set1_ps(x)) }
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> Self {
        unsafe { Self(_mm512_loadu_ps(p)) }
    }
    #[inline(always)]
    unsafe fn load_partial(p: *const f32, n: usize) -> Self {
        unsafe { Self(_mm512_maskz_loadu_ps(mask(n), p)) }
    }
    #[inline(always)]
    unsafe fn halves(p: *const u8) -> Self {
        unsafe { Self(_mm512_cvtph_ps(_mm256_loadu_si256(p.cast()))) }
    }
    #[inline(always)]
    unsafe fn halves_partial(p: *const u8, n: usize) -> Self {
        unsafe { Self(_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask(n), p.cast()))) }
    }
    type Bytes = __m128i;
    #[inline(always)]
    unsafe fn bytes(p: *const u8) -> __m128i {
        unsafe { _mm_loadu_si128(p.cast()) }
    }
    #[inline(always)]
    unsafe fn bytes_partial(p: *const u8, n: usize) -> __m128i {
        unsafe { _mm_maskz_loadu_epi8(mask(n), p.cast()) }
    }
    #[inline(always)]
    unsafe fn store(self, p: *mut f32) {
        unsafe { _mm512_storeu_ps(p, self.0) }
    }
    #[inline(always)]
    unsafe fn fmadd(a: Self, b: Self, c: Self) -> Self {
        unsafe { Self(_mm512_fmadd_ps(a.0, b.0, c.0)) }
    }
    #[inline(always)]
    unsafe fn fmadd_low(a: Self, b: Self, c: Self, n: usize) -> Self {
        unsafe { Self(_mm512_mask3_fmadd_ps(a.0, b.0, c.0, mask(n))) }
    }
    #[inline(always)]
    unsafe fn add(a: Self, b: Self) -> Self {
        unsafe { Self(_mm512_add_ps(a.0, b.0)) }
    }
    #[inline(always)]
    unsafe fn sub(a: Self, b: Self) -> Self {
        unsafe { Self(_mm512_sub_ps(a.0, b.0)) }
    }
    #[inline(always)]
    unsafe fn mul(a: Self, b: Self) -> Self {
        unsafe { Self(_mm512_mul_ps(a.0, b.0)) }
    }
    #[inline(always)]
    unsafe fn levels(bytes: __m128i) -> Self {
        unsafe { Self(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes))) }
    }
    /// The 16 entries in one register: `vpermps` reads each lane's low 4 bits.
    #[inline(always)]
    unsafe fn lookup(bytes: __m128i, table: &[f32; 16]) -> Self {
        unsafe {
            let levels = _mm512_cvtepu8_epi32(bytes);
            Self(_mm512_permutexvar_ps(
                levels,
                _mm512_loadu_ps(table.as_ptr()),
            ))
        }
    }
    /// One `vpermps` (16 entries) or `vpermi2ps` (32).
    #[inline(always)]
    unsafe fn lookup_codes(codes: &[u8; 16], table: &[f32]) -> Self {
        unsafe {
            let idx = _mm512_cvtepu8_epi32(_mm_loadu_si128(codes.as_ptr().cast()));
            let p = table.as_ptr();
            match table.len() {
                16 => Self(_mm512_permutexvar_ps(idx, _mm512_loadu_ps(p))),
                32 => Self(_mm512_permutex2var_ps(
                    _mm512_loadu_ps(p),
                    idx,
                    _mm512_loadu_ps(p.add(16)),
                )),
                _ => gathered(codes, table),
            }
        }
    }
    /// The codes widened to 16-bit lanes, where the halves are built (not
    /// to 32-bit lanes narrowed back with `vpmovdw`, 9-15% slower).
    #[inline(always)]
    unsafe fn e5m2(bytes: __m128i) -> Self {
        unsafe {
            Self(_mm512_cvtph_ps(_mm256_slli_epi16::<8>(
                _mm256_cvtepu8_epi16(bytes),
            )))
        }
    }
    #[inline(always)]
    unsafe fn e4m3_scaled(bytes: __m128i) -> Self {
        unsafe {
            let codes = _mm256_cvtepu8_epi16(bytes);
            let magnitude = _mm256_and_si256(codes, _mm256_set1_epi16(0x7F));
            let sign = _mm256_slli_epi16::<8>(_mm256_and_si256(codes, _mm256_set1_epi16(0x80)));
            let value = _mm512_cvtph_ps(_mm256_or_si256(_mm256_slli_epi16::<7>(magnitude), sign));
            let nan = _mm256_cmpeq_epi16_mask(magnitude, _mm256_set1_epi16(0x7F));
            Self(_mm512_mask_mov_ps(value, nan, _mm512_set1_ps(f32::NAN)))
        }
    }
    /// The `R·H <= 16` accumulators folded together at once ([`reduce16`]).
    #[inline(always)]
    unsafe fn finish_scores<const H: usize, const R: usize>(
        acc: [[Self; R]; H],
        _stash: &mut Stash<H>,
        w: &mut [f32],
        rows: usize,
        t: usize,
    ) {
        let mut sums = [0.0f32; 16];
        unsafe {
            let mut lanes = [_mm512_setzero_ps(); 16];
            for (j, a) in acc.iter().enumerate() {
                for (r, a) in a.iter().enumerate() {
                    lanes[j * R + r] = a.0;
                }
            }
            _mm512_storeu_ps(sums.as_mut_ptr(), reduce16(lanes));
        }
        for j in 0..H {
            w[j * rows + t..][..R].copy_from_slice(&sums[j * R..][..R]);
        }
    }
}

/// Lane `i` of the result is the sum of the 16 lanes of `v[i]`, added as
/// [`Lanes::finish_scores`] says. Pairs of vectors are folded together by
/// shuffles so that each addition serves two, four, eight, then all
/// sixteen sums.
///
/// # Safety
/// Only called from code compiled with AVX-512F; no memory is touched.
#[inline(always)]
unsafe fn reduce16(v: [__m512; 16]) -> __m512 {
    // SAFETY: the caller has AVX-512F; registers only.
    unsafe {
        // Level 1: [a0 a1 b0 b1] + [a2 a3 b2 b3] in 128-bit blocks: lanes
        // 0..8 hold v[2p]'s `k + (k + 8)`, lanes 8..16 v[2p + 1]'s.
        let mut w = [_mm512_setzero_ps(); 8];
        for (p, w) in w.iter_mut().enumerate() {
            let (a, b) = (v[2 * p], v[2 * p + 1]);
            *w = _mm512_add_ps(
                _mm512_shuffle_f32x4::<0x44>(a, b),
                _mm512_shuffle_f32x4::<0xEE>(a, b),
            );
        }
        // Level 2: [a0 a2 b0 b2] + [a1 a3 b1 b3]: block k holds vector
        // 4p + k's `k + (k + 4)` of its eight.
        let mut x = [_mm512_setzero_ps(); 4];
        for (p, x) in x.iter_mut().enumerate() {
            let (a, b) = (w[2 * p], w[2 * p + 1]);
            *x = _mm512_add_ps(
                _mm512_shuffle_f32x4::<0x88>(a, b),
                _mm512_shuffle_f32x4::<0xDD>(a, b),
            );
        }
        // Level 3, within 128-bit blocks: [a0 a1 b0 b1] + [a2 a3 b2 b3];
        // block k holds vectors 8p + k and 8p + 4 + k, two lanes each.
        let mut y = [_mm512_setzero_ps(); 2];
        for (p, y) in y.iter_mut().enumerate() {
            let (a, b) = (x[2 * p], x[2 * p + 1]);
            *y = _mm512_add_ps(
                _mm512_shuffle_ps::<0x44>(a, b),
                _mm512_shuffle_ps::<0xEE>(a, b),
            );
        }
        // Level 4: [a0 a2 b0 b2] + [a1 a3 b1 b3]; block k holds the sums of
        // vectors k, 4 + k, 8 + k, 12 + k, so lane 4k + m is v[4m + k]'s.
        let z = _mm512_add_ps(
            _mm512_shuffle_ps::<0x88>(y[0], y[1]),
            _mm512_shuffle_ps::<0xDD>(y[0], y[1]),
        );
        let order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
        _mm512_permutexvar_ps(order, z)
    }
}

/// Two AVX2 registers, the low eight lanes first.
#[derive(Clone, Copy)]
pub(in crate::kernel) struct Ymm2([__m256; 2]);

// SAFETY (every method's block): as for `Ymm2`'s `Lanes` below.
#[allow(clippy::undocumented_unsafe_blocks)] // one contract, stated above
impl Ymm2 {
    /// Sixteen lanes from a zero-padded copy.
    #[inline(always)]
    unsafe fn copied(values: &[f32; 16]) -> Self {
        // SAFETY: `values` holds 16 floats.
        unsafe { Self::load(values.as_ptr()) }
    }

    /// The lanes of eight from `base` below `n`, as a blend mask.
    #[inline(always)]
    unsafe fn below(n: usize, base: i32) -> __m256 {
        unsafe {
            let lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
            _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n as i32 - base), lane))
        }
    }

    /// `table[level & 15]` for the low eight bytes: two 8-entry tables
    /// chosen per lane by bit 3 of the level (moved to the sign bit, which
    /// `blendv` reads).
    #[inline(always)]
    unsafe fn lookup8(bytes: __m128i, low: __m256, high: __m256) -> __m256 {
        unsafe {
            let levels = _mm256_cvtepu8_epi32(bytes);
            let upper = _mm256_castsi256_ps(_mm256_slli_epi32::<28>(levels));
            _mm256_blendv_ps(
                _mm256_permutevar8x32_ps(low, levels),
                _mm256_permutevar8x32_ps(high, levels),
                upper,
            )
        }
    }

    /// `table[level & 31]` for the low eight bytes, the table in four
    /// registers: [`lookup8`](Self::lookup8) of each half, chosen by bit 4
    /// (moved to the sign bit).
    #[inline(always)]
    unsafe fn lookup8x4(bytes: __m128i, t: &[__m256; 4]) -> __m256 {
        unsafe {
            let upper = _mm256_castsi256_ps(_mm256_slli_epi32::<27>(_mm256_cvtepu8_epi32(bytes)));
            _mm256_blendv_ps(
                Self::lookup8(bytes, t[0], t[1]),
                Self::lookup8(bytes, t[2], t[3]),
                upper,
            )
        }
    }

    /// E5M2 values of the low eight bytes.
    #[inline(always)]
    unsafe fn e5m2_8(bytes: __m128i) -> __m256 {
        unsafe { _mm256_cvtph_ps(_mm_slli_epi16::<8>(_mm_cvtepu8_epi16(bytes))) }
    }

    /// E4M3 values times 2^-8 of the low eight bytes ([`Lanes::e4m3_scaled`]).
    #[inline(always)]
    unsafe fn e4m3_8(bytes: __m128i) -> __m256 {
        unsafe {
            let moved = _mm_slli_epi16::<7>(_mm_cvtepi8_epi16(bytes));
            let field = _mm_and_si128(moved, _mm_set1_epi16(0x3F80));
            let nan = _mm_add_epi16(field, _mm_set1_epi16(0x80));
            let nan = _mm_and_si128(nan, _mm_set1_epi16(0x4000));
            let bits = _mm_and_si128(moved, _mm_set1_epi16(0xBFFF_u16 as i16));
            _mm256_cvtph_ps(_mm_or_si128(bits, nan))
        }
    }
}

// SAFETY (every method's block): inlined only into `attend_tile_avx2` (AVX2, FMA,
// F16C); the caller keeps pointers valid for the lanes read. Partial
// forms read through zero-padded copies (AVX2 has no byte masks).
#[allow(clippy::undocumented_unsafe_blocks)] // one contract, stated above
impl Lanes for Ymm2 {
    const FMA: bool = true;
    const WIDENS_IN_REGISTERS: bool = true;
    const SCORE_ROWS: usize = 1;
    const VALUE_BLOCKS: usize = 4;

    #[inline(always)]
    unsafe fn zero() -> Self {
        unsafe { Self([_mm256_setzero_ps(); 2]) }
    }
    #[inline(always)]
    unsafe fn splat(x: f32) -> Self {
        unsafe { Self([_mm256_set1_ps(x); 2]) }
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> Self {
        unsafe { Self([_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8))]) }
    }
    #[inline(always)]
    unsafe fn load_partial(p: *const f32, n: usize) -> Self {
        let mut lanes = [0.0f32; 16];
        unsafe {
            std::ptr::copy_nonoverlapping(p, lanes.as_mut_ptr(), n);
            Self::copied(&lanes)
        }
    }
    #[inline(always)]
    unsafe fn halves(p: *const u8) -> Self {
        unsafe {
            let p = p.cast::<__m128i>();
            Self([
                _mm256_cvtph_ps(_mm_loadu_si128(p)),
                _mm256_cvtph_ps(_mm_loadu_si128(p.add(1))),
            ])
        }
    }
    #[inline(always)]
    unsafe fn halves_partial(p: *const u8, n: usize) -> Self {
        let mut halves = [0u8; 32];
        unsafe {
            std::ptr::copy_nonoverlapping(p, halves.as_mut_ptr(), 2 * n);
            Self::halves(halves.as_ptr())
        }
    }
    type Bytes = __m128i;
    #[inline(always)]
    unsafe fn bytes(p: *const u8) -> __m128i {
        unsafe { _mm_loadu_si128(p.cast()) }
    }
    #[inline(always)]
    unsafe fn bytes_partial(p: *const u8, n: usize) -> __m128i {
        let mut bytes = [0u8; 16];
        unsafe {
            std::ptr::copy_nonoverlapping(p, bytes.as_mut_ptr(), n);
            _mm_loadu_si128(bytes.as_ptr().cast())
        }
    }
    #[inline(always)]
    unsafe fn store(self, p: *mut f32) {
        unsafe {
            _mm256_storeu_ps(p, self.0[0]);
            _mm256_storeu_ps(p.add(8), self.0[1]);
        }
    }
    #[inline(always)]
    unsafe fn fmadd(a: Self, b: Self, c: Self) -> Self {
        unsafe {
            Self([
                _mm256_fmadd_ps(a.0[0], b.0[0], c.0[0]),
                _mm256_fmadd_ps(a.0[1], b.0[1], c.0[1]),
            ])
        }
    }
    #[inline(always)]
    unsafe fn fmadd_low(a: Self, b: Self, c: Self, n: usize) -> Self {
        unsafe {
            let sum = Self::fmadd(a, b, c);
            Self([
                _mm256_blendv_ps(c.0[0], sum.0[0], Self::below(n, 0)),
                _mm256_blendv_ps(c.0[1], sum.0[1], Self::below(n, 8)),
            ])
        }
    }
    #[inline(always)]
    unsafe fn add(a: Self, b: Self) -> Self {
        unsafe { Self([_mm256_add_ps(a.0[0], b.0[0]), _mm256_add_ps(a.0[1], b.0[1])]) }
    }
    #[inline(always)]
    unsafe fn sub(a: Self, b: Self) -> Self {
        unsafe { Self([_mm256_sub_ps(a.0[0], b.0[0]), _mm256_sub_ps(a.0[1], b.0[1])]) }
    }
    #[inline(always)]
    unsafe fn mul(a: Self, b: Self) -> Self {
        unsafe { Self([_mm256_mul_ps(a.0[0], b.0[0]), _mm256_mul_ps(a.0[1], b.0[1])]) }
    }
    #[inline(always)]
    unsafe fn levels(bytes: __m128i) -> Self {
        unsafe {
            Self([
                _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes)),
                _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128::<8>(bytes))),
            ])
        }
    }
    #[inline(always)]
    unsafe fn lookup(bytes: __m128i, table: &[f32; 16]) -> Self {
        unsafe {
            let (low, high) = (
                _mm256_loadu_ps(table.as_ptr()),
                _mm256_loadu_ps(table.as_ptr().add(8)),
            );
            Self([
                Self::lookup8(bytes, low, high),
                Self::lookup8(_mm_srli_si128::<8>(bytes), low, high),
            ])
        }
    }
    /// Eight-entry tables chosen per lane by the code's bits 3 and 4.
    #[inline(always)]
    unsafe fn lookup_codes(codes: &[u8; 16], table: &[f32]) -> Self {
        unsafe {
            let bytes = _mm_loadu_si128(codes.as_ptr().cast());
            let high = _mm_srli_si128::<8>(bytes);
            let p = table.as_ptr();
            match table.len() {
                16 => {
                    let (t0, t1) = (_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8)));
                    Self([Self::lookup8(bytes, t0, t1), Self::lookup8(high, t0, t1)])
                }
                32 => {
                    let t = [
                        _mm256_loadu_ps(p),
                        _mm256_loadu_ps(p.add(8)),
                        _mm256_loadu_ps(p.add(16)),
                        _mm256_loadu_ps(p.add(24)),
                    ];
                    Self([Self::lookup8x4(bytes, &t), Self::lookup8x4(high, &t)])
                }
                _ => gathered(codes, table),
            }
        }
    }
    #[inline(always)]
    unsafe fn e5m2(bytes: __m128i) -> Self {
        unsafe {
            Self([
                Self::e5m2_8(bytes),
                Self::e5m2_8(_mm_srli_si128::<8>(bytes)),
            ])
        }
    }
    /// The code sign-extended to 16 bits and moved up by 7 puts the sign in
    /// bits 15 and 14, exponent and mantissa in bits 13..7, where a half
    /// keeps them (bit 14 cleared); adding 0x80 to the field carries into
    /// bit 14 exactly when it is all ones (NaN): the half's exponent is
    /// then all ones and its mantissa not zero. (A NaN's sign and payload
    /// may differ from [`Zmm`]'s.)
    #[inline(always)]
    unsafe fn e4m3_scaled(bytes: __m128i) -> Self {
        unsafe {
            Self([
                Self::e4m3_8(bytes),
                Self::e4m3_8(_mm_srli_si128::<8>(bytes)),
            ])
        }
    }
    /// Each row's two registers added (the tree's `+8` step) and kept in
    /// `stash`; every eight rows, and at the last, [`reduce8`] folds eight
    /// rows of a head at once.
    #[inline(always)]
    unsafe fn finish_scores<const H: usize, const R: usize>(
        acc: [[Self; R]; H],
        stash: &mut Stash<H>,
        w: &mut [f32],
        rows: usize,
        t: usize,
    ) {
        unsafe {
            for (s, a) in stash.iter_mut().zip(&acc) {
                for (r, a) in a.iter().enumerate() {
                    let folded = _mm256_add_ps(a.0[0], a.0[1]);
                    _mm256_storeu_ps(s[(t + r) % 8].as_mut_ptr(), folded);
                }
            }
            let end = t + R;
            if end.is_multiple_of(8) || end == rows {
                let first = (end - 1) / 8 * 8;
                let mut sums = [0.0f32; 8];
                for (j, s) in stash.iter().enumerate() {
                    let mut rows8 = [_mm256_setzero_ps(); 8];
                    for (v, s) in rows8.iter_mut().zip(s) {
                        *v = _mm256_loadu_ps(s.as_ptr());
                    }
                    _mm256_storeu_ps(sums.as_mut_ptr(), reduce8(rows8));
                    w[j * rows + first..][..end - first].copy_from_slice(&sums[..end - first]);
                }
            }
        }
    }
}

/// Lane `i` of the result is the sum of the eight lanes of `v[i]`, added
/// as the last three levels of [`Lanes::finish_scores`]' tree: lane `k`
/// gets `k + 4`, then `k + 2` and `k + 1`; pairs of vectors are folded
/// together by shuffles so that each addition serves two, four, then all
/// eight sums.
///
/// # Safety
/// Only called from code compiled with AVX2; no memory is touched.
#[inline(always)]
unsafe fn reduce8(v: [__m256; 8]) -> __m256 {
    // SAFETY: the caller has AVX2; registers only.
    unsafe {
        // [a.lo | b.lo] + [a.hi | b.hi]: lanes 0..4 hold v[2p]'s `k + (k + 4)`,
        // lanes 4..8 v[2p + 1]'s.
        let mut w = [_mm256_setzero_ps(); 4];
        for (p, w) in w.iter_mut().enumerate() {
            let (a, b) = (v[2 * p], v[2 * p + 1]);
            *w = _mm256_add_ps(
                _mm256_permute2f128_ps::<0x20>(a, b),
                _mm256_permute2f128_ps::<0x31>(a, b),
            );
        }
        // Within 128-bit blocks, [a0 a1 b0 b1] + [a2 a3 b2 b3]: the low
        // block holds v[4p] and v[4p + 2], two lanes each; the high block
        // v[4p + 1] and v[4p + 3].
        let mut x = [_mm256_setzero_ps(); 2];
        for (p, x) in x.iter_mut().enumerate() {
            let (a, b) = (w[2 * p], w[2 * p + 1]);
            *x = _mm256_add_ps(
                _mm256_shuffle_ps::<0x44>(a, b),
                _mm256_shuffle_ps::<0xEE>(a, b),
            );
        }
        // [a0 a2 b0 b2] + [a1 a3 b1 b3]: the low block holds the sums of
        // v[0], v[2], v[4], v[6], the high block those of v[1], v[3], v[5], v[7].
        let z = _mm256_add_ps(
            _mm256_shuffle_ps::<0x88>(x[0], x[1]),
            _mm256_shuffle_ps::<0xDD>(x[0], x[1]),
        );
        _mm256_permutevar8x32_ps(z, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7))
    }
}
