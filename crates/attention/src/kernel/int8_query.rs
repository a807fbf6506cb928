//! Scores against integer keys with integer dot products
//! ([`Numerics::Int8Query`](crate::Numerics::Int8Query)), the way llama.cpp
//! scores quantized caches: each query head is quantized once per tile to
//! int8 codes with its own scale, and a score is
//! `Σ_groups [ a · s_q · dot(q_codes, levels) + offset term ]`, so the
//! group scale `a` and offset `b` are applied once per group, not once per
//! value.
//!
//! Two layouts are taken:
//! - **groups along a row** (per-token groups, or per-tensor) of at least
//!   [`MIN_GROUP`] channels: the head's channels split into segments of one
//!   group each; a segment adds `a·(s_q·Σ q̂·l) + b·Σ q` (affine levels) or
//!   `a·(s_q·Σ q̂·l − mid·Σ q)` (centred levels), with `Σ q` exact in f32;
//! - **one group per channel** (per-channel groups over blocks of tokens):
//!   for each run of rows sharing a block, the scale is folded into the
//!   query (`q'_c = q_c·a_c`) before it is quantized, and the offset term
//!   `Σ q_c·b_c` (or `−mid·Σ q'_c`) is one constant per head; the levels
//!   are scored centred on `m = 2^(bits−1)` at no cost per row (the
//!   constant takes `m·(Σ q'_c − s'·Σ q̂_c)`), which halves the codes'
//!   rounding error for 4-bit levels.
//!
//! NF4 codes take the first layout through their integer image
//! ([`NF4_IMAGE`], one `vpshufb` per 64 levels) as centred levels.
//!
//! 4-bit levels read in place, two per byte ([`LevelPacking::Nibbles`]),
//! are scored without being unpacked to memory: the low nibbles of a row's
//! bytes are its even channels and the high nibbles its odd ones, so each
//! head's codes are also kept split ([`split_planes`]: per block of
//! [`PLANE_BLOCK`] channels, the even channels' codes, then the odd ones')
//! and a row's 64 bytes give two `vpdpbusd`s, one per half of a block (a
//! last block of 64 channels or fewer: one, its nibbles side by side).
//! Segments are then whole blocks of a head: whole-row or per-channel
//! groups, groups of whole heads, or groups of a multiple of
//! [`PLANE_BLOCK`] channels where the head dimension is one too.
//!
//! The integer sums are exact, and the float finishing is the same scalar
//! code on every instruction set, so AVX-512 VNNI (`vpdpbusd`), AVX2
//! (`vpmaddubsw`/`vpmaddwd`, for CPUs without VNNI) and the portable loop
//! give bit-identical scores. Everything else (narrow groups,
//! a non-finite query or scale) returns `false` and the exact f32 path
//! scores the tile.

use kv_quant::{LevelMap, LevelPacking, LevelRows};

use super::{HeadBlockPass, Prefetcher, TileGeometry, for_head_blocks};

/// Narrowest group along a row the integer path takes: narrower groups
/// leave too few values per scale for an integer dot product to pay.
pub(crate) const MIN_GROUP: usize = 16;

/// The level NF4 codes' integer images are centred on.
pub(crate) const NF4_MID: f32 = 128.0;

/// The integer image of one NF4 unit: `NF4_LEVELS[c] ≈ (NF4_IMAGE[c] −
/// NF4_MID) / NF4_UNIT`.
pub(crate) const NF4_UNIT: f32 = 127.0;

/// NF4 codes as unsigned integer levels, `128 + round(127·NF4_LEVELS[c])`
/// (1 to 255), so that NF4 keys and values take the integer paths as
/// centred levels with scale `a / 127`. Each level moves by at most
/// 0.0037 of its group's scale (the rounding to 1/127; `NF4_IMAGE_ERROR`
/// in the tests).
pub(crate) const NF4_IMAGE: [u8; 16] = nf4_image();

/// The largest `|NF4_LEVELS[c] − (NF4_IMAGE[c] − 128)/127|` (0.00367, code
/// 5), checked against the table in a unit test.
#[cfg(test)]
pub(crate) const NF4_IMAGE_ERROR: f64 = 0.0037;

/// [`NF4_IMAGE`], computed at compile time (`x + 0.5` truncated rounds the
/// positive `x` half up; no level is a tie).
const fn nf4_image() -> [u8; 16] {
    let mut image = [0u8; 16];
    let mut c = 0;
    while c < 16 {
        image[c] = (kv_quant::NF4_LEVELS[c] * NF4_UNIT + NF4_MID + 0.5) as u8;
        c += 1;
    }
    image
}

/// Per-thread buffers: query codes and scales, and the integer sums of one
/// block of heads.
#[derive(Clone, Debug, Default)]
pub(crate) struct IntScratch {
    /// `q_heads × d` int8 codes (the high halves of 16-bit codes when wide).
    codes: Vec<i8>,
    /// The low halves of 16-bit codes (wide codes only).
    codes_lo: Vec<i8>,
    /// Per head, `d` bytes: its int8 codes split for levels packed two
    /// per byte ([`split_planes`]).
    planes: Vec<i8>,
    /// Per head: the code scale `s_q`.
    scale: Vec<f32>,
    /// Per head: the offset term of per-channel groups.
    constant: Vec<f32>,
    /// Groups along rows: `Σ q` of the segment starting at channel `c` of
    /// head `h` at `q_sums[h·d + c]`, for the query the codes were made
    /// from and groups of `q_sums_cpg` channels (0: none computed).
    q_sums: Vec<f32>,
    q_sums_cpg: usize,
    /// `heads × rows` integer dot products of one segment (with the low
    /// halves' in `sums_lo` for wide codes).
    sums: Vec<i32>,
    sums_lo: Vec<i32>,
    /// The dot products of `sums` (and `sums_lo`) as f32.
    dots: Vec<f32>,
    /// Per row: the index of its first group.
    row_groups: Vec<usize>,
    /// Per row: the scale and the offset factor of the current segment.
    seg_a: Vec<f32>,
    seg_b: Vec<f32>,
    /// The group (within a row) `seg_a` and `seg_b` hold, in this tile.
    seg_group: Option<usize>,
    /// One head's query times its per-channel scales.
    folded: Vec<f32>,
    /// Per head: the class weights of class-scaled codes ([`classes`]).
    class_weights: Vec<[i16; 16]>,
    /// What `codes`, `scale` and `constant` were computed from: the
    /// query's address (the queries do not change within a block of work)
    /// and, for per-channel groups, a copy of the block's scales and
    /// offsets (compared by value, so tiles of any store are safe).
    coded_for: Option<usize>,
    coded_params: Vec<f32>,
}

impl IntScratch {
    /// Forgets the codes: called whenever the queries' buffer may have
    /// changed (at the start of each block of attention work), since the
    /// codes are keyed by the query's address.
    pub(crate) fn forget(&mut self) {
        self.coded_for = None;
        self.q_sums_cpg = 0;
    }

    /// Whether the codes were computed for `query` and the per-channel
    /// parameters `params` (empty for groups along rows); if not, records
    /// them for the codes about to be computed.
    /// Codes of one scale per channel class ([`classes`]) and of one per
    /// head are told apart by `classes`. Where no later run can hold the
    /// same parameters (`recurs` false: a run of a whole per-channel group,
    /// the only one of its group in a pass), nothing is compared or kept,
    /// and the codes about to be computed are not offered again (comparing
    /// and copying the group's parameters was 2% of a paged `int4-ch`
    /// decode in blocks of 64, `perf`).
    fn reuse(&mut self, query: &[f32], params: [&[f32]; 2], classes: bool, recurs: bool) -> bool {
        if !recurs {
            self.coded_for = None;
            return false;
        }
        // Queries are f32 (4-byte aligned): the low bit is free.
        let key = query.as_ptr() as usize | usize::from(classes);
        let n = params[0].len();
        // Bits compared by one OR of differences without an early exit,
        // which vectorises: tiles shorter than their per-channel group
        // compare every parameter (an early-exit loop ran scalar, a tenth
        // of a grouped decode in blocks of 16, `perf`).
        let same_params = self.coded_params.len() == 2 * n
            && params
                .iter()
                .zip(self.coded_params.chunks_exact(n.max(1)))
                .all(|(p, c)| {
                    p.iter()
                        .zip(c)
                        .fold(0u32, |diff, (a, b)| diff | (a.to_bits() ^ b.to_bits()))
                        == 0
                });
        let same = self.coded_for == Some(key) && same_params;
        if !same {
            self.coded_for = Some(key);
            self.coded_params.clear();
            self.coded_params.extend_from_slice(params[0]);
            self.coded_params.extend_from_slice(params[1]);
        }
        same
    }
}

/// Scores every query head of `q` (`q_heads × d`, already scaled) against
/// the key rows of `keys` into `weights[h·rows + t]`. Returns `false`,
/// leaving `weights` unspecified, when the layout or the numbers are not
/// for the integer path; the caller then scores the tile exactly.
#[allow(clippy::too_many_arguments)] // the tile, its scratch and its output
pub(crate) fn scores(
    q: &[f32],
    keys: &LevelRows<'_>,
    geometry: TileGeometry,
    codes: QueryCodes,
    dot: Dot,
    scratch: &mut IntScratch,
    weights: &mut [f32],
    prefetch: &mut Prefetcher,
) -> bool {
    let TileGeometry { group, kv_heads, d } = geometry;
    let (ch, heads) = (kv_heads * d, kv_heads * group);
    let rows = keys.rows();
    if keys.channels() != ch || q.len() != heads * d || weights.len() < heads * rows || rows == 0 {
        return false;
    }
    if !reads_packed(keys, geometry, codes) {
        return false;
    }
    scratch.codes.resize(heads * d, 0);
    scratch.codes_lo.resize(heads * d, 0);
    scratch.planes.resize(heads * d, 0);
    scratch.scale.resize(heads, 0.0);
    scratch.constant.resize(heads, 0.0);
    scratch.sums.resize(group.min(4) * rows, 0);
    scratch.sums_lo.resize(group.min(4) * rows, 0);
    scratch.dots.resize(group.min(4) * rows, 0.0);
    let (mid, image) = match keys.map {
        LevelMap::Affine => (None, None),
        LevelMap::Centered { mid } => (Some(mid), None),
        // NF4 codes read through their integer image, centred on 128, with
        // int8 query codes only: the image's rounding (1/254 of a group's
        // scale) is the size of an int8 query code's, and would swamp a
        // 16-bit one's.
        LevelMap::Nf4 if codes == QueryCodes::Int8 => (Some(NF4_MID), Some(&NF4_IMAGE)),
        // FP8 codes are not proportional to their values: scored exactly.
        // Lloyd-Max codebooks likewise.
        LevelMap::Nf4 | LevelMap::Fp8(_) | LevelMap::Codebook(_) => return false,
    };
    let ctx = Context {
        q,
        keys,
        geometry,
        codes,
        dot,
        mid,
        image,
    };
    match dot {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Dot::Vnni` is only that of a supported `Isa::Avx512Vnni`: AVX-512F/BW/VNNI.
        Dot::Vnni => unsafe { layouts_avx512(ctx, scratch, weights, prefetch) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Dot::Avx2` is only that of a supported `Isa` with AVX2.
        Dot::Avx2 => unsafe { layouts_avx2(ctx, scratch, weights, prefetch) },
        Dot::Portable => layouts(ctx, scratch, weights, prefetch),
    }
}

/// Whether [`scores`] can read `keys` as they are: one level per byte, or
/// packed two per byte with int8 codes and segments of whole blocks of the
/// split codes (whole-row, per-channel or whole-head groups, or groups of
/// a multiple of [`PLANE_BLOCK`] channels with a head dimension that is
/// one too: [`split_planes`] blocks start at a head's first channel);
/// other packed keys are scored once unpacked.
pub(crate) fn reads_packed(
    keys: &LevelRows<'_>,
    geometry: TileGeometry,
    codes: QueryCodes,
) -> bool {
    let (cpg, d) = (keys.channels_per_group(), geometry.d);
    keys.packing == LevelPacking::Bytes
        || (codes == QueryCodes::Int8
            && d % 2 == 0
            && (cpg == 1
                || cpg.is_multiple_of(d)
                || (cpg.is_multiple_of(PLANE_BLOCK) && d.is_multiple_of(PLANE_BLOCK))))
}

/// [`layouts`] compiled with AVX-512, so that the coding and finishing
/// loops run 16 wide (their float operations are the portable ones in the
/// same order, without contraction: the same bits).
///
/// # Safety
/// The CPU must have AVX-512F/BW/VNNI.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn layouts_avx512(
    ctx: Context<'_, '_>,
    scratch: &mut IntScratch,
    weights: &mut [f32],
    prefetch: &mut Prefetcher,
) -> bool {
    layouts(ctx, scratch, weights, prefetch)
}

/// [`layouts`] compiled with AVX2 (eight lanes; the same float operations
/// in the same order, so the same bits).
///
/// # Safety
/// The CPU must have AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn layouts_avx2(
    ctx: Context<'_, '_>,
    scratch: &mut IntScratch,
    weights: &mut [f32],
    prefetch: &mut Prefetcher,
) -> bool {
    layouts(ctx, scratch, weights, prefetch)
}

/// The tile by its key layout, inlined into each instruction set's entry.
#[inline(always)]
fn layouts(
    ctx: Context<'_, '_>,
    scratch: &mut IntScratch,
    weights: &mut [f32],
    prefetch: &mut Prefetcher,
) -> bool {
    let cpg = ctx.keys.channels_per_group();
    if cpg == 1 && ctx.image.is_none() {
        channels::per_channel(ctx, scratch, weights, prefetch)
    } else if cpg >= MIN_GROUP {
        along_rows(ctx, scratch, weights, prefetch)
    } else {
        false
    }
}

/// What both layouts work with.
#[derive(Clone, Copy)]
struct Context<'a, 'k> {
    q: &'a [f32],
    keys: &'a LevelRows<'k>,
    geometry: TileGeometry,
    codes: QueryCodes,
    dot: Dot,
    mid: Option<f32>,
    /// NF4 keys: the integer image each code is read through (the scales
    /// are then divided by [`NF4_UNIT`]).
    image: Option<&'static [u8; 16]>,
}

/// How finely the query is coded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum QueryCodes {
    /// int8 codes, `s = max|q| / 127`.
    Int8,
    /// 16-bit codes `256·hi + lo` with int8 halves, `s = max|q| / 32639`:
    /// two integer dot products per level, exact combination.
    Int16,
}

impl QueryCodes {
    /// The largest code magnitude.
    fn max(self) -> f32 {
        match self {
            Self::Int8 => 127.0,
            // (32639 + 128) >> 8 = 127: the high half stays an int8.
            Self::Int16 => 32639.0,
        }
    }
}

/// Groups along a row: one quantization of each head, then per segment
/// (a head's channels within one group) integer sums and their finishing.
#[inline(always)]
fn along_rows(
    ctx: Context<'_, '_>,
    scratch: &mut IntScratch,
    weights: &mut [f32],
    prefetch: &mut Prefetcher,
) -> bool {
    let (q, keys, d) = (ctx.q, ctx.keys, ctx.geometry.d);
    let rows = keys.rows();
    if !scratch.reuse(q, [&[], &[]], false, true) {
        for (h, q) in q.chunks_exact(d).enumerate() {
            let (hi, lo) = (
                &mut scratch.codes[h * d..][..d],
                &mut scratch.codes_lo[h * d..][..d],
            );
            let Some(s) = quantize(q, ctx.codes, hi, lo) else {
                scratch.coded_for = None;
                return false;
            };
            split_planes(hi, &mut scratch.planes[h * d..][..d]);
            scratch.scale[h] = s;
        }
        scratch.q_sums_cpg = 0;
    }
    let cpg = keys.channels_per_group();
    if scratch.q_sums_cpg != cpg {
        // `Σ q` per head and segment, once per query (not once per tile).
        let TileGeometry { group, d, .. } = ctx.geometry;
        scratch.q_sums.resize(q.len(), 0.0);
        for (h, qh) in q.chunks_exact(d).enumerate() {
            let first = h / group * d;
            let mut c = first;
            while c < first + d {
                let end = ((c / cpg + 1) * cpg).min(first + d);
                scratch.q_sums[h * d + (c - first)] = lane_sum(&qh[c - first..end - first], None);
                c = end;
            }
        }
        scratch.q_sums_cpg = cpg;
    }
    // Groups over several tokens: each row's first group, found once per
    // tile (per-token groups are read with a stride instead).
    scratch.row_groups.clear();
    if keys.tokens_per_group() != 1 {
        scratch
            .row_groups
            .extend((0..rows).map(|t| keys.group_index(t, 0)));
    }
    scratch.seg_a.resize(rows, 0.0);
    scratch.seg_b.resize(rows, 0.0);
    scratch.seg_group = None;
    let mut pass = RowSegments {
        ctx,
        scratch,
        weights,
        prefetch,
    };
    for_head_blocks(ctx.geometry, &mut pass);
    true
}

/// The segments of one head block against every row (groups along rows).
struct RowSegments<'a, 'k> {
    ctx: Context<'a, 'k>,
    scratch: &'a mut IntScratch,
    weights: &'a mut [f32],
    prefetch: &'a mut Prefetcher,
}

impl HeadBlockPass for RowSegments<'_, '_> {
    #[inline(always)]
    fn run<const H: usize>(&mut self, kvh: usize, h0: usize) {
        let Self {
            ctx,
            scratch,
            weights,
            prefetch,
        } = self;
        let (keys, mid) = (ctx.keys, ctx.mid);
        let d = ctx.geometry.d;
        let (rows, cpg, first) = (keys.rows(), keys.channels_per_group(), kvh * d);
        let mut c = first;
        let mut segment = 0;
        while c < first + d {
            let end = ((c / cpg + 1) * cpg).min(first + d);
            let block = DotBlock {
                levels: keys.levels,
                packed: keys.packing == LevelPacking::Nibbles,
                ch: keys.channels(),
                start: c,
                len: end - c,
                codes: &[],
                code_stride: d,
                heads: H,
                rows,
                image: ctx.image,
                lane_weights: None,
            };
            scratch.dot_products(*ctx, block, h0 * d, c - first, None, prefetch);
            // The segment's scale and offset term per row (centred levels:
            // `a·(l − mid) = a·l + (−mid·a)`).
            let (seg_a, seg_b) = (&mut scratch.seg_a[..rows], &mut scratch.seg_b[..rows]);
            let g = c / cpg;
            if scratch.seg_group == Some(g) {
                // Filled for an earlier KV head (whole-row groups: once a tile).
            } else if keys.tokens_per_group() == 1 {
                // Per-token groups: row `t`'s group here is `t·per_row + g`,
                // read with a stride (unit for whole-row groups, as `int4`'s),
                // without the layout's divisions or bounds checks per row.
                let per_row = keys.channels() / cpg;
                let params = |p| strided(p, g, per_row, rows);
                let pairs = seg_a.iter_mut().zip(seg_b.iter_mut());
                match (mid, ctx.image) {
                    (None, _) => pairs
                        .zip(params(keys.scale).zip(params(keys.offset)))
                        .for_each(|((a, b), (&s, &o))| (*a, *b) = (s, o)),
                    (Some(mid), None) => pairs
                        .zip(params(keys.scale))
                        .for_each(|((a, b), &s)| (*a, *b) = (s, -mid * s)),
                    (Some(mid), Some(_)) => {
                        pairs.zip(params(keys.scale)).for_each(|((a, b), &s)| {
                            let s = s / NF4_UNIT;
                            (*a, *b) = (s, -mid * s);
                        })
                    }
                }
            } else {
                for ((a, b), &g0) in seg_a
                    .iter_mut()
                    .zip(seg_b.iter_mut())
                    .zip(&scratch.row_groups)
                {
                    let gi = g0 + g;
                    let s = match ctx.image {
                        None => keys.scale[gi],
                        Some(_) => keys.scale[gi] / NF4_UNIT,
                    };
                    *a = s;
                    *b = match mid {
                        None => keys.offset[gi],
                        Some(mid) => -mid * s,
                    };
                }
            }
            scratch.seg_group = Some(g);
            for j in 0..H {
                let h = h0 + j;
                let q_sum = scratch.q_sums[h * d + (c - first)];
                let s_q = scratch.scale[h];
                let w = &mut weights[h * rows..][..rows];
                let params = (&*seg_a, &*seg_b, s_q, q_sum, segment == 0);
                match ctx.codes {
                    QueryCodes::Int8 => {
                        finish_segment(w, &scratch.sums[j * rows..][..rows], params)
                    }
                    QueryCodes::Int16 => {
                        finish_segment(w, &scratch.dots[j * rows..][..rows], params)
                    }
                }
            }
            segment += 1;
            c = end;
        }
    }
}

/// A dot product as the finishing reads it: an int8 code's exact i32 sum,
/// or a wide code's combined sum already rounded to f32.
trait DotValue: Copy {
    fn value(self) -> f32;
}

impl DotValue for i32 {
    #[inline(always)]
    fn value(self) -> f32 {
        self as f32
    }
}

impl DotValue for f32 {
    #[inline(always)]
    fn value(self) -> f32 {
        self
    }
}

/// One head's scores of a segment (groups along rows): `w_t (+)= a_t·(s_q·dot_t)
/// + b_t·Σq`, assigned for the first segment and added after.
#[inline(always)]
fn finish_segment<T: DotValue>(
    w: &mut [f32],
    dots: &[T],
    (seg_a, seg_b, s_q, q_sum, first): (&[f32], &[f32], f32, f32, bool),
) {
    let terms = dots.iter().zip(seg_a.iter().zip(seg_b));
    let term = |(&dot, (&a, &b)): (&T, (&f32, &f32))| a * (s_q * dot.value()) + b * q_sum;
    if first {
        w.iter_mut().zip(terms).for_each(|(w, x)| *w = term(x));
    } else {
        w.iter_mut().zip(terms).for_each(|(w, x)| *w += term(x));
    }
}

/// `n` values of `p` from `first` on, `stride` apart (`n >= 1`; panics
/// past the end, as indexing would).
fn strided(
    p: &[f32],
    first: usize,
    stride: usize,
    n: usize,
) -> std::iter::StepBy<std::slice::Iter<'_, f32>> {
    p[first..(n - 1) * stride + first + 1]
        .iter()
        .step_by(stride)
}

impl IntScratch {
    /// The dot products of `block` with the query codes of its heads, the
    /// first head's codes at `head_start` (head `j` at `head_start +
    /// j·block.code_stride`) and the segment at channel `offset` of the
    /// head, weighted by the class weights of heads from `weights` on
    /// where given (packed levels, int8 codes): int8 codes' in `self.sums[..heads·rows]`, wide codes' as f32
    /// in `self.dots[..heads·rows]`, their halves combined exactly
    /// (`256·hi + lo` in i64) before the one rounding to f32. Packed levels
    /// read the split codes.
    fn dot_products(
        &mut self,
        ctx: Context<'_, '_>,
        block: DotBlock<'_>,
        head_start: usize,
        offset: usize,
        weights: Option<usize>,
        prefetch: &mut Prefetcher,
    ) {
        let n = block.heads * block.rows;
        let code_start = head_start + offset;
        let hi = if block.packed {
            // Segments are whole blocks: the split codes start at `offset` too.
            DotBlock {
                codes: &self.planes[code_start..],
                lane_weights: weights.map(|h| &self.class_weights[h..]),
                ..block
            }
        } else {
            DotBlock {
                codes: &self.codes[code_start..],
                ..block
            }
        };
        integer_sums(ctx.dot, hi, &mut self.sums[..n], prefetch);
        if ctx.codes == QueryCodes::Int16 {
            let lo = DotBlock {
                codes: &self.codes_lo[code_start..],
                ..block
            };
            integer_sums(ctx.dot, lo, &mut self.sums_lo[..n], prefetch);
            let halves = self.sums[..n].iter().zip(&self.sums_lo[..n]);
            for (d, (&hi, &lo)) in self.dots[..n].iter_mut().zip(halves) {
                *d = (256 * i64::from(hi) + i64::from(lo)) as f32;
            }
        }
    }
}

/// Quantizes `x` to codes `round(x / s)` (ties to even) with
/// `s = max|x| / codes.max()` and returns `s`; `None` when `x` is not
/// finite. Int8 codes go to `hi`; 16-bit codes `c` are split into
/// `c = 256·hi + lo` with both halves int8. Written as lane loops the
/// compiler vectorizes.
#[inline(always)]
fn quantize(x: &[f32], codes: QueryCodes, hi: &mut [i8], lo: &mut [i8]) -> Option<f32> {
    let non_finite = x.iter().fold(false, |bad, v| bad | !v.is_finite());
    if non_finite {
        return None;
    }
    // Whole chunks first, so the lanes stay in registers (a partial chunk
    // in the loop made the compiler keep them in memory, behind masked
    // stores: a third of the per-channel fold's time, `perf`).
    let mut lanes = [0.0f32; 16];
    let (whole, rest) = x.as_chunks::<16>();
    for chunk in whole {
        for (l, &v) in lanes.iter_mut().zip(chunk) {
            let a = v.abs();
            *l = if a > *l { a } else { *l };
        }
    }
    for (l, &v) in lanes.iter_mut().zip(rest) {
        let a = v.abs();
        *l = if a > *l { a } else { *l };
    }
    let peak = lanes.iter().fold(0.0f32, |m, &l| if l > m { l } else { m });
    if peak == 0.0 {
        hi.fill(0);
        lo.fill(0);
        return Some(0.0);
    }
    let max = codes.max();
    let inv = max / peak;
    // Adding 1.5·2^23 rounds |y| < 2^22 to the nearest integer, ties to
    // even, and leaves it in the low bits of the sum: no call to `roundf`
    // and no saturating conversion, so the loop vectorises (the float to
    // integer conversion was scalar, a third of the per-channel fold's
    // time). `max` is an integer, so clamping before rounding gives the
    // codes clamping after it gave.
    const ROUND: f32 = 12_582_912.0;
    let code = |v: f32| {
        let y = (v * inv).clamp(-max, max);
        ((y + ROUND).to_bits() as i32).wrapping_sub(ROUND.to_bits() as i32)
    };
    match codes {
        QueryCodes::Int8 => {
            for (h, &v) in hi.iter_mut().zip(x) {
                *h = code(v) as i8;
            }
        }
        QueryCodes::Int16 => {
            for ((h, l), &v) in hi.iter_mut().zip(lo.iter_mut()).zip(x) {
                let c = code(v);
                let high = (c + 128) >> 8;
                *h = high as i8;
                *l = (c - 256 * high) as i8;
            }
        }
    }
    Some(peak / max)
}

/// `Σ x_c·y_c` (or `Σ x_c` with `y` = `None`) in 16 lanes with a fixed
/// order, so the compiler vectorizes it and every ISA gets the same bits
/// (inlined, so that it is compiled for the caller's instruction set: a
/// call compiled for the baseline one was 4% of a per-channel decode).
#[inline(always)]
fn lane_sum(x: &[f32], y: Option<&[f32]>) -> f32 {
    // Whole chunks, then the rest into the first lanes: the lanes a
    // chunked loop would give them, kept in registers.
    let mut lanes = [0.0f32; 16];
    let (xs, x_rest) = x.as_chunks::<16>();
    match y {
        None => {
            for chunk in xs {
                for (l, &v) in lanes.iter_mut().zip(chunk) {
                    *l += v;
                }
            }
            for (l, &v) in lanes.iter_mut().zip(x_rest) {
                *l += v;
            }
        }
        Some(y) => {
            let (ys, y_rest) = y[..x.len()].as_chunks::<16>();
            for (cx, cy) in xs.iter().zip(ys) {
                for ((l, &a), &b) in lanes.iter_mut().zip(cx).zip(cy) {
                    *l += a * b;
                }
            }
            for ((l, &a), &b) in lanes.iter_mut().zip(x_rest).zip(y_rest) {
                *l += a * b;
            }
        }
    }
    lanes.iter().sum()
}

/// Integer dot products of `heads` query code rows against `rows` level rows.
#[derive(Clone, Copy)]
pub(crate) struct DotBlock<'a> {
    /// Level rows of `ch` levels: `ch` bytes each, or `ch / 2` with `packed`.
    pub(crate) levels: &'a [u8],
    /// Two levels per byte, the even channel's in the low nibble.
    pub(crate) packed: bool,
    pub(crate) ch: usize,
    /// First channel of the segment within a level row (even when packed).
    pub(crate) start: usize,
    /// Channels in the segment (even when packed).
    pub(crate) len: usize,
    /// Head `j`'s codes of the segment start at `codes[j·code_stride]`;
    /// when packed, split block by block ([`split_planes`], the segment
    /// starting a block).
    pub(crate) codes: &'a [i8],
    pub(crate) code_stride: usize,
    pub(crate) heads: usize,
    pub(crate) rows: usize,
    /// Levels read through this table first (NF4 codes: [`NF4_IMAGE`]).
    pub(crate) image: Option<&'static [u8; 16]>,
    /// Packed levels only, no image: head `j`'s products of channel `c`
    /// weighted by `lane_weights[j][2·class_of(c)]` (each class's weight
    /// twice, as `vpmaddwd` reads it; [`classes`]).
    pub(crate) lane_weights: Option<&'a [[i16; 16]]>,
}

/// `out[j·rows + t] = Σ_c level(t, start + c) · code(j, c)`, with
/// `code(j, c) = codes[j·code_stride + c]`, or for packed levels
/// `codes[j·code_stride + plane_index(c, len)]`; each product times its
/// class's weight where `lane_weights` are given.
pub(crate) fn integer_sums(dot: Dot, b: DotBlock<'_>, out: &mut [i32], prefetch: &mut Prefetcher) {
    let row_bytes = if b.packed { b.ch / 2 } else { b.ch };
    assert!(b.lane_weights.is_none_or(|w| {
        b.packed
            && b.image.is_none()
            && w.len() >= b.heads
            && classes::weights_fit(&w[..b.heads], b.len)
    }));
    assert!(
        b.heads >= 1
            && b.heads <= 4
            && b.start + b.len <= b.ch
            && (!b.packed
                || (b.ch.is_multiple_of(2)
                    && b.start.is_multiple_of(2)
                    && b.len.is_multiple_of(2)))
            && b.levels.len() >= b.rows * row_bytes
            && b.codes.len() >= (b.heads - 1) * b.code_stride + b.len
            && out.len() >= b.heads * b.rows
    );
    match dot {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Dot::Vnni` is only that of a supported `Isa::Avx512Vnni`:
        // AVX-512F/BW/VL/VNNI; the bounds were checked above.
        Dot::Vnni => unsafe { vnni::integer_sums(b, out, prefetch) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Dot::Avx2` is only that of a supported `Isa` with AVX2; the bounds were
        // checked above.
        Dot::Avx2 => unsafe { avx2::integer_sums(b, out, prefetch) },
        Dot::Portable => portable_sums(b, out, prefetch),
    }
}

/// The reference loop: exact i32 sums.
fn portable_sums(b: DotBlock<'_>, out: &mut [i32], prefetch: &mut Prefetcher) {
    for t in 0..b.rows {
        if t % 4 == 0 {
            prefetch.step();
        }
        let level = |c: usize| {
            let l = if b.packed {
                let byte = b.levels[t * b.ch / 2 + (b.start + c) / 2];
                (byte >> (4 * (c % 2))) & 15
            } else {
                b.levels[t * b.ch + b.start + c]
            };
            match b.image {
                None => l,
                Some(image) => image[usize::from(l & 15)],
            }
        };
        for j in 0..b.heads {
            let codes = &b.codes[j * b.code_stride..];
            let code = |c: usize| match b.packed {
                false => codes[c],
                true => codes[plane_index(c, b.len)],
            };
            let weight = |c: usize| {
                b.lane_weights
                    .map_or(1, |w| i32::from(w[j][2 * classes::class_of(c)]))
            };
            out[j * b.rows + t] = (0..b.len)
                .map(|c| i32::from(level(c)) * i32::from(code(c)) * weight(c))
                .sum();
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2;
mod channels;
mod classes;
mod dot;
mod fold;
mod planes;
#[cfg(target_arch = "x86_64")]
mod vnni;

pub(crate) use dot::Dot;
pub(crate) use planes::{PLANE_BLOCK, plane_index, split_planes};

#[cfg(test)]
mod tests;
