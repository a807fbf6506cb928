//! A calibrated Shard form (`shard-*-cal`, attention's `ShardPart`) in a
//! paged cache: sealed blocks coded on tables shared by every sequence are
//! shared through the prefix cache (a second sequence with the same
//! prompt reads the first one's sealed rows bit for bit, keys rotated at
//! the right positions), survive a swap to the host tier and back, and a
//! sequence that forks and writes into a shared sealed block stages its
//! own copy (copy-on-write) without changing its sibling's. A Shard form
//! fitted per sequence (`shard-k3`) keeps each sequence's tables beside its
//! block table: fitted at its first seal, shared by its forks (made before
//! the fit or after), kept through a swap and after its parent is freed;
//! its blocks are not shared through the prefix cache.

use std::sync::Arc;

use attention::stored::{Fitted, SequenceFit, ShardTables};
use attention::{Rope, RopeLayout};
use kv_lowrank::{Basis, BasisStorage, ShardKeys};
use kv_quant::{CacheForm, ChannelVq, DecodeScratch, FitOptions, RankRule};
use paged_cache::{
    BlockStorage, CacheConfig, HashPrefixCache, KvCacheManager, KvPart, LayerSpec, PrefixCache,
    SeqId,
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
    storage_of(FORM)
}

/// Blocks of `form` on tables fitted on 512 calibration rows.
fn storage_of(form: &str) -> Arc<BlockStorage> {
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
    let form: CacheForm = form.parse().unwrap();
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
    write_seeded(cache, seq, from, to, 1);
}

/// Writes rows `from..to` of keys seeded `seed` and values seeded `seed + 1`.
fn write_seeded(
    cache: &mut KvCacheManager<HashPrefixCache>,
    seq: SeqId,
    from: usize,
    to: usize,
    seed: u64,
) {
    let (k, v) = (rows(to, seed), rows(to, seed + 1));
    for t in from..to {
        let r = t * CH..(t + 1) * CH;
        cache.write_kv(seq, t, 0, &k[r.clone()], &v[r]).unwrap();
    }
}

#[test]
fn sealed_shard_blocks_are_shared_swapped_and_copied_on_write() {
    let storage = storage();
    assert!(!storage.fits_per_sequence(), "calibrated tables are shared");
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

#[test]
fn tables_fitted_per_sequence_live_beside_the_block_table() {
    let rope = Rope::new(RopeLayout::Adjacent, HEAD_DIM, HEAD_DIM, 10_000.0).unwrap();
    let fitted = [
        SequenceFit::Keys(rope),
        SequenceFit::Values { head_dim: HEAD_DIM },
    ]
    .map(|fit| Fitted {
        sequence: Some(fit),
        ..Fitted::default()
    });
    let form: CacheForm = "shard-k3+sink2+win8".parse().unwrap();
    let layers = [LayerSpec::uniform(form, CH)];
    let fitted = [fitted];
    let storage = Arc::new(BlockStorage::with_fitted(48, BS, &layers, &fitted).unwrap());
    assert!(storage.fits_per_sequence());
    let config = CacheConfig {
        num_blocks: 48,
        block_size: BS,
        host_blocks: 16,
    };
    let mut cache =
        KvCacheManager::with_storage(config, HashPrefixCache::new(BS), storage.clone()).unwrap();
    // The sink block, 9 blocks of middle (more rows than channels) and a
    // window of 8 rows.
    let tokens = 10 * BS + 8;
    let prompt: Vec<u32> = (0..tokens as u32).collect();
    let (a, _) = cache.add_sequence(&prompt, 0).unwrap();
    write_seeded(&mut cache, a, 0, tokens - BS, 1);
    assert_eq!(
        cache.seal(a, 0, tokens - BS).unwrap(),
        0,
        "too few rows to fit"
    );
    assert!(cache.sequence_tables(a).unwrap().is_empty());
    // A fork made before the fit shares the one fit its parent makes.
    let early = cache.fork(a).unwrap();
    write_seeded(&mut cache, a, tokens - BS, tokens, 1);
    assert_eq!(cache.seal(a, tokens - BS, tokens).unwrap(), 2 * 9);
    let tables = cache.sequence_tables(a).unwrap().clone();
    assert!(tables.part_bytes(KvPart::Keys) > 0 && tables.part_bytes(KvPart::Values) > 0);
    assert!(cache.sequence_tables(early).unwrap().same(&tables));
    // What a caller budgets per sequence bounds what it keeps.
    let bound = BlockStorage::sequence_bytes_fitted(BS, &layers, &fitted).unwrap();
    assert!(
        bound as usize >= tables.stored_bytes(),
        "{bound} {tables:?}"
    );
    cache.free(early).unwrap();
    // Its blocks are not shared through the prefix cache.
    cache.cache_prefix(a, tokens).unwrap();
    assert_eq!(cache.prefix_cache().cached_blocks(), 0);

    // Another sequence fits its own; a fork shares its parent's, and its
    // later seals code on them.
    let (b, hit) = cache.add_sequence(&prompt, 0).unwrap();
    assert_eq!(hit, 0, "no prefix hit");
    write_seeded(&mut cache, b, 0, tokens, 5);
    cache.seal(b, 0, tokens).unwrap();
    assert!(!cache.sequence_tables(b).unwrap().same(&tables));
    let c = cache.fork(a).unwrap();
    assert!(cache.sequence_tables(c).unwrap().same(&tables));
    cache.append(c, &[7; BS]).unwrap();
    write_seeded(&mut cache, c, tokens, tokens + BS, 9);
    assert_eq!(cache.seal(c, tokens, tokens + BS).unwrap(), 2);
    assert!(cache.sequence_tables(c).unwrap().same(&tables));

    // A fault in the tables (bare: read as flipped) reaches every sealed
    // block coded on them: the sequence's and its fork's, which shares
    // them, the block the fork sealed included; another sequence fitted
    // its own.
    let reads =
        |cache: &KvCacheManager<HashPrefixCache>| [a, b, c].map(|s| read_all(cache, &storage, s));
    let before = reads(&cache);
    let hit = storage
        .inject_sequence(
            cache.sequence_tables(a).unwrap(),
            0,
            KvPart::Keys,
            &gf2_codes::channel::ExactFlips::new([6]),
            0,
            kv_quant::FaultTarget::Metadata,
        )
        .unwrap();
    assert_eq!(hit.tables.len(), 1);
    let stats = storage
        .sequence_stats(cache.sequence_tables(c).unwrap())
        .unwrap();
    assert_eq!(stats.silent, 1);
    let after = reads(&cache);
    assert_ne!(after[0], before[0]);
    assert_eq!(after[1], before[1], "another sequence's tables");
    // Block 10, sealed by the fork's step (it left the fork's window).
    let late = 10 * BS * CH..11 * BS * CH;
    assert_ne!(
        after[2][late.clone()],
        before[2][late],
        "sealed by the fork"
    );

    // A swap keeps them and the rows; freeing the parent leaves the fork's.
    let a_rows = read_all(&cache, &storage, a);
    cache.swap_out(a).unwrap();
    cache.swap_in(a).unwrap();
    assert_eq!(read_all(&cache, &storage, a), a_rows);
    assert!(cache.sequence_tables(a).unwrap().same(&tables));
    let c_rows = read_all(&cache, &storage, c);
    cache.free(a).unwrap();
    assert_eq!(read_all(&cache, &storage, c), c_rows);
    assert_eq!(c_rows[..tokens * CH], a_rows[..tokens * CH], "shared keys");
    assert!(cache.sequence_tables(a).is_err());
    cache.check_invariants().unwrap();
}

#[test]
fn a_coded_shard_form_corrects_faults_in_sealed_blocks_and_scrubs_them() {
    use gf2_codes::channel::ExactFlips;
    use kv_quant::FaultTarget;
    let config = CacheConfig {
        num_blocks: 16,
        block_size: BS,
        host_blocks: 8,
    };
    let tokens = 5 * BS;
    let prompt: Vec<u32> = (0..tokens as u32).collect();
    let run = |form: &str| {
        let storage = storage_of(form);
        let mut cache =
            KvCacheManager::with_storage(config, HashPrefixCache::new(BS), storage.clone())
                .unwrap();
        let (a, _) = cache.add_sequence(&prompt, 0).unwrap();
        write(&mut cache, a, 0, tokens);
        assert_eq!(cache.seal(a, 0, tokens).unwrap(), 2 * 2);
        (storage, cache, a)
    };
    let (bare_storage, bare, b) = run(FORM);
    let (storage, mut cache, a) = run(&format!("{FORM}+secded84"));
    // The coded blocks read as the bare ones.
    let clean = read_all(&cache, &storage, a);
    assert_eq!(clean, read_all(&bare, &bare_storage, b));
    // A code bit and a scale bit of both parts of the two sealed blocks:
    // corrected on read, rewritten by a scrub.
    let sealed = cache.block_table(a).unwrap()[1..3].to_vec();
    for &block in &sealed {
        for part in [KvPart::Keys, KvPart::Values] {
            let hit = storage
                .inject(
                    block,
                    0,
                    part,
                    &ExactFlips::new([5]),
                    0,
                    FaultTarget::Everything,
                )
                .unwrap();
            assert_eq!((hit.values.len(), hit.scales.len()), (1, 1));
        }
    }
    assert_eq!(read_all(&cache, &storage, a), clean);
    // Out to the host tier with their flips, and back.
    cache.swap_out(a).unwrap();
    cache.swap_in(a).unwrap();
    assert_eq!(read_all(&cache, &storage, a), clean);
    let sealed = cache.block_table(a).unwrap()[1..3].to_vec();
    for &block in &sealed {
        let s = storage.scrub(block).unwrap();
        assert_eq!((s.values.corrected, s.metadata.corrected), (2, 2));
        let again = storage.scrub(block).unwrap();
        assert_eq!((again.values.corrected, again.metadata.corrected), (0, 0));
    }
    assert_eq!(read_all(&cache, &storage, a), clean);
    cache.check_invariants().unwrap();
}
