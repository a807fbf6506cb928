//! Paged decode attention over ECC-protected blocks: two sequences share a
//! prompt through the prefix cache, a fork copies on write, faults land in
//! the blocks, attention reads through the CSR page table (correcting on
//! the fly), and a scrub rewrites the corrected words.
//!
//! `cargo run --release -p paged-cache --example paged_decode`

use std::sync::Arc;

use attention::{Attention, HeadShape};
use gf2_codes::channel::BinarySymmetric;
use kv_quant::FaultTarget;
use paged_cache::{
    BlockStorage, CacheConfig, HashPrefixCache, KvCacheManager, KvPart, LayerSpec, paged_decode,
};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let shape = HeadShape::new(8, 2, 64)?;
    let ch = shape.kv_channels();
    let (blocks, bs) = (256, 16);
    let layers = [
        LayerSpec::uniform("fp16".parse()?, ch),
        LayerSpec::uniform("int4-g64+secded84".parse()?, ch),
    ];
    let storage = Arc::new(BlockStorage::new(blocks, bs, &layers)?);
    let config = CacheConfig {
        num_blocks: blocks,
        block_size: bs,
        host_blocks: 0,
    };
    let mut cache =
        KvCacheManager::with_storage(config, HashPrefixCache::new(bs), storage.clone())?;

    // K/V as a fixed function of (position, token), standing in for a model.
    let row = |pos: usize, token: u32, phase: f32| -> Vec<f32> {
        (0..ch)
            .map(|c| ((pos * 31 + c) as f32 * 0.01 + token as f32 * 0.1 + phase).sin())
            .collect()
    };
    let prompt: Vec<u32> = (0..1000).map(|i| i % 97).collect();
    let (a, _) = cache.add_sequence(&prompt, 0)?;
    for (pos, &token) in prompt.iter().enumerate() {
        for layer in 0..2 {
            cache.write_kv(a, pos, layer, &row(pos, token, 0.0), &row(pos, token, 1.0))?;
        }
    }
    cache.cache_prefix(a, prompt.len())?;
    let (b, hit) = cache.add_sequence(&prompt, 0)?;
    for (pos, &token) in prompt.iter().enumerate().skip(hit) {
        for layer in 0..2 {
            cache.write_kv(b, pos, layer, &row(pos, token, 0.0), &row(pos, token, 1.0))?;
        }
    }
    let c = cache.fork(b)?;
    cache.append(c, &[5])?;
    for layer in 0..2 {
        cache.write_kv(
            c,
            prompt.len(),
            layer,
            &row(prompt.len(), 5, 0.0),
            &row(prompt.len(), 5, 1.0),
        )?;
    }
    println!(
        "3 sequences, {} + {} + {} tokens in {} blocks ({} hit tokens, {} copy-on-write)",
        prompt.len(),
        prompt.len(),
        prompt.len() + 1,
        cache.pool().num_used(),
        hit,
        cache.stats().cow_copies
    );
    for (form, bytes) in cache.bytes_used()? {
        println!("  {form}: {bytes} bytes in use");
    }

    let attn = Attention::new(shape);
    let ids = [a, b, c];
    let table = cache.page_table(&ids)?;
    let queries: Vec<f32> = (0..ids.len() * shape.q_len())
        .map(|i| (i as f32 * 0.37).cos())
        .collect();
    let clean = paged_decode(&attn, &storage, &table, 1, &queries)?;

    // Faults at BER 1e-3 in the protected layer's blocks.
    let channel = BinarySymmetric::new(1e-3)?;
    let mut flips = 0;
    for (i, block) in cache.live_blocks().into_iter().enumerate() {
        for part in [KvPart::Keys, KvPart::Values] {
            flips += storage
                .inject(
                    block,
                    1,
                    part,
                    &channel,
                    i as u64 * 2 + part as u64,
                    FaultTarget::Everything,
                )?
                .total();
        }
    }
    let faulty = paged_decode(&attn, &storage, &table, 1, &queries)?;
    let diff = clean
        .iter()
        .zip(&faulty)
        .flat_map(|(x, y)| x.out.iter().zip(&y.out).map(|(p, q)| (p - q).abs()))
        .fold(0.0f32, f32::max);
    let stats = faulty.iter().fold((0, 0), |acc, o| {
        (
            acc.0 + o.stats.keys.values.corrected + o.stats.values.values.corrected,
            acc.1 + o.stats.keys.values.detected + o.stats.values.values.detected,
        )
    });
    println!(
        "{flips} flips injected; attention corrected {} words, detected {} (a shared block counts once per sequence reading it); max output change {diff:.2e}",
        stats.0, stats.1
    );
    let scrub = cache.scrub()?;
    println!(
        "scrub: {} value words corrected and rewritten, {} detected and left; {} metadata words corrected",
        scrub.values.corrected, scrub.values.detected, scrub.metadata.corrected
    );
    let again = cache.scrub()?;
    println!("second scrub: {} corrected", again.values.corrected);
    Ok(())
}
