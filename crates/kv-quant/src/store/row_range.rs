//! Rows of a store treated as a unit of their own: a paged cache keeps one
//! store per layer and part across all its blocks, and a block is a row
//! range of it. Row-local forms allow any range; per-channel forms over
//! blocks of `T` tokens allow ranges of whole blocks (each owns its
//! groups' scales, [`CacheForm::row_unit`]). [`KvStore::rows_to_store`] copies a range out (swap,
//! snapshots), [`KvStore::scrub_rows`] scrubs it and
//! [`KvStore::inject_rows`] faults it, each touching only the range's bytes:
//! its rows, the scales and offsets of its groups and their check bytes.

use std::ops::Range;

use gf2_codes::channel::{FaultChannel, FaultRng};

use super::KvStore;
use super::inject::{FaultTarget, Injection};
use super::rows::{ScrubStats, scrub_section};
use super::section::Section;
use crate::error::{KvQuantError, Result};
#[cfg(doc)]
use crate::spec::CacheForm;

/// The byte ranges of rows `start..end` in each buffer of a row-local section.
struct RowBytes {
    data: Range<usize>,
    meta: Range<usize>,
    groups: Range<usize>,
    total_groups: usize,
}

fn row_bytes(m: &Section, start: usize, end: usize) -> RowBytes {
    let rb = m.row_bytes;
    let (groups, total_groups) = match &m.layout {
        Some(l) => (l.groups_of_rows(start, end), l.groups()),
        None => (0..0, 0),
    };
    let width = m.coding.scale_type().bytes();
    RowBytes {
        data: start * rb..end * rb,
        meta: groups.start * width..groups.end * width,
        groups,
        total_groups,
    }
}

impl KvStore {
    /// Checks a row range of a store whose rows form units
    /// ([`CacheForm::row_unit`]): in range, and starting and ending on a
    /// unit (or at the last row).
    pub(super) fn check_row_range(&self, rows: &Range<usize>) -> Result<()> {
        let Some(unit) = self.form.row_unit() else {
            return Err(KvQuantError::InvalidParameter {
                name: "form",
                reason: format!(
                    "{} shares parameters across all tokens: its rows are not a unit",
                    self.form
                ),
            });
        };
        if rows.start >= rows.end || rows.end > self.tokens {
            return Err(KvQuantError::RowRange {
                start: rows.start,
                end: rows.end,
                tokens: self.tokens,
            });
        }
        if !rows.start.is_multiple_of(unit)
            || !(rows.end.is_multiple_of(unit) || rows.end == self.tokens)
        {
            return Err(KvQuantError::InvalidParameter {
                name: "rows",
                reason: format!(
                    "rows {}..{} of {}: its groups span {unit} tokens, so a range must start \
                     and end on a group",
                    rows.start, rows.end, self.form
                ),
            });
        }
        Ok(())
    }

    /// Rows `start..start + count` as a store of their own, with the same
    /// bytes (faults included): the inverse of
    /// [`copy_rows_from`](Self::copy_rows_from). Forms with a
    /// [row unit](CacheForm::row_unit), ranges of whole units.
    pub fn rows_to_store(&self, start: usize, count: usize) -> Result<KvStore> {
        let rows = start..start.saturating_add(count);
        self.check_row_range(&rows)?;
        let mut out =
            KvStore::zeroed_with(self.form, count, self.channels, self.codebook().cloned())?;
        let src = row_bytes(&self.middle, rows.start, rows.end);
        let (m, s) = (&mut out.middle, &self.middle);
        m.data.copy_from_slice(&s.data[src.data]);
        m.scales.copy_from_slice(&s.scales[src.meta.clone()]);
        if !m.offsets.is_empty() {
            m.offsets.copy_from_slice(&s.offsets[src.meta]);
        }
        if !m.checks.is_empty() {
            let (g, cb) = (src.groups.len(), s.coding.check_bytes());
            let at = |w: Range<usize>| w.start * cb..w.end * cb;
            m.checks[..g * cb].copy_from_slice(&s.checks[at(src.groups.clone())]);
            if !m.offsets.is_empty() {
                let t = src.total_groups;
                m.checks[g * cb..]
                    .copy_from_slice(&s.checks[at(t + src.groups.start..t + src.groups.end)]);
            }
        }
        out.middle.bound = self.middle.bound;
        out.middle.record(&self.middle.ledger_rows(rows), 0..count);
        Ok(out)
    }

    /// [`scrub`](Self::scrub) restricted to rows `rows` (their codewords and
    /// their groups' metadata words). Ranges of whole row units only.
    pub fn scrub_rows(&mut self, rows: Range<usize>) -> Result<ScrubStats> {
        self.check_row_range(&rows)?;
        let groups = row_bytes(&self.middle, rows.start, rows.end).groups;
        scrub_section(&mut self.middle, rows, groups)
    }

    /// [`inject`](Self::inject) restricted to the bytes of rows `rows`: the
    /// rows' value bytes (stream 0 of `seed`), their groups' scales (1),
    /// offsets (2) and check bytes (3: scale checks, then offset checks).
    /// Flip positions count from the range's first byte in each buffer
    /// (the checks: scale checks, then offset checks, as one buffer).
    /// Ranges of whole row units only.
    pub fn inject_rows(
        &mut self,
        rows: Range<usize>,
        channel: &dyn FaultChannel,
        seed: u64,
        target: FaultTarget,
    ) -> Result<Injection> {
        self.check_row_range(&rows)?;
        let r = row_bytes(&self.middle, rows.start, rows.end);
        let hit = |buffer: &mut [u8], stream: u64| {
            channel.inject_with(buffer, &mut FaultRng::with_stream(seed, stream))
        };
        let m = &mut self.middle;
        let mut injection = Injection::default();
        if target != FaultTarget::Metadata {
            injection.values = hit(&mut m.data[r.data.clone()], 0);
        }
        if target != FaultTarget::Values {
            injection.scales = hit(&mut m.scales[r.meta.clone()], 1);
            if !m.offsets.is_empty() {
                injection.offsets = hit(&mut m.offsets[r.meta.clone()], 2);
            }
            if !m.checks.is_empty() {
                injection.checks = with_range_checks(m, &r, |checks| hit(checks, 3));
            }
        }
        self.middle.record(&injection, rows);
        self.injected += injection.total() as u64;
        Ok(injection)
    }
}

/// Runs `f` over the check bytes of the range `r` as one buffer (its scale
/// checks, then its offset checks: the coordinates of
/// [`Injection::checks`] for a row range) and writes them back.
fn with_range_checks<T>(m: &mut Section, r: &RowBytes, f: impl FnOnce(&mut [u8]) -> T) -> T {
    let (g, t, cb) = (r.groups.len(), r.total_groups, m.coding.check_bytes());
    let scales = r.groups.start * cb..r.groups.end * cb;
    let offsets = (t + r.groups.start) * cb..(t + r.groups.end) * cb;
    let has_offsets = !m.offsets.is_empty();
    let mut checks = m.checks[scales.clone()].to_vec();
    if has_offsets {
        checks.extend_from_slice(&m.checks[offsets.clone()]);
    }
    let out = f(&mut checks);
    m.checks[scales].copy_from_slice(&checks[..g * cb]);
    if has_offsets {
        m.checks[offsets].copy_from_slice(&checks[g * cb..]);
    }
    out
}

/// Flips recorded by [`KvStore::inject_rows`] of a row range, re-applied to
/// the same range restore its bytes (a test helper for ledgers).
#[cfg(test)]
fn unapply(store: &mut KvStore, rows: Range<usize>, injection: &Injection) {
    let r = row_bytes(&store.middle, rows.start, rows.end);
    let m = &mut store.middle;
    injection.values.apply(&mut m.data[r.data.clone()]).unwrap();
    injection
        .scales
        .apply(&mut m.scales[r.meta.clone()])
        .unwrap();
    if !m.offsets.is_empty() {
        injection
            .offsets
            .apply(&mut m.offsets[r.meta.clone()])
            .unwrap();
    }
    if !m.checks.is_empty() {
        with_range_checks(m, &r, |checks| injection.checks.apply(checks).unwrap());
    }
    m.record(injection, rows);
}

#[cfg(test)]
mod tests {
    use super::*;
    use gf2_codes::channel::BinarySymmetric;

    fn rows(tokens: usize, channels: usize) -> Vec<f32> {
        (0..tokens * channels)
            .map(|i| ((i as f32) * 0.618).sin() * (1.0 + (i % 7) as f32))
            .collect()
    }

    const FORMS: [&str; 6] = [
        "int4+secded84",
        "int4-g16+golay24",
        "int8",
        "fp16",
        "nf4+secded84",
        "int4-sym-g32+hamming74",
    ];

    #[test]
    fn a_row_range_copies_out_and_back_byte_for_byte() {
        let (tokens, ch) = (12, 64);
        for spelling in FORMS {
            let form = spelling.parse().unwrap();
            let store = KvStore::quantize(form, &rows(tokens, ch), tokens, ch).unwrap();
            let part = store.rows_to_store(4, 5).unwrap();
            let direct = KvStore::quantize(form, &rows(tokens, ch)[4 * ch..9 * ch], 5, ch).unwrap();
            assert_eq!(part, direct, "{spelling}");
            let mut back = KvStore::zeroed(form, tokens, ch).unwrap();
            back.copy_rows_from(4, &part).unwrap();
            assert_eq!(back.rows_to_store(4, 5).unwrap(), part, "{spelling}");
            assert!(store.rows_to_store(10, 3).is_err());
            assert!(store.rows_to_store(3, 0).is_err());
        }
        let shared = KvStore::quantize("int4-ch".parse().unwrap(), &rows(8, 8), 8, 8).unwrap();
        assert!(shared.rows_to_store(0, 2).is_err());
    }

    #[test]
    fn faults_and_scrubs_of_a_row_range_touch_only_its_bytes() {
        let (tokens, ch) = (12, 64);
        let channel = BinarySymmetric::new(0.02).unwrap();
        for spelling in FORMS {
            let form = spelling.parse().unwrap();
            let clean = KvStore::quantize(form, &rows(tokens, ch), tokens, ch).unwrap();
            let mut store = clean.clone();
            let hit = store
                .inject_rows(4..8, &channel, 9, FaultTarget::Everything)
                .unwrap();
            assert!(hit.total() > 0, "{spelling}");
            // Rows outside the range are untouched.
            for (a, b) in [(0, 4), (8, 4)] {
                assert_eq!(
                    store.rows_to_store(a, b).unwrap(),
                    clean.rows_to_store(a, b).unwrap(),
                    "{spelling}"
                );
            }
            // The record is exact: re-applying it restores the range.
            let mut restored = store.clone();
            unapply(&mut restored, 4..8, &hit);
            assert_eq!(
                restored.rows_to_store(0, tokens).unwrap(),
                clean.rows_to_store(0, tokens).unwrap(),
                "{spelling}"
            );
            // A scrub of the range finds what a whole scrub finds, over a
            // third of the words.
            let mut whole = store.clone();
            let a = store.scrub_rows(4..8).unwrap();
            let b = whole.scrub().unwrap();
            for (x, y) in [(a.values, b.values), (a.metadata, b.metadata)] {
                assert_eq!(
                    (x.corrected, x.detected),
                    (y.corrected, y.detected),
                    "{spelling}"
                );
                assert_eq!(3 * x.words, y.words, "{spelling}");
            }
            assert_eq!(store, whole, "{spelling}");
            // The same seed gives the same flips.
            let mut again = clean.clone();
            let twice = again
                .inject_rows(4..8, &channel, 9, FaultTarget::Everything)
                .unwrap();
            assert_eq!(twice, hit, "{spelling}");
        }
    }
}
