//! Rotary position embedding ([`Rope`]): apply and exact undo, in both pair
//! layouts ([`RopeLayout`]).
//!
//! Pair `i` of the first `rotary_dims` channels of a head is rotated by the
//! angle `position · θ_i`, with `θ_i = base^(−2i/rotary_dims)` (RoFormer;
//! section 9 of `shard-kv-compression-blog.md` writes the same rotation for
//! rotate-half). The score of a rotated query at `p` and a rotated key at `s`
//! then depends on `s − p` only. Angles, sines and cosines are computed in
//! f64 and each rotated pair is rounded to f32 once.

use crate::error::{AttentionError, Result};

/// Which channels form the rotated pairs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RopeLayout {
    /// Pairs `(x[2i], x[2i+1])`: the layout GGUF Llama files expect
    /// (llama.cpp's "normal" RoPE).
    Adjacent,
    /// Pairs `(x[i], x[i + rotary_dims/2])`: Hugging Face's `rotate_half`
    /// (and llama.cpp's NeoX mode).
    RotateHalf,
}

/// A rotary embedding for heads of `head_dim` channels.
#[derive(Clone, Debug, PartialEq)]
pub struct Rope {
    layout: RopeLayout,
    head_dim: usize,
    inv_freq: Vec<f64>,
    /// [`trig_rows`](Self::trig_rows)' tables.
    steps: std::sync::Arc<TrigTables>,
}

/// `cos(r·s·θ_i)` then `sin(r·s·θ_i)` for `r < TRIG_RUN`, pair-major, for
/// the three scales `s` = 1, 64 and 4,096 (angles without a `sin_cos`),
/// and the first as f32 (the steps within a run).
#[derive(Debug, PartialEq)]
struct TrigTables {
    wide: Vec<[f64; 2 * TRIG_RUN]>,
    steps: Vec<[f32; 2 * TRIG_RUN]>,
}

/// Entries of each of [`Rope::trig_rows`]' three tables: angles of
/// positions below `TRIG_RUN³` (262,144) are products of three entries.
const TRIG_RUN: usize = 64;

impl Rope {
    /// RoPE over the first `rotary_dims` channels of each head (all of them
    /// when `rotary_dims == head_dim`) with frequency base `base`
    /// (10 000 in Llama 2, 500 000 in Llama 3, 100 000 in SmolLM2-135M).
    pub fn new(layout: RopeLayout, head_dim: usize, rotary_dims: usize, base: f64) -> Result<Self> {
        if !(base.is_finite() && base > 1.0) {
            return Err(AttentionError::InvalidParameter {
                name: "rope base",
                reason: format!("{base} is not a finite number above 1"),
            });
        }
        if rotary_dims == 0 || !rotary_dims.is_multiple_of(2) {
            return Err(AttentionError::InvalidParameter {
                name: "rotary dims",
                reason: format!("{rotary_dims} is not a positive even number"),
            });
        }
        let inv_freq = (0..rotary_dims / 2)
            .map(|i| base.powf(-2.0 * i as f64 / rotary_dims as f64))
            .collect();
        Self::with_inv_freq(layout, head_dim, inv_freq)
    }

    /// RoPE with explicit per-pair frequencies `θ_i` (radians per position),
    /// for scaled variants (Llama 3.1 rope scaling, NTK, YaRN) computed by
    /// the caller. Rotates the first `2·inv_freq.len()` channels.
    pub fn with_inv_freq(layout: RopeLayout, head_dim: usize, inv_freq: Vec<f64>) -> Result<Self> {
        if inv_freq.is_empty() || 2 * inv_freq.len() > head_dim {
            return Err(AttentionError::InvalidParameter {
                name: "rotary dims",
                reason: format!(
                    "{} rotated channels do not fit a head of {head_dim}",
                    2 * inv_freq.len()
                ),
            });
        }
        if let Some(f) = inv_freq.iter().find(|f| !(f.is_finite() && **f >= 0.0)) {
            return Err(AttentionError::InvalidParameter {
                name: "rope frequency",
                reason: format!("{f} is not a finite non-negative number"),
            });
        }
        // Per scale and pair: TRIG_RUN cosines, then as many sines.
        let pairs = inv_freq.len();
        let mut steps = Vec::with_capacity(3 * inv_freq.len());
        for scale in [1, TRIG_RUN, TRIG_RUN * TRIG_RUN] {
            for &f in &inv_freq {
                let mut table = [0.0; 2 * TRIG_RUN];
                for r in 0..TRIG_RUN {
                    (table[TRIG_RUN + r], table[r]) = ((r * scale) as f64 * f).sin_cos();
                }
                steps.push(table);
            }
        }
        Ok(Self {
            layout,
            head_dim,
            inv_freq,
            steps: std::sync::Arc::new(TrigTables {
                steps: steps[..pairs].iter().map(|t| t.map(|x| x as f32)).collect(),
                wide: steps,
            }),
        })
    }

    /// The pair layout.
    pub fn layout(&self) -> RopeLayout {
        self.layout
    }

    /// Channels per head.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// Rotated channels per head.
    pub fn rotary_dims(&self) -> usize {
        2 * self.inv_freq.len()
    }

    /// Per-pair frequencies `θ_i`.
    pub fn inv_freq(&self) -> &[f64] {
        &self.inv_freq
    }

    /// The two channels of pair `i` within a head.
    pub fn pair(&self, i: usize) -> (usize, usize) {
        match self.layout {
            RopeLayout::Adjacent => (2 * i, 2 * i + 1),
            RopeLayout::RotateHalf => (i, i + self.inv_freq.len()),
        }
    }

    /// Rotates every head of `x` (a whole number of heads) to `position`.
    pub fn apply(&self, x: &mut [f32], position: usize) -> Result<()> {
        self.rotate(x, position, 1.0)
    }

    /// Undoes [`apply`](Self::apply) at the same position (rotation by the
    /// opposite angle), within f32 rounding of each pair.
    pub fn undo(&self, x: &mut [f32], position: usize) -> Result<()> {
        self.rotate(x, position, -1.0)
    }

    /// Rotates consecutive rows of `x` (`x.len() / row` rows of `row`
    /// channels, each a whole number of heads) to positions `first`,
    /// `first + 1`, …: [`apply`](Self::apply) row by row, with one `sin_cos`
    /// per pair for the whole run. The angles of later rows come from the
    /// first row's by f64 angle addition, re-anchored every
    /// [`ANCHOR`](Self::ANCHOR) rows, so they stay within about one f64 ulp
    /// of the angle `position·θ` of `apply`'s (about 3e-11 rad at position
    /// 131,000), far below f32 resolution: the rotated f32 values are
    /// `apply`'s bits but for rare rounding ties, one f32 ulp apart (a test
    /// checks both).
    pub fn apply_rows(&self, x: &mut [f32], row: usize, first: usize) -> Result<()> {
        self.rotate_rows(x, row, first, 1.0)
    }

    /// Undoes [`apply_rows`](Self::apply_rows) at the same positions (each
    /// row [`undo`](Self::undo)ne, one `sin_cos` per pair for the run,
    /// within one f32 ulp of `undo`'s bits likewise).
    pub fn undo_rows(&self, x: &mut [f32], row: usize, first: usize) -> Result<()> {
        self.rotate_rows(x, row, first, -1.0)
    }

    fn rotate_rows(&self, x: &mut [f32], row: usize, first: usize, sign: f64) -> Result<()> {
        if row == 0 || !row.is_multiple_of(self.head_dim) || !x.len().is_multiple_of(row) {
            return Err(AttentionError::InvalidParameter {
                name: "RoPE rows",
                reason: format!(
                    "{} values in rows of {row} are not whole rows of whole heads of {}",
                    x.len(),
                    self.head_dim
                ),
            });
        }
        // Pairs a few at a time, their angles on the stack (this runs for
        // every page of a rebuilt tile: no allocation), each pair's
        // arithmetic as if all were done at once.
        const PAIRS: usize = 32;
        for (chunk, freqs) in self.inv_freq.chunks(PAIRS).enumerate() {
            // (sin, cos) of the current row's angle, and of one step.
            let (mut now, mut step) = ([(0.0f64, 1.0f64); PAIRS], [(0.0f64, 1.0f64); PAIRS]);
            let (now, step) = (&mut now[..freqs.len()], &mut step[..freqs.len()]);
            for (t, &f) in step.iter_mut().zip(freqs) {
                *t = (sign * f).sin_cos();
            }
            for (r, rows) in x.chunks_exact_mut(row).enumerate() {
                if r % Self::ANCHOR == 0 {
                    for (t, &f) in now.iter_mut().zip(freqs) {
                        *t = (sign * (first + r) as f64 * f).sin_cos();
                    }
                } else {
                    for (t, &(s1, c1)) in now.iter_mut().zip(step.iter()) {
                        let (s0, c0) = *t;
                        *t = (s0 * c1 + c0 * s1, c0 * c1 - s0 * s1);
                    }
                }
                self.rotate_heads(rows, chunk * PAIRS, now);
            }
        }
        Ok(())
    }

    /// The cosine and sine of every pair's angle at positions `first`,
    /// `first + 1`, … (`rows` of them), as f32, pair-major: `out` becomes
    /// `2 × pairs × rows` values, cosines first, `out[i·rows + r]` the
    /// cosine of pair `i` at row `r` and `out[(pairs + i)·rows + r]` its
    /// sine. A pair's angle at position `p = a·4096 + b·64 + c` (below
    /// 262,144) is the product of three tabled ones (`a·4096·θ`, `b·64·θ`,
    /// `c·θ`, tabled once per `Rope`) in f64, so no `sin_cos` runs (farther
    /// positions take one per pair and run of 64 rows): each run of 64
    /// rows takes that for its first row, rounded to f32, and turns it by
    /// each row's step (`r·θ`, `r < 64`, tabled as f32) in f32. Each value
    /// lies within 4e-7 of the exact `cos`/`sin` of `position·θ` (a test
    /// checks it against [`apply_rows`](Self::apply_rows)' angles): what
    /// a kernel that turns codes by their positions reads, rows in lanes.
    pub fn trig_rows(&self, first: usize, rows: usize, out: &mut Vec<f32>) {
        const N: usize = TRIG_RUN;
        let pairs = self.inv_freq.len();
        out.resize(2 * pairs * rows, 0.0);
        let (cos, sin) = out.split_at_mut(pairs * rows);
        let entry = |t: &[f64; 2 * N], r: usize| (t[r], t[N + r]);
        let times =
            |(c0, s0): (f64, f64), (c1, s1): (f64, f64)| (c0 * c1 - s0 * s1, s0 * c1 + c0 * s1);
        let tables = &self.steps;
        for (i, &f) in self.inv_freq.iter().enumerate() {
            let (cos, sin) = (&mut cos[i * rows..][..rows], &mut sin[i * rows..][..rows]);
            let [ones, runs, spans] = [0, 1, 2].map(|k| &tables.wide[k * pairs + i]);
            let (step_cos, step_sin) = tables.steps[i].split_at(N);
            for (run, (cos, sin)) in cos.chunks_mut(N).zip(sin.chunks_mut(N)).enumerate() {
                // The run's first angle, and each row's step from it.
                let p = first + run * N;
                let (c0, s0) = if p < N * N * N {
                    let (a, b) = (entry(spans, p / (N * N)), entry(runs, p / N % N));
                    times(times(a, b), entry(ones, p % N))
                } else {
                    let (s, c) = (p as f64 * f).sin_cos();
                    (c, s)
                };
                let (c0, s0) = (c0 as f32, s0 as f32);
                for (((co, si), &ct), &st) in cos.iter_mut().zip(sin).zip(step_cos).zip(step_sin) {
                    *co = c0 * ct - s0 * st;
                    *si = s0 * ct + c0 * st;
                }
            }
        }
    }

    /// Reorders every head of `x` (a whole number of heads) so that each
    /// rotated pair's two channels sit side by side, pair `i` at channels
    /// `2i, 2i + 1`, the channels RoPE leaves alone after them in their
    /// order: what a code of one pair reads ([`Adjacent`](RopeLayout::Adjacent)
    /// pairs already are; nothing moves). `head` is a buffer of one head,
    /// grown once. [`from_pair_order`](Self::from_pair_order) undoes it.
    pub fn to_pair_order(&self, x: &mut [f32], head: &mut Vec<f32>) {
        self.reorder(x, head, true);
    }

    /// Undoes [`to_pair_order`](Self::to_pair_order) exactly.
    pub fn from_pair_order(&self, x: &mut [f32], head: &mut Vec<f32>) {
        self.reorder(x, head, false);
    }

    fn reorder(&self, x: &mut [f32], head: &mut Vec<f32>, to_pairs: bool) {
        if self.layout == RopeLayout::Adjacent {
            return;
        }
        head.resize(self.head_dim, 0.0);
        for h in x.chunks_exact_mut(self.head_dim) {
            head.copy_from_slice(h);
            for i in 0..self.inv_freq.len() {
                let (a, b) = self.pair(i);
                if to_pairs {
                    (h[2 * i], h[2 * i + 1]) = (head[a], head[b]);
                } else {
                    (h[a], h[b]) = (head[2 * i], head[2 * i + 1]);
                }
            }
        }
    }

    /// Rows of [`apply_rows`](Self::apply_rows) between two exact `sin_cos`.
    pub const ANCHOR: usize = 16;

    fn rotate(&self, x: &mut [f32], position: usize, sign: f64) -> Result<()> {
        if !x.len().is_multiple_of(self.head_dim) {
            return Err(AttentionError::ShapeMismatch {
                what: "RoPE input (a whole number of heads)",
                expected: x.len().div_ceil(self.head_dim) * self.head_dim,
                got: x.len(),
            });
        }
        let trig: Vec<(f64, f64)> = self
            .inv_freq
            .iter()
            .map(|&f| (sign * position as f64 * f).sin_cos())
            .collect();
        self.rotate_heads(x, 0, &trig);
        Ok(())
    }

    /// Rotates pair `first + i` of every head of `x` by the angle whose
    /// `(sin, cos)` is `trig[i]`, each pair in f64 and rounded to f32 once.
    fn rotate_heads(&self, x: &mut [f32], first: usize, trig: &[(f64, f64)]) {
        for head in x.chunks_exact_mut(self.head_dim) {
            for (i, &(sin, cos)) in trig.iter().enumerate() {
                let (a, b) = self.pair(first + i);
                let (x0, x1) = (f64::from(head[a]), f64::from(head[b]));
                head[a] = (x0 * cos - x1 * sin) as f32;
                head[b] = (x0 * sin + x1 * cos) as f32;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_run_of_rows_is_apply_row_by_row_within_one_ulp() {
        use rand_chacha::ChaCha8Rng;
        use rand_core::{Rng, SeedableRng};
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let mut uniform = move || ((rng.next_u32() >> 8) as f32 / (1u32 << 24) as f32 - 0.5) * 16.0;
        // Heads of 128 take two chunks of pairs; 96 rotated channels of
        // 128 leave the tail alone.
        for (layout, base, dim, rotary) in [
            (RopeLayout::RotateHalf, 100_000.0, 64, 64),
            (RopeLayout::Adjacent, 1e4, 64, 64),
            (RopeLayout::RotateHalf, 1e6, 128, 128),
            (RopeLayout::Adjacent, 1e4, 128, 96),
        ] {
            let rope = Rope::new(layout, dim, rotary, base).unwrap();
            let (row, rows) = (3 * dim, 70);
            let (mut same, mut all) = (0usize, 0usize);
            for first in [0usize, 1, 63, 4_095, 131_000] {
                let x: Vec<f32> = (0..row * rows).map(|_| uniform()).collect();
                let (mut run, mut back) = (x.clone(), x.clone());
                rope.apply_rows(&mut run, row, first).unwrap();
                rope.undo_rows(&mut back, row, first).unwrap();
                let pairs = x.chunks(row).zip(run.chunks(row)).map(|p| (p, true));
                let undone = x.chunks(row).zip(back.chunks(row)).map(|p| (p, false));
                for (r, ((want, got), forward)) in pairs.enumerate().chain(undone.enumerate()) {
                    let mut want = want.to_vec();
                    if forward {
                        rope.apply(&mut want, first + r).unwrap();
                    } else {
                        rope.undo(&mut want, first + r).unwrap();
                    }
                    for (w, g) in want.iter().zip(got) {
                        let ulps = (w.to_bits() as i64 - g.to_bits() as i64).abs();
                        assert!(
                            ulps <= 1 || (w - g).abs() <= 1e-30,
                            "{w} {g} at {first}+{r}"
                        );
                        same += usize::from(w.to_bits() == g.to_bits());
                        all += 1;
                    }
                }
            }
            assert!(same * 1000 >= all * 999, "{same} of {all} bit-identical");
        }
        let rope = Rope::new(RopeLayout::Adjacent, 64, 64, 1e4).unwrap();
        for (len, row) in [(192, 0), (192, 96), (190, 64)] {
            assert!(matches!(
                rope.apply_rows(&mut vec![0.0; len], row, 0),
                Err(AttentionError::InvalidParameter { .. })
            ));
        }
    }

    /// The angles of `trig_rows` are those `apply_rows` turns by: a unit
    /// pair `(1, 0)` rotated reads `(cos, sin)` (f64, rounded once), within
    /// 4e-7, over several runs of rows.
    #[test]
    fn trig_rows_are_the_angles_apply_rows_turns_by() {
        // Positions from three tables, and past them.
        let cases = [RopeLayout::Adjacent, RopeLayout::RotateHalf]
            .into_iter()
            .flat_map(|l| [(l, 130_977), (l, 262_100), (l, 300_001)]);
        for (layout, first) in cases {
            let rope = Rope::new(layout, 16, 16, 10_000.0).unwrap();
            let rows = 150;
            let mut unit = vec![0f32; rows * 16];
            for row in unit.chunks_exact_mut(16) {
                for i in 0..8 {
                    row[rope.pair(i).0] = 1.0;
                }
            }
            rope.apply_rows(&mut unit, 16, first).unwrap();
            let mut trig = Vec::new();
            rope.trig_rows(first, rows, &mut trig);
            assert_eq!(trig.len(), 2 * 8 * rows);
            for (r, row) in unit.chunks_exact(16).enumerate() {
                for i in 0..8 {
                    let (a, b) = rope.pair(i);
                    let (x, y) = (trig[i * rows + r], trig[(8 + i) * rows + r]);
                    for (want, got) in [(row[a], x), (row[b], y)] {
                        assert!(
                            (want - got).abs() <= 4e-7,
                            "row {r} pair {i}: {want} against {got}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn pair_order_puts_each_pair_side_by_side_and_back() {
        // Heads of 8 with 6 rotated channels: pairs (0,3) (1,4) (2,5), then
        // channels 6 and 7 left where they are.
        let h = Rope::new(RopeLayout::RotateHalf, 8, 6, 10_000.0).unwrap();
        let x: Vec<f32> = (0..16).map(|v| v as f32).collect();
        let (mut y, mut head) = (x.clone(), Vec::new());
        h.to_pair_order(&mut y, &mut head);
        assert_eq!(
            y,
            [
                0., 3., 1., 4., 2., 5., 6., 7., 8., 11., 9., 12., 10., 13., 14., 15.
            ]
        );
        h.from_pair_order(&mut y, &mut head);
        assert_eq!(y, x);
        let a = Rope::new(RopeLayout::Adjacent, 8, 8, 10_000.0).unwrap();
        a.to_pair_order(&mut y, &mut head);
        assert_eq!(y, x);
    }

    #[test]
    fn pairs_follow_the_layout() {
        let a = Rope::new(RopeLayout::Adjacent, 8, 8, 10_000.0).unwrap();
        let h = Rope::new(RopeLayout::RotateHalf, 8, 8, 10_000.0).unwrap();
        assert_eq!(
            (0..4).map(|i| a.pair(i)).collect::<Vec<_>>(),
            [(0, 1), (2, 3), (4, 5), (6, 7)]
        );
        assert_eq!(
            (0..4).map(|i| h.pair(i)).collect::<Vec<_>>(),
            [(0, 4), (1, 5), (2, 6), (3, 7)]
        );
        assert_eq!(a.inv_freq()[0], 1.0);
        approx::assert_abs_diff_eq!(a.inv_freq()[1], 0.1, epsilon = 1e-15); // 10000^(-2/8)
    }

    #[test]
    fn position_zero_is_the_identity_and_one_step_matches_a_hand_rotation() {
        let rope = Rope::new(RopeLayout::RotateHalf, 4, 4, 100.0).unwrap();
        let x = [1.0f32, 2.0, 3.0, 4.0];
        let mut y = x;
        rope.apply(&mut y, 0).unwrap();
        assert_eq!(y, x);
        rope.apply(&mut y, 1).unwrap();
        // Pair 0 = (x0, x2) rotated by 1 rad, pair 1 = (x1, x3) by 0.1 rad.
        let (s0, c0) = 1f64.sin_cos();
        let (s1, c1) = 0.1f64.sin_cos();
        let want = [
            (1.0 * c0 - 3.0 * s0) as f32,
            (2.0 * c1 - 4.0 * s1) as f32,
            (1.0 * s0 + 3.0 * c0) as f32,
            (2.0 * s1 + 4.0 * c1) as f32,
        ];
        assert_eq!(y, want);
    }

    #[test]
    fn partial_rotary_leaves_the_tail_alone() {
        let rope = Rope::new(RopeLayout::Adjacent, 6, 4, 10_000.0).unwrap();
        let mut x = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0];
        rope.apply(&mut x, 7).unwrap();
        assert_eq!(&x[4..], &[5.0, 6.0]);
        assert_ne!(&x[..2], &[1.0, 2.0]);
    }

    #[test]
    fn bad_parameters_are_typed_errors() {
        let bad = [
            Rope::new(RopeLayout::Adjacent, 8, 8, 1.0),
            Rope::new(RopeLayout::Adjacent, 8, 8, f64::NAN),
            Rope::new(RopeLayout::Adjacent, 8, 7, 10_000.0),
            Rope::new(RopeLayout::Adjacent, 8, 0, 10_000.0),
            Rope::new(RopeLayout::Adjacent, 8, 10, 10_000.0),
            Rope::with_inv_freq(RopeLayout::Adjacent, 8, vec![1.0, f64::INFINITY]),
            Rope::with_inv_freq(RopeLayout::Adjacent, 8, vec![-1.0]),
        ];
        for b in bad {
            assert!(
                matches!(b, Err(AttentionError::InvalidParameter { .. })),
                "{b:?}"
            );
        }
        let rope = Rope::new(RopeLayout::Adjacent, 8, 8, 10_000.0).unwrap();
        assert!(matches!(
            rope.apply(&mut [0.0; 12], 1),
            Err(AttentionError::ShapeMismatch {
                expected: 16,
                got: 12,
                ..
            })
        ));
    }
}
