//! [`SequenceTables`]: tables a [`StoredPart`](super::StoredPart) fits on
//! one sequence's own rows (Shard's key basis and value codebook fitted on
//! the prefill, as `shard-kv-compression-blog.md` does), held by the cache
//! beside the sequence's block table.
//!
//! The part fits them ([`fit_sequence`](super::StoredPart::fit_sequence))
//! before the sequence's first seal and codes every later block of the
//! sequence on them ([`seal_on`](super::StoredPart::seal_on)). A fork
//! shares them and they are freed with the last sequence holding them;
//! faults reach them as stored bits
//! ([`inject_sequence`](super::StoredPart::inject_sequence), behind the
//! part's own lock), and what they read as then is what every copy of the
//! sequence reads. A sealed block keeps its own reference to the tables it
//! was coded on, so reading, copying and swapping a block need no
//! sequence.

use std::any::Any;
use std::fmt;
use std::sync::Arc;

/// What a part fitting its tables on each sequence needs to know of the
/// model, handed to the registry in [`Fitted`](super::Fitted).
#[derive(Clone, Debug)]
pub enum SequenceFit {
    /// A key part: the model's RoPE (keys are fitted with it undone and
    /// rotated again when read).
    Keys(crate::rope::Rope),
    /// A value part: channels per head (values are rotated per head).
    Values {
        /// Channels per head.
        head_dim: usize,
    },
}

/// Tables one part fitted on one sequence's rows (opaque to the cache:
/// only the part that fitted them reads them).
#[derive(Clone)]
pub struct SequenceTables {
    tables: Arc<dyn Any + Send + Sync>,
    bytes: usize,
}

impl SequenceTables {
    /// Wraps a part's tables, which store `bytes` bytes (counted per
    /// sequence in the cache's bits per value).
    pub fn new<T: Any + Send + Sync>(tables: T, bytes: usize) -> Self {
        Self {
            tables: Arc::new(tables),
            bytes,
        }
    }

    /// The tables, if they are a `T`.
    pub fn get<T: Any>(&self) -> Option<&T> {
        self.tables.downcast_ref()
    }

    /// Bytes the tables store.
    pub fn stored_bytes(&self) -> usize {
        self.bytes
    }

    /// Whether `self` and `other` are the same tables (a fork's, say).
    pub fn same(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.tables, &other.tables)
    }
}

impl fmt::Debug for SequenceTables {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SequenceTables")
            .field("bytes", &self.bytes)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_come_back_as_their_type_and_forks_share_them() {
        let t = SequenceTables::new(vec![1u8, 2, 3], 3);
        assert_eq!(t.get::<Vec<u8>>(), Some(&vec![1, 2, 3]));
        assert!(t.get::<String>().is_none());
        assert_eq!(t.stored_bytes(), 3);
        let fork = t.clone();
        assert!(fork.same(&t));
        assert!(!SequenceTables::new(vec![1u8, 2, 3], 3).same(&t));
        assert!(format!("{t:?}").contains("bytes: 3"));
    }
}
