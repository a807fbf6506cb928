//! The model's KV cache: every layer's K and V rows, stored in a kv-quant
//! [`CacheForm`] and corrupted by a seeded fault channel before attention
//! reads them tile by tile through the `attention` crate.
//!
//! In [`CacheMode::Plain`] attention reads the f32 rows directly (the plain
//! forward pass). In [`CacheMode::Form`] each forward call quantises and
//! encodes the layer's whole cache into a `KvStore` (also for `fp32`, whose
//! store holds the same bits), injects the faults, and attends the store
//! paired with its fault-free original so the statistics also count
//! miscorrected words and silent changes. Re-encoding on every call costs
//! O(T²) over a token-by-token generation; the evaluation prefills whole
//! windows, one call each, where it costs one encode per layer.

use attention::{Attention, DenseKv, Mask, StoreWithTruth};
use gf2_codes::channel::{
    BinarySymmetric, Burst, FaultChannel, MultiBitUpset, StuckAt, StuckValue,
};
use kv_quant::{CacheForm, FaultTarget, KvDecodeStats, KvStore, NonFinite, QuantizeOptions};

use crate::error::{EvalError, Result};

/// Where attention reads K and V from.
#[derive(Clone, Debug, PartialEq)]
pub enum CacheMode {
    /// The f32 rows as computed (no store).
    Plain,
    /// A kv-quant store of this form (keys and values alike).
    Form(CacheForm),
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
}

impl std::ops::AddAssign for CacheStats {
    fn add_assign(&mut self, r: Self) {
        self.injected_flips += r.injected_flips;
        self.keys += r.keys;
        self.values += r.values;
        self.non_finite += r.non_finite;
        self.stored_bytes += r.stored_bytes;
        self.stored_values += r.stored_values;
    }
}

/// The K/V cache of one sequence.
pub struct KvCache {
    mode: CacheMode,
    faults: Option<(FaultSpec, Box<dyn FaultChannel + Send + Sync>)>,
    stream: u64,
    layers: Vec<(Vec<f32>, Vec<f32>)>,
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

    /// Sizes the cache for a model on first use; refuses another model's shape.
    pub(crate) fn check_fits(&mut self, layers: usize, channels: usize) -> Result<()> {
        if self.layers.is_empty() {
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
            CacheMode::Form(form) => {
                let options = QuantizeOptions {
                    non_finite: NonFinite::Clamp,
                };
                let clean_k = KvStore::quantize_with(*form, k, tokens, self.channels, options)?;
                let clean_v = KvStore::quantize_with(*form, v, tokens, self.channels, options)?;
                self.stats.stored_bytes += (clean_k.stored_bytes() + clean_v.stored_bytes()) as u64;
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
