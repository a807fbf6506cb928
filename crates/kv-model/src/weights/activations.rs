//! Activations quantised per block for the integer products, as llama.cpp
//! quantises them (`quantize_row_q8_0_ref`, `_q8_1_ref`, `_q8_K_ref` of
//! ggml-quants.c):
//!
//! - **Q8_0** (32 values): `d = amax / 127` stored rounded to f16, codes
//!   `round(x / d)` from the unrounded `d`;
//! - **Q8_1**: as Q8_0, plus `s = d·Σq` rounded to f16, which carries the
//!   weights' min term of `Q4_1`/`Q5_1`;
//! - **Q8_K** (256 values): `d = −max / 127` from the value of largest
//!   magnitude (kept in f32), codes `min(127, round(x / d))`, and the sums
//!   of each 16 codes that the k-quants' min and offset terms use.
//!
//! Rounding is to nearest with ties to even (ggml's `nearest_int` and its
//! AVX2 quantiser; the reference `roundf` differs only on exact ties).
//! Quantising is scalar on every instruction set (it is `O(cols)` per
//! token against the product's `O(rows·cols)`), so every kernel multiplies
//! by the same codes.
//!
//! A block holding a NaN or an infinity gets a non-finite scale, so the
//! products it enters are NaN, as an f32 product's would be: a fault in an
//! activation stays visible instead of being rounded to a code.

use std::sync::OnceLock;

use half::f16;

use super::ActivationKind;
use super::token_lanes::{Q8Kx8Block, Q8x8Block, interleave, interleave_k};
use crate::error::{ModelError, Result};

/// One 32-value block of Q8_0 or Q8_1 activations.
#[derive(Clone, Copy, Debug, PartialEq)]
#[repr(C)]
pub struct Q8Block {
    /// The scale (an f16 value).
    pub d: f32,
    /// `d·Σq` (an f16 value; Q8_1 only, 0 in Q8_0 blocks).
    pub s: f32,
    /// The codes.
    pub qs: [i8; 32],
}

/// One 256-value block of Q8_K activations.
#[derive(Clone, Copy, Debug, PartialEq)]
#[repr(C)]
pub struct Q8KBlock {
    /// The scale.
    pub d: f32,
    /// The codes.
    pub qs: [i8; 256],
    /// The sum of each 16 codes.
    pub bsums: [i16; 16],
}

/// Rows of activations in the form one weight type's product needs.
#[derive(Clone, Debug)]
pub struct Activations {
    kind: ActivationKind,
    rows: usize,
    cols: usize,
    q8: Vec<Q8Block>,
    q8k: Vec<Q8KBlock>,
    f32: Vec<f32>,
    /// The Q8_0 or Q8_1 rows eight tokens at a time, a token per lane,
    /// built the first time a token-lane kernel asks.
    lanes: OnceLock<Vec<Q8x8Block>>,
    /// The same for Q8_K rows.
    lanes_k: OnceLock<Vec<Q8Kx8Block>>,
}

impl Activations {
    /// Quantises `x` (rows of `cols` values) as `kind`.
    pub fn new(kind: ActivationKind, x: &[f32], cols: usize) -> Result<Self> {
        let mut a = Self {
            kind,
            rows: 0,
            cols,
            q8: Vec::new(),
            q8k: Vec::new(),
            f32: Vec::new(),
            lanes: OnceLock::new(),
            lanes_k: OnceLock::new(),
        };
        a.quantize(kind, x, cols)?;
        Ok(a)
    }

    /// Quantises `x` again into these buffers (no allocation for the codes
    /// once they are large enough; tokens in lanes, if a product asks for
    /// them, are built again).
    pub fn quantize(&mut self, kind: ActivationKind, x: &[f32], cols: usize) -> Result<()> {
        let block = match kind {
            ActivationKind::F32 => 1,
            ActivationKind::Q8_0 | ActivationKind::Q8_1 => 32,
            ActivationKind::Q8_K => 256,
        };
        if cols == 0 || !cols.is_multiple_of(block) || !x.len().is_multiple_of(cols) {
            return Err(ModelError::ShapeMismatch {
                what: "activation values (whole rows of whole blocks)",
                expected: cols.max(block).next_multiple_of(block),
                got: x.len(),
            });
        }
        self.kind = kind;
        self.cols = cols;
        self.rows = x.len() / cols;
        self.q8.clear();
        self.q8k.clear();
        self.f32.clear();
        self.lanes = OnceLock::new();
        self.lanes_k = OnceLock::new();
        match kind {
            ActivationKind::F32 => self.f32.extend_from_slice(x),
            ActivationKind::Q8_0 => self
                .q8
                .extend(x.chunks_exact(32).map(|b| q8_block(b, false))),
            ActivationKind::Q8_1 => self
                .q8
                .extend(x.chunks_exact(32).map(|b| q8_block(b, true))),
            ActivationKind::Q8_K => self.q8k.extend(x.chunks_exact(256).map(q8k_block)),
        }
        Ok(())
    }

    /// The form.
    pub fn kind(&self) -> ActivationKind {
        self.kind
    }

    /// Rows (tokens).
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Values per row.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Bytes one row of these activations takes.
    pub fn row_bytes(&self) -> usize {
        match self.kind {
            ActivationKind::F32 => 4 * self.cols,
            ActivationKind::Q8_0 | ActivationKind::Q8_1 => {
                self.cols / 32 * std::mem::size_of::<Q8Block>()
            }
            ActivationKind::Q8_K => self.cols / 256 * std::mem::size_of::<Q8KBlock>(),
        }
    }

    /// Row `i` as Q8_0/Q8_1 blocks (empty in other forms).
    pub fn q8_row(&self, i: usize) -> &[Q8Block] {
        let n = self.cols / 32;
        self.q8.get(i * n..(i + 1) * n).unwrap_or(&[])
    }

    /// The Q8_0 rows in groups of eight tokens, a token per lane (empty in
    /// other forms; a last group of fewer filled up with its last token).
    pub(crate) fn token_lanes(&self) -> &[Q8x8Block] {
        self.lanes.get_or_init(|| interleave(self))
    }

    /// The Q8_K rows in groups of eight tokens, a token per lane (empty in
    /// other forms; a last group of fewer filled up with its last token).
    pub(crate) fn token_lanes_k(&self) -> &[Q8Kx8Block] {
        self.lanes_k.get_or_init(|| interleave_k(self))
    }

    /// Row `i` as Q8_K blocks (empty in other forms).
    pub fn q8k_row(&self, i: usize) -> &[Q8KBlock] {
        let n = self.cols / 256;
        self.q8k.get(i * n..(i + 1) * n).unwrap_or(&[])
    }

    /// Row `i` in f32 (empty in other forms).
    pub fn f32_row(&self, i: usize) -> &[f32] {
        self.f32
            .get(i * self.cols..(i + 1) * self.cols)
            .unwrap_or(&[])
    }

    /// The values the codes stand for, row-major (what the products
    /// multiply by; tests compare kernels against them).
    pub fn dequantized(&self) -> Vec<f32> {
        match self.kind {
            ActivationKind::F32 => self.f32.clone(),
            ActivationKind::Q8_0 | ActivationKind::Q8_1 => self
                .q8
                .iter()
                .flat_map(|b| b.qs.map(|q| f32::from(q) * b.d))
                .collect(),
            ActivationKind::Q8_K => self
                .q8k
                .iter()
                .flat_map(|b| b.qs.map(|q| f32::from(q) * b.d))
                .collect(),
        }
    }
}

/// `v` rounded to the nearest integer, ties to even, for `|v| < 2²²`
/// (ggml's `nearest_int`: adding 1.5·2²³ leaves the integer in the low
/// mantissa bits). Without SSE4.1 at compile time `round_ties_even` is a
/// call into libm, which took 6% of a prefill.
fn nearest_int(v: f32) -> i32 {
    ((v + 12_582_912.0).to_bits() & 0x007f_ffff) as i32 - 0x0040_0000
}

/// The largest magnitude of `x`, NaN if any value is NaN (a NaN compares
/// false, so once it is the running value it stays).
fn amax(x: &[f32]) -> f32 {
    x.iter().fold(0.0f32, |m, &v| {
        let a = v.abs();
        if a > m || a.is_nan() { a } else { m }
    })
}

fn q8_block(x: &[f32], with_sum: bool) -> Q8Block {
    let amax = amax(x);
    let mut b = Q8Block {
        d: 0.0,
        s: 0.0,
        qs: [0; 32],
    };
    if !amax.is_finite() {
        b.d = f32::NAN;
        b.s = f32::NAN;
        return b;
    }
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let mut sum = 0i32;
    for (q, &v) in b.qs.iter_mut().zip(x) {
        // |v·id| ≤ 127 up to rounding, so the cast never saturates.
        *q = nearest_int(v * id) as i8;
        sum += i32::from(*q);
    }
    b.d = f16::from_f32(d).to_f32();
    if with_sum {
        b.s = f16::from_f32(sum as f32 * d).to_f32();
    }
    b
}

fn q8k_block(x: &[f32]) -> Q8KBlock {
    let mut b = Q8KBlock {
        d: 0.0,
        qs: [0; 256],
        bsums: [0; 16],
    };
    let amax = amax(x);
    if !amax.is_finite() {
        b.d = f32::NAN;
        return b;
    }
    if amax == 0.0 {
        return b;
    }
    // The signed value of largest magnitude (the first, as ggml's `>`).
    let max = *x
        .iter()
        .find(|v| v.abs() == amax)
        .expect("amax is one of them");
    let iscale = -127.0 / max;
    for (q, &v) in b.qs.iter_mut().zip(x) {
        *q = nearest_int(iscale * v).min(127) as i8;
    }
    for (s, q) in b.bsums.iter_mut().zip(b.qs.chunks_exact(16)) {
        *s = q.iter().map(|&q| i16::from(q)).sum();
    }
    b.d = 1.0 / iscale;
    b
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ramp(n: usize, scale: f32) -> Vec<f32> {
        (0..n)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * scale)
            .collect()
    }

    #[test]
    fn q8_0_codes_are_within_half_a_step() {
        let x = ramp(64, 0.013);
        let a = Activations::new(ActivationKind::Q8_0, &x, 64).unwrap();
        let blocks = a.q8_row(0);
        assert_eq!(blocks.len(), 2);
        for (b, x) in blocks.iter().zip(x.chunks_exact(32)) {
            let d = amax(x) / 127.0;
            assert_eq!(b.d, f16::from_f32(d).to_f32());
            assert_eq!(b.qs.iter().map(|q| q.unsigned_abs()).max(), Some(127));
            for (&q, &v) in b.qs.iter().zip(x) {
                assert!((f32::from(q) * d - v).abs() <= d / 2.0 * 1.0001);
            }
            assert_eq!(b.s, 0.0);
        }
    }

    #[test]
    fn q8_1_carries_the_code_sum() {
        let x = ramp(32, 0.5);
        let b = Activations::new(ActivationKind::Q8_1, &x, 32)
            .unwrap()
            .q8_row(0)[0];
        let sum: i32 = b.qs.iter().map(|&q| i32::from(q)).sum();
        let d = amax(&x) / 127.0;
        assert_eq!(b.s, f16::from_f32(sum as f32 * d).to_f32());
    }

    #[test]
    fn q8_k_follows_the_signed_maximum() {
        let mut x = ramp(256, 0.01);
        x[17] = -3.0; // the largest magnitude codes to -127 (and d < 0 here)
        let b = Activations::new(ActivationKind::Q8_K, &x, 256)
            .unwrap()
            .q8k_row(0)[0];
        assert_eq!(b.qs[17], -127);
        assert_eq!(b.d, 1.0 / (-127.0 / -3.0));
        for (g, &s) in b.bsums.iter().enumerate() {
            let want: i16 = b.qs[16 * g..16 * g + 16]
                .iter()
                .map(|&q| i16::from(q))
                .sum();
            assert_eq!(s, want);
        }
        for (&q, &v) in b.qs.iter().zip(&x) {
            assert!((f32::from(q) * b.d - v).abs() <= b.d.abs() / 2.0 * 1.0001);
        }
    }

    #[test]
    fn zero_blocks_have_zero_scales() {
        for kind in [ActivationKind::Q8_0, ActivationKind::Q8_K] {
            let a = Activations::new(kind, &[0.0; 256], 256).unwrap();
            assert!(a.dequantized().iter().all(|&v| v == 0.0));
        }
    }

    #[test]
    fn non_finite_values_give_non_finite_scales() {
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let mut x = ramp(256, 0.1);
            x[40] = bad;
            let q8 = Activations::new(ActivationKind::Q8_0, &x, 256).unwrap();
            assert!(q8.q8_row(0)[1].d.is_nan(), "{bad}");
            assert!(q8.q8_row(0)[0].d.is_finite());
            let q8k = Activations::new(ActivationKind::Q8_K, &x, 256).unwrap();
            assert!(q8k.q8k_row(0)[0].d.is_nan(), "{bad}");
        }
    }

    #[test]
    fn nearest_int_rounds_ties_to_even() {
        for v in [
            -127.5f32, -2.5, -0.5, -0.49, 0.0, 0.5, 1.5, 2.5, 3.7, 126.5, 127.0,
        ] {
            assert_eq!(nearest_int(v), v.round_ties_even() as i32, "{v}");
        }
    }

    #[test]
    fn partial_blocks_are_refused() {
        assert!(Activations::new(ActivationKind::Q8_0, &[0.0; 48], 48).is_err());
        assert!(Activations::new(ActivationKind::Q8_K, &[0.0; 512], 512).is_ok());
        assert!(Activations::new(ActivationKind::Q8_0, &[0.0; 40], 32).is_err());
        assert!(Activations::new(ActivationKind::F32, &[0.0; 5], 0).is_err());
    }
}
