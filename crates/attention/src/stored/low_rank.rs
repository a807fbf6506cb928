//! [`LowRankPart`]: calibrated low-rank forms (`pca-r<R>`, `pca-e<E>`,
//! keys after or before RoPE (`-pre`) and values) as a [`StoredPart`], on
//! per-head bases fitted offline (`kv-eval calibrate`), loaded once and
//! shared by every block.
//!
//! A block's rows are staged exact (f16 under the form's protection, like
//! a per-channel block) until the step that fills it commits;
//! sealing projects them on the bases into one kv-lowrank [`LowRankStore`]
//! of the block (per-head coefficients, residual norms and row norms for
//! the certificates) and drops the exact rows. Each sealed block is its
//! own store, so a block is hashable and shareable like any other, and a
//! page is read by reconstructing its rows from the coefficients. The
//! block being written is exact, as KIVI keeps its residual.
//!
//! Keys projected before RoPE (`-pre`, on bases fitted on keys rotated
//! back to position 0) are staged as written (after RoPE); sealing
//! rotates each row back from its position (the block's first row's,
//! [`seal`](StoredPart::seal), kept with the block) before projecting, and
//! reading rotates each reconstructed row to its position again, in f64
//! angles ([`Rope::apply_rows`]), as the re-encode protocol's
//! [`PreRopeKeys`](crate::PreRopeKeys) does.
//!
//! Not yet: online bases (`fd-*`, fitted per sequence as rows arrive), and
//! attention in coefficient space over pages (tiles are reconstructed
//! rows).

use std::ops::Range;
use std::sync::Arc;

use gf2_codes::channel::{FaultChannel, Flips};
use kv_lowrank::{HeadBases, LowRankStore};
use kv_quant::{
    CacheForm, DecodeScratch, FaultTarget, Injection, KvDecodeStats, KvStore, RowBuffers,
    ScrubStats,
};

use super::staging::{BlockState, StagedBlocks};
use super::{PartBlock, PartScratch, PoolBytes, SharedTable, StoredPart};
use crate::error::{AttentionError, Result};
use crate::rope::Rope;
use crate::source::Tile;

/// A sealed block of a [`LowRankPart`]: its rows projected on the bases
/// (rotated back to position 0 first for keys of a `-pre` form), and the
/// position of its first row in its sequences.
#[derive(Clone, Debug)]
struct LowRankBlock {
    store: LowRankStore,
    first: usize,
}

/// A calibrated low-rank form kept in blocks (see the module docs).
#[derive(Debug)]
pub struct LowRankPart {
    form: CacheForm,
    /// The calibrated bases, shared by every block, as stored, protected
    /// bytes; sealed blocks read them as last decoded.
    bases: SharedTable<HeadBases>,
    /// The model's RoPE, for keys projected before it (`-pre`).
    rope: Option<Rope>,
    head_dim: usize,
    channels: usize,
    block_size: usize,
    blocks: StagedBlocks<LowRankBlock>,
    /// Bytes of one sealed block (the same for every block of a form).
    sealed_bytes: usize,
}

impl LowRankPart {
    /// Zeroed blocks of the calibrated low-rank `form` on `bases`; `rope`
    /// is the model's RoPE, which a form projecting keys before it (`-pre`)
    /// needs and every other form ignores.
    pub fn new(
        form: CacheForm,
        block_size: usize,
        channels: usize,
        num_blocks: usize,
        bases: Arc<HeadBases>,
        rope: Option<Rope>,
    ) -> Result<Self> {
        let head_dim = check_form(form, &bases, block_size, channels)?;
        let rope = rope_of(form, rope, head_dim)?;
        let zeros = vec![0.0; block_size * channels];
        let sealed_bytes =
            LowRankStore::build(form, &zeros, block_size, channels, head_dim, Some(&bases))?
                .stored_bytes();
        Ok(Self {
            blocks: StagedBlocks::new(form.exact_rows_form(), block_size, channels, num_blocks),
            bases: SharedTable::new(bases, &form),
            form,
            rope,
            head_dim,
            channels,
            block_size,
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
            sequence: 0,
            fitting: 0,
        })
    }

    /// Every sealed block reads the bases as last decoded.
    fn reread_bases(&mut self) -> Result<()> {
        let bases = self.bases.read().clone();
        for block in self.blocks.iter_mut() {
            if let BlockState::Sealed(sealed) = block {
                sealed.store.replace_bases(&bases)?;
            }
        }
        Ok(())
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
        if let Some(stats) = self.blocks.read_unsealed(block, offset, out, scratch)? {
            return Ok(stats);
        }
        let BlockState::Sealed(sealed) = self.blocks.get(block)? else {
            unreachable!("read_unsealed reads the others");
        };
        self.read_sealed(sealed, offset, out, low_rank)
    }

    /// Rows `offset..offset + out.len() / channels` of a sealed block,
    /// reconstructed (and, for keys projected before RoPE, rotated to
    /// their positions).
    fn read_sealed(
        &self,
        sealed: &LowRankBlock,
        offset: usize,
        out: &mut [f32],
        low_rank: &mut kv_lowrank::StoreScratch,
    ) -> Result<KvDecodeStats> {
        reconstruct(
            sealed,
            self.rope.as_ref(),
            self.channels,
            offset,
            out,
            low_rank,
        )
    }
}

/// Rows `offset..offset + out.len() / channels` of a sealed block
/// reconstructed from its coefficients, rotated to their positions by
/// `rope` for keys projected before RoPE.
fn reconstruct(
    sealed: &LowRankBlock,
    rope: Option<&Rope>,
    channels: usize,
    offset: usize,
    out: &mut [f32],
    scratch: &mut kv_lowrank::StoreScratch,
) -> Result<KvDecodeStats> {
    let stats = sealed
        .store
        .decode_rows_into(offset, out.len() / channels, out, scratch)?;
    if let Some(rope) = rope {
        rope.apply_rows(out, channels, sealed.first + offset)?;
    }
    Ok(stats)
}

/// The RoPE a part of `form` keeps: `rope` for keys projected before it
/// (which must be given, with heads of the bases' `head_dim`), none for
/// every other form.
fn rope_of(form: CacheForm, rope: Option<Rope>, head_dim: usize) -> Result<Option<Rope>> {
    if !form.codes_before_rope() {
        return Ok(None);
    }
    match rope {
        Some(rope) if rope.head_dim() == head_dim => Ok(Some(rope)),
        Some(rope) => Err(AttentionError::InvalidParameter {
            name: "rope",
            reason: format!(
                "a RoPE of heads of {} channels, where the bases of {form} have {head_dim}",
                rope.head_dim()
            ),
        }),
        None => Err(AttentionError::InvalidParameter {
            name: "form",
            reason: format!(
                "{form} projects keys before RoPE (-pre) and needs the model's RoPE: a key \
                 form of a model with RoPE (Fitted::rope)"
            ),
        }),
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
        self.blocks.exact_form()
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
        self.blocks.open(block)
    }

    fn put_row(&mut self, block: usize, offset: usize, row: &RowBuffers) -> Result<()> {
        // A sequence cut back into a sealed block: staged again from the
        // rows its coefficients give (rotated to their positions).
        let Self {
            blocks,
            rope,
            channels,
            ..
        } = self;
        blocks.put_row(block, offset, row, |sealed, rows| {
            let mut scratch = kv_lowrank::StoreScratch::default();
            reconstruct(sealed, rope.as_ref(), *channels, 0, rows, &mut scratch).map(|_| ())
        })
    }

    fn sealable(&self, before: usize, after: usize) -> Range<usize> {
        let first = before / self.block_size;
        first..(after / self.block_size).max(first)
    }

    fn seal(&mut self, block: usize, first: usize) -> Result<bool> {
        let (form, bs, ch, hd) = (self.form, self.block_size, self.channels, self.head_dim);
        let (bases, rope) = (self.bases.read(), self.rope.as_ref());
        self.blocks.seal(block, |rows| {
            let unrotated;
            let rows = match rope {
                Some(rope) => {
                    let mut r = rows.to_vec();
                    rope.undo_rows(&mut r, ch, first)?;
                    unrotated = r;
                    &unrotated[..]
                }
                None => rows,
            };
            let store = LowRankStore::build(form, rows, bs, ch, hd, Some(bases))?;
            Ok(LowRankBlock { store, first })
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

    fn snapshot(&self, block: usize) -> Result<PartBlock> {
        // Keys coded before RoPE carry their block's position.
        let positioned = self.rope.is_some();
        self.blocks.snapshot(block, |sealed| {
            let data = PartBlock::of_low_rank(sealed.store.clone());
            match positioned {
                true => data.at_position(sealed.first),
                false => data,
            }
        })
    }

    fn accepts(&self, data: &PartBlock) -> bool {
        match data.low_rank() {
            Some(lr) => {
                let bs = self.block_size;
                data.stores().is_empty()
                    && data.bytes().is_empty()
                    && data.shard().is_none()
                    && data.sparse().is_none()
                    && *lr.form() == self.form
                    && lr.tokens() == bs
                    && lr.channels() == self.channels
                    && match (self.rope.is_some(), data.first_position()) {
                        (true, Some(first)) => first.is_multiple_of(bs),
                        (false, None) => true,
                        _ => false,
                    }
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
        let bases = self.bases.read();
        self.blocks.restore(block, data, |data| {
            // Projected on the bases as fitted; read through this part's
            // bases as they are now.
            let Some(lr) = data.low_rank() else {
                return Ok(None);
            };
            // Blocks coded after RoPE read the same at any position.
            let first = data.first_position().unwrap_or(0);
            let mut store = lr.clone();
            store.replace_bases(bases)?;
            Ok(Some(LowRankBlock { store, first }))
        })
    }

    fn scrub(&mut self, block: usize) -> Result<ScrubStats> {
        // The coefficient stores of a sealed block are read (and their
        // words corrected on every read) but not rewritten here yet.
        self.blocks.scrub(block)
    }

    fn inject(
        &mut self,
        block: usize,
        channel: &dyn FaultChannel,
        seed: u64,
        target: FaultTarget,
    ) -> Result<Injection> {
        self.blocks.inject(block, channel, seed, target, |sealed| {
            let store = &mut sealed.store;
            // One injection per head's coefficient store, their flip
            // positions laid end to end in bits (each head's buffers after
            // the previous head's bytes).
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
            Ok(Injection {
                values,
                scales,
                offsets,
                checks,
                exact,
                tables: Flips::default(),
            })
        })
    }

    fn block_bytes(&self, block: usize) -> usize {
        self.blocks.block_bytes(
            block,
            |sealed| sealed.store.stored_bytes(),
            self.sealed_bytes,
        )
    }

    fn sealed_block_bytes(&self) -> usize {
        self.sealed_bytes
    }
}
