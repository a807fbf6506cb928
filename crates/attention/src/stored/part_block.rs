//! [`PartBlock`]: one block's contents in one part, as a cache copies it
//! (copy-on-write) and moves it to and from the host tier.

use kv_lowrank::LowRankStore;
use kv_quant::{KvStore, ScrubStats};

use super::{ShardBlock, SparseBlock};
use crate::error::Result;

/// One block's contents in one part, for copies and the host tier: the
/// kv-quant stores the implementation keeps for it (the one read last,
/// [`rows`](Self::rows), holding its rows as attention reads them), a
/// kv-lowrank store of a sealed low-rank block, and any bytes it keeps
/// outside both.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PartBlock {
    pub(super) stores: Vec<KvStore>,
    pub(super) low_rank: Option<LowRankStore>,
    pub(super) shard: Option<ShardBlock>,
    pub(super) sparse: Option<SparseBlock>,
    pub(super) bytes: Vec<u8>,
    pub(super) group: Option<u64>,
    /// Of a hierarchical block's stores, how many are its upper plane's
    /// (the residual plane's follow).
    pub(super) planes: Option<usize>,
    /// The position of the first row of a block coded before RoPE, which
    /// its rows are rotated back to when read.
    pub(super) first: Option<usize>,
}

impl PartBlock {
    /// A block kept in kv-quant stores, the one holding its rows as read
    /// last.
    pub fn of_stores(stores: Vec<KvStore>) -> Self {
        Self {
            stores,
            ..Self::default()
        }
    }

    /// A sealed low-rank block.
    pub fn of_low_rank(store: LowRankStore) -> Self {
        Self {
            low_rank: Some(store),
            ..Self::default()
        }
    }

    /// A sealed Shard block.
    pub fn of_shard(block: ShardBlock) -> Self {
        Self {
            shard: Some(block),
            ..Self::default()
        }
    }

    /// A sealed block of a `+out` form (dense rows and sparse outliers).
    pub fn of_sparse(block: SparseBlock) -> Self {
        Self {
            sparse: Some(block),
            ..Self::default()
        }
    }

    /// The sparse store of a sealed `+out` block, if it is one.
    pub fn sparse(&self) -> Option<&SparseBlock> {
        self.sparse.as_ref()
    }

    /// The block marked as one of the group of blocks sealed together
    /// under `group` (a per-channel group's channel slice: copies of one
    /// group's blocks keep its mark, so a cache can tell blocks of one
    /// group from blocks of another holding the same tokens).
    pub fn in_group(self, group: u64) -> Self {
        Self {
            group: Some(group),
            ..self
        }
    }

    /// The block marked as coded before RoPE from position `first` (the
    /// position of its first row, which reading rotates its rows from).
    pub fn at_position(self, first: usize) -> Self {
        Self {
            first: Some(first),
            ..self
        }
    }

    /// The position of the first row of a block coded before RoPE, if it is
    /// one.
    pub fn first_position(&self) -> Option<usize> {
        self.first
    }

    /// The mark of the group of blocks the block was sealed in, if any.
    pub fn group(&self) -> Option<u64> {
        self.group
    }

    /// The sealed Shard block, if it is one.
    pub fn shard(&self) -> Option<&ShardBlock> {
        self.shard.as_ref()
    }

    /// A block kept as plain bytes (a part defined outside kv-quant's forms).
    pub fn of_bytes(bytes: Vec<u8>) -> Self {
        Self {
            bytes,
            ..Self::default()
        }
    }

    /// The low-rank store of a sealed low-rank block.
    pub fn low_rank(&self) -> Option<&LowRankStore> {
        self.low_rank.as_ref()
    }

    /// The stores, in the implementation's order.
    pub fn stores(&self) -> &[KvStore] {
        &self.stores
    }

    /// The bytes kept outside kv-quant stores.
    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// The store holding the block's rows as read, if it is kept in stores
    /// (none for a block of two planes, read as their sum).
    pub fn rows(&self) -> Option<&KvStore> {
        match self.planes {
            Some(_) => None,
            None => self.stores.last(),
        }
    }

    /// Bytes held, counted from the stores' buffers and the plain bytes.
    pub fn stored_bytes(&self) -> usize {
        self.stores.iter().map(KvStore::stored_bytes).sum::<usize>()
            + self.low_rank.as_ref().map_or(0, LowRankStore::stored_bytes)
            + self.shard.as_ref().map_or(0, ShardBlock::stored_bytes)
            + self.sparse.as_ref().map_or(0, |s| s.store.stored_bytes())
            + self.bytes.len()
    }

    /// One scrubbing pass over every kv-quant store, a sparse block's
    /// store and tables, and a coded Shard block's words (swapped-out blocks collect faults too); plain bytes
    /// and low-rank coefficients are not rewritten here.
    pub fn scrub(&mut self) -> Result<ScrubStats> {
        let mut stats = ScrubStats::default();
        for s in &mut self.stores {
            stats += s.scrub()?;
        }
        if let Some(shard) = &mut self.shard {
            stats += shard.scrub()?;
        }
        if let Some(sparse) = &mut self.sparse {
            stats += sparse.store.scrub()?;
        }
        Ok(stats)
    }
}
