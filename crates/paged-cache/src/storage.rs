//! [`BlockStorage`]: the bytes behind the blocks. For every layer it holds
//! one [`StoredPart`] of keys and one of values, each over every block of
//! the pool, made from the layer's forms by attention's registry
//! ([`open_part`]); the stored-layer interface decides how a form keeps
//! its blocks, and nothing here looks at the form. What this type adds is
//! the cache's side of the contract: both rows of a token encoded before
//! either is stored (a refused row changes nothing, and a write allocates
//! nothing once warm), sealing at commit over a sequence's block table,
//! copies and restores that fit every part before changing any, checked
//! block indices, and a read-write lock per part: attention reads a layer
//! under its read locks, and a background scrubber ([`crate::Scrubber`])
//! takes a write lock one block at a time.
//!
//! Every form with a kv-quant block plan is one [`PlannedPart`](attention::stored::PlannedPart):
//! its sealed rows lie in one kv-quant store spanning all blocks (block
//! `b` at rows `b·block_size..`), as vLLM lays out its cache, row-local
//! forms written in place, per-channel groups and exact sink and window
//! blocks staged exact until sealed. A layer can keep different forms for
//! keys and values, and the pool reports the true bytes each takes.

use std::ops::Range;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};

use attention::AttentionError;
use attention::stored::{
    Fitted, PartBlock, StoredPart, check_part_form, open_part, part_pool_bytes,
};
use gf2_codes::DecodeStats;
use gf2_codes::channel::FaultChannel;
use kv_quant::{
    CacheForm, DecodeScratch, FaultTarget, Injection, KvDecodeStats, KvQuantError, KvStore,
    NonFinite, QuantizeOptions, RowBuffers, RowEncoder, ScrubStats,
};

use crate::error::{PagedCacheError, Result};
use crate::pool::BlockId;
use crate::seq_tables::SeqTables;

/// The stored forms and width of one layer's K and V rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LayerSpec {
    /// Form of the K rows (any form attention's registry,
    /// [`open_part`], accepts in blocks).
    pub key: CacheForm,
    /// Form of the V rows.
    pub value: CacheForm,
    /// Channels per token (`kv_heads × head_dim`).
    pub channels: usize,
}

impl LayerSpec {
    /// One form for keys and values.
    pub fn uniform(form: CacheForm, channels: usize) -> Self {
        Self {
            key: form,
            value: form,
            channels,
        }
    }

    /// The form of `part`.
    pub fn form(&self, part: KvPart) -> CacheForm {
        match part {
            KvPart::Keys => self.key,
            KvPart::Values => self.value,
        }
    }
}

/// K or V.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KvPart {
    /// Key rows.
    Keys,
    /// Value rows.
    Values,
}

/// The contents of one block: its K and V [`PartBlock`]s per layer (a
/// copy, for swapping and snapshots).
#[derive(Clone, Debug, PartialEq)]
pub struct BlockData {
    layers: Vec<[PartBlock; 2]>,
}

impl BlockData {
    /// The K or V store of `layer` that holds the block's rows as read
    /// (its staged exact rows where the block is not sealed).
    pub fn store(&self, layer: usize, part: KvPart) -> Option<&KvStore> {
        self.layers.get(layer)?[part as usize].rows()
    }

    /// Bytes held, counted from the stores' buffers (a staged part's
    /// exact rows beside its block rows).
    pub fn stored_bytes(&self) -> usize {
        self.layers
            .iter()
            .flatten()
            .map(PartBlock::stored_bytes)
            .sum()
    }

    /// One scrubbing pass over every store of the block (see
    /// [`KvStore::scrub`]): swapped-out blocks collect faults too.
    pub fn scrub(&mut self) -> Result<ScrubStats> {
        let mut stats = ScrubStats::default();
        for part in self.layers.iter_mut().flatten() {
            stats += part.scrub()?;
        }
        Ok(stats)
    }
}

/// A layer's row encoders and the buffers one token's rows are encoded
/// into before they are committed to a block (so a write allocates nothing
/// once warm, and a refused row changes nothing).
#[derive(Debug)]
struct LayerWriter {
    key: RowEncoder,
    value: RowEncoder,
    key_rows: RowBuffers,
    value_rows: RowBuffers,
}

impl LayerWriter {
    fn new(parts: &[RwLock<Box<dyn StoredPart>>; 2]) -> Result<Self> {
        let encoder = |p: &RwLock<Box<dyn StoredPart>>| read(p).row_encoder();
        let (key, value) = (encoder(&parts[0])?, encoder(&parts[1])?);
        Ok(Self {
            key_rows: RowBuffers::new(key.buffer_sizes(1)),
            value_rows: RowBuffers::new(value.buffer_sizes(1)),
            key,
            value,
        })
    }
}

/// Block contents for a pool of `num_blocks` blocks.
#[derive(Debug)]
pub struct BlockStorage {
    block_size: usize,
    num_blocks: usize,
    layers: Vec<LayerSpec>,
    writers: Vec<Mutex<LayerWriter>>,
    /// Per layer: the K and V parts, each over every block.
    parts: Vec<[RwLock<Box<dyn StoredPart>>; 2]>,
    /// What a written row's NaN and infinities get ([`NonFinite`] as a
    /// byte: [`non_finite_code`]).
    non_finite: AtomicU8,
    /// Non-finite values in the rows written so far (under a policy that
    /// stores them).
    non_finite_written: AtomicU64,
    /// Whether some part seals groups of several blocks together (so a
    /// write's check of its group is skipped for every other storage).
    grouped: bool,
}

/// [`NonFinite`] as the byte [`BlockStorage`] keeps it in.
fn non_finite_code(policy: NonFinite) -> u8 {
    match policy {
        NonFinite::Reject => 0,
        NonFinite::Clamp => 1,
        NonFinite::Keep => 2,
    }
}

/// The [`NonFinite`] of a [`non_finite_code`].
fn non_finite_of(code: u8) -> NonFinite {
    match code {
        1 => NonFinite::Clamp,
        2 => NonFinite::Keep,
        _ => NonFinite::Reject,
    }
}

// A panic while holding a lock leaves plain bytes behind, never a broken
// invariant of these types, so a poisoned lock is still usable.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

fn read<T: ?Sized>(m: &RwLock<T>) -> RwLockReadGuard<'_, T> {
    m.read().unwrap_or_else(PoisonError::into_inner)
}

fn write<T: ?Sized>(m: &RwLock<T>) -> RwLockWriteGuard<'_, T> {
    m.write().unwrap_or_else(PoisonError::into_inner)
}

impl BlockStorage {
    /// Zeroed storage for `num_blocks` blocks of `block_size` tokens, each
    /// layer part made by attention's registry
    /// ([`open_part`](attention::stored::open_part)) from its form.
    pub fn new(num_blocks: usize, block_size: usize, layers: &[LayerSpec]) -> Result<Self> {
        Self::with_fitted(num_blocks, block_size, layers, &[])
    }

    /// [`new`](Self::new) for calibrated forms: `fitted[layer]` holds the
    /// tables (a `vq` codebook) of the layer's K and V parts, loaded once
    /// and shared by every block (a layer past the end of `fitted` gets
    /// none; a form that needs a table it lacks is refused).
    pub fn with_fitted(
        num_blocks: usize,
        block_size: usize,
        layers: &[LayerSpec],
        fitted: &[[Fitted; 2]],
    ) -> Result<Self> {
        check_shape(layers.len(), block_size)?;
        for l in layers {
            check_pageable(&l.key, block_size)?;
            check_pageable(&l.value, block_size)?;
        }
        let none = Fitted::default();
        let parts = layers
            .iter()
            .enumerate()
            .map(|(i, l)| {
                let tables = |p: usize| fitted.get(i).map_or(&none, |f| &f[p]);
                let open = |form, p| {
                    open_part(form, block_size, l.channels, num_blocks, tables(p))
                        .map_err(form_error)
                };
                Ok([open(l.key, 0)?, open(l.value, 1)?])
            })
            .collect::<Result<Vec<_>>>()?;
        Self::from_parts(parts)
    }

    /// Storage over parts built elsewhere (a form with no spelling yet, an
    /// experiment's own [`StoredPart`]): per layer, its K and V parts, all
    /// of one block size and block count, K and V of one width.
    pub fn from_parts(parts: Vec<[Box<dyn StoredPart>; 2]>) -> Result<Self> {
        let (block_size, num_blocks) = parts
            .first()
            .map_or((0, 0), |[k, _]| (k.block_size(), k.num_blocks()));
        check_shape(parts.len(), block_size)?;
        let mut layers = Vec::with_capacity(parts.len());
        for (i, [k, v]) in parts.iter().enumerate() {
            if [k, v]
                .iter()
                .any(|p| p.block_size() != block_size || p.num_blocks() != num_blocks)
                || k.channels() != v.channels()
            {
                return Err(PagedCacheError::InvalidParameter {
                    name: "parts",
                    reason: format!(
                        "layer {i}'s parts differ in block size, block count or width from \
                         layer 0's ({num_blocks} blocks of {block_size})"
                    ),
                });
            }
            layers.push(LayerSpec {
                key: k.form(),
                value: v.form(),
                channels: k.channels(),
            });
        }
        let parts: Vec<[RwLock<Box<dyn StoredPart>>; 2]> = parts
            .into_iter()
            .map(|[k, v]| [RwLock::new(k), RwLock::new(v)])
            .collect();
        let writers = parts
            .iter()
            .map(|p| LayerWriter::new(p).map(Mutex::new))
            .collect::<Result<_>>()?;
        // A position far past any sink block: a group there has its size.
        let grouped = parts
            .iter()
            .flatten()
            .any(|p| read(p).sealed_with(1 << 30).len() > 1);
        Ok(Self {
            block_size,
            num_blocks,
            layers,
            writers,
            parts,
            non_finite: AtomicU8::new(non_finite_code(NonFinite::Reject)),
            non_finite_written: AtomicU64::new(0),
            grouped,
        })
    }

    /// Bytes [`new`](Self::new) takes for these arguments: every layer's K
    /// and V blocks ([`part_pool_bytes`]), plus the largest buffer it fills
    /// while building one part (freed before the next). A caller sizing a
    /// pool from user input checks this against its memory budget before
    /// building it. Rows staged later are not counted.
    pub fn pool_bytes(num_blocks: usize, block_size: usize, layers: &[LayerSpec]) -> Result<u64> {
        Self::pool_bytes_fitted(num_blocks, block_size, layers, &[])
    }

    /// Bytes each sequence takes at most beside its blocks in storage
    /// [`with_fitted`](Self::with_fitted) would build: the tables its
    /// forms fitted per sequence keep in every layer, plus the largest
    /// buffers one fit fills (0 for other forms). A caller serving `n`
    /// sequences at once adds `n` times this to
    /// [`pool_bytes_fitted`](Self::pool_bytes_fitted).
    pub fn sequence_bytes_fitted(
        block_size: usize,
        layers: &[LayerSpec],
        fitted: &[[Fitted; 2]],
    ) -> Result<u64> {
        let none = Fitted::default();
        let (mut total, mut widest) = (0u64, 0u64);
        for (i, l) in layers.iter().enumerate() {
            for (p, form) in [l.key, l.value].into_iter().enumerate() {
                let tables = fitted.get(i).map_or(&none, |f| &f[p]);
                let bytes =
                    part_pool_bytes(form, block_size, l.channels, 0, tables).map_err(form_error)?;
                total = total.saturating_add(bytes.sequence);
                widest = widest.max(bytes.fitting);
            }
        }
        Ok(total.saturating_add(widest))
    }

    /// [`pool_bytes`](Self::pool_bytes) of [`with_fitted`](Self::with_fitted).
    pub fn pool_bytes_fitted(
        num_blocks: usize,
        block_size: usize,
        layers: &[LayerSpec],
        fitted: &[[Fitted; 2]],
    ) -> Result<u64> {
        let mut total = 0u64;
        let mut widest = 0u64;
        let none = Fitted::default();
        for (i, l) in layers.iter().enumerate() {
            for (p, form) in [l.key, l.value].into_iter().enumerate() {
                let tables = fitted.get(i).map_or(&none, |f| &f[p]);
                let bytes = part_pool_bytes(form, block_size, l.channels, num_blocks, tables)
                    .map_err(form_error)?;
                total = total.saturating_add(bytes.blocks);
                widest = widest.max(bytes.building);
            }
        }
        Ok(total.saturating_add(widest))
    }

    /// Sets what [`write`](Self::write) does with NaN and infinite values:
    /// refuse the row ([`NonFinite::Reject`], the default: a model that
    /// writes them has a bug), saturate them, or store them as the form
    /// stores numbers ([`NonFinite::Keep`]: fault experiments on
    /// unprotected forms, where a flipped exponent's NaN is an outcome to
    /// measure). Stored ones are counted ([`non_finite_written`](Self::non_finite_written)).
    pub fn set_non_finite(&self, policy: NonFinite) {
        self.non_finite
            .store(non_finite_code(policy), Ordering::Relaxed);
    }

    /// NaN and infinite values written so far under a policy that stores
    /// them (saturated or kept).
    pub fn non_finite_written(&self) -> u64 {
        self.non_finite_written.load(Ordering::Relaxed)
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// The layers' forms and widths.
    pub fn layers(&self) -> &[LayerSpec] {
        &self.layers
    }

    /// Blocks held.
    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// The token slots of `block` (`index·block_size..`), checked.
    pub fn block_rows(&self, block: BlockId) -> Result<Range<usize>> {
        let b = block.index();
        if b >= self.num_blocks {
            return Err(PagedCacheError::BlockOutOfRange {
                block: block.0,
                blocks: self.num_blocks,
            });
        }
        Ok(b * self.block_size..(b + 1) * self.block_size)
    }

    fn layer(&self, layer: usize) -> Result<&LayerSpec> {
        self.layers
            .get(layer)
            .ok_or_else(|| PagedCacheError::InvalidParameter {
                name: "layer",
                reason: format!("layer {layer} of {}", self.layers.len()),
            })
    }

    /// `part` of `layer` over every block, read-locked for as long as the
    /// guard lives (attention holds it for one call).
    pub fn part(
        &self,
        layer: usize,
        part: KvPart,
    ) -> Result<RwLockReadGuard<'_, Box<dyn StoredPart>>> {
        self.layer(layer)?;
        Ok(read(&self.parts[layer][part as usize]))
    }

    /// `part` of `layer`, write-locked.
    fn part_mut(
        &self,
        layer: usize,
        part: KvPart,
    ) -> Result<RwLockWriteGuard<'_, Box<dyn StoredPart>>> {
        self.layer(layer)?;
        Ok(write(&self.parts[layer][part as usize]))
    }

    /// Whether `part` of `layer` holds `block`'s rows staged (exact, not
    /// sealed yet).
    pub fn is_staged(&self, block: BlockId, layer: usize, part: KvPart) -> Result<bool> {
        self.block_rows(block)?;
        Ok(self.part(layer, part)?.is_staged(block.index()))
    }

    /// Blocks staged in `part` of `layer` (their exact rows held).
    pub fn staged_blocks(&self, layer: usize, part: KvPart) -> Result<usize> {
        Ok(self.part(layer, part)?.staged_blocks())
    }

    /// Makes `block` ready for a new owner's rows in every layer part
    /// ([`StoredPart::open_block`]), so a block taken from the free list
    /// is never read as sealed. The manager calls it for every block it
    /// takes.
    pub fn open_block(&self, block: BlockId) -> Result<()> {
        self.block_rows(block)?;
        for parts in &self.parts {
            for p in parts {
                write(p).open_block(block.index())?;
            }
        }
        Ok(())
    }

    /// Writes one token's K and V rows of `layer` at slot `offset` of `block`
    /// (encoded once, here; no allocation once the layer's encoders are warm).
    /// Both rows are encoded before either is stored, so a refused row
    /// changes nothing.
    pub fn write(
        &self,
        block: BlockId,
        offset: usize,
        layer: usize,
        keys: &[f32],
        values: &[f32],
    ) -> Result<()> {
        let channels = self.layer(layer)?.channels;
        for (what, row) in [("key row", keys), ("value row", values)] {
            if row.len() != channels {
                return Err(PagedCacheError::ShapeMismatch {
                    what,
                    found: row.len(),
                    expected: channels,
                });
            }
        }
        if offset >= self.block_size {
            return Err(PagedCacheError::PositionOutOfRange {
                position: offset,
                tokens: self.block_size,
            });
        }
        self.block_rows(block)?;
        // Encode both rows before storing either, outside the parts'
        // locks; no allocation once warm.
        let mut writer = lock(&self.writers[layer]);
        let w = &mut *writer;
        let non_finite = non_finite_of(self.non_finite.load(Ordering::Relaxed));
        let options = QuantizeOptions { non_finite };
        w.key.encode_into(keys, w.key_rows.as_mut(), options)?;
        w.value
            .encode_into(values, w.value_rows.as_mut(), options)?;
        // (Under `Reject` a non-finite row was refused above.)
        if non_finite != NonFinite::Reject {
            let bad = keys.iter().chain(values).filter(|x| !x.is_finite()).count();
            if bad > 0 {
                self.non_finite_written
                    .fetch_add(bad as u64, Ordering::Relaxed);
            }
        }
        for (p, rows) in [&w.key_rows, &w.value_rows].into_iter().enumerate() {
            write(&self.parts[layer][p]).put_row(block.index(), offset, rows)?;
        }
        Ok(())
    }

    /// Seals the blocks of a sequence (its block table `table`) that a
    /// step taking it from `before` to `after` committed tokens made
    /// sealable ([`StoredPart::sealable`]), in every layer part. Blocks
    /// already sealed (shared ones sealed by another sequence) are left as
    /// they are. Call it when the step commits, never before, so that a
    /// rollback only drops staged rows. A part that fits its tables on each
    /// sequence ([`StoredPart::per_sequence`]) fits them on the blocks its
    /// first seal seals and keeps them in the sequence's `tables`; later
    /// seals code on them.
    pub fn seal_blocks(
        &self,
        table: &[BlockId],
        before: usize,
        after: usize,
        tables: &mut SeqTables,
    ) -> Result<usize> {
        let mut sealed = 0;
        let mut pages = Vec::new();
        for (layer, parts) in self.parts.iter().enumerate() {
            for (p, kv) in parts.iter().zip([KvPart::Keys, KvPart::Values]) {
                let mut part = write(p);
                let range = part.sealable(before, after);
                let range = range.start.min(table.len())..range.end.min(table.len());
                if range.is_empty() {
                    continue;
                }
                for &block in &table[range.clone()] {
                    self.block_rows(block)?;
                }
                if !part.per_sequence() && !self.grouped {
                    for i in range {
                        let block = table[i].index();
                        sealed += usize::from(part.seal(block, i * self.block_size)?);
                    }
                    continue;
                }
                if pages.is_empty() {
                    pages = table.iter().map(|b| b.0).collect();
                }
                if !part.per_sequence() {
                    for i in range {
                        sealed += part.seal_pages(&pages, i)?;
                    }
                    continue;
                }
                if tables.get(layer, kv).is_none() {
                    let fitted = part.fit_sequence(&pages, range.clone())?;
                    tables.set(layer, kv, fitted);
                }
                let Some(fitted) = tables.get(layer, kv) else {
                    unreachable!("fitted above");
                };
                for i in range {
                    let block = table[i].index();
                    sealed += usize::from(part.seal_on(block, i * self.block_size, fitted)?);
                }
            }
        }
        Ok(sealed)
    }

    /// Decodes rows `offset..offset + out.len() / channels` of one part of
    /// `block` into `out` (erased values interpolated from the block's own
    /// rows only). A sealed block of a per-channel group over several
    /// blocks holds one channel slice of its group and is refused: read it
    /// through its sequence's pages ([`PagedKv`](crate::PagedKv)).
    pub fn read(
        &self,
        block: BlockId,
        layer: usize,
        part: KvPart,
        offset: usize,
        out: &mut [f32],
        scratch: &mut DecodeScratch,
    ) -> Result<KvDecodeStats> {
        let channels = self.layer(layer)?.channels;
        self.block_rows(block)?;
        let n = out.len() / channels;
        if offset + n > self.block_size {
            return Err(PagedCacheError::PositionOutOfRange {
                position: offset + n,
                tokens: self.block_size,
            });
        }
        Ok(self
            .part(layer, part)?
            .read_rows(block.index(), offset, out, scratch)?)
    }

    /// A copy of `block`'s contents (its staged exact rows included).
    pub fn snapshot(&self, block: BlockId) -> Result<BlockData> {
        self.block_rows(block)?;
        let b = block.index();
        let layers = self
            .parts
            .iter()
            .map(|[k, v]| Ok([read(k).snapshot(b)?, read(v).snapshot(b)?]))
            .collect::<Result<_>>()?;
        Ok(BlockData { layers })
    }

    /// Replaces `block`'s contents (from [`snapshot`](Self::snapshot) of
    /// storage with the same layers and block size); refused, changing
    /// nothing, where any part does not fit.
    pub fn restore(&self, block: BlockId, data: BlockData) -> Result<()> {
        self.block_rows(block)?;
        let mut guards: Vec<_> = self.parts.iter().flatten().map(write).collect();
        let fits = data.layers.len() == self.layers.len()
            && guards
                .iter()
                .zip(data.layers.iter().flatten())
                .all(|(part, d)| part.accepts(d));
        if !fits {
            return Err(PagedCacheError::InvalidParameter {
                name: "block data",
                reason: "its layers differ from this storage's".into(),
            });
        }
        for (part, d) in guards.iter_mut().zip(data.layers.iter().flatten()) {
            part.restore(block.index(), d)?;
        }
        Ok(())
    }

    /// Copies `src`'s contents into `dst` (copy-on-write).
    pub fn copy(&self, src: BlockId, dst: BlockId) -> Result<()> {
        let data = self.snapshot(src)?;
        self.restore(dst, data)
    }

    /// Scrubs every part of `block` ([`StoredPart::scrub`]).
    pub fn scrub(&self, block: BlockId) -> Result<ScrubStats> {
        self.block_rows(block)?;
        let mut stats = ScrubStats::default();
        for p in self.parts.iter().flatten() {
            stats += write(p).scrub(block.index())?;
        }
        Ok(stats)
    }

    /// Injects faults from `channel` with `seed` into one part of `block`
    /// ([`StoredPart::inject`]: flip positions count from the block's
    /// first byte in each buffer; its staged exact rows where it is
    /// staged, its sealed rows otherwise).
    pub fn inject(
        &self,
        block: BlockId,
        layer: usize,
        part: KvPart,
        channel: &dyn FaultChannel,
        seed: u64,
        target: FaultTarget,
    ) -> Result<Injection> {
        self.block_rows(block)?;
        Ok(self
            .part_mut(layer, part)?
            .inject(block.index(), channel, seed, target)?)
    }

    /// Injects faults from `channel` with `seed` into the fitted tables one
    /// part of `layer` reads ([`StoredPart::inject_shared`]: a `vq`
    /// codebook, under targets that reach metadata). The layer's row
    /// encoders read the faulted tables from then on too, as an encoder
    /// reading the same memory would.
    pub fn inject_shared(
        &self,
        layer: usize,
        part: KvPart,
        channel: &dyn FaultChannel,
        seed: u64,
        target: FaultTarget,
    ) -> Result<Injection> {
        let injection = self
            .part_mut(layer, part)?
            .inject_shared(channel, seed, target)?;
        if !injection.tables.is_empty() {
            *lock(&self.writers[layer]) = LayerWriter::new(&self.parts[layer])?;
        }
        Ok(injection)
    }

    /// Applies `f` to a copy of the store holding `block`'s rows of one
    /// part of `layer` (its bytes, flips and words, as a store of
    /// `block_size` rows): its staged exact rows where it is staged.
    pub fn with_store<R>(
        &self,
        block: BlockId,
        layer: usize,
        part: KvPart,
        f: impl FnOnce(&KvStore) -> R,
    ) -> Result<R> {
        self.block_rows(block)?;
        let store = self.part(layer, part)?.block_store(block.index())?;
        Ok(f(&store))
    }

    /// Bytes `block` holds in `layer` (K and V), counted from its buffers:
    /// its sealed rows, and its staged exact rows where it is staged (both
    /// are held while it is).
    pub fn block_layer_bytes(&self, block: BlockId, layer: usize) -> Result<usize> {
        Ok(self.block_part_bytes(block, layer, KvPart::Keys)?
            + self.block_part_bytes(block, layer, KvPart::Values)?)
    }

    /// Bytes `block` holds in one part of `layer` (see
    /// [`block_layer_bytes`](Self::block_layer_bytes)).
    pub fn block_part_bytes(&self, block: BlockId, layer: usize, part: KvPart) -> Result<usize> {
        self.block_rows(block)?;
        Ok(self.part(layer, part)?.block_bytes(block.index()))
    }

    /// Bytes one sealed block holds in `layer` (K and V), staged exact
    /// rows not counted.
    pub fn layer_block_bytes(&self, layer: usize) -> Result<usize> {
        Ok(self.part_block_bytes(layer, KvPart::Keys)?
            + self.part_block_bytes(layer, KvPart::Values)?)
    }

    /// Bytes one sealed block holds in one part of `layer`.
    pub fn part_block_bytes(&self, layer: usize, part: KvPart) -> Result<usize> {
        Ok(self.part(layer, part)?.sealed_block_bytes())
    }

    /// How the words of the fitted tables (codebooks, bases) of every part
    /// decode now, against the words as written
    /// ([`StoredPart::shared_stats`]).
    pub fn shared_stats(&self) -> DecodeStats {
        let mut stats = DecodeStats::default();
        for p in self.parts.iter().flatten() {
            stats += read(p).shared_stats();
        }
        stats
    }

    /// One scrubbing pass over the fitted tables of every part
    /// ([`StoredPart::scrub_shared`]): the words their code corrects are
    /// rewritten (the tables as read, which reads already decode, do not
    /// change).
    pub fn scrub_shared(&self) -> Result<DecodeStats> {
        let mut stats = DecodeStats::default();
        for p in self.parts.iter().flatten() {
            stats += write(p).scrub_shared()?;
        }
        Ok(stats)
    }

    /// Faults from `channel`'s stream `seed` into the tables `part` of
    /// `layer` fitted on one sequence (`tables`, kept beside its block
    /// table), under targets that reach metadata
    /// ([`StoredPart::inject_sequence`]): where they read differently
    /// after, every block coded on them (the sequence's and its forks')
    /// reads through them as they are. Nothing where the part has no such
    /// tables or they are not fitted yet.
    pub fn inject_sequence(
        &self,
        tables: &SeqTables,
        layer: usize,
        part: KvPart,
        channel: &dyn FaultChannel,
        seed: u64,
        target: FaultTarget,
    ) -> Result<Injection> {
        let Some(fitted) = tables.get(layer, part) else {
            return Ok(Injection::default());
        };
        Ok(self
            .part_mut(layer, part)?
            .inject_sequence(fitted, channel, seed, target)?)
    }

    /// How the words of one sequence's fitted `tables` decode now, over
    /// every part ([`StoredPart::sequence_stats`]).
    pub fn sequence_stats(&self, tables: &SeqTables) -> Result<DecodeStats> {
        self.sum_over_sequence(tables, |p, fitted| read(p).sequence_stats(fitted))
    }

    /// One scrubbing pass over one sequence's fitted `tables`, every part
    /// ([`StoredPart::scrub_sequence`]).
    pub fn scrub_sequence(&self, tables: &SeqTables) -> Result<DecodeStats> {
        self.sum_over_sequence(tables, |p, fitted| write(p).scrub_sequence(fitted))
    }

    /// `f` over every part that holds fitted `tables`, summed.
    fn sum_over_sequence(
        &self,
        tables: &SeqTables,
        f: impl Fn(
            &RwLock<Box<dyn StoredPart>>,
            &attention::stored::SequenceTables,
        ) -> attention::Result<DecodeStats>,
    ) -> Result<DecodeStats> {
        let mut stats = DecodeStats::default();
        for (layer, parts) in self.parts.iter().enumerate() {
            for (p, kv) in parts.iter().zip([KvPart::Keys, KvPart::Values]) {
                if let Some(fitted) = tables.get(layer, kv) {
                    stats += f(p, fitted)?;
                }
            }
        }
        Ok(stats)
    }

    /// Whether any part codes blocks on tables each sequence fits on its
    /// own rows ([`StoredPart::per_sequence`]): such blocks are not shared
    /// through a prefix cache (the manager neither looks prompts up nor
    /// records prefixes).
    pub fn fits_per_sequence(&self) -> bool {
        self.parts.iter().flatten().any(|p| read(p).per_sequence())
    }

    /// Whether some layer's key or value part stages rows and seals
    /// blocks at commit ([`attention::stored::part_seals`]): a step's rows
    /// past a completed block then read it staged, where steps stopping at
    /// the block's end read it sealed.
    pub fn seals(&self) -> bool {
        self.layers.iter().any(|l| {
            attention::stored::part_seals(l.key, self.block_size)
                || attention::stored::part_seals(l.value, self.block_size)
        })
    }

    /// [`KvBackend::rows_before_seal`](attention::KvBackend::rows_before_seal)
    /// for a sequence holding `written` rows: to the end of its block where
    /// [`seals`](Self::seals), else `None`.
    pub fn rows_before_seal(&self, written: usize) -> Option<usize> {
        self.seals()
            .then(|| self.block_size - written % self.block_size)
    }

    /// Reads `view` of every part from now on (every sequence of the
    /// storage: the view is the storage's), or refuses, leaving every part
    /// in the full view, where some part keeps no such view
    /// ([`StoredPart::set_view`]).
    pub fn set_view(&self, view: attention::ReadView) -> Result<()> {
        for p in self.parts.iter().flatten() {
            let set = write(p).set_view(view);
            if let Err(e) = set {
                for p in self.parts.iter().flatten() {
                    // The full view is never refused.
                    let _ = write(p).set_view(attention::ReadView::Full);
                }
                return Err(e.into());
            }
        }
        Ok(())
    }

    /// Bytes of the fitted tables (codebooks, bases) the parts read, each
    /// part's counted once: stored beside the blocks and shared by all of
    /// them.
    pub fn shared_bytes(&self) -> usize {
        self.shared_part_bytes(KvPart::Keys) + self.shared_part_bytes(KvPart::Values)
    }

    /// [`shared_bytes`](Self::shared_bytes) of the key parts or of the
    /// value parts.
    pub fn shared_part_bytes(&self, part: KvPart) -> usize {
        self.parts
            .iter()
            .map(|p| read(&p[part as usize]).shared_bytes())
            .sum()
    }
}

/// Refuses storage of no layers or blocks of no tokens.
fn check_shape(layers: usize, block_size: usize) -> Result<()> {
    if layers == 0 {
        return Err(PagedCacheError::InvalidParameter {
            name: "layers",
            reason: "block storage needs at least one layer".into(),
        });
    }
    if block_size == 0 {
        return Err(PagedCacheError::InvalidParameter {
            name: "block_size",
            reason: "blocks hold at least one token".into(),
        });
    }
    Ok(())
}

/// Refuses forms blocks of `block_size` tokens cannot hold (attention's
/// [`check_part_form`]: shard and low-rank forms, per-tensor scales, and
/// per-channel groups other than one block). A codebook form (`vq`) passes
/// here and needs its table at [`BlockStorage::with_fitted`].
pub fn check_pageable(form: &CacheForm, block_size: usize) -> Result<()> {
    check_part_form(*form, block_size).map_err(form_error)
}

/// A form's refusal by the registry as this crate's error (naming the form).
fn form_error(e: AttentionError) -> PagedCacheError {
    match e {
        AttentionError::Store(KvQuantError::InvalidSpec { spec, reason }) => {
            PagedCacheError::InvalidParameter {
                name: "form",
                reason: format!("{spec} {reason}"),
            }
        }
        other => other.into(),
    }
}

mod groups;
#[cfg(test)]
mod tests;
