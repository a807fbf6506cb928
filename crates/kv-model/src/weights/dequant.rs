//! Dequantisation of stored weights to f32, block by block, exactly as ggml
//! defines each type's block layout: the float and 32-value types here, the
//! k-quants' super-blocks in `kquants.rs`. These are also the reference the
//! product kernels are tested against.

use half::{bf16, f16};

use super::WeightType;
use super::kquants::{
    dequant_q2_k, dequant_q3_k, dequant_q4_k, dequant_q5_k, dequant_q6_k, dequant_q8_k,
};
use crate::error::{ModelError, Result};

/// Dequantises `data` (whole blocks of `ty`) into `out`, one value per
/// element, in ggml's order.
pub fn dequantize_into(ty: WeightType, data: &[u8], out: &mut [f32]) -> Result<()> {
    let (elems, bytes) = (ty.block_elems(), ty.block_bytes());
    let blocks = data.len() / bytes;
    if !data.len().is_multiple_of(bytes) || out.len() != blocks * elems {
        return Err(ModelError::ShapeMismatch {
            what: "values of dequantised blocks",
            expected: blocks * elems,
            got: out.len(),
        });
    }
    let dequant = block_dequantizer(ty);
    for (o, b) in out.chunks_exact_mut(elems).zip(data.chunks_exact(bytes)) {
        dequant(b, o);
    }
    Ok(())
}

/// [`dequantize_into`] over rayon: large tensors (an embedding table, a
/// whole matrix) at every pool thread.
pub fn dequantize_parallel(ty: WeightType, data: &[u8], out: &mut [f32]) -> Result<()> {
    use rayon::prelude::*;
    let (elems, bytes) = (ty.block_elems(), ty.block_bytes());
    if !data.len().is_multiple_of(bytes) || out.len() != data.len() / bytes * elems {
        return Err(ModelError::ShapeMismatch {
            what: "values of dequantised blocks",
            expected: data.len() / bytes * elems,
            got: out.len(),
        });
    }
    // 256 blocks per work item keeps rayon's overhead negligible.
    out.par_chunks_mut(elems * 256)
        .zip(data.par_chunks(bytes * 256))
        .try_for_each(|(out, data)| dequantize_into(ty, data, out))
}

/// Dequantises one block of a ggml type into its elements.
type BlockDequant = fn(&[u8], &mut [f32]);

/// The block dequantiser of `ty`.
fn block_dequantizer(ty: WeightType) -> BlockDequant {
    match ty {
        WeightType::F32 => dequant_f32,
        WeightType::F16 => dequant_f16,
        WeightType::BF16 => dequant_bf16,
        WeightType::Q8_0 => dequant_q8_0,
        WeightType::Q4_0 => dequant_q4_0,
        WeightType::Q4_1 => dequant_q4_1,
        WeightType::Q5_0 => dequant_q5_0,
        WeightType::Q5_1 => dequant_q5_1,
        WeightType::Q2_K => dequant_q2_k,
        WeightType::Q3_K => dequant_q3_k,
        WeightType::Q4_K => dequant_q4_k,
        WeightType::Q5_K => dequant_q5_k,
        WeightType::Q6_K => dequant_q6_k,
        WeightType::Q8_K => dequant_q8_k,
    }
}

/// The f16 at byte `i` of a block.
pub(crate) fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

fn dequant_f32(b: &[u8], out: &mut [f32]) {
    out[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
}

fn dequant_f16(b: &[u8], out: &mut [f32]) {
    out[0] = f16_at(b, 0);
}

fn dequant_bf16(b: &[u8], out: &mut [f32]) {
    out[0] = bf16::from_le_bytes([b[0], b[1]]).to_f32();
}

/// `block_q8_0`: f16 `d`, then 32 `i8` quants; `x = q·d`.
fn dequant_q8_0(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 0);
    for (o, &q) in out.iter_mut().zip(&b[2..34]) {
        *o = f32::from(q as i8) * d;
    }
}

/// `block_q4_0`: f16 `d`, then 16 bytes; byte `j` holds element `j` in its
/// low nibble and element `j + 16` in its high nibble; `x = (q − 8)·d`.
fn dequant_q4_0(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 0);
    for (j, &q) in b[2..18].iter().enumerate() {
        out[j] = (f32::from(q & 0x0f) - 8.0) * d;
        out[j + 16] = (f32::from(q >> 4) - 8.0) * d;
    }
}

/// `block_q4_1`: f16 `d`, f16 `m`, then 16 bytes as in Q4_0; `x = q·d + m`.
fn dequant_q4_1(b: &[u8], out: &mut [f32]) {
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
pub(crate) fn q5_codes(qh: &[u8], qs: &[u8]) -> impl Iterator<Item = (usize, u8, u8)> {
    let qh = u32::from_le_bytes([qh[0], qh[1], qh[2], qh[3]]);
    qs.iter().enumerate().map(move |(j, &q)| {
        let hi0 = ((qh >> j) & 1) as u8;
        let hi1 = ((qh >> (j + 16)) & 1) as u8;
        (j, (q & 0x0f) | (hi0 << 4), (q >> 4) | (hi1 << 4))
    })
}

/// `block_q5_0`: f16 `d`, `qh[4]`, then 16 bytes of nibbles; `x = (q − 16)·d`.
fn dequant_q5_0(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 0);
    for (j, q0, q1) in q5_codes(&b[2..6], &b[6..22]) {
        out[j] = f32::from(q0 as i8 - 16) * d;
        out[j + 16] = f32::from(q1 as i8 - 16) * d;
    }
}

/// `block_q5_1`: f16 `d`, f16 `m`, `qh[4]`, then 16 bytes of nibbles;
/// `x = q·d + m`.
fn dequant_q5_1(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 0);
    let m = f16_at(b, 2);
    for (j, q0, q1) in q5_codes(&b[4..8], &b[8..24]) {
        out[j] = f32::from(q0) * d + m;
        out[j + 16] = f32::from(q1) * d + m;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block(ty: WeightType, bytes: &[u8]) -> Vec<f32> {
        let mut out = vec![0.0; ty.block_elems()];
        dequantize_into(ty, bytes, &mut out).unwrap();
        out
    }

    #[test]
    fn q4_1_block_follows_ggml_nibble_order() {
        let mut b = vec![0u8; 20];
        b[0..2].copy_from_slice(&f16::from_f32(0.5).to_le_bytes());
        b[2..4].copy_from_slice(&f16::from_f32(-1.0).to_le_bytes());
        for j in 0..16 {
            b[4 + j] = (j as u8) | (((15 - j) as u8) << 4);
        }
        let out = block(WeightType::Q4_1, &b);
        for j in 0..16 {
            assert_eq!(out[j], j as f32 * 0.5 - 1.0);
            assert_eq!(out[j + 16], (15 - j) as f32 * 0.5 - 1.0);
        }
    }

    #[test]
    fn q4_0_and_q8_0_blocks() {
        let mut b = vec![0u8; 18];
        b[0..2].copy_from_slice(&f16::from_f32(2.0).to_le_bytes());
        b[2] = 0x9f; // element 0: 15 → 14, element 16: 9 → 2
        let out = block(WeightType::Q4_0, &b);
        assert_eq!((out[0], out[16], out[1]), (14.0, 2.0, -16.0));
        let mut b = vec![0u8; 34];
        b[0..2].copy_from_slice(&f16::from_f32(0.25).to_le_bytes());
        b[2] = (-128i8) as u8;
        b[33] = 127;
        let out = block(WeightType::Q8_0, &b);
        assert_eq!((out[0], out[31], out[5]), (-32.0, 31.75, 0.0));
    }

    #[test]
    fn q5_blocks_take_their_fifth_bits_from_qh() {
        let mut b = vec![0u8; 22];
        b[0..2].copy_from_slice(&f16::from_f32(1.0).to_le_bytes());
        b[2..6].copy_from_slice(&(1u32 | 1 << 17).to_le_bytes());
        b[6] = 0x21; // element 0: 1 | 16, element 16: 2
        b[7] = 0x43; // element 1: 3, element 17: 4 | 16
        let out = block(WeightType::Q5_0, &b);
        assert_eq!((out[0], out[16], out[1], out[17]), (1.0, -14.0, -13.0, 4.0));
    }
}
