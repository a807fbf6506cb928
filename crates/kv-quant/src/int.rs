//! Integer quantization arithmetic (choosing stored scales and offsets, the
//! level of a value) and bit packing of levels of 1 to 8 bits.
//!
//! **Asymmetric** (`b` bits, `L = 2^b − 1`): the offset `o` is the group
//! minimum rounded *down* to the scale type, the scale `s` is `(max − o)/L`
//! rounded *up*, so the grid `o, o + s, …, o + L·s` covers the group and every
//! value is within `s/2` of a level. A value quantizes to
//! `q = clamp(round_ties_even((x − o) · (1/s)), 0, L)` (a multiply by the
//! group's reciprocal rather than a division per value; the two differ only
//! within a few ulps of a midpoint, where either level is within half a step
//! up to that rounding) and dequantizes to
//! `o + q·s` (an f32 multiply then an f32 add, no fused multiply-add, so that
//! GPU kernels using `__fmul_rn`/`__fadd_rn` match bit for bit). Level 0 maps
//! exactly to the stored offset.
//!
//! **Symmetric**: `s = absmax / (2^(b−1) − 1)` rounded up; `q = round(x·(1/s))` in
//! `[−(2^(b−1) − 1), 2^(b−1) − 1]`, stored offset-binary as `u = q + 2^(b−1)`,
//! dequantized as `(u − 2^(b−1))·s` (the subtraction is exact). The real 0
//! maps exactly to `u = 2^(b−1)` and back to 0.0. Code 0 is never produced by
//! quantization; a fault can still create it, and it dequantizes to `−2^(b−1)·s`.
//!
//! A group whose range (or absmax) is 0 gets scale 0 and every value of it
//! level 0 (asymmetric) or `2^(b−1)` (symmetric); a tiny non-zero range gets
//! the smallest positive scale of its type rather than 0, so nothing divides
//! by zero and the half-step bound still holds.
//!
//! **Packing**: value `j` of a row occupies bits `[b·j, b·j + b)` of the row's
//! little-endian bit stream, so INT4 puts value `2i` in the low nibble of byte
//! `i`, INT2 four values per byte from the low bits up, INT3 eight values in
//! three bytes, INT8 one per byte. A row takes `⌈b·channels/8⌉` bytes; unused
//! high bits of its last byte are zero.

use half::f16;

use crate::error::{KvQuantError, Result};
use crate::spec::ScaleType;

/// Rounding direction when a scale or offset is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Toward {
    Down,
    Up,
    /// Round to nearest (gains and norms, which need not cover a range).
    Nearest,
}

fn f16_step(h: f16, toward: Toward) -> f16 {
    let bits = h.to_bits();
    let positive = bits & 0x8000 == 0;
    let zero = bits & 0x7FFF == 0;
    let stepped = match (toward, positive, zero) {
        (Toward::Up, _, true) => 0x0001,
        (Toward::Down, _, true) => 0x8001,
        (Toward::Up, true, false) | (Toward::Down, false, false) => bits + 1,
        (Toward::Up, false, false) | (Toward::Down, true, false) => bits - 1,
        (Toward::Nearest, ..) => bits,
    };
    f16::from_bits(stepped)
}

/// `x` rounded to f32 in the given direction.
#[inline(always)]
pub(crate) fn directed_f32(x: f64, toward: Toward) -> f32 {
    let mut v = x as f32;
    match toward {
        Toward::Down if f64::from(v) > x => v = v.next_down(),
        Toward::Up if f64::from(v) < x => v = v.next_up(),
        _ => {}
    }
    v
}

/// The value of `x` (exact in f64) rounded in the given direction to the
/// scale type, returned as the f32 it equals exactly. F16 goes through f32
/// with the same directed rounding (rounding down or up twice is rounding
/// once), so the f16 step is the hardware conversion of an f32.
pub(crate) fn round_to(ty: ScaleType, x: f64, toward: Toward, what: &'static str) -> Result<f32> {
    let v32 = directed_f32(x, toward);
    let v = match ty {
        ScaleType::F16 => {
            let mut h = f16::from_f32(v32);
            let off = match toward {
                Toward::Down => h.to_f32() > v32,
                Toward::Up => h.to_f32() < v32,
                Toward::Nearest => false,
            };
            if off {
                h = f16_step(h, toward);
            }
            h.to_f32()
        }
        ScaleType::F32 => v32,
    };
    if v.is_finite() {
        Ok(v)
    } else {
        Err(KvQuantError::OutOfRange {
            what,
            value: x,
            dtype: scale_type_name(ty),
            max: scale_type_max(ty),
        })
    }
}

pub(crate) const fn scale_type_name(ty: ScaleType) -> &'static str {
    match ty {
        ScaleType::F16 => "f16",
        ScaleType::F32 => "f32",
    }
}

pub(crate) fn scale_type_max(ty: ScaleType) -> f64 {
    match ty {
        ScaleType::F16 => f16::MAX.to_f64(),
        ScaleType::F32 => f64::from(f32::MAX),
    }
}

/// Raw bits of a value exactly representable in `ty`.
#[inline]
pub(crate) fn to_bits(ty: ScaleType, v: f32) -> u32 {
    match ty {
        ScaleType::F16 => u32::from(f16::from_f32(v).to_bits()),
        ScaleType::F32 => v.to_bits(),
    }
}

/// The value of raw bits of `ty`.
#[inline]
pub(crate) fn from_bits(ty: ScaleType, bits: u32) -> f32 {
    match ty {
        ScaleType::F16 => f16::from_bits(bits as u16).to_f32(),
        ScaleType::F32 => f32::from_bits(bits),
    }
}

/// How a stored parameter is rounded: [`round_to`], or a faster routine
/// with the same results ([`crate::simd`]'s F16C conversion).
pub(crate) type Rounder = fn(ScaleType, f64, Toward, &'static str) -> Result<f32>;

/// Stored parameters of one asymmetric group: `(scale, offset)`.
#[inline(always)]
pub(crate) fn asymmetric_params(
    min: f32,
    max: f32,
    bits: u8,
    ty: ScaleType,
    round: Rounder,
) -> Result<(f32, f32)> {
    let offset = round(ty, f64::from(min), Toward::Down, "offset (group minimum)")?;
    let levels = f64::from((1u32 << bits) - 1);
    let range = f64::from(max) - f64::from(offset);
    let scale = if range > 0.0 {
        round(ty, range / levels, Toward::Up, "scale")?
    } else {
        0.0
    };
    Ok((scale, offset))
}

/// Stored scale of one symmetric group.
#[inline(always)]
pub(crate) fn symmetric_scale(absmax: f32, bits: u8, ty: ScaleType, round: Rounder) -> Result<f32> {
    let qmax = f64::from((1u32 << (bits - 1)) - 1);
    if absmax > 0.0 {
        round(ty, f64::from(absmax) / qmax, Toward::Up, "scale")
    } else {
        Ok(0.0)
    }
}

/// Bytes of one packed row of `channels` values at `bits` bits.
pub(crate) const fn packed_row_bytes(bits: u8, channels: usize) -> usize {
    (bits as usize * channels).div_ceil(8)
}

/// Packs levels (each `< 2^bits`, `bits` from 1 to 8) into `out` (`packed_row_bytes` bytes).
pub(crate) fn pack_row(bits: u8, levels: &[u8], out: &mut [u8]) {
    match bits {
        8 => out.copy_from_slice(levels),
        4 => crate::simd::with_avx2(|| {
            let mut pairs = levels.chunks_exact(2);
            for (o, pair) in out.iter_mut().zip(&mut pairs) {
                *o = pair[0] | pair[1] << 4;
            }
            if let [last] = pairs.remainder() {
                out[levels.len() / 2] = *last;
            }
        }),
        _ => {
            out.fill(0);
            for (j, &v) in levels.iter().enumerate() {
                let bit = bits as usize * j;
                let word = u16::from(v) << (bit % 8);
                out[bit / 8] |= word as u8;
                if let Some(next) = out.get_mut(bit / 8 + 1) {
                    *next |= (word >> 8) as u8;
                }
            }
        }
    }
}

/// Unpacks one row of levels (the inverse of [`pack_row`]).
#[inline]
pub(crate) fn unpack_row(bits: u8, packed: &[u8], levels: &mut [u8]) {
    match bits {
        8 => levels.copy_from_slice(packed),
        4 => {
            crate::simd::unpack_nibbles(packed, levels);
            if levels.len() % 2 == 1 {
                levels[levels.len() - 1] = packed[packed.len() - 1] & 0xF;
            }
        }
        2 => {
            let mut quads = levels.chunks_exact_mut(4);
            for (quad, &b) in (&mut quads).zip(packed) {
                for (j, q) in quad.iter_mut().enumerate() {
                    *q = b >> (2 * j) & 3;
                }
            }
            let rest = quads.into_remainder();
            if !rest.is_empty() {
                let b = packed[packed.len() - 1];
                for (j, q) in rest.iter_mut().enumerate() {
                    *q = b >> (2 * j) & 3;
                }
            }
        }
        3 => {
            let full_groups = levels.len() / 8;
            let mut eights = levels.chunks_exact_mut(8);
            for (eight, three) in (&mut eights).zip(packed.chunks_exact(3)) {
                let w = u32::from(three[0]) | u32::from(three[1]) << 8 | u32::from(three[2]) << 16;
                for (j, q) in eight.iter_mut().enumerate() {
                    *q = (w >> (3 * j) & 7) as u8;
                }
            }
            let rest = eights.into_remainder();
            if !rest.is_empty() {
                let tail = &packed[3 * full_groups..];
                let w = tail
                    .iter()
                    .enumerate()
                    .fold(0u32, |w, (i, &b)| w | u32::from(b) << (8 * i));
                for (j, q) in rest.iter_mut().enumerate() {
                    *q = (w >> (3 * j) & 7) as u8;
                }
            }
        }
        _ => {
            let mask = (1u16 << bits) - 1;
            for (j, q) in levels.iter_mut().enumerate() {
                let bit = bits as usize * j;
                let lo = u16::from(packed[bit / 8]);
                let hi = packed.get(bit / 8 + 1).map_or(0, |&b| u16::from(b));
                *q = ((lo | hi << 8) >> (bit % 8) & mask) as u8;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Reference packing: one bit at a time.
    fn pack_reference(bits: u8, levels: &[u8]) -> Vec<u8> {
        let mut out = vec![0u8; packed_row_bytes(bits, levels.len())];
        for (j, &v) in levels.iter().enumerate() {
            for b in 0..bits as usize {
                if v >> b & 1 == 1 {
                    let pos = bits as usize * j + b;
                    out[pos / 8] |= 1 << (pos % 8);
                }
            }
        }
        out
    }

    proptest! {
        #[test]
        fn packing_matches_the_bit_stream_reference(
            bits in 1u8..=8,
            raw in proptest::collection::vec(any::<u8>(), 0..70),
        ) {
            let levels: Vec<u8> = raw.iter().map(|&v| v & ((1u16 << bits) - 1) as u8).collect();
            let mut packed = vec![0xAAu8; packed_row_bytes(bits, levels.len())];
            pack_row(bits, &levels, &mut packed);
            prop_assert_eq!(&packed, &pack_reference(bits, &levels));
            let mut back = vec![0xFFu8; levels.len()];
            unpack_row(bits, &packed, &mut back);
            prop_assert_eq!(back, levels);
        }

        #[test]
        fn stored_scales_round_the_stated_way(x in 1e-9f64..6e4, f32_type in any::<bool>()) {
            let ty = if f32_type { ScaleType::F32 } else { ScaleType::F16 };
            let down = round_to(ty, x, Toward::Down, "t").unwrap();
            let up = round_to(ty, x, Toward::Up, "t").unwrap();
            prop_assert!(f64::from(down) <= x && x <= f64::from(up));
            prop_assert_eq!(from_bits(ty, to_bits(ty, up)), up);
            prop_assert_eq!(from_bits(ty, to_bits(ty, down)), down);
        }
    }

    #[test]
    fn documented_layouts() {
        let mut out = [0u8; 3];
        pack_row(3, &[1, 2, 3, 4, 5, 6, 7, 0], &mut out);
        let w = 1 | 2 << 3 | 3 << 6 | 4 << 9 | 5 << 12 | 6 << 15 | 7 << 18;
        assert_eq!(out, [w as u8, (w >> 8) as u8, (w >> 16) as u8]);
        let mut out = [0u8; 1];
        pack_row(4, &[0x3, 0xA], &mut out);
        assert_eq!(out, [0xA3]);
        pack_row(2, &[1, 2, 3, 0], &mut out);
        assert_eq!(out, [0b00_11_10_01]);
    }

    #[test]
    fn f16_overflow_is_an_error() {
        assert!(matches!(
            round_to(ScaleType::F16, 70000.0, Toward::Up, "scale"),
            Err(KvQuantError::OutOfRange { dtype: "f16", .. })
        ));
        assert_eq!(
            round_to(ScaleType::F16, 1e-12, Toward::Up, "s").unwrap(),
            f16::from_bits(1).to_f32()
        );
        assert_eq!(
            round_to(ScaleType::F16, 1e-12, Toward::Down, "s").unwrap(),
            0.0
        );
        assert!(round_to(ScaleType::F16, -1e-12, Toward::Down, "s").unwrap() < 0.0);
    }
}
