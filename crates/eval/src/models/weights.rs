//! A projection's weights: as the file stores them (kv-model's
//! [`StoredLinear`], multiplied by 8-bit-quantised activations as llama.cpp
//! does) or dense f32 (abft-gemm's [`Matrix`], faer's GEMM: Hugging Face
//! checkpoints, tiny test models, and every projection of a run whose GEMMs
//! are checked, since the checksums are taken over f32 weights).

use abft_gemm::Matrix;
use kv_model::weights::{Isa, StoredLinear};

use super::GemmChecks;
use crate::error::{EvalError, Result};

/// One projection's weights (`rows` outputs × `cols` inputs).
#[derive(Clone, Debug)]
pub enum Projection {
    /// f32 values.
    Dense(Matrix),
    /// Blocks as stored.
    Stored(StoredLinear),
}

impl From<Matrix> for Projection {
    fn from(m: Matrix) -> Self {
        Self::Dense(m)
    }
}

impl Projection {
    /// Outputs.
    pub fn rows(&self) -> usize {
        match self {
            Self::Dense(m) => m.rows,
            Self::Stored(s) => s.rows(),
        }
    }

    /// Inputs.
    pub fn cols(&self) -> usize {
        match self {
            Self::Dense(m) => m.cols,
            Self::Stored(s) => s.cols(),
        }
    }

    /// Bytes the weights take in memory.
    pub fn bytes(&self) -> usize {
        match self {
            Self::Dense(m) => m.data.len() * 4,
            Self::Stored(s) => s.bytes(),
        }
    }

    /// The dense matrix, if the weights are dense.
    pub fn dense(&self) -> Option<&Matrix> {
        match self {
            Self::Dense(m) => Some(m),
            Self::Stored(_) => None,
        }
    }

    /// Turns stored weights into dense f32 ones (for checked GEMMs).
    pub fn densify(&mut self) -> Result<()> {
        if let Self::Stored(s) = self {
            *self = Self::Dense(Matrix::new(s.rows(), s.cols(), s.to_f32())?);
        }
        Ok(())
    }

    /// Row `r` in f32 into `out` (an embedding lookup).
    pub fn row_into(&self, r: usize, out: &mut [f32]) -> Result<()> {
        match self {
            Self::Dense(m) => {
                let row = m.data.get(r * m.cols..(r + 1) * m.cols).ok_or_else(|| {
                    EvalError::OutOfRange {
                        what: "embedding row".into(),
                        index: r,
                        len: m.rows,
                    }
                })?;
                out.copy_from_slice(row);
                Ok(())
            }
            Self::Stored(s) => Ok(s.dequantize_row(r, out)?),
        }
    }
}

/// `out (t × w.rows) (=|+=) x (t × w.cols) · wᵀ`. Dense weights go through
/// abft-gemm's linear layer, so the projections are the GEMMs that crate
/// checks: with `checks`, the product is verified by row checks (the
/// configured rule) before it is added, computed alone (not accumulated
/// into `out` by the GEMM), which can change the last bit of a residual
/// sum. Stored weights go through kv-model's products on `isa`; checks
/// need dense weights (the model densifies them when checks are set).
pub(crate) fn project(
    out: &mut [f32],
    x: &[f32],
    w: &Projection,
    accumulate: bool,
    checks: Option<&GemmChecks>,
    isa: Isa,
) -> Result<()> {
    match (w, checks) {
        (Projection::Stored(s), None) => Ok(s.product_into(out, x, accumulate, isa)?),
        (Projection::Stored(_), Some(_)) => Err(EvalError::Model(
            "checked GEMMs need dense weights (set the checks through the model)".into(),
        )),
        (Projection::Dense(m), checks) => project_dense(out, x, m, accumulate, checks),
    }
}

/// [`project`] on dense weights.
pub(crate) fn project_dense(
    out: &mut [f32],
    x: &[f32],
    w: &Matrix,
    accumulate: bool,
    checks: Option<&GemmChecks>,
) -> Result<()> {
    let Some(checks) = checks else {
        return Ok(abft_gemm::linear_into(out, x, w, accumulate)?);
    };
    if accumulate {
        let mut product = vec![0.0; out.len()];
        abft_gemm::linear_into(&mut product, x, w, false)?;
        checks.check(w, x, &mut product)?;
        for (o, p) in out.iter_mut().zip(&product) {
            *o += p;
        }
    } else {
        abft_gemm::linear_into(out, x, w, false)?;
        checks.check(w, x, out)?;
    }
    Ok(())
}
