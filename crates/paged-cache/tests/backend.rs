//! [`PagedBackend`] against the f32 [`DenseBackend`] and against kv-quant
//! stores of the whole sequence: prefill then token-by-token steps over
//! several blocks, per-layer and per-part forms, and rolled-back steps that
//! give their blocks back.

use attention::{
    Attention, DenseBackend, HeadShape, KvBackend, Mask, ModelKvShape, Numerics, run_step,
};
use gf2_codes::channel::ExactFlips;
use kv_quant::{CacheForm, KvStore};
use paged_cache::{LayerSpec, PagedBackend, PagedCacheError};

const BS: usize = 16;

fn shape() -> HeadShape {
    HeadShape::new(4, 2, 16).unwrap()
}

fn model() -> ModelKvShape<'static> {
    ModelKvShape {
        layers: 3,
        heads: shape(),
        rope: None,
    }
}

fn rows(n: usize, ch: usize, phase: f32) -> Vec<f32> {
    (0..n * ch)
        .map(|i| ((i as f32 * 0.731 + phase).sin() * 1.7).tanh())
        .collect()
}

/// Runs steps of `sizes` tokens on `backend`, every layer appending its rows
/// and attending; returns each layer's outputs, step after step.
fn drive<B: KvBackend>(backend: &mut B, sizes: &[usize]) -> Vec<Vec<f32>>
where
    B::Error: std::fmt::Debug,
{
    let m = model();
    let (ch, mut attn) = (m.heads.kv_channels(), Attention::new(m.heads));
    // Exact scores, whichever tiles a backend reads as stored.
    attn.set_numerics(Numerics::Exact);
    backend.fit(&m).unwrap();
    let mut outs = vec![Vec::new(); m.layers];
    let mut start = 0;
    for &n in sizes {
        let ids: Vec<u32> = (start..start + n).map(|t| t as u32).collect();
        let positions: Vec<usize> = (start..start + n).collect();
        run_step(backend, &ids, |b| {
            for (l, out) in outs.iter_mut().enumerate() {
                let k = rows(n, ch, (start * 7 + l) as f32);
                let v = rows(n, ch, (start * 11 + l) as f32 + 0.5);
                b.append(l, &k, &v)?;
                let q = rows(n, m.heads.q_len(), start as f32 + 0.25);
                out.extend(b.attend(l, &attn, &q, &positions, &Mask::Causal)?.out);
            }
            Ok::<_, B::Error>(())
        })
        .unwrap();
        start += n;
    }
    outs
}

const STEPS: [usize; 6] = [37, 1, 1, 10, 1, 1];

#[test]
fn fp32_pages_equal_the_dense_oracle() {
    let ch = shape().kv_channels();
    let form: CacheForm = "fp32".parse().unwrap();
    let mut paged = PagedBackend::new(&[LayerSpec::uniform(form, ch); 3], BS, 8).unwrap();
    let got = drive(&mut paged, &STEPS);
    let want = drive(&mut DenseBackend::new(), &STEPS);
    assert_eq!(paged.tokens(), 51);
    for (g, w) in got.iter().zip(&want) {
        assert_eq!(g.len(), w.len());
        for (a, b) in g.iter().zip(w) {
            approx::assert_relative_eq!(a, b, epsilon = 1e-6, max_relative = 1e-6);
        }
    }
}

#[test]
fn encoded_pages_equal_the_same_form_stored_whole() {
    let ch = shape().kv_channels();
    let (m, mut attn) = (model(), Attention::new(shape()));
    // Exact scores: under the default, `int4` tiles take integer scores
    // whose value coding is per tile, and the paged source's tiles stop at
    // its blocks where the whole store's do not.
    attn.set_numerics(Numerics::Exact);
    let specs = [
        LayerSpec::uniform("int4+secded84".parse().unwrap(), ch),
        LayerSpec {
            key: "int8".parse().unwrap(),
            value: "int4-g16".parse().unwrap(),
            channels: ch,
        },
        LayerSpec::uniform("fp8-e4m3-tok".parse().unwrap(), ch),
    ];
    let mut paged = PagedBackend::new(&specs, BS, 8).unwrap();
    let got = drive(&mut paged, &STEPS);
    // The oracle: every step's K/V of a layer quantised as one store.
    for (l, spec) in specs.iter().enumerate() {
        let (mut k, mut v, mut want) = (Vec::new(), Vec::new(), Vec::new());
        let mut start = 0;
        for &n in &STEPS {
            k.extend(rows(n, ch, (start * 7 + l) as f32));
            v.extend(rows(n, ch, (start * 11 + l) as f32 + 0.5));
            let t = start + n;
            let ks = KvStore::quantize(spec.key, &k, t, ch).unwrap();
            let vs = KvStore::quantize(spec.value, &v, t, ch).unwrap();
            let q = rows(n, m.heads.q_len(), start as f32 + 0.25);
            let positions: Vec<usize> = (start..t).collect();
            want.extend(
                attn.prefill(&q, &positions, &ks, &vs, &Mask::Causal)
                    .unwrap()
                    .out,
            );
            start = t;
        }
        assert_eq!(got[l].len(), want.len());
        for (a, b) in got[l].iter().zip(&want) {
            approx::assert_relative_eq!(a, b, epsilon = 1e-5, max_relative = 1e-5);
        }
    }
    let stats = paged.read_stats();
    assert!(stats.keys.values.words > 0, "{stats:?}");
    assert_eq!(stats.keys.values.corrected, 0);
    // 51 tokens take four blocks of 16.
    let per_block: usize = (0..3)
        .map(|l| paged.storage().layer_block_bytes(l).unwrap())
        .sum();
    assert_eq!(paged.stored_bytes().unwrap(), 4 * per_block);
}

#[test]
fn a_rolled_back_step_gives_its_blocks_back() {
    let m = model();
    let ch = m.heads.kv_channels();
    let form: CacheForm = "int4+secded84".parse().unwrap();
    let mut paged = PagedBackend::new(&[LayerSpec::uniform(form, ch); 3], BS, 4).unwrap();
    paged.fit(&m).unwrap();
    // A first step that fails: the sequence goes away entirely.
    let failed = run_step(&mut paged, &[1; 20], |b| {
        b.append(0, &rows(20, ch, 0.0), &rows(20, ch, 1.0))?;
        Err::<(), _>(PagedCacheError::NoStorage)
    });
    assert!(failed.is_err());
    assert_eq!((paged.tokens(), paged.manager().pool().num_used()), (0, 0));
    assert!(paged.sequence().is_none());
    drive_ok(&mut paged, 20);
    assert_eq!(paged.manager().pool().num_used(), 2);
    // A step that fails after layer 0 wrote into a new block.
    let failed = run_step(&mut paged, &[2; 14], |b| {
        b.append(0, &rows(14, ch, 0.0), &rows(14, ch, 1.0))?;
        Err::<(), _>(PagedCacheError::NoStorage)
    });
    assert!(failed.is_err());
    assert_eq!((paged.tokens(), paged.manager().pool().num_used()), (20, 2));
    // A step larger than the pool is refused before anything changes.
    assert!(run_step(&mut paged, &[3; 60], |_| Ok::<(), PagedCacheError>(())).is_err());
    assert_eq!((paged.tokens(), paged.manager().pool().num_used()), (20, 2));
    paged.manager().check_invariants().unwrap();
}

fn drive_ok(paged: &mut PagedBackend, n: usize) {
    let ch = shape().kv_channels();
    run_step(paged, &vec![5; n], |b| {
        for l in 0..3 {
            b.append(l, &rows(n, ch, l as f32), &rows(n, ch, 2.0))?;
        }
        Ok::<(), PagedCacheError>(())
    })
    .unwrap();
}

#[test]
fn forms_a_block_cannot_hold_and_other_models_are_refused() {
    let ch = shape().kv_channels();
    for form in ["int4-ch36", "fp8-e4m3", "pca-r8", "vq"] {
        let spec = LayerSpec::uniform(form.parse().unwrap(), ch);
        assert!(
            matches!(
                PagedBackend::new(&[spec], BS, 4),
                Err(PagedCacheError::InvalidParameter { name: "form", .. })
            ),
            "{form}"
        );
    }
    let form: CacheForm = "int8".parse().unwrap();
    let mut paged = PagedBackend::new(&[LayerSpec::uniform(form, ch); 2], BS, 4).unwrap();
    assert!(paged.fit(&model()).is_err());
}

#[test]
fn faults_in_resident_blocks_are_seeded_and_scrubbed() {
    use gf2_codes::channel::BinarySymmetric;
    use kv_quant::FaultTarget;
    let ch = shape().kv_channels();
    let form: CacheForm = "int4+secded84".parse().unwrap();
    let build = || {
        let mut b = PagedBackend::new(&[LayerSpec::uniform(form, ch); 3], BS, 8).unwrap();
        b.fit(&model()).unwrap();
        drive_ok(&mut b, 40);
        b
    };
    let (a, b) = (build(), build());
    let channel = BinarySymmetric::new(2e-3).unwrap();
    let flips = a.inject(&channel, 7, FaultTarget::Values).unwrap();
    assert_eq!(b.inject(&channel, 7, FaultTarget::Values).unwrap(), flips);
    assert!(flips > 0);
    let table = a
        .manager()
        .block_table(a.sequence().unwrap())
        .unwrap()
        .to_vec();
    for &block in &table {
        assert_eq!(
            a.storage().snapshot(block).unwrap(),
            b.storage().snapshot(block).unwrap()
        );
    }
    let scrubbed = a.scrub().unwrap();
    assert!(scrubbed.values.corrected > 0, "{scrubbed:?}");
    assert!(scrubbed.values.corrected + scrubbed.values.detected <= flips);
    // What scrubbing corrected stays corrected.
    assert_eq!(a.scrub().unwrap().values.corrected, 0);
}

#[test]
fn an_erased_value_is_never_rebuilt_from_another_sequences_block() {
    use attention::KvSource;
    use kv_quant::FaultTarget;
    use paged_cache::{BlockId, BlockStorage, KvPart, PageTable, PagedKv};
    let ch = 8;
    let form: CacheForm = "int4+secded84+interp".parse().unwrap();
    let storage = BlockStorage::new(3, 4, &[LayerSpec::uniform(form, ch)]).unwrap();
    // Block 1 holds sequence A; blocks 0 and 2 (its physical neighbours)
    // hold another sequence with very different values.
    for b in 0..3u32 {
        for t in 0..4 {
            let v = if b == 1 { 0.1 * t as f32 } else { 50.0 };
            let row: Vec<f32> = (0..ch).map(|c| v + c as f32 * 0.01).collect();
            storage.write(BlockId(b), t, 0, &row, &row).unwrap();
        }
    }
    let clean = storage
        .with_store(BlockId(1), 0, KvPart::Keys, |st| {
            st.decode().unwrap().values
        })
        .unwrap();
    // Two flips in the codeword of A's first and last rows, channel 3.
    let rb = storage
        .with_store(BlockId(1), 0, KvPart::Keys, |s| s.row_bytes())
        .unwrap() as u64;
    let cells = [(0u64, 3u64), (3, 3)];
    let positions: Vec<u64> = cells
        .iter()
        .flat_map(|&(t, c)| [8 * (t * rb + c) + 1, 8 * (t * rb + c) + 5])
        .collect();
    storage
        .inject(
            BlockId(1),
            0,
            KvPart::Keys,
            &ExactFlips::new(positions),
            0,
            FaultTarget::Values,
        )
        .unwrap();
    let table = PageTable::from_tables(&[(&[BlockId(1)], 4)], 4).unwrap();
    let keys = PagedKv::new(&storage, &table, 0, 0, KvPart::Keys).unwrap();
    let mut scratch = Default::default();
    let tile = keys.read_tile(0, 4, &mut scratch).unwrap();
    assert_eq!(tile.stats.values.detected, 2);
    let attention::TileRows::F32(got) = tile.rows else {
        panic!("a tile with erased values decodes to f32 rows")
    };
    assert_eq!(
        got[3],
        clean[ch + 3],
        "first row: from the row after it only"
    );
    assert_eq!(
        got[3 * ch + 3],
        clean[2 * ch + 3],
        "last row: from the row before it only"
    );
}
