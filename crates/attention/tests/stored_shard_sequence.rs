//! The Shard part of a form fitted per sequence (`shard-k3`: the blog's
//! prefill fit) through the stored-layer interface: nothing seals until
//! the middle holds more rows than a key has channels; the cache then
//! fits the sequence's tables on the blocks its first seal seals
//! (`fit_sequence`), which are exactly kv-lowrank's `ShardKeys::fit` (RoPE
//! undone) and kv-quant's `ChannelVq::fit` of those rows, and every block
//! of the sequence, later ones included, is coded on them (`seal_on`); a
//! sealed block carries its tables, so another sequence's part restores
//! and reads it; what is not a sequence's tables is refused.

mod common;

use attention::stored::{Fitted, SequenceFit, StoredPart, check_part_form, open_part, part_seals};
use attention::{Rope, RopeLayout, SHARD_VALUE_FIT};
use kv_lowrank::ShardKeys;
use kv_quant::{CacheForm, ChannelVq, QuantizeOptions, Quantizer};

const HEAD_DIM: usize = 16;
const CH: usize = 2 * HEAD_DIM;
const BS: usize = 4;
/// Sink 2 (block 0 exact), window 8 (the last two or three blocks exact).
const FORM: &str = "shard-k3+sink2+win8";
/// Blocks of middle rows the first fit needs: more rows than channels.
const FIT_BLOCKS: usize = (CH + 1).div_ceil(BS);

fn rows(tokens: usize, seed: u64) -> Vec<f32> {
    common::structured_rows(tokens, CH, seed, 0.3)
}

fn rope() -> Rope {
    Rope::new(RopeLayout::Adjacent, HEAD_DIM, HEAD_DIM, 10_000.0).unwrap()
}

fn fits() -> [Fitted; 2] {
    [
        SequenceFit::Keys(rope()),
        SequenceFit::Values { head_dim: HEAD_DIM },
    ]
    .map(|fit| Fitted {
        sequence: Some(fit),
        ..Fitted::default()
    })
}

/// Writes rows `from..to` of `x` into `pages`.
fn write(part: &mut dyn StoredPart, pages: &[u32], x: &[f32], from: usize, to: usize) {
    let mut encoder = part.row_encoder().unwrap();
    let mut buf = kv_quant::RowBuffers::new(encoder.buffer_sizes(1));
    for t in from..to {
        if t % BS == 0 {
            part.open_block(pages[t / BS] as usize).unwrap();
        }
        encoder
            .encode_into(&x[t * CH..][..CH], buf.as_mut(), QuantizeOptions::default())
            .unwrap();
        part.put_row(pages[t / BS] as usize, t % BS, &buf).unwrap();
    }
}

fn read(part: &dyn StoredPart, pages: &[u32], start: usize, count: usize) -> Vec<f32> {
    common::f32_tile(part, pages, start, count)
}

/// Rows of `block` (of `staged`, the f16 rows as written) as tables fitted
/// on `fit_blocks` code them, unrotated.
fn expected(
    key: bool,
    staged: &[f32],
    fit_blocks: std::ops::Range<usize>,
    block: usize,
) -> Vec<f32> {
    let form: CacheForm = FORM.parse().unwrap();
    let Quantizer::Shard(spec) = *form.quantizer() else {
        unreachable!("a shard form")
    };
    let rows_of = |b: std::ops::Range<usize>| staged[b.start * BS * CH..b.end * BS * CH].to_vec();
    let undo = |mut x: Vec<f32>, first: usize| {
        for (i, row) in x.chunks_exact_mut(CH).enumerate() {
            rope().undo(row, first + i).unwrap();
        }
        x
    };
    let n = fit_blocks.len() * BS;
    let mut out = vec![0.0; BS * CH];
    if key {
        let fit = undo(rows_of(fit_blocks.clone()), fit_blocks.start * BS);
        let tables = ShardKeys::fit(&fit, n, CH, spec.key_bits(), spec.group, spec.rank)
            .unwrap()
            .tables();
        let coded = tables
            .encode_chunk(&undo(rows_of(block..block + 1), block * BS), BS)
            .unwrap();
        for (i, row) in out.chunks_exact_mut(CH).enumerate() {
            coded.reconstruct_into(i, row).unwrap();
            rope().apply(row, block * BS + i).unwrap();
        }
    } else {
        let tables = ChannelVq::fit(&rows_of(fit_blocks), n, CH, HEAD_DIM, SHARD_VALUE_FIT)
            .unwrap()
            .tables();
        let coded = tables.encode_chunk(&rows_of(block..block + 1), BS).unwrap();
        coded.decode_rows_into(0, BS, &mut out).unwrap();
    }
    out
}

fn close(got: &[f32], want: &[f32], what: &str) {
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= 1e-5 * (1.0 + w.abs()),
            "{what} [{i}]: {g} vs {w}"
        );
    }
}

#[test]
fn a_sequence_codes_every_block_on_tables_fitted_on_its_first_sealed_rows() {
    let form: CacheForm = FORM.parse().unwrap();
    assert!(check_part_form(form, BS).is_ok());
    assert!(part_seals(form, BS));
    // The sink is block 0, the window the last 8 rows: a prefill of
    // `prefill` tokens leaves blocks 1..FIT_BLOCKS + 1 out of the window.
    let prefill = (FIT_BLOCKS + 1) * BS + 8;
    let tokens = prefill + 2 * BS;
    let pages: Vec<u32> = (0..tokens.div_ceil(BS) as u32)
        .rev()
        .map(|p| p + 3)
        .collect();
    for (fitted, key) in fits().iter().zip([true, false]) {
        let mut part = open_part(form, BS, CH, pages.len() + 3, fitted).unwrap();
        assert!(part.per_sequence());
        let x = rows(tokens, u64::from(key));
        let staged = common::f16_rows(&x, CH);
        // One block short of the fit: nothing seals yet.
        write(part.as_mut(), &pages, &x, 0, prefill - BS);
        assert!(part.sealable(0, prefill - BS).is_empty());
        write(part.as_mut(), &pages, &x, prefill - BS, prefill);
        let first = part.sealable(prefill - BS, prefill);
        assert_eq!(first, 1..FIT_BLOCKS + 1, "all of the middle, from the sink");
        // Not without the sequence's tables; then on them.
        assert!(part.seal(pages[1] as usize, BS).is_err());
        assert!(
            part.fit_sequence(&pages, 1..FIT_BLOCKS).is_err(),
            "too few rows"
        );
        let tables = part.fit_sequence(&pages, first.clone()).unwrap();
        assert!(tables.stored_bytes() > 0);
        for i in first.clone() {
            assert!(part.seal_on(pages[i] as usize, i * BS, &tables).unwrap());
        }
        // Decode steps: their blocks seal on the same tables as they leave
        // the window.
        write(part.as_mut(), &pages, &x, prefill, tokens);
        let later = part.sealable(prefill, tokens);
        assert_eq!(later, FIT_BLOCKS + 1..FIT_BLOCKS + 3);
        for i in later.clone() {
            assert!(part.seal_on(pages[i] as usize, i * BS, &tables).unwrap());
        }
        for (b, &page) in pages.iter().enumerate().take(later.end).skip(first.start) {
            let mut got = vec![0.0; BS * CH];
            part.read_rows(
                page as usize,
                0,
                &mut got,
                &mut kv_quant::DecodeScratch::new(),
            )
            .unwrap();
            close(
                &got,
                &expected(key, &staged, first.clone(), b),
                &format!("block {b}"),
            );
        }
        // The sink and the window read exact; sealed blocks coded.
        let tile = read(part.as_ref(), &pages, 0, BS);
        let mut sink = staged[..BS * CH].to_vec();
        if let Some(h) = part.rotation() {
            h.rotate(&mut sink);
        }
        assert_eq!(tile, sink);
        assert!(part.block_bytes(pages[1] as usize) < part.block_bytes(pages[0] as usize));
        assert!(part.block_bytes(pages[1] as usize) <= part.sealed_block_bytes());
        // A sealed block carries its tables: another sequence's part (its
        // own tables never fitted) restores and reads it as this one does.
        let snap = part.snapshot(pages[2] as usize).unwrap();
        let mut other = open_part(form, BS, CH, 2, fitted).unwrap();
        assert!(other.accepts(&snap));
        other.restore(1, &snap).unwrap();
        assert_eq!(
            read(other.as_ref(), &[0, 1], BS, BS),
            read(part.as_ref(), &pages, 2 * BS, BS)
        );
        // The other part's tables are refused (keys for values, and back).
        let [k, v] = fits();
        let mut wrong =
            open_part(form, BS, CH, pages.len() + 3, if key { &v } else { &k }).unwrap();
        write(wrong.as_mut(), &pages, &x, 0, prefill);
        assert!(wrong.seal_on(pages[1] as usize, BS, &tables).is_err());
        assert!(!wrong.accepts(&snap));
    }
}

#[test]
fn a_form_fitted_per_sequence_needs_what_the_model_tells() {
    let form: CacheForm = FORM.parse().unwrap();
    let e = match open_part(form, BS, CH, 4, &Fitted::default()) {
        Err(e) => e.to_string(),
        Ok(_) => panic!("accepted without the model's RoPE"),
    };
    assert!(e.contains("each sequence"), "{e}");
    // NF4 values need no table: that part is not fitted per sequence.
    let nf4: CacheForm = "shard-k3-vnf4+sink2+win8".parse().unwrap();
    let [k, v] = fits();
    assert!(open_part(nf4, BS, CH, 4, &k).unwrap().per_sequence());
    assert!(!open_part(nf4, BS, CH, 4, &v).unwrap().per_sequence());
    // A rank past the key's channels, refused before any row is written
    // (the fit would refuse it at the first seal).
    let wide: CacheForm = "shard-r64+sink2+win8".parse().unwrap();
    let e = match open_part(wide, BS, CH, 4, &k) {
        Err(e) => e.to_string(),
        Ok(_) => panic!("a rank of 64 over 32 channels"),
    };
    assert!(e.contains("rank of 64"), "{e}");
    assert!(
        open_part(wide, BS, CH, 4, &v).is_ok(),
        "values have no rank"
    );
    // Heads that do not divide the channels.
    let odd = Fitted {
        sequence: Some(SequenceFit::Values { head_dim: 12 }),
        ..Fitted::default()
    };
    assert!(open_part(form, BS, CH, 4, &odd).is_err());
}

/// The coded spelling of a form fitted per sequence (`shard-k3+secded84`):
/// the same tables and the same rows as the bare form, its sealed blocks
/// stored under the codes, a flipped code corrected.
#[test]
fn a_coded_form_fitted_per_sequence_reads_as_the_bare_one_and_corrects() {
    use gf2_codes::channel::ExactFlips;
    use kv_quant::FaultTarget;
    let bare: CacheForm = FORM.parse().unwrap();
    let coded: CacheForm = format!("{FORM}+secded84").parse().unwrap();
    let tokens = (FIT_BLOCKS + 1) * BS + 8;
    let pages: Vec<u32> = (0..tokens.div_ceil(BS) as u32).collect();
    for (fitted, key) in fits().iter().zip([true, false]) {
        let x = rows(tokens, 7 + u64::from(key));
        let [(bare_part, bare_tables), (coded_part, coded_tables)] = [bare, coded].map(|form| {
            let mut part = open_part(form, BS, CH, pages.len(), fitted).unwrap();
            write(part.as_mut(), &pages, &x, 0, tokens);
            let sealable = part.sealable(0, tokens);
            let tables = part.fit_sequence(&pages, sealable.clone()).unwrap();
            for i in sealable {
                assert!(part.seal_on(pages[i] as usize, i * BS, &tables).unwrap());
            }
            (part, tables)
        });
        // The sequence's tables under RM(2,5): two check bytes per word.
        assert_eq!(
            coded_tables.stored_bytes(),
            2 * bare_tables.stored_bytes().next_multiple_of(2)
        );
        let mut parts = [bare_part, coded_part];
        let clean = read(parts[1].as_ref(), &pages, 0, tokens);
        assert_eq!(clean, read(parts[0].as_ref(), &pages, 0, tokens));
        let block = pages[1] as usize;
        assert!(parts[1].block_bytes(block) > parts[0].block_bytes(block));
        assert!(parts[1].block_bytes(block) <= parts[1].sealed_block_bytes());
        let hit = parts[1]
            .inject(block, &ExactFlips::new([2]), 0, FaultTarget::Values)
            .unwrap();
        assert_eq!(hit.total(), 1);
        assert_eq!(read(parts[1].as_ref(), &pages, 0, tokens), clean);
        assert_eq!(parts[1].scrub(block).unwrap().values.corrected, 1);
        // A flip in the sequence's tables (bit 6 of the first word: a key
        // basis row's f16 scale, or a centroid): corrected under the code,
        // read by every sealed block of the bare sequence.
        let flip = ExactFlips::new([6]);
        let hit = parts[1]
            .inject_sequence(&coded_tables, &flip, 0, FaultTarget::Values)
            .unwrap();
        assert_eq!(hit.total(), 0, "tables are metadata");
        let hit = parts[1]
            .inject_sequence(&coded_tables, &flip, 0, FaultTarget::Metadata)
            .unwrap();
        assert_eq!(hit.tables.len(), 1);
        assert_eq!(parts[1].sequence_stats(&coded_tables).unwrap().corrected, 1);
        assert_eq!(read(parts[1].as_ref(), &pages, 0, tokens), clean);
        assert_eq!(parts[1].scrub_sequence(&coded_tables).unwrap().corrected, 1);
        assert_eq!(parts[1].sequence_stats(&coded_tables).unwrap().corrected, 0);
        let bare_before = read(parts[0].as_ref(), &pages, 0, tokens);
        parts[0]
            .inject_sequence(&bare_tables, &flip, 0, FaultTarget::Everything)
            .unwrap();
        assert_eq!(parts[0].sequence_stats(&bare_tables).unwrap().silent, 1);
        let bare_after = read(parts[0].as_ref(), &pages, 0, tokens);
        assert_ne!(bare_after, bare_before);
        // The staged blocks (sink, window) are untouched; a sealed one reads
        // through the faulted tables.
        assert_eq!(bare_after[..BS * CH], bare_before[..BS * CH]);
        assert_ne!(
            bare_after[BS * CH..2 * BS * CH],
            bare_before[BS * CH..2 * BS * CH]
        );
        // Another part's tables are refused.
        let other = if key { &fits()[1] } else { &fits()[0] };
        let mut wrong = open_part(bare, BS, CH, pages.len(), other).unwrap();
        assert!(
            wrong
                .inject_sequence(&bare_tables, &flip, 0, FaultTarget::Metadata)
                .is_err()
        );
    }
}
