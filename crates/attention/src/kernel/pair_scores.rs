//! Scores of every query head against keys coded before RoPE on pair
//! codebooks ([`PairCodeRows`]), taken against the codebook: per query
//! head, pair and centroid the two numbers `A = q_a·c₀ + q_b·c₁` and
//! `B = q_b·c₀ − q_a·c₁` once per query (the table), then per row and pair
//! `A[code]·cos + B[code]·sin`, summed over the pairs of each gain block
//! and times the block's gain (the derivation is in
//! [`crate::pair_codes`]). Nothing is decoded or rotated per row.
//!
//! Rows run sixteen to a vector, one body over the float kernel's
//! [`Lanes`]: each pair's codes of sixteen rows index its table row in
//! registers (AVX-512 one `vpermps` for up to 16 centroids, `vpermi2ps`
//! for 32; AVX2 eight-entry tables blended; one lane at a time for other
//! sizes and on the scalar set),
//! and the rows' angles are read in lanes
//! ([`Rope::trig_rows`](crate::Rope::trig_rows) lays them out so). Both
//! vector sets give the same bits (the same fused multiply-adds in the
//! same order: per lane `acc = fma(A, cos, acc); acc = fma(B, sin, acc)`
//! over a block's pairs, then `score = fma(gain, acc, score)` over the
//! blocks); the scalar set rounds each product.

use super::fused::lanes::{Lanes, Portable};
#[cfg(target_arch = "x86_64")]
use super::fused::x86::{Ymm2, Zmm};
use super::{HeadBlockPass, LANES, TileGeometry, for_head_blocks};
use crate::isa::Isa;
use crate::pair_codes::PairCodeRows;

/// Per-thread buffers: the query's table and one run of rows' codes and
/// gains turned so that rows lie in lanes.
#[derive(Clone, Debug, Default)]
pub(crate) struct PairScratch {
    /// Per query head and pair, `width` values of `A` then `width` of `B`
    /// (entries past the codebook's centroids zero).
    table: Vec<f32>,
    /// What `table` was made from: the query's address and the centroids'.
    made_for: Option<(usize, usize)>,
    /// Per pair of one head, the codes of sixteen rows.
    codes: Vec<[u8; LANES]>,
    /// Per gain block of one head, the gains of sixteen rows.
    gains: Vec<[f32; LANES]>,
    /// One head's runs of pairs under one gain ([`gain_runs`]).
    runs: Vec<(usize, usize, usize)>,
}

impl PairScratch {
    /// Forgets the table (the queries' buffer may hold other queries).
    pub(crate) fn forget(&mut self) {
        self.made_for = None;
    }
}

/// Table entries per pair and part (`A` or `B`): the centroids, at least 16.
fn table_width(centroids: usize) -> usize {
    centroids.max(LANES)
}

/// One head's gain blocks: runs of its pairs `[start, end)` under one gain,
/// and the gain's index within a row.
fn gain_runs(pairs: &PairCodeRows<'_>, kv_head: usize, out: &mut Vec<(usize, usize, usize)>) {
    let d = pairs.head_dim();
    let block = pairs.codes().codebook.block();
    out.clear();
    for i in 0..d / 2 {
        let gain = (kv_head * d + 2 * i) / block;
        match out.last_mut() {
            Some((_, end, g)) if *g == gain => *end = i + 1,
            _ => out.push((i, i + 1, gain)),
        }
    }
}

/// Scores of every query head of `q` (`q_heads × d`, already scaled)
/// against the rows of `pairs` into `weights[h·rows + t]`.
pub(crate) fn scores(
    q: &[f32],
    pairs: &PairCodeRows<'_>,
    geometry: TileGeometry,
    isa: Isa,
    scratch: &mut PairScratch,
    weights: &mut [f32],
) {
    let TileGeometry { kv_heads, d, .. } = geometry;
    debug_assert_eq!(pairs.channels(), kv_heads * d);
    debug_assert_eq!(pairs.head_dim(), d);
    make_table(q, pairs, geometry, scratch);
    let width = table_width(pairs.codes().codebook.spec().centroids);
    let p = d / 2;
    let PairScratch {
        table,
        codes,
        gains,
        runs,
        ..
    } = scratch;
    codes.resize(p, [0; LANES]);
    gains.resize(p, [0.0; LANES]);
    let mut pass = PairPass {
        pairs,
        table,
        codes,
        gains,
        runs,
        weights,
        isa,
        width,
    };
    for_head_blocks(geometry, &mut pass);
}

/// The scores of one block of up to four query heads sharing a KV head
/// (the kernels' one head-block loop, [`for_head_blocks`]): sixteen rows at
/// a time, their codes and gains turned into lanes once for the block.
struct PairPass<'a> {
    pairs: &'a PairCodeRows<'a>,
    table: &'a [f32],
    codes: &'a mut [[u8; LANES]],
    gains: &'a mut [[f32; LANES]],
    runs: &'a mut Vec<(usize, usize, usize)>,
    weights: &'a mut [f32],
    isa: Isa,
    width: usize,
}

impl HeadBlockPass for PairPass<'_> {
    fn run<const H: usize>(&mut self, kvh: usize, h0: usize) {
        let (pairs, isa, width) = (self.pairs, self.isa, self.width);
        let (d, rows) = (pairs.head_dim(), pairs.rows());
        let (p, groups) = (d / 2, pairs.channels() / 2);
        let blocks = pairs.channels() / pairs.codes().codebook.block();
        gain_runs(pairs, kvh, self.runs);
        let tables: [&[f32]; H] =
            std::array::from_fn(|k| &self.table[(h0 + k) * p * 2 * width..][..p * 2 * width]);
        for t in (0..rows).step_by(LANES) {
            let n = LANES.min(rows - t);
            // Sixteen rows' codes and gains of this head, rows in lanes.
            let src = &pairs.codes().codes[t * groups..][..n * groups];
            turn_codes(src, (groups, kvh * p), n, isa, self.codes);
            for (lanes, &(_, _, b)) in self.gains.iter_mut().zip(self.runs.iter()) {
                *lanes = [0.0; LANES];
                for (l, v) in lanes.iter_mut().enumerate().take(n) {
                    *v = pairs.codes().gains[(t + l) * blocks + b];
                }
            }
            let chunk = Chunk {
                pairs,
                codes: self.codes,
                gains: self.gains,
                runs: self.runs,
                row: t,
                lanes: n,
                width,
            };
            for (k, s) in chunk.score(tables, isa).iter().enumerate() {
                self.weights[(h0 + k) * rows + t..][..n].copy_from_slice(&s[..n]);
            }
        }
    }
}

/// Codes `first..first + out.len()` of `n` rows of `groups` codes (`src`)
/// into `out`, a pair's sixteen rows a lane each (zeros past `n`).
fn turn_codes(
    src: &[u8],
    (groups, first): (usize, usize),
    n: usize,
    isa: Isa,
    out: &mut [[u8; LANES]],
) {
    #[cfg(target_arch = "x86_64")]
    if matches!(isa, Isa::Avx512 | Isa::Avx512Vnni) && out.len().is_multiple_of(4) {
        // SAFETY: the configured `isa` is supported: AVX-512F. The
        // gathers read four codes `first + 4j .. first + 4j + 4` of each of
        // the `n` rows, within `src` (`first + out.len() <= groups`).
        unsafe { turn_codes_avx512(src, (groups, first), n, out) };
        return;
    }
    let _ = isa;
    for (i, lanes) in out.iter_mut().enumerate() {
        *lanes = [0; LANES];
        for (l, c) in lanes.iter_mut().enumerate().take(n) {
            *c = src[l * groups + first + i];
        }
    }
}

/// [`turn_codes`] with one gather of four codes a row per four pairs.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn turn_codes_avx512(
    src: &[u8],
    (groups, first): (usize, usize),
    n: usize,
    out: &mut [[u8; LANES]],
) {
    use std::arch::x86_64::*;
    assert!(first + out.len() <= groups && src.len() >= n * groups && n <= LANES);
    let mask: __mmask16 = if n == LANES { 0xFFFF } else { (1u16 << n) - 1 };
    // Offsets up to 15 rows of codes: no i32 product may wrap.
    let stride = i32::try_from(groups)
        .ok()
        .filter(|g| g.checked_mul(LANES as i32).is_some())
        .expect("sixteen rows' codes fit in i32 offsets");
    let offsets = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32(stride),
    );
    let bytes = _mm512_set1_epi32(0xFF);
    for (j, quad) in out.chunks_exact_mut(4).enumerate() {
        // SAFETY: lanes below `n` read bytes `l·groups + first + 4j ..+4`
        // of `src` (asserted above); masked lanes read nothing.
        let words = unsafe {
            let base = src.as_ptr().add(first + 4 * j).cast::<i32>();
            _mm512_mask_i32gather_epi32::<1>(_mm512_setzero_si512(), mask, offsets, base)
        };
        for (k, lanes) in quad.iter_mut().enumerate() {
            let codes = _mm512_and_si512(
                _mm512_srlv_epi32(words, _mm512_set1_epi32(8 * k as i32)),
                bytes,
            );
            // SAFETY: 16 bytes.
            unsafe { _mm_storeu_si128(lanes.as_mut_ptr().cast(), _mm512_cvtepi32_epi8(codes)) };
        }
    }
}

/// The table of `q` against the codebook, unless it is already made.
fn make_table(q: &[f32], pairs: &PairCodeRows<'_>, geometry: TileGeometry, s: &mut PairScratch) {
    let codebook = pairs.codes().codebook;
    let key = (q.as_ptr() as usize, codebook.centroids().as_ptr() as usize);
    if s.made_for == Some(key) {
        return;
    }
    let TileGeometry { group, kv_heads, d } = geometry;
    let (p, k) = (d / 2, codebook.spec().centroids);
    let width = table_width(k);
    s.table.clear();
    s.table.resize(kv_heads * group * p * 2 * width, 0.0);
    for (h, entries) in s.table.chunks_exact_mut(p * 2 * width).enumerate() {
        let (qh, g) = (&q[h * d..][..d], h / group);
        for (i, e) in entries.chunks_exact_mut(2 * width).enumerate() {
            let (a, b) = pairs.pair(i);
            let (qa, qb) = (qh[a], qh[b]);
            let (ta, tb) = e.split_at_mut(width);
            for c in 0..k {
                let centroid = codebook.centroid(g * p + i, c as u8);
                let (c0, c1) = (centroid[0], centroid[1]);
                ta[c] = qa * c0 + qb * c1;
                tb[c] = qb * c0 - qa * c1;
            }
        }
    }
    s.made_for = Some(key);
}

/// Sixteen rows (or the tile's last few) of one KV head.
struct Chunk<'a> {
    pairs: &'a PairCodeRows<'a>,
    codes: &'a [[u8; LANES]],
    gains: &'a [[f32; LANES]],
    runs: &'a [(usize, usize, usize)],
    row: usize,
    lanes: usize,
    width: usize,
}

impl Chunk<'_> {
    /// The scores of `H` query heads (their `tables`) for these rows, on
    /// the configured instruction set's [`Lanes`].
    fn score<const H: usize>(&self, tables: [&[f32]; H], isa: Isa) -> [[f32; LANES]; H] {
        match isa {
            // SAFETY: the configured `isa` is supported (checked by
            // `AttentionConfig`): AVX-512F/BW/VL, AVX2, FMA and F16C.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 | Isa::Avx512Vnni => unsafe { self.score_avx512(tables) },
            // SAFETY: as above: AVX2, FMA and F16C.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => unsafe { self.score_avx2(tables) },
            // SAFETY: `Portable` needs no CPU feature.
            _ => unsafe { self.score_lanes::<Portable, H>(tables) },
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    unsafe fn score_avx512<const H: usize>(&self, tables: [&[f32]; H]) -> [[f32; LANES]; H] {
        // SAFETY: compiled with `Zmm`'s features, which the caller checked.
        unsafe { self.score_lanes::<Zmm, H>(tables) }
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn score_avx2<const H: usize>(&self, tables: [&[f32]; H]) -> [[f32; LANES]; H] {
        // SAFETY: compiled with `Ymm2`'s features, which the caller checked.
        unsafe { self.score_lanes::<Ymm2, H>(tables) }
    }

    /// Per lane (row) `acc = A[code]·cos + acc; acc = B[code]·sin + acc`
    /// over a gain block's pairs, then `score = gain·acc + score`, with
    /// `V`'s multiply-adds; each pair's codes and angles loaded once for
    /// the `H` heads, the entries looked up in registers
    /// ([`Lanes::lookup_codes`]).
    ///
    /// # Safety
    /// Only inlined into code compiled with `V`'s features.
    #[inline(always)]
    unsafe fn score_lanes<V: Lanes, const H: usize>(
        &self,
        tables: [&[f32]; H],
    ) -> [[f32; LANES]; H] {
        let (w, n) = (self.width, self.lanes);
        // SAFETY: the caller has `V`'s features; the angle runs hold `n`
        // values, the codes and gains 16 each, a table row `2·width`.
        unsafe {
            let mut score = [V::zero(); H];
            for (&(start, end, _), gain) in self.runs.iter().zip(self.gains) {
                let mut acc = [V::zero(); H];
                for i in start..end {
                    let (cos, sin) = self.pairs.trig_run(i, self.row, n);
                    let (c, s) = if n == LANES {
                        (V::load(cos.as_ptr()), V::load(sin.as_ptr()))
                    } else {
                        (
                            V::load_partial(cos.as_ptr(), n),
                            V::load_partial(sin.as_ptr(), n),
                        )
                    };
                    for (acc, table) in acc.iter_mut().zip(tables) {
                        let (ta, tb) = table[i * 2 * w..][..2 * w].split_at(w);
                        let codes = &self.codes[i];
                        *acc = V::fmadd(V::lookup_codes(codes, ta), c, *acc);
                        *acc = V::fmadd(V::lookup_codes(codes, tb), s, *acc);
                    }
                }
                let g = V::load(gain.as_ptr());
                for (score, acc) in score.iter_mut().zip(&acc) {
                    *score = V::fmadd(g, *acc, *score);
                }
            }
            let mut out = [[0f32; LANES]; H];
            for (o, s) in out.iter_mut().zip(&score) {
                s.store(o.as_mut_ptr());
            }
            out
        }
    }
}
