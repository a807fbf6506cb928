//! The crate's error type: every input a caller can get wrong ends here.

use kv_quant::KvQuantError;
use thiserror::Error;

/// Errors returned by `kv-lowrank`.
#[derive(Debug, Clone, PartialEq, Error)]
#[non_exhaustive]
pub enum LowRankError {
    /// A parameter outside its valid range (a rank of 0 or above the head
    /// dimension, an energy outside (0, 1], a sketch smaller than twice the rank).
    #[error("invalid {name}: {reason}")]
    InvalidParameter {
        /// The parameter.
        name: &'static str,
        /// Why it is invalid.
        reason: String,
    },
    /// A slice or matrix whose size does not match what the call needs.
    #[error("{what} has size {found}, expected {expected}")]
    ShapeMismatch {
        /// Which operand.
        what: &'static str,
        /// The size the call needs.
        expected: usize,
        /// The size it was given.
        found: usize,
    },
    /// A NaN or infinite value in rows to project or fit on.
    #[error("non-finite value {value} at row {row}, channel {channel}")]
    NonFinite {
        /// Row of the value.
        row: usize,
        /// Channel of the value.
        channel: usize,
        /// The value itself.
        value: f32,
    },
    /// Too few rows to fit a basis of the requested rank.
    #[error(
        "{rows} rows cannot fit a basis of rank {rank} (need at least as many rows as the rank)"
    )]
    TooFewRows {
        /// Rows given.
        rows: usize,
        /// Rank asked for.
        rank: usize,
    },
    /// Bases that do not fit the store or the form (another model shape,
    /// another head dimension, a missing head).
    #[error("bases do not fit: {0}")]
    Bases(String),
    /// An error of the coefficient store.
    #[error(transparent)]
    Quant(#[from] KvQuantError),
}

/// Result alias of this crate.
pub type Result<T> = std::result::Result<T, LowRankError>;

/// Checks a slice length, naming the operand on failure.
pub(crate) fn check_len(what: &'static str, expected: usize, found: usize) -> Result<()> {
    if expected == found {
        Ok(())
    } else {
        Err(LowRankError::ShapeMismatch {
            what,
            expected,
            found,
        })
    }
}

/// Refuses NaN and infinities in `rows` (`width` values per row).
pub(crate) fn check_finite(rows: &[f32], width: usize) -> Result<()> {
    match rows.iter().position(|x| !x.is_finite()) {
        None => Ok(()),
        Some(i) => Err(LowRankError::NonFinite {
            row: i / width.max(1),
            channel: i % width.max(1),
            value: rows[i],
        }),
    }
}
