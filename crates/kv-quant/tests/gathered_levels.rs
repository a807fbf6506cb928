//! `GatheredLevels`: rows read from several places of a store and set side
//! by side read as the values those rows hold, bit for bit; rows of another
//! store, other layouts and too many rows are refused.

use kv_quant::{DecodeScratch, GatheredLevels, KvStore, RowsView};

mod common;

use common::{CHANNELS, TOKENS, values};

/// Pushes rows `start..start + count` of `store`, read as levels.
fn push(gathered: &mut GatheredLevels, store: &KvStore, start: usize, count: usize) -> bool {
    let mut scratch = DecodeScratch::new();
    match store
        .decode_rows_view(start, count, &mut scratch)
        .unwrap()
        .0
    {
        RowsView::Levels(l) => gathered.push(&l),
        RowsView::Values(_) => panic!("{}: rows {start}.. read as values", store.form()),
    }
}

/// Pushes `pieces` (rows `start..start + count` each) of `store` into
/// `gathered` and checks that the view reads each row as the store's own
/// decode does, bit for bit, value by value and dequantized; returns the
/// view.
fn gather_and_check<'a>(
    gathered: &'a mut GatheredLevels,
    store: &'a KvStore,
    pieces: &[(usize, usize)],
) -> kv_quant::LevelRows<'a> {
    let form = store.form();
    let mut whole = vec![0.0; TOKENS * CHANNELS];
    store
        .decode_rows_rotated_into(0, TOKENS, &mut whole, &mut DecodeScratch::new())
        .unwrap();
    for &(start, count) in pieces {
        assert!(
            push(gathered, store, start, count),
            "{form}: {start}+{count}"
        );
    }
    let view = gathered.view(store).unwrap();
    let source_rows: Vec<usize> = pieces.iter().flat_map(|&(s, n)| s..s + n).collect();
    assert_eq!(view.rows(), source_rows.len(), "{form}");
    let mut dequantized = vec![0.0; view.rows() * CHANNELS];
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
    view
}

#[test]
fn gathered_rows_read_as_their_own_values() {
    let pieces = [(24, 8), (3, 5), (39, 1), (8, 16)];
    let mut gathered = GatheredLevels::default();
    for form in [
        "int4",
        "int8",
        "int4-g32",
        "int4-sym",
        "int3-g16",
        "nf4",
        "fp8-e4m3-tok",
        "int4+secded84",
        "int4+golay24",
        // Lloyd-Max codes: levels in the store's rotated coordinates.
        "lm4",
        "lm3+rot32",
    ] {
        let store = KvStore::quantize(form.parse().unwrap(), &values(7), TOKENS, CHANNELS).unwrap();
        assert!(store.reads_levels_per_token(), "{form}");
        gathered.clear();
        assert!(gathered.view(&store).is_none(), "{form}: nothing held");
        let view = gather_and_check(&mut gathered, &store, &pieces);
        // Sub-views of a gathered view are the rows they name.
        let sub = view.sub_rows(5, 10);
        assert_eq!(
            sub.value(0, 3).to_bits(),
            view.value(5, 3).to_bits(),
            "{form}"
        );
    }
}

/// Per-channel groups along tokens, pushed a whole group at a time (the
/// first piece starting inside its group, the last ending inside one),
/// read as their own values: a paged cache's tile over sealed `int4-ch<B>`
/// blocks.
#[test]
fn whole_token_groups_gathered_read_as_their_own_values() {
    for (form, pieces) in [
        ("int4-ch8", &[(12, 4), (32, 8), (0, 8), (8, 8), (24, 3)][..]),
        ("int8-ch4", &[(1, 3), (36, 4), (4, 8), (16, 2)][..]),
        ("int4-ch", &[(5, 35)][..]),
    ] {
        let store = KvStore::quantize(form.parse().unwrap(), &values(9), TOKENS, CHANNELS).unwrap();
        gather_and_check(&mut GatheredLevels::default(), &store, pieces);
    }
    // Blocks gather where the groups lie within them: whole multiples of
    // the group's tokens, never blocks of none.
    let ch8 = KvStore::quantize("int4-ch8".parse().unwrap(), &values(9), TOKENS, CHANNELS).unwrap();
    for (block, gathers) in [
        (8, true),
        (16, true),
        (24, true),
        (4, false),
        (12, false),
        (0, false),
    ] {
        assert_eq!(
            ch8.gathers_levels_in_blocks(block),
            gathers,
            "blocks of {block}"
        );
    }
}

#[test]
fn rows_of_other_stores_layouts_and_too_many_rows_are_refused() {
    for form in ["fp16", "fp8-e4m3", "int4-ch", "int4-t", "lm4+qjl", "lm8"] {
        let store = KvStore::quantize(form.parse().unwrap(), &values(3), TOKENS, CHANNELS).unwrap();
        assert!(!store.reads_levels_per_token(), "{form}");
    }
    let (a, b) = (
        KvStore::quantize("int4-g32".parse().unwrap(), &values(5), TOKENS, CHANNELS).unwrap(),
        KvStore::quantize("int4-g32".parse().unwrap(), &values(6), TOKENS, CHANNELS).unwrap(),
    );
    let mut gathered = GatheredLevels::default();
    assert!(push(&mut gathered, &a, 0, 3));
    assert!(gathered.view(&a).is_some());
    // Rows of another store of the same form: not pushed, and the rows held
    // are not a view of it.
    assert!(!push(&mut gathered, &b, 0, 3));
    assert!(gathered.view(&b).is_none());
    assert_eq!(gathered.view(&a).unwrap().rows(), 3);
    // Groups along tokens continue only at a group's edge: rows starting
    // inside a group after the first push, and any push after one that
    // ended inside its group, are refused.
    let ch8 = KvStore::quantize("int4-ch8".parse().unwrap(), &values(5), TOKENS, CHANNELS).unwrap();
    let mut grouped = GatheredLevels::default();
    assert!(
        push(&mut grouped, &ch8, 3, 5),
        "the first push may start inside"
    );
    assert!(!push(&mut grouped, &ch8, 17, 7), "a later one may not");
    assert!(push(&mut grouped, &ch8, 24, 3), "ends inside its group");
    assert!(
        !push(&mut grouped, &ch8, 32, 8),
        "nothing follows an open end"
    );
    assert_eq!(grouped.view(&ch8).unwrap().rows(), 8);
    // More rows than the store holds: no view.
    for _ in 0..13 {
        assert!(push(&mut gathered, &a, 0, 3));
    }
    assert!(gathered.view(&a).is_none(), "42 rows of a 40-row store");
}
