//! Integer levels of the row-local forms: the group parameters (scale and
//! offset, or the centred scale) of a run of values, found from its finite
//! range, and the rounding of each value to its level without division,
//! AVX2 where the CPU has it. The encoder (`encode.rs`) calls these per
//! group; whole-matrix quantization calls them for shared groups.
//!
//! Integer levels are found without division: `(x − o)·(1/s)` rounded to
//! nearest, ties to even. Against `(x − o)/s` the product differs by at most
//! a few ulps of a number ≤ 2^b, so a value lands on the other neighbour
//! level only within a few ulps of a midpoint, and every value stays within
//! half a step (plus that rounding) of its level.

use super::encode::sanitize;
use super::section::Kind;
use crate::error::Result;
use crate::int::{self, Toward};
use crate::nf4::nearest_level;
use crate::spec::ScaleType;

/// Whether every value of `xs` is finite (one branch-free pass, AVX2 where
/// the CPU has it).
#[inline]
pub(super) fn all_finite(xs: &[f32]) -> bool {
    crate::simd::with_avx2(|| xs.iter().fold(true, |ok, x| ok & x.is_finite()))
}

/// Finite minimum and maximum of `xs` (`(0, 0)` when none is finite);
/// `finite` says that every value is.
#[inline(always)]
pub(super) fn finite_range(xs: &[f32], finite: bool) -> (f32, f32) {
    let (lo, hi) = if finite {
        crate::simd::with_avx2(|| lane_range(xs))
    } else {
        xs.iter()
            .filter(|x| x.is_finite())
            .fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), &x| {
                (lo.min(x), hi.max(x))
            })
    };
    if lo > hi { (0.0, 0.0) } else { (lo, hi) }
}

/// Minimum and maximum of finite values, in 16 lanes held in registers.
#[inline(always)]
pub(super) fn lane_range(xs: &[f32]) -> (f32, f32) {
    const LANES: usize = 16;
    let (mut lo, mut hi) = ([f32::INFINITY; LANES], [f32::NEG_INFINITY; LANES]);
    let mut chunks = xs.chunks_exact(LANES);
    for c in &mut chunks {
        for i in 0..LANES {
            lo[i] = if c[i] < lo[i] { c[i] } else { lo[i] };
            hi[i] = if c[i] > hi[i] { c[i] } else { hi[i] };
        }
    }
    for (i, &x) in chunks.remainder().iter().enumerate() {
        lo[i] = if x < lo[i] { x } else { lo[i] };
        hi[i] = if x > hi[i] { x } else { hi[i] };
    }
    let lo = lo
        .into_iter()
        .fold(f32::INFINITY, |a, b| if b < a { b } else { a });
    let hi = hi
        .into_iter()
        .fold(f32::NEG_INFINITY, |a, b| if b > a { b } else { a });
    (lo, hi)
}

/// The stored parameters `(a, b)` of a group with finite range `(lo, hi)`.
pub(crate) fn group_params(kind: Kind, ty: ScaleType, lo: f32, hi: f32) -> Result<(f32, f32)> {
    group_params_with(kind, ty, lo, hi, int::round_to)
}

/// [`group_params`] with a chosen rounding routine (all give the same values).
#[inline(always)]
pub(super) fn group_params_with(
    kind: Kind,
    ty: ScaleType,
    lo: f32,
    hi: f32,
    round: int::Rounder,
) -> Result<(f32, f32)> {
    let absmax = lo.abs().max(hi.abs());
    match kind {
        Kind::Asym(bits) => int::asymmetric_params(lo, hi, bits, ty, round),
        Kind::Sym(bits) => Ok((int::symmetric_scale(absmax, bits, ty, round)?, 0.0)),
        Kind::Fp8(format) => {
            if absmax > 0.0 {
                let s = f64::from(absmax) / f64::from(format.max_finite());
                Ok((int::round_to(ScaleType::F32, s, Toward::Up, "scale")?, 0.0))
            } else {
                Ok((1.0, 0.0))
            }
        }
        _ => Ok((
            int::round_to(ty, f64::from(absmax), Toward::Up, "absmax")?,
            0.0,
        )),
    }
}

/// Group parameters of one row of a per-token scaled form (`finite`: the
/// row holds no NaN or infinity): the ranges of all groups in one AVX2
/// region, then the stored parameters group by group.
#[inline(always)]
pub(super) fn row_params(
    kind: Kind,
    ty: ScaleType,
    row: &[f32],
    finite: bool,
    cpg: usize,
    params: &mut [(f32, f32)],
) -> Result<()> {
    if finite {
        crate::simd::with_avx2(|| {
            for (p, seg) in params.iter_mut().zip(row.chunks_exact(cpg)) {
                *p = lane_range(seg);
            }
        });
    } else {
        for (p, seg) in params.iter_mut().zip(row.chunks_exact(cpg)) {
            *p = finite_range(seg, false);
        }
    }
    for p in params.iter_mut() {
        let (lo, hi) = if p.0 > p.1 { (0.0, 0.0) } else { *p };
        *p = group_params(kind, ty, lo, hi)?;
    }
    Ok(())
}

/// One finite row of an integer form: ranges, stored parameters and levels
/// of every group, in one AVX2 + F16C region where the CPU has them (the
/// hot path of appending a token). The same values as
/// [`row_params`] then [`levels_with`].
pub(super) fn int_row(
    kind: Kind,
    ty: ScaleType,
    row: &[f32],
    cpg: usize,
    params: &mut [(f32, f32)],
    levels: &mut [u8],
) -> Result<()> {
    #[cfg(target_arch = "x86_64")]
    if crate::simd::has_avx2_f16c() {
        // SAFETY: the CPU has AVX2 and F16C (checked just above).
        return unsafe { int_row_avx2(kind, ty, row, cpg, params, levels) };
    }
    int_row_generic(
        kind,
        ty,
        row,
        cpg,
        params,
        levels,
        int::round_to,
        lane_range,
    )
}

/// # Safety
/// The CPU must have AVX2 and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
unsafe fn int_row_avx2(
    kind: Kind,
    ty: ScaleType,
    row: &[f32],
    cpg: usize,
    params: &mut [(f32, f32)],
    levels: &mut [u8],
) -> Result<()> {
    int_row_generic(
        kind,
        ty,
        row,
        cpg,
        params,
        levels,
        crate::simd::round_f16c,
        // SAFETY: AVX2 is enabled in this function.
        |xs| unsafe { crate::simd::range_avx2(xs) },
    )
}

#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn int_row_generic(
    kind: Kind,
    ty: ScaleType,
    row: &[f32],
    cpg: usize,
    params: &mut [(f32, f32)],
    levels: &mut [u8],
    round: int::Rounder,
    range: impl Fn(&[f32]) -> (f32, f32),
) -> Result<()> {
    for (p, seg) in params.iter_mut().zip(row.chunks_exact(cpg)) {
        let (lo, hi) = range(seg);
        let (lo, hi) = if lo > hi { (0.0, 0.0) } else { (lo, hi) };
        *p = group_params_with(kind, ty, lo, hi, round)?;
    }
    for ((seg, lv), &(a, b)) in row
        .chunks_exact(cpg)
        .zip(levels.chunks_exact_mut(cpg))
        .zip(params.iter())
    {
        levels_of_group(kind, seg, lv, a, b);
    }
    Ok(())
}

/// Levels of one row of a scaled form given its groups' parameters.
pub(crate) fn levels_with(
    kind: Kind,
    row: &[f32],
    cpg: usize,
    params: &[(f32, f32)],
    levels: &mut [u8],
) {
    crate::simd::with_avx2(|| {
        for ((seg, lv), &(a, b)) in row
            .chunks_exact(cpg)
            .zip(levels.chunks_exact_mut(cpg))
            .zip(params)
        {
            levels_of_group(kind, seg, lv, a, b);
        }
    });
}

/// Integer levels `clamp(round((x − b)/a), lo, hi) + shift` of one group
/// (finite input; NaN is sanitized before it gets here); the level of a
/// zero scale is `shift` clamped at `lo` (0 for asymmetric groups, the
/// middle level for symmetric ones). Callers run it inside an AVX2 region.
#[inline(always)]
pub(super) fn round_levels(
    seg: &[f32],
    lv: &mut [u8],
    (a, b): (f32, f32),
    (lo, hi): (f32, f32),
    shift: f32,
) {
    if a > 0.0 && (1.0 / a).is_normal() {
        round_run(seg, lv, b, 1.0 / a, lo, hi, shift);
    } else if a > 0.0 {
        // Subnormal scales: the reciprocal would overflow.
        for (l, &x) in lv.iter_mut().zip(seg) {
            *l = (((x - b) / a).round_ties_even().clamp(lo, hi) + shift) as u8;
        }
    } else {
        lv.fill((0f32.clamp(lo, hi) + shift) as u8);
    }
}

/// The vectorised level loop: clamp, shift, then round by adding 1.5·2²³,
/// which leaves the nearest integer (ties to even, the default rounding
/// mode) in the low mantissa bits. Exact for results in `0..=255` because
/// `shift` is an even integer (0 or `2^(b−1)`, `b ≥ 2`), so rounding after
/// the shift equals rounding before it.
#[inline(always)]
fn round_run(seg: &[f32], lv: &mut [u8], b: f32, inv: f32, lo: f32, hi: f32, shift: f32) {
    const ROUND: f32 = 12_582_912.0;
    for (l, &x) in lv.iter_mut().zip(seg) {
        let v = (x - b) * inv;
        let v = if v < lo { lo } else { v };
        let v = if v > hi { hi } else { v };
        *l = (v + shift + ROUND).to_bits() as u8;
    }
}

/// Levels of one group (`a` scale or absmax, `b` offset).
#[inline(always)]
pub(crate) fn levels_of_group(kind: Kind, seg: &[f32], lv: &mut [u8], a: f32, b: f32) {
    match kind {
        Kind::Asym(bits) => {
            let top = ((1u32 << bits) - 1) as f32;
            round_levels(seg, lv, (a, b), (0.0, top), 0.0);
        }
        Kind::Sym(bits) => {
            let mid = (1u32 << (bits - 1)) as f32;
            round_levels(seg, lv, (a, 0.0), (1.0 - mid, mid - 1.0), mid);
        }
        Kind::Fp8(format) => {
            for (l, &x) in lv.iter_mut().zip(seg) {
                *l = format.encode(sanitize(x) / a);
            }
        }
        _ => {
            for (l, &x) in lv.iter_mut().zip(seg) {
                *l = if a > 0.0 {
                    nearest_level(sanitize(x) / a)
                } else {
                    7
                };
            }
        }
    }
}
