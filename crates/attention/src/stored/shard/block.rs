//! The types a [`ShardPart`](super::ShardPart) keeps and hands out: the
//! tables a part codes on ([`ShardTables`]) and one sealed block as
//! snapshots carry it ([`ShardBlock`]), with its stored bytes, its guard
//! under a coded spelling, its scrub and what a read of it counts.

use std::sync::Arc;

use kv_lowrank::ShardKeys;
use kv_quant::{ChannelVq, KvDecodeStats, KvStore, ScrubStats};

use super::BlockGuard;
use crate::error::Result;
use crate::rope::Rope;

/// The tables one part of a Shard form reads: calibrated (`kv-eval
/// calibrate` fits them on its text, per layer) or fitted on one
/// sequence's rows ([`StoredPart::fit_sequence`](crate::stored::StoredPart::fit_sequence)).
#[derive(Clone, Debug)]
pub enum ShardTables {
    /// Keys: a store fitted on the calibration keys (RoPE undone), whose
    /// basis and bit allocation every block is coded on, and the model's
    /// RoPE.
    Keys {
        /// The fitted store (its basis, allocation and groups are read).
        prototype: Arc<ShardKeys>,
        /// The rotation the keys are stored with.
        rope: Rope,
    },
    /// Values: the codebook fitted on the calibration values (`None` for
    /// NF4 values, which need no table).
    Values {
        /// The fitted store (its codebook is read).
        prototype: Option<Arc<ChannelVq>>,
        /// Channels per head (the Hadamard rotation of the values).
        head_dim: usize,
    },
}

/// One sealed block of a [`ShardPart`](super::ShardPart), as snapshots carry it.
#[derive(Clone, Debug, PartialEq)]
pub enum ShardBlock {
    /// Keys on the calibrated basis; `first` is the position of its first
    /// row (RoPE is applied again at read).
    Keys {
        /// The coded keys (RoPE undone), as the stored bits decode.
        keys: Box<ShardKeys>,
        /// Position of the block's first row.
        first: usize,
        /// The codes and scales as stored under a coded spelling.
        guard: Option<Box<BlockGuard>>,
    },
    /// Values on the calibrated codebook.
    Vq {
        /// The coded values, as the stored bits decode.
        values: ChannelVq,
        /// The indices and scales as stored under a coded spelling.
        guard: Option<Box<BlockGuard>>,
    },
    /// Values in NF4 after a Hadamard rotation (`-vnf4`).
    Nf4(Box<KvStore>),
}

impl ShardBlock {
    /// Bytes the block holds (the shared tables not counted).
    pub fn stored_bytes(&self) -> usize {
        if let Some(g) = self.guard() {
            return g.stored_bytes();
        }
        match self {
            Self::Keys { keys, .. } => keys.stored_bytes() - keys.shared_bytes(),
            Self::Vq { values, .. } => values.stored_bytes() - values.shared_bytes(),
            Self::Nf4(s) => s.stored_bytes(),
        }
    }

    /// The stored bits under a coded spelling.
    pub fn guard(&self) -> Option<&BlockGuard> {
        match self {
            Self::Keys { guard, .. } | Self::Vq { guard, .. } => guard.as_deref(),
            Self::Nf4(_) => None,
        }
    }

    /// One scrubbing pass over the stored words under a coded spelling
    /// (every corrected word rewritten); a bare block has none.
    pub fn scrub(&mut self) -> Result<ScrubStats> {
        match self {
            Self::Keys {
                guard: Some(guard), ..
            }
            | Self::Vq {
                guard: Some(guard), ..
            } => guard.scrub(),
            _ => Ok(ScrubStats::default()),
        }
    }

    /// What a read of rows from `offset` counts: under a code, every
    /// stored word of the block in the read holding its first row (as a
    /// kv-quant store counts a group's metadata).
    pub(super) fn read_stats(&self, offset: usize) -> KvDecodeStats {
        match self.guard() {
            Some(g) if offset == 0 => g.stats(),
            _ => KvDecodeStats::default(),
        }
    }
}
