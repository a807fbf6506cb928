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
    approx::assert_abs_diff_eq!(f64::from(dot(&a, &b, true)), want, epsilon = 1e-5);
    approx::assert_abs_diff_eq!(f64::from(dot(&a, &b, false)), want, epsilon = 1e-5);
    assert_eq!(max(&a), a.iter().copied().fold(f32::MIN, f32::max));
    assert_eq!(max(&[]), f32::NEG_INFINITY);
}

/// A dot product in 16 lanes (element `i` in lane `i mod 16`) folded by
/// [`reduce`], each multiply-add fused or not.
fn dot(a: &[f32], b: &[f32], fma: bool) -> f32 {
    let mut lanes = [0.0f32; LANES];
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        let l = &mut lanes[i % LANES];
        *l = if fma { x.mul_add(*y, *l) } else { x * y + *l };
    }
    reduce(lanes)
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
            fused::attend_tile_avx2(tile, Some(keys), values, None, &mut scratch, &mut partial);
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
    let tile = fused::Tile {
        q,
        geometry,
        rows,
        upcoming: None,
        dot: isa.dot(),
    };
    fused::attend_tile_portable(tile, Some(keys), values, None, &mut scratch, &mut partial);
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
    view_of(store, rows, scratch, false)
}

/// The level view of a store's first `rows` rows, packed as
/// `decode_rows_view_packed` packs them where `packed`.
fn view_of<'s>(
    store: &'s kv_quant::KvStore,
    rows: usize,
    scratch: &'s mut kv_quant::DecodeScratch,
    packed: bool,
) -> kv_quant::LevelRows<'s> {
    let view = if packed {
        store.decode_rows_view_packed(0, rows, scratch)
    } else {
        store.decode_rows_view(0, rows, scratch)
    };
    match view.unwrap().0 {
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

/// The AVX2 width of `fused` reading level tiles in registers (every level map, groups
/// shared by 16 channels and one per channel, out-of-range levels and FP8
/// NaN codes among the values) gives the bits of the same kernel over the
/// rows dequantized by kv-quant, and of the AVX-512 kernel (the scalar
/// set's array lanes likewise against its own f32 rows); also with a
/// head dimension that is not a multiple of 16 (per-channel levels read
/// through the last chunk's partial loads, shared groups widened first).
#[test]
fn level_tiles_read_in_registers_match_their_f32_rows() {
    {
        let avx2 = Isa::Avx2.is_supported();
        if !avx2 {
            test_support::skip(
                test_support::Requirement::Isa,
                "attention",
                "level_tiles_read_in_registers_match_their_f32_rows",
                "no AVX2/FMA/F16C: only the scalar set's lanes are checked here",
            );
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
            // The scalar set's lanes read the same levels in their array.
            let scalar = |keys, values| run_tile(Isa::Scalar, geometry, &q, keys, values);
            let want = scalar(TileRows::F32(kf), TileRows::F32(vf));
            assert!(want.0.iter().any(|x| x.is_finite()), "{form}");
            assert_eq!(
                nan_blind(&scalar(TileRows::Levels(kl), TileRows::Levels(vl))),
                nan_blind(&want),
                "{form}: scalar"
            );
            if !avx2 {
                continue;
            }
            let want = run_tile(
                Isa::Avx2,
                geometry,
                &q,
                TileRows::F32(kf),
                TileRows::F32(vf),
            );
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

/// Every line of the next tile's keys and values is requested while a tile
/// is worked on, on every instruction set and kernel path (half-float
/// rows, integer scores and sums, levels read by the float kernels), and
/// the requests change no bit of the result; keys go first, during the
/// score pass (one float body for every set, so the scalar set too).
#[test]
fn every_path_requests_every_line_of_the_next_tile() {
    use std::collections::BTreeSet;

    let geometry = TileGeometry {
        group: 4,
        kv_heads: 2,
        d: 64,
    };
    let (rows, ch, heads) = (37, 128, 8);
    let q = test_values(5, heads * 64, 0.5);
    // The next tile's rows: two ranges of keys, one of values, in a real
    // buffer (a prefetch never faults, but the addresses are honest).
    let buffer = vec![0u8; 40_000];
    let base = buffer.as_ptr() as usize;
    let mut next = NextTile::default();
    next.keys.push(base..base + 5_000);
    next.keys.push(base + 8_192..base + 9_000);
    next.values.push(base + 20_000..base + 30_000);
    let lines = |side: &prefetch::Upcoming, out: &mut BTreeSet<usize>| {
        let mut p = Prefetcher::new(Some(side), 1);
        let ((), issued) = prefetch::issued::record(|| p.finish());
        out.extend(issued);
    };
    let (mut keys_lines, mut value_lines) = (BTreeSet::new(), BTreeSet::new());
    lines(&next.keys, &mut keys_lines);
    lines(&next.values, &mut value_lines);
    assert_eq!((keys_lines.len(), value_lines.len()), (79 + 13, 157));
    for form in ["fp16", "int4", "int8", "nf4", "int4-ch32"] {
        let store = |seed: u64| {
            let values = test_values(seed, rows * ch, 1.0);
            kv_quant::KvStore::quantize(form.parse().unwrap(), &values, rows, ch).unwrap()
        };
        let (ks, vs) = (store(1), store(2));
        let (mut kd, mut vd) = (
            kv_quant::DecodeScratch::new(),
            kv_quant::DecodeScratch::new(),
        );
        let (kt, vt) = match form {
            "fp16" => (
                TileRows::F16(ks.fp16_rows(0, rows).unwrap().unwrap().0),
                TileRows::F16(vs.fp16_rows(0, rows).unwrap().unwrap().0),
            ),
            _ => (
                TileRows::Levels(view_of(&ks, rows, &mut kd, true)),
                TileRows::Levels(view_of(&vs, rows, &mut vd, true)),
            ),
        };
        for isa in Isa::available() {
            for numerics in [Numerics::Exact, Numerics::Int8Query, Numerics::Auto] {
                let run = |upcoming: Option<&NextTile>| {
                    let mut scratch = KernelScratch::default();
                    let mut partial = Partial::new(heads, 64);
                    attend_tile(
                        &q,
                        kt,
                        vt,
                        geometry,
                        numerics,
                        isa,
                        upcoming,
                        &mut scratch,
                        &mut partial,
                    );
                    let (mut out, mut lse) = (vec![0.0f32; heads * 64], vec![0.0f32; heads]);
                    partial.finish(&mut out, &mut lse);
                    out.iter()
                        .chain(&lse)
                        .map(|x| x.to_bits())
                        .collect::<Vec<_>>()
                };
                let (with, order) = prefetch::issued::record(|| run(Some(&next)));
                assert_eq!(with, run(None), "{form} {isa} {numerics:?}: bits");
                let ctx = format!("{form} {isa} {numerics:?}");
                // Keys in the score pass, values in the value pass after it.
                let last_key = order.iter().rposition(|l| keys_lines.contains(l));
                let first_value = order.iter().position(|l| value_lines.contains(l));
                if let (Some(k), Some(v)) = (last_key, first_value) {
                    assert!(k < v, "{ctx}: a value line before a key line");
                }
                let issued: BTreeSet<usize> = order.into_iter().collect();
                assert!(value_lines.is_subset(&issued), "{ctx}: value lines");
                assert!(keys_lines.is_subset(&issued), "{ctx}: key lines");
                assert_eq!(issued.len(), keys_lines.len() + value_lines.len(), "{ctx}");
            }
        }
    }
}
