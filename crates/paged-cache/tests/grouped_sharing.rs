//! Per-channel groups over several blocks through the prefix caches: two
//! forks of one sequence seal their groups on one shared first block's
//! copies, both are cached, and a third prompt with one fork's tokens
//! finds, by tokens, a first block of the other fork's group beside its
//! own second block. The hit must not piece a group together from two
//! groups (it is cut back to the last group sealed whole), and every row
//! the new sequence reads is one its own tokens' group holds.

use std::sync::Arc;

use attention::TileRows;
use attention::stored::PartScratch;
use paged_cache::{
    BlockStorage, CacheConfig, HashPrefixCache, KvCacheManager, KvPart, LayerSpec, PrefixCache,
    RadixPrefixCache, SeqId,
};

const BS: usize = 4;
const CH: usize = 8;

/// The K and V rows of the token ending `prefix` (a function of the
/// prefix, as a model's are).
fn row(prefix: &[u32], part: usize) -> Vec<f32> {
    let h = prefix.iter().fold(17u64 + part as u64, |h, &t| {
        h.wrapping_mul(31).wrapping_add(u64::from(t) + 1)
    });
    (0..CH)
        .map(|c| ((h.wrapping_mul(2 * c as u64 + 3) >> 7) % 1000) as f32 / 250.0 - 2.0)
        .collect()
}

/// Writes the rows of `id`'s tokens `from..`.
fn write<P: PrefixCache>(cache: &mut KvCacheManager<P>, id: SeqId, from: usize) {
    let tokens = cache.tokens(id).unwrap().to_vec();
    for pos in from..tokens.len() {
        let (k, v) = (row(&tokens[..=pos], 0), row(&tokens[..=pos], 1));
        cache.write_kv(id, pos, 0, &k, &v).unwrap();
    }
}

/// Every row of `id`'s keys as the cache reads them.
fn keys<P: PrefixCache>(cache: &KvCacheManager<P>, storage: &BlockStorage, id: SeqId) -> Vec<f32> {
    let pages: Vec<u32> = cache.block_table(id).unwrap().iter().map(|b| b.0).collect();
    let n = cache.tokens(id).unwrap().len();
    let part = storage.part(0, KvPart::Keys).unwrap();
    let mut scratch = PartScratch::default();
    let tile = part.read_tile(&pages, 0, n, &mut scratch).unwrap();
    match tile.rows {
        TileRows::F32(r) => r.to_vec(),
        TileRows::Levels(l) => {
            let mut out = vec![0.0; n * CH];
            l.dequantize_into(&mut out);
            out
        }
        TileRows::F16(b) => b
            .chunks_exact(2)
            .map(|h| half::f16::from_le_bytes([h[0], h[1]]).to_f32())
            .collect(),
        TileRows::PairCodes(_) => tile.rows.to_f32_vec(),
    }
}

fn pieced_groups_are_not_hits<P: PrefixCache>(prefix: P) {
    let layers = [LayerSpec::uniform("int4-ch8".parse().unwrap(), CH)];
    let storage = Arc::new(BlockStorage::new(32, BS, &layers).unwrap());
    let config = CacheConfig {
        num_blocks: 32,
        block_size: BS,
        host_blocks: 0,
    };
    let mut cache = KvCacheManager::with_storage(config, prefix, storage.clone()).unwrap();
    // A: six tokens, a group of two blocks half filled; C forks it.
    let (a, _) = cache.add_sequence(&[1, 2, 3, 4, 5, 6], 0).unwrap();
    write(&mut cache, a, 0);
    let c = cache.fork(a).unwrap();
    cache.append(a, &[7, 8]).unwrap();
    write(&mut cache, a, 6);
    cache.append(c, &[9, 9]).unwrap();
    write(&mut cache, c, 6);
    for id in [a, c] {
        assert_eq!(
            cache.seal(id, 0, 8).unwrap(),
            4,
            "a group of two blocks in K and V"
        );
        cache.cache_prefix(id, 8).unwrap();
    }
    let (ta, tc) = (cache.block_table(a).unwrap(), cache.block_table(c).unwrap());
    assert_ne!(ta[0], tc[0], "the fork copied the group's written block");
    // D: C's tokens and one more. Its first block's tokens are A's too.
    let prompt = [1, 2, 3, 4, 5, 6, 9, 9, 0];
    let (d, hit) = cache.add_sequence(&prompt, 0).unwrap();
    let table = cache.block_table(d).unwrap().to_vec();
    let tc = cache.block_table(c).unwrap();
    assert!(
        hit == 0 || table[..2] == tc[..2],
        "a hit of {hit} tokens on blocks {table:?} pieces C's group {tc:?} with another"
    );
    write(&mut cache, d, hit);
    cache.seal(d, 0, 8).unwrap();
    // Every row D reads is its own tokens' group's, sealed together.
    let (kd, kc) = (keys(&cache, &storage, d), keys(&cache, &storage, c));
    assert_eq!(kd[..8 * CH], kc[..8 * CH]);
    cache.check_invariants().unwrap();
}

#[test]
fn pieced_groups_are_not_hits_in_the_hash_cache() {
    pieced_groups_are_not_hits(HashPrefixCache::new(BS));
}

#[test]
fn pieced_groups_are_not_hits_in_the_radix_cache() {
    pieced_groups_are_not_hits(RadixPrefixCache::new(BS));
}

#[test]
fn parts_whose_groups_do_not_line_up_share_what_both_allow() {
    let spec = |k: &str, v: &str| LayerSpec {
        key: k.parse().unwrap(),
        value: v.parse().unwrap(),
        channels: CH,
    };
    // Groups of four blocks after one sink block in K, from the first
    // block in V: no prefix but the empty one ends a group in both.
    let storage = BlockStorage::new(16, BS, &[spec("int4-ch16+sink4", "int4-ch16")]).unwrap();
    assert_eq!(
        (0..12)
            .map(|n| storage.shareable_blocks(n))
            .collect::<Vec<_>>(),
        [0; 12]
    );
    // The same grouping in both parts: every fourth block after the sink.
    let storage = BlockStorage::new(16, BS, &[spec("int4-ch16+sink4", "int8-ch16+sink2")]).unwrap();
    let want = [0, 1, 1, 1, 1, 5, 5, 5, 5, 9, 9, 9];
    assert_eq!(
        (0..12)
            .map(|n| storage.shareable_blocks(n))
            .collect::<Vec<_>>(),
        want
    );
    // Groups of two blocks in one layer, of four in another: fours.
    let storage = BlockStorage::new(
        16,
        BS,
        &[spec("int4-ch8", "fp16"), spec("int4", "int4-ch16")],
    )
    .unwrap();
    let want = [0, 0, 0, 0, 4, 4, 4, 4, 8];
    assert_eq!(
        (0..9)
            .map(|n| storage.shareable_blocks(n))
            .collect::<Vec<_>>(),
        want
    );
}
