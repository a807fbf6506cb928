//! Chained block hashes and [`HashPrefixCache`], the prefix cache of vLLM
//! v1: a full block is identified by the SHA-256 of its parent block's hash,
//! a salt and its token ids, so equal hashes mean equal whole prefixes.
//! Blocks keep their hash while free and are evicted lazily, when the pool
//! hands them out again.
//!
//! The hash is SHA-256 (`sha2`), over a fixed byte encoding, so values are
//! stable across releases and platforms (pinned by a test against Python's
//! `hashlib`); it is not `DefaultHasher`, whose output may change.

use std::collections::HashMap;
use std::fmt;
use std::hash::{BuildHasherDefault, Hasher};

use sha2::{Digest, Sha256};

use crate::error::Result;
use crate::pool::{BlockId, BlockPool};
use crate::prefix::{PrefixCache, PrefixHit, PrefixLock};

/// Domain tag that starts every hashed message.
const DOMAIN: &[u8] = b"reliable-kv/paged-cache/block/v1";

/// The SHA-256 content hash of a full block and everything before it.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct BlockHash(pub [u8; 32]);

impl std::hash::Hash for BlockHash {
    fn hash<H: Hasher>(&self, state: &mut H) {
        // The bytes alone, without the length prefix a slice would add, so
        // the index's hasher sees the digest's first bytes.
        state.write(&self.0);
    }
}

impl BlockHash {
    /// The hash of a block holding `tokens`, after the block hashed as
    /// `parent` (`None` for the first block), under `salt`:
    /// `SHA-256(DOMAIN ‖ has_parent ‖ parent ‖ salt_le ‖ len_le ‖ tokens_le)`,
    /// where `DOMAIN` is `reliable-kv/paged-cache/block/v1`, `has_parent` one
    /// byte (0 or 1), `parent` 32 bytes (zeros for none), `salt` and the
    /// token count 8 little-endian bytes each, then each token as 4.
    pub fn chain(parent: Option<&BlockHash>, salt: u64, tokens: &[u32]) -> BlockHash {
        let mut h = Sha256::new();
        h.update(DOMAIN);
        h.update([u8::from(parent.is_some())]);
        h.update(parent.map_or([0; 32], |p| p.0));
        h.update(salt.to_le_bytes());
        h.update((tokens.len() as u64).to_le_bytes());
        let mut buf = [0u8; 256];
        for chunk in tokens.chunks(64) {
            for (o, t) in buf.chunks_exact_mut(4).zip(chunk) {
                o.copy_from_slice(&t.to_le_bytes());
            }
            h.update(&buf[..4 * chunk.len()]);
        }
        BlockHash(h.finalize().into())
    }
}

impl fmt::Debug for BlockHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for b in &self.0[..8] {
            write!(f, "{b:02x}")?;
        }
        f.write_str("…")
    }
}

/// A map hasher for keys that are already uniform hashes: it keeps the
/// first eight bytes written (the map is internal, so its hash never leaves
/// the process and need not be stable).
#[derive(Default)]
struct TakeFirst8(u64);

impl Hasher for TakeFirst8 {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        // Keys are `BlockHash`es, written once as their 32 digest bytes.
        for (i, &b) in bytes.iter().take(8).enumerate() {
            self.0 ^= u64::from(b) << (8 * i);
        }
    }
}

type HashIndex = HashMap<BlockHash, BlockId, BuildHasherDefault<TakeFirst8>>;

/// vLLM-style prefix caching by chained block hashes (see the module docs).
/// Only full blocks are cached, so hits are whole blocks.
#[derive(Clone, Debug)]
pub struct HashPrefixCache {
    block_size: usize,
    index: HashIndex,
}

impl HashPrefixCache {
    /// An empty cache for blocks of `block_size` tokens.
    pub fn new(block_size: usize) -> Self {
        Self {
            block_size,
            index: HashIndex::default(),
        }
    }

    /// The block cached under `hash`, if any.
    pub fn get(&self, hash: &BlockHash) -> Option<BlockId> {
        self.index.get(hash).copied()
    }
}

impl PrefixCache for HashPrefixCache {
    fn name(&self) -> &'static str {
        "hash"
    }

    fn lookup(&mut self, pool: &mut BlockPool, tokens: &[u32], salt: u64) -> Result<PrefixHit> {
        let bs = self.block_size;
        let mut hit = PrefixHit::default();
        let mut parent = None;
        for block_tokens in tokens[..tokens.len().saturating_sub(1)].chunks_exact(bs) {
            let hash = BlockHash::chain(parent.as_ref(), salt, block_tokens);
            let Some(&block) = self.index.get(&hash) else {
                break;
            };
            pool.acquire(block)?;
            hit.blocks.push(block);
            hit.tokens += bs;
            parent = Some(hash);
        }
        Ok(hit)
    }

    fn insert(
        &mut self,
        pool: &mut BlockPool,
        tokens: &[u32],
        blocks: &[BlockId],
        salt: u64,
    ) -> Result<()> {
        let needed = tokens.len() / self.block_size;
        if blocks.len() < needed {
            return Err(crate::PagedCacheError::ShapeMismatch {
                what: "blocks of the inserted tokens",
                found: blocks.len(),
                expected: needed,
            });
        }
        let mut parent = None;
        for (block_tokens, &block) in tokens.chunks_exact(self.block_size).zip(blocks) {
            let hash = BlockHash::chain(parent.as_ref(), salt, block_tokens);
            parent = Some(hash);
            if pool.hash(block)?.is_some() {
                continue; // Already cached (a hit, or inserted before).
            }
            if let std::collections::hash_map::Entry::Vacant(e) = self.index.entry(hash) {
                // The first block with this content is the cached one; later
                // duplicates stay unhashed and are reused first when freed.
                e.insert(block);
                pool.set_hash(block, Some(hash));
            }
        }
        Ok(())
    }

    fn release(&mut self, _: PrefixLock) {}

    fn forget(&mut self, block: BlockId, hash: BlockHash) {
        if self.index.get(&hash) == Some(&block) {
            self.index.remove(&hash);
        }
    }

    fn evict(&mut self, pool: &mut BlockPool, blocks: usize) -> Result<usize> {
        // Free hashed blocks are already reusable (lazy eviction); an
        // explicit eviction drops the least recently freed ones' hashes.
        let victims: Vec<BlockId> = pool
            .free_list()
            .filter(|&b| matches!(pool.hash(b), Ok(Some(_))))
            .take(blocks)
            .collect();
        for &b in &victims {
            if let Some(hash) = pool.set_hash(b, None) {
                self.forget(b, hash);
            }
        }
        Ok(victims.len())
    }

    fn for_each_held(&self, _: &mut dyn FnMut(BlockId)) {
        // Cached blocks are found through the pool's free list; the index
        // holds no references.
    }

    fn cached_blocks(&self) -> usize {
        self.index.len()
    }

    fn check_invariants(&self, pool: &BlockPool) -> std::result::Result<(), String> {
        for (hash, &block) in &self.index {
            match pool.hash(block) {
                Ok(Some(h)) if h == *hash => {}
                other => {
                    return Err(format!(
                        "index maps {hash:?} to {block}, which holds {other:?}"
                    ));
                }
            }
        }
        for i in 0..pool.num_blocks() {
            let block = BlockId(i as u32);
            if let Ok(Some(h)) = pool.hash(block)
                && self.index.get(&h) != Some(&block)
            {
                return Err(format!(
                    "{block} holds {h:?}, which the index maps elsewhere"
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hash_values_are_pinned_to_an_independent_sha256() {
        // Computed with Python's hashlib over the byte encoding of
        // `BlockHash::chain`'s doc with: `D = b"reliable-kv/paged-cache/block/v1"`;
        // `chain(p, salt, toks) = sha256(D + bytes([p is not None]) + (p or bytes(32))
        //   + pack("<Q", salt) + pack("<Q", len(toks)) + b"".join(pack("<I", t) for t in toks))`.
        let first = BlockHash::chain(None, 0, &[1, 2, 3, 4]);
        let second = BlockHash::chain(Some(&first), 7, &[5, 6, 7, 8]);
        let hex = |h: BlockHash| h.0.iter().map(|b| format!("{b:02x}")).collect::<String>();
        assert_eq!(hex(first), PINNED_FIRST);
        assert_eq!(hex(second), PINNED_SECOND);
        // Salt, parent and order all change the hash.
        assert_ne!(BlockHash::chain(None, 1, &[1, 2, 3, 4]), first);
        assert_ne!(BlockHash::chain(None, 0, &[2, 1, 3, 4]), first);
        assert_ne!(BlockHash::chain(Some(&second), 0, &[1, 2, 3, 4]), first);
    }

    #[test]
    fn the_index_hasher_sees_the_digest_bytes() {
        // A length prefix hashed first made every key collide once (a
        // 40x slower lookup); the index must hash the digest itself.
        use std::hash::BuildHasher;
        let build = BuildHasherDefault::<TakeFirst8>::default();
        let (x, y) = (
            BlockHash::chain(None, 0, &[1]),
            BlockHash::chain(None, 0, &[2]),
        );
        let first8 = u64::from_le_bytes(x.0[..8].try_into().unwrap());
        assert_eq!(build.hash_one(x), first8);
        assert_ne!(build.hash_one(x), build.hash_one(y));
    }

    const PINNED_FIRST: &str = "ad66245ed0f7988c9c17c35a3c20a910e21d9d62d6223bf5d4caa1b553a46e1c";
    const PINNED_SECOND: &str = "52dac077e1b734885e0862a98d88ff1e0796a8bb43152d84a4eba7e457a00396";
}
