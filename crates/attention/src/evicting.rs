//! [`Evicting`]: any [`KvBackend`] with SnapKV's token eviction at the end
//! of the prefill ([`SnapKv`]).
//!
//! Until [`Evicting::evict`] the wrapper passes every call through and
//! keeps, beside the inner backend, the f32 rows as the model computed them
//! (a [`DenseBackend`]) and each layer's last `window` queries. `evict`
//! selects each key head's tokens from those, empties the inner backend and
//! writes the kept rows into it compactly, as one step, coded from the f32
//! rows (so a quantised cache codes each kept row once, as it would have;
//! groups that span tokens, per-channel key scales, form over the kept
//! rows). Then the wrapper drops its copies and maps positions: the model
//! still counts the tokens it has seen ([`tokens`](KvBackend::tokens) is
//! the prefill's length plus what followed, so RoPE positions stay true),
//! while masks are taken on the stored rows (a query after the prefill
//! sees every kept row and the rows after them up to its own).
//!
//! Forms that rotate keys to their stored row's position when read (keys
//! coded before RoPE) would read evicted rows at the wrong positions; the
//! caller refuses them (kv-eval does). A backend that shares blocks by
//! token ids must not be wrapped: the kept rows of different heads belong
//! to different tokens (kv-eval wraps paged caches without a prefix cache).

use std::collections::VecDeque;

use crate::attend::{Attention, AttentionOutput};
use crate::backend::{DenseBackend, KvBackend, ModelKvShape, ReadView};
use crate::error::AttentionError;
use crate::evict::SnapKv;
use crate::shape::{HeadShape, Mask};

/// What an eviction kept.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Eviction {
    /// Tokens of the prefill.
    pub prefill: usize,
    /// Rows each key head kept of them.
    pub kept: usize,
}

impl Eviction {
    /// The stored row of the model's position `p`, which must not lie
    /// inside the prefill (a range's end may be the prefill's end).
    fn stored(&self, p: usize, what: &str) -> Result<usize, AttentionError> {
        if p < self.prefill {
            return Err(AttentionError::InvalidParameter {
                name: "position",
                reason: format!(
                    "{what} {p} lies in the prefill of {} tokens, whose rows were evicted \
                     or moved",
                    self.prefill
                ),
            });
        }
        Ok(p - (self.prefill - self.kept))
    }

    /// The stored row a key range starting at position `start` starts at:
    /// 0 for the first, else as [`stored`](Self::stored).
    fn stored_start(&self, start: usize) -> Result<usize, AttentionError> {
        match start {
            0 => Ok(0),
            s => self.stored(s, "key range start"),
        }
    }
}

/// A [`KvBackend`] that evicts tokens once, at the end of the prefill (see
/// the module docs).
#[derive(Debug)]
pub struct Evicting<B> {
    inner: B,
    /// `None`: every call passes through, nothing is kept.
    policy: Option<SnapKv>,
    shape: Option<(usize, HeadShape)>,
    /// The f32 rows as computed, until the eviction.
    rows: Option<DenseBackend>,
    /// Per layer, the last `window` queries attended (position, row).
    queries: Vec<VecDeque<(usize, Vec<f32>)>>,
    done: Option<Eviction>,
    /// Whether a step is open.
    open: bool,
}

impl<B: KvBackend> Evicting<B> {
    /// `inner` (empty: nothing written yet) under `policy`.
    pub fn new(inner: B, policy: SnapKv) -> Result<Self, B::Error> {
        Self::with_policy(inner, Some(policy))
    }

    /// [`new`](Self::new) where `policy` is given, else `inner` with every
    /// call passed through and nothing kept beside it ([`evict`](Self::evict)
    /// refused): one cache type for callers that evict only sometimes.
    pub fn with_policy(inner: B, policy: Option<SnapKv>) -> Result<Self, B::Error> {
        if inner.tokens() != 0 {
            return Err(AttentionError::InvalidParameter {
                name: "eviction",
                reason: format!(
                    "the cache holds {} tokens already: wrap an empty one",
                    inner.tokens()
                ),
            }
            .into());
        }
        Ok(Self {
            inner,
            policy,
            shape: None,
            rows: policy.map(|_| DenseBackend::new()),
            queries: Vec::new(),
            done: None,
            open: false,
        })
    }

    /// The wrapped backend.
    pub fn inner(&self) -> &B {
        &self.inner
    }

    /// The selection's parameters (`None`: a pass-through).
    pub fn policy(&self) -> Option<&SnapKv> {
        self.policy.as_ref()
    }

    /// What the eviction kept, once it ran.
    pub fn eviction(&self) -> Option<Eviction> {
        self.done
    }

    /// Tokens evicted: stored row `r` after the eviction is the model's
    /// position `r + offset` for rows written after it.
    fn offset(&self) -> usize {
        self.done.map_or(0, |e| e.prefill - e.kept)
    }

    /// Evicts: keeps [`SnapKv::budget`] of the committed tokens per key
    /// head, selected by the last `window` queries each layer attended,
    /// and writes them compactly into the emptied inner backend. Refused
    /// (nothing changed) while a step is open, before any token, a second
    /// time, or when a layer has not attended the prefill's last queries.
    /// An error of the inner backend while writing leaves the cache empty
    /// (no token held, none evicted).
    pub fn evict(&mut self) -> Result<Eviction, B::Error> {
        let refuse = |reason: String| -> B::Error {
            AttentionError::InvalidParameter {
                name: "eviction",
                reason,
            }
            .into()
        };
        let Some(policy) = self.policy else {
            return Err(refuse(
                "this cache passes every call through (no policy)".into(),
            ));
        };
        let (Some(rows), Some((layers, shape))) = (&self.rows, self.shape) else {
            return Err(refuse(match self.done {
                Some(_) => "the cache has evicted once already".into(),
                None => "nothing written yet".into(),
            }));
        };
        let prefill = rows.tokens();
        if self.open {
            return Err(refuse(
                "a step is open (commit or roll it back first)".into(),
            ));
        }
        if prefill == 0 || self.inner.tokens() != prefill || rows.layers() != layers {
            return Err(refuse(format!("{prefill} tokens committed")));
        }
        let window = policy.window().min(prefill);
        let (kv, d) = (shape.kv_channels(), shape.head_dim());
        let mut kept_rows = Vec::with_capacity(layers);
        let mut kept = 0;
        for layer in 0..layers {
            let seen: Vec<&(usize, Vec<f32>)> = self.queries[layer]
                .iter()
                .filter(|(p, _)| *p < prefill)
                .collect();
            let seen = &seen[seen.len().saturating_sub(window)..];
            let positions: Vec<usize> = seen.iter().map(|(p, _)| *p).collect();
            let queries: Vec<f32> = seen.iter().flat_map(|(_, q)| q.iter().copied()).collect();
            let (k, v) = rows.rows(layer).expect("fitted layers");
            let heads = policy.select(&shape, &queries, &positions, &k[..prefill * kv])?;
            kept = heads[0].len();
            let (mut ks, mut vs) = (vec![0.0f32; kept * kv], vec![0.0f32; kept * kv]);
            for (g, tokens) in heads.iter().enumerate() {
                for (slot, &t) in tokens.iter().enumerate() {
                    let (from, to) = (t as usize * kv + g * d, slot * kv + g * d);
                    ks[to..to + d].copy_from_slice(&k[from..from + d]);
                    vs[to..to + d].copy_from_slice(&v[from..from + d]);
                }
            }
            kept_rows.push((ks, vs));
        }
        // The kept rows' token ids differ by head, so none is named (a
        // backend wrapped here shares no blocks by them).
        self.inner.truncate(0)?;
        let written = self.inner.begin(&vec![0u32; kept]).and_then(|()| {
            kept_rows
                .iter()
                .enumerate()
                .try_for_each(|(layer, (k, v))| self.inner.append(layer, k, v))
        });
        if let Err(e) = written.and_then(|()| self.inner.commit()) {
            self.inner.rollback();
            // Empty, as the inner backend is (refitted by the next pass).
            self.rows = Some(DenseBackend::new());
            self.queries.iter_mut().for_each(VecDeque::clear);
            return Err(e);
        }
        let done = Eviction { prefill, kept };
        self.done = Some(done);
        self.rows = None;
        self.queries.clear();
        Ok(done)
    }

    /// The query ring of each layer cut to positions before `tokens`.
    fn forget_queries_from(&mut self, tokens: usize) {
        for ring in &mut self.queries {
            ring.retain(|(p, _)| *p < tokens);
        }
    }

    /// Applies `f` to the f32 copy, if one is kept (before the eviction).
    fn mirror(
        &mut self,
        f: impl FnOnce(&mut DenseBackend) -> Result<(), AttentionError>,
    ) -> Result<(), B::Error> {
        match &mut self.rows {
            Some(rows) => Ok(f(rows)?),
            None => Ok(()),
        }
    }
}

impl<B: KvBackend> KvBackend for Evicting<B> {
    type Error = B::Error;

    fn fit(&mut self, model: &ModelKvShape<'_>) -> Result<(), B::Error> {
        self.inner.fit(model)?;
        self.mirror(|r| r.fit(model))?;
        if self.shape.is_none() {
            self.shape = Some((model.layers, model.heads));
            self.queries = vec![VecDeque::new(); model.layers];
        }
        Ok(())
    }

    fn tokens(&self) -> usize {
        self.inner.tokens() + self.offset()
    }

    fn begin(&mut self, tokens: &[u32]) -> Result<(), B::Error> {
        self.inner.begin(tokens)?;
        if let Err(e) = self.mirror(|r| r.begin(tokens)) {
            self.inner.rollback();
            return Err(e);
        }
        self.open = true;
        Ok(())
    }

    fn append(&mut self, layer: usize, keys: &[f32], values: &[f32]) -> Result<(), B::Error> {
        self.inner.append(layer, keys, values)?;
        self.mirror(|r| r.append(layer, keys, values))
    }

    fn attend(
        &mut self,
        layer: usize,
        attention: &Attention,
        queries: &[f32],
        positions: &[usize],
        mask: &Mask<'_>,
    ) -> Result<AttentionOutput, B::Error> {
        let Some(done) = self.done else {
            if let (Some(policy), Some(ring)) = (self.policy, self.queries.get_mut(layer)) {
                let q_len = attention.shape().q_len();
                // Only the call's last `window` queries can be kept.
                let skip = positions.len().saturating_sub(policy.window());
                let rows = queries.chunks_exact(q_len).skip(skip);
                for (&p, q) in positions[skip..].iter().zip(rows) {
                    ring.push_back((p, q.to_vec()));
                    if ring.len() > policy.window() {
                        ring.pop_front();
                    }
                }
            }
            return self
                .inner
                .attend(layer, attention, queries, positions, mask);
        };
        let stored = positions
            .iter()
            .map(|&p| done.stored(p, "query position"))
            .collect::<Result<Vec<_>, _>>()?;
        let ranges;
        let mask = match mask {
            Mask::Causal => Mask::Causal,
            Mask::SlidingWindow(_) => {
                return Err(AttentionError::InvalidParameter {
                    name: "mask",
                    reason: "a sliding window counts model positions, which evicted rows no \
                             longer follow"
                        .into(),
                }
                .into());
            }
            Mask::Ranges(r) => {
                ranges = r
                    .iter()
                    .map(|r| Ok(done.stored_start(r.start)?..done.stored(r.end, "key range end")?))
                    .collect::<Result<Vec<_>, AttentionError>>()?;
                Mask::Ranges(&ranges)
            }
        };
        self.inner.attend(layer, attention, queries, &stored, &mask)
    }

    fn commit(&mut self) -> Result<(), B::Error> {
        let before = self.tokens();
        self.open = false;
        if let Err(e) = self.inner.commit() {
            self.mirror(|r| {
                r.rollback();
                Ok(())
            })?;
            self.forget_queries_from(before);
            return Err(e);
        }
        self.mirror(|r| r.commit())
    }

    fn rollback(&mut self) {
        let before = self.tokens();
        self.open = false;
        self.inner.rollback();
        if let Some(rows) = &mut self.rows {
            rows.rollback();
        }
        self.forget_queries_from(before);
    }

    /// Cuts back to `tokens` of the model's count: refused into the
    /// evicted prefill once it is evicted.
    fn truncate(&mut self, tokens: usize) -> Result<(), B::Error> {
        let offset = self.offset();
        if let Some(done) = self.done
            && tokens < done.prefill
        {
            return Err(AttentionError::InvalidParameter {
                name: "truncate",
                reason: format!(
                    "to {tokens} tokens, into the prefill of {} whose evicted rows are gone",
                    done.prefill
                ),
            }
            .into());
        }
        self.inner.truncate(tokens - offset)?;
        self.mirror(|r| r.truncate(tokens))?;
        self.forget_queries_from(tokens);
        Ok(())
    }

    fn commit_prefix(&mut self, keep: usize) -> Result<(), B::Error> {
        let before = self.tokens();
        self.open = false;
        match self.inner.commit_prefix(keep) {
            Ok(()) => {
                self.mirror(|r| r.commit_prefix(keep))?;
                self.forget_queries_from(self.tokens());
                Ok(())
            }
            Err(e) => {
                self.mirror(|r| {
                    r.rollback();
                    Ok(())
                })?;
                self.forget_queries_from(before);
                Err(e)
            }
        }
    }

    fn skips_layer(&self, layer: usize) -> bool {
        self.inner.skips_layer(layer)
    }

    fn rows_before_seal(&self) -> Option<usize> {
        self.inner.rows_before_seal()
    }

    fn set_read_view(&mut self, view: ReadView) -> Result<(), B::Error> {
        self.inner.set_read_view(view)
    }
}
