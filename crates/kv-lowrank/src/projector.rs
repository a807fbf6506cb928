//! [`Projector`]: the write path of a calibrated (`pca-*`) cache: one
//! token's K or V row projected on the layer's bases into caller-provided
//! coefficient and residual buffers, without allocating, for a cache that
//! appends a token at a time (the coefficients then go through kv-quant's
//! [`RowEncoder`](kv_quant::RowEncoder) in the form's coefficient code).

use kv_quant::{CacheForm, LowRankMethod};

use crate::error::{LowRankError, Result, check_finite, check_len};
use crate::store::{HeadBases, low_rank_spec};

/// Projects rows on one layer part's calibrated bases.
#[derive(Clone, Debug)]
pub struct Projector {
    bases: HeadBases,
    head_dim: usize,
    coefficients: usize,
}

impl Projector {
    /// A projector of rows of `bases.heads.len() × head_dim` channels for a
    /// `pca-*` form.
    pub fn new(form: &CacheForm, bases: HeadBases, head_dim: usize) -> Result<Self> {
        let spec = low_rank_spec(form)?;
        if !matches!(spec.method, LowRankMethod::Pca(_)) {
            return Err(LowRankError::InvalidParameter {
                name: "form",
                reason: format!(
                    "{form} fits its bases online; only pca-* forms project on fixed bases"
                ),
            });
        }
        if bases.heads.is_empty() || bases.heads.iter().any(|b| b.dim() != head_dim) {
            return Err(LowRankError::Bases(format!(
                "{} bases do not all have heads of {head_dim} channels",
                bases.heads.len()
            )));
        }
        let coefficients = bases.heads.iter().map(|b| b.rank()).sum();
        Ok(Self {
            bases,
            head_dim,
            coefficients,
        })
    }

    /// Channels of a row.
    pub fn channels(&self) -> usize {
        self.bases.heads.len() * self.head_dim
    }

    /// Coefficients of a row (the heads' ranks summed, head after head).
    pub fn coefficients(&self) -> usize {
        self.coefficients
    }

    /// Projects one row: `coeffs` gets each head's `(x − μ)·Bᵀ` in head
    /// order, `residuals` each head's `‖x − μ − c·B‖`. No allocation.
    pub fn project_into(
        &self,
        row: &[f32],
        coeffs: &mut [f32],
        residuals: &mut [f32],
    ) -> Result<()> {
        check_len("row", self.channels(), row.len())?;
        check_len("coefficients", self.coefficients, coeffs.len())?;
        check_len("residuals", self.bases.heads.len(), residuals.len())?;
        check_finite(row, self.channels())?;
        let d = self.head_dim;
        let mut at = 0;
        for ((basis, x), res) in self
            .bases
            .heads
            .iter()
            .zip(row.chunks_exact(d))
            .zip(residuals.iter_mut())
        {
            let r = basis.rank();
            let c = &mut coeffs[at..at + r];
            basis.project(x, c);
            let mut sq = 0.0f64;
            for (j, (&xj, &mj)) in x.iter().zip(basis.mean()).enumerate() {
                let rebuilt: f32 = mj
                    + c.iter()
                        .zip(basis.rows().chunks_exact(d))
                        .map(|(ci, b)| ci * b[j])
                        .sum::<f32>();
                sq += f64::from(xj - rebuilt).powi(2);
            }
            *res = sq.sqrt() as f32;
            at += r;
        }
        Ok(())
    }
}
