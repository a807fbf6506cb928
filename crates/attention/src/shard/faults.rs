//! Faults in a [`ShardLayer`]'s compressed middle and folded chunks.
//!
//! What a target reaches:
//! - `values` and `everything`: the key coefficient codes and the VQ
//!   indices (the bulk of the bytes). Under a form with a code
//!   (`shard+secded84`, `shard+golay24`, their interleaved layouts) each
//!   buffer is stored as its 4-bit nibbles (low then high of each byte)
//!   encoded by the gf2-codes codec; flips land in the encoded bytes, the
//!   codec corrects what it can and flags the rest, and a flagged word
//!   keeps its received data (`+keep`: a wrong coefficient or index).
//!   Without a code the flips land in the codes themselves.
//! - `metadata` and `everything`: each run's f16 scales (the keys'
//!   per-component steps, the values' channel maxima) and the layer's
//!   fitted tables (the key basis, the value codebook), stored as
//!   kv-quant [`ProtectedTable`]s under the form's metadata code (RM(2,5)
//!   under SECDED and Golay codes, none for an unprotected form), as the
//!   per-token forms store their scales; a word that decodes outside the
//!   range of f16 words written is detected, and a detected word reads as
//!   zero (a component or channel dropped, never a huge scale).
//!
//! Every flip is seeded and accounted: corrected, detected, miscorrected or
//! silent, from the codec's comparison with the words as written.
//!
//! Not exposed: the exact sink and window rows, the decode stream, and
//! NF4 values (`-vnf4`, refused).

use std::sync::Arc;

use gf2_codes::DecodeStats;
use gf2_codes::channel::FaultChannel;
use half::f16;
use kv_quant::{FaultTarget, MetaProtection, ProtectedTable};

use super::{MiddleValues, ShardLayer};
use crate::error::{AttentionError, Result};
use crate::stored::SharedTable;

/// What one injection into a layer did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ShardFaults {
    /// Bits flipped (in the encoded bytes under a code), in every buffer.
    pub flips: u64,
    /// Decode outcomes of the key codes' codewords (without a code, one
    /// word per byte: changed bytes are silent).
    pub keys: DecodeStats,
    /// The same for the VQ indices.
    pub values: DecodeStats,
    /// Decode outcomes of the keys' f16 per-component steps (one word
    /// each), under targets that reach metadata.
    pub key_scales: DecodeStats,
    /// The same for the values' f16 channel maxima.
    pub value_scales: DecodeStats,
    /// The same for the 16-bit words of the fitted tables (the key basis
    /// and the value codebook).
    pub tables: DecodeStats,
}

/// Stream salts: each buffer draws its flips from its own stream of the
/// run's seed.
const VALUE_SALT: u64 = 0x9e37_79b9_7f4a_7c15;
const KEY_SCALE_SALT: u64 = 0x2545_f491_4f6c_dd1d;
const VALUE_SCALE_SALT: u64 = 0x6a09_e667_f3bc_c909;
const KEY_TABLE_SALT: u64 = 0xbb67_ae85_84ca_a73b;
const VALUE_TABLE_SALT: u64 = 0x3c6e_f372_fe94_f82b;

impl ShardLayer {
    /// Injects `channel`'s faults, drawn from `seed`, into the stored bits
    /// `target` reaches (module docs), decodes them through the form's
    /// codes, and keeps what decoding gave for attention.
    pub fn inject(
        &mut self,
        channel: &dyn FaultChannel,
        seed: u64,
        target: FaultTarget,
    ) -> Result<ShardFaults> {
        if let Some(c) = self.compressed.first()
            && matches!(&*c.values, MiddleValues::Nf4(_))
        {
            return Err(AttentionError::InvalidParameter {
                name: "faults",
                reason: format!("{}: faults reach VQ values only, not NF4", self.form),
            });
        }
        let code = self.form.protection().map(|p| p.code);
        let meta = self.metadata_protection();
        let (codes, metadata) = (
            target != FaultTarget::Metadata,
            target != FaultTarget::Values,
        );
        let mut out = ShardFaults::default();
        for (i, c) in self.compressed.iter_mut().enumerate() {
            // The middle draws from `seed` itself, each folded chunk from its own stream.
            let seed = seed ^ (i as u64).wrapping_mul(0xd1b5_4a32_d192_ed03);
            let keys = Arc::make_mut(&mut c.keys);
            if codes {
                let (flips, stats) = hit(keys.codes_mut(), code, channel, seed)?;
                out.flips += flips;
                out.keys += stats;
            }
            if metadata {
                let (flips, stats) =
                    hit_f16(keys.scales_mut(), meta, channel, seed ^ KEY_SCALE_SALT);
                out.flips += flips;
                out.key_scales += stats;
            }
            if let MiddleValues::Vq(vq) = Arc::make_mut(&mut c.values) {
                if codes {
                    let (flips, stats) = hit(vq.indices_mut(), code, channel, seed ^ VALUE_SALT)?;
                    out.flips += flips;
                    out.values += stats;
                }
                if metadata {
                    let (flips, stats) =
                        hit_f16(vq.max_mut(), meta, channel, seed ^ VALUE_SCALE_SALT);
                    out.flips += flips;
                    out.value_scales += stats;
                }
            }
        }
        if metadata {
            self.inject_tables(channel, seed, &mut out)?;
        }
        Ok(out)
    }

    /// The code over the scales and tables: the form's metadata code
    /// (none for an unprotected form).
    pub(super) fn metadata_protection(&self) -> MetaProtection {
        self.form
            .protection()
            .map_or(MetaProtection::Unprotected, |p| p.metadata)
    }

    /// Faults into one stored copy of the layer's fitted tables (the key
    /// basis and the value codebook every run shares); every run then
    /// reads them as decoded.
    fn inject_tables(
        &mut self,
        channel: &dyn FaultChannel,
        seed: u64,
        out: &mut ShardFaults,
    ) -> Result<()> {
        let Some(first) = self.compressed.first() else {
            return Ok(());
        };
        let values = match &*first.values {
            MiddleValues::Vq(vq) => Some(Arc::new(vq.tables())),
            MiddleValues::Nf4(_) => None,
        };
        let mut keys = SharedTable::new(Arc::new(first.keys.tables()), &self.form);
        // Words counted where the table was hit, as kv-eval counts the
        // `vq` and `pca-*` tables.
        let (hit, changed) = keys.inject(channel, seed ^ KEY_TABLE_SALT, FaultTarget::Metadata)?;
        if hit.total() > 0 {
            out.flips += hit.total() as u64;
            out.tables += keys.stats();
        }
        if changed {
            for c in &mut self.compressed {
                Arc::make_mut(&mut c.keys).share_basis(keys.read())?;
            }
        }
        if let Some(vq) = values {
            let mut codebook = SharedTable::new(vq, &self.form);
            let (hit, changed) =
                codebook.inject(channel, seed ^ VALUE_TABLE_SALT, FaultTarget::Metadata)?;
            if hit.total() > 0 {
                out.flips += hit.total() as u64;
                out.tables += codebook.stats();
            }
            if changed {
                for c in &mut self.compressed {
                    if let MiddleValues::Vq(vq) = Arc::make_mut(&mut c.values) {
                        vq.share_codebook(codebook.read());
                    }
                }
            }
        }
        Ok(())
    }
}

/// Bytes of `bytes` as stored under `code` (their nibbles encoded).
pub(super) fn protected_len(bytes: usize, code: Option<gf2_codes::Int4Code>) -> usize {
    match code {
        Some(c) => c.codec().encoded_len(2 * bytes),
        None => bytes,
    }
}

/// Flips bits of the f16 `values` (held in f32) stored as a
/// [`ProtectedTable`] under `protection` (checked against the range
/// written), and leaves them as read (a detected word as zero); returns
/// the flips and the words' outcomes.
pub(crate) fn hit_f16(
    values: &mut [f32],
    protection: MetaProtection,
    channel: &dyn FaultChannel,
    seed: u64,
) -> (u64, DecodeStats) {
    let bytes: Vec<u8> = values
        .iter()
        .flat_map(|&v| f16::from_f32(v).to_le_bytes())
        .collect();
    let mut table = ProtectedTable::new(&bytes, protection).with_f16_range();
    let flips = table.inject(channel, seed).len() as u64;
    let (read, stats) = table.read();
    if flips > 0 {
        for (v, b) in values.iter_mut().zip(read.chunks_exact(2)) {
            *v = f16::from_le_bytes([b[0], b[1]]).to_f32();
        }
    }
    (flips, stats)
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
