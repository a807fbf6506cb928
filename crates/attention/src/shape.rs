//! [`HeadShape`] (query heads, KV heads, head dimension, with the GQA/MQA
//! grouping) and [`Mask`] (which keys each query sees).

use std::ops::Range;

use crate::error::{AttentionError, Result};

/// Head layout of one attention layer: `q_heads` query heads read
/// `kv_heads` KV heads, query head `h` reading KV head `h / (q_heads / kv_heads)`
/// (multi-head when equal, MQA when `kv_heads == 1`, GQA between).
///
/// Queries are `q_heads × head_dim` f32 per query token; a K or V cache row
/// (one token) is `kv_heads × head_dim` channels, head after head.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct HeadShape {
    q_heads: usize,
    kv_heads: usize,
    head_dim: usize,
}

impl HeadShape {
    /// Validates and builds a shape.
    pub fn new(q_heads: usize, kv_heads: usize, head_dim: usize) -> Result<Self> {
        if q_heads == 0 || kv_heads == 0 || !q_heads.is_multiple_of(kv_heads) {
            return Err(AttentionError::HeadGrouping { q_heads, kv_heads });
        }
        if head_dim == 0 {
            return Err(AttentionError::InvalidParameter {
                name: "head_dim",
                reason: "must be positive".into(),
            });
        }
        Ok(Self {
            q_heads,
            kv_heads,
            head_dim,
        })
    }

    /// Query heads.
    pub fn q_heads(&self) -> usize {
        self.q_heads
    }

    /// KV heads.
    pub fn kv_heads(&self) -> usize {
        self.kv_heads
    }

    /// Channels per head.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// Query heads per KV head.
    pub fn group(&self) -> usize {
        self.q_heads / self.kv_heads
    }

    /// The KV head that query head `h` reads.
    pub fn kv_head_of(&self, h: usize) -> usize {
        h / self.group()
    }

    /// Channels of one K or V cache row: `kv_heads × head_dim`.
    pub fn kv_channels(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    /// f32 values of one query token: `q_heads × head_dim`.
    pub fn q_len(&self) -> usize {
        self.q_heads * self.head_dim
    }

    /// The softmax scale `1/√head_dim`.
    pub fn scale(&self) -> f64 {
        1.0 / (self.head_dim as f64).sqrt()
    }
}

/// Which cached keys each query sees. Cache row `t` holds the token at
/// position `t`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mask<'a> {
    /// A query at position `p` sees keys `0..=p`.
    Causal,
    /// A query at position `p` sees the last `w` keys up to itself:
    /// `p+1-w..=p` (clipped at 0). `w` must be positive.
    SlidingWindow(usize),
    /// Query `i` sees exactly the keys in `ranges[i]`; positions are not used.
    /// An empty range masks every key of that query: its output is zero and
    /// its log-sum-exp is `-inf`.
    Ranges(&'a [Range<usize>]),
}

impl Mask<'_> {
    /// The keys that query `query` (at `position`) sees in a cache of `tokens`.
    pub fn visible(&self, query: usize, position: usize, tokens: usize) -> Result<Range<usize>> {
        let past = |what, position| AttentionError::PastCache {
            query,
            what,
            position,
            tokens,
        };
        match *self {
            Mask::Causal | Mask::SlidingWindow(_) if position >= tokens => {
                Err(past("position", position))
            }
            Mask::Causal => Ok(0..position + 1),
            Mask::SlidingWindow(0) => Err(AttentionError::InvalidParameter {
                name: "sliding window",
                reason: "must see at least one key".into(),
            }),
            Mask::SlidingWindow(w) => Ok((position + 1).saturating_sub(w)..position + 1),
            Mask::Ranges(ranges) => {
                let r = ranges.get(query).ok_or(AttentionError::ShapeMismatch {
                    what: "mask ranges",
                    expected: query + 1,
                    got: ranges.len(),
                })?;
                if r.end > tokens {
                    Err(past("key range end", r.end))
                } else {
                    Ok(r.start.min(r.end)..r.end)
                }
            }
        }
    }

    /// Checks the mask against `queries` and returns every visible range.
    pub(crate) fn ranges(&self, positions: &[usize], tokens: usize) -> Result<Vec<Range<usize>>> {
        let mut out = Vec::with_capacity(positions.len());
        self.ranges_into(positions, tokens, &mut out)?;
        Ok(out)
    }

    /// Checks the mask against `queries` and writes every visible range to
    /// `out` (replacing what it held).
    pub(crate) fn ranges_into(
        &self,
        positions: &[usize],
        tokens: usize,
        out: &mut Vec<Range<usize>>,
    ) -> Result<()> {
        if let Mask::Ranges(r) = self
            && r.len() != positions.len()
        {
            return Err(AttentionError::ShapeMismatch {
                what: "mask ranges (one per query)",
                expected: positions.len(),
                got: r.len(),
            });
        }
        out.clear();
        for (i, &p) in positions.iter().enumerate() {
            out.push(self.visible(i, p, tokens)?);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grouping_maps_query_heads_to_kv_heads() {
        let s = HeadShape::new(9, 3, 64).unwrap();
        assert_eq!(s.group(), 3);
        let kv: Vec<usize> = (0..9).map(|h| s.kv_head_of(h)).collect();
        assert_eq!(kv, [0, 0, 0, 1, 1, 1, 2, 2, 2]);
        let mqa = HeadShape::new(4, 1, 8).unwrap();
        assert!((0..4).all(|h| mqa.kv_head_of(h) == 0));
        assert_eq!(s.kv_channels(), 192);
        assert_eq!(s.scale(), 0.125);
    }

    #[test]
    fn bad_shapes_are_typed_errors() {
        for (q, kv) in [(9, 2), (0, 1), (4, 0), (3, 6)] {
            assert_eq!(
                HeadShape::new(q, kv, 64),
                Err(AttentionError::HeadGrouping {
                    q_heads: q,
                    kv_heads: kv
                })
            );
        }
        assert!(matches!(
            HeadShape::new(4, 2, 0),
            Err(AttentionError::InvalidParameter { .. })
        ));
    }

    #[test]
    fn masks_give_the_documented_ranges() {
        assert_eq!(Mask::Causal.visible(0, 5, 10), Ok(0..6));
        assert_eq!(Mask::SlidingWindow(3).visible(0, 5, 10), Ok(3..6));
        assert_eq!(Mask::SlidingWindow(30).visible(0, 5, 10), Ok(0..6));
        let r = [2..4, 7..7];
        assert_eq!(Mask::Ranges(&r).visible(1, 0, 10), Ok(7..7));
        assert!(matches!(
            Mask::Causal.visible(2, 10, 10),
            Err(AttentionError::PastCache {
                query: 2,
                position: 10,
                ..
            })
        ));
        assert!(matches!(
            Mask::Ranges(std::slice::from_ref(&(0..11))).visible(0, 0, 10),
            Err(AttentionError::PastCache { position: 11, .. })
        ));
        assert!(matches!(
            Mask::SlidingWindow(0).visible(0, 1, 10),
            Err(AttentionError::InvalidParameter { .. })
        ));
        assert!(matches!(
            Mask::Ranges(&r).ranges(&[0], 10),
            Err(AttentionError::ShapeMismatch { .. })
        ));
    }
}
