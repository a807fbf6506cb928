//! Shared helpers of the integration tests: seeded inputs and the
//! comparison against the f64 oracle.

#![allow(dead_code, unreachable_pub)]

use attention::{AttentionOutput, HeadShape, Mask, ReferenceOutput, reference_attention};
use rand_chacha::ChaCha8Rng;
use rand_core::{Rng, SeedableRng};

/// `n` values uniform in `[-amp, amp)` from `seed`.
pub fn uniform(seed: u64, n: usize, amp: f32) -> Vec<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..n)
        .map(|_| {
            let u = (rng.next_u32() >> 8) as f32 / (1u32 << 24) as f32;
            (2.0 * u - 1.0) * amp
        })
        .collect()
}

/// Largest absolute difference from the oracle's output, divided by the
/// largest |value| in the cache (the output is a convex combination of
/// values, so this is the error relative to its scale), and the largest
/// log-sum-exp difference.
pub fn error_against(got: &AttentionOutput, want: &ReferenceOutput, values: &[f32]) -> (f64, f64) {
    let vmax = values
        .iter()
        .fold(0.0f64, |m, v| m.max(f64::from(v.abs())))
        .max(1e-30);
    let out = got
        .out
        .iter()
        .zip(&want.out)
        .map(|(&a, &b)| (f64::from(a) - b).abs())
        .fold(0.0, f64::max)
        / vmax;
    let lse = got
        .lse
        .iter()
        .zip(&want.lse)
        .map(|(&a, &b)| {
            if a == f32::NEG_INFINITY && b == f64::NEG_INFINITY {
                0.0
            } else {
                (f64::from(a) - b).abs() / b.abs().max(1.0)
            }
        })
        .fold(0.0, f64::max);
    (out, lse)
}

/// The oracle for a call.
pub fn oracle(
    q: &[f32],
    positions: &[usize],
    k: &[f32],
    v: &[f32],
    tokens: usize,
    shape: &HeadShape,
    mask: &Mask<'_>,
) -> ReferenceOutput {
    reference_attention(q, positions, k, v, tokens, shape, mask).expect("valid oracle call")
}

/// `tokens` rows of `channels` values with structure a low-rank basis can
/// mostly hold (a smooth function of channel and token) plus seeded noise
/// of amplitude `noise`: the K/V rows of the stored-part tests.
pub fn structured_rows(tokens: usize, channels: usize, seed: u64, noise: f32) -> Vec<f32> {
    (0..tokens * channels)
        .map(|i| {
            let x = (i as u64 ^ seed).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40;
            let c = (i % channels) as f32;
            (c * 0.37 + (i / channels) as f32 * 0.11).sin()
                + noise * ((x as f32 / (1u64 << 24) as f32) - 0.5)
        })
        .collect()
}

/// Rows `start..start + count` of the sequence on `pages` as `part`'s tile,
/// for parts whose tiles are rebuilt f32 rows.
pub fn f32_tile(
    part: &dyn attention::stored::StoredPart,
    pages: &[u32],
    start: usize,
    count: usize,
) -> Vec<f32> {
    let mut scratch = attention::stored::PartScratch::default();
    let tile = part.read_tile(pages, start, count, &mut scratch).unwrap();
    tile.rows.to_f32_vec()
}

/// Writes `x` into `pages` of `part` a row at a time, as a cache writes
/// tokens, and seals the blocks the rows complete (at their positions).
pub fn write_and_seal(part: &mut dyn attention::stored::StoredPart, pages: &[u32], x: &[f32]) {
    let (bs, ch) = (part.block_size(), part.channels());
    let tokens = x.len() / ch;
    let mut encoder = part.row_encoder().unwrap();
    let mut buf = kv_quant::RowBuffers::new(encoder.buffer_sizes(1));
    for &p in pages {
        part.open_block(p as usize).unwrap();
    }
    let options = kv_quant::QuantizeOptions::default();
    for t in 0..tokens {
        encoder
            .encode_into(&x[t * ch..][..ch], buf.as_mut(), options)
            .unwrap();
        part.put_row(pages[t / bs] as usize, t % bs, &buf).unwrap();
    }
    for i in part.sealable(0, tokens) {
        assert!(part.seal(pages[i] as usize, i * bs).unwrap());
    }
}

/// `x` (rows of `channels` values) as an exact f16 store reads it back.
pub fn f16_rows(x: &[f32], channels: usize) -> Vec<f32> {
    let fp16: kv_quant::CacheForm = "fp16".parse().unwrap();
    kv_quant::KvStore::quantize(fp16, x, x.len() / channels, channels)
        .unwrap()
        .decode()
        .unwrap()
        .values
}

/// Per-head bases of `rank` fitted on `rows` (`tokens × heads·head_dim`),
/// stored as f16: the calibrated tables of a `pca-*` form.
pub fn fitted_bases(
    rows: &[f32],
    heads: usize,
    head_dim: usize,
    rank: usize,
) -> std::sync::Arc<kv_lowrank::HeadBases> {
    use kv_lowrank::{Basis, BasisStorage, HeadBases};
    let channels = heads * head_dim;
    let tokens = rows.len() / channels;
    let heads = (0..heads)
        .map(|h| {
            let head: Vec<f32> = rows
                .chunks_exact(channels)
                .flat_map(|r| r[h * head_dim..][..head_dim].to_vec())
                .collect();
            let rule = kv_quant::RankRule::Fixed(rank);
            let (b, _) = Basis::fit(&head, tokens, head_dim, rule, BasisStorage::F16).unwrap();
            std::sync::Arc::new(b)
        })
        .collect();
    std::sync::Arc::new(HeadBases { heads })
}

/// Keys before RoPE (`tokens × channels`, heads of `rope`'s) with
/// fixed-sign, larger channels (as keys' outlier channels are), and the
/// same rotated to their positions `0..tokens`.
pub fn pre_rope_keys(
    rope: &attention::Rope,
    tokens: usize,
    channels: usize,
    seed: u64,
) -> (Vec<f32>, Vec<f32>) {
    let d = rope.head_dim();
    let mut pre = structured_rows(tokens, channels, seed, 0.1);
    for row in pre.chunks_exact_mut(channels) {
        row[3] += 4.0;
        row[d + 5] -= 3.0;
    }
    let mut post = pre.clone();
    for (t, row) in post.chunks_exact_mut(channels).enumerate() {
        rope.apply(row, t).unwrap();
    }
    (pre, post)
}

/// The pair codebook of `form` (a `cq-d2-…-pre` form) fitted on 512 keys
/// of [`pre_rope_keys`] in pair order, with the RoPE.
pub fn pair_fitted(
    form: &kv_quant::CacheForm,
    rope: &attention::Rope,
    channels: usize,
) -> attention::stored::Fitted {
    let (mut pre, _) = pre_rope_keys(rope, 512, channels, 99);
    rope.to_pair_order(&mut pre, &mut Vec::new());
    let options = kv_quant::FitOptions::default();
    let cb = kv_quant::VqCodebook::fit(form, &pre, 512, channels, options).unwrap();
    attention::stored::Fitted {
        codebook: Some(std::sync::Arc::new(cb)),
        rope: Some(rope.clone()),
        ..Default::default()
    }
}
