//! Packed bit vectors over GF(2).
//!
//! Bit `i` of a [`BitVec`] lives in bit `i % 64` of word `i / 64` (LSB first),
//! and bits past `len` are always zero, so word-wise operations never need masking.

use crate::error::{Gf2Error, Result};

/// A vector over GF(2), packed 64 bits to a `u64` word.
#[derive(Clone, PartialEq, Eq, Hash, Default)]
pub struct BitVec {
    len: usize,
    words: Vec<u64>,
}

pub(crate) const fn words_for(bits: usize) -> usize {
    bits.div_ceil(64)
}

impl BitVec {
    /// The all-zero vector of `len` bits.
    pub fn zeros(len: usize) -> Self {
        Self {
            len,
            words: vec![0; words_for(len)],
        }
    }

    /// A vector with bit `i` equal to `bits[i]`.
    pub fn from_bools(bits: &[bool]) -> Self {
        let mut v = Self::zeros(bits.len());
        for (i, &b) in bits.iter().enumerate() {
            if b {
                v.words[i / 64] |= 1 << (i % 64);
            }
        }
        v
    }

    /// A vector of `len <= 64` bits taken from the low bits of `value`.
    ///
    /// Bits of `value` at positions `>= len` are ignored.
    pub fn from_u64(value: u64, len: usize) -> Result<Self> {
        if len > 64 {
            return Err(Gf2Error::InvalidParameter {
                name: "len",
                reason: format!("{len} bits do not fit in a u64"),
            });
        }
        let mut v = Self::zeros(len);
        if len > 0 {
            v.words[0] = value & low_mask(len);
        }
        Ok(v)
    }

    /// A vector built from packed words; bits past `len` are cleared.
    pub fn from_words(words: &[u64], len: usize) -> Result<Self> {
        crate::error::check_len("words", words_for(len), words.len())?;
        let mut v = Self {
            len,
            words: words.to_vec(),
        };
        v.clear_tail();
        Ok(v)
    }

    /// The number of bits.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the vector has no bits.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The packed words (bits past `len` are zero).
    pub fn words(&self) -> &[u64] {
        &self.words
    }

    /// The low 64 bits as an integer (the whole vector when `len <= 64`).
    pub fn to_u64(&self) -> u64 {
        self.words.first().copied().unwrap_or(0)
    }

    /// Bit `i`.
    ///
    /// # Panics
    /// If `i >= len`, as slice indexing does.
    pub fn get(&self, i: usize) -> bool {
        assert!(
            i < self.len,
            "bit index {i} out of range for length {}",
            self.len
        );
        self.words[i / 64] >> (i % 64) & 1 == 1
    }

    /// Sets bit `i` to `value`.
    ///
    /// # Panics
    /// If `i >= len`.
    pub fn set(&mut self, i: usize, value: bool) {
        assert!(
            i < self.len,
            "bit index {i} out of range for length {}",
            self.len
        );
        let mask = 1u64 << (i % 64);
        if value {
            self.words[i / 64] |= mask;
        } else {
            self.words[i / 64] &= !mask;
        }
    }

    /// Flips bit `i`.
    ///
    /// # Panics
    /// If `i >= len`.
    pub fn flip(&mut self, i: usize) {
        assert!(
            i < self.len,
            "bit index {i} out of range for length {}",
            self.len
        );
        self.words[i / 64] ^= 1 << (i % 64);
    }

    /// Hamming weight (number of ones).
    pub fn weight(&self) -> usize {
        self.words.iter().map(|w| w.count_ones() as usize).sum()
    }

    /// Whether every bit is zero.
    pub fn is_zero(&self) -> bool {
        self.words.iter().all(|&w| w == 0)
    }

    /// `self ^= other` (addition over GF(2)).
    pub fn xor_assign(&mut self, other: &BitVec) -> Result<()> {
        self.check_same_len("xor", other)?;
        xor_words(&mut self.words, &other.words);
        Ok(())
    }

    /// The inner product over GF(2): the parity of `self & other`.
    pub fn dot(&self, other: &BitVec) -> Result<bool> {
        self.check_same_len("dot", other)?;
        Ok(dot_words(&self.words, &other.words))
    }

    /// Indices of the set bits, ascending.
    pub fn iter_ones(&self) -> impl Iterator<Item = usize> + '_ {
        self.words.iter().enumerate().flat_map(|(wi, &w)| {
            let mut rest = w;
            std::iter::from_fn(move || {
                if rest == 0 {
                    return None;
                }
                let b = rest.trailing_zeros() as usize;
                rest &= rest - 1;
                Some(wi * 64 + b)
            })
        })
    }

    /// The bits as booleans.
    pub fn to_bools(&self) -> Vec<bool> {
        (0..self.len).map(|i| self.get(i)).collect()
    }

    fn check_same_len(&self, op: &'static str, other: &BitVec) -> Result<()> {
        if self.len == other.len {
            Ok(())
        } else {
            Err(Gf2Error::DimensionMismatch {
                op,
                expected: self.len,
                found: other.len,
            })
        }
    }

    fn clear_tail(&mut self) {
        if let (false, Some(last)) = (self.len.is_multiple_of(64), self.words.last_mut()) {
            *last &= low_mask(self.len % 64);
        }
    }
}

impl std::fmt::Debug for BitVec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "BitVec[")?;
        for i in 0..self.len {
            f.write_str(if self.get(i) { "1" } else { "0" })?;
        }
        write!(f, "]")
    }
}

/// A mask of the low `bits` bits (`bits` in 0..=64).
pub(crate) const fn low_mask(bits: usize) -> u64 {
    if bits >= 64 {
        u64::MAX
    } else {
        (1u64 << bits) - 1
    }
}

pub(crate) fn xor_words(dst: &mut [u64], src: &[u64]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d ^= s;
    }
}

pub(crate) fn dot_words(a: &[u64], b: &[u64]) -> bool {
    a.iter()
        .zip(b)
        .fold(0u32, |acc, (x, y)| acc ^ (x & y).count_ones())
        & 1
        == 1
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn naive_dot(a: &[bool], b: &[bool]) -> bool {
        a.iter().zip(b).filter(|(x, y)| **x && **y).count() % 2 == 1
    }

    proptest! {
        #[test]
        fn roundtrip_and_ops_match_naive(
            (a, b) in (0usize..200).prop_flat_map(|n| (
                proptest::collection::vec(any::<bool>(), n),
                proptest::collection::vec(any::<bool>(), n),
            ))
        ) {
            let va = BitVec::from_bools(&a);
            let vb = BitVec::from_bools(&b);
            prop_assert_eq!(va.to_bools(), a.clone());
            prop_assert_eq!(va.weight(), a.iter().filter(|x| **x).count());
            prop_assert_eq!(va.dot(&vb).unwrap(), naive_dot(&a, &b));
            let mut x = va.clone();
            x.xor_assign(&vb).unwrap();
            let naive: Vec<bool> = a.iter().zip(&b).map(|(p, q)| p ^ q).collect();
            prop_assert_eq!(x.to_bools(), naive);
            let ones: Vec<usize> = va.iter_ones().collect();
            let naive_ones: Vec<usize> = (0..a.len()).filter(|&i| a[i]).collect();
            prop_assert_eq!(ones, naive_ones);
        }
    }

    #[test]
    fn length_mismatch_is_an_error() {
        let a = BitVec::zeros(5);
        let b = BitVec::zeros(6);
        assert!(matches!(a.dot(&b), Err(Gf2Error::DimensionMismatch { .. })));
        let mut c = a.clone();
        assert!(c.xor_assign(&b).is_err());
        assert!(BitVec::from_u64(0, 65).is_err());
        assert!(BitVec::from_words(&[0, 0], 64).is_err());
    }

    #[test]
    fn tail_bits_are_cleared() {
        let v = BitVec::from_words(&[u64::MAX], 7).unwrap();
        assert_eq!(v.weight(), 7);
        let w = BitVec::from_u64(0xFF, 4).unwrap();
        assert_eq!(w.to_u64(), 0xF);
    }
}
