//! Attention read straight from every kv-quant stored form, tile by tile,
//! is bit-identical to decoding the whole store up front and attending the
//! f32 copy, with the same decode statistics, with and without faults.

mod common;

use attention::{
    Attention, AttentionConfig, AttentionOutput, DenseKv, HeadShape, Mask, Numerics, OnNonFinite,
};
use common::{error_against, oracle, uniform};
use gf2_codes::channel::BinarySymmetric;
use kv_quant::{CacheForm, FaultTarget, KvStore};

const FORMS: &[&str] = &[
    "fp32",
    "fp16",
    "bf16",
    "fp8-e4m3",
    "fp8-e5m2-h64",
    "int8",
    "int8-sym-ch",
    "int4",
    "int4-g32",
    "int4-g8",
    "int4-sym-g64-sf32",
    "int4-ch",
    "int4-ch64",
    "int4-t",
    "int3-g32",
    "int2",
    "nf4-g64",
    "int4+hamming74",
    "int4+secded84",
    "int4+secded84+zero",
    "int4+secded84+interp",
    "int4-g32+secded84+interp4",
    "int4-ch+secded84+interp",
    "int4+golay24",
    "int4+golay24+interp",
    "nf4+secded84+meta-none",
    "int4-g32+golay24+interp+meta-rm",
];

const TOKENS: usize = 333;

/// The bits of every output and log-sum-exp, every NaN counted as one
/// pattern: Rust (like LLVM and the x86 instructions under it) leaves the
/// payload of a NaN result unspecified, for example which of two NaN
/// operands of an addition it keeps, and the faulted unprotected forms
/// decode NaN scales.
fn bits(o: &AttentionOutput) -> (Vec<u32>, Vec<u32>) {
    let bits = |x: &f32| {
        if x.is_nan() {
            f32::NAN.to_bits()
        } else {
            x.to_bits()
        }
    };
    (
        o.out.iter().map(bits).collect(),
        o.lse.iter().map(bits).collect(),
    )
}

fn stores(form: &str, ber: f64, seed: u64, shape: &HeadShape) -> (KvStore, KvStore) {
    let ch = shape.kv_channels();
    let form: CacheForm = form.parse().unwrap();
    let k = KvStore::quantize(form, &uniform(seed, TOKENS * ch, 2.0), TOKENS, ch).unwrap();
    let v = KvStore::quantize(form, &uniform(seed ^ 1, TOKENS * ch, 1.0), TOKENS, ch).unwrap();
    let (mut kf, mut vf) = (k, v);
    if ber > 0.0 {
        let channel = BinarySymmetric::new(ber).unwrap();
        kf.inject(&channel, seed ^ 2, FaultTarget::Everything);
        vf.inject(&channel, seed ^ 3, FaultTarget::Everything);
    }
    (kf, vf)
}

#[test]
fn in_loop_decoding_equals_up_front_decoding_for_every_form() {
    in_loop_equals_up_front(HeadShape::new(6, 2, 64).unwrap(), FORMS);
}

/// SmolLM2's shape: rows of 192 channels, so groups (whole rows, 48 or 96
/// channels) that are multiples of 16 but not powers of two.
#[test]
fn in_loop_decoding_equals_up_front_decoding_for_groups_of_any_multiple_of_16() {
    let forms = ["int4", "int4-g48", "int8-g96", "int4+secded84+interp"];
    in_loop_equals_up_front(HeadShape::new(9, 3, 64).unwrap(), &forms);
}

fn in_loop_equals_up_front(shape: HeadShape, forms: &[&str]) {
    let config = AttentionConfig {
        tile_tokens: 32,
        tile_bytes: None,
        split_tokens: 64,
        on_non_finite: OnNonFinite::Report,
        // Bit identity with attention over the decoded f32 rows holds for
        // the exact scores only.
        numerics: Numerics::Exact,
        ..AttentionConfig::default()
    };
    let attn = Attention::with_config(shape, config).unwrap();
    let ch = shape.kv_channels();
    let q = uniform(99, 4 * shape.q_len(), 1.0);
    let positions = [TOKENS - 1, 0, 100, 257];
    for &form in forms {
        for (ber, seed) in [(0.0, 5), (1e-2, 6), (1e-3, 7)] {
            let (k, v) = stores(form, ber, seed, &shape);
            let (kd, vd) = (k.decode().unwrap(), v.decode().unwrap());
            let (k_dense, v_dense) = (
                DenseKv::new(&kd.values, TOKENS, ch).unwrap(),
                DenseKv::new(&vd.values, TOKENS, ch).unwrap(),
            );
            let ctx = format!("{form} at BER {ber}");

            let q0 = &q[..shape.q_len()];
            let up_front = attn
                .decode(q0, TOKENS - 1, &k_dense, &v_dense, &Mask::Causal)
                .unwrap();
            let in_loop = attn.decode(q0, TOKENS - 1, &k, &v, &Mask::Causal).unwrap();
            assert_eq!(bits(&in_loop), bits(&up_front), "{ctx}: decode");
            assert_eq!(in_loop.non_finite, up_front.non_finite, "{ctx}");
            // Every tile read once: the statistics are the whole decode's.
            assert_eq!(in_loop.stats.keys, kd.stats, "{ctx}: key stats");
            assert_eq!(in_loop.stats.values, vd.stats, "{ctx}: value stats");
            assert_eq!(in_loop.stats.tiles, TOKENS.div_ceil(32) as u64);
            // Tiles with erased values (attended from decoded f32 rows) are counted.
            let erased = kd.stats.erased_values + vd.stats.erased_values;
            assert_eq!(erased == 0, in_loop.stats.erased_tiles == 0, "{ctx}");
            assert!(in_loop.stats.erased_tiles <= in_loop.stats.tiles.min(erased));

            let up_front = attn
                .prefill(&q, &positions, &k_dense, &v_dense, &Mask::Causal)
                .unwrap();
            let in_loop = attn.prefill(&q, &positions, &k, &v, &Mask::Causal).unwrap();
            assert_eq!(bits(&in_loop), bits(&up_front), "{ctx}: prefill");
            assert_eq!(in_loop.stats.keys, kd.stats, "{ctx}: prefill key stats");
            assert_eq!(in_loop.stats.values, vd.stats, "{ctx}: prefill value stats");

            // The fused tiles count miscorrected and silent words from the
            // stores' fault ledgers, as a whole decode does (checked above):
            // an unprotected form hit by faults has silent words.
            if ber > 0.0 && k.form().protection().is_none() {
                assert!(in_loop.stats.keys.values.silent > 0, "{ctx}");
            }

            // And the result is the oracle's over the decoded values.
            if ber == 0.0 {
                let want = oracle(
                    q0,
                    &[TOKENS - 1],
                    &kd.values,
                    &vd.values,
                    TOKENS,
                    &shape,
                    &Mask::Causal,
                );
                let got = attn.decode(q0, TOKENS - 1, &k, &v, &Mask::Causal).unwrap();
                let (out, lse) = error_against(&got, &want, &vd.values);
                assert!(out < 1e-5 && lse < 1e-5, "{ctx}: {out} {lse}");
            }
        }
    }
}

#[test]
fn keys_and_values_may_use_different_forms() {
    // KIVI: per-channel keys, per-token values.
    let shape = HeadShape::new(4, 4, 32).unwrap();
    let ch = shape.kv_channels();
    let (k, v) = (uniform(1, TOKENS * ch, 1.0), uniform(2, TOKENS * ch, 1.0));
    let ks = KvStore::quantize("int4-ch".parse().unwrap(), &k, TOKENS, ch).unwrap();
    let vs = KvStore::quantize("int4-g32+secded84".parse().unwrap(), &v, TOKENS, ch).unwrap();
    let q = uniform(3, shape.q_len(), 1.0);
    let got = Attention::new(shape)
        .decode(&q, TOKENS - 1, &ks, &vs, &Mask::Causal)
        .unwrap();
    let want = oracle(
        &q,
        &[TOKENS - 1],
        &ks.decode().unwrap().values,
        &vs.decode().unwrap().values,
        TOKENS,
        &shape,
        &Mask::Causal,
    );
    let (out, _) = error_against(&got, &want, &v);
    assert!(out < 1e-5);
    assert_eq!(got.stats.keys.values.words, (TOKENS * ch) as u64);
    assert_eq!(got.stats.values.values.words, (TOKENS * ch) as u64);
    assert_eq!(got.stats.keys.values.words, got.stats.keys.values.clean);
}

#[test]
fn protection_keeps_attention_close_where_plain_int4_breaks() {
    // Keys and values that vary smoothly along the sequence, as real caches
    // do, and a query that singles out a few keys. At BER 1e-2 on the
    // values, SECDED with interpolation stays near the fault-free output;
    // unprotected INT4 does not.
    let shape = HeadShape::new(6, 2, 64).unwrap();
    let ch = shape.kv_channels();
    let smooth = |phase: f32| -> Vec<f32> {
        (0..TOKENS * ch)
            .map(|i| ((i / ch) as f32 * 0.02 + (i % ch) as f32 * 0.7 + phase).sin())
            .collect()
    };
    let (k, v) = (smooth(0.0), smooth(1.0));
    let q: Vec<f32> = (0..shape.q_len())
        .map(|i| 4.0 * k[200 * ch + i % ch])
        .collect();
    let attn = Attention::new(shape);
    let deviation = |form: &str| {
        let form: CacheForm = form.parse().unwrap();
        let (k0, v0) = (
            KvStore::quantize(form, &k, TOKENS, ch).unwrap(),
            KvStore::quantize(form, &v, TOKENS, ch).unwrap(),
        );
        let clean = attn
            .decode(&q, TOKENS - 1, &k0, &v0, &Mask::Causal)
            .unwrap();
        let channel = BinarySymmetric::new(1e-2).unwrap();
        let mut worst = 0.0f32;
        let mut stats = None;
        for seed in 0..4 {
            let (mut kf, mut vf) = (k0.clone(), v0.clone());
            kf.inject(&channel, 2 * seed, FaultTarget::Values);
            vf.inject(&channel, 2 * seed + 1, FaultTarget::Values);
            let faulty = attn
                .decode(&q, TOKENS - 1, &kf, &vf, &Mask::Causal)
                .unwrap();
            let dev = clean
                .out
                .iter()
                .zip(&faulty.out)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f32::max);
            worst = worst.max(dev);
            stats = Some(faulty.stats);
        }
        (worst, stats.unwrap())
    };
    let (plain, _) = deviation("int4");
    let (secded, stats) = deviation("int4+secded84+interp");
    assert!(stats.keys.values.corrected > 0 && stats.values.values.corrected > 0);
    assert!(
        stats.keys.erased_values > 0,
        "BER 1e-2 leaves double errors to erase"
    );
    // Measured: 0.034 against 0.099 (worst of four seeds).
    assert!(secded * 2.0 < plain, "secded {secded} vs plain {plain}");
}

/// Every protected form, faults at BER 1e-2 in every stored bit (values,
/// scales, offsets and their checks): the attention outputs stay finite,
/// because a metadata word that decodes to something no encoder writes
/// (NaN, ±∞, a negative scale) erases its group, whatever the erasure
/// policy, instead of spreading through a whole row.
#[test]
fn protected_forms_give_finite_attention_at_ber_1e_2() {
    let shape = HeadShape::new(6, 2, 64).unwrap();
    let config = AttentionConfig {
        on_non_finite: OnNonFinite::Report,
        ..AttentionConfig::default()
    };
    let attn = Attention::with_config(shape, config).unwrap();
    let q = uniform(98, shape.q_len(), 1.0);
    let forms = [
        "int4+hamming74",
        "int4+hamming74+interp",
        "int4+secded84",
        "int4+secded84+zero",
        "int4+secded84+interp",
        "int4+secded84+interp+meta-rm",
        "int4-ch+secded84+interp",
        "int4+golay24",
        "int4+golay24+meta-rm",
        "int4-g32+golay24+interp",
        "int8+golay24",
        "nf4+secded84",
        "nf4-sf32+secded84+interp+meta-rm",
        "lm4+secded84",
        "fp8-e4m3-tok+secded84+interp",
    ];
    let mut failed = Vec::new();
    for form in forms {
        for seed in 0..4 {
            let (k, v) = stores(form, 1e-2, 40 + seed, &shape);
            let out = attn.decode(&q, TOKENS - 1, &k, &v, &Mask::Causal).unwrap();
            let bad = out.out.iter().chain(&out.lse).filter(|x| !x.is_finite());
            if bad.count() > 0 {
                failed.push(format!("{form} seed {seed}"));
            }
        }
    }
    assert!(failed.is_empty(), "non-finite outputs: {failed:?}");
}
