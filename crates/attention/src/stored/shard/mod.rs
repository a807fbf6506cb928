//! [`ShardPart`]: the Shard forms (`shard-kv-compression-blog.md`) as a
//! [`StoredPart`]: keys on a basis and bit allocation fitted with RoPE
//! undone, values on a codebook (or NF4 after a Hadamard rotation,
//! `-vnf4`), the sink and the recent window exact. The tables are fitted
//! offline and shared by every sequence (`shard-*-cal`), or fitted on each
//! sequence's own rows (`shard-k3`: the blog's prefill fit) and held by the
//! cache as the sequence's [`SequenceTables`].
//!
//! A block's rows are staged exact (f16) until the step that takes its
//! last row out of the window commits; sealing codes the block on the
//! calibrated tables (kv-lowrank's `ShardKeys::encode_chunk` after RoPE is
//! undone at the block's positions, kv-quant's `ChannelVq::encode_chunk`
//! or NF4), each block with scales of its own, as the blog folds a chunk
//! of generated tokens into the compressed middle. Blocks holding sink
//! tokens are never sealed, and the window is the last `W` rows rounded
//! out to whole blocks (exact while staged), so rolling a step back only
//! drops staged rows. Calibrated tables are loaded once per model and
//! shared by every block, so sealed blocks are hashable and shareable like
//! any other. A sequence's own tables are fitted at the first commit whose
//! middle (past the sink, out of the window) holds more rows than a key
//! has channels (and 1,024 values at least, for the codebook's 256
//! centroids of 4), on those rows (a long prefill's, as the blog fits, its
//! first [`MAX_FIT_ROWS`] at most; rows written later are coded on them); every sealed block keeps a
//! reference to the tables it was coded on, so it reads, copies and swaps
//! without its sequence. (A sequence cut back below that threshold keeps
//! its tables, and its blocks seal again once it is past it.) A page of keys is read by rebuilding its rows (one GEMM of its
//! coefficients on the basis, then RoPE at the page's positions with one
//! `sin_cos` per pair for the page: `Rope::apply_rows`); a page of values
//! comes in the codebook's Hadamard rotation, exact rows rotated to match,
//! and attention rotates the weighted sum back once per output.
//!
//! Differences from the re-encode protocol's `ShardLayer`, by design: the
//! tables of a `-cal` form are the calibration's, those of a per-sequence
//! form are fitted on the rows committed when the first block seals (the
//! re-encode protocol fits on the whole window it is called with), every
//! block beyond the sink and window is compressed
//! (prefill and generated tokens alike: no Lloyd-Max decode stream), the
//! per-component scales are per block, and tiles are rebuilt rows rather
//! than scores taken in coefficient space. The window is exact for the
//! sequence that seals: a block shared through the prefix cache is sealed
//! when the longest sequence holding it moves past it, so a shorter one
//! may read that block coded within its own window (as it may after a
//! committed truncation back into sealed blocks). Faults reach every
//! stored bit of a sealed block: the codes or indices under `values` and
//! `everything`, the block's f16 scales (the keys' per-component steps,
//! the values' channel maxima) under `metadata` and `everything`. A bare
//! spelling stores them as they are; a coded one (`shard-k3-cal+secded84`,
//! `+golay24`, the interleaved layouts) stores the codes' nibbles under
//! the form's INT4 code and the scales under its metadata code
//! ([`BlockGuard`]): corrected as they land, scrubbed, every word counted
//! on the read holding the block's first row. The fitted table the part
//! reads (the key basis, the value codebook) is stored once per part, or
//! once per sequence where each fits its own (`SequenceShard`), as a
//! [`SharedTable`](super::SharedTable) under the form's metadata code
//! (none for a bare spelling), hit under `metadata` and `everything`
//! ([`inject_shared`](StoredPart::inject_shared),
//! [`inject_sequence`](StoredPart::inject_sequence)), and every sealed
//! block reads through it as faults leave it. Not yet: folded decode
//! streams (`-f<C>`: every block is folded here) and coded NF4 values
//! (`-vnf4+secded84`). kv-eval's calibration file carries every
//! table (the key basis, the bit allocation and the value codebook), with
//! check words.

mod block;
mod coding;
mod guard;
mod sequence;
mod table;

use std::ops::Range;
use std::sync::Arc;

use gf2_codes::channel::FaultChannel;
use kv_lowrank::ShardKeys;
use kv_quant::{
    CacheForm, ChannelVq, DecodeScratch, FaultTarget, Hadamard, Injection, KvDecodeStats,
    KvQuantError, KvStore, Quantizer, RowBuffers, ScrubStats, ShardValues,
};

pub use block::{ShardBlock, ShardTables};
pub(crate) use coding::check_shard_form;
use coding::{code, coded_on, decode_sealed, inject_f16, repoint};
pub use guard::BlockGuard;
use sequence::SequenceShard;
use table::Shared;

use super::staging::{BlockState, StagedBlocks, clamp_non_finite};
use super::{Fitted, PartBlock, PartScratch, PoolBytes, SequenceFit, SequenceTables, StoredPart};
use crate::error::{AttentionError, Result};
use crate::rope::Rope;
use crate::source::{KvSource, Tile};

/// Rows of its middle a sequence's tables are fitted on at most (a long
/// prefill's first 4,096, or more rows than a key has channels where that
/// is more: the key basis is a PCA over the channels, the codebook's
/// k-means samples 2^15 groups of 4), so a fit's buffers stay bounded
/// whatever the prompt.
pub const MAX_FIT_ROWS: usize = 4096;

/// A Shard form kept in blocks (see the module docs).
#[derive(Debug)]
pub struct ShardPart {
    form: CacheForm,
    /// The tables every block is coded on; `None` where each sequence
    /// fits its own.
    tables: Option<ShardTables>,
    /// The model's RoPE, for a key part.
    rope: Option<Rope>,
    /// Channels per head (the values' Hadamard rotation).
    head_dim: usize,
    /// Blocks of middle rows a sequence's tables are fitted on at least (0
    /// where the tables are the part's own).
    fit_blocks: usize,
    channels: usize,
    block_size: usize,
    /// Blocks holding sink tokens (never sealed).
    sink_blocks: usize,
    /// Rows kept exact at the end of the sequence.
    window: usize,
    blocks: StagedBlocks<ShardBlock>,
    /// Bytes of one sealed block (at most, where a sequence's fit chooses
    /// the components kept).
    sealed_bytes: usize,
    /// The Hadamard rotation sealed values are coded in: value tiles come
    /// in it (the sum is rotated back once per output, not once per row).
    rotation: Option<&'static Hadamard>,
    /// The fitted table the blocks read (the key basis, the value
    /// codebook), as stored, protected bytes; `tables` holds it as read.
    shared: Shared,
}

impl ShardPart {
    /// The part of the Shard `form` that `fitted` describes: on its
    /// calibrated tables (`-cal` forms), or fitting each sequence's own
    /// from what [`Fitted::sequence`] says of the model.
    pub fn open(
        form: CacheForm,
        block_size: usize,
        channels: usize,
        num_blocks: usize,
        fitted: &Fitted,
    ) -> Result<Self> {
        let spec = check_shard_form(form, block_size)?;
        if spec.calibrated {
            let tables = fitted.shard.clone().ok_or_else(|| {
                AttentionError::Store(KvQuantError::InvalidSpec {
                    spec: form.to_string(),
                    reason: "needs its calibrated key basis, bit allocation and value codebook \
                             (fit them with --calib-text, or pass the tables to the cache: \
                             BlockStorage::with_fitted)"
                        .into(),
                })
            })?;
            return Self::new(form, block_size, channels, num_blocks, tables);
        }
        let fit = fitted.sequence.clone().ok_or_else(|| {
            AttentionError::Store(KvQuantError::InvalidSpec {
                spec: form.to_string(),
                reason: "fits its tables on each sequence and needs the model's RoPE and head \
                         width for it (pass them to the cache: BlockStorage::with_fitted, \
                         Fitted::sequence)"
                    .into(),
            })
        })?;
        Self::fitting_per_sequence(form, block_size, channels, num_blocks, fit)
    }

    /// Zeroed blocks of the Shard `form` coded on `tables` (calibrated
    /// ones, or NF4 values, which need none).
    pub fn new(
        form: CacheForm,
        block_size: usize,
        channels: usize,
        num_blocks: usize,
        tables: ShardTables,
    ) -> Result<Self> {
        let (rope, head_dim) = match &tables {
            ShardTables::Keys { rope, .. } => (Some(rope.clone()), rope.head_dim()),
            ShardTables::Values { head_dim, .. } => (None, *head_dim),
        };
        Self::build(
            form,
            (block_size, channels, num_blocks),
            Some(tables),
            rope,
            head_dim,
        )
    }

    /// Zeroed blocks of the Shard `form` whose tables each sequence fits
    /// on its own rows ([`StoredPart::fit_sequence`]); NF4 values need
    /// none and are coded as [`new`](Self::new) codes them.
    pub fn fitting_per_sequence(
        form: CacheForm,
        block_size: usize,
        channels: usize,
        num_blocks: usize,
        fit: SequenceFit,
    ) -> Result<Self> {
        let spec = check_shard_form(form, block_size)?;
        let shape = (block_size, channels, num_blocks);
        match fit {
            SequenceFit::Keys(rope) => {
                let head_dim = rope.head_dim();
                Self::build(form, shape, None, Some(rope), head_dim)
            }
            SequenceFit::Values { head_dim } if spec.values == ShardValues::Nf4 => {
                let tables = ShardTables::Values {
                    prototype: None,
                    head_dim,
                };
                Self::build(form, shape, Some(tables), None, head_dim)
            }
            SequenceFit::Values { head_dim } => Self::build(form, shape, None, None, head_dim),
        }
    }

    fn build(
        form: CacheForm,
        (block_size, channels, num_blocks): (usize, usize, usize),
        tables: Option<ShardTables>,
        rope: Option<Rope>,
        head_dim: usize,
    ) -> Result<Self> {
        let spec = check_shard_form(form, block_size)?;
        if head_dim == 0 || !channels.is_multiple_of(head_dim) {
            return Err(AttentionError::InvalidParameter {
                name: "channels",
                reason: format!("{channels} channels are not whole heads of {head_dim} ({form})"),
            });
        }
        let shared = Shared::of(tables.as_ref(), &form);
        let mut part = Self {
            blocks: StagedBlocks::new(form.exact_rows_form(), block_size, channels, num_blocks),
            form,
            fit_blocks: if tables.is_some() {
                0
            } else {
                // More rows than a key has channels, so the fitted basis
                // has every component (PCA keeps at most rows − 1), and at
                // least as many groups of 4 values as the codebook has
                // centroids.
                let centroids = kv_quant::channel_vq::CENTROIDS * 4;
                (channels + 1)
                    .max(centroids.div_ceil(channels.max(1)))
                    .div_ceil(block_size)
            },
            tables,
            rope,
            head_dim,
            channels,
            block_size,
            sink_blocks: form.segments().sink.div_ceil(block_size),
            window: form.segments().window,
            sealed_bytes: 0,
            rotation: None,
            shared,
        };
        let zero = vec![0.0; block_size * channels];
        match (&part.tables, &part.rope) {
            (Some(tables), _) => {
                let sealed = code(tables, form.protection().copied(), (channels, &zero), 0)?;
                part.sealed_bytes = sealed.stored_bytes();
                part.rotation = match &sealed {
                    ShardBlock::Keys { .. } => None,
                    ShardBlock::Vq { values, .. } => Some(values.hadamard()),
                    ShardBlock::Nf4(s) => KvSource::rotation(&**s),
                };
            }
            (None, Some(_)) => {
                // What a fit would refuse, refused before any row is
                // written (kv-lowrank's `ShardKeys::fit`).
                let budget_bits = (spec.key_bits() * channels as f64).floor() as usize;
                let kept = spec.rank.unwrap_or(channels);
                let cheapest = 2 * spec.group.min(kept);
                if !channels.is_multiple_of(4) || kept > channels || budget_bits < cheapest {
                    return Err(AttentionError::Store(KvQuantError::InvalidSpec {
                        spec: form.to_string(),
                        reason: format!(
                            "cannot fit keys of {channels} channels: a rank of {kept} (at most \
                             the channels, a multiple of 4), {budget_bits} bits per token for \
                             groups of {} components at 2 bits at least",
                            spec.group
                        ),
                    }));
                }
                // At most: the allocation spends at most the budget's bits
                // per token, and keeps at most `rank` components, each
                // with an f16 step per block.
                let codes = block_size * (budget_bits / 8);
                part.sealed_bytes = match form.protection() {
                    Some(p) => BlockGuard::stored_len(p.code, p.metadata, codes, kept),
                    None => codes + 2 * kept,
                };
            }
            (None, None) => {
                let template = ChannelVq::from_codebook(
                    channels,
                    head_dim,
                    &[0.0; kv_quant::channel_vq::CENTROIDS * 4],
                )?;
                let sealed = template.encode_chunk(&zero, block_size)?;
                part.sealed_bytes = match form.protection() {
                    Some(p) => BlockGuard::stored_len(
                        p.code,
                        p.metadata,
                        sealed.indices().len(),
                        sealed.max().len(),
                    ),
                    None => sealed.stored_bytes() - sealed.shared_bytes(),
                };
                part.rotation = Some(sealed.hadamard());
            }
        }
        Ok(part)
    }

    /// [`PoolBytes`] of [`open`](Self::open): every block counted at the
    /// larger of its exact and sealed bytes; where each sequence fits its
    /// own tables, those tables (an int8 key basis of at most `rank` rows,
    /// or a codebook) and a fit's buffers (its rows in f32, the PCA's f64
    /// copies and its d × d matrices).
    pub fn pool_bytes(
        form: CacheForm,
        block_size: usize,
        channels: usize,
        num_blocks: usize,
        fitted: &Fitted,
    ) -> Result<PoolBytes> {
        let part = Self::open(form, block_size, channels, 0, fitted)?;
        let exact = KvStore::zeroed(form.exact_rows_form(), block_size, channels)?.stored_bytes();
        let (sequence, fitting) = if part.per_sequence() {
            let Quantizer::Shard(spec) = *form.quantizer() else {
                unreachable!("a Shard part holds a Shard form");
            };
            let kept = spec.rank.unwrap_or(channels).min(channels);
            let tables = match part.rope {
                Some(_) => kept * channels + 2 * kept + 2 * channels,
                None => 2 * kv_quant::channel_vq::CENTROIDS * 4,
            };
            // Stored under the metadata code (`SequenceShard`).
            let meta = form
                .protection()
                .map_or(kv_quant::MetaProtection::Unprotected, |p| p.metadata);
            let tables = kv_quant::ProtectedTable::stored_len(tables, meta);
            // The fit's f32 rows, the PCA's f64 copy and transpose, its
            // d × d moment and eigenvectors (kv-lowrank's `Basis::fit`).
            let (n, d) = (part.fit_rows_at_most(), channels);
            let fit = 4 * n * d + 16 * n * d + 16 * d * d;
            (tables as u64, fit as u64)
        } else {
            (0, 0)
        };
        Ok(PoolBytes {
            blocks: (part.sealed_bytes.max(exact) as u64).saturating_mul(num_blocks as u64),
            building: 0,
            sequence,
            fitting,
        })
    }

    /// A sequence's tables of this part (its kind: keys or values), or why
    /// `tables` are not.
    fn sequence_tables<'t>(&self, tables: &'t SequenceTables) -> Result<&'t SequenceShard> {
        let stored = tables.get::<SequenceShard>();
        let kind = match stored.map(SequenceShard::tables).transpose()? {
            Some(ShardTables::Keys { .. }) => Some(true),
            Some(ShardTables::Values { .. }) => Some(false),
            None => None,
        };
        match (stored, kind) {
            (Some(s), Some(keys)) if keys == self.rope.is_some() => Ok(s),
            _ => Err(AttentionError::InvalidParameter {
                name: "sequence tables",
                reason: format!("{tables:?} are not tables of this {} part", self.form),
            }),
        }
    }

    /// Rows a sequence's tables are fitted on at most: the first
    /// [`MAX_FIT_ROWS`] rows of its middle, in whole blocks, and never
    /// fewer than a fit needs (more rows than a key has channels).
    fn fit_rows_at_most(&self) -> usize {
        MAX_FIT_ROWS.div_ceil(self.block_size).max(self.fit_blocks) * self.block_size
    }

    /// Rows `offset..offset + out.len() / channels` of `block` as f32, in
    /// the part's [`rotation`](StoredPart::rotation) where `rotated`.
    fn decode(
        &self,
        block: usize,
        offset: usize,
        out: &mut [f32],
        rotated: bool,
        (scratch, coeffs): (&mut DecodeScratch, &mut Vec<f32>),
    ) -> Result<KvDecodeStats> {
        let rotation = self.rotation.filter(|_| rotated);
        if let Some(stats) = self.blocks.read_unsealed(block, offset, out, scratch)? {
            if let Some(h) = rotation {
                h.rotate(out);
            }
            return Ok(stats);
        }
        let BlockState::Sealed(sealed) = self.blocks.get(block)? else {
            unreachable!("read_unsealed reads the others");
        };
        let n = out.len() / self.channels;
        match (sealed, rotation) {
            (ShardBlock::Vq { values, .. }, Some(_)) => {
                values.rotated_rows_into(offset, n, out)?;
                Ok(sealed.read_stats(offset))
            }
            (ShardBlock::Nf4(store), Some(_)) => {
                scratch.limit_neighbours(None);
                Ok(store.decode_rows_rotated_into(offset, n, out, scratch)?)
            }
            _ => decode_sealed(
                self.rope.as_ref(),
                self.channels,
                sealed,
                offset,
                out,
                (scratch, coeffs),
            ),
        }
    }

    /// Whether a sealed block was coded on this part's table, as fitted or
    /// as faults left it (the table as read), or, where each sequence fits
    /// its own, on tables of this part's shape and budget.
    fn fits(&self, sealed: &ShardBlock) -> bool {
        // Stored under this form's codes, or bare where it has none.
        let codes = |g: &BlockGuard| (g.code(), g.metadata());
        let holds = match sealed {
            ShardBlock::Keys {
                keys,
                guard: Some(g),
                ..
            } => g.holds(keys.codes().len(), keys.scales().len()),
            ShardBlock::Vq {
                values,
                guard: Some(g),
            } => g.holds(values.indices().len(), values.max().len()),
            _ => true,
        };
        holds
            && sealed.guard().map(codes) == self.form.protection().map(|p| (p.code, p.metadata))
            && self.fits_tables(sealed)
    }

    /// [`fits`](Self::fits) as to the tables.
    fn fits_tables(&self, sealed: &ShardBlock) -> bool {
        let (bs, ch) = (self.block_size, self.channels);
        if self.tables.is_none() {
            return match sealed {
                ShardBlock::Keys { keys, .. } => {
                    let Quantizer::Shard(spec) = self.form.quantizer() else {
                        return false;
                    };
                    let budget_bits = (spec.key_bits() * ch as f64).floor() as usize;
                    self.rope.is_some()
                        && keys.tokens() == bs
                        && keys.dim() == ch
                        && keys.kept() <= spec.rank.unwrap_or(ch)
                        && keys.row_bytes() * 8 <= budget_bits
                }
                ShardBlock::Vq { values: v, .. } => {
                    self.rope.is_none()
                        && v.tokens() == bs
                        && v.channels() == ch
                        && Some(v.hadamard()) == self.rotation
                }
                ShardBlock::Nf4(_) => false,
            };
        }
        match (sealed, &self.shared, &self.tables) {
            (ShardBlock::Keys { keys, .. }, Shared::Keys(t), _) => {
                keys.tokens() == bs
                    && keys.dim() == ch
                    && [t.fitted(), t.read()]
                        .iter()
                        .any(|p| keys.basis() == p.basis() && keys.allocation() == p.allocation())
            }
            (ShardBlock::Vq { values: v, .. }, Shared::Vq(t), _) => {
                v.tokens() == bs
                    && v.channels() == ch
                    && [t.fitted(), t.read()]
                        .iter()
                        .any(|p| v.centroids() == p.centroids() && v.hadamard() == p.hadamard())
            }
            (ShardBlock::Nf4(s), Shared::None, Some(ShardTables::Values { head_dim, .. })) => {
                // Tiles come in the part's rotation: a block of another
                // NF4 form (another rotation) would read wrong.
                s.tokens() == bs
                    && s.channels() == ch
                    && crate::shard::nf4_form(*head_dim).is_ok_and(|f| *s.form() == f)
            }
            _ => false,
        }
    }

    /// After faults changed the table as read: new blocks are coded on it
    /// and every sealed block reads through it.
    fn reread(&mut self) -> Result<()> {
        let Some(tables) = &mut self.tables else {
            return Ok(());
        };
        self.shared.reread_into(tables);
        if let Some(tables) = &self.tables {
            for block in self.blocks.iter_mut() {
                if let BlockState::Sealed(sealed) = block {
                    repoint(sealed, tables)?;
                }
            }
        }
        Ok(())
    }
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
        self.blocks.exact_form()
    }

    fn shared_bytes(&self) -> usize {
        self.shared.stored_bytes()
    }

    fn inject_shared(
        &mut self,
        channel: &dyn FaultChannel,
        seed: u64,
        target: FaultTarget,
    ) -> Result<Injection> {
        let (injection, changed) = self.shared.inject(channel, seed, target)?;
        if changed {
            self.reread()?;
        }
        Ok(injection)
    }

    fn shared_stats(&self) -> gf2_codes::DecodeStats {
        self.shared.stats()
    }

    fn scrub_shared(&mut self) -> Result<gf2_codes::DecodeStats> {
        Ok(self.shared.scrub())
    }

    fn open_block(&mut self, block: usize) -> Result<()> {
        self.blocks.open(block)
    }

    fn put_row(&mut self, block: usize, offset: usize, row: &RowBuffers) -> Result<()> {
        // A sequence cut back into a sealed block: staged again from the
        // rows it reads as.
        // Row by row, as `read_rows` reads them (a key row rebuilt in a
        // tile of several rounds its sums another way).
        let (rope, ch) = (self.rope.as_ref(), self.channels);
        self.blocks.put_row(block, offset, row, |sealed, rows| {
            let (mut scratch, mut coeffs) = (DecodeScratch::new(), Vec::new());
            for (i, row) in rows.chunks_exact_mut(ch).enumerate() {
                decode_sealed(rope, ch, sealed, i, row, (&mut scratch, &mut coeffs))?;
            }
            Ok(())
        })
    }

    fn sealable(&self, before: usize, after: usize) -> Range<usize> {
        // Blocks whose rows have all left the window, past the sink; where
        // each sequence fits its tables, none until the first fit has
        // enough rows, then all of them (blocks sealed already are left).
        let out =
            |n: usize| (n.saturating_sub(self.window) / self.block_size).max(self.sink_blocks);
        let ready = |n: usize| out(n) >= self.sink_blocks + self.fit_blocks;
        if !ready(after) {
            return out(before)..out(before);
        }
        let first = if ready(before) {
            out(before)
        } else {
            self.sink_blocks
        };
        first..out(after).max(first)
    }

    fn seal(&mut self, block: usize, first: usize) -> Result<bool> {
        let (Some(tables), ch, protection) =
            (&self.tables, self.channels, self.form.protection().copied())
        else {
            return Err(AttentionError::InvalidParameter {
                name: "sequence tables",
                reason: format!(
                    "{} codes each sequence's blocks on tables fitted on its rows \
                     (fit_sequence, then seal_on)",
                    self.form
                ),
            });
        };
        self.blocks
            .seal(block, |rows| code(tables, protection, (ch, rows), first))
    }

    fn per_sequence(&self) -> bool {
        self.tables.is_none()
    }

    fn fit_sequence(&self, pages: &[u32], blocks: Range<usize>) -> Result<SequenceTables> {
        let (bs, ch) = (self.block_size, self.channels);
        let Quantizer::Shard(spec) = *self.form.quantizer() else {
            unreachable!("a Shard part holds a Shard form");
        };
        if self.tables.is_some() {
            return Err(AttentionError::InvalidParameter {
                name: "sequence tables",
                reason: format!("{} codes every block on the part's own tables", self.form),
            });
        }
        if blocks.end > pages.len() || blocks.len() < self.fit_blocks.max(1) {
            return Err(AttentionError::InvalidParameter {
                name: "blocks",
                reason: format!(
                    "tables are fitted on at least {} blocks of a sequence's table, not \
                     positions {blocks:?} of {}",
                    self.fit_blocks.max(1),
                    pages.len()
                ),
            });
        }
        // The first rows of the middle, up to a bound on a fit's memory.
        let blocks = blocks.start..blocks.end.min(blocks.start + self.fit_rows_at_most() / bs);
        let n = blocks.len() * bs;
        let mut rows = vec![0.0; n * ch];
        let mut scratch = DecodeScratch::new();
        for (i, b) in blocks.clone().enumerate() {
            let out = &mut rows[i * bs * ch..(i + 1) * bs * ch];
            self.read_rows(pages[b] as usize, 0, out, &mut scratch)?;
        }
        clamp_non_finite(&mut rows);
        let tables = match &self.rope {
            Some(rope) => {
                let first = blocks.start * bs;
                for (i, row) in rows.chunks_exact_mut(ch).enumerate() {
                    rope.undo(row, first + i)?;
                }
                let fitted =
                    ShardKeys::fit_tables(&rows, n, ch, spec.key_bits(), spec.group, spec.rank)?;
                ShardTables::Keys {
                    prototype: Arc::new(fitted),
                    rope: rope.clone(),
                }
            }
            None => ShardTables::Values {
                prototype: Some(Arc::new(
                    ChannelVq::fit(&rows, n, ch, self.head_dim, crate::SHARD_VALUE_FIT)?.tables(),
                )),
                head_dim: self.head_dim,
            },
        };
        // Stored under the form's metadata code, counted with its checks.
        let (stored, bytes) = SequenceShard::new(tables, &self.form);
        Ok(SequenceTables::new(stored, bytes))
    }

    fn seal_on(&mut self, block: usize, first: usize, tables: &SequenceTables) -> Result<bool> {
        if self.tables.is_some() {
            return self.seal(block, first);
        }
        let (ch, protection) = (self.channels, self.form.protection().copied());
        let read = self.sequence_tables(tables)?.tables()?;
        self.blocks
            .seal(block, |rows| code(&read, protection, (ch, rows), first))
    }

    fn inject_sequence(
        &mut self,
        tables: &SequenceTables,
        channel: &dyn FaultChannel,
        seed: u64,
        target: FaultTarget,
    ) -> Result<Injection> {
        if self.tables.is_some() {
            return Ok(Injection::default());
        }
        let stored = self.sequence_tables(tables)?;
        let before = stored.tables()?;
        let (injection, changed) = stored.inject(channel, seed, target)?;
        if let Some(read) = changed {
            // Every block coded on the tables as they read before (the
            // sequence's, its forks') reads through them as they are now.
            for block in self.blocks.iter_mut() {
                if let BlockState::Sealed(sealed) = block
                    && coded_on(sealed, &before)
                {
                    repoint(sealed, &read)?;
                }
            }
        }
        Ok(injection)
    }

    fn sequence_stats(&self, tables: &SequenceTables) -> Result<gf2_codes::DecodeStats> {
        if self.tables.is_some() {
            return Ok(gf2_codes::DecodeStats::default());
        }
        self.sequence_tables(tables)?.stats()
    }

    fn scrub_sequence(&mut self, tables: &SequenceTables) -> Result<gf2_codes::DecodeStats> {
        if self.tables.is_some() {
            return Ok(gf2_codes::DecodeStats::default());
        }
        self.sequence_tables(tables)?.scrub()
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
        self.decode(block, offset, out, false, (scratch, &mut Vec::new()))
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
            coeffs,
            ..
        } = scratch;
        let layout = (pages, self.block_size, self.channels);
        super::decode_pages(rows, layout, start, count, |page, offset, out| {
            self.decode(page, offset, out, true, (decode, coeffs))
        })
    }

    fn row_bytes(&self) -> usize {
        self.sealed_bytes.div_ceil(self.block_size)
    }

    fn rotation(&self) -> Option<&'static Hadamard> {
        self.rotation
    }

    fn snapshot(&self, block: usize) -> Result<PartBlock> {
        self.blocks
            .snapshot(block, |sealed| PartBlock::of_shard(sealed.clone()))
    }

    fn accepts(&self, data: &PartBlock) -> bool {
        match data.shard() {
            Some(sealed) => {
                data.stores().is_empty()
                    && data.bytes().is_empty()
                    && data.low_rank().is_none()
                    && self.fits(sealed)
            }
            None => self.blocks.accepts_unsealed(data),
        }
    }

    fn restore(&mut self, block: usize, data: &PartBlock) -> Result<()> {
        self.blocks.get(block)?;
        if !self.accepts(data) {
            return Err(AttentionError::InvalidParameter {
                name: "block data",
                reason: format!(
                    "it does not hold a block of {} rows of {} channels in {} on this part's \
                     tables",
                    self.block_size, self.channels, self.form
                ),
            });
        }
        // Coded on the tables as fitted or as read; read through them as
        // they are now (a sequence's own tables travel with the block).
        let tables = self.tables.as_ref();
        self.blocks.restore(block, data, |data| {
            data.shard()
                .map(|sealed| {
                    let mut sealed = sealed.clone();
                    if let Some(tables) = tables {
                        repoint(&mut sealed, tables)?;
                    }
                    Ok(sealed)
                })
                .transpose()
        })
    }

    fn scrub(&mut self, block: usize) -> Result<ScrubStats> {
        self.blocks.scrub_with(block, ShardBlock::scrub)
    }

    fn inject(
        &mut self,
        block: usize,
        channel: &dyn FaultChannel,
        seed: u64,
        target: FaultTarget,
    ) -> Result<Injection> {
        let bs = self.block_size;
        let (codes, scales) = (
            target != FaultTarget::Metadata,
            target != FaultTarget::Values,
        );
        self.blocks.inject(block, channel, seed, target, |sealed| {
            // The codes or indices (stream 0 of `seed`) and the block's f16
            // scales (stream 1: the keys' per-component steps, the values'
            // channel maxima), as a kv-quant store splits values and scales;
            // under a coded spelling, their stored bits (`BlockGuard`).
            let (data, steps, guard) = match sealed {
                ShardBlock::Keys { keys, guard, .. } => {
                    let (codes, steps) = keys.codes_and_scales_mut();
                    (codes, steps, guard)
                }
                ShardBlock::Vq { values, guard } => {
                    let (indices, max) = values.indices_and_max_mut();
                    (indices, max, guard)
                }
                ShardBlock::Nf4(store) => {
                    return Ok(store.inject_rows(0..bs, channel, seed, target)?);
                }
            };
            if let Some(guard) = guard {
                return guard.inject((data, steps), channel, seed, target);
            }
            Ok(Injection {
                values: if codes {
                    channel.inject(data, seed)
                } else {
                    Default::default()
                },
                scales: if scales {
                    inject_f16(steps, channel, seed)
                } else {
                    Default::default()
                },
                ..Injection::default()
            })
        })
    }

    fn block_bytes(&self, block: usize) -> usize {
        self.blocks
            .block_bytes(block, ShardBlock::stored_bytes, self.sealed_bytes)
    }

    fn sealed_block_bytes(&self) -> usize {
        self.sealed_bytes
    }
}
