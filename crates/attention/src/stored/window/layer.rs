//! [`WindowLayer`]: one layer's keys and values as one call of the
//! re-encode protocol reads them, whatever their forms, and the
//! [`WindowState`] a layer keeps between calls.
//!
//! Most forms keep nothing: each call codes the layer's rows again from
//! f32 truth, one [`WindowPart`] per part. A shard form stores keys and
//! values together and fits its middle on the prefill, so its layer is
//! built once at the prefill (its basis and codebook fitted on the
//! prefill's middle, or its basis read from the calibration), kept in the
//! state, and extended on later calls by the tokens generated since (its
//! decode stream, or chunks folded into the middle); the prefill's layer
//! is never cut back. [`open_window_layer`](super::super::open_window_layer)
//! is the one place that tells the two apart, so a caller running the
//! protocol never looks at the form.
//!
//! Faults land in the call's copy only, never in the kept state: the
//! window stores' bits (each part from its own seed, its fitted tables
//! from a salted stream of that seed) or a shard layer's codes, scales
//! and tables (`ShardLayer::inject`, from the key part's seed).

use std::sync::Arc;

use gf2_codes::DecodeStats;
use gf2_codes::channel::FaultChannel;
use kv_lowrank::LowRankStore;
use kv_quant::{CacheForm, FaultTarget, KvStore, Quantizer};

use super::{WindowPart, attend_windows};
use crate::error::{AttentionError, Result};
use crate::shard::{ShardFaults, ShardLayer};
use crate::stored::{Fitted, clamp_non_finite};
use crate::{Attention, AttentionOutput, Mask, Rope};

/// What one layer keeps between calls of the re-encode protocol: nothing
/// for forms coded again on every call; for a shard form, the layer built
/// at the prefill and the one last grown from it (reused so chunks folded
/// and stream rows written on earlier calls are not coded again).
///
/// One state serves one layer of one sequence: each call's rows extend
/// the last call's (after [`rollback`](Self::rollback), the prefill's).
/// A sequence whose prefill step is rolled back starts from a fresh
/// state. A state kept for another shard form or channel count is
/// refused; one kept for another sequence with the same prefill length
/// cannot be told apart, and is the caller's to avoid.
#[derive(Clone, Debug, Default)]
pub struct WindowState {
    shard: Option<ShardSlot>,
}

#[derive(Clone, Debug)]
struct ShardSlot {
    prefill: Arc<ShardLayer>,
    grown: Option<Arc<ShardLayer>>,
}

impl WindowState {
    /// Forgets what calls of a step rolled back added (a shard layer grown
    /// from rows now gone); the prefill's layer stays.
    pub fn rollback(&mut self) {
        if let Some(slot) = &mut self.shard {
            slot.grown = None;
        }
    }
}

/// Whether windows of `form` keep state fitted at the prefill (shard
/// forms), so a cache of them cannot be cut back below what it holds.
pub fn keeps_prefill(form: CacheForm) -> bool {
    form.quantizer().is_shard()
}

/// Whether one layer's keys and values can be kept in windows of `key`
/// and `value` ([`open_window_layer`](super::super::open_window_layer)'s
/// refusals of the forms alone, for a caller checking them before any
/// work): a shard form stores keys and values together (one form for
/// both) and undoes RoPE (the model must have one, `has_rope`); a form
/// coding before RoPE is a key form (values carry no RoPE) of a model with
/// RoPE, keys on pair codebooks (`cq-d2-pre`) keep no window of exact
/// tokens; a form with sparse outliers (`+out`) is a paged form only.
pub fn check_layer_forms(key: CacheForm, value: CacheForm, has_rope: bool) -> Result<()> {
    if key.codes_before_rope() && !has_rope {
        return Err(form_refused(format!(
            "{key} codes keys before RoPE; this model has none"
        )));
    }
    if matches!(key.quantizer(), Quantizer::Vq(s) if s.pre_rope) && key.segments().window > 0 {
        return Err(form_refused(format!(
            "{key} keeps a window of exact tokens, which keys coded before RoPE do not hold \
             (keep sink tokens with +sink<S>)"
        )));
    }
    if let Some(form) = [key, value].into_iter().find(|f| f.sparse().is_some()) {
        return Err(form_refused(format!(
            "{form} splits sparse outliers off each sealed block of a paged cache \
             (attention's SparsePart); the re-encode protocol does not keep them: use \
             --backend paged"
        )));
    }
    if keeps_prefill(key) || keeps_prefill(value) {
        if value != key {
            return Err(form_refused(format!(
                "shard stores keys and values together: {key} / {value} must be one shard form"
            )));
        }
        if !has_rope {
            return Err(form_refused(format!(
                "{key} undoes RoPE; this model has none"
            )));
        }
    }
    if value.codes_before_rope() {
        return Err(form_refused(format!(
            "{value} codes before RoPE, which values do not carry: use it for keys (the \
             value form without -pre)"
        )));
    }
    Ok(())
}

fn form_refused(reason: String) -> AttentionError {
    AttentionError::InvalidParameter {
        name: "form",
        reason,
    }
}

/// The shape of one call's rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WindowShape {
    /// Tokens held (committed and pending).
    pub tokens: usize,
    /// Tokens of the first committed step: a shard form's prefill (other
    /// forms ignore it).
    pub prefill: usize,
    /// Channels per token (KV heads × head dimension); a shard layer
    /// takes its own from the rows and the RoPE's head dimension.
    pub channels: usize,
    /// Channels per KV head (likewise).
    pub head_dim: usize,
}

/// Bytes one call's layer holds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WindowBytes {
    /// Every byte, fitted tables included.
    pub total: u64,
    /// The keys' and the values' share. A shard layer's exact rows and
    /// stream are split evenly between them (rounded down, so the two may
    /// sum to one byte less than `total`); its key basis and value
    /// codebook are counted in the keys' and the values' share.
    pub parts: [u64; 2],
    /// Bytes of the fitted tables windows coded per call read (`vq`
    /// codebooks, calibrated bases), counted with every window that reads
    /// them; included in `total` and `parts`. 0 for a shard layer, whose
    /// tables are in `parts`.
    pub shared: u64,
}

/// What one call's faults did.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct WindowInjection {
    /// Bits flipped.
    pub flips: u64,
    /// How the words of the fitted tables hit decoded.
    pub tables: DecodeStats,
}

/// One layer's keys and values as one call reads them (see the module
/// docs); made by [`open_window_layer`](super::super::open_window_layer).
#[derive(Clone, Debug)]
pub struct WindowLayer(Coded);

#[derive(Clone, Debug)]
enum Coded {
    /// Both variants boxed: a window pair and a shard layer's fault
    /// outcomes are hundreds of bytes each.
    Parts(Box<[WindowPart; 2]>),
    Shard {
        layer: Arc<ShardLayer>,
        injected: Option<Box<ShardFaults>>,
    },
}

/// See [`open_window_layer`](super::super::open_window_layer).
pub(in crate::stored) fn open(
    forms: [(CacheForm, &Fitted); 2],
    state: &mut WindowState,
    (keys, values): (&[f32], &[f32]),
    shape: WindowShape,
    rope: Option<&Rope>,
) -> Result<WindowLayer> {
    let [(key, key_fitted), (value, value_fitted)] = forms;
    let WindowShape {
        tokens,
        prefill,
        channels,
        head_dim,
    } = shape;
    check_layer_forms(key, value, rope.is_some())?;
    if !(keeps_prefill(key) || keeps_prefill(value)) {
        return Ok(WindowLayer(Coded::Parts(Box::new([
            super::open(key, key_fitted, keys, (tokens, channels, head_dim), rope)?,
            super::open(
                value,
                value_fitted,
                values,
                (tokens, channels, head_dim),
                None,
            )?,
        ]))));
    }
    let Some(rope) = rope else {
        return Err(form_refused(format!(
            "{key} undoes RoPE; this model has none"
        )));
    };

    // An earlier layer that read a faulted table or scale may give
    // non-finite rows; they are clamped as the paged Shard part clamps what
    // it seals, so a run measures the fault's outcome instead of ending.
    let clamped;
    let (keys, values) = if keys.iter().chain(values).any(|x| !x.is_finite()) {
        let (mut k, mut v) = (keys.to_vec(), values.to_vec());
        clamp_non_finite(&mut k);
        clamp_non_finite(&mut v);
        clamped = (k, v);
        (&clamped.0[..], &clamped.1[..])
    } else {
        (keys, values)
    };
    if let Some(slot) = &state.shard
        && (slot.prefill.form() != &key || slot.prefill.channels() != keys.len() / tokens.max(1))
    {
        return Err(AttentionError::InvalidParameter {
            name: "window state",
            reason: format!(
                "it keeps a {} layer of {} channels, asked for {key} of {} channels: one state \
                 serves one layer of one sequence",
                slot.prefill.form(),
                slot.prefill.channels(),
                keys.len() / tokens.max(1)
            ),
        });
    }
    let layer = match &mut state.shard {
        Some(slot) if slot.prefill.prefill() == prefill => {
            let base = match &slot.grown {
                Some(g) if g.tokens() <= tokens => g,
                _ => &slot.prefill,
            };
            let grown = Arc::new(base.extended(keys, values, tokens)?);
            slot.grown = Some(Arc::clone(&grown));
            grown
        }
        _ => {
            let basis = key_fitted.bases.as_ref().and_then(|b| b.heads.first());
            let built = Arc::new(ShardLayer::build_with(
                key,
                keys,
                values,
                tokens,
                prefill,
                rope,
                basis.map(|b| b.as_ref()),
            )?);
            state.shard = Some(ShardSlot {
                prefill: Arc::clone(&built),
                grown: None,
            });
            built
        }
    };
    Ok(WindowLayer(Coded::Shard {
        layer,
        injected: None,
    }))
}

impl WindowLayer {
    /// The bytes held this call.
    pub fn bytes(&self) -> WindowBytes {
        match &self.0 {
            Coded::Parts(parts) => {
                let mut bytes = WindowBytes::default();
                for (i, p) in parts.iter().enumerate() {
                    let (own, shared) = (p.stored_bytes() as u64, p.shared_bytes() as u64);
                    bytes.total += own + shared;
                    bytes.parts[i] = own + shared;
                    bytes.shared += shared;
                }
                bytes
            }
            Coded::Shard { layer, .. } => {
                let b = layer.bytes();
                let half = (b.exact + b.stream) / 2;
                WindowBytes {
                    total: b.total() as u64,
                    parts: [(b.keys + half) as u64, (b.values + half) as u64],
                    shared: 0,
                }
            }
        }
    }

    /// Injects faults from `channel` into every stored bit `target`
    /// reaches: part `p`'s rows from `seeds[p]` and its fitted tables from
    /// a salted stream of it, or a shard layer's codes, scales and tables
    /// from `seeds[0]`. Once per call: a shard layer refuses a second
    /// injection (its statistics describe one).
    pub fn inject(
        &mut self,
        channel: &dyn FaultChannel,
        seeds: [u64; 2],
        target: FaultTarget,
    ) -> Result<WindowInjection> {
        match &mut self.0 {
            Coded::Parts(parts) => {
                let mut out = WindowInjection::default();
                for (part, seed) in parts.iter_mut().zip(seeds) {
                    out.flips += part.inject(channel, seed, target);
                    let (flips, tables) = part.inject_shared(channel, table_seed(seed), target)?;
                    out.flips += flips;
                    out.tables += tables;
                }
                Ok(out)
            }
            Coded::Shard { layer, injected } => {
                if injected.is_some() {
                    return Err(AttentionError::InvalidParameter {
                        name: "faults",
                        reason: "a shard layer takes one injection per call".into(),
                    });
                }
                let f = Arc::make_mut(layer).inject(channel, seeds[0], target)?;
                *injected = Some(Box::new(f));
                Ok(WindowInjection {
                    flips: f.flips,
                    tables: f.tables,
                })
            }
        }
    }

    /// Injects faults into the fitted tables alone, as
    /// [`inject`](Self::inject) would (for a caller drawing the rows'
    /// faults row by row itself through [`rows_mut`](Self::rows_mut)).
    /// Refused for a shard layer, whose tables are faulted with its codes
    /// by [`inject`](Self::inject).
    pub fn inject_tables(
        &mut self,
        channel: &dyn FaultChannel,
        seeds: [u64; 2],
        target: FaultTarget,
    ) -> Result<WindowInjection> {
        let Coded::Parts(parts) = &mut self.0 else {
            return Err(AttentionError::InvalidParameter {
                name: "faults",
                reason: "a shard layer's tables are faulted with its codes, by inject".into(),
            });
        };
        let mut out = WindowInjection::default();
        for (part, seed) in parts.iter_mut().zip(seeds) {
            let (flips, tables) = part.inject_shared(channel, table_seed(seed), target)?;
            out.flips += flips;
            out.tables += tables;
        }
        Ok(out)
    }

    /// The kv-quant stores of keys and values, for faults drawn row by row
    /// (a non-uniform fault map); refused where a part is not kept in one
    /// (low-rank and shard forms take faults on the whole layer only).
    pub fn rows_mut(&mut self) -> Result<[&mut KvStore; 2]> {
        let Coded::Parts(parts) = &mut self.0 else {
            return Err(rows_refused());
        };
        let [k, v] = &mut **parts;
        match (k.rows_mut(), v.rows_mut()) {
            (Some(k), Some(v)) => Ok([k, v]),
            _ => Err(rows_refused()),
        }
    }

    /// The low-rank stores of keys and values, where a part is one (for
    /// the error certificates).
    pub fn low_rank(&self) -> [Option<&LowRankStore>; 2] {
        match &self.0 {
            Coded::Parts(parts) => [parts[0].low_rank(), parts[1].low_rank()],
            Coded::Shard { .. } => [None, None],
        }
    }

    /// Attends `queries` at `positions` over the layer under `mask`; the
    /// output's statistics count the words this call's faults hit.
    pub fn attend(
        &self,
        attention: &Attention,
        queries: &[f32],
        positions: &[usize],
        mask: &Mask<'_>,
    ) -> Result<AttentionOutput> {
        match &self.0 {
            Coded::Parts(parts) => {
                let [k, v] = &**parts;
                attend_windows(attention, queries, positions, (k, v), mask)
            }
            Coded::Shard { layer, injected } => {
                let mut out = layer.attend(attention, queries, positions, mask)?;
                if let Some(f) = injected {
                    out.stats.keys.values = f.keys;
                    out.stats.values.values = f.values;
                    out.stats.keys.metadata = f.key_scales;
                    out.stats.values.metadata = f.value_scales;
                }
                Ok(out)
            }
        }
    }
}

fn rows_refused() -> AttentionError {
    AttentionError::InvalidParameter {
        name: "fault map",
        reason: "low-rank and shard forms take faults on the whole layer only, not row by row"
            .into(),
    }
}

/// Salt of the streams that fault fitted tables (apart from the rows').
const TABLE_SALT: u64 = 0x7461_626c_6573;

/// The seed of a part's fitted tables' faults: splitmix64's finaliser of
/// the part's seed, salted.
fn table_seed(seed: u64) -> u64 {
    let mut z = (seed ^ TABLE_SALT).wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}
