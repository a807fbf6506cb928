//! # paged-cache
//!
//! Paged KV-cache management, built the way vLLM v1 and SGLang build it and
//! on this workspace's stored forms:
//!
//! - [`BlockPool`]: index-based blocks with reference counts, optional
//!   content hashes and an O(1) doubly linked free list through the blocks.
//! - [`KvCacheManager`]: block tables that grow at the end, append, fork
//!   with copy-on-write, truncate (speculative rollback), free, swap to a
//!   host tier and back, scrubbing, and [`check_invariants`](KvCacheManager::check_invariants).
//! - Prefix caching behind [`PrefixCache`]: [`HashPrefixCache`] (chained
//!   SHA-256 block hashes, lazy LRU eviction) and [`RadixPrefixCache`]
//!   (token radix tree with lock counts, LRU eviction of unlocked leaves).
//! - [`BlockStorage`]: real K/V bytes per block in a kv-quant form chosen
//!   per layer; [`Scrubber`] scrubs protected blocks on a background thread.
//! - [`PageTable`] (CSR, FlashInfer's layout), [`PagedKv`] and
//!   [`paged_decode`]: attention read through pages.
//! - [`PagedBackend`]: one sequence's paged cache as an
//!   [`attention::KvBackend`], the cache a model's forward pass runs on.
//! - [`scheduler`]: continuous batching with preemption by recompute or
//!   swap, driving an [`Engine`](scheduler::Engine) ([`serve`](scheduler::serve):
//!   kv-eval's real model; [`simulate`](scheduler::simulate): fixed tokens,
//!   `paged-cache simulate`), and its report; [`ReservedSlots`]: the
//!   slots it reserved for one sequence, as the backend a batched forward
//!   pass writes.
//!
//! ```
//! use paged_cache::{CacheConfig, HashPrefixCache, KvCacheManager};
//!
//! let config = CacheConfig { num_blocks: 8, block_size: 4, host_blocks: 0 };
//! let mut cache = KvCacheManager::new(config, HashPrefixCache::new(4))?;
//! let prompt: Vec<u32> = (0..10).collect();
//! let (a, hit) = cache.add_sequence(&prompt, 0)?;
//! assert_eq!((hit, cache.pool().num_used()), (0, 3));
//! cache.cache_prefix(a, prompt.len())?; // two full blocks become findable
//! let (b, hit) = cache.add_sequence(&prompt, 0)?;
//! assert_eq!(hit, 8); // both full blocks shared
//! assert_eq!(cache.pool().num_used(), 4);
//! let c = cache.fork(b)?; // shares all of b's blocks
//! cache.append(c, &[99])?; // copies b's last, shared block first
//! assert_eq!(cache.stats().cow_copies, 1);
//! cache.check_invariants().map_err(|e| e.to_string())?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod backend;
mod error;
mod hash;
mod manager;
mod page_table;
mod pool;
mod prefix;
mod radix;
pub mod scheduler;
mod scrub;
mod seq_tables;
mod slots;
mod storage;

pub use backend::{PagedBackend, PagedReadStats};
pub use error::{PagedCacheError, Result};
pub use hash::{BlockHash, HashPrefixCache};
pub use manager::{CacheConfig, KvCacheManager, ManagerStats, SeqId};
pub use page_table::{PageTable, PagedKv, paged_decode};
pub use pool::{Allocated, BlockId, BlockPool, FreeList, MAX_SLOTS};
pub use prefix::{NoPrefixCache, PrefixCache, PrefixHit, PrefixLock};
pub use radix::RadixPrefixCache;
pub use scrub::{ScrubTotals, Scrubber};
pub use seq_tables::SeqTables;
pub use slots::ReservedSlots;
pub use storage::{BlockData, BlockStorage, KvPart, LayerSpec, check_pageable};

/// The README's example, compiled and run as a doctest.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
