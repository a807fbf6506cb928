//! [`KvSource`]: the one trait attention reads a K or V cache through,
//! "give me rows `start..start+count` as f32", and its implementations for
//! plain f32 rows ([`DenseKv`]) and every kv-quant stored form
//! ([`KvStore`], with exact statistics from the store's fault ledger).
//!
//! A tile is f32 rows, or, for plain FP16 stores, the stored half floats
//! themselves ([`TileRows::F16`]), which the AVX-512 kernel widens in
//! registers: decoding FP16 into a buffer first took more time than the
//! attention arithmetic (measured at 32/8/128, 64K tokens). Integer forms
//! come as levels and group parameters ([`TileRows::Levels`]), keys coded
//! before RoPE on pair codebooks as codes, gains and angles
//! ([`TileRows::PairCodes`]).

use std::ops::Range;

use kv_quant::{
    DecodeScratch, GatheredLevels, Hadamard, KvDecodeStats, KvStore, LevelRows, RowsView,
};

use crate::error::{AttentionError, Result, check_len};
use crate::pair_codes::PairCodeRows;

/// The values of a tile as the attention kernel reads them: `count × channels`
/// values, row-major.
#[derive(Clone, Copy, Debug)]
pub enum TileRows<'s> {
    /// f32 values.
    F32(&'s [f32]),
    /// Little-endian IEEE half floats, two bytes per value (kv-quant's FP16
    /// row bytes); read exactly as [`kv_quant::widen_f16`] would widen them.
    F16(&'s [u8]),
    /// Integer levels and their group parameters, dequantized in the kernel
    /// exactly as [`LevelRows::dequantize_into`] would.
    Levels(LevelRows<'s>),
    /// Keys coded before RoPE on pair codebooks, with their rows' angles:
    /// scored against the codebook ([`PairCodeRows`]), read as values
    /// through [`PairCodeRows::widen_into`].
    PairCodes(PairCodeRows<'s>),
}

impl TileRows<'_> {
    /// Values held.
    pub fn len(&self) -> usize {
        match self {
            Self::F32(v) => v.len(),
            Self::F16(b) => b.len() / 2,
            Self::Levels(l) => l.rows() * l.channels(),
            Self::PairCodes(p) => p.rows() * p.channels(),
        }
    }

    /// Whether no values are held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The values as f32, as the kernels read them: copied, widened,
    /// dequantized or (pair codes) turned by their angles.
    pub fn to_f32_vec(&self) -> Vec<f32> {
        let mut out = vec![0.0; self.len()];
        match *self {
            Self::F32(v) => out.copy_from_slice(v),
            Self::F16(b) => kv_quant::widen_f16(b, &mut out),
            Self::Levels(l) => l.dequantize_into(&mut out),
            Self::PairCodes(p) => p.widen_into(&mut out),
        }
        out
    }

    /// The values `range` (element indices; whole rows of `channels`).
    pub(crate) fn slice(&self, range: Range<usize>, channels: usize) -> Self {
        match *self {
            Self::F32(v) => Self::F32(&v[range]),
            Self::F16(b) => Self::F16(&b[2 * range.start..2 * range.end]),
            Self::Levels(l) => {
                Self::Levels(l.sub_rows(range.start / channels, range.len() / channels))
            }
            Self::PairCodes(p) => {
                Self::PairCodes(p.sub_rows(range.start / channels, range.len() / channels))
            }
        }
    }
}

/// One tile of cache rows, with the statistics of decoding it.
#[derive(Debug)]
pub struct Tile<'s> {
    /// `count × channels` values, row-major.
    pub rows: TileRows<'s>,
    /// Decode statistics of these rows (all zero for plain f32 rows).
    pub stats: KvDecodeStats,
}

/// A K or V cache (`tokens × channels`, row `t` = the token at position `t`)
/// that attention reads tile by tile. Implementations decode into
/// `Scratch`, which the attention loop keeps per thread and reuses, so a
/// read does not allocate once the scratch has grown.
pub trait KvSource: Sync {
    /// Per-thread buffers for [`read_tile`](Self::read_tile).
    type Scratch: Default + Send;

    /// Cached tokens.
    fn tokens(&self) -> usize;

    /// Channels per token (`kv_heads × head_dim`).
    fn channels(&self) -> usize;

    /// Bytes this cache holds, counted from its buffers: what one full pass
    /// of attention reads.
    fn stored_bytes(&self) -> usize;

    /// Bytes one token's row takes in storage, group parameters not
    /// counted: what sizes attention's tiles
    /// ([`AttentionConfig::tile_bytes`](crate::AttentionConfig::tile_bytes)).
    /// The default divides [`stored_bytes`](Self::stored_bytes) by
    /// [`tokens`](Self::tokens); a source whose byte count depends on how
    /// it is laid out (whole blocks, groups over blocks of tokens) should
    /// give its form's size per row, so that the tiling does not change
    /// with the token count or the layout.
    fn row_bytes(&self) -> usize {
        self.stored_bytes().div_ceil(self.tokens().max(1))
    }

    /// Tokens per block of a source stored in blocks, which a tile should
    /// not cross to be read as stored (a paged source's block size, or a
    /// run of blocks its part reads as one tile, such as a sealed group
    /// of several pages: a tile
    /// over blocks that are not adjacent is decoded into f32 rows first,
    /// or has its blocks' levels copied side by side where the source
    /// [gathers](Self::gathers_blocks)); `None` (the default) for unblocked
    /// sources. Byte-sized tiles are halved until they divide it (not
    /// below 16 rows, so blocks smaller than that, or not a multiple of a
    /// tile size, still see tiles that cross them), except for blocks of
    /// at most a quarter of the tile of a source that gathers them.
    fn block_tokens(&self) -> Option<usize> {
        None
    }

    /// Where the source's runs of [`block_tokens`](Self::block_tokens)
    /// begin: tiles are cut at multiples of the tile size up to this row
    /// and at this row plus multiples of it after (a paged part whose
    /// per-channel groups of several blocks start after exact sink
    /// blocks). 0 (the default) for sources whose runs start at row 0.
    /// Attention honours one origin per call: where keys and values name
    /// two different ones, tiles start at row 0 and those crossing a run
    /// are read the slower way.
    fn tile_origin(&self) -> usize {
        0
    }

    /// Whether a tile over blocks that are not adjacent still reaches the
    /// kernel as stored, its blocks' rows copied side by side (a paged
    /// source of a form read as levels:
    /// [`BlockedScratch::read_blocks`]), rather than decoded into f32. Then
    /// attention lets byte-sized tiles cross blocks of at most a quarter of
    /// a tile, whose own tiles would cost more than the copy (measured on
    /// the paged cache's decode bench: blocks of 16 and 32 gain, a block
    /// of half a tile gains nothing and is read as stored). The default is
    /// `false`.
    fn gathers_blocks(&self) -> bool {
        false
    }

    /// Rows `start..start + count` as f32. Callers keep
    /// `start + count <= tokens()` and `count > 0`.
    fn read_tile<'s>(
        &'s self,
        start: usize,
        count: usize,
        scratch: &'s mut Self::Scratch,
    ) -> Result<Tile<'s>>;

    /// The memory addresses of the stored bytes of rows `start..start +
    /// count` when they are one contiguous range, `None` otherwise (the
    /// default). Attention prefetches the next tile's range while it works
    /// on the current one; nothing is read through it.
    fn row_addresses(&self, start: usize, count: usize) -> Option<Range<usize>> {
        let _ = (start, count);
        None
    }

    /// The memory addresses of the stored bytes of rows `start..start +
    /// count`, one range per run of contiguous rows, given to `each` (a
    /// paged source's tile over pages that are not adjacent: one range per
    /// page). The default gives [`row_addresses`](Self::row_addresses)'
    /// range, if any. Attention prefetches them as it does that range.
    fn row_address_ranges(&self, start: usize, count: usize, each: &mut dyn FnMut(Range<usize>)) {
        if let Some(range) = self.row_addresses(start, count) {
            each(range);
        }
    }

    /// The rotation the tiles come in, if any (kv-quant's `+rot`, `lm` and
    /// `vq` forms keep their rows rotated): attention rotates the queries
    /// by it before scoring keys, and rotates the weighted sum of values
    /// back once per output, so no tile is ever rotated back. `None` (the
    /// default) for sources whose tiles are the values themselves.
    fn rotation(&self) -> Option<&'static Hadamard> {
        None
    }
}

/// The address range of `items` (for [`KvSource::row_addresses`]).
fn addresses<T>(items: &[T]) -> Range<usize> {
    let range = items.as_ptr_range();
    range.start as usize..range.end as usize
}

impl<S: KvSource + ?Sized> KvSource for &S {
    type Scratch = S::Scratch;

    fn tokens(&self) -> usize {
        (**self).tokens()
    }

    fn channels(&self) -> usize {
        (**self).channels()
    }

    fn stored_bytes(&self) -> usize {
        (**self).stored_bytes()
    }

    fn row_bytes(&self) -> usize {
        (**self).row_bytes()
    }

    fn block_tokens(&self) -> Option<usize> {
        (**self).block_tokens()
    }

    fn tile_origin(&self) -> usize {
        (**self).tile_origin()
    }

    fn gathers_blocks(&self) -> bool {
        (**self).gathers_blocks()
    }

    fn read_tile<'s>(
        &'s self,
        start: usize,
        count: usize,
        scratch: &'s mut Self::Scratch,
    ) -> Result<Tile<'s>> {
        (**self).read_tile(start, count, scratch)
    }

    fn row_addresses(&self, start: usize, count: usize) -> Option<Range<usize>> {
        (**self).row_addresses(start, count)
    }

    fn row_address_ranges(&self, start: usize, count: usize, each: &mut dyn FnMut(Range<usize>)) {
        (**self).row_address_ranges(start, count, each)
    }

    fn rotation(&self) -> Option<&'static Hadamard> {
        (**self).rotation()
    }
}

/// Borrowed plain f32 rows; tiles are slices of them, nothing is copied.
#[derive(Clone, Copy, Debug)]
pub struct DenseKv<'a> {
    data: &'a [f32],
    tokens: usize,
    channels: usize,
}

impl<'a> DenseKv<'a> {
    /// Wraps `data` (`tokens × channels`, row-major).
    pub fn new(data: &'a [f32], tokens: usize, channels: usize) -> Result<Self> {
        if channels == 0 {
            return Err(AttentionError::InvalidParameter {
                name: "channels",
                reason: "a KV cache needs at least one channel".into(),
            });
        }
        let len = tokens
            .checked_mul(channels)
            .ok_or(AttentionError::InvalidParameter {
                name: "shape",
                reason: format!("{tokens} × {channels} overflows"),
            })?;
        check_len("dense KV rows (tokens × channels)", len, data.len())?;
        Ok(Self {
            data,
            tokens,
            channels,
        })
    }
}

impl KvSource for DenseKv<'_> {
    type Scratch = ();

    fn tokens(&self) -> usize {
        self.tokens
    }

    fn channels(&self) -> usize {
        self.channels
    }

    fn stored_bytes(&self) -> usize {
        std::mem::size_of_val(self.data)
    }

    fn read_tile<'s>(&'s self, start: usize, count: usize, _: &'s mut ()) -> Result<Tile<'s>> {
        Ok(Tile {
            rows: TileRows::F32(&self.data[start * self.channels..(start + count) * self.channels]),
            stats: KvDecodeStats::default(),
        })
    }

    fn row_addresses(&self, start: usize, count: usize) -> Option<Range<usize>> {
        let rows = self
            .data
            .get(start * self.channels..(start + count) * self.channels)?;
        Some(addresses(rows))
    }
}

/// The address range of the quantized rows among `start..start + count`
/// in a store's value buffer, which holds the middle rows alone (exact
/// sink and window rows live in a section of their own): store row `t` is
/// buffer row `t − sink`. `None` where no quantized row is among them.
fn store_rows(store: &KvStore, start: usize, count: usize) -> Option<Range<usize>> {
    let middle = store.segment_rows().middle;
    let (first, end) = (start.max(middle.start), (start + count).min(middle.end));
    if first >= end {
        return None;
    }
    let rb = store.row_bytes();
    let rows = (first - middle.start) * rb..(end - middle.start) * rb;
    Some(addresses(store.data().get(rows)?))
}

/// The addresses of the scale and offset words (and their check words,
/// where the metadata is protected) of the groups holding rows
/// `start..start + count`, one range per buffer, given to `each`.
/// Per-channel groups of a few tokens keep a word pair per channel for
/// every few rows (in `int4-ch16`, a third of the stored bytes), which a
/// tile reads as surely as its levels.
fn store_group_words(
    store: &KvStore,
    start: usize,
    count: usize,
    each: &mut dyn FnMut(Range<usize>),
) {
    let middle = store.segment_rows().middle;
    let (first, end) = (start.max(middle.start), (start + count).min(middle.end));
    let Some(layout) = store.layout().filter(|l| first < end && l.groups() > 0) else {
        return;
    };
    let groups = layout.groups_of_rows(first - middle.start, end - middle.start);
    let total = layout.groups();
    // Check words: one per scale, then one per offset.
    let offsets = usize::from(!store.offsets().is_empty());
    let buffers = [
        (store.scales(), 1),
        (store.offsets(), 1),
        (store.meta_checks(), 1 + offsets),
    ];
    for (words, parts) in buffers {
        let per_group = words.len() / (total * parts);
        for base in (0..parts).map(|p| p * total) {
            let bytes = (base + groups.start) * per_group..(base + groups.end) * per_group;
            if let Some(bytes) = words.get(bytes).filter(|b| !b.is_empty()) {
                each(addresses(bytes));
            }
        }
    }
}

/// Scratch of the stored-form sources: kv-quant's decode buffers (decoded
/// tiles live there too).
#[derive(Clone, Debug, Default)]
pub struct StoreScratch {
    decode: DecodeScratch,
}

impl StoreScratch {
    /// kv-quant's decode scratch underneath, to set how far interpolation
    /// reads ([`DecodeScratch::limit_neighbours_to_blocks`]).
    pub fn decode_scratch(&mut self) -> &mut DecodeScratch {
        &mut self.decode
    }
}

/// Scratch of a source whose rows lie in blocks of stored rows, each block
/// a run of consecutive rows of one kv-quant store (a paged cache's page
/// table, a cache whose blocks are stored in different forms). Such a
/// source reads a tile inside one run of adjacent blocks with
/// [`read_run`](Self::read_run) and any other tile with
/// [`read_blocks`](Self::read_blocks) (levels gathered block by block where
/// the form allows) or [`decode_blocks`](Self::decode_blocks) (f32);
/// either way interpolation reads an erased row's own block only.
#[derive(Clone, Debug, Default)]
pub struct BlockedScratch {
    store: StoreScratch,
    decode: DecodeScratch,
    rows: Vec<f32>,
    /// A gathered tile's levels and group parameters.
    gathered: GatheredLevels,
}

impl BlockedScratch {
    /// Rows `row..row + count` of `store`, whole or partial blocks of
    /// `block` rows adjacent in the store, read as the store's own tile
    /// (stored halves or levels where the form allows).
    pub fn read_run<'s>(
        &'s mut self,
        store: &'s KvStore,
        row: usize,
        count: usize,
        block: usize,
    ) -> Result<Tile<'s>> {
        self.store.decode.limit_neighbours_to_blocks(Some(block));
        store.read_tile(row, count, &mut self.store)
    }

    /// Rows `start..start + count` of a source whose blocks all lie in
    /// `store` (a paged cache's layer): for a store whose level groups lie
    /// within blocks ([`KvStore::gathers_levels_in_blocks`]: per-token
    /// groups, or per-channel groups of whole blocks), each
    /// block's levels and group parameters copied side by side into one
    /// level tile ([`GatheredLevels`]), so the kernel reads it as it reads
    /// a contiguous store's, with the same values; a tile with an erased
    /// value (or any other form) is decoded into f32 by
    /// [`decode_blocks`](Self::decode_blocks), its clean blocks decoded
    /// again (faulty tiles are rare; the statistics are the second
    /// decode's). `locate(t)` gives row `t`'s row in `store`, as for
    /// `decode_blocks`.
    pub fn read_blocks<'s>(
        &'s mut self,
        store: &'s KvStore,
        start: usize,
        count: usize,
        block: usize,
        locate: impl Fn(usize) -> usize,
    ) -> Result<Tile<'s>> {
        if store.gathers_levels_in_blocks(block)
            && let Some(stats) = self.gather_levels(store, start, count, block, &locate)?
            && self.gathered.view(store).is_some()
        {
            // Built again to hand out (a view kept from the check above would
            // hold the buffers on the path that decodes instead).
            let levels = self.gathered.view(store);
            return Ok(Tile {
                rows: TileRows::Levels(levels.expect("checked above")),
                stats,
            });
        }
        self.decode_blocks(start, count, block, store.channels(), |t| {
            (store, locate(t))
        })
    }

    /// Copies the levels and group parameters of rows `start..start +
    /// count`, block by block, into the gather buffers, with the rows'
    /// statistics; `None` where a block's rows do not read as levels (an
    /// erased value, rows outside the quantized middle).
    fn gather_levels(
        &mut self,
        store: &KvStore,
        start: usize,
        count: usize,
        block: usize,
        locate: &impl Fn(usize) -> usize,
    ) -> Result<Option<KvDecodeStats>> {
        self.gathered.clear();
        let mut stats = KvDecodeStats::default();
        let mut t = start;
        while t < start + count {
            let row = locate(t);
            let n = (block - t % block).min(start + count - t);
            let first = row - t % block;
            self.decode
                .limit_neighbours(Some(first..(first + block).min(store.tokens())));
            let (view, s) = store.decode_rows_view_packed(row, n, &mut self.decode)?;
            let RowsView::Levels(levels) = view else {
                return Ok(None);
            };
            if !self.gathered.push(&levels) {
                return Ok(None);
            }
            stats += s;
            t += n;
        }
        Ok(Some(stats))
    }

    /// Rows `start..start + count` of the source decoded block by block
    /// into f32. `locate(t)` gives the store holding row `t` and its row
    /// there; the rows of one block of `block` rows are consecutive in one
    /// store (starting at a multiple of `block` rows from the source's
    /// start), and interpolation reads only them.
    pub fn decode_blocks<'s, 'k>(
        &'s mut self,
        start: usize,
        count: usize,
        block: usize,
        channels: usize,
        locate: impl Fn(usize) -> (&'k KvStore, usize),
    ) -> Result<Tile<'s>> {
        let n = count * channels;
        if self.rows.len() < n {
            self.rows.resize(n, 0.0);
        }
        let rows = &mut self.rows[..n];
        let mut stats = KvDecodeStats::default();
        let mut t = start;
        while t < start + count {
            let (store, row) = locate(t);
            let n = (block - t % block).min(start + count - t);
            let first = row - t % block;
            self.decode
                .limit_neighbours(Some(first..(first + block).min(store.tokens())));
            let out = &mut rows[(t - start) * channels..][..n * channels];
            stats += store.decode_rows_rotated_into(row, n, out, &mut self.decode)?;
            t += n;
        }
        Ok(Tile {
            rows: TileRows::F32(rows),
            stats,
        })
    }
}

/// Any kv-quant form: each tile is dequantized (and, for protected forms,
/// ECC-decoded with the form's erasure policy) by
/// [`KvStore::decode_rows_rotated_into`], so values and statistics equal
/// those of the same rows of a whole [`KvStore::decode`] (in rotated
/// coordinates for rotated forms, reported by [`KvSource::rotation`]).
/// Plain FP16 tiles are the stored halves ([`KvStore::fp16_rows`]) and
/// integer tiles with no erased value are levels
/// ([`KvStore::decode_rows_view_packed`]: unprotected 4-bit levels as
/// stored, two per byte): the same values, produced later, in the kernel.
impl KvSource for KvStore {
    type Scratch = StoreScratch;

    fn tokens(&self) -> usize {
        KvStore::tokens(self)
    }

    fn channels(&self) -> usize {
        KvStore::channels(self)
    }

    fn stored_bytes(&self) -> usize {
        KvStore::stored_bytes(self)
    }

    fn row_bytes(&self) -> usize {
        KvStore::row_bytes(self)
    }

    fn read_tile<'s>(
        &'s self,
        start: usize,
        count: usize,
        scratch: &'s mut StoreScratch,
    ) -> Result<Tile<'s>> {
        if let Some((halves, stats)) = self.fp16_rows(start, count)? {
            return Ok(Tile {
                rows: TileRows::F16(halves),
                stats,
            });
        }
        let (view, stats) = self.decode_rows_view_packed(start, count, &mut scratch.decode)?;
        let rows = match view {
            RowsView::Levels(levels) => TileRows::Levels(levels),
            RowsView::Values(values) => TileRows::F32(values),
        };
        Ok(Tile { rows, stats })
    }

    fn row_addresses(&self, start: usize, count: usize) -> Option<Range<usize>> {
        store_rows(self, start, count)
    }

    fn row_address_ranges(&self, start: usize, count: usize, each: &mut dyn FnMut(Range<usize>)) {
        if let Some(range) = store_rows(self, start, count) {
            each(range);
        }
        store_group_words(self, start, count, each);
    }

    fn rotation(&self) -> Option<&'static Hadamard> {
        KvStore::rotation(self).ok().flatten()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A store with exact sink and window rows gives the addresses of its
    /// quantized rows only, counted from the middle's first row.
    #[test]
    fn row_addresses_skip_exact_rows() {
        let (tokens, ch) = (40, 16);
        let rows: Vec<f32> = (0..tokens * ch).map(|i| (i % 13) as f32 * 0.1).collect();
        let form = "int4+sink4+win8".parse().unwrap();
        let store = KvStore::quantize(form, &rows, tokens, ch).unwrap();
        let (rb, base) = (store.row_bytes(), store.data().as_ptr() as usize);
        let at = |r: usize| base + r * rb;
        assert_eq!(KvSource::row_addresses(&store, 0, 4), None, "sink rows");
        assert_eq!(KvSource::row_addresses(&store, 32, 8), None, "window rows");
        assert_eq!(KvSource::row_addresses(&store, 4, 2), Some(at(0)..at(2)));
        assert_eq!(KvSource::row_addresses(&store, 0, 40), Some(at(0)..at(28)));
        assert_eq!(KvSource::row_addresses(&store, 30, 5), Some(at(26)..at(28)));
        let plain = KvStore::quantize("int4".parse().unwrap(), &rows, tokens, ch).unwrap();
        let p = plain.data().as_ptr() as usize;
        assert_eq!(
            KvSource::row_addresses(&plain, 3, 2),
            Some(p + 3 * plain.row_bytes()..p + 5 * plain.row_bytes())
        );
    }

    /// The ranges to prefetch of a per-channel store in groups of 8 tokens
    /// are its level rows, then the scale and offset words of the groups
    /// holding them (16 channels each), and their check words where the
    /// metadata is protected: one per scale, then one per offset.
    #[test]
    fn row_address_ranges_add_the_group_words() {
        let (tokens, ch) = (32, 16);
        let rows: Vec<f32> = (0..tokens * ch).map(|i| (i % 13) as f32 * 0.1).collect();
        let ranges = |store: &KvStore, start, count| {
            let mut got = Vec::new();
            KvSource::row_address_ranges(store, start, count, &mut |r| got.push(r));
            got
        };
        let span = |bytes: &[u8], r: Range<usize>| {
            let p = bytes.as_ptr() as usize;
            p + r.start..p + r.end
        };
        let store = KvStore::quantize("int4-ch8".parse().unwrap(), &rows, tokens, ch).unwrap();
        let rb = store.row_bytes();
        // Rows 9..14 lie in the second group of 8 tokens: channels 16..32.
        assert_eq!(
            ranges(&store, 9, 5),
            [
                span(store.data(), 9 * rb..14 * rb),
                span(store.scales(), 32..64),
                span(store.offsets(), 32..64),
            ]
        );
        // Rows 6..17 touch three groups.
        assert_eq!(ranges(&store, 6, 11)[1], span(store.scales(), 0..96));
        let protected = "int4-ch8+secded84".parse().unwrap();
        let store = KvStore::quantize(protected, &rows, tokens, ch).unwrap();
        let got = ranges(&store, 9, 5);
        let checks = store.meta_checks();
        let cb = checks.len() / (2 * 64);
        assert_eq!(got.len(), 5, "{got:?}");
        assert_eq!(got[3], span(checks, 16 * cb..32 * cb), "the scales' checks");
        assert_eq!(
            got[4],
            span(checks, 80 * cb..96 * cb),
            "the offsets' checks"
        );
        // FP16 rows have no groups.
        let halves = KvStore::quantize("fp16".parse().unwrap(), &rows, tokens, ch).unwrap();
        assert_eq!(ranges(&halves, 0, 4).len(), 1);
    }
}
