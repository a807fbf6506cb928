//! [`ChannelKind`]: the fault channels a run can name, each built from a bit
//! error rate so that every channel flips the same expected fraction of bits.

use gf2_codes::channel::{
    BinarySymmetric, Burst, FaultChannel, MultiBitUpset, StuckAt, StuckValue,
};

use crate::error::{EvalError, Result};

/// A named fault channel; its rate comes from the bit error rate.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ChannelKind {
    /// Independent flips of every bit with probability `ber` (the paper's model).
    Bsc,
    /// Bursts of 2 to 8 adjacent bits, starting at rate `ber / 5` per bit
    /// (so the expected flip rate is `ber`).
    Burst,
    /// Multi-bit upsets: 2 or 3 bits of one byte, at rate `ber · 8 / 2.5`
    /// per byte (expected flip rate `ber`).
    Mbu,
    /// Cells stuck at 0 at rate `2·ber` (half of them read wrong).
    Stuck0,
    /// Cells stuck at 1 at rate `2·ber`.
    Stuck1,
}

impl ChannelKind {
    /// Every channel, in the order `--help` lists them.
    pub const ALL: [ChannelKind; 5] = [
        ChannelKind::Bsc,
        ChannelKind::Burst,
        ChannelKind::Mbu,
        ChannelKind::Stuck0,
        ChannelKind::Stuck1,
    ];

    /// The command-line name.
    pub fn name(self) -> &'static str {
        match self {
            Self::Bsc => "bsc",
            Self::Burst => "burst",
            Self::Mbu => "mbu",
            Self::Stuck0 => "stuck0",
            Self::Stuck1 => "stuck1",
        }
    }

    /// The channel at bit error rate `ber` (the expected fraction of bits flipped).
    pub fn build(self, ber: f64) -> Result<Box<dyn FaultChannel + Send + Sync>> {
        Ok(match self {
            Self::Bsc => Box::new(BinarySymmetric::new(ber)?),
            Self::Burst => Box::new(Burst::new(ber / 5.0, 2, 8)?),
            Self::Mbu => Box::new(MultiBitUpset::new((ber * 8.0 / 2.5).min(1.0), 1, 2, 3)?),
            Self::Stuck0 => Box::new(StuckAt::new((2.0 * ber).min(1.0), StuckValue::Zero)?),
            Self::Stuck1 => Box::new(StuckAt::new((2.0 * ber).min(1.0), StuckValue::One)?),
        })
    }
}

impl std::str::FromStr for ChannelKind {
    type Err = EvalError;
    fn from_str(s: &str) -> Result<Self> {
        Self::ALL
            .into_iter()
            .find(|c| c.name() == s)
            .ok_or_else(|| EvalError::InvalidParameter {
                name: "channel",
                reason: format!("{s:?} is not one of bsc, burst, mbu, stuck0, stuck1"),
            })
    }
}
