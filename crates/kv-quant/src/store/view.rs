//! Decoding rows of an integer form up to, but not including, the step that
//! turns levels into values: [`KvStore::decode_rows_view`] returns the
//! levels (ECC-decoded where protected) and the group parameters as a
//! [`LevelRows`], so a reader can dequantize in registers instead of
//! writing an f32 tile and reading it back. [`LevelRows::value`] and
//! [`LevelRows::dequantize_into`] give exactly what
//! [`KvStore::decode_rows_rotated_into`] writes (which is what
//! [`KvStore::decode_rows_into`] writes for forms without rotation).
//! [`KvStore::decode_rows_view_packed`] also leaves unprotected 4-bit levels
//! as stored, two per byte ([`LevelPacking::Nibbles`]), for readers that
//! unpack them in registers.

use gf2_codes::batch::erasure_words;

use super::decode::{DecodeScratch, grow};
use super::section::Section;
use super::{KvDecodeStats, KvStore, Piece};
use crate::error::Result;

/// How a level becomes a value in a group with scale `a` and offset `b`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum LevelMap {
    /// Asymmetric integer forms: `b + level · a` (the product rounded to
    /// f32, then the sum: no fused multiply-add).
    Affine,
    /// Symmetric integer forms: `(level − mid) · a`, with `mid = 2^(bits−1)`.
    Centered {
        /// The level that stands for zero.
        mid: f32,
    },
    /// FP8 codes: `value(code) · a`, the OCP value of the code
    /// ([`Fp8Format::decode`](crate::Fp8Format::decode)) times the group scale.
    Fp8(crate::Fp8Format),
    /// NF4 codes: `NF4_LEVELS[code & 15] · a` ([`NF4_LEVELS`](crate::NF4_LEVELS)).
    Nf4,
    /// Codes of a scalar codebook of at most 16 entries: `table[code] · a`,
    /// codes below the codebook's size (the Lloyd-Max forms `lm1` to `lm4`
    /// without QJL, [`LloydMax::padded16`](crate::LloydMax::padded16)).
    Codebook(&'static [f32; 16]),
}

impl LevelMap {
    /// The 16-entry table of a map that looks its values up
    /// ([`Nf4`](Self::Nf4), [`Codebook`](Self::Codebook)), so a kernel reads
    /// both through one register lookup; `None` for the others.
    pub fn table16(&self) -> Option<&'static [f32; 16]> {
        match *self {
            LevelMap::Nf4 => Some(&crate::nf4::NF4_LEVELS),
            LevelMap::Codebook(table) => Some(table),
            _ => None,
        }
    }
}

/// How [`LevelRows::levels`] holds its levels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LevelPacking {
    /// One level (or FP8 code) per byte.
    Bytes,
    /// Two 4-bit levels per byte, the even channel in the low nibble: the
    /// stored rows of unprotected 4-bit forms, read in place
    /// ([`KvStore::decode_rows_view_packed`]).
    Nibbles,
}

/// Levels (integer levels or FP8 codes) of rows `start..start + count` and
/// the parameters of their groups.
#[derive(Clone, Copy, Debug)]
pub struct LevelRows<'s> {
    section: &'s Section,
    start: usize,
    /// The levels, `count × channels`, row-major, packed as
    /// [`packing`](Self::packing) says.
    pub levels: &'s [u8],
    /// One level per byte, or two ([`LevelPacking::Nibbles`]: only from
    /// [`KvStore::decode_rows_view_packed`]).
    pub packing: LevelPacking,
    /// Scale of each group touched by the rows, from the first one
    /// ([`group_index`](Self::group_index) maps a value to its group).
    pub scale: &'s [f32],
    /// Offset of each group (zeros for symmetric forms).
    pub offset: &'s [f32],
    /// How a level becomes a value.
    pub map: LevelMap,
}

impl<'s> LevelRows<'s> {
    /// Rows held.
    pub fn rows(&self) -> usize {
        self.levels.len() / self.row_bytes()
    }

    /// Bytes of [`levels`](Self::levels) per row.
    pub fn row_bytes(&self) -> usize {
        match self.packing {
            LevelPacking::Bytes => self.section.channels,
            LevelPacking::Nibbles => self.section.channels / 2,
        }
    }

    /// The level of `channel` in row `row`.
    #[inline]
    pub fn level(&self, row: usize, channel: usize) -> u8 {
        match self.packing {
            LevelPacking::Bytes => self.levels[row * self.channels() + channel],
            LevelPacking::Nibbles => {
                let byte = self.levels[row * self.row_bytes() + channel / 2];
                (byte >> (4 * (channel % 2))) & 0xF
            }
        }
    }

    /// These rows with one level per byte: `self` where it already is,
    /// or its levels unpacked into `buffer`.
    pub fn unpacked<'b>(&self, buffer: &'b mut Vec<u8>) -> LevelRows<'b>
    where
        's: 'b,
    {
        if self.packing == LevelPacking::Bytes {
            return *self;
        }
        let n = self.rows() * self.channels();
        buffer.resize(n, 0);
        crate::simd::unpack_nibbles(self.levels, buffer);
        LevelRows {
            levels: &buffer[..n],
            packing: LevelPacking::Bytes,
            ..*self
        }
    }

    /// Channels per row.
    pub fn channels(&self) -> usize {
        self.section.channels
    }

    /// Consecutive channels of a row sharing one group (1 for per-channel
    /// groups, the whole row for per-token ones).
    pub fn channels_per_group(&self) -> usize {
        self.layout().channels_per_group
    }

    /// The largest level a value can hold (`2^bits − 1`, 255 for FP8 codes).
    pub fn max_level(&self) -> u8 {
        ((1u32 << self.section.coding.code_bits.min(8)) - 1) as u8
    }

    /// Consecutive tokens sharing one group (1 for per-token groups).
    pub fn tokens_per_group(&self) -> usize {
        self.layout().tokens_per_block
    }

    /// The index into [`scale`](Self::scale) and [`offset`](Self::offset) of
    /// the group holding channel `channel` of row `row` (counted from the
    /// first row held). Within a row, it is `group_index(row, 0) +
    /// channel / channels_per_group()`.
    #[inline]
    pub fn group_index(&self, row: usize, channel: usize) -> usize {
        let layout = self.layout();
        layout.group(self.start + row, channel) - layout.group(self.start, 0)
    }

    /// Rows `first..first + count` of these (panics outside them).
    pub fn sub_rows(&self, first: usize, count: usize) -> Self {
        assert!(
            first + count <= self.rows() && count > 0,
            "sub_rows: rows out of range"
        );
        let base = self.group_index(first, 0);
        let rb = self.row_bytes();
        let layout = self.layout();
        let groups = layout
            .groups_of_rows(self.start + first, self.start + first + count)
            .len();
        Self {
            section: self.section,
            start: self.start + first,
            levels: &self.levels[first * rb..][..count * rb],
            packing: self.packing,
            scale: &self.scale[base..][..groups],
            offset: &self.offset[base..][..groups],
            map: self.map,
        }
    }

    /// The value of `(row, channel)`, as the decode gives it.
    #[inline]
    pub fn value(&self, row: usize, channel: usize) -> f32 {
        let g = self.group_index(row, channel);
        let level = self.level(row, channel);
        self.section
            .coding
            .kind
            .dequant(level, self.scale[g], self.offset[g])
    }

    /// Writes every value (`rows × channels`), as the decode does. Packed
    /// levels are unpacked a few rows at a time into a stack buffer (into
    /// the heap only for rows of more than 4,096 channels).
    ///
    /// # Panics
    /// If `out` does not hold `rows × channels` values.
    pub fn dequantize_into(&self, out: &mut [f32]) {
        const STACK: usize = 4096;
        let ch = self.channels();
        assert_eq!(
            out.len(),
            self.rows() * ch,
            "dequantize_into: output length"
        );
        if self.packing == LevelPacking::Nibbles && ch <= STACK {
            let mut bytes = [0u8; STACK];
            let per = STACK / ch;
            for (first, out) in (0..self.rows()).step_by(per).zip(out.chunks_mut(per * ch)) {
                let rows = self.sub_rows(first, out.len() / ch);
                crate::simd::unpack_nibbles(rows.levels, &mut bytes[..out.len()]);
                rows.dequantize_levels(out, &bytes[..out.len()]);
            }
            return;
        }
        let mut buffer = Vec::new();
        let rows = self.unpacked(&mut buffer);
        rows.dequantize_levels(out, rows.levels);
    }

    /// Writes these rows' values from `levels`, one per byte.
    fn dequantize_levels(&self, out: &mut [f32], levels: &[u8]) {
        let end = self.start + self.rows();
        let params = (self.scale, self.offset);
        crate::simd::with_avx2(|| {
            self.section
                .dequantize(self.start, end, out, levels, params);
        });
    }

    #[inline]
    fn layout(&self) -> &crate::layout::GroupLayout {
        self.section
            .layout
            .as_ref()
            .expect("level forms have groups")
    }
}

/// Rows of a store as [`KvStore::decode_rows_view`] returns them, in the
/// store's rotated coordinates for rotated forms.
#[derive(Clone, Copy, Debug)]
pub enum RowsView<'s> {
    /// Levels and group parameters, to be turned into values by the reader.
    Levels(LevelRows<'s>),
    /// Values, decoded into the scratch: the float (FP32, FP16, BF16),
    /// Lloyd-Max and VQ forms, rows of the exact sink and window, and rows
    /// holding erased values (the erasure policy needs the values of their
    /// neighbours).
    Values(&'s [f32]),
}

impl KvStore {
    /// Decodes rows `start..start + count` as far as the form allows
    /// without writing values: for integer forms with no erased value in
    /// these rows (all of them quantized), the levels and the group
    /// parameters ([`RowsView::Levels`]); otherwise the values
    /// ([`RowsView::Values`]). Either way values and statistics equal those
    /// of [`decode_rows_rotated_into`](Self::decode_rows_rotated_into).
    pub fn decode_rows_view<'s>(
        &'s self,
        start: usize,
        count: usize,
        scratch: &'s mut DecodeScratch,
    ) -> Result<(RowsView<'s>, KvDecodeStats)> {
        self.rows_view(start, count, scratch, false)
    }

    /// [`decode_rows_view`](Self::decode_rows_view), except that the levels
    /// of unprotected 4-bit forms (`int4`, `int4-ch`, NF4, in rows without
    /// padding) are the stored bytes, two per byte
    /// ([`LevelPacking::Nibbles`]), read in place without being unpacked.
    /// Other forms, and rows with an erased value, read as
    /// [`decode_rows_view`](Self::decode_rows_view) reads them.
    pub fn decode_rows_view_packed<'s>(
        &'s self,
        start: usize,
        count: usize,
        scratch: &'s mut DecodeScratch,
    ) -> Result<(RowsView<'s>, KvDecodeStats)> {
        self.rows_view(start, count, scratch, true)
    }

    fn rows_view<'s>(
        &'s self,
        start: usize,
        count: usize,
        scratch: &'s mut DecodeScratch,
        keep_nibbles: bool,
    ) -> Result<(RowsView<'s>, KvDecodeStats)> {
        let end = self.row_end(start, count)?;
        let n = count * self.channels;
        let map = self.middle.coding.kind.level_map();
        let mut pieces = self.pieces(start, end);
        let whole_middle = match (pieces.next(), pieces.next()) {
            (Some((Piece::Middle, range, _)), None) => Some(range),
            _ => None,
        };
        let (Some(map), Some(local)) = (map, whole_middle) else {
            let mut values = std::mem::take(&mut scratch.values);
            let stats = self.decode_rows_rotated_into(start, count, grow(&mut values, n), scratch);
            scratch.values = values;
            return Ok((RowsView::Values(&scratch.values[..n]), stats?));
        };
        let section = &self.middle;
        let in_place = keep_nibbles && section.nibbles_in_place();
        let mut stats = section.decode_codes(local.start, local.end, scratch, in_place)?;
        section.ledger_truth(local.start, local.end, &mut stats, scratch)?;
        let rb = section.row_bytes;
        let stored = &section.data[local.start * rb..local.end * rb];
        // Rows read in place have no code to erase a value (and so never
        // need `scratch.levels`, which they leave unwritten).
        debug_assert!(!in_place || stats.erased_values == 0);
        if stats.erased_values > 0 {
            let mut values = std::mem::take(&mut scratch.values);
            let out = grow(&mut values, n);
            let params = (scratch.scale.as_slice(), scratch.offset.as_slice());
            section.dequantize(local.start, local.end, out, &scratch.levels, params);
            section.apply_policy(local.start, local.end, out, scratch)?;
            scratch.values = values;
            return Ok((RowsView::Values(&scratch.values[..n]), stats));
        }
        let groups = section
            .layout
            .as_ref()
            .expect("level forms have groups")
            .groups_of_rows(local.start, local.end)
            .len();
        let (levels, packing): (&[u8], _) = if in_place {
            (stored, LevelPacking::Nibbles)
        } else if section.coding.code_bits == 8 && section.coding.codec().is_none() {
            (stored, LevelPacking::Bytes)
        } else {
            (&scratch.levels[..n], LevelPacking::Bytes)
        };
        debug_assert_eq!(levels.len(), if in_place { n / 2 } else { n });
        debug_assert!(scratch.erasures.len() >= count * erasure_words(self.channels));
        let rows = LevelRows {
            section,
            start: local.start,
            levels,
            packing,
            scale: &scratch.scale[..groups],
            offset: &scratch.offset[..groups],
            map,
        };
        Ok((RowsView::Levels(rows), stats))
    }

    /// Whether rows with no erased value read as levels
    /// ([`RowsView::Levels`]) in groups of one token each, so that rows
    /// read from different places can be set side by side
    /// ([`GatheredLevels`]): the integer, NF4 and per-token FP8 forms,
    /// protected or not.
    pub fn reads_levels_per_token(&self) -> bool {
        self.gathers_levels_in_blocks(1)
    }

    /// Whether rows with no erased value read as levels whose groups lie
    /// within blocks of `block` tokens (groups of one token, or groups
    /// along tokens of a divisor of `block`: per-channel `int4-ch<G>`
    /// blocks), so that whole blocks read from different places can be
    /// set side by side ([`GatheredLevels`]); `false` for blocks of no
    /// tokens.
    pub fn gathers_levels_in_blocks(&self, block: usize) -> bool {
        block > 0
            && self.middle.coding.kind.level_map().is_some()
            && self
                .middle
                .layout
                .as_ref()
                .is_some_and(|l| block.is_multiple_of(l.tokens_per_block))
    }
}

/// Level rows read from several places of one store (each a
/// [`RowsView::Levels`] of [`KvStore::decode_rows_view`] or
/// [`KvStore::decode_rows_view_packed`]), copied side by side with their
/// group parameters, to be read as one view: a paged cache's tile over
/// pages that are not adjacent. Per-token groups make a row's parameters
/// its own; groups along tokens (per-channel `int4-ch<G>` blocks) are
/// pushed whole, so that each group's parameters follow its rows: the
/// first push may start inside its group and the last end inside one, and
/// every push between starts and ends at a group's edge. Either way the
/// view gives each row the values its own view gave. Only
/// views can be pushed, so the levels are always ones the store's decoder
/// wrote (no level above the form's largest). The view is packed as the
/// first rows pushed were; later rows packed two per byte are unpacked
/// to match one per byte.
#[derive(Clone, Debug, Default)]
pub struct GatheredLevels {
    levels: Vec<u8>,
    packing: Option<LevelPacking>,
    scale: Vec<f32>,
    offset: Vec<f32>,
    /// The section the rows came from (its address, form and channels),
    /// while any are held.
    section: Option<(usize, crate::CacheForm, usize)>,
    /// Groups along tokens: where the first row held lies in its group
    /// (the view's first row), and whether the last push ended inside its
    /// group (no push may follow).
    first_in_group: usize,
    open_end: bool,
}

impl GatheredLevels {
    /// Forgets the rows held (keeping the buffers).
    pub fn clear(&mut self) {
        self.levels.clear();
        self.scale.clear();
        self.offset.clear();
        self.section = None;
        self.packing = None;
        self.first_in_group = 0;
        self.open_end = false;
    }

    /// Appends the rows of `rows`; `false` (appending nothing) unless they
    /// come from the same store as the rows held, they are not one per
    /// byte where those are two per byte, and, for groups along tokens,
    /// they continue the held rows at a group's edge (see the type's doc).
    pub fn push(&mut self, rows: &LevelRows<'_>) -> bool {
        let from = rows.section;
        let section = (
            std::ptr::from_ref(from) as usize,
            from.coding.form,
            from.channels,
        );
        if self.section.is_some_and(|s| s != section) {
            return false;
        }
        let g = rows.tokens_per_group();
        let first = rows.start % g;
        let end = (rows.start + rows.rows()) % g;
        if self.section.is_some() && (first != 0 || self.open_end) {
            return false;
        }
        let packing = *self.packing.get_or_insert(rows.packing);
        match (packing, rows.packing) {
            (LevelPacking::Nibbles, LevelPacking::Bytes) => return false,
            (LevelPacking::Bytes, LevelPacking::Nibbles) => {
                let n = self.levels.len();
                self.levels.resize(n + rows.rows() * from.channels, 0);
                crate::simd::unpack_nibbles(rows.levels, &mut self.levels[n..]);
            }
            _ => self.levels.extend_from_slice(rows.levels),
        }
        if self.section.is_none() {
            self.first_in_group = first;
        }
        self.section = Some(section);
        self.open_end = end != 0;
        self.scale.extend_from_slice(rows.scale);
        self.offset.extend_from_slice(rows.offset);
        true
    }

    /// The rows held as one view of `store`; `None` when none are held, or
    /// they came from another store, or there are more of them than the
    /// store's quantized rows (a view's rows index its section's layout).
    pub fn view<'a>(&'a self, store: &'a KvStore) -> Option<LevelRows<'a>> {
        let section = &store.middle;
        let ours = (
            std::ptr::from_ref(section) as usize,
            section.coding.form,
            section.channels,
        );
        let map = section.coding.kind.level_map()?;
        let layout = section.layout.as_ref()?;
        let packing = self.packing?;
        let row_bytes = match packing {
            LevelPacking::Bytes => section.channels,
            LevelPacking::Nibbles => section.channels / 2,
        };
        let rows = self.levels.len() / row_bytes.max(1);
        // As rows `first..first + rows` of the section, the first inside
        // its group where the first push started: the groups follow.
        let first = self.first_in_group;
        let groups = if rows >= 1 {
            layout.groups_of_rows(first, first + rows).len()
        } else {
            0
        };
        let whole = self.levels.len() == rows * row_bytes
            && self.scale.len() == groups
            && self.offset.len() == groups;
        (self.section == Some(ours) && whole && rows >= 1 && first + rows <= section.tokens)
            .then_some(LevelRows {
                section,
                start: first,
                levels: &self.levels,
                packing,
                scale: &self.scale,
                offset: &self.offset,
                map,
            })
    }
}

/// Rows of one per-channel group whose channels are kept in several stores
/// of the same form (each a slice of consecutive channels over the same
/// rows, a [`RowsView::Levels`] of each), laid side by side along the
/// channels with their parameters, to be read as one view of a store of
/// the whole row (the template): a paged cache's group of several blocks,
/// kept as one channel slice per block. Each value reads as its slice's
/// view gave it.
#[derive(Clone, Debug, Default)]
pub struct ChannelSlices {
    levels: Vec<u8>,
    packing: Option<LevelPacking>,
    scale: Vec<f32>,
    offset: Vec<f32>,
    /// Rows held, channels filled so far, and the slices' form.
    rows: usize,
    filled: usize,
    form: Option<crate::CacheForm>,
    /// Channels of a whole row (the template's).
    channels: usize,
}

impl ChannelSlices {
    /// Starts a gather of `rows` rows of `channels` channels (keeping the
    /// buffers).
    pub fn begin(&mut self, rows: usize, channels: usize) {
        self.levels.clear();
        self.scale.clear();
        self.offset.clear();
        self.packing = None;
        self.form = None;
        self.rows = rows;
        self.filled = 0;
        self.channels = channels;
    }

    /// Appends the next slice of channels; `false` (and the gather is
    /// spoilt until the next [`begin`](Self::begin)) unless its rows are the
    /// gather's, its groups are per channel over a group holding all of
    /// them, it has the form and packing of the slices before it, and its
    /// channels fit (an even count where the levels are packed two per
    /// byte).
    pub fn push(&mut self, slice: &LevelRows<'_>) -> bool {
        let ch = slice.channels();
        let form = slice.section.coding.form;
        let packing = *self.packing.get_or_insert(slice.packing);
        let fits = slice.rows() == self.rows
            && slice.channels_per_group() == 1
            && slice.scale.len() == ch
            && slice.offset.len() == ch
            && *self.form.get_or_insert(form) == form
            && packing == slice.packing
            && self.filled + ch <= self.channels
            && (packing == LevelPacking::Bytes
                || (ch.is_multiple_of(2) && self.filled.is_multiple_of(2)));
        if !fits {
            self.filled = usize::MAX / 2;
            return false;
        }
        let (row_bytes, at, width) = match packing {
            LevelPacking::Bytes => (self.channels, self.filled, ch),
            LevelPacking::Nibbles => (self.channels / 2, self.filled / 2, ch / 2),
        };
        self.levels.resize(self.rows * row_bytes, 0);
        for (r, src) in slice.levels.chunks_exact(width).enumerate() {
            self.levels[r * row_bytes + at..][..width].copy_from_slice(src);
        }
        self.scale.extend_from_slice(slice.scale);
        self.offset.extend_from_slice(slice.offset);
        self.filled += ch;
        true
    }

    /// The gathered rows as rows `start..start + rows` of `template` (a
    /// store of the slices' form over whole rows, whose group holds those
    /// rows); `None` until every channel is filled, or where the template
    /// does not match.
    pub fn view<'a>(&'a self, template: &'a KvStore, start: usize) -> Option<LevelRows<'a>> {
        let section = &template.middle;
        let layout = section.layout.as_ref()?;
        let one_group = layout.channels_per_group == 1
            && start / layout.tokens_per_block
                == (start + self.rows.max(1) - 1) / layout.tokens_per_block;
        let same_form = self.form.is_some_and(|f| f == section.coding.form);
        (self.filled == self.channels
            && section.channels == self.channels
            && same_form
            && one_group
            && self.rows >= 1
            && start + self.rows <= section.tokens)
            .then_some(LevelRows {
                section,
                start,
                levels: &self.levels,
                packing: self.packing?,
                scale: &self.scale,
                offset: &self.offset,
                map: section.coding.kind.level_map()?,
            })
    }
}
