//! Paged decode attention: a batch's block tables as one CSR page table
//! ([`PageTable`]: `indptr`, `indices` and the last page's length per
//! sequence, FlashInfer's layout), a [`KvSource`] that reads a sequence's K
//! or V rows page by page from [`BlockStorage`] ([`PagedKv`]), and
//! [`paged_decode`], the attention crate's decode over those sources.

use std::sync::RwLockReadGuard;

use attention::{
    Attention, AttentionOutput, BlockedScratch, KvSource, Mask, StoreScratch, Tile, TileRows,
};
use kv_quant::{DecodeScratch, Hadamard, KvStore};

use crate::error::{PagedCacheError, Result};
use crate::pool::BlockId;
use crate::storage::{BlockStorage, KvPart, Staged};

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

/// One sequence's K or V rows of one layer, read through its pages. It
/// holds the layer store's read lock (and, for a staged part, the lock of
/// its staged rows) while it lives (one attention call).
/// A tile inside one page, or over pages that are consecutive blocks, is
/// read straight from the layer store, exactly as a contiguous store is
/// (FP16 halves or integer levels for the kernel); a tile over scattered
/// pages has its levels gathered page by page (integer, NF4 and per-token
/// FP8 forms), or is decoded page by page into f32 rows (other forms, and
/// tiles with an erased value). A page whose block is staged (not sealed:
/// [`BlockPlan`](kv_quant::BlockPlan)) is read from its exact rows, as
/// stored halves where they are plain f16, rotated like the sealed rows
/// where the form rotates. Interpolation of erased values reads
/// neighbours from the erased row's own block only (never another
/// sequence's token), on both paths.
#[derive(Debug)]
pub struct PagedKv<'a> {
    store: RwLockReadGuard<'a, KvStore>,
    staged: Option<RwLockReadGuard<'a, Staged>>,
    pages: &'a [u32],
    block_size: usize,
    tokens: usize,
    channels: usize,
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
        let store = storage.layer_store(layer, part)?;
        let staged = if storage.plan(layer, part)?.staged {
            Some(storage.staged_rows(layer, part)?)
        } else {
            None
        };
        let mut bytes = pages.len() * store.stored_bytes() / storage.num_blocks().max(1);
        if let Some(staged) = &staged {
            bytes += pages
                .iter()
                .filter_map(|&b| staged.get(b as usize))
                .map(KvStore::stored_bytes)
                .sum::<usize>();
        }
        Ok(Self {
            channels: store.channels(),
            store,
            staged,
            pages,
            block_size: storage.block_size(),
            tokens: table.tokens(seq),
            bytes,
        })
    }

    /// The store row of the sequence's token `t`.
    fn row(&self, t: usize) -> usize {
        self.pages[t / self.block_size] as usize * self.block_size + t % self.block_size
    }

    /// The pages of tokens `start..start + count`.
    fn pages_of(&self, start: usize, count: usize) -> &[u32] {
        &self.pages[start / self.block_size..=(start + count - 1) / self.block_size]
    }

    /// Whether tokens `start..start + count` sit in consecutive store rows.
    fn contiguous(&self, start: usize, count: usize) -> bool {
        self.pages_of(start, count)
            .windows(2)
            .all(|w| w[1] == w[0] + 1)
    }

    /// The staged exact rows of the page holding token `t`, if any.
    fn exact(&self, t: usize) -> Option<&KvStore> {
        let staged = self.staged.as_deref()?;
        staged.get(self.pages[t / self.block_size] as usize)
    }

    /// Whether any page of tokens `start..start + count` is staged.
    fn touches_staged(&self, start: usize, count: usize) -> bool {
        self.staged.as_deref().is_some_and(|staged| {
            self.pages_of(start, count)
                .iter()
                .any(|&b| staged.get(b as usize).is_some())
        })
    }

    /// Rows `start..start + count`, some of them staged, decoded page by
    /// page into f32 in the sealed rows' coordinates.
    fn decode_mixed<'s>(
        &'s self,
        start: usize,
        count: usize,
        scratch: &'s mut PagedScratch,
    ) -> attention::Result<Tile<'s>> {
        let (channels, bs) = (self.channels, self.block_size);
        let store: &KvStore = &self.store;
        let rotation = KvSource::rotation(store);
        let n = count * channels;
        if scratch.rows.len() < n {
            scratch.rows.resize(n, 0.0);
        }
        let mut stats = kv_quant::KvDecodeStats::default();
        let mut t = start;
        while t < start + count {
            let k = (bs - t % bs).min(start + count - t);
            let out = &mut scratch.rows[(t - start) * channels..][..k * channels];
            match self.exact(t) {
                Some(exact) => {
                    scratch.decode.limit_neighbours(None);
                    stats += exact.decode_rows_into(t % bs, k, out, &mut scratch.decode)?;
                    if let Some(h) = rotation {
                        h.rotate(out);
                    }
                }
                None => {
                    let row = self.row(t);
                    let first = row - t % bs;
                    scratch.decode.limit_neighbours(Some(first..first + bs));
                    stats += store.decode_rows_rotated_into(row, k, out, &mut scratch.decode)?;
                }
            }
            t += k;
        }
        Ok(Tile {
            rows: TileRows::F32(&scratch.rows[..n]),
            stats,
        })
    }
}

/// Scratch of [`PagedKv`]: attention's scratch of block-laid sources, and
/// the buffers of tiles that read staged rows.
#[derive(Debug, Default)]
pub struct PagedScratch {
    blocked: BlockedScratch,
    exact: StoreScratch,
    decode: DecodeScratch,
    rows: Vec<f32>,
}

impl KvSource for PagedKv<'_> {
    type Scratch = PagedScratch;

    fn tokens(&self) -> usize {
        self.tokens
    }

    fn channels(&self) -> usize {
        self.channels
    }

    fn stored_bytes(&self) -> usize {
        self.bytes
    }

    fn row_bytes(&self) -> usize {
        self.store.row_bytes()
    }

    fn block_tokens(&self) -> Option<usize> {
        Some(self.block_size)
    }

    /// Forms read as levels: a tile over pages that are not adjacent has
    /// its pages' levels copied side by side
    /// ([`BlockedScratch::read_blocks`](attention::BlockedScratch::read_blocks)).
    fn gathers_blocks(&self) -> bool {
        let store: &KvStore = &self.store;
        store.reads_levels_per_token()
    }

    fn read_tile<'s>(
        &'s self,
        start: usize,
        count: usize,
        scratch: &'s mut PagedScratch,
    ) -> attention::Result<Tile<'s>> {
        let store: &KvStore = &self.store;
        if self.touches_staged(start, count) {
            let one_page = start / self.block_size == (start + count - 1) / self.block_size;
            if one_page && KvSource::rotation(store).is_none() {
                let exact = self.exact(start).expect("a staged page");
                return exact.read_tile(start % self.block_size, count, &mut scratch.exact);
            }
            return self.decode_mixed(start, count, scratch);
        }
        if self.contiguous(start, count) {
            // A tile of several adjacent blocks: read as the store's tile.
            return scratch
                .blocked
                .read_run(store, self.row(start), count, self.block_size);
        }
        scratch
            .blocked
            .read_blocks(store, start, count, self.block_size, |t| self.row(t))
    }

    fn row_addresses(&self, start: usize, count: usize) -> Option<std::ops::Range<usize>> {
        let store: &KvStore = &self.store;
        if self.contiguous(start, count) && !self.touches_staged(start, count) {
            store.row_addresses(self.row(start), count)
        } else {
            None
        }
    }

    /// One range per page of the rows (sealed pages only).
    fn row_address_ranges(
        &self,
        start: usize,
        count: usize,
        each: &mut dyn FnMut(std::ops::Range<usize>),
    ) {
        let store: &KvStore = &self.store;
        let mut t = start;
        while t < start + count {
            let n = (self.block_size - t % self.block_size).min(start + count - t);
            if self.exact(t).is_none()
                && let Some(range) = store.row_addresses(self.row(t), n)
            {
                each(range);
            }
            t += n;
        }
    }

    fn rotation(&self) -> Option<&'static Hadamard> {
        let store: &KvStore = &self.store;
        KvSource::rotation(store)
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
