//! [`SequenceShard`]: the tables a [`ShardPart`](super::ShardPart) fits on
//! one sequence (`shard-k3`: the key basis and bit allocation, or the
//! value codebook), as stored bits and as read.
//!
//! The table is stored as a [`SharedTable`] under the form's metadata code
//! (RM(2,5) beside SECDED and Golay codes, none for a bare spelling),
//! counted with its check words in the sequence's bytes, exposed to faults
//! under `metadata` and `everything`, and scrubbed, as a calibrated part's
//! table is. The cache keeps it in the sequence's `SequenceTables`, a cell
//! its forks share, so the state sits behind a lock: a fault that changes
//! the table as read makes the sequence's sealed blocks read through the
//! new one (the part re-points them) and later seals code on it.

use std::sync::{Mutex, MutexGuard};

use gf2_codes::DecodeStats;
use gf2_codes::channel::FaultChannel;
use kv_quant::{CacheForm, FaultTarget, Injection};

use super::{ShardTables, Shared};
use crate::error::{AttentionError, Result};

/// One sequence's tables of one part (module docs).
#[derive(Debug)]
pub(super) struct SequenceShard {
    /// The table as stored, and the tables as last read through its code.
    state: Mutex<(Shared, ShardTables)>,
}

impl SequenceShard {
    /// `tables` as fitted, stored under `form`'s metadata code; and the
    /// bytes they store.
    pub(super) fn new(tables: ShardTables, form: &CacheForm) -> (Self, usize) {
        let shared = Shared::of(Some(&tables), form);
        let bytes = shared.stored_bytes();
        (
            Self {
                state: Mutex::new((shared, tables)),
            },
            bytes,
        )
    }

    /// The tables as read now (what a seal codes on).
    pub(super) fn tables(&self) -> Result<ShardTables> {
        Ok(self.lock()?.1.clone())
    }

    /// Faults into the stored table under `target`; the tables as read
    /// after, where they changed.
    pub(super) fn inject(
        &self,
        channel: &dyn FaultChannel,
        seed: u64,
        target: FaultTarget,
    ) -> Result<(Injection, Option<ShardTables>)> {
        let mut state = self.lock()?;
        let (stored, read) = &mut *state;
        let (injection, changed) = stored.inject(channel, seed, target)?;
        if !changed {
            return Ok((injection, None));
        }
        stored.reread_into(read);
        Ok((injection, Some(read.clone())))
    }

    /// How the stored words decode now.
    pub(super) fn stats(&self) -> Result<DecodeStats> {
        Ok(self.lock()?.0.stats())
    }

    /// One scrubbing pass over the stored words.
    pub(super) fn scrub(&self) -> Result<DecodeStats> {
        Ok(self.lock()?.0.scrub())
    }

    fn lock(&self) -> Result<MutexGuard<'_, (Shared, ShardTables)>> {
        self.state
            .lock()
            .map_err(|_| AttentionError::InvalidParameter {
                name: "sequence tables",
                reason: "a thread panicked while holding them".into(),
            })
    }
}
