//! AVX2 decoders for the one-value-per-codeword layouts.
//!
//! Both codes are systematic with the data in a byte's low nibble, so one
//! `vpshufb` of the data nibble gives the check bits its codeword would have;
//! XORed into the byte, it leaves in the high nibble the difference between
//! the check bits read and those expected, a syndrome in the basis of the check
//! bits that is zero exactly for a codeword. One `vptest` of the high nibbles
//! of a block of four 64-byte chunks sends a clean block (nearly all at real
//! error rates) to a plain store; otherwise each chunk is tested in turn, and
//! in a chunk with a non-zero difference a second shuffle maps each difference
//! to its data correction and outcome flags, and `vpmovmskb` turns the flags
//! into the erasure bitmap directly. Written by hand because this is the hot
//! path the paper fuses into attention, and the compiler does not find the
//! nibble lookups itself (measured: `cargo xtask bench gf2-codes`).

use std::arch::x86_64::*;

use super::hamming74::Tables as HammingTables;
use super::nibble::NibbleTables;
use super::secded84::Tables as SecdedTables;
use super::{BLOCK_CHUNKS, ChunkKernel, drive_chunks};
use crate::stats::DecodeStats;

#[inline(always)]
fn table(bytes: &[u8; 16]) -> __m256i {
    // SAFETY: `bytes` is 16 readable bytes; loadu has no alignment requirement.
    unsafe { _mm256_broadcastsi128_si256(_mm_loadu_si128(bytes.as_ptr().cast())) }
}

/// The two lookups of a systematic nibble code: the check bits of each data
/// nibble, and the correction and flags of each check-bit difference.
#[derive(Clone, Copy)]
struct CheckTables {
    check_hi: __m256i,
    action: __m256i,
}

impl CheckTables {
    fn new(t: &NibbleTables) -> Self {
        Self {
            check_hi: table(&t.check_hi),
            action: table(&t.action_by_check),
        }
    }

    /// `received` with its check bits replaced by their difference from the
    /// data's own: the high nibbles are zero exactly where a codeword was read.
    #[inline]
    #[target_feature(enable = "avx2,popcnt")]
    fn difference(&self, received: __m256i) -> __m256i {
        let lo = _mm256_and_si256(received, _mm256_set1_epi8(0x0F));
        _mm256_xor_si256(received, _mm256_shuffle_epi8(self.check_hi, lo))
    }

    /// Correction and flag extraction for 32 check-bit differences (from
    /// [`Self::difference`]); stores the 32 values.
    ///
    /// # Safety
    /// `out` must have 32 writable bytes; the CPU features must be present.
    #[inline]
    #[target_feature(enable = "avx2,popcnt")]
    unsafe fn correct32(&self, diff: __m256i, out: *mut u8) -> (u32, u32) {
        let nib = _mm256_set1_epi8(0x0F);
        let syndrome = _mm256_and_si256(_mm256_srli_epi16::<4>(diff), nib);
        let act = _mm256_shuffle_epi8(self.action, syndrome);
        let value = _mm256_and_si256(_mm256_xor_si256(diff, act), nib);
        // SAFETY: callers pass `out` with 32 writable bytes; storeu is unaligned.
        unsafe { _mm256_storeu_si256(out.cast(), value) };
        let detected = _mm256_movemask_epi8(act) as u32; // FLAG_DETECTED is bit 7
        let corrected = _mm256_movemask_epi8(_mm256_slli_epi16::<1>(act)) as u32; // FLAG_CORRECTED, bit 6
        (detected, corrected)
    }

    /// Decodes the 64 values of two vectors of check-bit differences (from
    /// [`Self::difference`]) into `out`; when all 64 are zero it stores the
    /// data nibbles as read and skips the correction.
    ///
    /// # Safety
    /// `out` must have 64 writable bytes; the CPU features must be present.
    #[inline]
    #[target_feature(enable = "avx2,popcnt")]
    unsafe fn decode64(&self, d0: __m256i, d1: __m256i, out: *mut u8) -> (u64, u64) {
        if _mm256_testz_si256(_mm256_or_si256(d0, d1), checks()) != 0 {
            // SAFETY: callers pass `out` with 64 writable bytes.
            unsafe { store_data(&[d0, d1], out) };
            return (0, 0);
        }
        // SAFETY: as above, for each 32-byte half.
        let ((det0, corr0), (det1, corr1)) =
            unsafe { (self.correct32(d0, out), self.correct32(d1, out.add(32))) };
        (
            u64::from(det0) | u64::from(det1) << 32,
            u64::from(corr0) | u64::from(corr1) << 32,
        )
    }

    /// Decodes the [`BLOCK_CHUNKS`] chunks of `received` (two vectors each)
    /// into `out`: one test of all their check-bit differences, and when one
    /// is non-zero, chunk by chunk through [`Self::decode64`] into `masks`.
    /// Returns whether the whole block was clean (`masks` then untouched).
    /// Not a `target_feature` function, so that it is always inlined (into
    /// the `target_feature` driver): called out of line, the vectors went
    /// through the stack and the decode slowed by a fifth.
    ///
    /// # Safety
    /// `out` must have `64 * BLOCK_CHUNKS` writable bytes; AVX2 and POPCNT
    /// must be present.
    #[inline(always)]
    unsafe fn decode_block(
        &self,
        received: [__m256i; 2 * BLOCK_CHUNKS],
        out: *mut u8,
        masks: &mut [(u64, u64); BLOCK_CHUNKS],
    ) -> bool {
        // SAFETY: the caller guarantees the CPU features and the bounds of
        // `out`: 64 · BLOCK_CHUNKS bytes, chunk j writing out[64j..64j + 64].
        unsafe {
            let diff = received.map(|r| self.difference(r));
            let any = diff
                .iter()
                .fold(_mm256_setzero_si256(), |a, &d| _mm256_or_si256(a, d));
            if _mm256_testz_si256(any, checks()) != 0 {
                store_data(&diff, out);
                return true;
            }
            for (j, m) in masks.iter_mut().enumerate() {
                *m = self.decode64(diff[2 * j], diff[2 * j + 1], out.add(64 * j));
            }
        }
        false
    }
}

/// The check bits of every byte.
#[inline]
#[target_feature(enable = "avx2,popcnt")]
fn checks() -> __m256i {
    _mm256_set1_epi8(0xF0u8 as i8)
}

/// Stores the data of check-bit differences whose high nibbles are all zero:
/// such a difference is its byte's data nibble, as it stands.
///
/// # Safety
/// `out` must have `32 * diff.len()` writable bytes; AVX2 must be present.
#[inline]
#[target_feature(enable = "avx2,popcnt")]
unsafe fn store_data(diff: &[__m256i], out: *mut u8) {
    for (i, &d) in diff.iter().enumerate() {
        // SAFETY: the caller's bound; storeu has no alignment requirement.
        unsafe { _mm256_storeu_si256(out.add(32 * i).cast(), d) };
    }
}

/// Where a kernel's received words come from: vector `i` of a chunk run
/// holds the 32 words `32i..32i + 32`, one per byte.
trait Received {
    /// Encoded bytes per 64 words.
    const CHUNK_BYTES: usize;

    /// Vector `i` of the words from `encoded`.
    ///
    /// # Safety
    /// AVX2 must be present; the bytes of words `32i..32i + 32` must be
    /// readable, as must any bytes up to [`super::CHUNK_READ`] past the
    /// chunk holding them.
    unsafe fn vector(&self, encoded: *const u8, i: usize) -> __m256i;
}

/// SECDED's words are its bytes.
struct SecdedBytes;

impl Received for SecdedBytes {
    const CHUNK_BYTES: usize = 64;

    #[inline(always)]
    unsafe fn vector(&self, encoded: *const u8, i: usize) -> __m256i {
        // SAFETY: the caller guarantees AVX2 and bytes 32i..32i + 32.
        unsafe { _mm256_loadu_si256(encoded.add(32 * i).cast()) }
    }
}

/// An AVX2 chunk kernel: the words of `R`, decoded by its code's tables.
struct Avx2Kernel<R> {
    received: R,
    tables: CheckTables,
}

impl<R: Received> ChunkKernel for Avx2Kernel<R> {
    const CHUNK_BYTES: usize = R::CHUNK_BYTES;

    #[inline(always)]
    unsafe fn decode_chunk_raw(&self, encoded: *const u8, out: *mut u8) -> (u64, u64) {
        let t = &self.tables;
        // SAFETY: the caller guarantees AVX2, CHUNK_READ readable bytes at
        // `encoded` (the two vectors of this chunk) and 64 writable at `out`.
        unsafe {
            let (r0, r1) = (
                self.received.vector(encoded, 0),
                self.received.vector(encoded, 1),
            );
            t.decode64(t.difference(r0), t.difference(r1), out)
        }
    }

    #[inline(always)]
    unsafe fn decode_block_raw(
        &self,
        encoded: *const u8,
        out: *mut u8,
        masks: &mut [(u64, u64); BLOCK_CHUNKS],
    ) -> bool {
        // SAFETY: the caller guarantees AVX2, the bytes of BLOCK_CHUNKS
        // chunks plus CHUNK_READ past the last one's start readable at
        // `encoded`, and 64 · BLOCK_CHUNKS writable bytes at `out`.
        unsafe {
            let received = std::array::from_fn(|i| self.received.vector(encoded, i));
            self.tables.decode_block(received, out, masks)
        }
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
    let kernel = Avx2Kernel {
        received: SecdedBytes,
        tables: CheckTables::new(t),
    };
    // Two call sites so that each inlined copy sees a constant `truth`.
    match truth {
        None => drive_chunks(&kernel, encoded, values, None, erasures),
        Some(t) => drive_chunks(&kernel, encoded, values, Some(t), erasures),
    }
}

/// Hamming's words are seven bits each, packed.
struct HammingBits {
    gather_a: __m256i,
    gather_b: __m256i,
    shift: __m256i,
}

impl HammingBits {
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

impl Received for HammingBits {
    const CHUNK_BYTES: usize = 56;

    #[inline(always)]
    unsafe fn vector(&self, encoded: *const u8, i: usize) -> __m256i {
        // SAFETY: the caller guarantees AVX2; words 32i..32i + 32 start at
        // byte 28i, and their unpacking reads 30 bytes, inside the caller's
        // bound (for i = 1 of a chunk, bytes 28..58 < CHUNK_READ).
        unsafe { self.unpack28(encoded.add(28 * i)) }
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
    let kernel = Avx2Kernel {
        received: HammingBits {
            gather_a,
            gather_b,
            shift,
        },
        tables: CheckTables::new(t),
    };
    // Two call sites so that each inlined copy sees a constant `truth`.
    match truth {
        None => drive_chunks(&kernel, encoded, values, None, erasures),
        Some(t) => drive_chunks(&kernel, encoded, values, Some(t), erasures),
    }
}
