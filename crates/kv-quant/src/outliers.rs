//! KVQuant's dense-and-sparse split (Hooper et al., "KVQuant", 2024,
//! section 3.4), block by block: the form `+out<P>` keeps the P percent of
//! a block's values that stretch their groups' ranges most exact (f16,
//! with their positions), and quantizes the rest ([`SparseStore`]).
//!
//! # Which values are outliers
//!
//! An integer form's error in a group is about `n·(range/(2^b − 1))²/12`
//! for `n` values spanning `range`, so removing a group's extreme value
//! saves in proportion to how much it shrinks the group's squared range.
//! The split removes, one value at a time, the extreme (lowest or highest
//! remaining value of its group) whose removal shrinks its group's squared
//! range most, until the share is taken ([`OutlierShare::count`], rounded
//! up), a greedy choice over every group of the block at once (a max-heap
//! of one candidate per group). Per-channel groups (`int2-ch`) give
//! KVQuant's per-channel outliers of keys, per-token groups its per-token
//! outliers of values. KVQuant picks outliers by thresholds calibrated
//! offline (keys) or by magnitude per token (values); the greedy range
//! criterion needs no calibration and, for a group with one far value,
//! picks the same value. Each group keeps at least two values. A removed
//! value is replaced in the dense rows by the nearest bound of its group's
//! remaining range, so it stretches nothing, and decoded rows read the
//! exact value in its place.
//!
//! # Stored bits
//!
//! Positions (row-major `token·channels + channel` in the block, 16 bits
//! each where the block has at most 65,536 values, 32 otherwise, ascending)
//! and values (f16) are two [`ProtectedTable`]s under the form's metadata
//! code: positions are metadata (faulted under
//! [`FaultTarget::Metadata`]), values are values (under
//! [`FaultTarget::Values`]); [`FaultTarget::Everything`] hits both. A
//! position that decodes outside the block places nothing (its value is
//! lost, and its word was counted by the ledger). True bytes: both tables
//! with their check words, beside the dense store's.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

use gf2_codes::channel::FaultChannel;
use half::f16;

use crate::error::{KvQuantError, Result};
use crate::layout::GroupLayout;
use crate::spec::{CacheForm, Granularity, MetaProtection, OutlierShare, Quantizer};
use crate::store::{DecodeScratch, FaultTarget, Injection, KvDecodeStats, KvStore, ScrubStats};
use crate::table::ProtectedTable;

/// Salt of the positions' fault stream (apart from the values').
const POSITION_SALT: u64 = 0x6a09_e667_f3bc_c908;
/// Salt of the outlier values' fault stream (apart from the dense store's).
const VALUE_SALT: u64 = 0xbb67_ae85_84ca_a73b;

/// Removes the outliers of `rows` (`tokens × channels`, row-major) in
/// place, as the module docs describe, for groups of `tokens_per_group`
/// tokens by `channels_per_group` channels; returns their positions
/// (ascending) and original values. `count` is capped so that every group
/// keeps two values.
pub fn split_outliers(
    rows: &mut [f32],
    (tokens, channels): (usize, usize),
    (tokens_per_group, channels_per_group): (usize, usize),
    count: usize,
) -> Result<Vec<(u32, f32)>> {
    if rows.len() != tokens * channels {
        return Err(KvQuantError::ShapeMismatch {
            what: "rows",
            expected: tokens * channels,
            found: rows.len(),
        });
    }
    if u32::try_from(rows.len()).is_err() {
        return Err(KvQuantError::InvalidParameter {
            name: "rows",
            reason: format!("{} values do not fit 32-bit positions", rows.len()),
        });
    }
    let layout = GroupLayout::new(tokens, channels, tokens_per_group, channels_per_group)?;
    let groups = layout.groups();
    // Every position, sorted by (group, value): each group a contiguous run.
    let mut order: Vec<u32> = (0..rows.len() as u32).collect();
    let group_of = |p: u32| layout.group(p as usize / channels, p as usize % channels);
    order.sort_unstable_by(|&a, &b| {
        group_of(a)
            .cmp(&group_of(b))
            .then(rows[a as usize].total_cmp(&rows[b as usize]))
            .then(a.cmp(&b))
    });
    let mut bounds = vec![0usize; groups + 1];
    for &p in &order {
        bounds[group_of(p) + 1] += 1;
    }
    for g in 0..groups {
        bounds[g + 1] += bounds[g];
    }
    let value = |i: usize| f64::from(rows[order[i] as usize]);
    // The remaining run of each group, `lo..hi` in `order`.
    let mut lo: Vec<usize> = bounds[..groups].to_vec();
    let mut hi: Vec<usize> = bounds[1..].to_vec();
    let candidate = |g: usize, lo: usize, hi: usize| -> Option<Candidate> {
        if hi - lo <= 2 {
            return None;
        }
        let range = value(hi - 1) - value(lo);
        let without_top = value(hi - 2) - value(lo);
        let without_bottom = value(hi - 1) - value(lo + 1);
        let top = without_top <= without_bottom;
        let left = if top { without_top } else { without_bottom };
        Some(Candidate {
            gain: range * range - left * left,
            group: g,
            top,
        })
    };
    let mut heap: BinaryHeap<Candidate> = (0..groups)
        .filter_map(|g| candidate(g, lo[g], hi[g]))
        .collect();
    let mut taken = Vec::with_capacity(count.min(rows.len()));
    while taken.len() < count {
        let Some(c) = heap.pop() else { break };
        let g = c.group;
        if c.top {
            hi[g] -= 1;
            taken.push(order[hi[g]]);
        } else {
            taken.push(order[lo[g]]);
            lo[g] += 1;
        }
        if let Some(next) = candidate(g, lo[g], hi[g]) {
            heap.push(next);
        }
    }
    let mut out: Vec<(u32, f32)> = taken.iter().map(|&p| (p, rows[p as usize])).collect();
    for &p in &taken {
        let g = group_of(p);
        let (low, high) = (rows[order[lo[g]] as usize], rows[order[hi[g] - 1] as usize]);
        let x = &mut rows[p as usize];
        *x = x.clamp(low, high);
    }
    out.sort_unstable_by_key(|&(p, _)| p);
    Ok(out)
}

/// One removable extreme: the heap orders by gain, then by lower group
/// (so the choice is deterministic).
#[derive(Clone, Copy, Debug)]
struct Candidate {
    gain: f64,
    group: usize,
    top: bool,
}

impl PartialEq for Candidate {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Candidate {}

impl PartialOrd for Candidate {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Candidate {
    fn cmp(&self, other: &Self) -> Ordering {
        self.gain
            .total_cmp(&other.gain)
            .then(other.group.cmp(&self.group))
    }
}

/// A block of rows in a `+out` form: the dense rows in a [`KvStore`] of
/// the form without outliers, the outliers in two protected tables
/// beside it (see the module docs).
#[derive(Clone, Debug, PartialEq)]
pub struct SparseStore {
    form: CacheForm,
    dense: KvStore,
    /// Positions as stored (16-bit words where the block allows).
    positions: ProtectedTable,
    /// Values as stored (f16 words).
    values: ProtectedTable,
    /// The outliers as last decoded: in-block positions (ascending, out of
    /// range ones dropped) and values.
    decoded: Vec<(u32, f32)>,
    /// How the tables' words decode now (values: `values`, positions:
    /// `metadata`).
    stats: KvDecodeStats,
}

impl SparseStore {
    /// `rows` (`tokens × channels`, row-major) in `form` (an integer form
    /// with `+out`): its outliers split off and the rest quantized in the
    /// form without them. A form without `+out`, or with segments, is
    /// refused (a paged cache keeps sink blocks exact beside it).
    pub fn quantize(form: CacheForm, rows: &[f32], tokens: usize, channels: usize) -> Result<Self> {
        let share = Self::share_of(&form)?;
        let dense_form = form.without_outliers();
        let grouping = grouping(&dense_form, tokens, channels)?;
        let mut dense_rows = rows.to_vec();
        let count = share.count(tokens * channels);
        let outliers = split_outliers(&mut dense_rows, (tokens, channels), grouping, count)?;
        let dense = KvStore::quantize(dense_form, &dense_rows, tokens, channels)?;
        let meta = meta_protection(&form);
        let wide = tokens * channels > 1 << 16;
        let mut position_bytes = Vec::with_capacity(outliers.len() * if wide { 4 } else { 2 });
        let mut value_bytes = Vec::with_capacity(outliers.len() * 2);
        for &(p, v) in &outliers {
            if wide {
                position_bytes.extend_from_slice(&p.to_le_bytes());
            } else {
                position_bytes.extend_from_slice(&(p as u16).to_le_bytes());
            }
            value_bytes.extend_from_slice(&f16::from_f32(v).to_le_bytes());
        }
        let mut store = Self {
            form,
            dense,
            positions: ProtectedTable::new(&position_bytes, meta),
            values: ProtectedTable::new(&value_bytes, meta).with_f16_range(),
            decoded: Vec::new(),
            stats: KvDecodeStats::default(),
        };
        store.reread();
        Ok(store)
    }

    fn share_of(form: &CacheForm) -> Result<OutlierShare> {
        if !form.segments().is_empty() {
            return Err(KvQuantError::InvalidParameter {
                name: "form",
                reason: format!(
                    "{form}: a sparse store holds a block of coded rows; its exact sink \
                     tokens are kept beside it"
                ),
            });
        }
        form.outliers()
            .ok_or_else(|| KvQuantError::InvalidParameter {
                name: "form",
                reason: format!("{form} keeps no outliers (spell +out<P>)"),
            })
    }

    /// Stored bytes of a block of `tokens × channels` values in `form`,
    /// without building one (for pool sizes).
    pub fn stored_bytes_of(form: CacheForm, tokens: usize, channels: usize) -> Result<usize> {
        let share = Self::share_of(&form)?;
        let dense = KvStore::zeroed(form.without_outliers(), tokens, channels)?.stored_bytes();
        let count = share.count(tokens * channels).min(tokens * channels);
        let wide = tokens * channels > 1 << 16;
        let meta = meta_protection(&form);
        Ok(dense
            + ProtectedTable::stored_len(count * if wide { 4 } else { 2 }, meta)
            + ProtectedTable::stored_len(count * 2, meta))
    }

    /// The form, `+out` included.
    pub fn form(&self) -> &CacheForm {
        &self.form
    }

    /// Tokens held.
    pub fn tokens(&self) -> usize {
        self.dense.tokens()
    }

    /// Channels per token.
    pub fn channels(&self) -> usize {
        self.dense.channels()
    }

    /// The dense rows' store (the form without `+out`).
    pub fn dense(&self) -> &KvStore {
        &self.dense
    }

    /// The outliers as they read now: in-block positions, ascending, and
    /// values.
    pub fn outliers(&self) -> &[(u32, f32)] {
        &self.decoded
    }

    /// Every stored byte: the dense store's and both tables' with their
    /// check words.
    pub fn stored_bytes(&self) -> usize {
        self.dense.stored_bytes() + self.positions.stored_bytes() + self.values.stored_bytes()
    }

    /// Decodes rows `start..start + count` into `out` (`count × channels`):
    /// the dense rows, then each outlier of those rows in its place. The
    /// statistics add the tables' words to the dense store's in the tile
    /// holding the block's first row, so tiles add up to one whole read.
    pub fn decode_rows_into(
        &self,
        start: usize,
        count: usize,
        out: &mut [f32],
        scratch: &mut DecodeScratch,
    ) -> Result<KvDecodeStats> {
        let mut stats = self.dense.decode_rows_into(start, count, out, scratch)?;
        let ch = self.channels();
        let (first, end) = ((start * ch) as u32, ((start + count) * ch) as u32);
        let from = self.decoded.partition_point(|&(p, _)| p < first);
        for &(p, v) in self.decoded[from..].iter().take_while(|&&(p, _)| p < end) {
            out[(p - first) as usize] = v;
        }
        if start == 0 && count > 0 {
            stats += self.stats;
        }
        Ok(stats)
    }

    /// Faults from `channel` with `seed` in the chosen buffers: the dense
    /// store's as [`KvStore::inject`] lays them out; the outlier values'
    /// flips as `exact` (the dense store of a block has no exact rows) and
    /// the positions' as `tables`, each from a salted stream of `seed`.
    pub fn inject(
        &mut self,
        channel: &dyn FaultChannel,
        seed: u64,
        target: FaultTarget,
    ) -> Injection {
        let mut injection = self.dense.inject(channel, seed, target);
        if target != FaultTarget::Metadata {
            injection.exact = self.values.inject(channel, seed ^ VALUE_SALT);
        }
        if target != FaultTarget::Values {
            injection.tables = self.positions.inject(channel, seed ^ POSITION_SALT);
        }
        self.reread();
        injection
    }

    /// One scrubbing pass over the dense store and both tables (their
    /// words under `values` and `metadata`).
    pub fn scrub(&mut self) -> Result<ScrubStats> {
        let mut stats = self.dense.scrub()?;
        stats.values += self.values.scrub();
        stats.metadata += self.positions.scrub();
        self.reread();
        Ok(stats)
    }

    /// Decodes both tables into `decoded` and `stats`.
    fn reread(&mut self) {
        let (positions, position_stats) = self.positions.read();
        let (values, value_stats) = self.values.read();
        let values = values
            .chunks_exact(2)
            .map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32());
        let total = (self.tokens() * self.channels()) as u64;
        let wide = total > 1 << 16;
        let positions: Vec<u32> = if wide {
            positions
                .chunks_exact(4)
                .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect()
        } else {
            positions
                .chunks_exact(2)
                .map(|b| u32::from(u16::from_le_bytes([b[0], b[1]])))
                .collect()
        };
        let mut decoded: Vec<(u32, f32)> = positions
            .into_iter()
            .zip(values)
            .filter(|&(p, _)| u64::from(p) < total)
            .collect();
        decoded.sort_by_key(|&(p, _)| p);
        self.decoded = decoded;
        self.stats = KvDecodeStats {
            values: value_stats,
            metadata: position_stats,
            erased_values: 0,
        };
    }

    /// How the outlier tables' words decode now.
    pub fn outlier_stats(&self) -> KvDecodeStats {
        self.stats
    }

    /// Whether both outlier tables hold their words as written.
    pub fn outliers_pristine(&self) -> bool {
        self.positions.is_pristine() && self.values.is_pristine()
    }
}

/// The metadata code of `form` (none for unprotected forms).
fn meta_protection(form: &CacheForm) -> MetaProtection {
    form.protection()
        .map_or(MetaProtection::Unprotected, |p| p.metadata)
}

/// The group shape (`tokens × channels` of one group) of an integer
/// `form` over a block of `tokens` rows.
fn grouping(form: &CacheForm, tokens: usize, channels: usize) -> Result<(usize, usize)> {
    match form.quantizer() {
        Quantizer::Int(s) => match s.granularity {
            Granularity::PerToken { group } => Ok((1, group.unwrap_or(channels))),
            Granularity::PerChannel { tokens: t } => Ok((t.unwrap_or(tokens), 1)),
            Granularity::PerTensor => Ok((tokens, channels)),
        },
        _ => Err(KvQuantError::InvalidParameter {
            name: "form",
            reason: format!("{form}: +out splits the groups of an integer form"),
        }),
    }
}

#[cfg(test)]
mod tests;
