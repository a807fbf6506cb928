//! The calibrated low-rank part (`stored::LowRankPart`) through the
//! stored-layer interface: rows written one at a time into scattered
//! blocks read back, tile by tile over the pages, as exactly the rows a
//! kv-lowrank store of each sealed block reconstructs (the block's rows as
//! staged, f16) and as the f16 rows of the block still written; snapshots
//! restore bit for bit; a flipped coefficient bit is counted and read;
//! the form without its bases, online and pre-RoPE forms are refused.

mod common;

use std::sync::Arc;

use attention::TileRows;
use attention::stored::{Fitted, PartScratch, StoredPart, check_part_form, open_part};
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
    let mut encoder = part.row_encoder().unwrap();
    let mut buf = kv_quant::RowBuffers::new(encoder.buffer_sizes(1));
    for &p in &pages {
        part.open_block(p as usize).unwrap();
    }
    for t in 0..tokens {
        encoder
            .encode_into(&x[t * CH..][..CH], buf.as_mut(), QuantizeOptions::default())
            .unwrap();
        part.put_row(pages[t / BS] as usize, t % BS, &buf).unwrap();
    }
    let sealable = part.sealable(0, tokens);
    assert_eq!(sealable, 0..3);
    for i in sealable {
        assert!(part.seal(pages[i] as usize, i * BS).unwrap());
    }
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
    for spelling in ["fd-r4", "pca-r4-pre"] {
        let form: CacheForm = spelling.parse().unwrap();
        assert!(check_part_form(form, BS).is_err(), "{spelling}");
    }
    assert!(check_part_form(pca, 1).is_err());
    // Bases that do not cover the rows.
    let fitted = Fitted {
        bases: Some(bases()),
        ..Fitted::default()
    };
    let e = refused(open_part(pca, BS, 2 * CH, 4, &fitted));
    assert!(e.contains("do not cover"), "{e}");
}
