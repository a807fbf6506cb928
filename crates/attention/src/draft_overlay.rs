//! [`DraftOverlay`]: a self-speculative draft's cache, the target's own
//! cache read in its [draft view](ReadView::Draft) with the draft's rows
//! kept beside it.
//!
//! A self-speculative draft runs the target model itself on a cheaper
//! view of the target's cache (QuantSpec, arXiv 2502.10424: the upper
//! 4-bit plane of a hierarchical INT8 cache). Its own tokens' K and V rows
//! never enter the target's cache: they are the draft's guesses, computed
//! through the draft view, and the target's verification writes its own.
//! The overlay keeps them in f32 rows of its own (QuantSpec's
//! full-precision buffer), so the target's cache is never written,
//! sealed, truncated or hashed by a draft, and is back in its full view
//! when the overlay is dropped.
//!
//! Attention of a draft query sees the target's committed rows (`0..T`,
//! through the draft view) and the draft's rows (`T..`), each under the
//! query's mask split at `T`; the two partial results are merged by their
//! log-sum-exps: with `m = max(l₁, l₂)`,
//! `o = (e^{l₁−m}·o₁ + e^{l₂−m}·o₂) / (e^{l₁−m} + e^{l₂−m})` and
//! `l = m + ln(e^{l₁−m} + e^{l₂−m})`, which is softmax attention over the
//! union up to rounding (a part that sees no key has `l = −∞` and weight 0).

use std::ops::Range;

use crate::attend::{Attention, AttentionOutput};
use crate::backend::{DenseBackend, KvBackend, ModelKvShape, ReadView};
use crate::error::AttentionError;
use crate::shape::Mask;

/// A draft's cache over a target's (see the module docs). Reads the target
/// through [`ReadView::Draft`] while it lives; dropping it reads the target
/// whole again.
#[derive(Debug)]
pub struct DraftOverlay<'a, B: KvBackend + ?Sized> {
    base: &'a mut B,
    own: DenseBackend,
    /// Per query of the current call: its visible keys in the target
    /// (`0..T`) and in the draft's rows.
    base_ranges: Vec<Range<usize>>,
    own_ranges: Vec<Range<usize>>,
    /// Layers the draft's forward passes skip.
    skip: Vec<bool>,
}

impl<'a, B: KvBackend + ?Sized> DraftOverlay<'a, B> {
    /// A draft over `base` (holding the committed tokens drafting starts
    /// after, no step open; the draft's rows are sized by the model's
    /// [`fit`](KvBackend::fit)); switches `base` to its draft view, or
    /// refuses, changing nothing, where some part of it keeps none.
    pub fn new(base: &'a mut B) -> Result<Self, B::Error> {
        base.set_read_view(ReadView::Draft)?;
        Ok(Self {
            base,
            own: DenseBackend::new(),
            base_ranges: Vec::new(),
            own_ranges: Vec::new(),
            skip: Vec::new(),
        })
    }

    /// Asks the draft's forward passes to skip `layers` (a shallower
    /// draft: [`KvBackend::skips_layer`]); replaces any earlier set.
    pub fn skip_layers(&mut self, layers: &[usize]) {
        self.skip.clear();
        for &l in layers {
            if self.skip.len() <= l {
                self.skip.resize(l + 1, false);
            }
            self.skip[l] = true;
        }
    }

    /// Tokens the draft holds past the target's.
    pub fn drafted(&self) -> usize {
        self.own.tokens()
    }
}

impl<B: KvBackend + ?Sized> Drop for DraftOverlay<'_, B> {
    fn drop(&mut self) {
        // The full view is every backend's default and is never refused.
        let back = self.base.set_read_view(ReadView::Full);
        debug_assert!(back.is_ok());
    }
}

impl<B: KvBackend + ?Sized> KvBackend for DraftOverlay<'_, B> {
    type Error = B::Error;

    fn fit(&mut self, model: &ModelKvShape<'_>) -> Result<(), Self::Error> {
        self.base.fit(model)?;
        Ok(self.own.fit(model)?)
    }

    fn tokens(&self) -> usize {
        self.base.tokens() + self.own.tokens()
    }

    fn begin(&mut self, tokens: &[u32]) -> Result<(), Self::Error> {
        Ok(self.own.begin(tokens)?)
    }

    fn append(&mut self, layer: usize, keys: &[f32], values: &[f32]) -> Result<(), Self::Error> {
        Ok(self.own.append(layer, keys, values)?)
    }

    fn attend(
        &mut self,
        layer: usize,
        attention: &Attention,
        queries: &[f32],
        positions: &[usize],
        mask: &Mask<'_>,
    ) -> Result<AttentionOutput, Self::Error> {
        let split = self.base.tokens();
        let own_rows = match self.own.rows(layer) {
            Some((k, _)) => k.len() / self.own.channels().max(1),
            None => {
                return Err(AttentionError::InvalidParameter {
                    name: "layer",
                    reason: format!("layer {layer} of a cache of {} layers", self.own.layers()),
                }
                .into());
            }
        };
        self.base_ranges.clear();
        self.own_ranges.clear();
        for (i, &p) in positions.iter().enumerate() {
            let r = mask.visible(i, p, split + own_rows)?;
            self.base_ranges.push(r.start.min(split)..r.end.min(split));
            self.own_ranges
                .push(r.start.max(split) - split..r.end.max(split) - split);
        }
        let sees = |ranges: &[Range<usize>]| ranges.iter().any(|r| !r.is_empty());
        let own = self.own.attend(
            layer,
            attention,
            queries,
            positions,
            &Mask::Ranges(&self.own_ranges),
        )?;
        if !sees(&self.base_ranges) {
            return Ok(own);
        }
        let base = self.base.attend(
            layer,
            attention,
            queries,
            positions,
            &Mask::Ranges(&self.base_ranges),
        )?;
        Ok(merge(base, own, attention.shape().head_dim()))
    }

    fn commit(&mut self) -> Result<(), Self::Error> {
        Ok(self.own.commit()?)
    }

    fn rollback(&mut self) {
        self.own.rollback();
    }

    /// Cuts the draft's rows back (never into the target's).
    fn truncate(&mut self, tokens: usize) -> Result<(), Self::Error> {
        let split = self.base.tokens();
        let Some(own) = tokens.checked_sub(split) else {
            return Err(AttentionError::InvalidParameter {
                name: "tokens",
                reason: format!(
                    "a draft cuts back its own rows only: {tokens} tokens is below the \
                     target's {split}"
                ),
            }
            .into());
        };
        Ok(self.own.truncate(own)?)
    }

    fn skips_layer(&self, layer: usize) -> bool {
        self.skip.get(layer).copied().unwrap_or(false)
    }

    /// The overlay reads its target in the draft view, whatever is asked.
    fn set_read_view(&mut self, _view: ReadView) -> Result<(), Self::Error> {
        Ok(())
    }
}

/// Two partial attention results over disjoint keys merged by their
/// log-sum-exps (see the module docs).
fn merge(mut a: AttentionOutput, b: AttentionOutput, head_dim: usize) -> AttentionOutput {
    for h in 0..a.lse.len().min(b.lse.len()) {
        let (la, lb) = (a.lse[h], b.lse[h]);
        let (oa, ob) = (h * head_dim, (h + 1) * head_dim);
        let m = la.max(lb);
        if m == f32::NEG_INFINITY {
            continue;
        }
        let (wa, wb) = ((la - m).exp(), (lb - m).exp());
        let sum = wa + wb;
        for (x, &y) in a.out[oa..ob].iter_mut().zip(&b.out[oa..ob]) {
            *x = (wa * *x + wb * y) / sum;
        }
        a.lse[h] = m + sum.ln();
    }
    a.stats.keys += b.stats.keys;
    a.stats.values += b.stats.values;
    a.stats.tiles += b.stats.tiles;
    a.stats.erased_tiles += b.stats.erased_tiles;
    a.non_finite += b.non_finite;
    a
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rope::Rope;
    use crate::shape::HeadShape;

    fn rows(n: usize, channels: usize, seed: u32) -> Vec<f32> {
        (0..n * channels)
            .map(|i| ((i as u32).wrapping_mul(2_654_435_761) ^ seed) as f32 / u32::MAX as f32 - 0.5)
            .collect()
    }

    /// A draft over a dense target attends like one dense cache holding the
    /// target's rows and the draft's, within f32 rounding of the merge; the
    /// target is never written, and cutting the draft back leaves it whole.
    #[test]
    fn attends_like_one_cache_and_never_writes_the_target() {
        let shape = HeadShape::new(4, 2, 8).unwrap();
        let model = ModelKvShape {
            layers: 2,
            heads: shape,
            rope: None::<&Rope>,
        };
        let attention = Attention::new(shape);
        let ch = shape.kv_channels();
        let (past, drafted) = (11, 3);
        let (k, v) = (rows(past + drafted, ch, 1), rows(past + drafted, ch, 2));
        let mut target = DenseBackend::new();
        target.fit(&model).unwrap();
        let mut whole = DenseBackend::new();
        whole.fit(&model).unwrap();
        for (backend, n) in [(&mut target, past), (&mut whole, past + drafted)] {
            backend.begin(&vec![0; n]).unwrap();
            for layer in 0..2 {
                backend.append(layer, &k[..n * ch], &v[..n * ch]).unwrap();
            }
            backend.commit().unwrap();
        }
        // A dense backend keeps no draft view.
        assert!(DraftOverlay::new(&mut target).is_err());
        // The overlay over a backend reading its draft view as the whole.
        struct Viewed(DenseBackend);
        impl KvBackend for Viewed {
            type Error = AttentionError;
            fn fit(&mut self, m: &ModelKvShape<'_>) -> crate::Result<()> {
                self.0.fit(m)
            }
            fn tokens(&self) -> usize {
                self.0.tokens()
            }
            fn begin(&mut self, t: &[u32]) -> crate::Result<()> {
                self.0.begin(t)
            }
            fn append(&mut self, l: usize, k: &[f32], v: &[f32]) -> crate::Result<()> {
                self.0.append(l, k, v)
            }
            fn attend(
                &mut self,
                l: usize,
                a: &Attention,
                q: &[f32],
                p: &[usize],
                m: &Mask<'_>,
            ) -> crate::Result<AttentionOutput> {
                self.0.attend(l, a, q, p, m)
            }
            fn commit(&mut self) -> crate::Result<()> {
                self.0.commit()
            }
            fn rollback(&mut self) {
                self.0.rollback()
            }
            fn truncate(&mut self, t: usize) -> crate::Result<()> {
                self.0.truncate(t)
            }
            fn set_read_view(&mut self, _: ReadView) -> crate::Result<()> {
                Ok(())
            }
        }
        let mut target = Viewed(target);
        let mut overlay = DraftOverlay::new(&mut target).unwrap();
        overlay.fit(&model).unwrap();
        let q = rows(drafted, shape.q_heads() * shape.head_dim(), 3);
        for t in 0..drafted {
            let at = past + t;
            overlay.begin(&[0]).unwrap();
            for layer in 0..2 {
                overlay
                    .append(
                        layer,
                        &k[at * ch..(at + 1) * ch],
                        &v[at * ch..(at + 1) * ch],
                    )
                    .unwrap();
                let query = &q[t * 32..(t + 1) * 32];
                let got = overlay
                    .attend(layer, &attention, query, &[at], &Mask::Causal)
                    .unwrap();
                let want = whole
                    .attend(layer, &attention, query, &[at], &Mask::Causal)
                    .unwrap();
                for (g, w) in got.out.iter().zip(&want.out) {
                    assert!((g - w).abs() <= 1e-6, "{g} against {w}");
                }
                for (g, w) in got.lse.iter().zip(&want.lse) {
                    assert!((g - w).abs() <= 1e-5, "{g} against {w}");
                }
            }
            overlay.commit().unwrap();
        }
        assert_eq!(
            (overlay.tokens(), overlay.drafted()),
            (past + drafted, drafted)
        );
        assert!(overlay.truncate(past - 1).is_err());
        overlay.truncate(past).unwrap();
        assert_eq!(overlay.drafted(), 0);
        drop(overlay);
        assert_eq!(target.tokens(), past);
    }
}
