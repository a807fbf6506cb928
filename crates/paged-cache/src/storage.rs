//! [`BlockStorage`]: the bytes behind the blocks, laid out as vLLM lays
//! out its KV cache: for every layer, one kv-quant [`KvStore`] of keys and
//! one of values spanning all blocks (`num_blocks × block_size` token rows,
//! block `b` at rows `b·block_size..(b + 1)·block_size`), so each buffer
//! (codes, scales, offsets, check bytes) is one contiguous array with a
//! fixed block stride. kv-quant owns the byte layout; nothing here
//! re-encodes anything. A layer can keep FP16, FP8, INT8, INT4 or
//! ECC-protected INT4, with different forms for keys and values, and the
//! pool reports the true bytes each form takes.
//!
//! Forms whose bytes span tokens (per-channel keys, exact sink and window
//! tokens) follow kv-quant's [`BlockPlan`]: a block's rows are *staged*
//! exact (f16 under the form's protection, one small store per block, kept
//! beside the layer store and reused once released) until the block is
//! *sealed* ([`BlockStorage::seal_blocks`], called when the step that made
//! it sealable commits): its rows quantized at once into the block's rows
//! of the layer store (per-channel scales over the block) and its exact
//! rows dropped. Sealed blocks are immutable, hashable and shareable like
//! any other; attention reads each page from where its rows are. Each layer's K and V stores
//! sit behind their own read-write lock: attention reads a layer under one
//! read lock, and a background scrubber ([`crate::Scrubber`]) takes the
//! write lock one block at a time.

use std::ops::Range;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};

use gf2_codes::channel::FaultChannel;
use kv_quant::{
    BlockPlan, CacheForm, DecodeScratch, FaultTarget, Injection, KvDecodeStats, KvStore, NonFinite,
    QuantizeOptions, RowBuffers, RowEncoder, ScrubStats,
};

use crate::error::{PagedCacheError, Result};
use crate::pool::BlockId;

/// The stored forms and width of one layer's K and V rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LayerSpec {
    /// Form of the K rows (any form with a [`BlockPlan`]).
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

/// The contents of one block: `[K, V]` stores of `block_size` rows per
/// layer (a copy, for swapping and snapshots).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockData {
    layers: Vec<[KvStore; 2]>,
    /// The staged (exact) rows of each layer and part, where the block is
    /// not sealed.
    staged: Vec<[Option<KvStore>; 2]>,
}

impl BlockData {
    /// The K or V store of `layer` that holds the block's rows: its staged
    /// exact rows where the block is not sealed, its sealed rows otherwise.
    pub fn store(&self, layer: usize, part: KvPart) -> Option<&KvStore> {
        let p = part as usize;
        match self.staged.get(layer)?.get(p)? {
            Some(exact) => Some(exact),
            None => self.layers.get(layer).map(|kv| &kv[p]),
        }
    }

    /// Bytes held, counted from the stores' buffers (a staged part's
    /// exact rows beside its block rows).
    pub fn stored_bytes(&self) -> usize {
        self.layers
            .iter()
            .flatten()
            .chain(self.staged.iter().flatten().flatten())
            .map(KvStore::stored_bytes)
            .sum()
    }

    /// One scrubbing pass over every store of the block (see
    /// [`KvStore::scrub`]): swapped-out blocks collect faults too.
    pub fn scrub(&mut self) -> Result<ScrubStats> {
        let mut stats = ScrubStats::default();
        for (kv, staged) in self.layers.iter_mut().zip(&mut self.staged) {
            for (store, exact) in kv.iter_mut().zip(staged) {
                stats += match exact {
                    Some(exact) => exact.scrub()?,
                    None => store.scrub()?,
                };
            }
        }
        Ok(stats)
    }
}

/// The staged blocks of one layer part: the exact rows of every block
/// written but not sealed, by block index, and released stores kept for
/// reuse (so a warm cache stages a block without allocating).
#[derive(Debug, Default)]
pub(crate) struct Staged {
    blocks: Vec<Option<KvStore>>,
    spare: Vec<KvStore>,
}

impl Staged {
    /// The exact rows of `block`, if it is staged.
    pub(crate) fn get(&self, block: usize) -> Option<&KvStore> {
        self.blocks.get(block).and_then(Option::as_ref)
    }

    /// Stages `block`: a spare store, or a new one of `form`.
    fn stage(
        &mut self,
        block: usize,
        form: CacheForm,
        rows: usize,
        channels: usize,
    ) -> Result<&mut KvStore> {
        if self.blocks.len() <= block {
            self.blocks.resize_with(block + 1, || None);
        }
        if self.blocks[block].is_none() {
            let store = match self.spare.pop() {
                Some(s) => s,
                None => KvStore::zeroed(form, rows, channels)?,
            };
            self.blocks[block] = Some(store);
        }
        Ok(self.blocks[block].as_mut().expect("staged above"))
    }

    /// Releases `block`'s exact rows, returning them.
    fn release(&mut self, block: usize) -> Option<KvStore> {
        self.blocks.get_mut(block).and_then(Option::take)
    }

    /// Keeps `store` for reuse.
    fn recycle(&mut self, store: KvStore) {
        self.spare.push(store);
    }

    /// Staged blocks.
    fn count(&self) -> usize {
        self.blocks.iter().filter(|b| b.is_some()).count()
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

/// Block contents for a pool of `num_blocks` blocks.
#[derive(Debug)]
pub struct BlockStorage {
    block_size: usize,
    num_blocks: usize,
    layers: Vec<LayerSpec>,
    writers: Vec<Mutex<LayerWriter>>,
    /// Per layer: how K and V are kept in blocks.
    plans: Vec<[BlockPlan; 2]>,
    /// Per layer: the K and V stores of every block (sealed rows).
    stores: Vec<[RwLock<KvStore>; 2]>,
    /// Per layer: the K and V exact rows of the blocks not sealed.
    staged: Vec<[RwLock<Staged>; 2]>,
    /// What a written row's NaN and infinities get ([`NonFinite`] as a
    /// byte: [`non_finite_code`]).
    non_finite: AtomicU8,
    /// Non-finite values in the rows written so far (under a policy that
    /// stores them).
    non_finite_written: AtomicU64,
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

fn read<T>(m: &RwLock<T>) -> RwLockReadGuard<'_, T> {
    m.read().unwrap_or_else(PoisonError::into_inner)
}

fn write<T>(m: &RwLock<T>) -> RwLockWriteGuard<'_, T> {
    m.write().unwrap_or_else(PoisonError::into_inner)
}

impl BlockStorage {
    /// Zeroed storage for `num_blocks` blocks of `block_size` tokens.
    pub fn new(num_blocks: usize, block_size: usize, layers: &[LayerSpec]) -> Result<Self> {
        if layers.is_empty() {
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
        let plans = layers
            .iter()
            .map(|l| {
                Ok([
                    block_plan(l.key, block_size)?,
                    block_plan(l.value, block_size)?,
                ])
            })
            .collect::<Result<Vec<_>>>()?;
        let rows = num_blocks.checked_mul(block_size).ok_or_else(|| {
            PagedCacheError::InvalidParameter {
                name: "num_blocks",
                reason: "blocks × block size overflows".into(),
            }
        })?;
        let stores = layers
            .iter()
            .zip(&plans)
            .map(|(l, [k, v])| {
                Ok([
                    RwLock::new(KvStore::zeroed(k.sealed, rows, l.channels)?),
                    RwLock::new(KvStore::zeroed(v.sealed, rows, l.channels)?),
                ])
            })
            .collect::<Result<_>>()?;
        let writers = layers
            .iter()
            .zip(&plans)
            .map(|(l, [k, v])| {
                let written = |p: &BlockPlan| if p.staged { p.exact } else { p.sealed };
                let key = RowEncoder::new(written(k), l.channels, None)?;
                let value = RowEncoder::new(written(v), l.channels, None)?;
                Ok(Mutex::new(LayerWriter {
                    key_rows: RowBuffers::new(key.buffer_sizes(1)),
                    value_rows: RowBuffers::new(value.buffer_sizes(1)),
                    key,
                    value,
                }))
            })
            .collect::<Result<_>>()?;
        let staged = layers.iter().map(|_| Default::default()).collect();
        Ok(Self {
            block_size,
            num_blocks,
            layers: layers.to_vec(),
            writers,
            plans,
            stores,
            staged,
            non_finite: AtomicU8::new(non_finite_code(NonFinite::Reject)),
            non_finite_written: AtomicU64::new(0),
        })
    }

    /// Bytes [`new`](Self::new) takes for these arguments: every layer's K
    /// and V stores (their sealed forms), counted from one block's bytes,
    /// plus the largest f32 matrix it zero-fills while building one store
    /// (`num_blocks · block_size · channels · 4`, freed before the next).
    /// A caller sizing a pool from user input checks this against its
    /// memory budget before building it. Staged exact rows are made as
    /// blocks are written and are not counted.
    pub fn pool_bytes(num_blocks: usize, block_size: usize, layers: &[LayerSpec]) -> Result<u64> {
        let blocks = num_blocks as u64;
        let rows = blocks.saturating_mul(block_size as u64);
        let mut total = 0u64;
        let mut widest = 0u64;
        for l in layers {
            for form in [l.key, l.value] {
                let plan = block_plan(form, block_size)?;
                let one = KvStore::zeroed(plan.sealed, block_size, l.channels)?.stored_bytes();
                total = total.saturating_add((one as u64).saturating_mul(blocks));
            }
            widest = widest.max(rows.saturating_mul(4 * l.channels as u64));
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

    /// The rows of `block` in every layer store.
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

    /// The K or V store of `layer` over every block, read-locked for as long
    /// as the guard lives (attention holds it for one call).
    pub fn layer_store(&self, layer: usize, part: KvPart) -> Result<RwLockReadGuard<'_, KvStore>> {
        self.layer(layer)?;
        Ok(read(&self.stores[layer][part as usize]))
    }

    /// How `part` of `layer` is kept in blocks.
    pub fn plan(&self, layer: usize, part: KvPart) -> Result<&BlockPlan> {
        self.layer(layer)?;
        Ok(&self.plans[layer][part as usize])
    }

    /// The staged (exact) rows of `part` of `layer`, read-locked for as
    /// long as the guard lives.
    pub(crate) fn staged_rows(
        &self,
        layer: usize,
        part: KvPart,
    ) -> Result<RwLockReadGuard<'_, Staged>> {
        self.layer(layer)?;
        Ok(read(&self.staged[layer][part as usize]))
    }

    /// Whether `part` of `layer` holds `block`'s rows staged (exact, not
    /// sealed yet).
    pub fn is_staged(&self, block: BlockId, layer: usize, part: KvPart) -> Result<bool> {
        self.block_rows(block)?;
        Ok(self.staged_rows(layer, part)?.get(block.index()).is_some())
    }

    /// Blocks staged in `part` of `layer` (their exact rows held).
    pub fn staged_blocks(&self, layer: usize, part: KvPart) -> Result<usize> {
        Ok(self.staged_rows(layer, part)?.count())
    }

    /// Makes `block` ready for a new owner's rows: in every staged layer
    /// part it gets exact rows to stage into (a released store reused
    /// where there is one), so a block taken from the free list is never
    /// read as sealed. The manager calls it for every block it takes.
    pub fn open_block(&self, block: BlockId) -> Result<()> {
        self.block_rows(block)?;
        for (layer, plans) in self.plans.iter().enumerate() {
            for (p, plan) in plans.iter().enumerate() {
                if plan.staged {
                    let channels = self.layers[layer].channels;
                    write(&self.staged[layer][p]).stage(
                        block.index(),
                        plan.exact,
                        self.block_size,
                        channels,
                    )?;
                }
            }
        }
        Ok(())
    }

    /// Writes one token's K and V rows of `layer` at slot `offset` of `block`
    /// (encoded once, here; no allocation once the layer's encoders are warm).
    /// A staged part writes the row exact into the block's staged rows; a
    /// block that was sealed is staged again first from its stored rows
    /// (a sequence cut back into a sealed block, or one of its rows
    /// written anew).
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
        let row = self.block_rows(block)?.start + offset;
        // Encode both rows before storing either, so a refused row changes
        // nothing, and outside the stores' locks; no allocation once warm.
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
        let b = block.index();
        for (p, rows) in [&w.key_rows, &w.value_rows].into_iter().enumerate() {
            let plan = &self.plans[layer][p];
            if !plan.staged {
                write(&self.stores[layer][p]).put_encoded_rows(row, rows)?;
                continue;
            }
            let mut staged = write(&self.staged[layer][p]);
            if staged.get(b).is_none() {
                self.unseal(&mut staged, block, layer, p)?;
            }
            let exact = staged.stage(b, plan.exact, self.block_size, channels)?;
            exact.put_encoded_rows(offset, rows)?;
        }
        Ok(())
    }

    /// Stages a sealed `block` of part `p` of `layer` again, its exact rows
    /// the values its sealed rows decode to.
    fn unseal(&self, staged: &mut Staged, block: BlockId, layer: usize, p: usize) -> Result<()> {
        let (plan, channels) = (&self.plans[layer][p], self.layers[layer].channels);
        let rows = self.block_rows(block)?;
        let mut values = vec![0.0; self.block_size * channels];
        let mut scratch = DecodeScratch::new();
        scratch.limit_neighbours(Some(rows.clone()));
        read(&self.stores[layer][p]).decode_rows_into(
            rows.start,
            self.block_size,
            &mut values,
            &mut scratch,
        )?;
        let decoded =
            KvStore::quantize_with(plan.exact, &values, self.block_size, channels, clamped())?;
        let exact = staged.stage(block.index(), plan.exact, self.block_size, channels)?;
        exact.copy_rows_from(0, &decoded)?;
        Ok(())
    }

    /// Seals the blocks of a sequence (its block table `table`) that a
    /// step taking it from `before` to `after` committed tokens made
    /// sealable ([`BlockPlan::sealable`]), in every staged layer part:
    /// each block's exact rows are quantized at once into its rows of the
    /// layer store and released. Blocks already sealed (shared ones sealed
    /// by another sequence) are left as they are. Call it when the step
    /// commits, never before, so that a rollback only drops exact rows.
    pub fn seal_blocks(&self, table: &[BlockId], before: usize, after: usize) -> Result<usize> {
        let mut sealed = 0;
        for (layer, plans) in self.plans.iter().enumerate() {
            for (p, plan) in plans.iter().enumerate() {
                if !plan.staged {
                    continue;
                }
                let first = plan.sealable(before).max(plan.sink_blocks);
                let last = plan.sealable(after).min(table.len());
                for &block in table.get(first..last).unwrap_or(&[]) {
                    sealed += usize::from(self.seal(block, layer, p)?);
                }
            }
        }
        Ok(sealed)
    }

    /// Seals `block` in part `p` of `layer` if it is staged.
    fn seal(&self, block: BlockId, layer: usize, p: usize) -> Result<bool> {
        let (plan, channels) = (&self.plans[layer][p], self.layers[layer].channels);
        let rows = self.block_rows(block)?;
        let mut staged = write(&self.staged[layer][p]);
        let Some(exact) = staged.release(block.index()) else {
            return Ok(false);
        };
        let mut values = vec![0.0; self.block_size * channels];
        let mut scratch = DecodeScratch::new();
        let sealed = exact
            .decode_rows_into(0, self.block_size, &mut values, &mut scratch)
            .map_err(PagedCacheError::from)
            .and_then(|_| {
                Ok(KvStore::quantize_with(
                    plan.sealed,
                    &values,
                    self.block_size,
                    channels,
                    clamped(),
                )?)
            });
        match sealed {
            Ok(sealed) => {
                write(&self.stores[layer][p]).copy_rows_from(rows.start, &sealed)?;
                staged.recycle(exact);
                Ok(true)
            }
            Err(e) => {
                // Nothing changed: the block stays staged.
                staged.blocks[block.index()] = Some(exact);
                Err(e)
            }
        }
    }

    /// Decodes rows `offset..offset + out.len() / channels` of one store of
    /// `block` into `out` (erased values interpolated from the block's own
    /// rows only).
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
        let rows = self.block_rows(block)?;
        let n = out.len() / channels;
        if offset + n > self.block_size {
            return Err(PagedCacheError::PositionOutOfRange {
                position: offset + n,
                tokens: self.block_size,
            });
        }
        if let Some(exact) = self.staged_rows(layer, part)?.get(block.index()) {
            scratch.limit_neighbours(None);
            return Ok(exact.decode_rows_into(offset, n, out, scratch)?);
        }
        let store = read(&self.stores[layer][part as usize]);
        // Interpolation reads neighbours within the block only.
        scratch.limit_neighbours(Some(rows.clone()));
        Ok(store.decode_rows_into(rows.start + offset, n, out, scratch)?)
    }

    /// A copy of `block`'s contents (its staged exact rows included).
    pub fn snapshot(&self, block: BlockId) -> Result<BlockData> {
        let rows = self.block_rows(block)?;
        let b = block.index();
        let mut layers = Vec::with_capacity(self.stores.len());
        let mut staged = Vec::with_capacity(self.stores.len());
        for (kv, st) in self.stores.iter().zip(&self.staged) {
            layers.push([
                read(&kv[0]).rows_to_store(rows.start, self.block_size)?,
                read(&kv[1]).rows_to_store(rows.start, self.block_size)?,
            ]);
            staged.push([read(&st[0]).get(b).cloned(), read(&st[1]).get(b).cloned()]);
        }
        Ok(BlockData { layers, staged })
    }

    /// Replaces `block`'s contents (from [`snapshot`](Self::snapshot) of
    /// storage with the same layers and block size).
    pub fn restore(&self, block: BlockId, data: BlockData) -> Result<()> {
        let rows = self.block_rows(block)?;
        let fits = data.layers.len() == self.layers.len()
            && data.staged.len() == self.layers.len()
            && data
                .layers
                .iter()
                .zip(&data.staged)
                .zip(self.layers.iter().zip(&self.plans))
                .all(|((d, st), (l, plans))| {
                    d.iter().zip(st).zip(plans).all(|((s, e), plan)| {
                        *s.form() == plan.sealed
                            && s.channels() == l.channels
                            && s.tokens() == self.block_size
                            && e.as_ref().is_none_or(|e| {
                                plan.staged
                                    && *e.form() == plan.exact
                                    && e.channels() == l.channels
                                    && e.tokens() == self.block_size
                            })
                    })
                });
        if !fits {
            return Err(PagedCacheError::InvalidParameter {
                name: "block data",
                reason: "its layers differ from this storage's".into(),
            });
        }
        let b = block.index();
        for ((kv, st), (d, exact)) in self
            .stores
            .iter()
            .zip(&self.staged)
            .zip(data.layers.iter().zip(data.staged))
        {
            for p in 0..2 {
                write(&kv[p]).copy_rows_from(rows.start, &d[p])?;
                let mut staged = write(&st[p]);
                if let Some(old) = staged.release(b) {
                    staged.recycle(old);
                }
                if let Some(e) = &exact[p] {
                    let form = *e.form();
                    staged
                        .stage(b, form, self.block_size, e.channels())?
                        .copy_rows_from(0, e)?;
                }
            }
        }
        Ok(())
    }

    /// Copies `src`'s contents into `dst` (copy-on-write).
    pub fn copy(&self, src: BlockId, dst: BlockId) -> Result<()> {
        let data = self.snapshot(src)?;
        self.restore(dst, data)
    }

    /// Scrubs every store of `block` (see [`KvStore::scrub`]): its sealed
    /// rows, or its staged exact rows where it is staged.
    pub fn scrub(&self, block: BlockId) -> Result<ScrubStats> {
        let rows = self.block_rows(block)?;
        let mut stats = ScrubStats::default();
        for (kv, st) in self.stores.iter().zip(&self.staged) {
            for p in 0..2 {
                let mut staged = write(&st[p]);
                stats += match staged
                    .blocks
                    .get_mut(block.index())
                    .and_then(Option::as_mut)
                {
                    Some(exact) => exact.scrub()?,
                    None => write(&kv[p]).scrub_rows(rows.clone())?,
                };
            }
        }
        Ok(stats)
    }

    /// Injects faults from `channel` with `seed` into one store of `block`
    /// (see [`KvStore::inject_rows`]: flip positions count from the block's
    /// first byte in each buffer): into its staged exact rows where it is
    /// staged, its sealed rows otherwise.
    pub fn inject(
        &self,
        block: BlockId,
        layer: usize,
        part: KvPart,
        channel: &dyn FaultChannel,
        seed: u64,
        target: FaultTarget,
    ) -> Result<Injection> {
        self.layer(layer)?;
        let rows = self.block_rows(block)?;
        let mut staged = write(&self.staged[layer][part as usize]);
        if let Some(exact) = staged
            .blocks
            .get_mut(block.index())
            .and_then(Option::as_mut)
        {
            return Ok(exact.inject_rows(0..self.block_size, channel, seed, target)?);
        }
        let mut store = write(&self.stores[layer][part as usize]);
        Ok(store.inject_rows(rows, channel, seed, target)?)
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
        let rows = self.block_rows(block)?;
        if let Some(exact) = self.staged_rows(layer, part)?.get(block.index()) {
            return Ok(f(exact));
        }
        let store = self.layer_store(layer, part)?;
        Ok(f(&store.rows_to_store(rows.start, self.block_size)?))
    }

    /// Bytes `block` holds in `layer` (K and V), counted from its buffers:
    /// its rows of the layer stores, and its staged exact rows where it is
    /// staged (both are held while it is).
    pub fn block_layer_bytes(&self, block: BlockId, layer: usize) -> Result<usize> {
        Ok(self.block_part_bytes(block, layer, KvPart::Keys)?
            + self.block_part_bytes(block, layer, KvPart::Values)?)
    }

    /// Bytes `block` holds in one part of `layer` (see
    /// [`block_layer_bytes`](Self::block_layer_bytes)).
    pub fn block_part_bytes(&self, block: BlockId, layer: usize, part: KvPart) -> Result<usize> {
        self.block_rows(block)?;
        let exact = self
            .staged_rows(layer, part)?
            .get(block.index())
            .map_or(0, KvStore::stored_bytes);
        Ok(self.part_block_bytes(layer, part)? + exact)
    }

    /// Bytes one block holds in `layer` (K and V) in the layer stores: the
    /// layer's stores' bytes over the block count (every block of a layer
    /// has the same layout), staged exact rows not counted.
    pub fn layer_block_bytes(&self, layer: usize) -> Result<usize> {
        Ok(self.part_block_bytes(layer, KvPart::Keys)?
            + self.part_block_bytes(layer, KvPart::Values)?)
    }

    /// Bytes one block holds in one part of `layer` in the layer store.
    pub fn part_block_bytes(&self, layer: usize, part: KvPart) -> Result<usize> {
        self.layer(layer)?;
        let bytes = read(&self.stores[layer][part as usize]).stored_bytes();
        Ok(bytes.checked_div(self.num_blocks).unwrap_or(0))
    }
}

/// The quantization options of sealing: exact rows that a fault made
/// non-finite are clamped (the fault's outcome is measured, not fatal).
fn clamped() -> QuantizeOptions {
    QuantizeOptions {
        non_finite: NonFinite::Clamp,
    }
}

/// Refuses forms blocks of `block_size` tokens cannot hold (see
/// [`BlockPlan::new`]): shard, low-rank and codebook forms, per-tensor
/// scales, and per-channel groups other than one block.
pub fn check_pageable(form: &CacheForm, block_size: usize) -> Result<()> {
    block_plan(*form, block_size).map(|_| ())
}

/// [`BlockPlan::new`], its refusal as this crate's error.
fn block_plan(form: CacheForm, block_size: usize) -> Result<BlockPlan> {
    BlockPlan::new(form, block_size).map_err(|e| PagedCacheError::InvalidParameter {
        name: "form",
        reason: match e {
            kv_quant::KvQuantError::InvalidSpec { spec, reason } => format!("{spec} {reason}"),
            other => other.to_string(),
        },
    })
}

#[cfg(test)]
mod tests;
