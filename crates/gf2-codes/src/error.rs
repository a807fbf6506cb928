//! The crate's error type: every input a caller can get wrong ends here.

use thiserror::Error;

/// Errors returned by `gf2-codes`.
#[derive(Debug, Clone, PartialEq, Error)]
#[non_exhaustive]
pub enum Gf2Error {
    /// Two operands (matrices, vectors, slices) have shapes that do not fit together.
    #[error("dimension mismatch in {op}: expected {expected}, found {found}")]
    DimensionMismatch {
        /// The operation that was asked for.
        op: &'static str,
        /// The size the operation needed.
        expected: usize,
        /// The size it was given.
        found: usize,
    },
    /// A slice handed to a batch call has the wrong length.
    #[error("{what} has length {found}, expected {expected}")]
    LengthMismatch {
        /// Which slice.
        what: &'static str,
        /// The length the call needs.
        expected: usize,
        /// The length it was given.
        found: usize,
    },
    /// A generator matrix whose rows are linearly dependent.
    #[error("generator matrix is not of full row rank: rank {rank} < {rows} rows")]
    RankDeficient {
        /// The rank found.
        rank: usize,
        /// The number of rows (the claimed dimension k).
        rows: usize,
    },
    /// A square matrix without an inverse.
    #[error("matrix is singular (rank {rank} < {size})")]
    Singular {
        /// The rank found.
        rank: usize,
        /// The matrix size.
        size: usize,
    },
    /// A parity-check matrix that does not describe the code of the generator.
    #[error("parity-check matrix does not match the generator: {reason}")]
    InvalidParityCheck {
        /// What was wrong.
        reason: String,
    },
    /// A code whose shape this crate does not handle (empty, or longer than 64 bits).
    #[error("unsupported code shape (n = {n}, k = {k}): {reason}")]
    UnsupportedCode {
        /// Code length.
        n: usize,
        /// Code dimension.
        k: usize,
        /// Why it is refused.
        reason: &'static str,
    },
    /// A table or enumeration that would not fit the configured limits.
    #[error("{what} needs {required} entries/steps, over the limit of {limit}")]
    TooLarge {
        /// What would have been built.
        what: &'static str,
        /// How much it would need (saturating).
        required: u128,
        /// The limit in force (see `CodeLimits`).
        limit: u128,
    },
    /// A probability outside [0, 1], or NaN.
    #[error("{name} must be a probability in [0, 1], got {value}")]
    InvalidProbability {
        /// The parameter's name.
        name: &'static str,
        /// The value given.
        value: f64,
    },
    /// Any other out-of-range parameter.
    #[error("invalid parameter {name}: {reason}")]
    InvalidParameter {
        /// The parameter's name.
        name: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// A value above 15 where an INT4 nibble was expected.
    #[error("value {value} at index {index} does not fit in a nibble (max 15)")]
    NibbleOutOfRange {
        /// Index of the first offending value.
        index: usize,
        /// The value found.
        value: u8,
    },
    /// A matrix given as text with a character other than `0` or `1`, or ragged rows.
    #[error("cannot parse bit matrix: {reason}")]
    Parse {
        /// What was wrong.
        reason: String,
    },
}

/// Shorthand for results of this crate.
pub type Result<T, E = Gf2Error> = std::result::Result<T, E>;

pub(crate) fn check_len(what: &'static str, expected: usize, found: usize) -> Result<()> {
    if expected == found {
        Ok(())
    } else {
        Err(Gf2Error::LengthMismatch {
            what,
            expected,
            found,
        })
    }
}
