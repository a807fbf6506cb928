//! [`Attention`]: blockwise online-softmax attention over any pair of
//! [`KvSource`]s, for decode (one query, split-K across threads) and
//! prefill (many queries, blocks of queries across threads).
//!
//! Keys are visited in tiles of [`AttentionConfig::tile_tokens`] rows (fewer
//! where such a tile would hold more than [`AttentionConfig::tile_bytes`]
//! stored row bytes, or would not divide a source's
//! [`block_tokens`](KvSource::block_tokens), unless the source
//! [gathers](KvSource::gathers_blocks) blocks of at most a quarter of
//! the tile) aligned to multiples of the
//! tile size, each read once per query block through
//! [`KvSource::read_tile`] into per-thread scratch; no score matrix and no
//! f32 copy of the cache is ever built. Decode splits the visible keys into
//! chunks of [`AttentionConfig::split_tokens`] (aligned the same way), runs
//! them in parallel with rayon and merges the partial softmax states in chunk
//! order, so the result does not depend on the number of threads.

use std::ops::Range;

use kv_quant::{Hadamard, KvDecodeStats};
use rayon::prelude::*;

use crate::error::{AttentionError, Result, check_len};
use crate::isa::Isa;
use crate::kernel::{NextTile, Partial, TileGeometry, attend_tile};
use crate::numerics::Numerics;
use crate::shape::{HeadShape, Mask};
use crate::source::{KvSource, TileRows};
use crate::tile_grid::TileGrid;
use crate::workspace::{Scratch, Slot, TileStats, Workspace};

/// What to do when the output is not finite (the cache held NaN or
/// infinite keys or values).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum OnNonFinite {
    /// Refuse with [`AttentionError::NonFiniteOutput`].
    #[default]
    Error,
    /// Return the output and count the values in
    /// [`AttentionOutput::non_finite`] (for fault-injection experiments on
    /// unprotected float caches). Non-finite queries are then accepted too:
    /// their heads' outputs come out NaN and are counted.
    Report,
}

/// Tiling and error handling of an [`Attention`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AttentionConfig {
    /// Most cache rows per tile (read and decoded at once). Default 256.
    pub tile_tokens: usize,
    /// Most stored key and value row bytes per tile
    /// ([`KvSource::row_bytes`], group parameters not counted): where
    /// `tile_tokens` rows of the two sources would hold more, or the rows
    /// do not divide a source's [`KvSource::block_tokens`] (a paged
    /// block, so that tiles stay inside one; not for a source that
    /// [gathers](KvSource::gathers_blocks) blocks of at most a quarter of
    /// the tile), the tile is halved until they fit, but not below 16
    /// rows (nor to an odd count). `None`:
    /// always `tile_tokens` rows. Default 128 KiB, where decode ran
    /// fastest on a 2-core Zen 4 host for every form and both benchmark
    /// shapes measured (attention `docs/measurements.md`, "Rows per tile").
    pub tile_bytes: Option<usize>,
    /// Keys per decode work item; a multiple of `tile_tokens`. Default 2048.
    pub split_tokens: usize,
    /// Non-finite outputs: error (default) or report.
    pub on_non_finite: OnNonFinite,
    /// Scores against integer keys: exact f32 or int8-quantized queries.
    pub numerics: Numerics,
    /// The instruction set of every CPU kernel. Default: the fastest this
    /// CPU supports ([`Isa::detect`]); pin another to compare sets or to
    /// reproduce a slower host's float rounding. One this CPU lacks is
    /// refused by [`Attention::with_config`] and [`Attention::set_isa`].
    pub isa: Isa,
}

impl Default for AttentionConfig {
    fn default() -> Self {
        Self {
            tile_tokens: 256,
            tile_bytes: Some(128 << 10),
            split_tokens: 2048,
            on_non_finite: OnNonFinite::Error,
            numerics: Numerics::default(),
            isa: Isa::detect(),
        }
    }
}

/// Statistics of one attention call: decode statistics of the K and V tiles
/// read (each distinct tile once), and how many tiles that was.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct AttentionStats {
    /// Decode statistics of the key tiles.
    pub keys: KvDecodeStats,
    /// Decode statistics of the value tiles.
    pub values: KvDecodeStats,
    /// Distinct tiles read (each holds up to `tile_tokens` rows of K and of V).
    pub tiles: u64,
    /// Of those, tiles whose keys or values had erased values: decoded to
    /// f32 rows with the erasure policy applied and attended exactly, not
    /// read as stored levels (nor scored with integer dot products).
    pub erased_tiles: u64,
}

/// What a call into caller-owned buffers ([`Attention::decode_into`],
/// [`Attention::prefill_into`]) returns besides its outputs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct AttentionInfo {
    /// Decode statistics of what was read.
    pub stats: AttentionStats,
    /// Output values that are NaN or infinite (only non-zero with
    /// [`OnNonFinite::Report`]).
    pub non_finite: usize,
}

/// Result of an attention call.
#[derive(Clone, Debug, PartialEq)]
pub struct AttentionOutput {
    /// `queries × q_heads × head_dim`.
    pub out: Vec<f32>,
    /// Log-sum-exp of the scaled scores per query and head; `-inf` where
    /// every key is masked (and the output is zero).
    pub lse: Vec<f32>,
    /// Decode statistics of what was read.
    pub stats: AttentionStats,
    /// Output values that are NaN or infinite (only non-zero with
    /// [`OnNonFinite::Report`]).
    pub non_finite: usize,
}

/// Attention for one layer's [`HeadShape`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Attention {
    shape: HeadShape,
    config: AttentionConfig,
}

/// Queries handled together in prefill: each tile read serves all of them.
const QUERY_BLOCK: usize = 16;

impl Attention {
    /// Attention with the default configuration.
    pub fn new(shape: HeadShape) -> Self {
        Self {
            shape,
            config: AttentionConfig::default(),
        }
    }

    /// Attention with an explicit configuration.
    pub fn with_config(shape: HeadShape, config: AttentionConfig) -> Result<Self> {
        if config.tile_tokens == 0 {
            return Err(AttentionError::InvalidParameter {
                name: "tile_tokens",
                reason: "must be positive".into(),
            });
        }
        if config.split_tokens == 0 || !config.split_tokens.is_multiple_of(config.tile_tokens) {
            return Err(AttentionError::InvalidParameter {
                name: "split_tokens",
                reason: format!(
                    "{} is not a positive multiple of tile_tokens ({})",
                    config.split_tokens, config.tile_tokens
                ),
            });
        }
        config.isa.ensure_supported()?;
        Ok(Self { shape, config })
    }

    /// Runs every kernel on `isa` from now on; an error (and no change)
    /// where this CPU lacks it.
    pub fn set_isa(&mut self, isa: Isa) -> Result<()> {
        isa.ensure_supported()?;
        self.config.isa = isa;
        Ok(())
    }

    /// The head shape.
    pub fn shape(&self) -> &HeadShape {
        &self.shape
    }

    /// The configuration.
    pub fn config(&self) -> &AttentionConfig {
        &self.config
    }

    /// Switches how integer keys are scored from now on.
    pub fn set_numerics(&mut self, numerics: Numerics) {
        self.config.numerics = numerics;
    }

    /// One query token (`q_heads × head_dim`) at `position` against the
    /// cache, split across threads: [`decode_into`](Self::decode_into) with
    /// a fresh workspace and output.
    pub fn decode<K: KvSource, V: KvSource>(
        &self,
        query: &[f32],
        position: usize,
        keys: &K,
        values: &V,
        mask: &Mask<'_>,
    ) -> Result<AttentionOutput> {
        self.with_fresh_buffers(1, |out, lse, ws| {
            self.decode_into(query, position, keys, values, mask, out, lse, ws)
        })
    }

    /// [`decode`](Self::decode) into caller-owned buffers: the output
    /// (`q_heads × head_dim`) into `out`, the log-sum-exp per head into
    /// `lse`, with every intermediate buffer in `ws`. Once `ws` has served
    /// a call of this size, a call allocates nothing.
    #[allow(clippy::too_many_arguments)] // the call's inputs, outputs and workspace
    pub fn decode_into<K: KvSource, V: KvSource>(
        &self,
        query: &[f32],
        position: usize,
        keys: &K,
        values: &V,
        mask: &Mask<'_>,
        out: &mut [f32],
        lse: &mut [f32],
        ws: &mut Workspace<K, V>,
    ) -> Result<AttentionInfo> {
        self.check_outputs(1, out, lse)?;
        self.prepare_into(query, &[position], keys, values, mask, ws)?;
        let range = ws.ranges[0].clone();
        let split = self.config.split_tokens;
        let grid = self.tile_grid(keys, values);
        let span = grid.span(&range, keys.tokens());
        ws.items.clear();
        ws.items.extend(grid.with_size(split).pieces(&span));
        let n = ws.items.len();
        let per = ws.ensure_slots(n);
        let Workspace {
            q,
            items,
            slots,
            scratch,
            ..
        } = ws;
        let ranges = std::slice::from_ref(&range);
        slots[..n]
            .par_chunks_mut(per)
            .zip(items.par_chunks(per))
            .zip(scratch.par_iter_mut())
            .for_each(|((slots, items), scratch)| {
                for (slot, chunk) in slots.iter_mut().zip(items) {
                    let sources = (keys, values);
                    slot.result =
                        self.run_block(q, ranges, chunk.clone(), grid, sources, (slot, scratch));
                }
            });
        ws.merged.reset(self.shape.q_heads(), self.shape.head_dim());
        ws.tiles.clear();
        for slot in &mut ws.slots[..n] {
            std::mem::replace(&mut slot.result, Ok(()))?;
            ws.merged.merge(&slot.partials[0]);
            ws.tiles.extend_from_slice(&slot.tiles);
        }
        let partials = std::slice::from_ref(&ws.merged);
        self.finish_into(partials, &mut ws.tiles, values.rotation(), out, lse)
    }

    /// Many query tokens (`positions.len() × q_heads × head_dim`) at
    /// `positions` against the cache, blocks of queries across threads:
    /// [`prefill_into`](Self::prefill_into) with a fresh workspace and output.
    pub fn prefill<K: KvSource, V: KvSource>(
        &self,
        queries: &[f32],
        positions: &[usize],
        keys: &K,
        values: &V,
        mask: &Mask<'_>,
    ) -> Result<AttentionOutput> {
        self.with_fresh_buffers(positions.len(), |out, lse, ws| {
            self.prefill_into(queries, positions, keys, values, mask, out, lse, ws)
        })
    }

    /// Runs a call into new output buffers for `queries` queries and a new
    /// workspace, and returns them as an [`AttentionOutput`].
    fn with_fresh_buffers<K: KvSource, V: KvSource>(
        &self,
        queries: usize,
        call: impl FnOnce(&mut [f32], &mut [f32], &mut Workspace<K, V>) -> Result<AttentionInfo>,
    ) -> Result<AttentionOutput> {
        let s = &self.shape;
        let mut out = vec![0.0; queries * s.q_len()];
        let mut lse = vec![0.0; queries * s.q_heads()];
        let info = call(&mut out, &mut lse, &mut Workspace::new())?;
        Ok(AttentionOutput {
            out,
            lse,
            stats: info.stats,
            non_finite: info.non_finite,
        })
    }

    /// [`prefill`](Self::prefill) into caller-owned buffers (`out`:
    /// `positions.len() × q_heads × head_dim`, `lse`: `positions.len() ×
    /// q_heads`), with every intermediate buffer in `ws`.
    #[allow(clippy::too_many_arguments)] // the call's inputs, outputs and workspace
    pub fn prefill_into<K: KvSource, V: KvSource>(
        &self,
        queries: &[f32],
        positions: &[usize],
        keys: &K,
        values: &V,
        mask: &Mask<'_>,
        out: &mut [f32],
        lse: &mut [f32],
        ws: &mut Workspace<K, V>,
    ) -> Result<AttentionInfo> {
        self.check_outputs(positions.len(), out, lse)?;
        self.prepare_into(queries, positions, keys, values, mask, ws)?;
        let ql = self.shape.q_len();
        let grid = self.tile_grid(keys, values);
        if positions.len() <= QUERY_BLOCK {
            return self.prefill_split(keys, values, grid, out, lse, ws);
        }
        let blocks = positions.len().div_ceil(QUERY_BLOCK);
        ws.items.clear();
        ws.items.extend(
            (0..blocks).map(|b| b * QUERY_BLOCK..((b + 1) * QUERY_BLOCK).min(positions.len())),
        );
        let per = ws.ensure_slots(blocks);
        let Workspace {
            q,
            ranges,
            items,
            slots,
            scratch,
            ..
        } = ws;
        slots[..blocks]
            .par_chunks_mut(per)
            .zip(items.par_chunks(per))
            .zip(scratch.par_iter_mut())
            .for_each(|((slots, blocks), scratch)| {
                for (slot, block) in slots.iter_mut().zip(blocks) {
                    let ranges = &ranges[block.clone()];
                    let q = &q[block.start * ql..block.end * ql];
                    let start = ranges.iter().map(|r| r.start).min().unwrap_or(0);
                    let end = ranges.iter().map(|r| r.end).max().unwrap_or(0);
                    let span = grid.span(&(start..end), keys.tokens());
                    let sources = (keys, values);
                    slot.result = self.run_block(q, ranges, span, grid, sources, (slot, scratch));
                }
            });
        ws.tiles.clear();
        for slot in &mut ws.slots[..blocks] {
            std::mem::replace(&mut slot.result, Ok(()))?;
            ws.tiles.extend_from_slice(&slot.tiles);
        }
        let partials = ws.slots[..blocks].iter().flat_map(|s| &s.partials);
        self.finish_into(partials, &mut ws.tiles, values.rotation(), out, lse)
    }

    /// One block of queries (at most [`QUERY_BLOCK`], already prepared in
    /// `ws`) split across threads as decode splits one query: the keys in
    /// chunks of `split_tokens` aligned as decode aligns them (and, where
    /// there are fewer chunks than threads, the queries in groups), each
    /// chunk's tiles read once for every query of a group, and each
    /// query's partial states merged in chunk order over the chunks decode
    /// would give it. So a few queries over a long cache (a speculative
    /// verification's rows) use every thread, and each query's arithmetic
    /// is decode's for that query alone.
    fn prefill_split<K: KvSource, V: KvSource>(
        &self,
        keys: &K,
        values: &V,
        grid: TileGrid,
        out: &mut [f32],
        lse: &mut [f32],
        ws: &mut Workspace<K, V>,
    ) -> Result<AttentionInfo> {
        let chunks = grid.with_size(self.config.split_tokens);
        let mut spans = std::mem::take(&mut ws.spans);
        spans.clear();
        spans.extend(ws.ranges.iter().map(|r| grid.span(r, keys.tokens())));
        let rows = spans.len();
        let lo = spans
            .iter()
            .filter(|s| !s.is_empty())
            .map(|s| s.start)
            .min();
        let hi = spans.iter().map(|s| s.end).max().unwrap_or(0);
        let span = lo.map_or(0..0, |lo| lo..hi);
        // Groups of queries where the chunks alone leave threads idle.
        let threads = rayon::current_num_threads();
        let groups = (threads / chunks.pieces(&span).count().max(1)).clamp(1, rows.max(1));
        let per_group = rows.div_ceil(groups).max(1);
        // No empty group: 5 rows over 4 groups are groups of 2, 2 and 1.
        let groups = rows.div_ceil(per_group).max(1);
        let group_rows = |g: usize| g * per_group..((g + 1) * per_group).min(rows);
        ws.items.clear();
        for c in chunks.pieces(&span) {
            ws.items.extend((0..groups).map(|_| c.clone()));
        }
        let n = ws.items.len();
        let per = ws.ensure_slots(n);
        let Workspace {
            q,
            ranges,
            items,
            slots,
            scratch,
            ..
        } = ws;
        let ql = self.shape.q_len();
        slots[..n]
            .par_chunks_mut(per)
            .zip(items.par_chunks(per))
            .zip(scratch.par_iter_mut())
            .enumerate()
            .for_each(|(batch, ((slots, items), scratch))| {
                for (i, (slot, chunk)) in slots.iter_mut().zip(items).enumerate() {
                    let r = group_rows((batch * per + i) % groups);
                    let q = &q[r.start * ql..r.end * ql];
                    let sources = (keys, values);
                    slot.result = self.run_block(
                        q,
                        &ranges[r],
                        chunk.clone(),
                        grid,
                        sources,
                        (slot, scratch),
                    );
                }
            });
        let (heads, d) = (self.shape.q_heads(), self.shape.head_dim());
        ws.merged_rows.resize_with(rows, || Partial::new(0, 0));
        ws.tiles.clear();
        for m in &mut ws.merged_rows[..rows] {
            m.reset(heads, d);
        }
        for (i, (slot, chunk)) in ws.slots[..n].iter_mut().zip(&ws.items).enumerate() {
            std::mem::replace(&mut slot.result, Ok(()))?;
            // A group records the tiles its queries reach (the last tiles
            // only by the later queries); `finish_into` counts each once.
            ws.tiles.extend_from_slice(&slot.tiles);
            let r = group_rows(i % groups);
            for (p, row) in slot.partials.iter().zip(r) {
                // The chunks decode visits for this query: those meeting its span.
                if chunk.start < spans[row].end && spans[row].start < chunk.end {
                    ws.merged_rows[row].merge(p);
                }
            }
        }
        ws.spans = spans;
        let partials = ws.merged_rows[..rows].iter();
        self.finish_into(partials, &mut ws.tiles, values.rotation(), out, lse)
    }

    /// Checks the output buffers of a call of `queries` queries.
    fn check_outputs(&self, queries: usize, out: &[f32], lse: &[f32]) -> Result<()> {
        check_len(
            "output (queries × q_heads × head_dim)",
            queries * self.shape.q_len(),
            out.len(),
        )?;
        check_len(
            "log-sum-exp (queries × q_heads)",
            queries * self.shape.q_heads(),
            lse.len(),
        )
    }

    /// Validates the call and writes the scaled queries and the visible
    /// ranges into the workspace.
    fn prepare_into<K: KvSource, V: KvSource>(
        &self,
        queries: &[f32],
        positions: &[usize],
        keys: &K,
        values: &V,
        mask: &Mask<'_>,
        ws: &mut Workspace<K, V>,
    ) -> Result<()> {
        let s = &self.shape;
        check_len(
            "key channels (kv_heads × head_dim)",
            s.kv_channels(),
            keys.channels(),
        )?;
        check_len(
            "value channels (kv_heads × head_dim)",
            s.kv_channels(),
            values.channels(),
        )?;
        check_len(
            "value tokens (as many as keys)",
            keys.tokens(),
            values.tokens(),
        )?;
        check_len(
            "queries (positions × q_heads × head_dim)",
            positions.len() * s.q_len(),
            queries.len(),
        )?;
        if keys.tokens() == 0 {
            return Err(AttentionError::EmptyCache);
        }
        let refuse = self.config.on_non_finite == OnNonFinite::Error;
        if let Some(i) = queries.iter().position(|x| refuse && !x.is_finite()) {
            return Err(AttentionError::NonFiniteQuery {
                query: i / s.q_len(),
                head: i % s.q_len() / s.head_dim(),
                channel: i % s.head_dim(),
                value: queries[i],
            });
        }
        mask.ranges_into(positions, keys.tokens(), &mut ws.ranges)?;
        let scale = s.scale();
        ws.q.clear();
        ws.q.extend(queries.iter().map(|&x| (f64::from(x) * scale) as f32));
        if let Some(h) = self.rotation_of(keys.rotation(), "key")? {
            h.rotate(&mut ws.q);
        }
        self.rotation_of(values.rotation(), "value")?;
        Ok(())
    }

    /// A source's rotation, checked to stay inside heads.
    fn rotation_of(
        &self,
        rotation: Option<&'static Hadamard>,
        what: &str,
    ) -> Result<Option<&'static Hadamard>> {
        match rotation {
            Some(h) if !self.shape.head_dim().is_multiple_of(h.block()) => {
                Err(AttentionError::InvalidParameter {
                    name: "rotation",
                    reason: format!(
                        "{what} rotation blocks of {} channels straddle heads of {} (use +rot<N> with N dividing the head dimension)",
                        h.block(),
                        self.shape.head_dim()
                    ),
                })
            }
            r => Ok(r),
        }
    }

    /// Rows per tile for `keys` and `values`: `tile_tokens`, halved while a
    /// tile would hold more than `tile_bytes` row bytes or would not divide
    /// a source's blocks (it stays a divisor of `tile_tokens`, so of
    /// `split_tokens`, and does not go below 16 rows).
    pub(crate) fn tile_rows<K: KvSource, V: KvSource>(&self, keys: &K, values: &V) -> usize {
        let rows = self.config.tile_tokens;
        let Some(budget) = self.config.tile_bytes else {
            return rows;
        };
        let per_row = keys.row_bytes().saturating_add(values.row_bytes());
        // Blocks of at most a quarter of the budget's tile are crossed by
        // sources that gather them (`KvSource::gathers_blocks`).
        let unblocked = halved_tile(rows, per_row, budget, [None, None]);
        let cut = |b: Option<usize>, gathers: bool| b.filter(|&b| !gathers || 4 * b > unblocked);
        let blocks = [
            cut(keys.block_tokens(), keys.gathers_blocks()),
            cut(values.block_tokens(), values.gathers_blocks()),
        ];
        halved_tile(rows, per_row, budget, blocks)
    }

    /// Where tiles are cut for `keys` and `values`: every
    /// [`tile_rows`](Self::tile_rows) rows, from the sources' tile origin
    /// where one names one (or both the same one;
    /// [`KvSource::tile_origin`]).
    pub(crate) fn tile_grid<K: KvSource, V: KvSource>(&self, keys: &K, values: &V) -> TileGrid {
        let origin = match (keys.tile_origin(), values.tile_origin()) {
            (0, o) | (o, 0) => o,
            (k, v) if k == v => k,
            _ => 0,
        };
        TileGrid::new(self.tile_rows(keys, values), origin)
    }

    /// Folds the tiles of `span` into one partial per query of `q`
    /// (`ranges.len() × q_len`, scaled): `slot.partials`, with the tiles
    /// read in `slot.tiles`.
    fn run_block<K: KvSource, V: KvSource>(
        &self,
        q: &[f32],
        ranges: &[Range<usize>],
        span: Range<usize>,
        grid: TileGrid,
        (keys, values): (&K, &V),
        (slot, scratch): (&mut Slot, &mut Scratch<K, V>),
    ) -> Result<()> {
        let s = &self.shape;
        let (d, ch, ql) = (s.head_dim(), s.kv_channels(), s.q_len());
        let geometry = TileGeometry {
            group: s.group(),
            kv_heads: s.kv_heads(),
            d,
        };
        if slot.partials.len() < ranges.len() {
            slot.partials.resize(ranges.len(), Partial::new(0, 0));
        }
        slot.partials.truncate(ranges.len());
        for p in &mut slot.partials {
            p.reset(s.q_heads(), d);
        }
        slot.tiles.clear();
        // `q` is new to this scratch: codes derived from its address are stale.
        scratch.kernel.forget_queries();
        let mut start = span.start;
        while start < span.end {
            let end = grid.next(start).min(span.end);
            if ranges.iter().any(|r| r.start < end && start < r.end) {
                // The next tile's stored rows, fetched while this one is worked on.
                let next = (end < span.end).then(|| {
                    let n = grid.next(end).min(span.end) - end;
                    let mut next = NextTile::default();
                    keys.row_address_ranges(end, n, &mut |r| next.keys.push(r));
                    values.row_address_ranges(end, n, &mut |r| next.values.push(r));
                    next
                });
                let k = keys.read_tile(start, end - start, &mut scratch.keys)?;
                let v = values.read_tile(start, end - start, &mut scratch.values)?;
                slot.tiles.push((start, k.stats, v.stats));
                // Keys as pair codes are scored against the codebook when
                // one query reads the tile (decode); several queries
                // (prefill, a draft's verification) would each make their
                // table for it, so they read it widened once (a prefill
                // over 2,048 tokens ran 2.6x slower with a table per query
                // and tile, `kv-eval ppl`).
                let readers = ranges
                    .iter()
                    .filter(|r| r.start < end && start < r.end)
                    .count();
                let k_rows = match k.rows {
                    TileRows::PairCodes(pairs) if readers > 1 => {
                        let widened = &mut scratch.widened_keys;
                        widened.resize(pairs.rows() * pairs.channels(), 0.0);
                        pairs.widen_into(widened);
                        TileRows::F32(widened)
                    }
                    rows => rows,
                };
                // The first query range that reads this tile requests the
                // next one (a later range's tile may lie past the first's end).
                let mut next = next;
                for (i, r) in ranges.iter().enumerate() {
                    let (lo, hi) = (r.start.max(start), r.end.min(end));
                    if lo < hi {
                        let rows = (lo - start) * ch..(hi - start) * ch;
                        attend_tile(
                            &q[i * ql..][..ql],
                            k_rows.slice(rows.clone(), ch),
                            v.rows.slice(rows, ch),
                            geometry,
                            self.config.numerics,
                            self.config.isa,
                            next.take().as_ref(),
                            &mut scratch.kernel,
                            &mut slot.partials[i],
                        );
                    }
                }
            }
            start = end;
        }
        Ok(())
    }

    /// Normalises the partials into `out` and `lse`, rotating the outputs
    /// back when the values were summed in rotated coordinates, and sums
    /// the statistics of the distinct tiles read.
    fn finish_into<'p>(
        &self,
        partials: impl IntoIterator<Item = &'p Partial>,
        tiles: &mut [TileStats],
        value_rotation: Option<&'static Hadamard>,
        out: &mut [f32],
        lse: &mut [f32],
    ) -> Result<AttentionInfo> {
        let s = &self.shape;
        for ((p, o), l) in partials
            .into_iter()
            .zip(out.chunks_exact_mut(s.q_len()))
            .zip(lse.chunks_exact_mut(s.q_heads()))
        {
            p.finish(o, l);
        }
        if let Some(h) = value_rotation {
            h.unrotate(out);
        }
        // A tile read by several query blocks counts once (its statistics
        // are the same each time, so which copy stays does not matter).
        tiles.sort_unstable_by_key(|t| t.0);
        let mut stats = AttentionStats::default();
        let mut last = None;
        for &(start, k, v) in tiles.iter() {
            if last != Some(start) {
                stats.tiles += 1;
                stats.erased_tiles += u64::from(k.erased_values + v.erased_values > 0);
                stats.keys += k;
                stats.values += v;
                last = Some(start);
            }
        }
        let non_finite = out.iter().filter(|x| !x.is_finite()).count();
        if non_finite > 0 && self.config.on_non_finite == OnNonFinite::Error {
            let first = out.iter().position(|x| !x.is_finite()).unwrap_or(0);
            return Err(AttentionError::NonFiniteOutput {
                count: non_finite,
                query: first / s.q_len(),
                head: first % s.q_len() / s.head_dim(),
            });
        }
        Ok(AttentionInfo { stats, non_finite })
    }
}

/// `rows` halved while `rows·per_row > budget` or `rows` does not divide
/// one of `blocks`, as long as the half is a whole number of at least 16
/// rows.
fn halved_tile(
    mut rows: usize,
    per_row: usize,
    budget: usize,
    blocks: [Option<usize>; 2],
) -> usize {
    let splits_a_block = |rows: usize| blocks.iter().flatten().any(|b| !b.is_multiple_of(rows));
    while rows.is_multiple_of(2)
        && rows / 2 >= 16
        && (rows.saturating_mul(per_row) > budget || splits_a_block(rows))
    {
        rows /= 2;
    }
    rows
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DenseKv;

    #[test]
    fn tiles_halve_to_the_byte_budget_and_the_sources_blocks() {
        const NONE: [Option<usize>; 2] = [None, None];
        // 32/8/128 row bytes of K+V: int4 1 KiB, int8 2 KiB, fp16 4 KiB.
        assert_eq!(halved_tile(128, 1024, 128 << 10, NONE), 128);
        assert_eq!(halved_tile(128, 2048, 128 << 10, NONE), 64);
        assert_eq!(halved_tile(128, 4096, 128 << 10, NONE), 32);
        // Never below 16 rows, never to an odd count.
        assert_eq!(halved_tile(128, 1 << 20, 128 << 10, NONE), 16);
        assert_eq!(halved_tile(18, 1 << 20, 1, NONE), 18);
        assert_eq!(halved_tile(96, 1 << 20, 1, NONE), 24);
        assert_eq!(halved_tile(8, 1 << 20, 1, NONE), 8);
        // Tiles that divide a source's blocks (paged blocks of 64, 48, 16).
        assert_eq!(halved_tile(128, 8, 128 << 10, [Some(64), None]), 64);
        assert_eq!(halved_tile(128, 8, 128 << 10, [None, Some(48)]), 16);
        assert_eq!(halved_tile(128, 8, 128 << 10, [Some(64), Some(16)]), 16);
        assert_eq!(halved_tile(128, 8, 128 << 10, [Some(3), None]), 16);
        for rows in 1..300 {
            for per_row in [0, 1, 700, 5000] {
                for blocks in [NONE, [Some(64), None], [Some(48), Some(96)]] {
                    let t = halved_tile(rows, per_row, 128 << 10, blocks);
                    assert!(rows % t == 0, "{rows} {per_row}: {t}");
                    // Either it fits (budget and blocks) or it could not halve.
                    let fits =
                        t * per_row <= 128 << 10 && blocks.iter().flatten().all(|b| b % t == 0);
                    assert!(
                        fits || t % 2 == 1 || t / 2 < 16,
                        "{rows} {per_row} {blocks:?}: {t}"
                    );
                    if t < rows {
                        assert!(t >= 16, "{rows}: {t}");
                    }
                }
            }
        }
    }

    #[test]
    fn tile_rows_follow_the_config() {
        let shape = HeadShape::new(4, 2, 256).unwrap();
        let (tokens, ch) = (10, shape.kv_channels());
        let data = vec![0.5f32; tokens * ch];
        // 2 KiB of f32 per row and part: 4 KiB a row for K and V.
        let (k, v) = (
            DenseKv::new(&data, tokens, ch).unwrap(),
            DenseKv::new(&data, tokens, ch).unwrap(),
        );
        let attn = Attention::new(shape);
        assert_eq!(attn.tile_rows(&k, &v), 32);
        let fixed = Attention::with_config(
            shape,
            AttentionConfig {
                tile_bytes: None,
                ..AttentionConfig::default()
            },
        )
        .unwrap();
        assert_eq!(fixed.tile_rows(&k, &v), 256);
        // kv-quant stores at 32/8/128: their form's row bytes, whatever the
        // token count and group parameters.
        let shape = HeadShape::new(32, 8, 128).unwrap();
        let attn = Attention::new(shape);
        let ch = shape.kv_channels();
        for (form, want) in [
            ("int4", 128),
            ("int4-ch", 128),
            ("int4+secded84", 64),
            ("int8", 64),
            ("fp16", 32),
        ] {
            for tokens in [40, 333] {
                let data: Vec<f32> = (0..tokens * ch).map(|i| (i as f32 * 0.37).sin()).collect();
                let store =
                    kv_quant::KvStore::quantize(form.parse().unwrap(), &data, tokens, ch).unwrap();
                assert_eq!(
                    attn.tile_rows(&store, &store),
                    want,
                    "{form}, {tokens} tokens"
                );
            }
        }
    }

    /// Dense rows posing as a blocked source that may gather its blocks.
    struct Blocked<'a> {
        rows: DenseKv<'a>,
        block: usize,
        gathers: bool,
    }

    impl KvSource for Blocked<'_> {
        type Scratch = ();

        fn tokens(&self) -> usize {
            self.rows.tokens()
        }

        fn channels(&self) -> usize {
            self.rows.channels()
        }

        fn stored_bytes(&self) -> usize {
            self.rows.stored_bytes()
        }

        fn block_tokens(&self) -> Option<usize> {
            Some(self.block)
        }

        fn gathers_blocks(&self) -> bool {
            self.gathers
        }

        fn read_tile<'s>(
            &'s self,
            start: usize,
            count: usize,
            scratch: &'s mut (),
        ) -> Result<crate::Tile<'s>> {
            self.rows.read_tile(start, count, scratch)
        }
    }

    /// A source that gathers is cut to its blocks only where a block is
    /// more than a quarter of the tile the bytes allow; one that does not is
    /// always cut; each source decides for itself.
    #[test]
    fn gathering_sources_cross_blocks_of_a_quarter_tile_or_less() {
        let shape = HeadShape::new(4, 2, 16).unwrap();
        let (tokens, ch) = (600, shape.kv_channels());
        let data = vec![0.5f32; tokens * ch];
        let rows = DenseKv::new(&data, tokens, ch).unwrap();
        // 128 B of f32 per row and part: the 128 KiB budget allows 256 rows.
        let attn = Attention::new(shape);
        assert_eq!(attn.tile_rows(&rows, &rows), 256);
        let blocked = |block, gathers| Blocked {
            rows,
            block,
            gathers,
        };
        for (block, gathers, want) in [
            (16, true, 256),
            (64, true, 256),
            (128, true, 128),
            (16, false, 16),
            (64, false, 64),
        ] {
            let source = blocked(block, gathers);
            assert_eq!(
                attn.tile_rows(&source, &source),
                want,
                "blocks of {block}, gathers {gathers}"
            );
        }
        assert_eq!(attn.tile_rows(&blocked(16, true), &blocked(32, false)), 32);
    }
}
