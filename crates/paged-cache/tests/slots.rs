//! [`ReservedSlots`] against [`PagedBackend`]: the same steps written into
//! slots a scheduler reserved give bit-identical attention outputs, and
//! what a reserved-slot backend must refuse (tokens other than the
//! reserved ones, shared blocks, a manager without storage).

use std::sync::Arc;

use attention::{Attention, HeadShape, KvBackend, Mask, ModelKvShape, run_step};
use paged_cache::{
    BlockStorage, CacheConfig, HashPrefixCache, KvCacheManager, LayerSpec, NoPrefixCache,
    PagedBackend, PagedCacheError, ReservedSlots,
};

const BS: usize = 16;
const STEPS: [usize; 5] = [37, 1, 1, 10, 1];
const FORM: &str = "int4-g16+secded84";

fn model() -> ModelKvShape<'static> {
    ModelKvShape {
        layers: 2,
        heads: HeadShape::new(4, 2, 16).unwrap(),
        rope: None,
    }
}

fn rows(n: usize, ch: usize, phase: f32) -> Vec<f32> {
    (0..n * ch)
        .map(|i| ((i as f32 * 0.731 + phase).sin() * 1.7).tanh())
        .collect()
}

/// One step of `n` tokens from `start` on `backend`: every layer appends
/// and attends; returns the outputs.
fn step<B: KvBackend>(backend: &mut B, start: usize, n: usize) -> Result<Vec<f32>, B::Error> {
    let m = model();
    let (ch, attn) = (m.heads.kv_channels(), Attention::new(m.heads));
    backend.fit(&m)?;
    let ids: Vec<u32> = (start..start + n).map(|t| t as u32).collect();
    let positions: Vec<usize> = (start..start + n).collect();
    run_step(backend, &ids, |b| {
        let mut out = Vec::new();
        for l in 0..m.layers {
            b.append(
                l,
                &rows(n, ch, (start * 7 + l) as f32),
                &rows(n, ch, (start + l) as f32),
            )?;
            let q = rows(n, m.heads.q_len(), start as f32 + 0.25);
            out.extend(b.attend(l, &attn, &q, &positions, &Mask::Causal)?.out);
        }
        Ok(out)
    })
}

fn manager<P: paged_cache::PrefixCache>(prefix: P) -> KvCacheManager<P> {
    let ch = model().heads.kv_channels();
    let layers = [LayerSpec::uniform(FORM.parse().unwrap(), ch); 2];
    let storage = Arc::new(BlockStorage::new(8, BS, &layers).unwrap());
    let config = CacheConfig {
        num_blocks: 8,
        block_size: BS,
        host_blocks: 0,
    };
    KvCacheManager::with_storage(config, prefix, storage).unwrap()
}

#[test]
fn reserved_slots_equal_the_paged_backend_bit_for_bit() {
    let ch = model().heads.kv_channels();
    let layers = [LayerSpec::uniform(FORM.parse().unwrap(), ch); 2];
    let mut paged = PagedBackend::new(&layers, BS, 8).unwrap();
    let mut cache = manager(NoPrefixCache);
    let mut seq = None;
    let mut start = 0;
    for n in STEPS {
        let want = step(&mut paged, start, n).unwrap();
        let ids: Vec<u32> = (start..start + n).map(|t| t as u32).collect();
        let id = match seq {
            None => cache.add_sequence(&ids, 0).unwrap().0,
            Some(id) => {
                cache.append(id, &ids).unwrap();
                id
            }
        };
        seq = Some(id);
        let mut slots = ReservedSlots::new(&cache, id, start).unwrap();
        assert_eq!(slots.reserved(), start + n);
        let got = step(&mut slots, start, n).unwrap();
        assert_eq!(
            got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            want.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            "step at {start}"
        );
        assert_eq!(slots.tokens(), start + n);
        start += n;
    }
}

#[test]
fn a_step_must_name_the_reserved_tokens() {
    let mut cache = manager(NoPrefixCache);
    let (id, _) = cache.add_sequence(&[0, 1, 2], 0).unwrap();
    let mut slots = ReservedSlots::new(&cache, id, 0).unwrap();
    // Other ids, more tokens than reserved: refused before anything is written.
    assert!(matches!(
        slots.begin(&[0, 1, 3]),
        Err(PagedCacheError::InvalidParameter { name: "step", .. })
    ));
    assert!(slots.begin(&[0, 1, 2, 3]).is_err());
    // A failed step leaves the slots as they were.
    assert!(step(&mut slots, 0, 4).is_err());
    assert_eq!(slots.tokens(), 0);
    step(&mut slots, 0, 3).unwrap();
    assert!(step(&mut slots, 3, 1).is_err(), "nothing more is reserved");
    assert!(matches!(
        ReservedSlots::new(&cache, id, 4),
        Err(PagedCacheError::PositionOutOfRange { .. })
    ));
}

#[test]
fn shared_blocks_and_caches_without_storage_are_refused() {
    let mut cache = manager(HashPrefixCache::new(BS));
    let prompt: Vec<u32> = (0..BS as u32).collect();
    let (a, _) = cache.add_sequence(&prompt, 0).unwrap();
    step(&mut ReservedSlots::new(&cache, a, 0).unwrap(), 0, BS).unwrap();
    cache.cache_prefix(a, BS).unwrap();
    let longer: Vec<u32> = (0..BS as u32 + 1).collect();
    let (b, hit) = cache.add_sequence(&longer, 0).unwrap();
    assert_eq!(hit, BS);
    // b's first block is a's: its slots are written, so reading is fine...
    assert!(ReservedSlots::new(&cache, b, BS).is_ok());
    // ...but writing them again would change a's cache.
    assert!(matches!(
        ReservedSlots::new(&cache, b, 0),
        Err(PagedCacheError::InvalidParameter { name: "slots", .. })
    ));
    let config = CacheConfig {
        num_blocks: 2,
        block_size: BS,
        host_blocks: 0,
    };
    let mut bare = KvCacheManager::new(config, NoPrefixCache).unwrap();
    let (id, _) = bare.add_sequence(&[1], 0).unwrap();
    assert!(matches!(
        ReservedSlots::new(&bare, id, 0),
        Err(PagedCacheError::NoStorage)
    ));
}
