//! 1,000,000 random operations per prefix cache on a metadata-only cache,
//! with the cheap invariants checked after every operation and the full
//! [`KvCacheManager::check_invariants`] every 5,000. Runs in release mode
//! under `cargo xtask test` (and `.ci/run`); in a debug build it is ignored.

use gf2_codes::channel::FaultRng;
use paged_cache::{
    CacheConfig, HashPrefixCache, KvCacheManager, PagedCacheError, PrefixCache, RadixPrefixCache,
    SeqId,
};

const OPS: usize = 1_000_000;
const BS: usize = 16;
const BLOCKS: usize = 256;
const HOST: usize = 128;

fn long_run<P: PrefixCache>(prefix: P, seed: u64) {
    let config = CacheConfig {
        num_blocks: BLOCKS,
        block_size: BS,
        host_blocks: HOST,
    };
    let mut cache = KvCacheManager::new(config, prefix).unwrap();
    let mut rng = FaultRng::new(seed);
    let bases: Vec<Vec<u32>> = (0..6)
        .map(|_| (0..160).map(|_| rng.below(4) as u32).collect())
        .collect();
    let mut live: Vec<SeqId> = Vec::new();
    // Successful operations per kind, to show every kind really ran.
    let mut done = [0u64; 9];
    for i in 0..OPS {
        let pick = |rng: &mut FaultRng, live: &[SeqId]| {
            (!live.is_empty()).then(|| live[rng.below(live.len() as u64) as usize])
        };
        let kind = rng.below(9) as usize;
        let ok = match kind {
            0 => {
                let base = &bases[rng.below(6) as usize];
                let len = 1 + rng.below(150) as usize;
                match cache.add_sequence(&base[..len], rng.below(2)) {
                    Ok((id, _)) => {
                        live.push(id);
                        true
                    }
                    Err(PagedCacheError::PoolExhausted { .. }) => false,
                    Err(e) => panic!("add: {e}"),
                }
            }
            1 => pick(&mut rng, &live).is_some_and(|id| {
                let tokens: Vec<u32> = (0..1 + rng.below(20))
                    .map(|_| rng.below(4) as u32)
                    .collect();
                match cache.append(id, &tokens) {
                    Ok(()) => true,
                    Err(PagedCacheError::PoolExhausted { .. } | PagedCacheError::SwappedOut(_)) => {
                        false
                    }
                    Err(e) => panic!("append: {e}"),
                }
            }),
            2 => pick(&mut rng, &live).is_some_and(|id| match cache.fork(id) {
                Ok(child) => {
                    live.push(child);
                    true
                }
                Err(PagedCacheError::SwappedOut(_)) => false,
                Err(e) => panic!("fork: {e}"),
            }),
            3 => pick(&mut rng, &live).is_some_and(|id| {
                cache.free(id).unwrap();
                live.retain(|&s| s != id);
                true
            }),
            4 => pick(&mut rng, &live).is_some_and(|id| {
                let n = rng.below(24) as usize;
                match cache.truncate(id, n) {
                    Ok(()) => true,
                    Err(
                        PagedCacheError::PositionOutOfRange { .. } | PagedCacheError::SwappedOut(_),
                    ) => false,
                    Err(e) => panic!("truncate: {e}"),
                }
            }),
            5 => pick(&mut rng, &live).is_some_and(|id| {
                let Ok(len) = cache.tokens(id).map(<[u32]>::len) else {
                    return false;
                };
                match cache.cache_prefix(id, len) {
                    Ok(()) => true,
                    Err(PagedCacheError::SwappedOut(_)) => false,
                    Err(e) => panic!("cache: {e}"),
                }
            }),
            6 => {
                cache.evict(rng.below(8) as usize).unwrap();
                true
            }
            7 => pick(&mut rng, &live).is_some_and(|id| match cache.swap_out(id) {
                Ok(()) => true,
                Err(PagedCacheError::HostTierFull { .. } | PagedCacheError::SwappedOut(_)) => false,
                Err(e) => panic!("swap out: {e}"),
            }),
            _ => pick(&mut rng, &live).is_some_and(|id| match cache.swap_in(id) {
                Ok(()) => true,
                Err(PagedCacheError::PoolExhausted { .. } | PagedCacheError::NotSwapped(_)) => {
                    false
                }
                Err(e) => panic!("swap in: {e}"),
            }),
        };
        done[kind] += u64::from(ok);
        // Keep the population bounded so operations keep succeeding.
        if live.len() > 48 {
            let id = live.swap_remove(0);
            cache.free(id).unwrap();
        }
        let pool = cache.pool();
        assert_eq!(pool.num_free() + pool.num_used(), BLOCKS, "op {i}");
        if i % 5_000 == 0 {
            cache
                .check_invariants()
                .unwrap_or_else(|e| panic!("after op {i} ({kind}): {e}"));
        }
    }
    cache.check_invariants().unwrap();
    for id in live {
        cache.free(id).unwrap();
    }
    cache.evict(usize::MAX).unwrap();
    cache.check_invariants().unwrap();
    assert_eq!(cache.pool().num_free(), BLOCKS);
    println!(
        "{}: successful operations by kind {done:?}, {:?}",
        cache.prefix_cache().name(),
        cache.stats()
    );
    assert!(done.iter().all(|&n| n > 10_000), "every kind ran: {done:?}");
    let stats = cache.stats();
    assert!(
        stats.hit_tokens > 0 && stats.cow_copies > 0 && stats.swapped_in > 0 && stats.evicted > 0
    );
}

#[test]
#[cfg_attr(
    debug_assertions,
    ignore = "1,000,000 operations: run in release (cargo xtask test)"
)]
fn a_million_operations_with_hash_prefix_caching() {
    long_run(HashPrefixCache::new(BS), 1);
}

#[test]
#[cfg_attr(
    debug_assertions,
    ignore = "1,000,000 operations: run in release (cargo xtask test)"
)]
fn a_million_operations_with_radix_prefix_caching() {
    long_run(RadixPrefixCache::new(BS), 2);
}
