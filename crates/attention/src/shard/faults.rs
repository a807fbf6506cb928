//! Faults in a [`ShardLayer`]'s compressed middle and folded chunks: the
//! key coefficient codes and the VQ indices (the bulk of its bytes). Under a form with a
//! code (`shard+secded84`, `shard+golay24`, their interleaved layouts) each
//! buffer is stored as its 4-bit nibbles (low then high of each byte)
//! encoded by the gf2-codes codec; flips land in the encoded bytes, the
//! codec corrects what it can and flags the rest, and a flagged word keeps
//! its received data (`+keep`: a wrong coefficient or index, never a wrong
//! scale). Without a code the flips land in the codes themselves. Every
//! flip is seeded and accounted: corrected, detected, miscorrected or
//! silent, from the codec's comparison with the codes as written.
//!
//! Not exposed: the exact sink and window rows, the decode stream, the
//! per-component scales, the basis and the codebook (a few percent of the
//! bytes at 8K tokens), and NF4 values (`-vnf4`, refused).

use std::sync::Arc;

use gf2_codes::DecodeStats;
use gf2_codes::channel::FaultChannel;

use super::{MiddleValues, ShardLayer};
use crate::error::{AttentionError, Result};

/// What one injection into a layer did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ShardFaults {
    /// Bits flipped (in the encoded bytes under a code).
    pub flips: u64,
    /// Decode outcomes of the key codes' codewords (without a code, one
    /// word per byte: changed bytes are silent).
    pub keys: DecodeStats,
    /// The same for the VQ indices.
    pub values: DecodeStats,
}

impl ShardLayer {
    /// Injects `channel`'s faults, drawn from `seed`, into the stored codes
    /// of the compressed middle and folded chunks (module docs), decodes them through the
    /// form's code, and keeps the decoded codes for attention.
    pub fn inject(&mut self, channel: &dyn FaultChannel, seed: u64) -> Result<ShardFaults> {
        if let Some(c) = self.compressed.first()
            && matches!(&*c.values, MiddleValues::Nf4(_))
        {
            return Err(AttentionError::InvalidParameter {
                name: "faults",
                reason: format!("{}: faults reach VQ values only, not NF4", self.form),
            });
        }
        let code = self.form.protection().map(|p| p.code);
        let mut out = ShardFaults::default();
        for (i, c) in self.compressed.iter_mut().enumerate() {
            // The middle draws from `seed` itself, each folded chunk from its own stream.
            let seed = seed ^ (i as u64).wrapping_mul(0xd1b5_4a32_d192_ed03);
            let (flips, stats) = hit(Arc::make_mut(&mut c.keys).codes_mut(), code, channel, seed)?;
            out.flips += flips;
            out.keys += stats;
            if let MiddleValues::Vq(vq) = Arc::make_mut(&mut c.values) {
                let seed = seed ^ 0x9e37_79b9_7f4a_7c15;
                let (flips, stats) = hit(vq.indices_mut(), code, channel, seed)?;
                out.flips += flips;
                out.values += stats;
            }
        }
        Ok(out)
    }
}

/// Bytes of `bytes` as stored under `code` (their nibbles encoded).
pub(super) fn protected_len(bytes: usize, code: Option<gf2_codes::Int4Code>) -> usize {
    match code {
        Some(c) => c.codec().encoded_len(2 * bytes),
        None => bytes,
    }
}

/// Flips bits of `bytes` (through `code` when there is one) and leaves the
/// decoded bytes there; returns the flips and the decode outcomes.
fn hit(
    bytes: &mut [u8],
    code: Option<gf2_codes::Int4Code>,
    channel: &dyn FaultChannel,
    seed: u64,
) -> Result<(u64, DecodeStats)> {
    let Some(code) = code else {
        let truth = bytes.to_vec();
        let flips = channel.inject(bytes, seed).len() as u64;
        let silent = bytes.iter().zip(&truth).filter(|(a, b)| a != b).count() as u64;
        let stats = DecodeStats {
            words: bytes.len() as u64,
            clean: bytes.len() as u64 - silent,
            silent,
            ..DecodeStats::default()
        };
        return Ok((flips, stats));
    };
    let codec = code.codec();
    let nibbles: Vec<u8> = bytes.iter().flat_map(|&b| [b & 15, b >> 4]).collect();
    let mut encoded = codec.encode(&nibbles).map_err(gf2)?;
    let flips = channel.inject(&mut encoded, seed).len() as u64;
    let mut values = vec![0u8; nibbles.len()];
    let mut erasures = vec![0u64; gf2_codes::batch::erasure_words(nibbles.len())];
    let stats = codec
        .decode_with_truth_into(&encoded, &nibbles, &mut values, &mut erasures)
        .map_err(gf2)?;
    for (b, pair) in bytes.iter_mut().zip(values.chunks_exact(2)) {
        *b = pair[0] | pair[1] << 4;
    }
    Ok((flips, stats))
}

fn gf2(e: gf2_codes::Gf2Error) -> AttentionError {
    AttentionError::InvalidParameter {
        name: "code",
        reason: e.to_string(),
    }
}
