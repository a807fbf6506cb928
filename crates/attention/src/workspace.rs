//! [`Workspace`]: the buffers of [`Attention::decode_into`](crate::Attention::decode_into)
//! and [`Attention::prefill_into`](crate::Attention::prefill_into), kept by
//! the caller across calls (faer's style of explicit scratch), so that a
//! decode step allocates nothing once they have grown to its size.

use std::ops::Range;

use kv_quant::KvDecodeStats;

use crate::error::Result;
use crate::kernel::{KernelScratch, Partial};
use crate::source::KvSource;

/// Statistics of one tile, keyed by its first row.
pub(crate) type TileStats = (usize, KvDecodeStats, KvDecodeStats);

/// Reusable buffers of attention calls over sources of types `K` and `V`:
/// the scaled queries, the visible ranges, per work item (a decode chunk
/// or a block of prefill queries) the partial softmax states, and per group
/// of work items (about two per thread) the tile readers' and the kernel's
/// scratch. One workspace serves calls of
/// any shape; it grows to the largest call and stays that size.
pub struct Workspace<K: KvSource, V: KvSource> {
    pub(crate) q: Vec<f32>,
    pub(crate) ranges: Vec<Range<usize>>,
    /// Work items: key spans (decode) or query-block indices (prefill).
    pub(crate) items: Vec<Range<usize>>,
    pub(crate) slots: Vec<Slot>,
    /// One per group of consecutive work items, which run in turn.
    pub(crate) scratch: Vec<Scratch<K, V>>,
    pub(crate) tiles: Vec<TileStats>,
    pub(crate) merged: Partial,
    /// Per query, the merged partials of a split prefill.
    pub(crate) merged_rows: Vec<Partial>,
    /// Per query, the tile-aligned key span of a split prefill.
    pub(crate) spans: Vec<Range<usize>>,
}

impl<K: KvSource, V: KvSource> Workspace<K, V> {
    /// An empty workspace; the first call sizes it.
    pub fn new() -> Self {
        Self {
            q: Vec::new(),
            ranges: Vec::new(),
            items: Vec::new(),
            slots: Vec::new(),
            scratch: Vec::new(),
            tiles: Vec::new(),
            merged: Partial::new(0, 0),
            merged_rows: Vec::new(),
            spans: Vec::new(),
        }
    }

    /// Makes at least `n` work-item slots, and scratch for the groups of
    /// [`group_size`](Self::group_size) items they form; returns the group
    /// size.
    pub(crate) fn ensure_slots(&mut self, n: usize) -> usize {
        let per = Self::group_size(n);
        while self.slots.len() < n {
            self.slots.push(Slot::default());
        }
        while self.scratch.len() < n.div_ceil(per) {
            self.scratch.push(Scratch::default());
        }
        per
    }

    /// Work items per group: `n` items in at most two groups per thread of
    /// the current pool, so that a call allocates scratch per group, not
    /// per item, while idle threads can still take a group from busy ones.
    fn group_size(n: usize) -> usize {
        n.div_ceil(2 * rayon::current_num_threads()).max(1)
    }
}

impl<K: KvSource, V: KvSource> Default for Workspace<K, V> {
    fn default() -> Self {
        Self::new()
    }
}

impl<K: KvSource, V: KvSource> std::fmt::Debug for Workspace<K, V> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Workspace")
            .field("slots", &self.slots.len())
            .field("queries", &self.ranges.len())
            .finish_non_exhaustive()
    }
}

/// One work item's results.
pub(crate) struct Slot {
    /// One partial per query of the item.
    pub(crate) partials: Vec<Partial>,
    /// The tiles the item read.
    pub(crate) tiles: Vec<TileStats>,
    pub(crate) result: Result<()>,
}

impl Default for Slot {
    fn default() -> Self {
        Self {
            partials: Vec::new(),
            tiles: Vec::new(),
            result: Ok(()),
        }
    }
}

/// The tile readers' and the kernel's buffers of one group of work items
/// (nothing in them outlives an item: each item starts by forgetting what
/// the kernel derived from the previous one's queries).
pub(crate) struct Scratch<K: KvSource, V: KvSource> {
    pub(crate) keys: K::Scratch,
    pub(crate) values: V::Scratch,
    pub(crate) kernel: KernelScratch,
    /// Keys of a pair-code tile read by several queries, widened once.
    pub(crate) widened_keys: Vec<f32>,
}

impl<K: KvSource, V: KvSource> Default for Scratch<K, V> {
    fn default() -> Self {
        Self {
            keys: K::Scratch::default(),
            values: V::Scratch::default(),
            kernel: KernelScratch::default(),
            widened_keys: Vec::new(),
        }
    }
}
