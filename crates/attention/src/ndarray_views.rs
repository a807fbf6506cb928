//! `ndarray` entry points (feature `ndarray`): callers holding K, V and Q as
//! array views attend without copying them into `Vec`s.
//!
//! [`DenseKv::from_array`] borrows a `tokens × channels` view as a KV
//! source; it must be in standard (row-major, contiguous) layout, since the
//! kernel reads rows in place (a transposed view is refused: call
//! `.as_standard_layout()` on it first, which copies once).
//! [`Attention::decode_array`] and [`Attention::prefill_array`] take queries
//! as `q_heads × head_dim` and `queries × q_heads × head_dim` views and
//! return the outputs and log-sum-exps as arrays.

use ndarray::{Array1, Array2, Array3, ArrayView2, ArrayView3};

use crate::attend::Attention;
use crate::error::{AttentionError, Result, check_len};
use crate::shape::Mask;
use crate::source::{DenseKv, KvSource};

/// The contiguous row-major data of a view, or why there is none.
fn row_major<'a>(
    what: &'static str,
    data: &ndarray::ArrayView<'a, f32, impl ndarray::Dimension>,
) -> Result<&'a [f32]> {
    data.to_slice()
        .ok_or_else(|| AttentionError::InvalidParameter {
            name: what,
            reason: "the view is not in standard (row-major, contiguous) layout; \
                 call .as_standard_layout() on it first"
                .into(),
        })
}

impl<'a> DenseKv<'a> {
    /// Borrows a `tokens × channels` view in standard layout.
    pub fn from_array(data: ArrayView2<'a, f32>) -> Result<Self> {
        let (tokens, channels) = data.dim();
        Self::new(row_major("KV view", &data)?, tokens, channels)
    }
}

impl Attention {
    /// [`Attention::decode`] of one query given as a `q_heads × head_dim`
    /// view: the output (`q_heads × head_dim`) and the log-sum-exp per head.
    pub fn decode_array<K: KvSource, V: KvSource>(
        &self,
        query: ArrayView2<'_, f32>,
        position: usize,
        keys: &K,
        values: &V,
        mask: &Mask<'_>,
    ) -> Result<(Array2<f32>, Array1<f32>)> {
        let shape = *self.shape();
        check_len("query heads", shape.q_heads(), query.dim().0)?;
        check_len("query head_dim", shape.head_dim(), query.dim().1)?;
        let q = row_major("query view", &query)?;
        let out = self.decode(q, position, keys, values, mask)?;
        let dims = (shape.q_heads(), shape.head_dim());
        Ok((
            Array2::from_shape_vec(dims, out.out).expect("decode output is q_heads × head_dim"),
            Array1::from_vec(out.lse),
        ))
    }

    /// [`Attention::prefill`] of `queries × q_heads × head_dim` queries at
    /// `positions`: the outputs (same shape) and the log-sum-exps
    /// (`queries × q_heads`).
    pub fn prefill_array<K: KvSource, V: KvSource>(
        &self,
        queries: ArrayView3<'_, f32>,
        positions: &[usize],
        keys: &K,
        values: &V,
        mask: &Mask<'_>,
    ) -> Result<(Array3<f32>, Array2<f32>)> {
        let shape = *self.shape();
        let (n, heads, dim) = queries.dim();
        check_len("queries", positions.len(), n)?;
        check_len("query heads", shape.q_heads(), heads)?;
        check_len("query head_dim", shape.head_dim(), dim)?;
        let q = row_major("query view", &queries)?;
        let out = self.prefill(q, positions, keys, values, mask)?;
        Ok((
            Array3::from_shape_vec((n, heads, dim), out.out).expect("prefill output shape"),
            Array2::from_shape_vec((n, heads), out.lse).expect("one lse per query and head"),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shape::HeadShape;
    use ndarray::{Array2, Array3};

    fn values(rows: usize, cols: usize, seed: usize) -> Array2<f32> {
        Array2::from_shape_fn((rows, cols), |(r, c)| {
            ((r * 37 + c * 11 + seed * 7) % 29) as f32 / 14.0 - 1.0
        })
    }

    #[test]
    fn views_give_the_slice_results_bit_for_bit() {
        let att = Attention::new(HeadShape::new(4, 2, 16).unwrap());
        let (k, v) = (values(40, 32, 1), values(40, 32, 2));
        let keys = DenseKv::from_array(k.view()).unwrap();
        let vals = DenseKv::from_array(v.view()).unwrap();
        let q = values(4, 16, 3);
        let (out, lse) = att
            .decode_array(q.view(), 39, &keys, &vals, &Mask::Causal)
            .unwrap();
        let sk = DenseKv::new(k.as_slice().unwrap(), 40, 32).unwrap();
        let sv = DenseKv::new(v.as_slice().unwrap(), 40, 32).unwrap();
        let want = att
            .decode(q.as_slice().unwrap(), 39, &sk, &sv, &Mask::Causal)
            .unwrap();
        assert_eq!(out.as_slice().unwrap(), &want.out[..]);
        assert_eq!(lse.as_slice().unwrap(), &want.lse[..]);

        let qs = Array3::from_shape_fn((3, 4, 16), |(i, h, d)| ((i + h * 3 + d) % 7) as f32 - 3.0);
        let positions = [37, 38, 39];
        let (out, lse) = att
            .prefill_array(qs.view(), &positions, &keys, &vals, &Mask::Causal)
            .unwrap();
        let want = att
            .prefill(qs.as_slice().unwrap(), &positions, &sk, &sv, &Mask::Causal)
            .unwrap();
        assert_eq!(out.as_slice().unwrap(), &want.out[..]);
        assert_eq!(lse.shape(), &[3, 4]);
        assert_eq!(lse.as_slice().unwrap(), &want.lse[..]);
    }

    #[test]
    fn non_standard_views_and_wrong_shapes_are_refused() {
        let att = Attention::new(HeadShape::new(4, 2, 16).unwrap());
        let k = values(32, 40, 1);
        assert!(matches!(
            DenseKv::from_array(k.t()),
            Err(AttentionError::InvalidParameter { .. })
        ));
        let kv = values(40, 32, 2);
        let keys = DenseKv::from_array(kv.view()).unwrap();
        let q = values(2, 16, 3);
        assert!(matches!(
            att.decode_array(q.view(), 39, &keys, &keys, &Mask::Causal),
            Err(AttentionError::ShapeMismatch {
                what: "query heads",
                expected: 4,
                got: 2
            })
        ));
        let qs = Array3::<f32>::zeros((2, 4, 16));
        assert!(matches!(
            att.prefill_array(qs.view(), &[39], &keys, &keys, &Mask::Causal),
            Err(AttentionError::ShapeMismatch {
                what: "queries",
                ..
            })
        ));
    }
}
