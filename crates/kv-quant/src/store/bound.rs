//! [`ParamBound`]: the range of the scales and offsets a store's writers
//! have written, the plausibility check of protected metadata.
//!
//! A metadata code lets a few words through wrong (four flips of an RM(2,5)
//! word can make another codeword; three of a SECDED one). A wrong word that
//! decodes to NaN, ±∞ or a negative scale is caught by its value alone; a
//! finite wrong one is caught here when it lies outside what was ever
//! written: a scale above the largest scale written, or an offset of larger
//! magnitude than any offset written. An exponent flip of an f16 scale
//! multiplies it by 2^(2^k), so the flips that do the most harm are the
//! ones that leave this range; what stays inside is a bounded error.
//!
//! The bound is two numbers per store kept with its shape, outside the
//! faulted buffers (a register's worth of state beside megabytes of rows,
//! which hardware would hold in protected control memory). It only widens:
//! overwriting rows keeps the old maximum, so the check never erases a word
//! a writer wrote, and a looser bound only lets more wrong words through.

use super::bits::read_word;
use crate::int;
use crate::spec::ScaleType;

/// The largest scale and the largest offset magnitude written into a store
/// (both 0 for a store whose metadata is unprotected or empty).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ParamBound {
    /// Largest scale (absmax, gain) written.
    pub scale: f32,
    /// Largest |offset| (QJL residual norm) written.
    pub offset: f32,
}

impl ParamBound {
    /// The bound of the little-endian words `scales` and `offsets` of type
    /// `ty` (a store's scale and offset buffers, or several stores' one
    /// after another): the largest scale and the largest |offset|. A NaN
    /// word changes nothing; an infinite one makes the bound infinite.
    pub fn of_words(ty: ScaleType, scales: &[u8], offsets: &[u8]) -> Self {
        let mut bound = Self::default();
        let width = ty.bytes();
        for w in scales.chunks_exact(width) {
            bound.widen_scale(int::from_bits(ty, read_word(w)));
        }
        for w in offsets.chunks_exact(width) {
            bound.widen_offset(int::from_bits(ty, read_word(w)));
        }
        bound
    }

    /// Widens the bound to hold `other`.
    pub(crate) fn widen(&mut self, other: ParamBound) {
        self.scale = self.scale.max(other.scale);
        self.offset = self.offset.max(other.offset);
    }

    /// Widens the bound to hold the scale `s` (a NaN changes nothing).
    #[inline]
    pub(crate) fn widen_scale(&mut self, s: f32) {
        self.scale = self.scale.max(s);
    }

    /// Widens the bound to hold the offset `o` (a NaN changes nothing).
    #[inline]
    pub(crate) fn widen_offset(&mut self, o: f32) {
        self.offset = self.offset.max(o.abs());
    }

    /// Whether a decoded parameter is one a writer could have written:
    /// finite, a scale in `0..=scale`, an offset in `-offset..=offset`.
    #[inline]
    pub fn admits(&self, v: f32, is_scale: bool) -> bool {
        if is_scale {
            (0.0..=self.scale).contains(&v)
        } else {
            v.abs() <= self.offset
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::f16;

    fn words(xs: &[f32]) -> Vec<u8> {
        xs.iter()
            .flat_map(|&x| f16::from_f32(x).to_le_bytes())
            .collect()
    }

    #[test]
    fn admits_exactly_what_was_written() {
        let b = ParamBound::of_words(
            ScaleType::F16,
            &words(&[0.5, 0.25, 0.0]),
            &words(&[-3.0, 1.0, 2.0]),
        );
        assert_eq!(
            b,
            ParamBound {
                scale: 0.5,
                offset: 3.0
            }
        );
        for (v, is_scale, ok) in [
            (0.5, true, true),
            (0.0, true, true),
            (0.5001, true, false),
            (-0.0625, true, false),
            (f32::NAN, true, false),
            (f32::INFINITY, true, false),
            (-3.0, false, true),
            (3.0, false, true),
            (-3.01, false, false),
            (f32::NAN, false, false),
            (f32::NEG_INFINITY, false, false),
        ] {
            assert_eq!(b.admits(v, is_scale), ok, "{v} (scale: {is_scale})");
        }
    }

    #[test]
    fn widening_keeps_the_larger_of_each() {
        let mut b = ParamBound {
            scale: 1.0,
            offset: 0.5,
        };
        b.widen(ParamBound {
            scale: 0.5,
            offset: 2.0,
        });
        b.widen_scale(f32::NAN);
        b.widen_offset(-1.5);
        assert_eq!(
            b,
            ParamBound {
                scale: 1.0,
                offset: 2.0
            }
        );
    }
}
