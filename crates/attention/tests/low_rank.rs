//! Attention over low-rank stores (kv-lowrank): the coefficient-space path
//! and the reconstructing path equal the f64 oracle over the reconstructed
//! keys and values within 1e-5, for calibrated and online (1..J chunks)
//! bases, GQA groups, decode and prefill, keys projected before or after
//! RoPE; and the runtime certificates bound the true errors against the
//! unprojected cache.

mod common;

use std::sync::Arc;

use attention::{Attention, HeadShape, Mask, PreRopeKeys, Rope, RopeLayout, certificates};
use common::{error_against, oracle, uniform};
use kv_lowrank::{Basis, BasisStorage, HeadBases, LowRankStore};
use kv_quant::{CacheForm, RankRule};

/// Rows near a `k`-dimensional subspace per head, with a mean and noise.
fn near_subspace(
    seed: u64,
    tokens: usize,
    heads: usize,
    d: usize,
    k: usize,
    noise: f32,
) -> Vec<f32> {
    let coeffs = uniform(seed, tokens * heads * k, 2.0);
    let dirs = uniform(seed ^ 0x55, heads * k * d, 1.0);
    let noise = uniform(seed ^ 0xAA, tokens * heads * d, noise);
    let mut out = vec![0.0; tokens * heads * d];
    for t in 0..tokens {
        for h in 0..heads {
            for c in 0..d {
                let mut v = 0.3 * (c as f32 * 0.7).sin();
                for j in 0..k {
                    v += coeffs[(t * heads + h) * k + j] * dirs[(h * k + j) * d + c];
                }
                out[(t * heads + h) * d + c] = v + noise[(t * heads + h) * d + c];
            }
        }
    }
    out
}

fn bases(rows: &[f32], tokens: usize, heads: usize, d: usize, r: usize) -> HeadBases {
    let heads = (0..heads)
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
        .collect();
    HeadBases { heads }
}

fn store(
    form: &str,
    rows: &[f32],
    tokens: usize,
    ch: usize,
    d: usize,
    b: Option<&HeadBases>,
) -> LowRankStore {
    let form: CacheForm = form.parse().unwrap();
    LowRankStore::build(form, rows, tokens, ch, d, b).unwrap()
}

fn decoded(s: &LowRankStore) -> Vec<f32> {
    let mut out = vec![0.0; s.tokens() * s.channels()];
    s.decode_rows_into(0, s.tokens(), &mut out, &mut Default::default())
        .unwrap();
    out
}

#[test]
fn coefficient_space_attention_equals_the_oracle_on_the_projections() {
    let tokens = 260;
    for (q_heads, kv_heads, d) in [(4, 2, 32), (6, 3, 16), (3, 1, 64)] {
        let shape = HeadShape::new(q_heads, kv_heads, d).unwrap();
        let ch = shape.kv_channels();
        let k = near_subspace(1, tokens, kv_heads, d, 6, 0.05);
        let v = near_subspace(2, tokens, kv_heads, d, 6, 0.05);
        let calib_k = near_subspace(3, 400, kv_heads, d, 6, 0.05);
        let calib_v = near_subspace(4, 400, kv_heads, d, 6, 0.05);
        let r = d / 4;
        let (bk, bv) = (
            bases(&calib_k, 400, kv_heads, d, r),
            bases(&calib_v, 400, kv_heads, d, r),
        );
        for (kf, vf) in [
            (format!("pca-r{r}"), format!("pca-r{r}")),
            (format!("pca-r{r}-c8"), format!("pca-r{r}-c4+secded84")),
            (format!("fd-r{r}-l40"), format!("fd-r{r}-l64-t0.3")),
            (format!("fd-r{r}-t0.05"), format!("fd-r{r}")),
        ] {
            let ks = store(&kf, &k, tokens, ch, d, Some(&bk));
            let vs = store(&vf, &v, tokens, ch, d, Some(&bv));
            if kf.starts_with("fd") {
                assert!(ks.chunks().len() > 1, "{kf}: {} chunks", ks.chunks().len());
            }
            let (kd, vd) = (decoded(&ks), decoded(&vs));
            let attn = Attention::new(shape);
            let q = uniform(5, 6 * shape.q_len(), 1.0);
            let positions: Vec<usize> = vec![0, 17, 100, 151, 230, tokens - 1];
            let fast = attn
                .attend_low_rank(&q, &positions, &ks, &vs, &Mask::Causal)
                .unwrap();
            let want = oracle(&q, &positions, &kd, &vd, tokens, &shape, &Mask::Causal);
            let (out, lse) = error_against(&fast, &want, &vd);
            assert!(
                out < 1e-5 && lse < 1e-5,
                "{kf}/{vf} {q_heads}/{kv_heads}/{d}: {out} {lse}"
            );
            // Decode (one query) on the same path, and the reconstructing path.
            let last = &q[5 * shape.q_len()..];
            let one = attn
                .attend_low_rank(last, &[tokens - 1], &ks, &vs, &Mask::Causal)
                .unwrap();
            let want = oracle(last, &[tokens - 1], &kd, &vd, tokens, &shape, &Mask::Causal);
            let (out, lse) = error_against(&one, &want, &vd);
            assert!(out < 1e-5 && lse < 1e-5, "{kf}/{vf} decode: {out} {lse}");
            let slow = attn
                .decode(last, tokens - 1, &ks, &vs, &Mask::Causal)
                .unwrap();
            let (out, lse) = error_against(&slow, &want, &vd);
            assert!(
                out < 1e-5 && lse < 1e-5,
                "{kf}/{vf} as KvSources: {out} {lse}"
            );
        }
    }
}

#[test]
fn keys_projected_before_rope_are_rotated_after_reconstruction() {
    let (tokens, kv_heads, d) = (130, 2, 32);
    let shape = HeadShape::new(4, kv_heads, d).unwrap();
    let ch = shape.kv_channels();
    let rope = Rope::new(RopeLayout::Adjacent, d, d, 10_000.0).unwrap();
    let raw = near_subspace(7, tokens, kv_heads, d, 5, 0.02);
    let calib = near_subspace(8, 300, kv_heads, d, 5, 0.02);
    let b = bases(&calib, 300, kv_heads, d, 8);
    let ks = store("pca-r8-pre", &raw, tokens, ch, d, Some(&b));
    let v = uniform(9, tokens * ch, 1.0);
    let vs = kv_quant::KvStore::quantize("fp32".parse().unwrap(), &v, tokens, ch).unwrap();
    // The oracle's keys: reconstructed, then rotated to their positions.
    let mut kd = decoded(&ks);
    for (t, row) in kd.chunks_exact_mut(ch).enumerate() {
        rope.apply(row, t).unwrap();
    }
    let keys = PreRopeKeys::new(&ks, &rope, 0);
    let q = uniform(10, 3 * shape.q_len(), 1.0);
    let positions = [10, 64, tokens - 1];
    let got = Attention::new(shape)
        .prefill(&q, &positions, &keys, &vs, &Mask::Causal)
        .unwrap();
    let want = oracle(&q, &positions, &kd, &v, tokens, &shape, &Mask::Causal);
    let (out, lse) = error_against(&got, &want, &v);
    assert!(out < 1e-5 && lse < 1e-5, "{out} {lse}");
    // The coefficient path refuses pre-RoPE keys by name.
    let ps = store(
        "pca-r8",
        &v,
        tokens,
        ch,
        d,
        Some(&bases(&v, tokens, kv_heads, d, 8)),
    );
    let e = Attention::new(shape)
        .attend_low_rank(&q, &positions, &ks, &ps, &Mask::Causal)
        .unwrap_err();
    assert!(e.to_string().contains("PreRopeKeys"), "{e}");
}

/// Per query head: logits, weights and output of attention on `k`, `v`
/// in f64 (the visible keys of a causal query at `pos`).
fn head_attention(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    pos: usize,
    ch: usize,
    h: usize,
    d: usize,
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let scale = 1.0 / (d as f64).sqrt();
    let logits: Vec<f64> = (0..=pos)
        .map(|t| {
            (0..d)
                .map(|c| f64::from(q[c]) * f64::from(k[t * ch + h * d + c]))
                .sum::<f64>()
                * scale
        })
        .collect();
    let m = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<f64> = logits.iter().map(|l| (l - m).exp()).collect();
    let z: f64 = e.iter().sum();
    let w: Vec<f64> = e.iter().map(|x| x / z).collect();
    let out = (0..d)
        .map(|c| {
            (0..=pos)
                .map(|t| w[t] * f64::from(v[t * ch + h * d + c]))
                .sum()
        })
        .collect();
    (logits, w, out)
}

#[test]
fn certificates_bound_the_true_errors() {
    let (tokens, kv_heads, d) = (200, 2, 32);
    let shape = HeadShape::new(4, kv_heads, d).unwrap();
    let ch = shape.kv_channels();
    for (noise, kf, vf, rk, rv) in [
        (0.05f32, "pca-r8", "pca-r8", 8, 8),
        (0.3, "pca-r4-c4", "pca-r8-c8", 4, 8),
        (0.1, "fd-r8-l50", "fd-r4", 8, 4),
    ] {
        let k = near_subspace(11, tokens, kv_heads, d, 6, noise);
        let v = near_subspace(12, tokens, kv_heads, d, 6, noise);
        let bk = bases(
            &near_subspace(13, 400, kv_heads, d, 6, noise),
            400,
            kv_heads,
            d,
            rk,
        );
        let bv = bases(
            &near_subspace(14, 400, kv_heads, d, 6, noise),
            400,
            kv_heads,
            d,
            rv,
        );
        let ks = store(kf, &k, tokens, ch, d, Some(&bk));
        let vs = store(vf, &v, tokens, ch, d, Some(&bv));
        let (kd, vd) = (decoded(&ks), decoded(&vs));
        let q = uniform(15, 5 * shape.q_len(), 2.0);
        let positions = [3, 50, 99, 150, tokens - 1];
        let certs = certificates(
            &shape,
            &q,
            &positions,
            tokens,
            Some(&ks),
            Some(&vs),
            0.0,
            &Mask::Causal,
        )
        .unwrap();
        for (i, &pos) in positions.iter().enumerate() {
            for g in 0..shape.q_heads() {
                let h = g / shape.group();
                let qh = &q[i * shape.q_len() + g * d..][..d];
                let (l, w, o) = head_attention(qh, &k, &v, pos, ch, h, d);
                let (lh, wh, oh) = head_attention(qh, &kd, &vd, pos, ch, h, d);
                let c = certs[i * shape.q_heads() + g];
                let dl = l
                    .iter()
                    .zip(&lh)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0.0, f64::max);
                let dw: f64 = w.iter().zip(&wh).map(|(a, b)| (a - b).abs()).sum();
                let dout = o
                    .iter()
                    .zip(&oh)
                    .map(|(a, b)| (a - b).powi(2))
                    .sum::<f64>()
                    .sqrt();
                let tol = 1e-5;
                assert!(
                    dl <= f64::from(c.logit) * (1.0 + tol) + tol,
                    "{kf}: logit {dl} > {}",
                    c.logit
                );
                assert!(
                    dw <= f64::from(c.softmax_l1) * (1.0 + tol) + tol,
                    "{kf}: l1 {dw} > {}",
                    c.softmax_l1
                );
                assert!(
                    dout <= f64::from(c.output) * (1.0 + tol) + tol,
                    "{kf}/{vf}: output {dout} > {}",
                    c.output
                );
            }
        }
    }
}
