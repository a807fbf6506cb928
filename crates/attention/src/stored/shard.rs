//! [`ShardPart`]: the calibrated Shard forms (`shard-*-cal`,
//! `shard-kv-compression-blog.md`) as a [`StoredPart`]: keys on a basis
//! and bit allocation fitted offline with RoPE undone, values on a
//! codebook fitted offline (or NF4 after a Hadamard rotation, `-vnf4`), the
//! sink and the recent window exact.
//!
//! A block's rows are staged exact (f16) until the step that takes its
//! last row out of the window commits; sealing codes the block on the
//! calibrated tables (kv-lowrank's `ShardKeys::encode_chunk` after RoPE is
//! undone at the block's positions, kv-quant's `ChannelVq::encode_chunk`
//! or NF4), each block with scales of its own, as the blog folds a chunk
//! of generated tokens into the compressed middle. Blocks holding sink
//! tokens are never sealed, and the window is the last `W` rows rounded
//! out to whole blocks (exact while staged), so rolling a step back only
//! drops staged rows. The tables are loaded once per model and shared by
//! every block, so sealed blocks are hashable and shareable like any
//! other; a page is read by rebuilding its rows (keys rotated back to
//! their positions).
//!
//! Differences from the re-encode protocol's `ShardLayer`, by design: the
//! basis, bit allocation and codebook are the calibration's (not fitted on
//! the prefill), every block beyond the sink and window is compressed
//! (prefill and generated tokens alike: no Lloyd-Max decode stream), the
//! per-component scales are per block, and tiles are rebuilt rows rather
//! than scores taken in coefficient space. Not yet: coded spellings
//! (`shard+secded84`), the per-sequence forms (`shard-k3`: bases fitted on
//! each prefill), and faults in the scales and the tables.

use std::ops::Range;
use std::sync::Arc;

use gf2_codes::channel::FaultChannel;
use kv_lowrank::ShardKeys;
use kv_quant::{
    CacheForm, ChannelVq, DecodeScratch, FaultTarget, Hadamard, Injection, KvDecodeStats,
    KvQuantError, KvStore, Quantizer, RowBuffers, ScrubStats,
};

use super::{PartBlock, PartScratch, PoolBytes, StoredPart};
use crate::error::{AttentionError, Result};
use crate::rope::Rope;
use crate::source::{Tile, TileRows};

/// The calibrated tables one part of a Shard form reads (`kv-eval
/// calibrate` fits them on its text, per layer).
#[derive(Clone, Debug)]
pub enum ShardTables {
    /// Keys: a store fitted on the calibration keys (RoPE undone), whose
    /// basis and bit allocation every block is coded on, and the model's
    /// RoPE.
    Keys {
        /// The fitted store (its basis, allocation and groups are read).
        prototype: Arc<ShardKeys>,
        /// The rotation the keys are stored with.
        rope: Rope,
    },
    /// Values: the codebook fitted on the calibration values (`None` for
    /// NF4 values, which need no table).
    Values {
        /// The fitted store (its codebook is read).
        prototype: Option<Arc<ChannelVq>>,
        /// Channels per head (the Hadamard rotation of the values).
        head_dim: usize,
    },
}

/// One sealed block of a [`ShardPart`], as snapshots carry it.
#[derive(Clone, Debug, PartialEq)]
pub enum ShardBlock {
    /// Keys on the calibrated basis; `first` is the position of its first
    /// row (RoPE is applied again at read).
    Keys {
        /// The coded keys (RoPE undone).
        keys: Box<ShardKeys>,
        /// Position of the block's first row.
        first: usize,
    },
    /// Values on the calibrated codebook.
    Vq(ChannelVq),
    /// Values in NF4 after a Hadamard rotation (`-vnf4`).
    Nf4(Box<KvStore>),
}

impl ShardBlock {
    /// Bytes the block holds (the shared tables not counted).
    pub fn stored_bytes(&self) -> usize {
        match self {
            Self::Keys { keys, .. } => keys.stored_bytes() - keys.shared_bytes(),
            Self::Vq(v) => v.stored_bytes() - v.shared_bytes(),
            Self::Nf4(s) => s.stored_bytes(),
        }
    }
}

/// One block of a [`ShardPart`].
#[derive(Clone, Debug)]
enum Block {
    /// Never opened: reads as zeros.
    Empty,
    /// Rows written exact, not sealed yet.
    Staged(Box<KvStore>),
    /// Rows coded on the calibrated tables.
    Sealed(ShardBlock),
}

/// A calibrated Shard form kept in blocks (see the module docs).
#[derive(Debug)]
pub struct ShardPart {
    form: CacheForm,
    exact: CacheForm,
    tables: ShardTables,
    channels: usize,
    block_size: usize,
    /// Blocks holding sink tokens (never sealed).
    sink_blocks: usize,
    /// Rows kept exact at the end of the sequence.
    window: usize,
    blocks: Vec<Block>,
    spare: Vec<KvStore>,
    /// Bytes of one sealed block.
    sealed_bytes: usize,
}

impl ShardPart {
    /// Zeroed blocks of the calibrated Shard `form` reading `tables`.
    pub fn new(
        form: CacheForm,
        block_size: usize,
        channels: usize,
        num_blocks: usize,
        tables: ShardTables,
    ) -> Result<Self> {
        check_form(form, block_size)?;
        let mut part = Self {
            exact: form.exact_rows_form(),
            form,
            tables,
            channels,
            block_size,
            sink_blocks: form.segments().sink.div_ceil(block_size),
            window: form.segments().window,
            blocks: vec![Block::Empty; num_blocks],
            spare: Vec::new(),
            sealed_bytes: 0,
        };
        part.sealed_bytes = part
            .code(&vec![0.0; block_size * channels], 0)?
            .stored_bytes();
        Ok(part)
    }

    /// [`PoolBytes`] of [`new`](Self::new): every block counted at the
    /// larger of its exact and sealed bytes.
    pub fn pool_bytes(
        form: CacheForm,
        block_size: usize,
        channels: usize,
        num_blocks: usize,
        tables: &ShardTables,
    ) -> Result<PoolBytes> {
        let part = Self::new(form, block_size, channels, 0, tables.clone())?;
        let exact = KvStore::zeroed(form.exact_rows_form(), block_size, channels)?.stored_bytes();
        Ok(PoolBytes {
            blocks: (part.sealed_bytes.max(exact) as u64).saturating_mul(num_blocks as u64),
            building: 0,
        })
    }

    /// `rows` (one block, as written) coded on the tables; `first` is the
    /// position of the first row.
    fn code(&self, rows: &[f32], first: usize) -> Result<ShardBlock> {
        let bs = self.block_size;
        Ok(match &self.tables {
            ShardTables::Keys { prototype, rope } => {
                let mut unrotated = rows.to_vec();
                for (i, row) in unrotated.chunks_exact_mut(self.channels).enumerate() {
                    rope.undo(row, first + i)?;
                }
                ShardBlock::Keys {
                    keys: Box::new(prototype.encode_chunk(&unrotated, bs)?),
                    first,
                }
            }
            ShardTables::Values {
                prototype: Some(vq),
                ..
            } => ShardBlock::Vq(vq.encode_chunk(rows, bs)?),
            ShardTables::Values {
                prototype: None,
                head_dim,
            } => {
                let nf4 = crate::shard::nf4_form(*head_dim)?;
                ShardBlock::Nf4(Box::new(KvStore::quantize_with(
                    nf4,
                    rows,
                    bs,
                    self.channels,
                    super::clamped(),
                )?))
            }
        })
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
    fn fresh_exact(&mut self) -> Result<Box<KvStore>> {
        match self.spare.pop() {
            Some(s) => Ok(Box::new(s)),
            None => Ok(Box::new(KvStore::zeroed(
                self.exact,
                self.block_size,
                self.channels,
            )?)),
        }
    }

    /// Rows `offset..offset + out.len() / channels` of `block` as f32.
    fn decode(
        &self,
        block: usize,
        offset: usize,
        out: &mut [f32],
        scratch: &mut DecodeScratch,
    ) -> Result<KvDecodeStats> {
        let n = out.len() / self.channels;
        match self.block(block)? {
            Block::Empty => out.fill(0.0),
            Block::Staged(exact) => {
                scratch.limit_neighbours(None);
                return Ok(exact.decode_rows_into(offset, n, out, scratch)?);
            }
            Block::Sealed(ShardBlock::Keys { keys, first }) => {
                let ShardTables::Keys { rope, .. } = &self.tables else {
                    unreachable!("a key part holds key blocks");
                };
                for (i, row) in out.chunks_exact_mut(self.channels).enumerate() {
                    keys.reconstruct_into(offset + i, row)?;
                    rope.apply(row, first + offset + i)?;
                }
            }
            Block::Sealed(ShardBlock::Vq(values)) => values.decode_rows_into(offset, n, out)?,
            Block::Sealed(ShardBlock::Nf4(store)) => {
                scratch.limit_neighbours(None);
                return Ok(store.decode_rows_into(offset, n, out, scratch)?);
            }
        }
        Ok(KvDecodeStats::default())
    }
}

/// Refuses what this part cannot hold.
fn check_form(form: CacheForm, block_size: usize) -> Result<()> {
    let refuse = |reason: &str| {
        Err(AttentionError::Store(KvQuantError::InvalidSpec {
            spec: form.to_string(),
            reason: reason.into(),
        }))
    };
    let Quantizer::Shard(spec) = form.quantizer() else {
        return refuse("is not a shard form");
    };
    if !spec.calibrated {
        return refuse(
            "fits its key basis and value codebook on each prefill, tables paged blocks do not \
             carry per sequence yet: use its calibrated twin (`-cal`) or --backend reencode",
        );
    }
    if form.protection().is_some() {
        return refuse(
            "is coded, which paged Shard blocks do not protect yet (use --backend reencode)",
        );
    }
    if spec.fold.is_some() {
        return refuse(
            "folds chunks of its decode stream; on paged blocks every block is folded as it leaves the window (drop -f)",
        );
    }
    if block_size < 4 {
        return refuse("needs blocks of at least 4 tokens");
    }
    Ok(())
}

/// Whether blocks of `block_size` tokens can hold the Shard `form`.
pub(crate) fn check_shard_form(form: CacheForm, block_size: usize) -> Result<()> {
    check_form(form, block_size)
}

impl StoredPart for ShardPart {
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
        match &self.tables {
            ShardTables::Keys { prototype, .. } => prototype.shared_bytes(),
            ShardTables::Values { prototype, .. } => {
                prototype.as_ref().map_or(0, |v| v.shared_bytes())
            }
        }
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
        if matches!(self.blocks[block], Block::Sealed(_)) {
            // A sequence cut back into a sealed block: stage it again from
            // the rows it reads as.
            let mut rows = vec![0.0; self.block_size * self.channels];
            self.decode(block, 0, &mut rows, &mut DecodeScratch::new())?;
            let decoded = KvStore::quantize_with(
                self.exact,
                &rows,
                self.block_size,
                self.channels,
                super::clamped(),
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
        // Blocks whose rows have all left the window, past the sink.
        let out =
            |n: usize| (n.saturating_sub(self.window) / self.block_size).max(self.sink_blocks);
        let first = out(before);
        first..out(after).max(first)
    }

    fn seal(&mut self, block: usize, first: usize) -> Result<bool> {
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
        let sealed = self.code(&rows, first)?;
        if let Block::Staged(exact) =
            std::mem::replace(&mut self.blocks[block], Block::Sealed(sealed))
        {
            self.spare.push(*exact);
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
        let tile = super::decode_pages(rows, layout, start, count, |page, offset, out| {
            self.decode(page, offset, out, decode)
        })?;
        debug_assert!(matches!(tile.rows, TileRows::F32(_)));
        Ok(tile)
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
            Block::Staged(exact) => PartBlock::of_stores(vec![(**exact).clone()]),
            Block::Sealed(sealed) => PartBlock::of_shard(sealed.clone()),
        })
    }

    fn accepts(&self, data: &PartBlock) -> bool {
        let shape = |s: &KvStore| {
            *s.form() == self.exact
                && s.tokens() == self.block_size
                && s.channels() == self.channels
        };
        let sealed = |b: &ShardBlock| match (b, &self.tables) {
            (ShardBlock::Keys { keys, .. }, ShardTables::Keys { prototype, .. }) => {
                keys.tokens() == self.block_size
                    && keys.dim() == self.channels
                    && keys.basis() == prototype.basis()
                    && keys.allocation() == prototype.allocation()
            }
            (
                ShardBlock::Vq(v),
                ShardTables::Values {
                    prototype: Some(p), ..
                },
            ) => {
                v.tokens() == self.block_size
                    && v.channels() == self.channels
                    && v.centroids() == p.centroids()
            }
            (
                ShardBlock::Nf4(s),
                ShardTables::Values {
                    prototype: None, ..
                },
            ) => s.tokens() == self.block_size && s.channels() == self.channels,
            _ => false,
        };
        match (
            data.stores(),
            data.shard(),
            data.low_rank(),
            data.bytes().is_empty(),
        ) {
            ([], None, None, true) => true,
            ([exact], None, None, true) => shape(exact),
            ([], Some(b), None, true) => sealed(b),
            _ => false,
        }
    }

    fn restore(&mut self, block: usize, data: &PartBlock) -> Result<()> {
        self.block(block)?;
        if !self.accepts(data) {
            return Err(AttentionError::InvalidParameter {
                name: "block data",
                reason: format!(
                    "it does not hold a block of {} rows of {} channels in {} on this part's tables",
                    self.block_size, self.channels, self.form
                ),
            });
        }
        let new = match (data.stores(), data.shard()) {
            ([exact], _) => {
                let mut s = self.fresh_exact()?;
                s.copy_rows_from(0, exact)?;
                Block::Staged(s)
            }
            (_, Some(sealed)) => Block::Sealed(sealed.clone()),
            _ => Block::Empty,
        };
        if let Block::Staged(old) = std::mem::replace(&mut self.blocks[block], new) {
            self.spare.push(*old);
        }
        Ok(())
    }

    fn scrub(&mut self, block: usize) -> Result<ScrubStats> {
        self.block(block)?;
        Ok(match &mut self.blocks[block] {
            Block::Staged(exact) => exact.scrub()?,
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
        let codes = target != FaultTarget::Metadata;
        Ok(match &mut self.blocks[block] {
            Block::Empty => Injection::default(),
            Block::Staged(exact) => exact.inject_rows(0..bs, channel, seed, target)?,
            // The codes and indices (the bulk of a sealed block); the
            // per-block scales are not exposed yet.
            Block::Sealed(ShardBlock::Keys { keys, .. }) if codes => Injection {
                values: channel.inject(keys.codes_mut(), seed),
                ..Injection::default()
            },
            Block::Sealed(ShardBlock::Vq(values)) if codes => Injection {
                values: channel.inject(values.indices_mut(), seed),
                ..Injection::default()
            },
            Block::Sealed(ShardBlock::Nf4(store)) => {
                store.inject_rows(0..bs, channel, seed, target)?
            }
            Block::Sealed(_) => Injection::default(),
        })
    }

    fn block_bytes(&self, block: usize) -> usize {
        match self.blocks.get(block) {
            Some(Block::Staged(exact)) => exact.stored_bytes(),
            Some(Block::Sealed(sealed)) => sealed.stored_bytes(),
            _ => self.sealed_bytes,
        }
    }

    fn sealed_block_bytes(&self) -> usize {
        self.sealed_bytes
    }
}
