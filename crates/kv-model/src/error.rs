//! The crate's error type.

use crate::weights::{Isa, WeightType};

/// Errors of the weight products.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ModelError {
    /// A ggml type id this crate does not know.
    #[error("ggml type id {0} is not a weight type this crate knows")]
    UnknownType(u32),
    /// A row length that is not a whole number of the type's blocks.
    #[error("a row of {cols} values is not a whole number of {ty} blocks of {block}")]
    PartialBlock {
        /// The weight type.
        ty: WeightType,
        /// Values per row.
        cols: usize,
        /// Values per block of the type.
        block: usize,
    },
    /// Stored bytes that are not what the shape and type need.
    #[error("{what}: {got} bytes, but {rows} rows of {cols} {ty} values take {expected}")]
    DataLength {
        /// What the bytes are (a tensor name or "weights").
        what: String,
        /// The weight type.
        ty: WeightType,
        /// Rows.
        rows: usize,
        /// Values per row.
        cols: usize,
        /// The bytes the shape needs.
        expected: usize,
        /// The bytes given.
        got: usize,
    },
    /// A shape whose element or byte count overflows `usize`.
    #[error("{rows} × {cols} {ty} values overflow the address space")]
    TooLarge {
        /// The weight type.
        ty: WeightType,
        /// Rows.
        rows: usize,
        /// Values per row.
        cols: usize,
    },
    /// A buffer whose length does not fit the product.
    #[error("{what}: {got} values, expected {expected}")]
    ShapeMismatch {
        /// Which buffer.
        what: &'static str,
        /// The length the call needs.
        expected: usize,
        /// The length given.
        got: usize,
    },
    /// Matrices stacked into one linear layer with different row lengths.
    #[error("stacked matrices have {got} and {expected} columns")]
    StackColumns {
        /// The first matrix's columns.
        expected: usize,
        /// A later matrix's columns.
        got: usize,
    },
    /// A type with no product kernel (dequantise it to F32 first).
    #[error("no product kernel for {0} weights (dequantise them to F32)")]
    NoKernel(WeightType),
    /// An instruction set pinned by the caller that this CPU lacks.
    #[error("this CPU cannot run the {0:?} kernels")]
    IsaUnavailable(Isa),
}

/// The crate's result type.
pub type Result<T> = std::result::Result<T, ModelError>;
