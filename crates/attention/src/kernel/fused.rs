//! The AVX-512 tile kernel: [`attend_tile`](super::attend_tile) reading keys
//! and values as stored, f32 or half floats widened in registers
//! (`vcvtph2ps`), so an FP16 cache is never copied into an f32 buffer.
//!
//! Integer tiles arrive as levels with their group parameters and are
//! dequantized in registers too ([`Levels`]). [`avx2`] is the same kernel
//! for hosts without AVX-512, on the same loaders.
//!
//! It computes exactly what [`avx2`] computes, and what it computes itself
//! from the same values widened to f32, bit for bit (the scalar set's
//! body, without fused multiply-adds, agrees to rounding):
//! - a score is a 16-lane multiply-add over the head dimension (the tail
//!   with masked lanes) folded by the tree `+8, +4, +2, +1`; here sixteen
//!   scores are folded at once by shuffles ([`reduce16`]) with the same
//!   additions;
//! - softmax is the shared [`max`](super::max) and
//!   [`exp_sub_sum`](super::exp_sub_sum);
//! - a weighted value sum runs over the rows in order, per channel.
//!
//! Written with intrinsics because LLVM does not find the batched
//! reduction, and its own vectorisation of the value sums across rows uses
//! gathers (six times slower, measured). Loops fill the register arrays
//! rather than `std::array::from_fn`: its closures were left out of line,
//! where the intrinsics are calls (ten times slower on level tiles, seen
//! with `perf`).

pub(super) mod avx2;

use std::arch::x86_64::*;

use kv_quant::{LevelMap, LevelRows};

use super::{
    HeadBlockPass, KernelScratch, LANES, NextTile, Partial, Prefetcher, TileGeometry,
    for_head_blocks, integer_values, score_steps, three_passes, value_steps, widen_rows,
};
use crate::source::TileRows;

/// Values of a tile (`rows × ch`) read 16 lanes at a time as f32.
///
/// # Safety
/// The loads are only called from functions compiled with the features of
/// [`attend_tile_avx512`], with a [`Row`](Self::Row) of a row `< rows` and
/// `col + 16 <= ch` (`col + n <= ch` for partial loads).
trait Load: Copy {
    /// Where a row starts, computed once per row and pass ([`row`](Self::row)).
    type Row: Copy;

    /// Channels per row.
    fn ch(self) -> usize;

    /// Values held.
    fn len(self) -> usize;

    /// The start of `row`.
    fn row(self, row: usize) -> Self::Row;

    /// Channels `col..col + 16` of a row as f32.
    unsafe fn load(self, row: Self::Row, col: usize) -> __m512;

    /// Channels `col..col + n` of a row as f32 (`n < 16`), zero above.
    unsafe fn load_partial(self, row: Self::Row, col: usize, n: usize) -> __m512;
}

/// f32 rows.
#[derive(Clone, Copy)]
struct Floats<'a>(&'a [f32], usize);

impl Load for Floats<'_> {
    type Row = usize;

    fn ch(self) -> usize {
        self.1
    }

    fn len(self) -> usize {
        self.0.len()
    }

    #[inline(always)]
    fn row(self, row: usize) -> usize {
        row * self.1
    }

    #[inline(always)]
    unsafe fn load(self, row: usize, col: usize) -> __m512 {
        debug_assert!(row + col + 16 <= self.0.len());
        // SAFETY: the caller keeps the 16 values inside the slice.
        unsafe { _mm512_loadu_ps(self.0.as_ptr().add(row + col)) }
    }

    #[inline(always)]
    unsafe fn load_partial(self, row: usize, col: usize, n: usize) -> __m512 {
        debug_assert!(row + col + n <= self.0.len() && n < 16);
        // SAFETY: masked lanes are not read; the others are inside the slice.
        unsafe { _mm512_maskz_loadu_ps(mask(n), self.0.as_ptr().add(row + col)) }
    }
}

/// Little-endian IEEE half floats, two bytes per value.
#[derive(Clone, Copy)]
struct Halves<'a>(&'a [u8], usize);

impl Load for Halves<'_> {
    type Row = usize;

    fn ch(self) -> usize {
        self.1
    }

    fn len(self) -> usize {
        self.0.len() / 2
    }

    #[inline(always)]
    fn row(self, row: usize) -> usize {
        row * self.1
    }

    #[inline(always)]
    unsafe fn load(self, row: usize, col: usize) -> __m512 {
        let i = row + col;
        debug_assert!(2 * (i + 16) <= self.0.len());
        // SAFETY: bytes `2i..2i + 32` are inside the slice; x86 is little-endian.
        unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(self.0.as_ptr().add(2 * i).cast())) }
    }

    #[inline(always)]
    unsafe fn load_partial(self, row: usize, col: usize, n: usize) -> __m512 {
        let i = row + col;
        debug_assert!(2 * (i + n) <= self.0.len() && n < 16);
        // SAFETY: masked 16-bit lanes are not read; the others are inside the slice.
        unsafe {
            let h = _mm256_maskz_loadu_epi16(mask(n), self.0.as_ptr().add(2 * i).cast());
            _mm512_cvtph_ps(h)
        }
    }
}

/// Integer levels or FP8 codes with their group parameters
/// ([`LevelRows`]), dequantized in registers as kv-quant does it:
/// `b + level·a` (product, then sum), `(level − mid)·a`, or
/// `value(code)·a` for FP8, the code widened exactly through IEEE half
/// precision ([`fp8_values`]), and `NF4_LEVELS[code]·a` from a register. Only for layouts where 16 consecutive channels of a
/// head share one group (`channels_per_group` a multiple of 16, like
/// SmolLM2's whole-row groups of 192, and of the head dimension where
/// that is not a multiple of 16) or each have their own
/// (`channels_per_group == 1`).
#[derive(Clone, Copy)]
struct Levels<'a> {
    rows: LevelRows<'a>,
    ch: usize,
    /// Channel → group within a row for shared groups; `None` for one
    /// group per channel.
    shared: Option<GroupDivisor>,
    /// How a level becomes a value.
    map: LevelMap,
    /// The step between consecutive rows' first groups where it is
    /// constant, so that row `t` starts at group `t·row_step`, found
    /// without a division: groups per row for per-token groups, 0 when
    /// every row lies in one block of tokens (FP8's per-tensor scale).
    row_step: Option<usize>,
}

impl<'a> Levels<'a> {
    /// `None` for levels packed two per byte and groupings the loader does
    /// not handle: groups of a multiple of 16 channels are read a group per
    /// 16-channel load, which holds for heads of `d` channels only where
    /// `d` is a multiple of 16 or groups hold whole heads; a head starting
    /// inside a group would have its loads straddle two.
    fn new(rows: LevelRows<'a>, d: usize) -> Option<Self> {
        if rows.packing != kv_quant::LevelPacking::Bytes {
            return None;
        }
        let cpg = rows.channels_per_group();
        let shared = match cpg {
            1 => None,
            n if n % 16 == 0 && (d.is_multiple_of(16) || n.is_multiple_of(d)) => {
                Some(GroupDivisor::new(n, rows.channels())?)
            }
            _ => return None,
        };
        let row_step = if rows.tokens_per_group() == 1 {
            Some(rows.channels() / cpg)
        } else {
            let last = rows.rows().saturating_sub(1);
            (rows.group_index(last, 0) == 0).then_some(0)
        };
        Some(Self {
            ch: rows.channels(),
            map: rows.map,
            rows,
            shared,
            row_step,
        })
    }

    /// Dequantizes 16 levels (bytes) of the row whose first group is `g`,
    /// starting at `col`, where bytes at or above `n` are zero.
    #[inline(always)]
    unsafe fn dequantize(self, g: usize, col: usize, bytes: __m128i, n: usize) -> __m512 {
        // SAFETY: the caller has the kernel's features; group `g + col / cpg`
        // (or `g + col + 15` for one group per channel, masked above `n`)
        // exists, as `LevelRows::value` would read it.
        unsafe {
            let (a, b) = if let Some(div) = self.shared {
                let i = g + div.of(col);
                (
                    _mm512_set1_ps(*self.rows.scale.get_unchecked(i)),
                    _mm512_set1_ps(*self.rows.offset.get_unchecked(i)),
                )
            } else {
                let (s, o) = (self.rows.scale.as_ptr(), self.rows.offset.as_ptr());
                (
                    _mm512_maskz_loadu_ps(mask(n), s.add(g + col)),
                    _mm512_maskz_loadu_ps(mask(n), o.add(g + col)),
                )
            };
            // A value, not a closure: a closure here would be compiled
            // without the kernel's features, its intrinsic a call whenever
            // the inliner leaves it out of line (see `reduce16`). The FP8
            // arms do not use it; the widening is pure, so it is not
            // computed for them.
            let levels = _mm512_cvtepu8_epi32(bytes);
            match self.map {
                LevelMap::Affine => _mm512_add_ps(b, _mm512_mul_ps(_mm512_cvtepi32_ps(levels), a)),
                LevelMap::Centered { mid } => {
                    let level = _mm512_cvtepi32_ps(levels);
                    _mm512_mul_ps(_mm512_sub_ps(level, _mm512_set1_ps(mid)), a)
                }
                // The 16 NF4 levels in one register: `vpermps` reads each
                // lane's low 4 bits, the `& 15` of kv-quant's lookup.
                LevelMap::Nf4 => {
                    let table = _mm512_loadu_ps(kv_quant::NF4_LEVELS.as_ptr());
                    _mm512_mul_ps(_mm512_permutexvar_ps(levels, table), a)
                }
                // Lloyd-Max codes the same way, from their codebook.
                LevelMap::Codebook(table) => {
                    let table = _mm512_loadu_ps(table.as_ptr());
                    _mm512_mul_ps(_mm512_permutexvar_ps(levels, table), a)
                }
                LevelMap::Fp8(kv_quant::Fp8Format::E5M2) => {
                    _mm512_mul_ps(fp8_values(kv_quant::Fp8Format::E5M2, bytes), a)
                }
                // `value·a` with value = half·2^8: `half·(2^8·a)` rounds the
                // same exact product once (scaling by 2^8 is exact).
                LevelMap::Fp8(kv_quant::Fp8Format::E4M3) => {
                    let half = fp8_values(kv_quant::Fp8Format::E4M3, bytes);
                    _mm512_mul_ps(half, _mm512_mul_ps(a, _mm512_set1_ps(256.0)))
                }
            }
        }
    }
}

/// The values of 16 FP8 codes (i32 lanes) without a table: for E5M2
/// exactly what [`Fp8Format::decode`](kv_quant::Fp8Format::decode) gives
/// (the code is the top byte of the IEEE half with the same value); for
/// E4M3 that value times 2^-8 (its exponent and mantissa moved into a
/// half's fields: the biases differ by 8, subnormals included), with
/// `S.1111.111` NaN.
#[inline(always)]
unsafe fn fp8_values(format: kv_quant::Fp8Format, codes: __m128i) -> __m512 {
    // SAFETY: only inlined into `attend_tile_avx512` (AVX-512F/BW/VL); no
    // memory is touched. The codes are widened to 16-bit lanes, where the
    // half floats are built (not to 32-bit lanes narrowed back with
    // `vpmovdw`, 9-15% slower for FP8 tiles).
    unsafe {
        let codes = _mm256_cvtepu8_epi16(codes);
        match format {
            kv_quant::Fp8Format::E5M2 => _mm512_cvtph_ps(_mm256_slli_epi16::<8>(codes)),
            kv_quant::Fp8Format::E4M3 => {
                let magnitude = _mm256_and_si256(codes, _mm256_set1_epi16(0x7F));
                let sign = _mm256_slli_epi16::<8>(_mm256_and_si256(codes, _mm256_set1_epi16(0x80)));
                let bits = _mm256_or_si256(_mm256_slli_epi16::<7>(magnitude), sign);
                let value = _mm512_cvtph_ps(bits);
                let nan = _mm256_cmpeq_epi16_mask(magnitude, _mm256_set1_epi16(0x7F));
                _mm512_mask_mov_ps(value, nan, _mm512_set1_ps(f32::NAN))
            }
        }
    }
}

impl Load for Levels<'_> {
    /// The row's first level and its first group.
    type Row = (usize, usize);

    fn ch(self) -> usize {
        self.ch
    }

    fn len(self) -> usize {
        self.rows.levels.len()
    }

    #[inline(always)]
    fn row(self, row: usize) -> (usize, usize) {
        let g = match self.row_step {
            Some(n) => row * n,
            None => self.rows.group_index(row, 0),
        };
        (row * self.ch, g)
    }

    #[inline(always)]
    unsafe fn load(self, (row, g): (usize, usize), col: usize) -> __m512 {
        let i = row + col;
        debug_assert!(i + 16 <= self.rows.levels.len());
        // SAFETY: bytes `i..i + 16` are inside the slice.
        unsafe {
            let bytes = _mm_loadu_si128(self.rows.levels.as_ptr().add(i).cast());
            self.dequantize(g, col, bytes, 16)
        }
    }

    #[inline(always)]
    unsafe fn load_partial(self, (row, g): (usize, usize), col: usize, n: usize) -> __m512 {
        let i = row + col;
        debug_assert!(i + n <= self.rows.levels.len() && n < 16);
        // SAFETY: masked bytes are not read; the others are inside the slice.
        unsafe {
            let bytes = _mm_maskz_loadu_epi8(mask(n), self.rows.levels.as_ptr().add(i).cast());
            self.dequantize(g, col, bytes, n)
        }
    }
}

/// `channel / channels_per_group` without a division instruction: a shift
/// for powers of two, else a multiply by `⌈2^32 / cpg⌉` and a shift, exact
/// for every channel of the row ([`GroupDivisor::new`] checks the bound).
#[derive(Clone, Copy, Debug)]
struct GroupDivisor {
    magic: u64,
    shift: u32,
}

impl GroupDivisor {
    /// The divisor for groups of `cpg` channels in rows of `ch` channels;
    /// `None` if the multiply-shift is not exact up to `ch`.
    fn new(cpg: usize, ch: usize) -> Option<Self> {
        if cpg.is_power_of_two() {
            return Some(Self {
                magic: 1,
                shift: cpg.trailing_zeros(),
            });
        }
        // With m = ⌈2^32 / cpg⌉ = (2^32 + e) / cpg and x = q·cpg + r,
        // x·m / 2^32 = q + r/cpg + x·e / (cpg·2^32), whose floor is q while
        // x·e < 2^32 (as r <= cpg − 1): true for every x < ch if ch·e < 2^32.
        let magic = (1u64 << 32).div_ceil(cpg as u64);
        let excess = magic * cpg as u64 - (1u64 << 32);
        ((ch as u64).checked_mul(excess)? < 1u64 << 32).then_some(Self { magic, shift: 32 })
    }

    #[inline(always)]
    fn of(self, channel: usize) -> usize {
        ((channel as u64 * self.magic) >> self.shift) as usize
    }
}

/// The mask of the lowest `n < 16` lanes (all 16 for `n = 16`).
#[inline(always)]
fn mask(n: usize) -> u16 {
    ((1u32 << n) - 1) as u16
}

/// [`attend_tile`](super::attend_tile) with AVX-512, dispatching on how
/// the keys and the values are stored. Levels in a grouping the loader
/// does not handle are dequantized into the scratch first. With `keys`
/// `None`, the scores are already in `scratch.weights` (the integer path
/// scored them); with `int_values`, the values are summed by the integer
/// value pass where it takes them.
///
/// # Safety
/// The CPU must have AVX-512F/BW/VL and FMA; the scratch must be sized for
/// `tile.rows` rows of `tile.geometry` (as `attend_tile` does).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
pub(super) unsafe fn attend_tile_avx512(
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
    three_passes::<true>(
        tile.geometry,
        rows,
        scratch,
        partial,
        |scratch| {
            if let Some(keys) = keys {
                assert_eq!(keys.len(), rows * ch);
                // The next tile's keys are requested during the score pass.
                let steps = score_steps(tile.geometry, rows);
                let mut prefetch = Prefetcher::new(tile.upcoming.map(|n| &n.keys), steps);
                match Side::new(keys, ch, d, kb) {
                    Side::F32(k) => score_pass(tile, k, scratch, &mut prefetch),
                    Side::F16(k) => score_pass(tile, k, scratch, &mut prefetch),
                    Side::Levels(k) => score_pass(tile, k, scratch, &mut prefetch),
                }
                prefetch.finish();
            }
        },
        |scratch| {
            // ... and its values during the value pass.
            let steps = value_steps(tile.geometry, rows);
            let mut prefetch = Prefetcher::new(tile.upcoming.map(|n| &n.values), steps);
            let p = &mut prefetch;
            if !integer_values(int_values, tile.geometry, rows, tile.dot, scratch, p) {
                match Side::new(values, ch, d, vb) {
                    Side::F32(v) => value_pass(tile, v, scratch, p),
                    Side::F16(v) => value_pass(tile, v, scratch, p),
                    Side::Levels(v) => value_pass(tile, v, scratch, p),
                }
            }
            prefetch.finish();
        },
    );
    scratch.wide = wide;
}

/// One side (keys or values) of a tile, as a loader.
enum Side<'a> {
    F32(Floats<'a>),
    F16(Halves<'a>),
    Levels(Levels<'a>),
}

impl<'a> Side<'a> {
    /// The loader of `rows` (`ch` channels each, heads of `d`); level
    /// layouts [`Levels`] does not read are widened into `buffer` first.
    fn new(rows: TileRows<'a>, ch: usize, d: usize, buffer: &'a mut Vec<f32>) -> Self {
        match rows {
            TileRows::F32(v) => Self::F32(Floats(v, ch)),
            TileRows::F16(h) => Self::F16(Halves(h, ch)),
            TileRows::Levels(l) => match Levels::new(l, d) {
                Some(levels) => Self::Levels(levels),
                None => Self::F32(Floats(widen_rows(rows, buffer), ch)),
            },
            TileRows::PairCodes(_) => Self::F32(Floats(widen_rows(rows, buffer), ch)),
        }
    }
}

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

/// The scores of every head into `scratch.weights` (`heads × rows`).
#[inline(always)]
fn score_pass<K: Load>(
    tile: Tile<'_>,
    keys: K,
    scratch: &mut KernelScratch,
    prefetch: &mut Prefetcher,
) {
    let Tile {
        q, geometry, rows, ..
    } = tile;
    let TileGeometry { group, kv_heads, d } = geometry;
    let heads = kv_heads * group;
    assert!(keys.len() == rows * kv_heads * d && keys.ch() == kv_heads * d);
    let mut pass = ScorePass {
        q,
        keys,
        weights: &mut scratch.weights[..heads * rows],
        d,
        rows,
        prefetch,
    };
    for_head_blocks(geometry, &mut pass);
}

/// The scores of one head block.
struct ScorePass<'a, K> {
    q: &'a [f32],
    keys: K,
    weights: &'a mut [f32],
    d: usize,
    rows: usize,
    prefetch: &'a mut Prefetcher,
}

impl<K: Load> HeadBlockPass for ScorePass<'_, K> {
    #[inline(always)]
    fn run<const H: usize>(&mut self, kvh: usize, h0: usize) {
        let (d, rows) = (self.d, self.rows);
        let block = ScoreBlock {
            q: &self.q[h0 * d..][..H * d],
            keys: self.keys,
            offset: kvh * d,
            d,
            rows,
        };
        scores::<K, H>(
            block,
            &mut self.weights[h0 * rows..][..H * rows],
            self.prefetch,
        );
    }
}

/// The weighted value sums of every head into `scratch.acc` (`heads × d`)
/// from the weights in `scratch.weights`.
#[inline(always)]
fn value_pass<V: Load>(
    tile: Tile<'_>,
    values: V,
    scratch: &mut KernelScratch,
    prefetch: &mut Prefetcher,
) {
    let TileGeometry { group, kv_heads, d } = tile.geometry;
    let (heads, rows) = (kv_heads * group, tile.rows);
    assert!(values.len() == rows * kv_heads * d && values.ch() == kv_heads * d);
    let mut pass = ValuePass {
        acc: &mut scratch.acc[..heads * d],
        weights: &scratch.weights[..heads * rows],
        values,
        d,
        rows,
        prefetch,
    };
    for_head_blocks(tile.geometry, &mut pass);
}

/// The weighted value sums of one head block.
struct ValuePass<'a, V> {
    acc: &'a mut [f32],
    weights: &'a [f32],
    values: V,
    d: usize,
    rows: usize,
    prefetch: &'a mut Prefetcher,
}

impl<V: Load> HeadBlockPass for ValuePass<'_, V> {
    #[inline(always)]
    fn run<const H: usize>(&mut self, kvh: usize, h0: usize) {
        let (d, rows) = (self.d, self.rows);
        let out = &mut self.acc[h0 * d..][..H * d];
        let w = &self.weights[h0 * rows..][..H * rows];
        weighted_sum::<V, H>(out, w, self.values, kvh * d, self.prefetch);
    }
}

/// Up to four query heads of one KV head against the key rows of a tile.
#[derive(Clone, Copy)]
struct ScoreBlock<'a, K> {
    /// `heads × d` scaled query values.
    q: &'a [f32],
    keys: K,
    /// First channel of the KV head in a key row.
    offset: usize,
    d: usize,
    rows: usize,
}

/// Scores of `H` heads against every row: `w[j·rows + t] = q_j · k_t`.
/// Four rows at a time share each key chunk loaded; the `4H` lane
/// accumulators are then folded together.
#[inline(always)]
fn scores<K: Load, const H: usize>(b: ScoreBlock<'_, K>, w: &mut [f32], prefetch: &mut Prefetcher) {
    let quads = b.rows / 4 * 4;
    for t in (0..quads).step_by(4) {
        prefetch.step();
        let acc = score_lanes::<K, H, 4>(b, t);
        write_scores::<H, 4>(acc, w, b.rows, t);
    }
    for t in quads..b.rows {
        prefetch.step();
        let acc = score_lanes::<K, H, 1>(b, t);
        write_scores::<H, 1>(acc, w, b.rows, t);
    }
}

/// The 16-lane accumulators of heads `j < H` and rows `t..t + R`.
#[inline(always)]
fn score_lanes<K: Load, const H: usize, const R: usize>(
    b: ScoreBlock<'_, K>,
    t: usize,
) -> [[__m512; R]; H] {
    let full = b.d / LANES * LANES;
    let tail = b.d - full;
    // SAFETY: only inlined into `attend_tile_avx512` (AVX-512F/BW/VL, FMA).
    // `score_pass` checked `keys.len() == rows·ch` and `attend_tile_avx512` `q.len() == heads·d`;
    // here `t + R <= rows`, every key channel read is below
    // `offset + d <= ch` and every query value below `H·d`.
    unsafe {
        let mut acc = [[_mm512_setzero_ps(); R]; H];
        let mut starts = [b.keys.row(t); R];
        for (r, s) in starts.iter_mut().enumerate().skip(1) {
            *s = b.keys.row(t + r);
        }
        let mut c = 0;
        while c < full {
            let mut k = [_mm512_setzero_ps(); R];
            for (r, k) in k.iter_mut().enumerate() {
                *k = b.keys.load(starts[r], b.offset + c);
            }
            for (j, acc) in acc.iter_mut().enumerate() {
                let qv = _mm512_loadu_ps(b.q.as_ptr().add(j * b.d + c));
                for (a, k) in acc.iter_mut().zip(&k) {
                    *a = _mm512_fmadd_ps(qv, *k, *a);
                }
            }
            c += LANES;
        }
        if tail > 0 {
            let mut k = [_mm512_setzero_ps(); R];
            for (r, k) in k.iter_mut().enumerate() {
                *k = b.keys.load_partial(starts[r], b.offset + full, tail);
            }
            for (j, acc) in acc.iter_mut().enumerate() {
                let qv = _mm512_maskz_loadu_ps(mask(tail), b.q.as_ptr().add(j * b.d + full));
                for (a, k) in acc.iter_mut().zip(&k) {
                    // Lanes above the tail keep their sums, as in the generic dot product.
                    *a = _mm512_mask3_fmadd_ps(qv, *k, *a, mask(tail));
                }
            }
        }
        acc
    }
}

/// Folds the accumulators and stores head `j`, row `r` at `w[j·rows + t + r]`.
#[inline(always)]
fn write_scores<const H: usize, const R: usize>(
    acc: [[__m512; R]; H],
    w: &mut [f32],
    rows: usize,
    t: usize,
) {
    let mut sums = [0.0f32; 16];
    // SAFETY: only inlined into `attend_tile_avx512` (AVX-512F); `sums`
    // holds the 16 floats stored.
    unsafe {
        let mut lanes = [_mm512_setzero_ps(); 16];
        for (j, a) in acc.iter().enumerate() {
            lanes[j * R..][..R].copy_from_slice(a);
        }
        _mm512_storeu_ps(sums.as_mut_ptr(), reduce16(lanes));
    }
    for j in 0..H {
        w[j * rows + t..][..R].copy_from_slice(&sums[j * R..][..R]);
    }
}

/// Lane `i` of the result is the sum of the 16 lanes of `v[i]`, added as
/// the parent module's `reduce` adds them: lane `k` gets `k + 8`, then
/// `k + 4`, `k + 2` and `k + 1`. Pairs of vectors are folded together by
/// shuffles so that each addition serves two, four, eight, then all sixteen
/// sums. Loops, not closures: a closure here is compiled without the
/// kernel's target features, so its intrinsics become calls whenever the
/// inliner leaves it out of line (the integer kernel's twin did that).
#[inline(always)]
fn reduce16(v: [__m512; 16]) -> __m512 {
    // SAFETY: only inlined into `attend_tile_avx512` (AVX-512F); no memory is touched.
    unsafe {
        // Level 1: [a0 a1 b0 b1] + [a2 a3 b2 b3] in 128-bit blocks: lanes
        // 0..8 hold v[2p]'s `k + (k + 8)`, lanes 8..16 v[2p + 1]'s.
        let mut w = [_mm512_setzero_ps(); 8];
        for (p, w) in w.iter_mut().enumerate() {
            let (a, b) = (v[2 * p], v[2 * p + 1]);
            *w = _mm512_add_ps(
                _mm512_shuffle_f32x4::<0x44>(a, b),
                _mm512_shuffle_f32x4::<0xEE>(a, b),
            );
        }
        // Level 2: [a0 a2 b0 b2] + [a1 a3 b1 b3]: block k holds vector
        // 4p + k's `k + (k + 4)` of its eight.
        let mut x = [_mm512_setzero_ps(); 4];
        for (p, x) in x.iter_mut().enumerate() {
            let (a, b) = (w[2 * p], w[2 * p + 1]);
            *x = _mm512_add_ps(
                _mm512_shuffle_f32x4::<0x88>(a, b),
                _mm512_shuffle_f32x4::<0xDD>(a, b),
            );
        }
        // Level 3, within 128-bit blocks: [a0 a1 b0 b1] + [a2 a3 b2 b3];
        // block k holds vectors 8p + k and 8p + 4 + k, two lanes each.
        let mut y = [_mm512_setzero_ps(); 2];
        for (p, y) in y.iter_mut().enumerate() {
            let (a, b) = (x[2 * p], x[2 * p + 1]);
            *y = _mm512_add_ps(
                _mm512_shuffle_ps::<0x44>(a, b),
                _mm512_shuffle_ps::<0xEE>(a, b),
            );
        }
        // Level 4: [a0 a2 b0 b2] + [a1 a3 b1 b3]; block k holds the sums of
        // vectors k, 4 + k, 8 + k, 12 + k, so lane 4k + m is v[4m + k]'s.
        let z = _mm512_add_ps(
            _mm512_shuffle_ps::<0x88>(y[0], y[1]),
            _mm512_shuffle_ps::<0xDD>(y[0], y[1]),
        );
        let order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
        _mm512_permutexvar_ps(order, z)
    }
}

/// `out[j·d + c] = Σ_t w[j·rows + t] · values[t][offset + c]` for `H`
/// heads, summed in row order per channel, as the parent module's
/// `weighted_sum`: blocks of 64, 32 and 16 channels hold their `H` sums in
/// registers while the rows stream by; the last `d mod 16` channels use
/// masked lanes.
#[inline(always)]
fn weighted_sum<V: Load, const H: usize>(
    out: &mut [f32],
    w: &[f32],
    values: V,
    offset: usize,
    prefetch: &mut Prefetcher,
) {
    let d = out.len() / H;
    let rows = w.len() / H;
    let b = ValueBlock {
        w,
        rows,
        values,
        offset,
        tail: 0,
    };
    let mut c = 0;
    while c + 64 <= d {
        store_block::<H, 4>(out, d, c, 16, value_block::<V, H, 4, 16>(b, c, prefetch));
        c += 64;
    }
    if c + 32 <= d {
        store_block::<H, 2>(out, d, c, 16, value_block::<V, H, 2, 16>(b, c, prefetch));
        c += 32;
    }
    if c + 16 <= d {
        store_block::<H, 1>(out, d, c, 16, value_block::<V, H, 1, 16>(b, c, prefetch));
        c += 16;
    }
    let n = d - c;
    if n > 0 {
        // A rare shape (head dims are multiples of 16 in practice): the
        // lane count is a run-time value here.
        store_block::<H, 1>(
            out,
            d,
            c,
            n,
            value_block::<V, H, 1, 0>(b.with_tail(n), c, prefetch),
        );
    }
}

/// Inputs of one register block of value sums.
#[derive(Clone, Copy)]
struct ValueBlock<'a, V> {
    w: &'a [f32],
    rows: usize,
    values: V,
    offset: usize,
    /// Lanes of a partial block (`value_block` with `FULL = 0`).
    tail: usize,
}

impl<V> ValueBlock<'_, V> {
    fn with_tail(self, tail: usize) -> Self {
        Self { tail, ..self }
    }
}

/// Channels `c..c + 16N` of `H` heads; with `FULL = 0`, one block of `tail` channels.
#[inline(always)]
fn value_block<V: Load, const H: usize, const N: usize, const FULL: usize>(
    b: ValueBlock<'_, V>,
    c: usize,
    prefetch: &mut Prefetcher,
) -> [[__m512; N]; H] {
    // SAFETY: only inlined into `attend_tile_avx512` (AVX-512F, FMA);
    // `value_pass` checked `values.len() == rows·ch`, channel `offset + c + 16N`
    // (`+ tail` for a partial block) is at most `ch`, and `w` holds `H·rows`
    // weights.
    unsafe {
        let mut acc = [[_mm512_setzero_ps(); N]; H];
        // Steps at each multiple of 64 channels of the head (`value_steps`).
        let steps = c.is_multiple_of(64);
        for t in 0..b.rows {
            if steps && t % 4 == 0 {
                prefetch.step();
            }
            let row = b.values.row(t);
            let mut v = [_mm512_setzero_ps(); N];
            for (k, v) in v.iter_mut().enumerate() {
                *v = if FULL == 16 {
                    b.values.load(row, b.offset + c + 16 * k)
                } else {
                    b.values.load_partial(row, b.offset + c + 16 * k, b.tail)
                };
            }
            for (j, acc) in acc.iter_mut().enumerate() {
                let wt = _mm512_set1_ps(*b.w.get_unchecked(j * b.rows + t));
                for (a, v) in acc.iter_mut().zip(&v) {
                    *a = _mm512_fmadd_ps(wt, *v, *a);
                }
            }
        }
        acc
    }
}

/// Writes `lanes` channels of each block to `out[j·d + c..]`.
#[inline(always)]
fn store_block<const H: usize, const N: usize>(
    out: &mut [f32],
    d: usize,
    c: usize,
    lanes: usize,
    acc: [[__m512; N]; H],
) {
    let mut buffer = [0.0f32; 16];
    for (j, a) in acc.iter().enumerate() {
        for (k, a) in a.iter().enumerate() {
            // SAFETY: only inlined into `attend_tile_avx512`; `buffer` holds 16 floats.
            unsafe { _mm512_storeu_ps(buffer.as_mut_ptr(), *a) };
            out[j * d + c + 16 * k..][..lanes].copy_from_slice(&buffer[..lanes]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::GroupDivisor;

    /// `fp8_values` of 16 codes, compiled with the kernel's features.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
    fn fp8_lanes(format: kv_quant::Fp8Format, codes: [i32; 16]) -> [f32; 16] {
        use std::arch::x86_64::*;
        let mut out = [0.0f32; 16];
        let bytes = codes.map(|c| c as u8);
        // SAFETY: the caller checked the features; `bytes` and `out` hold 16 lanes.
        unsafe {
            let v = super::fp8_values(format, _mm_loadu_si128(bytes.as_ptr().cast()));
            _mm512_storeu_ps(out.as_mut_ptr(), v);
        }
        out
    }

    #[test]
    fn fp8_codes_widen_to_their_values_exactly() {
        if !crate::Isa::Avx512.is_supported() {
            test_support::skip(
                test_support::Requirement::Isa,
                "attention",
                "fp8_codes_widen_to_their_values_exactly",
                "no AVX-512 F/BW/VL: the in-register FP8 widening is not used here",
            );
            return;
        }
        use kv_quant::Fp8Format;
        for (format, scale) in [(Fp8Format::E5M2, 1.0f32), (Fp8Format::E4M3, 256.0)] {
            for base in (0..256).step_by(16) {
                let codes: [i32; 16] = std::array::from_fn(|i| base + i as i32);
                // SAFETY: AVX-512 F/BW/VL and FMA were detected above.
                let got = unsafe { fp8_lanes(format, codes) };
                for (&code, &v) in codes.iter().zip(&got) {
                    let want = format.decode(code as u8);
                    let v = v * scale;
                    assert!(
                        v.to_bits() == want.to_bits() || (v.is_nan() && want.is_nan()),
                        "{format:?} code {code:#04x}: {v} vs {want}"
                    );
                }
            }
        }
    }

    #[test]
    fn group_divisors_divide_every_channel_of_a_row_exactly() {
        for cpg in (16..=4096).step_by(16) {
            for ch in [cpg, 3 * cpg, 40 * cpg] {
                let div = GroupDivisor::new(cpg, ch).expect("rows of realistic width");
                for x in 0..ch {
                    assert_eq!(div.of(x), x / cpg, "{x} / {cpg} in rows of {ch}");
                }
            }
        }
        // Refused where the multiply-shift could be off (ch · e >= 2^32).
        assert!(GroupDivisor::new(48, 1 << 31).is_none());
    }
}
