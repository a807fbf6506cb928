//! [`Shared`]: the fitted table a Shard part reads (the key basis and bit
//! allocation, or the value codebook) as stored bytes under the form's
//! metadata code: the part's own, or a sequence's
//! ([`SequenceShard`](super::sequence::SequenceShard)).

use gf2_codes::channel::FaultChannel;
use kv_lowrank::ShardKeys;
use kv_quant::{CacheForm, ChannelVq, FaultTarget, Injection};

use super::ShardTables;
use crate::error::Result;
use crate::stored::SharedTable;

/// A [`ShardPart`](super::ShardPart)'s fitted table as stored bytes.
#[derive(Debug)]
pub(super) enum Shared {
    /// The keys' basis.
    Keys(SharedTable<ShardKeys>),
    /// The values' codebook.
    Vq(SharedTable<ChannelVq>),
    /// NF4 values read no table.
    None,
}

impl Shared {
    /// The table of `tables` (if any) stored under `form`'s metadata code.
    pub(super) fn of(tables: Option<&ShardTables>, form: &CacheForm) -> Self {
        match tables {
            Some(ShardTables::Keys { prototype, .. }) => {
                Self::Keys(SharedTable::new(prototype.clone(), form))
            }
            Some(ShardTables::Values {
                prototype: Some(p), ..
            }) => Self::Vq(SharedTable::new(p.clone(), form)),
            _ => Self::None,
        }
    }

    pub(super) fn stored_bytes(&self) -> usize {
        match self {
            Self::Keys(t) => t.stored_bytes(),
            Self::Vq(t) => t.stored_bytes(),
            Self::None => 0,
        }
    }

    pub(super) fn inject(
        &mut self,
        channel: &dyn FaultChannel,
        seed: u64,
        target: FaultTarget,
    ) -> Result<(Injection, bool)> {
        match self {
            Self::Keys(t) => t.inject(channel, seed, target),
            Self::Vq(t) => t.inject(channel, seed, target),
            Self::None => Ok((Injection::default(), false)),
        }
    }

    pub(super) fn stats(&self) -> gf2_codes::DecodeStats {
        match self {
            Self::Keys(t) => t.stats(),
            Self::Vq(t) => t.stats(),
            Self::None => gf2_codes::DecodeStats::default(),
        }
    }

    pub(super) fn scrub(&mut self) -> gf2_codes::DecodeStats {
        match self {
            Self::Keys(t) => t.scrub(),
            Self::Vq(t) => t.scrub(),
            Self::None => gf2_codes::DecodeStats::default(),
        }
    }

    /// Sets `tables`' table to the one as read now.
    pub(super) fn reread_into(&self, tables: &mut ShardTables) {
        match (self, tables) {
            (Self::Keys(t), ShardTables::Keys { prototype, .. }) => *prototype = t.read().clone(),
            (Self::Vq(t), ShardTables::Values { prototype, .. }) => {
                *prototype = Some(t.read().clone());
            }
            _ => {}
        }
    }
}
