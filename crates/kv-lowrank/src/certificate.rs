//! Runtime error certificates of attention on low-rank keys and values
//! (section 3.5 of the low-rank subspace paper), from stored residual norms.
//!
//! With `k̂ᵢ`, `v̂ᵢ` the stored (reconstructed) keys and values:
//!
//! - **logits**: `|q·kᵢ − q·k̂ᵢ|/√d ≤ ‖q‖·‖kᵢ − k̂ᵢ‖/√d`, so
//!   `δ = ‖ℓ − ℓ̂‖∞ ≤ ‖q‖·maxᵢ‖kᵢ − k̂ᵢ‖/√d` over the visible keys;
//! - **softmax**: `‖α − α̂‖₁ ≤ 2·sinh(δ/2)` (the paper's bound; the tight
//!   two-point value is `2·tanh(δ/2)`, which it dominates);
//! - **output**: `‖o − ô‖ ≤ ‖α − α̂‖₁·maxᵢ‖vᵢ‖ + maxᵢ‖vᵢ − v̂ᵢ‖`: the
//!   paper's bound with `‖α̂‖₁ = 1` and the largest residual row norm in
//!   place of `‖ΔV‖_op` (it is never larger, and it is what the store keeps).
//!
//! The residual norms are computed at write time against the quantized
//! coefficients and rounded up, so the certificates also cover coefficient
//! quantization; the tests check that measured errors never exceed them.

/// The certificates of one query head.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Certificate {
    /// Bound on the largest change of a scaled logit.
    pub logit: f32,
    /// Bound on the L1 change of the attention weights.
    pub softmax_l1: f32,
    /// Bound on the Euclidean change of the head's output.
    pub output: f32,
}

impl Certificate {
    /// The certificates for a query of norm `q_norm` (unscaled), scores
    /// scaled by `scale` (1/√d), keys whose residuals are at most
    /// `key_residual`, values of norm at most `value_norm` and residual at
    /// most `value_residual` (0 where a part is stored exactly).
    pub fn new(
        q_norm: f32,
        scale: f32,
        key_residual: f32,
        value_norm: f32,
        value_residual: f32,
    ) -> Self {
        let logit = q_norm * key_residual * scale;
        let softmax_l1 = softmax_l1_bound(logit);
        Self {
            logit,
            softmax_l1,
            output: softmax_l1 * value_norm + value_residual,
        }
    }
}

/// The paper's bound `2·sinh(δ/2)` on `‖softmax(ℓ) − softmax(ℓ̂)‖₁` when
/// `‖ℓ − ℓ̂‖∞ ≤ δ`.
pub fn softmax_l1_bound(delta: f32) -> f32 {
    2.0 * (delta / 2.0).sinh()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn softmax(x: &[f64]) -> Vec<f64> {
        let m = x.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let e: Vec<f64> = x.iter().map(|v| (v - m).exp()).collect();
        let z: f64 = e.iter().sum();
        e.into_iter().map(|v| v / z).collect()
    }

    proptest! {
        /// Any perturbation of the logits within δ moves the weights by at
        /// most 2·tanh(δ/2) ≤ 2·sinh(δ/2) in L1.
        #[test]
        fn softmax_bound_holds(
            logits in proptest::collection::vec(-10.0f64..10.0, 1..20),
            signs in proptest::collection::vec(-1.0f64..1.0, 20),
            delta in 0.0f64..4.0,
        ) {
            let moved: Vec<f64> = logits.iter().zip(&signs).map(|(l, s)| l + s * delta).collect();
            let (a, b) = (softmax(&logits), softmax(&moved));
            let l1: f64 = a.iter().zip(&b).map(|(p, q)| (p - q).abs()).sum();
            prop_assert!(l1 <= 2.0 * (delta / 2.0).tanh() + 1e-12);
            prop_assert!(l1 <= f64::from(softmax_l1_bound(delta as f32)) + 1e-6);
        }
    }

    #[test]
    fn the_two_point_case_is_tight_for_tanh() {
        // Logits (−δ/2·…): two classes at the worst offset reach 2·tanh(δ/2).
        let delta = 1.5f64;
        let (a, b) = (
            softmax(&[delta / 2.0, -delta / 2.0]),
            softmax(&[-delta / 2.0, delta / 2.0]),
        );
        let l1: f64 = a.iter().zip(&b).map(|(p, q)| (p - q).abs()).sum();
        assert!((l1 - 2.0 * (delta / 2.0).tanh()).abs() < 1e-12, "{l1}");
        let c = Certificate::new(2.0, 0.125, 4.0, 3.0, 0.5);
        assert_eq!(c.logit, 1.0);
        assert!((c.output - (softmax_l1_bound(1.0) * 3.0 + 0.5)).abs() < 1e-6);
    }
}
