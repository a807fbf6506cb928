//! Attention over keys coded before RoPE on pair codebooks, scored against
//! the codebook (`TileRows::PairCodes`): within f32 rounding of the f64
//! oracle over the same keys, under every numerics; the same bits on every
//! instruction set with FMA; codebooks of 8 to 64 centroids (64: past the
//! AVX-512 register lookup), both pair layouts, tiles ending mid-vector.

mod common;

use attention::stored::open_window;
use attention::{
    Attention, AttentionConfig, DenseKv, HeadShape, Isa, KvSource, Mask, Numerics, Rope,
    RopeLayout, TileRows, reference_attention,
};
use kv_quant::CacheForm;

fn decode(
    shape: HeadShape,
    isa: Isa,
    numerics: Numerics,
    (k, v): (&impl KvSource, &DenseKv<'_>),
    q: &[f32],
) -> Vec<f32> {
    let config = AttentionConfig {
        isa,
        ..AttentionConfig::default()
    };
    let mut attn = Attention::with_config(shape, config).unwrap();
    attn.set_numerics(numerics);
    attn.decode(q, k.tokens() - 1, k, v, &Mask::Causal)
        .unwrap()
        .out
}

#[test]
fn codebook_scores_are_the_oracles_over_the_same_keys() {
    let tokens = 300;
    let available = Isa::available();
    for (spelling, layout, shape) in [
        ("cq-d2-k16-pre", RopeLayout::RotateHalf, (9, 3, 64)),
        ("cq-d2-k16-pre", RopeLayout::Adjacent, (4, 2, 16)),
        ("cq-d2-k8-pre", RopeLayout::RotateHalf, (4, 2, 32)),
        ("cq-d2-k32-pre-g32", RopeLayout::Adjacent, (8, 2, 64)),
        ("cq-d2-k64-pre", RopeLayout::RotateHalf, (4, 2, 32)),
    ] {
        let shape = HeadShape::new(shape.0, shape.1, shape.2).unwrap();
        let (d, ch) = (shape.head_dim(), shape.kv_channels());
        let rope = Rope::new(layout, d, d, 10_000.0).unwrap();
        let form: CacheForm = spelling.parse().unwrap();
        let fitted = common::pair_fitted(&form, &rope, ch);
        let (_, x) = common::pre_rope_keys(&rope, tokens, ch, 5);
        let window = open_window(form, &fitted, &x, (tokens, ch, d), Some(&rope)).unwrap();
        let source = window.source();
        let mut scratch = Default::default();
        let tile = source.read_tile(0, tokens, &mut scratch).unwrap();
        assert!(matches!(tile.rows, TileRows::PairCodes(_)), "{spelling}");
        // The keys as the codes describe them, rotated in f32.
        let k = tile.rows.to_f32_vec();
        let v = common::structured_rows(tokens, ch, 6, 1.0);
        let values = DenseKv::new(&v, tokens, ch).unwrap();
        let q: Vec<f32> = common::structured_rows(1, shape.q_len(), 7, 0.5);
        let oracle =
            reference_attention(&q, &[tokens - 1], &k, &v, tokens, &shape, &Mask::Causal).unwrap();
        let largest = v.iter().fold(0f32, |m, x| m.max(x.abs()));
        let mut fma: Option<(Isa, Vec<u32>)> = None;
        for &isa in &available {
            for numerics in [Numerics::Auto, Numerics::Exact, Numerics::Int8Query] {
                let out = decode(shape, isa, numerics, (&source, &values), &q);
                let ctx = format!("{spelling} {layout:?} {isa} {numerics:?}");
                for (a, b) in out.iter().zip(&oracle.out) {
                    let err = (f64::from(*a) - b).abs();
                    assert!(err <= 1e-5 * f64::from(largest), "{ctx}: {a} vs {b}");
                }
                if isa == Isa::Scalar {
                    continue;
                }
                let bits: Vec<u32> = out.iter().map(|x| x.to_bits()).collect();
                match &fma {
                    None => fma = Some((isa, bits)),
                    Some((first, want)) => assert_eq!(&bits, want, "{ctx} against {first}"),
                }
            }
        }
    }
}

/// Prefill reads a tile of pair codes that several queries share widened
/// once (each query would otherwise make its own table for it), and a
/// query alone against the codebook: both within f32 rounding of the
/// oracle over the same keys, causal masks cutting tiles included.
#[test]
fn prefill_over_pair_codes_is_the_oracles() {
    let shape = HeadShape::new(9, 3, 64).unwrap();
    let (d, ch, tokens) = (64, 192, 700);
    let rope = Rope::new(RopeLayout::Adjacent, d, d, 100_000.0).unwrap();
    let form: CacheForm = "cq-d2-k16-pre".parse().unwrap();
    let fitted = common::pair_fitted(&form, &rope, ch);
    let (_, x) = common::pre_rope_keys(&rope, tokens, ch, 5);
    let window = open_window(form, &fitted, &x, (tokens, ch, d), Some(&rope)).unwrap();
    let source = window.source();
    let mut scratch = Default::default();
    let k = source
        .read_tile(0, tokens, &mut scratch)
        .unwrap()
        .rows
        .to_f32_vec();
    let v = common::structured_rows(tokens, ch, 6, 1.0);
    let values = DenseKv::new(&v, tokens, ch).unwrap();
    let largest = v.iter().fold(0f32, |m, x| m.max(x.abs()));
    for positions in [
        vec![tokens - 1],
        (100..164).collect(),
        (tokens - 40..tokens).collect(),
    ] {
        let q = common::structured_rows(positions.len(), shape.q_len(), 7, 3.0);
        let oracle =
            reference_attention(&q, &positions, &k, &v, tokens, &shape, &Mask::Causal).unwrap();
        let attn = Attention::new(shape);
        let got = attn
            .prefill(&q, &positions, &source, &values, &Mask::Causal)
            .unwrap();
        for (a, b) in got.out.iter().zip(&oracle.out) {
            let err = (f64::from(*a) - b).abs();
            assert!(
                err <= 1e-5 * f64::from(largest),
                "{} queries: {a} vs {b}",
                positions.len()
            );
        }
    }
}
