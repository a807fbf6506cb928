//! One group per channel (per-channel groups over blocks of tokens): for
//! each run of rows sharing a block, the block's scales folded into the
//! query before it is quantized, the levels scored centred on
//! `2^(bits−1)` (see the parent module).

use super::fold::{FoldedHead, HEADS_TOGETHER, fold, fold_heads};
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
    folded.resize(HEADS_TOGETHER * ctx.geometry.d, 0.0);
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
    let (q, keys) = (ctx.q, ctx.keys);
    let TileGeometry { group, kv_heads, d } = ctx.geometry;
    let ch = kv_heads * d;
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
        // Runs shorter than their group may share its codes with the next.
        let recurs = t1 - t0 < keys.tokens_per_group();
        if !scratch.reuse(q, [scale, offset], classes, recurs) {
            for kvh in 0..kv_heads {
                let (a, b) = (&scale[kvh * d..][..d], &offset[kvh * d..][..d]);
                let mut h0 = kvh * group;
                while h0 < (kvh + 1) * group {
                    let n = HEADS_TOGETHER.min((kvh + 1) * group - h0);
                    let heads = h0..h0 + n;
                    // The class codes of `n` heads at once, or none.
                    let folded_heads = if classes {
                        let Some(f) = fold_heads(
                            &q[heads.start * d..heads.end * d],
                            a,
                            b,
                            folded,
                            &mut scratch.codes[heads.start * d..heads.end * d],
                            ctx.dot,
                        ) else {
                            scratch.coded_for = None;
                            return false;
                        };
                        Some(f)
                    } else {
                        None
                    };
                    for h in heads {
                        let head = folded_heads.map(|f| f[h - h0]);
                        if !code_head(ctx, scratch, folded, h, (a, b), head) {
                            scratch.coded_for = None;
                            return false;
                        }
                    }
                    h0 += n;
                }
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

/// Codes query head `h` for a run: its class codes `head` (already in
/// `scratch.codes`) or, without classes, its fold with `a` and `b`
/// quantized on one scale; then its split planes, scale and constant.
/// `false` when its fold is not finite.
#[inline(always)]
fn code_head(
    ctx: Context<'_, '_>,
    scratch: &mut IntScratch,
    folded: &mut [f32],
    h: usize,
    (a, b): (&[f32], &[f32]),
    head: Option<FoldedHead>,
) -> bool {
    let d = ctx.geometry.d;
    let q = &ctx.q[h * d..][..d];
    let (hi, lo) = (
        &mut scratch.codes[h * d..][..d],
        &mut scratch.codes_lo[h * d..][..d],
    );
    // `Σ_c s_c·code_c`, the codes' own image of `Σ q'`.
    let (folded_sum, offset_sum, coded_sum) = if let Some(head) = head {
        scratch.class_weights[h] = head.weights;
        scratch.scale[h] = head.unit;
        let coded_sum = head.unit * head.code_sum as f32;
        (head.folded_sum, head.offset_sum, coded_sum)
    } else {
        let (folded_sum, offset_sum) = fold(q, a, b, &mut folded[..d]);
        let Some(s) = quantize(&folded[..d], ctx.codes, hi, lo) else {
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
    let base = match ctx.mid {
        None => offset_sum,
        Some(mid) => -mid * folded_sum,
    };
    // The middle of the levels' range, `2^(bits−1)` (a centred map's own
    // middle level).
    let centre = ctx
        .mid
        .unwrap_or((f32::from(ctx.keys.max_level()) + 1.0) / 2.0);
    // Scored against levels centred on `centre`: the integer sum `Σ q̂·l`
    // less `centre·Σ q̂` (exact) is `Σ q̂·(l − centre)`, and `centre·Σ q'`
    // puts back exactly what the centring took away, so the codes'
    // rounding errors meet `l − centre` (at most 8 for 4-bit levels)
    // instead of `l` (up to 15).
    scratch.constant[h] = base + centre * (folded_sum - coded_sum);
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
