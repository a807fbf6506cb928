//! In-place changes of a [`KvStore`]: writing token rows one at a time (what
//! a paged cache does on every appended token) and scrubbing (decoding every
//! codeword and rewriting the corrected ones, so that a single flip is
//! cleaned before a second one lands in the same word).

use std::sync::Arc;

use gf2_codes::{DecodeOutcome, DecodeStats};

use super::bits::read_word;
use super::bound::ParamBound;
use super::encode::{RowBuffers, RowBuffersMut, RowEncoder};
use super::ledger::Buffer;
use super::section::Section;
use super::{KvStore, QuantizeOptions};
use crate::error::{KvQuantError, Result};
use crate::spec::CacheForm;
use crate::vq::VqCodebook;

impl KvStore {
    /// A store of `tokens × channels` zeros in `form` (every row decodes to 0.0).
    pub fn zeroed(form: CacheForm, tokens: usize, channels: usize) -> Result<Self> {
        Self::zeroed_with(form, tokens, channels, None)
    }

    /// [`zeroed`](Self::zeroed) for forms that need a codebook (`vq`).
    pub fn zeroed_with(
        form: CacheForm,
        tokens: usize,
        channels: usize,
        codebook: Option<Arc<VqCodebook>>,
    ) -> Result<Self> {
        let len = tokens
            .checked_mul(channels)
            .ok_or_else(|| KvQuantError::InvalidParameter {
                name: "shape",
                reason: format!("{tokens} × {channels} overflows"),
            })?;
        let zeros = vec![0.0; len];
        match codebook {
            Some(cb) => Self::quantize_with_codebook(
                form,
                &zeros,
                tokens,
                channels,
                QuantizeOptions::default(),
                cb,
            ),
            None => Self::quantize(form, &zeros, tokens, channels),
        }
    }

    /// An encoder for this store's rows (row-local forms only), for
    /// [`write_rows_with`](Self::write_rows_with).
    pub fn row_encoder(&self) -> Result<RowEncoder> {
        RowEncoder::new(self.form, self.channels, self.codebook().cloned())
    }

    /// Quantizes `rows` (`n × channels`, row-major) into tokens
    /// `start..start + n`, leaving every other token as it was. The bytes
    /// written equal those of the same rows of [`KvStore::quantize_with`] over
    /// the whole matrix, so a store filled row by row is byte-identical to one
    /// quantized at once. Overwriting a row also replaces any faults it held.
    ///
    /// Only [row-local](CacheForm::is_row_local) forms can do this; others
    /// share scales across tokens and get [`KvQuantError::InvalidParameter`].
    /// This convenience builds an encoder per call; a writer of many rows
    /// keeps one and calls [`write_rows_with`](Self::write_rows_with), which
    /// does not allocate.
    pub fn write_rows(
        &mut self,
        start: usize,
        rows: &[f32],
        options: QuantizeOptions,
    ) -> Result<()> {
        let mut encoder = self.row_encoder()?;
        self.write_rows_with(&mut encoder, start, rows, options)
    }

    /// [`write_rows`](Self::write_rows) with a caller-kept encoder of this
    /// store's form and width: no allocation once the encoder has grown. Bad
    /// shapes, ranges and non-finite input (under
    /// [`NonFinite::Reject`](super::NonFinite::Reject)) change nothing; a
    /// value beyond the scale type fails its row, leaving it and the rows
    /// after it as they were and the rows before it written.
    pub fn write_rows_with(
        &mut self,
        encoder: &mut RowEncoder,
        start: usize,
        rows: &[f32],
        options: QuantizeOptions,
    ) -> Result<()> {
        if encoder.form() != &self.form || encoder.buffer_sizes(1).data != self.middle.row_bytes {
            return Err(KvQuantError::StoreMismatch(format!(
                "an encoder of {} rows of {} bytes for a store of {} rows of {} bytes",
                encoder.form(),
                encoder.row_bytes(),
                self.form,
                self.middle.row_bytes
            )));
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
        let end = start.checked_add(n).filter(|&e| e <= self.tokens && n > 0);
        let Some(end) = end else {
            return Err(KvQuantError::RowRange {
                start,
                end: start.saturating_add(n),
                tokens: self.tokens,
            });
        };
        if options.non_finite == super::NonFinite::Reject
            && let Some(i) = rows.iter().position(|x| !x.is_finite())
        {
            return Err(KvQuantError::NonFinite {
                token: start + i / ch,
                channel: i % ch,
                value: rows[i],
            });
        }
        if self.middle.ledger_touches_rows(start..end) {
            // Rows holding faults: one row at a time, so the ledger forgets
            // exactly the rows written even when a later row fails.
            for (t, row) in (start..end).zip(rows.chunks_exact(ch)) {
                let written =
                    encoder.encode_into(row, row_buffers(&mut self.middle, t, t + 1), options);
                self.middle.bound.widen(encoder.written());
                written?;
                self.middle.forget_rows(t..t + 1);
            }
            return Ok(());
        }
        let out = row_buffers(&mut self.middle, start, end);
        let written = encoder.encode_into(rows, out, options);
        self.middle.bound.widen(encoder.written());
        written
    }

    /// Copies rows encoded by a [`RowEncoder`] of this store's form and width
    /// (`rows`, sized by its [`buffer_sizes`](RowEncoder::buffer_sizes) of
    /// `n` rows) into tokens `start..start + n`: the committing half of an
    /// encode-then-commit write, which cannot fail once the sizes match and
    /// does not allocate. Overwriting a row also replaces any faults it held.
    pub fn put_encoded_rows(&mut self, start: usize, rows: &RowBuffers) -> Result<()> {
        let rb = self.middle.row_bytes;
        if !self.form.is_row_local() || rb == 0 || !rows.data.len().is_multiple_of(rb) {
            return Err(KvQuantError::StoreMismatch(format!(
                "{} row bytes for a store of {} rows of {rb} bytes",
                rows.data.len(),
                self.form
            )));
        }
        let n = rows.data.len() / rb;
        let end = start.checked_add(n).filter(|&e| e <= self.tokens && n > 0);
        let Some(end) = end else {
            return Err(KvQuantError::RowRange {
                start,
                end: start.saturating_add(n),
                tokens: self.tokens,
            });
        };
        let out = row_buffers(&mut self.middle, start, end);
        let pairs = [
            (out.data, &rows.data),
            (out.scales, &rows.scales),
            (out.offsets, &rows.offsets),
            (out.scale_checks, &rows.scale_checks),
            (out.offset_checks, &rows.offset_checks),
        ];
        if let Some((dst, src)) = pairs.iter().find(|(d, s)| d.len() != s.len()) {
            return Err(KvQuantError::StoreMismatch(format!(
                "encoded buffers of {} bytes where the store's rows hold {}",
                src.len(),
                dst.len()
            )));
        }
        for (dst, src) in pairs {
            dst.copy_from_slice(src);
        }
        if self.middle.coding.meta_code().is_some() {
            let ty = self.middle.coding.scale_type();
            let written = ParamBound::of_words(ty, &rows.scales, &rows.offsets);
            self.middle.bound.widen(written);
        }
        self.middle.forget_rows(start..end);
        Ok(())
    }

    /// Copies every row of `src` (a store of the same form and
    /// width, typically just quantized) into tokens `start..start +
    /// src.tokens()` (whole [row units](CacheForm::row_unit): a per-channel
    /// store over blocks of `T` tokens takes whole blocks): [`write_rows`](Self::write_rows) split in its fallible
    /// half (quantizing) and this infallible-once-checked half, so a caller
    /// can quantize several rows before changing any store.
    pub fn copy_rows_from(&mut self, start: usize, src: &KvStore) -> Result<()> {
        if src.form != self.form || src.channels != self.channels || self.form.row_unit().is_none()
        {
            return Err(KvQuantError::StoreMismatch(format!(
                "rows of {} ×{} into {} ×{} (forms with a row unit only)",
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
        self.check_row_range(&(start..end))?;
        let (m, s) = (&mut self.middle, &src.middle);
        let rb = m.row_bytes;
        m.data[start * rb..end * rb].copy_from_slice(&s.data);
        if let Some(layout) = &m.layout {
            // Whole row units: the groups of these rows are contiguous and
            // are exactly the source's groups, in order.
            let groups = layout.groups_of_rows(start, end);
            let width = m.coding.scale_type().bytes();
            let bytes = groups.start * width..groups.end * width;
            m.scales[bytes.clone()].copy_from_slice(&s.scales);
            if !m.offsets.is_empty() {
                m.offsets[bytes].copy_from_slice(&s.offsets);
            }
            if !m.checks.is_empty() {
                let (total, g) = (layout.groups(), groups.len());
                let cb = m.coding.check_bytes();
                m.checks[groups.start * cb..groups.end * cb].copy_from_slice(&s.checks[..g * cb]);
                if !m.offsets.is_empty() {
                    m.checks[(total + groups.start) * cb..(total + groups.end) * cb]
                        .copy_from_slice(&s.checks[g * cb..]);
                }
            }
        }
        // The rows' faults are now the source's, and so is what was written.
        m.bound.widen(s.bound);
        m.forget_rows(start..end);
        m.record(&s.ledger_rows(0..n), start..end);
        Ok(())
    }

    /// A store of this store's rows followed by `next`'s (the same
    /// row-local form, width and codebook): what a stream grows by, with
    /// the rows already stored copied, not encoded again. Its bytes equal
    /// those of quantizing both stores' rows at once; faults and their
    /// ledger come along with the rows.
    pub fn concat(&self, next: &KvStore) -> Result<KvStore> {
        if next.form != self.form || next.channels != self.channels || !self.form.is_row_local() {
            return Err(KvQuantError::StoreMismatch(format!(
                "rows of {} ×{} after {} ×{} (row-local forms only)",
                next.form, next.channels, self.form, self.channels
            )));
        }
        let same_codebook = match (self.codebook(), next.codebook()) {
            (Some(a), Some(b)) => Arc::ptr_eq(a, b),
            (a, b) => a.is_none() && b.is_none(),
        };
        if !same_codebook {
            return Err(KvQuantError::StoreMismatch(format!(
                "rows of {} encoded against another codebook",
                next.form
            )));
        }
        let tokens =
            self.tokens
                .checked_add(next.tokens)
                .ok_or_else(|| KvQuantError::InvalidParameter {
                    name: "tokens",
                    reason: format!("{} + {} rows overflow", self.tokens, next.tokens),
                })?;
        let middle = Section::empty(
            self.middle.coding,
            tokens,
            self.channels,
            self.codebook().cloned(),
        )?;
        let mut out = KvStore {
            form: self.form,
            tokens,
            channels: self.channels,
            middle,
            exact: None,
            injected: self.injected + next.injected,
        };
        for (start, part) in [(0, self), (self.tokens, next)] {
            if part.tokens > 0 {
                out.copy_rows_from(start, part)?;
            }
        }
        Ok(out)
    }

    /// Scrubs the store: decodes every value codeword (exact rows included)
    /// and every protected metadata word, rewrites the corrected ones with
    /// their corrected contents, and leaves detected-uncorrectable ones
    /// exactly as they are (rewriting those would turn a detectable error
    /// into a silent one). Returns what was found (`corrected` = words
    /// rewritten); unprotected forms hold nothing to scrub and return zero counts.
    pub fn scrub(&mut self) -> Result<ScrubStats> {
        let mut stats = scrub_whole(&mut self.middle)?;
        if let Some(exact) = &mut self.exact {
            stats += scrub_whole(&mut exact.section)?;
        }
        Ok(stats)
    }
}

/// The buffers of rows `start..end` of a row-local section.
fn row_buffers(m: &mut Section, start: usize, end: usize) -> RowBuffersMut<'_> {
    let rb = m.row_bytes;
    let (groups, total) = match &m.layout {
        Some(l) => (l.groups_of_rows(start, end), l.groups()),
        None => (0..0, 0),
    };
    let width = m.coding.scale_type().bytes();
    let bytes = groups.start * width..groups.end * width;
    let offsets: &mut [u8] = if m.offsets.is_empty() {
        &mut []
    } else {
        &mut m.offsets[bytes.clone()]
    };
    let (scale_checks, offset_checks): (&mut [u8], &mut [u8]) = if m.checks.is_empty() {
        (&mut [], &mut [])
    } else {
        let cb = m.coding.check_bytes();
        let at = groups.start * cb..groups.end * cb;
        let (s, o) = m.checks.split_at_mut(total * cb);
        let o: &mut [u8] = if o.is_empty() {
            &mut []
        } else {
            &mut o[at.clone()]
        };
        (&mut s[at], o)
    };
    RowBuffersMut {
        data: &mut m.data[start * rb..end * rb],
        scales: &mut m.scales[bytes],
        offsets,
        scale_checks,
        offset_checks,
    }
}

/// Scrubs the codewords of `rows` and the metadata words of `groups`.
pub(super) fn scrub_section(
    m: &mut Section,
    rows: std::ops::Range<usize>,
    groups: std::ops::Range<usize>,
) -> Result<ScrubStats> {
    let mut stats = ScrubStats::default();
    let Some(codec) = m.coding.codec() else {
        return Ok(stats);
    };
    let (rb, nibbles) = (m.row_bytes, m.coding.nibbles(m.channels));
    let mut before = Vec::new();
    if rb > 0 {
        for r in rows.clone() {
            let bytes = r * rb..(r + 1) * rb;
            // A row the ledger has no fault in is as written: a scrub
            // changes nothing there. Elsewhere, the ledger follows the rewrite.
            let faulted = m
                .ledger
                .as_deref()
                .is_some_and(|l| l.touches(Buffer::Values, bytes.clone()));
            let row = &mut m.data[bytes.clone()];
            if faulted {
                before.clear();
                before.extend_from_slice(row);
            }
            stats.values += codec.scrub(row, nibbles)?;
            if faulted && let Some(l) = m.ledger.as_deref_mut() {
                l.toggle_changes(Buffer::Values, bytes.start, &before, row);
            }
        }
    }
    if let (Some(code), Some(layout)) = (m.coding.meta_code(), m.layout) {
        let width = m.coding.scale_type().bytes();
        let total = layout.groups();
        let bytes = groups.start * width..groups.end * width;
        let buffers: [(usize, &mut [u8]); 2] = [
            (total, &mut m.scales[bytes.clone()]),
            (total, {
                if m.offsets.is_empty() {
                    &mut []
                } else {
                    &mut m.offsets[bytes]
                }
            }),
        ];
        for (i, (total, buffer)) in buffers.into_iter().enumerate() {
            let base = i * total + groups.start;
            let kind = [Buffer::Scales, Buffer::Offsets][i];
            let cb = code.check_bytes();
            for (g, word) in buffer.chunks_exact_mut(width).enumerate() {
                let check = &mut m.checks[(base + g) * cb..][..cb];
                let (fixed, outcome) = code.decode(read_word(word), read_word(check));
                stats.metadata.record(outcome);
                if outcome == DecodeOutcome::Corrected {
                    let (old_word, old_check) = (read_word(word), read_word(check));
                    word.copy_from_slice(&fixed.to_le_bytes()[..width]);
                    check.copy_from_slice(&code.check(fixed).to_le_bytes()[..cb]);
                    if let Some(l) = m.ledger.as_deref_mut() {
                        let at = (groups.start + g) * width;
                        l.toggle_changes(kind, at, &old_word.to_le_bytes()[..width], word);
                        let old_check = &old_check.to_le_bytes()[..cb];
                        l.toggle_changes(Buffer::Checks, (base + g) * cb, old_check, check);
                    }
                }
            }
        }
    }
    Ok(stats)
}

/// Scrubs every row and group of a section.
fn scrub_whole(m: &mut Section) -> Result<ScrubStats> {
    let rows = m.data.len().checked_div(m.row_bytes).unwrap_or(0);
    let groups = m.layout.map_or(0, |l| l.groups());
    scrub_section(m, 0..rows, 0..groups)
}

/// What one [`KvStore::scrub`] pass found.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct ScrubStats {
    /// Value codewords: `corrected` were rewritten, `detected` left as found.
    pub values: DecodeStats,
    /// Metadata words (scales and offsets), counted the same way.
    pub metadata: DecodeStats,
    /// Words of fitted tables (codebooks, bases: a
    /// [`ProtectedTable`](crate::ProtectedTable)), counted the same way.
    pub tables: DecodeStats,
}

impl std::ops::AddAssign for ScrubStats {
    fn add_assign(&mut self, rhs: Self) {
        self.values += rhs.values;
        self.metadata += rhs.metadata;
        self.tables += rhs.tables;
    }
}

#[cfg(test)]
mod tests;
