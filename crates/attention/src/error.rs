//! [`AttentionError`]: every way a call into this crate can be refused.

use kv_quant::KvQuantError;

/// Errors of the attention crate.
#[derive(Debug, thiserror::Error, Clone, PartialEq)]
#[non_exhaustive]
pub enum AttentionError {
    /// A buffer or dimension does not have the size the call needs.
    #[error("shape mismatch: {what} should be {expected}, got {got}")]
    ShapeMismatch {
        /// What was measured.
        what: &'static str,
        /// The size the call needs.
        expected: usize,
        /// The size it got.
        got: usize,
    },
    /// The query heads cannot be shared out over the KV heads.
    #[error(
        "{q_heads} query heads cannot be grouped over {kv_heads} KV heads \
         (both must be positive and the KV head count must divide the query head count)"
    )]
    HeadGrouping {
        /// Query heads.
        q_heads: usize,
        /// KV heads.
        kv_heads: usize,
    },
    /// A parameter is outside its domain.
    #[error("invalid {name}: {reason}")]
    InvalidParameter {
        /// The parameter.
        name: &'static str,
        /// Why it was refused.
        reason: String,
    },
    /// A query position or key range reaches past the cached tokens.
    #[error("query {query}: {what} {position} is past the cache of {tokens} tokens")]
    PastCache {
        /// Index of the query in the call.
        query: usize,
        /// `"position"` or `"key range end"`.
        what: &'static str,
        /// The offending position.
        position: usize,
        /// Tokens in the cache.
        tokens: usize,
    },
    /// The cache holds no token.
    #[error("the KV cache is empty")]
    EmptyCache,
    /// A query holds NaN or an infinity (under [`OnNonFinite::Error`](crate::OnNonFinite::Error)).
    #[error("query {query}, head {head}, channel {channel} is not finite ({value})")]
    NonFiniteQuery {
        /// Index of the query in the call.
        query: usize,
        /// Query head.
        head: usize,
        /// Channel within the head.
        channel: usize,
        /// The value.
        value: f32,
    },
    /// The output came out NaN or infinite: the cache holds non-finite keys
    /// or values (for example after faults in an `fp16` cache). Set
    /// [`OnNonFinite::Report`](crate::OnNonFinite::Report) to get the output anyway.
    #[error(
        "{count} output values are not finite (first: query {query}, head {head}); \
         the cache holds NaN or infinite keys or values"
    )]
    NonFiniteOutput {
        /// Non-finite output values.
        count: usize,
        /// Query of the first one.
        query: usize,
        /// Head of the first one.
        head: usize,
    },
    /// Reading a stored form failed.
    #[error(transparent)]
    Store(#[from] KvQuantError),
    /// Reading a low-rank store failed.
    #[error(transparent)]
    LowRank(#[from] kv_lowrank::LowRankError),
}

/// Result alias of this crate.
pub type Result<T, E = AttentionError> = std::result::Result<T, E>;

pub(crate) fn check_len(what: &'static str, expected: usize, got: usize) -> Result<()> {
    if expected == got {
        Ok(())
    } else {
        Err(AttentionError::ShapeMismatch {
            what,
            expected,
            got,
        })
    }
}
