//! The paper's three codes with its exact matrices (ecc-kv-cache-paper, section 5):
//! Hamming(7,4) (eqs. 16-17), extended Hamming(8,4) SECDED (eqs. 22-23) and the
//! extended Golay(24,12) code (eqs. 31-34).
//!
//! Matrices are written row by row, column 0 first, exactly as printed.

use crate::code::LinearCode;
use crate::matrix::BitMatrix;

/// Hamming(7,4) parity-check matrix H, eq. (16).
pub const HAMMING74_H: [&str; 3] = ["1101100", "1011010", "0111001"];

/// Hamming(7,4) generator G = [I₄ | P], eq. (17).
pub const HAMMING74_G: [&str; 4] = ["1000110", "0100101", "0010011", "0001111"];

/// Extended Hamming(8,4) generator Ḡ, eq. (22).
pub const SECDED84_G: [&str; 4] = ["10001101", "01001011", "00100111", "00011110"];

/// Extended Hamming(8,4) parity-check matrix H̄, eq. (23): rows 0-2 are the
/// local Hamming syndrome, row 3 the overall parity.
pub const SECDED84_H: [&str; 4] = ["11011000", "10110100", "01110010", "11111111"];

/// The 12x12 matrix B of the extended Golay code, eq. (31).
pub const GOLAY24_B: [&str; 12] = [
    "110111000101",
    "101110001011",
    "011100010111",
    "111000101101",
    "110001011011",
    "100010110111",
    "000101101111",
    "001011011101",
    "010110111001",
    "101101110001",
    "011011100011",
    "111111111110",
];

fn parse(rows: &[&str]) -> BitMatrix {
    BitMatrix::from_str_rows(rows).expect("the paper's matrices are well formed")
}

/// B of eq. (31) as a matrix.
pub fn golay24_b() -> BitMatrix {
    parse(&GOLAY24_B)
}

/// Golay generator `G₂₄ = [I₁₂ | B]`, eq. (33).
pub fn golay24_generator() -> BitMatrix {
    BitMatrix::identity(12)
        .hstack(&golay24_b())
        .expect("both have 12 rows")
}

/// Golay parity-check matrix `H₂₄ = [Bᵀ | I₁₂]`, eq. (34).
pub fn golay24_parity_check() -> BitMatrix {
    golay24_b()
        .transpose()
        .hstack(&BitMatrix::identity(12))
        .expect("both have 12 rows")
}

/// Hamming(7,4) with the paper's G and H: `[7, 4, 3]`, perfect.
pub fn hamming74() -> LinearCode {
    LinearCode::with_parity_check(parse(&HAMMING74_G), parse(&HAMMING74_H))
        .expect("the paper's Hamming(7,4) matrices are consistent")
}

/// Extended Hamming(8,4) SECDED with the paper's Ḡ and H̄: `[8, 4, 4]`.
pub fn secded84() -> LinearCode {
    LinearCode::with_parity_check(parse(&SECDED84_G), parse(&SECDED84_H))
        .expect("the paper's SECDED matrices are consistent")
}

/// Extended Golay(24,12) with the paper's G₂₄ and H₂₄: `[24, 12, 8]`.
pub fn golay24() -> LinearCode {
    LinearCode::with_parity_check(golay24_generator(), golay24_parity_check())
        .expect("the paper's Golay matrices are consistent")
}
