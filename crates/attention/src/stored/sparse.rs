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
//! Sink tokens (`+sink<S>`) are kept exact inside the block that holds
//! them: a block of a sequence's first S tokens alone stays staged (exact),
//! and the block holding the S-th token seals with its leading sink rows
//! exact beside the coded rest (`SparseStore::quantize_with_exact`), where
//! [`PlannedPart`](super::PlannedPart) keeps the whole block exact (at
//! blocks of 64 and 2,048 tokens of context that is 0.42 bits per value
//! saved). Tiles are the decoded rows (f32): the outliers are patched into
//! each page's dense rows, so the integer kernels are not used here.
//!
//! With `+pre` (keys coded before RoPE, as KVQuant codes them) a block's
//! rows are rotated back to position 0 when it seals, from the position
//! of its first row, and rotated to their positions again when read
//! (`Rope::apply_rows`, one `sin_cos` per pair and page): the part needs
//! the model's RoPE ([`Fitted::rope`](super::Fitted)), and a sealed block
//! carries its first row's position ([`SparseBlock`]).

use std::ops::Range;

use gf2_codes::channel::FaultChannel;
use kv_quant::{
    CacheForm, DecodeScratch, FaultTarget, Granularity, Injection, KvDecodeStats, KvQuantError,
    KvStore, Quantizer, RowBuffers, ScrubStats, Segments, SparseStore,
};

use super::staging::{BlockState, StagedBlocks};
use super::{PartBlock, PartScratch, PoolBytes, StoredPart};
use crate::error::{AttentionError, Result};
use crate::rope::Rope;
use crate::source::Tile;

/// A sealed block of a [`SparsePart`]: its rows in a kv-quant
/// [`SparseStore`] and the position of its first row in its sequences
/// (the rotation a `+pre` block's rows get back when read).
#[derive(Clone, Debug, PartialEq)]
pub struct SparseBlock {
    /// The dense rows, the exact sink rows and the outliers.
    pub store: SparseStore,
    /// The position of the block's first row.
    pub first: usize,
}

/// An integer form with sparse outliers kept in blocks (module docs).
#[derive(Debug)]
pub struct SparsePart {
    form: CacheForm,
    /// The form of a sealed block: the form without its segments.
    sealed_form: CacheForm,
    channels: usize,
    block_size: usize,
    /// Sink tokens (`+sink<S>`): blocks of a sequence holding only sink
    /// tokens are never sealed; the block holding the last one seals with
    /// them exact.
    sink: usize,
    blocks: StagedBlocks<SparseBlock>,
    /// The model's RoPE, for keys coded before it (`+pre`).
    rope: Option<Rope>,
    /// Bytes of one sealed block (the same for every block of a form).
    sealed_bytes: usize,
}

impl SparsePart {
    /// Zeroed blocks of `form` (an integer form with `+out`), or why blocks
    /// of `block_size` rows of `channels` values cannot hold it (a `+pre`
    /// form needs the model's `rope`, whose heads divide the rows).
    pub fn new(
        form: CacheForm,
        block_size: usize,
        channels: usize,
        num_blocks: usize,
        rope: Option<Rope>,
    ) -> Result<Self> {
        let (sealed_form, sealed_bytes) = Self::check(form, block_size, channels)?;
        let pre_rope = form.sparse().is_some_and(|s| s.pre_rope());
        let rope = match (pre_rope, rope) {
            (false, _) => None,
            (true, None) => {
                return Err(AttentionError::InvalidParameter {
                    name: "form",
                    reason: format!(
                        "{form} codes keys before RoPE (+pre) and needs the model's RoPE: a \
                         key form of a model with RoPE (Fitted::rope)"
                    ),
                });
            }
            (true, Some(rope)) if !channels.is_multiple_of(rope.head_dim()) => {
                return Err(AttentionError::InvalidParameter {
                    name: "rope",
                    reason: format!(
                        "heads of {} channels do not divide rows of {channels}",
                        rope.head_dim()
                    ),
                });
            }
            (true, rope) => rope,
        };
        Ok(Self {
            rope,
            blocks: StagedBlocks::new(form.exact_rows_form(), block_size, channels, num_blocks),
            form,
            sealed_form,
            channels,
            block_size,
            sink: form.segments().sink,
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
        let (sealed_form, sealed) = Self::check(form, block_size, channels)?;
        let exact = KvStore::zeroed(form.exact_rows_form(), block_size, channels)?.stored_bytes();
        let sink = match form.segments().sink % block_size {
            0 => 0,
            rows => SparseStore::stored_bytes_of(sealed_form, block_size, channels, rows)?,
        };
        Ok(PoolBytes {
            blocks: (sealed.max(exact).max(sink) as u64).saturating_mul(num_blocks as u64),
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
        if form.sparse().is_none() {
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
        let bytes = SparseStore::stored_bytes_of(sealed_form, block_size, channels, 0)?;
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
        let BlockState::Sealed(sealed) = self.blocks.get(block)? else {
            unreachable!("read_unsealed reads the others");
        };
        Self::read_sealed(self.rope.as_ref(), sealed, offset, out, scratch)
    }

    /// Rows `offset..` of a sealed block into `out`, rotated to their
    /// positions where the block was coded before RoPE.
    fn read_sealed(
        rope: Option<&Rope>,
        sealed: &SparseBlock,
        offset: usize,
        out: &mut [f32],
        scratch: &mut DecodeScratch,
    ) -> Result<KvDecodeStats> {
        let channels = sealed.store.channels();
        // A block's own rows only: no limit another part's tile left.
        scratch.limit_neighbours(None);
        let stats = sealed
            .store
            .decode_rows_into(offset, out.len() / channels, out, scratch)?;
        if let Some(rope) = rope {
            // Exact sink rows were kept as written (after RoPE).
            let skip = sealed.store.exact_rows().saturating_sub(offset);
            let skip = skip.min(out.len() / channels);
            rope.apply_rows(
                &mut out[skip * channels..],
                channels,
                sealed.first + offset + skip,
            )?;
        }
        Ok(stats)
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
        // A sequence cut back into a sealed block: staged again from the
        // rows it reads as.
        let rope = self.rope.as_ref();
        self.blocks.put_row(block, offset, row, |sealed, rows| {
            Self::read_sealed(rope, sealed, 0, rows, &mut DecodeScratch::new())?;
            Ok(())
        })
    }

    fn sealable(&self, before: usize, after: usize) -> Range<usize> {
        let first = (before / self.block_size).max(self.sink / self.block_size);
        first..(after / self.block_size).max(first)
    }

    fn seal(&mut self, block: usize, first: usize) -> Result<bool> {
        let (form, bs, ch) = (self.sealed_form, self.block_size, self.channels);
        let exact = self.sink.saturating_sub(first);
        if exact >= bs {
            return Ok(false);
        }
        let rope = self.rope.as_ref();
        self.blocks.seal(block, |rows| {
            let store = match rope {
                Some(rope) => {
                    // Sink rows stay as written (exact, after RoPE).
                    let mut unrotated = rows.to_vec();
                    rope.undo_rows(&mut unrotated[exact * ch..], ch, first + exact)?;
                    SparseStore::quantize_with_exact(form, &unrotated, bs, ch, exact)?
                }
                None => SparseStore::quantize_with_exact(form, rows, bs, ch, exact)?,
            };
            Ok(SparseBlock { store, first })
        })
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
            .snapshot(block, |sealed| PartBlock::of_sparse(sealed.clone()))
    }

    fn accepts(&self, data: &PartBlock) -> bool {
        match data.sparse() {
            Some(SparseBlock { store: s, first }) => {
                data.stores().is_empty()
                    && data.bytes().is_empty()
                    && data.shard().is_none()
                    && data.low_rank().is_none()
                    && *s.form() == self.sealed_form
                    && s.tokens() == self.block_size
                    && s.channels() == self.channels
                    && first.is_multiple_of(self.block_size)
                    && s.exact_rows() == self.sink.saturating_sub(*first)
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
        self.blocks
            .scrub_with(block, |sealed| Ok(sealed.store.scrub()?))
    }

    fn inject(
        &mut self,
        block: usize,
        channel: &dyn FaultChannel,
        seed: u64,
        target: FaultTarget,
    ) -> Result<Injection> {
        self.blocks.inject(block, channel, seed, target, |sealed| {
            Ok(sealed.store.inject(channel, seed, target))
        })
    }

    fn block_bytes(&self, block: usize) -> usize {
        self.blocks
            .block_bytes(block, |s| s.store.stored_bytes(), self.sealed_bytes)
    }

    fn sealed_block_bytes(&self) -> usize {
        self.sealed_bytes
    }
}
