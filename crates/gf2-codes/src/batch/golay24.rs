//! Extended Golay(24,12) holding three INT4 values per codeword (section 5.4.1).
//!
//! Values `3i, 3i+1, 3i+2` form the data word `d = v₀ | v₁<<4 | v₂<<8`; the
//! codeword `d·G₂₄ = d | p<<12` (eq. 33) is stored little-endian in bytes
//! `3i..3i+3`. A last codeword with fewer than three values is padded with zero
//! values. Decoding: since `H₂₄ = [Bᵀ | I]` (eq. 34), the syndrome is
//! `p(d) ⊕ p_received`, where `p(d) = d·B` is the encoder's parity table, and a
//! 4096-entry table maps it to the coset leader: unique leaders (weight ≤ 3,
//! 2325 syndromes) are corrected, the 1771 weight-4 cosets are detected.

use std::sync::OnceLock;

use super::{Backend, Int4Codec, check_decode_shapes, check_nibbles};
use crate::code::LinearCode;
use crate::error::{Result, check_len};
use crate::stats::{DecodeOutcome, DecodeStats};

/// The Golay(24,12) batch codec (24 bits per 3 values).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Golay24;

const CORRECTED: u32 = 1 << 24;
const DETECTED: u32 = 1 << 25;

pub(crate) struct Tables {
    /// `d·B` for each data word: the parity on encode, the data part of the syndrome on decode.
    pub(crate) parity: Vec<u16>,
    /// Per syndrome: the 24-bit error pattern to remove | CORRECTED | DETECTED.
    pub(crate) leader: Vec<u32>,
    /// `vgf2p8affineqb` matrices: `[byte r of the codeword][syndrome byte h]`.
    pub(crate) syndrome_affine: [[u64; 2]; 3],
}

pub(crate) fn code() -> &'static LinearCode {
    static CODE: OnceLock<LinearCode> = OnceLock::new();
    CODE.get_or_init(crate::standard::golay24)
}

pub(crate) fn tables() -> &'static Tables {
    static TABLES: OnceLock<Tables> = OnceLock::new();
    TABLES.get_or_init(|| {
        let code = code();
        let parity: Vec<u16> = (0..4096u64)
            .map(|d| (code.encode(d).expect("12 data bits") >> 12) as u16)
            .collect();
        let leader = (0..4096u64)
            .map(|s| {
                // H₂₄ has the identity on the parity columns, so a received word
                // with data 0 and parity s has syndrome s.
                let d = code.decode_word(s << 12).expect("24-bit word");
                debug_assert_eq!(d.syndrome, s);
                match d.outcome {
                    DecodeOutcome::Clean => 0,
                    DecodeOutcome::Corrected => d.error_pattern as u32 | CORRECTED,
                    DecodeOutcome::Detected => DETECTED,
                }
            })
            .collect();
        let bit_syndrome = |bit: usize| code.syndrome(1 << bit).expect("bit < 24");
        let syndrome_affine = std::array::from_fn(|r| {
            std::array::from_fn(|h| {
                super::affine_matrix(super::syndrome_rows(|j| bit_syndrome(8 * r + j), h as u32))
            })
        });
        Tables {
            parity,
            leader,
            syndrome_affine,
        }
    })
}

#[inline(always)]
fn decode_word(t: &Tables, bytes: [u8; 3]) -> (u32, u32) {
    let w = u32::from(bytes[0]) | u32::from(bytes[1]) << 8 | u32::from(bytes[2]) << 16;
    let d = w & 0xFFF;
    let e = t.leader[usize::from(t.parity[d as usize]) ^ (w >> 12) as usize];
    (d ^ (e & 0xFFF), e)
}

#[inline(always)]
fn outcome(e: u32) -> DecodeOutcome {
    if e & DETECTED != 0 {
        DecodeOutcome::Detected
    } else if e & CORRECTED != 0 {
        DecodeOutcome::Corrected
    } else {
        DecodeOutcome::Clean
    }
}

/// Applies leader-table entry `e` of codeword `i` of a buffer whose values
/// were written uncorrected; counts it (for non-zero syndromes only).
#[inline]
fn apply_leader(e: u32, i: usize, out: &mut [u8], erasures: &mut [u64], stats: &mut DecodeStats) {
    if e & DETECTED != 0 {
        stats.detected += 1;
        for v in 3 * i..3 * i + 3 {
            erasures[v / 64] |= 1 << (v % 64);
        }
    } else if e & CORRECTED != 0 {
        stats.corrected += 1;
        for (j, v) in out[3 * i..3 * i + 3].iter_mut().enumerate() {
            *v ^= (e >> (4 * j) & 0xF) as u8;
        }
    }
}

/// Corrects codeword `i` of a block whose values were written uncorrected,
/// from its non-zero `syndrome` (the SIMD kernels' slow path).
#[inline]
pub(crate) fn correct_word(
    t: &Tables,
    syndrome: usize,
    i: usize,
    out: &mut [u8],
    erasures: &mut [u64],
    stats: &mut DecodeStats,
) {
    apply_leader(t.leader[syndrome], i, out, erasures, stats);
}

/// Ends a SIMD decode of `blocks` blocks of 64 codewords (192 values)
/// counted in `stats` (words, corrected, detected): the clean count, then
/// the tail after the blocks through the scalar loop.
pub(crate) fn finish_blocks(
    t: &Tables,
    blocks: usize,
    mut stats: DecodeStats,
    encoded: &[u8],
    values: &mut [u8],
    erasures: &mut [u64],
) -> DecodeStats {
    stats.clean = stats.words - stats.corrected - stats.detected;
    let done = 192 * blocks;
    stats += decode_all(
        t,
        &encoded[done..],
        &mut values[done..],
        None,
        &mut erasures[3 * blocks..],
    );
    stats
}

/// The whole decode loop; `truth` selects the truth-aware accounting.
///
/// Scalar: two table loads per codeword. The AVX2 and AVX-512 paths compute
/// syndromes for 64 words at a time and come here only for their tail. Truth-aware
/// decoding always runs here (an experiment path, not a hot one).
#[inline(always)]
pub(crate) fn decode_all(
    t: &Tables,
    encoded: &[u8],
    values: &mut [u8],
    truth: Option<&[u8]>,
    erasures: &mut [u64],
) -> DecodeStats {
    erasures.fill(0);
    let n = values.len();
    let full = n / 3;
    let (mut corrected, mut detected) = (0u64, 0u64);
    let mut stats = DecodeStats::default();
    let mark_erased = |i: usize, count: usize, erasures: &mut [u64]| {
        for v in 3 * i..3 * i + count {
            erasures[v / 64] |= 1 << (v % 64);
        }
    };
    for (i, (out, cw)) in values
        .chunks_exact_mut(3)
        .zip(encoded.chunks_exact(3))
        .enumerate()
    {
        let (d, e) = decode_word(t, [cw[0], cw[1], cw[2]]);
        out[0] = (d & 0xF) as u8;
        out[1] = (d >> 4 & 0xF) as u8;
        out[2] = (d >> 8) as u8;
        corrected += u64::from(e >> 24 & 1);
        detected += u64::from(e >> 25);
        if e & DETECTED != 0 {
            mark_erased(i, 3, erasures);
        }
        if let Some(truth) = truth {
            let right = out == &truth[3 * i..3 * i + 3];
            stats.record_with_truth(outcome(e), right);
        }
    }
    if truth.is_none() {
        stats.words = full as u64;
        stats.corrected = corrected;
        stats.detected = detected;
        stats.clean = full as u64 - corrected - detected;
    }
    let rest = n - 3 * full;
    if rest > 0 {
        let cw = &encoded[3 * full..];
        let (d, e) = decode_word(t, [cw[0], cw[1], cw[2]]);
        let all = [(d & 0xF) as u8, (d >> 4 & 0xF) as u8, (d >> 8) as u8];
        values[3 * full..].copy_from_slice(&all[..rest]);
        if e & DETECTED != 0 {
            mark_erased(full, rest, erasures);
        }
        match truth {
            None => stats.record(outcome(e)),
            // Padding values are zero by construction: they count as data too.
            Some(truth) => {
                let mut expected = [0u8; 3];
                expected[..rest].copy_from_slice(&truth[3 * full..]);
                stats.record_with_truth(outcome(e), all == expected);
            }
        }
    }
    stats
}

impl Int4Codec for Golay24 {
    fn name(&self) -> &'static str {
        "golay24"
    }

    fn values_per_codeword(&self) -> usize {
        3
    }

    fn bits_per_value(&self) -> u32 {
        8
    }

    fn encoded_len(&self, values: usize) -> usize {
        3 * values.div_ceil(3)
    }

    fn encode_into(&self, values: &[u8], encoded: &mut [u8]) -> Result<()> {
        check_len("encoded", self.encoded_len(values.len()), encoded.len())?;
        check_nibbles(values)?;
        let t = tables();
        for (v, out) in values.chunks(3).zip(encoded.chunks_exact_mut(3)) {
            let d = v
                .iter()
                .enumerate()
                .fold(0u32, |d, (j, &x)| d | u32::from(x & 0xF) << (4 * j));
            let w = d | u32::from(t.parity[d as usize]) << 12;
            out.copy_from_slice(&w.to_le_bytes()[..3]);
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
        check_decode_shapes(self, encoded.len(), values.len(), erasures.len(), None)?;
        backend.ensure_supported()?;
        Ok(match backend {
            #[cfg(target_arch = "x86_64")]
            Backend::Avx512 => {
                // SAFETY: `ensure_supported` checked the CPU features.
                unsafe {
                    super::avx512::golay_decode_avx512::<false>(tables(), encoded, values, erasures)
                }
            }
            #[cfg(target_arch = "x86_64")]
            Backend::Avx2 => {
                // SAFETY: `ensure_supported` checked the CPU features.
                unsafe {
                    super::avx2::golay_decode_avx2::<false>(tables(), encoded, values, erasures)
                }
            }
            _ => decode_all(tables(), encoded, values, None, erasures),
        })
    }

    fn decode_with_truth_into_with(
        &self,
        backend: Backend,
        encoded: &[u8],
        truth: &[u8],
        values: &mut [u8],
        erasures: &mut [u64],
    ) -> Result<DecodeStats> {
        check_decode_shapes(
            self,
            encoded.len(),
            values.len(),
            erasures.len(),
            Some(truth.len()),
        )?;
        backend.ensure_supported()?;
        Ok(decode_all(tables(), encoded, values, Some(truth), erasures))
    }

    fn scrub(&self, encoded: &mut [u8], values: usize) -> Result<DecodeStats> {
        check_len("encoded", self.encoded_len(values), encoded.len())?;
        let t = tables();
        let mut stats = DecodeStats::default();
        for cw in encoded.chunks_exact_mut(3) {
            let (_, e) = decode_word(t, [cw[0], cw[1], cw[2]]);
            stats.record(outcome(e));
            if e & CORRECTED != 0 {
                let fix = (e & 0xFF_FFFF).to_le_bytes();
                for (b, f) in cw.iter_mut().zip(fix) {
                    *b ^= f;
                }
            }
        }
        Ok(stats)
    }
}
