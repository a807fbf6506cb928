//! Attention over Shard layers computed on the compressed forms (the
//! per-pair relative-position identity for keys, rotated-space value sums)
//! equals the f64 oracle over the same layer dequantised (keys rebuilt and
//! rotated to their positions, values decoded) within 1e-5 relative, for
//! both RoPE pair layouts, partial rotary dimensions, GQA and MHA, queries
//! at every position (so every segment boundary: sink, middle, window,
//! stream), VQ and NF4 values, the stream on and off; and bad input is a
//! typed error.

mod common;

use attention::{Attention, HeadShape, Mask, Rope, RopeLayout, ShardLayer};
use common::{error_against, oracle, uniform};
use kv_quant::{CacheForm, FaultTarget};

/// Keys near a low-rank subspace with RoPE applied at their positions, and values.
fn rows(seed: u64, tokens: usize, channels: usize, rope: &Rope) -> (Vec<f32>, Vec<f32>) {
    let rank = 6;
    let c = uniform(seed, tokens * rank, 2.0);
    let dirs = uniform(seed ^ 1, rank * channels, 1.0);
    let noise = uniform(seed ^ 2, tokens * channels, 0.05);
    let mut keys = vec![0.0f32; tokens * channels];
    for t in 0..tokens {
        let row = &mut keys[t * channels..][..channels];
        for (ch, x) in row.iter_mut().enumerate() {
            *x = 0.2
                + noise[t * channels + ch]
                + (0..rank)
                    .map(|j| c[t * rank + j] * dirs[j * channels + ch])
                    .sum::<f32>();
        }
        rope.apply(row, t).unwrap();
    }
    (keys, uniform(seed ^ 3, tokens * channels, 1.5))
}

fn check(spec: &str, layout: RopeLayout, rotary: usize, q_heads: usize, kv_heads: usize) {
    let (d, tokens, prefill) = (16, 300, 260);
    let shape = HeadShape::new(q_heads, kv_heads, d).unwrap();
    let rope = Rope::new(layout, d, rotary, 10_000.0).unwrap();
    let (k, v) = rows(7, tokens, shape.kv_channels(), &rope);
    let form: CacheForm = spec.parse().unwrap();
    let layer = ShardLayer::build(form, &k, &v, tokens, prefill, &rope).unwrap();
    assert!(!layer.middle().is_empty(), "{spec}");
    // 40 generated tokens: two chunks of 16 folded under -f16, 8 in the stream.
    let folds = if spec.contains("-f16") { 32 } else { 0 };
    assert_eq!(layer.folded(), folds, "{spec}");
    let (dk, dv) = layer.dequantize().unwrap();
    let positions: Vec<usize> = (0..tokens).collect();
    let q = uniform(11, tokens * shape.q_len(), 1.0);
    let mut queries = q.clone();
    for (p, row) in queries.chunks_exact_mut(shape.q_len()).enumerate() {
        rope.apply(row, p).unwrap();
    }
    let attention = Attention::new(shape);
    // Every position at once (tiles built once for all queries), and a few
    // decode queries (each tile rebuilt for every KV head at once), at the
    // ends of the prefill, the stream and a folded chunk.
    let few = [tokens - 1, 291, 276, 275, prefill, prefill - 1, 40];
    let q_few: Vec<f32> = few
        .iter()
        .flat_map(|&p| queries[p * shape.q_len()..(p + 1) * shape.q_len()].to_vec())
        .collect();
    for mask in [Mask::Causal, Mask::SlidingWindow(100)] {
        for (q, pos) in [(&queries[..], &positions[..]), (&q_few[..], &few[..])] {
            let got = layer.attend(&attention, q, pos, &mask).unwrap();
            let want = oracle(q, pos, &dk, &dv, tokens, &shape, &mask);
            let (out, lse) = error_against(&got, &want, &dv);
            assert!(
                out < 1e-5 && lse < 1e-5,
                "{spec} {layout:?} {rotary} {mask:?} {} queries: {out:e} {lse:e}",
                pos.len()
            );
        }
    }
}

#[test]
fn compressed_attention_equals_the_dequantised_oracle() {
    for layout in [RopeLayout::Adjacent, RopeLayout::RotateHalf] {
        check("shard-k2-g4+win32", layout, 16, 4, 2);
        check("shard-k1-g4-s4+sink3+win20", layout, 16, 2, 2);
        check("shard-k3-g8-vnf4-soff+win40", layout, 8, 6, 2);
        // Generated tokens folded into the middle; a QJL stream.
        check("shard-k2-g4-f16+win32", layout, 16, 4, 2);
        check("shard-k3-g8-vnf4-soff-f16+win40", layout, 8, 6, 2);
        check("shard-k1-g4-s3q-f16+sink3+win20", layout, 16, 2, 2);
    }
}

#[test]
fn the_stored_keys_and_values_stay_close_to_the_rows() {
    let (d, tokens) = (16, 400);
    let rope = Rope::new(RopeLayout::RotateHalf, d, d, 10_000.0).unwrap();
    let (k, v) = rows(3, tokens, 2 * d, &rope);
    let layer = ShardLayer::build(
        "shard-k4-g4".parse().unwrap(),
        &k,
        &v,
        tokens,
        tokens,
        &rope,
    )
    .unwrap();
    let (dk, dv) = layer.dequantize().unwrap();
    let rel = |a: &[f32], b: &[f32]| {
        let e: f32 = a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum();
        (e / b.iter().map(|x| x * x).sum::<f32>()).sqrt()
    };
    assert!(rel(&dk, &k) < 0.05, "keys {}", rel(&dk, &k));
    // Uniform noise values at 2 bits per value.
    assert!(rel(&dv, &v) < 0.4, "values {}", rel(&dv, &v));
    // Sink and window exact to f16.
    for t in (0..4).chain(tokens - 64..tokens) {
        for c in 0..2 * d {
            let x = k[t * 2 * d + c];
            assert!((dk[t * 2 * d + c] - x).abs() <= x.abs() * 1e-3, "token {t}");
        }
    }
    let b = layer.bytes();
    assert_eq!(b.exact, 2 * 2 * 68 * 2 * d);
    // Keys at 4 bits per value and 2-bit values: under half of f16's bytes.
    assert!(b.total() * 2 < 2 * tokens * 2 * d * 2, "{b:?}");
}

#[test]
fn bad_input_is_a_typed_error() {
    let (d, tokens) = (16, 100);
    let rope = Rope::new(RopeLayout::Adjacent, d, d, 10_000.0).unwrap();
    let (k, mut v) = rows(5, tokens, d, &rope);
    let shard: CacheForm = "shard-k1-g4".parse().unwrap();
    let build =
        |f: CacheForm, k: &[f32], v: &[f32], p| ShardLayer::build(f, k, v, tokens, p, &rope);
    assert!(build("int4".parse().unwrap(), &k, &v, tokens).is_err());
    assert!(build(shard, &k, &v, tokens + 1).is_err());
    assert!(build(shard, &k[..d * 50], &v, tokens).is_err());
    let too_big: CacheForm = "shard-k1-g4-r32".parse().unwrap();
    let e = match build(too_big, &k, &v, tokens) {
        Ok(_) => panic!("a rank of 32 over 16 channels was accepted"),
        Err(e) => e.to_string(),
    };
    assert!(e.contains("above the key dimension"), "{e}");
    // A calibrated form needs its basis, of this layer's width.
    let cal: CacheForm = "shard-k1-g4-cal".parse().unwrap();
    assert!(build(cal, &k, &v, tokens).is_err());
    let (narrow, _) = kv_lowrank::Basis::fit(
        &k[..100 * 8],
        100,
        8,
        kv_quant::RankRule::Fixed(4),
        kv_lowrank::BasisStorage::F16,
    )
    .unwrap();
    let with = |f, b| ShardLayer::build_with(f, &k, &v, tokens, tokens, &rope, Some(b));
    assert!(with(shard, &narrow).is_err());
    let long: Vec<f32> = (0..300 * d).map(|i| (i as f32 * 0.1).sin()).collect();
    let v300: Vec<f32> = long.iter().map(|x| x * 0.5).collect();
    let (wide, _) = kv_lowrank::Basis::fit(
        &long[..100 * d],
        100,
        d,
        kv_quant::RankRule::Fixed(8),
        kv_lowrank::BasisStorage::F16,
    )
    .unwrap();
    let e = match ShardLayer::build_with(
        cal,
        &long[..299 * d],
        &v300[..299 * d],
        299,
        299,
        &rope,
        Some(&narrow),
    ) {
        Ok(_) => panic!("a basis of 8 channels stored rows of 16"),
        Err(e) => e.to_string(),
    };
    assert!(e.contains("another model"), "{e}");
    assert!(ShardLayer::build_with(cal, &long, &v300, 300, 300, &rope, Some(&wide)).is_ok());
    v[7] = f32::NAN;
    assert!(build(shard, &k, &v, tokens).is_err());
    v[7] = 0.0;
    let layer = build(shard, &k, &v, tokens).unwrap();
    let wrong = Attention::new(HeadShape::new(2, 2, 8).unwrap());
    assert!(
        layer
            .attend(&wrong, &[0.0; 16], &[0], &Mask::Causal)
            .is_err()
    );
    let right = Attention::new(HeadShape::new(2, 1, 16).unwrap());
    assert!(
        layer
            .attend(&right, &[0.0; 32], &[tokens], &Mask::Causal)
            .is_err()
    );
    assert!(
        layer
            .attend(&right, &[0.0; 31], &[0], &Mask::Causal)
            .is_err()
    );
}

#[test]
fn extending_after_the_prefill_equals_building_at_once() {
    let (d, tokens, prefill) = (16, 300, 250);
    let shape = HeadShape::new(4, 2, d).unwrap();
    let rope = Rope::new(RopeLayout::Adjacent, d, d, 10_000.0).unwrap();
    let (k, v) = rows(9, tokens, shape.kv_channels(), &rope);
    for spec in [
        "shard-k2-g4+win32",
        "shard-k2-g4-soff+win32",
        "shard-k2-g4-f16+win32",
        "shard-k2-g4-soff-f16+win32",
        "shard-k2-g4-vnf4-s4q-f16+win32",
    ] {
        let form: CacheForm = spec.parse().unwrap();
        let whole = ShardLayer::build(form, &k, &v, tokens, prefill, &rope).unwrap();
        let ch = shape.kv_channels();
        let first = ShardLayer::build(
            form,
            &k[..prefill * ch],
            &v[..prefill * ch],
            prefill,
            prefill,
            &rope,
        )
        .unwrap();
        let grown = first.extended(&k, &v, tokens).unwrap();
        assert_eq!(
            grown.dequantize().unwrap(),
            whole.dequantize().unwrap(),
            "{spec}"
        );
        assert_eq!(grown.bytes(), whole.bytes(), "{spec}");
        // Step by step, keeping the chunks folded so far, and back.
        let mid = first.extended(&k[..275 * ch], &v[..275 * ch], 275).unwrap();
        let stepped = mid.extended(&k, &v, tokens).unwrap();
        assert_eq!(stepped.dequantize().unwrap(), whole.dequantize().unwrap());
        assert_eq!(stepped.bytes(), whole.bytes(), "{spec}");
        // One token at a time, as generation grows it (each step encodes
        // only its own stream row and keeps the rows before).
        let mut step = first.clone();
        for t in prefill + 1..=tokens {
            step = step.extended(&k[..t * ch], &v[..t * ch], t).unwrap();
        }
        assert_eq!(
            step.dequantize().unwrap(),
            whole.dequantize().unwrap(),
            "{spec}"
        );
        assert_eq!(step.bytes(), whole.bytes(), "{spec}");
        let back = grown.extended(&k[..260 * ch], &v[..260 * ch], 260).unwrap();
        let at_260 =
            ShardLayer::build(form, &k[..260 * ch], &v[..260 * ch], 260, prefill, &rope).unwrap();
        assert_eq!(back.dequantize().unwrap(), at_260.dequantize().unwrap());
        if spec.contains("-f16") {
            // 50 generated: three chunks folded (their own codes and scales,
            // the basis and codebook shared), two tokens left over.
            assert_eq!(whole.folded(), 48, "{spec}");
            assert_eq!(mid.folded(), 16, "{spec}");
            let unfolded: CacheForm = spec.replace("-f16", "").parse().unwrap();
            let plain = ShardLayer::build(unfolded, &k, &v, tokens, prefill, &rope).unwrap();
            let (f, p) = (whole.bytes(), plain.bytes());
            let keys = plain.keys().unwrap();
            assert_eq!(
                f.keys - p.keys,
                3 * (16 * keys.row_bytes() + 2 * keys.kept()),
                "{spec}"
            );
            assert!(f.stream + f.exact < p.stream + p.exact, "{f:?} {p:?}");
        }
        // Non-finite generated rows are refused.
        let mut bad = k.clone();
        bad[(prefill + 3) * ch + 1] = f32::NAN;
        assert!(first.extended(&bad, &v, tokens).is_err());
        assert!(first.extended(&k[..10 * ch], &v[..10 * ch], 10).is_err());
    }
}

#[test]
fn faults_reach_folded_chunks_too() {
    use gf2_codes::channel::BinarySymmetric;
    let (d, tokens, prefill) = (16, 400, 300);
    let rope = Rope::new(RopeLayout::Adjacent, d, d, 10_000.0).unwrap();
    let (k, v) = rows(6, tokens, 2 * d, &rope);
    let build =
        |s: &str| ShardLayer::build(s.parse().unwrap(), &k, &v, tokens, prefill, &rope).unwrap();
    let folded = build("shard-k2-g4-f32+secded84");
    assert_eq!(folded.folded(), 96);
    let keys = folded.keys().unwrap();
    let channel = BinarySymmetric::new(1e-2).unwrap();
    let mut hit = folded.clone();
    let f = hit.inject(&channel, 5, FaultTarget::Values).unwrap();
    // Every compressed token's codes are codewords (one per nibble): the
    // middle's and three chunks'.
    let compressed = (folded.middle().len() + 96) as u64;
    assert_eq!(f.keys.words, 2 * compressed * keys.row_bytes() as u64);
    assert_eq!(f.values.words, 2 * compressed * (2 * d / 4) as u64);
    assert!(f.keys.corrected > 0 && f.values.corrected > 0, "{f:?}");
    let mut again = folded.clone();
    assert_eq!(again.inject(&channel, 5, FaultTarget::Values).unwrap(), f);
    assert_eq!(again.dequantize().unwrap(), hit.dequantize().unwrap());
}

#[test]
fn faults_are_seeded_accounted_and_corrected_under_a_code() {
    use gf2_codes::channel::BinarySymmetric;
    let (d, tokens) = (16, 400);
    let rope = Rope::new(RopeLayout::RotateHalf, d, d, 10_000.0).unwrap();
    let (k, v) = rows(4, tokens, 2 * d, &rope);
    let build =
        |s: &str| ShardLayer::build(s.parse().unwrap(), &k, &v, tokens, tokens, &rope).unwrap();
    let plain = build("shard-k2-g4");
    let clean = plain.dequantize().unwrap();
    // Unprotected: every flip lands in a code; changed bytes are silent.
    let channel = BinarySymmetric::new(1e-3).unwrap();
    let mut hit = plain.clone();
    let f = hit.inject(&channel, 7, FaultTarget::Values).unwrap();
    assert!(f.flips > 0);
    assert!(f.keys.silent + f.values.silent > 0 && f.keys.silent + f.values.silent <= f.flips);
    assert_eq!(f.keys.words, plain.keys().unwrap().codes().len() as u64);
    assert_ne!(hit.dequantize().unwrap(), clean);
    // The same seed, the same flips and the same layer.
    let mut again = plain.clone();
    assert_eq!(again.inject(&channel, 7, FaultTarget::Values).unwrap(), f);
    assert_eq!(again.dequantize().unwrap(), hit.dequantize().unwrap());
    // SECDED: code bytes double; single flips per word are all corrected.
    let secded = build("shard-k2-g4+secded84");
    let (b0, b1) = (plain.bytes(), secded.bytes());
    let keys = plain.keys().unwrap();
    let codes = keys.codes().len();
    // Codes doubled; the f16 steps and the basis under RM(2,5): two check
    // bytes per 16-bit word.
    assert_eq!(
        b1.keys - b0.keys,
        codes + 2 * keys.scales().len() + 2 * keys.shared_bytes().div_ceil(2)
    );
    assert_eq!(b1.exact, b0.exact);
    let sparse = BinarySymmetric::new(1e-4).unwrap();
    let mut hit = secded.clone();
    let f = hit.inject(&sparse, 3, FaultTarget::Values).unwrap();
    let (kw, vw) = (f.keys, f.values);
    assert!(f.flips > 0);
    assert_eq!(
        kw.corrected
            + vw.corrected
            + 2 * (kw.detected + vw.detected)
            + kw.miscorrected
            + vw.miscorrected,
        f.flips,
        "{f:?}: at 1e-4 each hit word holds one or two flips"
    );
    // This seed puts at most one flip in each word: all corrected, the
    // layer reads exactly as written.
    assert_eq!(
        kw.detected + vw.detected + kw.miscorrected + vw.miscorrected,
        0,
        "{f:?}"
    );
    assert_eq!(hit.dequantize().unwrap(), secded.dequantize().unwrap());
    // NF4 values are not exposed.
    let mut nf4 = build("shard-k2-g4-vnf4");
    assert!(nf4.inject(&channel, 1, FaultTarget::Values).is_err());
}

#[test]
fn scales_and_tables_are_exposed_under_metadata_and_protected_by_the_metadata_code() {
    use gf2_codes::channel::{BinarySymmetric, ExactFlips};
    let (d, tokens) = (16, 400);
    let rope = Rope::new(RopeLayout::RotateHalf, d, d, 10_000.0).unwrap();
    let (k, v) = rows(9, tokens, 2 * d, &rope);
    let build =
        |s: &str| ShardLayer::build(s.parse().unwrap(), &k, &v, tokens, tokens, &rope).unwrap();
    for spelling in ["shard-k2-g4", "shard-k2-g4+secded84"] {
        let layer = build(spelling);
        let clean = layer.dequantize().unwrap();
        let (kept, basis) = {
            let keys = layer.keys().unwrap();
            (keys.scales().len(), keys.shared_bytes().div_ceil(2))
        };
        // Metadata alone: the codes are left, every scale and table word is
        // read and accounted.
        let channel = BinarySymmetric::new(1e-3).unwrap();
        let mut hit = layer.clone();
        let f = hit.inject(&channel, 11, FaultTarget::Metadata).unwrap();
        assert_eq!(f.keys, Default::default(), "{spelling}");
        assert_eq!(f.values, Default::default(), "{spelling}");
        assert_eq!(f.key_scales.words, kept as u64, "{spelling}");
        assert_eq!(f.value_scales.words, 2 * d as u64, "{spelling}");
        // The key basis's words and the codebook's 256 × 4 f16 centroids.
        assert_eq!(f.tables.words, (basis + 256 * 4) as u64, "{spelling}");
        assert!(f.flips > 0, "{spelling}");
        let mut again = layer.clone();
        assert_eq!(
            again.inject(&channel, 11, FaultTarget::Metadata).unwrap(),
            f
        );
        assert_eq!(again.dequantize().unwrap(), hit.dequantize().unwrap());
        // Everything: both, the codes' stream as under `values`.
        let mut all = layer.clone();
        let e = all.inject(&channel, 11, FaultTarget::Everything).unwrap();
        let mut codes_only = layer.clone();
        let c = codes_only
            .inject(&channel, 11, FaultTarget::Values)
            .unwrap();
        assert_eq!((e.keys, e.values), (c.keys, c.values));
        assert_eq!((e.key_scales, e.tables), (f.key_scales, f.tables));
        assert_eq!(e.flips, c.flips + f.flips);
        // One flip in the first key step's f16 exponent (bit 14 of word 0):
        // silent and read wrong without a code, corrected under RM(2,5).
        let mut one = layer.clone();
        let f = one
            .inject(&ExactFlips::new([14]), 0, FaultTarget::Metadata)
            .unwrap();
        let read = one.dequantize().unwrap();
        if spelling.contains("secded") {
            assert_eq!(f.key_scales.corrected, 1, "{f:?}");
            assert_eq!(read, clean);
        } else {
            assert_eq!(f.key_scales.silent, 1, "{f:?}");
            assert_ne!(read, clean);
        }
    }
}

#[test]
fn a_detected_scale_reads_as_zero_not_as_a_huge_step() {
    use gf2_codes::channel::ExactFlips;
    let (d, tokens) = (16, 400);
    let rope = Rope::new(RopeLayout::RotateHalf, d, d, 10_000.0).unwrap();
    let (k, v) = rows(9, tokens, 2 * d, &rope);
    let layer = ShardLayer::build(
        "shard-k2-g4+secded84".parse().unwrap(),
        &k,
        &v,
        tokens,
        tokens,
        &rope,
    )
    .unwrap();
    // Four flips in the first step's f16 word: RM(2,5) (distance 8) detects
    // them, and the step reads as zero (the component dropped), not as
    // whatever the flipped exponent says.
    let mut hit = layer.clone();
    let f = hit
        .inject(&ExactFlips::new([14, 13, 12, 11]), 0, FaultTarget::Metadata)
        .unwrap();
    assert_eq!(f.key_scales.detected, 1, "{f:?}");
    assert_eq!(hit.keys().unwrap().scales()[0], 0.0);
    assert_eq!(
        hit.keys().unwrap().scales()[1..],
        layer.keys().unwrap().scales()[1..]
    );
}

#[test]
fn long_decodes_split_keys_and_sum_values_by_histogram() {
    // 5,000 tokens: decode calls split the keys into chunks of 2,048 and
    // sum middle values through per-centroid histograms (spans ≥ 512), the
    // heads of a group four at a time (groups of 2 and 5).
    let (d, tokens) = (16, 5000);
    for (q_heads, kv_heads) in [(4, 2), (10, 2)] {
        let shape = HeadShape::new(q_heads, kv_heads, d).unwrap();
        let rope = Rope::new(RopeLayout::RotateHalf, d, d, 10_000.0).unwrap();
        let (k, v) = rows(21, tokens, shape.kv_channels(), &rope);
        let layer =
            ShardLayer::build("shard-k2-g4".parse().unwrap(), &k, &v, tokens, 4900, &rope).unwrap();
        let (dk, dv) = layer.dequantize().unwrap();
        let positions = [4999, 4950, 3000, 2047, 2048, 300];
        let mut queries = uniform(5, positions.len() * shape.q_len(), 1.0);
        for (row, &p) in queries.chunks_exact_mut(shape.q_len()).zip(&positions) {
            rope.apply(row, p).unwrap();
        }
        let attention = Attention::new(shape);
        for mask in [Mask::Causal, Mask::SlidingWindow(700)] {
            let got = layer
                .attend(&attention, &queries, &positions, &mask)
                .unwrap();
            let want = oracle(&queries, &positions, &dk, &dv, tokens, &shape, &mask);
            let (out, lse) = error_against(&got, &want, &dv);
            assert!(
                out < 1e-5 && lse < 1e-5,
                "{q_heads}/{kv_heads} {mask:?}: {out:e} {lse:e}"
            );
        }
    }
}

/// Keys without variance (all zero: RoPE leaves them so exactly) keep no
/// component: the layer builds, attends as its dequantised oracle, and
/// rebuilds those keys as the mean.
#[test]
fn keys_without_variance_keep_no_component_and_still_attend() {
    let (d, tokens, prefill) = (16, 300, 300);
    let shape = HeadShape::new(4, 2, d).unwrap();
    let rope = Rope::new(RopeLayout::RotateHalf, d, d, 10_000.0).unwrap();
    let ch = shape.kv_channels();
    let k = vec![0.0f32; tokens * ch];
    let v = uniform(4, tokens * ch, 1.0);
    let layer = ShardLayer::build(
        "shard-k2-g4+win32".parse().unwrap(),
        &k,
        &v,
        tokens,
        prefill,
        &rope,
    )
    .unwrap();
    assert_eq!(layer.keys().unwrap().kept(), 0);
    let (dk, dv) = layer.dequantize().unwrap();
    assert_eq!(dk, k);
    let positions: Vec<usize> = (0..tokens).collect();
    let mut q = uniform(5, tokens * shape.q_len(), 1.0);
    for (p, row) in q.chunks_exact_mut(shape.q_len()).enumerate() {
        rope.apply(row, p).unwrap();
    }
    let attention = Attention::new(shape);
    let got = layer
        .attend(&attention, &q, &positions, &Mask::Causal)
        .unwrap();
    let want = oracle(&q, &positions, &dk, &dv, tokens, &shape, &Mask::Causal);
    let (out, lse) = error_against(&got, &want, &dv);
    assert!(out < 1e-5 && lse < 1e-5, "{out:e} {lse:e}");
}
