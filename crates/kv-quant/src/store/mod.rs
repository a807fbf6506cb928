//! [`KvStore`]: one K or V matrix (`tokens × channels`, row-major f32) held in
//! a [`CacheForm`], with seeded fault injection and decoding back to f32,
//! tile by tile or whole, with erasure recovery and exact statistics.
//!
//! # Canonical byte layout
//! A store is one [section](section) of rows in the form's coding, or, for
//! forms with `+sink`/`+win`, the quantized middle rows and an f16 section
//! holding the exact sink rows followed by the exact window rows. A section
//! holds up to four buffers, and [`KvStore::stored_bytes`] is the sum of
//! their lengths over the sections:
//! - **values** (`data`): token rows of [`row_bytes`](KvStore::row_bytes) bytes each,
//!   the row's codes packed into a little-endian bit stream (code `j` at
//!   bits `[b·j, b·j+b)`; see [`crate::int`]'s layout):
//!   - `fp32`/`fp16`/`bf16`: little-endian elements.
//!   - `fp8-*`: one FP8 code per value ([`Fp8Format`](crate::Fp8Format)).
//!   - `int*`, `nf4`, `lm*`: one level per value (`lm*+qjl`: the QJL sign
//!     in the bit above the level).
//!   - `vq`: one centroid index per `dim` values.
//!   - `+hamming74`, `+secded84`, `+golay24`: the row's bit stream taken a
//!     nibble at a time and encoded on its own by the gf2-codes batch codec
//!     ([`gf2_codes::batch`]): SECDED one byte per nibble, Hamming(7,4) eight
//!     codewords per 7 bytes with the row's last byte padded, Golay three
//!     nibbles per 3 bytes with the row's last triple zero-padded. No
//!     codeword spans two tokens; for 4-bit codes the nibbles are the codes.
//! - **scales**: one little-endian f16 or f32 per group ([`GroupLayout`]);
//!   the integer scale, the NF4 absmax, the FP8 scale (always f32), or the
//!   gain of a Lloyd-Max or VQ rotation block.
//! - **offsets**: asymmetric integer forms (the offset) and QJL forms (the
//!   residual norm) only, one per group, same type.
//! - **checks**: forms with protected metadata ([`MetaProtection`](crate::MetaProtection))
//!   only: one check word ([`MetaCode`](crate::MetaCode); one byte under
//!   SECDED, two per 16 bits under RM(2,5)) per scale, then one per offset.
//!
//! Rotated forms store every row (exact ones too) in rotated coordinates;
//! [`KvStore::decode_rows_into`] rotates back, and
//! [`KvStore::decode_rows_rotated_into`] does not.
//!
//! # What is protected by default
//! Forms with a code protect the values (and exact rows) with that code and
//! the scales and offsets with a metadata code: SECDED check bytes under
//! Hamming values, RM(2,5) check words under SECDED and Golay values
//! (`+meta-secded`, `+meta-rm` choose, `+meta-none` turns it off); a
//! decoded word outside the range written ([`ParamBound`]) erases its
//! group. Forms without a code protect nothing. Faults can be injected into
//! the values and the metadata separately ([`FaultTarget`]).

mod bits;
mod bound;
mod decode;
mod encode;
mod erasure;
mod inject;
mod ledger;
mod levels;
mod row_range;
mod rows;
pub(crate) mod section;
mod view;
mod vq_codes;

pub use bound::ParamBound;
pub use decode::DecodeScratch;
pub use encode::{RowBufferSizes, RowBuffers, RowBuffersMut, RowEncoder};
pub use inject::{FaultTarget, Injection};
pub use rows::ScrubStats;
pub use view::{ChannelSlices, GatheredLevels, LevelMap, LevelPacking, LevelRows, RowsView};
pub use vq_codes::VqCodeRows;

use std::ops::Range;
use std::sync::Arc;

use gf2_codes::DecodeStats;
use gf2_codes::batch::erasure_words;

use crate::error::{KvQuantError, Result, check_len};
use crate::int;
use crate::layout::GroupLayout;
use crate::rotation::Hadamard;
use crate::spec::CacheForm;
use crate::vq::VqCodebook;
use bits::read_word;
use section::{Coding, Section};

/// What to do with NaN and infinite input values.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum NonFinite {
    /// Refuse the input with [`KvQuantError::NonFinite`] (the default).
    #[default]
    Reject,
    /// Saturate: NaN is stored as the representable value nearest 0, +∞ and
    /// −∞ as the largest and smallest representable value of the value's
    /// group (for fp16/bf16/fp32 the format's largest finite magnitude; for
    /// rotated forms, ± the block's largest finite magnitude before
    /// rotation). Finite inputs beyond an fp16 store's range saturate
    /// likewise. Group ranges and scales are computed from the finite values only.
    Clamp,
    /// Store them as the form stores numbers: float forms (fp32, fp16,
    /// bf16, and the exact rows of sinks, windows and staged blocks) keep
    /// NaN and the infinities, and a finite value beyond fp16's or bf16's
    /// range becomes an infinity, as the IEEE conversion gives it; every
    /// other form saturates as under [`Clamp`](Self::Clamp). For fault
    /// experiments on unprotected caches: a fault's NaN reaches attention
    /// and the model, and its outcome is measured instead of ending the run.
    Keep,
}

/// Options of [`KvStore::quantize_with`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct QuantizeOptions {
    /// NaN and infinity handling.
    pub non_finite: NonFinite,
}

/// Statistics of one decode (one tile or a whole matrix). Tile statistics add
/// up (`+=`) to those of one whole decode.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct KvDecodeStats {
    /// Per value codeword for coded forms, per stored code otherwise
    /// (one per value, or per group of `dim` values for `vq`).
    /// Unprotected codes always decode "clean"; with the truth known, the
    /// changed ones count as `silent`.
    pub values: DecodeStats,
    /// Per metadata word (each scale and each offset), counted in the tile
    /// holding the group's first token.
    pub metadata: DecodeStats,
    /// Values flagged as erased: their codeword or their group's metadata was
    /// detected as corrupted. The erasure policy decided what they became.
    pub erased_values: u64,
}

impl KvDecodeStats {
    /// The statistics a decoder without the store's ledger counts:
    /// [`DecodeStats::without_truth`] of both parts (the erasures are the
    /// same either way).
    #[must_use]
    pub fn without_truth(self) -> Self {
        Self {
            values: self.values.without_truth(),
            metadata: self.metadata.without_truth(),
            erased_values: self.erased_values,
        }
    }
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
    /// `c / 64` of row `t` set when value `(t, c)` was erased (for rotated
    /// forms: rotated coordinate `c`).
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

/// The exact sink and window rows of a segmented store.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Exact {
    /// Rows `0..sink` of the section are tokens `0..sink`; the rest are the window.
    pub(crate) sink: usize,
    pub(crate) section: Section,
}

/// Which section a run of tokens lives in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Piece {
    Middle,
    Exact,
}

/// Tokens of each segment of a store.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SegmentRows {
    /// The exact sink tokens.
    pub sink: Range<usize>,
    /// The quantized tokens.
    pub middle: Range<usize>,
    /// The exact window tokens.
    pub window: Range<usize>,
}

/// A quantized (and possibly ECC-protected) `tokens × channels` matrix.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvStore {
    form: CacheForm,
    tokens: usize,
    channels: usize,
    middle: Section,
    exact: Option<Box<Exact>>,
    injected: u64,
}

impl KvStore {
    /// Quantizes `data` (`tokens × channels`, row-major) into `form`,
    /// rejecting NaN and infinities.
    pub fn quantize(form: CacheForm, data: &[f32], tokens: usize, channels: usize) -> Result<Self> {
        Self::quantize_with(form, data, tokens, channels, QuantizeOptions::default())
    }

    /// Quantizes with explicit options. Forms with a fitted codebook (`vq`)
    /// need [`quantize_with_codebook`](Self::quantize_with_codebook).
    pub fn quantize_with(
        form: CacheForm,
        data: &[f32],
        tokens: usize,
        channels: usize,
        options: QuantizeOptions,
    ) -> Result<Self> {
        Self::build(form, data, tokens, channels, options, None)
    }

    /// Quantizes a `vq` form with the codebooks it is encoded against (the
    /// store keeps a reference; [`codebook`](Self::codebook)).
    pub fn quantize_with_codebook(
        form: CacheForm,
        data: &[f32],
        tokens: usize,
        channels: usize,
        options: QuantizeOptions,
        codebook: Arc<VqCodebook>,
    ) -> Result<Self> {
        Self::build(form, data, tokens, channels, options, Some(codebook))
    }

    fn build(
        form: CacheForm,
        data: &[f32],
        tokens: usize,
        channels: usize,
        options: QuantizeOptions,
        codebook: Option<Arc<VqCodebook>>,
    ) -> Result<Self> {
        crate::error::check_channels(channels)?;
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
        let rows = Self::segment_rows_of(&form, tokens);
        let middle_coding = Coding::of(form.without_segments());
        let middle = encode::quantize_section(
            middle_coding,
            &data[rows.middle.start * channels..rows.middle.end * channels],
            rows.middle.len(),
            channels,
            codebook,
            options,
        )?;
        let exact = if form.segments().is_empty() {
            None
        } else {
            let mut exact_rows: Vec<f32> =
                Vec::with_capacity((tokens - rows.middle.len()) * channels);
            exact_rows
                .extend_from_slice(&data[rows.sink.start * channels..rows.sink.end * channels]);
            exact_rows
                .extend_from_slice(&data[rows.window.start * channels..rows.window.end * channels]);
            if let Some(h) = middle_coding.hadamard()? {
                encode::rotate_rows(h, &mut exact_rows)?;
            }
            let n = exact_rows.len() / channels;
            let section = encode::quantize_section(
                Coding::of(form.exact_rows_form()),
                &exact_rows,
                n,
                channels,
                None,
                options,
            )?;
            Some(Box::new(Exact {
                sink: rows.sink.len(),
                section,
            }))
        };
        Ok(KvStore {
            form,
            tokens,
            channels,
            middle,
            exact,
            injected: 0,
        })
    }

    /// The sink, middle and window tokens of a store of `tokens` tokens in
    /// `form`: the first `sink` tokens, then whole token blocks (per-channel
    /// scales) as long as at least `window` tokens remain, then the rest.
    /// Without segments every token is in the middle.
    pub fn segment_rows_of(form: &CacheForm, tokens: usize) -> SegmentRows {
        let seg = form.segments();
        if seg.is_empty() {
            return SegmentRows {
                sink: 0..0,
                middle: 0..tokens,
                window: tokens..tokens,
            };
        }
        let s = seg.sink.min(tokens);
        let rest = tokens - s;
        let avail = rest - seg.window.min(rest);
        let m = match form.token_block() {
            Some(b) => avail / b * b,
            None => avail,
        };
        SegmentRows {
            sink: 0..s,
            middle: s..s + m,
            window: s + m..tokens,
        }
    }

    /// The sink, middle and window tokens of this store.
    pub fn segment_rows(&self) -> SegmentRows {
        Self::segment_rows_of(&self.form, self.tokens)
    }

    /// The pieces of rows `start..end` (global tokens): which section, the
    /// section's rows, and the offset of the piece in the range (no
    /// allocation: tile decoding goes through here).
    pub(crate) fn pieces(
        &self,
        start: usize,
        end: usize,
    ) -> impl Iterator<Item = (Piece, Range<usize>, usize)> + use<> {
        let mut out: [Option<(Piece, Range<usize>, usize)>; 3] = [None, None, None];
        match &self.exact {
            None => out[0] = Some((Piece::Middle, start..end, 0)),
            Some(exact) => {
                let rows = self.segment_rows();
                let parts = [
                    (Piece::Exact, rows.sink, 0),
                    (Piece::Middle, rows.middle, 0),
                    (Piece::Exact, rows.window, exact.sink),
                ];
                for (slot, (piece, seg, local0)) in out.iter_mut().zip(parts) {
                    let (a, b) = (start.max(seg.start), end.min(seg.end));
                    if a < b {
                        *slot = Some((
                            piece,
                            local0 + a - seg.start..local0 + b - seg.start,
                            a - start,
                        ));
                    }
                }
            }
        }
        out.into_iter().flatten()
    }

    fn section(&self, piece: Piece) -> &Section {
        match piece {
            Piece::Middle => &self.middle,
            Piece::Exact => &self.exact.as_ref().expect("segmented store").section,
        }
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

    /// Bytes of one token row in the value buffer of the quantized rows.
    pub fn row_bytes(&self) -> usize {
        self.middle.row_bytes
    }

    /// The metadata grouping of the quantized rows (`None` for fp32, fp16, bf16).
    pub fn layout(&self) -> Option<&GroupLayout> {
        self.middle.layout.as_ref()
    }

    /// The value buffer of the quantized rows (see the module docs for its layout).
    pub fn data(&self) -> &[u8] {
        &self.middle.data
    }

    /// The scales buffer.
    pub fn scales(&self) -> &[u8] {
        &self.middle.scales
    }

    /// The offsets buffer (asymmetric integer forms, QJL residual norms).
    pub fn offsets(&self) -> &[u8] {
        &self.middle.offsets
    }

    /// The metadata check words (forms with protected metadata): one per
    /// scale, then one per offset, each [`MetaCode::check_bytes`](crate::MetaCode::check_bytes) long.
    pub fn meta_checks(&self) -> &[u8] {
        &self.middle.checks
    }

    /// The f16 rows of the exact sink and window tokens (sink first), as
    /// stored (encoded by the form's code when it has one); empty without segments.
    pub fn exact_data(&self) -> &[u8] {
        self.exact.as_ref().map_or(&[], |e| &e.section.data)
    }

    /// The codebooks of a `vq` store.
    pub fn codebook(&self) -> Option<&Arc<VqCodebook>> {
        self.middle.codebook.as_ref()
    }

    /// Reads the rows through `codebook` from now on (the same codebooks
    /// read back through their [`ProtectedTable`](crate::ProtectedTable), faults and all); refused for a store
    /// without codebooks or codebooks of another shape.
    pub fn replace_codebook(&mut self, codebook: Arc<VqCodebook>) -> Result<()> {
        let fits = self.middle.codebook.as_ref().is_some_and(|c| {
            c.spec() == codebook.spec()
                && c.block() == codebook.block()
                && c.codebooks() == codebook.codebooks()
        });
        if !fits {
            return Err(KvQuantError::InvalidParameter {
                name: "codebook",
                reason: format!("{} has no codebooks of that shape to replace", self.form),
            });
        }
        self.middle.codebook = Some(codebook);
        Ok(())
    }

    /// The range of the scales and offsets written into the quantized rows
    /// ([`ParamBound`]): with protected metadata, a decoded word outside it
    /// erases its group. Zero for forms whose metadata is unprotected.
    pub fn param_bound(&self) -> ParamBound {
        self.middle.bound
    }

    /// Stored parameters of group `g` of the quantized rows as held (before
    /// any metadata decoding): `(scale, offset)` for integer forms (offset 0
    /// when symmetric), `(absmax, 0)` for NF4, `(scale, 0)` for FP8,
    /// `(gain, residual norm or 0)` for Lloyd-Max and VQ; `None` for forms
    /// without groups or `g` out of range.
    pub fn group_params(&self, g: usize) -> Option<(f32, f32)> {
        let m = &self.middle;
        let layout = m.layout.as_ref()?;
        if g >= layout.groups() {
            return None;
        }
        let ty = m.coding.scale_type();
        let width = ty.bytes();
        let read = |buffer: &[u8]| int::from_bits(ty, read_word(&buffer[g * width..][..width]));
        let offset = if m.offsets.is_empty() {
            0.0
        } else {
            read(&m.offsets)
        };
        Some((read(&m.scales), offset))
    }

    /// True storage: the summed length of every buffer held (a `vq` store's
    /// shared codebook not included; see [`bits_per_value`](Self::bits_per_value)).
    pub fn stored_bytes(&self) -> usize {
        self.middle.stored_bytes() + self.exact.as_ref().map_or(0, |e| e.section.stored_bytes())
    }

    /// Stored bits per value, metadata and any codebook included (`NaN`
    /// for an empty store).
    pub fn bits_per_value(&self) -> f64 {
        let codebook = self.codebook().map_or(0, |c| c.stored_bytes());
        (8 * (self.stored_bytes() + codebook)) as f64 / (self.tokens * self.channels) as f64
    }

    /// Bits flipped by [`inject`](Self::inject) since quantization.
    pub fn injected_flips(&self) -> u64 {
        self.injected
    }

    /// Decodes the whole matrix. The statistics are exact: words decoded
    /// wrong (miscorrected, or silently changed) are found from the store's
    /// fault ledger, the record of every bit faults changed since the rows
    /// were written, so no fault-free copy is needed.
    pub fn decode(&self) -> Result<DecodedMatrix> {
        let mut values = vec![0.0; self.tokens * self.channels];
        let ew = erasure_words(self.channels);
        let mut erased = vec![0; self.tokens * ew];
        let mut scratch = DecodeScratch::new();
        let mut stats = KvDecodeStats::default();
        for (piece, local, offset) in self.pieces(0, self.tokens) {
            if local.is_empty() {
                continue;
            }
            let n = local.len();
            let out = &mut values[offset * self.channels..][..n * self.channels];
            let section = self.section(piece);
            let mut s = section.decode_rows(local.start, local.end, out, &mut scratch, true)?;
            section.ledger_truth(local.start, local.end, &mut s, &mut scratch)?;
            stats += s;
            erased[offset * ew..][..n * ew].copy_from_slice(&scratch.erasures[..n * ew]);
        }
        self.unrotate(&mut values)?;
        Ok(DecodedMatrix {
            values,
            erased,
            stats,
            injected_flips: self.injected,
            channels: self.channels,
        })
    }

    /// Decodes tokens `start..start + count` into `out` (`count × channels`
    /// f32, row-major) without allocating once `scratch` has grown, applying
    /// the form's erasure policy and undoing its rotation. Values and
    /// statistics equal those of the same rows of a whole
    /// [`decode`](Self::decode): interpolation reads neighbours outside the
    /// tile straight from the store, and statistics count only this tile's words.
    pub fn decode_rows_into(
        &self,
        start: usize,
        count: usize,
        out: &mut [f32],
        scratch: &mut DecodeScratch,
    ) -> Result<KvDecodeStats> {
        let stats = self.decode_rows_impl(start, count, out, scratch)?;
        self.unrotate(out)?;
        Ok(stats)
    }

    /// [`decode_rows_into`](Self::decode_rows_into) without undoing the
    /// rotation: rotated coordinates for `+rot`, `lm` and `vq` forms (rotate
    /// a query by the same [`Hadamard`] to get the same dot products), the
    /// same values as `decode_rows_into` for every other form.
    pub fn decode_rows_rotated_into(
        &self,
        start: usize,
        count: usize,
        out: &mut [f32],
        scratch: &mut DecodeScratch,
    ) -> Result<KvDecodeStats> {
        self.decode_rows_impl(start, count, out, scratch)
    }

    /// The rotation of the form's codes, if any.
    pub fn rotation(&self) -> Result<Option<&'static Hadamard>> {
        self.middle.coding.hadamard()
    }

    fn unrotate(&self, values: &mut [f32]) -> Result<()> {
        if let Some(h) = self.rotation()? {
            h.unrotate(values);
        }
        Ok(())
    }

    fn decode_rows_impl(
        &self,
        start: usize,
        count: usize,
        out: &mut [f32],
        scratch: &mut DecodeScratch,
    ) -> Result<KvDecodeStats> {
        let end = self.row_end(start, count)?;
        check_len("output tile", count * self.channels, out.len())?;
        let ch = self.channels;
        let mut stats = KvDecodeStats::default();
        for (piece, local, offset) in self.pieces(start, end) {
            let n = local.len();
            let section = self.section(piece);
            let out = &mut out[offset * ch..][..n * ch];
            let mut s = section.decode_rows(local.start, local.end, out, scratch, true)?;
            section.ledger_truth(local.start, local.end, &mut s, scratch)?;
            stats += s;
        }
        Ok(stats)
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
        let plain_fp16 = matches!(self.form.quantizer(), crate::spec::Quantizer::Fp16)
            && self.form.protection().is_none();
        if !plain_fp16 {
            return Ok(None);
        }
        let end = self.row_end(start, count)?;
        let words = (count * self.channels) as u64;
        let mut stats = KvDecodeStats::default();
        stats.values.words = words;
        stats.values.clean = words;
        if self.middle.ledger.is_some() {
            // Unprotected: the ledger needs no decode buffers.
            self.middle
                .ledger_truth(start, end, &mut stats, &mut DecodeScratch::new())?;
        }
        let rb = self.middle.row_bytes;
        Ok(Some((&self.middle.data[start * rb..end * rb], stats)))
    }

    /// `start + count`, or [`KvQuantError::RowRange`] unless `0 < count` and
    /// the rows are inside the store.
    pub(crate) fn row_end(&self, start: usize, count: usize) -> Result<usize> {
        start
            .checked_add(count)
            .filter(|&e| e <= self.tokens && count > 0)
            .ok_or(KvQuantError::RowRange {
                start,
                end: start.saturating_add(count),
                tokens: self.tokens,
            })
    }
}
