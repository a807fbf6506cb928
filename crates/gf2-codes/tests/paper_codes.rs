//! The paper's three codes: the identities its matrices satisfy, their true
//! distance profiles, and exhaustive decoding over every error pattern up to
//! weight 3 (and every weight-4 pattern for Golay).

use gf2_codes::channel::FaultRng;
use gf2_codes::{BitMatrix, DecodeOutcome, DecodeStats, LinearCode, standard};

fn patterns(n: usize, weight: u32) -> impl Iterator<Item = u64> {
    (0u64..1 << n).filter(move |e| e.count_ones() == weight)
}

fn binom(n: u64, k: u64) -> u64 {
    (0..k).fold(1, |acc, i| acc * (n - i) / (i + 1))
}

#[test]
fn hamming74_matrices_and_properties() {
    let code = standard::hamming74();
    let g = code.generator();
    let h = code.parity_check();
    assert!(g.mul(&h.transpose()).unwrap().is_zero(), "G·Hᵀ = 0");
    // H's columns are the seven non-zero vectors of F₂³ (section 5.1.1).
    let mut cols: Vec<u64> = (0..7).map(|j| h.column(j).to_u64()).collect();
    cols.sort_unstable();
    assert_eq!(cols, (1..8).collect::<Vec<_>>());
    assert_eq!((code.n(), code.k(), code.min_distance()), (7, 4, 3));
    assert_eq!(code.correction_radius(), 1);
    assert_eq!(code.detection_capability(), 2);
    assert_eq!(code.weight_distribution(), &[1, 0, 0, 7, 7, 0, 0, 1]);
    assert!(code.is_perfect(), "16 spheres of 8 words fill F₂⁷");
    // Parity equations (18)-(20).
    for d in 0u64..16 {
        let bit = |i: u32| d >> i & 1;
        let p0 = bit(0) ^ bit(1) ^ bit(3);
        let p1 = bit(0) ^ bit(2) ^ bit(3);
        let p2 = bit(1) ^ bit(2) ^ bit(3);
        assert_eq!(code.encode(d).unwrap(), d | p0 << 4 | p1 << 5 | p2 << 6);
    }
}

#[test]
fn hamming74_paper_examples() {
    let code = standard::hamming74();
    // Example 2: d = [0,1,0,0] encodes to [0,1,0,0,1,0,1]; a flip at index 3
    // gives syndrome [1,1,1] = column 3 of H, and is corrected.
    let c = code.encode(0b0010).unwrap();
    assert_eq!(c, 0b101_0010);
    let r = c ^ 1 << 3;
    assert_eq!(code.syndrome(r).unwrap(), 0b111);
    let dec = code.decode_word(r).unwrap();
    assert_eq!((dec.outcome, dec.codeword), (DecodeOutcome::Corrected, c));
    // Example 3: errors at indices 0 and 1 give syndrome h₀ ⊕ h₁ = h₂ = [0,1,1]ᵀ,
    // and the decoder flips bit 2: three bits off.
    let r = c ^ 0b11;
    assert_eq!(code.syndrome(r).unwrap(), 0b110);
    let dec = code.decode_word(r).unwrap();
    assert_eq!(dec.error_pattern, 1 << 2);
    assert_eq!((dec.codeword ^ c).count_ones(), 3);
}

#[test]
fn secded84_matrices_and_paper_table() {
    let code = standard::secded84();
    assert!(
        code.generator()
            .mul(&code.parity_check().transpose())
            .unwrap()
            .is_zero()
    );
    assert_eq!((code.n(), code.k(), code.min_distance()), (8, 4, 4));
    assert_eq!(code.weight_distribution(), &[1, 0, 0, 0, 14, 0, 0, 0, 1]);
    assert!(!code.is_perfect());
    for d in 0u64..16 {
        assert_eq!(code.encode(d).unwrap().count_ones() % 2, 0, "even weight");
    }
    // The four rows of section 5.2.2 over every codeword and every error of weight <= 2.
    // Syndrome bits 0-2 are the local syndrome z, bit 3 the overall parity p.
    for d in 0u64..16 {
        let c = code.encode(d).unwrap();
        for e in (0u64..256).filter(|e| e.count_ones() <= 2) {
            let dec = code.decode_word(c ^ e).unwrap();
            let (z, p) = (dec.syndrome & 0b111, dec.syndrome >> 3);
            match (e.count_ones(), e == 1 << 7) {
                (0, _) => {
                    assert_eq!((z, p), (0, 0));
                    assert_eq!(dec.outcome, DecodeOutcome::Clean);
                }
                (1, true) => {
                    // "Parity bit error: ignore (data valid)".
                    assert_eq!((z, p), (0, 1));
                    assert_eq!(dec.outcome, DecodeOutcome::Corrected);
                    assert_eq!(dec.data, d);
                }
                (1, false) => {
                    assert!(z != 0 && p == 1);
                    assert_eq!((dec.outcome, dec.codeword), (DecodeOutcome::Corrected, c));
                }
                _ => {
                    assert!(z != 0 && p == 0, "double error: z ≠ 0, p = 0");
                    assert_eq!(dec.outcome, DecodeOutcome::Detected);
                }
            }
        }
    }
}

#[test]
fn golay24_matrices_and_true_structure() {
    let b = standard::golay24_b();
    // Eq. (32): B·Bᵀ = I over F₂.
    assert_eq!(b.mul(&b.transpose()).unwrap(), BitMatrix::identity(12));
    let code = standard::golay24();
    assert!(
        code.generator()
            .mul(&code.parity_check().transpose())
            .unwrap()
            .is_zero()
    );
    // Self-dual: G₂₄·G₂₄ᵀ = 0.
    let g = code.generator();
    assert!(g.mul(&g.transpose()).unwrap().is_zero());
    assert_eq!((code.n(), code.k(), code.min_distance()), (24, 12, 8));
    assert_eq!(code.correction_radius(), 3);
    assert_eq!(code.detection_capability(), 7);
    let mut expected = [0u64; 25];
    for (w, a) in [(0, 1), (8, 759), (12, 2576), (16, 759), (24, 1)] {
        expected[w] = a;
    }
    assert_eq!(code.weight_distribution(), &expected[..]);

    // 2325 syndromes with a unique leader of weight <= 3; 1771 whose leaders
    // have weight 4 (never unique: each such coset holds 6 of them).
    let table = code.syndrome_table();
    assert_eq!(table.len(), 4096);
    let unique_le3 = table
        .iter()
        .filter(|l| l.weight <= 3 && l.is_unique())
        .count();
    let weight4: Vec<_> = table.iter().filter(|l| l.weight == 4).collect();
    // The unique leaders are exactly the patterns of weight <= 3 (counted
    // from the table, not written down): C(24,0..=3) = 1 + 24 + 276 + 2024.
    assert_eq!(
        unique_le3,
        (0..=3).map(|w| binom(24, w)).sum::<u64>() as usize
    );
    for w in 0..=3u32 {
        let with_weight = table
            .iter()
            .filter(|l| l.weight == w && l.is_unique())
            .count();
        assert_eq!(with_weight as u64, binom(24, u64::from(w)), "weight {w}");
    }
    assert_eq!(weight4.len(), 1771);
    assert!(weight4.iter().all(|l| l.multiplicity == 6));
    assert_eq!(binom(24, 4), 1771 * 6);
    // So the extended code is NOT perfect (the paper says it is): its
    // covering radius is 4. The perfect one is the (23,12) code.
    assert_eq!(code.covering_radius(), 4);
    assert!(!code.is_perfect());
}

#[test]
fn punctured_golay23_is_perfect() {
    // Deleting the last coordinate of the extended code gives the perfect
    // [23, 12, 7] Golay code: every one of its 2048 syndromes has a unique
    // leader of weight <= 3 (1 + 23 + 253 + 1771 = 2048).
    let g24 = standard::golay24_generator();
    let g23 = g24.select_columns(&(0..23).collect::<Vec<_>>());
    let code = LinearCode::from_generator(g23).unwrap();
    assert_eq!((code.n(), code.k(), code.min_distance()), (23, 12, 7));
    assert!(code.is_perfect());
}

/// Decodes every codeword hit by every pattern of the given weight and
/// classifies the outcomes against the truth.
fn sweep(code: &LinearCode, weight: u32, codewords: &[u64]) -> DecodeStats {
    let mut stats = DecodeStats::default();
    for &c in codewords {
        let d = code.extract_data(c).unwrap();
        for e in patterns(code.n(), weight) {
            let dec = code.decode_word(c ^ e).unwrap();
            stats.record_with_truth(dec.outcome, dec.data == d);
        }
    }
    stats
}

#[test]
fn exhaustive_hamming74_up_to_weight_3() {
    let code = standard::hamming74();
    let all: Vec<u64> = (0..16).map(|d| code.encode(d).unwrap()).collect();
    let w1 = sweep(&code, 1, &all);
    assert_eq!((w1.words, w1.corrected), (16 * 7, 16 * 7));
    // Every double error is miscorrected into a third flipped bit: the result is
    // another codeword, so the data is always wrong and nothing is detected.
    let w2 = sweep(&code, 2, &all);
    assert_eq!((w2.words, w2.miscorrected), (16 * 21, 16 * 21));
    for &c in &all {
        for e in patterns(7, 2) {
            let dec = code.decode_word(c ^ e).unwrap();
            assert_eq!(dec.outcome, DecodeOutcome::Corrected);
            assert_eq!((dec.codeword ^ c).count_ones(), 3);
        }
    }
    // Weight 3: the 7 weight-3 codewords go through silently, the rest are miscorrected.
    let w3 = sweep(&code, 3, &all);
    assert_eq!((w3.silent, w3.miscorrected), (16 * 7, 16 * 28));
}

#[test]
fn exhaustive_secded84_up_to_weight_3() {
    let code = standard::secded84();
    let all: Vec<u64> = (0..16).map(|d| code.encode(d).unwrap()).collect();
    let w1 = sweep(&code, 1, &all);
    assert_eq!((w1.words, w1.corrected), (16 * 8, 16 * 8));
    let w2 = sweep(&code, 2, &all);
    assert_eq!((w2.words, w2.detected), (16 * 28, 16 * 28));
    // Weight 3 has odd parity and looks like a single error: always miscorrected
    // into a weight-4 codeword, never silent, never detected.
    let w3 = sweep(&code, 3, &all);
    assert_eq!(w3.words, 16 * 56);
    assert_eq!(w3.detected + w3.silent + w3.clean, 0);
    for &c in &all {
        for e in patterns(8, 3) {
            let dec = code.decode_word(c ^ e).unwrap();
            assert_eq!((dec.codeword ^ c).count_ones(), 4);
        }
    }
}

#[test]
fn exhaustive_golay24_correctable_and_weight4() {
    let code = standard::golay24();
    let mut rng = FaultRng::new(24);
    let codewords: Vec<u64> = (0..8)
        .map(|_| code.encode(rng.next_u64() & 0xFFF).unwrap())
        .collect();
    for weight in 0..=3 {
        let s = sweep(&code, weight, &codewords);
        let n = binom(24, u64::from(weight)) * codewords.len() as u64;
        assert_eq!(s.words, n);
        if weight == 0 {
            assert_eq!(s.clean, n);
        } else {
            assert_eq!(
                s.corrected, n,
                "all {n} patterns of weight {weight} corrected"
            );
        }
    }
    // Every weight-4 pattern is flagged, never miscorrected.
    let s4 = sweep(&code, 4, &codewords);
    assert_eq!(s4.words, 10626 * codewords.len() as u64);
    assert_eq!(s4.detected, s4.words);
}
