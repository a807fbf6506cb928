//! Blockwise online-softmax attention (decode and prefill) against the f64
//! oracle: random shapes and tilings (proptest), very long contexts, large
//! score magnitudes, fully masked rows, and independence from the thread
//! count. Tolerance: 1e-5 of the largest |value| on the output, 1e-5
//! relative on the log-sum-exp. A prefill of at most 16 queries gives each
//! query the bits decode gives it alone, at any split of the keys.

mod common;

use attention::{Attention, AttentionConfig, DenseKv, HeadShape, Mask};
use common::{error_against, oracle, uniform};
use proptest::prelude::*;

const TOL: f64 = 1e-5;

fn config(tile: usize, split_tiles: usize) -> AttentionConfig {
    AttentionConfig {
        tile_tokens: tile,
        split_tokens: tile * split_tiles,
        ..AttentionConfig::default()
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    #[test]
    fn decode_matches_the_oracle(
        (kv_heads, group, d) in (1usize..4, 1usize..5, 1usize..80),
        tokens in 1usize..700,
        tile in 1usize..100,
        split_tiles in 1usize..5,
        amp in prop_oneof![Just(0.1f32), Just(1.0), Just(4.0)],
        pos_frac in 0.0f64..1.0,
        window in prop_oneof![Just(None), (1usize..200).prop_map(Some)],
        seed in any::<u64>(),
    ) {
        let shape = HeadShape::new(kv_heads * group, kv_heads, d).unwrap();
        let ch = shape.kv_channels();
        let k = uniform(seed, tokens * ch, amp);
        let v = uniform(seed ^ 1, tokens * ch, 1.0);
        let q = uniform(seed ^ 2, shape.q_len(), amp);
        let position = ((tokens - 1) as f64 * pos_frac) as usize;
        let mask = window.map_or(Mask::Causal, Mask::SlidingWindow);
        let attn = Attention::with_config(shape, config(tile, split_tiles)).unwrap();
        let got = attn
            .decode(&q, position, &DenseKv::new(&k, tokens, ch).unwrap(), &DenseKv::new(&v, tokens, ch).unwrap(), &mask)
            .unwrap();
        let want = oracle(&q, &[position], &k, &v, tokens, &shape, &mask);
        let (out, lse) = error_against(&got, &want, &v);
        prop_assert!(out < TOL && lse < TOL, "output error {out}, lse error {lse}");
    }

    #[test]
    fn prefill_matches_the_oracle(
        (kv_heads, group, d) in (1usize..3, 1usize..4, 1usize..70),
        tokens in 1usize..300,
        queries in 1usize..40,
        tile in 1usize..80,
        window in prop_oneof![Just(None), (1usize..100).prop_map(Some)],
        seed in any::<u64>(),
    ) {
        let shape = HeadShape::new(kv_heads * group, kv_heads, d).unwrap();
        let ch = shape.kv_channels();
        let k = uniform(seed, tokens * ch, 2.0);
        let v = uniform(seed ^ 1, tokens * ch, 1.0);
        let q = uniform(seed ^ 2, queries * shape.q_len(), 2.0);
        // Positions in any order, repeats allowed.
        let positions: Vec<usize> = uniform(seed ^ 3, queries, 1.0)
            .iter()
            .map(|u| ((u.abs() * tokens as f32) as usize).min(tokens - 1))
            .collect();
        let mask = window.map_or(Mask::Causal, Mask::SlidingWindow);
        let attn = Attention::with_config(shape, config(tile, 2)).unwrap();
        let got = attn
            .prefill(&q, &positions, &DenseKv::new(&k, tokens, ch).unwrap(), &DenseKv::new(&v, tokens, ch).unwrap(), &mask)
            .unwrap();
        let want = oracle(&q, &positions, &k, &v, tokens, &shape, &mask);
        let (out, lse) = error_against(&got, &want, &v);
        prop_assert!(out < TOL && lse < TOL, "output error {out}, lse error {lse}");
    }

    /// A few queries (a speculative verification's rows) over a cache
    /// longer than the key split: each row's output and log-sum-exp are
    /// decode's bits for that query alone.
    #[test]
    fn few_query_prefill_rows_are_decode_bits(
        (kv_heads, group, d) in (1usize..3, 1usize..4, 1usize..70),
        tokens in 1usize..400,
        queries in 1usize..17,
        tile in 1usize..40,
        split_tiles in 1usize..4,
        window in prop_oneof![Just(None), (1usize..100).prop_map(Some)],
        threads in 1usize..17,
        seed in any::<u64>(),
    ) {
        let shape = HeadShape::new(kv_heads * group, kv_heads, d).unwrap();
        let ch = shape.kv_channels();
        let k = uniform(seed, tokens * ch, 2.0);
        let v = uniform(seed ^ 1, tokens * ch, 1.0);
        let q = uniform(seed ^ 2, queries * shape.q_len(), 2.0);
        // The last `queries` positions, as a verification step holds them.
        let positions: Vec<usize> =
            (0..queries).map(|i| tokens.saturating_sub(queries) + i).map(|p| p.min(tokens - 1)).collect();
        let mask = window.map_or(Mask::Causal, Mask::SlidingWindow);
        let attn = Attention::with_config(shape, config(tile, split_tiles)).unwrap();
        let (kd, vd) = (DenseKv::new(&k, tokens, ch).unwrap(), DenseKv::new(&v, tokens, ch).unwrap());
        // Pools of 1 to 16 threads split the queries into every group count.
        let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
        let got = pool.install(|| attn.prefill(&q, &positions, &kd, &vd, &mask)).unwrap();
        let (ql, qh) = (shape.q_len(), shape.q_heads());
        if window.is_none() {
            // Every tile the last query reads is counted once.
            let last = queries - 1;
            let one = attn.decode(&q[last * ql..][..ql], positions[last], &kd, &vd, &mask).unwrap();
            prop_assert_eq!(got.stats.tiles, one.stats.tiles);
        }
        for (i, &p) in positions.iter().enumerate() {
            let one = attn.decode(&q[i * ql..][..ql], p, &kd, &vd, &mask).unwrap();
            let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            prop_assert_eq!(bits(&got.out[i * ql..][..ql]), bits(&one.out), "row {}", i);
            prop_assert_eq!(bits(&got.lse[i * qh..][..qh]), bits(&one.lse), "row {}", i);
        }
    }

    #[test]
    fn arbitrary_key_ranges_including_empty_ones(
        ranges in prop::collection::vec((0usize..120, 0usize..120), 1..20),
        seed in any::<u64>(),
    ) {
        let (tokens, shape) = (120, HeadShape::new(6, 2, 16).unwrap());
        let ch = shape.kv_channels();
        let ranges: Vec<_> = ranges.iter().map(|&(a, b)| a.min(b)..a.max(b)).collect();
        let positions = vec![0; ranges.len()];
        let k = uniform(seed, tokens * ch, 3.0);
        let v = uniform(seed ^ 1, tokens * ch, 1.0);
        let q = uniform(seed ^ 2, ranges.len() * shape.q_len(), 3.0);
        let mask = Mask::Ranges(&ranges);
        let attn = Attention::with_config(shape, config(16, 2)).unwrap();
        let (kd, vd) = (DenseKv::new(&k, tokens, ch).unwrap(), DenseKv::new(&v, tokens, ch).unwrap());
        let got = attn.prefill(&q, &positions, &kd, &vd, &mask).unwrap();
        let want = oracle(&q, &positions, &k, &v, tokens, &shape, &mask);
        let (out, lse) = error_against(&got, &want, &v);
        prop_assert!(out < TOL && lse < TOL, "output error {out}, lse error {lse}");
        for (i, r) in ranges.iter().enumerate() {
            let o = &got.out[i * shape.q_len()..][..shape.q_len()];
            prop_assert!(o.iter().all(|x| x.is_finite()));
            if r.is_empty() {
                prop_assert!(o.iter().all(|&x| x == 0.0));
                prop_assert!(got.lse[i * 6..][..6].iter().all(|&l| l == f32::NEG_INFINITY));
            }
            // Decode of each query alone agrees too.
            let one = attn.decode(&q[i * shape.q_len()..][..shape.q_len()], 0, &kd, &vd, &Mask::Ranges(std::slice::from_ref(r))).unwrap();
            let (out, _) = error_against(&one, &oracle(&q[i * shape.q_len()..][..shape.q_len()], &[0], &k, &v, tokens, &shape, &Mask::Ranges(std::slice::from_ref(r))), &v);
            prop_assert!(out < TOL);
        }
    }
}

#[test]
fn very_long_context_does_not_overflow_or_drift() {
    // 300K keys, all with the same large score: every weight is e^0 after
    // the max is subtracted, and a naive Σ e^s would overflow f32 (e^200).
    let (tokens, shape) = (300_000, HeadShape::new(2, 1, 4).unwrap());
    let k: Vec<f32> = (0..tokens)
        .flat_map(|_| [100.0f32, 100.0, 0.0, 0.0])
        .collect();
    let v = uniform(7, tokens * 4, 1.0);
    let q = [2.0f32, 2.0, 0.0, 0.0, -1.0, 0.5, 0.25, 0.0];
    let attn = Attention::new(shape);
    let (kd, vd) = (
        DenseKv::new(&k, tokens, 4).unwrap(),
        DenseKv::new(&v, tokens, 4).unwrap(),
    );
    let got = attn
        .decode(&q, tokens - 1, &kd, &vd, &Mask::Causal)
        .unwrap();
    let want = oracle(&q, &[tokens - 1], &k, &v, tokens, &shape, &Mask::Causal);
    let (out, lse) = error_against(&got, &want, &v);
    assert!(
        out < TOL && lse < TOL,
        "output error {out}, lse error {lse}"
    );
    // Head 0's scores are 200: the log-sum-exp is 200 + ln(300000).
    approx::assert_abs_diff_eq!(
        f64::from(got.lse[0]),
        200.0 + (tokens as f64).ln(),
        epsilon = 1e-3
    );
    assert!(got.out.iter().all(|x| x.is_finite()));
}

#[test]
fn large_score_magnitudes_stay_exact() {
    // Integer keys and queries make every f32 dot product exact, with
    // scores spread over ±1e4: the softmax must still match the oracle.
    let (tokens, shape) = (5000, HeadShape::new(4, 2, 8).unwrap());
    let ch = shape.kv_channels();
    let k: Vec<f32> = uniform(3, tokens * ch, 64.0)
        .iter()
        .map(|x| x.round())
        .collect();
    let v = uniform(4, tokens * ch, 1.0);
    let q: Vec<f32> = uniform(5, shape.q_len(), 64.0)
        .iter()
        .map(|x| x.round())
        .collect();
    for config in [config(64, 4), config(7, 3), config(1000, 1)] {
        let attn = Attention::with_config(shape, config).unwrap();
        let got = attn
            .decode(
                &q,
                tokens - 1,
                &DenseKv::new(&k, tokens, ch).unwrap(),
                &DenseKv::new(&v, tokens, ch).unwrap(),
                &Mask::Causal,
            )
            .unwrap();
        let want = oracle(&q, &[tokens - 1], &k, &v, tokens, &shape, &Mask::Causal);
        assert!(
            want.lse.iter().any(|l| *l > 1000.0),
            "scores should be large: {:?}",
            want.lse
        );
        let (out, lse) = error_against(&got, &want, &v);
        assert!(
            out < TOL && lse < TOL,
            "{config:?}: output error {out}, lse error {lse}"
        );
    }
}

#[test]
fn results_do_not_depend_on_the_thread_count() {
    let (tokens, shape) = (10_000, HeadShape::new(8, 2, 32).unwrap());
    let ch = shape.kv_channels();
    let k = uniform(11, tokens * ch, 1.0);
    let v = uniform(12, tokens * ch, 1.0);
    let q = uniform(13, 3 * shape.q_len(), 1.0);
    let (kd, vd) = (
        DenseKv::new(&k, tokens, ch).unwrap(),
        DenseKv::new(&v, tokens, ch).unwrap(),
    );
    let attn = Attention::with_config(shape, config(32, 8)).unwrap();
    let run = |threads: usize| {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        pool.install(|| {
            (
                attn.decode(&q[..shape.q_len()], tokens - 1, &kd, &vd, &Mask::Causal)
                    .unwrap(),
                attn.prefill(&q, &[9999, 17, 5000], &kd, &vd, &Mask::Causal)
                    .unwrap(),
            )
        })
    };
    let one = run(1);
    for threads in [2, 3, 7] {
        assert_eq!(run(threads), one, "{threads} threads");
    }
}

#[test]
fn mqa_and_multi_head_extremes() {
    for (q_heads, kv_heads) in [(8, 1), (5, 5), (1, 1)] {
        let (tokens, shape) = (257, HeadShape::new(q_heads, kv_heads, 24).unwrap());
        let ch = shape.kv_channels();
        let k = uniform(1, tokens * ch, 1.0);
        let v = uniform(2, tokens * ch, 1.0);
        let q = uniform(3, shape.q_len(), 1.0);
        let got = Attention::new(shape)
            .decode(
                &q,
                200,
                &DenseKv::new(&k, tokens, ch).unwrap(),
                &DenseKv::new(&v, tokens, ch).unwrap(),
                &Mask::Causal,
            )
            .unwrap();
        let want = oracle(&q, &[200], &k, &v, tokens, &shape, &Mask::Causal);
        let (out, lse) = error_against(&got, &want, &v);
        assert!(out < TOL && lse < TOL, "{q_heads}/{kv_heads}: {out} {lse}");
    }
}
