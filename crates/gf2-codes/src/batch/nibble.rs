//! Decode tables shared by the one-value-per-codeword codes (Hamming(7,4) and
//! SECDED(8,4)), derived from a [`LinearCode`] with n ≤ 8 and k = 4.

use super::{
    Backend, ChunkKernel, Int4Codec, affine_matrix, check_decode_shapes, drive_chunks,
    syndrome_rows,
};
use crate::code::LinearCode;
use crate::error::Result;
use crate::stats::{DecodeOutcome, DecodeStats};

/// A SIMD decoder of a nibble code: `(tables, encoded, values, truth, erasures)`.
#[cfg(target_arch = "x86_64")]
pub(crate) type SimdDecode =
    unsafe fn(&NibbleTables, &[u8], &mut [u8], Option<&[u8]>, &mut [u64]) -> DecodeStats;

/// The implementations of one nibble code, one per backend.
pub(crate) struct NibbleDecoders<'a, K> {
    /// The code's tables.
    pub(crate) tables: &'a NibbleTables,
    /// The portable kernel.
    pub(crate) scalar: K,
    /// AVX2 and AVX-512 decoders.
    #[cfg(target_arch = "x86_64")]
    pub(crate) simd: [SimdDecode; 2],
}

/// Checks shapes and the backend, then runs the chosen decoder.
pub(crate) fn run_decode<K: ChunkKernel>(
    codec: &dyn Int4Codec,
    decoders: NibbleDecoders<'_, K>,
    backend: Backend,
    encoded: &[u8],
    truth: Option<&[u8]>,
    values: &mut [u8],
    erasures: &mut [u64],
) -> Result<DecodeStats> {
    check_decode_shapes(
        codec,
        encoded.len(),
        values.len(),
        erasures.len(),
        truth.map(<[u8]>::len),
    )?;
    backend.ensure_supported()?;
    Ok(match backend {
        Backend::Scalar => drive_chunks(&decoders.scalar, encoded, values, truth, erasures),
        #[cfg(target_arch = "x86_64")]
        Backend::Avx2 | Backend::Avx512 => {
            let simd = decoders.simd[usize::from(backend == Backend::Avx512)];
            // SAFETY: `ensure_supported` checked this CPU's features for the backend.
            unsafe { simd(decoders.tables, encoded, values, truth, erasures) }
        }
        #[cfg(not(target_arch = "x86_64"))]
        Backend::Avx2 | Backend::Avx512 => {
            unreachable!("ensure_supported rejects x86 backends elsewhere")
        }
    })
}

/// Flag bit of a decode-table entry: the word was corrected.
pub(crate) const FLAG_CORRECTED: u8 = 0x40;
/// Flag bit of a decode-table entry: the word is detected-uncorrectable.
pub(crate) const FLAG_DETECTED: u8 = 0x80;
/// The outcome encoded in the flag bits of a table entry.
#[inline]
pub(crate) fn outcome_of(entry: u8) -> DecodeOutcome {
    if entry & FLAG_DETECTED != 0 {
        DecodeOutcome::Detected
    } else if entry & FLAG_CORRECTED != 0 {
        DecodeOutcome::Corrected
    } else {
        DecodeOutcome::Clean
    }
}

/// Lookup tables of a code whose codewords fit one byte and whose data word is
/// the low nibble.
pub(crate) struct NibbleTables {
    /// Codeword of each value.
    pub(crate) encode: [u8; 16],
    /// Per received word (`0..2^n`): decoded value | FLAG_* bits.
    pub(crate) decode: [u8; 256],
    /// Per received word: the corrected codeword (the word itself unless corrected).
    pub(crate) scrub: [u8; 256],
    /// Per syndrome: data correction (bits 0-3) | FLAG_* bits.
    pub(crate) action: [u8; 16],
    /// The check bits (high nibble, in place) of each value's codeword. The
    /// code is systematic, so `received ^ check_hi[received & 0xF]` holds in
    /// its high nibble `c ⊕ c(d)`, the difference between the check bits read
    /// and those of the data read: zero exactly for a codeword, and a
    /// syndrome in the basis of the check bits. Syndromes are linear, so a
    /// byte's is the XOR of its nibbles' contributions `lo(d) ⊕ hi(c)`, and
    /// `lo(d) = hi(c(d))` (a codeword's syndrome is zero): the syndrome
    /// proper is `hi(c ⊕ c(d))`.
    pub(crate) check_hi: [u8; 16],
    /// `action` indexed by that check-bit difference: `action[hi(s)]`, with
    /// `hi` the high nibble's syndrome contribution.
    pub(crate) action_by_check: [u8; 16],
    /// The `vgf2p8affineqb` matrix of the byte → syndrome map (bits ≥ n ignored).
    pub(crate) syndrome_affine: u64,
}

impl NibbleTables {
    /// Builds every table from the generic decoder, so fast paths and
    /// `LinearCode::decode_word` agree by construction.
    pub(crate) fn build(code: &LinearCode) -> Self {
        let n = code.n();
        assert!(
            n <= 8 && code.k() == 4 && n - 4 <= 4,
            "a nibble code in one byte"
        );
        let mut t = NibbleTables {
            encode: [0; 16],
            decode: [0; 256],
            scrub: [0; 256],
            action: [0; 16],
            check_hi: [0; 16],
            action_by_check: [0; 16],
            syndrome_affine: 0,
        };
        for v in 0..16u64 {
            t.encode[v as usize] = code.encode(v).expect("4 data bits") as u8;
        }
        for r in 0..1u64 << n {
            let d = code.decode_word(r).expect("an n-bit word");
            let flag = match d.outcome {
                DecodeOutcome::Clean => 0,
                DecodeOutcome::Corrected => FLAG_CORRECTED,
                DecodeOutcome::Detected => FLAG_DETECTED,
            };
            t.decode[r as usize] = d.data as u8 | flag;
            t.scrub[r as usize] = d.codeword as u8;
            t.action[d.syndrome as usize] = (d.error_pattern & 0xF) as u8 | flag;
        }
        let bit_syndrome = |j: usize| {
            if j < n {
                code.syndrome(1 << j).expect("bit < n")
            } else {
                0
            }
        };
        // The high nibble's syndrome contribution.
        let syndrome_hi = |nib: usize| {
            (0..4)
                .filter(|b| nib >> b & 1 == 1)
                .fold(0, |s, b| s ^ bit_syndrome(b + 4))
        };
        for nib in 0..16usize {
            let codeword = t.encode[nib];
            assert_eq!(
                usize::from(codeword & 0xF),
                nib,
                "systematic: data in the low nibble"
            );
            t.check_hi[nib] = codeword & 0xF0;
            t.action_by_check[nib] = t.action[syndrome_hi(nib) as usize];
        }
        t.syndrome_affine = affine_matrix(syndrome_rows(bit_syndrome, 0));
        t
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every received byte of both codes, decoded through the check-bit
    /// difference and its action table, equals the full decode table.
    #[test]
    fn the_check_bit_difference_decodes_every_byte_as_the_decode_table() {
        for code in [crate::standard::hamming74(), crate::standard::secded84()] {
            let t = NibbleTables::build(&code);
            for r in 0..1usize << code.n() {
                let data = r & 0xF;
                let difference = (r ^ usize::from(t.check_hi[data])) >> 4;
                let act = t.action_by_check[difference];
                let expect = t.decode[r];
                assert_eq!(
                    data as u8 ^ (act & 0xF),
                    expect & 0xF,
                    "n={} r={r:#x}",
                    code.n()
                );
                assert_eq!(act & 0xC0, expect & 0xC0, "flags, n={} r={r:#x}", code.n());
                assert_eq!(
                    difference == 0,
                    t.decode[r] & 0xC0 == 0 && t.scrub[r] as usize == r
                );
            }
        }
    }
}
