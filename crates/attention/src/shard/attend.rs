//! Attention over a [`ShardLayer`] on its compressed forms (the module
//! docs of `shard` give the identities): work items per KV head and block
//! of queries, each scoring the plain rows (sink, window, stream) and the
//! rebuilt key tiles of every compressed run (the middle and its folded
//! chunks), then summing values with the softmax weights, the compressed
//! runs' in the rotated space.

use std::ops::Range;

use faer::linalg::matmul::matmul;
use faer::{Accum, MatMut, MatRef, Par};
use kv_quant::DecodeScratch;
use rayon::prelude::*;

use super::tile_math::{OffsetTable, score_tile, turn_pairs, weigh_codebook};
use super::{Compressed, MiddleValues, QUERY_BLOCK, ShardLayer, TILE};
use crate::attend::{Attention, AttentionOutput, AttentionStats};
use crate::error::{AttentionError, Result, check_len};
use crate::isa::Isa;
use crate::kernel::exp;
use crate::rope::Rope;
use crate::shape::Mask;

impl ShardLayer {
    /// Attention of queries (`queries × q_heads × head_dim`, RoPE applied
    /// at `positions`) over the layer under `mask`, computed on the
    /// compressed forms (module docs). `attention`'s shape must read this
    /// layer's KV heads and head dimension.
    pub fn attend(
        &self,
        attention: &Attention,
        queries: &[f32],
        positions: &[usize],
        mask: &Mask<'_>,
    ) -> Result<AttentionOutput> {
        let shape = *attention.shape();
        if shape.kv_heads() != self.kv_heads || shape.head_dim() != self.head_dim {
            return Err(AttentionError::InvalidParameter {
                name: "shape",
                reason: format!(
                    "{} KV heads of {} channels read a layer of {} heads of {}",
                    shape.kv_heads(),
                    shape.head_dim(),
                    self.kv_heads,
                    self.head_dim
                ),
            });
        }
        check_len(
            "queries (positions × q_heads × head_dim)",
            positions.len() * shape.q_len(),
            queries.len(),
        )?;
        let ranges = mask.ranges(positions, self.tokens)?;
        let (plain_k, plain_v) = self.plain_rows()?;
        // Few queries (decode): split the keys too, so every thread has
        // work; chunks are merged exactly by their log-sum-exp.
        let chunk = if positions.len() <= QUERY_BLOCK {
            KEY_CHUNK
        } else {
            self.tokens.max(1)
        };
        let chunks: Vec<Vec<Range<usize>>> = (0..self.tokens.max(1))
            .step_by(chunk)
            .map(|c0| {
                let c = c0..(c0 + chunk).min(self.tokens);
                ranges
                    .iter()
                    .map(|r| r.start.max(c.start)..r.end.min(c.end).max(r.start.max(c.start)))
                    .collect()
            })
            .collect();
        let n_chunks = chunks.len();
        // Many queries read prebuilt tiles, a KV head per work item; few
        // queries (decode) rebuild each tile once for every KV head.
        let prebuilt = positions.len() > QUERY_BLOCK;
        let head_sets: Vec<Range<usize>> = if prebuilt {
            (0..self.kv_heads).map(|g| g..g + 1).collect()
        } else {
            std::iter::once(0..self.kv_heads).collect()
        };
        let blocks: Vec<(Range<usize>, Range<usize>, usize)> = head_sets
            .iter()
            .flat_map(|gs| {
                (0..positions.len())
                    .step_by(QUERY_BLOCK)
                    .flat_map(move |s| {
                        let qs = s..(s + QUERY_BLOCK).min(positions.len());
                        (0..n_chunks).map(move |c| (gs.clone(), qs.clone(), c))
                    })
            })
            .collect();
        let plain = self.plain_spans();
        let total: usize = self.compressed.iter().map(|c| c.tokens.len()).sum();
        let mut ctx = Context {
            layer: self,
            queries,
            plain: &plain,
            plain_k: &plain_k,
            plain_v: &plain_v,
            offsets: &self.offsets,
            tiles: None,
            compressed: total,
            group: shape.group(),
            q_heads: shape.q_heads(),
            scale: shape.scale() as f32,
            isa: attention.config().isa,
        };
        // Many queries: each compressed key tile is built once and read by all.
        let mut tiles = Vec::new();
        if prebuilt && total > 0 {
            let d = self.head_dim;
            tiles = vec![0.0f32; self.kv_heads * total * d];
            for (g, head) in tiles.chunks_exact_mut(total * d).enumerate() {
                for c in &self.compressed {
                    let kept = c.keys.kept();
                    head[c.first * d..(c.first + c.tokens.len()) * d]
                        .par_chunks_mut(TILE * d)
                        .enumerate()
                        .try_for_each_init(
                            || vec![0.0f32; TILE * kept],
                            |coeffs, (i, tile)| {
                                let codes = tile.len() / d * kept;
                                let t0 = c.tokens.start + i * TILE;
                                ctx.key_tile(c, g..g + 1, t0, &mut coeffs[..codes], tile)
                            },
                        )?;
                }
            }
        }
        if !tiles.is_empty() {
            ctx.tiles = Some(&tiles);
        }
        let parts: Vec<BlockOutput> = blocks
            .par_iter()
            .map(|(gs, qs, c)| ctx.block(gs.clone(), qs.clone(), &chunks[*c]))
            .collect::<Result<_>>()?;
        let d = self.head_dim;
        let n = positions.len();
        // Merge the chunks of each (query, head): weights e^(lse_c − lse).
        let mut acc = vec![0.0f64; n * shape.q_len()];
        let mut lse = vec![f32::NEG_INFINITY; n * shape.q_heads()];
        for merge in [false, true] {
            for ((gs, qs, _), part) in blocks.iter().zip(&parts) {
                for ((bi, i), g) in qs
                    .clone()
                    .enumerate()
                    .flat_map(|q| gs.clone().map(move |g| (q, g)))
                {
                    for hh in 0..shape.group() {
                        let h = i * shape.q_heads() + g * shape.group() + hh;
                        let at = (bi * gs.len() + g - gs.start) * shape.group() + hh;
                        let l = part.lse[at];
                        if !merge {
                            // First pass: the total log-sum-exp.
                            lse[h] = log_add(lse[h], l);
                            continue;
                        }
                        if l == f32::NEG_INFINITY {
                            continue;
                        }
                        let w = f64::from(l - lse[h]).exp();
                        for (a, &o) in acc[h * d..][..d].iter_mut().zip(&part.out[at * d..][..d]) {
                            *a += w * f64::from(o);
                        }
                    }
                }
            }
        }
        let out: Vec<f32> = acc.iter().map(|&a| a as f32).collect();
        let non_finite = out.iter().filter(|x| !x.is_finite()).count();
        Ok(AttentionOutput {
            out,
            lse,
            stats: AttentionStats::default(),
            non_finite,
        })
    }
}

/// `cos`, `sin` of `θᵢ·t₀` for successive tile starts `t₀`: exact (f64)
/// every [`TileStart::ANCHOR`] tiles, advanced by one f64 rotation of
/// `θᵢ·TILE` in between.
struct TileStart {
    inv_freq: Vec<f64>,
    start: usize,
    tiles: usize,
    /// Current angle's cos and sin, f64.
    z: Vec<(f64, f64)>,
    step: Vec<(f64, f64)>,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl TileStart {
    /// Tiles between exact anchors.
    const ANCHOR: usize = 16;

    fn new(rope: &Rope, start: usize) -> Self {
        let inv_freq = rope.inv_freq().to_vec();
        let step = inv_freq
            .iter()
            .map(|&f| {
                let (s, c) = (f * TILE as f64).sin_cos();
                (c, s)
            })
            .collect();
        let n = inv_freq.len();
        Self {
            inv_freq,
            start,
            tiles: 0,
            z: vec![(1.0, 0.0); n],
            step,
            cos: vec![0.0; n],
            sin: vec![0.0; n],
        }
    }

    /// The trig of the next tile's start.
    fn next(&mut self) -> (&[f32], &[f32]) {
        if self.tiles.is_multiple_of(Self::ANCHOR) {
            let t0 = (self.start + self.tiles * TILE) as f64;
            for (z, &f) in self.z.iter_mut().zip(&self.inv_freq) {
                let (s, c) = (t0 * f).sin_cos();
                *z = (c, s);
            }
        } else {
            for (z, &(c, s)) in self.z.iter_mut().zip(&self.step) {
                *z = (z.0 * c - z.1 * s, z.0 * s + z.1 * c);
            }
        }
        self.tiles += 1;
        for ((z, c), s) in self.z.iter().zip(&mut self.cos).zip(&mut self.sin) {
            *c = z.0 as f32;
            *s = z.1 as f32;
        }
        (&self.cos, &self.sin)
    }
}

/// What every work item of one call reads.
struct Context<'a> {
    layer: &'a ShardLayer,
    queries: &'a [f32],
    /// The runs of plain tokens and their first rows in `plain_k`, `plain_v`.
    plain: &'a [(Range<usize>, usize)],
    plain_k: &'a [f32],
    plain_v: &'a [f32],
    offsets: &'a OffsetTable,
    /// Every compressed key tile of every KV head (`kv_heads × compressed
    /// × d`, each tile channel by channel), built once when many queries
    /// read them (prefill).
    tiles: Option<&'a [f32]>,
    /// Compressed tokens in all.
    compressed: usize,
    group: usize,
    q_heads: usize,
    scale: f32,
    /// The configured instruction set of the tile loops.
    isa: Isa,
}

/// Buffers of one work item's compressed scores, shared by its runs (all
/// on the middle's basis, so of one width).
struct TileScratch {
    /// One tile's coefficients (`TILE × kept`).
    coeffs: Vec<f32>,
    /// One tile's rebuilt keys when the prefill's tiles are not at hand.
    own: Vec<f32>,
    /// A query rotated back to a tile's start.
    query: Vec<f32>,
}

/// Outputs of one work item: `queries × KV heads × group` heads.
struct BlockOutput {
    out: Vec<f32>,
    lse: Vec<f32>,
}

impl Context<'_> {
    /// Attention of queries `qs` for the query heads of KV heads `gs`
    /// (outputs ordered by query, KV head, then query head of the group).
    fn block(
        &self,
        gs: Range<usize>,
        qs: Range<usize>,
        ranges: &[Range<usize>],
    ) -> Result<BlockOutput> {
        let layer = self.layer;
        let (d, ch) = (layer.head_dim, layer.channels());
        let heads = qs.len() * gs.len() * self.group;
        // Scores of each (query, head) over its visible range.
        let mut scores: Vec<Vec<f32>> = Vec::with_capacity(heads);
        for i in qs.clone() {
            for g in gs.clone() {
                for hh in 0..self.group {
                    let h = g * self.group + hh;
                    let q = &self.queries[(i * self.q_heads + h) * d..][..d];
                    let r = &ranges[i];
                    let mut s = vec![f32::NEG_INFINITY; r.len()];
                    for (span, row) in self.plain {
                        for t in span.start.max(r.start)..span.end.min(r.end) {
                            let k = &self.plain_k[(row + t - span.start) * ch + g * d..][..d];
                            s[t - r.start] = dot(q, k) * self.scale;
                        }
                    }
                    scores.push(s);
                }
            }
        }
        let lo = qs.clone().map(|i| ranges[i].start).min().unwrap_or(0);
        let hi = qs.clone().map(|i| ranges[i].end).max().unwrap_or(0);
        let kept = layer.compressed.first().map_or(0, |c| c.keys.kept());
        let mut tile_scratch = TileScratch {
            coeffs: vec![0.0f32; TILE * kept],
            own: vec![
                0.0f32;
                if self.tiles.is_some() {
                    0
                } else {
                    TILE * gs.len() * d
                }
            ],
            query: vec![0.0f32; d],
        };
        for c in &layer.compressed {
            self.compressed_scores(c, &gs, &qs, ranges, lo..hi, &mut tile_scratch, &mut scores)?;
        }
        // Softmax and the value sums.
        let g_len = self.group;
        let mut out = vec![0.0f32; heads * d];
        let mut lse = vec![f32::NEG_INFINITY; heads];
        let per_query = gs.len() * g_len;
        let mut rot = vec![0.0f32; per_query * d];
        let mut part = vec![0.0f32; g_len * d];
        let mut hist = Vec::new();
        let mut rows = vec![0.0f32; TILE * ch];
        let mut scratch = DecodeScratch::new();
        let mut sums = vec![0.0f64; per_query];
        for (bi, i) in qs.clone().enumerate() {
            let r = &ranges[i];
            if r.is_empty() {
                continue;
            }
            let mut rotation = None;
            let at0 = bi * per_query;
            for (gi, g) in gs.clone().enumerate() {
                for hh in 0..g_len {
                    let at = at0 + gi * g_len + hh;
                    let s = &mut scores[at];
                    let m = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    // Weights in place (the kernels' branch-free exp vectorises).
                    for x in s.iter_mut() {
                        *x = exp::<false>(*x - m);
                    }
                    sums[gi * g_len + hh] = s.iter().map(|&w| f64::from(w)).sum();
                    lse[at] = m;
                    let o = &mut out[at * d..][..d];
                    for (span, row) in self.plain {
                        for t in span.start.max(r.start)..span.end.min(r.end) {
                            let w = s[t - r.start];
                            let v = &self.plain_v[(row + t - span.start) * ch + g * d..][..d];
                            for (o, &v) in o.iter_mut().zip(v) {
                                *o += w * v;
                            }
                        }
                    }
                }
            }
            // Compressed values summed in the rotated space (each stored row
            // read once for all the heads that weigh it), rotated back once.
            rot.fill(0.0);
            let weights = &scores[at0..at0 + per_query];
            for c in &layer.compressed {
                let span = r.start.max(c.tokens.start)..r.end.min(c.tokens.end);
                if span.is_empty() {
                    continue;
                }
                let at = span.start - r.start;
                match &*c.values {
                    MiddleValues::Vq(vq) => {
                        for (gi, g) in gs.clone().enumerate() {
                            let ws = &weights[gi * g_len..][..g_len];
                            vq_sum(
                                self.isa,
                                vq,
                                g,
                                d,
                                c.tokens.start,
                                span.clone(),
                                (ws, at),
                                &mut hist,
                                &mut part,
                            );
                            let max = &vq.max()[g * d..][..d];
                            for (x, p) in rot[gi * g_len * d..][..g_len * d]
                                .chunks_exact_mut(d)
                                .zip(part.chunks_exact(d))
                            {
                                for ((x, &p), &mx) in x.iter_mut().zip(p).zip(max) {
                                    *x += p * mx;
                                }
                            }
                        }
                        rotation = Some(vq.hadamard());
                    }
                    MiddleValues::Nf4(store) => {
                        for t0 in span.clone().step_by(TILE) {
                            let n = TILE.min(span.end - t0);
                            let tile = &mut rows[..n * ch];
                            store.decode_rows_rotated_into(
                                t0 - c.tokens.start,
                                n,
                                tile,
                                &mut scratch,
                            )?;
                            for (j, row) in tile.chunks_exact(ch).enumerate() {
                                let t = t0 + j - r.start;
                                for (gi, g) in gs.clone().enumerate() {
                                    let v = &row[g * d..][..d];
                                    for hh in 0..g_len {
                                        let w = weights[gi * g_len + hh][t];
                                        let at = (gi * g_len + hh) * d;
                                        for (a, &v) in rot[at..at + d].iter_mut().zip(v) {
                                            *a += w * v;
                                        }
                                    }
                                }
                            }
                        }
                        rotation = store.rotation()?;
                    }
                }
            }
            for (k, x) in rot.chunks_exact_mut(d).enumerate() {
                if let Some(h) = rotation {
                    h.unrotate(x);
                }
                let l = sums[k];
                let inv = (1.0 / l) as f32;
                for (o, &x) in out[(at0 + k) * d..][..d].iter_mut().zip(&*x) {
                    *o = (*o + x) * inv;
                }
                lse[at0 + k] += l.ln() as f32;
            }
        }
        Ok(BlockOutput { out, lse })
    }

    /// Scores of queries `qs` (the query heads of KV heads `gs`) against the
    /// keys of the compressed run `c` within `visible`, tile by tile: each
    /// tile rebuilt once for all of `gs` (or read from the prefill's tiles)
    /// and scored through the relative-position identity.
    #[allow(clippy::too_many_arguments)]
    fn compressed_scores(
        &self,
        c: &Compressed,
        gs: &Range<usize>,
        qs: &Range<usize>,
        ranges: &[Range<usize>],
        visible: Range<usize>,
        scratch: &mut TileScratch,
        scores: &mut [Vec<f32>],
    ) -> Result<()> {
        let layer = self.layer;
        let d = layer.head_dim;
        let (lo, hi) = (
            visible.start.max(c.tokens.start),
            visible.end.min(c.tokens.end),
        );
        if lo >= hi {
            return Ok(());
        }
        let kept = c.keys.kept();
        let TileScratch {
            coeffs,
            own,
            query: qv,
        } = scratch;
        let first = c.tokens.start + (lo - c.tokens.start) / TILE * TILE;
        let mut back = TileStart::new(&layer.rope, first);
        for t0 in (first..hi).step_by(TILE) {
            let (cos0, sin0) = back.next();
            let n = TILE.min(c.tokens.end - t0);
            if self.tiles.is_none() {
                self.key_tile(
                    c,
                    gs.clone(),
                    t0,
                    &mut coeffs[..n * kept],
                    &mut own[..n * gs.len() * d],
                )?;
            }
            for (gi, g) in gs.clone().enumerate() {
                // Head `g`'s keys of the tile, channel by channel (`d × n`).
                let keys = match self.tiles {
                    Some(all) => {
                        &all[(g * self.compressed + c.first + t0 - c.tokens.start) * d..][..d * n]
                    }
                    None => &own[gi * d * n..][..d * n],
                };
                for (bi, i) in qs.clone().enumerate() {
                    let r = &ranges[i];
                    let span = t0.max(r.start)..(t0 + n).min(r.end);
                    if span.is_empty() {
                        continue;
                    }
                    for hh in 0..self.group {
                        let h = g * self.group + hh;
                        qv.copy_from_slice(&self.queries[(i * self.q_heads + h) * d..][..d]);
                        // The query (at angle θp) rotated back by θt₀: the
                        // pair products then carry θ(t₀ − p) + θ(t − t₀) = θΔ.
                        for ((&c, &s), &(a, b)) in cos0.iter().zip(sin0).zip(&self.offsets.index) {
                            let (x, y) = (qv[a], qv[b]);
                            qv[a] = x * c + y * s;
                            qv[b] = y * c - x * s;
                        }
                        let mut acc = [0.0f32; TILE];
                        let acc = &mut acc[..n];
                        score_tile(self.isa, qv, keys, acc);
                        let s = &mut scores[(bi * gs.len() + gi) * self.group + hh];
                        for (o, &a) in s[span.start - r.start..span.end - r.start]
                            .iter_mut()
                            .zip(&acc[span.start - t0..])
                        {
                            *o = a * self.scale;
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// The keys of KV heads `gs` for tokens `t0..t0 + n` of the compressed
    /// run `c` (`t0` a tile start), channel by channel: `tile` holds
    /// `gs.len() × d` rows of `n`. `μ + c·B` with RoPE undone, the
    /// coefficients decoded once and one small GEMM for all the heads
    /// (faer's kernels), then each token's pairs turned by its offset in
    /// the tile.
    fn key_tile(
        &self,
        c: &Compressed,
        gs: Range<usize>,
        t0: usize,
        coeffs: &mut [f32],
        tile: &mut [f32],
    ) -> Result<()> {
        let layer = self.layer;
        let (d, ch, kept) = (layer.head_dim, layer.channels(), c.keys.kept());
        let width = gs.len() * d;
        let n = tile.len() / width;
        let basis = c.keys.basis();
        let (rows, mean) = (basis.rows(), &basis.mean()[gs.start * d..gs.end * d]);
        c.keys.coefficients_into(t0 - c.tokens.start, n, coeffs)?;
        for (k, &m) in tile.chunks_exact_mut(n).zip(mean) {
            k.fill(m);
        }
        if kept > 0 {
            // `Kᵀ = Bᵀ·Cᵀ`: the basis rows read as columns, the tile's
            // coefficients (`n × kept`, by token) as `kept × n`.
            matmul(
                MatMut::from_row_major_slice_mut(tile, width, n),
                Accum::Add,
                MatRef::from_column_major_slice_with_stride(
                    &rows[gs.start * d..(kept - 1) * ch + gs.end * d],
                    width,
                    kept,
                    ch,
                ),
                MatRef::from_column_major_slice(coeffs, kept, n),
                1.0f32,
                Par::Seq,
            );
        }
        let t = self.offsets;
        for head in tile.chunks_exact_mut(d * n) {
            turn_pairs(self.isa, head, n, t);
        }
        Ok(())
    }
}

/// Keys per work item of a decode call (few queries).
const KEY_CHUNK: usize = 2048;

/// `ln(e^a + e^b)`, exact at `-inf`.
fn log_add(a: f32, b: f32) -> f32 {
    let (hi, lo) = if a >= b { (a, b) } else { (b, a) };
    if lo == f32::NEG_INFINITY {
        return hi;
    }
    hi + (1.0 + (lo - hi).exp()).ln()
}

/// Spans at least this long sum VQ values through per-centroid weight
/// histograms; shorter ones centroid by centroid.
const HISTOGRAM_SPAN: usize = 512;

/// `part[h] = Σ_t ws[h][at + t]·centroid[idx[t]]` for each head `h`
/// weighing KV head `g` (its `d/4` groups) over the middle tokens `span`
/// (`at`: where the span starts in each head's weights), before the
/// channel maxima; `part` holds `ws.len() × d`. Long spans add each token's
/// weights into a 256-bin histogram per group (scalar adds per code instead
/// of four multiply-adds, since all groups share one codebook; the heads'
/// bins side by side, so each code is read once) and multiply the
/// histograms by the codebook once.
#[allow(clippy::too_many_arguments)]
fn vq_sum(
    isa: Isa,
    vq: &kv_quant::ChannelVq,
    g: usize,
    d: usize,
    first: usize,
    span: Range<usize>,
    (ws, at): (&[Vec<f32>], usize),
    hist: &mut Vec<[f32; 4]>,
    part: &mut [f32],
) {
    use kv_quant::channel_vq::{CENTROIDS, GROUP};
    let per = vq.channels() / GROUP;
    let groups = d / GROUP;
    let (centroids, _) = vq.centroids().as_chunks::<GROUP>();
    let rows = vq.indices()[(span.start - first) * per..(span.end - first) * per].chunks_exact(per);
    part.fill(0.0);
    if span.len() < HISTOGRAM_SPAN {
        for (t, row) in rows.enumerate() {
            for (h, acc) in part.chunks_exact_mut(d).enumerate() {
                let w = ws[h][at + t];
                let (acc, _) = acc.as_chunks_mut::<GROUP>();
                for (&k, a) in row[g * groups..][..groups].iter().zip(acc.iter_mut()) {
                    let c = &centroids[usize::from(k)];
                    for e in 0..GROUP {
                        a[e] += w * c[e];
                    }
                }
            }
        }
        return;
    }
    // Four heads' bins side by side (one 128-bit add per code), the heads
    // taken four at a time.
    for (hs, acc) in ws.chunks(4).zip(part.chunks_mut(4 * d)) {
        hist.clear();
        hist.resize(groups * CENTROIDS, [0.0f32; 4]);
        let mut w = [0.0f32; 4];
        for (t, row) in rows.clone().enumerate() {
            for (w, s) in w.iter_mut().zip(hs) {
                *w = s[at + t];
            }
            for (j, &k) in row[g * groups..][..groups].iter().enumerate() {
                let bin = &mut hist[j * CENTROIDS + usize::from(k)];
                for (b, &w) in bin.iter_mut().zip(&w) {
                    *b += w;
                }
            }
        }
        for (j, bins) in hist.chunks_exact(CENTROIDS).enumerate() {
            let mut block = [[0.0f32; 4]; 4];
            weigh_codebook(isa, bins, centroids, &mut block);
            for (head, sums) in acc.chunks_exact_mut(d).zip(&block) {
                head[j * GROUP..][..GROUP].copy_from_slice(sums);
            }
        }
    }
}

/// Dot product with eight partial sums (so the compiler can vectorise it).
#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for ((s, &x), &y) in acc.iter_mut().zip(x).zip(y) {
            *s += x * y;
        }
    }
    acc.iter().sum::<f32>() + tail
}
