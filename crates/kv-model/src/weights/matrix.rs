//! [`QuantMatrix`]: a weight matrix as its file stores it (rows of whole
//! blocks of one ggml type), and [`StoredLinear`]: a linear layer stacked
//! from such matrices by rows (Q, K and V; gate and up), each part keeping
//! its own type.

use super::WeightType;
use super::dequant::{dequantize_into, dequantize_parallel};
use crate::error::{ModelError, Result};

/// `rows × cols` weights of one type, row-major, as stored.
#[derive(Clone, PartialEq)]
pub struct QuantMatrix {
    ty: WeightType,
    rows: usize,
    cols: usize,
    data: Vec<u8>,
}

impl std::fmt::Debug for QuantMatrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QuantMatrix")
            .field("ty", &self.ty)
            .field("rows", &self.rows)
            .field("cols", &self.cols)
            .field("bytes", &self.data.len())
            .finish()
    }
}

impl QuantMatrix {
    /// Takes `data`: `rows` rows of `cols` values of `ty`. Refuses a row
    /// that is not whole blocks and data of any other length.
    pub fn new(ty: WeightType, rows: usize, cols: usize, data: Vec<u8>) -> Result<Self> {
        let expected = Self::data_len(ty, rows, cols)?;
        if data.len() != expected {
            return Err(ModelError::DataLength {
                what: "weights".into(),
                ty,
                rows,
                cols,
                expected,
                got: data.len(),
            });
        }
        Ok(Self {
            ty,
            rows,
            cols,
            data,
        })
    }

    /// The bytes `rows` rows of `cols` values of `ty` take.
    pub fn data_len(ty: WeightType, rows: usize, cols: usize) -> Result<usize> {
        ty.row_bytes(cols)?
            .checked_mul(rows)
            .ok_or(ModelError::TooLarge { ty, rows, cols })
    }

    /// F32 weights from values (row-major).
    pub fn from_f32(rows: usize, cols: usize, values: &[f32]) -> Result<Self> {
        let data = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        Self::new(WeightType::F32, rows, cols, data)
    }

    /// The type.
    pub fn ty(&self) -> WeightType {
        self.ty
    }

    /// Rows (outputs of the product).
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Values per row (inputs of the product).
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// The stored bytes.
    pub fn data(&self) -> &[u8] {
        &self.data
    }

    /// The bytes as stored, to change in place (fault experiments, and
    /// [`WeightGuard`](crate::model::WeightGuard)'s repairs): any bytes
    /// are a matrix of this type, though not necessarily a finite one.
    pub fn data_mut(&mut self) -> &mut [u8] {
        &mut self.data
    }

    /// Bytes per row.
    pub fn row_bytes(&self) -> usize {
        self.data.len().checked_div(self.rows).unwrap_or(0)
    }

    /// Row `r`'s bytes.
    pub fn row(&self, r: usize) -> Option<&[u8]> {
        let n = self.row_bytes();
        self.data.get(r * n..(r + 1) * n)
    }

    /// Row `r` in f32 into `out` (`cols` values).
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) -> Result<()> {
        let row = self.row(r).ok_or(ModelError::ShapeMismatch {
            what: "row index (rows)",
            expected: self.rows,
            got: r,
        })?;
        dequantize_into(self.ty, row, out)
    }

    /// Every value in f32, row-major.
    pub fn to_f32(&self) -> Vec<f32> {
        let mut out = vec![0.0f32; self.rows * self.cols];
        dequantize_parallel(self.ty, &self.data, &mut out).expect("checked at construction");
        out
    }

    /// This matrix if its type has a product kernel, else its values as
    /// F32 (`Q2_K`, `Q3_K`, `Q8_K`); the flag says whether it converted.
    pub fn with_kernel(self) -> (Self, bool) {
        if self.ty.activation().is_some() {
            return (self, false);
        }
        let values = self.to_f32();
        let m = Self::from_f32(self.rows, self.cols, &values).expect("same shape, F32 rows");
        (m, true)
    }
}

/// A linear layer whose weights are [`QuantMatrix`] parts stacked by rows:
/// output `j` of the layer is row `j` of the parts taken in order.
#[derive(Clone, Debug, PartialEq)]
pub struct StoredLinear {
    parts: Vec<QuantMatrix>,
    rows: usize,
    cols: usize,
}

impl StoredLinear {
    /// Stacks `parts` (at least one, all with the same columns).
    pub fn new(parts: Vec<QuantMatrix>) -> Result<Self> {
        let cols = parts
            .first()
            .map(QuantMatrix::cols)
            .ok_or(ModelError::ShapeMismatch {
                what: "matrices stacked into a linear layer",
                expected: 1,
                got: 0,
            })?;
        if let Some(p) = parts.iter().find(|p| p.cols() != cols) {
            return Err(ModelError::StackColumns {
                expected: cols,
                got: p.cols(),
            });
        }
        let rows = parts.iter().map(QuantMatrix::rows).sum();
        Ok(Self { parts, rows, cols })
    }

    /// The parts, in row order.
    pub fn parts(&self) -> &[QuantMatrix] {
        &self.parts
    }

    /// Each part's bytes as stored with its bytes per row, to change in
    /// place (see [`QuantMatrix::data_mut`]); the shapes stay.
    pub fn part_bytes_mut(&mut self) -> impl Iterator<Item = (&mut [u8], usize)> {
        self.parts.iter_mut().map(|p| {
            let row_bytes = p.row_bytes();
            (p.data_mut(), row_bytes)
        })
    }

    /// Outputs (rows of all parts).
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Inputs.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Stored bytes of all parts.
    pub fn bytes(&self) -> usize {
        self.parts.iter().map(|p| p.data().len()).sum()
    }

    /// Every value in f32, row-major (`rows × cols`).
    pub fn to_f32(&self) -> Vec<f32> {
        self.parts.iter().flat_map(QuantMatrix::to_f32).collect()
    }

    /// Row `r` (of the stack) in f32 into `out` (`cols` values): an
    /// embedding lookup.
    pub fn dequantize_row(&self, mut r: usize, out: &mut [f32]) -> Result<()> {
        for p in &self.parts {
            if r < p.rows() {
                return p.dequantize_row(r, out);
            }
            r -= p.rows();
        }
        Err(ModelError::ShapeMismatch {
            what: "row index (rows)",
            expected: self.rows,
            got: r,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_and_lengths_are_checked() {
        assert!(QuantMatrix::new(WeightType::Q4_0, 2, 64, vec![0; 72]).is_ok());
        assert!(matches!(
            QuantMatrix::new(WeightType::Q4_0, 2, 64, vec![0; 71]),
            Err(ModelError::DataLength {
                expected: 72,
                got: 71,
                ..
            })
        ));
        assert!(matches!(
            QuantMatrix::new(WeightType::Q4_K, 1, 128, vec![0; 72]),
            Err(ModelError::PartialBlock { .. })
        ));
        assert!(matches!(
            QuantMatrix::data_len(WeightType::F32, usize::MAX / 2, 4),
            Err(ModelError::TooLarge { .. })
        ));
    }

    #[test]
    fn rows_dequantize_as_the_whole() {
        let values: Vec<f32> = (0..96).map(|i| i as f32 * 0.25 - 7.0).collect();
        let m = QuantMatrix::from_f32(3, 32, &values).unwrap();
        assert_eq!(m.to_f32(), values);
        let mut row = vec![0.0; 32];
        m.dequantize_row(2, &mut row).unwrap();
        assert_eq!(row, values[64..]);
        assert!(m.dequantize_row(3, &mut row).is_err());
    }

    #[test]
    fn types_without_kernels_become_f32() {
        let m = QuantMatrix::new(WeightType::Q3_K, 1, 256, vec![0x55; 110]).unwrap();
        let values = m.to_f32();
        let (f, converted) = m.with_kernel();
        assert!(converted);
        assert_eq!((f.ty(), f.to_f32()), (WeightType::F32, values));
    }

    #[test]
    fn stacks_need_equal_columns() {
        let a = QuantMatrix::from_f32(1, 32, &[1.0; 32]).unwrap();
        let b = QuantMatrix::from_f32(2, 64, &[1.0; 128]).unwrap();
        assert!(matches!(
            StoredLinear::new(vec![a.clone(), b]),
            Err(ModelError::StackColumns {
                expected: 32,
                got: 64
            })
        ));
        assert!(StoredLinear::new(vec![]).is_err());
        let s = StoredLinear::new(vec![a.clone(), a]).unwrap();
        assert_eq!((s.rows(), s.cols(), s.bytes()), (2, 32, 256));
    }
}
