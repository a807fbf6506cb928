//! [`HierarchicalPart`]: a hierarchical `int8h` form (QuantSpec's
//! hierarchical KV cache, arXiv 2502.10424) as two planes in blocks, each
//! a [`PlannedPart`] of its own under the form's protection.
//!
//! - The **upper plane** is the `int4` form of the same options (`int8h-ch+sink4`:
//!   `int4-ch+sink4`), kept exactly as that form is kept: per-token rows
//!   written in place, per-channel blocks staged exact and sealed at
//!   commit, sink and window blocks exact.
//! - The **residual plane** is the same 4-bit form, without segments, of
//!   what the upper plane leaves: `r = x − x̂₄`, where `x̂₄` is what the
//!   upper plane reads as, with scales of its own on the same groups. A
//!   row-local upper plane writes a row's residual with the row; a staged
//!   one writes a block's residuals when it seals the block (the exact
//!   rows read before sealing, the sealed rows after).
//!
//! Reading in the [full view](ReadView::Full) (decoding, verification) is
//! `x̂₄ + r̂` on every block whose upper plane is coded, and the exact rows
//! on every block still staged, decoded page by page into f32 rows; in
//! the [draft view](ReadView::Draft) it is the upper plane alone, read
//! exactly as a part of its `int4` form reads (stored levels to the
//! integer kernels), half the bytes. Since `|x − x̂₄|` is at most half an
//! upper step `s`, the residual's step is about `s/15` and the full view's
//! error about `s/30`, INT8's order; each plane's words are corrected,
//! faulted, scrubbed and counted by its own store, so a fault in one plane
//! never reaches the other's code.
//!
//! Per-channel groups of several blocks (`int8h-ch<G>`, `G` a multiple of
//! the block above it) are refused: the planes keep one block per group.

use std::ops::Range;

use gf2_codes::channel::{FaultChannel, Flips};
use kv_quant::{
    BlockPlan, CacheForm, DecodeScratch, FaultTarget, Injection, KvDecodeStats, KvQuantError,
    Quantizer, RowBuffers, RowEncoder, ScrubStats,
};

use super::{
    PartBlock, PartScratch, PlannedPart, PoolBytes, StoredPart, clamp_non_finite, clamped,
    decode_pages,
};
use crate::backend::ReadView;
use crate::error::{AttentionError, Result};
use crate::source::Tile;

/// Salt of the residual plane's fault streams (apart from the upper's).
const RESIDUAL_SALT: u64 = 0x7265_7369_6475_616c;

/// An `int8h` form in blocks (see the module docs).
#[derive(Debug)]
pub struct HierarchicalPart {
    form: CacheForm,
    upper: PlannedPart,
    residual: PlannedPart,
    view: ReadView,
    /// The form a written row arrives in: the upper plane's exact rows
    /// where it stages them, else plain f32 (the row is coded here).
    written: CacheForm,
    upper_encoder: RowEncoder,
    residual_encoder: RowEncoder,
    upper_row: RowBuffers,
    residual_row: RowBuffers,
    /// Rows being coded: as written, as the upper plane reads them.
    exact: Vec<f32>,
    read: Vec<f32>,
    decode: DecodeScratch,
}

impl HierarchicalPart {
    /// Zeroed blocks of `form` (an `int8h` form) in blocks of
    /// `block_size` tokens of `channels` values.
    pub fn new(
        form: CacheForm,
        block_size: usize,
        channels: usize,
        num_blocks: usize,
    ) -> Result<Self> {
        let (upper_plan, residual_plan) = Self::plans(form, block_size)?;
        let upper = PlannedPart::new(upper_plan, channels, num_blocks, None)?;
        let residual = PlannedPart::new(residual_plan, channels, num_blocks, None)?;
        let written = if upper_plan.staged {
            upper.written_form()
        } else {
            CacheForm::plain(Quantizer::Fp32)?
        };
        let upper_encoder = upper.row_encoder()?;
        let residual_encoder = residual.row_encoder()?;
        Ok(Self {
            form,
            view: ReadView::Full,
            written,
            upper_row: RowBuffers::new(upper_encoder.buffer_sizes(1)),
            residual_row: RowBuffers::new(residual_encoder.buffer_sizes(1)),
            upper_encoder,
            residual_encoder,
            exact: vec![0.0; block_size * channels],
            read: vec![0.0; block_size * channels],
            decode: DecodeScratch::new(),
            upper,
            residual,
        })
    }

    /// The block plans of the upper and residual planes of `form`, or why
    /// blocks of `block_size` cannot hold it.
    pub fn plans(form: CacheForm, block_size: usize) -> Result<(BlockPlan, BlockPlan)> {
        let (upper, residual) = form.planes().ok_or_else(|| {
            AttentionError::Store(KvQuantError::InvalidSpec {
                spec: form.to_string(),
                reason: "is not a hierarchical (int8h) form".into(),
            })
        })?;
        let (upper, residual) = (
            BlockPlan::new(upper, block_size)?,
            BlockPlan::new(residual, block_size)?,
        );
        if upper.group_blocks > 1 {
            return Err(AttentionError::Store(KvQuantError::InvalidSpec {
                spec: form.to_string(),
                reason: format!(
                    "groups per-channel scales over {} blocks; its planes keep one block per \
                     group (use int8h-ch, or blocks of the group's size)",
                    upper.group_blocks
                ),
            }));
        }
        Ok((upper, residual))
    }

    /// [`PoolBytes`] of [`new`](Self::new): both planes'.
    pub fn pool_bytes(
        form: CacheForm,
        block_size: usize,
        channels: usize,
        num_blocks: usize,
    ) -> Result<PoolBytes> {
        let (upper, residual) = Self::plans(form, block_size)?;
        let (u, r) = (
            PlannedPart::pool_bytes(&upper, channels, num_blocks, None)?,
            PlannedPart::pool_bytes(&residual, channels, num_blocks, None)?,
        );
        Ok(PoolBytes {
            blocks: u.blocks.saturating_add(r.blocks),
            building: u.building.max(r.building),
            sequence: 0,
            fitting: 0,
        })
    }

    /// The view read now.
    pub fn view(&self) -> ReadView {
        self.view
    }

    /// Whether `block`'s upper plane is coded (so a residual is stored
    /// beside it): not while it is staged exact.
    fn coded(&self, block: usize) -> bool {
        !self.upper.is_staged(block)
    }

    /// Rows `offset..` of `block` in the full view into `out`, the
    /// residual read into `tmp`.
    fn read_full(
        &self,
        block: usize,
        offset: usize,
        out: &mut [f32],
        tmp: &mut Vec<f32>,
        scratch: &mut DecodeScratch,
    ) -> Result<KvDecodeStats> {
        let mut stats = self.upper.read_rows(block, offset, out, scratch)?;
        if self.coded(block) {
            if tmp.len() < out.len() {
                tmp.resize(out.len(), 0.0);
            }
            let tmp = &mut tmp[..out.len()];
            stats += self.residual.read_rows(block, offset, tmp, scratch)?;
            for (x, r) in out.iter_mut().zip(tmp.iter()) {
                *x += r;
            }
        }
        Ok(stats)
    }

    /// Writes the residuals of `rows` rows of `block` from `offset` on:
    /// `self.exact` as written minus `self.read` as the upper plane reads.
    fn put_residuals(&mut self, block: usize, offset: usize, rows: usize) -> Result<()> {
        let ch = self.channels();
        for i in 0..rows {
            let span = i * ch..(i + 1) * ch;
            for (x, r) in self.exact[span.clone()].iter_mut().zip(&self.read[span]) {
                *x -= r;
            }
            let residual = &self.exact[i * ch..(i + 1) * ch];
            self.residual_encoder
                .encode_into(residual, self.residual_row.as_mut(), clamped())?;
            self.residual
                .put_row(block, offset + i, &self.residual_row)?;
        }
        Ok(())
    }

    /// Codes the residuals of a block the upper plane has just sealed
    /// (its exact rows in `self.exact`).
    fn seal_residual(&mut self, block: usize, first: usize) -> Result<()> {
        let (bs, ch) = (self.block_size(), self.channels());
        self.upper
            .read_rows(block, 0, &mut self.read[..bs * ch], &mut self.decode)?;
        // A fresh stage: the residual plane's rows of a staged block were
        // never written (nor faulted) since its last seal.
        self.residual.open_block(block)?;
        self.put_residuals(block, 0, bs)?;
        self.residual.seal(block, first)?;
        Ok(())
    }

    /// Stages a sealed `block` of a staged upper plane again from its full
    /// reading (a sequence cut back into it and writing again), so the
    /// rows kept keep the residual's precision.
    fn restage(&mut self, block: usize) -> Result<()> {
        let (bs, ch) = (self.block_size(), self.channels());
        let mut full = vec![0.0; bs * ch];
        let mut tmp = Vec::new();
        let mut scratch = DecodeScratch::new();
        self.read_full(block, 0, &mut full, &mut tmp, &mut scratch)?;
        for (i, row) in full.chunks_exact(ch).enumerate() {
            self.upper_encoder
                .encode_into(row, self.upper_row.as_mut(), clamped())?;
            self.upper.put_row(block, i, &self.upper_row)?;
        }
        Ok(())
    }

    /// Splits a [`snapshot`](StoredPart::snapshot) into the planes'.
    fn split(data: &PartBlock) -> Option<(PartBlock, PartBlock)> {
        let n = data.planes?;
        let stores = data.stores();
        (n <= stores.len()).then(|| {
            (
                PartBlock::of_stores(stores[..n].to_vec()),
                PartBlock::of_stores(stores[n..].to_vec()),
            )
        })
    }
}

impl StoredPart for HierarchicalPart {
    fn form(&self) -> CacheForm {
        self.form
    }

    fn channels(&self) -> usize {
        self.upper.channels()
    }

    fn block_size(&self) -> usize {
        self.upper.block_size()
    }

    fn tile_unit(&self) -> usize {
        match self.view {
            ReadView::Draft => self.upper.tile_unit(),
            ReadView::Full => self.block_size(),
        }
    }

    fn num_blocks(&self) -> usize {
        self.upper.num_blocks()
    }

    fn written_form(&self) -> CacheForm {
        self.written
    }

    /// Opens the upper plane's block, and the residual's where it is
    /// written in place: a staged residual plane is staged only while its
    /// block seals, so a block's exact rows are held once.
    fn open_block(&mut self, block: usize) -> Result<()> {
        self.upper.open_block(block)?;
        if !self.residual.plan().staged {
            self.residual.open_block(block)?;
        }
        Ok(())
    }

    fn put_row(&mut self, block: usize, offset: usize, row: &RowBuffers) -> Result<()> {
        if self.upper.plan().staged {
            if self.coded(block) {
                self.restage(block)?;
            }
            return self.upper.put_row(block, offset, row);
        }
        let ch = self.channels();
        if row.data.len() != 4 * ch || offset >= self.block_size() {
            return Err(AttentionError::InvalidParameter {
                name: "row",
                reason: format!(
                    "{} bytes at slot {offset}: one f32 row of {ch} channels in a block of {}",
                    row.data.len(),
                    self.block_size()
                ),
            });
        }
        for (x, b) in self.exact.iter_mut().zip(row.data.chunks_exact(4)) {
            *x = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        }
        clamp_non_finite(&mut self.exact[..ch]);
        self.upper_encoder
            .encode_into(&self.exact[..ch], self.upper_row.as_mut(), clamped())?;
        self.upper.put_row(block, offset, &self.upper_row)?;
        self.upper
            .read_rows(block, offset, &mut self.read[..ch], &mut self.decode)?;
        self.put_residuals(block, offset, 1)
    }

    fn sealable(&self, before: usize, after: usize) -> Range<usize> {
        self.upper.sealable(before, after)
    }

    /// Seals the upper plane's block, then codes its residuals: the rows
    /// as staged minus the rows as sealed. Where the residual fails, the
    /// upper plane's block is put back as it was (staged), so a failure
    /// leaves the block as it was.
    fn seal(&mut self, block: usize, first: usize) -> Result<bool> {
        if !self.upper.is_staged(block) {
            return Ok(false);
        }
        let (bs, ch) = (self.block_size(), self.channels());
        self.upper
            .read_rows(block, 0, &mut self.exact[..bs * ch], &mut self.decode)?;
        let staged = self.upper.snapshot(block)?;
        if !self.upper.seal(block, first)? {
            return Ok(false);
        }
        let residual = self.seal_residual(block, first);
        if residual.is_err() {
            self.upper.restore(block, &staged)?;
        }
        residual.map(|()| true)
    }

    fn is_staged(&self, block: usize) -> bool {
        self.upper.is_staged(block)
    }

    fn staged_blocks(&self) -> usize {
        self.upper.staged_blocks()
    }

    fn read_rows(
        &self,
        block: usize,
        offset: usize,
        out: &mut [f32],
        scratch: &mut DecodeScratch,
    ) -> Result<KvDecodeStats> {
        match self.view {
            ReadView::Draft => self.upper.read_rows(block, offset, out, scratch),
            ReadView::Full => self.read_full(block, offset, out, &mut Vec::new(), scratch),
        }
    }

    fn read_tile<'s>(
        &'s self,
        pages: &[u32],
        start: usize,
        count: usize,
        scratch: &'s mut PartScratch,
    ) -> Result<Tile<'s>> {
        if self.view == ReadView::Draft {
            return self.upper.read_tile(pages, start, count, scratch);
        }
        let PartScratch {
            rows,
            coeffs,
            decode,
            ..
        } = scratch;
        let layout = (pages, self.block_size(), self.channels());
        decode_pages(rows, layout, start, count, |page, offset, out| {
            self.read_full(page, offset, out, coeffs, decode)
        })
    }

    fn row_bytes(&self) -> usize {
        match self.view {
            ReadView::Draft => self.upper.row_bytes(),
            ReadView::Full => self.upper.row_bytes() + self.residual.row_bytes(),
        }
    }

    fn gathers_blocks(&self) -> bool {
        self.view == ReadView::Draft && self.upper.gathers_blocks()
    }

    fn row_address_ranges(
        &self,
        pages: &[u32],
        start: usize,
        count: usize,
        each: &mut dyn FnMut(Range<usize>),
    ) {
        self.upper.row_address_ranges(pages, start, count, each);
        if self.view == ReadView::Full {
            self.residual.row_address_ranges(pages, start, count, each);
        }
    }

    fn row_addresses(&self, pages: &[u32], start: usize, count: usize) -> Option<Range<usize>> {
        match self.view {
            ReadView::Draft => self.upper.row_addresses(pages, start, count),
            ReadView::Full => None,
        }
    }

    fn snapshot(&self, block: usize) -> Result<PartBlock> {
        let (upper, residual) = (self.upper.snapshot(block)?, self.residual.snapshot(block)?);
        let planes = upper.stores().len();
        let mut stores = upper.stores;
        stores.extend(residual.stores);
        Ok(PartBlock {
            planes: Some(planes),
            ..PartBlock::of_stores(stores)
        })
    }

    fn accepts(&self, data: &PartBlock) -> bool {
        Self::split(data).is_some_and(|(u, r)| self.upper.accepts(&u) && self.residual.accepts(&r))
    }

    fn restore(&mut self, block: usize, data: &PartBlock) -> Result<()> {
        match Self::split(data) {
            Some((u, r)) if self.upper.accepts(&u) && self.residual.accepts(&r) => {
                self.upper.restore(block, &u)?;
                self.residual.restore(block, &r)
            }
            _ => Err(AttentionError::InvalidParameter {
                name: "block data",
                reason: format!(
                    "it does not hold the two planes of a block of {} rows of {} channels in {}",
                    self.block_size(),
                    self.channels(),
                    self.form
                ),
            }),
        }
    }

    /// Scrubs the upper plane's block, and the residual's where the block
    /// is coded (a staged block's residual rows are not read).
    fn scrub(&mut self, block: usize) -> Result<ScrubStats> {
        let mut stats = self.upper.scrub(block)?;
        if self.coded(block) {
            stats += self.residual.scrub(block)?;
        }
        Ok(stats)
    }

    /// Faults both planes of a coded block, the residual's from a stream
    /// of its own (a staged block: its exact rows only, its residual rows
    /// being unread); flip positions of the residual plane follow the
    /// upper plane's (each buffer's positions past `8 ×` the upper plane's
    /// bytes of the block).
    fn inject(
        &mut self,
        block: usize,
        channel: &dyn FaultChannel,
        seed: u64,
        target: FaultTarget,
    ) -> Result<Injection> {
        let past = 8 * self.upper.block_bytes(block) as u64;
        let upper = self.upper.inject(block, channel, seed, target)?;
        if !self.coded(block) {
            return Ok(upper);
        }
        let residual = self
            .residual
            .inject(block, channel, seed ^ RESIDUAL_SALT, target)?;
        let join = |a: &Flips, b: &Flips| {
            let mut events = a.positions().to_vec();
            events.extend(b.positions().iter().map(|p| p + past));
            Flips::from_events(events)
        };
        Ok(Injection {
            values: join(&upper.values, &residual.values),
            scales: join(&upper.scales, &residual.scales),
            offsets: join(&upper.offsets, &residual.offsets),
            checks: join(&upper.checks, &residual.checks),
            exact: join(&upper.exact, &residual.exact),
            tables: join(&upper.tables, &residual.tables),
        })
    }

    fn block_bytes(&self, block: usize) -> usize {
        self.upper.block_bytes(block) + self.residual.block_bytes(block)
    }

    fn sealed_block_bytes(&self) -> usize {
        self.upper.sealed_block_bytes() + self.residual.sealed_block_bytes()
    }

    fn set_view(&mut self, view: ReadView) -> Result<()> {
        self.view = view;
        Ok(())
    }
}
