//! Whether stored weights are all finite, read from where a non-finite
//! value can hide in each layout: every value of the float types, the
//! float scale fields of the block types (their codes are small integers,
//! so a block's values are finite exactly when its scales are).

use rayon::prelude::*;

use super::WeightType;

/// Byte offsets of a block's f16 fields (scales and minimums) in ggml's
/// layout of `ty`; `None` for the float types and Q8_K (an f32 scale).
fn half_fields(ty: WeightType) -> Option<&'static [usize]> {
    Some(match ty {
        // {d, qs} and {d, qh, qs}.
        WeightType::Q4_0 | WeightType::Q5_0 | WeightType::Q8_0 => &[0],
        // {d, m, ...}, and the k-quants' {d, dmin, scales, ...}.
        WeightType::Q4_1 | WeightType::Q5_1 | WeightType::Q4_K | WeightType::Q5_K => &[0, 2],
        // {scales[16], qs[64], d, dmin}.
        WeightType::Q2_K => &[80, 82],
        // {hmask[32], qs[64], scales[12], d}.
        WeightType::Q3_K => &[108],
        // {ql[128], qh[64], scales[16], d}.
        WeightType::Q6_K => &[208],
        WeightType::F32 | WeightType::F16 | WeightType::BF16 | WeightType::Q8_K => return None,
    })
}

/// The index of the first block of `data` (whole blocks of `ty`) holding
/// a NaN or an infinity, or whose scale does; `None` when all are finite.
pub fn first_non_finite(ty: WeightType, data: &[u8]) -> Option<usize> {
    let bb = ty.block_bytes();
    let finite_half = |b: &[u8]| half::f16::from_le_bytes([b[0], b[1]]).is_finite();
    let finite_bf16 = |b: &[u8]| half::bf16::from_le_bytes([b[0], b[1]]).is_finite();
    let finite_f32 = |b: &[u8]| f32::from_le_bytes([b[0], b[1], b[2], b[3]]).is_finite();
    let block_ok = |b: &[u8]| -> bool {
        match (ty, half_fields(ty)) {
            (_, Some(fields)) => fields.iter().all(|&o| finite_half(&b[o..])),
            (WeightType::F16, None) => finite_half(b),
            (WeightType::BF16, None) => finite_bf16(b),
            // F32 values, and Q8_K's f32 scale first in its block.
            _ => finite_f32(b),
        }
    };
    data.par_chunks_exact(bb).position_first(|b| !block_ok(b))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_a_non_finite_value_or_scale_in_every_type() {
        for ty in WeightType::ALL {
            let bb = ty.block_bytes();
            let mut data = vec![0u8; 5 * bb];
            assert_eq!(first_non_finite(ty, &data), None, "{ty:?}");
            // A NaN where the layout keeps its floats, in block 3.
            let at = 3 * bb + half_fields(ty).map_or(0, |f| f[f.len() - 1]);
            match (ty, half_fields(ty)) {
                (_, Some(_)) | (WeightType::F16, None) => {
                    data[at..at + 2].copy_from_slice(&half::f16::NAN.to_le_bytes());
                }
                (WeightType::BF16, None) => {
                    data[at..at + 2].copy_from_slice(&half::bf16::INFINITY.to_le_bytes());
                }
                _ => data[at..at + 4].copy_from_slice(&f32::NEG_INFINITY.to_le_bytes()),
            }
            assert_eq!(first_non_finite(ty, &data), Some(3), "{ty:?}");
        }
    }

    #[test]
    fn the_scale_offsets_are_the_dequantisers() {
        // A block whose only non-zero byte pair is its scale field reads as
        // non-zero values, and one whose scale is zero reads as zeros:
        // the offsets above are where the dequantisers read their scales.
        for ty in WeightType::ALL {
            let Some(fields) = half_fields(ty) else {
                continue;
            };
            let mut block = vec![0x11u8; ty.block_bytes()];
            for &o in fields {
                block[o..o + 2].copy_from_slice(&half::f16::ZERO.to_le_bytes());
            }
            let mut out = vec![1.0f32; ty.block_elems()];
            crate::weights::dequantize_into(ty, &block, &mut out).unwrap();
            assert!(out.iter().all(|&v| v == 0.0), "{ty:?}: {out:?}");
        }
    }
}
