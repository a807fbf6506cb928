//! The calibrated low-rank part (`stored::LowRankPart`) through the
//! stored-layer interface: rows written one at a time into scattered
//! blocks read back, tile by tile over the pages, as exactly the rows a
//! kv-lowrank store of each sealed block reconstructs (the block's rows as
//! staged, f16) and as the f16 rows of the block still written; snapshots
//! restore bit for bit; a flipped coefficient bit is counted and read;
//! keys projected before RoPE are rotated back from each block's position
//! when sealed and to it when read; the form without its bases (or a
//! `-pre` form without the model's RoPE) and online forms are refused.

mod common;

use std::sync::Arc;

use attention::stored::{Fitted, PartBlock, PartScratch, StoredPart, check_part_form, open_part};
use attention::{Rope, RopeLayout, TileRows};
use gf2_codes::channel::ExactFlips;
use kv_lowrank::{HeadBases, LowRankStore};
use kv_quant::{CacheForm, DecodeScratch, FaultTarget, QuantizeOptions};

const HEADS: usize = 2;
const HEAD_DIM: usize = 16;
const CH: usize = HEADS * HEAD_DIM;
const BS: usize = 8;

fn rows(tokens: usize, seed: u64) -> Vec<f32> {
    common::structured_rows(tokens, CH, seed, 0.1)
}

fn bases() -> Arc<HeadBases> {
    common::fitted_bases(&rows(256, 99), HEADS, HEAD_DIM, 4)
}

#[test]
fn pages_read_as_each_sealed_block_reconstructs() {
    let form: CacheForm = "pca-r4".parse().unwrap();
    let fitted = Fitted {
        bases: Some(bases()),
        ..Fitted::default()
    };
    let blocks = 6;
    let mut part = open_part(form, BS, CH, blocks, &fitted).unwrap();
    assert_eq!(
        part.shared_bytes(),
        fitted.bases.as_ref().unwrap().stored_bytes()
    );
    let pages: Vec<u32> = vec![4, 1, 5, 0];
    let tokens = 3 * BS + 3;
    let x = rows(tokens, 1);
    assert_eq!(part.sealable(0, tokens), 0..3);
    common::write_and_seal(part.as_mut(), &pages, &x);
    assert_eq!(part.staged_blocks(), 1);
    // Expected: full blocks reconstructed from a store of their f16 rows,
    // the last block's rows f16.
    let staged = common::f16_rows(&x, CH);
    let mut want = Vec::new();
    for b in 0..3 {
        let block = &staged[b * BS * CH..][..BS * CH];
        let store =
            LowRankStore::build(form, block, BS, CH, HEAD_DIM, fitted.bases.as_deref()).unwrap();
        let mut out = vec![0.0; BS * CH];
        store
            .decode_rows_into(0, BS, &mut out, &mut kv_lowrank::StoreScratch::default())
            .unwrap();
        want.extend(out);
    }
    want.extend_from_slice(&staged[3 * BS * CH..]);
    let mut scratch = PartScratch::default();
    for (start, count) in [
        (0, tokens),
        (3, 9),
        (BS, BS),
        (2 * BS + 5, tokens - 2 * BS - 5),
    ] {
        let tile = part.read_tile(&pages, start, count, &mut scratch).unwrap();
        let TileRows::F32(got) = tile.rows else {
            panic!("reconstructed rows are f32")
        };
        assert_eq!(got, &want[start * CH..][..count * CH], "{start}+{count}");
    }
    // Snapshots restore bit for bit, sealed and staged.
    for &p in &pages {
        let snap = part.snapshot(p as usize).unwrap();
        assert!(part.accepts(&snap));
        part.restore(2, &snap).unwrap();
        assert_eq!(part.snapshot(2).unwrap(), snap);
    }
    // A flipped coefficient bit of a sealed block is counted and read (the
    // exact channel flips bit 3 of each head's coefficient store).
    let before = part.read_tile(&pages, 0, BS, &mut scratch).unwrap();
    let TileRows::F32(before) = before.rows else {
        unreachable!()
    };
    let before = before.to_vec();
    let hit = part
        .inject(
            pages[0] as usize,
            &ExactFlips::new([3]),
            0,
            FaultTarget::Values,
        )
        .unwrap();
    assert_eq!(hit.total(), HEADS);
    let after = part.read_tile(&pages, 0, BS, &mut scratch).unwrap();
    let TileRows::F32(after) = after.rows else {
        unreachable!()
    };
    assert_ne!(after, &before[..]);
    let mut row = vec![0.0; CH];
    part.read_rows(pages[3] as usize, 0, &mut row, &mut DecodeScratch::new())
        .unwrap();
    assert_eq!(row, staged[3 * BS * CH..][..CH]);
}

#[test]
fn what_the_low_rank_part_cannot_hold_is_refused() {
    let pca: CacheForm = "pca-r4".parse().unwrap();
    let refused = |r: attention::Result<Box<dyn StoredPart>>| match r {
        Err(e) => e.to_string(),
        Ok(_) => panic!("accepted"),
    };
    let e = refused(open_part(pca, BS, CH, 4, &Fitted::default()));
    assert!(e.contains("needs its calibrated bases"), "{e}");
    let fd: CacheForm = "fd-r4".parse().unwrap();
    assert!(check_part_form(fd, BS).is_err());
    let pre: CacheForm = "pca-r4-pre".parse().unwrap();
    assert!(check_part_form(pre, BS).is_ok());
    assert!(check_part_form(pca, 1).is_err());
    // Bases that do not cover the rows.
    let fitted = Fitted {
        bases: Some(bases()),
        ..Fitted::default()
    };
    let e = refused(open_part(pca, BS, 2 * CH, 4, &fitted));
    assert!(e.contains("do not cover"), "{e}");
    // Keys projected before RoPE without the model's RoPE, or with one of
    // other heads.
    let e = refused(open_part(pre, BS, CH, 4, &fitted));
    assert!(e.contains("needs the model's RoPE"), "{e}");
    let other = Fitted {
        rope: Some(Rope::new(RopeLayout::Adjacent, 2 * HEAD_DIM, 2 * HEAD_DIM, 1e4).unwrap()),
        ..fitted
    };
    let e = refused(open_part(pre, BS, CH, 4, &other));
    assert!(e.contains("heads of 32 channels"), "{e}");
}

/// Every row of `part` over `pages`, read as one tile.
fn read_all(part: &dyn StoredPart, pages: &[u32], tokens: usize) -> Vec<f32> {
    let mut scratch = PartScratch::default();
    let tile = part.read_tile(pages, 0, tokens, &mut scratch).unwrap();
    let TileRows::F32(got) = tile.rows else {
        panic!("reconstructed rows are f32")
    };
    got.to_vec()
}

#[test]
fn keys_projected_before_rope_turn_back_from_and_to_their_positions() {
    let form: CacheForm = "pca-r4-pre".parse().unwrap();
    let rope = Rope::new(RopeLayout::RotateHalf, HEAD_DIM, HEAD_DIM, 1e4).unwrap();
    let fitted = Fitted {
        bases: Some(bases()),
        rope: Some(rope.clone()),
        ..Fitted::default()
    };
    let mut part = open_part(form, BS, CH, 6, &fitted).unwrap();
    let pages: Vec<u32> = vec![3, 0, 5, 1];
    let tokens = 3 * BS + 2;
    // Keys as the model caches them: after RoPE at their positions.
    let mut x = rows(tokens, 7);
    rope.apply_rows(&mut x, CH, 0).unwrap();
    common::write_and_seal(part.as_mut(), &pages, &x);
    assert_eq!(part.staged_blocks(), 1);
    // Expected: each sealed block's staged (f16) rows rotated back from the
    // block's first position, projected, reconstructed and rotated again.
    let staged = common::f16_rows(&x, CH);
    let mut want = Vec::new();
    for b in 0..3 {
        let mut block = staged[b * BS * CH..][..BS * CH].to_vec();
        rope.undo_rows(&mut block, CH, b * BS).unwrap();
        let store =
            LowRankStore::build(form, &block, BS, CH, HEAD_DIM, fitted.bases.as_deref()).unwrap();
        let mut out = vec![0.0; BS * CH];
        store
            .decode_rows_into(0, BS, &mut out, &mut kv_lowrank::StoreScratch::default())
            .unwrap();
        rope.apply_rows(&mut out, CH, b * BS).unwrap();
        want.extend(out);
    }
    want.extend_from_slice(&staged[3 * BS * CH..]);
    assert_eq!(read_all(part.as_ref(), &pages, tokens), want);
    // Tiles starting inside blocks rotate each row to its own position.
    let mut scratch = PartScratch::default();
    for (start, count) in [(3, 9), (BS + 5, BS), (2 * BS + 5, tokens - 2 * BS - 5)] {
        let tile = part.read_tile(&pages, start, count, &mut scratch).unwrap();
        let TileRows::F32(got) = tile.rows else {
            panic!("reconstructed rows are f32")
        };
        assert_eq!(got, &want[start * CH..][..count * CH], "{start}+{count}");
    }
    // Keys before RoPE read at the wrong position would miss: the rows are
    // not merely the projection of the rotated keys.
    let store = LowRankStore::build(
        form,
        &staged[BS * CH..2 * BS * CH],
        BS,
        CH,
        HEAD_DIM,
        fitted.bases.as_deref(),
    )
    .unwrap();
    let mut unturned = vec![0.0; BS * CH];
    store
        .decode_rows_into(
            0,
            BS,
            &mut unturned,
            &mut kv_lowrank::StoreScratch::default(),
        )
        .unwrap();
    assert_ne!(unturned, want[BS * CH..2 * BS * CH]);
    // A snapshot keeps its block's position: restored into another block,
    // it reads its rows where they were.
    let snap = part.snapshot(pages[1] as usize).unwrap();
    assert_eq!(snap.first_position(), Some(BS));
    assert!(part.accepts(&snap));
    part.restore(2, &snap).unwrap();
    let mut block = vec![0.0; BS * CH];
    part.read_rows(2, 0, &mut block, &mut DecodeScratch::new())
        .unwrap();
    assert_eq!(block, want[BS * CH..2 * BS * CH]);
    // Sealed blocks of keys coded before RoPE carry their position:
    // without one, or at a position inside a block, they are refused.
    let unplaced = PartBlock::of_low_rank(snap.low_rank().unwrap().clone());
    assert!(!part.accepts(&unplaced));
    assert!(!part.accepts(&unplaced.at_position(BS + 1)));
    // A rollback into a sealed block stages it again from its rows at
    // their positions (f16): its first row rewritten, the others as they
    // read.
    let mut encoder = part.row_encoder().unwrap();
    let mut buf = kv_quant::RowBuffers::new(encoder.buffer_sizes(1));
    let row = 2 * BS;
    encoder
        .encode_into(
            &x[row * CH..][..CH],
            buf.as_mut(),
            QuantizeOptions::default(),
        )
        .unwrap();
    part.put_row(pages[2] as usize, 0, &buf).unwrap();
    assert!(part.is_staged(pages[2] as usize));
    let mut restaged = vec![0.0; BS * CH];
    let mut scratch = DecodeScratch::new();
    part.read_rows(pages[2] as usize, 0, &mut restaged, &mut scratch)
        .unwrap();
    assert_eq!(restaged[..CH], staged[row * CH..][..CH]);
    let rest = &want[(row + 1) * CH..(row + BS) * CH];
    assert_eq!(restaged[CH..], common::f16_rows(rest, CH)[..]);
}
