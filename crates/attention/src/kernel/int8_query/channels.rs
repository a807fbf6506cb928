//! One group per channel (per-channel groups over blocks of tokens): for
//! each run of rows sharing a block, the block's scales folded into the
//! query before it is quantized, the levels scored centred on
//! `2^(bits−1)` (see the parent module).

use super::fold::{fold, fold_classes};
use super::{
    Context, DotBlock, DotValue, HeadBlockPass, IntScratch, LevelPacking, Prefetcher, QueryCodes,
    TileGeometry, for_head_blocks, quantize, split_planes,
};

/// One head's scores of a run of rows (per-channel groups): `s·dot + k`.
#[inline(always)]
fn finish_run<T: DotValue>(w: &mut [f32], dots: &[T], s: f32, k: f32) {
    for (w, &dot) in w.iter_mut().zip(dots) {
        *w = s * dot.value() + k;
    }
}

/// One group per channel: per run of rows in one block of tokens, the
/// block's scales folded into the query before it is quantized.
#[inline(always)]
pub(super) fn per_channel(
    ctx: Context<'_, '_>,
    scratch: &mut IntScratch,
    weights: &mut [f32],
    prefetch: &mut Prefetcher,
) -> bool {
    let mut folded = std::mem::take(&mut scratch.folded);
    folded.resize(ctx.geometry.d, 0.0);
    let scored = per_channel_runs(ctx, &mut folded, scratch, weights, prefetch);
    scratch.folded = folded;
    scored
}

/// [`per_channel`] with its folded-query buffer.
#[inline(always)]
fn per_channel_runs(
    ctx: Context<'_, '_>,
    folded: &mut [f32],
    scratch: &mut IntScratch,
    weights: &mut [f32],
    prefetch: &mut Prefetcher,
) -> bool {
    let (q, keys, mid) = (ctx.q, ctx.keys, ctx.mid);
    let TileGeometry { group, kv_heads, d } = ctx.geometry;
    let ch = kv_heads * d;
    // The middle of the levels' range, `2^(bits−1)` (a centred map's own
    // middle level).
    let centre = mid.unwrap_or((f32::from(keys.max_level()) + 1.0) / 2.0);
    // Packed levels with int8 codes take one scale per channel class
    // (heads short enough for a weight of 1: under 1.1 million channels).
    let classes = ctx.codes == QueryCodes::Int8
        && keys.packing == LevelPacking::Nibbles
        && super::classes::max_weight(d) >= 1;
    if classes {
        scratch
            .class_weights
            .resize(ctx.geometry.group * kv_heads, [0; 16]);
    }
    for (t0, t1, base) in super::super::block_runs(keys) {
        let (Some(scale), Some(offset)) = (
            keys.scale.get(base..base + ch),
            keys.offset.get(base..base + ch),
        ) else {
            return false;
        };
        if !scratch.reuse(q, [scale, offset], classes) {
            for (h, q) in q.chunks_exact(d).enumerate() {
                let kvh = h / group;
                let (a, b) = (&scale[kvh * d..][..d], &offset[kvh * d..][..d]);
                let (hi, lo) = (
                    &mut scratch.codes[h * d..][..d],
                    &mut scratch.codes_lo[h * d..][..d],
                );
                // `Σ_c s_c·code_c`, the codes' own image of `Σ q'`.
                let (folded_sum, offset_sum, coded_sum) = if classes {
                    let Some(head) = fold_classes(q, a, b, folded, hi, ctx.dot) else {
                        scratch.coded_for = None;
                        return false;
                    };
                    scratch.class_weights[h] = head.weights;
                    scratch.scale[h] = head.unit;
                    let coded_sum = head.unit * head.code_sum as f32;
                    (head.folded_sum, head.offset_sum, coded_sum)
                } else {
                    let (folded_sum, offset_sum) = fold(q, a, b, folded);
                    let Some(s) = quantize(folded, ctx.codes, hi, lo) else {
                        scratch.coded_for = None;
                        return false;
                    };
                    let code_sum: i32 = match ctx.codes {
                        QueryCodes::Int8 => hi.iter().map(|&c| i32::from(c)).sum(),
                        QueryCodes::Int16 => hi
                            .iter()
                            .zip(lo.iter())
                            .map(|(&h, &l)| 256 * i32::from(h) + i32::from(l))
                            .sum(),
                    };
                    scratch.scale[h] = s;
                    (folded_sum, offset_sum, s * code_sum as f32)
                };
                split_planes(hi, &mut scratch.planes[h * d..][..d]);
                let base = match mid {
                    None => offset_sum,
                    Some(mid) => -mid * folded_sum,
                };
                // Scored against levels centred on `centre`: the integer
                // sum `Σ q̂·l` less `centre·Σ q̂` (exact) is
                // `Σ q̂·(l − centre)`, and `centre·Σ q'` puts back exactly
                // what the centring took away, so the codes' rounding
                // errors meet `l − centre` (at most 8 for 4-bit levels)
                // instead of `l` (up to 15).
                scratch.constant[h] = base + centre * (folded_sum - coded_sum);
            }
        }
        let mut pass = ChannelRun {
            ctx,
            scratch: &mut *scratch,
            weights: &mut *weights,
            prefetch: &mut *prefetch,
            rows: t0..t1,
            classes,
        };
        for_head_blocks(ctx.geometry, &mut pass);
    }
    true
}

/// One head block against a run of rows sharing a block of tokens
/// (per-channel groups, scales folded into the codes).
struct ChannelRun<'a, 'k> {
    ctx: Context<'a, 'k>,
    scratch: &'a mut IntScratch,
    weights: &'a mut [f32],
    prefetch: &'a mut Prefetcher,
    rows: std::ops::Range<usize>,
    /// Codes with one scale per channel class (weighted sums).
    classes: bool,
}

impl HeadBlockPass for ChannelRun<'_, '_> {
    #[inline(always)]
    fn run<const H: usize>(&mut self, kvh: usize, h0: usize) {
        let (keys, d) = (self.ctx.keys, self.ctx.geometry.d);
        let (ch, rows, run) = (keys.channels(), keys.rows(), self.rows.len());
        let (t0, rb) = (self.rows.start, keys.row_bytes());
        let block = DotBlock {
            levels: &keys.levels[t0 * rb..self.rows.end * rb],
            packed: keys.packing == LevelPacking::Nibbles,
            ch,
            start: kvh * d,
            len: d,
            codes: &[],
            code_stride: d,
            heads: H,
            rows: run,
            image: None,
            lane_weights: None,
        };
        let weights = self.classes.then_some(h0);
        self.scratch
            .dot_products(self.ctx, block, h0 * d, 0, weights, self.prefetch);
        for j in 0..H {
            let h = h0 + j;
            let (s, k) = (self.scratch.scale[h], self.scratch.constant[h]);
            let w = &mut self.weights[h * rows + t0..][..run];
            match self.ctx.codes {
                QueryCodes::Int8 => finish_run(w, &self.scratch.sums[j * run..][..run], s, k),
                QueryCodes::Int16 => finish_run(w, &self.scratch.dots[j * run..][..run], s, k),
            }
        }
    }
}
