//! Extended Hamming(8,4) SECDED at one byte per value.
//!
//! Byte layout: bits 0-3 the value (data bits d₀..d₃), bits 4-6 the Hamming
//! parity p₀..p₂ of eqs. (18)-(20), bit 7 the overall parity (eq. 22's last
//! column). Decoding follows the paper's table (section 5.2.2): the syndrome
//! under H̄ (eq. 23) is the local syndrome z (bits 0-2) and the overall parity
//! p (bit 3); `z = 0, p = 0` clean; `p = 1` a single error, corrected (for
//! `z = 0` it hit the parity bit and the data was valid); `z ≠ 0, p = 0` a
//! double error, flagged as an erasure.

use std::sync::OnceLock;

use super::{
    Backend, ChunkKernel, Int4Codec, check_decode_shapes, check_nibbles, drive_chunks,
    split_entries,
};
use crate::code::LinearCode;
use crate::error::{Result, check_len};
use crate::stats::{DecodeOutcome, DecodeStats};

/// Flag bit of a decode-table entry: the word was corrected.
pub(crate) const FLAG_CORRECTED: u8 = 0x40;
/// Flag bit of a decode-table entry: the word is detected-uncorrectable.
pub(crate) const FLAG_DETECTED: u8 = 0x80;

/// The SECDED(8,4) batch codec (8 bits per value).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Secded84;

/// Tables derived from the paper's matrices.
pub(crate) struct Tables {
    /// Codeword of each value.
    pub(crate) encode: [u8; 16],
    /// Per received byte: decoded value | FLAG_* bits.
    pub(crate) decode: [u8; 256],
    /// Per received byte: the corrected codeword (the byte itself unless corrected).
    pub(crate) scrub: [u8; 256],
    /// Syndrome contribution of the low and high nibble of a received byte.
    pub(crate) syndrome_lo: [u8; 16],
    pub(crate) syndrome_hi: [u8; 16],
    /// Per syndrome: data correction (bits 0-3) | FLAG_* bits.
    pub(crate) action: [u8; 16],
    /// The `vgf2p8affineqb` matrix of the byte → syndrome map.
    pub(crate) syndrome_affine: u64,
}

pub(crate) fn code() -> &'static LinearCode {
    static CODE: OnceLock<LinearCode> = OnceLock::new();
    CODE.get_or_init(crate::standard::secded84)
}

pub(crate) fn tables() -> &'static Tables {
    static TABLES: OnceLock<Tables> = OnceLock::new();
    TABLES.get_or_init(|| {
        let code = code();
        let mut t = Tables {
            encode: [0; 16],
            decode: [0; 256],
            scrub: [0; 256],
            syndrome_lo: [0; 16],
            syndrome_hi: [0; 16],
            action: [0; 16],
            syndrome_affine: 0,
        };
        for v in 0..16u64 {
            t.encode[v as usize] = code.encode(v).expect("4 data bits") as u8;
        }
        for r in 0..256u64 {
            let d = code.decode_word(r).expect("8-bit word");
            let flag = match d.outcome {
                DecodeOutcome::Clean => 0,
                DecodeOutcome::Corrected => FLAG_CORRECTED,
                DecodeOutcome::Detected => FLAG_DETECTED,
            };
            t.decode[r as usize] = d.data as u8 | flag;
            t.scrub[r as usize] = d.codeword as u8;
            // Syndromes are linear: each byte's is the XOR of its nibbles'.
            let s = d.syndrome as usize;
            t.action[s] = ((d.error_pattern & 0xF) as u8) | flag;
        }
        for nib in 0..16u64 {
            t.syndrome_lo[nib as usize] = code.syndrome(nib).expect("8-bit word") as u8;
            t.syndrome_hi[nib as usize] = code.syndrome(nib << 4).expect("8-bit word") as u8;
        }
        let n = code.n();
        t.syndrome_affine = super::affine_matrix(super::syndrome_rows(
            |j| {
                if j < n {
                    code.syndrome(1 << j).expect("bit < n")
                } else {
                    0
                }
            },
            0,
        ));
        t
    })
}

struct ScalarKernel<'a>(&'a Tables);

impl ChunkKernel for ScalarKernel<'_> {
    const CHUNK_BYTES: usize = 64;

    #[inline(always)]
    unsafe fn decode_chunk_raw(&self, encoded: *const u8, out: *mut u8) -> (u64, u64) {
        // SAFETY: the caller guarantees 64 readable bytes at `encoded` and 64
        // writable at `out` (trait contract); the two do not overlap.
        let (encoded, out) = unsafe {
            (
                std::slice::from_raw_parts(encoded, 64),
                std::slice::from_raw_parts_mut(out, 64),
            )
        };
        let (mut det, mut corr) = (0u64, 0u64);
        for (g, (o, e)) in out
            .chunks_exact_mut(8)
            .zip(encoded.chunks_exact(8))
            .enumerate()
        {
            let entries = e.iter().enumerate().fold(0u64, |w, (j, &b)| {
                w | u64::from(self.0.decode[usize::from(b)]) << (8 * j)
            });
            let (values, d, c) = split_entries(entries);
            o.copy_from_slice(&values.to_le_bytes());
            det |= d << (8 * g);
            corr |= c << (8 * g);
        }
        (det, corr)
    }
}

impl Secded84 {
    fn run(
        self,
        backend: Backend,
        encoded: &[u8],
        truth: Option<&[u8]>,
        values: &mut [u8],
        erasures: &mut [u64],
    ) -> Result<DecodeStats> {
        check_decode_shapes(
            &self,
            encoded.len(),
            values.len(),
            erasures.len(),
            truth.map(<[u8]>::len),
        )?;
        backend.ensure_supported()?;
        let t = tables();
        Ok(match backend {
            Backend::Scalar => drive_chunks(&ScalarKernel(t), encoded, values, truth, erasures),
            #[cfg(target_arch = "x86_64")]
            Backend::Avx2 => {
                // SAFETY: `ensure_supported` checked that this CPU has AVX2.
                unsafe { super::avx2::secded_decode_avx2(t, encoded, values, truth, erasures) }
            }
            #[cfg(target_arch = "x86_64")]
            Backend::Avx512 => {
                // SAFETY: `ensure_supported` checked the CPU features.
                unsafe { super::avx512::secded_decode_avx512(t, encoded, values, truth, erasures) }
            }
            #[cfg(not(target_arch = "x86_64"))]
            Backend::Avx2 | Backend::Avx512 => {
                unreachable!("ensure_supported rejects x86 backends elsewhere")
            }
        })
    }
}

impl Int4Codec for Secded84 {
    fn name(&self) -> &'static str {
        "secded84"
    }

    fn values_per_codeword(&self) -> usize {
        1
    }

    fn bits_per_value(&self) -> u32 {
        8
    }

    fn encoded_len(&self, values: usize) -> usize {
        values
    }

    fn encode_into(&self, values: &[u8], encoded: &mut [u8]) -> Result<()> {
        check_len("encoded", values.len(), encoded.len())?;
        check_nibbles(values)?;
        let t = tables();
        #[cfg(target_arch = "x86_64")]
        if Backend::Avx512.is_supported() {
            // SAFETY: features checked just above; lengths and nibbles checked before.
            unsafe { super::avx512::secded_encode_avx512(t, values, encoded) };
            return Ok(());
        }
        encode_scalar(t, values, encoded);
        Ok(())
    }

    fn decode_into_with(
        &self,
        backend: Backend,
        encoded: &[u8],
        values: &mut [u8],
        erasures: &mut [u64],
    ) -> Result<DecodeStats> {
        self.run(backend, encoded, None, values, erasures)
    }

    fn decode_with_truth_into_with(
        &self,
        backend: Backend,
        encoded: &[u8],
        truth: &[u8],
        values: &mut [u8],
        erasures: &mut [u64],
    ) -> Result<DecodeStats> {
        self.run(backend, encoded, Some(truth), values, erasures)
    }

    fn scrub(&self, encoded: &mut [u8], values: usize) -> Result<DecodeStats> {
        check_len("encoded", self.encoded_len(values), encoded.len())?;
        let t = tables();
        let mut stats = DecodeStats::default();
        for b in encoded.iter_mut() {
            let e = t.decode[*b as usize];
            stats.record(outcome_of(e));
            *b = t.scrub[*b as usize];
        }
        Ok(stats)
    }
}

fn encode_scalar(t: &Tables, values: &[u8], encoded: &mut [u8]) {
    for (e, &v) in encoded.iter_mut().zip(values) {
        *e = t.encode[usize::from(v & 0xF)];
    }
}

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn simd_and_scalar_encoders_agree_with_the_code() {
        let values: Vec<u8> = (0..1000u32).map(|i| (i * 7 % 16) as u8).collect();
        let mut scalar = vec![0u8; values.len()];
        encode_scalar(tables(), &values, &mut scalar);
        assert_eq!(Secded84.encode(&values).unwrap(), scalar);
        for (&v, &e) in values.iter().zip(&scalar) {
            assert_eq!(u64::from(e), code().encode(u64::from(v)).unwrap());
        }
    }
}
