//! [`StagedBlocks`]: the blocks of a part whose sealed form is not rows of
//! one kv-quant store (a low-rank store per block, a Shard block, a form
//! from outside), written exact until they are sealed.
//!
//! Every such part keeps the same life cycle, kept here once: a block is
//! empty until opened, staged (its rows f16 in a small kv-quant store of
//! the form's exact-rows form, under the form's protection, reused once
//! released) while written, and sealed into the part's own type `S`. A
//! sealed block written again (its sequence cut back into it) is staged
//! again from the rows it reads as; an exact value a fault made
//! non-finite is clamped when sealed, so a fault's outcome is measured,
//! not fatal. The part supplies only what differs: how to seal, how to
//! read a sealed block, how to copy one.

use kv_quant::{
    CacheForm, DecodeScratch, FaultTarget, Injection, KvDecodeStats, KvStore, RowBuffers,
    ScrubStats,
};

use super::{PartBlock, clamped};
use crate::error::{AttentionError, Result};

/// One block of a [`StagedBlocks`].
#[derive(Clone, Debug)]
pub(crate) enum BlockState<S> {
    /// Never opened: reads as zeros.
    Empty,
    /// Rows written exact, not sealed yet.
    Staged(Box<KvStore>),
    /// Rows in the part's sealed form.
    Sealed(S),
}

/// The blocks of a staging part (see the module docs).
#[derive(Debug)]
pub(crate) struct StagedBlocks<S> {
    exact: CacheForm,
    block_size: usize,
    channels: usize,
    blocks: Vec<BlockState<S>>,
    /// Released exact stores, kept so a warm cache stages a block without
    /// allocating its buffers.
    spare: Vec<KvStore>,
}

impl<S> StagedBlocks<S> {
    /// `num_blocks` empty blocks of `block_size` rows of `channels` values,
    /// staged in `exact` (a form's exact-rows form).
    pub(crate) fn new(
        exact: CacheForm,
        block_size: usize,
        channels: usize,
        num_blocks: usize,
    ) -> Self {
        Self {
            exact,
            block_size,
            channels,
            blocks: (0..num_blocks).map(|_| BlockState::Empty).collect(),
            spare: Vec::new(),
        }
    }

    /// The form staged rows are kept in.
    pub(crate) fn exact_form(&self) -> CacheForm {
        self.exact
    }

    /// Blocks held.
    pub(crate) fn len(&self) -> usize {
        self.blocks.len()
    }

    /// Block `block`, or an error naming the blocks there are.
    pub(crate) fn get(&self, block: usize) -> Result<&BlockState<S>> {
        self.blocks
            .get(block)
            .ok_or_else(|| AttentionError::InvalidParameter {
                name: "block",
                reason: format!("block {block} of {}", self.blocks.len()),
            })
    }

    /// Every block, in index order.
    pub(crate) fn iter_mut(&mut self) -> impl Iterator<Item = &mut BlockState<S>> {
        self.blocks.iter_mut()
    }

    /// Refuses rows `offset..offset + rows` past a block.
    pub(crate) fn check_rows(&self, offset: usize, rows: usize) -> Result<()> {
        if offset + rows > self.block_size {
            return Err(AttentionError::InvalidParameter {
                name: "rows",
                reason: format!(
                    "rows {offset}..{} past a block of {}",
                    offset + rows,
                    self.block_size
                ),
            });
        }
        Ok(())
    }

    /// An exact store for a block: a spare one, or a new one.
    fn fresh(&mut self) -> Result<Box<KvStore>> {
        Ok(Box::new(match self.spare.pop() {
            Some(s) => s,
            None => KvStore::zeroed(self.exact, self.block_size, self.channels)?,
        }))
    }

    /// Replaces `block` with `new`, keeping a staged store it held.
    fn replace(&mut self, block: usize, new: BlockState<S>) {
        if let BlockState::Staged(old) = std::mem::replace(&mut self.blocks[block], new) {
            self.spare.push(*old);
        }
    }

    /// Makes `block` staged and empty of rows a reader could take for its
    /// own (an opened block is never read as another owner's sealed rows).
    pub(crate) fn open(&mut self, block: usize) -> Result<()> {
        self.get(block)?;
        if !matches!(self.blocks[block], BlockState::Staged(_)) {
            let exact = self.fresh()?;
            self.blocks[block] = BlockState::Staged(exact);
        }
        Ok(())
    }

    /// Stores one encoded row at slot `offset` of `block`; a sealed block
    /// is staged again first from the rows `sealed_rows` gives for it.
    pub(crate) fn put_row(
        &mut self,
        block: usize,
        offset: usize,
        row: &RowBuffers,
        sealed_rows: impl FnOnce(&S, &mut [f32]) -> Result<()>,
    ) -> Result<()> {
        self.get(block)?;
        if offset >= self.block_size {
            return Err(AttentionError::InvalidParameter {
                name: "offset",
                reason: format!("slot {offset} of a block of {}", self.block_size),
            });
        }
        if let BlockState::Sealed(sealed) = &self.blocks[block] {
            let mut rows = vec![0.0; self.block_size * self.channels];
            sealed_rows(sealed, &mut rows)?;
            self.stage_rows(block, &rows)?;
        }
        if matches!(self.blocks[block], BlockState::Empty) {
            self.open(block)?;
        }
        let BlockState::Staged(exact) = &mut self.blocks[block] else {
            unreachable!("staged above");
        };
        exact.put_encoded_rows(offset, row)?;
        Ok(())
    }

    /// Stages `block` again with `rows` (`block_size × channels` values, as
    /// its sealed rows read) coded exact, whatever it held.
    pub(crate) fn stage_rows(&mut self, block: usize, rows: &[f32]) -> Result<()> {
        self.get(block)?;
        let decoded =
            KvStore::quantize_with(self.exact, rows, self.block_size, self.channels, clamped())?;
        let mut exact = self.fresh()?;
        exact.copy_rows_from(0, &decoded)?;
        self.replace(block, BlockState::Staged(exact));
        Ok(())
    }

    /// Makes `block` sealed as `sealed` (a part sealing several blocks at
    /// once, or restoring a copy), releasing its staged rows.
    pub(crate) fn put_sealed(&mut self, block: usize, sealed: S) -> Result<()> {
        self.get(block)?;
        self.replace(block, BlockState::Sealed(sealed));
        Ok(())
    }

    /// Seals `block` with `seal` (given its exact rows, non-finite values
    /// clamped), or returns `false` where it holds no staged rows. A
    /// failure of `seal` leaves the block as it was.
    pub(crate) fn seal(
        &mut self,
        block: usize,
        seal: impl FnOnce(&[f32]) -> Result<S>,
    ) -> Result<bool> {
        let BlockState::Staged(exact) = self.get(block)? else {
            return Ok(false);
        };
        let mut rows = vec![0.0; self.block_size * self.channels];
        exact.decode_rows_into(0, self.block_size, &mut rows, &mut DecodeScratch::new())?;
        clamp_non_finite(&mut rows);
        let sealed = seal(&rows)?;
        self.replace(block, BlockState::Sealed(sealed));
        Ok(true)
    }

    /// Whether `block` holds staged rows.
    pub(crate) fn is_staged(&self, block: usize) -> bool {
        matches!(self.blocks.get(block), Some(BlockState::Staged(_)))
    }

    /// Blocks holding staged rows.
    pub(crate) fn staged_count(&self) -> usize {
        self.blocks
            .iter()
            .filter(|b| matches!(b, BlockState::Staged(_)))
            .count()
    }

    /// Rows `offset..offset + out.len() / channels` of an empty or staged
    /// `block` (`None` for a sealed one, which the part reads).
    pub(crate) fn read_unsealed(
        &self,
        block: usize,
        offset: usize,
        out: &mut [f32],
        scratch: &mut DecodeScratch,
    ) -> Result<Option<KvDecodeStats>> {
        let n = out.len() / self.channels;
        Ok(match self.get(block)? {
            BlockState::Empty => {
                out.fill(0.0);
                Some(KvDecodeStats::default())
            }
            BlockState::Staged(exact) => {
                scratch.limit_neighbours(None);
                Some(exact.decode_rows_into(offset, n, out, scratch)?)
            }
            BlockState::Sealed(_) => None,
        })
    }

    /// A copy of `block`: its exact store where staged, `sealed`'s copy
    /// where sealed.
    pub(crate) fn snapshot(
        &self,
        block: usize,
        sealed: impl FnOnce(&S) -> PartBlock,
    ) -> Result<PartBlock> {
        Ok(match self.get(block)? {
            BlockState::Empty => PartBlock::default(),
            BlockState::Staged(exact) => PartBlock::of_stores(vec![(**exact).clone()]),
            BlockState::Sealed(s) => sealed(s),
        })
    }

    /// Whether `data` is an empty block or a staged one of this shape.
    pub(crate) fn accepts_unsealed(&self, data: &PartBlock) -> bool {
        if !data.bytes().is_empty()
            || data.low_rank().is_some()
            || data.shard().is_some()
            || data.sparse().is_some()
        {
            return false;
        }
        match data.stores() {
            [] => true,
            [exact] => {
                *exact.form() == self.exact
                    && exact.tokens() == self.block_size
                    && exact.channels() == self.channels
            }
            _ => false,
        }
    }

    /// Replaces `block` with `data`: staged rows copied into an exact
    /// store, a sealed block as `sealed` rebuilds it (`None` where `data`
    /// is not one). The caller has checked that the part accepts `data`.
    pub(crate) fn restore(
        &mut self,
        block: usize,
        data: &PartBlock,
        sealed: impl FnOnce(&PartBlock) -> Result<Option<S>>,
    ) -> Result<()> {
        self.get(block)?;
        let new = match data.stores() {
            [exact] => {
                let mut s = self.fresh()?;
                s.copy_rows_from(0, exact)?;
                BlockState::Staged(s)
            }
            _ => match sealed(data)? {
                Some(s) => BlockState::Sealed(s),
                None => BlockState::Empty,
            },
        };
        self.replace(block, new);
        Ok(())
    }

    /// One scrubbing pass over a staged block's exact rows (sealed and
    /// empty blocks: nothing).
    pub(crate) fn scrub(&mut self, block: usize) -> Result<ScrubStats> {
        self.scrub_with(block, |_| Ok(ScrubStats::default()))
    }

    /// One scrubbing pass over a staged block's exact rows, or `sealed`'s
    /// pass over a sealed one (empty blocks: nothing).
    pub(crate) fn scrub_with(
        &mut self,
        block: usize,
        sealed: impl FnOnce(&mut S) -> Result<ScrubStats>,
    ) -> Result<ScrubStats> {
        self.get(block)?;
        match &mut self.blocks[block] {
            BlockState::Staged(exact) => Ok(exact.scrub()?),
            BlockState::Sealed(s) => sealed(s),
            BlockState::Empty => Ok(ScrubStats::default()),
        }
    }

    /// Faults into a staged block's exact rows, or `sealed`'s injection
    /// into a sealed one.
    pub(crate) fn inject(
        &mut self,
        block: usize,
        channel: &dyn gf2_codes::channel::FaultChannel,
        seed: u64,
        target: FaultTarget,
        sealed: impl FnOnce(&mut S) -> Result<Injection>,
    ) -> Result<Injection> {
        self.get(block)?;
        let bs = self.block_size;
        match &mut self.blocks[block] {
            BlockState::Empty => Ok(Injection::default()),
            BlockState::Staged(exact) => Ok(exact.inject_rows(0..bs, channel, seed, target)?),
            BlockState::Sealed(s) => sealed(s),
        }
    }

    /// Bytes `block` holds: its exact store where staged, `sealed`'s count
    /// where sealed, `otherwise` for an empty block.
    pub(crate) fn block_bytes(
        &self,
        block: usize,
        sealed: impl FnOnce(&S) -> usize,
        otherwise: usize,
    ) -> usize {
        match self.blocks.get(block) {
            Some(BlockState::Staged(exact)) => exact.stored_bytes(),
            Some(BlockState::Sealed(s)) => sealed(s),
            _ => otherwise,
        }
    }
}

/// Clamps the non-finite values of exact rows about to be coded: a fault
/// that made an exact (f16) value non-finite becomes the largest f16 of its
/// sign (NaN becomes 0), so sealing and fitting measure the fault's outcome
/// instead of failing (a pair of such values stays finite through a
/// rotation, which `f32::MAX` would not).
pub fn clamp_non_finite(rows: &mut [f32]) {
    for x in rows {
        if !x.is_finite() {
            *x = if x.is_nan() {
                0.0
            } else {
                x.signum() * f32::from(half::f16::MAX)
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::clamp_non_finite;

    #[test]
    fn non_finite_values_become_the_nearest_f16_and_the_rest_stay() {
        let max = f32::from(half::f16::MAX);
        let mut rows = [1.5, f32::NAN, f32::INFINITY, f32::NEG_INFINITY, -2.0, 1e9];
        clamp_non_finite(&mut rows);
        // A finite value beyond f16's range is the coder's to saturate.
        assert_eq!(rows, [1.5, 0.0, max, -max, -2.0, 1e9]);
    }
}
