//! The crate's error type: every input a caller can get wrong ends here.

use gf2_codes::Gf2Error;
use thiserror::Error;

/// Errors returned by `kv-quant`.
#[derive(Debug, Clone, PartialEq, Error)]
#[non_exhaustive]
pub enum KvQuantError {
    /// A cache-form spelling that does not parse, or asks for contradictory things.
    #[error(
        "invalid cache form {spec:?}: {reason}\nvalid forms: {}",
        crate::spec::GRAMMAR
    )]
    InvalidSpec {
        /// The text that was given.
        spec: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A per-layer form policy that does not parse or does not fit the model.
    #[error(
        "invalid layer forms {spec:?}: {reason}\nvalid layer forms: {}",
        crate::spec::LAYER_GRAMMAR
    )]
    InvalidLayerForms {
        /// The text that was given (cut when long).
        spec: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A form that needs fitted data (a vector-quantization codebook) was
    /// used without it, or with data fitted for another shape.
    #[error("{form} needs {what}: {reason}")]
    Calibration {
        /// The form.
        form: String,
        /// What it needs.
        what: &'static str,
        /// What is missing or wrong.
        reason: String,
    },
    /// A NaN or infinite input value under [`NonFinite::Reject`](crate::NonFinite::Reject).
    #[error(
        "non-finite input {value} at token {token}, channel {channel} (quantize with NonFinite::Clamp to saturate instead)"
    )]
    NonFinite {
        /// Token (row) of the value.
        token: usize,
        /// Channel (column) of the value.
        channel: usize,
        /// The value itself.
        value: f32,
    },
    /// A finite input or derived scale that the chosen storage type cannot hold.
    #[error(
        "{what} {value} does not fit in {dtype} (largest finite {max}); use a wider scale type or clamp"
    )]
    OutOfRange {
        /// What overflowed (input value, scale, offset).
        what: &'static str,
        /// The value.
        value: f64,
        /// The storage type.
        dtype: &'static str,
        /// Its largest finite value.
        max: f64,
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
    /// A parameter outside its valid range.
    #[error("invalid {name}: {reason}")]
    InvalidParameter {
        /// The parameter.
        name: &'static str,
        /// Why it is invalid.
        reason: String,
    },
    /// A row range outside the stored tokens.
    #[error("rows {start}..{end} are outside the {tokens} stored tokens")]
    RowRange {
        /// First row asked for.
        start: usize,
        /// One past the last row asked for.
        end: usize,
        /// Tokens held.
        tokens: usize,
    },
    /// Two stores (or a store and an encoder) that must share form and shape do not.
    #[error("stores differ: {0}")]
    StoreMismatch(String),
    /// An error from the codes layer.
    #[error(transparent)]
    Code(#[from] Gf2Error),
}

/// Result alias of this crate.
pub type Result<T> = std::result::Result<T, KvQuantError>;

/// Checks a slice length, naming the operand on failure.
pub(crate) fn check_len(what: &'static str, expected: usize, found: usize) -> Result<()> {
    if expected == found {
        Ok(())
    } else {
        Err(KvQuantError::ShapeMismatch {
            what,
            expected,
            found,
        })
    }
}

/// Refuses a row-major matrix of `channels` columns holding a NaN or an
/// infinity, naming the first one's token and channel.
pub(crate) fn check_finite(rows: &[f32], channels: usize) -> Result<()> {
    match rows.iter().position(|x| !x.is_finite()) {
        Some(i) => Err(KvQuantError::NonFinite {
            token: i / channels,
            channel: i % channels,
            value: rows[i],
        }),
        None => Ok(()),
    }
}

/// Refuses a matrix without channels.
pub(crate) fn check_channels(channels: usize) -> Result<()> {
    if channels == 0 {
        return Err(KvQuantError::InvalidParameter {
            name: "channels",
            reason: "a KV matrix needs at least one channel".into(),
        });
    }
    Ok(())
}
