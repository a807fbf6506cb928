//! Paged decode attention equals attention over the same data stored
//! contiguously: random block tables (physical blocks in random order),
//! block sizes, lengths and forms, bit for bit (row-local forms decode each
//! row the same wherever it is stored, and the kernel sees the same tiles).
//! Malformed page tables get typed errors.

use gf2_codes::channel::ExactFlips;
use std::sync::Arc;

use attention::{Attention, AttentionConfig, HeadShape, Mask, Numerics};
use kv_quant::{CacheForm, KvStore};
use paged_cache::{
    BlockId, BlockStorage, KvPart, LayerSpec, PageTable, PagedCacheError, PagedKv, paged_decode,
};
use proptest::prelude::*;

const FORMS: [&str; 8] = [
    "fp32",
    "fp16",
    "int8",
    "fp8-e4m3-tok",
    "int4-g32",
    "int4+secded84+interp",
    "int4-g16+golay24",
    "int4+secded84+interp+meta-rm",
];

fn rows(tokens: usize, channels: usize, seed: u64) -> Vec<f32> {
    (0..tokens * channels)
        .map(|i| {
            let x = (i as u64 ^ seed).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40;
            (x as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// Storage, page table, and each sequence's K and V rows.
type Built = (Arc<BlockStorage>, PageTable, Vec<(Vec<f32>, Vec<f32>)>);

/// Writes `lens.len()` sequences into blocks in a shuffled order; returns
/// the storage, the page table and each sequence's K and V rows.
fn build(form: CacheForm, bs: usize, channels: usize, lens: &[usize], shuffle: u64) -> Built {
    let total: usize = lens.iter().map(|l| l.div_ceil(bs)).sum();
    let mut order: Vec<u32> = (0..total as u32 + 3).collect();
    let mut s = shuffle | 1;
    for i in (1..order.len()).rev() {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        order.swap(i, (s % (i as u64 + 1)) as usize);
    }
    let storage = Arc::new(
        BlockStorage::new(order.len(), bs, &[LayerSpec::uniform(form, channels)]).unwrap(),
    );
    let mut next = 0;
    let mut tables = Vec::new();
    let mut data = Vec::new();
    for (i, &len) in lens.iter().enumerate() {
        let (k, v) = (
            rows(len, channels, 2 * i as u64),
            rows(len, channels, 2 * i as u64 + 1),
        );
        let blocks: Vec<BlockId> = (0..len.div_ceil(bs))
            .map(|_| {
                next += 1;
                BlockId(order[next - 1])
            })
            .collect();
        for t in 0..len {
            let r = t * channels..(t + 1) * channels;
            storage
                .write(blocks[t / bs], t % bs, 0, &k[r.clone()], &v[r])
                .unwrap();
        }
        tables.push(blocks);
        data.push((k, v));
    }
    let refs: Vec<(&[BlockId], usize)> = tables
        .iter()
        .map(|t| t.as_slice())
        .zip(lens.iter().copied())
        .collect();
    let table = PageTable::from_tables(&refs, bs).unwrap();
    (storage, table, data)
}

/// Seals every block of every sequence of `table` (staged forms), as the
/// steps that wrote them would have when they committed.
fn seal_all(storage: &BlockStorage, table: &PageTable, lens: &[usize]) {
    for (i, &len) in lens.iter().enumerate() {
        let blocks: Vec<BlockId> = table.pages(i).iter().map(|&b| BlockId(b)).collect();
        storage
            .seal_blocks(&blocks, 0, len, &mut paged_cache::SeqTables::default())
            .unwrap();
    }
}

/// `x` rounded to f16, the exact rows a staged block seals from.
fn f16_rounded(x: &[f32]) -> Vec<f32> {
    x.iter().map(|&v| half::f16::from_f32(v).to_f32()).collect()
}

/// Asserts that a paged decode gave the contiguous decode's outputs, log
/// sum-exps and tile count, bit for bit.
fn assert_same_decode(
    paged: &attention::AttentionOutput,
    want: &attention::AttentionOutput,
    what: &str,
) {
    assert_eq!((&paged.out, &paged.lse), (&want.out, &want.lse), "{what}");
    assert_eq!(paged.stats.tiles, want.stats.tiles, "{what}");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(if cfg!(debug_assertions) { 24 } else { 96 }))]

    #[test]
    fn paged_decode_equals_contiguous_decode(
        form in 0..FORMS.len(),
        bs in prop_oneof![Just(1usize), Just(3), Just(16), Just(32), Just(64)],
        lens in proptest::collection::vec(1usize..300, 1..4),
        tile in prop_oneof![Just(16usize), Just(64)],
        shuffle in any::<u64>(),
    ) {
        let form: CacheForm = FORMS[form].parse().unwrap();
        let shape = HeadShape::new(4, 2, 32).unwrap();
        let ch = shape.kv_channels();
        // Exact scores over fixed tiles: integer numerics code value weights
        // per tile, and byte-sized tiles stop at a paged source's block
        // size, so either would let blocks move the tiles (and the bits).
        let config = AttentionConfig { tile_tokens: tile, tile_bytes: None, split_tokens: 4 * tile, numerics: Numerics::Exact, ..AttentionConfig::default() };
        let attn = Attention::with_config(shape, config).unwrap();
        let (storage, table, data) = build(form, bs, ch, &lens, shuffle);
        let queries = rows(lens.len(), shape.q_len(), 99);
        let paged = paged_decode(&attn, &storage, &table, 0, &queries).unwrap();
        for (i, ((k, v), out)) in data.iter().zip(&paged).enumerate() {
            let len = lens[i];
            let ks = KvStore::quantize(form, k, len, ch).unwrap();
            let vs = KvStore::quantize(form, v, len, ch).unwrap();
            let q = &queries[i * shape.q_len()..][..shape.q_len()];
            let contiguous = attn.decode(q, len - 1, &ks, &vs, &Mask::Causal).unwrap();
            prop_assert_eq!(&out.out, &contiguous.out, "sequence {} of {} tokens", i, len);
            prop_assert_eq!(&out.lse, &contiguous.lse);
            prop_assert_eq!(out.stats, contiguous.stats);
            // And the paged source reports the blocks' true bytes.
            let src = PagedKv::new(&storage, &table, i, 0, KvPart::Keys).unwrap();
            let per_block = KvStore::zeroed(form, bs, ch).unwrap().stored_bytes();
            prop_assert_eq!(attention::KvSource::stored_bytes(&src), len.div_ceil(bs) * per_block);
        }
    }
}

/// Under attention's default tiles (sized by bytes) and numerics, paged
/// decode over shuffled blocks equals contiguous decode bit for bit, tile
/// counts included. Forms read as levels gather blocks of at most a
/// quarter of a tile: their tiles are then a contiguous store's, their
/// levels copied page by page. Larger blocks, and FP16's, cut the tiles
/// to the block: paged decode equals contiguous decode with fixed tiles of
/// the block's size, every tile inside one block and read as stored. At
/// this shape (256 channels) every level form's byte budget is 256 rows,
/// FP16's 128.
#[test]
fn default_tiles_read_pages_as_a_contiguous_store() {
    let shape = HeadShape::new(8, 2, 128).unwrap();
    let ch = shape.kv_channels();
    let lens = [300, 77];
    for (spelling, bs, fixed_tile) in [
        ("int4", 64, None),
        ("int4", 16, None),
        ("int4", 128, Some(128)),
        ("int4+secded84", 48, None),
        ("int8", 16, None),
        ("nf4", 32, None),
        // Lloyd-Max codes gather as levels too, in rotated coordinates.
        ("lm4", 16, None),
        ("lm3", 32, None),
        ("fp16", 64, Some(64)),
        ("fp16", 16, Some(16)),
    ] {
        let form: CacheForm = spelling.parse().unwrap();
        let (storage, table, data) = build(form, bs, ch, &lens, 11);
        let attn = Attention::new(shape);
        let queries = rows(lens.len(), shape.q_len(), 7);
        let paged = paged_decode(&attn, &storage, &table, 0, &queries).unwrap();
        let contiguous = match fixed_tile {
            None => attn,
            Some(tile) => {
                let fixed = AttentionConfig {
                    tile_tokens: tile,
                    tile_bytes: None,
                    split_tokens: 2048 / tile * tile,
                    ..AttentionConfig::default()
                };
                Attention::with_config(shape, fixed).unwrap()
            }
        };
        for (i, ((k, v), out)) in data.iter().zip(&paged).enumerate() {
            let len = lens[i];
            let src = PagedKv::new(&storage, &table, i, 0, KvPart::Keys).unwrap();
            let ks = KvStore::quantize(form, k, len, ch).unwrap();
            let vs = KvStore::quantize(form, v, len, ch).unwrap();
            assert_eq!(
                attention::KvSource::row_bytes(&src),
                ks.row_bytes(),
                "{spelling}"
            );
            assert_eq!(attention::KvSource::block_tokens(&src), Some(bs));
            assert_eq!(
                attention::KvSource::gathers_blocks(&src),
                spelling != "fp16",
                "{spelling}"
            );
            let q = &queries[i * shape.q_len()..][..shape.q_len()];
            let want = contiguous
                .decode(q, len - 1, &ks, &vs, &Mask::Causal)
                .unwrap();
            assert_same_decode(
                out,
                &want,
                &format!("{spelling}, blocks of {bs}, sequence {i}"),
            );
        }
    }
}

/// Per-channel keys and values sealed block by block (`int4-ch` on pages of
/// B tokens: one scale and offset per channel per block) gather whole
/// blocks into a tile as per-token forms do, so under attention's default
/// tiles paged decode equals decode over one contiguous `int4-ch<B>` store
/// of the same rows, bit for bit and tile for tile (the rows are f16
/// values, so sealing from the exact staged rows quantizes what the
/// contiguous store quantizes).
#[test]
fn sealed_per_channel_blocks_read_as_a_contiguous_store() {
    let shape = HeadShape::new(8, 2, 128).unwrap();
    let ch = shape.kv_channels();
    for bs in [16, 32, 64] {
        let lens = [20 * bs, 3 * bs];
        let form: CacheForm = "int4-ch".parse().unwrap();
        let (storage, table, data) = build(form, bs, ch, &lens, 5);
        seal_all(&storage, &table, &lens);
        let attn = Attention::new(shape);
        let queries = rows(lens.len(), shape.q_len(), 7);
        let paged = paged_decode(&attn, &storage, &table, 0, &queries).unwrap();
        let grouped: CacheForm = format!("int4-ch{bs}").parse().unwrap();
        for (i, ((k, v), out)) in data.iter().zip(&paged).enumerate() {
            let len = lens[i];
            let src = PagedKv::new(&storage, &table, i, 0, KvPart::Keys).unwrap();
            assert!(attention::KvSource::gathers_blocks(&src), "blocks of {bs}");
            let ks = KvStore::quantize(grouped, &f16_rounded(k), len, ch).unwrap();
            let vs = KvStore::quantize(grouped, &f16_rounded(v), len, ch).unwrap();
            let q = &queries[i * shape.q_len()..][..shape.q_len()];
            let want = attn.decode(q, len - 1, &ks, &vs, &Mask::Causal).unwrap();
            assert_same_decode(out, &want, &format!("blocks of {bs}, sequence {i}"));
        }
    }
}

/// A per-channel group kept over several pages (`int4-ch64` in blocks of
/// 16 and 32, one channel slice per page) is read a whole group per tile:
/// the source's tile unit is the group, so paged decode under attention's
/// default tiles equals decode over one contiguous `int4-ch64` store with
/// fixed tiles of 64 rows, bit for bit and tile for tile. After sink blocks
/// the groups do not start at a multiple of their size, and tiles stay
/// cut to the page.
#[test]
fn grouped_pages_are_read_a_group_per_tile() {
    let shape = HeadShape::new(8, 2, 128).unwrap();
    let ch = shape.kv_channels();
    for bs in [16, 32] {
        let lens = [20 * 64, 3 * 64];
        let form: CacheForm = "int4-ch64".parse().unwrap();
        let (storage, table, data) = build(form, bs, ch, &lens, 9);
        seal_all(&storage, &table, &lens);
        let attn = Attention::new(shape);
        let queries = rows(lens.len(), shape.q_len(), 3);
        let paged = paged_decode(&attn, &storage, &table, 0, &queries).unwrap();
        let fixed = AttentionConfig {
            tile_tokens: 64,
            tile_bytes: None,
            ..AttentionConfig::default()
        };
        let contiguous = Attention::with_config(shape, fixed).unwrap();
        for (i, ((k, v), out)) in data.iter().zip(&paged).enumerate() {
            let len = lens[i];
            let src = PagedKv::new(&storage, &table, i, 0, KvPart::Keys).unwrap();
            assert_eq!(
                attention::KvSource::block_tokens(&src),
                Some(64),
                "blocks of {bs}"
            );
            let ks = KvStore::quantize(form, &f16_rounded(k), len, ch).unwrap();
            let vs = KvStore::quantize(form, &f16_rounded(v), len, ch).unwrap();
            let q = &queries[i * shape.q_len()..][..shape.q_len()];
            let want = contiguous
                .decode(q, len - 1, &ks, &vs, &Mask::Causal)
                .unwrap();
            assert_same_decode(out, &want, &format!("blocks of {bs}, sequence {i}"));
        }
    }
}

/// A source that records the tiles attention reads from it.
struct Recorded<'a> {
    inner: PagedKv<'a>,
    tiles: std::sync::Mutex<Vec<(usize, usize)>>,
}

impl attention::KvSource for Recorded<'_> {
    type Scratch = <PagedKv<'static> as attention::KvSource>::Scratch;

    fn tokens(&self) -> usize {
        self.inner.tokens()
    }

    fn channels(&self) -> usize {
        self.inner.channels()
    }

    fn stored_bytes(&self) -> usize {
        self.inner.stored_bytes()
    }

    fn row_bytes(&self) -> usize {
        self.inner.row_bytes()
    }

    fn block_tokens(&self) -> Option<usize> {
        self.inner.block_tokens()
    }

    fn tile_origin(&self) -> usize {
        self.inner.tile_origin()
    }

    fn gathers_blocks(&self) -> bool {
        self.inner.gathers_blocks()
    }

    fn read_tile<'s>(
        &'s self,
        start: usize,
        count: usize,
        scratch: &'s mut Self::Scratch,
    ) -> attention::Result<attention::Tile<'s>> {
        self.tiles.lock().unwrap().push((start, count));
        self.inner.read_tile(start, count, scratch)
    }
}

/// Per-channel groups of several pages after an exact sink block: tiles
/// start at the groups (the sink rows a tile of their own, every later
/// tile one whole group), and the decode equals the one whose tiles are
/// single pages up to the order of its sums.
#[test]
fn grouped_pages_after_sink_blocks_are_read_a_group_per_tile() {
    use attention::KvSource;
    let shape = HeadShape::new(8, 2, 128).unwrap();
    let ch = shape.kv_channels();
    let sunk: CacheForm = "int4-ch64+sink4".parse().unwrap();
    let len = 16 + 20 * 64 + 40;
    let (storage, table, _) = build(sunk, 16, ch, &[len], 9);
    seal_all(&storage, &table, &[len]);
    let keys = PagedKv::new(&storage, &table, 0, 0, KvPart::Keys).unwrap();
    assert_eq!((keys.block_tokens(), keys.tile_origin()), (Some(64), 16));
    let record = || Recorded {
        inner: PagedKv::new(&storage, &table, 0, 0, KvPart::Keys).unwrap(),
        tiles: Default::default(),
    };
    let values = PagedKv::new(&storage, &table, 0, 0, KvPart::Values).unwrap();
    let q = rows(1, shape.q_len(), 3);
    let attn = Attention::new(shape);
    let grouped = record();
    let out = attn
        .decode(&q, len - 1, &grouped, &values, &Mask::Causal)
        .unwrap();
    let mut tiles = grouped.tiles.into_inner().unwrap();
    tiles.sort_unstable();
    assert_eq!(tiles[0], (0, 16), "the sink block alone");
    for &(start, count) in &tiles[1..] {
        assert!(
            (start - 16).is_multiple_of(64) && count <= 64,
            "tile {start}+{count} within one group"
        );
    }
    assert_eq!(tiles.iter().map(|t| t.1).sum::<usize>(), len);
    // Pages of 16 a tile each: the same attention, other sums.
    let paged = Attention::with_config(
        shape,
        AttentionConfig {
            tile_tokens: 16,
            split_tokens: 16 * 128,
            ..AttentionConfig::default()
        },
    )
    .unwrap();
    let by_page = paged
        .decode(&q, len - 1, &keys, &values, &Mask::Causal)
        .unwrap();
    let worst = out
        .out
        .iter()
        .zip(&by_page.out)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    assert!(worst < 1e-5, "{worst}");
}

/// A tile over pages that are not adjacent reads as gathered levels while
/// its rows are clean, with the rows' own values; once one of its values is
/// erased it is decoded into f32 page by page, the erased value rebuilt from
/// its own page's rows only, with the erasure counted.
#[test]
fn a_gathered_tile_with_an_erased_value_is_decoded_page_by_page() {
    use attention::{KvSource, TileRows};
    use kv_quant::FaultTarget;
    let (ch, bs) = (16, 4);
    let form: CacheForm = "int4+secded84+interp".parse().unwrap();
    // Sequence 0 on pages 2 and 0, sequence 1 on page 1 between them.
    let storage = BlockStorage::new(3, bs, &[LayerSpec::uniform(form, ch)]).unwrap();
    let value = |b: u32, t: usize, c: usize| (b * 10) as f32 + 0.1 * t as f32 + 0.01 * c as f32;
    for b in 0..3u32 {
        for t in 0..bs {
            let row: Vec<f32> = (0..ch).map(|c| value(b, t, c)).collect();
            storage.write(BlockId(b), t, 0, &row, &row).unwrap();
        }
    }
    let table =
        PageTable::from_tables(&[(&[BlockId(2), BlockId(0)], 8), (&[BlockId(1)], 4)], bs).unwrap();
    let page_values = |b: u32| {
        storage
            .with_store(BlockId(b), 0, KvPart::Keys, |st| {
                st.decode().unwrap().values
            })
            .unwrap()
    };
    let clean: Vec<f32> = [page_values(2), page_values(0)].concat();
    let read = |storage: &BlockStorage| {
        let keys = PagedKv::new(storage, &table, 0, 0, KvPart::Keys).unwrap();
        assert!(keys.gathers_blocks(), "levels are gathered across pages");
        let mut scratch = Default::default();
        let tile = keys.read_tile(0, 8, &mut scratch).unwrap();
        let values = match tile.rows {
            TileRows::Levels(levels) => {
                let mut out = vec![0.0; 8 * ch];
                levels.dequantize_into(&mut out);
                (true, out)
            }
            TileRows::F32(v) => (false, v.to_vec()),
            TileRows::F16(_) | TileRows::PairCodes(_) => {
                panic!("an integer form reads as levels or f32")
            }
        };
        (values, tile.stats)
    };
    let ((levels, got), stats) = read(&storage);
    assert!(
        levels,
        "a clean tile over pages 2 and 0 is gathered as levels"
    );
    assert_eq!(got, clean);
    assert_eq!(stats.values.detected, 0);
    // Two flips in one codeword of page 0's first row (the tile's row 4),
    // channel 3: erased, and rebuilt from page 0's next row only (not from
    // page 2's last row, which precedes it in the tile).
    let rb = storage
        .with_store(BlockId(0), 0, KvPart::Keys, |s| s.row_bytes())
        .unwrap() as u64;
    let bit = 8 * 3;
    let flips = ExactFlips::new(vec![bit + 1, bit + 5]);
    storage
        .inject(BlockId(0), 0, KvPart::Keys, &flips, 0, FaultTarget::Values)
        .unwrap();
    assert!(rb > 3);
    let ((levels, got), stats) = read(&storage);
    assert!(!levels, "a tile with an erased value is decoded into f32");
    assert_eq!(stats.values.detected, 1, "one codeword");
    for (i, (&g, &c)) in got.iter().zip(&clean).enumerate() {
        if i == 4 * ch + 3 {
            assert_eq!(g, clean[5 * ch + 3], "from its own page's next row");
        } else {
            assert_eq!(g, c, "value {i}");
        }
    }
}

#[test]
fn malformed_page_tables_are_errors() {
    let form: CacheForm = "fp16".parse().unwrap();
    let (storage, table, _) = build(form, 4, 16, &[9, 4], 5);
    let shape = HeadShape::new(2, 2, 8).unwrap();
    let attn = Attention::new(shape);
    let q = vec![0.5; 2 * shape.q_len()];
    assert_eq!(table.indptr, [0, 3, 4]);
    assert_eq!(table.last_page_len, [1, 4]);
    assert_eq!((table.tokens(0), table.tokens(1)), (9, 4));
    paged_decode(&attn, &storage, &table, 0, &q).unwrap();
    let bad = |f: fn(&mut PageTable)| {
        let mut t = table.clone();
        f(&mut t);
        paged_decode(&attn, &storage, &t, 0, &q)
    };
    for f in [
        (|t: &mut PageTable| t.indptr[1] = 5) as fn(&mut PageTable),
        |t| t.indptr.pop().map(drop).unwrap_or(()),
        |t| t.indices[0] = 1_000,
        |t| t.last_page_len[0] = 0,
        |t| t.last_page_len[1] = 5,
        |t| t.block_size = 0,
    ] {
        assert!(matches!(bad(f), Err(PagedCacheError::PageTable(_))));
    }
    assert!(matches!(
        paged_decode(&attn, &storage, &table, 0, &q[1..]),
        Err(PagedCacheError::ShapeMismatch { .. })
    ));
    assert!(
        paged_decode(&attn, &storage, &table, 1, &q).is_err(),
        "no layer 1"
    );
    assert!(PageTable::from_tables(&[(&[BlockId(0)], 9)], 4).is_err());
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// A page table with arbitrary fields (it is a plain struct a caller can
    /// fill) never makes validation, a paged source or paged decode panic:
    /// each refuses it with a typed error or reads it correctly.
    #[test]
    fn arbitrary_page_tables_never_panic(
        indptr in proptest::collection::vec(0u32..12, 0..5),
        indices in proptest::collection::vec(0u32..12, 0..10),
        last_page_len in proptest::collection::vec(0u32..20, 0..4),
        block_size in 0usize..6,
        seq in 0usize..5,
    ) {
        let form: CacheForm = "int4+secded84".parse().unwrap();
        let storage = BlockStorage::new(8, 4, &[LayerSpec::uniform(form, 16)]).unwrap();
        let table = PageTable { indptr, indices, last_page_len, block_size };
        let _ = table.validate(storage.num_blocks());
        let _ = table.check_sequence(seq);
        if let Ok(kv) = PagedKv::new(&storage, &table, seq, 0, KvPart::Keys) {
            prop_assert!(attention::KvSource::tokens(&kv) <= table.indices.len() * 4);
        }
        let attn = Attention::new(HeadShape::new(2, 1, 16).unwrap());
        let q = vec![0.5; 32 * table.sequences()];
        let _ = paged_decode(&attn, &storage, &table, 0, &q);
    }
}

/// A calibrated codebook form (`vq`, its codebook fitted once and shared by
/// every block, as `kv-eval calibrate` fits it) is a paged form: rows
/// written into shuffled blocks and attended through the pages equal the
/// same rows quantized against the same codebook in one contiguous store,
/// bit for bit; the codebook is counted once, beside the blocks; without
/// its codebook the form is refused.
#[test]
fn a_calibrated_codebook_form_pages_like_a_contiguous_store() {
    use attention::stored::Fitted;
    use kv_quant::{FitOptions, VqCodebook};
    let shape = HeadShape::new(4, 2, 64).unwrap();
    let ch = shape.kv_channels();
    let (bs, len) = (16usize, 150usize);
    for spelling in ["vq", "vq+sink4"] {
        let form: CacheForm = spelling.parse().unwrap();
        let calibration = rows(512, ch, 7);
        let codebook =
            Arc::new(VqCodebook::fit(&form, &calibration, 512, ch, FitOptions::default()).unwrap());
        let tables = || Fitted {
            codebook: Some(codebook.clone()),
            ..Fitted::default()
        };
        let fitted = [tables(), tables()];
        let blocks = len.div_ceil(bs);
        let layer = [LayerSpec::uniform(form, ch)];
        let storage = BlockStorage::with_fitted(blocks + 2, bs, &layer, &[fitted]).unwrap();
        assert_eq!(storage.shared_bytes(), 2 * codebook.stored_bytes());
        let table: Vec<BlockId> = (0..blocks as u32).rev().map(|b| BlockId(b + 2)).collect();
        let (k, v) = (rows(len, ch, 1), rows(len, ch, 2));
        for t in 0..len {
            let r = t * ch..(t + 1) * ch;
            storage
                .write(table[t / bs], t % bs, 0, &k[r.clone()], &v[r])
                .unwrap();
        }
        storage
            .seal_blocks(&table, 0, len, &mut paged_cache::SeqTables::default())
            .unwrap();
        let page_table = PageTable::from_tables(&[(&table, len)], bs).unwrap();
        let config = AttentionConfig {
            tile_tokens: bs,
            tile_bytes: None,
            split_tokens: 4 * bs,
            numerics: Numerics::Exact,
            ..AttentionConfig::default()
        };
        let attn = Attention::with_config(shape, config).unwrap();
        let q = rows(1, shape.q_len(), 3);
        let paged = paged_decode(&attn, &storage, &page_table, 0, &q).unwrap();
        // The same rows in one store: sink rows exact, the rest coded
        // against the same codebook (row-local, so block by block or at
        // once is the same code).
        let quantize = |x: &[f32]| {
            KvStore::quantize_with_codebook(
                form,
                x,
                len,
                ch,
                kv_quant::QuantizeOptions::default(),
                codebook.clone(),
            )
            .unwrap()
        };
        let contiguous = attn
            .decode(&q, len - 1, &quantize(&k), &quantize(&v), &Mask::Causal)
            .unwrap();
        if spelling == "vq" {
            assert_eq!(paged[0].out, contiguous.out, "{spelling}");
            // The shared codebook is stored bits too: a flip in it is
            // counted and read by every row coded with that centroid,
            // in this cache only (the calibration's copy is untouched).
            let flips = ExactFlips::new((0..64).map(|c| 16 * c + 9)); // top mantissa bits
            let values_only = storage
                .inject_shared(0, KvPart::Values, &flips, 0, kv_quant::FaultTarget::Values)
                .unwrap();
            assert_eq!(values_only.total(), 0, "tables are not value bits");
            let hit = storage
                .inject_shared(
                    0,
                    KvPart::Values,
                    &flips,
                    0,
                    kv_quant::FaultTarget::Everything,
                )
                .unwrap();
            assert_eq!(hit.tables.len(), 64);
            assert_eq!(hit.total(), 64);
            let faulted = paged_decode(&attn, &storage, &page_table, 0, &q).unwrap();
            assert_ne!(faulted[0].out, paged[0].out);
            assert_eq!(codebook.stored_bytes() * 8, 16 * codebook.centroids().len());
            let again = attn
                .decode(&q, len - 1, &quantize(&k), &quantize(&v), &Mask::Causal)
                .unwrap();
            assert_eq!(
                again.out, contiguous.out,
                "the shared codebook is untouched"
            );
        } else {
            // A paged sink is a whole exact block (16 rows), the store's 4.
            let err = paged[0]
                .out
                .iter()
                .zip(&contiguous.out)
                .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            assert!(err < 0.1, "{spelling}: {err}");
        }
    }
    let refused = BlockStorage::new(2, 16, &[LayerSpec::uniform("vq".parse().unwrap(), ch)]);
    match refused {
        Err(PagedCacheError::InvalidParameter {
            name: "form",
            reason,
        }) => {
            assert!(reason.contains("needs its fitted codebook"), "{reason}")
        }
        other => panic!("{other:?}"),
    }
}
