//! The Shard cache form of one layer ([`ShardLayer`],
//! `shard-kv-compression-blog.md` sections 5-10) and attention computed on
//! its compressed forms.
//!
//! Segments, by token: the first `sink` tokens and the last `window` tokens
//! of the prefill exact (f16); the middle between them compressed (keys
//! through kv-lowrank's [`ShardKeys`] after RoPE is undone, values through
//! kv-quant's [`ChannelVq`] or NF4 after a Hadamard rotation); tokens
//! written after the prefill in the decode stream (Hadamard + Lloyd-Max per
//! token, data-oblivious, optionally with a QJL sketch, or f16 when the
//! stream is off). A middle too short to fit a basis and a codebook stays
//! exact. Under `-f<C>` every whole chunk of `C` generated tokens leaves
//! the stream and is folded into the compressed middle: its rows as the
//! stream held them, RoPE undone, stored on the prefill's basis, bit
//! allocation and codebook with scales of their own (the blog's first
//! attempt at decode tokens, section 8, at chunk granularity).
//!
//! Scores of middle keys never see a rotated key. The score of a query at
//! `p` against a key at `t` depends on `Δ = t − p` only (section 9):
//! `Σᵢ (aᵢcᵢ + bᵢdᵢ)·cos θᵢΔ + (bᵢcᵢ − aᵢdᵢ)·sin θᵢΔ`, with `(a, b)` the
//! de-rotated query pair and `(c, d)` the key pair `μ + c·B` rebuilt from
//! the coefficients of one tile. Splitting `Δ = (t₀ − p) + (t − t₀)` for a
//! tile starting at `t₀` evaluates it as one dot product: the query
//! rotated back by `t₀` (once per tile and head) against the tile's keys
//! rotated by their offset `t − t₀` within the tile (one table of `cos`,
//! `sin` per layer). Values are summed in the rotated space and rotated back
//! once per output (section 10): `Σ w·H⁻¹(ṽ) = H⁻¹(Σ w·ṽ)`, and the
//! per-channel maxima of the VQ form multiply the sum, not each token.

use std::ops::Range;
use std::sync::Arc;

use half::f16;
use kv_lowrank::ShardKeys;
use kv_quant::{
    CacheForm, ChannelVq, DecodeScratch, FitOptions, KvStore, LloydMaxSpec, Nf4Spec,
    ProtectedTable, Quantizer, Rotation, ScaleType, ShardSpec, ShardValues,
};

use crate::error::{AttentionError, Result, check_len};
use crate::rope::Rope;

mod attend;
mod faults;
mod tile_math;

use tile_math::OffsetTable;

pub use faults::ShardFaults;

/// How Shard's value codebooks are fitted (on a prefill's middle, or on a
/// calibration text for the `-cal` forms): 20 k-means iterations over at
/// most 2^15 seeded samples.
pub const SHARD_VALUE_FIT: FitOptions = FitOptions {
    seed: 0,
    iterations: 20,
    max_samples: 1 << 15,
};

/// Middle tokens per tile (keys rebuilt together, stored channel by channel).
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

/// One compressed run of tokens: the prefill's middle, or a chunk of
/// generated tokens folded in after it (sharing its basis and codebook).
#[derive(Clone, Debug)]
struct Compressed {
    tokens: Range<usize>,
    /// Compressed tokens before this run (its first row among them all).
    first: usize,
    keys: Arc<ShardKeys>,
    values: Arc<MiddleValues>,
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
    /// `cos`, `sin` of RoPE's angles at each offset within a tile.
    offsets: Arc<OffsetTable>,
    /// Exact rows (f16 bits) of every token outside the compressed runs and
    /// the Lloyd-Max stream, in token order.
    exact_keys: Vec<u16>,
    exact_values: Vec<u16>,
    /// The prefill's middle first (when compressed), then the folded
    /// chunks, in token order.
    compressed: Vec<Compressed>,
    /// Keys and values of the tokens after the folded chunks in the
    /// Lloyd-Max stream.
    stream: Option<(KvStore, KvStore)>,
}

/// The pieces of a stored layer, by bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ShardBytes {
    /// Exact f16 rows (sink, window, and the stream when it is off).
    pub exact: usize,
    /// Compressed keys (the middle and its folded chunks): codes, scales,
    /// the int8 basis and mean (once).
    pub keys: usize,
    /// Compressed values: indices, channel maxima and the codebook (once),
    /// or NF4.
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
        let mut layer = Self {
            form,
            kv_heads: channels / head_dim,
            head_dim,
            tokens,
            prefill,
            middle: middle.clone(),
            rope: rope.clone(),
            offsets: Arc::new(OffsetTable::new(rope)),
            exact_keys: Vec::new(),
            exact_values: Vec::new(),
            compressed: Vec::new(),
            stream: None,
        };
        for t in (0..prefill).filter(|t| !middle.contains(t)) {
            layer.push_exact(
                &keys[t * channels..(t + 1) * channels],
                &values[t * channels..(t + 1) * channels],
            );
        }
        if !middle.is_empty() {
            let rows = middle.start * channels..middle.end * channels;
            let mut unrotated = keys[rows.clone()].to_vec();
            for (t, row) in middle.clone().zip(unrotated.chunks_exact_mut(channels)) {
                rope.undo(row, t)?;
            }
            let shard_keys = match basis {
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
            };
            let v = &values[rows];
            let shard_values = match spec.values {
                ShardValues::Vq => MiddleValues::Vq(ChannelVq::fit(
                    v,
                    middle.len(),
                    channels,
                    head_dim,
                    SHARD_VALUE_FIT,
                )?),
                ShardValues::Nf4 => MiddleValues::Nf4(Box::new(KvStore::quantize(
                    nf4_form(head_dim)?,
                    v,
                    middle.len(),
                    channels,
                )?)),
            };
            layer.compressed.push(Compressed {
                tokens: middle,
                first: 0,
                keys: Arc::new(shard_keys),
                values: Arc::new(shard_values),
            });
        }
        layer.append_generated(keys, values, None)?;
        Ok(layer)
    }

    /// The same layer after generation: `keys` and `values` hold every
    /// token (`tokens × channels`), of which the first
    /// [`prefill`](Self::prefill) are those this layer was built from (not
    /// read again: the fitted middle, sink and window are kept), and so are
    /// the chunks this layer has folded that end by `tokens`; the rest go
    /// to folded chunks and the decode stream. Equal to building the layer
    /// from all `tokens` at once. When `tokens` is at least this layer's,
    /// the stream rows it holds are kept as they are and only the tokens
    /// after them are encoded (the stream is row-local), so a decode step
    /// costs one token's encoding, not the whole stream's; those rows of
    /// `keys` and `values` must be the ones this layer was extended with.
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
        let rows = self.prefill * ch..tokens * ch;
        for (what, rows) in [("key", &keys[rows.clone()]), ("value", &values[rows])] {
            if let Some(i) = rows.iter().position(|x| !x.is_finite()) {
                return Err(AttentionError::InvalidParameter {
                    name: "rows",
                    reason: format!(
                        "{what} of token {}, channel {} is {}",
                        self.prefill + i / ch,
                        i % ch,
                        rows[i]
                    ),
                });
            }
        }
        let kept = (self.prefill - self.middle.len()) * ch;
        let mut out = Self {
            form: self.form,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            tokens,
            prefill: self.prefill,
            middle: self.middle.clone(),
            rope: self.rope.clone(),
            offsets: Arc::clone(&self.offsets),
            exact_keys: self.exact_keys[..kept].to_vec(),
            exact_values: self.exact_values[..kept].to_vec(),
            compressed: self
                .compressed
                .iter()
                .filter(|c| c.tokens.end <= tokens)
                .cloned()
                .collect(),
            stream: None,
        };
        let prior = self.stream.as_ref().filter(|_| tokens >= self.tokens);
        out.append_generated(keys, values, prior)?;
        Ok(out)
    }

    /// Stores the tokens after the folded chunks (every token past the
    /// prefill when none are): whole chunks folded under `-f<C>` (when the
    /// middle is compressed), the rest in the stream (or exact). `prior`
    /// is a stream of the tokens from this layer's first unfolded token on
    /// (the rows of `keys` and `values` it was encoded from), reused when no
    /// chunk is folded now.
    fn append_generated(
        &mut self,
        keys: &[f32],
        values: &[f32],
        prior: Option<&(KvStore, KvStore)>,
    ) -> Result<()> {
        let spec = self.spec();
        let (ch, d) = (self.channels(), self.head_dim);
        let unfolded = self.folded_end();
        let mut start = unfolded;
        if let (Some(c), Some(middle)) = (spec.fold, self.compressed.first().cloned()) {
            while start + c <= self.tokens {
                let rows = start * ch..(start + c) * ch;
                let (mut k, v) = as_stored(spec, &keys[rows.clone()], &values[rows], c, ch, d)?;
                for (t, row) in (start..start + c).zip(k.chunks_exact_mut(ch)) {
                    self.rope.undo(row, t)?;
                }
                let folded = match &*middle.values {
                    MiddleValues::Vq(vq) => MiddleValues::Vq(vq.encode_chunk(&v, c)?),
                    MiddleValues::Nf4(_) => {
                        MiddleValues::Nf4(Box::new(KvStore::quantize(nf4_form(d)?, &v, c, ch)?))
                    }
                };
                let last = self.compressed.last().unwrap_or(&middle);
                let first = last.first + last.tokens.len();
                self.compressed.push(Compressed {
                    tokens: start..start + c,
                    first,
                    keys: Arc::new(middle.keys.encode_chunk(&k, c)?),
                    values: Arc::new(folded),
                });
                start += c;
            }
        }
        let rest = start * ch..self.tokens * ch;
        match spec.stream {
            Some(_) if !rest.is_empty() => {
                let lm = stream_form(spec, d)?;
                let n = self.tokens - start;
                let (rest_k, rest_v) = (&keys[rest.clone()], &values[rest]);
                let reusable =
                    prior.filter(|(k, _)| start == unfolded && k.tokens() <= n && k.form() == &lm);
                self.stream = Some(match reusable {
                    Some((pk, pv)) if pk.tokens() == n => (pk.clone(), pv.clone()),
                    Some((pk, pv)) => {
                        // The prior rows copied, only the new ones encoded.
                        let (kept, m) = (pk.tokens() * ch, n - pk.tokens());
                        (
                            pk.concat(&KvStore::quantize(lm, &rest_k[kept..], m, ch)?)?,
                            pv.concat(&KvStore::quantize(lm, &rest_v[kept..], m, ch)?)?,
                        )
                    }
                    None => (
                        KvStore::quantize(lm, rest_k, n, ch)?,
                        KvStore::quantize(lm, rest_v, n, ch)?,
                    ),
                });
            }
            None => {
                for t in start..self.tokens {
                    let row = t * ch..(t + 1) * ch;
                    self.push_exact(&keys[row.clone()], &values[row]);
                }
            }
            _ => {}
        }
        Ok(())
    }

    /// Appends one exact row of keys and values (f16).
    fn push_exact(&mut self, keys: &[f32], values: &[f32]) {
        self.exact_keys
            .extend(keys.iter().map(|&x| f16::from_f32(x).to_bits()));
        self.exact_values
            .extend(values.iter().map(|&x| f16::from_f32(x).to_bits()));
    }

    /// The first token after the prefill and the folded chunks.
    fn folded_end(&self) -> usize {
        self.compressed
            .last()
            .map_or(self.prefill, |c| c.tokens.end.max(self.prefill))
    }

    /// Generated tokens folded into the compressed middle.
    pub fn folded(&self) -> usize {
        self.folded_end() - self.prefill
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

    /// The prefill's compressed tokens (empty when the prefill was too
    /// short); chunks folded after it are counted by [`folded`](Self::folded).
    pub fn middle(&self) -> Range<usize> {
        self.middle.clone()
    }

    /// Channels per token (all KV heads).
    pub fn channels(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    /// The middle's keys, when compressed.
    pub fn keys(&self) -> Option<&ShardKeys> {
        self.compressed.first().map(|c| &*c.keys)
    }

    /// Bytes held, by piece (a folded chunk's keys and values without the
    /// basis and codebook it shares with the middle).
    pub fn bytes(&self) -> ShardBytes {
        let code = self.form.protection().map(|p| p.code);
        // Scales and tables are stored under the metadata code (`faults`).
        let meta = |bytes: usize| ProtectedTable::stored_len(bytes, self.metadata_protection());
        let mut bytes = ShardBytes {
            exact: 2 * (self.exact_keys.len() + self.exact_values.len()),
            stream: self
                .stream
                .as_ref()
                .map_or(0, |(k, v)| k.stored_bytes() + v.stored_bytes()),
            ..ShardBytes::default()
        };
        for (i, c) in self.compressed.iter().enumerate() {
            let k = &c.keys;
            bytes.keys += faults::protected_len(k.codes().len(), code) + meta(2 * k.scales().len());
            if i == 0 {
                bytes.keys += meta(k.shared_bytes());
            }
            bytes.values += match &*c.values {
                MiddleValues::Vq(v) => {
                    faults::protected_len(v.indices().len(), code)
                        + meta(2 * v.max().len())
                        + if i == 0 { meta(v.shared_bytes()) } else { 0 }
                }
                MiddleValues::Nf4(s) => s.stored_bytes(),
            };
        }
        bytes
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
        let (mut keys, mut values) = (
            vec![0.0f32; self.tokens * ch],
            vec![0.0f32; self.tokens * ch],
        );
        for (span, row) in self.plain_spans() {
            let (from, to) = (
                row * ch..(row + span.len()) * ch,
                span.start * ch..span.end * ch,
            );
            keys[to.clone()].copy_from_slice(&k[from.clone()]);
            values[to].copy_from_slice(&v[from]);
        }
        for c in &self.compressed {
            for t in c.tokens.clone() {
                let row = &mut keys[t * ch..(t + 1) * ch];
                c.keys.reconstruct_into(t - c.tokens.start, row)?;
                self.rope.apply(row, t)?;
            }
            let n = c.tokens.len();
            let rows = &mut values[c.tokens.start * ch..c.tokens.end * ch];
            match &*c.values {
                MiddleValues::Vq(vq) => vq.decode_rows_into(0, n, rows)?,
                MiddleValues::Nf4(s) => {
                    s.decode_rows_into(0, n, rows, &mut DecodeScratch::new())?;
                }
            }
        }
        Ok((keys, values))
    }

    /// The runs of tokens outside the compressed ones, in order, each with
    /// the row of its first token in [`plain_rows`](Self::plain_rows).
    fn plain_spans(&self) -> Vec<(Range<usize>, usize)> {
        let (mut spans, mut at, mut row) = (Vec::new(), 0, 0);
        for c in self
            .compressed
            .iter()
            .map(|c| c.tokens.clone())
            .chain(std::iter::once(self.tokens..self.tokens))
        {
            if c.start > at {
                spans.push((at..c.start, row));
                row += c.start - at;
            }
            at = c.end;
        }
        spans
    }

    /// Rows of every token outside the compressed runs, f32, in token
    /// order (the exact rows, then the decoded stream).
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

/// Rows of `tokens` generated tokens as the decode stream holds them (its
/// Lloyd-Max codes decoded, or f16 when it is off): what a folded chunk
/// is encoded from.
fn as_stored(
    spec: ShardSpec,
    keys: &[f32],
    values: &[f32],
    tokens: usize,
    channels: usize,
    head_dim: usize,
) -> Result<(Vec<f32>, Vec<f32>)> {
    let mut out = (vec![0.0f32; keys.len()], vec![0.0f32; values.len()]);
    for (rows, to) in [(keys, &mut out.0), (values, &mut out.1)] {
        if spec.stream.is_some() {
            let store = KvStore::quantize(stream_form(spec, head_dim)?, rows, tokens, channels)?;
            store.decode_rows_into(0, tokens, to, &mut DecodeScratch::new())?;
        } else {
            for (o, &x) in to.iter_mut().zip(rows) {
                *o = f16::from_f32(x).to_f32();
            }
        }
    }
    Ok(out)
}

/// The NF4 form of the middle's values: per head Hadamard, groups of 64.
pub(crate) fn nf4_form(head_dim: usize) -> Result<CacheForm> {
    let nf4 = CacheForm::plain(Quantizer::Nf4(Nf4Spec {
        group: kv_quant::spec::DEFAULT_NF4_GROUP.min(head_dim),
        scale: ScaleType::F16,
    }))?;
    Ok(nf4.with_rotation(Some(Rotation { block: head_dim }))?)
}

/// The Lloyd-Max form of the decode stream, rotated per head (the form's
/// stream must be on).
fn stream_form(spec: ShardSpec, head_dim: usize) -> Result<CacheForm> {
    let lm = CacheForm::plain(Quantizer::LloydMax(LloydMaxSpec {
        bits: spec.stream.unwrap_or(kv_quant::spec::DEFAULT_SHARD_STREAM),
        qjl: spec.stream_qjl,
        scale: ScaleType::F16,
    }))?;
    Ok(lm.with_rotation(Some(Rotation { block: head_dim }))?)
}
