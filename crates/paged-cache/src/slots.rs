//! [`ReservedSlots`]: the slots a scheduler reserved for one sequence, as
//! an [`attention::KvBackend`] a model's forward pass can write and read.
//!
//! In continuous batching the scheduler, not the model, decides where a
//! step's tokens go: [`serve`](crate::scheduler::serve) appends them to
//! their sequences (taking blocks, copying shared ones, preempting when
//! short) and then hands the engine the batch. Each sequence of the batch
//! is then one `ReservedSlots`: it holds the sequence's block table and
//! writes each token's K/V into its slot through the shared
//! [`BlockStorage`], so a batch needs no mutable access to the manager and
//! every sequence of it can be an independent backend of one batched
//! forward pass. A step must name exactly the tokens reserved next; a
//! rolled-back step leaves its slots reserved (the scheduler owns them).

use std::sync::Arc;

use attention::{Attention, AttentionOutput, KvBackend, Mask, ModelKvShape, StepRows};

use crate::backend::{PagedReadStats, attend_blocks, fit_storage, layer_spec};
use crate::error::{PagedCacheError, Result};
use crate::manager::{KvCacheManager, SeqId};
use crate::pool::BlockId;
use crate::prefix::PrefixCache;
use crate::seq_tables::SeqTables;
use crate::storage::BlockStorage;

/// One sequence's reserved slots as a KV backend (see the module docs).
#[derive(Debug)]
pub struct ReservedSlots {
    storage: Arc<BlockStorage>,
    table: Vec<BlockId>,
    ids: Vec<u32>,
    written: usize,
    step: StepRows,
    stats: PagedReadStats,
    /// The sequence's fitted tables ([`SeqTables`]): slots shared with the
    /// manager's, so a fit here is the sequence's.
    tables: SeqTables,
}

impl ReservedSlots {
    /// The slots of `seq` in `manager`, whose first `written` tokens hold
    /// their K/V already. Refused when the manager has no block storage,
    /// `seq` is unknown or swapped out, `written` is past its tokens, or a
    /// block holding a slot still to be written is shared (writing it would
    /// change another sequence's cache: reserve through
    /// [`KvCacheManager::append`], which copies it first).
    pub fn new<P: PrefixCache>(
        manager: &KvCacheManager<P>,
        seq: SeqId,
        written: usize,
    ) -> Result<Self> {
        let storage = manager.storage().ok_or(PagedCacheError::NoStorage)?.clone();
        let ids = manager.tokens(seq)?.to_vec();
        let table = manager.block_table(seq)?.to_vec();
        if written > ids.len() {
            return Err(PagedCacheError::PositionOutOfRange {
                position: written,
                tokens: ids.len(),
            });
        }
        let bs = storage.block_size();
        for &block in &table[written / bs..] {
            if manager.pool().ref_count(block)? != 1 {
                return Err(PagedCacheError::InvalidParameter {
                    name: "slots",
                    reason: format!(
                        "{seq}: block {} holds slots to write but is shared",
                        block.0
                    ),
                });
            }
        }
        Ok(Self {
            storage,
            table,
            ids,
            written,
            step: StepRows::new(manager.storage().map_or(0, |s| s.layers().len())),
            stats: PagedReadStats::default(),
            tables: manager.sequence_tables(seq)?.clone(),
        })
    }

    /// Decode statistics of every attention read so far.
    pub fn read_stats(&self) -> PagedReadStats {
        self.stats
    }

    /// Tokens reserved (written or not).
    pub fn reserved(&self) -> usize {
        self.ids.len()
    }
}

impl KvBackend for ReservedSlots {
    type Error = PagedCacheError;

    fn fit(&mut self, model: &ModelKvShape<'_>) -> Result<()> {
        fit_storage(&self.storage, model)
    }

    fn tokens(&self) -> usize {
        self.written
    }

    fn begin(&mut self, tokens: &[u32]) -> Result<()> {
        let end = self.written + tokens.len();
        if self.ids.get(self.written..end) != Some(tokens) {
            return Err(PagedCacheError::InvalidParameter {
                name: "step",
                reason: format!(
                    "tokens {}..{end} are not the ones reserved ({} reserved, {} written)",
                    self.written,
                    self.ids.len(),
                    self.written
                ),
            });
        }
        Ok(self.step.begin(tokens.len())?)
    }

    fn append(&mut self, layer: usize, keys: &[f32], values: &[f32]) -> Result<()> {
        let channels = layer_spec(&self.storage, layer)?.channels;
        self.step.check_append(layer, channels, keys, values)?;
        let bs = self.storage.block_size();
        let first = self.written + self.step.pending(layer);
        for (i, (k, v)) in keys
            .chunks_exact(channels)
            .zip(values.chunks_exact(channels))
            .enumerate()
        {
            let pos = first + i;
            self.storage
                .write(self.table[pos / bs], pos % bs, layer, k, v)?;
            self.step.appended(layer, 1);
        }
        Ok(())
    }

    fn attend(
        &mut self,
        layer: usize,
        attention: &Attention,
        queries: &[f32],
        positions: &[usize],
        mask: &Mask<'_>,
    ) -> Result<AttentionOutput> {
        layer_spec(&self.storage, layer)?;
        let visible = self.written + self.step.pending(layer);
        if visible == 0 {
            return Err(attention::AttentionError::EmptyCache.into());
        }
        let (storage, stats) = (&self.storage, &mut self.stats);
        attend_blocks(
            storage,
            &self.table,
            visible,
            layer,
            attention,
            (queries, positions, mask),
            stats,
        )
    }

    fn commit(&mut self) -> Result<()> {
        match self.step.close() {
            Ok(n) => {
                let before = self.written;
                self.written += n;
                // Blocks the step made sealable are sealed now it is whole.
                self.storage
                    .seal_blocks(&self.table, before, self.written, &mut self.tables)?;
                Ok(())
            }
            Err(e) => {
                self.rollback();
                Err(e.into())
            }
        }
    }

    fn rollback(&mut self) {
        self.step.discard();
    }

    /// Goes back to `tokens` written; the slots stay reserved, so the next
    /// step writes the reserved tokens again.
    fn truncate(&mut self, tokens: usize) -> Result<()> {
        self.step.check_truncate(tokens, self.written)?;
        self.written = tokens;
        Ok(())
    }

    /// Switches the storage's parts to `view` (see
    /// [`BlockStorage::set_view`]: every sequence of the storage reads the
    /// view, so a batch drafts with it set and verifies with it back at
    /// [`ReadView::Full`](attention::ReadView::Full)).
    fn set_read_view(&mut self, view: attention::ReadView) -> Result<()> {
        self.storage.set_view(view)
    }

    /// To the end of the current block where some form seals blocks
    /// ([`BlockStorage::rows_before_seal`]).
    fn rows_before_seal(&self) -> Option<usize> {
        self.storage.rows_before_seal(self.written)
    }

    /// Commits the first `keep` rows and seals only what they complete.
    fn commit_prefix(&mut self, keep: usize) -> Result<()> {
        match self.step.close() {
            Ok(n) if keep <= n => {
                let before = self.written;
                self.written += keep;
                self.storage
                    .seal_blocks(&self.table, before, self.written, &mut self.tables)?;
                Ok(())
            }
            Ok(n) => Err(attention::keep_past_step(keep, n).into()),
            Err(e) => {
                self.rollback();
                Err(e.into())
            }
        }
    }
}
