//! [`SeqTables`]: the tables each layer part fitted on one sequence's own
//! rows (attention's [`SequenceTables`]: Shard's key basis and value
//! codebook of a form fitted per sequence, `shard-k3`), kept beside the
//! sequence's block table.
//!
//! Empty until the sequence's first seal, which fits them
//! ([`BlockStorage::seal_blocks`](crate::BlockStorage::seal_blocks)).
//! Each part's slot is a cell shared by every copy of the sequence's
//! tables: a fork (made before or after the fit) and the
//! [`ReservedSlots`](crate::ReservedSlots) of a batched step fill and read
//! the one fit, never fit twice, and tables never change once fitted, so a
//! fork's copy-on-write never copies them. They are dropped with the last
//! sequence holding them. Sealed blocks keep their own reference to the
//! tables they were coded on, so a block read, copied or swapped needs no
//! sequence.

use std::sync::{Arc, OnceLock};

use attention::stored::SequenceTables;

use crate::storage::KvPart;

/// The tables each layer part (K, V) fitted on one sequence: empty until
/// its first seal fits them ([`BlockStorage::seal_blocks`](crate::BlockStorage::seal_blocks)),
/// shared by its forks, dropped with the last sequence holding them.
#[derive(Clone, Debug, Default)]
pub struct SeqTables {
    layers: Vec<[Arc<OnceLock<SequenceTables>>; 2]>,
}

impl SeqTables {
    /// Empty slots for `layers` layers (the copies of these share them).
    pub fn new(layers: usize) -> Self {
        Self {
            layers: (0..layers).map(|_| Default::default()).collect(),
        }
    }

    /// The tables `part` of `layer` fitted, if it has.
    pub fn get(&self, layer: usize, part: KvPart) -> Option<&SequenceTables> {
        self.layers.get(layer)?[part as usize].get()
    }

    /// Keeps `tables` as those `part` of `layer` fitted, in the slot every
    /// copy shares (a layer past the slots made gets one of its own); a
    /// slot filled already keeps its tables.
    pub(crate) fn set(&mut self, layer: usize, part: KvPart, tables: SequenceTables) {
        if self.layers.len() <= layer {
            self.layers.resize_with(layer + 1, Default::default);
        }
        let _ = self.layers[layer][part as usize].set(tables);
    }

    /// Whether no part has fitted tables.
    pub fn is_empty(&self) -> bool {
        self.layers.iter().flatten().all(|c| c.get().is_none())
    }

    /// Bytes the tables of `part` store, over every layer.
    pub fn part_bytes(&self, part: KvPart) -> usize {
        self.layers
            .iter()
            .filter_map(|l| l[part as usize].get())
            .map(SequenceTables::stored_bytes)
            .sum()
    }

    /// Bytes every table stores.
    pub fn stored_bytes(&self) -> usize {
        self.part_bytes(KvPart::Keys) + self.part_bytes(KvPart::Values)
    }

    /// Whether `self` and `other` hold the same tables in every part (a
    /// fork shares its parent's).
    pub fn same(&self, other: &Self) -> bool {
        fn slots(t: &SeqTables) -> Vec<Option<&SequenceTables>> {
            t.layers.iter().flatten().map(|c| c.get()).collect()
        }
        let (a, b) = (slots(self), slots(other));
        a.len() == b.len()
            && a.iter().zip(&b).all(|(x, y)| match (x, y) {
                (Some(x), Some(y)) => x.same(y),
                (None, None) => true,
                _ => false,
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_are_kept_per_layer_and_part_and_counted() {
        let mut t = SeqTables::new(1);
        let early = t.clone();
        assert!(t.is_empty());
        assert!(t.get(2, KvPart::Keys).is_none());
        t.set(2, KvPart::Keys, SequenceTables::new(1u8, 10));
        t.set(0, KvPart::Values, SequenceTables::new(2u8, 7));
        assert!(!t.is_empty());
        assert_eq!(t.get(2, KvPart::Keys).unwrap().get::<u8>(), Some(&1));
        assert!(t.get(2, KvPart::Values).is_none());
        assert_eq!(t.part_bytes(KvPart::Keys), 10);
        assert_eq!(t.part_bytes(KvPart::Values), 7);
        assert_eq!(t.stored_bytes(), 17);
        let fork = t.clone();
        assert!(fork.same(&t));
        // A copy made before the fit shares the slots made then; a slot
        // filled keeps its tables.
        assert!(early.get(0, KvPart::Values).is_some());
        assert!(early.get(2, KvPart::Keys).is_none(), "a slot made later");
        let mut other = t.clone();
        other.set(0, KvPart::Values, SequenceTables::new(3u8, 1));
        assert_eq!(other.get(0, KvPart::Values).unwrap().get::<u8>(), Some(&2));
        assert!(other.same(&t));
        let mut fresh = SeqTables::new(3);
        fresh.set(2, KvPart::Keys, SequenceTables::new(1u8, 10));
        assert!(!fresh.same(&t));
    }
}
