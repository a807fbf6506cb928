//! `KvStore::gathered_levels`: rows read from several places of a store and
//! set side by side read as the values those rows hold, bit for bit; other
//! layouts and lengths that are not whole rows are refused.

use kv_quant::{DecodeScratch, KvStore, RowsView};

const TOKENS: usize = 40;
const CHANNELS: usize = 64;

fn values(seed: u32) -> Vec<f32> {
    (0..TOKENS * CHANNELS)
        .map(|i| ((i as u32).wrapping_mul(2_654_435_761) ^ seed) as f32 / u32::MAX as f32 - 0.5)
        .collect()
}

/// Rows `start..start + count` of `store` as levels, copied out.
fn levels_of(store: &KvStore, start: usize, count: usize) -> (Vec<u8>, Vec<f32>, Vec<f32>) {
    let mut scratch = DecodeScratch::new();
    match store
        .decode_rows_view(start, count, &mut scratch)
        .unwrap()
        .0
    {
        RowsView::Levels(l) => (l.levels.to_vec(), l.scale.to_vec(), l.offset.to_vec()),
        RowsView::Values(_) => panic!("{}: rows {start}.. read as values", store.form()),
    }
}

#[test]
fn gathered_rows_read_as_their_own_values() {
    let pieces = [(24, 8), (3, 5), (39, 1), (8, 16)];
    for form in [
        "int4",
        "int8",
        "int4-g32",
        "int4-sym",
        "int3-g16",
        "nf4",
        "int4+secded84",
        "int4+golay24",
    ] {
        let store = KvStore::quantize(form.parse().unwrap(), &values(7), TOKENS, CHANNELS).unwrap();
        assert!(store.reads_levels_per_token(), "{form}");
        let whole = store.decode().unwrap().values;
        let (mut levels, mut scale, mut offset) = (Vec::new(), Vec::new(), Vec::new());
        for &(start, count) in &pieces {
            let (l, s, o) = levels_of(&store, start, count);
            levels.extend(l);
            scale.extend(s);
            offset.extend(o);
        }
        let view = store.gathered_levels(&levels, &scale, &offset).unwrap();
        let source_rows: Vec<usize> = pieces.iter().flat_map(|&(s, n)| s..s + n).collect();
        assert_eq!(view.rows(), source_rows.len());
        let mut dequantized = vec![0.0; levels.len()];
        view.dequantize_into(&mut dequantized);
        for (r, &t) in source_rows.iter().enumerate() {
            for c in 0..CHANNELS {
                let want = whole[t * CHANNELS + c].to_bits();
                assert_eq!(
                    view.value(r, c).to_bits(),
                    want,
                    "{form}, row {t}, channel {c}"
                );
                assert_eq!(dequantized[r * CHANNELS + c].to_bits(), want, "{form}");
            }
        }
        // Sub-views of a gathered view are the rows they name.
        let sub = view.sub_rows(5, 10);
        assert_eq!(
            sub.value(0, 3).to_bits(),
            view.value(5, 3).to_bits(),
            "{form}"
        );
    }
}

#[test]
fn other_layouts_and_partial_rows_are_refused() {
    for form in ["fp16", "fp8-e4m3", "int4-ch", "int4-t", "lm4"] {
        let store = KvStore::quantize(form.parse().unwrap(), &values(3), TOKENS, CHANNELS).unwrap();
        assert!(!store.reads_levels_per_token(), "{form}");
        let (levels, params) = (vec![0u8; CHANNELS], vec![1.0f32; CHANNELS]);
        for groups in [1, CHANNELS] {
            let p = &params[..groups];
            assert!(store.gathered_levels(&levels, p, p).is_none(), "{form}");
        }
    }
    let store =
        KvStore::quantize("int4-g32".parse().unwrap(), &values(5), TOKENS, CHANNELS).unwrap();
    let (levels, scale, offset) = levels_of(&store, 0, 3);
    assert!(store.gathered_levels(&levels, &scale, &offset).is_some());
    let too_many_rows = vec![0u8; (TOKENS + 1) * CHANNELS];
    let params = vec![1.0f32; 2 * (TOKENS + 1)];
    for (l, s, o) in [
        (&levels[..levels.len() - 1], &scale[..], &offset[..]),
        (&levels[..], &scale[..scale.len() - 1], &offset[..]),
        (&levels[..], &scale[..], &offset[1..]),
        (&levels[..0], &scale[..0], &offset[..0]),
        (&too_many_rows[..], &params[..], &params[..]),
    ] {
        assert!(store.gathered_levels(l, s, o).is_none());
    }
}
