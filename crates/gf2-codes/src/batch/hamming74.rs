//! Hamming(7,4) packed at 7 bits per value: 8 codewords in 7 bytes.
//!
//! The codewords of values `8g..8g+8` are concatenated LSB first into the
//! 56-bit little-endian word of bytes `7g..7g+7` (codeword j in bits 7j..7j+7,
//! each codeword as in eq. 17: bits 0-3 the value, bits 4-6 the parity). A last
//! group of m < 8 values takes `⌈7m/8⌉` bytes; its unused high bits are written
//! as zero and ignored by the decoder. The code is perfect: every non-zero
//! syndrome is "corrected", so double errors are miscorrected (section 5.1.4)
//! and nothing is ever flagged as erased.

use std::sync::OnceLock;

use super::nibble::{NibbleDecoders, outcome_of, run_decode};
use super::{Backend, ChunkKernel, Int4Codec, check_nibbles, split_entries};
use crate::code::LinearCode;
use crate::error::{Result, check_len};
use crate::stats::DecodeStats;

/// The Hamming(7,4) batch codec (7 bits per value).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Hamming74;

/// Tables derived from the paper's matrices.
pub(crate) type Tables = super::nibble::NibbleTables;

pub(crate) fn code() -> &'static LinearCode {
    static CODE: OnceLock<LinearCode> = OnceLock::new();
    CODE.get_or_init(crate::standard::hamming74)
}

pub(crate) fn tables() -> &'static Tables {
    static TABLES: OnceLock<Tables> = OnceLock::new();
    TABLES.get_or_init(|| Tables::build(code()))
}

/// Reads group `g`'s 56-bit word from up to 7 bytes (fewer at the end).
#[inline(always)]
fn load_group(bytes: &[u8]) -> u64 {
    let mut w = [0u8; 8];
    let n = bytes.len().min(7);
    w[..n].copy_from_slice(&bytes[..n]);
    u64::from_le_bytes(w)
}

struct ScalarKernel<'a>(&'a Tables);

impl ChunkKernel for ScalarKernel<'_> {
    const CHUNK_BYTES: usize = 56;

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
        for (g, o) in out.chunks_exact_mut(8).enumerate() {
            let word = load_group(&encoded[7 * g..7 * g + 7]);
            let entries = (0..8).fold(0u64, |w, j| {
                w | u64::from(self.0.decode[(word >> (7 * j) & 0x7F) as usize]) << (8 * j)
            });
            let (values, d, c) = split_entries(entries);
            o.copy_from_slice(&values.to_le_bytes());
            det |= d << (8 * g);
            corr |= c << (8 * g);
        }
        (det, corr)
    }
}

impl Hamming74 {
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
                super::avx2::hamming_decode_avx2,
                super::avx512::hamming_decode_avx512,
            ],
        };
        run_decode(&self, decoders, backend, encoded, truth, values, erasures)
    }
}

impl Int4Codec for Hamming74 {
    fn name(&self) -> &'static str {
        "hamming74"
    }

    fn values_per_codeword(&self) -> usize {
        1
    }

    fn bits_per_value(&self) -> u32 {
        7
    }

    fn encoded_len(&self, values: usize) -> usize {
        (7 * values).div_ceil(8)
    }

    fn encode_into(&self, values: &[u8], encoded: &mut [u8]) -> Result<()> {
        check_len("encoded", self.encoded_len(values.len()), encoded.len())?;
        check_nibbles(values)?;
        let t = tables();
        for (group, out) in values.chunks(8).zip(encoded.chunks_mut(7)) {
            let word = group.iter().enumerate().fold(0u64, |w, (j, &v)| {
                w | u64::from(t.encode[usize::from(v & 0xF)]) << (7 * j)
            });
            out.copy_from_slice(&word.to_le_bytes()[..out.len()]);
        }
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
        for (g, out) in encoded.chunks_mut(7).enumerate() {
            let in_group = (values - 8 * g).min(8);
            let word = load_group(out);
            let mut fixed = word;
            for j in 0..in_group {
                let cw = (word >> (7 * j) & 0x7F) as usize;
                stats.record(outcome_of(t.decode[cw]));
                fixed ^= u64::from(t.scrub[cw] ^ cw as u8) << (7 * j);
            }
            let n = out.len();
            out.copy_from_slice(&fixed.to_le_bytes()[..n]);
        }
        Ok(stats)
    }
}
