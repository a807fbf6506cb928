use gf2_codes::channel::{BinarySymmetric, ExactFlips};
use proptest::prelude::*;

use super::*;

fn form(s: &str) -> CacheForm {
    s.parse().unwrap()
}

/// The greedy choice, checked one removal at a time by brute force: of
/// every group's two extremes, the one whose removal shrinks its squared
/// range most (ties to the lower group, then the top).
fn brute_force(
    rows: &[f32],
    (tokens, channels): (usize, usize),
    (tpg, cpg): (usize, usize),
    count: usize,
) -> Vec<u32> {
    let layout = GroupLayout::new(tokens, channels, tpg, cpg).unwrap();
    let mut left: Vec<Vec<u32>> = vec![Vec::new(); layout.groups()];
    for p in 0..rows.len() as u32 {
        left[layout.group(p as usize / channels, p as usize % channels)].push(p);
    }
    let key = |p: &u32| (rows[*p as usize], *p);
    let mut taken = Vec::new();
    while taken.len() < count {
        let mut best: Option<(f64, usize, bool)> = None;
        for (g, members) in left.iter().enumerate() {
            if members.len() <= 2 {
                continue;
            }
            let mut v: Vec<u32> = members.clone();
            v.sort_by(|a, b| key(a).0.total_cmp(&key(b).0).then(a.cmp(b)));
            let x = |i: usize| f64::from(rows[v[i] as usize]);
            let n = v.len();
            let range = x(n - 1) - x(0);
            let (top, bottom) = (x(n - 2) - x(0), x(n - 1) - x(1));
            let is_top = top <= bottom;
            let rest = if is_top { top } else { bottom };
            let gain = range * range - rest * rest;
            if best.is_none_or(|(b, _, _)| gain > b) {
                best = Some((gain, g, is_top));
            }
        }
        let Some((_, g, top)) = best else { break };
        let mut v = left[g].clone();
        v.sort_by(|a, b| key(a).0.total_cmp(&key(b).0).then(a.cmp(b)));
        let p = if top { v[v.len() - 1] } else { v[0] };
        left[g].retain(|&q| q != p);
        taken.push(p);
    }
    taken.sort_unstable();
    taken
}

proptest! {
    #[test]
    fn the_split_takes_the_greedy_choice_and_bounds_every_group(
        seed in 0u64..1000,
        per_channel in any::<bool>(),
        count in 0usize..30,
    ) {
        let (tokens, channels) = (8, 12);
        let mut rng = test_rng(seed);
        let rows: Vec<f32> = (0..tokens * channels)
            .map(|_| {
                let x: f32 = rng.next_f32() * 2.0 - 1.0;
                if rng.next_f32() < 0.05 { x * 50.0 } else { x }
            })
            .collect();
        let grouping = if per_channel { (tokens, 1) } else { (1, 4) };
        let mut dense = rows.clone();
        let out = split_outliers(&mut dense, (tokens, channels), grouping, count).unwrap();
        let expect = brute_force(&rows, (tokens, channels), grouping, count);
        let got: Vec<u32> = out.iter().map(|&(p, _)| p).collect();
        prop_assert_eq!(&got, &expect);
        // Values are the originals; the dense rows keep every other value and
        // put each outlier inside its group's remaining range.
        let layout = GroupLayout::new(tokens, channels, grouping.0, grouping.1).unwrap();
        for (p, v) in &out {
            prop_assert_eq!(*v, rows[*p as usize]);
        }
        for g in 0..layout.groups() {
            let members: Vec<usize> = (0..rows.len())
                .filter(|&p| layout.group(p / channels, p % channels) == g)
                .collect();
            let kept: Vec<f32> = members
                .iter()
                .filter(|&&p| !got.contains(&(p as u32)))
                .map(|&p| rows[p])
                .collect();
            let (lo, hi) = kept.iter().fold((f32::INFINITY, f32::NEG_INFINITY), |(a, b), &x| (a.min(x), b.max(x)));
            for &p in &members {
                if got.contains(&(p as u32)) {
                    prop_assert!(dense[p] >= lo && dense[p] <= hi);
                } else {
                    prop_assert_eq!(dense[p], rows[p]);
                }
            }
        }
    }
}

/// The squared error of `xs` under the clip search's levels on `lo..hi`.
fn grid_error(xs: &[f64], lo: f64, hi: f64, bits: u8) -> f64 {
    let s = (hi - lo) / f64::from((1u32 << bits) - 1);
    xs.iter()
        .map(|&x| {
            let y = lo + s * ((x.clamp(lo, hi) - lo) / s).round();
            (x - y) * (x - y)
        })
        .sum()
}

proptest! {
    #[test]
    fn clipping_never_raises_a_groups_error_and_stays_in_its_range(
        seed in 0u64..1000,
        bits in 2u8..=4,
        per_channel in any::<bool>(),
    ) {
        let (tokens, channels) = (16, 8);
        let mut rng = test_rng(seed);
        let rows: Vec<f32> = (0..tokens * channels)
            .map(|_| {
                // Bell-shaped: a sum of uniforms.
                (0..4).map(|_| rng.next_f32()).sum::<f32>() - 2.0
            })
            .collect();
        let grouping = if per_channel { (tokens, 1) } else { (1, 4) };
        let mut clipped = rows.clone();
        let n = clip_groups(&mut clipped, (tokens, channels), grouping, bits, &[]).unwrap();
        let changed = rows.iter().zip(&clipped).filter(|(a, b)| a != b).count();
        prop_assert_eq!(n, changed);
        let layout = GroupLayout::new(tokens, channels, grouping.0, grouping.1).unwrap();
        for g in 0..layout.groups() {
            let members: Vec<usize> = (0..rows.len())
                .filter(|&p| layout.group(p / channels, p % channels) == g)
                .collect();
            let xs: Vec<f64> = members.iter().map(|&p| f64::from(rows[p])).collect();
            let ys: Vec<f64> = members.iter().map(|&p| f64::from(clipped[p])).collect();
            let (lo, hi) = xs.iter().fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), &x| (a.min(x), b.max(x)));
            let (cl, ch) = ys.iter().fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), &x| (a.min(x), b.max(x)));
            prop_assert!(cl >= lo && ch <= hi);
            // The original values read on the clipped group's grid err no
            // more than on the full range's.
            prop_assert!(grid_error(&xs, cl, ch, bits) <= grid_error(&xs, lo, hi, bits) + 1e-12);
        }
    }
}

#[test]
fn clipping_a_bell_shaped_group_at_two_bits_cuts_its_error_by_a_quarter() {
    let mut rng = test_rng(11);
    let tokens = 64;
    let rows: Vec<f32> = (0..tokens)
        .map(|_| (0..12).map(|_| rng.next_f32()).sum::<f32>() - 6.0)
        .collect();
    let xs: Vec<f64> = rows.iter().map(|&x| f64::from(x)).collect();
    let (lo, hi) = xs
        .iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), &x| {
            (a.min(x), b.max(x))
        });
    let mut clipped = rows.clone();
    assert!(clip_groups(&mut clipped, (tokens, 1), (tokens, 1), 2, &[]).unwrap() > 0);
    let (cl, ch) = clipped
        .iter()
        .fold((f32::INFINITY, f32::NEG_INFINITY), |(a, b), &x| {
            (a.min(x), b.max(x))
        });
    let full = grid_error(&xs, lo, hi, 2);
    let best = grid_error(&xs, f64::from(cl), f64::from(ch), 2);
    assert!(best < 0.75 * full, "{best} against {full}");
    // Bad shapes and bit counts are refused.
    assert!(clip_groups(&mut clipped, (tokens, 2), (tokens, 1), 2, &[]).is_err());
    assert!(clip_groups(&mut clipped, (tokens, 1), (tokens, 1), 0, &[]).is_err());
}

/// A small deterministic stream for the tests (xorshift).
struct TestRng(u64);

fn test_rng(seed: u64) -> TestRng {
    TestRng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
}

impl TestRng {
    fn next_f32(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 >> 40) as f32 / (1u64 << 24) as f32
    }
}

#[test]
fn one_far_value_per_channel_is_what_the_split_takes() {
    // 16 tokens × 4 channels, each channel smooth but for one spike.
    let (tokens, channels) = (16, 4);
    let mut rows: Vec<f32> = (0..tokens * channels)
        .map(|i| ((i * 7) % 13) as f32 / 13.0)
        .collect();
    let spikes = [(3, 0, 40.0), (9, 1, -25.0), (0, 2, 30.0), (15, 3, -60.0)];
    for &(t, c, v) in &spikes {
        rows[t * channels + c] = v;
    }
    let mut dense = rows.clone();
    let out = split_outliers(&mut dense, (tokens, channels), (tokens, 1), 4).unwrap();
    let mut want: Vec<(u32, f32)> = spikes
        .iter()
        .map(|&(t, c, v)| ((t * channels + c) as u32, v))
        .collect();
    want.sort_by_key(|w| w.0);
    assert_eq!(out, want);
    assert!(dense.iter().all(|x| (0.0..1.0).contains(x)));
}

#[test]
fn a_sparse_store_reads_its_outliers_exactly_and_counts_their_bytes() {
    let (tokens, channels) = (64, 24);
    let mut rng = test_rng(7);
    let mut rows: Vec<f32> = (0..tokens * channels)
        .map(|_| rng.next_f32() - 0.5)
        .collect();
    rows[5 * channels + 3] = 100.0;
    rows[40 * channels + 17] = -80.0;
    let f = form("int2-ch+out1");
    let store = SparseStore::quantize(f, &rows, tokens, channels).unwrap();
    let count = 16; // ⌈1% of 1,536⌉
    assert_eq!(store.outliers().len(), count);
    assert_eq!(
        store.stored_bytes(),
        SparseStore::stored_bytes_of(f, tokens, channels, 0).unwrap()
    );
    assert_eq!(
        store.stored_bytes(),
        store.dense().stored_bytes() + 4 * count,
        "16-bit positions and f16 values, unprotected"
    );
    let mut out = vec![0.0; tokens * channels];
    let mut scratch = DecodeScratch::default();
    store
        .decode_rows_into(0, tokens, &mut out, &mut scratch)
        .unwrap();
    assert_eq!(out[5 * channels + 3], 100.0);
    assert_eq!(out[40 * channels + 17], -80.0);
    // The dense part alone: two bits over each channel's range without the
    // spikes, so every other value is within a step of the truth.
    let dense_err = rows
        .iter()
        .zip(&out)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    assert!(dense_err < 0.2, "{dense_err}");
    // Tile by tile equals the whole read, statistics included.
    let mut tiled = vec![0.0; tokens * channels];
    let mut stats = KvDecodeStats::default();
    for start in (0..tokens).step_by(16) {
        stats += store
            .decode_rows_into(
                start,
                16,
                &mut tiled[start * channels..(start + 16) * channels],
                &mut scratch,
            )
            .unwrap();
    }
    assert_eq!(tiled, out);
    let whole = store
        .decode_rows_into(0, tokens, &mut out, &mut scratch)
        .unwrap();
    assert_eq!(stats, whole);
}

#[test]
fn exact_leading_rows_read_exactly_and_stretch_no_group() {
    let (tokens, channels) = (16, 8);
    let mut rng = test_rng(5);
    let mut rows: Vec<f32> = (0..tokens * channels)
        .map(|_| rng.next_f32() - 0.5)
        .collect();
    // Attention-sink rows far larger than the rest.
    for x in &mut rows[..3 * channels] {
        *x *= 1000.0;
    }
    let f = form("int4-ch+out1+secded84");
    let store = SparseStore::quantize_with_exact(f, &rows, tokens, channels, 3).unwrap();
    assert_eq!(store.exact_rows(), 3);
    assert_eq!(
        store.stored_bytes(),
        SparseStore::stored_bytes_of(f, tokens, channels, 3).unwrap()
    );
    // ⌈1% of the 13 coded rows' 104 values⌉, none of them in the exact rows.
    assert_eq!(store.outliers().len(), 2);
    assert!(
        store
            .outliers()
            .iter()
            .all(|&(p, _)| p >= 3 * channels as u32)
    );
    let mut out = vec![0.0; tokens * channels];
    let mut scratch = DecodeScratch::default();
    store
        .decode_rows_into(0, tokens, &mut out, &mut scratch)
        .unwrap();
    let f16 = |x: f32| f16::from_f32(x).to_f32();
    for i in 0..3 * channels {
        assert_eq!(out[i], f16(rows[i]));
    }
    // The coded rows keep 4-bit precision over their own range.
    let err = (3 * channels..rows.len())
        .map(|i| (out[i] - rows[i]).abs())
        .fold(0.0f32, f32::max);
    assert!(err < 0.05, "{err}");
    // A row range inside the exact rows, and one across their end.
    let mut part = vec![0.0; 3 * channels];
    store
        .decode_rows_into(1, 3, &mut part, &mut scratch)
        .unwrap();
    assert_eq!(part, out[channels..4 * channels]);
    // Faults reach the exact rows too (their flips come first in `exact`).
    let mut hit = store.clone();
    let injection = hit.inject(&ExactFlips::new(vec![0]), 2, FaultTarget::Values);
    assert_eq!(injection.exact.len(), 2);
    assert_eq!(injection.exact.positions()[0], 0);
    assert!(SparseStore::quantize_with_exact(f, &rows, tokens, channels, tokens).is_err());
}

#[test]
fn faults_in_protected_outliers_are_corrected_and_counted() {
    let (tokens, channels) = (32, 16);
    let mut rng = test_rng(3);
    let rows: Vec<f32> = (0..tokens * channels)
        .map(|_| (rng.next_f32() - 0.5) * 4.0)
        .collect();
    let f = form("int2-ch+out2+secded84");
    let clean = SparseStore::quantize(f, &rows, tokens, channels).unwrap();
    let mut hit = clean.clone();
    // One flip in each table's first data word: RM(2,5) corrects both.
    let channel = ExactFlips::new(vec![0]);
    let injection = hit.inject(&channel, 1, FaultTarget::Everything);
    assert_eq!(injection.exact.len(), 1);
    assert_eq!(injection.tables.len(), 1);
    assert!(!hit.outliers_pristine());
    assert_eq!(hit.outliers(), clean.outliers());
    let stats = hit.outlier_stats();
    assert_eq!(stats.values.corrected, 1);
    assert_eq!(stats.metadata.corrected, 1);
    // The scrub counts the dense store's words as its own scrub does, and
    // one more corrected word in each table.
    let mut dense = clean.dense().clone();
    dense.inject(&channel, 1, FaultTarget::Everything);
    let dense = dense.scrub().unwrap();
    let scrubbed = hit.scrub().unwrap();
    assert_eq!(scrubbed.values.corrected, dense.values.corrected + 1);
    assert_eq!(scrubbed.metadata.corrected, dense.metadata.corrected + 1);
    assert!(hit.outliers_pristine());
    assert_eq!(hit.outlier_stats().values.corrected, 0);
}

/// Two flips in one position word: SECDED (the metadata code under
/// Hamming values) detects it, the entry is dropped and counted as erased,
/// and the dense store's clamped bound reads in its place.
#[test]
fn an_outlier_with_a_detected_word_is_dropped_not_placed() {
    let (tokens, channels) = (16, 8);
    let mut rows: Vec<f32> = (0..tokens * channels)
        .map(|i| (i % 7) as f32 * 0.1)
        .collect();
    rows[5 * channels + 2] = 50.0;
    let f = form("int4-ch+out0.5+hamming74");
    let clean = SparseStore::quantize(f, &rows, tokens, channels).unwrap();
    assert_eq!(clean.outliers(), &[((5 * channels + 2) as u32, 50.0)][..]);
    let mut hit = clean.clone();
    hit.inject(&ExactFlips::new(vec![0, 1]), 4, FaultTarget::Metadata);
    let stats = hit.outlier_stats();
    assert_eq!((stats.metadata.detected, stats.erased_values), (1, 1));
    assert!(hit.outliers().is_empty());
    let mut out = vec![0.0; tokens * channels];
    hit.decode_rows_into(5, 1, &mut out[..channels], &mut DecodeScratch::default())
        .unwrap();
    assert!(
        out[2] < 1.0,
        "the clamped bound, not 0.0 at position 0: {}",
        out[2]
    );
}

#[test]
fn non_finite_rows_and_rows_of_no_channels_are_refused() {
    let mut rows = vec![0.5f32; 32];
    rows[9] = f32::NAN;
    let e = SparseStore::quantize(form("int2-ch+out1"), &rows, 4, 8).unwrap_err();
    assert!(
        matches!(
            e,
            KvQuantError::NonFinite {
                token: 1,
                channel: 1,
                ..
            }
        ),
        "{e}"
    );
    rows[9] = f32::INFINITY;
    assert!(split_outliers(&mut rows, (4, 8), (4, 1), 1).is_err());
    assert!(clip_groups(&mut rows, (4, 8), (4, 1), 2, &[]).is_err());
    assert!(SparseStore::quantize(form("int2-ch+out1"), &[], 4, 0).is_err());
}

#[test]
fn faults_in_bare_outliers_never_place_a_value_outside_the_block() {
    let (tokens, channels) = (16, 8);
    let rows: Vec<f32> = (0..tokens * channels).map(|i| i as f32).collect();
    let f = form("int4-ch+out20");
    for seed in 0..50 {
        let mut store = SparseStore::quantize(f, &rows, tokens, channels).unwrap();
        store.inject(
            &BinarySymmetric::new(0.2).unwrap(),
            seed,
            FaultTarget::Metadata,
        );
        assert!(
            store
                .outliers()
                .iter()
                .all(|&(p, _)| (p as usize) < tokens * channels)
        );
        let mut out = vec![0.0; tokens * channels];
        store
            .decode_rows_into(0, tokens, &mut out, &mut DecodeScratch::default())
            .unwrap();
    }
}

#[test]
fn forms_without_sparse_or_with_segments_are_refused() {
    let rows = vec![0.0; 64];
    for (spelling, needle) in [
        ("int2-ch", "keeps no outliers"),
        ("int2-ch+sink4+out1", "sink"),
    ] {
        let e = SparseStore::quantize(form(spelling), &rows, 8, 8)
            .unwrap_err()
            .to_string();
        assert!(e.contains(needle), "{spelling}: {e}");
    }
    // Groups of two keep both values: nothing to split, and the bytes the
    // form promises are the bytes it holds.
    let pairs = form("int2-g2+out20");
    let store = SparseStore::quantize(pairs, &rows, 8, 8).unwrap();
    assert!(store.outliers().is_empty());
    assert_eq!(
        store.stored_bytes(),
        SparseStore::stored_bytes_of(pairs, 8, 8, 0).unwrap()
    );
    let e = KvStore::quantize(form("int2-ch+out1"), &rows, 8, 8)
        .unwrap_err()
        .to_string();
    assert!(e.contains("SparseStore"), "{e}");
}
