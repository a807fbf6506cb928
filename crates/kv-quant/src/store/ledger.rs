//! The fault ledger of a section: every bit where a buffer differs from what
//! the encoder wrote, and the truth it gives a decode.
//!
//! A fault channel returns exactly the bits it flipped ([`Flips`]); the
//! section records them here (a bit flipped twice is back to what was
//! written, so recording toggles). Writing rows clears their bits; a
//! scrubber's rewrite toggles the bits it changed. So the word the encoder
//! wrote is always `received XOR ledger`, and a decode learns whether each
//! word it returned is right without a fault-free copy of the store: a word
//! with no ledger bit is right, and a word with some is decoded twice, as
//! received and as written, and compared. The decode itself (the fused tile
//! kernels included) runs on the received bytes alone, exactly as without
//! faults; [`Section::ledger_truth`] then moves the words it got wrong from
//! `clean` to `silent` and from `corrected` to `miscorrected`.

use std::ops::Range;

use gf2_codes::batch::{Backend, erasure_words};
use gf2_codes::channel::Flips;
use gf2_codes::{DecodeOutcome, DecodeStats};

use super::KvDecodeStats;
use super::bits::read_word;
use super::decode::{DecodeScratch, grow};
use super::inject::Injection;
use super::section::Section;
use crate::error::Result;

/// One buffer of a section.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Buffer {
    Values,
    Scales,
    Offsets,
    Checks,
}

/// Bits that differ from what was written, per buffer (`8·byte + bit`, ascending).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct FaultLedger {
    values: Vec<u64>,
    scales: Vec<u64>,
    offsets: Vec<u64>,
    checks: Vec<u64>,
}

impl FaultLedger {
    fn bits(&self, buffer: Buffer) -> &Vec<u64> {
        match buffer {
            Buffer::Values => &self.values,
            Buffer::Scales => &self.scales,
            Buffer::Offsets => &self.offsets,
            Buffer::Checks => &self.checks,
        }
    }

    fn bits_mut(&mut self, buffer: Buffer) -> &mut Vec<u64> {
        match buffer {
            Buffer::Values => &mut self.values,
            Buffer::Scales => &mut self.scales,
            Buffer::Offsets => &mut self.offsets,
            Buffer::Checks => &mut self.checks,
        }
    }

    /// Whether every buffer holds what was written.
    pub(crate) fn is_empty(&self) -> bool {
        self.values.is_empty()
            && self.scales.is_empty()
            && self.offsets.is_empty()
            && self.checks.is_empty()
    }

    /// Records flips at `positions` (ascending, distinct) shifted by `base`
    /// bits: a recorded bit flipped again is back to what was written.
    pub(crate) fn toggle(&mut self, buffer: Buffer, base: u64, positions: &[u64]) {
        if positions.is_empty() {
            return;
        }
        let old = std::mem::take(self.bits_mut(buffer));
        let mut merged = Vec::with_capacity(old.len() + positions.len());
        let (mut a, mut b) = (
            old.iter().copied().peekable(),
            positions.iter().map(|p| base + p),
        );
        let mut next_b = b.next();
        loop {
            match (a.peek().copied(), next_b) {
                (Some(x), Some(y)) if x == y => {
                    a.next();
                    next_b = b.next();
                }
                (Some(x), Some(y)) if x < y => {
                    merged.push(x);
                    a.next();
                }
                (_, Some(y)) => {
                    merged.push(y);
                    next_b = b.next();
                }
                (Some(x), None) => {
                    merged.push(x);
                    a.next();
                }
                (None, None) => break,
            }
        }
        *self.bits_mut(buffer) = merged;
    }

    /// Records the bits where `before` and `after` (bytes starting at byte
    /// `base_byte` of the buffer) differ: a rewrite by a scrubber.
    pub(crate) fn toggle_changes(
        &mut self,
        buffer: Buffer,
        base_byte: usize,
        before: &[u8],
        after: &[u8],
    ) {
        let mut changed = Vec::new();
        for (i, (x, y)) in before.iter().zip(after).enumerate() {
            let mut d = x ^ y;
            while d != 0 {
                changed.push(8 * i as u64 + u64::from(d.trailing_zeros()));
                d &= d - 1;
            }
        }
        self.toggle(buffer, 8 * base_byte as u64, &changed);
    }

    /// Forgets the bits of bytes `bytes` (they were written anew).
    pub(crate) fn clear(&mut self, buffer: Buffer, bytes: Range<usize>) {
        let bits = self.bits_mut(buffer);
        if bits.is_empty() {
            return;
        }
        let r = Self::span(bits, bytes);
        bits.drain(r);
    }

    /// The recorded bits of bytes `bytes`, as offsets from the first of them.
    pub(crate) fn of_bytes(&self, buffer: Buffer, bytes: Range<usize>) -> Vec<u64> {
        let bits = self.bits(buffer);
        let base = 8 * bytes.start as u64;
        bits[Self::span(bits, bytes)]
            .iter()
            .map(|b| b - base)
            .collect()
    }

    /// Whether any bit of bytes `bytes` is recorded.
    pub(crate) fn touches(&self, buffer: Buffer, bytes: Range<usize>) -> bool {
        let bits = self.bits(buffer);
        !bits.is_empty() && !Self::span(bits, bytes).is_empty()
    }

    /// XORs the recorded bits of bytes `bytes` into `out` (a copy of those
    /// bytes as received), giving them as written.
    fn restore(&self, buffer: Buffer, bytes: Range<usize>, out: &mut [u8]) {
        let bits = self.bits(buffer);
        let base = 8 * bytes.start as u64;
        for &b in &bits[Self::span(bits, bytes)] {
            let b = b - base;
            out[(b / 8) as usize] ^= 1 << (b % 8);
        }
    }

    /// Indices into `bits` of the bits inside bytes `bytes`.
    fn span(bits: &[u64], bytes: Range<usize>) -> Range<usize> {
        let (lo, hi) = (8 * bytes.start as u64, 8 * bytes.end as u64);
        bits.partition_point(|&b| b < lo)..bits.partition_point(|&b| b < hi)
    }
}

/// Words a decode returned wrong without knowing it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Wrong {
    /// Decoded as clean, data changed.
    silent: u64,
    /// Decoded as corrected, to the wrong data.
    miscorrected: u64,
}

impl Wrong {
    fn count(&mut self, outcome: DecodeOutcome, right: bool) {
        match (outcome, right) {
            (DecodeOutcome::Clean, false) => self.silent += 1,
            (DecodeOutcome::Corrected, false) => self.miscorrected += 1,
            _ => {}
        }
    }

    /// Moves the wrong words out of `clean` and `corrected`.
    fn apply(self, stats: &mut DecodeStats) {
        stats.clean -= self.silent;
        stats.silent += self.silent;
        stats.corrected -= self.miscorrected;
        stats.miscorrected += self.miscorrected;
    }
}

/// Byte ranges of rows `rows` of a section: value bytes, metadata bytes
/// (the same in scales and offsets), their groups and the section's group count.
fn row_span(m: &Section, rows: &Range<usize>) -> (Range<usize>, Range<usize>, Range<usize>, usize) {
    let (groups, total) = match &m.layout {
        Some(l) => (l.groups_of_rows(rows.start, rows.end), l.groups()),
        None => (0..0, 0),
    };
    let (rb, width) = (m.row_bytes, m.coding.scale_type().bytes());
    (
        rows.start * rb..rows.end * rb,
        groups.start * width..groups.end * width,
        groups,
        total,
    )
}

impl Section {
    /// Records `injection`, made into the buffers of rows `rows` (value
    /// flips counted from the rows' first byte, scale and offset flips from
    /// their first group's, check flips over the rows' scale checks, then
    /// their offset checks), in the ledger.
    pub(crate) fn record(&mut self, injection: &Injection, rows: Range<usize>) {
        let own = injection.values.len()
            + injection.scales.len()
            + injection.offsets.len()
            + injection.checks.len();
        if own == 0 {
            return;
        }
        let (data, meta, groups, total) = row_span(self, &rows);
        let cb = self.coding.check_bytes() as u64;
        let g = groups.len() as u64 * cb;
        let ledger = self.ledger_mut();
        ledger.toggle(
            Buffer::Values,
            8 * data.start as u64,
            injection.values.positions(),
        );
        ledger.toggle(
            Buffer::Scales,
            8 * meta.start as u64,
            injection.scales.positions(),
        );
        ledger.toggle(
            Buffer::Offsets,
            8 * meta.start as u64,
            injection.offsets.positions(),
        );
        let checks = injection.checks.positions();
        let split = checks.partition_point(|&b| b < 8 * g);
        ledger.toggle(
            Buffer::Checks,
            8 * groups.start as u64 * cb,
            &checks[..split],
        );
        let offset_checks: Vec<u64> = checks[split..].iter().map(|b| b - 8 * g).collect();
        ledger.toggle(
            Buffer::Checks,
            8 * (total + groups.start) as u64 * cb,
            &offset_checks,
        );
    }

    /// The ledger of rows `rows`, in the coordinates [`record`](Self::record) takes.
    pub(crate) fn ledger_rows(&self, rows: Range<usize>) -> Injection {
        let Some(ledger) = self.ledger.as_deref().filter(|l| !l.is_empty()) else {
            return Injection::default();
        };
        let (data, meta, groups, total) = row_span(self, &rows);
        let [scale_checks, offset_checks] = self.check_spans(&groups, total);
        let g = 8 * scale_checks.len() as u64;
        let mut checks = ledger.of_bytes(Buffer::Checks, scale_checks);
        checks.extend(
            ledger
                .of_bytes(Buffer::Checks, offset_checks)
                .into_iter()
                .map(|b| b + g),
        );
        Injection {
            values: Flips::from_events(ledger.of_bytes(Buffer::Values, data)),
            scales: Flips::from_events(ledger.of_bytes(Buffer::Scales, meta.clone())),
            offsets: Flips::from_events(ledger.of_bytes(Buffer::Offsets, meta)),
            checks: Flips::from_events(checks),
            exact: Flips::default(),
            tables: Flips::default(),
        }
    }

    /// Forgets the faults of rows `rows` (they were written anew).
    pub(crate) fn forget_rows(&mut self, rows: Range<usize>) {
        if self.ledger.as_deref().is_none_or(FaultLedger::is_empty) {
            return;
        }
        let (data, meta, groups, total) = row_span(self, &rows);
        let [scale_checks, offset_checks] = self.check_spans(&groups, total);
        let ledger = self.ledger_mut();
        ledger.clear(Buffer::Values, data);
        ledger.clear(Buffer::Scales, meta.clone());
        ledger.clear(Buffer::Offsets, meta);
        ledger.clear(Buffer::Checks, scale_checks);
        ledger.clear(Buffer::Checks, offset_checks);
    }

    /// Whether any fault of rows `rows` is recorded.
    pub(crate) fn ledger_touches_rows(&self, rows: Range<usize>) -> bool {
        let Some(ledger) = self.ledger.as_deref().filter(|l| !l.is_empty()) else {
            return false;
        };
        let (data, meta, groups, total) = row_span(self, &rows);
        let [scale_checks, offset_checks] = self.check_spans(&groups, total);
        ledger.touches(Buffer::Values, data)
            || ledger.touches(Buffer::Scales, meta.clone())
            || ledger.touches(Buffer::Offsets, meta)
            || ledger.touches(Buffer::Checks, scale_checks)
            || ledger.touches(Buffer::Checks, offset_checks)
    }

    /// The check bytes of the scales and of the offsets of `groups` (of
    /// `total` groups in all).
    fn check_spans(&self, groups: &Range<usize>, total: usize) -> [Range<usize>; 2] {
        let cb = self.coding.check_bytes();
        [
            groups.start * cb..groups.end * cb,
            (total + groups.start) * cb..(total + groups.end) * cb,
        ]
    }

    /// Corrects the statistics of a decode of rows `start..end` with the
    /// ledger: words decoded wrong move to `silent` or `miscorrected`. A
    /// no-op (and free) when the section holds what was written.
    pub(crate) fn ledger_truth(
        &self,
        start: usize,
        end: usize,
        stats: &mut KvDecodeStats,
        scratch: &mut DecodeScratch,
    ) -> Result<()> {
        let Some(ledger) = self.ledger.as_deref() else {
            return Ok(());
        };
        if ledger.is_empty() {
            return Ok(());
        }
        self.value_truth(ledger, start, end, scratch)?
            .apply(&mut stats.values);
        self.metadata_truth(ledger, start, end)
            .apply(&mut stats.metadata);
        Ok(())
    }

    /// Wrong value words of rows `start..end`.
    fn value_truth(
        &self,
        ledger: &FaultLedger,
        start: usize,
        end: usize,
        scratch: &mut DecodeScratch,
    ) -> Result<Wrong> {
        let (ch, rb) = (self.channels, self.row_bytes);
        let mut wrong = Wrong::default();
        let Some(codec) = self.coding.codec() else {
            // Unprotected: a word is wrong exactly when a flip hit its bits
            // (bits past the last word of a row are padding).
            let (word_bits, words) = match self.coding.kind.float_bytes() {
                Some(bytes) => (8 * bytes as u64, ch as u64),
                None => (
                    u64::from(self.coding.code_bits),
                    self.coding.codes(ch) as u64,
                ),
            };
            for r in start..end {
                let mut last = None;
                for bit in ledger.of_bytes(Buffer::Values, r * rb..(r + 1) * rb) {
                    let w = bit / word_bits;
                    if w < words && last != Some(w) {
                        wrong.silent += 1;
                        last = Some(w);
                    }
                }
            }
            return Ok(wrong);
        };
        // Coded: decode each faulted row as received against the same row
        // as written.
        let backend = Backend::detect();
        let n = self.coding.nibbles(ch);
        let nw = erasure_words(n);
        for r in start..end {
            let bytes = r * rb..(r + 1) * rb;
            if !ledger.touches(Buffer::Values, bytes.clone()) {
                continue;
            }
            let received = &self.data[bytes.clone()];
            let written = grow(&mut scratch.truth_row, rb);
            written.copy_from_slice(received);
            ledger.restore(Buffer::Values, bytes, written);
            let truth = grow(&mut scratch.truth_nibbles, n);
            let truth_erasures = grow(&mut scratch.truth_erasures, nw);
            codec.decode_into_with(backend, written, truth, truth_erasures)?;
            let nibbles = grow(&mut scratch.nibbles, n);
            let erasures = grow(&mut scratch.row_erasures, nw);
            let s =
                codec.decode_with_truth_into_with(backend, received, truth, nibbles, erasures)?;
            wrong.silent += s.silent;
            wrong.miscorrected += s.miscorrected;
        }
        Ok(wrong)
    }

    /// Wrong metadata words of the groups a decode of rows `start..end`
    /// counts (those whose first token is among them).
    fn metadata_truth(&self, ledger: &FaultLedger, start: usize, end: usize) -> Wrong {
        let mut wrong = Wrong::default();
        let Some(layout) = &self.layout else {
            return wrong;
        };
        let width = self.coding.scale_type().bytes();
        let total = layout.groups();
        let mut word = [0u8; 4];
        for g in layout.groups_of_rows(start, end) {
            if !(start..end).contains(&layout.first_token(g)) {
                continue;
            }
            let words = [(Buffer::Scales, &self.scales, g)].into_iter().chain(
                (!self.offsets.is_empty()).then_some((Buffer::Offsets, &self.offsets, total + g)),
            );
            for (buffer, bytes, check) in words {
                let at = g * width..(g + 1) * width;
                let cb = self.coding.check_bytes();
                let check_hit = !self.checks.is_empty()
                    && ledger.touches(Buffer::Checks, check * cb..(check + 1) * cb);
                if !ledger.touches(buffer, at.clone()) && !check_hit {
                    continue;
                }
                let (decoded, outcome) = self.meta_word(bytes, g, check);
                let written = &mut word[..width];
                written.copy_from_slice(&bytes[at.clone()]);
                ledger.restore(buffer, at, written);
                wrong.count(outcome, decoded == read_word(written));
            }
        }
        wrong
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn toggling_twice_forgets_and_ranges_select_bytes() {
        let mut l = FaultLedger::default();
        l.toggle(Buffer::Values, 0, &[3, 9, 17]);
        l.toggle(Buffer::Values, 8, &[1, 2]); // bits 9 (again) and 10
        assert_eq!(l.values, [3, 10, 17]);
        assert_eq!(l.of_bytes(Buffer::Values, 1..3), [2, 9]);
        assert!(l.touches(Buffer::Values, 2..3));
        assert!(!l.touches(Buffer::Values, 3..9));
        l.toggle_changes(Buffer::Values, 2, &[0b0000_0010], &[0b0000_0011]);
        assert_eq!(l.values, [3, 10, 16, 17]);
        l.clear(Buffer::Values, 1..3);
        assert_eq!(l.values, [3]);
        let mut bytes = [0u8; 1];
        l.restore(Buffer::Values, 0..1, &mut bytes);
        assert_eq!(bytes, [0b1000]);
        assert!(!l.is_empty());
        l.toggle(Buffer::Values, 0, &[3]);
        assert!(l.is_empty());
    }
}
