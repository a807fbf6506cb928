//! Integer value sums for per-channel groups over blocks of tokens (KIVI's
//! values, `int4-ch<B>` blocks of the paged cache): one scale `a_c` and
//! offset `b_c` per channel and block, so a head's weighted sum splits by
//! run of rows sharing a block,
//! `Σ_runs [a_c·Σ_{t∈run} w_t·l_tc + b_c·Σ_{t∈run} w_t]`.
//!
//! The weights themselves are the integer part: each head's weights are
//! coded once per tile to 16 bits, `ŵ_t = round(w_t / S)` with
//! `S = max_t w_t / Q` (as [`code_weights`](super::code_weights) codes
//! products, with unit scales), and per run the sums `Σ_t ŵ_t·l_tc` are
//! the same exact i32 sums the per-token pass takes (`vpdpwssd`,
//! `vpmaddwd` or the portable loop: the same integers). The finishing
//! `a_c·(S·Σ) + b_c·W_run` (centred levels: `a_c·(S·Σ − mid·W_run)`) is
//! f32 lane loops in the same order on every instruction set, so every
//! path gives the same bits; it runs once per run, head and channel,
//! which is why it is not f64.
//!
//! The bound: each code is off by at most `S/2`, so channel `c`'s sum
//! moves by at most `(S/2)·Σ_t |a_tc|·l_tc` (with the block's `a_tc`),
//! plus the f32 finishing's rounding.

use kv_quant::{LevelMap, LevelPacking, LevelRows};

use super::super::int8_query::Dot;
use super::super::{HeadBlockPass, Prefetcher, TileGeometry, for_head_blocks};
use super::{CODE_MAX, CODE_MIN, LANES, SumBlock, ValueScratch, code_weights, integer_sums};

/// Fewest tokens per block worth coding this way: shorter blocks leave
/// too few rows per run for the integer sums to pay for their finishing.
const MIN_TOKENS: usize = 16;

/// Whether `levels` are per-channel integer groups over blocks of at
/// least [`MIN_TOKENS`] tokens that this pass takes: affine or centred
/// levels, head dimensions a multiple of 16 (of 32 when packed two per
/// byte), whole heads in the rows.
pub(super) fn takes(levels: &LevelRows<'_>, geometry: TileGeometry) -> bool {
    let packed = levels.packing == LevelPacking::Nibbles;
    levels.channels_per_group() == 1
        && levels.tokens_per_group() >= MIN_TOKENS
        && geometry.d.is_multiple_of(if packed { 32 } else { 16 })
        && levels.channels() == geometry.kv_heads * geometry.d
        && matches!(levels.map, LevelMap::Affine | LevelMap::Centered { .. })
}

/// [`super::weighted_sums`] for the layouts [`takes`] accepts (checked by
/// the caller, with the buffer lengths): `false` for non-finite weights,
/// scales or offsets, leaving the f32 pass to run.
#[inline(always)]
pub(super) fn weighted_sums(
    levels: &LevelRows<'_>,
    geometry: TileGeometry,
    weights: &[f32],
    acc: &mut [f32],
    dot: Dot,
    scratch: &mut ValueScratch,
    prefetch: &mut Prefetcher,
) -> bool {
    let rows = levels.rows();
    let heads = geometry.kv_heads * geometry.group;
    let max_level = levels.max_level().max(1);
    let per_code = rows.next_multiple_of(2) as i64 * i64::from(max_level);
    let code_max = CODE_MAX.min(i64::from(i32::MAX) / per_code);
    if code_max < CODE_MIN {
        return false;
    }
    // The runs: rows sharing a block of tokens, found once per tile.
    let s = &mut *scratch;
    s.runs.clear();
    s.runs.extend(super::super::block_runs(levels));
    let ch = levels.channels();
    // A fold without early exit, so that it vectorises (`all` did not).
    let non_finite = |x: &[f32]| x.iter().fold(false, |bad, v| bad | !v.is_finite());
    let params_bad = s.runs.iter().fold(false, |bad, &(_, _, base)| {
        bad | non_finite(&levels.scale[base..base + ch])
            | non_finite(&levels.offset[base..base + ch])
    });
    if params_bad {
        return false;
    }
    // Each head's weights padded with zeros to whole lanes and one row
    // more (an odd last run reads the code after it, against zero levels),
    // with unit scales and zero offsets for the coding.
    let stride = (rows + 1).next_multiple_of(LANES);
    s.w.resize(heads * stride, 0.0);
    for (padded, w) in s.w.chunks_exact_mut(stride).zip(weights.chunks_exact(rows)) {
        padded[..rows].copy_from_slice(w);
        padded[rows..].fill(0.0);
    }
    s.seg_a.clear();
    s.seg_a.resize(stride, 1.0);
    s.seg_b.clear();
    s.seg_b.resize(stride, 0.0);
    let mut pass = Runs {
        levels,
        acc,
        dot,
        code_max: code_max as f32,
        d: geometry.d,
        stride,
        scratch: s,
        prefetch,
        ok: true,
    };
    for_head_blocks(geometry, &mut pass);
    pass.ok
}

/// `Σ w` over 16 fixed lanes, then the lanes in order: the same sum on
/// every instruction set.
#[inline(always)]
fn lane_total(w: &[f32]) -> f32 {
    let mut lanes = [0.0f32; LANES];
    let (whole, rest) = w.as_chunks::<LANES>();
    for chunk in whole {
        for i in 0..LANES {
            lanes[i] += chunk[i];
        }
    }
    for (l, &x) in lanes.iter_mut().zip(rest) {
        *l += x;
    }
    lanes.iter().sum()
}

/// The runs of each head block.
struct Runs<'a, 'k> {
    levels: &'a LevelRows<'k>,
    acc: &'a mut [f32],
    dot: Dot,
    code_max: f32,
    d: usize,
    stride: usize,
    scratch: &'a mut ValueScratch,
    /// Stepped by the integer sums ([`integer_sums`]).
    prefetch: &'a mut Prefetcher,
    /// Cleared by a non-finite weight.
    ok: bool,
}

impl HeadBlockPass for Runs<'_, '_> {
    #[inline(always)]
    fn run<const H: usize>(&mut self, kvh: usize, h0: usize) {
        if !self.ok {
            return;
        }
        let (levels, d, stride) = (self.levels, self.d, self.stride);
        let ch = levels.channels();
        let rb = levels.row_bytes();
        let mid = match levels.map {
            LevelMap::Centered { mid } => Some(mid),
            _ => None,
        };
        let s = &mut *self.scratch;
        s.codes.resize(H * stride, 0);
        s.scale.resize(H, 0.0);
        s.wide.clear();
        s.wide.resize(H * d, 0.0);
        for j in 0..H {
            let w = &s.w[(h0 + j) * stride..][..stride];
            let code = &mut s.codes[j * stride..][..stride];
            let Some((scale, _)) =
                code_weights(w, &s.seg_a, &s.seg_b, self.code_max, self.dot, code)
            else {
                self.ok = false;
                return;
            };
            s.scale[j] = scale;
        }
        s.sums.resize(H * d, 0);
        for r in 0..s.runs.len() {
            let (t0, t1, base) = s.runs[r];
            let run = t1 - t0;
            let block = SumBlock {
                levels: &levels.levels[t0 * rb..t1 * rb],
                packed: levels.packing == LevelPacking::Nibbles,
                ch,
                start: kvh * d,
                in_head: 0,
                len: d,
                rows: run,
                codes: &s.codes[t0..H * stride],
                stride,
                image: None,
            };
            integer_sums::<H>(self.dot, block, &mut s.sums[..H * d], self.prefetch);
            let (a, b) = (
                &levels.scale[base + kvh * d..][..d],
                &levels.offset[base + kvh * d..][..d],
            );
            for j in 0..H {
                let w = &s.w[(h0 + j) * stride + t0..][..run];
                let total = lane_total(w);
                let scale = s.scale[j] as f32;
                let sums = &s.sums[j * d..][..d];
                let out = &mut s.wide[j * d..][..d];
                // Lane loops the compiler vectorises, the same operations
                // in the same order on every instruction set.
                match mid {
                    None => {
                        for (((o, &sum), &a), &b) in out.iter_mut().zip(sums).zip(a).zip(b) {
                            *o += a * (scale * sum as f32) + b * total;
                        }
                    }
                    Some(mid) => {
                        for ((o, &sum), &a) in out.iter_mut().zip(sums).zip(a) {
                            *o += a * (scale * sum as f32 - mid * total);
                        }
                    }
                }
            }
        }
        for j in 0..H {
            self.acc[(h0 + j) * d..][..d].copy_from_slice(&s.wide[j * d..][..d]);
        }
    }
}
