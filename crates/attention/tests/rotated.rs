//! Rotated forms (kv-quant's `+rot`, `lm`, `vq`): attention reads their
//! tiles in rotated coordinates, rotates the query instead of every key and
//! the weighted sum of values back once; the result equals the f64 oracle
//! on the decoded (unrotated) K and V within 1e-5, for decode and prefill,
//! GQA, segmented and protected forms, and either side rotated alone.

mod common;

use attention::{Attention, DenseKv, HeadShape, KvSource, Mask, Numerics};
use common::{error_against, oracle, uniform};
use kv_quant::{CacheForm, KvStore};

fn store(form: &str, data: &[f32], tokens: usize, ch: usize) -> KvStore {
    let form: CacheForm = form.parse().unwrap();
    KvStore::quantize(form, data, tokens, ch).unwrap()
}

#[test]
fn rotated_stores_attend_like_their_decodes() {
    let tokens = 300;
    for (q_heads, kv_heads, d) in [(4, 2, 64), (3, 3, 128), (8, 1, 64)] {
        let shape = HeadShape::new(q_heads, kv_heads, d).unwrap();
        let ch = shape.kv_channels();
        let k = uniform(1, tokens * ch, 2.0);
        let v = uniform(2, tokens * ch, 1.0);
        for (kf, vf) in [
            ("int4+rot", "int4+rot"),
            ("lm4", "lm3"),
            ("int4-g32+rot32", "fp16"),
            ("int4", "lm4+rot"),
            ("lm4+sink4+win32", "int4+rot+sink4+win32+secded84+interp"),
        ] {
            let (ks, vs) = (store(kf, &k, tokens, ch), store(vf, &v, tokens, ch));
            assert!(ks.rotation().unwrap().is_some() || vs.rotation().unwrap().is_some());
            let (kd, vd) = (ks.decode().unwrap().values, vs.decode().unwrap().values);
            // The exact path (the oracle's tolerance); `tests/numerics.rs`
            // bounds the integer one.
            let mut attn = Attention::new(shape);
            attn.set_numerics(Numerics::Exact);
            let q = uniform(3, 5 * shape.q_len(), 1.0);
            let positions: Vec<usize> = (tokens - 5..tokens).collect();
            let pre = attn
                .prefill(&q, &positions, &ks, &vs, &Mask::Causal)
                .unwrap();
            let want = oracle(&q, &positions, &kd, &vd, tokens, &shape, &Mask::Causal);
            let (out, lse) = error_against(&pre, &want, &vd);
            assert!(
                out < 1e-5 && lse < 1e-5,
                "{kf}/{vf} {q_heads}/{kv_heads}/{d}: {out} {lse}"
            );
            let last = &q[4 * shape.q_len()..];
            let dec = attn
                .decode(last, tokens - 1, &ks, &vs, &Mask::Causal)
                .unwrap();
            let want = oracle(last, &[tokens - 1], &kd, &vd, tokens, &shape, &Mask::Causal);
            let (out, lse) = error_against(&dec, &want, &vd);
            assert!(out < 1e-5 && lse < 1e-5, "{kf}/{vf} decode: {out} {lse}");
            // The dense decodes give the same answer as the rotated read.
            let dense = attn
                .decode(
                    last,
                    tokens - 1,
                    &DenseKv::new(&kd, tokens, ch).unwrap(),
                    &DenseKv::new(&vd, tokens, ch).unwrap(),
                    &Mask::Causal,
                )
                .unwrap();
            let diff = dense
                .out
                .iter()
                .zip(&dec.out)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f32::max);
            assert!(diff < 1e-5, "{kf}/{vf}: {diff}");
        }
    }
}

#[test]
fn rotation_blocks_that_straddle_heads_are_refused() {
    let shape = HeadShape::new(2, 2, 32).unwrap();
    let ch = shape.kv_channels();
    let tokens = 8;
    let ks = store("int4+rot64", &uniform(1, tokens * ch, 1.0), tokens, ch);
    let vs = store("int4", &uniform(2, tokens * ch, 1.0), tokens, ch);
    assert_eq!(ks.rotation().unwrap().unwrap().block(), 64);
    assert!(KvSource::rotation(&ks).is_some());
    let q = uniform(3, shape.q_len(), 1.0);
    let e = Attention::new(shape)
        .decode(&q, tokens - 1, &ks, &vs, &Mask::Causal)
        .unwrap_err();
    assert!(e.to_string().contains("straddle heads"), "{e}");
}
