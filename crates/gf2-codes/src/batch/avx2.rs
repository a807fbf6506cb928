//! AVX2 decoders for the one-value-per-codeword layouts.
//!
//! Both rest on one fact: a syndrome is linear in the received bits, so the
//! syndrome of a byte is the XOR of the syndromes of its two nibbles, and
//! 16-entry tables fit the `vpshufb` byte shuffle. A third shuffle maps the
//! syndrome to the data correction and the outcome flags; `vpmovmskb` turns the
//! flags into the erasure bitmap directly. Written by hand because this is the
//! hot path the paper fuses into attention, and the compiler does not find the
//! nibble-split lookups itself (measured: `cargo xtask bench gf2-codes`).

use std::arch::x86_64::*;

use super::hamming74::Tables as HammingTables;
use super::secded84::Tables as SecdedTables;
use super::{ChunkKernel, drive_chunks};
use crate::stats::DecodeStats;

#[inline(always)]
fn table(bytes: &[u8; 16]) -> __m256i {
    // SAFETY: `bytes` is 16 readable bytes; loadu has no alignment requirement.
    unsafe { _mm256_broadcastsi128_si256(_mm_loadu_si128(bytes.as_ptr().cast())) }
}

/// Syndrome lookup, correction and flag extraction for 32 received bytes whose
/// low nibble is the data and high nibble the check bits; stores 32 values.
/// A clean half-chunk (all syndromes zero) skips the action lookup.
///
/// # Safety
/// `out` must have 32 writable bytes; the CPU features must be present.
#[inline]
#[target_feature(enable = "avx2,popcnt")]
unsafe fn correct32(
    received: __m256i,
    syn_lo: __m256i,
    syn_hi: __m256i,
    action: __m256i,
    out: *mut u8,
) -> (u32, u32) {
    let nib = _mm256_set1_epi8(0x0F);
    let lo = _mm256_and_si256(received, nib);
    let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(received), nib);
    let syndrome = _mm256_xor_si256(
        _mm256_shuffle_epi8(syn_lo, lo),
        _mm256_shuffle_epi8(syn_hi, hi),
    );
    if _mm256_testz_si256(syndrome, syndrome) != 0 {
        // All 32 clean (the common case at real error rates): the nibbles as read.
        // SAFETY: callers pass `out` with 32 writable bytes; storeu is unaligned.
        unsafe { _mm256_storeu_si256(out.cast(), lo) };
        return (0, 0);
    }
    let act = _mm256_shuffle_epi8(action, syndrome);
    let value = _mm256_xor_si256(lo, _mm256_and_si256(act, nib));
    // SAFETY: callers pass `out` with 32 writable bytes; storeu is unaligned.
    unsafe { _mm256_storeu_si256(out.cast(), value) };
    let detected = _mm256_movemask_epi8(act) as u32; // FLAG_DETECTED is bit 7
    let corrected = _mm256_movemask_epi8(_mm256_slli_epi16::<1>(act)) as u32; // FLAG_CORRECTED, bit 6
    (detected, corrected)
}

struct SecdedAvx2 {
    syn_lo: __m256i,
    syn_hi: __m256i,
    action: __m256i,
}

impl ChunkKernel for SecdedAvx2 {
    const CHUNK_BYTES: usize = 64;

    #[inline(always)]
    unsafe fn decode_chunk_raw(&self, encoded: *const u8, out: *mut u8) -> (u64, u64) {
        let mut masks = [(0u32, 0u32); 2];
        for (half, m) in masks.iter_mut().enumerate() {
            // SAFETY: the caller guarantees AVX2, 64 readable bytes at `encoded`
            // and 64 writable at `out` (trait contract), so both halves are in bounds.
            *m = unsafe {
                let r = _mm256_loadu_si256(encoded.add(32 * half).cast());
                correct32(r, self.syn_lo, self.syn_hi, self.action, out.add(32 * half))
            };
        }
        (
            u64::from(masks[0].0) | u64::from(masks[1].0) << 32,
            u64::from(masks[0].1) | u64::from(masks[1].1) << 32,
        )
    }
}

/// SECDED batch decode with AVX2.
///
/// # Safety
/// The CPU must support AVX2 and POPCNT. Slice shapes must have been checked by the caller.
#[target_feature(enable = "avx2,popcnt")]
pub(crate) unsafe fn secded_decode_avx2(
    t: &SecdedTables,
    encoded: &[u8],
    values: &mut [u8],
    truth: Option<&[u8]>,
    erasures: &mut [u64],
) -> DecodeStats {
    let kernel = SecdedAvx2 {
        syn_lo: table(&t.syndrome_lo),
        syn_hi: table(&t.syndrome_hi),
        action: table(&t.action),
    };
    // Two call sites so that each inlined copy sees a constant `truth`.
    match truth {
        None => drive_chunks(&kernel, encoded, values, None, erasures),
        Some(t) => drive_chunks(&kernel, encoded, values, Some(t), erasures),
    }
}

struct HammingAvx2 {
    syn_lo: __m256i,
    syn_hi: __m256i,
    action: __m256i,
    gather_a: __m256i,
    gather_b: __m256i,
    shift: __m256i,
}

impl HammingAvx2 {
    /// Unpacks the 32 codewords of 28 packed bytes (two 7-byte groups per
    /// 128-bit lane) into one byte each.
    ///
    /// Codeword j of a group sits at bit 7j: it is the 16-bit pair
    /// (byte j−1, byte j) shifted right by 8 − j, or byte 0 for j = 0. The pair is
    /// gathered with `vpshufb` (byte 0 into the high half for j = 0), multiplied
    /// by 2^j and its high byte kept: `(pair << j) >> 8 = pair >> (8 − j)`.
    #[inline]
    #[target_feature(enable = "avx2,popcnt")]
    fn unpack28(&self, src: *const u8) -> __m256i {
        // SAFETY: callers guarantee 30 readable bytes from `src` (14 + 16).
        let x = unsafe { _mm256_loadu2_m128i(src.add(14).cast(), src.cast()) };
        let a = _mm256_srli_epi16::<8>(_mm256_mullo_epi16(
            _mm256_shuffle_epi8(x, self.gather_a),
            self.shift,
        ));
        let b = _mm256_srli_epi16::<8>(_mm256_mullo_epi16(
            _mm256_shuffle_epi8(x, self.gather_b),
            self.shift,
        ));
        _mm256_and_si256(_mm256_packus_epi16(a, b), _mm256_set1_epi8(0x7F))
    }
}

impl ChunkKernel for HammingAvx2 {
    const CHUNK_BYTES: usize = 56;

    #[inline(always)]
    unsafe fn decode_chunk_raw(&self, encoded: *const u8, out: *mut u8) -> (u64, u64) {
        let mut masks = [(0u32, 0u32); 2];
        for (half, m) in masks.iter_mut().enumerate() {
            // SAFETY: AVX2 is guaranteed by the caller; the second half reads
            // bytes 28..58 < CHUNK_READ = 64 and writes out[32..64] (trait contract).
            *m = unsafe {
                let cw = self.unpack28(encoded.add(28 * half));
                correct32(
                    cw,
                    self.syn_lo,
                    self.syn_hi,
                    self.action,
                    out.add(32 * half),
                )
            };
        }
        (
            u64::from(masks[0].0) | u64::from(masks[1].0) << 32,
            u64::from(masks[0].1) | u64::from(masks[1].1) << 32,
        )
    }
}

/// Hamming(7,4) batch decode with AVX2.
///
/// # Safety
/// The CPU must support AVX2 and POPCNT. Slice shapes must have been checked by the caller.
#[target_feature(enable = "avx2,popcnt")]
pub(crate) unsafe fn hamming_decode_avx2(
    t: &HammingTables,
    encoded: &[u8],
    values: &mut [u8],
    truth: Option<&[u8]>,
    erasures: &mut [u64],
) -> DecodeStats {
    const Z: i8 = -128; // vpshufb writes zero for indices with the top bit set
    #[rustfmt::skip]
    let gather_a = _mm256_setr_epi8(
        Z, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, Z,
        Z, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, Z,
    );
    #[rustfmt::skip]
    let gather_b = _mm256_setr_epi8(
        Z, 7, 7, 8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, Z,
        Z, 7, 7, 8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, Z,
    );
    let shift = _mm256_setr_epi16(1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128);
    let kernel = HammingAvx2 {
        syn_lo: table(&t.syndrome_lo),
        syn_hi: table(&t.syndrome_hi),
        action: table(&t.action),
        gather_a,
        gather_b,
        shift,
    };
    // Two call sites so that each inlined copy sees a constant `truth`.
    match truth {
        None => drive_chunks(&kernel, encoded, values, None, erasures),
        Some(t) => drive_chunks(&kernel, encoded, values, Some(t), erasures),
    }
}
