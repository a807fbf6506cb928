//! A projection's weights: as the file stores them ([`StoredLinear`],
//! multiplied by 8-bit-quantised activations as llama.cpp does) or dense
//! f32 (abft-gemm's [`Matrix`] and its plain linear layer, faer's GEMM:
//! Hugging Face checkpoints, GPT-2, and models densified on purpose), and
//! the [`ProjectionHook`] that may compute every product instead (kv-eval's
//! GEMM checks, which take their checksums over f32 weights).

use std::sync::Arc;

use abft_gemm::Matrix;

use crate::error::{ModelError, Result};
use crate::weights::{Isa, StoredLinear};

/// Which projection of a model a product is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum ProjectionKind {
    /// Q, K and V (stacked).
    Qkv,
    /// The attention output.
    AttentionOut,
    /// The MLP's first projection (Llama: gate and up stacked; GPT-2: fc).
    MlpUp,
    /// The MLP's down projection.
    MlpDown,
    /// The output head (the token embedding where tied).
    Output,
}

/// A projection's identity: its layer (`None` for the output head) and kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ProjectionId {
    /// The transformer block, or `None` outside the blocks.
    pub layer: Option<usize>,
    /// Which of the block's projections.
    pub kind: ProjectionKind,
}

impl ProjectionId {
    /// Projection `kind` of block `layer`.
    pub fn block(layer: usize, kind: ProjectionKind) -> Self {
        Self {
            layer: Some(layer),
            kind,
        }
    }

    /// The output head.
    pub const OUTPUT: Self = Self {
        layer: None,
        kind: ProjectionKind::Output,
    };
}

/// Every projection of a model: each block's four (Q/K/V, attention
/// output, MLP up and down, in that order), then the output head (`P` a
/// shared or a mutable reference).
pub(crate) fn listed<P>(blocks: impl Iterator<Item = [P; 4]>, output: P) -> Vec<(ProjectionId, P)> {
    const KINDS: [ProjectionKind; 4] = [
        ProjectionKind::Qkv,
        ProjectionKind::AttentionOut,
        ProjectionKind::MlpUp,
        ProjectionKind::MlpDown,
    ];
    let mut all: Vec<_> = blocks
        .enumerate()
        .flat_map(|(l, ps)| {
            KINDS
                .into_iter()
                .zip(ps)
                .map(move |(kind, p)| (ProjectionId::block(l, kind), p))
        })
        .collect();
    all.push((ProjectionId::OUTPUT, output));
    all
}

/// Computes a model's projections in place of the plain products: what an
/// experiment plugs in to check or fault every GEMM (kv-eval's V-ABFT
/// checks). The model calls it once per projection and forward pass, with
/// the activations of every row of the batch.
pub trait ProjectionHook: Send + Sync + std::fmt::Debug {
    /// `out (t × rows) (=|+=) x (t × cols) · Wᵀ` for projection `id`, whose
    /// weights are `weights` (`accumulate`: add to `out`).
    fn project(
        &self,
        id: ProjectionId,
        weights: &Projection,
        x: &[f32],
        out: &mut [f32],
        accumulate: bool,
    ) -> Result<()>;
}

/// A model's projection hook, if one is set. A cloned model starts
/// without one (a hook may count what it sees, per model).
#[derive(Debug, Default)]
pub(crate) struct HookSlot(pub(crate) Option<Arc<dyn ProjectionHook>>);

impl Clone for HookSlot {
    fn clone(&self) -> Self {
        Self(None)
    }
}

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

    /// The weights as dense f32: borrowed where they are, a dequantised
    /// copy of stored ones.
    pub fn to_dense(&self) -> Result<std::borrow::Cow<'_, Matrix>> {
        Ok(match self {
            Self::Dense(m) => std::borrow::Cow::Borrowed(m),
            Self::Stored(s) => {
                std::borrow::Cow::Owned(Matrix::new(s.rows(), s.cols(), s.to_f32())?)
            }
        })
    }

    /// Turns stored weights into dense f32 ones (faer's GEMM on f32
    /// activations).
    pub fn densify(&mut self) -> Result<()> {
        if let std::borrow::Cow::Owned(m) = self.to_dense()? {
            *self = Self::Dense(m);
        }
        Ok(())
    }

    /// The plain product `out (t × rows) (=|+=) x (t × cols) · Wᵀ`: stored
    /// weights through this crate's kernels on `isa`, dense ones through
    /// abft-gemm's linear layer (faer's GEMM).
    pub fn product_into(
        &self,
        out: &mut [f32],
        x: &[f32],
        accumulate: bool,
        isa: Isa,
    ) -> Result<()> {
        match self {
            Self::Stored(s) => s.product_into(out, x, accumulate, isa),
            Self::Dense(m) => dense_product(out, x, m, accumulate),
        }
    }

    /// The weights' bytes as stored, in segments of equal rows, each with
    /// its bytes per row: every part of stacked weights, or a dense
    /// matrix's f32 values as they lie in memory (4 bytes a value). What
    /// [`WeightGuard`](super::WeightGuard) checks and fault experiments
    /// flip.
    pub fn byte_rows(&self) -> Vec<(&[u8], usize)> {
        match self {
            Self::Stored(s) => s
                .parts()
                .iter()
                .map(|p| (p.data(), p.row_bytes()))
                .collect(),
            Self::Dense(m) => vec![(bytemuck::cast_slice(&m.data), 4 * m.cols)],
        }
    }

    /// [`byte_rows`](Self::byte_rows), to change in place; the shapes stay.
    pub fn byte_rows_mut(&mut self) -> Vec<(&mut [u8], usize)> {
        match self {
            Self::Stored(s) => s.part_bytes_mut().collect(),
            Self::Dense(m) => vec![(bytemuck::cast_slice_mut(&mut m.data), 4 * m.cols)],
        }
    }

    /// Row `r` in f32 into `out` (an embedding lookup).
    pub fn row_into(&self, r: usize, out: &mut [f32]) -> Result<()> {
        match self {
            Self::Dense(m) => {
                let row = m.data.get(r * m.cols..(r + 1) * m.cols).ok_or_else(|| {
                    ModelError::OutOfRange {
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

/// `out (t × w.rows) (=|+=) x (t × w.cols) · wᵀ` for projection `id`:
/// through `hook` where one is set, else the plain product
/// ([`Projection::product_into`]).
pub(crate) fn project(
    out: &mut [f32],
    x: &[f32],
    (id, w): (ProjectionId, &Projection),
    accumulate: bool,
    hook: &HookSlot,
    isa: Isa,
) -> Result<()> {
    match &hook.0 {
        Some(hook) => hook.project(id, w, x, out, accumulate),
        None => w.product_into(out, x, accumulate, isa),
    }
}

/// abft-gemm's plain linear layer (faer's GEMM).
fn dense_product(out: &mut [f32], x: &[f32], w: &Matrix, accumulate: bool) -> Result<()> {
    Ok(abft_gemm::linear_into(out, x, w, accumulate)?)
}
