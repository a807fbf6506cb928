//! Encoding: f32 rows into a section's bytes.
//!
//! [`RowEncoder`] is the write path of row-local forms (every per-token
//! form): it quantizes and encodes rows straight into caller-provided
//! buffers ([`RowBuffersMut`]) without allocating once built, which is what
//! a paged cache does for every appended token. Whole-matrix quantization
//! runs the same encoder over every row; forms whose metadata is shared
//! across tokens (per-channel, per-tensor) first compute their group
//! parameters over the matrix and then encode the rows with them.
//! The integer levels and group parameters come from `levels.rs`.

use std::sync::Arc;

use super::bound::ParamBound;
use super::levels::{all_finite, group_params, int_row, levels_of_group, levels_with, row_params};
use super::section::{Coding, Kind, Section};
use super::{LevelMap, NonFinite, QuantizeOptions, bits::read_word};
use crate::error::{KvQuantError, Result, check_len};
use crate::int::{self, Toward};
use crate::layout::GroupLayout;
use crate::lloyd_max::LloydMax;
use crate::meta::MetaCode;
use crate::qjl::QjlSketch;
use crate::rotation::Hadamard;
use crate::spec::{CacheForm, ScaleType};
use crate::vq::VqCodebook;

use half::{bf16, f16};

/// Magnitude that `NonFinite::Clamp` gives infinities in rotated forms when
/// the block holds no finite value to saturate at.
const ROTATED_CLAMP: f32 = 1e30;

/// Borrowed buffers of consecutive token rows of a row-local form: what a
/// paged cache block (or a slice of one per-layer buffer) holds. Lengths
/// are those of [`RowEncoder::buffer_sizes`] for the number of rows.
#[derive(Debug)]
pub struct RowBuffersMut<'a> {
    /// Row bytes (`rows × row_bytes`).
    pub data: &'a mut [u8],
    /// Scales (absmax, gain): `rows × groups_per_row` words.
    pub scales: &'a mut [u8],
    /// Offsets (QJL residual norms) for forms that have them, else empty.
    pub offsets: &'a mut [u8],
    /// Check words of the scales (forms with protected metadata).
    pub scale_checks: &'a mut [u8],
    /// Check words of the offsets.
    pub offset_checks: &'a mut [u8],
}

/// Byte lengths of the buffers of `rows` rows ([`RowEncoder::buffer_sizes`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct RowBufferSizes {
    /// Row bytes.
    pub data: usize,
    /// Scale bytes.
    pub scales: usize,
    /// Offset bytes.
    pub offsets: usize,
    /// Scale check bytes.
    pub scale_checks: usize,
    /// Offset check bytes.
    pub offset_checks: usize,
}

/// Owned buffers of consecutive token rows (sized by
/// [`RowEncoder::buffer_sizes`]): where a writer encodes rows before it
/// commits them to a store with [`KvStore::put_encoded_rows`](crate::KvStore::put_encoded_rows),
/// so that of several rows either all or none change.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RowBuffers {
    /// Row bytes.
    pub data: Vec<u8>,
    /// Scale bytes.
    pub scales: Vec<u8>,
    /// Offset bytes.
    pub offsets: Vec<u8>,
    /// Scale check bytes.
    pub scale_checks: Vec<u8>,
    /// Offset check bytes.
    pub offset_checks: Vec<u8>,
}

impl RowBuffers {
    /// Zeroed buffers of these sizes.
    pub fn new(sizes: RowBufferSizes) -> Self {
        Self {
            data: vec![0; sizes.data],
            scales: vec![0; sizes.scales],
            offsets: vec![0; sizes.offsets],
            scale_checks: vec![0; sizes.scale_checks],
            offset_checks: vec![0; sizes.offset_checks],
        }
    }

    /// The sizes held.
    pub fn sizes(&self) -> RowBufferSizes {
        RowBufferSizes {
            data: self.data.len(),
            scales: self.scales.len(),
            offsets: self.offsets.len(),
            scale_checks: self.scale_checks.len(),
            offset_checks: self.offset_checks.len(),
        }
    }

    /// The buffers, borrowed for [`RowEncoder::encode_into`].
    pub fn as_mut(&mut self) -> RowBuffersMut<'_> {
        RowBuffersMut {
            data: &mut self.data,
            scales: &mut self.scales,
            offsets: &mut self.offsets,
            scale_checks: &mut self.scale_checks,
            offset_checks: &mut self.offset_checks,
        }
    }
}

/// Reusable buffers of one encoder.
#[derive(Clone, Debug, Default)]
struct Scratch {
    rotated: Vec<f32>,
    levels: Vec<u8>,
    packed: Vec<u8>,
    nibbles: Vec<u8>,
    params: Vec<(f32, f32)>,
    signs: Vec<u8>,
    residual: Vec<f32>,
    sanitized: Vec<f32>,
}

fn grow<T: Clone + Default>(v: &mut Vec<T>, n: usize) -> &mut [T] {
    if v.len() < n {
        v.resize(n, T::default());
    }
    &mut v[..n]
}

/// Quantizes and encodes rows of one row-local form into caller-provided
/// buffers. Built once per form and width; [`encode_into`](Self::encode_into)
/// does not allocate after the first call.
#[derive(Clone, Debug)]
pub struct RowEncoder {
    coding: Coding,
    channels: usize,
    /// Groups of one row and their channels.
    groups: usize,
    cpg: usize,
    hadamard: Option<&'static Hadamard>,
    codebook: Option<Arc<VqCodebook>>,
    meta: Option<&'static MetaCode>,
    /// Saturate rather than refuse out-of-range float input (set per call).
    clamp: bool,
    /// Float forms keep non-finite values' bits ([`NonFinite::Keep`]).
    keep: bool,
    /// The range of the protected metadata the last `encode_into` wrote.
    written: ParamBound,
    scratch: Scratch,
}

impl RowEncoder {
    /// An encoder of rows of `channels` values in `form` (row-local forms
    /// only; `codebook` for vq forms).
    pub fn new(
        form: CacheForm,
        channels: usize,
        codebook: Option<Arc<VqCodebook>>,
    ) -> Result<Self> {
        if !form.is_row_local() {
            return Err(KvQuantError::InvalidParameter {
                name: "form",
                reason: format!(
                    "{form} is not row-local (it shares scales across tokens or keeps a \
                     sink or window exact), so its rows cannot be written one at a time \
                     (use a per-token form such as int4-g64 or fp8-e4m3-tok)"
                ),
            });
        }
        Self::for_coding(Coding::of(form), channels, codebook)
    }

    pub(crate) fn for_coding(
        coding: Coding,
        channels: usize,
        codebook: Option<Arc<VqCodebook>>,
    ) -> Result<Self> {
        crate::error::check_channels(channels)?;
        // A one-row section checks the shape, rotation and codebook.
        let probe = Section::empty(coding, 1, channels, codebook.clone())?;
        let (groups, cpg) = probe.layout.map_or((0, channels), |l| {
            (l.groups_per_block, l.channels_per_group)
        });
        Ok(Self {
            coding,
            channels,
            groups,
            cpg,
            hadamard: coding.hadamard()?,
            codebook: probe.codebook,
            meta: coding.meta_code(),
            clamp: false,
            keep: false,
            written: ParamBound::default(),
            scratch: Scratch::default(),
        })
    }

    /// The form.
    pub fn form(&self) -> &CacheForm {
        &self.coding.form
    }

    /// Bytes of one stored row.
    pub fn row_bytes(&self) -> usize {
        self.coding.row_bytes(self.channels)
    }

    /// Metadata groups per row.
    pub fn groups_per_row(&self) -> usize {
        self.groups
    }

    /// Consecutive channels of a row sharing one metadata group (the whole
    /// row for forms without groups).
    pub fn channels_per_group(&self) -> usize {
        self.cpg
    }

    /// How a stored level becomes a value for the integer forms (`None` for
    /// float, FP8, NF4, Lloyd-Max and codebook forms).
    pub fn level_map(&self) -> Option<LevelMap> {
        self.coding.kind.level_map()
    }

    /// Type of the stored scales and offsets.
    pub fn scale_type(&self) -> ScaleType {
        self.coding.scale_type()
    }

    /// Bits of one stored code (4 for INT4, 8 for FP8, 16 for f16).
    pub fn code_bits(&self) -> u32 {
        self.coding.code_bits
    }

    /// Buffer lengths for `rows` rows.
    pub fn buffer_sizes(&self, rows: usize) -> RowBufferSizes {
        let words = rows * self.groups;
        let width = self.coding.scale_type().bytes();
        let offsets = if self.coding.has_offsets() { words } else { 0 };
        let cb = self.meta.map_or(0, MetaCode::check_bytes);
        RowBufferSizes {
            data: rows * self.row_bytes(),
            scales: words * width,
            offsets: offsets * width,
            scale_checks: words * cb,
            offset_checks: offsets * cb,
        }
    }

    /// Quantizes and encodes `rows` (`n × channels`, row-major) into `out`.
    /// The bytes equal those of the same rows of a whole-matrix
    /// [`KvStore::quantize_with`](crate::KvStore::quantize_with). On error
    /// (non-finite input under [`NonFinite::Reject`], a value beyond the
    /// scale type, wrong buffer lengths) rows before the failing one are
    /// written and the rest are left as they were.
    pub fn encode_into(
        &mut self,
        rows: &[f32],
        out: RowBuffersMut<'_>,
        options: QuantizeOptions,
    ) -> Result<()> {
        let ch = self.channels;
        if !rows.len().is_multiple_of(ch) {
            return Err(KvQuantError::ShapeMismatch {
                what: "rows to encode",
                found: rows.len(),
                expected: rows.len().div_ceil(ch) * ch,
            });
        }
        let n = rows.len() / ch;
        let sizes = self.buffer_sizes(n);
        check_len("row bytes", sizes.data, out.data.len())?;
        check_len("scales", sizes.scales, out.scales.len())?;
        check_len("offsets", sizes.offsets, out.offsets.len())?;
        check_len(
            "scale check bytes",
            sizes.scale_checks,
            out.scale_checks.len(),
        )?;
        check_len(
            "offset check bytes",
            sizes.offset_checks,
            out.offset_checks.len(),
        )?;
        let (rb, width) = (self.row_bytes(), self.coding.scale_type().bytes());
        let g = self.groups;
        // Integer and codebook forms saturate under `Keep` as under `Clamp`;
        // float forms keep the bits.
        self.clamp = options.non_finite != NonFinite::Reject;
        self.keep = options.non_finite == NonFinite::Keep;
        self.written = ParamBound::default();
        for (r, row) in rows.chunks_exact(ch).enumerate() {
            let finite = all_finite(row);
            if options.non_finite == NonFinite::Reject
                && !finite
                && let Some(c) = row.iter().position(|x| !x.is_finite())
            {
                return Err(KvQuantError::NonFinite {
                    token: r,
                    channel: c,
                    value: row[c],
                });
            }
            self.encode_row(
                row,
                finite,
                &mut out.data[r * rb..][..rb],
                &mut out.scales[r * g * width..][..g * width],
                if out.offsets.is_empty() {
                    &mut []
                } else {
                    &mut out.offsets[r * g * width..][..g * width]
                },
            )?;
            if let Some(code) = self.meta {
                let cb = code.check_bytes();
                let words = out.scales[r * g * width..][..g * width].chunks_exact(width);
                let checks = out.scale_checks[r * g * cb..][..g * cb].chunks_exact_mut(cb);
                let ty = self.coding.scale_type();
                for (c, w) in checks.zip(words) {
                    let word = read_word(w);
                    c.copy_from_slice(&code.check(word).to_le_bytes()[..cb]);
                    self.written.widen_scale(int::from_bits(ty, word));
                }
                if !out.offsets.is_empty() {
                    let words = out.offsets[r * g * width..][..g * width].chunks_exact(width);
                    let checks = out.offset_checks[r * g * cb..][..g * cb].chunks_exact_mut(cb);
                    for (c, w) in checks.zip(words) {
                        let word = read_word(w);
                        c.copy_from_slice(&code.check(word).to_le_bytes()[..cb]);
                        self.written.widen_offset(int::from_bits(ty, word));
                    }
                }
            }
        }
        Ok(())
    }

    /// The range of the protected scales and offsets the last
    /// [`encode_into`](Self::encode_into) wrote (every row before a failing
    /// one; zero for forms whose metadata is unprotected).
    pub(crate) fn written(&self) -> ParamBound {
        self.written
    }

    /// One row: rotation, group parameters, codes, packing and the code.
    fn encode_row(
        &mut self,
        row: &[f32],
        finite: bool,
        data: &mut [u8],
        scales: &mut [u8],
        offsets: &mut [u8],
    ) -> Result<()> {
        let mut rotated = std::mem::take(&mut self.scratch.rotated);
        let result = self.encode_row_with(row, finite, &mut rotated, data, scales, offsets);
        self.scratch.rotated = rotated;
        result
    }

    #[inline(always)]
    fn encode_row_with(
        &mut self,
        row: &[f32],
        finite: bool,
        rotated: &mut Vec<f32>,
        data: &mut [u8],
        scales: &mut [u8],
        offsets: &mut [u8],
    ) -> Result<()> {
        let ty = self.coding.scale_type();
        let width = ty.bytes();
        let kind = self.coding.kind;
        let (row, finite) = match self.hadamard {
            Some(h) => (rotate_row(h, row, grow(rotated, row.len()))?, true),
            None => (row, finite),
        };
        if let Some(bytes) = kind.float_bytes() {
            return self.encode_float(kind, bytes, row, data);
        }
        let codes = self.coding.codes(self.channels);
        let s = &mut self.scratch;
        let params = grow(&mut s.params, self.groups);
        let levels = grow(&mut s.levels, codes);
        match kind {
            Kind::Asym(_) | Kind::Sym(_) if finite => {
                int_row(kind, ty, row, self.cpg, params, levels)?;
            }
            Kind::Asym(_) | Kind::Sym(_) | Kind::Nf4 | Kind::Fp8(_) => {
                row_params(kind, ty, row, finite, self.cpg, params)?;
                if finite {
                    levels_with(kind, row, self.cpg, params, levels);
                } else {
                    // Only under NonFinite::Clamp: saturate, then quantize.
                    let clean = grow(&mut s.sanitized, row.len());
                    for (c, &x) in clean.iter_mut().zip(row) {
                        *c = sanitize(x);
                    }
                    levels_with(kind, clean, self.cpg, params, levels);
                }
            }
            Kind::LloydMax { bits, qjl } => {
                let n = if qjl { self.cpg } else { 0 };
                let signs = grow(&mut s.signs, n);
                let residual = grow(&mut s.residual, n);
                lloyd_max_row(bits, ty, row, self.cpg, params, levels, signs, residual)?;
            }
            Kind::Vq { dim } => {
                let codebook = self.codebook.as_ref().expect("vq encoders hold a codebook");
                // A non-finite cq row (under Clamp) saturates as rotated ones do.
                let row = if finite {
                    row
                } else {
                    let clean = grow(&mut s.sanitized, row.len());
                    clean.copy_from_slice(row);
                    for block in clean.chunks_exact_mut(self.cpg) {
                        clamp_block(block);
                    }
                    &*clean
                };
                let saturate = self.clamp;
                vq_row(codebook, (dim, ty, saturate), row, self.cpg, params, levels)?;
            }
            Kind::F32 | Kind::F16 | Kind::Bf16 | Kind::LowRank => {
                unreachable!("float forms handled above; sections refuse low-rank forms")
            }
        }
        for (p, w) in params.iter().zip(scales.chunks_exact_mut(width)) {
            w.copy_from_slice(&int::to_bits(ty, p.0).to_le_bytes()[..width]);
        }
        for (p, w) in params.iter().zip(offsets.chunks_exact_mut(width)) {
            w.copy_from_slice(&int::to_bits(ty, p.1).to_le_bytes()[..width]);
        }
        emit_levels(&self.coding, levels, data, &mut s.packed, &mut s.nibbles)
    }

    fn encode_float(
        &mut self,
        kind: Kind,
        bytes: usize,
        row: &[f32],
        data: &mut [u8],
    ) -> Result<()> {
        let packed = grow(&mut self.scratch.packed, bytes * self.channels);
        float_codes(kind, row, packed, self.clamp, self.keep)?;
        if self.coding.codec().is_none() {
            data.copy_from_slice(packed);
            return Ok(());
        }
        let packed = &self.scratch.packed[..bytes * self.channels];
        let count = self.coding.nibbles(self.channels);
        encode_nibbles(&self.coding, packed, count, data, &mut self.scratch.nibbles)
    }
}

/// Saturates the non-finite values of a block about to be rotated: NaN to
/// 0, ±∞ to ± the block's largest finite magnitude.
fn clamp_block(block: &mut [f32]) {
    if block.iter().all(|x| x.is_finite()) {
        return;
    }
    let top = block
        .iter()
        .filter(|x| x.is_finite())
        .fold(0.0f32, |m, x| m.max(x.abs()));
    let top = if top > 0.0 { top } else { ROTATED_CLAMP };
    for x in block.iter_mut() {
        if x.is_nan() {
            *x = 0.0;
        } else if x.is_infinite() {
            *x = top.copysign(*x);
        }
    }
}

/// Rotates whole rows in place (see [`rotate_row`]).
pub(crate) fn rotate_rows(h: &Hadamard, rows: &mut [f32]) -> Result<()> {
    let original = rows.to_vec();
    rotate_row(h, &original, rows).map(|_| ())
}

/// Rotates `row` into `y`, saturating non-finite input first (it only gets
/// here under [`NonFinite::Clamp`]); a rotated value beyond f32 is an error.
fn rotate_row<'y>(h: &Hadamard, row: &[f32], y: &'y mut [f32]) -> Result<&'y [f32]> {
    y.copy_from_slice(row);
    for block in y.chunks_exact_mut(h.block()) {
        clamp_block(block);
    }
    h.rotate(y);
    if let Some(i) = y.iter().position(|v| !v.is_finite()) {
        return Err(KvQuantError::OutOfRange {
            what: "rotated value",
            value: f64::from(row[i]),
            dtype: "f32",
            max: f64::from(f32::MAX),
        });
    }
    Ok(y)
}

pub(crate) fn sanitize(x: f32) -> f32 {
    if x.is_nan() {
        0.0
    } else if x.is_infinite() {
        f32::MAX.copysign(x)
    } else {
        x
    }
}

/// The little-endian bits of each value of a float form; with `keep`, the
/// IEEE conversion of every value, NaN and infinities included; otherwise
/// non-finite values are sanitized and values beyond the format saturate
/// when `clamp` is set and are errors if not.
fn float_codes(kind: Kind, row: &[f32], out: &mut [u8], clamp: bool, keep: bool) -> Result<()> {
    if keep {
        match kind {
            Kind::F32 => {
                for (o, &x) in out.chunks_exact_mut(4).zip(row) {
                    o.copy_from_slice(&x.to_le_bytes());
                }
            }
            Kind::F16 => {
                for (o, &x) in out.chunks_exact_mut(2).zip(row) {
                    o.copy_from_slice(&f16::from_f32(x).to_le_bytes());
                }
            }
            _ => {
                for (o, &x) in out.chunks_exact_mut(2).zip(row) {
                    o.copy_from_slice(&bf16::from_f32(x).to_le_bytes());
                }
            }
        }
        return Ok(());
    }
    let overflow = |x: f32, dtype: &'static str, max: f64| KvQuantError::OutOfRange {
        what: "input value",
        value: f64::from(x),
        dtype,
        max,
    };
    match kind {
        Kind::F32 => {
            for (o, &x) in out.chunks_exact_mut(4).zip(row) {
                o.copy_from_slice(&sanitize(x).to_le_bytes());
            }
        }
        Kind::F16 => {
            for (o, &x) in out.chunks_exact_mut(2).zip(row) {
                let h = f16::from_f32(sanitize(x));
                let h = if h.is_infinite() {
                    if !clamp {
                        return Err(overflow(x, "f16", f16::MAX.to_f64()));
                    }
                    f16::MAX.copysign(h)
                } else {
                    h
                };
                o.copy_from_slice(&h.to_le_bytes());
            }
        }
        _ => {
            for (o, &x) in out.chunks_exact_mut(2).zip(row) {
                let h = bf16::from_f32(sanitize(x));
                let h = if h.is_infinite() {
                    if !clamp {
                        return Err(overflow(x, "bf16", bf16::MAX.to_f64()));
                    }
                    bf16::MAX.copysign(h)
                } else {
                    h
                };
                o.copy_from_slice(&h.to_le_bytes());
            }
        }
    }
    Ok(())
}

fn rms(y: &[f32]) -> f32 {
    (y.iter().map(|v| v * v).sum::<f32>() / y.len() as f32).sqrt()
}

/// The stored gain of a block: the least-squares scale `⟨y, c⟩/⟨c, c⟩` of
/// the chosen unit-RMS reconstruction `c`, rounded to the scale type.
fn stored_gain(ty: ScaleType, y: &[f32], c: impl Iterator<Item = f32> + Clone) -> Result<f32> {
    let cc: f64 = c.clone().map(|v| f64::from(v) * f64::from(v)).sum();
    let yc: f64 = y
        .iter()
        .zip(c)
        .map(|(a, b)| f64::from(*a) * f64::from(b))
        .sum();
    if cc <= 0.0 || yc == 0.0 {
        return Ok(0.0);
    }
    int::round_to(ty, yc / cc, Toward::Nearest, "gain")
}

/// [`stored_gain`], held at the scale type's largest finite value where
/// `saturate` (a row a fault made huge, under [`NonFinite::Clamp`]).
fn saturated_gain(
    ty: ScaleType,
    y: &[f32],
    c: impl Iterator<Item = f32> + Clone,
    saturate: bool,
) -> Result<f32> {
    match stored_gain(ty, y, c) {
        Err(KvQuantError::OutOfRange { value, max, .. }) if saturate && !value.is_nan() => {
            Ok((max as f32).copysign(value as f32))
        }
        other => other,
    }
}

/// One rotated row of a Lloyd-Max form: per block the gain (and QJL
/// residual norm), the centroid indices with the QJL sign in the top bit.
/// `signs` and `residual` hold a block each for QJL forms and are empty
/// otherwise.
#[allow(clippy::too_many_arguments)]
fn lloyd_max_row(
    bits: u8,
    ty: ScaleType,
    row: &[f32],
    block: usize,
    params: &mut [(f32, f32)],
    levels: &mut [u8],
    signs: &mut [u8],
    residual: &mut [f32],
) -> Result<()> {
    let qjl = !signs.is_empty();
    let lm = LloydMax::of(bits);
    let table = lm.centroids();
    for ((y, lv), p) in row
        .chunks_exact(block)
        .zip(levels.chunks_exact_mut(block))
        .zip(params.iter_mut())
    {
        let r = rms(y);
        if r > 0.0 {
            let inv = 1.0 / r;
            for (l, &v) in lv.iter_mut().zip(y) {
                *l = lm.index(v * inv);
            }
        } else {
            lv.fill(0);
        }
        let gain = if r > 0.0 {
            stored_gain(ty, y, lv.iter().map(|&l| table[usize::from(l)]))?
        } else {
            0.0
        };
        let mut residual_norm = 0.0;
        if qjl {
            let sketch = QjlSketch::of(block);
            // The residual against what the decoder will rebuild.
            let res = &mut *residual;
            for ((o, &v), &l) in res.iter_mut().zip(y).zip(lv.iter()) {
                *o = v - gain * table[usize::from(l)];
            }
            let norm = res
                .iter()
                .map(|v| f64::from(*v) * f64::from(*v))
                .sum::<f64>()
                .sqrt();
            residual_norm = int::round_to(ty, norm, Toward::Nearest, "residual norm")?;
            sketch.signs(res, signs);
            for (l, &s) in lv.iter_mut().zip(signs.iter()) {
                *l |= s << bits;
            }
        }
        *p = (gain, residual_norm);
    }
    Ok(())
}

/// One row of a vq form (rotated) or cq form: per gain block the gain and
/// the index of every group of `dim` coordinates.
fn vq_row(
    codebook: &VqCodebook,
    (dim, ty, saturate): (usize, ScaleType, bool),
    row: &[f32],
    block: usize,
    params: &mut [(f32, f32)],
    levels: &mut [u8],
) -> Result<()> {
    let per_block = block / dim;
    let mut unit = [0f32; 8];
    for (b, ((y, lv), p)) in row
        .chunks_exact(block)
        .zip(levels.chunks_exact_mut(per_block))
        .zip(params.iter_mut())
        .enumerate()
    {
        let r = rms(y);
        if r == 0.0 {
            lv.fill(0);
            *p = (0.0, 0.0);
            continue;
        }
        let inv = 1.0 / r;
        for (j, (l, g)) in lv.iter_mut().zip(y.chunks_exact(dim)).enumerate() {
            for (u, &v) in unit.iter_mut().zip(g) {
                *u = v * inv;
            }
            *l = codebook.nearest(codebook.codebook_of(b, j), &unit[..dim]);
        }
        let chosen = lv.iter().enumerate().flat_map(|(j, &l)| {
            codebook
                .centroid(codebook.codebook_of(b, j), l)
                .iter()
                .copied()
        });
        *p = (saturated_gain(ty, y, chosen, saturate)?, 0.0);
    }
    Ok(())
}

/// Packs one code per entry of `levels` into the row and, for protected
/// forms, encodes it.
pub(crate) fn emit_levels(
    coding: &Coding,
    levels: &[u8],
    data: &mut [u8],
    packed: &mut Vec<u8>,
    nibbles: &mut Vec<u8>,
) -> Result<()> {
    let bits = coding.code_bits as u8;
    match coding.codec() {
        None => {
            int::pack_row(bits, levels, data);
            Ok(())
        }
        Some(codec) if coding.nibbles_are_levels() => Ok(codec.encode_into(levels, data)?),
        Some(_) => {
            let n = int::packed_row_bytes(bits, levels.len());
            let p = grow(packed, n);
            int::pack_row(bits, levels, p);
            let count = (coding.code_bits as usize * levels.len()).div_ceil(4);
            encode_nibbles(coding, &packed[..n], count, data, nibbles)
        }
    }
}

/// Encodes the first `count` nibbles of a packed code stream with the form's code.
fn encode_nibbles(
    coding: &Coding,
    packed: &[u8],
    count: usize,
    data: &mut [u8],
    nibbles: &mut Vec<u8>,
) -> Result<()> {
    let codec = coding.codec().expect("protected forms only");
    let nb = grow(nibbles, count);
    super::bits::bytes_to_nibbles(packed, nb);
    Ok(codec.encode_into(nb, data)?)
}

/// Whole-matrix quantization into a new section: row-local forms run the
/// row encoder over every row; forms with metadata shared across tokens
/// compute it over the matrix first.
pub(crate) fn quantize_section(
    coding: Coding,
    data: &[f32],
    tokens: usize,
    channels: usize,
    codebook: Option<Arc<VqCodebook>>,
    options: QuantizeOptions,
) -> Result<Section> {
    let mut section = Section::empty(coding, tokens, channels, codebook.clone())?;
    if tokens == 0 {
        return Ok(section);
    }
    let shared = coding.form.token_block() != Some(1);
    if !shared {
        let mut encoder = RowEncoder::for_coding(coding, channels, codebook)?;
        let sizes = encoder.buffer_sizes(tokens);
        let split = sizes.scale_checks.min(section.checks.len());
        let (scale_checks, offset_checks) = section.checks.split_at_mut(split);
        encoder.encode_into(
            data,
            RowBuffersMut {
                data: &mut section.data,
                scales: &mut section.scales,
                offsets: &mut section.offsets,
                scale_checks,
                offset_checks,
            },
            options,
        )?;
        section.bound = encoder.written();
        return Ok(section);
    }
    // Shared metadata: per-channel, per-tensor integer and FP8 forms
    // (never rotated by a block of their own, but they may be +rot).
    let layout = section.layout.expect("scaled forms have groups");
    let ty = coding.scale_type();
    let kind = coding.kind;
    let rotated;
    let data = match coding.hadamard()? {
        Some(h) => {
            let mut y = vec![0.0; data.len()];
            rotate_row(h, data, &mut y)?;
            rotated = y;
            &rotated[..]
        }
        None => data,
    };
    let params: Vec<(f32, f32)> = shared_ranges(&layout, data, channels)
        .into_iter()
        .map(|(lo, hi)| group_params(kind, ty, lo, hi))
        .collect::<Result<_>>()?;
    let width = ty.bytes();
    for (g, &(a, b)) in params.iter().enumerate() {
        section.scales[g * width..][..width]
            .copy_from_slice(&int::to_bits(ty, a).to_le_bytes()[..width]);
        if coding.has_offsets() {
            section.offsets[g * width..][..width]
                .copy_from_slice(&int::to_bits(ty, b).to_le_bytes()[..width]);
        }
    }
    if let Some(code) = coding.meta_code() {
        let cb = code.check_bytes();
        let checks: Vec<u8> = section
            .scales
            .chunks_exact(width)
            .chain(section.offsets.chunks_exact(width))
            .flat_map(|w| code.check(read_word(w)).to_le_bytes().into_iter().take(cb))
            .collect();
        section.checks = checks;
        section.bound = ParamBound::of_words(ty, &section.scales, &section.offsets);
    }
    let sanitized: Vec<f32>;
    let data = if all_finite(data) {
        data
    } else {
        sanitized = data.iter().map(|&x| sanitize(x)).collect();
        &sanitized
    };
    let cpg = layout.channels_per_group;
    let (mut levels, mut packed, mut nibbles) = (vec![0u8; channels], Vec::new(), Vec::new());
    let rb = section.row_bytes;
    for (t, row) in data.chunks_exact(channels).enumerate() {
        let base = layout.group(t, 0);
        let row_params = &params[base..][..layout.groups_per_block];
        if cpg == 1 {
            for ((l, &x), &(a, b)) in levels.iter_mut().zip(row).zip(row_params) {
                levels_of_group(
                    kind,
                    std::slice::from_ref(&x),
                    std::slice::from_mut(l),
                    a,
                    b,
                );
            }
        } else {
            levels_with(kind, row, cpg, row_params, &mut levels);
        }
        emit_levels(
            &coding,
            &levels,
            &mut section.data[t * rb..][..rb],
            &mut packed,
            &mut nibbles,
        )?;
    }
    Ok(section)
}

/// Finite minimum and maximum of every group of a shared-metadata layout.
fn shared_ranges(layout: &GroupLayout, data: &[f32], channels: usize) -> Vec<(f32, f32)> {
    let mut ranges = vec![(f32::INFINITY, f32::NEG_INFINITY); layout.groups()];
    let cpg = layout.channels_per_group;
    for (t, row) in data.chunks_exact(channels).enumerate() {
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
