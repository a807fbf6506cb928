//! `decode_rows_view_packed`: unprotected 4-bit levels read in place, two
//! per byte, hold the levels `decode_rows_view` unpacks, level for level;
//! everything else reads as `decode_rows_view` reads it.

use kv_quant::{DecodeScratch, GatheredLevels, KvStore, LevelPacking, LevelRows, RowsView};

mod common;

use common::{CHANNELS, TOKENS, values};

fn store(form: &str) -> KvStore {
    KvStore::quantize(form.parse().unwrap(), &values(3), TOKENS, CHANNELS).unwrap()
}

fn levels<'s>(view: RowsView<'s>, form: &str) -> LevelRows<'s> {
    match view {
        RowsView::Levels(l) => l,
        RowsView::Values(_) => panic!("{form} reads as values"),
    }
}

#[test]
fn packed_views_hold_the_unpacked_levels() {
    for form in [
        "int4", "int4-g32", "int4-sym", "int4-ch", "nf4", "nf4-g32", "lm4",
    ] {
        let store = store(form);
        for (start, count) in [(0, TOKENS), (3, 17), (39, 1)] {
            let (mut a, mut b) = (DecodeScratch::new(), DecodeScratch::new());
            let (plain, plain_stats) = store.decode_rows_view(start, count, &mut a).unwrap();
            let (packed, packed_stats) =
                store.decode_rows_view_packed(start, count, &mut b).unwrap();
            assert_eq!(plain_stats, packed_stats, "{form}");
            let (plain, packed) = (levels(plain, form), levels(packed, form));
            assert_eq!(plain.packing, LevelPacking::Bytes);
            assert_eq!(packed.packing, LevelPacking::Nibbles, "{form}");
            assert_eq!(packed.levels.len(), count * CHANNELS / 2);
            assert_eq!((packed.rows(), packed.row_bytes()), (count, CHANNELS / 2));
            for r in 0..count {
                for c in 0..CHANNELS {
                    assert_eq!(packed.level(r, c), plain.level(r, c), "{form} ({r}, {c})");
                    assert_eq!(packed.value(r, c).to_bits(), plain.value(r, c).to_bits());
                }
            }
            let mut buffer = Vec::new();
            assert_eq!(packed.unpacked(&mut buffer).levels, plain.levels, "{form}");
            let (mut x, mut y) = (vec![0.0; count * CHANNELS], vec![0.0; count * CHANNELS]);
            plain.dequantize_into(&mut x);
            packed.dequantize_into(&mut y);
            assert_eq!(x, y, "{form}");
            if count > 4 {
                let (p, q) = (plain.sub_rows(2, 3), packed.sub_rows(2, 3));
                assert_eq!(q.rows(), 3);
                assert_eq!(q.unpacked(&mut buffer).levels, p.levels, "{form}");
                assert_eq!(q.scale, p.scale);
            }
        }
    }
}

#[test]
fn other_forms_read_as_the_plain_view() {
    for form in [
        "int8",
        "int3",
        "int4+secded84",
        "int4+golay24",
        "nf4+secded84",
        "fp8-e4m3-tok",
        "lm3",
    ] {
        let store = store(form);
        let (mut a, mut b) = (DecodeScratch::new(), DecodeScratch::new());
        let plain = levels(store.decode_rows_view(1, 9, &mut a).unwrap().0, form);
        let packed = levels(store.decode_rows_view_packed(1, 9, &mut b).unwrap().0, form);
        assert_eq!(packed.packing, LevelPacking::Bytes, "{form}");
        assert_eq!(packed.levels, plain.levels, "{form}");
        assert_eq!((packed.row_bytes(), packed.rows()), (CHANNELS, 9), "{form}");
        assert_eq!(packed.level(2, 5), plain.levels[2 * CHANNELS + 5], "{form}");
    }
    // Rows of an odd number of channels end inside a byte (padded): read
    // one level per byte.
    let odd = KvStore::quantize("int4".parse().unwrap(), &values(5)[..40 * 63], 40, 63).unwrap();
    let mut scratch = DecodeScratch::new();
    let view = levels(
        odd.decode_rows_view_packed(0, 40, &mut scratch).unwrap().0,
        "int4",
    );
    assert_eq!((view.packing, view.row_bytes()), (LevelPacking::Bytes, 63));
    // Values forms stay values.
    let fp16 = store("fp16");
    let mut scratch = DecodeScratch::new();
    let view = fp16.decode_rows_view_packed(0, 4, &mut scratch).unwrap().0;
    assert!(matches!(view, RowsView::Values(_)));
}

/// Packed rows gathered side by side stay packed and hold the unpacked
/// rows' levels; packed rows pushed after unpacked ones are unpacked, and
/// unpacked rows after packed ones are refused.
#[test]
fn gathered_packed_rows_equal_gathered_plain_rows() {
    let store = store("int4");
    let pieces = [(24, 8), (3, 5), (39, 1)];
    let (mut plain, mut packed, mut mixed) = (
        GatheredLevels::default(),
        GatheredLevels::default(),
        GatheredLevels::default(),
    );
    for (i, &(start, count)) in pieces.iter().enumerate() {
        let (mut a, mut b) = (DecodeScratch::new(), DecodeScratch::new());
        let p = levels(
            store.decode_rows_view(start, count, &mut a).unwrap().0,
            "int4",
        );
        let q = levels(
            store
                .decode_rows_view_packed(start, count, &mut b)
                .unwrap()
                .0,
            "int4",
        );
        assert!(plain.push(&p) && packed.push(&q));
        assert!(mixed.push(if i == 0 { &p } else { &q }));
        if i > 0 {
            assert!(!packed.clone().push(&p), "bytes after nibbles are refused");
        }
    }
    let (p, q, m) = (
        plain.view(&store).unwrap(),
        packed.view(&store).unwrap(),
        mixed.view(&store).unwrap(),
    );
    assert_eq!(q.packing, LevelPacking::Nibbles);
    assert_eq!(m.packing, LevelPacking::Bytes);
    assert_eq!((p.levels, p.scale, p.offset), (m.levels, m.scale, m.offset));
    assert_eq!(q.rows(), 14);
    let mut buffer = Vec::new();
    assert_eq!(q.unpacked(&mut buffer).levels, p.levels);
    assert_eq!((q.scale, q.offset), (p.scale, p.offset));
}

/// Packed rows dequantized a few rows at a time (wide rows: several
/// chunks) and through the heap (rows of more than 4,096 channels) give
/// the plain view's values; rows outside the store are a typed error.
#[test]
fn packed_rows_dequantize_in_chunks_and_refuse_rows_outside() {
    for (rows, ch) in [(9, 1024), (3, 8192)] {
        let x: Vec<f32> = (0..rows * ch)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 64.0)
            .collect();
        let store = KvStore::quantize("int4".parse().unwrap(), &x, rows, ch).unwrap();
        let (mut a, mut b) = (DecodeScratch::new(), DecodeScratch::new());
        let plain = levels(store.decode_rows_view(0, rows, &mut a).unwrap().0, "int4");
        let packed = levels(
            store.decode_rows_view_packed(0, rows, &mut b).unwrap().0,
            "int4",
        );
        assert_eq!(packed.packing, LevelPacking::Nibbles);
        let (mut want, mut got) = (vec![0.0; rows * ch], vec![f32::NAN; rows * ch]);
        plain.dequantize_into(&mut want);
        packed.dequantize_into(&mut got);
        assert_eq!(got, want, "{rows} rows of {ch}");
    }
    let store = store("int4");
    let mut scratch = DecodeScratch::new();
    for (start, count) in [(TOKENS, 1), (30, 11), (0, TOKENS + 1)] {
        assert!(
            store
                .decode_rows_view_packed(start, count, &mut scratch)
                .is_err(),
            "rows {start}..{}",
            start + count
        );
    }
}
