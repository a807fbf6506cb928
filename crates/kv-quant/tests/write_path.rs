//! The write path: [`RowEncoder`] over caller-provided buffers writes the
//! same bytes as whole-matrix quantization for every row-local form, checks
//! its buffers, and neither it nor a tile decode allocates once warm
//! (counted by a per-thread counting allocator).

use std::sync::Arc;

use kv_quant::{
    CacheForm, DecodeScratch, FitOptions, KvQuantError, KvStore, QuantizeOptions, RowBuffersMut,
    RowEncoder, VqCodebook,
};

use test_support::allocations;

#[global_allocator]
static GLOBAL: test_support::CountingAllocator = test_support::CountingAllocator;

fn data(tokens: usize, channels: usize) -> Vec<f32> {
    (0..tokens * channels)
        .map(|i| ((i as f32) * 0.731).sin() * (1.0 + (i % channels) as f32 * 0.02))
        .collect()
}

const FORMS: [&str; 20] = [
    "int4",
    "int4+secded84",
    "int4-g32+golay24+interp",
    "int4-sym-g64+hamming74",
    "int8",
    "int2-g16+secded84",
    "int3",
    "nf4+secded84",
    "fp8-e4m3-tok",
    "fp16",
    "fp16+golay24",
    "int4+rot",
    "lm4",
    "lm3+qjl+secded84",
    "int4-ch1",
    "vq-k16",
    "int4-g32+golay24+interp+meta-rm",
    "nf4-sf32+secded84+meta-rm",
    "int4+secded84x8+interp",
    "int8-g32+golay24x8",
];

fn codebook(form: &CacheForm, channels: usize) -> Option<Arc<VqCodebook>> {
    form.quantizer().needs_codebook().then(|| {
        let train = data(300, channels);
        Arc::new(VqCodebook::fit(form, &train, 300, channels, FitOptions::default()).unwrap())
    })
}

/// `x` quantized as one store (with its codebook when the form has one).
fn quantize_whole(
    form: CacheForm,
    x: &[f32],
    tokens: usize,
    channels: usize,
    cb: &Option<Arc<VqCodebook>>,
) -> KvStore {
    match cb {
        Some(cb) => KvStore::quantize_with_codebook(
            form,
            x,
            tokens,
            channels,
            QuantizeOptions::default(),
            cb.clone(),
        ),
        None => KvStore::quantize(form, x, tokens, channels),
    }
    .unwrap()
}

#[test]
fn encoder_bytes_equal_a_whole_quantization() {
    let (tokens, channels) = (9, 128);
    let x = data(tokens, channels);
    for spelling in FORMS {
        let form: CacheForm = spelling.parse().unwrap();
        let cb = codebook(&form, channels);
        let whole = quantize_whole(form, &x, tokens, channels, &cb);
        let mut encoder = RowEncoder::new(form, channels, cb).unwrap();
        let sizes = encoder.buffer_sizes(tokens);
        let (mut data, mut scales, mut offsets) = (
            vec![0u8; sizes.data],
            vec![0u8; sizes.scales],
            vec![0u8; sizes.offsets],
        );
        let (mut sc, mut oc) = (
            vec![0u8; sizes.scale_checks],
            vec![0u8; sizes.offset_checks],
        );
        // Two calls, rows 0..4 then 4..9.
        for (a, b) in [(0usize, 4usize), (4, 9)] {
            let s = encoder.buffer_sizes(1);
            encoder
                .encode_into(
                    &x[a * channels..b * channels],
                    RowBuffersMut {
                        data: &mut data[a * s.data..b * s.data],
                        scales: &mut scales[a * s.scales..b * s.scales],
                        offsets: &mut offsets[a * s.offsets..b * s.offsets],
                        scale_checks: &mut sc[a * s.scale_checks..b * s.scale_checks],
                        offset_checks: &mut oc[a * s.offset_checks..b * s.offset_checks],
                    },
                    QuantizeOptions::default(),
                )
                .unwrap();
        }
        assert_eq!(data, whole.data(), "{spelling}");
        assert_eq!(scales, whole.scales(), "{spelling}");
        assert_eq!(offsets, whole.offsets(), "{spelling}");
        let mut checks = sc.clone();
        checks.extend(&oc);
        assert_eq!(checks, whole.meta_checks(), "{spelling}");
    }
}

#[test]
fn encoder_buffers_and_forms_are_checked() {
    let form: CacheForm = "int4+secded84".parse().unwrap();
    let mut encoder = RowEncoder::new(form, 64, None).unwrap();
    let sizes = encoder.buffer_sizes(1);
    let (mut scales, mut offsets) = (vec![0u8; sizes.scales], vec![0u8; sizes.offsets]);
    let (mut sc, mut oc) = (
        vec![0u8; sizes.scale_checks],
        vec![0u8; sizes.offset_checks],
    );
    for (data_len, row, want) in [
        (sizes.data - 1, 0.5f32, "row bytes"),
        (sizes.data, f32::NAN, "non-finite"),
    ] {
        let mut data = vec![0u8; data_len];
        let out = RowBuffersMut {
            data: &mut data,
            scales: &mut scales,
            offsets: &mut offsets,
            scale_checks: &mut sc,
            offset_checks: &mut oc,
        };
        let e = encoder
            .encode_into(&[row; 64], out, QuantizeOptions::default())
            .unwrap_err();
        match want {
            "row bytes" => assert!(
                matches!(
                    e,
                    KvQuantError::ShapeMismatch {
                        what: "row bytes",
                        ..
                    }
                ),
                "{e}"
            ),
            _ => assert!(matches!(e, KvQuantError::NonFinite { .. }), "{e}"),
        }
    }
    for shared in ["int4-ch", "fp8-e4m3", "int4+sink4", "int4-ch32+win32"] {
        assert!(
            RowEncoder::new(shared.parse().unwrap(), 64, None).is_err(),
            "{shared}"
        );
    }
    assert!(matches!(
        RowEncoder::new("vq".parse().unwrap(), 64, None),
        Err(KvQuantError::Calibration { .. })
    ));
}

#[test]
fn writing_and_tile_decoding_do_not_allocate_once_warm() {
    let (tokens, channels) = (256, 192);
    let x = data(tokens, channels);
    for spelling in [
        "int4",
        "int4+secded84",
        "int4+secded84+interp",
        "lm4",
        "int8+golay24",
        "fp16",
    ] {
        let form: CacheForm = spelling.parse().unwrap();
        let mut store = KvStore::zeroed(form, tokens, channels).unwrap();
        let mut encoder = store.row_encoder().unwrap();
        let opts = QuantizeOptions::default();
        store
            .write_rows_with(&mut encoder, 0, &x[..channels], opts)
            .unwrap();
        let before = allocations();
        for t in 1..tokens {
            store
                .write_rows_with(&mut encoder, t, &x[t * channels..][..channels], opts)
                .unwrap();
        }
        assert_eq!(allocations(), before, "{spelling}: writing allocated");
        let mut scratch = DecodeScratch::new();
        let mut out = vec![0.0; 64 * channels];
        store
            .decode_rows_into(0, 64, &mut out, &mut scratch)
            .unwrap();
        let before = allocations();
        for start in (0..tokens).step_by(64) {
            store
                .decode_rows_into(start, 64, &mut out, &mut scratch)
                .unwrap();
        }
        assert_eq!(allocations(), before, "{spelling}: tile decoding allocated");
    }
}

#[test]
fn encoded_rows_commit_into_a_store_without_allocating() {
    let (tokens, channels) = (9, 128);
    let x = data(tokens, channels);
    for spelling in FORMS {
        let form: CacheForm = spelling.parse().unwrap();
        let cb = codebook(&form, channels);
        let whole = quantize_whole(form, &x, tokens, channels, &cb);
        let mut store = whole.clone();
        // Scribble over the store first, then commit every row again.
        let zero = vec![0.25f32; tokens * channels];
        store
            .write_rows(0, &zero, QuantizeOptions::default())
            .unwrap();
        assert_ne!(store, whole, "{spelling}");
        let mut encoder = RowEncoder::new(form, channels, cb).unwrap();
        let mut rows = kv_quant::RowBuffers::new(encoder.buffer_sizes(1));
        // Warm up, then count.
        encoder
            .encode_into(&x[..channels], rows.as_mut(), QuantizeOptions::default())
            .unwrap();
        let before = allocations();
        for t in 0..tokens {
            encoder
                .encode_into(
                    &x[t * channels..][..channels],
                    rows.as_mut(),
                    QuantizeOptions::default(),
                )
                .unwrap();
            store.put_encoded_rows(t, &rows).unwrap();
        }
        assert_eq!(allocations(), before, "{spelling} allocated");
        assert_eq!(store, whole, "{spelling}");
        // Rows past the store and buffers of another width are refused.
        assert!(matches!(
            store.put_encoded_rows(tokens, &rows),
            Err(KvQuantError::RowRange { .. })
        ));
        if let Ok(other) = RowEncoder::new(form, channels / 2, None) {
            let half = kv_quant::RowBuffers::new(other.buffer_sizes(1));
            assert!(store.put_encoded_rows(0, &half).is_err(), "{spelling}");
        }
    }
}

/// Every way rows reach a store (a whole quantization, `write_rows` one row
/// at a time, `put_encoded_rows`, `copy_rows_from`, `rows_to_store`,
/// `concat`, overwriting) keeps its parameter bound over every word written, so a
/// clean store never erases a group for lying outside it; the bound is the
/// exact range of the words written, and overwriting never narrows it.
#[test]
fn every_write_path_keeps_the_parameter_bound() {
    let (tokens, channels) = (9, 128);
    // Rows of magnitudes 1, 40 and 1/40: a bound of any one row is too narrow.
    let x: Vec<f32> = data(tokens, channels)
        .iter()
        .enumerate()
        .map(|(i, v)| v * [1.0, 40.0, 0.025][i / channels % 3])
        .collect();
    let clean = |store: &KvStore, what: &str| {
        let d = store.decode().unwrap();
        assert_eq!(d.stats.erased_values, 0, "{what}");
        d.values
    };
    for spelling in FORMS {
        let form: CacheForm = spelling.parse().unwrap();
        let cb = codebook(&form, channels);
        let whole = quantize_whole(form, &x, tokens, channels, &cb);
        let bound = whole.param_bound();
        let protected = !whole.meta_checks().is_empty();
        let groups = (0..).map_while(|g| whole.group_params(g));
        let (s, o) = groups.fold((0f32, 0f32), |(s, o), (a, b)| (s.max(a), o.max(b.abs())));
        let expect = if protected { (s, o) } else { (0.0, 0.0) };
        assert_eq!((bound.scale, bound.offset), expect, "{spelling}");
        let values = clean(&whole, spelling);

        let mut by_rows = KvStore::zeroed_with(form, tokens, channels, cb.clone()).unwrap();
        let mut encoder = RowEncoder::new(form, channels, cb.clone()).unwrap();
        let mut rows = kv_quant::RowBuffers::new(encoder.buffer_sizes(1));
        let mut committed = by_rows.clone();
        for t in (0..tokens).rev() {
            let row = &x[t * channels..][..channels];
            by_rows
                .write_rows(t, row, QuantizeOptions::default())
                .unwrap();
            encoder
                .encode_into(row, rows.as_mut(), QuantizeOptions::default())
                .unwrap();
            committed.put_encoded_rows(t, &rows).unwrap();
        }
        let mut copied = KvStore::zeroed_with(form, tokens, channels, cb.clone()).unwrap();
        copied.copy_rows_from(0, &whole).unwrap();
        for (store, what) in [
            (&by_rows, "write_rows"),
            (&committed, "put"),
            (&copied, "copy"),
        ] {
            assert_eq!(store.param_bound(), bound, "{spelling} {what}");
            assert_eq!(clean(store, what), values, "{spelling} {what}");
        }
        // Two parts concatenated: the whole's bytes, bound and values.
        let (head, tail) = (
            whole.rows_to_store(0, 4).unwrap(),
            quantize_whole(form, &x[4 * channels..], tokens - 4, channels, &cb),
        );
        let joined = head.concat(&tail).unwrap();
        assert_eq!(joined.data(), whole.data(), "{spelling}");
        assert_eq!(joined.scales(), whole.scales(), "{spelling}");
        assert_eq!(joined.offsets(), whole.offsets(), "{spelling}");
        assert_eq!(joined.meta_checks(), whole.meta_checks(), "{spelling}");
        assert_eq!(joined.param_bound(), bound, "{spelling}");
        assert_eq!(clean(&joined, "concat"), values, "{spelling}");
        // A part of the store keeps the whole's bound.
        let part = whole.rows_to_store(3, 3).unwrap();
        assert_eq!(part.param_bound(), bound, "{spelling}");
        assert_eq!(clean(&part, "part"), values[3 * channels..6 * channels]);
        // Overwriting the largest rows with small ones keeps the old bound.
        let small = vec![0.01f32; 3 * channels];
        by_rows
            .write_rows(0, &small, QuantizeOptions::default())
            .unwrap();
        assert_eq!(by_rows.param_bound(), bound, "{spelling}");
        clean(&by_rows, "overwritten");
    }
}

/// `concat` takes rows of the same row-local form, width and codebook only;
/// anything else is a typed error.
#[test]
fn concat_refuses_other_forms_widths_and_codebooks() {
    let x = data(8, 64);
    let q = |spelling: &str, channels: usize| {
        KvStore::quantize(spelling.parse().unwrap(), &x[..4 * channels], 4, channels).unwrap()
    };
    let mismatch = |r: Result<KvStore, KvQuantError>| {
        assert!(matches!(r, Err(KvQuantError::StoreMismatch(_))), "{r:?}");
    };
    mismatch(q("int4", 64).concat(&q("int8", 64)));
    mismatch(q("int4", 64).concat(&q("int4", 32)));
    // Per-channel groups share scales across tokens: not row-local.
    mismatch(q("int4-ch", 64).concat(&q("int4-ch", 64)));
    let form: CacheForm = "vq-k16".parse().unwrap();
    let (a, b) = (codebook(&form, 64), codebook(&form, 64));
    let with = |cb: &Option<Arc<VqCodebook>>| quantize_whole(form, &x[..4 * 64], 4, 64, cb);
    mismatch(with(&a).concat(&with(&b)));
    assert_eq!(with(&a).concat(&with(&a)).unwrap().tokens(), 8);
}
