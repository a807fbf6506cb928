//! [`BlockPool`]: fixed-size KV blocks addressed by index, each with a
//! reference count, an optional content hash and the token ids of its
//! slots, and an O(1) doubly linked free list threaded through the blocks
//! themselves (vLLM v1's `FreeKVCacheBlockQueue` design).
//!
//! Free-list order is the eviction order of cached content: allocation pops
//! the front; a block whose count drops to zero goes to the back when it
//! holds a content hash (it stays findable until reused, least recently
//! freed first) and to the front when it does not (nothing is lost by
//! reusing it at once).

use std::fmt;

use crate::error::{PagedCacheError, Result};
use crate::hash::BlockHash;

/// Index of a block in its pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct BlockId(pub u32);

impl BlockId {
    /// The index as `usize`.
    pub const fn index(self) -> usize {
        self.0 as usize
    }
}

impl fmt::Display for BlockId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "#{}", self.0)
    }
}

/// End of the free list.
const NIL: u32 = u32::MAX;

/// The most token slots a pool (or a host tier) may have: one u32 token id
/// each, 8 GiB at most, refused above before anything is allocated.
pub const MAX_SLOTS: usize = 1 << 31;

/// `blocks × block_size` slots, or an error naming `name` past [`MAX_SLOTS`].
pub(crate) fn check_slots(name: &'static str, blocks: usize, block_size: usize) -> Result<usize> {
    blocks
        .checked_mul(block_size)
        .filter(|&s| s <= MAX_SLOTS)
        .ok_or_else(|| PagedCacheError::InvalidParameter {
            name,
            reason: format!(
                "{blocks} blocks of {block_size} tokens: more than {MAX_SLOTS} token slots"
            ),
        })
}

#[derive(Clone, Debug)]
struct BlockMeta {
    ref_count: u32,
    prev: u32,
    next: u32,
    hash: Option<BlockHash>,
}

/// A block taken from the free list.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Allocated {
    /// The block, now with reference count 1 and no hash.
    pub block: BlockId,
    /// The content hash it held while free (lazily evicted now): whoever maps
    /// hashes to blocks must forget it.
    pub evicted: Option<BlockHash>,
}

/// A pool of `num_blocks` blocks of `block_size` token slots.
#[derive(Clone, Debug)]
pub struct BlockPool {
    block_size: usize,
    meta: Vec<BlockMeta>,
    tokens: Vec<u32>,
    head: u32,
    tail: u32,
    free: usize,
}

impl BlockPool {
    /// A pool with every block free, in index order.
    pub fn new(num_blocks: usize, block_size: usize) -> Result<Self> {
        if block_size == 0 {
            return Err(PagedCacheError::InvalidParameter {
                name: "block_size",
                reason: "a block holds at least one token".into(),
            });
        }
        if num_blocks >= NIL as usize {
            return Err(PagedCacheError::InvalidParameter {
                name: "num_blocks",
                reason: format!("at most {} blocks", NIL - 1),
            });
        }
        let slots = check_slots("num_blocks", num_blocks, block_size)?;
        let mut meta = Vec::new();
        meta.try_reserve_exact(num_blocks)
            .map_err(|_| PagedCacheError::OutOfMemory {
                what: "block entries",
                count: num_blocks,
            })?;
        meta.extend((0..num_blocks as u32).map(|i| BlockMeta {
            ref_count: 0,
            prev: if i == 0 { NIL } else { i - 1 },
            next: if i + 1 == num_blocks as u32 {
                NIL
            } else {
                i + 1
            },
            hash: None,
        }));
        Ok(Self {
            block_size,
            meta,
            tokens: crate::error::try_vec(slots, 0, "token slots")?,
            head: if num_blocks == 0 { NIL } else { 0 },
            tail: if num_blocks == 0 {
                NIL
            } else {
                num_blocks as u32 - 1
            },
            free: num_blocks,
        })
    }

    /// Token slots per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks in the pool.
    pub fn num_blocks(&self) -> usize {
        self.meta.len()
    }

    /// Blocks on the free list (cached-but-free blocks included).
    pub fn num_free(&self) -> usize {
        self.free
    }

    /// Blocks with a positive reference count.
    pub fn num_used(&self) -> usize {
        self.meta.len() - self.free
    }

    fn meta(&self, block: BlockId) -> Result<&BlockMeta> {
        self.meta
            .get(block.index())
            .ok_or(PagedCacheError::BlockOutOfRange {
                block: block.0,
                blocks: self.meta.len(),
            })
    }

    /// The reference count of `block`.
    pub fn ref_count(&self, block: BlockId) -> Result<u32> {
        Ok(self.meta(block)?.ref_count)
    }

    /// The content hash of `block`, if it has one.
    pub fn hash(&self, block: BlockId) -> Result<Option<BlockHash>> {
        Ok(self.meta(block)?.hash)
    }

    /// Token ids of `block`'s slots (slots past a sequence's length hold
    /// whatever was last written there).
    pub fn tokens(&self, block: BlockId) -> &[u32] {
        &self.tokens[block.index() * self.block_size..][..self.block_size]
    }

    pub(crate) fn tokens_mut(&mut self, block: BlockId) -> &mut [u32] {
        &mut self.tokens[block.index() * self.block_size..][..self.block_size]
    }

    fn unlink(&mut self, i: u32) {
        let BlockMeta { prev, next, .. } = self.meta[i as usize];
        match prev {
            NIL => self.head = next,
            p => self.meta[p as usize].next = next,
        }
        match next {
            NIL => self.tail = prev,
            n => self.meta[n as usize].prev = prev,
        }
        self.meta[i as usize].prev = NIL;
        self.meta[i as usize].next = NIL;
        self.free -= 1;
    }

    fn push_back(&mut self, i: u32) {
        self.meta[i as usize].prev = self.tail;
        self.meta[i as usize].next = NIL;
        match self.tail {
            NIL => self.head = i,
            t => self.meta[t as usize].next = i,
        }
        self.tail = i;
        self.free += 1;
    }

    fn push_front(&mut self, i: u32) {
        self.meta[i as usize].next = self.head;
        self.meta[i as usize].prev = NIL;
        match self.head {
            NIL => self.tail = i,
            h => self.meta[h as usize].prev = i,
        }
        self.head = i;
        self.free += 1;
    }

    /// Takes the front block of the free list (reference count 1). A block
    /// that still held cached content loses its hash, returned in
    /// [`Allocated::evicted`].
    #[inline]
    pub fn allocate(&mut self) -> Result<Allocated> {
        let i = self.head;
        if i == NIL {
            return Err(PagedCacheError::PoolExhausted { needed: 1, free: 0 });
        }
        self.unlink(i);
        let meta = &mut self.meta[i as usize];
        meta.ref_count = 1;
        Ok(Allocated {
            block: BlockId(i),
            evicted: meta.hash.take(),
        })
    }

    /// Adds a reference to `block`. A free block (cached content found by a
    /// prefix lookup) leaves the free list with its hash kept.
    #[inline]
    pub fn acquire(&mut self, block: BlockId) -> Result<()> {
        let count = self.meta(block)?.ref_count;
        if count == 0 {
            self.unlink(block.0);
        }
        self.meta[block.index()].ref_count = count + 1;
        Ok(())
    }

    /// Drops a reference; at zero the block joins the free list (back when
    /// hashed, front otherwise) and `true` is returned.
    #[inline]
    pub fn release(&mut self, block: BlockId) -> Result<bool> {
        let meta = self.meta(block)?;
        match meta.ref_count {
            0 => Err(PagedCacheError::DoubleFree(block)),
            1 => {
                let hashed = meta.hash.is_some();
                self.meta[block.index()].ref_count = 0;
                if hashed {
                    self.push_back(block.0);
                } else {
                    self.push_front(block.0);
                }
                Ok(true)
            }
            n => {
                self.meta[block.index()].ref_count = n - 1;
                Ok(false)
            }
        }
    }

    /// Copies `src`'s token slots into `dst`'s (copy-on-write).
    pub(crate) fn copy_tokens(&mut self, src: BlockId, dst: BlockId) {
        let bs = self.block_size;
        self.tokens
            .copy_within(src.index() * bs..(src.index() + 1) * bs, dst.index() * bs);
    }

    /// Sets (or with `None` clears) `block`'s content hash, returning the old one.
    pub(crate) fn set_hash(
        &mut self,
        block: BlockId,
        hash: Option<BlockHash>,
    ) -> Option<BlockHash> {
        std::mem::replace(&mut self.meta[block.index()].hash, hash)
    }

    /// The free list, front (next to be allocated) first.
    pub fn free_list(&self) -> FreeList<'_> {
        FreeList {
            pool: self,
            at: self.head,
        }
    }

    /// Checks the pool's own invariants: the free list is a well-linked
    /// chain of exactly the blocks with count zero, each once, and `free`
    /// counts it.
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        let mut seen = vec![false; self.meta.len()];
        let (mut prev, mut at, mut n) = (NIL, self.head, 0);
        while at != NIL {
            let m = self
                .meta
                .get(at as usize)
                .ok_or(format!("free list links to block {at} outside the pool"))?;
            if std::mem::replace(&mut seen[at as usize], true) {
                return Err(format!("block {at} is on the free list twice"));
            }
            if m.ref_count != 0 {
                return Err(format!("block {at} is free with count {}", m.ref_count));
            }
            if m.prev != prev {
                return Err(format!("block {at} links back to {} not {prev}", m.prev));
            }
            prev = at;
            at = m.next;
            n += 1;
        }
        if self.tail != prev {
            return Err(format!("tail is {} but the list ends at {prev}", self.tail));
        }
        if n != self.free {
            return Err(format!(
                "{n} blocks on the free list, {} counted",
                self.free
            ));
        }
        for (i, m) in self.meta.iter().enumerate() {
            if m.ref_count == 0 && !seen[i] {
                return Err(format!("block {i} has count 0 but is not on the free list"));
            }
        }
        Ok(())
    }
}

/// Iterator over the free list (see [`BlockPool::free_list`]).
#[derive(Debug)]
pub struct FreeList<'a> {
    pool: &'a BlockPool,
    at: u32,
}

impl Iterator for FreeList<'_> {
    type Item = BlockId;

    fn next(&mut self) -> Option<BlockId> {
        (self.at != NIL).then(|| {
            let block = BlockId(self.at);
            self.at = self.pool.meta[self.at as usize].next;
            block
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocation_order_follows_the_free_list() {
        let mut pool = BlockPool::new(4, 16).unwrap();
        let a = pool.allocate().unwrap().block;
        let b = pool.allocate().unwrap().block;
        assert_eq!((a, b), (BlockId(0), BlockId(1)));
        assert_eq!(pool.num_free(), 2);
        // Unhashed blocks go to the front: reused first.
        assert!(pool.release(a).unwrap());
        assert_eq!(
            pool.free_list().collect::<Vec<_>>(),
            [BlockId(0), BlockId(2), BlockId(3)]
        );
        // Hashed blocks go to the back: kept longest.
        pool.set_hash(b, Some(BlockHash([7; 32])));
        assert!(pool.release(b).unwrap());
        assert_eq!(pool.free_list().last(), Some(BlockId(1)));
        pool.check_invariants().unwrap();
        // Acquiring a free hashed block takes it out of the middle of the list.
        pool.acquire(BlockId(1)).unwrap();
        assert_eq!(pool.hash(BlockId(1)).unwrap(), Some(BlockHash([7; 32])));
        pool.release(BlockId(1)).unwrap();
        // Allocation drains the front; the hashed block comes last and reports its hash.
        let order: Vec<_> = (0..4).map(|_| pool.allocate().unwrap()).collect();
        assert_eq!(order[3].block, BlockId(1));
        assert_eq!(order[3].evicted, Some(BlockHash([7; 32])));
        assert!(order[..3].iter().all(|a| a.evicted.is_none()));
        assert!(matches!(
            pool.allocate(),
            Err(PagedCacheError::PoolExhausted { .. })
        ));
        pool.check_invariants().unwrap();
    }

    #[test]
    fn double_free_and_bad_indices_are_errors() {
        let mut pool = BlockPool::new(2, 4).unwrap();
        let a = pool.allocate().unwrap().block;
        pool.acquire(a).unwrap();
        assert!(!pool.release(a).unwrap());
        assert!(pool.release(a).unwrap());
        assert!(matches!(pool.release(a), Err(PagedCacheError::DoubleFree(b)) if b == a));
        assert!(matches!(
            pool.acquire(BlockId(9)),
            Err(PagedCacheError::BlockOutOfRange { .. })
        ));
        assert!(BlockPool::new(2, 0).is_err());
        let empty = BlockPool::new(0, 4).unwrap();
        empty.check_invariants().unwrap();
    }
}
