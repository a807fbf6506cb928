//! [`KvSource`]: the one trait attention reads a K or V cache through,
//! "give me rows `start..start+count` as f32", and its implementations for
//! plain f32 rows ([`DenseKv`]), every kv-quant stored form ([`KvStore`]),
//! and a stored form decoded against its fault-free truth ([`StoreWithTruth`]).

use kv_quant::{DecodeScratch, KvDecodeStats, KvStore};

use crate::error::{AttentionError, Result, check_len};

/// One tile of cache rows as f32, with the statistics of decoding it.
#[derive(Debug)]
pub struct Tile<'s> {
    /// `count × channels` values, row-major.
    pub rows: &'s [f32],
    /// Decode statistics of these rows (all zero for plain f32 rows).
    pub stats: KvDecodeStats,
}

/// A K or V cache (`tokens × channels`, row `t` = the token at position `t`)
/// that attention reads tile by tile. Implementations decode into
/// `Scratch`, which the attention loop keeps per thread and reuses, so a
/// read does not allocate once the scratch has grown.
pub trait KvSource: Sync {
    /// Per-thread buffers for [`read_tile`](Self::read_tile).
    type Scratch: Default + Send;

    /// Cached tokens.
    fn tokens(&self) -> usize;

    /// Channels per token (`kv_heads × head_dim`).
    fn channels(&self) -> usize;

    /// Bytes this cache holds, counted from its buffers: what one full pass
    /// of attention reads.
    fn stored_bytes(&self) -> usize;

    /// Rows `start..start + count` as f32. Callers keep
    /// `start + count <= tokens()` and `count > 0`.
    fn read_tile<'s>(
        &'s self,
        start: usize,
        count: usize,
        scratch: &'s mut Self::Scratch,
    ) -> Result<Tile<'s>>;
}

impl<S: KvSource + ?Sized> KvSource for &S {
    type Scratch = S::Scratch;

    fn tokens(&self) -> usize {
        (**self).tokens()
    }

    fn channels(&self) -> usize {
        (**self).channels()
    }

    fn stored_bytes(&self) -> usize {
        (**self).stored_bytes()
    }

    fn read_tile<'s>(
        &'s self,
        start: usize,
        count: usize,
        scratch: &'s mut Self::Scratch,
    ) -> Result<Tile<'s>> {
        (**self).read_tile(start, count, scratch)
    }
}

/// Borrowed plain f32 rows; tiles are slices of them, nothing is copied.
#[derive(Clone, Copy, Debug)]
pub struct DenseKv<'a> {
    data: &'a [f32],
    tokens: usize,
    channels: usize,
}

impl<'a> DenseKv<'a> {
    /// Wraps `data` (`tokens × channels`, row-major).
    pub fn new(data: &'a [f32], tokens: usize, channels: usize) -> Result<Self> {
        if channels == 0 {
            return Err(AttentionError::InvalidParameter {
                name: "channels",
                reason: "a KV cache needs at least one channel".into(),
            });
        }
        let len = tokens
            .checked_mul(channels)
            .ok_or(AttentionError::InvalidParameter {
                name: "shape",
                reason: format!("{tokens} × {channels} overflows"),
            })?;
        check_len("dense KV rows (tokens × channels)", len, data.len())?;
        Ok(Self {
            data,
            tokens,
            channels,
        })
    }
}

impl KvSource for DenseKv<'_> {
    type Scratch = ();

    fn tokens(&self) -> usize {
        self.tokens
    }

    fn channels(&self) -> usize {
        self.channels
    }

    fn stored_bytes(&self) -> usize {
        std::mem::size_of_val(self.data)
    }

    fn read_tile<'s>(&'s self, start: usize, count: usize, _: &'s mut ()) -> Result<Tile<'s>> {
        Ok(Tile {
            rows: &self.data[start * self.channels..(start + count) * self.channels],
            stats: KvDecodeStats::default(),
        })
    }
}

/// Scratch of the stored-form sources: kv-quant's decode buffers and the f32 tile.
#[derive(Clone, Debug, Default)]
pub struct StoreScratch {
    decode: DecodeScratch,
    rows: Vec<f32>,
}

impl StoreScratch {
    fn tile(&mut self, len: usize) -> (&mut [f32], &mut DecodeScratch) {
        if self.rows.len() < len {
            self.rows.resize(len, 0.0);
        }
        (&mut self.rows[..len], &mut self.decode)
    }
}

/// Any kv-quant form: each tile is dequantized (and, for protected forms,
/// ECC-decoded with the form's erasure policy) by
/// [`KvStore::decode_rows_into`], so values and statistics equal those of
/// the same rows of a whole [`KvStore::decode`].
impl KvSource for KvStore {
    type Scratch = StoreScratch;

    fn tokens(&self) -> usize {
        KvStore::tokens(self)
    }

    fn channels(&self) -> usize {
        KvStore::channels(self)
    }

    fn stored_bytes(&self) -> usize {
        KvStore::stored_bytes(self)
    }

    fn read_tile<'s>(
        &'s self,
        start: usize,
        count: usize,
        scratch: &'s mut StoreScratch,
    ) -> Result<Tile<'s>> {
        let (rows, decode) = scratch.tile(count * KvStore::channels(self));
        let stats = self.decode_rows_into(start, count, rows, decode)?;
        Ok(Tile { rows, stats })
    }
}

/// A stored form read while comparing with the same store before faults,
/// so the statistics also count miscorrected words and silent changes
/// (experiments only: it decodes twice).
#[derive(Clone, Copy, Debug)]
pub struct StoreWithTruth<'a> {
    store: &'a KvStore,
    truth: &'a KvStore,
}

impl<'a> StoreWithTruth<'a> {
    /// Pairs a (possibly faulted) store with its fault-free original.
    pub fn new(store: &'a KvStore, truth: &'a KvStore) -> Result<Self> {
        store.check_truth(truth)?;
        Ok(Self { store, truth })
    }
}

impl KvSource for StoreWithTruth<'_> {
    type Scratch = StoreScratch;

    fn tokens(&self) -> usize {
        self.store.tokens()
    }

    fn channels(&self) -> usize {
        self.store.channels()
    }

    fn stored_bytes(&self) -> usize {
        self.store.stored_bytes()
    }

    fn read_tile<'s>(
        &'s self,
        start: usize,
        count: usize,
        scratch: &'s mut StoreScratch,
    ) -> Result<Tile<'s>> {
        let (rows, decode) = scratch.tile(count * self.store.channels());
        let stats = self
            .store
            .decode_rows_with_truth_into(self.truth, start, count, rows, decode)?;
        Ok(Tile { rows, stats })
    }
}
