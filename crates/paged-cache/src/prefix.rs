//! [`PrefixCache`]: the one interface of the two prefix caches,
//! [`HashPrefixCache`](crate::HashPrefixCache) (vLLM's chained block hashes)
//! and [`RadixPrefixCache`](crate::RadixPrefixCache) (SGLang's token radix tree).

use crate::error::Result;
use crate::hash::BlockHash;
use crate::pool::{BlockId, BlockPool};

/// A lock a lookup took on cached content; give it back with
/// [`PrefixCache::release`] when the sequence stops using the prefix.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PrefixLock(pub(crate) u32);

/// The result of a lookup.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PrefixHit {
    /// Tokens of the prompt whose K/V are cached (at most `len − 1`).
    pub tokens: usize,
    /// The blocks holding them (`⌈tokens / block_size⌉`), each with one
    /// reference taken for the caller. The last one may hold more tokens
    /// than the hit (the caller copies it before writing).
    pub blocks: Vec<BlockId>,
    /// The lock to release, for caches that lock what a sequence uses.
    pub lock: Option<PrefixLock>,
}

/// A prefix cache over a [`BlockPool`].
///
/// Contract: `lookup` returns a prefix of the given tokens whose K/V the
/// returned blocks hold, never the whole prompt (at least one token is left
/// to compute, whose logits start generation); `insert` records that the
/// given blocks hold the K/V of the given tokens (position `i` in block
/// `i / block_size`); content is evicted only when nothing uses it.
pub trait PrefixCache {
    /// Short name for reports (`hash`, `radix`).
    fn name(&self) -> &'static str;

    /// The longest cached prefix of `tokens` under `salt` (different salts
    /// never share content), capped at `tokens.len() − 1`.
    fn lookup(&mut self, pool: &mut BlockPool, tokens: &[u32], salt: u64) -> Result<PrefixHit>;

    /// Records that `blocks` hold the K/V of `tokens` under `salt`.
    fn insert(
        &mut self,
        pool: &mut BlockPool,
        tokens: &[u32],
        blocks: &[BlockId],
        salt: u64,
    ) -> Result<()>;

    /// Gives back a lock from a lookup.
    fn release(&mut self, lock: PrefixLock);

    /// The pool handed out `block`, which was free but cached under `hash`
    /// (lazy eviction): forget that mapping.
    fn forget(&mut self, block: BlockId, hash: BlockHash);

    /// Evicts cached content no sequence uses, least recently used first,
    /// until `blocks` more blocks are reusable or nothing is left to evict;
    /// returns how many were made reusable.
    fn evict(&mut self, pool: &mut BlockPool, blocks: usize) -> Result<usize>;

    /// Blocks that [`evict`](Self::evict) could make reusable now (beyond
    /// the pool's free blocks): what admission may count on.
    fn evictable_blocks(&self, pool: &BlockPool) -> usize {
        let _ = pool;
        0
    }

    /// Calls `f` once per block reference the cache itself holds.
    fn for_each_held(&self, f: &mut dyn FnMut(BlockId));

    /// Blocks whose content is cached.
    fn cached_blocks(&self) -> usize;

    /// Checks the cache's invariants against the pool.
    fn check_invariants(&self, pool: &BlockPool) -> std::result::Result<(), String>;
}

/// No prefix caching: every lookup misses (the baseline of reports).
#[derive(Clone, Copy, Debug, Default)]
pub struct NoPrefixCache;

impl PrefixCache for NoPrefixCache {
    fn name(&self) -> &'static str {
        "none"
    }

    fn lookup(&mut self, _: &mut BlockPool, _: &[u32], _: u64) -> Result<PrefixHit> {
        Ok(PrefixHit::default())
    }

    fn insert(&mut self, _: &mut BlockPool, _: &[u32], _: &[BlockId], _: u64) -> Result<()> {
        Ok(())
    }

    fn release(&mut self, _: PrefixLock) {}

    fn forget(&mut self, _: BlockId, _: BlockHash) {}

    fn evict(&mut self, _: &mut BlockPool, _: usize) -> Result<usize> {
        Ok(0)
    }

    fn for_each_held(&self, _: &mut dyn FnMut(BlockId)) {}

    fn cached_blocks(&self) -> usize {
        0
    }

    fn check_invariants(&self, _: &BlockPool) -> std::result::Result<(), String> {
        Ok(())
    }
}
