//! The stored-layer interface: [`StoredPart`], one part (keys or values)
//! of one layer of a paged KV cache, whatever form it is kept in.
//!
//! A paged cache (paged-cache's `BlockStorage`) holds, per layer and
//! part, one `Box<dyn StoredPart>` made by [`open_part`] from a parsed
//! [`CacheForm`], and never looks at the form again: writing a token,
//! sealing, reading attention's tiles, counting bytes, injecting faults,
//! scrubbing, copying a block and swapping it out all go through the
//! trait. [`open_part`] is the one place that maps a form to the type
//! that stores it (the registry); no crate above this one branches on
//! the form.
//!
//! # The contract
//!
//! - **Memory.** A part is the memory of every block of one pool (`blocks
//!   × block_size` token rows of `channels` values). Block `b` is
//!   addressed by its index; what a block holds, and whether it is laid
//!   out beside its neighbours, is the implementation's affair.
//! - **Writing.** Rows arrive one token at a time, already encoded by a
//!   kv-quant [`RowEncoder`] of the part's
//!   [`written_form`](StoredPart::written_form), a row-local form (the
//!   form itself, or its exact rows: f16 under the form's protection).
//!   The cache encodes both parts of a token before storing either, so a
//!   refused row changes nothing; [`put_row`](StoredPart::put_row) only
//!   stores bytes. A block taken from the free list is
//!   [opened](StoredPart::open_block) before its first row.
//! - **Sealing.** A form whose bytes span tokens keeps a block's rows as
//!   written (staged) until the step that completes the block commits;
//!   then the cache calls [`seal_pages`](StoredPart::seal_pages) (by
//!   default [`seal`](StoredPart::seal) of that block) on each position
//!   of the sequence's table that [`sealable`](StoredPart::sealable)
//!   names. A rollback never reaches a sealed block, so nothing is ever
//!   unsealed by one; a block written again after its sequence was cut
//!   back into it is staged again from its sealed rows by `put_row` (or,
//!   for groups of blocks, by [`cut`](StoredPart::cut) and
//!   [`unseal`](StoredPart::unseal)).
//! - **Groups of blocks.** A form whose sealed blocks depend on their
//!   neighbours (per-channel groups over several blocks: [`GroupedPart`])
//!   seals a group at its first block
//!   ([`seal_pages`](StoredPart::seal_pages)), tells the cache which
//!   prefixes it may share ([`shareable_blocks`](StoredPart::shareable_blocks),
//!   [`shareable_hit`](StoredPart::shareable_hit))
//!   and which blocks a write or a cut stages again
//!   ([`sealed_with`](StoredPart::sealed_with) and
//!   [`unseal`](StoredPart::unseal), [`cut_blocks`](StoredPart::cut_blocks)
//!   and [`cut`](StoredPart::cut)); the cache makes those blocks the
//!   sequence's own first, so no block is ever sealed into two groups.
//! - **Reading.** Attention reads a sequence's rows through its pages
//!   (block indices in token order) tile by tile:
//!   [`read_tile`](StoredPart::read_tile) hands the fused and integer
//!   kernels stored halves or levels wherever the form allows, never an
//!   f32 copy it does not need.
//! - **Faults and bytes.** Every stored bit can be hit
//!   ([`inject`](StoredPart::inject), with kv-quant's fault ledger, so
//!   reads count miscorrected and silent words), every protected word
//!   [scrubbed](StoredPart::scrub), and every byte counted
//!   ([`block_bytes`](StoredPart::block_bytes)).
//! - **Copies.** [`snapshot`](StoredPart::snapshot) and
//!   [`restore`](StoredPart::restore) move one block's contents in and
//!   out (copy-on-write, the host tier), as a [`PartBlock`].
//!
//! # How to add a cache form
//!
//! 1. Give the form a spelling in kv-quant (`spec/`), so `"name".parse::<CacheForm>()`
//!    knows it: one variant and one line of the parser.
//! 2. Write one module here that stores it: a type implementing
//!    [`StoredPart`]. Most forms need only choose their written form and
//!    what sealing does; [`planned`](self) (every kv-quant form a
//!    [`BlockPlan`] describes) is the worked example: row-local forms
//!    written in place, per-channel groups and exact sink and window
//!    blocks staged and sealed.
//! 3. Add one arm to [`open_part`] that builds it for its forms, and one
//!    to [`part_pool_bytes`].
//! 4. Where the form's whole-window store (the re-encode protocol's) is
//!    not a kv-quant or kv-lowrank store already, one arm to
//!    [`open_window`].
//!
//! # Windows: the re-encode protocol
//!
//! [`open_window_layer`] codes one layer's keys and values whole from
//! their f32 rows for one call of the re-encode protocol ([`WindowLayer`]:
//! two [`WindowPart`]s over the kv-quant and kv-lowrank stores the paged
//! parts seal into, or a Shard layer its [`WindowState`] keeps from the
//! prefill), so the protocol builds, faults, counts and reads every form
//! without looking at it. A window is not a one-block [`StoredPart`]: the
//! protocol codes it from f32 at once (per-channel scales over every
//! token, sink and window segments inside one store, bases fitted on the
//! window), where a paged part stages rows as f16 and seals blocks, so
//! the two differ by design and the protocol's tables stay what they were.
//!
//! Nothing in paged-cache, the model runner or kv-eval changes: the
//! state-machine, swap, prefix and scrubbing tests of paged-cache run
//! every form [`open_part`] accepts. A part defined outside this crate
//! (an experiment's own form, before it has a spelling) is handed to
//! paged-cache directly (`BlockStorage::from_parts`); paged-cache's
//! `tests/custom_part.rs` stores and attends one that way.

mod grouped;
mod hierarchical;
mod low_rank;
mod part_block;
mod planned;
mod rope_pairs;
mod sequence;
mod shard;
mod shared;
mod sparse;
mod staging;
mod window;

use std::ops::Range;
use std::sync::Arc;

use gf2_codes::channel::FaultChannel;
use kv_lowrank::HeadBases;
use kv_quant::{
    BlockPlan, CacheForm, DecodeScratch, FaultTarget, Hadamard, Injection, KvDecodeStats,
    KvQuantError, KvStore, Quantizer, RowBuffers, RowEncoder, ScrubStats, VqCodebook,
};

pub use grouped::GroupedPart;
pub use hierarchical::HierarchicalPart;
pub use low_rank::LowRankPart;
pub use part_block::PartBlock;
pub use planned::PlannedPart;
pub use rope_pairs::{RopePairBlock, RopePairPart};
pub use sequence::{SequenceFit, SequenceTables};
pub use shard::{BlockGuard, MAX_FIT_ROWS, ShardBlock, ShardPart, ShardTables};
pub use shared::SharedTable;
pub use sparse::{SparseBlock, SparsePart};
pub use staging::clamp_non_finite;
pub use window::{
    WindowBytes, WindowInjection, WindowLayer, WindowPart, WindowScratch, WindowShape,
    WindowSource, WindowState, attend_windows, check_layer_forms, keeps_prefill,
};

use crate::backend::{ReadView, no_draft_view};
use crate::error::{AttentionError, Result};
use crate::source::{BlockedScratch, StoreScratch, Tile};

/// One part (keys or values) of one layer of a paged cache, over every
/// block of its pool (see the [module docs](self) for the contract).
pub trait StoredPart: Send + Sync + std::fmt::Debug {
    /// The form asked for (its spelling, as parsed).
    fn form(&self) -> CacheForm;

    /// Channels per token.
    fn channels(&self) -> usize;

    /// Tokens per block.
    fn block_size(&self) -> usize;

    /// Rows a tile should stay within to be read as stored where the part
    /// does not [gather](Self::gathers_blocks) blocks (a paged source's
    /// [`KvSource::block_tokens`](crate::KvSource::block_tokens)): the block, or a larger run of blocks
    /// the part reads as one tile (a sealed group of several blocks).
    fn tile_unit(&self) -> usize {
        self.block_size()
    }

    /// The row from which runs of [`tile_unit`](Self::tile_unit) rows
    /// begin ([`KvSource::tile_origin`](crate::KvSource::tile_origin)):
    /// 0 (the default), or the rows of exact sink blocks kept before a
    /// part's first group of several blocks.
    fn tile_origin(&self) -> usize {
        0
    }

    /// Blocks held.
    fn num_blocks(&self) -> usize;

    /// The row-local kv-quant form a written row arrives encoded in.
    fn written_form(&self) -> CacheForm;

    /// The encoder of written rows: [`written_form`](Self::written_form)'s
    /// (with the part's codebook where that form has one).
    fn row_encoder(&self) -> Result<RowEncoder> {
        Ok(RowEncoder::new(self.written_form(), self.channels(), None)?)
    }

    /// Bytes of fitted tables the part reads and every block shares (a
    /// calibrated codebook): stored once per cache, beside the blocks.
    fn shared_bytes(&self) -> usize {
        0
    }

    /// Makes `block` ready for a new owner's rows (a block taken from the
    /// free list is never read as another owner's sealed rows).
    fn open_block(&mut self, block: usize) -> Result<()>;

    /// Stores one row, encoded in [`written_form`](Self::written_form), at
    /// slot `offset` of `block`.
    fn put_row(&mut self, block: usize, offset: usize, row: &RowBuffers) -> Result<()>;

    /// The positions in a sequence's block table of the blocks that a step
    /// taking it from `before` to `after` committed tokens makes sealable
    /// (empty for forms written in place).
    fn sealable(&self, before: usize, after: usize) -> Range<usize>;

    /// Seals `block` (its staged rows coded in the sealed form), whose first
    /// row is position `first` of its sequence (a block shared through the
    /// prefix cache holds the same positions in every sequence sharing it),
    /// or returns `false` where it holds no staged rows (sealed already, by
    /// another sequence sharing it). A failure leaves the block as it was.
    fn seal(&mut self, block: usize, first: usize) -> Result<bool>;

    /// Seals block `index` of a sequence's block table `pages` (see
    /// [`seal`](Self::seal)); returns the blocks sealed. A part whose
    /// sealed blocks depend on their neighbours (per-channel groups over
    /// several blocks) seals a whole group at its first block and nothing
    /// at the others. The default seals `pages[index]` alone.
    fn seal_pages(&mut self, pages: &[u32], index: usize) -> Result<usize> {
        let block = *pages
            .get(index)
            .ok_or_else(|| AttentionError::InvalidParameter {
                name: "index",
                reason: format!("block {index} of a table of {}", pages.len()),
            })?;
        Ok(usize::from(
            self.seal(block as usize, index * self.block_size())?,
        ))
    }

    /// Of a sequence's first `blocks` whole blocks, how many lead a prefix
    /// that another sequence may share (a fork): blocks whose sealed
    /// contents depend on no later block. The default (every block sealed
    /// on its own rows): all of them.
    fn shareable_blocks(&self, blocks: usize) -> usize {
        blocks
    }

    /// Of the blocks `pages` a prefix cache found for a prompt (by their
    /// tokens, so they may come from different sequences), how many lead
    /// a prefix a new sequence may take as it is: for a part sealing
    /// groups of blocks, the sink blocks and then the groups whose blocks
    /// were all sealed together. The default: all of them.
    fn shareable_hit(&self, pages: &[u32]) -> usize {
        pages.len()
    }

    /// The block-table positions sealed together with position `index`
    /// (a per-channel group over several blocks), which a row written into
    /// any of them stages again ([`unseal`](Self::unseal)). The default:
    /// `index` alone.
    fn sealed_with(&self, index: usize) -> Range<usize> {
        index..index + 1
    }

    /// Stages again, from the rows they read as, the blocks sealed
    /// together with position `index` of the sequence on `pages`, before a
    /// row is written into one of them; the cache has made them the
    /// sequence's own. The default does nothing: a block sealed on its own
    /// rows is staged again when written ([`put_row`](Self::put_row)).
    fn unseal(&mut self, pages: &[u32], index: usize) -> Result<()> {
        let _ = (pages, index);
        Ok(())
    }

    /// The block-table positions of the blocks a sequence keeps that
    /// [`cut`](Self::cut) to `tokens` tokens may stage again (the cache
    /// makes them the sequence's own first). The default: none.
    fn cut_blocks(&self, tokens: usize) -> Range<usize> {
        let _ = tokens;
        0..0
    }

    /// Makes the blocks a sequence on `pages` keeps readable and writable
    /// on their own when it is cut back to `tokens` tokens, before the
    /// blocks past them are dropped; the cache has made the blocks
    /// [`cut_blocks`](Self::cut_blocks) names the sequence's own. The
    /// default does nothing: a block sealed on its own rows is staged
    /// again when written ([`put_row`](Self::put_row)).
    fn cut(&mut self, pages: &[u32], tokens: usize) -> Result<()> {
        let _ = (pages, tokens);
        Ok(())
    }

    /// Whether the part codes blocks on tables fitted on each sequence's
    /// own rows ([`SequenceTables`]: Shard with bases fitted on the
    /// prefill), so the cache fits them with
    /// [`fit_sequence`](Self::fit_sequence) before a sequence's first seal
    /// and seals its blocks with [`seal_on`](Self::seal_on). The default:
    /// no (tables, if any, are the part's own).
    fn per_sequence(&self) -> bool {
        false
    }

    /// Fits a sequence's tables on the rows of the blocks at positions
    /// `blocks` of its block table `pages` (those its first seal seals:
    /// the prefill past the sink and out of the window), for a part that
    /// is [`per_sequence`](Self::per_sequence); the default refuses.
    fn fit_sequence(&self, pages: &[u32], blocks: Range<usize>) -> Result<SequenceTables> {
        let _ = (pages, blocks);
        Err(AttentionError::InvalidParameter {
            name: "sequence tables",
            reason: format!("{} fits no tables per sequence", self.form()),
        })
    }

    /// [`seal`](Self::seal) on a sequence's `tables` (from
    /// [`fit_sequence`](Self::fit_sequence)); the default, for parts whose
    /// tables are their own, ignores them.
    fn seal_on(&mut self, block: usize, first: usize, tables: &SequenceTables) -> Result<bool> {
        let _ = tables;
        self.seal(block, first)
    }

    /// Injects faults from `channel` with `seed` into a sequence's `tables`
    /// (from [`fit_sequence`](Self::fit_sequence)) as stored under targets
    /// that reach metadata; where the tables read differently after, every
    /// sealed block coded on them (the sequence's and its forks') reads
    /// through them as they are now, and later seals code on them. Flips
    /// land in [`Injection::tables`]. The default has no such tables.
    fn inject_sequence(
        &mut self,
        tables: &SequenceTables,
        channel: &dyn FaultChannel,
        seed: u64,
        target: FaultTarget,
    ) -> Result<Injection> {
        let _ = (tables, channel, seed, target);
        Ok(Injection::default())
    }

    /// How the words of a sequence's `tables` decode now, against the
    /// words as written. The default has no such tables.
    fn sequence_stats(&self, tables: &SequenceTables) -> Result<gf2_codes::DecodeStats> {
        let _ = tables;
        Ok(gf2_codes::DecodeStats::default())
    }

    /// One scrubbing pass over a sequence's `tables` as stored (every
    /// corrected word rewritten). The default has no such tables.
    fn scrub_sequence(&mut self, tables: &SequenceTables) -> Result<gf2_codes::DecodeStats> {
        let _ = tables;
        Ok(gf2_codes::DecodeStats::default())
    }

    /// Whether `block` holds staged (not sealed) rows.
    fn is_staged(&self, block: usize) -> bool;

    /// Blocks holding staged rows.
    fn staged_blocks(&self) -> usize;

    /// Decodes rows `offset..offset + out.len() / channels` of `block` into
    /// `out` (erased values interpolated from the block's own rows).
    fn read_rows(
        &self,
        block: usize,
        offset: usize,
        out: &mut [f32],
        scratch: &mut DecodeScratch,
    ) -> Result<KvDecodeStats>;

    /// Rows `start..start + count` of the sequence whose blocks are
    /// `pages` (in token order), as attention's tile.
    fn read_tile<'s>(
        &'s self,
        pages: &[u32],
        start: usize,
        count: usize,
        scratch: &'s mut PartScratch,
    ) -> Result<Tile<'s>>;

    /// Bytes one token's row takes, group parameters not counted (what
    /// sizes attention's tiles, [`KvSource::row_bytes`](crate::KvSource::row_bytes)).
    fn row_bytes(&self) -> usize;

    /// Whether a tile over blocks that are not adjacent reaches the kernel
    /// as stored levels ([`KvSource::gathers_blocks`](crate::KvSource::gathers_blocks));
    /// the default (a part reconstructing f32 rows): no.
    fn gathers_blocks(&self) -> bool {
        false
    }

    /// The rotation the tiles come in, if any
    /// ([`KvSource::rotation`](crate::KvSource::rotation)); the default
    /// (tiles in the rows' own coordinates): none.
    fn rotation(&self) -> Option<&'static Hadamard> {
        None
    }

    /// The addresses of the stored bytes of rows `start..start + count`,
    /// one range per run of contiguous rows, given to `each` (prefetch
    /// hints only; the default gives none).
    fn row_address_ranges(
        &self,
        pages: &[u32],
        start: usize,
        count: usize,
        each: &mut dyn FnMut(Range<usize>),
    ) {
        let _ = (pages, start, count, each);
    }

    /// The addresses of rows `start..start + count` where they are one
    /// contiguous range (the default: never).
    fn row_addresses(&self, pages: &[u32], start: usize, count: usize) -> Option<Range<usize>> {
        let _ = (pages, start, count);
        None
    }

    /// A copy of `block`'s contents.
    fn snapshot(&self, block: usize) -> Result<PartBlock>;

    /// Whether `data` is a [`snapshot`](Self::snapshot) this part can
    /// [`restore`](Self::restore) (same form and shape), checked before a
    /// cache restores any part of a block.
    fn accepts(&self, data: &PartBlock) -> bool;

    /// Replaces `block`'s contents with a [`snapshot`](Self::snapshot) of a
    /// part of the same form and shape (refused, changing nothing, where
    /// it does not [`accept`](Self::accepts) it).
    fn restore(&mut self, block: usize, data: &PartBlock) -> Result<()>;

    /// One scrubbing pass over `block`'s protected words.
    fn scrub(&mut self, block: usize) -> Result<ScrubStats>;

    /// Injects faults from `channel` with `seed` into `block`'s stored bits
    /// (flip positions count from the block's first byte in each buffer).
    fn inject(
        &mut self,
        block: usize,
        channel: &dyn FaultChannel,
        seed: u64,
        target: FaultTarget,
    ) -> Result<Injection>;

    /// Injects faults from `channel` with `seed` into the fitted tables the
    /// part reads ([`shared_bytes`](Self::shared_bytes): a `vq` codebook,
    /// calibrated bases), under `target`s that reach metadata. The part
    /// keeps its tables as stored, protected bytes ([`SharedTable`]), so
    /// other caches sharing the fitted tables are untouched, and every row
    /// read from now on reads the tables as decoded through their code.
    /// Flips land in [`Injection::tables`], the words' outcomes in
    /// [`shared_stats`](Self::shared_stats). The default has no tables.
    fn inject_shared(
        &mut self,
        channel: &dyn FaultChannel,
        seed: u64,
        target: FaultTarget,
    ) -> Result<Injection> {
        let _ = (channel, seed, target);
        Ok(Injection::default())
    }

    /// How the words of the part's fitted tables decode now, against the
    /// words as written: corrected, detected (erased to zero),
    /// miscorrected, silent. The default has no tables.
    fn shared_stats(&self) -> gf2_codes::DecodeStats {
        gf2_codes::DecodeStats::default()
    }

    /// One scrubbing pass over the fitted tables' stored words (every
    /// corrected word rewritten). The default has no tables.
    fn scrub_shared(&mut self) -> Result<gf2_codes::DecodeStats> {
        Ok(gf2_codes::DecodeStats::default())
    }

    /// The store holding `block`'s rows as read, as a store of
    /// `block_size` rows (its bytes, flips and words), for parts kept in
    /// kv-quant stores; the default refuses.
    fn block_store(&self, block: usize) -> Result<KvStore> {
        Err(AttentionError::InvalidParameter {
            name: "block",
            reason: format!(
                "block {block} of {} is not kept in a kv-quant store",
                self.form()
            ),
        })
    }

    /// Bytes `block` holds, counted from its buffers (staged rows
    /// included while it holds them).
    fn block_bytes(&self, block: usize) -> usize;

    /// Bytes one sealed (or written-in-place) block holds.
    fn sealed_block_bytes(&self) -> usize;

    /// Reads `view` from now on: [`ReadView::Draft`] is the cheaper view
    /// a self-speculative draft reads (a hierarchical form's upper plane).
    /// The default keeps only [`ReadView::Full`] and refuses the draft
    /// view.
    fn set_view(&mut self, view: ReadView) -> Result<()> {
        match view {
            ReadView::Full => Ok(()),
            ReadView::Draft => Err(no_draft_view(&self.form().to_string())),
        }
    }

    /// The one kv-quant store of every block's sealed rows, block `b` at
    /// rows `b·block_size..`, where the part keeps them so (what a device
    /// copies as the pool); `None` for other layouts.
    fn sealed_store(&self) -> Option<&KvStore> {
        None
    }
}

/// Rows `start..start + count` of a sequence on `pages` (blocks of
/// `block_size` rows of `channels` values) decoded page by page into
/// `rows` by `decode(page, offset, out)`, as one f32 tile: the loop every
/// part that reconstructs rows shares.
pub fn decode_pages<'s>(
    rows: &'s mut Vec<f32>,
    layout: (&[u32], usize, usize),
    start: usize,
    count: usize,
    mut decode: impl FnMut(usize, usize, &mut [f32]) -> Result<KvDecodeStats>,
) -> Result<Tile<'s>> {
    decode_positions(rows, layout, start, count, |_, page, offset, out| {
        decode(page, offset, out)
    })
}

/// [`decode_pages`] with the position in the block table of each page
/// given too: `decode(index, page, offset, out)`.
pub fn decode_positions<'s>(
    rows: &'s mut Vec<f32>,
    (pages, block_size, channels): (&[u32], usize, usize),
    start: usize,
    count: usize,
    mut decode: impl FnMut(usize, usize, usize, &mut [f32]) -> Result<KvDecodeStats>,
) -> Result<Tile<'s>> {
    let n = count * channels;
    if rows.len() < n {
        rows.resize(n, 0.0);
    }
    let mut stats = KvDecodeStats::default();
    let mut t = start;
    while t < start + count {
        let k = (block_size - t % block_size).min(start + count - t);
        let out = &mut rows[(t - start) * channels..][..k * channels];
        let index = t / block_size;
        stats += decode(index, pages[index] as usize, t % block_size, out)?;
        t += k;
    }
    Ok(Tile {
        rows: crate::TileRows::F32(&rows[..n]),
        stats,
    })
}

/// Per-thread buffers of [`StoredPart::read_tile`]: those of the block
/// layouts this crate reads (a part from elsewhere decodes into `rows`).
#[derive(Debug, Default)]
pub struct PartScratch {
    /// Block-laid kv-quant stores.
    pub blocked: BlockedScratch,
    /// One store's tile.
    pub store: StoreScratch,
    /// Decoding rows into f32.
    pub decode: DecodeScratch,
    /// f32 rows of a decoded tile.
    pub rows: Vec<f32>,
    /// Reconstructing low-rank rows.
    pub low_rank: kv_lowrank::StoreScratch,
    /// Coefficients of rebuilt rows (Shard keys); one channel slice's rows
    /// (per-channel groups over several blocks).
    pub coeffs: Vec<f32>,
    /// A tile gathered from a group's channel slices.
    pub slices: kv_quant::ChannelSlices,
    /// Codes of keys coded before RoPE on pair codebooks, and the angles
    /// of their rows.
    pub pairs: PairScratch,
}

/// Per-thread buffers of a tile of pair codes ([`crate::PairCodeRows`]).
#[derive(Debug, Default)]
pub struct PairScratch {
    /// Decoding the codes.
    pub decode: DecodeScratch,
    /// The rows' angles ([`crate::Rope::trig_rows`]).
    pub trig: Vec<f32>,
}

/// The quantization options of re-coding exact rows (sealing, staging a
/// sealed block again): a value a fault made non-finite saturates, so the
/// fault's outcome is measured, not fatal.
pub(crate) fn clamped() -> kv_quant::QuantizeOptions {
    kv_quant::QuantizeOptions {
        non_finite: kv_quant::NonFinite::Clamp,
    }
}

/// Tables fitted offline (`kv-eval calibrate`) that a part of a calibrated
/// form reads, loaded once per model and shared by every sequence and
/// block, so sealed blocks stay hashable and shareable.
#[derive(Clone, Debug, Default)]
pub struct Fitted {
    /// The codebook of a `vq` form.
    pub codebook: Option<Arc<VqCodebook>>,
    /// The per-head bases of a calibrated low-rank form (`pca-*`).
    pub bases: Option<Arc<HeadBases>>,
    /// The tables of a calibrated Shard form's part (`shard-*-cal`).
    pub shard: Option<ShardTables>,
    /// What a part fitting its tables on each sequence (`shard-k3`) needs
    /// to know of the model.
    pub sequence: Option<SequenceFit>,
    /// The model's RoPE, for a key part coded before it (`+pre`,
    /// `cq-d2-pre`, `pca-*-pre`).
    pub rope: Option<crate::Rope>,
}

/// The one place a parsed form meets the type that stores it: a part of
/// `num_blocks` zeroed blocks of `block_size` tokens of `channels` values
/// (reading `fitted`'s tables where the form needs them), or why blocks
/// cannot hold the form (before any memory is taken).
pub fn open_part(
    form: CacheForm,
    block_size: usize,
    channels: usize,
    num_blocks: usize,
    fitted: &Fitted,
) -> Result<Box<dyn StoredPart>> {
    if let Quantizer::LowRank(_) = form.quantizer() {
        let bases = bases_of(form, fitted)?;
        return Ok(Box::new(LowRankPart::new(
            form,
            block_size,
            channels,
            num_blocks,
            bases,
            fitted.rope.clone(),
        )?));
    }
    if let Quantizer::Shard(_) = form.quantizer() {
        return Ok(Box::new(ShardPart::open(
            form, block_size, channels, num_blocks, fitted,
        )?));
    }
    if codes_pairs(form) {
        let (codebook, rope) = pair_tables(form, fitted)?;
        return Ok(Box::new(RopePairPart::new(
            form, block_size, channels, num_blocks, codebook, rope,
        )?));
    }
    if form.sparse().is_some() {
        return Ok(Box::new(SparsePart::new(
            form,
            block_size,
            channels,
            num_blocks,
            fitted.rope.clone(),
        )?));
    }
    if form.quantizer().is_hierarchical() {
        return Ok(Box::new(HierarchicalPart::new(
            form, block_size, channels, num_blocks,
        )?));
    }
    let plan = BlockPlan::new(form, block_size)?;
    if plan.group_blocks > 1 {
        return Ok(Box::new(GroupedPart::new(plan, channels, num_blocks)?));
    }
    let codebook = codebook_of(form, fitted)?;
    Ok(Box::new(PlannedPart::new(
        plan, channels, num_blocks, codebook,
    )?))
}

/// The registry of the re-encode protocol, beside [`open_part`]: `rows`
/// (`tokens × channels`, heads of `head_dim` values) coded whole in
/// `form` as one [`WindowPart`] (reading `fitted`'s codebook or
/// calibrated bases where the form needs them; keys of a form projected
/// before RoPE rotated back to position 0 by `rope` first), or why a
/// window cannot hold the form (shard forms keep state across calls:
/// [`ShardLayer`](crate::ShardLayer)).
pub fn open_window(
    form: CacheForm,
    fitted: &Fitted,
    rows: &[f32],
    (tokens, channels, head_dim): (usize, usize, usize),
    rope: Option<&crate::Rope>,
) -> Result<WindowPart> {
    window::open(form, fitted, rows, (tokens, channels, head_dim), rope)
}

/// One layer of the re-encode protocol for one call: keys and values
/// (`shape.tokens` rows each) in `forms` (each with the fitted tables it
/// reads), coded whole as two [`WindowPart`]s, or, for a shard form
/// (keys and values stored together), the layer `state` keeps from the
/// prefill extended by the rows since. `rope` rotates keys of forms that
/// project before RoPE (and is what a shard form undoes).
pub fn open_window_layer(
    forms: [(CacheForm, &Fitted); 2],
    state: &mut WindowState,
    rows: (&[f32], &[f32]),
    shape: WindowShape,
    rope: Option<&crate::Rope>,
) -> Result<WindowLayer> {
    window::layer_open(forms, state, rows, shape, rope)
}

/// A part's refusal of a [`PartBlock`] that is not a block of its
/// `block_size` rows of `channels` values in `form`.
fn block_data_refused(block_size: usize, channels: usize, form: CacheForm) -> AttentionError {
    AttentionError::InvalidParameter {
        name: "block data",
        reason: format!(
            "it does not hold a block of {block_size} rows of {channels} channels in {form}"
        ),
    }
}

/// The bases a low-rank `form` needs from `fitted`, or its refusal.
fn bases_of(form: CacheForm, fitted: &Fitted) -> Result<Arc<HeadBases>> {
    fitted.bases.clone().ok_or_else(|| {
        AttentionError::Store(KvQuantError::InvalidSpec {
            spec: form.to_string(),
            reason: "needs its calibrated bases (fit them with `kv-eval calibrate`, or pass \
                     the tables to the cache: BlockStorage::with_fitted)"
                .into(),
        })
    })
}

/// Whether `form` codes keys before RoPE on pair codebooks
/// ([`RopePairPart`]).
fn codes_pairs(form: CacheForm) -> bool {
    matches!(form.quantizer(), Quantizer::Vq(s) if s.pre_rope)
}

/// The codebook and the model's RoPE a [`RopePairPart`] of `form` needs
/// from `fitted`, or their refusal.
fn pair_tables(form: CacheForm, fitted: &Fitted) -> Result<(Arc<VqCodebook>, crate::Rope)> {
    let codebook = codebook_of(form, fitted)?.ok_or_else(|| AttentionError::InvalidParameter {
        name: "form",
        reason: format!("{form} reads a fitted codebook"),
    })?;
    let rope = fitted
        .rope
        .clone()
        .ok_or_else(|| AttentionError::InvalidParameter {
            name: "form",
            reason: format!(
                "{form} codes keys before RoPE (-pre) and needs the model's RoPE: a key form \
                 of a model with RoPE (Fitted::rope)"
            ),
        })?;
    Ok((codebook, rope))
}

/// The codebook `form` needs from `fitted`, or its refusal.
fn codebook_of(form: CacheForm, fitted: &Fitted) -> Result<Option<Arc<VqCodebook>>> {
    if !form.quantizer().needs_codebook() {
        return Ok(None);
    }
    match &fitted.codebook {
        Some(cb) => Ok(Some(cb.clone())),
        None => Err(AttentionError::Store(KvQuantError::InvalidSpec {
            spec: form.to_string(),
            reason: "needs its fitted codebook (fit one with `kv-eval calibrate`, or pass the \
                     tables to the cache: BlockStorage::with_fitted)"
                .into(),
        })),
    }
}

/// Whether blocks of `block_size` tokens can hold `form`, given the fitted
/// tables it needs ([`open_part`]'s refusals of the form itself, without
/// building anything).
pub fn check_part_form(form: CacheForm, block_size: usize) -> Result<()> {
    if let Quantizer::LowRank(spec) = form.quantizer() {
        let refuse = |reason: &str| {
            Err(AttentionError::Store(KvQuantError::InvalidSpec {
                spec: form.to_string(),
                reason: reason.into(),
            }))
        };
        return match spec.method {
            kv_quant::spec::LowRankMethod::Fd { .. } => refuse(
                "is an online low-rank form: its bases are fitted per sequence, which paged \
                 blocks do not carry yet (use --backend reencode)",
            ),
            _ if block_size < 2 => refuse("needs blocks of at least 2 tokens"),
            _ => Ok(()),
        };
    }
    if let Quantizer::Shard(_) = form.quantizer() {
        return shard::check_shard_form(form, block_size).map(|_| ());
    }
    if form.quantizer().is_hierarchical() {
        return HierarchicalPart::plans(form, block_size).map(|_| ());
    }
    if codes_pairs(form) {
        return RopePairPart::fits(form, block_size);
    }
    if form.sparse().is_some() {
        return SparsePart::fits(form, block_size);
    }
    BlockPlan::new(form, block_size)?;
    Ok(())
}

/// Whether a part of `form` in blocks of `block_size` stages written rows
/// and seals blocks at commit (per-channel groups, exact sinks and
/// windows), so that a caller running a long prefill steps it a block at a
/// time, as a server's decode would see it. `false` for forms written in
/// place and forms blocks cannot hold.
pub fn part_seals(form: CacheForm, block_size: usize) -> bool {
    match form.quantizer() {
        Quantizer::Hierarchical(_) => {
            HierarchicalPart::plans(form, block_size).is_ok_and(|(upper, _)| upper.staged)
        }
        Quantizer::LowRank(_) | Quantizer::Shard(_) => check_part_form(form, block_size).is_ok(),
        _ if codes_pairs(form) => RopePairPart::fits(form, block_size).is_ok(),
        _ if form.sparse().is_some() => SparsePart::fits(form, block_size).is_ok(),
        _ => BlockPlan::new(form, block_size).is_ok_and(|plan| plan.staged),
    }
}

/// Memory [`open_part`] takes, counted before building anything (a caller
/// sizing a pool from user input checks it against its memory budget
/// first).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolBytes {
    /// Bytes the part's blocks hold once built (rows staged later and
    /// shared fitted tables not counted).
    pub blocks: u64,
    /// The largest buffer filled while building, freed before it returns.
    pub building: u64,
    /// Bytes of the tables each sequence keeps at most beside its blocks,
    /// for a part fitting its tables per sequence (0 for other parts).
    pub sequence: u64,
    /// The buffers one such fit fills, freed before it returns.
    pub fitting: u64,
}

/// [`PoolBytes`] of [`open_part`] for these arguments (saturating).
pub fn part_pool_bytes(
    form: CacheForm,
    block_size: usize,
    channels: usize,
    num_blocks: usize,
    fitted: &Fitted,
) -> Result<PoolBytes> {
    if let Quantizer::LowRank(_) = form.quantizer() {
        let bases = bases_of(form, fitted)?;
        return LowRankPart::pool_bytes(form, block_size, channels, num_blocks, &bases);
    }
    if let Quantizer::Shard(_) = form.quantizer() {
        return ShardPart::pool_bytes(form, block_size, channels, num_blocks, fitted);
    }
    if codes_pairs(form) {
        let (codebook, _) = pair_tables(form, fitted)?;
        return RopePairPart::pool_bytes(form, block_size, channels, num_blocks, &codebook);
    }
    if form.sparse().is_some() {
        return SparsePart::pool_bytes(form, block_size, channels, num_blocks);
    }
    if form.quantizer().is_hierarchical() {
        return HierarchicalPart::pool_bytes(form, block_size, channels, num_blocks);
    }
    let plan = BlockPlan::new(form, block_size)?;
    if plan.group_blocks > 1 {
        return GroupedPart::pool_bytes(&plan, channels, num_blocks);
    }
    PlannedPart::pool_bytes(&plan, channels, num_blocks, codebook_of(form, fitted)?)
}
