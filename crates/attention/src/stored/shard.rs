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
//! other. A page of keys is read by rebuilding its rows (one GEMM of its
//! coefficients on the basis, then RoPE at the page's positions with one
//! `sin_cos` per pair for the page: `Rope::apply_rows`); a page of values
//! comes in the codebook's Hadamard rotation, exact rows rotated to match,
//! and attention rotates the weighted sum back once per output.
//!
//! Differences from the re-encode protocol's `ShardLayer`, by design: the
//! basis, bit allocation and codebook are the calibration's (not fitted on
//! the prefill), every block beyond the sink and window is compressed
//! (prefill and generated tokens alike: no Lloyd-Max decode stream), the
//! per-component scales are per block, and tiles are rebuilt rows rather
//! than scores taken in coefficient space. The window is exact for the
//! sequence that seals: a block shared through the prefix cache is sealed
//! when the longest sequence holding it moves past it, so a shorter one
//! may read that block coded within its own window (as it may after a
//! committed truncation back into sealed blocks). Faults reach every
//! stored bit of a sealed block: the codes or indices under `values` and
//! `everything`, the block's f16 scales (the keys' per-component steps,
//! the values' channel maxima) under `metadata` and `everything`, all
//! unprotected; the fitted table the part reads (the key basis, the value
//! codebook) is stored once per part as a [`SharedTable`], hit under
//! `metadata` and `everything` (unprotected too: the form is), and every
//! sealed block reads through it as faults leave it. Not yet: coded
//! spellings (`shard+secded84`) and the per-sequence forms (`shard-k3`:
//! bases fitted on each prefill). kv-eval's calibration file carries every
//! table (the key basis, the bit allocation and the value codebook), with
//! check words.

use std::ops::Range;
use std::sync::Arc;

use faer::linalg::matmul::matmul;
use faer::{Accum, MatMut, MatRef, Par};
use gf2_codes::channel::{FaultChannel, FaultRng, Flips};
use half::f16;
use kv_lowrank::ShardKeys;
use kv_quant::{
    CacheForm, ChannelVq, DecodeScratch, FaultTarget, Hadamard, Injection, KvDecodeStats,
    KvQuantError, KvStore, Quantizer, RowBuffers, ScrubStats,
};

use super::staging::{BlockState, StagedBlocks};
use super::{PartBlock, PartScratch, PoolBytes, SharedTable, StoredPart};
use crate::error::{AttentionError, Result};
use crate::rope::Rope;
use crate::source::{KvSource, Tile};

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

/// A calibrated Shard form kept in blocks (see the module docs).
#[derive(Debug)]
pub struct ShardPart {
    form: CacheForm,
    tables: ShardTables,
    channels: usize,
    block_size: usize,
    /// Blocks holding sink tokens (never sealed).
    sink_blocks: usize,
    /// Rows kept exact at the end of the sequence.
    window: usize,
    blocks: StagedBlocks<ShardBlock>,
    /// Bytes of one sealed block.
    sealed_bytes: usize,
    /// The Hadamard rotation sealed values are coded in: value tiles come
    /// in it (the sum is rotated back once per output, not once per row).
    rotation: Option<&'static Hadamard>,
    /// The fitted table the blocks read (the key basis, the value
    /// codebook), as stored, protected bytes; `tables` holds it as read.
    shared: Shared,
}

/// A [`ShardPart`]'s fitted table as stored bytes.
#[derive(Debug)]
enum Shared {
    /// The keys' basis.
    Keys(SharedTable<ShardKeys>),
    /// The values' codebook.
    Vq(SharedTable<ChannelVq>),
    /// NF4 values read no table.
    None,
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
        check_shard_form(form, block_size)?;
        let shared = match &tables {
            ShardTables::Keys { prototype, .. } => {
                Shared::Keys(SharedTable::new(prototype.clone(), &form))
            }
            ShardTables::Values {
                prototype: Some(p), ..
            } => Shared::Vq(SharedTable::new(p.clone(), &form)),
            ShardTables::Values {
                prototype: None, ..
            } => Shared::None,
        };
        let mut part = Self {
            blocks: StagedBlocks::new(form.exact_rows_form(), block_size, channels, num_blocks),
            form,
            tables,
            channels,
            block_size,
            sink_blocks: form.segments().sink.div_ceil(block_size),
            window: form.segments().window,
            sealed_bytes: 0,
            rotation: None,
            shared,
        };
        let zero = code(&part.tables, channels, &vec![0.0; block_size * channels], 0)?;
        part.sealed_bytes = zero.stored_bytes();
        part.rotation = match &zero {
            ShardBlock::Keys { .. } => None,
            ShardBlock::Vq(v) => Some(v.hadamard()),
            ShardBlock::Nf4(s) => KvSource::rotation(&**s),
        };
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
            (ShardBlock::Vq(values), Some(_)) => values.rotated_rows_into(offset, n, out)?,
            (ShardBlock::Nf4(store), Some(_)) => {
                scratch.limit_neighbours(None);
                return Ok(store.decode_rows_rotated_into(offset, n, out, scratch)?);
            }
            _ => {
                return decode_sealed(
                    &self.tables,
                    self.channels,
                    sealed,
                    offset,
                    out,
                    (scratch, coeffs),
                );
            }
        }
        Ok(KvDecodeStats::default())
    }

    /// Whether a sealed block was coded on this part's table, as fitted or
    /// as faults left it (the table as read).
    fn fits(&self, sealed: &ShardBlock) -> bool {
        let (bs, ch) = (self.block_size, self.channels);
        match (sealed, &self.shared, &self.tables) {
            (ShardBlock::Keys { keys, .. }, Shared::Keys(t), _) => {
                keys.tokens() == bs
                    && keys.dim() == ch
                    && [t.fitted(), t.read()]
                        .iter()
                        .any(|p| keys.basis() == p.basis() && keys.allocation() == p.allocation())
            }
            (ShardBlock::Vq(v), Shared::Vq(t), _) => {
                v.tokens() == bs
                    && v.channels() == ch
                    && [t.fitted(), t.read()]
                        .iter()
                        .any(|p| v.centroids() == p.centroids() && v.hadamard() == p.hadamard())
            }
            (ShardBlock::Nf4(s), Shared::None, ShardTables::Values { head_dim, .. }) => {
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
        match (&self.shared, &mut self.tables) {
            (Shared::Keys(t), ShardTables::Keys { prototype, .. }) => {
                *prototype = t.read().clone();
            }
            (Shared::Vq(t), ShardTables::Values { prototype, .. }) => {
                *prototype = Some(t.read().clone());
            }
            _ => return Ok(()),
        }
        for block in self.blocks.iter_mut() {
            if let BlockState::Sealed(sealed) = block {
                repoint(sealed, &self.tables)?;
            }
        }
        Ok(())
    }
}

/// Makes `sealed` read through `tables` (the part's table as read now).
fn repoint(sealed: &mut ShardBlock, tables: &ShardTables) -> Result<()> {
    match (sealed, tables) {
        (ShardBlock::Keys { keys, .. }, ShardTables::Keys { prototype, .. }) => {
            keys.share_basis(prototype)?;
        }
        (
            ShardBlock::Vq(v),
            ShardTables::Values {
                prototype: Some(p), ..
            },
        ) => v.share_codebook(p),
        _ => {}
    }
    Ok(())
}

/// `rows` (one block of `channels`-value rows, as written) coded on
/// `tables`; `first` is the position of the first row.
fn code(tables: &ShardTables, channels: usize, rows: &[f32], first: usize) -> Result<ShardBlock> {
    let bs = rows.len() / channels;
    Ok(match tables {
        ShardTables::Keys { prototype, rope } => {
            let mut unrotated = rows.to_vec();
            for (i, row) in unrotated.chunks_exact_mut(channels).enumerate() {
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
                channels,
                super::clamped(),
            )?))
        }
    })
}

/// Rows `offset..offset + out.len() / channels` of a sealed block read
/// through `tables` (keys rotated back to their positions).
fn decode_sealed(
    tables: &ShardTables,
    channels: usize,
    sealed: &ShardBlock,
    offset: usize,
    out: &mut [f32],
    (scratch, coeffs): (&mut DecodeScratch, &mut Vec<f32>),
) -> Result<KvDecodeStats> {
    match sealed {
        ShardBlock::Keys { keys, first } => {
            let ShardTables::Keys { rope, .. } = tables else {
                unreachable!("a key part holds key blocks");
            };
            // The rows' coefficients at once, then `K = μ + C·B` as one
            // small GEMM (faer's kernels, as `ShardLayer` rebuilds a tile:
            // row by row the axpy loops ran 10x slower), then RoPE.
            let (n, kept) = (out.len() / channels, keys.kept());
            coeffs.resize(n * kept, 0.0);
            keys.coefficients_into(offset, n, &mut coeffs[..n * kept])?;
            let basis = keys.basis();
            for row in out.chunks_exact_mut(channels) {
                row.copy_from_slice(basis.mean());
            }
            if kept > 0 {
                matmul(
                    MatMut::from_row_major_slice_mut(out, n, channels),
                    Accum::Add,
                    MatRef::from_row_major_slice(&coeffs[..n * kept], n, kept),
                    MatRef::from_row_major_slice(basis.rows(), kept, channels),
                    1.0f32,
                    Par::Seq,
                );
            }
            rope.apply_rows(out, channels, first + offset)?;
        }
        ShardBlock::Vq(values) => values.decode_rows_into(offset, out.len() / channels, out)?,
        ShardBlock::Nf4(store) => {
            scratch.limit_neighbours(None);
            return Ok(store.decode_rows_into(offset, out.len() / channels, out, scratch)?);
        }
    }
    Ok(KvDecodeStats::default())
}

/// Flips the f16 bits of `values` (f16 values held in f32) from stream 1 of
/// `channel`'s `seed`, positions counted in the f16 bytes laid end to end.
fn inject_f16(values: &mut [f32], channel: &dyn FaultChannel, seed: u64) -> Flips {
    let mut bytes: Vec<u8> = values
        .iter()
        .flat_map(|&v| f16::from_f32(v).to_le_bytes())
        .collect();
    let flips = channel.inject_with(&mut bytes, &mut FaultRng::with_stream(seed, 1));
    for (v, b) in values.iter_mut().zip(bytes.chunks_exact(2)) {
        *v = f16::from_le_bytes([b[0], b[1]]).to_f32();
    }
    flips
}

/// Whether blocks of `block_size` tokens can hold the Shard `form`
/// (what this part refuses, before anything is built).
pub(crate) fn check_shard_form(form: CacheForm, block_size: usize) -> Result<()> {
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
        match &self.shared {
            Shared::Keys(t) => t.stored_bytes(),
            Shared::Vq(t) => t.stored_bytes(),
            Shared::None => 0,
        }
    }

    fn inject_shared(
        &mut self,
        channel: &dyn FaultChannel,
        seed: u64,
        target: FaultTarget,
    ) -> Result<Injection> {
        let (injection, changed) = match &mut self.shared {
            Shared::Keys(t) => t.inject(channel, seed, target)?,
            Shared::Vq(t) => t.inject(channel, seed, target)?,
            Shared::None => return Ok(Injection::default()),
        };
        if changed {
            self.reread()?;
        }
        Ok(injection)
    }

    fn shared_stats(&self) -> gf2_codes::DecodeStats {
        match &self.shared {
            Shared::Keys(t) => t.stats(),
            Shared::Vq(t) => t.stats(),
            Shared::None => gf2_codes::DecodeStats::default(),
        }
    }

    fn scrub_shared(&mut self) -> Result<gf2_codes::DecodeStats> {
        Ok(match &mut self.shared {
            Shared::Keys(t) => t.scrub(),
            Shared::Vq(t) => t.scrub(),
            Shared::None => gf2_codes::DecodeStats::default(),
        })
    }

    fn open_block(&mut self, block: usize) -> Result<()> {
        self.blocks.open(block)
    }

    fn put_row(&mut self, block: usize, offset: usize, row: &RowBuffers) -> Result<()> {
        // A sequence cut back into a sealed block: staged again from the
        // rows it reads as.
        // Row by row, as `read_rows` reads them (a key row rebuilt in a
        // tile of several rounds its sums another way).
        let (tables, ch) = (&self.tables, self.channels);
        self.blocks.put_row(block, offset, row, |sealed, rows| {
            let (mut scratch, mut coeffs) = (DecodeScratch::new(), Vec::new());
            for (i, row) in rows.chunks_exact_mut(ch).enumerate() {
                decode_sealed(tables, ch, sealed, i, row, (&mut scratch, &mut coeffs))?;
            }
            Ok(())
        })
    }

    fn sealable(&self, before: usize, after: usize) -> Range<usize> {
        // Blocks whose rows have all left the window, past the sink.
        let out =
            |n: usize| (n.saturating_sub(self.window) / self.block_size).max(self.sink_blocks);
        let first = out(before);
        first..out(after).max(first)
    }

    fn seal(&mut self, block: usize, first: usize) -> Result<bool> {
        let (tables, ch) = (&self.tables, self.channels);
        self.blocks
            .seal(block, |rows| code(tables, ch, rows, first))
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
        // they are now.
        let tables = &self.tables;
        self.blocks.restore(block, data, |data| {
            data.shard()
                .map(|sealed| {
                    let mut sealed = sealed.clone();
                    repoint(&mut sealed, tables)?;
                    Ok(sealed)
                })
                .transpose()
        })
    }

    fn scrub(&mut self, block: usize) -> Result<ScrubStats> {
        self.blocks.scrub(block)
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
            // channel maxima), as a kv-quant store splits values and scales.
            let (data, steps) = match sealed {
                ShardBlock::Keys { keys, .. } => {
                    let data = codes.then(|| channel.inject(keys.codes_mut(), seed));
                    (
                        data,
                        scales.then(|| inject_f16(keys.scales_mut(), channel, seed)),
                    )
                }
                ShardBlock::Vq(values) => {
                    let data = codes.then(|| channel.inject(values.indices_mut(), seed));
                    (
                        data,
                        scales.then(|| inject_f16(values.max_mut(), channel, seed)),
                    )
                }
                ShardBlock::Nf4(store) => {
                    return Ok(store.inject_rows(0..bs, channel, seed, target)?);
                }
            };
            Ok(Injection {
                values: data.unwrap_or_default(),
                scales: steps.unwrap_or_default(),
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
