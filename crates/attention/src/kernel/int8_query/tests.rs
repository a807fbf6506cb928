//! Tests of the integer scores: the kernels' exact sums, the NF4 image,
//! and the same bits on every path.

use super::*;

/// The levels of an integer form's view (which never reads as values here).
fn level_view(view: kv_quant::RowsView<'_>) -> LevelRows<'_> {
    match view {
        kv_quant::RowsView::Levels(l) => l,
        kv_quant::RowsView::Values(_) => panic!("integer forms give levels"),
    }
}

/// The NF4 image is `128 + round(127·level)` in f64, every level is
/// within `NF4_IMAGE_ERROR` of its image, and that bound is tight to
/// 1e-4 (a looser constant would understate the path's accuracy).
#[test]
fn nf4_image_rounds_each_level_to_the_nearest_127th() {
    let mut worst = 0.0f64;
    for (c, (&level, &image)) in kv_quant::NF4_LEVELS.iter().zip(&NF4_IMAGE).enumerate() {
        let x = f64::from(level);
        assert_eq!(f64::from(image), 128.0 + (127.0 * x).round(), "code {c}");
        let err = (x - (f64::from(image) - 128.0) / 127.0).abs();
        worst = worst.max(err);
    }
    assert!(
        worst <= NF4_IMAGE_ERROR && worst > NF4_IMAGE_ERROR - 1e-4,
        "{worst}"
    );
    assert_eq!((NF4_IMAGE[0], NF4_IMAGE[7], NF4_IMAGE[15]), (1, 128, 255));
}

/// Integer sums of every kernel equal the reference loop, over segment
/// lengths that use full and masked 64-byte chunks, odd row counts and
/// every head count.
#[test]
fn every_dot_kernel_gives_the_exact_sums() {
    let dots = Dot::available();
    if dots.len() == 1 {
        test_support::skip(
            test_support::Requirement::Isa,
            "attention",
            "every_dot_kernel_gives_the_exact_sums",
            "neither AVX2 nor AVX-512 VNNI: only the portable integer sums were run",
        );
    }
    for (ch, start, len, rows, heads) in [
        (1024, 128, 128, 37, 4),
        (192, 64, 64, 5, 3),
        (300, 7, 201, 9, 2),
        (16, 0, 16, 1, 1),
        (130, 1, 129, 66, 4),
        // Blocks of sixteen rows (and the rows after them), every head count.
        (192, 64, 64, 35, 3),
        (192, 0, 64, 16, 1),
        (64, 0, 48, 33, 2),
        (256, 128, 128, 48, 4),
        // Heads of 64 channels or fewer, two rows a vector: 32 or fewer,
        // odd lengths and starts, one and four heads.
        (64, 5, 20, 9, 4),
        (64, 0, 33, 8, 1),
        (96, 32, 64, 12, 4),
        (40, 3, 31, 13, 2),
    ] {
        // Levels of every byte, and NF4 codes (nibbles) read through
        // their image.
        for image in [None, Some(&NF4_IMAGE)] {
            let levels: Vec<u8> = (0..rows * ch)
                .map(|i| (i * 37 % 256) as u8 & if image.is_some() { 15 } else { 255 })
                .collect();
            let codes: Vec<i8> = (0..4 * 256).map(|i| (i * 53 % 255 - 127) as i8).collect();
            let block = DotBlock {
                levels: &levels,
                packed: false,
                ch,
                start,
                len,
                codes: &codes,
                code_stride: 256,
                heads,
                rows,
                image,
                lane_weights: None,
            };
            let level = |l: u8| image.map_or(l, |m| m[usize::from(l)]);
            let mut want = vec![0; heads * rows];
            for t in 0..rows {
                for j in 0..heads {
                    want[j * rows + t] = (0..len)
                        .map(|c| {
                            i32::from(level(levels[t * ch + start + c]))
                                * i32::from(codes[j * 256 + c])
                        })
                        .sum();
                }
            }
            for &dot in &dots {
                let mut got = vec![0; heads * rows];
                integer_sums(dot, block, &mut got, &mut Prefetcher::new(None, 1));
                assert_eq!(
                    got,
                    want,
                    "{dot:?} at ch {ch}, start {start}, len {len}, image {}",
                    image.is_some()
                );
            }
        }
    }
}

/// Packed segments `(ch, start, len, rows, heads)` the kernels are checked
/// on: segments of whole blocks of 128, a last block of more and of fewer
/// than 64 channels, every head count, odd row counts.
pub(super) const PACKED_SEGMENTS: [(usize, usize, usize, usize, usize); 11] = [
    (1024, 128, 128, 37, 4),
    (192, 64, 64, 5, 3),
    (512, 0, 320, 9, 2),
    (200, 0, 200, 6, 4),
    (96, 0, 96, 17, 1),
    (64, 0, 48, 33, 2),
    (16, 0, 16, 1, 1),
    (384, 128, 256, 8, 3),
    // Heads of 64 channels or fewer (two rows a vector), one and four heads.
    (64, 0, 32, 8, 1),
    (128, 64, 64, 13, 4),
    (64, 0, 64, 20, 4),
];

/// Integer sums over levels packed two per byte, against split codes,
/// equal the sums over the same levels unpacked against the plain codes:
/// segments of whole blocks of 128, a last block of more and of fewer than
/// 64 channels, every head count, NF4 images, odd row counts.
#[test]
fn packed_levels_give_the_unpacked_sums() {
    let dots = Dot::available();
    for (ch, start, len, rows, heads) in PACKED_SEGMENTS {
        for image in [None, Some(&NF4_IMAGE)] {
            let levels: Vec<u8> = (0..rows * ch).map(|i| (i * 37 % 256) as u8 & 15).collect();
            let packed: Vec<u8> = levels.chunks_exact(2).map(|p| p[0] | p[1] << 4).collect();
            let codes: Vec<i8> = (0..4 * 512).map(|i| (i * 53 % 255 - 127) as i8).collect();
            let mut split = vec![0i8; 4 * 512];
            for j in 0..heads {
                let seg = j * 512;
                split_planes(&codes[seg..seg + len], &mut split[seg..seg + len]);
            }
            let plain = DotBlock {
                levels: &levels,
                packed: false,
                ch,
                start,
                len,
                codes: &codes,
                code_stride: 512,
                heads,
                rows,
                image,
                lane_weights: None,
            };
            let mut want = vec![0; heads * rows];
            integer_sums(
                Dot::Portable,
                plain,
                &mut want,
                &mut Prefetcher::new(None, 1),
            );
            let block = DotBlock {
                levels: &packed,
                packed: true,
                codes: &split,
                ..plain
            };
            for &dot in &dots {
                let mut got = vec![0; heads * rows];
                integer_sums(dot, block, &mut got, &mut Prefetcher::new(None, 1));
                assert_eq!(got, want, "{dot:?} at ch {ch}, start {start}, len {len}");
            }
        }
    }
}

/// `scores` gives the same bits on the portable path and with VNNI
/// (coding and finishing compiled for AVX-512 there), for both query
/// codings and every key layout it takes; and a scratch that served
/// another layout for the same query buffer gives what a fresh one does
/// (the cached query codes and segment sums are not stale).
#[test]
fn scores_are_the_same_bits_on_every_path_and_after_reuse() {
    if Dot::available().len() == 1 {
        test_support::skip(
            test_support::Requirement::Isa,
            "attention",
            "scores_are_the_same_bits_on_every_path_and_after_reuse",
            "neither AVX2 nor AVX-512 VNNI: the portable path is checked against itself after reuse only",
        );
    }
    let uniform = |seed, n| crate::kernel::test_values(seed, n, 1.0);
    let (group, kv_heads, d, rows) = (3, 2, 96, 37);
    let geometry = TileGeometry { group, kv_heads, d };
    let (ch, heads) = (kv_heads * d, kv_heads * group);
    let q = uniform(1, heads * d);
    let k = uniform(2, rows * ch);
    let forms = [
        "int4",
        "int4-g32",
        "int4-ch",
        "int8",
        "int4-sym-g64",
        "int4-g16",
        "nf4-g32",
        "nf4-g96",
    ];
    let stores: Vec<kv_quant::KvStore> = forms
        .iter()
        .map(|f| kv_quant::KvStore::quantize(f.parse().unwrap(), &k, rows, ch).unwrap())
        .collect();
    let scratch = || -> Vec<kv_quant::DecodeScratch> {
        forms
            .iter()
            .map(|_| kv_quant::DecodeScratch::new())
            .collect()
    };
    let (mut decodes, mut packed_decodes) = (scratch(), scratch());
    let levels: Vec<LevelRows<'_>> = stores
        .iter()
        .zip(decodes.iter_mut())
        .map(|(s, dec)| level_view(s.decode_rows_view(0, rows, dec).unwrap().0))
        .collect();
    // The 4-bit forms' levels as stored, two per byte.
    let packed: Vec<LevelRows<'_>> = stores
        .iter()
        .zip(packed_decodes.iter_mut())
        .map(|(s, dec)| level_view(s.decode_rows_view_packed(0, rows, dec).unwrap().0))
        .collect();
    let run = |levels: &LevelRows<'_>, codes, dot, scratch: &mut IntScratch| {
        let mut w = vec![f32::NAN; heads * rows];
        let mut prefetch = Prefetcher::new(None, 1);
        assert!(scores(
            &q,
            levels,
            geometry,
            codes,
            dot,
            scratch,
            &mut w,
            &mut prefetch
        ));
        w
    };
    for codes in [QueryCodes::Int8, QueryCodes::Int16] {
        let mut shared = IntScratch::default();
        for (form, levels) in forms.iter().zip(&levels) {
            if levels.map == LevelMap::Nf4 && codes == QueryCodes::Int16 {
                // Left to the exact path (see `scores`).
                let mut w = vec![0.0; heads * rows];
                let mut prefetch = Prefetcher::new(None, 1);
                let scratch = &mut shared;
                assert!(!scores(
                    &q,
                    levels,
                    geometry,
                    codes,
                    crate::Isa::detect().dot(),
                    scratch,
                    &mut w,
                    &mut prefetch
                ));
                continue;
            }
            let fresh = run(levels, codes, Dot::Portable, &mut IntScratch::default());
            let bits = |w: &[f32]| w.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            for dot in Dot::available() {
                let fast = run(levels, codes, dot, &mut IntScratch::default());
                assert_eq!(bits(&fresh), bits(&fast), "{form} {codes:?} {dot:?}");
            }
            let reused = run(levels, codes, crate::Isa::detect().dot(), &mut shared);
            assert_eq!(
                bits(&fresh),
                bits(&reused),
                "{form} {codes:?} after the others"
            );
        }
        // Packed levels are scored with int8 codes in segments of whole
        // heads (or blocks of 128 channels): the same bits as unpacked;
        // other codings and segments are left to the caller.
        for ((form, plain), packed) in forms.iter().zip(&levels).zip(&packed) {
            if packed.packing == kv_quant::LevelPacking::Bytes {
                assert!(*form == "int8", "{form} is read in place");
                continue;
            }
            let cpg = packed.channels_per_group();
            let whole_blocks = cpg == 1 || cpg % d == 0 || cpg % PLANE_BLOCK == 0;
            for dot in Dot::available() {
                let mut w = vec![0.0; heads * rows];
                let mut prefetch = Prefetcher::new(None, 1);
                let scratch = &mut shared;
                let taken = scores(
                    &q,
                    packed,
                    geometry,
                    codes,
                    dot,
                    scratch,
                    &mut w,
                    &mut prefetch,
                );
                assert_eq!(
                    taken,
                    codes == QueryCodes::Int8 && whole_blocks,
                    "{form} {codes:?}"
                );
                if taken {
                    // Per-channel keys take one scale per channel class
                    // when packed: the portable path of the packed view.
                    let reference = if cpg == 1 { packed } else { plain };
                    let want = run(reference, codes, Dot::Portable, &mut IntScratch::default());
                    let bits = |w: &[f32]| w.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&w), bits(&want), "{form} {dot:?} packed");
                }
            }
        }
    }
}

#[test]
fn quantized_queries_round_to_the_nearest_code() {
    let x = [0.5f32, -1.0, 0.25, 0.0];
    let (mut hi, mut lo) = ([0i8; 4], [0i8; 4]);
    let s = quantize(&x, QueryCodes::Int8, &mut hi, &mut lo).unwrap();
    assert_eq!(s, 1.0 / 127.0);
    assert_eq!(hi, [64, -127, 32, 0]);
    // 16-bit codes: 0.5·32639 = 16319.5 rounds to even, 16320 = 256·64 − 64.
    let s = quantize(&x, QueryCodes::Int16, &mut hi, &mut lo).unwrap();
    assert_eq!(s, 1.0 / 32639.0);
    let codes: Vec<i32> = hi
        .iter()
        .zip(&lo)
        .map(|(&h, &l)| 256 * i32::from(h) + i32::from(l))
        .collect();
    assert_eq!(codes, [16320, -32639, 8160, 0]);
    assert_eq!((hi[0], lo[0]), (64, -64));
    assert_eq!(
        quantize(&[0.0; 3], QueryCodes::Int8, &mut hi[..3], &mut lo[..3]),
        Some(0.0)
    );
    assert_eq!(
        quantize(
            &[1.0, f32::NAN],
            QueryCodes::Int8,
            &mut hi[..2],
            &mut lo[..2]
        ),
        None
    );
    assert_eq!(
        quantize(
            &[f32::INFINITY],
            QueryCodes::Int16,
            &mut hi[..1],
            &mut lo[..1]
        ),
        None
    );
}

#[test]
fn sixteen_bit_codes_split_into_int8_halves_exactly() {
    // Every code the quantizer can produce splits into halves in range.
    for c in -32639i32..=32639 {
        let high = (c + 128) >> 8;
        let low = c - 256 * high;
        assert!(
            (-128..=127).contains(&high) && (-128..=127).contains(&low),
            "{c}"
        );
    }
}

/// Packed keys are scored as they are only where every segment is whole
/// blocks of the split codes, which start at each head's first channel;
/// there the scores are the unpacked keys' bit for bit (per-channel keys,
/// coded by channel class when packed: the portable path's), and elsewhere
/// `scores` declines them (they are unpacked first). Groups of 128
/// channels qualify only where the head dimension is a multiple of 128.
#[test]
fn packed_keys_are_read_as_they_are_only_in_whole_blocks() {
    let cases = [
        // (group, kv_heads, d, form, read packed)
        (2, 4, 96, "int4", true),
        (2, 4, 96, "int4-ch", true),
        (2, 4, 96, "int4-g128", false),
        (2, 4, 96, "nf4-g128", false),
        (2, 4, 96, "int4-g192", true),
        (2, 4, 96, "int4-g64", false),
        (2, 2, 192, "int4-g128", false),
        (2, 2, 192, "int4-g64", false),
        (1, 2, 256, "int4-g128", true),
        (1, 2, 256, "nf4-g128", true),
        (3, 3, 64, "int4-g64", true),
        (3, 3, 64, "nf4", true),
    ];
    for (group, kv_heads, d, form, expect) in cases {
        let geometry = TileGeometry { group, kv_heads, d };
        let (ch, heads, rows) = (kv_heads * d, kv_heads * group, 21);
        let q = crate::kernel::test_values(1, heads * d, 1.0);
        let k = crate::kernel::test_values(2, rows * ch, 1.0);
        let store = kv_quant::KvStore::quantize(form.parse().unwrap(), &k, rows, ch).unwrap();
        let (mut a, mut b) = (
            kv_quant::DecodeScratch::new(),
            kv_quant::DecodeScratch::new(),
        );
        let plain = level_view(store.decode_rows_view(0, rows, &mut a).unwrap().0);
        let packed = level_view(store.decode_rows_view_packed(0, rows, &mut b).unwrap().0);
        assert_eq!(packed.packing, kv_quant::LevelPacking::Nibbles, "{form}");
        let reads = reads_packed(&packed, geometry, QueryCodes::Int8);
        assert_eq!(reads, expect, "{form} at d = {d}");
        assert!(
            !reads_packed(&packed, geometry, QueryCodes::Int16),
            "{form}"
        );
        let run = |levels: &LevelRows<'_>, dot| {
            let mut w = vec![f32::NAN; heads * rows];
            let taken = scores(
                &q,
                levels,
                geometry,
                QueryCodes::Int8,
                dot,
                &mut IntScratch::default(),
                &mut w,
                &mut Prefetcher::new(None, 1),
            );
            taken.then_some(w)
        };
        let want = run(&plain, Dot::Portable).expect("unpacked keys take the integer path");
        // Per-channel keys read packed take one scale per channel class:
        // their reference is the portable path of the packed view.
        let want = match packed.channels_per_group() {
            1 => run(&packed, Dot::Portable).expect("packed per-channel keys are taken"),
            _ => want,
        };
        let bits = |w: &[f32]| w.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for dot in Dot::available() {
            match run(&packed, dot) {
                Some(got) => {
                    assert!(expect, "{form} at d = {d}: read packed");
                    assert_eq!(bits(&got), bits(&want), "{form} at d = {d}, {dot:?}");
                }
                None => assert!(!expect, "{form} at d = {d}: declined"),
            }
        }
    }
}

/// Per-channel keys read in tiles shorter than their groups (each group's
/// codes coded by the first tile and reused by the next through one
/// scratch) score every row as the whole store in one tile does (whole
/// groups, coded afresh), and as a fresh scratch per tile does, on every
/// way this CPU runs: four query heads of 128 channels (folded together on
/// AVX-512) and three of 96 (one at a time).
#[test]
fn per_channel_codes_reused_across_tiles_give_the_whole_tile_bits() {
    for (group, kv_heads, d) in [(4, 2, 128), (3, 2, 96)] {
        let geometry = TileGeometry { group, kv_heads, d };
        let (ch, heads, rows, tile) = (kv_heads * d, kv_heads * group, 64, 16);
        let q = crate::kernel::test_values(7, heads * d, 1.0);
        let k = crate::kernel::test_values(8, rows * ch, 1.0);
        let store =
            kv_quant::KvStore::quantize("int4-ch32".parse().unwrap(), &k, rows, ch).unwrap();
        let mut decode = kv_quant::DecodeScratch::new();
        let all = level_view(
            store
                .decode_rows_view_packed(0, rows, &mut decode)
                .unwrap()
                .0,
        );
        assert_eq!(all.packing, kv_quant::LevelPacking::Nibbles);
        let run = |levels: &LevelRows<'_>, dot, scratch: &mut IntScratch| {
            let n = levels.rows();
            let mut w = vec![f32::NAN; heads * n];
            let mut prefetch = Prefetcher::new(None, 1);
            assert!(scores(
                &q,
                levels,
                geometry,
                QueryCodes::Int8,
                dot,
                scratch,
                &mut w,
                &mut prefetch
            ));
            w
        };
        let bits = |w: &[f32]| w.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for dot in Dot::available() {
            let whole = run(&all, dot, &mut IntScratch::default());
            let mut shared = IntScratch::default();
            for t0 in (0..rows).step_by(tile) {
                let part = all.sub_rows(t0, tile);
                let reused = run(&part, dot, &mut shared);
                let fresh = run(&part, dot, &mut IntScratch::default());
                assert_eq!(bits(&reused), bits(&fresh), "d {d} {dot:?} rows {t0}..");
                for h in 0..heads {
                    assert_eq!(
                        bits(&reused[h * tile..][..tile]),
                        bits(&whole[h * rows + t0..][..tile]),
                        "d {d} {dot:?} head {h} rows {t0}.."
                    );
                }
            }
        }
    }
}
