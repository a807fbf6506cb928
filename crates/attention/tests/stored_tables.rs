//! Fitted tables (a `vq` codebook, `pca-*` bases) as stored, protected
//! bytes of a part (`stored::SharedTable`), through the stored-layer
//! interface: counted with their check words, hit only under targets that
//! reach metadata, corrected by the form's metadata code (RM(2,5) under
//! SECDED values) so every row reads as before, detected words read as
//! zero, unprotected tables read the fault silently, scrubbing rewrites
//! what the code corrects, and a block restored from a snapshot reads the
//! part's tables as they are now.

mod common;

use std::sync::Arc;

use attention::TileRows;
use attention::stored::{Fitted, PartScratch, StoredPart, open_part};
use gf2_codes::channel::ExactFlips;
use kv_lowrank::{Basis, BasisStorage, HeadBases};
use kv_quant::{CacheForm, FaultTarget, FitOptions, QuantizeOptions, RankRule, VqCodebook};

const HEADS: usize = 2;
const HEAD_DIM: usize = 64;
const CH: usize = HEADS * HEAD_DIM;
const BS: usize = 8;
const TOKENS: usize = 3 * BS;

fn rows(tokens: usize, seed: u64) -> Vec<f32> {
    common::structured_rows(tokens, CH, seed, 0.2)
}

/// The fitted tables of `form` (a codebook for `vq`, bases for `pca`).
fn fitted(form: &CacheForm) -> (Fitted, usize) {
    let cal = rows(512, 99);
    if form.quantizer().needs_codebook() {
        let cb = VqCodebook::fit(form, &cal, 512, CH, FitOptions::default()).unwrap();
        let bytes = cb.stored_bytes();
        let fitted = Fitted {
            codebook: Some(Arc::new(cb)),
            ..Fitted::default()
        };
        return (fitted, bytes);
    }
    let heads: Vec<Arc<Basis>> = (0..HEADS)
        .map(|h| {
            let head: Vec<f32> = cal
                .chunks_exact(CH)
                .flat_map(|r| r[h * HEAD_DIM..][..HEAD_DIM].to_vec())
                .collect();
            let (b, _) =
                Basis::fit(&head, 512, HEAD_DIM, RankRule::Fixed(8), BasisStorage::F16).unwrap();
            Arc::new(b)
        })
        .collect();
    let bases = HeadBases { heads };
    let bytes = bases.stored_bytes();
    let fitted = Fitted {
        bases: Some(Arc::new(bases)),
        ..Fitted::default()
    };
    (fitted, bytes)
}

/// A part of `form` over 4 blocks, three of them written and sealed.
fn written(form: &CacheForm) -> (Box<dyn StoredPart>, usize) {
    let (fitted, table_bytes) = fitted(form);
    let mut part = open_part(*form, BS, CH, 4, &fitted).unwrap();
    let x = rows(TOKENS, 1);
    let mut encoder = part.row_encoder().unwrap();
    let mut buf = kv_quant::RowBuffers::new(encoder.buffer_sizes(1));
    for b in 0..3 {
        part.open_block(b).unwrap();
    }
    for t in 0..TOKENS {
        encoder
            .encode_into(&x[t * CH..][..CH], buf.as_mut(), QuantizeOptions::default())
            .unwrap();
        part.put_row(t / BS, t % BS, &buf).unwrap();
    }
    for b in part.sealable(0, TOKENS) {
        part.seal(b, b * BS).unwrap();
    }
    (part, table_bytes)
}

fn read(part: &dyn StoredPart) -> Vec<f32> {
    let mut scratch = PartScratch::default();
    let tile = part.read_tile(&[0, 1, 2], 0, TOKENS, &mut scratch).unwrap();
    match tile.rows {
        TileRows::F32(r) => r.to_vec(),
        _ => {
            let mut out = vec![0.0; TOKENS * CH];
            for b in 0..3 {
                part.read_rows(
                    b,
                    0,
                    &mut out[b * BS * CH..][..BS * CH],
                    &mut kv_quant::DecodeScratch::new(),
                )
                .unwrap();
            }
            out
        }
    }
}

/// One flip in each of the first `words` 16-bit words (a high bit of the
/// f16: the exponent, so an unprotected read is far off).
fn one_per_word(words: u64) -> ExactFlips {
    ExactFlips::new((0..words).map(|w| 16 * w + 14))
}

#[test]
fn protected_tables_read_right_through_correctable_faults() {
    for spelling in ["vq+secded84", "pca-r8+secded84"] {
        let form: CacheForm = spelling.parse().unwrap();
        let (mut part, table_bytes) = written(&form);
        // RM(2,5): two check bytes per 16-bit word.
        assert_eq!(part.shared_bytes(), 2 * table_bytes, "{spelling}");
        let clean = read(part.as_ref());
        let flips = one_per_word(100);
        let none = part.inject_shared(&flips, 0, FaultTarget::Values).unwrap();
        assert_eq!(none.total(), 0, "{spelling}: tables are not value bits");
        let hit = part
            .inject_shared(&flips, 0, FaultTarget::Metadata)
            .unwrap();
        assert_eq!(hit.tables.len(), 100, "{spelling}");
        assert_eq!(read(part.as_ref()), clean, "{spelling}: corrected");
        let stats = part.shared_stats();
        assert_eq!(
            (
                stats.corrected,
                stats.detected,
                stats.miscorrected,
                stats.silent
            ),
            (100, 0, 0, 0),
            "{spelling}"
        );
        assert_eq!(stats.words as usize, table_bytes / 2);
        // A snapshot restores bit for bit while the tables carry faults.
        let snap = part.snapshot(0).unwrap();
        part.restore(3, &snap).unwrap();
        assert_eq!(part.snapshot(3).unwrap(), snap, "{spelling}");
        assert_eq!(part.scrub_shared().unwrap().corrected, 100);
        assert_eq!(part.shared_stats().corrected, 0, "{spelling}: scrubbed");
        assert_eq!(read(part.as_ref()), clean, "{spelling}");
    }
}

#[test]
fn a_detected_table_word_reads_as_zero_and_is_counted() {
    let form: CacheForm = "pca-r8+secded84".parse().unwrap();
    let (mut part, _) = written(&form);
    let clean = read(part.as_ref());
    // Four flips in the data bits of word 0: RM(2,5) detects them.
    part.inject_shared(&ExactFlips::new([1, 5, 9, 14]), 0, FaultTarget::Everything)
        .unwrap();
    let stats = part.shared_stats();
    assert_eq!((stats.detected, stats.miscorrected + stats.silent), (1, 0));
    // The first entry of head 0's first basis row is now 0: head 0's
    // rows change, head 1's do not.
    let faulted = read(part.as_ref());
    let differs = |h: usize| {
        (0..TOKENS).any(|t| {
            let r = t * CH + h * HEAD_DIM..t * CH + (h + 1) * HEAD_DIM;
            faulted[r.clone()] != clean[r]
        })
    };
    assert!(differs(0));
    assert!(!differs(1));
    // A scrub leaves a detected word as found.
    assert_eq!(part.scrub_shared().unwrap().detected, 1);
    assert_eq!(part.shared_stats().detected, 1);
}

#[test]
fn unprotected_tables_read_the_fault_silently() {
    for spelling in ["vq", "pca-r8"] {
        let form: CacheForm = spelling.parse().unwrap();
        let (mut part, table_bytes) = written(&form);
        assert_eq!(part.shared_bytes(), table_bytes, "{spelling}");
        let clean = read(part.as_ref());
        part.inject_shared(&one_per_word(100), 0, FaultTarget::Everything)
            .unwrap();
        let stats = part.shared_stats();
        assert_eq!((stats.silent, stats.corrected), (100, 0), "{spelling}");
        assert_ne!(read(part.as_ref()), clean, "{spelling}");
        assert_eq!(part.scrub_shared().unwrap().silent, 0, "nothing to scrub");
    }
}

/// A block restored from a snapshot taken before the tables were hit reads
/// through the part's tables as they are now, like every other block.
#[test]
fn a_restored_block_reads_the_tables_as_they_are() {
    let form: CacheForm = "pca-r8".parse().unwrap();
    let (mut part, _) = written(&form);
    let snap = part.snapshot(1).unwrap();
    part.inject_shared(&one_per_word(20), 0, FaultTarget::Everything)
        .unwrap();
    let faulted = read(part.as_ref());
    part.restore(1, &snap).unwrap();
    assert_eq!(read(part.as_ref()), faulted);
}
