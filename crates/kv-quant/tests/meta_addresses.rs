//! `KvStore::meta_addresses`: the metadata a decode of some rows reads
//! (their groups' scales, offsets and check words) is exactly the byte
//! ranges given, one per buffer, inside the store's own buffers; forms
//! without group metadata and rows past the store give none.

use std::ops::Range;

use kv_quant::KvStore;

mod common;

use common::{CHANNELS, TOKENS, values};

/// The address range of `bytes`.
fn addresses(bytes: &[u8]) -> Range<usize> {
    let r = bytes.as_ptr_range();
    r.start as usize..r.end as usize
}

/// The ranges `meta_addresses` gives for rows `start..start + count`.
fn given(store: &KvStore, start: usize, count: usize) -> Vec<Range<usize>> {
    let mut ranges = Vec::new();
    store.meta_addresses(start, count, &mut |r| ranges.push(r));
    ranges
}

/// What a decode of those rows reads, from the public buffers: the words
/// of the groups the rows touch in each buffer (check words: one per
/// scale, then one per offset).
fn expected(store: &KvStore, start: usize, count: usize) -> Vec<Range<usize>> {
    let layout = store.layout().expect("a grouped form");
    let (total, groups) = (layout.groups(), layout.groups_of_rows(start, start + count));
    let mut want = Vec::new();
    for buffer in [store.scales(), store.offsets()] {
        if !buffer.is_empty() {
            let per = buffer.len() / total;
            want.push(addresses(&buffer[groups.start * per..groups.end * per]));
        }
    }
    let checks = store.meta_checks();
    if !checks.is_empty() {
        let words = if store.offsets().is_empty() { 1 } else { 2 };
        let per = checks.len() / (words * total);
        for w in 0..words {
            let first = w * total;
            want.push(addresses(
                &checks[(first + groups.start) * per..(first + groups.end) * per],
            ));
        }
    }
    want
}

#[test]
fn the_ranges_are_the_metadata_a_decode_of_the_rows_reads() {
    let rows = values(7);
    for spelling in [
        "int4",
        "int4+secded84",
        "int4-ch",
        "int4-ch16",
        "int4-ch16+secded84",
        "int8-sym",
        "int2-g8+hamming74",
    ] {
        let form = spelling.parse().unwrap();
        let store = KvStore::quantize(form, &rows, TOKENS, CHANNELS).unwrap();
        for (start, count) in [(0, 1), (0, TOKENS), (3, 5), (TOKENS - 1, 1), (16, 16)] {
            let got = given(&store, start, count);
            assert_eq!(
                got,
                expected(&store, start, count),
                "{spelling} rows {start}+{count}"
            );
            assert!(!got.is_empty(), "{spelling}: a grouped form has metadata");
        }
    }
}

#[test]
fn forms_without_group_metadata_and_rows_past_the_store_give_nothing() {
    let rows = values(8);
    let fp16 = KvStore::quantize("fp16".parse().unwrap(), &rows, TOKENS, CHANNELS).unwrap();
    assert!(given(&fp16, 0, TOKENS).is_empty());
    let int4 = KvStore::quantize("int4".parse().unwrap(), &rows, TOKENS, CHANNELS).unwrap();
    assert!(given(&int4, TOKENS - 1, 2).is_empty(), "past the last row");
    assert!(given(&int4, 0, 0).is_empty(), "no rows");
}
