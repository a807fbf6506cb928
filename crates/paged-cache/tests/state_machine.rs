//! A proptest state machine over random operation sequences (add with
//! prefix lookup, append, fork, write, free, truncate, cache a prefix,
//! evict, swap out, swap in, inject a flip, scrub) on a cache with real
//! two-layer block storage, for both prefix caches. After every step:
//! [`KvCacheManager::check_invariants`] (free + used = total, the free list
//! is exactly the blocks with count zero, hash index and block hashes agree
//! both ways, counts equal users so nothing is freed twice or leaked, every
//! sequence's slots hold its tokens) and every resident sequence's K/V,
//! decoded from its blocks, equals what the model says it wrote, so a
//! shared block written in place would show up in a sibling.
//!
//! Layer 0 also runs staged forms (per-channel keys, sinks, windows, and
//! the calibrated low-rank and Shard forms, whose tables are fitted once
//! and shared by every block) with a `Seal` op: the model then holds each
//! position's exact (f16) row until a seal, which turns a block's rows into
//! the values of the block coded at once, in every sequence sharing it; a
//! row written into a sealed block stages it again from its stored values
//! (and, like `Write`, makes the sequence dirty). What a row written now
//! reads back as, and what a block seals to, come from an oracle: a fresh
//! one-block part of the same form and tables (sealing is a function of
//! the block's rows, its first position and the tables), or a one-group
//! part for per-channel groups over several blocks, which seal, stage
//! again when written or cut into, and are shared whole.
//!
//! K/V rows are a fixed function of the token prefix, as in a real model,
//! except after a `Write` op, which perturbs a row and marks the sequence
//! (and its forks) dirty: dirty sequences are never put in the prefix cache,
//! so every prefix hit must return exactly the canonical rows.

use std::cell::RefCell;
use std::sync::Arc;

use attention::TileRows;
use attention::stored::{PartScratch, StoredPart, open_part, part_seals};
use gf2_codes::channel::{FaultChannel, FaultRng, Flips};
use kv_quant::{BlockPlan, CacheForm, DecodeScratch, FaultTarget, QuantizeOptions, RowBuffers};
use paged_cache::{
    BlockId, BlockStorage, CacheConfig, HashPrefixCache, KvCacheManager, KvPart, LayerSpec,
    PagedCacheError, PrefixCache, RadixPrefixCache, SeqId,
};
use proptest::prelude::*;

#[path = "state_machine/fitted.rs"]
mod fitted;
use fitted::fitted;

const BS: usize = 4;
const CH: usize = 8;
const BLOCKS: usize = 24;
const HOST: usize = 12;
/// Channels per head of the low-rank and Shard forms' tables.
const HEAD_DIM: usize = 4;
const LAYER0_FORMS: [&str; 15] = [
    "fp16",
    // Per-channel groups of 2 and 4 blocks, kept as channel slices.
    "int4-ch8+sink2",
    "int2-ch16+win3",
    "vq-k16+rot8",
    "int8",
    "fp8-e4m3-tok",
    "int4-g4+golay24",
    "nf4-g8",
    "int4-ch+sink2",
    "int8-ch+win3",
    "int4-ch+secded84",
    "pca-r2",
    // Projected before RoPE: each sealed block rotated back from its
    // position, and to it when read.
    "pca-r2-pre",
    "shard-k3-cal+sink2+win3",
    // Dense-and-sparse: outliers split off each sealed block.
    "int2-ch+sink2+out10+secded84",
];
const PROTECTED: &str = "int4-g4+secded84";

#[derive(Clone, Debug)]
enum Op {
    Add { base: usize, len: usize, salt: u64 },
    Append { seq: usize, tokens: Vec<u32> },
    Fork { seq: usize },
    Write { seq: usize, pos: usize },
    Free { seq: usize },
    Truncate { seq: usize, n: usize },
    Cache { seq: usize },
    Evict { n: usize },
    SwapOut { seq: usize },
    SwapIn { seq: usize },
    Inject { seq: usize, bit: u64 },
    Scrub,
    Seal { seq: usize },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..3usize, 1..=14usize, 0..2u64).prop_map(|(base, len, salt)| Op::Add { base, len, salt }),
        4 => (any::<usize>(), proptest::collection::vec(0..3u32, 1..6)).prop_map(|(seq, tokens)| Op::Append { seq, tokens }),
        2 => any::<usize>().prop_map(|seq| Op::Fork { seq }),
        2 => (any::<usize>(), any::<usize>()).prop_map(|(seq, pos)| Op::Write { seq, pos }),
        2 => any::<usize>().prop_map(|seq| Op::Free { seq }),
        2 => (any::<usize>(), 0..6usize).prop_map(|(seq, n)| Op::Truncate { seq, n }),
        2 => any::<usize>().prop_map(|seq| Op::Cache { seq }),
        1 => (0..6usize).prop_map(|n| Op::Evict { n }),
        1 => any::<usize>().prop_map(|seq| Op::SwapOut { seq }),
        1 => any::<usize>().prop_map(|seq| Op::SwapIn { seq }),
        1 => (any::<usize>(), any::<u64>()).prop_map(|(seq, bit)| Op::Inject { seq, bit }),
        1 => Just(Op::Scrub),
        3 => any::<usize>().prop_map(|seq| Op::Seal { seq }),
    ]
}

/// Flips exactly one chosen bit.
#[derive(Debug)]
struct OneBit(u64);

impl FaultChannel for OneBit {
    fn inject_with(&self, data: &mut [u8], _: &mut FaultRng) -> Flips {
        if data.is_empty() {
            return Flips::from_events(Vec::new());
        }
        let bit = self.0 % (8 * data.len() as u64);
        data[(bit / 8) as usize] ^= 1 << (bit % 8);
        Flips::from_events(vec![bit])
    }
}

fn bases() -> [Vec<u32>; 3] {
    // Small alphabet, so appends and prompts share prefixes often.
    [
        (0..16).map(|i| i % 3).collect(),
        (0..16).map(|i| (i * 7 + 1) % 3).collect(),
        (0..16).map(|i| u32::from(i % 5 == 0)).collect(),
    ]
}

/// The canonical row of `layer`/`part` at the end of `prefix`.
fn canonical(prefix: &[u32], layer: usize, part: usize, version: u32) -> Vec<f32> {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325 ^ (layer as u64) << 8 ^ part as u64;
    for &t in prefix {
        h = (h ^ u64::from(t) ^ (prefix.len() as u64) << 40).wrapping_mul(0x1000_0000_01b3);
    }
    h ^= u64::from(version) << 32;
    (0..CH)
        .map(|c| {
            let x = h.wrapping_mul(2 * c as u64 + 1).rotate_left(17) >> 40;
            (x as f32 / (1u64 << 24) as f32) * 4.0 - 2.0
        })
        .collect()
}

/// Expected decoded rows of one position: `[layer][K, V]`.
type Rows = [[Vec<f32>; 2]; 2];

struct Harness<P: PrefixCache> {
    cache: KvCacheManager<P>,
    storage: Arc<BlockStorage>,
    /// Whether each layer's K and V stage rows and seal blocks.
    seals: [[bool; 2]; 2],
    /// Layer 0's K and V blocks per per-channel group (1 where blocks seal
    /// alone), and its sink blocks.
    groups: [usize; 2],
    sinks: usize,
    /// One-block parts of each layer's K and V forms and tables (`[layer *
    /// 2 + part]`): what a written row reads back as, what a block seals to.
    oracles: RefCell<Vec<Box<dyn StoredPart>>>,
    /// Per live sequence: expected decoded rows `[position][layer][part]`, dirty flag.
    model: std::collections::BTreeMap<SeqId, (Vec<Rows>, bool)>,
    /// The values sealed blocks of layer 0 held, by the tokens from the
    /// sequence's start to the block's end and by part, as the model said
    /// while a sequence held the block whole (a dirty sequence's block of
    /// the same tokens may hold other values: every one is kept).
    sealed_rows: std::collections::HashMap<(Vec<u32>, usize), Vec<Vec<f32>>>,
    pending_flip: bool,
}

impl<P: PrefixCache> Harness<P> {
    fn new(prefix: P, layer0: &str) -> Self {
        let forms: [CacheForm; 2] = [layer0.parse().unwrap(), PROTECTED.parse().unwrap()];
        let layers = forms.map(|form| LayerSpec::uniform(form, CH));
        let seals = forms.map(|form| [part_seals(form, BS); 2]);
        let fitted = forms.map(fitted);
        let plan = BlockPlan::new(forms[0], BS).ok();
        let group = plan.map_or(1, |p| p.group_blocks);
        let sinks = plan.map_or(forms[0].segments().sink.div_ceil(BS), |p| p.sink_blocks);
        // A group's oracle holds the sink blocks before it, unused.
        let blocks = if group > 1 { sinks + group } else { 1 };
        let oracles = (0..4)
            .map(|i| open_part(forms[i / 2], BS, CH, blocks, &fitted[i / 2][i % 2]).unwrap())
            .collect();
        let storage = Arc::new(BlockStorage::with_fitted(BLOCKS, BS, &layers, &fitted).unwrap());
        let config = CacheConfig {
            num_blocks: BLOCKS,
            block_size: BS,
            host_blocks: HOST,
        };
        Self {
            cache: KvCacheManager::with_storage(config, prefix, storage.clone()).unwrap(),
            storage,
            seals,
            groups: [group; 2],
            sinks,
            oracles: RefCell::new(oracles),
            model: Default::default(),
            sealed_rows: Default::default(),
            pending_flip: false,
        }
    }

    /// `rows` written into the oracle blocks of `layer`'s `part` (sealed as
    /// the block or group whose first row is position `first`, if given),
    /// read back.
    fn oracle(&self, layer: usize, part: usize, rows: &[f32], seal: Option<usize>) -> Vec<f32> {
        let mut oracles = self.oracles.borrow_mut();
        let p = &mut oracles[layer * 2 + part];
        let pages: Vec<u32> = (0..p.num_blocks() as u32).collect();
        for &b in &pages {
            p.open_block(b as usize).unwrap();
        }
        let mut encoder = p.row_encoder().unwrap();
        let mut buf = RowBuffers::new(encoder.buffer_sizes(1));
        // A group's rows go in after the sink blocks.
        let base = if pages.len() > 1 { self.sinks } else { 0 };
        for (i, row) in rows.chunks_exact(CH).enumerate() {
            encoder
                .encode_into(row, buf.as_mut(), QuantizeOptions::default())
                .unwrap();
            p.put_row(base + i / BS, i % BS, &buf).unwrap();
        }
        if let Some(first) = seal {
            if pages.len() > 1 {
                let m = pages.len() - base;
                assert_eq!(p.seal_pages(&pages, base).unwrap(), m, "the group seals");
            } else {
                assert!(p.seal(0, first).unwrap(), "the oracle block seals");
            }
        }
        // Row by row, as `verify` reads (a Shard key row rebuilt in a tile
        // of several rounds its sums another way).
        let mut out = vec![0.0; rows.len()];
        for (i, row) in out.chunks_exact_mut(CH).enumerate() {
            row.copy_from_slice(&read_row(p.as_ref(), &pages, base * BS + i));
        }
        out
    }

    /// The values a row written now reads back as: exact (f16) in a staged
    /// part, quantized alone in a row-local one.
    fn expected(&self, row: &[f32], layer: usize, part: usize) -> Vec<f32> {
        self.oracle(layer, part, row, None)
    }

    /// What layer 0's `part` seals `held` (one block's or group's rows as
    /// the model holds them, the first at position `first`) to, row by
    /// row.
    fn sealed_to(&self, part: usize, held: &[f32], first: usize) -> Vec<Vec<f32>> {
        self.oracle(0, part, held, Some(first))
            .chunks_exact(CH)
            .map(<[f32]>::to_vec)
            .collect()
    }

    /// The block-table positions layer 0's `part` seals together with
    /// position `index`.
    fn span(&self, part: usize, index: usize) -> std::ops::Range<usize> {
        let m = self.groups[part];
        match index.checked_sub(self.sinks) {
            Some(past) if m > 1 => {
                let start = self.sinks + past / m * m;
                start..start + m
            }
            _ => index..index + 1,
        }
    }

    /// Row `pos` of `id`'s `layer`/`part` as the cache reads it.
    fn read(&self, table: &[BlockId], pos: usize, layer: usize, part: KvPart) -> Vec<f32> {
        let pages: Vec<u32> = table.iter().map(|b| b.0).collect();
        read_row(
            self.storage.part(layer, part).unwrap().as_ref(),
            &pages,
            pos,
        )
    }

    /// Whether `block` holds sealed rows in a staged part of `layer`.
    fn sealed(&self, block: BlockId, layer: usize, part: usize) -> bool {
        self.seals[layer][part]
            && !self
                .storage
                .is_staged(block, layer, [KvPart::Keys, KvPart::Values][part])
                .unwrap()
    }

    /// Before a row of `id` is written at `pos`: where its block is sealed,
    /// the write stages it again from its stored values (exact rows of
    /// them), and the sequence stops holding canonical rows.
    fn before_write(&mut self, id: SeqId, pos: usize, layer: usize) -> Result<(), PagedCacheError> {
        let table = self.cache.block_table(id)?;
        for part in 0..2 {
            let blocks = if layer == 0 {
                self.span(part, pos / BS)
            } else {
                pos / BS..pos / BS + 1
            };
            if self.sealed(table[blocks.start.min(table.len() - 1)], layer, part) {
                let rows = &self.model[&id].0;
                let span = blocks.start * BS..rows.len().min(blocks.end * BS);
                let exact: Vec<Vec<f32>> = span
                    .clone()
                    .map(|q| self.expected(&rows[q][layer][part], layer, part))
                    .collect();
                let entry = self.model.get_mut(&id).expect("modelled");
                for (q, row) in span.zip(exact) {
                    entry.0[q][layer][part] = row;
                }
                entry.1 = true;
            }
        }
        Ok(())
    }

    /// Writes canonical (or perturbed) rows for positions `from..` of `id`.
    fn write_rows(&mut self, id: SeqId, from: usize, version: u32) -> Result<(), PagedCacheError> {
        let tokens = self.cache.tokens(id)?.to_vec();
        for pos in from..tokens.len() {
            let mut rows: Rows = Default::default();
            for (layer, row) in rows.iter_mut().enumerate() {
                let k = canonical(&tokens[..=pos], layer, 0, version);
                let v = canonical(&tokens[..=pos], layer, 1, version);
                self.before_write(id, pos, layer)?;
                self.cache.write_kv(id, pos, layer, &k, &v)?;
                *row = [self.expected(&k, layer, 0), self.expected(&v, layer, 1)];
            }
            let entry = self.model.get_mut(&id).expect("modelled");
            if pos < entry.0.len() {
                entry.0[pos] = rows;
            } else {
                entry.0.push(rows);
            }
        }
        Ok(())
    }

    fn live(&self, i: usize) -> Option<SeqId> {
        let ids: Vec<SeqId> = self.model.keys().copied().collect();
        (!ids.is_empty()).then(|| ids[i % ids.len()])
    }

    fn apply(&mut self, op: &Op) -> Result<(), PagedCacheError> {
        match *op {
            Op::Add { base, len, salt } => {
                let prompt = bases()[base][..len].to_vec();
                let was_sealed: Vec<[bool; 2]> = (0..BLOCKS as u32)
                    .map(|b| [0, 1].map(|part| self.sealed(BlockId(b), 0, part)))
                    .collect();
                let (id, hit) = match self.cache.add_sequence(&prompt, salt) {
                    Err(PagedCacheError::PoolExhausted { .. }) => return Ok(()),
                    other => other?,
                };
                // Positions before the hit hold canonical rows already:
                // exact, or in a sealed block the values it was sealed to.
                let table = self.cache.block_table(id)?.to_vec();
                let mut rows = Vec::new();
                for pos in 0..hit {
                    let mut r: Rows = Default::default();
                    for (layer, r) in r.iter_mut().enumerate() {
                        for (part, r) in r.iter_mut().enumerate() {
                            let block = table[pos / BS];
                            *r = if layer == 0
                                && pos / BS < hit / BS
                                && self.sealed(block, 0, part)
                                && !was_sealed[block.index()][part]
                            {
                                // Sealed by this hit (its prefix made the
                                // whole block or group sealable; a partial
                                // block is a copy): the hit's exact rows.
                                let blocks = self.span(part, pos / BS);
                                let start = blocks.start * BS;
                                let held: Vec<f32> = (start..blocks.end * BS)
                                    .flat_map(|q| {
                                        self.expected(
                                            &canonical(&prompt[..=q], 0, part, 0),
                                            0,
                                            part,
                                        )
                                    })
                                    .collect();
                                self.sealed_to(part, &held, start).swap_remove(pos - start)
                            } else if self.sealed(block, layer, part) {
                                self.sealed_hit(id, &prompt, hit, pos, block, part)
                            } else {
                                self.expected(
                                    &canonical(&prompt[..=pos], layer, part, 0),
                                    layer,
                                    part,
                                )
                            };
                        }
                    }
                    rows.push(r);
                }
                // Every other sequence sharing a block this hit sealed
                // reads the new values too.
                for (i, &block) in table.iter().enumerate().take(hit / BS) {
                    for part in 0..2 {
                        if was_sealed[block.index()][part] || !self.sealed(block, 0, part) {
                            continue;
                        }
                        let sealed: Vec<Vec<f32>> = rows[i * BS..(i + 1) * BS]
                            .iter()
                            .map(|r: &Rows| r[0][part].clone())
                            .collect();
                        self.share_sealed(block, part, &sealed)?;
                    }
                }
                self.model.insert(id, (rows, false));
                self.write_rows(id, hit, 0)
            }
            Op::Append { seq, ref tokens } => {
                let Some(id) = self.live(seq) else {
                    return Ok(());
                };
                if self.cache.is_swapped(id)? {
                    return Ok(());
                }
                let from = self.cache.tokens(id)?.len();
                match self.cache.append(id, tokens) {
                    Err(PagedCacheError::PoolExhausted { .. }) => return Ok(()),
                    other => other?,
                }
                let dirty = self.model[&id].1;
                self.write_rows(id, from, u32::from(dirty) * 7)
            }
            Op::Fork { seq } => {
                let Some(id) = self.live(seq) else {
                    return Ok(());
                };
                if self.cache.is_swapped(id)? {
                    return Ok(());
                }
                // A fork copies the written blocks of a group being filled.
                let child = match self.cache.fork(id) {
                    Err(PagedCacheError::PoolExhausted { .. }) => return Ok(()),
                    other => other?,
                };
                let m = self.model[&id].clone();
                self.model.insert(child, m);
                Ok(())
            }
            Op::Write { seq, pos } => {
                let Some(id) = self.live(seq) else {
                    return Ok(());
                };
                let len = self.cache.tokens(id)?.len();
                if self.cache.is_swapped(id)? || len == 0 {
                    return Ok(());
                }
                let pos = pos % len;
                let tokens = self.cache.tokens(id)?[..=pos].to_vec();
                let mut rows: Rows = Default::default();
                for (layer, row) in rows.iter_mut().enumerate() {
                    let k = canonical(&tokens, layer, 0, 3);
                    let v = canonical(&tokens, layer, 1, 3);
                    // A copy-on-write that runs out of blocks changes
                    // nothing; the model's rows of a sealed block turn
                    // exact only once the write goes ahead.
                    let model = self.model[&id].clone();
                    self.before_write(id, pos, layer)?;
                    match self.cache.write_kv(id, pos, layer, &k, &v) {
                        Err(PagedCacheError::PoolExhausted { .. }) if layer == 0 => {
                            self.model.insert(id, model);
                            return Ok(());
                        }
                        // Only the first layer can run out (copy-on-write);
                        // then nothing was written.
                        other => other?,
                    }
                    *row = [self.expected(&k, layer, 0), self.expected(&v, layer, 1)];
                }
                let entry = self.model.get_mut(&id).expect("modelled");
                entry.0[pos] = rows;
                entry.1 = true;
                Ok(())
            }
            Op::Free { seq } => {
                let Some(id) = self.live(seq) else {
                    return Ok(());
                };
                self.cache.free(id)?;
                self.model.remove(&id);
                Ok(())
            }
            Op::Truncate { seq, n } => {
                let Some(id) = self.live(seq) else {
                    return Ok(());
                };
                if self.cache.is_swapped(id)? {
                    return Ok(());
                }
                let n = n.min(self.cache.tokens(id)?.len());
                self.cut(id, n)
            }
            Op::Cache { seq } => {
                let Some(id) = self.live(seq) else {
                    return Ok(());
                };
                if self.cache.is_swapped(id)? || self.model[&id].1 {
                    return Ok(());
                }
                let len = self.cache.tokens(id)?.len();
                self.cache.cache_prefix(id, len)
            }
            Op::Evict { n } => self.cache.evict(n).map(|_| ()),
            Op::SwapOut { seq } => {
                let Some(id) = self.live(seq) else {
                    return Ok(());
                };
                match self.cache.swap_out(id) {
                    Err(PagedCacheError::HostTierFull { .. } | PagedCacheError::SwappedOut(_)) => {
                        Ok(())
                    }
                    other => other,
                }
            }
            Op::SwapIn { seq } => {
                let Some(id) = self.live(seq) else {
                    return Ok(());
                };
                match self.cache.swap_in(id) {
                    Err(PagedCacheError::PoolExhausted { .. } | PagedCacheError::NotSwapped(_)) => {
                        Ok(())
                    }
                    other => other,
                }
            }
            Op::Inject { seq, bit } => {
                if self.pending_flip {
                    return self.apply(&Op::Scrub);
                }
                let Some(id) = self.live(seq) else {
                    return Ok(());
                };
                if self.cache.is_swapped(id)? || self.cache.tokens(id)?.is_empty() {
                    return Ok(());
                }
                let table = self.cache.block_table(id)?;
                let block = table[(bit as usize) % table.len()];
                let flips = self.storage.inject(
                    block,
                    1,
                    KvPart::Keys,
                    &OneBit(bit >> 8),
                    0,
                    FaultTarget::Values,
                )?;
                assert_eq!(flips.total(), 1);
                self.pending_flip = true;
                Ok(())
            }
            Op::Seal { seq } => {
                let Some(id) = self.live(seq) else {
                    return Ok(());
                };
                if self.cache.is_swapped(id)? {
                    return Ok(());
                }
                let table = self.cache.block_table(id)?.to_vec();
                let before: Vec<[bool; 2]> = table
                    .iter()
                    .map(|&b| [0, 1].map(|part| self.sealed(b, 0, part)))
                    .collect();
                let len = self.cache.tokens(id)?.len();
                self.cache.seal(id, 0, len)?;
                for (i, &block) in table.iter().enumerate() {
                    for part in 0..2 {
                        let blocks = self.span(part, i);
                        if before[i][part] || !self.sealed(block, 0, part) || blocks.start != i {
                            continue;
                        }
                        // Sealed now: the block's or group's rows (all held
                        // by `id`) quantized at once, in every sequence
                        // sharing it.
                        let held: Vec<f32> = self.model[&id].0[i * BS..blocks.end * BS]
                            .iter()
                            .flat_map(|r| r[0][part].clone())
                            .collect();
                        let sealed = self.sealed_to(part, &held, i * BS);
                        for (j, rows) in blocks.zip(sealed.chunks(BS)) {
                            self.share_sealed(table[j], part, rows)?;
                        }
                    }
                }
                Ok(())
            }
            Op::Scrub => {
                self.cache.scrub()?;
                let again = self.cache.scrub()?;
                assert_eq!(
                    again.values.corrected + again.metadata.corrected,
                    0,
                    "a second pass finds nothing"
                );
                assert_eq!(
                    again.values.detected + again.metadata.detected,
                    0,
                    "single flips only"
                );
                self.pending_flip = false;
                Ok(())
            }
        }
    }

    /// Sets the rows of `block` (part `part` of layer 0) to `sealed` in
    /// every resident sequence holding it.
    fn share_sealed(
        &mut self,
        block: BlockId,
        part: usize,
        sealed: &[Vec<f32>],
    ) -> Result<(), PagedCacheError> {
        let ids: Vec<SeqId> = self.model.keys().copied().collect();
        for other in ids {
            if self.cache.is_swapped(other)? {
                continue;
            }
            let at = self
                .cache
                .block_table(other)?
                .iter()
                .position(|&b| b == block);
            let Some(j) = at else { continue };
            let rows = &mut self.model.get_mut(&other).expect("modelled").0;
            for q in j * BS..rows.len().min((j + 1) * BS) {
                rows[q][0][part] = sealed[q - j * BS].clone();
            }
        }
        Ok(())
    }

    /// The values of a prefix hit's position `pos` in a sealed `block`:
    /// those of a block sealed while a clean sequence held it whole, whose
    /// tokens up to the hit are the prompt's. A partial hit's block is a
    /// copy whose later slots hold the new prompt already, so the source
    /// is found by the hit tokens (a block of another prompt with the
    /// same hit tokens would qualify too: the check is that the values are
    /// those of a sealed block of this path, not of any other).
    fn sealed_hit(
        &self,
        id: SeqId,
        prompt: &[u32],
        hit: usize,
        pos: usize,
        block: BlockId,
        part: usize,
    ) -> Vec<f32> {
        let start = pos / BS * BS;
        let known = (hit - start).min(BS);
        let _ = block;
        let table = self.cache.block_table(id).unwrap();
        let got = self.read(table, pos, 0, [KvPart::Keys, KvPart::Values][part]);
        let found = self.sealed_rows.iter().any(|((path, p), held)| {
            *p == part
                && path.len() == start + BS
                && path[..start + known] == prompt[..start + known]
                && held.iter().any(|h| h[(pos % BS) * CH..][..CH] == got[..])
        });
        assert!(
            found,
            "position {pos} of a hit on a sealed block: {got:?} is no sealed block's"
        );
        got
    }

    /// Records the values of every sealed block a sequence holds whole
    /// (after [`verify`](Self::verify) found them as the model says).
    fn record_sealed(&mut self) {
        let mut found = Vec::new();
        for (&id, (rows, _)) in &self.model {
            if self.cache.is_swapped(id).unwrap() {
                continue;
            }
            let tokens = self.cache.tokens(id).unwrap();
            for (i, &block) in self.cache.block_table(id).unwrap().iter().enumerate() {
                for part in 0..2 {
                    if rows.len() >= (i + 1) * BS && self.sealed(block, 0, part) {
                        let held = rows[i * BS..(i + 1) * BS]
                            .iter()
                            .flat_map(|r| r[0][part].clone())
                            .collect();
                        found.push(((tokens[..(i + 1) * BS].to_vec(), part), held));
                    }
                }
            }
        }
        for (key, held) in found {
            let known = self.sealed_rows.entry(key).or_default();
            if !known.contains(&held) {
                known.push(held);
            }
        }
    }

    fn verify(&self) {
        self.cache.check_invariants().unwrap();
        for (&id, (rows, _)) in &self.model {
            assert_eq!(self.cache.tokens(id).unwrap().len(), rows.len(), "{id}");
            if self.cache.is_swapped(id).unwrap() {
                continue;
            }
            let table = self.cache.block_table(id).unwrap();
            for (pos, want) in rows.iter().enumerate() {
                for (layer, want) in want.iter().enumerate() {
                    for (part, want) in [KvPart::Keys, KvPart::Values].into_iter().zip(want) {
                        let out = self.read(table, pos, layer, part);
                        assert_eq!(&out, want, "{id} position {pos} layer {layer} {part:?}");
                    }
                }
            }
        }
    }
}

impl<P: PrefixCache> Harness<P> {
    /// Cuts the last `n` tokens of `id`: a cut into a sealed group of
    /// blocks stages the group's kept blocks again, from the values they
    /// read as (exact rows of them: the sequence stops holding canonical
    /// rows).
    fn cut(&mut self, id: SeqId, n: usize) -> Result<(), PagedCacheError> {
        let table = self.cache.block_table(id)?.to_vec();
        let keep = self.cache.tokens(id)?.len() - n;
        let was_sealed: [bool; 2] = [0, 1].map(|part| {
            keep > 0 && {
                let blocks = self.span(part, (keep - 1) / BS);
                blocks.len() > 1
                    && keep < blocks.end * BS
                    && table
                        .get(blocks.start)
                        .is_some_and(|&b| self.sealed(b, 0, part))
            }
        });
        // A cut into a shared sealed group copies its kept blocks first.
        match self.cache.truncate(id, n) {
            Err(PagedCacheError::PoolExhausted { .. }) => return Ok(()),
            other => other?,
        }
        let rows = &mut self.model.get_mut(&id).expect("modelled").0;
        rows.truncate(keep);
        for part in (0..2).filter(|&p| was_sealed[p]) {
            let start = self.span(part, (keep - 1) / BS).start * BS;
            let exact: Vec<Vec<f32>> = (start..keep)
                .map(|q| self.expected(&self.model[&id].0[q][0][part], 0, part))
                .collect();
            let entry = self.model.get_mut(&id).expect("modelled");
            for (q, row) in (start..keep).zip(exact) {
                entry.0[q][0][part] = row;
            }
            entry.1 = true;
        }
        Ok(())
    }
}

/// Row `pos` of the sequence on `pages` as `part` reads it: through its
/// block alone (`read_rows`) where it can be, else as a one-row tile (a
/// sealed per-channel group over several blocks), in the rows'
/// coordinates.
fn read_row(part: &dyn StoredPart, pages: &[u32], pos: usize) -> Vec<f32> {
    let mut out = vec![0.0; CH];
    let block = pages[pos / BS] as usize;
    if part.sealed_with(pos / BS).len() <= 1 || part.is_staged(block) {
        part.read_rows(block, pos % BS, &mut out, &mut DecodeScratch::new())
            .unwrap();
        return out;
    }
    let mut scratch = PartScratch::default();
    let tile = part.read_tile(pages, pos, 1, &mut scratch).unwrap();
    match tile.rows {
        TileRows::Levels(l) => l.dequantize_into(&mut out),
        TileRows::F32(r) => out.copy_from_slice(r),
        TileRows::F16(_) | TileRows::PairCodes(_) => {
            unreachable!("a sealed group reads as levels or f32")
        }
    }
    out
}

fn run<P: PrefixCache>(prefix: P, layer0: &str, ops: &[Op]) {
    let mut h = Harness::new(prefix, layer0);
    for op in ops {
        h.apply(op).unwrap_or_else(|e| panic!("{op:?}: {e}"));
        h.verify();
        h.record_sealed();
    }
    // Freeing everything and evicting every cached prefix gives back every block.
    let ids: Vec<SeqId> = h.model.keys().copied().collect();
    for id in ids {
        h.cache.free(id).unwrap();
    }
    h.cache.evict(usize::MAX).unwrap();
    h.cache.check_invariants().unwrap();
    assert_eq!(h.cache.pool().num_free(), BLOCKS);
    assert_eq!(h.cache.host_free(), HOST);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(if cfg!(debug_assertions) { 48 } else { 256 }))]

    #[test]
    fn hash_cache_state_machine(form in 0..LAYER0_FORMS.len(), ops in proptest::collection::vec(op(), 1..60)) {
        run(HashPrefixCache::new(BS), LAYER0_FORMS[form], &ops);
    }

    #[test]
    fn radix_cache_state_machine(form in 0..LAYER0_FORMS.len(), ops in proptest::collection::vec(op(), 1..60)) {
        run(RadixPrefixCache::new(BS), LAYER0_FORMS[form], &ops);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(if cfg!(debug_assertions) { 256 } else { 512 }))]

    /// The forms whose groups span several blocks, which fork, share, seal
    /// and cut whole groups, get cases of their own.
    #[test]
    fn grouped_forms_state_machine(form in 1..3usize, radix: bool, ops in proptest::collection::vec(op(), 1..60)) {
        if radix {
            run(RadixPrefixCache::new(BS), LAYER0_FORMS[form], &ops);
        } else {
            run(HashPrefixCache::new(BS), LAYER0_FORMS[form], &ops);
        }
    }
}
