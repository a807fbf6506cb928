//! Dequantisation of GGUF tensors to f32, block by block, exactly as ggml
//! defines each type's block layout: the plain and 32-value types here, the
//! k-quants' super-blocks in `kquants.rs`.

use half::{bf16, f16};
use rayon::prelude::*;

use super::Tensor;
use super::kquants::{
    dequant_q2_k, dequant_q3_k, dequant_q4_k, dequant_q5_k, dequant_q6_k, dequant_q8_k,
};
use crate::error::{EvalError, Result};

impl Tensor<'_> {
    /// Dequantises the whole tensor to f32 (row-major, `dims[0]` contiguous).
    pub fn to_f32(&self) -> Result<Vec<f32>> {
        let n = self.info.elements() as usize;
        let mut out = vec![0.0f32; n];
        let dequant = self.dequantizer()?;
        let block_elems = self.info.ty.block_elems as usize;
        let block_bytes = self.info.ty.block_bytes as usize;
        // 256 blocks per work item keeps rayon's overhead negligible.
        let per_item = 256;
        out.par_chunks_mut(block_elems * per_item)
            .zip(self.data.par_chunks(block_bytes * per_item))
            .for_each(|(out, data)| {
                for (o, b) in out
                    .chunks_exact_mut(block_elems)
                    .zip(data.chunks_exact(block_bytes))
                {
                    dequant(b, o);
                }
            });
        Ok(out)
    }

    /// Dequantises row `row` (`dims[0]` values) into `out`.
    pub fn row_to_f32(&self, row: usize, out: &mut [f32]) -> Result<()> {
        let len = self.info.row_len();
        if row >= self.info.rows() {
            return Err(EvalError::OutOfRange {
                what: format!("row of {}", self.info.name),
                index: row,
                len: self.info.rows(),
            });
        }
        if out.len() != len {
            return Err(EvalError::ShapeMismatch {
                what: "values of a dequantised row",
                expected: len,
                got: out.len(),
            });
        }
        let dequant = self.dequantizer()?;
        let block_elems = self.info.ty.block_elems as usize;
        let block_bytes = self.info.ty.block_bytes as usize;
        let row_bytes = len / block_elems * block_bytes;
        let data = &self.data[row * row_bytes..(row + 1) * row_bytes];
        for (o, b) in out
            .chunks_exact_mut(block_elems)
            .zip(data.chunks_exact(block_bytes))
        {
            dequant(b, o);
        }
        Ok(())
    }

    fn dequantizer(&self) -> Result<BlockDequant> {
        Ok(match self.info.ty.name {
            "F32" => dequant_f32,
            "F16" => dequant_f16,
            "BF16" => dequant_bf16,
            "Q8_0" => dequant_q8_0,
            "Q4_0" => dequant_q4_0,
            "Q4_1" => dequant_q4_1,
            "Q5_0" => dequant_q5_0,
            "Q5_1" => dequant_q5_1,
            "Q2_K" => dequant_q2_k,
            "Q3_K" => dequant_q3_k,
            "Q4_K" => dequant_q4_k,
            "Q5_K" => dequant_q5_k,
            "Q6_K" => dequant_q6_k,
            "Q8_K" => dequant_q8_k,
            other => {
                return Err(EvalError::UnsupportedType {
                    name: self.info.name.clone(),
                    ty: other.into(),
                });
            }
        })
    }
}

/// Dequantises one block of a ggml type into its elements.
type BlockDequant = fn(&[u8], &mut [f32]);

fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

pub(super) fn dequant_f32(b: &[u8], out: &mut [f32]) {
    out[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
}

pub(super) fn dequant_f16(b: &[u8], out: &mut [f32]) {
    out[0] = f16_at(b, 0);
}

pub(super) fn dequant_bf16(b: &[u8], out: &mut [f32]) {
    out[0] = bf16::from_le_bytes([b[0], b[1]]).to_f32();
}

/// `block_q8_0`: f16 `d`, then 32 `i8` quants; `x = q·d`.
pub(super) fn dequant_q8_0(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 0);
    for (o, &q) in out.iter_mut().zip(&b[2..34]) {
        *o = f32::from(q as i8) * d;
    }
}

/// `block_q4_0`: f16 `d`, then 16 bytes; byte `j` holds element `j` in its
/// low nibble and element `j + 16` in its high nibble; `x = (q − 8)·d`.
pub(super) fn dequant_q4_0(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 0);
    for (j, &q) in b[2..18].iter().enumerate() {
        out[j] = (f32::from(q & 0x0f) - 8.0) * d;
        out[j + 16] = (f32::from(q >> 4) - 8.0) * d;
    }
}

/// `block_q4_1`: f16 `d`, f16 `m`, then 16 bytes as in Q4_0; `x = q·d + m`.
pub(super) fn dequant_q4_1(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 0);
    let m = f16_at(b, 2);
    for (j, &q) in b[4..20].iter().enumerate() {
        out[j] = f32::from(q & 0x0f) * d + m;
        out[j + 16] = f32::from(q >> 4) * d + m;
    }
}

/// The fifth bits of a `Q5_0`/`Q5_1` block (`qh`, little-endian u32: bit
/// `j` belongs to element `j`) merged into the nibbles of `qs` (laid out as
/// in Q4_0): the 5-bit codes of elements `j` and `j + 16`.
fn q5_codes(qh: &[u8], qs: &[u8]) -> impl Iterator<Item = (usize, u8, u8)> {
    let qh = u32::from_le_bytes([qh[0], qh[1], qh[2], qh[3]]);
    qs.iter().enumerate().map(move |(j, &q)| {
        let hi0 = ((qh >> j) & 1) as u8;
        let hi1 = ((qh >> (j + 16)) & 1) as u8;
        (j, (q & 0x0f) | (hi0 << 4), (q >> 4) | (hi1 << 4))
    })
}

/// `block_q5_0`: f16 `d`, `qh[4]`, then 16 bytes of nibbles; `x = (q − 16)·d`.
pub(super) fn dequant_q5_0(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 0);
    for (j, q0, q1) in q5_codes(&b[2..6], &b[6..22]) {
        out[j] = f32::from(q0 as i8 - 16) * d;
        out[j + 16] = f32::from(q1 as i8 - 16) * d;
    }
}

/// `block_q5_1`: f16 `d`, f16 `m`, `qh[4]`, then 16 bytes of nibbles;
/// `x = q·d + m`.
pub(super) fn dequant_q5_1(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 0);
    let m = f16_at(b, 2);
    for (j, q0, q1) in q5_codes(&b[4..8], &b[8..24]) {
        out[j] = f32::from(q0) * d + m;
        out[j + 16] = f32::from(q1) * d + m;
    }
}
