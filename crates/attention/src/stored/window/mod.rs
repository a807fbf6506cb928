//! [`WindowPart`]: one part (keys or values) of one layer coded whole
//! from its f32 rows at once, as the re-encode protocol attends it (the
//! ECC paper's protocol: every window quantised again from f32 truth and
//! faulted afresh on every call).
//!
//! The paged cache writes rows one token at a time and seals blocks
//! ([`StoredPart`](super::StoredPart)); a window is what the same forms
//! are when the rows are all known first: a row-local or per-channel
//! kv-quant form over the whole window (per-channel scales over every
//! token, exact sink and window segments inside the store), or a low-rank
//! form whose bases are fitted on the window (`fd-*`) or read from the
//! calibration (`pca-*`). The stores are
//! kv-quant's [`KvStore`] and kv-lowrank's [`LowRankStore`], the types
//! the paged parts seal into; [`open_window`](super::open_window) is the
//! registry beside [`open_part`](super::open_part), so nothing above this
//! crate branches on a form to build, fault, count or read a window.
//!
//! A window's fitted tables (a `vq` codebook, calibrated bases) are
//! counted with it ([`WindowPart::shared_bytes`], amortised over the
//! tokens of one window) and faulted in a fresh stored, protected copy
//! ([`WindowPart::inject_shared`], [`SharedTable`]), so the tables every
//! other window reads stay clean. Attention reads a window through
//! [`WindowPart::source`] (fused and integer kernels on the stored
//! halves and levels; keys a form projected before RoPE rotated back to
//! their positions by the RoPE they were opened with) or, for low-rank
//! keys and values of equal rank, in coefficient space
//! ([`attend_windows`]). A window source cuts tiles as the protocol
//! always has (it does not forward the store's
//! [`row_bytes`](crate::KvSource::row_bytes), so tiles stay
//! `tile_tokens` rows long): forwarding it would change the protocol's
//! bits on long windows.

mod layer;

pub(super) use layer::open as layer_open;

pub use layer::{
    WindowBytes, WindowInjection, WindowLayer, WindowShape, WindowState, check_layer_forms,
    keeps_prefill,
};

use std::ops::Range;
use std::sync::Arc;

use gf2_codes::DecodeStats;
use gf2_codes::channel::FaultChannel;
use kv_lowrank::{HeadBases, LowRankStore};
use kv_quant::{
    CacheForm, DecodeScratch, FaultTarget, Hadamard, KvStore, MetaProtection, NonFinite,
    ProtectedTable, QuantizeOptions, Quantizer,
};

use super::{Fitted, SharedTable};
use crate::error::{AttentionError, Result};
use crate::low_rank::{LowRankScratch, PreRopeKeys};
use crate::pair_codes::pair_tile;
use crate::source::{KvSource, StoreScratch, Tile};
use crate::{Attention, AttentionOutput, Mask, Rope};

/// One part of one layer coded whole from its f32 rows (see the module
/// docs); built by [`open_window`](super::open_window).
#[derive(Clone, Debug)]
pub struct WindowPart {
    store: WindowStore,
    /// The calibrated bases a low-rank store was projected on (faulted
    /// in a fresh copy by [`inject_shared`](Self::inject_shared)).
    bases: Option<Arc<HeadBases>>,
    /// The RoPE keys of a form projected before RoPE were rotated back
    /// with, which reading rotates them again by.
    rope: Option<Rope>,
}

/// Where a window's rows are kept.
#[derive(Clone, Debug)]
enum WindowStore {
    /// A kv-quant store (row-local, per-channel, codebook, segments).
    Rows(KvStore),
    /// A low-rank store.
    LowRank(LowRankStore),
}

/// Codes `rows` (`tokens × channels`, heads of `head_dim`) in `form` as
/// one window, reading `fitted`'s codebook or bases where the form needs
/// them; keys of a form projected before RoPE are rotated back to
/// position 0 first (`rope`, kept to rotate them again when read; without
/// it the rows are coded as given). Values a fault upstream made
/// non-finite are clamped, so the fault's outcome is measured, not fatal:
/// kv-quant forms clamp to their group's range (`NonFinite::Clamp`),
/// low-rank forms NaN to 0 and infinities to ±`f32::MAX` (what the
/// protocol always did: `clamp_non_finite`'s ±f16::MAX would change its
/// bits). Shard forms, whose state outlives one call, are
/// refused (attention's [`ShardLayer`](crate::ShardLayer) holds them).
pub(super) fn open(
    form: CacheForm,
    fitted: &Fitted,
    rows: &[f32],
    (tokens, channels, head_dim): (usize, usize, usize),
    rope: Option<&Rope>,
) -> Result<WindowPart> {
    match form.quantizer() {
        Quantizer::Shard(_) => Err(AttentionError::InvalidParameter {
            name: "form",
            reason: format!(
                "{form} is a shard form: its middle is fitted at the prefill and kept, so it \
                 is built by ShardLayer, not coded again per window"
            ),
        }),
        Quantizer::Hierarchical(_) => Err(AttentionError::InvalidParameter {
            name: "form",
            reason: format!(
                "{form} keeps two 4-bit planes for a paged cache to read whole or, for \
                 self-speculation, upper plane only; the re-encode protocol does not hold it \
                 (use --backend paged)"
            ),
        }),
        Quantizer::Vq(spec) if spec.pre_rope => {
            open_pairs(form, fitted, rows, (tokens, channels), rope)
        }
        Quantizer::LowRank(spec) => {
            let unrotate = rope.filter(|_| spec.pre_rope);
            let unrotated;
            let rows = match unrotate {
                Some(rope) => {
                    let mut r = rows.to_vec();
                    for (t, row) in r.chunks_exact_mut(channels.max(1)).enumerate() {
                        rope.undo(row, t)?;
                    }
                    unrotated = r;
                    &unrotated[..]
                }
                _ => rows,
            };
            let clamped;
            let rows = if rows.iter().all(|x| x.is_finite()) {
                rows
            } else {
                clamped = rows
                    .iter()
                    .map(|&x| match x {
                        x if x.is_nan() => 0.0,
                        x if x.is_infinite() => x.signum() * f32::MAX,
                        x => x,
                    })
                    .collect::<Vec<f32>>();
                &clamped[..]
            };
            let store = LowRankStore::build(
                form,
                rows,
                tokens,
                channels,
                head_dim,
                fitted.bases.as_deref(),
            )?;
            Ok(WindowPart {
                bases: (!store.owns_bases())
                    .then(|| fitted.bases.clone())
                    .flatten(),
                store: WindowStore::LowRank(store),
                rope: unrotate.cloned(),
            })
        }
        _ => {
            let options = QuantizeOptions {
                non_finite: NonFinite::Clamp,
            };
            let codebook = super::codebook_of(form, fitted)?;
            let store = match codebook {
                Some(cb) => {
                    KvStore::quantize_with_codebook(form, rows, tokens, channels, options, cb)?
                }
                None => KvStore::quantize_with(form, rows, tokens, channels, options)?,
            };
            Ok(WindowPart {
                store: WindowStore::Rows(store),
                bases: None,
                rope: None,
            })
        }
    }
}

/// Keys coded before RoPE on pair codebooks (`cq-d2-pre`), as a paged
/// cache's [`RopePairPart`](super::RopePairPart) codes a block: the rows
/// past the window's sink tokens rotated back to position 0 from their
/// positions and put in pair order, the sink rows exact as given; read
/// rotated to their positions again ([`WindowPart::source`]).
fn open_pairs(
    form: CacheForm,
    fitted: &Fitted,
    rows: &[f32],
    (tokens, channels): (usize, usize),
    rope: Option<&Rope>,
) -> Result<WindowPart> {
    let refuse = |reason: String| AttentionError::InvalidParameter {
        name: "form",
        reason,
    };
    let rope = rope.ok_or_else(|| {
        refuse(format!(
            "{form} codes keys before RoPE and needs the model's RoPE"
        ))
    })?;
    if form.segments().window > 0 {
        return Err(refuse(format!(
            "{form} keeps a window of exact tokens, which keys coded before RoPE do not hold \
             (keep sink tokens with +sink<S>)"
        )));
    }
    let codebook = super::codebook_of(form, fitted)?
        .ok_or_else(|| refuse(format!("{form} reads a fitted codebook")))?;
    if Some(rows.len()) != tokens.checked_mul(channels) {
        return Err(AttentionError::ShapeMismatch {
            what: "window rows",
            expected: tokens.saturating_mul(channels),
            got: rows.len(),
        });
    }
    let sink = form.segments().sink.min(tokens);
    // Non-finite values (a fault upstream) saturate before the rotation,
    // as a paged block's staged rows do when it seals.
    let mut unrotated = rows.to_vec();
    super::clamp_non_finite(&mut unrotated);
    let coded = &mut unrotated[sink * channels..];
    if !coded.is_empty() {
        rope.undo_rows(coded, channels, sink)?;
    }
    rope.to_pair_order(coded, &mut Vec::new());
    let options = QuantizeOptions {
        non_finite: NonFinite::Clamp,
    };
    let store =
        KvStore::quantize_with_codebook(form, &unrotated, tokens, channels, options, codebook)?;
    Ok(WindowPart {
        store: WindowStore::Rows(store),
        bases: None,
        rope: Some(rope.clone()),
    })
}

impl WindowPart {
    /// The form the rows are coded in.
    pub fn form(&self) -> CacheForm {
        match &self.store {
            WindowStore::Rows(s) => *s.form(),
            WindowStore::LowRank(s) => *s.form(),
        }
    }

    /// Tokens held.
    pub fn tokens(&self) -> usize {
        match &self.store {
            WindowStore::Rows(s) => s.tokens(),
            WindowStore::LowRank(s) => KvSource::tokens(s),
        }
    }

    /// Bytes the window holds of its own (codes, scales, checks, exact
    /// segments, bases fitted on the window).
    pub fn stored_bytes(&self) -> usize {
        match &self.store {
            WindowStore::Rows(s) => s.stored_bytes(),
            WindowStore::LowRank(s) => s.stored_bytes(),
        }
    }

    /// Bytes of the fitted tables the window reads (a `vq` codebook,
    /// calibrated bases), as stored under the form's metadata code:
    /// counted with every window that reads them.
    pub fn shared_bytes(&self) -> usize {
        let table = |form: &CacheForm, bytes: usize| {
            let protection = form
                .protection()
                .map_or(MetaProtection::Unprotected, |p| p.metadata);
            ProtectedTable::stored_len(bytes, protection)
        };
        match &self.store {
            WindowStore::Rows(s) => s
                .codebook()
                .map_or(0, |c| table(s.form(), c.stored_bytes())),
            WindowStore::LowRank(s) if s.owns_bases() => 0,
            WindowStore::LowRank(s) => table(s.form(), s.basis_bytes()),
        }
    }

    /// Injects faults from `channel` with `seed` into every stored bit
    /// `target` reaches (the stores' fault ledgers record each flip, so
    /// reads count corrected, miscorrected and silent words); returns the
    /// bits flipped.
    pub fn inject(&mut self, channel: &dyn FaultChannel, seed: u64, target: FaultTarget) -> u64 {
        match &mut self.store {
            WindowStore::Rows(s) => s.inject(channel, seed, target).total() as u64,
            WindowStore::LowRank(s) => s
                .inject(channel, seed, target)
                .iter()
                .map(|i| i.total() as u64)
                .sum(),
        }
    }

    /// The kv-quant store of a window kept in one, for faults drawn row
    /// by row (a non-uniform fault map); `None` for a low-rank window,
    /// which takes faults on the whole window only.
    pub fn rows_mut(&mut self) -> Option<&mut KvStore> {
        match &mut self.store {
            WindowStore::Rows(s) => Some(s),
            WindowStore::LowRank(_) => None,
        }
    }

    /// The low-rank store of a low-rank window (for its error
    /// certificates).
    pub fn low_rank(&self) -> Option<&LowRankStore> {
        match &self.store {
            WindowStore::LowRank(s) => Some(s),
            WindowStore::Rows(_) => None,
        }
    }

    /// Injects faults from `channel` with `seed` into a fresh stored,
    /// protected copy of the fitted tables the window reads (the form's
    /// metadata code, [`SharedTable`]) under targets that reach metadata;
    /// where a flip changes what the tables read as, the window reads them
    /// as decoded from then on. Returns the bits flipped and how the
    /// tables' words decoded (nothing without tables, or under
    /// [`FaultTarget::Values`]).
    pub fn inject_shared(
        &mut self,
        channel: &dyn FaultChannel,
        seed: u64,
        target: FaultTarget,
    ) -> Result<(u64, DecodeStats)> {
        if target == FaultTarget::Values {
            return Ok(Default::default());
        }
        let form = self.form();
        match &mut self.store {
            WindowStore::Rows(s) => {
                let Some(cb) = s.codebook().cloned() else {
                    return Ok(Default::default());
                };
                let mut table = SharedTable::new(cb, &form);
                let (hit, changed) = table.inject(channel, seed, target)?;
                if hit.total() == 0 {
                    return Ok(Default::default());
                }
                if changed {
                    s.replace_codebook(table.read().clone())?;
                }
                Ok((hit.total() as u64, table.stats()))
            }
            WindowStore::LowRank(s) => {
                let Some(bases) = &self.bases else {
                    return Ok(Default::default());
                };
                let mut table = SharedTable::new(bases.clone(), &form);
                let (hit, changed) = table.inject(channel, seed, target)?;
                if hit.total() == 0 {
                    return Ok(Default::default());
                }
                if changed {
                    s.replace_bases(table.read())?;
                }
                Ok((hit.total() as u64, table.stats()))
            }
        }
    }

    /// The window as attention reads it: keys of a form projected before
    /// RoPE rotated back to their positions (from 0) on the way, by the
    /// RoPE they were opened with.
    pub fn source(&self) -> WindowSource<'_> {
        WindowSource(match (&self.store, &self.rope) {
            (WindowStore::Rows(s), Some(rope)) => SourceKind::Pairs(s, rope),
            (WindowStore::Rows(s), None) => SourceKind::Store(s),
            (WindowStore::LowRank(s), Some(rope)) => {
                SourceKind::PreRope(PreRopeKeys::new(s, rope, 0))
            }
            (WindowStore::LowRank(s), None) => SourceKind::LowRank(s),
        })
    }

    /// Whether the rows were rotated back to position 0 before coding
    /// (keys of a form projected before RoPE, opened with a RoPE).
    pub fn rotated_back(&self) -> bool {
        self.rope.is_some()
    }
}

/// Attends `queries` at `positions` over windows of keys and values:
/// in coefficient space where both are low-rank (keys after RoPE) with
/// one rank for every head and run
/// ([`Attention::attend_low_rank`]), else through the kernels over their
/// [`source`](WindowPart::source)s. Values rotated back before coding
/// (opened with a RoPE under a form projected before RoPE) are refused:
/// values carry no RoPE.
pub fn attend_windows(
    attention: &Attention,
    queries: &[f32],
    positions: &[usize],
    (keys, values): (&WindowPart, &WindowPart),
    mask: &Mask<'_>,
) -> Result<AttentionOutput> {
    if values.rotated_back() {
        return Err(AttentionError::InvalidParameter {
            name: "values",
            reason: format!(
                "{} values were rotated back to position 0: values carry no RoPE (open them \
                 without one)",
                values.form()
            ),
        });
    }
    match coefficient_path(keys, values) {
        Some((k, v)) => attention.attend_low_rank(queries, positions, k, v, mask),
        None => attention.prefill(queries, positions, &keys.source(), &values.source(), mask),
    }
}

/// Whether keys and values can be attended in coefficient space: both
/// low-rank, keys after RoPE, equal ranks per head and chunk.
fn coefficient_path<'a>(
    keys: &'a WindowPart,
    values: &'a WindowPart,
) -> Option<(&'a LowRankStore, &'a LowRankStore)> {
    if keys.rotated_back() {
        return None;
    }
    let (k, v) = (keys.low_rank()?, values.low_rank()?);
    let ranks = |s: &LowRankStore| -> Vec<usize> {
        s.chunks()
            .iter()
            .flat_map(|c| c.bases.iter().map(|b| b.rank()))
            .collect()
    };
    let (rk, rv) = (ranks(k), ranks(v));
    let uniform = |r: &[usize]| r.windows(2).all(|w| w[0] == w[1]);
    (!k.spec().pre_rope && uniform(&rk) && uniform(&rv) && rk.first() == rv.first())
        .then_some((k, v))
}

/// A [`WindowPart`] as attention reads it ([`WindowPart::source`]).
pub struct WindowSource<'a>(SourceKind<'a>);

/// What a window source reads.
enum SourceKind<'a> {
    Store(&'a KvStore),
    LowRank(&'a LowRankStore),
    PreRope(PreRopeKeys<'a>),
    /// Keys coded before RoPE on pair codebooks, rotated when read.
    Pairs(&'a KvStore, &'a Rope),
}

/// Per-thread buffers of a [`WindowSource`].
#[derive(Debug, Default)]
pub struct WindowScratch {
    store: StoreScratch,
    low_rank: LowRankScratch,
    /// Decoded rows of keys coded before RoPE, one head's buffer.
    pairs: (Vec<f32>, DecodeScratch, Vec<f32>),
    /// Their codes and angles, where they are scored as codes.
    pair_codes: super::PairScratch,
}

impl KvSource for WindowSource<'_> {
    type Scratch = WindowScratch;

    fn tokens(&self) -> usize {
        match &self.0 {
            SourceKind::Store(s) => KvSource::tokens(*s),
            SourceKind::LowRank(s) => KvSource::tokens(*s),
            SourceKind::PreRope(s) => s.tokens(),
            SourceKind::Pairs(s, _) => KvSource::tokens(*s),
        }
    }

    fn channels(&self) -> usize {
        match &self.0 {
            SourceKind::Store(s) => KvSource::channels(*s),
            SourceKind::LowRank(s) => KvSource::channels(*s),
            SourceKind::PreRope(s) => s.channels(),
            SourceKind::Pairs(s, _) => KvSource::channels(*s),
        }
    }

    fn stored_bytes(&self) -> usize {
        match &self.0 {
            SourceKind::Store(s) => KvSource::stored_bytes(*s),
            SourceKind::LowRank(s) => KvSource::stored_bytes(*s),
            SourceKind::PreRope(s) => s.stored_bytes(),
            SourceKind::Pairs(s, _) => KvSource::stored_bytes(*s),
        }
    }

    fn read_tile<'s>(
        &'s self,
        start: usize,
        count: usize,
        scratch: &'s mut WindowScratch,
    ) -> Result<Tile<'s>> {
        match &self.0 {
            SourceKind::Store(s) => s.read_tile(start, count, &mut scratch.store),
            SourceKind::LowRank(s) => s.read_tile(start, count, &mut scratch.low_rank),
            SourceKind::PreRope(s) => s.read_tile(start, count, &mut scratch.low_rank),
            SourceKind::Pairs(s, rope) => {
                // Scored against the codebook where the rows are codes (a
                // window starts at position 0).
                let codes = &mut scratch.pair_codes;
                let rows = (start, count, start);
                let tile = pair_tile(s, rope, rows, &mut codes.decode, &mut codes.trig);
                if let Some(tile) = tile? {
                    return Ok(tile);
                }
                let (rows, decode, head) = &mut scratch.pairs;
                let ch = s.channels();
                rows.resize(count * ch, 0.0);
                let stats = s.decode_rows_into(start, count, rows, decode)?;
                // Sink rows were kept as given (after RoPE).
                let skip = s.form().segments().sink.saturating_sub(start).min(count);
                let coded = &mut rows[skip * ch..];
                rope.from_pair_order(coded, head);
                rope.apply_rows(coded, ch, start + skip)?;
                Ok(Tile {
                    rows: crate::TileRows::F32(rows),
                    stats,
                })
            }
        }
    }

    fn row_addresses(&self, start: usize, count: usize) -> Option<Range<usize>> {
        match &self.0 {
            SourceKind::Store(s) => s.row_addresses(start, count),
            _ => None,
        }
    }

    fn rotation(&self) -> Option<&'static Hadamard> {
        match &self.0 {
            SourceKind::Store(s) => KvSource::rotation(*s),
            _ => None,
        }
    }
}
