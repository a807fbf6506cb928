//! [`KvBackend`]: the one interface between a model's forward pass and its
//! KV cache, split the way vLLM splits its model runner from its cache
//! manager. The model never owns the cache: for each layer it appends the
//! step's new K/V rows and asks the backend to attend the layer's queries
//! over everything the layer holds; after the last layer it commits the step,
//! or rolls it back after an error, so no layer is ever left with rows the
//! others lack.
//!
//! The backend attends itself (rather than handing out a [`KvSource`]) so
//! that each implementation can pick its read path: tiles of a kv-quant
//! store, pages of a block table, or coefficient space for low-rank forms.
//!
//! [`DenseBackend`] keeps the f32 rows as computed: the oracle every other
//! backend is compared with.

use crate::attend::{Attention, AttentionOutput};
use crate::error::{AttentionError, Result};
use crate::rope::Rope;
use crate::shape::{HeadShape, Mask};
use crate::source::DenseKv;

/// What a backend needs to know of the model it serves.
#[derive(Clone, Copy, Debug)]
pub struct ModelKvShape<'a> {
    /// Transformer blocks (one K and one V cache each).
    pub layers: usize,
    /// Heads of one layer.
    pub heads: HeadShape,
    /// The keys' rotary embedding, if the model has one (forms that project
    /// keys before RoPE undo and redo it).
    pub rope: Option<&'a Rope>,
}

/// Which of a form's views attention reads: the whole stored form, or the
/// cheaper view a form keeps for self-speculative drafting (the upper
/// 4-bit plane of a hierarchical `int8h` form, half its bytes).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum ReadView {
    /// Every stored bit: what decoding and verification read.
    #[default]
    Full,
    /// The draft view: a self-speculative draft's reads.
    Draft,
}

/// The error of a backend (or a stored part) asked for a
/// [`ReadView::Draft`] it does not keep; `what` names the form or backend.
pub fn no_draft_view(what: &str) -> AttentionError {
    AttentionError::InvalidParameter {
        name: "view",
        reason: format!(
            "{what} keeps no draft view (self-speculation reads the upper 4-bit plane of a \
             hierarchical form: int8h, int8h-g<N>, int8h-ch, on the paged cache)"
        ),
    }
}

/// The cache a model's forward pass talks to.
///
/// A step opens with [`begin`](Self::begin), which names its tokens; every
/// layer then [`append`](Self::append)s one K and one V row per token and
/// may [`attend`](Self::attend); [`commit`](Self::commit) closes it, or
/// [`rollback`](Self::rollback) undoes it. [`tokens`](Self::tokens) counts
/// committed tokens only; within a step, a layer's attention sees the
/// committed rows and the rows appended to that layer in the step.
pub trait KvBackend {
    /// The backend's error; attention's own errors convert into it.
    type Error: std::error::Error + From<AttentionError>;

    /// Sizes an empty backend for `model`, or checks that a used one was
    /// sized for the same shape.
    fn fit(&mut self, model: &ModelKvShape<'_>) -> Result<(), Self::Error>;

    /// Committed tokens (the position of the next step's first token).
    fn tokens(&self) -> usize;

    /// Opens a step of `tokens` (their ids: a paged backend reserves their
    /// slots and can find a cached prefix by them). Refused while a step is
    /// open, or when the backend cannot hold them, before anything changes.
    fn begin(&mut self, tokens: &[u32]) -> Result<(), Self::Error>;

    /// Appends `keys` and `values` (`n × kv_channels` each) to `layer`
    /// within the open step (at most the step's tokens in all).
    fn append(&mut self, layer: usize, keys: &[f32], values: &[f32]) -> Result<(), Self::Error>;

    /// Attention of `queries` at `positions` over the rows `layer` holds.
    fn attend(
        &mut self,
        layer: usize,
        attention: &Attention,
        queries: &[f32],
        positions: &[usize],
        mask: &Mask<'_>,
    ) -> Result<AttentionOutput, Self::Error>;

    /// Makes the step's rows permanent. Every layer must have appended one
    /// row per token of the step; if not, the step is rolled back and refused.
    fn commit(&mut self) -> Result<(), Self::Error>;

    /// Drops the rows appended since the last commit, from every layer.
    fn rollback(&mut self);

    /// Drops every committed token from position `tokens` on, in every
    /// layer (a speculative draft's cache going back to what the target
    /// accepted). Refused while a step is open or past the tokens held.
    fn truncate(&mut self, tokens: usize) -> Result<(), Self::Error>;

    /// Commits the first `keep` tokens of the open step and drops the rest
    /// from every layer: speculative decoding's verification keeps the
    /// accepted drafts. `keep` equal to the step's tokens is
    /// [`commit`](Self::commit). This default commits the whole step and
    /// [truncates](Self::truncate) it; a backend whose commit does work
    /// over the committed rows (a paged cache sealing per-channel groups)
    /// commits only the kept rows instead. `keep` past the step's tokens
    /// is refused, and the step undone.
    fn commit_prefix(&mut self, keep: usize) -> Result<(), Self::Error> {
        commit_then_truncate(self, keep)
    }

    /// Whether the forward pass may skip `layer` for this cache's step: a
    /// self-speculative draft that runs a shallower model
    /// ([`DraftOverlay::skip_layers`](crate::DraftOverlay::skip_layers)).
    /// A model that skips a layer passes its hidden state through and
    /// appends zero rows to it (never attended: the layer is skipped for
    /// every token of the draft). The default: never.
    fn skips_layer(&self, layer: usize) -> bool {
        let _ = layer;
        false
    }

    /// How many rows a step may hold, from the first not yet written on,
    /// before a row past them would read differently from a step that
    /// stopped there: rows up to the end of the current block, where the
    /// cache seals a completed block at commit (staged forms: per-channel
    /// groups, exact sinks and windows), so that a row after the
    /// completing one reads the block sealed when the steps stop at the
    /// boundary and staged when one step crosses it. At least 1 (the row
    /// that completes the block). `None` (the default)
    /// where no seal changes a reading. Speculative decoding caps a
    /// verification's drafts by it, so that its rows read what plain
    /// decoding's read.
    fn rows_before_seal(&self) -> Option<usize> {
        None
    }

    /// Reads `view` of the stored forms from now on (every layer and
    /// part), or refuses, changing nothing, where some part keeps no such
    /// view. The default keeps only [`ReadView::Full`].
    fn set_read_view(&mut self, view: ReadView) -> Result<(), Self::Error> {
        match view {
            ReadView::Full => Ok(()),
            ReadView::Draft => Err(no_draft_view("this backend").into()),
        }
    }
}

/// [`KvBackend::commit_prefix`]'s default: commits the step, then cuts it
/// back to its first `keep` rows (refusing, and undoing the step, where
/// `keep` is past them). For backends that override `commit_prefix` to
/// check something first and then do what the default does.
pub fn commit_then_truncate<B: KvBackend + ?Sized>(
    backend: &mut B,
    keep: usize,
) -> Result<(), B::Error> {
    let before = backend.tokens();
    backend.commit()?;
    let after = backend.tokens();
    if before + keep > after {
        backend.truncate(before)?;
        return Err(keep_past_step(keep, after - before).into());
    }
    backend.truncate(before + keep)
}

/// The error of a [`KvBackend::commit_prefix`] keeping more tokens than
/// its step holds.
pub fn keep_past_step(keep: usize, step: usize) -> AttentionError {
    AttentionError::InvalidParameter {
        name: "keep",
        reason: format!("{keep} tokens kept of a step of {step}"),
    }
}

/// Runs one step of `tokens` on `backend` through `forward`: commits it
/// when `forward` succeeds, rolls it back when it fails (the error is
/// returned either way).
pub fn run_step<B, T, E>(
    backend: &mut B,
    tokens: &[u32],
    forward: impl FnOnce(&mut B) -> std::result::Result<T, E>,
) -> std::result::Result<T, E>
where
    B: KvBackend + ?Sized,
    E: From<B::Error>,
{
    backend.begin(tokens)?;
    match forward(backend) {
        Ok(out) => {
            backend.commit()?;
            Ok(out)
        }
        Err(e) => {
            backend.rollback();
            Err(e)
        }
    }
}

/// The open step's token count and the rows each layer appended so far:
/// the bookkeeping every backend needs to commit or roll back a step.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StepRows {
    pending: Vec<usize>,
    open: Option<usize>,
}

impl StepRows {
    /// Bookkeeping for `layers` layers, no step open.
    pub fn new(layers: usize) -> Self {
        Self {
            pending: vec![0; layers],
            open: None,
        }
    }

    /// Opens a step of `tokens` tokens (at least one; none open).
    pub fn begin(&mut self, tokens: usize) -> Result<()> {
        if let Some(open) = self.open {
            return Err(AttentionError::InvalidParameter {
                name: "step",
                reason: format!("a step of {open} tokens is still open (commit or roll it back)"),
            });
        }
        if tokens == 0 {
            return Err(AttentionError::InvalidParameter {
                name: "step",
                reason: "a step needs at least one token".into(),
            });
        }
        self.open = Some(tokens);
        Ok(())
    }

    /// The open step's tokens.
    pub fn open(&self) -> Option<usize> {
        self.open
    }

    /// Layers tracked.
    pub fn layers(&self) -> usize {
        self.pending.len()
    }

    /// Checks that a step is open, `layer` exists and `keys`/`values` hold
    /// whole rows of `channels`, no more than the step's tokens, and returns
    /// the row count (before anything is written).
    pub fn check_append(
        &self,
        layer: usize,
        channels: usize,
        keys: &[f32],
        values: &[f32],
    ) -> Result<usize> {
        if layer >= self.pending.len() {
            return Err(AttentionError::InvalidParameter {
                name: "layer",
                reason: format!("layer {layer} of a cache of {} layers", self.pending.len()),
            });
        }
        if channels == 0 || !keys.len().is_multiple_of(channels) {
            return Err(AttentionError::ShapeMismatch {
                what: "appended key values (a multiple of the channels)",
                expected: keys.len().div_ceil(channels.max(1)) * channels,
                got: keys.len(),
            });
        }
        crate::error::check_len("appended value values", keys.len(), values.len())?;
        let rows = keys.len() / channels;
        let Some(open) = self.open else {
            return Err(AttentionError::InvalidParameter {
                name: "step",
                reason: "rows appended outside a step (begin one first)".into(),
            });
        };
        if self.pending[layer] + rows > open {
            return Err(AttentionError::InvalidParameter {
                name: "step",
                reason: format!(
                    "layer {layer} would hold {} rows of a step of {open} tokens",
                    self.pending[layer] + rows
                ),
            });
        }
        Ok(rows)
    }

    /// Records `rows` appended to `layer`.
    pub fn appended(&mut self, layer: usize, rows: usize) {
        self.pending[layer] += rows;
    }

    /// Rows `layer` appended in the open step.
    pub fn pending(&self, layer: usize) -> usize {
        self.pending.get(layer).copied().unwrap_or(0)
    }

    /// Closes the step: its token count, or an error when a layer did not
    /// append one row per token (the caller then rolls back). Closes only
    /// on success.
    pub fn close(&mut self) -> Result<usize> {
        let Some(n) = self.open else {
            return Err(AttentionError::InvalidParameter {
                name: "step",
                reason: "no step is open".into(),
            });
        };
        if let Some((layer, &got)) = self.pending.iter().enumerate().find(|(_, p)| **p != n) {
            return Err(AttentionError::InvalidParameter {
                name: "step",
                reason: format!("layer {layer} appended {got} rows in a step of {n} tokens"),
            });
        }
        self.pending.iter_mut().for_each(|p| *p = 0);
        self.open = None;
        Ok(n)
    }

    /// Refuses a truncation to `tokens` while a step is open or past the
    /// `held` committed tokens.
    pub fn check_truncate(&self, tokens: usize, held: usize) -> Result<()> {
        if let Some(open) = self.open {
            return Err(AttentionError::InvalidParameter {
                name: "truncate",
                reason: format!("a step of {open} tokens is open (commit or roll it back first)"),
            });
        }
        if tokens > held {
            return Err(AttentionError::InvalidParameter {
                name: "truncate",
                reason: format!("to {tokens} tokens, past the {held} held"),
            });
        }
        Ok(())
    }

    /// Forgets the open step (if any).
    pub fn discard(&mut self) {
        self.pending.iter_mut().for_each(|p| *p = 0);
        self.open = None;
    }
}

/// The f32 oracle: every layer's K and V rows as computed, read directly.
#[derive(Clone, Debug, Default)]
pub struct DenseBackend {
    layers: Vec<(Vec<f32>, Vec<f32>)>,
    channels: usize,
    tokens: usize,
    step: StepRows,
}

impl DenseBackend {
    /// An empty backend, sized on first use.
    pub fn new() -> Self {
        Self::default()
    }

    /// The rows (keys, values) `layer` holds, committed and pending.
    pub fn rows(&self, layer: usize) -> Option<(&[f32], &[f32])> {
        self.layers.get(layer).map(|(k, v)| (&k[..], &v[..]))
    }

    /// Channels per row (0 before [`fit`](KvBackend::fit)).
    pub fn channels(&self) -> usize {
        self.channels
    }

    /// Layers held (0 before [`fit`](KvBackend::fit)).
    pub fn layers(&self) -> usize {
        self.layers.len()
    }

    /// Bytes of the f32 rows held.
    pub fn held_bytes(&self) -> u64 {
        self.layers
            .iter()
            .map(|(k, v)| 4 * (k.len() + v.len()) as u64)
            .sum()
    }
}

impl KvBackend for DenseBackend {
    type Error = AttentionError;

    fn fit(&mut self, model: &ModelKvShape<'_>) -> Result<()> {
        let channels = model.heads.kv_channels();
        if self.layers.is_empty() {
            self.layers = vec![(Vec::new(), Vec::new()); model.layers];
            self.channels = channels;
            self.step = StepRows::new(model.layers);
        }
        check_fit(self.layers.len(), self.channels, model)
    }

    fn tokens(&self) -> usize {
        self.tokens
    }

    fn begin(&mut self, tokens: &[u32]) -> Result<()> {
        if self.layers.is_empty() {
            return Err(AttentionError::InvalidParameter {
                name: "step",
                reason: "the backend was not fitted to a model".into(),
            });
        }
        self.step.begin(tokens.len())
    }

    fn append(&mut self, layer: usize, keys: &[f32], values: &[f32]) -> Result<()> {
        let rows = self.step.check_append(layer, self.channels, keys, values)?;
        let (k, v) = &mut self.layers[layer];
        k.extend_from_slice(keys);
        v.extend_from_slice(values);
        self.step.appended(layer, rows);
        Ok(())
    }

    fn attend(
        &mut self,
        layer: usize,
        attention: &Attention,
        queries: &[f32],
        positions: &[usize],
        mask: &Mask<'_>,
    ) -> Result<AttentionOutput> {
        let (k, v) = self
            .rows(layer)
            .ok_or_else(|| AttentionError::InvalidParameter {
                name: "layer",
                reason: format!("layer {layer} of a cache of {} layers", self.layers.len()),
            })?;
        let tokens = self.tokens + self.step.pending(layer);
        let keys = DenseKv::new(k, tokens, self.channels)?;
        let values = DenseKv::new(v, tokens, self.channels)?;
        attention.prefill(queries, positions, &keys, &values, mask)
    }

    fn commit(&mut self) -> Result<()> {
        match self.step.close() {
            Ok(n) => {
                self.tokens += n;
                Ok(())
            }
            Err(e) => {
                self.rollback();
                Err(e)
            }
        }
    }

    fn rollback(&mut self) {
        self.step.discard();
        self.drop_rows_past(self.tokens);
    }

    fn truncate(&mut self, tokens: usize) -> Result<()> {
        self.step.check_truncate(tokens, self.tokens)?;
        self.tokens = tokens;
        self.drop_rows_past(tokens);
        Ok(())
    }
}

impl DenseBackend {
    /// Keeps the first `tokens` rows of every layer.
    fn drop_rows_past(&mut self, tokens: usize) {
        let keep = tokens * self.channels;
        for (k, v) in &mut self.layers {
            k.truncate(keep);
            v.truncate(keep);
        }
    }
}

/// Refuses a model whose layer count or KV width differs from what a
/// backend was sized for.
pub fn check_fit(layers: usize, channels: usize, model: &ModelKvShape<'_>) -> Result<()> {
    if layers != model.layers || channels != model.heads.kv_channels() {
        return Err(AttentionError::InvalidParameter {
            name: "model",
            reason: format!(
                "a cache of {layers} layers × {channels} channels used with a model of {} × {}",
                model.layers,
                model.heads.kv_channels()
            ),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reference::reference_attention;

    fn rows(n: usize, ch: usize, phase: f32) -> Vec<f32> {
        (0..n * ch)
            .map(|i| (i as f32 * 0.37 + phase).sin())
            .collect()
    }

    fn shape() -> ModelKvShape<'static> {
        ModelKvShape {
            layers: 3,
            heads: HeadShape::new(4, 2, 8).unwrap(),
            rope: None,
        }
    }

    #[test]
    fn a_step_keeps_a_prefix_and_committed_rows_truncate() {
        let model = shape();
        let ch = model.heads.kv_channels();
        let mut b = DenseBackend::new();
        b.fit(&model).unwrap();
        let open = |b: &mut DenseBackend, n: usize| {
            b.begin(&vec![3; n]).unwrap();
            for l in 0..model.layers {
                b.append(l, &rows(n, ch, l as f32), &rows(n, ch, 2.0))
                    .unwrap();
            }
        };
        open(&mut b, 6);
        b.commit_prefix(4).unwrap();
        assert_eq!(b.tokens(), 4);
        assert!((0..3).all(|l| b.rows(l).unwrap().0 == &rows(6, ch, l as f32)[..4 * ch]));
        // A step of 3 keeping none leaves the 4; keeping more is refused.
        open(&mut b, 3);
        b.commit_prefix(0).unwrap();
        assert_eq!(b.tokens(), 4);
        open(&mut b, 3);
        assert!(matches!(
            b.commit_prefix(4),
            Err(AttentionError::InvalidParameter { name: "keep", .. })
        ));
        assert_eq!(b.tokens(), 4);
        open(&mut b, 3);
        b.commit().unwrap();
        // Truncation: not while a step is open, not past the tokens held.
        b.begin(&[1]).unwrap();
        assert!(matches!(
            b.truncate(2),
            Err(AttentionError::InvalidParameter {
                name: "truncate",
                ..
            })
        ));
        b.rollback();
        assert!(b.truncate(8).is_err());
        b.truncate(2).unwrap();
        assert_eq!(b.tokens(), 2);
        assert!((0..3).all(|l| b.rows(l).unwrap().1.len() == 2 * ch));
    }

    #[test]
    fn a_failed_step_leaves_no_layer_with_extra_rows() {
        let model = shape();
        let ch = model.heads.kv_channels();
        let mut b = DenseBackend::new();
        b.fit(&model).unwrap();
        let step = |b: &mut DenseBackend, n: usize, fail_at: Option<usize>| {
            run_step(b, &vec![7; n], |b| {
                for l in 0..model.layers {
                    if fail_at == Some(l) {
                        return Err(AttentionError::EmptyCache);
                    }
                    b.append(l, &rows(n, ch, l as f32), &rows(n, ch, 9.0))?;
                }
                Ok(())
            })
        };
        step(&mut b, 5, None).unwrap();
        assert_eq!(b.tokens(), 5);
        // An error after layer 0 appended drops layer 0's new rows.
        assert_eq!(step(&mut b, 3, Some(1)), Err(AttentionError::EmptyCache));
        assert_eq!(b.tokens(), 5);
        for l in 0..model.layers {
            assert_eq!(b.rows(l).unwrap().0.len(), 5 * ch, "layer {l}");
        }
        // Rows outside a step, more rows than the step's tokens, and layers
        // that miss rows are refused; the step is rolled back.
        assert!(b.append(0, &rows(1, ch, 0.0), &rows(1, ch, 0.0)).is_err());
        b.begin(&[1, 2]).unwrap();
        assert!(b.begin(&[1]).is_err());
        assert!(b.append(0, &rows(3, ch, 0.0), &rows(3, ch, 0.0)).is_err());
        for l in 0..model.layers {
            b.append(l, &rows(2, ch, 0.0), &rows(2, ch, 0.0)).unwrap();
        }
        b.append(0, &rows(0, ch, 0.0), &rows(0, ch, 0.0)).unwrap();
        assert!(b.append(1, &rows(1, ch, 0.0), &rows(1, ch, 0.0)).is_err());
        b.rollback();
        b.begin(&[1, 2]).unwrap();
        b.append(0, &rows(2, ch, 0.0), &rows(2, ch, 0.0)).unwrap();
        b.append(1, &rows(1, ch, 0.0), &rows(1, ch, 0.0)).unwrap();
        assert!(matches!(
            b.commit(),
            Err(AttentionError::InvalidParameter { name: "step", .. })
        ));
        assert!((0..3).all(|l| b.rows(l).unwrap().1.len() == 5 * ch));
        assert!(b.begin(&[]).is_err());
        step(&mut b, 2, None).unwrap();
        assert_eq!(b.tokens(), 7);
    }

    #[test]
    fn bad_appends_and_other_models_are_refused() {
        let model = shape();
        let ch = model.heads.kv_channels();
        let mut b = DenseBackend::new();
        b.fit(&model).unwrap();
        b.begin(&[0]).unwrap();
        assert!(b.append(3, &rows(1, ch, 0.0), &rows(1, ch, 0.0)).is_err());
        assert!(
            b.append(0, &rows(1, ch, 0.0)[..ch - 1], &[0.0; 15])
                .is_err()
        );
        assert!(b.append(0, &rows(1, ch, 0.0), &rows(2, ch, 0.0)).is_err());
        assert_eq!(b.rows(0).unwrap().0.len(), 0);
        let other = ModelKvShape { layers: 2, ..model };
        assert!(b.fit(&other).is_err());
    }

    #[test]
    fn dense_backend_attends_like_the_oracle() {
        let model = shape();
        let heads = model.heads;
        let ch = heads.kv_channels();
        let attn = Attention::new(heads);
        let mut b = DenseBackend::new();
        b.fit(&model).unwrap();
        let (k, v) = (rows(10, ch, 0.5), rows(10, ch, 1.5));
        // Six tokens in one step, then four one at a time.
        let mut outs = Vec::new();
        for (start, n) in [(0, 6), (6, 1), (7, 1), (8, 1), (9, 1)] {
            let q = rows(n, heads.q_len(), start as f32);
            let positions: Vec<usize> = (start..start + n).collect();
            let out = run_step(&mut b, &vec![0; n], |b| {
                for l in 0..model.layers {
                    b.append(l, &k[start * ch..][..n * ch], &v[start * ch..][..n * ch])?;
                }
                b.attend(1, &attn, &q, &positions, &Mask::Causal)
            })
            .unwrap();
            outs.push((q, positions, out.out));
        }
        for (q, positions, got) in outs {
            let want =
                reference_attention(&q, &positions, &k, &v, 10, &heads, &Mask::Causal).unwrap();
            for (g, w) in got.iter().zip(&want.out) {
                assert!(
                    (f64::from(*g) - w).abs() <= 1e-5 * (1.0 + w.abs()),
                    "{g} vs {w}"
                );
            }
        }
    }
}
