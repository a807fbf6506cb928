//! Hierarchical `int8h` forms on the paged cache: read in the draft view
//! they are, bit for bit, the `int4` form of their upper plane written
//! with the same rows (through commits, rollbacks and kept prefixes); read
//! whole they are about INT8's error, and exact where the upper plane is
//! still staged; faults in either plane are corrected by its own code;
//! copies and the host tier keep both planes; a form without a draft view
//! refuses it, changing nothing.

mod common;

use attention::{KvBackend, ReadView, TileRows};
use common::{model, row, shape};
use gf2_codes::channel::BinarySymmetric;
use kv_quant::{CacheForm, FaultTarget};
use paged_cache::{KvPart, LayerSpec, PagedBackend};
use proptest::prelude::*;

fn backend(key: &str, value: &str, bs: usize) -> PagedBackend {
    let spec = LayerSpec {
        key: key.parse().unwrap(),
        value: value.parse().unwrap(),
        channels: shape().kv_channels(),
    };
    let mut b = PagedBackend::new(&[spec], bs, 64).unwrap();
    b.fit(&model()).unwrap();
    b
}

/// Appends tokens `start..start + n` as one step, then commits it, rolls
/// it back, or keeps its first `keep` rows.
fn step(b: &mut PagedBackend, start: usize, n: usize, kind: usize, keep: usize) {
    let ch = shape().kv_channels();
    let ids: Vec<u32> = (start..start + n).map(|t| t as u32).collect();
    b.begin(&ids).unwrap();
    let k: Vec<f32> = (start..start + n).flat_map(|t| row(t, 0, ch)).collect();
    let v: Vec<f32> = (start..start + n).flat_map(|t| row(t, 1, ch)).collect();
    b.append(0, &k, &v).unwrap();
    match kind {
        0..=5 => b.commit().unwrap(),
        6 => b.rollback(),
        _ => b.commit_prefix(keep.min(n)).unwrap(),
    }
}

/// Whether each token's block is staged (held exact) in one part.
fn staged(b: &PagedBackend, part: KvPart, bs: usize) -> Vec<bool> {
    let Some(seq) = b.sequence().filter(|_| b.tokens() > 0) else {
        return Vec::new();
    };
    let table = b.manager().block_table(seq).unwrap();
    let part = b.storage().part(0, part).unwrap();
    (0..b.tokens())
        .map(|t| part.is_staged(table[t / bs].index()))
        .collect()
}

/// Every token's rows of one part as its storage reads them now, and the
/// tile's kind (`"levels"`, `"f32"`, `"f16"`).
fn read(b: &PagedBackend, part: KvPart) -> (Vec<f32>, &'static str) {
    let (tokens, ch) = (b.tokens(), shape().kv_channels());
    let Some(seq) = b.sequence().filter(|_| tokens > 0) else {
        return (Vec::new(), "none");
    };
    let pages: Vec<u32> = b
        .manager()
        .block_table(seq)
        .unwrap()
        .iter()
        .map(|p| p.0)
        .collect();
    let part = b.storage().part(0, part).unwrap();
    let mut scratch = attention::stored::PartScratch::default();
    let tile = part.read_tile(&pages, 0, tokens, &mut scratch).unwrap();
    match tile.rows {
        TileRows::F32(r) => (r.to_vec(), "f32"),
        TileRows::F16(h) => (
            h.chunks_exact(2)
                .map(|h| half::f16::from_le_bytes([h[0], h[1]]).to_f32())
                .collect(),
            "f16",
        ),
        TileRows::Levels(l) => {
            let mut out = vec![0.0; tokens * ch];
            l.dequantize_into(&mut out);
            (out, "levels")
        }
        TileRows::PairCodes(_) => (tile.rows.to_f32_vec(), "pair codes"),
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Each hierarchical form beside the `int4` form of its upper plane.
const TWINS: [(&str, &str); 4] = [
    ("int8h", "int4"),
    ("int8h-g16+secded84", "int4-g16+secded84"),
    ("int8h-ch+sink4", "int4-ch+sink4"),
    ("int8h-ch+win5+hamming74", "int4-ch+win5+hamming74"),
];

proptest! {
    #![proptest_config(ProptestConfig::with_cases(16))]

    /// The draft view is the upper plane's form, bit for bit, through any
    /// steps; the full view is within a small share of the upper plane's
    /// error, and holds every exact row as the upper plane does.
    #[test]
    fn draft_view_is_the_upper_form_and_the_full_view_is_finer(
        twin in 0..TWINS.len(),
        bs in prop::sample::select(vec![4usize, 8, 16]),
        steps in prop::collection::vec((1usize..12, 0usize..10, 0usize..12), 1..10),
    ) {
        let (h, four) = TWINS[twin];
        let mut planes = backend(h, h, bs);
        let mut upper = backend(four, four, bs);
        let ch = shape().kv_channels();
        for (n, kind, keep) in steps {
            let start = planes.tokens();
            step(&mut planes, start, n, kind, keep);
            step(&mut upper, start, n, kind, keep);
            for (p, part) in [KvPart::Keys, KvPart::Values].into_iter().enumerate() {
                let truth: Vec<f32> = (0..planes.tokens()).flat_map(|t| row(t, p, ch)).collect();
                let (want, _) = read(&upper, part);
                planes.set_read_view(ReadView::Draft).unwrap();
                let (draft, _) = read(&planes, part);
                planes.set_read_view(ReadView::Full).unwrap();
                let (full, _) = read(&planes, part);
                prop_assert_eq!(bits(&draft), bits(&want), "{} in blocks of {}", h, bs);
                let exact = staged(&planes, part, bs);
                let mut worst = (0.0f32, 0.0f32);
                for (i, ((f, d), x)) in full.iter().zip(&draft).zip(&truth).enumerate() {
                    if exact[i / ch] {
                        // An exact row of the upper plane is exact in both views.
                        prop_assert_eq!(f.to_bits(), d.to_bits());
                    } else {
                        worst = (worst.0.max((f - x).abs()), worst.1.max((d - x).abs()));
                    }
                }
                prop_assert!(
                    worst.0 <= worst.1 / 8.0 + 1e-3,
                    "{h}: full view error {} against the upper plane's {}", worst.0, worst.1
                );
            }
        }
    }
}

/// Reading in the draft view takes the integer kernels' stored levels;
/// the full view decodes f32 rows; a form without a draft view refuses
/// it and the storage stays in the full view.
#[test]
fn views_read_their_own_tiles_and_a_form_without_one_refuses() {
    let mut b = backend("int8h-ch", "int8h", 4);
    step(&mut b, 0, 9, 0, 0);
    b.set_read_view(ReadView::Draft).unwrap();
    // Tokens 0..8 are sealed, token 8 staged: gathered as levels per block.
    assert_eq!(read(&b, KvPart::Values).1, "levels");
    b.set_read_view(ReadView::Full).unwrap();
    assert_eq!(read(&b, KvPart::Values).1, "f32");
    let mut mixed = backend("int8h-ch", "int8", 4);
    step(&mut mixed, 0, 9, 0, 0);
    let before = read(&mixed, KvPart::Keys).0;
    let e = mixed
        .set_read_view(ReadView::Draft)
        .unwrap_err()
        .to_string();
    assert!(e.contains("int8 keeps no draft view"), "{e}");
    assert_eq!(bits(&read(&mixed, KvPart::Keys).0), bits(&before));
    let e = backend("int4", "int4", 4)
        .set_read_view(ReadView::Draft)
        .unwrap_err()
        .to_string();
    assert!(e.contains("keeps no draft view"), "{e}");
}

/// Groups of several blocks, and forms blocks cannot hold, are refused
/// when the cache is built.
#[test]
fn unpageable_hierarchical_forms_are_refused() {
    let spec = |f: &str| LayerSpec {
        key: f.parse::<CacheForm>().unwrap(),
        value: "int8".parse().unwrap(),
        channels: 64,
    };
    let e = PagedBackend::new(&[spec("int8h-ch16")], 4, 8).unwrap_err();
    assert!(e.to_string().contains("one block per group"), "{e}");
    assert!(PagedBackend::new(&[spec("int8h-ch16")], 16, 8).is_ok());
}

/// Bits flipped in both planes of a protected form at a low bit error
/// rate are all corrected (reads equal the clean reads in both views);
/// a scrub rewrites them.
#[test]
fn faults_in_either_plane_are_corrected_by_its_code() {
    let form = "int8h-ch+secded84";
    let mut clean = backend(form, form, 8);
    let mut hit = backend(form, form, 8);
    for b in [&mut clean, &mut hit] {
        step(b, 0, 20, 0, 0);
    }
    let channel = BinarySymmetric::new(2e-4).unwrap();
    let injection = hit.inject(&channel, 7, FaultTarget::Everything).unwrap();
    assert!(injection > 0, "no flips to correct");
    for view in [ReadView::Full, ReadView::Draft] {
        for b in [&mut clean, &mut hit] {
            b.set_read_view(view).unwrap();
        }
        for part in [KvPart::Keys, KvPart::Values] {
            assert_eq!(
                bits(&read(&hit, part).0),
                bits(&read(&clean, part).0),
                "{view:?}"
            );
        }
    }
    let storage = hit.storage().clone();
    let table = hit
        .manager()
        .block_table(hit.sequence().unwrap())
        .unwrap()
        .to_vec();
    let mut scrubbed = kv_quant::ScrubStats::default();
    for &block in &table {
        scrubbed += storage.scrub(block).unwrap();
    }
    assert!(
        scrubbed.values.corrected + scrubbed.metadata.corrected > 0,
        "{scrubbed:?}"
    );
}

/// Blocks copied out of one cache (the host tier's snapshots) and into
/// another that holds other rows read, in both views, as the first; a
/// block of another form is refused.
#[test]
fn snapshots_carry_both_planes() {
    let (k, v) = ("int8h-ch+sink4", "int8h-g16");
    let mut from = backend(k, v, 4);
    step(&mut from, 0, 14, 0, 0);
    let mut into = backend(k, v, 4);
    // Other rows at the same positions: the rows of tokens 100.. .
    let ch = shape().kv_channels();
    into.begin(&[0; 14]).unwrap();
    let other = |p| (100..114).flat_map(|t| row(t, p, ch)).collect::<Vec<f32>>();
    into.append(0, &other(0), &other(1)).unwrap();
    into.commit().unwrap();
    let table = |b: &PagedBackend| {
        b.manager()
            .block_table(b.sequence().unwrap())
            .unwrap()
            .to_vec()
    };
    let (src, dst) = (table(&from), table(&into));
    assert_ne!(
        bits(&read(&into, KvPart::Keys).0),
        bits(&read(&from, KvPart::Keys).0)
    );
    for (&a, &b) in src.iter().zip(&dst) {
        let data = from.storage().snapshot(a).unwrap();
        into.storage().restore(b, data).unwrap();
    }
    for view in [ReadView::Full, ReadView::Draft] {
        from.set_read_view(view).unwrap();
        into.set_read_view(view).unwrap();
        for part in [KvPart::Keys, KvPart::Values] {
            assert_eq!(
                bits(&read(&into, part).0),
                bits(&read(&from, part).0),
                "{view:?}"
            );
        }
    }
    let mut flat = backend("int4-ch+sink4", "int4-g16", 4);
    step(&mut flat, 0, 14, 0, 0);
    let data = flat.storage().snapshot(table(&flat)[1]).unwrap();
    assert!(into.storage().restore(dst[1], data).is_err());
}

/// A sequence cut back into a sealed block and written again keeps the
/// rows it kept at the full view's precision: the block is staged from
/// its full reading (upper plus residual), not from its upper plane.
#[test]
fn a_block_cut_into_is_staged_from_its_full_reading() {
    let mut b = backend("int8h-ch", "int8h-ch", 4);
    step(&mut b, 0, 10, 0, 0);
    b.truncate(6).unwrap();
    step(&mut b, 6, 6, 0, 0);
    let ch = shape().kv_channels();
    for (p, part) in [KvPart::Keys, KvPart::Values].into_iter().enumerate() {
        let truth: Vec<f32> = (0..12).flat_map(|t| row(t, p, ch)).collect();
        b.set_read_view(ReadView::Draft).unwrap();
        let draft = read(&b, part).0;
        b.set_read_view(ReadView::Full).unwrap();
        let full = read(&b, part).0;
        let worst = |v: &[f32]| {
            v.iter()
                .zip(&truth)
                .map(|(a, x)| (a - x).abs())
                .fold(0.0f32, f32::max)
        };
        // Rows 4 and 5 were kept through the cut; every row is sealed.
        assert!(
            worst(&full) <= worst(&draft) / 8.0,
            "full {} against draft {}",
            worst(&full),
            worst(&draft)
        );
    }
}
