//! Tests of the integer value sums: the stated bound against f64, the
//! same bits on every path and packing, and the layouts refused.

use super::*;
use crate::kernel::test_values as uniform;
use kv_quant::KvStore;

/// [`weighted_sums`] with no next tile to prefetch.
fn sums(
    levels: &LevelRows<'_>,
    geometry: TileGeometry,
    weights: &[f32],
    acc: &mut [f32],
    dot: Dot,
    scratch: &mut ValueScratch,
) -> bool {
    let prefetch = &mut Prefetcher::new(None, 1);
    weighted_sums(levels, geometry, weights, acc, dot, scratch, prefetch)
}

fn levels_of<'s>(
    store: &'s KvStore,
    rows: usize,
    decode: &'s mut kv_quant::DecodeScratch,
) -> LevelRows<'s> {
    match store.decode_rows_view(0, rows, decode).unwrap().0 {
        kv_quant::RowsView::Levels(levels) => levels,
        kv_quant::RowsView::Values(_) => panic!("{} gives values", store.form()),
    }
}

/// Against the f64 sums of the decoded values, within the stated
/// bound `(S/2)·Σ_t l_tc` plus f32 rounding of the finishing; and the
/// VNNI sums equal the portable ones bit for bit.
#[test]
fn integer_value_sums_stay_within_the_stated_bound() {
    // (form, rows, rows skipped before the tile, geometry): per-channel
    // groups over blocks of tokens with tiles that start inside a block,
    // so runs start at odd rows.
    for (form, rows, skip, (group, kv_heads, d)) in [
        ("int4", 64, 0, (3, 3, 64)),
        ("int4-g32", 63, 0, (4, 2, 128)),
        ("int8", 17, 0, (2, 2, 96)),
        ("int4-sym-g64", 40, 0, (1, 2, 64)),
        ("int4-g16", 9, 0, (3, 2, 32)),
        ("int2", 5, 0, (2, 1, 64)),
        ("nf4-g64", 33, 0, (3, 2, 64)),
        ("nf4-g32", 16, 0, (2, 2, 128)),
        ("int4-ch16", 40, 0, (3, 2, 64)),
        ("int4-ch16", 37, 5, (2, 2, 64)),
        ("int8-ch32", 45, 3, (2, 2, 32)),
        ("int4-sym-ch16", 33, 1, (4, 1, 128)),
        ("int2-ch16", 16, 0, (1, 1, 64)),
    ] {
        let geometry = TileGeometry { group, kv_heads, d };
        let (ch, heads) = (kv_heads * d, kv_heads * group);
        let v = uniform(rows as u64, (skip + rows) * ch, 2.0);
        let store = KvStore::quantize(form.parse().unwrap(), &v, skip + rows, ch).unwrap();
        let decoded = store.decode().unwrap().values[skip * ch..].to_vec();
        let mut decode = kv_quant::DecodeScratch::new();
        let levels = levels_of(&store, skip + rows, &mut decode).sub_rows(skip, rows);
        assert!(takes(&levels, geometry), "{form}");
        // Softmax-like weights in (0, 1], one row of each head at 1.
        let weights: Vec<f32> = uniform(7, heads * rows, 1.0)
            .iter()
            .enumerate()
            .map(|(i, x)| {
                if i % rows == 3 % rows {
                    1.0
                } else {
                    (x.abs() * 4.0).exp() / 55.0
                }
            })
            .collect();
        let mut results = Vec::new();
        for dot in Dot::available() {
            let mut acc = vec![f32::NAN; heads * d];
            let mut scratch = ValueScratch::default();
            assert!(sums(
                &levels,
                geometry,
                &weights,
                &mut acc,
                dot,
                &mut scratch
            ));
            results.push(acc);
        }
        assert_eq!(
            results[0], results[1],
            "{form}: VNNI and portable sums differ"
        );
        // 4-bit levels as stored, two per byte: the same bits, in
        // segments of a multiple of 32 channels.
        let mut packed_decode = kv_quant::DecodeScratch::new();
        let packed = match store
            .decode_rows_view_packed(0, skip + rows, &mut packed_decode)
            .unwrap()
            .0
        {
            kv_quant::RowsView::Levels(levels) => levels.sub_rows(skip, rows),
            kv_quant::RowsView::Values(_) => panic!("{form} gives values"),
        };
        if packed.packing == LevelPacking::Nibbles {
            let whole = (levels.channels_per_group().is_multiple_of(32)
                || levels.channels_per_group() == 1)
                && d % 32 == 0;
            assert_eq!(takes(&packed, geometry), whole, "{form}");
            for dot in Dot::available().into_iter().filter(|_| whole) {
                let mut acc = vec![f32::NAN; heads * d];
                let mut scratch = ValueScratch::default();
                assert!(sums(
                    &packed,
                    geometry,
                    &weights,
                    &mut acc,
                    dot,
                    &mut scratch
                ));
                assert_eq!(acc, results[0], "{form}: packed {dot:?}");
            }
        } else {
            assert_ne!(levels.max_level(), 15, "4-bit {form} is read in place");
        }
        let cpg = levels.channels_per_group();
        // NF4: scale a/127 on the image's levels, each off its value by
        // the image's rounding.
        let nf4 = levels.map == LevelMap::Nf4;
        let unit = if nf4 { f64::from(NF4_UNIT) } else { 1.0 };
        let level = |l: u8| match nf4 {
            true => f64::from(NF4_IMAGE[usize::from(l)]),
            false => f64::from(l),
        };
        let image_error = |l: u8| match nf4 {
            true => (f64::from(kv_quant::NF4_LEVELS[usize::from(l)])
                - (level(l) - f64::from(NF4_MID)) / unit)
                .abs(),
            false => 0.0,
        };
        let max_level = if nf4 {
            255.0
        } else {
            f64::from(levels.max_level())
        };
        for h in 0..heads {
            let kvh = h / group;
            let w = &weights[h * rows..][..rows];
            for c in 0..d {
                let ch_c = kvh * d + c;
                let g = ch_c / cpg;
                let want: f64 = (0..rows)
                    .map(|t| f64::from(w[t]) * f64::from(decoded[t * ch + ch_c]))
                    .sum();
                let scale_of = |t: usize| f64::from(levels.scale[levels.group_index(t, 0) + g]);
                let s = (0..rows)
                    .map(|t| f64::from(w[t]) * scale_of(t) / unit)
                    .fold(0.0, f64::max)
                    / 32767.0;
                let level_sum: f64 = (0..rows).map(|t| level(levels.levels[t * ch + ch_c])).sum();
                // Per-channel groups code the weights alone: each row's
                // error is its block's scale times half a weight code.
                let (s, level_sum) = if cpg == 1 {
                    let s = w.iter().map(|&w| f64::from(w)).fold(0.0, f64::max) / 32767.0;
                    let scaled: f64 = (0..rows)
                        .map(|t| scale_of(t).abs() * level(levels.levels[t * ch + ch_c]))
                        .sum();
                    (s, scaled)
                } else {
                    (s, level_sum)
                };
                let image: f64 = (0..rows)
                    .map(|t| {
                        f64::from(w[t]) * scale_of(t) * image_error(levels.levels[t * ch + ch_c])
                    })
                    .sum();
                let magnitude: f64 = (0..rows)
                    .map(|t| f64::from(w[t]) * f64::from(decoded[t * ch + ch_c].abs()))
                    .sum::<f64>()
                    + s * rows as f64 * max_level;
                let allowed =
                    s / 2.0 * level_sum * (1.0 + 1e-6) + image * (1.0 + 1e-6) + 1e-6 * magnitude;
                if nf4 {
                    assert!(image > 0.0, "the NF4 image error was not counted");
                }
                let err = (f64::from(results[0][h * d + c]) - want).abs();
                assert!(
                    err <= allowed,
                    "{form}, head {h}, channel {c}: error {err:.3e} > {allowed:.3e}"
                );
            }
        }
    }
}

/// Layouts the pass does not take, and non-finite weights, return false.
#[test]
fn other_layouts_and_non_finite_weights_are_refused() {
    let geometry = TileGeometry {
        group: 2,
        kv_heads: 1,
        d: 64,
    };
    let v = uniform(3, 8 * 64, 1.0);
    for (form, taken) in [
        ("int4", true),
        ("int4-g8", false),
        ("int4-ch", false),
        ("nf4", true),
        ("nf4-g8", false),
        ("fp8-e4m3", false),
    ] {
        let store = KvStore::quantize(form.parse().unwrap(), &v, 8, 64).unwrap();
        let mut decode = kv_quant::DecodeScratch::new();
        let levels = levels_of(&store, 8, &mut decode);
        assert_eq!(takes(&levels, geometry), taken, "{form}");
        let mut acc = vec![0.0; 2 * 64];
        let mut weights = vec![0.5; 2 * 8];
        let mut scratch = ValueScratch::default();
        let ok = sums(
            &levels,
            geometry,
            &weights,
            &mut acc,
            crate::Isa::detect().dot(),
            &mut scratch,
        );
        assert_eq!(ok, taken, "{form}");
        weights[5] = f32::NAN;
        assert!(!sums(
            &levels,
            geometry,
            &weights,
            &mut acc,
            crate::Isa::detect().dot(),
            &mut scratch
        ));
    }
}

/// Flips the given bits of the buffer of the `call`-th call only (a
/// metadata injection calls the channel for scales, then offsets).
#[derive(Debug)]
struct FlipsInCall(usize, Vec<u64>, std::sync::atomic::AtomicUsize);

impl gf2_codes::channel::FaultChannel for FlipsInCall {
    fn inject_with(
        &self,
        data: &mut [u8],
        _rng: &mut gf2_codes::channel::FaultRng,
    ) -> gf2_codes::channel::Flips {
        let call = self.2.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let positions = if call == self.0 {
            self.1.clone()
        } else {
            Vec::new()
        };
        let flips = gf2_codes::channel::Flips::from_events(positions);
        flips.apply(data).unwrap();
        flips
    }
}

/// A negative scale (an unprotected f16 scale whose sign bit a fault
/// flipped) and products too small to scale are left to the f32 pass
/// on every instruction set, instead of coding out of range.
#[test]
fn negative_and_tiny_products_are_refused() {
    let geometry = TileGeometry {
        group: 2,
        kv_heads: 1,
        d: 64,
    };
    let weights = vec![0.5; 2 * 8];
    let v = uniform(4, 8 * 64, 1.0);
    let mut store = KvStore::quantize("int4".parse().unwrap(), &v, 8, 64).unwrap();
    let sign = FlipsInCall(0, vec![3 * 16 + 15], Default::default());
    store.inject(&sign, 0, kv_quant::FaultTarget::Metadata);
    let tiny: Vec<f32> = v.iter().map(|x| x * 1e-36).collect();
    let tiny = KvStore::quantize("int4-sf32".parse().unwrap(), &tiny, 8, 64).unwrap();
    for (store, what) in [(&store, "negative scale"), (&tiny, "tiny products")] {
        let mut decode = kv_quant::DecodeScratch::new();
        let levels = levels_of(store, 8, &mut decode);
        assert!(takes(&levels, geometry), "{what}");
        for dot in Dot::available() {
            let mut acc = vec![0.0; 2 * 64];
            let mut scratch = ValueScratch::default();
            let ok = sums(&levels, geometry, &weights, &mut acc, dot, &mut scratch);
            assert!(!ok, "{what}, {dot:?}: taken");
        }
    }
}

/// A scratch that served a longer tile with large weights gives a shorter
/// tile's sums the bits a fresh scratch gives: the rows past the shorter
/// tile (padding to whole lanes) read as zero weights, not as what the
/// longer tile left there. Per-token and per-channel values, every way
/// this CPU runs.
#[test]
fn a_reused_scratch_pads_shorter_tiles_with_zeros() {
    let geometry = TileGeometry {
        group: 2,
        kv_heads: 2,
        d: 64,
    };
    let (heads, ch) = (4, 128);
    for form in ["int4", "int4-ch16"] {
        for dot in Dot::available() {
            let mut shared = ValueScratch::default();
            for (rows, weight) in [(40, 30.0f32), (17, 0.25)] {
                let v = uniform(9, rows * ch, 1.0);
                let store = KvStore::quantize(form.parse().unwrap(), &v, rows, ch).unwrap();
                let mut decode = kv_quant::DecodeScratch::new();
                let levels = levels_of(&store, rows, &mut decode);
                let weights: Vec<f32> = (0..heads * rows)
                    .map(|i| weight * (1.0 + (i % 7) as f32))
                    .collect();
                let run = |scratch: &mut ValueScratch| {
                    let mut acc = vec![0.0f32; heads * 64];
                    assert!(sums(&levels, geometry, &weights, &mut acc, dot, scratch));
                    acc.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
                };
                assert_eq!(
                    run(&mut shared),
                    run(&mut ValueScratch::default()),
                    "{form} {dot:?} {rows} rows"
                );
            }
        }
    }
}
