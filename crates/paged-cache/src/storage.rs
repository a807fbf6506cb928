//! [`BlockStorage`]: the bytes behind the blocks, laid out as vLLM lays
//! out its KV cache: for every layer, one kv-quant [`KvStore`] of keys and
//! one of values spanning all blocks (`num_blocks × block_size` token rows,
//! block `b` at rows `b·block_size..(b + 1)·block_size`), so each buffer
//! (codes, scales, offsets, check bytes) is one contiguous array with a
//! fixed block stride. kv-quant owns the byte layout; nothing here
//! re-encodes anything. A layer can keep FP16, FP8, INT8, INT4 or
//! ECC-protected INT4, with different forms for keys and values, and the
//! pool reports the true bytes each form takes. Each layer's K and V stores
//! sit behind their own read-write lock: attention reads a layer under one
//! read lock, and a background scrubber ([`crate::Scrubber`]) takes the
//! write lock one block at a time.

use std::ops::Range;
use std::sync::{Mutex, MutexGuard, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};

use gf2_codes::channel::FaultChannel;
use kv_quant::{
    CacheForm, DecodeScratch, FaultTarget, Injection, KvDecodeStats, KvStore, QuantizeOptions,
    Quantizer, RowBuffers, RowEncoder, ScrubStats,
};

use crate::error::{PagedCacheError, Result};
use crate::pool::BlockId;

/// The stored forms and width of one layer's K and V rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LayerSpec {
    /// Form of the K rows (must be [row-local](CacheForm::is_row_local)).
    pub key: CacheForm,
    /// Form of the V rows (must be row-local).
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
}

impl BlockData {
    /// The K or V store of `layer`.
    pub fn store(&self, layer: usize, part: KvPart) -> Option<&KvStore> {
        self.layers.get(layer).map(|kv| &kv[part as usize])
    }

    /// Bytes held, counted from the stores' buffers.
    pub fn stored_bytes(&self) -> usize {
        self.layers
            .iter()
            .flatten()
            .map(KvStore::stored_bytes)
            .sum()
    }

    /// One scrubbing pass over every store of the block (see
    /// [`KvStore::scrub`]): swapped-out blocks collect faults too.
    pub fn scrub(&mut self) -> Result<ScrubStats> {
        let mut stats = ScrubStats::default();
        for store in self.layers.iter_mut().flatten() {
            stats += store.scrub()?;
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

/// Block contents for a pool of `num_blocks` blocks.
#[derive(Debug)]
pub struct BlockStorage {
    block_size: usize,
    num_blocks: usize,
    layers: Vec<LayerSpec>,
    writers: Vec<Mutex<LayerWriter>>,
    /// Per layer: the K and V stores of every block.
    stores: Vec<[RwLock<KvStore>; 2]>,
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
        for form in layers.iter().flat_map(|l| [l.key, l.value]) {
            check_pageable(&form)?;
        }
        let rows = num_blocks.checked_mul(block_size).ok_or_else(|| {
            PagedCacheError::InvalidParameter {
                name: "num_blocks",
                reason: "blocks × block size overflows".into(),
            }
        })?;
        let stores = layers
            .iter()
            .map(|l| {
                Ok([
                    RwLock::new(KvStore::zeroed(l.key, rows, l.channels)?),
                    RwLock::new(KvStore::zeroed(l.value, rows, l.channels)?),
                ])
            })
            .collect::<Result<_>>()?;
        let writers = layers
            .iter()
            .map(|l| {
                let key = RowEncoder::new(l.key, l.channels, None)?;
                let value = RowEncoder::new(l.value, l.channels, None)?;
                Ok(Mutex::new(LayerWriter {
                    key_rows: RowBuffers::new(key.buffer_sizes(1)),
                    value_rows: RowBuffers::new(value.buffer_sizes(1)),
                    key,
                    value,
                }))
            })
            .collect::<Result<_>>()?;
        Ok(Self {
            block_size,
            num_blocks,
            layers: layers.to_vec(),
            writers,
            stores,
        })
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

    /// Writes one token's K and V rows of `layer` at slot `offset` of `block`
    /// (encoded once, here; no allocation once the layer's encoders are warm).
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
        let options = QuantizeOptions::default();
        w.key.encode_into(keys, w.key_rows.as_mut(), options)?;
        w.value
            .encode_into(values, w.value_rows.as_mut(), options)?;
        let [k, v] = &self.stores[layer];
        write(k).put_encoded_rows(row, &w.key_rows)?;
        write(v).put_encoded_rows(row, &w.value_rows)?;
        Ok(())
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
        let store = read(&self.stores[layer][part as usize]);
        // Interpolation reads neighbours within the block only.
        scratch.limit_neighbours(Some(rows.clone()));
        Ok(store.decode_rows_into(rows.start + offset, n, out, scratch)?)
    }

    /// A copy of `block`'s contents.
    pub fn snapshot(&self, block: BlockId) -> Result<BlockData> {
        let rows = self.block_rows(block)?;
        let layers = self
            .stores
            .iter()
            .map(|kv| {
                Ok([
                    read(&kv[0]).rows_to_store(rows.start, self.block_size)?,
                    read(&kv[1]).rows_to_store(rows.start, self.block_size)?,
                ])
            })
            .collect::<Result<_>>()?;
        Ok(BlockData { layers })
    }

    /// Replaces `block`'s contents (from [`snapshot`](Self::snapshot) of
    /// storage with the same layers and block size).
    pub fn restore(&self, block: BlockId, data: BlockData) -> Result<()> {
        let rows = self.block_rows(block)?;
        let fits = data.layers.len() == self.layers.len()
            && data.layers.iter().zip(&self.layers).all(|(d, l)| {
                d.iter().zip([l.key, l.value]).all(|(s, f)| {
                    *s.form() == f && s.channels() == l.channels && s.tokens() == self.block_size
                })
            });
        if !fits {
            return Err(PagedCacheError::InvalidParameter {
                name: "block data",
                reason: "its layers differ from this storage's".into(),
            });
        }
        for (kv, d) in self.stores.iter().zip(&data.layers) {
            write(&kv[0]).copy_rows_from(rows.start, &d[0])?;
            write(&kv[1]).copy_rows_from(rows.start, &d[1])?;
        }
        Ok(())
    }

    /// Copies `src`'s contents into `dst` (copy-on-write).
    pub fn copy(&self, src: BlockId, dst: BlockId) -> Result<()> {
        let data = self.snapshot(src)?;
        self.restore(dst, data)
    }

    /// Scrubs every store of `block` (see [`KvStore::scrub`]).
    pub fn scrub(&self, block: BlockId) -> Result<ScrubStats> {
        let rows = self.block_rows(block)?;
        let mut stats = ScrubStats::default();
        for store in self.stores.iter().flatten() {
            stats += write(store).scrub_rows(rows.clone())?;
        }
        Ok(stats)
    }

    /// Injects faults from `channel` with `seed` into one store of `block`
    /// (see [`KvStore::inject_rows`]: flip positions count from the block's
    /// first byte in each buffer).
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
        let mut store = write(&self.stores[layer][part as usize]);
        Ok(store.inject_rows(rows, channel, seed, target)?)
    }

    /// Applies `f` to a copy of one store of `block` (its bytes, flips and
    /// words, as a store of `block_size` rows).
    pub fn with_store<R>(
        &self,
        block: BlockId,
        layer: usize,
        part: KvPart,
        f: impl FnOnce(&KvStore) -> R,
    ) -> Result<R> {
        let rows = self.block_rows(block)?;
        let store = self.layer_store(layer, part)?;
        Ok(f(&store.rows_to_store(rows.start, self.block_size)?))
    }

    /// Bytes `block` holds in `layer` (K and V), counted from its buffers.
    pub fn block_layer_bytes(&self, block: BlockId, layer: usize) -> Result<usize> {
        self.block_rows(block)?;
        self.layer_block_bytes(layer)
    }

    /// Bytes one block holds in `layer` (K and V): the layer's stores'
    /// bytes over the block count (every block of a layer has the same layout).
    pub fn layer_block_bytes(&self, layer: usize) -> Result<usize> {
        Ok(self.part_block_bytes(layer, KvPart::Keys)?
            + self.part_block_bytes(layer, KvPart::Values)?)
    }

    /// Bytes one block holds in one part of `layer`.
    pub fn part_block_bytes(&self, layer: usize, part: KvPart) -> Result<usize> {
        self.layer(layer)?;
        let bytes = read(&self.stores[layer][part as usize]).stored_bytes();
        Ok(bytes.checked_div(self.num_blocks).unwrap_or(0))
    }
}

/// Refuses forms a block cannot hold: forms that share scales across
/// tokens (blocks are written a token at a time), and forms that need
/// fitted data (codebooks, bases) the storage does not carry.
pub fn check_pageable(form: &CacheForm) -> Result<()> {
    let q = form.quantizer();
    let reason = if q.is_shard() {
        "is a shard form: its middle is fitted on the whole prefill and stored by attention's \
         ShardLayer, not written a token at a time into blocks (use --backend reencode)"
    } else if !form.is_row_local() {
        "shares scales across tokens (or keeps exact sink/window tokens); paged blocks are \
         written one token at a time and need a per-token form (fp16, fp8-e4m3-tok, int8, \
         int4, int4-g64, int4+secded84, …)"
    } else if matches!(q, Quantizer::LowRank(_)) {
        "is a low-rank form: its coefficients and bases live in kv-lowrank stores, not blocks"
    } else if q.needs_codebook() {
        "needs a fitted codebook, which block storage does not carry"
    } else {
        return Ok(());
    };
    Err(PagedCacheError::InvalidParameter {
        name: "form",
        reason: format!("{form} {reason}"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_scale_forms_and_bad_rows_are_refused() {
        let spec = |s: &str| LayerSpec::uniform(s.parse().unwrap(), 8);
        assert!(matches!(
            BlockStorage::new(2, 4, &[spec("fp8-e4m3")]),
            Err(PagedCacheError::InvalidParameter { name: "form", .. })
        ));
        assert!(BlockStorage::new(2, 4, &[]).is_err());
        for refused in ["int4-ch", "int4+sink4", "vq", "pca-r4"] {
            assert!(
                matches!(
                    BlockStorage::new(2, 4, &[spec(refused)]),
                    Err(PagedCacheError::InvalidParameter { name: "form", .. })
                ),
                "{refused}"
            );
        }
        let storage = BlockStorage::new(2, 4, &[spec("int4+secded84")]).unwrap();
        let row = [0.25f32; 8];
        assert!(matches!(
            storage.write(BlockId(0), 0, 0, &row[..7], &row),
            Err(PagedCacheError::ShapeMismatch { .. })
        ));
        assert!(storage.write(BlockId(0), 4, 0, &row, &row).is_err());
        assert!(storage.write(BlockId(2), 0, 0, &row, &row).is_err());
        assert!(storage.write(BlockId(0), 0, 1, &row, &row).is_err());
        // A NaN value row leaves the key row untouched too.
        let before = storage.snapshot(BlockId(0)).unwrap();
        let mut bad = row;
        bad[3] = f32::NAN;
        assert!(matches!(
            storage.write(BlockId(0), 1, 0, &row, &bad),
            Err(PagedCacheError::Quant(_))
        ));
        assert_eq!(storage.snapshot(BlockId(0)).unwrap(), before);
        storage.write(BlockId(0), 1, 0, &row, &row).unwrap();
        let mut out = [0.0; 8];
        storage
            .read(
                BlockId(0),
                0,
                KvPart::Values,
                1,
                &mut out,
                &mut DecodeScratch::new(),
            )
            .unwrap();
        assert!(out.iter().all(|&x| (x - 0.25).abs() < 1e-6), "{out:?}");
    }
}
