//! The synthetic K/V rows and block orders the benches and timing examples
//! share, so that every figure over "smooth rows" or "shuffled blocks" is
//! measured on the same data.

use rayon::prelude::*;

/// `tokens × channels` smooth, token-correlated values in [-1, 1], like
/// real K/V caches: `sin(0.013·t + 0.37·c + phase)·(0.5 + 0.5·cos(0.11·c))`
/// for token `t` and channel `c` (computed in parallel on the current
/// rayon pool).
pub fn smooth_rows(tokens: usize, channels: usize, phase: f32) -> Vec<f32> {
    (0..tokens * channels)
        .into_par_iter()
        .map(|i| {
            let (t, c) = ((i / channels) as f32, (i % channels) as f32);
            (0.013 * t + 0.37 * c + phase).sin() * (0.5 + 0.5 * (0.11 * c).cos())
        })
        .collect()
}

/// `0..n` in a fixed shuffled order (a Fisher-Yates shuffle driven by a
/// xorshift generator), as a long-running block pool hands blocks out.
pub fn shuffled(n: u32) -> Vec<u32> {
    let mut order: Vec<u32> = (0..n).collect();
    let mut s = 0x2545_F491_4F6C_DD1Du64;
    for i in (1..order.len()).rev() {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        order.swap(i, (s % (i as u64 + 1)) as usize);
    }
    order
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_are_bounded_and_the_order_is_a_permutation() {
        let rows = smooth_rows(7, 5, 0.3);
        assert_eq!(rows.len(), 35);
        assert!(rows.iter().all(|x| x.abs() <= 1.0));
        assert_eq!(
            rows[5 + 2],
            (0.013f32 + 0.74 + 0.3).sin() * (0.5 + 0.5 * 0.22f32.cos())
        );
        let mut order = shuffled(1000);
        assert_ne!(order[..10], (0..10).collect::<Vec<u32>>()[..]);
        order.sort_unstable();
        assert_eq!(order, (0..1000).collect::<Vec<u32>>());
    }
}
