use super::*;
use proptest::prelude::*;

#[test]
fn issue_spellings_parse_and_print_back() {
    for s in [
        "fp32",
        "fp16",
        "bf16",
        "fp8-e4m3",
        "fp8-e5m2-h64",
        "fp8-e4m3-tok",
        "fp8-e5m2-h64-tok",
        "int8",
        "int4",
        "int4-g64",
        "int4-sym-ch",
        "int2-ch32-sf32",
        "int3-t",
        "nf4",
        "nf4-g32",
        "int4+hamming74",
        "int4+secded84",
        "int4+secded84+interp",
        "int4+secded84+interp4",
        "int4-g64+golay24+zero+meta-none",
        "nf4+secded84",
        // Part two: rotations, codebooks, segments, every code on every width.
        "int4+rot",
        "int4-g32+rot128",
        "nf4+rot",
        "lm4",
        "lm3+qjl",
        "lm8-sf32+rot128",
        "vq",
        "vq-d2-k16",
        "vq+rot128",
        "cq",
        "cq-d2-k16",
        "cq-d1-k4+sink4+secded84",
        "cq-d2-k16-g64",
        "int4-ch32+win32",
        "int4+sink4+win64",
        "lm4+sink4",
        "int8+secded84",
        "int2+golay24+interp",
        "int3+hamming74",
        "fp8-e4m3-tok+secded84",
        "fp16+secded84",
        "lm4+secded84+interp",
        "vq+golay24",
        "int4+rot+sink4+win64+secded84+interp",
        // Low-rank forms (stored by kv-lowrank).
        "pca-r32",
        "pca-r16-c8",
        "pca-e0.99-c4+secded84",
        "pca-e0.999",
        "pca-e1",
        "pca-r32-pre",
        "fd-r16",
        "fd-r16-m48-l256-t0.25-c8",
        // The Shard pipeline (stored by attention's ShardLayer).
        "shard",
        "shard-k0.75-g32-r64-vnf4-s4",
        "shard-soff+sink8+win128",
        "shard-k2+win16",
        "shard-r64-cal",
        "shard+secded84",
        "shard-k3+golay24x8",
        "shard-s3q",
        "shard-s4-f256",
        "shard-k3-soff-f16",
        "shard-s7q-f64",
        // Hierarchical forms (stored by attention's HierarchicalPart).
        "int8h",
        "int8h-g32",
        "int8h-ch+sink4",
        "int8h-sym-ch16-sf32",
        "int8h-ch+sink4+secded84",
    ] {
        let form: CacheForm = s.parse().unwrap_or_else(|e| panic!("{s}: {e}"));
        assert_eq!(form.to_string(), s);
    }
}

/// The metadata code follows the value code unless spelled: SECDED under
/// Hamming, RM(2,5) under SECDED and Golay; a spelled default is dropped
/// and a spelled other code is kept.
#[test]
fn metadata_defaults_follow_the_value_code() {
    for (spelling, metadata, printed) in [
        ("int4+secded84", MetaProtection::ReedMuller, "int4+secded84"),
        ("int4+hamming74", MetaProtection::Secded, "int4+hamming74"),
        (
            "int4+secded84+meta-secded",
            MetaProtection::Secded,
            "int4+secded84+meta-secded",
        ),
        ("int4+golay24", MetaProtection::ReedMuller, "int4+golay24"),
        (
            "int4+golay24x8+interp",
            MetaProtection::ReedMuller,
            "int4+golay24x8+interp",
        ),
        (
            "int4+golay24+meta-rm",
            MetaProtection::ReedMuller,
            "int4+golay24",
        ),
        (
            "int4+golay24+meta-secded",
            MetaProtection::Secded,
            "int4+golay24+meta-secded",
        ),
        (
            "int4+secded84x8+meta-rm",
            MetaProtection::ReedMuller,
            "int4+secded84x8",
        ),
        (
            "int4+hamming74+meta-none",
            MetaProtection::Unprotected,
            "int4+hamming74+meta-none",
        ),
    ] {
        let f: CacheForm = spelling.parse().unwrap();
        assert_eq!(f.protection().unwrap().metadata, metadata, "{spelling}");
        assert_eq!(f.to_string(), printed);
        assert_eq!(printed.parse::<CacheForm>().unwrap(), f);
    }
}

#[test]
fn defaults_are_dropped_when_printing() {
    let f: CacheForm = "int4-asym-sf16+secded84+keep+meta-rm".parse().unwrap();
    assert_eq!(f.to_string(), "int4+secded84");
    assert_eq!("nf4-g64".parse::<CacheForm>().unwrap().to_string(), "nf4");
    let p = f.protection().unwrap();
    assert_eq!(p.policy, ErasurePolicy::Keep);
    assert_eq!(p.metadata, MetaProtection::ReedMuller);
    assert_eq!("lm4+rot64".parse::<CacheForm>().unwrap().to_string(), "lm4");
    assert_eq!(
        "int4+rot64".parse::<CacheForm>().unwrap().to_string(),
        "int4+rot"
    );
    assert_eq!("vq-d4-k256".parse::<CacheForm>().unwrap().to_string(), "vq");
    assert_eq!("cq-d4-k256".parse::<CacheForm>().unwrap().to_string(), "cq");
    // Suffixes in any order print in one.
    let f: CacheForm = "int4+win64+secded84+sink4+rot".parse().unwrap();
    assert_eq!(f.to_string(), "int4+rot+sink4+win64+secded84");
}

#[test]
fn bits_and_blocks_of_the_new_forms() {
    let lm: CacheForm = "lm3+qjl".parse().unwrap();
    assert_eq!(lm.quantizer().code_bits(), 4);
    assert_eq!(lm.rotation(), Some(Rotation { block: 64 }));
    let vq: CacheForm = "vq-d8-k16".parse().unwrap();
    assert_eq!(
        (vq.quantizer().code_bits(), vq.quantizer().values_per_code()),
        (4, 8)
    );
    assert!(vq.quantizer().needs_codebook());
    let kivi: CacheForm = "int4-ch32+win128".parse().unwrap();
    assert_eq!(kivi.token_block(), Some(32));
    assert!(!kivi.is_row_local());
    assert_eq!(
        kivi.segments(),
        Segments {
            sink: 0,
            window: 128
        }
    );
    assert!("lm4".parse::<CacheForm>().unwrap().is_row_local());
    let exact = "int4+rot+sink4+secded84+interp"
        .parse::<CacheForm>()
        .unwrap()
        .exact_rows_form();
    assert_eq!(exact.to_string(), "fp16+secded84+interp");
}

#[test]
fn bad_spellings_are_rejected_with_the_valid_choices() {
    for (s, needle) in [
        ("int5", "unknown base form"),
        ("fp8-e3m4", "unknown FP8 format"),
        ("int4+interp", "needs a code"),
        ("int4+meta-none", "needs a code"),
        ("int4+secded84+golay24", "more than one code"),
        ("int4+secded84+zero+interp", "more than one erasure policy"),
        ("int4-g64-ch", "more than one granularity"),
        ("int4-g0", "at least 1"),
        ("int4-g64-g32", "given twice"),
        ("int4-sym-asym", "given twice"),
        ("nf4-sym", "unknown NF4 option"),
        ("fp32-g4", "takes no options"),
        ("int4+secded84+interp0", "at least 1"),
        ("int4+foo", "unknown suffix"),
        ("", "unknown base form"),
        // Contradictions of part two.
        ("fp16+rot", "stores the values as they are"),
        ("bf16+rot64", "stores the values as they are"),
        ("int4+rot48", "not a power of two"),
        ("int4+rot8192", "not a power of two"),
        ("int4+rot+rot", "more than one rotation"),
        ("int4+qjl", "not int4"),
        ("lm0", "at least 1"),
        ("lm9", "not supported"),
        ("lm4-g32", "unknown Lloyd-Max option"),
        ("lm8+qjl", "lm1 to lm7"),
        ("vq-d3", "not supported"),
        ("vq-k100", "not supported"),
        ("vq-k512", "not supported"),
        ("vq-d8+rot4", "do not divide"),
        ("fp16+sink4", "keeps every token"),
        ("fp32+win64", "keeps every token"),
        ("int4+sink0", "at least 1"),
        ("int4+win0", "at least 1"),
        ("int4+sink4+sink8", "more than one +sink"),
        ("pca", "one of -r<R>"),
        ("pca-r8-e0.9", "one of -r<R>"),
        ("pca-r0", "at least 1"),
        ("pca-e1.5", "not in (0, 1]"),
        ("pca-e0", "not a positive number"),
        ("fd", "needs -r<R>"),
        ("fd-r16-m20", "below twice the rank"),
        ("fd-r16-l0", "at least 1"),
        ("pca-r8-m16", "unknown pca option"),
        ("pca-r8+rot", "no +rot"),
        ("fd-r8+sink4", "no +rot, +sink"),
        ("shard-k9", "cannot be met"),
        ("shard-k0", "not a positive number"),
        ("shard-g6", "multiple of 4"),
        ("shard-r40", "multiple of the group"),
        ("shard-s9", "1 to 8"),
        ("shard-s300", "1 to 8"),
        ("shard-s8q", "-s1q to -s7q"),
        ("shard-sq", "unknown shard option"),
        ("shard-s0q", "-s1q to -s7q"),
        ("shard-s4-s3q", "given twice"),
        ("shard-s3q-s4", "given twice"),
        ("shard-soff-s4", "given twice"),
        ("shard-f8", "16 to 65536"),
        ("shard-f100000", "16 to 65536"),
        ("shard-f0", "at least 1"),
        ("shard-x", "unknown shard option"),
        ("shard+rot", "no +rot"),
        ("shard+secded84+interp", "+keep"),
        ("shard+golay24+zero", "+keep"),
    ] {
        let e = s.parse::<CacheForm>().unwrap_err().to_string();
        assert!(e.contains(needle), "{s}: {e}");
        assert!(e.contains("valid forms: BASE"), "{s}: {e}");
    }
}

#[test]
fn long_spellings_are_cut_in_errors() {
    let long = format!("int4+{}", "x".repeat(100_000));
    let e = long.parse::<CacheForm>().unwrap_err().to_string();
    assert!(e.len() < 3_000, "{} bytes", e.len());
    assert!(e.contains("100005 bytes"), "{e}");
}

fn forms() -> impl Strategy<Value = CacheForm> {
    let scale = prop_oneof![Just(ScaleType::F16), Just(ScaleType::F32)];
    let granularity = prop_oneof![
        proptest::option::of(1usize..300).prop_map(|group| Granularity::PerToken { group }),
        proptest::option::of(1usize..300).prop_map(|tokens| Granularity::PerChannel { tokens }),
        Just(Granularity::PerTensor),
    ];
    let int = (
        prop_oneof![Just(2u8), Just(3), Just(4), Just(8)],
        any::<bool>(),
        granularity,
        scale.clone(),
    )
        .prop_map(|(bits, symmetric, granularity, scale)| {
            Quantizer::Int(IntSpec {
                bits,
                symmetric,
                granularity,
                scale,
            })
        });
    let quantizer = prop_oneof![
        Just(Quantizer::Fp32),
        Just(Quantizer::Fp16),
        Just(Quantizer::Bf16),
        (
            any::<bool>(),
            proptest::option::of(1usize..300),
            any::<bool>()
        )
            .prop_map(|(e4, head_dim, per_token)| {
                Quantizer::Fp8(Fp8Spec {
                    format: if e4 { Fp8Format::E4M3 } else { Fp8Format::E5M2 },
                    head_dim,
                    per_token,
                })
            }),
        int,
        (1usize..300, scale.clone())
            .prop_map(|(group, scale)| Quantizer::Nf4(Nf4Spec { group, scale })),
        (1u8..=8, any::<bool>(), scale.clone())
            .prop_map(|(bits, qjl, scale)| Quantizer::LloydMax(LloydMaxSpec { bits, qjl, scale })),
        (
            0u32..4,
            1u32..=8,
            scale,
            any::<bool>(),
            0usize..4,
            any::<bool>()
        )
            .prop_map(|(d, k, scale, coupled, g, pre)| {
                Quantizer::Vq(VqSpec {
                    dim: 1 << d,
                    centroids: 1 << k,
                    scale,
                    coupled,
                    gain_block: (coupled && g > 0).then_some(g << (d + 2)),
                    pre_rope: pre && coupled && d == 1,
                })
            }),
        (
            prop_oneof![
                (1usize..200).prop_map(|r| LowRankMethod::Pca(RankRule::Fixed(r))),
                (1u32..=1_000_000).prop_map(|e| LowRankMethod::Pca(RankRule::Energy(e))),
                (1usize..64, 0usize..64, 1usize..600, 1u32..2_000_000).prop_map(
                    |(rank, extra, chunk, threshold)| LowRankMethod::Fd {
                        rank,
                        sketch: 2 * rank + extra,
                        chunk,
                        threshold
                    }
                ),
            ],
            prop_oneof![
                Just(CoeffCode::F16),
                Just(CoeffCode::Int8),
                Just(CoeffCode::Int4)
            ],
            any::<bool>(),
        )
            .prop_map(
                |(method, coeffs, pre_rope)| Quantizer::LowRank(LowRankSpec {
                    method,
                    coeffs,
                    pre_rope
                })
            ),
    ];
    let policy = prop_oneof![
        Just(ErasurePolicy::Keep),
        Just(ErasurePolicy::Zero),
        (1u32..64).prop_map(|reach| ErasurePolicy::Interpolate { reach }),
    ];
    let protection = proptest::option::of((0usize..3, policy, any::<bool>()).prop_map(
        |(c, policy, meta)| Protection {
            code: Int4Code::ALL[c],
            policy,
            metadata: if meta {
                MetaProtection::Secded
            } else {
                MetaProtection::Unprotected
            },
        },
    ));
    let rotation = proptest::option::of((1u32..12).prop_map(|b| Rotation { block: 1 << b }));
    let segments = (0usize..3, 0usize..3).prop_map(|(s, w)| Segments {
        sink: s * 4,
        window: w * 32,
    });
    (quantizer, rotation, segments, protection)
        .prop_filter_map("valid forms only", |(q, r, s, p)| {
            CacheForm::build(q, r, s, p).ok()
        })
}

proptest! {
    #[test]
    fn every_form_round_trips(form in forms()) {
        let text = form.to_string();
        prop_assert_eq!(text.parse::<CacheForm>().unwrap(), form);
    }

    /// No input makes the parser panic, and every error quotes the grammar.
    #[test]
    fn arbitrary_text_never_panics(text in "[a-z0-9+\\-]{0,40}") {
        if let Err(e) = text.parse::<CacheForm>() {
            prop_assert!(e.to_string().contains("valid forms"));
        }
    }
}

#[test]
fn shard_defaults_are_the_blogs() {
    let form: CacheForm = "shard".parse().unwrap();
    let Quantizer::Shard(spec) = *form.quantizer() else {
        panic!("{form:?}")
    };
    assert_eq!(spec, ShardSpec::default());
    assert_eq!((form.segments().sink, form.segments().window), (4, 64));
    assert_eq!(spec.stream, Some(8));
    assert_eq!((spec.stream_qjl, spec.fold), (false, None));
    assert!(!form.is_row_local());
    let Quantizer::Shard(qjl) = *"shard-s3q-f128".parse::<CacheForm>().unwrap().quantizer() else {
        panic!("not shard")
    };
    assert_eq!(
        (qjl.stream, qjl.stream_qjl, qjl.fold),
        (Some(3), true, Some(128))
    );
    let other: CacheForm = "shard-k0.5+sink4+win64".parse().unwrap();
    assert_eq!(other.to_string(), "shard-k0.5");
}

/// `int8h` is two 4-bit planes of the `int4` form of the same options: the
/// upper keeps the segments, the residual does not; both carry the
/// protection. Options that cannot be kept in blocks or that would rotate
/// one plane's coordinates are refused.
#[test]
fn hierarchical_forms_split_into_two_int4_planes() {
    let f: CacheForm = "int8h-ch+sink4+secded84".parse().unwrap();
    let (upper, residual) = f.planes().unwrap();
    assert_eq!(upper.to_string(), "int4-ch+sink4+secded84");
    assert_eq!(residual.to_string(), "int4-ch+secded84");
    assert_eq!(f.quantizer().code_bits(), 8);
    assert!(f.quantizer().is_hierarchical() && !f.is_row_local());
    let (upper, residual) = "int8h-g32".parse::<CacheForm>().unwrap().planes().unwrap();
    assert_eq!(
        (upper, residual),
        ("int4-g32".parse().unwrap(), "int4-g32".parse().unwrap())
    );
    assert_eq!("int4-g32".parse::<CacheForm>().unwrap().planes(), None);
    for (bad, why) in [
        ("int8h-t", "one scale per tensor"),
        ("int8h+rot", "+rot"),
        ("int8h-g0", "at least 1"),
        ("int8h-x", "unknown integer option"),
    ] {
        let e = bad.parse::<CacheForm>().unwrap_err().to_string();
        assert!(e.contains(why), "{bad}: {e}");
    }
    let e = BlockPlan::new(f, 16).unwrap_err().to_string();
    assert!(e.contains("HierarchicalPart"), "{e}");
}

/// `+out<P>`: a percentage with at most two decimals in (0, 20], printed
/// in its shortest form, on integer forms with groups only; the dense
/// form is the same spelling without it.
#[test]
fn outlier_shares_parse_print_and_refuse() {
    for (text, printed, bp) in [
        ("int2-ch+out1", "int2-ch+out1", 100),
        ("int3-ch+sink4+out0.5", "int3-ch+sink4+out0.5", 50),
        ("int4+out0.05+secded84", "int4+out0.05+secded84", 5),
        ("int2-ch64+out20", "int2-ch64+out20", 2000),
        ("int2-g32+out1.50", "int2-g32+out1.5", 150),
        ("int2-ch+clip+out1+sink4", "int2-ch+sink4+out1+clip", 100),
        ("int2-ch+pre+out1+clip", "int2-ch+out1+clip+pre", 100),
    ] {
        let f: CacheForm = text.parse().unwrap();
        assert_eq!(f.to_string(), printed);
        assert_eq!(f.sparse().unwrap().basis_points(), bp);
        assert_eq!(printed.parse::<CacheForm>().unwrap(), f);
        assert!(!f.is_row_local() && f.row_unit().is_none());
        assert_eq!(f.without_sparse().sparse(), None);
        assert_eq!(f.exact_rows_form().sparse(), None);
    }
    let f: CacheForm = "int2-ch+out1".parse().unwrap();
    assert_eq!(f.sparse().unwrap().count(12_288), 123);
    assert_eq!(f.sparse().unwrap().fraction(), 0.01);
    for (bad, why) in [
        ("int2-ch+out0", "(0, 20]"),
        ("int2-ch+out20.01", "(0, 20]"),
        ("int2-ch+out25", "(0, 20]"),
        ("int2-ch+out0.001", "two"),
        ("int2-ch+out", "percentage"),
        ("int2-ch+out-1", "percentage"),
        ("int2-ch+out1+out2", "more than one"),
        ("int2-t+out1", "one scale per tensor"),
        ("lm2+out1", "integer"),
        ("fp16+out1", "integer"),
        ("int8h-ch+out1", "integer"),
        ("int4+rot+out1", "+rot"),
        ("int4-ch32+win32+out1", "+win"),
        ("int2-ch+clip", "+out<P>+clip"),
        ("int2-ch+pre", "+out<P>+pre"),
        ("int2-ch+out1+pre+pre", "more than one +pre"),
        ("int2-ch-sym+out1+clip", "asymmetric"),
        ("int2-ch+out1+clip+clip", "more than one +clip"),
    ] {
        let e = bad.parse::<CacheForm>().unwrap_err().to_string();
        assert!(e.contains(why), "{bad}: {e}");
    }
    let e = BlockPlan::new(f, 16).unwrap_err().to_string();
    assert!(e.contains("SparsePart"), "{e}");
    assert!(f.with_sparse(None).unwrap().sparse().is_none());
    let clipped: CacheForm = "int2-ch+out1+clip".parse().unwrap();
    assert!(clipped.sparse().unwrap().clip() && !f.sparse().unwrap().clip());
    assert_ne!(clipped, f);
    let pre: CacheForm = "int2-ch+out1+pre".parse().unwrap();
    assert!(pre.sparse().unwrap().pre_rope() && !clipped.sparse().unwrap().pre_rope());
    assert!(SparseSpec::new(0).is_err() && SparseSpec::new(2001).is_err());
}
