//! Rows of a coupled (`cq`) store as their codes: [`KvStore::decode_vq_codes`]
//! stops where [`KvStore::decode_rows_into`] would look the codes up, and
//! returns the centroid index of every group and the gain of every gain
//! block ([`VqCodeRows`]), so a reader can score a query against the
//! codebook once and add each row's entries, instead of writing the rows'
//! values and reading them back (attention scores keys coded before RoPE
//! this way). [`VqCodeRows::value`] gives exactly what the decode writes.

use super::decode::DecodeScratch;
use super::{KvDecodeStats, KvStore, Piece};
use crate::error::Result;
use crate::spec::Quantizer;
use crate::vq::VqCodebook;

/// Codes and gains of rows of a `cq` store (no exact rows among them, no
/// erased value): value `c` of row `r` is
/// `gains[r·B + c / block] · codebook.centroid(c / dim, codes[r·G + c / dim])[c % dim]`
/// with `G = channels / dim` groups and `B = channels / block` gain blocks
/// a row ([`value`](Self::value)).
#[derive(Clone, Copy, Debug)]
pub struct VqCodeRows<'s> {
    /// Centroid indices, one per byte: `rows × channels / dim`, row-major;
    /// group `j` of a row indexes codebook `j` (a `cq` form has one per
    /// group).
    pub codes: &'s [u8],
    /// Gains, `rows × channels / block`, row-major (block: the codebook's
    /// gain block).
    pub gains: &'s [f32],
    /// The codebooks the codes index.
    pub codebook: &'s VqCodebook,
    channels: usize,
}

impl VqCodeRows<'_> {
    /// Rows held.
    pub fn rows(&self) -> usize {
        self.codes.len() * self.codebook.spec().dim / self.channels
    }

    /// Channels per row.
    pub fn channels(&self) -> usize {
        self.channels
    }

    /// The value of `channel` in row `row`, as the store decodes it.
    pub fn value(&self, row: usize, channel: usize) -> f32 {
        let dim = self.codebook.spec().dim;
        let groups = self.channels / dim;
        let blocks = self.channels / self.codebook.block();
        let code = self.codes[row * groups + channel / dim];
        let gain = self.gains[row * blocks + channel / self.codebook.block()];
        gain * self.codebook.centroid(channel / dim, code)[channel % dim]
    }
}

impl KvStore {
    /// Codes and gains of rows `start..start + count` of a coupled (`cq`)
    /// store, ECC-decoded where protected and counted in the statistics as
    /// a decode counts them; `None` where the rows cannot be read so: a
    /// form other than `cq`, rows that include exact sink or window rows,
    /// or rows holding an erased value (whose policy needs values). Read
    /// those with [`decode_rows_into`](Self::decode_rows_into).
    pub fn decode_vq_codes<'s>(
        &'s self,
        start: usize,
        count: usize,
        scratch: &'s mut DecodeScratch,
    ) -> Result<Option<(VqCodeRows<'s>, KvDecodeStats)>> {
        let end = self.row_end(start, count)?;
        let section = &self.middle;
        let (Quantizer::Vq(spec), Some(codebook), Some(layout)) = (
            self.form.quantizer(),
            section.codebook.as_ref(),
            section.layout.as_ref(),
        ) else {
            return Ok(None);
        };
        if !spec.coupled || layout.tokens_per_block != 1 {
            return Ok(None);
        }
        let mut pieces = self.pieces(start, end);
        let local = match (pieces.next(), pieces.next()) {
            (Some((Piece::Middle, range, _)), None) => range,
            _ => return Ok(None),
        };
        let mut stats = section.decode_codes(local.start, local.end, scratch, false)?;
        section.ledger_truth(local.start, local.end, &mut stats, scratch)?;
        if stats.erased_values > 0 {
            return Ok(None);
        }
        let codes = count * self.channels / spec.dim;
        let gains = layout.groups_of_rows(local.start, local.end).len();
        let scratch: &'s DecodeScratch = scratch;
        // `decode_codes` unpacked the levels into the scratch unless they
        // are stored one per byte.
        let levels: &[u8] = if section.coding.code_bits == 8 && section.coding.codec().is_none() {
            let rb = section.row_bytes;
            &section.data[local.start * rb..local.end * rb]
        } else {
            &scratch.levels
        };
        let rows = VqCodeRows {
            codes: &levels[..codes],
            gains: &scratch.scale[..gains],
            codebook,
            channels: self.channels,
        };
        Ok(Some((rows, stats)))
    }
}
