//! The calibrated Shard part (`stored::ShardPart`) through the stored-layer
//! interface: rows written one at a time into scattered blocks read back,
//! tile by tile over the pages, as exactly what the calibrated tables code
//! each sealed block to (keys: RoPE undone at the block's positions, coded
//! on the calibration's basis and bit allocation, rebuilt and rotated
//! back; values: coded on the calibration's codebook or in NF4) and as the
//! f16 rows of blocks in the sink or the window; snapshots restore bit for
//! bit and are refused by a part on other tables; a flipped code is read;
//! a coded spelling stores codes and scales under its codes, corrects and
//! scrubs single flips and counts every word; folded spellings and coded
//! NF4 values are refused. The forms fitted per sequence
//! are `tests/stored_shard_sequence.rs`'s.

mod common;

use std::sync::Arc;

use attention::stored::{
    Fitted, ShardBlock, ShardTables, StoredPart, check_part_form, open_part, part_seals,
};
use attention::{Rope, RopeLayout};
use gf2_codes::channel::ExactFlips;
use kv_lowrank::{Basis, BasisStorage, ShardKeys};
use kv_quant::{
    CacheForm, ChannelVq, DecodeScratch, FaultTarget, FitOptions, QuantizeOptions, RankRule,
};

const HEAD_DIM: usize = 16;
const CH: usize = 2 * HEAD_DIM;
const BS: usize = 4;
/// Sink 2 (block 0 exact), window 8 (the last two or three blocks exact).
const FORM: &str = "shard-k3-cal+sink2+win8";

fn rows(tokens: usize, seed: u64) -> Vec<f32> {
    common::structured_rows(tokens, CH, seed, 0.3)
}

fn rope() -> Rope {
    Rope::new(RopeLayout::Adjacent, HEAD_DIM, HEAD_DIM, 10_000.0).unwrap()
}

/// Tables fitted on 512 calibration rows, as `kv-eval calibrate` fits them.
fn tables() -> (ShardTables, ShardTables) {
    let n = 512;
    let mut keys = rows(n, 99);
    for (t, row) in keys.chunks_exact_mut(CH).enumerate() {
        rope().undo(row, t % 64).unwrap();
    }
    let (basis, _) = Basis::fit(&keys, n, CH, RankRule::Fixed(16), BasisStorage::Int8).unwrap();
    let keys = ShardKeys::with_basis(&keys, n, &basis, 3.0, 8).unwrap();
    let values = ChannelVq::fit(&rows(n, 98), n, CH, HEAD_DIM, FitOptions::default()).unwrap();
    (
        ShardTables::Keys {
            prototype: Arc::new(keys),
            rope: rope(),
        },
        ShardTables::Values {
            prototype: Some(Arc::new(values)),
            head_dim: HEAD_DIM,
        },
    )
}

fn fitted(t: &ShardTables) -> Fitted {
    Fitted {
        shard: Some(t.clone()),
        ..Fitted::default()
    }
}

/// Writes `x` (`tokens` rows) into `pages` and seals what the step from 0
/// to `tokens` makes sealable.
fn write(part: &mut dyn StoredPart, pages: &[u32], x: &[f32], tokens: usize) {
    let mut encoder = part.row_encoder().unwrap();
    let mut buf = kv_quant::RowBuffers::new(encoder.buffer_sizes(1));
    for &p in pages {
        part.open_block(p as usize).unwrap();
    }
    for t in 0..tokens {
        encoder
            .encode_into(&x[t * CH..][..CH], buf.as_mut(), QuantizeOptions::default())
            .unwrap();
        part.put_row(pages[t / BS] as usize, t % BS, &buf).unwrap();
    }
    for i in part.sealable(0, tokens) {
        assert!(part.seal(pages[i] as usize, i * BS).unwrap());
    }
}

fn read(part: &dyn StoredPart, pages: &[u32], start: usize, count: usize) -> Vec<f32> {
    common::f32_tile(part, pages, start, count)
}

#[test]
fn pages_read_as_the_calibrated_tables_code_each_block() {
    let form: CacheForm = FORM.parse().unwrap();
    assert!(part_seals(form, BS));
    let (key_tables, value_tables) = tables();
    // 7 blocks, the last one partly written: block 0 holds the sink,
    // blocks 4-6 hold the window's rows, blocks 1-3 are sealed.
    let tokens = 6 * BS + 2;
    let pages: Vec<u32> = vec![9, 3, 7, 0, 5, 1, 8];
    for (tables, seed) in [(&key_tables, 1), (&value_tables, 2)] {
        let mut part = open_part(form, BS, CH, 10, &fitted(tables)).unwrap();
        let x = rows(tokens, seed);
        write(part.as_mut(), &pages, &x, tokens);
        assert_eq!(part.sealable(0, tokens), 1..4);
        assert_eq!(part.staged_blocks(), 4);
        let staged = common::f16_rows(&x, CH);
        let mut want = staged.clone();
        // Value tiles come in the codebook's Hadamard rotation (the
        // attention sum is rotated back once per output): exact rows
        // rotated, sealed rows as the codebook reads them rotated.
        let rotation = part.rotation();
        assert_eq!(
            rotation.is_some(),
            matches!(tables, ShardTables::Values { .. })
        );
        let mut want_tile = staged.clone();
        if let Some(h) = rotation {
            h.rotate(&mut want_tile);
        }
        for b in 1..4 {
            let block = &staged[b * BS * CH..][..BS * CH];
            let got = &mut want[b * BS * CH..][..BS * CH];
            match tables {
                ShardTables::Keys { prototype, rope } => {
                    let mut unrotated = block.to_vec();
                    for (i, row) in unrotated.chunks_exact_mut(CH).enumerate() {
                        rope.undo(row, b * BS + i).unwrap();
                    }
                    let coded = prototype.encode_chunk(&unrotated, BS).unwrap();
                    for (i, row) in got.chunks_exact_mut(CH).enumerate() {
                        coded.reconstruct_into(i, row).unwrap();
                        rope.apply(row, b * BS + i).unwrap();
                    }
                }
                ShardTables::Values { prototype, .. } => {
                    let coded = prototype.as_ref().unwrap().encode_chunk(block, BS).unwrap();
                    coded.decode_rows_into(0, BS, got).unwrap();
                    coded
                        .rotated_rows_into(0, BS, &mut want_tile[b * BS * CH..][..BS * CH])
                        .unwrap();
                }
            }
        }
        if rotation.is_none() {
            want_tile.clone_from(&want);
        }
        // Keys are rebuilt as one GEMM per page (faer), the reference row
        // by row: equal within f32 rounding of the sums (values and exact
        // rows bit for bit).
        for (start, count) in [
            (0, tokens),
            (3, 9),
            (BS, BS),
            (2 * BS + 1, tokens - 2 * BS - 1),
        ] {
            let got = read(part.as_ref(), &pages, start, count);
            let want = &want_tile[start * CH..][..count * CH];
            for (i, (g, w)) in got.iter().zip(want).enumerate() {
                assert!(
                    (g - w).abs() <= 1e-5 * (1.0 + w.abs()),
                    "{start}+{count} [{i}]: {g} vs {w}"
                );
            }
            if matches!(tables, ShardTables::Values { .. }) {
                assert_eq!(got, want, "{start}+{count}");
            }
        }
        // Rows read one block at a time come unrotated.
        for (b, &page) in pages.iter().enumerate() {
            let n = if b == 6 { 2 } else { BS };
            let mut got = vec![0.0; n * CH];
            part.read_rows(page as usize, 0, &mut got, &mut DecodeScratch::new())
                .unwrap();
            let want = &want[b * BS * CH..][..n * CH];
            for (g, w) in got.iter().zip(want) {
                assert!(
                    (g - w).abs() <= 1e-5 * (1.0 + w.abs()),
                    "block {b}: {g} vs {w}"
                );
            }
            if rotation.is_some() {
                assert_eq!(got, want, "block {b}");
            }
        }
        // A sealed block is coded: it reads other than its exact rows,
        // and holds fewer bytes.
        assert_ne!(want[BS * CH..2 * BS * CH], staged[BS * CH..2 * BS * CH]);
        assert!(part.block_bytes(pages[1] as usize) < part.block_bytes(pages[0] as usize));
        // Snapshots restore bit for bit, sealed and staged.
        for &p in &pages {
            let snap = part.snapshot(p as usize).unwrap();
            assert!(part.accepts(&snap));
            part.restore(2, &snap).unwrap();
            assert_eq!(part.snapshot(2).unwrap(), snap);
        }
        // A flipped code of a sealed block is read.
        let before = read(part.as_ref(), &pages, BS, BS);
        let hit = part
            .inject(
                pages[1] as usize,
                &ExactFlips::new([3]),
                0,
                FaultTarget::Values,
            )
            .unwrap();
        assert_eq!(hit.total(), 1);
        assert_ne!(read(part.as_ref(), &pages, BS, BS), before);
        // The block's f16 scales are stored bits too: `metadata` flips them
        // and not the codes, `everything` both (the scales on stream 1).
        let block = pages[2] as usize;
        let codes = |part: &dyn StoredPart| match part.snapshot(block).unwrap().shard() {
            Some(ShardBlock::Keys { keys, .. }) => keys.codes().to_vec(),
            Some(ShardBlock::Vq { values, .. }) => values.indices().to_vec(),
            other => panic!("a sealed block: {other:?}"),
        };
        let (before, stored) = (
            read(part.as_ref(), &pages, 2 * BS, BS),
            codes(part.as_ref()),
        );
        let flip = ExactFlips::new([3]);
        let hit = part.inject(block, &flip, 0, FaultTarget::Metadata).unwrap();
        assert_eq!((hit.values.len(), hit.scales.len()), (0, 1));
        assert_eq!(codes(part.as_ref()), stored);
        assert_ne!(read(part.as_ref(), &pages, 2 * BS, BS), before);
        let hit = part
            .inject(block, &flip, 0, FaultTarget::Everything)
            .unwrap();
        assert_eq!((hit.values.len(), hit.scales.len()), (1, 1));
        assert_ne!(codes(part.as_ref()), stored);
    }
}

#[test]
fn a_sealed_key_block_is_refused_by_a_part_on_other_tables() {
    let form: CacheForm = FORM.parse().unwrap();
    let (keys, values) = tables();
    let mut a = open_part(form, BS, CH, 4, &fitted(&keys)).unwrap();
    let x = rows(4 * BS, 5);
    write(a.as_mut(), &[0, 1, 2, 3], &x, 4 * BS);
    let snap = a.snapshot(1).unwrap();
    assert!(matches!(
        snap.shard(),
        Some(ShardBlock::Keys { first: 4, .. })
    ));
    let v = open_part(form, BS, CH, 4, &fitted(&values)).unwrap();
    assert!(!v.accepts(&snap));
    let other = {
        let n = 256;
        let cal = rows(n, 77);
        let (basis, _) = Basis::fit(&cal, n, CH, RankRule::Fixed(8), BasisStorage::Int8).unwrap();
        ShardTables::Keys {
            prototype: Arc::new(ShardKeys::with_basis(&cal, n, &basis, 3.0, 8).unwrap()),
            rope: rope(),
        }
    };
    let mut b = open_part(form, BS, CH, 4, &fitted(&other)).unwrap();
    assert!(!b.accepts(&snap));
    assert!(b.restore(0, &snap).is_err());
    // A value block on the same codebook rotated in heads of another width
    // reads in other coordinates than the part's tiles: refused too.
    let ShardTables::Values { prototype, .. } = &values else {
        unreachable!("value tables")
    };
    let narrow = ShardTables::Values {
        prototype: Some(Arc::new(
            ChannelVq::from_codebook(CH, HEAD_DIM / 2, prototype.as_ref().unwrap().centroids())
                .unwrap(),
        )),
        head_dim: HEAD_DIM / 2,
    };
    let mut n = open_part(form, BS, CH, 4, &fitted(&narrow)).unwrap();
    write(n.as_mut(), &[0, 1, 2, 3], &x, 4 * BS);
    let narrow_snap = n.snapshot(1).unwrap();
    assert!(n.accepts(&narrow_snap));
    let mut v = v;
    assert!(!v.accepts(&narrow_snap));
    assert!(v.restore(0, &narrow_snap).is_err());
}

#[test]
fn what_the_shard_part_cannot_hold_is_refused() {
    for spelling in [
        "shard-k3-cal-vnf4+secded84",
        "shard-k3-cal-f16",
        "shard-k3-f16",
    ] {
        let form: CacheForm = spelling.parse().unwrap();
        assert!(check_part_form(form, BS).is_err(), "{spelling}");
        assert!(!part_seals(form, BS), "{spelling}");
    }
    let form: CacheForm = FORM.parse().unwrap();
    assert!(check_part_form(form, 2).is_err());
    let e = match open_part(form, BS, CH, 4, &Fitted::default()) {
        Err(e) => e.to_string(),
        Ok(_) => panic!("accepted without tables"),
    };
    assert!(e.contains("calibrated key basis"), "{e}");
    // A coded VQ form handed NF4 tables (no codebook): refused, not a panic.
    let coded: CacheForm = format!("{FORM}+secded84").parse().unwrap();
    let nf4 = ShardTables::Values {
        prototype: None,
        head_dim: HEAD_DIM,
    };
    assert!(open_part(coded, BS, CH, 4, &fitted(&nf4)).is_err());
}

#[test]
fn the_shared_tables_are_stored_bits_every_block_reads_through() {
    let form: CacheForm = FORM.parse().unwrap();
    let (key_tables, value_tables) = tables();
    // Blocks 1-3 sealed (block 0 holds the sink, 4-5 the window).
    let tokens = 6 * BS;
    let pages: Vec<u32> = (0..6).collect();
    for (tables, seed) in [(&key_tables, 1), (&value_tables, 2)] {
        let mut part = open_part(form, BS, CH, 8, &fitted(tables)).unwrap();
        write(part.as_mut(), &pages, &rows(tokens, seed), tokens);
        let snap = part.snapshot(1).unwrap();
        // A bit of a word block 1 reads: the first key basis row's f16
        // scale (every key reads it), or a centroid block 1's first group
        // names (4 f16 values of 2 bytes each).
        let bit = match snap.shard() {
            Some(ShardBlock::Keys { .. }) => 6,
            Some(ShardBlock::Vq { values, .. }) => u64::from(values.indices()[0]) * 64 + 6,
            other => panic!("a sealed block: {other:?}"),
        };
        let flip = ExactFlips::new([bit]);
        let before = read(part.as_ref(), &pages, BS, BS);
        assert!(part.shared_bytes() > 0);
        let hit = part.inject_shared(&flip, 0, FaultTarget::Values).unwrap();
        assert_eq!(hit.total(), 0, "the tables are metadata");
        let hit = part.inject_shared(&flip, 0, FaultTarget::Metadata).unwrap();
        assert_eq!(hit.tables.len(), 1);
        // Unprotected (a bare spelling): read silently.
        assert_eq!(part.shared_stats().silent, 1);
        let after = read(part.as_ref(), &pages, BS, BS);
        assert_ne!(after, before);
        // A block restored from before the fault reads the tables as they
        // are now, like every other block, and a snapshot taken now is
        // accepted too.
        assert!(part.accepts(&snap));
        part.restore(7, &snap).unwrap();
        let moved = [0, 7, 2, 3, 4, 5];
        assert_eq!(read(part.as_ref(), &moved, BS, BS), after);
        let resealed = part.snapshot(1).unwrap();
        assert!(part.accepts(&resealed));
        assert_eq!(part.scrub_shared().unwrap().corrected, 0);
    }
}

#[test]
fn a_coded_spelling_stores_codes_and_scales_under_its_codes() {
    use attention::stored::BlockGuard;
    use gf2_codes::batch::Int4Code;
    use kv_quant::MetaProtection;
    let bare: CacheForm = FORM.parse().unwrap();
    let coded: CacheForm = format!("{FORM}+secded84").parse().unwrap();
    assert!(part_seals(coded, BS));
    let (key_tables, value_tables) = tables();
    let tokens = 6 * BS;
    let pages: Vec<u32> = vec![5, 0, 4, 1, 3, 2];
    for (tables, seed) in [(&key_tables, 1), (&value_tables, 2)] {
        let mut plain = open_part(bare, BS, CH, 6, &fitted(tables)).unwrap();
        let mut part = open_part(coded, BS, CH, 6, &fitted(tables)).unwrap();
        let x = rows(tokens, seed);
        write(plain.as_mut(), &pages, &x, tokens);
        write(part.as_mut(), &pages, &x, tokens);
        // The same values, read through the codes.
        let clean = read(part.as_ref(), &pages, 0, tokens);
        assert_eq!(clean, read(plain.as_ref(), &pages, 0, tokens));
        // A sealed block's bytes: the codes' nibbles a byte each under
        // SECDED(8,4), the f16 scales with RM(2,5)'s two check bytes.
        let block = pages[1] as usize;
        let snap = part.snapshot(block).unwrap();
        let (codes, scales) = match snap.shard() {
            Some(ShardBlock::Keys { keys, guard, .. }) => {
                assert!(guard.is_some());
                (keys.codes().len(), keys.scales().len())
            }
            Some(ShardBlock::Vq { values, guard }) => {
                assert!(guard.is_some());
                (values.indices().len(), values.max().len())
            }
            other => panic!("a sealed block: {other:?}"),
        };
        let want = BlockGuard::stored_len(
            Int4Code::Secded84,
            MetaProtection::ReedMuller,
            codes,
            scales,
        );
        assert_eq!(part.block_bytes(block), want);
        assert_eq!(part.sealed_block_bytes(), want);
        assert_eq!(plain.block_bytes(block), codes + 2 * scales);
        // A bare block is refused by the coded part and the other way round.
        assert!(!part.accepts(&plain.snapshot(block).unwrap()));
        assert!(!plain.accepts(&snap));
        // One flip in a code word and one in a scale's word: corrected,
        // the block reads as written, and the read counts every word.
        let stats = |part: &dyn StoredPart| {
            let mut out = vec![0.0; BS * CH];
            part.read_rows(block, 0, &mut out, &mut DecodeScratch::new())
                .unwrap()
        };
        assert_eq!(stats(part.as_ref()).values.clean, 2 * codes as u64);
        let hit = part
            .inject(block, &ExactFlips::new([3]), 0, FaultTarget::Everything)
            .unwrap();
        assert_eq!(hit.total(), 2, "a code bit and a scale bit: {hit:?}");
        assert_eq!(read(part.as_ref(), &pages, 0, tokens), clean);
        let s = stats(part.as_ref());
        assert_eq!((s.values.corrected, s.metadata.corrected), (1, 1));
        // Swapped out and back, the flips travel with the block.
        let faulted = part.snapshot(block).unwrap();
        part.restore(pages[0] as usize, &faulted).unwrap();
        assert_eq!(part.snapshot(pages[0] as usize).unwrap(), faulted);
        part.restore(pages[0] as usize, &snap).unwrap();
        // A scrub rewrites both words; the next read finds them clean.
        let scrub = part.scrub(block).unwrap();
        assert_eq!((scrub.values.corrected, scrub.metadata.corrected), (1, 1));
        let s = stats(part.as_ref());
        assert_eq!(s.values.corrected + s.metadata.corrected, 0);
        assert_eq!(part.snapshot(block).unwrap(), snap);
        // Two flips in one code word: detected, its received data kept.
        part.inject(block, &ExactFlips::new([0, 1]), 0, FaultTarget::Values)
            .unwrap();
        let s = stats(part.as_ref());
        assert_eq!((s.values.detected, s.erased_values), (1, 0));
        assert_eq!(part.scrub(block).unwrap().values.detected, 1);
        // The shared table under RM(2,5): a flip is corrected, every block
        // reads as before.
        let before = read(part.as_ref(), &pages, 0, tokens);
        let hit = part
            .inject_shared(&ExactFlips::new([6]), 0, FaultTarget::Metadata)
            .unwrap();
        assert_eq!(hit.tables.len(), 1);
        assert_eq!(part.shared_stats().corrected, 1);
        assert_eq!(read(part.as_ref(), &pages, 0, tokens), before);
        // Staged blocks hold f16 rows under the same code.
        assert!(part.block_bytes(pages[5] as usize) > plain.block_bytes(pages[5] as usize));
    }
}
