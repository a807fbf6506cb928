//! Staged forms on the paged cache (per-channel keys, exact sinks and
//! windows: kv-quant's `BlockPlan`) against a reference written from the
//! plan alone: after every committed or rolled-back step, each token of
//! each layer part reads back as its block's rows quantized at once in the
//! sealed form where the plan says the block is sealed, and as exact f16
//! rows where it is not; attention over the pages equals attention over
//! those reference rows; forks, copy-on-write, swap and rollback keep them,
//! and a step that keeps a prefix of its rows (speculative decoding's
//! `commit_prefix`) reads as if only those rows had been written.

mod common;

use attention::{Attention, DenseKv, KvBackend, Mask, Numerics, TileRows};
use common::{model, row, shape};
use kv_quant::{BlockPlan, CacheForm, KvStore};
use paged_cache::{KvPart, LayerSpec, PagedBackend, PagedCacheError};
use proptest::prelude::*;

/// The values the plan says a sequence of `tokens` tokens holds in one part.
fn reference(plan: &BlockPlan, tokens: usize, part: usize, ch: usize) -> Vec<f32> {
    let bs = plan.block_size;
    let sealed = plan.sealable(tokens);
    let mut out = Vec::with_capacity(tokens * ch);
    let mut b = 0;
    while b * bs < tokens {
        // A sealed group of blocks is quantized at once; other blocks one
        // at a time.
        let blocks = if plan.staged && b >= plan.sink_blocks && b < sealed {
            plan.group_blocks
        } else {
            1
        };
        let n = (tokens - b * bs).min(blocks * bs);
        let rows: Vec<f32> = (b * bs..b * bs + n)
            .flat_map(|t| row(t, part, ch))
            .collect();
        let form = if plan.staged && b >= plan.sink_blocks && b < sealed {
            plan.sealed
        } else if plan.staged {
            plan.exact
        } else {
            plan.sealed
        };
        // A staged block is sealed from its exact (f16) rows, as KIVI
        // quantizes its f16 residual.
        let rows = if plan.staged {
            let exact = KvStore::quantize(plan.exact, &rows, n, ch).unwrap();
            exact.decode().unwrap().values
        } else {
            rows
        };
        let store = KvStore::quantize(form, &rows, n, ch).unwrap();
        let values = store.decode().unwrap().values;
        out.extend(values);
        b += blocks;
    }
    out
}

/// Every token's rows as the backend's storage reads them, through the
/// sequence's pages.
fn stored(backend: &PagedBackend, part: KvPart, ch: usize) -> Vec<f32> {
    let storage = backend.storage();
    let Some(seq) = backend.sequence() else {
        return Vec::new();
    };
    let tokens = backend.tokens();
    if tokens == 0 {
        return Vec::new();
    }
    let pages: Vec<u32> = backend
        .manager()
        .block_table(seq)
        .unwrap()
        .iter()
        .map(|b| b.0)
        .collect();
    let part = storage.part(0, part).unwrap();
    let mut scratch = attention::stored::PartScratch::default();
    let tile = part.read_tile(&pages, 0, tokens, &mut scratch).unwrap();
    let mut values = match tile.rows {
        TileRows::F32(r) => r.to_vec(),
        TileRows::F16(b) => b
            .chunks_exact(2)
            .map(|h| half::f16::from_le_bytes([h[0], h[1]]).to_f32())
            .collect(),
        TileRows::Levels(l) => {
            let mut out = vec![0.0; tokens * ch];
            l.dequantize_into(&mut out);
            out
        }
        TileRows::PairCodes(_) => tile.rows.to_f32_vec(),
    };
    // Tiles of rotated forms come in the rotated coordinates.
    if let Some(h) = part.rotation() {
        h.unrotate(&mut values);
    }
    values
}

/// Opens a step and appends tokens `start..start + n` to it.
fn open_step(backend: &mut PagedBackend, start: usize, n: usize) {
    let ch = shape().kv_channels();
    let ids: Vec<u32> = (start..start + n).map(|t| t as u32).collect();
    backend.begin(&ids).unwrap();
    let k: Vec<f32> = (start..start + n).flat_map(|t| row(t, 0, ch)).collect();
    let v: Vec<f32> = (start..start + n).flat_map(|t| row(t, 1, ch)).collect();
    backend.append(0, &k, &v).unwrap();
}

/// Appends tokens `start..start + n` in one step, then keeps its first
/// `keep` rows (`commit_prefix`).
fn step_keeping(backend: &mut PagedBackend, start: usize, n: usize, keep: usize) {
    open_step(backend, start, n);
    backend.commit_prefix(keep).unwrap();
}

/// Appends tokens `start..start + n` in one step, then commits it or
/// rolls it back.
fn step(backend: &mut PagedBackend, start: usize, n: usize, commit: bool) {
    open_step(backend, start, n);
    if commit {
        backend.commit().unwrap();
    } else {
        backend.rollback();
    }
}

fn check_against_reference(backend: &PagedBackend, spec: &LayerSpec, bs: usize) {
    let ch = spec.channels;
    for (p, (form, part)) in [(spec.key, KvPart::Keys), (spec.value, KvPart::Values)]
        .into_iter()
        .enumerate()
    {
        let plan = BlockPlan::new(form, bs).unwrap();
        let want = reference(&plan, backend.tokens(), p, ch);
        let got = stored(backend, part, ch);
        assert_eq!(got.len(), want.len());
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(
                (g - w).abs() <= 1e-5 * w.abs().max(1.0),
                "{form} at {} tokens, value {i}: {g} against {w}",
                backend.tokens()
            );
        }
    }
}

const FORMS: [(&str, &str); 8] = [
    ("int4-ch", "int4"),
    // Groups of 16 tokens: several blocks in blocks of 4 and 8.
    ("int4-ch16+sink4", "int2-ch16"),
    ("int3-ch16+secded84+win5", "int8-ch16+sink2"),
    ("int4-ch+sink4", "lm4"),
    ("int4-ch+sink4", "lm4+sink4"),
    ("int3-ch+win9", "int4+win9"),
    ("int4-ch+secded84", "int4+secded84"),
    ("int8-ch+sink2+win5", "fp16"),
];

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    #[test]
    fn staged_pages_read_as_their_plan_says(
        forms in 0..FORMS.len(),
        bs in prop::sample::select(vec![4usize, 8, 16]),
        steps in prop::collection::vec((1usize..12, 0usize..10, 0usize..12), 1..12),
    ) {
        let ch = shape().kv_channels();
        let (k, v) = FORMS[forms];
        let spec = LayerSpec { key: k.parse().unwrap(), value: v.parse().unwrap(), channels: ch };
        let mut backend = PagedBackend::new(&[spec], bs, 64).unwrap();
        backend.fit(&model()).unwrap();
        for (n, kind, keep) in steps {
            let start = backend.tokens();
            match kind {
                0..=5 => step(&mut backend, start, n, true),
                6 => step(&mut backend, start, n, false),
                _ => step_keeping(&mut backend, start, n, keep.min(n)),
            }
            check_against_reference(&backend, &spec, bs);
        }
    }
}

#[test]
fn attention_over_staged_pages_equals_attention_over_the_reference_rows() {
    let ch = shape().kv_channels();
    let mut attn = Attention::new(shape());
    attn.set_numerics(Numerics::Exact);
    for (k, v) in FORMS {
        for bs in [4, 16] {
            let spec = LayerSpec {
                key: k.parse().unwrap(),
                value: v.parse().unwrap(),
                channels: ch,
            };
            let mut backend = PagedBackend::new(&[spec], bs, 64).unwrap();
            backend.fit(&model()).unwrap();
            for (start, n) in [(0, 21), (21, 1), (22, 1), (23, 17), (40, 3)] {
                step(&mut backend, start, n, true);
            }
            let t = backend.tokens();
            let q: Vec<f32> = (0..shape().q_len())
                .map(|i| (i as f32 * 0.37).cos())
                .collect();
            // Attention of a query at the last position, read through the
            // pages, against the same rows given as f32.
            backend.begin(&[t as u32]).unwrap();
            backend.append(0, &row(t, 0, ch), &row(t, 1, ch)).unwrap();
            let got = backend
                .attend(0, &attn, &q, &[t], &Mask::Causal)
                .unwrap()
                .out;
            backend.rollback();
            let kplan = BlockPlan::new(spec.key, bs).unwrap();
            let vplan = BlockPlan::new(spec.value, bs).unwrap();
            // The step's own row is staged exact (or row-local coded).
            let with_step = |plan: &BlockPlan, p: usize| {
                let mut rows = reference(plan, t, p, ch);
                let last = if plan.staged { plan.exact } else { plan.sealed };
                let own = KvStore::quantize(last, &row(t, p, ch), 1, ch).unwrap();
                rows.extend(own.decode().unwrap().values);
                rows
            };
            let (kr, vr) = (with_step(&kplan, 0), with_step(&vplan, 1));
            let keys = DenseKv::new(&kr, t + 1, ch).unwrap();
            let values = DenseKv::new(&vr, t + 1, ch).unwrap();
            let want = attn
                .decode(&q, t, &keys, &values, &Mask::Causal)
                .unwrap()
                .out;
            for (g, w) in got.iter().zip(&want) {
                assert!(
                    (g - w).abs() < 1e-4,
                    "{k}/{v} blocks of {bs}: {g} against {w}"
                );
            }
        }
    }
}

#[test]
fn forks_swaps_and_bytes_follow_the_staged_rows() {
    let ch = shape().kv_channels();
    let spec = LayerSpec::uniform("int4-ch+sink4".parse::<CacheForm>().unwrap(), ch);
    let bs = 8;
    let mut backend = PagedBackend::new(&[spec], bs, 16).unwrap();
    backend.fit(&model()).unwrap();
    step(&mut backend, 0, 13, true);
    step(&mut backend, 13, 6, true);
    let storage = backend.storage().clone();
    let seq = backend.sequence().unwrap();
    let table = backend.manager().block_table(seq).unwrap().to_vec();
    // 19 tokens in blocks of 8: block 0 holds the sinks (staged for good),
    // block 1 is sealed, block 2 is being written (staged).
    let staged: Vec<bool> = table
        .iter()
        .map(|&b| storage.is_staged(b, 0, KvPart::Keys).unwrap())
        .collect();
    assert_eq!(staged, [true, false, true]);
    let sealed = storage.part_block_bytes(0, KvPart::Keys).unwrap();
    let exact = KvStore::zeroed("fp16".parse().unwrap(), bs, ch)
        .unwrap()
        .stored_bytes();
    assert_eq!(
        backend.stored_bytes().unwrap(),
        2 * (3 * sealed + 2 * exact),
        "every block's sealed rows, and the exact rows of the two staged blocks"
    );
    // A snapshot restored into another block reads the same; a block
    // snapshot carries its staged rows.
    let before = stored(&backend, KvPart::Keys, ch);
    for &b in &table {
        let data = storage.snapshot(b).unwrap();
        storage.restore(b, data).unwrap();
    }
    assert_eq!(stored(&backend, KvPart::Keys, ch), before);
    check_against_reference(&backend, &spec, bs);
}

#[test]
fn blocks_a_form_cannot_use_are_refused_before_any_work() {
    let ch = shape().kv_channels();
    for (form, bs) in [
        ("int4-ch24", 16),
        ("vq", 16),
        ("shard", 16),
        ("fp8-e4m3", 16),
    ] {
        let spec = LayerSpec::uniform(form.parse().unwrap(), ch);
        assert!(
            matches!(
                PagedBackend::new(&[spec], bs, 4),
                Err(PagedCacheError::InvalidParameter { name: "form", .. })
            ),
            "{form} in blocks of {bs}"
        );
    }
    for bs in [32, 16, 8] {
        let spec = LayerSpec::uniform("int4-ch32".parse().unwrap(), ch);
        assert!(PagedBackend::new(&[spec], bs, 4).is_ok(), "blocks of {bs}");
    }
}

/// Cutting a sequence back (`truncate`: a speculative draft's cache) to a
/// length at which the same blocks are sealed leaves the rows a sequence
/// of that length holds; so does any cut of row-local forms. Cuts into a sealed block keep
/// its sealed rows (re-staged from them when written again): not the
/// reference's exact rows, so not checked here.
#[test]
fn truncation_that_keeps_the_sealed_blocks_reads_as_the_shorter_sequence() {
    let ch = shape().kv_channels();
    let bs = 4;
    for (k, v) in FORMS
        .into_iter()
        .chain([("int8", "int4"), ("fp16", "int4+secded84")])
    {
        let spec = LayerSpec {
            key: k.parse().unwrap(),
            value: v.parse().unwrap(),
            channels: ch,
        };
        let plans = [spec.key, spec.value].map(|f| BlockPlan::new(f, bs).unwrap());
        let mut backend = PagedBackend::new(&[spec], bs, 64).unwrap();
        backend.fit(&model()).unwrap();
        step(&mut backend, 0, 13, true);
        step(&mut backend, 13, 2, true);
        // The shortest cut every part allows: one where each staged part
        // has sealed what it has at 15 tokens (a window seals a block only
        // once its rows are old enough, so that can be past the blocks).
        let floor = (0..=15)
            .find(|&t| {
                plans
                    .iter()
                    .all(|p| !p.staged || p.sealable(t) == p.sealable(15))
            })
            .unwrap();
        for t in (floor..=15).rev() {
            backend.truncate(t).unwrap();
            assert_eq!(backend.tokens(), t);
            check_against_reference(&backend, &spec, bs);
        }
        assert!(backend.truncate(16).is_err(), "past the tokens held");
        // Written again from the cut: as a sequence written in one go.
        let t = backend.tokens();
        step(&mut backend, t, 15 - t, true);
        check_against_reference(&backend, &spec, bs);
    }
}
