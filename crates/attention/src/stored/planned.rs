//! [`PlannedPart`]: every kv-quant form a [`BlockPlan`] describes, as a
//! [`StoredPart`] (the worked example of the module docs).
//!
//! The sealed rows of every block lie in one kv-quant [`KvStore`] spanning
//! the pool (`blocks × block_size` rows, block `b` at rows
//! `b·block_size..`), so each of its buffers (codes, scales, offsets,
//! check bytes) is one array with a fixed block stride, as vLLM lays out
//! its cache, and a run of adjacent blocks reads as one store's tile.
//! A row-local form writes its rows there directly. A staged form
//! (per-channel groups, exact sink and window tokens) writes a block's
//! rows exact into a small store of its own (f16 under the form's
//! protection, reused once released) until the block is sealed: its rows
//! quantized at once into the block's rows of the pool store (per-channel
//! scales over the block), and the exact rows dropped. Attention reads
//! each page from where its rows are: staged pages as stored halves where
//! they are plain f16 (rotated like the sealed rows where the form
//! rotates), sealed pages as the pool store's tiles or gathered levels.
//! Interpolation of erased values reads the erased row's own block only.

use std::ops::Range;
use std::sync::Arc;

use gf2_codes::channel::FaultChannel;
use kv_quant::{
    BlockPlan, CacheForm, DecodeScratch, FaultTarget, Hadamard, Injection, KvDecodeStats, KvStore,
    RowBuffers, RowEncoder, ScrubStats, VqCodebook,
};

use super::{PartBlock, PartScratch, PoolBytes, SharedTable, StoredPart, clamped};
use crate::error::{AttentionError, Result};
use crate::source::{KvSource, Tile};
use gf2_codes::DecodeStats;

/// A kv-quant form kept in blocks as its [`BlockPlan`] says (see the
/// module docs).
#[derive(Debug)]
pub struct PlannedPart {
    plan: BlockPlan,
    channels: usize,
    num_blocks: usize,
    /// Every block's sealed (or written-in-place) rows.
    sealed: KvStore,
    /// The exact rows of every block written but not sealed, by block.
    staged: Vec<Option<KvStore>>,
    /// Released exact stores, kept so a warm cache stages a block without
    /// allocating.
    spare: Vec<KvStore>,
    /// The fitted codebook of a `vq` form, shared by every block, as
    /// stored, protected bytes.
    codebook: Option<SharedTable<VqCodebook>>,
}

impl PlannedPart {
    /// Zeroed blocks of `plan`'s form (with its fitted `codebook` for a
    /// `vq` form).
    pub fn new(
        plan: BlockPlan,
        channels: usize,
        num_blocks: usize,
        codebook: Option<Arc<VqCodebook>>,
    ) -> Result<Self> {
        let rows = num_blocks.checked_mul(plan.block_size).ok_or_else(|| {
            AttentionError::InvalidParameter {
                name: "num_blocks",
                reason: "blocks × block size overflows".into(),
            }
        })?;
        Ok(Self {
            sealed: KvStore::zeroed_with(plan.sealed, rows, channels, codebook.clone())?,
            codebook: codebook.map(|cb| SharedTable::new(cb, &plan.form)),
            plan,
            channels,
            num_blocks,
            staged: Vec::new(),
            spare: Vec::new(),
        })
    }

    /// `values` (`block_size` rows) quantized at once in the sealed form.
    fn quantize_sealed(&self, values: &[f32]) -> Result<KvStore> {
        let (bs, ch, form) = (self.plan.block_size, self.channels, self.plan.sealed);
        Ok(match &self.codebook {
            Some(cb) => {
                KvStore::quantize_with_codebook(form, values, bs, ch, clamped(), cb.read().clone())?
            }
            None => KvStore::quantize_with(form, values, bs, ch, clamped())?,
        })
    }

    /// How the form is kept in blocks.
    pub fn plan(&self) -> &BlockPlan {
        &self.plan
    }

    /// [`PoolBytes`] of [`new`](Self::new): one block's bytes counted from
    /// a zeroed block, times the blocks; building fills one f32 matrix of
    /// the whole pool.
    pub fn pool_bytes(
        plan: &BlockPlan,
        channels: usize,
        num_blocks: usize,
        codebook: Option<Arc<VqCodebook>>,
    ) -> Result<PoolBytes> {
        let one = KvStore::zeroed_with(plan.sealed, plan.block_size, channels, codebook)?
            .stored_bytes() as u64;
        let rows = (num_blocks as u64).saturating_mul(plan.block_size as u64);
        Ok(PoolBytes {
            blocks: one.saturating_mul(num_blocks as u64),
            building: rows.saturating_mul(4 * channels as u64),
            sequence: 0,
            fitting: 0,
        })
    }

    /// Pool rows of `block`.
    fn rows_of(&self, block: usize) -> Result<Range<usize>> {
        if block >= self.num_blocks {
            return Err(AttentionError::InvalidParameter {
                name: "block",
                reason: format!("block {block} of {}", self.num_blocks),
            });
        }
        let bs = self.plan.block_size;
        Ok(block * bs..(block + 1) * bs)
    }

    fn exact(&self, block: usize) -> Option<&KvStore> {
        self.staged.get(block).and_then(Option::as_ref)
    }

    /// Stages `block`: a spare store, or a new one of the exact form.
    fn stage(&mut self, block: usize) -> Result<&mut KvStore> {
        if self.staged.len() <= block {
            self.staged.resize_with(block + 1, || None);
        }
        if self.staged[block].is_none() {
            let store = match self.spare.pop() {
                Some(s) => s,
                None => KvStore::zeroed(self.plan.exact, self.plan.block_size, self.channels)?,
            };
            self.staged[block] = Some(store);
        }
        Ok(self.staged[block].as_mut().expect("staged above"))
    }

    /// Releases `block`'s exact rows, keeping the store for reuse.
    fn release(&mut self, block: usize) {
        if let Some(s) = self.staged.get_mut(block).and_then(Option::take) {
            self.spare.push(s);
        }
    }

    /// Stages a sealed `block` again, its exact rows the values its sealed
    /// rows decode to (a sequence cut back into a sealed block).
    fn unseal(&mut self, block: usize) -> Result<()> {
        let rows = self.rows_of(block)?;
        let (bs, channels) = (self.plan.block_size, self.channels);
        let mut values = vec![0.0; bs * channels];
        let mut scratch = DecodeScratch::new();
        scratch.limit_neighbours(Some(rows.clone()));
        self.sealed
            .decode_rows_into(rows.start, bs, &mut values, &mut scratch)?;
        let decoded = KvStore::quantize_with(self.plan.exact, &values, bs, channels, clamped())?;
        self.stage(block)?.copy_rows_from(0, &decoded)?;
        Ok(())
    }

    /// The pool row of the sequence's token `t`.
    fn row(&self, pages: &[u32], t: usize) -> usize {
        let bs = self.plan.block_size;
        pages[t / bs] as usize * bs + t % bs
    }

    /// The pages of tokens `start..start + count`.
    fn pages_of<'p>(&self, pages: &'p [u32], start: usize, count: usize) -> &'p [u32] {
        let bs = self.plan.block_size;
        &pages[start / bs..=(start + count - 1) / bs]
    }

    /// Whether tokens `start..start + count` sit in consecutive pool rows.
    fn contiguous(&self, pages: &[u32], start: usize, count: usize) -> bool {
        self.pages_of(pages, start, count)
            .windows(2)
            .all(|w| w[1] == w[0] + 1)
    }

    /// The staged exact rows of the page holding token `t`, if any.
    fn exact_at(&self, pages: &[u32], t: usize) -> Option<&KvStore> {
        self.exact(pages[t / self.plan.block_size] as usize)
    }

    /// Whether any page of tokens `start..start + count` is staged.
    fn touches_staged(&self, pages: &[u32], start: usize, count: usize) -> bool {
        self.plan.staged
            && self
                .pages_of(pages, start, count)
                .iter()
                .any(|&b| self.exact(b as usize).is_some())
    }

    /// Rows `start..start + count`, some of them staged, decoded page by
    /// page into f32 in the sealed rows' coordinates.
    fn decode_mixed<'s>(
        &'s self,
        pages: &[u32],
        start: usize,
        count: usize,
        scratch: &'s mut PartScratch,
    ) -> Result<Tile<'s>> {
        let bs = self.plan.block_size;
        let rotation = KvSource::rotation(&self.sealed);
        let PartScratch { rows, decode, .. } = scratch;
        let layout = (pages, bs, self.channels);
        super::decode_pages(rows, layout, start, count, |page, offset, out| {
            let k = out.len() / self.channels;
            Ok(match self.exact(page) {
                Some(exact) => {
                    decode.limit_neighbours(None);
                    let stats = exact.decode_rows_into(offset, k, out, decode)?;
                    if let Some(h) = rotation {
                        h.rotate(out);
                    }
                    stats
                }
                None => {
                    let first = page * bs;
                    decode.limit_neighbours(Some(first..first + bs));
                    self.sealed
                        .decode_rows_rotated_into(first + offset, k, out, decode)?
                }
            })
        })
    }

    /// Checks that `store` has this part's exact or sealed form (`exact`)
    /// and one block's shape.
    fn fits(&self, store: &KvStore, exact: bool) -> bool {
        let form = if exact {
            self.plan.exact
        } else {
            self.plan.sealed
        };
        (!exact || self.plan.staged)
            && *store.form() == form
            && store.channels() == self.channels
            && store.tokens() == self.plan.block_size
    }
}

impl StoredPart for PlannedPart {
    fn form(&self) -> CacheForm {
        self.plan.form
    }

    fn channels(&self) -> usize {
        self.channels
    }

    fn block_size(&self) -> usize {
        self.plan.block_size
    }

    fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    fn written_form(&self) -> CacheForm {
        if self.plan.staged {
            self.plan.exact
        } else {
            self.plan.sealed
        }
    }

    fn row_encoder(&self) -> Result<RowEncoder> {
        let form = self.written_form();
        let codebook = self
            .codebook
            .as_ref()
            .map(|cb| cb.read().clone())
            .filter(|_| form.quantizer().needs_codebook());
        Ok(RowEncoder::new(form, self.channels, codebook)?)
    }

    fn shared_bytes(&self) -> usize {
        self.codebook.as_ref().map_or(0, |c| c.stored_bytes())
    }

    fn open_block(&mut self, block: usize) -> Result<()> {
        self.rows_of(block)?;
        if self.plan.staged {
            self.stage(block)?;
        }
        Ok(())
    }

    fn put_row(&mut self, block: usize, offset: usize, row: &RowBuffers) -> Result<()> {
        let rows = self.rows_of(block)?;
        if offset >= self.plan.block_size {
            return Err(AttentionError::InvalidParameter {
                name: "offset",
                reason: format!("slot {offset} of a block of {}", self.plan.block_size),
            });
        }
        if !self.plan.staged {
            self.sealed.put_encoded_rows(rows.start + offset, row)?;
            return Ok(());
        }
        if self.exact(block).is_none() {
            self.unseal(block)?;
        }
        self.stage(block)?.put_encoded_rows(offset, row)?;
        Ok(())
    }

    fn sealable(&self, before: usize, after: usize) -> Range<usize> {
        if !self.plan.staged {
            return 0..0;
        }
        let first = self.plan.sealable(before).max(self.plan.sink_blocks);
        first..self.plan.sealable(after).max(first)
    }

    fn seal(&mut self, block: usize, _first: usize) -> Result<bool> {
        let rows = self.rows_of(block)?;
        let Some(exact) = self.exact(block) else {
            return Ok(false);
        };
        let (bs, channels) = (self.plan.block_size, self.channels);
        let mut values = vec![0.0; bs * channels];
        let mut scratch = DecodeScratch::new();
        exact.decode_rows_into(0, bs, &mut values, &mut scratch)?;
        // Exact rows a fault made non-finite are clamped: the fault's
        // outcome is measured, not fatal. On failure nothing changed.
        let sealed = self.quantize_sealed(&values)?;
        self.sealed.copy_rows_from(rows.start, &sealed)?;
        self.release(block);
        Ok(true)
    }

    fn is_staged(&self, block: usize) -> bool {
        self.exact(block).is_some()
    }

    fn staged_blocks(&self) -> usize {
        self.staged.iter().filter(|b| b.is_some()).count()
    }

    fn read_rows(
        &self,
        block: usize,
        offset: usize,
        out: &mut [f32],
        scratch: &mut DecodeScratch,
    ) -> Result<KvDecodeStats> {
        let rows = self.rows_of(block)?;
        let n = out.len() / self.channels;
        if offset + n > self.plan.block_size {
            return Err(AttentionError::InvalidParameter {
                name: "rows",
                reason: format!(
                    "rows {offset}..{} of a block of {}",
                    offset + n,
                    self.plan.block_size
                ),
            });
        }
        if let Some(exact) = self.exact(block) {
            scratch.limit_neighbours(None);
            return Ok(exact.decode_rows_into(offset, n, out, scratch)?);
        }
        scratch.limit_neighbours(Some(rows.clone()));
        Ok(self
            .sealed
            .decode_rows_into(rows.start + offset, n, out, scratch)?)
    }

    fn read_tile<'s>(
        &'s self,
        pages: &[u32],
        start: usize,
        count: usize,
        scratch: &'s mut PartScratch,
    ) -> Result<Tile<'s>> {
        let bs = self.plan.block_size;
        if self.touches_staged(pages, start, count) {
            let one_page = start / bs == (start + count - 1) / bs;
            if one_page && KvSource::rotation(&self.sealed).is_none() {
                let exact = self.exact_at(pages, start).expect("a staged page");
                return exact.read_tile(start % bs, count, &mut scratch.store);
            }
            return self.decode_mixed(pages, start, count, scratch);
        }
        if self.contiguous(pages, start, count) {
            // A tile of several adjacent blocks: read as the store's tile.
            return scratch
                .blocked
                .read_run(&self.sealed, self.row(pages, start), count, bs);
        }
        scratch
            .blocked
            .read_blocks(&self.sealed, start, count, bs, |t| self.row(pages, t))
    }

    fn row_bytes(&self) -> usize {
        self.sealed.row_bytes()
    }

    fn gathers_blocks(&self) -> bool {
        self.sealed.gathers_levels_in_blocks(self.plan.block_size)
    }

    fn rotation(&self) -> Option<&'static Hadamard> {
        KvSource::rotation(&self.sealed)
    }

    fn row_address_ranges(
        &self,
        pages: &[u32],
        start: usize,
        count: usize,
        each: &mut dyn FnMut(Range<usize>),
    ) {
        let bs = self.plan.block_size;
        let mut t = start;
        while t < start + count {
            let n = (bs - t % bs).min(start + count - t);
            if self.exact_at(pages, t).is_none() {
                self.sealed.row_address_ranges(self.row(pages, t), n, each);
            }
            t += n;
        }
    }

    fn row_addresses(&self, pages: &[u32], start: usize, count: usize) -> Option<Range<usize>> {
        if self.contiguous(pages, start, count) && !self.touches_staged(pages, start, count) {
            self.sealed.row_addresses(self.row(pages, start), count)
        } else {
            None
        }
    }

    fn snapshot(&self, block: usize) -> Result<PartBlock> {
        let rows = self.rows_of(block)?;
        let mut stores = vec![
            self.sealed
                .rows_to_store(rows.start, self.plan.block_size)?,
        ];
        stores.extend(self.exact(block).cloned());
        Ok(PartBlock::of_stores(stores))
    }

    fn accepts(&self, data: &PartBlock) -> bool {
        if !data.bytes().is_empty() || data.sparse().is_some() {
            return false;
        }
        match data.stores() {
            [sealed] => self.fits(sealed, false),
            [sealed, exact] => self.fits(sealed, false) && self.fits(exact, true),
            _ => false,
        }
    }

    fn restore(&mut self, block: usize, data: &PartBlock) -> Result<()> {
        let rows = self.rows_of(block)?;
        if !self.accepts(data) {
            return Err(super::block_data_refused(
                self.plan.block_size,
                self.channels,
                self.plan.form,
            ));
        }
        self.sealed.copy_rows_from(rows.start, &data.stores()[0])?;
        self.release(block);
        if let Some(exact) = data.stores().get(1) {
            self.stage(block)?.copy_rows_from(0, exact)?;
        }
        Ok(())
    }

    fn scrub(&mut self, block: usize) -> Result<ScrubStats> {
        let rows = self.rows_of(block)?;
        Ok(match self.staged.get_mut(block).and_then(Option::as_mut) {
            Some(exact) => exact.scrub()?,
            None => self.sealed.scrub_rows(rows)?,
        })
    }

    fn inject(
        &mut self,
        block: usize,
        channel: &dyn FaultChannel,
        seed: u64,
        target: FaultTarget,
    ) -> Result<Injection> {
        let rows = self.rows_of(block)?;
        let bs = self.plan.block_size;
        Ok(match self.staged.get_mut(block).and_then(Option::as_mut) {
            Some(exact) => exact.inject_rows(0..bs, channel, seed, target)?,
            None => self.sealed.inject_rows(rows, channel, seed, target)?,
        })
    }

    fn inject_shared(
        &mut self,
        channel: &dyn FaultChannel,
        seed: u64,
        target: FaultTarget,
    ) -> Result<Injection> {
        let Some(codebook) = &mut self.codebook else {
            return Ok(Injection::default());
        };
        let (injection, changed) = codebook.inject(channel, seed, target)?;
        if changed {
            self.sealed.replace_codebook(codebook.read().clone())?;
        }
        Ok(injection)
    }

    fn shared_stats(&self) -> DecodeStats {
        self.codebook
            .as_ref()
            .map_or_else(DecodeStats::default, SharedTable::stats)
    }

    fn scrub_shared(&mut self) -> Result<DecodeStats> {
        let Some(codebook) = &mut self.codebook else {
            return Ok(DecodeStats::default());
        };
        Ok(codebook.scrub())
    }

    fn block_store(&self, block: usize) -> Result<KvStore> {
        let rows = self.rows_of(block)?;
        Ok(match self.exact(block) {
            Some(exact) => exact.clone(),
            None => self
                .sealed
                .rows_to_store(rows.start, self.plan.block_size)?,
        })
    }

    fn block_bytes(&self, block: usize) -> usize {
        self.sealed_block_bytes() + self.exact(block).map_or(0, KvStore::stored_bytes)
    }

    fn sealed_block_bytes(&self) -> usize {
        self.sealed
            .stored_bytes()
            .checked_div(self.num_blocks)
            .unwrap_or(0)
    }

    fn sealed_store(&self) -> Option<&KvStore> {
        Some(&self.sealed)
    }
}
