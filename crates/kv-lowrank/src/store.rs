//! [`LowRankStore`]: one K or V matrix (`tokens × heads·head_dim`) held as
//! per-head coefficients on low-rank bases, in token chunks that each have
//! one basis per head.
//!
//! - **SubSpace-G** (`pca-*` forms): one chunk over every token, with the
//!   calibrated bases of the layer ([`HeadBases`], shared, not counted in
//!   the store's bytes but reported by [`LowRankStore::basis_bytes`]).
//! - **SubSpace-A** (`fd-*` forms): tokens are taken in order; each head
//!   feeds its frequent-directions sketch. A chunk closes when it reaches
//!   `L` tokens or a token's relative residual `‖(I − P_B)x‖/‖x‖` on the
//!   chunk's basis passes `τ` in any head; the next chunk's bases are
//!   directions of the sketches (which have already seen the token that
//!   closed the chunk): the `r` of them that carry the most energy of the
//!   last `r` tokens (see `chunk_basis` for why not simply the top `r`).
//!   Old tokens are never revisited. Chunk boundaries are
//!   shared by the heads of a store; keys and values chunk independently.
//!   The chunk bases belong to the store and are counted in its bytes.
//!
//! Coefficients of head `h` are a kv-quant [`KvStore`] of `tokens × r_h`
//! values in the form's coefficient code (`fp16`, `int8-sym`, `int4-sym`:
//! one scale per token and head) under the form's protection, so faults are
//! injected, corrected and counted like every other form. Each token and
//! head also keeps its residual norm `‖x − x̂‖` (f16, rounded up, the
//! quantized coefficients included), from which attention derives runtime
//! error certificates ([`crate::certificate`]).

use std::sync::Arc;

use gf2_codes::channel::FaultChannel;
use half::f16;
use kv_quant::{
    CacheForm, CoeffCode, DecodeScratch, FaultTarget, Injection, IntSpec, KvDecodeStats, KvStore,
    LowRankMethod, LowRankSpec, NonFinite, QuantizeOptions, Quantizer, RankRule,
};

use crate::basis::{Basis, BasisStorage};
use crate::error::{LowRankError, Result, check_finite, check_len};
use crate::fd::FrequentDirections;

/// The calibrated bases of one layer part: one per KV head.
#[derive(Clone, Debug, PartialEq)]
pub struct HeadBases {
    /// One basis per head, all of the same dimension.
    pub heads: Vec<Arc<Basis>>,
}

impl HeadBases {
    /// Bytes of the bases as stored.
    pub fn stored_bytes(&self) -> usize {
        self.heads.iter().map(|b| b.stored_bytes()).sum()
    }
}

/// The heads' bases end to end, each as [`Basis::table_bytes`] lays it out.
impl kv_quant::TableBytes for HeadBases {
    fn table_bytes(&self) -> Vec<u8> {
        self.heads.iter().flat_map(|b| b.table_bytes()).collect()
    }

    fn with_table_bytes(&self, bytes: &[u8]) -> kv_quant::Result<Self> {
        let invalid = |e: LowRankError| kv_quant::KvQuantError::InvalidParameter {
            name: "bases",
            reason: e.to_string(),
        };
        if bytes.len() != self.stored_bytes() {
            return Err(invalid(LowRankError::Bases(format!(
                "{} bytes for bases of {}",
                bytes.len(),
                self.stored_bytes()
            ))));
        }
        let mut at = 0;
        let mut heads = Vec::with_capacity(self.heads.len());
        for b in &self.heads {
            let n = b.stored_bytes();
            heads.push(Arc::new(
                b.with_table_bytes(&bytes[at..at + n]).map_err(invalid)?,
            ));
            at += n;
        }
        Ok(Self { heads })
    }

    fn f16_words(&self) -> bool {
        self.heads.iter().all(|b| b.storage() == BasisStorage::F16)
    }
}

/// A run of tokens with one basis per head.
#[derive(Clone, Debug, PartialEq)]
pub struct Chunk {
    /// First token.
    pub start: usize,
    /// One past the last token.
    pub end: usize,
    /// One basis per head.
    pub bases: Vec<Arc<Basis>>,
}

/// Low-rank coefficients of one K or V matrix.
#[derive(Clone, Debug, PartialEq)]
pub struct LowRankStore {
    form: CacheForm,
    spec: LowRankSpec,
    tokens: usize,
    head_dim: usize,
    chunks: Vec<Chunk>,
    /// Per head: `tokens × rank` coefficients.
    coeffs: Vec<KvStore>,
    /// Residual norm bits (f16, rounded up) per token and head.
    residuals: Vec<u16>,
    /// Per chunk and head: the largest `‖x‖` (f16 bits, rounded up).
    norms: Vec<u16>,
    /// Whether the chunk bases belong to this store (online forms).
    owns_bases: bool,
}

/// The low-rank spec of a form, or an error naming it.
pub fn low_rank_spec(form: &CacheForm) -> Result<LowRankSpec> {
    match form.quantizer() {
        Quantizer::LowRank(s) => Ok(*s),
        _ => Err(LowRankError::InvalidParameter {
            name: "form",
            reason: format!("{form} is not a low-rank form (pca-*, fd-*)"),
        }),
    }
}

/// The kv-quant form of the coefficients of one head.
pub fn coefficient_form(form: &CacheForm) -> Result<CacheForm> {
    let spec = low_rank_spec(form)?;
    let q = match spec.coeffs {
        CoeffCode::F16 => Quantizer::Fp16,
        CoeffCode::Int8 | CoeffCode::Int4 => Quantizer::Int(IntSpec {
            bits: if spec.coeffs == CoeffCode::Int8 { 8 } else { 4 },
            symmetric: true,
            ..IntSpec::new(4)
        }),
    };
    Ok(CacheForm::new(q, form.protection().copied())?)
}

/// `x` as f16 bits, rounded up (a bound stays a bound).
fn up16(x: f32) -> u16 {
    let h = f16::from_f32(x);
    if h.to_f32() < x {
        h.to_bits() + 1
    } else {
        h.to_bits()
    }
}

fn norm(x: &[f32]) -> f32 {
    x.iter()
        .map(|v| f64::from(*v) * f64::from(*v))
        .sum::<f64>()
        .sqrt() as f32
}

impl LowRankStore {
    /// Projects `rows` (`tokens × channels`, heads of `head_dim` channels)
    /// on bases of `form`: the calibrated `bases` for `pca-*` forms, bases
    /// fitted online for `fd-*` forms. NaN and infinities are refused.
    pub fn build(
        form: CacheForm,
        rows: &[f32],
        tokens: usize,
        channels: usize,
        head_dim: usize,
        bases: Option<&HeadBases>,
    ) -> Result<Self> {
        let spec = low_rank_spec(&form)?;
        if head_dim == 0 || channels == 0 || !channels.is_multiple_of(head_dim) {
            return Err(LowRankError::InvalidParameter {
                name: "head dimension",
                reason: format!("{channels} channels are not whole heads of {head_dim}"),
            });
        }
        check_len("rows (tokens × channels)", tokens * channels, rows.len())?;
        check_finite(rows, channels)?;
        let heads = channels / head_dim;
        let (chunks, owns_bases) = match spec.method {
            LowRankMethod::Pca(rule) => {
                let bases = check_bases(&form, rule, bases, heads, head_dim)?;
                (
                    vec![Chunk {
                        start: 0,
                        end: tokens,
                        bases,
                    }],
                    false,
                )
            }
            LowRankMethod::Fd {
                rank,
                sketch,
                chunk,
                threshold,
            } => {
                crate::basis::check_rule(RankRule::Fixed(rank), head_dim)?;
                let chunks = online_chunks(
                    rows,
                    tokens,
                    heads,
                    head_dim,
                    rank,
                    sketch,
                    chunk,
                    f64::from(threshold) / 1e6,
                )?;
                (chunks, true)
            }
        };
        let coeff_form = coefficient_form(&form)?;
        let mut coeffs = Vec::with_capacity(heads);
        let mut x = vec![0.0f32; head_dim];
        for h in 0..heads {
            let r = chunks.first().map_or(1, |c| c.bases[h].rank());
            let mut c = vec![0.0f32; tokens * r];
            for chunk in &chunks {
                let basis = &chunk.bases[h];
                for t in chunk.start..chunk.end {
                    x.copy_from_slice(&rows[t * channels + h * head_dim..][..head_dim]);
                    basis.project(&x, &mut c[t * r..][..r]);
                }
            }
            let opts = QuantizeOptions {
                non_finite: NonFinite::Clamp,
            };
            coeffs.push(KvStore::quantize_with(coeff_form, &c, tokens, r, opts)?);
        }
        let mut store = Self {
            form,
            spec,
            tokens,
            head_dim,
            chunks,
            coeffs,
            residuals: Vec::new(),
            norms: Vec::new(),
            owns_bases,
        };
        store.measure(rows)?;
        Ok(store)
    }

    /// Residual norms (against the stored, quantized coefficients) and the
    /// largest row norm of every chunk and head.
    fn measure(&mut self, rows: &[f32]) -> Result<()> {
        let (heads, d) = (self.heads(), self.head_dim);
        let channels = heads * d;
        let mut back = vec![0.0f32; self.tokens * channels];
        if self.tokens > 0 {
            self.decode_rows_into(0, self.tokens, &mut back, &mut StoreScratch::default())?;
        }
        self.residuals = vec![0; self.tokens * heads];
        self.norms = vec![0; self.chunks.len() * heads];
        for (j, chunk) in self.chunks.iter().enumerate() {
            for t in chunk.start..chunk.end {
                for h in 0..heads {
                    let x = &rows[t * channels + h * d..][..d];
                    let y = &back[t * channels + h * d..][..d];
                    let res: f64 = x.iter().zip(y).map(|(a, b)| f64::from(a - b).powi(2)).sum();
                    self.residuals[t * heads + h] = up16(res.sqrt() as f32);
                    let n = up16(norm(x));
                    let slot = &mut self.norms[j * heads + h];
                    if f16::from_bits(n) > f16::from_bits(*slot) {
                        *slot = n;
                    }
                }
            }
        }
        Ok(())
    }

    /// The form.
    pub fn form(&self) -> &CacheForm {
        &self.form
    }

    /// The low-rank parameters of the form.
    pub fn spec(&self) -> &LowRankSpec {
        &self.spec
    }

    /// Tokens held.
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    /// KV heads.
    pub fn heads(&self) -> usize {
        self.coeffs.len()
    }

    /// Channels per head.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// Channels per token (`heads × head_dim`).
    pub fn channels(&self) -> usize {
        self.heads() * self.head_dim
    }

    /// The chunks, in token order.
    pub fn chunks(&self) -> &[Chunk] {
        &self.chunks
    }

    /// The coefficient store of head `h` (`tokens × rank`).
    pub fn coefficients(&self, h: usize) -> &KvStore {
        &self.coeffs[h]
    }

    /// The residual norm bound `‖x − x̂‖` of token `t`, head `h`.
    pub fn residual(&self, t: usize, h: usize) -> f32 {
        f16::from_bits(self.residuals[t * self.heads() + h]).to_f32()
    }

    /// The largest residual norm of head `h` over tokens `range`.
    pub fn max_residual(&self, h: usize, range: std::ops::Range<usize>) -> f32 {
        range.map(|t| self.residual(t, h)).fold(0.0f32, f32::max)
    }

    /// A bound on `‖x‖` of every token of head `h` in tokens `range` (the
    /// largest row norm of the chunks it touches).
    pub fn max_norm(&self, h: usize, range: std::ops::Range<usize>) -> f32 {
        let heads = self.heads();
        self.chunks
            .iter()
            .enumerate()
            .filter(|(_, c)| c.start < range.end && range.start < c.end)
            .map(|(j, _)| f16::from_bits(self.norms[j * heads + h]).to_f32())
            .fold(0.0f32, f32::max)
    }

    /// Stored bytes: coefficients (with their scales and check bytes),
    /// residual norms, chunk norms, and the chunk bases of online forms.
    pub fn stored_bytes(&self) -> usize {
        let coeffs: usize = self.coeffs.iter().map(KvStore::stored_bytes).sum();
        let own = if self.owns_bases {
            self.basis_bytes()
        } else {
            0
        };
        coeffs + 2 * self.residuals.len() + 2 * self.norms.len() + own
    }

    /// Bytes of the bases the store reads (shared calibrated bases are
    /// counted once per store here; online bases are part of `stored_bytes`).
    pub fn basis_bytes(&self) -> usize {
        self.chunks
            .iter()
            .flat_map(|c| c.bases.iter())
            .map(|b| b.stored_bytes())
            .sum()
    }

    /// Whether the chunk bases belong to the store (`fd-*` forms).
    pub fn owns_bases(&self) -> bool {
        self.owns_bases
    }

    /// Reconstructs tokens `start..start + count` (`x̂ = μ + c·B` per head,
    /// the chunk's basis) into `out` (`count × channels`), returning the
    /// statistics of the coefficient decodes.
    pub fn decode_rows_into(
        &self,
        start: usize,
        count: usize,
        out: &mut [f32],
        scratch: &mut StoreScratch,
    ) -> Result<KvDecodeStats> {
        let end = start
            .checked_add(count)
            .filter(|&e| e <= self.tokens && count > 0)
            .ok_or(LowRankError::InvalidParameter {
                name: "rows",
                reason: format!("{start}+{count} outside the {} tokens", self.tokens),
            })?;
        let (heads, d) = (self.heads(), self.head_dim);
        check_len("output rows", count * heads * d, out.len())?;
        let mut stats = KvDecodeStats::default();
        for h in 0..heads {
            let r = self.coeffs[h].channels();
            if scratch.coeffs.len() < count * r {
                scratch.coeffs.resize(count * r, 0.0);
            }
            let c = &mut scratch.coeffs[..count * r];
            stats += self.coeffs[h].decode_rows_into(start, count, c, &mut scratch.decode)?;
            for chunk in self
                .chunks
                .iter()
                .filter(|c| c.start < end && start < c.end)
            {
                let basis = &chunk.bases[h];
                for t in chunk.start.max(start)..chunk.end.min(end) {
                    let i = t - start;
                    basis.reconstruct(&c[i * r..][..r], &mut out[i * heads * d + h * d..][..d]);
                }
            }
        }
        Ok(stats)
    }

    /// Reads the coefficients through `bases` from now on (the calibrated
    /// bases read back through their protected table, faults and all);
    /// refused for a store owning its bases (online forms) or bases of
    /// another shape.
    pub fn replace_bases(&mut self, bases: &HeadBases) -> Result<()> {
        let fits = |chunk: &Chunk| {
            chunk.bases.len() == bases.heads.len()
                && chunk.bases.iter().zip(&bases.heads).all(|(a, b)| {
                    (a.dim(), a.rank(), a.storage()) == (b.dim(), b.rank(), b.storage())
                })
        };
        if self.owns_bases || !self.chunks.iter().all(fits) {
            return Err(LowRankError::Bases(format!(
                "{} reads no calibrated bases of that shape to replace",
                self.form
            )));
        }
        for chunk in &mut self.chunks {
            chunk.bases.clone_from(&bases.heads);
        }
        Ok(())
    }

    /// Injects faults into every head's coefficients (head `h` draws from
    /// the stream of `seed + h`) and returns each head's exact flips;
    /// residual norms are side data of the certificates and are not exposed.
    pub fn inject(
        &mut self,
        channel: &dyn FaultChannel,
        seed: u64,
        target: FaultTarget,
    ) -> Vec<Injection> {
        self.coeffs
            .iter_mut()
            .enumerate()
            .map(|(h, c)| c.inject(channel, seed.wrapping_add(h as u64), target))
            .collect()
    }
}

/// Reusable buffers of [`LowRankStore::decode_rows_into`].
#[derive(Clone, Debug, Default)]
pub struct StoreScratch {
    coeffs: Vec<f32>,
    decode: DecodeScratch,
}

/// The calibrated bases, checked against the form and the head shape.
fn check_bases(
    form: &CacheForm,
    rule: RankRule,
    bases: Option<&HeadBases>,
    heads: usize,
    head_dim: usize,
) -> Result<Vec<Arc<Basis>>> {
    crate::basis::check_rule(rule, head_dim)?;
    let Some(bases) = bases else {
        return Err(LowRankError::Bases(format!(
            "{form} needs bases fitted on a calibration text (kv-eval calibrate, or --calib-text)"
        )));
    };
    if bases.heads.len() != heads {
        return Err(LowRankError::Bases(format!(
            "{} bases for {heads} heads",
            bases.heads.len()
        )));
    }
    for (h, b) in bases.heads.iter().enumerate() {
        if b.dim() != head_dim {
            return Err(LowRankError::Bases(format!(
                "head {h}: a basis of dimension {} for heads of {head_dim}",
                b.dim()
            )));
        }
        if let RankRule::Fixed(r) = rule
            && b.rank() != r
        {
            return Err(LowRankError::Bases(format!(
                "head {h}: a basis of rank {} for {form}",
                b.rank()
            )));
        }
    }
    Ok(bases.heads.clone())
}

/// SubSpace-A chunking (see the module docs).
#[allow(clippy::too_many_arguments)]
fn online_chunks(
    rows: &[f32],
    tokens: usize,
    heads: usize,
    d: usize,
    rank: usize,
    sketch: usize,
    max_len: usize,
    threshold: f64,
) -> Result<Vec<Chunk>> {
    let channels = heads * d;
    let mut sketches: Vec<FrequentDirections> = (0..heads)
        .map(|_| FrequentDirections::new(sketch, d))
        .collect::<Result<_>>()?;
    let mut chunks: Vec<Chunk> = Vec::new();
    let mut c = vec![0.0f32; rank];
    let mut y = vec![0.0f32; d];
    for t in 0..tokens {
        let row = &rows[t * channels..][..channels];
        for (h, fd) in sketches.iter_mut().enumerate() {
            fd.insert(&row[h * d..][..d])?;
        }
        let rollover = match chunks.last() {
            None => true,
            Some(ch) if ch.end - ch.start >= max_len => true,
            Some(ch) => ch.bases.iter().enumerate().any(|(h, b)| {
                let x = &row[h * d..][..d];
                b.project(x, &mut c);
                b.reconstruct(&c, &mut y);
                let res: f64 = x
                    .iter()
                    .zip(&y)
                    .map(|(a, b)| f64::from(a - b).powi(2))
                    .sum();
                let n = f64::from(norm(x));
                n > 0.0 && res.sqrt() > threshold * n
            }),
        };
        if rollover {
            let recent = t.saturating_sub(rank - 1)..t + 1;
            let bases = sketches
                .iter()
                .enumerate()
                .map(|(h, fd)| {
                    let heads_rows = recent.clone().map(|u| &rows[u * channels + h * d..][..d]);
                    chunk_basis(fd, heads_rows, d, rank).map(Arc::new)
                })
                .collect::<Result<Vec<_>>>()?;
            chunks.push(Chunk {
                start: t,
                end: t + 1,
                bases,
            });
        } else if let Some(ch) = chunks.last_mut() {
            ch.end = t + 1;
        }
    }
    if chunks.is_empty() {
        // No token: one empty chunk keeps the coefficient stores' shapes.
        let bases = sketches
            .iter()
            .map(|fd| chunk_basis(fd, std::iter::empty(), d, rank).map(Arc::new))
            .collect::<Result<Vec<_>>>()?;
        chunks.push(Chunk {
            start: 0,
            end: 0,
            bases,
        });
    }
    Ok(chunks)
}

/// A new chunk's basis: `rank` of the sketch's right singular directions,
/// those carrying the most energy of the `recent` rows (the last `rank`
/// tokens, the one that closed the chunk included), ties by singular value;
/// directions beyond the sketch's complete it to an orthonormal basis.
///
/// Choosing by recent energy rather than by singular value alone lets a
/// chunk follow a shift of the stream at once: the sketch (of `m ≥ 2r`
/// rows) keeps the new directions well before their total energy outgrows
/// the old ones, and a basis of the old top directions would close a chunk
/// at every token until it did.
fn chunk_basis<'r>(
    fd: &FrequentDirections,
    recent: impl Iterator<Item = &'r [f32]> + Clone,
    d: usize,
    rank: usize,
) -> Result<Basis> {
    let mut dirs = fd.directions();
    let energy = |v: &[f64]| -> f64 {
        recent
            .clone()
            .map(|x| {
                x.iter()
                    .zip(v)
                    .map(|(a, b)| f64::from(*a) * b)
                    .sum::<f64>()
                    .powi(2)
            })
            .sum()
    };
    let mut scored: Vec<(f64, f64, Vec<f64>)> =
        dirs.drain(..).map(|(s, v)| (energy(&v), s, v)).collect();
    scored.sort_by(|a, b| b.0.total_cmp(&a.0).then(b.1.total_cmp(&a.1)));
    let mut chosen: Vec<Vec<f64>> = scored.into_iter().take(rank).map(|x| x.2).collect();
    // Complete with coordinate vectors made orthogonal to what is chosen.
    let mut e = 0;
    while chosen.len() < rank && e < d {
        let mut v: Vec<f64> = (0..d).map(|j| if j == e { 1.0 } else { 0.0 }).collect();
        for u in &chosen {
            let dot: f64 = v.iter().zip(u).map(|(a, b)| a * b).sum();
            for (a, b) in v.iter_mut().zip(u) {
                *a -= dot * b;
            }
        }
        let n = v.iter().map(|a| a * a).sum::<f64>().sqrt();
        if n > 1e-6 {
            chosen.push(v.into_iter().map(|a| a / n).collect());
        }
        e += 1;
    }
    let flat: Vec<f64> = chosen.into_iter().flatten().collect();
    Basis::from_directions(d, &flat, BasisStorage::F16)
}
