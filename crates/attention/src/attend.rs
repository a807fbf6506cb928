//! [`Attention`]: blockwise online-softmax attention over any pair of
//! [`KvSource`]s, for decode (one query, split-K across threads) and
//! prefill (many queries, blocks of queries across threads).
//!
//! Keys are visited in tiles of [`AttentionConfig::tile_tokens`] rows aligned
//! to multiples of the tile size, each read once per query block through
//! [`KvSource::read_tile`] into per-thread scratch; no score matrix and no
//! f32 copy of the cache is ever built. Decode splits the visible keys into
//! chunks of [`AttentionConfig::split_tokens`] (aligned the same way), runs
//! them in parallel with rayon and merges the partial softmax states in chunk
//! order, so the result does not depend on the number of threads.

use std::ops::Range;

use kv_quant::{Hadamard, KvDecodeStats};
use rayon::prelude::*;

use crate::error::{AttentionError, Result, check_len};
use crate::kernel::{KernelScratch, Partial, TileGeometry, attend_tile};
use crate::shape::{HeadShape, Mask};
use crate::source::KvSource;

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
    /// Cache rows per tile (read and decoded at once). Default 64.
    pub tile_tokens: usize,
    /// Keys per decode work item; a multiple of `tile_tokens`. Default 2048.
    pub split_tokens: usize,
    /// Non-finite outputs: error (default) or report.
    pub on_non_finite: OnNonFinite,
}

impl Default for AttentionConfig {
    fn default() -> Self {
        Self {
            tile_tokens: 64,
            split_tokens: 2048,
            on_non_finite: OnNonFinite::Error,
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

struct ThreadScratch<K: KvSource, V: KvSource> {
    keys: K::Scratch,
    values: V::Scratch,
    kernel: KernelScratch,
}

impl<K: KvSource, V: KvSource> Default for ThreadScratch<K, V> {
    fn default() -> Self {
        Self {
            keys: K::Scratch::default(),
            values: V::Scratch::default(),
            kernel: KernelScratch::default(),
        }
    }
}

/// Statistics of one tile, keyed by its first row.
type TileStats = (usize, KvDecodeStats, KvDecodeStats);

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
        Ok(Self { shape, config })
    }

    /// The head shape.
    pub fn shape(&self) -> &HeadShape {
        &self.shape
    }

    /// The configuration.
    pub fn config(&self) -> &AttentionConfig {
        &self.config
    }

    /// One query token (`q_heads × head_dim`) at `position` against the
    /// cache, split across threads.
    pub fn decode<K: KvSource, V: KvSource>(
        &self,
        query: &[f32],
        position: usize,
        keys: &K,
        values: &V,
        mask: &Mask<'_>,
    ) -> Result<AttentionOutput> {
        let (q, ranges) = self.prepare(query, &[position], keys, values, mask)?;
        let range = ranges[0].clone();
        let split = self.config.split_tokens;
        let span = self.tile_span(&range, keys.tokens());
        let chunks: Vec<Range<usize>> = (span.start / split * split..span.end)
            .step_by(split)
            .map(|s| s.max(span.start)..(s / split * split + split).min(span.end))
            .collect();
        let ranges = std::slice::from_ref(&range);
        let results: Vec<(Vec<Partial>, Vec<TileStats>)> = chunks
            .into_par_iter()
            .map_init(ThreadScratch::<K, V>::default, |scratch, chunk| {
                self.run_block(&q, ranges, chunk, keys, values, scratch)
            })
            .collect::<Result<_>>()?;
        let mut partial = Partial::new(self.shape.q_heads(), self.shape.head_dim());
        let mut tiles = Vec::new();
        for (p, t) in results {
            partial.merge(&p[0]);
            tiles.extend(t);
        }
        self.finish(std::slice::from_ref(&partial), tiles, values.rotation())
    }

    /// Many query tokens (`positions.len() × q_heads × head_dim`) at
    /// `positions` against the cache, blocks of queries across threads.
    pub fn prefill<K: KvSource, V: KvSource>(
        &self,
        queries: &[f32],
        positions: &[usize],
        keys: &K,
        values: &V,
        mask: &Mask<'_>,
    ) -> Result<AttentionOutput> {
        let (q, ranges) = self.prepare(queries, positions, keys, values, mask)?;
        let ql = self.shape.q_len();
        let results: Vec<(Vec<Partial>, Vec<TileStats>)> = ranges
            .par_chunks(QUERY_BLOCK)
            .zip(q.par_chunks(QUERY_BLOCK * ql))
            .map_init(ThreadScratch::<K, V>::default, |scratch, (ranges, q)| {
                let start = ranges.iter().map(|r| r.start).min().unwrap_or(0);
                let end = ranges.iter().map(|r| r.end).max().unwrap_or(0);
                let span = self.tile_span(&(start..end), keys.tokens());
                self.run_block(q, ranges, span, keys, values, scratch)
            })
            .collect::<Result<_>>()?;
        let mut partials = Vec::with_capacity(positions.len());
        let mut tiles = Vec::new();
        for (p, t) in results {
            partials.extend(p);
            tiles.extend(t);
        }
        self.finish(&partials, tiles, values.rotation())
    }

    /// Validates the call and returns the scaled queries and visible ranges.
    fn prepare<K: KvSource, V: KvSource>(
        &self,
        queries: &[f32],
        positions: &[usize],
        keys: &K,
        values: &V,
        mask: &Mask<'_>,
    ) -> Result<(Vec<f32>, Vec<Range<usize>>)> {
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
        let ranges = mask.ranges(positions, keys.tokens())?;
        let scale = s.scale();
        let mut q: Vec<f32> = queries
            .iter()
            .map(|&x| (f64::from(x) * scale) as f32)
            .collect();
        if let Some(h) = self.rotation_of(keys.rotation(), "key")? {
            h.rotate(&mut q);
        }
        self.rotation_of(values.rotation(), "value")?;
        Ok((q, ranges))
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

    /// The tile-aligned rows covering `range`, clipped to the cache.
    fn tile_span(&self, range: &Range<usize>, tokens: usize) -> Range<usize> {
        if range.is_empty() {
            return 0..0;
        }
        let tile = self.config.tile_tokens;
        range.start / tile * tile..range.end.div_ceil(tile).saturating_mul(tile).min(tokens)
    }

    /// Folds the tiles of `span` into one partial per query of `q`
    /// (`ranges.len() × q_len`, scaled).
    fn run_block<K: KvSource, V: KvSource>(
        &self,
        q: &[f32],
        ranges: &[Range<usize>],
        span: Range<usize>,
        keys: &K,
        values: &V,
        scratch: &mut ThreadScratch<K, V>,
    ) -> Result<(Vec<Partial>, Vec<TileStats>)> {
        let s = &self.shape;
        let (d, ch, ql) = (s.head_dim(), s.kv_channels(), s.q_len());
        let geometry = TileGeometry {
            group: s.group(),
            kv_heads: s.kv_heads(),
            d,
        };
        let mut partials = vec![Partial::new(s.q_heads(), d); ranges.len()];
        let mut tiles = Vec::new();
        let tile = self.config.tile_tokens;
        let mut start = span.start;
        while start < span.end {
            let end = (start / tile * tile + tile).min(span.end);
            if ranges.iter().any(|r| r.start < end && start < r.end) {
                // The next tile's stored rows, fetched while this one is worked on.
                let next = (end < span.end).then(|| {
                    let n = (end + tile).min(span.end) - end;
                    [keys.row_addresses(end, n), values.row_addresses(end, n)]
                });
                let k = keys.read_tile(start, end - start, &mut scratch.keys)?;
                let v = values.read_tile(start, end - start, &mut scratch.values)?;
                tiles.push((start, k.stats, v.stats));
                for (i, r) in ranges.iter().enumerate() {
                    let (lo, hi) = (r.start.max(start), r.end.min(end));
                    if lo < hi {
                        let rows = (lo - start) * ch..(hi - start) * ch;
                        attend_tile(
                            &q[i * ql..][..ql],
                            k.rows.slice(rows.clone(), ch),
                            v.rows.slice(rows, ch),
                            geometry,
                            next.as_ref().filter(|_| i == 0),
                            &mut scratch.kernel,
                            &mut partials[i],
                        );
                    }
                }
            }
            start = end;
        }
        Ok((partials, tiles))
    }

    /// Normalises the partials into outputs, rotating them back when the
    /// values were summed in rotated coordinates.
    fn finish(
        &self,
        partials: &[Partial],
        mut tiles: Vec<TileStats>,
        value_rotation: Option<&'static Hadamard>,
    ) -> Result<AttentionOutput> {
        let s = &self.shape;
        let mut out = vec![0.0; partials.len() * s.q_len()];
        let mut lse = vec![0.0; partials.len() * s.q_heads()];
        for ((p, o), l) in partials
            .iter()
            .zip(out.chunks_exact_mut(s.q_len()))
            .zip(lse.chunks_exact_mut(s.q_heads()))
        {
            p.finish(o, l);
        }
        if let Some(h) = value_rotation {
            h.unrotate(&mut out);
        }
        // A tile read by several query blocks counts once.
        tiles.sort_by_key(|t| t.0);
        tiles.dedup_by_key(|t| t.0);
        let mut stats = AttentionStats {
            tiles: tiles.len() as u64,
            ..AttentionStats::default()
        };
        for (_, k, v) in tiles {
            stats.keys += k;
            stats.values += v;
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
        Ok(AttentionOutput {
            out,
            lse,
            stats,
            non_finite,
        })
    }
}
