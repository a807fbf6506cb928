//! Per-channel groups over several blocks (`stored::GroupedPart`, kept as
//! one channel slice per block) through the stored-layer interface: rows
//! written one at a time into scattered blocks read back, tile by tile,
//! as exactly the rows one kv-quant store of each whole group holds (its
//! rows as staged, f16) and as the f16 rows of the group still written,
//! as levels where a tile lies in one sealed group; a group's blocks hold
//! a store of the whole group's bytes between them; snapshots restore bit
//! for bit; a flipped bit is counted and read; a cut back into a sealed
//! group stages its kept blocks again; what the part cannot do is refused.

mod common;

use attention::TileRows;
use attention::stored::{Fitted, PartScratch, StoredPart, open_part, part_pool_bytes};
use gf2_codes::channel::ExactFlips;
use kv_quant::{CacheForm, DecodeScratch, FaultTarget, KvStore, QuantizeOptions};

const CH: usize = 32;
const BS: usize = 8;

fn rows(tokens: usize, seed: u64) -> Vec<f32> {
    common::structured_rows(tokens, CH, seed, 0.1)
}

/// A part of `form` in `blocks` blocks, with `x`'s `tokens` rows written
/// on `pages` and every sealable group sealed.
fn written(
    form: &str,
    blocks: usize,
    pages: &[u32],
    x: &[f32],
    tokens: usize,
) -> Box<dyn StoredPart> {
    let form: CacheForm = form.parse().unwrap();
    let mut part = open_part(form, BS, CH, blocks, &Fitted::default()).unwrap();
    let mut encoder = part.row_encoder().unwrap();
    let mut buf = kv_quant::RowBuffers::new(encoder.buffer_sizes(1));
    for &p in &pages[..tokens.div_ceil(BS)] {
        part.open_block(p as usize).unwrap();
    }
    for t in 0..tokens {
        encoder
            .encode_into(&x[t * CH..][..CH], buf.as_mut(), QuantizeOptions::default())
            .unwrap();
        part.put_row(pages[t / BS] as usize, t % BS, &buf).unwrap();
    }
    for i in part.sealable(0, tokens) {
        part.seal_pages(pages, i).unwrap();
    }
    part
}

/// The rows a reader should see: each sealed group as one store of the
/// group's staged rows decodes them, the rest f16.
fn expected(form: &str, group: usize, sealed_groups: usize, x: &[f32]) -> Vec<f32> {
    let sealed: CacheForm = form.parse::<CacheForm>().unwrap().without_segments();
    let staged = common::f16_rows(x, CH);
    let mut want = Vec::new();
    for g in 0..sealed_groups {
        let rows = &staged[g * group * CH..][..group * CH];
        let store = KvStore::quantize(sealed, rows, group, CH).unwrap();
        let mut out = vec![0.0; group * CH];
        store
            .decode_rows_into(0, group, &mut out, &mut DecodeScratch::new())
            .unwrap();
        want.extend(out);
    }
    want.extend_from_slice(&staged[sealed_groups * group * CH..]);
    want
}

/// Rows `start..start + count` of `part` on `pages` as f32, and whether
/// the tile came as levels.
fn tile(part: &dyn StoredPart, pages: &[u32], start: usize, count: usize) -> (Vec<f32>, bool) {
    let mut scratch = PartScratch::default();
    let tile = part.read_tile(pages, start, count, &mut scratch).unwrap();
    match tile.rows {
        TileRows::F32(r) => (r.to_vec(), false),
        TileRows::F16(b) => (
            b.chunks_exact(2)
                .map(|h| half::f16::from_le_bytes([h[0], h[1]]).to_f32())
                .collect(),
            false,
        ),
        TileRows::Levels(l) => {
            let mut out = vec![0.0; count * CH];
            l.dequantize_into(&mut out);
            (out, true)
        }
        TileRows::PairCodes(_) => (tile.rows.to_f32_vec(), false),
    }
}

#[test]
fn pages_read_as_one_store_of_each_whole_group() {
    // Groups of 4 blocks of 8 (32 tokens), 2.5 groups written.
    let pages: Vec<u32> = vec![9, 2, 7, 0, 4, 11, 1, 5, 3, 10, 6];
    let tokens = 2 * 32 + 20;
    let x = rows(tokens, 1);
    for form in ["int4-ch32", "int2-ch32", "int4-ch32+secded84", "int8-ch32"] {
        let part = written(form, 12, &pages, &x, tokens);
        assert_eq!(part.staged_blocks(), 3, "{form}: the group being filled");
        let want = expected(form, 32, 2, &x);
        for (start, count) in [
            (0, tokens),
            (0, 32),
            (3, 9),
            (8, 8),
            (40, 24),
            (60, 16),
            (64, 20),
            (70, 3),
        ] {
            let (got, levels) = tile(part.as_ref(), &pages, start, count);
            for (i, (g, w)) in got.iter().zip(&want[start * CH..]).enumerate() {
                assert_eq!(
                    g.to_bits(),
                    w.to_bits(),
                    "{form}: rows {start}+{count}, value {i}"
                );
            }
            // A tile inside one sealed group reads as levels.
            let inside = (start + count) <= 64 && start / 32 == (start + count - 1) / 32;
            assert_eq!(levels, inside, "{form}: rows {start}+{count}");
        }
    }
}

#[test]
fn a_groups_blocks_hold_a_whole_group_store_between_them() {
    let form: CacheForm = "int4-ch32".parse().unwrap();
    let part = open_part(form, BS, CH, 6, &Fitted::default()).unwrap();
    let whole = KvStore::zeroed(form, 32, CH).unwrap().stored_bytes();
    assert_eq!(4 * part.sealed_block_bytes(), whole);
    // Half the parameter bytes of blocks that are groups of their own.
    let one = open_part("int4-ch8".parse().unwrap(), BS, CH, 6, &Fitted::default()).unwrap();
    let params = |g: usize| 2 * 2 * CH * (32 / g);
    assert_eq!(
        4 * one.sealed_block_bytes() - 4 * part.sealed_block_bytes(),
        params(8) - params(32)
    );
    let pool = part_pool_bytes(form, BS, CH, 6, &Fitted::default()).unwrap();
    assert!(pool.blocks >= 6 * part.block_bytes(0) as u64);
    assert_eq!(part.shareable_blocks(7), 4);
    assert_eq!(part.shareable_blocks(3), 0);
    let sinks = open_part(
        "int4-ch16+sink2".parse().unwrap(),
        BS,
        CH,
        6,
        &Fitted::default(),
    )
    .unwrap();
    assert_eq!(
        (0..6)
            .map(|b| sinks.shareable_blocks(b))
            .collect::<Vec<_>>(),
        [0, 1, 1, 3, 3, 5]
    );
}

#[test]
fn snapshots_restore_and_flips_are_counted_and_read() {
    let pages: Vec<u32> = vec![5, 1, 3, 0, 2, 4];
    let tokens = 32 + 4;
    let x = rows(tokens, 2);
    let mut part = written("int4-ch32+secded84", 8, &pages, &x, tokens);
    // Snapshots restore bit for bit, sealed slices and staged blocks; a
    // slice is not a staged block of another part.
    for &p in &pages[..5] {
        let snap = part.snapshot(p as usize).unwrap();
        assert!(part.accepts(&snap));
        part.restore(7, &snap).unwrap();
        assert_eq!(part.snapshot(7).unwrap(), snap);
    }
    let other = open_part("int4-ch64".parse().unwrap(), BS, CH, 8, &Fitted::default()).unwrap();
    assert!(!other.accepts(&part.snapshot(pages[0] as usize).unwrap()));
    // One flip in each of two words of block 0's slice: corrected and
    // counted on the read of the group, the values unchanged.
    let (before, _) = tile(part.as_ref(), &pages, 0, 32);
    let hit = part
        .inject(
            pages[0] as usize,
            &ExactFlips::new([1, 70]),
            0,
            FaultTarget::Values,
        )
        .unwrap();
    assert_eq!(hit.total(), 2);
    let mut scratch = PartScratch::default();
    let t = part.read_tile(&pages, 0, 32, &mut scratch).unwrap();
    assert_eq!(t.stats.values.corrected, 2);
    let (after, _) = tile(part.as_ref(), &pages, 0, 32);
    assert_eq!(before, after);
    let scrubbed = part.scrub(pages[0] as usize).unwrap();
    assert_eq!(scrubbed.values.corrected, 2);
    // Unprotected codes: a flipped level bit changes a value.
    let mut bare = written("int4-ch32", 8, &pages, &x, tokens);
    let (before, _) = tile(bare.as_ref(), &pages, 0, 32);
    bare.inject(
        pages[2] as usize,
        &ExactFlips::new([0]),
        0,
        FaultTarget::Values,
    )
    .unwrap();
    let (after, _) = tile(bare.as_ref(), &pages, 0, 32);
    let changed: Vec<usize> = (0..before.len())
        .filter(|&i| before[i] != after[i])
        .collect();
    // Bit 0 of block 2's slice: row 0, its first channel (channel 16).
    assert_eq!(changed, [16]);
}

#[test]
fn a_cut_into_a_sealed_group_stages_its_kept_blocks_again() {
    let pages: Vec<u32> = vec![3, 0, 6, 1, 5, 2];
    let tokens = 32 + 8;
    let x = rows(tokens, 3);
    let mut part = written("int4-ch32", 8, &pages, &x, tokens);
    let want = expected("int4-ch32", 32, 1, &x);
    assert_eq!(part.cut_blocks(32), 0..0, "a cut at a group's end keeps it");
    assert_eq!(part.cut_blocks(19), 0..3);
    assert_eq!(part.cut_blocks(0), 0..0);
    part.cut(&pages, 19).unwrap();
    assert_eq!(
        pages[..3]
            .iter()
            .map(|&p| part.is_staged(p as usize))
            .collect::<Vec<_>>(),
        [true; 3]
    );
    // The kept rows read as their sealed values did, rounded to f16.
    let (got, levels) = tile(part.as_ref(), &pages, 0, 19);
    assert!(!levels);
    assert_eq!(got, common::f16_rows(&want[..19 * CH], CH));
    // The cache drops the blocks past the cut: block 3 of the group is a
    // fresh one. Written again, the group seals again whole.
    let mut pages = pages;
    pages[3] = 7;
    part.open_block(7).unwrap();
    let mut encoder = part.row_encoder().unwrap();
    let mut buf = kv_quant::RowBuffers::new(encoder.buffer_sizes(1));
    for t in 19..32 {
        encoder
            .encode_into(&x[t * CH..][..CH], buf.as_mut(), QuantizeOptions::default())
            .unwrap();
        part.put_row(pages[t / BS] as usize, t % BS, &buf).unwrap();
    }
    assert_eq!(part.seal_pages(&pages, 0).unwrap(), 4);
    assert_eq!(part.seal_pages(&pages, 1).unwrap(), 0);
    assert_eq!(part.staged_blocks(), 1);
}

#[test]
fn what_a_grouped_part_cannot_do_is_refused() {
    let form: CacheForm = "int4-ch32".parse().unwrap();
    let refused = |r: attention::Result<Box<dyn StoredPart>>| match r {
        Err(e) => e.to_string(),
        Ok(_) => panic!("accepted"),
    };
    // Channels that do not split into even slices, one per block.
    let e = refused(open_part(form, BS, 36, 4, &Fitted::default()));
    assert!(e.contains("slices"), "{e}");
    assert!(
        refused(open_part(
            "int4-ch20".parse().unwrap(),
            BS,
            CH,
            4,
            &Fitted::default()
        ))
        .contains("never splits")
    );
    let pages: Vec<u32> = vec![0, 1, 2, 3, 4];
    let x = rows(36, 4);
    let mut part = written("int4-ch32", 6, &pages, &x, 36);
    // One block alone: not sealed, read or written as a group's slice.
    let e = part.seal(pages[4] as usize, 32).unwrap_err().to_string();
    assert!(e.contains("seal_pages"), "{e}");
    let mut row = vec![0.0; CH];
    let e = part
        .read_rows(pages[0] as usize, 0, &mut row, &mut DecodeScratch::new())
        .unwrap_err()
        .to_string();
    assert!(e.contains("channel slice"), "{e}");
    let encoder = part.row_encoder().unwrap();
    let mut buf = kv_quant::RowBuffers::new(encoder.buffer_sizes(1));
    let mut encoder = encoder;
    encoder
        .encode_into(&x[..CH], buf.as_mut(), QuantizeOptions::default())
        .unwrap();
    let e = part
        .put_row(pages[1] as usize, 0, &buf)
        .unwrap_err()
        .to_string();
    assert!(e.contains("cut the sequence"), "{e}");
    // Rows past the table, a table too short for a sealed group, and a
    // group partly sealed.
    let mut scratch = PartScratch::default();
    let e = part
        .read_tile(&pages[..4], 0, 40, &mut scratch)
        .unwrap_err()
        .to_string();
    assert!(e.contains("past"), "{e}");
    let e = part
        .read_tile(&pages[..2], 0, 8, &mut scratch)
        .unwrap_err()
        .to_string();
    assert!(e.contains("at least 4 blocks"), "{e}");
    let mixed = [pages[0], pages[1], pages[4], pages[3]];
    let e = part
        .read_tile(&mixed, 0, 8, &mut scratch)
        .unwrap_err()
        .to_string();
    assert!(e.contains("partly sealed"), "{e}");
    let e = part.seal_pages(&mixed, 0).unwrap_err().to_string();
    assert!(e.contains("partly sealed"), "{e}");
}
