//! [`BlockGuard`]: a sealed Shard block's stored bits under a coded
//! spelling (`shard-k3-cal+secded84`, `+golay24`, their interleaved
//! layouts).
//!
//! The block's codes (key coefficient codes or VQ indices) are stored as
//! their 4-bit nibbles (low then high of each byte) encoded by the form's
//! INT4 code, as the re-encode protocol's `ShardLayer` stores them; its f16
//! scales (the keys' per-component steps, the values' channel maxima) as a
//! kv-quant [`ProtectedTable`] under the form's metadata code (RM(2,5)
//! beside SECDED and Golay codes), checked against the range written. The
//! block beside the guard holds the codes and scales as last decoded,
//! which is what attention reads: faults decode through the codes when
//! they land (a detected code word keeps its received data, `+keep`,
//! whatever erasure policy the spelling names; a detected scale reads as
//! zero), and a scrub rewrites every corrected word. The words as written are kept beside them, so every word is
//! accounted (corrected, detected, miscorrected, silent) on every read of
//! the block ([`stats`](BlockGuard::stats)).

use gf2_codes::DecodeStats;
use gf2_codes::batch::{Int4Code, erasure_words};
use gf2_codes::channel::{FaultChannel, Flips};
use half::f16;
use kv_quant::{FaultTarget, Injection, KvDecodeStats, MetaProtection, ProtectedTable, ScrubStats};

use crate::error::{AttentionError, Result};

/// Salt of the scales' stream (apart from the codes').
const SCALE_SALT: u64 = 0x2545_f491_4f6c_dd1d;

/// A sealed block's codes and scales as stored under a code (module docs).
#[derive(Clone, Debug, PartialEq)]
pub struct BlockGuard {
    code: Int4Code,
    /// The codes' nibbles encoded by `code`: the stored bits faults see.
    encoded: Vec<u8>,
    /// The codes as written (what every decode is compared with).
    written: Vec<u8>,
    /// The f16 scales under the metadata code.
    scales: ProtectedTable,
    /// How the stored words decode now: the code words (`values`) and the
    /// scales (`metadata`).
    stats: KvDecodeStats,
}

impl BlockGuard {
    /// `codes` and `scales` (f16 values held in f32) as written, stored
    /// under `code` and `metadata`.
    pub fn new(
        code: Int4Code,
        metadata: MetaProtection,
        codes: &[u8],
        scales: &[f32],
    ) -> Result<Self> {
        let encoded = code.codec().encode(&nibbles(codes)).map_err(gf2)?;
        let scales = ProtectedTable::new(&f16_bytes(scales), metadata).with_f16_range();
        let words = code.codec().codewords(2 * codes.len()) as u64;
        let clean = |words: u64| DecodeStats {
            words,
            clean: words,
            ..DecodeStats::default()
        };
        Ok(Self {
            code,
            encoded,
            written: codes.to_vec(),
            stats: KvDecodeStats {
                values: clean(words),
                metadata: clean(scales.words() as u64),
                erased_values: 0,
            },
            scales,
        })
    }

    /// Whether it stores `codes` bytes of codes and `scales` scales.
    pub fn holds(&self, codes: usize, scales: usize) -> bool {
        self.written.len() == codes && self.scales.len() == 2 * scales
    }

    /// The INT4 code over the codes.
    pub fn code(&self) -> Int4Code {
        self.code
    }

    /// The metadata code over the scales.
    pub fn metadata(&self) -> MetaProtection {
        self.scales.protection()
    }

    /// Bytes stored: the encoded codes, the scales and their check words.
    pub fn stored_bytes(&self) -> usize {
        self.encoded.len() + self.scales.stored_bytes()
    }

    /// Bytes [`new`](Self::new) stores for `codes` bytes of codes and
    /// `scales` f16 scales.
    pub fn stored_len(
        code: Int4Code,
        metadata: MetaProtection,
        codes: usize,
        scales: usize,
    ) -> usize {
        code.codec().encoded_len(2 * codes) + ProtectedTable::stored_len(2 * scales, metadata)
    }

    /// How every stored word decodes now, against the words as written.
    pub fn stats(&self) -> KvDecodeStats {
        self.stats
    }

    /// Faults from `channel`'s stream `seed` into the stored bits `target`
    /// reaches (the encoded codes under `values`, the scales under
    /// `metadata`, both under `everything`); `codes` and `scales` (the
    /// block's, of the lengths written) are left as the stored bits decode.
    pub fn inject(
        &mut self,
        (codes, scales): (&mut [u8], &mut [f32]),
        channel: &dyn FaultChannel,
        seed: u64,
        target: FaultTarget,
    ) -> Result<Injection> {
        let mut hit = Injection::default();
        if target != FaultTarget::Metadata {
            hit.values = channel.inject(&mut self.encoded, seed);
        }
        if target != FaultTarget::Values {
            // The scales' data words, then their check words (a kv-quant
            // store's `scales` and `checks`).
            let flips = self.scales.inject(channel, seed ^ SCALE_SALT);
            let data_bits = 16 * self.scales.words() as u64;
            let (data, checks): (Vec<u64>, Vec<u64>) =
                flips.positions().iter().partition(|&&p| p < data_bits);
            hit.scales = Flips::from_events(data);
            hit.checks = Flips::from_events(checks.iter().map(|p| p - data_bits).collect());
        }
        if hit.total() > 0 {
            self.decode_into(codes, scales)?;
        }
        Ok(hit)
    }

    /// One scrubbing pass: every corrected code word and scale word is
    /// rewritten with its check bits (detected ones are left as found);
    /// counted against the words as written. What a read decodes does not
    /// change.
    pub fn scrub(&mut self) -> Result<ScrubStats> {
        let before = self.stats;
        let codec = self.code.codec();
        codec
            .scrub(&mut self.encoded, 2 * self.written.len())
            .map_err(gf2)?;
        let metadata = self.scales.scrub();
        // The outcomes of the scrub's reads, against the truth; the words
        // now stored decode as before, those corrected now clean.
        self.stats.values = self.decode_codes()?.1;
        self.stats.metadata = self.scales.read().1;
        Ok(ScrubStats {
            values: before.values,
            metadata,
            tables: DecodeStats::default(),
        })
    }

    /// Decodes the stored bits into `codes` and `scales`, and records how.
    fn decode_into(&mut self, codes: &mut [u8], scales: &mut [f32]) -> Result<()> {
        if codes.len() != self.written.len() || 2 * scales.len() != self.scales.len() {
            return Err(AttentionError::InvalidParameter {
                name: "guarded block",
                reason: format!(
                    "{} code bytes and {} scales, where {} and {} were written",
                    codes.len(),
                    scales.len(),
                    self.written.len(),
                    self.scales.len() / 2
                ),
            });
        }
        let (decoded, values) = self.decode_codes()?;
        codes.copy_from_slice(&decoded);
        let (bytes, metadata) = self.scales.read();
        for (s, b) in scales.iter_mut().zip(bytes.chunks_exact(2)) {
            *s = f16::from_le_bytes([b[0], b[1]]).to_f32();
        }
        // A detected code word keeps its received data (`+keep`) and a
        // detected scale reads as zero: nothing is erased to be filled in.
        self.stats = KvDecodeStats {
            values,
            metadata,
            erased_values: 0,
        };
        Ok(())
    }

    /// The codes as the stored bits decode (a detected word keeps its
    /// received data), and the words' outcomes against the truth.
    fn decode_codes(&self) -> Result<(Vec<u8>, DecodeStats)> {
        let truth = nibbles(&self.written);
        let mut values = vec![0u8; truth.len()];
        let mut erasures = vec![0u64; erasure_words(truth.len())];
        let stats = self
            .code
            .codec()
            .decode_with_truth_into(&self.encoded, &truth, &mut values, &mut erasures)
            .map_err(gf2)?;
        let codes = values.chunks_exact(2).map(|p| p[0] | p[1] << 4).collect();
        Ok((codes, stats))
    }
}

/// Each byte's low then high nibble.
fn nibbles(bytes: &[u8]) -> Vec<u8> {
    bytes.iter().flat_map(|&b| [b & 15, b >> 4]).collect()
}

/// f16 values held in f32, as little-endian f16 bytes.
fn f16_bytes(values: &[f32]) -> Vec<u8> {
    values
        .iter()
        .flat_map(|&v| f16::from_f32(v).to_le_bytes())
        .collect()
}

fn gf2(e: gf2_codes::Gf2Error) -> AttentionError {
    AttentionError::InvalidParameter {
        name: "code",
        reason: e.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use gf2_codes::channel::{BinarySymmetric, ExactFlips};

    use super::*;

    fn guard() -> (BlockGuard, Vec<u8>, Vec<f32>) {
        let codes: Vec<u8> = (0..64u32).map(|i| (i * 37 % 256) as u8).collect();
        let scales = vec![0.5, 0.25, 1.5, 0.125];
        let g = BlockGuard::new(
            Int4Code::Secded84,
            MetaProtection::ReedMuller,
            &codes,
            &scales,
        )
        .unwrap();
        (g, codes, scales)
    }

    #[test]
    fn single_flips_are_corrected_and_a_scrub_rewrites_them() {
        let (mut g, codes, scales) = guard();
        // SECDED(8,4): a byte per nibble; RM(2,5): 2 + 2 bytes per scale.
        assert_eq!(g.stored_bytes(), 2 * 64 + 4 * 4);
        assert_eq!(
            g.stored_bytes(),
            BlockGuard::stored_len(Int4Code::Secded84, MetaProtection::ReedMuller, 64, 4)
        );
        assert_eq!(g.stats().values.clean, 128);
        let (mut c, mut s) = (codes.clone(), scales.clone());
        // Bit 3 of code byte 0's low nibble word, bit 9 of the second
        // word; bit 14 (exponent) of scale 0 under `everything`.
        let hit = g
            .inject(
                (&mut c, &mut s),
                &ExactFlips::new([3, 9]),
                0,
                FaultTarget::Values,
            )
            .unwrap();
        assert_eq!(hit.values.len(), 2);
        assert_eq!((c.as_slice(), s.as_slice()), (&codes[..], &scales[..]));
        assert_eq!(g.stats().values.corrected, 2);
        let scrub = g.scrub().unwrap();
        assert_eq!(scrub.values.corrected, 2);
        assert_eq!(g.stats().values.corrected, 0);
        assert_eq!(g.stats().values.clean, 128);
    }

    #[test]
    fn without_a_strong_enough_code_errors_are_detected_or_counted_wrong() {
        let (mut g, codes, scales) = guard();
        let (mut c, mut s) = (codes.clone(), scales.clone());
        // Two flips in one SECDED word: detected, the received data kept.
        g.inject(
            (&mut c, &mut s),
            &ExactFlips::new([0, 1]),
            0,
            FaultTarget::Everything,
        )
        .unwrap();
        assert_eq!(g.stats().values.detected, 1);
        assert_eq!(g.stats().erased_values, 0, "kept, not erased");
        // A scrub leaves it.
        assert_eq!(g.scrub().unwrap().values.detected, 1);
        assert_eq!(g.stats().values.detected, 1);
        // Four flips in scale 0's word: detected by RM(2,5), read as zero.
        g.inject(
            (&mut c, &mut s),
            &ExactFlips::new([14, 13, 12, 11]),
            0,
            FaultTarget::Metadata,
        )
        .unwrap();
        assert_eq!(g.stats().metadata.detected, 1);
        assert_eq!(s[0], 0.0);
        assert_eq!(s[1..], scales[1..]);
    }

    #[test]
    fn every_word_is_accounted_and_a_seed_gives_the_same_faults() {
        let channel = BinarySymmetric::new(3e-2).unwrap();
        let run = || {
            let (mut g, mut c, mut s) = guard();
            let hit = g
                .inject((&mut c, &mut s), &channel, 9, FaultTarget::Everything)
                .unwrap();
            (g, c, s, hit)
        };
        let (g, c, s, hit) = run();
        assert_eq!(run().1, c);
        assert_eq!(run().2, s);
        assert!(hit.total() > 0);
        let v = g.stats().values;
        assert_eq!(
            v.clean + v.corrected + v.detected + v.miscorrected + v.silent,
            v.words
        );
        assert_eq!(v.words, 128);
        assert_eq!(g.stats().metadata.words, 4);
    }
}
