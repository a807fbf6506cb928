//! The inner loop of blockwise online-softmax attention: one query token's
//! heads against one tile of stored K/V rows ([`attend_tile`]), and the
//! exact log-sum-exp merge of partial results ([`Partial`]), section 3.3 of
//! `lowrank-kv-subspace-paper.md` ("blockwise softmax across chunks").
//!
//! Within a tile, scores, their maximum, `exp(s − m)` and the weighted value
//! sum are f32 in 16-lane vectors with a fixed reduction tree, so every
//! vector instruction set gives bit-identical results; the scalar set (no
//! fused multiply-adds) rounds the multiply-adds separately. Tile results
//! are folded into the running state in f64, so long contexts lose nothing
//! to the running sums. [`Isa`] picks every body's instructions.
//!
//! Each algorithm has one body:
//! - float scores and weighted value sums of f32, half-float, level and FP8
//!   tiles: [`fused`] (its loaders dequantize levels in registers,
//!   `fused::load`; the lane widths are `fused::lanes` and `fused::x86`);
//! - integer scores of int8 or int16 query codes against 4- and 8-bit
//!   levels, per-token or per-channel: [`int8_query`];
//! - integer value sums of rounded weights against levels: [`int_values`];
//! - scores of keys coded before RoPE against their pair codebook:
//!   [`pair_scores`];
//! - softmax ([`max`], [`exp_sub_sum`], [`exp`]) and the merge of tiles
//!   ([`Partial`]): here and in [`partial`].
//!
//! Tiles no body reads as stored are widened to f32 rows by kv-quant first
//! ([`widen_rows`]), whose arithmetic the in-register loaders reproduce.

mod fused;
mod int8_query;
mod int_values;
mod pair_scores;
mod partial;
mod prefetch;
mod runs;

pub(crate) use int8_query::Dot;
pub(crate) use partial::Partial;
pub(crate) use prefetch::{NextTile, Prefetcher};
pub(crate) use runs::block_runs;

use crate::isa::Isa;
use crate::numerics::Numerics;
use crate::source::TileRows;
use kv_quant::{LevelMap, LevelRows};

const LANES: usize = 16;

/// Per-thread buffers of [`attend_tile`].
#[derive(Clone, Debug, Default)]
pub(crate) struct KernelScratch {
    /// Scores, then weights: `q_heads × rows`.
    weights: Vec<f32>,
    /// Weighted value sums: `q_heads × d`.
    acc: Vec<f32>,
    /// Per head: maximum score and sum of weights.
    maxima: Vec<f32>,
    sums: Vec<f32>,
    /// f32 copies of tiles the kernel does not read as stored (the generic
    /// kernel's half floats, level layouts the fused loaders do not read).
    wide: WideScratch,
    /// Query codes of the integer score path.
    int: int8_query::IntScratch,
    /// Weight codes and sums of the integer value path.
    int_values: int_values::ValueScratch,
    /// The query's table against a pair codebook.
    pairs: pair_scores::PairScratch,
    /// Key and value levels packed two per byte, unpacked for the paths
    /// that read one level per byte.
    unpacked: [Vec<u8>; 2],
}

impl KernelScratch {
    /// Forgets what was derived from the queries (their integer codes):
    /// call before the queries' buffer is reused for other queries.
    pub(crate) fn forget_queries(&mut self) {
        self.int.forget();
        self.pairs.forget();
    }
}

/// Geometry of one call of [`attend_tile`].
#[derive(Clone, Copy, Debug)]
pub(crate) struct TileGeometry {
    /// Query heads per KV head.
    pub(crate) group: usize,
    /// KV heads.
    pub(crate) kv_heads: usize,
    /// Channels per head.
    pub(crate) d: usize,
}

/// Folds the keys and values of `keys`/`values` (`rows × kv_heads·d`) into
/// `partial` for the query heads `q` (`q_heads × d`, already multiplied by
/// the softmax scale). Integer keys are scored with integer dot products
/// under [`Numerics::Int8Query`] ([`int8_query`]). `isa` (a set this CPU
/// supports: [`Attention::with_config`](crate::Attention::with_config) and
/// [`Attention::set_isa`](crate::Attention::set_isa) check it) picks
/// every kernel: the float passes ([`fused`], one body at every width) read
/// both sides as stored, levels dequantized in registers (and, with
/// AVX-512 or AVX2, half floats and FP8 codes widened there too; the
/// scalar set has kv-quant widen those tiles first).
#[allow(clippy::too_many_arguments)] // one tile's inputs, state and scratch
pub(crate) fn attend_tile(
    q: &[f32],
    keys: TileRows<'_>,
    values: TileRows<'_>,
    geometry: TileGeometry,
    numerics: Numerics,
    isa: Isa,
    upcoming: Option<&NextTile>,
    scratch: &mut KernelScratch,
    partial: &mut Partial,
) {
    let rows = keys.len() / (geometry.kv_heads * geometry.d);
    if rows == 0 {
        return;
    }
    let heads = geometry.kv_heads * geometry.group;
    if scratch.maxima.len() < heads {
        scratch.maxima.resize(heads, 0.0);
        scratch.sums.resize(heads, 0.0);
    }
    if scratch.weights.len() < heads * rows {
        scratch.weights.resize(heads * rows, 0.0);
    }
    if scratch.acc.len() < heads * geometry.d {
        scratch.acc.resize(heads * geometry.d, 0.0);
    }
    // Keys coded before RoPE on pair codebooks are scored against the
    // codebook under every numerics (f32 arithmetic throughout).
    let pair_scored = match keys {
        TileRows::PairCodes(pairs) => {
            let weights = &mut scratch.weights[..heads * rows];
            pair_scores::scores(q, &pairs, geometry, isa, &mut scratch.pairs, weights);
            true
        }
        _ => false,
    };
    let codes = match numerics {
        Numerics::Exact => None,
        Numerics::Auto => match keys {
            TileRows::Levels(levels) if auto_integer_keys(&levels) => {
                Some(int8_query::QueryCodes::Int8)
            }
            _ => None,
        },
        Numerics::Int8Query => Some(int8_query::QueryCodes::Int8),
        Numerics::Int16Query => Some(int8_query::QueryCodes::Int16),
    };
    // Levels packed two per byte are read so by the integer paths where
    // their layout allows; everything else reads them unpacked into the
    // scratch.
    let mut unpacked = std::mem::take(&mut scratch.unpacked);
    let [key_levels, value_levels] = &mut unpacked;
    let steps = score_steps(geometry, rows);
    let mut score = |levels: &LevelRows<'_>, codes| {
        let mut prefetch = Prefetcher::new(upcoming.map(|n| &n.keys), steps);
        let scored = int8_query::scores(
            q,
            levels,
            geometry,
            codes,
            isa.dot(),
            &mut scratch.int,
            &mut scratch.weights[..heads * rows],
            &mut prefetch,
        );
        // Rows past the last whole step (a range ending mid-tile).
        prefetch.finish();
        scored
    };
    let (keys, scored) = match (keys, codes) {
        (keys, _) if pair_scored => (keys, true),
        (TileRows::Levels(levels), Some(codes))
            if int8_query::reads_packed(&levels, geometry, codes) && score(&levels, codes) =>
        {
            (keys, true)
        }
        (TileRows::Levels(levels), codes) => {
            // Packed keys whose layout the integer path cannot read packed
            // are unpacked and offered to it again; a tile it declined as
            // it was (a non-finite query) is scored exactly.
            let retry = codes.filter(|&codes| {
                levels.packing == kv_quant::LevelPacking::Nibbles
                    && !int8_query::reads_packed(&levels, geometry, codes)
            });
            let levels = levels.unpacked(key_levels);
            let scored = retry.is_some_and(|codes| score(&levels, codes));
            (TileRows::Levels(levels), scored)
        }
        (keys, _) => (keys, false),
    };
    // Integer value sums go with int8 query codes (the 16-bit codings keep
    // f32 value sums), and under `Auto` with the layout it takes.
    let integer_value_sums = |levels: &LevelRows<'_>| {
        let wanted = match numerics {
            Numerics::Int8Query => true,
            Numerics::Auto => auto_integer_values(levels),
            Numerics::Exact | Numerics::Int16Query => false,
        };
        wanted && int_values::takes(levels, geometry)
    };
    // Packed values stay packed where the integer pass takes them; the f32
    // pass reads them only if that pass declines (a non-finite weight:
    // then through `LevelRows::dequantize_into`).
    let (values, int_values) = match values {
        TileRows::Levels(levels) if integer_value_sums(&levels) => (values, Some(levels)),
        TileRows::Levels(levels) => {
            let levels = levels.unpacked(value_levels);
            (
                TileRows::Levels(levels),
                integer_value_sums(&levels).then_some(levels),
            )
        }
        values => (values, None),
    };
    // The integer path prefetched the next tile's keys already.
    let keys = (!scored).then_some(keys);
    kernels(
        q, keys, values, int_values, geometry, rows, isa, upcoming, scratch, partial,
    );
    scratch.unpacked = unpacked;
}

/// The float kernels of [`attend_tile`], keys given unless scored already.
#[allow(clippy::too_many_arguments)] // one tile's inputs, state and scratch
fn kernels(
    q: &[f32],
    keys: Option<TileRows<'_>>,
    values: TileRows<'_>,
    int_values: Option<LevelRows<'_>>,
    geometry: TileGeometry,
    rows: usize,
    isa: Isa,
    upcoming: Option<&NextTile>,
    scratch: &mut KernelScratch,
    partial: &mut Partial,
) {
    let tile = fused::Tile {
        q,
        geometry,
        rows,
        upcoming,
        dot: isa.dot(),
    };
    match isa {
        // SAFETY: the configured `isa` is supported (checked by
        // `AttentionConfig`): AVX-512F/BW/VL, AVX2, FMA and F16C; the
        // scratch was sized by `attend_tile`.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 | Isa::Avx512Vnni => unsafe {
            fused::attend_tile_avx512(tile, keys, values, int_values, scratch, partial)
        },
        // SAFETY: as above: AVX2, FMA and F16C.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe {
            fused::attend_tile_avx2(tile, keys, values, int_values, scratch, partial)
        },
        _ => fused::attend_tile_portable(tile, keys, values, int_values, scratch, partial),
    }
}

/// Whether [`Numerics::Auto`] scores keys `levels` with integer dot
/// products: 4-bit affine levels in whole-row per-token groups (`int4` and
/// its protected forms), the layout whose perplexity the integer path was
/// measured to keep within 0.1% of exact scores (attention
/// `docs/measurements.md`, "Perplexity of the two codings"), and 4-bit
/// levels read in place in per-channel groups of 32 to
/// [`AUTO_CHANNEL_BLOCK`] tokens (the paged cache's sealed `int4-ch`
/// blocks and groups), whose scales fold into int8 query codes with one
/// scale per channel class (+0.015% on Qwen2.5-Coder-0.5B, "Per-channel
/// keys coded by channel class"). Groups of 16 fold the query too often to
/// gain: their keys stay exact.
fn auto_integer_keys(levels: &LevelRows<'_>) -> bool {
    let per_channel = levels.channels_per_group() == 1
        && levels.packing == kv_quant::LevelPacking::Nibbles
        && (2 * MIN_CHANNEL_BLOCK..=AUTO_CHANNEL_BLOCK).contains(&levels.tokens_per_group());
    four_bit_affine(levels) && (whole_row_per_token(levels) || per_channel)
}

/// Whether [`Numerics::Auto`] sums values `levels` with integer dot
/// products: the per-token key layout above, and 4-bit affine levels in per-channel
/// groups over blocks of 16 to [`AUTO_CHANNEL_BLOCK`] tokens (the paged
/// cache's sealed `int4-ch` blocks: +0.01% perplexity on SmolLM2-135M,
/// "Per-channel blocks").
fn auto_integer_values(levels: &LevelRows<'_>) -> bool {
    let per_channel = levels.channels_per_group() == 1
        && (MIN_CHANNEL_BLOCK..=AUTO_CHANNEL_BLOCK).contains(&levels.tokens_per_group());
    four_bit_affine(levels) && (whole_row_per_token(levels) || per_channel)
}

/// Levels in whole-row per-token groups (one scale and offset per row).
fn whole_row_per_token(levels: &LevelRows<'_>) -> bool {
    levels.tokens_per_group() == 1 && levels.channels_per_group() == levels.channels()
}

/// 4-bit levels read as `b + l·a`.
fn four_bit_affine(levels: &LevelRows<'_>) -> bool {
    levels.max_level() == 15 && levels.map == LevelMap::Affine
}

/// The longest block of per-channel groups [`Numerics::Auto`] reads with
/// integer dot products (measured at 64; the paged cache's blocks are 16
/// to 64 tokens).
const AUTO_CHANNEL_BLOCK: usize = 128;

/// The shortest block of per-channel value groups [`Numerics::Auto`] sums
/// with integer dot products; keys take twice as many (a fold per 16 rows
/// cost more than the float kernel: paged `int4-ch` in blocks of 16, 16K
/// tokens at 32/8/128, 15.9-17.2 ms with integer keys against 11.8-12.9
/// ms exact).
const MIN_CHANNEL_BLOCK: usize = 16;

/// The value pass of [`int_values`] into `scratch.acc`, where `levels` is
/// given and the pass takes it (stepping `prefetch`); `false` leaves the
/// f32 pass to run.
#[inline(always)]
fn integer_values(
    levels: Option<LevelRows<'_>>,
    geometry: TileGeometry,
    rows: usize,
    dot: Dot,
    scratch: &mut KernelScratch,
    prefetch: &mut Prefetcher,
) -> bool {
    let Some(levels) = levels else {
        return false;
    };
    let (heads, d) = (geometry.kv_heads * geometry.group, geometry.d);
    int_values::weighted_sums(
        &levels,
        geometry,
        &scratch.weights[..heads * rows],
        &mut scratch.acc[..heads * d],
        dot,
        &mut scratch.int_values,
        prefetch,
    )
}

/// The steps a score pass takes: one per four rows of each head block.
pub(super) fn score_steps(geometry: TileGeometry, rows: usize) -> usize {
    geometry.kv_heads * geometry.group.div_ceil(4) * rows.div_ceil(4)
}

/// The steps a value pass takes: one per four rows of each block of up to
/// 64 channels of each head block (the value kernels' unit; the
/// prefetcher spreads the next tile's value lines over them).
pub(super) fn value_steps(geometry: TileGeometry, rows: usize) -> usize {
    geometry.kv_heads * geometry.group.div_ceil(4) * geometry.d.div_ceil(64) * rows.div_ceil(4)
}

/// A pass over one block of up to four query heads sharing a KV head: the
/// unit every pass of a tile works on, with the head count `H` a constant
/// so that the block's accumulators live in registers.
pub(crate) trait HeadBlockPass {
    /// Query heads `h0..h0 + H`, all of KV head `kvh`.
    fn run<const H: usize>(&mut self, kvh: usize, h0: usize);
}

/// Runs `pass` over every block of up to four query heads of each KV head,
/// in head order: the one head-block loop of every kernel.
#[inline(always)]
pub(crate) fn for_head_blocks<P: HeadBlockPass>(geometry: TileGeometry, pass: &mut P) {
    let TileGeometry {
        group, kv_heads, ..
    } = geometry;
    for kvh in 0..kv_heads {
        let mut g = 0;
        while g < group {
            let n = (group - g).min(4);
            let h0 = kvh * group + g;
            match n {
                1 => pass.run::<1>(kvh, h0),
                2 => pass.run::<2>(kvh, h0),
                3 => pass.run::<3>(kvh, h0),
                _ => pass.run::<4>(kvh, h0),
            }
            g += n;
        }
    }
}

/// `rows` as f32: borrowed, or widened/dequantized into `buffer`.
pub(crate) fn widen_rows<'a>(rows: TileRows<'a>, buffer: &'a mut Vec<f32>) -> &'a [f32] {
    match rows {
        TileRows::F32(v) => v,
        TileRows::F16(halves) => {
            buffer.resize(halves.len() / 2, 0.0);
            kv_quant::widen_f16(halves, buffer);
            buffer
        }
        TileRows::Levels(levels) => {
            // Values, not bytes: packed levels hold two per byte.
            buffer.resize(levels.rows() * levels.channels(), 0.0);
            levels.dequantize_into(buffer);
            buffer
        }
        TileRows::PairCodes(pairs) => {
            buffer.resize(pairs.rows() * pairs.channels(), 0.0);
            pairs.widen_into(buffer);
            buffer
        }
    }
}

/// f32 copies of half-float and level tiles, for the kernels that read f32 only.
#[derive(Clone, Debug, Default)]
pub(crate) struct WideScratch {
    keys: Vec<f32>,
    values: Vec<f32>,
}

impl WideScratch {
    /// The key and the value buffers.
    pub(crate) fn buffers(&mut self) -> (&mut Vec<f32>, &mut Vec<f32>) {
        (&mut self.keys, &mut self.values)
    }
}

/// Each head's scores in `scratch.weights` turned into `exp(s − m)`, with
/// the maximum `m` and the sum in `scratch.maxima` and `scratch.sums`.
#[inline(always)]
pub(crate) fn softmax_pass<const FMA: bool>(
    geometry: TileGeometry,
    rows: usize,
    scratch: &mut KernelScratch,
) {
    let heads = geometry.kv_heads * geometry.group;
    let weights = &mut scratch.weights[..heads * rows];
    let (m, l) = (&mut scratch.maxima[..heads], &mut scratch.sums[..heads]);
    softmax_rows::<FMA>(weights, rows, m, l);
}

/// Each head's weighted sum in `scratch.acc`, with its maximum and sum,
/// folded into `partial`.
#[inline(always)]
pub(crate) fn fold_heads(geometry: TileGeometry, scratch: &KernelScratch, partial: &mut Partial) {
    let d = geometry.d;
    let (m, l, acc) = (&scratch.maxima, &scratch.sums, &scratch.acc);
    for h in 0..geometry.kv_heads * geometry.group {
        partial.fold(h, m[h], l[h], &acc[h * d..][..d]);
    }
}

/// Per head (a row of `rows` scores in `weights`): its maximum into `m`,
/// the scores replaced by `exp(s − m)`, and their sum into `l`.
#[inline(always)]
fn softmax_rows<const FMA: bool>(weights: &mut [f32], rows: usize, m: &mut [f32], l: &mut [f32]) {
    for ((w, m), l) in weights
        .chunks_exact_mut(rows)
        .zip(m.iter_mut())
        .zip(l.iter_mut())
    {
        *m = max(w);
        *l = exp_sub_sum::<FMA>(w, *m);
    }
}

#[inline(always)]
fn madd<const FMA: bool>(a: f32, b: f32, c: f32) -> f32 {
    if FMA { a.mul_add(b, c) } else { a * b + c }
}

/// Sums 16 lanes with a fixed tree.
#[inline(always)]
fn reduce(mut lanes: [f32; LANES]) -> f32 {
    let mut width = LANES / 2;
    while width > 0 {
        for i in 0..width {
            lanes[i] += lanes[i + width];
        }
        width /= 2;
    }
    lanes[0]
}

/// Largest element, ignoring NaN (a NaN score still poisons the output
/// through `exp`, which the caller then reports).
#[inline(always)]
fn max(x: &[f32]) -> f32 {
    let (chunks, tail) = x.as_chunks::<LANES>();
    let mut lanes = [f32::NEG_INFINITY; LANES];
    for c in chunks {
        for i in 0..LANES {
            lanes[i] = if c[i] > lanes[i] { c[i] } else { lanes[i] };
        }
    }
    for (i, &v) in tail.iter().enumerate() {
        lanes[i] = if v > lanes[i] { v } else { lanes[i] };
    }
    lanes
        .iter()
        .fold(f32::NEG_INFINITY, |a, &b| if b > a { b } else { a })
}

/// `x ← exp(x − m)`, returning `Σ x`.
#[inline(always)]
fn exp_sub_sum<const FMA: bool>(x: &mut [f32], m: f32) -> f32 {
    let (chunks, tail) = x.as_chunks_mut::<LANES>();
    let mut lanes = [0.0f32; LANES];
    for c in chunks {
        for i in 0..LANES {
            c[i] = exp::<FMA>(c[i] - m);
            lanes[i] += c[i];
        }
    }
    for (i, v) in tail.iter_mut().enumerate() {
        *v = exp::<FMA>(*v - m);
        lanes[i] += *v;
    }
    reduce(lanes)
}

/// `e^x` for `x ≤ 0` (scores minus their maximum), branch-free so it
/// vectorises: `x = n·ln2 + r` with `|r| ≤ ln2/2` (Cody–Waite, two-part
/// ln 2), `e^r` by its degree-7 Taylor polynomial (truncation below
/// 5e-9 relative), and `2^n` built in the exponent bits. Below −87 (where
/// `2^n` would leave the normal range) it returns 0; those weights are
/// under 1e-37 of the maximum's. Written here rather than calling `f32::exp`
/// because libm's scalar call cannot vectorise and cost more than the dot
/// products at 64K tokens.
#[inline(always)]
pub(crate) fn exp<const FMA: bool>(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // ln 2 split so that n·LN2_HI is exact for |n| < 2^10.
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    // Adding 1.5·2^23 rounds to an integer held in the low mantissa bits.
    const SHIFT: f32 = 12_582_912.0;
    const C: [f32; 8] = [
        1.0,
        1.0,
        0.5,
        1.0 / 6.0,
        1.0 / 24.0,
        1.0 / 120.0,
        1.0 / 720.0,
        1.0 / 5040.0,
    ];
    let xc = if x < -87.0 { -87.0 } else { x };
    let shifted = madd::<FMA>(xc, LOG2E, SHIFT);
    let n = shifted - SHIFT;
    let r = madd::<FMA>(-n, LN2_LO, madd::<FMA>(-n, LN2_HI, xc));
    let mut p = C[7];
    for &c in C[..7].iter().rev() {
        p = madd::<FMA>(p, r, c);
    }
    // The low bits of `shifted` hold n + 2^22; 2^n has exponent field n + 127.
    let n_bits = shifted.to_bits().wrapping_sub(SHIFT.to_bits());
    let two_n = f32::from_bits(n_bits.wrapping_add(127) << 23);
    if x < -87.0 { 0.0 } else { p * two_n }
}

#[cfg(test)]
mod tests;

/// Deterministic values in `[-scale, scale)` (xorshift64) for the kernels'
/// unit tests.
#[cfg(test)]
pub(crate) fn test_values(seed: u64, n: usize, scale: f32) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ((x >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) as f32 * scale
        })
        .collect()
}
