//! In-place changes of a [`KvStore`]: writing token rows one at a time (what
//! a paged cache does on every appended token) and scrubbing (decoding every
//! codeword and rewriting the corrected ones, so that a single flip is
//! cleaned before a second one lands in the same word).

use gf2_codes::{DecodeOutcome, DecodeStats};

use super::{KvStore, QuantizeOptions, read_word};
use crate::error::{KvQuantError, Result};
use crate::spec::CacheForm;

impl KvStore {
    /// A store of `tokens × channels` zeros in `form` (every row decodes to 0.0).
    pub fn zeroed(form: CacheForm, tokens: usize, channels: usize) -> Result<Self> {
        let len = tokens
            .checked_mul(channels)
            .ok_or_else(|| KvQuantError::InvalidParameter {
                name: "shape",
                reason: format!("{tokens} × {channels} overflows"),
            })?;
        Self::quantize(form, &vec![0.0; len], tokens, channels)
    }

    /// Quantizes `rows` (`n × channels`, row-major) into tokens
    /// `start..start + n`, leaving every other token as it was. The bytes
    /// written equal those of the same rows of [`KvStore::quantize_with`] over
    /// the whole matrix, so a store filled row by row is byte-identical to one
    /// quantized at once. Overwriting a row also replaces any faults it held.
    ///
    /// Only [row-local](CacheForm::is_row_local) forms can do this; others
    /// share scales across tokens and get [`KvQuantError::InvalidParameter`].
    pub fn write_rows(
        &mut self,
        start: usize,
        rows: &[f32],
        options: QuantizeOptions,
    ) -> Result<()> {
        if !self.form.is_row_local() {
            return Err(KvQuantError::InvalidParameter {
                name: "form",
                reason: format!(
                    "{} shares scales across tokens, so its rows cannot be written one at a time \
                     (use a per-token form such as int4-g64 or fp8-e4m3-tok)",
                    self.form
                ),
            });
        }
        let ch = self.channels;
        if !rows.len().is_multiple_of(ch) {
            return Err(KvQuantError::ShapeMismatch {
                what: "rows to write",
                found: rows.len(),
                expected: rows.len().div_ceil(ch) * ch,
            });
        }
        let n = rows.len() / ch;
        // Range errors before the work of quantizing.
        if start.checked_add(n).is_none_or(|e| e > self.tokens) || n == 0 {
            return Err(KvQuantError::RowRange {
                start,
                end: start.saturating_add(n),
                tokens: self.tokens,
            });
        }
        let fresh = KvStore::quantize_with(self.form, rows, n, ch, options)?;
        self.copy_rows_from(start, &fresh)
    }

    /// Copies every row of `src` (a store of the same row-local form and
    /// width, typically just quantized) into tokens `start..start +
    /// src.tokens()`: [`write_rows`](Self::write_rows) split in its fallible
    /// half (quantizing) and this infallible-once-checked half, so a caller
    /// can quantize several rows before changing any store.
    pub fn copy_rows_from(&mut self, start: usize, src: &KvStore) -> Result<()> {
        if src.form != self.form || src.channels != self.channels || !self.form.is_row_local() {
            return Err(KvQuantError::StoreMismatch(format!(
                "rows of {} ×{} into {} ×{} (row-local forms only)",
                src.form, src.channels, self.form, self.channels
            )));
        }
        let n = src.tokens;
        let end = start.checked_add(n).filter(|&e| e <= self.tokens && n > 0);
        let Some(end) = end else {
            return Err(KvQuantError::RowRange {
                start,
                end: start.saturating_add(n),
                tokens: self.tokens,
            });
        };
        let rb = self.row_bytes;
        self.data[start * rb..end * rb].copy_from_slice(&src.data);
        if let Some(layout) = &self.layout {
            // Row-local: the groups of these rows are contiguous and are
            // exactly the source's groups, in order.
            let groups = layout.groups_of_rows(start, end);
            let width = self.scale_type().bytes();
            let bytes = groups.start * width..groups.end * width;
            self.scales[bytes.clone()].copy_from_slice(&src.scales);
            if !self.offsets.is_empty() {
                self.offsets[bytes].copy_from_slice(&src.offsets);
            }
            if !self.checks.is_empty() {
                let (total, g) = (layout.groups(), groups.len());
                self.checks[groups.clone()].copy_from_slice(&src.checks[..g]);
                if !self.offsets.is_empty() {
                    self.checks[total + groups.start..total + groups.end]
                        .copy_from_slice(&src.checks[g..]);
                }
            }
        }
        Ok(())
    }

    /// Scrubs the store: decodes every value codeword and every protected
    /// metadata word, rewrites the corrected ones with their corrected
    /// contents, and leaves detected-uncorrectable ones exactly as they are
    /// (rewriting those would turn a detectable error into a silent one).
    /// Returns what was found (`corrected` = words rewritten); unprotected
    /// forms hold nothing to scrub and return zero counts.
    pub fn scrub(&mut self) -> Result<ScrubStats> {
        let mut stats = ScrubStats::default();
        let Some(protection) = self.form.protection() else {
            return Ok(stats);
        };
        let codec = protection.code.codec();
        let (rb, ch) = (self.row_bytes, self.channels);
        if rb > 0 {
            for row in self.data.chunks_exact_mut(rb) {
                stats.values += codec.scrub(row, ch)?;
            }
        }
        if let (Some(code), Some(layout)) = (self.meta_code(), self.layout) {
            let width = self.scale_type().bytes();
            let total = layout.groups();
            let buffers = [(0, &mut self.scales), (total, &mut self.offsets)];
            for (base, buffer) in buffers {
                for (g, word) in buffer.chunks_exact_mut(width).enumerate() {
                    let check = &mut self.checks[base + g];
                    let (fixed, outcome) = code.decode(read_word(word), *check);
                    stats.metadata.record(outcome);
                    if outcome == DecodeOutcome::Corrected {
                        word.copy_from_slice(&fixed.to_le_bytes()[..width]);
                        *check = code.check(fixed);
                    }
                }
            }
        }
        Ok(stats)
    }
}

/// What one [`KvStore::scrub`] pass found.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct ScrubStats {
    /// Value codewords: `corrected` were rewritten, `detected` left as found.
    pub values: DecodeStats,
    /// Metadata words (scales and offsets), counted the same way.
    pub metadata: DecodeStats,
}

impl std::ops::AddAssign for ScrubStats {
    fn add_assign(&mut self, rhs: Self) {
        self.values += rhs.values;
        self.metadata += rhs.metadata;
    }
}

#[cfg(test)]
mod tests {
    use gf2_codes::channel::BinarySymmetric;

    use super::*;
    use crate::store::FaultTarget;

    fn data(tokens: usize, channels: usize, seed: u32) -> Vec<f32> {
        (0..tokens * channels)
            .map(|i| ((i as u32).wrapping_mul(2_654_435_761) ^ seed) as f32 / u32::MAX as f32 - 0.5)
            .map(|x| x * 6.0)
            .collect()
    }

    #[test]
    fn rows_written_one_at_a_time_equal_a_whole_quantization() {
        for spelling in [
            "fp32",
            "fp16",
            "bf16",
            "fp8-e4m3-tok",
            "fp8-e5m2-h16-tok",
            "int8",
            "int4-g16",
            "int4-sym-g24-sf32",
            "int3",
            "int2-g8",
            "int4-ch1",
            "nf4-g16",
            "int4+secded84",
            "int4-g16+hamming74",
            "int4-g24+golay24+interp",
            "nf4-g16+secded84+meta-none",
        ] {
            let form: CacheForm = spelling.parse().unwrap();
            assert!(form.is_row_local(), "{spelling}");
            let (tokens, channels) = (7, 48);
            let values = data(tokens, channels, 3);
            let whole = KvStore::quantize(form, &values, tokens, channels).unwrap();
            let mut rows = KvStore::zeroed(form, tokens, channels).unwrap();
            // Out of order, one and two rows at a time.
            for (start, n) in [(3, 2), (0, 1), (6, 1), (1, 2), (5, 1)] {
                rows.write_rows(
                    start,
                    &values[start * channels..(start + n) * channels],
                    QuantizeOptions::default(),
                )
                .unwrap();
            }
            assert_eq!(rows, whole, "{spelling}");
        }
    }

    #[test]
    fn writes_outside_the_store_or_into_shared_scales_are_refused() {
        let form: CacheForm = "int4-g16".parse().unwrap();
        let mut store = KvStore::zeroed(form, 4, 32).unwrap();
        let row = vec![0.5; 32];
        let opts = QuantizeOptions::default();
        assert!(matches!(
            store.write_rows(4, &row, opts),
            Err(KvQuantError::RowRange { .. })
        ));
        assert!(matches!(
            store.write_rows(0, &row[..31], opts),
            Err(KvQuantError::ShapeMismatch { .. })
        ));
        assert!(matches!(
            store.write_rows(0, &[], opts),
            Err(KvQuantError::RowRange { .. })
        ));
        assert!(matches!(
            store.write_rows(0, &[f32::NAN; 32], opts),
            Err(KvQuantError::NonFinite { .. })
        ));
        let other = KvStore::quantize("int4-g32".parse().unwrap(), &row, 1, 32).unwrap();
        assert!(matches!(
            store.copy_rows_from(0, &other),
            Err(KvQuantError::StoreMismatch(_))
        ));
        let wide = KvStore::quantize(form, &[0.5; 48], 1, 48).unwrap();
        assert!(store.copy_rows_from(0, &wide).is_err());
        for shared in ["fp8-e4m3", "int4-ch", "int4-t", "int8-ch4"] {
            let form: CacheForm = shared.parse().unwrap();
            assert!(!form.is_row_local());
            let mut store = KvStore::zeroed(form, 4, 32).unwrap();
            assert!(matches!(
                store.write_rows(0, &row, opts),
                Err(KvQuantError::InvalidParameter { name: "form", .. })
            ));
        }
    }

    #[test]
    fn scrubbing_restores_single_flips_and_leaves_double_flips_detected() {
        for spelling in [
            "int4-g16+secded84",
            "int4-g16+hamming74",
            "int4-g16+golay24",
        ] {
            let form: CacheForm = spelling.parse().unwrap();
            let values = data(64, 64, 9);
            let clean = KvStore::quantize(form, &values, 64, 64).unwrap();
            let mut store = clean.clone();
            let injection = store.inject(
                &BinarySymmetric::new(2e-3).unwrap(),
                5,
                FaultTarget::Everything,
            );
            assert!(injection.total() > 10, "{spelling}: {}", injection.total());
            let first = store.scrub().unwrap();
            let second = store.scrub().unwrap();
            // A second pass finds nothing left to correct.
            assert_eq!(
                second.values.corrected + second.metadata.corrected,
                0,
                "{spelling}"
            );
            assert_eq!(second.values.detected, first.values.detected, "{spelling}");
            if first.values.detected == 0 && first.metadata.detected == 0 {
                // Everything was correctable: the bytes are the clean ones again
                // (Hamming(7,4) may miscorrect a double flip, so compare decodes).
                let now = store.decode_with_truth(&clean).unwrap();
                assert_eq!(
                    now.stats.values.silent + now.stats.values.miscorrected,
                    0,
                    "{spelling}"
                );
            }
            assert!(first.values.corrected > 0, "{spelling}");
        }
        // An unprotected form has nothing to scrub.
        let mut plain = KvStore::zeroed("int4".parse().unwrap(), 2, 8).unwrap();
        assert_eq!(plain.scrub().unwrap(), ScrubStats::default());
    }
}
