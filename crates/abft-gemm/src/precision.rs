//! Storage precisions of GEMM inputs and outputs: rounding an f32 to the
//! format (round to nearest even), the format's bits for fault injection,
//! its unit roundoff `u` (design §2.2) and the e_max the design measured on
//! Ascend 910B (§3 note).

use half::{bf16, f16};

use crate::error::{AbftError, Result};

/// A storage format of A, B and C; accumulation is always f32.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Precision {
    /// IEEE binary32: 1 sign, 8 exponent, 23 mantissa bits.
    Fp32,
    /// bfloat16: 1 sign, 8 exponent, 7 mantissa bits.
    Bf16,
    /// IEEE binary16: 1 sign, 5 exponent, 10 mantissa bits.
    Fp16,
    /// OCP FP8 E4M3: 1 sign, 4 exponent, 3 mantissa bits.
    Fp8E4M3,
    /// OCP FP8 E5M2: 1 sign, 5 exponent, 2 mantissa bits.
    Fp8E5M2,
}

impl Precision {
    /// Every precision.
    pub const ALL: [Precision; 5] = [
        Precision::Fp32,
        Precision::Bf16,
        Precision::Fp16,
        Precision::Fp8E4M3,
        Precision::Fp8E5M2,
    ];

    /// Short name (`fp32`, `bf16`, `fp16`, `fp8-e4m3`, `fp8-e5m2`).
    pub fn name(self) -> &'static str {
        match self {
            Self::Fp32 => "fp32",
            Self::Bf16 => "bf16",
            Self::Fp16 => "fp16",
            Self::Fp8E4M3 => "fp8-e4m3",
            Self::Fp8E5M2 => "fp8-e5m2",
        }
    }

    /// Bits per value.
    pub fn bits(self) -> u32 {
        match self {
            Self::Fp32 => 32,
            Self::Bf16 | Self::Fp16 => 16,
            Self::Fp8E4M3 | Self::Fp8E5M2 => 8,
        }
    }

    /// Mantissa (fraction) bits; the exponent starts at this bit.
    pub fn mantissa_bits(self) -> u32 {
        match self {
            Self::Fp32 => 23,
            Self::Bf16 => 7,
            Self::Fp16 => 10,
            Self::Fp8E4M3 => 3,
            Self::Fp8E5M2 => 2,
        }
    }

    /// Unit roundoff `u = 2^-(mantissa bits + 1)`: the design's values for
    /// FP32 (2⁻²⁴), BF16 (2⁻⁸), E4M3 (2⁻⁴) and E5M2 (2⁻³); FP16 is 2⁻¹¹.
    pub fn unit_roundoff(self) -> f64 {
        2f64.powi(-(self.mantissa_bits() as i32 + 1))
    }

    /// e_max measured on Ascend 910B (design §3 note: BF16 8e-3, FP32
    /// 2.2e-6, FP16 1e-3); FP8 has none there, so `3u` (the design's default).
    pub fn e_max_ascend(self) -> f64 {
        match self {
            Self::Fp32 => 2.2e-6,
            Self::Bf16 => 8e-3,
            Self::Fp16 => 1e-3,
            Self::Fp8E4M3 | Self::Fp8E5M2 => 3.0 * self.unit_roundoff(),
        }
    }

    /// `x` rounded to this format (nearest, ties to even), as f32. FP8
    /// saturates finite values beyond its range to the largest finite value
    /// (the "satfinite" conversion; E4M3 has no infinity); the wider formats
    /// overflow to infinity as IEEE rounding does.
    pub fn round(self, x: f32) -> f32 {
        match self {
            Self::Fp32 => x,
            Self::Bf16 => bf16::from_f32(x).to_f32(),
            Self::Fp16 => f16::from_f32(x).to_f32(),
            Self::Fp8E4M3 => float8::F8E4M3::from_f32(x.clamp(-448.0, 448.0)).to_f32(),
            Self::Fp8E5M2 => float8::F8E5M2::from_f32(x.clamp(-57344.0, 57344.0)).to_f32(),
        }
    }

    /// [`round`](Self::round) of every element, in place: bf16 by the
    /// round-to-nearest-even bit trick (what `half` does per element, here
    /// in a loop the compiler vectorises), fp16 through `half`'s slice
    /// conversion (F16C/AVX-512 when the CPU has them), FP8 per element.
    /// Equal to `round` element by element (tested).
    pub fn round_slice(self, xs: &mut [f32]) {
        match self {
            Self::Fp32 => {}
            Self::Bf16 => {
                for x in xs.iter_mut() {
                    let b = x.to_bits();
                    *x = if x.is_nan() {
                        f32::from_bits((b | 0x0040_0000) & 0xFFFF_0000)
                    } else {
                        f32::from_bits((b.wrapping_add(0x7FFF + ((b >> 16) & 1))) & 0xFFFF_0000)
                    };
                }
            }
            Self::Fp16 => {
                use half::slice::HalfFloatSliceExt;
                let mut h = vec![f16::ZERO; xs.len()];
                h.convert_from_f32_slice(xs);
                h.convert_to_f32_slice(xs);
            }
            // FP8 by scaling to the value's unit in the last place (a power
            // of two, so exact) and rounding ties to even: the format's
            // round-to-nearest-even with satfinite, without a table.
            Self::Fp8E4M3 => xs
                .iter_mut()
                .for_each(|x| *x = round_minifloat(*x, 3, -6, 448.0)),
            Self::Fp8E5M2 => xs
                .iter_mut()
                .for_each(|x| *x = round_minifloat(*x, 2, -14, 57_344.0)),
        }
    }

    /// The format's bits of `x` (which should be representable).
    pub fn to_bits(self, x: f32) -> u32 {
        match self {
            Self::Fp32 => x.to_bits(),
            Self::Bf16 => bf16::from_f32(x).to_bits().into(),
            Self::Fp16 => f16::from_f32(x).to_bits().into(),
            Self::Fp8E4M3 => float8::F8E4M3::from_f32(x).to_bits().into(),
            Self::Fp8E5M2 => float8::F8E5M2::from_f32(x).to_bits().into(),
        }
    }

    /// The value of the format's bit pattern `bits`.
    pub fn from_bits(self, bits: u32) -> f32 {
        match self {
            Self::Fp32 => f32::from_bits(bits),
            Self::Bf16 => bf16::from_bits(bits as u16).to_f32(),
            Self::Fp16 => f16::from_bits(bits as u16).to_f32(),
            Self::Fp8E4M3 => float8::F8E4M3::from_bits(bits as u8).to_f32(),
            Self::Fp8E5M2 => float8::F8E5M2::from_bits(bits as u8).to_f32(),
        }
    }
}

/// `x` rounded to nearest-even in a binary format with `mantissa` stored
/// bits, smallest normal exponent `min_exp` (subnormals below it) and
/// largest finite value `max`, saturating beyond it; NaN stays NaN.
#[inline]
fn round_minifloat(x: f32, mantissa: i32, min_exp: i32, max: f32) -> f32 {
    if x.is_nan() {
        return x;
    }
    let c = x.clamp(-max, max);
    let exp = ((c.to_bits() >> 23) & 0xff) as i32 - 127;
    // Unit in the last place: 2^ulp; `scale` = 2^-ulp, exact in f32.
    let ulp = exp.max(min_exp) - mantissa;
    let scale = f32::from_bits(((127 - ulp) as u32) << 23);
    // Round to an integer, ties to even, by adding and removing 1.5·2^23
    // (|y| ≤ 2^(mantissa+1), far below 2^22): `round_ties_even` would call
    // libm's `rintf` on a baseline x86-64 build, 4x slower here.
    const MAGIC: f32 = 12_582_912.0;
    let y = c * scale;
    (((y + MAGIC) - MAGIC) / scale).copysign(y)
}

impl std::str::FromStr for Precision {
    type Err = AbftError;
    fn from_str(s: &str) -> Result<Self> {
        Self::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| AbftError::InvalidParameter {
                name: "precision",
                reason: format!("{s:?} is not one of fp32, bf16, fp16, fp8-e4m3, fp8-e5m2"),
            })
    }
}

/// Which way a bit flips.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FlipDirection {
    /// A 0 becomes 1.
    ZeroToOne,
    /// A 1 becomes 0.
    OneToZero,
}

/// `x` (representable in `precision`) with bit `bit` flipped in the given
/// direction; `None` when that bit does not hold the direction's starting
/// value (the flip cannot be injected there) or `bit` is past the format.
pub fn flip_bit(x: f32, precision: Precision, bit: u32, direction: FlipDirection) -> Option<f32> {
    if bit >= precision.bits() {
        return None;
    }
    let bits = precision.to_bits(x);
    let set = bits >> bit & 1 == 1;
    match (direction, set) {
        (FlipDirection::ZeroToOne, false) | (FlipDirection::OneToZero, true) => {
            Some(precision.from_bits(bits ^ (1 << bit)))
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn round_slice_equals_round_on_a_sweep_of_bit_patterns() {
        let mut xs: Vec<f32> = (0..=u32::MAX / 40_009)
            .map(|i| f32::from_bits(i.wrapping_mul(40_009) ^ (i >> 3)))
            .collect();
        xs.extend([
            0.0,
            -0.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            f32::MAX,
            f32::MIN_POSITIVE,
            1e-45,
            65_504.0,
            65_520.0,
            // bf16 ties: 1 + 2^-8 rounds to even (1.0), 1 + 3·2^-8 up.
            1.0 + 1.0 / 256.0,
            1.0 + 3.0 / 256.0,
        ]);
        for p in Precision::ALL {
            let mut rounded = xs.clone();
            p.round_slice(&mut rounded);
            for (&x, &r) in xs.iter().zip(&rounded) {
                let want = p.round(x);
                assert!(
                    want.to_bits() == r.to_bits() || (want.is_nan() && r.is_nan()),
                    "{p:?} {x:e} ({:#x}): {r:e} vs {want:e}",
                    x.to_bits()
                );
            }
        }
    }

    use super::*;

    #[test]
    fn unit_roundoffs_are_the_designs() {
        assert_eq!(Precision::Fp32.unit_roundoff(), 2f64.powi(-24));
        assert_eq!(Precision::Bf16.unit_roundoff(), 2f64.powi(-8));
        assert_eq!(Precision::Fp8E4M3.unit_roundoff(), 2f64.powi(-4));
        assert_eq!(Precision::Fp8E5M2.unit_roundoff(), 2f64.powi(-3));
        assert_eq!(Precision::Fp16.unit_roundoff(), 2f64.powi(-11));
    }

    #[test]
    fn rounding_and_bits_round_trip() {
        for p in Precision::ALL {
            for x in [0.0f32, 1.0, -2.5, 0.375, 3.0] {
                let r = p.round(x);
                assert_eq!(p.from_bits(p.to_bits(r)), r, "{p:?} {x}");
            }
            assert_eq!(p.name().parse::<Precision>().unwrap(), p);
        }
        assert_eq!(Precision::Bf16.round(1.0 + 1.0 / 256.0), 1.0); // tie to even
        assert_eq!(Precision::Bf16.round(1.0 + 3.0 / 256.0), 1.0 + 4.0 / 256.0);
        assert!("fp64".parse::<Precision>().is_err());
        assert_eq!(Precision::Fp8E4M3.round(1e6), 448.0);
        assert_eq!(Precision::Fp8E5M2.round(-1e9), -57344.0);
        assert!(Precision::Fp8E4M3.round(f32::NAN).is_nan());
    }

    #[test]
    fn exponent_flips_scale_by_powers_of_two() {
        // BF16 bit 7 is the lowest exponent bit: 1.0 (exp 127 = 0b0111_1111) has it set.
        assert_eq!(
            flip_bit(1.0, Precision::Bf16, 7, FlipDirection::OneToZero),
            Some(0.5)
        );
        assert_eq!(
            flip_bit(1.0, Precision::Bf16, 7, FlipDirection::ZeroToOne),
            None
        );
        // 0.75 has exponent 126 = 0b0111_1110: setting bit 14 (the top
        // exponent bit) adds 128 to it.
        let up = flip_bit(0.75, Precision::Bf16, 14, FlipDirection::ZeroToOne).unwrap();
        assert_eq!(up, 1.5 * 2f32.powi(127));
        assert_eq!(
            flip_bit(2.0, Precision::Fp32, 31, FlipDirection::ZeroToOne),
            Some(-2.0)
        );
        assert_eq!(
            flip_bit(2.0, Precision::Fp16, 16, FlipDirection::ZeroToOne),
            None
        );
        assert_eq!(
            flip_bit(1.0, Precision::Fp16, 10, FlipDirection::OneToZero),
            Some(0.5)
        );
    }
}
