//! The Shard cache form of one layer ([`ShardLayer`],
//! `shard-kv-compression-blog.md` sections 5-10) and attention computed on
//! its compressed forms.
//!
//! Segments, by token: the first `sink` tokens and the last `window` tokens
//! of the prefill exact (f16); the middle between them compressed (keys
//! through kv-lowrank's [`ShardKeys`] after RoPE is undone, values through
//! kv-quant's [`ChannelVq`] or NF4 after a Hadamard rotation); tokens
//! written after the prefill in the decode stream (Hadamard + Lloyd-Max per
//! token, data-oblivious, or f16 when the stream is off). A middle too short
//! to fit a basis and a codebook stays exact.
//!
//! Scores of middle keys never see a rotated key. The score of a query at
//! `p` against a key at `t` depends on `Δ = t − p` only (section 9):
//! `Σᵢ (aᵢcᵢ + bᵢdᵢ)·cos θᵢΔ + (bᵢcᵢ − aᵢdᵢ)·sin θᵢΔ`, with `(a, b)` the
//! de-rotated query pair and `(c, d)` the key pair `μ + c·B` rebuilt from
//! the coefficients of one tile. Splitting `Δ = (t₀ − p) + (t − t₀)` for a
//! tile starting at `t₀` evaluates it as one dot product: the query
//! rotated back by `t₀` (once per tile and head) against the tile's keys
//! rotated by their offset `t − t₀` within the tile (one table of `cos`,
//! `sin` per call). Values are summed in the rotated space and rotated back
//! once per output (section 10): `Σ w·H⁻¹(ṽ) = H⁻¹(Σ w·ṽ)`, and the
//! per-channel maxima of the VQ form multiply the sum, not each token.

use std::ops::Range;
use std::sync::Arc;

use half::f16;
use kv_lowrank::ShardKeys;
use kv_quant::{
    CacheForm, ChannelVq, DecodeScratch, FitOptions, KvStore, LloydMaxSpec, Nf4Spec, Quantizer,
    Rotation, ScaleType, ShardSpec, ShardValues,
};

use crate::error::{AttentionError, Result, check_len};
use crate::rope::Rope;

mod attend;
mod faults;

pub use faults::ShardFaults;

/// Middle tokens per tile (rebuilt keys of one KV head at a time).
const TILE: usize = 64;

/// Queries per work item: each tile rebuilt serves all of them.
const QUERY_BLOCK: usize = 16;

/// Fewest middle tokens that are compressed (below, the middle stays exact).
const MIN_MIDDLE: usize = 16;

/// How the middle's values are stored.
#[derive(Clone, Debug)]
enum MiddleValues {
    Vq(ChannelVq),
    Nf4(Box<KvStore>),
}

/// One layer's keys and values in a `shard` form.
#[derive(Clone, Debug)]
pub struct ShardLayer {
    form: CacheForm,
    kv_heads: usize,
    head_dim: usize,
    tokens: usize,
    prefill: usize,
    middle: Range<usize>,
    rope: Rope,
    /// Exact rows (f16 bits) of every token outside the middle and the
    /// Lloyd-Max stream, token order: row of token `t` is `t − middle.len()`.
    exact_keys: Vec<u16>,
    exact_values: Vec<u16>,
    keys: Option<Arc<ShardKeys>>,
    values: Option<Arc<MiddleValues>>,
    /// Keys and values of tokens `prefill..tokens` in the Lloyd-Max stream.
    stream: Option<(KvStore, KvStore)>,
}

/// The pieces of a stored layer, by bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ShardBytes {
    /// Exact f16 rows (sink, window, and the stream when it is off).
    pub exact: usize,
    /// Middle keys: codes, scales, int8 basis and mean.
    pub keys: usize,
    /// Middle values: indices, codebook and channel maxima (or NF4).
    pub values: usize,
    /// The Lloyd-Max decode stream.
    pub stream: usize,
}

impl ShardBytes {
    /// Every byte held.
    pub fn total(&self) -> usize {
        self.exact + self.keys + self.values + self.stream
    }
}

impl ShardLayer {
    /// Stores `keys` and `values` (`tokens × kv_heads·head_dim`, keys with
    /// RoPE applied at their row's position) of which the first `prefill`
    /// tokens were prefilled (sink, middle, window) and the rest generated
    /// (the decode stream). Bases and codebooks are fitted on the middle.
    pub fn build(
        form: CacheForm,
        keys: &[f32],
        values: &[f32],
        tokens: usize,
        prefill: usize,
        rope: &Rope,
    ) -> Result<Self> {
        Self::build_with(form, keys, values, tokens, prefill, rope, None)
    }

    /// [`build`](Self::build) with the key basis of a `-cal` form: fitted
    /// on a calibration text's keys (all KV heads, RoPE undone), required
    /// by `-cal` forms and refused by the others.
    pub fn build_with(
        form: CacheForm,
        keys: &[f32],
        values: &[f32],
        tokens: usize,
        prefill: usize,
        rope: &Rope,
        basis: Option<&kv_lowrank::Basis>,
    ) -> Result<Self> {
        let Quantizer::Shard(spec) = *form.quantizer() else {
            return Err(AttentionError::InvalidParameter {
                name: "form",
                reason: format!("{form} is not a shard form"),
            });
        };
        let head_dim = rope.head_dim();
        let channels = keys.len().checked_div(tokens).unwrap_or(0);
        if tokens == 0 || channels == 0 || !channels.is_multiple_of(head_dim) {
            return Err(AttentionError::InvalidParameter {
                name: "rows",
                reason: format!(
                    "{} key values are not {tokens} tokens of whole heads of {head_dim}",
                    keys.len()
                ),
            });
        }
        check_len("keys (tokens × channels)", tokens * channels, keys.len())?;
        check_len(
            "values (tokens × channels)",
            tokens * channels,
            values.len(),
        )?;
        if prefill > tokens {
            return Err(AttentionError::InvalidParameter {
                name: "prefill",
                reason: format!("{prefill} prefilled tokens of {tokens}"),
            });
        }
        for (what, rows) in [("key", keys), ("value", values)] {
            if let Some(i) = rows.iter().position(|x| !x.is_finite()) {
                return Err(AttentionError::InvalidParameter {
                    name: "rows",
                    reason: format!(
                        "{what} of token {}, channel {} is {}",
                        i / channels,
                        i % channels,
                        rows[i]
                    ),
                });
            }
        }
        if spec.calibrated != basis.is_some() {
            return Err(AttentionError::InvalidParameter {
                name: "basis",
                reason: format!(
                    "{form} {} a calibrated key basis",
                    if spec.calibrated { "needs" } else { "takes no" }
                ),
            });
        }
        if let Some(r) = spec.rank
            && r > channels
        {
            return Err(AttentionError::InvalidParameter {
                name: "rank",
                reason: format!("a rank of {r} is above the key dimension {channels} ({form})"),
            });
        }
        let seg = form.segments();
        let sink_end = seg.sink.min(prefill);
        let window_start = prefill.saturating_sub(seg.window).max(sink_end);
        let mut middle = sink_end..window_start;
        let fits = middle.len() >= MIN_MIDDLE
            && middle.len() * channels >= kv_quant::channel_vq::CENTROIDS * 4;
        if !fits {
            middle = sink_end..sink_end;
        }
        let (mut exact_keys, mut exact_values) = (Vec::new(), Vec::new());
        let exact_end = if spec.stream.is_some() {
            prefill
        } else {
            tokens
        };
        for t in (0..exact_end).filter(|t| !middle.contains(t)) {
            let row = t * channels..(t + 1) * channels;
            exact_keys.extend(
                keys[row.clone()]
                    .iter()
                    .map(|&x| f16::from_f32(x).to_bits()),
            );
            exact_values.extend(values[row].iter().map(|&x| f16::from_f32(x).to_bits()));
        }
        let (mut shard_keys, mut shard_values) = (None, None);
        if !middle.is_empty() {
            let rows = middle.start * channels..middle.end * channels;
            let mut unrotated = keys[rows.clone()].to_vec();
            for (t, row) in middle.clone().zip(unrotated.chunks_exact_mut(channels)) {
                rope.undo(row, t)?;
            }
            shard_keys = Some(Arc::new(match basis {
                Some(b) => {
                    ShardKeys::with_basis(&unrotated, middle.len(), b, spec.key_bits(), spec.group)?
                }
                None => ShardKeys::fit(
                    &unrotated,
                    middle.len(),
                    channels,
                    spec.key_bits(),
                    spec.group,
                    spec.rank,
                )?,
            }));
            let v = &values[rows];
            shard_values = Some(Arc::new(match spec.values {
                ShardValues::Vq => MiddleValues::Vq(ChannelVq::fit(
                    v,
                    middle.len(),
                    channels,
                    head_dim,
                    FitOptions {
                        seed: 0,
                        iterations: 20,
                        max_samples: 1 << 15,
                    },
                )?),
                ShardValues::Nf4 => {
                    let nf4 = nf4_form(head_dim)?;
                    MiddleValues::Nf4(Box::new(KvStore::quantize(nf4, v, middle.len(), channels)?))
                }
            }));
        }
        let stream = stream(spec, keys, values, tokens, prefill, channels, head_dim)?;
        Ok(Self {
            form,
            kv_heads: channels / head_dim,
            head_dim,
            tokens,
            prefill,
            middle,
            rope: rope.clone(),
            exact_keys,
            exact_values,
            keys: shard_keys,
            values: shard_values,
            stream,
        })
    }

    /// The same layer after generation: `keys` and `values` hold every
    /// token (`tokens × channels`), of which the first
    /// [`prefill`](Self::prefill) are those this layer was built from (not
    /// read again: the fitted middle, sink and window are kept); the rest
    /// go to the decode stream.
    pub fn extended(&self, keys: &[f32], values: &[f32], tokens: usize) -> Result<Self> {
        let ch = self.channels();
        check_len("keys (tokens × channels)", tokens * ch, keys.len())?;
        check_len("values (tokens × channels)", tokens * ch, values.len())?;
        if tokens < self.prefill {
            return Err(AttentionError::InvalidParameter {
                name: "tokens",
                reason: format!(
                    "{tokens} tokens, fewer than the prefill of {}",
                    self.prefill
                ),
            });
        }
        let spec = self.spec();
        let kept = (self.prefill - self.middle.len()) * ch;
        let mut out = Self {
            tokens,
            exact_keys: self.exact_keys[..kept].to_vec(),
            exact_values: self.exact_values[..kept].to_vec(),
            stream: stream(spec, keys, values, tokens, self.prefill, ch, self.head_dim)?,
            ..self.clone()
        };
        if spec.stream.is_none() {
            let rows = self.prefill * ch..tokens * ch;
            out.exact_keys.extend(
                keys[rows.clone()]
                    .iter()
                    .map(|&x| f16::from_f32(x).to_bits()),
            );
            out.exact_values
                .extend(values[rows].iter().map(|&x| f16::from_f32(x).to_bits()));
        }
        Ok(out)
    }

    /// The form.
    pub fn form(&self) -> &CacheForm {
        &self.form
    }

    /// The form's parameters.
    pub fn spec(&self) -> ShardSpec {
        match self.form.quantizer() {
            Quantizer::Shard(s) => *s,
            _ => unreachable!("built from shard forms only"),
        }
    }

    /// Tokens stored.
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    /// Tokens of the prefill (sink, middle and window).
    pub fn prefill(&self) -> usize {
        self.prefill
    }

    /// The compressed tokens (empty when the prefill was too short).
    pub fn middle(&self) -> Range<usize> {
        self.middle.clone()
    }

    /// Channels per token (all KV heads).
    pub fn channels(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    /// The middle's keys, when compressed.
    pub fn keys(&self) -> Option<&ShardKeys> {
        self.keys.as_deref()
    }

    /// Bytes held, by piece.
    pub fn bytes(&self) -> ShardBytes {
        let code = self.form.protection().map(|p| p.code);
        ShardBytes {
            exact: 2 * (self.exact_keys.len() + self.exact_values.len()),
            keys: self.keys.as_ref().map_or(0, |k| {
                k.stored_bytes() - k.codes().len() + faults::protected_len(k.codes().len(), code)
            }),
            values: match self.values.as_deref() {
                Some(MiddleValues::Vq(v)) => {
                    v.stored_bytes() - v.indices().len()
                        + faults::protected_len(v.indices().len(), code)
                }
                Some(MiddleValues::Nf4(s)) => s.stored_bytes(),
                None => 0,
            },
            stream: self
                .stream
                .as_ref()
                .map_or(0, |(k, v)| k.stored_bytes() + v.stored_bytes()),
        }
    }

    /// Bytes held.
    pub fn stored_bytes(&self) -> usize {
        self.bytes().total()
    }

    /// Every key (RoPE applied at its position) and value as stored, f32:
    /// the dequantise-then-attend oracle of [`ShardLayer::attend`].
    pub fn dequantize(&self) -> Result<(Vec<f32>, Vec<f32>)> {
        let ch = self.channels();
        let (k, v) = self.plain_rows()?;
        let m = self.middle.len();
        let (mut keys, mut values) = (
            vec![0.0f32; self.tokens * ch],
            vec![0.0f32; self.tokens * ch],
        );
        for t in (0..self.tokens).filter(|t| !self.middle.contains(t)) {
            let r = (t - if t >= self.middle.end { m } else { 0 }) * ch;
            keys[t * ch..(t + 1) * ch].copy_from_slice(&k[r..r + ch]);
            values[t * ch..(t + 1) * ch].copy_from_slice(&v[r..r + ch]);
        }
        if let (Some(sk), Some(sv)) = (&self.keys, self.values.as_deref()) {
            for t in self.middle.clone() {
                let row = &mut keys[t * ch..(t + 1) * ch];
                sk.reconstruct_into(t - self.middle.start, row)?;
                self.rope.apply(row, t)?;
            }
            let rows = &mut values[self.middle.start * ch..self.middle.end * ch];
            match sv {
                MiddleValues::Vq(vq) => vq.decode_rows_into(0, m, rows)?,
                MiddleValues::Nf4(s) => {
                    s.decode_rows_into(0, m, rows, &mut DecodeScratch::new())?;
                }
            }
        }
        Ok((keys, values))
    }

    /// Rows of every token outside the middle, f32, in token order (the
    /// exact rows, then the decoded stream).
    fn plain_rows(&self) -> Result<(Vec<f32>, Vec<f32>)> {
        let widen = |b: &[u16]| {
            b.iter()
                .map(|&x| f16::from_bits(x).to_f32())
                .collect::<Vec<_>>()
        };
        let (mut k, mut v) = (widen(&self.exact_keys), widen(&self.exact_values));
        if let Some((sk, sv)) = &self.stream {
            let n = sk.tokens() * self.channels();
            let mut scratch = DecodeScratch::new();
            for (store, out) in [(sk, &mut k), (sv, &mut v)] {
                let at = out.len();
                out.resize(at + n, 0.0);
                store.decode_rows_into(0, store.tokens(), &mut out[at..], &mut scratch)?;
            }
        }
        Ok((k, v))
    }
}

/// The Lloyd-Max stream of tokens `prefill..tokens` (none when off or empty).
fn stream(
    spec: ShardSpec,
    keys: &[f32],
    values: &[f32],
    tokens: usize,
    prefill: usize,
    channels: usize,
    head_dim: usize,
) -> Result<Option<(KvStore, KvStore)>> {
    match spec.stream {
        Some(bits) if tokens > prefill => {
            let lm = stream_form(bits, head_dim)?;
            let rows = prefill * channels..tokens * channels;
            let n = tokens - prefill;
            Ok(Some((
                KvStore::quantize(lm, &keys[rows.clone()], n, channels)?,
                KvStore::quantize(lm, &values[rows], n, channels)?,
            )))
        }
        _ => Ok(None),
    }
}

/// The NF4 form of the middle's values: per head Hadamard, groups of 64.
fn nf4_form(head_dim: usize) -> Result<CacheForm> {
    let nf4 = CacheForm::plain(Quantizer::Nf4(Nf4Spec {
        group: kv_quant::spec::DEFAULT_NF4_GROUP.min(head_dim),
        scale: ScaleType::F16,
    }))?;
    Ok(nf4.with_rotation(Some(Rotation { block: head_dim }))?)
}

/// The Lloyd-Max form of the decode stream, rotated per head.
fn stream_form(bits: u8, head_dim: usize) -> Result<CacheForm> {
    let lm = CacheForm::plain(Quantizer::LloydMax(LloydMaxSpec {
        bits,
        qjl: false,
        scale: ScaleType::F16,
    }))?;
    Ok(lm.with_rotation(Some(Rotation { block: head_dim }))?)
}
