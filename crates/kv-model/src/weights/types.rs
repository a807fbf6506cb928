//! The ggml tensor types weights are stored in, with their block geometry
//! (`ggml.h`'s `ggml_type` ids, `ggml-common.h`'s block structs) and the
//! activation form each type's product multiplies by.

use crate::error::{ModelError, Result};

/// A ggml weight type: how a row of weights is cut into blocks and coded.
#[allow(non_camel_case_types)] // ggml's own spellings, as GGUF tools print them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum WeightType {
    /// IEEE single precision.
    F32,
    /// IEEE half precision.
    F16,
    /// bfloat16.
    BF16,
    /// 32 values: f16 scale, 4-bit codes; `x = (q − 8)·d`.
    Q4_0,
    /// 32 values: f16 scale and min, 4-bit codes; `x = q·d + m`.
    Q4_1,
    /// 32 values: f16 scale, 5-bit codes; `x = (q − 16)·d`.
    Q5_0,
    /// 32 values: f16 scale and min, 5-bit codes; `x = q·d + m`.
    Q5_1,
    /// 32 values: f16 scale, 8-bit codes; `x = q·d`.
    Q8_0,
    /// 256 values: 2-bit codes, 4-bit scales and mins per 16.
    Q2_K,
    /// 256 values: 3-bit codes, 6-bit scales per 16.
    Q3_K,
    /// 256 values: 4-bit codes, 6-bit scales and mins per 32.
    Q4_K,
    /// 256 values: 5-bit codes, 6-bit scales and mins per 32.
    Q5_K,
    /// 256 values: 6-bit codes, 8-bit scales per 16.
    Q6_K,
    /// 256 values: f32 scale, 8-bit codes, sums of 16 (ggml's activation
    /// type of the k-quants).
    Q8_K,
}

/// How a product quantises the activations a weight type is multiplied by
/// (llama.cpp's `vec_dot_type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[allow(non_camel_case_types)] // ggml's spellings.
pub enum ActivationKind {
    /// Kept in f32 (float weight types).
    F32,
    /// 32 values per block, f16 scale, 8-bit codes (`block_q8_0`).
    Q8_0,
    /// As [`Q8_0`](Self::Q8_0) with `s = d·Σq` for the weights' min term
    /// (`block_q8_1`).
    Q8_1,
    /// 256 values per block, f32 scale, 8-bit codes and sums of 16
    /// (`block_q8_K`).
    Q8_K,
}

impl WeightType {
    /// Every type, in ggml id order.
    pub const ALL: [WeightType; 14] = [
        Self::F32,
        Self::F16,
        Self::Q4_0,
        Self::Q4_1,
        Self::Q5_0,
        Self::Q5_1,
        Self::Q8_0,
        Self::Q2_K,
        Self::Q3_K,
        Self::Q4_K,
        Self::Q5_K,
        Self::Q6_K,
        Self::Q8_K,
        Self::BF16,
    ];

    /// The type with ggml id `id`.
    pub fn from_ggml_id(id: u32) -> Result<Self> {
        Self::ALL
            .into_iter()
            .find(|t| t.ggml_id() == id)
            .ok_or(ModelError::UnknownType(id))
    }

    /// ggml's id (`enum ggml_type`).
    pub fn ggml_id(self) -> u32 {
        match self {
            Self::F32 => 0,
            Self::F16 => 1,
            Self::Q4_0 => 2,
            Self::Q4_1 => 3,
            Self::Q5_0 => 6,
            Self::Q5_1 => 7,
            Self::Q8_0 => 8,
            Self::Q2_K => 10,
            Self::Q3_K => 11,
            Self::Q4_K => 12,
            Self::Q5_K => 13,
            Self::Q6_K => 14,
            Self::Q8_K => 15,
            Self::BF16 => 30,
        }
    }

    /// ggml's name (`"Q4_K"`).
    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "F32",
            Self::F16 => "F16",
            Self::BF16 => "BF16",
            Self::Q4_0 => "Q4_0",
            Self::Q4_1 => "Q4_1",
            Self::Q5_0 => "Q5_0",
            Self::Q5_1 => "Q5_1",
            Self::Q8_0 => "Q8_0",
            Self::Q2_K => "Q2_K",
            Self::Q3_K => "Q3_K",
            Self::Q4_K => "Q4_K",
            Self::Q5_K => "Q5_K",
            Self::Q6_K => "Q6_K",
            Self::Q8_K => "Q8_K",
        }
    }

    /// Values per block.
    pub fn block_elems(self) -> usize {
        match self {
            Self::F32 | Self::F16 | Self::BF16 => 1,
            Self::Q4_0 | Self::Q4_1 | Self::Q5_0 | Self::Q5_1 | Self::Q8_0 => 32,
            _ => 256,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::F16 | Self::BF16 => 2,
            Self::Q4_0 => 18,
            Self::Q4_1 => 20,
            Self::Q5_0 => 22,
            Self::Q5_1 => 24,
            Self::Q8_0 => 34,
            Self::Q2_K => 84,
            Self::Q3_K => 110,
            Self::Q4_K => 144,
            Self::Q5_K => 176,
            Self::Q6_K => 210,
            Self::Q8_K => 292,
        }
    }

    /// Stored bits per weight (`block_bytes · 8 / block_elems`).
    pub fn bits_per_weight(self) -> f64 {
        (self.block_bytes() * 8) as f64 / self.block_elems() as f64
    }

    /// The activation form this type's product multiplies by, or `None`
    /// where no product kernel exists (`Q2_K`, `Q3_K`, `Q8_K`: dequantise
    /// those to F32).
    pub fn activation(self) -> Option<ActivationKind> {
        Some(match self {
            Self::F32 | Self::F16 | Self::BF16 => ActivationKind::F32,
            Self::Q4_0 | Self::Q5_0 | Self::Q8_0 => ActivationKind::Q8_0,
            Self::Q4_1 | Self::Q5_1 => ActivationKind::Q8_1,
            Self::Q4_K | Self::Q5_K | Self::Q6_K => ActivationKind::Q8_K,
            Self::Q2_K | Self::Q3_K | Self::Q8_K => return None,
        })
    }

    /// Bytes of a row of `cols` values, checking that `cols` is a whole
    /// number of blocks.
    pub fn row_bytes(self, cols: usize) -> Result<usize> {
        let block = self.block_elems();
        if !cols.is_multiple_of(block) {
            return Err(ModelError::PartialBlock {
                ty: self,
                cols,
                block,
            });
        }
        Ok(cols / block * self.block_bytes())
    }
}

impl std::fmt::Display for WeightType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for WeightType {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|t| t.name().eq_ignore_ascii_case(s))
            .ok_or_else(|| format!("unknown ggml type {s:?}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_and_names_round_trip() {
        for t in WeightType::ALL {
            assert_eq!(WeightType::from_ggml_id(t.ggml_id()).ok(), Some(t));
            assert_eq!(t.name().parse::<WeightType>(), Ok(t));
        }
        assert!(matches!(
            WeightType::from_ggml_id(9),
            Err(ModelError::UnknownType(9))
        ));
        assert!("Q4_X".parse::<WeightType>().is_err());
    }

    #[test]
    fn geometry_is_ggmls() {
        assert_eq!(WeightType::Q4_K.bits_per_weight(), 4.5);
        assert_eq!(WeightType::Q6_K.bits_per_weight(), 6.5625);
        assert_eq!(WeightType::Q4_1.row_bytes(576).ok(), Some(360));
        assert!(matches!(
            WeightType::Q4_K.row_bytes(896),
            Err(ModelError::PartialBlock {
                ty: WeightType::Q4_K,
                cols: 896,
                block: 256
            })
        ));
    }
}
