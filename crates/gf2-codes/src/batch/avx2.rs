//! AVX2 decoders: SECDED(8,4) and Hamming(7,4) (one value per codeword),
//! Golay(24,12), and the interleaved `secded84x8` and `golay24x8`.
//!
//! SECDED and Hamming are systematic with the data in a byte's low nibble, so
//! one `vpshufb` of the data nibble gives the check bits its codeword would
//! have; XORed into the byte, it leaves in the high nibble the difference
//! between the check bits read and those expected, a syndrome in the basis of
//! the check bits that is zero exactly for a codeword. One `vptest` of the
//! high nibbles of a block of four 64-value chunks sends a clean block (most
//! of them at real error rates; at BER 1e-3 most SECDED blocks hold a flip) to
//! a plain store; otherwise each chunk is tested in turn, and in a chunk with a
//! non-zero difference a second shuffle maps each difference to its data
//! correction and outcome flags, and `vpmovmskb` turns the flags into the
//! erasure bitmap directly. Golay computes its parity from nibble tables the
//! same way, eight codewords per vector (see [`golay_decode_avx2`]). Written by
//! hand because this is the hot path the paper fuses into attention, and the
//! compiler does not find the nibble lookups itself (measured: `cargo xtask
//! bench gf2-codes`).

use std::arch::x86_64::*;

use super::golay24::{self, Tables as GolayTables};
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
    /// AVX2 must be present; `encoded` is the start of a chunk (or of a
    /// block of chunks), and [`super::CHUNK_READ`] bytes from the start of
    /// the chunk holding words `32i..32i + 32` must be readable.
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

/// `secded84x8`'s words: each 8-byte block holds bit `b` of its eight
/// codewords in byte `b`, so the block is an 8×8 bit matrix whose transpose
/// is the codewords' bytes; four blocks are transposed at once by the three
/// delta swaps of [`super::interleaved::transpose8`] in 64-bit lanes.
struct SecdedX8Planes;

impl Received for SecdedX8Planes {
    const CHUNK_BYTES: usize = 64;

    #[inline(always)]
    unsafe fn vector(&self, encoded: *const u8, i: usize) -> __m256i {
        // SAFETY: the caller guarantees AVX2 and bytes 32i..32i + 32.
        let x = unsafe { _mm256_loadu_si256(encoded.add(32 * i).cast()) };
        // SAFETY: AVX2 is present (the caller's guarantee).
        unsafe { transpose8x4(x) }
    }
}

/// [`super::interleaved::transpose8`] on each 64-bit lane.
#[inline]
#[target_feature(enable = "avx2,popcnt")]
fn transpose8x4(x: __m256i) -> __m256i {
    let m1 = _mm256_set1_epi64x(0x00AA_00AA_00AA_00AA);
    let t = _mm256_and_si256(_mm256_xor_si256(x, _mm256_srli_epi64::<7>(x)), m1);
    let x = _mm256_xor_si256(x, _mm256_xor_si256(t, _mm256_slli_epi64::<7>(t)));
    let m2 = _mm256_set1_epi64x(0x0000_CCCC_0000_CCCC);
    let t = _mm256_and_si256(_mm256_xor_si256(x, _mm256_srli_epi64::<14>(x)), m2);
    let x = _mm256_xor_si256(x, _mm256_xor_si256(t, _mm256_slli_epi64::<14>(t)));
    let m3 = _mm256_set1_epi64x(0x0000_0000_F0F0_F0F0);
    let t = _mm256_and_si256(_mm256_xor_si256(x, _mm256_srli_epi64::<28>(x)), m3);
    _mm256_xor_si256(x, _mm256_xor_si256(t, _mm256_slli_epi64::<28>(t)))
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
    drive_chunks(&kernel, encoded, values, truth, erasures)
}

/// `secded84x8` batch decode with AVX2: each 64-byte chunk (eight blocks)
/// transposed in registers, then decoded as plain SECDED.
///
/// # Safety
/// As [`secded_decode_avx2`]; `values.len()` must be a multiple of 64.
#[target_feature(enable = "avx2,popcnt")]
pub(crate) unsafe fn secded_x8_decode_avx2(
    t: &SecdedTables,
    encoded: &[u8],
    values: &mut [u8],
    truth: Option<&[u8]>,
    erasures: &mut [u64],
) -> DecodeStats {
    debug_assert!(values.len().is_multiple_of(64));
    let kernel = Avx2Kernel {
        received: SecdedX8Planes,
        tables: CheckTables::new(t),
    };
    drive_chunks(&kernel, encoded, values, truth, erasures)
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
        // byte 28i, and their unpacking reads 30 bytes. Vector i = 2j + h is
        // half h of chunk j (56j bytes in), reading bytes 28h..28h + 30 <=
        // 58 < CHUNK_READ of that chunk, inside the caller's bound.
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
    drive_chunks(&kernel, encoded, values, truth, erasures)
}

/// Golay(24,12) batch decode with AVX2, 64 codewords per block, eight per
/// vector (one 32-bit lane each): the syndrome `p(d) ⊕ p_received` with
/// `p(d)` the XOR of the parities of the data word's three nibbles, each
/// looked up by `vpshufb` in two 16-entry tables (its low byte and high
/// nibble; parity is linear, so the zero nibble's is zero and the other
/// bytes of a lane stay clear). Values are written as read; only words with
/// a non-zero syndrome go to the 4096-entry leader table, as in the AVX-512
/// kernel. The tail (under 64 codewords) takes the scalar loop.
/// `INTERLEAVED` reads `golay24x8`'s layout: a group's 24 bytes are one
/// interleaving block, whose three 8-byte planes, transposed in registers,
/// are the codewords' byte planes.
///
/// # Safety
/// The CPU must support AVX2 and POPCNT. Slice shapes must have been
/// checked by the caller; with `INTERLEAVED`, `values.len()` must be a
/// multiple of 192 (the plain layout's tail is decoded as such).
#[target_feature(enable = "avx2,popcnt")]
pub(crate) unsafe fn golay_decode_avx2<const INTERLEAVED: bool>(
    t: &GolayTables,
    encoded: &[u8],
    values: &mut [u8],
    erasures: &mut [u64],
) -> DecodeStats {
    const BLOCK_VALUES: usize = 192; // 64 codewords, 192 bytes, 3 erasure words
    const Z: i8 = -128; // vpshufb writes zero for indices with the top bit set
    let blocks = values.len() / BLOCK_VALUES;
    // Lane k of codeword group g: codewords 4k..4k + 4 of the group, read
    // from bytes 24g + 8k .. 24g + 8k + 16 (codewords 4-7 sit at offset 4).
    #[rustfmt::skip]
    let arrange = _mm256_setr_epi8(
        0, 1, 2, Z, 3, 4, 5, Z, 6, 7, 8, Z, 9, 10, 11, Z,
        4, 5, 6, Z, 7, 8, 9, Z, 10, 11, 12, Z, 13, 14, 15, Z,
    );
    // A lane's spread nibbles (v0 | v1 << 8 | v2 << 16) packed to 12 bytes,
    // then the two lanes' 12 bytes joined.
    #[rustfmt::skip]
    let pack = _mm256_setr_epi8(
        0, 1, 2, 4, 5, 6, 8, 9, 10, 12, 13, 14, Z, Z, Z, Z,
        0, 1, 2, 4, 5, 6, 8, 9, 10, 12, 13, 14, Z, Z, Z, Z,
    );
    let join = _mm256_setr_epi32(0, 1, 2, 4, 5, 6, 7, 7);
    // Interleaved: after the transposes, qword r holds byte r of codewords
    // 0..8; dwords (r, low half) to lane 0 and (r, high half) to lane 1, then
    // codeword k of a lane gathers bytes k, 4 + k and 8 + k.
    let by_codeword = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
    #[rustfmt::skip]
    let gather = _mm256_setr_epi8(
        0, 4, 8, Z, 1, 5, 9, Z, 2, 6, 10, Z, 3, 7, 11, Z,
        0, 4, 8, Z, 1, 5, 9, Z, 2, 6, 10, Z, 3, 7, 11, Z,
    );
    // Parity of nibble k of the data word, low byte and high nibble.
    let parity = |k: usize, shift: usize| {
        let bytes: [u8; 16] = std::array::from_fn(|v| {
            (t.parity[v << (4 * k)] >> shift) as u8 // the parity is linear
        });
        table(&bytes)
    };
    let (lo, hi) = (
        [parity(0, 0), parity(1, 0), parity(2, 0)],
        [parity(0, 8), parity(1, 8), parity(2, 8)],
    );
    let nib = _mm256_set1_epi32(0xF);

    let mut stats = DecodeStats::default();
    for b in 0..blocks {
        let enc = &encoded[BLOCK_VALUES * b..BLOCK_VALUES * (b + 1)];
        let out = &mut values[BLOCK_VALUES * b..BLOCK_VALUES * (b + 1)];
        let er = &mut erasures[3 * b..3 * b + 3];
        er.fill(0);
        // A loop, not `array::from_fn`: its closure was called out of line.
        let mut syndromes = [_mm256_setzero_si256(); 8];
        for (g, syndrome) in syndromes.iter_mut().enumerate() {
            let p = enc[24 * g..24 * g + 24].as_ptr();
            let w = if INTERLEAVED {
                // SAFETY: 16 + 8 bytes, the group's 24.
                let planes = unsafe {
                    _mm256_set_m128i(_mm_loadl_epi64(p.add(16).cast()), _mm_loadu_si128(p.cast()))
                };
                let bytes = _mm256_permutevar8x32_epi32(transpose8x4(planes), by_codeword);
                _mm256_shuffle_epi8(bytes, gather)
            } else {
                // SAFETY: both 16-byte reads lie in the group's 24 bytes.
                let x = unsafe { _mm256_loadu2_m128i(p.add(8).cast(), p.cast()) };
                _mm256_shuffle_epi8(x, arrange)
            };
            let n: [__m256i; 3] = [
                _mm256_and_si256(w, nib),
                _mm256_and_si256(_mm256_srli_epi32::<4>(w), nib),
                _mm256_and_si256(_mm256_srli_epi32::<8>(w), nib),
            ];
            let (expected_lo, expected_hi) = (look3(&lo, &n), look3(&hi, &n));
            let expected = _mm256_or_si256(expected_lo, _mm256_slli_epi32::<8>(expected_hi));
            let spread = _mm256_or_si256(
                _mm256_or_si256(n[0], _mm256_slli_epi32::<8>(n[1])),
                _mm256_slli_epi32::<16>(n[2]),
            );
            let packed = _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(spread, pack), join);
            // SAFETY: values 24g..24g + 24 of the 192-byte block: 16 + 8 bytes.
            unsafe {
                let o = out.as_mut_ptr().add(24 * g);
                _mm_storeu_si128(o.cast(), _mm256_castsi256_si128(packed));
                _mm_storel_epi64(o.add(16).cast(), _mm256_extracti128_si256::<1>(packed));
            }
            *syndrome = _mm256_xor_si256(expected, _mm256_srli_epi32::<12>(w));
        }
        stats.words += 64;
        let any = syndromes
            .iter()
            .fold(_mm256_setzero_si256(), |a, &s| _mm256_or_si256(a, s));
        if _mm256_testz_si256(any, any) != 0 {
            continue;
        }
        for (g, &s) in syndromes.iter().enumerate() {
            let zero = _mm256_cmpeq_epi32(s, _mm256_setzero_si256());
            let mut rest = !_mm256_movemask_ps(_mm256_castsi256_ps(zero)) as u32 & 0xFF;
            if rest == 0 {
                continue;
            }
            let mut lanes = [0u32; 8];
            // SAFETY: `lanes` is 32 writable bytes.
            unsafe { _mm256_storeu_si256(lanes.as_mut_ptr().cast(), s) };
            while rest != 0 {
                let lane = rest.trailing_zeros() as usize;
                rest &= rest - 1;
                golay24::correct_word(t, lanes[lane] as usize, 8 * g + lane, out, er, &mut stats);
            }
        }
    }
    golay24::finish_blocks(t, blocks, stats, encoded, values, erasures)
}

/// `tables[0][n[0]] ⊕ tables[1][n[1]] ⊕ tables[2][n[2]]`, byte by byte.
#[inline]
#[target_feature(enable = "avx2,popcnt")]
fn look3(tables: &[__m256i; 3], n: &[__m256i; 3]) -> __m256i {
    let a = _mm256_shuffle_epi8(tables[0], n[0]);
    let b = _mm256_shuffle_epi8(tables[1], n[1]);
    _mm256_xor_si256(_mm256_xor_si256(a, b), _mm256_shuffle_epi8(tables[2], n[2]))
}

/// SECDED encode with AVX2: one byte shuffle per 32 values.
///
/// # Safety
/// The CPU must support AVX2 and POPCNT; `values` must hold nibbles and
/// `encoded.len() == values.len()`.
#[target_feature(enable = "avx2,popcnt")]
pub(crate) unsafe fn secded_encode_avx2(t: &SecdedTables, values: &[u8], encoded: &mut [u8]) {
    assert_eq!(values.len(), encoded.len(), "one byte per value");
    let codewords = table(&t.encode);
    let (whole, _) = values.as_chunks::<32>();
    let (outs, _) = encoded.as_chunks_mut::<32>();
    for (v, e) in whole.iter().zip(outs) {
        // SAFETY: both arrays are 32 bytes; loadu/storeu are unaligned.
        unsafe {
            let v = _mm256_loadu_si256(v.as_ptr().cast());
            _mm256_storeu_si256(e.as_mut_ptr().cast(), _mm256_shuffle_epi8(codewords, v));
        }
    }
    let done = 32 * whole.len();
    for (e, &v) in encoded[done..].iter_mut().zip(&values[done..]) {
        *e = t.encode[usize::from(v & 0xF)];
    }
}
