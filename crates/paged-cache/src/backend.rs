//! [`PagedBackend`]: one sequence's KV cache on paged blocks, as an
//! [`attention::KvBackend`] a model's forward pass can run on.
//!
//! A step's tokens get their slots when the step begins (blocks taken from
//! the pool, a shared block copied first); each token's K and V rows are
//! quantised and encoded once, when written, into their slot in the layer's
//! forms ([`BlockStorage`]); attention reads the sequence's pages through
//! [`PagedKv`] and the attention crate's blockwise kernels. A rolled-back
//! step gives its slots back (blocks left empty return to the pool).

use std::sync::Arc;

use attention::{Attention, AttentionOutput, KvBackend, Mask, ModelKvShape, StepRows, check_fit};
use gf2_codes::channel::FaultChannel;
use kv_quant::{FaultTarget, KvDecodeStats, ScrubStats};

use crate::error::{PagedCacheError, Result};
use crate::manager::{CacheConfig, KvCacheManager, SeqId};
use crate::page_table::{PageTable, PagedKv};
use crate::prefix::{NoPrefixCache, PrefixCache};
use crate::storage::{BlockStorage, KvPart, LayerSpec};

/// Decode statistics of everything a [`PagedBackend`]'s attention read.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PagedReadStats {
    /// Key tiles.
    pub keys: KvDecodeStats,
    /// Value tiles.
    pub values: KvDecodeStats,
}

/// One sequence's paged, encoded KV cache (see the module docs).
#[derive(Debug)]
pub struct PagedBackend<P: PrefixCache = NoPrefixCache> {
    manager: KvCacheManager<P>,
    storage: Arc<BlockStorage>,
    seq: Option<SeqId>,
    tokens: usize,
    step: StepRows,
    stats: PagedReadStats,
    /// Bits [`inject`](PagedBackend::inject) flipped in fitted tables.
    table_flips: std::sync::atomic::AtomicU64,
}

/// Salt of the fault streams of the fitted tables (apart from the blocks').
const TABLE_SALT: u64 = 0x7461_626c_6573;
/// Salt of the streams that fault a sequence's own fitted tables.
const SEQUENCE_TABLE_SALT: u64 = 0x7365_7174_6162;

impl PagedBackend<NoPrefixCache> {
    /// A cache of `num_blocks` blocks of `block_size` tokens holding `layers`
    /// (each layer's key and value forms must be
    /// [pageable](crate::check_pageable) in blocks of `block_size`).
    pub fn new(layers: &[LayerSpec], block_size: usize, num_blocks: usize) -> Result<Self> {
        Self::with_prefix_cache(layers, block_size, num_blocks, NoPrefixCache)
    }
}

impl<P: PrefixCache> PagedBackend<P> {
    /// [`new`](PagedBackend::new) with a prefix cache.
    pub fn with_prefix_cache(
        layers: &[LayerSpec],
        block_size: usize,
        num_blocks: usize,
        prefix: P,
    ) -> Result<Self> {
        let storage = Arc::new(BlockStorage::new(num_blocks, block_size, layers)?);
        Self::with_storage(storage, prefix)
    }

    /// A cache over `storage` built by the caller (calibrated forms'
    /// fitted tables: [`BlockStorage::with_fitted`]; parts defined
    /// elsewhere: [`BlockStorage::from_parts`]), all of its blocks.
    pub fn with_storage(storage: Arc<BlockStorage>, prefix: P) -> Result<Self> {
        let config = CacheConfig {
            num_blocks: storage.num_blocks(),
            block_size: storage.block_size(),
            host_blocks: 0,
        };
        let layers = storage.layers().len();
        Ok(Self {
            manager: KvCacheManager::with_storage(config, prefix, storage.clone())?,
            storage,
            seq: None,
            tokens: 0,
            step: StepRows::new(layers),
            stats: PagedReadStats::default(),
            table_flips: Default::default(),
        })
    }

    /// The block manager (pool, tables, statistics).
    pub fn manager(&self) -> &KvCacheManager<P> {
        &self.manager
    }

    /// The blocks' bytes.
    pub fn storage(&self) -> &Arc<BlockStorage> {
        &self.storage
    }

    /// The sequence, once a step has begun.
    pub fn sequence(&self) -> Option<SeqId> {
        self.seq
    }

    /// Decode statistics of every attention read so far.
    pub fn read_stats(&self) -> PagedReadStats {
        self.stats
    }

    /// Bytes held by the sequence's blocks (K and V of every layer), counted
    /// from the stores' buffers (staged exact rows included).
    pub fn stored_bytes(&self) -> Result<usize> {
        let Some(seq) = self.seq else { return Ok(0) };
        let mut bytes = 0;
        for &block in self.manager.block_table(seq)? {
            for layer in 0..self.storage.layers().len() {
                bytes += self.storage.block_layer_bytes(block, layer)?;
            }
        }
        Ok(bytes)
    }

    /// Flips bits of every block the sequence holds (every layer, K and V)
    /// through `channel`: the store of layer `l`, part `p` in the `i`-th
    /// block of the table draws from its own stream of `seed`; then of the
    /// fitted tables every layer part reads (a `vq` codebook, calibrated
    /// bases, and the tables a Shard form fitted on this sequence, under
    /// targets that reach metadata), each from a stream of its own.
    /// Returns the bits flipped.
    pub fn inject(
        &self,
        channel: &dyn FaultChannel,
        seed: u64,
        target: FaultTarget,
    ) -> Result<u64> {
        let Some(seq) = self.seq else { return Ok(0) };
        let layers = self.storage.layers().len() as u64;
        let mut flips = 0;
        for (i, &block) in self.manager.block_table(seq)?.iter().enumerate() {
            for layer in 0..layers {
                for (p, part) in [KvPart::Keys, KvPart::Values].into_iter().enumerate() {
                    let stream = (i as u64 * layers + layer) * 2 + p as u64;
                    let s = seed ^ stream.wrapping_mul(0x9e37_79b9_7f4a_7c15);
                    flips += self
                        .storage
                        .inject(block, layer as usize, part, channel, s, target)?
                        .total() as u64;
                }
            }
        }
        for layer in 0..layers {
            for (p, part) in [KvPart::Keys, KvPart::Values].into_iter().enumerate() {
                let s =
                    seed ^ TABLE_SALT ^ (layer * 2 + p as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
                let mut hit = self
                    .storage
                    .inject_shared(layer as usize, part, channel, s, target)?
                    .total() as u64;
                let s = s ^ SEQUENCE_TABLE_SALT;
                hit += self
                    .storage
                    .inject_sequence(
                        self.manager.sequence_tables(seq)?,
                        layer as usize,
                        part,
                        channel,
                        s,
                        target,
                    )?
                    .total() as u64;
                self.table_flips
                    .fetch_add(hit, std::sync::atomic::Ordering::Relaxed);
                flips += hit;
            }
        }
        Ok(flips)
    }

    /// Of the bits [`inject`](Self::inject) flipped so far, those in the
    /// fitted tables (codebooks, calibrated bases, the sequence's own)
    /// rather than in blocks.
    pub fn table_flips(&self) -> u64 {
        self.table_flips.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Scrubs every block the sequence holds and the fitted tables the
    /// cache reads: correctable errors in protected words are rewritten
    /// before further flips pair up with them.
    pub fn scrub(&self) -> Result<ScrubStats> {
        let Some(seq) = self.seq else {
            return Ok(ScrubStats::default());
        };
        let mut stats = ScrubStats::default();
        for &block in self.manager.block_table(seq)? {
            stats += self.storage.scrub(block)?;
        }
        stats.tables += self.storage.scrub_shared()?;
        stats.tables += self
            .storage
            .scrub_sequence(self.manager.sequence_tables(seq)?)?;
        Ok(stats)
    }

    /// How the words of the fitted tables (codebooks, calibrated bases,
    /// the sequence's own) the cache reads decode now, against the words
    /// as written: corrected, detected (read as zero), miscorrected and
    /// silent words.
    pub fn table_stats(&self) -> Result<gf2_codes::DecodeStats> {
        let mut stats = self.storage.shared_stats();
        if let Some(seq) = self.seq {
            stats += self
                .storage
                .sequence_stats(self.manager.sequence_tables(seq)?)?;
        }
        Ok(stats)
    }

    fn layer_spec(&self, layer: usize) -> Result<&LayerSpec> {
        layer_spec(&self.storage, layer)
    }
}

/// The spec of `layer`, or an error naming the layers there are.
pub(crate) fn layer_spec(storage: &BlockStorage, layer: usize) -> Result<&LayerSpec> {
    storage
        .layers()
        .get(layer)
        .ok_or_else(|| PagedCacheError::InvalidParameter {
            name: "layer",
            reason: format!("layer {layer} of {}", storage.layers().len()),
        })
}

/// [`KvBackend::fit`] for a cache on `storage`: its layers share one width
/// that fits `model`.
pub(crate) fn fit_storage(storage: &BlockStorage, model: &ModelKvShape<'_>) -> Result<()> {
    let layers = storage.layers();
    let channels = layers[0].channels;
    if layers.iter().any(|l| l.channels != channels) {
        return Err(PagedCacheError::InvalidParameter {
            name: "layers",
            reason: "a model's layers share one K/V width".into(),
        });
    }
    Ok(check_fit(layers.len(), channels, model)?)
}

/// Queries, their positions and the mask of one attention call.
pub(crate) type Queries<'q, 'm> = (&'q [f32], &'q [usize], &'q Mask<'m>);

/// Attention of `queries` over the first `visible` tokens of a sequence
/// whose block table is `blocks`, through its pages; adds what the reads
/// decoded to `stats`.
pub(crate) fn attend_blocks(
    storage: &BlockStorage,
    blocks: &[crate::pool::BlockId],
    visible: usize,
    layer: usize,
    attention: &Attention,
    (queries, positions, mask): Queries<'_, '_>,
    stats: &mut PagedReadStats,
) -> Result<AttentionOutput> {
    let bs = storage.block_size();
    let blocks = blocks
        .get(..visible.div_ceil(bs))
        .ok_or(PagedCacheError::PositionOutOfRange {
            position: visible,
            tokens: blocks.len() * bs,
        })?;
    let table = PageTable::from_tables(&[(blocks, visible)], bs)?;
    let keys = PagedKv::new(storage, &table, 0, layer, KvPart::Keys)?;
    let values = PagedKv::new(storage, &table, 0, layer, KvPart::Values)?;
    let out = attention.prefill(queries, positions, &keys, &values, mask)?;
    stats.keys += out.stats.keys;
    stats.values += out.stats.values;
    Ok(out)
}

impl<P: PrefixCache> KvBackend for PagedBackend<P> {
    type Error = PagedCacheError;

    fn fit(&mut self, model: &ModelKvShape<'_>) -> Result<()> {
        fit_storage(&self.storage, model)
    }

    fn tokens(&self) -> usize {
        self.tokens
    }

    fn begin(&mut self, tokens: &[u32]) -> Result<()> {
        self.step.begin(tokens.len())?;
        let reserved = match self.seq {
            None => self.manager.add_sequence(tokens, 0).map(|(seq, _)| {
                self.seq = Some(seq);
            }),
            Some(seq) => self.manager.append(seq, tokens),
        };
        if reserved.is_err() {
            self.step.discard();
        }
        reserved
    }

    fn append(&mut self, layer: usize, keys: &[f32], values: &[f32]) -> Result<()> {
        let channels = self.layer_spec(layer)?.channels;
        let rows = self.step.check_append(layer, channels, keys, values)?;
        let Some(seq) = self.seq else {
            return Err(PagedCacheError::InvalidParameter {
                name: "step",
                reason: "no sequence yet (begin a step first)".into(),
            });
        };
        let first = self.tokens + self.step.pending(layer);
        for (i, (k, v)) in keys
            .chunks_exact(channels)
            .zip(values.chunks_exact(channels))
            .enumerate()
        {
            self.manager.write_kv(seq, first + i, layer, k, v)?;
            self.step.appended(layer, 1);
        }
        debug_assert_eq!(self.step.pending(layer), first - self.tokens + rows);
        Ok(())
    }

    fn attend(
        &mut self,
        layer: usize,
        attention: &Attention,
        queries: &[f32],
        positions: &[usize],
        mask: &Mask<'_>,
    ) -> Result<AttentionOutput> {
        self.layer_spec(layer)?;
        let Some(seq) = self.seq else {
            return Err(attention::AttentionError::EmptyCache.into());
        };
        // The layer sees its committed rows and the rows it appended in
        // this step, like every other backend.
        let visible = self.tokens + self.step.pending(layer);
        let blocks = self.manager.block_table(seq)?;
        let (storage, stats) = (&self.storage, &mut self.stats);
        attend_blocks(
            storage,
            blocks,
            visible,
            layer,
            attention,
            (queries, positions, mask),
            stats,
        )
    }

    fn commit(&mut self) -> Result<()> {
        match self.step.close() {
            Ok(n) => {
                let before = self.tokens;
                self.tokens += n;
                if let Some(seq) = self.seq {
                    // Sealing after the step is whole: a refused seal leaves
                    // its blocks staged, and the step stays committed.
                    self.manager.seal(seq, before, self.tokens)?;
                }
                Ok(())
            }
            Err(e) => {
                self.rollback();
                Err(e.into())
            }
        }
    }

    fn rollback(&mut self) {
        let Some(n) = self.step.open() else {
            return;
        };
        self.step.discard();
        let Some(seq) = self.seq else {
            return;
        };
        // The sequence is resident and holds the step's `n` tokens after
        // the committed ones, so neither call can fail.
        let undone = self.drop_last(seq, n, self.tokens);
        debug_assert!(undone.is_ok(), "{undone:?}");
    }

    /// Drops committed tokens past `tokens` (the manager's truncation: a
    /// block cut into is staged again from its sealed rows when written).
    fn truncate(&mut self, tokens: usize) -> Result<()> {
        self.step.check_truncate(tokens, self.tokens)?;
        if let Some(seq) = self.seq {
            self.drop_last(seq, self.tokens - tokens, tokens)?;
        }
        self.tokens = tokens;
        Ok(())
    }

    /// Switches the storage's parts to `view` (a hierarchical form's
    /// upper plane for [`attention::ReadView::Draft`]); refused, changing
    /// nothing, where some layer's form keeps no draft view.
    fn set_read_view(&mut self, view: attention::ReadView) -> Result<()> {
        self.storage.set_view(view)
    }

    /// To the end of the current block where some form seals blocks
    /// ([`BlockStorage::rows_before_seal`]).
    fn rows_before_seal(&self) -> Option<usize> {
        self.storage.rows_before_seal(self.tokens)
    }

    /// Commits the first `keep` rows of the step and seals only what they
    /// complete: rows dropped here never enter a sealed group.
    fn commit_prefix(&mut self, keep: usize) -> Result<()> {
        let n = match self.step.close() {
            Ok(n) if keep <= n => n,
            Ok(n) => {
                self.undo_step(n);
                return Err(attention::keep_past_step(keep, n).into());
            }
            Err(e) => {
                self.rollback();
                return Err(e.into());
            }
        };
        let before = self.tokens;
        if let Some(seq) = self.seq {
            self.drop_last(seq, n - keep, before + keep)?;
        }
        self.tokens += keep;
        if let Some(seq) = self.seq {
            self.manager.seal(seq, before, self.tokens)?;
        }
        Ok(())
    }
}

impl<P: PrefixCache> PagedBackend<P> {
    /// Drops the last `n` tokens of `seq`, which keeps `left` (freeing the
    /// sequence when none is left).
    fn drop_last(&mut self, seq: SeqId, n: usize, left: usize) -> Result<()> {
        if left == 0 {
            self.seq = None;
            self.manager.free(seq)
        } else if n > 0 {
            self.manager.truncate(seq, n)
        } else {
            Ok(())
        }
    }

    /// Undoes a closed step of `n` tokens (its rows past the committed).
    fn undo_step(&mut self, n: usize) {
        if let Some(seq) = self.seq {
            let undone = self.drop_last(seq, n, self.tokens);
            debug_assert!(undone.is_ok(), "{undone:?}");
        }
    }
}
