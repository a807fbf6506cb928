//! The instruction set pinned through [`AttentionConfig::isa`]: every set
//! this CPU supports decodes every kind of stored form; the vector sets
//! (AVX2, AVX-512, AVX-512 VNNI) give the same bits, the scalar one agrees
//! to rounding (it does not fuse multiply-adds); a set this CPU lacks is
//! refused before any work.

mod common;

use attention::{Attention, AttentionConfig, AttentionOutput, HeadShape, Isa, Mask, Numerics};
use common::uniform;
use kv_quant::KvStore;

const TOKENS: usize = 300;

/// One decode of `form` on `isa` under `numerics`.
fn decode(isa: Isa, numerics: Numerics, form: &str, shape: HeadShape) -> AttentionOutput {
    let config = AttentionConfig {
        isa,
        numerics,
        tile_tokens: 64,
        split_tokens: 128,
        ..AttentionConfig::default()
    };
    let attn = Attention::with_config(shape, config).unwrap();
    assert_eq!(attn.config().isa, isa);
    let ch = shape.kv_channels();
    let store = |seed: u64| {
        let rows = uniform(seed, TOKENS * ch, 1.0);
        KvStore::quantize(form.parse().unwrap(), &rows, TOKENS, ch).unwrap()
    };
    let (k, v) = (store(1), store(2));
    let q = uniform(3, shape.q_len(), 1.0);
    attn.decode(&q, TOKENS - 1, &k, &v, &Mask::Causal).unwrap()
}

fn bits(out: &AttentionOutput) -> Vec<u32> {
    out.out.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn every_supported_set_decodes_alike() {
    let available = Isa::available();
    if available.len() == 1 {
        test_support::skip(
            test_support::Requirement::Isa,
            "attention",
            "every_supported_set_decodes_alike",
            "only the scalar kernels run on this CPU: nothing to compare",
        );
        return;
    }
    // Float rows, integer levels read by the int8 paths (per token and
    // per channel), a Lloyd-Max codebook, a protected form.
    let forms = ["fp16", "int4", "int4-ch32", "int8", "lm4", "int4+secded84"];
    if available.len() == 2 {
        test_support::skip(
            test_support::Requirement::Isa,
            "attention",
            "every_supported_set_decodes_alike",
            "one vector set on this CPU: its bits were compared with no other vector set",
        );
    }
    // Heads of 40 channels (not a multiple of 16): the last chunk of each
    // head is partial, and groups of 32 channels start inside heads.
    let tail_forms = ["fp16", "int4-g32", "int4-ch32", "int8", "nf4-g1"];
    let cases = [
        (HeadShape::new(8, 2, 128).unwrap(), &forms[..]),
        (HeadShape::new(9, 3, 64).unwrap(), &forms[..]),
        (HeadShape::new(8, 4, 40).unwrap(), &tail_forms[..]),
    ];
    for (shape, forms) in cases {
        for &form in forms {
            for numerics in [Numerics::Auto, Numerics::Exact, Numerics::Int8Query] {
                let scalar = decode(Isa::Scalar, numerics, form, shape);
                let mut vector: Option<(Isa, Vec<u32>)> = None;
                for &isa in &available[1..] {
                    let out = decode(isa, numerics, form, shape);
                    let ctx = format!("{isa} {form} {numerics:?} {shape:?}");
                    assert_eq!(out.stats, scalar.stats, "{ctx}: statistics");
                    for (a, b) in out.out.iter().zip(&scalar.out) {
                        assert!((a - b).abs() <= 1e-5 * (1.0 + b.abs()), "{ctx}: {a} vs {b}");
                    }
                    match &vector {
                        None => vector = Some((isa, bits(&out))),
                        Some((first, want)) => {
                            assert_eq!(&bits(&out), want, "{ctx}: bits against {first}")
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn a_set_this_cpu_lacks_is_refused() {
    let shape = HeadShape::new(4, 2, 32).unwrap();
    let lacking: Vec<Isa> = Isa::ALL
        .into_iter()
        .filter(|isa| !isa.is_supported())
        .collect();
    // The scalar set always runs, and is accepted both ways.
    let mut attn = Attention::with_config(
        shape,
        AttentionConfig {
            isa: Isa::Scalar,
            ..AttentionConfig::default()
        },
    )
    .unwrap();
    assert_eq!(AttentionConfig::default().isa, Isa::detect());
    attn.set_isa(Isa::detect()).unwrap();
    if lacking.is_empty() {
        test_support::skip(
            test_support::Requirement::Isa,
            "attention",
            "a_set_this_cpu_lacks_is_refused",
            "this CPU runs every set: no refusal to see",
        );
        return;
    }
    for isa in lacking {
        let config = AttentionConfig {
            isa,
            ..AttentionConfig::default()
        };
        let err = Attention::with_config(shape, config).unwrap_err();
        assert!(err.to_string().contains(isa.name()), "{err}");
        assert!(attn.set_isa(isa).is_err());
        assert_eq!(attn.config().isa, Isa::detect(), "unchanged by a refusal");
    }
}
