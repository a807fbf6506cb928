//! The re-encoding KV backend ([`KvCache`], the paper's protocol): every
//! layer's K and V rows, stored in kv-quant [`CacheForm`]s (per layer,
//! separately for keys and values) and corrupted by a seeded fault channel
//! before attention reads them tile by tile through the `attention` crate.
//! The forward passes reach it through [`KvBackend`]: rows are appended per
//! layer, and a step is committed or rolled back as a whole.
//!
//! In [`CacheMode::Plain`] attention reads the f32 rows directly (the plain
//! forward pass). In [`CacheMode::Stored`] each forward call codes the
//! layer's whole cache again through attention's registry
//! ([`open_window_layer`]: a kv-quant or kv-lowrank store per part, also
//! for `fp32`, whose store holds the same bits; a `shard` form's layer
//! built once at the prefill and extended after), injects the faults, and
//! attends the faulted stores; their fault ledgers make the statistics
//! also count miscorrected words and silent changes. Nothing here looks at
//! a form to build, fault, count or read a window. Re-encoding on every call
//! costs O(T²) over a token-by-token generation; the evaluation prefills
//! whole windows, one call each, where it costs one encode per layer. With
//! per-block forms ([`BlockForms`], `blocks.rs`, the adaptive-protection
//! experiment) each part is stored as one store per run of blocks of one
//! code, the protection chosen per block.

mod backend;
mod blocks;
mod channel;
mod mode;

pub use blocks::BlockForms;
pub use channel::ChannelKind;
pub use mode::{CacheMode, StoredForms};

pub use crate::adaptive::{HotMap, HotRegion, LayerCodewords};

use attention::stored::{
    Fitted, WindowBytes, WindowInjection, WindowLayer, WindowShape, WindowState, check_layer_forms,
    keeps_prefill, open_window_layer,
};
use attention::{
    Attention, AttentionOutput, DenseBackend, KvBackend, Mask, ModelKvShape, Rope, certificates,
};
use gf2_codes::channel::FaultChannel;
use kv_lowrank::LowRankStore;
use kv_quant::{CacheForm, FaultTarget, KvDecodeStats, Quantizer};

use blocks::{BlockedPart, PartFaults};

use crate::calibration::{Part, basis_shape};
use crate::error::{EvalError, Result};

/// The form of one part of a layer and the fitted tables it reads.
#[derive(Clone, Debug)]
struct PartCode {
    form: CacheForm,
    fitted: Fitted,
}

/// The forms of one layer.
#[derive(Clone, Debug)]
struct LayerCodes {
    key: PartCode,
    value: PartCode,
}

/// One layer as one call reads it: coded by attention's registry
/// ([`open_window_layer`]), or in the per-block forms of an
/// adaptive-protection run ([`BlockForms`]).
enum ReadLayer {
    Window(WindowLayer),
    Blocked([BlockedPart; 2]),
}

impl ReadLayer {
    /// Bytes held.
    fn bytes(&self) -> WindowBytes {
        match self {
            Self::Window(w) => w.bytes(),
            Self::Blocked(parts) => {
                let [k, v] = [parts[0].bytes(), parts[1].bytes()];
                WindowBytes {
                    total: k + v,
                    parts: [k, v],
                    shared: 0,
                }
            }
        }
    }

    /// Injects this call's faults: row range by row range for parts
    /// stored block by block or under a row-resolved map (`part_faults`),
    /// else the whole layer from one stream per part (`seeds`, the
    /// per-layer map's channel).
    fn inject<'f>(
        &mut self,
        faults: &'f Faults,
        layer: usize,
        seeds: [u64; 2],
        part_faults: impl Fn(usize) -> PartFaults<'f>,
    ) -> Result<WindowInjection> {
        let spec = &faults.spec;
        let channel = faults.layer_channel(layer);
        let whole = spec.hot.is_none_or(|m| !m.is_row_resolved());
        match self {
            Self::Blocked(parts) => {
                let mut flips = 0;
                for (p, part) in parts.iter_mut().enumerate() {
                    flips += part.inject(&part_faults(p))?;
                }
                Ok(WindowInjection {
                    flips,
                    ..Default::default()
                })
            }
            Self::Window(w) if whole => Ok(w.inject(channel, seeds, spec.target)?),
            Self::Window(w) => {
                let mut flips = 0;
                for (p, store) in w.rows_mut()?.into_iter().enumerate() {
                    flips += part_faults(p).inject(store, 0)?;
                }
                let mut out = w.inject_tables(channel, seeds, spec.target)?;
                out.flips += flips;
                Ok(out)
            }
        }
    }

    /// The low-rank stores of keys and values, where a part is one.
    fn low_rank(&self) -> [Option<&LowRankStore>; 2] {
        match self {
            Self::Window(w) => w.low_rank(),
            Self::Blocked(_) => [None, None],
        }
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
    /// Where the memory is worse: the map's region sees `hot.ber` instead
    /// of `ber` (a non-uniform fault map; the re-encode backend only).
    pub hot: Option<HotMap>,
}

impl FaultSpec {
    /// Whether any bit is flipped: a positive rate, or a hot region with
    /// one (perfect memory with a few bad rows is faulted).
    pub fn is_faulted(&self) -> bool {
        self.ber > 0.0 || self.hot.is_some_and(|h| h.ber > 0.0)
    }

    /// Whether row `row` of `layer`'s keys (`part` 0) or values (1) lies in
    /// the hot region of this run's map (the same map for every run of
    /// one seed).
    pub fn is_hot(&self, layer: usize, part: usize, row: usize) -> bool {
        self.hot
            .is_some_and(|h| h.hot_row(mix(self.seed ^ MAP_SALT), layer, part, row))
    }
}

/// Codec statistics summed over every store read.
#[derive(Clone, Debug, Default, PartialEq)]
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
    /// tokens of one sequence), included in `stored_bytes`; on the paged
    /// backend, the fitted tables (codebooks and calibrated bases) counted
    /// once beside the blocks.
    pub codebook_bytes: u64,
    /// `stored_bytes` of the key stores and of the value stores.
    pub part_bytes: [u64; 2],
    /// Words of the fitted tables (codebooks, calibrated bases) as read
    /// through their code after each call whose faults hit them:
    /// corrected, detected, miscorrected, silent (zero without faults in
    /// metadata).
    pub tables: gf2_codes::DecodeStats,
    /// Runtime error certificates of the low-rank layers, per layer.
    pub certificates: Vec<CertificateSums>,
    /// Value codewords read, corrected and detected, per layer: what a
    /// scrubber sees of each layer's memory.
    pub layers: Vec<LayerCodewords>,
    /// The same per block of rows (`blocks[2·layer + part][block]`), for
    /// forms stored block by block with `observe` set ([`BlockForms`]).
    pub blocks: Vec<Vec<LayerCodewords>>,
}

/// Sums and maxima of the error certificates of one layer (every query
/// head of every query of every call).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CertificateSums {
    /// Certificates summed.
    pub count: u64,
    /// Sum of the logit bounds.
    pub logit_sum: f64,
    /// Largest logit bound.
    pub logit_max: f64,
    /// Sum of the output bounds.
    pub output_sum: f64,
    /// Largest output bound.
    pub output_max: f64,
}

impl std::ops::AddAssign for CertificateSums {
    fn add_assign(&mut self, r: Self) {
        self.count += r.count;
        self.logit_sum += r.logit_sum;
        self.logit_max = self.logit_max.max(r.logit_max);
        self.output_sum += r.output_sum;
        self.output_max = self.output_max.max(r.output_max);
    }
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
        self.tables += r.tables;
        self.part_bytes[0] += r.part_bytes[0];
        self.part_bytes[1] += r.part_bytes[1];
        if self.layers.len() < r.layers.len() {
            self.layers
                .resize(r.layers.len(), LayerCodewords::default());
        }
        for (a, b) in self.layers.iter_mut().zip(&r.layers) {
            *a += *b;
        }
        if self.blocks.len() < r.blocks.len() {
            self.blocks.resize(r.blocks.len(), Vec::new());
        }
        for (a, b) in self.blocks.iter_mut().zip(&r.blocks) {
            if a.len() < b.len() {
                a.resize(b.len(), LayerCodewords::default());
            }
            for (a, b) in a.iter_mut().zip(b) {
                *a += *b;
            }
        }
        if self.certificates.len() < r.certificates.len() {
            self.certificates
                .resize(r.certificates.len(), CertificateSums::default());
        }
        for (a, b) in self.certificates.iter_mut().zip(r.certificates) {
            *a += b;
        }
    }
}

/// The K/V cache of one sequence.
pub struct KvCache {
    mode: CacheMode,
    faults: Option<Faults>,
    stream: u64,
    /// The f32 rows, committed and pending: the truth every call encodes.
    rows: DenseBackend,
    codes: Vec<LayerCodes>,
    rope: Option<Rope>,
    calls: u64,
    stats: CacheStats,
    /// The statistics when the open step began.
    checkpoint: Option<CacheStats>,
    /// Tokens of the first committed step: a `shard` form's prefill.
    prefill: Option<usize>,
    /// Per layer, what attention's registry keeps between calls (a
    /// `shard` form's layer built at the prefill and the last one grown
    /// from it).
    windows: Vec<WindowState>,
}

impl std::fmt::Debug for KvCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvCache")
            .field("mode", &self.mode)
            .field("faults", &self.faults.as_ref().map(|f| f.spec))
            .field("stream", &self.stream)
            .field("tokens", &self.rows.tokens())
            .finish()
    }
}

/// A run's fault channels: every layer's, and the hot layers' if any.
struct Faults {
    spec: FaultSpec,
    channel: Box<dyn FaultChannel + Send + Sync>,
    hot: Option<Box<dyn FaultChannel + Send + Sync>>,
}

impl Faults {
    /// The hot region's channel where `hot`, else the run's.
    fn channel(&self, hot: bool) -> &(dyn FaultChannel + Send + Sync) {
        match (&self.hot, hot) {
            (Some(h), true) => h.as_ref(),
            _ => self.channel.as_ref(),
        }
    }

    /// The channel of the whole of `layer` (the hot one where a per-layer
    /// map names it).
    fn layer_channel(&self, layer: usize) -> &(dyn FaultChannel + Send + Sync) {
        self.channel(self.spec.hot.is_some_and(|h| h.hot_layer(layer)))
    }
}

/// Salt of the seed a row-resolved [`HotMap`] is drawn from.
const MAP_SALT: u64 = 0x4d41_5053;

/// splitmix64's finaliser, to derive independent seeds.
pub(crate) fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl KvCache {
    /// An empty cache. `stream` separates the fault draws of independent
    /// sequences under one seed (the evaluation passes the window index).
    pub fn new(mode: CacheMode, faults: Option<FaultSpec>, stream: u64) -> Result<Self> {
        if let Some(hot) = faults.and_then(|f| f.hot) {
            hot.check()?;
        }
        let faults = match faults {
            Some(f) if f.is_faulted() && f.ber >= 0.0 => {
                if matches!(mode, CacheMode::Plain) {
                    return Err(EvalError::InvalidParameter {
                        name: "faults",
                        reason: "the plain cache has no stored bits to corrupt; use a form".into(),
                    });
                }
                let hot = match f.hot {
                    Some(h) => {
                        let whole_layer_only = |f: &CacheForm| {
                            !f.is_row_local() || matches!(f.quantizer(), Quantizer::LowRank(_))
                        };
                        if let Some((f, _)) = mode
                            .forms()
                            .into_iter()
                            .find(|(f, _)| h.is_row_resolved() && whole_layer_only(f))
                        {
                            return Err(EvalError::InvalidParameter {
                                name: "hot map",
                                reason: format!(
                                    "{f} takes a per-layer fault map only: a block or row map \
                                     needs row-local kv-quant forms (not shard or low-rank forms, \
                                     nor forms whose rows share parameters)"
                                ),
                            });
                        }
                        Some(f.channel.build(h.ber)?)
                    }
                    None => None,
                };
                Some(Faults {
                    spec: f,
                    channel: f.channel.build(f.ber)?,
                    hot,
                })
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
            rows: DenseBackend::new(),
            codes: Vec::new(),
            rope: None,
            calls: 0,
            stats: CacheStats::default(),
            checkpoint: None,
            prefill: None,
            windows: Vec::new(),
        })
    }

    /// Statistics so far.
    pub fn stats(&self) -> &CacheStats {
        &self.stats
    }

    /// Bytes of the f32 rows held between calls (every call encodes them
    /// anew into the stores it attends).
    pub fn held_bytes(&self) -> u64 {
        self.rows.held_bytes()
    }

    /// The storage mode.
    pub fn mode(&self) -> &CacheMode {
        &self.mode
    }

    /// The f32 rows (keys, values) of `layer` that a plain cache holds:
    /// what calibration fits its codebooks and bases on.
    pub fn plain_rows(&self, layer: usize) -> Option<(&[f32], &[f32])> {
        match self.mode {
            CacheMode::Plain => self.rows.rows(layer),
            CacheMode::Stored(_) => None,
        }
    }
}

/// The largest norm of one head's slice of a row.
fn max_head_norm(rows: &[f32], head_dim: usize) -> f32 {
    rows.chunks_exact(head_dim)
        .map(|h| h.iter().map(|x| x * x).sum::<f32>().sqrt())
        .fold(0.0, f32::max)
}

/// The forms, codebooks and bases of every layer, checked against the model.
fn resolve(stored: &StoredForms, layers: usize, channels: usize) -> Result<Vec<LayerCodes>> {
    let forms = stored.layers.resolve(layers)?;
    let need = |what: &str, form: &CacheForm| EvalError::InvalidParameter {
        name: "calibration",
        reason: format!(
            "{form} needs {what} fitted on a calibration text: pass --calibration FILE \
             (from `kv-eval calibrate`) or --calib-text FILE"
        ),
    };
    let part =
        |form: CacheForm, layer: usize, part: Part| -> Result<PartCode> {
            let mut code = PartCode {
                form,
                fitted: Fitted::default(),
            };
            if form.quantizer().needs_codebook() {
                let cal = stored
                    .calibration
                    .as_ref()
                    .ok_or_else(|| need("codebooks", &form))?;
                let cb = cal.codebook(&form, layer, part).ok_or_else(|| {
                    EvalError::InvalidParameter {
                        name: "calibration",
                        reason: format!(
                            "the calibration holds no {} codebook of layer {layer} for {form} \
                     (calibrate again with this form)",
                            part.name()
                        ),
                    }
                })?;
                cb.check_fits(&form, channels)?;
                code.fitted.codebook = Some(cb);
            }
            if form.quantizer().needs_bases() && basis_shape(&form, part).is_some() {
                let cal = stored
                    .calibration
                    .as_ref()
                    .ok_or_else(|| need("bases", &form))?;
                code.fitted.bases = Some(cal.bases(&form, layer, part).ok_or_else(|| {
                    EvalError::InvalidParameter {
                        name: "calibration",
                        reason: format!(
                            "the calibration holds no {} bases of layer {layer} for {form} \
                     (calibrate again with this form)",
                            part.name()
                        ),
                    }
                })?);
            }
            Ok(code)
        };
    forms
        .into_iter()
        .enumerate()
        .map(|(l, (key, value))| {
            Ok(LayerCodes {
                key: part(key, l, Part::Key)?,
                value: part(value, l, Part::Value)?,
            })
        })
        .collect()
}
