//! Seeded fault injection into a store's buffers, with the exact record of
//! every flipped bit ([`Injection`]), and the map from a flipped bit to the
//! value word it hit.

use gf2_codes::channel::{FaultChannel, FaultRng, Flips};

use super::KvStore;
use super::ledger::Buffer;

/// Which buffers a fault injection hits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FaultTarget {
    /// The value codes (or codewords) only, exact rows included.
    Values,
    /// Scales, offsets and their check bytes only.
    Metadata,
    /// Both.
    Everything,
}

/// The exact flips of one injection, per buffer (bit positions `8·byte + bit`).
///
/// Each buffer gets its own random stream of the seed (values 0, scales 1,
/// offsets 2, checks 3, exact sink and window rows 4), so the value flips of
/// a seed are the same whether or not the metadata is hit too.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Injection {
    /// Flips in the value buffer (of the quantized rows).
    pub values: Flips,
    /// Flips in the scales.
    pub scales: Flips,
    /// Flips in the offsets.
    pub offsets: Flips,
    /// Flips in the metadata check bytes.
    pub checks: Flips,
    /// Flips in the exact (sink and window) rows.
    pub exact: Flips,
    /// Flips in fitted tables the rows are read through (a paged cache's
    /// shared `vq` codebook, flipped in its [`ProtectedTable`](crate::ProtectedTable)).
    pub tables: Flips,
}

impl Injection {
    /// Total flipped bits.
    pub fn total(&self) -> usize {
        self.values.len()
            + self.scales.len()
            + self.offsets.len()
            + self.checks.len()
            + self.exact.len()
            + self.tables.len()
    }

    /// Flipped bits in the metadata buffers.
    pub fn metadata(&self) -> usize {
        self.scales.len() + self.offsets.len() + self.checks.len()
    }
}

impl KvStore {
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
        let m = &mut self.middle;
        if target != FaultTarget::Metadata {
            injection.values = hit(&mut m.data, 0);
            if let Some(exact) = &mut self.exact {
                injection.exact = hit(&mut exact.section.data, 4);
            }
        }
        if target != FaultTarget::Values {
            injection.scales = hit(&mut m.scales, 1);
            injection.offsets = hit(&mut m.offsets, 2);
            injection.checks = hit(&mut m.checks, 3);
        }
        let rows = 0..self.middle.tokens;
        self.middle.record(&injection, rows);
        if let Some(exact) = &mut self.exact {
            exact
                .section
                .ledger_mut()
                .toggle(Buffer::Values, 0, injection.exact.positions());
        }
        self.injected += injection.total() as u64;
        injection
    }

    /// The bits that differ from what was written, in [`inject`](Self::inject)'s
    /// coordinates (one position stream per buffer; `exact` for the exact
    /// sink and window rows): every injected flip not since undone by a
    /// scrubber or overwritten by new rows. Flipping these bits again would
    /// give back the store as written.
    pub fn fault_ledger(&self) -> Injection {
        let mut ledger = self.middle.ledger_rows(0..self.middle.tokens);
        if let Some(exact) = &self.exact {
            ledger.exact = exact.section.ledger_rows(0..exact.section.tokens).values;
        }
        ledger
    }

    /// Value words per token of the quantized rows: codewords for coded
    /// forms, codes otherwise.
    pub fn words_per_row(&self) -> usize {
        self.middle.words_per_row()
    }

    /// The value word (global index `row · words_per_row + word`, rows of
    /// the quantized middle) holding bit `bit` of the value buffer, or
    /// `None` for a padding bit that belongs to no word (a fault there
    /// changes nothing).
    pub fn word_of_bit(&self, bit: u64) -> Option<usize> {
        let m = &self.middle;
        let row_bits = 8 * m.row_bytes as u64;
        if row_bits == 0 {
            return None;
        }
        let (row, b) = ((bit / row_bits) as usize, bit % row_bits);
        if row >= m.tokens {
            return None;
        }
        let word = match m.coding.codec() {
            Some(codec) => codec.codeword_of_bit(b, m.coding.nibbles(m.channels)),
            None => (b / u64::from(m.coding.code_bits)) as usize,
        };
        (word < m.words_per_row()).then_some(row * m.words_per_row() + word)
    }
}
