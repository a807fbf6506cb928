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
//! range most, until the share is taken ([`SparseSpec::count`], rounded
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
//! [`FaultTarget::Values`]); [`FaultTarget::Everything`] hits both. An
//! entry whose position or value word the code detects as corrupted is
//! dropped (the dense store's clamped bound reads in its place; counted
//! as an erased value), and a position that decodes outside the coded rows
//! places nothing (a fault the code let through, counted by the ledger).
//! True bytes: both tables with their check words, beside the dense
//! store's. The dense store also codes placeholders of the exact rows
//! (copies of the first coded row, which the exact rows overwrite when
//! read): their words are stored bits, faulted and counted like the rest.
//!
//! # Clipping (`+clip`)
//!
//! After the split, `+clip` clamps each dense group to the range that
//! minimises its squared error under the form's uniform levels
//! ([`clip_groups`]); the stored format is unchanged (the clamped group's
//! minimum and maximum are the clipped bounds).

use std::cmp::Ordering;
use std::collections::BinaryHeap;

use gf2_codes::DecodeOutcome;
use gf2_codes::channel::{FaultChannel, Flips};
use half::f16;

use crate::error::{KvQuantError, Result, check_channels, check_finite, check_len};
use crate::layout::GroupLayout;
use crate::spec::{CacheForm, Granularity, MetaProtection, Quantizer, SparseSpec};
use crate::store::{DecodeScratch, FaultTarget, Injection, KvDecodeStats, KvStore, ScrubStats};
use crate::table::ProtectedTable;

/// Salt of the positions' fault stream (apart from the values').
const POSITION_SALT: u64 = 0x6a09_e667_f3bc_c908;
/// Salt of the outlier values' fault stream (apart from the dense store's).
const VALUE_SALT: u64 = 0xbb67_ae85_84ca_a73b;
/// Salt of the exact rows' fault stream.
const EXACT_SALT: u64 = 0x3c6e_f372_fe94_f82b;

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
    check_shape(rows, tokens, channels)?;
    if u32::try_from(rows.len()).is_err() {
        return Err(KvQuantError::InvalidParameter {
            name: "rows",
            reason: format!("{} values do not fit 32-bit positions", rows.len()),
        });
    }
    let layout = GroupLayout::new(tokens, channels, tokens_per_group, channels_per_group)?;
    let groups = layout.groups();
    let group_of = |p: u32| layout.group(p as usize / channels, p as usize % channels);
    // Every position, sorted by (group, value): each group a contiguous run.
    let (mut order, bounds) = group_runs(&layout, rows.len(), channels);
    for g in 0..groups {
        order[bounds[g]..bounds[g + 1]].sort_unstable_by(|&a, &b| {
            rows[a as usize]
                .total_cmp(&rows[b as usize])
                .then(a.cmp(&b))
        });
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

/// Refuses rows of no channels, and a non-finite value (the split and the
/// clipping order values; a paged cache clamps its staged rows first).
fn check_shape(rows: &[f32], tokens: usize, channels: usize) -> Result<()> {
    check_channels(channels)?;
    check_len("rows", tokens * channels, rows.len())?;
    check_finite(rows, channels)
}

/// How many values the split can take from a `layout` over `len` values
/// of `channels` columns: every group keeps two.
fn removable(layout: &GroupLayout, len: usize, channels: usize) -> usize {
    let (_, bounds) = group_runs(layout, len, channels);
    bounds
        .windows(2)
        .map(|r| (r[1] - r[0]).saturating_sub(2))
        .sum()
}

/// The positions `0..len` of a row-major matrix of `channels` columns
/// grouped by `layout`: positions in group order (ascending within a
/// group) and each group's run `bounds[g]..bounds[g + 1]`.
fn group_runs(layout: &GroupLayout, len: usize, channels: usize) -> (Vec<u32>, Vec<usize>) {
    let groups = layout.groups();
    let group_of = |p: usize| layout.group(p / channels, p % channels);
    let mut bounds = vec![0usize; groups + 1];
    for p in 0..len {
        bounds[group_of(p) + 1] += 1;
    }
    for g in 0..groups {
        bounds[g + 1] += bounds[g];
    }
    let mut next = bounds.clone();
    let mut order = vec![0u32; len];
    for p in 0..len {
        let g = group_of(p);
        order[next[g]] = p as u32;
        next[g] += 1;
    }
    (order, bounds)
}

/// Fractions of the way from a group's bound to its mean that
/// [`clip_groups`] tries for each bound (0 keeps the bound).
pub const CLIP_STEPS: [f64; 9] = [0.0, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5];

/// Clamps each group of `rows` (`tokens × channels`, groups of
/// `tokens_per_group × channels_per_group`) to the range that minimises
/// the group's squared error under asymmetric uniform levels of `bits`
/// bits (`x̂ = lo + s·round((clamp(x) − lo)/s)`, `s = (hi − lo)/(2^b − 1)`),
/// (values at the sorted positions `skip`, an outlier's placeholder, take no
/// part in the search but are clamped with their group),
/// among the ranges whose low bound is `min + f·(mean − min)` and high
/// bound `max − g·(max − mean)` for `f`, `g` in [`CLIP_STEPS`] (the full
/// range first, so a tie keeps it). A 2-bit grid over a bell-shaped group
/// spans about ±1.5σ at its best, where the group's extremes span about
/// ±2.4σ over 64 values: clipping halves the error of the rest at the cost
/// of the few values past the bounds (the outliers are split off first).
/// Returns how many values were clamped.
pub fn clip_groups(
    rows: &mut [f32],
    (tokens, channels): (usize, usize),
    (tokens_per_group, channels_per_group): (usize, usize),
    bits: u8,
    skip: &[u32],
) -> Result<usize> {
    check_shape(rows, tokens, channels)?;
    if !(1..=16).contains(&bits) {
        return Err(KvQuantError::InvalidParameter {
            name: "bits",
            reason: format!("{bits} is not in 1..=16"),
        });
    }
    let layout = GroupLayout::new(tokens, channels, tokens_per_group, channels_per_group)?;
    let (order, bounds) = group_runs(&layout, rows.len(), channels);
    let steps = f64::from((1u32 << bits) - 1);
    let mut values = Vec::new();
    let mut clamped = 0;
    for run in bounds.windows(2) {
        let members = &order[run[0]..run[1]];
        values.clear();
        values.extend(
            members
                .iter()
                .filter(|&p| skip.binary_search(p).is_err())
                .map(|&p| f64::from(rows[p as usize])),
        );
        let (lo, hi) = values
            .iter()
            .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), &x| {
                (a.min(x), b.max(x))
            });
        if hi <= lo {
            continue;
        }
        let mean = values.iter().sum::<f64>() / values.len() as f64;
        let error = |l: f64, h: f64| {
            let s = (h - l) / steps;
            values
                .iter()
                .map(|&x| {
                    let y = l + s * ((x.clamp(l, h) - l) / s).round();
                    (x - y) * (x - y)
                })
                .sum::<f64>()
        };
        let mut best = (error(lo, hi), lo, hi);
        for f in CLIP_STEPS {
            for g in CLIP_STEPS {
                let (l, h) = (lo + f * (mean - lo), hi - g * (hi - mean));
                if h > l {
                    let e = error(l, h);
                    if e < best.0 {
                        best = (e, l, h);
                    }
                }
            }
        }
        let (l, h) = (best.1 as f32, best.2 as f32);
        for &p in members {
            let x = &mut rows[p as usize];
            if *x < l || *x > h {
                *x = x.clamp(l, h);
                clamped += 1;
            }
        }
    }
    Ok(clamped)
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
    /// The leading rows kept exact (a sequence's sink tokens), if any.
    exact: Option<KvStore>,
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
    /// refused (a paged cache keeps a sequence's sink tokens:
    /// [`quantize_with_exact`](Self::quantize_with_exact)).
    pub fn quantize(form: CacheForm, rows: &[f32], tokens: usize, channels: usize) -> Result<Self> {
        Self::quantize_with_exact(form, rows, tokens, channels, 0)
    }

    /// [`quantize`](Self::quantize) keeping the first `exact` rows exact
    /// (f16 under the form's protection, a sequence's sink tokens): the
    /// split, the clipping and the share's count see only the other rows,
    /// and the exact rows' places in the dense store hold copies of the
    /// first coded row, so they stretch no per-channel group.
    pub fn quantize_with_exact(
        form: CacheForm,
        rows: &[f32],
        tokens: usize,
        channels: usize,
        exact: usize,
    ) -> Result<Self> {
        let share = Self::share_of(&form)?;
        check_shape(rows, tokens, channels)?;
        if exact >= tokens {
            return Err(KvQuantError::InvalidParameter {
                name: "exact rows",
                reason: format!("{exact} exact rows leave none of {tokens} to code"),
            });
        }
        let dense_form = form.without_sparse();
        let coded = tokens - exact;
        let grouping = grouping(&dense_form, coded, channels)?;
        let mut dense_rows = rows.to_vec();
        let (head, tail) = dense_rows.split_at_mut(exact * channels);
        let count = share.count(coded * channels);
        let mut outliers = split_outliers(tail, (coded, channels), grouping, count)?;
        if let (true, Quantizer::Int(spec)) = (share.clip(), form.quantizer()) {
            let skip: Vec<u32> = outliers.iter().map(|&(p, _)| p).collect();
            clip_groups(tail, (coded, channels), grouping, spec.bits, &skip)?;
        }
        for row in head.chunks_exact_mut(channels) {
            row.copy_from_slice(&tail[..channels]);
        }
        let offset = (exact * channels) as u32;
        for o in &mut outliers {
            o.0 += offset;
        }
        let dense = KvStore::quantize(dense_form, &dense_rows, tokens, channels)?;
        let exact_rows = (exact > 0)
            .then(|| {
                KvStore::quantize(
                    form.exact_rows_form(),
                    &rows[..exact * channels],
                    exact,
                    channels,
                )
            })
            .transpose()?;
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
            // Saturated: a value past f16's range (a key un-rotated from a
            // clamped fault) keeps its sign and the largest magnitude.
            let v = v.clamp(-f32::from(f16::MAX), f32::from(f16::MAX));
            value_bytes.extend_from_slice(&f16::from_f32(v).to_le_bytes());
        }
        let mut store = Self {
            form,
            dense,
            exact: exact_rows,
            positions: ProtectedTable::new(&position_bytes, meta),
            values: ProtectedTable::new(&value_bytes, meta).with_f16_range(),
            decoded: Vec::new(),
            stats: KvDecodeStats::default(),
        };
        store.reread();
        Ok(store)
    }

    fn share_of(form: &CacheForm) -> Result<SparseSpec> {
        if !form.segments().is_empty() {
            return Err(KvQuantError::InvalidParameter {
                name: "form",
                reason: format!(
                    "{form}: a sparse store holds a block of coded rows; its exact sink \
                     tokens are kept beside it"
                ),
            });
        }
        form.sparse().ok_or_else(|| KvQuantError::InvalidParameter {
            name: "form",
            reason: format!("{form} keeps no outliers (spell +out<P>)"),
        })
    }

    /// Stored bytes of a block of `tokens × channels` values in `form`
    /// with its first `exact` rows exact, without building one (for pool
    /// sizes).
    pub fn stored_bytes_of(
        form: CacheForm,
        tokens: usize,
        channels: usize,
        exact: usize,
    ) -> Result<usize> {
        let share = Self::share_of(&form)?;
        let dense = KvStore::zeroed(form.without_sparse(), tokens, channels)?.stored_bytes();
        let exact_bytes = match exact {
            0 => 0,
            n => KvStore::zeroed(form.exact_rows_form(), n, channels)?.stored_bytes(),
        };
        let coded = tokens.saturating_sub(exact);
        let (tpg, cpg) = grouping(&form.without_sparse(), coded, channels)?;
        let layout = GroupLayout::new(coded, channels, tpg, cpg)?;
        let count =
            share
                .count(coded * channels)
                .min(removable(&layout, coded * channels, channels));
        let wide = tokens * channels > 1 << 16;
        let meta = meta_protection(&form);
        Ok(dense
            + exact_bytes
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

    /// Leading rows kept exact.
    pub fn exact_rows(&self) -> usize {
        self.exact.as_ref().map_or(0, KvStore::tokens)
    }

    /// Every stored byte: the dense store's, the exact rows' and both
    /// tables' with their check words.
    pub fn stored_bytes(&self) -> usize {
        self.dense.stored_bytes()
            + self.exact.as_ref().map_or(0, KvStore::stored_bytes)
            + self.positions.stored_bytes()
            + self.values.stored_bytes()
    }

    /// Decodes rows `start..start + count` into `out` (`count × channels`):
    /// the dense rows, the exact rows over theirs, then each outlier of
    /// those rows in its place. The statistics add the tables' words to
    /// the dense store's in the tile holding the block's first row, so
    /// tiles add up to one whole read.
    pub fn decode_rows_into(
        &self,
        start: usize,
        count: usize,
        out: &mut [f32],
        scratch: &mut DecodeScratch,
    ) -> Result<KvDecodeStats> {
        let mut stats = self.dense.decode_rows_into(start, count, out, scratch)?;
        let ch = self.channels();
        if let Some(exact) = &self.exact
            && start < exact.tokens()
        {
            let n = (exact.tokens() - start).min(count);
            stats += exact.decode_rows_into(start, n, &mut out[..n * ch], scratch)?;
        }
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
    /// store's as [`KvStore::inject`] lays them out; as `exact`, the exact
    /// rows' bits (the dense store of a block has none of its own) and
    /// after them the outlier values'; the positions' as `tables`; each
    /// from a salted stream of `seed`.
    pub fn inject(
        &mut self,
        channel: &dyn FaultChannel,
        seed: u64,
        target: FaultTarget,
    ) -> Injection {
        let mut injection = self.dense.inject(channel, seed, target);
        if target != FaultTarget::Metadata {
            let (mut flips, base) = match &mut self.exact {
                Some(exact) => {
                    let hit = exact.inject(channel, seed ^ EXACT_SALT, FaultTarget::Values);
                    (
                        hit.values.positions().to_vec(),
                        8 * exact.stored_bytes() as u64,
                    )
                }
                None => (Vec::new(), 0),
            };
            let values = self.values.inject(channel, seed ^ VALUE_SALT);
            flips.extend(values.positions().iter().map(|p| p + base));
            injection.exact = Flips::from_events(flips);
        }
        if target != FaultTarget::Values {
            injection.tables = self.positions.inject(channel, seed ^ POSITION_SALT);
        }
        self.reread();
        injection
    }

    /// One scrubbing pass over the dense store, the exact rows and both
    /// tables (their words under `values` and `metadata`).
    pub fn scrub(&mut self) -> Result<ScrubStats> {
        let mut stats = self.dense.scrub()?;
        if let Some(exact) = &mut self.exact {
            stats += exact.scrub()?;
        }
        stats.values += self.values.scrub();
        stats.metadata += self.positions.scrub();
        self.reread();
        Ok(stats)
    }

    /// Decodes both tables into `decoded` and `stats`.
    fn reread(&mut self) {
        let (positions, position_stats) = self.positions.read_words();
        let (values, value_stats) = self.values.read_words();
        let ch = self.channels();
        let total = (self.tokens() * ch) as u64;
        let first = (self.exact_rows() * ch) as u64;
        let detected =
            |w: &[(u16, DecodeOutcome)]| w.iter().any(|(_, o)| *o == DecodeOutcome::Detected);
        let per_position = if total > 1 << 16 { 2 } else { 1 };
        let mut erased = 0;
        let mut decoded: Vec<(u32, f32)> = Vec::with_capacity(values.len());
        for (p, v) in positions.chunks_exact(per_position).zip(&values) {
            // An entry whose position or value the code could not vouch
            // for is dropped: the dense store's clamped bound reads there.
            if detected(p) || v.1 == DecodeOutcome::Detected {
                erased += 1;
                continue;
            }
            let position = p
                .iter()
                .rev()
                .fold(0u32, |acc, &(w, _)| (acc << 16) | u32::from(w));
            // A position outside the coded rows (a fault the code let
            // through, or no code) places nothing.
            if (first..total).contains(&u64::from(position)) {
                decoded.push((position, f16::from_bits(v.0).to_f32()));
            }
        }
        decoded.sort_by_key(|&(p, _)| p);
        self.decoded = decoded;
        self.stats = KvDecodeStats {
            values: value_stats,
            metadata: position_stats,
            erased_values: erased,
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
