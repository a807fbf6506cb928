//! The erasure policies ([`ErasurePolicy`]): what a decoded tile holds in
//! place of values whose codeword or group metadata was detected as
//! corrupted. `keep` leaves a value whose codeword was detected as
//! received (a wrong level is a bounded error), but a group whose scale or
//! offset was erased has no value to keep: its values are interpolated as
//! under `+interp` (default reach). Interpolation reads neighbours along the token axis, in the
//! section's stored (for rotated forms, rotated) coordinates; neighbours
//! outside the tile are decoded a row at a time and kept for the rest of
//! the tile ([`Neighbours`]), so a tile's values equal those of a whole
//! decode.

use gf2_codes::batch::erasure_words;

use super::decode::{DecodeScratch, grow};
use super::section::Section;
use crate::error::Result;
use crate::spec::{DEFAULT_INTERP_REACH, ErasurePolicy};

/// Rows outside a tile decoded (without the policy) for interpolation.
#[derive(Clone, Debug, Default)]
pub(crate) struct Neighbours {
    scratch: DecodeScratch,
    tokens: Vec<usize>,
    values: Vec<f32>,
    erased: Vec<u64>,
}

impl Neighbours {
    /// The value at `(token, channel)` unless it is erased.
    fn value(&mut self, section: &Section, token: usize, channel: usize) -> Result<Option<f32>> {
        let (ch, ew) = (section.channels, erasure_words(section.channels));
        let slot = match self.tokens.iter().position(|&t| t == token) {
            Some(i) => i,
            None => {
                let i = self.tokens.len();
                self.tokens.push(token);
                let values = grow(&mut self.values, (i + 1) * ch);
                let row = &mut values[i * ch..];
                section.decode_rows(token, token + 1, row, &mut self.scratch, false)?;
                let erased = grow(&mut self.erased, (i + 1) * ew);
                erased[i * ew..].copy_from_slice(&self.scratch.erasures[..ew]);
                i
            }
        };
        let erased = self.erased[slot * ew + channel / 64] >> (channel % 64) & 1 == 1;
        Ok((!erased).then(|| self.values[slot * ch + channel]))
    }
}

/// The paper's interpolation (eq. 29 and section 5.3.3), generalised to the
/// nearest valid neighbours at distances `d_l`, `d_r`.
pub(crate) fn interpolate(left: Option<(usize, f32)>, right: Option<(usize, f32)>) -> f32 {
    match (left, right) {
        (Some((1, l)), Some((1, r))) => 0.5 * (l + r),
        (Some((dl, l)), Some((dr, r))) => {
            let (dl, dr) = (dl as f32, dr as f32);
            (dr * l + dl * r) / (dl + dr)
        }
        (Some((_, v)), None) | (None, Some((_, v))) => v,
        (None, None) => 0.0,
    }
}

impl Section {
    /// Applies the form's erasure policy to the decoded rows `start..end`
    /// in `out`, whose erasure bits are in `scratch.erasures` (those from
    /// erased metadata also in `scratch.meta_erasures`, the only ones
    /// `keep` rebuilds).
    pub(crate) fn apply_policy(
        &self,
        start: usize,
        end: usize,
        out: &mut [f32],
        scratch: &mut DecodeScratch,
    ) -> Result<()> {
        // Only protected forms detect anything, so only they have erasures.
        let Some(protection) = self.coding.protection() else {
            return Ok(());
        };
        let ch = self.channels;
        let ew = erasure_words(ch);
        // The values rebuilt and how far interpolation reaches (`None`:
        // zeroed). Under `keep` only the groups whose metadata was erased
        // change, interpolated.
        let every = &scratch.erasures[..(end - start) * ew];
        let (reach, rebuilt) = match protection.policy {
            ErasurePolicy::Keep if scratch.meta_erasures_rows != end - start => return Ok(()),
            ErasurePolicy::Keep => (
                Some(DEFAULT_INTERP_REACH as usize),
                &scratch.meta_erasures[..(end - start) * ew],
            ),
            ErasurePolicy::Zero => (None, every),
            ErasurePolicy::Interpolate { reach } => (Some(reach as usize), every),
        };
        let (lo, hi) = scratch.neighbour_rows.unwrap_or((0, self.tokens));
        let (lo, hi) = (lo.min(start), hi.max(end).min(self.tokens));
        let block = scratch.neighbour_block;
        let erasures = &scratch.erasures[..(end - start) * ew];
        let neighbours = scratch.neighbours.get_or_insert_with(Default::default);
        neighbours.tokens.clear();
        let erased = |t: usize, c: usize| erasures[(t - start) * ew + c / 64] >> (c % 64) & 1 == 1;
        for r in 0..end - start {
            for (w, &word) in rebuilt[r * ew..][..ew].iter().enumerate() {
                let mut bits = word;
                while bits != 0 {
                    let c = 64 * w + bits.trailing_zeros() as usize;
                    bits &= bits - 1;
                    let t = start + r;
                    let (lo, hi) = match block {
                        Some(b) => (lo.max(t / b * b), hi.min((t / b + 1) * b)),
                        None => (lo, hi),
                    };
                    out[r * ch + c] = match reach {
                        None => 0.0,
                        Some(reach) => {
                            let mut neighbour = |t2: usize| -> Result<Option<f32>> {
                                if (start..end).contains(&t2) {
                                    Ok((!erased(t2, c)).then(|| out[(t2 - start) * ch + c]))
                                } else {
                                    neighbours.value(self, t2, c)
                                }
                            };
                            let mut left = None;
                            for d in 1..=reach.min(t - lo) {
                                if let Some(v) = neighbour(t - d)? {
                                    left = Some((d, v));
                                    break;
                                }
                            }
                            let mut right = None;
                            for d in 1..=reach.min(hi - 1 - t) {
                                if let Some(v) = neighbour(t + d)? {
                                    right = Some((d, v));
                                    break;
                                }
                            }
                            interpolate(left, right)
                        }
                    };
                }
            }
        }
        Ok(())
    }
}
