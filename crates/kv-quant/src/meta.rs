//! SECDED protection of metadata words (f16 or f32 scales and offsets).
//!
//! A metadata word of `w` = 16 or 32 bits gets one check byte of an extended,
//! shortened Hamming code: (22,16) with 6 check bits for f16 words, (39,32)
//! with 7 for f32 words, both of minimum distance 4. Data bit `i` is given
//! the `i`-th `r'`-bit column of weight ≥ 2 in ascending order (`r'` = 5 or 6),
//! the check byte holds those `r'` Hamming parities in bits `0..r'` and the
//! overall parity of data and Hamming bits in bit `r'`. Decoding recomputes
//! the check bits from the received data; the difference (the syndrome)
//! names the flipped bit when it is one of the `n` single-error syndromes and
//! is flagged as detected otherwise.
//!
//! The generator is handed to [`LinearCode`] (see [`MetaCode::linear_code`]),
//! whose tests confirm the distance; the table decoder here is the fast path,
//! checked against `LinearCode::decode_word` on every pattern of up to three flips.

use std::sync::OnceLock;

use gf2_codes::{BitMatrix, DecodeOutcome, LinearCode};

/// The SECDED code of one metadata word width.
#[derive(Debug)]
pub struct MetaCode {
    width: u32,
    hamming_bits: u32,
    /// Check bits contributed by each byte value of each data byte.
    parity: Vec<[u8; 256]>,
    /// Syndrome → flipped bit position + 1, or 0 when not a single error.
    single: Vec<u8>,
}

impl MetaCode {
    fn build(width: u32) -> MetaCode {
        let hamming_bits = if width <= 26 { 5 } else { 6 };
        let columns: Vec<u8> = (1u8..(1 << hamming_bits))
            .filter(|c| c.count_ones() >= 2)
            .take(width as usize)
            .collect();
        assert_eq!(columns.len(), width as usize, "enough Hamming columns");
        let p_row = |i: usize| -> u8 {
            let h = columns[i];
            h | (((1 + h.count_ones()) & 1) as u8) << hamming_bits
        };
        let parity = (0..width as usize / 8)
            .map(|byte| {
                std::array::from_fn(|v| {
                    (0..8)
                        .filter(|b| v >> b & 1 == 1)
                        .fold(0u8, |acc, b| acc ^ p_row(8 * byte + b))
                })
            })
            .collect();
        let r = hamming_bits + 1;
        let mut single = vec![0u8; 1 << r];
        for i in 0..width as usize {
            single[usize::from(p_row(i))] = i as u8 + 1;
        }
        for j in 0..r {
            single[1 << j] = (width + j) as u8 + 1;
        }
        MetaCode {
            width,
            hamming_bits,
            parity,
            single,
        }
    }

    /// The code for 16-bit words (f16 metadata).
    pub fn f16() -> &'static MetaCode {
        static CODE: OnceLock<MetaCode> = OnceLock::new();
        CODE.get_or_init(|| MetaCode::build(16))
    }

    /// The code for 32-bit words (f32 metadata).
    pub fn f32() -> &'static MetaCode {
        static CODE: OnceLock<MetaCode> = OnceLock::new();
        CODE.get_or_init(|| MetaCode::build(32))
    }

    /// The code for a word width in bits (16 or 32).
    pub(crate) fn for_width(width: usize) -> &'static MetaCode {
        if width == 16 {
            Self::f16()
        } else {
            Self::f32()
        }
    }

    /// Data bits per word.
    pub fn data_bits(&self) -> u32 {
        self.width
    }

    /// Check bits per word (held in one byte).
    pub fn check_bits(&self) -> u32 {
        self.hamming_bits + 1
    }

    /// The check byte of a data word.
    #[inline]
    pub fn check(&self, data: u32) -> u8 {
        self.parity
            .iter()
            .enumerate()
            .fold(0, |acc, (i, t)| acc ^ t[(data >> (8 * i)) as usize & 0xFF])
    }

    /// Decodes a received word and check byte: the data and the outcome
    /// (detected words return the data as received).
    #[inline]
    pub fn decode(&self, data: u32, check: u8) -> (u32, DecodeOutcome) {
        let mask = (1u16 << self.check_bits()) - 1;
        let syndrome = (check ^ self.check(data)) & mask as u8;
        if syndrome == 0 {
            return (data, DecodeOutcome::Clean);
        }
        match self.single[usize::from(syndrome)] {
            0 => (data, DecodeOutcome::Detected),
            p if u32::from(p) <= self.width => (data ^ 1 << (p - 1), DecodeOutcome::Corrected),
            _ => (data, DecodeOutcome::Corrected), // a check bit flipped: data valid
        }
    }

    /// The same code as a [`LinearCode`]: codeword bit `i < w` is data bit
    /// `i`, bit `w + j` is check bit `j`.
    pub fn linear_code(&self) -> LinearCode {
        let rows: Vec<u64> = (0..self.width)
            .map(|i| 1u64 << i | u64::from(self.check(1 << i)) << self.width)
            .collect();
        let n = (self.width + self.check_bits()) as usize;
        let g = BitMatrix::from_u64_rows(&rows, n).expect("rows fit in n bits");
        LinearCode::from_generator(g).expect("systematic generator has full rank")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_codes_are_secded() {
        for (code, n) in [(MetaCode::f16(), 22), (MetaCode::f32(), 39)] {
            let lc = code.linear_code();
            assert_eq!((lc.n(), lc.k()), (n, code.data_bits() as usize));
            assert_eq!(lc.min_distance(), 4, "({n},{})", lc.k());
        }
    }

    /// Every pattern of up to three flips on a few data words: the table
    /// decoder agrees with the generic syndrome decoder, corrects every single
    /// flip and detects every double flip.
    #[test]
    fn table_decoder_agrees_with_linear_code_on_all_small_patterns() {
        for code in [MetaCode::f16(), MetaCode::f32()] {
            let lc = code.linear_code();
            let w = code.data_bits();
            let n = lc.n();
            let data_mask = ((1u64 << w) - 1) as u32;
            for data in [0u32, 0x3C00 & data_mask, 0xDEAD_BEEF & data_mask, data_mask] {
                let check = code.check(data);
                let cw = u64::from(data) | u64::from(check) << w;
                assert_eq!(lc.encode(u64::from(data)).unwrap(), cw);
                let mut patterns = vec![0u64];
                for a in 0..n {
                    patterns.push(1 << a);
                    for b in a + 1..n {
                        patterns.push(1 << a | 1 << b);
                        for c in b + 1..n {
                            patterns.push(1 << a | 1 << b | 1 << c);
                        }
                    }
                }
                for e in patterns {
                    let rx = cw ^ e;
                    let (d, outcome) = code.decode(rx as u32 & data_mask, (rx >> w) as u8);
                    let reference = lc.decode_word(rx).unwrap();
                    assert_eq!(outcome, reference.outcome, "pattern {e:#x}");
                    assert_eq!(u64::from(d), reference.data, "pattern {e:#x}");
                    match e.count_ones() {
                        0 => assert_eq!(outcome, DecodeOutcome::Clean),
                        1 => assert_eq!((d, outcome), (data, DecodeOutcome::Corrected)),
                        2 => assert_eq!(outcome, DecodeOutcome::Detected),
                        _ => {}
                    }
                }
            }
        }
    }
}
