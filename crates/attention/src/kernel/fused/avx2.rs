//! The AVX2 tile kernel: [`attend_tile`](crate::kernel::attend_tile) on a
//! host without AVX-512, reading f32 or half-float rows as stored (half
//! floats widened in registers by F16C's `vcvtph2ps`), so an FP16 cache is
//! never copied into an f32 buffer; levels and FP8 codes are dequantized
//! in registers. The tiles are the parent module's loaders ([`Floats`],
//! [`Halves`], [`Levels`], chosen by [`Side`]; level layouts `Levels` does
//! not read are widened into the scratch first), read here through this
//! module's eight-lane [`Load`] (levels as [`MappedLevels`], compiled for
//! their level map).
//!
//! It computes exactly what the parent module's AVX-512 kernel computes,
//! bit for bit (NaN aside: an E4M3 NaN code
//! gives a NaN here whose sign and payload may differ): a score is the 16-lane
//! multiply-add over the head dimension (here two 8-lane registers)
//! folded by the tree `+8, +4, +2, +1`, eight scores at once by shuffles
//! ([`reduce8`]); a weighted value sum runs over the rows in order, per
//! channel. A head dimension that is not a multiple of 16 ends in a
//! partial chunk: its values are read through a zero-padded copy
//! ([`Load::load_partial`]) and its score lanes above the head kept as
//! they were, as the AVX-512 kernel's masked loads and multiply-adds do.
//!
//! Written because on an AVX2-only host (Zen 3) FP16 decode ran at a
//! quarter of the streaming read: a third of its time went to widening
//! every tile into f32 and most of the rest to a score loop that reloaded
//! each key row once per query head and spilled its accumulators (`perf`).
//! Register blocks are sized for AVX2's sixteen registers: one key row
//! against up to four query heads (eight accumulators; a row's folded sums
//! wait on the stack for the next seven rows), and value blocks of `16·N`
//! channels with `H·N ≤ 4` (at most eight accumulators, the values loaded
//! as the FMAs need them).

use std::arch::x86_64::*;

use kv_quant::{LevelMap, LevelRows};

use super::{Floats, Halves, Levels, Side, Tile};
use crate::kernel::{
    HeadBlockPass, KernelScratch, Partial, Prefetcher, TileGeometry, for_head_blocks,
    integer_values, score_steps, three_passes, value_steps,
};
use crate::source::TileRows;

/// Values of a tile (`rows × ch`) read 16 lanes at a time as f32.
///
/// # Safety
/// [`load`](Self::load) and [`load_partial`](Self::load_partial) are only
/// called from functions compiled with AVX2, FMA and F16C, with a
/// [`Row`](Self::Row) of a row `< rows` and `col + 16 <= ch` (`col + n <=
/// ch` for a partial load).
trait Load: Copy {
    /// Where a row starts, computed once per row and pass ([`row`](Self::row)).
    type Row: Copy;

    /// Channels per row: the stride [`row`](Self::row) steps by.
    fn ch(self) -> usize;

    /// Values held.
    fn len(self) -> usize;

    /// The start of row `t`.
    fn row(self, t: usize) -> Self::Row;

    /// Channels `col..col + 16` of a row as f32, low eight in the first register.
    unsafe fn load(self, row: Self::Row, col: usize) -> [__m256; 2];

    /// Channels `col..col + n` of a row as f32 (`n < 16`, a head's last
    /// channels when its dimension is not a multiple of 16), zeros above:
    /// through a copy, the values the parent module's masked loads give.
    unsafe fn load_partial(self, row: Self::Row, col: usize, n: usize) -> [__m256; 2];
}

/// Sixteen lanes from a zero-padded copy.
///
/// # Safety
/// Only called from functions compiled with AVX.
#[inline(always)]
unsafe fn lanes16(values: &[f32; 16]) -> [__m256; 2] {
    // SAFETY: `values` holds 16 floats; unaligned loads.
    unsafe {
        [
            _mm256_loadu_ps(values.as_ptr()),
            _mm256_loadu_ps(values.as_ptr().add(8)),
        ]
    }
}

/// The parent module's f32 rows, eight lanes at a time.
impl Load for Floats<'_> {
    type Row = usize;

    fn ch(self) -> usize {
        self.1
    }

    fn len(self) -> usize {
        self.0.len()
    }

    #[inline(always)]
    fn row(self, t: usize) -> usize {
        t * self.1
    }

    #[inline(always)]
    unsafe fn load(self, row: usize, col: usize) -> [__m256; 2] {
        debug_assert!(row + col + 16 <= self.0.len());
        // SAFETY: the caller keeps the 16 values inside the slice.
        unsafe {
            let p = self.0.as_ptr().add(row + col);
            [_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8))]
        }
    }

    #[inline(always)]
    unsafe fn load_partial(self, row: usize, col: usize, n: usize) -> [__m256; 2] {
        let mut lanes = [0.0f32; 16];
        lanes[..n].copy_from_slice(&self.0[row + col..][..n]);
        // SAFETY: the caller is compiled with AVX.
        unsafe { lanes16(&lanes) }
    }
}

/// The parent module's half-float rows, widened by F16C eight lanes at a time.
impl Load for Halves<'_> {
    type Row = usize;

    fn ch(self) -> usize {
        self.1
    }

    fn len(self) -> usize {
        self.0.len() / 2
    }

    #[inline(always)]
    fn row(self, t: usize) -> usize {
        t * self.1
    }

    #[inline(always)]
    unsafe fn load(self, row: usize, col: usize) -> [__m256; 2] {
        let i = row + col;
        debug_assert!(2 * (i + 16) <= self.0.len());
        // SAFETY: bytes `2i..2i + 32` are inside the slice; x86 is little-endian.
        unsafe {
            let p = self.0.as_ptr().add(2 * i).cast::<__m128i>();
            [
                _mm256_cvtph_ps(_mm_loadu_si128(p)),
                _mm256_cvtph_ps(_mm_loadu_si128(p.add(1))),
            ]
        }
    }

    #[inline(always)]
    unsafe fn load_partial(self, row: usize, col: usize, n: usize) -> [__m256; 2] {
        let i = row + col;
        let mut halves = [0u8; 32];
        halves[..2 * n].copy_from_slice(&self.0[2 * i..][..2 * n]);
        // SAFETY: `halves` holds 32 bytes (zero halves above `n`); the
        // caller is compiled with F16C.
        unsafe {
            let p = halves.as_ptr().cast::<__m128i>();
            [
                _mm256_cvtph_ps(_mm_loadu_si128(p)),
                _mm256_cvtph_ps(_mm_loadu_si128(p.add(1))),
            ]
        }
    }
}

/// A level map as a constant ([`map_code`]), so that a loader's choice of
/// arithmetic is made once per tile, not at every load: with the map a
/// run-time value, every 16 values of an FP8 tile went through a jump
/// table and reloaded their constants (`perf`).
const AFFINE: u8 = 0;
/// [`LevelMap::Centered`].
const CENTERED: u8 = 1;
/// [`LevelMap::Nf4`] and [`LevelMap::Codebook`]: a 16-entry table.
const TABLE: u8 = 2;
/// [`LevelMap::Fp8`] E5M2.
const E5M2: u8 = 3;
/// [`LevelMap::Fp8`] E4M3.
const E4M3: u8 = 4;

/// The constant of `map`, the middle level of a centered map (0 for the
/// others) and the table of a table map (NF4's for the others, unread).
fn map_code(map: LevelMap) -> (u8, f32, &'static [f32; 16]) {
    let table = map.table16().unwrap_or(&kv_quant::NF4_LEVELS);
    match map {
        LevelMap::Affine => (AFFINE, 0.0, table),
        LevelMap::Centered { mid } => (CENTERED, mid, table),
        LevelMap::Nf4 | LevelMap::Codebook(_) => (TABLE, 0.0, table),
        LevelMap::Fp8(kv_quant::Fp8Format::E5M2) => (E5M2, 0.0, table),
        LevelMap::Fp8(kv_quant::Fp8Format::E4M3) => (E4M3, 0.0, table),
    }
}

/// The parent module's level loader, eight lanes at a time, compiled for
/// one level map (`MAP`, a [`map_code`]) and one grouping (`SHARED`: 16
/// consecutive channels in one group, else each channel in its own):
/// the same layouts (levels one per byte) and the same arithmetic as
/// kv-quant's dequantization.
#[derive(Clone, Copy)]
struct MappedLevels<'a, const MAP: u8, const SHARED: bool> {
    levels: Levels<'a>,
    /// The middle level of a centered map.
    mid: f32,
    /// The entries of a table map.
    table: &'static [f32; 16],
}

/// Binds `$l` to `$levels` as the [`MappedLevels`] of its map and grouping
/// and evaluates `$body` with it: one monomorphic copy of `$body` per pair.
macro_rules! with_mapped_levels {
    ($levels:expr, $l:ident => $body:expr) => {{
        let levels: Levels<'_> = $levels;
        let (code, mid, table) = map_code(levels.map);
        match (code, levels.shared.is_some()) {
            (AFFINE, true) => with_mapped_levels!(@ levels, mid, table, AFFINE, true, $l => $body),
            (AFFINE, false) => with_mapped_levels!(@ levels, mid, table, AFFINE, false, $l => $body),
            (CENTERED, true) => with_mapped_levels!(@ levels, mid, table, CENTERED, true, $l => $body),
            (CENTERED, false) => with_mapped_levels!(@ levels, mid, table, CENTERED, false, $l => $body),
            (TABLE, true) => with_mapped_levels!(@ levels, mid, table, TABLE, true, $l => $body),
            (TABLE, false) => with_mapped_levels!(@ levels, mid, table, TABLE, false, $l => $body),
            (E5M2, true) => with_mapped_levels!(@ levels, mid, table, E5M2, true, $l => $body),
            (E5M2, false) => with_mapped_levels!(@ levels, mid, table, E5M2, false, $l => $body),
            (E4M3, true) => with_mapped_levels!(@ levels, mid, table, E4M3, true, $l => $body),
            (E4M3, false) => with_mapped_levels!(@ levels, mid, table, E4M3, false, $l => $body),
            _ => unreachable!("map_code gives one of the five map constants"),
        }
    }};
    (@ $levels:ident, $mid:ident, $table:ident, $map:ident, $shared:literal, $l:ident => $body:expr) => {{
        let $l = MappedLevels::<$map, $shared> {
            levels: $levels,
            mid: $mid,
            table: $table,
        };
        $body
    }};
}

impl<const MAP: u8, const SHARED: bool> Load for MappedLevels<'_, MAP, SHARED> {
    /// The row's first level and its first group.
    type Row = (usize, usize);

    fn ch(self) -> usize {
        self.levels.ch
    }

    fn len(self) -> usize {
        self.levels.rows.levels.len()
    }

    #[inline(always)]
    fn row(self, t: usize) -> (usize, usize) {
        let g = match self.levels.row_step {
            Some(n) => t * n,
            None => self.levels.rows.group_index(t, 0),
        };
        (t * self.levels.ch, g)
    }

    #[inline(always)]
    unsafe fn load(self, (row, g): (usize, usize), col: usize) -> [__m256; 2] {
        let rows = self.levels.rows;
        let i = row + col;
        debug_assert!(i + 16 <= rows.levels.len());
        debug_assert_eq!(SHARED, self.levels.shared.is_some());
        // SAFETY: bytes `i..i + 16` are inside the slice; group
        // `g + col / cpg` (or `g + col + 15` for one group per channel)
        // exists, as `LevelRows::value` would read it.
        unsafe {
            let bytes = _mm_loadu_si128(rows.levels.as_ptr().add(i).cast());
            let (s, o) = (rows.scale.as_ptr(), rows.offset.as_ptr());
            let ((a0, b0), (a1, b1)) = match self.levels.shared {
                // 16 channels from a multiple of 16 lie in one group; so do
                // any 16 of a head where groups hold whole heads
                // (`Levels::new`).
                Some(div) if SHARED => {
                    let j = g + div.of(col);
                    let p = (_mm256_set1_ps(*s.add(j)), _mm256_set1_ps(*o.add(j)));
                    (p, p)
                }
                _ => {
                    let j = g + col;
                    (
                        (_mm256_loadu_ps(s.add(j)), _mm256_loadu_ps(o.add(j))),
                        (_mm256_loadu_ps(s.add(j + 8)), _mm256_loadu_ps(o.add(j + 8))),
                    )
                }
            };
            [
                dequantize8::<MAP>(self.mid, self.table, bytes, a0, b0),
                dequantize8::<MAP>(self.mid, self.table, _mm_srli_si128::<8>(bytes), a1, b1),
            ]
        }
    }

    /// [`load`](Self::load)'s arithmetic on copies of the `n` levels and
    /// their parameters (zero above `n`, so those lanes hold `b + 0·a`
    /// with finite parameters: the passes never use them).
    #[inline(always)]
    unsafe fn load_partial(self, (row, g): (usize, usize), col: usize, n: usize) -> [__m256; 2] {
        let rows = self.levels.rows;
        let mut bytes = [0u8; 16];
        bytes[..n].copy_from_slice(&rows.levels[row + col..][..n]);
        let (mut a, mut b) = ([0.0f32; 16], [0.0f32; 16]);
        match self.levels.shared {
            // Groups hold whole heads where a head ends mid-chunk
            // (`Levels::new`): the tail is in its head's group.
            Some(div) if SHARED => {
                let j = g + div.of(col);
                a.fill(rows.scale[j]);
                b.fill(rows.offset[j]);
            }
            _ => {
                a[..n].copy_from_slice(&rows.scale[g + col..][..n]);
                b[..n].copy_from_slice(&rows.offset[g + col..][..n]);
            }
        }
        // SAFETY: the buffers hold 16 bytes and 16 floats each; the caller
        // is compiled with AVX2, FMA and F16C.
        unsafe {
            let bytes = _mm_loadu_si128(bytes.as_ptr().cast());
            let ([a0, a1], [b0, b1]) = (lanes16(&a), lanes16(&b));
            [
                dequantize8::<MAP>(self.mid, self.table, bytes, a0, b0),
                dequantize8::<MAP>(self.mid, self.table, _mm_srli_si128::<8>(bytes), a1, b1),
            ]
        }
    }
}

/// The low eight levels (bytes) of `bytes` as values under the map `MAP`
/// (a [`map_code`]; `mid` is a centered map's middle level), with scales
/// `a` and offsets `b`: `b + level·a` (product, then sum), `(level −
/// mid)·a`, `NF4_LEVELS[level & 15]·a`, or FP8 through IEEE half precision
/// as the parent module's `fp8_values` (E4M3 as `half·(2^8·a)`).
#[inline(always)]
fn dequantize8<const MAP: u8>(
    mid: f32,
    table: &'static [f32; 16],
    bytes: __m128i,
    a: __m256,
    b: __m256,
) -> __m256 {
    // SAFETY: only inlined into `attend_tile_avx2` (AVX2, F16C); no memory is touched.
    unsafe {
        match MAP {
            AFFINE => {
                let level = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
                _mm256_add_ps(b, _mm256_mul_ps(level, a))
            }
            CENTERED => {
                let level = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
                _mm256_mul_ps(_mm256_sub_ps(level, _mm256_set1_ps(mid)), a)
            }
            // Two 8-entry tables, chosen per lane by bit 3 of the level
            // (moved to the sign bit, which `blendv` reads).
            TABLE => {
                let levels = _mm256_cvtepu8_epi32(bytes);
                let table = table.as_ptr();
                let low = _mm256_permutevar8x32_ps(_mm256_loadu_ps(table), levels);
                let high = _mm256_permutevar8x32_ps(_mm256_loadu_ps(table.add(8)), levels);
                let upper = _mm256_castsi256_ps(_mm256_slli_epi32::<28>(levels));
                _mm256_mul_ps(_mm256_blendv_ps(low, high, upper), a)
            }
            E5M2 => {
                let codes = _mm_cvtepu8_epi16(bytes);
                _mm256_mul_ps(_mm256_cvtph_ps(_mm_slli_epi16::<8>(codes)), a)
            }
            E4M3 => {
                // The code sign-extended to 16 bits and moved up by 7: the
                // sign in bits 15 and 14, exponent and mantissa in bits
                // 13..7, where a half keeps them (bit 14 cleared).
                let moved = _mm_slli_epi16::<7>(_mm_cvtepi8_epi16(bytes));
                let field = _mm_and_si128(moved, _mm_set1_epi16(0x3F80));
                // Adding 0x80 carries into bit 14 exactly when the field is
                // all ones (`S.1111.111`, NaN): the half's exponent is then
                // all ones and its mantissa not zero, a NaN.
                let nan = _mm_add_epi16(field, _mm_set1_epi16(0x80));
                let nan = _mm_and_si128(nan, _mm_set1_epi16(0x4000));
                let bits = _mm_and_si128(moved, _mm_set1_epi16(0xBFFF_u16 as i16));
                let half = _mm256_cvtph_ps(_mm_or_si128(bits, nan));
                _mm256_mul_ps(half, _mm256_mul_ps(a, _mm256_set1_ps(256.0)))
            }
            _ => unreachable!("not a level map constant"),
        }
    }
}

/// [`attend_tile`](crate::kernel::attend_tile) with AVX2: scores from the
/// keys (unless `keys` is `None`: the integer path scored them), softmax,
/// and value sums (the integer value pass's where `int_values` is given and
/// it takes them).
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C; the scratch must be sized for
/// `tile.rows` rows of `tile.geometry` (as `attend_tile` does).
#[target_feature(enable = "avx2,fma,f16c")]
pub(in crate::kernel) unsafe fn attend_tile_avx2(
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
                let weights = &mut scratch.weights[..heads * rows];
                match Side::new(keys, ch, d, kb) {
                    Side::F32(k) => score_pass(tile, k, weights, &mut prefetch),
                    Side::F16(k) => score_pass(tile, k, weights, &mut prefetch),
                    Side::Levels(k) => with_mapped_levels!(k, k => {
                        score_pass(tile, k, weights, &mut prefetch)
                    }),
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
                let (acc, weights) = (
                    &mut scratch.acc[..heads * d],
                    &scratch.weights[..heads * rows],
                );
                match Side::new(values, ch, d, vb) {
                    Side::F32(v) => value_pass(tile, v, acc, weights, p),
                    Side::F16(v) => value_pass(tile, v, acc, weights, p),
                    Side::Levels(v) => {
                        with_mapped_levels!(v, v => value_pass(tile, v, acc, weights, p))
                    }
                }
            }
            prefetch.finish();
        },
    );
    scratch.wide = wide;
}

/// The scores of every head into `weights` (`heads × rows`).
#[inline(always)]
fn score_pass<K: Load>(tile: Tile<'_>, keys: K, weights: &mut [f32], prefetch: &mut Prefetcher) {
    let TileGeometry { kv_heads, d, .. } = tile.geometry;
    assert!(keys.len() == tile.rows * kv_heads * d && keys.ch() == kv_heads * d);
    let mut pass = ScorePass {
        q: tile.q,
        keys,
        weights,
        d,
        rows: tile.rows,
        prefetch,
    };
    for_head_blocks(tile.geometry, &mut pass);
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
    /// `w[j·rows + t] = q_j · k_t` for the `H` heads `j` from `h0`: each
    /// key chunk loaded once feeds the `2H` accumulators of one row; a
    /// row's two registers are added (the tree's `+8` step) and kept, and
    /// every eight rows the rest of the tree folds them into eight scores.
    #[inline(always)]
    fn run<const H: usize>(&mut self, kvh: usize, h0: usize) {
        let (d, rows) = (self.d, self.rows);
        let q = &self.q[h0 * d..][..H * d];
        let w = &mut self.weights[h0 * rows..][..H * rows];
        let (full, tail) = (d / 16 * 16, d % 16);
        // The queries' last `tail` channels, zero-padded to 16 lanes.
        let mut q_tail = [[0.0f32; 16]; H];
        for (j, lanes) in q_tail.iter_mut().enumerate() {
            lanes[..tail].copy_from_slice(&q[j * d + full..][..tail]);
        }
        // SAFETY: only inlined into `attend_tile_avx2` (AVX2, FMA, F16C).
        // `score_pass` checked `keys.len() == rows·ch` with rows `ch`
        // apart; a row's chunks end
        // at `t·ch + kvh·d + d <= rows·ch`; `q` holds `H·d` values, read in
        // chunks of 16 up to `full <= d` and then from `q_tail`.
        unsafe {
            // Lanes `< tail` of the last chunk: the others keep their sums,
            // as the parent module's masked multiply-add keeps them.
            let in_tail = |base: i32| {
                let lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
                let limit = _mm256_set1_epi32(tail as i32 - base);
                _mm256_castsi256_ps(_mm256_cmpgt_epi32(limit, lane))
            };
            let tail_mask = [in_tail(0), in_tail(8)];
            let mut halves = [[_mm256_setzero_ps(); 8]; H];
            for t in 0..rows {
                if t.is_multiple_of(4) {
                    self.prefetch.step();
                }
                let row = self.keys.row(t);
                let mut acc = [[_mm256_setzero_ps(); 2]; H];
                for c in (0..full).step_by(16) {
                    let k = self.keys.load(row, kvh * d + c);
                    for (j, a) in acc.iter_mut().enumerate() {
                        let p = q.as_ptr().add(j * d + c);
                        a[0] = _mm256_fmadd_ps(_mm256_loadu_ps(p), k[0], a[0]);
                        a[1] = _mm256_fmadd_ps(_mm256_loadu_ps(p.add(8)), k[1], a[1]);
                    }
                }
                if tail > 0 {
                    let k = self.keys.load_partial(row, kvh * d + full, tail);
                    for (j, a) in acc.iter_mut().enumerate() {
                        let p = q_tail[j].as_ptr();
                        for (h, a) in a.iter_mut().enumerate() {
                            let sum = _mm256_fmadd_ps(_mm256_loadu_ps(p.add(8 * h)), k[h], *a);
                            *a = _mm256_blendv_ps(*a, sum, tail_mask[h]);
                        }
                    }
                }
                let r = t % 8;
                for (h, a) in halves.iter_mut().zip(&acc) {
                    h[r] = _mm256_add_ps(a[0], a[1]);
                }
                if r == 7 || t + 1 == rows {
                    let mut sums = [0.0f32; 8];
                    for (j, h) in halves.iter().enumerate() {
                        _mm256_storeu_ps(sums.as_mut_ptr(), reduce8(*h));
                        w[j * rows + t - r..][..r + 1].copy_from_slice(&sums[..r + 1]);
                    }
                }
            }
        }
    }
}

/// Lane `i` of the result is the sum of the eight lanes of `v[i]`, added
/// as the parent module's `reduce` adds its last three levels: lane `k`
/// gets `k + 4`, then `k + 2` and `k + 1`; pairs of vectors are folded
/// together by shuffles so that each addition serves two, four, then all
/// eight sums.
#[inline(always)]
fn reduce8(v: [__m256; 8]) -> __m256 {
    // SAFETY: only inlined into `attend_tile_avx2` (AVX2); no memory is touched.
    unsafe {
        // [a.lo | b.lo] + [a.hi | b.hi]: lanes 0..4 hold v[2p]'s `k + (k + 4)`,
        // lanes 4..8 v[2p + 1]'s.
        let mut w = [_mm256_setzero_ps(); 4];
        for (p, w) in w.iter_mut().enumerate() {
            let (a, b) = (v[2 * p], v[2 * p + 1]);
            *w = _mm256_add_ps(
                _mm256_permute2f128_ps::<0x20>(a, b),
                _mm256_permute2f128_ps::<0x31>(a, b),
            );
        }
        // Within 128-bit blocks, [a0 a1 b0 b1] + [a2 a3 b2 b3]: the low
        // block holds v[4p] and v[4p + 2], two lanes each; the high block
        // v[4p + 1] and v[4p + 3].
        let mut x = [_mm256_setzero_ps(); 2];
        for (p, x) in x.iter_mut().enumerate() {
            let (a, b) = (w[2 * p], w[2 * p + 1]);
            *x = _mm256_add_ps(
                _mm256_shuffle_ps::<0x44>(a, b),
                _mm256_shuffle_ps::<0xEE>(a, b),
            );
        }
        // [a0 a2 b0 b2] + [a1 a3 b1 b3]: the low block holds the sums of
        // v[0], v[2], v[4], v[6], the high block those of v[1], v[3], v[5], v[7].
        let z = _mm256_add_ps(
            _mm256_shuffle_ps::<0x88>(x[0], x[1]),
            _mm256_shuffle_ps::<0xDD>(x[0], x[1]),
        );
        _mm256_permutevar8x32_ps(z, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7))
    }
}

/// The weighted value sums of every head into `acc` (`heads × d`) from the
/// softmax weights (`heads × rows`).
#[inline(always)]
fn value_pass<V: Load>(
    tile: Tile<'_>,
    values: V,
    acc: &mut [f32],
    weights: &[f32],
    prefetch: &mut Prefetcher,
) {
    let TileGeometry { kv_heads, d, .. } = tile.geometry;
    assert!(values.len() == tile.rows * kv_heads * d && values.ch() == kv_heads * d);
    let mut pass = ValuePass {
        acc,
        weights,
        values,
        d,
        rows: tile.rows,
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
    /// Stepped every four rows of the blocks that start a run of 64
    /// channels ([`value_steps`]' unit).
    prefetch: &'a mut Prefetcher,
}

impl<V: Load> HeadBlockPass for ValuePass<'_, V> {
    /// Blocks of `16·N` channels with `H·N ≤ 4`, so the `2·H·N`
    /// accumulators fit the registers while the rows stream by; narrower
    /// blocks take what is left, the last one partial where `d` is not a
    /// multiple of 16 ([`value_tail`]).
    #[inline(always)]
    fn run<const H: usize>(&mut self, kvh: usize, h0: usize) {
        let (d, rows) = (self.d, self.rows);
        let out = &mut self.acc[h0 * d..][..H * d];
        let w = &self.weights[h0 * rows..][..H * rows];
        let block = ValueBlock {
            w,
            rows,
            values: self.values,
            offset: kvh * d,
        };
        let mut c = 0;
        if H == 1 {
            while c + 64 <= d {
                store_block::<H, 4>(out, d, c, value_block::<V, H, 4>(block, c, self.prefetch));
                c += 64;
            }
        }
        if H <= 2 {
            while c + 32 <= d {
                store_block::<H, 2>(out, d, c, value_block::<V, H, 2>(block, c, self.prefetch));
                c += 32;
            }
        }
        while c + 16 <= d {
            store_block::<H, 1>(out, d, c, value_block::<V, H, 1>(block, c, self.prefetch));
            c += 16;
        }
        if c < d {
            let tail = value_tail::<V, H>(block, c, d - c, self.prefetch);
            for (j, a) in tail.iter().enumerate() {
                let mut lanes = [0.0f32; 16];
                // SAFETY: only inlined into `attend_tile_avx2` (AVX2); `lanes` holds 16 floats.
                unsafe {
                    _mm256_storeu_ps(lanes.as_mut_ptr(), a[0]);
                    _mm256_storeu_ps(lanes.as_mut_ptr().add(8), a[1]);
                }
                out[j * d + c..(j + 1) * d].copy_from_slice(&lanes[..d - c]);
            }
        }
    }
}

/// Inputs of one register block of value sums.
#[derive(Clone, Copy)]
struct ValueBlock<'a, V> {
    w: &'a [f32],
    rows: usize,
    values: V,
    /// First channel of the KV head in a row.
    offset: usize,
}

/// Channels `c..c + 16N` of `H` heads, summed over the rows in order.
#[inline(always)]
fn value_block<V: Load, const H: usize, const N: usize>(
    b: ValueBlock<'_, V>,
    c: usize,
    prefetch: &mut Prefetcher,
) -> [[[__m256; 2]; N]; H] {
    // SAFETY: only inlined into `attend_tile_avx2` (AVX2, FMA, F16C);
    // `value_pass` checked `values.len() == rows·ch` with rows `ch` apart, channel
    // `offset + c + 16N` is at most `ch`, and `w` holds `H·rows` weights.
    unsafe {
        let mut acc = [[[_mm256_setzero_ps(); 2]; N]; H];
        let step = c.is_multiple_of(64);
        for t in 0..b.rows {
            if step && t % 4 == 0 {
                prefetch.step();
            }
            let row = b.values.row(t);
            let mut v = [[_mm256_setzero_ps(); 2]; N];
            for (k, v) in v.iter_mut().enumerate() {
                *v = b.values.load(row, b.offset + c + 16 * k);
            }
            for (j, acc) in acc.iter_mut().enumerate() {
                let wt = _mm256_set1_ps(*b.w.get_unchecked(j * b.rows + t));
                for (a, v) in acc.iter_mut().zip(&v) {
                    a[0] = _mm256_fmadd_ps(wt, v[0], a[0]);
                    a[1] = _mm256_fmadd_ps(wt, v[1], a[1]);
                }
            }
        }
        acc
    }
}

/// Channels `c..c + n` (`n < 16`, a head's last ones) of `H` heads,
/// summed over the rows in order as [`value_block`] sums them.
#[inline(always)]
fn value_tail<V: Load, const H: usize>(
    b: ValueBlock<'_, V>,
    c: usize,
    n: usize,
    prefetch: &mut Prefetcher,
) -> [[__m256; 2]; H] {
    // SAFETY: only inlined into `attend_tile_avx2` (AVX2, FMA, F16C);
    // `value_pass` checked `values.len() == rows·ch` with rows `ch` apart,
    // channel `offset + c + n` is at most `ch`, and `w` holds `H·rows`
    // weights.
    unsafe {
        let mut acc = [[_mm256_setzero_ps(); 2]; H];
        let steps = c.is_multiple_of(64);
        for t in 0..b.rows {
            if steps && t % 4 == 0 {
                prefetch.step();
            }
            let v = b.values.load_partial(b.values.row(t), b.offset + c, n);
            for (j, a) in acc.iter_mut().enumerate() {
                let wt = _mm256_set1_ps(*b.w.get_unchecked(j * b.rows + t));
                a[0] = _mm256_fmadd_ps(wt, v[0], a[0]);
                a[1] = _mm256_fmadd_ps(wt, v[1], a[1]);
            }
        }
        acc
    }
}

/// Writes each block's 16 channels to `out[j·d + c + 16k..]`.
#[inline(always)]
fn store_block<const H: usize, const N: usize>(
    out: &mut [f32],
    d: usize,
    c: usize,
    acc: [[[__m256; 2]; N]; H],
) {
    for (j, a) in acc.iter().enumerate() {
        for (k, a) in a.iter().enumerate() {
            let o = &mut out[j * d + c + 16 * k..][..16];
            // SAFETY: only inlined into `attend_tile_avx2` (AVX2); `o` holds 16 floats.
            unsafe {
                _mm256_storeu_ps(o.as_mut_ptr(), a[0]);
                _mm256_storeu_ps(o.as_mut_ptr().add(8), a[1]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::arch::x86_64::*;

    use kv_quant::{Fp8Format, LevelMap, LloydMax, NF4_LEVELS};

    /// `dequantize8` of eight bytes with scale `a` and offset `b`,
    /// compiled with the kernel's features.
    #[target_feature(enable = "avx2,fma,f16c")]
    fn lanes(map: LevelMap, bytes: [u8; 8], a: f32, b: f32) -> [f32; 8] {
        let mut wide = [0u8; 16];
        wide[..8].copy_from_slice(&bytes);
        let mut out = [0.0f32; 8];
        let (a, b) = (_mm256_set1_ps(a), _mm256_set1_ps(b));
        // SAFETY: the caller checked the features; `wide` holds 16 bytes
        // and `out` 8 floats.
        unsafe {
            let bytes = _mm_loadu_si128(wide.as_ptr().cast());
            let (code, mid, t) = super::map_code(map);
            let v = match code {
                super::AFFINE => super::dequantize8::<{ super::AFFINE }>(mid, t, bytes, a, b),
                super::CENTERED => super::dequantize8::<{ super::CENTERED }>(mid, t, bytes, a, b),
                super::TABLE => super::dequantize8::<{ super::TABLE }>(mid, t, bytes, a, b),
                super::E5M2 => super::dequantize8::<{ super::E5M2 }>(mid, t, bytes, a, b),
                _ => super::dequantize8::<{ super::E4M3 }>(mid, t, bytes, a, b),
            };
            _mm256_storeu_ps(out.as_mut_ptr(), v);
        }
        out
    }

    /// Every byte under every level map gives kv-quant's value (the
    /// formulas of `LevelMap`'s docs), NaN for E4M3's NaN codes.
    #[test]
    fn every_byte_dequantizes_as_kv_quant_defines_it() {
        if !crate::Isa::Avx2.is_supported() {
            test_support::skip(
                test_support::Requirement::Isa,
                "attention",
                "every_byte_dequantizes_as_kv_quant_defines_it",
                "no AVX2/FMA/F16C: the AVX2 tile kernel is not used here",
            );
            return;
        }
        let (a, b) = (0.371_2f32, -1.25f32);
        for map in [
            LevelMap::Affine,
            LevelMap::Centered { mid: 8.0 },
            LevelMap::Nf4,
            LevelMap::Codebook(LloydMax::of(4).padded16().expect("4 bits")),
            LevelMap::Codebook(LloydMax::of(3).padded16().expect("3 bits")),
            LevelMap::Fp8(Fp8Format::E5M2),
            LevelMap::Fp8(Fp8Format::E4M3),
        ] {
            let mut nans = 0;
            for base in (0..256).step_by(8) {
                let bytes: [u8; 8] = std::array::from_fn(|i| (base + i) as u8);
                // SAFETY: AVX2, FMA and F16C were detected above.
                let got = unsafe { lanes(map, bytes, a, b) };
                for (&byte, &v) in bytes.iter().zip(&got) {
                    let want = match map {
                        LevelMap::Affine => b + f32::from(byte) * a,
                        LevelMap::Centered { mid } => (f32::from(byte) - mid) * a,
                        LevelMap::Nf4 => NF4_LEVELS[usize::from(byte & 15)] * a,
                        // Codes past the codebook are never stored; the
                        // lookup reads the low 4 bits (a padded entry).
                        LevelMap::Codebook(table) => table[usize::from(byte & 15)] * a,
                        LevelMap::Fp8(format) => format.decode(byte) * a,
                    };
                    nans += usize::from(v.is_nan());
                    assert!(
                        v.to_bits() == want.to_bits() || (v.is_nan() && want.is_nan()),
                        "{map:?} byte {byte:#04x}: {v} vs {want}"
                    );
                }
            }
            let want_nans = match map {
                LevelMap::Fp8(Fp8Format::E4M3) => 2,
                LevelMap::Fp8(Fp8Format::E5M2) => 6,
                _ => 0,
            };
            assert_eq!(nans, want_nans, "{map:?}");
        }
    }
}
