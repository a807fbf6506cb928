//! The float tile kernel: [`attend_tile`](super::attend_tile) reading keys
//! and values as stored: f32 rows, integer and table levels with their
//! group parameters dequantized in registers ([`load`]), and with the
//! vector widths half floats and FP8 codes widened in registers too
//! (`vcvtph2ps`), so an FP16 cache is never copied into an f32 buffer.
//!
//! One body, written over sixteen f32 [`Lanes`]: one AVX-512 register
//! (`attend_tile_avx512`), two AVX2 registers (`attend_tile_avx2`, both in
//! [`x86`]) or a plain array on every CPU ([`attend_tile_portable`], the
//! scalar set). Every lane operation gives the same bits at both vector
//! widths, so the two compute the same bits, and the scalar set (its
//! multiply-adds rounded twice) agrees to rounding:
//! - a score is a 16-lane multiply-add over the head dimension (the tail
//!   with its lanes above the head keeping their sums) folded by the tree
//!   `+8, +4, +2, +1`, many scores at once by shuffles
//!   ([`Lanes::finish_scores`]);
//! - softmax is the shared [`max`](super::max) and
//!   [`exp_sub_sum`](super::exp_sub_sum);
//! - a weighted value sum runs over the rows in order, per channel.
//!
//! Register blocking is the width's ([`Lanes::SCORE_ROWS`],
//! [`Lanes::VALUE_BLOCKS`]): AVX-512's 32 registers (and the array) score
//! four rows per query chunk loaded and keep 64 channels of four heads'
//! value sums; AVX2's sixteen score one row against up to four heads and
//! keep at most four blocks of 16 value channels.
//!
//! Written with intrinsics because LLVM does not find the batched
//! reduction, and its own vectorisation of the value sums across rows uses
//! gathers (six times slower, measured). On an AVX2-only host (Zen 3) FP16
//! decode ran at a quarter of the streaming read before this kernel read
//! half floats in registers. Loops fill the register arrays rather than
//! `std::array::from_fn` or closures: those are compiled without the
//! kernel's target features, and their intrinsics become calls whenever
//! the inliner leaves them out of line (ten times slower on level tiles,
//! seen with `perf`).

pub(super) mod lanes;
pub(super) mod load;
#[cfg(target_arch = "x86_64")]
pub(super) mod x86;

use kv_quant::{LevelMap, LevelRows};

use super::{
    HeadBlockPass, KernelScratch, NextTile, Partial, Prefetcher, TileGeometry, fold_heads,
    for_head_blocks, integer_values, score_steps, softmax_pass, value_steps, widen_rows,
};
use crate::source::TileRows;
#[cfg(target_arch = "x86_64")]
pub(in crate::kernel) use x86::{attend_tile_avx2, attend_tile_avx512};

use lanes::{Lanes, Portable, Stash};
use load::{Floats, Halves, LevelLayout, Load, with_levels};

/// What one tile call works with, besides its keys and values.
#[derive(Clone, Copy)]
pub(in crate::kernel) struct Tile<'a> {
    pub(in crate::kernel) q: &'a [f32],
    pub(in crate::kernel) geometry: TileGeometry,
    pub(in crate::kernel) rows: usize,
    pub(in crate::kernel) upcoming: Option<&'a NextTile>,
    /// The integer dot products of the configured instruction set.
    pub(in crate::kernel) dot: super::Dot,
}

/// [`attend_tile`](super::attend_tile) with [`Portable`] lanes: the
/// scalar set, on every CPU.
pub(in crate::kernel) fn attend_tile_portable(
    tile: Tile<'_>,
    keys: Option<TileRows<'_>>,
    values: TileRows<'_>,
    int_values: Option<LevelRows<'_>>,
    scratch: &mut KernelScratch,
    partial: &mut Partial,
) {
    // SAFETY: `Portable` needs no CPU feature.
    unsafe { attend_tile_lanes::<Portable>(tile, keys, values, int_values, scratch, partial) }
}

/// Scores from the keys (unless `keys` is `None`: the integer path scored
/// them, into `scratch.weights`), softmax, and value sums (the integer
/// value pass's where `int_values` is given and it takes them), dispatching
/// on how each side is stored. Levels in a grouping the loader does not
/// handle are dequantized into the scratch first.
///
/// # Safety
/// Only inlined into a function compiled with the features of `V`; the
/// scratch is sized for `tile.rows` rows of `tile.geometry`.
#[inline(always)]
unsafe fn attend_tile_lanes<V: Lanes>(
    tile: Tile<'_>,
    keys: Option<TileRows<'_>>,
    values: TileRows<'_>,
    int_values: Option<LevelRows<'_>>,
    scratch: &mut KernelScratch,
    partial: &mut Partial,
) {
    let mut wide = std::mem::take(&mut scratch.wide);
    let TileGeometry { group, kv_heads, d } = tile.geometry;
    let (ch, heads, rows) = (kv_heads * d, kv_heads * group, tile.rows);
    // Every load below stays inside these lengths.
    assert!(values.len() == rows * ch && tile.q.len() == heads * d);
    let (kb, vb) = wide.buffers();
    if let Some(keys) = keys {
        assert_eq!(keys.len(), rows * ch);
        // The next tile's keys are requested during the score pass ...
        let steps = score_steps(tile.geometry, rows);
        let mut prefetch = Prefetcher::new(tile.upcoming.map(|n| &n.keys), steps);
        let (w, p) = (&mut scratch.weights[..heads * rows], &mut prefetch);
        match Side::new::<V>(keys, ch, d, kb) {
            Side::F32(k) => score_pass::<V, _>(tile, k, w, p),
            Side::F16(k) => score_pass::<V, _>(tile, k, w, p),
            Side::Levels(k) => with_levels!(k, k => score_pass::<V, _>(tile, k, w, p)),
        }
        prefetch.finish();
    }
    if V::FMA {
        softmax_pass::<true>(tile.geometry, rows, scratch);
    } else {
        softmax_pass::<false>(tile.geometry, rows, scratch);
    }
    // ... and its values during the value pass.
    let steps = value_steps(tile.geometry, rows);
    let mut prefetch = Prefetcher::new(tile.upcoming.map(|n| &n.values), steps);
    let p = &mut prefetch;
    if !integer_values(int_values, tile.geometry, rows, tile.dot, scratch, p) {
        let (acc, w) = (
            &mut scratch.acc[..heads * d],
            &scratch.weights[..heads * rows],
        );
        match Side::new::<V>(values, ch, d, vb) {
            Side::F32(v) => value_pass::<V, _>(tile, v, acc, w, p),
            Side::F16(v) => value_pass::<V, _>(tile, v, acc, w, p),
            Side::Levels(v) => with_levels!(v, v => value_pass::<V, _>(tile, v, acc, w, p)),
        }
    }
    prefetch.finish();
    fold_heads(tile.geometry, scratch, partial);
    scratch.wide = wide;
}

/// One side (keys or values) of a tile, as a loader.
enum Side<'a> {
    F32(Floats<'a>),
    F16(Halves<'a>),
    Levels(LevelLayout<'a>),
}

impl<'a> Side<'a> {
    /// The loader of `rows` (`ch` channels each, heads of `d`); level
    /// layouts [`LevelLayout`] does not read, pair codes, and for lanes
    /// that do not widen in registers half floats and FP8 codes, are
    /// widened into `buffer` first.
    fn new<V: Lanes>(rows: TileRows<'a>, ch: usize, d: usize, buffer: &'a mut Vec<f32>) -> Self {
        let widened = |buffer| Self::F32(Floats(widen_rows(rows, buffer), ch));
        match rows {
            TileRows::F32(v) => Self::F32(Floats(v, ch)),
            TileRows::F16(h) if V::WIDENS_IN_REGISTERS => Self::F16(Halves(h, ch)),
            TileRows::F16(_) => widened(buffer),
            TileRows::Levels(l) if !V::WIDENS_IN_REGISTERS && matches!(l.map, LevelMap::Fp8(_)) => {
                widened(buffer)
            }
            TileRows::Levels(l) => match LevelLayout::new(l, d) {
                Some(levels) => Self::Levels(levels),
                None => widened(buffer),
            },
            TileRows::PairCodes(_) => widened(buffer),
        }
    }
}

/// The scores of every head into `weights` (`heads × rows`).
#[inline(always)]
fn score_pass<V: Lanes, K: Load>(
    tile: Tile<'_>,
    keys: K,
    weights: &mut [f32],
    prefetch: &mut Prefetcher,
) {
    let TileGeometry { kv_heads, d, .. } = tile.geometry;
    assert!(keys.len() == tile.rows * kv_heads * d && keys.ch() == kv_heads * d);
    let mut pass = ScorePass::<V, K> {
        q: tile.q,
        keys,
        weights,
        d,
        rows: tile.rows,
        prefetch,
        lanes: std::marker::PhantomData,
    };
    for_head_blocks(tile.geometry, &mut pass);
}

/// The scores of one head block.
struct ScorePass<'a, V, K> {
    q: &'a [f32],
    keys: K,
    weights: &'a mut [f32],
    d: usize,
    rows: usize,
    /// Stepped every four rows ([`score_steps`]' unit).
    prefetch: &'a mut Prefetcher,
    lanes: std::marker::PhantomData<V>,
}

impl<V: Lanes, K: Load> HeadBlockPass for ScorePass<'_, V, K> {
    /// `w[j·rows + t] = q_j · k_t` for the `H` heads `j` from `h0`: each
    /// query chunk loaded feeds [`Lanes::SCORE_ROWS`] rows, whose
    /// accumulators [`Lanes::finish_scores`] folds into scores.
    #[inline(always)]
    fn run<const H: usize>(&mut self, kvh: usize, h0: usize) {
        let (d, rows) = (self.d, self.rows);
        let q = &self.q[h0 * d..][..H * d];
        let w = &mut self.weights[h0 * rows..][..H * rows];
        let whole = rows / V::SCORE_ROWS * V::SCORE_ROWS;
        let mut stash: Stash<H> = [[[0.0; 8]; 8]; H];
        // The queries' last `d mod 16` channels, zero above, loaded once.
        let (full, tail) = (d / 16 * 16, d % 16);
        // SAFETY: only inlined into the kernel (its width's features);
        // `q` holds `H·d` values.
        let q_tail: [V; H] = unsafe {
            let mut lanes = [V::zero(); H];
            if tail > 0 {
                for (j, lanes) in lanes.iter_mut().enumerate() {
                    *lanes = V::load_partial(q.as_ptr().add(j * d + full), tail);
                }
            }
            lanes
        };
        let b = ScoreBlock {
            q,
            q_tail: &q_tail,
            keys: self.keys,
            offset: kvh * d,
            d,
        };
        let mut t = 0;
        while t < rows {
            if t.is_multiple_of(4) {
                self.prefetch.step();
            }
            // SAFETY: only inlined into the kernel (its width's features);
            // `t + R <= rows`.
            unsafe {
                if t < whole && V::SCORE_ROWS == 4 {
                    let acc = score_lanes::<V, K, H, 4>(b, t);
                    V::finish_scores::<H, 4>(acc, &mut stash, w, rows, t);
                    t += 4;
                } else {
                    let acc = score_lanes::<V, K, H, 1>(b, t);
                    V::finish_scores::<H, 1>(acc, &mut stash, w, rows, t);
                    t += 1;
                }
            }
        }
    }
}

/// Up to four query heads of one KV head against the key rows of a tile.
#[derive(Clone, Copy)]
struct ScoreBlock<'a, V, K, const H: usize> {
    /// `H × d` scaled query values.
    q: &'a [f32],
    /// Each head's last `d mod 16` query values, zero above.
    q_tail: &'a [V; H],
    keys: K,
    /// First channel of the KV head in a key row.
    offset: usize,
    d: usize,
}

/// The 16-lane accumulators of heads `j < H` against rows `t..t + R`.
#[inline(always)]
fn score_lanes<V: Lanes, K: Load, const H: usize, const R: usize>(
    b: ScoreBlock<'_, V, K, H>,
    t: usize,
) -> [[V; R]; H] {
    let ScoreBlock {
        q,
        q_tail,
        keys,
        offset,
        d,
    } = b;
    let full = d / 16 * 16;
    let tail = d - full;
    // SAFETY: only inlined into the kernel (its width's features).
    // `score_pass` checked `keys.len() == rows·ch`; here `t + R <= rows`,
    // every key channel read is below `offset + d <= ch` and every query
    // value below `H·d`.
    unsafe {
        let mut acc = [[V::zero(); R]; H];
        let mut starts = [keys.row(t); R];
        for (r, s) in starts.iter_mut().enumerate().skip(1) {
            *s = keys.row(t + r);
        }
        let mut c = 0;
        while c < full {
            let mut k = [V::zero(); R];
            for (r, k) in k.iter_mut().enumerate() {
                *k = keys.load(starts[r], offset + c);
            }
            for (j, acc) in acc.iter_mut().enumerate() {
                let qv = V::load(q.as_ptr().add(j * d + c));
                for (a, k) in acc.iter_mut().zip(&k) {
                    *a = V::fmadd(qv, *k, *a);
                }
            }
            c += 16;
        }
        if tail > 0 {
            let mut k = [V::zero(); R];
            for (r, k) in k.iter_mut().enumerate() {
                *k = keys.load_partial(starts[r], offset + full, tail);
            }
            for (acc, &qv) in acc.iter_mut().zip(q_tail) {
                for (a, k) in acc.iter_mut().zip(&k) {
                    // Lanes above the tail keep their sums, as in the generic dot product.
                    *a = V::fmadd_low(qv, *k, *a, tail);
                }
            }
        }
        acc
    }
}

/// The weighted value sums of every head into `acc` (`heads × d`) from the
/// softmax weights (`heads × rows`).
#[inline(always)]
fn value_pass<V: Lanes, L: Load>(
    tile: Tile<'_>,
    values: L,
    acc: &mut [f32],
    weights: &[f32],
    prefetch: &mut Prefetcher,
) {
    let TileGeometry { kv_heads, d, .. } = tile.geometry;
    assert!(values.len() == tile.rows * kv_heads * d && values.ch() == kv_heads * d);
    let mut pass = ValuePass::<V, L> {
        acc,
        weights,
        values,
        d,
        rows: tile.rows,
        prefetch,
        lanes: std::marker::PhantomData,
    };
    for_head_blocks(tile.geometry, &mut pass);
}

/// The weighted value sums of one head block.
struct ValuePass<'a, V, L> {
    acc: &'a mut [f32],
    weights: &'a [f32],
    values: L,
    d: usize,
    rows: usize,
    /// Stepped every four rows of the blocks that start a run of 64
    /// channels ([`value_steps`]' unit).
    prefetch: &'a mut Prefetcher,
    lanes: std::marker::PhantomData<V>,
}

impl<V: Lanes, L: Load> HeadBlockPass for ValuePass<'_, V, L> {
    /// `out[j·d + c] = Σ_t w[j·rows + t] · values[t][offset + c]` for `H`
    /// heads, summed in row order per channel: blocks of `16·N` channels
    /// with `H·N` at most [`Lanes::VALUE_BLOCKS`] hold their sums in
    /// registers while the rows stream by; narrower blocks take what is
    /// left, the last one partial where `d` is not a multiple of 16.
    #[inline(always)]
    fn run<const H: usize>(&mut self, kvh: usize, h0: usize) {
        let (d, rows) = (self.d, self.rows);
        let out = &mut self.acc[h0 * d..][..H * d];
        let b = ValueBlock {
            w: &self.weights[h0 * rows..][..H * rows],
            rows,
            values: self.values,
            offset: kvh * d,
            lanes: 16,
        };
        let p = &mut *self.prefetch;
        let mut c = 0;
        if H * 4 <= V::VALUE_BLOCKS {
            while c + 64 <= d {
                store_block::<V, H, 4>(out, d, c, 16, value_block::<V, L, H, 4, true>(b, c, p));
                c += 64;
            }
        }
        if H * 2 <= V::VALUE_BLOCKS {
            while c + 32 <= d {
                store_block::<V, H, 2>(out, d, c, 16, value_block::<V, L, H, 2, true>(b, c, p));
                c += 32;
            }
        }
        while c + 16 <= d {
            store_block::<V, H, 1>(out, d, c, 16, value_block::<V, L, H, 1, true>(b, c, p));
            c += 16;
        }
        if c < d {
            let b = ValueBlock { lanes: d - c, ..b };
            let sums = value_block::<V, L, H, 1, false>(b, c, p);
            store_block::<V, H, 1>(out, d, c, d - c, sums);
        }
    }
}

/// Inputs of one register block of value sums.
#[derive(Clone, Copy)]
struct ValueBlock<'a, L> {
    w: &'a [f32],
    rows: usize,
    values: L,
    /// First channel of the KV head in a row.
    offset: usize,
    /// Lanes read by a partial block (a head's last channels).
    lanes: usize,
}

/// Channels `c..c + 16N` of `H` heads (with `FULL` false, one block of
/// `c..c + lanes`), summed over the rows in order.
#[inline(always)]
fn value_block<V: Lanes, L: Load, const H: usize, const N: usize, const FULL: bool>(
    b: ValueBlock<'_, L>,
    c: usize,
    prefetch: &mut Prefetcher,
) -> [[V; N]; H] {
    // SAFETY: only inlined into the kernel (its width's features);
    // `value_pass` checked `values.len() == rows·ch` with rows `ch` apart,
    // channel `offset + c + 16N` (`+ lanes` for a partial block) is at
    // most `ch`, and `w` holds `H·rows` weights.
    unsafe {
        let mut acc = [[V::zero(); N]; H];
        // Steps at each multiple of 64 channels of the head (`value_steps`).
        let steps = c.is_multiple_of(64);
        for t in 0..b.rows {
            if steps && t % 4 == 0 {
                prefetch.step();
            }
            let row = b.values.row(t);
            let mut v = [V::zero(); N];
            for (k, v) in v.iter_mut().enumerate() {
                let col = b.offset + c + 16 * k;
                *v = if FULL {
                    b.values.load(row, col)
                } else {
                    b.values.load_partial(row, col, b.lanes)
                };
            }
            for (j, acc) in acc.iter_mut().enumerate() {
                let wt = V::splat(*b.w.get_unchecked(j * b.rows + t));
                for (a, v) in acc.iter_mut().zip(&v) {
                    *a = V::fmadd(wt, *v, *a);
                }
            }
        }
        acc
    }
}

/// Writes `lanes` channels of each block to `out[j·d + c + 16k..]`.
#[inline(always)]
fn store_block<V: Lanes, const H: usize, const N: usize>(
    out: &mut [f32],
    d: usize,
    c: usize,
    lanes: usize,
    acc: [[V; N]; H],
) {
    let mut buffer = [0.0f32; 16];
    for (j, a) in acc.iter().enumerate() {
        for (k, a) in a.iter().enumerate() {
            // SAFETY: only inlined into the kernel; `buffer` holds 16 floats.
            unsafe { a.store(buffer.as_mut_ptr()) };
            out[j * d + c + 16 * k..][..lanes].copy_from_slice(&buffer[..lanes]);
        }
    }
}

#[cfg(test)]
mod tests;
