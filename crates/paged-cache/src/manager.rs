//! [`KvCacheManager`]: sequences over a [`BlockPool`]. Per-sequence block
//! tables that grow only at the end, appends, forks that share blocks and
//! copy a shared block the first time it would change, truncation
//! (speculative-decoding rollback), prefix caching through any
//! [`PrefixCache`], a host tier for swapping, optional real block storage
//! ([`BlockStorage`]) and scrubbing.
//!
//! Every call either succeeds or changes nothing: blocks a call needs are
//! counted (and cached prefixes evicted for them) before anything moves.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use kv_quant::ScrubStats;

use crate::error::{PagedCacheError, Result};
use crate::page_table::PageTable;
use crate::pool::{BlockId, BlockPool};
use crate::prefix::{PrefixCache, PrefixHit, PrefixLock};
use crate::seq_tables::SeqTables;
use crate::storage::{BlockData, BlockStorage};

/// A sequence's id.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SeqId(pub u64);

impl fmt::Display for SeqId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "s{}", self.0)
    }
}

/// Sizes of a cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CacheConfig {
    /// Device blocks.
    pub num_blocks: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// Host-tier blocks for swapping (0: no swapping).
    pub host_blocks: usize,
}

#[derive(Clone, Debug)]
struct Sequence {
    tokens: Vec<u32>,
    table: Vec<BlockId>,
    salt: u64,
    lock: Option<PrefixLock>,
    host: Option<Vec<u32>>,
    /// Tables its parts fitted on its rows (shared with its forks).
    tables: SeqTables,
}

/// Counters of what the manager did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ManagerStats {
    /// Prompt tokens looked up in the prefix cache.
    pub lookup_tokens: u64,
    /// Of those, tokens found cached.
    pub hit_tokens: u64,
    /// Blocks copied because a shared block was about to change.
    pub cow_copies: u64,
    /// Blocks moved to the host tier.
    pub swapped_out: u64,
    /// Blocks moved back.
    pub swapped_in: u64,
    /// Blocks made reusable by evicting cached prefixes.
    pub evicted: u64,
}

/// The host tier: slots made as swapping needs them (up to `capacity`),
/// so a large tier costs nothing until it is used.
#[derive(Clone, Debug)]
struct HostTier {
    capacity: usize,
    /// Slots given back, handed out again first (last in, first out).
    free: Vec<u32>,
    /// Slots made so far: `0..made` exist in `tokens` and `data`.
    made: usize,
    tokens: Vec<u32>,
    data: Vec<Option<BlockData>>,
}

impl HostTier {
    /// Slots that can still be handed out.
    fn available(&self) -> usize {
        self.free.len() + (self.capacity - self.made)
    }

    /// A free slot: a given-back one, or a new one (the caller checked
    /// [`available`](Self::available)).
    fn take(&mut self, block_size: usize) -> u32 {
        if let Some(slot) = self.free.pop() {
            return slot;
        }
        let slot = self.made;
        self.made += 1;
        self.tokens.resize(self.made * block_size, 0);
        self.data.push(None);
        slot as u32
    }
}

/// Sequences, their block tables and the pool under them.
#[derive(Debug)]
pub struct KvCacheManager<P: PrefixCache> {
    pool: BlockPool,
    prefix: P,
    seqs: BTreeMap<SeqId, Sequence>,
    next_id: u64,
    host: HostTier,
    storage: Option<Arc<BlockStorage>>,
    stats: ManagerStats,
}

impl<P: PrefixCache> KvCacheManager<P> {
    /// A metadata-only cache (token ids, no K/V bytes).
    pub fn new(config: CacheConfig, prefix: P) -> Result<Self> {
        let bs = config.block_size;
        let pool = BlockPool::new(config.num_blocks, bs)?;
        let host_blocks = u32::try_from(config.host_blocks)
            .ok()
            .filter(|&n| n < u32::MAX)
            .ok_or_else(|| PagedCacheError::InvalidParameter {
                name: "host_blocks",
                reason: format!(
                    "{} host blocks: at most {}",
                    config.host_blocks,
                    u32::MAX - 1
                ),
            })?;
        // Checked here, made on demand.
        crate::pool::check_slots("host_blocks", host_blocks as usize, bs)?;
        Ok(Self {
            pool,
            prefix,
            seqs: BTreeMap::new(),
            next_id: 0,
            host: HostTier {
                capacity: config.host_blocks,
                free: Vec::new(),
                made: 0,
                tokens: Vec::new(),
                data: Vec::new(),
            },
            storage: None,
            stats: ManagerStats::default(),
        })
    }

    /// A cache whose blocks hold real K/V bytes in `storage` (same block
    /// count and size as `config`).
    pub fn with_storage(
        config: CacheConfig,
        prefix: P,
        storage: Arc<BlockStorage>,
    ) -> Result<Self> {
        if storage.num_blocks() != config.num_blocks || storage.block_size() != config.block_size {
            return Err(PagedCacheError::InvalidParameter {
                name: "storage",
                reason: format!(
                    "{} blocks of {} tokens, the cache has {} of {}",
                    storage.num_blocks(),
                    storage.block_size(),
                    config.num_blocks,
                    config.block_size
                ),
            });
        }
        let mut manager = Self::new(config, prefix)?;
        manager.storage = Some(storage);
        Ok(manager)
    }

    /// The pool.
    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    /// The prefix cache.
    pub fn prefix_cache(&self) -> &P {
        &self.prefix
    }

    /// The block storage, if any.
    pub fn storage(&self) -> Option<&Arc<BlockStorage>> {
        self.storage.as_ref()
    }

    /// Counters.
    pub fn stats(&self) -> ManagerStats {
        self.stats
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.pool.block_size()
    }

    /// Blocks a call could get: free ones plus those evicting unused cached
    /// prefixes would free.
    pub fn available_blocks(&self) -> usize {
        self.pool.num_free() + self.prefix.evictable_blocks(&self.pool)
    }

    /// Free host-tier blocks.
    pub fn host_free(&self) -> usize {
        self.host.available()
    }

    /// Live sequences, in id order.
    pub fn sequences(&self) -> impl Iterator<Item = SeqId> + '_ {
        self.seqs.keys().copied()
    }

    fn seq(&self, id: SeqId) -> Result<&Sequence> {
        self.seqs
            .get(&id)
            .ok_or(PagedCacheError::UnknownSequence(id))
    }

    fn resident(&self, id: SeqId) -> Result<&Sequence> {
        let s = self.seq(id)?;
        if s.host.is_some() {
            return Err(PagedCacheError::SwappedOut(id));
        }
        Ok(s)
    }

    /// Token ids of a sequence.
    pub fn tokens(&self, id: SeqId) -> Result<&[u32]> {
        Ok(&self.seq(id)?.tokens)
    }

    /// Block table of a resident sequence.
    pub fn block_table(&self, id: SeqId) -> Result<&[BlockId]> {
        Ok(&self.resident(id)?.table)
    }

    /// Whether the sequence is swapped out.
    pub fn is_swapped(&self, id: SeqId) -> Result<bool> {
        Ok(self.seq(id)?.host.is_some())
    }

    /// Blocks needed to make `needed` free: evicts cached prefixes when short.
    fn ensure_free(&mut self, needed: usize) -> Result<()> {
        let free = self.pool.num_free();
        if free < needed {
            let evicted = self.prefix.evict(&mut self.pool, needed - free)?;
            self.stats.evicted += evicted as u64;
        }
        let free = self.pool.num_free();
        if free < needed {
            return Err(PagedCacheError::PoolExhausted { needed, free });
        }
        Ok(())
    }

    fn take_block(&mut self) -> Result<BlockId> {
        let a = self.pool.allocate()?;
        if let Some(hash) = a.evicted {
            self.prefix.forget(a.block, hash);
        }
        if let Some(storage) = &self.storage {
            // Staged forms stage a new block's rows exact from its first row.
            storage.open_block(a.block)?;
        }
        Ok(a.block)
    }

    /// Starts a sequence with `prompt`, reusing its longest cached prefix.
    /// Returns the id and the number of prompt tokens found cached.
    pub fn add_sequence(&mut self, prompt: &[u32], salt: u64) -> Result<(SeqId, usize)> {
        if prompt.is_empty() {
            return Err(PagedCacheError::InvalidParameter {
                name: "prompt",
                reason: "a sequence starts with at least one token".into(),
            });
        }
        // Blocks coded on one sequence's own tables are not shared: a prompt
        // is not looked up (and no prefix is recorded) for such forms.
        let mut hit = if self.per_sequence() {
            PrefixHit::default()
        } else {
            self.prefix.lookup(&mut self.pool, prompt, salt)?
        };
        let bs = self.block_size();
        // A hit ends where a group of blocks sealed together ends: the
        // blocks the cache found by their tokens are taken only in groups
        // sealed together (a group still filled, or pieced together from
        // two sequences' blocks, is not), and a partial block (copied on
        // write) only where it is not in a group. Cut back, the hit is
        // given back and looked up again for what is kept, so the cache's
        // lock covers no more than the sequence holds.
        if let Some(storage) = self.storage.clone() {
            loop {
                let (held, whole) = (hit.blocks.len(), hit.tokens / bs);
                let full = storage.shareable_hit(&hit.blocks[..whole]);
                let keep = if full < whole {
                    full
                } else if storage.shareable_blocks(held) < held {
                    whole
                } else {
                    held
                };
                if keep == held {
                    break;
                }
                for &b in hit.blocks.iter().rev() {
                    self.pool.release(b)?;
                }
                if let Some(lock) = hit.lock.take() {
                    self.prefix.release(lock);
                }
                hit = if keep == 0 {
                    PrefixHit::default()
                } else {
                    self.prefix
                        .lookup(&mut self.pool, &prompt[..keep * bs + 1], salt)?
                };
            }
        }
        let cow = usize::from(!hit.tokens.is_multiple_of(bs));
        let needed = prompt.len().div_ceil(bs) - hit.blocks.len() + cow;
        if let Err(e) = self.ensure_free(needed) {
            for &b in hit.blocks.iter().rev() {
                self.pool.release(b)?;
            }
            if let Some(lock) = hit.lock {
                self.prefix.release(lock);
            }
            return Err(e);
        }
        self.stats.lookup_tokens += prompt.len() as u64;
        self.stats.hit_tokens += hit.tokens as u64;
        let id = SeqId(self.next_id);
        self.next_id += 1;
        self.seqs.insert(
            id,
            Sequence {
                tokens: prompt[..hit.tokens].to_vec(),
                table: hit.blocks,
                salt,
                lock: hit.lock,
                host: None,
                tables: SeqTables::new(self.storage.as_ref().map_or(0, |s| s.layers().len())),
            },
        );
        if let Some(storage) = &self.storage {
            // The hit is the new sequence's committed prefix: blocks of it
            // another sequence left staged (inside its window) are sealed
            // as that prefix makes them sealable.
            let s = self.seqs.get_mut(&id).expect("inserted above");
            storage.seal_blocks(&s.table, 0, hit.tokens, &mut s.tables)?;
        }
        self.append_reserved(id, &prompt[hit.tokens..])?;
        Ok((id, hit.tokens))
    }

    /// Blocks an append of `n` tokens to `s` takes from the pool.
    fn append_cost(&self, s: &Sequence, n: usize) -> Result<usize> {
        let bs = self.block_size();
        let len = s.tokens.len();
        let grow = (len + n).div_ceil(bs) - s.table.len();
        let copy = n > 0 && !len.is_multiple_of(bs) && self.pool.ref_count(s.table[len / bs])? > 1;
        Ok(grow + usize::from(copy))
    }

    /// Appends tokens (decode steps or a prompt chunk).
    pub fn append(&mut self, id: SeqId, tokens: &[u32]) -> Result<()> {
        let cost = self.append_cost(self.resident(id)?, tokens.len())?;
        self.ensure_free(cost)?;
        self.append_reserved(id, tokens)
    }

    /// Appends after the blocks were counted as free.
    fn append_reserved(&mut self, id: SeqId, tokens: &[u32]) -> Result<()> {
        let bs = self.block_size();
        for &t in tokens {
            let pos = self.seqs[&id].tokens.len();
            if pos.is_multiple_of(bs) {
                let b = self.take_block()?;
                self.seqs.get_mut(&id).expect("live").table.push(b);
            } else {
                self.make_exclusive(id, pos / bs)?;
            }
            let s = self.seqs.get_mut(&id).expect("live");
            let block = s.table[pos / bs];
            s.tokens.push(t);
            self.pool.tokens_mut(block)[pos % bs] = t;
        }
        Ok(())
    }

    /// Makes block `index` of `id`'s table safe to change: a shared block is
    /// copied (copy-on-write); an exclusive one that was cached loses its hash.
    fn make_exclusive(&mut self, id: SeqId, index: usize) -> Result<BlockId> {
        let block = self.seqs[&id].table[index];
        if self.pool.ref_count(block)? > 1 {
            let copy = self.take_block()?;
            self.pool.copy_tokens(block, copy);
            if let Some(storage) = &self.storage {
                storage.copy(block, copy)?;
            }
            self.pool.release(block)?;
            self.seqs.get_mut(&id).expect("live").table[index] = copy;
            self.stats.cow_copies += 1;
            return Ok(copy);
        }
        if let Some(hash) = self.pool.set_hash(block, None) {
            self.prefix.forget(block, hash);
        }
        Ok(block)
    }

    /// Writes the K and V rows of `layer` for the token at `position`
    /// (copying the block first if it is shared).
    pub fn write_kv(
        &mut self,
        id: SeqId,
        position: usize,
        layer: usize,
        keys: &[f32],
        values: &[f32],
    ) -> Result<()> {
        let s = self.resident(id)?;
        let storage = self.storage.clone().ok_or(PagedCacheError::NoStorage)?;
        if position >= s.tokens.len() {
            return Err(PagedCacheError::PositionOutOfRange {
                position,
                tokens: s.tokens.len(),
            });
        }
        let bs = self.block_size();
        let index = position / bs;
        // A group of blocks sealed together (a per-channel group over
        // several blocks) that the write stages again, or a whole group
        // shared with others whose written block is shared, is made this
        // sequence's own first, so that no block of it is ever sealed into
        // two groups.
        let group = storage.group_with(index);
        let sealed = storage.sealed_with(&s.table, index).len() > 1;
        let rewrite = group.len() > 1
            && group.end <= s.table.len()
            && self.pool.ref_count(s.table[index])? > 1;
        let with = if sealed || rewrite {
            group.start..group.end.min(s.table.len())
        } else {
            index..index + 1
        };
        let shared = with
            .clone()
            .filter(|&i| self.pool.ref_count(s.table[i]).is_ok_and(|c| c > 1))
            .count();
        self.ensure_free(shared)?;
        if with.len() > 1 {
            for i in with {
                self.make_exclusive(id, i)?;
            }
            storage.unseal(&self.seqs[&id].table, index)?;
        }
        let block = self.make_exclusive(id, index)?;
        storage.write(block, position % bs, layer, keys, values)
    }

    /// Seals the blocks of `id` that a step taking it from `before` to
    /// `after` committed tokens made sealable in its staged forms
    /// ([`BlockStorage::seal_blocks`]); returns the blocks sealed (one per
    /// layer part). Call it when the step commits.
    pub fn seal(&mut self, id: SeqId, before: usize, after: usize) -> Result<usize> {
        let s = self.resident(id)?;
        if before > after || after > s.tokens.len() {
            return Err(PagedCacheError::PositionOutOfRange {
                position: after,
                tokens: s.tokens.len(),
            });
        }
        let storage = self.storage.as_ref().ok_or(PagedCacheError::NoStorage)?;
        let s = self.seqs.get_mut(&id).expect("resident above");
        storage.seal_blocks(&s.table, before, after, &mut s.tables)
    }

    /// Whether the storage holds a form fitted per sequence (whose blocks
    /// the prefix cache never shares).
    fn per_sequence(&self) -> bool {
        self.storage.as_ref().is_some_and(|s| s.fits_per_sequence())
    }

    /// The tables the parts of a form fitted per sequence fitted on `id`'s
    /// rows (empty before its first seal, and for other forms), shared
    /// with its forks and freed with it.
    pub fn sequence_tables(&self, id: SeqId) -> Result<&SeqTables> {
        Ok(&self.seq(id)?.tables)
    }

    /// The written blocks of a group of blocks sealed together that `id`
    /// is still filling (see [`StoredPart::shareable_blocks`]), which a fork
    /// copies: positions `own.start..own.end` of its table.
    ///
    /// [`StoredPart::shareable_blocks`]: attention::stored::StoredPart::shareable_blocks
    fn unshareable(&self, s: &Sequence) -> std::ops::Range<usize> {
        let whole = s.tokens.len() / self.block_size();
        let keep = self
            .storage
            .as_ref()
            .map_or(whole, |st| st.shareable_blocks(whole));
        keep..whole
    }

    /// A new sequence sharing all of `id`'s blocks (parallel sampling, beam
    /// search), except the whole blocks of a group of blocks sealed
    /// together that `id` is still filling, which it copies (two sequences
    /// never seal one block into different groups).
    pub fn fork(&mut self, id: SeqId) -> Result<SeqId> {
        let s = self.resident(id)?.clone();
        let own = self.unshareable(&s);
        self.ensure_free(own.len())?;
        for &b in &s.table {
            self.pool.acquire(b)?;
        }
        let child = SeqId(self.next_id);
        self.next_id += 1;
        self.seqs.insert(child, Sequence { lock: None, ..s });
        for i in own {
            if let Err(e) = self.make_exclusive(child, i) {
                // No child is left sharing a group it could seal apart.
                self.free(child)?;
                return Err(e);
            }
        }
        Ok(child)
    }

    fn release_table(&mut self, table: &[BlockId]) -> Result<()> {
        // Reverse order: a sequence's tail blocks are the least likely to be
        // shared by a later prompt, so they should be evicted first.
        for &b in table.iter().rev() {
            self.pool.release(b)?;
        }
        Ok(())
    }

    /// Ends a sequence, returning its blocks (or host slots).
    pub fn free(&mut self, id: SeqId) -> Result<()> {
        let s = self
            .seqs
            .remove(&id)
            .ok_or(PagedCacheError::UnknownSequence(id))?;
        self.release_table(&s.table)?;
        if let Some(slots) = s.host {
            for slot in slots {
                self.host.data[slot as usize] = None;
                self.host.free.push(slot);
            }
        }
        if let Some(lock) = s.lock {
            self.prefix.release(lock);
        }
        Ok(())
    }

    /// Removes the last `n` tokens (speculative-decoding rollback); blocks
    /// left empty return to the pool.
    pub fn truncate(&mut self, id: SeqId, n: usize) -> Result<()> {
        let bs = self.block_size();
        let s = self.resident(id)?;
        let len = s.tokens.len();
        if n > len {
            return Err(PagedCacheError::PositionOutOfRange {
                position: n,
                tokens: len,
            });
        }
        if n == 0 {
            return Ok(());
        }
        let keep = (len - n).div_ceil(bs);
        if let Some(storage) = self.storage.clone() {
            // The kept blocks of a whole group of blocks sealed together
            // that the cut splits are made this sequence's own (a sealed
            // group's are staged again from their rows), so that no block
            // is ever sealed into two groups.
            let restaged = storage.cut_blocks(&s.table, len - n);
            if !restaged.is_empty() {
                let shared = restaged
                    .clone()
                    .filter(|&i| self.pool.ref_count(s.table[i]).is_ok_and(|c| c > 1))
                    .count();
                self.ensure_free(shared)?;
                for i in restaged {
                    self.make_exclusive(id, i)?;
                }
                storage.cut(&self.seqs[&id].table, len - n)?;
            }
        }
        let s = self.seqs.get_mut(&id).expect("live");
        s.tokens.truncate(len - n);
        let dropped = s.table.split_off(keep);
        self.release_table(&dropped)
    }

    /// Records the first `tokens` tokens of `id` (their K/V written) in the
    /// prefix cache (nothing where the storage holds a form fitted per
    /// sequence, whose blocks are not shared).
    pub fn cache_prefix(&mut self, id: SeqId, tokens: usize) -> Result<()> {
        let s = self.resident(id)?;
        if tokens > s.tokens.len() {
            return Err(PagedCacheError::PositionOutOfRange {
                position: tokens,
                tokens: s.tokens.len(),
            });
        }
        if self.per_sequence() {
            return Ok(());
        }
        let s = self.seqs.remove(&id).expect("live");
        let result = self
            .prefix
            .insert(&mut self.pool, &s.tokens[..tokens], &s.table, s.salt);
        self.seqs.insert(id, s);
        result
    }

    /// Evicts cached prefixes no sequence uses until `blocks` are reusable.
    pub fn evict(&mut self, blocks: usize) -> Result<usize> {
        let n = self.prefix.evict(&mut self.pool, blocks)?;
        self.stats.evicted += n as u64;
        Ok(n)
    }

    /// Moves a sequence's blocks to the host tier (preemption by swap).
    /// Blocks it shared are copied; the device copies stay with their other users.
    pub fn swap_out(&mut self, id: SeqId) -> Result<()> {
        let s = self.resident(id)?;
        let n = s.table.len();
        if self.host.available() < n {
            return Err(PagedCacheError::HostTierFull {
                needed: n,
                free: self.host.available(),
            });
        }
        let s = self.seqs.get_mut(&id).expect("live");
        let table = std::mem::take(&mut s.table);
        let lock = s.lock.take();
        let bs = self.pool.block_size();
        let mut slots = Vec::with_capacity(n);
        for &b in &table {
            let slot = self.host.take(bs);
            self.host.tokens[slot as usize * bs..][..bs].copy_from_slice(self.pool.tokens(b));
            if let Some(storage) = &self.storage {
                self.host.data[slot as usize] = Some(storage.snapshot(b)?);
            }
            slots.push(slot);
        }
        self.seqs.get_mut(&id).expect("live").host = Some(slots);
        self.release_table(&table)?;
        if let Some(lock) = lock {
            self.prefix.release(lock);
        }
        self.stats.swapped_out += n as u64;
        Ok(())
    }

    /// Brings a swapped-out sequence back into fresh device blocks.
    pub fn swap_in(&mut self, id: SeqId) -> Result<()> {
        let slots = self
            .seq(id)?
            .host
            .clone()
            .ok_or(PagedCacheError::NotSwapped(id))?;
        self.ensure_free(slots.len())?;
        let bs = self.pool.block_size();
        let mut table = Vec::with_capacity(slots.len());
        for &slot in &slots {
            let b = self.take_block()?;
            let range = slot as usize * bs..(slot as usize + 1) * bs;
            self.pool
                .tokens_mut(b)
                .copy_from_slice(&self.host.tokens[range]);
            if let (Some(storage), Some(data)) =
                (&self.storage, self.host.data[slot as usize].take())
            {
                storage.restore(b, data)?;
            }
            self.host.free.push(slot);
            table.push(b);
        }
        let s = self.seqs.get_mut(&id).expect("live");
        s.table = table;
        s.host = None;
        self.stats.swapped_in += slots.len() as u64;
        Ok(())
    }

    /// Blocks that hold content: in use, or cached while free.
    pub fn live_blocks(&self) -> Vec<BlockId> {
        (0..self.pool.num_blocks() as u32)
            .map(BlockId)
            .filter(|&b| {
                self.pool.ref_count(b).is_ok_and(|c| c > 0)
                    || self.pool.hash(b).is_ok_and(|h| h.is_some())
            })
            .collect()
    }

    /// One scrubbing pass over every block that holds content: device
    /// blocks in use or cached, and the host tier's swapped-out copies (a
    /// flip left there would meet a second one in the same word after the
    /// sequence is swapped back in).
    pub fn scrub(&mut self) -> Result<ScrubStats> {
        let storage = self.storage.as_ref().ok_or(PagedCacheError::NoStorage)?;
        let mut stats = ScrubStats::default();
        for b in self.live_blocks() {
            stats += storage.scrub(b)?;
        }
        for data in self.host.data.iter_mut().flatten() {
            stats += data.scrub()?;
        }
        Ok(stats)
    }

    /// Bytes the blocks in use hold, per layer form (K and V together; a
    /// layer whose K and V forms differ is listed under its key form),
    /// summed over those blocks from their stores' buffers.
    pub fn bytes_used(&self) -> Result<Vec<(kv_quant::CacheForm, usize)>> {
        let storage = self.storage.as_ref().ok_or(PagedCacheError::NoStorage)?;
        let mut per_form: Vec<(kv_quant::CacheForm, usize)> = Vec::new();
        for (layer, spec) in storage.layers().iter().enumerate() {
            let mut bytes = 0;
            for b in (0..self.pool.num_blocks() as u32).map(BlockId) {
                if self.pool.ref_count(b)? > 0 {
                    bytes += storage.block_layer_bytes(b, layer)?;
                }
            }
            match per_form.iter_mut().find(|(f, _)| *f == spec.key) {
                Some((_, b)) => *b += bytes,
                None => per_form.push((spec.key, bytes)),
            }
        }
        Ok(per_form)
    }

    /// Slots allocated but not holding a token of their sequence, summed over
    /// resident sequences (each wastes less than one block).
    pub fn wasted_slots(&self) -> usize {
        let bs = self.block_size();
        self.seqs
            .values()
            .filter(|s| s.host.is_none())
            .map(|s| s.table.len() * bs - s.tokens.len())
            .sum()
    }

    /// The CSR page table of `ids` (all resident), in that order.
    pub fn page_table(&self, ids: &[SeqId]) -> Result<PageTable> {
        let tables = ids
            .iter()
            .map(|&id| {
                let s = self.resident(id)?;
                Ok((s.table.as_slice(), s.tokens.len()))
            })
            .collect::<Result<Vec<_>>>()?;
        PageTable::from_tables(&tables, self.block_size())
    }

    /// Checks every invariant: the pool's; the prefix cache's; each block's
    /// count equals its users (sequence tables plus cache references); each
    /// resident sequence has exactly `⌈len / block_size⌉` blocks whose slots
    /// hold its tokens; host slots are free or used exactly once.
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        self.pool.check_invariants()?;
        self.prefix.check_invariants(&self.pool)?;
        let bs = self.block_size();
        let mut users = vec![0u32; self.pool.num_blocks()];
        self.prefix.for_each_held(&mut |b| users[b.index()] += 1);
        let mut host_used = vec![false; self.host.made];
        for &slot in &self.host.free {
            if std::mem::replace(&mut host_used[slot as usize], true) {
                return Err(format!("host slot {slot} is free twice"));
            }
        }
        for (id, s) in &self.seqs {
            if let Some(slots) = &s.host {
                if !s.table.is_empty() {
                    return Err(format!("{id} is swapped out but holds device blocks"));
                }
                if slots.len() != s.tokens.len().div_ceil(bs) {
                    return Err(format!("{id} has {} host slots", slots.len()));
                }
                for (i, &slot) in slots.iter().enumerate() {
                    if std::mem::replace(&mut host_used[slot as usize], true) {
                        return Err(format!("host slot {slot} is used twice"));
                    }
                    for (j, &t) in s.tokens[i * bs..].iter().take(bs).enumerate() {
                        if self.host.tokens[slot as usize * bs + j] != t {
                            return Err(format!(
                                "{id}: host slot {slot} lost token {}",
                                i * bs + j
                            ));
                        }
                    }
                }
                continue;
            }
            if s.table.len() != s.tokens.len().div_ceil(bs) {
                return Err(format!(
                    "{id} holds {} blocks for {} tokens",
                    s.table.len(),
                    s.tokens.len()
                ));
            }
            for &b in &s.table {
                users[b.index()] += 1;
            }
            for (pos, &t) in s.tokens.iter().enumerate() {
                if self.pool.tokens(s.table[pos / bs])[pos % bs] != t {
                    return Err(format!("{id}: position {pos} no longer holds token {t}"));
                }
            }
        }
        if host_used.iter().any(|u| !u) {
            return Err("a host slot is neither free nor used".into());
        }
        let made = self.host.made;
        if made > self.host.capacity
            || self.host.tokens.len() != made * bs
            || self.host.data.len() != made
        {
            return Err(format!(
                "{made} host slots made of {}, holding {} tokens and {} blocks",
                self.host.capacity,
                self.host.tokens.len(),
                self.host.data.len()
            ));
        }
        for (i, &n) in users.iter().enumerate() {
            let count = self
                .pool
                .ref_count(BlockId(i as u32))
                .map_err(|e| e.to_string())?;
            if count != n {
                return Err(format!("block #{i} has count {count} but {n} users"));
            }
        }
        Ok(())
    }
}
