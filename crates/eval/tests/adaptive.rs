//! Adaptive protection on the tiny model: non-uniform fault maps (hot
//! layers, hot blocks, hot rows) are seen where they are by the scrubber's
//! counts, the choice promotes exactly the hot regions, per-block forms read
//! the same values as one store, and bad maps and block forms are refused.

mod common;

use kv_eval::adaptive::{AdaptRule, Level, choose, choose_blocks};
use kv_eval::cache::{BlockForms, CacheMode, ChannelKind, FaultSpec, HotMap, HotRegion, KvCache};
use kv_quant::{CacheForm, FaultTarget};

use common::tiny::{LAYERS, VOCAB, model, run, tokens};

fn form(spec: &str) -> CacheMode {
    CacheMode::form(spec.parse().unwrap())
}

fn hot(region: HotRegion, hot_ber: f64, ber: f64, seed: u64) -> Option<FaultSpec> {
    Some(FaultSpec {
        channel: ChannelKind::Bsc,
        ber,
        seed,
        target: FaultTarget::Values,
        hot: Some(HotMap {
            region,
            ber: hot_ber,
        }),
    })
}

const RULE: AdaptRule = AdaptRule {
    promote_at: 1e-3,
    demote_at: 0.0,
};

/// A non-uniform fault map: the hot layer sees its own bit error rate, and
/// the per-layer codeword counts (a scrubber's view) show it, which is what
/// adaptive protection reads; the adaptive choice promotes exactly it.
#[test]
fn hot_layers_are_seen_per_layer_and_promoted() {
    let m = model();
    let toks = tokens(64);
    let faults = hot(HotRegion::Layers(1 << 1), 2e-2, 1e-5, 4);
    let (_, cache) = run(&m, &toks, form("int4+secded84"), faults);
    let layers = &cache.stats().layers;
    assert_eq!(layers.len(), LAYERS);
    assert!(layers.iter().all(|l| l.words > 0));
    let rate =
        |l: usize| (layers[l].corrected + layers[l].detected) as f64 / layers[l].words as f64;
    for l in (0..LAYERS).filter(|&l| l != 1) {
        assert!(rate(1) > 50.0 * rate(l).max(1e-6), "layer {l}: {layers:?}");
    }
    let expected: Vec<Level> = (0..LAYERS)
        .map(|l| if l == 1 { Level::Golay } else { Level::Secded })
        .collect();
    assert_eq!(choose(layers, RULE).unwrap(), expected);
}

/// Blocks and rows: the observed per-block counts single out the blocks
/// holding hot rows, the choice promotes exactly those, and every run of
/// one seed sees the same map.
#[test]
fn hot_blocks_and_rows_are_seen_per_block_and_promoted() {
    let m = model();
    let toks = tokens(64);
    let block = 8;
    for region in [
        HotRegion::Blocks {
            block,
            fraction: 0.2,
        },
        HotRegion::Rows { fraction: 0.03 },
    ] {
        let faults = hot(region, 0.1, 1e-6, 7);
        let observing = form("int4+secded84").with_blocks(BlockForms::uniform(block, true));
        let (logits, cache) = run(&m, &toks, observing.clone(), faults);
        let blocks = &cache.stats().blocks;
        assert_eq!(blocks.len(), 2 * LAYERS, "{region:?}");
        let spec = faults.unwrap();
        let is_hot =
            |i: usize, b: usize| (b * block..(b + 1) * block).any(|r| spec.is_hot(i / 2, i % 2, r));
        let hot_blocks: usize = (0..2 * LAYERS)
            .map(|i| (0..64 / block).filter(|&b| is_hot(i, b)).count())
            .sum();
        assert!(
            hot_blocks > 0 && hot_blocks < LAYERS * 64 / block,
            "{region:?}: {hot_blocks}"
        );
        let levels = choose_blocks(blocks, RULE).unwrap();
        for (i, part) in levels.iter().enumerate() {
            assert_eq!(part.len(), 64 / block);
            for (b, level) in part.iter().enumerate() {
                let want = if is_hot(i, b) {
                    Level::Golay
                } else {
                    Level::Secded
                };
                assert_eq!(
                    *level, want,
                    "{region:?}: part {i}, block {b}: {:?}",
                    blocks[i][b]
                );
            }
        }
        // The same seed, the same map and flips.
        let (again, cache2) = run(&m, &toks, observing, faults);
        assert_eq!(logits, again);
        assert_eq!(cache.stats(), cache2.stats());
    }
}

/// Per-block forms hold the same values under every code: clean, a part
/// stored in alternating codes reads the same logits as one store, and its
/// bytes lie between the uniform forms' bytes.
#[test]
fn blocks_in_different_codes_read_the_same_values() {
    let m = model();
    let toks = tokens(64);
    let forms: [CacheForm; 3] =
        ["int4+hamming74", "int4+secded84", "int4+golay24"].map(|f| f.parse().unwrap());
    let levels: Vec<Vec<Level>> = (0..2 * LAYERS)
        .map(|i| {
            (0..8)
                .map(|b| [Level::Hamming, Level::Secded, Level::Golay][(i + b / 2) % 3])
                .collect()
        })
        .collect();
    let (plain, one) = run(&m, &toks, form("int4+secded84"), None);
    let mixed = form("int4+secded84").with_blocks(BlockForms::from_levels(8, &levels, forms));
    let (blocked, cache) = run(&m, &toks, mixed, None);
    assert_eq!(plain.len(), toks.len() * VOCAB);
    let worst = plain
        .iter()
        .zip(&blocked)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(worst <= 1e-5, "max |blocked − one store| = {worst}");
    let bytes = |f: &str| run(&m, &toks, form(f), None).1.stats().stored_bytes;
    let mixed_bytes = cache.stats().stored_bytes;
    assert!(bytes("int4+hamming74") < mixed_bytes && mixed_bytes < bytes("int4+golay24"));
    assert!(one.stats().stored_bytes != mixed_bytes);
}

/// Bad maps and block forms are typed errors.
#[test]
fn bad_maps_and_block_forms_are_refused() {
    let m = model();
    let toks = tokens(16);
    let secded = || form("int4+secded84");
    // Rates and fractions outside [0, 1], blocks of no rows.
    for region in [
        HotRegion::Layers(1),
        HotRegion::Rows { fraction: 1.5 },
        HotRegion::Blocks {
            block: 0,
            fraction: 0.1,
        },
    ] {
        let ber = if matches!(region, HotRegion::Layers(_)) {
            1.5
        } else {
            1e-2
        };
        assert!(
            KvCache::new(secded(), hot(region, ber, 1e-5, 0), 0).is_err(),
            "{region:?}"
        );
    }
    // A row-resolved map over a low-rank form.
    let rows = HotRegion::Rows { fraction: 0.1 };
    let low_rank = CacheMode::form("pca-r4".parse().unwrap());
    assert!(KvCache::new(low_rank, hot(rows, 1e-2, 1e-5, 0), 0).is_err());
    // A row-resolved map over a form whose rows share parameters.
    assert!(KvCache::new(form("int4-ch+secded84"), hot(rows, 1e-2, 1e-5, 0), 0).is_err());
    // Block forms: a block form of another quantizer, blocks of no rows,
    // a table longer than the model, a layer form that is not row-local.
    let other = |f: &str| BlockForms {
        block: 4,
        layers: vec![[vec![f.parse().unwrap()], Vec::new()]],
        observe: false,
    };
    let too_long = BlockForms {
        block: 4,
        layers: vec![[Vec::new(), Vec::new()]; LAYERS + 1],
        observe: false,
    };
    for (mode, blocks) in [
        (secded(), other("int8+golay24")),
        (secded(), other("int4+rot+golay24")),
        (secded(), other("int4+sink4+golay24")),
        (secded(), BlockForms::uniform(0, false)),
        (secded(), too_long),
        (form("int4-ch+secded84"), BlockForms::uniform(4, false)),
    ] {
        let mut cache = KvCache::new(mode.clone().with_blocks(blocks.clone()), None, 0).unwrap();
        let err = m.forward(&toks, &mut cache, 0);
        assert!(err.is_err(), "{mode:?} {blocks:?}");
    }
}

/// Perfect memory with a few bad rows is faulted: a run whose rate is 0
/// outside the hot region still injects into it.
#[test]
fn a_hot_region_alone_is_faulted() {
    let m = model();
    let toks = tokens(64);
    let rows = HotRegion::Rows { fraction: 0.05 };
    let mode = form("int4+secded84+interp").with_blocks(BlockForms::uniform(8, false));
    let (_, cache) = run(&m, &toks, mode, hot(rows, 0.1, 0.0, 2));
    assert!(cache.stats().injected_flips > 0);
    assert!(cache.stats().values.values.corrected > 0);
}
