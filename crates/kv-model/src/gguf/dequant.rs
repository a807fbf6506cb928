//! A tensor's bytes as kv-model's weights: its [`WeightType`], its values
//! in f32 (kv-model's dequantisers, exactly as ggml defines each block
//! layout) and its stored blocks as a [`QuantMatrix`].

use crate::weights::{QuantMatrix, WeightType, dequantize_into, dequantize_parallel};

use super::Tensor;
use crate::error::{ModelError, Result};

impl Tensor<'_> {
    /// The tensor's type as a weight type (every ggml float and block type
    /// but the integer types, F64 and Q8_1).
    pub fn weight_type(&self) -> Result<WeightType> {
        WeightType::from_ggml_id(self.info.ty.id()).map_err(|_| ModelError::UnsupportedType {
            name: self.info.name.clone(),
            ty: self.info.ty.name().into(),
        })
    }

    /// Dequantises the whole tensor to f32 (row-major, `dims[0]` contiguous).
    pub fn to_f32(&self) -> Result<Vec<f32>> {
        let ty = self.weight_type()?;
        let mut out = vec![0.0f32; self.info.elements() as usize];
        dequantize_parallel(ty, self.data, &mut out)?;
        Ok(out)
    }

    /// Dequantises row `row` (`dims[0]` values) into `out`.
    pub fn row_to_f32(&self, row: usize, out: &mut [f32]) -> Result<()> {
        let ty = self.weight_type()?;
        let len = self.info.row_len();
        if row >= self.info.rows() {
            return Err(ModelError::OutOfRange {
                what: format!("row of {}", self.info.name),
                index: row,
                len: self.info.rows(),
            });
        }
        if out.len() != len {
            return Err(ModelError::ShapeMismatch {
                what: "values of a dequantised row",
                expected: len,
                got: out.len(),
            });
        }
        let row_bytes = ty.row_bytes(len)?;
        dequantize_into(ty, &self.data[row * row_bytes..(row + 1) * row_bytes], out)?;
        Ok(())
    }

    /// The tensor's stored blocks, copied, as `rows × row_len` weights.
    pub fn to_quant_matrix(&self) -> Result<QuantMatrix> {
        let ty = self.weight_type()?;
        QuantMatrix::new(
            ty,
            self.info.rows(),
            self.info.row_len(),
            self.data.to_vec(),
        )
    }
}
