//! `ndarray` entry points (feature `ndarray`): a caller holding K or V as an
//! `ArrayView2` (`tokens × channels`) quantizes it and gets the decoded
//! matrix back as an `Array2`, without first copying into a `Vec`.
//!
//! A view in standard (row-major, contiguous) layout is read in place; any
//! other layout (a transposed or strided view) is copied once into row-major
//! order, which is what the stored forms need anyway.

use ndarray::{Array2, ArrayView2};

use crate::error::Result;
use crate::spec::CacheForm;
use crate::store::{DecodedMatrix, KvStore, QuantizeOptions};

impl KvStore {
    /// [`KvStore::quantize`] of a `tokens × channels` view.
    pub fn quantize_array(form: CacheForm, data: ArrayView2<'_, f32>) -> Result<Self> {
        Self::quantize_array_with(form, data, QuantizeOptions::default())
    }

    /// [`KvStore::quantize_with`] of a `tokens × channels` view.
    pub fn quantize_array_with(
        form: CacheForm,
        data: ArrayView2<'_, f32>,
        options: QuantizeOptions,
    ) -> Result<Self> {
        let (tokens, channels) = data.dim();
        let rows = data.as_standard_layout();
        let slice = rows.as_slice().expect("standard layout is contiguous");
        Self::quantize_with(form, slice, tokens, channels, options)
    }
}

impl DecodedMatrix {
    /// The decoded values as a `tokens × channels` array (moved, not copied).
    pub fn values_array(self, channels: usize) -> Result<Array2<f32>> {
        let tokens = self.values.len().checked_div(channels).unwrap_or(0);
        crate::error::check_len("decoded values", tokens * channels, self.values.len())?;
        Ok(Array2::from_shape_vec((tokens, channels), self.values)
            .expect("length checked against the shape"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ndarray::Array2;

    fn matrix(tokens: usize, channels: usize) -> Array2<f32> {
        Array2::from_shape_fn((tokens, channels), |(t, c)| {
            ((t * 31 + c * 17) % 23) as f32 / 7.0 - 1.5
        })
    }

    #[test]
    fn a_view_quantizes_as_its_slice_does() {
        let m = matrix(12, 64);
        let form: CacheForm = "int4+secded84".parse().unwrap();
        let from_view = KvStore::quantize_array(form, m.view()).unwrap();
        let from_slice = KvStore::quantize(form, m.as_slice().unwrap(), 12, 64).unwrap();
        let a = from_view.decode().unwrap().values_array(64).unwrap();
        let b = from_slice.decode().unwrap().values;
        assert_eq!(a.shape(), &[12, 64]);
        assert_eq!(a.as_slice().unwrap(), &b[..]);
    }

    #[test]
    fn a_transposed_view_is_read_in_its_logical_order() {
        let m = matrix(64, 12); // channels × tokens in memory
        let t = m.t(); // a 12 × 64 view, column-major
        let form: CacheForm = "int8".parse().unwrap();
        let from_view = KvStore::quantize_array(form, t).unwrap();
        let owned: Vec<f32> = t.iter().copied().collect();
        let from_slice = KvStore::quantize(form, &owned, 12, 64).unwrap();
        assert_eq!(
            from_view.decode().unwrap().values,
            from_slice.decode().unwrap().values
        );
    }

    #[test]
    fn bad_views_get_the_slice_path_errors() {
        let mut m = matrix(4, 64);
        m[[2, 5]] = f32::NAN;
        let form: CacheForm = "int4".parse().unwrap();
        assert!(KvStore::quantize_array(form, m.view()).is_err());
        let empty = Array2::<f32>::zeros((3, 0));
        assert!(KvStore::quantize_array(form, empty.view()).is_err());
        let store = KvStore::quantize_array("int4".parse().unwrap(), matrix(3, 64).view()).unwrap();
        let mut decoded = store.decode().unwrap();
        decoded.values.push(0.0);
        assert!(decoded.values_array(64).is_err());
    }
}
