//! Keys coded before RoPE on pair codebooks (`stored::RopePairPart`,
//! `cq-d2-k<K>-pre`) through the stored-layer interface: rows written one
//! at a time into scattered blocks read back, tile by tile, as exactly the
//! rows a kv-quant store of each sealed block decodes once rotated back to
//! their positions (the block's rows as staged, f16, rotated to position
//! 0 from the block's first row and put in pair order before coding; sink
//! rows exact inside their block), in both pair layouts; a rotated key
//! scores as its pair centroids rotated (the codebook commutes with RoPE);
//! snapshots restore at their positions; the re-encode protocol's window
//! codes as a block at position 0; the shared codebook's faults are
//! corrected under a code; what blocks cannot hold is refused.

mod common;

use std::sync::Arc;

use attention::stored::{Fitted, StoredPart, open_part, part_seals};
use attention::{Rope, RopeLayout, TileRows};
use gf2_codes::channel::ExactFlips;
use kv_quant::{
    CacheForm, DecodeScratch, FaultTarget, FitOptions, KvStore, QuantizeOptions, Segments,
    VqCodebook,
};

const HEAD: usize = 16;
const CH: usize = 2 * HEAD;
const BS: usize = 8;

fn keys(rope: &Rope, tokens: usize, seed: u64) -> (Vec<f32>, Vec<f32>) {
    common::pre_rope_keys(rope, tokens, CH, seed)
}

fn fitted(form: &CacheForm, rope: &Rope) -> Fitted {
    common::pair_fitted(form, rope, CH)
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// `got` equals `want` within f32 rounding of a rotation: a tile scored as
/// pair codes turns its pairs in f32 by f32 angles, where a decoded row
/// turns them in f64 and rounds once (a few ulp of each row's largest).
fn assert_near(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (g, w) in got.chunks(CH).zip(want.chunks(CH)) {
        let scale = w.iter().fold(1.0f32, |m, x| m.max(x.abs()));
        let err = max_abs_diff(g, w);
        assert!(err <= 1e-6 * scale, "{what}: {err} at scale {scale}");
    }
}

/// Whether rows `start..start + count` of `part` on `pages` come as pair
/// codes (scored against the codebook) rather than decoded rows.
fn reads_as_codes(part: &dyn StoredPart, pages: &[u32], start: usize, count: usize) -> bool {
    let mut scratch = attention::stored::PartScratch::default();
    let tile = part.read_tile(pages, start, count, &mut scratch).unwrap();
    matches!(tile.rows, TileRows::PairCodes(_))
}

#[test]
fn pages_read_as_each_block_coded_before_rope_decodes() {
    // Heads of 16, all rotated or 12 of them (channels 12-15 left alone).
    for (layout, rotary) in [
        (RopeLayout::Adjacent, HEAD),
        (RopeLayout::RotateHalf, HEAD),
        (RopeLayout::RotateHalf, 12),
    ] {
        let rope = Rope::new(layout, HEAD, rotary, 10_000.0).unwrap();
        let form: CacheForm = "cq-d2-k16-pre+sink3".parse().unwrap();
        let fitted = fitted(&form, &rope);
        let codebook = fitted.codebook.clone().unwrap();
        let mut part = open_part(form, BS, CH, 6, &fitted).unwrap();
        assert!(part_seals(form, BS));
        assert_eq!(part.shared_bytes(), codebook.stored_bytes());
        let pages: Vec<u32> = vec![3, 0, 5];
        let tokens = 2 * BS + 2;
        let (_, x) = keys(&rope, tokens, 1);
        common::write_and_seal(part.as_mut(), &pages, &x);
        assert_eq!(part.staged_blocks(), 1, "the tail block stays staged");
        let staged = common::f16_rows(&x, CH);
        let mut want = Vec::new();
        for b in 0..2 {
            // Sink rows stay as written; the others are coded before RoPE.
            let sink = 3usize.saturating_sub(b * BS);
            let mut block = staged[b * BS * CH..][..BS * CH].to_vec();
            let coded = &mut block[sink * CH..];
            for (i, row) in coded.chunks_exact_mut(CH).enumerate() {
                rope.undo(row, b * BS + sink + i).unwrap();
            }
            rope.to_pair_order(coded, &mut Vec::new());
            let form = form.with_segments(Segments { sink, window: 0 }).unwrap();
            let opts = QuantizeOptions::default();
            let store =
                KvStore::quantize_with_codebook(form, &block, BS, CH, opts, codebook.clone())
                    .unwrap();
            assert_eq!(part.block_bytes(pages[b] as usize), store.stored_bytes());
            if sink == 0 {
                assert_eq!(part.sealed_block_bytes(), store.stored_bytes());
            }
            let mut out = vec![0.0; BS * CH];
            store
                .decode_rows_into(0, BS, &mut out, &mut DecodeScratch::new())
                .unwrap();
            rope.from_pair_order(&mut out[sink * CH..], &mut Vec::new());
            rope.apply_rows(&mut out[sink * CH..], CH, b * BS + sink)
                .unwrap();
            want.extend(out);
        }
        want.extend_from_slice(&staged[2 * BS * CH..]);
        for (start, count) in [(0, tokens), (5, 7), (BS + 1, BS + 1), (2 * BS, 2), (BS, BS)] {
            let what = format!("{layout:?} {rotary}: {start}+{count}");
            let got = common::f32_tile(part.as_ref(), &pages, start, count);
            assert_near(&got, &want[start * CH..][..count * CH], &what);
            // Codes where the rows lie in one sealed block past the sink
            // rows, all channels rotated; decoded rows, bit for bit, else.
            let codes = start / BS == (start + count - 1) / BS && (3..2 * BS).contains(&start);
            assert_eq!(
                reads_as_codes(part.as_ref(), &pages, start, count),
                codes && rotary == HEAD,
                "{what}"
            );
            if !reads_as_codes(part.as_ref(), &pages, start, count) {
                assert_eq!(got, &want[start * CH..][..count * CH], "{what}");
            }
        }
        // Sink rows read as written, bit for bit.
        assert_eq!(want[..3 * CH], staged[..3 * CH]);
        // The coded rows: near the keys (2 bits a value, on the pairs).
        let err = max_abs_diff(&want[3 * CH..2 * BS * CH], &staged[3 * CH..2 * BS * CH]);
        assert!(err > 0.0 && err < 2.0, "{layout:?} {rotary}: {err}");
        // A sealed block restored elsewhere keeps its positions: read as
        // the first page of a table, it still rotates to positions BS.. .
        let snap = part.snapshot(pages[1] as usize).unwrap();
        assert_eq!(snap.first_position(), Some(BS));
        assert!(part.accepts(&snap));
        part.restore(1, &snap).unwrap();
        assert_near(
            &common::f32_tile(part.as_ref(), &[1], 0, BS),
            &want[BS * CH..2 * BS * CH],
            "restored",
        );
        // A block claiming another position than its sink rows say, or a
        // block's store without its position, is refused.
        let sink_block = part.snapshot(pages[0] as usize).unwrap();
        let moved =
            attention::stored::PartBlock::of_stores(sink_block.stores().to_vec()).at_position(BS);
        assert!(!part.accepts(&moved));
        let bare = attention::stored::PartBlock::of_stores(snap.stores().to_vec());
        assert!(!part.accepts(&bare));
        assert!(part.restore(2, &moved).is_err());
        // A sequence cut back into a sealed block: staged again from the
        // rows it reads as (after RoPE), a row then written over.
        let mut before = vec![0.0; BS * CH];
        part.read_rows(pages[1] as usize, 0, &mut before, &mut DecodeScratch::new())
            .unwrap();
        let mut encoder = part.row_encoder().unwrap();
        let mut buf = kv_quant::RowBuffers::new(encoder.buffer_sizes(1));
        encoder
            .encode_into(
                &x[BS * CH..][..CH],
                buf.as_mut(),
                QuantizeOptions::default(),
            )
            .unwrap();
        part.put_row(pages[1] as usize, 0, &buf).unwrap();
        assert!(part.is_staged(pages[1] as usize));
        let after = common::f32_tile(part.as_ref(), &pages, BS, BS);
        assert_eq!(after[..CH], staged[BS * CH..][..CH]);
        let f16_of_before = common::f16_rows(&before[CH..], CH);
        assert_eq!(after[CH..], f16_of_before[..]);
    }
}

/// The score of a query against a key coded before RoPE is its pairs'
/// centroids, scaled by the row's gain and rotated to the key's position:
/// `g·Σ_p Re(conj(q_p)·c_p·e^{iθ_p t})`, the products `conj(q_p)·c_p`
/// taken against the codebook once.
#[test]
fn a_rotated_key_scores_as_its_rotated_centroids() {
    let rope = Rope::new(RopeLayout::RotateHalf, HEAD, HEAD, 10_000.0).unwrap();
    let form: CacheForm = "cq-d2-k16-pre".parse().unwrap();
    let fitted = fitted(&form, &rope);
    let codebook = fitted.codebook.clone().unwrap();
    let mut part = open_part(form, BS, CH, 2, &fitted).unwrap();
    let (_, x) = keys(&rope, BS, 4);
    common::write_and_seal(part.as_mut(), &[1], &x);
    let read = common::f32_tile(part.as_ref(), &[1], 0, BS);
    // The block's codes and gains, as its store holds them: a 4-bit index
    // a pair (two a byte, low nibble first) and one f16 gain a row.
    let store = part.snapshot(1).unwrap().stores()[0].clone();
    let (q, _) = keys(&rope, 1, 77);
    let pairs = HEAD / 2;
    for t in 0..BS {
        let key = &read[t * CH..][..CH];
        let direct: f64 = q.iter().zip(key).map(|(a, b)| f64::from(a * b)).sum();
        let mut decoded = vec![0.0; CH];
        store
            .decode_rows_into(t, 1, &mut decoded, &mut DecodeScratch::new())
            .unwrap();
        let indices: Vec<u8> = store.data()[t * CH / 4..][..CH / 4]
            .iter()
            .flat_map(|b| [b & 0xF, b >> 4])
            .collect();
        let (gain, _) = store.group_params(t).unwrap();
        for (pair, &idx) in indices.iter().enumerate() {
            let c = codebook.centroid(codebook.codebook_of(0, pair), idx);
            assert_eq!(decoded[2 * pair..][..2], [gain * c[0], gain * c[1]]);
        }
        let mut via_codebook = 0.0f64;
        for h in 0..2 {
            for p in 0..pairs {
                // The pair as coded (gain × centroid), in pair order.
                let c = &decoded[h * HEAD + 2 * p..][..2];
                let (a, b) = rope.pair(p);
                let (qa, qb) = (f64::from(q[h * HEAD + a]), f64::from(q[h * HEAD + b]));
                let angle = t as f64 * rope.inv_freq()[p];
                let (s, co) = angle.sin_cos();
                // Re(conj(q)·c·e^{iθt}) with q = qa + i·qb, c = c0 + i·c1.
                let (c0, c1) = (f64::from(c[0]), f64::from(c[1]));
                let (re, im) = (qa * c0 + qb * c1, qa * c1 - qb * c0);
                via_codebook += re * co - im * s;
            }
        }
        assert!(
            (direct - via_codebook).abs() < 1e-4 * (1.0 + direct.abs()),
            "token {t}: {direct} against {via_codebook}"
        );
    }
    assert_eq!(codebook.codebooks(), CH / 2, "one codebook per pair");
}

/// The re-encode protocol codes a window as the paged cache codes a block
/// at position 0: given the rows as the block staged them (f16), the
/// window reads back the block's rows (or codes) bit for bit.
#[test]
fn a_window_reads_as_the_paged_block_at_position_zero() {
    use attention::KvSource;
    for layout in [RopeLayout::Adjacent, RopeLayout::RotateHalf] {
        let rope = Rope::new(layout, HEAD, HEAD, 10_000.0).unwrap();
        let form: CacheForm = "cq-d2-k16-pre+sink3+secded84".parse().unwrap();
        let fitted = fitted(&form, &rope);
        let mut part = open_part(form, BS, CH, 2, &fitted).unwrap();
        let (_, x) = keys(&rope, BS, 6);
        common::write_and_seal(part.as_mut(), &[1], &x);
        let staged = common::f16_rows(&x, CH);
        let window =
            attention::stored::open_window(form, &fitted, &staged, (BS, CH, HEAD), Some(&rope))
                .unwrap();
        assert!(window.rotated_back());
        let source = window.source();
        let mut scratch = Default::default();
        // Rows with sink rows among them decode; rows past them are codes
        // in both, with the same angles.
        for (start, count, codes) in [(0, BS, false), (2, 5, false), (4, 4, true)] {
            let tile = source.read_tile(start, count, &mut scratch).unwrap();
            assert_eq!(matches!(tile.rows, TileRows::PairCodes(_)), codes);
            assert_eq!(reads_as_codes(part.as_ref(), &[1], start, count), codes);
            let paged = common::f32_tile(part.as_ref(), &[1], start, count);
            assert_eq!(tile.rows.to_f32_vec(), paged, "{layout:?} {start}+{count}");
        }
    }
}

/// The exponent's top bit of every centroid of the first pair's codebook
/// (16 centroids of two f16 values: words 0-31 of the table).
fn first_codebook_exponents() -> ExactFlips {
    ExactFlips::new((0..32).map(|w| 16 * w + 14))
}

#[test]
fn codebook_faults_are_corrected_under_a_code_and_read_by_every_block_without() {
    let rope = Rope::new(RopeLayout::Adjacent, HEAD, HEAD, 10_000.0).unwrap();
    for (spelling, corrected) in [("cq-d2-k16-pre+secded84", true), ("cq-d2-k16-pre", false)] {
        let form: CacheForm = spelling.parse().unwrap();
        let fitted = fitted(&form, &rope);
        let mut part = open_part(form, BS, CH, 4, &fitted).unwrap();
        let (_, x) = keys(&rope, 2 * BS, 5);
        common::write_and_seal(part.as_mut(), &[0, 1], &x);
        let clean = common::f32_tile(part.as_ref(), &[0, 1], 0, 2 * BS);
        let before = part.snapshot(0).unwrap();
        // Values alone never reach the shared table.
        let none = part
            .inject_shared(&first_codebook_exponents(), 1, FaultTarget::Values)
            .unwrap();
        assert!(none.tables.is_empty());
        let hit = part
            .inject_shared(&first_codebook_exponents(), 1, FaultTarget::Everything)
            .unwrap();
        assert_eq!(hit.tables.len(), 32, "{spelling}");
        let stats = part.shared_stats();
        let read = common::f32_tile(part.as_ref(), &[0, 1], 0, 2 * BS);
        if corrected {
            assert_eq!(read, clean, "{spelling}");
            assert!(stats.corrected == 32 && stats.silent == 0, "{stats:?}");
            assert_eq!(part.scrub_shared().unwrap().corrected, 32);
            assert_eq!(part.scrub_shared().unwrap().corrected, 0);
            continue;
        }
        assert!(stats.silent >= 1, "{stats:?}");
        // Every sealed block reads the faulted table: each row's first
        // pair took one of the faulted centroids.
        for t in 0..2 * BS {
            assert_ne!(read[t * CH..][..2], clean[t * CH..][..2], "token {t}");
        }
        // So does a block restored from a copy taken before the fault; a
        // block sealed after it is coded on the faulted table (the same
        // rows sealed on the clean one read as `clean`).
        part.restore(2, &before).unwrap();
        let restored = common::f32_tile(part.as_ref(), &[2], 0, BS);
        assert_near(&restored, &read[..BS * CH], spelling);
        common::write_and_seal(part.as_mut(), &[3], &x[..BS * CH]);
        let resealed = common::f32_tile(part.as_ref(), &[3], 0, BS);
        assert_ne!(resealed, clean[..BS * CH]);
        assert_ne!(resealed, read[..BS * CH]);
    }
}

#[test]
fn what_blocks_cannot_hold_is_refused() {
    let rope = Rope::new(RopeLayout::Adjacent, HEAD, HEAD, 10_000.0).unwrap();
    let form: CacheForm = "cq-d2-k16-pre".parse().unwrap();
    let fitted = fitted(&form, &rope);
    let refused = |form: CacheForm, fitted: &Fitted| match open_part(form, BS, CH, 2, fitted) {
        Err(e) => e.to_string(),
        Ok(_) => panic!("{form} opened"),
    };
    // Without the model's RoPE, or without the codebook.
    let no_rope = Fitted {
        rope: None,
        ..fitted.clone()
    };
    assert!(refused(form, &no_rope).contains("needs the model's RoPE"));
    let no_codebook = Fitted {
        codebook: None,
        ..fitted.clone()
    };
    assert!(refused(form, &no_codebook).contains("codebook"));
    // Heads that do not divide the rows.
    let wide = Fitted {
        rope: Some(Rope::new(RopeLayout::Adjacent, 24, 24, 10_000.0).unwrap()),
        ..fitted.clone()
    };
    assert!(refused(form, &wide).contains("divide"));
    // A window of exact tokens.
    let windowed: CacheForm = "cq-d2-k16-pre+win16".parse().unwrap();
    assert!(refused(windowed, &fitted).contains("window"));
    assert!(!part_seals(windowed, BS));
    // A codebook fitted on keys after RoPE (a `cq-d2` table) is another
    // table, whatever its shape.
    let after_rope: CacheForm = "cq-d2-k16".parse().unwrap();
    let (_, post) = keys(&rope, 512, 99);
    let plain = VqCodebook::fit(&after_rope, &post, 512, CH, FitOptions::default()).unwrap();
    let wrong = Fitted {
        codebook: Some(Arc::new(plain)),
        ..fitted.clone()
    };
    assert!(refused(form, &wrong).contains("cq-pre"));
    // The re-encode protocol's check of a layer's forms, before any work.
    let fp16: CacheForm = "fp16".parse().unwrap();
    let check = |key: CacheForm, value: CacheForm, rope: bool| {
        attention::stored::check_layer_forms(key, value, rope)
            .unwrap_err()
            .to_string()
    };
    assert!(check(form, fp16, false).contains("this model has none"));
    assert!(check(windowed, fp16, true).contains("window of exact tokens"));
    assert!(check(fp16, form, true).contains("values do not carry"));
    // A window of the re-encode protocol without the model's RoPE.
    let e =
        attention::stored::open_window(form, &fitted, &vec![0.0; BS * CH], (BS, CH, HEAD), None)
            .unwrap_err()
            .to_string();
    assert!(e.contains("needs the model's RoPE"), "{e}");
}
