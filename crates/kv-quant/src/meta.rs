//! Codes for metadata words (f16 or f32 scales and offsets).
//!
//! Two codes, both systematic: the word's bits are stored as they are and
//! its check bits in a check word of one, two or four bytes beside it.
//!
//! - **SECDED** (one check byte per word): an extended, shortened Hamming
//!   code, (22,16) with 6 check bits for f16 words, (39,32) with 7 for f32
//!   words, both of minimum distance 4. Data bit `i` is given the `i`-th
//!   `r'`-bit column of weight ≥ 2 in ascending order (`r'` = 5 or 6), the
//!   check byte holds those `r'` Hamming parities in bits `0..r'` and the
//!   overall parity of data and Hamming bits in bit `r'`. The difference of
//!   received and recomputed check bits (the syndrome) names the flipped bit
//!   when it is one of the `n` single-error syndromes and is flagged as
//!   detected otherwise.
//! - **Reed-Muller RM(2,5)** (two check bytes per 16 data bits): the
//!   \[32,16,8\] code of the polynomials of degree ≤ 2 in five variables, put
//!   in systematic form (an equivalent code: its coordinates permuted so the
//!   16 information positions come first). It corrects every pattern of up
//!   to three flips and detects every pattern of four, like the values'
//!   Golay(24,12), with 16 check bits where Golay over two 12-bit halves
//!   would take 24. An f32 word is two independent codewords (its halves).
//!   Decoding is one lookup in a table of the 2¹⁶ syndromes: the 5,489
//!   patterns of weight ≤ 3 each own one; every other syndrome is detected.
//!
//! Each code is handed to [`LinearCode`] (see [`MetaCode::linear_code`]),
//! whose tests confirm the distance; the table decoders here are the fast
//! path, checked against `LinearCode::decode_word` on every pattern of up to
//! three (SECDED) or four (RM) flips.

use std::sync::OnceLock;

use gf2_codes::{BitMatrix, DecodeOutcome, LinearCode};

use crate::spec::MetaProtection;

/// A metadata code for one word width.
#[derive(Debug)]
pub struct MetaCode {
    width: u32,
    check_bits: u32,
    /// Check bits contributed by each byte value of each data byte.
    parity: Vec<[u32; 256]>,
    decoder: Decoder,
}

/// How a syndrome becomes a correction.
#[derive(Debug)]
enum Decoder {
    /// SECDED: syndrome → flipped bit position + 1, or 0 when not a single
    /// error (positions past the data bits are check bits).
    Single(Vec<u8>),
    /// RM(2,5) per 16-bit half: 16-bit syndrome → error pattern (data bits
    /// 0..16, check bits 16..32), or [`UNCORRECTABLE`].
    Leaders(&'static [u32]),
}

/// A syndrome no pattern of weight ≤ 3 has.
const UNCORRECTABLE: u32 = u32::MAX;

impl MetaCode {
    fn secded(width: u32) -> MetaCode {
        let hamming_bits = if width <= 26 { 5 } else { 6 };
        let columns: Vec<u32> = (1u32..(1 << hamming_bits))
            .filter(|c| c.count_ones() >= 2)
            .take(width as usize)
            .collect();
        assert_eq!(columns.len(), width as usize, "enough Hamming columns");
        let p_row = |i: usize| -> u32 {
            let h = columns[i];
            h | ((1 + h.count_ones()) & 1) << hamming_bits
        };
        let r = hamming_bits + 1;
        let mut single = vec![0u8; 1 << r];
        for i in 0..width as usize {
            single[p_row(i) as usize] = i as u8 + 1;
        }
        for j in 0..r {
            single[1 << j] = (width + j) as u8 + 1;
        }
        MetaCode {
            width,
            check_bits: r,
            parity: parity_tables(width, p_row),
            decoder: Decoder::Single(single),
        }
    }

    fn reed_muller(width: u32) -> MetaCode {
        let checks = rm25_checks();
        // Data bit i of half h contributes its row's check bits at 16·h.
        let p_row = |i: usize| checks[i % 16] << (16 * (i / 16));
        MetaCode {
            width,
            check_bits: width,
            parity: parity_tables(width, p_row),
            decoder: Decoder::Leaders(rm25_leaders()),
        }
    }

    /// The SECDED code for 16-bit words (f16 metadata).
    pub fn f16() -> &'static MetaCode {
        static CODE: OnceLock<MetaCode> = OnceLock::new();
        CODE.get_or_init(|| MetaCode::secded(16))
    }

    /// The SECDED code for 32-bit words (f32 metadata).
    pub fn f32() -> &'static MetaCode {
        static CODE: OnceLock<MetaCode> = OnceLock::new();
        CODE.get_or_init(|| MetaCode::secded(32))
    }

    /// The RM(2,5) code for 16-bit words (f16 metadata).
    pub fn rm_f16() -> &'static MetaCode {
        static CODE: OnceLock<MetaCode> = OnceLock::new();
        CODE.get_or_init(|| MetaCode::reed_muller(16))
    }

    /// The RM(2,5) code for 32-bit words: two codewords, one per half.
    pub fn rm_f32() -> &'static MetaCode {
        static CODE: OnceLock<MetaCode> = OnceLock::new();
        CODE.get_or_init(|| MetaCode::reed_muller(32))
    }

    /// The code `protection` names for words of `width` bits (16, else 32:
    /// the widths of kv-quant's scale types); `None` for unprotected metadata.
    pub(crate) fn for_protection(
        protection: MetaProtection,
        width: usize,
    ) -> Option<&'static MetaCode> {
        match (protection, width == 16) {
            (MetaProtection::Unprotected, _) => None,
            (MetaProtection::Secded, true) => Some(Self::f16()),
            (MetaProtection::Secded, false) => Some(Self::f32()),
            (MetaProtection::ReedMuller, true) => Some(Self::rm_f16()),
            (MetaProtection::ReedMuller, false) => Some(Self::rm_f32()),
        }
    }

    /// Data bits per word.
    pub fn data_bits(&self) -> u32 {
        self.width
    }

    /// Check bits per word.
    pub fn check_bits(&self) -> u32 {
        self.check_bits
    }

    /// Bytes of a word's stored check word (little-endian).
    pub fn check_bytes(&self) -> usize {
        self.check_bits.div_ceil(8) as usize
    }

    /// The check word of a data word.
    #[inline]
    pub fn check(&self, data: u32) -> u32 {
        self.parity
            .iter()
            .enumerate()
            .fold(0, |acc, (i, t)| acc ^ t[(data >> (8 * i)) as usize & 0xFF])
    }

    /// The syndrome of a received word and check word: 0 exactly when the
    /// pair is a codeword (the common case, which needs no decoding).
    #[inline]
    pub(crate) fn syndrome(&self, data: u32, check: u32) -> u32 {
        let mask = if self.check_bits == 32 {
            u32::MAX
        } else {
            (1 << self.check_bits) - 1
        };
        (check ^ self.check(data)) & mask
    }

    /// [`syndrome`](Self::syndrome) of a 16-bit word (an f16 scale or
    /// offset): two table lookups, without the general loop over bytes.
    ///
    /// # Panics
    /// If the code protects fewer than 16 data bits.
    #[inline]
    pub(crate) fn syndrome16(&self, data: u16, check: u32) -> u32 {
        let [lo, hi] = data.to_le_bytes();
        let parity = self.parity[0][usize::from(lo)] ^ self.parity[1][usize::from(hi)];
        let mask = if self.check_bits == 32 {
            u32::MAX
        } else {
            (1 << self.check_bits) - 1
        };
        (check ^ parity) & mask
    }

    /// Decodes a received word and check word: the data and the outcome
    /// (detected words return the data as received).
    #[inline]
    pub fn decode(&self, data: u32, check: u32) -> (u32, DecodeOutcome) {
        let syndrome = self.syndrome(data, check);
        if syndrome == 0 {
            return (data, DecodeOutcome::Clean);
        }
        match &self.decoder {
            Decoder::Single(single) => match single[syndrome as usize] {
                0 => (data, DecodeOutcome::Detected),
                p if u32::from(p) <= self.width => (data ^ 1 << (p - 1), DecodeOutcome::Corrected),
                _ => (data, DecodeOutcome::Corrected), // a check bit flipped: data valid
            },
            Decoder::Leaders(leaders) => {
                let mut fixed = data;
                for half in 0..self.width / 16 {
                    let s = (syndrome >> (16 * half)) & 0xFFFF;
                    if s == 0 {
                        continue;
                    }
                    match leaders[s as usize] {
                        UNCORRECTABLE => return (data, DecodeOutcome::Detected),
                        e => fixed ^= (e & 0xFFFF) << (16 * half),
                    }
                }
                (fixed, DecodeOutcome::Corrected)
            }
        }
    }

    /// One codeword of this code as a [`LinearCode`]: codeword bit `i < w`
    /// is data bit `i`, bit `w + j` is check bit `j`. RM(2,5) over f32 words
    /// stores two independent codewords, so its codeword is the \[32,16,8\]
    /// code of one half (the same as [`rm_f16`](Self::rm_f16)'s).
    pub fn linear_code(&self) -> LinearCode {
        let width = match self.decoder {
            Decoder::Single(_) => self.width,
            Decoder::Leaders(_) => 16,
        };
        let check_bits = self.check_bits * width / self.width;
        let rows: Vec<u64> = (0..width)
            .map(|i| 1u64 << i | u64::from(self.check(1 << i)) << width)
            .collect();
        let n = (width + check_bits) as usize;
        let g = BitMatrix::from_u64_rows(&rows, n).expect("rows fit in n bits");
        LinearCode::from_generator(g).expect("systematic generator has full rank")
    }
}

/// Per data byte, the check bits each of its 256 values contributes, from
/// the check bits `p_row(i)` of data bit `i`.
fn parity_tables(width: u32, p_row: impl Fn(usize) -> u32) -> Vec<[u32; 256]> {
    (0..width as usize / 8)
        .map(|byte| {
            std::array::from_fn(|v| {
                (0..8)
                    .filter(|b| v >> b & 1 == 1)
                    .fold(0, |acc, b| acc ^ p_row(8 * byte + b))
            })
        })
        .collect()
}

/// RM(2,5) in systematic form: the 16 check bits of each data bit.
///
/// The generator's rows are the monomials `1, x₁..x₅, xᵢxⱼ` evaluated at
/// the 32 points of GF(2)⁵; Gauss-Jordan elimination brings it to reduced
/// row-echelon form, whose 16 pivot columns become the data bits (in
/// order) and the other 16 the check bits.
fn rm25_checks() -> [u32; 16] {
    let point = |p: u32, v: u32| p >> v & 1;
    let mut rows: Vec<u32> = Vec::with_capacity(16);
    let eval = |f: &dyn Fn(u32) -> u32| (0..32).fold(0u32, |acc, p| acc | f(p) << p);
    rows.push(eval(&|_| 1));
    for v in 0..5 {
        rows.push(eval(&|p| point(p, v)));
    }
    for a in 0..5 {
        for b in a + 1..5 {
            rows.push(eval(&|p| point(p, a) & point(p, b)));
        }
    }
    let mut pivots = Vec::with_capacity(16);
    let mut r = 0;
    for col in 0..32 {
        let Some(found) = (r..16).find(|&i| rows[i] >> col & 1 == 1) else {
            continue;
        };
        rows.swap(r, found);
        for i in 0..16 {
            if i != r && rows[i] >> col & 1 == 1 {
                rows[i] ^= rows[r];
            }
        }
        pivots.push(col);
        r += 1;
    }
    assert_eq!(r, 16, "RM(2,5) has dimension 16");
    let others: Vec<u32> = (0..32).filter(|c| !pivots.contains(c)).collect();
    std::array::from_fn(|i| {
        others
            .iter()
            .enumerate()
            .fold(0, |acc, (j, &c)| acc | (rows[i] >> c & 1) << j)
    })
}

/// The RM(2,5) syndrome table: syndrome → the unique pattern of weight ≤ 3
/// that has it, or [`UNCORRECTABLE`].
fn rm25_leaders() -> &'static [u32] {
    static TABLE: OnceLock<Vec<u32>> = OnceLock::new();
    TABLE.get_or_init(|| {
        let checks = rm25_checks();
        let syndrome = |e: u32| {
            (0..16)
                .filter(|i| e >> i & 1 == 1)
                .fold(e >> 16, |acc, i| acc ^ checks[i])
        };
        let mut table = vec![UNCORRECTABLE; 1 << 16];
        for a in 0..32 {
            table[syndrome(1 << a) as usize] = 1 << a;
            for b in a + 1..32 {
                table[syndrome(1 << a | 1 << b) as usize] = 1 << a | 1 << b;
                for c in b + 1..32 {
                    let e = 1 << a | 1 << b | 1 << c;
                    table[syndrome(e) as usize] = e;
                }
            }
        }
        table
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secded_codes_have_distance_four_and_rm_eight() {
        for (code, n, d) in [
            (MetaCode::f16(), 22, 4),
            (MetaCode::f32(), 39, 4),
            (MetaCode::rm_f16(), 32, 8),
            (MetaCode::rm_f32(), 32, 8),
        ] {
            let lc = code.linear_code();
            assert_eq!(
                (lc.n(), lc.k()),
                (n, n - code.check_bits().min(16) as usize)
            );
            assert_eq!(lc.min_distance(), d, "({n},{})", lc.k());
        }
        assert_eq!(MetaCode::rm_f32().check_bytes(), 4);
        assert_eq!(MetaCode::rm_f16().check_bytes(), 2);
        assert_eq!(MetaCode::f32().check_bytes(), 1);
        // Every pattern of weight ≤ 3 owns a syndrome of its own.
        let owned = rm25_leaders()
            .iter()
            .filter(|&&e| e != UNCORRECTABLE)
            .count();
        assert_eq!(owned, 32 + 496 + 4960);
    }

    /// Every pattern of up to `max` flips of an `n`-bit codeword, each once.
    fn patterns(n: usize, max: u32) -> Vec<u64> {
        let (mut out, mut frontier) = (vec![0u64], vec![0u64]);
        for _ in 0..max {
            frontier = frontier
                .iter()
                .flat_map(|&p| (64 - p.leading_zeros() as usize..n).map(move |b| p | 1 << b))
                .collect();
            out.extend(&frontier);
        }
        out
    }

    /// Every pattern of up to three flips (SECDED) or four (RM) on a few
    /// data words: the table decoder agrees with the generic syndrome
    /// decoder, corrects what the code's radius allows and detects the rest
    /// it promises to.
    #[test]
    fn table_decoders_agree_with_linear_code_on_all_small_patterns() {
        for (code, max, radius) in [
            (MetaCode::f16(), 3, 1),
            (MetaCode::f32(), 3, 1),
            (MetaCode::rm_f16(), 4, 3),
        ] {
            let lc = code.linear_code();
            let w = code.data_bits();
            let data_mask = ((1u64 << w) - 1) as u32;
            for data in [0u32, 0x3C00 & data_mask, 0xDEAD_BEEF & data_mask, data_mask] {
                let check = code.check(data);
                let cw = u64::from(data) | u64::from(check) << w;
                assert_eq!(lc.encode(u64::from(data)).unwrap(), cw);
                for e in patterns(lc.n(), max) {
                    let rx = cw ^ e;
                    let (d, outcome) = code.decode(rx as u32 & data_mask, (rx >> w) as u32);
                    let reference = lc.decode_word(rx).unwrap();
                    assert_eq!(outcome, reference.outcome, "pattern {e:#x}");
                    assert_eq!(u64::from(d), reference.data, "pattern {e:#x}");
                    match e.count_ones() {
                        0 => assert_eq!(outcome, DecodeOutcome::Clean),
                        k if k <= radius => {
                            assert_eq!((d, outcome), (data, DecodeOutcome::Corrected))
                        }
                        k if k == radius + 1 => assert_eq!(outcome, DecodeOutcome::Detected),
                        _ => {}
                    }
                }
            }
        }
    }

    /// RM over f32 words: each half is its own codeword, so three flips in
    /// each half are all corrected and four in either half are detected.
    #[test]
    fn rm_f32_words_decode_their_halves_independently() {
        let code = MetaCode::rm_f32();
        let data = 0x4049_0FDBu32; // π
        let check = code.check(data);
        let flip = |d: u32, c: u32, bits: &[u32]| {
            bits.iter().fold((d, c), |(d, c), &b| match b {
                0..16 => (d ^ 1 << b, c),
                16..32 => (d, c ^ 1 << (b - 16)),
                32..48 => (d ^ 1 << (b - 16), c),
                _ => (d, c ^ 1 << (b - 32)),
            })
        };
        // Bits 0..32 address half 0 (data 0..16, checks 16..32), 32..64 half 1.
        let (d, c) = flip(data, check, &[0, 7, 20, 33, 47, 60]);
        assert_eq!(code.decode(d, c), (data, DecodeOutcome::Corrected));
        let (d, c) = flip(data, check, &[1, 2, 3, 20, 40]);
        assert_eq!(code.decode(d, c).1, DecodeOutcome::Detected);
        let (d, c) = flip(data, check, &[50, 51, 52, 53]);
        assert_eq!(code.decode(d, c).1, DecodeOutcome::Detected);
        assert_eq!(code.decode(data, check), (data, DecodeOutcome::Clean));
    }
}
