//! AVX-512 (F, BW, VBMI) + GFNI decoders for all three layouts.
//!
//! A syndrome is a GF(2)-linear map of the received bits, and
//! `vgf2p8affineqb` applies an 8x8 bit matrix to every byte of a vector: one
//! instruction computes 64 SECDED or Hamming syndromes, and three compute the
//! low or high byte of 64 Golay syndromes from the byte-planes of 64
//! codewords. `vpmultishiftqb` cuts the 7-bit Hamming codewords out of their
//! packed groups, and `vpermb`/`vpermi2b` transpose Golay's 3-byte codewords
//! into byte-planes and the decoded values back. Written by hand because this
//! is the memory-speed path of the paper's protected KV cache; measured with
//! `cargo xtask bench gf2-codes`.

use std::arch::x86_64::*;

use super::golay24::{self, Tables as GolayTables};
use super::hamming74::Tables as HammingTables;
use super::nibble::FLAG_CORRECTED;
use super::secded84::Tables as SecdedTables;
use super::{ChunkKernel, drive_chunks};
use crate::stats::DecodeStats;

#[inline(always)]
fn table16(bytes: &[u8; 16]) -> __m512i {
    // SAFETY: `bytes` is 16 readable bytes; loadu has no alignment requirement.
    unsafe { _mm512_broadcast_i32x4(_mm_loadu_si128(bytes.as_ptr().cast())) }
}

/// Syndrome, correction and flags for 64 received bytes whose low nibble is
/// the data; stores 64 values and returns (detected, corrected) masks.
///
/// # Safety
/// `out` must have 64 writable bytes; the CPU features must be present.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi,gfni,popcnt")]
unsafe fn correct64(
    received: __m512i,
    affine: __m512i,
    action: __m512i,
    out: *mut u8,
) -> (u64, u64) {
    let syndrome = _mm512_gf2p8affine_epi64_epi8::<0>(received, affine);
    let act = _mm512_shuffle_epi8(action, syndrome);
    // Corrections live in the action's low nibble, flags in bits 6 and 7.
    let value = _mm512_and_si512(_mm512_xor_si512(received, act), _mm512_set1_epi8(0x0F));
    // SAFETY: callers pass `out` with 64 writable bytes; storeu is unaligned.
    unsafe { _mm512_storeu_si512(out.cast(), value) };
    (
        _mm512_movepi8_mask(act),
        _mm512_test_epi8_mask(act, _mm512_set1_epi8(FLAG_CORRECTED as i8)),
    )
}

struct SecdedAvx512 {
    affine: __m512i,
    action: __m512i,
}

impl SecdedAvx512 {
    /// The kernel's constants from the tables.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vbmi,gfni,popcnt")]
    fn new(t: &SecdedTables) -> Self {
        Self {
            affine: _mm512_set1_epi64(t.syndrome_affine as i64),
            action: table16(&t.action),
        }
    }
}

impl ChunkKernel for SecdedAvx512 {
    const CHUNK_BYTES: usize = 64;

    #[inline(always)]
    unsafe fn decode_chunk_raw(&self, encoded: *const u8, out: *mut u8) -> (u64, u64) {
        // SAFETY: the caller guarantees the features, 64 readable bytes at
        // `encoded` and 64 writable at `out` (trait contract).
        unsafe {
            let x = _mm512_loadu_si512(encoded.cast());
            correct64(x, self.affine, self.action, out)
        }
    }
}

/// SECDED batch decode with AVX-512 + GFNI.
///
/// # Safety
/// The CPU must support AVX-512 F/BW/VBMI, GFNI and POPCNT. Slice shapes must
/// have been checked by the caller.
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi,gfni,popcnt")]
pub(crate) unsafe fn secded_decode_avx512(
    t: &SecdedTables,
    encoded: &[u8],
    values: &mut [u8],
    truth: Option<&[u8]>,
    erasures: &mut [u64],
) -> DecodeStats {
    let kernel = SecdedAvx512::new(t);
    drive_chunks(&kernel, encoded, values, truth, erasures)
}

/// SECDED over the interleaved layout: each 64-byte chunk (eight whole
/// blocks) is transposed back in registers (a byte reversal per plane and
/// one `vgf2p8affineqb`, as `interleaved`'s permutation does) before the
/// plain kernel's correction.
struct SecdedX8Avx512 {
    plain: SecdedAvx512,
    reverse: __m512i,
    units: __m512i,
}

impl ChunkKernel for SecdedX8Avx512 {
    const CHUNK_BYTES: usize = 64;

    #[inline(always)]
    unsafe fn decode_chunk_raw(&self, encoded: *const u8, out: *mut u8) -> (u64, u64) {
        // SAFETY: as for the plain kernel (trait contract).
        unsafe {
            let x = _mm512_loadu_si512(encoded.cast());
            let x = _mm512_permutexvar_epi8(self.reverse, x);
            let x = _mm512_gf2p8affine_epi64_epi8::<0>(self.units, x);
            correct64(x, self.plain.affine, self.plain.action, out)
        }
    }
}

/// SECDED decode of the interleaved layout (`secded84x8`) with AVX-512 +
/// GFNI, for a whole number of 64-value chunks.
///
/// # Safety
/// As [`secded_decode_avx512`]; `values.len()` must be a multiple of 64.
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi,gfni,popcnt")]
pub(crate) unsafe fn secded_x8_decode_avx512(
    t: &SecdedTables,
    reverse: &[u8; 64],
    encoded: &[u8],
    values: &mut [u8],
    truth: Option<&[u8]>,
    erasures: &mut [u64],
) -> DecodeStats {
    debug_assert!(values.len().is_multiple_of(64));
    let kernel = SecdedX8Avx512 {
        plain: SecdedAvx512::new(t),
        // SAFETY: 64 readable bytes.
        reverse: unsafe { _mm512_loadu_si512(reverse.as_ptr().cast()) },
        units: _mm512_set1_epi64(0x8040_2010_0804_0201_u64 as i64),
    };
    drive_chunks(&kernel, encoded, values, truth, erasures)
}

struct HammingAvx512 {
    group: __m512i,
    offsets: __m512i,
    affine: __m512i,
    action: __m512i,
}

impl ChunkKernel for HammingAvx512 {
    const CHUNK_BYTES: usize = 56;

    #[inline(always)]
    unsafe fn decode_chunk_raw(&self, encoded: *const u8, out: *mut u8) -> (u64, u64) {
        // SAFETY: the caller guarantees the features, 64 readable bytes at
        // `encoded` and 64 writable at `out` (trait contract).
        unsafe {
            let x = _mm512_loadu_si512(encoded.cast());
            // Group g (bytes 7g..7g+7) into qword g, then byte j of each qword
            // takes the 8 bits starting at bit 7j: codeword j and one spare bit.
            let grouped = _mm512_permutexvar_epi8(self.group, x);
            let fields = _mm512_multishift_epi64_epi8(self.offsets, grouped);
            let codewords = _mm512_and_si512(fields, _mm512_set1_epi8(0x7F));
            correct64(codewords, self.affine, self.action, out)
        }
    }
}

/// Hamming(7,4) batch decode with AVX-512 + GFNI.
///
/// # Safety
/// As [`secded_decode_avx512`].
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi,gfni,popcnt")]
pub(crate) unsafe fn hamming_decode_avx512(
    t: &HammingTables,
    encoded: &[u8],
    values: &mut [u8],
    truth: Option<&[u8]>,
    erasures: &mut [u64],
) -> DecodeStats {
    let group: [u8; 64] = std::array::from_fn(|i| (7 * (i / 8) + (i % 8).min(6)) as u8);
    let offsets: [u8; 64] = std::array::from_fn(|i| (7 * (i % 8)) as u8);
    // SAFETY: both arrays are 64 readable bytes.
    let (group, offsets) = unsafe {
        (
            _mm512_loadu_si512(group.as_ptr().cast()),
            _mm512_loadu_si512(offsets.as_ptr().cast()),
        )
    };
    let kernel = HammingAvx512 {
        group,
        offsets,
        affine: _mm512_set1_epi64(t.syndrome_affine as i64),
        action: table16(&t.action),
    };
    drive_chunks(&kernel, encoded, values, truth, erasures)
}

/// Golay batch decode with AVX-512 + GFNI, 64 codewords per block: syndromes
/// for all, the leader table only for the words whose syndrome is non-zero.
/// `INTERLEAVED` reads `golay24x8`'s layout: each 192-byte block is eight
/// interleaving blocks, whose 8-byte planes are transposed back in registers
/// (byte reversal and one `vgf2p8affineqb`, as `interleaved` does) before
/// the byte planes are gathered from where the transpose leaves them.
///
/// # Safety
/// As [`secded_decode_avx512`]; with `INTERLEAVED`, `values.len()` must be
/// a multiple of 192 (the plain layout's tail is decoded as such).
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi,gfni,popcnt")]
pub(crate) unsafe fn golay_decode_avx512<const INTERLEAVED: bool>(
    t: &GolayTables,
    encoded: &[u8],
    values: &mut [u8],
    erasures: &mut [u64],
) -> DecodeStats {
    const BLOCK_VALUES: usize = 192; // 64 codewords, 192 bytes, 3 erasure words
    let blocks = values.len() / BLOCK_VALUES;
    debug_assert!(!INTERLEAVED || values.len().is_multiple_of(BLOCK_VALUES));
    // SAFETY: every array is 64 readable bytes.
    let load = |a: &[u8; 64]| unsafe { _mm512_loadu_si512(a.as_ptr().cast()) };

    // Byte-plane r of the block: byte i is input byte 3i + r. `vpermi2b` covers
    // input bytes 0..128 with the low 7 index bits; lanes reading 128..192 are
    // then replaced from the third vector by `vpermb` (low 6 bits: 3i + r − 128).
    // Interleaved: after the transposes, byte r of codeword i = 8B + k sits
    // at 24B + 8r + k.
    let source = |i: usize, r: usize| match INTERLEAVED {
        false => 3 * i + r,
        true => 24 * (i / 8) + 8 * r + i % 8,
    };
    let plane_idx: [[u8; 64]; 3] =
        std::array::from_fn(|r| std::array::from_fn(|i| source(i, r) as u8));
    let plane_hi: [u64; 3] =
        std::array::from_fn(|r| (0..64).fold(0u64, |m, i| m | u64::from(source(i, r) >= 128) << i));
    let reverse: [u8; 64] = std::array::from_fn(|k| (k / 8 * 8 + 7 - k % 8) as u8);
    let reverse = load(&reverse);
    let units = _mm512_set1_epi64(0x8040_2010_0804_0201_u64 as i64);
    let transpose = |z: __m512i| match INTERLEAVED {
        false => z,
        true => _mm512_gf2p8affine_epi64_epi8::<0>(units, _mm512_permutexvar_epi8(reverse, z)),
    };
    // Output vector k, byte b: value 64k + b = codeword c, role ρ. Roles 0 and 1
    // come from planes V0/V1 by `vpermi2b` (bit 6 picks V1), role 2 from V2.
    let out_idx: [[u8; 64]; 3] = std::array::from_fn(|k| {
        std::array::from_fn(|b| {
            let v = 64 * k + b;
            ((v / 3) | if v % 3 == 1 { 64 } else { 0 }) as u8
        })
    });
    let out_role2: [u64; 3] = std::array::from_fn(|k| {
        (0..64).fold(0u64, |m, b| m | u64::from((64 * k + b) % 3 == 2) << b)
    });
    let plane_idx = plane_idx.each_ref().map(load);
    let out_idx = out_idx.each_ref().map(load);
    let affine = t
        .syndrome_affine
        .map(|halves| halves.map(|m| _mm512_set1_epi64(m as i64)));
    let nib = _mm512_set1_epi8(0x0F);

    let mut stats = DecodeStats::default();
    for b in 0..blocks {
        let enc = &encoded[BLOCK_VALUES * b..BLOCK_VALUES * (b + 1)];
        let out = &mut values[BLOCK_VALUES * b..BLOCK_VALUES * (b + 1)];
        let er = &mut erasures[3 * b..3 * b + 3];
        er.fill(0);
        // SAFETY: `enc` and `out` are 192 bytes: three 64-byte vectors each.
        let (z0, z1, z2) = unsafe {
            let p = enc.as_ptr();
            (
                _mm512_loadu_si512(p.cast()),
                _mm512_loadu_si512(p.add(64).cast()),
                _mm512_loadu_si512(p.add(128).cast()),
            )
        };
        let (z0, z1, z2) = (transpose(z0), transpose(z1), transpose(z2));
        let planes: [__m512i; 3] = std::array::from_fn(|r| {
            let low = _mm512_permutex2var_epi8(z0, plane_idx[r], z1);
            _mm512_mask_permutexvar_epi8(low, plane_hi[r], plane_idx[r], z2)
        });
        let half = |h: usize| {
            let a = _mm512_gf2p8affine_epi64_epi8::<0>(planes[0], affine[0][h]);
            let b = _mm512_gf2p8affine_epi64_epi8::<0>(planes[1], affine[1][h]);
            let c = _mm512_gf2p8affine_epi64_epi8::<0>(planes[2], affine[2][h]);
            _mm512_ternarylogic_epi64::<0x96>(a, b, c) // a ^ b ^ c
        };
        let (s_lo, s_hi) = (half(0), half(1));
        let v0 = _mm512_and_si512(planes[0], nib);
        let v1 = _mm512_and_si512(_mm512_srli_epi16::<4>(planes[0]), nib);
        let v2 = _mm512_and_si512(planes[1], nib);
        for k in 0..3 {
            let o = _mm512_permutex2var_epi8(v0, out_idx[k], v1);
            let o = _mm512_mask_permutexvar_epi8(o, out_role2[k], out_idx[k], v2);
            // SAFETY: out[64k..64k + 64] is in bounds of the 192-byte block.
            unsafe { _mm512_storeu_si512(out.as_mut_ptr().add(64 * k).cast(), o) };
        }
        let any = _mm512_or_si512(s_lo, s_hi);
        let nonzero = _mm512_test_epi8_mask(any, any);
        stats.words += 64;
        if nonzero != 0 {
            let (mut lo, mut hi) = ([0u8; 64], [0u8; 64]);
            // SAFETY: both arrays are 64 writable bytes.
            unsafe {
                _mm512_storeu_si512(lo.as_mut_ptr().cast(), s_lo);
                _mm512_storeu_si512(hi.as_mut_ptr().cast(), s_hi);
            }
            let mut rest = nonzero;
            while rest != 0 {
                let i = rest.trailing_zeros() as usize;
                rest &= rest - 1;
                let syndrome = usize::from(lo[i]) | usize::from(hi[i]) << 8;
                golay24::correct_word(t, syndrome, i, out, er, &mut stats);
            }
        }
    }
    golay24::finish_blocks(t, blocks, stats, encoded, values, erasures)
}

/// SECDED encode with AVX-512: one byte shuffle per 64 values.
///
/// # Safety
/// As [`secded_decode_avx512`]; `values` must hold nibbles and
/// `encoded.len() == values.len()`.
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi,gfni,popcnt")]
pub(crate) unsafe fn secded_encode_avx512(t: &SecdedTables, values: &[u8], encoded: &mut [u8]) {
    let table = table16(&t.encode);
    let full = values.len() / 64;
    for c in 0..full {
        // SAFETY: c < full, so bytes 64c..64c + 64 exist in both slices.
        unsafe {
            let v = _mm512_loadu_si512(values.as_ptr().add(64 * c).cast());
            let e = _mm512_shuffle_epi8(table, v);
            _mm512_storeu_si512(encoded.as_mut_ptr().add(64 * c).cast(), e);
        }
    }
    for (e, &v) in encoded[64 * full..].iter_mut().zip(&values[64 * full..]) {
        *e = t.encode[usize::from(v)];
    }
}
