//! [`Adapted`]: a KV backend whose errors convert into [`ModelError`]
//! (attention's `DenseBackend`, paged-cache's `PagedBackend` and
//! `ReservedSlots`, or a backend of one's own), seen by the forward passes
//! as a [`ModelCache`](super::ModelCache).

use attention::{Attention, AttentionOutput, KvBackend, Mask, ModelKvShape};

use crate::error::{ModelError, Result};

/// A KV backend with its errors converted into this crate's.
#[derive(Debug)]
pub struct Adapted<B>(pub B);

impl<B> KvBackend for Adapted<B>
where
    B: KvBackend,
    ModelError: From<B::Error>,
{
    type Error = ModelError;

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

    fn truncate(&mut self, tokens: usize) -> Result<()> {
        Ok(self.0.truncate(tokens)?)
    }

    fn commit_prefix(&mut self, keep: usize) -> Result<()> {
        Ok(self.0.commit_prefix(keep)?)
    }

    fn set_read_view(&mut self, view: attention::ReadView) -> Result<()> {
        Ok(self.0.set_read_view(view)?)
    }

    fn skips_layer(&self, layer: usize) -> bool {
        self.0.skips_layer(layer)
    }

    fn rows_before_seal(&self) -> Option<usize> {
        self.0.rows_before_seal()
    }
}
