//! The model's KV cache: every layer's K and V rows, stored in kv-quant
//! [`CacheForm`]s (per layer, separately for keys and values) and corrupted
//! by a seeded fault channel before attention reads them tile by tile
//! through the `attention` crate.
//!
//! In [`CacheMode::Plain`] attention reads the f32 rows directly (the plain
//! forward pass). In [`CacheMode::Stored`] each forward call quantises and
//! encodes the layer's whole cache into a `KvStore` per part (also for
//! `fp32`, whose store holds the same bits), injects the faults, and attends
//! the stores paired with their fault-free originals so the statistics also
//! count miscorrected words and silent changes. Re-encoding on every call
//! costs O(T²) over a token-by-token generation; the evaluation prefills
//! whole windows, one call each, where it costs one encode per layer.

use std::sync::Arc;

use attention::{Attention, DenseKv, Mask, StoreWithTruth};
use gf2_codes::channel::{
    BinarySymmetric, Burst, FaultChannel, MultiBitUpset, StuckAt, StuckValue,
};
use kv_quant::{
    CacheForm, FaultTarget, KvDecodeStats, KvStore, LayerForms, NonFinite, QuantizeOptions,
    VqCodebook,
};

use crate::calibration::{Calibration, Part};
use crate::error::{EvalError, Result};

/// Where attention reads K and V from.
#[derive(Clone, Debug, PartialEq)]
pub enum CacheMode {
    /// The f32 rows as computed (no store).
    Plain,
    /// kv-quant stores, in forms chosen per layer for keys and values.
    Stored(StoredForms),
}

/// The forms of a stored cache and the fitted data they need.
#[derive(Clone, Debug, PartialEq)]
pub struct StoredForms {
    /// Key and value forms per layer.
    pub layers: LayerForms,
    /// Codebooks (and other calibrated data) for the forms that need them.
    pub calibration: Option<Arc<Calibration>>,
}

impl CacheMode {
    /// One form for keys and values of every layer.
    pub fn form(form: CacheForm) -> Self {
        Self::key_value(form, form)
    }

    /// A key form and a value form for every layer.
    pub fn key_value(key: CacheForm, value: CacheForm) -> Self {
        Self::Stored(StoredForms {
            layers: LayerForms::uniform(key, value),
            calibration: None,
        })
    }

    /// Per-layer forms with the calibration they need.
    pub fn layered(layers: LayerForms, calibration: Option<Arc<Calibration>>) -> Self {
        Self::Stored(StoredForms {
            layers,
            calibration,
        })
    }

    /// The same forms with this calibration (plain stays plain).
    pub fn with_calibration(self, calibration: Option<Arc<Calibration>>) -> Self {
        match self {
            Self::Plain => Self::Plain,
            Self::Stored(s) => Self::Stored(StoredForms { calibration, ..s }),
        }
    }

    /// The spelling of the mode: `plain`, a form (`int4`), a key/value pair
    /// (`int4-ch/int4`) or a layer policy (`0,29:fp16;*:int4`).
    pub fn label(&self) -> String {
        match self {
            Self::Plain => "plain".into(),
            Self::Stored(s) => match s.layers.rules() {
                [rule] if rule.layers.is_none() && rule.key == rule.value => rule.key.to_string(),
                [rule] if rule.layers.is_none() => format!("{}/{}", rule.key, rule.value),
                _ => s.layers.to_string(),
            },
        }
    }

    /// Every form the mode names, with the part it stores.
    pub fn forms(&self) -> Vec<(CacheForm, Part)> {
        match self {
            Self::Plain => Vec::new(),
            Self::Stored(s) => s
                .layers
                .rules()
                .iter()
                .flat_map(|r| [(r.key, Part::Key), (r.value, Part::Value)])
                .collect(),
        }
    }

    /// Refuses exact sinks and windows that cover a whole context of `ctx`
    /// tokens (nothing would be quantized).
    pub fn check_context(&self, ctx: usize) -> Result<()> {
        for (f, _) in self.forms() {
            let seg = f.segments();
            if seg.sink + seg.window >= ctx {
                return Err(EvalError::InvalidParameter {
                    name: "form",
                    reason: format!(
                        "{f}: a sink of {} and a window of {} tokens cover the whole context of {ctx}",
                        seg.sink, seg.window
                    ),
                });
            }
        }
        Ok(())
    }

    /// Parses `plain`, `FORM`, `KEY_FORM/VALUE_FORM` or a layer policy
    /// (`LAYERS:FORM[/FORM];...`).
    pub fn parse(text: &str) -> Result<Self> {
        let text = text.trim();
        if text == "plain" {
            return Ok(Self::Plain);
        }
        if text.contains(':') {
            return Ok(Self::layered(text.parse()?, None));
        }
        Ok(match text.split_once('/') {
            Some((k, v)) => Self::key_value(k.parse()?, v.parse()?),
            None => Self::form(text.parse()?),
        })
    }
}

/// The forms and codebooks of one layer.
#[derive(Clone, Debug)]
struct LayerCodes {
    key: CacheForm,
    value: CacheForm,
    key_codebook: Option<Arc<VqCodebook>>,
    value_codebook: Option<Arc<VqCodebook>>,
}

/// A named fault channel; its rate comes from the bit error rate.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ChannelKind {
    /// Independent flips of every bit with probability `ber` (the paper's model).
    Bsc,
    /// Bursts of 2 to 8 adjacent bits, starting at rate `ber / 5` per bit
    /// (so the expected flip rate is `ber`).
    Burst,
    /// Multi-bit upsets: 2 or 3 bits of one byte, at rate `ber · 8 / 2.5`
    /// per byte (expected flip rate `ber`).
    Mbu,
    /// Cells stuck at 0 at rate `2·ber` (half of them read wrong).
    Stuck0,
    /// Cells stuck at 1 at rate `2·ber`.
    Stuck1,
}

impl ChannelKind {
    /// Every channel, in the order `--help` lists them.
    pub const ALL: [ChannelKind; 5] = [
        ChannelKind::Bsc,
        ChannelKind::Burst,
        ChannelKind::Mbu,
        ChannelKind::Stuck0,
        ChannelKind::Stuck1,
    ];

    /// The command-line name.
    pub fn name(self) -> &'static str {
        match self {
            Self::Bsc => "bsc",
            Self::Burst => "burst",
            Self::Mbu => "mbu",
            Self::Stuck0 => "stuck0",
            Self::Stuck1 => "stuck1",
        }
    }

    /// The channel at bit error rate `ber` (the expected fraction of bits flipped).
    pub fn build(self, ber: f64) -> Result<Box<dyn FaultChannel + Send + Sync>> {
        Ok(match self {
            Self::Bsc => Box::new(BinarySymmetric::new(ber)?),
            Self::Burst => Box::new(Burst::new(ber / 5.0, 2, 8)?),
            Self::Mbu => Box::new(MultiBitUpset::new((ber * 8.0 / 2.5).min(1.0), 1, 2, 3)?),
            Self::Stuck0 => Box::new(StuckAt::new((2.0 * ber).min(1.0), StuckValue::Zero)?),
            Self::Stuck1 => Box::new(StuckAt::new((2.0 * ber).min(1.0), StuckValue::One)?),
        })
    }
}

impl std::str::FromStr for ChannelKind {
    type Err = EvalError;
    fn from_str(s: &str) -> Result<Self> {
        Self::ALL
            .into_iter()
            .find(|c| c.name() == s)
            .ok_or_else(|| EvalError::InvalidParameter {
                name: "channel",
                reason: format!("{s:?} is not one of bsc, burst, mbu, stuck0, stuck1"),
            })
    }
}

/// The faults of one run.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FaultSpec {
    /// The channel.
    pub channel: ChannelKind,
    /// Bit error rate.
    pub ber: f64,
    /// Seed; each store gets its own stream of it.
    pub seed: u64,
    /// Which buffers of a store are hit.
    pub target: FaultTarget,
}

/// Codec statistics summed over every store read.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Bits flipped by the fault channel.
    pub injected_flips: u64,
    /// Decode statistics of the key stores.
    pub keys: KvDecodeStats,
    /// Decode statistics of the value stores.
    pub values: KvDecodeStats,
    /// Non-finite attention outputs.
    pub non_finite: u64,
    /// Bytes of stored K and V (summed over stores read).
    pub stored_bytes: u64,
    /// K and V values stored (summed over stores read).
    pub stored_values: u64,
    /// Bytes of the codebooks the stores read were encoded against, each
    /// counted with every store that uses it (a codebook amortised over the
    /// tokens of one sequence), included in `stored_bytes`.
    pub codebook_bytes: u64,
    /// `stored_bytes` of the key stores and of the value stores.
    pub part_bytes: [u64; 2],
}

impl std::ops::AddAssign for CacheStats {
    fn add_assign(&mut self, r: Self) {
        self.injected_flips += r.injected_flips;
        self.keys += r.keys;
        self.values += r.values;
        self.non_finite += r.non_finite;
        self.stored_bytes += r.stored_bytes;
        self.stored_values += r.stored_values;
        self.codebook_bytes += r.codebook_bytes;
        self.part_bytes[0] += r.part_bytes[0];
        self.part_bytes[1] += r.part_bytes[1];
    }
}

/// The K/V cache of one sequence.
pub struct KvCache {
    mode: CacheMode,
    faults: Option<(FaultSpec, Box<dyn FaultChannel + Send + Sync>)>,
    stream: u64,
    layers: Vec<(Vec<f32>, Vec<f32>)>,
    codes: Vec<LayerCodes>,
    channels: usize,
    tokens: usize,
    calls: u64,
    stats: CacheStats,
}

impl std::fmt::Debug for KvCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvCache")
            .field("mode", &self.mode)
            .field("faults", &self.faults.as_ref().map(|f| f.0))
            .field("stream", &self.stream)
            .field("tokens", &self.tokens)
            .finish()
    }
}

/// splitmix64's finaliser, to derive independent seeds.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl KvCache {
    /// An empty cache. `stream` separates the fault draws of independent
    /// sequences under one seed (the evaluation passes the window index).
    pub fn new(mode: CacheMode, faults: Option<FaultSpec>, stream: u64) -> Result<Self> {
        let faults = match faults {
            Some(f) if f.ber > 0.0 => {
                if matches!(mode, CacheMode::Plain) {
                    return Err(EvalError::InvalidParameter {
                        name: "faults",
                        reason: "the plain cache has no stored bits to corrupt; use a form".into(),
                    });
                }
                Some((f, f.channel.build(f.ber)?))
            }
            Some(f) if f.ber.is_nan() || f.ber < 0.0 => {
                return Err(EvalError::InvalidParameter {
                    name: "ber",
                    reason: format!("{} is not in [0, 1]", f.ber),
                });
            }
            _ => None,
        };
        Ok(Self {
            mode,
            faults,
            stream,
            layers: Vec::new(),
            codes: Vec::new(),
            channels: 0,
            tokens: 0,
            calls: 0,
            stats: CacheStats::default(),
        })
    }

    /// Tokens held.
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    /// Statistics so far.
    pub fn stats(&self) -> &CacheStats {
        &self.stats
    }

    /// The storage mode.
    pub fn mode(&self) -> &CacheMode {
        &self.mode
    }

    /// The f32 rows (keys, values) of `layer` that a plain cache holds:
    /// what calibration fits its codebooks and bases on.
    pub fn plain_rows(&self, layer: usize) -> Option<(&[f32], &[f32])> {
        match self.mode {
            CacheMode::Plain => self.layers.get(layer).map(|(k, v)| (&k[..], &v[..])),
            CacheMode::Stored(_) => None,
        }
    }

    /// Sizes the cache for a model on first use; refuses another model's
    /// shape, forms that name layers the model lacks, and forms whose
    /// codebooks the calibration does not hold.
    pub(crate) fn check_fits(&mut self, layers: usize, channels: usize) -> Result<()> {
        if self.layers.is_empty() {
            if let CacheMode::Stored(stored) = &self.mode {
                self.codes = resolve(stored, layers, channels)?;
            }
            self.layers = vec![(Vec::new(), Vec::new()); layers];
            self.channels = channels;
        }
        if self.layers.len() != layers || self.channels != channels {
            return Err(EvalError::Shape(format!(
                "cache of {} layers × {} channels used with a model of {layers} × {channels}",
                self.layers.len(),
                self.channels,
            )));
        }
        Ok(())
    }

    /// Marks `t` appended tokens as held (after every layer appended them).
    pub(crate) fn advance(&mut self, t: usize) {
        self.tokens += t;
        self.calls += 1;
    }

    /// Appends layer `layer`'s new K and V rows and runs `attention` for
    /// `queries` at `positions` over the whole layer cache as stored.
    pub(crate) fn attend(
        &mut self,
        layer: usize,
        attention: &Attention,
        queries: &[f32],
        positions: &[usize],
        k_new: &[f32],
        v_new: &[f32],
    ) -> Result<Vec<f32>> {
        let (k, v) = &mut self.layers[layer];
        k.extend_from_slice(k_new);
        v.extend_from_slice(v_new);
        let tokens = k.len() / self.channels;
        let out = match &self.mode {
            CacheMode::Plain => {
                let keys = DenseKv::new(k, tokens, self.channels)?;
                let values = DenseKv::new(v, tokens, self.channels)?;
                attention.prefill(queries, positions, &keys, &values, &Mask::Causal)?
            }
            CacheMode::Stored(_) => {
                let codes = &self.codes[layer];
                let clean_k = quantize(codes.key, &codes.key_codebook, k, tokens, self.channels)?;
                let clean_v =
                    quantize(codes.value, &codes.value_codebook, v, tokens, self.channels)?;
                for (store, part) in [(&clean_k, 0), (&clean_v, 1)] {
                    let codebook = store.codebook().map_or(0, |c| c.stored_bytes()) as u64;
                    self.stats.stored_bytes += store.stored_bytes() as u64 + codebook;
                    self.stats.codebook_bytes += codebook;
                    self.stats.part_bytes[part] += store.stored_bytes() as u64 + codebook;
                }
                self.stats.stored_values += 2 * (tokens * self.channels) as u64;
                match &self.faults {
                    None => {
                        attention.prefill(queries, positions, &clean_k, &clean_v, &Mask::Causal)?
                    }
                    Some((spec, channel)) => {
                        let base = mix(spec.seed ^ mix(self.stream ^ mix(self.calls)));
                        let mut faulty_k = clean_k.clone();
                        let mut faulty_v = clean_v.clone();
                        let seed_k = mix(base ^ mix(2 * layer as u64));
                        let seed_v = mix(base ^ mix(2 * layer as u64 + 1));
                        let hit_k = faulty_k.inject(channel.as_ref(), seed_k, spec.target);
                        let hit_v = faulty_v.inject(channel.as_ref(), seed_v, spec.target);
                        self.stats.injected_flips += (hit_k.total() + hit_v.total()) as u64;
                        let keys = StoreWithTruth::new(&faulty_k, &clean_k)?;
                        let values = StoreWithTruth::new(&faulty_v, &clean_v)?;
                        attention.prefill(queries, positions, &keys, &values, &Mask::Causal)?
                    }
                }
            }
        };
        self.stats.keys += out.stats.keys;
        self.stats.values += out.stats.values;
        self.stats.non_finite += out.non_finite as u64;
        Ok(out.out)
    }
}

/// Quantises one part of a layer (with its codebook when the form has one).
fn quantize(
    form: CacheForm,
    codebook: &Option<Arc<VqCodebook>>,
    rows: &[f32],
    tokens: usize,
    channels: usize,
) -> Result<KvStore> {
    let options = QuantizeOptions {
        non_finite: NonFinite::Clamp,
    };
    Ok(match codebook {
        Some(cb) => {
            KvStore::quantize_with_codebook(form, rows, tokens, channels, options, cb.clone())?
        }
        None => KvStore::quantize_with(form, rows, tokens, channels, options)?,
    })
}

/// The forms and codebooks of every layer, checked against the model.
fn resolve(stored: &StoredForms, layers: usize, channels: usize) -> Result<Vec<LayerCodes>> {
    let forms = stored.layers.resolve(layers)?;
    let codebook = |form: &CacheForm,
                    layer: usize,
                    part: Part|
     -> Result<Option<Arc<VqCodebook>>> {
        if !form.quantizer().needs_codebook() {
            return Ok(None);
        }
        let Some(cal) = &stored.calibration else {
            return Err(EvalError::InvalidParameter {
                name: "calibration",
                reason: format!(
                    "{form} needs codebooks fitted on a calibration text: pass --calibration FILE \
                     (from `kv-eval calibrate`) or --calib-text FILE"
                ),
            });
        };
        let cb = cal
            .codebook(form, layer, part)
            .ok_or_else(|| EvalError::InvalidParameter {
                name: "calibration",
                reason: format!(
                    "the calibration holds no {} codebook of layer {layer} for {form} \
                 (calibrate again with this form)",
                    part.name()
                ),
            })?;
        cb.check_fits(form, channels)?;
        Ok(Some(cb))
    };
    forms
        .into_iter()
        .enumerate()
        .map(|(l, (key, value))| {
            Ok(LayerCodes {
                key,
                value,
                key_codebook: codebook(&key, l, Part::Key)?,
                value_codebook: codebook(&value, l, Part::Value)?,
            })
        })
        .collect()
}
