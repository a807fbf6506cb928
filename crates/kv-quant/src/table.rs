//! Fitted tables as stored, protected bytes ([`ProtectedTable`]): the
//! codebooks and bases a calibrated form reads for every token it holds.
//!
//! One flipped bit in a shared codebook or basis changes every token coded
//! with it, so a table is stored like the metadata of the rows: its bytes
//! in 16-bit words, each with the check word of the form's metadata code
//! ([`MetaProtection`]: SECDED (22,16), one check byte per word, or
//! Reed-Muller RM(2,5), two; none for unprotected forms). Every stored bit,
//! data and check, can be hit ([`ProtectedTable::inject`]); a read
//! ([`ProtectedTable::read`]) decodes every word, counts it against the
//! words as written (the ledger: corrected, detected, miscorrected,
//! silent) and gives the table's bytes, a detected word erased to zero
//! (an f16 centroid coordinate or basis entry of 0, never a value the code
//! could not vouch for); a scrub ([`ProtectedTable::scrub`]) rewrites every
//! word it corrects, before single flips pair up.

use std::sync::Arc;

use gf2_codes::DecodeStats;
use gf2_codes::channel::{FaultChannel, Flips};

use crate::meta::MetaCode;
use crate::spec::MetaProtection;

/// A fitted table that can be stored as bytes and rebuilt from them: what a
/// [`ProtectedTable`] holds for it. A table rebuilt from faulted bytes is
/// built as read (a flipped exponent gives an infinite entry), so a fault's
/// outcome is measured, not refused.
pub trait TableBytes: Sized {
    /// The table's stored bytes.
    fn table_bytes(&self) -> Vec<u8>;

    /// A table of this shape holding `bytes` (as
    /// [`table_bytes`](Self::table_bytes) lays them out).
    fn with_table_bytes(&self, bytes: &[u8]) -> crate::Result<Self>;

    /// Whether every 16-bit word of [`table_bytes`](Self::table_bytes) is
    /// an f16 value (so a protected table can check decoded words against
    /// the range written: [`ProtectedTable::with_f16_range`]).
    fn f16_words(&self) -> bool {
        false
    }
}

/// A table's bytes as 16-bit words (little-endian pairs, the last padded
/// with a zero byte), each with a check word of a metadata code.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProtectedTable {
    protection: MetaProtection,
    /// Bytes of the table (before padding).
    len: usize,
    /// The stored bits: every word's two data bytes, then every word's
    /// check bytes (`check_bytes` each), as faults see them.
    stored: Vec<u8>,
    /// The words as written: what a read is compared with.
    truth: Arc<[u16]>,
    /// For a table of f16 values under a code: the largest magnitude
    /// written, as f16 bits without the sign (for finite f16 values the
    /// order of these bits is the order of magnitudes). A decoded word
    /// above it (or not finite) is an error the code let through.
    f16_bound: Option<u16>,
}

impl ProtectedTable {
    /// `bytes` stored under `protection`'s code.
    pub fn new(bytes: &[u8], protection: MetaProtection) -> Self {
        let words: Vec<u16> = bytes
            .chunks(2)
            .map(|p| u16::from_le_bytes([p[0], p.get(1).copied().unwrap_or(0)]))
            .collect();
        let code = code_of(protection);
        let check_bytes = code.map_or(0, MetaCode::check_bytes);
        let mut stored = Vec::with_capacity(words.len() * (2 + check_bytes));
        stored.extend(words.iter().flat_map(|w| w.to_le_bytes()));
        if let Some(code) = code {
            for &w in &words {
                let check = code.check(u32::from(w)).to_le_bytes();
                stored.extend_from_slice(&check[..check_bytes]);
            }
        }
        Self {
            protection,
            len: bytes.len(),
            stored,
            truth: words.into(),
            f16_bound: None,
        }
    }

    /// The same table, its words known to be f16 values: under a code, a
    /// word that decodes to a magnitude above the largest written, or to a
    /// non-finite value, is treated as detected (read as zero, left by a
    /// scrub), as protected metadata outside the range its writers wrote
    /// is. One exponent flip the code let through would otherwise read as
    /// a value up to 65,504 in every row that uses it. Unprotected tables
    /// are not checked.
    #[must_use]
    pub fn with_f16_range(mut self) -> Self {
        if code_of(self.protection).is_some() {
            self.f16_bound = self
                .truth
                .iter()
                .map(|w| w & 0x7FFF)
                .filter(|&m| m < 0x7C00)
                .max();
        }
        self
    }

    /// Bytes a table of `bytes` bytes stores under `protection`: whole
    /// 16-bit words and their check words.
    pub fn stored_len(bytes: usize, protection: MetaProtection) -> usize {
        bytes.div_ceil(2) * (2 + code_of(protection).map_or(0, MetaCode::check_bytes))
    }

    /// The code over the words.
    pub fn protection(&self) -> MetaProtection {
        self.protection
    }

    /// Bytes of the table (data only).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the table holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// 16-bit words stored.
    pub fn words(&self) -> usize {
        self.truth.len()
    }

    /// Every stored byte: data words (padded to whole words) and check
    /// words.
    pub fn stored_bytes(&self) -> usize {
        self.stored.len()
    }

    /// The check words as stored: every word's check bytes, in word order
    /// (empty for an unprotected table).
    pub fn check_bytes(&self) -> &[u8] {
        &self.stored[2 * self.words()..]
    }

    /// The words of `bytes` (laid out as [`new`](Self::new) lays them) that
    /// are not codewords with the check words `checks` ([`check_bytes`](Self::check_bytes)
    /// of a table written from the same bytes): each word's index and what
    /// decoding the pair gives (`Corrected`: the word or its check took a
    /// few flips; `Detected`: more). Empty when every word checks, as a
    /// table loaded from a file should; `checks` of the wrong length are
    /// refused.
    pub fn failing_words(
        bytes: &[u8],
        checks: &[u8],
        protection: MetaProtection,
    ) -> crate::Result<Vec<(usize, gf2_codes::DecodeOutcome)>> {
        let mut table = Self::new(bytes, protection);
        let at = 2 * table.words();
        crate::error::check_len("table check bytes", table.stored.len() - at, checks.len())?;
        table.stored[at..].copy_from_slice(checks);
        Ok((0..table.words())
            .filter_map(|i| match table.decode_word(i).1 {
                gf2_codes::DecodeOutcome::Clean => None,
                outcome => Some((i, outcome)),
            })
            .collect())
    }

    /// Flips stored bits from `channel`'s stream `seed` (data bytes first,
    /// then check bytes, laid end to end), returning the flips.
    pub fn inject(&mut self, channel: &dyn FaultChannel, seed: u64) -> Flips {
        channel.inject(&mut self.stored, seed)
    }

    /// Whether every stored bit is as written.
    pub fn is_pristine(&self) -> bool {
        self.stored == Self::new(&self.written_bytes(), self.protection).stored
    }

    /// The table's bytes as written (the ledger's truth).
    pub fn written_bytes(&self) -> Vec<u8> {
        let mut out: Vec<u8> = self.truth.iter().flat_map(|w| w.to_le_bytes()).collect();
        out.truncate(self.len);
        out
    }

    /// The table's bytes as decoded (a detected word erased to zero
    /// bytes), and every word's outcome against the words as written.
    pub fn read(&self) -> (Vec<u8>, DecodeStats) {
        let (words, stats) = self.read_words();
        let mut out: Vec<u8> = words.iter().flat_map(|(w, _)| w.to_le_bytes()).collect();
        out.truncate(self.len);
        (out, stats)
    }

    /// Every word as decoded with its outcome (a detected word erased to
    /// zero, as [`read`](Self::read) gives it), and the words' statistics:
    /// what a reader that must drop detected entries (an outlier whose
    /// position or value the code could not vouch for) reads.
    pub fn read_words(&self) -> (Vec<(u16, gf2_codes::DecodeOutcome)>, DecodeStats) {
        let mut stats = DecodeStats::default();
        let words = (0..self.words())
            .map(|i| {
                let (word, outcome) = self.checked_word(i);
                let word = match outcome {
                    gf2_codes::DecodeOutcome::Detected => 0,
                    _ => word,
                };
                stats.record_with_truth(outcome, word == self.truth[i]);
                (word, outcome)
            })
            .collect();
        (words, stats)
    }

    /// One scrubbing pass: every word the code corrects is written back
    /// with its check word; detected words are left as found. Counted
    /// against the truth, as [`read`](Self::read) counts.
    pub fn scrub(&mut self) -> DecodeStats {
        let mut stats = DecodeStats::default();
        let Some(code) = code_of(self.protection) else {
            return stats;
        };
        for i in 0..self.words() {
            let (word, outcome) = self.checked_word(i);
            stats.record_with_truth(outcome, word == self.truth[i]);
            if outcome == gf2_codes::DecodeOutcome::Corrected {
                self.stored[2 * i..2 * i + 2].copy_from_slice(&word.to_le_bytes());
                let cb = code.check_bytes();
                let at = 2 * self.words() + cb * i;
                let check = code.check(u32::from(word)).to_le_bytes();
                self.stored[at..at + cb].copy_from_slice(&check[..cb]);
            }
        }
        stats
    }

    /// Word `i` decoded, and flagged as detected where it is outside the
    /// f16 range written ([`with_f16_range`](Self::with_f16_range)).
    fn checked_word(&self, i: usize) -> (u16, gf2_codes::DecodeOutcome) {
        let (word, outcome) = self.decode_word(i);
        match self.f16_bound {
            Some(bound)
                if outcome != gf2_codes::DecodeOutcome::Detected && word & 0x7FFF > bound =>
            {
                (word, gf2_codes::DecodeOutcome::Detected)
            }
            _ => (word, outcome),
        }
    }

    /// Word `i` as received, decoded.
    fn decode_word(&self, i: usize) -> (u16, gf2_codes::DecodeOutcome) {
        let data = u16::from_le_bytes([self.stored[2 * i], self.stored[2 * i + 1]]);
        let Some(code) = code_of(self.protection) else {
            return (data, gf2_codes::DecodeOutcome::Clean);
        };
        let cb = code.check_bytes();
        let at = 2 * self.words() + cb * i;
        let mut check = [0u8; 4];
        check[..cb].copy_from_slice(&self.stored[at..at + cb]);
        let (word, outcome) = code.decode(u32::from(data), u32::from_le_bytes(check));
        (word as u16, outcome)
    }
}

/// The code of 16-bit words under `protection`.
fn code_of(protection: MetaProtection) -> Option<&'static MetaCode> {
    match protection {
        MetaProtection::Unprotected => None,
        MetaProtection::Secded => Some(MetaCode::f16()),
        MetaProtection::ReedMuller => Some(MetaCode::rm_f16()),
    }
}

#[cfg(test)]
mod tests {
    use gf2_codes::channel::{BinarySymmetric, ExactFlips};
    use proptest::prelude::*;

    use super::*;

    const ALL: [MetaProtection; 3] = [
        MetaProtection::Unprotected,
        MetaProtection::Secded,
        MetaProtection::ReedMuller,
    ];

    fn table(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i * 37 + 11) as u8).collect()
    }

    /// Flips the given stored bits directly.
    fn flip(t: &mut ProtectedTable, bits: &[usize]) {
        for &b in bits {
            t.stored[b / 8] ^= 1 << (b % 8);
        }
    }

    #[test]
    fn bytes_come_back_and_are_counted() {
        for p in ALL {
            for len in [0, 1, 2, 7, 64] {
                let t = ProtectedTable::new(&table(len), p);
                let (bytes, stats) = t.read();
                assert_eq!(bytes, table(len));
                assert_eq!(stats.words, len.div_ceil(2) as u64);
                assert_eq!(stats.clean, stats.words);
                let check = code_of(p).map_or(0, MetaCode::check_bytes);
                assert_eq!(t.stored_bytes(), len.div_ceil(2) * (2 + check));
                assert_eq!(ProtectedTable::stored_len(len, p), t.stored_bytes());
                assert!(t.is_pristine());
                assert_eq!(t.written_bytes(), table(len));
            }
        }
    }

    #[test]
    fn every_single_flip_is_corrected_by_either_code() {
        for p in [MetaProtection::Secded, MetaProtection::ReedMuller] {
            let clean = ProtectedTable::new(&table(9), p);
            for bit in 0..8 * clean.stored_bytes() {
                let mut t = clean.clone();
                flip(&mut t, &[bit]);
                let (bytes, stats) = t.read();
                assert_eq!(bytes, table(9), "{p:?} bit {bit}");
                // SECDED (22,16) uses 6 bits of its check byte: a flip in
                // the other two changes no syndrome and nothing read.
                let code = code_of(p).unwrap();
                let unused = bit >= 8 * 2 * clean.words()
                    && (bit % (8 * code.check_bytes())) >= code.check_bits() as usize;
                let corrected = u64::from(!unused);
                assert_eq!(
                    (stats.corrected, stats.miscorrected),
                    (corrected, 0),
                    "{p:?} bit {bit}"
                );
                assert_eq!(t.scrub().corrected, corrected);
                assert_eq!(t.is_pristine(), !unused, "{p:?} bit {bit} scrubbed");
            }
        }
    }

    #[test]
    fn failing_words_name_the_words_a_file_changed() {
        let bytes = table(40);
        let t = ProtectedTable::new(&bytes, MetaProtection::ReedMuller);
        let checks = t.check_bytes().to_vec();
        assert_eq!(checks.len(), 40);
        let ok = ProtectedTable::failing_words(&bytes, &checks, MetaProtection::ReedMuller);
        assert_eq!(ok.unwrap(), vec![]);
        let mut changed = bytes.clone();
        changed[7] ^= 0x10; // word 3, one bit
        changed[20] ^= 0x0F; // word 10, four bits
        let failing =
            ProtectedTable::failing_words(&changed, &checks, MetaProtection::ReedMuller).unwrap();
        use gf2_codes::DecodeOutcome::{Corrected, Detected};
        assert_eq!(failing, vec![(3, Corrected), (10, Detected)]);
        assert!(
            ProtectedTable::failing_words(&bytes, &checks[1..], MetaProtection::ReedMuller)
                .is_err()
        );
    }

    #[test]
    fn an_f16_word_the_code_let_through_above_the_range_is_detected() {
        let values = [0.5f32, -1.25, 0.75, 2.0];
        let bytes: Vec<u8> = values
            .iter()
            .flat_map(|&v| half::f16::from_f32(v).to_le_bytes())
            .collect();
        let code = MetaCode::rm_f16();
        // A stored word replaced by another codeword (what five or more
        // flips can leave): 0.5 becomes 512.0, in range of nothing written.
        let big = half::f16::from_f32(512.0).to_bits();
        let mut t = ProtectedTable::new(&bytes, MetaProtection::ReedMuller).with_f16_range();
        t.stored[..2].copy_from_slice(&big.to_le_bytes());
        let at = 2 * t.words();
        t.stored[at..at + 2].copy_from_slice(&code.check(u32::from(big)).to_le_bytes()[..2]);
        let (read, stats) = t.read();
        assert_eq!((stats.detected, stats.silent), (1, 0));
        assert_eq!(&read[..2], &[0, 0]);
        assert_eq!(&read[2..], &bytes[2..]);
        // 1.5 is within the range written: a wrong word the check passes.
        let mut t = ProtectedTable::new(&bytes, MetaProtection::ReedMuller).with_f16_range();
        let mid = half::f16::from_f32(1.5).to_bits();
        t.stored[..2].copy_from_slice(&mid.to_le_bytes());
        t.stored[at..at + 2].copy_from_slice(&code.check(u32::from(mid)).to_le_bytes()[..2]);
        assert_eq!(t.read().1.silent, 1);
        // Unprotected tables are not checked.
        let mut t = ProtectedTable::new(&bytes, MetaProtection::Unprotected).with_f16_range();
        t.stored[..2].copy_from_slice(&big.to_le_bytes());
        assert_eq!(t.read().1.silent, 1);
    }

    #[test]
    fn an_unprotected_flip_is_silent() {
        let mut t = ProtectedTable::new(&table(8), MetaProtection::Unprotected);
        flip(&mut t, &[13]);
        let (bytes, stats) = t.read();
        assert_ne!(bytes, table(8));
        assert_eq!((stats.silent, stats.clean), (1, 3));
        assert_eq!(t.scrub(), DecodeStats::default());
    }

    #[test]
    fn rm_detects_four_flips_in_a_word_and_erases_it() {
        let mut t = ProtectedTable::new(&table(4), MetaProtection::ReedMuller);
        // Word 1: data bits 16..32 of the stored bytes, checks after.
        flip(&mut t, &[16, 19, 25, 30]);
        let (bytes, stats) = t.read();
        assert_eq!(stats.detected, 1);
        assert_eq!(&bytes[2..4], &[0, 0]);
        assert_eq!(&bytes[..2], &table(4)[..2]);
        let before = t.clone();
        assert_eq!(t.scrub().detected, 1);
        assert_eq!(t, before, "a detected word is left as found");
    }

    proptest! {
        /// Up to three flips per RM(2,5) word are corrected wherever they
        /// fall, and the scrubbed table is the table as written.
        #[test]
        fn rm_corrects_three_flips_per_word(
            len in 2usize..40,
            picks in proptest::collection::vec((0usize..64, 0usize..32), 0..12),
        ) {
            let clean = ProtectedTable::new(&table(len), MetaProtection::ReedMuller);
            let words = clean.words();
            let mut t = clean.clone();
            let mut per_word = vec![std::collections::BTreeSet::new(); words];
            for (w, b) in picks {
                let w = w % words;
                if per_word[w].len() < 3 {
                    per_word[w].insert(b);
                }
            }
            for (w, bits) in per_word.iter().enumerate() {
                for &b in bits {
                    // Bits 0..16 data, 16..32 check, of word w.
                    let at = if b < 16 { 16 * w + b } else { 8 * (2 * words + 2 * w) + b - 16 };
                    flip(&mut t, &[at]);
                }
            }
            let (bytes, stats) = t.read();
            prop_assert_eq!(bytes, table(len));
            prop_assert_eq!(stats.miscorrected + stats.silent + stats.detected, 0);
            t.scrub();
            prop_assert!(t.is_pristine());
        }

        /// Under any channel the ledger accounts for every word: clean,
        /// corrected, detected, miscorrected or silent, and a word read
        /// right unless it was detected, miscorrected or silent.
        #[test]
        fn every_word_is_accounted(seed in any::<u64>(), p in 0usize..3) {
            let bytes = table(200);
            let mut t = ProtectedTable::new(&bytes, ALL[p]);
            t.inject(&BinarySymmetric::new(0.02).unwrap(), seed);
            let (read, s) = t.read();
            prop_assert_eq!(s.words, 100);
            prop_assert_eq!(s.clean + s.corrected + s.detected + s.miscorrected + s.silent, 100);
            // `table` has no zero word, so a detected word (erased to
            // zero) reads wrong, like a miscorrected or silent one.
            prop_assert!(bytes.chunks(2).all(|w| w != [0, 0]));
            let wrong = read.chunks(2).zip(bytes.chunks(2)).filter(|(a, b)| a != b).count() as u64;
            prop_assert_eq!(wrong, s.detected + s.miscorrected + s.silent);
        }
    }

    #[test]
    fn a_channel_reaches_check_bytes() {
        let mut t = ProtectedTable::new(&table(64), MetaProtection::Secded);
        // The first bit of the first check byte, after 64 data bytes.
        let flips = t.inject(&ExactFlips::new([8 * 64]), 3);
        assert_eq!(flips.positions(), &[8 * 64]);
        assert!(!t.is_pristine());
        assert_eq!(t.read().1.corrected, 1);
    }
}
