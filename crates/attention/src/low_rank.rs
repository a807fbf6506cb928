//! Attention over kv-lowrank stores.
//!
//! - Every [`LowRankStore`] is a [`KvSource`] whose tiles are the
//!   reconstructed rows `x̂ = μ + c·B` (each token with its chunk's basis):
//!   the universal path, for any mix of forms. [`PreRopeKeys`] does the
//!   same for keys projected before RoPE and rotates each reconstructed row
//!   to its position.
//! - [`Attention::attend_low_rank`] is the coefficient-space path of the
//!   low-rank paper (section 3.3 B) for keys and values both low-rank and
//!   post-RoPE: per KV head and per run of tokens where the key and value
//!   bases stay the same, the queries are projected once (`q̃ = q·Bᵀ`), the
//!   existing fused kernels attend the coefficient stores as heads of
//!   dimension `r` (queries rescaled by `√(r/d)` so scores keep `1/√d`), the
//!   key mean adds `q·μ/√d` to the run's log-sum-exp, each run's output is
//!   reconstructed once (`õ·E + μ_E`), and runs are merged by an exact
//!   log-sum-exp combination. No key or value row is ever reconstructed.
//! - [`certificates`] gives the runtime error bounds of
//!   [`kv_lowrank::certificate`] for any call, from stored residual norms.

use std::ops::Range;

use kv_lowrank::{Certificate, LowRankStore, StoreScratch};
use rayon::prelude::*;

use crate::attend::{Attention, AttentionOutput, AttentionStats};
use crate::error::{AttentionError, Result, check_len};
use crate::numerics::Numerics;
use crate::rope::Rope;
use crate::shape::{HeadShape, Mask};
use crate::source::{KvSource, Tile, TileRows};

/// Scratch of the low-rank sources: the coefficient decode and the f32 tile.
#[derive(Clone, Debug, Default)]
pub struct LowRankScratch {
    store: StoreScratch,
    rows: Vec<f32>,
}

impl LowRankScratch {
    fn tile(&mut self, len: usize) -> (&mut [f32], &mut StoreScratch) {
        if self.rows.len() < len {
            self.rows.resize(len, 0.0);
        }
        (&mut self.rows[..len], &mut self.store)
    }
}

/// Reconstructed rows, tile by tile (keys projected after RoPE, or values).
impl KvSource for LowRankStore {
    type Scratch = LowRankScratch;

    fn tokens(&self) -> usize {
        LowRankStore::tokens(self)
    }

    fn channels(&self) -> usize {
        LowRankStore::channels(self)
    }

    fn stored_bytes(&self) -> usize {
        LowRankStore::stored_bytes(self)
    }

    fn read_tile<'s>(
        &'s self,
        start: usize,
        count: usize,
        scratch: &'s mut LowRankScratch,
    ) -> Result<Tile<'s>> {
        let (rows, store) = scratch.tile(count * self.channels());
        let stats = self.decode_rows_into(start, count, rows, store)?;
        Ok(Tile {
            rows: TileRows::F32(rows),
            stats,
        })
    }
}

/// Keys projected before RoPE (`pca-*-pre`, `fd-*-pre`): each reconstructed
/// row is rotated to its position (`first_position + token`), which equals
/// projecting nothing and rotating the reconstructed un-rotated key.
#[derive(Clone, Copy, Debug)]
pub struct PreRopeKeys<'a> {
    store: &'a LowRankStore,
    rope: &'a Rope,
    first_position: usize,
}

impl<'a> PreRopeKeys<'a> {
    /// Keys of `store` whose token `t` sits at position `first_position + t`.
    pub fn new(store: &'a LowRankStore, rope: &'a Rope, first_position: usize) -> Self {
        Self {
            store,
            rope,
            first_position,
        }
    }
}

impl KvSource for PreRopeKeys<'_> {
    type Scratch = LowRankScratch;

    fn tokens(&self) -> usize {
        self.store.tokens()
    }

    fn channels(&self) -> usize {
        self.store.channels()
    }

    fn stored_bytes(&self) -> usize {
        self.store.stored_bytes()
    }

    fn read_tile<'s>(
        &'s self,
        start: usize,
        count: usize,
        scratch: &'s mut LowRankScratch,
    ) -> Result<Tile<'s>> {
        let ch = self.store.channels();
        let (rows, store) = scratch.tile(count * ch);
        let stats = self.store.decode_rows_into(start, count, rows, store)?;
        for (i, row) in rows.chunks_exact_mut(ch).enumerate() {
            self.rope.apply(row, self.first_position + start + i)?;
        }
        Ok(Tile {
            rows: TileRows::F32(rows),
            stats,
        })
    }
}

/// Runs of tokens over which both stores keep their bases: `(range, key
/// chunk, value chunk)`.
fn runs(keys: &LowRankStore, values: &LowRankStore) -> Vec<(Range<usize>, usize, usize)> {
    let mut cuts: Vec<usize> = keys
        .chunks()
        .iter()
        .chain(values.chunks())
        .flat_map(|c| [c.start, c.end])
        .collect();
    cuts.push(0);
    cuts.push(keys.tokens());
    cuts.sort_unstable();
    cuts.dedup();
    let find = |chunks: &[kv_lowrank::Chunk], t: usize| {
        chunks.iter().position(|c| c.start <= t && t < c.end)
    };
    cuts.windows(2)
        .filter(|w| w[0] < w[1])
        .filter_map(|w| {
            let (k, v) = (find(keys.chunks(), w[0])?, find(values.chunks(), w[0])?);
            Some((w[0]..w[1], k, v))
        })
        .collect()
}

/// Runtime error certificates of a call (`queries × q_heads`, query-major):
/// from the stored residual norms of the low-rank parts (`None` for a part
/// stored otherwise, which contributes no error) over each query's visible
/// keys. `value_norm` bounds `‖vᵢ‖` where the values are not low-rank.
#[allow(clippy::too_many_arguments)]
pub fn certificates(
    shape: &HeadShape,
    queries: &[f32],
    positions: &[usize],
    tokens: usize,
    keys: Option<&LowRankStore>,
    values: Option<&LowRankStore>,
    value_norm: f32,
    mask: &Mask<'_>,
) -> Result<Vec<Certificate>> {
    let (d, ql, group) = (shape.head_dim(), shape.q_len(), shape.group());
    check_len(
        "queries (positions × q_heads × head_dim)",
        positions.len() * ql,
        queries.len(),
    )?;
    let ranges = mask.ranges(positions, tokens)?;
    let scale = shape.scale() as f32;
    let mut out = Vec::with_capacity(positions.len() * shape.q_heads());
    for (i, range) in ranges.iter().enumerate() {
        for g in 0..shape.q_heads() {
            let h = g / group;
            let q = &queries[i * ql + g * d..][..d];
            let q_norm = q.iter().map(|v| v * v).sum::<f32>().sqrt();
            let key_res = keys.map_or(0.0, |k| k.max_residual(h, range.clone()));
            let (v_norm, v_res) = match values {
                Some(v) => (
                    v.max_norm(h, range.clone()),
                    v.max_residual(h, range.clone()),
                ),
                None => (value_norm, 0.0),
            };
            out.push(Certificate::new(q_norm, scale, key_res, v_norm, v_res));
        }
    }
    Ok(out)
}

/// One (run, KV head)'s attention in coefficient space, before the merge.
struct HeadPart<'a> {
    h: usize,
    values: &'a kv_lowrank::Basis,
    part: AttentionOutput,
    shift: Vec<f32>,
}

impl Attention {
    /// Attention in coefficient space over low-rank keys and values (both
    /// projected after RoPE, keys and values of equal rank per head and
    /// run): see the module docs. `queries` are `positions.len() × q_heads ×
    /// head_dim`. Statistics count each coefficient tile once per KV head
    /// and run that reads it.
    pub fn attend_low_rank(
        &self,
        queries: &[f32],
        positions: &[usize],
        keys: &LowRankStore,
        values: &LowRankStore,
        mask: &Mask<'_>,
    ) -> Result<AttentionOutput> {
        let s = *self.shape();
        let (d, ql, group, kv_heads) = (s.head_dim(), s.q_len(), s.group(), s.kv_heads());
        check_len("key channels", s.kv_channels(), keys.channels())?;
        check_len("value channels", s.kv_channels(), values.channels())?;
        check_len("value tokens", keys.tokens(), values.tokens())?;
        check_len("key heads", kv_heads, keys.heads())?;
        check_len(
            "queries (positions × q_heads × head_dim)",
            positions.len() * ql,
            queries.len(),
        )?;
        if keys.spec().pre_rope {
            return Err(AttentionError::InvalidParameter {
                name: "low-rank keys",
                reason: "keys projected before RoPE are read through PreRopeKeys".into(),
            });
        }
        if keys.tokens() == 0 {
            return Err(AttentionError::EmptyCache);
        }
        let ranges = mask.ranges(positions, keys.tokens())?;
        let n = positions.len();
        // Running log-sum-exp merge per query and query head.
        let mut best = vec![f32::NEG_INFINITY; n * s.q_heads()];
        let mut sum = vec![0f64; n * s.q_heads()];
        let mut acc = vec![0f64; n * ql];
        let mut stats = AttentionStats::default();
        let scale = s.scale() as f32;
        // Every (run, KV head) attends on its own, in parallel; the merge
        // below is sequential and in a fixed order, so results do not
        // depend on the thread count.
        // `Numerics::Auto`'s integer path was measured on stored keys and
        // values, not on coefficients: they are scored exactly unless a
        // numerics is asked for.
        let mut config = *self.config();
        if config.numerics == Numerics::Auto {
            config.numerics = Numerics::Exact;
        }
        let tasks: Vec<(Range<usize>, usize, usize, usize)> = runs(keys, values)
            .into_iter()
            .flat_map(|(run, kc, vc)| (0..kv_heads).map(move |h| (run.clone(), kc, vc, h)))
            .collect();
        let parts = tasks
            .par_iter()
            .map(|(run, kc, vc, h)| -> Result<Option<HeadPart>> {
                let h = *h;
                let kb = &keys.chunks()[*kc].bases[h];
                let vb = &values.chunks()[*vc].bases[h];
                let r = kb.rank();
                if vb.rank() != r {
                    return Err(AttentionError::InvalidParameter {
                        name: "low-rank ranks",
                        reason: format!(
                            "head {h}: keys of rank {r} and values of rank {} (the coefficient path needs equal ranks; read the stores as KvSources instead)",
                            vb.rank()
                        ),
                    });
                }
                let sub = Attention::with_config(HeadShape::new(group, 1, r)?, config)?;
                // Projected, rescaled queries of this head's group.
                let rescale = ((r as f64).sqrt() * s.scale()) as f32;
                let mut q = vec![0f32; n * group * r];
                let mut shift = vec![0f32; n * group];
                for i in 0..n {
                    for j in 0..group {
                        let src = &queries[i * ql + (h * group + j) * d..][..d];
                        let dst = &mut q[(i * group + j) * r..][..r];
                        kb.project_query(src, dst);
                        for v in dst.iter_mut() {
                            *v *= rescale;
                        }
                        shift[i * group + j] = kb.mean_score(src) * scale;
                    }
                }
                let visible: Vec<Range<usize>> = ranges
                    .iter()
                    .map(|v| v.start.max(run.start)..v.end.min(run.end))
                    .map(|v| if v.start < v.end { v } else { 0..0 })
                    .collect();
                if visible.iter().all(|v| v.is_empty()) {
                    return Ok(None);
                }
                // One query decodes with the keys split across threads;
                // several share each tile read (prefill).
                let (kc, vc) = (keys.coefficients(h), values.coefficients(h));
                let part = if n == 1 {
                    sub.decode(&q, positions[0], kc, vc, &Mask::Ranges(&visible))?
                } else {
                    sub.prefill(&q, positions, kc, vc, &Mask::Ranges(&visible))?
                };
                Ok(Some(HeadPart {
                    h,
                    values: vb,
                    part,
                    shift,
                }))
            })
            .collect::<Result<Vec<_>>>()?;
        let mut full = vec![0f32; d];
        for HeadPart {
            h,
            values: vb,
            part,
            shift,
        } in parts.into_iter().flatten()
        {
            stats.keys += part.stats.keys;
            stats.values += part.stats.values;
            stats.tiles += part.stats.tiles;
            let r = vb.rank();
            for i in 0..n {
                for j in 0..group {
                    let lse = part.lse[i * group + j];
                    if lse == f32::NEG_INFINITY {
                        continue;
                    }
                    let lse = lse + shift[i * group + j];
                    let slot = i * s.q_heads() + h * group + j;
                    vb.reconstruct(&part.out[(i * group + j) * r..][..r], &mut full);
                    // Merge: rescale the running sums to the new maximum.
                    let m = best[slot].max(lse);
                    let old = f64::from(best[slot] - m).exp();
                    let w = f64::from(lse - m).exp();
                    let out = &mut acc[i * ql + (h * group + j) * d..][..d];
                    for (o, &x) in out.iter_mut().zip(&full) {
                        *o = *o * old + w * f64::from(x);
                    }
                    sum[slot] = sum[slot] * old + w;
                    best[slot] = m;
                }
            }
        }
        let mut out = vec![0f32; n * ql];
        let mut lse = vec![f32::NEG_INFINITY; n * s.q_heads()];
        for slot in 0..n * s.q_heads() {
            if sum[slot] > 0.0 {
                lse[slot] = best[slot] + sum[slot].ln() as f32;
                let (i, g) = (slot / s.q_heads(), slot % s.q_heads());
                for (o, a) in out[i * ql + g * d..][..d]
                    .iter_mut()
                    .zip(&acc[i * ql + g * d..][..d])
                {
                    *o = (a / sum[slot]) as f32;
                }
            }
        }
        let non_finite = out.iter().filter(|x| !x.is_finite()).count();
        Ok(AttentionOutput {
            out,
            lse,
            stats,
            non_finite,
        })
    }
}
