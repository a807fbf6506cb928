use gf2_codes::channel::BinarySymmetric;

use super::*;
use crate::store::FaultTarget;

fn data(tokens: usize, channels: usize, seed: u32) -> Vec<f32> {
    (0..tokens * channels)
        .map(|i| ((i as u32).wrapping_mul(2_654_435_761) ^ seed) as f32 / u32::MAX as f32 - 0.5)
        .map(|x| x * 6.0)
        .collect()
}

#[test]
fn rows_written_one_at_a_time_equal_a_whole_quantization() {
    for spelling in [
        "fp32",
        "fp16",
        "bf16",
        "fp8-e4m3-tok",
        "fp8-e5m2-h16-tok",
        "int8",
        "int4-g16",
        "int4-sym-g24-sf32",
        "int3",
        "int2-g8",
        "int4-ch1",
        "nf4-g16",
        "int4+secded84",
        "int4-g16+hamming74",
        "int4-g24+golay24+interp",
        "nf4-g16+secded84+meta-none",
    ] {
        let form: CacheForm = spelling.parse().unwrap();
        assert!(form.is_row_local(), "{spelling}");
        let (tokens, channels) = (7, 48);
        let values = data(tokens, channels, 3);
        let whole = KvStore::quantize(form, &values, tokens, channels).unwrap();
        let mut rows = KvStore::zeroed(form, tokens, channels).unwrap();
        // Out of order, one and two rows at a time.
        for (start, n) in [(3, 2), (0, 1), (6, 1), (1, 2), (5, 1)] {
            rows.write_rows(
                start,
                &values[start * channels..(start + n) * channels],
                QuantizeOptions::default(),
            )
            .unwrap();
        }
        assert_eq!(rows, whole, "{spelling}");
    }
}

#[test]
fn writes_outside_the_store_or_into_shared_scales_are_refused() {
    let form: CacheForm = "int4-g16".parse().unwrap();
    let mut store = KvStore::zeroed(form, 4, 32).unwrap();
    let row = vec![0.5; 32];
    let opts = QuantizeOptions::default();
    assert!(matches!(
        store.write_rows(4, &row, opts),
        Err(KvQuantError::RowRange { .. })
    ));
    assert!(matches!(
        store.write_rows(0, &row[..31], opts),
        Err(KvQuantError::ShapeMismatch { .. })
    ));
    assert!(matches!(
        store.write_rows(0, &[], opts),
        Err(KvQuantError::RowRange { .. })
    ));
    assert!(matches!(
        store.write_rows(0, &[f32::NAN; 32], opts),
        Err(KvQuantError::NonFinite { .. })
    ));
    let other = KvStore::quantize("int4-g32".parse().unwrap(), &row, 1, 32).unwrap();
    assert!(matches!(
        store.copy_rows_from(0, &other),
        Err(KvQuantError::StoreMismatch(_))
    ));
    let wide = KvStore::quantize(form, &[0.5; 48], 1, 48).unwrap();
    assert!(store.copy_rows_from(0, &wide).is_err());
    for shared in ["fp8-e4m3", "int4-ch", "int4-t", "int8-ch4"] {
        let form: CacheForm = shared.parse().unwrap();
        assert!(!form.is_row_local());
        let mut store = KvStore::zeroed(form, 4, 32).unwrap();
        assert!(matches!(
            store.write_rows(0, &row, opts),
            Err(KvQuantError::InvalidParameter { name: "form", .. })
        ));
    }
}

#[test]
fn scrubbing_restores_single_flips_and_leaves_double_flips_detected() {
    for spelling in [
        "int4-g16+secded84",
        "int4-g16+hamming74",
        "int4-g16+golay24",
    ] {
        let form: CacheForm = spelling.parse().unwrap();
        let values = data(64, 64, 9);
        let clean = KvStore::quantize(form, &values, 64, 64).unwrap();
        let mut store = clean.clone();
        let injection = store.inject(
            &BinarySymmetric::new(2e-3).unwrap(),
            5,
            FaultTarget::Everything,
        );
        assert!(injection.total() > 10, "{spelling}: {}", injection.total());
        let first = store.scrub().unwrap();
        let second = store.scrub().unwrap();
        // A second pass finds nothing left to correct.
        assert_eq!(
            second.values.corrected + second.metadata.corrected,
            0,
            "{spelling}"
        );
        assert_eq!(second.values.detected, first.values.detected, "{spelling}");
        if first.values.detected == 0 && first.metadata.detected == 0 {
            // Everything was correctable: the bytes are the clean ones again
            // (Hamming(7,4) may miscorrect a double flip, so compare decodes).
            let now = store.decode().unwrap();
            assert_eq!(
                now.stats.values.silent + now.stats.values.miscorrected,
                0,
                "{spelling}"
            );
        }
        assert!(first.values.corrected > 0, "{spelling}");
    }
    // An unprotected form has nothing to scrub.
    let mut plain = KvStore::zeroed("int4".parse().unwrap(), 2, 8).unwrap();
    assert_eq!(plain.scrub().unwrap(), ScrubStats::default());
}
