//! Token eviction at the end of a prefill: SnapKV's selection (Li et al.
//! 2024, "SnapKV: LLM Knows What You are Looking for Before Generation").
//!
//! The prefill's last `window` tokens (the observation window) vote: each
//! of their queries' softmax weights over the prefill's keys is summed per
//! key, over the window's queries and over the query heads that share a
//! key head (GQA), then max-pooled over `pool` neighbouring positions so
//! that a kept token brings its neighbours' context. Each key head keeps
//! the tokens with the largest pooled votes, up to its budget, and every
//! token of the window. With [`SnapKv::with_sinks`] every head also keeps
//! the prefill's first tokens (attention sinks), before any voted one, so
//! that a cache form keeping its first tokens exact (`+sink<S>`) holds the
//! true sinks in those slots. Every key head keeps the same number of tokens, so
//! a layer's kept rows still fill one row per slot (slot `s` of head `h`
//! is head `h`'s `s`-th kept token); different heads may keep different
//! tokens. [`crate::Evicting`] applies the selection to any
//! [`KvBackend`](crate::KvBackend).
//!
//! Votes are taken in f64 from the rows as the model computed them (the
//! f32 keys before any quantisation), at the model's `1/√d` scale; ties
//! keep the earlier token, so a selection is a function of its inputs.

use rayon::prelude::*;

use crate::error::{AttentionError, Result};
use crate::shape::HeadShape;

/// SnapKV's selection parameters (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SnapKv {
    keep: f64,
    window: usize,
    pool: usize,
    sinks: usize,
}

impl Default for SnapKv {
    /// Half the prefill kept, a window of 32 queries, pooling over 7
    /// positions (SnapKV's defaults for window and pool).
    fn default() -> Self {
        Self {
            keep: 0.5,
            window: 32,
            pool: 7,
            sinks: 0,
        }
    }
}

impl SnapKv {
    /// Keeps the share `keep` of a prefill's tokens (in (0, 1]), voted on
    /// by the last `window` queries (at least 1), pooled over `pool`
    /// positions (odd, at least 1; 1 pools nothing).
    pub fn new(keep: f64, window: usize, pool: usize) -> Result<Self> {
        let invalid = |name, reason: String| Err(AttentionError::InvalidParameter { name, reason });
        if !(keep > 0.0 && keep <= 1.0) {
            return invalid("eviction keep", format!("{keep} is not in (0, 1]"));
        }
        if window == 0 {
            return invalid("eviction window", "must hold at least one query".into());
        }
        if pool == 0 || pool.is_multiple_of(2) {
            return invalid("eviction pool", format!("{pool} is not odd and positive"));
        }
        Ok(Self {
            keep,
            window,
            pool,
            sinks: 0,
        })
    }

    /// The same policy keeping, in every key head, the prefill's first
    /// `sinks` tokens before any voted one (as many of them as the budget
    /// leaves beside the window). SnapKV itself keeps none by rule (0, the
    /// default).
    pub fn with_sinks(self, sinks: usize) -> Self {
        Self { sinks, ..self }
    }

    /// The first tokens every key head keeps (see
    /// [`with_sinks`](Self::with_sinks)).
    pub fn sinks(&self) -> usize {
        self.sinks
    }

    /// The share of a prefill's tokens kept.
    pub fn keep(&self) -> f64 {
        self.keep
    }

    /// The observation window's queries.
    pub fn window(&self) -> usize {
        self.window
    }

    /// The pooling width.
    pub fn pool(&self) -> usize {
        self.pool
    }

    /// Tokens each key head keeps of a prefill of `prefill` tokens: the
    /// share [`keep`](Self::keep), rounded up, and at least the
    /// observation window (all of a prefill shorter than it).
    pub fn budget(&self, prefill: usize) -> usize {
        let share = (self.keep * prefill as f64).ceil() as usize;
        share.max(self.window).min(prefill)
    }

    /// The tokens each key head keeps of a prefill of `keys.len() /
    /// kv_channels` tokens, ascending: head `g`'s in `out[g]`, each
    /// [`budget`](Self::budget) long. `queries` holds the observation
    /// window's query rows (`q_len` each) at `positions`, which must be the
    /// prefill's last `min(window, prefill)` positions in order (each query
    /// sees the keys up to its own position).
    pub fn select(
        &self,
        shape: &HeadShape,
        queries: &[f32],
        positions: &[usize],
        keys: &[f32],
    ) -> Result<Vec<Vec<u32>>> {
        let (d, kv) = (shape.head_dim(), shape.kv_channels());
        if !keys.len().is_multiple_of(kv) || keys.is_empty() {
            return Err(AttentionError::InvalidParameter {
                name: "eviction keys",
                reason: format!("{} values are not whole rows of {kv}", keys.len()),
            });
        }
        let prefill = keys.len() / kv;
        if prefill > u32::MAX as usize {
            return Err(AttentionError::InvalidParameter {
                name: "eviction keys",
                reason: format!("{prefill} tokens: at most {} are indexed", u32::MAX),
            });
        }
        let window = self.window.min(prefill);
        let expected: Vec<usize> = (prefill - window..prefill).collect();
        if positions != expected.as_slice() {
            return Err(AttentionError::InvalidParameter {
                name: "eviction window",
                reason: format!(
                    "queries at positions {:?}..., expected the prefill's last {window} ({}..{prefill})",
                    positions.first(),
                    prefill - window
                ),
            });
        }
        if queries.len() != window * shape.q_len() {
            return Err(AttentionError::ShapeMismatch {
                what: "eviction window queries",
                expected: window * shape.q_len(),
                got: queries.len(),
            });
        }
        let budget = self.budget(prefill);
        let voted = prefill - window;
        let scale = shape.scale();
        let kept = (0..shape.kv_heads())
            .into_par_iter()
            .map(|g| {
                let mut votes = vec![0.0f64; voted];
                let mut weights = vec![0.0f64; prefill];
                for h in (0..shape.q_heads()).filter(|&h| shape.kv_head_of(h) == g) {
                    for (i, q) in queries.chunks_exact(shape.q_len()).enumerate() {
                        let q = &q[h * d..(h + 1) * d];
                        let seen = positions[i] + 1;
                        for (t, w) in weights[..seen].iter_mut().enumerate() {
                            let k = &keys[t * kv + g * d..t * kv + (g + 1) * d];
                            *w = scale
                                * q.iter()
                                    .zip(k)
                                    .map(|(&a, &b)| f64::from(a) * f64::from(b))
                                    .sum::<f64>();
                        }
                        let peak = weights[..seen].iter().copied().fold(f64::MIN, f64::max);
                        let mass: f64 = weights[..seen].iter().map(|w| (w - peak).exp()).sum();
                        for (v, w) in votes.iter_mut().zip(&weights) {
                            *v += (w - peak).exp() / mass;
                        }
                    }
                }
                let mut score = pooled(&votes, self.pool);
                // Sinks first: above every vote, the earlier first.
                for s in score.iter_mut().take(self.sinks) {
                    *s = f64::INFINITY;
                }
                chosen(&score, budget - window, voted, prefill)
            })
            .collect();
        Ok(kept)
    }
}

/// `votes` max-pooled over `pool` positions centred on each (clipped at
/// the ends).
fn pooled(votes: &[f64], pool: usize) -> Vec<f64> {
    let r = pool / 2;
    (0..votes.len())
        .map(|t| {
            let span = t.saturating_sub(r)..(t + r + 1).min(votes.len());
            votes[span].iter().copied().fold(f64::MIN, f64::max)
        })
        .collect()
}

/// The `n` tokens of largest `score` (ties: the earlier) and the window
/// `voted..prefill`, ascending.
fn chosen(score: &[f64], n: usize, voted: usize, prefill: usize) -> Vec<u32> {
    let mut order: Vec<u32> = (0..voted as u32).collect();
    order.sort_by(|&a, &b| {
        score[b as usize]
            .total_cmp(&score[a as usize])
            .then(a.cmp(&b))
    });
    order.truncate(n);
    order.sort_unstable();
    order.extend(voted as u32..prefill as u32);
    order
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parameters_outside_their_domains_are_refused() {
        for (keep, window, pool, what) in [
            (0.0, 32, 7, "keep"),
            (1.5, 32, 7, "keep"),
            (f64::NAN, 32, 7, "keep"),
            (0.5, 0, 7, "window"),
            (0.5, 32, 0, "pool"),
            (0.5, 32, 4, "pool"),
        ] {
            let e = SnapKv::new(keep, window, pool).unwrap_err().to_string();
            assert!(e.contains(what), "{keep} {window} {pool}: {e}");
        }
        assert!(SnapKv::new(1.0, 1, 1).is_ok());
    }

    #[test]
    fn budgets_round_up_and_hold_the_window() {
        let p = SnapKv::new(0.25, 8, 3).unwrap();
        assert_eq!(p.budget(100), 25);
        assert_eq!(p.budget(101), 26);
        assert_eq!(p.budget(20), 8); // the window
        assert_eq!(p.budget(5), 5); // all of a short prefill
    }

    /// A brute-force SnapKV: every (head, query, key) weight from the
    /// softmax definition, the votes pooled by the definition, the kept
    /// set by full sort.
    fn reference(p: &SnapKv, shape: &HeadShape, q: &[f32], k: &[f32]) -> Vec<Vec<u32>> {
        let (d, kv) = (shape.head_dim(), shape.kv_channels());
        let prefill = k.len() / kv;
        let w = p.window.min(prefill);
        (0..shape.kv_heads())
            .map(|g| {
                let mut votes = vec![0.0; prefill - w];
                for h in 0..shape.q_heads() {
                    if h / shape.group() != g {
                        continue;
                    }
                    for i in 0..w {
                        let pos = prefill - w + i;
                        let s: Vec<f64> = (0..=pos)
                            .map(|t| {
                                (0..d)
                                    .map(|c| {
                                        f64::from(q[i * shape.q_len() + h * d + c])
                                            * f64::from(k[t * kv + g * d + c])
                                    })
                                    .sum::<f64>()
                                    / (d as f64).sqrt()
                            })
                            .collect();
                        let z: f64 = s.iter().map(|x| x.exp()).sum();
                        for (t, v) in votes.iter_mut().enumerate() {
                            *v += s[t].exp() / z;
                        }
                    }
                }
                let r = p.pool / 2;
                let pooled: Vec<f64> = (0..votes.len())
                    .map(|t| {
                        let vote = (t.saturating_sub(r)..=(t + r).min(votes.len() - 1))
                            .map(|u| votes[u])
                            .fold(f64::MIN, f64::max);
                        if t < p.sinks { f64::INFINITY } else { vote }
                    })
                    .collect();
                let mut idx: Vec<usize> = (0..votes.len()).collect();
                idx.sort_by(|&a, &b| pooled[b].partial_cmp(&pooled[a]).unwrap().then(a.cmp(&b)));
                let mut kept: Vec<u32> = idx[..p.budget(prefill) - w]
                    .iter()
                    .map(|&t| t as u32)
                    .collect();
                kept.sort();
                kept.extend((prefill - w) as u32..prefill as u32);
                kept
            })
            .collect()
    }

    fn rows(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| {
                let x = (i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed);
                (x >> 8) as f32 / (1u32 << 24) as f32 * 4.0 - 2.0
            })
            .collect()
    }

    #[test]
    fn selection_matches_the_definition() {
        for (q_heads, kv_heads, d, prefill, keep, window, pool, sinks) in [
            (4, 2, 8, 50, 0.3, 6, 3, 0),
            (3, 3, 4, 40, 0.5, 5, 1, 0),
            (6, 2, 8, 64, 0.1, 4, 7, 0),
            (2, 1, 4, 9, 0.5, 32, 3, 0),
            (4, 2, 8, 50, 0.3, 6, 3, 4),
            (6, 2, 8, 64, 0.1, 4, 7, 9), // more sinks than the budget's votes
        ] {
            let shape = HeadShape::new(q_heads, kv_heads, d).unwrap();
            let p = SnapKv::new(keep, window, pool).unwrap().with_sinks(sinks);
            let w = window.min(prefill);
            let q = rows(w * shape.q_len(), 7);
            let k = rows(prefill * shape.kv_channels(), 11);
            let positions: Vec<usize> = (prefill - w..prefill).collect();
            let got = p.select(&shape, &q, &positions, &k).unwrap();
            assert_eq!(
                got,
                reference(&p, &shape, &q, &k),
                "{q_heads}/{kv_heads}/{d}"
            );
            for kept in &got {
                assert_eq!(kept.len(), p.budget(prefill));
                assert!(kept.windows(2).all(|w| w[0] < w[1]));
                let voted = p.budget(prefill) - w;
                let first: Vec<u32> = (0..sinks.min(voted) as u32).collect();
                assert_eq!(kept[..first.len()], first, "the sinks first");
            }
        }
    }

    #[test]
    fn a_key_the_window_attends_to_is_kept_with_its_neighbours() {
        let shape = HeadShape::new(1, 1, 4).unwrap();
        let prefill = 40;
        let mut k = vec![0.0f32; prefill * 4];
        k[17 * 4] = 8.0; // token 17 aligns with the queries
        let q = [1.0f32, 0.0, 0.0, 0.0].repeat(4);
        let positions: Vec<usize> = (36..40).collect();
        let kept = SnapKv::new(0.2, 4, 3)
            .unwrap()
            .select(&shape, &q, &positions, &k)
            .unwrap();
        // Budget 8: the window (4) and 4 voted, 16..=18 pooled to the peak
        // first, then the earliest of the ties.
        assert_eq!(kept, vec![vec![0, 16, 17, 18, 36, 37, 38, 39]]);
        // Two sinks take two of the voted places: the peak and one neighbour
        // stay.
        let kept = SnapKv::new(0.2, 4, 3)
            .unwrap()
            .with_sinks(2)
            .select(&shape, &q, &positions, &k)
            .unwrap();
        assert_eq!(kept, vec![vec![0, 1, 16, 17, 36, 37, 38, 39]]);
    }

    #[test]
    fn mismatched_inputs_are_refused() {
        let shape = HeadShape::new(2, 1, 4).unwrap();
        let p = SnapKv::new(0.5, 2, 1).unwrap();
        let k = rows(10 * 4, 1);
        let q = rows(2 * 8, 2);
        assert!(p.select(&shape, &q, &[7, 8], &k).is_err()); // not the last two
        assert!(p.select(&shape, &q[..8], &[8, 9], &k).is_err()); // one query short
        assert!(p.select(&shape, &q, &[8, 9], &k[..39]).is_err()); // a partial row
        assert!(p.select(&shape, &q, &[8, 9], &[]).is_err());
        assert!(p.select(&shape, &q, &[8, 9], &k).is_ok());
    }
}
