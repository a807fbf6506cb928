//! Adaptive protection (the ECC paper's future work): each layer's or each
//! block's code chosen from what reading it under a detecting code showed.
//!
//! A first pass stores everything under SECDED(8,4) and counts, per layer
//! or per block of rows, the value codewords corrected and detected (a
//! scrubber's view of that memory: [`LayerCodewords`]). From those counts
//! each region's raw bit error rate is estimated, and the region is
//! promoted to Golay(24,12) where the estimate reaches `promote_at`,
//! demoted to Hamming(7,4) (one byte in eight less, no detection) where it
//! stays below `demote_at`, and kept under SECDED between. The re-encode
//! backend writes every window's stores anew, so the chosen codes take
//! effect at the next write: per layer through a layer policy
//! ([`layer_forms`]), per block through [`BlockForms`]. [`HotMap`] is the
//! non-uniform fault map it is measured on (through `FaultSpec::hot`);
//! `kv-eval adapt` runs the whole experiment.
//!
//! [`BlockForms`]: crate::cache::BlockForms

use crate::cache::mix;
use crate::error::{EvalError, Result};

/// Where the memory is worse than the rest (the hot part of a
/// [`HotMap`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum HotRegion {
    /// Whole layers: bit `l` set for layer `l` (layers 0..64).
    Layers(u64),
    /// Blocks of `block` consecutive rows of each layer's key and value
    /// stores, each hot with probability `fraction` (a page of failing
    /// cells).
    Blocks {
        /// Rows per block.
        block: usize,
        /// Expected fraction of hot blocks.
        fraction: f64,
    },
    /// Single rows of each layer's key and value stores, each hot with
    /// probability `fraction` (a few failing rows).
    Rows {
        /// Expected fraction of hot rows.
        fraction: f64,
    },
}

/// A non-uniform fault map: the region `region` sees the bit error rate
/// `ber` instead of the run's. Which blocks or rows are hot is drawn from
/// the run's fault seed, so every run of one seed sees the same map (the
/// same memory), whatever its forms.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct HotMap {
    /// Where.
    pub region: HotRegion,
    /// Its bit error rate.
    pub ber: f64,
}

impl HotMap {
    /// Refuses a rate or fraction outside `[0, 1]` and empty blocks.
    pub fn check(&self) -> Result<()> {
        let bad = |name, reason: String| Err(EvalError::InvalidParameter { name, reason });
        if !(0.0..=1.0).contains(&self.ber) {
            return bad("hot ber", format!("{} is not in [0, 1]", self.ber));
        }
        match self.region {
            HotRegion::Layers(_) => Ok(()),
            HotRegion::Blocks { block: 0, .. } => bad("hot blocks", "blocks of 0 rows".into()),
            HotRegion::Blocks { fraction, .. } | HotRegion::Rows { fraction }
                if !(0.0..=1.0).contains(&fraction) =>
            {
                bad("hot fraction", format!("{fraction} is not in [0, 1]"))
            }
            _ => Ok(()),
        }
    }

    /// Whether the map is drawn per row or block rather than per layer
    /// (faults are then injected row range by row range).
    pub fn is_row_resolved(&self) -> bool {
        !matches!(self.region, HotRegion::Layers(_))
    }

    /// Whether the whole of `layer` is hot (a layer map only).
    pub fn hot_layer(&self, layer: usize) -> bool {
        matches!(self.region, HotRegion::Layers(m) if layer < 64 && m >> layer & 1 == 1)
    }

    /// Whether row `row` of `layer`'s keys (`part` 0) or values (1) is hot
    /// under the map drawn from `seed`.
    pub fn hot_row(&self, seed: u64, layer: usize, part: usize, row: usize) -> bool {
        let draw = |salt: u64, unit: usize, fraction: f64| {
            let h = mix(seed ^ mix(salt ^ mix((2 * layer + part) as u64 ^ mix(unit as u64))));
            ((h >> 11) as f64) / ((1u64 << 53) as f64) < fraction
        };
        match self.region {
            HotRegion::Layers(_) => self.hot_layer(layer),
            HotRegion::Blocks { block, fraction } => draw(0xb10c, row / block.max(1), fraction),
            HotRegion::Rows { fraction } => draw(0x5043, row, fraction),
        }
    }
}

/// Value-codeword statistics of a region of the cache: one layer's stores
/// (keys and values), or one block of one part.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct LayerCodewords {
    /// Codewords read.
    pub words: u64,
    /// Of those, corrected.
    pub corrected: u64,
    /// Of those, detected as uncorrectable.
    pub detected: u64,
}

impl LayerCodewords {
    /// The counts of decode statistics.
    pub fn of(s: &gf2_codes::DecodeStats) -> Self {
        Self {
            words: s.words,
            corrected: s.corrected,
            detected: s.detected,
        }
    }
}

impl std::ops::AddAssign for LayerCodewords {
    fn add_assign(&mut self, r: Self) {
        self.words += r.words;
        self.corrected += r.corrected;
        self.detected += r.detected;
    }
}

/// A layer's protection.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Level {
    /// Hamming(7,4): 7 bits per value, single flips corrected, nothing
    /// detected.
    Hamming,
    /// SECDED(8,4): 8 bits per value, single flips corrected, double detected.
    Secded,
    /// Golay(24,12): 8 bits per value, three flips per word corrected.
    Golay,
}

/// When a layer moves up or down.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdaptRule {
    /// Promote to Golay at an estimated bit error rate of at least this.
    pub promote_at: f64,
    /// Demote to Hamming below this.
    pub demote_at: f64,
}

impl AdaptRule {
    /// Refuses thresholds that are not `0 ≤ demote_at ≤ promote_at ≤ 1`.
    pub fn check(&self) -> Result<()> {
        let ok = (0.0..=1.0).contains(&self.demote_at)
            && (0.0..=1.0).contains(&self.promote_at)
            && self.demote_at <= self.promote_at;
        if ok {
            Ok(())
        } else {
            Err(EvalError::InvalidParameter {
                name: "adaptive thresholds",
                reason: format!(
                    "need 0 ≤ demote-at ({}) ≤ promote-at ({}) ≤ 1",
                    self.demote_at, self.promote_at
                ),
            })
        }
    }
}

/// A layer's raw bit error rate estimated from its SECDED(8,4) statistics:
/// a word with one flip is corrected (probability ≈ 8p), one with two is
/// detected (≈ 28p²), so `p ≈ (corrected + 2·detected) / (8·words)`.
/// `None` for a layer nothing was read from.
pub fn estimate(layer: &LayerCodewords) -> Option<f64> {
    (layer.words > 0)
        .then(|| (layer.corrected + 2 * layer.detected) as f64 / (8 * layer.words) as f64)
}

/// The level of a region whose estimated bit error rate is `p`.
fn level_of(p: f64, rule: AdaptRule) -> Level {
    if p >= rule.promote_at {
        Level::Golay
    } else if p < rule.demote_at {
        Level::Hamming
    } else {
        Level::Secded
    }
}

/// Each layer's level under `rule`, from its observed statistics.
pub fn choose(layers: &[LayerCodewords], rule: AdaptRule) -> Result<Vec<Level>> {
    rule.check()?;
    layers
        .iter()
        .enumerate()
        .map(|(l, s)| {
            let p = estimate(s).ok_or_else(|| EvalError::InvalidParameter {
                name: "observation",
                reason: format!("layer {l} was never read: observe more tokens"),
            })?;
            Ok(level_of(p, rule))
        })
        .collect()
}

/// Each block's level under `rule`, from its observed statistics
/// (`blocks[2·layer + part][block]`, as [`CacheStats::blocks`] holds them).
/// A block nothing was read from keeps SECDED, the observation's code.
///
/// [`CacheStats::blocks`]: crate::cache::CacheStats::blocks
pub fn choose_blocks(blocks: &[Vec<LayerCodewords>], rule: AdaptRule) -> Result<Vec<Vec<Level>>> {
    rule.check()?;
    Ok(blocks
        .iter()
        .map(|part| {
            part.iter()
                .map(|s| estimate(s).map_or(Level::Secded, |p| level_of(p, rule)))
                .collect()
        })
        .collect())
}

/// The per-layer spelling (kv-quant's `LayerForms`) storing each layer in
/// its level's form, `forms` giving the Hamming, SECDED and Golay forms
/// (for example `int4+golay24+interp`): `0,5:int4+golay24+interp;1-4:...`,
/// every level that occurs, no `*`.
pub fn layer_forms(levels: &[Level], forms: [&str; 3]) -> String {
    [Level::Hamming, Level::Secded, Level::Golay]
        .into_iter()
        .zip(forms)
        .filter_map(|(level, form)| {
            let layers: Vec<String> = (0..levels.len())
                .filter(|&l| levels[l] == level)
                .map(|l| l.to_string())
                .collect();
            (!layers.is_empty()).then(|| format!("{}:{form}", layers.join(",")))
        })
        .collect::<Vec<_>>()
        .join(";")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seen(words: u64, corrected: u64, detected: u64) -> LayerCodewords {
        LayerCodewords {
            words,
            corrected,
            detected,
        }
    }

    #[test]
    fn layers_move_by_their_estimated_rate() {
        let rule = AdaptRule {
            promote_at: 1e-4,
            demote_at: 1e-6,
        };
        // 1e6 words with 800 corrected: p = 800 / 8e6 = 1e-4.
        let layers = [
            seen(1_000_000, 800, 0),
            seen(1_000_000, 7, 0),
            seen(1_000_000, 80, 1),
        ];
        assert_eq!(estimate(&layers[0]), Some(1e-4));
        assert_eq!(
            choose(&layers, rule).unwrap(),
            [Level::Golay, Level::Hamming, Level::Secded]
        );
        assert_eq!(
            layer_forms(
                &choose(&layers, rule).unwrap(),
                [
                    "int4+hamming74+interp",
                    "int4+secded84+interp",
                    "int4+golay24+interp"
                ]
            ),
            "1:int4+hamming74+interp;2:int4+secded84+interp;0:int4+golay24+interp"
        );
    }

    #[test]
    fn bad_rules_and_unread_layers_are_errors() {
        let bad = AdaptRule {
            promote_at: 1e-6,
            demote_at: 1e-4,
        };
        assert!(choose(&[seen(10, 0, 0)], bad).is_err());
        let nan = AdaptRule {
            promote_at: f64::NAN,
            demote_at: 0.0,
        };
        assert!(nan.check().is_err());
        let rule = AdaptRule {
            promote_at: 1e-4,
            demote_at: 1e-6,
        };
        assert!(choose(&[seen(0, 0, 0)], rule).is_err());
    }
}
