//! Unit tests of the tile kernels: `exp` against libm, the fixed reductions
//! against f64 sums, and every instruction set against the others.

use super::*;

#[test]
fn exp_is_within_two_ulps_of_libm_on_its_domain() {
    for fma in [false, true] {
        let mut worst = 0.0f64;
        let mut x = 0.0f32;
        while x > -87.0 {
            let got = if fma { exp::<true>(x) } else { exp::<false>(x) };
            let want = f64::from(x).exp();
            let rel = ((f64::from(got) - want) / want).abs();
            worst = worst.max(rel);
            x -= 0.000_77;
        }
        assert!(worst < 2.5e-7, "fma={fma}: worst relative error {worst}");
    }
    assert_eq!(exp::<true>(0.0), 1.0);
    assert_eq!(exp::<true>(-88.0), 0.0);
    assert_eq!(exp::<false>(f32::NEG_INFINITY), 0.0);
    assert!(exp::<true>(f32::NAN).is_nan());
}

#[test]
fn fixed_reductions_match_f64_sums() {
    let a: Vec<f32> = (0..37).map(|i| (i as f32 * 0.31).sin()).collect();
    let b: Vec<f32> = (0..37).map(|i| (i as f32 * 0.17).cos()).collect();
    let want: f64 = a
        .iter()
        .zip(&b)
        .map(|(&x, &y)| f64::from(x) * f64::from(y))
        .sum();
    approx::assert_abs_diff_eq!(f64::from(dot::<true>(&a, &b)), want, epsilon = 1e-5);
    approx::assert_abs_diff_eq!(f64::from(dot::<false>(&a, &b)), want, epsilon = 1e-5);
    assert_eq!(max(&a), a.iter().copied().fold(f32::MIN, f32::max));
    assert_eq!(max(&[]), f32::NEG_INFINITY);
}

/// Runs one tile through one ISA variant, with the keys and the values
/// given as f32 or as half floats (`halves`), and returns the finished
/// output. The inputs are f16 values, so both spellings hold the same.
/// With `fused_avx2`, `Isa::Avx2` runs the AVX2 kernel that reads rows as
/// stored (`fused::avx2`) instead of the f32 body.
fn run(
    isa: Isa,
    geometry: TileGeometry,
    rows: usize,
    halves: (bool, bool),
    fused_avx2: bool,
) -> (Vec<f32>, Vec<f32>) {
    let heads = geometry.kv_heads * geometry.group;
    let (d, ch) = (geometry.d, geometry.kv_heads * geometry.d);
    let wave = |n: usize, f: f32| -> Vec<f32> {
        (0..n).map(|i| half_round((i as f32 * f).sin())).collect()
    };
    let (q, k, v) = (
        wave(heads * d, 0.37),
        wave(rows * ch, 0.11),
        wave(rows * ch, 0.23),
    );
    let (kh, vh) = (to_halves(&k), to_halves(&v));
    let keys = if halves.0 {
        TileRows::F16(&kh)
    } else {
        TileRows::F32(&k)
    };
    let values = if halves.1 {
        TileRows::F16(&vh)
    } else {
        TileRows::F32(&v)
    };
    let mut scratch = KernelScratch::default();
    scratch.weights.resize(heads * rows, 0.0);
    scratch.acc.resize(heads * d, 0.0);
    scratch.maxima.resize(heads, 0.0);
    scratch.sums.resize(heads, 0.0);
    let mut partial = Partial::new(heads, d);
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx2 && fused_avx2 {
        // SAFETY: the caller checked the features (and `d % 16 == 0`); the scratch is sized.
        unsafe {
            let tile = fused::Tile {
                q: &q,
                geometry,
                rows,
                upcoming: None,
            };
            fused::avx2::attend_tile_avx2(
                tile,
                Some(keys),
                values,
                None,
                &mut scratch,
                &mut partial,
            );
        }
        let (mut out, mut lse) = (vec![0.0; heads * d], vec![0.0; heads]);
        partial.finish(&mut out, &mut lse);
        return (out, lse);
    }
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512 {
        // SAFETY: the caller checked the features; the scratch is sized.
        unsafe {
            let tile = fused::Tile {
                q: &q,
                geometry,
                rows,
                upcoming: None,
            };
            fused::attend_tile_avx512(tile, Some(keys), values, None, &mut scratch, &mut partial)
        };
    }
    let mut wide = WideScratch::default();
    let (key_buffer, value_buffer) = wide.buffers();
    let args = TileArgs {
        q: &q,
        keys: Some(widen_rows(keys, key_buffer)),
        values,
        value_buffer,
        int_values: None,
        geometry,
        rows,
    };
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => {}
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the caller checked the features.
        Isa::Avx2 => unsafe { attend_tile_avx2(args, &mut scratch, &mut partial) },
        Isa::Generic => attend_tile_body::<false, GENERIC>(args, &mut scratch, &mut partial),
    }
    let (mut out, mut lse) = (vec![0.0; heads * d], vec![0.0; heads]);
    partial.finish(&mut out, &mut lse);
    (out, lse)
}

fn half_round(x: f32) -> f32 {
    let mut out = [0.0];
    kv_quant::widen_f16(&to_halves(&[x]), &mut out);
    out[0]
}

/// Little-endian IEEE halves of `x` (round to nearest even).
fn to_halves(x: &[f32]) -> Vec<u8> {
    let store = kv_quant::KvStore::quantize("fp16".parse().unwrap(), x, 1, x.len()).unwrap();
    store.data().to_vec()
}

#[test]
fn every_isa_variant_agrees() {
    // Head dims that use every register block (64, 32, 16) and the masked tail.
    for (group, kv_heads, d, rows) in [
        (4, 2, 128, 37),
        (3, 3, 64, 64),
        (2, 2, 48, 8),
        (1, 1, 64, 17),
        (5, 1, 117, 9),
        (1, 2, 3, 1),
        (7, 1, 80, 66),
    ] {
        let geometry = TileGeometry { group, kv_heads, d };
        let generic = run(Isa::Generic, geometry, rows, (false, false), false);
        assert_eq!(
            generic,
            run(Isa::Generic, geometry, rows, (true, true), false)
        );
        #[cfg(target_arch = "x86_64")]
        {
            let fma = is_x86_feature_detected!("fma");
            let avx2 = (fma && is_x86_feature_detected!("avx2"))
                .then(|| run(Isa::Avx2, geometry, rows, (false, false), false));
            if let Some(a) = &avx2 {
                assert_eq!(a, &run(Isa::Avx2, geometry, rows, (true, false), false));
                if d.is_multiple_of(16) && is_x86_feature_detected!("f16c") {
                    for halves in [(false, false), (true, true), (true, false), (false, true)] {
                        assert_eq!(
                            a,
                            &run(Isa::Avx2, geometry, rows, halves, true),
                            "AVX2 reading halves {halves:?} as stored at {geometry:?}"
                        );
                    }
                }
            }
            let avx512 = (isa() == Isa::Avx512).then(|| {
                let f32_rows = run(Isa::Avx512, geometry, rows, (false, false), false);
                for halves in [(true, true), (true, false), (false, true)] {
                    assert_eq!(
                        f32_rows,
                        run(Isa::Avx512, geometry, rows, halves, false),
                        "AVX-512 reading halves {halves:?} at {geometry:?}"
                    );
                }
                f32_rows
            });
            if let (Some(a), Some(b)) = (&avx2, &avx512) {
                assert_eq!(
                    a, b,
                    "AVX2 and AVX-512 must be bit-identical at {geometry:?}"
                );
            }
            for fused in avx2.iter().chain(&avx512) {
                for (x, y) in fused.0.iter().zip(&generic.0) {
                    approx::assert_abs_diff_eq!(x, y, epsilon = 1e-5);
                }
            }
            let skipped = match (&avx2, &avx512) {
                (None, None) => Some("no FMA/AVX2: only the generic path was run"),
                (Some(_), None) => {
                    Some("no AVX-512 F/BW/VL: AVX2 vs AVX-512 bit identity not checked")
                }
                (None, Some(_)) => Some("no AVX2: AVX2 vs AVX-512 bit identity not checked"),
                (Some(_), Some(_)) => None,
            };
            if let Some(reason) = skipped {
                test_support::skip(
                    test_support::Requirement::Isa,
                    "attention",
                    "every_isa_variant_agrees",
                    reason,
                );
            }
        }
        assert!(generic.0.iter().all(|x| x.is_finite()));
    }
}
