//! # gf2-codes
//!
//! The foundation of the workspace: linear algebra over GF(2), binary linear
//! block codes, the three codes of the ECC KV-cache paper with batch INT4
//! codecs fast enough to sit in an attention loop, and seeded fault channels
//! whose every flip is accounted for.
//!
//! - [`BitVec`], [`BitMatrix`]: packed vectors and matrices with multiply,
//!   transpose, rank, row echelon (systematic) form, null space and inverse.
//! - [`LinearCode`]: any generator matrix → parity-check matrix, minimum
//!   distance, weight distribution, syndrome table of coset leaders, decoding.
//! - [`standard`]: Hamming(7,4), SECDED(8,4) and Golay(24,12) with the paper's
//!   exact matrices.
//! - [`batch`]: byte-layout codecs for INT4 values ([`Hamming74`], [`Secded84`],
//!   [`Golay24`]), with SIMD decoders chosen at run time.
//! - [`channel`]: fault channels (binary symmetric, bursts, multi-bit upsets,
//!   stuck-at cells, word and row faults) driven by an explicit seed.
//!
//! ```
//! use gf2_codes::{standard, DecodeOutcome};
//!
//! let code = standard::secded84();
//! assert_eq!((code.n(), code.k(), code.min_distance()), (8, 4, 4));
//! let c = code.encode(0b0010).unwrap();
//! let two_flips = code.decode_word(c ^ 0b0000_0110).unwrap();
//! assert_eq!(two_flips.outcome, DecodeOutcome::Detected);
//! ```

pub mod batch;
mod bitvec;
pub mod channel;
mod code;
mod error;
mod matrix;
pub mod standard;
mod stats;

pub use batch::{Golay24, Hamming74, Int4Code, Secded84};
pub use bitvec::BitVec;
pub use code::{CodeLimits, CosetLeader, LinearCode, WordDecode};
pub use error::{Gf2Error, Result};
pub use matrix::{BitMatrix, RowEchelon};
pub use stats::{DecodeOutcome, DecodeStats};

/// The README's example, compiled and run as a doctest.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
