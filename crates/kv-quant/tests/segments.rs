//! Exact sink and window tokens (`+sink<S>`, `+win<W>`): which tokens stay
//! exact, that they decode to their f16 values, that tiles across segment
//! borders decode like the whole matrix, that faults in exact rows are
//! counted and corrected under a code, and that such stores are not written
//! row by row.

use gf2_codes::channel::BinarySymmetric;
use half::f16;
use kv_quant::{
    CacheForm, DecodeScratch, FaultTarget, KvQuantError, KvStore, QuantizeOptions, SegmentRows,
};

fn form(s: &str) -> CacheForm {
    s.parse().unwrap()
}

fn data(tokens: usize, channels: usize) -> Vec<f32> {
    (0..tokens * channels)
        .map(|i| {
            let (t, c) = ((i / channels) as f32, (i % channels) as f32);
            (0.07 * t + 0.9 * c).sin() * (1.0 + 0.05 * c)
        })
        .collect()
}

#[test]
fn segment_rows_follow_the_stated_rule() {
    let rows = |s: &str, t: usize| KvStore::segment_rows_of(&form(s), t);
    assert_eq!(
        rows("int4+sink4+win64", 300),
        SegmentRows {
            sink: 0..4,
            middle: 4..236,
            window: 236..300
        }
    );
    // Only whole 32-token blocks are quantized: 300 − 4 − 64 = 232 → 224.
    assert_eq!(
        rows("int4-ch32+sink4+win64", 300),
        SegmentRows {
            sink: 0..4,
            middle: 4..228,
            window: 228..300
        }
    );
    // KIVI without a sink: the incomplete block stays exact.
    assert_eq!(
        rows("int4-ch32+win1", 100),
        SegmentRows {
            sink: 0..0,
            middle: 0..96,
            window: 96..100
        }
    );
    // Short sequences are all exact.
    assert_eq!(
        rows("int4+sink4+win64", 50),
        SegmentRows {
            sink: 0..4,
            middle: 4..4,
            window: 4..50
        }
    );
    assert_eq!(
        rows("int4+sink4", 2),
        SegmentRows {
            sink: 0..2,
            middle: 2..2,
            window: 2..2
        }
    );
    assert_eq!(
        rows("int4", 9),
        SegmentRows {
            sink: 0..0,
            middle: 0..9,
            window: 9..9
        }
    );
}

#[test]
fn exact_rows_decode_to_their_f16_values_and_tiles_match_the_whole() {
    let (tokens, channels) = (150, 64);
    let x = data(tokens, channels);
    for spelling in [
        "int4+sink4+win32",
        "int2-ch16+win20",
        "lm3+sink4+win16",
        "int4+rot+sink3+secded84+interp",
    ] {
        let f = form(spelling);
        let store = KvStore::quantize(f, &x, tokens, channels).unwrap();
        let rows = store.segment_rows();
        let whole = store.decode().unwrap();
        let rotated = f.rotation().is_some();
        for t in rows.sink.clone().chain(rows.window.clone()) {
            for c in 0..channels {
                let (a, b) = (whole.values[t * channels + c], x[t * channels + c]);
                // f16 rounding (of rotated coordinates for rotated forms).
                let tol = if rotated {
                    2e-3
                } else {
                    (f16::from_f32(b).to_f32() - b).abs()
                };
                approx::assert_abs_diff_eq!(a, b, epsilon = tol + 1e-6);
            }
        }
        // Every tile, also across segment borders, equals the whole decode.
        let mut scratch = DecodeScratch::new();
        for (start, count) in [(0, 7), (3, 2), (4, 40), (110, 40), (100, 50), (0, 150)] {
            let mut out = vec![0.0; count * channels];
            store
                .decode_rows_into(start, count, &mut out, &mut scratch)
                .unwrap();
            assert_eq!(
                out[..],
                whole.values[start * channels..(start + count) * channels],
                "{spelling} {start}+{count}"
            );
        }
        // Bytes: quantized middle plus f16 (coded) exact rows.
        let middle = KvStore::quantize(
            f.without_segments(),
            &x[rows.middle.start * channels..rows.middle.end * channels],
            rows.middle.len(),
            channels,
        )
        .unwrap();
        let exact_rows = tokens - rows.middle.len();
        let exact = KvStore::quantize(
            f.exact_rows_form(),
            &x[..exact_rows * channels],
            exact_rows,
            channels,
        )
        .unwrap();
        assert_eq!(
            store.stored_bytes(),
            middle.stored_bytes() + exact.stored_bytes(),
            "{spelling}"
        );
    }
}

#[test]
fn faults_in_exact_rows_are_injected_counted_and_corrected() {
    let (tokens, channels) = (128, 64);
    let x = data(tokens, channels);
    let clean = KvStore::quantize(form("int4+sink4+win32+secded84"), &x, tokens, channels).unwrap();
    let mut faulty = clean.clone();
    let injection = faulty.inject(&BinarySymmetric::new(2e-3).unwrap(), 3, FaultTarget::Values);
    assert!(!injection.exact.is_empty() && !injection.values.is_empty());
    let decoded = faulty.decode().unwrap();
    let s = decoded.stats.values;
    assert_eq!(s.words, s.clean + s.corrected + s.detected);
    assert!(s.corrected > 0);
    // Exact rows (4 sink + 32 window) are SECDED-coded f16: 4 nibbles
    // (codewords) per value; the 92 middle rows one per value.
    assert_eq!(s.words as usize, 92 * channels + 36 * channels * 4);
    // Scrubbing fixes every single flip in both sections.
    let mut scrubbed = faulty.clone();
    let found = scrubbed.scrub().unwrap();
    assert_eq!(found.values.corrected, s.corrected);
    // An unprotected segmented store takes exact-row faults silently.
    let plain = KvStore::quantize(form("int4+sink4+win32"), &x, tokens, channels).unwrap();
    let mut hit = plain.clone();
    let inj = hit.inject(&BinarySymmetric::new(1e-2).unwrap(), 1, FaultTarget::Values);
    assert!(!inj.exact.is_empty());
    let d = hit.decode().unwrap();
    assert!(d.stats.values.silent > 0);
}

#[test]
fn segmented_stores_are_not_written_row_by_row() {
    let f = form("int4+sink4");
    assert!(!f.is_row_local());
    let mut store = KvStore::zeroed(f, 8, 64).unwrap();
    let e = store
        .write_rows(0, &[0.5; 64], QuantizeOptions::default())
        .unwrap_err();
    assert!(
        matches!(e, KvQuantError::InvalidParameter { name: "form", .. }),
        "{e}"
    );
}
