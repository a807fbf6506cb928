//! [`LinearCode`]: a binary linear block code built from any generator matrix,
//! with its parity-check matrix, distance profile and syndrome table.
//!
//! Conventions (the paper's, section 4.2): a data word `d` (k bits) encodes to
//! the codeword `c = d·G` (n bits); the syndrome of a received word `r` is
//! `z = H·rᵀ` (n − k bits). Codewords, data words and syndromes are held in a
//! `u64` with bit `i` = coordinate `i`, so codes are limited to n ≤ 64.

use crate::bitvec::low_mask;
use crate::error::{Gf2Error, Result};
use crate::matrix::BitMatrix;
use crate::stats::DecodeOutcome;

/// Size limits for the tables a [`LinearCode`] builds; sizes over them are refused
/// with [`Gf2Error::TooLarge`] instead of exhausting memory or time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CodeLimits {
    /// Largest `n − k` for which a syndrome table (`2^(n−k)` entries of 16 bytes) is built.
    pub max_syndrome_bits: usize,
    /// Largest number of words enumerated, both for the weight distribution
    /// (`2^min(k, n−k)` codewords) and for the coset-leader search.
    pub max_enumeration: u64,
}

impl Default for CodeLimits {
    /// `n − k <= 22` (a 64 MiB table) and `2^32` enumerated words.
    fn default() -> Self {
        Self {
            max_syndrome_bits: 22,
            max_enumeration: 1 << 32,
        }
    }
}

/// The minimum-weight error patterns of one syndrome.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CosetLeader {
    /// One minimum-weight error pattern with this syndrome (the first found in
    /// order of weight, then lexicographic order of positions).
    pub pattern: u64,
    /// Its Hamming weight.
    pub weight: u32,
    /// How many error patterns of that weight share the syndrome (saturating).
    pub multiplicity: u32,
}

impl CosetLeader {
    /// Whether the leader is the only minimum-weight pattern, so that correcting
    /// to it is unambiguous. A syndrome with a non-unique leader means
    /// "detected, uncorrectable".
    pub fn is_unique(&self) -> bool {
        self.multiplicity == 1
    }
}

/// Outcome of decoding one received word with [`LinearCode::decode_word`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WordDecode {
    /// The codeword decided on (the received word when detected).
    pub codeword: u64,
    /// The data bits read from `codeword`.
    pub data: u64,
    /// The syndrome of the received word.
    pub syndrome: u64,
    /// The error pattern removed (zero unless corrected).
    pub error_pattern: u64,
    /// Clean, corrected or detected.
    pub outcome: DecodeOutcome,
}

/// A binary linear `[n, k, d]` code with n ≤ 64.
#[derive(Clone, Debug)]
pub struct LinearCode {
    n: usize,
    k: usize,
    generator: BitMatrix,
    parity_check: BitMatrix,
    systematic: BitMatrix,
    info_set: Vec<usize>,
    generator_rows: Vec<u64>,
    /// Syndrome of a single 1 in column j (column j of H).
    h_columns: Vec<u64>,
    /// Rows of the inverse of `G[:, info_set]`: data = c[info_set] · inverse.
    data_recovery_rows: Vec<u64>,
    weight_distribution: Vec<u64>,
    min_distance: usize,
    leaders: Vec<CosetLeader>,
    decoding_radius: usize,
}

impl LinearCode {
    /// Builds a code from a `k x n` generator matrix of full row rank, deriving a
    /// parity-check matrix in systematic form: identity on the redundancy
    /// columns, `Pᵀ` on the information set (the paper's eq. 13 when `G = [I | P]`).
    pub fn from_generator(generator: BitMatrix) -> Result<Self> {
        Self::build(generator, None, CodeLimits::default())
    }

    /// Like [`from_generator`](Self::from_generator) with a given parity-check
    /// matrix, which must have rank `n − k` and satisfy `G·Hᵀ = 0`. Syndromes are
    /// then computed with this `H` (the paper's SECDED uses its bordered `H̄`).
    pub fn with_parity_check(generator: BitMatrix, parity_check: BitMatrix) -> Result<Self> {
        Self::build(generator, Some(parity_check), CodeLimits::default())
    }

    /// The general constructor: optional parity-check matrix and explicit limits.
    pub fn with_limits(
        generator: BitMatrix,
        parity_check: Option<BitMatrix>,
        limits: CodeLimits,
    ) -> Result<Self> {
        Self::build(generator, parity_check, limits)
    }

    fn build(
        generator: BitMatrix,
        parity_check: Option<BitMatrix>,
        limits: CodeLimits,
    ) -> Result<Self> {
        let (k, n) = (generator.rows(), generator.cols());
        if k == 0 || n == 0 {
            return Err(Gf2Error::UnsupportedCode {
                n,
                k,
                reason: "a code needs at least one row and one column",
            });
        }
        if n > 64 {
            return Err(Gf2Error::UnsupportedCode {
                n,
                k,
                reason: "codewords are held in a u64, so n must be at most 64",
            });
        }
        let echelon = generator.row_echelon();
        let rank = echelon.pivots.len();
        if rank < k {
            return Err(Gf2Error::RankDeficient { rank, rows: k });
        }
        let r = n - k;
        if r > limits.max_syndrome_bits {
            return Err(Gf2Error::TooLarge {
                what: "syndrome table",
                required: 1u128 << r,
                limit: 1u128 << limits.max_syndrome_bits,
            });
        }
        let systematic = echelon.reduced;
        let info_set = echelon.pivots;
        let redundancy: Vec<usize> = (0..n).filter(|c| !info_set.contains(c)).collect();

        let parity_check = match parity_check {
            Some(h) => {
                validate_parity_check(&generator, &h)?;
                h
            }
            None => {
                // Row echelon G_s has identity on the information set; in those
                // coordinates G_s = [I | P] and H = [Pᵀ | I].
                let mut h = BitMatrix::zeros(r, n);
                for (i, &red) in redundancy.iter().enumerate() {
                    h.set(i, red, true);
                    for (row, &info) in info_set.iter().enumerate() {
                        if systematic.get(row, red) {
                            h.set(i, info, true);
                        }
                    }
                }
                h
            }
        };

        let generator_rows = generator.to_u64_rows()?;
        let h_columns: Vec<u64> = (0..n)
            .map(|j| (0..r).fold(0u64, |s, i| s | (u64::from(parity_check.get(i, j)) << i)))
            .collect();
        let data_recovery_rows = generator
            .select_columns(&info_set)
            .inverse()?
            .to_u64_rows()?;
        let parity_rows = parity_check.to_u64_rows()?;

        let weight_distribution = weight_distribution(n, k, &generator_rows, &parity_rows, limits)?;
        let min_distance = (1..=n)
            .find(|&w| weight_distribution[w] > 0)
            .expect("a code of dimension >= 1 has a non-zero codeword");
        let leaders = coset_leaders(n, r, &h_columns, limits)?;

        Ok(Self {
            n,
            k,
            generator,
            parity_check,
            systematic,
            info_set,
            generator_rows,
            h_columns,
            data_recovery_rows,
            weight_distribution,
            min_distance,
            leaders,
            decoding_radius: n,
        })
    }

    /// Limits correction to leaders of weight at most `radius`; syndromes whose
    /// leader is heavier are reported as detected (bounded-distance decoding).
    /// The default, `n`, corrects every syndrome with a unique leader.
    pub fn with_decoding_radius(mut self, radius: usize) -> Self {
        self.decoding_radius = radius;
        self
    }

    /// Code length n.
    pub fn n(&self) -> usize {
        self.n
    }

    /// Dimension k (data bits per codeword).
    pub fn k(&self) -> usize {
        self.k
    }

    /// Rate k / n.
    pub fn rate(&self) -> f64 {
        self.k as f64 / self.n as f64
    }

    /// The generator matrix as given.
    pub fn generator(&self) -> &BitMatrix {
        &self.generator
    }

    /// The parity-check matrix H (`G·Hᵀ = 0`).
    pub fn parity_check(&self) -> &BitMatrix {
        &self.parity_check
    }

    /// The reduced row echelon form of G: identity on the information set.
    pub fn systematic_generator(&self) -> &BitMatrix {
        &self.systematic
    }

    /// The information set: coordinates where the systematic generator has its
    /// identity columns (`0..k` for a generator of the form `[I | P]`).
    pub fn information_set(&self) -> &[usize] {
        &self.info_set
    }

    /// Minimum distance d.
    pub fn min_distance(&self) -> usize {
        self.min_distance
    }

    /// Guaranteed correction radius `t = ⌊(d − 1) / 2⌋`.
    pub fn correction_radius(&self) -> usize {
        (self.min_distance - 1) / 2
    }

    /// Guaranteed detection capability `d − 1` (when used for detection only).
    pub fn detection_capability(&self) -> usize {
        self.min_distance - 1
    }

    /// `A_w`, the number of codewords of each weight `w = 0..=n`.
    pub fn weight_distribution(&self) -> &[u64] {
        &self.weight_distribution
    }

    /// Whether the Hamming spheres of radius t around the codewords exactly
    /// fill the space (every syndrome has a unique leader of weight ≤ t).
    pub fn is_perfect(&self) -> bool {
        let t = self.correction_radius();
        self.leaders
            .iter()
            .all(|l| l.is_unique() && l.weight as usize <= t)
    }

    /// The largest coset-leader weight (the covering radius).
    pub fn covering_radius(&self) -> usize {
        self.leaders
            .iter()
            .map(|l| l.weight as usize)
            .max()
            .unwrap_or(0)
    }

    /// The syndrome table: entry `s` describes the leaders of syndrome `s`.
    pub fn syndrome_table(&self) -> &[CosetLeader] {
        &self.leaders
    }

    /// Syndrome `H·rᵀ` of a received word, bit i = row i of H.
    pub fn syndrome(&self, received: u64) -> Result<u64> {
        self.check_word(received)?;
        Ok(self.syndrome_unchecked(received))
    }

    fn syndrome_unchecked(&self, received: u64) -> u64 {
        let mut s = 0;
        let mut rest = received;
        while rest != 0 {
            s ^= self.h_columns[rest.trailing_zeros() as usize];
            rest &= rest - 1;
        }
        s
    }

    /// Encodes `data` (k bits) as `data · G`.
    pub fn encode(&self, data: u64) -> Result<u64> {
        if data & !low_mask(self.k) != 0 {
            return Err(Gf2Error::InvalidParameter {
                name: "data",
                reason: format!("{data:#x} has bits above k = {}", self.k),
            });
        }
        let mut c = 0;
        let mut rest = data;
        while rest != 0 {
            c ^= self.generator_rows[rest.trailing_zeros() as usize];
            rest &= rest - 1;
        }
        Ok(c)
    }

    /// Whether `word` is a codeword.
    pub fn is_codeword(&self, word: u64) -> Result<bool> {
        Ok(self.syndrome(word)? == 0)
    }

    /// The data word of a codeword (read from the information set).
    pub fn extract_data(&self, codeword: u64) -> Result<u64> {
        self.check_word(codeword)?;
        Ok(self.extract_data_unchecked(codeword))
    }

    fn extract_data_unchecked(&self, codeword: u64) -> u64 {
        let mut d = 0;
        for (i, &col) in self.info_set.iter().enumerate() {
            if codeword >> col & 1 == 1 {
                d ^= self.data_recovery_rows[i];
            }
        }
        d
    }

    /// Syndrome decoding of one received word (n bits).
    pub fn decode_word(&self, received: u64) -> Result<WordDecode> {
        self.check_word(received)?;
        let syndrome = self.syndrome_unchecked(received);
        let leader = self.leaders[syndrome as usize];
        let (outcome, error_pattern) = if syndrome == 0 {
            (DecodeOutcome::Clean, 0)
        } else if leader.is_unique() && leader.weight as usize <= self.decoding_radius {
            (DecodeOutcome::Corrected, leader.pattern)
        } else {
            (DecodeOutcome::Detected, 0)
        };
        let codeword = received ^ error_pattern;
        Ok(WordDecode {
            codeword,
            data: self.extract_data_unchecked(codeword),
            syndrome,
            error_pattern,
            outcome,
        })
    }

    fn check_word(&self, word: u64) -> Result<()> {
        if word & !low_mask(self.n) != 0 {
            return Err(Gf2Error::InvalidParameter {
                name: "received word",
                reason: format!("{word:#x} has bits above n = {}", self.n),
            });
        }
        Ok(())
    }
}

fn validate_parity_check(generator: &BitMatrix, h: &BitMatrix) -> Result<()> {
    let (k, n) = (generator.rows(), generator.cols());
    let invalid = |reason: String| Err(Gf2Error::InvalidParityCheck { reason });
    if h.cols() != n || h.rows() != n - k {
        return invalid(format!(
            "H is {}x{}, expected {}x{n}",
            h.rows(),
            h.cols(),
            n - k
        ));
    }
    if h.rank() != n - k {
        return invalid(format!("H has rank {} < n - k = {}", h.rank(), n - k));
    }
    if !generator.mul(&h.transpose())?.is_zero() {
        return invalid("G·Hᵀ is not zero".into());
    }
    Ok(())
}

/// `A_w` by enumerating the smaller of the code and its dual (MacWilliams
/// identity for the dual), with a Gray-code walk: one XOR per word.
fn weight_distribution(
    n: usize,
    k: usize,
    generator_rows: &[u64],
    parity_rows: &[u64],
    limits: CodeLimits,
) -> Result<Vec<u64>> {
    let r = n - k;
    let dim = k.min(r);
    let words = 1u128 << dim;
    if words > u128::from(limits.max_enumeration) {
        return Err(Gf2Error::TooLarge {
            what: "weight-distribution enumeration",
            required: words,
            limit: u128::from(limits.max_enumeration),
        });
    }
    if k <= r {
        Ok(enumerate_weights(n, generator_rows))
    } else {
        let dual = enumerate_weights(n, parity_rows);
        Ok(macwilliams(n, r, &dual))
    }
}

fn enumerate_weights(n: usize, rows: &[u64]) -> Vec<u64> {
    let mut hist = vec![0u64; n + 1];
    let mut word = 0u64;
    hist[0] = 1;
    for i in 1u64..(1u64 << rows.len()) {
        word ^= rows[i.trailing_zeros() as usize];
        hist[word.count_ones() as usize] += 1;
    }
    hist
}

/// MacWilliams: `A_j = 2^-(n-k_dual) Σ_i B_i K_j(i)` with Krawtchouk polynomials
/// `K_j(i) = Σ_s (−1)^s C(i, s) C(n − i, j − s)`, in exact integer arithmetic.
fn macwilliams(n: usize, dual_dim: usize, dual: &[u64]) -> Vec<u64> {
    let binom = binomials(n);
    (0..=n)
        .map(|j| {
            let sum: i128 = (0..=n)
                .map(|i| {
                    let kraw: i128 = (0..=j.min(i))
                        .filter(|&s| j - s <= n - i)
                        .map(|s| {
                            let term = binom[i][s] as i128 * binom[n - i][j - s] as i128;
                            if s % 2 == 0 { term } else { -term }
                        })
                        .sum();
                    dual[i] as i128 * kraw
                })
                .sum();
            let a = sum >> dual_dim;
            debug_assert_eq!(a << dual_dim, sum, "MacWilliams sum must divide exactly");
            a as u64
        })
        .collect()
}

fn binomials(n: usize) -> Vec<Vec<u64>> {
    let mut c = vec![vec![0u64; n + 1]; n + 1];
    for i in 0..=n {
        c[i][0] = 1;
        for j in 1..=i {
            c[i][j] = c[i - 1][j - 1] + if j < i { c[i - 1][j] } else { 0 };
        }
    }
    c
}

/// Coset leaders by enumerating error patterns in order of weight until every
/// syndrome is reached, finishing the last weight so that ties are counted.
fn coset_leaders(
    n: usize,
    r: usize,
    h_columns: &[u64],
    limits: CodeLimits,
) -> Result<Vec<CosetLeader>> {
    let size = 1usize << r;
    let mut leaders = vec![
        CosetLeader {
            pattern: 0,
            weight: u32::MAX,
            multiplicity: 0,
        };
        size
    ];
    leaders[0] = CosetLeader {
        pattern: 0,
        weight: 0,
        multiplicity: 1,
    };
    let mut reached = 1usize;
    let binom = binomials(n);
    let mut work: u128 = 1;
    let mut weight = 0;
    while reached < size {
        weight += 1;
        work += u128::from(binom[n][weight]);
        if work > u128::from(limits.max_enumeration) {
            return Err(Gf2Error::TooLarge {
                what: "coset-leader enumeration",
                required: work,
                limit: u128::from(limits.max_enumeration),
            });
        }
        visit_patterns(n, weight, h_columns, &mut |pattern, syndrome| {
            let entry = &mut leaders[syndrome as usize];
            if entry.multiplicity == 0 {
                *entry = CosetLeader {
                    pattern,
                    weight: weight as u32,
                    multiplicity: 1,
                };
                reached += 1;
            } else if entry.weight == weight as u32 {
                entry.multiplicity = entry.multiplicity.saturating_add(1);
            }
        });
    }
    Ok(leaders)
}

/// Calls `f(pattern, syndrome)` for every n-bit pattern of the given weight, in
/// lexicographic order of positions.
fn visit_patterns(n: usize, weight: usize, h_columns: &[u64], f: &mut impl FnMut(u64, u64)) {
    fn rec(
        start: usize,
        left: usize,
        n: usize,
        pattern: u64,
        syndrome: u64,
        h: &[u64],
        f: &mut impl FnMut(u64, u64),
    ) {
        if left == 0 {
            f(pattern, syndrome);
            return;
        }
        for j in start..=n - left {
            rec(j + 1, left - 1, n, pattern | 1 << j, syndrome ^ h[j], h, f);
        }
    }
    rec(0, weight, n, 0, 0, h_columns, f);
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn random_generator() -> impl Strategy<Value = BitMatrix> {
        (1usize..=12, 0usize..=10).prop_flat_map(|(k, extra)| {
            let n = k + extra;
            proptest::collection::vec(any::<u64>(), k)
                .prop_map(move |rows| BitMatrix::from_u64_rows(&rows, n).unwrap())
        })
    }

    /// The naive oracle: enumerate all 2^k codewords directly.
    fn naive_weights(g: &BitMatrix) -> Vec<u64> {
        let rows = g.to_u64_rows().unwrap();
        let mut hist = vec![0u64; g.cols() + 1];
        for d in 0u64..(1 << rows.len()) {
            let c = (0..rows.len())
                .filter(|&i| d >> i & 1 == 1)
                .fold(0, |c, i| c ^ rows[i]);
            hist[c.count_ones() as usize] += 1;
        }
        hist
    }

    proptest! {
        #[test]
        fn random_codes_have_consistent_structure(g in random_generator()) {
            let code = match LinearCode::from_generator(g.clone()) {
                Ok(code) => code,
                Err(Gf2Error::RankDeficient { rank, rows }) => {
                    prop_assert!(rank < rows);
                    prop_assert_eq!(rank, g.rank());
                    return Ok(());
                }
                Err(e) => return Err(TestCaseError::fail(format!("unexpected {e}"))),
            };
            let (n, k) = (code.n(), code.k());
            prop_assert!(g.mul(&code.parity_check().transpose()).unwrap().is_zero());
            prop_assert_eq!(code.parity_check().rank(), n - k);
            // Weight distribution (via the dual and MacWilliams when n - k < k) equals brute force.
            prop_assert_eq!(code.weight_distribution(), &naive_weights(&g)[..]);
            // Every data word round-trips, and leaders are minimum weight in their coset.
            for d in 0u64..(1 << k) {
                let c = code.encode(d).unwrap();
                prop_assert!(code.is_codeword(c).unwrap());
                prop_assert_eq!(code.extract_data(c).unwrap(), d);
            }
            let mut seen = vec![0u64; 1 << (n - k)];
            for e in 0u64..(1u64 << n) {
                let s = code.syndrome(e).unwrap() as usize;
                let l = code.syndrome_table()[s];
                prop_assert!(e.count_ones() >= l.weight);
                if e.count_ones() == l.weight { seen[s] += 1; }
            }
            for (s, l) in code.syndrome_table().iter().enumerate() {
                prop_assert_eq!(code.syndrome(l.pattern).unwrap() as usize, s);
                prop_assert_eq!(u64::from(l.multiplicity), seen[s]);
            }
            // Every error pattern within t is corrected.
            let t = code.correction_radius();
            for e in (0u64..(1u64 << n)).filter(|e| e.count_ones() as usize <= t) {
                let c = code.encode((1u64 << k) - 1).unwrap();
                let dec = code.decode_word(c ^ e).unwrap();
                prop_assert_eq!(dec.codeword, c);
            }
        }
    }

    #[test]
    fn refuses_bad_generators_and_huge_tables() {
        let dependent = BitMatrix::from_str_rows(&["1100", "0011", "1111"]).unwrap();
        assert_eq!(
            LinearCode::from_generator(dependent).unwrap_err(),
            Gf2Error::RankDeficient { rank: 2, rows: 3 }
        );
        assert!(matches!(
            LinearCode::from_generator(BitMatrix::zeros(0, 5)),
            Err(Gf2Error::UnsupportedCode { .. })
        ));
        assert!(matches!(
            LinearCode::from_generator(BitMatrix::identity(65)),
            Err(Gf2Error::UnsupportedCode { .. })
        ));
        // A [64, 1] repetition code needs a 2^63-entry syndrome table.
        let rep = BitMatrix::from_u64_rows(&[u64::MAX], 64).unwrap();
        assert!(matches!(
            LinearCode::from_generator(rep),
            Err(Gf2Error::TooLarge {
                what: "syndrome table",
                ..
            })
        ));
        // A [64, 32] code needs 2^32 codewords for its weight distribution.
        let rows: Vec<u64> = (0..32).map(|i| 1u64 << i | 0xDEAD_BEEF_u64 << 32).collect();
        let g = BitMatrix::from_u64_rows(&rows, 64).unwrap();
        let limits = CodeLimits {
            max_syndrome_bits: 32,
            max_enumeration: 1 << 20,
        };
        assert!(matches!(
            LinearCode::with_limits(g, None, limits),
            Err(Gf2Error::TooLarge { .. })
        ));
    }

    #[test]
    fn refuses_wrong_parity_check() {
        let g = BitMatrix::from_str_rows(&["1011", "0111"]).unwrap();
        let wrong = BitMatrix::from_str_rows(&["1000", "0100"]).unwrap();
        assert!(matches!(
            LinearCode::with_parity_check(g.clone(), wrong),
            Err(Gf2Error::InvalidParityCheck { .. })
        ));
        let rank_one = BitMatrix::from_str_rows(&["1110", "1110"]).unwrap();
        assert!(matches!(
            LinearCode::with_parity_check(g.clone(), rank_one),
            Err(Gf2Error::InvalidParityCheck { .. })
        ));
        let code = LinearCode::from_generator(g).unwrap();
        assert!(code.encode(0b100).is_err());
        assert!(code.decode_word(0b10000).is_err());
    }

    #[test]
    fn non_systematic_information_set() {
        // Column 0 is all zero, so the information set is {1, 2}.
        let g = BitMatrix::from_str_rows(&["0110", "0011"]).unwrap();
        let code = LinearCode::from_generator(g.clone()).unwrap();
        assert_eq!(code.information_set(), &[1, 2]);
        for d in 0..4 {
            assert_eq!(code.extract_data(code.encode(d).unwrap()).unwrap(), d);
        }
        assert!(g.mul(&code.parity_check().transpose()).unwrap().is_zero());
        // The zero column can never be covered: distance 2 ([0110] and [0011] have weight 2).
        assert_eq!(code.min_distance(), 2);
    }
}
