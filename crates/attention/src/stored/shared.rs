//! [`SharedTable`]: a fitted table every block of a part reads (a `vq`
//! codebook, the calibrated bases of a `pca-*` form), kept as stored,
//! protected bytes beside the blocks.
//!
//! The table is stored once per part as a kv-quant [`ProtectedTable`]
//! under the form's metadata code (RM(2,5) under SECDED and Golay values,
//! SECDED under Hamming, none for unprotected forms): counted in the
//! part's [`shared_bytes`](super::StoredPart::shared_bytes), exposed to
//! faults under targets that reach metadata, read through its code (a
//! table of f16 values also checked against the range written, as
//! protected metadata is), and scrubbed. What the kernels read is the table as last decoded (a
//! detected word erased to zero), rebuilt whenever faults reach the stored
//! bytes or a scrub rewrites them; the fitted table shared by other caches
//! is never touched.

use std::sync::Arc;

use gf2_codes::DecodeStats;
use gf2_codes::channel::FaultChannel;
use kv_quant::{CacheForm, FaultTarget, Injection, MetaProtection, ProtectedTable, TableBytes};

use crate::error::Result;

/// A fitted table as stored, protected bytes, and as read (see the module
/// docs).
#[derive(Clone, Debug)]
pub struct SharedTable<T> {
    /// The stored bytes under the form's metadata code.
    stored: ProtectedTable,
    /// The table as fitted (the shape every read is rebuilt in).
    fitted: Arc<T>,
    /// The table as last read through the code.
    read: Arc<T>,
}

impl<T: TableBytes> SharedTable<T> {
    /// `fitted` stored under the metadata code of `form`'s protection
    /// (none for an unprotected form).
    pub fn new(fitted: Arc<T>, form: &CacheForm) -> Self {
        let protection = form
            .protection()
            .map_or(MetaProtection::Unprotected, |p| p.metadata);
        let stored = ProtectedTable::new(&fitted.table_bytes(), protection);
        Self {
            stored: if fitted.f16_words() {
                stored.with_f16_range()
            } else {
                stored
            },
            read: fitted.clone(),
            fitted,
        }
    }

    /// The table as fitted (before any fault).
    pub fn fitted(&self) -> &Arc<T> {
        &self.fitted
    }

    /// The table as the kernels read it.
    pub fn read(&self) -> &Arc<T> {
        &self.read
    }

    /// Stored bytes: the table and its check words.
    pub fn stored_bytes(&self) -> usize {
        self.stored.stored_bytes()
    }

    /// Faults from `channel`'s stream `seed` into the stored bytes, under
    /// targets that reach metadata (none under `Values`); the table is read
    /// again through its code when any bit flipped. Returns the flips (in
    /// [`Injection::tables`]) and whether the table as read changed.
    pub fn inject(
        &mut self,
        channel: &dyn FaultChannel,
        seed: u64,
        target: FaultTarget,
    ) -> Result<(Injection, bool)> {
        if target == FaultTarget::Values {
            return Ok((Injection::default(), false));
        }
        let tables = self.stored.inject(channel, seed);
        if tables.is_empty() {
            return Ok((Injection::default(), false));
        }
        let changed = self.reread()?;
        Ok((
            Injection {
                tables,
                ..Injection::default()
            },
            changed,
        ))
    }

    /// How the stored words decode now, against the words as written.
    pub fn stats(&self) -> DecodeStats {
        self.stored.read().1
    }

    /// One scrubbing pass over the stored words: every corrected word is
    /// rewritten with its check word, before a second flip pairs up with
    /// it. The table as read does not change (a read decodes the same).
    pub fn scrub(&mut self) -> DecodeStats {
        self.stored.scrub()
    }

    /// Rebuilds the table as read; whether it differs from before.
    fn reread(&mut self) -> Result<bool> {
        let (bytes, _) = self.stored.read();
        if bytes == self.read.table_bytes() {
            return Ok(false);
        }
        self.read = Arc::new(self.fitted.with_table_bytes(&bytes)?);
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use gf2_codes::channel::ExactFlips;
    use kv_quant::{FitOptions, VqCodebook};

    use super::*;

    fn codebook(form: &CacheForm) -> Arc<VqCodebook> {
        let data: Vec<f32> = (0..256 * 64)
            .map(|i| ((i * 7919) % 97) as f32 - 48.0)
            .collect();
        Arc::new(VqCodebook::fit(form, &data, 256, 64, FitOptions::default()).unwrap())
    }

    #[test]
    fn a_protected_table_reads_right_through_one_flip_per_word() {
        let form: CacheForm = "vq+secded84".parse().unwrap();
        let cb = codebook(&form);
        let mut t = SharedTable::new(cb.clone(), &form);
        // RM(2,5) under SECDED values: 2 check bytes per 16-bit word.
        assert_eq!(t.stored_bytes(), 2 * cb.stored_bytes());
        let (inj, changed) = t
            .inject(&ExactFlips::new([3, 40, 100]), 0, FaultTarget::Everything)
            .unwrap();
        assert_eq!(inj.tables.len(), 3);
        assert!(!changed);
        assert_eq!(t.read().table_bytes(), cb.table_bytes());
        assert_eq!(t.stats().corrected, 3);
        assert_eq!(t.scrub().corrected, 3);
        assert_eq!(t.stats().corrected, 0);
    }

    #[test]
    fn an_unprotected_table_reads_the_fault() {
        let form: CacheForm = "vq".parse().unwrap();
        let cb = codebook(&form);
        let mut t = SharedTable::new(cb.clone(), &form);
        assert_eq!(t.stored_bytes(), cb.stored_bytes());
        let flips = ExactFlips::new([14]);
        assert_eq!(
            t.inject(&flips, 0, FaultTarget::Values).unwrap(),
            (Injection::default(), false)
        );
        let (_, changed) = t.inject(&flips, 0, FaultTarget::Metadata).unwrap();
        assert!(changed);
        assert_ne!(t.read().centroids()[0], cb.centroids()[0]);
        assert_eq!(t.read().centroids()[1..], cb.centroids()[1..]);
        assert_eq!(t.stats().silent, 1);
    }
}
