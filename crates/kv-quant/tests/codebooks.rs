//! Vector-quantized forms (`vq`): they need a fitted codebook of their
//! shape, decode every group to a gain times a centroid, beat scalar
//! codebooks of the same bits on correlated data, and count their bytes.

use std::sync::Arc;

use gf2_codes::channel::FaultRng;
use kv_quant::{
    CacheForm, FitOptions, Hadamard, KvQuantError, KvStore, NonFinite, QuantizeOptions, VqCodebook,
};

fn form(s: &str) -> CacheForm {
    s.parse().unwrap()
}

/// Rows with strongly correlated neighbouring rotated coordinates: pairs of
/// channels that move together, which a vector codebook can exploit.
fn correlated(tokens: usize, channels: usize, seed: u64) -> Vec<f32> {
    let mut rng = FaultRng::new(seed);
    let mut normal = || {
        let (u1, u2) = (1.0 - rng.next_f64(), rng.next_f64());
        ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
    };
    let h = Hadamard::of(64).unwrap();
    let mut data = Vec::with_capacity(tokens * channels);
    for _ in 0..tokens {
        let mut row: Vec<f32> = Vec::with_capacity(channels);
        for _ in 0..channels / 4 {
            let a = normal();
            let b = normal();
            row.extend([a, 0.9 * a + 0.1 * b, b, 0.8 * b - 0.2 * a]);
        }
        // Correlated in rotated coordinates: store the unrotated rows.
        h.unrotate(&mut row);
        data.extend(row);
    }
    data
}

/// `data` coded in `form` against `codebook`.
fn coded(form: CacheForm, data: &[f32], channels: usize, codebook: Arc<VqCodebook>) -> KvStore {
    let tokens = data.len() / channels;
    KvStore::quantize_with_codebook(
        form,
        data,
        tokens,
        channels,
        QuantizeOptions::default(),
        codebook,
    )
    .unwrap()
}

fn mse(a: &[f32], b: &[f32]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| f64::from(x - y).powi(2))
        .sum::<f64>()
        / a.len() as f64
}

#[test]
fn vq_needs_a_codebook_of_its_shape() {
    let (tokens, channels) = (300, 128);
    let data = correlated(tokens, channels, 1);
    let e = KvStore::quantize(form("vq"), &data, tokens, channels).unwrap_err();
    assert!(matches!(e, KvQuantError::Calibration { .. }), "{e}");
    assert!(e.to_string().contains("VqCodebook::fit"), "{e}");
    let cb = VqCodebook::fit(
        &form("vq-k16"),
        &data,
        tokens,
        channels,
        FitOptions::default(),
    )
    .unwrap();
    let wrong = KvStore::quantize_with_codebook(
        form("vq"),
        &data,
        tokens,
        channels,
        QuantizeOptions::default(),
        Arc::new(cb.clone()),
    )
    .unwrap_err();
    assert!(matches!(wrong, KvQuantError::Calibration { .. }), "{wrong}");
    let narrow = KvStore::quantize_with_codebook(
        form("vq-k16"),
        &data[..64 * tokens],
        tokens,
        64,
        QuantizeOptions::default(),
        Arc::new(cb),
    )
    .unwrap_err();
    assert!(
        matches!(narrow, KvQuantError::Calibration { .. }),
        "{narrow}"
    );
}

#[test]
fn vq_decodes_gain_times_centroid_and_beats_scalar_codes_of_equal_bits() {
    let (tokens, channels) = (1024, 128);
    let train = correlated(tokens, channels, 2);
    let test = correlated(256, channels, 3);
    let f = form("vq");
    let cb =
        Arc::new(VqCodebook::fit(&f, &train, tokens, channels, FitOptions::default()).unwrap());
    let store = coded(f, &test, channels, cb.clone());
    // 8-bit indices per 4 values, an f16 gain per 64-channel block and token.
    assert_eq!(
        store.stored_bytes(),
        256 * (channels / 4 + 2 * channels / 64)
    );
    assert_eq!(cb.stored_bytes(), 2 * 256 * 4 * 2);
    let expected_bits =
        8.0 * (store.stored_bytes() + cb.stored_bytes()) as f64 / (256 * channels) as f64;
    approx::assert_abs_diff_eq!(store.bits_per_value(), expected_bits, epsilon = 1e-12);
    // Decoded rotated rows are gain × centroid, group by group.
    let mut rotated = vec![0.0; channels];
    store
        .decode_rows_rotated_into(7, 1, &mut rotated, &mut Default::default())
        .unwrap();
    let data = store.data();
    for blk in 0..2 {
        let (gain, _) = store.group_params(7 * 2 + blk).unwrap();
        for g in 0..16 {
            let idx = data[7 * 32 + blk * 16 + g];
            let c = cb.centroid(blk, idx);
            for j in 0..4 {
                assert_eq!(rotated[blk * 64 + g * 4 + j], gain * c[j]);
            }
        }
    }
    // Against a 2-bit scalar Lloyd-Max code of the same rotated rows.
    let vq = mse(&store.decode().unwrap().values, &test);
    let lm = KvStore::quantize(form("lm2"), &test, 256, channels).unwrap();
    let lm = mse(&lm.decode().unwrap().values, &test);
    assert!(vq < 0.8 * lm, "vq {vq} vs lm2 {lm}");
}

#[test]
fn vq_rows_written_one_at_a_time_equal_a_whole_quantization() {
    let (tokens, channels) = (300, 64);
    let data = correlated(tokens, channels, 4);
    let f = form("vq-d2-k16+secded84");
    let cb = Arc::new(VqCodebook::fit(&f, &data, tokens, channels, FitOptions::default()).unwrap());
    let whole = coded(f, &data, channels, cb.clone());
    let mut rows = KvStore::zeroed_with(f, tokens, channels, Some(cb)).unwrap();
    for t in (0..tokens).rev() {
        rows.write_rows(
            t,
            &data[t * channels..][..channels],
            QuantizeOptions::default(),
        )
        .unwrap();
    }
    assert_eq!(rows, whole);
}

/// Unrotated rows whose groups of two channels each move along their own
/// direction (`(a, s_g·a)` plus a little noise, `s_g` per group): what a
/// codebook per group learns and one codebook shared by a rotated block
/// cannot.
fn coupled(tokens: usize, channels: usize, seed: u64) -> Vec<f32> {
    let mut rng = FaultRng::new(seed);
    let mut normal = || {
        let (u1, u2) = (1.0 - rng.next_f64(), rng.next_f64());
        ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
    };
    let mut data = Vec::with_capacity(tokens * channels);
    for _ in 0..tokens {
        for g in 0..channels / 2 {
            let s = 2.0 * (g as f32 * 0.7).sin();
            let a = normal() * (1.0 + (g % 5) as f32);
            data.extend([a, s * a + 0.05 * normal()]);
        }
    }
    data
}

#[test]
fn cq_codes_each_group_on_its_own_codebook() {
    let (tokens, channels) = (2048, 64);
    let train = coupled(tokens, channels, 5);
    let test = coupled(256, channels, 6);
    let f = form("cq-d2-k16");
    assert_eq!(f.rotation(), None, "cq codes the channels as they are");
    let cb =
        Arc::new(VqCodebook::fit(&f, &train, tokens, channels, FitOptions::default()).unwrap());
    assert_eq!((cb.codebooks(), cb.block()), (channels / 2, channels));
    assert_eq!(cb.stored_bytes(), channels / 2 * 16 * 2 * 2);
    let store = coded(f, &test, channels, cb.clone());
    // A 4-bit index per two values and one f16 gain per row.
    assert_eq!(store.stored_bytes(), 256 * (channels / 4 + 2));
    // Decoded rows are the row's gain times each group's own centroid.
    let decoded = store.decode().unwrap().values;
    // Two 4-bit indices a byte, the first in the low nibble.
    let indices: Vec<u8> = store.data()[9 * channels / 4..][..channels / 4]
        .iter()
        .flat_map(|b| [b & 0xF, b >> 4])
        .collect();
    let (gain, _) = store.group_params(9).unwrap();
    assert_ne!(cb.centroid(0, 0), cb.centroid(1, 0), "groups fit apart");
    for (g, &idx) in indices.iter().enumerate() {
        assert_eq!(cb.codebook_of(0, g), g, "group g reads codebook g");
        let c = cb.centroid(g, idx);
        for j in 0..2 {
            assert_eq!(decoded[9 * channels + 2 * g + j], gain * c[j]);
        }
    }
    // One codebook per group beats one shared per rotated block of the
    // same bits on data whose groups differ.
    let cq = mse(&decoded, &test);
    let shared = form("vq-d2-k16");
    let shared_cb = VqCodebook::fit(&shared, &train, tokens, channels, FitOptions::default());
    let vq = coded(shared, &test, channels, Arc::new(shared_cb.unwrap()));
    let vq = mse(&vq.decode().unwrap().values, &test);
    assert!(cq < 0.5 * vq, "cq {cq} vs vq {vq}");
    // A gain per 32 channels (`-g32`): the same codebooks per group, two
    // gains a row; group g of the second block reads codebook 16 + g.
    let halves = form("cq-d2-k16-g32");
    let cb32 = Arc::new(
        VqCodebook::fit(&halves, &train, tokens, channels, FitOptions::default()).unwrap(),
    );
    assert_eq!((cb32.codebooks(), cb32.block()), (channels / 2, 32));
    assert_eq!(cb32.codebook_of(1, 3), 16 + 3);
    let store32 = coded(halves, &test, channels, cb32.clone());
    assert_eq!(store32.stored_bytes(), 256 * (channels / 4 + 2 * 2));
    let decoded32 = store32.decode().unwrap().values;
    let (gain, _) = store32.group_params(9 * 2 + 1).unwrap();
    let byte = store32.data()[9 * channels / 4 + 8 + 1];
    let c = cb32.centroid(16 + 2, byte & 0xF);
    assert_eq!(decoded32[9 * channels + 32 + 4], gain * c[0]);
    // Written a row at a time under a code, the same store.
    let protected = form("cq-d2-k16+secded84");
    let whole = coded(protected, &test, channels, cb.clone());
    let mut rows = KvStore::zeroed_with(protected, 256, channels, Some(cb.clone())).unwrap();
    for t in 0..256 {
        let row = &test[t * channels..][..channels];
        rows.write_rows(t, row, QuantizeOptions::default()).unwrap();
    }
    assert_eq!(rows, whole);
}

#[test]
fn cq_refuses_rotation_and_other_shapes() {
    let e = "cq+rot".parse::<CacheForm>().unwrap_err().to_string();
    assert!(e.contains("takes no +rot"), "{e}");
    let e = "cq-x3".parse::<CacheForm>().unwrap_err().to_string();
    assert!(e.contains("unknown cq option"), "{e}");
    let e = "vq-g64".parse::<CacheForm>().unwrap_err().to_string();
    assert!(e.contains("unknown vq option"), "{e}");
    let e = "cq-d4-g6".parse::<CacheForm>().unwrap_err().to_string();
    assert!(e.contains("not whole codes of 4"), "{e}");
    // Codes before RoPE are codes of rotated pairs: cq-d2 only.
    for bad in ["cq-d4-pre", "cq-d1-k4-pre"] {
        let e = bad.parse::<CacheForm>().unwrap_err().to_string();
        assert!(e.contains("spell it with cq-d2"), "{bad}: {e}");
    }
    let e = "vq-d2-pre".parse::<CacheForm>().unwrap_err().to_string();
    assert!(e.contains("unknown vq option"), "{e}");
    let pre: CacheForm = "cq-d2-k16-g32-pre+sink4".parse().unwrap();
    assert_eq!(pre.to_string(), "cq-d2-k16-g32-pre+sink4");
    // A vq spec built with a gain block of its own (no spelling reaches it).
    let spec = kv_quant::VqSpec {
        dim: 4,
        centroids: 16,
        scale: kv_quant::ScaleType::F16,
        coupled: false,
        gain_block: Some(64),
        pre_rope: false,
    };
    let e = CacheForm::new(kv_quant::Quantizer::Vq(spec), None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("only cq"), "{e}");
    let data = coupled(300, 64, 7);
    let cb = VqCodebook::fit(&form("cq-d2-k16"), &data, 300, 64, FitOptions::default()).unwrap();
    assert!(cb.check_fits(&form("cq-d2-k16"), 64).is_ok());
    // A vq codebook of the same dim and size, other channels, another dim.
    for (other, channels) in [("vq-d2-k16", 64), ("cq-d2-k16", 128), ("cq-d4-k16", 64)] {
        assert!(matches!(
            cb.check_fits(&form(other), channels),
            Err(KvQuantError::Calibration { .. })
        ));
    }
    // Where only the kind differs (one group, one rotated block of 8
    // channels: the same counts), the kinds still do not mix.
    let rows8 = coupled(300, 8, 8);
    let cq8 = VqCodebook::fit(&form("cq-d8-k16"), &rows8, 300, 8, FitOptions::default()).unwrap();
    let vq8 = VqCodebook::fit(
        &form("vq-d8-k16+rot8"),
        &rows8,
        300,
        8,
        FitOptions::default(),
    )
    .unwrap();
    assert_eq!(
        (cq8.codebooks(), cq8.block()),
        (vq8.codebooks(), vq8.block())
    );
    for (cb, other) in [(&cq8, "vq-d8-k16+rot8"), (&vq8, "cq-d8-k16")] {
        assert!(matches!(
            cb.check_fits(&form(other), 8),
            Err(KvQuantError::Calibration { .. })
        ));
    }
    // Gain blocks that do not divide the rows: refused by the fit and by a
    // store given a codebook of another width.
    let e = VqCodebook::fit(
        &form("cq-d2-k16-g48"),
        &data,
        300,
        64,
        FitOptions::default(),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("not whole gain blocks of 48"), "{e}");
    assert!(
        KvStore::zeroed_with(form("cq-d2-k16-g48"), 4, 64, Some(Arc::new(cb.clone()))).is_err()
    );
    // Channels that are not whole groups.
    assert!(
        VqCodebook::fit(
            &form("cq-d4-k16"),
            &data[..6 * 300],
            300,
            6,
            FitOptions::default()
        )
        .is_err()
    );
}

/// A cq row a fault upstream made non-finite or huge: refused under
/// `NonFinite::Reject`; under `Clamp` saturated as a rotated block is
/// (NaN to 0, ±∞ to the row's largest finite magnitude) and its gain held
/// at f16's largest, so the fault's outcome is measured, not fatal.
#[test]
fn cq_rows_a_fault_made_non_finite_saturate_under_clamp() {
    let channels = 64;
    let f = form("cq-d2-k16");
    let train = coupled(1024, channels, 5);
    let cb = Arc::new(VqCodebook::fit(&f, &train, 1024, channels, FitOptions::default()).unwrap());
    let mut rows = coupled(3, channels, 8);
    rows[3] = f32::NAN;
    rows[channels + 5] = f32::INFINITY;
    for x in &mut rows[2 * channels..] {
        *x *= 1e30;
    }
    let quantize = |non_finite| {
        let options = QuantizeOptions { non_finite };
        KvStore::quantize_with_codebook(f, &rows, 3, channels, options, cb.clone())
    };
    assert!(matches!(
        quantize(NonFinite::Reject),
        Err(KvQuantError::NonFinite {
            token: 0,
            channel: 3,
            ..
        })
    ));
    let store = quantize(NonFinite::Clamp).unwrap();
    let decoded = store.decode().unwrap().values;
    assert!(decoded.iter().all(|x| x.is_finite()));
    // The huge row's gain saturates at f16's largest finite value.
    let (gain, _) = store.group_params(2).unwrap();
    assert_eq!(gain.abs(), 65504.0);
}

/// `decode_vq_codes` stops where the decode looks codes up: every value
/// it describes is the decode's, bit for bit, with the decode's
/// statistics, faults included; rows it cannot describe are `None`.
#[test]
fn cq_codes_read_as_codes_and_gains_are_the_decoded_rows() {
    use kv_quant::{DecodeScratch, FaultTarget};
    let (tokens, channels) = (1024, 64);
    let train = coupled(tokens, channels, 11);
    let test = coupled(96, channels, 12);
    let channel = gf2_codes::channel::BinarySymmetric::new(2e-3).unwrap();
    for (spelling, fault) in [
        ("cq-d2-k16", false),
        ("cq-d2-k16-g32", false),
        ("cq", false),
        ("cq-d2-k16+secded84", true),
        ("cq-d2-k16+sink4", false),
    ] {
        let f = form(spelling);
        let base = f.with_segments(Default::default()).unwrap();
        let cb = Arc::new(
            VqCodebook::fit(&base, &train, tokens, channels, FitOptions::default()).unwrap(),
        );
        let mut store = coded(f, &test, channels, cb);
        if fault {
            store.inject(&channel, 3, FaultTarget::Everything);
        }
        let sink = f.segments().sink;
        let (mut a, mut b) = (DecodeScratch::new(), DecodeScratch::new());
        let mut described = 0;
        for (start, count) in [(0, 96), (sink, 16), (40, 7), (95, 1)] {
            let mut rows = vec![0f32; count * channels];
            let decoded = store
                .decode_rows_into(start, count, &mut rows, &mut a)
                .unwrap();
            let Some((codes, stats)) = store.decode_vq_codes(start, count, &mut b).unwrap() else {
                assert!(
                    start < sink || decoded.erased_values > 0,
                    "{spelling}: rows {start}+{count} not described"
                );
                continue;
            };
            described += 1;
            assert_eq!(stats, decoded, "{spelling}");
            assert_eq!((codes.rows(), codes.channels()), (count, channels));
            for r in 0..count {
                for c in 0..channels {
                    let (got, want) = (codes.value(r, c), rows[r * channels + c]);
                    assert_eq!(got.to_bits(), want.to_bits(), "{spelling} row {r} ch {c}");
                }
            }
        }
        assert!(described >= 3, "{spelling}: {described}");
    }
    // Forms that are not coupled codebooks are not described.
    let ints = KvStore::quantize(form("int4"), &test, 96, channels).unwrap();
    let mut scratch = DecodeScratch::new();
    assert!(ints.decode_vq_codes(0, 8, &mut scratch).unwrap().is_none());
    let vq = form("vq-d2-k16");
    let cb = VqCodebook::fit(&vq, &train, tokens, channels, FitOptions::default()).unwrap();
    let vq = coded(vq, &test, channels, Arc::new(cb));
    assert!(vq.decode_vq_codes(0, 8, &mut scratch).unwrap().is_none());
    // A range past the rows is the decode's error.
    assert!(vq.decode_vq_codes(90, 8, &mut scratch).is_err());
}
