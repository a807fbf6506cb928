//! [`GroupedPart`]: per-channel integer forms whose token groups span
//! several blocks (`int4-ch<G>` in blocks of `B` tokens, `G = m·B`,
//! KIVI's grouping with a group longer than a page), as a [`StoredPart`].
//!
//! A group's scale and offset per channel cost `32/G` bits per value only
//! if they are stored once per group, yet blocks are allocated, copied,
//! swapped and shared one at a time and the `m` blocks of a group lie
//! anywhere in the pool. So a sealed group is kept **in channel slices**:
//! block `j` of the group holds channels `j·C/m..(j+1)·C/m` of all `G`
//! rows, with their parameters, as one kv-quant store of the sealed form
//! (`G` rows of `C/m` channels, under the form's protection). Every block
//! then holds the same bytes (`G·C/m` levels and `C/m` parameter pairs,
//! exactly a block's share of the group), is a self-contained store for
//! copies, the host tier, fault injection and scrubbing, and a group's
//! quantization is the one a store of the whole group gives (per-channel
//! parameters depend on their own channel only: tested bit for bit).
//!
//! The price is that a sealed block is read with its group's other
//! blocks: attention reads a tile's rows from all `m` slices and lays them
//! side by side (kv-quant's [`ChannelSlices`], so the integer kernels
//! read levels, and fold a group's scales into the query once for all of
//! its tiles), and the cache keeps groups whole:
//! - a group is sealed when its last block commits, all `m` blocks at once
//!   ([`seal_pages`](StoredPart::seal_pages) at its first block); the
//!   blocks of the group being written stay exact (KIVI's residual, up to
//!   `G − 1` tokens);
//! - only whole groups are shared: a prefix hit (blocks found by their
//!   tokens, maybe from different sequences) is cut back to the last
//!   group whose blocks were all sealed together, each sealed block
//!   carrying its group's mark through copies
//!   ([`shareable_hit`](StoredPart::shareable_hit)); a fork copies the
//!   written blocks of the group being filled
//!   ([`shareable_blocks`](StoredPart::shareable_blocks)); a write into a
//!   group shared with others copies the group first; so two sequences
//!   never seal one block into different groups;
//! - a sequence cut back into a sealed group stages the group's kept
//!   blocks again from the rows they read as ([`cut`](StoredPart::cut)),
//!   before the blocks past the cut are dropped.
//!
//! Groups start after the sink blocks. Rotated forms are refused (a
//! rotation would mix the slices' channels): kv-quant's `BlockPlan`.

use std::ops::Range;

use gf2_codes::channel::FaultChannel;
use kv_quant::{
    BlockPlan, CacheForm, DecodeScratch, FaultTarget, Injection, KvDecodeStats, KvStore,
    RowBuffers, RowsView, ScrubStats,
};

use super::staging::{BlockState, StagedBlocks, clamp_non_finite};
use super::{PartBlock, PartScratch, PoolBytes, StoredPart, clamped};
use crate::error::{AttentionError, Result};
use crate::source::{KvSource, Tile, TileRows};

/// One sealed block: its channel slice of the group's rows, and the mark
/// of the group it was sealed in (copies keep it).
#[derive(Clone, Debug)]
struct Slice {
    store: KvStore,
    group: u64,
}

/// A per-channel form grouped over several blocks (see the module docs).
#[derive(Debug)]
pub struct GroupedPart {
    plan: BlockPlan,
    channels: usize,
    /// Channels of each block's slice (`channels / group_blocks`).
    slice: usize,
    blocks: StagedBlocks<Slice>,
    /// The mark the last sealed (or unmarked restored) group got.
    next_group: u64,
    /// A zeroed store of a whole group (`G` rows of every channel): the
    /// layout gathered tiles are read in.
    template: KvStore,
    /// Bytes of one sealed block (one slice).
    sealed_bytes: usize,
}

impl GroupedPart {
    /// Zeroed blocks of `plan`'s form (its `group_blocks` at least 2).
    pub fn new(plan: BlockPlan, channels: usize, num_blocks: usize) -> Result<Self> {
        let slice = check_shape(&plan, channels)?;
        let group = plan.block_size * plan.group_blocks;
        Ok(Self {
            template: KvStore::zeroed(plan.sealed, group, channels)?,
            sealed_bytes: KvStore::zeroed(plan.sealed, group, slice)?.stored_bytes(),
            blocks: StagedBlocks::new(plan.exact, plan.block_size, channels, num_blocks),
            plan,
            channels,
            slice,
            next_group: 0,
        })
    }

    /// [`PoolBytes`] of [`new`](Self::new): every block counted at the
    /// larger of its exact and sealed bytes, and the template; sealing
    /// fills one f32 matrix of a group.
    pub fn pool_bytes(plan: &BlockPlan, channels: usize, num_blocks: usize) -> Result<PoolBytes> {
        let slice = check_shape(plan, channels)?;
        let group = plan.block_size * plan.group_blocks;
        let sealed = KvStore::zeroed(plan.sealed, group, slice)?.stored_bytes();
        let exact = KvStore::zeroed(plan.exact, plan.block_size, channels)?.stored_bytes();
        let template = KvStore::zeroed(plan.sealed, group, channels)?.stored_bytes();
        Ok(PoolBytes {
            blocks: (sealed.max(exact) as u64)
                .saturating_mul(num_blocks as u64)
                .saturating_add(template as u64),
            // Sealing holds the group's rows, one slice's columns and the
            // group's slices (staging again: the rows).
            building: (4 * group * (channels + slice) + plan.group_blocks * sealed) as u64,
            sequence: 0,
            fitting: 0,
        })
    }

    /// How the form is kept in blocks.
    pub fn plan(&self) -> &BlockPlan {
        &self.plan
    }

    /// Tokens per group.
    fn group_tokens(&self) -> usize {
        self.plan.block_size * self.plan.group_blocks
    }

    /// The block-table positions of the group holding position `index`
    /// (`None` for a sink block).
    fn group_of(&self, index: usize) -> Option<Range<usize>> {
        let (sink, m) = (self.plan.sink_blocks, self.plan.group_blocks);
        let past = index.checked_sub(sink)?;
        let start = sink + past / m * m;
        Some(start..start + m)
    }

    /// The pages of the whole group `group`, or why the table lacks them.
    fn group_pages<'p>(&self, pages: &'p [u32], group: Range<usize>) -> Result<&'p [u32]> {
        pages
            .get(group.clone())
            .ok_or_else(|| AttentionError::InvalidParameter {
                name: "pages",
                reason: format!(
                    "a sealed group's blocks {group:?} need a table of at least {} blocks, not {}",
                    group.end,
                    pages.len()
                ),
            })
    }

    /// The sealed slice of `block`, or `None` where it is not sealed.
    fn sealed(&self, block: u32) -> Result<Option<&KvStore>> {
        Ok(self.slice_of(block)?.map(|s| &s.store))
    }

    /// The sealed block `block`, or `None` where it is not sealed.
    fn slice_of(&self, block: u32) -> Result<Option<&Slice>> {
        Ok(match self.blocks.get(block as usize)? {
            BlockState::Sealed(s) => Some(s),
            _ => None,
        })
    }

    /// A mark no group of this part has had.
    fn new_group(&mut self) -> u64 {
        self.next_group += 1;
        self.next_group
    }

    /// Rows `r0..r0 + out.len() / channels` of the sealed group on
    /// `group`, decoded from every slice into `out` (`tmp` holds one
    /// slice's rows).
    fn decode_sealed(
        &self,
        group: &[u32],
        r0: usize,
        out: &mut [f32],
        tmp: &mut Vec<f32>,
        scratch: &mut DecodeScratch,
    ) -> Result<KvDecodeStats> {
        let (ch, w) = (self.channels, self.slice);
        let k = out.len() / ch;
        tmp.resize(k * w, 0.0);
        let mut stats = KvDecodeStats::default();
        for (i, &page) in group.iter().enumerate() {
            let Some(slice) = self.sealed(page)? else {
                return Err(self.partly_sealed(group));
            };
            scratch.limit_neighbours(None);
            stats += slice.decode_rows_into(r0, k, &mut tmp[..k * w], scratch)?;
            for (row, src) in out.chunks_exact_mut(ch).zip(tmp.chunks_exact(w)) {
                row[i * w..][..w].copy_from_slice(src);
            }
        }
        Ok(stats)
    }

    /// Gathers rows `r0..r0 + count` of the sealed group on `group` as
    /// levels into `scratch.slices`; `None` where a slice does not read as
    /// levels (an erased value) or a block is not sealed.
    fn gather(
        &self,
        group: &[u32],
        r0: usize,
        count: usize,
        scratch: &mut PartScratch,
    ) -> Result<Option<KvDecodeStats>> {
        scratch.slices.begin(count, self.channels);
        let mut stats = KvDecodeStats::default();
        for &page in group {
            let Some(slice) = self.sealed(page)? else {
                return Ok(None);
            };
            scratch.decode.limit_neighbours(None);
            let (view, s) = slice.decode_rows_view_packed(r0, count, &mut scratch.decode)?;
            stats += s;
            let RowsView::Levels(levels) = view else {
                return Ok(None);
            };
            if !scratch.slices.push(&levels) {
                return Ok(None);
            }
        }
        Ok(Some(stats))
    }

    /// Stages again, from the rows they read as, the first `keep` blocks of
    /// the sealed group holding position `index` of the table `pages`
    /// (nothing for a sink block, a group the table does not hold whole,
    /// which was never sealed, or a group not sealed).
    fn restage(&mut self, pages: &[u32], index: usize, keep: usize) -> Result<()> {
        let Some(group) = self.group_of(index) else {
            return Ok(());
        };
        let Some(group) = pages.get(group) else {
            return Ok(());
        };
        if self.sealed(group[0])?.is_none() {
            return Ok(());
        }
        let (bs, ch) = (self.plan.block_size, self.channels);
        let mut rows = vec![0.0; self.group_tokens() * ch];
        let mut tmp = Vec::new();
        self.decode_sealed(group, 0, &mut rows, &mut tmp, &mut DecodeScratch::new())?;
        for (&page, block_rows) in group.iter().zip(rows.chunks_exact(bs * ch)).take(keep) {
            self.blocks.stage_rows(page as usize, block_rows)?;
        }
        Ok(())
    }

    /// The error of a group whose blocks are not all sealed.
    fn partly_sealed(&self, group: &[u32]) -> AttentionError {
        AttentionError::InvalidParameter {
            name: "pages",
            reason: format!(
                "blocks {group:?} of one {} group are partly sealed (a group is sealed, shared \
                 and cut back whole)",
                self.plan.form
            ),
        }
    }

    /// The error of reading or writing one sealed block alone.
    fn slice_alone(&self, block: usize) -> AttentionError {
        AttentionError::InvalidParameter {
            name: "block",
            reason: format!(
                "block {block} holds one channel slice of a sealed group of {} blocks of {}: \
                 read its rows through the sequence's pages (read_tile), and cut the sequence \
                 back (StoredPart::cut) before writing into it",
                self.plan.group_blocks, self.plan.form
            ),
        }
    }
}

/// Channels per slice of `plan`'s groups over `channels`, or why they do
/// not split into one slice per block of a group.
fn check_shape(plan: &BlockPlan, channels: usize) -> Result<usize> {
    let m = plan.group_blocks;
    if m < 2 || channels == 0 || !channels.is_multiple_of(2 * m) {
        return Err(AttentionError::InvalidParameter {
            name: "channels",
            reason: format!(
                "{} groups {m} blocks: its {channels} channels must split into {m} slices of an \
                 even number of channels, one per block (use a group of fewer blocks, or \
                 blocks of the group's size)",
                plan.form
            ),
        });
    }
    Ok(channels / m)
}

impl StoredPart for GroupedPart {
    fn form(&self) -> CacheForm {
        self.plan.form
    }

    fn channels(&self) -> usize {
        self.channels
    }

    fn block_size(&self) -> usize {
        self.plan.block_size
    }

    fn tile_unit(&self) -> usize {
        // A tile inside one sealed group reads its slices side by side
        // (`read_tile`): tiles of a group's rows are groups.
        self.group_tokens()
    }

    fn tile_origin(&self) -> usize {
        // Groups start after the sink blocks.
        self.plan.sink_blocks * self.plan.block_size
    }

    fn num_blocks(&self) -> usize {
        self.blocks.len()
    }

    fn written_form(&self) -> CacheForm {
        self.plan.exact
    }

    fn open_block(&mut self, block: usize) -> Result<()> {
        self.blocks.open(block)
    }

    fn put_row(&mut self, block: usize, offset: usize, row: &RowBuffers) -> Result<()> {
        if matches!(self.blocks.get(block)?, BlockState::Sealed(_)) {
            return Err(self.slice_alone(block));
        }
        self.blocks
            .put_row(block, offset, row, |_, _| unreachable!("not sealed"))
    }

    fn sealable(&self, before: usize, after: usize) -> Range<usize> {
        let first = self.plan.sealable(before).max(self.plan.sink_blocks);
        first..self.plan.sealable(after).max(first)
    }

    fn seal(&mut self, block: usize, _first: usize) -> Result<bool> {
        match self.blocks.get(block)? {
            BlockState::Staged(_) => Err(AttentionError::InvalidParameter {
                name: "block",
                reason: format!(
                    "{} seals whole groups of {} blocks: seal them through the sequence's \
                     pages (StoredPart::seal_pages)",
                    self.plan.form, self.plan.group_blocks
                ),
            }),
            _ => Ok(false),
        }
    }

    fn seal_pages(&mut self, pages: &[u32], index: usize) -> Result<usize> {
        let Some(group) = self.group_of(index) else {
            return Ok(0);
        };
        if index != group.start {
            return Ok(0);
        }
        let group = self.group_pages(pages, group)?;
        let staged = group
            .iter()
            .filter(|&&b| self.blocks.is_staged(b as usize))
            .count();
        if staged == 0 {
            // Sealed already, by another sequence sharing the whole group.
            return Ok(0);
        }
        if staged != group.len() {
            return Err(self.partly_sealed(group));
        }
        let (bs, ch, w) = (self.plan.block_size, self.channels, self.slice);
        let g = self.group_tokens();
        let mut rows = vec![0.0; g * ch];
        let mut scratch = DecodeScratch::new();
        for (&page, out) in group.iter().zip(rows.chunks_exact_mut(bs * ch)) {
            self.blocks
                .read_unsealed(page as usize, 0, out, &mut scratch)?;
        }
        // Exact rows a fault made non-finite are clamped: the fault's
        // outcome is measured, not fatal. On failure nothing changed.
        clamp_non_finite(&mut rows);
        let mut slices = Vec::with_capacity(group.len());
        let mut columns = vec![0.0; g * w];
        for i in 0..group.len() {
            for (dst, src) in columns.chunks_exact_mut(w).zip(rows.chunks_exact(ch)) {
                dst.copy_from_slice(&src[i * w..][..w]);
            }
            slices.push(KvStore::quantize_with(
                self.plan.sealed,
                &columns,
                g,
                w,
                clamped(),
            )?);
        }
        let mark = self.new_group();
        for (&page, store) in group.iter().zip(slices) {
            let slice = Slice { store, group: mark };
            self.blocks.put_sealed(page as usize, slice)?;
        }
        Ok(group.len())
    }

    fn shareable_blocks(&self, blocks: usize) -> usize {
        self.plan.whole_groups(blocks)
    }

    fn shareable_hit(&self, pages: &[u32]) -> usize {
        let (sink, m) = (self.plan.sink_blocks, self.plan.group_blocks);
        if pages.len() <= sink {
            return pages.len();
        }
        // Whole groups whose blocks were sealed together (a group still
        // staged cannot tell whose blocks it holds, so it is not taken).
        let mark = |b: &u32| self.slice_of(*b).ok().flatten().map(|s| s.group);
        let mut kept = sink;
        for group in pages[sink..].chunks_exact(m) {
            let first = mark(&group[0]);
            if first.is_none() || !group.iter().all(|b| mark(b) == first) {
                break;
            }
            kept += m;
        }
        kept
    }

    fn cut_blocks(&self, tokens: usize) -> Range<usize> {
        let Some(last) = tokens.checked_sub(1).map(|t| t / self.plan.block_size) else {
            return 0..0;
        };
        match self.group_of(last) {
            Some(group) if tokens < group.end * self.plan.block_size => group.start..last + 1,
            _ => 0..0,
        }
    }

    fn cut(&mut self, pages: &[u32], tokens: usize) -> Result<()> {
        let kept = self.cut_blocks(tokens);
        if kept.is_empty() {
            return Ok(());
        }
        self.restage(pages, kept.start, kept.len())
    }

    fn sealed_with(&self, index: usize) -> Range<usize> {
        self.group_of(index).unwrap_or(index..index + 1)
    }

    fn unseal(&mut self, pages: &[u32], index: usize) -> Result<()> {
        self.restage(pages, index, self.plan.group_blocks)
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
        self.blocks
            .read_unsealed(block, offset, out, scratch)?
            .ok_or_else(|| self.slice_alone(block))
    }

    fn read_tile<'s>(
        &'s self,
        pages: &[u32],
        start: usize,
        count: usize,
        scratch: &'s mut PartScratch,
    ) -> Result<Tile<'s>> {
        let (bs, ch) = (self.plan.block_size, self.channels);
        if count == 0 {
            return Err(AttentionError::InvalidParameter {
                name: "count",
                reason: "a tile holds at least one row".into(),
            });
        }
        let (first, last) = (start / bs, (start + count - 1) / bs);
        if last >= pages.len() {
            return Err(AttentionError::InvalidParameter {
                name: "pages",
                reason: format!("rows {start}..{} past {} pages", start + count, pages.len()),
            });
        }
        // A tile inside one sealed group: its slices' levels side by side.
        if let Some(group) = self.group_of(first).filter(|g| g.contains(&last))
            && let Some(group_pages) = pages.get(group.clone())
            && self.sealed(group_pages[0])?.is_some()
        {
            let r0 = (first - group.start) * bs + start % bs;
            if let Some(stats) = self.gather(group_pages, r0, count, scratch)? {
                let rows = scratch
                    .slices
                    .view(&self.template, r0)
                    .expect("every slice gathered");
                return Ok(Tile {
                    rows: TileRows::Levels(rows),
                    stats,
                });
            }
        }
        if first == last
            && let BlockState::Staged(exact) = self.blocks.get(pages[first] as usize)?
        {
            return KvSource::read_tile(&**exact, start % bs, count, &mut scratch.store);
        }
        let PartScratch {
            rows,
            decode,
            coeffs,
            ..
        } = scratch;
        let layout = (pages, bs, ch);
        super::decode_positions(rows, layout, start, count, |index, page, offset, out| {
            if let Some(stats) = self.blocks.read_unsealed(page, offset, out, decode)? {
                return Ok(stats);
            }
            let Some(group) = self.group_of(index) else {
                return Err(AttentionError::InvalidParameter {
                    name: "pages",
                    reason: format!("sink position {index} holds a sealed group's block"),
                });
            };
            let r0 = (index - group.start) * bs + offset;
            let group = self.group_pages(pages, group)?;
            self.decode_sealed(group, r0, out, coeffs, decode)
        })
    }

    fn row_bytes(&self) -> usize {
        self.template.row_bytes()
    }

    fn snapshot(&self, block: usize) -> Result<PartBlock> {
        self.blocks.snapshot(block, |slice| {
            PartBlock::of_stores(vec![slice.store.clone()]).in_group(slice.group)
        })
    }

    fn accepts(&self, data: &PartBlock) -> bool {
        match data.stores() {
            [s] if *s.form() == self.plan.sealed => {
                data.bytes().is_empty()
                    && data.low_rank().is_none()
                    && data.shard().is_none()
                    && data.sparse().is_none()
                    && s.tokens() == self.group_tokens()
                    && s.channels() == self.slice
            }
            _ => self.blocks.accepts_unsealed(data),
        }
    }

    fn restore(&mut self, block: usize, data: &PartBlock) -> Result<()> {
        self.blocks.get(block)?;
        if !self.accepts(data) {
            return Err(AttentionError::InvalidParameter {
                name: "block data",
                reason: format!(
                    "it holds neither a block of {} rows of {} channels nor a slice of a \
                     group of {} in {}",
                    self.plan.block_size, self.channels, self.plan.group_blocks, self.plan.form
                ),
            });
        }
        match data.stores() {
            [s] if *s.form() == self.plan.sealed => {
                // A copy of a group's block keeps its group's mark; a slice
                // without one is a group of its own.
                let group = match data.group() {
                    Some(g) => g,
                    None => self.new_group(),
                };
                let slice = Slice {
                    store: s.clone(),
                    group,
                };
                self.blocks.put_sealed(block, slice)
            }
            _ => self.blocks.restore(block, data, |_| Ok(None)),
        }
    }

    fn scrub(&mut self, block: usize) -> Result<ScrubStats> {
        self.blocks
            .scrub_with(block, |slice| Ok(slice.store.scrub()?))
    }

    fn inject(
        &mut self,
        block: usize,
        channel: &dyn FaultChannel,
        seed: u64,
        target: FaultTarget,
    ) -> Result<Injection> {
        let g = self.group_tokens();
        self.blocks.inject(block, channel, seed, target, |slice| {
            Ok(slice.store.inject_rows(0..g, channel, seed, target)?)
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
