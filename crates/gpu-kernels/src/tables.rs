//! Decode tables the kernels read, built on the host from gf2-codes'
//! [`LinearCode`](gf2_codes::LinearCode)s and kv-quant's [`MetaCode`], so the
//! device decoders and the CPU decoders come from the same matrices and
//! cannot drift apart. Every table is checked against the CPU batch codecs
//! on every received word (tests below).

use gf2_codes::{DecodeOutcome, Int4Code};
use kv_quant::MetaCode;

/// Flag bit of a nibble-table entry: the word was corrected.
pub const NIBBLE_CORRECTED: u8 = 1 << 6;
/// Flag bit of a nibble-table entry: the word was detected as uncorrectable.
pub const NIBBLE_DETECTED: u8 = 1 << 7;
/// Flag bit of a Golay leader entry: the syndrome has a unique leader (corrected).
pub const GOLAY_CORRECTED: u32 = 1 << 24;
/// Flag bit of a Golay leader entry: the syndrome is detected-uncorrectable.
pub const GOLAY_DETECTED: u32 = 1 << 25;

/// Decode table of a one-value-per-codeword code (Hamming(7,4): 128
/// entries, SECDED(8,4): 256): entry `w` is the decoded value in bits 0-3
/// (the received data bits for detected words), [`NIBBLE_CORRECTED`] and
/// [`NIBBLE_DETECTED`].
pub fn nibble_table(code: Int4Code) -> Vec<u8> {
    let lc = code.linear_code();
    (0..1u64 << lc.n())
        .map(|w| {
            let d = lc.decode_word(w).expect("word fits the code");
            let value = match d.outcome {
                DecodeOutcome::Detected => (w & 15) as u8,
                _ => d.data as u8,
            };
            value
                | match d.outcome {
                    DecodeOutcome::Clean => 0,
                    DecodeOutcome::Corrected => NIBBLE_CORRECTED,
                    DecodeOutcome::Detected => NIBBLE_DETECTED,
                }
        })
        .collect()
}

/// The Golay(24,12) tables: the parity `d·B` of each 12-bit data word (the
/// encoder's table, and the data part of the syndrome on decode), and per
/// syndrome the 24-bit error pattern to remove with [`GOLAY_CORRECTED`] or
/// [`GOLAY_DETECTED`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GolayTables {
    /// 4096 parities.
    pub parity: Vec<u16>,
    /// 4096 leader entries.
    pub leader: Vec<u32>,
}

impl GolayTables {
    /// Builds both tables from the paper's generator (via gf2-codes).
    pub fn build() -> Self {
        let code = Int4Code::Golay24.linear_code();
        let parity = (0..4096u64)
            .map(|d| (code.encode(d).expect("12 data bits") >> 12) as u16)
            .collect();
        let leader = (0..4096u64)
            .map(|s| {
                // H₂₄ = [Bᵀ | I]: data 0 with parity s has syndrome s.
                let d = code.decode_word(s << 12).expect("24-bit word");
                match d.outcome {
                    DecodeOutcome::Clean => 0,
                    DecodeOutcome::Corrected => d.error_pattern as u32 | GOLAY_CORRECTED,
                    DecodeOutcome::Detected => GOLAY_DETECTED,
                }
            })
            .collect();
        Self { parity, leader }
    }
}

/// The metadata SECDED code of one word width as the kernels read it:
/// `columns[i]` is the check byte of data bit `i` alone, so a word's check
/// byte is the XOR of the columns of its set bits.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MetaColumns {
    /// Data bits (16 or 32).
    pub width: u32,
    /// Check bits used (6 or 7).
    pub check_bits: u32,
    /// One column per data bit, padded with zeros to 32.
    pub columns: [u8; 32],
}

impl MetaColumns {
    /// The columns of kv-quant's SECDED metadata code for f16 words, or for
    /// f32 words when `wide` (the only metadata code the kernels decode).
    pub fn secded(wide: bool) -> Self {
        let code = if wide {
            MetaCode::f32()
        } else {
            MetaCode::f16()
        };
        let mut columns = [0u8; 32];
        for (i, c) in columns
            .iter_mut()
            .enumerate()
            .take(code.data_bits() as usize)
        {
            // SECDED check words fit a byte (6 or 7 bits).
            *c = code.check(1 << i) as u8;
        }
        Self {
            width: code.data_bits(),
            check_bits: code.check_bits(),
            columns,
        }
    }

    /// The decode the kernels perform (`rkv_meta_decode` in `common.cuh`),
    /// written out on the host: the reference that ties the device
    /// algorithm to [`MetaCode::decode`] (tested on every pattern of up to
    /// three flips).
    pub fn decode(&self, data: u32, check: u8) -> (u32, DecodeOutcome) {
        let mask = ((1u32 << self.check_bits) - 1) as u8;
        let recomputed = (0..self.width)
            .filter(|i| data >> i & 1 == 1)
            .fold(0u8, |acc, i| acc ^ self.columns[i as usize]);
        let syndrome = (check ^ recomputed) & mask;
        if syndrome == 0 {
            return (data, DecodeOutcome::Clean);
        }
        if let Some(i) = (0..self.width).find(|&i| self.columns[i as usize] == syndrome) {
            return (data ^ 1 << i, DecodeOutcome::Corrected);
        }
        if syndrome.is_power_of_two() {
            (data, DecodeOutcome::Corrected)
        } else {
            (data, DecodeOutcome::Detected)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every received byte (SECDED) or 7-bit word (Hamming): the table entry
    /// equals what the CPU batch codec decodes.
    #[test]
    fn nibble_tables_match_the_cpu_codecs_on_every_word() {
        for code in [Int4Code::Secded84, Int4Code::Hamming74] {
            let table = nibble_table(code);
            let n = code.linear_code().n();
            assert_eq!(table.len(), 1 << n);
            for (w, &entry) in table.iter().enumerate() {
                // One codeword alone: SECDED's byte is the word; for Hamming a
                // single value's codeword sits in bits 0..7 of one byte.
                let decoded = code.codec().decode(&[w as u8], 1).unwrap();
                assert_eq!(entry & 15, decoded.values[0], "{code} word {w:#x}");
                assert_eq!(
                    entry & NIBBLE_DETECTED != 0,
                    decoded.is_erased(0),
                    "{code} word {w:#x}"
                );
                assert_eq!(
                    u64::from(entry & NIBBLE_CORRECTED != 0),
                    decoded.stats.corrected,
                    "{code} word {w:#x}"
                );
            }
        }
    }

    /// Every one of the 2^24 received Golay words: syndrome lookup through
    /// the tables equals the CPU codec (values, erasure, correction). One of
    /// the slow tests (about a second in release): 16.7 M words, decoded by
    /// the CPU codec in batches of 65,536 without allocating per word.
    #[test]
    fn golay_tables_match_the_cpu_codec_on_every_word() {
        let t = GolayTables::build();
        let codec = Int4Code::Golay24.codec();
        const BATCH: u32 = 1 << 16;
        let mut bytes = vec![0u8; 3 * BATCH as usize];
        let mut values = vec![0u8; 3 * BATCH as usize];
        let mut erasures = vec![0u64; (3 * BATCH as usize).div_ceil(64)];
        for first in (0..1u32 << 24).step_by(BATCH as usize) {
            for (i, b) in bytes.chunks_exact_mut(3).enumerate() {
                b.copy_from_slice(&(first + i as u32).to_le_bytes()[..3]);
            }
            codec
                .decode_into(&bytes, &mut values, &mut erasures)
                .unwrap();
            for i in 0..BATCH as usize {
                let word = first + i as u32;
                let d = word & 0xFFF;
                let syndrome = (u32::from(t.parity[d as usize]) ^ (word >> 12)) as usize;
                let entry = t.leader[syndrome];
                let detected = entry & GOLAY_DETECTED != 0;
                let fixed = if detected {
                    d
                } else {
                    (word ^ (entry & 0xFF_FFFF)) & 0xFFF
                };
                let got: [u8; 3] = std::array::from_fn(|j| (fixed >> (4 * j) & 15) as u8);
                assert_eq!(got, values[3 * i..3 * i + 3], "word {word:#x}");
                let erased = erasures[3 * i / 64] >> (3 * i % 64) & 1 == 1;
                assert_eq!(detected, erased, "word {word:#x}");
            }
        }
    }

    /// The device's metadata decode equals kv-quant's on every pattern of
    /// up to three flips of a few words, for both widths.
    #[test]
    fn meta_columns_decode_like_kv_quant() {
        for (code, wide) in [(MetaCode::f16(), false), (MetaCode::f32(), true)] {
            let cols = MetaColumns::secded(wide);
            let w = code.data_bits();
            let n = w + code.check_bits();
            let mask = if w == 32 { u32::MAX } else { (1 << w) - 1 };
            for data in [0u32, 0x3C00, 0xBEEF, 0xDEAD_BEEF & mask, mask] {
                let cw = u64::from(data) | u64::from(code.check(data)) << w;
                for a in 0..n {
                    for b in a..n {
                        for c in b..n {
                            let e = 1u64 << a ^ 1u64 << b ^ 1u64 << c;
                            for e in [0, 1u64 << a, 1u64 << a ^ 1u64 << b, e] {
                                let rx = cw ^ e;
                                let (d, chk) = (rx as u32 & mask, (rx >> w) as u8);
                                assert_eq!(
                                    cols.decode(d, chk),
                                    code.decode(d, u32::from(chk)),
                                    "{e:#x}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}
