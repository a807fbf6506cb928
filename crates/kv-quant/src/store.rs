//! [`KvStore`]: one K or V matrix (`tokens × channels`, row-major f32) held in
//! a [`CacheForm`], with seeded fault injection and decoding back to f32,
//! tile by tile or whole, with erasure recovery and exact statistics.
//!
//! # Canonical byte layout
//! A store holds up to four buffers, and [`KvStore::stored_bytes`] is the sum
//! of their lengths:
//! - **values** (`data`): token rows of [`row_bytes`](KvStore::row_bytes) bytes each.
//!   - `fp32`/`fp16`/`bf16`: little-endian elements.
//!   - `fp8-*`: one FP8 code per value ([`Fp8Format`]).
//!   - `int*`, `nf4`: packed levels, see [`crate::int`]'s layout (value `j` at
//!     bits `[b·j, b·j+b)` of the row's little-endian bit stream).
//!   - `+hamming74`, `+secded84`, `+golay24`: each row encoded on its own by
//!     the gf2-codes batch codec ([`gf2_codes::batch`]): SECDED one byte per
//!     value, Hamming(7,4) eight codewords per 7 bytes with the row's last
//!     byte padded, Golay three values of the row per 3 bytes with the row's
//!     last triple zero-padded. No codeword spans two tokens.
//! - **scales**: one little-endian f16 or f32 per group ([`GroupLayout`]);
//!   the integer scale, the NF4 absmax, or the FP8 scale (always f32).
//! - **offsets**: asymmetric integer forms only, one per group, same type.
//! - **checks**: forms with [`MetaProtection::Secded`] only: one check byte
//!   ([`MetaCode`]) per scale, then one per offset.
//!
//! # What is protected by default
//! Forms with a code protect the values with that code and the scales and
//! offsets with SECDED check bytes (`+meta-none` turns the latter off).
//! Forms without a code protect nothing. Faults can be injected into the
//! values and the metadata separately ([`FaultTarget`]).

mod rows;
mod view;

pub use rows::ScrubStats;
pub use view::{LevelMap, LevelRows, RowsView};

use gf2_codes::batch::{Backend, erasure_words};
use gf2_codes::channel::{FaultChannel, FaultRng, Flips};
use gf2_codes::{DecodeStats, Int4Code};
use half::{bf16, f16};

use crate::error::{KvQuantError, Result, check_len};
use crate::fp8::Fp8Format;
use crate::int::{self, Toward};
use crate::layout::GroupLayout;
use crate::meta::MetaCode;
use crate::nf4::{NF4_LEVELS, nearest_level};
use crate::spec::{
    CacheForm, ErasurePolicy, Granularity, MetaProtection, Protection, Quantizer, ScaleType,
};

/// What to do with NaN and infinite input values.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum NonFinite {
    /// Refuse the input with [`KvQuantError::NonFinite`] (the default).
    #[default]
    Reject,
    /// Saturate: NaN is stored as the representable value nearest 0, +∞ and
    /// −∞ as the largest and smallest representable value of the value's
    /// group (for fp16/bf16/fp32 the format's largest finite magnitude).
    /// Finite inputs beyond an fp16 store's range saturate likewise. Group
    /// ranges and scales are computed from the finite values only.
    Clamp,
}

/// Options of [`KvStore::quantize_with`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct QuantizeOptions {
    /// NaN and infinity handling.
    pub non_finite: NonFinite,
}

/// Which buffers a fault injection hits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FaultTarget {
    /// The value codes (or codewords) only.
    Values,
    /// Scales, offsets and their check bytes only.
    Metadata,
    /// Both.
    Everything,
}

/// The exact flips of one injection, per buffer (bit positions `8·byte + bit`).
///
/// Each buffer gets its own random stream of the seed (values 0, scales 1,
/// offsets 2, checks 3), so the value flips of a seed are the same whether or
/// not the metadata is hit too.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Injection {
    /// Flips in the value buffer.
    pub values: Flips,
    /// Flips in the scales.
    pub scales: Flips,
    /// Flips in the offsets.
    pub offsets: Flips,
    /// Flips in the metadata check bytes.
    pub checks: Flips,
}

impl Injection {
    /// Total flipped bits.
    pub fn total(&self) -> usize {
        self.values.len() + self.scales.len() + self.offsets.len() + self.checks.len()
    }

    /// Flipped bits in the metadata buffers.
    pub fn metadata(&self) -> usize {
        self.scales.len() + self.offsets.len() + self.checks.len()
    }
}

/// Statistics of one decode (one tile or a whole matrix). Tile statistics add
/// up (`+=`) to those of one whole decode.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct KvDecodeStats {
    /// Per value codeword for coded forms, per stored value otherwise.
    /// Unprotected values always decode "clean"; with the truth known, the
    /// changed ones count as `silent`.
    pub values: DecodeStats,
    /// Per metadata word (each scale and each offset), counted in the tile
    /// holding the group's first token.
    pub metadata: DecodeStats,
    /// Values flagged as erased: their codeword or their group's metadata was
    /// detected as corrupted. The erasure policy decided what they became.
    pub erased_values: u64,
}

impl std::ops::AddAssign for KvDecodeStats {
    fn add_assign(&mut self, rhs: Self) {
        self.values += rhs.values;
        self.metadata += rhs.metadata;
        self.erased_values += rhs.erased_values;
    }
}

/// An owned decode: values, erasures and statistics.
#[derive(Clone, Debug, PartialEq)]
pub struct DecodedMatrix {
    /// `tokens × channels` values, row-major.
    pub values: Vec<f32>,
    /// Erasure bitmap: `⌈channels/64⌉` words per token, bit `c % 64` of word
    /// `c / 64` of row `t` set when value `(t, c)` was erased.
    pub erased: Vec<u64>,
    /// Decode statistics.
    pub stats: KvDecodeStats,
    /// Bits flipped into the store by [`KvStore::inject`] since it was quantized.
    pub injected_flips: u64,
    channels: usize,
}

impl DecodedMatrix {
    /// Whether value `(token, channel)` was erased.
    ///
    /// # Panics
    /// If the position is outside the matrix.
    pub fn is_erased(&self, token: usize, channel: usize) -> bool {
        assert!(channel < self.channels, "channel {channel} out of range");
        let words = erasure_words(self.channels);
        self.erased[token * words + channel / 64] >> (channel % 64) & 1 == 1
    }
}

/// Reusable buffers for [`KvStore::decode_rows_into`]: they grow on first use
/// and are reused after, so steady-state tile decoding does not allocate.
#[derive(Clone, Debug, Default)]
pub struct DecodeScratch {
    levels: Vec<u8>,
    flat_levels: Vec<u8>,
    flat_erasures: Vec<u64>,
    truth_levels: Vec<u8>,
    truth_erasures: Vec<u64>,
    erasures: Vec<u64>,
    scale: Vec<f32>,
    offset: Vec<f32>,
    meta_erased: Vec<bool>,
    /// Decoded values of [`KvStore::decode_rows_view`] when it cannot return levels.
    values: Vec<f32>,
}

impl DecodeScratch {
    /// Empty scratch.
    pub fn new() -> Self {
        Self::default()
    }
}

fn grow<T: Clone + Default>(v: &mut Vec<T>, n: usize) -> &mut [T] {
    if v.len() < n {
        v.resize(n, T::default());
    }
    &mut v[..n]
}

/// How stored codes become values.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    F32,
    F16,
    Bf16,
    Fp8(Fp8Format),
    Asym(u8),
    Sym(u8),
    Nf4,
}

impl Kind {
    fn of(q: &Quantizer) -> Kind {
        match *q {
            Quantizer::Fp32 => Kind::F32,
            Quantizer::Fp16 => Kind::F16,
            Quantizer::Bf16 => Kind::Bf16,
            Quantizer::Fp8(s) => Kind::Fp8(s.format),
            Quantizer::Int(s) if s.symmetric => Kind::Sym(s.bits),
            Quantizer::Int(s) => Kind::Asym(s.bits),
            Quantizer::Nf4(_) => Kind::Nf4,
        }
    }

    /// Bits of one level for the level forms.
    fn level_bits(self) -> Option<u8> {
        match self {
            Kind::Asym(b) | Kind::Sym(b) => Some(b),
            Kind::Nf4 => Some(4),
            _ => None,
        }
    }

    /// Bytes per value of the raw (one code per element) forms.
    fn raw_bytes(self) -> Option<usize> {
        match self {
            Kind::F32 => Some(4),
            Kind::F16 | Kind::Bf16 => Some(2),
            Kind::Fp8(_) => Some(1),
            _ => None,
        }
    }

    /// Value of one level in a group with parameters `(a, b)`.
    #[inline]
    fn dequant(self, level: u8, a: f32, b: f32) -> f32 {
        match self {
            Kind::Asym(_) => b + f32::from(level) * a,
            Kind::Sym(bits) => (f32::from(level) - f32::from(1u8 << (bits - 1))) * a,
            Kind::Fp8(format) => format.table()[usize::from(level)] * a,
            _ => NF4_LEVELS[usize::from(level & 15)] * a,
        }
    }
}

/// A quantized (and possibly ECC-protected) `tokens × channels` matrix.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvStore {
    form: CacheForm,
    tokens: usize,
    channels: usize,
    row_bytes: usize,
    layout: Option<GroupLayout>,
    data: Vec<u8>,
    scales: Vec<u8>,
    offsets: Vec<u8>,
    checks: Vec<u8>,
    injected: u64,
}

fn sanitize(x: f32) -> f32 {
    if x.is_nan() {
        0.0
    } else if x.is_infinite() {
        f32::MAX.copysign(x)
    } else {
        x
    }
}

impl KvStore {
    /// Quantizes `data` (`tokens × channels`, row-major) into `form`,
    /// rejecting NaN and infinities.
    pub fn quantize(form: CacheForm, data: &[f32], tokens: usize, channels: usize) -> Result<Self> {
        Self::quantize_with(form, data, tokens, channels, QuantizeOptions::default())
    }

    /// Quantizes with explicit options.
    pub fn quantize_with(
        form: CacheForm,
        data: &[f32],
        tokens: usize,
        channels: usize,
        options: QuantizeOptions,
    ) -> Result<Self> {
        if channels == 0 {
            return Err(KvQuantError::InvalidParameter {
                name: "channels",
                reason: "a KV matrix needs at least one channel".into(),
            });
        }
        let len = tokens
            .checked_mul(channels)
            .ok_or_else(|| KvQuantError::InvalidParameter {
                name: "shape",
                reason: format!("{tokens} × {channels} overflows"),
            })?;
        check_len("input matrix", len, data.len())?;
        if options.non_finite == NonFinite::Reject
            && let Some(i) = data.iter().position(|x| !x.is_finite())
        {
            return Err(KvQuantError::NonFinite {
                token: i / channels,
                channel: i % channels,
                value: data[i],
            });
        }
        let kind = Kind::of(form.quantizer());
        let layout = Self::layout_of(form.quantizer(), tokens, channels)?;
        let row_bytes = match (kind.raw_bytes(), form.protection()) {
            (Some(b), _) => b * channels,
            (None, Some(p)) => p.code.codec().encoded_len(channels),
            (None, None) => int::packed_row_bytes(kind.level_bits().unwrap_or(8), channels),
        };
        let mut store = KvStore {
            form,
            tokens,
            channels,
            row_bytes,
            layout,
            data: vec![0; row_bytes * tokens],
            scales: Vec::new(),
            offsets: Vec::new(),
            checks: Vec::new(),
            injected: 0,
        };
        match kind {
            Kind::F32 | Kind::F16 | Kind::Bf16 => store.fill_raw(kind, data, options)?,
            Kind::Fp8(format) => store.fill_fp8(format, data)?,
            _ => store.fill_levels(kind, data)?,
        }
        Ok(store)
    }

    fn layout_of(q: &Quantizer, tokens: usize, channels: usize) -> Result<Option<GroupLayout>> {
        let (tpb, cpg) = match *q {
            Quantizer::Fp32 | Quantizer::Fp16 | Quantizer::Bf16 => return Ok(None),
            Quantizer::Fp8(s) => (
                if s.per_token { 1 } else { tokens },
                s.head_dim.unwrap_or(channels),
            ),
            Quantizer::Nf4(s) => (1, s.group),
            Quantizer::Int(s) => match s.granularity {
                Granularity::PerToken { group } => (1, group.unwrap_or(channels)),
                Granularity::PerChannel { tokens: block } => (block.unwrap_or(tokens), 1),
                Granularity::PerTensor => (tokens, channels),
            },
        };
        GroupLayout::new(tokens, channels, tpb, cpg).map(Some)
    }

    fn scale_type(&self) -> ScaleType {
        match self.form.quantizer() {
            Quantizer::Int(s) => s.scale,
            Quantizer::Nf4(s) => s.scale,
            _ => ScaleType::F32,
        }
    }

    fn meta_code(&self) -> Option<&'static MetaCode> {
        match self.form.protection() {
            Some(Protection {
                metadata: MetaProtection::Secded,
                ..
            }) => Some(MetaCode::for_width(8 * self.scale_type().bytes())),
            _ => None,
        }
    }

    fn fill_raw(&mut self, kind: Kind, data: &[f32], options: QuantizeOptions) -> Result<()> {
        let clamp = options.non_finite == NonFinite::Clamp;
        let overflow = |x: f32, dtype: &'static str, max: f64| KvQuantError::OutOfRange {
            what: "input value",
            value: f64::from(x),
            dtype,
            max,
        };
        match kind {
            Kind::F32 => {
                for (o, &x) in self.data.chunks_exact_mut(4).zip(data) {
                    o.copy_from_slice(&sanitize(x).to_le_bytes());
                }
            }
            _ => {
                // The 16-bit format: conversion to (bits, is infinite), largest finite, name.
                type Convert = fn(f32) -> (u16, bool);
                let (convert, max, name): (Convert, f32, &'static str) = if kind == Kind::F16 {
                    let c: Convert =
                        |x| (f16::from_f32(x).to_bits(), f16::from_f32(x).is_infinite());
                    (c, f16::MAX.to_f32(), "f16")
                } else {
                    let c: Convert =
                        |x| (bf16::from_f32(x).to_bits(), bf16::from_f32(x).is_infinite());
                    (c, bf16::MAX.to_f32(), "bf16")
                };
                for (o, &x) in self.data.chunks_exact_mut(2).zip(data) {
                    let (mut bits, infinite) = convert(sanitize(x));
                    if infinite {
                        if !clamp {
                            return Err(overflow(x, name, f64::from(max)));
                        }
                        bits = convert(max.copysign(x)).0;
                    }
                    o.copy_from_slice(&bits.to_le_bytes());
                }
            }
        }
        Ok(())
    }

    /// Finite minimum and maximum of every group (0, 0 for groups without finite values).
    fn group_ranges(&self, layout: &GroupLayout, data: &[f32]) -> Vec<(f32, f32)> {
        let mut ranges = vec![(f32::INFINITY, f32::NEG_INFINITY); layout.groups()];
        let cpg = layout.channels_per_group;
        for (t, row) in data.chunks_exact(self.channels).enumerate() {
            let base = layout.group(t, 0);
            for (gi, seg) in row.chunks_exact(cpg).enumerate() {
                let r = &mut ranges[base + gi];
                for &x in seg.iter().filter(|x| x.is_finite()) {
                    r.0 = r.0.min(x);
                    r.1 = r.1.max(x);
                }
            }
        }
        for r in &mut ranges {
            if r.0 > r.1 {
                *r = (0.0, 0.0);
            }
        }
        ranges
    }

    fn fill_fp8(&mut self, format: Fp8Format, data: &[f32]) -> Result<()> {
        let layout = self.layout.expect("fp8 forms have groups");
        let scales: Vec<f32> = self
            .group_ranges(&layout, data)
            .into_iter()
            .map(|(lo, hi)| {
                let absmax = lo.abs().max(hi.abs());
                if absmax > 0.0 {
                    let s = f64::from(absmax) / f64::from(format.max_finite());
                    int::round_to(ScaleType::F32, s, Toward::Up, "scale")
                } else {
                    Ok(1.0)
                }
            })
            .collect::<Result<_>>()?;
        for (t, row) in data.chunks_exact(self.channels).enumerate() {
            let out = &mut self.data[t * self.row_bytes..][..self.channels];
            for (c, (o, &x)) in out.iter_mut().zip(row).enumerate() {
                *o = format.encode(sanitize(x) / scales[layout.group(t, c)]);
            }
        }
        self.scales = scales.iter().flat_map(|s| s.to_le_bytes()).collect();
        Ok(())
    }

    fn fill_levels(&mut self, kind: Kind, data: &[f32]) -> Result<()> {
        let layout = self.layout.expect("level forms have groups");
        let ty = self.scale_type();
        let ranges = self.group_ranges(&layout, data);
        // (a, b) per group as in `Kind::dequant`.
        let params: Vec<(f32, f32)> = ranges
            .iter()
            .map(|&(lo, hi)| match kind {
                Kind::Asym(bits) => int::asymmetric_params(lo, hi, bits, ty),
                Kind::Sym(bits) => {
                    Ok((int::symmetric_scale(lo.abs().max(hi.abs()), bits, ty)?, 0.0))
                }
                _ => {
                    let absmax = lo.abs().max(hi.abs());
                    Ok((
                        int::round_to(ty, f64::from(absmax), Toward::Up, "absmax")?,
                        0.0,
                    ))
                }
            })
            .collect::<Result<_>>()?;
        let width = ty.bytes();
        let write = |v: f32| int::to_bits(ty, v).to_le_bytes().into_iter().take(width);
        self.scales = params.iter().flat_map(|p| write(p.0)).collect();
        if matches!(kind, Kind::Asym(_)) {
            self.offsets = params.iter().flat_map(|p| write(p.1)).collect();
        }
        if let Some(code) = self.meta_code() {
            self.checks = self
                .scales
                .chunks_exact(width)
                .chain(self.offsets.chunks_exact(width))
                .map(|w| code.check(read_word(w)))
                .collect();
        }
        let cpg = layout.channels_per_group;
        let mut levels = vec![0u8; self.channels];
        for (t, row) in data.chunks_exact(self.channels).enumerate() {
            let base = layout.group(t, 0);
            for (gi, (seg, lv)) in row
                .chunks_exact(cpg)
                .zip(levels.chunks_exact_mut(cpg))
                .enumerate()
            {
                let (a, b) = params[base + gi];
                for (l, &x) in lv.iter_mut().zip(seg) {
                    let x = sanitize(x);
                    *l = match kind {
                        Kind::Asym(bits) => int::asymmetric_level(x, a, b, bits),
                        Kind::Sym(bits) => int::symmetric_level(x, a, bits),
                        _ if a > 0.0 => nearest_level(x / a),
                        _ => 7,
                    };
                }
            }
            let out = &mut self.data[t * self.row_bytes..][..self.row_bytes];
            match self.form.protection() {
                Some(p) => p.code.codec().encode_into(&levels, out)?,
                None => int::pack_row(kind.level_bits().unwrap_or(8), &levels, out),
            }
        }
        Ok(())
    }

    /// The form.
    pub fn form(&self) -> &CacheForm {
        &self.form
    }

    /// Tokens (rows).
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    /// Channels (columns).
    pub fn channels(&self) -> usize {
        self.channels
    }

    /// Bytes of one token row in the value buffer.
    pub fn row_bytes(&self) -> usize {
        self.row_bytes
    }

    /// The metadata grouping (`None` for fp32, fp16, bf16).
    pub fn layout(&self) -> Option<&GroupLayout> {
        self.layout.as_ref()
    }

    /// The value buffer (see the module docs for its layout).
    pub fn data(&self) -> &[u8] {
        &self.data
    }

    /// The scales buffer.
    pub fn scales(&self) -> &[u8] {
        &self.scales
    }

    /// The offsets buffer (asymmetric integer forms).
    pub fn offsets(&self) -> &[u8] {
        &self.offsets
    }

    /// The metadata check bytes (forms with SECDED metadata).
    pub fn meta_checks(&self) -> &[u8] {
        &self.checks
    }

    /// Stored parameters of group `g` as held (before any metadata decoding):
    /// `(scale, offset)` for integer forms (offset 0 when symmetric),
    /// `(absmax, 0)` for NF4, `(scale, 0)` for FP8; `None` for forms without
    /// groups or `g` out of range.
    pub fn group_params(&self, g: usize) -> Option<(f32, f32)> {
        let layout = self.layout.as_ref()?;
        if g >= layout.groups() {
            return None;
        }
        let ty = self.scale_type();
        let width = ty.bytes();
        let read = |buffer: &[u8]| int::from_bits(ty, read_word(&buffer[g * width..][..width]));
        let offset = if self.offsets.is_empty() {
            0.0
        } else {
            read(&self.offsets)
        };
        Some((read(&self.scales), offset))
    }

    /// True storage: the summed length of every buffer held.
    pub fn stored_bytes(&self) -> usize {
        self.data.len() + self.scales.len() + self.offsets.len() + self.checks.len()
    }

    /// Stored bits per value, metadata included (`NaN` for an empty store).
    pub fn bits_per_value(&self) -> f64 {
        (8 * self.stored_bytes()) as f64 / (self.tokens * self.channels) as f64
    }

    /// Bits flipped by [`inject`](Self::inject) since quantization.
    pub fn injected_flips(&self) -> u64 {
        self.injected
    }

    /// Value words per token: codewords for coded forms, values otherwise.
    pub fn words_per_row(&self) -> usize {
        match self.form.protection() {
            Some(p) => p.code.codec().codewords(self.channels),
            None => self.channels,
        }
    }

    /// The value word (global index `token · words_per_row + word`) holding
    /// bit `bit` of the value buffer, or `None` for a padding bit that belongs
    /// to no word (a fault there changes nothing).
    pub fn word_of_bit(&self, bit: u64) -> Option<usize> {
        let row_bits = 8 * self.row_bytes as u64;
        let (row, b) = ((bit / row_bits) as usize, bit % row_bits);
        if row >= self.tokens {
            return None;
        }
        let word_bits = match (self.form.protection(), Kind::of(self.form.quantizer())) {
            (Some(p), _) => match p.code {
                Int4Code::Hamming74 => 7,
                Int4Code::Secded84 => 8,
                Int4Code::Golay24 => 24,
            },
            (None, kind) => match kind.raw_bytes() {
                Some(bytes) => 8 * bytes as u64,
                None => u64::from(kind.level_bits().unwrap_or(8)),
            },
        };
        let word = (b / word_bits) as usize;
        (word < self.words_per_row()).then_some(row * self.words_per_row() + word)
    }

    /// Injects faults from `channel` with `seed` into the chosen buffers.
    pub fn inject(
        &mut self,
        channel: &dyn FaultChannel,
        seed: u64,
        target: FaultTarget,
    ) -> Injection {
        let mut injection = Injection::default();
        let hit = |buffer: &mut Vec<u8>, stream: u64| {
            channel.inject_with(buffer, &mut FaultRng::with_stream(seed, stream))
        };
        if target != FaultTarget::Metadata {
            injection.values = hit(&mut self.data, 0);
        }
        if target != FaultTarget::Values {
            injection.scales = hit(&mut self.scales, 1);
            injection.offsets = hit(&mut self.offsets, 2);
            injection.checks = hit(&mut self.checks, 3);
        }
        self.injected += injection.total() as u64;
        injection
    }

    /// Decodes the whole matrix.
    pub fn decode(&self) -> Result<DecodedMatrix> {
        self.decode_owned(None)
    }

    /// Decodes the whole matrix, comparing with `truth` (the same store
    /// before faults) to count miscorrected words and silent changes.
    pub fn decode_with_truth(&self, truth: &KvStore) -> Result<DecodedMatrix> {
        self.check_truth(truth)?;
        self.decode_owned(Some(truth))
    }

    fn decode_owned(&self, truth: Option<&KvStore>) -> Result<DecodedMatrix> {
        let mut values = vec![0.0; self.tokens * self.channels];
        let mut scratch = DecodeScratch::new();
        let stats = if self.tokens == 0 {
            KvDecodeStats::default()
        } else {
            self.decode_rows_impl(0, self.tokens, &mut values, &mut scratch, truth)?
        };
        let words = erasure_words(self.channels) * self.tokens;
        Ok(DecodedMatrix {
            values,
            erased: scratch
                .erasures
                .get(..words)
                .map_or_else(|| vec![0; words], <[u64]>::to_vec),
            stats,
            injected_flips: self.injected,
            channels: self.channels,
        })
    }

    /// Checks that `truth` can be this store's fault-free original: same
    /// form and shape ([`KvQuantError::StoreMismatch`] otherwise).
    pub fn check_truth(&self, truth: &KvStore) -> Result<()> {
        if truth.form != self.form || truth.tokens != self.tokens || truth.channels != self.channels
        {
            return Err(KvQuantError::StoreMismatch(format!(
                "{} {}×{} against truth {} {}×{}",
                self.form, self.tokens, self.channels, truth.form, truth.tokens, truth.channels
            )));
        }
        Ok(())
    }

    /// Decodes tokens `start..start + count` into `out` (`count × channels`
    /// f32, row-major) without allocating once `scratch` has grown, applying
    /// the form's erasure policy. Values and statistics equal those of the
    /// same rows of a whole [`decode`](Self::decode): interpolation reads
    /// neighbours outside the tile straight from the store, and statistics
    /// count only this tile's words.
    pub fn decode_rows_into(
        &self,
        start: usize,
        count: usize,
        out: &mut [f32],
        scratch: &mut DecodeScratch,
    ) -> Result<KvDecodeStats> {
        self.decode_rows_impl(start, count, out, scratch, None)
    }

    /// The stored bytes of rows `start..start + count` when the form is
    /// plain FP16 (little-endian IEEE half floats, row-major, `2·channels`
    /// bytes per row), with the statistics
    /// [`decode_rows_into`](Self::decode_rows_into) returns for the same rows;
    /// `None` for every other form. A reader can widen the halves in registers
    /// (see [`widen_f16`](crate::widen_f16)) instead of decoding into a buffer:
    /// the values are the same.
    ///
    /// [`decode_rows_view`](Self::decode_rows_view) does the same for the
    /// integer forms.
    pub fn fp16_rows(&self, start: usize, count: usize) -> Result<Option<(&[u8], KvDecodeStats)>> {
        if Kind::of(self.form.quantizer()) != Kind::F16 || self.form.protection().is_some() {
            return Ok(None);
        }
        let end = self.row_end(start, count)?;
        let words = (count * self.channels) as u64;
        let mut stats = KvDecodeStats::default();
        stats.values.words = words;
        stats.values.clean = words;
        let rb = self.row_bytes;
        Ok(Some((&self.data[start * rb..end * rb], stats)))
    }

    /// [`decode_rows_into`](Self::decode_rows_into) with the truth known.
    pub fn decode_rows_with_truth_into(
        &self,
        truth: &KvStore,
        start: usize,
        count: usize,
        out: &mut [f32],
        scratch: &mut DecodeScratch,
    ) -> Result<KvDecodeStats> {
        self.check_truth(truth)?;
        self.decode_rows_impl(start, count, out, scratch, Some(truth))
    }

    fn decode_rows_impl(
        &self,
        start: usize,
        count: usize,
        out: &mut [f32],
        scratch: &mut DecodeScratch,
        truth: Option<&KvStore>,
    ) -> Result<KvDecodeStats> {
        let end = self.row_end(start, count)?;
        check_len("output tile", count * self.channels, out.len())?;
        let kind = Kind::of(self.form.quantizer());
        let mut stats = self.decode_codes(start, end, kind, scratch, truth)?;
        if kind.raw_bytes().is_some() {
            stats.values = self.decode_raw(kind, start, end, out, scratch, truth);
        } else {
            let params = (scratch.scale.as_slice(), scratch.offset.as_slice());
            crate::simd::with_avx2(|| {
                self.dequantize_levels(kind, start, end, out, &scratch.levels, params);
            });
        }
        if stats.erased_values > 0 {
            let ew = erasure_words(self.channels);
            self.apply_policy(start, end, out, &scratch.erasures[..count * ew])?;
        }
        Ok(stats)
    }

    /// `start + count`, or [`KvQuantError::RowRange`] unless `0 < count` and
    /// the rows are inside the store.
    fn row_end(&self, start: usize, count: usize) -> Result<usize> {
        start
            .checked_add(count)
            .filter(|&e| e <= self.tokens && count > 0)
            .ok_or(KvQuantError::RowRange {
                start,
                end: start.saturating_add(count),
                tokens: self.tokens,
            })
    }

    /// Everything of decoding rows `start..end` but turning codes into
    /// values: the group parameters (SECDED-decoded where protected) into
    /// `scratch.scale`/`scratch.offset`, the levels of level forms (ECC-decoded
    /// where protected) into `scratch.levels`, and the erasure bit of every
    /// value into `scratch.erasures`. The returned statistics lack
    /// `values` for the raw forms, which [`decode_raw`](Self::decode_raw) counts.
    fn decode_codes(
        &self,
        start: usize,
        end: usize,
        kind: Kind,
        scratch: &mut DecodeScratch,
        truth: Option<&KvStore>,
    ) -> Result<KvDecodeStats> {
        let count = end - start;
        let ch = self.channels;
        let ew = erasure_words(ch);
        let erasures = grow(&mut scratch.erasures, count * ew);
        erasures.fill(0);
        let mut stats = KvDecodeStats::default();
        if let Some(layout) = &self.layout {
            stats.metadata = self.load_params(layout, start, end, scratch, truth);
        }
        if kind.raw_bytes().is_none() {
            stats.values = crate::simd::with_avx2(|| self.load_levels(start, end, scratch, truth))?;
        }
        let erasures = &mut scratch.erasures[..count * ew];
        if let Some(layout) = &self.layout {
            let groups = layout.groups_of_rows(start, end);
            for (i, _) in scratch.meta_erased[..groups.len()]
                .iter()
                .enumerate()
                .filter(|e| *e.1)
            {
                let g = groups.start + i;
                let t0 = layout.first_token(g).max(start);
                let t1 = (layout.first_token(g) + layout.tokens_per_block).min(end);
                let c0 = g % layout.groups_per_block * layout.channels_per_group;
                for t in t0..t1 {
                    set_bits(
                        &mut erasures[(t - start) * ew..][..ew],
                        c0,
                        layout.channels_per_group,
                    );
                }
            }
        }
        stats.erased_values = erasures.iter().map(|w| u64::from(w.count_ones())).sum();
        Ok(stats)
    }

    /// Reads (and for SECDED metadata decodes) the parameters of the groups of
    /// rows `start..end` into the scratch, returning metadata statistics.
    fn load_params(
        &self,
        layout: &GroupLayout,
        start: usize,
        end: usize,
        scratch: &mut DecodeScratch,
        truth: Option<&KvStore>,
    ) -> DecodeStats {
        let groups = layout.groups_of_rows(start, end);
        let n = groups.len();
        let ty = self.scale_type();
        let width = ty.bytes();
        let total = layout.groups();
        let scale = grow(&mut scratch.scale, n);
        let offset = grow(&mut scratch.offset, n);
        let erased = grow(&mut scratch.meta_erased, n);
        let mut stats = DecodeStats::default();
        let has_offsets = !self.offsets.is_empty();
        for (i, g) in groups.enumerate() {
            let counted = (start..end).contains(&layout.first_token(g));
            let mut read = |buffer: &[u8], check_index: usize, truth_buffer: Option<&[u8]>| {
                let (word, outcome) = self.meta_word(buffer, g, check_index);
                if counted {
                    match truth_buffer {
                        Some(t) => stats.record_with_truth(
                            outcome,
                            word == read_word(&t[g * width..][..width]),
                        ),
                        None => stats.record(outcome),
                    }
                }
                (
                    int::from_bits(ty, word),
                    outcome == gf2_codes::DecodeOutcome::Detected,
                )
            };
            let (s, s_bad) = read(&self.scales, g, truth.map(|t| t.scales.as_slice()));
            let (o, o_bad) = if has_offsets {
                read(
                    &self.offsets,
                    total + g,
                    truth.map(|t| t.offsets.as_slice()),
                )
            } else {
                (0.0, false)
            };
            scale[i] = s;
            offset[i] = o;
            erased[i] = s_bad || o_bad;
        }
        stats
    }

    /// Metadata word `g` of `buffer` (the scales or the offsets) after SECDED
    /// decoding with check byte `check_index`, if the form has one.
    #[inline]
    fn meta_word(
        &self,
        buffer: &[u8],
        g: usize,
        check_index: usize,
    ) -> (u32, gf2_codes::DecodeOutcome) {
        let width = self.scale_type().bytes();
        let raw = read_word(&buffer[g * width..][..width]);
        match self.meta_code() {
            Some(code) => code.decode(raw, self.checks[check_index]),
            None => (raw, gf2_codes::DecodeOutcome::Clean),
        }
    }

    /// Decodes (coded) or unpacks (plain) the levels of rows `start..end` into the scratch.
    fn load_levels(
        &self,
        start: usize,
        end: usize,
        scratch: &mut DecodeScratch,
        truth: Option<&KvStore>,
    ) -> Result<DecodeStats> {
        let (ch, rb) = (self.channels, self.row_bytes);
        let count = end - start;
        let ew = erasure_words(ch);
        let levels = grow(&mut scratch.levels, count * ch);
        let rows = &self.data[start * rb..end * rb];
        let bits = Kind::of(self.form.quantizer()).level_bits().unwrap_or(8);
        let Some(protection) = self.form.protection() else {
            for (lv, row) in levels.chunks_exact_mut(ch).zip(rows.chunks_exact(rb)) {
                int::unpack_row(bits, row, lv);
            }
            let mut stats = DecodeStats::default();
            match truth {
                None => {
                    stats.words = (count * ch) as u64;
                    stats.clean = stats.words;
                }
                Some(truth) => {
                    let tl = grow(&mut scratch.truth_levels, count * ch);
                    let truth_rows = &truth.data[start * rb..end * rb];
                    for (lv, row) in tl.chunks_exact_mut(ch).zip(truth_rows.chunks_exact(rb)) {
                        int::unpack_row(bits, row, lv);
                    }
                    for (a, b) in levels.iter().zip(tl.iter()) {
                        stats.record_with_truth(gf2_codes::DecodeOutcome::Clean, a == b);
                    }
                }
            }
            return Ok(stats);
        };
        let codec = protection.code.codec();
        let backend = Backend::detect();
        // Values per row including codeword padding (Golay pads a row to a
        // multiple of 3); the rows of a tile then form one codeword stream
        // unless a row ends inside a byte (Hamming(7,4) with channels % 8 ≠ 0).
        let padded = codec.codewords(ch) * codec.values_per_codeword();
        if truth.is_none() && codec.encoded_len(padded * count) == rb * count {
            let erasures = &mut scratch.erasures[..count * ew];
            if padded == ch && ch % 64 == 0 {
                // Same layout as the tile: decode straight into it.
                return Ok(codec.decode_into_with(backend, rows, levels, erasures)?);
            }
            // One call over the tile into flat buffers, then split into rows.
            let flat = grow(&mut scratch.flat_levels, padded * count);
            let flat_erasures = grow(&mut scratch.flat_erasures, erasure_words(padded * count));
            let stats = codec.decode_into_with(backend, rows, flat, flat_erasures)?;
            for r in 0..count {
                levels[r * ch..][..ch].copy_from_slice(&flat[r * padded..][..ch]);
                copy_bits(flat_erasures, r * padded, &mut erasures[r * ew..][..ew], ch);
            }
            return Ok(stats);
        }
        let erasures = &mut scratch.erasures[..count * ew];
        let mut stats = DecodeStats::default();
        for r in 0..count {
            let row = &rows[r * rb..][..rb];
            let lv = &mut levels[r * ch..][..ch];
            let er = &mut erasures[r * ew..][..ew];
            stats += match truth {
                None => codec.decode_into_with(backend, row, lv, er)?,
                Some(truth) => {
                    let tl = grow(&mut scratch.truth_levels, ch);
                    let truth_row = &truth.data[(start + r) * rb..][..rb];
                    let te = grow(&mut scratch.truth_erasures, ew);
                    codec.decode_into_with(backend, truth_row, tl, te)?;
                    codec.decode_with_truth_into_with(backend, row, tl, lv, er)?
                }
            };
        }
        Ok(stats)
    }

    /// Turns one level (or FP8 code) per value of rows `start..end`
    /// (`levels`, row stride `channels`) into values, with the group
    /// parameters `scale`/`offset` loaded for those rows.
    fn dequantize_levels(
        &self,
        kind: Kind,
        start: usize,
        end: usize,
        out: &mut [f32],
        levels: &[u8],
        (scale, offset): (&[f32], &[f32]),
    ) {
        let layout = self.layout.as_ref().expect("level forms have groups");
        let ch = self.channels;
        let g0 = layout.groups_of_rows(start, end).start;
        let cpg = layout.channels_per_group;
        for (r, (o, lv)) in out
            .chunks_exact_mut(ch)
            .zip(levels.chunks_exact(ch))
            .enumerate()
        {
            let base = layout.group(start + r, 0) - g0;
            let a = &scale[base..][..layout.groups_per_block];
            let b = &offset[base..][..layout.groups_per_block];
            if cpg == 1 {
                dequantize_columns(kind, o, lv, a, b);
            } else {
                for (((o, lv), &a), &b) in o
                    .chunks_exact_mut(cpg)
                    .zip(lv.chunks_exact(cpg))
                    .zip(a)
                    .zip(b)
                {
                    dequantize_segment(kind, o, lv, a, b);
                }
            }
        }
    }

    /// Decodes the one-code-per-value forms.
    fn decode_raw(
        &self,
        kind: Kind,
        start: usize,
        end: usize,
        out: &mut [f32],
        scratch: &DecodeScratch,
        truth: Option<&KvStore>,
    ) -> DecodeStats {
        let rb = self.row_bytes;
        let bytes = &self.data[start * rb..end * rb];
        match kind {
            Kind::F32 => {
                for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                    *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                }
            }
            // AVX-512 or F16C conversion when the CPU has it (replacing
            // `half`'s 4-wide slice conversion took fp16 decode attention at
            // 32/8/128, 64K tokens from 39 to 29 ms on this project's machine).
            Kind::F16 => crate::simd::f16_to_f32(bytes, out),
            Kind::Bf16 => {
                for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                    *o = bf16::from_le_bytes([b[0], b[1]]).to_f32();
                }
            }
            Kind::Fp8(_) => {
                // One code byte per value: the level loop reads the row bytes directly.
                let params = (scratch.scale.as_slice(), scratch.offset.as_slice());
                self.dequantize_levels(kind, start, end, out, bytes, params);
            }
            _ => unreachable!("raw forms only"),
        }
        let per_value = kind.raw_bytes().unwrap_or(1);
        let mut stats = DecodeStats::default();
        match truth {
            None => {
                stats.words = (bytes.len() / per_value) as u64;
                stats.clean = stats.words;
            }
            Some(truth) => {
                let truth_bytes = &truth.data[start * rb..end * rb];
                for (a, b) in bytes
                    .chunks_exact(per_value)
                    .zip(truth_bytes.chunks_exact(per_value))
                {
                    stats.record_with_truth(gf2_codes::DecodeOutcome::Clean, a == b);
                }
            }
        }
        stats
    }

    fn apply_policy(
        &self,
        start: usize,
        end: usize,
        out: &mut [f32],
        erasures: &[u64],
    ) -> Result<()> {
        // Only protected forms detect anything, so only they have erasures.
        let Some(protection) = self.form.protection() else {
            return Ok(());
        };
        let policy = protection.policy;
        let ch = self.channels;
        let ew = erasure_words(ch);
        let erased = |t: usize, c: usize| erasures[(t - start) * ew + c / 64] >> (c % 64) & 1 == 1;
        for r in 0..end - start {
            for (w, &word) in erasures[r * ew..][..ew].iter().enumerate() {
                let mut bits = word;
                while bits != 0 {
                    let c = 64 * w + bits.trailing_zeros() as usize;
                    bits &= bits - 1;
                    let t = start + r;
                    out[r * ch + c] = match policy {
                        ErasurePolicy::Keep => continue,
                        ErasurePolicy::Zero => 0.0,
                        ErasurePolicy::Interpolate { reach } => {
                            let neighbour = |t2: usize| -> Result<Option<f32>> {
                                if (start..end).contains(&t2) {
                                    Ok((!erased(t2, c)).then(|| out[(t2 - start) * ch + c]))
                                } else {
                                    self.valid_value_at(protection.code, t2, c)
                                }
                            };
                            let reach = reach as usize;
                            let mut left = None;
                            for d in 1..=reach.min(t) {
                                if let Some(v) = neighbour(t - d)? {
                                    left = Some((d, v));
                                    break;
                                }
                            }
                            let mut right = None;
                            for d in 1..=reach.min(self.tokens - 1 - t) {
                                if let Some(v) = neighbour(t + d)? {
                                    right = Some((d, v));
                                    break;
                                }
                            }
                            interpolate(left, right)
                        }
                    };
                }
            }
        }
        Ok(())
    }

    /// The value at `(token, channel)` if neither its codeword nor its
    /// group's metadata is detected as corrupted (used for interpolation
    /// across tile borders; decisions equal those of a tile decode).
    fn valid_value_at(&self, code: Int4Code, token: usize, channel: usize) -> Result<Option<f32>> {
        let kind = Kind::of(self.form.quantizer());
        let layout = self.layout.as_ref().expect("protected forms have groups");
        let g = layout.group(token, channel);
        let ty = self.scale_type();
        let read = |buffer: &[u8], check_index: usize| {
            let (word, outcome) = self.meta_word(buffer, g, check_index);
            (
                int::from_bits(ty, word),
                outcome == gf2_codes::DecodeOutcome::Detected,
            )
        };
        let (a, a_bad) = read(&self.scales, g);
        let (b, b_bad) = if self.offsets.is_empty() {
            (0.0, false)
        } else {
            read(&self.offsets, layout.groups() + g)
        };
        if a_bad || b_bad {
            return Ok(None);
        }
        let row = &self.data[token * self.row_bytes..][..self.row_bytes];
        let codec = code.codec();
        // The smallest byte-aligned run of codewords holding the value.
        let unit = match code {
            Int4Code::Hamming74 => 8,
            Int4Code::Secded84 => 1,
            Int4Code::Golay24 => 3,
        };
        let u = channel / unit;
        let n = unit.min(self.channels - u * unit);
        let first = u * codec.encoded_len(unit);
        let mut values = [0u8; 8];
        let mut erased = [0u64; 1];
        codec.decode_into_with(
            Backend::Scalar,
            &row[first..first + codec.encoded_len(n)],
            &mut values[..n],
            &mut erased,
        )?;
        if erased[0] >> (channel - u * unit) & 1 == 1 {
            return Ok(None);
        }
        let level = values[channel - u * unit];
        Ok(Some(kind.dequant(level, a, b)))
    }
}

/// The paper's interpolation (eq. 29 and section 5.3.3), generalised to the
/// nearest valid neighbours at distances `d_l`, `d_r`.
fn interpolate(left: Option<(usize, f32)>, right: Option<(usize, f32)>) -> f32 {
    match (left, right) {
        (Some((1, l)), Some((1, r))) => 0.5 * (l + r),
        (Some((dl, l)), Some((dr, r))) => {
            let (dl, dr) = (dl as f32, dr as f32);
            (dr * l + dl * r) / (dl + dr)
        }
        (Some((_, v)), None) | (None, Some((_, v))) => v,
        (None, None) => 0.0,
    }
}

/// Sets bits `from..from + n` of a bitmap.
fn set_bits(words: &mut [u64], from: usize, n: usize) {
    let (mut bit, end) = (from, from + n);
    while bit < end {
        let (w, shift) = (bit / 64, bit % 64);
        let take = (64 - shift).min(end - bit);
        let mask = if take == 64 {
            u64::MAX
        } else {
            ((1u64 << take) - 1) << shift
        };
        words[w] |= mask;
        bit += take;
    }
}

/// Copies bits `from..from + n` of the bitmap `src` to bits `0..n` of `dst`.
fn copy_bits(src: &[u64], from: usize, dst: &mut [u64], n: usize) {
    for (i, d) in dst.iter_mut().enumerate() {
        let bit = from + 64 * i;
        let (w, shift) = (bit / 64, bit % 64);
        let mut v = src[w] >> shift;
        if shift != 0
            && let Some(&next) = src.get(w + 1)
        {
            v |= next << (64 - shift);
        }
        let left = n - 64 * i;
        *d = if left < 64 {
            v & ((1u64 << left) - 1)
        } else {
            v
        };
    }
}

#[inline]
fn read_word(bytes: &[u8]) -> u32 {
    bytes
        .iter()
        .enumerate()
        .fold(0, |w, (i, &b)| w | u32::from(b) << (8 * i))
}

#[inline]
fn dequantize_segment(kind: Kind, out: &mut [f32], levels: &[u8], a: f32, b: f32) {
    match kind {
        Kind::Asym(_) => {
            for (o, &q) in out.iter_mut().zip(levels) {
                *o = b + f32::from(q) * a;
            }
        }
        Kind::Sym(bits) => {
            let mid = f32::from(1u8 << (bits - 1));
            for (o, &q) in out.iter_mut().zip(levels) {
                *o = (f32::from(q) - mid) * a;
            }
        }
        Kind::Fp8(format) => {
            let table = format.table();
            for (o, &q) in out.iter_mut().zip(levels) {
                *o = table[usize::from(q)] * a;
            }
        }
        _ => {
            for (o, &q) in out.iter_mut().zip(levels) {
                *o = NF4_LEVELS[usize::from(q & 15)] * a;
            }
        }
    }
}

#[inline]
fn dequantize_columns(kind: Kind, out: &mut [f32], levels: &[u8], a: &[f32], b: &[f32]) {
    match kind {
        Kind::Asym(_) => {
            for (((o, &q), &a), &b) in out.iter_mut().zip(levels).zip(a).zip(b) {
                *o = b + f32::from(q) * a;
            }
        }
        _ => {
            for ((o, &q), &a) in out.iter_mut().zip(levels).zip(a) {
                *o = kind.dequant(q, a, 0.0);
            }
        }
    }
}
