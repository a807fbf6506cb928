//! Bad input gets a typed error: mismatched shapes, positions past the
//! cache, empty caches, non-finite queries and outputs, bad configurations.

use attention::{
    Attention, AttentionConfig, AttentionError, DenseKv, HeadShape, Mask, OnNonFinite,
};
use kv_quant::KvStore;

fn setup() -> (Attention, Vec<f32>, Vec<f32>) {
    let shape = HeadShape::new(4, 2, 8).unwrap();
    (Attention::new(shape), vec![0.5; 10 * 16], vec![0.25; 4 * 8])
}

#[test]
fn shape_mismatches() {
    let (attn, kv, q) = setup();
    let good = DenseKv::new(&kv, 10, 16).unwrap();
    let wide = DenseKv::new(&kv[..10 * 8], 10, 8).unwrap();
    let short = DenseKv::new(&kv[..9 * 16], 9, 16).unwrap();
    let m = Mask::Causal;
    let e = attn.decode(&q, 0, &wide, &good, &m).unwrap_err();
    assert!(
        matches!(
            e,
            AttentionError::ShapeMismatch {
                expected: 16,
                got: 8,
                ..
            }
        ),
        "{e}"
    );
    let e = attn.decode(&q, 0, &good, &wide, &m).unwrap_err();
    assert!(
        matches!(
            e,
            AttentionError::ShapeMismatch {
                expected: 16,
                got: 8,
                ..
            }
        ),
        "{e}"
    );
    let e = attn.decode(&q, 0, &good, &short, &m).unwrap_err();
    assert!(
        matches!(
            e,
            AttentionError::ShapeMismatch {
                expected: 10,
                got: 9,
                ..
            }
        ),
        "{e}"
    );
    let e = attn.decode(&q[..31], 0, &good, &good, &m).unwrap_err();
    assert!(
        matches!(
            e,
            AttentionError::ShapeMismatch {
                expected: 32,
                got: 31,
                ..
            }
        ),
        "{e}"
    );
    let e = attn.prefill(&q, &[0, 1], &good, &good, &m).unwrap_err();
    assert!(
        matches!(
            e,
            AttentionError::ShapeMismatch {
                expected: 64,
                got: 32,
                ..
            }
        ),
        "{e}"
    );
    let e = attn
        .prefill(&q, &[0], &good, &good, &Mask::Ranges(&[0..1, 0..2]))
        .unwrap_err();
    assert!(matches!(e, AttentionError::ShapeMismatch { .. }), "{e}");
    assert!(matches!(
        DenseKv::new(&kv, 11, 16),
        Err(AttentionError::ShapeMismatch { .. })
    ));
    assert!(matches!(
        DenseKv::new(&kv, 10, 0),
        Err(AttentionError::InvalidParameter { .. })
    ));
    assert!(matches!(
        DenseKv::new(&kv, usize::MAX, 2),
        Err(AttentionError::InvalidParameter { .. })
    ));
}

#[test]
fn head_groupings_that_do_not_divide() {
    let e = HeadShape::new(9, 2, 64).unwrap_err();
    assert_eq!(
        e,
        AttentionError::HeadGrouping {
            q_heads: 9,
            kv_heads: 2
        }
    );
    assert!(e.to_string().contains("must divide"));
}

#[test]
fn positions_past_the_cache_and_empty_caches() {
    let (attn, kv, q) = setup();
    let good = DenseKv::new(&kv, 10, 16).unwrap();
    let e = attn
        .decode(&q, 10, &good, &good, &Mask::Causal)
        .unwrap_err();
    assert_eq!(
        e,
        AttentionError::PastCache {
            query: 0,
            what: "position",
            position: 10,
            tokens: 10
        }
    );
    let e = attn
        .prefill(
            &[q.clone(), q.clone()].concat(),
            &[3, 12],
            &good,
            &good,
            &Mask::SlidingWindow(4),
        )
        .unwrap_err();
    assert!(
        matches!(
            e,
            AttentionError::PastCache {
                query: 1,
                position: 12,
                ..
            }
        ),
        "{e}"
    );
    let e = attn
        .decode(
            &q,
            0,
            &good,
            &good,
            &Mask::Ranges(std::slice::from_ref(&(2..11))),
        )
        .unwrap_err();
    assert!(
        matches!(e, AttentionError::PastCache { position: 11, .. }),
        "{e}"
    );
    let empty = DenseKv::new(&[], 0, 16).unwrap();
    assert_eq!(
        attn.decode(&q, 0, &empty, &empty, &Mask::Causal)
            .unwrap_err(),
        AttentionError::EmptyCache
    );
    let store = KvStore::quantize("int4".parse().unwrap(), &[], 0, 16).unwrap();
    assert_eq!(
        attn.decode(&q, 0, &store, &store, &Mask::Causal)
            .unwrap_err(),
        AttentionError::EmptyCache
    );
}

#[test]
fn non_finite_queries_and_outputs() {
    let (attn, clean, mut q) = setup();
    let mut kv = clean.clone();
    q[13] = f32::NAN;
    let good = DenseKv::new(&clean, 10, 16).unwrap();
    let e = attn.decode(&q, 0, &good, &good, &Mask::Causal).unwrap_err();
    assert!(
        matches!(
            e,
            AttentionError::NonFiniteQuery {
                query: 0,
                head: 1,
                channel: 5,
                ..
            }
        ),
        "{e}"
    );
    q[13] = 0.25;
    // A NaN value in channel 0 of KV head 1 poisons that channel of query
    // heads 2 and 3 only.
    kv[3 * 16 + 8] = f32::NAN;
    let poisoned = DenseKv::new(&kv, 10, 16).unwrap();
    let e = attn
        .decode(&q, 9, &good, &poisoned, &Mask::Causal)
        .unwrap_err();
    assert_eq!(
        e,
        AttentionError::NonFiniteOutput {
            count: 2,
            query: 0,
            head: 2
        }
    );
    // Masked out, it does no harm.
    assert!(attn.decode(&q, 2, &good, &poisoned, &Mask::Causal).is_ok());
    let report = Attention::with_config(
        *attn.shape(),
        AttentionConfig {
            on_non_finite: OnNonFinite::Report,
            ..AttentionConfig::default()
        },
    )
    .unwrap();
    let out = report
        .decode(&q, 9, &good, &poisoned, &Mask::Causal)
        .unwrap();
    assert_eq!(out.non_finite, 2);
    assert!(out.out[..16].iter().all(|x| x.is_finite()));
    // An infinite key gives a NaN score (inf − inf), also reported.
    kv[3 * 16 + 8] = f32::INFINITY;
    let inf = DenseKv::new(&kv, 10, 16).unwrap();
    assert!(matches!(
        attn.decode(&q, 9, &inf, &good, &Mask::Causal),
        Err(AttentionError::NonFiniteOutput { .. })
    ));
    // Under Report a NaN query is no error either: its head's outputs are
    // NaN and counted (a fault upstream of attention), the other heads exact.
    q[13] = f32::NAN;
    let out = report.decode(&q, 9, &good, &good, &Mask::Causal).unwrap();
    assert_eq!(out.non_finite, 8);
    assert!(out.out[8..16].iter().all(|x| x.is_nan()));
    let mut q_clean = q.clone();
    q_clean[13] = 0.25;
    let exact = report
        .decode(&q_clean, 9, &good, &good, &Mask::Causal)
        .unwrap();
    assert_eq!(out.out[..8], exact.out[..8]);
    assert_eq!(out.out[16..], exact.out[16..]);
}

#[test]
fn bad_configurations() {
    let shape = HeadShape::new(2, 1, 4).unwrap();
    for (tile, split) in [(0, 64), (64, 0), (64, 100)] {
        let config = AttentionConfig {
            tile_tokens: tile,
            split_tokens: split,
            ..AttentionConfig::default()
        };
        assert!(matches!(
            Attention::with_config(shape, config),
            Err(AttentionError::InvalidParameter { .. })
        ));
    }
    let (attn, kv, q) = setup();
    let good = DenseKv::new(&kv, 10, 16).unwrap();
    assert!(matches!(
        attn.decode(&q, 5, &good, &good, &Mask::SlidingWindow(0)),
        Err(AttentionError::InvalidParameter { .. })
    ));
}
