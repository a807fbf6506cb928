//! The crate's error type.

/// Errors of checked GEMM and its thresholds.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum AbftError {
    /// Inner dimensions or buffer lengths do not fit.
    #[error("shape mismatch: {0}")]
    Shape(String),
    /// A matrix has no rows or no columns.
    #[error("{0} is empty")]
    Empty(&'static str),
    /// An input holds NaN or an infinity: checksums cannot tell a soft error
    /// from it, so the product is refused rather than flagged.
    #[error("{matrix}[{row}, {col}] is not finite ({value})")]
    NonFinite {
        /// `"A"` or `"B"`.
        matrix: &'static str,
        /// Row.
        row: usize,
        /// Column.
        col: usize,
        /// The value.
        value: f32,
    },
    /// A parameter is out of its domain.
    #[error("invalid {name}: {reason}")]
    InvalidParameter {
        /// The parameter.
        name: &'static str,
        /// Why.
        reason: String,
    },
}

/// Result alias of this crate.
pub type Result<T> = std::result::Result<T, AbftError>;
