//! Faults in the stored weights, and the checks that find and repair them
//! (`kv-eval ppl --weight-flips RATE --weight-check N`).
//!
//! [`WeightFaults`] is a projection hook that keeps its own copy of every
//! projection as the model stores it (GGUF blocks, or f32 where the model
//! holds f32), the memory the faults land in. Before each product it flips
//! every stored bit of that projection with probability `rate`
//! (gf2-codes' binary symmetric channel, a seeded stream per pass and
//! projection), so flips accumulate pass after pass as soft errors do in
//! memory. On the passes the schedule names (every `N`th), each
//! projection's [`WeightGuard`] (kv-model: a CRC-32 per row, one XOR
//! parity row per group of interleaved rows) checks the copy before the
//! product reads it, corrects rows with one flipped bit from their CRC and
//! rebuilds from parity every other damaged row alone in its group. The product
//! is then the plain one on the copy, so a run without flips gives the
//! model's own bits.
//!
//! Every flipped bit is accounted once, at the first check that sees it:
//! corrected (its row repaired to the model's clean row), miscorrected
//! (its row repaired to anything else), detected (its row flagged but left, with
//! another damaged row in its group), or silent (its row passed its CRC);
//! bits flipped back by a second flip before a check cancel, and flips
//! after the last check are pending. The embedding lookup reads the
//! model's own (clean) rows; norms and biases are not faulted.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Instant;

use gf2_codes::channel::{BinarySymmetric, FaultChannel, FaultRng};
use kv_model::model::{CausalLm, Projection, ProjectionHook, ProjectionId, WeightGuard};
use kv_model::weights::Isa;

use crate::error::{EvalError, Result};

/// Faults in the stored weights and how often they are checked.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct WeightFaultConfig {
    /// Probability that a stored weight bit flips, per forward pass.
    pub rate: f64,
    /// Seed (pass `p` and projection `i` draw from stream `p·1024 + i`).
    pub seed: u64,
    /// Check and repair every this many passes (`None`: never).
    pub check_every: Option<u64>,
    /// Rows per parity group of the guards.
    pub rows_per_group: usize,
}

/// What a run with [`WeightFaults`] saw.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct WeightFaultStats {
    /// Forward passes (a pass starts at the first projection the hook saw).
    pub passes: u64,
    /// Passes whose projections were checked.
    pub checks: u64,
    /// Bits flipped.
    pub flips: u64,
    /// Flipped bits whose rows were rebuilt to the clean rows.
    pub corrected: u64,
    /// Flipped bits whose rows were rebuilt to something else.
    pub miscorrected: u64,
    /// Flipped bits in rows flagged and left as they are.
    pub detected: u64,
    /// Flipped bits in rows that passed their CRC.
    pub silent: u64,
    /// Bits flipped twice before a check (back as they were).
    pub cancelled: u64,
    /// Flipped bits no check saw (after the last one, or never checked).
    pub pending: u64,
    /// Rows repaired (per check).
    pub rows_repaired: u64,
    /// Of those, rows repaired from their CRC alone (one flipped bit).
    pub rows_repaired_by_crc: u64,
    /// Rows flagged and left (per check: a row left stays damaged and is
    /// flagged again by the next).
    pub rows_unrepaired: u64,
    /// Parity rows recomputed.
    pub parity_rebuilt: u64,
    /// Stored weight bytes exposed (every projection seen).
    pub weight_bytes: u64,
    /// Bytes of the guards (CRCs and parity rows).
    pub guard_bytes: u64,
    /// Seconds spent in checks.
    pub check_seconds: f64,
}

/// The stored weights' faults and checks, as a projection hook (see the
/// [module docs](self)).
#[derive(Debug)]
pub struct WeightFaults {
    config: WeightFaultConfig,
    channel: BinarySymmetric,
    isa: Isa,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    /// Projections in the order first seen (the first starts a pass).
    order: Vec<ProjectionId>,
    copies: HashMap<ProjectionId, FaultyCopy>,
    stats: WeightFaultStats,
}

/// One projection's faulty copy, its guard and its flipped bits not yet
/// seen by a check (segment, byte) → bit mask.
#[derive(Debug)]
struct FaultyCopy {
    weights: Projection,
    guard: WeightGuard,
    outstanding: HashMap<(usize, usize), u8>,
}

impl WeightFaults {
    /// Faults and checks as `config` says, products on `isa`.
    pub fn new(config: WeightFaultConfig, isa: Isa) -> Result<Self> {
        let channel = BinarySymmetric::new(config.rate).map_err(|_| invalid_rate(config.rate))?;
        if config.check_every == Some(0) {
            return Err(EvalError::InvalidParameter {
                name: "weight-check",
                reason: "checks every 0 passes (use never, or at least 1)".into(),
            });
        }
        if config.rows_per_group == 0 {
            return Err(EvalError::InvalidParameter {
                name: "weight-group",
                reason: "parity groups of 0 rows (use at least 1)".into(),
            });
        }
        Ok(Self {
            config,
            channel,
            isa,
            state: Mutex::new(State::default()),
        })
    }

    /// Bytes the hook will hold for `model`'s projections in groups of
    /// `rows_per_group` rows: the faulty copy of every projection, its
    /// parity rows and CRCs (what a caller checks against its memory
    /// budget before installing the hook).
    pub fn memory_needed(model: &dyn CausalLm, rows_per_group: usize) -> u64 {
        model
            .projections()
            .iter()
            .flat_map(|(_, p)| p.byte_rows())
            .map(|(bytes, row_bytes)| {
                let rows = bytes.len().checked_div(row_bytes).unwrap_or(0);
                let groups = rows.div_ceil(rows_per_group.max(1)).max(1);
                (bytes.len() + groups * row_bytes + 4 * (rows + groups)) as u64
            })
            .sum()
    }

    /// What the run saw so far; flips no check has seen count as pending.
    pub fn stats(&self) -> WeightFaultStats {
        let state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let mut stats = state.stats;
        stats.pending = state
            .copies
            .values()
            .flat_map(|c| c.outstanding.values())
            .map(|m| u64::from(m.count_ones()))
            .sum();
        stats.cancelled = stats.flips
            - stats.corrected
            - stats.miscorrected
            - stats.detected
            - stats.silent
            - stats.pending;
        stats
    }
}

fn invalid_rate(rate: f64) -> EvalError {
    EvalError::InvalidParameter {
        name: "weight-flips",
        reason: format!("{rate} is not a probability in [0, 1]"),
    }
}

impl ProjectionHook for WeightFaults {
    fn project(
        &self,
        id: ProjectionId,
        weights: &Projection,
        x: &[f32],
        out: &mut [f32],
        accumulate: bool,
    ) -> kv_model::Result<()> {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let State {
            order,
            copies,
            stats,
        } = &mut *state;
        if order.first().is_none_or(|&first| first == id) {
            stats.passes += 1;
        }
        let index = match order.iter().position(|&o| o == id) {
            Some(i) => i,
            None => {
                order.push(id);
                order.len() - 1
            }
        };
        let copy = match copies.entry(id) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(v) => {
                let guard = WeightGuard::new(weights, self.config.rows_per_group)?;
                stats.weight_bytes += weights.bytes() as u64;
                stats.guard_bytes += guard.bytes() as u64;
                v.insert(FaultyCopy {
                    weights: weights.clone(),
                    guard,
                    outstanding: HashMap::new(),
                })
            }
        };
        // This pass's flips.
        let stream = (stats.passes - 1) * 1024 + index as u64;
        let mut rng = FaultRng::with_stream(self.config.seed, stream);
        for (segment, (bytes, _)) in copy.weights.byte_rows_mut().into_iter().enumerate() {
            let flips = self.channel.inject_with(bytes, &mut rng);
            stats.flips += flips.len() as u64;
            for &bit in flips.positions() {
                *copy
                    .outstanding
                    .entry((segment, (bit / 8) as usize))
                    .or_insert(0) ^= 1 << (bit % 8);
            }
        }
        copy.outstanding.retain(|_, mask| *mask != 0);
        let due = self
            .config
            .check_every
            .is_some_and(|every| (stats.passes - 1) % every == every - 1);
        if due {
            if index == 0 {
                stats.checks += 1;
            }
            let started = Instant::now();
            check(copy, weights, stats)?;
            stats.check_seconds += started.elapsed().as_secs_f64();
        }
        copy.weights.product_into(out, x, accumulate, self.isa)
    }
}

/// Checks and repairs `copy`, accounting its outstanding flips against the
/// model's `clean` weights.
fn check(
    copy: &mut FaultyCopy,
    clean: &Projection,
    stats: &mut WeightFaultStats,
) -> kv_model::Result<()> {
    let (report, fates) = copy.guard.check(&mut copy.weights)?;
    stats.rows_repaired += report.repaired;
    stats.rows_repaired_by_crc += report.repaired_by_crc;
    stats.rows_unrepaired += report.unrepaired;
    stats.parity_rebuilt += report.parity_rebuilt;
    let faulty = copy.weights.byte_rows();
    let clean = clean.byte_rows();
    let fate =
        |segment: usize, row: usize| fates.iter().find(|f| (f.segment, f.row) == (segment, row));
    for (&(segment, byte), &mask) in &copy.outstanding {
        let bits = u64::from(mask.count_ones());
        let row_bytes = faulty[segment].1;
        let row = byte / row_bytes;
        match fate(segment, row) {
            Some(f) if f.repair.is_some() => {
                let span = row * row_bytes..(row + 1) * row_bytes;
                if faulty[segment].0[span.clone()] == clean[segment].0[span] {
                    stats.corrected += bits;
                } else {
                    stats.miscorrected += bits;
                }
            }
            Some(_) => stats.detected += bits,
            None => stats.silent += bits,
        }
    }
    copy.outstanding.clear();
    Ok(())
}
