//! Per-codeword decode outcomes and the counters every batch decode returns.

use std::ops::AddAssign;

/// What the decoder concluded about one received codeword.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DecodeOutcome {
    /// Zero syndrome: the word is accepted as it is.
    Clean,
    /// Non-zero syndrome with a unique minimum-weight coset leader within the
    /// decoding radius: the leader was XORed away. For SECDED this includes the
    /// paper's "parity bit only" row, where the data bits were valid all along.
    Corrected,
    /// Non-zero syndrome that cannot be corrected unambiguously: the data is
    /// returned as received and flagged as an erasure.
    Detected,
}

/// Counters of decode outcomes over a batch, counted per codeword.
///
/// Without the true data (`decode_*` calls) every word lands in exactly one of
/// `clean`, `corrected`, `detected`, and `miscorrected == silent == 0`.
/// When the truth is known (`decode_*_with_truth` calls) the five counters
/// partition the words: a word the decoder called clean but whose data is
/// wrong is `silent` (not `clean`), and a word it called corrected but got
/// wrong is `miscorrected` (not `corrected`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct DecodeStats {
    /// Codewords decoded.
    pub words: u64,
    /// Accepted with a zero syndrome (and, with truth, right).
    pub clean: u64,
    /// Corrected (and, with truth, right).
    pub corrected: u64,
    /// Detected as uncorrectable and flagged as erasures.
    pub detected: u64,
    /// With truth only: the decoder "corrected" to the wrong data.
    pub miscorrected: u64,
    /// With truth only: zero syndrome, wrong data (an undetected error).
    pub silent: u64,
}

impl DecodeStats {
    /// Counts one word whose truth is unknown.
    #[inline]
    pub fn record(&mut self, outcome: DecodeOutcome) {
        self.words += 1;
        match outcome {
            DecodeOutcome::Clean => self.clean += 1,
            DecodeOutcome::Corrected => self.corrected += 1,
            DecodeOutcome::Detected => self.detected += 1,
        }
    }

    /// Counts one word whose decoded data was compared with the truth.
    #[inline]
    pub fn record_with_truth(&mut self, outcome: DecodeOutcome, data_is_right: bool) {
        self.words += 1;
        match (outcome, data_is_right) {
            (DecodeOutcome::Clean, true) => self.clean += 1,
            (DecodeOutcome::Clean, false) => self.silent += 1,
            (DecodeOutcome::Corrected, true) => self.corrected += 1,
            (DecodeOutcome::Corrected, false) => self.miscorrected += 1,
            (DecodeOutcome::Detected, _) => self.detected += 1,
        }
    }

    /// Words whose data came out wrong without a flag (`miscorrected + silent`).
    pub fn undetected_errors(&self) -> u64 {
        self.miscorrected + self.silent
    }

    /// What a decoder that does not know the truth counts for the same
    /// words: miscorrected words as corrected and silent ones as clean (a
    /// device decoder, say, compared with a CPU decode that had a ledger).
    #[must_use]
    pub fn without_truth(self) -> Self {
        Self {
            words: self.words,
            clean: self.clean + self.silent,
            corrected: self.corrected + self.miscorrected,
            detected: self.detected,
            miscorrected: 0,
            silent: 0,
        }
    }
}

impl AddAssign for DecodeStats {
    fn add_assign(&mut self, rhs: Self) {
        self.words += rhs.words;
        self.clean += rhs.clean;
        self.corrected += rhs.corrected;
        self.detected += rhs.detected;
        self.miscorrected += rhs.miscorrected;
        self.silent += rhs.silent;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn truth_partitions_words() {
        let mut s = DecodeStats::default();
        for outcome in [
            DecodeOutcome::Clean,
            DecodeOutcome::Corrected,
            DecodeOutcome::Detected,
        ] {
            for right in [true, false] {
                s.record_with_truth(outcome, right);
            }
        }
        assert_eq!(s.words, 6);
        assert_eq!(
            (s.clean, s.corrected, s.detected, s.miscorrected, s.silent),
            (1, 1, 2, 1, 1)
        );
        assert_eq!(
            s.clean + s.corrected + s.detected + s.miscorrected + s.silent,
            s.words
        );
        let mut t = s;
        t += s;
        assert_eq!(t.words, 12);
        assert_eq!(t.undetected_errors(), 4);
    }

    #[test]
    fn without_truth_counts_what_the_decoder_saw() {
        let mut with = DecodeStats::default();
        let mut without = DecodeStats::default();
        for (outcome, right) in [
            (DecodeOutcome::Clean, true),
            (DecodeOutcome::Clean, false),
            (DecodeOutcome::Corrected, false),
            (DecodeOutcome::Corrected, true),
            (DecodeOutcome::Corrected, false),
            (DecodeOutcome::Detected, false),
        ] {
            with.record_with_truth(outcome, right);
            without.record(outcome);
        }
        assert_ne!(with, without);
        assert_eq!(with.without_truth(), without);
        assert_eq!(without.without_truth(), without);
    }
}
