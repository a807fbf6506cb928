//! [`LowRankPart`]: calibrated low-rank forms (`pca-r<R>`, `pca-e<E>`,
//! keys after RoPE and values) as a [`StoredPart`], on per-head bases
//! fitted offline (`kv-eval calibrate`), loaded once and shared by every
//! block.
//!
//! A block's rows are staged exact (f16 under the form's protection, like
//! a per-channel block) until the step that fills it commits; sealing
//! projects them on the bases into one kv-lowrank [`LowRankStore`] of the
//! block (per-head coefficients, residual norms and row norms for the
//! certificates) and drops the exact rows. Each sealed block is its own
//! store, so a block is hashable and shareable like any other, and a page
//! is read by reconstructing its rows from the coefficients. The block
//! being written is exact, as KIVI keeps its residual.
//!
//! Not yet: keys projected before RoPE (`-pre`: their rows would need
//! their positions), online bases (`fd-*`, fitted per sequence), exact
//! segments on low-rank forms, and attention in coefficient space over
//! pages (tiles are reconstructed rows).

use std::ops::Range;
use std::sync::Arc;

use gf2_codes::channel::{FaultChannel, Flips};
use kv_lowrank::{HeadBases, LowRankStore};
use kv_quant::{
    CacheForm, DecodeScratch, FaultTarget, Hadamard, Injection, KvDecodeStats, KvStore, RowBuffers,
    ScrubStats,
};

use super::{PartBlock, PartScratch, PoolBytes, SharedTable, StoredPart, clamped};
use crate::error::{AttentionError, Result};
use crate::source::Tile;

/// One block of a [`LowRankPart`].
#[derive(Clone, Debug)]
enum Block {
    /// Never opened: reads as zeros.
    Empty,
    /// Rows written exact, not sealed yet.
    Staged(KvStore),
    /// Rows projected on the bases.
    Sealed(LowRankStore),
}

/// A calibrated low-rank form kept in blocks (see the module docs).
#[derive(Debug)]
pub struct LowRankPart {
    form: CacheForm,
    exact: CacheForm,
    /// The calibrated bases, shared by every block, as stored, protected
    /// bytes; sealed blocks read them as last decoded.
    bases: SharedTable<HeadBases>,
    head_dim: usize,
    channels: usize,
    block_size: usize,
    blocks: Vec<Block>,
    spare: Vec<KvStore>,
    /// Bytes of one sealed block (the same for every block of a form).
    sealed_bytes: usize,
}

impl LowRankPart {
    /// Zeroed blocks of the calibrated low-rank `form` on `bases`.
    pub fn new(
        form: CacheForm,
        block_size: usize,
        channels: usize,
        num_blocks: usize,
        bases: Arc<HeadBases>,
    ) -> Result<Self> {
        let head_dim = check_form(form, &bases, block_size, channels)?;
        let zeros = vec![0.0; block_size * channels];
        let sealed_bytes =
            LowRankStore::build(form, &zeros, block_size, channels, head_dim, Some(&bases))?
                .stored_bytes();
        Ok(Self {
            exact: form.exact_rows_form(),
            bases: SharedTable::new(bases, &form),
            form,
            head_dim,
            channels,
            block_size,
            blocks: vec![Block::Empty; num_blocks],
            spare: Vec::new(),
            sealed_bytes,
        })
    }

    /// [`PoolBytes`] of [`new`](Self::new): every block counted at the
    /// larger of its exact and sealed bytes (blocks are made as they are
    /// written, and a block may stay exact while it is written).
    pub fn pool_bytes(
        form: CacheForm,
        block_size: usize,
        channels: usize,
        num_blocks: usize,
        bases: &HeadBases,
    ) -> Result<PoolBytes> {
        let head_dim = check_form(form, bases, block_size, channels)?;
        let zeros = vec![0.0; block_size * channels];
        let sealed =
            LowRankStore::build(form, &zeros, block_size, channels, head_dim, Some(bases))?
                .stored_bytes();
        let exact = KvStore::zeroed(form.exact_rows_form(), block_size, channels)?.stored_bytes();
        Ok(PoolBytes {
            blocks: (sealed.max(exact) as u64).saturating_mul(num_blocks as u64),
            building: 0,
        })
    }

    /// Every sealed block reads the bases as last decoded.
    fn reread_bases(&mut self) -> Result<()> {
        let bases = self.bases.read().clone();
        for block in &mut self.blocks {
            if let Block::Sealed(store) = block {
                store.replace_bases(&bases)?;
            }
        }
        Ok(())
    }

    fn block(&self, block: usize) -> Result<&Block> {
        self.blocks
            .get(block)
            .ok_or_else(|| AttentionError::InvalidParameter {
                name: "block",
                reason: format!("block {block} of {}", self.blocks.len()),
            })
    }

    /// An exact store for a block: a spare one, or a new one.
    fn fresh_exact(&mut self) -> Result<KvStore> {
        match self.spare.pop() {
            Some(s) => Ok(s),
            None => Ok(KvStore::zeroed(self.exact, self.block_size, self.channels)?),
        }
    }

    /// Rows `offset..offset + out.len() / channels` of `block` as f32.
    fn decode(
        &self,
        block: usize,
        offset: usize,
        out: &mut [f32],
        scratch: &mut DecodeScratch,
        low_rank: &mut kv_lowrank::StoreScratch,
    ) -> Result<KvDecodeStats> {
        let n = out.len() / self.channels;
        Ok(match self.block(block)? {
            Block::Empty => {
                out.fill(0.0);
                KvDecodeStats::default()
            }
            Block::Staged(exact) => {
                scratch.limit_neighbours(None);
                exact.decode_rows_into(offset, n, out, scratch)?
            }
            Block::Sealed(store) => store.decode_rows_into(offset, n, out, low_rank)?,
        })
    }
}

/// Refuses what this part cannot hold; the head dimension of `bases`.
fn check_form(
    form: CacheForm,
    bases: &HeadBases,
    block_size: usize,
    channels: usize,
) -> Result<usize> {
    super::check_part_form(form, block_size)?;
    let head_dim = bases.heads.first().map_or(0, |b| b.dim());
    if head_dim == 0 || bases.heads.len() * head_dim != channels {
        return Err(AttentionError::InvalidParameter {
            name: "bases",
            reason: format!(
                "{} bases of {head_dim} channels do not cover rows of {channels}",
                bases.heads.len()
            ),
        });
    }
    Ok(head_dim)
}

impl StoredPart for LowRankPart {
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
        self.exact
    }

    fn shared_bytes(&self) -> usize {
        self.bases.stored_bytes()
    }

    fn inject_shared(
        &mut self,
        channel: &dyn FaultChannel,
        seed: u64,
        target: FaultTarget,
    ) -> Result<Injection> {
        let (injection, changed) = self.bases.inject(channel, seed, target)?;
        if changed {
            self.reread_bases()?;
        }
        Ok(injection)
    }

    fn shared_stats(&self) -> gf2_codes::DecodeStats {
        self.bases.stats()
    }

    fn scrub_shared(&mut self) -> Result<gf2_codes::DecodeStats> {
        Ok(self.bases.scrub())
    }

    fn open_block(&mut self, block: usize) -> Result<()> {
        self.block(block)?;
        if !matches!(self.blocks[block], Block::Staged(_)) {
            let exact = self.fresh_exact()?;
            self.blocks[block] = Block::Staged(exact);
        }
        Ok(())
    }

    fn put_row(&mut self, block: usize, offset: usize, row: &RowBuffers) -> Result<()> {
        self.block(block)?;
        if offset >= self.block_size {
            return Err(AttentionError::InvalidParameter {
                name: "offset",
                reason: format!("slot {offset} of a block of {}", self.block_size),
            });
        }
        if let Block::Sealed(store) = &self.blocks[block] {
            // A sequence cut back into a sealed block: stage it again from
            // the rows its coefficients give.
            let mut rows = vec![0.0; self.block_size * self.channels];
            store.decode_rows_into(
                0,
                self.block_size,
                &mut rows,
                &mut kv_lowrank::StoreScratch::default(),
            )?;
            let decoded = KvStore::quantize_with(
                self.exact,
                &rows,
                self.block_size,
                self.channels,
                clamped(),
            )?;
            let mut exact = self.fresh_exact()?;
            exact.copy_rows_from(0, &decoded)?;
            self.blocks[block] = Block::Staged(exact);
        }
        if matches!(self.blocks[block], Block::Empty) {
            self.open_block(block)?;
        }
        let Block::Staged(exact) = &mut self.blocks[block] else {
            unreachable!("staged above");
        };
        exact.put_encoded_rows(offset, row)?;
        Ok(())
    }

    fn sealable(&self, before: usize, after: usize) -> Range<usize> {
        let first = before / self.block_size;
        first..(after / self.block_size).max(first)
    }

    fn seal(&mut self, block: usize, _first: usize) -> Result<bool> {
        let Block::Staged(exact) = self.block(block)? else {
            return Ok(false);
        };
        let mut rows = vec![0.0; self.block_size * self.channels];
        exact.decode_rows_into(0, self.block_size, &mut rows, &mut DecodeScratch::new())?;
        // A fault that made an exact value non-finite is clamped, as
        // sealing a per-channel block clamps it: measured, not fatal.
        for x in &mut rows {
            if !x.is_finite() {
                *x = if x.is_nan() {
                    0.0
                } else {
                    x.signum() * f32::MAX
                };
            }
        }
        let store = LowRankStore::build(
            self.form,
            &rows,
            self.block_size,
            self.channels,
            self.head_dim,
            Some(self.bases.read()),
        )?;
        if let Block::Staged(exact) =
            std::mem::replace(&mut self.blocks[block], Block::Sealed(store))
        {
            self.spare.push(exact);
        }
        Ok(true)
    }

    fn is_staged(&self, block: usize) -> bool {
        matches!(self.blocks.get(block), Some(Block::Staged(_)))
    }

    fn staged_blocks(&self) -> usize {
        self.blocks
            .iter()
            .filter(|b| matches!(b, Block::Staged(_)))
            .count()
    }

    fn read_rows(
        &self,
        block: usize,
        offset: usize,
        out: &mut [f32],
        scratch: &mut DecodeScratch,
    ) -> Result<KvDecodeStats> {
        if offset + out.len() / self.channels > self.block_size {
            return Err(AttentionError::InvalidParameter {
                name: "rows",
                reason: format!("rows past a block of {}", self.block_size),
            });
        }
        let mut low_rank = kv_lowrank::StoreScratch::default();
        self.decode(block, offset, out, scratch, &mut low_rank)
    }

    fn read_tile<'s>(
        &'s self,
        pages: &[u32],
        start: usize,
        count: usize,
        scratch: &'s mut PartScratch,
    ) -> Result<Tile<'s>> {
        let PartScratch {
            rows,
            decode,
            low_rank,
            ..
        } = scratch;
        let layout = (pages, self.block_size, self.channels);
        super::decode_pages(rows, layout, start, count, |page, offset, out| {
            self.decode(page, offset, out, decode, low_rank)
        })
    }

    fn row_bytes(&self) -> usize {
        self.sealed_bytes.div_ceil(self.block_size)
    }

    fn gathers_blocks(&self) -> bool {
        false
    }

    fn rotation(&self) -> Option<&'static Hadamard> {
        None
    }

    fn snapshot(&self, block: usize) -> Result<PartBlock> {
        Ok(match self.block(block)? {
            Block::Empty => PartBlock::default(),
            Block::Staged(exact) => PartBlock::of_stores(vec![exact.clone()]),
            Block::Sealed(store) => PartBlock::of_low_rank(store.clone()),
        })
    }

    fn accepts(&self, data: &PartBlock) -> bool {
        let shape = |s: &KvStore| {
            *s.form() == self.exact
                && s.tokens() == self.block_size
                && s.channels() == self.channels
        };
        match (data.stores(), data.low_rank(), data.bytes().is_empty()) {
            ([], None, true) => true,
            ([exact], None, true) => shape(exact),
            ([], Some(lr), true) => {
                *lr.form() == self.form
                    && lr.tokens() == self.block_size
                    && lr.channels() == self.channels
            }
            _ => false,
        }
    }

    fn restore(&mut self, block: usize, data: &PartBlock) -> Result<()> {
        self.block(block)?;
        if !self.accepts(data) {
            return Err(AttentionError::InvalidParameter {
                name: "block data",
                reason: format!(
                    "it does not hold a block of {} rows of {} channels in {}",
                    self.block_size, self.channels, self.form
                ),
            });
        }
        let new = match (data.stores(), data.low_rank()) {
            ([exact], _) => {
                let mut s = self.fresh_exact()?;
                s.copy_rows_from(0, exact)?;
                Block::Staged(s)
            }
            (_, Some(lr)) => {
                // Projected on the bases as fitted; read through this
                // part's bases as they are now.
                let mut lr = lr.clone();
                lr.replace_bases(self.bases.read())?;
                Block::Sealed(lr)
            }
            _ => Block::Empty,
        };
        if let Block::Staged(old) = std::mem::replace(&mut self.blocks[block], new) {
            self.spare.push(old);
        }
        Ok(())
    }

    fn scrub(&mut self, block: usize) -> Result<ScrubStats> {
        self.block(block)?;
        Ok(match &mut self.blocks[block] {
            Block::Staged(exact) => exact.scrub()?,
            // The coefficient stores of a sealed block are read (and their
            // words corrected on every read) but not rewritten here yet.
            Block::Sealed(_) | Block::Empty => ScrubStats::default(),
        })
    }

    fn inject(
        &mut self,
        block: usize,
        channel: &dyn FaultChannel,
        seed: u64,
        target: FaultTarget,
    ) -> Result<Injection> {
        self.block(block)?;
        let bs = self.block_size;
        Ok(match &mut self.blocks[block] {
            Block::Empty => Injection::default(),
            Block::Staged(exact) => exact.inject_rows(0..bs, channel, seed, target)?,
            Block::Sealed(store) => {
                // One injection per head's coefficient store, their flip
                // positions laid end to end in bits (each head's buffers
                // after the previous head's bytes).
                let sizes: Vec<u64> = (0..store.heads())
                    .map(|h| 8 * store.coefficients(h).stored_bytes() as u64)
                    .collect();
                let mut merged: [Vec<u64>; 5] = Default::default();
                let mut base = 0u64;
                for (i, size) in store.inject(channel, seed, target).iter().zip(sizes) {
                    for (m, flips) in merged
                        .iter_mut()
                        .zip([&i.values, &i.scales, &i.offsets, &i.checks, &i.exact])
                    {
                        m.extend(flips.positions().iter().map(|p| p + base));
                    }
                    base += size;
                }
                let [values, scales, offsets, checks, exact] = merged.map(Flips::from_events);
                Injection {
                    values,
                    scales,
                    offsets,
                    checks,
                    exact,
                    tables: Flips::default(),
                }
            }
        })
    }

    fn block_bytes(&self, block: usize) -> usize {
        match self.blocks.get(block) {
            Some(Block::Staged(exact)) => exact.stored_bytes(),
            Some(Block::Sealed(store)) => store.stored_bytes(),
            _ => self.sealed_bytes,
        }
    }

    fn sealed_block_bytes(&self) -> usize {
        self.sealed_bytes
    }
}
