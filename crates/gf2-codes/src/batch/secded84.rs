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

use super::nibble::{NibbleDecoders, outcome_of, run_decode};
use super::{Backend, ChunkKernel, Int4Codec, check_nibbles, split_entries};
use crate::code::LinearCode;
use crate::error::{Result, check_len};
use crate::stats::DecodeStats;

/// The SECDED(8,4) batch codec (8 bits per value).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Secded84;

/// Tables derived from the paper's matrices.
pub(crate) type Tables = super::nibble::NibbleTables;

pub(crate) fn code() -> &'static LinearCode {
    static CODE: OnceLock<LinearCode> = OnceLock::new();
    CODE.get_or_init(crate::standard::secded84)
}

pub(crate) fn tables() -> &'static Tables {
    static TABLES: OnceLock<Tables> = OnceLock::new();
    TABLES.get_or_init(|| Tables::build(code()))
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
        let t = tables();
        let decoders = NibbleDecoders {
            tables: t,
            scalar: ScalarKernel(t),
            #[cfg(target_arch = "x86_64")]
            simd: [
                super::avx2::secded_decode_avx2,
                super::avx512::secded_decode_avx512,
            ],
        };
        run_decode(&self, decoders, backend, encoded, truth, values, erasures)
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
        #[cfg(target_arch = "x86_64")]
        if Backend::Avx2.is_supported() {
            // SAFETY: features checked just above; lengths and nibbles checked before.
            unsafe { super::avx2::secded_encode_avx2(t, values, encoded) };
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
        // Each SIMD encoder the CPU has, on lengths around its vector width.
        #[cfg(target_arch = "x86_64")]
        for len in [0, 1, 31, 32, 33, 63, 64, 65, 1000] {
            let values = &values[..len];
            let mut simd = vec![0u8; len];
            if Backend::Avx2.is_supported() {
                // SAFETY: AVX2 checked; equal lengths; the values are nibbles.
                unsafe { crate::batch::avx2::secded_encode_avx2(tables(), values, &mut simd) };
                assert_eq!(simd, scalar[..len], "AVX2, {len} values");
            }
            if Backend::Avx512.is_supported() {
                // SAFETY: AVX-512 checked; equal lengths; the values are nibbles.
                unsafe { crate::batch::avx512::secded_encode_avx512(tables(), values, &mut simd) };
                assert_eq!(simd, scalar[..len], "AVX-512, {len} values");
            }
        }
    }
}
