//! [`PagedCacheError`]: every way a paged-cache call can be refused.

use crate::manager::SeqId;
use crate::pool::BlockId;

/// Errors of the paged cache. Calls that fail leave the cache as it was.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PagedCacheError {
    /// Not enough free blocks, even after evicting cached prefixes.
    #[error("block pool exhausted: {needed} blocks needed, {free} free")]
    PoolExhausted {
        /// Blocks the call needed.
        needed: usize,
        /// Blocks that were free.
        free: usize,
    },
    /// Not enough free host-tier slots for a swap-out.
    #[error("host tier full: {needed} blocks needed, {free} free")]
    HostTierFull {
        /// Blocks the swap needed.
        needed: usize,
        /// Host slots that were free.
        free: usize,
    },
    /// A parameter outside its valid range.
    #[error("invalid {name}: {reason}")]
    InvalidParameter {
        /// The parameter.
        name: &'static str,
        /// Why it is invalid.
        reason: String,
    },
    /// No live sequence has this id.
    #[error("unknown sequence {0}")]
    UnknownSequence(SeqId),
    /// The sequence is swapped out to the host tier; swap it in first.
    #[error("sequence {0} is swapped out")]
    SwappedOut(SeqId),
    /// The sequence is on the device; it cannot be swapped in.
    #[error("sequence {0} is not swapped out")]
    NotSwapped(SeqId),
    /// A reference count would drop below zero: a block freed twice.
    #[error("block {0} freed twice (its reference count is already 0)")]
    DoubleFree(BlockId),
    /// A block index outside the pool.
    #[error("block {block} is outside the pool of {blocks} blocks")]
    BlockOutOfRange {
        /// The index.
        block: u32,
        /// Blocks in the pool.
        blocks: usize,
    },
    /// A token position outside a sequence.
    #[error("position {position} is outside the {tokens} tokens of the sequence")]
    PositionOutOfRange {
        /// The position.
        position: usize,
        /// Tokens in the sequence.
        tokens: usize,
    },
    /// The cache was built without block storage (metadata only).
    #[error("this cache has no block storage (it was built for metadata only)")]
    NoStorage,
    /// A malformed page table.
    #[error("invalid page table: {0}")]
    PageTable(String),
    /// A slice of the wrong length.
    #[error("{what} has length {found}, expected {expected}")]
    ShapeMismatch {
        /// What was passed.
        what: &'static str,
        /// Its length.
        found: usize,
        /// The length required.
        expected: usize,
    },
    /// A size this machine cannot allocate (refused before allocating).
    #[error("cannot allocate {count} {what}")]
    OutOfMemory {
        /// What was to be allocated.
        what: &'static str,
        /// How many.
        count: usize,
    },
    /// From the stored forms.
    #[error(transparent)]
    Quant(#[from] kv_quant::KvQuantError),
    /// From attention.
    #[error(transparent)]
    Attention(#[from] attention::AttentionError),
}

/// Result with [`PagedCacheError`].
pub type Result<T, E = PagedCacheError> = std::result::Result<T, E>;

/// `n` copies of `value`, or [`PagedCacheError::OutOfMemory`] instead of an
/// abort when the allocator refuses.
pub(crate) fn try_vec<T: Clone>(n: usize, value: T, what: &'static str) -> Result<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n)
        .map_err(|_| PagedCacheError::OutOfMemory { what, count: n })?;
    v.resize(n, value);
    Ok(v)
}
