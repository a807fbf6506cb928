//! Low-rank stores: full rank reproduces the input, online chunks follow
//! their rules (length, residual threshold, a subspace change), protected
//! coefficients count and correct injected faults, bytes are what the
//! buffers hold, and bad input gets typed errors.

use std::sync::Arc;

use gf2_codes::channel::{BinarySymmetric, FaultRng};
use kv_lowrank::{Basis, BasisStorage, HeadBases, LowRankError, LowRankStore};
use kv_quant::{CacheForm, FaultTarget, RankRule};

fn gaussian(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = FaultRng::new(seed);
    (0..n)
        .map(|_| {
            let (u1, u2) = (1.0 - rng.next_f64(), rng.next_f64());
            ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
        })
        .collect()
}

/// Rows of `heads` heads, each in the span of the first `k` (or, from
/// token `switch` on, the next `k`) coordinates.
fn spans(tokens: usize, heads: usize, d: usize, k: usize, switch: usize) -> Vec<f32> {
    let g = gaussian(tokens * heads * k, 3);
    let mut rows = vec![0.0; tokens * heads * d];
    for t in 0..tokens {
        for h in 0..heads {
            let off = if t < switch { 0 } else { k };
            for j in 0..k {
                rows[(t * heads + h) * d + off + j] = g[(t * heads + h) * k + j];
            }
        }
    }
    rows
}

fn fitted(rows: &[f32], tokens: usize, heads: usize, d: usize, r: usize) -> HeadBases {
    HeadBases {
        heads: (0..heads)
            .map(|h| {
                let head: Vec<f32> = (0..tokens)
                    .flat_map(|t| rows[(t * heads + h) * d..][..d].to_vec())
                    .collect();
                Arc::new(
                    Basis::fit(&head, tokens, d, RankRule::Fixed(r), BasisStorage::F16)
                        .unwrap()
                        .0,
                )
            })
            .collect(),
    }
}

fn decode(s: &LowRankStore) -> Vec<f32> {
    let mut out = vec![0.0; s.tokens() * s.channels()];
    s.decode_rows_into(0, s.tokens(), &mut out, &mut Default::default())
        .unwrap();
    out
}

fn form(s: &str) -> CacheForm {
    s.parse().unwrap()
}

#[test]
fn full_rank_reproduces_the_input_and_residuals_bound_the_error() {
    let (tokens, heads, d) = (100, 2, 16);
    let rows = gaussian(tokens * heads * d, 1);
    let b = fitted(&rows, tokens, heads, d, d);
    for f in ["pca-r16", "pca-r16-c8"] {
        let s = LowRankStore::build(form(f), &rows, tokens, heads * d, d, Some(&b)).unwrap();
        let back = decode(&s);
        for t in 0..tokens {
            for h in 0..heads {
                let x = &rows[(t * heads + h) * d..][..d];
                let y = &back[(t * heads + h) * d..][..d];
                let err = x
                    .iter()
                    .zip(y)
                    .map(|(a, b)| (a - b).powi(2))
                    .sum::<f32>()
                    .sqrt();
                assert!(err <= s.residual(t, h), "{f}: {err} > {}", s.residual(t, h));
                assert!(
                    s.residual(t, h) < if f == "pca-r16" { 0.02 } else { 0.1 },
                    "{f}: {}",
                    s.residual(t, h)
                );
            }
        }
    }
}

#[test]
fn online_chunks_follow_length_threshold_and_subspace_changes() {
    let (tokens, heads, d) = (300, 2, 16);
    let rows = spans(tokens, heads, d, 4, 150);
    // Length only (a threshold no residual passes).
    let s = LowRankStore::build(form("fd-r4-l64-t2"), &rows, tokens, heads * d, d, None).unwrap();
    let lens: Vec<usize> = s.chunks().iter().map(|c| c.end - c.start).collect();
    assert_eq!(lens, [64, 64, 64, 64, 44]);
    // A tight threshold rolls over where the subspace changes, and the
    // chunks cover every token once, in order.
    let s =
        LowRankStore::build(form("fd-r4-l1000-t0.1"), &rows, tokens, heads * d, d, None).unwrap();
    let starts: Vec<usize> = s.chunks().iter().map(|c| c.start).collect();
    assert!(starts.contains(&150), "{starts:?}");
    assert!(
        starts.iter().all(|&t| t < 5 || (150..160).contains(&t)),
        "{starts:?}"
    );
    for w in s.chunks().windows(2) {
        assert_eq!(w[0].end, w[1].start);
    }
    assert_eq!(s.chunks().last().unwrap().end, tokens);
    // Inside each subspace the rank-4 chunks reconstruct almost exactly.
    assert!(s.max_residual(0, 10..150) < 0.05 && s.max_residual(1, 170..300) < 0.05);
    assert!(s.owns_bases() && s.stored_bytes() > s.basis_bytes());
}

#[test]
fn protected_coefficients_take_faults_like_every_form() {
    let (tokens, heads, d) = (128, 2, 32);
    let rows = gaussian(tokens * heads * d, 5);
    let b = fitted(&rows, tokens, heads, d, 8);
    let clean = LowRankStore::build(
        form("pca-r8-c4+secded84"),
        &rows,
        tokens,
        heads * d,
        d,
        Some(&b),
    )
    .unwrap();
    let mut hit = clean.clone();
    let inj = hit.inject(&BinarySymmetric::new(1e-3).unwrap(), 7, FaultTarget::Values);
    assert_eq!(inj.len(), heads);
    let flips: usize = inj.iter().map(|i| i.total()).sum();
    assert!(flips > 0);
    let mut out = vec![0.0; tokens * heads * d];
    let stats = hit
        .decode_rows_into(0, tokens, &mut out, &mut Default::default())
        .unwrap();
    let v = stats.values;
    assert_eq!(v.words, (tokens * heads * 8) as u64);
    assert_eq!(v.clean + v.corrected + v.detected, v.words);
    assert!(v.corrected > 0);
    // Against the truth every flipped word is corrected, detected or silent.
    for h in 0..heads {
        let truth = hit.coefficients(h).decode().unwrap().stats.values;
        assert_eq!(truth.words, truth.clean + truth.corrected + truth.detected);
        assert!(truth.corrected + truth.detected + truth.miscorrected + truth.silent >= 1);
    }
    // Bytes: one SECDED byte per int4 coefficient, an f16 scale and its two
    // RM(2,5) check bytes per token and head, f16 residuals, f16 chunk norms.
    let expect = heads * (tokens * 8 + tokens * 2 + tokens * 2) + 2 * tokens * heads + 2 * heads;
    assert_eq!(clean.stored_bytes(), expect);
}

#[test]
fn bad_input_gets_typed_errors() {
    let (tokens, heads, d) = (20, 2, 8);
    let rows = gaussian(tokens * heads * d, 9);
    let b = fitted(&rows, tokens, heads, d, 4);
    let build = |f: &str, rows: &[f32], b: Option<&HeadBases>| {
        LowRankStore::build(form(f), rows, tokens, heads * d, d, b)
    };
    assert!(matches!(
        build("pca-r4", &rows, None),
        Err(LowRankError::Bases(_))
    ));
    assert!(matches!(
        build("pca-r5", &rows, Some(&b)),
        Err(LowRankError::Bases(_))
    ));
    assert!(matches!(
        build("pca-r9", &rows, Some(&b)),
        Err(LowRankError::InvalidParameter { name: "rank", .. })
    ));
    assert!(matches!(
        build("fd-r9", &rows, None),
        Err(LowRankError::InvalidParameter { name: "rank", .. })
    ));
    let one = HeadBases {
        heads: b.heads[..1].to_vec(),
    };
    assert!(matches!(
        build("pca-r4", &rows, Some(&one)),
        Err(LowRankError::Bases(_))
    ));
    let mut nan = rows.clone();
    nan[3] = f32::NAN;
    assert!(matches!(
        build("fd-r2", &nan, None),
        Err(LowRankError::NonFinite {
            row: 0,
            channel: 3,
            ..
        })
    ));
    assert!(matches!(
        build("fd-r2", &rows[1..], None),
        Err(LowRankError::ShapeMismatch { .. })
    ));
    assert!(LowRankStore::build(form("fd-r2"), &rows, tokens, heads * d, 6, None).is_err());
    assert!(LowRankStore::build(form("int4"), &rows, tokens, heads * d, d, None).is_err());
    let s = build("fd-r2", &rows, None).unwrap();
    assert!(
        s.decode_rows_into(19, 2, &mut [0.0; 2 * 16], &mut Default::default())
            .is_err()
    );
}
