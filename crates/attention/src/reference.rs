//! The f64 oracle: attention computed the plain way (every score, one
//! softmax, one weighted sum), section 2.1 of `ecc-kv-cache-paper.txt`
//! (equations 2–4) with the causal mask and GQA/MQA head mapping. Every
//! other path in this crate is tested against it.

use crate::error::{Result, check_len};
use crate::shape::{HeadShape, Mask};

/// Output of [`reference_attention`].
#[derive(Clone, Debug, PartialEq)]
pub struct ReferenceOutput {
    /// `queries × q_heads × head_dim`.
    pub out: Vec<f64>,
    /// Log-sum-exp of the scaled scores, `queries × q_heads`; `-inf` where
    /// every key is masked (and the output is zero).
    pub lse: Vec<f64>,
}

/// Attention of `queries.len() / shape.q_len()` query tokens at `positions`
/// over a `tokens`-row cache (`keys`, `values`: `tokens × kv_channels`,
/// row-major), in f64 throughout.
pub fn reference_attention(
    queries: &[f32],
    positions: &[usize],
    keys: &[f32],
    values: &[f32],
    tokens: usize,
    shape: &HeadShape,
    mask: &Mask<'_>,
) -> Result<ReferenceOutput> {
    let d = shape.head_dim();
    let ch = shape.kv_channels();
    check_len(
        "queries (positions × q_heads × head_dim)",
        positions.len() * shape.q_len(),
        queries.len(),
    )?;
    check_len(
        "keys (tokens × kv_heads × head_dim)",
        tokens * ch,
        keys.len(),
    )?;
    check_len(
        "values (tokens × kv_heads × head_dim)",
        tokens * ch,
        values.len(),
    )?;
    let ranges = mask.ranges(positions, tokens)?;
    let scale = shape.scale();
    let mut out = vec![0.0; queries.len()];
    let mut lse = vec![f64::NEG_INFINITY; positions.len() * shape.q_heads()];
    let mut scores = Vec::new();
    for (i, range) in ranges.iter().enumerate() {
        for h in 0..shape.q_heads() {
            let q = &queries[(i * shape.q_heads() + h) * d..][..d];
            let kv = shape.kv_head_of(h) * d;
            scores.clear();
            scores.extend(range.clone().map(|t| {
                let k = &keys[t * ch + kv..][..d];
                q.iter()
                    .zip(k)
                    .map(|(&a, &b)| f64::from(a) * f64::from(b))
                    .sum::<f64>()
                    * scale
            }));
            if scores.is_empty() {
                continue;
            }
            let m = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let o = &mut out[(i * shape.q_heads() + h) * d..][..d];
            let mut z = 0.0;
            for (t, s) in range.clone().zip(&scores) {
                let w = (s - m).exp();
                z += w;
                for (o, &v) in o.iter_mut().zip(&values[t * ch + kv..][..d]) {
                    *o += w * f64::from(v);
                }
            }
            o.iter_mut().for_each(|o| *o /= z);
            lse[i * shape.q_heads() + h] = m + z.ln();
        }
    }
    Ok(ReferenceOutput { out, lse })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_keys_by_hand() {
        // One head of dim 4 (scale 1/2), keys e0 and 2·e0, query 2·e0:
        // scores 1 and 2, weights 1/(1+e) and e/(1+e).
        let shape = HeadShape::new(1, 1, 4).unwrap();
        let q = [2.0, 0.0, 0.0, 0.0];
        let k = [1.0, 0.0, 0.0, 0.0, 2.0, 0.0, 0.0, 0.0];
        let v = [1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0];
        let r = reference_attention(&q, &[1], &k, &v, 2, &shape, &Mask::Causal).unwrap();
        let e = 1f64.exp();
        approx::assert_abs_diff_eq!(r.out[0], 1.0 / (1.0 + e), epsilon = 1e-15);
        approx::assert_abs_diff_eq!(r.out[1], e / (1.0 + e), epsilon = 1e-15);
        approx::assert_abs_diff_eq!(r.lse[0], (1f64.exp() + 2f64.exp()).ln(), epsilon = 1e-14);
        // Causal at position 0 sees only the first key.
        let r0 = reference_attention(&q, &[0], &k, &v, 2, &shape, &Mask::Causal).unwrap();
        assert_eq!(&r0.out, &[1.0, 0.0, 0.0, 0.0]);
    }

    #[test]
    fn gqa_heads_read_their_kv_head_and_masked_rows_are_zero() {
        // 4 query heads over 2 KV heads of dim 1: heads 0,1 read KV head 0.
        let shape = HeadShape::new(4, 2, 1).unwrap();
        let q = [1.0, 1.0, 1.0, 1.0];
        let k = [0.0, 0.0];
        let v = [3.0, 7.0];
        let r = reference_attention(&q, &[0], &k, &v, 1, &shape, &Mask::Causal).unwrap();
        assert_eq!(r.out, [3.0, 3.0, 7.0, 7.0]);
        let empty = std::slice::from_ref(&(0..0));
        let r = reference_attention(&q, &[0], &k, &v, 1, &shape, &Mask::Ranges(empty)).unwrap();
        assert_eq!(r.out, [0.0; 4]);
        assert!(r.lse.iter().all(|l| *l == f64::NEG_INFINITY));
    }
}
