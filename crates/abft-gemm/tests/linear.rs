//! `linear_into` (the model's projections) against an f64 loop, from one
//! row (a decode step) to batches of dozens, accumulating or not.

use abft_gemm::{Matrix, linear_into};
use proptest::prelude::*;

fn case() -> impl Strategy<Value = (usize, usize, usize, Vec<f32>, Vec<f32>, bool)> {
    (1usize..40, 1usize..90, 1usize..150, any::<bool>()).prop_flat_map(|(t, k, n, accumulate)| {
        (
            Just(t),
            Just(k),
            Just(n),
            prop::collection::vec(-4.0f32..4.0, t * k),
            prop::collection::vec(-1.0f32..1.0, n * k),
            Just(accumulate),
        )
    })
}

proptest! {
    #[test]
    fn a_linear_layer_is_an_f64_loop_within_rounding((t, k, n, x, w, accumulate) in case()) {
        let w = Matrix::new(n, k, w).unwrap();
        let start: Vec<f32> = (0..t * n).map(|i| (i % 7) as f32 - 3.0).collect();
        let mut out = start.clone();
        linear_into(&mut out, &x, &w, accumulate).unwrap();
        for r in 0..t {
            for o in 0..n {
                let terms = (0..k).map(|c| f64::from(x[r * k + c]) * f64::from(w.at(o, c)));
                let magnitude: f64 = terms.clone().map(f64::abs).sum();
                let base = if accumulate { f64::from(start[r * n + o]) } else { 0.0 };
                let want = base + terms.sum::<f64>();
                let got = f64::from(out[r * n + o]);
                // f32 sums of k terms: at most k·2⁻²⁴ of the terms' magnitudes.
                let bound = (k as f64 + 2.0) * f64::from(f32::EPSILON) * (magnitude + base.abs());
                prop_assert!((got - want).abs() <= bound, "t {t} row {r} out {o}: {got} vs {want}");
            }
        }
    }

}
