//! Properties of every quantizer: error bounds against the stored scales,
//! exact zero points, degenerate groups, non-finite and out-of-range input,
//! shapes, and the packing density of every form.

use kv_quant::{
    CacheForm, DecodeScratch, Fp8Format, Granularity, IntSpec, KvQuantError, KvStore, NF4_LEVELS,
    NonFinite, QuantizeOptions, Quantizer, ScaleType,
};
use proptest::prelude::*;

fn int_forms() -> Vec<CacheForm> {
    let mut forms = Vec::new();
    for bits in [2u8, 3, 4, 8] {
        for symmetric in [false, true] {
            for granularity in [
                Granularity::PerToken { group: None },
                Granularity::PerToken { group: Some(4) },
                Granularity::PerChannel { tokens: None },
                Granularity::PerChannel { tokens: Some(3) },
                Granularity::PerTensor,
            ] {
                for scale in [ScaleType::F16, ScaleType::F32] {
                    let spec = IntSpec {
                        bits,
                        symmetric,
                        granularity,
                        scale,
                    };
                    forms.push(CacheForm::plain(Quantizer::Int(spec)).unwrap());
                }
            }
        }
    }
    forms
}

fn int_spec(form: &CacheForm) -> IntSpec {
    match form.quantizer() {
        Quantizer::Int(s) => *s,
        other => panic!("not an integer form: {other:?}"),
    }
}

/// Checks `|x − x̂| ≤ s/2` for every value, with `s` the stored scale of the
/// value's group, up to f32 rounding of the arithmetic (a few ulps of the
/// magnitudes involved).
fn assert_half_step(form: &CacheForm, data: &[f32], tokens: usize, channels: usize) {
    let store = KvStore::quantize(*form, data, tokens, channels).unwrap();
    let back = store.decode().unwrap();
    let layout = *store.layout().unwrap();
    let spec = int_spec(form);
    let top = f64::from((1u32 << spec.bits) - 1);
    for t in 0..tokens {
        for c in 0..channels {
            let (s, o) = store.group_params(layout.group(t, c)).unwrap();
            let (x, y) = (
                f64::from(data[t * channels + c]),
                f64::from(back.values[t * channels + c]),
            );
            let slack =
                4.0 * f64::from(f32::EPSILON) * (x.abs() + f64::from(o).abs() + top * f64::from(s));
            assert!(
                (x - y).abs() <= f64::from(s) / 2.0 + slack,
                "{form}: ({t},{c}) x={x} x̂={y} scale={s} offset={o}"
            );
        }
    }
}

fn matrix(tokens: usize, channels: usize, magnitude: f32) -> impl Strategy<Value = Vec<f32>> {
    proptest::collection::vec(-1.0f32..1.0, tokens * channels)
        .prop_map(move |v| v.into_iter().map(|x| x * magnitude).collect())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    #[test]
    fn every_integer_form_is_within_half_a_step(
        (tokens, data) in (1usize..9).prop_flat_map(|t| (Just(t), matrix(t, 8, 1.0))),
        magnitude_exp in -30i32..4,
        shift in -3.0f32..3.0,
    ) {
        let magnitude = 10f32.powi(magnitude_exp);
        let data: Vec<f32> = data.iter().map(|x| x * magnitude + shift * magnitude).collect();
        for form in int_forms() {
            assert_half_step(&form, &data, tokens, 8);
        }
    }

    #[test]
    fn f32_scales_hold_the_whole_f32_range(
        data in matrix(3, 8, 1.0),
        magnitude_exp in -44i32..37,
    ) {
        let magnitude = 10f32.powi(magnitude_exp);
        let data: Vec<f32> = data.iter().map(|x| x * magnitude).collect();
        for form in int_forms().into_iter().filter(|f| int_spec(f).scale == ScaleType::F32) {
            assert_half_step(&form, &data, 3, 8);
        }
    }

    #[test]
    fn nf4_picks_the_nearest_level_of_the_stored_absmax(data in matrix(4, 16, 3.0)) {
        for spelling in ["nf4-g8", "nf4-g16-sf32"] {
            let form: CacheForm = spelling.parse().unwrap();
            let store = KvStore::quantize(form, &data, 4, 16).unwrap();
            let back = store.decode().unwrap();
            let layout = *store.layout().unwrap();
            for t in 0..4 {
                for c in 0..16 {
                    let (absmax, _) = store.group_params(layout.group(t, c)).unwrap();
                    let x = data[t * 16 + c];
                    let err = (back.values[t * 16 + c] - x).abs();
                    let best = NF4_LEVELS.iter().map(|l| (l * absmax - x).abs()).fold(f32::INFINITY, f32::min);
                    prop_assert!(err <= best + 1e-6 * absmax, "{spelling} ({t},{c})");
                }
            }
        }
    }

    #[test]
    fn fp8_stores_round_to_nearest_in_scaled_units(data in matrix(4, 16, 100.0)) {
        for (spelling, format) in [("fp8-e4m3", Fp8Format::E4M3), ("fp8-e5m2-h8", Fp8Format::E5M2)] {
            let form: CacheForm = spelling.parse().unwrap();
            let store = KvStore::quantize(form, &data, 4, 16).unwrap();
            let back = store.decode().unwrap();
            let layout = *store.layout().unwrap();
            for t in 0..4 {
                for c in 0..16 {
                    let (s, _) = store.group_params(layout.group(t, c)).unwrap();
                    let x = data[t * 16 + c];
                    prop_assert_eq!(back.values[t * 16 + c], format.decode(format.encode(x / s)) * s);
                    prop_assert!((x / s).abs() <= format.max_finite() * (1.0 + 1e-6));
                }
            }
        }
    }
}

#[test]
fn zero_points_map_exactly_where_stated() {
    // Multiples of 1/8: every group minimum is exact in f16, so it is the offset.
    let data: Vec<f32> = (0..64).map(|i| (i as f32 - 20.0) * 0.125).collect();
    for form in int_forms() {
        let spec = int_spec(&form);
        let store = KvStore::quantize(form, &data, 4, 16).unwrap();
        let layout = *store.layout().unwrap();
        if spec.symmetric {
            // Real zero -> level 2^(b-1) -> exactly 0.0.
            let mut with_zero = data.clone();
            with_zero[5] = 0.0;
            let store = KvStore::quantize(form, &with_zero, 4, 16).unwrap();
            assert_eq!(store.decode().unwrap().values[5], 0.0, "{form}");
        } else {
            // Level 0 -> exactly the stored offset, which the group minimum reaches.
            let back = store.decode().unwrap();
            for g in 0..layout.groups() {
                let (_, offset) = store.group_params(g).unwrap();
                let min_decoded = (0..64)
                    .filter(|&i| layout.group(i / 16, i % 16) == g)
                    .map(|i| back.values[i])
                    .fold(f32::INFINITY, f32::min);
                assert_eq!(min_decoded, offset, "{form} group {g}");
            }
        }
    }
}

#[test]
fn constant_and_denormal_groups_decode_without_division_by_zero() {
    for value in [0.0f32, 1.5, -3.25, 1e-40, -1e-42, f32::from_bits(1)] {
        let data = vec![value; 32];
        for form in int_forms() {
            let store = KvStore::quantize(form, &data, 4, 8).unwrap();
            let back = store.decode().unwrap();
            let spec = int_spec(&form);
            // Exact where the stated arithmetic is exact: zero always, an
            // asymmetric constant whenever its offset type holds it.
            let offset_exact = match spec.scale {
                ScaleType::F32 => true,
                ScaleType::F16 => half::f16::from_f32(value).to_f32() == value,
            };
            if value == 0.0 || (!spec.symmetric && offset_exact) {
                assert!(back.values.iter().all(|&y| y == value), "{form} {value}");
            } else {
                assert!(back.values.iter().all(|y| y.is_finite()), "{form} {value}");
                assert_half_step(&form, &data, 4, 8);
            }
        }
    }
    // A mixed row with a denormal-size range.
    let data: Vec<f32> = (0..16).map(|i| i as f32 * 1e-41).collect();
    for form in int_forms()
        .into_iter()
        .filter(|f| int_spec(f).scale == ScaleType::F32)
    {
        assert_half_step(&form, &data, 2, 8);
    }
}

#[test]
fn non_finite_input_is_an_error_by_default_and_clamped_on_request() {
    let forms = [
        "fp32",
        "fp16",
        "bf16",
        "fp8-e4m3",
        "int8",
        "int4-g4",
        "int2-ch",
        "nf4-g8",
        "int4+secded84",
    ];
    for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        let mut data: Vec<f32> = (0..16).map(|i| i as f32 / 4.0 - 2.0).collect();
        data[9] = bad;
        for spelling in forms {
            let form: CacheForm = spelling.parse().unwrap();
            match KvStore::quantize(form, &data, 2, 8) {
                Err(KvQuantError::NonFinite {
                    token: 1,
                    channel: 1,
                    ..
                }) => {}
                other => panic!("{spelling} with {bad}: {other:?}"),
            }
            let clamp = QuantizeOptions {
                non_finite: NonFinite::Clamp,
            };
            let store = KvStore::quantize_with(form, &data, 2, 8, clamp).unwrap();
            let back = store.decode().unwrap();
            assert!(back.values.iter().all(|v| v.is_finite()), "{spelling}");
            let v = back.values[9];
            let (nearest_zero, top) = extremes(&store, 1, 1);
            if bad.is_nan() {
                assert_eq!(v, nearest_zero, "{spelling}: NaN");
            } else if bad > 0.0 {
                assert_eq!(v, top, "{spelling}: +inf saturates to the top");
            } else {
                let bottom = if spelling.starts_with("int") {
                    // Asymmetric: level 0, the stored offset.
                    store
                        .group_params(store.layout().unwrap().group(1, 1))
                        .unwrap()
                        .1
                } else {
                    -top
                };
                assert_eq!(v, bottom, "{spelling}: -inf saturates to the bottom");
            }
        }
    }
}

/// `NonFinite::Keep`: float forms (and the exact rows of sinks) store NaN
/// and the infinities as IEEE conversion gives them, a finite value past
/// fp16's range included; every other form stores what `Clamp` stores,
/// byte for byte.
#[test]
fn keep_stores_non_finite_floats_and_saturates_the_rest() {
    let keep = QuantizeOptions {
        non_finite: NonFinite::Keep,
    };
    let clamp = QuantizeOptions {
        non_finite: NonFinite::Clamp,
    };
    let mut data: Vec<f32> = (0..32).map(|i| i as f32 / 8.0 - 2.0).collect();
    data[1] = f32::NAN;
    data[9] = f32::INFINITY;
    data[10] = f32::NEG_INFINITY;
    data[20] = 1e6;
    let same_bits = |a: f32, b: f32| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan());
    for spelling in ["fp32", "fp16", "bf16"] {
        let form: CacheForm = spelling.parse().unwrap();
        let back = KvStore::quantize_with(form, &data, 4, 8, keep)
            .unwrap()
            .decode()
            .unwrap()
            .values;
        assert!(back[1].is_nan(), "{spelling}: NaN kept");
        assert_eq!(back[9], f32::INFINITY, "{spelling}");
        assert_eq!(back[10], f32::NEG_INFINITY, "{spelling}");
        let want = match spelling {
            "fp32" => 1e6,
            "fp16" => f32::INFINITY,
            _ => half::bf16::from_f32(1e6).to_f32(),
        };
        assert_eq!(back[20], want, "{spelling}: beyond the format's range");
        if spelling == "fp32" {
            assert!(same_bits(back[5], data[5]), "fp32 keeps every value");
        }
    }
    // (A finite value past a scale type's range is an error of its own,
    // the same under every policy: `values_beyond_a_storage_type_are_errors`.)
    data[20] = 0.5;
    // Sink rows are exact fp16 rows: NaN kept there; the middle saturates.
    let sink = KvStore::quantize_with("int4+sink1".parse().unwrap(), &data, 4, 8, keep).unwrap();
    let back = sink.decode().unwrap().values;
    assert!(back[1].is_nan(), "the sink row keeps NaN");
    assert!(
        back[8..].iter().all(|v| v.is_finite()),
        "the int4 middle saturates"
    );
    for spelling in [
        "int4",
        "int4-ch",
        "int8-sym",
        "nf4-g8",
        "fp8-e4m3",
        "int4+secded84",
        "lm4+rot8",
    ] {
        let form: CacheForm = spelling.parse().unwrap();
        let kept = KvStore::quantize_with(form, &data, 4, 8, keep).unwrap();
        let clamped = KvStore::quantize_with(form, &data, 4, 8, clamp).unwrap();
        assert_eq!(kept, clamped, "{spelling}: Keep saturates as Clamp does");
    }
}

/// The representable value nearest 0 and the largest representable value of
/// the group of `(t, c)`, from the stated formulas of each form.
fn extremes(store: &KvStore, t: usize, c: usize) -> (f32, f32) {
    let params = store
        .layout()
        .map(|l| store.group_params(l.group(t, c)).unwrap());
    match *store.form().quantizer() {
        Quantizer::Fp32 => (0.0, f32::MAX),
        Quantizer::Fp16 => (0.0, 65504.0),
        Quantizer::Bf16 => (0.0, half::bf16::MAX.to_f32()),
        Quantizer::Fp8(spec) => (0.0, spec.format.max_finite() * params.unwrap().0),
        Quantizer::Nf4(_) => (0.0, params.unwrap().0),
        Quantizer::Int(spec) => {
            let (s, o) = params.unwrap();
            if spec.symmetric {
                (0.0, ((1u32 << (spec.bits - 1)) - 1) as f32 * s)
            } else {
                let levels = (0..1u32 << spec.bits).map(|q| o + q as f32 * s);
                let nearest = levels
                    .clone()
                    .min_by(|a, b| a.abs().total_cmp(&b.abs()))
                    .unwrap();
                (nearest, o + ((1u32 << spec.bits) - 1) as f32 * s)
            }
        }
        Quantizer::LloydMax(_)
        | Quantizer::Vq(_)
        | Quantizer::LowRank(_)
        | Quantizer::Shard(_)
        | Quantizer::Hierarchical(_) => {
            unreachable!(
                "rotated forms saturate per block (tests/rotated.rs); low-rank, shard and \
                 hierarchical forms are stored outside KvStore"
            )
        }
    }
}

#[test]
fn values_beyond_a_storage_type_are_errors() {
    let mut data = vec![0.5f32; 16];
    data[3] = 1e6;
    let fp16: CacheForm = "fp16".parse().unwrap();
    assert!(matches!(
        KvStore::quantize(fp16, &data, 2, 8),
        Err(KvQuantError::OutOfRange { dtype: "f16", .. })
    ));
    let clamp = QuantizeOptions {
        non_finite: NonFinite::Clamp,
    };
    let back = KvStore::quantize_with(fp16, &data, 2, 8, clamp)
        .unwrap()
        .decode()
        .unwrap();
    assert_eq!(back.values[3], 65504.0);
    let int4: CacheForm = "int4".parse().unwrap();
    let e = KvStore::quantize(int4, &data, 2, 8).unwrap_err();
    assert!(
        matches!(e, KvQuantError::OutOfRange { dtype: "f16", .. }),
        "{e}"
    );
    assert!(e.to_string().contains("wider scale type"));
    assert!(KvStore::quantize("int4-sf32".parse().unwrap(), &data, 2, 8).is_ok());
}

#[test]
fn shapes_and_groupings_are_checked() {
    let data = vec![0.0f32; 24];
    let int4: CacheForm = "int4".parse().unwrap();
    assert!(matches!(
        KvStore::quantize(int4, &data, 5, 5),
        Err(KvQuantError::ShapeMismatch {
            expected: 25,
            found: 24,
            ..
        })
    ));
    assert!(matches!(
        KvStore::quantize(int4, &data, 24, 0),
        Err(KvQuantError::InvalidParameter {
            name: "channels",
            ..
        })
    ));
    for spelling in ["int4-g5", "nf4-g7", "fp8-e4m3-h5"] {
        assert!(
            matches!(
                KvStore::quantize(spelling.parse().unwrap(), &data, 3, 8),
                Err(KvQuantError::InvalidParameter {
                    name: "group size",
                    ..
                })
            ),
            "{spelling}"
        );
    }
    let store = KvStore::quantize(int4, &data, 3, 8).unwrap();
    let mut out = vec![0.0; 16];
    let mut scratch = kv_quant::DecodeScratch::new();
    assert!(matches!(
        store.decode_rows_into(2, 2, &mut out, &mut scratch),
        Err(KvQuantError::RowRange {
            start: 2,
            end: 4,
            tokens: 3
        })
    ));
    assert!(matches!(
        store.decode_rows_into(0, 1, &mut out, &mut scratch),
        Err(KvQuantError::ShapeMismatch { .. })
    ));
    assert!(store.decode_rows_into(0, 0, &mut [], &mut scratch).is_err());
    // An empty store is fine and decodes to nothing.
    let empty = KvStore::quantize(int4, &[], 0, 8).unwrap();
    assert_eq!(empty.stored_bytes(), 0);
    assert!(empty.decode().unwrap().values.is_empty());
}

/// Stored sizes follow from the packing rules and are counted from the
/// buffers: 128 tokens × 64 channels.
#[test]
fn stored_bytes_of_every_form() {
    let (t, c) = (128usize, 64usize);
    let data: Vec<f32> = (0..t * c)
        .map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0)
        .collect();
    let n = t * c;
    for (spelling, expected) in [
        ("fp32", 4 * n),
        ("fp16", 2 * n),
        ("bf16", 2 * n),
        ("fp8-e4m3", n + 4),
        ("fp8-e5m2-h32", n + 2 * 4),
        ("int8", n + t * 4),
        ("int8-sym-t", n + 2),
        ("int4", n / 2 + t * 4),
        ("int4-g32", n / 2 + t * 2 * 4),
        ("int4-ch", n / 2 + c * 4),
        ("int4-ch32-sf32", n / 2 + 4 * c * 8),
        ("int3", n * 3 / 8 + t * 4),
        ("int2-sym", n / 4 + t * 2),
        ("nf4", n / 2 + t * 2),
        ("int4+hamming74", n * 7 / 8 + t * 4 + 2 * t),
        // SECDED and Golay forms default to RM(2,5) metadata: two check
        // bytes per 16 bits of a word.
        ("int4+secded84", n + t * 4 + 2 * 2 * t),
        ("int4+secded84+meta-secded", n + t * 4 + 2 * t),
        ("int4+secded84+meta-none", n + t * 4),
        ("int4+golay24", t * 66 + t * 4 + 2 * 2 * t),
        ("int4+golay24+meta-secded", t * 66 + t * 4 + 2 * t),
        ("int4-sf32+golay24x8", t * 66 + t * 8 + 2 * 4 * t),
        ("int4-sf32+secded84", n + t * 8 + 2 * 4 * t),
        ("int4-sf32+secded84+meta-secded", n + t * 8 + 2 * t),
    ] {
        let form: CacheForm = spelling.parse().unwrap();
        let store = KvStore::quantize(form, &data, t, c).unwrap();
        assert_eq!(store.stored_bytes(), expected, "{spelling}");
        assert_eq!(store.bits_per_value(), 8.0 * expected as f64 / n as f64);
    }
}

#[test]
fn fp16_rows_are_the_stored_halves_with_the_decode_statistics() {
    let (tokens, channels) = (37, 19);
    let data: Vec<f32> = (0..tokens * channels)
        .map(|i| (i as f32 * 0.37).sin() * 3.0)
        .collect();
    let store = KvStore::quantize("fp16".parse().unwrap(), &data, tokens, channels).unwrap();
    let mut scratch = DecodeScratch::default();
    for (start, count) in [(0, 1), (5, 17), (0, 37), (36, 1)] {
        let (bytes, stats) = store.fp16_rows(start, count).unwrap().unwrap();
        let mut want = vec![0.0; count * channels];
        let want_stats = store
            .decode_rows_into(start, count, &mut want, &mut scratch)
            .unwrap();
        assert_eq!(stats, want_stats);
        let mut got = vec![f32::NAN; count * channels];
        kv_quant::widen_f16(bytes, &mut got);
        assert_eq!(got, want);
    }
    assert!(matches!(
        store.fp16_rows(30, 8),
        Err(KvQuantError::RowRange { .. })
    ));
    assert!(store.fp16_rows(3, 0).is_err());
    for form in ["fp32", "bf16", "int4", "fp8-e4m3"] {
        let other = KvStore::quantize(form.parse().unwrap(), &data, tokens, channels).unwrap();
        assert!(other.fp16_rows(0, 1).unwrap().is_none(), "{form}");
    }
}
