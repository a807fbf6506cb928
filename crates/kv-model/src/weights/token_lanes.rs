//! Eight tokens' Q8_0, Q8_1 or Q8_K activations interleaved a token per
//! 32-bit lane, the form the token-lane kernels (`Q4_0`, `Q5_0`, `Q4_1`,
//! `Q5_1`, `Q4_K`, `Q6_K`) multiply by.
//!
//! A row kernel of the 32-value types sums a block's 32 products over the
//! eight lanes of a register and then has to add the lanes (or keep eight
//! partial sums) for every token. With the tokens in the lanes instead,
//! one weight row's four codes `4k .. 4k + 4` are broadcast to all eight
//! lanes and multiplied by the eight tokens' codes `4k .. 4k + 4` at once,
//! so a block's eight products per token come out of eight multiply-adds
//! in eight lanes, already one sum per token, and the scale is applied
//! once per block for the eight (llama.cpp's repacked `Q4_0` kernels put
//! weight rows in the lanes for the same reason; activations are the side
//! that is cheap to rearrange here, once per product, because the weights
//! stay as stored).

use super::activations::{Activations, Q8Block, Q8KBlock};

/// Block `b` of eight tokens' Q8_0 rows.
#[derive(Clone, Copy, Debug, PartialEq)]
#[repr(C, align(32))]
pub(crate) struct Q8x8Block {
    /// Codes `4k .. 4k + 4` of token `t` at `qs[8k + t]`.
    pub(crate) qs: [[i8; 4]; 64],
    /// Each token's scale.
    pub(crate) d: [f32; 8],
    /// Each token's sum of its 32 codes (the offset term of the weight
    /// types whose codes are stored shifted, `Q4_0` and `Q5_0`).
    pub(crate) sum: [i32; 8],
    /// Each token's `d·Σq` (Q8_1 rows; the min term of `Q4_1` and `Q5_1`).
    pub(crate) s: [f32; 8],
}

impl Q8x8Block {
    /// The blocks `b` of `rows`.
    fn new(rows: [&Q8Block; 8]) -> Q8x8Block {
        Q8x8Block {
            qs: std::array::from_fn(|i| {
                let (k, t) = (i / 8, i % 8);
                std::array::from_fn(|e| rows[t].qs[4 * k + e])
            }),
            d: rows.map(|r| r.d),
            sum: rows.map(|r| r.qs.iter().map(|&q| i32::from(q)).sum()),
            s: rows.map(|r| r.s),
        }
    }
}

/// Super-block `b` of eight tokens' Q8_K rows.
#[derive(Clone, Copy, Debug, PartialEq)]
#[repr(C, align(32))]
pub(crate) struct Q8Kx8Block {
    /// Codes `4k .. 4k + 4` of token `t` at `qs[8k + t]`.
    pub(crate) qs: [[i8; 4]; 512],
    /// Each token's scale.
    pub(crate) d: [f32; 8],
    /// Sums of codes `32j .. 32j + 16` and `32j + 16 .. 32j + 32` of token
    /// `t` at `bsums[8j + t]` (the k-quants multiply them by a scale or a
    /// min per run of 32, or per 16: one `vpmaddwd` for the eight tokens).
    pub(crate) bsums: [[i16; 2]; 64],
}

impl Q8Kx8Block {
    /// The super-blocks `b` of `rows`.
    fn new(rows: [&Q8KBlock; 8]) -> Q8Kx8Block {
        Q8Kx8Block {
            qs: std::array::from_fn(|i| {
                let (k, t) = (i / 8, i % 8);
                std::array::from_fn(|e| rows[t].qs[4 * k + e])
            }),
            d: rows.map(|r| r.d),
            bsums: std::array::from_fn(|i| {
                let (j, t) = (i / 8, i % 8);
                [rows[t].bsums[2 * j], rows[t].bsums[2 * j + 1]]
            }),
        }
    }
}

/// The Q8_K rows of `a` in groups of eight tokens, laid out as
/// [`interleave`]'s. Empty unless `a` is Q8_K.
pub(crate) fn interleave_k(a: &Activations) -> Vec<Q8Kx8Block> {
    if a.kind() != super::ActivationKind::Q8_K {
        return Vec::new();
    }
    let blocks = a.cols() / 256;
    let last = a.rows().saturating_sub(1);
    let mut out = Vec::with_capacity(a.rows().div_ceil(8) * blocks);
    for g in 0..a.rows().div_ceil(8) {
        let rows: [&[Q8KBlock]; 8] = std::array::from_fn(|t| a.q8k_row((8 * g + t).min(last)));
        out.extend((0..blocks).map(|b| Q8Kx8Block::new(rows.map(|r| &r[b]))));
    }
    out
}

/// The Q8_0 or Q8_1 rows of `a` in groups of eight tokens: group `g`
/// (tokens `8g .. 8g + 8`) at `blocks·g .. blocks·(g + 1)`; a last group
/// of fewer than eight is filled up with its last token (lanes whose
/// results are not read). Empty unless `a` is Q8_0 or Q8_1.
pub(crate) fn interleave(a: &Activations) -> Vec<Q8x8Block> {
    use super::ActivationKind::{Q8_0, Q8_1};
    if !matches!(a.kind(), Q8_0 | Q8_1) {
        return Vec::new();
    }
    let blocks = a.cols() / 32;
    let last = a.rows().saturating_sub(1);
    let mut out = Vec::with_capacity(a.rows().div_ceil(8) * blocks);
    for g in 0..a.rows().div_ceil(8) {
        let rows: [&[Q8Block]; 8] = std::array::from_fn(|t| a.q8_row((8 * g + t).min(last)));
        out.extend((0..blocks).map(|b| Q8x8Block::new(rows.map(|r| &r[b]))));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::weights::ActivationKind;

    #[test]
    fn lanes_hold_each_tokens_codes_in_order() {
        let (rows, cols) = (19, 64);
        let x: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 29 % 83) as f32 - 41.0) * 0.07)
            .collect();
        let a = Activations::new(ActivationKind::Q8_0, &x, cols).unwrap();
        let lanes = interleave(&a);
        assert_eq!(
            lanes.len(),
            3 * 2,
            "two whole groups of eight, one of three; two blocks"
        );
        for g in 0..3 {
            for b in 0..2 {
                let l = &lanes[2 * g + b];
                for t in 0..8 {
                    // The last group filled up with token 18.
                    let row = &a.q8_row((8 * g + t).min(rows - 1))[b];
                    for e in 0..32 {
                        assert_eq!(l.qs[8 * (e / 4) + t][e % 4], row.qs[e]);
                    }
                    assert_eq!(l.d[t], row.d);
                    assert_eq!((l.s[t], row.s), (0.0, 0.0));
                    assert_eq!(l.sum[t], row.qs.iter().map(|&q| i32::from(q)).sum::<i32>());
                }
            }
        }
        let q8_1 = Activations::new(ActivationKind::Q8_1, &x, cols).unwrap();
        let lanes = interleave(&q8_1);
        assert_eq!(lanes[3].s[5], q8_1.q8_row(13)[1].s);
        assert_ne!(lanes[3].s[5], 0.0);
        let q8k = Activations::new(ActivationKind::Q8_K, &[0.5; 256 * 8], 256).unwrap();
        assert!(interleave(&q8k).is_empty());
        assert!(interleave_k(&a).is_empty());
    }

    #[test]
    fn super_block_lanes_hold_each_tokens_codes_and_sums() {
        let (rows, cols) = (17, 512);
        let x: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 31 % 97) as f32 - 48.0) * 0.05)
            .collect();
        let a = Activations::new(ActivationKind::Q8_K, &x, cols).unwrap();
        let lanes = interleave_k(&a);
        assert_eq!(
            lanes.len(),
            3 * 2,
            "two whole groups of eight, one of one; two super-blocks"
        );
        for g in 0..3 {
            for b in 0..2 {
                let l = &lanes[2 * g + b];
                for t in 0..8 {
                    // The last group filled up with token 16.
                    let row = &a.q8k_row((8 * g + t).min(rows - 1))[b];
                    for e in 0..256 {
                        assert_eq!(l.qs[8 * (e / 4) + t][e % 4], row.qs[e]);
                    }
                    for j in 0..8 {
                        assert_eq!(l.bsums[8 * j + t], [row.bsums[2 * j], row.bsums[2 * j + 1]]);
                    }
                    assert_eq!(l.d[t], row.d);
                }
            }
        }
    }
}
