//! [`BlockStorage`]: the bytes behind the blocks. Each block holds, for every
//! layer, its K rows and its V rows as two kv-quant [`KvStore`]s of
//! `block_size` tokens in the layer's [`CacheForm`] (kv-quant owns the
//! byte layout; nothing here re-encodes anything), so a layer can keep FP16,
//! FP8, INT8, INT4 or ECC-protected INT4 and the pool reports the true bytes
//! each form takes. Blocks sit behind their own mutex so a background
//! scrubber ([`crate::Scrubber`]) can work beside the cache.

use std::sync::{Mutex, MutexGuard, PoisonError};

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

/// The contents of one block: `[K, V]` stores per layer.
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
    layers: Vec<LayerSpec>,
    writers: Vec<Mutex<LayerWriter>>,
    blocks: Vec<Mutex<BlockData>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding a block leaves plain bytes behind, never a
    // broken invariant of this type, so a poisoned lock is still usable.
    m.lock().unwrap_or_else(PoisonError::into_inner)
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
        for form in layers.iter().flat_map(|l| [l.key, l.value]) {
            check_pageable(&form)?;
        }
        let template = BlockData {
            layers: layers
                .iter()
                .map(|l| {
                    Ok([
                        KvStore::zeroed(l.key, block_size, l.channels)?,
                        KvStore::zeroed(l.value, block_size, l.channels)?,
                    ])
                })
                .collect::<Result<_>>()?,
        };
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
            layers: layers.to_vec(),
            writers,
            blocks: (0..num_blocks)
                .map(|_| Mutex::new(template.clone()))
                .collect(),
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
        self.blocks.len()
    }

    fn block(&self, block: BlockId) -> Result<MutexGuard<'_, BlockData>> {
        self.blocks
            .get(block.index())
            .map(lock)
            .ok_or(PagedCacheError::BlockOutOfRange {
                block: block.0,
                blocks: self.blocks.len(),
            })
    }

    fn layer(&self, layer: usize) -> Result<&LayerSpec> {
        self.layers
            .get(layer)
            .ok_or_else(|| PagedCacheError::InvalidParameter {
                name: "layer",
                reason: format!("layer {layer} of {}", self.layers.len()),
            })
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
        // Encode both rows before storing either, so a refused row changes
        // nothing, and outside the block's lock; no allocation once warm.
        let mut writer = lock(&self.writers[layer]);
        let w = &mut *writer;
        let options = QuantizeOptions::default();
        w.key.encode_into(keys, w.key_rows.as_mut(), options)?;
        w.value
            .encode_into(values, w.value_rows.as_mut(), options)?;
        let mut data = self.block(block)?;
        let [k, v] = &mut data.layers[layer];
        k.put_encoded_rows(offset, &w.key_rows)?;
        v.put_encoded_rows(offset, &w.value_rows)?;
        Ok(())
    }

    /// Decodes rows `offset..offset + out.len() / channels` of one store of
    /// `block` into `out`.
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
        let data = self.block(block)?;
        let store = &data.layers[layer][part as usize];
        Ok(store.decode_rows_into(offset, out.len() / channels, out, scratch)?)
    }

    /// A copy of `block`'s contents.
    pub fn snapshot(&self, block: BlockId) -> Result<BlockData> {
        Ok(self.block(block)?.clone())
    }

    /// Replaces `block`'s contents (from [`snapshot`](Self::snapshot) of
    /// storage with the same layers).
    pub fn restore(&self, block: BlockId, data: BlockData) -> Result<()> {
        let mut slot = self.block(block)?;
        if data.layers.len() != slot.layers.len()
            || data.layers.iter().zip(&slot.layers).any(|(a, b)| {
                a.iter()
                    .zip(b)
                    .any(|(a, b)| a.form() != b.form() || a.channels() != b.channels())
            })
        {
            return Err(PagedCacheError::InvalidParameter {
                name: "block data",
                reason: "its layers differ from this storage's".into(),
            });
        }
        *slot = data;
        Ok(())
    }

    /// Copies `src`'s contents into `dst` (copy-on-write).
    pub fn copy(&self, src: BlockId, dst: BlockId) -> Result<()> {
        let data = self.snapshot(src)?;
        let mut slot = self.block(dst)?;
        slot.clone_from(&data);
        Ok(())
    }

    /// Scrubs every store of `block` (see [`KvStore::scrub`]).
    pub fn scrub(&self, block: BlockId) -> Result<ScrubStats> {
        let mut data = self.block(block)?;
        let mut stats = ScrubStats::default();
        for store in data.layers.iter_mut().flatten() {
            stats += store.scrub()?;
        }
        Ok(stats)
    }

    /// Injects faults from `channel` with `seed` into one store of `block`.
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
        let mut data = self.block(block)?;
        Ok(data.layers[layer][part as usize].inject(channel, seed, target))
    }

    /// Applies `f` to one store of `block` (reading bytes, flips, words).
    pub fn with_store<R>(
        &self,
        block: BlockId,
        layer: usize,
        part: KvPart,
        f: impl FnOnce(&KvStore) -> R,
    ) -> Result<R> {
        self.layer(layer)?;
        let data = self.block(block)?;
        Ok(f(&data.layers[layer][part as usize]))
    }

    /// Bytes `block` holds in `layer` (K and V), counted from its buffers.
    pub fn block_layer_bytes(&self, block: BlockId, layer: usize) -> Result<usize> {
        self.layer(layer)?;
        let data = self.block(block)?;
        Ok(data.layers[layer].iter().map(KvStore::stored_bytes).sum())
    }

    /// Bytes one block holds in `layer` (K and V), counted from the first
    /// block's buffers (every block of a layer has the same layout).
    pub fn layer_block_bytes(&self, layer: usize) -> Result<usize> {
        self.layer(layer)?;
        let Some(first) = self.blocks.first() else {
            return Ok(0);
        };
        let data = lock(first);
        Ok(data.layers[layer].iter().map(KvStore::stored_bytes).sum())
    }
}

/// Refuses forms a block cannot hold: forms that share scales across
/// tokens (blocks are written a token at a time), and forms that need
/// fitted data (codebooks, bases) the storage does not carry.
pub fn check_pageable(form: &CacheForm) -> Result<()> {
    let q = form.quantizer();
    let reason = if !form.is_row_local() {
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
