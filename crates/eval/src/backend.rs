//! [`Adapted`]: any [`KvBackend`] whose errors convert into [`EvalError`],
//! seen by the forward passes as a [`ModelCache`](crate::model::ModelCache)
//! (the f32 oracle [`attention::DenseBackend`], for one).

use attention::{Attention, AttentionOutput, KvBackend, Mask, ModelKvShape};

use crate::error::{EvalError, Result};

/// A backend with its errors converted into this crate's.
#[derive(Debug)]
pub struct Adapted<B>(pub B);

impl<B> KvBackend for Adapted<B>
where
    B: KvBackend,
    EvalError: From<B::Error>,
{
    type Error = EvalError;

    fn fit(&mut self, model: &ModelKvShape<'_>) -> Result<()> {
        Ok(self.0.fit(model)?)
    }

    fn tokens(&self) -> usize {
        self.0.tokens()
    }

    fn begin(&mut self, tokens: &[u32]) -> Result<()> {
        Ok(self.0.begin(tokens)?)
    }

    fn append(&mut self, layer: usize, keys: &[f32], values: &[f32]) -> Result<()> {
        Ok(self.0.append(layer, keys, values)?)
    }

    fn attend(
        &mut self,
        layer: usize,
        attention: &Attention,
        queries: &[f32],
        positions: &[usize],
        mask: &Mask<'_>,
    ) -> Result<AttentionOutput> {
        Ok(self.0.attend(layer, attention, queries, positions, mask)?)
    }

    fn commit(&mut self) -> Result<()> {
        Ok(self.0.commit()?)
    }

    fn rollback(&mut self) {
        self.0.rollback()
    }
}
