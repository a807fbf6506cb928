//! `ChannelSlices`: a per-channel group kept as slices of its channels in
//! several stores reads, gathered, as the values one store of the whole
//! rows holds, bit for bit (per-channel parameters depend only on their
//! channel); slices that do not line up are refused.

use kv_quant::{ChannelSlices, DecodeScratch, KvStore, LevelPacking, RowsView};

mod common;

use common::values;

const ROWS: usize = 32;
const CHANNELS: usize = 48;

/// Columns `channels` of `rows` (`ROWS × CHANNELS`), row-major.
fn columns(rows: &[f32], channels: std::ops::Range<usize>) -> Vec<f32> {
    rows.chunks_exact(CHANNELS)
        .flat_map(|r| r[channels.clone()].to_vec())
        .collect()
}

/// Pushes rows `start..start + count` of each slice store into `gather`.
fn push_all(gather: &mut ChannelSlices, slices: &[KvStore], start: usize, count: usize) -> bool {
    gather.begin(count, CHANNELS);
    slices.iter().all(|s| {
        let mut scratch = DecodeScratch::new();
        match s
            .decode_rows_view_packed(start, count, &mut scratch)
            .unwrap()
            .0
        {
            RowsView::Levels(l) => gather.push(&l),
            RowsView::Values(_) => panic!("{}: read as values", s.form()),
        }
    })
}

#[test]
fn gathered_slices_read_as_the_whole_store() {
    let rows: Vec<f32> = values(3)[..ROWS * CHANNELS].to_vec();
    for form in [
        "int4-ch32",
        "int2-ch32",
        "int8-ch32",
        "int4-ch32+secded84",
        "int3-ch32",
    ] {
        let form = form.parse().unwrap();
        let whole = KvStore::quantize(form, &rows, ROWS, CHANNELS).unwrap();
        let mut want = vec![0.0; ROWS * CHANNELS];
        whole
            .decode_rows_into(0, ROWS, &mut want, &mut DecodeScratch::new())
            .unwrap();
        for m in [2, 3, 4] {
            let width = CHANNELS / m;
            let slices: Vec<KvStore> = (0..m)
                .map(|i| {
                    let cols = columns(&rows, i * width..(i + 1) * width);
                    KvStore::quantize(form, &cols, ROWS, width).unwrap()
                })
                .collect();
            let template = KvStore::zeroed(form, ROWS, CHANNELS).unwrap();
            let mut gather = ChannelSlices::default();
            for (start, count) in [(0, ROWS), (5, 9), (16, 16), (31, 1)] {
                assert!(push_all(&mut gather, &slices, start, count), "{form} m={m}");
                let view = gather.view(&template, start).unwrap();
                assert_eq!((view.rows(), view.channels()), (count, CHANNELS));
                let mut got = vec![0.0; count * CHANNELS];
                view.dequantize_into(&mut got);
                for (g, w) in got.iter().zip(&want[start * CHANNELS..]) {
                    assert_eq!(
                        g.to_bits(),
                        w.to_bits(),
                        "{form} m={m} rows {start}+{count}"
                    );
                }
                assert_eq!(view.group_index(count - 1, CHANNELS - 1), CHANNELS - 1);
            }
        }
    }
}

#[test]
fn slices_that_do_not_line_up_are_refused() {
    let rows: Vec<f32> = values(5)[..ROWS * CHANNELS].to_vec();
    let form = "int4-ch32".parse().unwrap();
    let half = |i: usize| KvStore::quantize(form, &columns(&rows, i * 24..(i + 1) * 24), ROWS, 24);
    let slices = [half(0).unwrap(), half(1).unwrap()];
    let template = KvStore::zeroed(form, ROWS, CHANNELS).unwrap();
    let mut gather = ChannelSlices::default();
    // Half the channels: no view yet.
    gather.begin(4, CHANNELS);
    let mut scratch = DecodeScratch::new();
    let RowsView::Levels(l) = slices[0]
        .decode_rows_view_packed(0, 4, &mut scratch)
        .unwrap()
        .0
    else {
        panic!("levels");
    };
    assert_eq!(l.packing, LevelPacking::Nibbles);
    assert!(gather.push(&l));
    assert!(gather.view(&template, 0).is_none());
    // Rows other than the gather's, or channels past the row: refused.
    assert!(!gather.push(&l.sub_rows(0, 3)));
    gather.begin(4, CHANNELS);
    for _ in 0..2 {
        assert!(gather.push(&l));
    }
    assert!(!gather.push(&l), "a third slice of 24 channels");
    // Another form, or rows past the template's group: refused.
    assert!(push_all(&mut gather, &slices, 28, 4));
    let other = KvStore::zeroed("int4-ch16".parse().unwrap(), ROWS, CHANNELS).unwrap();
    assert!(
        gather.view(&other, 28).is_none(),
        "rows 28..32 span two groups of 16"
    );
    assert!(
        gather.view(&template, 29).is_none(),
        "rows past the template"
    );
    assert!(gather.view(&template, 28).is_some());
    // Per-token groups are not channel slices.
    let tok =
        KvStore::quantize("int4".parse().unwrap(), &rows[..4 * CHANNELS], 4, CHANNELS).unwrap();
    let RowsView::Levels(t) = tok.decode_rows_view_packed(0, 4, &mut scratch).unwrap().0 else {
        panic!("levels");
    };
    gather.begin(4, CHANNELS);
    assert!(!gather.push(&t));
}
