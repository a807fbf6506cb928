//! Scrubbing between two rounds of fault injection: every ECC word hit once
//! in the first round and once in the second is corrected, both with
//! synchronous passes ([`KvCacheManager::scrub`]) and with the background
//! [`Scrubber`]; without scrubbing the same words hold two flips and SECDED
//! can only detect them (the control that shows the test can fail).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use gf2_codes::channel::BinarySymmetric;
use kv_quant::{FaultTarget, KvStore};
use paged_cache::{
    BlockId, BlockStorage, CacheConfig, HashPrefixCache, KvCacheManager, KvPart, LayerSpec,
    Scrubber,
};

const BS: usize = 16;
const CH: usize = 64;
const BLOCKS: usize = 32;
const P: f64 = 4e-3;

/// A cache with one sequence filling every block, in SECDED-protected INT4.
fn filled() -> (KvCacheManager<HashPrefixCache>, Arc<BlockStorage>) {
    let layers = [LayerSpec::uniform("int4-g32+secded84".parse().unwrap(), CH)];
    let storage = Arc::new(BlockStorage::new(BLOCKS, BS, &layers).unwrap());
    let config = CacheConfig {
        num_blocks: BLOCKS,
        block_size: BS,
        host_blocks: 0,
    };
    let mut cache =
        KvCacheManager::with_storage(config, HashPrefixCache::new(BS), storage.clone()).unwrap();
    let prompt: Vec<u32> = (0..(BLOCKS * BS) as u32).collect();
    let (id, _) = cache.add_sequence(&prompt, 0).unwrap();
    for t in 0..prompt.len() {
        let row: Vec<f32> = (0..CH)
            .map(|c| ((t * CH + c) as f32 * 0.37).sin())
            .collect();
        cache.write_kv(id, t, 0, &row, &row).unwrap();
    }
    (cache, storage)
}

/// Flipped bit positions per (block, part, word).
type WordHits = HashMap<(u32, usize, usize), Vec<u64>>;

/// Injects one round into every store; returns flips per (block, part, word).
fn inject(storage: &BlockStorage, seed: u64) -> WordHits {
    let channel = BinarySymmetric::new(P).unwrap();
    let mut hits = WordHits::new();
    for b in 0..BLOCKS as u32 {
        for (p, part) in [KvPart::Keys, KvPart::Values].into_iter().enumerate() {
            let flips = storage
                .inject(
                    BlockId(b),
                    0,
                    part,
                    &channel,
                    seed * 1000 + u64::from(b) * 2 + p as u64,
                    FaultTarget::Values,
                )
                .unwrap();
            storage
                .with_store(BlockId(b), 0, part, |s| {
                    for &bit in flips.values.positions() {
                        let w = s.word_of_bit(bit).expect("SECDED has no padding bits");
                        hits.entry((b, p, w)).or_default().push(bit);
                    }
                })
                .unwrap();
        }
    }
    hits
}

/// Words hit exactly once in each round, in two different bits (the same
/// bit flipped twice would cancel out).
fn once_in_each(first: &WordHits, second: &WordHits) -> Vec<(u32, usize, usize)> {
    let mut words: Vec<_> = first
        .iter()
        .filter(|&(w, a)| a.len() == 1 && second.get(w).is_some_and(|b| b.len() == 1 && b != a))
        .map(|(&w, _)| w)
        .collect();
    words.sort_unstable();
    words
}

/// Whether each word decodes to its clean value without being flagged.
fn corrected(
    storage: &BlockStorage,
    truth: &BlockStorage,
    words: &[(u32, usize, usize)],
) -> Vec<bool> {
    words
        .iter()
        .map(|&(b, p, w)| {
            let part = [KvPart::Keys, KvPart::Values][p];
            let clean = truth
                .with_store(BlockId(b), 0, part, KvStore::clone)
                .unwrap();
            storage
                .with_store(BlockId(b), 0, part, |s| {
                    let d = s.decode().unwrap();
                    let t = clean.decode().unwrap();
                    let (token, channel) = (w / CH, w % CH);
                    !d.is_erased(token, channel) && d.values[w] == t.values[w]
                })
                .unwrap()
        })
        .collect()
}

fn truth_copy(storage: &BlockStorage) -> BlockStorage {
    let copy = BlockStorage::new(BLOCKS, BS, storage.layers()).unwrap();
    for b in 0..BLOCKS as u32 {
        copy.restore(BlockId(b), storage.snapshot(BlockId(b)).unwrap())
            .unwrap();
    }
    copy
}

#[test]
fn words_hit_once_in_each_round_are_all_corrected_with_scrubbing_between() {
    let (mut cache, storage) = filled();
    let truth = truth_copy(&storage);
    let first = inject(&storage, 1);
    let pass = cache.scrub().unwrap();
    // SECDED "corrects" every odd number of flips (three flips miscorrect).
    let odd = first.values().filter(|n| n.len() % 2 == 1).count() as u64;
    assert_eq!(pass.values.corrected, odd);
    assert_eq!(
        pass.values.detected,
        first.values().filter(|n| n.len() == 2).count() as u64
    );
    let second = inject(&storage, 2);
    let words = once_in_each(&first, &second);
    assert!(
        words.len() >= 5,
        "the rate gives enough twice-hit words: {}",
        words.len()
    );
    assert!(corrected(&storage, &truth, &words).iter().all(|&c| c));

    // Control: the same two rounds without a scrub in between leave those
    // words with two flips, which SECDED detects but cannot correct.
    let (_, unscrubbed) = filled();
    inject(&unscrubbed, 1);
    inject(&unscrubbed, 2);
    assert!(corrected(&unscrubbed, &truth, &words).iter().all(|&c| !c));
}

#[test]
fn a_scrubbing_pass_reaches_swapped_out_blocks() {
    let layers = [LayerSpec::uniform("int4-g32+secded84".parse().unwrap(), CH)];
    let storage = Arc::new(BlockStorage::new(4, BS, &layers).unwrap());
    let config = CacheConfig {
        num_blocks: 4,
        block_size: BS,
        host_blocks: 2,
    };
    let mut cache =
        KvCacheManager::with_storage(config, HashPrefixCache::new(BS), storage.clone()).unwrap();
    let prompt: Vec<u32> = (0..2 * BS as u32).collect();
    let (id, _) = cache.add_sequence(&prompt, 0).unwrap();
    for t in 0..prompt.len() {
        let row: Vec<f32> = (0..CH)
            .map(|c| ((t * CH + c) as f32 * 0.11).cos())
            .collect();
        cache.write_kv(id, t, 0, &row, &row).unwrap();
    }
    let clean: Vec<_> = cache
        .block_table(id)
        .unwrap()
        .iter()
        .map(|&b| storage.snapshot(b).unwrap())
        .collect();
    // One flip in each of the two blocks' keys, then the sequence leaves the device.
    let channel = BinarySymmetric::new(0.5).unwrap();
    let mut flipped = 0;
    for &b in cache.block_table(id).unwrap() {
        let one = kv_quant::FaultTarget::Values;
        let flips = storage
            .inject(b, 0, KvPart::Keys, &FirstBit(&channel), 7, one)
            .unwrap();
        flipped += flips.total();
    }
    assert_eq!(flipped, 2);
    cache.swap_out(id).unwrap();
    let pass = cache.scrub().unwrap();
    assert_eq!(
        pass.values.corrected, 2,
        "the host tier's copies are scrubbed"
    );
    assert_eq!(cache.scrub().unwrap().values.corrected, 0);
    cache.swap_in(id).unwrap();
    let back: Vec<_> = cache
        .block_table(id)
        .unwrap()
        .iter()
        .map(|&b| storage.snapshot(b).unwrap())
        .collect();
    assert_eq!(back, clean, "swapped back in bit for bit clean");
}

/// Keeps only the first flip `inner` would make (so exactly one per store).
#[derive(Debug)]
struct FirstBit<'a>(&'a BinarySymmetric);

impl gf2_codes::channel::FaultChannel for FirstBit<'_> {
    fn inject_with(
        &self,
        data: &mut [u8],
        rng: &mut gf2_codes::channel::FaultRng,
    ) -> gf2_codes::channel::Flips {
        let mut copy = data.to_vec();
        let flips = self.0.inject_with(&mut copy, rng);
        let first: Vec<u64> = flips.positions().iter().take(1).copied().collect();
        for &bit in &first {
            data[(bit / 8) as usize] ^= 1 << (bit % 8);
        }
        gf2_codes::channel::Flips::from_events(first)
    }
}

#[test]
fn the_background_scrubber_cleans_words_between_rounds() {
    let (_cache, storage) = filled();
    let truth = truth_copy(&storage);
    let scrubber = Scrubber::start(storage.clone(), 20_000.0).unwrap();
    let first = inject(&storage, 1);
    // Wait for two full passes after the injection (a pass in progress may
    // have passed some blocks already).
    let start = scrubber.totals().passes;
    let deadline = Instant::now() + Duration::from_secs(60);
    while scrubber.totals().passes < start + 2 {
        assert!(Instant::now() < deadline, "the scrubber stalled");
        std::thread::sleep(Duration::from_millis(2));
    }
    let second = inject(&storage, 2);
    let totals = scrubber.stop().unwrap();
    assert!(
        totals.stats.values.corrected >= first.values().filter(|n| n.len() == 1).count() as u64
    );
    let words = once_in_each(&first, &second);
    assert!(words.len() >= 5);
    assert!(corrected(&storage, &truth, &words).iter().all(|&c| c));
    assert!(Scrubber::start(storage, 0.0).is_err());
}

#[test]
fn bytes_used_are_counted_from_the_blocks_buffers() {
    let (mut cache, _) = filled();
    // Per store of 16 tokens × 64 channels in int4-g32+secded84: one SECDED
    // byte per value (1,024), an f16 scale and offset per group of 32
    // (2 groups × 16 tokens × 2 bytes each = 64 + 64), and two RM(2,5)
    // check bytes per scale and per offset (128): 1,280 bytes; K and V:
    // 2,560 per block.
    let form = "int4-g32+secded84".parse().unwrap();
    assert_eq!(cache.bytes_used().unwrap(), vec![(form, BLOCKS * 2_560)]);
    let id = cache.sequences().next().unwrap();
    cache.truncate(id, 3 * BS).unwrap();
    assert_eq!(
        cache.bytes_used().unwrap(),
        vec![(form, (BLOCKS - 3) * 2_560)]
    );
}
