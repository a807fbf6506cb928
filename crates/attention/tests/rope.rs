//! RoPE: exact undo, relative-position scores, the per-pair Δ identity of
//! section 9 of `shard-kv-compression-blog.md`, and the relation between
//! the two pair layouts.

mod common;

use attention::{Rope, RopeLayout};
use common::uniform;
use proptest::prelude::*;

fn layout() -> impl Strategy<Value = RopeLayout> {
    prop_oneof![Just(RopeLayout::Adjacent), Just(RopeLayout::RotateHalf)]
}

fn dot(a: &[f32], b: &[f32]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(&x, &y)| f64::from(x) * f64::from(y))
        .sum()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn undo_inverts_apply(
        layout in layout(),
        half in 1usize..65,
        extra in 0usize..4,
        heads in 1usize..4,
        base in prop_oneof![Just(10_000.0f64), Just(500_000.0), 2.0f64..1e6],
        position in prop_oneof![0usize..10, 0usize..1_000_000],
        seed in any::<u64>(),
    ) {
        let d = 2 * half + extra;
        let rope = Rope::new(layout, d, 2 * half, base).unwrap();
        let x = uniform(seed, heads * d, 3.0);
        let mut y = x.clone();
        rope.apply(&mut y, position).unwrap();
        rope.undo(&mut y, position).unwrap();
        let norm = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        for (a, b) in x.iter().zip(&y) {
            prop_assert!(approx::abs_diff_eq!(a, b, epsilon = 1e-6 * norm.max(1.0)), "{a} vs {b}");
        }
        // A rotation keeps each head's norm.
        rope.apply(&mut y, position).unwrap();
        for (hx, hy) in x.chunks(d).zip(y.chunks(d)) {
            prop_assert!(approx::abs_diff_eq!(dot(hx, hx), dot(hy, hy), epsilon = 1e-5 * dot(hx, hx).max(1.0)));
        }
    }

    #[test]
    fn scores_depend_only_on_the_offset(
        layout in layout(),
        half in 1usize..65,
        p in 0usize..5000,
        s in 0usize..5000,
        shift in 0usize..100_000,
        seed in any::<u64>(),
    ) {
        let d = 2 * half;
        let rope = Rope::new(layout, d, d, 10_000.0).unwrap();
        let (q, k) = (uniform(seed, d, 1.0), uniform(seed ^ 9, d, 1.0));
        let score = |p: usize, s: usize| {
            let (mut qr, mut kr) = (q.clone(), k.clone());
            rope.apply(&mut qr, p).unwrap();
            rope.apply(&mut kr, s).unwrap();
            dot(&qr, &kr)
        };
        let a = score(p, s);
        let b = score(p + shift, s + shift);
        prop_assert!(approx::abs_diff_eq!(a, b, epsilon = 1e-5 * d as f64), "{a} vs {b}");
        // The per-pair identity with Δ = s − p on the unrotated halves.
        let delta = s as f64 - p as f64;
        let identity: f64 = (0..half)
            .map(|i| {
                let (x, y) = rope.pair(i);
                let (a, b, c, e) = (f64::from(q[x]), f64::from(q[y]), f64::from(k[x]), f64::from(k[y]));
                let (sin, cos) = (rope.inv_freq()[i] * delta).sin_cos();
                (a * c + b * e) * cos + (b * c - a * e) * sin
            })
            .sum();
        prop_assert!(
            approx::abs_diff_eq!(a, identity, epsilon = 1e-5 * d as f64),
            "{a} vs identity {identity}"
        );
    }

    #[test]
    fn the_layouts_are_a_channel_permutation_of_each_other(
        half in 1usize..33,
        position in 0usize..100_000,
        seed in any::<u64>(),
    ) {
        // Adjacent pair i = (2i, 2i+1); rotate-half pair i = (i, i + d/2).
        let d = 2 * half;
        let adjacent = Rope::new(RopeLayout::Adjacent, d, d, 10_000.0).unwrap();
        let rotate_half = Rope::new(RopeLayout::RotateHalf, d, d, 10_000.0).unwrap();
        let x = uniform(seed, d, 1.0);
        let permute = |x: &[f32]| -> Vec<f32> {
            let mut y = vec![0.0; d];
            for i in 0..half {
                y[i] = x[2 * i];
                y[i + half] = x[2 * i + 1];
            }
            y
        };
        let mut a = x.clone();
        adjacent.apply(&mut a, position).unwrap();
        let mut h = permute(&x);
        rotate_half.apply(&mut h, position).unwrap();
        prop_assert_eq!(permute(&a), h);
    }
}
