//! A calibrated Shard form (`shard-*-cal`, attention's `ShardPart`) in a
//! paged cache: sealed blocks coded on tables shared by every sequence are
//! shared through the prefix cache (a second sequence with the same
//! prompt reads the first one's sealed rows bit for bit, keys rotated at
//! the right positions), survive a swap to the host tier and back, and a
//! sequence that forks and writes into a shared sealed block stages its
//! own copy (copy-on-write) without changing its sibling's.

use std::sync::Arc;

use attention::stored::{Fitted, ShardTables};
use attention::{Rope, RopeLayout};
use kv_lowrank::{Basis, BasisStorage, ShardKeys};
use kv_quant::{CacheForm, ChannelVq, DecodeScratch, FitOptions, RankRule};
use paged_cache::{
    BlockStorage, CacheConfig, HashPrefixCache, KvCacheManager, KvPart, LayerSpec, SeqId,
};

const HEAD_DIM: usize = 16;
const CH: usize = 2 * HEAD_DIM;
const BS: usize = 4;
const FORM: &str = "shard-k3-cal+sink2+win8";

fn rows(tokens: usize, seed: u64) -> Vec<f32> {
    (0..tokens * CH)
        .map(|i| {
            let x = (i as u64 ^ seed).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40;
            ((i % CH) as f32 * 0.37 + (i / CH) as f32 * 0.11).sin()
                + 0.3 * ((x as f32 / (1u64 << 24) as f32) - 0.5)
        })
        .collect()
}

fn storage() -> Arc<BlockStorage> {
    let rope = Rope::new(RopeLayout::Adjacent, HEAD_DIM, HEAD_DIM, 10_000.0).unwrap();
    let n = 512;
    let mut keys = rows(n, 99);
    for (t, row) in keys.chunks_exact_mut(CH).enumerate() {
        rope.undo(row, t % 64).unwrap();
    }
    let (basis, _) = Basis::fit(&keys, n, CH, RankRule::Fixed(16), BasisStorage::Int8).unwrap();
    let keys = ShardKeys::with_basis(&keys, n, &basis, 3.0, 8).unwrap();
    let values = ChannelVq::fit(&rows(n, 98), n, CH, HEAD_DIM, FitOptions::default()).unwrap();
    let fitted = [
        Fitted {
            shard: Some(ShardTables::Keys {
                prototype: Arc::new(keys),
                rope,
            }),
            ..Fitted::default()
        },
        Fitted {
            shard: Some(ShardTables::Values {
                prototype: Some(Arc::new(values)),
                head_dim: HEAD_DIM,
            }),
            ..Fitted::default()
        },
    ];
    let form: CacheForm = FORM.parse().unwrap();
    let layers = [LayerSpec::uniform(form, CH)];
    Arc::new(BlockStorage::with_fitted(16, BS, &layers, &[fitted]).unwrap())
}

/// Every row `seq` holds, keys then values, as the cache reads them.
fn read_all(
    cache: &KvCacheManager<HashPrefixCache>,
    storage: &BlockStorage,
    seq: SeqId,
) -> Vec<f32> {
    let len = cache.tokens(seq).unwrap().len();
    let table = cache.block_table(seq).unwrap();
    let mut out = Vec::new();
    for part in [KvPart::Keys, KvPart::Values] {
        for t in 0..len {
            let mut row = vec![0.0; CH];
            storage
                .read(
                    table[t / BS],
                    0,
                    part,
                    t % BS,
                    &mut row,
                    &mut DecodeScratch::new(),
                )
                .unwrap();
            out.extend(row);
        }
    }
    out
}

fn write(cache: &mut KvCacheManager<HashPrefixCache>, seq: SeqId, from: usize, to: usize) {
    let (k, v) = (rows(to, 1), rows(to, 2));
    for t in from..to {
        let r = t * CH..(t + 1) * CH;
        cache.write_kv(seq, t, 0, &k[r.clone()], &v[r]).unwrap();
    }
}

#[test]
fn sealed_shard_blocks_are_shared_swapped_and_copied_on_write() {
    let storage = storage();
    let config = CacheConfig {
        num_blocks: 16,
        block_size: BS,
        host_blocks: 8,
    };
    let mut cache =
        KvCacheManager::with_storage(config, HashPrefixCache::new(BS), storage.clone()).unwrap();
    let tokens = 5 * BS;
    let prompt: Vec<u32> = (0..tokens as u32).collect();
    let (a, _) = cache.add_sequence(&prompt, 0).unwrap();
    write(&mut cache, a, 0, tokens);
    // Blocks 1 and 2 leave the window of 8 (block 0 holds the sink).
    assert_eq!(cache.seal(a, 0, tokens).unwrap(), 2 * 2);
    let a_rows = read_all(&cache, &storage, a);
    cache.cache_prefix(a, tokens).unwrap();

    // Same prompt: the prefix cache hands over the full blocks, sealed
    // ones included, and they read the same.
    let (b, hit) = cache.add_sequence(&prompt, 0).unwrap();
    assert_eq!(hit, 4 * BS, "whole blocks hit");
    write(&mut cache, b, hit, tokens);
    assert_eq!(read_all(&cache, &storage, b), a_rows);
    assert_eq!(
        cache.block_table(a).unwrap()[1],
        cache.block_table(b).unwrap()[1],
        "a sealed block shared"
    );

    // To the host tier and back, bit for bit.
    cache.swap_out(a).unwrap();
    cache.swap_in(a).unwrap();
    assert_eq!(read_all(&cache, &storage, a), a_rows);

    // B forks and writes into the shared sealed block 1: it gets its own
    // copy, staged from the rows it reads as; A's block is untouched.
    let c = cache.fork(b).unwrap();
    cache.truncate(c, tokens - (BS + 1)).unwrap();
    cache.append(c, &[99]).unwrap();
    let fresh = rows(1, 7);
    cache.write_kv(c, BS + 1, 0, &fresh, &fresh).unwrap();
    assert_ne!(
        cache.block_table(c).unwrap()[1],
        cache.block_table(a).unwrap()[1],
        "copied on write"
    );
    assert_eq!(read_all(&cache, &storage, a), a_rows);
    let c_rows = read_all(&cache, &storage, c);
    // Block 0 (exact) is still shared; the copied block was staged from
    // the rows block 1 reads as, rounded to the exact rows' f16.
    assert_eq!(c_rows[..BS * CH], a_rows[..BS * CH], "the shared block");
    let f16 = |x: &f32| half::f16::from_f32(*x).to_f32();
    let kept: Vec<f32> = a_rows[BS * CH..(BS + 1) * CH].iter().map(f16).collect();
    assert_eq!(
        c_rows[BS * CH..(BS + 1) * CH],
        kept[..],
        "the kept row, staged"
    );
    cache.check_invariants().unwrap();
}
