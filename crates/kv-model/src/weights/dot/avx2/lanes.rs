//! The AVX2 token-lane kernels: one weight row against eight tokens'
//! activations interleaved a token per 32-bit lane (`token_lanes.rs`).
//! Each computes, for each of the eight tokens, the bits its one-token
//! kernel in `mod.rs` computes (`scalar.rs` defines them); a row is
//! unpacked a segment at a time into an aligned buffer, and each four of
//! its codes are broadcast from there to the eight lanes by a load
//! (`vpbroadcastd`/`vbroadcastss` from memory use no vector port; taken
//! from a register, as the compiler does when the unpacked codes are still
//! in one, each broadcast cost two shuffles and the kernels ran at the
//! shuffle port's pace, 12% faster than the per-token kernels instead of
//! 2x).
//!
//! Every function is `unsafe` for its target features only, as in
//! `mod.rs`.

use std::arch::x86_64::*;

use super::super::super::kquants::scale_min_k4;
use super::super::super::token_lanes::{Q8Kx8Block, Q8x8Block};
use super::{bit_bytes, block_scales, f16_at, load, nibbles, q4_0_codes, q5_0_codes};

/// Codes `4c .. 4c + 4` of a row's unpacked codes broadcast to the eight
/// lanes, times each token's codes `4c .. 4c + 4` (`qs[8c .. 8c + 8]`),
/// summed in pairs by `vpmaddubsw`.
///
/// # Safety
/// `codes` must have `4c + 4` bytes and be 4-byte aligned (its four bytes
/// are read as an f32 by `vbroadcastss`), and `qs` must have `8c + 8`
/// entries. Every caller passes a 32-byte aligned buffer.
#[inline(always)]
unsafe fn chunk_product(codes: &[u8], qs: &[[i8; 4]], c: usize) -> __m256i {
    debug_assert!(4 * c + 4 <= codes.len() && 8 * c + 8 <= qs.len());
    debug_assert!(codes.as_ptr().align_offset(4) == 0);
    // SAFETY: in bounds by the caller's guarantee; loads are unaligned.
    // Only inlined into the AVX2 kernels below.
    unsafe {
        let w = _mm256_castps_si256(_mm256_broadcast_ss(
            &*codes.as_ptr().add(4 * c).cast::<f32>(),
        ));
        _mm256_maddubs_epi16(w, load(qs.as_ptr().add(8 * c).cast()))
    }
}

/// Blocks of a weight row unpacked at a time by [`lanes8_with`]: 1 KiB of
/// codes and their scales, in L1 beside the tokens' blocks.
const SEGMENT: usize = 32;

/// A segment's unpacked codes, 32-byte aligned.
#[repr(C, align(32))]
struct Unpacked([[u8; 32]; SEGMENT]);

/// How a block's 32 unpacked codes meet the eight tokens' codes: the
/// exact 32-bit sum per token (lane), `Σ_e code[e]·qs_t[e]`, with the codes
/// as stored (unsigned).
trait BlockSum {
    /// # Safety
    /// `codes` is 32 bytes, 4-byte aligned, and `qs` 64 entries, as
    /// [`chunk_product`] needs; the CPU has the implementation's features
    /// (it is only inlined into kernels that enable them).
    unsafe fn block_sum(codes: &[u8], qs: &[[i8; 4]]) -> __m256i;
}

/// AVX2: `vpmaddubsw` pairs, four pairs summed in 16 bits (at most
/// `4·2·31·127 = 31,496`: no overflow), then `vpmaddwd` widens them.
pub(super) struct Madd;

impl BlockSum for Madd {
    #[inline(always)]
    unsafe fn block_sum(codes: &[u8], qs: &[[i8; 4]]) -> __m256i {
        // SAFETY: k < 8: in bounds by the caller's guarantee; AVX2 by it too.
        unsafe {
            let ones = _mm256_set1_epi16(1);
            let low = _mm256_add_epi16(
                _mm256_add_epi16(chunk_product(codes, qs, 0), chunk_product(codes, qs, 1)),
                _mm256_add_epi16(chunk_product(codes, qs, 2), chunk_product(codes, qs, 3)),
            );
            let high = _mm256_add_epi16(
                _mm256_add_epi16(chunk_product(codes, qs, 4), chunk_product(codes, qs, 5)),
                _mm256_add_epi16(chunk_product(codes, qs, 6), chunk_product(codes, qs, 7)),
            );
            _mm256_add_epi32(_mm256_madd_epi16(low, ones), _mm256_madd_epi16(high, ones))
        }
    }
}

/// AVX-512 VNNI (on 256-bit registers, AVX-512VL): `vpdpbusd` multiplies
/// the broadcast four codes (unsigned) by each token's four (signed) and
/// adds the four products into the lane's 32-bit sum, one instruction
/// where AVX2 takes three; two chains of four, added. (On 512-bit
/// registers, two runs a product placed by `vpermd`, it measured slower
/// here: 1.02-1.08x AVX2 against 1.12-1.14x.)
pub(super) struct Vnni;

impl BlockSum for Vnni {
    #[inline(always)]
    unsafe fn block_sum(codes: &[u8], qs: &[[i8; 4]]) -> __m256i {
        // SAFETY: k < 8: in bounds by the caller's guarantee; AVX-512 VNNI
        // and VL by it too.
        unsafe {
            let (mut low, mut high) = (_mm256_setzero_si256(), _mm256_setzero_si256());
            for k in 0..4 {
                low = chunk_dpbusd(low, codes, qs, k);
                high = chunk_dpbusd(high, codes, qs, k + 4);
            }
            _mm256_add_epi32(low, high)
        }
    }
}

/// `acc` plus codes `4c .. 4c + 4` broadcast to the eight lanes times each
/// token's codes `4c .. 4c + 4`, summed by `vpdpbusd`. A function, not a
/// closure, for the reason [`block_term`] gives.
///
/// # Safety
/// As [`chunk_product`], and the CPU has AVX-512 VL and VNNI.
#[inline(always)]
unsafe fn chunk_dpbusd(acc: __m256i, codes: &[u8], qs: &[[i8; 4]], c: usize) -> __m256i {
    debug_assert!(4 * c + 4 <= codes.len() && 8 * c + 8 <= qs.len());
    // SAFETY: in bounds and aligned by the caller's guarantee.
    unsafe {
        let w = _mm256_castps_si256(_mm256_broadcast_ss(
            &*codes.as_ptr().add(4 * c).cast::<f32>(),
        ));
        _mm256_dpbusd_epi32(acc, w, load(qs.as_ptr().add(8 * c).cast()))
    }
}

/// `Q4_0`/`Q5_0` against eight tokens in lanes ([`Q8x8Block`]): the
/// two-chain accumulation of `scalar.rs`, for the eight at once.
/// `unpack(block)` gives the block's codes as stored, unsigned (`0 .. 16`
/// or `0 .. 32`); their offset `2^SHIFT` (8 or 16) comes off as
/// `2^SHIFT·Σy` from each token's code sum, so each lane's block sum is
/// the exact integer of the signed codes, whichever [`BlockSum`] took it.
///
/// The row is unpacked a segment at a time into a buffer, and each four
/// codes of a block are then broadcast from it to the eight lanes by a
/// load (`vpbroadcastd` from memory uses no vector port; taken from a
/// register, as the compiler does when the unpacked block is still in
/// one, each broadcast cost two shuffles and the kernel ran at the
/// shuffle port's pace), where they meet each token's four codes.
///
/// # Safety
/// The CPU has AVX2, FMA, F16C and what `S` needs: only inlined into
/// the `q4_0`/`q5_0` lane kernels, which enable them.
#[inline(always)]
unsafe fn lanes8_with<S: BlockSum, const SHIFT: i32>(
    w: &[u8],
    block_bytes: usize,
    y: &[Q8x8Block],
    unpack: impl Fn(&[u8]) -> __m256i,
) -> [f32; 8] {
    // SAFETY: the features by the caller's guarantee; every load is in
    // bounds as noted at each.
    unsafe {
        // The two chains in registers: indexed by a block's parity
        // (`acc[i % 2]`) they lived on the stack, and every block's
        // multiply-add waited for the store of the one before it
        // (measured: a fifth of the kernel's time on that store).
        let (mut even, mut odd) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        let mut codes = Unpacked([[0; 32]; SEGMENT]);
        let mut scales = [0f32; SEGMENT];
        for (w, y) in w.chunks(SEGMENT * block_bytes).zip(y.chunks(SEGMENT)) {
            let n = y.len().min(w.len() / block_bytes);
            for ((b, c), s) in w
                .chunks_exact(block_bytes)
                .zip(&mut codes.0)
                .zip(&mut scales)
            {
                // `c` is 32 bytes, aligned to 32.
                _mm256_store_si256(c.as_mut_ptr().cast(), unpack(b));
                *s = _mm_cvtss_f32(block_scales(b));
            }
            // SEGMENT is even: a block's parity is its parity in the segment.
            for i in (0..n).step_by(2) {
                let (d, sum) = block_term::<S, SHIFT>(&codes.0[i], scales[i], &y[i]);
                even = _mm256_fmadd_ps(d, sum, even);
                if i + 1 < n {
                    let (d, sum) =
                        block_term::<S, SHIFT>(&codes.0[i + 1], scales[i + 1], &y[i + 1]);
                    odd = _mm256_fmadd_ps(d, sum, odd);
                }
            }
        }
        let mut out = [0f32; 8];
        // `out` is eight f32.
        _mm256_storeu_ps(out.as_mut_ptr(), _mm256_add_ps(even, odd));
        out
    }
}

/// A block's scale `dw` times each token's, and the block's exact sum
/// less the codes' offset, as floats. A function, not a closure: a closure
/// in a function without target features is compiled without them (its
/// intrinsics become calls; measured: prefill 5.6 times slower).
///
/// # Safety
/// As [`lanes8_with`]; `codes` is 32 bytes aligned to 32.
#[inline(always)]
unsafe fn block_term<S: BlockSum, const SHIFT: i32>(
    codes: &[u8; 32],
    dw: f32,
    y: &Q8x8Block,
) -> (__m256, __m256) {
    // SAFETY: the features by the caller's guarantee; `qs` is 64 entries,
    // `sum` and `d` eight 32-bit values.
    unsafe {
        let sum = S::block_sum(codes, &y.qs);
        let offset = _mm256_slli_epi32::<SHIFT>(load(y.sum.as_ptr().cast()));
        let sum = _mm256_sub_epi32(sum, offset);
        let d = _mm256_mul_ps(_mm256_set1_ps(dw), _mm256_loadu_ps(y.d.as_ptr()));
        (d, _mm256_cvtepi32_ps(sum))
    }
}

/// `Q4_1`/`Q5_1` against eight tokens in lanes: the bits of [`lanes32`](super::lanes32)
/// for each of the eight. Lane `k` of that definition (values `4k .. 4k +
/// 4` of every block) is here the register `acc[k]`, a token per lane:
/// each block's four codes `4k .. 4k + 4` are broadcast and multiplied by
/// the tokens' four, and the eight registers are added at the end in
/// [`hsum_ps`](super::hsum_ps)'s order; the min terms are summed apart, as there.
#[target_feature(enable = "avx2,fma,f16c")]
fn lanes8_min(
    w: &[u8],
    block_bytes: usize,
    y: &[Q8x8Block],
    unpack: impl Fn(&[u8]) -> __m256i,
) -> [f32; 8] {
    let ones = _mm256_set1_epi16(1);
    let mut acc = [_mm256_setzero_ps(); 8];
    let mut mins = _mm256_setzero_ps();
    let mut codes = Unpacked([[0; 32]; SEGMENT]);
    let mut scales = [[0f32; 2]; SEGMENT];
    for (w, y) in w.chunks(SEGMENT * block_bytes).zip(y.chunks(SEGMENT)) {
        let n = y.len().min(w.len() / block_bytes);
        for ((b, c), s) in w
            .chunks_exact(block_bytes)
            .zip(&mut codes.0)
            .zip(&mut scales)
        {
            // SAFETY: `c` is 32 bytes, aligned to 32.
            unsafe { _mm256_store_si256(c.as_mut_ptr().cast(), unpack(b)) };
            let dm = block_scales(b);
            *s = [_mm_cvtss_f32(dm), _mm_cvtss_f32(_mm_movehdup_ps(dm))];
        }
        for ((c, [dw, mw]), y) in codes.0[..n].iter().zip(&scales[..n]).zip(&y[..n]) {
            // SAFETY: `d` and `s` are eight f32 of `y`.
            let (yd, ys) =
                unsafe { (_mm256_loadu_ps(y.d.as_ptr()), _mm256_loadu_ps(y.s.as_ptr())) };
            let d = _mm256_mul_ps(_mm256_broadcast_ss(dw), yd);
            for (k, acc) in acc.iter_mut().enumerate() {
                // SAFETY: k < 8: 32 codes, 64 entries of `qs`.
                let sum = _mm256_madd_epi16(unsafe { chunk_product(c, &y.qs, k) }, ones);
                *acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(sum), *acc);
            }
            mins = _mm256_add_ps(mins, _mm256_mul_ps(_mm256_broadcast_ss(mw), ys));
        }
    }
    // `(l0+l4) + (l2+l6)` and `(l1+l5) + (l3+l7)`, then those two.
    let even = _mm256_add_ps(_mm256_add_ps(acc[0], acc[4]), _mm256_add_ps(acc[2], acc[6]));
    let odd = _mm256_add_ps(_mm256_add_ps(acc[1], acc[5]), _mm256_add_ps(acc[3], acc[7]));
    let mut out = [0f32; 8];
    // SAFETY: `out` is eight f32.
    unsafe {
        _mm256_storeu_ps(
            out.as_mut_ptr(),
            _mm256_add_ps(_mm256_add_ps(even, odd), mins),
        )
    };
    out
}

/// `Q4_0 · Q8_0`, eight tokens in lanes.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn q4_0_lanes(w: &[u8], y: &[Q8x8Block]) -> [f32; 8] {
    // SAFETY: this function enables what `Madd` needs.
    unsafe { lanes8_with::<Madd, 3>(w, 18, y, |b| q4_0_codes(b)) }
}

/// `Q5_0 · Q8_0`, eight tokens in lanes.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn q5_0_lanes(w: &[u8], y: &[Q8x8Block]) -> [f32; 8] {
    // SAFETY: this function enables what `Madd` needs.
    unsafe { lanes8_with::<Madd, 4>(w, 22, y, |b| q5_0_codes(b)) }
}

/// `Q4_0 · Q8_0`, eight tokens in lanes, on AVX-512 VNNI.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(crate) fn q4_0_lanes_vnni(w: &[u8], y: &[Q8x8Block]) -> [f32; 8] {
    // SAFETY: this function enables what `Vnni` needs.
    unsafe { lanes8_with::<Vnni, 3>(w, 18, y, |b| q4_0_codes(b)) }
}

/// `Q5_0 · Q8_0`, eight tokens in lanes, on AVX-512 VNNI.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(crate) fn q5_0_lanes_vnni(w: &[u8], y: &[Q8x8Block]) -> [f32; 8] {
    // SAFETY: this function enables what `Vnni` needs.
    unsafe { lanes8_with::<Vnni, 4>(w, 22, y, |b| q5_0_codes(b)) }
}

/// `Q4_1 · Q8_1`, eight tokens in lanes.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn q4_1_lanes(w: &[u8], y: &[Q8x8Block]) -> [f32; 8] {
    // SAFETY: a block is 20 bytes (nibbles at 4..20).
    lanes8_min(w, 20, y, |b| unsafe { nibbles(b[..20].as_ptr().add(4)) })
}

/// `Q5_1 · Q8_1`, eight tokens in lanes.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn q5_1_lanes(w: &[u8], y: &[Q8x8Block]) -> [f32; 8] {
    lanes8_min(w, 24, y, |b| {
        let b = &b[..24];
        // SAFETY: a block is 24 bytes (`qh` at 4..8, nibbles at 8..24).
        let (low, high) = unsafe { (nibbles(b.as_ptr().add(8)), bit_bytes(b.as_ptr().add(4))) };
        _mm256_or_si256(low, _mm256_and_si256(high, _mm256_set1_epi8(0x10)))
    })
}

/// Super-blocks of a k-quant row unpacked at a time by [`q4_k_lanes`] and
/// [`q6_k_lanes`] (2 KiB of codes).
const SEGMENT_K: usize = 8;

/// A `Q4_K` super-block unpacked for [`q4_k_lanes`].
#[derive(Clone, Copy)]
#[repr(C, align(32))]
struct UnpackedK {
    /// The 256 codes in order.
    codes: [u8; 256],
    /// The eight runs' scales.
    scales: [i16; 8],
    /// The eight runs' mins.
    mins: [i16; 8],
    /// `d` and `dmin`.
    d: [f32; 2],
}

/// Defines a `Q4_K` token-lane kernel on `$features`, its runs summed and
/// scaled by `$run` ([`scaled_run_madd`] or [`scaled_run_dpbusd`]: the
/// same exact integers).
macro_rules! q4_k_lanes_kernel {
    ($(#[$doc:meta])* $name:ident, $features:literal, $run:ident) => {
        $(#[$doc])*
        #[target_feature(enable = $features)]
        pub(crate) fn $name(w: &[u8], y: &[Q8Kx8Block]) -> [f32; 8] {
    let mask = _mm256_set1_epi8(0x0f);
    let mut acc = _mm256_setzero_ps();
    let empty = UnpackedK {
        codes: [0; 256],
        scales: [0; 8],
        mins: [0; 8],
        d: [0.0; 2],
    };
    let mut unpacked = [empty; SEGMENT_K];
    for (w, y) in w.chunks(SEGMENT_K * 144).zip(y.chunks(SEGMENT_K)) {
        let n = y.len().min(w.len() / 144);
        for (b, u) in w.chunks_exact(144).zip(&mut unpacked) {
            for j in 0..4 {
                // SAFETY: `qs` is bytes 16..144 of the block, 32 per pair of
                // runs; `codes` has 64 bytes at 64j, aligned to 32.
                unsafe {
                    let q = load(b.as_ptr().add(16 + 32 * j));
                    let c = u.codes.as_mut_ptr().add(64 * j).cast::<__m256i>();
                    _mm256_store_si256(c, _mm256_and_si256(q, mask));
                    _mm256_store_si256(c.add(1), _mm256_and_si256(_mm256_srli_epi16::<4>(q), mask));
                }
            }
            for r in 0..8 {
                let (sc, m) = scale_min_k4(r, &b[4..16]);
                u.scales[r] = i16::from(sc);
                u.mins[r] = i16::from(m);
            }
            u.d = [f16_at(b, 0), f16_at(b, 2)];
        }
        for (u, y) in unpacked[..n].iter().zip(&y[..n]) {
            let mut sumi = _mm256_setzero_si256();
            let mut summ = _mm256_setzero_si256();
            for r in 0..8 {
                // SAFETY: run `r` is codes `32r .. 32r + 32` (of 256) and
                // entries `64r .. 64r + 64` of `qs` (of 512); the codes are
                // aligned to 32; the features are this function's.
                let run = unsafe { $run(&u.codes, &y.qs, 8 * r, 8, u.scales[r]) };
                sumi = _mm256_add_epi32(sumi, run);
                // SAFETY: `bsums[8r .. 8r + 8]` is 32 bytes of `y`.
                let sums = unsafe { load(y.bsums.as_ptr().add(8 * r).cast()) };
                summ =
                    _mm256_add_epi32(summ, _mm256_madd_epi16(sums, _mm256_set1_epi16(u.mins[r])));
            }
            // SAFETY: `d` is eight f32 of `y`.
            let yd = unsafe { _mm256_loadu_ps(y.d.as_ptr()) };
            let d = _mm256_mul_ps(yd, _mm256_set1_ps(u.d[0]));
            let dmin = _mm256_mul_ps(yd, _mm256_set1_ps(u.d[1]));
            // `acc + d·sumi − dmin·summ`, unfused, as `q4_k`.
            acc = _mm256_sub_ps(
                _mm256_add_ps(acc, _mm256_mul_ps(d, _mm256_cvtepi32_ps(sumi))),
                _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(summ)),
            );
        }
    }
    let mut out = [0f32; 8];
    // SAFETY: `out` is eight f32.
    unsafe { _mm256_storeu_ps(out.as_mut_ptr(), acc) };
    out
        }
    };
}

q4_k_lanes_kernel!(
    /// `Q4_K · Q8_K`, eight tokens in lanes ([`Q8Kx8Block`]): the bits of
    /// [`q4_k`](super::q4_k) for each of the eight. A run's four codes are broadcast from
    /// the unpacked super-block by a load, as in [`lanes8_with`]; a run's eight
    /// products sum in 16 bits (at most `8·2·15·127 = 30,480`) and
    /// `vpmaddwd` applies its scale; the mins meet each token's code sums in
    /// one `vpmaddwd` per run.
    q4_k_lanes,
    "avx2,fma,f16c",
    scaled_run_madd
);

q4_k_lanes_kernel!(
    /// [`q4_k_lanes`] on AVX-512 VNNI: its runs summed by `vpdpbusd`.
    q4_k_lanes_vnni,
    "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni",
    scaled_run_dpbusd
);

/// `chunks` runs of four codes from run-of-four `first` on, against the
/// eight tokens' codes, summed per token and times `scale` (exact
/// integers): on AVX2 the products sum in 16 bits (the callers' bounds:
/// at most `8·2·15·127 = 30,480` for `Q4_K`'s runs of 32, `4·2·63·127 =
/// 64,008` in two halves for `Q6_K`'s groups of 16, each half at most
/// 32,004), then `vpmaddwd` applies the scale.
///
/// # Safety
/// `codes` is 32-byte aligned with `4(first + chunks)` bytes, `qs` has
/// `8(first + chunks)` entries; the CPU has AVX2. `chunks` is 4 or 8.
#[inline(always)]
unsafe fn scaled_run_madd(
    codes: &[u8],
    qs: &[[i8; 4]],
    first: usize,
    chunks: usize,
    scale: i16,
) -> __m256i {
    // SAFETY: in bounds by the caller's guarantee. No closures: a closure
    // here would be compiled without the caller's features.
    unsafe {
        let sc = _mm256_set1_epi16(scale);
        if chunks == 8 {
            let low = pair_product(codes, qs, first);
            let low = _mm256_add_epi16(low, pair_product(codes, qs, first + 2));
            let high = pair_product(codes, qs, first + 4);
            let high = _mm256_add_epi16(high, pair_product(codes, qs, first + 6));
            _mm256_madd_epi16(_mm256_add_epi16(low, high), sc)
        } else {
            _mm256_add_epi32(
                _mm256_madd_epi16(pair_product(codes, qs, first), sc),
                _mm256_madd_epi16(pair_product(codes, qs, first + 2), sc),
            )
        }
    }
}

/// [`chunk_product`] of runs-of-four `at` and `at + 1`, added in 16 bits.
///
/// # Safety
/// As [`chunk_product`] for `at + 1`.
#[inline(always)]
unsafe fn pair_product(codes: &[u8], qs: &[[i8; 4]], at: usize) -> __m256i {
    // SAFETY: by the caller's guarantee.
    unsafe {
        _mm256_add_epi16(
            chunk_product(codes, qs, at),
            chunk_product(codes, qs, at + 1),
        )
    }
}

/// [`scaled_run_madd`]'s integers by `vpdpbusd` (two chains) and one
/// `vpmulld` by the scale.
///
/// # Safety
/// As [`scaled_run_madd`], and the CPU has AVX-512 VL and VNNI.
#[inline(always)]
unsafe fn scaled_run_dpbusd(
    codes: &[u8],
    qs: &[[i8; 4]],
    first: usize,
    chunks: usize,
    scale: i16,
) -> __m256i {
    // SAFETY: in bounds by the caller's guarantee.
    unsafe {
        let (mut a, mut b) = (_mm256_setzero_si256(), _mm256_setzero_si256());
        for k in (0..chunks).step_by(2) {
            a = chunk_dpbusd(a, codes, qs, first + k);
            b = chunk_dpbusd(b, codes, qs, first + k + 1);
        }
        _mm256_mullo_epi32(_mm256_add_epi32(a, b), _mm256_set1_epi32(i32::from(scale)))
    }
}

/// A `Q6_K` super-block unpacked for [`q6_k_lanes`].
#[derive(Clone, Copy)]
#[repr(C, align(32))]
struct Unpacked6K {
    /// The 256 codes in order (`0 .. 64`).
    codes: [u8; 256],
    /// The sixteen groups' scales.
    scales: [i16; 16],
    /// `d`.
    d: f32,
}

/// Defines a `Q6_K` token-lane kernel on `$features`, its groups summed
/// and scaled by `$run` (as [`q4_k_lanes_kernel`]).
macro_rules! q6_k_lanes_kernel {
    ($(#[$doc:meta])* $name:ident, $features:literal, $run:ident) => {
        $(#[$doc])*
        #[target_feature(enable = $features)]
        pub(crate) fn $name(w: &[u8], y: &[Q8Kx8Block]) -> [f32; 8] {
    let (mask, pair) = (_mm256_set1_epi8(0x0f), _mm256_set1_epi8(3));
    let mut acc = _mm256_setzero_ps();
    let empty = Unpacked6K {
        codes: [0; 256],
        scales: [0; 16],
        d: 0.0,
    };
    let mut unpacked = [empty; SEGMENT_K];
    for (w, y) in w.chunks(SEGMENT_K * 210).zip(y.chunks(SEGMENT_K)) {
        let n = y.len().min(w.len() / 210);
        for (b, u) in w.chunks_exact(210).zip(&mut unpacked) {
            for n in 0..2 {
                // SAFETY: `ql` is bytes 0..128 (64 per half), `qh` 128..192
                // (32 per half); `codes` has 128 bytes at 128n, aligned to 32.
                unsafe {
                    let l1 = load(b.as_ptr().add(64 * n));
                    let l2 = load(b.as_ptr().add(64 * n + 32));
                    let h = load(b.as_ptr().add(128 + 32 * n));
                    let high = |s: i32| {
                        let h = _mm256_srl_epi16(h, _mm_cvtsi32_si128(s));
                        _mm256_slli_epi16::<4>(_mm256_and_si256(h, pair))
                    };
                    let c = u.codes.as_mut_ptr().add(128 * n).cast::<__m256i>();
                    _mm256_store_si256(c, _mm256_or_si256(_mm256_and_si256(l1, mask), high(0)));
                    _mm256_store_si256(
                        c.add(1),
                        _mm256_or_si256(_mm256_and_si256(l2, mask), high(2)),
                    );
                    _mm256_store_si256(
                        c.add(2),
                        _mm256_or_si256(
                            _mm256_and_si256(_mm256_srli_epi16::<4>(l1), mask),
                            high(4),
                        ),
                    );
                    _mm256_store_si256(
                        c.add(3),
                        _mm256_or_si256(
                            _mm256_and_si256(_mm256_srli_epi16::<4>(l2), mask),
                            high(6),
                        ),
                    );
                }
            }
            u.scales = std::array::from_fn(|g| i16::from(b[192 + g] as i8));
            u.d = f16_at(b, 208);
        }
        for (u, y) in unpacked[..n].iter().zip(&y[..n]) {
            let mut sumi = _mm256_setzero_si256();
            let mut offset = _mm256_setzero_si256();
            for g in 0..16 {
                // SAFETY: group `g` is codes `16g .. 16g + 16` (of 256) and
                // entries `32g .. 32g + 32` of `qs` (of 512); the codes are
                // aligned to 32; the features are this function's.
                let group = unsafe { $run(&u.codes, &y.qs, 4 * g, 4, u.scales[g]) };
                sumi = _mm256_add_epi32(sumi, group);
            }
            for j in 0..8 {
                let (lo, hi) = (u.scales[2 * j] as u16, u.scales[2 * j + 1] as u16);
                let sc = _mm256_set1_epi32(((u32::from(hi) << 16) | u32::from(lo)) as i32);
                // SAFETY: `bsums[8j .. 8j + 8]` is 32 bytes of `y`.
                let sums = unsafe { load(y.bsums.as_ptr().add(8 * j).cast()) };
                offset = _mm256_add_epi32(offset, _mm256_madd_epi16(sums, sc));
            }
            // SAFETY: `d` is eight f32 of `y`.
            let yd = unsafe { _mm256_loadu_ps(y.d.as_ptr()) };
            let d = _mm256_mul_ps(yd, _mm256_set1_ps(u.d));
            let total = _mm256_sub_epi32(sumi, _mm256_slli_epi32::<5>(offset));
            // `acc + d·(sumi − 32·offset)`, unfused, as `q6_k`.
            acc = _mm256_add_ps(acc, _mm256_mul_ps(d, _mm256_cvtepi32_ps(total)));
        }
    }
    let mut out = [0f32; 8];
    // SAFETY: `out` is eight f32.
    unsafe { _mm256_storeu_ps(out.as_mut_ptr(), acc) };
    out
        }
    };
}

q6_k_lanes_kernel!(
    /// `Q6_K · Q8_K`, eight tokens in lanes: the bits of [`q6_k`](super::q6_k) for each of
    /// the eight, as [`q4_k_lanes`] computes `q4_k`'s. Two products of 6-bit
    /// codes sum in 16 bits (at most `2·2·63·127 = 32,004`), so each group of
    /// 16 values takes two `vpmaddwd` with its scale; the offsets
    /// `Σ_g sc_g·Σy_g` take one per pair of groups.
    q6_k_lanes,
    "avx2,fma,f16c",
    scaled_run_madd
);

q6_k_lanes_kernel!(
    /// [`q6_k_lanes`] on AVX-512 VNNI: its groups summed by `vpdpbusd`.
    q6_k_lanes_vnni,
    "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni",
    scaled_run_dpbusd
);
