//! Decoding a section's rows back to f32 in its stored domain (rotated
//! coordinates for rotated forms): metadata words (decoded by their code
//! where protected), codes (ECC-decoded where protected, with an erasure bit per
//! value), values, and the erasure policy ([`super::erasure`]).

use gf2_codes::batch::{Backend, erasure_words};
use gf2_codes::{DecodeOutcome, DecodeStats};
use half::bf16;

use super::KvDecodeStats;
use super::bits::{copy_bits, erase_values_of_nibbles, nibbles_to_bytes, read_word, set_bits};
use super::erasure::Neighbours;
use super::section::{Kind, Section};
use crate::error::{Result, check_len};
use crate::int;
use crate::layout::GroupLayout;
use crate::lloyd_max::LloydMax;
use crate::meta::MetaCode;
use crate::nf4::NF4_LEVELS;
use crate::qjl::QjlSketch;
use crate::spec::ScaleType;

/// Reusable buffers for [`KvStore::decode_rows_into`](super::KvStore::decode_rows_into):
/// they grow on first use and are reused after, so steady-state tile
/// decoding does not allocate.
#[derive(Clone, Debug, Default)]
pub struct DecodeScratch {
    pub(crate) levels: Vec<u8>,
    pub(crate) bytes: Vec<u8>,
    pub(crate) nibbles: Vec<u8>,
    nibble_erasures: Vec<u64>,
    pub(crate) row_erasures: Vec<u64>,
    pub(crate) truth_nibbles: Vec<u8>,
    pub(crate) truth_erasures: Vec<u64>,
    /// A faulted row as written (from the fault ledger).
    pub(crate) truth_row: Vec<u8>,
    pub(crate) erasures: Vec<u64>,
    pub(crate) scale: Vec<f32>,
    pub(crate) offset: Vec<f32>,
    meta_erased: Vec<bool>,
    /// The erasure bits that come from a group's metadata (a subset of
    /// `erasures`), valid for `count` rows when `meta_erasures_rows` is.
    pub(crate) meta_erasures: Vec<u64>,
    /// Rows `meta_erasures` holds (0 when no group's metadata was erased).
    pub(crate) meta_erasures_rows: usize,
    /// Decoded values when a view cannot return levels.
    pub(crate) values: Vec<f32>,
    /// Rows decoded for interpolation across tile borders.
    pub(crate) neighbours: Option<Box<Neighbours>>,
    /// Rows interpolation may read (`None`: the whole store).
    pub(crate) neighbour_rows: Option<(usize, usize)>,
    /// Interpolation reads only rows of the erased row's aligned block of
    /// this many rows (`None`: no such limit).
    pub(crate) neighbour_block: Option<usize>,
}

impl DecodeScratch {
    /// Empty scratch.
    pub fn new() -> Self {
        Self::default()
    }

    /// Limits the rows the interpolation policy (`+interp`) reads
    /// neighbours from in the decodes that use this scratch: a paged cache
    /// whose store spans many sequences' blocks passes a block's rows, so
    /// an erased value is never rebuilt from another sequence's token.
    /// `None` (the default) allows the whole store.
    pub fn limit_neighbours(&mut self, rows: Option<std::ops::Range<usize>>) {
        self.neighbour_rows = rows.map(|r| (r.start, r.end));
    }

    /// Limits interpolation (`+interp`, and a group whose metadata was
    /// erased under `keep`) to the erased row's own block of `rows` rows
    /// (rows `b·rows..(b + 1)·rows`): a paged cache whose blocks are
    /// aligned runs of a store's rows decodes several blocks in one tile
    /// and still never rebuilds a value from another block's token.
    /// `None` (the default) sets no such limit.
    pub fn limit_neighbours_to_blocks(&mut self, rows: Option<usize>) {
        self.neighbour_block = rows.filter(|&r| r > 0);
    }
}

pub(crate) fn grow<T: Clone + Default>(v: &mut Vec<T>, n: usize) -> &mut [T] {
    if v.len() < n {
        v.resize(n, T::default());
    }
    &mut v[..n]
}

/// Little-endian metadata words of type `ty` as f32.
fn words_to_f32(ty: ScaleType, words: &[u8], out: &mut [f32]) {
    match ty {
        ScaleType::F16 => crate::simd::f16_to_f32(words, out),
        ScaleType::F32 => {
            for (o, w) in out.iter_mut().zip(words.chunks_exact(4)) {
                *o = f32::from_le_bytes([w[0], w[1], w[2], w[3]]);
            }
        }
    }
}

fn all_clean(words: u64) -> DecodeStats {
    DecodeStats {
        words,
        clean: words,
        ..DecodeStats::default()
    }
}

impl Section {
    /// Decodes rows `start..end` of the section into `out` (stored domain),
    /// applying the erasure policy when `policy` is set.
    pub(crate) fn decode_rows(
        &self,
        start: usize,
        end: usize,
        out: &mut [f32],
        scratch: &mut DecodeScratch,
        policy: bool,
    ) -> Result<KvDecodeStats> {
        check_len("output tile", (end - start) * self.channels, out.len())?;
        let mut stats = self.decode_codes(start, end, scratch, false)?;
        if let Some(values) = self.values_from_codes(start, end, out, scratch) {
            stats.values = values;
        }
        if policy && stats.erased_values > 0 {
            self.apply_policy(start, end, out, scratch)?;
        }
        Ok(stats)
    }

    /// Everything of decoding rows `start..end` but turning codes into
    /// values: the group parameters into `scratch.scale`/`scratch.offset`,
    /// the codes into `scratch.levels` (or, for protected float forms, the
    /// packed rows into `scratch.bytes`), and the erasure bit of every value
    /// into `scratch.erasures`. The returned statistics lack `values` for
    /// unprotected float forms, which [`values_from_codes`](Self::values_from_codes) counts.
    /// With `keep_nibbles`, unprotected 4-bit codes in rows without padding
    /// ([`nibbles_in_place`](Self::nibbles_in_place)) are left packed in the
    /// section's data and `scratch.levels` is not written.
    pub(crate) fn decode_codes(
        &self,
        start: usize,
        end: usize,
        scratch: &mut DecodeScratch,
        keep_nibbles: bool,
    ) -> Result<KvDecodeStats> {
        let count = end - start;
        let ew = erasure_words(self.channels);
        grow(&mut scratch.erasures, count * ew).fill(0);
        let mut stats = KvDecodeStats::default();
        if let Some(layout) = &self.layout {
            stats.metadata = self.load_params(layout, start, end, scratch);
        }
        let float = self.coding.kind.float_bytes().is_some();
        if !float || self.coding.codec().is_some() {
            stats.values = if keep_nibbles && self.nibbles_in_place() {
                all_clean((count * self.channels) as u64)
            } else {
                crate::simd::with_avx2(|| self.load_codes(start, end, scratch))?
            };
        }
        scratch.meta_erasures_rows = 0;
        // A branch-free OR over the flags first: per-channel groups give a
        // tile a thousand of them, and the scan for set ones was 7% of a
        // paged `int4-ch` decode in blocks of 16 (`perf`).
        let any_erased = self.layout.as_ref().is_some_and(|layout| {
            let n = layout.groups_of_rows(start, end).len();
            scratch.meta_erased[..n]
                .iter()
                .fold(false, |any, &e| any | e)
        });
        if let (Some(layout), true) = (&self.layout, any_erased) {
            let erasures = &mut scratch.erasures[..count * ew];
            let groups = layout.groups_of_rows(start, end);
            for (i, _) in scratch.meta_erased[..groups.len()]
                .iter()
                .enumerate()
                .filter(|e| *e.1)
            {
                if scratch.meta_erasures_rows == 0 {
                    grow(&mut scratch.meta_erasures, count * ew).fill(0);
                    scratch.meta_erasures_rows = count;
                }
                let g = groups.start + i;
                let t0 = layout.first_token(g).max(start);
                let t1 = (layout.first_token(g) + layout.tokens_per_block).min(end);
                let c0 = g % layout.groups_per_block * layout.channels_per_group;
                for t in t0..t1 {
                    for bits in [&mut *erasures, &mut scratch.meta_erasures[..count * ew]] {
                        set_bits(
                            &mut bits[(t - start) * ew..][..ew],
                            c0,
                            layout.channels_per_group,
                        );
                    }
                }
            }
        }
        // Only a code or a metadata check erases; unprotected forms skip
        // the count (a tenth of a small-head decode, `perf`).
        // At realistic error rates nearly every word is zero: one OR over
        // them (vectorised) decides, and only a tile with an erasure is
        // counted (the count was 12% of an `int4+secded84` decode-attention
        // call, `perf`, in a crate built without POPCNT).
        if self.coding.codec().is_some() || self.coding.meta_code().is_some() {
            let erasures = &scratch.erasures[..count * ew];
            if erasures.iter().fold(0u64, |any, &w| any | w) != 0 {
                stats.erased_values = erasures.iter().map(|w| u64::from(w.count_ones())).sum();
            }
        }
        Ok(stats)
    }

    /// Whether the section's rows are unprotected 4-bit levels, one per
    /// channel, packed two per byte (low nibble first) with no padding: the
    /// stored bytes are then the levels as [`LevelPacking::Nibbles`](super::LevelPacking)
    /// reads them. With neither a value code nor a metadata code, no value
    /// is ever erased, so such rows always read as levels.
    pub(crate) fn nibbles_in_place(&self) -> bool {
        self.coding.code_bits == 4
            && self.coding.codec().is_none()
            && self.coding.meta_code().is_none()
            && self.coding.kind.level_map().is_some()
            && self.coding.codes(self.channels) == self.channels
            && 2 * self.row_bytes == self.channels
    }

    /// Reads (and for protected metadata decodes) the parameters of the groups of
    /// rows `start..end` into the scratch, returning metadata statistics.
    fn load_params(
        &self,
        layout: &GroupLayout,
        start: usize,
        end: usize,
        scratch: &mut DecodeScratch,
    ) -> DecodeStats {
        // Protected metadata is also checked for plausibility: a scale or
        // offset that decodes to NaN or ±∞, a negative scale (every form's
        // scale, absmax or gain is ≥ 0), or a value outside the range the
        // store's writers wrote ([`ParamBound`](super::ParamBound)) is an
        // undetected error the code let through, and erasing its group lets
        // the erasure policy rebuild the values instead of spreading a
        // non-finite or blown-up row. Such a
        // word, and a detected one, reads as 0: `keep` leaves a detected
        // value codeword as received because a wrong level is a bounded
        // error, but a scale or offset as received is not bounded (one
        // exponent flip multiplies a whole group), so under `keep` the
        // group's values are interpolated (`apply_policy`).
        let ty = self.coding.scale_type();
        let Some(code) = self.coding.meta_code() else {
            // Unprotected metadata: the words as stored, converted in bulk
            // (F16C or AVX-512 for f16 words).
            let groups = layout.groups_of_rows(start, end);
            let n = groups.len();
            let has_offsets = !self.offsets.is_empty();
            let width = ty.bytes();
            let bytes = groups.start * width..groups.end * width;
            words_to_f32(ty, &self.scales[bytes.clone()], grow(&mut scratch.scale, n));
            let offset = grow(&mut scratch.offset, n);
            if has_offsets {
                words_to_f32(ty, &self.offsets[bytes], offset);
            } else {
                offset.fill(0.0);
            }
            grow(&mut scratch.meta_erased, n).fill(false);
            let counted = layout.counted_groups(start, end).len() as u64;
            let words = counted * (1 + u64::from(has_offsets));
            return DecodeStats {
                words,
                clean: words,
                ..DecodeStats::default()
            };
        };
        match ty {
            ScaleType::F16 => self.load_params_f16(layout, start, end, code, scratch),
            ScaleType::F32 => self.load_params_by_word(layout, start, end, scratch),
        }
    }

    /// [`load_params`](Self::load_params) for protected metadata, one word
    /// at a time: decoded, converted and checked for plausibility.
    fn load_params_by_word(
        &self,
        layout: &GroupLayout,
        start: usize,
        end: usize,
        scratch: &mut DecodeScratch,
    ) -> DecodeStats {
        let groups = layout.groups_of_rows(start, end);
        let n = groups.len();
        let ty = self.coding.scale_type();
        let total = layout.groups();
        let scale = grow(&mut scratch.scale, n);
        let offset = grow(&mut scratch.offset, n);
        let erased = grow(&mut scratch.meta_erased, n);
        let mut stats = DecodeStats::default();
        let has_offsets = !self.offsets.is_empty();
        let counted_groups = layout.counted_groups(start, end);
        for (i, g) in groups.enumerate() {
            let counted = counted_groups.contains(&g);
            let mut read = |buffer: &[u8], check_index: usize, is_scale: bool| {
                let (word, outcome) = self.meta_word(buffer, g, check_index);
                if counted {
                    stats.record(outcome);
                }
                let v = int::from_bits(ty, word);
                let implausible = !self.bound.admits(v, is_scale);
                let erased = outcome == DecodeOutcome::Detected || implausible;
                (if erased { 0.0 } else { v }, erased)
            };
            let (s, s_bad) = read(&self.scales, g, true);
            let (o, o_bad) = if has_offsets {
                read(&self.offsets, total + g, false)
            } else {
                (0.0, false)
            };
            scale[i] = s;
            offset[i] = o;
            erased[i] = s_bad || o_bad;
        }
        stats
    }

    /// [`load_params`](Self::load_params) for protected f16 words, with the
    /// same results: each word's syndrome (two table lookups), the words
    /// converted in bulk, and only the words with a non-zero syndrome (at
    /// realistic error rates, almost none) decoded one by one. The per-word
    /// path cost two fifths of a small-head decode-attention call (`perf`).
    fn load_params_f16(
        &self,
        layout: &GroupLayout,
        start: usize,
        end: usize,
        code: &MetaCode,
        scratch: &mut DecodeScratch,
    ) -> DecodeStats {
        let groups = layout.groups_of_rows(start, end);
        let n = groups.len();
        let total = layout.groups();
        let cb = code.check_bytes();
        let counted = layout.counted_groups(start, end);
        let erased = grow(&mut scratch.meta_erased, n);
        erased.fill(false);
        let mut stats = DecodeStats::default();
        let has_offsets = !self.offsets.is_empty();
        let parts = [
            (&self.scales, &mut scratch.scale, 0, true),
            (&self.offsets, &mut scratch.offset, total, false),
        ];
        for (buffer, out, base, is_scale) in parts {
            let out = grow(out, n);
            if !is_scale && !has_offsets {
                out.fill(0.0);
                continue;
            }
            let words = &buffer[groups.start * 2..groups.end * 2];
            crate::simd::f16_to_f32(words, out);
            let checks = &self.checks[(base + groups.start) * cb..(base + groups.end) * cb];
            // Nearly every tile is clean: one branch-free pass over the
            // syndromes and the bounds decides, and only a tile with a
            // nonzero syndrome or an implausible word takes the word-by-word
            // loop (the loop was a tenth of an `int4+secded84` decode-
            // attention call at head dimension 64, `perf`).
            let clean = match cb {
                1 => clean_words::<1>(code, words, checks, out, &self.bound, is_scale),
                2 => clean_words::<2>(code, words, checks, out, &self.bound, is_scale),
                _ => false,
            };
            if clean {
                let clean = counted.len() as u64;
                stats.words += clean;
                stats.clean += clean;
                continue;
            }
            let mut unclean = 0;
            for (i, (w, c)) in words
                .chunks_exact(2)
                .zip(checks.chunks_exact(cb))
                .enumerate()
            {
                let word = u16::from_le_bytes([w[0], w[1]]);
                let check = match *c {
                    [c] => u32::from(c),
                    [lo, hi] => u32::from(u16::from_le_bytes([lo, hi])),
                    _ => read_word(c),
                };
                if code.syndrome16(word, check) == 0 {
                    continue;
                }
                let g = groups.start + i;
                let (fixed, outcome) = code.decode(u32::from(word), check);
                if counted.contains(&g) {
                    stats.record(outcome);
                    unclean += 1;
                }
                // A detected word reads as NaN here, which the range check
                // below erases like any implausible word.
                out[i] = match outcome {
                    DecodeOutcome::Detected => f32::NAN,
                    _ => int::from_bits(ScaleType::F16, fixed),
                };
            }
            let clean = (counted.len() - unclean) as u64;
            stats.words += clean;
            stats.clean += clean;
            // A detected word, and one outside what was written, reads as 0
            // and erases its group.
            for (v, e) in out.iter_mut().zip(erased.iter_mut()) {
                if !self.bound.admits(*v, is_scale) {
                    *e = true;
                    *v = 0.0;
                }
            }
        }
        stats
    }

    /// Metadata word `g` of `buffer` (the scales or the offsets) after SECDED
    /// decoding with check word `check_index`, if the form has one.
    #[inline]
    pub(crate) fn meta_word(
        &self,
        buffer: &[u8],
        g: usize,
        check_index: usize,
    ) -> (u32, DecodeOutcome) {
        let width = self.coding.scale_type().bytes();
        let raw = read_word(&buffer[g * width..][..width]);
        match self.coding.meta_code() {
            Some(code) => {
                let cb = code.check_bytes();
                code.decode(raw, read_word(&self.checks[check_index * cb..][..cb]))
            }
            None => (raw, DecodeOutcome::Clean),
        }
    }

    /// Decodes (coded) or unpacks (plain) the codes of rows `start..end`.
    fn load_codes(
        &self,
        start: usize,
        end: usize,
        scratch: &mut DecodeScratch,
    ) -> Result<DecodeStats> {
        let (ch, rb) = (self.channels, self.row_bytes);
        let count = end - start;
        let codes = self.coding.codes(ch);
        let bits = self.coding.code_bits as u8;
        let rows = &self.data[start * rb..end * rb];
        let Some(codec) = self.coding.codec() else {
            // Unprotected level forms: 8-bit codes are read in place.
            if bits == 4 && 2 * rb == codes {
                // Rows without padding: one stream of nibbles for the tile.
                crate::simd::unpack_nibbles(rows, grow(&mut scratch.levels, count * codes));
            } else if bits < 8 {
                let levels = grow(&mut scratch.levels, count * codes);
                for (lv, row) in levels.chunks_exact_mut(codes).zip(rows.chunks_exact(rb)) {
                    int::unpack_row(bits, row, lv);
                }
            }
            return Ok(all_clean((count * codes) as u64));
        };
        let backend = Backend::detect();
        let ew = erasure_words(ch);
        let n = self.coding.nibbles(ch);
        // Nibbles per row including codeword padding (Golay pads a row to a
        // multiple of 3); the rows of a tile form one codeword stream
        // unless a row ends inside a byte (Hamming(7,4) with n % 8 ≠ 0).
        let padded = codec.codewords(n) * codec.values_per_codeword();
        let one_stream =
            codec.concatenates(padded) && codec.encoded_len(padded * count) == rb * count;
        if one_stream && self.coding.nibbles_are_levels() && padded == ch && ch % 64 == 0 {
            // Same layout as the tile: decode straight into it.
            let levels = grow(&mut scratch.levels, count * ch);
            let erasures = &mut scratch.erasures[..count * ew];
            return Ok(codec.decode_into_with(backend, rows, levels, erasures)?);
        }
        let stride = if one_stream { padded } else { n };
        let nibbles = grow(&mut scratch.nibbles, stride * count);
        let nibble_erasures = grow(&mut scratch.nibble_erasures, erasure_words(stride * count));
        let mut stats = DecodeStats::default();
        if one_stream {
            stats = codec.decode_into_with(backend, rows, nibbles, nibble_erasures)?;
        } else {
            nibble_erasures.fill(0);
            let nw = erasure_words(n);
            let row_erasures = grow(&mut scratch.row_erasures, nw);
            for r in 0..count {
                let row = &rows[r * rb..][..rb];
                let nb = &mut nibbles[r * n..][..n];
                stats += codec.decode_into_with(backend, row, nb, row_erasures)?;
                for (w, &word) in row_erasures.iter().enumerate() {
                    let mut b = word;
                    while b != 0 {
                        let i = 64 * w + b.trailing_zeros() as usize;
                        b &= b - 1;
                        set_bits(nibble_erasures, r * n + i, 1);
                    }
                }
            }
        }
        // Nibbles back to codes (or packed float bytes), nibble erasures to values.
        let erasures = &mut scratch.erasures[..count * ew];
        if self.coding.nibbles_are_levels() {
            let levels = grow(&mut scratch.levels, count * ch);
            for r in 0..count {
                levels[r * ch..][..ch].copy_from_slice(&nibbles[r * stride..][..ch]);
                copy_bits(
                    nibble_erasures,
                    r * stride,
                    &mut erasures[r * ew..][..ew],
                    ch,
                );
            }
            return Ok(stats);
        }
        let packed_len = self.coding.packed_bytes(ch);
        let float = self.coding.kind.float_bytes().is_some();
        let packed = grow(&mut scratch.bytes, count * packed_len);
        let nw = erasure_words(n);
        let row_erasures = grow(&mut scratch.row_erasures, nw);
        for r in 0..count {
            nibbles_to_bytes(
                &nibbles[r * stride..][..n],
                &mut packed[r * packed_len..][..packed_len],
            );
            copy_bits(nibble_erasures, r * stride, row_erasures, n);
            erase_values_of_nibbles(
                row_erasures,
                n,
                self.coding.code_bits as usize,
                self.coding.values_per_code,
                ch,
                &mut erasures[r * ew..][..ew],
            );
        }
        if !float {
            let levels = grow(&mut scratch.levels, count * codes);
            for (lv, p) in levels
                .chunks_exact_mut(codes)
                .zip(packed.chunks_exact(packed_len))
            {
                int::unpack_row(bits, p, lv);
            }
        }
        Ok(stats)
    }

    /// Turns the codes of rows `start..end` into values; returns the value
    /// statistics of unprotected float forms (counted here, per value).
    fn values_from_codes(
        &self,
        start: usize,
        end: usize,
        out: &mut [f32],
        scratch: &DecodeScratch,
    ) -> Option<DecodeStats> {
        let kind = self.coding.kind;
        let (ch, rb) = (self.channels, self.row_bytes);
        if let Some(per_value) = kind.float_bytes() {
            let protected = self.coding.codec().is_some();
            let bytes = if protected {
                &scratch.bytes[..(end - start) * self.coding.packed_bytes(ch)]
            } else {
                &self.data[start * rb..end * rb]
            };
            float_values(kind, bytes, out);
            if protected {
                return None;
            }
            return Some(all_clean((bytes.len() / per_value) as u64));
        }
        let codes = self.coding.codes(ch);
        let levels: &[u8] = if self.coding.code_bits == 8 && self.coding.codec().is_none() {
            &self.data[start * rb..end * rb]
        } else {
            &scratch.levels[..(end - start) * codes]
        };
        let params = (scratch.scale.as_slice(), scratch.offset.as_slice());
        crate::simd::with_avx2(|| self.dequantize(start, end, out, levels, params));
        None
    }

    /// Values of rows `start..end` from their codes (`levels`, row stride
    /// `codes`) and the parameters of their groups.
    pub(crate) fn dequantize(
        &self,
        start: usize,
        end: usize,
        out: &mut [f32],
        levels: &[u8],
        (scale, offset): (&[f32], &[f32]),
    ) {
        let kind = self.coding.kind;
        let layout = self.layout.as_ref().expect("level forms have groups");
        let ch = self.channels;
        let codes = self.coding.codes(ch);
        let g0 = layout.groups_of_rows(start, end).start;
        let cpg = layout.channels_per_group;
        for (r, (o, lv)) in out
            .chunks_exact_mut(ch)
            .zip(levels.chunks_exact(codes))
            .enumerate()
        {
            let base = layout.group(start + r, 0) - g0;
            let a = &scale[base..][..layout.groups_per_block];
            let b = &offset[base..][..layout.groups_per_block];
            match kind {
                Kind::Vq { dim } => {
                    let codebook = self.codebook.as_ref().expect("vq sections hold a codebook");
                    let per_block = cpg / dim;
                    let blocks = o.chunks_exact_mut(cpg).zip(lv.chunks_exact(per_block));
                    for (blk, ((o, lv), &gain)) in blocks.zip(a).enumerate() {
                        // `cq-d2` pairs gathered eight at a time: the paged
                        // cache decodes its values every step.
                        if dim == 2 && codebook.spec().coupled {
                            let k = codebook.spec().centroids;
                            let book = codebook.codebook_of(blk, 0);
                            let table = (codebook.centroids(), k, book);
                            crate::simd::centroid_pairs(table, lv, gain, o);
                            continue;
                        }
                        for (j, (o, &l)) in o.chunks_exact_mut(dim).zip(lv).enumerate() {
                            let book = codebook.codebook_of(blk, j);
                            for (o, &c) in o.iter_mut().zip(codebook.centroid(book, l)) {
                                *o = gain * c;
                            }
                        }
                    }
                }
                Kind::LloydMax { bits, qjl: true } => {
                    let table = LloydMax::of(bits).centroids();
                    let sketch = QjlSketch::of(cpg);
                    let mask = (1u8 << bits) - 1;
                    let mut signs = [0u8; crate::spec::MAX_ROTATION_BLOCK];
                    for (((o, lv), &gain), &norm) in o
                        .chunks_exact_mut(cpg)
                        .zip(lv.chunks_exact(cpg))
                        .zip(a)
                        .zip(b)
                    {
                        for ((o, &l), s) in o.iter_mut().zip(lv).zip(signs.iter_mut()) {
                            *o = gain * table[usize::from(l & mask)];
                            *s = l >> bits & 1;
                        }
                        sketch.add_estimate(&signs[..cpg], norm, o);
                    }
                }
                _ if cpg == 1 => dequantize_columns(kind, o, lv, a, b),
                _ => {
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
    }
}

/// Values of little-endian float codes.
fn float_values(kind: Kind, bytes: &[u8], out: &mut [f32]) {
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
        _ => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = bf16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
    }
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
        Kind::LloydMax { bits, .. } => {
            let table = LloydMax::of(bits).centroids();
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

/// Whether every f16 metadata word of `words` has a zero syndrome against
/// its `CB` check bytes (little-endian) and its value (`values`, already
/// widened) is one the writers could have written: the clean case of
/// [`Section::load_params_f16`], without a branch per word.
fn clean_words<const CB: usize>(
    code: &MetaCode,
    words: &[u8],
    checks: &[u8],
    values: &[f32],
    bound: &super::ParamBound,
    is_scale: bool,
) -> bool {
    let syndromes =
        words
            .chunks_exact(2)
            .zip(checks.as_chunks::<CB>().0)
            .fold(0u32, |any, (w, c)| {
                let check = c
                    .iter()
                    .rev()
                    .fold(0u32, |word, &byte| word << 8 | u32::from(byte));
                any | code.syndrome16(u16::from_le_bytes([w[0], w[1]]), check)
            });
    syndromes == 0
        && values
            .iter()
            .fold(true, |ok, &v| ok & bound.admits(v, is_scale))
}

#[cfg(test)]
mod tests {
    use gf2_codes::channel::BinarySymmetric;

    use super::*;
    use crate::store::{FaultTarget, KvStore};

    /// The bulk path for protected f16 metadata gives the per-word path's
    /// parameters, erasures and statistics, tile by tile, under faults that
    /// leave corrected, detected and miscorrected words, for both metadata
    /// codes, with and without offsets, and for groups spanning tokens.
    #[test]
    fn bulk_f16_metadata_equals_the_per_word_path() {
        let channel = BinarySymmetric::new(3e-2).unwrap();
        let (tokens, channels) = (37, 64);
        let mut detected = 0;
        let data: Vec<f32> = (0..tokens * channels)
            .map(|i| ((i as f32) * 0.37).sin() * (1.0 + (i % 7) as f32))
            .collect();
        for spelling in [
            "int4+secded84",
            "int4-g16+golay24+meta-secded",
            "int4-sym-g32+secded84",
            "nf4+hamming74",
            "int4-ch+secded84+interp",
            "int4-ch16+golay24",
        ] {
            let form = spelling.parse().unwrap();
            let mut store = KvStore::quantize(form, &data, tokens, channels).unwrap();
            store.inject(&channel, 11, FaultTarget::Everything);
            let section = &store.middle;
            let layout = section.layout.unwrap();
            let code = section.coding.meta_code().unwrap();
            for (start, end) in [(0, tokens), (0, 5), (5, 21), (21, tokens), (36, 37)] {
                let (mut bulk, mut word) = (DecodeScratch::new(), DecodeScratch::new());
                let a = section.load_params_f16(&layout, start, end, code, &mut bulk);
                let b = section.load_params_by_word(&layout, start, end, &mut word);
                let n = layout.groups_of_rows(start, end).len();
                let what = format!("{spelling} rows {start}..{end}");
                assert_eq!(a, b, "{what}");
                let bits = |v: &[f32]| v[..n].iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&bulk.scale), bits(&word.scale), "{what}");
                assert_eq!(bits(&bulk.offset), bits(&word.offset), "{what}");
                assert_eq!(bulk.meta_erased[..n], word.meta_erased[..n], "{what}");
            }
            let whole = section.load_params_by_word(&layout, 0, tokens, &mut DecodeScratch::new());
            assert!(whole.corrected > 0, "{spelling}: {whole:?}");
            detected += whole.detected;
        }
        assert!(detected > 0, "no detected word exercised the erasure");
    }
}
