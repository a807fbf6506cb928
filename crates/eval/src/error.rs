//! The crate's error type.

use std::path::PathBuf;

/// Errors of model loading, evaluation and the command line.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EvalError {
    /// A file could not be opened or read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// A metadata key or tensor the model needs is missing or has the wrong type.
    #[error("model file: {0}")]
    Model(String),
    /// Weights or configurations whose shapes do not fit each other.
    #[error("shape mismatch: {0}")]
    Shape(String),
    /// A buffer or count does not have the size the call needs.
    #[error("{what}: {got}, expected {expected}")]
    ShapeMismatch {
        /// What was measured.
        what: &'static str,
        /// The size the call needs.
        expected: usize,
        /// The size it got.
        got: usize,
    },
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
    /// A forward call with no tokens, or logits asked from past its tokens.
    #[error("{tokens} tokens with logits from token {logits_from}")]
    EmptyForward {
        /// Tokens in the call.
        tokens: usize,
        /// The first token whose logits were asked for.
        logits_from: usize,
    },
    /// Something sized from user input would not fit the memory budget
    /// ([`crate::budget`]).
    #[error(
        "{what} would take {}, over the memory budget of {} ({origin})",
        crate::budget::human(*bytes),
        crate::budget::human(*limit)
    )]
    MemoryBudget {
        /// What was asked for (with the numbers that size it).
        what: String,
        /// Bytes it would take.
        bytes: u64,
        /// The budget.
        limit: u64,
        /// Where the budget came from.
        origin: String,
    },
    /// A parameter is out of its domain.
    #[error("invalid {name}: {reason}")]
    InvalidParameter {
        /// The parameter.
        name: &'static str,
        /// Why it is invalid.
        reason: String,
    },
    /// A token id is past the vocabulary.
    #[error("token id {id} is past the vocabulary of {vocab}")]
    TokenId {
        /// The id.
        id: u32,
        /// The vocabulary size.
        vocab: usize,
    },
    /// A cache form or fault channel failed.
    #[error(transparent)]
    Quant(#[from] kv_quant::KvQuantError),
    /// A low-rank store refused its input.
    #[error(transparent)]
    LowRank(#[from] kv_lowrank::LowRankError),
    /// The attention kernel refused its input.
    #[error(transparent)]
    Attention(#[from] attention::AttentionError),
    /// A projection's shapes disagree.
    #[error(transparent)]
    Gemm(#[from] abft_gemm::AbftError),
    /// The paged cache refused a form, a shape or a step.
    #[error(transparent)]
    Paged(#[from] paged_cache::PagedCacheError),
    /// The model runner's foundation failed: a GGUF file, the tokenizer,
    /// a weight product or layout.
    #[error(transparent)]
    KvModel(#[from] kv_model::ModelError),
    /// A fault channel could not be built.
    #[error(transparent)]
    Channel(#[from] gf2_codes::Gf2Error),
    /// A safetensors file (checkpoint or calibration) is malformed: what is
    /// wrong, and the safetensors crate's own error when it found it.
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
    /// Writing a report failed.
    #[error("report: {0}")]
    Report(String),
}

/// Result alias of this crate.
pub type Result<T> = std::result::Result<T, EvalError>;
