//! `shard` forms on the re-encode cache: each layer is built at the
//! prefill (its basis and codebook fitted on the prefill's middle, or its
//! basis read from a calibration) and kept; later calls extend its decode
//! stream (or fold them into the middle) with the tokens generated since,
//! and attention reads it on its compressed forms. Faults land in a fresh
//! copy of the middle's stored bits on every call (the paper's protocol),
//! never in the kept layer: the codes under `values`, the scales and the
//! fitted tables under `metadata`, all of them under `everything`
//! (attention's `ShardLayer::inject`).

use std::sync::Arc;

use attention::stored::clamp_non_finite;
use attention::{Attention, AttentionOutput, Mask, Rope, ShardBytes, ShardLayer};
use gf2_codes::DecodeStats;
use gf2_codes::channel::FaultChannel;
use kv_quant::FaultTarget;

use super::LayerCodes;
use crate::error::{EvalError, Result};

/// One layer's `shard` state: the layer built at the prefill, and the one
/// last grown from it (reused so chunks folded and stream rows written on
/// earlier calls are not encoded again; dropped when a step is rolled back,
/// since its chunks and stream may hold the step's rows).
#[derive(Clone, Debug)]
pub(super) struct ShardSlot {
    prefill: Arc<ShardLayer>,
    pub(super) grown: Option<Arc<ShardLayer>>,
}

/// What one call did.
pub(super) struct ShardRun {
    /// The attention output, with the decode statistics of the injected codes.
    pub(super) out: AttentionOutput,
    /// The layer's bytes.
    pub(super) bytes: ShardBytes,
    /// Bits flipped.
    pub(super) flips: u64,
    /// How the fitted tables' words decoded (the key basis, the codebook).
    pub(super) tables: DecodeStats,
}

/// Attends `layer` (rows `k`, `v` of `tokens` tokens, the first `prefill`
/// of them prefilled) in its `shard` form, building it on first use and
/// extending it after.
#[allow(clippy::too_many_arguments)]
pub(super) fn attend(
    cached: &mut Vec<Option<ShardSlot>>,
    layer: usize,
    codes: &LayerCodes,
    prefill: usize,
    rope: Option<&Rope>,
    (k, v, tokens): (&[f32], &[f32], usize),
    attention: &Attention,
    (queries, positions, mask): (&[f32], &[usize], &Mask<'_>),
    faults: Option<(&(dyn FaultChannel + Send + Sync), u64, FaultTarget)>,
) -> Result<ShardRun> {
    let form = codes.key.form;
    if codes.value.form != form {
        return Err(EvalError::InvalidParameter {
            name: "form",
            reason: format!(
                "shard stores keys and values together: {} / {} must be one shard form",
                codes.key.form, codes.value.form
            ),
        });
    }
    let rope = rope.ok_or_else(|| EvalError::InvalidParameter {
        name: "form",
        reason: format!("{form} undoes RoPE; this model has none"),
    })?;
    // Under faults an earlier layer's output may be non-finite (a bare
    // table or scale hit); the rows are clamped as the paged Shard part
    // clamps what it seals (attention's `clamp_non_finite`), so the run
    // measures the fault's outcome instead of ending.
    let clamped;
    let (k, v) = if faults.is_some() && k.iter().chain(v).any(|x| !x.is_finite()) {
        let (mut k, mut v) = (k.to_vec(), v.to_vec());
        clamp_non_finite(&mut k);
        clamp_non_finite(&mut v);
        clamped = (k, v);
        (&clamped.0[..], &clamped.1[..])
    } else {
        (k, v)
    };
    if cached.len() <= layer {
        cached.resize(layer + 1, None);
    }
    let mut built = match &mut cached[layer] {
        Some(slot) if slot.prefill.prefill() == prefill => {
            let base = match &slot.grown {
                Some(g) if g.tokens() <= tokens => g,
                _ => &slot.prefill,
            };
            let grown = Arc::new(base.extended(k, v, tokens)?);
            slot.grown = Some(Arc::clone(&grown));
            grown
        }
        _ => {
            let basis = codes.key.bases.as_ref().and_then(|b| b.heads.first());
            let s = Arc::new(ShardLayer::build_with(
                form,
                k,
                v,
                tokens,
                prefill,
                rope,
                basis.map(|b| b.as_ref()),
            )?);
            cached[layer] = Some(ShardSlot {
                prefill: Arc::clone(&s),
                grown: None,
            });
            s
        }
    };
    // Faults land in a copy (the kept layer stays clean); a clean call copies nothing.
    let injected = match faults {
        Some((channel, seed, target)) => {
            Some(Arc::make_mut(&mut built).inject(channel, seed, target)?)
        }
        None => None,
    };
    let mut out = built.attend(attention, queries, positions, mask)?;
    if let Some(f) = injected {
        out.stats.keys.values = f.keys;
        out.stats.values.values = f.values;
        out.stats.keys.metadata = f.key_scales;
        out.stats.values.metadata = f.value_scales;
    }
    Ok(ShardRun {
        out,
        bytes: built.bytes(),
        flips: injected.map_or(0, |f| f.flips),
        tables: injected.map_or_else(DecodeStats::default, |f| f.tables),
    })
}
