//! Paged decode attention: a batch's block tables as one CSR page table
//! ([`PageTable`]: `indptr`, `indices` and the last page's length per
//! sequence, FlashInfer's layout), a [`KvSource`] that reads a sequence's K
//! or V rows page by page from [`BlockStorage`] ([`PagedKv`]), and
//! [`paged_decode`], the attention crate's decode over those sources.

use std::sync::RwLockReadGuard;

use attention::stored::{PartScratch, StoredPart};
use attention::{Attention, AttentionOutput, KvSource, Mask, Tile};
use kv_quant::Hadamard;

use crate::error::{PagedCacheError, Result};
use crate::pool::BlockId;
use crate::storage::{BlockStorage, KvPart};

/// A batch's block tables in CSR form: sequence `i` owns pages
/// `indices[indptr[i]..indptr[i + 1]]`, all full except the last, which
/// holds `last_page_len[i]` tokens (1 to `block_size`; 0 only for a
/// sequence without pages).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PageTable {
    /// Offsets into `indices`, one more than there are sequences.
    pub indptr: Vec<u32>,
    /// Physical block of each page.
    pub indices: Vec<u32>,
    /// Tokens in each sequence's last page.
    pub last_page_len: Vec<u32>,
    /// Tokens per page.
    pub block_size: usize,
}

impl PageTable {
    /// Builds the CSR arrays from `(block table, tokens)` per sequence.
    pub fn from_tables(tables: &[(&[BlockId], usize)], block_size: usize) -> Result<Self> {
        let mut table = PageTable {
            indptr: vec![0],
            indices: Vec::new(),
            last_page_len: Vec::new(),
            block_size,
        };
        for &(blocks, tokens) in tables {
            if blocks.len() != tokens.div_ceil(block_size.max(1)) {
                return Err(PagedCacheError::PageTable(format!(
                    "{} pages for {tokens} tokens of {block_size}",
                    blocks.len()
                )));
            }
            table.indices.extend(blocks.iter().map(|b| b.0));
            table.indptr.push(table.indices.len() as u32);
            let last = if tokens == 0 {
                0
            } else {
                tokens - (blocks.len() - 1) * block_size
            };
            table.last_page_len.push(last as u32);
        }
        table.validate(usize::MAX)?;
        Ok(table)
    }

    /// Sequences in the table.
    pub fn sequences(&self) -> usize {
        self.last_page_len.len()
    }

    /// Pages of sequence `i`.
    pub fn pages(&self, i: usize) -> &[u32] {
        &self.indices[self.indptr[i] as usize..self.indptr[i + 1] as usize]
    }

    /// Tokens of sequence `i`.
    pub fn tokens(&self, i: usize) -> usize {
        match self.pages(i).len() {
            0 => 0,
            n => (n - 1) * self.block_size + self.last_page_len[i] as usize,
        }
    }

    /// Checks sequence `seq`'s entries alone (its offsets and its last
    /// page's length), so one sequence can be read from a table that was
    /// not validated whole without any index going out of range.
    pub fn check_sequence(&self, seq: usize) -> Result<()> {
        let bad = |m: String| Err(PagedCacheError::PageTable(m));
        if seq >= self.sequences() {
            return bad(format!("sequence {seq} of {}", self.sequences()));
        }
        let (Some(&lo), Some(&hi)) = (self.indptr.get(seq), self.indptr.get(seq + 1)) else {
            return bad(format!(
                "indptr has {} entries for {} sequences",
                self.indptr.len(),
                self.sequences()
            ));
        };
        if lo > hi || hi as usize > self.indices.len() || self.block_size == 0 {
            return bad(format!(
                "sequence {seq}: pages {lo}..{hi} of {} indices, blocks of {}",
                self.indices.len(),
                self.block_size
            ));
        }
        let (pages, last) = ((hi - lo) as usize, self.last_page_len[seq] as usize);
        if (pages == 0 && last != 0) || (pages > 0 && !(1..=self.block_size).contains(&last)) {
            return bad(format!(
                "sequence {seq}: last page length {last} with {pages} pages of {}",
                self.block_size
            ));
        }
        Ok(())
    }

    /// Checks the arrays' shapes and ranges (pages below `num_blocks`).
    pub fn validate(&self, num_blocks: usize) -> Result<()> {
        let bad = |m: String| Err(PagedCacheError::PageTable(m));
        if self.block_size == 0 {
            return bad("block size 0".into());
        }
        if self.indptr.len() != self.last_page_len.len() + 1 || self.indptr.first() != Some(&0) {
            return bad(format!(
                "indptr has {} entries for {} sequences (and must start at 0)",
                self.indptr.len(),
                self.last_page_len.len()
            ));
        }
        if self.indptr.windows(2).any(|w| w[0] > w[1])
            || *self.indptr.last().expect("non-empty") as usize != self.indices.len()
        {
            return bad("indptr must rise to the number of indices".into());
        }
        if let Some(&b) = self.indices.iter().find(|&&b| b as usize >= num_blocks) {
            return bad(format!("page {b} is outside the {num_blocks} blocks"));
        }
        for i in 0..self.sequences() {
            let (pages, last) = (self.pages(i).len(), self.last_page_len[i] as usize);
            let ok = if pages == 0 {
                last == 0
            } else {
                (1..=self.block_size).contains(&last)
            };
            if !ok {
                return bad(format!(
                    "sequence {i}: last page length {last} with {pages} pages of {}",
                    self.block_size
                ));
            }
        }
        Ok(())
    }
}

/// One sequence's K or V rows of one layer, read through its pages: a
/// view of the layer part ([`StoredPart`]) that holds its read lock while
/// it lives (one attention call) and hands each tile request to the part
/// with the sequence's pages ([`StoredPart::read_tile`]: stored halves or
/// levels where the form allows; interpolation of erased values never
/// reads another sequence's token).
#[derive(Debug)]
pub struct PagedKv<'a> {
    part: RwLockReadGuard<'a, Box<dyn StoredPart>>,
    pages: &'a [u32],
    tokens: usize,
    bytes: usize,
}

impl<'a> PagedKv<'a> {
    /// Sequence `seq` of `table`, layer `layer`, keys or values.
    pub fn new(
        storage: &'a BlockStorage,
        table: &'a PageTable,
        seq: usize,
        layer: usize,
        part: KvPart,
    ) -> Result<Self> {
        table.check_sequence(seq)?;
        if table.block_size != storage.block_size() {
            return Err(PagedCacheError::PageTable(format!(
                "pages of {} tokens over blocks of {}",
                table.block_size,
                storage.block_size()
            )));
        }
        let pages = table.pages(seq);
        if let Some(&b) = pages.iter().find(|&&b| b as usize >= storage.num_blocks()) {
            return Err(PagedCacheError::PageTable(format!(
                "page {b} is outside the {} blocks",
                storage.num_blocks()
            )));
        }
        let part = storage.part(layer, part)?;
        let bytes = pages.iter().map(|&b| part.block_bytes(b as usize)).sum();
        Ok(Self {
            part,
            pages,
            tokens: table.tokens(seq),
            bytes,
        })
    }
}

impl KvSource for PagedKv<'_> {
    type Scratch = PartScratch;

    fn tokens(&self) -> usize {
        self.tokens
    }

    fn channels(&self) -> usize {
        self.part.channels()
    }

    fn stored_bytes(&self) -> usize {
        self.bytes
    }

    fn row_bytes(&self) -> usize {
        self.part.row_bytes()
    }

    fn block_tokens(&self) -> Option<usize> {
        Some(self.part.tile_unit())
    }

    fn tile_origin(&self) -> usize {
        self.part.tile_origin()
    }

    fn gathers_blocks(&self) -> bool {
        self.part.gathers_blocks()
    }

    fn read_tile<'s>(
        &'s self,
        start: usize,
        count: usize,
        scratch: &'s mut PartScratch,
    ) -> attention::Result<Tile<'s>> {
        self.part.read_tile(self.pages, start, count, scratch)
    }

    fn row_addresses(&self, start: usize, count: usize) -> Option<std::ops::Range<usize>> {
        self.part.row_addresses(self.pages, start, count)
    }

    fn row_address_ranges(
        &self,
        start: usize,
        count: usize,
        each: &mut dyn FnMut(std::ops::Range<usize>),
    ) {
        self.part.row_address_ranges(self.pages, start, count, each)
    }

    fn rotation(&self) -> Option<&'static Hadamard> {
        self.part.rotation()
    }
}

/// Decode attention for every sequence of `table`: `queries` holds one
/// query per sequence (`sequences × q_heads × head_dim`), the last token of
/// each attending to all of that sequence's tokens in `layer`.
pub fn paged_decode(
    attention: &Attention,
    storage: &BlockStorage,
    table: &PageTable,
    layer: usize,
    queries: &[f32],
) -> Result<Vec<AttentionOutput>> {
    table.validate(storage.num_blocks())?;
    let q_len = attention.shape().q_len();
    if queries.len() != table.sequences() * q_len {
        return Err(PagedCacheError::ShapeMismatch {
            what: "queries",
            found: queries.len(),
            expected: table.sequences() * q_len,
        });
    }
    (0..table.sequences())
        .map(|i| {
            let keys = PagedKv::new(storage, table, i, layer, KvPart::Keys)?;
            let values = PagedKv::new(storage, table, i, layer, KvPart::Values)?;
            let q = &queries[i * q_len..][..q_len];
            let position = keys.tokens().saturating_sub(1);
            Ok(attention.decode(q, position, &keys, &values, &Mask::Causal)?)
        })
        .collect()
}
