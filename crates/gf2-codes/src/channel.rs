//! Fault channels: seeded bit flips on `&mut [u8]`, every flip recorded.
//!
//! A channel applies faults to a byte buffer with randomness from a
//! [`FaultRng`] and returns the exact set of bits whose value changed
//! ([`Flips`]): applying the same [`Flips`] again restores the buffer. Bit
//! positions are `8 * byte + bit`, bit 0 the least significant.
//!
//! Reproducibility: [`FaultRng`] is ChaCha8 keyed by a SplitMix64 expansion of
//! the seed, both fixed algorithms; uniform draws use the top 53 bits of each
//! 64-bit output, geometric skips use `libm`'s pure-Rust logarithm, and bounded
//! integers use rejection sampling, all written here rather than taken from
//! `rand`'s distributions (whose output may change between releases). The same
//! seed therefore gives the same flips on every platform and release.
//!
//! Rare events are sampled by geometric skips (the gap to the next event is
//! `⌊ln U / ln(1 − p)⌋`), so the cost grows with the number of events, not the
//! number of bits.

use rand_chacha::ChaCha8Rng;
use rand_core::{Rng, SeedableRng};

use crate::error::{Gf2Error, Result};

/// The deterministic random stream behind every channel.
#[derive(Clone, Debug)]
pub struct FaultRng {
    inner: ChaCha8Rng,
}

/// SplitMix64 (Steele, Lea and Flood 2014), used only to spread a `u64` seed
/// over ChaCha's 256-bit key.
fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl FaultRng {
    /// The stream for `seed`.
    pub fn new(seed: u64) -> Self {
        let mut state = seed;
        let mut key = [0u8; 32];
        for chunk in key.chunks_exact_mut(8) {
            chunk.copy_from_slice(&splitmix64(&mut state).to_le_bytes());
        }
        Self {
            inner: ChaCha8Rng::from_seed(key),
        }
    }

    /// An independent stream for `(seed, stream)`: the same key with ChaCha's
    /// stream number set, for per-layer or per-trial streams from one seed.
    pub fn with_stream(seed: u64, stream: u64) -> Self {
        let mut rng = Self::new(seed);
        rng.inner.set_stream(stream);
        rng
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.inner.next_u64()
    }

    /// A uniform draw from `[0, 1)` with 53 random bits.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// A uniform draw from `(0, 1]`.
    fn next_f64_nonzero(&mut self) -> f64 {
        ((self.next_u64() >> 11) + 1) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// A uniform integer in `0..n` (`n > 0`), without modulo bias.
    ///
    /// # Panics
    /// If `n == 0`.
    pub fn below(&mut self, n: u64) -> u64 {
        assert!(n > 0, "below(0) has no values");
        // Reject the top partial block of the 64-bit range.
        let zone = u64::MAX - (u64::MAX - n + 1) % n;
        loop {
            let x = self.next_u64();
            if x <= zone {
                return x % n;
            }
        }
    }

    /// Number of failures before the first success of Bernoulli(p) trials,
    /// given `ln_q = ln(1 − p)` (negative); saturates at `u64::MAX`.
    fn geometric(&mut self, ln_q: f64) -> u64 {
        let g = libm::log(self.next_f64_nonzero()) / ln_q;
        // `as` saturates: huge or infinite gaps become u64::MAX.
        g as u64
    }
}

/// The bits a channel changed: distinct positions `8 * byte + bit`, ascending.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Flips {
    positions: Vec<u64>,
}

impl Flips {
    /// Builds a record from raw flip events: positions flipped an even number
    /// of times cancel, so the result is exactly the set of changed bits.
    pub fn from_events(mut events: Vec<u64>) -> Self {
        events.sort_unstable();
        let mut positions = Vec::with_capacity(events.len());
        for p in events {
            if positions.last() == Some(&p) {
                positions.pop();
            } else {
                positions.push(p);
            }
        }
        Self { positions }
    }

    /// The positions, ascending.
    pub fn positions(&self) -> &[u64] {
        &self.positions
    }

    /// Number of flipped bits.
    pub fn len(&self) -> usize {
        self.positions.len()
    }

    /// Whether nothing was flipped.
    pub fn is_empty(&self) -> bool {
        self.positions.is_empty()
    }

    /// Flips these bits in `data` (a second application undoes the first).
    pub fn apply(&self, data: &mut [u8]) -> Result<()> {
        if let Some(&last) = self.positions.last()
            && last / 8 >= data.len() as u64
        {
            return Err(Gf2Error::LengthMismatch {
                what: "data for these flips",
                expected: (last / 8 + 1) as usize,
                found: data.len(),
            });
        }
        for &p in &self.positions {
            data[(p / 8) as usize] ^= 1 << (p % 8);
        }
        Ok(())
    }

    /// Number of flips inside each consecutive `unit_bits`-bit unit (for
    /// example 8 for a SECDED codeword): `(unit index, flips)` for units hit.
    ///
    /// # Panics
    /// If `unit_bits == 0`.
    pub fn per_unit(&self, unit_bits: u64) -> Vec<(u64, u32)> {
        assert!(unit_bits > 0, "unit_bits must be positive");
        let mut out: Vec<(u64, u32)> = Vec::new();
        for &p in &self.positions {
            let u = p / unit_bits;
            match out.last_mut() {
                Some((last, n)) if *last == u => *n += 1,
                _ => out.push((u, 1)),
            }
        }
        out
    }
}

/// A source of bit faults.
pub trait FaultChannel: std::fmt::Debug + Send + Sync {
    /// Applies faults to `data` drawing from `rng`; returns what changed.
    fn inject_with(&self, data: &mut [u8], rng: &mut FaultRng) -> Flips;

    /// Applies faults to `data` from a fresh stream for `seed`.
    fn inject(&self, data: &mut [u8], seed: u64) -> Flips {
        self.inject_with(data, &mut FaultRng::new(seed))
    }
}

fn check_probability(name: &'static str, p: f64) -> Result<f64> {
    if (0.0..=1.0).contains(&p) {
        Ok(p)
    } else {
        Err(Gf2Error::InvalidProbability { name, value: p })
    }
}

/// Calls `f(i)` for each index in `0..n` chosen independently with probability
/// `p`, in ascending order, by geometric skips.
fn for_each_bernoulli(rng: &mut FaultRng, n: u64, p: f64, mut f: impl FnMut(&mut FaultRng, u64)) {
    if p == 0.0 || n == 0 {
        return;
    }
    if p == 1.0 {
        for i in 0..n {
            f(rng, i);
        }
        return;
    }
    let ln_q = libm::log1p(-p);
    let mut i = rng.geometric(ln_q);
    while i < n {
        f(rng, i);
        i = i.saturating_add(1).saturating_add(rng.geometric(ln_q));
    }
}

fn total_bits(data: &[u8]) -> u64 {
    data.len() as u64 * 8
}

/// The binary symmetric channel: every bit flips independently with probability p
/// (the paper's model, eq. 9).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BinarySymmetric {
    p: f64,
}

impl BinarySymmetric {
    /// A channel with bit error rate `p` in `[0, 1]`.
    pub fn new(p: f64) -> Result<Self> {
        Ok(Self {
            p: check_probability("bit error rate", p)?,
        })
    }

    /// The bit error rate.
    pub fn p(&self) -> f64 {
        self.p
    }
}

impl FaultChannel for BinarySymmetric {
    fn inject_with(&self, data: &mut [u8], rng: &mut FaultRng) -> Flips {
        let mut positions = Vec::new();
        for_each_bernoulli(rng, total_bits(data), self.p, |_, bit| {
            data[(bit / 8) as usize] ^= 1 << (bit % 8);
            positions.push(bit);
        });
        // Ascending and distinct by construction.
        Flips { positions }
    }
}

/// Bursts: each bit position starts a burst with probability `rate`; a burst
/// flips a run of adjacent bits whose length is uniform in `min_len..=max_len`
/// (cut at the end of the buffer). Overlapping bursts cancel where they overlap.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Burst {
    rate: f64,
    min_len: u64,
    max_len: u64,
}

impl Burst {
    /// Bursts starting at rate `rate` per bit, of `min_len..=max_len` bits (`1 <= min_len <= max_len`).
    pub fn new(rate: f64, min_len: u64, max_len: u64) -> Result<Self> {
        if min_len == 0 || min_len > max_len {
            return Err(Gf2Error::InvalidParameter {
                name: "burst length",
                reason: format!("need 1 <= min_len <= max_len, got {min_len}..={max_len}"),
            });
        }
        Ok(Self {
            rate: check_probability("burst rate", rate)?,
            min_len,
            max_len,
        })
    }
}

impl FaultChannel for Burst {
    fn inject_with(&self, data: &mut [u8], rng: &mut FaultRng) -> Flips {
        let n = total_bits(data);
        let mut events = Vec::new();
        for_each_bernoulli(rng, n, self.rate, |rng, start| {
            let len = self.min_len + rng.below(self.max_len - self.min_len + 1);
            events.extend(start..start.saturating_add(len).min(n));
        });
        let flips = Flips::from_events(events);
        flips.apply(data).expect("positions lie inside the buffer");
        flips
    }
}

/// Multi-bit upsets confined to one aligned word: each word of `word_bytes`
/// bytes is hit with probability `rate`, and a hit flips a number of distinct
/// bits uniform in `min_bits..=max_bits`, all inside that word (the way HBM
/// errors cluster in a byte or a word). A partial last word counts as a word.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MultiBitUpset {
    rate: f64,
    word_bytes: usize,
    min_bits: u32,
    max_bits: u32,
}

impl MultiBitUpset {
    /// Upsets at `rate` per word of `word_bytes` (1, 2, 4 or 8) bytes, each
    /// flipping `min_bits..=max_bits` distinct bits (`1 <= min_bits <= max_bits <= 8 * word_bytes`).
    pub fn new(rate: f64, word_bytes: usize, min_bits: u32, max_bits: u32) -> Result<Self> {
        if ![1, 2, 4, 8].contains(&word_bytes) {
            return Err(Gf2Error::InvalidParameter {
                name: "word_bytes",
                reason: format!("{word_bytes} is not 1, 2, 4 or 8"),
            });
        }
        if min_bits == 0 || min_bits > max_bits || max_bits as usize > 8 * word_bytes {
            return Err(Gf2Error::InvalidParameter {
                name: "bits per upset",
                reason: format!(
                    "need 1 <= min_bits <= max_bits <= {}, got {min_bits}..={max_bits}",
                    8 * word_bytes
                ),
            });
        }
        Ok(Self {
            rate: check_probability("upset rate", rate)?,
            word_bytes,
            min_bits,
            max_bits,
        })
    }
}

impl FaultChannel for MultiBitUpset {
    fn inject_with(&self, data: &mut [u8], rng: &mut FaultRng) -> Flips {
        let words = data.len().div_ceil(self.word_bytes) as u64;
        let mut events = Vec::new();
        for_each_bernoulli(rng, words, self.rate, |rng, w| {
            let first = w * self.word_bytes as u64 * 8;
            let width = ((data.len() as u64 * 8) - first).min(self.word_bytes as u64 * 8);
            let want =
                u64::from(self.min_bits) + rng.below(u64::from(self.max_bits - self.min_bits) + 1);
            // Partial Fisher-Yates over the word's bit offsets: distinct bits.
            let mut offsets: Vec<u64> = (0..width).collect();
            for i in 0..want.min(width) as usize {
                let j = i + rng.below(width - i as u64) as usize;
                offsets.swap(i, j);
                events.push(first + offsets[i]);
            }
        });
        let flips = Flips::from_events(events);
        flips.apply(data).expect("positions lie inside the buffer");
        flips
    }
}

/// What a stuck cell reads as.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum StuckValue {
    /// Stuck at 0.
    Zero,
    /// Stuck at 1.
    One,
    /// Each stuck cell at 0 or 1 with equal probability.
    Random,
}

/// Stuck-at cells: each bit is a stuck cell with probability `rate`; a stuck
/// cell forces its value, which flips the bit only where it differed. The
/// returned [`Flips`] hold those changes, not the cells.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StuckAt {
    rate: f64,
    value: StuckValue,
}

impl StuckAt {
    /// Stuck cells at rate `rate` per bit.
    pub fn new(rate: f64, value: StuckValue) -> Result<Self> {
        Ok(Self {
            rate: check_probability("stuck-cell rate", rate)?,
            value,
        })
    }
}

impl FaultChannel for StuckAt {
    fn inject_with(&self, data: &mut [u8], rng: &mut FaultRng) -> Flips {
        let mut positions = Vec::new();
        for_each_bernoulli(rng, total_bits(data), self.rate, |rng, bit| {
            let forced = match self.value {
                StuckValue::Zero => 0,
                StuckValue::One => 1,
                StuckValue::Random => (rng.next_u64() >> 63) as u8,
            };
            let byte = &mut data[(bit / 8) as usize];
            if (*byte >> (bit % 8)) & 1 != forced {
                *byte ^= 1 << (bit % 8);
                positions.push(bit);
            }
        });
        Flips { positions }
    }
}

/// What a whole-run fault does to the bytes it hits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RunFaultMode {
    /// Every bit inverted.
    Invert,
    /// Replaced by random bytes (each bit flips with probability 1/2).
    Random,
    /// Cleared to zero.
    Zeros,
    /// Set to all ones.
    Ones,
}

/// Whole-word and row faults: each aligned run of `run_bytes` bytes (a word,
/// say 8, or a DRAM row, say 1024) fails with probability `rate`, and a failed
/// run is corrupted as `mode` says. A partial last run counts as a run.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AlignedRunFault {
    rate: f64,
    run_bytes: usize,
    mode: RunFaultMode,
}

impl AlignedRunFault {
    /// Runs of `run_bytes >= 1` bytes failing with probability `rate`.
    pub fn new(rate: f64, run_bytes: usize, mode: RunFaultMode) -> Result<Self> {
        if run_bytes == 0 {
            return Err(Gf2Error::InvalidParameter {
                name: "run_bytes",
                reason: "a run needs at least one byte".into(),
            });
        }
        Ok(Self {
            rate: check_probability("run fault rate", rate)?,
            run_bytes,
            mode,
        })
    }
}

impl FaultChannel for AlignedRunFault {
    fn inject_with(&self, data: &mut [u8], rng: &mut FaultRng) -> Flips {
        let runs = data.len().div_ceil(self.run_bytes) as u64;
        let mut positions = Vec::new();
        for_each_bernoulli(rng, runs, self.rate, |rng, r| {
            let start = r as usize * self.run_bytes;
            let end = (start + self.run_bytes).min(data.len());
            for (i, byte) in data[start..end].iter_mut().enumerate() {
                let new = match self.mode {
                    RunFaultMode::Invert => !*byte,
                    RunFaultMode::Random => rng.next_u64() as u8,
                    RunFaultMode::Zeros => 0,
                    RunFaultMode::Ones => 0xFF,
                };
                let mut diff = *byte ^ new;
                while diff != 0 {
                    positions.push(((start + i) * 8) as u64 + u64::from(diff.trailing_zeros()));
                    diff &= diff - 1;
                }
                *byte = new;
            }
        });
        Flips { positions }
    }
}

/// Exactly the given bit positions (`8 · byte + bit`) flipped, the random
/// stream unused: a targeted, deterministic fault (two flips in one
/// codeword, one in a chosen metadata word). Positions past the buffer are
/// left out, and a position given twice flips back, so the returned
/// [`Flips`] are exactly the bits changed.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct ExactFlips {
    positions: Vec<u64>,
}

impl ExactFlips {
    /// Flips `positions`.
    pub fn new(positions: impl IntoIterator<Item = u64>) -> Self {
        Self {
            positions: positions.into_iter().collect(),
        }
    }
}

impl FaultChannel for ExactFlips {
    fn inject_with(&self, data: &mut [u8], _rng: &mut FaultRng) -> Flips {
        let bits = total_bits(data);
        let flips = Flips::from_events(
            self.positions
                .iter()
                .copied()
                .filter(|&p| p < bits)
                .collect(),
        );
        for &p in flips.positions() {
            data[(p / 8) as usize] ^= 1 << (p % 8);
        }
        flips
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `ExactFlips` changes exactly its positions inside the buffer, once
    /// each (a repeated position flips back), whatever the seed.
    #[test]
    fn exact_flips_change_exactly_their_positions() {
        let channel = ExactFlips::new([3, 9, 9, 17, 64]);
        for seed in [0, 7] {
            let mut data = [0u8; 4];
            let flips = channel.inject(&mut data, seed);
            assert_eq!(flips.positions(), &[3, 17], "bit 9 twice, bit 64 outside");
            assert_eq!(data, [0b1000, 0, 0b10, 0]);
        }
    }
    use proptest::prelude::*;

    /// Asserts `observed` lies within `z` standard deviations of Binomial(n, p)'s mean.
    fn assert_binomial(observed: u64, n: u64, p: f64, z: f64, what: &str) {
        let mean = n as f64 * p;
        let sd = (n as f64 * p * (1.0 - p)).sqrt();
        let (lo, hi) = (mean - z * sd, mean + z * sd);
        assert!(
            (lo..=hi).contains(&(observed as f64)),
            "{what}: observed {observed} outside [{lo:.1}, {hi:.1}] for Binomial({n}, {p})"
        );
    }

    fn diff_positions(before: &[u8], after: &[u8]) -> Vec<u64> {
        let mut out = Vec::new();
        for (i, (a, b)) in before.iter().zip(after).enumerate() {
            let mut d = a ^ b;
            while d != 0 {
                out.push(i as u64 * 8 + u64::from(d.trailing_zeros()));
                d &= d - 1;
            }
        }
        out
    }

    #[test]
    fn bsc_counts_fall_in_binomial_intervals() {
        // 4.5 sigma: a correct sampler fails this with probability ~7e-6 per
        // case, fixed seeds make it deterministic, and an off-by-one in the
        // skip (mean gap 1/p + 1) shifts the count by about p·n, far outside.
        let bytes = 1 << 20;
        for (seed, p) in [
            (1, 1e-5),
            (2, 1e-4),
            (3, 1e-3),
            (4, 1e-2),
            (5, 0.1),
            (6, 0.5),
            (7, 0.9),
        ] {
            let mut data = vec![0u8; bytes];
            let flips = BinarySymmetric::new(p).unwrap().inject(&mut data, seed);
            let n = bytes as u64 * 8;
            assert_binomial(flips.len() as u64, n, p, 4.5, &format!("BSC p={p}"));
            // Each bit position within a byte is equally likely.
            let mut per_bit = [0u64; 8];
            for &pos in flips.positions() {
                per_bit[(pos % 8) as usize] += 1;
            }
            for (b, &c) in per_bit.iter().enumerate() {
                assert_binomial(c, n / 8, p, 4.5, &format!("BSC p={p} bit {b}"));
            }
            assert_eq!(
                flips.positions(),
                &diff_positions(&vec![0; bytes], &data)[..]
            );
        }
    }

    #[test]
    fn bsc_edge_probabilities() {
        let mut data = vec![0xA5u8; 100];
        assert!(
            BinarySymmetric::new(0.0)
                .unwrap()
                .inject(&mut data, 1)
                .is_empty()
        );
        assert_eq!(data, vec![0xA5; 100]);
        let all = BinarySymmetric::new(1.0).unwrap().inject(&mut data, 1);
        assert_eq!(all.len(), 800);
        assert_eq!(data, vec![0x5A; 100]);
        assert!(
            BinarySymmetric::new(0.5)
                .unwrap()
                .inject(&mut [], 3)
                .is_empty()
        );
    }

    #[test]
    fn invalid_parameters_are_rejected() {
        for p in [-0.1, 1.5, f64::NAN, f64::INFINITY] {
            assert!(matches!(
                BinarySymmetric::new(p),
                Err(Gf2Error::InvalidProbability { .. })
            ));
            assert!(Burst::new(p, 1, 2).is_err());
            assert!(StuckAt::new(p, StuckValue::One).is_err());
            assert!(AlignedRunFault::new(p, 8, RunFaultMode::Invert).is_err());
            assert!(MultiBitUpset::new(p, 8, 1, 2).is_err());
        }
        assert!(Burst::new(0.1, 0, 2).is_err());
        assert!(Burst::new(0.1, 3, 2).is_err());
        assert!(MultiBitUpset::new(0.1, 3, 1, 2).is_err());
        assert!(MultiBitUpset::new(0.1, 1, 1, 9).is_err());
        assert!(MultiBitUpset::new(0.1, 1, 0, 1).is_err());
        assert!(AlignedRunFault::new(0.1, 0, RunFaultMode::Zeros).is_err());
        assert!(Flips::from_events(vec![80]).apply(&mut [0u8; 10]).is_err());
    }

    #[test]
    fn same_seed_same_flips_and_streams_differ() {
        let channel = BinarySymmetric::new(1e-2).unwrap();
        let (mut a, mut b) = (vec![0u8; 4096], vec![0u8; 4096]);
        assert_eq!(channel.inject(&mut a, 7), channel.inject(&mut b, 7));
        assert_eq!(a, b);
        let mut c = vec![0u8; 4096];
        assert_ne!(channel.inject(&mut c, 8), channel.inject(&mut a, 7));
        let s0 = channel.inject_with(&mut vec![0u8; 4096], &mut FaultRng::with_stream(7, 0));
        let s1 = channel.inject_with(&mut vec![0u8; 4096], &mut FaultRng::with_stream(7, 1));
        assert_ne!(s0, s1);
    }

    #[test]
    fn stream_is_pinned() {
        // Regression pin of the whole chain (SplitMix64 key, ChaCha8, 53-bit
        // uniforms, libm log, skips): a change here changes every published
        // sweep, so it must be deliberate. Values recorded from this
        // implementation when it was written.
        let mut rng = FaultRng::new(2026);
        let first: Vec<u64> = (0..3).map(|_| rng.next_u64()).collect();
        let flips = BinarySymmetric::new(1e-3)
            .unwrap()
            .inject(&mut vec![0u8; 1024], 2026);
        assert_eq!(first, PINNED_U64);
        assert_eq!(&flips.positions()[..PINNED_FLIPS.len()], PINNED_FLIPS);
    }

    const PINNED_U64: [u64; 3] = [
        2_844_324_442_384_783_272,
        14_866_699_687_074_317_239,
        5_073_000_549_912_893_414,
    ];
    const PINNED_FLIPS: &[u64] = &[1868, 2084, 3375, 4212, 5440, 5559];

    #[test]
    fn word_and_run_faults_hit_binomial_counts() {
        let bytes = 1 << 20;
        for (seed, rate, run) in [(11, 1e-3, 8), (12, 1e-2, 64), (13, 0.1, 1024)] {
            let mut data = vec![0u8; bytes];
            let flips = AlignedRunFault::new(rate, run, RunFaultMode::Ones)
                .unwrap()
                .inject(&mut data, seed);
            let units = (bytes / run) as u64;
            let hit = flips.per_unit(run as u64 * 8);
            assert!(
                hit.iter().all(|&(_, n)| n as usize == run * 8),
                "whole runs flip"
            );
            assert_binomial(
                hit.len() as u64,
                units,
                rate,
                4.5,
                &format!("runs of {run}"),
            );
        }
    }

    #[test]
    fn upsets_stay_inside_one_word() {
        let bytes = 1 << 18;
        let mbu = MultiBitUpset::new(0.01, 4, 2, 3).unwrap();
        let mut data = vec![0u8; bytes];
        let flips = mbu.inject(&mut data, 99);
        let words = flips.per_unit(32);
        assert!(words.iter().all(|&(_, n)| (2..=3).contains(&n)));
        assert_binomial(words.len() as u64, (bytes / 4) as u64, 0.01, 4.5, "upsets");
    }

    #[test]
    fn stuck_cells_only_flip_differing_bits() {
        let bytes = 1 << 18;
        let mut data = vec![0xF0u8; bytes];
        let flips = StuckAt::new(0.01, StuckValue::One)
            .unwrap()
            .inject(&mut data, 5);
        // Only the low nibbles (zeros) can change, and only 0 -> 1.
        assert!(flips.positions().iter().all(|p| p % 8 < 4));
        assert!(data.iter().all(|&b| b & 0xF0 == 0xF0));
        assert_binomial(
            flips.len() as u64,
            bytes as u64 * 4,
            0.01,
            4.5,
            "stuck-at-1 on zeros",
        );
    }

    fn channels() -> impl Strategy<Value = Box<dyn FaultChannel>> {
        let rate = 0.0..0.3f64;
        prop_oneof![
            rate.clone()
                .prop_map(|p| Box::new(BinarySymmetric::new(p).unwrap()) as Box<dyn FaultChannel>),
            (rate.clone(), 1u64..20, 0u64..20)
                .prop_map(
                    |(p, a, b)| Box::new(Burst::new(p, a, a + b).unwrap()) as Box<dyn FaultChannel>
                ),
            (
                rate.clone(),
                prop::sample::select(vec![1usize, 2, 4, 8]),
                1u32..8
            )
                .prop_map(|(p, w, k)| Box::new(
                    MultiBitUpset::new(p, w, 1, k.min(8 * w as u32)).unwrap()
                ) as Box<dyn FaultChannel>),
            (
                rate.clone(),
                prop::sample::select(vec![StuckValue::Zero, StuckValue::One, StuckValue::Random])
            )
                .prop_map(|(p, v)| Box::new(StuckAt::new(p, v).unwrap()) as Box<dyn FaultChannel>),
            (
                rate,
                1usize..100,
                prop::sample::select(vec![
                    RunFaultMode::Invert,
                    RunFaultMode::Random,
                    RunFaultMode::Zeros,
                    RunFaultMode::Ones
                ])
            )
                .prop_map(|(p, r, m)| Box::new(AlignedRunFault::new(p, r, m).unwrap())
                    as Box<dyn FaultChannel>),
        ]
    }

    proptest! {
        #[test]
        fn every_channel_reports_exactly_its_flips(
            channel in channels(),
            data in proptest::collection::vec(any::<u8>(), 0..700),
            seed in any::<u64>(),
        ) {
            let before = data.clone();
            let mut after = data;
            let flips = channel.inject(&mut after, seed);
            prop_assert_eq!(flips.positions(), &diff_positions(&before, &after)[..]);
            // Deterministic for the seed.
            let mut again = before.clone();
            prop_assert_eq!(channel.inject(&mut again, seed), flips.clone());
            // Undo restores the buffer.
            flips.apply(&mut after).unwrap();
            prop_assert_eq!(after, before);
        }

        #[test]
        fn below_stays_in_range(n in 1u64..u64::MAX, seed in any::<u64>()) {
            let mut rng = FaultRng::new(seed);
            for _ in 0..16 {
                prop_assert!(rng.below(n) < n);
            }
        }
    }
}
