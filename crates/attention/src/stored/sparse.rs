//! [`SparsePart`]: integer forms with KVQuant's dense-and-sparse split
//! (`int2-ch+out1`, `int3-ch+sink4+out0.5`, `int2-g32+out1+secded84`)
//! as a [`StoredPart`].
//!
//! A block's rows are staged exact (f16 under the form's protection) until
//! the step that fills it commits; sealing splits off the block's outliers
//! and quantizes the rest into one kv-quant [`SparseStore`] of the block
//! (kv-quant's `outliers` module: the greedy choice, the stored tables and
//! their faults). Per-channel groups span the block (`int2-ch`, or
//! `int2-ch<B>` with B the block size), per-token groups are the form's.
//! Sink blocks (`+sink<S>`) stay exact, as [`PlannedPart`](super::PlannedPart)
//! keeps them. Tiles are the decoded rows (f32): the outliers are patched
//! into each page's dense rows, so the integer kernels are not used here.

use std::ops::Range;

use gf2_codes::channel::FaultChannel;
use kv_quant::{
    CacheForm, DecodeScratch, FaultTarget, Granularity, Injection, KvDecodeStats, KvQuantError,
    KvStore, Quantizer, RowBuffers, ScrubStats, Segments, SparseStore,
};

use super::staging::{BlockState, StagedBlocks};
use super::{PartBlock, PartScratch, PoolBytes, StoredPart};
use crate::error::{AttentionError, Result};
use crate::source::Tile;

/// An integer form with sparse outliers kept in blocks (module docs).
#[derive(Debug)]
pub struct SparsePart {
    form: CacheForm,
    /// The form of a sealed block: the form without its segments.
    sealed_form: CacheForm,
    channels: usize,
    block_size: usize,
    /// Leading blocks of a sequence never sealed (exact sink tokens).
    sink_blocks: usize,
    blocks: StagedBlocks<SparseStore>,
    /// Bytes of one sealed block (the same for every block of a form).
    sealed_bytes: usize,
}

impl SparsePart {
    /// Zeroed blocks of `form` (an integer form with `+out`), or why blocks
    /// of `block_size` rows of `channels` values cannot hold it.
    pub fn new(
        form: CacheForm,
        block_size: usize,
        channels: usize,
        num_blocks: usize,
    ) -> Result<Self> {
        let (sealed_form, sealed_bytes) = Self::check(form, block_size, channels)?;
        Ok(Self {
            blocks: StagedBlocks::new(form.exact_rows_form(), block_size, channels, num_blocks),
            form,
            sealed_form,
            channels,
            block_size,
            sink_blocks: form.segments().sink.div_ceil(block_size),
            sealed_bytes,
        })
    }

    /// [`PoolBytes`] of [`new`](Self::new): every block at the larger of
    /// its exact and sealed bytes.
    pub fn pool_bytes(
        form: CacheForm,
        block_size: usize,
        channels: usize,
        num_blocks: usize,
    ) -> Result<PoolBytes> {
        let (_, sealed) = Self::check(form, block_size, channels)?;
        let exact = KvStore::zeroed(form.exact_rows_form(), block_size, channels)?.stored_bytes();
        Ok(PoolBytes {
            blocks: (sealed.max(exact) as u64).saturating_mul(num_blocks as u64),
            ..PoolBytes::default()
        })
    }

    /// Whether blocks of `block_size` rows can hold `form` (channels
    /// aside): its per-channel groups must be the block.
    pub fn fits(form: CacheForm, block_size: usize) -> Result<()> {
        let refuse = |reason: String| {
            Err(AttentionError::Store(KvQuantError::InvalidSpec {
                spec: form.to_string(),
                reason,
            }))
        };
        if block_size == 0 {
            return refuse("blocks hold at least one token".into());
        }
        if form.outliers().is_none() {
            return refuse("keeps no sparse outliers (spell +out<P>)".into());
        }
        if let Quantizer::Int(spec) = form.quantizer()
            && let Granularity::PerChannel { tokens: Some(t) } = spec.granularity
            && t != block_size
        {
            return refuse(format!(
                "+out seals block by block, and per-channel groups of {t} tokens are not \
                 blocks of {block_size} (spell -ch, or -ch{block_size})"
            ));
        }
        Ok(())
    }

    /// The sealed form and one sealed block's bytes, or why not.
    fn check(form: CacheForm, block_size: usize, channels: usize) -> Result<(CacheForm, usize)> {
        Self::fits(form, block_size)?;
        let sealed_form = form.with_segments(Segments::default())?;
        let bytes = SparseStore::stored_bytes_of(sealed_form, block_size, channels)?;
        Ok((sealed_form, bytes))
    }

    /// Rows `offset..offset + out.len() / channels` of `block` as f32.
    fn decode(
        &self,
        block: usize,
        offset: usize,
        out: &mut [f32],
        scratch: &mut DecodeScratch,
    ) -> Result<KvDecodeStats> {
        if let Some(stats) = self.blocks.read_unsealed(block, offset, out, scratch)? {
            return Ok(stats);
        }
        let BlockState::Sealed(store) = self.blocks.get(block)? else {
            unreachable!("read_unsealed reads the others");
        };
        Ok(store.decode_rows_into(offset, out.len() / self.channels, out, scratch)?)
    }
}

impl StoredPart for SparsePart {
    fn form(&self) -> CacheForm {
        self.form
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
        self.blocks.exact_form()
    }

    fn open_block(&mut self, block: usize) -> Result<()> {
        self.blocks.open(block)
    }

    fn put_row(&mut self, block: usize, offset: usize, row: &RowBuffers) -> Result<()> {
        let bs = self.block_size;
        // A sequence cut back into a sealed block: staged again from the
        // rows it reads as.
        self.blocks.put_row(block, offset, row, |store, rows| {
            store.decode_rows_into(0, bs, rows, &mut DecodeScratch::new())?;
            Ok(())
        })
    }

    fn sealable(&self, before: usize, after: usize) -> Range<usize> {
        let first = (before / self.block_size).max(self.sink_blocks);
        first..(after / self.block_size).max(first)
    }

    fn seal(&mut self, block: usize, _first: usize) -> Result<bool> {
        let (form, bs, ch) = (self.sealed_form, self.block_size, self.channels);
        self.blocks
            .seal(block, |rows| Ok(SparseStore::quantize(form, rows, bs, ch)?))
    }

    fn is_staged(&self, block: usize) -> bool {
        self.blocks.is_staged(block)
    }

    fn staged_blocks(&self) -> usize {
        self.blocks.staged_count()
    }

    fn read_rows(
        &self,
        block: usize,
        offset: usize,
        out: &mut [f32],
        scratch: &mut DecodeScratch,
    ) -> Result<KvDecodeStats> {
        self.blocks.check_rows(offset, out.len() / self.channels)?;
        self.decode(block, offset, out, scratch)
    }

    fn read_tile<'s>(
        &'s self,
        pages: &[u32],
        start: usize,
        count: usize,
        scratch: &'s mut PartScratch,
    ) -> Result<Tile<'s>> {
        let PartScratch { rows, decode, .. } = scratch;
        let layout = (pages, self.block_size, self.channels);
        super::decode_pages(rows, layout, start, count, |page, offset, out| {
            self.decode(page, offset, out, decode)
        })
    }

    fn row_bytes(&self) -> usize {
        self.sealed_bytes.div_ceil(self.block_size)
    }

    fn snapshot(&self, block: usize) -> Result<PartBlock> {
        self.blocks
            .snapshot(block, |store| PartBlock::of_sparse(store.clone()))
    }

    fn accepts(&self, data: &PartBlock) -> bool {
        match data.sparse() {
            Some(s) => {
                data.stores().is_empty()
                    && data.bytes().is_empty()
                    && data.shard().is_none()
                    && data.low_rank().is_none()
                    && *s.form() == self.sealed_form
                    && s.tokens() == self.block_size
                    && s.channels() == self.channels
            }
            None => self.blocks.accepts_unsealed(data),
        }
    }

    fn restore(&mut self, block: usize, data: &PartBlock) -> Result<()> {
        self.blocks.get(block)?;
        if !self.accepts(data) {
            return Err(super::block_data_refused(
                self.block_size,
                self.channels,
                self.form,
            ));
        }
        self.blocks
            .restore(block, data, |data| Ok(data.sparse().cloned()))
    }

    fn scrub(&mut self, block: usize) -> Result<ScrubStats> {
        self.blocks.scrub_with(block, |store| Ok(store.scrub()?))
    }

    fn inject(
        &mut self,
        block: usize,
        channel: &dyn FaultChannel,
        seed: u64,
        target: FaultTarget,
    ) -> Result<Injection> {
        self.blocks.inject(block, channel, seed, target, |store| {
            Ok(store.inject(channel, seed, target))
        })
    }

    fn block_bytes(&self, block: usize) -> usize {
        self.blocks
            .block_bytes(block, SparseStore::stored_bytes, self.sealed_bytes)
    }

    fn sealed_block_bytes(&self) -> usize {
        self.sealed_bytes
    }
}
