//! The dense-and-sparse part (`stored::SparsePart`, `+out<P>` forms)
//! through the stored-layer interface: rows written one at a time into
//! scattered blocks read back, tile by tile over the pages, as exactly the
//! rows a kv-quant `SparseStore` of each sealed block decodes (the block's
//! rows as staged, f16; sink rows exact inside their block), the block
//! still written as its f16 rows; snapshots restore bit for bit; faults in the outlier
//! tables are counted, corrected under a code and scrubbed; bytes are the
//! store's; what blocks cannot hold is refused.

mod common;

use attention::stored::{Fitted, PartScratch, open_part, part_pool_bytes, part_seals};
use attention::{Rope, RopeLayout, TileRows};
use gf2_codes::channel::ExactFlips;
use kv_quant::{CacheForm, DecodeScratch, FaultTarget, SparseStore};

const CH: usize = 32;
const BS: usize = 8;

fn rows(tokens: usize, seed: u64) -> Vec<f32> {
    let mut x = common::structured_rows(tokens, CH, seed, 0.1);
    // A few far values, as keys' outlier channels have.
    for t in (0..tokens).step_by(5) {
        x[t * CH + (t * 7) % CH] = if t % 2 == 0 { 300.0 } else { -200.0 };
    }
    x
}

#[test]
fn pages_read_as_each_sealed_block_decodes() {
    for spelling in [
        "int2-ch+sink4+out2",
        "int3-g16+out1+secded84",
        "int2-ch8+out5",
    ] {
        let form: CacheForm = spelling.parse().unwrap();
        let mut part = open_part(form, BS, CH, 6, &Fitted::default()).unwrap();
        assert!(part_seals(form, BS), "{spelling}");
        let pages: Vec<u32> = vec![4, 1, 5, 0];
        let tokens = 3 * BS + 3;
        let x = rows(tokens, 1);
        common::write_and_seal(part.as_mut(), &pages, &x);
        // Sink tokens seal exact inside the block holding them.
        assert_eq!(part.staged_blocks(), 1, "{spelling}");
        let sink = form.segments().sink;
        let staged = common::f16_rows(&x, CH);
        let sealed = form.without_segments();
        let mut want = Vec::new();
        for b in 0..3 {
            let block = &staged[b * BS * CH..][..BS * CH];
            let exact = sink.saturating_sub(b * BS);
            let store = SparseStore::quantize_with_exact(sealed, block, BS, CH, exact).unwrap();
            assert_eq!(store.exact_rows(), exact);
            let mut out = vec![0.0; BS * CH];
            store
                .decode_rows_into(0, BS, &mut out, &mut DecodeScratch::new())
                .unwrap();
            assert_eq!(out[..exact * CH], block[..exact * CH], "sink rows exact");
            assert_eq!(part.block_bytes(pages[b] as usize), store.stored_bytes());
            if exact == 0 {
                assert_eq!(part.sealed_block_bytes(), store.stored_bytes());
            }
            want.extend(out);
        }
        want.extend_from_slice(&staged[3 * BS * CH..]);
        // The far values read exactly where they were sealed.
        for t in (0..3 * BS).step_by(5) {
            let c = t * CH + (t * 7) % CH;
            assert_eq!(want[c], staged[c], "{spelling}: token {t}");
        }
        for (start, count) in [
            (0, tokens),
            (3, 9),
            (BS, BS),
            (2 * BS + 5, tokens - 2 * BS - 5),
        ] {
            assert_eq!(
                common::f32_tile(part.as_ref(), &pages, start, count),
                &want[start * CH..][..count * CH],
                "{spelling}: {start}+{count}"
            );
        }
        // Snapshots restore bit for bit, sealed and staged.
        for &p in &pages {
            let snap = part.snapshot(p as usize).unwrap();
            assert!(part.accepts(&snap));
            part.restore(2, &snap).unwrap();
            assert_eq!(part.snapshot(2).unwrap(), snap);
        }
        let pool = part_pool_bytes(form, BS, CH, 6, &Fitted::default()).unwrap();
        assert!(pool.blocks >= 6 * part.sealed_block_bytes() as u64);
    }
}

/// `+pre`: a sealed block holds its rows rotated back to position 0 (from
/// its first row's position) and reads them rotated to their positions
/// again; the part refuses to open without the model's RoPE.
#[test]
fn keys_coded_before_rope_read_back_at_their_positions() {
    let form: CacheForm = "int4-ch+sink3+out2+clip+pre".parse().unwrap();
    let rope = Rope::new(RopeLayout::Adjacent, 16, 16, 10_000.0).unwrap();
    let fitted = Fitted {
        rope: Some(rope.clone()),
        ..Fitted::default()
    };
    let mut part = open_part(form, BS, CH, 6, &fitted).unwrap();
    let pages: Vec<u32> = vec![3, 0, 5];
    let tokens = 2 * BS + 2;
    let x = rows(tokens, 9);
    common::write_and_seal(part.as_mut(), &pages, &x);
    let staged = common::f16_rows(&x, CH);
    let sealed = form.without_segments();
    let mut want = Vec::new();
    for b in 0..2 {
        // Sink rows stay as written; the others are coded before RoPE.
        let exact = 3usize.saturating_sub(b * BS);
        let mut block = staged[b * BS * CH..][..BS * CH].to_vec();
        for (i, row) in block.chunks_exact_mut(CH).enumerate().skip(exact) {
            rope.undo(row, b * BS + i).unwrap();
        }
        let store = SparseStore::quantize_with_exact(sealed, &block, BS, CH, exact).unwrap();
        let mut out = vec![0.0; BS * CH];
        store
            .decode_rows_into(0, BS, &mut out, &mut DecodeScratch::new())
            .unwrap();
        rope.apply_rows(&mut out[exact * CH..], CH, b * BS + exact)
            .unwrap();
        want.extend(out);
    }
    want.extend_from_slice(&staged[2 * BS * CH..]);
    for (start, count) in [(0, tokens), (5, 7), (BS + 1, BS + 1)] {
        assert_eq!(
            common::f32_tile(part.as_ref(), &pages, start, count),
            &want[start * CH..][..count * CH],
            "{start}+{count}"
        );
    }
    // Near the staged rows: a 4-bit code and a RoPE round trip away.
    let err = want[..2 * BS * CH]
        .iter()
        .zip(&staged)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    assert!(err < 0.2, "{err}");
    // Sink rows read as written, bit for bit.
    assert_eq!(want[..3 * CH], staged[..3 * CH]);
    // A sealed block restored elsewhere keeps its positions: read as the
    // first page of a table, it still rotates to positions BS.. .
    let snap = part.snapshot(pages[1] as usize).unwrap();
    assert_eq!(snap.sparse().unwrap().first, BS);
    part.restore(1, &snap).unwrap();
    assert_eq!(
        common::f32_tile(part.as_ref(), &[1], 0, BS),
        &want[BS * CH..2 * BS * CH]
    );
    // A block claiming another position than its sink rows say is refused.
    let sink_block = part.snapshot(pages[0] as usize).unwrap();
    let mut moved = sink_block.sparse().unwrap().clone();
    moved.first = BS;
    assert!(!part.accepts(&attention::stored::PartBlock::of_sparse(moved)));
    // Without the model's RoPE, or with heads that do not divide the rows.
    for fitted in [
        Fitted::default(),
        Fitted {
            rope: Some(Rope::new(RopeLayout::Adjacent, 24, 24, 10_000.0).unwrap()),
            ..Fitted::default()
        },
    ] {
        let e = match open_part(form, BS, CH, 2, &fitted) {
            Err(e) => e.to_string(),
            Ok(_) => panic!("opened"),
        };
        assert!(e.contains("RoPE") || e.contains("divide"), "{e}");
    }
}

#[test]
fn outlier_faults_are_counted_corrected_and_scrubbed() {
    let form: CacheForm = "int2-ch+out5+secded84".parse().unwrap();
    let mut part = open_part(form, BS, CH, 2, &Fitted::default()).unwrap();
    let pages = [1u32];
    let x = rows(BS, 3);
    common::write_and_seal(part.as_mut(), &pages, &x);
    let clean = common::f32_tile(part.as_ref(), &pages, 0, BS);
    // Bit 0 of every buffer: each table's first word and the dense
    // store's, all corrected by their codes.
    let hit = part
        .inject(1, &ExactFlips::new([0]), 5, FaultTarget::Everything)
        .unwrap();
    assert_eq!(hit.exact.len(), 1, "one flip in the outlier values");
    assert_eq!(hit.tables.len(), 1, "one flip in their positions");
    let mut scratch = PartScratch::default();
    let read = part.read_tile(&pages, 0, BS, &mut scratch).unwrap();
    let stats = read.stats;
    let TileRows::F32(got) = read.rows else {
        unreachable!()
    };
    assert_eq!(got, &clean[..]);
    assert!(stats.values.corrected >= 2, "{stats:?}");
    assert!(stats.metadata.corrected >= 1, "{stats:?}");
    assert_eq!(stats.values.silent + stats.metadata.silent, 0);
    let scrubbed = part.scrub(1).unwrap();
    assert!(scrubbed.values.corrected >= 2 && scrubbed.metadata.corrected >= 1);
    let again = part.scrub(1).unwrap();
    assert_eq!(again.values.corrected + again.metadata.corrected, 0);
    assert_eq!(common::f32_tile(part.as_ref(), &pages, 0, BS), clean);
}

#[test]
fn what_blocks_cannot_hold_is_refused() {
    let refused = |spelling: &str, block: usize| match open_part(
        spelling.parse().unwrap(),
        block,
        CH,
        4,
        &Fitted::default(),
    ) {
        Err(e) => e.to_string(),
        Ok(_) => panic!("{spelling} accepted in blocks of {block}"),
    };
    let e = refused("int2-ch16+out1", BS);
    assert!(e.contains("-ch8"), "{e}");
    let e = refused("int2-g12+out1", BS);
    assert!(e.contains("do not divide"), "{e}");
    assert!(!part_seals("int2-ch16+out1".parse().unwrap(), BS));
    // The re-encode protocol refuses the form before any work.
    let form: CacheForm = "int2-ch+out1".parse().unwrap();
    let fp16: CacheForm = "fp16".parse().unwrap();
    let e = attention::stored::check_layer_forms(fp16, form, true)
        .unwrap_err()
        .to_string();
    assert!(e.contains("--backend paged"), "{e}");
}
