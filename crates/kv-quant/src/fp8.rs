//! FP8 E4M3 and E5M2: conversion from f32 with round-to-nearest-even and
//! saturation, and decoding through 256-entry tables.
//!
//! Formats as in the OCP 8-bit floating point specification (v1.0, 2023):
//! - **E4M3**: bias 7, no infinities, NaN only at `S.1111.111` (0x7F/0xFF),
//!   largest finite 448, smallest subnormal 2⁻⁹.
//! - **E5M2**: bias 15, IEEE-like, infinities at `S.11111.00`, NaNs at
//!   `S.11111.{01,10,11}`, largest finite 57344, smallest subnormal 2⁻¹⁶.
//!
//! Encoding rounds to nearest, ties to even, and saturates finite values
//! beyond the largest finite to it (the "satfinite" conversion of CUDA's
//! `cvt.rn.satfinite`). Infinite input saturates the same way; NaN encodes as
//! the canonical NaN `0x7F`/`0x7E` with the input's sign. The quantizers of this
//! crate never pass NaN or infinity here (see [`NonFinite`](crate::NonFinite)),
//! so NaN and infinity codes appear in a store only through injected faults.

use std::sync::OnceLock;

/// `2^e` for a normal f32 exponent (`-126 ≤ e ≤ 127`), built from its bits
/// (`powi` is a library call; this is one shift).
#[inline]
fn pow2(e: i32) -> f32 {
    debug_assert!((-126..=127).contains(&e));
    f32::from_bits(((e + 127) as u32) << 23)
}

/// The two OCP FP8 formats.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Fp8Format {
    /// 4 exponent bits, 3 mantissa bits, finite-only (max 448).
    E4M3,
    /// 5 exponent bits, 2 mantissa bits, with infinities (max 57344).
    E5M2,
}

impl Fp8Format {
    const fn mantissa_bits(self) -> u32 {
        match self {
            Fp8Format::E4M3 => 3,
            Fp8Format::E5M2 => 2,
        }
    }

    const fn bias(self) -> i32 {
        match self {
            Fp8Format::E4M3 => 7,
            Fp8Format::E5M2 => 15,
        }
    }

    /// Largest finite magnitude.
    pub const fn max_finite(self) -> f32 {
        match self {
            Fp8Format::E4M3 => 448.0,
            Fp8Format::E5M2 => 57344.0,
        }
    }

    /// Smallest positive (subnormal) magnitude.
    pub fn min_positive(self) -> f32 {
        pow2(1 - self.bias() - self.mantissa_bits() as i32)
    }

    /// Code of the largest finite positive value.
    const fn max_code(self) -> u8 {
        match self {
            Fp8Format::E4M3 => 0x7E,
            Fp8Format::E5M2 => 0x7B,
        }
    }

    /// Encodes `x` with round-to-nearest-even and saturation (see the module docs).
    pub fn encode(self, x: f32) -> u8 {
        let sign = if x.is_sign_negative() { 0x80 } else { 0 };
        let a = x.abs();
        if a.is_nan() {
            return sign
                | match self {
                    Fp8Format::E4M3 => 0x7F,
                    Fp8Format::E5M2 => 0x7E,
                };
        }
        let m = self.mantissa_bits() as i32;
        let emin = 1 - self.bias(); // exponent of the smallest normal
        // Quantum of the binade of `a` (or of the subnormal range), a power of two.
        let exp = if a >= pow2(emin) {
            // Unbiased exponent of a normal f32 (a >= 2^-14 here, always normal).
            ((a.to_bits() >> 23) as i32) - 127
        } else {
            emin
        };
        let quantum = pow2(exp - m);
        // a / quantum is an exact power-of-two scaling, so only the rounding rounds.
        let steps = (a / quantum).round_ties_even();
        let r = steps * quantum;
        if r > self.max_finite() {
            return sign | self.max_code();
        }
        if r < pow2(emin) {
            // Subnormal (or zero): the mantissa field counts quanta of 2^(emin - m).
            return sign | steps as u8;
        }
        // Normal: recompute the exponent from r (rounding may have carried).
        let e = ((r.to_bits() >> 23) as i32) - 127;
        let mant = (r / pow2(e - m)) as u32 - (1 << m);
        sign | (((e + self.bias()) as u32) << m | mant) as u8
    }

    /// Decodes one code exactly (NaN codes give NaN, E5M2 infinities ±∞).
    pub fn decode(self, code: u8) -> f32 {
        let m = self.mantissa_bits();
        let sign = if code & 0x80 != 0 { -1.0 } else { 1.0 };
        let field = i32::from(code & 0x7F) >> m;
        let mant = u32::from(code) & ((1 << m) - 1);
        let top = (1 << (7 - m)) - 1; // all-ones exponent field
        match self {
            Fp8Format::E4M3 if field == top && mant == (1 << m) - 1 => return f32::NAN,
            Fp8Format::E5M2 if field == top => {
                return if mant == 0 {
                    sign * f32::INFINITY
                } else {
                    f32::NAN
                };
            }
            _ => {}
        }
        let value = if field == 0 {
            mant as f32 * pow2(1 - self.bias() - m as i32)
        } else {
            ((1 << m) + mant) as f32 * pow2(field - self.bias() - m as i32)
        };
        sign * value
    }

    /// The decode table: entry `c` is [`decode(c)`](Self::decode).
    pub fn table(self) -> &'static [f32; 256] {
        static E4M3: OnceLock<[f32; 256]> = OnceLock::new();
        static E5M2: OnceLock<[f32; 256]> = OnceLock::new();
        let cell = match self {
            Fp8Format::E4M3 => &E4M3,
            Fp8Format::E5M2 => &E5M2,
        };
        cell.get_or_init(|| std::array::from_fn(|c| self.decode(c as u8)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use float8::{F8E4M3, F8E5M2};
    use proptest::prelude::*;

    const BOTH: [Fp8Format; 2] = [Fp8Format::E4M3, Fp8Format::E5M2];

    /// The independent reference: the `float8` crate.
    fn reference_decode(format: Fp8Format, code: u8) -> f32 {
        match format {
            Fp8Format::E4M3 => F8E4M3::from_bits(code).to_f32(),
            Fp8Format::E5M2 => F8E5M2::from_bits(code).to_f32(),
        }
    }

    fn reference_encode(format: Fp8Format, x: f32) -> u8 {
        match format {
            Fp8Format::E4M3 => F8E4M3::from_f32(x).to_bits(),
            Fp8Format::E5M2 => F8E5M2::from_f32(x).to_bits(),
        }
    }

    /// A second, brute-force reference from the format definition: the finite
    /// code nearest to `x`, ties to the even code, saturating.
    fn brute_force_encode(format: Fp8Format, x: f32) -> u8 {
        if x.abs() > format.max_finite() {
            // Saturation (satfinite); also keeps f64 distances meaningful.
            return format.max_code() | if x < 0.0 { 0x80 } else { 0 };
        }
        let mut best = 0u8;
        let mut best_err = f64::INFINITY;
        for c in 0..=255u8 {
            let v = format.decode(c);
            if !v.is_finite() || (v == 0.0 && v.is_sign_negative() != x.is_sign_negative()) {
                continue;
            }
            if v != 0.0 && v.is_sign_negative() != x.is_sign_negative() {
                continue;
            }
            let err = (f64::from(v) - f64::from(x)).abs();
            if err < best_err || (err == best_err && c & 1 == 0) {
                best = c;
                best_err = err;
            }
        }
        best
    }

    #[test]
    fn all_256_codes_decode_as_the_reference() {
        for format in BOTH {
            for c in 0..=255u8 {
                let (ours, theirs) = (format.decode(c), reference_decode(format, c));
                assert!(
                    ours.to_bits() == theirs.to_bits() || (ours.is_nan() && theirs.is_nan()),
                    "{format:?} {c:#04x}: {ours} vs {theirs}"
                );
                assert_eq!(format.table()[usize::from(c)].to_bits(), ours.to_bits());
            }
        }
    }

    #[test]
    fn format_constants_match_the_ocp_definition() {
        assert_eq!(Fp8Format::E4M3.decode(0x7E), 448.0);
        assert!(Fp8Format::E4M3.decode(0x7F).is_nan());
        assert!(Fp8Format::E4M3.decode(0xFF).is_nan());
        assert_eq!(Fp8Format::E4M3.decode(0x78), 256.0); // no infinity at S.1111.000
        assert_eq!(Fp8Format::E4M3.min_positive(), pow2(-9));
        assert_eq!(Fp8Format::E5M2.decode(0x7B), 57344.0);
        assert_eq!(Fp8Format::E5M2.decode(0x7C), f32::INFINITY);
        assert_eq!(Fp8Format::E5M2.decode(0xFC), f32::NEG_INFINITY);
        assert!((0x7D..=0x7F).all(|c| Fp8Format::E5M2.decode(c).is_nan()));
        assert_eq!(Fp8Format::E5M2.min_positive(), pow2(-16));
    }

    #[test]
    fn every_finite_code_round_trips_and_every_midpoint_rounds_to_even() {
        for format in BOTH {
            let mut finite: Vec<(f32, u8)> = (0..=255u8)
                .map(|c| (format.decode(c), c))
                .filter(|(v, _)| v.is_finite())
                .collect();
            for &(v, c) in &finite {
                let back = format.encode(v);
                // ±0 both encode to themselves.
                assert_eq!(back, c, "{format:?} {c:#04x} = {v}");
            }
            finite.sort_by(|a, b| a.0.total_cmp(&b.0));
            finite.dedup_by(|a, b| a.0 == b.0);
            for w in finite.windows(2) {
                let ((lo, lc), (hi, hc)) = (w[0], w[1]);
                if lo == 0.0 || hi == 0.0 {
                    continue; // the sign of zero, not rounding, decides there
                }
                // Exact: a midpoint needs one more mantissa bit than FP8 has.
                let mid = ((f64::from(lo) + f64::from(hi)) / 2.0) as f32;
                assert_eq!(f64::from(mid), (f64::from(lo) + f64::from(hi)) / 2.0);
                let even = if lc & 1 == 0 { lc } else { hc };
                assert_eq!(
                    format.encode(mid),
                    even,
                    "{format:?} midpoint of {lo} and {hi}"
                );
                assert_eq!(format.encode(mid), reference_encode(format, mid));
                assert_eq!(format.encode(mid.next_down()), lc, "{format:?} below {mid}");
                assert_eq!(format.encode(mid.next_up()), hc, "{format:?} above {mid}");
            }
        }
    }

    #[test]
    fn saturation_and_special_inputs() {
        for format in BOTH {
            let max = format.max_finite();
            assert_eq!(format.decode(format.encode(max * 1.01)), max);
            assert_eq!(format.decode(format.encode(-max * 1e6)), -max);
            assert_eq!(format.decode(format.encode(f32::INFINITY)), max);
            assert!(format.decode(format.encode(f32::NAN)).is_nan());
            assert_eq!(format.encode(1e-30), 0);
            assert_eq!(format.encode(-1e-30), 0x80);
            assert_eq!(format.encode(f32::from_bits(1)), 0); // f32 subnormal
        }
    }

    proptest! {
        #[test]
        fn encode_matches_both_references(bits in any::<u32>()) {
            let x = f32::from_bits(bits);
            prop_assume!(x.is_finite());
            for format in BOTH {
                let ours = format.encode(x);
                prop_assert_eq!(ours, reference_encode(format, x), "{:?} {}", format, x);
                prop_assert_eq!(ours, brute_force_encode(format, x), "{:?} {}", format, x);
            }
        }

        #[test]
        fn encode_matches_references_in_the_normal_range(x in -600.0f32..600.0) {
            for format in BOTH {
                prop_assert_eq!(format.encode(x), reference_encode(format, x));
                prop_assert_eq!(format.encode(x), brute_force_encode(format, x));
            }
        }
    }
}
