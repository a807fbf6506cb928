//! Rotated forms (`+rot`, `lm<b>`, `lm<b>+qjl`): decoding rotates back,
//! the rotated decode is the rotation of the decode, rotation spreads
//! outliers, Lloyd-Max reaches its theoretical distortion on Gaussian
//! coordinates, and bad shapes and non-finite input are handled.

use gf2_codes::channel::FaultRng;
use kv_quant::{
    CacheForm, DecodeScratch, Hadamard, KvQuantError, KvStore, LloydMax, NonFinite, QuantizeOptions,
};

fn form(s: &str) -> CacheForm {
    s.parse().unwrap()
}

/// Standard normal draws (Box–Muller), reproducible.
fn gaussian(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = FaultRng::new(seed);
    (0..n)
        .map(|_| {
            let (u1, u2) = (1.0 - rng.next_f64(), rng.next_f64());
            ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
        })
        .collect()
}

/// Keys with one outlier channel per head, as real keys have.
fn outlier_keys(tokens: usize, channels: usize, seed: u64) -> Vec<f32> {
    let mut x = gaussian(tokens * channels, seed);
    for row in x.chunks_exact_mut(channels) {
        for head in row.chunks_exact_mut(64) {
            head[5] += 30.0;
        }
    }
    x
}

fn mse(a: &[f32], b: &[f32]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| f64::from(x - y).powi(2))
        .sum::<f64>()
        / a.len() as f64
}

#[test]
fn rotated_decodes_are_rotations_of_the_decodes() {
    let (tokens, channels) = (40, 128);
    let data = outlier_keys(tokens, channels, 1);
    for spelling in [
        "int4+rot",
        "int4-g32+rot",
        "int8-sym+rot128",
        "nf4+rot",
        "fp8-e4m3-tok+rot",
        "int4-ch+rot",
        "lm4",
        "lm2+rot128",
        "lm3+qjl",
        "int4+rot+secded84+interp",
        "lm4+golay24",
    ] {
        let store = KvStore::quantize(form(spelling), &data, tokens, channels).unwrap();
        let whole = store.decode().unwrap();
        let mut scratch = DecodeScratch::new();
        let mut rotated = vec![0.0; 16 * channels];
        store
            .decode_rows_rotated_into(8, 16, &mut rotated, &mut scratch)
            .unwrap();
        let mut expect = whole.values[8 * channels..24 * channels].to_vec();
        store.rotation().unwrap().unwrap().rotate(&mut expect);
        for (a, b) in rotated.iter().zip(&expect) {
            approx::assert_relative_eq!(a, b, epsilon = 1e-5, max_relative = 1e-5);
        }
        // Back in the original coordinates the error is a quantization
        // error: at most lm2's distortion (0.1175) of the signal's power.
        let power = data.iter().map(|x| f64::from(x * x)).sum::<f64>() / data.len() as f64;
        let err = mse(&whole.values, &data);
        assert!(err < 0.12 * power, "{spelling}: mse {err} of power {power}");
    }
}

#[test]
fn rotation_spreads_outliers_before_integer_quantization() {
    let (tokens, channels) = (64, 128);
    let data = outlier_keys(tokens, channels, 2);
    let err = |s: &str| {
        let store = KvStore::quantize(form(s), &data, tokens, channels).unwrap();
        mse(&store.decode().unwrap().values, &data)
    };
    // Per-token INT4: the outlier sets the step of its whole group.
    let (plain, rotated) = (err("int4-g64"), err("int4-g64+rot"));
    assert!(
        rotated < 0.5 * plain,
        "int4-g64: {plain}, rotated: {rotated}"
    );
    let (plain, rotated) = (err("int3-g64"), err("int3-g64+rot"));
    assert!(
        rotated < 0.5 * plain,
        "int3-g64: {plain}, rotated: {rotated}"
    );
}

#[test]
fn lloyd_max_reaches_its_distortion_on_gaussian_rows() {
    let (tokens, channels) = (400, 128);
    let data = gaussian(tokens * channels, 3);
    for bits in 1u8..=8 {
        let store = KvStore::quantize(form(&format!("lm{bits}")), &data, tokens, channels).unwrap();
        let err = mse(&store.decode().unwrap().values, &data);
        let theory = LloydMax::of(bits).mse();
        // Unit-variance coordinates: the measured error per coordinate is the
        // codebook's distortion, a little less (least-squares gain) or a
        // little more (f16 gains at 8 bits).
        assert!(
            err < 1.15 * theory + 2e-5 && err > 0.7 * theory,
            "lm{bits}: {err} vs {theory}"
        );
        let expected_bits = f64::from(bits) + 16.0 / 64.0;
        assert!(
            (store.bits_per_value() - expected_bits).abs() < 1e-9,
            "lm{bits}"
        );
    }
}

#[test]
fn qjl_makes_inner_products_less_biased_over_many_keys() {
    // Inner products of one query with many keys: the QJL residual sketch
    // removes the shrinkage of the 2-bit reconstruction on average.
    let (tokens, channels) = (2000, 64);
    let keys = gaussian(tokens * channels, 4);
    let q = gaussian(channels, 5);
    let dots = |values: &[f32]| -> Vec<f64> {
        values
            .chunks_exact(channels)
            .map(|k| k.iter().zip(&q).map(|(a, b)| f64::from(a * b)).sum())
            .collect()
    };
    let truth = dots(&keys);
    let bias = |s: &str| {
        let store = KvStore::quantize(form(s), &keys, tokens, channels).unwrap();
        let est = dots(&store.decode().unwrap().values);
        // Regression slope of the estimates on the true products.
        let num: f64 = est.iter().zip(&truth).map(|(e, t)| e * t).sum();
        let den: f64 = truth.iter().map(|t| t * t).sum();
        (num / den - 1.0).abs()
    };
    let plain = bias("lm1");
    let sketched = bias("lm1+qjl");
    assert!(plain > 0.01, "lm1 slope bias {plain}");
    assert!(sketched < plain, "lm1+qjl bias {sketched} vs lm1 {plain}");
}

#[test]
fn rotation_blocks_must_divide_the_channels() {
    let data = vec![0.5; 2 * 96];
    for s in ["int4+rot", "lm4", "nf4+rot64"] {
        let e = KvStore::quantize(form(s), &data, 2, 96).unwrap_err();
        assert!(
            matches!(
                e,
                KvQuantError::InvalidParameter {
                    name: "rotation block",
                    ..
                }
            ),
            "{s}: {e}"
        );
        assert!(e.to_string().contains("+rot<N>"), "{e}");
    }
    assert!(KvStore::quantize(form("int4+rot32"), &data, 2, 96).is_ok());
}

#[test]
fn non_finite_input_in_rotated_forms() {
    let (tokens, channels) = (3, 64);
    let mut data = gaussian(tokens * channels, 6);
    data[10] = f32::INFINITY;
    data[70] = f32::NAN;
    for s in ["lm4", "int4+rot", "lm3+qjl"] {
        assert!(matches!(
            KvStore::quantize(form(s), &data, tokens, channels),
            Err(KvQuantError::NonFinite {
                token: 0,
                channel: 10,
                ..
            })
        ));
        let opts = QuantizeOptions {
            non_finite: NonFinite::Clamp,
        };
        let store = KvStore::quantize_with(form(s), &data, tokens, channels, opts).unwrap();
        let back = store.decode().unwrap();
        assert!(back.values.iter().all(|x| x.is_finite()), "{s}");
        // The clamped infinity is the largest value of its token (it became
        // that block's largest finite magnitude before rotation).
        let row0 = &back.values[..channels];
        let top = row0.iter().cloned().fold(f32::MIN, f32::max);
        assert!(
            (row0[10] - top).abs() < 1e-3 + 0.5 * top.abs(),
            "{s}: {row0:?}"
        );
        // The row without a non-finite value is unaffected.
        let clean = KvStore::quantize(form(s), &data[2 * channels..], 1, channels).unwrap();
        assert_eq!(
            &back.values[2 * channels..],
            &clean.decode().unwrap().values[..],
            "{s}"
        );
    }
    // A rotated value beyond f32 is an error, not an infinity.
    let huge = vec![f32::MAX; 64];
    assert!(matches!(
        KvStore::quantize(form("int4-sf32+rot"), &huge, 1, 64),
        Err(KvQuantError::OutOfRange { .. })
    ));
}

#[test]
fn rotation_keeps_dot_products_of_decoded_rows() {
    // The rotated decode of keys and a rotated query give the same scores as
    // the decode and the plain query.
    let (tokens, channels) = (32, 64);
    let keys = outlier_keys(tokens, channels, 7);
    let q = gaussian(channels, 8);
    let store = KvStore::quantize(form("int4+rot"), &keys, tokens, channels).unwrap();
    let plain = store.decode().unwrap().values;
    let mut rotated = vec![0.0; tokens * channels];
    store
        .decode_rows_rotated_into(0, tokens, &mut rotated, &mut DecodeScratch::new())
        .unwrap();
    let mut rq = q.clone();
    Hadamard::of(64).unwrap().rotate(&mut rq);
    for (a, b) in plain
        .chunks_exact(channels)
        .zip(rotated.chunks_exact(channels))
    {
        let s1: f32 = a.iter().zip(&q).map(|(x, y)| x * y).sum();
        let s2: f32 = b.iter().zip(&rq).map(|(x, y)| x * y).sum();
        approx::assert_relative_eq!(s1, s2, epsilon = 1e-4, max_relative = 1e-4);
    }
}
