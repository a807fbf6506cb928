//! The crate's error type.

use std::path::PathBuf;

use crate::weights::{Isa, WeightType};

/// Errors of model files, the tokenizer and the weight products.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ModelError {
    /// A file could not be opened or read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// A GGUF file is malformed (the reason says where and how).
    #[error("malformed GGUF: {0}")]
    Gguf(String),
    /// A GGUF file uses a version this reader does not know.
    #[error("unsupported GGUF version {0} (versions 2 and 3 are read)")]
    GgufVersion(u32),
    /// A tensor's element type is not one this crate can dequantise.
    #[error(
        "tensor {name}: type {ty} is not a weight type (the ggml float and block types are; integer types, F64 and Q8_1 are not)"
    )]
    UnsupportedType {
        /// Tensor name.
        name: String,
        /// The ggml type name.
        ty: String,
    },
    /// A safetensors checkpoint is malformed: what is wrong, and where,
    /// and the safetensors crate's own error when it found it.
    #[error(
        "safetensors: {context}{}",
        source.as_ref().map(|s| format!(": {s}")).unwrap_or_default()
    )]
    Safetensors {
        /// What is wrong, and where.
        context: String,
        /// The safetensors crate's error, when the problem was found there.
        #[source]
        source: Option<safetensors::SafeTensorError>,
    },
    /// A metadata key or tensor the model needs is missing or has the
    /// wrong type.
    #[error("model file: {0}")]
    ModelFile(String),
    /// The tokenizer could not be built or failed.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// An index past the end of what it indexes.
    #[error("{what} {index} is past the {len} there are")]
    OutOfRange {
        /// What is indexed (`"row of blk.0.attn_q.weight"`).
        what: String,
        /// The index asked for.
        index: usize,
        /// How many there are.
        len: usize,
    },
    /// A parameter is out of its domain.
    #[error("invalid {name}: {reason}")]
    InvalidParameter {
        /// The parameter.
        name: &'static str,
        /// Why it is invalid.
        reason: String,
    },
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
    /// Weights or configurations whose shapes do not fit each other.
    #[error("shape mismatch: {0}")]
    Shape(String),
    /// A forward call with no tokens, or logits asked from past its tokens.
    #[error("{tokens} tokens with logits from token {logits_from}")]
    EmptyForward {
        /// Tokens in the call.
        tokens: usize,
        /// The first token whose logits were asked for.
        logits_from: usize,
    },
    /// A token id is past the vocabulary.
    #[error("token id {id} is past the vocabulary of {vocab}")]
    TokenId {
        /// The id.
        id: u32,
        /// The vocabulary size.
        vocab: usize,
    },
    /// The attention kernel (or a KV backend, through it) refused its input.
    #[error(transparent)]
    Attention(#[from] attention::AttentionError),
    /// The paged cache refused a form, a shape or a step.
    #[error(transparent)]
    Paged(#[from] paged_cache::PagedCacheError),
    /// A dense f32 product's shapes disagree (abft-gemm's linear layer).
    #[error(transparent)]
    Gemm(#[from] abft_gemm::AbftError),
    /// An error of a KV backend or projection hook defined outside this
    /// crate (kv-eval's re-encode protocol, its GEMM checks), kept whole:
    /// its owner can downcast it back.
    #[error(transparent)]
    External(Box<dyn std::error::Error + Send + Sync + 'static>),
    /// An instruction set pinned by the caller that this CPU lacks.
    #[error("this CPU cannot run the {0:?} kernels")]
    IsaUnavailable(Isa),
}

/// The crate's result type.
pub type Result<T> = std::result::Result<T, ModelError>;
