//! A cache form defined outside the workspace's crates, served by the
//! paged cache through the stored-layer interface alone
//! ([`attention::stored::StoredPart`]): `Bf16Part` keeps each value as
//! bfloat16 (round to nearest even), a form kv-quant has no spelling for.
//! Handed to [`BlockStorage::from_parts`] beside a kv-quant part, it is
//! written, attended (bit for bit what attention computes over the same
//! rounded rows), copied, swapped to the host tier and back, faulted and
//! counted with no change to paged-cache or attention.

use std::ops::Range;
use std::sync::Arc;

use attention::stored::{Fitted, PartBlock, PartScratch, StoredPart, open_part};
use attention::{
    Attention, AttentionConfig, AttentionError, DenseKv, HeadShape, Mask, Numerics, Tile, TileRows,
};
use gf2_codes::channel::{ExactFlips, FaultChannel};
use kv_quant::{
    CacheForm, DecodeScratch, FaultTarget, Injection, KvDecodeStats, RowBuffers, ScrubStats,
};
use paged_cache::{
    BlockStorage, CacheConfig, KvCacheManager, KvPart, NoPrefixCache, PagedCacheError, paged_decode,
};

/// bfloat16 rows: two bytes per value, one flat buffer per block.
#[derive(Debug)]
struct Bf16Part {
    blocks: Vec<Vec<u8>>,
    block_size: usize,
    channels: usize,
}

fn to_bf16(x: f32) -> u16 {
    let bits = x.to_bits();
    let round = 0x7fff + ((bits >> 16) & 1);
    (bits.wrapping_add(round) >> 16) as u16
}

fn from_bf16(h: u16) -> f32 {
    f32::from_bits(u32::from(h) << 16)
}

impl Bf16Part {
    fn new(num_blocks: usize, block_size: usize, channels: usize) -> Self {
        Self {
            blocks: vec![vec![0; block_size * channels * 2]; num_blocks],
            block_size,
            channels,
        }
    }

    fn block(&self, block: usize) -> attention::Result<&Vec<u8>> {
        self.blocks
            .get(block)
            .ok_or_else(|| AttentionError::InvalidParameter {
                name: "block",
                reason: format!("block {block} of {}", self.blocks.len()),
            })
    }

    fn value(&self, block: usize, i: usize) -> f32 {
        let b = &self.blocks[block];
        from_bf16(u16::from_le_bytes([b[2 * i], b[2 * i + 1]]))
    }
}

impl StoredPart for Bf16Part {
    fn form(&self) -> CacheForm {
        // Named by its written form: it has no spelling of its own.
        "fp32".parse().unwrap()
    }
    fn channels(&self) -> usize {
        self.channels
    }
    fn block_size(&self) -> usize {
        self.block_size
    }
    fn num_blocks(&self) -> usize {
        self.blocks.len()
    }
    fn written_form(&self) -> CacheForm {
        "fp32".parse().unwrap()
    }
    fn open_block(&mut self, block: usize) -> attention::Result<()> {
        self.block(block).map(|_| ())
    }
    fn put_row(&mut self, block: usize, offset: usize, row: &RowBuffers) -> attention::Result<()> {
        self.block(block)?;
        let ch = self.channels;
        let out = &mut self.blocks[block][offset * ch * 2..][..ch * 2];
        for (o, f) in out.chunks_exact_mut(2).zip(row.data.chunks_exact(4)) {
            let x = f32::from_le_bytes(f.try_into().unwrap());
            o.copy_from_slice(&to_bf16(x).to_le_bytes());
        }
        Ok(())
    }
    fn sealable(&self, _: usize, _: usize) -> Range<usize> {
        0..0
    }
    fn seal(&mut self, _: usize, _: usize) -> attention::Result<bool> {
        Ok(false)
    }
    fn is_staged(&self, _: usize) -> bool {
        false
    }
    fn staged_blocks(&self) -> usize {
        0
    }
    fn read_rows(
        &self,
        block: usize,
        offset: usize,
        out: &mut [f32],
        _: &mut DecodeScratch,
    ) -> attention::Result<KvDecodeStats> {
        self.block(block)?;
        for (i, o) in out.iter_mut().enumerate() {
            *o = self.value(block, offset * self.channels + i);
        }
        Ok(KvDecodeStats::default())
    }
    fn read_tile<'s>(
        &'s self,
        pages: &[u32],
        start: usize,
        count: usize,
        scratch: &'s mut PartScratch,
    ) -> attention::Result<Tile<'s>> {
        let (bs, ch) = (self.block_size, self.channels);
        scratch.rows.resize(count * ch, 0.0);
        for t in start..start + count {
            let block = pages[t / bs] as usize;
            for c in 0..ch {
                scratch.rows[(t - start) * ch + c] = self.value(block, (t % bs) * ch + c);
            }
        }
        Ok(Tile {
            rows: TileRows::F32(&scratch.rows[..count * ch]),
            stats: KvDecodeStats::default(),
        })
    }
    fn row_bytes(&self) -> usize {
        2 * self.channels
    }
    fn snapshot(&self, block: usize) -> attention::Result<PartBlock> {
        Ok(PartBlock::of_bytes(self.block(block)?.clone()))
    }
    fn accepts(&self, data: &PartBlock) -> bool {
        data.stores().is_empty() && data.bytes().len() == self.block_size * self.channels * 2
    }
    fn restore(&mut self, block: usize, data: &PartBlock) -> attention::Result<()> {
        self.block(block)?;
        if !self.accepts(data) {
            return Err(AttentionError::InvalidParameter {
                name: "block data",
                reason: "not a bf16 block of this shape".into(),
            });
        }
        self.blocks[block].copy_from_slice(data.bytes());
        Ok(())
    }
    fn scrub(&mut self, block: usize) -> attention::Result<ScrubStats> {
        self.block(block)?;
        Ok(ScrubStats::default())
    }
    fn inject(
        &mut self,
        block: usize,
        channel: &dyn FaultChannel,
        seed: u64,
        _: FaultTarget,
    ) -> attention::Result<Injection> {
        self.block(block)?;
        let values = channel.inject(&mut self.blocks[block], seed);
        Ok(Injection {
            values,
            ..Injection::default()
        })
    }
    fn block_bytes(&self, _: usize) -> usize {
        self.sealed_block_bytes()
    }
    fn sealed_block_bytes(&self) -> usize {
        self.block_size * self.channels * 2
    }
}

fn rows(tokens: usize, channels: usize, seed: u64) -> Vec<f32> {
    (0..tokens * channels)
        .map(|i| {
            let x = (i as u64 ^ seed).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40;
            (x as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

const BS: usize = 16;
const BLOCKS: usize = 12;

/// Two layers: layer 0 all bf16, layer 1 bf16 keys beside `int4-ch` values
/// from the registry (staged and sealed as usual).
fn storage(shape: &HeadShape) -> Arc<BlockStorage> {
    let ch = shape.kv_channels();
    let bf16 = || Box::new(Bf16Part::new(BLOCKS, BS, ch)) as Box<dyn StoredPart>;
    let int4 = open_part(
        "int4-ch".parse().unwrap(),
        BS,
        ch,
        BLOCKS,
        &Fitted::default(),
    )
    .unwrap();
    Arc::new(BlockStorage::from_parts(vec![[bf16(), bf16()], [bf16(), int4]]).unwrap())
}

#[test]
fn a_part_from_outside_is_written_attended_copied_swapped_and_faulted() {
    let shape = HeadShape::new(4, 2, 16).unwrap();
    let ch = shape.kv_channels();
    let storage = storage(&shape);
    assert_eq!(storage.layers()[1].value.to_string(), "int4-ch");
    let config = CacheConfig {
        num_blocks: BLOCKS,
        block_size: BS,
        host_blocks: 4,
    };
    let mut cache = KvCacheManager::with_storage(config, NoPrefixCache, storage.clone()).unwrap();
    let tokens = 3 * BS + 5;
    let prompt: Vec<u32> = (0..tokens as u32).collect();
    let (seq, _) = cache.add_sequence(&prompt, 0).unwrap();
    let (k, v) = (rows(tokens, ch, 1), rows(tokens, ch, 2));
    for t in 0..tokens {
        let r = t * ch..(t + 1) * ch;
        for layer in 0..2 {
            cache
                .write_kv(seq, t, layer, &k[r.clone()], &v[r.clone()])
                .unwrap();
        }
    }
    assert_eq!(
        cache.seal(seq, 0, tokens).unwrap(),
        3,
        "int4-ch seals its 3 full blocks"
    );

    // Layer 0 attended through pages equals attention over the rounded
    // rows, bit for bit (fixed tiles of one block, exact scores).
    let attn_config = AttentionConfig {
        tile_tokens: BS,
        tile_bytes: None,
        split_tokens: 2 * BS,
        numerics: Numerics::Exact,
        ..AttentionConfig::default()
    };
    let attn = Attention::with_config(shape, attn_config).unwrap();
    let round = |x: &[f32]| x.iter().map(|&x| from_bf16(to_bf16(x))).collect::<Vec<_>>();
    let (kr, vr) = (round(&k), round(&v));
    let q = rows(1, shape.q_len(), 3);
    let table = cache.page_table(&[seq]).unwrap();
    let paged = paged_decode(&attn, &storage, &table, 0, &q).unwrap();
    let dense = attn
        .decode(
            &q,
            tokens - 1,
            &DenseKv::new(&kr, tokens, ch).unwrap(),
            &DenseKv::new(&vr, tokens, ch).unwrap(),
            &Mask::Causal,
        )
        .unwrap();
    assert_eq!(paged[0].out, dense.out);
    assert_eq!(paged[0].lse, dense.lse);
    // Layer 1 mixes it with a registry part and still attends.
    assert!(paged_decode(&attn, &storage, &table, 1, &q).is_ok());

    // Bytes: 2 per value, counted through the interface.
    let block = cache.block_table(seq).unwrap()[0];
    assert_eq!(
        storage.block_part_bytes(block, 0, KvPart::Keys).unwrap(),
        BS * ch * 2
    );

    // Copy-on-write: a fork's write copies the shared last block.
    let fork = cache.fork(seq).unwrap();
    cache.append(fork, &[7]).unwrap();
    assert_eq!(cache.stats().cow_copies, 1);
    let last = |c: &KvCacheManager<NoPrefixCache>, s| *c.block_table(s).unwrap().last().unwrap();
    let mut a = vec![0.0; 5 * ch];
    let mut b = vec![0.0; 5 * ch];
    let mut scratch = DecodeScratch::new();
    storage
        .read(last(&cache, seq), 0, KvPart::Keys, 0, &mut a, &mut scratch)
        .unwrap();
    storage
        .read(last(&cache, fork), 0, KvPart::Keys, 0, &mut b, &mut scratch)
        .unwrap();
    assert_eq!(a, b);
    assert_eq!(a, kr[3 * BS * ch..][..5 * ch]);

    // Swap out and back in: the same rows come back.
    cache.free(fork).unwrap();
    cache.swap_out(seq).unwrap();
    cache.swap_in(seq).unwrap();
    let table = cache.page_table(&[seq]).unwrap();
    let again = paged_decode(&attn, &storage, &table, 0, &q).unwrap();
    assert_eq!(again[0].out, dense.out);

    // One flipped bit is counted and reaches the rows read.
    let block = cache.block_table(seq).unwrap()[0];
    let flips = ExactFlips::new([14]); // bit 6 of byte 1: value 0's exponent
    let injected = storage
        .inject(block, 0, KvPart::Keys, &flips, 0, FaultTarget::Everything)
        .unwrap();
    assert_eq!(injected.total(), 1);
    let mut row = vec![0.0; ch];
    storage
        .read(block, 0, KvPart::Keys, 0, &mut row, &mut scratch)
        .unwrap();
    assert_ne!(row[0], kr[0]);
    assert_eq!(row[1..], kr[1..ch]);
}

#[test]
fn parts_that_disagree_are_refused() {
    let ch = 32;
    let part = |blocks, bs, ch| Box::new(Bf16Part::new(blocks, bs, ch)) as Box<dyn StoredPart>;
    for parts in [
        vec![[part(4, 16, ch), part(4, 8, ch)]],
        vec![[part(4, 16, ch), part(5, 16, ch)]],
        vec![[part(4, 16, ch), part(4, 16, 2 * ch)]],
        vec![
            [part(4, 16, ch), part(4, 16, ch)],
            [part(4, 8, ch), part(4, 8, ch)],
        ],
        vec![],
    ] {
        assert!(matches!(
            BlockStorage::from_parts(parts),
            Err(PagedCacheError::InvalidParameter { .. })
        ));
    }
}
