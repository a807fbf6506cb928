//! [`RopePairPart`]: keys coded before RoPE on one codebook per rotated
//! pair (`cq-d2-k<K>-pre`), a RoPE-commutative codebook as a
//! [`StoredPart`].
//!
//! RoPE turns each pair of a key's channels by an angle that depends on
//! the token's position only. A pair coded before RoPE is a centroid `c`
//! of its pair's codebook times the row's gain `g`; rotating the decoded
//! pair to position `t` is rotating `g·c`, and since a rotation of the
//! plane is multiplication by `e^{iθt}`, which commutes with the gain and
//! with the codebook's lookup, the rotated key is the codebook's centroid
//! rotated: `R_t(g·c) = g·R_t(c)`. A query's score against a key is then
//! `g·Σ_pairs Re(conj(q_p)·c_p·e^{iθ_p t})`: the products `conj(q_p)·c`
//! can be taken against the codebook once per query, and each token adds
//! its pairs' products turned by its position (CommVQ's observation,
//! Li et al. 2025; here with one 2-d codebook per pair rather than their
//! additive codes). The keys before RoPE keep their per-channel structure
//! (fixed-sign outlier channels, which RoPE smears into rings for the fast
//! pairs), which is what a pair's codebook fits.
//!
//! A block's rows are staged exact (f16 under the form's protection, as
//! written: after RoPE) until the step that fills it commits; sealing
//! rotates each row back to position 0 from its position (the block's
//! first row's, [`seal`](StoredPart::seal)), puts each pair's two channels
//! side by side ([`Rope::to_pair_order`]) and codes the block on the
//! calibrated codebook (one kv-quant [`KvStore`] per block, the sequence's
//! sink tokens exact inside it, kept as written). A tile within one
//! sealed block, past its sink rows, is its codes, gains and rows' angles
//! ([`crate::PairCodeRows`]): the kernel scores a query against the
//! codebook once and adds each row's entries turned by its angle, nothing
//! decoded or rotated per row (5x faster than decoding at SmolLM2's
//! shape: attention's `pair-codes` bench). Other tiles (sink rows, staged
//! rows, tiles across blocks) and [`read_rows`](StoredPart::read_rows)
//! decode the rows, put the channels back and rotate each to its position
//! ([`Rope::apply_rows`]).

use std::ops::Range;
use std::sync::Arc;

use gf2_codes::DecodeStats;
use gf2_codes::channel::FaultChannel;
use kv_quant::{
    CacheForm, DecodeScratch, FaultTarget, Injection, KvDecodeStats, KvQuantError, KvStore,
    Quantizer, RowBuffers, RowEncoder, ScrubStats, Segments, VqCodebook,
};

use super::staging::{BlockState, StagedBlocks};
use super::{PartBlock, PartScratch, PoolBytes, SharedTable, StoredPart, clamped};
use crate::error::{AttentionError, Result};
use crate::pair_codes::pair_tile;
use crate::rope::Rope;
use crate::source::Tile;

/// A sealed block of a [`RopePairPart`]: its rows coded before RoPE, in
/// pair order (its leading sink rows exact, as written), and the position
/// of its first row.
#[derive(Clone, Debug, PartialEq)]
pub struct RopePairBlock {
    /// The block's rows.
    pub store: KvStore,
    /// The position of the block's first row in its sequences.
    pub first: usize,
}

/// Keys coded before RoPE on one codebook per rotated pair (module docs).
#[derive(Debug)]
pub struct RopePairPart {
    form: CacheForm,
    channels: usize,
    block_size: usize,
    /// Sink tokens (`+sink<S>`): blocks of a sequence holding only sink
    /// tokens are never sealed; the block holding the last one seals with
    /// them exact.
    sink: usize,
    blocks: StagedBlocks<RopePairBlock>,
    rope: Rope,
    /// The pairs' codebooks, shared by every block, as stored, protected
    /// bytes.
    codebook: SharedTable<VqCodebook>,
    /// Bytes of one sealed block without sink rows.
    sealed_bytes: usize,
}

impl RopePairPart {
    /// Zeroed blocks of `form` (a `cq-d2-…-pre` form) coded on `codebook`
    /// (fitted on keys rotated back to position 0, in pair order), rotated
    /// by the model's `rope`, or why blocks of `block_size` rows of
    /// `channels` values cannot hold it.
    pub fn new(
        form: CacheForm,
        block_size: usize,
        channels: usize,
        num_blocks: usize,
        codebook: Arc<VqCodebook>,
        rope: Rope,
    ) -> Result<Self> {
        Self::fits(form, block_size)?;
        if !channels.is_multiple_of(rope.head_dim()) {
            return Err(AttentionError::InvalidParameter {
                name: "rope",
                reason: format!(
                    "heads of {} channels do not divide rows of {channels}",
                    rope.head_dim()
                ),
            });
        }
        let sealed_bytes = Self::sealed_bytes_of(form, block_size, channels, &codebook)?;
        Ok(Self {
            blocks: StagedBlocks::new(form.exact_rows_form(), block_size, channels, num_blocks),
            codebook: SharedTable::new(codebook, &form),
            form,
            channels,
            block_size,
            sink: form.segments().sink,
            rope,
            sealed_bytes,
        })
    }

    /// Bytes of one sealed block without sink rows (which checks that
    /// `codebook` fits the form and the rows).
    fn sealed_bytes_of(
        form: CacheForm,
        block_size: usize,
        channels: usize,
        codebook: &Arc<VqCodebook>,
    ) -> Result<usize> {
        let coded = form.with_segments(Segments::default())?;
        let one = KvStore::zeroed_with(coded, block_size, channels, Some(codebook.clone()))?;
        Ok(one.stored_bytes())
    }

    /// [`PoolBytes`] of [`new`](Self::new): every block at the larger of
    /// its exact and sealed bytes.
    pub fn pool_bytes(
        form: CacheForm,
        block_size: usize,
        channels: usize,
        num_blocks: usize,
        codebook: &Arc<VqCodebook>,
    ) -> Result<PoolBytes> {
        Self::fits(form, block_size)?;
        let sealed = Self::sealed_bytes_of(form, block_size, channels, codebook)?;
        let exact = KvStore::zeroed(form.exact_rows_form(), block_size, channels)?.stored_bytes();
        // A block holding the last sink tokens keeps them exact beside the
        // coded rows: at most every row exact.
        Ok(PoolBytes {
            blocks: (sealed.max(exact) as u64).saturating_mul(num_blocks as u64),
            ..PoolBytes::default()
        })
    }

    /// Whether blocks of `block_size` rows can hold `form` (channels and
    /// tables aside): a `-pre` codebook form whose exact tokens are sinks.
    pub fn fits(form: CacheForm, block_size: usize) -> Result<()> {
        let refuse = |reason: &str| {
            Err(AttentionError::Store(KvQuantError::InvalidSpec {
                spec: form.to_string(),
                reason: reason.into(),
            }))
        };
        if !matches!(form.quantizer(), Quantizer::Vq(s) if s.pre_rope) {
            return refuse("does not code keys before RoPE on pair codebooks (spell cq-d2-pre)");
        }
        if block_size == 0 {
            return refuse("blocks hold at least one token");
        }
        if form.segments().window > 0 {
            return refuse(
                "keeps a window of exact tokens, which blocks coded before RoPE do not hold \
                 (keep sink tokens with +sink<S>)",
            );
        }
        Ok(())
    }

    /// The form of a sealed block whose first row is position `first`: the
    /// sink rows it holds exact.
    fn block_form(&self, first: usize) -> Result<CacheForm> {
        let sink = self.sink.saturating_sub(first);
        Ok(self.form.with_segments(Segments { sink, window: 0 })?)
    }

    /// Rows `offset..offset + out.len() / channels` of a sealed block,
    /// rotated to their positions (`head`: one head's buffer).
    fn read_sealed(
        rope: &Rope,
        sealed: &RopePairBlock,
        offset: usize,
        out: &mut [f32],
        scratch: &mut DecodeScratch,
        head: &mut Vec<f32>,
    ) -> Result<KvDecodeStats> {
        let channels = sealed.store.channels();
        // A block's own rows only: no limit another part's tile left.
        scratch.limit_neighbours(None);
        let rows = out.len() / channels;
        let stats = sealed.store.decode_rows_into(offset, rows, out, scratch)?;
        // Exact sink rows were kept as written (after RoPE).
        let skip = sealed
            .store
            .form()
            .segments()
            .sink
            .saturating_sub(offset)
            .min(rows);
        let coded = &mut out[skip * channels..];
        rope.from_pair_order(coded, head);
        rope.apply_rows(coded, channels, sealed.first + offset + skip)?;
        Ok(stats)
    }

    /// Rows of `block` as [`read_rows`](StoredPart::read_rows) gives them.
    fn decode(
        &self,
        block: usize,
        offset: usize,
        out: &mut [f32],
        scratch: &mut DecodeScratch,
        head: &mut Vec<f32>,
    ) -> Result<KvDecodeStats> {
        if let Some(stats) = self.blocks.read_unsealed(block, offset, out, scratch)? {
            return Ok(stats);
        }
        let BlockState::Sealed(sealed) = self.blocks.get(block)? else {
            unreachable!("read_unsealed reads the others");
        };
        Self::read_sealed(&self.rope, sealed, offset, out, scratch, head)
    }
}

impl StoredPart for RopePairPart {
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

    fn row_encoder(&self) -> Result<RowEncoder> {
        Ok(RowEncoder::new(self.written_form(), self.channels, None)?)
    }

    fn shared_bytes(&self) -> usize {
        self.codebook.stored_bytes()
    }

    fn open_block(&mut self, block: usize) -> Result<()> {
        self.blocks.open(block)
    }

    fn put_row(&mut self, block: usize, offset: usize, row: &RowBuffers) -> Result<()> {
        // A sequence cut back into a sealed block: staged again from its
        // decoded rows (after RoPE, as written; `read_rows`' f64 rotation,
        // within 1e-6 of the kernel's codebook scores' f32 angles).
        let rope = &self.rope;
        self.blocks.put_row(block, offset, row, |sealed, rows| {
            let mut scratch = DecodeScratch::new();
            Self::read_sealed(rope, sealed, 0, rows, &mut scratch, &mut Vec::new())?;
            Ok(())
        })
    }

    fn sealable(&self, before: usize, after: usize) -> Range<usize> {
        let first = (before / self.block_size).max(self.sink / self.block_size);
        first..(after / self.block_size).max(first)
    }

    fn seal(&mut self, block: usize, first: usize) -> Result<bool> {
        let (bs, ch) = (self.block_size, self.channels);
        if self.sink.saturating_sub(first) >= bs {
            return Ok(false);
        }
        let form = self.block_form(first)?;
        let exact = form.segments().sink;
        let (rope, codebook) = (&self.rope, self.codebook.read().clone());
        self.blocks.seal(block, |rows| {
            // Sink rows stay as written (exact, after RoPE).
            let mut unrotated = rows.to_vec();
            let coded = &mut unrotated[exact * ch..];
            rope.undo_rows(coded, ch, first + exact)?;
            rope.to_pair_order(coded, &mut Vec::new());
            let store =
                KvStore::quantize_with_codebook(form, &unrotated, bs, ch, clamped(), codebook)?;
            Ok(RopePairBlock { store, first })
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
        self.decode(block, offset, out, scratch, &mut Vec::new())
    }

    fn read_tile<'s>(
        &'s self,
        pages: &[u32],
        start: usize,
        count: usize,
        scratch: &'s mut PartScratch,
    ) -> Result<Tile<'s>> {
        // A tile within one sealed block is scored against the codebook.
        let (bs, last) = (self.block_size, (start + count).saturating_sub(1));
        if count > 0
            && start / bs == last / bs
            && let BlockState::Sealed(sealed) = self.blocks.get(pages[start / bs] as usize)?
        {
            let (offset, pairs) = (start % bs, &mut scratch.pairs);
            let rows = (offset, count, sealed.first + offset);
            let tile = pair_tile(
                &sealed.store,
                &self.rope,
                rows,
                &mut pairs.decode,
                &mut pairs.trig,
            );
            if let Some(tile) = tile? {
                return Ok(tile);
            }
        }
        let PartScratch {
            rows,
            decode,
            coeffs,
            ..
        } = scratch;
        let layout = (pages, self.block_size, self.channels);
        super::decode_pages(rows, layout, start, count, |page, offset, out| {
            self.decode(page, offset, out, decode, coeffs)
        })
    }

    fn row_bytes(&self) -> usize {
        self.sealed_bytes.div_ceil(self.block_size)
    }

    fn snapshot(&self, block: usize) -> Result<PartBlock> {
        self.blocks.snapshot(block, |sealed| {
            PartBlock::of_stores(vec![sealed.store.clone()]).at_position(sealed.first)
        })
    }

    fn accepts(&self, data: &PartBlock) -> bool {
        let Some(first) = data.first_position() else {
            return self.blocks.accepts_unsealed(data);
        };
        let Ok(form) = self.block_form(first) else {
            return false;
        };
        match data.stores() {
            [s] => {
                data.bytes().is_empty()
                    && data.low_rank().is_none()
                    && data.shard().is_none()
                    && data.sparse().is_none()
                    && *s.form() == form
                    && s.tokens() == self.block_size
                    && s.channels() == self.channels
                    && first.is_multiple_of(self.block_size)
                    && self.sink.saturating_sub(first) < self.block_size
            }
            _ => false,
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
        match data.first_position() {
            Some(first) => {
                // Read on this part's tables as they are now.
                let mut store = data.stores()[0].clone();
                store.replace_codebook(self.codebook.read().clone())?;
                self.blocks
                    .put_sealed(block, RopePairBlock { store, first })
            }
            None => self.blocks.restore(block, data, |_| Ok(None)),
        }
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
        let bs = self.block_size;
        self.blocks.inject(block, channel, seed, target, |sealed| {
            Ok(sealed.store.inject_rows(0..bs, channel, seed, target)?)
        })
    }

    fn inject_shared(
        &mut self,
        channel: &dyn FaultChannel,
        seed: u64,
        target: FaultTarget,
    ) -> Result<Injection> {
        let (injection, changed) = self.codebook.inject(channel, seed, target)?;
        if changed {
            let read = self.codebook.read().clone();
            for b in self.blocks.iter_mut() {
                if let BlockState::Sealed(sealed) = b {
                    sealed.store.replace_codebook(read.clone())?;
                }
            }
        }
        Ok(injection)
    }

    fn shared_stats(&self) -> DecodeStats {
        self.codebook.stats()
    }

    fn scrub_shared(&mut self) -> Result<DecodeStats> {
        Ok(self.codebook.scrub())
    }

    fn block_bytes(&self, block: usize) -> usize {
        self.blocks
            .block_bytes(block, |s| s.store.stored_bytes(), self.sealed_bytes)
    }

    fn sealed_block_bytes(&self) -> usize {
        self.sealed_bytes
    }
}
