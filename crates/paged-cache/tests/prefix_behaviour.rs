//! Behavioural tests that both prefix caches pass, run through the
//! manager: hits are prefixes whose blocks hold the right tokens, capped at
//! prompt length − 1; salts isolate; cached content survives until reused,
//! least recently used first; eviction gives every block back. Plus what
//! only the radix tree can do: hits shorter than a block, and hits ending
//! inside a block (copied before the new sequence writes into it).

use paged_cache::{
    CacheConfig, HashPrefixCache, KvCacheManager, PagedCacheError, PrefixCache, RadixPrefixCache,
};

const BS: usize = 4;

fn cache<P: PrefixCache>(make: fn(usize) -> P, blocks: usize) -> KvCacheManager<P> {
    let config = CacheConfig {
        num_blocks: blocks,
        block_size: BS,
        host_blocks: 0,
    };
    KvCacheManager::new(config, make(BS)).unwrap()
}

fn prompt(seed: u32, len: usize) -> Vec<u32> {
    (0..len as u32).map(|i| seed * 1000 + i).collect()
}

fn check<P: PrefixCache>(c: &KvCacheManager<P>) {
    c.check_invariants().unwrap();
}

/// Runs one behavioural test on both implementations.
macro_rules! both {
    ($name:ident, $body:ident) => {
        mod $name {
            #[test]
            fn hash() {
                super::$body(paged_cache::HashPrefixCache::new, true);
            }
            #[test]
            fn radix() {
                super::$body(paged_cache::RadixPrefixCache::new, false);
            }
        }
    };
}

fn hits_are_prefixes_capped_below_the_prompt<P: PrefixCache>(
    make: fn(usize) -> P,
    whole_blocks: bool,
) {
    let mut c = cache(make, 32);
    let p = prompt(1, 4 * BS); // block-aligned: the last block must not be a hit
    let (a, hit) = c.add_sequence(&p, 0).unwrap();
    assert_eq!(hit, 0);
    c.cache_prefix(a, p.len()).unwrap();
    check(&c);
    let (b, hit) = c.add_sequence(&p, 0).unwrap();
    assert!(hit < p.len(), "a hit leaves at least one token to compute");
    assert_eq!(hit, if whole_blocks { 3 * BS } else { p.len() - 1 });
    assert_eq!(c.tokens(b).unwrap(), p.as_slice());
    // A longer prompt with the same start hits the whole cached prompt.
    let mut longer = p.clone();
    longer.extend([7, 7, 7]);
    let (_, hit) = c.add_sequence(&longer, 0).unwrap();
    assert_eq!(hit, p.len());
    // A prompt that differs in its first token hits nothing.
    let mut other = p.clone();
    other[0] += 1;
    let (_, hit) = c.add_sequence(&other, 0).unwrap();
    assert_eq!(hit, 0);
    // One that differs inside block 2 hits the blocks before it (whole
    // blocks) or every token before the difference (radix).
    let mut diverging = p.clone();
    diverging[2 * BS + 1] += 1;
    let (_, hit) = c.add_sequence(&diverging, 0).unwrap();
    assert_eq!(hit, if whole_blocks { 2 * BS } else { 2 * BS + 1 });
    check(&c);
}
both!(hits, hits_are_prefixes_capped_below_the_prompt);

fn salts_never_share<P: PrefixCache>(make: fn(usize) -> P, _: bool) {
    let mut c = cache(make, 16);
    let p = prompt(2, 3 * BS);
    let (a, _) = c.add_sequence(&p, 11).unwrap();
    c.cache_prefix(a, p.len()).unwrap();
    assert_eq!(c.add_sequence(&p, 12).unwrap().1, 0);
    assert!(c.add_sequence(&p, 11).unwrap().1 > 0);
    check(&c);
}
both!(salts, salts_never_share);

fn freed_content_stays_cached_until_reused_lru_first<P: PrefixCache>(
    make: fn(usize) -> P,
    _: bool,
) {
    // 13 blocks: A and B take 3 each.
    let mut c = cache(make, 13);
    let (pa, pb) = (prompt(3, 3 * BS), prompt(4, 3 * BS));
    for p in [&pa, &pb] {
        let (s, _) = c.add_sequence(p, 0).unwrap();
        c.cache_prefix(s, p.len()).unwrap();
        c.free(s).unwrap();
    }
    check(&c);
    // Use A again: it becomes the most recently used.
    let (s, hit) = c.add_sequence(&pa, 0).unwrap();
    assert!(hit >= 2 * BS);
    c.free(s).unwrap();
    // Unrelated sequences take 10 blocks: the 7 never-cached ones, then
    // cached ones, least recently used first: B's before A's. (The hash
    // cache evicts block by block, a sequence's tail blocks first, so B's
    // first block may survive; the radix tree evicts B's whole leaf.)
    let mut fill = Vec::new();
    for (i, blocks) in [3, 3, 3, 1].into_iter().enumerate() {
        fill.push(
            c.add_sequence(&prompt(10 + i as u32, blocks * BS), 0)
                .unwrap()
                .0,
        );
    }
    check(&c);
    for s in fill {
        c.free(s).unwrap();
    }
    let (sb, hit_b) = c.add_sequence(&pb, 0).unwrap();
    let (sa, hit_a) = c.add_sequence(&pa, 0).unwrap();
    assert!(hit_a >= 2 * BS, "A survived: {hit_a}");
    assert!(hit_b <= BS && hit_b < hit_a, "B was evicted first: {hit_b}");
    c.free(sa).unwrap();
    c.free(sb).unwrap();
    check(&c);
}
both!(lru, freed_content_stays_cached_until_reused_lru_first);

fn eviction_gives_every_block_back<P: PrefixCache>(make: fn(usize) -> P, _: bool) {
    let mut c = cache(make, 16);
    let ids: Vec<_> = (0..4)
        .map(|i| {
            let p = prompt(20 + i, 2 * BS + 1);
            let (s, _) = c.add_sequence(&p, 0).unwrap();
            c.cache_prefix(s, p.len()).unwrap();
            s
        })
        .collect();
    for s in ids {
        c.free(s).unwrap();
    }
    c.evict(usize::MAX).unwrap();
    check(&c);
    assert_eq!(c.pool().num_free(), 16);
    assert_eq!(c.prefix_cache().cached_blocks(), 0);
    assert_eq!(c.add_sequence(&prompt(20, 2 * BS + 1), 0).unwrap().1, 0);
    // And an exhausted pool is an error that changes nothing.
    let big = prompt(30, 16 * BS + 1);
    let before = c.pool().num_free();
    assert!(matches!(
        c.add_sequence(&big, 0),
        Err(PagedCacheError::PoolExhausted { .. })
    ));
    assert_eq!(c.pool().num_free(), before);
    check(&c);
}
both!(eviction, eviction_gives_every_block_back);

#[test]
fn radix_hits_prefixes_shorter_than_a_block_and_copies_the_shared_partial_block() {
    let mut c = cache(RadixPrefixCache::new, 16);
    let p = prompt(5, BS - 1);
    let (a, _) = c.add_sequence(&p, 0).unwrap();
    c.cache_prefix(a, p.len()).unwrap();
    let mut q = p[..2].to_vec();
    q.extend([42, 43, 44]);
    let (b, hit) = c.add_sequence(&q, 0).unwrap();
    assert_eq!(hit, 2, "two tokens of a partial block");
    assert_eq!(
        c.stats().cow_copies,
        1,
        "b wrote after the hit into a shared block"
    );
    assert_eq!(c.tokens(a).unwrap(), p.as_slice());
    assert_eq!(c.tokens(b).unwrap(), q.as_slice());
    c.check_invariants().unwrap();
    // The hash cache only ever shares whole blocks.
    let mut h = cache(HashPrefixCache::new, 16);
    let (a, _) = h.add_sequence(&p, 0).unwrap();
    h.cache_prefix(a, p.len()).unwrap();
    assert_eq!(h.add_sequence(&q, 0).unwrap().1, 0);
}

#[test]
fn radix_locks_keep_used_prefixes_from_eviction() {
    let mut c = cache(RadixPrefixCache::new, 8);
    let p = prompt(6, 2 * BS + 1);
    let (a, _) = c.add_sequence(&p, 0).unwrap();
    c.cache_prefix(a, p.len()).unwrap();
    c.free(a).unwrap();
    let (b, hit) = c.add_sequence(&p, 0).unwrap();
    assert_eq!(hit, 2 * BS);
    // b locks the two blocks it uses; the cached tail past them (the third
    // block, which b did not match) can go, and nothing else can.
    assert_eq!(c.prefix_cache().evictable_blocks(c.pool()), 1);
    assert_eq!(c.evict(usize::MAX).unwrap(), 1);
    assert_eq!(c.prefix_cache().evictable_blocks(c.pool()), 0);
    assert_eq!(c.evict(usize::MAX).unwrap(), 0);
    assert_eq!(c.tokens(b).unwrap(), p.as_slice());
    c.check_invariants().unwrap();
    c.free(b).unwrap();
    assert!(c.prefix_cache().evictable_blocks(c.pool()) > 0);
    assert!(c.evict(usize::MAX).unwrap() > 0);
    assert_eq!(c.pool().num_free(), 8);
    c.check_invariants().unwrap();
}

fn too_few_blocks_are_refused<P: PrefixCache>(make: fn(usize) -> P, _: bool) {
    let mut pool = paged_cache::BlockPool::new(8, BS).unwrap();
    let mut prefix = make(BS);
    let blocks = [pool.allocate().unwrap().block];
    let tokens = prompt(7, 2 * BS);
    assert!(matches!(
        prefix.insert(&mut pool, &tokens, &blocks, 0),
        Err(PagedCacheError::ShapeMismatch { .. })
    ));
    prefix.check_invariants(&pool).unwrap();
    assert_eq!(prefix.cached_blocks(), 0);
}
both!(short_insert, too_few_blocks_are_refused);
