//! Weighted value sums against integer values with integer dot products
//! ([`Numerics::Int8Query`](crate::Numerics::Int8Query)): the value pass's
//! counterpart of the integer scores in [`int8_query`](super::int8_query).
//!
//! A value is `b + a·l` (affine levels) or `a·(l − mid)` (centred levels)
//! with the group's scale `a` and offset `b`, so a head's weighted sum over
//! one group's channels splits into
//! `Σ_t w_t·a_t·l_tc + Σ_t w_t·b_t`. The first term is the integer part:
//! per head and segment (a head's channels within one group) the products
//! `x_t = w_t·a_t` are coded to 16 bits, `x̂_t = round(x_t / S)` with
//! `S = max_t x_t / Q`, and `Σ_t x̂_t·l_tc` is an exact i32 sum, two rows per
//! AVX-512 VNNI `vpdpwssd` (AVX2 `vpmaddwd` without VNNI, or a portable
//! loop: the same sums). The
//! coding, the second term and the finishing `S·Σ + B` are the same
//! operations in the same order on every instruction set (16 fixed lanes,
//! no contraction), so both give the same bits.
//!
//! The bound: each coded product is off by at most `S/2`, so a tile's sum
//! for channel `c` moves by at most `(S/2)·Σ_t l_tc` before the softmax
//! normalisation (with weights `w ≤ 1`, at most `R·max(a·l)/(2Q)` for `R`
//! rows). `Q` is 32,767, or less where `R` rows of the largest level could
//! overflow an i32.
//!
//! Taken for per-token groups of a multiple of 16 channels (the integer
//! forms, clean protected tiles included, and NF4 through its integer
//! image [`NF4_IMAGE`](super::int8_query::NF4_IMAGE), as centred levels of
//! scale `a/127`) with head dimensions a multiple of 16; everything else, and a non-finite weight or scale, returns
//! `false` and the f32 value pass runs. 4-bit levels packed two per byte
//! ([`LevelPacking::Nibbles`]) are summed without being unpacked to
//! memory, in segments of a multiple of 32 channels: a pair of rows' bytes
//! interleaved give, from their low and high nibbles, the 16-bit pairs of
//! 16 even and 16 odd channels.

use kv_quant::{LevelMap, LevelPacking, LevelRows};

use super::int8_query::{Dot, NF4_IMAGE, NF4_MID, NF4_UNIT};
use super::{HeadBlockPass, Prefetcher, TileGeometry, for_head_blocks};

/// The largest weight code.
const CODE_MAX: i64 = 32_767;

/// The smallest code range worth taking (very long tiles of 8-bit levels
/// would leave fewer codes than this to stay inside an i32).
const CODE_MIN: i64 = 1_024;

/// Per-thread buffers of one tile's value pass.
#[derive(Clone, Debug, Default)]
pub(crate) struct ValueScratch {
    /// Per head: the segment's weight codes, one per row and zeros past
    /// the rows (a stride of whole lanes), so that rows `2p` and `2p + 1`
    /// read as one little-endian 32-bit pair.
    codes: Vec<u16>,
    /// Per head: the segment's integer sums, one per channel.
    sums: Vec<i32>,
    /// Per head: the code scale `S` and the offset term `B`.
    scale: Vec<f64>,
    offset: Vec<f64>,
    /// Per group of a row: its scale and offset factor in every row.
    seg_a: Vec<f32>,
    seg_b: Vec<f32>,
    /// Per head: its weights.
    w: Vec<f32>,
    /// Per-channel groups: the tile's runs of rows sharing a block of
    /// tokens (first row, end, index of the block's first group).
    runs: Vec<(usize, usize, usize)>,
    /// Per-channel groups: each head's sums over the runs so far.
    wide: Vec<f32>,
}

/// Whether the integer value pass takes value rows `levels` of a tile of
/// `geometry`: per-token groups of a multiple of 16 channels, integer
/// levels, and head dimensions a multiple of 16 (both of 32 for levels
/// packed two per byte); or per-channel groups over blocks of tokens
/// ([`channels`]).
pub(crate) fn takes(levels: &LevelRows<'_>, geometry: TileGeometry) -> bool {
    let packed = levels.packing == LevelPacking::Nibbles;
    if channels::takes(levels, geometry) {
        return true;
    }
    levels.tokens_per_group() == 1
        && (!packed
            || (levels.channels_per_group().is_multiple_of(32) && geometry.d.is_multiple_of(32)))
        && levels.channels_per_group().is_multiple_of(16)
        && geometry.d.is_multiple_of(16)
        && levels.channels() == geometry.kv_heads * geometry.d
        && matches!(
            levels.map,
            LevelMap::Affine | LevelMap::Centered { .. } | LevelMap::Nf4
        )
}

/// Writes `acc[h·d + c] = Σ_t weights[h·rows + t]·v_t[kvh(h)·d + c]` for every
/// query head, with the integer part coded as the module says. Returns
/// `false`, leaving `acc` unspecified, for layouts [`takes`] refuses and for
/// non-finite weights or scales.
pub(crate) fn weighted_sums(
    levels: &LevelRows<'_>,
    geometry: TileGeometry,
    weights: &[f32],
    acc: &mut [f32],
    dot: Dot,
    scratch: &mut ValueScratch,
    prefetch: &mut Prefetcher,
) -> bool {
    match dot {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Dot::Vnni` is only that of a supported `Isa::Avx512Vnni`: AVX-512F/BW/VNNI.
        Dot::Vnni => unsafe {
            weighted_sums_avx512(levels, geometry, weights, acc, scratch, prefetch)
        },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Dot::Avx2` is only that of a supported `Isa` with AVX2.
        Dot::Avx2 => unsafe {
            weighted_sums_avx2(levels, geometry, weights, acc, scratch, prefetch)
        },
        Dot::Portable => weighted_sums_with(levels, geometry, weights, acc, dot, scratch, prefetch),
    }
}

/// [`weighted_sums`] compiled with AVX2 (the same float operations in the
/// same order, so the same bits).
///
/// # Safety
/// The CPU must have AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn weighted_sums_avx2(
    levels: &LevelRows<'_>,
    geometry: TileGeometry,
    weights: &[f32],
    acc: &mut [f32],
    scratch: &mut ValueScratch,
    prefetch: &mut Prefetcher,
) -> bool {
    weighted_sums_with(levels, geometry, weights, acc, Dot::Avx2, scratch, prefetch)
}

/// [`weighted_sums`] compiled with AVX-512, so that the weight coding's
/// lane loops run 16 wide. The float operations are the portable ones in
/// the same order (no contraction), so the results are the same bits.
///
/// # Safety
/// The CPU must have AVX-512F/BW/VNNI.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn weighted_sums_avx512(
    levels: &LevelRows<'_>,
    geometry: TileGeometry,
    weights: &[f32],
    acc: &mut [f32],
    scratch: &mut ValueScratch,
    prefetch: &mut Prefetcher,
) -> bool {
    weighted_sums_with(levels, geometry, weights, acc, Dot::Vnni, scratch, prefetch)
}

/// The body of [`weighted_sums`], inlined into each instruction set's entry.
#[inline(always)]
fn weighted_sums_with(
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
    if !takes(levels, geometry)
        || rows == 0
        || weights.len() < heads * rows
        || acc.len() < heads * geometry.d
    {
        return false;
    }
    if channels::takes(levels, geometry) {
        return channels::weighted_sums(levels, geometry, weights, acc, dot, scratch, prefetch);
    }
    // NF4 codes are read through their integer image (centred levels of
    // scale `a / 127`).
    let image = (levels.map == LevelMap::Nf4).then_some(&NF4_IMAGE);
    let max_level = if image.is_some() {
        u8::MAX
    } else {
        levels.max_level().max(1)
    };
    // R rows of the largest level times the largest code stay inside an i32.
    let per_code = rows.next_multiple_of(2) as i64 * i64::from(max_level);
    let code_max = CODE_MAX.min(i64::from(i32::MAX) / per_code);
    if code_max < CODE_MIN {
        return false;
    }
    // Rows padded to whole lanes with zero weights, scales and offsets
    // (which change no sum), every group's parameters contiguous over the
    // rows, and every head's weights contiguous: the coding then runs over
    // whole 16-lane chunks.
    let stride = rows.next_multiple_of(LANES);
    let per_row = levels.channels() / levels.channels_per_group();
    let s = &mut *scratch;
    // Every row is written below and only the padding zeroed (clearing
    // whole buffers first wrote every row twice).
    for buffer in [&mut s.seg_a, &mut s.seg_b] {
        buffer.resize(per_row * stride, 0.0);
        for group in buffer.chunks_exact_mut(stride) {
            group[rows..].fill(0.0);
        }
    }
    for t in 0..rows {
        for g in 0..per_row {
            let a = levels.scale[t * per_row + g];
            let (a, b) = match levels.map {
                LevelMap::Centered { mid } => (a, -mid * a),
                LevelMap::Nf4 => {
                    let a = a / NF4_UNIT;
                    (a, -NF4_MID * a)
                }
                _ => (a, levels.offset[t * per_row + g]),
            };
            s.seg_a[g * stride + t] = a;
            s.seg_b[g * stride + t] = b;
        }
    }
    s.w.resize(heads * stride, 0.0);
    for (padded, w) in s.w.chunks_exact_mut(stride).zip(weights.chunks_exact(rows)) {
        padded[..rows].copy_from_slice(w);
        padded[rows..].fill(0.0);
    }
    let mut pass = Segments {
        levels,
        image,
        acc,
        dot,
        code_max: code_max as f32,
        d: geometry.d,
        rows,
        stride,
        scratch,
        prefetch,
        ok: true,
    };
    for_head_blocks(geometry, &mut pass);
    pass.ok
}

/// The segments of each head block.
struct Segments<'a, 'k> {
    levels: &'a LevelRows<'k>,
    /// NF4 values: the integer image their codes are read through.
    image: Option<&'static [u8; 16]>,
    acc: &'a mut [f32],
    dot: Dot,
    code_max: f32,
    d: usize,
    rows: usize,
    /// Rows padded to whole lanes.
    stride: usize,
    scratch: &'a mut ValueScratch,
    /// Stepped every four rows of each run of 64 channels.
    prefetch: &'a mut Prefetcher,
    /// Cleared by a non-finite weight or scale.
    ok: bool,
}

impl HeadBlockPass for Segments<'_, '_> {
    #[inline(always)]
    fn run<const H: usize>(&mut self, kvh: usize, h0: usize) {
        if !self.ok {
            return;
        }
        let (levels, d, rows, stride) = (self.levels, self.d, self.rows, self.stride);
        let (ch, cpg) = (levels.channels(), levels.channels_per_group());
        let s = &mut *self.scratch;
        s.codes.resize(H * stride, 0);
        s.scale.resize(H, 0.0);
        s.offset.resize(H, 0.0);
        let first = kvh * d;
        let mut c = first;
        while c < first + d {
            let end = ((c / cpg + 1) * cpg).min(first + d);
            let g = c / cpg;
            let (a, b) = (
                &s.seg_a[g * stride..][..stride],
                &s.seg_b[g * stride..][..stride],
            );
            for j in 0..H {
                let w = &s.w[(h0 + j) * stride..][..stride];
                let code = &mut s.codes[j * stride..][..stride];
                let coded = code_weights(w, a, b, self.code_max, self.dot, code);
                let Some((scale, offset)) = coded else {
                    self.ok = false;
                    return;
                };
                s.scale[j] = scale;
                s.offset[j] = offset;
            }
            let len = end - c;
            s.sums.resize(H * len, 0);
            let block = SumBlock {
                levels: levels.levels,
                packed: levels.packing == LevelPacking::Nibbles,
                ch,
                start: c,
                in_head: c - first,
                len,
                rows,
                codes: &s.codes[..H * stride],
                stride,
                image: self.image,
            };
            integer_sums::<H>(self.dot, block, &mut s.sums[..H * len], self.prefetch);
            for j in 0..H {
                let out = &mut self.acc[(h0 + j) * d + (c - first)..][..len];
                let (scale, offset) = (s.scale[j], s.offset[j]);
                for (o, &sum) in out.iter_mut().zip(&s.sums[j * len..][..len]) {
                    *o = (scale * f64::from(sum) + offset) as f32;
                }
            }
            c = end;
        }
    }
}

/// Lanes of the coding loops (fixed, so every instruction set computes the
/// same sums in the same order).
const LANES: usize = 16;

/// `v` as whole lanes (a trailing partial lane is not read).
#[inline(always)]
fn chunks(v: &[f32]) -> &[[f32; LANES]] {
    v.as_chunks::<LANES>().0
}

/// Codes one head's weights `w` times the segment's scales `a` into
/// `codes`, returning the code scale `S` and the offset term
/// `B = Σ_t w_t·b_t`; `None` for a non-finite or negative product, a
/// non-finite offset factor, or products too small to scale.
/// All slices hold the rows padded to whole lanes (zeros past the rows).
/// This runs once per head, segment and row, as often as the integer sums'
/// inner loop, so it is written as whole-lane loops the compiler vectorises.
#[inline(always)]
fn code_weights(
    w: &[f32],
    a: &[f32],
    b: &[f32],
    code_max: f32,
    dot: Dot,
    codes: &mut [u16],
) -> Option<(f64, f64)> {
    // `x·0` is ±0 for finite `x` and NaN for ±∞ and NaN: `probe` stays 0
    // exactly when every product and offset factor is finite.
    let mut probe = [0.0f32; LANES];
    let mut largest = [0.0f32; LANES];
    let mut smallest = [0.0f32; LANES];
    let mut offset = [0.0f32; LANES];
    for ((w, a), b) in chunks(w).iter().zip(chunks(a)).zip(chunks(b)) {
        for i in 0..LANES {
            let x = w[i] * a[i];
            probe[i] += x * 0.0 + b[i] * 0.0;
            largest[i] = if x > largest[i] { x } else { largest[i] };
            smallest[i] = if x < smallest[i] { x } else { smallest[i] };
            offset[i] += w[i] * b[i];
        }
    }
    let finite = probe.iter().all(|&p| p == 0.0);
    // A negative product (a scale that is not a writer's: unprotected
    // metadata under faults) is outside the codes' range.
    let negative = smallest.iter().any(|&x| x < 0.0);
    let largest = largest
        .iter()
        .fold(0.0f32, |m, &v| if v > m { v } else { m });
    let offset: f64 = offset.iter().map(|&o| f64::from(o)).sum();
    if !finite || negative || !offset.is_finite() {
        return None;
    }
    let (scale, inv) = if largest > 0.0 {
        (largest / code_max, code_max / largest)
    } else {
        (0.0, 0.0)
    };
    // Products below about 1e-34 would scale to infinity (and a zero
    // product to NaN): left to the f32 pass.
    if !inv.is_finite() {
        return None;
    }
    match dot {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Dot::Vnni` is only that of a supported `Isa::Avx512Vnni`: AVX-512F/BW.
        Dot::Vnni => unsafe { vnni::round_codes(w, a, inv, code_max, codes) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Dot::Avx2` is only that of a supported `Isa` with AVX2.
        Dot::Avx2 => unsafe { avx2::round_codes(w, a, inv, code_max, codes) },
        Dot::Portable => round_codes(w, a, inv, code_max, codes),
    }
    Some((f64::from(scale), offset))
}

/// `codes[t] = min(w_t·a_t·inv + 0.5, code_max)` truncated, for products in
/// `0..=code_max / inv` (finite): whole lanes of the padded rows.
fn round_codes(w: &[f32], a: &[f32], inv: f32, code_max: f32, codes: &mut [u16]) {
    let out = codes.as_chunks_mut::<LANES>().0;
    for ((c, w), a) in out.iter_mut().zip(chunks(w)).zip(chunks(a)) {
        for i in 0..LANES {
            let r = w[i] * a[i] * inv + 0.5;
            let rounded = if r < code_max { r } else { code_max };
            // In `0.5..=code_max`: the conversion truncates exactly.
            c[i] = rounded as u16;
        }
    }
}

/// One segment's levels and the weight codes of its heads.
#[derive(Clone, Copy)]
struct SumBlock<'a> {
    /// The tile's levels, `rows × ch`, one per byte or two (`packed`).
    levels: &'a [u8],
    packed: bool,
    ch: usize,
    /// The segment's channels `start..start + len` (`len` a multiple of 16,
    /// and `start` and `len` of 32 when packed).
    start: usize,
    len: usize,
    /// `start` counted from its head's first channel: the kernels step the
    /// prefetcher every four rows at each multiple of 64 channels of the
    /// head ([`value_steps`](super::value_steps)' unit).
    in_head: usize,
    rows: usize,
    /// `H × stride` weight codes (the last head's only up to its
    /// `2·rows.div_ceil(2)`: the rows' pairs are all that is read).
    codes: &'a [u16],
    /// Codes per head (`2·rows.div_ceil(2)` or more).
    stride: usize,
    /// Levels read through this table first (NF4 codes, below 16).
    image: Option<&'static [u8; 16]>,
}

/// `out[j·len + c] = Σ_t code_j(t)·levels[t][start + c]` for `H` heads.
fn integer_sums<const H: usize>(
    dot: Dot,
    b: SumBlock<'_>,
    out: &mut [i32],
    prefetch: &mut Prefetcher,
) {
    let pairs = b.rows.div_ceil(2);
    let row_bytes = if b.packed { b.ch / 2 } else { b.ch };
    assert!(
        b.len.is_multiple_of(16)
            && (!b.packed
                || (b.len.is_multiple_of(32)
                    && b.start.is_multiple_of(32)
                    && b.ch.is_multiple_of(2)))
            && b.start + b.len <= b.ch
            && b.levels.len() >= b.rows * row_bytes
            && b.stride >= 2 * pairs
            && b.codes.len() >= (H - 1) * b.stride + 2 * pairs
            && out.len() >= H * b.len
    );
    match dot {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Dot::Vnni` is only that of a supported `Isa::Avx512Vnni`: AVX-512F/BW/VNNI; the
        // bounds were checked above.
        Dot::Vnni => unsafe { vnni::sums::<H>(b, out, prefetch) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Dot::Avx2` is only that of a supported `Isa` with AVX2; the bounds were
        // checked above.
        Dot::Avx2 => unsafe { avx2::sums::<H>(b, out, prefetch) },
        Dot::Portable => portable_sums::<H>(b, out, prefetch),
    }
}

/// The reference loop: exact i32 sums.
fn portable_sums<const H: usize>(b: SumBlock<'_>, out: &mut [i32], prefetch: &mut Prefetcher) {
    out[..H * b.len].fill(0);
    for t in 0..b.rows {
        if t % 4 == 0 {
            // One step per multiple of 64 channels of the head in the
            // segment, as the vector paths take them.
            for _ in b.in_head.div_ceil(64)..(b.in_head + b.len).div_ceil(64) {
                prefetch.step();
            }
        }
        let level = |c: usize| {
            let l = if b.packed {
                (b.levels[t * b.ch / 2 + (b.start + c) / 2] >> (4 * (c % 2))) & 15
            } else {
                b.levels[t * b.ch + b.start + c]
            };
            b.image.map_or(l, |m| m[usize::from(l & 15)])
        };
        for j in 0..H {
            let code = i32::from(b.codes[j * b.stride + t]);
            let sums = &mut out[j * b.len..][..b.len];
            for (c, s) in sums.iter_mut().enumerate() {
                *s += code * i32::from(level(c));
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod vnni {
    //! `vpdpwssd` on two rows of 16 channels at a time: the rows' levels
    //! interleaved into 16-bit pairs, each head's two weight codes
    //! broadcast as one 32-bit pair.

    use std::arch::x86_64::*;

    use super::{Prefetcher, SumBlock};

    /// [`super::round_codes`] sixteen lanes at a time, with the same
    /// operations in the same order (products, scaling, `+ 0.5`, `vminps`,
    /// truncation), so the same codes.
    ///
    /// # Safety
    /// The CPU must have AVX-512F/BW; the slices hold whole lanes.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) unsafe fn round_codes(
        w: &[f32],
        a: &[f32],
        inv: f32,
        code_max: f32,
        codes: &mut [u16],
    ) {
        let out = codes.as_chunks_mut::<{ super::LANES }>().0;
        let (inv, half, top) = (
            _mm512_set1_ps(inv),
            _mm512_set1_ps(0.5),
            _mm512_set1_ps(code_max),
        );
        for ((c, w), a) in out.iter_mut().zip(super::chunks(w)).zip(super::chunks(a)) {
            // SAFETY: each chunk holds 16 floats or 16 codes; unaligned access.
            unsafe {
                let x = _mm512_mul_ps(_mm512_loadu_ps(w.as_ptr()), _mm512_loadu_ps(a.as_ptr()));
                let r = _mm512_add_ps(_mm512_mul_ps(x, inv), half);
                let codes = _mm512_cvtepi32_epi16(_mm512_cvttps_epi32(_mm512_min_ps(r, top)));
                _mm256_storeu_si256(c.as_mut_ptr().cast(), codes);
            }
        }
    }

    /// [`super::integer_sums`] with AVX-512 VNNI.
    ///
    /// # Safety
    /// The CPU must have AVX-512F/BW/VNNI, and `b`'s bounds must hold as
    /// [`super::integer_sums`] checks them.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub(super) unsafe fn sums<const H: usize>(
        b: SumBlock<'_>,
        out: &mut [i32],
        prefetch: &mut Prefetcher,
    ) {
        match (b.packed, b.image.is_some()) {
            (false, true) => segment::<H, true>(b, out, prefetch),
            (false, false) => segment::<H, false>(b, out, prefetch),
            (true, true) => nibble_segment::<H, true>(b, out, prefetch),
            (true, false) => nibble_segment::<H, false>(b, out, prefetch),
        }
    }

    /// A segment of packed levels in blocks of 64 and 32 channels.
    #[inline(always)]
    fn nibble_segment<const H: usize, const IMAGE: bool>(
        b: SumBlock<'_>,
        out: &mut [i32],
        prefetch: &mut Prefetcher,
    ) {
        let mut c = 0;
        while c + 64 <= b.len {
            nibble_block::<H, 2, IMAGE>(b, c, out, prefetch);
            c += 64;
        }
        if c + 32 <= b.len {
            nibble_block::<H, 1, IMAGE>(b, c, out, prefetch);
        }
    }

    /// Channels `c..c + 32K` of a packed segment, every row, `H` heads.
    /// Per pair of rows and 32 channels, the rows' 16 bytes interleaved
    /// (row `t`'s byte, then row `t + 1`'s) hold in their low nibbles the
    /// 16-bit pairs of the even channels and in their high nibbles those
    /// of the odd ones: accumulators `2k` and `2k + 1` of each head.
    #[inline(always)]
    fn nibble_block<const H: usize, const K: usize, const IMAGE: bool>(
        b: SumBlock<'_>,
        c: usize,
        out: &mut [i32],
        prefetch: &mut Prefetcher,
    ) {
        let pairs = b.rows.div_ceil(2);
        let steps = (b.in_head + c).is_multiple_of(64);
        let row_bytes = b.ch / 2;
        // SAFETY: only inlined into `sums` (AVX-512F/BW/VNNI). Every byte
        // read is in row `t < rows` at byte `(start + c) / 2 + 16k + 15 <
        // (start + len) / 2 <= ch / 2`; every pair of codes read is below
        // `(H − 1)·stride + 2·pairs`; every store is below `H·len`.
        unsafe {
            let image = match b.image {
                Some(m) if IMAGE => _mm256_broadcastsi128_si256(_mm_loadu_si128(m.as_ptr().cast())),
                _ => _mm256_setzero_si256(),
            };
            let nibble = _mm256_set1_epi8(0x0F);
            let mut acc = [[[_mm512_setzero_si512(); 2]; K]; H];
            let at = |t: usize, k: usize| {
                b.levels
                    .as_ptr()
                    .add(t * row_bytes + (b.start + c) / 2 + 16 * k)
            };
            for p in 0..pairs {
                if steps && p % 2 == 0 {
                    prefetch.step();
                }
                let t = 2 * p;
                let mut v = [[_mm512_setzero_si512(); 2]; K];
                for (k, v) in v.iter_mut().enumerate() {
                    let r0 = _mm_loadu_si128(at(t, k).cast());
                    // An odd last row pairs with zeros (its code is 0 too).
                    let r1 = if t + 1 < b.rows {
                        _mm_loadu_si128(at(t + 1, k).cast())
                    } else {
                        _mm_setzero_si128()
                    };
                    let both =
                        _mm256_set_m128i(_mm_unpackhi_epi8(r0, r1), _mm_unpacklo_epi8(r0, r1));
                    let mut even = _mm256_and_si256(both, nibble);
                    let mut odd = _mm256_and_si256(_mm256_srli_epi16::<4>(both), nibble);
                    if IMAGE {
                        even = _mm256_shuffle_epi8(image, even);
                        odd = _mm256_shuffle_epi8(image, odd);
                    }
                    v[0] = _mm512_cvtepu8_epi16(even);
                    v[1] = _mm512_cvtepu8_epi16(odd);
                }
                for (j, acc) in acc.iter_mut().enumerate() {
                    let pair = b.codes.as_ptr().add(j * b.stride + 2 * p);
                    let w = _mm512_set1_epi32(pair.cast::<i32>().read_unaligned());
                    for (a, v) in acc.iter_mut().zip(&v) {
                        a[0] = _mm512_dpwssd_epi32(a[0], v[0], w);
                        a[1] = _mm512_dpwssd_epi32(a[1], v[1], w);
                    }
                }
            }
            // Lane `i` of the even sums is channel `2i`, of the odd ones
            // `2i + 1`: interleaved back in channel order.
            let low = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
            let high =
                _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
            for (j, acc) in acc.iter().enumerate() {
                for (k, a) in acc.iter().enumerate() {
                    let o = out.as_mut_ptr().add(j * b.len + c + 32 * k);
                    _mm512_storeu_si512(o.cast(), _mm512_permutex2var_epi32(a[0], low, a[1]));
                    _mm512_storeu_si512(
                        o.add(16).cast(),
                        _mm512_permutex2var_epi32(a[0], high, a[1]),
                    );
                }
            }
        }
    }

    /// The segment's channels in blocks of 64, 32 and 16.
    #[inline(always)]
    fn segment<const H: usize, const IMAGE: bool>(
        b: SumBlock<'_>,
        out: &mut [i32],
        prefetch: &mut Prefetcher,
    ) {
        let mut c = 0;
        while c + 64 <= b.len {
            block::<H, 4, IMAGE>(b, c, out, prefetch);
            c += 64;
        }
        if c + 32 <= b.len {
            block::<H, 2, IMAGE>(b, c, out, prefetch);
            c += 32;
        }
        if c + 16 <= b.len {
            block::<H, 1, IMAGE>(b, c, out, prefetch);
        }
    }

    /// Channels `c..c + 16N` of the segment, every row, `H` heads; with
    /// `IMAGE`, each level read through `b.image` (`vpshufb`: NF4 levels
    /// are nibbles, so bit 7, which would zero a byte, is never set).
    #[inline(always)]
    fn block<const H: usize, const N: usize, const IMAGE: bool>(
        b: SumBlock<'_>,
        c: usize,
        out: &mut [i32],
        prefetch: &mut Prefetcher,
    ) {
        let pairs = b.rows.div_ceil(2);
        let steps = (b.in_head + c).is_multiple_of(64);
        // SAFETY: only inlined into `sums` (AVX-512F/BW/VNNI). Every level
        // read is in row `t < rows` at channel `start + c + 16k + 15 <
        // start + len <= ch`; every pair of codes read is below `(H − 1)·stride + 2·pairs`; every
        // store is below `H·len`.
        unsafe {
            let image = match b.image {
                Some(m) if IMAGE => _mm_loadu_si128(m.as_ptr().cast()),
                _ => _mm_setzero_si128(),
            };
            let mut acc = [[_mm512_setzero_si512(); N]; H];
            let at = |t: usize, k: usize| b.levels.as_ptr().add(t * b.ch + b.start + c + 16 * k);
            for p in 0..pairs {
                if steps && p % 2 == 0 {
                    prefetch.step();
                }
                let t = 2 * p;
                let mut v = [_mm512_setzero_si512(); N];
                for (k, v) in v.iter_mut().enumerate() {
                    let mut r0 = _mm_loadu_si128(at(t, k).cast());
                    // An odd last row pairs with zeros (its code is 0 too).
                    let mut r1 = if t + 1 < b.rows {
                        _mm_loadu_si128(at(t + 1, k).cast())
                    } else {
                        _mm_setzero_si128()
                    };
                    if IMAGE {
                        r0 = _mm_shuffle_epi8(image, r0);
                        r1 = _mm_shuffle_epi8(image, r1);
                    }
                    let lo = _mm_unpacklo_epi8(r0, r1);
                    let hi = _mm_unpackhi_epi8(r0, r1);
                    *v = _mm512_cvtepu8_epi16(_mm256_set_m128i(hi, lo));
                }
                for (j, acc) in acc.iter_mut().enumerate() {
                    let pair = b.codes.as_ptr().add(j * b.stride + 2 * p);
                    let w = _mm512_set1_epi32(pair.cast::<i32>().read_unaligned());
                    for (a, v) in acc.iter_mut().zip(&v) {
                        *a = _mm512_dpwssd_epi32(*a, *v, w);
                    }
                }
            }
            for (j, acc) in acc.iter().enumerate() {
                for (k, a) in acc.iter().enumerate() {
                    let o = out.as_mut_ptr().add(j * b.len + c + 16 * k);
                    _mm512_storeu_si512(o.cast(), *a);
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2;
mod channels;
#[cfg(test)]
mod tests;
