//! Unit tests of the tile kernels: `exp` against libm, the fixed reductions
//! against f64 sums, and every instruction set against the others.

use super::*;
use crate::isa::Isa;

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
fn run(
    isa: Isa,
    geometry: TileGeometry,
    rows: usize,
    halves: (bool, bool),
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
    run_tile(isa, geometry, &q, keys, values)
}

/// One tile of `keys` and `values` through one ISA variant, returning the
/// finished output and log-sum-exp.
fn run_tile(
    isa: Isa,
    geometry: TileGeometry,
    q: &[f32],
    keys: TileRows<'_>,
    values: TileRows<'_>,
) -> (Vec<f32>, Vec<f32>) {
    let heads = geometry.kv_heads * geometry.group;
    let d = geometry.d;
    let rows = values.len() / (geometry.kv_heads * d);
    let mut scratch = KernelScratch::default();
    scratch.weights.resize(heads * rows, 0.0);
    scratch.acc.resize(heads * d, 0.0);
    scratch.maxima.resize(heads, 0.0);
    scratch.sums.resize(heads, 0.0);
    let mut partial = Partial::new(heads, d);
    let finish = |partial: Partial| {
        let (mut out, mut lse) = (vec![0.0; heads * d], vec![0.0; heads]);
        partial.finish(&mut out, &mut lse);
        (out, lse)
    };
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx2 {
        // SAFETY: the caller checked the features; the scratch is sized.
        unsafe {
            let tile = fused::Tile {
                q,
                geometry,
                rows,
                upcoming: None,
                dot: isa.dot(),
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
        return finish(partial);
    }
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512 {
        // SAFETY: the caller checked the features; the scratch is sized.
        unsafe {
            let tile = fused::Tile {
                q,
                geometry,
                rows,
                upcoming: None,
                dot: isa.dot(),
            };
            fused::attend_tile_avx512(tile, Some(keys), values, None, &mut scratch, &mut partial)
        };
        return finish(partial);
    }
    let mut wide = WideScratch::default();
    let (key_buffer, value_buffer) = wide.buffers();
    let args = TileArgs {
        q,
        keys: Some(widen_rows(keys, key_buffer)),
        values,
        value_buffer,
        int_values: None,
        geometry,
        rows,
        dot: isa.dot(),
        upcoming: None,
    };
    attend_tile_body(args, &mut scratch, &mut partial);
    finish(partial)
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
        // A tail of 12: both eight-lane halves of AVX2's partial chunk.
        (3, 2, 60, 13),
    ] {
        let geometry = TileGeometry { group, kv_heads, d };
        let generic = run(Isa::Scalar, geometry, rows, (false, false));
        assert_eq!(generic, run(Isa::Scalar, geometry, rows, (true, true)));
        #[cfg(target_arch = "x86_64")]
        {
            let avx2 = Isa::Avx2
                .is_supported()
                .then(|| run(Isa::Avx2, geometry, rows, (false, false)));
            if let Some(a) = &avx2 {
                for halves in [(true, true), (true, false), (false, true)] {
                    assert_eq!(
                        a,
                        &run(Isa::Avx2, geometry, rows, halves),
                        "AVX2 reading halves {halves:?} as stored at {geometry:?}"
                    );
                }
            }
            let avx512 = (Isa::Avx512.is_supported()).then(|| {
                let f32_rows = run(Isa::Avx512, geometry, rows, (false, false));
                for halves in [(true, true), (true, false), (false, true)] {
                    assert_eq!(
                        f32_rows,
                        run(Isa::Avx512, geometry, rows, halves),
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

/// The level view of a store's first `rows` rows, one level per byte.
fn levels_of<'s>(
    store: &'s kv_quant::KvStore,
    rows: usize,
    scratch: &'s mut kv_quant::DecodeScratch,
) -> kv_quant::LevelRows<'s> {
    match store.decode_rows_view(0, rows, scratch).unwrap().0 {
        kv_quant::RowsView::Levels(levels) => levels,
        kv_quant::RowsView::Values(_) => panic!("{} gives values", store.form()),
    }
}

/// The bits of every output and log-sum-exp, every NaN as one pattern
/// (which NaN payload an operation keeps is unspecified).
fn nan_blind(o: &(Vec<f32>, Vec<f32>)) -> Vec<u32> {
    let bits = |x: &f32| {
        if x.is_nan() {
            f32::NAN.to_bits()
        } else {
            x.to_bits()
        }
    };
    o.0.iter().chain(&o.1).map(bits).collect()
}

/// `fused::avx2` reading level tiles in registers (every level map, groups
/// shared by 16 channels and one per channel, out-of-range levels and FP8
/// NaN codes among the values) gives the bits of the same kernel over the
/// rows dequantized by kv-quant, and of the AVX-512 kernel; also with a
/// head dimension that is not a multiple of 16 (per-channel levels read
/// through the last chunk's partial loads, shared groups widened first).
#[test]
fn level_tiles_read_in_registers_match_their_f32_rows() {
    #[cfg(target_arch = "x86_64")]
    {
        if !Isa::Avx2.is_supported() {
            test_support::skip(
                test_support::Requirement::Isa,
                "attention",
                "level_tiles_read_in_registers_match_their_f32_rows",
                "no AVX2/FMA/F16C: the AVX2 tile kernel is not used here",
            );
            return;
        }
        let tails = TileGeometry {
            group: 2,
            kv_heads: 4,
            d: 40,
        };
        // Read in registers through the last chunk's partial loads
        // (whole-row, per-channel and two-head groups, every map), or
        // widened first (groups of 40 or 32 channels).
        let tail_forms = [
            "int8",
            "int8-sym",
            "int4-ch",
            "int4-ch32",
            "int8-sym-ch",
            "int4-g80",
            "int4-g40",
            "int4-g32",
            "nf4-g1",
            "fp8-e4m3",
            "fp8-e5m2-h1",
            "lm4+rot8",
        ];
        let heads64 = [
            "int8",
            "int4-ch",
            // Per-channel groups over blocks of 32 tokens: the 37 rows span
            // two blocks, so each row's group is found by division.
            "int4-ch32",
            "int8-sym-ch",
            "int4-sym-g64",
            "int4-g32",
            "nf4-g64",
            "nf4-g1",
            "fp8-e4m3",
            "fp8-e4m3-h1",
            "fp8-e5m2-h64",
            "fp8-e5m2-h1",
            // Lloyd-Max codebooks (rotated coordinates: the tile is what
            // the store holds), one 16-entry lookup per lane.
            "lm4",
            "lm3",
            "lm2",
        ];
        let geometry64 = TileGeometry {
            group: 3,
            kv_heads: 2,
            d: 64,
        };
        let cases = heads64
            .iter()
            .map(|&f| (f, geometry64))
            .chain(tail_forms.iter().map(|&f| (f, tails)));
        for (form, geometry) in cases {
            let rows = 37;
            let ch = geometry.kv_heads * geometry.d;
            let q = test_values(3, geometry.kv_heads * geometry.group * geometry.d, 0.5);
            let quantize = |seed: u64, scale: f32| {
                let values = test_values(seed, rows * ch, scale);
                kv_quant::KvStore::quantize(form.parse().unwrap(), &values, rows, ch).unwrap()
            };
            let (ks, vs) = (quantize(1, 2.0), quantize(2, 1.0));
            let (mut kd, mut vd) = (
                kv_quant::DecodeScratch::new(),
                kv_quant::DecodeScratch::new(),
            );
            let kl = levels_of(&ks, rows, &mut kd);
            let vl = levels_of(&vs, rows, &mut vd);
            assert_eq!(kl.packing, kv_quant::LevelPacking::Bytes, "{form}");
            // Two value bytes out of a writer's range: E4M3's NaN codes.
            // (A Lloyd-Max code is `bits` wide as stored, so its levels
            // never leave the codebook.)
            let mut bytes = vl.levels.to_vec();
            if !form.starts_with("lm") {
                bytes[5] = 0x7F;
                bytes[ch + 70] = 0xFF;
                // In the last (partial) chunk of head 0 where heads have
                // 40 channels.
                bytes[2 * ch + 37] = 0x7F;
            }
            let mut vl = vl;
            vl.levels = &bytes;
            let (mut kw, mut vw) = (Vec::new(), Vec::new());
            let (kf, vf) = (
                widen_rows(TileRows::Levels(kl), &mut kw),
                widen_rows(TileRows::Levels(vl), &mut vw),
            );
            let want = run_tile(
                Isa::Avx2,
                geometry,
                &q,
                TileRows::F32(kf),
                TileRows::F32(vf),
            );
            assert!(want.0.iter().any(|x| x.is_finite()), "{form}");
            let got = run_tile(
                Isa::Avx2,
                geometry,
                &q,
                TileRows::Levels(kl),
                TileRows::Levels(vl),
            );
            assert_eq!(nan_blind(&got), nan_blind(&want), "{form}");
            if Isa::Avx512.is_supported() {
                let avx512 = run_tile(
                    Isa::Avx512,
                    geometry,
                    &q,
                    TileRows::Levels(kl),
                    TileRows::Levels(vl),
                );
                assert_eq!(nan_blind(&avx512), nan_blind(&want), "{form}: AVX-512");
            }
        }
    }
}
