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
    /// The model runner failed: a GGUF file, the tokenizer, a weight
    /// product or layout, a forward pass (errors of kv-eval's own KV
    /// backends and hooks come back as themselves: see the `From` impls).
    #[error(transparent)]
    KvModel(kv_model::ModelError),
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

/// A model runner's error as this crate's: errors kv-eval's backends and
/// hooks handed the runner ([`ModelError::External`](kv_model::ModelError::External) holding an
/// [`EvalError`]) come back as they were; attention's, the paged cache's,
/// invalid parameters, model-file and I/O errors as this crate's variants
/// of the same name; the rest as [`EvalError::KvModel`].
impl From<kv_model::ModelError> for EvalError {
    fn from(e: kv_model::ModelError) -> Self {
        match e {
            kv_model::ModelError::External(inner) => match inner.downcast::<EvalError>() {
                Ok(ours) => *ours,
                Err(other) => Self::KvModel(kv_model::ModelError::External(other)),
            },
            kv_model::ModelError::Attention(e) => Self::Attention(e),
            kv_model::ModelError::Paged(e) => Self::Paged(e),
            kv_model::ModelError::InvalidParameter { name, reason } => {
                Self::InvalidParameter { name, reason }
            }
            kv_model::ModelError::ModelFile(m) => Self::Model(m),
            kv_model::ModelError::Io { path, source } => Self::Io { path, source },
            kv_model::ModelError::Safetensors { context, source } => {
                Self::Safetensors { context, source }
            }
            e => Self::KvModel(e),
        }
    }
}

/// This crate's error handed to the model runner (by a KV backend or a
/// projection hook): kept whole in [`ModelError::External`](kv_model::ModelError::External), unless it is
/// the runner's own.
impl From<EvalError> for kv_model::ModelError {
    fn from(e: EvalError) -> Self {
        match e {
            EvalError::KvModel(inner) => inner,
            e => Self::External(Box::new(e)),
        }
    }
}

/// Result alias of this crate.
pub type Result<T> = std::result::Result<T, EvalError>;
